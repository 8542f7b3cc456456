"""Sizes as users write them, one rule for every size: "256M", "2G", "1.5G", "512MiB" and "64k" are
binary (K = KiB = 2^10 bytes, M = MiB = 2^20, G = GiB = 2^30, T = TiB = 2^40), "4096B" is bytes, and
a bare number (an integer, or digits alone such as "512") is MiB. "MB", "GB", "KB" and "TB" are
refused: they mean 10^6 bytes to some and 2^20 to others."""

from __future__ import annotations

import re

# ASCII only: `\d` would take other scripts' digits ("٢٥٦M"), and IGNORECASE the Kelvin sign for K.
# "B" alone is bytes; "iB" after a prefix ("MiB") says it is binary; "B" after one ("MB") is refused.
# No two runs of spaces may meet (" *(?:UNIT)? *"): backtracking between them is quadratic.
_SIZE = re.compile(r" *([0-9]+)(?:\.([0-9]+))?(?: *(?:([KMGT])(i?B)?|(B)))? *", re.IGNORECASE | re.ASCII)
_BARE = re.compile(r" *[0-9]+(?:\.[0-9]+)? *", re.ASCII)
_FACTOR = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_EITHER = {"K": "10^3 or 2^10", "M": "10^6 or 2^20", "G": "10^9 or 2^30", "T": "10^12 or 2^40"}
BARE_RULE = "a bare number is MiB"  # for every size key of a spec, and `vmlaunch balloon`'s SIZE
MAX_SIZE = (1 << 63) - 1  # QEMU keeps sizes in int64_t: nothing it takes is larger
_MAX_DIGITS = 24  # more than any size up to MAX_SIZE needs, far less than int()'s 4300-digit limit


def parse_size(text: str | int, default_unit: str = "M") -> int:
    """Return a size in bytes. A bare number (an int, or digits alone) counts `default_unit`: MiB, the
    one rule of every size in vmlaunch; a "B" suffix alone always means bytes.

    Raises ValueError with a message fit for a user, which names the unit a bare number was read in
    and, for "MB" and the like, what to write instead.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"{text!r} is not a size (examples: 256M, 2G, 1.5G)")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{_short(text)} is negative")
        if text > MAX_SIZE // _FACTOR[default_unit]:
            raise ValueError(f"{_in_unit(text, default_unit)} is too large")
        return text * _FACTOR[default_unit]
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{_short(text)} is not a size (examples: 256M, 2G, 1.5G)")
    whole: str = match[1].lstrip("0")
    fraction: str = (match[2] or "").rstrip("0")
    prefix, after, byte = match[3], match[4], match[5]
    if len(whole) + len(fraction) > _MAX_DIGITS:
        raise ValueError(f"{_short(text)} is too large")
    if prefix and after and after.upper() == "B":
        raise ValueError(_ambiguous(text, prefix.upper(), whole, fraction))
    unit = prefix.upper() if prefix else "" if byte else default_unit
    shown = _short(text) if prefix or byte else _in_unit(text, unit)
    size = _exact(whole, fraction, _FACTOR[unit])
    if size is None:
        raise ValueError(f"{shown} is not a whole number of bytes")
    if size > MAX_SIZE:
        raise ValueError(f"{shown} is too large")
    return size


def _exact(whole: str, fraction: str, factor: int) -> int | None:
    """whole.fraction times `factor` exactly ("1.0001G" is not a whole number of bytes, however a
    float would round it); None when that is not a whole number."""
    scaled = int(whole + fraction or "0") * factor
    scale: int = 10 ** len(fraction)
    return None if scaled % scale else scaled // scale


def _ambiguous(text: str, prefix: str, whole: str, fraction: str) -> str:
    """Why "128MB" is refused, and what to write: vmlaunch's sizes are binary."""
    said = (f"{_short(text)}: {prefix}B is ambiguous ({_EITHER[prefix]} bytes?); vmlaunch sizes are "
            "binary")
    number = (whole or "0") + (f".{fraction}" if fraction else "")
    size = _exact(whole, fraction, _FACTOR[prefix])
    if size is None or size > MAX_SIZE:
        return f"{said}: {prefix} = {prefix}iB = {_FACTOR[prefix]} bytes"
    return f"{said}: write {number}{prefix} (= {number} {prefix}iB = {size} bytes)"


def is_bare(value: object) -> bool:
    """Whether `value` is a bare number, which counts MiB: an int, or digits alone ("512", "1.5")."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, str) and _BARE.fullmatch(value) is not None


def bare_shown(value: object) -> str | None:
    """A bare number as a message shows it, with its unit and why: "512 MiB (a bare number is MiB)";
    None for anything else, which names its unit itself ("512M", "4096B")."""
    return _in_unit(value, "M") if isinstance(value, (str, int)) and is_bare(value) else None


def _in_unit(value: str | int, unit: str) -> str:
    """A bare number with the unit it was read in: 512 MiB (a bare number is MiB)."""
    text = str(value).strip(" ")
    if len(text) > 40:
        text = f"{text[:30]}...({len(text)} digits)"
    return f"{text} MiB ({BARE_RULE})" if unit == "M" else f"{text} {unit}iB" if unit else f"{text} bytes"


def spelled(size: int) -> str:
    """A size in bytes, shortest exact form and its unit in words: "16T (16 TiB)", "1536B (1536 bytes)"."""
    short = format_size(size)
    unit = short[-1]
    return f"{short} ({short[:-1]} bytes)" if unit == "B" else f"{short} ({short[:-1]} {unit}iB)"


def mib_words(mib: int) -> str:
    """A number of MiB for a note, a size a human reads first: "1T (1048576 MiB)", "512 MiB", and
    to a tenth of a GiB when it is no whole one: "1024.2G (1048832 MiB)"."""
    short = format_size(mib << 20)
    if not mib or short.endswith("M"):
        return f"{human_size(mib << 20)} ({mib} MiB)" if mib >= 10 << 10 else f"{mib} MiB"
    return f"{short} ({mib} MiB)"


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
    """Shortest exact form, which parse_size reads back: 268435456 -> "256M", 1536 -> "1536B" (bytes,
    when not a whole KiB: a bare number would be MiB)."""
    for unit in ("T", "G", "M", "K"):
        if size and size % _FACTOR[unit] == 0:
            return f"{size // _FACTOR[unit]}{unit}"
    return f"{size}B"


def human_size(size: int) -> str:
    """To the nearest MiB, or tenth of a GiB from 10G on, for a table: 123456789 -> "118M"."""
    if size >= 10 << 30:
        return f"{size / (1 << 30):.1f}G"
    mib = round(size / (1 << 20))
    return format_size(mib << 20) if mib else "0M" if size == 0 else "<1M"
