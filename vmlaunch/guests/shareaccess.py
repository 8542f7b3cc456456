"""A share's folder as a VM's own uid may use it while the lab runs, and handed back after.

A root-run lab runs each VM's QEMU as a uid and gid of its own (`-runas`); QEMU's 9p server then
touches the share's files as that uid. `grant` gives it access with POSIX ACL entries before QEMU
starts; `hand_back` takes every trace of it away again at `down` (after a failed `up`, and by the
next command after a crash): the files the VM made are given to the folder's owner, and every ACL
entry naming the VM's uid is removed. `check_xattrs` says whether a writable share can work at all:
QEMU keeps what the guest sets (owner, mode, file type) in `user.virtfs.*` extended attributes
(security_model=mapped-xattr, `compiler.shares`), and a guest's every create fails without them.

How the tree is walked, so that nobody can redirect it (a host user who may write in the folder,
racing; a guest that made the files):
- from a descriptor of the folder, each entry opened relative to its folder's descriptor with
  O_NOFOLLOW (O_PATH for what is not a folder), checked with fstat on that descriptor and changed
  through it: a symlink is never followed, a name renamed meanwhile changes nothing outside;
- never into another mount (a folder or file mounted inside the share has another mount id);
- `grant` never changes a file with more than one hard link: a host user could have linked
  /etc/shadow into the folder, and an ACL entry on it would hand that file to the guest.
  `hand_back` only removes what names the VM's uid and gives back what the VM's uid owns, so it
  undoes them on any file (a guest may hard-link its own files inside the share).

The ACLs are written as their xattrs (`system.posix_acl_access`, `system.posix_acl_default`), as
the kernel defines them (include/uapi/linux/posix_acl_xattr.h): no `acl` package needed. What `grant`
changed of an ACL that was there before (its mask, a default ACL it made, an entry for the owner it
added) is kept in a `trusted.vmlaunch.share.UID` xattr of that inode, which only root can read or set
and QEMU never passes to a guest; `hand_back` restores from it and removes it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.errors import HostError, Location
from vmlaunch.spec.model import LabSpec

ACCESS = "system.posix_acl_access"
DEFAULT = "system.posix_acl_default"
MARK = "trusted.vmlaunch.share."  # + the uid: what its `grant` changed of this inode's ACLs (`_Mark`)
PROBE = "user.vmlaunch.probe"
XATTRS_HINT = ("put the folder on a file system that keeps them (ext4, xfs, btrfs, tmpfs), or give "
               "the share readonly = true (a read-only share needs none)")
MAX_DEPTH = 256  # folders deep; each level holds a descriptor while below it

# include/uapi/linux/posix_acl.h and posix_acl_xattr.h
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
RWX, RW, RX, R = 7, 6, 5, 4
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
_TAGS = (USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER)
_NOT_SUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP)
_NO_ATTR = (errno.ENODATA,)


class ShareAccessError(HostError):
    """The folder cannot be given to a VM's uid at all (exit 3); `hand_back` removes what a grant
    that raised it had done."""


# --- ACLs ----------------------------------------------------------------------------------------


@attrs.frozen
class Entry:
    tag: int
    perm: int
    id: int = UNDEFINED_ID  # a uid for USER, a gid for GROUP; undefined for the others


@attrs.frozen
class Acl:
    """A POSIX ACL: its entries in the kernel's order (by tag, then id)."""

    entries: tuple[Entry, ...]

    @classmethod
    def of(cls, entries: list[Entry]) -> Acl:
        return cls(tuple(sorted(entries, key=lambda e: (e.tag, e.id if e.tag in (USER, GROUP) else 0))))

    @classmethod
    def from_mode(cls, mode: int) -> Acl:
        """The ACL the mode bits give, where a file has no ACL xattr."""
        return cls.of([Entry(USER_OBJ, (mode >> 6) & 7), Entry(GROUP_OBJ, (mode >> 3) & 7),
                       Entry(OTHER, mode & 7)])

    @classmethod
    def decode(cls, data: bytes) -> Acl:
        """An ACL from its xattr; ValueError for what is not one."""
        if len(data) < _HEADER.size or (len(data) - _HEADER.size) % _ENTRY.size:
            raise ValueError(f"an ACL xattr of {len(data)} bytes")
        (version,) = _HEADER.unpack_from(data)
        if version != VERSION:
            raise ValueError(f"ACL version {version}")
        entries = [Entry(tag, perm, id_ if tag in (USER, GROUP) else UNDEFINED_ID)
                   for tag, perm, id_ in _ENTRY.iter_unpack(data[_HEADER.size:])]
        if any(entry.tag not in _TAGS for entry in entries):
            raise ValueError("an ACL entry of an unknown tag")
        return cls.of(entries)

    def encode(self) -> bytes:
        return _HEADER.pack(VERSION) + b"".join(_ENTRY.pack(e.tag, e.perm, e.id) for e in self.entries)

    def get(self, tag: int, id_: int = UNDEFINED_ID) -> Entry | None:
        return next((e for e in self.entries if e.tag == tag and e.id == id_), None)

    def perm(self, tag: int, id_: int = UNDEFINED_ID) -> int | None:
        entry = self.get(tag, id_)
        return None if entry is None else entry.perm

    def named(self, uid: int) -> bool:
        return self.get(USER, uid) is not None

    def with_user(self, uid: int, perm: int) -> Acl:
        """This ACL with `u:uid:perm` (replacing one there), its mask the union of the group class
        (as `setfacl -m` sets it)."""
        rest = [e for e in self.entries if not (e.tag == USER and e.id == uid) and e.tag != MASK]
        rest.append(Entry(USER, perm, uid))
        return Acl.of([*rest, Entry(MASK, _union(rest))])

    def without_users(self, uids: Iterable[int], mask: int | None = None) -> Acl:
        """This ACL without the entries of `uids`. Its mask `mask` where named entries are left, else
        the union of what is left within the mask it has (never more than it allowed). With no named
        entry left, the three entries of the mode bits, the group's reduced to what the mask (`mask`,
        else the one it has) let it have: each keeps what it allowed."""
        drop = set(uids)
        current = self.perm(MASK)
        rest = [e for e in self.entries if not (e.tag == USER and e.id in drop) and e.tag != MASK]
        if all(e.tag in (USER_OBJ, GROUP_OBJ, OTHER) for e in rest):
            within = mask if mask is not None else current
            if within is None:
                return Acl.of(rest)
            return Acl.of([attrs.evolve(e, perm=e.perm & within) if e.tag == GROUP_OBJ else e
                           for e in rest])
        if mask is None:
            mask = _union(rest) & (RWX if current is None else current)
        return Acl.of([*rest, Entry(MASK, mask)])

    def base(self) -> Acl:
        """Its entries of the owner, the group (within the mask) and others: what it would be as mode
        bits alone."""
        mask = self.perm(MASK)
        group = (self.perm(GROUP_OBJ) or 0) & (RWX if mask is None else mask)
        return Acl.of([*(e for e in self.entries if e.tag in (USER_OBJ, OTHER)), Entry(GROUP_OBJ, group)])


