"""The runtime driven directly, in this process: executor (up, down, describe), journal, control and
qemu, on real guests under TCG. User and socket networks only: nothing is created on the host."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.compile.compiler import compile_lab
from vmlaunch.compile.plan import Plan
from vmlaunch.core.wait import wait_until
from vmlaunch.errors import RuntimeFailure, UsageError
from vmlaunch.host.facts import detect_host
from vmlaunch.lab import process as qemu
from vmlaunch.lab.journal import Journal, JournalError
from vmlaunch.runtime import control, executor
from vmlaunch.spec.load import load_lab

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"
SPEC = """
[lab]
name = "rt"
[network.lan]
type = "socket"
[vm.a]
memory = "128M"
accel = "tcg"
kernel = "GUEST/vmlinuz"
initrd = "GUEST/initrd.gz"
[[vm.a.disk]]
file = "a.img"
size = "8M"
[[vm.a.nic]]
network = "lan"
[vm.b]
memory = "128M"
accel = "tcg"
kernel = "GUEST/vmlinuz"
initrd = "GUEST/initrd.gz"
[[vm.b.nic]]
network = "lan"
"""


def plan_of(tmp_path: Path, guest: Path, text: str = SPEC, vms: tuple[str, ...] = ()) -> Plan:
    spec = tmp_path / "lab.toml"
    spec.write_text(text.replace("GUEST", str(guest)))
    return compile_lab(load_lab(spec), detect_host(), vms)


@pytest.fixture
def lab(tmp_path: Path, run_dir: Path, test_guest: Path) -> Iterator[Plan]:
    plan = plan_of(tmp_path, test_guest)
    yield plan
    executor.down(plan.run_dir, timeout=1, force=True)
    assert not plan.run_dir.path.exists()


def test_up_status_control_down(lab: Plan, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vmlaunch")
    pids = executor.up(lab, spec=tmp_path / "lab.toml", wait_for=READY, timeout=120)
    assert set(pids) == {"a", "b"} and all(qemu.alive(pid) for pid in pids.values())
    assert "a: ready" in caplog.text
    journal = Journal.load(lab.run_dir)
    # two VMs as root: host KSM on while the lab runs (tests/test_ksm*.py has the rest), and each QEMU
    # under a uid of its own (tests/test_confine*.py)
    assert [e.kind for e in journal.resources] == ["image", "ksm", "manager", "vm-user", "vm-user"]
    assert set(journal.vms) == {"a", "b"}
    assert journal.spec == str(tmp_path / "lab.toml")

    rows = {row.name: row for row in control.status(lab.run_dir, ["a", "b", "c"])}
    assert rows["a"].state == "running" and rows["a"].balloon_bytes == 128 << 20
    assert rows["c"].state == "stopped" and rows["a"].to_json()["pid"] == pids["a"]
    assert control.qmp_command(lab.run_dir, "b", "query-status")["status"] == "running"
    assert control.balloon(lab.run_dir, "b") == 128 << 20
    assert control.balloon(lab.run_dir, "b", 96 << 20, timeout=30, memory=128 << 20) == 96 << 20
    with pytest.raises(UsageError, match="between 4 KiB and 128 MiB"):
        control.balloon(lab.run_dir, "b", 1 << 30, memory=128 << 20)
    assert READY in control.read_log(lab.run_dir, "a")
    described = "\n".join(executor.describe(lab))
    assert "[done]" in described and "a: tcg" in described and "[running]" in described

    assert executor.up(lab, spec=tmp_path / "lab.toml") == pids  # already up: nothing to do
    assert "every VM already runs" in caplog.text

    assert executor.down(lab.run_dir, ["b"], timeout=5)  # b only: a and its image stay
    assert set(Journal.load(lab.run_dir).vms) == {"a"} and not qemu.alive(pids["b"])
    assert control.status(lab.run_dir, ["b"])[0].state == "stopped"
    with pytest.raises(RuntimeFailure, match="VM b is not running"):
        control.qmp_command(lab.run_dir, "b", "query-status")
    assert executor.down(lab.run_dir, timeout=5)
    assert not lab.run_dir.path.exists() and (tmp_path / "a.img").exists()  # down keeps images
    assert not executor.down(lab.run_dir)


def test_a_crashed_vm_shows_and_follow_log_ends(lab: Plan, tmp_path: Path) -> None:
    pids = executor.up(lab, spec=tmp_path / "lab.toml", wait_for=READY, timeout=120)
    chunks = control.follow_log(lab.run_dir, "a")
    assert next(chunks)  # the boot so far
    os.kill(pids["a"], signal.SIGKILL)
    assert qemu.wait_gone(pids["a"], 5)
    assert isinstance("".join(chunks), str)  # ends once the VM is gone
    assert control.status(lab.run_dir, ["a"])[0].state == "crashed"
    control.qmp_command(lab.run_dir, "b", "system_powerdown")  # the guest powers itself off
    assert qemu.wait_gone(pids["b"], 30)
    assert control.status(lab.run_dir, ["b"])[0].state == "off"
    assert executor.down(lab.run_dir, timeout=1)


def test_logs_of_qemu_and_of_the_last_run(lab: Plan, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """QEMU's own messages for its whole life (-D), and both logs still there after down."""
    from vmlaunch.cli import main

    pids = executor.up(lab, spec=tmp_path / "lab.toml", wait_for=READY, timeout=120)
    os.kill(pids["a"], signal.SIGTERM)  # QEMU says so on its stderr, long after it daemonized
    assert qemu.wait_gone(pids["a"], 5)
    assert "terminating on signal 15" in control.read_log(lab.run_dir, "a", qemu_messages=True)
    assert executor.down(lab.run_dir, timeout=5)
    assert "terminating on signal 15" in control.read_log(lab.run_dir, "a", qemu_messages=True)
    spec = str(tmp_path / "lab.toml")
    assert main(["logs", spec, "b"]) == 0
    out, err = capsys.readouterr()
    assert READY in out and "b is not up: this is its last run's log" in err
    assert main(["logs", spec, "a", "--qemu", "--follow"]) == 0  # not up: nothing to follow
    assert "terminating on signal 15" in capsys.readouterr().out
    kept = Path(os.environ["VMLAUNCH_LOG_DIR"]) / "rt"
    assert sorted(p.name for p in kept.iterdir()) == ["a.qemu.log", "a.serial.log", "b.qemu.log",
                                                      "b.serial.log", "events.jsonl", "manager.log"]
    assert all(stat_mode(p) == 0o600 for p in kept.iterdir())
    assert main(["logs", spec, "a", "--events"]) == 0  # the lab manager heard QEMU say why it quit
    assert "a SHUTDOWN by the host (host-signal)" in capsys.readouterr().out


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_failing_up_rolls_everything_back(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    plan = plan_of(tmp_path, test_guest, SPEC.replace('initrd = "GUEST/initrd.gz"\n[[vm.b',
                                                      'initrd = "/nonexistent/initrd"\n[[vm.b'))
    with pytest.raises(qemu.QemuFailed, match="b: QEMU exited with status 1"):
        executor.up(plan, spec=tmp_path / "lab.toml", timeout=30)
    assert not plan.run_dir.path.exists() and not (tmp_path / "a.img").exists()
    # why it failed is kept: `vmlaunch logs --qemu` shows it after the run dir is gone
    assert "/nonexistent/initrd" in control.read_log(plan.run_dir, "b", qemu_messages=True)


def test_a_rollback_step_that_fails_is_said_and_the_up_keeps_its_error(
        tmp_path: Path, run_dir: Path, test_guest: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Undoing a resource fails during the rollback (as releasing a KSM claim can): the up's own error
    is raised, with its exit code, the failure is said, and the resource stays for `down`."""
    from vmlaunch.errors import HostError
    from vmlaunch.resources.image import ImageRecord

    def failing(record: ImageRecord, ctx: object, *, rollback: bool) -> None:
        raise HostError("cannot write /sys/kernel/mm/ksm/run (made up by the test)")

    one_vm = SPEC[:SPEC.index("[vm.b]")].replace('"GUEST/initrd.gz"', '"/nonexistent/initrd"')
    plan = plan_of(tmp_path, test_guest, one_vm)
    monkeypatch.setattr(ImageRecord, "undo", failing)
    with pytest.raises(qemu.QemuFailed, match="a: QEMU exited with status 1") as caught:
        executor.up(plan, spec=tmp_path / "lab.toml", timeout=30)
    assert caught.value.exit_code == 4
    assert f"rolling back, could not undo image {tmp_path / 'a.img'}" in caplog.text
    assert "cannot write /sys/kernel/mm/ksm/run (made up by the test) (it stays in the journal: " \
           "`vmlaunch down SPEC` tries again)" in caplog.text
    assert [entry.kind for entry in Journal.load(plan.run_dir).resources] == ["image"]
    monkeypatch.undo()
    assert executor.down(plan.run_dir, timeout=1)
    assert not plan.run_dir.path.exists()


def test_down_force_removes_what_it_recognises(lab: Plan, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    pids = executor.up(lab, spec=tmp_path / "lab.toml", timeout=60)
    doc = json.loads(lab.run_dir.state.read_text())
    doc["resources"].append({"kind": "teleporter", "key": "2M", "vm": None, "record": {"pages": 4}})
    lab.run_dir.state.write_text(json.dumps(doc))
    with pytest.raises(JournalError, match="unknown kind 'teleporter'"):
        executor.down(lab.run_dir, timeout=1)
    assert all(qemu.alive(pid) for pid in pids.values())  # refused before anything changed
    assert executor.down(lab.run_dir, timeout=1, force=True)
    assert not any(qemu.alive(pid) for pid in pids.values()) and not lab.run_dir.path.exists()
    assert "not recognised, so not undone" in caplog.text and "teleporter" in caplog.text


def test_wait_for_times_out_with_the_console_tail(tmp_path: Path, run_dir: Path,
                                                  test_guest: Path) -> None:
    plan = plan_of(tmp_path, test_guest, vms=("b",))
    with pytest.raises(RuntimeFailure, match="timed out after 1 s waiting for 'never printed'"):
        executor.up(plan, spec=tmp_path / "lab.toml", wait_for="never printed", timeout=1)
    assert not plan.run_dir.path.exists()


def test_progress_while_waiting_for_the_console(tmp_path: Path, run_dir: Path, test_guest: Path,
                                                 caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 5 s (2 s here, not to wait for nothing): the VM, the seconds waited and the console's last
    line, cleaned and short."""
    caplog.set_level(logging.INFO, logger="vmlaunch")
    monkeypatch.setattr(executor, "wait_until", functools.partial(wait_until, progress_every=2.0))
    plan = plan_of(tmp_path, test_guest, vms=("b",))
    with pytest.raises(RuntimeFailure, match="timed out after 3 s"):
        executor.up(plan, spec=tmp_path / "lab.toml", wait_for="never printed", timeout=3)
    lines = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("b: waiting for 'never printed', 2 s: "), lines
    console = lines[0].split(", 2 s: ", 1)[1]
    assert 0 < len(console) <= 60 and "\x1b" not in console and "\r" not in console


BLANK = '[lab]\nname = "blank"\n[vm.solo]\nmemory = "64M"\naccel = "tcg"\n' \
        '[[vm.solo.disk]]\nfile = "blank.img"\nsize = "1M"\n'


def test_down_says_which_vm_it_still_waits_for(tmp_path: Path, run_dir: Path,
                                               caplog: pytest.LogCaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM with nothing to boot ignores the power button: from 2 s on (1 s here), down says so."""
    caplog.set_level(logging.INFO, logger="vmlaunch")
    monkeypatch.setattr(qemu, "PROGRESS_AFTER", 1.0)
    plan = plan_of(tmp_path, tmp_path, BLANK)
    executor.up(plan, spec=tmp_path / "lab.toml", timeout=30)
    assert executor.down(plan.run_dir, timeout=1.5)
    messages = [r.getMessage() for r in caplog.records]
    assert "solo: still shutting down, 1 s: the guest has 1.5 s to power off after the ACPI power " \
           "button" in messages, messages
    assert "solo: quit (the guest did not power off within 1.5 s, so its disks were not cleanly unmounted; " \
           "give it longer with `vmlaunch down SPEC --timeout S`)" in messages
    quit = next(r for r in caplog.records if r.getMessage().startswith("solo: quit"))
    assert quit.levelno == logging.WARNING  # not a line among the others: the guest lost its shutdown


def test_the_cli_commands_in_process(tmp_path: Path, run_dir: Path, test_guest: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's runtime commands through `main`, in this process (test_e2e runs them as a user would)."""
    from vmlaunch.cli import main

    spec = tmp_path / "lab.toml"
    spec.write_text(SPEC.replace("GUEST", str(test_guest)))
    try:
        assert main(["up", str(spec), "--dry-run"]) == 0
        assert "image " in capsys.readouterr().out
        assert main(["-q", "up", str(spec), "--wait-for", READY, "--timeout", "120"]) == 0
        assert "a: running (pid" in capsys.readouterr().out
        assert main(["status", str(spec)]) == 0
        out = capsys.readouterr().out
        plan = plan_of(tmp_path, test_guest)
        mac = load_lab(spec).vm("a").nics[0].mac
        assert "running" in out and f"  nic0 {mac} lan (socket 239." in out  # each NIC, under its VM
        assert main(["status", str(spec), "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert rows["b"]["state"] == "running"
        assert rows["a"]["nics"][0]["mac"] == mac and rows["a"]["nics"][0]["type"] == "socket"
        assert main(["ls"]) == 0
        listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rt ")]
        assert len(listed) == 1 and "a, b" in listed[0] and listed[0].endswith(str(spec))
        assert main(["ls", "--json"]) == 0
        labs = json.loads(capsys.readouterr().out)
        assert labs["rt"]["vms"] == {"a": "running", "b": "running"}
        assert labs["rt"]["run_dir"] == str(plan.run_dir)
        assert main(["logs", str(spec), "a"]) == 0
        assert READY in capsys.readouterr().out
        assert main(["balloon", str(spec), "a", "96M", "--timeout", "30"]) == 0
        assert capsys.readouterr().out.strip() == "a: 96M"
        assert main(["qmp", str(spec), "a", "query-balloon"]) == 0
        assert json.loads(capsys.readouterr().out) == {"actual": 96 << 20}
        assert main(["qmp", str(spec), "a", "balloon", "nope"]) == 64
        assert main(["qmp", str(spec), "a", "human-monitor-command", '{"command-line": "info status"}']) == 0
        assert capsys.readouterr().out == "VM status: running\n"  # the monitor's text, not JSON
        assert main(["qmp", str(spec), "a", "human-monitor-command", '{"command-line": "no-such"}']) == 4
        said = capsys.readouterr()
        assert said.out == "" and "a: the monitor says: unknown command: 'no-such'" in said.err
        assert main(["balloon", str(spec), "a", "8M", "--timeout", "5"]) == 4  # below the guest's floor
        err = capsys.readouterr().err
        assert "short of 8M" in err and "floor" in err and "driver" not in err, err
        assert main(["balloon", str(spec), "a", "lots"]) == 64
        assert main(["-v", "down", str(spec), "b", "--timeout", "5"]) == 0
        assert "b: powered off" in capsys.readouterr().err
    finally:
        assert main(["down", str(spec), "--timeout", "5"]) == 0
    assert main(["down", str(spec)]) == 0
    assert "lab rt is not up" in capsys.readouterr().out
    assert main(["ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {}


def test_console_attach_and_detach(lab: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    """The interactive console, fed from a pipe: a command reaches the guest, Ctrl-] detaches."""
    import io
    import threading
    import time

    executor.up(lab, spec=tmp_path / "lab.toml", wait_for=READY, timeout=120)
    read_end, write_end = os.pipe()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.FileIO(read_end, closefd=False)))
    attached = threading.Thread(target=control.attach_console, args=(lab.run_dir, "a"))
    attached.start()
    os.write(write_end, b"echo console-$((6*7))\n")
    deadline = time.monotonic() + 30
    while "console-42" not in control.read_log(lab.run_dir, "a") and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(RuntimeFailure, match="another console is attached to a"):
        control.attach_console(lab.run_dir, "a")
    os.write(write_end, b"\x1d")  # Ctrl-]
    attached.join(10)
    assert not attached.is_alive()
    assert "console-42" in control.read_log(lab.run_dir, "a")
    assert "[detached from a]" in capfd.readouterr().err
    os.close(read_end)
    os.close(write_end)
