"""Carry a Plan out (`up`) and undo it (`down`).

`up` applies each resource, journals the record it returns and puts the record's undo on one
ExitStack: any failure (or Ctrl-C) unwinds what this `up` did, in reverse. Every kind of resource is
handled the same way (`resources/base.py`); nothing here knows bridges from images.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from vmlaunch.compile.plan import Plan, VmPlan
from vmlaunch.core import signals
from vmlaunch.core.textsafe import last_line, printable
from vmlaunch.core.wait import TimedOut, remaining, wait_until
from vmlaunch.errors import RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.lab import process as qemu
from vmlaunch.lab.journal import Entry, Journal, VmEntry, locked
from vmlaunch.lab.running import running_vms
from vmlaunch.lab.timeline import Timeline
from vmlaunch.layout import lastrun
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import RunDir, VmFiles
from vmlaunch.qemu.qmp import QuickQmp
from vmlaunch.resources.base import Context, Resource, UndoneWithError, preflight
from vmlaunch.runtime.waves import ALL_AT_ONCE, Waves

if TYPE_CHECKING:
    from vmlaunch.saved.snapshot import WarmStart

log = logging.getLogger(__name__)


def describe(plan: Plan) -> Iterator[str]:
    """What `up` would do, for `--dry-run`: the resources with what exists now, then each argv."""
    import shlex

    from vmlaunch.resources.vmuser import VmUser

    yield f"lab {plan.lab}: run dir {plan.run_dir}"
    journal = Journal.load(plan.run_dir)
    for resource in plan.resources:
        found = resource.found()
        state = " [done]" if journal.has(resource.kind, resource.key) else f" [{found}]" if found else ""
        yield f"  {resource.describe()}{state}"
    running_now = running_vms(journal)
    yield from (f"accelerator: {line}" for line in plan.accel_lines())
    yield f"{plan.admission.describe(len(plan.vms))}; when `up` waits for the VMs (--wait-for, --wait ssh)"
    for vm in plan.vms:
        running = vm.name in running_now
        yield f"{vm.name}: {vm.accel.accel.value}{' [running]' if running else ''}"
        runas = " -runas UID:UID" if any(isinstance(r, VmUser) and r.vm == vm.name
                                         for r in plan.resources) else ""
        yield f"  {shlex.join(vm.argv)} -S{runas}  (in a session of its own; then QMP cont)"


def _apply(resource: Resource, ctx: Context, journal: Journal, stack: contextlib.ExitStack) -> None:
    """Apply one resource, journal its record, and put its undo on the stack for a failing `up`.

    A resource that writes for a while (an image) may name a `claim` to apply and journal first, unless
    a killed run did: what a crash half-way leaves, `down` undoes and the next `up` finishes. The
    finished record then replaces the claim's."""
    claim_of = getattr(resource, "claim", None)
    claim: Resource | None = claim_of(ctx) if claim_of is not None else None
    claimed = contextlib.ExitStack()  # the claim's undo, until the record replaces it
    try:
        if claim is not None and not journal.has(claim.kind, claim.key):
            _apply(claim, ctx, journal, claimed)
        record = resource.apply(ctx)
        entry = Entry(kind=resource.kind, key=resource.key, vm=resource.owner, record=record)
        stack.callback(_roll_back, entry, ctx, journal)  # first: undone even if not journaled
        claimed.pop_all()  # undoing the record undoes what the claim covered: never both
    except BaseException:
        with signals.held():
            claimed.close()
        raise
    if claim is not None:
        journal.resources = [e for e in journal.resources if (e.kind, e.key) != (claim.kind, claim.key)]
    journal.add(entry)


def _roll_back(entry: Entry, ctx: Context, journal: Journal) -> None:
    """Undo one thing a failing `up` did. A failure is said, never raised: the error of the failing
    `up` stays the one it exits with, and the rest of the rollback runs. What could not be undone
    stays in the journal, for `down` to try again."""
    try:
        entry.record.undo(ctx, rollback=True)
    except UndoneWithError as exc:  # done as far as it goes: never again
        log.warning("%s", exc)
    except Exception as exc:  # whatever it is, the error of the `up` comes first
        log.warning("rolling back, could not undo %s: %s (it stays in the journal: `vmlaunch down SPEC` "
                    "tries again)", entry.record.describe(), _reason(exc))
        return
    with contextlib.suppress(OSError):  # the run dir goes away after a failed up anyway
        journal.drop(entry)


def _reason(exc: Exception) -> str:
    if isinstance(exc, VmlaunchError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}"  # a bug: still said, and the rollback goes on


def up(plan: Plan, *, spec: str | os.PathLike[str], qemu_img: str | None = None, wait_for: str | None = None,
       timeout: float = 60.0, force: bool = False, wait_ssh: bool = False,
       fresh: bool = False, from_snapshot: WarmStart | None = None,
       parallel: int | None = None) -> dict[str, int]:
    """Make the plan real; return name -> pid of every VM of the plan now running.

    A lab that is up from another spec file (same lab name) is refused unless `force` takes it over.
    `from_snapshot` (`snapshot.warm_start`): the VMs, all down, start from a snapshot, RAM included.
    `parallel`: how many VMs boot at once (`up --parallel`), instead of the plan's admission.
    """
    if fresh and from_snapshot is not None:
        raise UsageError("--fresh and --from-snapshot do not go together: --fresh makes the disks that "
                         "hold the snapshot anew")
    umask = os.umask(0o077)  # the run dir, journal and logs are for their owner only
    try:
        ctx = Context(lab=plan.lab, qemu_img=qemu_img or "qemu-img", umask=umask)
        return _up(plan, os.fspath(spec), ctx, wait_for, timeout, force, wait_ssh, fresh, from_snapshot,
                   parallel)
    finally:
        os.umask(umask)


