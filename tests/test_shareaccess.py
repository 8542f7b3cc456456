"""A share given to a VM's uid and handed back (vmlaunch/guests/shareaccess.py), on a real folder as root.

The VM's uid acts as QEMU does after `-runas`: a forked child that dropped to the uid and gid, working
from a descriptor of the share's folder opened before (as QEMU's 9p server opens it at start-up), and
creating files and folders with the modes QEMU's `fmode` and `dmode` give them.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from vmlaunch.compile.compiler import SHARE_DMODE, SHARE_FMODE
from vmlaunch.guests import shareaccess
from vmlaunch.guests.shareaccess import (
    ACCESS,
    DEFAULT,
    GROUP,
    GROUP_OBJ,
    MARK,
    MASK,
    OTHER,
    USER,
    USER_OBJ,
    Acl,
    Entry,
    Grant,
    ShareAccessError,
    check_xattrs,
    grant,
    hand_back,
)
from vmlaunch.lab import journal

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to other uids: needs root")

OWNER, OWNER_GROUP = 4242, 4242  # the share folder's owner: a user of the host
BOB = 4244  # another host user, named in an ACL of the user's own
VM, VM_GROUP = 4343, 4343  # the VM's own uid and gid


# --- the ACL format ------------------------------------------------------------------------------


def test_an_acl_is_the_kernels_bytes() -> None:
    acl = Acl.from_mode(0o640).with_user(VM, 6)
    assert acl.encode() == bytes.fromhex(
        "02000000" "01000600ffffffff" "02000600f7100000" "04000400ffffffff" "10000600ffffffff"
        "20000000ffffffff")
    assert Acl.decode(acl.encode()) == acl
    with pytest.raises(ValueError):
        Acl.decode(b"\x01\x00\x00\x00")
    with pytest.raises(ValueError):
        Acl.decode(acl.encode()[:-1])


def test_entries_are_kept_in_the_kernels_order_and_the_mask_covers_the_group_class() -> None:
    acl = Acl.of([Entry(OTHER, 0), Entry(GROUP, 5, 7), Entry(USER, 4, 900), Entry(GROUP_OBJ, 4),
                  Entry(USER_OBJ, 6), Entry(MASK, 5)])
    given = acl.with_user(100, 6)
    assert [(e.tag, e.id) for e in given.entries if e.tag == USER] == [(USER, 100), (USER, 900)]
    assert given.perm(MASK) == 7  # r-x | rw- | r-- | r--
    assert given.without_users([100], mask=5) == acl  # the mask it had, given back
    assert given.without_users([100]).perm(MASK) == 5  # else what is left, within the mask it has


def test_an_acl_reduced_to_the_mode_bits_keeps_what_each_entry_allowed() -> None:
    guest_made = Acl.of([Entry(USER_OBJ, 6), Entry(USER, 7, VM), Entry(USER, 7, OWNER), Entry(GROUP_OBJ, 5),
                         Entry(MASK, 6), Entry(OTHER, 0)])
    assert guest_made.without_users([VM, OWNER]) == Acl.from_mode(0o640)  # group r-x within rw-
    assert guest_made.without_users([VM]).perm(MASK) == 6  # never more than the mask allowed
    assert Acl.from_mode(0o755).with_user(VM, 7).without_users([VM]) == Acl.from_mode(0o755)


# --- a share to give ------------------------------------------------------------------------------


@pytest.fixture
def share(tmp_path: Path) -> Iterator[Path]:
    """A user's folder: files and folders, an ACL of the user's own (bob may read `acl.txt`, the mask
    says r--), a default ACL, a file hard-linked from outside, symlinks to a file and a folder
    outside, a FIFO, and a setuid program of the user's."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "shadow").write_text("secret\n")
    os.chmod(outside / "shadow", 0o640)
    folder = tmp_path / "share"
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "a.txt").write_text("a\n")
    (folder / "sub" / "b.txt").write_text("b\n")
    (folder / "sub" / "deeper" / "c.txt").write_text("c\n")
    os.chmod(folder / "sub" / "b.txt", 0o600)
    (folder / "acl.txt").write_text("acl\n")
    bob_reads = [Entry(USER_OBJ, 6), Entry(USER, 5, BOB), Entry(GROUP_OBJ, 4), Entry(MASK, 4),
                 Entry(OTHER, 0)]
    os.setxattr(folder / "acl.txt", ACCESS, Acl.of(bob_reads).encode())
    (folder / "team").mkdir()
    team = [Entry(USER_OBJ, 7), Entry(USER, 7, BOB), Entry(GROUP_OBJ, 5), Entry(MASK, 7), Entry(OTHER, 0)]
    os.setxattr(folder / "team", DEFAULT, Acl.of(team).encode())
    os.link(outside / "shadow", folder / "hardlink")
    os.symlink(outside / "shadow", folder / "link")
    os.symlink(outside, folder / "linkdir")
    os.mkfifo(folder / "fifo")
    (folder / "tool").write_text("#!/bin/sh\n")
    for path in [folder, *folder.rglob("*")]:
        os.lchown(path, OWNER, OWNER_GROUP)
    os.chmod(folder / "tool", 0o4755)
    yield folder


