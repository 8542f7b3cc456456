"""The lab's event log: what happened to its VMs, one JSON object a line (`RunDir.events`).

    {"time": 1795709601.123456, "vm": "vm1", "event": "BLOCK_IO_ERROR", "disk": "disk1",
     "data": {"device": "", "node-name": "disk1-slot", "operation": "write", "action": "stop",
              "nospace": false, "reason": "Input/output error"}}

Two kinds of writer append to it. The lab manager (`manager/manager.py`) hears each VM's QMP events on
its own monitor and logs those worth knowing (`LOGGED`: an I/O error, a pause, a panic, a reset, ...)
the moment they come, `time` being QEMU's timestamp and `data` QEMU's own. vmlaunch's commands log
what they do to a running VM themselves (`record`: a disk fault set or cleared), under event names of
their own (`VMLAUNCH_...`). `disk` names the disk as users know it (diskN, `vmlaunch status --json`'s
`disks`), found from the block node or device QEMU names (`disk_of`).

Readers: `vmlaunch logs SPEC --events` (`render`), `status` (why a VM is paused: its latest
BLOCK_IO_ERROR, `latest_io_error`), the evidence of a failed test. `down` keeps the log of the last run
(`layout/lastrun.py`), as it keeps the manager's.

Bounded, because a guest decides how often an event comes: a guest that retries a failing request
forever (`on_error.write = "report"`) has QEMU send a BLOCK_IO_ERROR for every failure, thousands a
second. The manager folds repeats of one event (same VM, event, disk, operation and reason; never an
error that paused the VM, which comes a few at a time, once per resume) into one line
(`Coalescer`): the first is logged at once, those that follow within a window are counted and logged
as one line with `"repeated": N` (and `"first"`: when the first of them came) when the window closes;
while they go on, each window is twice as long as the one before, up to a minute. A storm of a day is
then about 1,500 lines, not millions. And the file stops at MAX_BYTES with one last line that says so
(`VMLAUNCH_EVENTS_CAPPED`): a lab that logged that much has shown its problem.

Each line is one write() on a file opened O_APPEND (0600, never through a symlink), so the lines of
the manager and of a command never interleave. A reader skips what is not a line of the log (a line
cut short, garbage), never failing on it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import attrs

from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.rundir import RunDir, open_in_run_dir

log = logging.getLogger(__name__)

# The QMP events the manager logs: what changes a VM's life or says why it changed. Left out: those
# that come all the time and say little (BALLOON_CHANGE, RTC_CHANGE, JOB_STATUS_CHANGE,
# VSERPORT_CHANGE, NIC_RX_FILTER_CHANGED, ACPI_DEVICE_OST).
LOGGED = frozenset({
    "BLOCK_IO_ERROR",  # a disk's request failed on the host; action stop pauses the VM (io-error)
    "BLOCK_IMAGE_CORRUPTED",  # qcow2 found its metadata corrupt: the image is marked and may stop
    "BLOCK_JOB_ERROR",
    "STOP", "RESUME",
    "SHUTDOWN", "POWERDOWN", "RESET",
    "GUEST_PANICKED", "GUEST_CRASHLOADED",
    "WATCHDOG",
    "SUSPEND", "SUSPEND_DISK", "WAKEUP",
    "DEVICE_DELETED",
    "MEMORY_FAILURE",  # a hardware memory error the host passed on (or not) to the guest
})
CAPPED = "VMLAUNCH_EVENTS_CAPPED"  # the last line of a log that reached MAX_BYTES
MAX_BYTES = 4 << 20
MAX_LINE = 16 << 10  # a line's data beyond this is left out (it says so): one event, not a dump
WINDOW = 1.0  # seconds: repeats of one event within it are one line
LONGEST_WINDOW = 60.0  # seconds: how long the window grows while repeats go on

_NODE = re.compile(r"(disk\d+)(?:-[A-Za-z0-9_.-]*)?")  # diskN, diskN-slot, diskN-file, a fault's node
_QDEV = re.compile(r"/machine/peripheral/(disk\d+)(?:/.*)?")  # the device, or its virtio backend


@attrs.frozen
class Event:
    """One line of the log: one event, or `repeated` events alike (the last one's time and data)."""

    time: float  # seconds since the epoch
    vm: str
    event: str  # QEMU's name (BLOCK_IO_ERROR), or vmlaunch's own (VMLAUNCH_...)
    data: Mapping[str, Any] = attrs.field(factory=dict)
    disk: str | None = None  # diskN
    repeated: int | None = None  # this line stands for this many events alike
    first: float | None = None  # with `repeated`: when the first of them came

    @property
    def key(self) -> tuple[str, str, str | None, str | None, str | None] | None:
        """What makes two events repeats of one another; None for one that is never folded: a failed
        request that paused the VM (action stop) comes a few at a time (the requests in flight), once
        per resume, and a `--once` disk fault is known to have fired by its line
        (rig/diskfault.py), which must not wait for a window."""
        operation, reason = self.data.get("operation"), self.data.get("reason")
        if self.event == "BLOCK_IO_ERROR" and self.data.get("action", "stop") == "stop":
            return None
        return (self.vm, self.event, self.disk, operation if isinstance(operation, str) else None,
                reason if isinstance(reason, str) else None)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"time": self.time, "vm": self.vm, "event": self.event}
        if self.disk is not None:
            doc["disk"] = self.disk
        doc["data"] = dict(self.data)
        if self.repeated is not None:
            doc["repeated"] = self.repeated
            doc["first"] = self.first
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> Event | None:
        """The event a line of the log holds; None for what is not one."""
        if not isinstance(doc, dict):
            return None
        when, vm, name, data = doc.get("time"), doc.get("vm"), doc.get("event"), doc.get("data", {})
        if not (_number(when) and isinstance(vm, str) and isinstance(name, str) and isinstance(data, dict)):
            return None
        disk, repeated, first = doc.get("disk"), doc.get("repeated"), doc.get("first")
        return cls(float(when), vm, name, data, disk if isinstance(disk, str) else None,
                   repeated if isinstance(repeated, int) and not isinstance(repeated, bool) else None,
                   float(first) if _number(first) else None)


