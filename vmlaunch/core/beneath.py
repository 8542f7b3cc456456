"""Files made beneath a folder's descriptor, never through what stands in it: how a tar stream from a
guest becomes files on the host, and how that copy is merged into a folder that already holds things.

Why not `tarfile.extractall(filter="data")`: the filter decides on path names (`os.path.realpath` of
each member's destination, made before the member is written), so its soundness rests on the names it
resolves matching what the kernel later follows. Python's own filter had escapes of exactly that kind
(CVE-2025-4517 and its siblings: a chain of symlinks past PATH_MAX), fixed only in later 3.11 and 3.12
releases, and vmlaunch supports Pythons without the filter at all. Here every file, folder and link is
made with `*at` calls relative to an open descriptor, each component opened with `O_NOFOLLOW`, each
file created with `O_CREAT | O_EXCL`: the kernel, not a name check, refuses to pass through a link, so
no order, type or name of members can reach outside the folder, whatever runs the copy (root
included). Links the stream makes are resolved afterwards, in the finished tree, the way the kernel
would: one that leads outside the copy (by `..`, an absolute target or a chain of links) fails the copy.

Nothing is chowned: files belong to whoever extracts. Modes keep their permission bits only (no setuid,
setgid or sticky bit), and folders stay at least `u+rwx` so the copy can be finished and removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tarfile
from collections.abc import Iterator
from typing import IO

MAX_MEMBERS = 1_000_000  # members one stream may hold
MAX_HEADER = 1 << 20  # bytes of one header (a long name, a pax record): tarfile reads them whole
MAX_DEPTH = 1024  # folders deep
LINK_HOPS = 40  # links followed while resolving one link, as the kernel's ELOOP bound
CHUNK = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """What a stream or a merge would have done outside its folder, or cannot do safely; the message
    is one line naming the member."""


class _BoundedReads:
    """A file object whose single reads are bounded: tarfile reads a pax header or a GNU long name
    whole, so a stream could otherwise make it read gigabytes into memory at once."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > max(MAX_HEADER, CHUNK):
            raise Refused(f"a header of the stream is larger than {MAX_HEADER} bytes")
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


def parts_of(name: str, top: str) -> list[str]:
    """The components of a member's name, which must lie under `top`: no absolute name, no `..`, no
    NUL, no component longer than a file name may be."""
    if "\0" in name:
        raise Refused(f"{name!r}: a name holding a NUL")
    if name.startswith("/"):
        raise Refused(f"{name!r}: an absolute name")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise Refused(f"{name!r}: a name climbing with ..")
    if not parts or parts[0] != top:
        raise Refused(f"{name!r}: outside {top}")
    if len(parts) > MAX_DEPTH:
        raise Refused(f"{name[:80]!r}...: more than {MAX_DEPTH} folders deep")
    for part in parts:
        if len(os.fsencode(part)) > 255:
            raise Refused(f"{name[:80]!r}...: a name longer than 255 bytes")
    return parts


@contextlib.contextmanager
def opened_dir(root: int, parts: list[str], *, make: bool = False) -> Iterator[int]:
    """A descriptor of the folder `parts` beneath `root`, each component opened without following a
    link (a link or a file on the way is refused); missing folders are made when `make`."""
    fd = os.dup(root)
    try:
        for i, part in enumerate(parts):
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise Refused(f"{'/'.join(parts[:i + 1])}: no such folder in the copy") from None
                os.mkdir(part, 0o700, dir_fd=fd)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(f"{'/'.join(parts[:i + 1])} is not a folder (a link or a file): "
                                  "nothing is written through it") from None
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _clear(name: str, dir_fd: int, member: str, kind: str) -> None:
    """Make room for a member of `kind` at `name`: a file or link there (an earlier member of the same
    name) is unlinked, never opened; a folder stays only for a folder."""
    st = _lstat(name, dir_fd)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        if kind != "dir":
            raise Refused(f"{member}: sent again as a {kind}, where the stream made a folder")
        return
    os.unlink(name, dir_fd=dir_fd)


def extract(stream: IO[bytes], root: int, top: str) -> None:
    """Unpack the tar stream `stream` beneath the folder open as `root` (empty, and vmlaunch's own),
    every member under `top`. Regular files, folders, symbolic and hard links only. Refused (and the
    caller removes what was made) when the stream holds anything else or reaches outside."""
    folders: list[tuple[list[str], int, float]] = []
    links: list[list[str]] = []
    try:
        tar = tarfile.open(fileobj=_BoundedReads(stream), mode="r:")  # type: ignore[call-overload]  # noqa: SIM115
    except tarfile.TarError as exc:
        raise Refused(f"not a tar stream: {exc}") from None
    with tar:
        count = 0
        while True:
            try:
                member = tar.next()
            except tarfile.TarError as exc:
                raise Refused(f"a broken tar stream: {exc}") from None
            if member is None:
                break
            tar.members.clear()  # kept by tarfile for lookups this never makes; memory stays flat
            count += 1
            if count > MAX_MEMBERS:
                raise Refused(f"more than {MAX_MEMBERS} members")
            _member(tar, member, root, top, folders, links)
    for parts in links:
        _check_link(root, parts, top)
    for parts, mode, mtime in reversed(folders):  # deepest last made, first closed
        with opened_dir(root, parts) as fd:
            os.chmod(fd, (mode & 0o777) | 0o700)
            with contextlib.suppress(OSError):
                os.utime(fd, (mtime, mtime))


