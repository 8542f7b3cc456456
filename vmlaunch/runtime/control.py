"""Driving VMs that are up: status, balloon, raw QMP, the serial log and the interactive console."""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import stat
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vmlaunch.core.wait import TimedOut, wait_until
from vmlaunch.errors import RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.host.confine import Confinement
from vmlaunch.lab import events as event_log
from vmlaunch.lab import process as qemu
from vmlaunch.lab.events import IoError
from vmlaunch.lab.journal import Journal
from vmlaunch.lab.running import running_pid
from vmlaunch.layout import lastrun
from vmlaunch.layout.rundir import RunDir, VmFiles, open_in_run_dir
from vmlaunch.qemu.qmp import Qmp, QmpError, QuickQmp
from vmlaunch.resources.remote import RemoteDomainRecord

if TYPE_CHECKING:
    from vmlaunch.spec.model import LabSpec, VmSpec

log = logging.getLogger(__name__)
DETACH_KEY = b"\x1d"  # Ctrl-]


@attrs.frozen
class NicStatus:
    """One NIC of a VM as the spec gives it: where it is plugged and how the host reaches it."""

    index: int
    network: str
    type: str  # bridge | user | socket | tap
    mac: str
    model: str
    bridge: str | None = None  # bridge networks: the bridge and the VM's tap on it
    tap: str | None = None  # bridge and tap networks
    forwards: tuple[str, ...] = ()  # user networks: the host ports forwarded into the guest
    mcast: str | None = None  # socket networks: the multicast group:port
    address: str | None = None  # the static address cloud-init sets ("10.10.0.11/24")
    link: str = "up"  # "down" while `vmlaunch link ... down` holds it (rig/link.py)

    def describe(self) -> str:
        where = {"bridge": f"bridge {self.bridge}, tap {self.tap}", "tap": f"tap {self.tap}",
                 "socket": f"socket {self.mcast}"}.get(self.type, "user")
        forwards = f"; forwards {', '.join(self.forwards)}" if self.forwards else ""
        address = f" {self.address}" if self.address else ""
        link = ", link down" if self.link == "down" else ""
        return f"{self.mac}{address} {self.network} ({where}{forwards}){link}"


@attrs.frozen
class MemoryStatus:
    """A VM's memory, in bytes: what the spec allows, where the balloon is going and is, what the
    guest has free (from the balloon's statistics, None until the guest reports them)."""

    max: int  # `memory`
    policy: str | None  # "auto" (the lab manager sizes it), "manual"; None: no balloon
    min: int | None = None  # `balloon.min`, for policy auto
    target: int | None = None  # the target the lab manager set last (auto)
    actual: int | None = None  # the balloon's actual size: what the guest has
    guest_free: int | None = None  # stat-free-memory
    guest_available: int | None = None  # stat-available-memory
    ksm_merged: int | None = None  # bytes of its RAM KSM has merged with other pages (Linux 6.1+)


@attrs.frozen
class LabMemoryStatus:
    """The lab's memory: its budget, what its guests hold, what KSM saves on the host, its manager."""

    budget: int  # bytes: `lab.memory.budget`, else 80 % of the host's memory
    actual: int  # bytes: the sum of the running VMs' actual sizes
    manager: str  # "running (pid N)", "gone (`up` starts it again)", "none"
    ksm: dict[str, int] | None = None  # the host's KSM counters (run, pages_shared, pages_sharing, saved)
    ksm_merged: int | None = None  # bytes: the sum of the running VMs' ksm_merged
    ksm_setting: str = ""  # what the lab does with KSM: "on while the lab runs (...)", "off for the lab", ...


@attrs.frozen
class DiskStatus:
    """One disk of a VM as the guest sees it, in order: its name (QEMU's node and device id, which
    `vmlaunch fault` and `Vm.disk()` take), the spec key it comes from and what it is."""

    name: str  # disk0, disk1, ...: the image's overlay first, then each [[disk]]
    key: str  # "vm.a.image", "vm.a.disk[0]"
    file: str
    format: str
    bus: str
    readonly: bool
    on_error: dict[str, str]  # {"read": "report", "write": "enospc"}: QEMU's defaults where unset
    # what `vmlaunch fault` (or the spec's [[fault]]) set on it in the running QEMU, as `fault --json`
    faults: tuple[dict[str, Any], ...] = ()


