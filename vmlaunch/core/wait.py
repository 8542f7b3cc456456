"""The one way vmlaunch waits: poll a check until it holds or a deadline passes.

Every loop that waits (for a lock, a QMP socket, a console line, a QEMU to exit, a balloon to settle)
goes through `wait_until`, so each has a deadline, a polling interval and, when it takes a while, a
progress callback; none sleeps blindly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

Progress = Callable[[float], None]  # called with the seconds waited so far


class TimedOut(Exception):
    """The check did not hold before the deadline; callers turn it into a message of their own."""

    def __init__(self, waited: float) -> None:
        super().__init__(f"timed out after {waited:.1f} s")
        self.waited = waited


def wait_until(check: Callable[[], T | None], timeout: float, *, interval: float = 0.1,
               progress: Progress | None = None, progress_every: float = 5.0) -> T:
    """Call `check` until it returns something other than None/False and return that.

    Raises `TimedOut` once `timeout` seconds have passed (`math.inf` waits for ever). `check` may raise
    to stop the wait early (a QEMU that exited will never print its ready line). `progress` is called
    every `progress_every` seconds while waiting.
    """
    start = time.monotonic()
    deadline = start + timeout if math.isfinite(timeout) else math.inf
    next_progress = start + progress_every
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        now = time.monotonic()
        if now >= deadline:
            raise TimedOut(now - start)
        if progress is not None and now >= next_progress:
            progress(now - start)
            next_progress = now + progress_every
        time.sleep(max(0.0, min(interval, deadline - now)))


def remaining(deadline: float, floor: float = 0.0) -> float:
    """Seconds left until a `time.monotonic()` deadline, at least `floor`."""
    return max(floor, deadline - time.monotonic())


async def wait_until_async(check: Callable[[], T | None], timeout: float, *,
                           interval: float = 0.05) -> T | None:
    """`wait_until` for code on an event loop: returns None at the deadline instead of raising."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(max(0.0, min(interval, deadline - time.monotonic())))
