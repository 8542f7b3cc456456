"""Faults on a running VM's disks: I/O errors, held requests, slow disks (`vmlaunch fault`, `Vm.disk`).

Every disk's device reads and writes through its fault slot, a `raw` node over the disk's format node
(`compile/compiler.py: fault_slot`): `diskN-slot` -> `diskN` (raw or qcow2) -> `diskN-file`. A fault
uses three things of QEMU's, all in the running QEMU and none in an image:

- errors: QEMU's blkdebug between the slot and `diskN` (`diskN-faultK`), with one `inject-error` rule
  per fault. Offsets there are the guest's (the slot passes requests through unchanged). A rule always
  names its `iotype`: without it, a rule armed by a read also fails a later write. The rules of an open
  blkdebug node cannot change, so each change adds a new node over `diskN` with the new rules, reopens
  the slot onto it (`blockdev-reopen`, the slot's compiled options with `file` changed) and deletes the
  old one; the last fault cleared reopens the slot onto `diskN` again.
- holds (`hang`): blkdebug's breakpoint (HMP `qemu-io NODE "break write_aio TAG"`) holds the next
  request of its kind, and QEMU's I/O limits hold every later one (1 byte a second that way: the first
  request of a leaky bucket always passes, the breakpoint has it). `release` removes the breakpoint,
  resumes what it holds, then lifts the limit, which drains the rest. A held request keeps a drain
  from ending (QMP `stop` did not answer within 8 s): holds are released before anything that drains
  (a new set of rules, a snapshot, `down`).
- slow: QEMU's I/O limits on the device (`block_set_io_throttle`, on the virtio-blk device's backend,
  `/machine/peripheral/diskN/virtio-backend`).

What is set lives in `disk-faults.json` in the run dir (`RunDir.disk_faults`), with the pid of the
QEMU it was set in: a record of a QEMU that is gone (down, crashed, started again) is dropped when
read, for a new QEMU starts without any of it. Changes are made under the lab's lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from vmlaunch.compile.plan import VmPlan
from vmlaunch.errors import EXIT_HOST, Problem, RuntimeFailure, SpecError, UsageError
from vmlaunch.layout.rundir import RunDir, open_in_run_dir
from vmlaunch.qemu.qmp import QmpError, QuickQmp
from vmlaunch.spec.diskfault import (
    SECTOR,
    describe,
    errno_number,
    fired_by,
    from_json,
    iops_of,
    may_pause,
    mistaken_for,
    plural,
    replaces,
    requests,
    to_json,
)
from vmlaunch.spec.model import DiskBus, DiskFault, FaultKind, LabSpec, OnError

log = logging.getLogger(__name__)

VERSION = 1
QMP_TIMEOUT = 10.0  # seconds QEMU gets to answer one command (a reopen drains the disk's requests)
LOCK_TIMEOUT = 30.0  # seconds a fault command waits for another command on the lab to finish
HOLD_BPS = 1  # bytes per second while requests are held: a 4 KiB request waits more than an hour
EVENTS = {"read": "read_aio", "write": "write_aio", "flush": "flush_to_disk"}
# In every blkdebug node with a flush rule: a rule that fails nothing (errno 0, on block-status queries,
# which no request of the guest is) but that a read makes the one in force (`_reopen_slot`)
DISARM = {"event": "read_aio", "iotype": "block-status", "errno": 0, "once": False}
DISARM_TRIES = 5


class VmDown(RuntimeFailure):
    """A fault on a VM that is not running."""

    exit_code = EXIT_HOST


@attrs.frozen
class Target:
    """One disk of a running VM, as the compiler built it."""

    vm: str
    name: str  # diskN
    key: str  # its spec key
    bus: DiskBus
    readonly: bool
    discard: bool
    pid: int
    read_error: OnError | None = None  # the disk's on_error (None: QEMU's default)
    write_error: OnError | None = None

    @property
    def slot(self) -> str:
        return f"{self.name}-slot"

    @property
    def backend(self) -> str:
        """The device's block backend as QMP's I/O limits find it."""
        if self.bus is DiskBus.VIRTIO:
            return f"/machine/peripheral/{self.name}/virtio-backend"
        return self.name

    def slot_options(self, file: str) -> dict[str, Any]:
        """The slot's options as compiled (`compiler.fault_slot`), over `file`."""
        options: dict[str, Any] = {"driver": "raw", "node-name": self.slot, "file": file,
                                   "read-only": self.readonly}
        if self.discard:
            options["discard"] = "unmap"
        return options


