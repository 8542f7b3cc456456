"""A network's up_script and down_script around each of its taps: run by vmlaunch, journaled like any
resource.

The KVM guide wires each tap with an ifup/ifdown pair that QEMU runs (`script=`, `downscript=`). QEMU
runs no downscript when it is killed, and a failing script shows only as QEMU failing to start. So
vmlaunch keeps owning its taps (tap.py) and runs a network's scripts itself:

- the up_script runs as `SCRIPT TAP` once the tap exists (on its bridge, for a bridge network), before
  QEMU starts. A failure (exit status, signal, timeout) fails `up` with the script's output and rolls it
  back. A claim is journaled before it starts: from then on its down_script runs exactly once, whether
  the up_script succeeded, failed half-way or was cut off by a crash;
- the down_script runs as `SCRIPT TAP` before the tap is removed, by `down` (whatever happened to QEMU)
  and by a failing `up`. The journal holds the script's path and environment as they were at `up`: a
  spec changed or removed since does not change what `down` runs. A failing down_script is reported
  (`down` exits 4) and never run again.

A script is run without a shell, argv `[SCRIPT, TAP]`, from its own folder, stdin /dev/null, its
output (stdout and stderr, in order) captured; with vmlaunch's environment less vmlaunch's own
`VMLAUNCH_*` settings, plus the NIC's (`ScriptEnv.variables`). It runs in a session of its own, with
no signal blocked; after SCRIPT_TIMEOUT seconds it is killed with everything it started in that
session, and it dies with the vmlaunch that runs it (PR_SET_PDEATHSIG), SIGKILL included. It is
code run as vmlaunch's user (root, to make taps), so it is refused, before anything changes and
again just before it runs, when another user than you or root could change it or a folder on its
path (`guests/diskfiles.py`'s rule, with no opt-in).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs

from vmlaunch.core.textsafe import printable
from vmlaunch.errors import HostError, RuntimeFailure
from vmlaunch.guests.diskfiles import DiskOrigin, Policy, Unsafe, check_owner, resolve
from vmlaunch.resources.base import Context, OfVm, Resource, UndoneWithError
from vmlaunch.resources.links import interface_name

log = logging.getLogger(__name__)

SCRIPT_TIMEOUT = 30.0  # seconds: wiring a tap takes milliseconds; `ovs-vsctl` waits 5 s for its daemon
OUTPUT_KEPT = 64 << 10  # the end of a script's output that a message may quote from
OUTPUT_LINES = 20  # lines of it a failure shows


class ScriptRefused(HostError):
    """A script vmlaunch will not run: another user could change it (exit 3)."""


class ScriptFailed(RuntimeFailure):
    """An up_script failed: its exit status or signal, or it timed out; with its output."""


@attrs.frozen
class ScriptEnv:
    """The NIC a script wires, as its `VMLAUNCH_*` variables tell it."""

    lab: str
    vm: str
    nic: int
    network: str
    tap: str = attrs.field(validator=interface_name)
    mac: str
    bridge: str | None = attrs.field(default=None, validator=interface_name)  # bridge networks only
    mtu: int | None = None  # the network's, when it sets one
    ip: str | None = None  # "10.10.0.11/24", when the NIC has a static address

    def variables(self, action: str) -> dict[str, str]:
        given = {"LAB": self.lab, "VM": self.vm, "NIC": str(self.nic), "NETWORK": self.network,
                 "TAP": self.tap, "MAC": self.mac, "ACTION": action, "BRIDGE": self.bridge,
                 "MTU": None if self.mtu is None else str(self.mtu), "IP": self.ip}
        return {f"VMLAUNCH_{key}": value for key, value in given.items() if value is not None}


@attrs.frozen
class ScriptRecord:
    """A NIC whose up_script started: what its down_script needs, kept from the `up` that ran it."""

    kind: ClassVar[str] = "script"

    network: str
    up_script: Path
    down_script: Path | None
    env: ScriptEnv

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Run the down_script, once: a failure is reported (UndoneWithError), never retried."""
        if self.down_script is None:
            return
        try:
            run_checked(self.down_script, self.env, "down", f"network {self.network}: down_script")
        except (ScriptFailed, ScriptRefused) as exc:
            raise UndoneWithError(exc.message, exc.hint) from None

    def describe(self) -> str:
        if self.down_script is None:
            return f"up_script {self.up_script} {self.env.tap} (network {self.network}; no down_script)"
        return f"down_script {self.down_script} {self.env.tap} (network {self.network}), to run"


