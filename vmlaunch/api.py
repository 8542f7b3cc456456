"""The Python API for test rigs; the CLI's up/down/status/logs/balloon/qmp, as objects.

    with vmlaunch.Lab("lab.toml") as lab:
        lab.vm("alpha").wait_for_console("ready", timeout=30)
        lab.vm("alpha").balloon(128 << 20)

A relative spec path is taken from the directory of the file that calls `Lab` (a test file, a
script), not from the working directory, so a test finds the spec beside it wherever pytest runs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from vmlaunch.compile.compiler import compile_lab
from vmlaunch.compile.plan import Plan
from vmlaunch.compile.preflight import load_checked
from vmlaunch.core.wait import TimedOut, wait_until
from vmlaunch.errors import Location, Problem, RuntimeFailure, SpecError, UsageError, VmlaunchError
from vmlaunch.guests.kernels import prepare as prepare_kernels
from vmlaunch.host.facts import detect_host
from vmlaunch.lab import running
from vmlaunch.layout.rundir import RunDir
from vmlaunch.runtime import control, executor
from vmlaunch.runtime.control import VmStatus

if TYPE_CHECKING:
    from vmlaunch.lab.events import Event
    from vmlaunch.rig.agent import Command, Result
    from vmlaunch.rig.guest import Guest
    from vmlaunch.spec.model import LabSpec

log = logging.getLogger("vmlaunch")

__all__ = ["Disk", "Lab", "Vm", "VmStatus", "run"]


def run(spec: str | os.PathLike[str], vm: str, cmd: Command, *, timeout: float | None = None,
        input: bytes | None = None, cold: bool = False, warm: bool = False, wait: float = 300.0,
        shares: Sequence[str] = (), wait_for: str | None = None) -> Result:
    """Run `cmd` in a throwaway VM made from `vm` of the spec, as `vmlaunch run SPEC VM -- CMD`, and
    return its Result (exit status, stdout, stderr): a string is run by the guest's shell, a list
    arrives as those words. From the VM's template when it has one (made now with `warm`, or where the
    VM says `template = true`), else cold (always with `cold`). `shares`: `DIR[:TARGET][:ro]` folders.
    Nothing is left afterwards. CommandTimedOut past `timeout`; RuntimeFailure (exit 6 in the CLI)
    when the guest panics; SpecError, UsageError as `Lab`. A relative `spec` is taken from the
    directory of the calling file."""
    from vmlaunch.runtime import throwaway
    from vmlaunch.spec.throwaway import parse_share

    base, base_is = _caller_base()
    path = _locate_spec(spec, base, base_is)
    model = load_checked(path, vms=[vm])
    model.select([vm])
    options = throwaway.Options(timeout=timeout, input=input, cold=cold, warm=warm, wait=wait,
                                shares=tuple(parse_share(text, Path.cwd()) for text in shares),
                                wait_for=wait_for)
    return throwaway.run(model, vm, cmd, options, detect_host(), spec=str(path),
                         wants_template=model.vm(vm).template).result


class Lab:
    """A lab from its spec. As a context manager: up on enter, down on exit, whatever happened."""

    def __init__(self, spec: str | os.PathLike[str], vms: Sequence[str] = (), *,
                 wait_for: str | None = None, timeout: float | None = None, wait_ssh: bool = False) -> None:
        """Read and check the spec, probe the host and compile the lab; nothing starts yet (a kernel
        that boots faster under TCG from its decompressed ELF is decompressed into the cache, once).

        A relative `spec` is taken from the directory of the calling file (the working directory
        from the REPL or `python -c`). `vms` limits the lab to those VMs (all when empty);
        `wait_for` and `timeout` are the defaults of `up` (`timeout`: 60 s, 600 s with `wait_ssh`,
        as the CLI). Raises SpecError (the spec is missing or
        wrong, or a file it names is: kernel, initrd, a disk without a size), HostError (the host
        cannot run it) or UsageError (no VM of such a name, or a lab on libvirt hosts, which the CLI
        brings up).
        """
        __tracebackhide__ = True  # pytest: a missing or wrong spec shows the test's line
        base, base_is = _caller_base()
        self.spec = _locate_spec(spec, base, base_is)
        self.spec_model = load_checked(self.spec, vms=vms)
        self.spec_model.select(vms)  # a UsageError for a VM the lab does not have
        if self.spec_model.hosts:  # not compiled into QEMUs of this machine, as it would run here
            raise UsageError(f"{self.spec}: lab {self.spec_model.name} runs on libvirt hosts "
                             f"({', '.join(host.name for host in self.spec_model.hosts)}), and the Python "
                             "API drives vmlaunch's own QEMUs on this machine",
                             "bring it up with `vmlaunch up` (the manual's \"Across several hosts\")")
        self.host = detect_host()
        kernels = prepare_kernels(self.spec_model, self.host, vms, build=True)  # once, into the cache
        self.plan: Plan = compile_lab(self.spec_model, self.host, vms, kernels=kernels,
                                      running=running.where_running(
                                          RunDir.of(self.host.run_root, self.spec_model.name),
                                          self.host.numa))
        self.only = tuple(vms)  # empty: the whole lab
        self.wait_for = wait_for
        self.timeout = timeout
        self.wait_ssh = wait_ssh

    def __repr__(self) -> str:
        return f"Lab({str(self.spec)!r}, vms={list(self.vms)!r})"

    @property
    def name(self) -> str:
        """The lab's name (`lab.name` in the spec)."""
        return self.spec_model.name

    @property
    def model(self) -> LabSpec:
        """The lab as its spec describes it, with the clones `fork` made that are up (VMs of the lab
        until they go down)."""
        from vmlaunch.runtime.members import members

        return members(self.spec_model)

    @property
    def vms(self) -> tuple[str, ...]:
        """The names of the VMs this Lab brings up and down, in spec order, then the clones that are
        up (a Lab made for some VMs, `vms=[...]`, has those and the clones it forked)."""
        planned = tuple(vm.name for vm in self.plan.vms)
        clones = [vm.name for vm in self.model.vms if vm.name not in planned
                  and (not self.only or vm.name in self.only)]  # a Lab of some VMs: the clones it made
        return (*planned, *clones)

    def fork(self, vm: str, count: int = 1, *, name: str | None = None, shared_memory: bool = False,
             keep_going: bool = False, same_identity: bool = False, timeout: float = 60.0) -> list[Vm]:
        """Fork the running VM `vm` into `count` clones, as `vmlaunch fork`: each runs on from this
        instant with an identity of its own, and is a VM of the lab (`Lab.vm`, `status`, `down`)
        until it goes down. `name`: their names, `{i}` being the number (default VM-1, VM-2, ...).
        Returns the clones. RuntimeFailure (nothing changed) when the VM cannot be forked; a fork
        that fails half-way is rolled back (with `keep_going`, a clone that fails alone is)."""
        from vmlaunch.runtime import fork

        made = fork.fork(self.spec_model, self.host, vm, count, pattern=name, shared_memory=shared_memory,
                         keep_going=keep_going, same_identity=same_identity, timeout=timeout)
        if self.only:  # a Lab of some VMs drives (and takes down) the clones it made too
            self.only = (*self.only, *(each.name for each in made))
        return [Vm(self, each.name) for each in made]

    @property
    def run_dir(self) -> RunDir:
        """The lab's run dir (sockets, logs, journal); see the manual's Files page."""
        return self.plan.run_dir

    def up(self, wait_for: str | None = None, timeout: float | None = None,
           wait_ssh: bool | None = None, parallel: int | None = None) -> None:
        """Bring the VMs up, as `vmlaunch up`: return when each runs and answers QMP (and, with
        `wait_for`, has printed it on its console; with `wait_ssh`, as `--wait ssh`, when each VM
        with an SSH port answers SSH and its cloud-init is done). VMs already running are left alone.
        While it waits, at most `parallel` VMs boot at once (as `up --parallel`; default: as many as
        the host's CPUs can boot, or the lab's `boot_parallel`).

        Raises RuntimeFailure or HostError; whatever this call did is undone first.
        """
        from vmlaunch.host.confine import warn_if_off

        warn_if_off(self.host)
        wait_ssh = wait_ssh if wait_ssh is not None else self.wait_ssh
        if timeout is None:
            timeout = self.timeout if self.timeout is not None else executor.default_timeout(wait_ssh)
        from vmlaunch.guests.shareaccess import require_xattrs

        require_xattrs(self.spec_model, [vm.name for vm in self.plan.vms])
        plan, model = self.plan, self.model
        if model is not self.spec_model:  # clones are up: the lab manager goes on watching them
            names = [vm.name for vm in self.plan.vms]
            kernels = prepare_kernels(model, self.host, names, build=True)
            plan = compile_lab(model, self.host, names, kernels=kernels,
                               running=running.where_running(self.run_dir, self.host.numa))
        executor.up(plan, spec=str(self.spec_model.file), qemu_img=self.host.qemu.img,
                    wait_for=wait_for if wait_for is not None else self.wait_for,
                    timeout=timeout, wait_ssh=wait_ssh, parallel=_parallel(parallel))

    def down(self, timeout: float = 10.0) -> bool:
        """Stop the VMs and undo what `up` did, as `vmlaunch down`; returns False (and does nothing)
        when the lab is not up. Disk images are kept. Raises RuntimeFailure naming every step that
        failed (after trying them all)."""
        return executor.down(self.run_dir, self.only, timeout=timeout, spec=self.spec_model.file)

    def pause(self, timeout: float = 10.0) -> dict[str, str]:
        """Pause every VM of this Lab, as `vmlaunch pause`: VM -> "paused" or "already paused". A
        snapshot save or restore leaves them paused."""
        return control.pause(self.run_dir, self.vms, timeout)

    def resume(self, timeout: float = 10.0) -> dict[str, str]:
        """Resume every VM of this Lab, as `vmlaunch resume`: VM -> "resumed" or "already running".
        RuntimeFailure, and nothing resumed, when an interrupted snapshot restore holds one."""
        return control.resume(self.run_dir, self.vms, timeout)

    @contextlib.contextmanager
    def fresh(self, vm: str, *, cold: bool = False, warm: bool = True, wait: float = 300.0,
              wait_for: str | None = None) -> Iterator[Vm]:
        """A throwaway VM made from `vm`'s definition, as `vmlaunch run` makes one (never the lab's
        running VM, which is left alone): woken from its warm template (made on first use) unless
        `cold` (or `warm` False: from a template only where one is, or the VM's `template = true`);
        `wait_for`: the console text it is ready at (its template's ready point too).
        As a context manager: the running VM (`run`, `succeed`, `copy_to`, `console_output`...), then
        gone with everything it made when the block ends.

            with lab.fresh("alpha") as vm:
                vm.succeed("uname -r")
        """
        from vmlaunch.runtime import throwaway

        self.model.select([vm])
        options = throwaway.Options(cold=cold, warm=warm, wait=wait, wait_for=wait_for)
        started = throwaway.start(self.spec_model, vm, options, self.host, spec=str(self.spec),
                                  wants_template=self.spec_model.vm(vm).template)
        try:
            if started.warm:
                throwaway.set_clock(started)
            yield Vm(Lab._throwaway(started.lab, started.plan, self.host), vm)
        finally:
            throwaway.finish(started)

    @classmethod
    def _throwaway(cls, model: LabSpec, plan: Plan, host: Any) -> Lab:
        """The Lab of a throwaway VM that runs (`fresh`): its own lab, named run-..."""
        lab = cls.__new__(cls)
        lab.spec, lab.spec_model, lab.host, lab.plan = model.file, model, host, plan
        lab.only, lab.wait_for, lab.timeout, lab.wait_ssh = (), None, None, False
        return lab

    def vm(self, name: str) -> Vm:
        """The VM called `name`; UsageError when the spec has none, or this Lab was made for other
        VMs of it (`Lab(spec, vms=[...])`)."""
        self.model.select([name])
        if name not in self.vms:
            from vmlaunch.errors import UsageError

            raise UsageError(f"VM {name} is not one of this Lab's VMs ({', '.join(self.vms)})",
                             "make a Lab without vms=[...] to manage every VM of the lab")
        return Vm(self, name)

    def status(self) -> dict[str, VmStatus]:
        """Each VM's status by name: running, stopped or crashed, with pid, accelerator, balloon
        size and uptime when running, its NICs, its memory (`memory`: max, policy, the lab manager's
        target, actual, guest free) and the lab's (`lab_memory`: budget, actual, manager, KSM), as
        `vmlaunch status`."""
        return {row.name: row for row in control.status(self.run_dir, list(self.vms), self.model)}

    def collect(self, folder: str | os.PathLike[str], *, screenshots: bool = True) -> Path:
        """Save the evidence of this Lab's VMs into `folder` (made when missing) and return it: each
        VM's console log, QEMU's command line and messages, and a screenshot (`VM/serial.log`,
        `VM/qemu.log`, `VM/screen.png`), `status.json` (as `vmlaunch status --json`), `wire.json`
        (the faults set on the wire), `manager.log` (the lab manager's log), `events.jsonl` (the
        lab's event log), and `README.txt` listing what was saved and what could not be, and why.
        Never raises for a missing piece: after `down` it saves the logs of the last run; files are
        made new, never through a link standing in `folder`. OutputRefused (exit 73) when `folder`
        cannot be made or nothing could be saved in it. The pytest fixture calls it when a test
        fails."""
        from vmlaunch.runtime.evidence import collect

        return collect(self.run_dir, self.model, self.vms, Path(folder), screenshots=screenshots).folder

    def partition(self, *vms: str) -> list[list[str]]:
        """Cut `vms` off from the rest of the lab, as `vmlaunch partition SPEC VMS...`: on every
        network they share with other VMs (bridge networks on the host, in the lab's nftables table;
        socket networks in the guests, through the command channel), as one more group: a second
        call cuts another group off from this one and from the rest. Returns the groups now.
        UsageError for no VM, a VM named twice or one the lab does not have; RuntimeFailure when the
        lab is not up; HostError when the host has no nft."""
        from vmlaunch.rig import partition

        return partition.partition(self.run_dir, self.model, vms)

    def heal(self, *vms: str) -> list[list[str]]:
        """Put `vms` back with the rest of the lab (none: heal every cut), as `vmlaunch partition
        --heal`; returns the groups still cut off."""
        from vmlaunch.rig import partition

        return partition.heal(self.run_dir, self.model, vms)

    def manager_log(self) -> str:
        """The lab manager's log: every balloon target it set and why (`vmlaunch logs --manager`)."""
        return control.read_manager_log(self.run_dir)[0]

    def events(self, *vms: str) -> list[Event]:
        """The lab's event log (`vmlaunch logs --events`): what QEMU reported of its VMs (an I/O
        error, a pause, a panic, ...) and what vmlaunch did to them at runtime, oldest first; of
        `vms` only when named. After `down`, the last run's; RuntimeFailure when there is none."""
        self.model.select(vms)
        return control.read_events(self.run_dir, vms)[0]

    def __enter__(self) -> Lab:
        """`up()`, then the lab."""
        self.up()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """`down()`, whatever happened in the block. When the block raised, a failing `down` is
        logged, not raised, so the block's own error is the one seen."""
        try:
            self.down()
        except VmlaunchError as error:
            if exc is None:
                raise
            log.error("taking lab %s down failed: %s", self.spec_model.name, error)  # keep exc visible