# --- the record ----------------------------------------------------------------------------------


def load(run_dir: RunDir) -> dict[str, Any]:
    """VM -> {"pid": QEMU pid, "disks": {diskN: {"node": blkdebug node or None, "serial": n,
    "faults": [fault...]}}}; only VMs whose QEMU still runs that pid."""
    from vmlaunch.lab import process as qemu

    try:
        fd = open_in_run_dir(run_dir.disk_faults, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    with os.fdopen(fd) as handle:
        try:
            data = json.load(handle)
        except (ValueError, UnicodeDecodeError):
            return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("vms"), dict):
        return {}
    live = {}
    for vm, entry in data["vms"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int):
            continue
        if qemu.find_pid(run_dir.vm(vm), entry["pid"]) == entry["pid"]:
            live[vm] = entry
    return live


def _save(run_dir: RunDir, vms: dict[str, Any]) -> None:
    from vmlaunch.core.fsutil import write_atomic

    kept = {vm: entry for vm, entry in vms.items() if any(disk.get("node") or disk.get("faults")
                                                          for disk in entry["disks"].values())}
    if not kept:
        run_dir.disk_faults.unlink(missing_ok=True)
        return
    write_atomic(run_dir.disk_faults, json.dumps({"version": VERSION, "vms": kept}, indent=1,
                                                 sort_keys=True) + "\n", mode=0o600)


def faults_of(entry: dict[str, Any]) -> list[DiskFault]:
    faults = []
    for doc in entry.get("faults") or []:
        try:
            fault = from_json(doc)
            errno_number(fault.errno)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        faults.append(fault)
    return faults


def listing(run_dir: RunDir) -> dict[str, dict[str, list[DiskFault]]]:
    """What is set now: VM -> disk -> its faults."""
    found: dict[str, dict[str, list[DiskFault]]] = {}
    for vm, entry in sorted(load(run_dir).items()):
        disks = {disk: _spent_off(run_dir, vm, disk, record)
                 for disk, record in sorted(entry["disks"].items())}
        found[vm] = {disk: faults for disk, faults in disks.items() if faults}
    return found


def _key(fault: DiskFault) -> str:
    return json.dumps(to_json(fault), sort_keys=True)


def _spent_off(run_dir: RunDir, vm: str, disk: str, record: dict[str, Any]) -> list[DiskFault]:
    """The disk's faults without its `--once` errors that fired: an error of their kind (a failed
    flush is a failed write to QEMU) logged on the disk since they were set. QEMU does not say which
    rule failed a request, nor keeps a rule that fired: the lab's event log is what tells."""
    faults = faults_of(record)
    armed = record.get("armed") or {}
    if not any(fault.once for fault in faults):
        return faults
    from vmlaunch.lab import events

    failed = [event for event in events.read(run_dir, [vm])
              if event.event == "BLOCK_IO_ERROR" and event.disk == disk]
    kept = []
    for fault in faults:  # no other error of the disk is reported as this one is (`_check`)
        since = armed.get(_key(fault)) if fault.once else None
        if since is not None and any(event.time >= since and fired_by(event.data, fault) for event in failed):
            continue
        kept.append(fault)
    return kept


def _unspent(run_dir: RunDir, where: Target, record: dict[str, Any]) -> list[DiskFault]:
    """The disk's faults as `_spent_off` says, and the record made to say so too (what fired once is
    gone from QEMU as well)."""
    faults = _spent_off(run_dir, where.vm, where.name, record)
    record["faults"] = [to_json(fault) for fault in faults]
    keys = {_key(fault) for fault in faults}
    record["armed"] = {key: when for key, when in (record.get("armed") or {}).items() if key in keys}
    return faults


def held_requests(run_dir: RunDir, vm: str) -> list[str]:
    """The disks of running VM `vm` whose requests are held (`hang`)."""
    return [disk for disk, faults in listing(run_dir).get(vm, {}).items()
            if any(fault.kind is FaultKind.HANG for fault in faults)]


# --- which disk ----------------------------------------------------------------------------------


def disk_name(lab: LabSpec, vm: str, text: str) -> str:
    """The name (diskN) of the disk `text` names on VM `vm`: diskN, or N; UsageError otherwise."""
    return f"disk{_index(lab, vm, text)}"


