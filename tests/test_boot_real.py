"""Labs bigger than the host, with the real QEMU and the test guest under TCG: the VMs boot in waves
(`up --parallel`, [lab] boot_parallel), a guest that panics in a wave ends `up` at once, and a
kernel's timer check cannot panic a starved guest (no_timer_check under TCG)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vmlaunch.cli import main

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"


def lab(tmp_path: Path, guest: Path, name: str, count: int, *, lab_keys: str = "",
        appends: dict[int, str] | None = None) -> Path:
    text = f'[lab]\nname = "{name}"\n{lab_keys}[lab.memory]\nksm = false\n'  # the host's KSM left alone
    for index in range(count):
        append = (appends or {}).get(index, "console=ttyS0")
        text += (f'[vm.v{index}]\nmemory = "128M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                 f'initrd = "{guest}/initrd.gz"\nappend = "{append}"\n')
    spec = tmp_path / f"{name}.toml"
    spec.write_text(text)
    return spec


def test_the_vms_boot_one_by_one_when_asked(tmp_path: Path, run_dir: Path, test_guest: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    spec = lab(tmp_path, test_guest, "waves", 3)
    assert main(["up", str(spec), "--dry-run"]) == 0
    assert "\nboot: " in capsys.readouterr().out  # how many boot at once on this host, and why
    assert main(["-v", "up", str(spec), "--wait-for", READY, "--parallel", "1", "--timeout", "300",
                 "--timeline"]) == 0
    out, err = capsys.readouterr()
    try:
        table = out.splitlines()[-4:]  # the timeline: a header and a row per VM
        assert table[0].split() == ["VM", "qemu", "wave", "firmware", "loader", "kernel", "userspace",
                                    "total"], out
        assert [row.split()[0] for row in table[1:]] == ["v0", "v1", "v2"]
        assert main(["status", str(spec), "--json"]) == 0
        boot = json.loads(capsys.readouterr().out)["v2"]["boot"]
        assert set(boot) == {"qemu", "wave", "firmware", "loader", "kernel", "userspace"}, boot
        assert boot["wave"] > boot["qemu"]  # v2 waited paused while v0 and v1 booted
        assert "boot: at most 1 of the 3 VMs at once (--parallel 1)" in err
        events = [match.group(0) for match in re.finditer(r"v\d: (ready|continued)", err)]
        # each VM is let boot only once the one before it is ready
        assert events == ["v0: continued", "v0: ready", "v1: continued", "v1: ready", "v2: continued",
                          "v2: ready"], err
        # the guests' kernels were told to skip the timer check a starved vCPU fails
        assert main(["cmdline", str(spec), "v0"]) == 0
        assert "no_timer_check" in capsys.readouterr().out
    finally:
        assert main(["down", str(spec), "--timeout", "0"]) == 0


def test_the_lab_key_sets_the_width_and_a_panic_in_a_wave_ends_up(tmp_path: Path, run_dir: Path,
                                                                  test_guest: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """v1 panics while it boots: `up` ends then (not at its timeout), names it and its panic line, and
    rolls back; v2, still waiting for its turn, never ran."""
    spec = lab(tmp_path, test_guest, "panicwave", 3, lab_keys="boot_parallel = 1\n",
               appends={1: "console=ttyS0 rdinit=/no-such-init root=/dev/nowhere"})
    assert main(["-v", "up", str(spec), "--wait-for", READY, "--timeout", "600"]) == 4
    err = capsys.readouterr().err
    assert "boot: at most 1 of the 3 VMs at once ([lab] boot_parallel 1)" in err
    assert "v1: the guest panicked before its console printed 'VMLAUNCH-GUEST-READY': Kernel panic" in err
    assert "v2: continued" not in err
    assert "Traceback" not in err
    assert not (run_dir / "panicwave").exists()
    assert main(["logs", str(spec), "v1"]) == 0
    assert "Kernel panic - not syncing" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "two", "-1", "1.5"])
def test_a_parallel_that_is_not_a_count_is_refused(tmp_path: Path, test_guest: Path, bad: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    spec = lab(tmp_path, test_guest, "bad", 1)
    assert main(["up", str(spec), "--parallel", bad]) == 64
    err = capsys.readouterr().err
    assert "--parallel" in err and "is not a number of VMs" in err and "Traceback" not in err


def test_the_apis_wait_ends_at_a_panic(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    from vmlaunch import Lab, RuntimeFailure

    spec = lab(tmp_path, test_guest, "apipanic", 1,
               appends={0: "console=ttyS0 rdinit=/no-such-init root=/dev/nowhere"})
    with Lab(spec) as running:
        running.up()
        with pytest.raises(RuntimeFailure, match=r"v0: the guest panicked before its console printed "
                                                 r"'VMLAUNCH-GUEST-READY': Kernel panic - not syncing"):
            running.vm("v0").wait_for_console(READY, timeout=600)  # not its timeout: the panic ends it


def test_a_guest_that_reboots_after_its_panic_still_ends_the_wait(tmp_path: Path, run_dir: Path,
                                                                 test_guest: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """panic=1: the kernel reboots a second after its panic, and its next boot's lines follow the
    panic on the console: `up` still ends at the panic, not at its timeout."""
    spec = lab(tmp_path, test_guest, "reboots", 1,
               appends={0: "console=ttyS0 rdinit=/no-such-init root=/dev/nowhere panic=1"})
    assert main(["-q", "up", str(spec), "--wait-for", READY, "--timeout", "600"]) == 4
    err = capsys.readouterr().err
    assert "v0: the guest panicked before its console printed 'VMLAUNCH-GUEST-READY': Kernel panic" in err


def test_a_big_wait_prints_one_line_for_the_lab(tmp_path: Path, run_dir: Path, test_guest: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Seven guests booting one at a time: after 5 s more than four still wait, so the progress is
    one line for the lab ("2/7 ready; booting v2; 4 waiting to boot"), not a line per VM; once four
    or fewer wait, each VM's own line is back."""
    spec = lab(tmp_path, test_guest, "quiet", 7)
    assert main(["up", str(spec), "--wait-for", READY, "--parallel", "1", "--timeout", "600"]) == 0
    err = capsys.readouterr().err
    try:
        # at 5 s at most two are ready (a boot takes over 2 s): one line for the lab, none per VM
        assert re.search(r"^vmlaunch: waiting for 'VMLAUNCH-GUEST-READY', 5 s: \d/7 ready; booting v\d; "
                         r"\d waiting to boot$", err, re.M), err
        assert not re.search(r"^vmlaunch: v\d: waiting for 'VMLAUNCH-GUEST-READY', 5 s", err, re.M), err
    finally:
        assert main(["down", str(spec), "--timeout", "0"]) == 0
