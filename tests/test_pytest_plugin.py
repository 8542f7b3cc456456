"""The pytest plugin (vmlaunch/pytest_plugin.py) as a test suite meets it: the errors a test catches
come from `vmlaunch` itself, and a failure of vmlaunch's own kind shows the test's lines and the
one-line message, not vmlaunch's internals (a failure of the real test guest, run by pytester)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import vmlaunch

pytest_plugins = ["pytester"]
ERRORS = ("VmlaunchError", "SpecError", "HostError", "RuntimeFailure", "UsageError", "AgentError",
          "GuestPaused", "CommandTimedOut", "CommandFailed", "QmpError")


def test_the_errors_a_test_catches_are_importable_from_vmlaunch() -> None:
    from vmlaunch import AgentError, CommandFailed, CommandTimedOut, GuestPaused, QmpError, RuntimeFailure

    for error in (AgentError, CommandFailed, CommandTimedOut, GuestPaused, QmpError):
        assert issubclass(error, RuntimeFailure)
    assert set(ERRORS) <= set(vmlaunch.__all__)
    assert all(issubclass(getattr(vmlaunch, name), vmlaunch.VmlaunchError) for name in ERRORS)


def test_importing_vmlaunch_stays_light() -> None:
    """The CLI imports the package first: its exports load on first use, not at `import vmlaunch`."""
    code = ("import sys, vmlaunch; heavy = [m for m in sys.modules if m.startswith('vmlaunch.') and m not in "
            "('vmlaunch.core', 'vmlaunch.core.version')]; print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


INNER = """
import pytest
import vmlaunch


def test_a_command_fails(vmlaunch_lab):
    lab = vmlaunch_lab("lab.toml", wait_for="VMLAUNCH-GUEST-READY")
    lab.vm("solo").succeed("false")


def test_the_error_is_caught(vmlaunch_lab):
    lab = vmlaunch_lab("lab.toml", wait_for="VMLAUNCH-GUEST-READY")
    with pytest.raises(vmlaunch.CommandFailed) as caught:
        lab.vm("solo").succeed("exit 3")
    assert caught.value.result.exit_code == 3
"""


@pytest.mark.qemu
@pytest.mark.guest
def test_a_failing_command_shows_the_test_and_the_message(pytester: pytest.Pytester, run_dir: Path,
                                                          test_guest: Path) -> None:
    pytester.makefile(".toml", lab=f"""
[lab]
name = "plug{uuid.uuid4().hex[:6]}"
[lab.memory]
ksm = false
[vm.solo]
memory = "128M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
""")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    failure = out.split("_ test_a_command_fails _", 1)[1].split("- Captured", 1)[0]
    failure = failure.split("vmlaunch evidence", 1)[0]
    assert re.search(r"^>\s+lab\.vm\(\"solo\"\)\.succeed\(\"false\"\)$", failure, re.M), failure
    message = r"^E\s+vmlaunch\.\S*CommandFailed: solo: 'false' exited with status 1$"
    assert re.search(message, failure, re.M), failure
    assert "vmlaunch/" not in failure.replace("test_inner.py", ""), failure  # none of vmlaunch's frames
    assert len(failure.strip().splitlines()) <= 12, failure


FRESH = """
def test_a_fresh_vm_per_test(vmlaunch_fresh):
    vm = vmlaunch_fresh("lab.toml", "solo")
    vm.succeed("echo mine > /tmp/mark")
    assert False, "on purpose"


def test_the_next_one_is_fresh(vmlaunch_fresh):
    vm = vmlaunch_fresh("lab.toml", "solo")
    assert vm.run("test -e /tmp/mark").exit_code == 1
"""


@pytest.mark.qemu
@pytest.mark.guest
def test_vmlaunch_fresh_gives_each_test_its_own_vm_and_keeps_a_failures_evidence(
        pytester: pytest.Pytester, run_dir: Path, test_guest: Path) -> None:
    pytester.makefile(".toml", lab=f"""
[lab]
name = "fresh{uuid.uuid4().hex[:6]}"
[vm.solo]
memory = "128M"
accel = "tcg"
template = true
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
""")
    pytester.makepyfile(test_inner=FRESH)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    saved = re.search(r"test_a_fresh_vm_per_test: (\S+vmlaunch-run-[0-9a-f]{8})", result.stdout.str())
    assert saved is not None, result.stdout.str()
    assert (Path(saved.group(1)) / "solo" / "serial.log").exists()
    assert not [entry for entry in os.listdir(run_dir) if not entry.startswith(".")]  # every run gone
    assert not os.listdir(run_dir / ".throwaway")
