"""The command channel to a guest: run a command in it without its network or SSH.

QEMU carries the channel on virtio-serial ports (compile/compiler.py puts them in when a VM's `agent`
is on), each a socket in the run dir (0600, like QMP: whoever opens it is root in the guest):

- `V.agent`, port org.vmlaunch.agent.0: vmlaunch's own agent (guests/guest_agent.py, or
  guests/guest_agent.sh where the guest has no python3), installed by the cloud-init seed and built
  into the project's test guest. Protocol VLA1, described in those files: a `hello` with a nonce (the
  answer to it proves the agent is there and that what is read next belongs to this client), then one
  `exec` at a time, length-prefixed both ways, so any bytes pass.
- `V.qga`, port org.qemu.guest_agent.0: QEMU's guest agent, where the guest runs one
  (`guest-sync-delimited`, `guest-exec`, `guest-exec-status`). Its output is capped by qemu-ga itself
  (16 MiB).

`run` takes whichever answers, vmlaunch's agent first. A channel serves one client at a time: clients
of one VM queue on `V.agent.lock`.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import secrets
import select
import shlex
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from vmlaunch.core.textsafe import printable
from vmlaunch.errors import AgentError, CommandTimedOut, GuestPaused, RuntimeFailure, UsageError
from vmlaunch.layout.rundir import RunDir, VmFiles, open_in_run_dir

DEFAULT_TIMEOUT = 60.0  # seconds a command may run
DEFAULT_WAIT = 60.0  # seconds to wait for an agent to answer (a guest still booting)
DEFAULT_LIMIT = 64 << 20  # bytes kept of each output stream
GRACE = 15.0  # seconds a step of the protocol (a reply, the output) may take before the channel is hung
SETTLE = 5.0  # seconds past a command's timeout for the agent to end it and say so: then it has timed out
PREFER = 0.3  # seconds vmlaunch's agent gets to answer after QEMU's guest agent did
CHUNK = 1 << 16
QGA_LONGEST = 64 << 20  # bytes of one reply of QEMU's guest agent (it caps each output at 16 MiB)
GREETING = 4096  # bytes kept of what comes before an answer to the greeting (older replies)
REGREET = 1.0  # seconds without an answer to the greeting before another is sent
REOPEN = 5.0  # seconds without an answer before the channel is opened again
WATCH = 1.0  # seconds of silence on the channel after which vmlaunch looks whether the VM still runs

Command = str | bytes | Sequence[str | bytes]


@attrs.frozen
class Result:
    """What a command run in a guest did: its exit status (128+N when killed by signal N) and its
    output, bytes as the guest wrote them; `truncated` when a stream passed the bound (the rest was
    read and dropped in the guest)."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool = False
    timed_out: bool = False
    via: str = "agent"  # agent (vmlaunch's) | qga (QEMU's guest agent) | ssh

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def command_line(cmd: Command) -> bytes:
    """The shell text the guest runs: a string as it is (the guest's shell reads it), a sequence as
    argv (each word quoted)."""
    if isinstance(cmd, bytes):
        return cmd
    if isinstance(cmd, str):
        return cmd.encode("utf-8", "surrogateescape")
    words = [word.decode("utf-8", "surrogateescape") if isinstance(word, bytes) else word for word in cmd]
    if not words:
        raise AgentError("no command given")
    if any("\0" in word for word in words):
        raise AgentError("a command word holds a NUL byte, which no argv can carry")
    return ("exec " + " ".join(shlex.quote(word) for word in words)).encode("utf-8", "surrogateescape")


def describe(cmd: Command, width: int = 60) -> str:
    text = command_line(cmd).decode("utf-8", "replace")
    text = text[5:] if text.startswith("exec ") and not isinstance(cmd, str | bytes) else text
    return text if len(text) <= width else text[:width - 3] + "..."


