"""The disk-file rule (vmlaunch/guests/diskfiles.py): what `up` refuses to let QEMU open, and the checks the
image resource makes before and after QEMU opens a disk."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.guests.diskfiles import DiskFileRefused, Policy, Unsafe, check
from vmlaunch.resources.base import Context
from vmlaunch.resources.image import Image
from vmlaunch.runtime import executor
from vmlaunch.spec.load import load_lab

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of another user)")


def as_nobody(folder: Path, make: str, *args: str) -> None:
    """Make an entry in `folder` as user nobody: a forked child changes into it, then its uid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.chdir(folder)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            getattr(os, make)(*args)
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def sticky(tmp_path: Path) -> Path:
    """A sticky world-writable folder like /tmp, owned by root."""
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    return folder


def disk_images(tmp_path: Path, disks: str) -> list[Image]:
    spec = write_spec(tmp_path, '[lab]\nname = "t"\n[vm.web]\nmemory = 64\nkernel = "k"\n' + disks)
    return [r for r in compile_lab(load_lab(spec), fake_host()).resources if isinstance(r, Image)]


def refused(images: list[Image]) -> str:
    with pytest.raises(DiskFileRefused) as info:
        Image.preflight(images)
    return str(info.value)


# --- 1. symlinks the kernel's protected_symlinks would not follow ------------------------------------


@as_root
def test_a_symlink_of_another_user_in_a_sticky_folder_is_refused(tmp_path: Path, sticky: Path) -> None:
    (tmp_path / "secret.img").write_bytes(b"root's")
    as_nobody(sticky, "symlink", str(tmp_path / "secret.img"), "disk.img")
    assert os.lstat(sticky / "disk.img").st_uid == NOBODY
    images = disk_images(tmp_path, f'[[vm.web.disk]]\nfile = "{sticky}/disk.img"\n'
                         'accept_other_owner = true\n')  # no opt-in accepts this one
    message = refused(images)
    assert message.startswith(f"{tmp_path}/lab.toml:7: vm.web.disk[0].file: {sticky}/disk.img is a "
                              "symlink owned by uid 65534 (nobody) in the sticky world-writable folder")
    assert "protected_symlinks" in message
    assert (images[0].found() or "").startswith("refused:")


@as_root
def test_a_symlink_the_follower_or_folder_owner_owns_is_followed(tmp_path: Path, sticky: Path) -> None:
    (tmp_path / "mine.img").write_bytes(b"x")
    os.symlink(tmp_path / "mine.img", sticky / "link.img")  # root's link in root's sticky folder
    found = check(sticky / "link.img", Policy(), creating=False)
    assert found.path == tmp_path / "mine.img"


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    with pytest.raises(Unsafe, match="too many levels of symlinks"):
        check(tmp_path / "a", Policy(), creating=False)


# --- 2. files and folders of another user --------------------------------------------------------------


@as_root
def test_a_file_of_another_user_needs_an_opt_in_when_running_as_root(tmp_path: Path) -> None:
    image = tmp_path / "theirs.img"
    image.write_bytes(b"")
    os.chown(image, NOBODY, NOBODY)
    message = refused(disk_images(tmp_path, f'[[vm.web.disk]]\nfile = "{image}"\n'))
    assert message.startswith(f"{tmp_path}/lab.toml:7: vm.web.disk[0].file: {image} belongs to uid "
                              "65534 (nobody), not to uid 0 (root) (add accept_other_owner = true")
    Image.preflight(disk_images(tmp_path, f'[[vm.web.disk]]\nfile = "{image}"\n'
                                'accept_other_owner = true\n'))


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o662])
def test_a_file_others_may_write_needs_an_opt_in(tmp_path: Path, mode: int) -> None:
    image = tmp_path / "open.img"
    image.write_bytes(b"")
    os.chmod(image, mode)
    if mode == 0o662:
        os.chown(image, -1, NOBODY)  # a group with another user in it
    message = refused(disk_images(tmp_path, f'[[vm.web.disk]]\nfile = "{image}"\n'))
    assert f"{image} may be written by other users (mode {mode:04o})" in message
    Image.preflight(disk_images(tmp_path, f'[[vm.web.disk]]\nfile = "{image}"\n'
                                'accept_other_owner = true\n'))


@as_root
def test_a_folder_others_may_write_is_refused(tmp_path: Path, sticky: Path) -> None:
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)  # not sticky: anyone may rename the image away and put another
    (open_folder / "a.img").write_bytes(b"")
    with pytest.raises(Unsafe, match="can be replaced by other users: .*/open is writable by everyone"):
        check(open_folder / "a.img", Policy(), creating=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "a.img").write_bytes(b"")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(Unsafe, match=r"can be replaced by uid 65534 \(nobody\), who owns .*/theirs"):
        check(theirs / "a.img", Policy(), creating=False)
    # A sticky folder protects your own entries, not another user's.
    (sticky / "mine.img").write_bytes(b"")
    assert check(sticky / "mine.img", Policy(), creating=False).stat is not None
    check(sticky / "new.img", Policy(), creating=True)  # creating in /tmp is fine
    as_nobody(sticky, "mkdir", "sub")
    with pytest.raises(Unsafe, match="sub belongs to uid 65534 .* in the sticky shared folder"):
        check(sticky / "sub" / "x.img", Policy(), creating=True)


