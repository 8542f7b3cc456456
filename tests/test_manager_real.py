"""The lab manager for real (TCG, the test guest): the autonomic balloon keeps three 256M guests within
a 640M budget while one of them allocates 160M and gives the memory back after; a user's own QMP
connection stays usable all along; the manager survives a VM killed, a VM taken down and brought back,
and its own death (`up` starts it again), and `down` stops it and keeps its log."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.api import Lab
from vmlaunch.cli import main
from vmlaunch.core.wait import wait_until
from vmlaunch.lab.journal import Journal
from vmlaunch.lab.process import alive
from vmlaunch.layout.rundir import RunDir
from vmlaunch.qemu.qmp import QuickQmp

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"
M = 1 << 20


def spec(tmp_path: Path, guest: Path, budget: str = "640M") -> Path:
    vms = "".join(f'[vm.{name}]\nmemory = "256M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                  f'initrd = "{guest}/initrd.gz"\n[vm.{name}.balloon]\npolicy = "auto"\nmin = "96M"\n'
                  for name in ("a", "b", "c"))
    path = tmp_path / "lab.toml"
    path.write_text(f'[lab]\nname = "mgr"\n[lab.memory]\nbudget = "{budget}"\nksm = false\n{vms}')
    return path


@pytest.fixture
def lab(tmp_path: Path, run_dir: Path, test_guest: Path) -> Iterator[tuple[Path, RunDir]]:
    path = spec(tmp_path, test_guest)
    assert main(["up", str(path), "--wait-for", READY, "--timeout", "120"]) == 0
    try:
        yield path, RunDir.of(run_dir, "mgr")
    finally:
        main(["down", str(path)])


def status(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    capsys.readouterr()
    assert main(["status", str(path), "--json"]) == 0
    rows: dict[str, dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def memory(row: dict[str, object]) -> dict[str, int]:
    found = row["memory"]
    assert isinstance(found, dict)
    return found


def actuals(run_dir: RunDir) -> dict[str, int]:
    """What the manager saw last (read from its state file, not over QMP: the test holds a user's
    connection on the first monitor in the meantime)."""
    doc = json.loads(run_dir.manager_state.read_text())
    return {name: vm["actual"] for name, vm in doc["vms"].items()}


def type_in(run_dir: RunDir, vm: str, command: str) -> None:
    """A command for the guest's console shell."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(run_dir.vm(vm).console))
        conn.sendall(f"\n{command}\n".encode())
        time.sleep(0.3)


def console(run_dir: RunDir, vm: str) -> str:
    return run_dir.vm(vm).serial_log.read_text(errors="replace")


def manager_pid(run_dir: RunDir) -> int:
    entry = Journal.load(run_dir).entry("manager", "lab")
    assert entry is not None
    pid: int = entry.record.pid  # type: ignore[attr-defined]
    return pid


def test_the_balloon_follows_a_guest_that_needs_memory_within_the_budget(
        lab: tuple[Path, RunDir], capsys: pytest.CaptureFixture[str]) -> None:
    path, run_dir = lab
    # The maximums (768M) are over the budget: the manager brings the lab under it, the idle guests
    # give their spare memory back.
    wait_until(lambda: run_dir.manager_state.exists() and sum(actuals(run_dir).values()) <= 640 * M
               and max(actuals(run_dir).values()) < 160 * M, 90, interval=0.5)
    # A user's QMP tool holds the first monitor the whole time: the manager has its own.
    with QuickQmp(run_dir.vm("a").qmp, timeout=5) as user:
        type_in(run_dir, "a", 'for i in $(seq 20); do dd if=/dev/urandom of=/tmp/hog$i bs=1M count=8 '
                              '2>/dev/null; sleep 1; done; echo HOG-$((6*7))')
        seen: list[dict[str, int]] = []

        def grown() -> bool:
            now = actuals(run_dir)
            seen.append(now)
            return "HOG-42" in console(run_dir, "a") and now["a"] >= 200 * M

        wait_until(grown, 150, interval=0.5)
        assert int(user.cmd("query-balloon")["actual"]) >= 200 * M
        assert all(sum(sample.values()) <= 640 * M for sample in seen), seen
        assert max(sample["b"] for sample in seen) < 160 * M  # the idle ones stayed small
    # Statuses of everything: the manager's targets, the guests' free memory, the lab's budget.
    rows = status(path, capsys)
    assert memory(rows["a"])["target"] >= 200 * M and memory(rows["a"])["max"] == 256 * M
    assert memory(rows["a"])["guest_free"] > 0 and memory(rows["b"])["min"] == 96 * M
    lab_memory = rows["a"]["lab_memory"]
    assert isinstance(lab_memory, dict) and lab_memory["budget"] == 640 * M
    assert str(lab_memory["manager"]).startswith("running")
    # The hog stops: its memory goes back.
    type_in(run_dir, "a", "rm -f /tmp/hog*")
    wait_until(lambda: actuals(run_dir)["a"] <= 150 * M, 90, interval=0.5)
    for vm in ("a", "b", "c"):
        assert "Out of memory" not in console(run_dir, vm), vm
    capsys.readouterr()
    assert main(["logs", str(path), "--manager"]) == 0
    log = capsys.readouterr().out
    assert "a: target" in log and "short:" in log and "plenty:" in log


def test_the_manager_outlives_vms_and_itself(
        lab: tuple[Path, RunDir], capsys: pytest.CaptureFixture[str]) -> None:
    path, run_dir = lab
    wait_until(lambda: run_dir.manager_state.exists() and len(actuals(run_dir)) == 3, 60, interval=0.5)
    first = manager_pid(run_dir)
    # A VM crashes: the manager drops it and goes on with the others.
    os.kill(int(json.loads(run_dir.manager_state.read_text())["vms"]["c"]["pid"]), signal.SIGKILL)
    wait_until(lambda: set(actuals(run_dir)) == {"a", "b"}, 30, interval=0.5)
    # A VM taken down and brought back is watched again.
    assert main(["down", str(path), "b"]) == 0
    wait_until(lambda: set(actuals(run_dir)) == {"a"}, 30, interval=0.5)
    assert main(["up", str(path), "b", "--wait-for", READY, "--timeout", "120"]) == 0
    wait_until(lambda: set(actuals(run_dir)) == {"a", "b"}, 30, interval=0.5)
    assert manager_pid(run_dir) == first
    # The manager itself dies: status says so, and `up` starts it again.
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: not alive(first), 10)
    rows = status(path, capsys)
    assert str(rows["a"]["lab_memory"]["manager"]).startswith("gone")  # type: ignore[index]
    assert main(["up", str(path), "--wait-for", READY, "--timeout", "120"]) == 0  # c comes back too
    second = manager_pid(run_dir)
    assert second != first
    wait_until(lambda: set(actuals(run_dir)) == {"a", "b", "c"} and
               json.loads(run_dir.manager_state.read_text())["pid"] == second, 30, interval=0.5)
    api = Lab(path)  # the Python API sees the same
    assert f"lab manager of mgr started (pid {second})" in api.manager_log()
    row = api.status()["a"]
    assert row.memory is not None and row.memory.max == 256 * M and row.memory.policy == "auto"
    assert row.lab_memory is not None and row.lab_memory.budget == 640 * M
    # `down` stops it; its log is kept.
    assert main(["down", str(path)]) == 0
    assert not alive(second)  # gone, or a zombie its new parent has not reaped yet
    capsys.readouterr()
    assert main(["logs", str(path), "--manager"]) == 0
    log = capsys.readouterr().out
    assert f"lab manager of mgr started (pid {second})" in log and "stopped" in log
