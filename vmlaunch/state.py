"""A lab's run dir: its lock and its state file, the journal of what `up` did.

Every host change is written to the state file as soon as it is made (atomically: a temp file
renamed over the old one), so `down` can undo it from another process even when the `up` that made it
was killed half-way. The lock serialises `up` and `down` of one lab; it lives beside the run dir
(`.LAB.lock`), because `down` removes the run dir while holding it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vmlaunch.errors import RuntimeFailure

STATE_VERSION = 1


class LabBusy(RuntimeFailure):
    """Another vmlaunch holds the lab's lock for longer than we were willing to wait."""


@contextlib.contextmanager
def locked(run_dir: Path, timeout: float, on_wait: Any | None = None) -> Iterator[None]:
    """Hold the lab's lock; wait up to `timeout` seconds for another `up`/`down` to finish.

    The lock file goes away with the lab: when the run dir is gone at the end, the holder removes it.
    A waiter that then gets the lock on the removed file notices (the path names another inode, or
    none) and locks anew, so two processes never both hold the lab.
    """
    run_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock_path = run_dir.parent / f".{run_dir.name}.lock"
    deadline = time.monotonic() + timeout
    told = False
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        if _try_lock(fd) and _same_file(fd, lock_path):
            break
        os.close(fd)
        if time.monotonic() >= deadline:
            raise LabBusy(f"lab {run_dir.name} is busy: another vmlaunch up or down holds "
                          f"{lock_path}", "wait for it to finish, or raise --timeout")
        if not told and on_wait is not None:
            on_wait(f"waiting for another vmlaunch on lab {run_dir.name}")
            told = True
        time.sleep(0.1)
    try:
        yield
    finally:
        if not run_dir.exists():
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _well_formed(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    resources, vms = data.get("resources", []), data.get("vms", {})
    return (isinstance(resources, list) and isinstance(vms, dict)
            and all(isinstance(r, dict) and {"kind", "key", "record"} <= set(r)
                    and isinstance(r["record"], dict) for r in resources)
            and all(isinstance(v, dict) and isinstance(v.get("pid"), (int, type(None)))
                    and isinstance(v.get("started", 0), (int, float)) for v in vms.values()))


class State:
    """The state file: resources applied (in order) and VMs started, saved on every change."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "state.json"
        self.resources: list[dict[str, Any]] = []
        self.vms: dict[str, dict[str, Any]] = {}
        self.spec: str | None = None

    @classmethod
    def load(cls, run_dir: Path) -> State:
        state = cls(run_dir)
        try:
            data = json.loads(state.path.read_text())
        except FileNotFoundError:
            return state
        except (OSError, ValueError) as exc:
            raise RuntimeFailure(f"cannot read the lab's state file {state.path}: {exc}",
                                 "it was not written by this vmlaunch; remove the run dir by hand"
                                 ) from None
        if not _well_formed(data):
            raise RuntimeFailure(f"the lab's state file {state.path} is not one vmlaunch wrote",
                                 "stop its QEMUs by hand and remove the run dir")
        state.resources = list(data["resources"])
        state.vms = dict(data["vms"])
        state.spec = data.get("spec")
        return state

    @property
    def empty(self) -> bool:
        return not self.resources and not self.vms

    def save(self) -> None:
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = {"version": STATE_VERSION, "spec": self.spec, "resources": self.resources,
                "vms": self.vms}
        tmp = self.path.with_name(f".state.{os.getpid()}.tmp")
        with open(tmp, "w") as out:
            json.dump(data, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)

    def add_resource(self, record: dict[str, Any]) -> None:
        self.resources.append(record)
        self.save()

    def drop_resource(self, record: dict[str, Any]) -> None:
        with contextlib.suppress(ValueError):
            self.resources.remove(record)
        self.save()

    def has_resource(self, kind: str, key: str) -> bool:
        return any(r["kind"] == kind and r["key"] == key for r in self.resources)
