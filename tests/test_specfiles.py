"""The files a spec names are checked at validate, cmdline and up --dry-run: exit 2 with the line."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_spec
from vmlaunch.cli import main
from vmlaunch.compile.preflight import load_checked
from vmlaunch.errors import SpecError

HEAD = '[lab]\nname = "files"\n'


def lab_with(tmp_path: Path, vm: str) -> Path:
    (tmp_path / "vmlinuz").write_bytes(b"a kernel")
    return write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\n' + vm)


def problems(spec: Path) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_checked(spec)
    return [str(problem) for problem in caught.value.problems]


def test_good_files_pass(tmp_path: Path) -> None:
    (tmp_path / "root.img").write_bytes(b"\0" * 512)
    spec = lab_with(tmp_path, 'kernel = "vmlinuz"\ninitrd = "vmlinuz"\n'
                    '[[vm.a.disk]]\nfile = "root.img"\n'
                    '[[vm.a.disk]]\nfile = "new.qcow2"\nsize = "1G"\n')  # created by up
    load_checked(spec)


def test_each_bad_file_is_a_problem_on_its_line(tmp_path: Path) -> None:
    (tmp_path / "empty.img").touch()
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    spec = lab_with(tmp_path, 'kernel = "nope"\n'                       # line 5
                    'initrd = "folder"\n'                                # 6
                    '[[vm.a.disk]]\nfile = "empty.img"\n'                # 8
                    '[[vm.a.disk]]\nfile = "missing.img"\n'              # 10
                    '[[vm.a.disk]]\nfile = "fifo"\nsize = "1G"\n'        # 12
                    '[[vm.a.disk]]\nfile = "/dev/null"\nreadonly = true\n')  # 15
    assert problems(spec) == [
        f"{spec}:5: vm.a.kernel: {tmp_path}/nope does not exist "
        "(relative paths are relative to the spec file)",
        f"{spec}:6: vm.a.initrd: {tmp_path}/folder is a folder, not a file",
        f"{spec}:8: vm.a.disk[0].file: {tmp_path}/empty.img is empty",
        f"{spec}:10: vm.a.disk[1].file: {tmp_path}/missing.img does not exist "
        "(give the disk a size to have `up` create it)",
        f"{spec}:12: vm.a.disk[2].file: {tmp_path}/fifo is a FIFO, not a file",
        f"{spec}:15: vm.a.disk[3].file: /dev/null is a character device, not a file",
    ]


def test_an_empty_disk_with_a_size_is_fine(tmp_path: Path) -> None:
    """`up` gives it its size (a note says so); only a disk it cannot size must have content."""
    (tmp_path / "empty.img").touch()
    spec = lab_with(tmp_path, 'kernel = "vmlinuz"\n[[vm.a.disk]]\nfile = "empty.img"\nsize = "1M"\n')
    load_checked(spec)


def test_a_block_device_needs_the_opt_in(tmp_path: Path) -> None:
    device = next((entry.path for entry in os.scandir("/dev")
                   if stat.S_ISBLK(os.stat(entry.path).st_mode)), None)
    if device is None:
        pytest.skip("this machine has no block device in /dev")
    spec = lab_with(tmp_path, f'[[vm.a.disk]]\nfile = "{device}"\nreadonly = true\n')
    assert problems(spec) == [f"{spec}:6: vm.a.disk[0].file: {device} is a block device "
                              "(add block_device = true to the disk if that is meant)"]
    spec = lab_with(tmp_path, f'[[vm.a.disk]]\nfile = "{device}"\nreadonly = true\nblock_device = true\n')
    load_checked(spec)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may read and write any file")
def test_unreadable_and_unwritable_files(tmp_path: Path) -> None:  # pragma: no cover - not as root
    (tmp_path / "ro.img").write_bytes(b"x")
    (tmp_path / "ro.img").chmod(0o444)
    (tmp_path / "none").write_bytes(b"x")
    (tmp_path / "none").chmod(0)
    spec = lab_with(tmp_path, 'kernel = "none"\n[[vm.a.disk]]\nfile = "ro.img"\n')
    assert problems(spec) == [
        f"{spec}:5: vm.a.kernel: {tmp_path}/none is not readable by you",
        f"{spec}:7: vm.a.disk[0].file: {tmp_path}/ro.img is not writable by you (the VM writes to "
        "this disk) (add readonly = true to the disk if the VM only reads it)",
    ]


def test_only_the_vms_named_are_checked(tmp_path: Path) -> None:
    spec = lab_with(tmp_path, 'kernel = "vmlinuz"\n[vm.b]\nmemory = 64\nkernel = "gone"\n')
    load_checked(spec, vms=["a"])
    assert problems(spec) == [f"{spec}:8: vm.b.kernel: {tmp_path}/gone does not exist "
                              "(relative paths are relative to the spec file)"]


@pytest.mark.parametrize("command", [["validate"], ["cmdline"], ["up", "--dry-run"], ["cmdline", "--json"]])
def test_commands_that_start_nothing_report_them(tmp_path: Path, command: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    spec = lab_with(tmp_path, 'kernel = "nope"\n')
    assert main([command[0], str(spec), *command[1:]]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no command line follows the message
    assert err.splitlines() == [f"{spec}:5: vm.a.kernel: {tmp_path}/nope does not exist (relative "
                                "paths are relative to the spec file)", "vmlaunch: 1 problem in the spec"]


def test_status_and_down_do_not_need_the_files(tmp_path: Path, run_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A lab whose kernel was deleted since `up` can still be looked at and taken down."""
    spec = lab_with(tmp_path, 'kernel = "nope"\n')
    assert main(["status", str(spec)]) == 0
    assert main(["down", str(spec)]) == 0
    assert "not up" in capsys.readouterr().out


