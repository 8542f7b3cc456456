"""The one wait helper."""

from __future__ import annotations

import asyncio
import math

import pytest

from vmlaunch.core.wait import TimedOut, remaining, wait_until, wait_until_async


def test_returns_the_first_true_value() -> None:
    calls = iter([None, False, 0, "ready"])
    assert wait_until(lambda: next(calls), 5, interval=0) == 0  # 0 is an answer, not a "not yet"


def test_times_out_with_how_long_it_waited() -> None:
    with pytest.raises(TimedOut) as info:
        wait_until(lambda: None, 0.05, interval=0.01)
    assert info.value.waited >= 0.05


def test_zero_timeout_still_checks_once() -> None:
    assert wait_until(lambda: "now", 0) == "now"


def test_progress_is_reported_while_waiting() -> None:
    seen: list[float] = []
    with pytest.raises(TimedOut):
        wait_until(lambda: None, 0.2, interval=0.01, progress=seen.append, progress_every=0.05)
    assert 2 <= len(seen) <= 5 and seen == sorted(seen)


def test_a_check_that_raises_stops_the_wait() -> None:
    def check() -> None:
        raise RuntimeError("QEMU exited")

    with pytest.raises(RuntimeError, match="QEMU exited"):
        wait_until(check, math.inf)


def test_remaining_has_a_floor() -> None:
    assert remaining(0.0, floor=0.5) == 0.5


def test_async_variant() -> None:
    calls = iter([None, None, 7])
    assert asyncio.run(wait_until_async(lambda: next(calls), 5, interval=0)) == 7
    assert asyncio.run(wait_until_async(lambda: None, 0.02, interval=0.01)) is None