def run(run_dir: RunDir, vm: str, cmd: Command, *, timeout: float | None = DEFAULT_TIMEOUT,
        input: bytes | None = None, wait: float = DEFAULT_WAIT, limit: int = DEFAULT_LIMIT,
        via: str | None = None, stdout: IO[bytes] | None = None) -> Result:
    """Run `cmd` in VM `vm` (a string through the guest's shell, a sequence as argv) with `input` on
    its stdin; return its Result. `via`: "agent" or "qga" to use only that agent. With `stdout` (a
    binary file), the command's standard output is written there instead of kept in the Result.

    Raises AgentError when the VM has no channel, no agent answers within `wait` seconds, or the
    channel closes or stops answering; CommandTimedOut (carrying the Result so far as `.result`) when
    the command outlives `timeout` (None: no limit) — the agent killed it and its process group."""
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise UsageError(f"timeout {timeout!r}: give a number of seconds above 0 (or None: no limit)")
    text = command_line(cmd)
    files = run_dir.vm(vm)
    sent = False

    paused = PauseWatch(run_dir, vm)

    def watch() -> None:
        """A guest frozen by a failed disk request answers nothing until the VM is resumed: rather
        than waiting for it (a test waiting here could never resume it), say so."""
        why = paused.why()
        if why is not None:
            ran = (f"{describe(cmd)!r} was sent, and its result is lost: vmlaunch's agent ends a command "
                   "whose caller went away once the VM runs again (what it started in the background "
                   "and has returned from runs on)" if sent else f"{describe(cmd)!r} was not sent")
            raise GuestPaused(f"{vm} is paused by an I/O error ({why}): {ran}",
                              f"`vmlaunch resume SPEC {vm}` retries the failed request")

    with _queued(files, vm, wait):
        deadline = time.monotonic() + wait
        channel = _connect(files, vm, deadline, via, wait, watch)
        try:
            sent = True
            result = channel.exec(text, input or b"", timeout, limit, stdout)
        except _Overdue:
            # a deadline no reply moves: a guest that says "still running" forever, or nothing, is done
            # with at its timeout like one that ends its command then
            assert timeout is not None
            error = CommandTimedOut(f"{vm}: {describe(cmd)!r} did not end within {timeout:g} s, and "
                                    f"{channel.what} did not say it ended it within {SETTLE:g} s more: "
                                    "it may still run in the guest", "give it more time with a larger "
                                    "timeout; `vmlaunch logs` shows the guest's console")
            error.result = Result(-1, b"", b"", timed_out=True, via=channel.via)  # type: ignore[attr-defined]
            raise error from None
        finally:
            channel.close()
    if result.timed_out:
        error = CommandTimedOut(f"{vm}: {describe(cmd)!r} did not end within {timeout:g} s; it was killed "
                                "in the guest", "give it more time with a larger timeout")
        error.result = result  # type: ignore[attr-defined]
        raise error
    return result


class _Overdue(Exception):
    """A command's timeout and SETTLE seconds passed without the agent saying that it ended."""


class _Late(AgentError):
    """A deadline passed before the guest sent what was waited for."""


def _sooner(hard: float | None) -> float:
    """The deadline of one step of the protocol: GRACE seconds from now, or `hard` when it comes first."""
    soon = time.monotonic() + GRACE
    return soon if hard is None else min(soon, hard)


def _passed(hard: float | None) -> bool:
    return hard is not None and time.monotonic() >= hard


class PauseWatch:
    """Whether VM `vm` is paused by a failed disk request, looked at after each silence of the channel:
    the lab's event log says so (read again only when it changed), and QEMU's run state confirms it (a
    log alone may have missed the resume)."""

    def __init__(self, run_dir: RunDir, vm: str) -> None:
        self.run_dir = run_dir
        self.vm = vm
        self.seen: tuple[int, int] | None = None  # the log's (size, mtime) when it said nothing

    def why(self) -> str | None:
        """What paused the VM (the failed request), when a failed disk request did and it still is."""
        from vmlaunch.lab import events
        from vmlaunch.lab.process import IO_ERROR_SAID, guest_stuck

        try:
            stat = os.stat(self.run_dir.events)
        except OSError:
            return None
        if (stat.st_size, stat.st_mtime_ns) == self.seen:
            return None
        failed = events.latest_io_error(events.read(self.run_dir, [self.vm]), self.vm)
        if failed is None:
            self.seen = (stat.st_size, stat.st_mtime_ns)
            return None
        if guest_stuck(self.run_dir.vm(self.vm)) != IO_ERROR_SAID:
            return None  # resumed since, or QEMU busy: looked at again after the next silence
        return failed.describe()


@contextlib.contextmanager
def _queued(files: VmFiles, vm: str, wait: float) -> Iterator[None]:
    """One client per channel: wait (up to `wait` seconds) for the one before to finish."""
    if not files.dir.is_dir():
        raise RuntimeFailure(f"VM {vm} is not running (its lab is not up)", "`vmlaunch up` it first")
    fd = open_in_run_dir(files.agent_lock, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise AgentError(f"{vm}: another command holds the channel for more than {wait:g} s",
                                     "a channel serves one command at a time") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)