@attrs.frozen
class VmStatus:
    name: str
    state: str  # running | stopped (not up) | off (up, the guest powered itself off) | crashed |
    # guest-panicked | unresponsive (its QMP does not answer) | paused | shutdown | internal-error |
    # starting (its guest never ran yet) | another of QEMU's run states
    pid: int | None = None
    accel: str | None = None
    balloon_bytes: int | None = None
    uptime: float | None = None
    nics: tuple[NicStatus, ...] = ()  # when the lab's spec was given
    ssh_port: int | None = None  # 127.0.0.1's port forwarded to the guest's SSH (`vmlaunch ssh`)
    memory: MemoryStatus | None = None  # when the lab's spec was given
    lab_memory: LabMemoryStatus | None = None  # the same for every VM of the lab: `status --json` stays
    # keyed by VM name
    run_state: str | None = None  # QEMU's own (QMP query-status), when it answered
    why: str | None = None  # what makes `state` other than running: the panic line, QEMU's run state
    uid: int | None = None  # the uid its QEMU runs as (host/confine.py: a uid of its own, as root)
    sandbox: bool | None = None  # its QEMU runs in a seccomp sandbox
    boot: dict[str, float] | None = None  # where its last boot's time went, by phase (lab/timeline.py)
    disks: tuple[DiskStatus, ...] = ()  # when the lab's spec was given
    io_error: IoError | None = None  # paused by a failed disk request (run state io-error): which
    forked_from: str | None = None  # a clone `vmlaunch fork` made: the VM it is a copy of

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def disks_of(lab: LabSpec, vm: VmSpec) -> tuple[DiskStatus, ...]:
    from vmlaunch.compile.compiler import boot_disks
    from vmlaunch.errors import format_key_path
    from vmlaunch.layout.labdir import LabDir

    lab_dir = LabDir.of(lab.file, lab.name)
    return tuple(
        DiskStatus(f"disk{index}", format_key_path(key), str(disk.file), disk.format.value, disk.bus.value,
                   disk.readonly, {"read": (disk.read_error.value if disk.read_error else "report"),
                                   "write": (disk.write_error.value if disk.write_error else "enospc")})
        for index, (key, disk) in enumerate(boot_disks(lab_dir, vm)))


def nics_of(lab: LabSpec, vm: VmSpec) -> tuple[NicStatus, ...]:
    from vmlaunch.core.naming import tap_name
    from vmlaunch.spec.model import BridgeNetwork, SocketNetwork, TapNetwork, UserNetwork

    nics = []
    for index, nic in enumerate(vm.nics):
        net = lab.network(nic.network)
        extra: dict[str, Any] = {}
        if isinstance(net, BridgeNetwork):
            extra = {"bridge": net.bridge, "tap": tap_name(lab.name, vm.name, index)}
        elif isinstance(net, TapNetwork):
            extra = {"tap": tap_name(lab.name, vm.name, index)}
        elif isinstance(net, UserNetwork):
            extra = {"forwards": tuple(net.forward)}
        elif isinstance(net, SocketNetwork):
            extra = {"mcast": f"{net.group}:{net.port}"}
        nics.append(NicStatus(index, net.name, net.type.value, nic.mac, nic.model.value, address=nic.ip,
                              **extra))
    return tuple(nics)