def _union(entries: Iterable[Entry]) -> int:
    """The permissions of the group class: what a mask must allow for each entry to have its own."""
    union = 0
    for entry in entries:
        if entry.tag in (USER, GROUP_OBJ, GROUP):
            union |= entry.perm
    return union


# --- what grant changed of an inode -------------------------------------------------------------


@attrs.frozen
class _Mark:
    """Kept in the inode's `trusted.vmlaunch.share.UID` xattr, written before its ACLs change: one
    per VM uid, so that VMs sharing a folder each hand back what their own grant changed."""

    access_mask: int | None = None  # the mask of the access ACL it had
    default_made: bool = False  # it had no default ACL: `grant` made it
    default_mask: int | None = None  # the mask of the default ACL it had
    owner_entry: bool = False  # `grant` added the folder owner's entry to the default ACL

    def encode(self) -> bytes:
        return json.dumps(attrs.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> _Mark:
        try:
            doc = json.loads(data)
            mark = cls(access_mask=_perm_or_none(doc.get("access_mask")),
                       default_made=doc.get("default_made") is True,
                       default_mask=_perm_or_none(doc.get("default_mask")),
                       owner_entry=doc.get("owner_entry") is True)
        except (ValueError, AttributeError, TypeError):
            return cls()  # only root writes it; unreadable, it restores nothing
        return mark


def _perm_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and 0 <= value <= 7 else None


# --- walking a share ----------------------------------------------------------------------------

@attrs.frozen
class Inherited:
    """For `hand_back`: what an inode made while the lab ran got from its folder's default ACL."""

    made: bool = False  # the default ACL was one a grant made
    owner_entry: bool = False  # its entry for the folder's owner was one a grant added
    shared: bool = False  # another VM's grant is still on the folder: take only this uid's entries


NOTHING = Inherited()


@attrs.frozen
class _Node:
    """An inode of the share: a descriptor of it (O_PATH unless a folder), its stat, its path."""

    fd: int
    info: os.stat_result
    path: str
    inherited: Inherited = NOTHING

    @property
    def proc(self) -> str:
        """The inode itself, whatever its name is now: getxattr and chmod through it never follow a
        symlink but this one (not taken for a symlink)."""
        return f"/proc/self/fd/{self.fd}"

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.info.st_mode)