def _up(plan: Plan, spec: str, ctx: Context, wait_for: str | None, timeout: float,
        force: bool, wait_ssh: bool = False, fresh: bool = False,
        from_snapshot: WarmStart | None = None, parallel: int | None = None) -> dict[str, int]:
    with locked(plan.run_dir, timeout):
        journal = Journal.load(plan.run_dir)  # first: a journal it cannot read leaves no mark
        journal.check_spec(spec, force=force)
        if os.path.lexists(plan.run_dir.intent):  # a snapshot operation a killed vmlaunch left
            from vmlaunch.saved import snapshot

            snapshot.settle(plan.run_dir, timeout)
        if os.path.lexists(plan.run_dir.forks):
            settle_fork(plan.run_dir, timeout)  # a fork killed half-way: its clones go, its source runs
            journal = Journal.load(plan.run_dir)
        plan.run_dir.create()
        journal.spec = os.path.realpath(spec)
        already = running_vms(journal)
        for name in _never_ran(journal, already):  # an up killed before it let them run: started anew
            del already[name], journal.vms[name]
        to_start = [vm for vm in plan.vms if vm.name not in already]
        if from_snapshot is not None and len(to_start) < len(plan.vms):
            running = [vm.name for vm in plan.vms if vm.name in already]
            raise RuntimeFailure(f"{', '.join(running)} {'runs' if len(running) == 1 else 'run'} already: "
                                 "--from-snapshot starts VMs that are down", "restore a lab that is up "
                                 f"with `vmlaunch snapshot SPEC restore {from_snapshot.name}`")
        if fresh:
            for name in already:
                log.warning("%s runs already: not started afresh (down it first)", name)
            _reset(plan.lab_dir, [vm.name for vm in to_start])
        revived = _revive(plan, ctx, journal)
        if not to_start:
            if revived:
                with contextlib.ExitStack() as stack:
                    for resource in revived:
                        _apply(resource, ctx, journal, stack)
                    stack.pop_all()
            log.info("lab %s: every VM already runs", plan.lab)
            return already
        wanted = {vm.name for vm in to_start}
        resources = [r for r in plan.resources if not journal.has(r.kind, r.key)
                     and (r.owner is None or r.owner in wanted)]
        stack = contextlib.ExitStack()
        try:
            preflight(resources)
            for resource in resources:
                _apply(resource, ctx, journal, stack)
            for vm in to_start:
                clear_stale(vm.files)
                # Journaled before QEMU starts: a vmlaunch killed from here on leaves a journal that
                # `down` finds the QEMU by (through the pidfile).
                journal.vms[vm.name] = VmEntry(pid=None, started=time.time(), accel=vm.accel.accel.value)
            journal.save()
            if from_snapshot is not None:
                to_start = [from_snapshot.starting(vm) for vm in to_start]
            # Before start: a signal the moment start returns must not leave its QEMUs running.
            stack.callback(qemu.kill_serving, [vm.files for vm in to_start])
            try:
                pids = qemu.start(to_start, identities(journal, to_start),
                                  from_snapshot.descriptors if from_snapshot is not None else None)
            finally:
                if from_snapshot is not None:
                    from_snapshot.close()
            timeline = Timeline({vm.name: (vm.files, journal.vms[vm.name].started) for vm in to_start})
            for vm in to_start:
                timeline.mark(vm.name, "qmp")  # `start` returns once each QEMU answered QMP
            for resource in plan.resources:  # QEMUs wait paused: a resource may check what QEMU opened,
                for hook in ("check_opened", "attach"):  # and put QEMU's threads where they belong
                    call = getattr(resource, hook, None)
                    if call is not None and resource.owner in pids:
                        call(pids[resource.owner])
            for vm in to_start:  # whatever umask QEMU had, these are ours alone
                journal.vms[vm.name] = VmEntry(pid=pids[vm.name], started=journal.vms[vm.name].started,
                                               accel=vm.accel.accel.value,
                                               ssh_port=ssh_port(vm) if vm.ssh_user else None)
                for path in vm.files.private:
                    narrow(path)
            journal.save()
            deadline = time.monotonic() + timeout
            if from_snapshot is not None:  # still paused: the guests resume at the snapshot's instant
                from_snapshot.load(to_start, timeout)
            if any(vm.disk_faults for vm in to_start):  # the spec's disk faults, before the guests run
                from vmlaunch.rig import diskfault

                for vm in to_start:
                    diskfault.apply_at_up(plan.run_dir, vm, pids[vm.name])
            waited = [vm for vm in to_start if vm.ssh_user] if wait_ssh else []
            signalled = to_start if wait_for is not None else waited  # the VMs with a ready signal
            waves = _waves(plan, to_start, timeout, parallel=parallel, signalled=signalled,
                           warm=from_snapshot is not None, timeline=timeline)
            stack.callback(waves.close)
            if wait_for is not None:
                _wait_console(to_start, pids, wait_for, timeout, waves, timeline)
            if waited:  # with their clocks set in the same SSH session, after a snapshot
                ports = {vm.name: journal.vms[vm.name].ssh_port for vm in waited}
                wait_for_ssh(plan, waited, pids, ports, remaining(deadline, 1.0),
                             clocks=[vm.name for vm in waited] if from_snapshot is not None else (),
                             waves=waves, timeline=timeline)
            if not waves.all_continued:  # asked for, with nothing to wait for: each had its share
                asking = _Asking()
                waves.wait_until_continued(deadline, lambda: _check_admitted(to_start, pids, waves, asking))
            waves.finish()
            for name, phases in timeline.phases().items():  # for `status --json` and `up --timeline`
                journal.vms[name] = attrs.evolve(journal.vms[name], boot=phases)
            journal.save()
            if from_snapshot is not None:
                from_snapshot.step_clocks(plan, [vm for vm in to_start if vm not in waited],
                                          {vm.name: journal.vms[vm.name].ssh_port for vm in to_start})
            if any(vm.guest_netem for vm in to_start) or any(r.kind == "netem" for r in resources):
                from vmlaunch.rig import netem  # the spec's netem: recorded, and set in the guests

                netem.apply_at_up(plan, to_start, deadline)
        except BaseException:
            with signals.held():  # a second Ctrl-C must not cut the rollback short
                try:
                    stack.close()  # QEMUs killed first: their logs are complete
                    lastrun.keep(plan.run_dir, [vm.name for vm in to_start])
                finally:
                    for vm in to_start:
                        journal.vms.pop(vm.name, None)
                    if not journal.empty:  # the run dir stays (for VMs that run, or what was not undone)
                        for vm in to_start:  # but not these files: their logs were kept
                            _remove_files(vm.files)
                    _settle(journal, [vm.name for vm in plan.vms])
            raise
        stack.pop_all()  # success: keep everything for `down`
        return {**already, **pids}


