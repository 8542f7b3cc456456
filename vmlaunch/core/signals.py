"""Signals that would cut a rollback short are held until it is done."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP for the block; they are delivered after it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs handlers in the main thread only: nothing to hold here
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
