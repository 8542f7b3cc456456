"""Driving a running VM for real (TCG, the test guest), where the guest can be hurt: a balloon asked
below the guest's floor leaves the guest where it was and alive, and a guest that panicked is shown
as such by `status`, the API and `balloon`. One booted VM serves every step."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.cli import main
from vmlaunch.core.wait import wait_until
from vmlaunch.layout.rundir import RunDir

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"
M = 1 << 20


@pytest.fixture
def lab(tmp_path: Path, run_dir: Path, test_guest: Path) -> Iterator[tuple[Path, RunDir]]:
    spec = tmp_path / "lab.toml"
    # agent = false: the guest idle, only its kernel and a shell, so that its floor is what they hold.
    # A guest whose programs keep allocating (the command channel's agent polls and forks) can run out
    # of memory under a balloon pushed below its floor, and panic: the memory guide says so.
    spec.write_text(f'[lab]\nname = "floor"\n[vm.web]\nmemory = "128M"\naccel = "tcg"\nagent = false\n'
                    f'kernel = "{test_guest}/vmlinuz"\ninitrd = "{test_guest}/initrd.gz"\n')
    assert main(["-q", "up", str(spec), "--wait-for", READY, "--timeout", "120"]) == 0
    try:
        yield spec, RunDir.of(run_dir, "floor")
    finally:
        main(["-q", "down", str(spec), "--timeout", "2"])


def type_in(run_dir: RunDir, command: str) -> None:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(run_dir.vm("web").console))
        conn.sendall(f"\n{command}\n".encode())
        time.sleep(0.3)


def console(run_dir: RunDir) -> str:
    return run_dir.vm("web").serial_log.read_text(errors="replace")


def status_of(spec: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    capsys.readouterr()
    assert main(["status", str(spec), "--json"]) == 0
    row: dict[str, object] = json.loads(capsys.readouterr().out)["web"]
    return row


def test_a_balloon_below_the_floor_leaves_the_guest_alive_and_a_panic_shows(
        lab: tuple[Path, RunDir], capsys: pytest.CaptureFixture[str]) -> None:
    from vmlaunch.api import Lab
    from vmlaunch.errors import RuntimeFailure

    spec, run_dir = lab
    for size in ("16M", "24M", "40M"):  # all under what this guest's kernel and initramfs hold
        capsys.readouterr()
        assert main(["balloon", str(spec), "web", size]) == 4
        err = capsys.readouterr().err
        assert f"short of {size}" in err and "the target is back at 128M" in err, err
        assert "Traceback" not in err
    # The API does the same, and the guest went back to all of its memory.
    vm = Lab(spec).vm("web")
    with pytest.raises(RuntimeFailure, match="the target is back at 128M"):
        vm.balloon(20 * M)
    assert wait_until(lambda: vm.balloon() == 128 * M or None, 10) is True
    # A guest left squeezing would OOM-kill its shell or panic: its shell still answers, a second on.
    time.sleep(1)
    type_in(run_dir, "echo alive-$((40+2))")
    wait_until(lambda: "alive-42" in console(run_dir) or None, 10)
    text = console(run_dir)
    assert "Kernel panic" not in text and "oom-killer" not in text
    row = status_of(spec, capsys)
    assert (row["state"], row["run_state"], row["why"]) == ("running", "running", None)
    # Its balloon driver still answers: a size it can give is reached.
    assert vm.balloon(112 * M) == 112 * M
    assert vm.balloon(128 * M) == 128 * M

    # Now the guest panics: QEMU runs on (no pvpanic driver in it), `status` reads the console.
    type_in(run_dir, "echo c > /proc/sysrq-trigger")
    wait_until(lambda: "Kernel panic - not syncing" in console(run_dir) or None, 30)
    row = status_of(spec, capsys)
    assert row["state"] == "guest-panicked", row  # QEMU's name for it
    assert "Kernel panic - not syncing" in str(row["why"])
    assert vm.status().state == "guest-panicked"
    capsys.readouterr()
    assert main(["status", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "web " in out and " guest-panicked " in out and "guest-panicked: Kernel panic - not syncing" in out
    assert main(["balloon", str(spec), "web", "100M"]) == 4
    assert "the guest panicked" in capsys.readouterr().err
    # `down` does not wait for the power button of a guest that cannot answer it.
    assert main(["down", str(spec)]) == 0
    assert "web: quit (the guest panicked)" in capsys.readouterr().err


def test_a_panic_ends_the_wait_for_a_console_line_at_once(tmp_path: Path, run_dir: Path, test_guest: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A guest that panics while booting will never print its ready line: `up` fails then, naming the
    panic, and rolls back; its console stays readable with `logs`."""
    spec = tmp_path / "lab.toml"
    spec.write_text(f'[lab]\nname = "boom"\n[vm.p]\nmemory = "128M"\naccel = "tcg"\n'
                    f'kernel = "{test_guest}/vmlinuz"\ninitrd = "{test_guest}/initrd.gz"\n'
                    'append = "console=ttyS0 rdinit=/no-such-init root=/dev/nowhere"\n')
    assert main(["-q", "up", str(spec), "--wait-for", READY, "--timeout", "600"]) == 4
    err = capsys.readouterr().err
    assert "p: the guest panicked before its console printed 'VMLAUNCH-GUEST-READY': Kernel panic" in err
    assert "Traceback" not in err
    assert not (run_dir / "boom").exists()
    assert main(["logs", str(spec), "p"]) == 0
    assert "Kernel panic - not syncing" in capsys.readouterr().out