def state(*roots: Path) -> dict[str, tuple[int, int, int, bytes | None, bytes | None, bool]]:
    """Each inode under `roots`: mode, owner, group, access and default ACL xattrs, and a mark."""
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            info = os.lstat(path)
            attrs_: list[bytes | None] = [None, None]
            mark = False
            if not stat.S_ISLNK(info.st_mode):
                for index, name in enumerate((ACCESS, DEFAULT)):
                    try:
                        attrs_[index] = os.getxattr(path, name)
                    except OSError as exc:
                        assert exc.errno == errno.ENODATA
                mark = any(name.startswith(MARK) for name in os.listxattr(path))
            found[str(path)] = (info.st_mode, info.st_uid, info.st_gid, attrs_[0], attrs_[1], mark)
    return found


def acl_of(path: Path, name: str = ACCESS) -> Acl | None:
    try:
        return Acl.decode(os.getxattr(path, name))
    except OSError as exc:
        assert exc.errno == errno.ENODATA
        return None


def as_uid(uid: int, gid: int, folder: Path, act: Callable[[int], None]) -> int:
    """Run `act(folder_fd)` in a child that dropped to uid and gid (no other group, no capability),
    with a descriptor of `folder` opened before it dropped, as QEMU has; its exit status: 0 done,
    13 refused (EACCES or EPERM), 1 any other error."""
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            act(folder_fd)
            code = 0
        except PermissionError:
            code = 13
        except BaseException:  # noqa: BLE001 - a child never returns into pytest
            code = 1
        os._exit(code)
    os.close(folder_fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def write_file(name: str, text: str = "x\n", flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
               mode: int = SHARE_FMODE) -> Callable[[int], None]:
    def act(folder_fd: int) -> None:
        fd = os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=folder_fd)
        os.write(fd, text.encode())
        os.close(fd)
    return act


def read_file(name: str) -> Callable[[int], None]:
    def act(folder_fd: int) -> None:
        os.close(os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder_fd))
    return act


# --- grant and hand back --------------------------------------------------------------------------


def test_grant_then_hand_back_leaves_every_mode_owner_and_acl_as_before(share: Path) -> None:
    outside = share.parent / "outside"
    before = state(share, outside)
    given = grant(share, VM, VM_GROUP, readonly=False)
    assert (given.owner, given.group, given.folders, given.files) == (OWNER, OWNER_GROUP, 4, 5)
    assert given.notes == (f"{share}/hardlink: 2 hard links: left as it is (the guest cannot use it)",)
    assert state(share, outside) != before
    assert hand_back(share, VM, VM_GROUP) == []
    assert state(share, outside) == before