def _open(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except FileNotFoundError:
        conn.close()
        return None
    except OSError as exc:
        conn.close()
        raise AgentError(f"cannot open the channel {path}: {exc.strerror or exc}",
                         "is the VM running? `vmlaunch status`") from None
    conn.setblocking(False)
    return conn


def _connect(files: VmFiles, vm: str, deadline: float, via: str | None, wait: float,
             watch: Callable[[], None] | None = None) -> Channel:
    """The first agent that answers: vmlaunch's, or QEMU's guest agent (vmlaunch's is preferred when
    both answer within PREFER seconds). `watch` is called after each WATCH seconds of silence, on the
    chosen channel too."""
    if via not in (None, "agent", "qga"):
        raise AgentError(f"via={via!r}: the channel is \"agent\" or \"qga\"")
    candidates = _open_all(files, vm, via, watch)
    if not candidates:
        if not files.pidfile.exists():
            raise RuntimeFailure(f"VM {vm} is not running", "`vmlaunch up` it first")
        raise AgentError(f"VM {vm} has no command channel", "set agent = true on the VM in the spec and "
                         "`up` it again (see the manual's Test rigs guide)")
    # QEMU's guest agent is greeted only once vmlaunch's had PREFER seconds to answer: qemu-ga with a
    # reply for a client that went away writes it again and again while no client is connected, never
    # back in its main loop (ga_channel_write_all; the guest's shutdown then waits 90 s for it), so a
    # channel that is not chosen must not be left with a greeting to answer
    held = [c for c in candidates if isinstance(c, QgaChannel)] if len(candidates) > 1 else []
    try:
        for channel in candidates:
            if channel not in held:
                channel.greet(deadline)
        opened = greeted = time.monotonic()
        reopen = REOPEN
        chosen: Channel | None = None
        chosen_at = 0.0
        while chosen is None or (isinstance(chosen, QgaChannel) and len(candidates) > 1):
            now = time.monotonic()
            limit = deadline if chosen is None else min(deadline, chosen_at + PREFER)
            if now >= limit:
                break
            if held and now - opened >= PREFER:  # vmlaunch's agent did not answer: QEMU's may
                for channel in held:
                    channel.greet(deadline)
                held = []
            early = bool(held) and opened + PREFER - now < min(limit - now, WATCH)  # to greet QEMU's
            wait = opened + PREFER - now if early else min(limit - now, WATCH)
            readable, _, _ = select.select([c.conn for c in candidates], [], [], wait)
            if not readable and watch is not None and chosen is None and not early:
                watch()
            if not readable and chosen is None and time.monotonic() - opened >= reopen:
                # the guest's end of the port may not have heard that this client opened it (a client
                # before this one went away while the VM was paused): open it again, less and less
                # often (a guest slow to answer gets its time)
                for channel in candidates:
                    channel.close()
                candidates = _open_all(files, vm, via, watch)
                if not candidates:
                    raise RuntimeFailure(f"VM {vm} is not running", "`vmlaunch up` it first")
                opened, reopen, greeted = time.monotonic(), reopen * 2, -REGREET  # greeted at once
                held = []
            if not readable and chosen is None and time.monotonic() - greeted >= REGREET:
                # a greeting the agent did not take whole (a client before this one went away in the
                # middle of a command, and what watched for that in the guest took a byte of ours):
                # another, on a line of its own; an answer to any of them will do (a stale answer of
                # QEMU's guest agent is not one of its replies: `QgaChannel.call` skips it)
                for channel in candidates:
                    if channel not in held:
                        channel.greet(deadline)
                greeted = time.monotonic()
            for channel in [c for c in candidates if c.conn in readable]:
                if channel.answered():
                    if isinstance(channel, VlaChannel):
                        chosen = channel
                        break
                    if chosen is None:
                        chosen, chosen_at = channel, time.monotonic()
            if isinstance(chosen, VlaChannel):
                break
    except BaseException:
        for channel in candidates:
            channel.close()
        raise
    for channel in candidates:
        if channel is not chosen:
            channel.close()
    if chosen is None:
        which = " or ".join(c.what for c in candidates)
        raise AgentError(f"{vm}: no agent answered on its command channel ({which}) within {wait:g} s",
                         "is the guest up? vmlaunch's agent starts with the test guest and from the "
                         "cloud-init seed; another guest needs qemu-guest-agent running")
    return chosen


def _open_all(files: VmFiles, vm: str, via: str | None, watch: Callable[[], None] | None) -> list[Channel]:
    """A connection to each agent's channel the VM has (of `via`, when given)."""
    candidates: list[Channel] = []
    if via in (None, "agent") and (conn := _open(files.agent)) is not None:
        candidates.append(VlaChannel(conn, vm, watch))
    if via in (None, "qga") and (conn := _open(files.qga)) is not None:
        candidates.append(QgaChannel(conn, vm, watch))
    return candidates


class Channel:
    """One connection to an agent."""

    what = "an agent"
    via = "agent"

    def __init__(self, conn: socket.socket, vm: str, watch: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.vm = vm
        self.watch = watch  # called after each WATCH seconds without a byte (it may raise)
        self.greetings: list[object] = []  # each greeting's token: an answer to any of them will do
        self.buffer = b""
        self.closed = False

    def close(self) -> None:
        self.conn.close()

    def greet(self, deadline: float) -> None:
        """Send a greeting (within 5 s, and by `deadline`); an answer to it or an earlier one will do."""
        raise NotImplementedError

    def _greeting_deadline(self, deadline: float) -> float:
        return min(time.monotonic() + 5.0, deadline)

    def answered(self) -> bool:
        """Read what there is; whether the greeting was answered."""
        raise NotImplementedError

    def exec(self, text: bytes, data: bytes, timeout: float | None, limit: int,
             stdout: IO[bytes] | None) -> Result:
        raise NotImplementedError

    def _take(self) -> None:
        """What there is to read now, into the buffer; AgentError when the channel closed."""
        with contextlib.suppress(BlockingIOError):
            data = self.conn.recv(CHUNK)
            if not data:
                raise AgentError(f"{self.vm}: the command channel ({self.what}) closed before it answered")
            self.buffer += data

    # ---- blocking reads and writes against a deadline

    def _receive(self, deadline: float | None, doing: str) -> bytes:
        """Some bytes; AgentError when the channel closes or `deadline` passes first."""
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.conn], [], [], WATCH if wait is None else min(wait, WATCH))
            if readable or (wait is not None and wait <= WATCH):
                break
            if self.watch is not None:
                self.watch()
        if not readable:
            raise _Late(f"{self.vm}: the command channel stopped answering ({doing})",
                        "the guest may hang; `vmlaunch logs` shows its console")
        try:
            data = self.conn.recv(CHUNK)
        except BlockingIOError:
            return b""
        except OSError as exc:
            raise AgentError(f"{self.vm}: the command channel failed ({doing}): {exc.strerror or exc}") \
                from None
        if not data:
            raise AgentError(f"{self.vm}: the command channel closed ({doing})",
                             "the VM stopped, or QEMU closed the channel")
        return data

    def _send(self, data: bytes, deadline: float | None, doing: str) -> None:
        view = memoryview(data)
        while view:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, writable, _ = select.select([], [self.conn], [], wait)
            if not writable:
                raise _Late(f"{self.vm}: the command channel takes nothing more ({doing})",
                            "the agent in the guest stopped reading")
            try:
                view = view[self.conn.send(view[:CHUNK]):]
            except BlockingIOError:
                continue
            except OSError as exc:
                raise AgentError(f"{self.vm}: the command channel failed ({doing}): "
                                 f"{exc.strerror or exc}") from None

    def _line(self, deadline: float | None, doing: str, longest: int = 4096) -> bytes:
        """A line of at most `longest` bytes (a longer one is garbage, refused once that many came)."""
        if b"\n" not in self.buffer:
            pending = bytearray(self.buffer)  # grown in place: a long reply is not copied once a chunk
            while b"\n" not in (piece := self._receive(deadline, doing)):
                pending += piece
                if len(pending) > longest:
                    raise AgentError(f"{self.vm}: the agent answered garbage ({doing}): a line longer than "
                                     f"{longest} bytes")
            pending += piece
            self.buffer = bytes(pending)
        line, _, self.buffer = self.buffer.partition(b"\n")
        if len(line) > longest:
            raise AgentError(f"{self.vm}: the agent answered garbage ({doing}): a line longer than "
                             f"{longest} bytes")
        return line

    def _copy(self, size: int, sink: IO[bytes] | None, deadline: float | None, doing: str) -> bytes:
        """`size` bytes of the channel: into `sink`, or returned."""
        kept = bytearray()
        while size > 0:
            if not self.buffer:
                self.buffer = self._receive(deadline, doing)
            piece, self.buffer = self.buffer[:size], self.buffer[size:]
            size -= len(piece)
            if sink is not None:
                sink.write(piece)
            else:
                kept += piece
        return bytes(kept)


