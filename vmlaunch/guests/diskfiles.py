"""Disk files are the user's files, opened as the user meant: the checks `up` makes on each one.

The rule (the manual: Safety, "Disk files"). vmlaunch resolves a disk's path itself, one component at a time,
and refuses it, naming the disk's key and spec line, when

1. it follows a symlink the kernel's `protected_symlinks` would refuse (one in a sticky
   world-writable folder, owned neither by you nor by the folder's owner), whatever the sysctl says;
2. someone other than you or root could change what it names (a folder on the way that another user
   owns or may write to, an entry of a sticky folder that another user owns) or owns the file
   itself, unless the disk says `accept_other_owner = true`;
3. it is not a regular file (a block device needs `block_device = true`; character devices, FIFOs,
   sockets and folders are always refused);
4. it is missing and the disk has no `size` to create it with.

"You" is the effective user: run as root (sudo included), a file of the user who ran sudo is
another user's. The check runs before anything changes (preflight), again when the image resource
is applied, and once more after QEMU has opened the files, paused, before any guest runs: QEMU must
hold exactly the file the path names now, so a swap between check and use stops the VM.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat
from collections.abc import Iterable
from pathlib import Path

import attrs

from vmlaunch.core.sourcemap import SourceMap
from vmlaunch.errors import HostError, KeyPath, Location, format_key_path

MAX_SYMLINKS = 40  # as the kernel's path walk


class DiskFileRefused(HostError):
    """A disk file vmlaunch will not let QEMU open; the message names the disk's key and line."""