def test_what_grant_gives(share: Path) -> None:
    outside = share.parent / "outside"
    before = state(outside)
    grant(share, VM, VM_GROUP, readonly=False)
    for folder in (share, share / "sub", share / "sub" / "deeper", share / "team"):
        access, default = acl_of(folder), acl_of(folder, DEFAULT)
        assert access is not None and access.perm(USER, VM) == 7 and access.perm(MASK) == 7
        assert default is not None and default.perm(USER, VM) == 7 and default.perm(USER, OWNER) == 7
    assert acl_of(share / "team", DEFAULT) == Acl.of([  # the user's own default ACL, plus two entries
        Entry(USER_OBJ, 7), Entry(USER, 7, BOB), Entry(USER, 7, OWNER), Entry(USER, 7, VM),
        Entry(GROUP_OBJ, 5), Entry(MASK, 7), Entry(OTHER, 0)])
    for file in ("a.txt", "sub/b.txt", "tool"):
        access = acl_of(share / file)
        assert access is not None and access.perm(USER, VM) == 6, file
    assert acl_of(share / "acl.txt") == Acl.of([
        Entry(USER_OBJ, 6), Entry(USER, 5, BOB), Entry(USER, 6, VM), Entry(GROUP_OBJ, 4), Entry(MASK, 7),
        Entry(OTHER, 0)])
    assert acl_of(share / "fifo") is None
    assert state(outside) == before  # neither through the hard link nor through a symlink
    assert as_uid(VM, VM_GROUP, share, read_file("sub/deeper/c.txt")) == 0
    assert as_uid(VM, VM_GROUP, share, write_file("a.txt", flags=os.O_WRONLY | os.O_APPEND)) == 0
    assert as_uid(VM, VM_GROUP, share, read_file("hardlink")) == 13


def test_files_the_uid_made_are_the_owners_while_the_lab_runs_and_handed_back_after(share: Path) -> None:
    before = state(share)
    grant(share, VM, VM_GROUP, readonly=False)

    def guest(folder_fd: int) -> None:  # what QEMU does for a guest that writes a file and a folder
        write_file("made.txt", "by the guest\n")(folder_fd)
        os.mkdir("made", SHARE_DMODE, dir_fd=folder_fd)
        inner = os.open("made", os.O_RDONLY | os.O_DIRECTORY, dir_fd=folder_fd)
        write_file("inner.txt")(inner)
        os.link("made.txt", "made-link", src_dir_fd=folder_fd, dst_dir_fd=folder_fd)  # a guest's `ln`

    assert as_uid(VM, VM_GROUP, share, guest) == 0
    assert os.stat(share / "made.txt").st_uid == VM
    # the folder's owner edits and removes what the guest made while the lab runs
    edit = write_file("made.txt", "by the owner\n", os.O_WRONLY | os.O_TRUNC)
    assert as_uid(OWNER, OWNER_GROUP, share, edit) == 0
    assert as_uid(OWNER, OWNER_GROUP, share, lambda fd: os.unlink("made/inner.txt", dir_fd=fd)) == 0
    assert as_uid(VM, VM_GROUP, share, write_file("made/inner.txt")) == 0
    # what the owner makes meanwhile, the guest may use as the group of it may (the mask is its
    # create mode's group bits: the owner's umask decides, as for a group)
    assert as_uid(OWNER, OWNER_GROUP, share, write_file("owners.txt", mode=0o664)) == 0
    assert as_uid(VM, VM_GROUP, share, write_file("owners.txt", "guest\n", os.O_WRONLY | os.O_APPEND)) == 0
    assert as_uid(OWNER, OWNER_GROUP, share, write_file("owners-ro.txt", mode=0o644)) == 0
    assert as_uid(VM, VM_GROUP, share, read_file("owners-ro.txt")) == 0
    assert as_uid(VM, VM_GROUP, share, write_file("owners-ro.txt", "guest\n", os.O_WRONLY)) == 13

    assert hand_back(share, VM, VM_GROUP) == []
    made = {path: os.lstat(share / path) for path in ("made.txt", "made-link", "made", "made/inner.txt")}
    assert {(info.st_uid, info.st_gid) for info in made.values()} == {(OWNER, OWNER_GROUP)}
    assert stat.S_IMODE(made["made.txt"].st_mode) == 0o640 and made["made.txt"].st_nlink == 2
    assert stat.S_IMODE(made["made"].st_mode) == 0o750
    assert stat.S_IMODE(made["made/inner.txt"].st_mode) == 0o640
    for path in ("made.txt", "made", "made/inner.txt", "owners.txt", "owners-ro.txt"):
        assert not set(os.listxattr(share / path)) & {ACCESS, DEFAULT, f"{MARK}{VM}"}, path
    # a default ACL (no umask) made from the folder's 0755: its group gets what the folder's has
    assert stat.S_IMODE(os.stat(share / "owners.txt").st_mode) == 0o644
    assert (share / "made.txt").read_text() == "by the owner\n"
    after = state(share)
    for path in ("made.txt", "made-link", "made", "made/inner.txt", "owners.txt", "owners-ro.txt"):
        after.pop(str(share / path))
    assert after == before


