"""Disk faults as users write them, one parser for the spec (`[[vm.V.disk.fault]]`), the CLI (`vmlaunch
fault SPEC VM DISK ...`) and the API (`Vm.disk(name).fail/hang/slow`):

- `error`: requests of one kind (`read`, `write` or `flush`) fail with an errno, a name such as "EIO"
  or "ENOSPC" (Linux's names; the guest's driver sees an I/O error whatever the errno, but QEMU's
  `on_error.write = "enospc"` pauses the VM on ENOSPC only); at one sector (512 bytes, as the guest
  counts them) or, without one, every request; `once`: only the first such request fails;
- `hang`: reads or writes are held until `release`;
- `slow`: `bps` (bytes per second, with a unit: "1M" is 1 MiB/s, "512K", "2MiB/s"; a bare number is
  refused: bits, bytes or megabytes?), `iops` (requests per second), `latency` (milliseconds between two
  requests: QEMU has no delay for a disk that keeps its data, so the disk's requests are paced, one
  every `latency` ms, at most 1000).
"""

from __future__ import annotations

import difflib
import errno as errnos
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from vmlaunch.core.units import parse_size
from vmlaunch.spec.model import DiskFault, FaultKind, OnError

OPS = {FaultKind.ERROR: ("read", "write", "flush"), FaultKind.HANG: ("read", "write")}
KEYS = ("type", "op", "read", "write", "flush", "sector", "once", "errno", "bps", "iops", "latency")
SECTOR = 512
MAX_LATENCY_MS = 1000  # QEMU's I/O limits count whole requests per second: one a second is the slowest
MAX_IOPS = 1_000_000
MAX_RATE = 10**15  # QEMU's largest I/O limit (THROTTLE_VALUE_MAX), in bytes a second
_RATE = re.compile(r"(.*?)(?:/s)?", re.IGNORECASE | re.ASCII)

Problem = tuple[str, str, str]  # (the key it is about, "" for the fault; the message; a hint)


def errno_number(name: str) -> int:
    """The number of errno `name` ("EIO", case-insensitive); ValueError naming the closest ones."""
    word = name.strip().upper() if isinstance(name, str) else ""
    number = getattr(errnos, word, None) if word.startswith("E") else None
    if isinstance(number, int) and errnos.errorcode.get(number) is not None:
        return number
    close = difflib.get_close_matches(word, sorted(set(errnos.errorcode.values())), n=3)
    raise ValueError(f"{name!r} is not an errno name" + (f" (closest: {', '.join(close)})" if close
                                                          else " (examples: EIO, ENOSPC, EROFS)"))


