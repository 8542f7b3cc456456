"""Talking QMP to QEMU: the project's one QMP module.

qemu.qmp (QEMU's own library, asyncio) serves every connection that lives longer than one exchange:
`AsyncQmp` for code on an event loop (`down` stopping many VMs at once, the lab manager), `Qmp` as a
blocking facade over it on a private loop (balloon waits, the Python API). `up`'s hot path and one-shot
queries use `QuickQmp`, a bare blocking exchange over the socket: importing qemu.qmp and starting an
event loop costs ~60 ms, more than QEMU itself takes to start (measured in bench/up.py). Both report
failures through `failure()`, so a QMP error reads the same whichever client met it.

QEMU sends events (STOP, BLOCK_IO_ERROR, BALLOON_CHANGE, ...) on every monitor whenever they happen.
qemu.qmp's default listener keeps each one forever (its history, and a queue nobody need read): in a
process that lives as long as its lab (the lab manager), that grows without end. `AsyncQmp` puts a
bounded listener in its place (`EventBacklog`): the last EVENT_BACKLOG events wait to be taken, older
ones are dropped and counted.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from vmlaunch.core.wait import TimedOut, remaining, wait_until
from vmlaunch.errors import RuntimeFailure

if TYPE_CHECKING:
    from qemu.qmp.events import EventListener

T = TypeVar("T")
EVENT_BACKLOG = 1000  # events waiting to be taken, at most; older ones are dropped


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

    def send(self, command: str, **args: Any) -> None:
        """Write a command, not waiting for its answer (`reply` reads it; QEMU answers in order): `up`
        resumes ten paused VMs with one round trip, not ten one after another."""
        message: dict[str, Any] = {"execute": command}
        if args:
            message["arguments"] = args
        try:
            self.stream.write(json.dumps(message).encode() + b"\n")
            self.stream.flush()
        except OSError as exc:
            raise QmpError(f"QMP: {exc}") from None

    def reply(self, command: str) -> Any:
        """The answer to the oldest command `send` wrote (events before it are skipped)."""
        while True:
            reply = self._read()
            if "return" in reply or "error" in reply:
                return result(command, reply)

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


class Backlog(Protocol):
    """The events of one QMP connection waiting to be taken (`event_backlog`)."""

    dropped: int

    async def get(self) -> Any: ...

    def take(self) -> list[dict[str, Any]]: ...


def event_backlog(limit: int = EVENT_BACKLOG) -> Backlog:
    """A listener for every event that keeps the last `limit` of them (`EventBacklog`). Its class is
    made here: it derives from qemu.qmp's, which is imported only where QMP is spoken."""
    from qemu.qmp.events import EventListener

    class EventBacklog(EventListener):
        """qemu.qmp's EventListener, bounded: the QMP client hands it each event (`put`, which must
        never block: it runs in the client's reader), `get` waits for the next one, `take` takes what
        waits. When `limit` events wait, the oldest goes (`dropped` counts them): a reader that fell
        behind loses the oldest news, never the newest, and memory stays bounded."""

        def __init__(self) -> None:
            super().__init__()
            self.waiting: deque[dict[str, Any]] = deque(maxlen=limit)
            self.dropped = 0
            self.arrived: Any = None  # an asyncio.Event, made on the loop that reads (`get`)

        async def put(self, event: Any) -> None:
            if not self.accept(event):
                return
            if len(self.waiting) == self.waiting.maxlen:
                self.dropped += 1
            self.waiting.append(dict(event))
            if self.arrived is not None:
                self.arrived.set()

        async def get(self) -> Any:
            import asyncio

            while not self.waiting:
                if self.arrived is None:
                    self.arrived = asyncio.Event()
                self.arrived.clear()
                await self.arrived.wait()
            return self.waiting.popleft()

        def empty(self) -> bool:
            return not self.waiting

        def clear(self) -> list[Any]:
            return self.take()

        def take(self) -> list[dict[str, Any]]:
            taken = list(self.waiting)
            self.waiting.clear()
            return taken

    return EventBacklog()


class AsyncQmp:
    """qemu.qmp's QMPClient with vmlaunch's errors, a timeout on every exchange and a bounded backlog
    of the events QEMU sent (`next_event`, `take_events`)."""

    def __init__(self, path: Path, timeout: float = 5.0) -> None:
        from qemu.qmp import QMPClient

        self.path = path
        self.timeout = timeout
        self.client = QMPClient(f"vmlaunch-{path.stem}")
        unbounded = self.client.events
        self.events = event_backlog(EVENT_BACKLOG)
        listener = cast("EventListener", self.events)
        self.client.events = listener  # qemu.qmp refuses to remove the listener named so
        self.client.register_listener(listener)
        self.client.remove_listener(unbounded)

    async def next_event(self) -> dict[str, Any]:
        """The next event QEMU sent ({"event", "data", "timestamp"}), waiting for one as long as it
        takes; the oldest waiting first."""
        event: dict[str, Any] = await self.events.get()
        return event

    def take_events(self) -> list[dict[str, Any]]:
        """The events waiting, oldest first, without waiting for more."""
        return self.events.take()

    @property
    def dropped_events(self) -> int:
        """Events dropped because EVENT_BACKLOG of them were waiting."""
        return self.events.dropped

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