def bzimage(path: Path, *, init_mib: float, load_mib: int = 16, version: int = 0x20F,
            magic: bytes = b"HdrS") -> Path:
    """A file with an x86 boot setup header: what the memory check reads of a kernel."""
    import struct

    header = bytearray(0x400)
    header[0x202:0x206] = magic
    struct.pack_into("<H", header, 0x206, version)
    struct.pack_into("<Q", header, 0x258, load_mib << 20)
    struct.pack_into("<I", header, 0x260, int(init_mib * (1 << 20)))
    path.write_bytes(bytes(header))
    return path


@pytest.mark.parametrize(("memory", "initrd_mib", "refused"), [
    (64, 0, True),    # 16 + 63.6 > 64: the decompressor has nowhere to go
    (80, 0, False),   # it fits
    (80, 2, True),    # the initrd, loaded into guest RAM too, does not
    (82, 2, False),
])
def test_memory_too_small_for_the_kernel_to_unpack(tmp_path: Path, memory: int, initrd_mib: int,
                                                    refused: bool) -> None:
    bzimage(tmp_path / "vmlinuz", init_mib=63.6)
    initrd = ""
    if initrd_mib:
        (tmp_path / "initrd").write_bytes(b"\1" * (initrd_mib << 20))
        initrd = 'initrd = "initrd"\n'
    spec = write_spec(tmp_path, HEAD + f'[vm.a]\nmemory = {memory}\nkernel = "vmlinuz"\n{initrd}')
    if not refused:
        load_checked(spec)
        return
    found = problems(spec)
    total = 16 + 64 + initrd_mib  # rounded up to whole MiB
    assert found == [
        f"{spec}:4: vm.a.memory: {memory} MiB cannot hold kernel {tmp_path}/vmlinuz: its setup header "
        f"asks for 63.6 MiB from the 16 MiB mark to unpack itself"
        + (f", plus {initrd_mib:.1f} MiB for initrd {tmp_path}/initrd" if initrd_mib else "")
        + f", {total} MiB in all; the guest would stop before its first line, or panic out of memory "
        f'(memory = "{-(-(total + 8) // 32) * 32}M" or more: the kernel needs room to run as well)']