def _index(lab: LabSpec, vm: str, text: str) -> int:
    from vmlaunch.compile.compiler import boot_disks
    from vmlaunch.errors import format_key_path
    from vmlaunch.layout.labdir import LabDir

    disks = boot_disks(LabDir.of(lab.file, lab.name), lab.vm(vm))
    match = re.fullmatch(r"(?:disk)?([0-9]{1,4})", str(text), re.ASCII)
    if match is None or int(match[1]) >= len(disks):
        names = ", ".join(f"disk{number} ({format_key_path(key)})"
                          for number, (key, _) in enumerate(disks)) or "none"
        raise UsageError(f"VM {vm} has no disk {text!r} (its disks: {names})",
                         "`vmlaunch status SPEC --json` lists them")
    return int(match[1])


def target(run_dir: RunDir, lab: LabSpec, vm: str, text: str) -> Target:
    """The disk `text` names on VM `vm` (diskN, or N), which must run: UsageError for an unknown disk,
    VmDown when it is not running."""
    from vmlaunch.compile.compiler import boot_disks
    from vmlaunch.errors import format_key_path
    from vmlaunch.lab import process as qemu
    from vmlaunch.lab.journal import Journal
    from vmlaunch.layout.labdir import LabDir

    index = _index(lab, vm, text)
    key, disk = boot_disks(LabDir.of(lab.file, lab.name), lab.vm(vm))[index]
    journal = Journal.load(run_dir) if run_dir.path.is_dir() else None
    entry = journal.vms.get(vm) if journal is not None else None
    pid = qemu.find_pid(run_dir.vm(vm), entry.pid) if entry is not None else None
    if pid is None:
        raise VmDown(f"VM {vm} is not running: a disk fault is set in a running QEMU",
                     f"start it with `vmlaunch up SPEC {vm}`")
    if journal is not None:
        journal.check_spec(lab.file, force=False)  # another spec of the lab's name: other disks
    return Target(vm, f"disk{index}", format_key_path(key), disk.bus, disk.readonly, disk.discard, pid,
                  disk.read_error, disk.write_error)


# QOM types of the disk devices the compiler makes, by bus
DEVICE_BUSES = {"virtio-blk-pci": DiskBus.VIRTIO, "scsi-hd": DiskBus.SCSI, "ide-hd": DiskBus.SATA,
                "ide-cd": DiskBus.SATA}


def running_as(qmp: QuickQmp, where: Target) -> Target:
    """`where` as its QEMU has it: the device's bus and on_error as `up` gave them, which a spec edited
    since may no longer say (a pause while a request is held would freeze QEMU). UsageError when the
    running VM has no such disk."""
    device = f"/machine/peripheral/{where.name}"
    try:
        kind = qmp.cmd("qom-get", path=device, property="type")
    except QmpError as exc:
        if "not found" not in exc.message:
            raise
        raise UsageError(f"VM {where.vm} has no {where.name} running: its spec names more disks than "
                         "it was brought up with", f"`vmlaunch up SPEC {where.vm}` again after `vmlaunch "
                         f"down SPEC {where.vm}`") from None
    actions = [qmp.cmd("qom-get", path=device, property=name) for name in ("rerror", "werror")]
    read, write = (OnError(action) if action in {item.value for item in OnError} else None
                   for action in actions)  # "auto": QEMU's default
    readonly = where.readonly
    for node in qmp.cmd("query-named-block-nodes", flat=True) or []:
        if isinstance(node, dict) and node.get("node-name") == where.slot:
            readonly = node.get("ro") is True
    return attrs.evolve(where, bus=DEVICE_BUSES.get(str(kind), where.bus), read_error=read, write_error=write,
                        readonly=readonly)


# --- changes -------------------------------------------------------------------------------------


Change = tuple[QuickQmp, Target, dict[str, Any], dict[str, Any], list[DiskFault]]


@contextlib.contextmanager
def _disk(run_dir: RunDir, lab: LabSpec, vm: str, disk: str, timeout: float) -> Iterator[Change]:
    """A change of one disk's faults: under the lab's lock, with its QEMU's QMP, the disk as QEMU runs
    it, the lab's fault records, this disk's record and its faults not yet spent. The records are
    saved when the change ends, whether it went through or not."""
    from vmlaunch.lab.journal import locked

    lab.select([vm])
    with locked(run_dir, timeout):
        where = target(run_dir, lab, vm, disk)
        with QuickQmp(run_dir.vm(vm).qmp, timeout=QMP_TIMEOUT) as qmp:
            where = running_as(qmp, where)
            vms = load(run_dir)
            record = _record(vms, where)
            try:
                yield qmp, where, vms, record, _unspent(run_dir, where, record)
            finally:
                _save(run_dir, vms)


