#!/usr/bin/env python3
"""vmlaunch's agent for guests with python3 (every cloud-init guest has one): it serves vmlaunch's
command channel, protocol VLA1 (vmlaunch/rig/agent.py is the host side), on the virtio-serial port
org.vmlaunch.agent.0. Whoever can open the channel's socket on the host is root in this guest: that
socket is 0600, like QMP.

    host:  VLA1 hello NONCE\\n                       guest: VLA1 NONCE ready 1 py\\n
    host:  VLA1 exec ID CMDLEN INLEN TIMEOUT LIMIT\\n CMD INPUT VLA1 end ID\\n
    guest: VLA1 ID done STATUS TIMEDOUT OUTLEN ERRLEN TRUNCATED\\n OUT ERR

CMD runs through `/bin/sh -c` in a session of its own (its process group is what a timeout kills, and
what is killed when the host side closes before it ends), stdin from INPUT, in /, umask 022. Each
output stream keeps its first LIMIT bytes; the rest is read and dropped (TRUNCATED=1). While the host
side is closed, reads of the port end at once and poll() says POLLHUP (and POLLIN): the agent then
sleeps until the kernel signals (SIGIO) that the host connected.

Standard library only, Python 3.6 and later (the guests' own interpreters). vmlaunch installs it from
the cloud-init seed and runs it as root; it is never imported by vmlaunch itself.
"""

import contextlib
import errno
import fcntl
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Optional, Tuple

PORT_NAME = "org.vmlaunch.agent.0"
WORK = "/var/lib/vmlaunch-agent"
CHUNK = 1 << 16


class HostGone(Exception):
    """The host side closed while a request was under way."""


def find_port() -> Optional[str]:
    link = "/dev/virtio-ports/" + PORT_NAME
    if os.path.exists(link):
        return link
    try:
        ports = os.listdir("/sys/class/virtio-ports")
    except OSError:
        return None
    for port in ports:
        try:
            with open("/sys/class/virtio-ports/%s/name" % port) as handle:
                if handle.read().strip() == PORT_NAME:
                    return "/dev/" + port
        except OSError:
            continue
    return None


class Channel:
    """The port, opened non-blocking, read through a buffer."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.fcntl(self.fd, fcntl.F_SETOWN, os.getpid())
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_ASYNC)  # SIGIO when the host comes or writes
        self.buffer = b""

    def wait_for_host(self) -> None:
        """Sleep until the host connects (a SIGIO, or once a second to be sure)."""
        while self.host_gone():
            signal.sigtimedwait([signal.SIGIO], 1.0)

    def host_gone(self) -> bool:
        """POLLHUP: no host side (the port then also says POLLIN: a read would end at once)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        events = poller.poll(0)
        return bool(events and events[0][1] & select.POLLHUP)

    def _fill(self) -> None:
        """Read what there is; HostGone when the host side is closed."""
        while True:
            try:
                data = os.read(self.fd, CHUNK)
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
                    raise HostGone() from None
                select.select([self.fd], [], [], 1.0)
                continue
            if not data:
                raise HostGone()
            self.buffer += data
            return

    def line(self) -> bytes:
        while b"\n" not in self.buffer:
            if len(self.buffer) > CHUNK:
                raise HostGone()  # not a request line: resynchronise on the next connection
            self._fill()
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def copy(self, size: int, out: IO[bytes]) -> None:
        while size > 0:
            if not self.buffer:
                self._fill()
            piece = self.buffer[:size]
            self.buffer = self.buffer[len(piece):]
            out.write(piece)
            size -= len(piece)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                done = os.write(self.fd, view)
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
                    raise HostGone() from None
                select.select([], [self.fd], [], 1.0)
                continue
            view = view[done:]

    def send_file(self, handle: IO[bytes]) -> None:
        handle.seek(0)
        while True:
            data = handle.read(CHUNK)
            if not data:
                return
            self.write(data)