def _revive(plan: Plan, ctx: Context, journal: Journal) -> list[Resource]:
    """The lab's journaled processes (the lab manager) that are gone, to start again: their records
    are dropped from the journal. Those that run are given this plan's settings (`refresh`)."""
    revived = []
    for resource in plan.resources:
        entry = journal.entry(resource.kind, resource.key)
        if entry is None:
            continue
        alive = getattr(entry.record, "alive", None)
        if alive is not None and not alive():
            log.warning("%s is gone: starting it again", entry.record.describe())
            journal.drop(entry)
            revived.append(resource)
            continue
        refresh = getattr(resource, "refresh", None)
        if refresh is not None:
            refresh(ctx)
    return revived


def ssh_port(vm: VmPlan) -> int:
    """The host port QEMU's user network picked for the VM's SSH forward (127.0.0.1:0 in its argv),
    from the monitor's `info usernet`: the section of the management netdev, the rule to port 22."""
    import re

    with QuickQmp(vm.files.qmp, timeout=5) as qmp:
        text = qmp.cmd("human-monitor-command", **{"command-line": "info usernet"})
    section = re.search(r"\(mgmt\):\r?\n(.*?)(?:\r?\nHub |\Z)", str(text), re.S)
    found = section and re.search(r"TCP\[HOST_FORWARD\]\s+\d+\s+127\.0\.0\.1\s+(\d+)\s+\S+\s+22\b",
                                  section.group(1))
    if not found:
        raise RuntimeFailure(f"{vm.name}: QEMU did not say which port it forwards to SSH",
                             f"`info usernet` answered: {printable(str(text)).strip()[:200]!r}")
    return int(found.group(1))


def reset(run_dir: RunDir, lab_dir: LabDir, vms: Sequence[str], timeout: float = 10.0) -> None:
    """`vmlaunch reset`: the next `up` starts these VMs afresh from their images. Refused for a VM
    that runs (its QEMU holds the files)."""
    with locked(run_dir, timeout):
        running = [name for name in running_vms(Journal.load(run_dir)) if name in vms]
        if running:
            raise RuntimeFailure(f"{', '.join(running)} {'is' if len(running) == 1 else 'are'} up: "
                                 "a running VM cannot be reset", "take it down first: `vmlaunch down "
                                 f"SPEC {' '.join(running)}`")
        _reset(lab_dir, vms)


def _reset(lab_dir: LabDir | None, vms: Sequence[str]) -> None:
    from vmlaunch.resources.guest import reset as reset_vm

    if lab_dir is None:
        return
    for name in vms:
        removed = reset_vm(lab_dir, name)
        if removed:
            log.info("%s: reset (removed %s)", name, ", ".join(path.name for path in removed))