class Vm:
    """One VM of a lab; `Lab.vm(name)` makes one. Its methods need the VM to be up."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab = lab
        self.name = name

    def __repr__(self) -> str:
        return f"<Vm {self.name} of lab {self.lab.name}>"

    @property
    def pid(self) -> int:
        """The QEMU process's pid; RuntimeFailure when the VM is not running."""
        return running.running_pid(self.lab.run_dir, self.name)

    def console_output(self) -> str:
        """Everything the serial console has printed so far (as `vmlaunch logs`); RuntimeFailure
        when there is no log (never up). After `down`, the output of its last run."""
        return control.read_log(self.lab.run_dir, self.name)

    def follow_console(self) -> Iterator[str]:
        """The serial console output as it comes (as `vmlaunch logs --follow`): an iterator of the
        output so far, then each new piece, until the VM stops. RuntimeFailure, on the first
        `next()`, when the VM is not running."""
        return control.follow_log(self.lab.run_dir, self.name)

    def wait_for_console(self, text: str, timeout: float = 30.0) -> str:
        """Wait until the serial console has printed `text`; return the output so far.

        RuntimeFailure when `timeout` seconds pass first, when the VM stops, or at once when its guest
        panics (its console shows a kernel panic, or QEMU's pvpanic device reports one), naming the
        panic line.
        """
        from vmlaunch.lab import process

        files = self.lab.run_dir.vm(self.name)
        asked = [0.0]  # when QEMU was last asked for its run state (a pvpanic panic): once a second

        def printed() -> str | None:
            output = self.console_output()
            if text in output:
                return output
            self.pid  # noqa: B018 - raises when the VM stopped: no point waiting on
            now = time.monotonic()
            ask = now - asked[0] >= 1.0
            if ask:
                asked[0] = now
            panic = process.guest_panic(files, ask_qemu=ask)
            if panic is not None:
                raise RuntimeFailure(f"{self.name}: the guest panicked before its console printed "
                                     f"{text!r}: {panic}", f"see {files.serial_log}")
            return None

        try:
            return wait_until(printed, timeout)
        except TimedOut:
            log_file = self.lab.run_dir.vm(self.name).serial_log
            raise RuntimeFailure(f"{self.name}: {text!r} did not appear on the console within "
                                 f"{timeout:g} s", f"see {log_file}") from None

    def balloon(self, size: int | None = None, timeout: float = 10.0) -> int:
        """Set the balloon target in bytes and wait for the guest, or read it; returns the size.

        RuntimeFailure when the VM has no balloon device or the guest does not get there within
        `timeout` seconds (the message says how far it got); UsageError for a size below 4 KiB.
        """
        memory = self.lab.model.vm(self.name).memory_mib << 20  # a larger target is refused at once
        return control.balloon(self.lab.run_dir, self.name, size, timeout, memory)

    def pause(self, timeout: float = 10.0) -> str:
        """Pause the VM, as `vmlaunch pause SPEC VM`: "paused" or "already paused"."""
        return control.pause(self.lab.run_dir, [self.name], timeout)[self.name]

    def resume(self, timeout: float = 10.0) -> str:
        """Resume the VM, as `vmlaunch resume SPEC VM`: "resumed" or "already running"; RuntimeFailure
        when an interrupted snapshot restore holds it paused (its memory may be half loaded)."""
        return control.resume(self.lab.run_dir, [self.name], timeout)[self.name]

    def link(self, nic: int | str, up: bool) -> int:
        """Set a NIC's link up or down, as `vmlaunch link SPEC VM NIC up|down` (QMP `set_link`: the
        guest sees its carrier go and come back; nothing passes while it is down). `nic`: its index,
        `nicN`, or the name of the network it is on. Returns the NIC's index. UsageError for a NIC
        the VM does not have; RuntimeFailure when the VM is not running."""
        from vmlaunch.rig.link import set_link

        return set_link(self.lab.run_dir, self.lab.model, self.name, nic, up)

    def disk(self, name: str | int) -> Disk:
        """One of the VM's disks, to break while it runs: `name` as `status --json` lists it ("disk0"
        is the image's overlay, then each [[disk]]: "disk1", ...), or its index.

            with lab.vm("db").disk("disk1").fail("write", sector=2048, once=True):
                ...  # the fault is cleared when the block ends
        """
        return Disk(self, name)

    def qmp(self, command: str, **args: Any) -> Any:
        """Send one QMP command with `args` as its arguments; return QEMU's reply (`return`).

        `vm.qmp("query-status")["status"]`. Raises QmpError (a RuntimeFailure) when QEMU answers
        with an error.
        """
        return control.qmp_command(self.lab.run_dir, self.name, command, args)

    def netem(self, nic: int | str, *, delay: float | str | None = None, jitter: float | str | None = None,
              loss: float | str | None = None, rate: str | None = None, corrupt: float | str | None = None,
              duplicate: float | str | None = None, reorder: float | str | None = None,
              where: str = "auto", clear: bool = False, timeout: float = 30.0) -> dict[str, Any]:
        """Set the kernel's netem on one NIC (its index, "nicN" or its network's name), as `vmlaunch
        netem SPEC VM NIC ...`, replacing what it had; with `clear`, clear it. Returns what is now set:
        the figures in fixed units (delay_ms, jitter_ms, loss, corrupt, duplicate, reorder in percent,
        rate_bit) and "where" ("host" or "guest"); {} once cleared.

        delay and jitter: milliseconds, or text with a unit ("20ms"); percentages 0-100 (30 or "30%");
        rate: text with tc's unit ("10mbit"). Delay, jitter, loss, corrupt, duplicate and reorder apply
        to what the NIC sends (once per round trip), rate to each direction. UsageError for a bad
        figure, HostError where netem cannot run (`where="host"` on a kernel without netem, a guest
        without tc or netem).
        """
        from vmlaunch.lab import wire
        from vmlaunch.rig import netem
        from vmlaunch.spec.netem import parse_netem

        index = wire.resolve_nic(self.lab.model, self.name, str(nic))
        given = {"delay": delay, "jitter": jitter, "loss": loss, "rate": rate, "corrupt": corrupt,
                 "duplicate": duplicate, "reorder": reorder}
        if clear:
            if any(value is not None for value in given.values()):
                raise UsageError("netem(clear=True) takes no figures")
            netem.clear_netem(self.lab.run_dir, self.lab.model, self.name, index, timeout=timeout)
            return {}
        parsed, problems = parse_netem({**given, "where": where}, bare_ms=True)
        if parsed is None:
            said = "; ".join(f"{key}: {message}" if key else message for key, message, _ in problems)
            raise UsageError(said, problems[0][2])
        return netem.set_netem(self.lab.run_dir, self.lab.model, self.name, index, parsed, timeout=timeout)

    def screenshot(self, path: str | os.PathLike[str]) -> Path:
        """Save the VM's screen as a PNG at `path` (replaced atomically; a relative path is taken from
        the working directory) and return its absolute path. The screen is the VM's display device
        (`video` in the spec, VGA by default). RuntimeFailure when the VM is not running or has no
        screen (`video = "none"`)."""
        from vmlaunch.compile.compiler import video_of
        from vmlaunch.rig import screen
        from vmlaunch.spec.model import Video

        if video_of(self.lab.model, self.lab.model.vm(self.name)) is Video.NONE:
            raise screen.no_screen(self.name)
        return screen.screenshot(self.lab.run_dir, self.name, Path(path))

    def send_keys(self, *keys: str, text: str | None = None, hold_ms: int | None = None) -> None:
        """Press keys on the VM's keyboard, as QMP `send-key`: each of `keys` is one combination of
        QEMU's key names (qcodes) joined by `-`, pressed together: `vm.send_keys("ctrl-alt-delete")`,
        `vm.send_keys("alt-f2", "ret")`; common aliases are known (enter, esc, del, space, super).
        `text` is then typed as keys of a US keyboard, shift for capitals and symbols:
        `vm.send_keys(text="root\n")`. Each key is held `hold_ms` (QEMU's 100 ms by default).
        UsageError naming an unknown key or a character a US keyboard cannot type (nothing is sent
        then); RuntimeFailure when the VM is not running. Returns once QEMU has queued the keys."""
        from vmlaunch.rig import screen

        if hold_ms is not None and (isinstance(hold_ms, bool) or not isinstance(hold_ms, int) or hold_ms < 1):
            raise UsageError(f"hold_ms: {hold_ms!r} is not a number of milliseconds (1 or more)")
        screen.send_keys(self.lab.run_dir, self.name, screen.keys_to_send(keys, text), hold_ms)

    def status(self) -> VmStatus:
        """This VM's row of `Lab.status()`."""
        return self.lab.status()[self.name]

    def ssh(self, command: str | Sequence[str], *, check: bool = False, timeout: float | None = None,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `command` in the VM over SSH, as `vmlaunch ssh SPEC VM -- ...`; its output as text.

        A string runs through the guest's shell (`vm.ssh("ls /tmp | wc -l")`); a sequence of words
        arrives as those words (`vm.ssh(["printf", "%s", "two words"])`). `returncode` is the
        command's (255: SSH itself failed). `check=True` raises RuntimeFailure on a non-zero status.
        UsageError when the VM has no SSH port; RuntimeFailure when it is not running."""
        words = ["sh", "-c", command] if isinstance(command, str) else list(command)
        argv = running.ssh_argv_of(self.lab.run_dir, self.lab.model, self.name, words)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout,
                                  stdin=None if input is not None else subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeFailure(f"{self.name}: {words!r} did not finish within {timeout:g} s") from None
        if check and done.returncode != 0:
            raise RuntimeFailure(f"{self.name}: {words!r} exited with status {done.returncode}",
                                 done.stderr.strip()[-500:] or None)
        return done

    # ---- the command channel (rig/agent.py, rig/guest.py): no network or SSH needed

    def _guest(self, via: str | None) -> Guest:
        from vmlaunch.rig.guest import Guest

        if via not in (None, "agent", "qga", "ssh"):
            raise UsageError(f"via={via!r}: give \"ssh\" (or \"agent\", \"qga\"), or nothing for the "
                             "command channel")
        return Guest(self.lab.run_dir, self.name, self.lab.model, via)

    def run(self, cmd: Command, timeout: float | None = 60.0, *, input: bytes | None = None,
            via: str | None = None) -> Result:
        """Run `cmd` in the guest; its `Result(exit_code, stdout, stderr)`, outputs as bytes.

        A string runs through the guest's shell (`vm.run("ls /tmp | wc -l")`), a list is argv
        (`vm.run(["printf", "%s", "two words"])`). It goes through the command channel (`agent`), which
        needs neither the guest's network nor SSH; `via="ssh"` goes through SSH instead. `input` is the
        command's stdin. Each output keeps its first 64 MiB (`truncated` says when there was more).

        Raises CommandTimedOut (exit 124 at the CLI; `.result` holds the output so far) when the command
        outlives `timeout` seconds (None: no limit): it is killed in the guest with its process group.
        AgentError (exit 5) when the VM has no channel, no agent answers within 60 s, or the channel
        closes or hangs."""
        return self._guest(via).run(cmd, timeout=timeout, input=input)

    def succeed(self, cmd: Command, timeout: float | None = 60.0, *, via: str | None = None) -> str:
        """Run `cmd`; its standard output as text. CommandFailed (a RuntimeFailure; `.result` holds the
        exit status and both outputs, which the message shows) when it exits with another status than 0."""
        return self._guest(via).succeed(cmd, timeout)

    def fail(self, cmd: Command, timeout: float | None = 60.0, *, via: str | None = None) -> str:
        """Run `cmd`, which must fail: its standard output; CommandFailed when it exits 0."""
        return self._guest(via).fail(cmd, timeout)

    def wait_until_succeeds(self, cmd: Command, timeout: float = 900.0, *, via: str | None = None) -> str:
        """Run `cmd` every half second until it exits 0; its standard output. CommandFailed with the
        last try's status and output when `timeout` seconds pass first."""
        return self._guest(via).wait_until_succeeds(cmd, timeout)

    def wait_for_unit(self, unit: str, timeout: float = 900.0, *, via: str | None = None) -> None:
        """Wait until the systemd unit `unit` is active in the guest. A unit that fails ends the wait at
        once: CommandFailed carrying the tail of its journal."""
        self._guest(via).wait_for_unit(unit, timeout)

    def wait_for_port(self, port: int, timeout: float = 900.0, *, via: str | None = None) -> None:
        """Wait until something listens on TCP `port` inside the guest (any address)."""
        self._guest(via).wait_for_port(port, timeout)

    def copy_to(self, host_path: str | os.PathLike[str], guest_path: str, *, timeout: float | None = 600.0,
                via: str | None = None) -> str:
        """Copy a file or folder of the host into the guest, as `cp -r` (into `guest_path` when it is a
        folder there); modes kept, the copies owned by root. Returns the guest path written."""
        return self._guest(via).copy_to(host_path, guest_path, timeout)

    def copy_from(self, guest_path: str, host_path: str | os.PathLike[str], *, timeout: float | None = 600.0,
                  via: str | None = None) -> Path:
        """Copy a file or folder of the guest to the host, as `cp -r`; modes kept less setuid and setgid
        bits, links only inside the copy, no device nodes (the guest is not trusted). Returns the host
        path written."""
        return self._guest(via).copy_from(guest_path, host_path, timeout)

    def wait_ssh(self, timeout: float = 600.0) -> None:
        """Wait until the VM answers SSH and its cloud-init is done (as `up --wait ssh`)."""
        from vmlaunch.lab.journal import Journal

        plan = self.lab.plan.vm(self.name)
        entry = Journal.load(self.lab.run_dir).vms.get(self.name)
        if plan.ssh_user is None:
            raise running.no_ssh(self.lab.model, self.name)
        if entry is None or entry.ssh_port is None:
            raise RuntimeFailure(f"VM {self.name} is not up with an SSH port", "`up` it first")
        executor.wait_for_ssh(self.lab.plan, [plan], {self.name: self.pid},
                              {self.name: entry.ssh_port}, timeout)


def _caller_base() -> tuple[Path, str]:
    """Where a relative spec path is taken from, and how to say so: the directory of the file of the
    first caller outside vmlaunch, or the working directory when that code has no file (the REPL,
    `python -c`, a notebook cell)."""
    frame = sys._getframe(1)
    while _in_vmlaunch(frame.f_globals.get("__name__")) and frame.f_back is not None:
        frame = frame.f_back
    file = frame.f_code.co_filename
    if _in_vmlaunch(frame.f_globals.get("__name__")) or not os.path.isfile(file):
        return Path.cwd(), "the working directory, as the caller has no file"
    file = os.path.abspath(file)
    return Path(file).parent, f"the directory of the calling file, {file}"


def _in_vmlaunch(module: object) -> bool:
    return isinstance(module, str) and (module == "vmlaunch" or module.startswith("vmlaunch."))


def _locate_spec(spec: str | os.PathLike[str], base: Path, base_is: str) -> Path:
    """`spec` as an absolute path, a relative one taken from `base`.

    A missing spec is a SpecError naming the full path looked at; any other problem with the file
    is `read_spec`'s to report.
    """
    __tracebackhide__ = True  # pytest: the test's line, not vmlaunch's frames
    given = Path(spec)
    if given.is_absolute():
        return Path(os.path.normpath(given))
    path = Path(os.path.normpath(base / given))
    try:
        os.lstat(path)
    except FileNotFoundError:
        problem = Problem(Location(path, 1), f"cannot read the spec: {os.strerror(errno.ENOENT)}",
                          _missing_hint(given, base, base_is))
        raise SpecError([problem]) from None
    except (OSError, ValueError):
        pass  # not a missing file: read_spec says what it is
    return path


def _missing_hint(given: Path, base: Path, base_is: str) -> str:
    taken_from = f"a relative spec path is taken from {base_is}"
    try:
        beside_cwd = Path.cwd() / given
    except OSError:  # the working directory was removed
        return taken_from
    if beside_cwd != base / given and beside_cwd.is_file():
        return f"{taken_from}; the working directory has {beside_cwd}: pass that absolute path"
    return taken_from


def _parallel(parallel: int | None) -> int | None:
    if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1):
        raise UsageError(f"parallel: {parallel!r} is not a number of VMs (1 or more)")
    return parallel