def test_a_readonly_grant_lets_the_uid_read_and_nothing_more(share: Path) -> None:
    before = state(share)
    given = grant(share, VM, VM_GROUP, readonly=True)
    default = acl_of(share, DEFAULT)
    assert default is not None and default.perm(USER, VM) == 5 and default.get(USER, OWNER) is None
    assert as_uid(VM, VM_GROUP, share, read_file("sub/b.txt")) == 0  # 0600: the ACL lets it read
    assert as_uid(VM, VM_GROUP, share, write_file("sub/b.txt", flags=os.O_WRONLY)) == 13
    assert as_uid(VM, VM_GROUP, share, write_file("new.txt")) == 13
    # a file the owner saves meanwhile (an editor writes a new one): the guest reads it too
    assert as_uid(OWNER, OWNER_GROUP, share, write_file("saved.txt", mode=0o644)) == 0
    assert as_uid(VM, VM_GROUP, share, read_file("saved.txt")) == 0
    assert given.hand_back() == []
    assert set(os.listxattr(share / "saved.txt")) & {ACCESS, f"{MARK}{VM}"} == set()
    assert stat.S_IMODE(os.stat(share / "saved.txt").st_mode) == 0o644
    after = state(share)
    del after[str(share / "saved.txt")]
    assert after == before


def test_what_the_uid_cannot_have_before_a_grant(share: Path) -> None:
    assert as_uid(VM, VM_GROUP, share, read_file("sub/b.txt")) == 13
    assert as_uid(VM, VM_GROUP, share, write_file("a.txt", flags=os.O_WRONLY)) == 13


def test_a_setuid_file_the_uid_made_is_handed_back_without_the_bit(share: Path) -> None:
    """Through QEMU a guest cannot set the bit (mapped-xattr); a QEMU taken over by the guest could."""
    grant(share, VM, VM_GROUP, readonly=False)

    def plant(folder_fd: int) -> None:
        write_file("rootsh")(folder_fd)
        fd = os.open("rootsh", os.O_RDONLY, dir_fd=folder_fd)
        os.fchmod(fd, 0o6755)
        os.close(fd)
        os.symlink("/etc/shadow", "link-of-the-uid", dir_fd=folder_fd)
        os.mkfifo("fifo-of-the-uid", dir_fd=folder_fd)

    assert as_uid(VM, VM_GROUP, share, plant) == 0
    assert os.stat(share / "rootsh").st_mode & 0o6000 == 0o6000
    assert hand_back(share, VM, VM_GROUP) == []
    info = os.stat(share / "rootsh")
    assert (info.st_uid, info.st_gid, info.st_mode & 0o6000) == (OWNER, OWNER_GROUP, 0)
    for name in ("link-of-the-uid", "fifo-of-the-uid"):
        assert (os.lstat(share / name).st_uid, os.lstat(share / name).st_gid) == (OWNER, OWNER_GROUP)
    assert os.stat("/etc/shadow").st_uid == 0  # the link itself, never what it names


def test_hand_back_without_a_grant_changes_nothing(share: Path) -> None:
    before = state(share, share.parent / "outside")
    assert hand_back(share, VM, VM_GROUP) == []
    assert state(share, share.parent / "outside") == before
    assert hand_back(share.parent / "gone", VM, VM_GROUP) == []