def narrow(path: Path) -> None:
    """chmod 0600, but never through a symlink (a chmod follows one)."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            os.chmod(path, 0o600)


def _settle(journal: Journal, vms: Iterable[str]) -> list[str]:
    """Save the journal, or remove the run dir when nothing is left in it; return what failed.

    Removing needs no free space: a full run dir still loses an empty journal. A run dir that is not
    vmlaunch's, or holds files vmlaunch did not put there, is kept and said so.
    """
    run_dir = journal.run_dir
    if journal.empty:
        if run_dir.path.exists() and not run_dir.marked():
            log.warning("kept %s: it has no vmlaunch mark, so vmlaunch did not make it", run_dir)
            return []
        try:
            if stat.S_ISREG(os.lstat(run_dir.state).st_mode):
                os.unlink(run_dir.state)  # first: whatever else fails, nothing is left to undo
        except FileNotFoundError:
            pass
        except OSError as exc:
            return [f"the journal {run_dir.state} could not be removed ({exc.strerror or exc}); "
                    "everything it lists is undone: run down again to remove the run dir"]
        why = run_dir.remove(vms)
        if why is not None:
            log.warning("kept %s: %s", run_dir, why)
        return []
    try:
        journal.save()
    except OSError as exc:
        return [f"the journal {run_dir.state} could not be updated ({exc.strerror or exc}); it still "
                "lists what was undone, which the next down finds gone and skips"]
    return []


settle_journal = _settle  # for the multi-host engine's rollback (multihost/engine.py)


def _never_ran(journal: Journal, running: dict[str, int]) -> list[str]:
    """The VMs among `running` whose guest never ran (`qemu.NEVER_RAN`): an `up` was killed before it
    let them run. Their QEMUs are stopped, for this `up` to start them anew."""
    stalled = {}
    for name, pid in running.items():
        try:
            with QuickQmp(journal.run_dir.vm(name).qmp, 2) as qmp:
                state = qmp.cmd("query-status").get("status")
        except (RuntimeFailure, OSError, ValueError):
            continue  # busy or gone: left as it is
        if state in qemu.NEVER_RAN:
            stalled[name] = (pid, journal.run_dir.vm(name))
    if not stalled:  # the usual case: no event loop (asyncio) to start for nothing
        return []
    for name, how in qemu.stop_all(stalled, 1.0).items():
        log.warning("%s: its guest never ran (an earlier up was interrupted before it let it run): %s, "
                    "started again", name, how)
    return list(stalled)


def identities(journal: Journal, vms: Sequence[VmPlan]) -> dict[str, tuple[int, int]]:
    """VM -> (uid, gid) its QEMU runs as: the uid each VM claimed (resources/vmuser.py), if any."""
    from vmlaunch.resources.vmuser import VmUserRecord

    found = {}
    for vm in vms:
        entry = journal.entry(VmUserRecord.kind, vm.name)
        if entry is not None and isinstance(entry.record, VmUserRecord):
            found[vm.name] = (entry.record.uid, entry.record.gid)
    return found


def _remove_files(files: VmFiles) -> None:
    for path in files.every:
        with contextlib.suppress(OSError):
            path.unlink()


def clear_stale(files: VmFiles) -> None:
    """Sockets and pidfiles a crashed QEMU left behind would make QEMU fail to bind; and QEMU opens
    its serial log itself, following links, so a link planted where any VM file goes is removed."""
    for path in files.every:
        with contextlib.suppress(FileNotFoundError):
            if path in files.stale or stat.S_ISLNK(os.lstat(path).st_mode):
                path.unlink()


def _waves(plan: Plan, vms: Sequence[VmPlan], timeout: float, *, parallel: int | None,
           signalled: Sequence[VmPlan], warm: bool, timeline: Timeline | None = None) -> Waves:
    """Shake hands with every VM (started paused) and continue the first of them. The VMs whose ready
    signal `up` waits for (`signalled`: a console text, SSH) boot in waves; the others are continued
    at once, as every VM was before admission. With nothing to wait for, only `--parallel` makes
    waves, each VM keeping its place for its part of the timeout. VMs loaded from a snapshot do not
    boot: all resume at once."""
    from vmlaunch.policy.admission import Booting, admission
    from vmlaunch.spec.model import Accel

    booting = [Booting(vm.name, vm.vcpus, vm.accel.accel is Accel.TCG) for vm in vms]
    waited = {vm.name for vm in signalled}
    counted = [vm for vm in booting if vm.name in waited] if waited else booting
    chosen = plan.admission if parallel is None else admission(0, booting, asked=parallel)
    share = None
    if warm or chosen.width is None or chosen.width >= len(counted) or not (waited or parallel is not None):
        chosen, free = ALL_AT_ONCE, set()
    elif waited:
        free = {vm.name for vm in vms} - waited
        log.info("%s", chosen.describe(len(counted)))
    else:  # --parallel with nothing to wait for: the waves fit in the timeout
        free = set()
        share = chosen.share(timeout, len(counted), floor=0.0) * 0.9
        log.info("%s", chosen.describe(len(counted)))
    deadline = time.monotonic() + timeout
    return Waves.open(booting, lambda name: QuickQmp(plan.vm(name).files.qmp, remaining(deadline, 1.0)),
                      chosen, timeout, timeline=timeline, free=free, share=share)


def _check_admitted(vms: Sequence[VmPlan], pids: dict[str, int], waves: Waves,
                    asking: _Asking) -> None:
    for vm in vms:
        if waves.admitted(vm.name):
            check_booting(vm, pids[vm.name], "it was let boot", ask_qemu=asking(vm.name))


def _wait_console(vms: Sequence[VmPlan], pids: dict[str, int], wait_for: str, timeout: float,
                  waves: Waves, timeline: Timeline | None = None) -> None:
    waiting = {vm.name: vm for vm in vms}
    asking = _Asking()

    def all_ready() -> bool:
        for name, vm in list(waiting.items()):
            if not waves.admitted(name):
                continue  # paused until its turn to boot
            console = qemu.read_text(vm.files.serial_log)
            if timeline is not None:
                timeline.observe(name, console)
            if wait_for in console:
                log.info("%s: ready (%r on the console)", name, wait_for)
                del waiting[name]
                if timeline is not None:
                    timeline.mark(name, "ready")
                waves.ready(name)
            else:
                check_booting(vm, pids[name], f"its console printed {wait_for!r}", ask_qemu=asking(name))
        waves.step()
        return not waiting

    def progress(waited: float) -> None:
        if len(waiting) > QUIET_ABOVE:
            for vm in waiting.values():
                if waves.admitted(vm.name):
                    _console_line(vm)  # a console that shows the OS refusing the CPU ends the wait
            log.info("waiting for %r, %.0f s: %s", wait_for, waited, waves.summary(list(waiting)))
        for name, vm in waiting.items():
            if not waves.admitted(name):
                log.debug("%s: waiting for its turn to boot", name)
            else:
                log.log(logging.DEBUG if len(waiting) > QUIET_ABOVE else logging.INFO,
                        "%s: waiting for %r, %.0f s: %s", name, wait_for, waited, _console_line(vm))

    try:
        wait_until(all_ready, timeout, progress=progress)
    except TimedOut:
        tails = "".join(f"\n{name}:{_tail(vm.files.serial_log)}" for name, vm in sorted(waiting.items()))
        paused = [name for name in waiting if not waves.admitted(name)]
        still = f" ({len(paused)} of them never got their turn to boot)" if paused else ""
        raise RuntimeFailure(f"timed out after {timeout:g} s waiting for {wait_for!r} on the console "
                             f"of {', '.join(sorted(waiting))}{still}; the last lines:{tails}") from None


# More VMs than this waiting: one progress line for the whole lab per interval (each VM's under -v).
QUIET_ABOVE = 4


def check_booting(vm: VmPlan, pid: int, before: str, *, ask_qemu: bool = True) -> None:
    """Raise RuntimeFailure when a VM waited for will never get to `before`: its QEMU exited, or its
    guest panicked (its console says so, or QEMU's run state when `ask_qemu`). The wait ends now (and
    `up` rolls back), not at its timeout."""
    if not qemu.alive(pid):
        raise RuntimeFailure(f"{vm.name}: QEMU exited before {before}"
                             f"{_tail(vm.files.serial_log)}{_tail(vm.files.qemu_log, empty='')}")
    panic = qemu.guest_stuck(vm.files, ask_qemu=ask_qemu, any_boot=True)  # a fresh log per QEMU
    if panic == qemu.IO_ERROR_SAID:
        raise RuntimeFailure(f"{vm.name}: stopped before {before}: {panic}", "its disks' on_error, "
                             "and the spec's [[fault]]s, say what a failed request does")
    if panic is not None:
        raise RuntimeFailure(f"{vm.name}: the guest panicked before {before}: {panic}"
                             f"{_tail(vm.files.serial_log)}", f"`vmlaunch logs SPEC {vm.name}` shows its "
                             "whole console (kept after this failed up)")


class _Asking:
    """Whether to ask QEMU for a VM's run state this round: at most once a second per VM (a panic
    its console does not show is seen within a second or two, and 40 VMs do not cost 200 QMP
    connections a second)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.last: dict[str, float] = {}

    def __call__(self, name: str) -> bool:
        now = time.monotonic()
        if now - self.last.get(name, -self.every) < self.every:
            return False
        self.last[name] = now
        return True


