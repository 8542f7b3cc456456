"""QEMU processes: start them daemonized, find them again, talk QMP, stop them."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vmlaunch.errors import RuntimeFailure
from vmlaunch.plan import VmPlan
from vmlaunch.qemuopts import escape
from vmlaunch.signals import held


class QemuFailed(RuntimeFailure):
    """QEMU refused to start; carries its own error text and the command."""


class QmpError(RuntimeFailure):
    """A QMP command failed or the VM did not answer."""


def start(vms: Sequence[VmPlan]) -> dict[str, int]:
    """Start every VM at once, paused (`-daemonize -S`); return name -> pid once each has initialised.

    The caller lets them run with `cont` once all are up: guests that boot while other QEMUs are still
    initialising slow those down (ten at once on two cores: 0.96 s running, 0.37 s paused).

    QEMU's daemonize parent exits 0 only when start-up succeeded, so a failure is known here, with
    QEMU's own message (kept in the run dir as VM.stderr.log). When one fails, the others that did start
    are killed before QemuFailed is raised.
    """
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for vm in vms:
            with open(vm.run_dir / f"{vm.name}.stderr.log", "wb") as stderr:
                # umask 077: the QMP and console sockets QEMU creates are for their owner only.
                procs[vm.name] = subprocess.Popen([*vm.argv, "-daemonize", "-S"],
                                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=stderr, umask=0o077)
        failures = []
        pids = {}
        for vm in vms:
            code = procs[vm.name].wait()
            if code == 0 and (pid := read_pid(vm)) is not None:
                pids[vm.name] = pid
            else:
                text = (vm.run_dir / f"{vm.name}.stderr.log").read_text(errors="replace").strip()
                failures.append(f"{vm.name}: QEMU exited with status {code}: "
                                f"{text or '(no message)'}\n"
                                f"  command: {shlex.join(vm.argv)} -daemonize -S")
    except BaseException:
        with held():
            _kill_started(vms, procs)
        raise
    if failures:
        kill_all(list(pids.values()))
        raise QemuFailed("\n".join(failures))
    return pids


def _kill_started(vms: Sequence[VmPlan], procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Interrupted while QEMUs were starting: kill the daemonizing parents and what they spawned."""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    for proc in procs.values():
        proc.wait()
    kill_all([pid for vm in vms if vm.name in procs and (pid := read_pid(vm)) is not None
              and is_our_qemu(pid, vm.qmp_socket)])


def read_pid(vm: VmPlan) -> int | None:
    try:
        return int(vm.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def is_our_qemu(pid: int | None, qmp_socket: Path) -> bool:
    """True when `pid` is alive and is the QEMU serving `qmp_socket` (unique per lab and VM): a stale
    pidfile's pid may since name another process, or another lab's VM of the same name."""
    if pid is None:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") + b" "
    except OSError:
        return False
    return f"path={escape(str(qmp_socket))},".encode() in cmdline and alive(pid)


def find_pid(run_dir: Path, name: str, recorded: int | None = None) -> int | None:
    """The pid of VM `name`'s QEMU if it runs: the recorded one, else the one in its pidfile (a
    vmlaunch killed while QEMU started never recorded it)."""
    qmp_socket = run_dir / f"{name}.qmp"
    if is_our_qemu(recorded, qmp_socket):
        return recorded
    try:
        pid = int((run_dir / f"{name}.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if is_our_qemu(pid, qmp_socket) else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child that was not reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def kill(pid: int) -> None:
    kill_all([pid])


def kill_all(pids: Sequence[int]) -> None:
    """SIGKILL every one before waiting for any: an interruption while waiting leaves none running."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        wait_gone(pid, 5)


class QuickQmp:
    """A bare synchronous QMP exchange, for `up`'s hot path only (the handshake, `cont`,
    `query-status`): qemu.qmp costs ~60 ms to import and an event loop per connection, more than
    QEMU itself takes to start. Everything else talks through `Qmp`.
    """

    def __init__(self, path: Path, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                self.conn.connect(str(path))
                break
            except OSError as exc:
                self.conn.close()
                if time.monotonic() >= deadline:
                    raise QmpError(f"no QMP answer on {path}: {exc.strerror or exc}") from None
                time.sleep(0.005)
        self.stream = self.conn.makefile("rwb")
        self._read()  # the greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        import json

        try:
            line = self.stream.readline()
        except OSError as exc:
            raise QmpError(f"QMP: {exc}") from None
        if not line:
            raise QmpError("QMP: QEMU closed the connection")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def cmd(self, command: str) -> Any:
        import json

        self.stream.write(json.dumps({"execute": command}).encode() + b"\n")
        self.stream.flush()
        while True:
            reply = self._read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise QmpError(f"QMP {command} failed: {reply['error'].get('desc')}")
            # anything else is an event: not what we wait for

    def close(self) -> None:
        self.stream.close()
        self.conn.close()

    def __enter__(self) -> QuickQmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Qmp:
    """A synchronous QMP connection to one VM: qemu.qmp's QMPClient on a private event loop, with a
    timeout on every exchange, so a stopped QEMU or a busy socket cannot hang a command forever."""

    def __init__(self, socket: Path, timeout: float = 5.0) -> None:
        import asyncio

        from qemu.qmp import QMPClient

        self.socket = socket
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda loop, context: None)  # errors reach us as exceptions
        self.client = QMPClient(f"vmlaunch-{socket.stem}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._run(self.client.connect(str(socket)), max(0.1, deadline - time.monotonic()))
                return
            except QmpError as exc:
                if time.monotonic() >= deadline:
                    self.close()
                    raise QmpError(f"no QMP answer on {socket}: {exc.message}") from None
                time.sleep(0.05)

    def _run(self, awaitable: Any, timeout: float) -> Any:
        import asyncio

        from qemu.qmp import ExecuteError, QMPError

        try:
            return self.loop.run_until_complete(asyncio.wait_for(awaitable, timeout))
        except ExecuteError as exc:
            raise QmpError(exc.error.error.desc) from None
        except asyncio.TimeoutError:
            raise QmpError(f"no answer within {timeout:g} s") from None
        except (QMPError, OSError, EOFError) as exc:
            raise QmpError(str(exc) or type(exc).__name__) from None

    def cmd(self, command: str, **args: Any) -> Any:
        try:
            return self._run(self.client.execute(command, args or None), self.timeout)
        except QmpError as exc:
            raise QmpError(f"QMP {command} failed: {exc.message}") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._run(self.client.disconnect(), 1.0)
        self.loop.close()

    def __enter__(self) -> Qmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop(pid: int | None, qmp_socket: Path, timeout: float) -> str:
    """Graceful first (ACPI power button), then QMP quit, then SIGKILL; says which one worked."""
    if pid is None or not is_our_qemu(pid, qmp_socket):
        return "not running"
    with contextlib.suppress(QmpError), Qmp(qmp_socket, timeout=2) as qmp:
        qmp.cmd("system_powerdown")
        if wait_gone(pid, timeout):
            return "powered off"
        with contextlib.suppress(QmpError):
            qmp.cmd("quit")
        if wait_gone(pid, 5):
            return "quit"
    kill(pid)
    return "killed"
