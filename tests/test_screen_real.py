"""The screen, the keyboard and the evidence of a failing test, on the real test guest (no NIC: nothing on
the host's network)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

import vmlaunch
from vmlaunch.cli import main
from vmlaunch.errors import RuntimeFailure, UsageError
from vmlaunch.runtime.screen import PNG_SIGNATURE

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
