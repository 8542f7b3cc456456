from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmlaunch.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize(("text", "unit", "expected"), [
    ("256M", "", 256 << 20),
    ("2G", "", 2 << 30),
    ("1.5G", "", 1536 << 20),
    ("512MiB", "", 512 << 20),
    ("64k", "", 64 << 10),
    ("4096", "", 4096),
    (256, "M", 256 << 20),
    ("256", "M", 256 << 20),
])
def test_parse_size(text: str | int, unit: str, expected: int) -> None:
    assert parse_size(text, default_unit=unit) == expected


@pytest.mark.parametrize("text", ["12X", "", "-1M", "1.3", "M", True])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_round_trips(size: int) -> None:
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize(("text", "unit", "expected"), [
    ("256B", "M", 256),  # B alone is bytes, whatever the default unit
    ("16777216B", "M", 16 << 20),
    ("16777216b", "", 16 << 20),
    ("1KB", "M", 1 << 10),  # after a prefix, B adds nothing
    (" 1 K ", "", 1 << 10),
    ("0001M", "", 1 << 20),
    ("1.50000000000000000000000000000000G", "", 1536 << 20),  # exact, however long
    ("0.5K", "", 512),
])
def test_parse_size_bytes_and_exactness(text: str, unit: str, expected: int) -> None:
    assert parse_size(text, default_unit=unit) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("256M\n", "is not a size"),  # `$` would let the newline through
    ("256M\t", "is not a size"),
    ("\u0662\u0665\u0666M", "is not a size"),  # Arabic-Indic digits: int() takes them, \d matches
    ("256\u212a", "is not a size"),  # the Kelvin sign, which IGNORECASE takes for k
    ("256iB", "is not a size"),
    ("0.1", "is not a whole number of bytes"),
    ("1.0001G", "is not a whole number of bytes"),
    ("9" * 400 + "G", "is too large"),
    ("9223372036854775808", "is too large"),  # 2**63: past QEMU's int64
    (10**400, "is too large"),
    (256.0, "is not a size"),
    (float("nan"), "is not a size"),
    (None, "is not a size"),
])
def test_parse_size_refuses_with_a_message(text: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_size(text)  # type: ignore[arg-type]
    assert len(str(info.value)) < 100  # a 400-digit number is not echoed whole


def test_parse_size_is_linear_on_long_text() -> None:
    import time

    start = time.monotonic()
    for text in ("1" + " " * 100_000 + "x", "1" * 100_000 + "x", " " * 100_000):
        with pytest.raises(ValueError):
            parse_size(text)
    assert time.monotonic() - start < 1


@pytest.mark.parametrize(("text", "seconds"), [("5s", 5.0), ("500ms", 0.5), ("1ms", 0.001), ("1m", 60.0),
                                               (2, 2.0), ("1440m", 86400.0)])
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0.5ms", 0.0001, 0, "0s", -1, "1441m", True, "soon", "1h"])
def test_durations_outside_1_ms_and_a_day_are_refused(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)  # type: ignore[arg-type]
