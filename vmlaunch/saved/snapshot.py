"""Snapshots of a whole lab (`vmlaunch snapshot SPEC save|restore|list|delete`) and the warm start
(`up --from-snapshot NAME`).

QEMU keeps internal snapshots inside qcow2 images. A lab's snapshot NAME is, in each of its VMs, a
snapshot NAME on every writable disk, the first of which also holds the VM's RAM and device state
(QEMU's "vmstate"). `save` pauses every VM (QMP `stop`), runs one `snapshot-save` job per QEMU, all at
once, and resumes them together; `restore` does the same with `snapshot-load` jobs. Both hold the
lab's lock, so no `up` or `down` runs meanwhile.

What a VM's snapshot holds is decided here, from the spec (`vm_disks`): its writable disks in the
compiler's order (the image's overlay is `disk0`). Left out on purpose, and so never a reason to
refuse: the cloud-init seed (raw and read-only; `up` writes it anew) and the UEFI variable store
(raw; QEMU keeps the flash contents in guest memory, so the variables come back with the RAM: seen
here, a `snapshot-load` wrote `nvram.fd` back as it was at the save). The QMP jobs are given exactly
these nodes (`devices`) and the node for the RAM (`vmstate`). `-loadvm` and HMP `savevm` cannot be
told and take every writable node: QEMU 7.2 refuses a VM with UEFI ("Device 'fw-vars' is writable but
does not support snapshots"). So `up --from-snapshot` does not use `-loadvm`: QEMU starts paused as at
every `up` (`-S`), and a `snapshot-load` job loads the snapshot before the guest runs one instruction.

Refused before anything changes, every reason at once, each with the spec's line (`check`): a
writable raw disk (only qcow2 holds internal snapshots), a 9p share (QEMU 7.2 blocks migration, and
with it the saving of RAM, while the guest has the share mounted: "Migration is disabled when VirtFS
export path '...' is mounted in the guest using mount_tag 'share0'"), a passed-through PCI device
(QEMU cannot save its state; vfio-pci blocks migration), a VM without a writable qcow2 disk to hold
its RAM, and for `save`/`restore` a VM that is not running. What the spec rules out is a problem of
the spec (`SnapshotUnsupported`, exit 2); the lab's state at the time, a run-time one (exit 4).

Clones: a clone's disks are copies of its source's, snapshots included. `runtime/fork.py` deletes
them from the copies (`drop_all`), and a snapshot a clone's disk holds from before its fork is never
listed for it nor loaded into it (`_own`): a restore never turns a clone back into its source.

Clocks: a loaded guest's clock reads the snapshot's time, behind by its age. After a load each VM
with SSH has its clock set to the host's over SSH, to within the time a line takes through SSH; the
others through their command channel, to the second; for a VM neither reaches vmlaunch says how far
behind it may be (`step_clocks`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vmlaunch.core.wait import remaining
from vmlaunch.errors import KeyPath, Location, RuntimeFailure, SpecUnfit, UsageError, VmlaunchError
from vmlaunch.lab import process as qemu
from vmlaunch.lab.journal import Journal, LabBusy, locked
from vmlaunch.lab.running import running_vms, ssh_argv_of
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import RunDir
from vmlaunch.qemu.opts import escape
from vmlaunch.qemu.qmp import QuickQmp
from vmlaunch.saved import intent
from vmlaunch.saved.intent import Intent, Operation
from vmlaunch.spec.model import Disk, DiskFormat, LabSpec, VmSpec

if TYPE_CHECKING:
    from vmlaunch.compile.plan import Plan, VmPlan
    from vmlaunch.qemu.qmp import AsyncQmp
    from vmlaunch.spec.forks import Clone

log = logging.getLogger(__name__)

# A letter or digit of any script, then those, '.', '_' or '-'. QEMU loads a snapshot by its ID first
# (qcow2's find_snapshot_by_id_or_name; `qemu-img snapshot -a 1` applies the snapshot with ID 1, not
# the one named "1"), and the IDs QEMU gives are numbers: a name of digits only could load another.
NAME = re.compile(r"[^\W_][\w.-]{0,63}")
NAME_BYTES = 255  # QEMU keeps a name in 256 bytes (QEMUSnapshotInfo.name): a longer one is cut short
JOB_POLL = 0.05  # seconds between query-jobs while a job runs (a save takes well under a second)
SSH_TIMEOUT = 15.0  # seconds for the SSH command that steps a guest's clock


class SnapshotRefused(RuntimeFailure):
    """The lab cannot be snapshotted (or restored) as it is now: nothing was changed."""


class SnapshotUnsupported(SnapshotRefused, SpecUnfit):
    """The spec asks for what a snapshot cannot hold (a raw disk, a 9p share, a PCI device, a VM
    without a qcow2 disk): a problem of the spec, exit 2 as every other; nothing was changed."""


def check_name(name: str, *, number_ok: bool = False) -> str:
    """`name` when it can name a snapshot; UsageError saying why not. `number_ok` (delete): a name of
    digits only too, which QEMU deletes by name (see `delete`) but would load by ID."""
    if NAME.fullmatch(name) is None or len(name.encode()) > NAME_BYTES:
        raise UsageError(f"{name!r} is not a snapshot name: a letter or digit, then up to 63 letters, "
                         f"digits, '.', '_' or '-' (at most {NAME_BYTES} bytes in UTF-8)")
    if name.isdigit() and not number_ok:
        raise UsageError(f"{name!r} is not a snapshot name: QEMU takes a number for the ID of a "
                         "snapshot, so it could load another one", "add a letter, e.g. "
                         f"'snap{name}'")
    return name


# --- what a VM's snapshot holds ----------------------------------------------------------------------


@attrs.frozen
class SnapDisk:
    """A writable qcow2 disk of a VM: its block node in the VM's QEMU, its file, its spec key."""

    node: str
    file: Path
    key: KeyPath


@attrs.frozen
class VmDisks:
    """The disks a VM's snapshot is made of; the first holds the RAM and device state."""

    vm: str
    disks: tuple[SnapDisk, ...]

    @property
    def vmstate(self) -> str:
        return self.disks[0].node

    @property
    def devices(self) -> list[str]:
        return [disk.node for disk in self.disks]


def _numbered_disks(lab: LabSpec, vm: VmSpec) -> list[tuple[str, Disk, KeyPath]]:
    """Every disk of the VM with its block node name, as `compiler._Compiler.boot_disks` and `disks`
    number them (`disk0`, `disk1`, ...): the image's overlay first, then its [[disk]]s."""
    disks: list[tuple[KeyPath, Disk]] = [(("vm", vm.name, "disk", index), disk)
                                         for index, disk in enumerate(vm.disks)]
    if vm.image is not None:
        overlay = Disk(file=LabDir.of(lab.file, lab.name).vm(vm.name).overlay, format=DiskFormat.QCOW2)
        disks.insert(0, (("vm", vm.name, "image"), overlay))
    return [(f"disk{index}", disk, key) for index, (key, disk) in enumerate(disks)]