class Disk:
    """A disk of a running VM, to break as `vmlaunch fault SPEC VM DISK ...` does (rig/diskfault.py).
    Each of `fail`, `hang`, `release` and `slow` returns the disk, which as a context manager clears
    every fault of the disk when the block ends, whatever happened in it. UsageError for a disk the VM
    does not have or a bad figure; RuntimeFailure (exit 3's) when the VM is not running."""

    def __init__(self, vm: Vm, name: str | int) -> None:
        self.vm = vm
        self.name = f"disk{name}" if isinstance(name, int) and not isinstance(name, bool) else str(name)

    def __repr__(self) -> str:
        return f"Disk({self.vm.name!r}, {self.name!r})"

    def _set(self, raw: dict[str, Any]) -> Disk:
        from vmlaunch.rig import diskfault
        from vmlaunch.spec.diskfault import parse_fault

        fault, problems = parse_fault({key: value for key, value in raw.items() if value is not None})
        if fault is None:
            key, message, hint = problems[0]
            raise UsageError(f"{raw['type']}: {key + ': ' if key else ''}{message}", hint or None)
        diskfault.set_fault(self.vm.lab.run_dir, self.vm.lab.model, self.vm.name, self.name, fault)
        return self

    @staticmethod
    def _op(op: str | None, read: bool, write: bool, flush: bool) -> dict[str, Any]:
        raw: dict[str, Any] = {"op": op}
        for word, on in (("read", read), ("write", write), ("flush", flush)):
            if on:
                raw[word] = True
        return raw

    def fail(self, op: str | None = None, *, read: bool = False, write: bool = False, flush: bool = False,
             sector: int | None = None, once: bool = False, errno: str = "EIO") -> Disk:
        """Requests of kind `op` ("read", "write" or "flush"; or read=/write=/flush=True) fail with
        `errno`, at `sector` (512 bytes, as the guest counts them) or every one; `once`: the first only."""
        return self._set({"type": "error", **self._op(op, read, write, flush), "sector": sector,
                          "once": once or None, "errno": errno})

    def hang(self, op: str | None = None, *, read: bool = False, write: bool = False) -> Disk:
        """Hold requests of kind `op` ("read" or "write") until `release`."""
        return self._set({"type": "hang", **self._op(op, read, write, False)})

    def slow(self, bps: str | None = None, *, iops: int | None = None,
             latency: int | str | None = None) -> Disk:
        """Throttle the disk: `bps` with a unit ("1M" is 1 MiB/s), `iops` requests a second, or one
        request every `latency` ms."""
        return self._set({"type": "slow", "bps": bps, "iops": iops, "latency": latency})

    def release(self) -> Disk:
        """Let the held requests go (UsageError when none is held)."""
        from vmlaunch.rig import diskfault

        diskfault.release(self.vm.lab.run_dir, self.vm.lab.model, self.vm.name, self.name)
        return self

    def clear(self) -> None:
        """Take every fault off the disk (holds released first)."""
        from vmlaunch.rig import diskfault

        diskfault.clear(self.vm.lab.run_dir, self.vm.lab.model, self.vm.name, self.name)

    def faults(self) -> list[dict[str, Any]]:
        """What is set on the disk now, as `vmlaunch fault SPEC --json` lists it."""
        from vmlaunch.rig import diskfault
        from vmlaunch.spec.diskfault import to_json

        found = diskfault.listing(self.vm.lab.run_dir).get(self.vm.name, {})
        return [to_json(fault) for fault in found.get(self.name, [])]

    def __enter__(self) -> Disk:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            self.clear()
        except VmlaunchError as error:  # the VM went down in the block: nothing is left to clear
            if exc is None and not isinstance(error, RuntimeFailure):
                raise
            log.debug("%s: not cleared: %s", self, error)
