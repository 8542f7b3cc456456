"""Sizes as users write them: "256M", "2G", "1.5G", "512MiB", "4096B" or a plain integer."""

from __future__ import annotations

import re

# ASCII only: `\d` would take other scripts' digits ("٢٥٦M"), and IGNORECASE the Kelvin sign for K.
# "B" alone is bytes; after a prefix ("MB", "MiB") it adds nothing: every prefix is binary.
# No two runs of spaces may meet (" *(?:UNIT)? *"): backtracking between them is quadratic.
_SIZE = re.compile(r" *([0-9]+)(?:\.([0-9]+))?(?: *(?:([KMGT])(?:i?B)?|(B)))? *", re.IGNORECASE | re.ASCII)
_FACTOR = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = (1 << 63) - 1  # QEMU keeps sizes in int64_t: nothing it takes is larger
_MAX_DIGITS = 24  # more than any size up to MAX_SIZE needs, far less than int()'s 4300-digit limit


def parse_size(text: str | int, default_unit: str = "") -> int:
    """Return a size in bytes. A bare number (or an int) is in `default_unit` ("" = bytes, "M" = MiB);
    a "B" suffix alone always means bytes.

    Raises ValueError with a message fit for a user.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"{text!r} is not a size (examples: 256M, 2G, 1.5G)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{_short(text)} is negative")
        if text > MAX_SIZE // _FACTOR[default_unit]:
            raise ValueError(f"{_short(text)} is too large")
        return text * _FACTOR[default_unit]
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{_short(text)} is not a size (examples: 256M, 2G, 1.5G)")
    whole: str = match[1].lstrip("0")
    fraction: str = (match[2] or "").rstrip("0")
    prefix, byte = match[3], match[4]
    if len(whole) + len(fraction) > _MAX_DIGITS:
        raise ValueError(f"{_short(text)} is too large")
    factor = _FACTOR[prefix.upper() if prefix else "" if byte else default_unit]
    # exact: "1.0001G" is not a whole number of bytes, however a float would round it
    scaled = int(whole + fraction or "0") * factor
    scale: int = 10 ** len(fraction)
    if scaled % scale:
        raise ValueError(f"{_short(text)} is not a whole number of bytes")
    if scaled // scale > MAX_SIZE:
        raise ValueError(f"{_short(text)} is too large")
    return scaled // scale


_DURATION = re.compile(r" *([0-9]+(?:\.[0-9]+)?) *(ms|s|m)? *", re.ASCII)
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(text: str | float) -> float:
    """Seconds from "5s", "500ms", "1m" or a number of seconds; raises ValueError for a user."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"{text!r} is not a duration (examples: 5s, 500ms, 1m)")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        match = _DURATION.fullmatch(text)
        if not match or len(match[1]) > 12:
            raise ValueError(f"{_short(text)} is not a duration (examples: 5s, 500ms, 1m)")
        seconds = float(match[1]) * _SECONDS[match[2]]
    if not 0.001 <= seconds <= 86400:
        raise ValueError(f"{_short(str(text))} is not between 1 ms and a day")
    return seconds


def _short(value: str | int) -> str:
    """`value` as a message shows it: repr, cut short when long (a size of 400 digits)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} characters)"


def format_size(size: int) -> str:
    """Shortest exact form: 268435456 -> "256M", 1536 -> "1536" bytes when not a whole KiB."""
    for unit in ("T", "G", "M", "K"):
        if size and size % _FACTOR[unit] == 0:
            return f"{size // _FACTOR[unit]}{unit}"
    return str(size)


def human_size(size: int) -> str:
    """To the nearest MiB, or tenth of a GiB from 10G on, for a table: 123456789 -> "118M"."""
    if size >= 10 << 30:
        return f"{size / (1 << 30):.1f}G"
    mib = round(size / (1 << 20))
    return format_size(mib << 20) if mib else "0M" if size == 0 else "<1M"