def _console_line(vm: VmPlan) -> str:
    """The last line of a waiting VM's console, for its progress line; a console that shows its OS
    refusing the VM's CPU ends the wait (check_cpu_level)."""
    console = qemu.read_text(vm.files.serial_log)
    check_cpu_level(vm, console)
    return last_line(console) or "(nothing on the console yet)"


# How long `up` waits by default: for the VMs to run (and a console text), and with --wait ssh for a
# cold boot of a distro under TCG (a minute or two on an idle host, several on a busy one; Lima's
# default is ten minutes too).
UP_TIMEOUT = 60.0
SSH_TIMEOUT = 600.0


def default_timeout(wait_ssh: bool) -> float:
    return SSH_TIMEOUT if wait_ssh else UP_TIMEOUT


# Run in the guest by `--wait ssh`: "cloud-init:0" once cloud-init has finished (or at once when the
# guest has none, or it is disabled), "cloud-init:1" when it finished with errors. Read from the file
# cloud-init writes when its last stage ends (/run/cloud-init/result.json: `"errors": []` when there
# were none), as `cloud-init status` does; the shell is quicker than that Python command by a second
# or two under TCG. A guest without that directory (cloud-init not started by its systemd generator)
# is asked `cloud-init status --wait`.
_CLOUD_INIT_DONE = (
    "command -v cloud-init >/dev/null 2>&1 || exit 0; r=/run/cloud-init; "
    "if [ -e $r/enabled ]; then "
    "while [ ! -e $r/result.json ]; do sleep 0.5 2>/dev/null || sleep 1; done; "
    "grep -q '\"errors\": \\[\\]' $r/result.json; echo cloud-init:$?; "
    "elif [ -d $r ]; then echo cloud-init:0; "
    "else cloud-init status --wait >/dev/null 2>&1; echo cloud-init:$?; fi")
SSH_ATTEMPT = 5.0  # seconds one SSH attempt of `--wait ssh` may take before it is tried again