def set_fault(run_dir: RunDir, lab: LabSpec, vm: str, disk: str, fault: DiskFault,
              timeout: float = LOCK_TIMEOUT) -> str:
    """Set `fault` on a disk of running VM `vm`; returns what is now set on it, described. An error
    fault replaces one on the same requests and sector; a slow one replaces the disk's slow one."""
    with _disk(run_dir, lab, vm, disk, timeout) as (qmp, where, vms, record, faults):
        _check(where, fault, faults)
        set_now = {name: faults if name == where.name else _spent_off(run_dir, vm, name, other)
                   for name, other in vms[vm]["disks"].items()}
        actions = {name: _on_error(qmp, where, name) for name, there in set_now.items() if there}
        _check_pauses(where, fault, actions, set_now)
        if fault.kind is FaultKind.ERROR:
            _check_sector(qmp, where, fault)
        kept = [old for old in faults if not replaces(fault, old)]
        if fault.once and len(kept) < len(faults):
            # the error it replaces goes first: a request it fails while the new rules come in must not
            # count as the once error's
            _apply(qmp, where, record, kept)
        if fault.kind is FaultKind.ERROR and fault.once:
            record.setdefault("armed", {})[_key(fault)] = time.time()
        faults = [*kept, fault]
        _apply(qmp, where, record, faults)
        _note(run_dir, vm, where.name, f"set {describe(fault)}")
    return "; ".join(describe(item) for item in faults)


def release(run_dir: RunDir, lab: LabSpec, vm: str, disk: str, timeout: float = LOCK_TIMEOUT) -> list[str]:
    """Let the held requests of a disk go; returns the kinds released. UsageError when none is held."""
    with _disk(run_dir, lab, vm, disk, timeout) as (qmp, where, _, record, faults):
        held = [fault.op or "" for fault in faults if fault.kind is FaultKind.HANG]
        if not held:
            raise UsageError(f"{vm} {where.name}: nothing is held", f"`vmlaunch fault SPEC {vm} "
                             f"{where.name} hang --write` holds its writes")
        _apply(qmp, where, record, [fault for fault in faults if fault.kind is not FaultKind.HANG])
        _note(run_dir, vm, where.name, f"released held {requests(held)}")
    return held


def clear(run_dir: RunDir, lab: LabSpec, vm: str, disk: str,
          timeout: float = LOCK_TIMEOUT) -> list[DiskFault]:
    """Take every fault off a disk (holds released first); returns what was set."""
    with _disk(run_dir, lab, vm, disk, timeout) as (qmp, where, _, record, faults):
        if not (faults or record.get("node")):
            return faults
        _apply(qmp, where, record, [])
        _note(run_dir, vm, where.name, "cleared")
    return faults


def undo(run_dir: RunDir, names: Iterable[str] | None = None, *, why: str,
         timeout: float = QMP_TIMEOUT) -> list[str]:
    """Take every fault off the disks of the running VMs `names` (all when None), holds first: before a
    snapshot, before `down` stops the QEMUs. The caller holds the lab's lock. Returns "VM diskN" of each
    disk cleared; a QEMU that does not answer is left to the caller (it is about to be stopped, or the
    snapshot will say it could not pause it)."""
    vms = load(run_dir)
    wanted = set(names) if names is not None else None
    done = []
    for vm, entry in vms.items():
        if wanted is not None and vm not in wanted:
            continue
        for disk, record in entry["disks"].items():
            if not (record.get("faults") or record.get("node")):
                continue
            where = Target(vm, disk, disk, DiskBus(record.get("bus", "virtio")), bool(record.get("readonly")),
                           bool(record.get("discard")), entry["pid"])
            try:
                with QuickQmp(run_dir.vm(vm).qmp, timeout=timeout) as qmp:
                    _apply(qmp, where, record, [])
                done.append(f"{vm} {disk}")
            except QmpError as exc:
                log.warning("%s %s: its faults could not be taken off: %s", vm, disk, exc.message)
    _save(run_dir, vms)
    for item in done:
        vm, disk = item.split(" ")
        _note(run_dir, vm, disk, f"cleared ({why})")
    return done


