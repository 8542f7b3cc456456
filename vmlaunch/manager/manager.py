"""The lab manager: one process per lab that keeps the lab's event log, and sizes the balloons of its
`policy = "auto"` VMs and balances them over NUMA nodes when the lab asks for it.

`up` starts it for every lab (`resources/manager.py`) as `python -m vmlaunch.manager RUN_DIR`, and `down`
stops it (SIGTERM). Every round (`interval`, 1 s, while it has work: see "Idle" below) it:

1. reads its settings (`manager.json`, rewritten by each `up`) and the journal: the VMs that run now.
   A VM that appears is connected to on its own QMP monitor (`V.manager.qmp`; the VM's first monitor
   stays free for `status`, `balloon`, `qmp`, the API and a user's tools), its events are listened to
   and, with a balloon, its guest statistics are turned on (each round with an auto balloon, every
   HELD_STATS seconds without: `status` shows them); a VM that went away (down, crashed) is dropped;
2. where the lab has an auto balloon, samples each VM (its balloon's size; its guest-stats:
   available and free memory, major faults and swap-ins since the last sample), the host (MemTotal,
   MemAvailable) and the KSM counters;
3. asks the pure policy (`balloon_policy.decide`) for new targets, sets them, and logs each change with
   its reason; with NUMA placement, the balancer (`manager/balancer.py`) samples the VMs' runnable vCPUs and,
   every `lab.placement.interval`, moves at most one VM between nodes;
4. writes what it saw and set to `manager.state.json`, for `status` and for itself after a restart,
   and the repeats of an event whose window closed to the event log.

Events are not left for the rounds: one task per VM waits on its monitor and logs each event worth
logging the moment it comes (`lab/events.py`), so that a `status` run just after a VM paused on an
I/O error finds why in the log, and the events a QEMU sends just before it exits are logged before
the connection goes. Events a VM sent before the manager connected to it are not in the log.

Idle: a lab with nothing to size or balance costs its guests next to nothing. The statistics (a
timer in QEMU and a wake-up of the guest's balloon driver each period) come each round only from the
VMs whose balloon the policy sizes, and VMs are asked over QMP only where the policy runs. A round that leaves
nothing to do (no auto balloon, no balancer, no `up` or `down` under way, no VM still starting or not
yet connected, no repeat of an event waiting to be logged: `quiet`) lets the next full round wait up
to IDLE_EVERY; each `interval` meanwhile it only looks whether the journal or the settings changed
(an `up` or `down` of the lab writes both), and runs a round at once when they did. Events still come
as they happen: they are listened to, not asked for.

Where the policy runs, it costs what it needs: a balloon's actual size is asked once and then kept
from its BALLOON_CHANGE events, and a steady auto balloon (`pace`: SETTLE rounds in which the policy
set it no target, it did not move and the host's available memory held) reports its statistics every
STEADY_STATS seconds, read only once the guest can have sent newer ones. Any change brings it back to
each round. A steady guest that suddenly needs memory is seen up to STEADY_STATS late; until then its
balloon deflates on OOM by itself (auto balloons have deflate_on_oom).

It keeps nothing that cannot be rebuilt: started again, it reads the journal, QMP and its state file.
Every event loop and QMP connection is asyncio (`qmp.AsyncQmp`), one loop for the whole lab. Errors of
one VM (its QEMU gone half-way through a round) never end the manager: that VM is dropped and found
again next round if it still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.host.memory import ksm_counters, meminfo
from vmlaunch.lab.events import Writer
from vmlaunch.lab.process import OUT_OF_MEMORY, console_line_since, console_size
from vmlaunch.layout.rundir import RunDir
from vmlaunch.manager.balancer import Balancer
from vmlaunch.policy.balloon import Guest, Host, decide
from vmlaunch.qemu.qmp import AsyncQmp, QmpError
from vmlaunch.resources.manager import INTERVAL, ManagedVm, ManagerConfig, read_config

log = logging.getLogger("vmlaunch.manager.manager")

BALLOON = "/machine/peripheral/balloon0"
MIB = 1 << 20
UNKNOWN = 1 << 63  # QEMU reports a statistic the guest did not send as (uint64) -1
ORPHAN_AFTER = 60.0  # seconds a manager not in its lab's journal runs before it takes itself for orphaned
IDLE_EVERY = 10.0  # seconds at most between the full rounds of a quiet lab (see "Idle" above)
HELD_STATS = 10  # seconds between the statistics of a balloon the policy does not size (`status`'s FREE)
SETTLE = 5  # rounds an auto balloon is left where it is, at its target, before it counts as steady
STEADY_STATS = 5  # seconds between the statistics of a steady auto balloon (see "Idle" above)


@attrs.define
class Watched:
    """One VM the manager is connected to."""

    name: str
    pid: int
    qmp: AsyncQmp
    target: int | None = None  # bytes: the target this manager (or the one before it) set
    faults: tuple[float, int, int] | None = None  # (last-update, major faults, swap-in bytes) last seen
    seen: dict[str, Any] = attrs.Factory(dict)  # the last sample, for the state file
    set_from: int | None = None  # bytes: the balloon's actual size when the target was set last
    last_actual: int | None = None  # bytes: its actual size at the last sample
    floor: int | None = None  # bytes: where it stopped giving, short of a lower target (observed)
    console_seen: int = 0  # bytes of its console log already looked at for signs of its floor
    listener: asyncio.Task[None] | None = None  # logs its events as they come
    actual: int | None = None  # bytes: the balloon's actual size, from BALLOON_CHANGE (None: ask QEMU)
    period: int = 0  # seconds: the statistics period its balloon has now (0: not set by this manager)
    still: int = 0  # rounds the policy left it where it is, at its target (SETTLE of them: steady)
    stats: Any = None  # the balloon's guest-stats as last read
    stats_due: float = float("-inf")  # when the guest will have sent newer ones (monotonic)
    paced_actual: int | None = None  # bytes: its actual size when `pace` last looked

    async def close(self) -> None:
        if self.listener is not None:
            self.listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.listener
        await self.qmp.close()


def stats_due(stats: Any, period: int, interval: float) -> float:
    """When (monotonic) a balloon whose statistics come every `period` seconds will have sent newer
    ones than `stats`, just read: at once (next round) when they come as often as the rounds; else
    `period` after their `last-update` (whole seconds of the host's clock, hence the second added), and
    never later than `period` from now (a guest that stopped sending them is not asked each round)."""
    now = time.monotonic()
    if period <= interval:
        return now
    updated = stats.get("last-update") if isinstance(stats, dict) else None
    if not isinstance(updated, int) or updated <= 0:
        return now + period
    return now + max(interval / 2, min(period, updated + period + 1 - time.time()))


def stat(stats: dict[str, Any], key: str) -> int | None:
    value = stats.get(key)
    return value if isinstance(value, int) and 0 <= value < UNKNOWN else None


class Manager:
    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.watched: dict[str, Watched] = {}
        self.stopping = asyncio.Event()
        self.config: ManagerConfig | None = None
        self.saved_targets = self._saved_targets()
        self.started = time.monotonic()
        self.journaled = False  # seen in the lab's journal: from then on it must stay there
        self.identity = _identity(run_dir.path)  # its run dir: one made anew at the path is another lab's
        self.idle_since: float | None = None  # since when the lab has had no VM and no up or down running
        self.lab_busy = True  # an `up` or `down` of the lab held its lock at the start of this round
        self.balancer = Balancer()
        self.events = Writer(run_dir)
        self.quiet = False  # the last round left nothing to do until the lab changes (see "Idle")
        self.starting = False  # a VM of the journal has no QEMU pid yet
        self.last_round = float("-inf")  # when the last full round started (monotonic)
        self.seen: tuple[object, ...] | None = None  # the journal's and the settings' `_signature` then
        self.config_read: object = None  # the settings file (`_signature`) when it was read last
        self.running: tuple[object, dict[str, int]] | None = None  # the journal as read last, its QEMUs
        self.saved: dict[str, Any] | None = None  # the part of the state file that `save` compares
        self.saved_at = float("-inf")  # when it wrote it last (monotonic)
        self.host_available: int | None = None  # bytes: the host's MemAvailable at the last round that sized

    def _saved_targets(self) -> dict[str, tuple[int, int, int | None]]:
        """name -> (QEMU pid, target, observed floor) from the state file a previous manager of this
        lab left."""
        try:
            doc = json.loads(self.run_dir.manager_state.read_text())
            return {name: (int(vm["pid"]), int(vm["target"]),
                           int(vm["floor"]) if vm.get("floor") is not None else None)
                    for name, vm in doc["vms"].items() if vm.get("target") is not None}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        while not self.stopping.is_set():
            started = time.monotonic()
            if self.due(started):
                try:
                    await self.full_round(started)
                except Exception:  # a bug must not leave the lab without its manager: log it, go on
                    log.exception("round failed")
            left = max(0.1, self.interval - (time.monotonic() - started))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), left)
        log.info("stopping: %d VM(s) watched", len(self.watched))
        await asyncio.gather(*(vm.close() for vm in self.watched.values()))
        self.events.close()

    @property
    def interval(self) -> float:
        return self.config.interval if self.config else INTERVAL

    async def full_round(self, now: float) -> None:
        self.seen = self._signature()  # before the round reads them: a change meanwhile is seen next
        self.last_round = now
        await self.round()

    def due(self, now: float) -> bool:
        """Whether a full round runs now: always while there is work, else when the lab's journal or
        settings changed, and every IDLE_EVERY at least."""
        return (not self.quiet or now - self.last_round >= IDLE_EVERY
                or self._signature() != self.seen)

    def _signature(self) -> tuple[object, ...]:
        """The journal and the settings as files (inode, size, mtime): what an `up` or `down` changes."""
        def of(path: Path) -> tuple[int, int, int] | None:
            try:
                st = os.stat(path)
            except OSError:
                return None
            return (st.st_ino, st.st_size, st.st_mtime_ns)

        return (of(self.run_dir.state), of(self.run_dir.manager_config))

    def _read_config(self) -> ManagerConfig | None:
        read = self._signature()[1]
        if self.config is not None and read is not None and read == self.config_read:
            return self.config  # the file as read last
        try:
            config = read_config(self.run_dir)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s: %s", self.run_dir.manager_config, exc)
            return self.config
        self.config_read = read
        if config != self.config:
            auto = ", ".join(vm.name for vm in config.vms if vm.auto) or "none"
            log.info("settings: budget %d MiB, auto balloons: %s", config.budget_mib, auto)
        return config

    def _running(self) -> dict[str, int]:
        """The lab's VMs whose QEMU runs, by the journal; while the journal is the one read last (and
        named this manager and some VM) and each of those QEMUs still runs, the same without reading
        it again: a busy lab's rounds each second cost next to nothing."""
        from vmlaunch.errors import VmlaunchError
        from vmlaunch.lab import process as qemu
        from vmlaunch.lab.journal import Journal

        read = self._signature()[0]
        if self.running is not None and read is not None and read == self.running[0] \
                and all(qemu.alive(pid) for pid in self.running[1].values()):
            return dict(self.running[1])
        self.running = None
        try:
            journal = Journal.load(self.run_dir)
        except VmlaunchError as exc:
            log.warning("cannot read the journal: %s", exc)
            return {name: vm.pid for name, vm in self.watched.items()}
        mine = journal.entry("manager", "lab")
        if mine is not None and getattr(mine.record, "pid", None) == os.getpid():
            self.journaled = True
        elif self.journaled or self._past_grace():
            # Taken out of the journal (down could not stop it), or never put in (the `up` that started
            # it was killed before it could): nobody would ever stop it.
            log.info("not in the lab's journal (any more): nothing would stop this manager, so it stops")
            self.stopping.set()
            return {}
        idle = self._idle(len(journal.vms))
        if idle is not None:
            self.stop(idle)
            return {}
        found = {}
        self.starting = any(entry.pid is None for entry in journal.vms.values())
        for name, entry in journal.vms.items():
            if entry.pid is None:
                continue  # still starting: next round
            pid = qemu.find_pid(self.run_dir.vm(name), entry.pid)
            if pid is not None:
                found[name] = pid
        if self.journaled and found and not self.starting and len(found) == len(journal.vms):
            self.running = (read, dict(found))
        return found

    def gone(self) -> str | None:
        """Why the lab is gone, None while it is not: whatever order its files disappear in, a manager
        whose lab no command knows any more stops (the journal's own check is in `_running`)."""
        path = self.run_dir.path
        identity = _identity(path)
        if identity is None:
            return f"its run dir {path} is gone"
        if identity != self.identity:
            return f"its run dir {path} was removed (the one there now is another run's)"
        if not os.path.lexists(self.run_dir.manager_config):
            return f"its settings {self.run_dir.manager_config} are gone"
        if not os.path.lexists(self.run_dir.state) and (self.journaled or self._past_grace()):
            return f"the lab's journal {self.run_dir.state} is gone"
        return None

    def _past_grace(self) -> bool:
        """Whether a manager not (yet) in its lab's journal should be by now: the `up` that started
        it has let the lab's lock go (it journals its manager before), or a minute went by."""
        return not self.lab_busy or time.monotonic() - self.started > ORPHAN_AFTER

    def _idle(self, journal_vms: int) -> str | None:
        """Why the lab is gone when it has no VM: none in its journal, no QEMU of it running, and no
        `up` or `down` of it under way, for ORPHAN_AFTER seconds (an `up` interrupted and never taken
        down); None while it has one."""
        from vmlaunch.host.processes import Kind, of_run_dir

        busy = journal_vms or self.lab_busy or of_run_dir(self.run_dir.path, Kind.QEMU)
        if busy:
            self.idle_since = None
            return None
        now = time.monotonic()
        self.idle_since = self.idle_since if self.idle_since is not None else now
        if now - self.idle_since < ORPHAN_AFTER:
            return None
        return f"the lab has had no VM (no QEMU of it running) for {ORPHAN_AFTER:g} s"

    def stop(self, why: str) -> None:
        log.info("%s: nothing of the lab is left to manage, so the lab manager stops", why)
        self.stopping.set()

    async def round(self) -> None:
        from vmlaunch.host.processes import lab_locked

        self.lab_busy = lab_locked(self.run_dir.lock)  # before the journal is read: see _past_grace
        why = self.gone()
        if why is not None:
            self.stop(why)
            return
        self.config = self._read_config()
        if self.config is None:
            self.stop(f"its settings {self.run_dir.manager_config} are gone")
            return
        config = self.config
        running = self._running()
        if self.stopping.is_set():
            return
        wanted = {vm.name: vm for vm in config.vms if vm.name in running}
        for name in [name for name, vm in self.watched.items()
                     if name not in wanted or running.get(name) != vm.pid]:
            log.info("%s: no longer running: not watched", name)
            await self.watched.pop(name).close()
        new = [vm for name, vm in wanted.items() if name not in self.watched]
        connected = await asyncio.gather(*(self.connect(vm, running[vm.name]) for vm in new))
        for vm, watched in zip(new, connected):
            if watched is not None:
                self.watched[vm.name] = watched
        order = [vm for vm in config.vms if vm.name in self.watched]
        sizing = any(vm.auto for vm in order)  # the policy runs: it weighs every VM (else none is asked)
        samples = await asyncio.gather(*(self.sample(vm) for vm in order)) if sizing else []
        guests = [guest for guest in samples if guest is not None]
        host_mem = meminfo()
        if host_mem is not None and sizing:
            host = Host(total=host_mem.total, available=host_mem.available)
            moved = set()
            for decision in decide(config.budget_mib * MIB, host, guests):
                await self.set_target(decision.name, decision.target, decision.reason)
                moved.add(decision.name)
            await self.pace([vm for vm in order if vm.auto and vm.balloon], moved, host)
        if config.balance:
            await self.balancer.round(config, running)
        self.save(config, host_mem)
        self.events.flush()
        self.quiet = not (sizing or config.balance or self.lab_busy or self.starting
                          or len(self.watched) < len(wanted) or self.idle_since is not None
                          or bool(self.events.coalescer.bursts))

    async def connect(self, vm: ManagedVm, pid: int) -> Watched | None:
        qmp = AsyncQmp(self.run_dir.vm(vm.name).manager_qmp, timeout=5.0)
        try:
            await qmp.connect()
            period = max(1, round(self.interval)) if vm.auto else HELD_STATS
            if vm.balloon:  # each period a timer in QEMU and a wake-up of the guest: the policy's input
                await qmp.cmd("qom-set", path=BALLOON, property="guest-stats-polling-interval", value=period)
        except QmpError as exc:
            log.debug("%s: not reachable yet: %s", vm.name, exc.message)
            await qmp.close()
            return None
        saved = self.saved_targets.get(vm.name)
        target, floor = (saved[1], saved[2]) if saved is not None and saved[0] == pid else (None, None)
        log.info("%s: watched (QEMU pid %d%s%s)", vm.name, pid,
                 f", target {target // MIB} MiB as set before" if target is not None else "",
                 f", its floor {floor // MIB} MiB as seen before" if floor is not None else "")
        watched = Watched(vm.name, pid, qmp, target=target, floor=floor,
                          console_seen=console_size(self.run_dir.vm(vm.name)), seen={"pid": pid})
        if vm.balloon:
            watched.period = period
        watched.listener = asyncio.create_task(self.listen(watched))
        return watched

    async def listen(self, watched: Watched) -> None:
        """Log the VM's events as they come, until its connection is closed (the task cancelled); keep
        its balloon's actual size from BALLOON_CHANGE, so no round has to ask for it."""
        dropped = 0
        name, qmp = watched.name, watched.qmp
        while True:
            message = await qmp.next_event()
            if message.get("event") == "BALLOON_CHANGE":
                actual = (message.get("data") or {}).get("actual")
                if isinstance(actual, int) and actual >= 0:
                    watched.actual = actual
            if qmp.dropped_events != dropped:  # fell behind by a whole backlog: say so, go on
                log.warning("%s: %d QMP event(s) dropped unread", name, qmp.dropped_events - dropped)
                dropped = qmp.dropped_events
            self.quiet = False  # its repeats are logged when their window closes, by the rounds
            try:
                self.events.hear(name, message)
            except Exception:  # a bug here must not silence the VM's events for good
                log.exception("%s: event %s not logged", name, message.get("event"))

    async def sample(self, vm: ManagedVm) -> Guest | None:
        """The VM as the policy sees it; a VM without an auto balloon is held where it is."""
        watched = self.watched[vm.name]
        maximum = vm.maximum_mib * MIB
        try:
            if vm.balloon and watched.actual is None:  # once: BALLOON_CHANGE keeps it from then on
                watched.actual = int((await watched.qmp.cmd("query-balloon"))["actual"])
            actual = watched.actual if vm.balloon and watched.actual is not None else maximum
            if vm.balloon and time.monotonic() >= watched.stats_due:
                watched.stats = await watched.qmp.cmd("qom-get", path=BALLOON, property="guest-stats")
                watched.stats_due = stats_due(watched.stats, watched.period, self.interval)
            stats = watched.stats if vm.balloon else {}
        except QmpError as exc:
            log.info("%s: QMP failed (%s): dropped until it answers again", vm.name, exc.message)
            await self.watched.pop(vm.name).close()
            return None
        values = stats.get("stats", {}) if isinstance(stats, dict) else {}
        updated = stats.get("last-update", 0) if isinstance(stats, dict) else 0
        available = stat(values, "stat-available-memory") if updated else None
        free = stat(values, "stat-free-memory") if updated else None
        faults = stat(values, "stat-major-faults") or 0
        swap_in = stat(values, "stat-swap-in") or 0
        fault_rate = swap_rate = 0.0
        if updated and watched.faults is not None and updated > watched.faults[0]:
            elapsed = updated - watched.faults[0]
            fault_rate = max(0, faults - watched.faults[1]) / elapsed
            swap_rate = max(0, swap_in - watched.faults[2]) / elapsed
        if updated and (watched.faults is None or updated > watched.faults[0]):
            watched.faults = (float(updated), faults, swap_in)
        if vm.auto:
            self.observe_floor(watched, actual)
        watched.seen = {"pid": watched.pid, "actual": actual, "target": watched.target,
                        "available": available, "free": free, "major_faults_per_s": round(fault_rate, 1),
                        "swap_in_per_s": round(swap_rate), "auto": vm.auto, "floor": watched.floor}
        if vm.auto:
            return Guest(name=vm.name, maximum=maximum, minimum=vm.minimum_mib * MIB, actual=actual,
                         target=watched.target, available=available, free=free,
                         total=stat(values, "stat-total-memory"), major_faults=fault_rate, swap_in=swap_rate,
                         floor=watched.floor)
        # Held where it is: counted against the budget, never moved.
        return Guest(name=vm.name, maximum=actual, minimum=actual, actual=actual, target=None,
                     available=None, free=free, total=None, major_faults=0.0, swap_in=0.0)

    async def pace(self, vms: list[ManagedVm], moved: set[str], host: Host) -> None:
        """Let a steady auto balloon report its statistics every STEADY_STATS seconds, and a moving one
        each round. Steady: SETTLE rounds in a row in which the policy set it no target, its balloon did
        not move and the host's available memory did not move by more than 1/32 of its total. A
        change of any of these makes it report each round again from the next one."""
        shifted = self.host_available is not None and \
            abs(host.available - self.host_available) > host.total // 32
        self.host_available = host.available
        base = max(1, round(self.interval))
        for vm in vms:
            watched = self.watched.get(vm.name)
            if watched is None:
                continue
            still = not shifted and vm.name not in moved and watched.actual == watched.paced_actual
            watched.paced_actual = watched.actual
            watched.still = watched.still + 1 if still else 0
            period = STEADY_STATS if watched.still >= SETTLE and base < STEADY_STATS else base
            if period == watched.period:
                continue
            try:
                await watched.qmp.cmd("qom-set", path=BALLOON, property="guest-stats-polling-interval",
                                      value=period)
            except QmpError as exc:
                log.debug("%s: statistics period not set: %s", vm.name, exc.message)
                continue
            log.debug("%s: balloon statistics every %d s", vm.name, period)
            due = stats_due(watched.stats, period, self.interval)  # the guest's next, at the new period
            watched.stats_due = due if period > watched.period else min(watched.stats_due, due)
            watched.period = period

    def observe_floor(self, watched: Watched, actual: int) -> None:
        """Note the guest's floor when its balloon stopped short of a lower target: it gave some of the
        way and then stopped moving for a round, or its console says it ran out of pages to give
        ("Out of puff") or of memory (the OOM killer). The policy never asks it below that again, and
        raises a target already under it: squeezing on would have the guest kill its own programs,
        or panic."""
        files = self.run_dir.vm(watched.name)
        sign = console_line_since(files, watched.console_seen, OUT_OF_MEMORY)
        watched.console_seen = console_size(files)
        short = watched.target is not None and actual > watched.target
        gave = watched.set_from is not None and actual < watched.set_from
        stopped = short and gave and actual == watched.last_actual
        watched.last_actual = actual
        if (stopped or (short and sign is not None)) and (watched.floor is None or actual > watched.floor):
            watched.floor = actual
            log.warning("%s: its balloon stopped at %d MiB, short of the target %d MiB: its floor%s; "
                        "it is not asked below it again", watched.name, actual // MIB,
                        (watched.target or 0) // MIB, f" (its console: {sign!r})" if sign else "")

    async def set_target(self, name: str, target: int, reason: str) -> None:
        watched = self.watched.get(name)
        if watched is None:
            return
        before = watched.target if watched.target is not None else watched.seen.get("actual")
        try:
            await watched.qmp.cmd("balloon", value=target)
        except QmpError as exc:
            log.warning("%s: balloon target %d MiB not set: %s", name, target // MIB, exc.message)
            return
        watched.target = target
        watched.set_from = watched.seen.get("actual")
        watched.seen["target"] = target
        shown = f"{before // MIB} -> " if isinstance(before, int) else ""
        log.info("%s: target %s%d MiB: %s", name, shown, target // MIB, reason)

    def save(self, config: ManagerConfig, host_mem: Any) -> None:
        """Write what it saw and set, for `status`: when that changed (the host's and KSM's figures
        aside), else every IDLE_EVERY seconds."""
        mine = {"budget": config.budget_mib * MIB, "placement": self.balancer.state or None,
                "vms": {name: vm.seen for name, vm in self.watched.items()}}
        now = time.monotonic()
        if mine == self.saved and now - self.saved_at < IDLE_EVERY:
            return
        ksm = ksm_counters()
        doc = {"pid": os.getpid(), "time": time.time(),
               "host": attrs.asdict(host_mem) if host_mem is not None else None,
               "ksm": ksm.to_json() if ksm is not None else None, **mine}
        self.saved, self.saved_at = copy.deepcopy(mine), now  # a copy: `seen` is changed in place
        try:
            write_atomic(self.run_dir.manager_state, json.dumps(doc, indent=1) + "\n", durable=False)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.run_dir.manager_state, exc.strerror or exc)


def _identity(path: Path) -> tuple[int, int] | None:
    """The run dir's device and inode; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def main(argv: list[str] | None = None) -> int:
    """`python -m vmlaunch.manager.manager RUN_DIR`: the manager in the foreground (`up` starts it
    through `manager/managerd.py`, which does not wait for these modules to load)."""
    parser = argparse.ArgumentParser(prog="python -m vmlaunch.manager.manager",
                                     description="The lab manager (started by `vmlaunch up`).")
    parser.add_argument("run_dir", type=Path)
    return run(parser.parse_args(argv).run_dir)


def run(path: Path) -> int:
    """Run the manager of the lab whose run dir is `path` until SIGTERM."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("qemu").setLevel(logging.CRITICAL)  # the QMP library's chatter about lost peers
    run_dir = RunDir(path)
    log.info("lab manager of %s started (pid %d)", run_dir.lab, os.getpid())

    async def serve() -> None:  # the manager's event is made on the loop that runs it
        await Manager(run_dir).serve()

    try:
        asyncio.run(serve())
    except Exception:
        log.exception("the lab manager failed")
        return 1
    log.info("lab manager of %s stopped", run_dir.lab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
