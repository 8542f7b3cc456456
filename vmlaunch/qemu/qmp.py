"""Talking QMP to QEMU: the project's one QMP module.

qemu.qmp (QEMU's own library, asyncio) serves every connection that lives longer than one exchange:
`AsyncQmp` for code on an event loop (`down` stopping many VMs at once, the lab manager), `Qmp` as a
blocking facade over it on a private loop (balloon waits, the Python API). `up`'s hot path and one-shot
queries use `QuickQmp`, a bare blocking exchange over the socket: importing qemu.qmp and starting an
event loop costs ~60 ms, more than QEMU itself takes to start (measured in bench/up.py). Both report
failures through `failure()`, so a QMP error reads the same whichever client met it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from vmlaunch.core.wait import TimedOut, remaining, wait_until
from vmlaunch.errors import RuntimeFailure

T = TypeVar("T")


class QmpError(RuntimeFailure):
    """A QMP command failed or the VM did not answer."""


def failure(command: str, desc: str) -> QmpError:
    """The error for a command QEMU refused, whichever client sent it."""
    return QmpError(f"QMP {command} failed: {desc}")


def unanswered(path: Path, why: str) -> QmpError:
    return QmpError(f"no QMP answer on {path}: {why}")


def result(command: str, reply: dict[str, Any]) -> Any:
    """The value of a reply to `command`, or its error as a QmpError."""
    if "error" in reply:
        error = reply["error"]
        raise failure(command, str(error.get("desc") if isinstance(error, dict) else error))
    return reply["return"]


class QuickQmp:
    """A bare blocking QMP connection: connect (waiting for QEMU to listen), negotiate, exchange."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        deadline = time.monotonic() + timeout
        self.conn = self._connect(deadline, timeout)
        self.stream = self.conn.makefile("rwb")
        self._read()  # the greeting
        self.cmd("qmp_capabilities")

    def _connect(self, deadline: float, timeout: float) -> socket.socket:
        last: list[OSError] = []

        def attempt() -> socket.socket | None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(remaining(deadline, 0.1))
            try:
                conn.connect(str(self.path))
                return conn
            except OSError as exc:
                conn.close()
                last[:] = [exc]
                return None

        try:
            return wait_until(attempt, timeout, interval=0.005)
        except TimedOut:
            why = (last[0].strerror or str(last[0])) if last else "timed out"
            raise unanswered(self.path, why) from None

    def _read(self) -> dict[str, Any]:
        try:
            line = self.stream.readline()
        except OSError as exc:
            raise QmpError(f"QMP: {exc}") from None
        if not line:
            raise QmpError("QMP: QEMU closed the connection")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def cmd(self, command: str, **args: Any) -> Any:
        return self.cmd_with_fds(command, (), **args)

    def cmd_with_fds(self, command: str, fds: Sequence[int], **args: Any) -> Any:
        """`cmd`, with `fds` passed along (SCM_RIGHTS) for the commands that take one (add-fd,
        getfd): QEMU gets its own copies, the caller's stay open."""
        message: dict[str, Any] = {"execute": command}
        if args:
            message["arguments"] = args
        data = json.dumps(message).encode() + b"\n"
        if fds:
            self.stream.flush()
            try:
                socket.send_fds(self.conn, [data], list(fds))
            except OSError as exc:
                raise QmpError(f"QMP: {exc}") from None
        else:
            self.stream.write(data)
            self.stream.flush()
        while True:
            reply = self._read()
            if "return" in reply or "error" in reply:
                return result(command, reply)
            # anything else is an event: not what we wait for

    def add_fd(self, fd: int) -> int:
        """Hand QEMU a copy of `fd` in a new fd set; returns the set's id, for `/dev/fdset/ID` as a
        file name and for `remove_fd`. QEMU opens such a name by duplicating a descriptor of the set
        whose access mode matches (O_WRONLY for a file it writes): it never opens a path of its own,
        which a confined QEMU could not."""
        reply = self.cmd_with_fds("add-fd", [fd])
        return int(reply["fdset-id"])

    def remove_fd(self, fdset: int) -> None:
        self.cmd("remove-fd", **{"fdset-id": fdset})

    def close(self) -> None:
        self.stream.close()
        self.conn.close()

    def __enter__(self) -> QuickQmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncQmp:
    """qemu.qmp's QMPClient with vmlaunch's errors and a timeout on every exchange."""

    def __init__(self, path: Path, timeout: float = 5.0) -> None:
        from qemu.qmp import QMPClient

        self.path = path
        self.timeout = timeout
        self.client = QMPClient(f"vmlaunch-{path.stem}")

    async def _bounded(self, awaitable: Awaitable[T], timeout: float) -> T:
        import asyncio

        from qemu.qmp import ExecuteError, QMPError

        try:
            return await asyncio.wait_for(awaitable, timeout)
        except ExecuteError as exc:
            raise QmpError(exc.error.error.desc) from None
        except asyncio.TimeoutError:
            raise QmpError(f"no answer within {timeout:g} s") from None
        except (QMPError, OSError, EOFError) as exc:
            raise QmpError(str(exc) or type(exc).__name__) from None

    async def connect(self) -> None:
        """Connect, retrying while QEMU is not listening yet, until the timeout."""
        import asyncio

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                await self._bounded(self.client.connect(str(self.path)), remaining(deadline, 0.1))
                return
            except QmpError as exc:
                if time.monotonic() >= deadline:
                    raise unanswered(self.path, exc.message) from None
                await asyncio.sleep(0.05)

    async def cmd(self, command: str, **args: Any) -> Any:
        try:
            return await self._bounded(self.client.execute(command, args or None), self.timeout)
        except QmpError as exc:
            raise failure(command, exc.message) from None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._bounded(self.client.disconnect(), 1.0)


class Qmp:
    """A blocking QMP connection to one VM: `AsyncQmp` on a private event loop."""

    def __init__(self, path: Path, timeout: float = 5.0) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda loop, context: None)  # errors reach us as exceptions
        self.client = AsyncQmp(path, timeout)
        try:
            self.loop.run_until_complete(self.client.connect())
        except BaseException:
            self.loop.close()
            raise

    def cmd(self, command: str, **args: Any) -> Any:
        return self.loop.run_until_complete(self.client.cmd(command, **args))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()

    def __enter__(self) -> Qmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