def test_a_grant_made_twice_is_handed_back_once(share: Path) -> None:
    """An `up` that crashed after its grant and the next one's: the first mark holds what was there."""
    before = state(share)
    grant(share, VM, VM_GROUP, readonly=False)
    grant(share, VM, VM_GROUP, readonly=False)
    assert hand_back(share, VM, VM_GROUP) == []
    assert state(share) == before


@pytest.mark.parametrize("order", ["first in, first out", "last in, first out"])
def test_two_vms_sharing_a_folder_each_hand_back_their_own(share: Path, order: str) -> None:
    """Each grant marks what it changed under its own uid; the last one out puts the rest back."""
    other = VM + 1
    before = state(share)
    grant(share, VM, VM_GROUP, readonly=False)
    grant(share, other, other, readonly=False)
    assert as_uid(VM, VM_GROUP, share, write_file("sub/by-vm.txt")) == 0
    assert as_uid(other, other, share, lambda fd: os.mkdir("by-other", SHARE_DMODE, dir_fd=fd)) == 0
    assert as_uid(VM, VM_GROUP, share, write_file("by-other/by-vm.txt")) == 0  # each reaches the other's
    first, second = (VM, other) if order == "first in, first out" else (other, VM)
    assert hand_back(share, first, first) == []
    still = acl_of(share / "sub" / "b.txt")
    assert still is not None and still.get(USER, first) is None and still.perm(USER, second) == 6
    assert as_uid(second, second, share, write_file("sub/b.txt", flags=os.O_WRONLY | os.O_APPEND)) == 0
    assert hand_back(share, second, second) == []
    made = ("sub/by-vm.txt", "by-other", "by-other/by-vm.txt")
    for path in made:
        info = os.stat(share / path)
        assert (info.st_uid, info.st_gid) == (OWNER, OWNER_GROUP), path
        assert not {name for name in os.listxattr(share / path) if name.startswith(("system.", MARK))}, path
    after = state(share)
    for path in made:
        del after[str(share / path)]
    assert after == before


def test_an_acl_the_owner_changed_while_the_lab_ran_keeps_the_change(share: Path) -> None:
    grant(share, VM, VM_GROUP, readonly=False)
    changed = acl_of(share / "a.txt")
    assert changed is not None
    os.setxattr(share / "a.txt", ACCESS, changed.with_user(BOB, 4).encode())  # setfacl -m u:bob:r
    assert hand_back(share, VM, VM_GROUP) == []
    assert acl_of(share / "a.txt") == Acl.from_mode(0o644).with_user(BOB, 4)


def test_a_file_hard_linked_from_outside_is_never_given(share: Path) -> None:
    outside = share.parent / "outside" / "shadow"
    grant(share, VM, VM_GROUP, readonly=False)
    assert acl_of(outside) is None and os.stat(outside).st_mode == stat.S_IFREG | 0o640
    assert as_uid(VM, VM_GROUP, share, read_file("hardlink")) == 13
    assert as_uid(VM, VM_GROUP, share, read_file("link")) != 0  # O_NOFOLLOW as QEMU; and no access


def test_a_swapped_symlink_is_not_followed(share: Path, tmp_path: Path) -> None:
    """What grant sees is what it opened: a folder replaced by a symlink to /etc in the meantime is
    a symlink when opened (O_NOFOLLOW), so nothing outside is walked."""
    etc_like = tmp_path / "etc-like"
    etc_like.mkdir()
    (etc_like / "passwd").write_text("root\n")
    before = state(etc_like)
    os.rename(share / "sub", tmp_path / "sub-away")
    os.symlink(etc_like, share / "sub")
    grant(share, VM, VM_GROUP, readonly=False)
    assert state(etc_like) == before
    assert hand_back(share, VM, VM_GROUP) == []