def parse_rate(text: str | int) -> int:
    """Bytes per second from "1M", "512K", "2MiB/s" (powers of 1024, as every size of vmlaunch); a
    number without a unit is refused. ValueError for a user."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"{text!r} is not a rate (examples: 1M, 512K, 10MiB/s)")
    if isinstance(text, (int, str)) and re.fullmatch(r" *0*(\.0*)? *", str(text)):
        raise ValueError(f"rate {text!r} is zero: `hang` holds requests; `clear` takes the limits off")
    if isinstance(text, int) or not re.search(r"[A-Za-z]", text.replace("/s", "").replace("/S", "")):
        raise ValueError(f"rate {text!r} has no unit: is it bytes, KiB or MiB a second? (examples: "
                         "1M, 512K, 10MiB/s; 100B for bytes)")
    match = _RATE.fullmatch(text.strip())
    try:
        rate = parse_size(match[1] if match else text)
    except ValueError as exc:
        raise ValueError(f"rate {exc}") from None
    if rate < 1:
        raise ValueError(f"rate {text!r} is zero: to take the limits off, `clear` the disk")
    if rate > MAX_RATE:
        raise ValueError(f"rate {text!r} is more than QEMU's largest limit ({MAX_RATE} bytes a second, "
                         "about 909T)")
    return rate


def parse_fault(raw: Mapping[str, Any]) -> tuple[DiskFault | None, list[Problem]]:
    """A fault from its fields (`type`, `op` or one of `read`/`write`/`flush` = true, `sector`, `once`,
    `errno`, `bps`, `iops`, `latency`), with the problems that keep it from being one."""
    problems: list[Problem] = []
    unknown = [key for key in raw if key not in KEYS]
    for key in unknown:
        problems.append((key, f"unknown field {key!r}", f"a fault has {', '.join(KEYS)}"))
    try:
        kind = FaultKind(raw.get("type"))
    except ValueError:
        return None, [*problems, ("type", f"type must be one of {', '.join(k.value for k in FaultKind)}, "
                                  f"not {raw.get('type')!r}", "")]
    flags = [op for op in ("read", "write", "flush") if raw.get(op) is True]
    for word in ("read", "write", "flush"):
        if word in raw and not isinstance(raw[word], bool):
            problems.append((word, f"{word} is true or false", ""))
    op = raw.get("op")
    if op is not None and not isinstance(op, str):
        problems.append(("op", "op is a word: read, write or flush", ""))
        op = None
    if op is not None and flags and flags != [op]:
        problems.append(("op", f"op = {op!r} and {', '.join(flags)} = true say two things", ""))
    chosen = op or (flags[0] if len(flags) == 1 else None)
    if len(flags) > 1:
        problems.append(("", f"one kind of request per fault, not {' and '.join(flags)}",
                         "give each its own fault"))
    fields: dict[str, Any] = {"kind": kind}
    if kind is FaultKind.SLOW:
        for key in ("op", "read", "write", "flush", "sector", "once", "errno"):
            if key in raw:
                problems.append((key, f"{key} is not for a slow disk (it slows reads and writes "
                                 "alike)", "a slow fault has bps, iops and latency"))
        fields.update(_slow(raw, problems))
    else:
        allowed = OPS[kind]
        if chosen is None and not problems:
            problems.append(("op", f"which requests: {', '.join(allowed[:-1])} or {allowed[-1]}?",
                             f"op = \"{allowed[0]}\", or {allowed[0]} = true"))
        elif chosen is not None and chosen not in allowed:
            article = "an" if kind is FaultKind.ERROR else "a"
            problems.append(("op", f"{article} {kind.value} fault is on {' or '.join(allowed)}, "
                             f"not {chosen!r}", ""))
        fields["op"] = chosen
        for key in ("bps", "iops", "latency"):
            if key in raw:
                problems.append((key, f"{key} is for a slow fault", 'type = "slow"'))
        if kind is FaultKind.HANG:
            for key in ("sector", "once", "errno"):
                if key in raw:
                    problems.append((key, f"{key} is for an error fault: a hang holds every request "
                                     "of its kind", ""))
        else:
            fields.update(_error(raw, chosen, problems))
    if problems:
        return None, problems
    return DiskFault(**fields), []


def _error(raw: Mapping[str, Any], op: str | None, problems: list[Problem]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    sector = raw.get("sector")
    if sector is not None:
        if isinstance(sector, bool) or not isinstance(sector, int) or sector < 0:
            problems.append(("sector", f"sector is a whole number from 0, not {sector!r}", ""))
        elif op == "flush":
            problems.append(("sector", "a flush is of the whole disk: it has no sector", "leave sector out"))
        else:
            fields["sector"] = sector
    once = raw.get("once", False)
    if not isinstance(once, bool):
        problems.append(("once", "once is true or false", ""))
    else:
        fields["once"] = once
    name = raw.get("errno", "EIO")
    try:
        errno_number(name)
        fields["errno"] = name.strip().upper()
    except ValueError as exc:
        problems.append(("errno", str(exc), "Linux's errno names: EIO, ENOSPC, EROFS, ..."))
    return fields


def _slow(raw: Mapping[str, Any], problems: list[Problem]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if raw.get("bps") is not None:
        try:
            fields["bps"] = parse_rate(raw["bps"])
        except ValueError as exc:
            problems.append(("bps", str(exc), ""))
    for key, most in (("iops", MAX_IOPS), ("latency", MAX_LATENCY_MS)):
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, str) and key == "latency":
            value = _milliseconds(value, problems)
            if value is None:
                continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            problems.append((key, f"{key} is a whole number from 1 to {most}, not {value!r}",
                             "latency is in milliseconds" if key == "latency" else ""))
            continue
        fields["latency_ms" if key == "latency" else key] = value
    if not fields and not problems:
        problems.append(("", "a slow disk needs bps, iops or latency", "e.g. bps = \"1M\""))
    if "iops" in fields and "latency_ms" in fields:
        problems.append(("latency", "latency paces the disk's requests, as iops does: give one of them", ""))
    return fields


def _milliseconds(text: str, problems: list[Problem]) -> int | None:
    match = re.fullmatch(r" *([0-9]+) *(ms|s)? *", text, re.ASCII)
    if not match:
        problems.append(("latency", f"latency {text!r} is not a duration (examples: 20, \"20ms\", "
                         "\"1s\")", ""))
        return None
    return int(match[1]) * (1000 if match[2] == "s" else 1)


def plural(op: str | None) -> str:
    """"reads", "writes", "flushes"."""
    return "flushes" if op == "flush" else f"{op}s"


def requests(ops: list[str]) -> str:
    """"reads and writes"."""
    return " and ".join(plural(op) for op in sorted(ops))


def may_pause(fault: DiskFault, read_error: OnError | None, write_error: OnError | None) -> bool:
    """Whether an error fault pauses the VM when it fires, on a disk with these on_error actions (None:
    QEMU's default): "stop", or writes' default "enospc" with ENOSPC (QEMU counts a failed flush as a
    failed write). QEMU pauses a VM only once every request of its disks is done: such an error and a
    hang on the same VM would wait for each other, and are never set together."""
    if fault.kind is not FaultKind.ERROR:
        return False
    if fault.op == "read":
        return read_error is OnError.STOP
    return write_error is OnError.STOP or (write_error in (None, OnError.ENOSPC) and fault.errno == "ENOSPC")


def replaces(new: DiskFault, old: DiskFault) -> bool:
    """Whether `new`, set on a disk, takes the place of `old`: an error of the same requests and
    sector, or a second slow fault."""
    if new.kind is FaultKind.SLOW:
        return old.kind is FaultKind.SLOW
    return (new.kind is old.kind is FaultKind.ERROR and new.op == old.op and new.sector == old.sector)


def reported_as(fault: DiskFault) -> tuple[str, int]:
    """What QEMU's BLOCK_IO_ERROR says of a request this error fault failed: its operation (a failed
    flush is a failed write) and its errno (the event's reason is its text). Not which rule, nor the
    sector."""
    return ("read" if fault.op == "read" else "write", errno_number(fault.errno))


def mistaken_for(fault: DiskFault, others: Iterable[DiskFault]) -> DiskFault | None:
    """An error fault of `others` that QEMU's events could not tell from `fault` (same operation and
    errno), when either fires only once: the event log, which says when a `--once` error fired, would
    not know which did. None when there is none."""
    if fault.kind is not FaultKind.ERROR:
        return None
    for other in others:
        if (other.kind is FaultKind.ERROR and (fault.once or other.once) and not replaces(fault, other)
                and reported_as(other) == reported_as(fault)):
            return other
    return None


def fired_by(event: Mapping[str, Any], fault: DiskFault) -> bool:
    """Whether a BLOCK_IO_ERROR event's request may have been failed by error `fault`: its operation,
    and its reason the errno's text (QEMU's strerror, as Python's)."""
    operation, number = reported_as(fault)
    reason = event.get("reason")
    return (event.get("operation") == operation
            and (not isinstance(reason, str) or not reason or reason == os.strerror(number)))