def apply_at_up(run_dir: RunDir, vm: VmPlan, pid: int) -> None:
    """Set the spec's `[[vm.V.disk.fault]]`s in a QEMU `up` just started (paused: before its guest
    runs). The caller holds the lab's lock. UsageError for a sector past a disk's end."""
    if not vm.disk_faults:
        return
    vms = load(run_dir)
    vms[vm.name] = {"pid": pid, "disks": {}}
    with QuickQmp(run_dir.vm(vm.name).qmp, timeout=QMP_TIMEOUT) as qmp:
        try:
            for start in vm.disk_faults:
                where = Target(vm.name, start.disk, start.key, start.bus, start.readonly, start.discard, pid)
                record = _record(vms, where)
                for number, fault in enumerate(start.faults):
                    try:
                        _check_sector(qmp, where, fault)
                    except UsageError as exc:
                        if number >= len(start.locations):
                            raise
                        raise SpecError([Problem(start.locations[number], exc.message)]) from None
                for fault in start.faults:  # QEMU is still in prelaunch: no event came before
                    if fault.kind is FaultKind.ERROR and fault.once:
                        record.setdefault("armed", {})[_key(fault)] = time.time()
                _apply(qmp, where, record, list(start.faults))
                _note(run_dir, vm.name, where.name, "set from the spec: " +
                      "; ".join(describe(fault) for fault in start.faults))
        finally:
            _save(run_dir, vms)


# --- QEMU ----------------------------------------------------------------------------------------


def _record(vms: dict[str, Any], where: Target) -> dict[str, Any]:
    entry = vms.get(where.vm)
    if entry is None or entry.get("pid") != where.pid:
        entry = vms[where.vm] = {"pid": where.pid, "disks": {}}
    record: dict[str, Any] = entry["disks"].setdefault(where.name, {"node": None, "serial": 0, "faults": []})
    record.update({"bus": where.bus.value, "readonly": where.readonly, "discard": where.discard})
    return record


def _check(where: Target, fault: DiskFault, faults: Sequence[DiskFault]) -> None:
    held = {old.op or "" for old in faults if old.kind is FaultKind.HANG}
    if where.readonly and fault.op in ("write", "flush"):
        verb = "hold" if fault.kind is FaultKind.HANG else "fail"
        raise UsageError(f"{where.vm} {where.name} is read-only: it has no {plural(fault.op)} to {verb}")
    if fault.kind is FaultKind.HANG and fault.op in held:
        raise UsageError(f"{where.vm} {where.name}: a hang holds its {plural(fault.op)} already",
                         f"`vmlaunch fault SPEC {where.vm} {where.name} release` lets them go")
    if fault.kind is FaultKind.ERROR and held:
        raise UsageError(f"{where.vm} {where.name}: a hang holds its {requests(sorted(held))}, and new "
                         "error rules would wait for them", f"`vmlaunch fault SPEC {where.vm} "
                         f"{where.name} release` first")
    errno_number(fault.errno)
    other = mistaken_for(fault, faults)
    if other is not None:
        raise UsageError(f"{where.vm} {where.name}: not set: {describe(other)} fails the same requests "
                         f"with the same errno, and QEMU does not say which error failed a request, so "
                         f"vmlaunch could not tell when a --once one fired",
                         f"give one of them another --errno (EIO, EROFS, ENOSPC, ...), or `vmlaunch fault "
                         f"SPEC {where.vm} {where.name} clear` first")


def _on_error(qmp: QuickQmp, where: Target, disk: str) -> tuple[OnError | None, OnError | None]:
    """Disk `disk`'s (on_error.read, on_error.write) in where's QEMU (None: QEMU's default)."""
    if disk == where.name:
        return where.read_error, where.write_error
    other = running_as(qmp, attrs.evolve(where, name=disk))
    return other.read_error, other.write_error