def _open_folder(folder: Path) -> int:
    """The share's folder, as QEMU opens it (its path may hold symlinks, the user's choice)."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _mount_id(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _fs_type(fd: int) -> str:
    """The type of the file system `fd` is on (`ext4`), from /proc/self/mountinfo."""
    mount = _mount_id(fd)
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8",
                                            errors="replace") as table:
        for line in table:
            fields = line.split()
            if fields and fields[0] == str(mount) and "-" in fields:
                return fields[fields.index("-") + 1]
    return "unknown"


Visitor = Callable[[_Node], Inherited]


class _Walk:
    """Every inode of a share on the folder's own mount, parents before children, each visited
    once with a descriptor of it. The visitor returns what the inode's children inherit."""

    def __init__(self, folder: Path, top_fd: int) -> None:
        self.folder = folder
        self.top_fd = top_fd
        self.top = _Node(top_fd, os.fstat(top_fd), str(folder))
        self.mount = _mount_id(top_fd)
        self.problems: list[str] = []  # what could not be done
        self.left: list[str] = []  # what was left alone on purpose

    def run(self, visit: Visitor) -> None:
        # one open folder per level below (not recursion: a guest decides how deep a share is)
        stack: list[tuple[int, str, Iterator[str], Inherited]] = []
        inherited = visit(self.top)
        self._enter(stack, os.dup(self.top_fd), self.top.path, inherited, depth=0)
        while stack:
            dir_fd, path, names, flags = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                os.close(dir_fd)
                continue
            node = self._open(dir_fd, name, f"{path}/{name}", flags)
            if node is None:
                continue
            try:
                inherited = visit(node)
                if node.is_dir:
                    self._enter(stack, os.dup(node.fd), node.path, inherited, depth=len(stack))
            finally:
                os.close(node.fd)

    def _enter(self, stack: list[tuple[int, str, Iterator[str], Inherited]], fd: int, path: str,
               flags: Inherited, *, depth: int) -> None:
        if depth >= MAX_DEPTH:
            self.problems.append(f"{path}: more than {MAX_DEPTH} folders deep: what it holds was left "
                                 "as it is")
            os.close(fd)
            return
        try:
            names = sorted(os.listdir(fd))
        except OSError as exc:
            self.problems.append(f"{path}: cannot list it: {exc.strerror or exc}")
            os.close(fd)
            return
        stack.append((fd, path, iter(names), flags))

    def _open(self, dir_fd: int, name: str, path: str, inherited: Inherited) -> _Node | None:
        """The entry `name` of the folder `dir_fd`, never through a link, only on the share's mount;
        None (said in `problems` or `left`) for what cannot or must not be visited."""
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None  # gone meanwhile
        except OSError as exc:
            self.problems.append(f"{path}: cannot open it: {exc.strerror or exc}")
            return None
        try:
            info = os.fstat(fd)
            if info.st_dev != self.top.info.st_dev or _mount_id(fd) != self.mount:
                self.left.append(f"{path}: another file system is mounted there: left as it is")
                os.close(fd)
                return None
            if stat.S_ISDIR(info.st_mode):  # to list it: the very inode, opened for reading
                folder = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                os.close(fd)
                fd = folder
        except OSError as exc:
            os.close(fd)
            self.problems.append(f"{path}: cannot open it: {exc.strerror or exc}")
            return None
        return _Node(fd, info, path, inherited)