def run(command: bytes, stdin: IO[bytes], outputs: Tuple[IO[bytes], IO[bytes]], timeout: int,
        limit: int, channel: Optional["Channel"] = None) -> Tuple[int, int, int]:
    """Run the command, its output into `outputs`; (status, timed out, truncated). When the host side
    of `channel` goes away meanwhile (the host's command was interrupted), the command is killed with
    its process group, as at a timeout."""
    stdin.seek(0)
    proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd="/", start_new_session=True, close_fds=True,
                            preexec_fn=lambda: os.umask(0o022))
    kept = [0, 0]
    streams = {proc.stdout.fileno(): 0, proc.stderr.fileno(): 1}  # type: ignore[union-attr]
    for fd in streams:
        os.set_blocking(fd, False)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    timed_out = truncated = 0
    killed_at = None  # type: Optional[float]
    while streams:
        wait = 1.0
        if deadline is not None and not timed_out:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        watched = list(streams) + ([channel.fd] if channel is not None and killed_at is None else [])
        ready, _, _ = select.select(watched, [], [], wait)
        if channel is not None and channel.fd in ready:
            if channel.host_gone():  # interrupted on the host: nobody waits for the result
                timed_out = 1
                killed_at = time.monotonic()
                kill_group(proc.pid)
            ready.remove(channel.fd)
            if killed_at is None:
                time.sleep(0.05)  # bytes while a command runs: left for the next request
        for fd in ready:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                continue
            if not data:
                del streams[fd]
                continue
            index = streams[fd]
            room = limit - kept[index]
            if len(data) > room:
                truncated = 1
                data = data[:max(room, 0)]
            outputs[index].write(data)
            kept[index] += len(data)
        now = time.monotonic()
        if deadline is not None and not timed_out and now >= deadline:
            timed_out = 1
            killed_at = now
            kill_group(proc.pid)
        if killed_at is not None and now - killed_at > 2.0:
            break  # what keeps the pipes open left the group: stop reading
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]
    try:
        status = proc.wait(timeout=2.0 if timed_out else None)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        status = proc.wait()
    if status < 0:
        status = 128 - status
    if timed_out:
        kill_group(proc.pid)  # whatever it left in its group
    return status, timed_out, truncated


def kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def serve(channel: Channel) -> None:
    """Answer requests until the host side closes."""
    while True:
        words = channel.line().decode("ascii", "replace").split()
        if len(words) < 3 or words[0] != "VLA1":
            continue
        if words[1] == "hello":
            channel.write(("VLA1 %s ready 1 py\n" % words[2]).encode())
        elif words[1] == "exec" and len(words) == 7 and all(word.isdigit() for word in words[3:]):
            request, sizes = words[2], [int(word) for word in words[3:]]
            execute(channel, request, *sizes)
        else:
            channel.write(("VLA1 %s error unknown request %s\n" % (words[2], words[1])).encode())


def execute(channel: Channel, request: str, command_size: int, input_size: int, timeout: int,
            limit: int) -> None:
    with tempfile.TemporaryFile(dir=WORK) as command, tempfile.TemporaryFile(dir=WORK) as stdin, \
            tempfile.TemporaryFile(dir=WORK) as out, tempfile.TemporaryFile(dir=WORK) as err:
        channel.copy(command_size, command)
        channel.copy(input_size, stdin)
        if channel.line() != ("VLA1 end %s" % request).encode():
            channel.write(("VLA1 %s error the request was cut or garbled\n" % request).encode())
            raise HostGone()
        command.seek(0)
        try:
            status, timed_out, truncated = run(command.read(), stdin, (out, err), timeout, limit, channel)
        except OSError as exc:
            channel.write(("VLA1 %s error cannot run the command: %s\n" % (request, exc)).encode())
            return
        sizes = (out.tell(), err.tell())
        header = "VLA1 %s done %d %d %d %d %d\n" % (request, status, timed_out, sizes[0], sizes[1], truncated)
        channel.write(header.encode())
        channel.send_file(out)
        channel.send_file(err)


def main() -> int:
    os.umask(0o077)
    os.makedirs(WORK, mode=0o700, exist_ok=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGIO])
    channel = None  # type: Optional[Channel]
    while channel is None:
        path = find_port()
        if path is not None:
            try:
                channel = Channel(path)
            except OSError as exc:
                print("vmlaunch-agent: cannot open %s: %s" % (path, exc), file=sys.stderr)
        if channel is None:
            time.sleep(2.0)
    while True:
        channel.wait_for_host()
        try:
            serve(channel)
        except HostGone:
            channel.buffer = b""


if __name__ == "__main__":
    sys.exit(main())