class VlaChannel(Channel):
    """vmlaunch's agent, protocol VLA1."""

    what = "vmlaunch's agent"

    def greet(self, deadline: float) -> None:
        nonce = secrets.token_hex(8)
        self.greetings.append(nonce.encode())
        self._send(f"VLA1 hello {nonce}\n".encode(), self._greeting_deadline(deadline), "greeting")

    def answered(self) -> bool:
        self._take()
        while b"\n" in self.buffer:
            line, _, self.buffer = self.buffer.partition(b"\n")
            words = line.split()
            if len(words) >= 3 and words[0] == b"VLA1" and words[1] in self.greetings \
                    and words[2] == b"ready":
                self.flavour = (words[4] if len(words) > 4 else b"?").decode("ascii", "replace")
                return True
        self.buffer = self.buffer[-GREETING:]  # a stale stream without lines: only its end may matter
        return False

    def exec(self, text: bytes, data: bytes, timeout: float | None, limit: int,
             stdout: IO[bytes] | None) -> Result:
        request = secrets.token_hex(4)
        seconds = 0 if timeout is None else max(1, int(timeout + 0.999))
        header = f"VLA1 exec {request} {len(text)} {len(data)} {seconds} {limit}\n".encode()
        start = time.monotonic()
        send_deadline = start + GRACE + len(data) / (1 << 20)  # the guest reads >= 1 MiB/s
        self._send(header + text + data + f"VLA1 end {request}\n".encode(), send_deadline, "sending")
        # the answer comes by the timeout and SETTLE, counted from before the command was sent, whatever
        # else the guest sends meanwhile
        hard = None if timeout is None else start + seconds + SETTLE
        try:
            while True:
                line = self._line(hard, "waiting for the command to end")
                words = line.decode("utf-8", "replace").split(" ")
                if len(words) >= 3 and words[0] == "VLA1" and words[1] == request:
                    break
        except _Late:
            if hard is None:
                raise
            raise _Overdue from None
        if words[2] == "error":
            raise AgentError(f"{self.vm}: the agent could not run the command: {' '.join(words[3:])}")
        if words[2] != "done" or len(words) != 8 or not all(w.isdigit() for w in words[3:]):
            raise AgentError(f"{self.vm}: the agent answered garbage: {' '.join(words)[:200]!r}")
        status, timed_out, out_size, err_size, truncated = (int(w) for w in words[3:])
        if out_size > limit or err_size > limit:  # the agent keeps `limit` of each: a guest lying
            raise AgentError(f"{self.vm}: the agent announced {max(out_size, err_size)} bytes of output, "
                             f"more than the {limit} asked for: refused")
        transfer = GRACE + (out_size + err_size) / (1 << 20)
        out = self._copy(out_size, stdout, time.monotonic() + transfer, "reading the output")
        err = self._copy(err_size, None, time.monotonic() + transfer, "reading the output")
        return Result(status, out, err, bool(truncated), bool(timed_out), "agent")


