from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmlaunch.core.units import (
    bare_shown,
    format_size,
    is_bare,
    mib_words,
    parse_duration,
    parse_size,
    spelled,
)


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
    ("1KiB", "M", 1 << 10),  # iB after a prefix says it is binary
    (" 1 K ", "", 1 << 10),
    ("0001M", "", 1 << 20),
    ("1.50000000000000000000000000000000G", "", 1536 << 20),  # exact, however long
    ("0.5K", "", 512),
])
def test_parse_size_bytes_and_exactness(text: str, unit: str, expected: int) -> None:
    assert parse_size(text, default_unit=unit) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("512", 512 << 20), (512, 512 << 20), (" 4096 ", 4096 << 20), ("1.5", 1536 << 10), (1, 1 << 20),
    ("1.5GiB", 1536 << 20), ("64k", 64 << 10), ("512 MiB", 512 << 20), ("2 g", 2 << 30), ("1tib", 1 << 40),
    ("16 KiB", 16 << 10), ("4096B", 4096), ("4096 b", 4096), ("3T", 3 << 40),
])
def test_a_bare_number_is_mib_and_units_are_binary(text: str | int, expected: int) -> None:
    """One rule, whatever the key: no default unit to pass, a bare number (int or digits) is MiB."""
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("128MB", "'128MB': MB is ambiguous (10^6 or 2^20 bytes?); vmlaunch sizes are binary: write 128M "
              "(= 128 MiB = 134217728 bytes)"),
    ("2gb", "'2gb': GB is ambiguous (10^9 or 2^30 bytes?); vmlaunch sizes are binary: write 2G "
            "(= 2 GiB = 2147483648 bytes)"),
    ("512 MB", "write 512M (= 512 MiB = 536870912 bytes)"),
    ("128 mb", "write 128M (= 128 MiB = 134217728 bytes)"),
    ("1.5GB", "write 1.5G (= 1.5 GiB = 1610612736 bytes)"),
    ("64KB", "KB is ambiguous (10^3 or 2^10 bytes?); vmlaunch sizes are binary: write 64K (= 64 KiB = "
             "65536 bytes)"),
    ("1 tb", "TB is ambiguous (10^12 or 2^40 bytes?); vmlaunch sizes are binary: write 1T (= 1 TiB = "
             "1099511627776 bytes)"),
    ("2Gb", "GB is ambiguous"),
    ("0.1KB", "KB is ambiguous (10^3 or 2^10 bytes?); vmlaunch sizes are binary: K = KiB = 1024 bytes"),
    ("99999999TB", "TB is ambiguous (10^12 or 2^40 bytes?); vmlaunch sizes are binary: T = TiB = "
                   "1099511627776 bytes"),
])
def test_mb_and_gb_are_refused_with_the_binary_meaning(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert message in str(info.value)


@pytest.mark.parametrize(("value", "shown"), [
    (134217728, "134217728 MiB (a bare number is MiB)"), ("512", "512 MiB (a bare number is MiB)"),
    (" 1.5 ", "1.5 MiB (a bare number is MiB)"), ("512M", None), ("4096B", None), (True, None), (2.0, None),
])
def test_a_bare_number_is_shown_with_its_unit(value: object, shown: str | None) -> None:
    assert bare_shown(value) == shown
    assert is_bare(value) == (shown is not None)


def test_messages_name_the_unit_a_bare_number_was_read_in() -> None:
    with pytest.raises(ValueError, match=r"^9223372036854775807 MiB \(a bare number is MiB\) is too large$"):
        parse_size(9223372036854775807)
    with pytest.raises(ValueError, match=r"^0\.0000001 MiB \(a bare number is MiB\) is not a whole "
                       r"number of bytes$"):
        parse_size("0.0000001")  # 0.1048576 bytes
    assert (spelled(16 << 40), spelled(16 << 20), spelled(1536)) == (
        "16T (16 TiB)", "16M (16 MiB)", "1536B (1536 bytes)")
    assert (mib_words(1 << 20), mib_words(512), mib_words(1048832), mib_words(3072), mib_words(0)) == (
        "1T (1048576 MiB)", "512 MiB", "1024.2G (1048832 MiB)", "3G (3072 MiB)", "0 MiB")
    assert (format_size(1536), format_size(0)) == ("1536B", "0B")  # a bare 1536 would be MiB


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