def vm_disks(lab: LabSpec, vm: VmSpec) -> VmDisks:
    """The VM's writable qcow2 disks: what its snapshots live on (read-only and raw disks are not)."""
    return VmDisks(vm.name, tuple(SnapDisk(node, disk.file, key)
                                  for node, disk, key in _numbered_disks(lab, vm)
                                  if not disk.readonly and disk.format is DiskFormat.QCOW2))


def _where(lab: LabSpec, key: KeyPath) -> str:
    return str(Location(lab.file, lab.source.line_of(key), key))


def problems(lab: LabSpec, vm: VmSpec) -> list[str]:
    """Why this VM cannot be snapshotted, one line each (none: it can)."""
    found = []
    for _, disk, key in _numbered_disks(lab, vm):
        if not disk.readonly and disk.format is not DiskFormat.QCOW2:
            found.append(f"{_where(lab, key)} the {disk.format.value} disk {disk.file} cannot hold a "
                         "snapshot: only qcow2 keeps internal snapshots (convert it with `qemu-img "
                         "convert -O qcow2`, or make it readonly = true)")
    for index, share in enumerate(vm.shares):
        found.append(f"{_where(lab, ('vm', vm.name, 'share', index))} the 9p share of {share.source} "
                     "cannot be snapshotted: QEMU blocks migration, and so the saving of RAM, while "
                     f"the guest has it mounted (\"Migration is disabled when VirtFS export path "
                     f"'{share.source}' is mounted in the guest using mount_tag '{share.tag}'\")")
    for index, dev in enumerate(vm.pci):
        found.append(f"{_where(lab, ('vm', vm.name, 'pci', index))} the passed-through PCI device "
                     f"{dev.host} cannot be snapshotted: QEMU cannot save a host device's state "
                     "(vfio-pci blocks migration)")
    if not found and not vm_disks(lab, vm).disks:
        found.append(f"{_where(lab, ('vm', vm.name))} VM {vm.name} has no writable qcow2 disk to hold "
                     "its RAM and device state (add a [[disk]] with format = \"qcow2\")")
    return found


def check(lab: LabSpec, names: Sequence[str], *, running: Mapping[str, int] | None = None,
          doing: str = "snapshot lab {lab}") -> dict[str, VmDisks]:
    """Each named VM's snapshot disks, or SnapshotRefused with every reason why not; with `running`
    (name -> pid), each VM must also be in it. `doing` names the operation refused."""
    doing = doing.format(lab=lab.name)
    if not names:
        raise SnapshotUnsupported(f"cannot {doing}: it has no VM")
    found: list[str] = []
    unsupported = False  # a reason in the spec, not in the lab's state: exit 2 (SnapshotUnsupported)
    for name in names:
        vm = lab.vm(name)
        reasons = problems(lab, vm)
        unsupported = unsupported or bool(reasons)
        found += reasons
        if running is not None and name not in running:
            found.append(f"{_where(lab, ('vm', name))} VM {name} is not running")
    if found:
        down = running is not None and any(name not in running for name in names)
        hints = ["change the spec as each line says"] if unsupported else []
        hints.append("bring the lab up first; a lab that is down starts from a snapshot with `vmlaunch "
                     "up SPEC --from-snapshot NAME`" if down else "nothing was changed")
        refused = SnapshotUnsupported if unsupported else SnapshotRefused
        raise refused(f"cannot {doing}:\n" + "\n".join(found), "; ".join(hints))
    return {name: vm_disks(lab, lab.vm(name)) for name in names}


# --- the snapshots a disk holds ------------------------------------------------------------------------


@attrs.frozen
class SnapInfo:
    """One snapshot of one disk, as QEMU reports it."""

    name: str
    taken: float  # seconds since the epoch
    vm_state_size: int  # bytes of RAM and device state (0 on a disk that holds none)
    vm_clock: float  # QEMU's clock of the VM then: seconds it had run
    id: str = ""  # the disk's own number for it (QEMU gives "1", "2", ...)

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> SnapInfo:
        return cls(str(data["name"]), data["date-sec"] + data["date-nsec"] / 1e9,
                   int(data.get("vm-state-size", 0)), data["vm-clock-sec"] + data["vm-clock-nsec"] / 1e9,
                   str(data.get("id", "")))


Found = dict[str, dict[str, SnapInfo]]  # block node -> snapshot name -> what it is


def _found_up(nodes: Sequence[Mapping[str, Any]], disks: VmDisks) -> Found:
    """From a running QEMU's `query-named-block-nodes`, which reads each node's snapshot table."""
    wanted = set(disks.devices)
    found: Found = {node: {} for node in wanted}
    for node in nodes:
        if node.get("node-name") in wanted:
            found[node["node-name"]] = {snap["name"]: SnapInfo.of(snap)
                                        for snap in node.get("image", {}).get("snapshots", [])}
    return found


def _found_down(qemu_img: str, disks: VmDisks) -> Found:
    """From the files, with `qemu-img info -U` (no lock taken: a QEMU may hold them). A missing file
    has no snapshot."""
    found: Found = {}
    for disk in disks.disks:
        try:
            table = _table(qemu_img, disk.file) if disk.file.exists() else []
        except RuntimeFailure as exc:
            raise RuntimeFailure(f"{disks.vm}: {exc.message}") from None
        found[disk.node] = {snap.name: snap for snap in table}
    return found