@attrs.frozen
class ScriptClaim(OfVm):
    """Journaled just before an up_script starts, so that its down_script runs whatever happens next."""

    kind: ClassVar[str] = "script"

    record: ScriptRecord

    @property
    def key(self) -> str:
        return f"{self.record.env.tap} (starting)"

    @property
    def vm(self) -> str:
        return self.record.env.vm

    def describe(self) -> str:
        return f"up_script {self.record.up_script} {self.record.env.tap}: starting"

    def found(self) -> str | None:
        return None

    def apply(self, ctx: Context) -> ScriptRecord:
        return self.record


@attrs.frozen
class TapScript(OfVm):
    """Run a network's up_script for one NIC's tap (planned right after that tap)."""

    kind: ClassVar[str] = "script"

    network: str
    up_script: Path
    down_script: Path | None
    env: ScriptEnv
    origin: DiskOrigin | None = attrs.field(default=None, eq=False)  # the network, for messages

    @property
    def key(self) -> str:
        return self.env.tap

    @property
    def vm(self) -> str:
        return self.env.vm

    @property
    def record(self) -> ScriptRecord:
        return ScriptRecord(network=self.network, up_script=self.up_script, down_script=self.down_script,
                            env=self.env)

    def describe(self) -> str:
        down = f"; down_script {self.down_script}" if self.down_script else ""
        return f"up_script {self.up_script} {self.env.tap} for {self.env.vm} (network {self.network}{down})"

    def found(self) -> str | None:
        return None

    @staticmethod
    def preflight(resources: Sequence[Resource]) -> None:
        """Before anything changes: every script is one no other user can change."""
        problems: list[str] = []
        seen: set[Path] = set()
        for resource in resources:
            assert isinstance(resource, TapScript)
            for key, script in (("up_script", resource.up_script), ("down_script", resource.down_script)):
                if script is None or script in seen:
                    continue
                seen.add(script)
                try:
                    check_script(script)
                except Unsafe as problem:
                    where = f"{resource.origin.location(key)} " if resource.origin is not None else ""
                    problems.append(f"{where}{problem.message}"
                                    + (f" ({problem.plain_fix})" if problem.plain_fix else ""))
        if problems:
            raise ScriptRefused("\n".join(problems), REFUSED_HINT)

    def claim(self, ctx: Context) -> Resource | None:
        """With a down_script, the claim that makes it run even if this `up` dies in the up_script."""
        return ScriptClaim(self.record) if self.down_script is not None else None

    def apply(self, ctx: Context) -> ScriptRecord:
        run_checked(self.up_script, self.env, "up", f"network {self.network}: up_script")
        return self.record


REFUSED_HINT = ("vmlaunch runs only scripts that no user but you and root can change, by a path no "
                "other user can change either")


def check_script(script: Path) -> None:
    """Raise Unsafe when `script` is not a regular file that only you and root can change, by a path
    only you and root can change (guests/diskfiles.py's rule, with no opt-in)."""
    policy = Policy()
    found = resolve(script, policy)
    if found.stat is None:
        raise Unsafe(f"{script} does not exist")
    if not stat.S_ISREG(found.stat.st_mode):
        raise Unsafe(f"{script} is not a regular file")
    check_owner(script, found, policy)


