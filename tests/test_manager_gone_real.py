"""Nothing of a lab outlives it (issue 48), for real (TCG, the test guest): a lab manager whose settings,
journal or run dir go away under it stops within a few rounds and says why in its log; `up`
interrupted at instants across the manager's start, then `down`, leaves no manager; and `doctor`
names a manager and a QEMU whose lab no command knows, with the command that ends each."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.cli import main
from vmlaunch.core.wait import wait_until
from vmlaunch.host.processes import Kind, of_run_dir
from vmlaunch.lab.journal import Journal
from vmlaunch.lab.process import alive
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.manager import ManagerRecord

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
ROUNDS = 10.0  # seconds: a few of the manager's 1 s rounds, on a busy host


def spec(tmp_path: Path, guest: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[lab]\nname = "{name}"\n[lab.memory]\nksm = false\n'
                    f'[vm.a]\nmemory = "128M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                    f'initrd = "{guest}/initrd.gz"\n')
    return path


def manager_pid(run_dir: RunDir) -> int:
    entry = Journal.load(run_dir).entry("manager", "lab")
    assert entry is not None and isinstance(entry.record, ManagerRecord)
    return entry.record.pid


def stops(pid: int) -> bool:
    try:
        wait_until(lambda: not alive(pid), ROUNDS, interval=0.1)
    except Exception:
        return False
    return True


@pytest.fixture
def lab(tmp_path: Path, run_dir: Path, test_guest: Path) -> Iterator[tuple[Path, RunDir]]:
    path = spec(tmp_path, test_guest, "gone")
    assert main(["up", str(path)]) == 0
    try:
        yield path, RunDir.of(run_dir, "gone")
    finally:
        assert main(["down", str(path), "--timeout", "1"]) == 0


def test_a_manager_stops_when_its_settings_journal_or_run_dir_go(
        lab: tuple[Path, RunDir], capsys: pytest.CaptureFixture[str]) -> None:
    """One lab, three losses: between them `up` starts the manager again (it finds it gone)."""
    path, run_dir = lab
    log = run_dir.manager_log
    # Its settings file alone.
    pid = manager_pid(run_dir)
    run_dir.manager_config.unlink()
    assert stops(pid), "the manager did not stop when its settings file was removed"
    assert f"its settings {run_dir.manager_config} are gone" in log.read_text()
    assert main(["up", str(path)]) == 0  # revives it
    # Its journal alone (kept aside, so that `down` can take the lab down after).
    pid = manager_pid(run_dir)
    assert pid != 0 and alive(pid)
    journal = run_dir.state.read_bytes()
    run_dir.state.unlink()
    try:
        assert stops(pid), "the manager did not stop when its lab's journal was removed"
        assert f"the lab's journal {run_dir.state} is gone" in log.read_text()
    finally:
        run_dir.state.write_bytes(journal)
    assert main(["up", str(path)]) == 0
    # Its whole run dir (moved away, and put back for `down`): held still meanwhile, the manager and
    # the QEMU are what a removed run dir leaves, and doctor names both.
    pid = manager_pid(run_dir)
    qemu = Journal.load(run_dir).vms["a"].pid
    assert qemu is not None
    aside = run_dir.path.with_name("gone-aside")
    os.kill(pid, signal.SIGSTOP)
    try:
        run_dir.path.rename(aside)
        capsys.readouterr()
        main(["doctor", "--json"])
        found = [f for f in json.loads(capsys.readouterr().out)["host"] if f["id"] == "host.stray_process"]
        by_fix = {f["fix"]: f for f in found}
        assert f"kill {pid}" in by_fix and f"kill {qemu}" in by_fix, found
        assert by_fix[f"kill {pid}"]["found"] == (f"a lab manager of lab gone (pid {pid}) runs without its "
                                                 f"lab: its run dir {run_dir.path} is gone")
        assert by_fix[f"kill {qemu}"]["status"] == "warn" and "QEMU of VM a of lab gone" in \
            by_fix[f"kill {qemu}"]["found"]
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        assert stops(pid), "the manager did not stop when its run dir was removed"
        assert f"its run dir {run_dir.path} is gone" in (aside / "manager.log").read_text()
    finally:
        aside.rename(run_dir.path)


INSTANTS = [(Kind.MANAGER, 0.0), (Kind.MANAGER, 0.05), (Kind.MANAGER, 0.2), (Kind.QEMU, 0.0),
            (Kind.QEMU, 0.3)]


@pytest.mark.parametrize("kind, after", INSTANTS, ids=[f"{k.name.lower()}+{a}s" for k, a in INSTANTS])
def test_up_interrupted_across_the_managers_start_leaves_no_manager_after_down(
        tmp_path: Path, run_dir: Path, test_guest: Path, kind: Kind, after: float) -> None:
    """SIGINT to `up` the moment the manager's (or the QEMU's) process shows, or a little after:
    whatever the instant, `down` leaves no manager of the lab running."""
    path = spec(tmp_path, test_guest, "intr")
    lab_dir = RunDir.of(run_dir, "intr")
    up = subprocess.Popen([sys.executable, "-m", "vmlaunch", "up", str(path)], stderr=subprocess.PIPE,
                          text=True)
    try:
        wait_until(lambda: bool(of_run_dir(lab_dir.path, kind)) or up.poll() is not None, 60, interval=0.005)
        time.sleep(after)
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
        assert "Traceback" not in err, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            up.kill()
        up.wait()
    assert main(["down", str(path), "--timeout", "1"]) == 0
    assert of_run_dir(lab_dir.path, Kind.MANAGER) == [], "a manager of the lab outlived its down"
    assert of_run_dir(lab_dir.path, Kind.QEMU) == []
