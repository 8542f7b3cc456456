"""Writing files so that a crash leaves the old content or the new one, never half of either."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace `path` with `data`: a temp file in the same folder, fsync'd, renamed over it.

    `durable` also fsyncs the folder, so the rename itself survives a power cut; caches that can be
    rebuilt pass False.
    """
    raw = data.encode() if isinstance(data, str) else data
    tmp = temp_of(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def temp_of(path: Path) -> Path:
    """The temp file beside `path` that `path` is written in before it is renamed into place: hidden,
    and named for this process (`is_temp_of` knows the shape)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def is_temp_of(name: str, target: str) -> bool:
    """Whether `name` is a temp file (`temp_of`) of `target` that a process killed half-way leaves."""
    middle = name[len(target) + 2:-4] if name.startswith(f".{target}.") and name.endswith(".tmp") else ""
    return middle.isdigit()


def fsync_dir(folder: Path) -> None:
    """Make renames and creations in `folder` survive a power cut (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def try_lock(fd: int) -> bool:
    """An exclusive flock on `fd` if nobody holds one, without waiting."""
    import errno
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def lock_if_current(fd: int, path: Path) -> int | None:
    """`fd`, now holding an exclusive flock, when nobody else held one and `path` still names it (see
    `same_file`); otherwise None, and `fd` is closed (also when the lock raises)."""
    try:
        if try_lock(fd) and same_file(fd, path):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`: a lock file its holder removed and another
    process made anew is not the one locked."""
    try:
        return os.lstat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
