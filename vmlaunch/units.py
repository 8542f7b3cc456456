"""Sizes as users write them: "256M", "2G", "1.5G", "512MiB" or a plain integer."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_FACTOR = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}



def parse_size(text: str | int, default_unit: str = "") -> int:
    """Return a size in bytes. A bare number (or an int) is in `default_unit` ("" = bytes, "M" = MiB).

    Raises ValueError with a message fit for a user.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative")
        return text * _FACTOR[default_unit]
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 256M, 2G, 1.5G)")
    number, unit = match.groups()
    factor = _FACTOR[unit.upper() if unit else default_unit]
    value = float(number) * factor if "." in number else int(number) * factor
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(size: int) -> str:
    """Shortest exact form: 268435456 -> "256M", 1536 -> "1536" bytes when not a whole KiB."""
    for unit in ("T", "G", "M", "K"):
        if size and size % _FACTOR[unit] == 0:
            return f"{size // _FACTOR[unit]}{unit}"
    return str(size)
