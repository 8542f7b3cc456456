"""The lab manager as a resource: `up` starts it (one process per lab, `vmlaunch/manager/manager.py`), the
journal records which process it is, and `down` stops it.

It is started for every lab, before the VMs (it finds them through the journal as they come, and goes
on when they go): it keeps the lab's event log, and sizes the `policy = "auto"` balloons and balances the
VMs over NUMA nodes where the lab asks for it. Its settings are `manager.json` in the run dir,
written by every `up` (a VM added by `up VM` is in the spec it was compiled from), read by the manager
every round. An `up` that finds the journaled manager gone starts it again (`alive`); the new one
rebuilds its view from the journal, QMP and `manager.state.json`.

A process is known by its pid and its start time (field 22 of /proc/PID/stat, in clock ticks since
boot): a pid reused by another process is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.core.textsafe import printable
from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.rundir import RunDir, open_in_run_dir
from vmlaunch.resources.base import Context, LabWide

log = logging.getLogger(__name__)

# Seconds between the manager's rounds, and the guests' balloon statistics period: a guest allocating
# 4 MiB/s from 16 MiB free has 4 s before its OOM killer runs; the manager sees it a round later and
# grows it one round after that. A round costs two QMP exchanges per VM.
INTERVAL = 1.0
READY_TIMEOUT = 15.0  # seconds the sh that starts the manager has to say its pid (a very busy host)
STOP_TIMEOUT = 5.0


@attrs.frozen
class ManagedVm:
    """One VM of the lab as the manager sees it; sizes in MiB."""

    name: str
    maximum_mib: int  # `memory`
    minimum_mib: int  # `balloon.min` (auto), else its memory: a manual VM holds what it holds
    auto: bool  # the manager sets its balloon target
    balloon: bool  # it has a balloon device (and statistics)
    nodes: tuple[int, ...] = ()  # the NUMA node(s) placement put it on at `up` (none: not placed)
    movable: bool = False  # the balancer may move it (placed on one node, through a cpuset cgroup)
    cgroup: str | None = None  # its cpuset cgroup, whose cpus and mems say where it is now


@attrs.frozen
class ManagerConfig:
    lab: str
    budget_mib: int
    vms: tuple[ManagedVm, ...]
    interval: float = INTERVAL
    balance: bool = False  # the NUMA balancer runs
    balance_interval: float = 5.0  # seconds between its decisions (`lab.placement.interval`)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> ManagerConfig:
        """Raises ValueError for anything that is not a config `up` wrote."""
        try:
            vms = tuple(ManagedVm(name=str(vm["name"]), maximum_mib=int(vm["maximum_mib"]),
                                  minimum_mib=int(vm["minimum_mib"]), auto=bool(vm["auto"]),
                                  balloon=bool(vm["balloon"]),
                                  nodes=tuple(int(node) for node in vm.get("nodes", ())),
                                  movable=bool(vm.get("movable", False)),
                                  cgroup=str(vm["cgroup"]) if vm.get("cgroup") else None)
                        for vm in doc["vms"])
            return cls(lab=str(doc["lab"]), budget_mib=int(doc["budget_mib"]), vms=vms,
                       interval=float(doc.get("interval", INTERVAL)), balance=bool(doc.get("balance", False)),
                       balance_interval=float(doc.get("balance_interval", 5.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a lab manager config: {exc}") from None


def write_config(run_dir: RunDir, config: ManagerConfig) -> None:
    write_atomic(run_dir.manager_config, json.dumps(config.to_json(), indent=1) + "\n", durable=False)


def read_config(run_dir: RunDir) -> ManagerConfig:
    fd = open_in_run_dir(run_dir.manager_config, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        return ManagerConfig.from_json(json.loads(f.read(1 << 20)))


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


@attrs.frozen
class ManagerRecord:
    kind: ClassVar[str] = "manager"

    pid: int
    started: int  # start_time(pid) when it was started
    run_dir: str

    def running(self) -> bool:
        return start_time(self.pid) == self.started

    def alive(self) -> bool:
        """For `up`: False when the manager is gone and should be started again."""
        return self.running()

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.running():
                log.warning("the lab manager (pid %d) did not stop within %g s: killed", self.pid,
                            STOP_TIMEOUT)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        from vmlaunch.layout import lastrun

        run_dir = RunDir(Path(self.run_dir))
        for problem in stop_unjournaled(run_dir):  # one an interrupted `up` started, if any
            log.warning("%s", problem)
        lastrun.keep_manager(run_dir)
        lastrun.keep_events(run_dir)  # complete now: its writer has stopped
        for path in (run_dir.manager_state, run_dir.manager_config):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # a read-only or broken run dir: its removal, next, says so
                log.debug("%s stays: %s", path, exc.strerror or exc)

    def describe(self) -> str:
        return f"lab manager (pid {self.pid})"


@attrs.frozen
class LabManager(LabWide):
    """The lab's manager process."""

    kind: ClassVar[str] = "manager"

    run_dir: RunDir
    config: ManagerConfig

    @property
    def key(self) -> str:
        return "lab"

    def describe(self) -> str:
        auto = [vm.name for vm in self.config.vms if vm.auto]
        jobs = [f"the lab's event log ({self.run_dir.events.name})"]
        if auto:
            jobs.append(f"balloons of {', '.join(auto)} sized within a budget of "
                        f"{self.config.budget_mib} MiB, every {self.config.interval:g} s")
        if self.config.balance:
            movable = [vm.name for vm in self.config.vms if vm.movable]
            jobs.append(f"NUMA balancer every {self.config.balance_interval:g} s (may move: "
                        f"{', '.join(movable) or 'none'})")
        return f"lab manager: {'; '.join(jobs)} (log: {self.run_dir.manager_log})"

    def found(self) -> str | None:
        return None

    def refresh(self, ctx: Context) -> None:
        """For an `up` that finds the manager running: its settings as this spec has them."""
        write_config(self.run_dir, self.config)

    def apply(self, ctx: Context) -> ManagerRecord:
        write_config(self.run_dir, self.config)
        logfile = open_in_run_dir(self.run_dir.manager_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        ready_r, ready_w = os.pipe()
        try:
            # Started in the background by sh, which says its pid and exits: the manager is nobody's
            # child (no caller of `up`, the API or a test, is left with a zombie), and `up` goes on in
            # a millisecond, not after a Python start-up (the manager's own start runs beside QEMU's).
            # Its output goes to its log; the pipe is sh's alone. The argv is sh's "$@", never spliced
            # into the script. The run dir absolute: `doctor` and `down` know the manager's lab by
            # its command line.
            child = subprocess.Popen(
                ["/bin/sh", "-c", '"$@" >&2 & echo $!', "sh", sys.executable, "-m",
                 "vmlaunch.manager.managerd", os.path.abspath(self.run_dir.path), "--detached"],
                stdin=subprocess.DEVNULL, stdout=ready_w, stderr=logfile, start_new_session=True,
                umask=0o077)
        finally:
            os.close(logfile)
            os.close(ready_w)
        pid = None
        try:
            pid = _read_ready(ready_r, READY_TIMEOUT)
            child.wait(READY_TIMEOUT)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        except BaseException:  # Ctrl-C before the record is journaled: nothing would stop it
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            else:  # it may be started already, and not said so yet: found by its command line
                child.kill()
                child.wait()
                stop_unjournaled(self.run_dir)
            raise
        finally:
            os.close(ready_r)
        started = start_time(pid) if pid is not None else None
        if pid is None or started is None:
            tail = printable(_tail(self.run_dir.manager_log)).strip()
            raise RuntimeFailure("the lab manager did not start" + (f": {tail}" if tail else ""),
                                 f"its log is {self.run_dir.manager_log}")
        return ManagerRecord(pid=pid, started=started, run_dir=str(self.run_dir.path))


def stop_unjournaled(run_dir: RunDir, but: int | None = None) -> list[str]:
    """Stop every lab manager of `run_dir` but the journaled one (`but`), found by its command line
    until a scan finds none: a manager whose first process forks as it is signalled shows in the next
    scan. For a caller that holds the lab's lock, so no `up` is starting one. What failed, one line
    each."""
    from vmlaunch.host.processes import Kind, of_run_dir

    signalled: set[int] = set()
    for _ in range(10):
        found = [p.pid for p in of_run_dir(run_dir.path, Kind.MANAGER) if p.pid != but]
        if not found:
            return []
        for pid in found:
            if pid not in signalled:
                log.info("stopping a lab manager of %s that no journal names (pid %d)", run_dir.lab, pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if pid not in signalled else signal.SIGKILL)
            signalled.add(pid)
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline and any(start_time(pid) is not None for pid in found):
            time.sleep(0.05)
    left = [p.pid for p in of_run_dir(run_dir.path, Kind.MANAGER) if p.pid != but]
    return [f"a lab manager of {run_dir.lab} that no journal names would not stop: kill -9 {pid}"
            for pid in left]


def release_unjournaled_manager(ctx: Context, journaled: Callable[[str, str], bool]) -> list[str]:
    """For `down`: a lab manager no journal names (an `up` interrupted between starting it and
    journaling it) is stopped; the journaled one is stopped by its record."""
    if journaled(ManagerRecord.kind, "lab"):
        return []
    from vmlaunch.layout.dirs import run_root

    return stop_unjournaled(RunDir.of(run_root(), ctx.lab))


def _read_ready(fd: int, timeout: float) -> int | None:
    """The manager's pid, as its starter writes it on the pipe; None when it exits first."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            return None
        chunk = os.read(fd, 64)
        if not chunk:
            return None
        data += chunk
    line = data.split(b"\n")[0]
    return int(line) if line.isdigit() else None


def _tail(path: Path, size: int = 2000) -> str:
    try:
        fd = open_in_run_dir(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, RuntimeFailure):
        return ""
    with os.fdopen(fd, "rb") as f:
        with contextlib.suppress(OSError):
            f.seek(-size, os.SEEK_END)
        return f.read().decode(errors="replace")