# --- reading and writing an inode's ACLs ----------------------------------------------------------


def _read_acl(node: _Node, name: str) -> Acl | None:
    """The inode's ACL `name`; None where it has none (the mode bits say it all)."""
    try:
        return Acl.decode(os.getxattr(node.proc, name))
    except OSError as exc:
        if exc.errno in _NO_ATTR:
            return None
        raise
    except ValueError as exc:
        raise OSError(errno.EINVAL, f"its {name} cannot be read: {exc}") from None


def _read_mark(node: _Node, uid: int) -> _Mark | None:
    try:
        return _Mark.decode(os.getxattr(node.proc, f"{MARK}{uid}"))
    except OSError as exc:
        if exc.errno in _NO_ATTR:
            return None
        raise


def _write_acl(node: _Node, name: str, acl: Acl | None, was: Acl | None) -> None:
    """Set the inode's ACL `name` to `acl` (None: none) where it differs from what it `was`. An
    access ACL of mode bits alone is set as mode bits: the kernel keeps no xattr for it."""
    if acl == was:
        return
    if acl is None:
        try:
            os.removexattr(node.proc, name)
        except OSError as exc:
            if exc.errno not in _NO_ATTR:
                raise
        return
    os.setxattr(node.proc, name, acl.encode())


def _other_marks(node: _Node, uid: int) -> list[str]:
    """The marks of other VMs' grants on the inode: theirs is still on it."""
    ours = f"{MARK}{uid}"
    return sorted(name for name in os.listxattr(node.proc) if name.startswith(MARK) and name != ours)


def _remove_mark(node: _Node, uid: int) -> None:
    try:
        os.removexattr(node.proc, f"{MARK}{uid}")
    except OSError as exc:
        if exc.errno not in _NO_ATTR:
            raise


# --- the API ------------------------------------------------------------------------------------