def _number(value: Any) -> TypeGuard[float]:
    """A JSON number that is one (not a bool, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def disk_of(data: Mapping[str, Any]) -> str | None:
    """The disk (diskN) an event's data is about: the block node it names (diskN-slot, the node each
    disk's device reads and writes through, or any other of its nodes), its device's id, or the
    device's QOM path (`qdev`, `path`); None when it names no disk."""
    for key in ("node-name", "node_name", "device", "id"):
        value = data.get(key)
        if isinstance(value, str) and (match := _NODE.fullmatch(value)):
            return match.group(1)
    for key in ("qdev", "path"):
        value = data.get(key)
        if isinstance(value, str) and (match := _QDEV.fullmatch(value)):
            return match.group(1)
    return None


def from_qmp(vm: str, message: Mapping[str, Any]) -> Event | None:
    """The log's event for a QMP event of `vm` (its `event`, `data`, `timestamp`); None for one that is
    not logged (`LOGGED`)."""
    name = message.get("event")
    if name not in LOGGED:
        return None
    data = message.get("data")
    data = data if isinstance(data, dict) else {}
    stamp = message.get("timestamp")
    when = time.time()
    if isinstance(stamp, dict) and _number(stamp.get("seconds")) and _number(stamp.get("microseconds")):
        when = stamp["seconds"] + stamp["microseconds"] / 1e6
    return Event(when, vm, str(name), data, disk_of(data))