def _table(qemu_img: str, file: Path) -> list[SnapInfo]:
    """Every snapshot a qcow2 file holds, in its order, read with `qemu-img info -U`."""
    import json

    argv = [qemu_img, "info", "-U", "--output=json", "-f", "qcow2", str(file)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise RuntimeFailure(f"cannot read the snapshots of {file}: {qemu_img}: {exc.strerror or exc}",
                             "install qemu-utils") from None
    if done.returncode != 0:
        raise RuntimeFailure(f"cannot read the snapshots of {file}: "
                             f"{done.stderr.strip() or f'qemu-img exited with {done.returncode}'}")
    return [SnapInfo.of(snap) for snap in json.loads(done.stdout).get("snapshots", [])]


def drop_all(qemu_img: str, file: Path) -> None:
    """Delete every internal snapshot of a qcow2 file no QEMU has open (a clone's copy of its source's
    disk, `runtime/fork.py`), with `qemu-img snapshot -d` by name; RuntimeFailure when some are left.
    Read again after: a qemu-img that took a name for another snapshot's ID deleted that one, so a
    second round deletes what is left."""
    for _ in range(2):
        table = _table(qemu_img, file)
        if not table:
            return
        image = f"driver=qcow2,file.driver=file,file.filename={escape(str(file))}"
        for snap in table:
            subprocess.run([qemu_img, "snapshot", "--image-opts", "-q", "-d", snap.name, image],
                           capture_output=True, check=False, stdin=subprocess.DEVNULL)
    left = _table(qemu_img, file)
    if left:
        raise RuntimeFailure(f"cannot delete the snapshots {file} holds from its source "
                             f"({', '.join(repr(snap.name) for snap in left)}): a restore would turn "
                             "the clone back into it")


def _clones_of(run_dir: RunDir) -> dict[str, Clone]:
    """The lab's clones that say when they were forked, by name (`resources/clone.py`'s book)."""
    from vmlaunch.resources.clone import read_book

    return {clone.name: clone for clone in read_book(run_dir).clones if clone.forked > 0}


def _own(found: Found, clone: Clone | None) -> Found:
    """What a VM's disks hold of its own: for a clone, only what was taken once it was forked; what was
    taken before came with the copies of its source's disks (a fork drops those; one an older
    vmlaunch made kept them). A restore must never turn a clone back into its source."""
    if clone is None:
        return found
    return {node: {tag: snap for tag, snap in tags.items() if snap.taken >= clone.forked}
            for node, tags in found.items()}


def _found(run_dir: RunDir, disks: VmDisks, running: Mapping[str, int], qemu_img: str) -> Found:
    if disks.vm in running:
        with QuickQmp(run_dir.vm(disks.vm).qmp, timeout=5) as qmp:
            return _found_up(qmp.cmd("query-named-block-nodes", flat=True), disks)
    return _found_down(qemu_img, disks)


def _missing(found: Found, disks: VmDisks, name: str) -> list[SnapDisk]:
    """The VM's disks without the snapshot; the first disk without its RAM counts as missing too."""
    missing = [disk for disk in disks.disks if name not in found.get(disk.node, {})]
    first = found.get(disks.vmstate, {}).get(name)
    if first is not None and first.vm_state_size == 0:
        missing.insert(0, disks.disks[0])
    return missing


# --- list ----------------------------------------------------------------------------------------------


@attrs.frozen
class VmSnapshot:
    """A snapshot as one VM has it (`snapshot list`)."""

    name: str
    vm: str
    taken: float
    vm_state_size: int
    vm_clock: float
    missing: tuple[str, ...] = ()  # the disk files that lack it: restore refuses such a snapshot

    @property
    def complete(self) -> bool:
        return not self.missing

    def to_json(self) -> dict[str, Any]:
        return {"taken": self.taken, "vm_state_size": self.vm_state_size,
                "vm_clock": self.vm_clock, "complete": self.complete, "missing": list(self.missing)}


def list_snapshots(run_dir: RunDir, lab: LabSpec, *, qemu_img: str = "qemu-img") -> list[VmSnapshot]:
    """Every snapshot of every VM of the lab, by name then VM: from QEMU for a VM that runs, from its
    disk files (`qemu-img info -U`) for one that is down."""
    settle_unlocked(run_dir)
    names = [vm.name for vm in lab.vms]
    running = running_vms(Journal.load(run_dir), names)
    clones = _clones_of(run_dir)
    result = []
    for name in names:
        disks = vm_disks(lab, lab.vm(name))
        if not disks.disks:
            continue
        found = _own(_found(run_dir, disks, running, qemu_img), clones.get(name))
        tags = sorted({tag for per_node in found.values() for tag in per_node})
        for tag in tags:
            info = found[disks.vmstate].get(tag) or next(n[tag] for n in found.values() if tag in n)
            missing = tuple(str(disk.file) for disk in _missing(found, disks, tag))
            result.append(VmSnapshot(tag, name, info.taken, info.vm_state_size, info.vm_clock, missing))
    return sorted(result, key=lambda snap: (snap.name, names.index(snap.vm)))


# --- jobs on running VMs ---------------------------------------------------------------------------------


async def _job(qmp: AsyncQmp, vm: str, command: str, deadline: float, **args: Any) -> None:
    """Run one snapshot job in a VM's QEMU until it concludes; dismiss it; raise its error."""
    import asyncio

    job_id = f"vmlaunch-{command}"
    for job in await qmp.cmd("query-jobs"):  # one a killed vmlaunch left behind would block the id
        if job.get("id") == job_id and job.get("status") == "concluded":
            await qmp.cmd("job-dismiss", id=job_id)
    await qmp.cmd(command, **{"job-id": job_id, **args})
    while True:
        job = next((job for job in await qmp.cmd("query-jobs") if job.get("id") == job_id), None)
        if job is None:
            raise RuntimeFailure(f"{vm}: QEMU's {command} job vanished")
        if job.get("status") == "concluded":
            await qmp.cmd("job-dismiss", id=job_id)
            if "error" in job:
                raise RuntimeFailure(f"{vm}: {command}: {job['error']}")
            return
        if time.monotonic() >= deadline:
            raise RuntimeFailure(f"{vm}: {command} did not finish in time (QEMU's job is "
                                 f"{job.get('status')})", "a larger --timeout for VMs with much memory")
        await asyncio.sleep(JOB_POLL)


class _Lab:
    """One QMP connection per VM for a snapshot operation, and the VMs it paused."""

    def __init__(self, sockets: Mapping[str, Path]) -> None:
        from vmlaunch.qemu.qmp import AsyncQmp

        self.qmps = {name: AsyncQmp(path, timeout=10) for name, path in sockets.items()}
        self.paused: list[str] = []  # by us, running before: resumed at the end

    async def __aenter__(self) -> _Lab:
        failed = await self.each(list(self.qmps), lambda name, qmp: qmp.connect())
        if failed:
            await self.__aexit__()
            raise RuntimeFailure("; ".join(f"{name}: {message}" for name, message in failed.items()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        import asyncio

        await asyncio.gather(*(qmp.close() for qmp in self.qmps.values()))

    async def each(self, names: Sequence[str],
                   step: Callable[[str, AsyncQmp], Awaitable[Any]]) -> dict[str, str]:
        """`step` for every named VM at once; VM -> what failed (every step runs, whatever fails)."""
        import asyncio

        outcomes = await asyncio.gather(*(step(name, self.qmps[name]) for name in names),
                                        return_exceptions=True)
        failed = {}
        for name, outcome in zip(names, outcomes):
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # Ctrl-C, SystemExit
            if isinstance(outcome, Exception):
                failed[name] = str(outcome.message if isinstance(outcome, RuntimeFailure) else outcome)
        return failed

    async def states(self) -> dict[str, str]:
        """Each VM's run state ("running", "paused", ...; "" when QEMU did not say)."""
        states: dict[str, str] = {}

        async def query(name: str, qmp: AsyncQmp) -> None:
            states[name] = str((await qmp.cmd("query-status")).get("status", ""))

        failed = await self.each(list(self.qmps), query)
        if failed:
            raise RuntimeFailure("could not read every VM's state: " + "; ".join(failed.values()))
        return states

    async def pause(self, run_dir: RunDir, operation: Operation, name: str,
                    disks: Mapping[str, VmDisks], held: Sequence[str] = ()) -> None:
        """Stop every VM that runs, together, once the intent to is written (saved/intent.py): which VMs
        this operation pauses, so that a vmlaunch killed half-way leaves the next command what it
        needs to resume them. A VM the user paused stays paused afterwards; `held`, VMs an
        interrupted restore left paused, are resumed with the rest once this one succeeds."""
        running = [vm for vm, state in (await self.states()).items() if state == "running"]
        self.paused = [*running, *(vm for vm in held if vm not in running)]
        intent.begin(run_dir, operation, name, tuple(self.qmps), tuple(self.paused),
                     {vm: tuple((disk.node, str(disk.file)) for disk in disks[vm].disks) for vm in disks})
        failed = await self.each(running, lambda vm, qmp: qmp.cmd("stop"))
        if failed:
            raise RuntimeFailure("could not pause every VM: " + "; ".join(failed.values()))

    async def resume(self, names: Sequence[str] | None = None) -> dict[str, str]:
        chosen = [name for name in self.paused if names is None or name in names]
        failed = await self.each(chosen, lambda name, qmp: qmp.cmd("cont"))
        self.paused = [name for name in self.paused if name not in chosen or name in failed]
        return failed

    async def found(self, disks: Mapping[str, VmDisks]) -> dict[str, Found]:
        """Each VM's snapshots, from its QEMU."""
        found: dict[str, Found] = {}

        async def query(name: str, qmp: AsyncQmp) -> None:
            found[name] = _found_up(await qmp.cmd("query-named-block-nodes", flat=True), disks[name])

        failed = await self.each(list(disks), query)
        if failed:
            raise RuntimeFailure("could not read the VMs' snapshots: " + "; ".join(failed.values()))
        return found


def _sockets(run_dir: RunDir, names: Iterable[str]) -> dict[str, Path]:
    return {name: run_dir.vm(name).qmp for name in names}


def _run(coroutine: Any) -> Any:
    import asyncio

    return asyncio.run(coroutine)


def _failure(what: str, failed: Mapping[str, str]) -> str:
    return f"{what}:\n" + "\n".join(f"  {message}" for message in failed.values())


# --- save --------------------------------------------------------------------------------------------


def save(run_dir: RunDir, lab: LabSpec, name: str, *, timeout: float = 60.0, force: bool = False) -> None:
    """Snapshot every VM of the lab as NAME: pause them all, save, resume them all.

    A NAME that any VM has already is refused unless `force`, which deletes it first (if the new save
    then fails, neither is left). On a failure every VM is resumed and what was saved of NAME is
    deleted again."""
    check_name(name)
    names = [vm.name for vm in lab.vms]
    with locked(run_dir, timeout):
        settle(run_dir, timeout, strict=True)
        held = intent.held_paused(run_dir)
        if held:  # their memory may be half loaded: no snapshot of that
            why = next(iter(held.values()))
            raise SnapshotRefused(f"cannot snapshot lab {lab.name}: {', '.join(held)} "
                                  f"{'is' if len(held) == 1 else 'are'} kept paused {why}")
        disks = check(lab, names, running=running_vms(Journal.load(run_dir), names))
        _faults_off(run_dir, disks, "snapshot save")
        _run(_save(run_dir, disks, name, time.monotonic() + timeout, force))
    log.debug("lab %s: saved snapshot %s of %s", lab.name, name, ", ".join(names))


def _faults_off(run_dir: RunDir, vms: Iterable[str], doing: str) -> None:
    """Disk faults come off before a snapshot: a held request keeps a VM from pausing (a drain never
    ends), and a fault is no part of a VM's state."""
    if not run_dir.disk_faults.exists():
        return
    from vmlaunch.rig import diskfault

    for cleared in diskfault.undo(run_dir, list(vms), why=doing):
        log.warning("%s: its disk faults were taken off for the %s", cleared, doing)


async def _save(run_dir: RunDir, disks: Mapping[str, VmDisks], name: str, deadline: float,
                force: bool) -> None:
    async with _Lab(_sockets(run_dir, disks)) as lab:
        found = await lab.found(disks)
        have = [vm for vm in disks if any(name in tags for tags in found[vm].values())]
        if have and not force:
            raise SnapshotRefused(f"snapshot {name!r} exists already in {', '.join(have)}",
                                  "`--force` replaces it; `vmlaunch snapshot SPEC list` shows them all")
        settled = False  # done, or undone: the intent goes; else the next command finishes it
        try:
            await lab.pause(run_dir, Operation.SAVE, name, disks)  # in the try: a VM paused
            # before another failed to is resumed
            if have:
                failed = await lab.each(have, lambda vm, qmp: _delete_job(qmp, vm, disks[vm], found[vm],
                                                                          name, deadline))
                if failed:
                    raise RuntimeFailure(_failure(f"could not delete the old snapshot {name!r}", failed))
            failed = await lab.each(list(disks), lambda vm, qmp: _job(
                qmp, vm, "snapshot-save", deadline, tag=name, vmstate=disks[vm].vmstate,
                devices=disks[vm].devices))
            if failed:
                left = await _remove_partial(lab, disks, name, deadline)
                settled = not left
                raise RuntimeFailure(_failure(f"snapshot {name!r} failed", failed) + left,
                                     "every VM was resumed")
            settled = True
        finally:
            not_resumed = await lab.resume()
            if not_resumed:
                log.warning("%s", _failure("could not resume", not_resumed))
            elif settled:
                intent.end(run_dir)


async def _delete_job(qmp: AsyncQmp, vm: str, disks: VmDisks, found: Found, name: str,
                      deadline: float) -> None:
    devices = [node for node in disks.devices if name in found.get(node, {})]
    if devices:
        await _job(qmp, vm, "snapshot-delete", deadline, tag=name, devices=devices)


async def _remove_partial(lab: _Lab, disks: Mapping[str, VmDisks], name: str, deadline: float) -> str:
    """After a failed save: delete NAME wherever it was made. Returns what could not be, as text."""
    try:
        found = await lab.found(disks)
    except RuntimeFailure as exc:
        return f"\n  and the partial snapshot may be left: {exc.message}"
    failed = await lab.each(list(disks), lambda vm, qmp: _delete_job(qmp, vm, disks[vm], found[vm], name,
                                                                     max(deadline, time.monotonic() + 10)))
    return "".join(f"\n  and the partial snapshot is left: {message}" for message in failed.values())


# --- restore ------------------------------------------------------------------------------------------


def restore(run_dir: RunDir, lab: LabSpec, name: str, *, timeout: float = 60.0) -> None:
    """Bring every VM of the lab back to snapshot NAME: each must have it whole; pause them all, load
    it into each, resume them all; then step the clocks of the guests with SSH."""
    check_name(name)
    names = [vm.name for vm in lab.vms]
    with locked(run_dir, timeout):
        settle(run_dir, timeout, strict=True)
        running = running_vms(Journal.load(run_dir), names)
        disks = check(lab, names, running=running, doing="restore lab {lab}")
        _faults_off(run_dir, disks, "snapshot restore")
        taken = _run(_restore(run_dir, disks, name, time.monotonic() + timeout, _clones_of(run_dir)))
    log.debug("lab %s: restored snapshot %s", lab.name, name)
    step_clocks(taken, {vm.name: functools.partial(ssh_argv_of, run_dir, lab, vm.name)
                        for vm in lab.vms if vm.ssh}, run_dir)


async def _restore(run_dir: RunDir, disks: Mapping[str, VmDisks], name: str, deadline: float,
                   clones: Mapping[str, Clone]) -> dict[str, float]:
    """Load NAME into every VM; returns VM -> when the snapshot was taken. A clone forked after NAME
    was taken has no part in it: the restore is refused (`_own`)."""
    async with _Lab(_sockets(run_dir, disks)) as lab:
        found = {vm: _own(per_vm, clones.get(vm)) for vm, per_vm in (await lab.found(disks)).items()}
        if not any(name in tags for per_node in found.values() for tags in per_node.values()):
            raise SnapshotRefused(f"the lab has no snapshot {name!r}",
                                  "`vmlaunch snapshot SPEC list` shows the snapshots; nothing was changed")
        lacking = {vm: _missing(found[vm], disks[vm], name) for vm in disks}
        lacking = {vm: missing for vm, missing in lacking.items() if missing}
        later = [vm for vm in lacking if vm in clones and not any(name in t for t in found[vm].values())]
        if later:
            raise SnapshotRefused(
                f"cannot restore {name!r}: {', '.join(later)} {'was' if len(later) == 1 else 'were'} forked "
                f"after it was taken, so {'has' if len(later) == 1 else 'have'} no part in it: nothing was "
                f"changed", f"`vmlaunch down SPEC {' '.join(later)}` removes "
                f"{'that clone' if len(later) == 1 else 'those clones'}; then restore")
        if lacking:
            raise SnapshotRefused(f"snapshot {name!r} is not whole in every VM of the lab: " + "; ".join(
                f"{vm} lacks it on {', '.join(str(disk.file) for disk in missing)}"
                for vm, missing in lacking.items()), "`vmlaunch snapshot SPEC list` shows what each has; "
                "nothing was changed")
        failed: dict[str, str] = {}
        interrupted = intent.read(run_dir)  # finish_interrupted kept it: VMs it holds paused
        held = interrupted.paused if interrupted is not None else ()
        loaded = False
        try:
            await lab.pause(run_dir, Operation.RESTORE, name, disks, held)
            failed = await lab.each(list(disks), lambda vm, qmp: _job(
                qmp, vm, "snapshot-load", deadline, tag=name, vmstate=disks[vm].vmstate,
                devices=disks[vm].devices))
            loaded = True
        finally:
            # A VM whose load failed holds half of it: it stays paused, for the user to decide.
            not_resumed = await lab.resume([vm for vm in disks if vm not in failed] if loaded else [])
            if loaded:
                holding = tuple(vm for vm in lab.paused if vm in failed)
                if holding:
                    current = intent.read(run_dir)
                    if current is not None:
                        intent.write(run_dir, current.with_paused(holding))
                else:
                    intent.end(run_dir)
        if failed:
            raise RuntimeFailure(_failure(f"restoring snapshot {name!r} failed", failed),
                                 f"{', '.join(failed)} {'is' if len(failed) == 1 else 'are'} left paused "
                                 "(its memory may be half loaded): restore again, or `vmlaunch down SPEC`")
        if not_resumed:
            log.warning("%s", _failure("could not resume", not_resumed))
        return {vm: found[vm][disks[vm].vmstate][name].taken for vm in disks}


# --- an interrupted save or restore ---------------------------------------------------------------------


def finish_interrupted(run_dir: RunDir, timeout: float = 60.0) -> list[str]:
    """Finish or undo a snapshot save or restore whose vmlaunch was killed (its intent is still in the
    run dir); the caller holds the lab's lock, so the one that wrote it is gone. Returns what was
    done, one line each, for the caller to say.

    - save: the snapshot jobs QEMU still runs are waited for; the name is kept where every VM holds it
      whole, else deleted from every VM that has it (a name is on every VM of the lab or on none);
      the VMs that save paused are resumed.
    - restore: a VM it paused may hold half of the snapshot's memory: it stays paused, and the intent
      with it, until a restore loads a snapshot whole (and resumes it) or the lab goes down."""
    try:
        found = intent.read(run_dir)
    except intent.IntentError as exc:  # written atomically: only a hand could have damaged it
        intent.end(run_dir)
        return [f"{exc.message}: removed; a VM a snapshot operation paused stays paused (`vmlaunch "
                "status SPEC` shows which): `vmlaunch resume SPEC VM` resumes it, unless its memory "
                "may be half loaded (a restore): then `vmlaunch snapshot SPEC restore NAME` again"]
    if found is None:
        return []
    deadline = time.monotonic() + timeout
    running = [vm for vm in found.vms if qemu.find_pid(run_dir.vm(vm)) is not None]
    return list(_run(_finish(run_dir, found, running, deadline)))


def _intent_disks(found: Intent, vm: str) -> VmDisks:
    pairs = found.disks.get(vm, ())
    return VmDisks(vm, tuple(SnapDisk(node, Path(file), ("vm", vm)) for node, file in pairs))


async def _finish(run_dir: RunDir, found: Intent, running: Sequence[str], deadline: float) -> list[str]:
    what = f"{found.describe()} was interrupted (vmlaunch pid {found.pid} is gone)"
    gone = [vm for vm in found.vms if vm not in running]
    said = [f"{what}: {', '.join(gone)} no longer {'runs' if len(gone) == 1 else 'run'}"] if gone else []
    async with _Lab(_sockets(run_dir, running)) as lab:
        await lab.each(list(running), lambda vm, qmp: _settle_jobs(qmp, deadline))
        states = await lab.states()
        if found.operation is Operation.RESTORE:
            held = tuple(vm for vm in found.paused if states.get(vm) == "paused")
            if not held:
                intent.end(run_dir)
                return [*said, f"{what}: no VM is left paused"]
            if held != found.paused:
                intent.write(run_dir, found.with_paused(held))
            return [*said, f"{what}: {', '.join(held)} {'is' if len(held) == 1 else 'are'} kept paused "
                    f"{intent.interrupted_restore(found)}"]
        disks = {vm: _intent_disks(found, vm) for vm in running}
        have = await lab.found(disks)
        holders = [vm for vm in running if any(found.snapshot in tags for tags in have[vm].values())]
        whole = not gone and all(not _missing(have[vm], disks[vm], found.snapshot) for vm in running)
        if whole:
            said.append(f"{what}: {found.snapshot!r} was saved whole in every VM: kept")
        elif holders:
            failed = await lab.each(holders, lambda vm, qmp: _delete_job(
                qmp, vm, disks[vm], have[vm], found.snapshot, deadline))
            done = [vm for vm in holders if vm not in failed]
            if done:
                said.append(f"{what}: the half-saved {found.snapshot!r} was deleted from {', '.join(done)}")
            said += [f"{what}: {message}" for message in failed.values()]
        lab.paused = [vm for vm in found.paused if states.get(vm) == "paused"]
        not_resumed = await lab.resume()
        resumed = [vm for vm in found.paused if states.get(vm) == "paused" and vm not in not_resumed]
        if resumed:
            said.append(f"{what}: {', '.join(resumed)} resumed")
        said += [f"{what}: could not resume {message}" for message in not_resumed.values()]
        if not not_resumed:
            intent.end(run_dir)
    return said


async def _settle_jobs(qmp: AsyncQmp, deadline: float) -> None:
    """Wait for the snapshot jobs a killed vmlaunch started to conclude, and dismiss them."""
    import asyncio

    while True:
        jobs = [job for job in await qmp.cmd("query-jobs") if str(job.get("id", "")).startswith("vmlaunch-")]
        for job in jobs:
            if job.get("status") == "concluded":
                await qmp.cmd("job-dismiss", id=job["id"])
        if all(job.get("status") == "concluded" for job in jobs) or time.monotonic() >= deadline:
            return
        await asyncio.sleep(JOB_POLL)


# --- the guests' clocks ---------------------------------------------------------------------------------


# Run as root in the guest: print its clock, then set it to the time that comes on standard input. The
# host sends its time only once that first line arrives: the clock is then right to within the time a
# line takes through SSH, not the seconds SSH takes to connect to a TCG guest.
_SET_CLOCK = 'date +%s.%N; read t; date -u -s "@$t" >/dev/null'


def step_clocks(taken: Mapping[str, float], ssh: Mapping[str, Callable[[list[str]], list[str]]],
                run_dir: RunDir | None = None) -> None:
    """After a load, set each guest's clock to the host's over SSH where the VM has SSH (`ssh[vm]`
    makes the command line that runs words there), else through its command channel (in `run_dir`)
    where its agent answers, all at once; say so for the others. `taken`: VM -> when its snapshot was
    taken.

    A loaded guest's clock reads the snapshot's time, behind by its age, while QEMU's RTC follows the
    host's (`hwclock -s` in the guest sets the clock from it). Seen here under TCG with a Debian guest:
    131 s behind after a warm start, 132 s after a restore in its running QEMU; the busybox test
    guest, restored in its running QEMU, kept its clock running instead (its kernel had switched to
    another clocksource once the TSC jumped). Under KVM, kvmclock resumes from the snapshot too (not
    seen: KVM runs no guest on this machine)."""
    from concurrent.futures import ThreadPoolExecutor

    for vm, when in taken.items():
        if vm not in ssh and run_dir is None:
            log.info("%s: its clock may be up to %.0f s behind (the snapshot's age): it has no SSH to set "
                     "it with (NTP or `hwclock -s` in the guest does)", vm, max(0.0, time.time() - when))
    chosen = [vm for vm in taken if vm in ssh or run_dir is not None]
    if not chosen:
        return

    def step(vm: str) -> float | str:
        if vm in ssh:
            return _step_clock(ssh[vm])
        assert run_dir is not None  # chosen without SSH only with a run dir
        return _step_clock_by_channel(run_dir, vm)

    with ThreadPoolExecutor(len(chosen)) as pool:
        outcomes = list(pool.map(step, chosen))
    for vm, stepped in zip(chosen, outcomes):
        how = "" if vm in ssh else " through its command channel"
        if isinstance(stepped, float):
            log.info("%s: clock set to the host's%s (it was %.1f s %s)", vm, how, abs(stepped),
                     "behind" if stepped >= 0 else "ahead")
        elif vm in ssh:
            log.warning("%s: its clock could not be set to the host's: %s", vm, stepped)
        else:
            log.info("%s: its clock may be up to %.0f s behind (the snapshot's age): it has no SSH, and its "
                     "command channel could not set it (%s); NTP or `hwclock -s` in the guest does", vm,
                     max(0.0, time.time() - taken[vm]), stepped)


CHANNEL_CLOCK_WAIT = 10.0  # seconds for a loaded guest's agent to answer before its clock is left


def _step_clock_by_channel(run_dir: RunDir, vm: str) -> float | str:
    """Set the guest's clock to ours through its command channel (as root, to the second: busybox's
    `date -s` takes whole seconds): how far behind it was, or why it could not be set."""
    from vmlaunch.rig import agent

    sent = time.time()
    command = f"date +%s; date -u -s @{round(sent)} >/dev/null"
    try:
        result = agent.run(run_dir, vm, command, timeout=CHANNEL_CLOCK_WAIT, wait=CHANNEL_CLOCK_WAIT)
    except VmlaunchError as exc:
        return exc.message
    said = result.stdout.decode(errors="replace").split()
    if result.exit_code != 0 or not said or not said[0].isdigit():
        return f"`date -s` exited {result.exit_code}: {result.stderr.decode(errors='replace').strip()}"
    return sent - int(said[0])


def _step_clock(argv_of: Callable[[list[str]], list[str]], timeout: float = SSH_TIMEOUT) -> float | str:
    """Set the guest's clock to ours (as root through sudo, which the lab's user may): how far behind
    it was, or why it could not be set."""
    session = clock_session(argv_of, timeout=timeout)
    return session.error if session.error is not None else session.behind


@attrs.frozen
class ClockSession:
    """What one SSH session that set a guest's clock found: `error` None when the clock was set
    (`behind`: by how much it was behind, negative when ahead); `output` what `then` printed;
    `status` ssh's exit status (None when it did not finish; 255: SSH could not connect or log in;
    CLOCK_REFUSED: the clock could not be set, sudo refused)."""

    behind: float
    error: str | None
    output: str = ""
    status: int | None = None


CLOCK_REFUSED = 97  # the exit status of a clock session whose `sudo ... date -s` failed


def clock_session(argv_of: Callable[[list[str]], list[str]], then: str = "",
                  timeout: float = SSH_TIMEOUT) -> ClockSession:
    """In one SSH session: set the guest's clock to ours (as root through sudo), then run `then` (shell
    words, as the lab's user). The clock needs a line each way: the guest prints its clock, the host
    answers with its own once that line arrives."""
    import select
    import shlex

    command = f"sudo -n sh -c {shlex.quote(_SET_CLOCK)} || exit {CLOCK_REFUSED}"
    if then:
        command += f"; {then}"
    deadline = time.monotonic() + timeout
    try:
        argv = argv_of(["sh", "-c", command])
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    except (OSError, ValueError, RuntimeFailure) as exc:
        return ClockSession(0.0, str(exc))
    assert proc.stdout is not None
    try:
        if not select.select([proc.stdout], [], [], remaining(deadline))[0]:
            return ClockSession(0.0, f"SSH did not answer within {timeout:.0f} s")
        line = proc.stdout.readline()  # the guest's clock: the command runs now
        now = time.time()
        out, err = proc.communicate(f"{now:.6f}\n" if line else "", timeout=remaining(deadline, 1.0))
    except subprocess.TimeoutExpired:
        return ClockSession(0.0, f"SSH did not finish within {timeout:.0f} s")
    except (OSError, ValueError) as exc:  # a clock left unset is a warning, never a failed up
        return ClockSession(0.0, f"{type(exc).__name__}: {exc}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status = proc.returncode
    if not line or status in (255, CLOCK_REFUSED):
        lines = err.strip().splitlines()
        return ClockSession(0.0, lines[-1] if lines else f"ssh exited with {status}", out, status)
    try:
        behind = now - float(line)
    except ValueError:
        behind = 0.0  # set; its clock before is unknown (a `date` without %N)
    return ClockSession(behind, None, out, status)


# --- delete --------------------------------------------------------------------------------------------


def delete(run_dir: RunDir, lab: LabSpec, name: str, *, timeout: float = 60.0,
           qemu_img: str = "qemu-img") -> list[str]:
    """Delete snapshot NAME from every VM that has it: a QEMU job in a VM that runs, `qemu-img
    snapshot -d` on the disks of one that is down. Returns the VMs it was deleted from.

    Both find the snapshot by its name only, never by its ID (QEMU 7.2: `snapshot-delete` and
    `qemu-img snapshot -d` look it up with bdrv_snapshot_find, which compares names), so NAME may be
    a number here: `delete 1` deletes the snapshot named "1", not the one whose ID is 1. A qemu-img
    that took NAME for an ID first would delete that other one: `_delete_down` makes sure."""
    check_name(name, number_ok=True)
    names = [vm.name for vm in lab.vms]
    with locked(run_dir, timeout):
        settle(run_dir, timeout, strict=True)
        running = running_vms(Journal.load(run_dir), names)
        disks = {vm: vm_disks(lab, lab.vm(vm)) for vm in names}
        found = {vm: _found(run_dir, disks[vm], running, qemu_img) for vm in names if disks[vm].disks}
        have = [vm for vm, per_node in found.items() if any(name in tags for tags in per_node.values())]
        if not have:
            raise RuntimeFailure(f"no VM of lab {lab.name} has a snapshot {name!r}",
                                 "`vmlaunch snapshot SPEC list` shows the snapshots")
        up = [vm for vm in have if vm in running]
        failed: dict[str, str] = {}
        if up:
            failed = _run(_delete_up(run_dir, {vm: disks[vm] for vm in up}, {vm: found[vm] for vm in up},
                                     name, time.monotonic() + timeout))
        for vm in have:
            if vm not in running:
                for disk in disks[vm].disks:
                    if name in found[vm].get(disk.node, {}):
                        why = _delete_down(qemu_img, disk.file, name)
                        if why is not None:
                            failed[vm] = f"{failed[vm]}; {why}" if vm in failed else f"{vm}: {why}"
    if failed:
        raise RuntimeFailure(_failure(f"could not delete snapshot {name!r} everywhere", failed))
    return have


async def _delete_up(run_dir: RunDir, disks: Mapping[str, VmDisks], found: Mapping[str, Found], name: str,
                     deadline: float) -> dict[str, str]:
    async with _Lab(_sockets(run_dir, disks)) as lab:
        return await lab.each(list(disks), lambda vm, qmp: _delete_job(qmp, vm, disks[vm], found[vm], name,
                                                                       deadline))


def _delete_down(qemu_img: str, file: Path, name: str) -> str | None:
    """Delete snapshot NAME from a disk file with `qemu-img snapshot -d` (it has no -f: the format is
    given with --image-opts); None, or what went wrong.

    When another snapshot of the file has NAME for its ID, the file is left alone unless this
    qemu-img is seen to find snapshots by name (`_deletes_by_name`); and the file is read again after,
    to be sure exactly one snapshot named NAME went."""
    try:
        before = _table(qemu_img, file)
    except RuntimeFailure as exc:
        return exc.message
    other = next((snap for snap in before if snap.id == name and snap.name != name), None)
    if other is not None and not _deletes_by_name(qemu_img):
        return (f"{file}: not deleted: its snapshot {other.name!r} has the ID {name}, and {qemu_img} "
                f"could take {name!r} for that ID")
    image = f"driver=qcow2,file.driver=file,file.filename={escape(str(file))}"
    done = subprocess.run([qemu_img, "snapshot", "--image-opts", "-q", "-d", name, image],
                          capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        return f"{file}: {done.stderr.strip() or f'qemu-img exited with {done.returncode}'}"
    try:
        after = _table(qemu_img, file)
    except RuntimeFailure as exc:
        return exc.message
    gone = [snap for snap in before if snap not in after]
    if len(gone) != 1 or gone[0].name != name:
        shown = ", ".join(f"{snap.name!r} (ID {snap.id})" for snap in gone) or "nothing"
        return f"{file}: qemu-img snapshot -d {name} deleted {shown}"
    return None


@functools.cache
def _deletes_by_name(qemu_img: str) -> bool:
    """Whether this qemu-img's `snapshot -d X` deletes the snapshot named X, even when another one
    has the ID X: tried on a scratch image (QEMU 7.2's does; its `-a` takes the ID first, as the
    `-d` of old releases did)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="vmlaunch-") as folder:
        image = str(Path(folder) / "probe.qcow2")
        steps = [["create", "-q", "-f", "qcow2", image, "1M"], ["snapshot", "-c", "named", image],
                 ["snapshot", "-c", "1", image], ["snapshot", "-d", "1", image]]  # ids 1 and 2
        for step in steps:
            done = subprocess.run([qemu_img, *step], capture_output=True, check=False,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                return False
        try:
            return [snap.name for snap in _table(qemu_img, Path(image))] == ["named"]
        except RuntimeFailure:
            return False


# --- up --from-snapshot ---------------------------------------------------------------------------------


@attrs.frozen
class WarmStart:
    """`up --from-snapshot NAME`: what the executor needs to start VMs from a snapshot. Made by
    `warm_start`, which checked the VMs can be and that their disks hold it whole."""

    name: str
    disks: Mapping[str, VmDisks] = attrs.field(eq=False)
    taken: Mapping[str, float] = attrs.field(eq=False)  # VM -> when its snapshot was taken
    # VM -> the options of the file nodes `starting` opened through the page cache, as compiled
    reopen: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict, eq=False)
    # VM -> vmlaunch's own copies of the descriptors `starting` handed its QEMU (`close` closes them)
    descriptors: dict[str, list[int]] = attrs.field(factory=dict, eq=False)

    def starting(self, vm: VmPlan) -> VmPlan:
        """The VM as it starts for the load: the files of its snapshot disks through the host's page
        cache (cache.direct off), where the compiled line has O_DIRECT. QEMU reads the saved RAM from
        the first disk in small pieces: with O_DIRECT each one is a read from the disk (1.4-2.6 s for
        256 MiB of a Debian guest's RAM here, 0.2-0.9 s through the page cache that just wrote it).
        `load` reopens them as compiled (QMP blockdev-reopen) before the guest runs.

        A QEMU confined to a uid of its own (host/confine.py) cannot open those files again for the
        reopen (root's, mode 0600): vmlaunch opens each one and hands QEMU the descriptor in an fd set
        (`-add-fd`, `descriptors`), the node's filename being `/dev/fdset/N`. QEMU opens such a name by
        duplicating the descriptor, at start and at the reopen alike, never by path (QEMU 7.2; a
        reopen cannot change a node's filename, so the node starts with that name)."""
        argv, compiled = _page_cached(vm.argv, self.disks[vm.name].devices)
        argv, self.reopen[vm.name], self.descriptors[vm.name] = _through_descriptors(vm.name, argv, compiled)
        return attrs.evolve(vm, argv=argv)

    def close(self) -> None:
        """Once the QEMUs started (or failed to): vmlaunch's copies of their descriptors closed (each
        QEMU holds its own)."""
        for fds in self.descriptors.values():
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.descriptors.clear()

    def load(self, vms: Sequence[VmPlan], timeout: float) -> None:
        """Load the snapshot into each VM's QEMU, all at once, while they wait paused (`-S`) for their
        `cont`: the guests run their first instruction at the snapshot's instant. Then the disk files
        `starting` opened through the page cache go back to the cache mode they were compiled with
        (should that fail, they stay in the page cache, which is safe: flushes still reach the disk)."""
        if not vms:
            return
        names = [vm.name for vm in vms]

        async def load_one(vm: str, qmp: AsyncQmp) -> None:
            await _job(qmp, vm, "snapshot-load", time.monotonic() + timeout, tag=self.name,
                       vmstate=self.disks[vm].vmstate, devices=self.disks[vm].devices)
            if self.reopen.get(vm):
                try:
                    await qmp.cmd("blockdev-reopen", options=self.reopen[vm])
                except RuntimeFailure as exc:
                    log.warning("%s: its disks stay in the host's page cache after the load (QMP "
                                "blockdev-reopen: %s)", vm, exc.message)

        async def load_all() -> None:
            async with _Lab({vm.name: vm.files.qmp for vm in vms}) as lab:
                failed = await lab.each(names, load_one)
                if failed:
                    raise RuntimeFailure(_failure(f"loading snapshot {self.name!r} failed", failed))

        _run(load_all())
        log.info("%s: loaded snapshot %s", ", ".join(names), self.name)

    def step_clocks(self, plan: Plan, vms: Sequence[VmPlan], ports: Mapping[str, int | None]) -> None:
        """Once the VMs run: step the clocks of those with SSH (`ports`: VM -> its SSH port)."""
        from vmlaunch.guests.sshkeys import ssh_argv

        ssh: dict[str, Callable[[list[str]], list[str]]] = {}
        for vm in vms:
            port = ports.get(vm.name)
            if vm.ssh_user is not None and port is not None and plan.lab_dir is not None:
                ssh[vm.name] = functools.partial(ssh_argv, plan.lab_dir, vm.name, vm.ssh_user, port)
        step_clocks({vm.name: self.taken[vm.name] for vm in vms}, ssh, plan.run_dir)


def _page_cached(argv: Sequence[str], nodes: Iterable[str]) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """`argv` with the file nodes of the block nodes `nodes` (`NODE-file`, as the compiler names them)
    opened without O_DIRECT, and their options as they were. Nodes already without O_DIRECT, and
    those with aio=native (which needs it, and cannot change on a reopen), are left as they are."""
    import json

    from vmlaunch.qemu.opts import json_arg

    files = {f"{node}-file" for node in nodes}
    out, originals = list(argv), []
    for index in range(1, len(argv)):
        if argv[index - 1] != "-blockdev" or not argv[index].startswith("{"):
            continue
        options = json.loads(argv[index])
        cache = options.get("cache")
        if (options.get("node-name") in files and options.get("driver") == "file"
                and isinstance(cache, dict) and cache.get("direct") and options.get("aio") != "native"):
            originals.append(options)
            out[index] = json_arg({**options, "cache": {**cache, "direct": False}})
    return tuple(out), originals


def _through_descriptors(vm: str, argv: Sequence[str], compiled: Sequence[dict[str, Any]]) -> tuple[
        tuple[str, ...], list[dict[str, Any]], list[int]]:
    """`argv` with the file nodes `compiled` (their options as compiled) opened through descriptors
    vmlaunch opens here: each node's filename `/dev/fdset/N`, and `-add-fd fd=FD,set=N` for its
    descriptor. Returns that argv, the options to reopen each node with (as compiled, but for that
    filename) and the descriptors, which QEMU's process must be given. A qcow2 file whose backing
    file is named relative to it keeps its path: QEMU would look for that file beside /dev/fdset/N."""
    import json

    from vmlaunch.qemu.opts import json_arg

    out, reopen, fds = list(argv), [], []
    try:
        for options in compiled:
            path = str(options["filename"])
            flags = os.O_RDONLY if options.get("read-only") else os.O_RDWR
            try:
                fd = os.open(path, flags | os.O_CLOEXEC)
            except OSError as exc:
                raise RuntimeFailure(f"{vm}: cannot open {path} for its warm start: "
                                     f"{exc.strerror or exc}") from None
            if _backing_named_relative(fd):
                os.close(fd)
                reopen.append(options)
                continue
            fds.append(fd)
            fdset = len(fds)
            for index in range(1, len(out)):
                if out[index - 1] == "-blockdev" and out[index].startswith("{"):
                    node = json.loads(out[index])
                    if node.get("node-name") == options["node-name"]:
                        out[index] = json_arg({**node, "filename": f"/dev/fdset/{fdset}"})
            out += ["-add-fd", f"fd={fd},set={fdset},opaque={escape(str(options['node-name']))}"]
            reopen.append({**options, "filename": f"/dev/fdset/{fdset}"})
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return tuple(out), reopen, fds


def _backing_named_relative(fd: int) -> bool:
    """Whether the qcow2 file open as `fd` names a backing file by a relative name (or by a
    protocol's, `json:...`), which QEMU finds from the file's own name: its header (big-endian
    backing_file_offset at byte 8, backing_file_size at 16) and the name it points to."""
    import struct

    try:
        header = os.pread(fd, 20, 0)
        if len(header) < 20 or header[:4] != b"QFI\xfb":
            return False
        offset, size = struct.unpack(">QI", header[8:20])
        return bool(offset and size) and not os.pread(fd, 1, offset).startswith(b"/")
    except OSError:
        return False


def warm_start(lab: LabSpec, names: Sequence[str], name: str, *, qemu_img: str | None = None) -> WarmStart:
    """Check that these VMs can start from snapshot NAME: none of them has what a snapshot refuses,
    and each holds NAME whole on its disks (read with `qemu-img info -U`). Whether they already run
    is for `executor.up` to refuse, under the lab's lock."""
    check_name(name)
    disks = check(lab, names, doing=f"start lab {{lab}} from snapshot {name!r}")
    taken: dict[str, float] = {}
    lacking = []
    for vm, layout in disks.items():
        found = _found_down(qemu_img or "qemu-img", layout)
        missing = _missing(found, layout, name)
        if missing:
            lacking.append(f"{_where(lab, missing[0].key)} {vm} has no snapshot {name!r} on "
                           f"{', '.join(str(disk.file) for disk in missing)}")
        else:
            taken[vm] = found[layout.vmstate][name].taken
    if lacking:
        raise SnapshotRefused(f"cannot start lab {lab.name} from snapshot {name!r}:\n" + "\n".join(lacking),
                              "`vmlaunch snapshot SPEC list` shows the snapshots each VM has")
    return WarmStart(name, disks, taken)


# --- an operation a killed vmlaunch left --------------------------------------------------------------


def settle(run_dir: RunDir, timeout: float = 60.0, *, strict: bool = False) -> None:
    """Finish or undo an operation a killed vmlaunch left (`finish_interrupted`) and say what
    was done; the caller holds the lab's lock. One that cannot be finished is said, and never stops
    the command that found it (`up`, `down`, `resume`...), unless `strict`: a snapshot operation must
    not write its own intent over one still to finish."""
    if not os.path.lexists(run_dir.intent):
        return  # the usual case

    try:
        for line in finish_interrupted(run_dir, timeout):
            log.warning("%s", line)
    except VmlaunchError as exc:
        if strict:
            raise
        log.warning("an interrupted snapshot operation could not be finished: %s", exc.message)


def settle_unlocked(run_dir: RunDir, timeout: float = 60.0) -> Intent | None:
    """For a command that does not hold the lab's lock (`status`, `snapshot list`): when an operation
    was recorded and nobody holds the lock (so it was interrupted), take the lock and finish it
    (`settle`); when another vmlaunch holds it, the operation is under way: leave it, and
    return it."""
    if not os.path.lexists(run_dir.intent):
        return None
    try:
        with locked(run_dir, 0):
            settle(run_dir, timeout)
    except LabBusy:
        with contextlib.suppress(intent.IntentError):
            return intent.read(run_dir)
    return None
