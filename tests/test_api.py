"""The Python API and the pytest fixture, on a real guest (user networking: nothing on the host)."""

from __future__ import annotations

from pathlib import Path

import pytest

import vmlaunch
from vmlaunch.errors import RuntimeFailure

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
SPEC = """
[lab]
name = "api"
[network.out]
type = "user"
[vm.solo]
memory = "192M"
accel = "tcg"
kernel = "GUEST/vmlinuz"
initrd = "GUEST/initrd.gz"
[[vm.solo.nic]]
network = "out"
"""


def spec(tmp_path: Path, guest: Path) -> Path:
    path = tmp_path / "lab.toml"
    path.write_text(SPEC.replace("GUEST", str(guest)))
    return path


@pytest.mark.fast  # one real boot through the API: `make test-fast`'s
def test_lab_context_manager(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    with vmlaunch.Lab(spec(tmp_path, test_guest)) as lab:
        assert (lab.name, lab.vms) == ("api", ("solo",))
        vm = lab.vm("solo")
        assert "VMLAUNCH-GUEST-READY" in vm.wait_for_console("VMLAUNCH-GUEST-READY", timeout=60)
        assert "VMLAUNCH-GUEST-READY" in next(vm.follow_console())  # the output so far comes first
        assert vm.pid == vm.status().pid
        assert vm.qmp("query-status")["status"] == "running"
        assert vm.balloon() == 192 << 20
        assert vm.status().state == "running"
        with pytest.raises(RuntimeFailure, match="did not appear on the console within 0.5 s"):
            vm.wait_for_console("never printed", timeout=0.5)
    assert not (run_dir / "api").exists()
    assert lab.status()["solo"].state == "stopped"


def test_fixture_tears_down_even_when_the_test_fails(tmp_path: Path, run_dir: Path,
                                                     test_guest: Path) -> None:
    import subprocess
    import sys

    spec(tmp_path, test_guest)
    inner = tmp_path / "test_inner.py"
    inner.write_text("""
def test_uses_a_lab(vmlaunch_lab):
    # beside this file, wherever pytest runs; ready, so that the teardown's ACPI press is heard (one
    # made while the guest boots is lost, and waited out for 10 s)
    lab = vmlaunch_lab("lab.toml", wait_for="VMLAUNCH-GUEST-READY")
    assert lab.vm("solo").pid > 0
    raise AssertionError("the test fails; the lab must go down anyway")
""")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(inner)],
                          capture_output=True, text=True, check=False, cwd=elsewhere)
    assert done.returncode == 1, done.stdout
    assert "the lab must go down anyway" in done.stdout
    assert not (run_dir / "api").exists()  # no run dir: the VM was stopped and the lab taken down