def test_the_grant_is_journaled_as_it_is(share: Path) -> None:
    given = grant(share, VM, VM_GROUP, readonly=False)
    plain = json.loads(json.dumps(journal._plain(given)))
    assert plain["folder"] == str(share) and plain["uid"] == VM
    assert journal._converter(True).structure(plain, Grant) == given
    assert given.hand_back() == []


def test_a_share_deeper_than_the_walk_goes_is_said(share: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shareaccess, "MAX_DEPTH", 2)
    given = grant(share, VM, VM_GROUP, readonly=False)
    assert f"{share}/sub/deeper: more than 2 folders deep: what it holds was left as it is" in given.notes
    assert acl_of(share / "sub" / "deeper" / "c.txt") is None
    problems = hand_back(share, VM, VM_GROUP)
    assert problems == [f"{share}/sub/deeper: more than 2 folders deep: what it holds was left as it is"]


def test_a_folder_that_is_the_uids_own_has_no_owner_to_hand_back_to(tmp_path: Path) -> None:
    folder = tmp_path / "vm-owned"
    folder.mkdir()
    os.chown(folder, VM, VM_GROUP)
    assert hand_back(folder, VM, VM_GROUP) == [
        f"{folder}: the folder itself belongs to the VM's uid {VM}, so it has no owner to hand the files "
        "back to: chown -R them to whom they belong"]