@attrs.define
class _Burst:
    """The repeats of one event in the window open now."""

    span: float  # the window's length
    until: float  # when it closes
    stormy: bool = False  # it follows a window that had repeats: a storm goes on
    count: int = 0  # events folded into it so far
    first: float = 0.0
    last: Event | None = None
    closed: bool = False

    def fold(self, event: Event) -> None:
        self.first = event.time if self.count == 0 else self.first
        self.count += 1
        self.last = event


class Coalescer:
    """Folds repeats of one event into one line: pure (the caller gives the time), so it is tested
    without a clock. `add` returns the lines to write now, `flush` those whose window has closed,
    `drain` all that wait (when the writer stops)."""

    def __init__(self, window: float = WINDOW, longest: float = LONGEST_WINDOW) -> None:
        self.window = window
        self.longest = longest
        self.bursts: dict[tuple[str, str, str | None, str | None, str | None], _Burst] = {}

    def add(self, event: Event) -> list[Event]:
        key = event.key
        if key is None:
            return [event]
        burst = self.bursts.get(key)
        if burst is not None and not burst.closed and event.time < burst.until:
            burst.fold(event)
            return []
        written = self._close(burst) if burst is not None else []
        if burst is not None and burst.stormy and event.time < burst.until + burst.span:
            span = min(burst.span * 2, self.longest)
            self.bursts[key] = _Burst(span, event.time + span, stormy=True)
            self.bursts[key].fold(event)
            return written
        self.bursts[key] = _Burst(self.window, event.time + self.window)
        return [*written, event]

    def flush(self, now: float) -> list[Event]:
        written = []
        for key, burst in list(self.bursts.items()):
            if now >= burst.until:
                written += self._close(burst)
                if now >= burst.until + burst.span:
                    del self.bursts[key]  # quiet for a whole window more: the next one is news again
        return sorted(written, key=lambda event: event.time)

    def drain(self) -> list[Event]:
        written = [line for burst in self.bursts.values() for line in self._close(burst)]
        self.bursts.clear()
        return sorted(written, key=lambda event: event.time)

    @staticmethod
    def _close(burst: _Burst) -> list[Event]:
        """The line for the events the window folded (none when it folded none); the window is over."""
        if burst.closed:
            return []
        burst.closed = True
        burst.stormy = burst.count > 0
        if burst.last is None:
            return []
        return [attrs.evolve(burst.last, repeated=burst.count, first=burst.first)]


class Writer:
    """The manager's side of the log: events folded (`Coalescer`), then appended; a log that is full
    or cannot be written is said once in the manager's log, and the events go on being taken (and
    dropped), so QEMU's monitor never backs up."""

    def __init__(self, run_dir: RunDir, coalescer: Coalescer | None = None) -> None:
        self.run_dir = run_dir
        self.coalescer = coalescer or Coalescer()
        self.full = False
        self.failing = False

    def hear(self, vm: str, message: Mapping[str, Any]) -> None:
        """A QMP event of `vm`: logged at once, folded, or not logged (not in LOGGED)."""
        event = from_qmp(vm, message)
        if event is not None:
            self._write(self.coalescer.add(event))

    def flush(self, now: float | None = None) -> None:
        """Log the repeats whose window has closed."""
        self._write(self.coalescer.flush(time.time() if now is None else now))

    def close(self) -> None:
        self._write(self.coalescer.drain())

    def _write(self, events: Sequence[Event]) -> None:
        if not events or self.full:
            return
        try:
            self.full = not append(self.run_dir, events)
        except (OSError, RuntimeFailure) as exc:
            if not self.failing:
                log.warning("cannot write the event log %s: %s", self.run_dir.events,
                            getattr(exc, "strerror", None) or exc)
            self.failing = True
            return
        self.failing = False
        if self.full:
            log.warning("the event log %s reached %d MiB: nothing more is logged in it",
                        self.run_dir.events, MAX_BYTES >> 20)


