"""Files in the run root that every lab shares: the bridge registry (`bridges.json`) and the KSM claims
(`ksm.json`). Each records which labs use a host-wide thing, so that the last lab to leave it, and only
that one, puts it back.

Each file is read and replaced (atomically, `fsutil.write_atomic`) only under the flock of a lock file
beside it; both are the owner's alone (0600) and never followed through a symlink, and both are
removed when the file records nothing any more. Lock order: a lab's own lock, then such a file's; the
locks of other labs are only ever tried, never waited for (`lab_in_use`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vmlaunch.core.fsutil import lock_if_current, try_lock
from vmlaunch.core.wait import TimedOut, wait_until
from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.dirs import run_root, secure_dir
from vmlaunch.layout.rundir import RunDir

LOCK_TIMEOUT = 30.0
LAB_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?")  # what a claim may name (core/naming.py's rule)


class RegistryError(RuntimeFailure):
    """A host-wide file cannot be read or locked."""


@contextlib.contextmanager
def locked(file: str, lock: str, what: str, root: Path | None = None,
           timeout: float = LOCK_TIMEOUT) -> Iterator[Path]:
    """Hold the lock of the host-wide `file` in the run root for the block; yields the run root.

    When the block leaves no `file`, the lock file goes too, so a run root without labs is empty; a
    waiter that then gets the lock on the removed file notices (the path names another inode, or none)
    and locks anew.
    """
    root = run_root() if root is None else root
    secure_dir(root, top=root, create=True)
    lock_path = root / lock

    def take() -> int | None:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            try:  # a read-only run root: the lock is there, and flock needs no write access
                fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                raise RegistryError(f"cannot open the {what}'s lock {lock_path}: "
                                    f"{exc.strerror or exc}") from exc
        try:
            check_owner(fd, lock_path)
        except BaseException:
            os.close(fd)
            raise
        return lock_if_current(fd, lock_path)

    try:
        fd = wait_until(take, timeout)
    except TimedOut:
        raise RegistryError(f"the {what} is busy: another vmlaunch holds {lock_path}",
                            "wait for it to finish") from None
    try:
        yield root
    finally:
        if not (root / file).exists():
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
        os.close(fd)


def read_owned(path: Path) -> bytes | None:
    """The file's bytes, None when there is none. Raises OSError (a link, unreadable) and
    RegistryError (another user's, or writable by others: it decides what vmlaunch undoes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as file:
        check_owner(file.fileno(), path)
        return file.read()


def read_document(path: Path, version: int | tuple[int, ...],
                  damaged: Callable[[str], RegistryError]) -> dict[str, Any] | None:
    """The file's JSON object, None when there is none; `damaged(problem)` is raised for one that cannot
    be read, is not JSON, or is not of `version` (or one of those)."""
    try:
        raw = read_owned(path)
    except OSError as exc:
        raise damaged(exc.strerror or str(exc)) from exc
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise damaged(str(exc)) from exc
    versions = version if isinstance(version, tuple) else (version,)
    if not isinstance(doc, dict) or type(doc.get("version")) is not int or doc["version"] not in versions:
        raise damaged(f"not a version {' or '.join(map(str, versions))} file")
    return doc


def check_owner(fd: int, path: Path) -> None:
    """Refuse a file another user could have written."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RegistryError(f"{path} is not a file of this user's alone; refusing to use it",
                            f"remove it if you trust nothing in {path.parent}")


def lab_in_use(root: Path, lab: str) -> bool:
    """Whether a lab may still use what it claimed: it has a journal, or an `up`/`down` of it runs.
    A lab with neither is gone (its run dir was removed, or a killed `up` never journaled anything):
    its claims are stale and dropped, so they never keep a host-wide thing in place."""
    run_dir = RunDir.of(root, lab)
    if run_dir.state.exists():
        return True
    try:
        fd = os.open(run_dir.lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: nothing of that lab runs
    try:
        if not try_lock(fd):
            return True  # an up or down of it runs (it may not have journaled yet)
        return run_dir.state.exists()  # it may have finished just now
    finally:
        os.close(fd)