def status(run_dir: RunDir, names: Sequence[str], lab: LabSpec | None = None) -> list[VmStatus]:
    """Each VM of the lab: running, stopped (not up) or crashed (up, but its QEMU is gone); with the
    lab's spec, also each VM's NICs."""
    from vmlaunch.lab import wire
    from vmlaunch.rig import diskfault
    from vmlaunch.rig.link import link_of
    from vmlaunch.saved.intent import held_paused
    from vmlaunch.saved.snapshot import settle_unlocked
    from vmlaunch.spec.diskfault import to_json

    ongoing = settle_unlocked(run_dir)  # an interrupted snapshot save or restore: finished or undone
    journal = Journal.load(run_dir)
    held = held_paused(run_dir)
    if ongoing is not None:  # under way in another vmlaunch, which has the VMs' QMP meanwhile
        held = {vm: f"by vmlaunch: {ongoing.describe()} under way (pid {ongoing.pid})"
                for vm in ongoing.paused}
    busy = set(held) if ongoing is not None else set()
    faults = wire.load(run_dir)
    logged: list[event_log.Event] | None = None  # the lab's event log, read once if a VM needs it
    vms_managed = manager_state(run_dir).get("vms")
    managed: dict[str, Any] = vms_managed if isinstance(vms_managed, dict) else {}
    result: list[VmStatus] = []
    for name in names:
        nics = nics_of(lab, lab.vm(name)) if lab is not None else ()
        vm = journal.vms.get(name)
        spec_memory = memory_of(lab.vm(name), managed.get(name)) if lab is not None else None
        if vm is None:
            result.append(VmStatus(name, "stopped", nics=nics, memory=spec_memory))
            continue
        pid = qemu.find_pid(run_dir.vm(name), vm.pid)
        if pid is None:
            result.append(VmStatus(name, gone_state(run_dir.vm(name)), vm.pid, vm.accel, nics=nics,
                                   memory=spec_memory))
            continue
        balloon, stats, run_state, blocks = None, {}, None, None
        try:
            with QuickQmp(run_dir.vm(name).qmp, timeout=STATUS_QMP_TIMEOUT) as qmp:
                run_state = read_run_state(qmp)
                if run_state == IO_ERROR:
                    blocks = qmp.cmd("query-block")
                balloon = read_balloon(qmp)
                stats = guest_stats(qmp.cmd("qom-get", path=BALLOON, property="guest-stats"))
        except QmpError:
            pass  # no balloon device, or QMP busy: the rest of the status still holds
        io_error = None
        if run_state == IO_ERROR:
            if logged is None:
                logged = event_log.read(run_dir)
            io_error = io_error_of(event_log.latest_io_error(logged, name), failed_blocks(blocks))
        state, why = vm_state(run_dir.vm(name), run_state, held.get(name), busy=name in busy,
                              io_error=io_error)
        memory = None
        if spec_memory is not None:
            from vmlaunch.host.memory import ksm_merging

            memory = attrs.evolve(spec_memory, actual=balloon, guest_free=stats.get("stat-free-memory"),
                                  guest_available=stats.get("stat-available-memory"),
                                  ksm_merged=ksm_merging(pid))
        nics = tuple(attrs.evolve(nic, link=link_of(faults, name, nic.index, pid)) for nic in nics)
        confined = Confinement.of(pid)
        result.append(VmStatus(name, state, pid, vm.accel, balloon, time.time() - vm.started, nics,
                               vm.ssh_port, memory, run_state=run_state, why=why, uid=confined.uid,
                               sandbox=confined.seccomp, boot=vm.boot, io_error=io_error))
    if lab is not None:
        lab_memory = lab_memory_status(run_dir, lab, result)
        set_now = diskfault.listing(run_dir) if run_dir.disk_faults.exists() else {}

        def disks(name: str) -> tuple[DiskStatus, ...]:
            faults = set_now.get(name, {})
            return tuple(attrs.evolve(disk, faults=tuple(map(to_json, faults.get(disk.name, ()))))
                         for disk in disks_of(lab, lab.vm(name)))

        result = [attrs.evolve(row, lab_memory=lab_memory, disks=disks(row.name)) for row in result]
    if run_dir.forks.exists():
        from vmlaunch.resources.clone import BookError, read_book

        try:
            sources = {clone.name: clone.source for clone in read_book(run_dir).clones}
        except BookError:
            sources = {}
        result = [attrs.evolve(row, forked_from=sources.get(row.name)) for row in result]
    return result


BALLOON = "/machine/peripheral/balloon0"  # the balloon's QOM path (its id is balloon0)
IO_ERROR = "io-error"  # QEMU's run state of a VM a failed disk request paused (on_error "stop", "enospc")
STATUS_QMP_TIMEOUT = 2.0  # seconds `status` gives a VM's QMP to connect and answer each question


def read_run_state(qmp: QuickQmp | Qmp) -> str | None:
    """QEMU's run state ("running", "paused", "guest-panicked", ...), None when it cannot be read."""
    reply = qmp.cmd("query-status")
    state = reply.get("status") if isinstance(reply, dict) else None
    return state if isinstance(state, str) else None


def read_balloon(qmp: QuickQmp | Qmp) -> int | None:
    """The balloon's actual size in bytes, None when QEMU has no balloon or does not say (a VM whose
    snapshot job still runs may answer without it)."""
    reply = qmp.cmd("query-balloon")
    actual = reply.get("actual") if isinstance(reply, dict) else None
    return actual if isinstance(actual, int) and not isinstance(actual, bool) else None


def failed_blocks(blocks: Any) -> list[IoError]:
    """The disks QMP query-block says failed (each device's io-status: "failed", "nospace"), for a VM
    paused on an I/O error that the event log has not heard of (the lab manager was not connected when
    it came); the operation and QEMU's reason are not known there. A disk whose error was resumed may
    still say so: `cont` resets the io-status of named drives only, not of -blockdev devices."""
    found = []
    for block in blocks if isinstance(blocks, list) else ():
        status = block.get("io-status") if isinstance(block, dict) else None
        if status not in ("failed", "nospace"):
            continue
        inserted = block.get("inserted")
        node = inserted.get("node-name") if isinstance(inserted, dict) else None
        disk = event_log.disk_of({"node-name": node, "qdev": block.get("qdev"),
                                  "device": block.get("device")})
        found.append(IoError(disk=disk, operation=None, reason=None, nospace=status == "nospace",
                             action="stop", time=None))
    return found


