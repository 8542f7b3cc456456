"""`vmlaunch fork SPEC VM --count N`: N running copies of a running VM, each a new member of its lab,
each with an identity of its own, made from one save of the VM's state.

Save once, load N times (QEMU's migration, as its facts in ../shared/QEMU-FACTS.md and the issue
have them):

1. Under the lab's lock, before anything changes: the source must run and QEMU must be able to move it
   (no PCI device passed through, no 9p share), the lab's budget must hold the clones, their names
   must be free, and the guest must answer on its command channel (how each clone learns who it is;
   `--same-identity` forks a guest without one, loudly). The fork is written in the lab's book of
   clones (`forks.json`, `resources/clone.py`) before the first change, with the clones it makes.
2. Each clone's resources (its folder, seed and host key, its taps, its uid) are applied and
   journaled as `up` does, as members of the lab.
3. The source is paused (QMP `stop`: QEMU drains and flushes its disks), its state is saved through
   a file descriptor QEMU is given (`getfd`, then `migrate fd:`; `exec:` would need a process QEMU's
   sandbox does not let it start) with the migration's bandwidth cap lifted, while its writable disks
   (its overlay, each `[[disk]]`, its UEFI variables) are copied for each clone, sparse (and shared
   by reflink where the file system can). Then the source resumes: it was paused for as long as the
   save and the copies took. The copies then lose the internal snapshots they hold from the source
   (`qemu-img snapshot -d`, milliseconds each): a clone's snapshots are its own, so a restore never
   turns it back into its source.
4. Each clone's QEMU starts with `-incoming defer`, the source's machine, memory and devices, its own
   sockets, disks, NICs (new MACs, its own taps) and SSH port, loads the saved state
   (`migrate-incoming fd:`) and runs. Its VM generation id is new (QEMU writes a fresh one into the
   guest after a load): a Linux guest reseeds its random numbers.
5. Through the command channel, each clone is given its identity: its clock from the host, its MACs
   seen by the guest (and the network configuration that matches them), a static address of its own
   on static-address networks (the next free one in the subnet), its hostname, a new machine-id (and
   with systemd-networkd a restart of it, so a DHCP lease is asked for with the new client id), new
   SSH host keys (the pin in the lab's known_hosts is the new key).

Killed at any point, the next command that takes the lab's lock (`up`, `down`, another `fork`) finds
the fork still written in the book and undoes it (`executor.settle_fork`): the clones go, the source
resumes. A clone that fails to load or to take its identity is removed and named; the others of the
fork go too unless `--keep-going`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

from vmlaunch.compile.plan import Plan, VmPlan
from vmlaunch.core.wait import TimedOut, wait_until
from vmlaunch.errors import AgentError, RuntimeFailure, SpecUnfit, VmlaunchError
from vmlaunch.host.facts import Host
from vmlaunch.lab import process as qemu
from vmlaunch.lab.journal import Entry, Journal, VmEntry, locked
from vmlaunch.lab.running import running_vms
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import NOFOLLOW, RunDir
from vmlaunch.qemu.opts import json_arg
from vmlaunch.qemu.qmp import QmpError, QuickQmp
from vmlaunch.resources.base import Context, Resource, preflight
from vmlaunch.resources.clone import Book, CloneFiles, Forking, read_book, write_book
from vmlaunch.rig import agent
from vmlaunch.runtime import executor
from vmlaunch.saved import snapshot
from vmlaunch.spec import forks
from vmlaunch.spec.forks import Clone
from vmlaunch.spec.model import BUDGET_SHARE, LabSpec, UserNetwork, VmSpec, agent_on

log = logging.getLogger(__name__)

# QEMU caps a migration at 128 MiB/s by default, a save to a file too: a 192 MiB guest then takes
# 0.54 s instead of 0.09-0.17 s. A fork lifts the cap for its save and puts it back after.
BANDWIDTH = 1 << 40
LOAD_TIMEOUT = 60.0  # seconds a clone's QEMU gets to load the state
IDENTITY_TIMEOUT = 60.0  # seconds the guest gets to take a clone's identity
FD_NAME = "vmlaunch-fork"


@attrs.frozen
class Forked:
    """A clone made: what `fork` prints of it."""

    name: str
    pid: int
    macs: tuple[str, ...]
    addresses: tuple[str, ...]  # its static addresses
    ssh_port: int | None
    forwards: tuple[str, ...]  # its forwarding rules, with their host ports
    identity: tuple[str, ...]  # what its guest was given ("clock", "mac eth0 52:54:00:...", ...)
    ready: float  # seconds from the command's start to the clone running with its identity
    same_identity: bool = False  # --same-identity: its addresses, as all else, are its source's

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


# --- refusals ----------------------------------------------------------------------------------------


def refusals(lab: LabSpec, vm: VmSpec, count: int, host: Host, running: Sequence[str], *,
             shared_memory: bool = False) -> None:
    """Why `vm` cannot be forked into `count` clones, raised before anything changes."""
    if shared_memory and vm.hugepages is not None:
        raise SpecUnfit(f"{vm.name}'s memory is hugepages: --shared-memory maps a file of the saved "
                        "memory instead", "fork it without --shared-memory")
    if vm.pci:
        raise SpecUnfit(f"{vm.name} has a PCI device passed through ({vm.pci[0].host}): QEMU cannot "
                        "copy a device's state out of the hardware", "fork a VM without [[pci]]")
    if vm.shares:
        raise SpecUnfit(f"{vm.name} has a 9p share ({vm.shares[0].target}): QEMU cannot copy a VM "
                        "whose guest has one mounted", "fork a VM without [[share]]")
    budget = lab.memory.budget_mib or int(host.memory_mib * BUDGET_SHARE)
    holding = sum(each.memory_mib for each in lab.vms if each.name in running)
    wanted = count * vm.memory_mib
    if holding + wanted > budget:
        raise RuntimeFailure(
            f"{count} clone{'s' if count != 1 else ''} of {vm.name} need {wanted} MiB, and the lab's VMs "
            f"hold {holding} MiB of its budget of {budget} MiB already",
            "fewer clones, or a larger [lab.memory] budget")


# --- the fork ----------------------------------------------------------------------------------------


def fork(lab: LabSpec, host: Host, source: str, count: int, *, pattern: str | None = None,
         shared_memory: bool = False, keep_going: bool = False, same_identity: bool = False,
         timeout: float = 60.0, started: float | None = None) -> list[Forked]:
    """Fork the running VM `source` of `lab` (the spec's lab) into `count` clones; return each clone
    made, once it runs with its identity (module docstring). `started`: when the command started
    (time.monotonic()), which each clone's `ready` counts from; default now."""
    started = time.monotonic() if started is None else started
    run_dir = RunDir.of(host.run_root, lab.name)
    umask = os.umask(0o077)
    try:
        with locked(run_dir, timeout):
            return _fork(lab, host, run_dir, source, count, pattern, shared_memory, keep_going,
                         same_identity, timeout, started)
    finally:
        os.umask(umask)


def _fork(lab: LabSpec, host: Host, run_dir: RunDir, source: str, count: int, pattern: str | None,
          shared_memory: bool, keep_going: bool, same_identity: bool, timeout: float,
          started: float) -> list[Forked]:
    journal = Journal.load(run_dir)
    journal.check_spec(lab.file, force=False)
    snapshot.settle(run_dir, timeout)
    if os.path.lexists(run_dir.forks):
        executor.settle_fork(run_dir, timeout)
    journal = Journal.load(run_dir)
    book = read_book(run_dir)
    lab = forks.with_clones(lab, book.clones)
    vm = lab.select([source])[0]
    running = running_vms(journal)
    if source not in running:
        raise RuntimeFailure(f"{source} is not running: only a running VM can be forked",
                             f"start it with `vmlaunch up SPEC {source}`")
    refusals(lab, vm, count, host, list(running), shared_memory=shared_memory)
    if run_dir.disk_faults.exists():
        from vmlaunch.rig.diskfault import held_requests

        held = held_requests(run_dir, source)
        if held:  # a pause waits for every request: it would never end
            raise RuntimeFailure(f"{source} holds requests of {', '.join(held)} (`fault ... hang`): it "
                                 "cannot pause for the fork while they wait", f"`vmlaunch fault SPEC "
                                 f"{source} {held[0]} release` first")
    lab_dir = LabDir.of(lab.file, lab.name)
    kept = {entry.name for entry in os.scandir(lab_dir.path)} if lab_dir.path.is_dir() else set()
    # a folder of the lab dir may hold a VM's disks from before (a VM since left out of the spec)
    names = forks.names(pattern, source, count, {each.name for each in lab.vms} | set(journal.vms) | kept)
    if same_identity:  # said first: what follows may take a while
        log.warning("--same-identity: the clones of %s keep its MACs in the guest, its addresses, "
                    "hostname, machine-id and SSH host keys; on a shared network they collide with "
                    "it and with each other", source)
    number = book.last + 1
    clones = _clones(lab, vm, names, number, same_identity, book.clones)
    with_new = forks.with_clones(lab, clones)
    with ThreadPoolExecutor(1) as pool:  # the guest answers while the clones are compiled
        answered = pool.submit(_check_channel, run_dir, vm, same_identity)
        from vmlaunch.compile.compiler import compile_lab

        plan = compile_lab(with_new, host, names)
        if shared_memory:
            for each in plan.vms:
                shared(each, run_dir.fork_memory, share=False)  # refused here, not once paused
        copies = _copies(with_new, lab_dir, vm, names, running[source])
        _room(run_dir, lab_dir, vm, copies, shared_memory)
        answered.result()
    book = Book(clones=(*book.clones, *clones), last=number,
                forking=Forking(number, os.getpid(), source, tuple(names), lab_dir=str(lab_dir.path)))
    write_book(run_dir, book)  # before anything changes: a kill from here on is undone by the next command
    try:
        made = _make(with_new, plan, host, run_dir, journal, vm, clones, book, copies, keep_going, started,
                     shared_memory)
    except BaseException as exc:
        from vmlaunch.core import signals

        with signals.held():
            why = (f"the fork of {source} failed ({exc})" if isinstance(exc, VmlaunchError)
                   else f"the fork of {source} was interrupted")
            executor.settle_fork(run_dir, timeout, why=why)
        raise
    book = read_book(run_dir)
    write_book(run_dir, attrs.evolve(book, forking=None))
    return made


def _check_channel(run_dir: RunDir, vm: VmSpec, same_identity: bool) -> None:
    """The source's guest answers on its command channel: each clone is told who it is through it
    (none is needed with `same_identity`)."""
    if same_identity:
        return
    if not agent_on(vm):
        raise SpecUnfit(f"{vm.name} has no command channel (agent = false), through which each clone "
                        "is given its own identity (MACs, addresses, hostname, machine-id, SSH "
                        "host keys)", "--same-identity forks it anyway: the clones then keep "
                        f"{vm.name}'s identity")
    from vmlaunch.runtime.control import read_run_state

    with QuickQmp(run_dir.vm(vm.name).qmp, 10.0) as qmp:
        if read_run_state(qmp) != "running":
            return  # a paused guest cannot answer; its clones run, and are asked
    try:
        agent.run(run_dir, vm.name, "true", timeout=10.0, wait=10.0)
    except AgentError as exc:
        raise RuntimeFailure(f"{vm.name}'s command channel does not answer ({exc.message}): it is how each "
                             "clone is given its own identity", "wait until its guest has booted, or "
                             "--same-identity to fork it anyway (the clones keep its identity)") from None


def _clones(lab: LabSpec, vm: VmSpec, names: Sequence[str], number: int, same_identity: bool,
            existing: Sequence[Clone]) -> list[Clone]:
    """The clones' records: a static address each on static-address networks, host ports of their own
    for forwarded ones; the spec's VM they copy is `vm`'s (`existing`: the lab's clones)."""
    used = forks.used_addresses(lab)
    spec_vm = next((clone.base for clone in existing if clone.name == vm.name), vm.name)
    forked = time.time()  # before its disks are copied: what they hold from before is its source's
    made = []
    for index, name in enumerate(names, start=1):
        addresses: list[str | None] = []
        for nic in vm.nics:
            if nic.ip is None:
                addresses.append(None)
            elif same_identity:
                addresses.append(nic.ip)
            else:
                addresses.append(forks.next_address(nic.ip, used, forks.subnet_of(lab.network(nic.network))))
        forwards: list[tuple[str, tuple[str, ...]]] = []
        for nic in vm.nics:
            network = lab.network(nic.network)
            base = forks.base_network(nic.network)
            if isinstance(network, UserNetwork) and network.forward and base not in dict(forwards):
                ports = free_ports(len(network.forward))
                forwards.append((base, forks.forward_rules(network.forward, ports)))
        made.append(Clone(name, vm.name, number, index, spec_vm, tuple(addresses), tuple(forwards),
                          same_identity, forked))
    return made


def free_ports(count: int) -> list[int]:
    """`count` TCP ports free on 127.0.0.1 now (the kernel picks them), for a clone's forwards."""
    held, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in held:
            sock.close()
    return ports


def _make(lab: LabSpec, plan: Plan, host: Host, run_dir: RunDir, journal: Journal, vm: VmSpec,
          clones: Sequence[Clone], book: Book, copies: Sequence[tuple[Path, Path]], keep_going: bool,
          started: float, shared_memory: bool) -> list[Forked]:
    from vmlaunch.resources.guest import Nvram, Overlay
    from vmlaunch.resources.image import Image

    names = [clone.name for clone in clones]
    lab_dir = LabDir.of(lab.file, lab.name)
    ctx = Context(lab=lab.name, qemu_img=host.qemu.img or "qemu-img")
    skipped = (Overlay, Nvram, Image)  # a clone's disks are copies of its source's
    resources: list[Resource] = [CloneFiles(name, run_dir, lab_dir) for name in names]
    resources += [r for r in plan.resources if r.owner in names and not isinstance(r, skipped)
                  and not journal.has(r.kind, r.key)]
    preflight(resources)
    for resource in resources:
        record = resource.apply(ctx)
        journal.add(Entry(kind=resource.kind, key=resource.key, vm=resource.owner, record=record))
    if clones[0].same_identity and lab_dir.vm(vm.name).host_pub.exists():
        from vmlaunch.guests import sshkeys  # the guest keeps its source's host key: so does the pin

        public = sshkeys.read_own_file(lab_dir.vm(vm.name).host_pub)
        for name in names:
            sshkeys.pin(lab_dir, name, public)
    plans = [attrs.evolve(each, argv=(*each.argv, "-incoming", "defer")) for each in plan.vms]
    for each in plans:
        executor.clear_stale(each.files)
        journal.vms[each.name] = VmEntry(pid=None, started=time.time(), accel=each.accel.accel.value)
    journal.save()
    marks = {"prepared": time.monotonic()}
    _save(run_dir, vm.name, book, copies)
    marks["saved"] = time.monotonic()
    try:
        _drop_inherited(lab, names, ctx.qemu_img)
        if shared_memory:  # the first clone's QEMU turns the state into RAM the others map
            _template(run_dir, shared(plans[0], run_dir.fork_memory, share=True),
                      executor.identities(journal, plans[:1]))
            plans = [shared(each, run_dir.fork_memory, share=False) for each in plans]
        pids = qemu.start(plans, executor.identities(journal, plans))
        for each in plans:
            journal.vms[each.name] = attrs.evolve(journal.vms[each.name], pid=pids[each.name])
            for path in each.files.private:
                executor.narrow(path)
        journal.save()
        for resource in plan.resources:
            for hook in ("check_opened", "attach"):
                call = getattr(resource, hook, None)
                if call is not None and resource.owner in pids:
                    call(pids[resource.owner])
        by_name = {clone.name: clone for clone in clones}
        loaded_at: dict[str, float] = {}
        done_at: dict[str, float] = {}
        identities = _bring_all(run_dir, lab, lab_dir, vm, plans, pids, by_name, keep_going,
                                ignore_shared=shared_memory, loaded_at=loaded_at, done_at=done_at)
    finally:
        for path in (run_dir.fork_state, run_dir.fork_memory):  # the clones' mappings keep the RAM
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if not identities:
        raise RuntimeFailure(f"no clone of {vm.name} was made: each failed (said above)")
    journal = Journal.load(run_dir)  # a clone --keep-going took down is gone from it
    plans = [each for each in plans if each.name in identities]
    for each in plans:
        if each.ssh_user:
            journal.vms[each.name] = attrs.evolve(journal.vms[each.name], ssh_port=executor.ssh_port(each))
    journal.save()
    for resource in plan.resources:  # the lab manager watches the clones too
        refresh = getattr(resource, "refresh", None)
        if refresh is not None and resource.owner is None:
            refresh(ctx)
    if plans:
        loaded, ready = max(loaded_at.values()), max(done_at.values())
        log.info("fork of %s: prepared in %.2f s, saved (%s paused) in %.2f s, %d clone%s loaded in "
                 "%.2f s and given their identities in %.2f s more", vm.name, marks["prepared"] - started,
                 vm.name, marks["saved"] - marks["prepared"], len(plans), "" if len(plans) == 1 else "s",
                 loaded - marks["saved"], ready - loaded)
    made = []
    for each in plans:
        spec = lab.vm(each.name)
        clone = by_name[each.name]
        made.append(Forked(each.name, pids[each.name], tuple(nic.mac for nic in spec.nics),
                           tuple(address for address in clone.addresses if address),
                           journal.vms[each.name].ssh_port,
                           tuple(rule for _, rules in clone.forwards for rule in rules),
                           identities[each.name], done_at[each.name] - started, clone.same_identity))
    from vmlaunch.lab import events

    for forked in made:
        events.record(run_dir, forked.name, "VMLAUNCH_FORK",
                      {"message": f"forked from {vm.name} (fork {clones[0].fork})", "source": vm.name})
    return made


def _drop_inherited(lab: LabSpec, names: Sequence[str], qemu_img: str) -> None:
    """Delete from the clones' qcow2 copies the internal snapshots they hold from their source, before
    their QEMUs open them: a restore must never turn a clone back into its source (its hostname,
    machine-id, MACs, host key). With `qemu-img snapshot -d`, a few milliseconds a snapshot, after
    the source runs again."""
    files = [disk.file for name in names for disk in snapshot.vm_disks(lab, lab.vm(name)).disks]
    if not files:
        return
    with ThreadPoolExecutor(min(4, len(files))) as pool:
        list(pool.map(lambda file: snapshot.drop_all(qemu_img, file), files))  # raises the first failure


def _copies(lab: LabSpec, lab_dir: LabDir, vm: VmSpec, names: Sequence[str], pid: int
            ) -> list[tuple[Path, Path]]:
    """(what to copy, a clone's copy) for each writable disk of the source and each clone: its
    overlay, each writable [[disk]], its UEFI variables. What is copied is the file the source's QEMU
    has open (`/proc/PID/fd/N`), never what its path names now: a path swapped since `up` (a link to
    a file of the host's) is refused, as is a writable block device (a copy would read it whole)."""
    from vmlaunch.spec.model import Firmware

    held = _open_files(pid)
    wanted = [lab_dir.vm(vm.name).overlay] if vm.image is not None else []
    wanted += [disk.file for disk in vm.disks if not disk.readonly]
    wanted += [lab_dir.vm(vm.name).nvram] if vm.firmware is Firmware.UEFI else []
    found = {}
    for path in wanted:
        opened = held.get(os.path.realpath(path))
        if opened is None:
            raise RuntimeFailure(f"{path} is not the file {vm.name}'s QEMU has open (it was replaced or "
                                 "removed since `up`): its clones would not get the disk it writes",
                                 f"put it back, or `vmlaunch down SPEC {vm.name}` and `up` it again")
        if stat.S_ISBLK(os.stat(opened).st_mode):
            raise RuntimeFailure(f"{vm.name}'s disk {path} is a block device: a fork would copy it whole "
                                 "for each clone", "fork a VM whose writable disks are files")
        found[path] = opened
    pairs = []
    for name in names:
        clone = lab.vm(name)
        if vm.image is not None:
            pairs.append((found[lab_dir.vm(vm.name).overlay], lab_dir.vm(name).overlay))
        for disk, copy in zip(vm.disks, clone.disks):
            if not disk.readonly:
                pairs.append((found[disk.file], copy.file))
        if vm.firmware is Firmware.UEFI:
            pairs.append((found[lab_dir.vm(vm.name).nvram], lab_dir.vm(name).nvram))
    return pairs


def _open_files(pid: int) -> dict[str, Path]:
    """The files a process has open: the path each names (as the kernel says) -> /proc/PID/fd/N."""
    folder = Path(f"/proc/{pid}/fd")
    found: dict[str, Path] = {}
    try:
        entries = os.listdir(folder)
    except OSError:
        return found
    for entry in entries:
        with contextlib.suppress(OSError):
            found.setdefault(os.readlink(folder / entry), folder / entry)
    return found


def _room(run_dir: RunDir, lab_dir: LabDir, vm: VmSpec, copies: Sequence[tuple[Path, Path]],
          shared_memory: bool) -> None:
    """Refuse a fork whose saved state (the VM's memory at most, and the shared RAM file with
    --shared-memory) does not fit in the run dir's file system, or whose disk copies (what the
    source's files hold) do not fit beside the spec."""
    need = (vm.memory_mib << 20) * (2 if shared_memory else 1)
    free = _free(run_dir.path)
    if free is not None and free < need:
        raise RuntimeFailure(f"the run dir {run_dir} has {free >> 20} MiB free, and a fork of {vm.name} "
                             f"saves up to {need >> 20} MiB there", "free some, or set VMLAUNCH_RUN_DIR "
                             "to a roomier place")
    copied = sum(os.stat(source).st_blocks * 512 for source, _ in copies)
    free = _free(lab_dir.path)
    if copied and free is not None and free < copied:
        raise RuntimeFailure(f"the copies of {vm.name}'s disks need {copied >> 20} MiB, and {lab_dir} has "
                             f"{free >> 20} MiB free", "fewer clones, or free some room")


def _free(path: Path) -> int | None:
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def copy_disk(source: Path, target: Path) -> None:
    """Copy a disk (for a clone: what the source's QEMU has open, /proc/PID/fd/N) to a new file in a
    folder just made, private (a clone's, or a throwaway VM's home), sparse, shared by reflink where
    the file system can."""
    done = subprocess.run(["cp", "--sparse=always", "--reflink=auto", "--no-preserve=all", "--",
                           str(source), str(target)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = "; ".join(line for line in done.stderr.strip().splitlines() if line.strip())
        raise RuntimeFailure(f"a copy of a disk for {target.parent.name} failed: "
                             f"{said or f'cp exited with {done.returncode}'}", "is the file system full?")
    os.chmod(target, 0o600)


def _save(run_dir: RunDir, source: str, book: Book, copies: Sequence[tuple[Path, Path]]) -> None:
    """Pause the source, save its state to the run dir's fork.state while its disks are copied, and
    let it go on (module docstring, step 3)."""
    from vmlaunch.runtime.control import read_run_state

    forking = book.forking
    assert forking is not None

    with QuickQmp(run_dir.vm(source).qmp, 10.0) as qmp:
        state = read_run_state(qmp)
        if state not in ("running", "paused"):
            raise RuntimeFailure(f"{source} is {state}: only a VM that runs or is paused can be forked",
                                 f"`vmlaunch status SPEC` says why; `vmlaunch resume SPEC {source}`")
        was_running = state == "running"
        if was_running:
            write_book(run_dir, attrs.evolve(book, forking=attrs.evolve(forking, paused=True)))
            qmp.cmd("stop")
        params = qmp.cmd("query-migrate-parameters")
        before = params.get("max-bandwidth") if isinstance(params, dict) else None
        try:
            qmp.cmd("migrate-set-parameters", **{"max-bandwidth": BANDWIDTH})
            fd = os.open(run_dir.fork_state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW, 0o600)
            try:
                qmp.cmd_with_fds("getfd", [fd], fdname=FD_NAME)
            finally:
                os.close(fd)
            with ThreadPoolExecutor(max(1, min(4, len(copies)))) as pool:
                copying = [pool.submit(copy_disk, src, dst) for src, dst in copies]
                try:
                    qmp.cmd("migrate", uri=f"fd:{FD_NAME}")
                except QmpError as exc:
                    raise RuntimeFailure(f"QEMU cannot save {source}: {exc.message}",
                                         "a device QEMU cannot migrate? `vmlaunch qmp SPEC VM "
                                         "query-migrate` says more") from None
                _wait_saved(qmp, source)
                for each in copying:
                    each.result()
        finally:
            with contextlib.suppress(QmpError):
                if isinstance(before, int):
                    qmp.cmd("migrate-set-parameters", **{"max-bandwidth": before})
                if was_running:
                    qmp.cmd("cont")
                elif read_run_state(qmp) == "postmigrate":
                    # A saved VM's disks are handed over (inactive) until it runs: a VM its user had
                    # paused gets them back and stays paused, as it was.
                    qmp.cmd("cont")
                    qmp.cmd("stop")
            if was_running:
                write_book(run_dir, attrs.evolve(book, forking=attrs.evolve(forking, paused=False)))


def _wait_saved(qmp: QuickQmp, source: str) -> None:
    def done() -> bool | None:
        reply = qmp.cmd("query-migrate")
        status = reply.get("status") if isinstance(reply, dict) else None
        if status == "completed":
            return True
        if status in ("failed", "cancelled"):
            raise RuntimeFailure(f"QEMU could not save {source}: {reply.get('error-desc', status)}")
        return None

    try:
        wait_until(done, LOAD_TIMEOUT, interval=0.005)
    except TimedOut:
        with contextlib.suppress(QmpError):
            qmp.cmd("migrate_cancel")
        raise RuntimeFailure(f"QEMU did not save {source} within {LOAD_TIMEOUT:g} s") from None


RAM_ID = "pc.ram"  # the id (and migration name) of the RAM QEMU makes for `-m` alone


def shared(plan: VmPlan, memory: Path, *, share: bool) -> VmPlan:
    """The clone's argv with its RAM a mapping of `memory` (`memory-backend-file`, under the name
    QEMU's own RAM has, so the saved state loads into it): shared (the template, whose loaded RAM
    lands in the file) or copy-on-write (a clone)."""
    argv = list(plan.argv)
    if any('"memory-backend' in arg for arg in argv):  # placed on NUMA nodes: the spec's own backend
        raise SpecUnfit(f"{plan.name}: its memory is bound to NUMA nodes: --shared-memory maps one "
                        "file instead", "fork it without --shared-memory")
    size = argv[argv.index("-m") + 1]
    machine = argv.index("-machine") + 1
    argv[machine] = f"{argv[machine]},memory-backend={RAM_ID}"
    backend = json_arg({"qom-type": "memory-backend-file", "id": RAM_ID, "mem-path": str(memory),
                        "size": mib_bytes(size), "share": share})
    return attrs.evolve(plan, argv=(*argv, "-object", backend))


def mib_bytes(text: str) -> int:
    """`-m 160M` -> bytes."""
    return int(text.rstrip("M")) << 20


def _template(run_dir: RunDir, plan: VmPlan, identity: dict[str, tuple[int, int]]) -> None:
    """Load the saved state into a QEMU whose RAM is the shared file, never run it, save its devices
    alone (`x-ignore-shared`: its RAM is in the file) over the state, and stop it."""
    pids = qemu.start([plan], identity)
    try:
        why = _load(run_dir, plan, pids[plan.name], run=False)
        if why is not None:
            raise RuntimeFailure(f"the shared memory could not be made: {why}")
        with QuickQmp(plan.files.qmp, 10.0) as qmp:
            qmp.cmd("migrate-set-capabilities",
                    capabilities=[{"capability": "x-ignore-shared", "state": True}])
            os.unlink(run_dir.fork_state)
            fd = os.open(run_dir.fork_state, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
            try:
                qmp.cmd_with_fds("getfd", [fd], fdname=FD_NAME)
            finally:
                os.close(fd)
            qmp.cmd("migrate", uri=f"fd:{FD_NAME}")
            _wait_saved(qmp, plan.name)
    finally:
        qemu.stop_all({plan.name: (pids[plan.name], plan.files)}, 0)
        executor.clear_stale(plan.files)


def _bring_all(run_dir: RunDir, lab: LabSpec, lab_dir: LabDir, source: VmSpec, plans: Sequence[VmPlan],
               pids: dict[str, int], clones: dict[str, Clone], keep_going: bool, *, ignore_shared: bool,
               loaded_at: dict[str, float], done_at: dict[str, float]) -> dict[str, tuple[str, ...]]:
    """Each clone, on a thread of its own, loads the saved state, runs and is given its identity
    (`_give`); clone -> what it was given, and when each had loaded and was ready (time.monotonic()).
    One that fails is named; without `keep_going` that fails the fork (all of it is rolled back), with
    it that clone alone is taken down."""

    def bring(plan: VmPlan) -> tuple[str, ...] | str:
        why = _load(run_dir, plan, pids[plan.name], ignore_shared=ignore_shared)
        if why is not None:
            return f"did not load {why}"
        loaded_at[plan.name] = time.monotonic()
        given = _give(run_dir, lab, lab_dir, source, clones[plan.name])
        if isinstance(given, str):
            return f"did not take its identity: {given}"
        done_at[plan.name] = time.monotonic()
        return given

    with ThreadPoolExecutor(len(plans)) as pool:
        outcomes = dict(zip([plan.name for plan in plans], pool.map(bring, plans)))
    failed = {name: why for name, why in outcomes.items() if isinstance(why, str)}
    if failed and not keep_going:
        raise RuntimeFailure("; ".join(f"{name} {why}" for name, why in failed.items()),
                             "the fork is rolled back; --keep-going keeps the clones that did")
    for name, why in failed.items():
        log.warning("%s %s: removed (--keep-going keeps the others)", name, why)
    if failed:
        executor.take_down(run_dir, list(failed))
    return {name: given for name, given in outcomes.items() if not isinstance(given, str)}


def _load(run_dir: RunDir, plan: VmPlan, pid: int, *, run: bool = True, ignore_shared: bool = False,
          state: Path | None = None) -> str | None:
    """Load the saved state (the fork's, or `state`) into the clone's QEMU and let it run (unless not
    `run`); why not, or None. `ignore_shared`: its RAM maps the template's file, the state has its
    devices alone."""
    try:
        with QuickQmp(plan.files.qmp, 10.0) as qmp:
            if ignore_shared:
                qmp.cmd("migrate-set-capabilities",
                        capabilities=[{"capability": "x-ignore-shared", "state": True}])
            fd = os.open(state or run_dir.fork_state, os.O_RDONLY | NOFOLLOW)
            try:
                qmp.cmd_with_fds("getfd", [fd], fdname=FD_NAME)
            finally:
                os.close(fd)
            qmp.cmd("migrate-incoming", uri=f"fd:{FD_NAME}")

            def loaded() -> bool | None:
                if not qemu.alive(pid):
                    raise RuntimeFailure("its QEMU exited")
                reply = qmp.cmd("query-status")
                return True if reply.get("status") not in ("inmigrate", "prelaunch") else None

            wait_until(loaded, LOAD_TIMEOUT, interval=0.005)
            if run:
                qmp.cmd("cont")
        return None
    except TimedOut:
        return f"within {LOAD_TIMEOUT:g} s"
    except (VmlaunchError, OSError) as exc:
        said = qemu.messages(plan.files).strip().splitlines()
        return f"({exc}{': ' + said[-1] if said else ''})"


# --- identity ----------------------------------------------------------------------------------------

# Run as root in the clone through the command channel, with POSIX sh (busybox's too): $1 hostname,
# $2 machine-id, $3 the host's time (seconds since the epoch), $4 "OLD=NEW,..." MACs, $5
# "NEWMAC=OLD>NEW,..." static addresses; the SSH host key pair on stdin (the private key, then the
# public line). Each step says what it did, one line each.
IDENTITY = r"""set -u
name=$1 mid=$2 now=$3 macs=$4 addrs=$5
say() { echo "$*"; }
# Few programs run: under TCG each new one costs its translation (a third of a second in a busy guest).
if date -u -s "@$now" >/dev/null 2>&1 || date -u -s "@${now%.*}" >/dev/null 2>&1; then say clock; fi
read -r old < /proc/sys/kernel/hostname || old=
echo "$name" > /proc/sys/kernel/hostname && say "hostname $name"
[ -f /etc/hostname ] && echo "$name" > /etc/hostname
edits=""  # sed expressions for the files that name the old hostname, MACs, addresses
if [ -n "$old" ] && [ "$old" != "$name" ] && [ -f /etc/hosts ]; then
  sed -i -E "s/(^|[[:space:]])$old([[:space:]]|[.]|\$)/$name/g" /etc/hosts
fi
if [ -d /etc ]; then
  printf '%s
' "$mid" > /etc/machine-id && say "machine-id $mid"
  dbus=/var/lib/dbus/machine-id
  [ -f $dbus ] && [ ! -L $dbus ] && printf '%s
' "$mid" > $dbus
fi
ifc_of() {  # the interface whose MAC is $1, in $ifc
  ifc=
  for d in /sys/class/net/*; do
    read -r a < "$d/address" 2>/dev/null || continue
    [ "$a" = "$1" ] && { ifc=${d##*/}; return 0; }
  done
  return 1
}
IFS_=$IFS; IFS=,
for pair in $macs; do
  from=${pair%%=*} to=${pair#*=}
  ifc_of "$from" || continue
  edits="$edits -e s/$from/$to/g"
  if ! ip link set dev "$ifc" address "$to" 2>/dev/null; then
    ip link set dev "$ifc" down && ip link set dev "$ifc" address "$to" && ip link set dev "$ifc" up
  fi
  say "mac $ifc $to"
done
for item in $addrs; do
  mac=${item%%=*} rest=${item#*=}
  from=${rest%%>*} to=${rest#*>}
  ifc_of "$mac" || continue
  edits="$edits -e s#$(echo "$from" | sed 's/[.]/[.]/g')#$to#g"
  ip addr del "$from" dev "$ifc" 2>/dev/null
  ip addr add "$to" dev "$ifc" && say "address $ifc $to"
done
IFS=$IFS_
if [ -n "$edits" ]; then
  set --
  for f in /etc/systemd/network/*.network /run/systemd/network/*.network /etc/netplan/*.yaml \
           /etc/network/interfaces /etc/network/interfaces.d/* \
           /etc/NetworkManager/system-connections/*.nmconnection; do
    [ -f "$f" ] && set -- "$@" "$f"
  done
  [ $# -gt 0 ] && sed -i $edits "$@"
fi
private= public= inkey=
while IFS= read -r line; do
  case $line in
    -----BEGIN*) inkey=1; private=$line ;;
    -----END*) private="$private
$line"; inkey= ;;
    ssh-ed25519\ *) public=$line ;;
    *) [ -n "$inkey" ] && private="$private
$line" ;;
  esac
done
if [ -n "$public" ] && [ -d /etc/ssh ]; then
  rm -f /etc/ssh/ssh_host_*_key /etc/ssh/ssh_host_*_key.pub
  (umask 077; printf '%s
' "$private" > /etc/ssh/ssh_host_ed25519_key)
  (umask 022; printf '%s
' "$public" > /etc/ssh/ssh_host_ed25519_key.pub)
  for pidfile in /run/sshd.pid /var/run/sshd.pid; do
    [ -f "$pidfile" ] && read -r pid < "$pidfile" && kill -HUP "$pid" 2>/dev/null && break
  done
  say "ssh host key"
fi
if [ -d /run/systemd/netif ] && command -v systemctl >/dev/null 2>&1; then
  systemctl restart systemd-networkd && say "network restarted (DHCP asks with the new machine-id)"
elif [ -d /run/NetworkManager ] && command -v nmcli >/dev/null 2>&1; then
  nmcli connection reload && say "network configuration reloaded"
fi
exit 0
"""


def _give(run_dir: RunDir, lab: LabSpec, lab_dir: LabDir, source: VmSpec, clone: Clone
          ) -> tuple[str, ...] | str:
    """Give the clone its identity through its command channel (the IDENTITY script): what was set,
    one line each, or why not. A clone forked with --same-identity is given none."""
    if clone.same_identity:
        return ()
    spec = lab.vm(clone.name)
    # the SSH NIC and NICs on user networks keep theirs (spec/forks.py: clone_spec says why)
    macs = ",".join(f"{old.mac}={new.mac}" for old, new in zip(source.nics, spec.nics) if old.mac != new.mac)
    addrs = ",".join(f"{new.mac}={old.ip}>{new.ip}" for old, new in zip(source.nics, spec.nics)
                     if old.ip and new.ip and old.ip != new.ip)
    keys = b""
    if spec.cloud_init is not None:
        from vmlaunch.guests import sshkeys

        private, public = sshkeys.ensure_host_key(lab_dir, clone.name)
        keys = f"{private.rstrip()}\n{public.strip()}\n".encode()
    try:
        result = agent.run(run_dir, clone.name, ["sh", "-c", IDENTITY, "identity", clone.name,
                                                 uuid.uuid4().hex, f"{time.time():.3f}", macs, addrs],
                           input=keys, timeout=IDENTITY_TIMEOUT, wait=IDENTITY_TIMEOUT)
    except VmlaunchError as exc:
        return str(exc)
    if result.exit_code != 0:
        return (f"the identity script exited with status {result.exit_code}: "
                f"{result.stderr[-300:].decode(errors='replace')!r}")
    return tuple(line for line in result.stdout.decode(errors="replace").splitlines() if line.strip())


def describe(forked: Forked) -> str:
    """One line of `fork`'s output."""
    parts = [f"{forked.name}: running (pid {forked.pid}), ready in {forked.ready:.2f} s"]
    if forked.macs:
        parts.append(f"MAC {', '.join(forked.macs)}")
    if forked.addresses:
        how = "its source's: --same-identity" if forked.same_identity else "the next free"
        parts.append(f"address {', '.join(forked.addresses)} ({how})")
    if forked.ssh_port:
        parts.append(f"ssh 127.0.0.1:{forked.ssh_port}")
    if forked.forwards:
        parts.append(f"forwards {', '.join(forked.forwards)}")
    return "; ".join(parts)