def encode(event: Event) -> bytes:
    """The event's line; one whose data is larger than MAX_LINE keeps its size only."""
    line = json.dumps(event.to_json(), separators=(",", ":"), default=str) + "\n"
    if len(line) > MAX_LINE:
        left_out = {"vmlaunch": f"data left out: {len(line)} bytes"}
        line = json.dumps(attrs.evolve(event, data=left_out).to_json(), separators=(",", ":")) + "\n"
    return line.encode()


def append(run_dir: RunDir, events: Sequence[Event]) -> bool:
    """Append the events' lines to the lab's log; False when it is full (MAX_BYTES), from which on
    nothing more is written. Raises OSError (and RuntimeFailure for a symlink where the log goes)."""
    if not events:
        return True
    fd = open_in_run_dir(run_dir.events, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        for event in events:
            line = encode(event)
            if size + len(line) > MAX_BYTES:
                if size < MAX_BYTES:
                    os.write(fd, _capped_line(event, size))
                return False
            os.write(fd, line)  # one write a line: never interleaved with another writer's
            size += len(line)
        return True
    finally:
        os.close(fd)


def _capped_line(event: Event, size: int) -> bytes:
    """The log's last line, padded to take the log to MAX_BYTES: every writer after it finds the log
    full, whatever the length of its own line."""
    doc = Event(event.time, event.vm, CAPPED, {
        "message": f"the event log reached {MAX_BYTES >> 20} MiB: nothing more is logged",
        "bytes": MAX_BYTES}).to_json()
    text = json.dumps(doc, separators=(",", ":"))
    return (text + " " * max(0, MAX_BYTES - size - len(text) - 1) + "\n").encode()


def record(run_dir: RunDir, vm: str, event: str, data: Mapping[str, Any] | None = None, *,
           disk: str | None = None, when: float | None = None) -> bool:
    """Log what vmlaunch did to VM `vm` (event names of vmlaunch's own: VMLAUNCH_FAULT, ...); `data`
    may hold a "message", the text `logs --events` shows for it; `disk` defaults to the disk `data`
    names. Never fails the command that logs: a log that cannot be written is a warning, and False."""
    data = dict(data or {})
    line = Event(time.time() if when is None else when, vm, event, data,
                 disk if disk is not None else disk_of(data))
    try:
        return append(run_dir, [line])
    except (OSError, RuntimeFailure) as exc:
        log.warning("the event log of lab %s: %s is not logged: %s", run_dir.lab, event,
                    getattr(exc, "strerror", None) or exc)
        return False


def parse(text: str, vms: Iterable[str] = ()) -> list[Event]:
    """The events of a log's text (of the VMs `vms`, all when empty), in time order (a line that folds
    repeats is written after them, with the last one's time); what is not a line of the log is
    skipped."""
    only = set(vms)
    events = []
    for line in text.splitlines():
        try:
            event = Event.from_json(json.loads(line))
        except ValueError:
            continue
        if event is not None and (not only or event.vm in only or event.event == CAPPED):
            events.append(event)
    events.sort(key=lambda event: event.time)  # stable: lines of one instant keep their order
    return events


def read(run_dir: RunDir, vms: Iterable[str] = ()) -> list[Event]:
    """The events of the lab's log in its run dir (of the VMs `vms`, all when empty), in time order;
    none when there is no log."""
    try:
        fd = open_in_run_dir(run_dir.events, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    with os.fdopen(fd, "rb") as f:
        return parse(f.read(MAX_BYTES + MAX_LINE).decode(errors="replace"), vms)


@attrs.frozen
class IoError:
    """Why a VM is paused in QEMU's run state io-error: the request that failed."""

    disk: str | None  # diskN; None when nothing says which
    operation: str | None  # read | write; None when not logged
    reason: str | None  # QEMU's (strerror) text, e.g. "Input/output error"
    nospace: bool  # the host's file system is full (ENOSPC)
    action: str | None  # what the disk's on_error said to do: stop
    time: float | None  # when it failed; None when not logged

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def describe(self) -> str:
        """"disk1 write failed (Input/output error)", as `status` says it."""
        what = " ".join(word for word in (self.disk or "a disk", self.operation) if word)
        why = "no space left on the host" if self.nospace else self.reason
        return f"{what} failed" + (f" ({why})" if why else "")


def latest_io_error(events: Sequence[Event], vm: str) -> IoError | None:
    """The failed request that paused `vm` last: its latest BLOCK_IO_ERROR whose action stopped it,
    unless it was resumed since (then that error is over, and a new one was not logged)."""
    latest: Event | None = None
    for event in sorted(events, key=lambda event: event.time):  # a line of repeats comes late
        if event.vm != vm:
            continue
        if event.event == "BLOCK_IO_ERROR" and event.data.get("action", "stop") == "stop":
            latest = event if latest is None or event.time >= latest.time else latest
        elif event.event == "RESUME" and latest is not None and event.time > latest.time:
            latest = None
    if latest is None:
        return None
    data = latest.data
    return IoError(disk=latest.disk, operation=_text(data.get("operation")), reason=_text(data.get("reason")),
                   nospace=data.get("nospace") is True, action=_text(data.get("action")), time=latest.time)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# What QEMU did after a failed request, by the disk's action.
_ACTIONS = {"stop": "the VM paused", "report": "the guest got the error",
            "ignore": "the guest was told it succeeded"}


def render(event: Event) -> str:
    """One readable line: `2026-11-26 16:20:01.123 vm1 BLOCK_IO_ERROR disk1 write: Input/output error
    (action stop; the VM paused)`. What came from QEMU or a guest is made safe to show."""
    from vmlaunch.core.textsafe import printable

    words = [_clock(event.time), event.vm, event.event]
    if event.disk is not None and event.event != "BLOCK_IO_ERROR":
        words.append(event.disk)
    said = _said(event)
    if said:
        words.append(said)
    if event.repeated is not None:
        since = f" since {_clock(event.first)[11:]}" if event.first is not None else ""
        words.append(f"({event.repeated} {'time' if event.repeated == 1 else 'times'}{since})")
    return printable(" ".join(words))


def _clock(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + f".{int(when * 1000) % 1000:03d}"


def _said(event: Event) -> str:
    data = event.data
    message = data.get("message")
    if isinstance(message, str) and message:
        return message
    if event.event == "BLOCK_IO_ERROR":
        where = event.disk or _text(data.get("node-name")) or _text(data.get("device")) or "?"
        operation = _text(data.get("operation")) or "request"
        reason = "no space left on the host" if data.get("nospace") is True else \
            (_text(data.get("reason")) or "failed")
        action = _text(data.get("action"))
        then = f" (action {action}; {_ACTIONS[action]})" if action in _ACTIONS else \
            (f" (action {action})" if action else "")
        return f"{where} {operation}: {reason}{then}"
    said = _PLAIN.get(event.event)
    if said is not None and not data:
        return said
    if event.event in ("SHUTDOWN", "RESET") and isinstance(data.get("guest"), bool):
        by = "by the guest" if data["guest"] else "by the host"
        why = _text(data.get("reason"))
        return f"{by}{f' ({why})' if why else ''}"
    if event.event in ("GUEST_PANICKED", "WATCHDOG") and _text(data.get("action")):
        what = "the guest panicked" if event.event == "GUEST_PANICKED" else "the guest's watchdog fired"
        rest = " ".join(f"{key}={_shown(value)}" for key, value in sorted(data.items()) if key != "action")
        return f"{what} (action {data['action']}){f': {rest}' if rest else ''}"
    return " ".join(f"{key}={_shown(value)}" for key, value in sorted(data.items()))


# What an event without data says.
_PLAIN = {"STOP": "the VM paused", "RESUME": "the VM runs again",
          "POWERDOWN": "its ACPI power button was pressed", "SUSPEND": "the guest suspended itself (to RAM)",
          "SUSPEND_DISK": "the guest suspended itself (to disk)", "WAKEUP": "the guest woke up"}


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