def iops_of(fault: DiskFault) -> int | None:
    """The requests per second QEMU's I/O limits get for a slow fault: `iops`, or one request every
    `latency` ms."""
    if fault.latency_ms is not None:
        return max(1, round(1000 / fault.latency_ms))
    return fault.iops


def describe(fault: DiskFault) -> str:
    """`error write at sector 2048, once, ENOSPC`, `hang write`, `slow 1M/s, 100 IOPS`."""
    if fault.kind is FaultKind.SLOW:
        parts = []
        if fault.bps is not None:
            parts.append(f"{_rate(fault.bps)}/s")
        if fault.iops is not None:
            parts.append(f"{fault.iops} IOPS")
        if fault.latency_ms is not None:
            parts.append(f"one request every {fault.latency_ms} ms")
        return "slow " + ", ".join(parts)
    if fault.kind is FaultKind.HANG:
        return f"hang {fault.op}"
    where = f" at sector {fault.sector}" if fault.sector is not None else ""
    return f"error {fault.op}{where}{', once' if fault.once else ''}, {fault.errno}"


def _rate(value: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value >= factor and value % factor == 0:
            return f"{value // factor}{unit}"
    return f"{value}B"


def to_json(fault: DiskFault) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": fault.kind.value}
    if fault.kind is FaultKind.SLOW:
        doc.update({"bps": fault.bps, "iops": fault.iops, "latency_ms": fault.latency_ms})
    else:
        doc["op"] = fault.op
    if fault.kind is FaultKind.ERROR:
        doc.update({"sector": fault.sector, "once": fault.once, "errno": fault.errno})
    return doc


def from_json(doc: Mapping[str, Any]) -> DiskFault:
    """The fault `to_json` wrote (ValueError for anything else)."""
    kind = FaultKind(doc["type"])
    if kind is FaultKind.SLOW:
        return DiskFault(kind, bps=doc.get("bps"), iops=doc.get("iops"), latency_ms=doc.get("latency_ms"))
    if kind is FaultKind.HANG:
        return DiskFault(kind, op=str(doc["op"]))
    return DiskFault(kind, op=str(doc["op"]), sector=doc.get("sector"), once=bool(doc.get("once")),
                     errno=str(doc.get("errno", "EIO")))