def _check_pauses(where: Target, fault: DiskFault, actions: dict[str, tuple[OnError | None, OnError | None]],
                  set_now: dict[str, list[DiskFault]]) -> None:
    """QEMU pauses a VM only once every request of its disks is done: a pause while a request is held
    (an I/O error that stops the VM, on any of its disks) would wait for ever, and QEMU with it. A hang
    and an error that pauses are not set on one VM together. `set_now`: each disk's faults (a `--once`
    error that fired is not one)."""
    holds = [f"{disk} ({describe(old)})" for disk, faults in set_now.items() for old in faults
             if old.kind is FaultKind.HANG]
    pausing = [f"{disk} ({describe(old)})" for disk, faults in set_now.items() for old in faults
               if may_pause(old, *actions.get(disk, (None, None)))]
    why = ("QEMU pauses a VM only once every request of its disks is done, so that pause would wait for "
           "the held request, and QEMU with it")
    if fault.kind is FaultKind.HANG and pausing:
        raise UsageError(f"{where.vm}: not set: {', '.join(pausing)} pauses the VM when it fires; {why}",
                         "clear that disk first, or give it on_error = \"report\"")
    if may_pause(fault, where.read_error, where.write_error) and holds:
        raise UsageError(f"{where.vm}: not set: this error pauses the VM when it fires, and "
                         f"{', '.join(holds)} holds requests; {why}",
                         f"`vmlaunch fault SPEC {where.vm} DISK release` first")


def _check_sector(qmp: QuickQmp, where: Target, fault: DiskFault) -> None:
    if fault.sector is None:
        return
    size = _size(qmp, where)
    if size is not None and fault.sector * SECTOR >= size:
        message = (f"sector {fault.sector} is past the end of {where.vm} {where.name} ({size // SECTOR} "
                   f"sectors of {SECTOR} bytes: 0 to {size // SECTOR - 1})")
        raise UsageError(message)


def _size(qmp: QuickQmp, where: Target) -> int | None:
    for node in qmp.cmd("query-named-block-nodes", flat=True) or []:
        if isinstance(node, dict) and node.get("node-name") == where.slot:
            size = (node.get("image") or {}).get("virtual-size")
            return size if isinstance(size, int) else None
    return None


def _rules(faults: Sequence[DiskFault]) -> list[dict[str, Any]]:
    """blkdebug's inject-error rules of the error faults: each with its iotype (a write also fails
    as a write of zeroes, which a guest sends for zeroed ranges)."""
    rules = []
    for fault in faults:
        if fault.kind is not FaultKind.ERROR or fault.op is None:
            continue
        iotypes = ("write", "write-zeroes") if fault.op == "write" else (fault.op,)
        for iotype in iotypes:
            rule: dict[str, Any] = {"event": EVENTS[fault.op], "iotype": iotype,
                                    "errno": errno_number(fault.errno), "once": fault.once}
            if fault.sector is not None:
                rule["sector"] = fault.sector
            rules.append(rule)
    if any(rule["iotype"] == "flush" for rule in rules):
        rules.append(DISARM)
    return rules


def _reopen_slot(qmp: QuickQmp, where: Target, node: str | None, file: str,
                 rules: Sequence[dict[str, Any]]) -> None:
    """Reopen the slot over `file`. A reopen first flushes the slot, through the blkdebug node `node`
    it leaves: with a flush rule armed there, that flush fails ("Error flushing drive"). Such a node is
    disarmed first: a read through the slot fires its DISARM rule, which takes the flush rule out of
    the rules in force, and a flush of the node itself (whose events go to its child, not to it) then
    succeeds, so that the slot's flush finds nothing new to flush there. A guest write in between arms
    it again: tried a few times."""
    disarm = node is not None and DISARM in rules
    for attempt in range(DISARM_TRIES):
        if disarm and node is not None:
            _hmp(qmp, where.slot, "read 0 512")
            _hmp(qmp, node, "flush")
        try:
            qmp.cmd("blockdev-reopen", options=[where.slot_options(file)])
            return
        except QmpError as exc:
            if not disarm or "flushing" not in exc.message or attempt == DISARM_TRIES - 1:
                raise


def _limits(faults: Sequence[DiskFault]) -> dict[str, int]:
    """QEMU's I/O limits for the slow fault and the holds (a total and a per-direction limit cannot
    be set together: with a hold, the totals become per-direction ones)."""
    limits = dict.fromkeys(("bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"), 0)
    for fault in faults:
        if fault.kind is FaultKind.SLOW:
            limits["bps"] = fault.bps or 0
            limits["iops"] = iops_of(fault) or 0
    held = [fault.op for fault in faults if fault.kind is FaultKind.HANG]
    if held:
        for total in ("bps", "iops"):
            limits[f"{total}_rd"] = limits[f"{total}_wr"] = limits.pop(total)
            limits[total] = 0
        for op in held:
            limits[f"bps_{'rd' if op == 'read' else 'wr'}"] = HOLD_BPS
    return limits