def test_a_folder_no_share_may_be_is_never_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked again of the folder opened: a link on its path may name another since `validate`."""
    run_root = tmp_path / "run"
    (run_root / "lab").mkdir(parents=True)
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(run_root))
    (tmp_path / "share").symlink_to(run_root / "lab")
    with pytest.raises(ShareAccessError) as refused:
        grant(tmp_path / "share", VM, VM_GROUP, readonly=True)
    assert refused.value.message == (
        f"cannot give share {tmp_path}/share to its VM: {run_root}/lab, the folder it names now, is in "
        f"{run_root}, vmlaunch's run folder (every lab's sockets and journal): a guest could read what "
        "vmlaunch keeps there")
    assert os.listxattr(run_root / "lab") == []


def test_a_missing_folder_cannot_be_given(tmp_path: Path) -> None:
    with pytest.raises(ShareAccessError, match="cannot open share .*: No such file or directory"):
        grant(tmp_path / "gone", VM, VM_GROUP, readonly=False)


# --- other file systems: in a mount namespace of their own -----------------------------------------

IN_NAMESPACE = """
import json, os, subprocess, sys
from pathlib import Path
from vmlaunch.guests import shareaccess
base = Path(sys.argv[1])
result = {}
"""


def in_mount_namespace(tmp_path: Path, script: str) -> dict[str, object]:
    """Run `script` as root in a mount namespace of its own (its mounts vanish with it); it fills
    `result`, printed as JSON."""
    code = IN_NAMESPACE + textwrap.dedent(script) + "\nprint(json.dumps(result))\n"
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", code,
                           str(tmp_path)], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_check_xattrs(tmp_path: Path) -> None:
    assert check_xattrs(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # the probe is gone
    gone = tmp_path / "gone"
    assert check_xattrs(gone) == f"cannot create a file in {gone}: No such file or directory"
    result = in_mount_namespace(tmp_path, """
        (base / "ramfs").mkdir()
        subprocess.run(["mount", "-t", "ramfs", "ramfs", str(base / "ramfs")], check=True)
        (base / "tmpfs").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(base / "tmpfs")], check=True)
        result["ramfs"] = shareaccess.check_xattrs(base / "ramfs")
        result["tmpfs"] = shareaccess.check_xattrs(base / "tmpfs")
        try:
            shareaccess.grant(base / "ramfs", 4343, 4343, readonly=False)
        except shareaccess.ShareAccessError as exc:
            result["grant"] = [exc.message, exc.hint]
    """)
    assert result["ramfs"] == (f"the file system of {tmp_path}/ramfs (ramfs) does not keep user "
                               "extended attributes, where QEMU keeps the owner, mode and type of each "
                               "file a guest makes")
    assert result["tmpfs"] is None
    assert result["grant"] == [f"cannot give share {tmp_path}/ramfs to its VM: its file system (ramfs) "
                               "has no POSIX ACLs", "share a folder of a file system with ACLs (ext4, xfs, "
                               "btrfs, tmpfs) that is not mounted with noacl"]


def test_a_mount_inside_the_share_is_left_alone(share: Path) -> None:
    """A folder mounted inside the share (another file system, or the same one bound there, as
    /etc could be) is neither given nor walked, and said."""
    etc_like = share.parent / "etc-like"
    etc_like.mkdir()
    (etc_like / "shadow").write_text("secret\n")
    (share / "mnt").mkdir()
    (share / "bound").mkdir()
    (share / "bound-file").write_text("")
    os.chown(share / "mnt", OWNER, OWNER_GROUP)
    result = in_mount_namespace(share.parent, """
        share = base / "share"
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(share / "mnt")], check=True)
        (share / "mnt" / "inside").write_text("x")
        subprocess.run(["mount", "--bind", str(base / "etc-like"), str(share / "bound")], check=True)
        subprocess.run(["mount", "--bind", str(base / "etc-like" / "shadow"), str(share / "bound-file")],
                       check=True)
        given = shareaccess.grant(share, 4343, 4343, readonly=False)
        result["notes"] = list(given.notes)
        result["untouched"] = [sorted(os.listxattr(path)) for path in
                               (share / "mnt", share / "mnt" / "inside", share / "bound",
                                base / "etc-like" / "shadow")]
        result["problems"] = shareaccess.hand_back(share, 4343, 4343)
    """)
    notes = result["notes"]
    assert isinstance(notes, list) and sorted(notes) == sorted([
        f"{share}/bound: another file system is mounted there: left as it is",
        f"{share}/bound-file: another file system is mounted there: left as it is",
        f"{share}/hardlink: 2 hard links: left as it is (the guest cannot use it)",
        f"{share}/mnt: another file system is mounted there: left as it is"])
    assert result["untouched"] == [[], [], [], []]
    assert result["problems"] == []


def test_up_refuses_a_writable_share_without_user_xattrs(tmp_path: Path) -> None:
    """Before it changes anything, exit 3 at the share's line; a read-only share there is fine."""
    (tmp_path / "k").write_bytes(b"kernel" * 100)
    spec = tmp_path / "lab.toml"
    spec.write_text('[lab]\nname = "x"\n[vm.a]\nmemory = 64\nkernel = "k"\n'
                    '[[vm.a.share]]\nsource = "ro"\ntarget = "/srv/ro"\nreadonly = true\n'
                    '[[vm.a.share]]\nsource = "rw"\ntarget = "/srv/rw"\n')
    result = in_mount_namespace(tmp_path, """
        from vmlaunch.spec.load import load_lab
        for name in ("ro", "rw"):
            (base / name).mkdir()
            subprocess.run(["mount", "-t", "ramfs", "ramfs", str(base / name)], check=True)
        try:
            shareaccess.require_xattrs(load_lab(base / "lab.toml"))
        except shareaccess.ShareAccessError as exc:
            result["error"] = [str(exc.location), exc.message, exc.hint]
        done = subprocess.run([sys.executable, "-m", "vmlaunch", "-q", "up", str(base / "lab.toml")],
                              capture_output=True, text=True, env={**os.environ,
                              "VMLAUNCH_RUN_DIR": str(base / "run")})
        result["up"] = [done.returncode, done.stderr]
    """)
    why = (f"the file system of {tmp_path}/rw (ramfs) does not keep user extended attributes, where QEMU "
           "keeps the owner, mode and type of each file a guest makes")
    assert result["error"] == [f"{spec}:11: vm.a.share[1].source:", f"{spec}:11: vm.a.share[1].source: {why}",
                               shareaccess.XATTRS_HINT]
    assert result["up"] == [3, f"vmlaunch: error: {spec}:11: vm.a.share[1].source: {why}\n  hint: "
                               f"{shareaccess.XATTRS_HINT}\n"]
    assert not (tmp_path / "run").exists()
