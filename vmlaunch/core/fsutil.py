"""Writing files so that a crash leaves the old content or the new one, never half of either; and the
one rule for a file a user or a guest names: what stands at the name is looked at before it is read or
written, and anything but a regular file (a FIFO, a device, a folder, a symlink where none may be) is
refused, as is a file larger than its kind may be (`Unfit`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


class Unfit(OSError):
    """What stands at a name vmlaunch was to read or write is not a regular file, or is too large.
    An OSError, so that code already saying "cannot read X: {strerror}" says why in one line."""

    def __init__(self, path: Path | str, what: str) -> None:
        super().__init__(errno.EINVAL, what, str(path))
        self.path = Path(path)
        self.what = what

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def kind_of(mode: int) -> str:
    """What a file of `st_mode` `mode` is, as a sentence says it: "a FIFO", "a folder", ..."""
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _refuse_unless_regular(path: Path | str, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise Unfit(path, f"it is {kind_of(info.st_mode)}, not a regular file")


def read_bounded(path: Path, limit: int, *, follow: bool = True) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them. Unfit when it is anything else
    (looked at before it is opened, so a device is never opened, and again on what was opened:
    non-blocking, so a FIFO swapped in between cannot hang us) or larger than `limit`; OSError when
    it cannot be read. `follow`: a symlink at `path` is followed (a spec a user named may be one);
    without it, one is refused."""
    info = os.stat(path) if follow else os.lstat(path)
    _refuse_unless_regular(path, info)
    _refuse_larger(path, info.st_size, limit)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise Unfit(path, "it is a symlink, not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        _refuse_unless_regular(path, info)
        _refuse_larger(path, info.st_size, limit)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    _refuse_larger(path, size, limit)  # it grew while we read it
    return b"".join(chunks)


def _refuse_larger(path: Path | str, size: int, limit: int) -> None:
    if size > limit:
        raise Unfit(path, f"it is too large: {size} bytes, at most {limit}")


def check_new_target(path: Path | str, *, dir_fd: int | None = None) -> None:
    """Unfit unless what stands at `path` (not followed) is a regular file or nothing: what a file
    vmlaunch makes for a user may replace."""
    try:
        info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    _refuse_unless_regular(path, info)


def write_new(path: Path, data: bytes | str, mode: int = 0o644, *, durable: bool = True) -> None:
    """Write a file a user named (`--out`, a screenshot, evidence): made new, a temp file beside it
    renamed over it, after checking that what stands at `path` is a regular file or nothing (Unfit
    for a FIFO, a device, a folder, a symlink: never written through, never replaced)."""
    check_new_target(path)
    write_atomic(path, data, mode, durable=durable)


def write_new_at(dir_fd: int, name: str, data: bytes | str, mode: int = 0o644) -> None:
    """`write_new` of `name` in the folder open as `dir_fd` (a folder opened without following links:
    evidence writes beneath its folder this way, whatever entries stand in it)."""
    check_new_target(name, dir_fd=dir_fd)
    _replace_at(dir_fd, name, data, mode, durable=False)


def open_folder_at(dir_fd: int | None, name: str | Path, *, make: bool = False, follow: bool = False) -> int:
    """A descriptor of the folder `name` (in `dir_fd`, or as a path when None), made first with
    `make`; never through a symlink unless `follow` (Unfit when one, or anything but a folder,
    stands there)."""
    if make:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=dir_fd)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        raise Unfit(name, f"it is {kind_of(info.st_mode)}, not a folder") from None


def write_atomic(path: Path, data: bytes | str, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace `path` with `data`: a temp file in the same folder, fsync'd, renamed over it.

    `durable` also fsyncs the folder, so the rename itself survives a power cut; caches that can be
    rebuilt pass False.
    """
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _replace_at(folder, path.name, data, mode, durable=durable)
    finally:
        os.close(folder)


def _replace_at(dir_fd: int, name: str, data: bytes | str, mode: int, *, durable: bool) -> None:
    """`name` in the folder `dir_fd` replaced by a temp file made new beside it (a temp a killed
    process left is removed first, never written through) and renamed over it."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = temp_of(Path(name)).name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable:
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)


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
