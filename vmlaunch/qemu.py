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
    procs = {}
    for vm in vms:
        with open(vm.run_dir / f"{vm.name}.stderr.log", "wb") as stderr:
            # umask 077: the QMP and console sockets QEMU creates are for their owner only.
            procs[vm.name] = subprocess.Popen([*vm.argv, "-daemonize", "-S"], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=stderr, umask=0o077)
    failures = []
    pids = {}
    for vm in vms:
        code = procs[vm.name].wait()
        if code == 0 and (pid := read_pid(vm)) is not None:
            pids[vm.name] = pid
        else:
            text = (vm.run_dir / f"{vm.name}.stderr.log").read_text(errors="replace").strip()
            failures.append(f"{vm.name}: QEMU exited with status {code}: {text or '(no message)'}\n"
                            f"  command: {shlex.join(vm.argv)} -daemonize -S")
    if failures:
        for pid in pids.values():
            kill(pid)
        raise QemuFailed("\n".join(failures))
    return pids


def read_pid(vm: VmPlan) -> int | None:
    try:
        return int(vm.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def is_our_qemu(pid: int, name: str) -> bool:
    """True when `pid` is alive and is the QEMU of VM `name` (a stale pidfile may name another)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"guest={name},".encode() in b" ".join(cmdline) + b","


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
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
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
    """A synchronous QMP connection to one VM (qemu.qmp's legacy client)."""

    def __init__(self, socket: Path, timeout: float = 5.0) -> None:
        from qemu.qmp.legacy import QEMUMonitorProtocol

        self.socket = socket
        self.client = QEMUMonitorProtocol(str(socket))
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.connect()
                return
            except Exception as exc:  # qemu.qmp raises its own ConnectError and OSErrors
                self.client.close()
                self.client = QEMUMonitorProtocol(str(socket))
                if time.monotonic() >= deadline:
                    raise QmpError(f"no QMP answer on {socket}: {exc}") from None
                time.sleep(0.05)

    def cmd(self, command: str, **args: Any) -> Any:
        from qemu.qmp import ExecuteError

        try:
            return self.client.cmd(command, **args)
        except ExecuteError as exc:
            raise QmpError(f"QMP {command} failed: {exc.error.error.desc}") from None
        except (EOFError, OSError) as exc:
            raise QmpError(f"QMP {command}: the connection closed ({exc or 'EOF'})") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

    def __enter__(self) -> Qmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stop(pid: int, name: str, qmp_socket: Path, timeout: float) -> str:
    """Graceful first (ACPI power button), then QMP quit, then SIGKILL; says which one worked."""
    if not is_our_qemu(pid, name):
        return "not running"
    with contextlib.suppress(QmpError), Qmp(qmp_socket, timeout=1) as qmp:
        qmp.cmd("system_powerdown")
        if wait_gone(pid, timeout):
            return "powered off"
        with contextlib.suppress(QmpError):
            qmp.cmd("quit")
        if wait_gone(pid, 5):
            return "quit"
    kill(pid)
    return "killed"