class Unsafe(Exception):
    """One reason a path is refused; `opt_in` names the disk key that would accept it, if any."""

    def __init__(self, message: str, opt_in: str | None = None, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.plain_fix = fix  # without the opt-in: what a file that has none (a script) can do
        self.fix = fix or (f"add {opt_in} = true to the disk if that is meant" if opt_in else None)


@attrs.frozen
class DiskOrigin:
    """Where a disk is in the spec: its file, its key path (`vm.web.disk[0]`) and the source map
    that finds the line (scanned only when a message needs it)."""

    spec: Path
    key_path: KeyPath
    source: SourceMap | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def name(self) -> str:
        return format_key_path(self.key_path)

    def location(self, key: str = "file") -> Location:
        path = (*self.key_path, key)
        return Location(self.spec, self.source.line_of(path) if self.source else 1, path)


@attrs.frozen
class Found:
    """What a disk's path names now: the path with no symlink left, and its stat (None: missing)."""

    path: Path
    stat: os.stat_result | None

    @property
    def identity(self) -> tuple[int, int] | None:
        return None if self.stat is None else (self.stat.st_dev, self.stat.st_ino)

    @property
    def block_device(self) -> bool:
        return self.stat is not None and stat.S_ISBLK(self.stat.st_mode)


@attrs.frozen
class Policy:
    """What a disk accepts: its opt-ins, and who "you" are (the effective uid)."""

    block_device: bool = False
    accept_other_owner: bool = False
    uid: int = attrs.field(factory=os.geteuid)

    def trusted(self, uid: int) -> bool:
        return uid in (0, self.uid)


def check(path: Path, policy: Policy, *, creating: bool) -> Found:
    """Resolve `path` under the rule; raise Unsafe with the first reason it is refused.

    `creating`: the disk has a size, so a missing file is fine (its folder is checked instead).
    """
    found = resolve(path, policy)
    if found.stat is None:
        if not creating:
            raise Unsafe(f"{path} does not exist", fix="give the disk a size to have up create it")
        return found
    mode = found.stat.st_mode
    if stat.S_ISBLK(mode) and not policy.block_device:
        raise Unsafe(f"{_named(path, found)} is a block device", "block_device")
    if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
        raise Unsafe(f"{_named(path, found)} is {_kind(mode)}, not a disk image or block device")
    check_owner(path, found, policy)
    return found


def resolve(path: Path, policy: Policy) -> Found:
    """What `path` names, walked under rules 1 and 2 for every folder on the way (Unsafe if not)."""
    try:
        return _walk(path, policy)
    except OSError as exc:
        raise Unsafe(f"cannot resolve {path}: {exc.strerror or exc}") from None


def check_owner(path: Path, found: Found, policy: Policy) -> None:
    """Rule 2 for the file itself: yours or root's, and no other user may write to it."""
    assert found.stat is not None
    if not policy.trusted(found.stat.st_uid) and not policy.accept_other_owner:
        raise Unsafe(f"{_named(path, found)} belongs to {_user(found.stat.st_uid)}, not to "
                     f"{_user(policy.uid)}", "accept_other_owner")
    if _others_may_write(found.stat, policy) and not policy.accept_other_owner:
        raise Unsafe(f"{_named(path, found)} may be written by other users (mode "
                     f"{stat.S_IMODE(found.stat.st_mode):04o})", "accept_other_owner",
                     fix=f"chmod go-w {path}")


def _walk(path: Path, policy: Policy) -> Found:
    """The path walk, one component at a time with lstat, as the kernel would follow it."""
    if not path.is_absolute():
        raise Unsafe(f"{path} is not an absolute path")
    folder, folder_st = Path("/"), os.lstat("/")
    todo = list(path.parts[1:])
    links = 0
    while todo:
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":  # `folder` holds no symlink, so its parent is the real one
            folder = folder.parent
            folder_st = os.lstat(folder)
            continue
        entry = folder / name
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            if todo:
                raise Unsafe(f"{entry} does not exist (on the way to {path})") from None
            _changeable(folder, folder_st, None, policy)
            return Found(entry, None)
        except OSError as exc:
            raise Unsafe(f"cannot look at {entry}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):  # first: no opt-in accepts what the kernel would refuse
            _protected(folder, folder_st, entry, st, policy)
        _changeable(folder, folder_st, st, policy, entry)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_SYMLINKS:
                raise Unsafe(f"{path}: too many levels of symlinks")
            target = Path(os.readlink(entry))
            if target.is_absolute():
                folder, folder_st = Path("/"), os.lstat("/")
            todo = [*target.parts[1 if target.is_absolute() else 0:], *todo]
            continue
        if todo and not stat.S_ISDIR(st.st_mode):
            raise Unsafe(f"{entry} is not a folder (on the way to {path})")
        folder, folder_st = entry, st
    return Found(folder, folder_st)


def _protected(folder: Path, folder_st: os.stat_result, link: Path, link_st: os.stat_result,
               policy: Policy) -> None:
    """fs.protected_symlinks: in a sticky world-writable folder, follow a symlink only when the
    follower owns it or the folder's owner does. Checked here too: the sysctl may be off."""
    if not (folder_st.st_mode & stat.S_ISVTX and folder_st.st_mode & stat.S_IWOTH):
        return
    if link_st.st_uid in (policy.uid, folder_st.st_uid):
        return
    raise Unsafe(f"{link} is a symlink owned by {_user(link_st.st_uid)} in the sticky world-writable "
                 f"folder {folder}: the kernel's protected_symlinks rule refuses to follow it")


def _changeable(folder: Path, folder_st: os.stat_result, entry_st: os.stat_result | None,
                policy: Policy, entry: Path | None = None) -> None:
    """Refuse a folder whose entry (or the entry to be created) another user could replace."""
    if policy.accept_other_owner:
        return
    what = f"{entry}" if entry is not None else f"a file created in {folder}"
    if not policy.trusted(folder_st.st_uid):
        raise Unsafe(f"{what} can be replaced by {_user(folder_st.st_uid)}, who owns {folder}",
                     "accept_other_owner")
    if not _others_may_write(folder_st, policy):
        return
    if folder_st.st_mode & stat.S_ISVTX:  # sticky: only an entry's owner may rename or remove it
        if entry_st is None or policy.trusted(entry_st.st_uid):
            return
        raise Unsafe(f"{what} belongs to {_user(entry_st.st_uid)} in the sticky shared folder "
                     f"{folder}", "accept_other_owner")
    raise Unsafe(f"{what} can be replaced by other users: {folder} is writable by "
                 f"{'everyone' if folder_st.st_mode & stat.S_IWOTH else 'its group'}", "accept_other_owner")


def _others_may_write(st: os.stat_result, policy: Policy) -> bool:
    if st.st_mode & stat.S_IWOTH:
        return True
    return bool(st.st_mode & stat.S_IWGRP) and not _group_of_trusted(st.st_gid, policy.uid)


@functools.lru_cache(maxsize=32)
def _group_of_trusted(gid: int, uid: int) -> bool:
    """Whether every member of the group is you or root (a user-private group, `root`, ...)."""
    trusted = {0, uid}
    try:
        members = {pwd.getpwnam(name).pw_uid for name in grp.getgrgid(gid).gr_mem}
    except KeyError:
        return False
    members |= {user.pw_uid for user in pwd.getpwall() if user.pw_gid == gid}
    return members <= trusted


def _named(path: Path, found: Found) -> str:
    return str(path) if found.path == path else f"{path} (that is {found.path})"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


@functools.lru_cache(maxsize=32)
def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def refusal(origin: DiskOrigin | None, path: Path, problem: Unsafe) -> str:
    """`lab.toml:14: vm.web.disk[0].file: ...`, with the opt-in that would accept it."""
    where = f"{origin.location()} " if origin is not None else ""
    return f"{where}{problem.message}" + (f" ({problem.fix})" if problem.fix else "")


def refuse(problems: Iterable[str]) -> DiskFileRefused:
    lines = list(problems)
    return DiskFileRefused("\n".join(lines) if len(lines) > 1 else lines[0],
                           "vmlaunch opens only disk files you own, by a path no other user can "
                           "change (the manual: Safety, Disk files)")


def opened_by(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of every file a process holds open; the process must be one of ours."""
    fd_dir = Path(f"/proc/{pid}/fd")
    held = set()
    for fd in os.listdir(fd_dir):
        try:
            st = os.stat(fd_dir / fd)
        except FileNotFoundError:  # closed meanwhile
            continue
        held.add((st.st_dev, st.st_ino))
    return held