@attrs.frozen
class ScriptRun:
    """How a script ended: its exit status (negative: the signal that killed it; None: timed out and
    killed, or never started: `error` says why) and the end of its output."""

    status: int | None
    output: str = ""
    error: str | None = None


def run_checked(script: Path, env: ScriptEnv, action: str, what: str,
                timeout: float = SCRIPT_TIMEOUT) -> None:
    """Check `script` again (it may have changed since `up` checked it) and run it; ScriptRefused or
    ScriptFailed, naming `what` and quoting the script's output, unless it exits 0."""
    shown = f"{what} `{script} {env.tap}`"
    try:
        check_script(script)
    except Unsafe as problem:
        fix = f" ({problem.plain_fix})" if problem.plain_fix else ""
        raise ScriptRefused(f"{shown} not run: {problem.message}{fix}", REFUSED_HINT) from None
    done = run_script(script, env.tap, environment(env.variables(action)), timeout=timeout)
    if done.status == 0:
        if done.output.strip():
            log.debug("%s said:%s", shown, quoted(done.output))
        return
    if done.error is not None:
        raise ScriptFailed(f"{shown} cannot be run: {done.error}",
                           "a script starts with a #! line (#!/bin/sh) and is executable")
    if done.status is None:
        why = f"did not finish within {timeout:g} s, so it was killed, with what it started"
    elif done.status < 0:
        why = f"was killed by {_signal_name(-done.status)}"
    else:
        why = f"failed with exit status {done.status}"
    said = f"; its output:{quoted(done.output)}" if done.output.strip() else " (it printed nothing)"
    raise ScriptFailed(f"{shown} {why}{said}")


def environment(variables: Mapping[str, str]) -> dict[str, str]:
    """vmlaunch's environment without its own VMLAUNCH_* settings (VMLAUNCH_RUN_DIR, ...), and the
    script's variables."""
    return {**{key: value for key, value in os.environ.items() if not key.startswith("VMLAUNCH_")},
            **variables}


def run_script(script: Path, tap: str, env: Mapping[str, str], *, timeout: float) -> ScriptRun:
    """Run `script TAP`; its output goes to a file, not a pipe, so a daemon it leaves running (holding
    the output open) never keeps us waiting. Interrupted (Ctrl-C), it is killed before we go on."""
    import subprocess
    import tempfile

    in_child = _in_child()
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen([str(script), tap], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=script.parent, env=dict(env),
                                    start_new_session=True, preexec_fn=in_child)
        except OSError as exc:
            return ScriptRun(status=None, error=exc.strerror or str(exc))
        status: int | None
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            status = None
        except BaseException:
            _kill_session(proc)
            raise
        size = out.seek(0, os.SEEK_END)
        out.seek(max(0, size - OUTPUT_KEPT))
        return ScriptRun(status=status, output=out.read().decode(errors="replace"))


PR_SET_PDEATHSIG = 1  # prctl(2)


def _in_child() -> Any:
    """What runs in the script's process before exec (prepared here: nothing is loaded after fork).

    A rollback holds SIGINT, SIGTERM and SIGHUP (core/signals.py), and a blocked mask outlives exec: the
    script and what it runs must be able to receive them. And the script dies with the vmlaunch that
    runs it (PR_SET_PDEATHSIG): a vmlaunch killed with SIGKILL in an up_script leaves no script
    running on, half-way through wiring a tap that `down` removes (its down_script runs then, as the
    claim journaled before the script started says). What the script started in the background is
    its own business, as when it succeeds."""
    import ctypes

    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux's libc: without it
        prctl = None

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # vmlaunch died before that took effect
                os._exit(1)

    return run


def _kill_session(proc: Any) -> None:
    """Kill the script and every process of its session's group, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def quoted(output: str) -> str:
    """The end of a script's output, for a message: each line as `  | line`, without terminal escapes."""
    lines = [line for line in printable(output).rstrip().splitlines()][-OUTPUT_LINES:]
    return "".join(f"\n  | {line}" for line in lines)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
