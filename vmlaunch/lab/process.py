"""QEMU processes: start them detached and paused, find them again, stop them.

Coverage: the paths for a signal while QEMUs start are exercised by tests/test_e2e.py, whose
vmlaunch runs in a subprocess that the in-process coverage figure does not see.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vmlaunch.compile.plan import VmPlan
from vmlaunch.core.signals import held
from vmlaunch.core.textsafe import printable
from vmlaunch.core.wait import TimedOut, wait_until, wait_until_async
from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.rundir import VmFiles, open_in_run_dir
from vmlaunch.qemu.opts import escape
from vmlaunch.qemu.qmp import AsyncQmp, QmpError

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)


class QemuFailed(RuntimeFailure):
    """QEMU refused to start; carries its own error text and the command."""


START_TIMEOUT = 60.0  # seconds a QEMU has to initialise (answer QMP) before it counts as failed


def start(vms: Sequence[VmPlan], identities: Mapping[str, tuple[int, int]] | None = None,
          fds: Mapping[str, Sequence[int]] | None = None) -> dict[str, int]:
    """Start every VM at once, paused (`-S`); return name -> pid once each has initialised.

    The caller lets them run with `cont` once all are up: guests that boot while other QEMUs are still
    initialising slow those down (ten at once on two cores: 0.96 s running, 0.37 s paused).

    `identities`: VM -> (uid, gid) its QEMU drops to once it has opened what it needs (`-runas`,
    host/confine.py). `fds`: VM -> the descriptors its QEMU inherits (those its argv's `-add-fd` names),
    at the same numbers. QEMU is not told to -daemonize (its sandbox forbids the fork): it is started in a
    session of its own, detached from vmlaunch's terminal, and counts as initialised once it answers
    on its QMP socket. A QEMU that exits first failed, with its own message (kept in the run dir);
    the others that did start are then killed before QemuFailed is raised.
    """
    identities = identities or {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    argvs: dict[str, list[str]] = {}
    try:
        for vm in vms:
            identity = identities.get(vm.name)
            runas = ["-runas", f"{identity[0]}:{identity[1]}"] if identity else []
            argvs[vm.name] = [*vm.argv, "-S", *runas]
            stderr = open_in_run_dir(vm.files.stderr_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                # umask 077: the QMP and console sockets QEMU creates are for their owner only.
                procs[vm.name] = subprocess.Popen(argvs[vm.name], stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL, stderr=stderr, umask=0o077,
                                                  cwd="/", start_new_session=True,
                                                  pass_fds=tuple((fds or {}).get(vm.name, ())))
            finally:
                os.close(stderr)
        failures = []
        pids = {}
        for vm in vms:
            proc = procs[vm.name]
            code = _initialised(vm.files, proc)
            if code is None:  # its pidfile names QEMU itself, were it started through a wrapper
                written = read_pid(vm.files)
                ours = written is not None and is_our_qemu(written, vm.files)
                pids[vm.name] = written if ours and written is not None else proc.pid
            else:
                text = printable(messages(vm.files)).strip()
                failures.append(f"{vm.name}: QEMU exited with status {code}: "
                                f"{text or '(no message)'}\n"
                                f"  command: {shlex.join(argvs[vm.name])}")
    except BaseException:
        with held():
            _kill_started(vms, procs)
        raise
    if failures:
        kill_all(list(pids.values()))
        raise QemuFailed("\n".join(failures))
    return pids


def _initialised(files: VmFiles, proc: subprocess.Popen[bytes]) -> int | None:
    """None once the QEMU answers a QMP command; its exit status when it exits first (a status of -1:
    it did neither within START_TIMEOUT, and was killed).

    Not its greeting: QEMU 7.2 greets on the QMP socket before it initialises the machine (a missing
    initrd fails it after). A command is answered by its main loop, once start-up is done and, with
    -runas, root dropped."""
    from vmlaunch.qemu.qmp import QuickQmp

    def ready() -> int | bool | None:
        code = proc.poll()
        if code is not None:
            return code
        if not os.path.lexists(files.qmp):  # not bound yet (`up` removed a stale one): looked at again
            return None
        try:
            with QuickQmp(files.qmp, timeout=2.0):  # greeting, then qmp_capabilities answered
                return True
        except (QmpError, OSError, ValueError):
            return None

    try:  # every millisecond: a look costs microseconds, and `up` waits for nothing else here
        result = wait_until(ready, START_TIMEOUT, interval=0.001)
    except TimedOut:
        proc.kill()
        proc.wait()
        return -1
    return None if result is True else int(result)


def _kill_started(vms: Sequence[VmPlan], procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Interrupted while QEMUs were starting: kill them, wait for each, then every process serving one
    of these VMs (a wrapper's child)."""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    for proc in procs.values():
        proc.wait()
    kill_serving([vm.files for vm in vms if vm.name in procs])


def kill_serving(vms: Sequence[VmFiles]) -> None:
    """Kill every process serving one of these VMs, found by command line until a scan finds none:
    a daemonizing QEMU forks twice, and a fork that raced one scan shows in the next."""
    for _ in range(10):
        found = [pid for files in vms for pid in scan(files)]
        if not found:
            return
        kill_all(found)


def read_text(path: Path, tail: int | None = None) -> str:
    """A file of the run dir as text ("" when missing), never read through a symlink; with `tail`, only
    its last `tail` bytes."""
    try:
        fd = open_in_run_dir(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, "rb") as f:
        if tail is not None and os.fstat(fd).st_size > tail:
            f.seek(-tail, os.SEEK_END)
        return f.read().decode(errors="replace")


# QEMU's run states of a VM whose guest never ran: started paused (-S) by an `up` that has not let it
# run yet, or that was killed before it did (or while it loaded a snapshot into it).
NEVER_RAN = ("prelaunch", "inmigrate", "restore-vm")


# What a Linux guest prints when it panics, and what it prints first when it boots (so a panic
# before a reboot is not taken for the state of the guest that booted after it).
_PANIC = "Kernel panic - not syncing"
_BOOTED = "Linux version "


def console_panic(files: VmFiles, *, any_boot: bool = False) -> str | None:
    """The panic line on the VM's serial console when its guest panicked since it last booted (with
    `any_boot`, at any time this QEMU ran: a kernel told to reboot on a panic boots again), else
    None. QEMU knows of a panic only through a pvpanic device whose driver the guest loaded; the
    console tells of one at any instant, the first second of a boot included."""
    text = read_text(files.serial_log, tail=None if any_boot else 64 << 10)
    panic = text.find(_PANIC) if any_boot else text.rfind(_PANIC)
    if panic < 0 or (not any_boot and text.rfind(_BOOTED) > panic):
        return None
    line = text[panic:].splitlines()[0] if text[panic:] else _PANIC
    return " ".join(printable(line).split())[:200]


# What `guest_panic` says of a panic QEMU knows of (pvpanic) when the console shows none (a guest
# whose console is not the serial port).
PVPANIC_SAID = "QEMU reports the guest panicked (pvpanic: run state guest-panicked)"
IO_ERROR_SAID = ("QEMU paused it: a disk request failed (run state io-error; `vmlaunch logs SPEC --events` "
                 "says which)")


def guest_panic(files: VmFiles, *, ask_qemu: bool = True, any_boot: bool = False) -> str | None:
    """The panic line when the guest panicked since it last booted: from its console, else (with
    `ask_qemu`) QEMU's run state, which a pvpanic device sets; None when it did not, or QEMU does not
    answer within a second (busy, or gone: the caller's other checks say so)."""
    stuck = guest_stuck(files, ask_qemu=ask_qemu, any_boot=any_boot)
    return stuck if stuck != IO_ERROR_SAID else None


def guest_stuck(files: VmFiles, *, ask_qemu: bool = True, any_boot: bool = False) -> str | None:
    """Why the guest cannot go on: its panic (as `guest_panic`), or QEMU paused by a failed disk
    request (run state io-error: `vmlaunch resume` retries it, nothing else does)."""
    panic = console_panic(files, any_boot=any_boot)
    if panic is not None or not ask_qemu:
        return panic
    from vmlaunch.qemu.qmp import QuickQmp

    try:
        with QuickQmp(files.qmp, timeout=1.0) as qmp:
            state = qmp.cmd("query-status").get("status")
    except (RuntimeFailure, OSError, ValueError):
        return None
    return PVPANIC_SAID if state == "guest-panicked" else IO_ERROR_SAID if state == "io-error" else None


# What a Linux guest prints when its balloon driver can take no more pages, or when it starts killing
# its own processes: the balloon reached the guest's floor, and squeezing on would kill the guest.
OUT_OF_MEMORY = ("Out of puff", "invoked oom-killer", "Out of memory: Kill")


def console_size(files: VmFiles) -> int:
    """How many bytes the VM's console log holds (0 when there is none)."""
    try:
        return files.serial_log.stat().st_size
    except OSError:
        return 0


def console_line_since(files: VmFiles, since: int, marks: Sequence[str]) -> str | None:
    """The first console line, among what the guest printed after byte `since`, that holds one of
    `marks`, without its escapes; None when there is none."""
    size = console_size(files)
    if size <= since:
        return None
    text = read_text(files.serial_log, tail=min(size - since, 1 << 20))
    for line in text.splitlines():
        if any(mark in line for mark in marks):
            return " ".join(printable(line).split())[:160]
    return None


def messages(files: VmFiles) -> str:
    """What QEMU said: while starting (its stderr), then for the rest of its life (its -D log)."""
    return read_text(files.stderr_log) + read_text(files.qemu_log)


def read_pid(files: VmFiles) -> int | None:
    try:
        return int(read_text(files.pidfile).strip())
    except (OSError, ValueError, RuntimeFailure):
        return None


def scan(files: VmFiles) -> list[int]:
    """Every live process serving this VM's QMP socket: the QEMU, also before it wrote its pidfile."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and is_our_qemu(int(entry), files):
            pids.append(int(entry))
    return pids


def is_our_qemu(pid: int | None, files: VmFiles) -> bool:
    """True when `pid` is alive and is the QEMU serving this VM's QMP socket (unique per lab and VM):
    a stale pidfile's pid may since name another process, or another lab's VM of the same name."""
    if pid is None:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") + b" "
    except OSError:
        return False
    return f"path={escape(str(files.qmp))},".encode() in cmdline and alive(pid)


def find_pid(files: VmFiles, recorded: int | None = None) -> int | None:
    """The pid of the VM's QEMU if it runs: the recorded one, else the one in its pidfile, else one
    found by its command line (a vmlaunch killed while QEMU started recorded neither)."""
    if is_our_qemu(recorded, files):
        return recorded
    pid = read_pid(files)
    if is_our_qemu(pid, files):
        return pid
    if recorded is None:
        found = scan(files)
        return found[0] if found else None
    return None


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
    try:
        return wait_until(lambda: not alive(pid), timeout, interval=0.05)
    except TimedOut:
        return False


def kill_all(pids: Sequence[int]) -> None:
    """SIGKILL every one before waiting for any: an interruption while waiting leaves none running."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        wait_gone(pid, 5)


CHANNEL_CHUNK = 1 << 16  # bytes read at once from a command channel while its VM powers off
PROGRESS_AFTER = 2.0  # seconds before `down` says which VMs it still waits for, then every 5 s
PROGRESS_EVERY = 5.0


def stop_all(vms: Mapping[str, tuple[int | None, VmFiles]], timeout: float) -> dict[str, str]:
    """Stop VMs together, each the gentlest way that works: the ACPI power button (every guest gets
    `timeout` seconds, at the same time), then QMP quit, then SIGKILL. Returns name -> what worked.

    From 2 s on, a progress line says which VMs are still shutting down and at which step."""
    import asyncio

    steps: dict[str, str] = {}  # VM -> the step it is at, while it is not stopped yet

    async def stop_every() -> list[str]:
        reporter = asyncio.ensure_future(_report(steps, timeout))
        try:
            return list(await asyncio.gather(*(_stop(name, pid, files, timeout, steps)
                                               for name, (pid, files) in vms.items())))
        finally:
            reporter.cancel()

    return dict(zip(vms, asyncio.run(stop_every())))


async def _report(steps: dict[str, str], timeout: float) -> None:
    import asyncio
    import time

    start = time.monotonic()
    await asyncio.sleep(PROGRESS_AFTER)
    while True:
        waited = time.monotonic() - start
        for name, step in sorted(steps.items()):
            log.info("%s: still shutting down, %.0f s: %s", name, waited, step)
        await asyncio.sleep(PROGRESS_EVERY)


def unclean(timeout: float) -> str:
    """Why a guest that was running was made to quit, and what that cost: a guest stopped in the middle
    of its shutdown did not unmount its file systems (a journal replay, or fsck, at its next boot)."""
    return (f"the guest did not power off within {timeout:g} s, so its disks were not cleanly "
            "unmounted; give it longer with `vmlaunch down SPEC --timeout S`")


async def _stop(name: str, pid: int | None, files: VmFiles, timeout: float, steps: dict[str, str]) -> str:
    if pid is None or not is_our_qemu(pid, files):
        return "not running"
    qmp = AsyncQmp(files.qmp, timeout=2)
    listening: list[asyncio.Task[None]] = []
    try:
        steps[name] = "connecting to QMP"
        await qmp.connect()
        # A guest that cannot answer the power button (it panicked, or it is paused) is not waited for.
        state = (await qmp.cmd("query-status")).get("status")
        deaf = "the guest panicked" if state == "guest-panicked" or console_panic(files) else \
            f"the VM is {state}" if state != "running" else None
        if deaf is None:
            listening = await _listen_to_agents(files)
            await qmp.cmd("system_powerdown")
            steps[name] = f"the guest has {timeout:g} s to power off after the ACPI power button"
            if await wait_until_async(lambda: not alive(pid), timeout):
                return "powered off"
        steps[name] = f"QEMU was told to quit ({deaf or 'the guest did not power off'})"
        with contextlib.suppress(QmpError):
            await qmp.cmd("quit")
        if await wait_until_async(lambda: not alive(pid), 5):
            return f"quit ({deaf or unclean(timeout)})"
    except QmpError:
        pass
    finally:
        steps.pop(name, None)
        await qmp.close()
        await _stop_listening(listening)
    kill_all([pid])
    return "killed"


async def _listen_to_agents(files: VmFiles) -> list[asyncio.Task[None]]:
    """A client on each command channel socket of the VM while it powers off, reading what comes and
    dropping it. QEMU's guest agent with a reply for a client that went away (one given up, killed,
    or of an older vmlaunch, which greeted both agents and kept the first to answer: rig/agent.py)
    writes it again and again while no client is there
    (virtio-serial answers EAGAIN; qemu-ga's ga_channel_write_all retries at once), never back in its
    main loop: it cannot take the SIGTERM of the guest's shutdown, and systemd waits 90 s for it
    (`Job qemu-guest-agent.service/stop running`). With a client there the reply goes through."""
    import asyncio

    async def drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(CHANNEL_CHUNK):
                pass
        except OSError:
            pass
        finally:
            writer.close()

    tasks = []
    for path in (files.agent, files.qga):
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 1.0)
        except (OSError, asyncio.TimeoutError):
            continue  # no such channel (agent = false), or QEMU is not listening
        tasks.append(asyncio.ensure_future(drain(reader, writer)))
    return tasks


async def _stop_listening(tasks: Sequence[asyncio.Task[None]]) -> None:
    import asyncio

    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