def wait_for_ssh(plan: Plan, vms: Sequence[VmPlan], pids: dict[str, int], ports: dict[str, int | None],
                 timeout: float, clocks: Collection[str] = (), waves: Waves | None = None,
                 timeline: Timeline | None = None) -> None:
    """Every VM with an SSH port answers: `ssh ... true` with the lab's key and its pinned host key
    succeeds, and cloud-init (when the guest has it) has finished. The VMs are tried all at once, each
    every second; a progress line per VM every 5 s; a VM whose QEMU exits stops the wait.

    `clocks`: VMs just loaded from a snapshot, whose clocks are behind: the same SSH session sets each
    one's clock to the host's (`snapshot.clock_session`), so SSH is asked once, not twice."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import wait as futures_wait

    from vmlaunch.guests.sshkeys import ssh_argv
    from vmlaunch.saved.snapshot import clock_session

    waiting = {vm.name: vm for vm in vms}
    asking = _Asking()
    lab_dir = plan.lab_dir
    assert lab_dir is not None  # compile_lab sets it
    unset = set(clocks)  # VMs whose clock is still to be set

    deadline = time.monotonic() + timeout
    tried: dict[str, str] = {}  # VM -> why SSH did not answer it last

    def answers(vm: VmPlan) -> bool:
        """SSH runs a command, and cloud-init (when the guest has it) has finished: until then it may
        still restart sshd with the host key it was given, or not have made the user yet. Why it did
        not (yet) goes to `tried[vm.name]`."""
        port = ports.get(vm.name)
        assert port is not None and vm.ssh_user is not None
        unreachable = port_unreachable(port)
        if unreachable is not None:
            tried[vm.name] = unreachable
            return False
        argv_of = functools.partial(ssh_argv, lab_dir, vm.name, vm.ssh_user, port)
        if vm.name in unset:
            session = clock_session(argv_of, then=_CLOUD_INIT_DONE, timeout=remaining(deadline, SSH_ATTEMPT))
            if session.status is None or session.status == 255:
                log.debug("%s: SSH: %s", vm.name, session.error)
                tried[vm.name] = session.error or "SSH did not answer"
                return False  # SSH did not answer (yet)
            unset.discard(vm.name)
            if session.error is not None:
                log.warning("%s: its clock could not be set to the host's: %s", vm.name, session.error)
                return False  # asked again, without the clock
            log.info("%s: clock set to the host's (it was %.1f s %s)", vm.name, abs(session.behind),
                     "behind" if session.behind >= 0 else "ahead")
            status, output = session.status, session.output
        else:
            try:
                done = subprocess.run(argv_of(["sh", "-c", _CLOUD_INIT_DONE]), stdin=subprocess.DEVNULL,
                                      capture_output=True, check=False, text=True,
                                      timeout=remaining(deadline, SSH_ATTEMPT))
            except subprocess.TimeoutExpired:
                tried[vm.name] = f"SSH did not finish within {SSH_ATTEMPT:g} s"
                return False
            status, output = done.returncode, done.stdout
            if status != 0:
                lines = [line for line in done.stderr.splitlines() if line.strip()]
                tried[vm.name] = lines[-1].strip() if lines else f"ssh exited with status {status}"
        if status != 0:
            return False  # 255: ssh could not connect or log in (yet)
        said = output.strip().rpartition("cloud-init:")[2]
        if said not in ("", "0", "2"):  # 2: done, with warnings (`cloud-init status`)
            log.warning("%s: cloud-init reported an error: `vmlaunch ssh SPEC %s -- cloud-init status "
                        "--long` says which", vm.name, vm.name)
        return True

    pool = ThreadPoolExecutor(max(1, len(vms)))

    def all_ready() -> bool:
        trying = [vm for vm in waiting.values() if waves is None or waves.admitted(vm.name)]
        attempts = [pool.submit(answers, vm) for vm in trying]
        while True:  # an attempt may take seconds: meanwhile a panic or a VM's turn is seen at once
            done, running = futures_wait(attempts, timeout=0.2)
            if not running:
                break
            for vm, attempt in zip(trying, attempts):
                if attempt in running:
                    check_booting(vm, pids[vm.name], "SSH answered", ask_qemu=asking(vm.name))
            if waves is not None:
                waves.step()
        answered = [attempt.result() for attempt in attempts]
        for vm, ok in zip(trying, answered):
            if timeline is not None:
                timeline.observe(vm.name, qemu.read_text(vm.files.serial_log, tail=1 << 20))
            if ok:
                log.info("%s: ready (SSH answers on 127.0.0.1:%s)", vm.name, ports[vm.name])
                del waiting[vm.name]
                tried.pop(vm.name, None)
                if timeline is not None:
                    timeline.mark(vm.name, "ready")
                if waves is not None:
                    waves.ready(vm.name)
            else:
                check_booting(vm, pids[vm.name], "SSH answered", ask_qemu=asking(vm.name))
                fix = cannot_heal(tried.get(vm.name, ""))
                if fix is not None:
                    raise RuntimeFailure(f"{vm.name}: SSH cannot reach 127.0.0.1:{ports[vm.name]}: "
                                         f"{tried[vm.name]}; waiting would not help", fix)
        if waves is not None:
            waves.step()
        return not waiting

    def progress(waited: float) -> None:
        quiet = len(waiting) > QUIET_ABOVE
        if quiet and waves is not None:
            log.info("waiting for SSH, %.0f s: %s", waited, waves.summary(list(waiting)))
        for name, vm in waiting.items():
            if waves is not None and not waves.admitted(name):
                log.debug("%s: waiting for its turn to boot", name)
                continue
            ssh = f"; SSH: {printable(tried[name])[:120]}" if name in tried else ""
            log.log(logging.DEBUG if quiet and waves is not None else logging.INFO,
                    "%s: waiting for SSH, %.0f s: %s%s", name, waited, _console_line(vm), ssh)

    try:
        wait_until(all_ready, timeout, interval=1.0, progress=progress)
    except TimedOut:
        tails = "".join(f"\n{name}:{_tail(vm.files.serial_log)}" for name, vm in sorted(waiting.items()))
        last = "".join(f"\n{name}: SSH said last: {printable(tried[name])[:200]}"
                       for name in sorted(waiting) if name in tried)
        raise RuntimeFailure(f"timed out after {timeout:.0f} s waiting for SSH on "
                             f"{', '.join(sorted(waiting))}; the last console lines:{tails}{last}",
                             "a cold boot under TCG takes a minute or two: a longer --timeout?") from None
    finally:  # attempts still under way end with their ssh (the VMs they ask go down on a failure)
        pool.shutdown(wait=False, cancel_futures=True)


# Errors of a connection to a forwarded port on 127.0.0.1 that no wait heals: the loopback interface
# of this network namespace is down (a fresh `unshare -n` or `ip netns add` leaves it so), or it has
# no 127.0.0.1.
_NO_LOOPBACK = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL)
_NO_LOOPBACK_TEXT = tuple(os.strerror(code) for code in _NO_LOOPBACK)
_LOOPBACK_FIX = ("the loopback interface is down in this network namespace: `ip link set lo up` "
                 "(as root, in the namespace vmlaunch runs in), then `vmlaunch up` again")


def port_unreachable(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a TCP connection to host:port fails at once for a reason no wait heals, else None (it
    connects, is refused, or is slow: a guest that is still booting)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=1.0):
            return None
    except OSError as exc:
        if exc.errno in _NO_LOOPBACK:
            return f"connect to {host} port {port}: {exc.strerror}"
        return None


def cannot_heal(error: str) -> str | None:
    """The fix for an SSH error that waiting cannot heal, None for one that it may."""
    return _LOOPBACK_FIX if any(text in error for text in _NO_LOOPBACK_TEXT) else None


# What glibc (2.33 and later) prints when the CPU lacks the x86-64 level the distribution was built
# for (RHEL 9 and its rebuilds: x86-64-v2; RHEL 10: v3): the guest's init dies at once, and the
# guest panics or loops, never answering. Seen on the console, it ends a wait with the fix.
_CPU_LEVEL_MISSING = re.compile(r"CPU does not support (x86-64-v[2-4])")


def check_cpu_level(vm: VmPlan, console: str) -> None:
    """Fail when the VM's console shows its OS refusing the VM's CPU model."""
    found = _CPU_LEVEL_MISSING.search(console)
    if found is None:
        return
    model = vm.argv[vm.argv.index("-cpu") + 1] if "-cpu" in vm.argv else "QEMU's default"
    raise RuntimeFailure(f"{vm.name}: its OS needs an {found[1]} CPU (its console says \"{found[0]}\"), "
                         f"and -cpu {model} is not one",
                         f'set cpu_model = "max" in vm.{vm.name}: every x86-64 level')


def _tail(path: Path, lines: int = 5, empty: str = " (nothing on its console)") -> str:
    """The end of a log, for an error message (a failed `up` removes the run dir it lives in), with
    the guest's terminal escapes taken out: this is vmlaunch speaking, not the guest."""
    text = printable(qemu.read_text(path)).strip()
    if not text:
        return empty
    return "".join(f"\n  | {line}" for line in text.splitlines()[-lines:])


