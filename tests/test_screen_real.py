"""The screen, the keyboard and the evidence of a failing test, on the real test guest (no NIC: nothing on
the host's network)."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path

import pytest

import vmlaunch
from vmlaunch.cli import main
from vmlaunch.errors import EXIT_CANT_CREATE, OutputRefused, RuntimeFailure, UsageError
from vmlaunch.rig.screen import PNG_SIGNATURE

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
pytest_plugins = ["pytester"]


def spec_text(guest: Path, name: str, video: str = "") -> str:
    return f"""
[lab]
name = "{name}"
[lab.memory]
ksm = false
[vm.solo]
memory = "128M"
accel = "tcg"
kernel = "{guest}/vmlinuz"
initrd = "{guest}/initrd.gz"
{video}
"""


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:6]}"


def is_png(path: Path) -> bool:
    return path.read_bytes().startswith(PNG_SIGNATURE) and path.stat().st_size > 100


def test_screenshot_and_keys(tmp_path: Path, run_dir: Path, test_guest: Path,
                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_text(spec_text(test_guest, unique("scr")))
    with vmlaunch.Lab(spec) as lab:
        vm = lab.vm("solo")
        vm.wait_for_console("VMLAUNCH-GUEST-READY", timeout=60)
        (tmp_path / "shots").mkdir()
        shot = vm.screenshot(tmp_path / "shots" / "screen.png")
        assert shot == tmp_path / "shots" / "screen.png" and is_png(shot)
        assert [p.name for p in shot.parent.iterdir()] == ["screen.png"]  # no temp file left behind
        # the guest's keyboard: Alt+SysRq+H makes its kernel print the SysRq help on the console
        with pytest.raises(UsageError, match="unknown key 'sysrx' in 'alt-sysrx-h'"):
            vm.send_keys("alt-sysrx-h")
        vm.send_keys("alt-sysrq-h")
        vm.wait_for_console("sysrq: HELP", timeout=30)
        vm.send_keys(text="Hello, world!\n", hold_ms=20)  # shifted and unshifted keys, typed
        # the CLI: a default file name in the working directory, its path printed
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        assert main(["-q", "screenshot", str(spec), "solo"]) == 0
        printed = Path(capsys.readouterr().out.strip())
        assert printed.parent == tmp_path and printed.name.startswith("solo-") and is_png(printed)
        assert main(["-q", "send-keys", str(spec), "solo", "shift-a", "--text", "b"]) == 0
        assert main(["-q", "send-keys", str(spec), "solo", "nokey"]) == 64
        # evidence of a running lab, from the API
        folder = lab.collect(tmp_path / "evidence")
        assert is_png(folder / "solo" / "screen.png")
        assert "VMLAUNCH-GUEST-READY" in (folder / "solo" / "serial.log").read_text()
        assert "-device" in (folder / "solo" / "qemu.log").read_text()  # its command line
        assert json.loads((folder / "status.json").read_text())["solo"]["state"] == "running"
    with pytest.raises(RuntimeFailure, match="VM solo is not running"):
        vm.screenshot(tmp_path / "late.png")


def test_a_vm_without_a_screen(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_text(spec_text(test_guest, unique("noscr"), 'video = "none"'))
    with vmlaunch.Lab(spec, wait_for="VMLAUNCH-GUEST-READY") as lab:
        with pytest.raises(RuntimeFailure, match='VM solo has no screen to capture'):
            lab.vm("solo").screenshot(tmp_path / "none.png")
        assert not (tmp_path / "none.png").exists()
        folder = lab.collect(tmp_path / "evidence")
        assert not (folder / "solo" / "screen.png").exists()
        assert "solo/screen.png: VM solo has no screen" in (folder / "README.txt").read_text()
        assert (folder / "solo" / "serial.log").stat().st_size > 0


def test_a_screenshot_or_evidence_never_replaces_nor_follows_what_stands_there(
        tmp_path: Path, run_dir: Path, test_guest: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO, a device node or a symlink at the screenshot's name is refused with one line (exit 73)
    and left as it was (`screenshot ... /dev/null` made the host's /dev/null a PNG); evidence never
    writes through a link in its folder, a subfolder's included."""
    canary, elsewhere = tmp_path / "canary", tmp_path / "elsewhere"
    canary.write_text("the host's own file\n")
    elsewhere.mkdir()
    fifo, link, device = tmp_path / "fifo.png", tmp_path / "link.png", tmp_path / "null.png"
    os.mkfifo(fifo)
    link.symlink_to(canary)
    try:
        os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        device = Path("/dev/null")  # refused before it is touched: checked still a device below
    spec = tmp_path / "lab.toml"
    spec.write_text(spec_text(test_guest, unique("scrout")))
    with vmlaunch.Lab(spec, wait_for="VMLAUNCH-GUEST-READY") as lab:
        capsys.readouterr()
        for target, kind in ((fifo, "a FIFO"), (device, "a character device"), (link, "a symlink")):
            assert main(["-q", "screenshot", str(spec), "solo", str(target)]) == EXIT_CANT_CREATE, target
            assert capsys.readouterr().err == (f"vmlaunch: error: will not write {target}: it is {kind}, "
                                               "not a regular file (name a new file, or a regular file to "
                                               "replace)\n")
        with pytest.raises(OutputRefused, match="it is a folder"):
            lab.vm("solo").screenshot(tmp_path)
        assert stat.S_ISFIFO(fifo.lstat().st_mode) and stat.S_ISCHR(device.lstat().st_mode)
        assert link.is_symlink() and canary.read_text() == "the host's own file\n"
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp left
        # evidence: its VM's subfolder a link to a host folder, a file of it a link to a host file
        folder = tmp_path / "evidence"
        folder.mkdir()
        (folder / "solo").symlink_to(elsewhere)
        (folder / "status.json").symlink_to(canary)
        assert main(["-q", "evidence", str(spec), str(folder)]) == 0
        index = (folder / "README.txt").read_text()
        assert "solo/serial.log: cannot write it: it is a symlink, not a folder" in index
        assert "solo/screen.png: cannot write it: it is a symlink, not a folder" in index
        assert "status.json: cannot write it: it is a symlink, not a regular file" in index
        assert list(elsewhere.iterdir()) == [] and canary.read_text() == "the host's own file\n"
        (folder / "solo").unlink()
        assert main(["-q", "evidence", str(spec), str(folder)]) == 0  # a folder of its own: all there
        assert is_png(folder / "solo" / "screen.png") and (folder / "solo" / "serial.log").stat().st_size > 0


