"""The lab's event log (lab/events.py) without QEMU: QMP events into lines, repeats folded, the cap,
what a reader skips, how a line reads; the lab manager logging a fake QEMU's events as they come; why
`status` says a VM is paused; `logs --events` of a lab that is down; the log kept by `down`. The real
I/O error, on the test guest, is in test_diskfault_real.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_spec
from vmlaunch.cli import main
from vmlaunch.lab import events
from vmlaunch.lab.events import (
    CAPPED,
    Coalescer,
    Event,
    IoError,
    Writer,
    append,
    disk_of,
    from_qmp,
    latest_io_error,
    parse,
    read,
    record,
    render,
)
from vmlaunch.layout import lastrun
from vmlaunch.layout.rundir import RunDir
from vmlaunch.runtime.control import failed_blocks, io_error_of, vm_state

T0 = 1_795_709_601.0  # some second of 2026
SHOWN = "a BLOCK_IO_ERROR disk1 write: Input/output error (action stop; the VM paused)"
IO_DATA = {"device": "", "node-name": "disk1-slot", "operation": "write", "action": "stop", "nospace": False,
           "reason": "Input/output error"}


def qmp_event(name: str, when: float = T0, **data: Any) -> dict[str, Any]:
    seconds = int(when)
    return {"event": name, "data": data,
            "timestamp": {"seconds": seconds, "microseconds": round((when - seconds) * 1e6)}}


def io_error(when: float, vm: str = "a", **data: Any) -> Event:
    event = from_qmp(vm, qmp_event("BLOCK_IO_ERROR", when, **{**IO_DATA, **data}))
    assert event is not None
    return event


def retried(when: float, vm: str = "a", **data: Any) -> Event:
    """An error the guest is handed (action report), which a guest may retry thousands of times a
    second: what is folded."""
    return io_error(when, vm, **{"action": "report", **data})


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def lab_run_dir(tmp_path: Path) -> RunDir:
    run_dir = RunDir(tmp_path / "lab")
    run_dir.create()
    return run_dir


# --- what a QMP event becomes ---------------------------------------------------------------------


def test_a_qmp_event_becomes_a_line_with_its_disk_and_qemus_time() -> None:
    event = io_error(T0 + 0.25)
    assert event == Event(T0 + 0.25, "a", "BLOCK_IO_ERROR", IO_DATA, "disk1")
    assert event.to_json() == {"time": T0 + 0.25, "vm": "a", "event": "BLOCK_IO_ERROR", "disk": "disk1",
                               "data": IO_DATA}
    assert from_qmp("a", qmp_event("BALLOON_CHANGE", actual=1 << 27)) is None  # noise: not logged
    assert from_qmp("a", qmp_event("RTC_CHANGE", offset=1)) is None
    stop = from_qmp("a", {"event": "STOP"})  # no timestamp: when it was heard
    assert stop is not None and stop.disk is None and abs(stop.time - time.time()) < 5


@pytest.mark.parametrize(("data", "disk"), [
    ({"node-name": "disk1-slot"}, "disk1"),  # the node each disk's device reads through
    ({"node-name": "disk12"}, "disk12"),  # its format node
    ({"node-name": "disk0-f1"}, "disk0"),  # a fault's node over it
    ({"device": "", "qdev": "/machine/peripheral/disk3/virtio-backend"}, "disk3"),
    ({"device": "disk2", "path": "/machine/peripheral/disk2"}, "disk2"),  # DEVICE_DELETED
    ({"device": "net0", "path": "/machine/peripheral/net0"}, None),
    ({"node-name": "diskette"}, None),
    ({"node-name": 7}, None),
    ({}, None),
])
def test_disk_of(data: dict[str, Any], disk: str | None) -> None:
    assert disk_of(data) == disk


# --- repeats --------------------------------------------------------------------------------------


def test_repeats_are_folded_into_one_line_when_their_window_closes() -> None:
    fold = Coalescer(window=1.0, longest=60.0)
    first = retried(T0)
    assert fold.add(first) == [first]  # news at once
    assert fold.add(retried(T0 + 0.1)) == []
    assert fold.add(retried(T0 + 0.5)) == []
    other_errno = retried(T0 + 0.55, reason="Read-only file system")  # another errno: not a repeat
    assert fold.add(other_errno) == [other_errno]
    paused = io_error(T0 + 0.58)  # an error that paused the VM: once per resume, never folded
    assert fold.add(paused) == [paused]
    read_error = retried(T0 + 0.6, operation="read")  # another operation: not a repeat
    assert fold.add(read_error) == [read_error]
    other_vm = retried(T0 + 0.7, vm="b")
    assert fold.add(other_vm) == [other_vm]
    assert fold.flush(T0 + 0.9) == []  # the window is still open
    (line,) = fold.flush(T0 + 1.0)
    assert (line.repeated, line.first, line.time) == (2, T0 + 0.1, T0 + 0.5)
    assert line.to_json()["repeated"] == 2 and line.to_json()["first"] == T0 + 0.1
    assert fold.flush(T0 + 1.1) == []


def test_a_storm_gets_longer_windows_and_a_quiet_spell_makes_the_next_event_news_again() -> None:
    """A guest that fails one request for ever: 1,000 errors a second for 200 s come out as a handful
    of lines, the windows doubling up to a minute."""
    fold = Coalescer(window=1.0, longest=60.0)
    written: list[Event] = []
    for tick in range(200_000):
        now = T0 + tick / 1000
        written += fold.add(retried(now))
        if tick % 1000 == 0:  # the manager's round
            written += fold.flush(now)
    written += fold.flush(T0 + 200 + 61)
    assert written[0].repeated is None
    assert sum(line.repeated or 1 for line in written) == 200_000  # every one counted
    assert len(written) < 12
    spans = [round(b.time - a.time) for a, b in zip(written[1:], written[2:])]
    assert spans[:5] == [2, 4, 8, 16, 32] and max(spans) <= 61
    assert fold.bursts  # still within a window of the storm's end
    assert fold.flush(T0 + 400) == [] and not fold.bursts
    news = retried(T0 + 500)
    assert fold.add(news) == [news]


def test_drain_writes_what_waits() -> None:
    fold = Coalescer()
    fold.add(retried(T0))
    fold.add(retried(T0 + 0.2))
    fold.add(retried(T0 + 0.3))
    (line,) = fold.drain()
    assert line.repeated == 2 and not fold.bursts


# --- the file -------------------------------------------------------------------------------------


def test_record_appends_a_line_of_its_own_0600(lab_run_dir: RunDir) -> None:
    assert record(lab_run_dir, "a", "VMLAUNCH_FAULT", {"node-name": "disk1-slot", "message": "eio set"},
                  when=T0)
    assert record(lab_run_dir, "b", "VMLAUNCH_FAULT", {"message": "cleared"}, disk="disk0", when=T0 + 1)
    assert os.stat(lab_run_dir.events).st_mode & 0o777 == 0o600
    lines = lab_run_dir.events.read_text().splitlines()
    assert [json.loads(line)["disk"] for line in lines] == ["disk1", "disk0"]
    assert [event.vm for event in read(lab_run_dir)] == ["a", "b"]
    assert [event.vm for event in read(lab_run_dir, ["b"])] == ["b"]


def test_record_never_fails_its_command(lab_run_dir: RunDir, caplog: pytest.LogCaptureFixture) -> None:
    lab_run_dir.events.symlink_to("/etc/passwd")  # planted
    assert record(lab_run_dir, "a", "VMLAUNCH_FAULT") is False
    assert "is not logged" in caplog.text


def test_the_log_stops_at_its_cap_with_one_last_line(lab_run_dir: RunDir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_BYTES", 4096)
    line = len(events.encode(io_error(T0)))
    count = 0
    while append(lab_run_dir, [io_error(T0 + count)]):
        count += 1
    assert count == 4096 // line
    size = lab_run_dir.events.stat().st_size
    assert size >= 4096  # the last line takes it to the cap: every writer after it finds it full
    assert not append(lab_run_dir, [Event(T0, "a", "STOP")])
    assert not record(lab_run_dir, "a", "VMLAUNCH_FAULT", {"message": "x"})
    assert lab_run_dir.events.stat().st_size == size
    logged = read(lab_run_dir)
    assert len(logged) == count + 1 and logged[-1].event == CAPPED
    assert "nothing more is logged" in logged[-1].data["message"]
    assert read(lab_run_dir, ["b"])[-1].event == CAPPED  # whoever reads, of whichever VM


def test_a_huge_line_keeps_its_size_only() -> None:
    line = events.encode(Event(T0, "a", "GUEST_PANICKED", {"info": "x" * 100_000}))
    assert len(line) < 1000 and b"data left out" in line


def test_a_reader_skips_what_is_not_a_line_of_the_log() -> None:
    good = json.dumps(io_error(T0).to_json())
    text = "\n".join([
        good,
        '{"time": 1, "vm": "a", "event": "STOP", "data": {}',  # cut short
        "garbage \x00\x1b[2J",
        "[1, 2]",
        '{"time": "soon", "vm": "a", "event": "STOP"}',
        '{"time": true, "vm": "a", "event": "STOP"}',
        '{"time": 1, "vm": 7, "event": "STOP"}',
        '{"time": 1, "vm": "a", "event": "STOP", "data": []}',
        '{"time": 2, "vm": "a", "event": "RESUME", "repeated": "x", "first": null}',
        "",
        good[:40],  # a torn last line
    ])
    parsed = parse(text)
    assert [event.event for event in parsed] == ["RESUME", "BLOCK_IO_ERROR"]  # in time order
    assert parsed[0].repeated is None and parsed[0].data == {}


def test_read_without_a_log(lab_run_dir: RunDir) -> None:
    assert read(lab_run_dir) == []


# --- how a line reads -----------------------------------------------------------------------------


def test_render(utc: None) -> None:
    assert render(io_error(T0 + 0.123)) == f"2026-11-26 16:13:21.123 {SHOWN}"
    assert render(io_error(T0, nospace=True, action="report", operation="read")) == (
        "2026-11-26 16:13:21.000 a BLOCK_IO_ERROR disk1 read: no space left on the host (action report; the "
        "guest got the error)")
    folded = Event(T0 + 9.5, "a", "BLOCK_IO_ERROR", IO_DATA, "disk1", repeated=40, first=T0 + 1)
    assert render(folded).endswith("(action stop; the VM paused) (40 times since 16:13:22.000)")
    assert render(Event(T0, "a", "STOP")) == "2026-11-26 16:13:21.000 a STOP the VM paused"
    assert render(Event(T0, "b", "SHUTDOWN", {"guest": True, "reason": "guest-shutdown"})) == (
        "2026-11-26 16:13:21.000 b SHUTDOWN by the guest (guest-shutdown)")
    assert render(Event(T0, "b", "RESET", {"guest": False, "reason": "host-qmp-system-reset"})).endswith(
        "b RESET by the host (host-qmp-system-reset)")
    panic = Event(T0, "b", "GUEST_PANICKED", {"action": "pause", "info": {"type": "hyper-v"}})
    assert render(panic).endswith('GUEST_PANICKED the guest panicked (action pause): info={"type":"hyper-v"}')
    assert render(Event(T0, "b", "POWERDOWN")).endswith("b POWERDOWN its ACPI power button was pressed")
    assert render(Event(T0, "b", "BLOCK_JOB_ERROR", {"device": "job0", "operation": "write",
                                                     "action": "report"})).endswith(
        "b BLOCK_JOB_ERROR action=report device=job0 operation=write")
    assert render(Event(T0, "a", "VMLAUNCH_FAULT", {"message": "disk1: writes fail (EIO)"}, "disk1")) == (
        "2026-11-26 16:13:21.000 a VMLAUNCH_FAULT disk1 disk1: writes fail (EIO)")
    # what a guest or QEMU said is shown without its escapes
    assert "\x1b" not in render(Event(T0, "a", "GUEST_PANICKED", {"info": "\x1b]0;owned\x07x y"}))


# --- why a VM is paused ---------------------------------------------------------------------------


def test_the_latest_io_error_that_stopped_the_vm() -> None:
    logged = [io_error(T0, reason="Broken pipe"), Event(T0 + 1, "a", "RESUME"),
              io_error(T0 + 2, vm="b"), io_error(T0 + 3, operation="read", action="report"),
              io_error(T0 + 4, nospace=True, reason="No space left on device")]
    found = latest_io_error(logged, "a")
    assert found == IoError(disk="disk1", operation="write", reason="No space left on device", nospace=True,
                            action="stop", time=T0 + 4)
    assert found.describe() == "disk1 write failed (no space left on the host)"
    assert latest_io_error(logged[:2], "a") is None  # resumed since: that one is over
    assert latest_io_error(logged, "c") is None
    # a line of repeats is written late: the order that counts is QEMU's time
    late = Event(T0 + 0.5, "a", "BLOCK_IO_ERROR", IO_DATA, "disk1", repeated=3, first=T0 + 0.2)
    assert latest_io_error([Event(T0 + 1, "a", "RESUME"), late], "a") is None


def test_status_says_why_an_io_error_paused_a_vm(tmp_path: Path) -> None:
    files = RunDir(tmp_path).vm("db")
    found = IoError("disk1", "write", "Input/output error", False, "stop", T0)
    assert vm_state(files, "io-error", io_error=found) == (
        "paused", "by an I/O error: disk1 write failed (Input/output error); `vmlaunch resume SPEC db` "
        "retries it (`vmlaunch logs SPEC --events` shows each error)")
    state, why = vm_state(files, "io-error")
    assert state == "paused" and why is not None and why.startswith("by an I/O error: a disk request failed;")


def test_without_a_logged_error_query_block_names_the_disk() -> None:
    blocks = [{"device": "", "qdev": "/machine/peripheral/disk0/virtio-backend", "io-status": "ok",
               "inserted": {"node-name": "disk0-slot"}},
              {"device": "", "qdev": "/machine/peripheral/disk1/virtio-backend", "io-status": "nospace",
               "inserted": {"node-name": "disk1-slot"}},
              {"device": "", "qdev": "/machine/peripheral/disk2/virtio-backend"}]  # no werror=stop: none
    (found,) = failed_blocks(blocks)
    assert found == IoError("disk1", None, None, True, "stop", None)
    assert found.describe() == "disk1 failed (no space left on the host)"
    assert failed_blocks([{"io-status": "failed", "qdev": "/machine/peripheral/disk4/virtio-backend"}]) == \
        [IoError("disk4", None, None, False, "stop", None)]
    assert failed_blocks("nonsense") == [] and failed_blocks(None) == []
    logged = IoError("disk1", "write", "Input/output error", False, "stop", T0)
    assert io_error_of(logged, [found]) == logged and io_error_of(logged, []) == logged
    assert io_error_of(None, [found]) == found and io_error_of(None, []) is None
    elsewhere = IoError("disk2", None, None, False, "stop", None)  # a pause the log missed
    assert io_error_of(logged, [elsewhere]) == elsewhere
    # QEMU keeps the io-status of a -blockdev device that failed before and was resumed: the disk
    # the log names is one of those failed, so it is the one
    stale = IoError("disk0", None, None, False, "stop", None)
    assert io_error_of(logged, [stale, found]) == logged


# --- the manager's side ---------------------------------------------------------------------------


def test_the_writer_logs_news_at_once_and_repeats_at_the_round(lab_run_dir: RunDir) -> None:
    writer = Writer(lab_run_dir)
    writer.hear("a", qmp_event("BLOCK_IO_ERROR", T0, **{**IO_DATA, "action": "report"}))
    writer.hear("a", qmp_event("BALLOON_CHANGE", T0, actual=5))
    assert [event.event for event in read(lab_run_dir)] == ["BLOCK_IO_ERROR"]
    for tick in range(1, 50):
        writer.hear("a", qmp_event("BLOCK_IO_ERROR", T0 + tick / 100, **{**IO_DATA, "action": "report"}))
    assert len(read(lab_run_dir)) == 1
    writer.flush(T0 + 5)
    assert [event.repeated for event in read(lab_run_dir)] == [None, 49]
    writer.hear("a", qmp_event("STOP", T0 + 10))
    writer.hear("a", qmp_event("STOP", T0 + 10.1))
    writer.close()  # the manager stops: what waits is written
    assert [event.repeated for event in read(lab_run_dir)] == [None, 49, None, 1]


def test_a_writer_that_cannot_write_says_so_once(lab_run_dir: RunDir,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    lab_run_dir.events.symlink_to("/etc/passwd")
    writer = Writer(lab_run_dir)
    for tick in range(3):
        writer.hear("a", qmp_event("RESET", T0 + 10 * tick))
    assert caplog.text.count("cannot write the event log") == 1


class EventingQemu:
    """A QEMU's second monitor, as the lab manager finds it: a greeting, replies, and `events` sent
    once it is asked for its capabilities."""

    def __init__(self, path: Path, sent: list[dict[str, Any]]) -> None:
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(1)
        self.sent = sent
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        decoder = json.JSONDecoder()

        def send(message: dict[str, Any]) -> None:
            conn.sendall(json.dumps(message).encode() + b"\r\n")  # QEMU ends each message so

        with conn:
            send({"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 0}, "package": ""},
                          "capabilities": []}})
            buffer = ""
            while data := conn.recv(4096):
                buffer += data.decode()
                while buffer.strip():
                    try:
                        message, end = decoder.raw_decode(buffer.lstrip())
                    except ValueError:
                        break
                    buffer = buffer.lstrip()[end:]
                    send({"return": {}, "id": message.get("id")})
                    if message["execute"] == "qmp_capabilities":
                        for event in self.sent:
                            send(event)

    def close(self) -> None:
        self.server.close()


def test_the_manager_logs_a_vms_events_as_they_come(run_dir: Path) -> None:
    from vmlaunch.manager.manager import Manager
    from vmlaunch.resources.manager import ManagedVm

    lab = RunDir(run_dir / "t")
    lab.create()
    sent = [qmp_event("BALLOON_CHANGE", T0, actual=1), qmp_event("BLOCK_IO_ERROR", T0, **IO_DATA),
            qmp_event("STOP", T0)]
    qemu = EventingQemu(lab.vm("a").manager_qmp, sent)

    async def watch() -> list[Event]:
        manager = Manager(lab)
        watched = await manager.connect(ManagedVm("a", 128, 128, auto=False, balloon=False), os.getpid())
        assert watched is not None
        deadline = time.monotonic() + 5
        while len(read(lab)) < 2 and time.monotonic() < deadline:  # no round needed: as they come
            await asyncio.sleep(0.02)
        await watched.close()
        return read(lab)

    try:
        logged = asyncio.run(watch())
    finally:
        qemu.close()
    assert [(event.event, event.disk) for event in logged] == [("BLOCK_IO_ERROR", "disk1"), ("STOP", None)]


# --- logs --events, and down --------------------------------------------------------------------


LAB = '[lab]\nname = "{name}"\n[vm.a]\nmemory = 64\nkernel = "/k"\n[vm.b]\nmemory = 64\nkernel = "/k"\n'


def test_logs_events_of_a_lab_that_is_down_shows_its_last_run(tmp_path: Path, run_dir: Path, utc: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, LAB.format(name="evdown"))
    lab = RunDir.of(run_dir, "evdown")
    assert main(["logs", str(spec), "--events"]) == 4  # never up, nothing kept
    assert "has no event log" in capsys.readouterr().err
    lab.create()
    append(lab, [io_error(T0), Event(T0 + 1, "b", "STOP")])
    lastrun.keep_events(lab)  # as down does, when its manager stops
    assert lab.remove(["a", "b"]) is None  # the run dir goes with its event log
    assert main(["logs", str(spec), "--events"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"2026-11-26 16:13:21.000 {SHOWN}",
                                "2026-11-26 16:13:22.000 b STOP the VM paused"]
    assert "evdown is not up: these are its last run's events" in err
    assert main(["logs", str(spec), "b", "--events", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line) == {"time": T0 + 1, "vm": "b", "event": "STOP", "data": {}}
    assert main(["logs", str(spec), "b", "--events", "--follow"]) == 0  # not up: nothing to follow
    assert capsys.readouterr().out.count("\n") == 1
    # a run that logged nothing replaces the last one's log with none
    lab.create()
    lastrun.keep_events(lab)
    assert lastrun.read_events("evdown") is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--events", "--qemu"], "no --qemu and no --manager"),
    (["--events", "--manager"], "no --qemu and no --manager"),
    (["a", "--json"], "--json prints the event log's lines"),
    (["a", "b"], "one VM's console at a time, not a, b"),
    (["--events", "c"], "c"),
    ([], "or --events for the lab's event log"),
])
def test_logs_usage(tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                    message: str) -> None:
    spec = write_spec(tmp_path, LAB.format(name="evuse"))
    assert main(["logs", str(spec), *argv]) == 64
    assert message in capsys.readouterr().err


def test_follow_shows_each_whole_line_until_the_manager_stops(lab_run_dir: RunDir,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from vmlaunch.runtime import control

    class Manager:  # runs until the log has its last line
        def running(self) -> bool:
            return b"RESET" not in lab_run_dir.events.read_bytes() if lab_run_dir.events.exists() else True

    monkeypatch.setattr(control, "manager_record", lambda run_dir: Manager())
    line = events.encode(io_error(T0))
    pieces = [line[:20], line[20:] + events.encode(Event(T0 + 1, "b", "STOP")),
              events.encode(Event(T0 + 2, "a", "RESET"))]

    def write() -> None:
        for piece in pieces:
            time.sleep(0.3)
            with lab_run_dir.events.open("ab") as log:
                log.write(piece)

    writer = threading.Thread(target=write)
    writer.start()
    batches = [[event.event for event in batch] for batch in control.follow_events(lab_run_dir, ["a"])]
    writer.join()
    assert [name for batch in batches for name in batch] == ["BLOCK_IO_ERROR", "RESET"]  # b's left out
    assert all(batches)  # a torn line waits for its end: never an empty or broken batch