def _release_unjournaled(run_dir: RunDir, journaled: Callable[[str, str], bool]) -> None:
    from vmlaunch.resources.registry import release_unjournaled

    try:
        for problem in release_unjournaled(Context(lab=run_dir.lab), journaled):
            log.warning("%s", problem)
    except (VmlaunchError, OSError) as exc:  # a read-only run root: still stop every VM
        log.warning("%s", exc)


def _undo_wire(run_dir: RunDir, stopped: set[str], *, whole_lab: bool) -> list[str]:
    """The faults on the wire of what went down: link records die with their QEMUs; the lab's
    partition table goes with the lab (rig/partition.py). Returns what failed."""
    from vmlaunch.rig import link, partition

    try:
        link.forget(run_dir, stopped)
    except (VmlaunchError, OSError) as exc:  # a record only: never worth keeping a lab up for
        log.debug("the link records of %s: %s", ", ".join(sorted(stopped)), exc)
    return partition.remove_table(run_dir) if whole_lab else []


def down(run_dir: RunDir, only: Sequence[str] = (), *, timeout: float = 10.0, force: bool = False,
         spec: str | os.PathLike[str] | None = None) -> bool:
    """Stop the lab's VMs (or those named) and undo what `up` did; False when nothing was up.

    Keeps going when a step fails (a full or read-only run dir included) and reports every failure
    once at the end. With `force`, a journal that cannot be read whole is used for what can be read,
    and the rest is reported, and a lab up from another spec than `spec` is taken down anyway.
    """
    with locked(run_dir, timeout + 30):
        return take_down(run_dir, only, timeout=timeout, force=force, spec=spec)


def take_down(run_dir: RunDir, only: Sequence[str] = (), *, timeout: float = 10.0, force: bool = False,
              spec: str | os.PathLike[str] | None = None, settle: bool = True) -> bool:
    """`down`, for a caller that holds the lab's lock (a fork that rolls its clones back: `settle`
    False, it settles the fork itself)."""
    journal = Journal.load(run_dir, force=force)
    if spec is not None:
        journal.check_spec(spec, force=force)
    from vmlaunch.saved import snapshot

    snapshot.settle(run_dir, timeout + 30)  # a half-saved snapshot goes while QEMU can delete it
    if settle and not journal.unreadable and os.path.lexists(run_dir.forks):
        settle_fork(run_dir, timeout)  # a fork killed half-way: its clones go, its source runs
        journal = Journal.load(run_dir, force=force)
    if not journal.unreadable:  # what an `up` killed before journaling left (resources/registry.py)
        _release_unjournaled(run_dir, journal.has)
    known = set(journal.vms)  # whose files the run dir may hold
    journal_vms = set(known)
    if journal.empty and not journal.unreadable:
        _settle(journal, known)
        return False
    names = [name for name in journal.vms if not only or name in only]
    targets = {name: (qemu.find_pid(run_dir.vm(name), journal.vms[name].pid), run_dir.vm(name))
               for name in names}
    if run_dir.disk_faults.exists():  # held requests go first: a guest waiting on one cannot power off
        from vmlaunch.rig import diskfault

        diskfault.undo(run_dir, names, why="down", timeout=min(timeout, 5.0))
    stopped = qemu.stop_all(targets, timeout)
    lastrun.keep(run_dir, stopped)  # before the run dir, and the logs in it, go
    for name, how in stopped.items():  # a guest made to quit lost what it had not written: said louder,
        # unless --timeout 0 asked for just that
        unasked = timeout > 0 and how.startswith("quit (the guest did not")
        log.log(logging.WARNING if unasked else logging.INFO, "%s: %s", name, how)
        del journal.vms[name]
        if journal.vms:  # the lab stays up: this VM's files go now, as the run dir would
            _remove_files(run_dir.vm(name))
    failures: list[str] = []
    if stopped and run_dir.wire.exists():  # netem set at run time: its IFBs outlive the taps
        from vmlaunch.rig import netem

        failures += netem.undo_at_down(run_dir, run_dir.lab, list(stopped) if journal.vms else None)
    remaining_vms = set(journal.vms)
    if only:  # a lab on libvirt hosts: its other domains stay, and what they use
        remaining_vms |= {e.vm for e in journal.resources if e.kind == "remote-domain" and e.vm is not None
                          and e.vm not in only}
    failures += _undo_wire(run_dir, set(stopped), whole_lab=not remaining_vms)
    ctx = Context(lab=run_dir.lab)
    for entry in reversed(list(journal.resources)):
        if remaining_vms and (entry.vm is None or entry.vm in remaining_vms):
            continue  # still used by a VM that keeps running
        try:
            entry.record.undo(ctx, rollback=False)
            journal.resources.remove(entry)
        except UndoneWithError as exc:  # done as far as it goes: never again
            failures.append(str(exc))
            journal.resources.remove(entry)
        except VmlaunchError as exc:
            failures.append(str(exc))
        except OSError as exc:
            failures.append(f"{entry.record.describe()}: {exc.strerror or exc}")
    for line in journal.unreadable:  # only with force: anything else raised in load
        log.warning("not recognised, so not undone (check by hand): %s", line)
    if journal.unreadable and not journal.vms and not journal.resources:
        # The lab is down as far as the journal knows; what it could not say is found without it:
        # QEMUs by their pidfiles and command lines, taps by their mark, the lab's claims in the
        # host-wide registries (stale now, released like those of a killed `up`).
        from vmlaunch.runtime import salvage

        known |= salvage.vm_names(run_dir)  # their files go with the run dir
        left = salvage.take_down(run_dir, journal_vms, timeout)
        if left:
            raise RuntimeFailure("down --force could not take everything down; still there:\n"
                                 + "\n".join(left), f"the journal is kept in {run_dir}; stop "
                                 "what is listed by hand, then run down --force again")
    failures += _settle(journal, known)
    if failures:
        raise RuntimeFailure("down could not undo everything:\n" + "\n".join(failures),
                             f"the journal is kept in {run_dir}; run down again after fixing it"
                             if run_dir.path.exists() else None)
    return True