@pytest.mark.parametrize("kernel", [
    {"magic": b"NotS"},          # not an x86 bzImage (another architecture's kernel): QEMU says
    {"version": 0x209},          # a boot protocol without init_size
    {"load_mib": 4096},          # values no kernel has: left to QEMU
    {"init_mib": 2048.0},
])
def test_kernels_the_check_cannot_read_are_left_to_qemu(tmp_path: Path, kernel: dict[str, Any]) -> None:
    bzimage(tmp_path / "vmlinuz", **{"init_mib": 63.6, **kernel})
    load_checked(write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 32\nkernel = "vmlinuz"\n'))


def test_a_short_kernel_file_is_left_to_qemu(tmp_path: Path) -> None:
    (tmp_path / "vmlinuz").write_bytes(b"HdrS")
    load_checked(write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 32\nkernel = "vmlinuz"\n'))


@pytest.mark.guest_files
def test_the_test_guest_in_64m_is_refused_with_its_numbers(tmp_path: Path, test_guest: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The real kernel: 64M hangs before the first line of the serial log (tried); 96M boots."""
    body = f'kernel = "{test_guest / "vmlinuz"}"\ninitrd = "{test_guest / "initrd.gz"}"\n'
    assert main(["validate", str(write_spec(tmp_path, HEAD + '[vm.a]\nmemory = "64M"\n' + body))]) == 2
    err = capsys.readouterr().err
    assert "vm.a.memory: 64 MiB cannot hold kernel" in err and "from the 16 MiB mark" in err
    assert main(["validate", str(write_spec(tmp_path, HEAD + '[vm.a]\nmemory = "96M"\n' + body))]) == 0


def test_a_kernel_that_is_a_fifo_is_reported_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "vmlinuz")
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 32\nkernel = "vmlinuz"\n')
    assert problems(spec) == [f"{spec}:5: vm.a.kernel: {tmp_path}/vmlinuz is a FIFO, not a file"]


def test_a_test_guest_not_built_yet_says_how_to_build_it(tmp_path: Path) -> None:
    """A fresh clone: the demo lab names examples/guest/, which `make demo` (tools/build_guest.py)
    builds; the command a user types first must say so, not only that the kernel is missing."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import EXAMPLES, ROOT

    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "build_guest.py", tmp_path / "tools")
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / "lab.toml", tmp_path / "examples")
    done = subprocess.run([sys.executable, "-m", "vmlaunch", "up", "examples/lab.toml"], cwd=tmp_path,
                          capture_output=True, text=True, check=False, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    hint = (f"(the test guest is not built yet: `make demo` in {tmp_path} builds it, or `make setup` "
            "(tools/build_guest.py) to only build it)")
    lines = done.stderr.splitlines()
    assert lines[:2] == [
        f"examples/lab.toml:20: vm.alpha.kernel: {tmp_path}/examples/guest/vmlinuz does not exist {hint}",
        f"examples/lab.toml:21: vm.alpha.initrd: {tmp_path}/examples/guest/initrd.gz does not exist {hint}",
    ]
    assert len(lines) == 5 and "Traceback" not in done.stderr
    # a file the builder does not make, or a folder that is not a checkout's: the usual hint
    spec = tmp_path / "examples" / "lab.toml"
    spec.write_text(spec.read_text().replace('"guest/vmlinuz"', '"guest/bzImage"', 1))
    assert problems(spec)[0].endswith("guest/bzImage does not exist (relative paths are relative to "
                                      "the spec file)")
    (tmp_path / "tools" / "build_guest.py").unlink()
    assert problems(spec)[1].endswith("guest/initrd.gz does not exist (relative paths are relative to "
                                      "the spec file)")


# --- what `up` refuses of files that are there: validate says it too, in up's words ------------------


def up_and_validate(spec: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, int, str]:
    """`up`'s exit code and message, then validate's."""
    up = main(["up", str(spec)])
    up_err = capsys.readouterr().err
    valid = main(["validate", str(spec)])
    return up, up_err, valid, capsys.readouterr().err


def test_validate_refuses_an_image_that_names_a_backing_file_as_up_does(
        tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    backing = 'json:{"driver":"raw","file":{"driver":"file","filename":"/etc/shadow"}}'
    subprocess.run(["qemu-img", "create", "-q", "-u", "-f", "qcow2", "-b", backing, "-F", "raw",
                    str(tmp_path / "base.qcow2"), "1M"], check=True)
    spec = write_spec(tmp_path, HEAD + '[image.base]\nfile = "base.qcow2"\n'
                      '[vm.a]\nmemory = 64\naccel = "tcg"\nimage = "base"\nssh = false\n')
    up, up_err, valid, err = up_and_validate(spec, capsys)
    message = (f"image base ({tmp_path}/base.qcow2): the qcow2 image names a backing file ({backing!r}); "
               "QEMU would open it for the guest, so an image could make the guest read any file on this "
               "host. vmlaunch boots only self-contained images")
    hint = ("flatten it into one file (qemu-img convert -O qcow2 IMAGE flat.qcow2) and use that, with its "
            "own checksum")
    assert up == 4 and f"vmlaunch: error: {message}\n  hint: {hint}\n" in up_err, up_err
    assert valid == 2
    assert err.splitlines() == [f"{spec}:4: image.base.file: {message} ({hint})",
                                "vmlaunch: 1 problem in the spec"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a file of another user)")
def test_validate_refuses_a_script_of_another_user_as_up_does(
        tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wire = tmp_path / "ifup"
    wire.write_text("#!/bin/sh\nexit 0\n")
    wire.chmod(0o755)
    os.chown(wire, 65534, 65534)
    spec = lab_with(tmp_path, 'kernel = "vmlinuz"\naccel = "tcg"\n[[vm.a.nic]]\nnetwork = "n"\n'
                    '[network.n]\ntype = "tap"\nup_script = "ifup"\n')
    up, up_err, valid, err = up_and_validate(spec, capsys)
    message = f"{wire} belongs to uid 65534 (nobody)"
    assert up == 3 and f"{spec}:11: network.n.up_script: {message}" in up_err, up_err
    shown = next(line for line in up_err.splitlines() if message in line).removeprefix("vmlaunch: error: ")
    hint = ("vmlaunch runs only scripts that no user but you and root can change, by a path no other "
            "user can change either")
    assert f"  hint: {hint}" in up_err
    assert valid == 2
    assert err.splitlines() == [f"{shown} ({hint})", "vmlaunch: 1 problem in the spec"]