def check_xattrs(folder: Path) -> str | None:
    """None when the folder's file system keeps user extended attributes (a `user.vmlaunch.probe`
    set and removed on a temporary file in it), else why not, one sentence. A writable share needs
    them: QEMU keeps what the guest sets of a file there (`up` refuses without: `XATTRS_HINT`)."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".vmlaunch-probe-", dir=folder)
    except OSError as exc:
        return f"cannot create a file in {folder}: {exc.strerror or exc}"
    try:
        os.setxattr(fd, PROBE, b"1")
        os.removexattr(fd, PROBE)
    except OSError as exc:
        if exc.errno in _NOT_SUPPORTED:
            return (f"the file system of {folder} ({_fs_type(fd)}) does not keep user extended "
                    "attributes, where QEMU keeps the owner, mode and type of each file a guest makes")
        return f"cannot set an extended attribute on a file in {folder}: {exc.strerror or exc}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)
    return None


def require_xattrs(lab: LabSpec, vms: Sequence[str] = ()) -> None:
    """ShareAccessError (exit 3), at its line, for the first writable share of the VMs named (or all)
    whose folder's file system keeps no user extended attributes (`check_xattrs`): `up` asks it
    before it changes anything."""
    for vm in lab.vms:
        if vms and vm.name not in vms:
            continue
        for index, share in enumerate(vm.shares):
            why = None if share.readonly else check_xattrs(share.source)
            if why is not None:
                path = ("vm", vm.name, "share", index, "source")
                raise ShareAccessError(why, XATTRS_HINT, Location(lab.file, lab.source.line_of(path), path))


@attrs.frozen
class Grant:
    """What `grant` gave a VM's uid of a share's folder (journaled; `hand_back` takes it back)."""

    folder: Path
    uid: int
    gid: int
    readonly: bool
    owner: int  # the folder's owner and group when granted
    group: int
    folders: int = 0  # folders and files given an entry for the uid
    files: int = 0
    notes: tuple[str, ...] = ()  # what was left as it is, and why (at most NOTES lines)

    def hand_back(self) -> list[str]:
        return hand_back(self.folder, self.uid, self.gid)


NOTES = 20


def grant(folder: Path, uid: int, gid: int, *, readonly: bool) -> Grant:
    """Give the VM's `uid` access to the share at `folder` while the lab runs.

    Every folder gets `u:UID:rwx` and a default entry `u:UID:rwx` (`r-x` for both when `readonly`:
    a file the owner saves meanwhile is readable for the guest), and when writable a default entry
    `u:OWNER:rwx` (OWNER: the folder's owner, unless root): the files a guest creates stay readable,
    editable and removable by the folder's owner while the lab runs. Every regular file with one
    link gets `u:UID:rw-` (`r--`, and nothing for a file anyone may read already). Symlinks,
    devices, FIFOs and sockets get nothing;
    files with other hard links and other mounts are left as they are (said in `notes`, as is a
    file that could not be changed).

    ShareAccessError when the folder cannot be opened, its file system has no POSIX ACLs, or the
    folder itself cannot be given. Interrupted half-way, `hand_back` undoes what was done."""
    try:
        top_fd = _open_folder(folder)
    except OSError as exc:
        raise ShareAccessError(f"cannot open share {folder}: {exc.strerror or exc}") from None
    try:
        _check_folder(top_fd, folder, readonly=readonly)
        _check_acls(top_fd, folder)
        walk = _Walk(folder, top_fd)
        owner = walk.top.info.st_uid
        counts = {"folders": 0, "files": 0}

        def visit(node: _Node) -> Inherited:
            if not node.is_dir and not stat.S_ISREG(node.info.st_mode):
                return NOTHING  # symlinks, devices, FIFOs, sockets: nothing to give
            if readonly and not node.is_dir and node.info.st_mode & stat.S_IROTH:
                return NOTHING  # anyone may read it: so may the VM's uid, as it is (a source tree's files)
            if not node.is_dir and node.info.st_nlink != 1:
                walk.left.append(f"{node.path}: {node.info.st_nlink} hard links: left as it is (the "
                                 "guest cannot use it)")
                return NOTHING
            try:
                _grant_one(node, uid, owner, readonly=readonly)
            except OSError as exc:
                if node is walk.top:
                    raise ShareAccessError(f"cannot give share {folder} to its VM's uid {uid}: "
                                           f"{exc.strerror or exc}") from None
                walk.problems.append(f"{node.path}: not given to uid {uid}: {exc.strerror or exc}")
                return NOTHING
            counts["folders" if node.is_dir else "files"] += 1
            return NOTHING

        walk.run(visit)
    finally:
        os.close(top_fd)
    notes = [*walk.problems, *walk.left]
    if len(notes) > NOTES:
        notes = [*notes[:NOTES - 1], f"and {len(notes) - NOTES + 1} more"]
    return Grant(folder=folder, uid=uid, gid=gid, readonly=readonly, owner=owner,
                 group=walk.top.info.st_gid, folders=counts["folders"], files=counts["files"],
                 notes=tuple(notes))


def _check_folder(fd: int, folder: Path, *, readonly: bool) -> None:
    """ShareAccessError for a folder no share may be (`sharerules.host_refusal`), as opened: a link
    on its path may name another folder than when the spec was checked."""
    from vmlaunch.guests.sharerules import host_refusal

    opened = os.readlink(f"/proc/self/fd/{fd}")
    refused = host_refusal(opened, readonly=readonly)
    if refused is not None:
        raise ShareAccessError(f"cannot give share {folder} to its VM: {opened}, the folder it names "
                               f"now, {refused[0]}", refused[1])


def _check_acls(fd: int, folder: Path) -> None:
    """ShareAccessError when the folder's file system has no POSIX ACLs (or its ACL is unreadable)."""
    try:
        os.getxattr(f"/proc/self/fd/{fd}", ACCESS)
    except OSError as exc:
        if exc.errno in _NOT_SUPPORTED:
            raise ShareAccessError(
                f"cannot give share {folder} to its VM: its file system ({_fs_type(fd)}) has no POSIX "
                "ACLs", "share a folder of a file system with ACLs (ext4, xfs, btrfs, tmpfs) that is "
                "not mounted with noacl") from None
        if exc.errno not in _NO_ATTR:
            raise ShareAccessError(f"cannot read the ACL of share {folder}: {exc.strerror or exc}") from None


def _grant_one(node: _Node, uid: int, owner: int, *, readonly: bool) -> None:
    """Add the uid's entries to one inode; first mark what changes of what it had."""
    access = _read_acl(node, ACCESS)
    default = _read_acl(node, DEFAULT) if node.is_dir else None
    add_owner = (node.is_dir and not readonly and owner not in (0, uid)
                 and (default is None or not default.named(owner)))
    if _read_mark(node, uid) is None:  # else a grant not handed back: its mark holds what was there
        others = _other_marks(node, uid)
        if others:  # another VM's grant is on it: what was there before is in its mark
            mark = attrs.evolve(_Mark.decode(os.getxattr(node.proc, others[0])), owner_entry=add_owner)
        else:
            mark = _Mark(access_mask=None if access is None else access.perm(MASK),
                         default_made=node.is_dir and default is None,
                         default_mask=None if default is None else default.perm(MASK),
                         owner_entry=add_owner)
        os.setxattr(node.proc, f"{MARK}{uid}", mark.encode())
    mode_acl = Acl.from_mode(node.info.st_mode)
    if node.is_dir:  # for what is made in it while the lab runs, by the guest or the owner
        given = (default or (access or mode_acl).base()).with_user(uid, RX if readonly else RWX)
        _write_acl(node, DEFAULT, given.with_user(owner, RWX) if add_owner else given, default)
    perm = (RX if readonly else RWX) if node.is_dir else (R if readonly else RW)
    _write_acl(node, ACCESS, (access or mode_acl).with_user(uid, perm), access)


def hand_back(folder: Path, uid: int, gid: int) -> list[str]:
    """Take a share back from the VM's uid: at `down`, after a failed `up`, by the next command
    after a crash; with or without a `grant` before (nothing to do is no error).

    Every inode of the share (on its own mount, no link followed) owned by `uid` or `gid` is given to
    the folder's owner or group, a setuid or setgid bit cleared; every ACL entry for `uid` is removed
    (access and default ACLs), and what `grant` changed besides is as it was: the masks, the default
    ACLs it made, the entries for the owner it added (and that files made meanwhile inherited). An
    access ACL left with what the mode bits say is removed. Returns the problems, one line each;
    never raises for one file."""
    try:
        top_fd = _open_folder(folder)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{folder}: cannot open it to hand it back: {exc.strerror or exc}"]
    try:
        walk = _Walk(folder, top_fd)
        owner, group = walk.top.info.st_uid, walk.top.info.st_gid
        if owner == uid:
            return [f"{folder}: the folder itself belongs to the VM's uid {uid}, so it has no owner to "
                    "hand the files back to: chown -R them to whom they belong"]

        def visit(node: _Node) -> Inherited:
            try:
                return _hand_back_one(node, uid, gid, owner, group)
            except OSError as exc:
                walk.problems.append(f"{node.path}: not handed back: {exc.strerror or exc}")
                return node.inherited

        walk.run(visit)
    except OSError as exc:
        return [f"{folder}: cannot hand it back: {exc.strerror or exc}"]
    finally:
        os.close(top_fd)
    return walk.problems


def _hand_back_one(node: _Node, uid: int, gid: int, owner: int, group: int) -> Inherited:
    """Hand one inode back; returns what its children inherited (`Inherited`)."""
    info = node.info
    if info.st_uid == uid or info.st_gid == gid:
        _chown(node.fd, owner if info.st_uid == uid else -1, group if info.st_gid == gid else -1)
        if stat.S_ISREG(info.st_mode) and info.st_mode & 0o6000:  # chown clears them; to be sure
            os.chmod(node.proc, stat.S_IMODE(info.st_mode) & ~0o6000)
    if stat.S_ISLNK(info.st_mode):
        return node.inherited
    mark = _read_mark(node, uid)
    access = _read_acl(node, ACCESS)
    default = _read_acl(node, DEFAULT) if node.is_dir else None
    if mark is None and not any(acl is not None and acl.named(uid) for acl in (access, default)):
        return NOTHING  # no grant here, and nothing below inherited one from here
    if mark is None:  # made while the lab ran: it inherited its folder's default ACL
        below = node.inherited
        last = not below.shared
        drop = [uid, owner] if below.owner_entry and last else [uid]
        _write_acl(node, ACCESS, None if access is None else access.without_users(drop), access)
        _write_acl(node, DEFAULT, None if default is None or below.made and last
                   else default.without_users(drop), default)
        return below
    others = _other_marks(node, uid)
    if others:  # another VM's grant stays: only this uid's entries go, the last grant out restores
        _write_acl(node, ACCESS, None if access is None else access.without_users([uid]), access)
        _write_acl(node, DEFAULT, None if default is None else default.without_users([uid]), default)
        if mark.owner_entry:  # the owner's entry this grant added: the last one out removes it
            for name in others:
                kept = _Mark.decode(os.getxattr(node.proc, name))
                os.setxattr(node.proc, name, attrs.evolve(kept, owner_entry=True).encode())
        _remove_mark(node, uid)
        return Inherited(mark.default_made, mark.owner_entry, shared=True)
    _write_acl(node, ACCESS, None if access is None else access.without_users([uid], mark.access_mask),
               access)
    restored = None if mark.default_made or default is None else default.without_users(
        [uid, owner] if mark.owner_entry else [uid], mark.default_mask)
    _write_acl(node, DEFAULT, restored, default)
    _remove_mark(node, uid)
    return Inherited(mark.default_made, mark.owner_entry)


def _chown(fd: int, uid: int, gid: int) -> None:
    """chown the very inode of an O_PATH descriptor (a symlink too, never what it names):
    fchownat(fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW), which os.chown cannot say."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_symlink_nofollow, at_empty_path = 0x100, 0x1000
    if libc.fchownat(fd, b"", ctypes.c_uint32(uid & 0xFFFFFFFF), ctypes.c_uint32(gid & 0xFFFFFFFF),
                     at_symlink_nofollow | at_empty_path) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