# --- 3. what a disk may be ----------------------------------------------------------------------------


def test_only_regular_files_and_opted_in_block_devices(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Unsafe, match="is a FIFO, not a disk image"):
        check(tmp_path / "fifo", Policy(), creating=False)
    os.symlink("/dev/null", tmp_path / "null")
    with pytest.raises(Unsafe, match=r"null \(that is /dev/null\) is a character device"):
        check(tmp_path / "null", Policy(), creating=False)
    with pytest.raises(Unsafe, match="is a folder"):
        check(tmp_path, Policy(), creating=False)
    with pytest.raises(Unsafe, match="missing.img does not exist") as missing:
        check(tmp_path / "missing.img", Policy(), creating=False)
    assert missing.value.fix == "give the disk a size to have up create it"
    if os.geteuid() == 0:
        try:
            os.mknod(tmp_path / "blk", 0o600 | stat.S_IFBLK, os.makedev(7, 200))
        except OSError:
            return
        with pytest.raises(Unsafe, match="blk is a block device") as device:
            check(tmp_path / "blk", Policy(), creating=False)
        assert device.value.fix == "add block_device = true to the disk if that is meant"
        assert check(tmp_path / "blk", Policy(block_device=True), creating=False).block_device


def test_every_refused_disk_is_listed_with_its_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    message = refused(disk_images(tmp_path, '[[vm.web.disk]]\nfile = "fifo"\n'
                                  '[[vm.web.disk]]\nfile = "gone.img"\nreadonly = true\n'))
    assert message.splitlines()[:2] == [
        f"{tmp_path}/lab.toml:7: vm.web.disk[0].file: {tmp_path}/fifo is a FIFO, not a disk image or "
        "block device",
        f"{tmp_path}/lab.toml:9: vm.web.disk[1].file: {tmp_path}/gone.img does not exist (give the "
        "disk a size to have up create it)",
    ]


# --- a swap between check and use ----------------------------------------------------------------------


@pytest.fixture
def holder() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def opened(path: Path, procs: list[subprocess.Popen[bytes]]) -> int:
    """A process that opens `path` as QEMU would, and holds it."""
    proc = subprocess.Popen(["sh", "-c", 'exec 3<"$0"; echo open; exec sleep 60', str(path)],
                            stdout=subprocess.PIPE)
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
    return proc.pid


def test_a_target_swapped_between_check_and_use_stops_the_vm(
        tmp_path: Path, holder: list[subprocess.Popen[bytes]]) -> None:
    (tmp_path / "good.img").write_bytes(b"good")
    (tmp_path / "other.img").write_bytes(b"other")
    os.symlink("good.img", tmp_path / "disk.img")
    [image] = disk_images(tmp_path, '[[vm.web.disk]]\nfile = "disk.img"\n')
    Image.preflight([image])
    image.apply(Context(lab="t"))  # checked: disk.img is good.img

    image.check_opened(opened(tmp_path / "disk.img", holder))  # QEMU opened what was checked

    os.replace(tmp_path / "other.img", tmp_path / "good.img")  # swapped after the check ...
    pid = opened(tmp_path / "disk.img", holder)  # ... before QEMU opened it
    with pytest.raises(DiskFileRefused, match=r"lab.toml:7: vm.web.disk\[0\].file: .*disk.img changed "
                       "after it was checked .* web is stopped before its guest runs"):
        image.check_opened(pid)

    [again] = disk_images(tmp_path, '[[vm.web.disk]]\nfile = "disk.img"\n')
    again.apply(Context(lab="t"))
    os.symlink("/dev/null", tmp_path / "swap")
    os.replace(tmp_path / "swap", tmp_path / "disk.img")
    pid = opened(tmp_path / "disk.img", holder)  # QEMU got /dev/null ...
    os.symlink("good.img", tmp_path / "swap")
    os.replace(tmp_path / "swap", tmp_path / "disk.img")  # ... and the path was put back
    with pytest.raises(DiskFileRefused, match="changed between the check and QEMU opening it"):
        again.check_opened(pid)


# --- up --dry-run -----------------------------------------------------------------------------------------


def test_dry_run_says_which_files_each_vm_writes(tmp_path: Path, run_dir: Path) -> None:
    (tmp_path / "root.img").write_bytes(b"")
    (tmp_path / "base.img").write_bytes(b"")
    spec = write_spec(tmp_path, '[lab]\nname = "t"\n[vm.web]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.web.disk]]\nfile = "root.img"\n'
                      '[[vm.web.disk]]\nfile = "base.img"\nreadonly = true\n'
                      '[[vm.web.disk]]\nfile = "new.img"\nsize = "1M"\n'
                      '[vm.db]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.db.disk]]\nfile = "base.img"\nreadonly = true\n')
    lines = list(executor.describe(compile_lab(load_lab(spec), fake_host())))
    assert f"  image {tmp_path}/root.img (raw) for web, read-write [exists: web writes to it]" in lines
    assert f"  image {tmp_path}/base.img (raw) for web, read-only [exists: web opens it read-only]" in lines
    assert f"  image {tmp_path}/base.img (raw) for db, read-only [exists: db opens it read-only]" in lines
    assert f"  image {tmp_path}/new.img (raw, 1M) for web, read-write: created if missing" in lines
