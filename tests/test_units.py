from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmlaunch.units import format_size, parse_size


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
