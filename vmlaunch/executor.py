"""Carry a Plan out (`up`) and undo it (`down`).

`up` applies each host action through a resource that knows how to undo itself, all on one ExitStack:
any failure (or Ctrl-C) unwinds what this `up` did, in reverse. Each applied resource is journaled
in the state file at once, so `down` can undo it later from another process, after a crash too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vmlaunch import qemu, signals
from vmlaunch.errors import RuntimeFailure, VmlaunchError
from vmlaunch.plan import BindPci, CreateBridge, CreateImage, HostAction, Plan, VmPlan
from vmlaunch.state import State, locked

Say = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"vmlaunch: {message}", file=sys.stderr, flush=True)


def describe(plan: Plan, only: Sequence[str] = ()) -> Iterator[str]:
    """What `up` would do, for `--dry-run`: host actions with what exists now, then each argv."""
    import shlex

    yield f"lab {plan.lab}: run dir {plan.run_dir}"
    state = State.load(plan.run_dir)
    for action in plan.actions:
        yield f"  {action.describe()}{_already(action, state)}"
    running_now = running_vms(state)
    for vm in plan.vms:
        running = vm.name in running_now
        yield f"{vm.name}: {vm.accel.accel.value} ({vm.accel.reason}){' [running]' if running else ''}"
        yield f"  {shlex.join(vm.argv)} -daemonize -S  (then QMP cont)"


def _already(action: HostAction, state: State) -> str:
    kind, key = _identity(action)
    if state.has_resource(kind, key):
        return " [done]"
    if isinstance(action, CreateImage) and action.path.exists():
        return " [exists: kept]"
    return ""


def _identity(action: HostAction) -> tuple[str, str]:
    if isinstance(action, BindPci):
        return "pci", action.address
    if isinstance(action, CreateImage):
        return "image", str(action.path)
    if isinstance(action, CreateBridge):
        return "bridge", action.name
    return "tap", action.ifname


def _applied(action: HostAction, state: State, qemu_img: str | None,
             stack: contextlib.ExitStack) -> None:
    """Apply one action, journal it, and put its undo on the stack for a failing `up`."""
    kind, key = _identity(action)
    record = _apply(action, qemu_img)
    # The owning VM, so `down VM` keeps what other VMs still use; bridges belong to the lab.
    entry = {"kind": kind, "key": key, "vm": getattr(action, "vm", None), "record": record}
    stack.callback(_roll_back, entry, state)  # first: undone even if the journal cannot be written
    state.add_resource(entry)


def _roll_back(entry: dict[str, Any], state: State) -> None:
    _undo(entry, rollback=True)
    with contextlib.suppress(OSError):  # the run dir goes away after a failed up anyway
        state.drop_resource(entry)


def _apply(action: HostAction, qemu_img: str | None) -> dict[str, Any]:
    if isinstance(action, CreateImage):
        from vmlaunch.images import create_image

        return create_image(action, qemu_img or "qemu-img").to_json()
    if isinstance(action, BindPci):
        from vmlaunch.pci import bind

        return bind(action.address, action.driver).to_json()
    if isinstance(action, CreateBridge):
        from vmlaunch.netdev import ensure_bridge

        return ensure_bridge(action).to_json()
    from vmlaunch.netdev import create_tap

    return create_tap(action).to_json()


def _undo(entry: dict[str, Any], rollback: bool) -> None:
    """Undo one journaled resource. Images are only removed on a failed `up`: they hold user data."""
    kind, record = entry["kind"], entry["record"]
    if kind == "image":
        if rollback:
            from vmlaunch.images import ImageRecord, remove_image

            remove_image(ImageRecord.from_json(record))
    elif kind == "pci":
        from vmlaunch.pci import PciBinding, restore

        restore(PciBinding.from_json(record))
    elif kind == "bridge":
        from vmlaunch.netdev import BridgeRecord, remove_bridge

        remove_bridge(BridgeRecord.from_json(record))
    elif kind == "tap":
        from vmlaunch.netdev import TapRecord, remove_tap

        remove_tap(TapRecord.from_json(record))


def running_vms(state: State) -> dict[str, int]:
    found = {name: qemu.find_pid(state.run_dir, name, vm.get("pid")) for name, vm in state.vms.items()}
    return {name: pid for name, pid in found.items() if pid is not None}


def up(plan: Plan, *, spec: Path, qemu_img: str | None = None, wait_for: str | None = None,
       timeout: float = 60.0, say: Say = _stderr) -> dict[str, int]:
    """Make the plan real; return name -> pid of every VM of the plan now running."""
    umask = os.umask(0o077)  # the run dir, state file and logs are for their owner only
    try:
        return _up(plan, spec, qemu_img, wait_for, timeout, say)
    finally:
        os.umask(umask)


def _up(plan: Plan, spec: Path, qemu_img: str | None, wait_for: str | None, timeout: float,
        say: Say) -> dict[str, int]:
    with locked(plan.run_dir, timeout, say):
        plan.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(plan.run_dir, 0o700)
        state = State.load(plan.run_dir)
        state.spec = str(spec)
        already = running_vms(state)
        to_start = [vm for vm in plan.vms if vm.name not in already]
        if not to_start:
            say(f"lab {plan.lab}: every VM already runs")
            return already
        wanted = {vm.name for vm in to_start}
        actions = [a for a in plan.actions if not state.has_resource(*_identity(a))
                   and (not hasattr(a, "vm") or a.vm in wanted)]
        stack = contextlib.ExitStack()
        try:
            _check_pci(actions)
            for action in actions:
                _applied(action, state, qemu_img, stack)
            for vm in to_start:
                _clear_stale(vm)
                # Recorded before QEMU starts: a vmlaunch killed from here on leaves a state that
                # `down` finds the QEMU by (through the pidfile).
                state.vms[vm.name] = {"pid": None, "started": time.time(),
                                      "accel": vm.accel.accel.value}
            state.save()
            pids = qemu.start(to_start)
            stack.callback(qemu.kill_all, list(pids.values()))
            for vm in to_start:  # QEMU's daemonize sets umask 027; these are ours alone
                state.vms[vm.name]["pid"] = pids[vm.name]
                for path in (vm.qmp_socket, vm.console_socket, vm.serial_log):
                    with contextlib.suppress(FileNotFoundError):
                        os.chmod(path, 0o600)
            state.save()
            _wait_ready(to_start, pids, wait_for, timeout, say)
        except BaseException:
            with signals.held():  # a second Ctrl-C must not cut the rollback short
                try:
                    stack.close()
                finally:
                    for vm in to_start:
                        state.vms.pop(vm.name, None)
                    if state.empty:
                        shutil.rmtree(plan.run_dir, ignore_errors=True)
                    else:
                        state.save()
            raise
        stack.pop_all()  # success: keep everything for `down`
        return {**already, **pids}


def _check_pci(actions: Sequence[HostAction]) -> None:
    """Before anything changes: every device to pass through is in a viable IOMMU group."""
    binds = [a for a in actions if isinstance(a, BindPci)]
    if binds:
        from vmlaunch.pci import check_viable

        check_viable([a.address for a in binds], drivers={a.driver for a in binds})


def _clear_stale(vm: VmPlan) -> None:
    """Sockets and pidfiles a crashed QEMU left behind would make QEMU fail to bind."""
    for path in (vm.qmp_socket, vm.console_socket, vm.pidfile):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _wait_ready(vms: Sequence[VmPlan], pids: dict[str, int], wait_for: str | None,
                timeout: float, say: Say) -> None:
    """Every VM answers QMP and runs; with `wait_for`, every serial console has printed it."""
    deadline = time.monotonic() + timeout
    # They were started paused. Shake hands with every one first, then let them all run at once: a
    # guest that already boots slows down the handshakes still to come.
    with contextlib.ExitStack() as connections:
        qmps = {vm.name: connections.enter_context(
            qemu.QuickQmp(vm.qmp_socket, timeout=max(1.0, deadline - time.monotonic())))
            for vm in vms}
        for qmp in qmps.values():
            qmp.cmd("cont")
        for name, qmp in qmps.items():
            status = qmp.cmd("query-status")
            if status.get("status") != "running":
                raise RuntimeFailure(f"{name}: QEMU is {status.get('status')}, not running")
    if wait_for is None:
        return
    waiting = {vm.name: vm for vm in vms}
    last_progress = 0.0
    while waiting:
        for name, vm in list(waiting.items()):
            if wait_for in _read(vm.serial_log):
                say(f"{name}: ready ({wait_for!r} on the console)")
                del waiting[name]
            elif not qemu.alive(pids[name]):
                raise RuntimeFailure(f"{name}: QEMU exited before its console printed {wait_for!r}"
                                     f"{_tail(vm.serial_log)}{_tail(vm.run_dir / (name + '.stderr.log'))}")
        now = time.monotonic()
        if waiting and now >= deadline:
            tails = "".join(f"\n{name}:{_tail(vm.serial_log)}" for name, vm in sorted(waiting.items()))
            raise RuntimeFailure(f"timed out after {timeout:g} s waiting for {wait_for!r} on the "
                                 f"console of {', '.join(sorted(waiting))}; the last lines:{tails}")
        if waiting and now - last_progress >= 5:
            for name, vm in waiting.items():
                tail = _read(vm.serial_log).strip().splitlines()[-1:] or ["(no output yet)"]
                say(f"{name}: waiting for {wait_for!r}: {tail[0][:70]}")
            last_progress = now
        time.sleep(0.1)


def _tail(path: Path, lines: int = 5) -> str:
    """The end of a log, for an error message: a failed `up` removes the run dir it lives in."""
    text = _read(path).strip()
    return "".join(f"\n  | {line}" for line in text.splitlines()[-lines:]) if text else ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def down(run_dir: Path, only: Sequence[str] = (), *, timeout: float = 10.0,
         say: Say = _stderr) -> bool:
    """Stop the lab's VMs (or those named) and undo what `up` did; False when nothing was up.

    Keeps going when a step fails and reports every failure at the end.
    """
    with locked(run_dir, timeout + 30, say):
        state = State.load(run_dir)
        if state.empty:
            shutil.rmtree(run_dir, ignore_errors=True)
            return False
        names = [name for name in state.vms if not only or name in only]
        failures: list[str] = []
        for name in names:
            pid = qemu.find_pid(run_dir, name, state.vms[name].get("pid"))
            how = qemu.stop(pid, run_dir / f"{name}.qmp", timeout)
            say(f"{name}: {how}")
            del state.vms[name]
            state.save()
        remaining = set(state.vms)
        for entry in reversed(list(state.resources)):
            owner = entry.get("vm")
            if remaining and (owner is None or owner in remaining):
                continue  # still used by a VM that keeps running
            try:
                _undo(entry, rollback=False)
                state.drop_resource(entry)
            except VmlaunchError as exc:
                failures.append(str(exc))
        if state.empty:
            shutil.rmtree(run_dir, ignore_errors=True)
        if failures:
            raise RuntimeFailure("down could not undo everything:\n" + "\n".join(failures),
                                 f"the state is kept in {run_dir}; run down again after fixing it")
        return True