def io_error_of(logged: IoError | None, failed: Sequence[IoError]) -> IoError | None:
    """The failed request that paused a VM: the one the event log has (disk, operation, QEMU's
    reason), unless QEMU's devices say only other disks failed (a pause the log missed, after an error
    it logged and a resume it did not), then the disk they name (the newest of several is not known:
    the first)."""
    if logged is not None and (not failed or any(item.disk in (None, logged.disk) for item in failed)):
        return logged
    return failed[0] if failed else None


def vm_state(files: VmFiles, run_state: str | None, held: str | None = None, *,
             busy: bool = False, io_error: IoError | None = None) -> tuple[str, str | None]:
    """What `status` says of a VM whose QEMU runs, and why when it is not plainly running: QEMU's run
    state, else "unresponsive" when its QMP did not answer; a guest whose console shows a kernel
    panic since it booted is "guest-panicked" (QEMU's name) whatever QEMU thinks (without a pvpanic
    driver in the guest, QEMU goes on running a guest that panicked). `held`: why vmlaunch keeps it paused (an
    interrupted restore, or an operation under way in another vmlaunch: `busy`, which has its QMP
    meanwhile); a VM paused otherwise was paused by its user (`vmlaunch pause`, QMP stop). A VM a failed
    disk request paused (QEMU's io-error) is "paused" too, with the request: `io_error`."""
    panic = qemu.console_panic(files)
    if run_state == "guest-panicked" or panic is not None:
        return "guest-panicked", panic or "QEMU reported a guest panic (pvpanic)"
    if run_state is None and busy:
        return "paused", held
    if run_state is None:
        return "unresponsive", f"its QMP did not answer within {STATUS_QMP_TIMEOUT:g} s"
    if run_state in qemu.NEVER_RAN:
        return "starting", (f"QEMU: {run_state}: its guest has not run yet (an up under way, or one "
                            "that was interrupted: `vmlaunch up SPEC` starts it again)")
    if run_state == "paused":
        return "paused", held or ("by its user (`vmlaunch pause`, or QMP stop), or by a vmlaunch "
                                  "snapshot under way: `vmlaunch resume SPEC VM` resumes it")
    if run_state == IO_ERROR:
        failed = io_error.describe() if io_error is not None else "a disk request failed"
        return "paused", (f"by an I/O error: {failed}; `vmlaunch resume SPEC {files.name}` retries it "
                          "(`vmlaunch logs SPEC --events` shows each error)")
    return run_state, None if run_state == "running" else f"QEMU: {run_state}"


def guest_stats(reply: Any) -> dict[str, int]:
    """The statistics the guest reported (QEMU shows one it never sent as (uint64) -1); none before
    its first report."""
    if not isinstance(reply, dict) or not reply.get("last-update"):
        return {}
    if not isinstance(reply.get("stats"), dict):
        return {}
    return {key: value for key, value in reply["stats"].items()
            if isinstance(value, int) and 0 <= value < 1 << 63}


def memory_of(vm: VmSpec, managed: dict[str, Any] | None) -> MemoryStatus:
    from vmlaunch.spec.model import BalloonPolicy, balloon_min_mib

    if not vm.balloon.enabled:
        return MemoryStatus(max=vm.memory_mib << 20, policy=None)
    auto = vm.balloon.policy is BalloonPolicy.AUTO
    target = managed.get("target") if auto and managed else None
    return MemoryStatus(max=vm.memory_mib << 20, policy=vm.balloon.policy.value,
                        min=balloon_min_mib(vm) << 20 if auto else None,
                        target=target if isinstance(target, int) else None)


