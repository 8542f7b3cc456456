"""Files a user names, to write or to read, are looked at before anything else: what vmlaunch writes
for a user is made new (never through a symlink, never over a FIFO, a device or a folder), and what it
reads by a name a user controls is a regular file of a bounded size (a FIFO never hangs it). Without
QEMU: `graph --out`, `evidence`, the image catalog's lock file, the spec; the screenshot is in
test_screen_real.py."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from vmlaunch.core.fsutil import Unfit, read_bounded, write_new, write_new_at
from vmlaunch.errors import EXIT_CANT_CREATE, EXIT_SPEC

LAB = """[lab]
name = "{name}"
[image.deb]
catalog = "debian-12"
[vm.a]
memory = 256
image = "deb"
"""


def environ(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "VMLAUNCH_RUN_DIR": str(tmp_path / "run"),
            "VMLAUNCH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}


def vmlaunch(tmp_path: Path, *args: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own, killed after `timeout` (a hang fails the test, not the run)."""
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          check=False, env=environ(tmp_path), cwd=tmp_path, timeout=timeout)


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "lab.toml"
    path.write_text(LAB.format(name=f"op{os.getpid() % 10000}"))
    return path


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A file outside every folder vmlaunch is told to write into."""
    path = tmp_path / "canary"
    path.write_text("the host's own file\n")
    return path


def char_device(path: Path) -> Path:
    """A character device node (/dev/null's numbers) at `path`: made as root, else a link's stand-in
    cannot be had, and the test is skipped."""
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


# --- the helpers ------------------------------------------------------------------------------------


def test_write_new_refuses_what_is_not_a_regular_file(tmp_path: Path, canary: Path) -> None:
    fifo, link, folder = tmp_path / "fifo", tmp_path / "link", tmp_path / "folder"
    os.mkfifo(fifo)
    link.symlink_to(canary)
    folder.mkdir()
    device = char_device(tmp_path / "null")
    for path, kind in ((fifo, "a FIFO"), (link, "a symlink"), (folder, "a folder"),
                       (device, "a character device")):
        with pytest.raises(Unfit, match=f"^{path}: it is {kind}, not a regular file$"):
            write_new(path, b"x")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and stat.S_ISCHR(device.lstat().st_mode)
    assert link.is_symlink() and canary.read_text() == "the host's own file\n"
    write_new(tmp_path / "new", "one")
    write_new(tmp_path / "new", "two")  # a regular file is replaced
    assert (tmp_path / "new").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary", "fifo", "folder", "link", "new", "null"]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(Unfit, match="it is a symlink"):
            write_new_at(fd, "link", b"x")
        write_new_at(fd, "at", b"made beneath the folder")
    finally:
        os.close(fd)
    assert (tmp_path / "at").read_bytes() == b"made beneath the folder"
    assert canary.read_text() == "the host's own file\n"


def test_read_bounded_checks_the_type_and_the_size(tmp_path: Path, canary: Path) -> None:
    fifo, link, big = tmp_path / "fifo", tmp_path / "link", tmp_path / "big"
    os.mkfifo(fifo)
    link.symlink_to(canary)
    with open(big, "wb") as file:
        file.truncate(200 << 20)  # sparse: 200 MiB that take no room
    with pytest.raises(Unfit, match="it is a FIFO, not a regular file"):
        read_bounded(fifo, 1 << 20)
    with pytest.raises(Unfit, match="it is a character device"):
        read_bounded(Path("/dev/zero"), 1 << 20)
    with pytest.raises(Unfit, match="it is a folder"):
        read_bounded(tmp_path, 1 << 20)
    with pytest.raises(Unfit, match=f"it is too large: {200 << 20} bytes, at most {1 << 20}$"):
        read_bounded(big, 1 << 20)
    with pytest.raises(Unfit, match="it is a symlink"):
        read_bounded(link, 1 << 20, follow=False)
    assert read_bounded(link, 1 << 20) == b"the host's own file\n"  # a user's own link: followed
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "none", 10)


# --- reading: the lock file, the spec ---------------------------------------------------------------


@pytest.mark.parametrize("command", [["validate"], ["image", "pull"]])
def test_a_lock_file_that_is_a_fifo_is_refused_at_once(tmp_path: Path, spec: Path,
                                                       command: list[str]) -> None:
    lock = Path(f"{spec}.lock")
    os.mkfifo(lock)
    done = vmlaunch(tmp_path, *command, str(spec), timeout=10)  # hung for good before
    assert done.returncode == EXIT_SPEC, done.stderr
    assert f"{lock}:1: cannot read the lock file: it is a FIFO, not a regular file" in done.stderr
    assert stat.S_ISFIFO(lock.lstat().st_mode)


def test_a_huge_lock_file_is_refused_unread(tmp_path: Path, spec: Path) -> None:
    lock = Path(f"{spec}.lock")
    with open(lock, "wb") as file:
        file.truncate(200 << 20)
    done = vmlaunch(tmp_path, "validate", str(spec))
    assert done.returncode == EXIT_SPEC, done.stderr
    assert f"cannot read the lock file: it is too large: {200 << 20} bytes, at most {1 << 20}" in done.stderr


def test_a_spec_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "lab.toml"
    os.mkfifo(fifo)
    done = vmlaunch(tmp_path, "validate", str(fifo), timeout=10)
    assert done.returncode == EXIT_SPEC
    assert f"{fifo}:1: cannot read the spec: it is a FIFO, not a regular file" in done.stderr


# --- writing: graph --out, evidence ----------------------------------------------------------------


def test_graph_out_never_replaces_nor_follows(tmp_path: Path, spec: Path, canary: Path) -> None:
    fifo, link = tmp_path / "lab.dot", tmp_path / "link.dot"
    os.mkfifo(fifo)
    link.symlink_to(canary)
    for out, kind in ((fifo, "a FIFO"), (link, "a symlink")):
        done = vmlaunch(tmp_path, "graph", str(spec), "--out", str(out), timeout=10)
        assert done.returncode == EXIT_CANT_CREATE, done.stderr
        assert done.stderr == (f"vmlaunch: error: will not write {out}: it is {kind}, not a regular file "
                               "(name a new file, or a regular file to replace)\n")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and link.is_symlink()
    assert canary.read_text() == "the host's own file\n"
    done = vmlaunch(tmp_path, "graph", str(spec), "--out", str(tmp_path / "new.dot"))
    assert done.returncode == 0 and (tmp_path / "new.dot").read_text().startswith("digraph")


def test_evidence_never_writes_through_a_link_in_its_folder(tmp_path: Path, spec: Path, canary: Path) -> None:
    folder, elsewhere = tmp_path / "evidence", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "status.json").symlink_to(canary)
    (folder / "README.txt").symlink_to(canary)
    (folder / "wire.json").symlink_to(elsewhere / "planted")
    # a lab never up has these three to save (no logs yet): each is a link, so nothing is saved
    done = vmlaunch(tmp_path, "evidence", str(spec), str(folder))
    assert done.returncode == EXIT_CANT_CREATE, done.stderr
    assert done.stderr == (f"vmlaunch: error: nothing could be saved in {folder}: status.json: cannot write "
                           "it: it is a symlink, not a regular file (and 2 more)\n")
    assert canary.read_text() == "the host's own file\n" and list(elsewhere.iterdir()) == []
    assert all((folder / name).is_symlink() for name in ("status.json", "README.txt", "wire.json"))
    (folder / "README.txt").unlink()  # something saved: the rest is said, and the exit is 0
    done = vmlaunch(tmp_path, "evidence", str(spec), str(folder))
    assert done.returncode == 0, done.stderr
    assert "warning: not saved: status.json: cannot write it: it is a symlink, not a regular file" \
        in done.stderr
    assert "wire.json: cannot write it: it is a symlink" in (folder / "README.txt").read_text()
    assert canary.read_text() == "the host's own file\n" and list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a read-only file system for root: a mount in a mount namespace of its own")
def test_evidence_into_a_read_only_folder_says_nothing_was_saved(tmp_path: Path, spec: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    script = (f'mount -t tmpfs -o ro none "{ro}" || exit 99\n'
              f'"{sys.executable}" -m vmlaunch evidence "{spec}" "{ro}"; echo "exit $?"\n'
              f'"{sys.executable}" -m vmlaunch evidence "{spec}" "{ro}/sub/deeper"; echo "exit $?"\n')
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          env=environ(tmp_path), capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"exit {EXIT_CANT_CREATE}"] * 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"vmlaunch: error: nothing could be saved in {ro}: status.json: cannot write "
                               "it: Read-only file system"), lines
    assert lines[1] == (f"vmlaunch: error: nothing was saved: cannot make the folder {ro}/sub: Read-only "
                        "file system")


def test_export_never_replaces_nor_follows(tmp_path: Path, spec: Path, canary: Path) -> None:
    out = tmp_path / "out"
    (out / "domains").mkdir(parents=True)
    fifo = out / ".vmlaunch-export"
    os.mkfifo(fifo)  # the manifest, read before and written after: read it hung, written it was replaced
    (out / "domains" / "a.xml").symlink_to(canary)
    done = vmlaunch(tmp_path, "export", str(spec), "--to", "libvirt", "--out", str(out), timeout=10)
    assert done.returncode == EXIT_CANT_CREATE, done.stderr
    assert (f"vmlaunch: error: will not write {out}/domains/a.xml: it is a symlink, not a regular file"
            in done.stderr)
    (out / "domains" / "a.xml").unlink()
    done = vmlaunch(tmp_path, "export", str(spec), "--to", "libvirt", "--out", str(out), timeout=10)
    assert done.returncode == EXIT_CANT_CREATE, done.stderr
    assert f"will not write {fifo}: it is a FIFO, not a regular file" in done.stderr
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and canary.read_text() == "the host's own file\n"