INNER = """
import pytest

def test_passes(vmlaunch_lab):
    vmlaunch_lab("lab.toml", wait_for="VMLAUNCH-GUEST-READY")

def test_fails(vmlaunch_lab):
    lab = vmlaunch_lab("lab.toml", wait_for="VMLAUNCH-GUEST-READY")
    assert lab.vm("solo").pid < 0, "deliberately failing"
"""


@pytest.mark.parametrize("keep", [False, True], ids=["failing-only", "keep"])
def test_a_failing_test_leaves_its_evidence(pytester: pytest.Pytester, run_dir: Path, test_guest: Path,
                                            keep: bool) -> None:
    name = unique("evid")
    pytester.makefile(".toml", lab=spec_text(test_guest, name))
    pytester.makepyfile(test_inner=INNER)
    args = ["-p", "no:cacheprovider", "-rA", *(["--vmlaunch-keep"] if keep else [])]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1, failed=1)
    basetemp = next(pytester.path.glob("**/test_fails0"))
    folder = basetemp / f"vmlaunch-{name}"
    expected = {"README.txt", "status.json", "wire.json", "manager.log", "solo/serial.log", "solo/qemu.log",
                "solo/screen.png"}
    saved = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
    assert saved - {"events.jsonl"} == expected  # events: the guest's RESUME, if the manager heard it
    for file in expected:
        assert (folder / file).stat().st_size > 0, file
    assert is_png(folder / "solo" / "screen.png")
    assert "VMLAUNCH-GUEST-READY" in (folder / "solo" / "serial.log").read_text()
    assert json.loads((folder / "status.json").read_text())["solo"]["state"] == "running"
    assert "lab manager of" in (folder / "manager.log").read_text()
    # the report names the folder: in the failure's section and in the summary
    result.stdout.fnmatch_lines(["*vmlaunch evidence*", f"*lab {name}: {folder}*"])
    result.stdout.fnmatch_lines([f"test_inner.py::test_fails: {folder}"])
    passed = next(pytester.path.glob("**/test_passes0")) / f"vmlaunch-{name}"
    assert passed.is_dir() is keep  # a passing test's only with --vmlaunch-keep
    assert not os.listdir(run_dir)  # every lab went down