def manager_state(run_dir: RunDir) -> dict[str, Any]:
    """What the lab manager saw and set last (`manager.state.json`), {} when there is none."""
    import json

    try:
        doc = json.loads(qemu.read_text(run_dir.manager_state) or "{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def lab_memory_status(run_dir: RunDir, lab: LabSpec, rows: Sequence[VmStatus]) -> LabMemoryStatus:
    from vmlaunch.host.memory import ksm_counters
    from vmlaunch.spec.model import BUDGET_SHARE

    budget = lab.memory.budget_mib
    if budget is None:
        budget = int((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20) * BUDGET_SHARE)
    actual = sum(row.memory.actual if row.memory.actual is not None else row.memory.max
                 for row in rows if row.state == "running" and row.memory is not None)
    record = manager_record(run_dir)
    manager = ("none" if record is None else f"running (pid {record.pid})" if record.running()
               else "gone (`vmlaunch up SPEC` starts it again)")
    ksm = ksm_counters()
    merged = [row.memory.ksm_merged for row in rows
              if row.memory is not None and row.memory.ksm_merged is not None]
    return LabMemoryStatus(budget=budget << 20, actual=actual, manager=manager,
                           ksm=ksm.to_json() if ksm is not None else None,
                           ksm_merged=sum(merged) if merged else None, ksm_setting=ksm_setting(run_dir, lab))


def ksm_setting(run_dir: RunDir, lab: LabSpec) -> str:
    """What the lab does with host KSM, in words."""
    from vmlaunch.resources.ksm import KsmRecord

    entry = Journal.load(run_dir).entry(KsmRecord.kind, "host")
    if entry is not None and isinstance(entry.record, KsmRecord):
        return f"on while the lab runs: {entry.record.describe_rate()}"
    if lab.memory.ksm is False:
        return "off for this lab (ksm = false: its memory is never merged)"
    return "left as the host has it"


@attrs.frozen
class LabUp:
    """A lab that is up on this host (`vmlaunch ls`), as its journal tells."""

    name: str
    spec: str | None
    vms: dict[str, str]  # VM -> running | crashed
    since: float  # when its first VM was started (seconds since the epoch)
    run_dir: str

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def labs_up(root: Path) -> list[LabUp]:
    """Every lab with a run dir under `root` (vmlaunch's: marked) and a VM in its journal (a QEMU of
    vmlaunch's, or a domain on a libvirt host), by name.
    A run dir whose journal cannot be read is a warning, not the end of the list."""
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    labs = []
    for entry in entries:
        run_dir = RunDir.of(root, entry)
        try:  # a run dir is a folder (the run root also holds the bridge registry's files)
            if entry.startswith(".") or not stat.S_ISDIR(os.lstat(run_dir.path).st_mode):
                continue
        except OSError:  # gone meanwhile
            continue
        if not run_dir.marked():
            continue
        try:
            journal = Journal.load(run_dir)
        except (VmlaunchError, OSError) as exc:
            log.warning("%s: %s", run_dir, exc)
            continue
        remote = {e.record.vm: e.record.host for e in journal.resources
                  if isinstance(e.record, RemoteDomainRecord)}
        if remote:  # a lab on libvirt hosts: where each VM is (`status` asks the hosts how it is)
            labs.append(LabUp(entry, journal.spec, {name: f"on host {host}" for name, host in remote.items()},
                              os.stat(run_dir.state).st_mtime, str(run_dir)))
            continue
        if not journal.vms:
            continue
        vms = {name: "running" if qemu.find_pid(run_dir.vm(name), vm.pid) else gone_state(run_dir.vm(name))
               for name, vm in journal.vms.items()}
        since = min(vm.started for vm in journal.vms.values())
        labs.append(LabUp(entry, journal.spec, vms, since, str(run_dir)))
    return labs


# What a Linux guest prints last when it powers itself off (`poweroff`, `shutdown -h`).
_POWERED_OFF = ("reboot: Power down", "reboot: System halted")


def gone_state(files: VmFiles) -> str:
    """A VM of the lab whose QEMU is gone: "off" when its guest powered itself off (its console's
    last lines say so), else "crashed" (killed, or QEMU failed)."""
    tail = qemu.read_text(files.serial_log)[-4096:]
    return "off" if any(mark in tail for mark in _POWERED_OFF) else "crashed"


def qmp_command(run_dir: RunDir, name: str, command: str, args: dict[str, Any] | None = None) -> Any:
    running_pid(run_dir, name)
    with QuickQmp(run_dir.vm(name).qmp, timeout=5) as qmp:
        return qmp.cmd(command, **(args or {}))


def pause(run_dir: RunDir, names: Sequence[str], timeout: float = 10.0) -> dict[str, str]:
    """Pause the named VMs (QMP stop): the user's own pause, which vmlaunch keeps (a snapshot resumes
    only what it paused itself). Returns VM -> what was done: "paused" or "already paused"."""
    return _pause_or_resume(run_dir, names, timeout, pausing=True)


def resume(run_dir: RunDir, names: Sequence[str], timeout: float = 10.0) -> dict[str, str]:
    """Resume the named VMs (QMP cont): "resumed" or "already running"; a VM a failed disk request
    paused (io-error) is "resumed (the failed request is retried)": QEMU sends the request again, and
    pauses the VM again if it fails again. A VM an interrupted snapshot restore left paused may hold
    half of its memory: it is refused (RuntimeFailure), and nothing is resumed."""
    return _pause_or_resume(run_dir, names, timeout, pausing=False)


def _pause_or_resume(run_dir: RunDir, names: Sequence[str], timeout: float, *,
                     pausing: bool) -> dict[str, str]:
    from vmlaunch.lab.journal import locked
    from vmlaunch.saved.intent import held_paused
    from vmlaunch.saved.snapshot import settle

    for name in names:
        running_pid(run_dir, name)
    with locked(run_dir, timeout):
        settle(run_dir, timeout)
        held = {name: why for name, why in held_paused(run_dir).items() if name in names}
        if held and not pausing:
            raise RuntimeFailure("not resumed: " + "; ".join(f"{name} is kept paused {why}"
                                                             for name, why in held.items()))
        if pausing and run_dir.disk_faults.exists():  # QEMU pauses once every request is done
            from vmlaunch.rig.diskfault import held_requests

            waiting = [(name, disk) for name in names for disk in held_requests(run_dir, name)]
            if waiting:
                shown = ", ".join(f"{name} {disk}" for name, disk in waiting)
                raise RuntimeFailure(f"not paused: a hang holds the requests of {shown}, and QEMU pauses a "
                                     "VM only once its requests are done",
                                     f"`vmlaunch fault SPEC {waiting[0][0]} {waiting[0][1]} release` first")
        done = {}
        for name in names:
            with QuickQmp(run_dir.vm(name).qmp, timeout=5) as qmp:
                state = read_run_state(qmp)
                if pausing:
                    done[name] = "already paused" if state in ("paused", IO_ERROR) else \
                        _qmp_step(qmp, "stop", "paused")
                elif state == "running":
                    done[name] = "already running"
                elif state == "paused":
                    done[name] = _qmp_step(qmp, "cont", "resumed")
                elif state == IO_ERROR:  # cont retries the request that failed: it may fail again
                    done[name] = _qmp_step(qmp, "cont", "resumed (the failed request is retried)")
                else:
                    raise RuntimeFailure(f"{name}: not resumed: QEMU's run state is {state}",
                                         "`vmlaunch status SPEC` says why")
        return done


def _qmp_step(qmp: QuickQmp, command: str, done: str) -> str:
    qmp.cmd(command)
    return done


PAGE = 4096
# A guest whose balloon has not moved for this long while it is short of its target has stopped:
# its driver found no page it could give (the guest's floor), or it has none.
BALLOON_STALL = 3.0


def balloon(run_dir: RunDir, name: str, size: int | None = None, timeout: float = 10.0,
            memory: int | None = None) -> int:
    """Set the balloon target to `size` bytes (and wait until the guest follows), or read it.

    `memory`, the VM's RAM, bounds the target: QEMU caps it there, so a larger one is never reached.
    A guest that stops short of a smaller size (its floor: what its kernel and programs hold), shows
    that it is out of memory, or does not follow within `timeout` gets its target set back to where
    the balloon was, so it is never left squeezed towards a size that would kill it; the
    RuntimeFailure says how far it got and that the target is back.
    """
    from vmlaunch.spec.throwaway import is_throwaway

    if size is not None and is_throwaway(run_dir.lab):
        raise UsageError(f"{name} is a throwaway VM: its RAM may map its template's file, which a balloon "
                         "would punch holes in", "give a VM of a lab its balloon (`vmlaunch up`)")
    if size is not None:
        size -= size % PAGE  # the balloon moves whole pages
        if size <= 0 or (memory is not None and size > memory):
            limit = f" and {memory >> 20} MiB (the VM's memory)" if memory is not None else ""
            raise UsageError(f"balloon size must be between 4 KiB{limit}")
    running_pid(run_dir, name)
    files = run_dir.vm(name)
    with Qmp(files.qmp) as qmp:
        try:
            read = read_balloon(qmp)
        except QmpError as exc:
            raise RuntimeFailure(f"{name}: {exc.message}", "the VM has no balloon device: "
                                 "[vm.NAME.balloon] enabled = false?") from None
        if read is None:
            raise RuntimeFailure(f"{name}: QEMU did not say where the balloon is", "try again")
        actual: int = read
        panic = qemu.console_panic(files)
        if size is not None and panic is not None:
            raise RuntimeFailure(f"{name}: the guest panicked ({panic}); its balloon driver cannot answer",
                                 f"`vmlaunch logs SPEC {name}` shows the console; `vmlaunch down` and "
                                 "`up` start it again")
        if size is None or size == actual:
            return actual
        before = actual
        console_from = qemu.console_size(files)
        qmp.cmd("balloon", value=size)
        moved_at, last, sign = time.monotonic(), actual, None

        def settled() -> int | bool | None:
            nonlocal actual, moved_at, last, sign
            now_at = read_balloon(qmp)
            actual = now_at if now_at is not None else actual
            if actual == size:
                return actual
            now = time.monotonic()
            if actual != last:
                moved_at, last = now, actual
            if size < before:
                sign = qemu.console_line_since(files, console_from, qemu.OUT_OF_MEMORY)
                # A guest that gave something and then stopped is at its floor; one that gave nothing
                # yet may still be loading its driver, and gets the whole timeout.
                if sign is not None or (actual != before and now - moved_at >= BALLOON_STALL):
                    return True
            return None

        try:
            if wait_until(settled, timeout, interval=0.2) == size:
                return size
        except TimedOut:
            pass
        except BaseException:
            if size < before:
                _set_back(qmp, name, before)  # interrupted: never left squeezing
            raise
        back = _set_back(qmp, name, before) if size < before else None
    raise _not_followed(name, size, timeout, before, actual, memory, back, sign)


SET_BACK_WAIT = 10.0  # seconds a balloon set back waits for the guest to take its memory back


def _set_back(qmp: Qmp, name: str, before: int) -> int | None:
    """The balloon's target back at `before`, where the guest was, and the guest given a moment to
    take its memory back (so the next command finds it there); None when QEMU refused."""
    try:
        qmp.cmd("balloon", value=before)
        wait_until(lambda: read_balloon(qmp) == before or None, SET_BACK_WAIT, interval=0.1)
    except QmpError as exc:
        log.warning("%s: the balloon target could not be set back to %s: %s", name, _shown(before),
                    exc.message)
        return None
    except TimedOut:
        log.warning("%s: the guest is still taking its memory back towards %s", name, _shown(before))
    return before


def _shown(size: int) -> str:
    from vmlaunch.core.units import format_size

    return format_size(size)


def _not_followed(name: str, size: int, timeout: float, before: int, actual: int,
                  memory: int | None, back: int | None = None, sign: str | None = None) -> RuntimeFailure:
    """Why the guest's memory stopped short of `size`: it never moved (no driver answers), or it moved
    and stopped (the guest keeps a floor: what its kernel and programs cannot give up). A
    guest already below its RAM has a driver: one that does not move is at its floor. `back`: the
    target was set back there; `sign`: what the guest printed when it ran out of memory."""
    shown = _shown
    then = (f"; the target is back at {shown(back)}, where the guest was, so it keeps running"
            if back is not None else "")
    seen = f" (its console: {sign!r})" if sign else ""
    floor = (f"{shown(actual)} is about the guest's floor now: what its kernel and programs hold and "
             "cannot give back; a size well above it works, or free memory in the guest first (a "
             "longer --timeout helps only a guest that is still giving memory back)")
    if actual == before and sign is None:
        if memory is not None and before < memory and size < before:
            return RuntimeFailure(f"{name}: the guest gave nothing more within {timeout:g} s: it stays "
                                  f"at {shown(actual)}, short of {shown(size)}{then}", floor)
        return RuntimeFailure(
            f"{name}: the guest did not move its memory towards {shown(size)} within {timeout:g} s "
            f"(it stays at {shown(actual)}){then}", "no balloon driver answered: is the guest still "
            "booting, or is its virtio_balloon driver not loaded?")
    if size < before:
        return RuntimeFailure(
            f"{name}: the guest gave up {shown(before - actual)} and stopped at {shown(actual)}, short "
            f"of {shown(size)}{seen}{then}", floor)
    return RuntimeFailure(
        f"{name}: the guest took back {shown(actual - before)} and is at {shown(actual)}, short of "
        f"{shown(size)}, within {timeout:g} s", "a longer --timeout may let it finish")


def is_up(run_dir: RunDir, name: str) -> bool:
    """Whether the lab's journal has the VM: running, or crashed with its files still in the run dir."""
    return name in Journal.load(run_dir).vms


def read_log(run_dir: RunDir, name: str, *, qemu_messages: bool = False) -> str:
    """The VM's serial console output (or what QEMU said): of the run that is up, else of the last run,
    which `down` kept (`layout/lastrun.py`)."""
    if is_up(run_dir, name):
        files = run_dir.vm(name)
        return qemu.messages(files) if qemu_messages else qemu.read_text(files.serial_log)  # no links
    kept = lastrun.read(run_dir.lab, name, "qemu" if qemu_messages else "serial")
    if kept is None:
        what = "QEMU messages" if qemu_messages else "serial log"
        raise RuntimeFailure(f"VM {name} has no {what}: it is not up, and no earlier run was kept",
                             f"bring it up with `vmlaunch up SPEC {name}`")
    return kept


def manager_record(run_dir: RunDir) -> Any:
    """The journaled lab manager (a ManagerRecord), None when the lab has none up."""
    entry = Journal.load(run_dir).entry("manager", "lab")
    return entry.record if entry is not None else None


def read_manager_log(run_dir: RunDir) -> tuple[str, bool]:
    """The lab manager's log and whether it runs: of the manager that is up, else of the last one."""
    record = manager_record(run_dir)
    if record is not None:
        return qemu.read_text(run_dir.manager_log), record.running()
    kept = lastrun.read_manager(run_dir.lab)
    if kept is None:
        raise RuntimeFailure(f"lab {run_dir.lab} has no lab manager log: its manager is not up, and no "
                             "earlier run was kept", "bring it up with `vmlaunch up SPEC`")
    return kept, False


def follow_manager_log(run_dir: RunDir, offset: int) -> Iterator[str]:
    """The manager's log as it grows from `offset`, until the manager stops."""
    record = manager_record(run_dir)
    with os.fdopen(open_in_run_dir(run_dir.manager_log, os.O_RDONLY), "rb") as log:
        log.seek(offset)
        while True:
            chunk = wait_until(lambda: log.read() or (None if record.running() else b""), math.inf,
                               interval=0.2)
            if not chunk:
                return
            yield chunk.decode(errors="replace")


def lab_is_up(run_dir: RunDir) -> bool:
    """Whether the lab's journal has a VM or its manager: the run dir's files are this run's."""
    journal = Journal.load(run_dir)
    return bool(journal.vms) or journal.entry("manager", "lab") is not None


def read_events(run_dir: RunDir, vms: Sequence[str] = ()) -> tuple[list[event_log.Event], bool]:
    """The lab's event log (the events of `vms`, all when empty) and whether the lab is up: of the
    run that is up, else of the last one, which `down` kept (`layout/lastrun.py`)."""
    if lab_is_up(run_dir):
        return event_log.read(run_dir, vms), True
    kept = lastrun.read_events(run_dir.lab)
    if kept is None:
        raise RuntimeFailure(f"lab {run_dir.lab} has no event log: it is not up, and no earlier run of "
                             "it was kept", "bring it up with `vmlaunch up SPEC`")
    return event_log.parse(kept, vms), False


def follow_events(run_dir: RunDir, vms: Sequence[str] = ()) -> Iterator[list[event_log.Event]]:
    """The lab's events from the first, then each new line as it is written, until the lab manager,
    which writes them, stops (`down`); the events there are once when it does not run."""
    record = manager_record(run_dir)
    if record is None or not record.running():
        yield event_log.read(run_dir, vms)
        return
    offset, partial = 0, b""

    def grown() -> bytes | None:
        data = _read_from(run_dir.events, offset)
        return data or (None if record.running() else b"")

    while True:
        chunk = wait_until(grown, math.inf, interval=0.2)
        if not chunk:
            return
        offset += len(chunk)
        lines, _, partial = (partial + chunk).rpartition(b"\n")  # a line is shown once it is whole
        found = event_log.parse(lines.decode(errors="replace"), vms)
        if found:
            yield found


def _read_from(path: Path, offset: int) -> bytes:
    """What the file holds past `offset`; b"" when it does not exist (yet)."""
    try:
        fd = open_in_run_dir(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return b""
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        return f.read(event_log.MAX_BYTES)


def follow_log(run_dir: RunDir, name: str) -> Iterator[str]:
    """The serial log as it grows, until the VM stops (or the reader stops asking)."""
    path = run_dir.vm(name).serial_log
    pid = running_pid(run_dir, name)
    with os.fdopen(open_in_run_dir(path, os.O_RDONLY), errors="replace") as log:
        while True:
            # new output, or "" once the VM is gone and nothing more will come
            chunk = wait_until(lambda: log.read() or (None if qemu.alive(pid) else ""), math.inf,
                               interval=0.2)
            if not chunk:
                return
            yield chunk


def attach_console(run_dir: RunDir, name: str) -> None:
    """An interactive serial console on this terminal; Ctrl-] detaches, the VM keeps running."""
    import fcntl

    running_pid(run_dir, name)
    # QEMU serves one client and queues the next silently: a lock says it plainly instead.
    guard = os.open(run_dir.vm(name).console_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(guard)
        raise RuntimeFailure(f"another console is attached to {name}",
                             "detach it first (Ctrl-] in that terminal)") from None
    try:
        _attach(run_dir, name)
    finally:
        os.close(guard)


def _attach(run_dir: RunDir, name: str) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(run_dir.vm(name).console))
    except OSError as exc:
        raise RuntimeFailure(f"cannot attach to the console of {name}: {exc.strerror}") from None
    stdin = sys.stdin.fileno()
    saved = _raw_terminal(stdin)
    print(f"[connected to {name}; Ctrl-] detaches]\r", file=sys.stderr, flush=True)
    try:
        _pump(conn, stdin, sys.stdout.buffer.fileno())
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        conn.close()
        print(f"\n[detached from {name}]", file=sys.stderr, flush=True)


def _raw_terminal(fd: int) -> list[Any] | None:
    if not os.isatty(fd):
        return None
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    return saved


def _pump(conn: socket.socket, stdin: int, stdout: int) -> None:
    while True:
        ready, _, _ = select.select([conn.fileno(), stdin], [], [])
        if conn.fileno() in ready:
            data = conn.recv(4096)
            if not data:
                return  # QEMU went away
            os.write(stdout, data)
        if stdin in ready:
            data = os.read(stdin, 1024)
            if not data or DETACH_KEY in data:
                conn.sendall(data.split(DETACH_KEY)[0])
                return
            conn.sendall(data)
