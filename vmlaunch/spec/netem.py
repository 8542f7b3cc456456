"""The netem figures as users write them, one parser for the spec (`netem = { ... }` on a NIC), the CLI
(`vmlaunch netem`) and the API (`Vm.netem`):

- delay, jitter: a duration with its unit, as tc writes them ("20ms", "1.5ms", "500us", "1s"); in the
  spec a unit is required, on the command line and in the API a bare number is milliseconds;
- loss, corrupt, duplicate, reorder: a percentage 0-100 ("1%", "0.5", 30);
- rate: bits per second with one of tc's units (bit kbit mbit gbit tbit, or bytes: bps kbps mbps gbps
  tbps; powers of 1000); a rate without a unit is refused (is "10" bits, bytes or megabits?).

Reorder and jitter need a delay: netem reorders by sending some packets at once while the rest wait,
and jitter varies the delay.

What each figure does to which direction (spec/model.py `Netem`): delay, jitter, loss, corrupt,
duplicate and reorder apply to the traffic the VM's NIC sends, so once per round trip; rate to each
direction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from vmlaunch.spec.model import Netem, NetemWhere

FIGURES = ("delay", "jitter", "loss", "corrupt", "duplicate", "reorder", "rate")
PERCENTS = ("loss", "corrupt", "duplicate", "reorder")
KEYS = (*FIGURES, "where")
MAX_DELAY_MS = 60_000.0  # a minute each way: more is a typo (and netem's queue would hold it all)
# The netlink netem rate is a u32 of bytes per second (TCA_NETEM_RATE): about 34 Gbit/s
MAX_RATE_BIT = (2**32 - 1) * 8

_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_DURATION = re.compile(rf" *{_NUMBER} *(us|usec|ms|msec|s|sec|secs)? *", re.ASCII | re.IGNORECASE)
_PERCENT = re.compile(rf" *{_NUMBER} *(%)? *", re.ASCII)
_RATE = re.compile(rf" *{_NUMBER} *([a-z]*) *", re.ASCII | re.IGNORECASE)
_MS = {"us": 0.001, "usec": 0.001, "ms": 1.0, "msec": 1.0, "s": 1000.0, "sec": 1000.0, "secs": 1000.0}
# tc's rate units (tc(8) "RATES"): bit and its SI multiples, and bytes per second ("bps", sic)
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
              "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}
RATE_HINT = ("with a unit as tc writes rates: bit, kbit, mbit, gbit, tbit (bits/s) or bps, kbps, mbps, "
             "gbps (bytes/s)")

Problem = tuple[str, str, "str | None"]  # (key, message, hint)


class NetemValueError(ValueError):
    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} characters)"


def parse_delay(value: object, *, bare_ms: bool) -> float:
    """Milliseconds from "20ms", "500us", "1s" (and, with `bare_ms`, 20 or "20")."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise NetemValueError(f"{_shown(value)} is not a duration", 'e.g. "20ms"')
    if isinstance(value, (int, float)):
        if not bare_ms:
            raise NetemValueError(f"{_shown(value)} has no unit", f'write "{value}ms" (or us, s)')
        number, unit = float(value), "ms"
    else:
        if value.strip().startswith("-"):
            raise NetemValueError(f"{_shown(value)} is negative", "a delay is 0 or more")
        found = _DURATION.fullmatch(value)
        if found is None or len(found[1]) > 12:
            raise NetemValueError(f"{_shown(value)} is not a duration", 'e.g. "20ms", "500us", "1s"')
        if found[2] is None and not bare_ms:
            raise NetemValueError(f"{_shown(value)} has no unit", f'write "{value.strip()}ms" (or us, s)')
        number, unit = float(found[1]), (found[2] or "ms").lower()
    if math.isnan(number) or number < 0:
        raise NetemValueError(f"{_shown(value)} is negative", "a delay is 0 or more")
    ms = number * _MS[unit]
    if not ms <= MAX_DELAY_MS:
        raise NetemValueError(f"{_shown(value)} is more than a minute", "at most 60s")
    return round(ms * 1000) / 1000  # whole microseconds: what netem keeps