class QgaChannel(Channel):
    """QEMU's guest agent (qemu-ga): JSON commands, output base64 in the replies."""

    what = "QEMU's guest agent"
    via = "qga"
    POLL = 0.05

    def greet(self, deadline: float) -> None:
        sync_id = secrets.randbelow(1 << 30)
        self.greetings.append(sync_id)
        self._send(b"\xff" + json.dumps({"execute": "guest-sync-delimited",
                                         "arguments": {"id": sync_id}}).encode() + b"\n",
                   self._greeting_deadline(deadline), "greeting")

    def answered(self) -> bool:
        self._take()
        while b"\n" in self.buffer:
            line, _, self.buffer = self.buffer.partition(b"\n")
            line = line.rpartition(b"\xff")[2].strip()
            with contextlib.suppress(ValueError, AttributeError, RecursionError):
                if json.loads(line).get("return") in self.greetings:
                    return True
        # what is not yet a line: a stale reply (up to QGA_LONGEST) may come before the answer, which
        # is short and follows a 0xff byte; its end is all that may matter
        self.buffer = self.buffer[-GREETING:]
        return False

    def call(self, command: str, arguments: dict[str, Any], deadline: float | None) -> Any:
        self._send(json.dumps({"execute": command, "arguments": arguments}).encode() + b"\n", deadline,
                   f"sending {command}")
        while True:
            line = self._line(deadline, f"waiting for {command}", longest=QGA_LONGEST).strip()
            try:
                reply = json.loads(line)
            except (ValueError, RecursionError):  # not a reply (a nesting too deep is not one either)
                continue
            if not isinstance(reply, dict):
                continue
            if "error" in reply:
                desc = reply["error"].get("desc") if isinstance(reply["error"], dict) else reply["error"]
                raise AgentError(f"{self.vm}: QEMU's guest agent refused {command}: "
                                 f"{printable(str(desc))[:200]}")
            if "return" in reply:
                return reply["return"]

    def garbage(self, what: str, reply: object) -> AgentError:
        return AgentError(f"{self.vm}: QEMU's guest agent answered garbage to {what}: "
                          f"{printable(repr(reply))[:200]}")

    def exec(self, text: bytes, data: bytes, timeout: float | None, limit: int,
             stdout: IO[bytes] | None) -> Result:
        script = ('command -v setsid >/dev/null 2>&1 && exec setsid /bin/sh -c "$0"; exec /bin/sh -c "$0"')
        args: dict[str, Any] = {"path": "/bin/sh", "capture-output": True,
                                "arg": ["-c", script, text.decode("utf-8", "surrogateescape")]}
        if data:
            args["input-data"] = base64.b64encode(data).decode()
        deadline = None if timeout is None else time.monotonic() + timeout
        # every call, and the polling, end by the timeout and SETTLE, whatever the guest answers
        # ("still running" forever, or nothing)
        hard = None if deadline is None else deadline + SETTLE
        try:
            started = self.call("guest-exec", args, _sooner(hard))
            pid = started.get("pid") if isinstance(started, dict) else None
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise self.garbage("guest-exec", started)
            timed_out = False
            while True:
                status = self.call("guest-exec-status", {"pid": pid}, _sooner(hard))
                if not isinstance(status, dict):
                    raise self.garbage("guest-exec-status", status)
                if status.get("exited") is True:
                    break
                if deadline is not None and time.monotonic() >= deadline and not timed_out:
                    timed_out = True
                    self.call("guest-exec", {"path": "/bin/sh", "arg": [
                        "-c", 'kill -KILL -- "-$0" 2>/dev/null || kill -KILL "$0"', str(pid)]}, _sooner(hard))
                if _passed(hard):
                    raise _Overdue
                time.sleep(self.POLL)
        except _Late:
            if _passed(hard):
                raise _Overdue from None
            raise
        code = self._exit_code(status)
        out, out_cut = self._output(status, "out", limit)
        err, err_cut = self._output(status, "err", limit)
        if stdout is not None:
            stdout.write(out)
            out = b""
        return Result(code, out, err, out_cut or err_cut, timed_out, "qga")

    def _exit_code(self, status: dict[str, Any]) -> int:
        """The exit status of a command that ended, 128+N when signal N ended it."""
        code, signal = status.get("exitcode"), status.get("signal")
        if isinstance(code, int) and not isinstance(code, bool):
            return code
        if isinstance(signal, int) and not isinstance(signal, bool) and 0 <= signal < 128:
            return 128 + signal
        if "exitcode" not in status and "signal" not in status:
            return 128  # qemu-ga says neither when it could not tell
        raise self.garbage("guest-exec-status", {"exitcode": code, "signal": signal})

    def _output(self, status: dict[str, Any], stream: str, limit: int) -> tuple[bytes, bool]:
        """`limit` bytes at most of one output stream of the status (base64: only what becomes those
        is decoded), and whether there was more."""
        encoded = status.get(f"{stream}-data", "")
        if not isinstance(encoded, str) or not encoded.isascii():
            raise self.garbage("guest-exec-status", {f"{stream}-data": encoded})
        keep = (limit + 3) // 3 * 4  # base64 characters of a little more than `limit` bytes
        try:
            decoded = base64.b64decode(encoded[:keep], validate=True)
        except ValueError:  # binascii.Error
            raise self.garbage("guest-exec-status", {f"{stream}-data": encoded[:40]}) from None
        truncated = bool(status.get(f"{stream}-truncated")) or len(encoded) > keep or len(decoded) > limit
        return decoded[:limit], truncated