def _hmp(qmp: QuickQmp, node: str, command: str) -> None:
    """HMP qemu-io on block node `node` (through a BlockBackend of its own, which drains the node when
    it goes: never while a request is held)."""
    qmp.cmd("human-monitor-command", **{"command-line": f'qemu-io {node} "{command}"'})


def _hold(qmp: QuickQmp, where: Target, command: str) -> None:
    """HMP qemu-io through the device's own BlockBackend (`-d`): a breakpoint found below it, and no
    drain when the command ends, so that one hold can be set or let go while another holds a
    request."""
    qmp.cmd("human-monitor-command", **{"command-line": f'qemu-io -d {where.backend} "{command}"'})


def _apply(qmp: QuickQmp, where: Target, record: dict[str, Any], faults: list[DiskFault]) -> None:
    """Bring the disk in QEMU from what `record` says is set to `faults`, step by step, recording each
    step as it is done (a step that fails leaves the record saying what QEMU has)."""
    before = faults_of(record)
    held = {fault.op or "" for fault in before if fault.kind is FaultKind.HANG}
    holds = {fault.op or "" for fault in faults if fault.kind is FaultKind.HANG}
    node = record.get("node")

    def now(state: list[DiskFault]) -> list[DiskFault]:
        record["faults"] = [to_json(fault) for fault in state]
        return state

    # 1. holds that go: the breakpoint off and what it holds resumed, before anything drains
    for op in sorted(held - holds):
        if node:
            _hold(qmp, where, f"remove_break vmlaunch-{op}")
            _hold(qmp, where, f"resume vmlaunch-{op}")
    state = now([fault for fault in before if fault.kind is not FaultKind.HANG or (fault.op or "") in holds])
    # 2. their limit lifted (which drains what it held)
    if _limits(state) != _limits(before):
        qmp.cmd("block_set_io_throttle", id=where.backend, **_limits(state))
    # 3. the blkdebug node with the new rules, or none
    rules = _rules(faults)
    if (rules or holds) and (node is None or rules != _rules(state)):
        serial = int(record.get("serial") or 0) + 1
        # a token of its own: a fault command killed between blockdev-add and saving the record leaves a
        # node the record does not name, which a later one must not collide with
        new = f"{where.name}-fault{serial}-{os.urandom(3).hex()}"
        options: dict[str, Any] = {"driver": "blkdebug", "node-name": new, "image": where.name,
                                   "read-only": where.readonly}
        if rules:  # QEMU refuses an empty list
            options["inject-error"] = rules
        qmp.cmd("blockdev-add", **options)
        record["serial"] = serial
        try:
            _reopen_slot(qmp, where, node, new, _rules(state))
        except QmpError:
            qmp.cmd("blockdev-del", **{"node-name": new})
            raise
        record["node"] = new
        if node is not None:
            qmp.cmd("blockdev-del", **{"node-name": node})
        node = new
    elif not (rules or holds) and node is not None:
        _reopen_slot(qmp, where, node, where.name, _rules(state))
        record["node"] = None
        qmp.cmd("blockdev-del", **{"node-name": node})
        node = None
    state = now([fault for fault in faults if fault.kind is FaultKind.ERROR] +
                [fault for fault in state if fault.kind is not FaultKind.ERROR])
    # 4. new holds: the breakpoint for the next request of the kind, the limit for every later one
    for fault in faults:
        if fault.kind is FaultKind.HANG and (fault.op or "") not in held and node is not None:
            _hold(qmp, where, f"break {EVENTS[fault.op or 'write']} vmlaunch-{fault.op}")
            state = now([*state, fault])
    # 5. the limits of the slow fault and the holds as wanted
    if _limits(faults) != _limits(state):
        qmp.cmd("block_set_io_throttle", id=where.backend, **_limits(faults))
    now(faults)


def _note(run_dir: RunDir, vm: str, disk: str, what: str) -> None:
    """Put the change in the lab's event log (`vmlaunch logs SPEC --events`): a test's evidence then
    says which fault was set when, beside what QEMU reported of it."""
    from vmlaunch.lab import events

    log.debug("%s %s: %s", vm, disk, what)
    events.record(run_dir, vm, "VMLAUNCH_DISK_FAULT", {"message": f"disk fault {what}"}, disk=disk)