def settle_fork(run_dir: RunDir, timeout: float = 10.0, *, why: str | None = None) -> list[str]:
    """Undo a `vmlaunch fork` that was killed half-way (its book still says a fork is under way, and the
    caller holds the lab's lock, so the vmlaunch doing it is gone), or that fails (`why`): its source
    first (a save still under way cancelled; resumed if the fork had paused it), then its clones
    taken down (QEMU, taps, copies, pins), a clone folder made before it was journaled removed, its
    saved state removed; the fork is struck from the book last, so a command killed meanwhile leaves
    it for the next one. Returns what was done, one line each, also said as warnings."""
    from vmlaunch.resources.clone import BookError, read_book, write_book

    try:
        book = read_book(run_dir)
    except BookError as exc:
        log.warning("%s", exc)
        return []
    forking = book.forking
    if forking is None or (forking.pid == os.getpid() and why is None):
        return []  # none, or this process's own fork, which takes a failing clone down (--keep-going)
    what = why or f"a fork of {forking.source} was interrupted (vmlaunch pid {forking.pid} is gone)"
    said = _settle_source(run_dir, forking.source, forking.paused)
    journal = Journal.load(run_dir)
    clones = [name for name in forking.clones if name in journal.vms
              or any(entry.vm == name for entry in journal.resources)]
    if clones:
        try:
            take_down(run_dir, clones, timeout=0, settle=False)  # copies of a moment ago: nothing to save
            said.append(f"{what}: {', '.join(clones)} taken down")
        except VmlaunchError as exc:  # what is left stays journaled: the lab's `down` tries again
            said.append(f"{what}: {', '.join(clones)} not all taken down: {exc}")
    if forking.lab_dir is not None:
        from vmlaunch.resources.clone import CloneRecord

        journal = Journal.load(run_dir)
        for name in forking.clones:  # a folder made but not journaled (the fork names around any other)
            if name not in journal.vms and not any(e.vm == name for e in journal.resources):
                CloneRecord(name, run_dir.path, Path(forking.lab_dir), run_dir.lab).undo(
                    Context(lab=run_dir.lab), rollback=True)
    for path in (run_dir.fork_state, run_dir.fork_memory):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    book = read_book(run_dir)
    write_book(run_dir, attrs.evolve(book.without(set(forking.clones)), forking=None))
    for line in said:
        log.warning("%s", line)
    return said


MIGRATING = ("setup", "active", "cancelling", "pre-switchover", "device", "wait-unplug")


def _settle_source(run_dir: RunDir, source: str, paused: bool) -> list[str]:
    """The source of a fork that is settled: a save still under way cancelled (and waited for), then
    resumed if the fork had paused it; paused by its user, its disks back (a saved VM's are handed
    over until it runs) and paused still."""
    journal = Journal.load(run_dir)
    pid = qemu.find_pid(run_dir.vm(source), journal.vms[source].pid) if source in journal.vms else None
    if pid is None:
        return []
    try:
        with QuickQmp(run_dir.vm(source).qmp, 5.0) as qmp:
            with contextlib.suppress(VmlaunchError):
                qmp.cmd("migrate_cancel")
            with contextlib.suppress(TimedOut):
                wait_until(lambda: qmp.cmd("query-migrate").get("status") not in MIGRATING or None,
                           10.0, interval=0.02)
            state = qmp.cmd("query-status").get("status")
            if paused and state in ("paused", "postmigrate"):
                qmp.cmd("cont")
                return [f"{source}: resumed (the fork had paused it)"]
            if state == "postmigrate":
                qmp.cmd("cont")
                qmp.cmd("stop")
    except VmlaunchError as exc:
        return [f"{source}: could not be resumed ({exc}): `vmlaunch resume SPEC {source}`"]
    return []