def parse_percent(value: object) -> float:
    """A percentage 0-100 from "1%", "0.5", 30."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise NetemValueError(f"{_shown(value)} is not a percentage", 'e.g. "1%" or 0.5')
    if isinstance(value, str):
        if value.strip().startswith("-"):
            raise NetemValueError(f"{_shown(value)} is not a percentage from 0 to 100")
        found = _PERCENT.fullmatch(value)
        if found is None or len(found[1]) > 12:
            raise NetemValueError(f"{_shown(value)} is not a percentage", 'e.g. "1%" or "0.5"')
        number = float(found[1])
    else:
        number = float(value)
    if not 0 <= number <= 100:  # NaN too
        raise NetemValueError(f"{_shown(value)} is not a percentage from 0 to 100")
    return number


def parse_rate(value: object) -> int:
    """Bits per second from "10mbit", "1gbit", "125kbps"; a number without a unit is refused."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise NetemValueError(f"{_shown(value)} is not a rate", RATE_HINT)
    if isinstance(value, (int, float)):
        raise NetemValueError(f"{_shown(value)} has no unit", RATE_HINT)
    if value.strip().startswith("-"):
        raise NetemValueError(f"{_shown(value)} is negative", "a rate is more than 0")
    found = _RATE.fullmatch(value)
    if found is None or len(found[1]) > 15:
        raise NetemValueError(f"{_shown(value)} is not a rate", RATE_HINT)
    unit = found[2].lower()
    if not unit:
        raise NetemValueError(f"{_shown(value)} has no unit", RATE_HINT)
    if unit not in RATE_UNITS:
        raise NetemValueError(f"{_shown(value)}: {found[2]!r} is not a rate unit", RATE_HINT)
    bits = round(float(found[1]) * RATE_UNITS[unit])
    if bits < 8:
        raise NetemValueError(f"{_shown(value)} is less than a byte per second", "a rate is 8bit or more")
    if bits > MAX_RATE_BIT:
        raise NetemValueError(f"{_shown(value)} is more than netem can shape", "at most 34gbit")
    return bits


def parse_netem(values: Mapping[str, Any], *, bare_ms: bool) -> tuple[Netem | None, list[Problem]]:
    """A Netem from the figures given (None values are not given), and every problem found, each with
    the key it is about. `bare_ms`: a bare delay is milliseconds (the CLI, the API); in the spec a
    delay needs its unit."""
    problems: list[Problem] = []
    given: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        try:
            if key in ("delay", "jitter"):
                given[f"{key}_ms"] = parse_delay(value, bare_ms=bare_ms)
            elif key in PERCENTS:
                given[key] = parse_percent(value)
            elif key == "rate":
                given["rate_bit"] = parse_rate(value)
            elif key == "where":
                try:
                    given["where"] = NetemWhere(value)
                except ValueError:
                    raise NetemValueError(f"{_shown(value)} is not one of auto, host, guest") from None
            else:
                raise NetemValueError(f"unknown figure {_shown(key)}", f"known: {', '.join(KEYS)}")
        except NetemValueError as exc:
            problems.append((key, exc.message, exc.hint))
    if problems:
        return None, problems
    netem = Netem(**given)
    if not figures(netem):
        return None, [("", "sets no figure", f"give one or more of {', '.join(FIGURES)}")]
    for key in ("jitter", "reorder"):
        if key in values and values[key] is not None and not netem.delay_ms:
            what = "varies the delay" if key == "jitter" else "sends some packets at once while the rest wait"
            problems.append((key, f"{key} needs a delay ({key} {what})", "add a delay, e.g. \"20ms\""))
    return (None, problems) if problems else (netem, [])


def figures(netem: Netem) -> dict[str, str]:
    """The figures set, as text a user reads and the parser reads back: {"delay": "100ms", ...}."""
    shown: dict[str, str] = {}
    for key in ("delay", "jitter"):
        value = getattr(netem, f"{key}_ms")
        if value is not None:
            shown[key] = f"{value:g}ms"
    for key in PERCENTS:
        value = getattr(netem, key)
        if value is not None:
            shown[key] = f"{value:g}%"
    if netem.rate_bit is not None:
        shown["rate"] = format_rate(netem.rate_bit)
    return shown


def format_rate(bits: int) -> str:
    """Shortest exact form in tc's bit units: 10000000 -> "10mbit"."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits % RATE_UNITS[unit] == 0:
            return f"{bits // RATE_UNITS[unit]}{unit}"
    return f"{bits}bit"


def to_json(netem: Netem) -> dict[str, Any]:
    """The record of wire.json: figures in fixed units, only those set."""
    keys = ("delay_ms", "jitter_ms", *PERCENTS, "rate_bit")
    return {key: getattr(netem, key) for key in keys if getattr(netem, key) is not None}


def from_json(data: Mapping[str, Any]) -> Netem | None:
    """A Netem back from wire.json; None when the record is not one (edited, another version)."""
    keys = ("delay_ms", "jitter_ms", *PERCENTS, "rate_bit")
    try:
        given = {key: data[key] for key in keys if data.get(key) is not None}
        if any(isinstance(value, bool) or not isinstance(value, (int, float)) for value in given.values()):
            return None
        if "rate_bit" in given:
            given["rate_bit"] = int(given["rate_bit"])
        return Netem(**given)
    except (TypeError, ValueError):
        return None


def resolve_where(where: NetemWhere, *, host_side: bool, host_netem: bool) -> NetemWhere:
    """Where a NIC's netem runs, HOST or GUEST: `auto` is the host where the NIC has a host interface
    (a tap: bridge and tap networks) and the host kernel has netem, else the guest. `host` is returned
    as asked: the caller refuses it where it cannot be (no host interface, no netem)."""
    if where is NetemWhere.AUTO:
        return NetemWhere.HOST if host_side and host_netem else NetemWhere.GUEST
    return where