def _member(tar: tarfile.TarFile, member: tarfile.TarInfo, root: int, top: str,
            folders: list[tuple[list[str], int, float]], links: list[list[str]]) -> None:
    name = member.name
    parts = parts_of(name, top)
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        what = "a FIFO" if member.isfifo() else "a device node" if member.isdev() else "not a file"
        raise Refused(f"{name}: {what}; a copy brings files, folders and links only")
    with opened_dir(root, parts[:-1], make=True) as parent:
        leaf = parts[-1]
        if member.isdir():
            _clear(leaf, parent, name, "dir")
            if _lstat(leaf, parent) is None:
                os.mkdir(leaf, 0o700, dir_fd=parent)
            folders.append((parts, member.mode, member.mtime))
        elif member.issym():
            _clear(leaf, parent, name, "link")
            if "\0" in member.linkname or not member.linkname:
                raise Refused(f"{name}: a link to {member.linkname!r}")
            os.symlink(member.linkname, leaf, dir_fd=parent)
            links.append(parts)
        elif member.islnk():
            _hard_link(member, parent, leaf, root, top)
        else:
            _clear(leaf, parent, name, "file")
            _write(tar, member, parent, leaf)


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, leaf: str) -> None:
    fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=parent)
    with os.fdopen(fd, "wb") as out:
        data = tar.extractfile(member)
        if data is not None:
            left = member.size
            while left > 0:
                chunk = data.read(min(CHUNK, left))
                if not chunk:
                    raise Refused(f"{member.name}: the stream ends inside it")
                out.write(chunk)
                left -= len(chunk)
        out.flush()
        os.chmod(out.fileno(), member.mode & 0o777)
        with contextlib.suppress(OSError):
            os.utime(out.fileno(), (member.mtime, member.mtime))


def _hard_link(member: tarfile.TarInfo, parent: int, leaf: str, root: int, top: str) -> None:
    """A hard link to a regular file the stream made before; never to a link, a folder or anything
    outside the copy (the target is opened component by component as any name is)."""
    target = parts_of(member.linkname, top)
    with opened_dir(root, target[:-1]) as where:
        st = _lstat(target[-1], where)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise Refused(f"{member.name}: a hard link to {member.linkname}, which is not a file of the copy")
        _clear(leaf, parent, member.name, "hard link")
        os.link(target[-1], leaf, src_dir_fd=where, dst_dir_fd=parent, follow_symlinks=False)


def _check_link(root: int, parts: list[str], top: str) -> None:
    """Resolve the link at `parts` as the kernel would, in the finished copy; Refused when it leads
    (through `..`, an absolute target or other links) anywhere outside `top`."""
    where = parts[:-1]
    with opened_dir(root, where) as fd:
        pending = os.readlink(parts[-1], dir_fd=fd).split("/")
    name = "/".join(parts)
    if pending[0] == "":
        raise Refused(f"{name}: a link to an absolute path, outside the copy")
    hops = 0
    real = len(where)  # how much of `where` is a folder that exists (beyond it, names are only names)
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if len(where) <= 1:
                raise Refused(f"{name}: a link leading outside the copy")
            where = where[:-1]
            real = min(real, len(where))
            continue
        if not where:
            raise Refused(f"{name}: a link leading outside the copy")
        if real == len(where):  # a folder that exists: what stands in it decides, links followed
            with opened_dir(root, where) as fd:
                st = _lstat(part, fd)
                target = os.readlink(part, dir_fd=fd) if st is not None and stat.S_ISLNK(st.st_mode) else None
            if target is not None:
                hops += 1
                if hops > LINK_HOPS or target.startswith("/"):
                    raise Refused(f"{name}: a link leading outside the copy (or in a loop)")
                pending = target.split("/") + pending
                continue
            if st is not None and stat.S_ISDIR(st.st_mode):
                real += 1
        # a name that does not exist (yet): taken as a name, and a `..` after it comes back to a folder
        # that exists, whose links are followed again (what a later file of that name would make of it)
        where = [*where, part]


def merge(src_parent: int, name: str, dst_parent: int, dst_name: str, shown: str) -> None:
    """Put the copy `name` (beneath `src_parent`, vmlaunch's own staging) at `dst_name` beneath
    `dst_parent`, as `cp -r` would: a folder into a folder there, entry by entry; anything else renamed
    into place, replacing a file or link that stands there (the link itself, never what it names). What
    already stands in the destination is never followed: a link where a folder would go is refused.
    Every conflict is found before anything is moved, so a refused merge changes nothing."""
    _merge(src_parent, name, dst_parent, dst_name, shown, move=False)
    _merge(src_parent, name, dst_parent, dst_name, shown, move=True)


def _merge(src_parent: int, name: str, dst_parent: int, dst_name: str, shown: str, *, move: bool) -> None:
    st = _lstat(name, src_parent)
    there = _lstat(dst_name, dst_parent)
    if st is None:
        raise Refused(f"the copy holds no {name}")
    if there is None or not stat.S_ISDIR(st.st_mode):
        if there is not None and stat.S_ISDIR(there.st_mode):
            raise Refused(f"{shown} is a folder: cannot put a file there")
        if move:
            os.rename(name, dst_name, src_dir_fd=src_parent, dst_dir_fd=dst_parent)
        return
    if not stat.S_ISDIR(there.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(there.st_mode) else "not a folder"
        raise Refused(f"{shown} is {kind}: a copy never writes through it; remove it or copy elsewhere")
    with opened_dir(src_parent, [name]) as src, opened_dir(dst_parent, [dst_name]) as dst:
        for entry in sorted(os.listdir(src)):
            _merge(src, entry, dst, entry, f"{shown}/{entry}", move=move)
