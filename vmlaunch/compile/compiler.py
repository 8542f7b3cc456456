"""compile(lab, host) -> Plan: a pure function from the spec and the host's facts to QEMU argv.

No I/O happens here. Every default that depends on the host is decided here, and every option that a
spec value reaches is built in JSON form or through `qemuopts.opts`, which escapes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from vmlaunch.compile.plan import AccelChoice, Plan, StartFaults, VmPlan
from vmlaunch.core.naming import cgroup_name, management_mac, netem_ifb_name, process_name, tap_name
from vmlaunch.core.units import format_size, mib_words
from vmlaunch.errors import HostError, KeyPath, Location, format_key_path
from vmlaunch.guests.channel import AGENT_PORT, QGA_PORT
from vmlaunch.guests.diskfiles import DiskOrigin
from vmlaunch.guests.kernels import KernelBoot, fast_boot_wanted
from vmlaunch.host.confine import SANDBOX
from vmlaunch.host.facts import Host, accel_of
from vmlaunch.host.numa import Topology, format_cpulist
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import RunDir, VmFiles
from vmlaunch.policy.admission import Booting, admission
from vmlaunch.qemu.opts import json_arg, opts
from vmlaunch.resources.base import Resource
from vmlaunch.resources.guest import LabDirResource, Nvram, Overlay, Seed
from vmlaunch.resources.image import Image
from vmlaunch.resources.manager import LabManager, ManagedVm, ManagerConfig
from vmlaunch.spec.model import (
    BUDGET_SHARE,
    DEFAULT_CLOUD_USER,
    TAP_NETWORKS,
    Accel,
    Aio,
    BalloonPolicy,
    BridgeNetwork,
    Disk,
    DiskBus,
    DiskFormat,
    Firmware,
    LabSpec,
    NetemWhere,
    Nic,
    NicModel,
    PciDriver,
    PlacementPolicy,
    SocketNetwork,
    UserNetwork,
    Video,
    VmSpec,
    agent_on,
    balloon_min_mib,
    needs_lab_dir,
)

if TYPE_CHECKING:
    from vmlaunch.policy.placement import Placed

# The CPU under TCG when the spec names none: QEMU's default model (qemu64) plus what x86-64-v2 adds
# to it (SSSE3, SSE4.1, SSE4.2, POPCNT), the level RHEL 9 and its rebuilds are built for. Measured by
# bench/boot.py (a Debian guest, command to cloud-init done, medians of 2 interleaved runs): qemu64
# 69 s, `max` 86 s, Nehalem 85 s, Haswell-noTSX 102 s; the v2 additions to qemu64 made no difference
# beyond the runs' spread (about 10 %). The newer models cost the guest's user space time under TCG
# (AVX2 and the like, emulated, which its libraries then use). A guest built for v3 (RHEL 10) says so
# on its console, and `up` then stops waiting with the fix: cpu_model = "max".
TCG_CPU = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt"
# TCG's translation cache (`-accel tcg,tb-size=`, MiB). QEMU's default lets it grow to 1 GiB, and it
# stays resident: a Debian guest under TCG had 590 MiB of it by its login prompt. Capped, the guest
# retranslates what falls out; measured (the Debian image to its login prompt, plain QEMU, one run
# each): default 60 s and 590 MiB, 256 MiB 54 s, 128 MiB 56 s, 64 MiB 67 s, 32 MiB 82 s. The test
# guest boots in the same 6 s with 16 MiB and uses 48 MiB of the default.
TCG_CACHE_MIB = 128
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL
SHARE_FMODE = 0o660  # the host mode of every file a guest creates in a share (see `shares`)
SHARE_DMODE = 0o770  # and of every folder
NIC_DEVICES = {
    NicModel.VIRTIO: "virtio-net-pci",
    NicModel.E1000: "e1000",
    NicModel.E1000E: "e1000e",
    NicModel.RTL8139: "rtl8139",
}
VIDEO_DEVICES = {Video.STD: "VGA", Video.VIRTIO: "virtio-vga"}
DISK_DEVICES = {DiskBus.VIRTIO: "virtio-blk-pci", DiskBus.SCSI: "scsi-hd", DiskBus.SATA: "ide-hd"}
MEMORY_TARGET = 0.8


def compile_lab(lab: LabSpec, host: Host, only: Sequence[str] = (),
                running: Mapping[str, tuple[int, ...]] | None = None,
                kernels: Mapping[Path, KernelBoot] | None = None) -> Plan:
    """The plan for the VMs named in `only` (all of them when empty). `running`: the nodes the lab's
    VMs that run already are on now (`runtime.control.where_running`), for placement. `kernels`: how
    each direct-boot kernel boots under TCG (`guests.kernels.prepare`); a kernel not in it boots as
    given."""
    vms = lab.select(only)
    check_vlans(lab, vms, host)
    run_dir = RunDir.of(host.run_root, lab.name)
    placements = placements_of(lab, host, running)
    compiler = _Compiler(lab, host, run_dir, placements, kernels or {})
    plans = tuple(compiler.vm(vm) for vm in vms)
    resources = (*host_resources(lab, vms, host), *netem_resources(lab, vms, host),
                 *placement_resources(lab, vms, host, run_dir, placements),
                 *ksm_resources(lab, host), *manager_resources(lab, host, run_dir, placements),
                 *user_resources(vms, host))
    booting = [Booting(plan.name, vm.cpus, plan.accel.accel is Accel.TCG) for plan, vm in zip(plans, vms)]
    return Plan(lab=lab.name, run_dir=run_dir, resources=resources, vms=plans,
                notes=(*memory_notes(vms, host, lab), *pinning_notes(lab, host), *compiler.kernel_notes(vms)),
                lab_dir=compiler.lab_dir,
                admission=admission(host.cpus, booting, asked=lab.boot_parallel,
                                    asked_by="[lab] boot_parallel"))


def has_manager(lab: LabSpec) -> bool:
    """A lab manager runs while the lab is up, for every lab with a VM: it keeps the lab's event log
    (what QEMU reports of each VM: an I/O error, a pause, a panic), and sizes the auto balloons and
    balances the VMs over the host's NUMA nodes when the lab asks for it."""
    return bool(lab.vms)


def sizes_balloons(lab: LabSpec) -> bool:
    """The lab manager sizes a VM's balloon (`policy = "auto"`): the lab's memory is weighed against
    its budget."""
    return any(vm.balloon.enabled and vm.balloon.policy is BalloonPolicy.AUTO for vm in lab.vms)


def placing(lab: LabSpec, host: Host) -> bool:
    """Placement puts every VM on a node: `policy = "auto"`, the default on a host of several nodes."""
    policy = lab.placement.policy
    return host.numa is not None and (policy is PlacementPolicy.AUTO or
                                      (policy is None and host.numa.multi_node))


def balancing(lab: LabSpec, host: Host) -> bool:
    """The lab manager's balancer runs: placement, and `balance` not turned off."""
    return placing(lab, host) and lab.placement.balance is not False


def placements_of(lab: LabSpec, host: Host,
                  running: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Placed]:
    """Where each VM runs: every VM when placement is on, else those with `numa_node` or
    `cpu_pinning`. Nodes and CPUs the host does not have are exit 3, with the key's line.

    VMs in `running` (VM -> the nodes it is on now) stay there, their vCPUs counted as load where they
    are (their memory is in the nodes' free memory already): the others are placed beside them."""
    topology = host.numa
    if topology is None:
        return {}
    auto = placing(lab, host)
    wanted = [vm for vm in lab.vms if auto or vm.numa_node is not None or vm.cpu_pinning]
    if not wanted:
        return {}
    from vmlaunch.policy.placement import Binding, Demand, Node, Placed, place

    for vm in wanted:
        check_placement(lab, vm, topology)
    running = {vm.name: on for vm in wanted if not vm.cpu_pinning
               and (on := tuple(n for n in (running or {}).get(vm.name, ()) if topology.node(n)))}
    demands = [Demand(vm.name, vm.cpus, vm.memory_mib, vm.numa_node, vm.cpu_pinning,
                      page_mib=max(2, vm.hugepages.kib >> 10) if vm.hugepages else 2)
               for vm in wanted if vm.name not in running]
    nodes = [Node(node.id, node.cpus, node.free_mib, node.memory_mib, node.distances)
             for node in topology.nodes]
    vcpus_on: dict[int, int] = {}
    for vm in wanted:
        for index, node in enumerate(running.get(vm.name, ())):  # vCPUs spread over its nodes
            count = len(range(index, vm.cpus, len(running[vm.name])))
            vcpus_on[node] = vcpus_on.get(node, 0) + count
    placed = place(demands, nodes, vcpus_on)
    for vm in wanted:
        now = running.get(vm.name)
        if now is not None:
            binding = (Binding.NODE if vm.numa_node is not None else Binding.PLACED if len(now) == 1
                       else Binding.SPANS)
            cpus = tuple(sorted(cpu for node in topology.nodes if node.id in now for cpu in node.cpus))
            placed[vm.name] = Placed(vm.name, binding, now, cpus,
                                     reason=f"running on node{'s' if len(now) > 1 else ''} "
                                            f"{', '.join(map(str, now))}")
    return placed


def check_placement(lab: LabSpec, vm: VmSpec, topology: Topology) -> None:
    def fail(key: str, message: str, hint: str) -> HostError:
        path: KeyPath = ("vm", vm.name, key)
        return HostError(message, hint, Location(lab.file, lab.source.line_of(path), path))

    nodes = ", ".join(str(node.id) for node in topology.nodes)
    if vm.numa_node is not None:
        node = topology.node(vm.numa_node)
        if node is None:
            raise fail("numa_node", f"this host has no NUMA node {vm.numa_node} (its nodes: {nodes})",
                       "name one of its nodes, or leave numa_node out: placement picks one")
        if not node.cpus and not vm.cpu_pinning:
            raise fail("numa_node", f"node {node.id} has memory but no CPUs (a CXL or other memory-only "
                       "node): the VM's vCPUs cannot run there",
                       "name a node with CPUs (lscpu lists them per node), or add cpu_pinning for the vCPUs")
        if node.memory_mib and vm.memory_mib > node.memory_mib:
            raise fail("numa_node", f"{format_size(vm.memory_mib << 20)} does not fit node {node.id} "
                       f"({format_size(node.memory_mib << 20)} in all)",
                       "leave numa_node out: placement spreads a VM larger than any node over several")
    missing = sorted(set(vm.cpu_pinning) - topology.cpus)
    if missing:
        raise fail("cpu_pinning", f"this host has no CPU {', '.join(map(str, missing))} (its CPUs: "
                   f"{format_cpulist(topology.cpus)})", "pin to CPUs the host has (lscpu lists them)")


def pinning_notes(lab: LabSpec, host: Host) -> Iterator[str]:
    """Pinning that over-commits CPUs, or leaves some idle, is allowed (a user may want it): say so."""
    owners: dict[int, list[str]] = {}
    for vm in lab.vms:
        pins = vm.cpu_pinning
        if not pins:
            continue
        for cpu in sorted(set(pins)):
            owners.setdefault(cpu, []).append(vm.name)
        idle = sorted(set(pins[vm.cpus:]) - set(pins[:vm.cpus]))  # a CPU named twice may still run one
        if len(pins) > vm.cpus:
            carry = (f"CPU{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} carr"
                     f"{'y' if len(idle) > 1 else 'ies'} no vCPU (QEMU's other threads use every pinned CPU)"
                     if idle else "the extra entries repeat CPUs that run vCPUs already")
            yield (f"{vm.name}: cpu_pinning names {len(pins)} host CPUs for {vm.cpus} vCPU"
                   f"{'s' if vm.cpus > 1 else ''}: {carry}")
        shared = {cpu: [i for i in range(vm.cpus) if pins[i % len(pins)] == cpu] for cpu in set(pins)}
        doubled = {cpu: vcpus for cpu, vcpus in shared.items() if len(vcpus) > 1}
        if doubled:
            yield (f"{vm.name}: over-committed by its pinning: " + "; ".join(
                f"vCPUs {', '.join(map(str, vcpus))} share CPU {cpu}"
                for cpu, vcpus in sorted(doubled.items())))
        topology = host.numa
        if vm.numa_node is not None and topology is not None:
            away = [cpu for cpu in pins if topology.node_of_cpu(cpu) not in (None, vm.numa_node)]
            if away:
                yield (f"{vm.name}: vCPUs pinned to CPU{'s' if len(away) > 1 else ''} "
                       f"{', '.join(map(str, away))}, off node {vm.numa_node} where numa_node binds its "
                       "memory: their memory accesses are all remote")
    for cpu, vms in sorted(owners.items()):
        if len(vms) > 1:
            yield (f"host CPU {cpu} is pinned in {' and '.join(vms)}: their vCPUs take turns on it "
                   "(over-committed)")


def placement_resources(lab: LabSpec, vms: Sequence[VmSpec], host: Host, run_dir: RunDir,
                        placements: dict[str, Placed]) -> Iterator[Resource]:
    for vm in vms:
        placed = placements.get(vm.name)
        if placed is not None:
            from vmlaunch.resources.placement import VmPlacement

            yield VmPlacement(lab=lab.name, placed=placed, cpusets=host.cpusets, qmp=run_dir.vm(vm.name).qmp,
                              host_nodes=tuple(node.id for node in host.numa.nodes) if host.numa else (0,))


def check_vlans(lab: LabSpec, vms: Sequence[VmSpec], host: Host) -> None:
    """An 802.1Q VLAN needs the kernel's 8021q: without it, `up` stops before anything changes."""
    if host.vlan_8021q:
        return
    used = {nic.network for vm in vms for nic in vm.nics}
    for net in lab.networks:
        if isinstance(net, BridgeNetwork) and net.vlan is not None and net.name in used:
            path: KeyPath = ("network", net.name, "vlan")
            raise HostError(f"VLAN {net.vlan} of {net.uplink}: this kernel lacks 802.1Q VLAN support "
                            "(no 8021q module loaded, built in or installed)",
                            "load the module: `modprobe 8021q` (a kernel built with CONFIG_VLAN_8021Q); "
                            "or tag the VLAN elsewhere: a switch port, Open vSwitch through "
                            "type = \"tap\" scripts (examples/ovs.toml)",
                            Location(lab.file, lab.source.line_of(path), path))


def ksm_resources(lab: LabSpec, host: Host) -> Iterator[Resource]:
    """Host KSM on while the lab runs: as `ksm = true` (or a rate) asks, which needs root and a kernel
    with KSM (exit 3 otherwise); by default where vmlaunch may (as root) for a lab of two VMs or more
    whose RAM KSM can merge (hugepages it cannot), with a rate that scales (`resources/ksm.py`)."""
    memory = lab.memory
    path: KeyPath = ("lab", "memory", "ksm")
    if memory.ksm is False:
        return
    mergeable = [vm for vm in lab.vms if vm.hugepages is None]
    if host.ksm is None or not host.ksm.writable:
        if memory.ksm:
            where = Location(lab.file, lab.source.line_of(path), path)
            if host.ksm is None:
                raise HostError("this kernel has no KSM (no /sys/kernel/mm/ksm)",
                                "use a kernel built with CONFIG_KSM, or set ksm = false", where)
            raise HostError("turning host KSM on needs root (it is one setting for the whole host)",
                            "run vmlaunch as root, or set ksm = false (an administrator may turn KSM on "
                            "with `echo 1 > /sys/kernel/mm/ksm/run`: the guests' memory is mergeable)",
                            where)
        return
    if not mergeable or (memory.ksm is None and len(mergeable) < 2):
        return
    from vmlaunch.resources.ksm import Ksm, default_settings, explicit_settings

    if memory.ksm_pages_to_scan is not None or memory.ksm_sleep_ms is not None:
        yield Ksm(settings=explicit_settings(host.ksm.advisor, memory.ksm_pages_to_scan, memory.ksm_sleep_ms),
                  explicit=True)
    else:
        yield Ksm(settings=default_settings(host.ksm.advisor, sum(vm.memory_mib for vm in mergeable)))


def manager_resources(lab: LabSpec, host: Host, run_dir: RunDir,
                      placements: dict[str, Placed] | None = None) -> Iterator[Resource]:
    """The lab manager, watching every VM of the lab (those `up` starts later too)."""
    if not has_manager(lab):
        return
    budget = lab.memory.budget_mib or int(host.memory_mib * BUDGET_SHARE)
    placements = placements or {}
    cpusets = host.cpusets

    def placed(vm: VmSpec) -> dict[str, object]:
        where = placements.get(vm.name)
        if where is None:
            return {}
        cgroup = str(cpusets.folder(cgroup_name(lab.name, vm.name))) if cpusets else None
        return {"nodes": where.nodes, "movable": where.movable and cgroup is not None, "cgroup": cgroup}

    vms = tuple(ManagedVm(name=vm.name, maximum_mib=vm.memory_mib,
                          minimum_mib=balloon_min_mib(vm) if vm.balloon.policy is BalloonPolicy.AUTO
                          else vm.memory_mib,
                          auto=vm.balloon.enabled and vm.balloon.policy is BalloonPolicy.AUTO,
                          balloon=vm.balloon.enabled, **placed(vm))  # type: ignore[arg-type]
                for vm in lab.vms)
    yield LabManager(run_dir=run_dir, config=ManagerConfig(
        lab=lab.name, budget_mib=budget, vms=vms, balance=balancing(lab, host),
        balance_interval=lab.placement.interval_s))


def boot_disks(lab_dir: LabDir, vm: VmSpec) -> tuple[tuple[KeyPath, Disk], ...]:
    """The VM's disks with their key paths, in the order the guest sees them: its image's overlay
    first, then its [[disk]]s."""
    disks = tuple((("vm", vm.name, "disk", index), disk) for index, disk in enumerate(vm.disks))
    if vm.image is None:
        return disks
    overlay = Disk(file=lab_dir.vm(vm.name).overlay, format=DiskFormat.QCOW2)
    return ((("vm", vm.name, "image"), overlay), *disks)


def slot_name(node: str) -> str:
    """The block node a disk's device reads and writes through: its fault slot."""
    return f"{node}-slot"


def fault_slot(node: str, disk: Disk) -> dict[str, object]:
    """The options of the disk's fault slot: a `raw` node over the disk's format node `node`, as the
    device's drive. It passes every request through unchanged at the guest's offsets; a disk fault
    (`rig/diskfault.py`) puts QEMU's blkdebug between it and `node` while the VM runs (blkdebug
    injects only below a format node) and takes it out again. `bench/disk_slot.py` measures what the
    slot costs. The runtime reopens the slot with these options and only `file` changed."""
    slot: dict[str, object] = {"driver": "raw", "node-name": slot_name(node), "file": node,
                               "read-only": disk.readonly}
    if disk.discard:  # each node passes a discard on only when it has this; zeroes are detected below
        slot["discard"] = "unmap"
    return slot


def reports_free_pages(vm: VmSpec) -> bool:
    """Free page reporting on the balloon: as the spec says, but never for RAM on hugepages (a freed
    4 KiB page cannot be given back out of a hugepage)."""
    return vm.balloon.free_page_reporting and vm.hugepages is None


def video_of(lab: LabSpec, vm: VmSpec) -> Video:
    """The VM's screen as the spec asks for it: `video` given, or the default on the x86 PC machines
    (no screen elsewhere: QEMU's other x86 machines have no PCI bus or no VGA)."""
    if vm.video is Video.STD and not is_pc_machine(vm.machine) \
            and not lab.source.defines(("vm", vm.name, "video")):
        return Video.NONE
    return vm.video


def is_pc_machine(machine: str) -> bool:
    """The x86 PC machines (`pc`, `q35`, and their versions such as pc-q35-7.2), which have an ISA bus."""
    return machine in ("pc", "q35") or machine.startswith(("pc-", "pc-i440fx", "pc-q35"))


# Linux's check that the IO-APIC timer ticks, at boot, fails when the vCPU is starved of host CPU
# (a TCG guest beside many others): "Kernel panic - not syncing: IO-APIC + timer doesn't work!". Linux
# skips it itself on KVM (kvmclock); under TCG vmlaunch asks it to, on a direct-boot kernel's line.
NO_TIMER_CHECK = "no_timer_check"
MAX_CMDLINE = 2048  # bytes of an x86 kernel command line (longer: the guest prints nothing at all)


def kernel_append(vm: VmSpec, accel: Accel) -> str | None:
    """The kernel command line of a direct-boot VM: the spec's `append`, and under TCG no_timer_check."""
    if vm.kernel is None or accel is not Accel.TCG:
        return vm.append
    words = (vm.append or "").split()
    if NO_TIMER_CHECK in words or any(word.startswith(f"{NO_TIMER_CHECK}=") for word in words):
        return vm.append
    longer = f"{vm.append} {NO_TIMER_CHECK}" if vm.append else NO_TIMER_CHECK
    return longer if len(longer.encode()) < MAX_CMDLINE else vm.append


def memory_notes(vms: Sequence[VmSpec], host: Host, lab: LabSpec | None = None) -> Iterator[str]:
    """The KVM guide's over-commit target: guests together use at most 80 % of host memory. A lab
    manager keeps the guests within the lab's budget: then the budget is what is weighed. `vms` are the
    VMs being started (all the lab's, or those named): the notes say which they weigh."""
    if lab is not None and sizes_balloons(lab):
        budget = lab.memory.budget_mib
        target = int(host.memory_mib * BUDGET_SHARE)
        if budget is not None and budget > target:
            yield (f"the lab's memory budget, {mib_words(budget)}, is more than {BUDGET_SHARE:.0%} of the "
                   f"host's {mib_words(host.memory_mib)}: the host may swap, which hurts every guest")
        floors = sum(balloon_min_mib(vm) if vm.balloon.policy is BalloonPolicy.AUTO else vm.memory_mib
                     for vm in lab.vms)
        if budget is None and floors > target:
            yield (f"the lab's VMs keep at least {mib_words(floors)} together "
                   f"(balloon.min of the auto ones, memory of the others), more than the default budget "
                   f"of {mib_words(target)} ({BUDGET_SHARE:.0%} of the host): the lab manager holds them "
                   "at their minimums")
        return
    total = sum(vm.memory_mib for vm in vms)
    if total > host.memory_mib * MEMORY_TARGET:
        if len(vms) == 1:
            asked = f"VM {vms[0].name} asks for {mib_words(total)} of memory"
        elif lab is None or len(vms) == len(lab.vms):
            asked = f"the lab's {len(vms)} VMs ask for {mib_words(total)} of memory together"
        else:
            names = ", ".join(vm.name for vm in vms)
            asked = f"the {len(vms)} VMs started ({names}) ask for {mib_words(total)} of memory together"
        yield (f"{asked}, more than {MEMORY_TARGET:.0%} of the host's {mib_words(host.memory_mib)}; "
               "ballooning and KSM help, swapping hurts every guest")


def confined_as_root(host: Host) -> bool:
    """Whether each QEMU runs under a uid of its own: a lab run as root, with confinement on."""
    return host.as_root and host.confine


def user_resources(vms: Sequence[VmSpec], host: Host) -> Iterator[Resource]:
    """Last, right before the QEMUs start: each VM's own uid (host/confine.py)."""
    if confined_as_root(host):
        from vmlaunch.resources.vmuser import VmUser

        for vm in vms:
            yield VmUser(vm=vm.name, run_root=host.run_root,
                         shares=tuple((share.source, share.readonly) for share in vm.shares))


def netem_side(lab: LabSpec, vm: VmSpec, index: int, host: Host) -> NetemWhere | None:
    """Where the spec's netem of NIC `index` runs (HOST or GUEST), None when it has none. `host` on a
    host whose kernel has no netem is a HostError at the key; netem in a guest without its command
    channel (`agent = false`) too."""
    from vmlaunch.host.netem import no_netem
    from vmlaunch.spec.netem import resolve_where

    nic = vm.nics[index]
    if nic.netem is None:
        return None
    host_side = isinstance(lab.network(nic.network), TAP_NETWORKS)
    where = resolve_where(nic.netem.where, host_side=host_side, host_netem=bool(host.netem))
    path: KeyPath = ("vm", vm.name, "nic", index, "netem")
    if where is NetemWhere.HOST and host.netem is False:
        error = no_netem()
        raise HostError(error.message, error.hint, Location(lab.file, lab.source.line_of(path), path))
    if where is NetemWhere.GUEST and getattr(vm, "agent", None) is False:
        raise HostError("netem in the guest is set through its command channel, and the VM has agent = "
                        "false", "turn the agent on, or use where = \"host\" on a bridge or tap network",
                        Location(lab.file, lab.source.line_of(path), path))
    return where


def netem_resources(lab: LabSpec, vms: Sequence[VmSpec], host: Host) -> Iterator[Resource]:
    """After the taps: each NIC's netem from the spec that runs on the host side (its tap)."""
    for vm in vms:
        for index, _ in enumerate(vm.nics):
            if netem_side(lab, vm, index, host) is NetemWhere.HOST:
                from vmlaunch.resources.netem import TapNetem

                tap = tap_name(lab.name, vm.name, index)
                netem = vm.nics[index].netem
                assert netem is not None
                yield TapNetem(tap=tap, ifb=netem_ifb_name(tap), vm=vm.name, index=index, netem=netem)


def host_resources(lab: LabSpec, vms: Sequence[VmSpec], host: Host | None = None) -> Iterator[Resource]:
    """In the order `up` applies them: PCI first (checked before anything else changes)."""
    for vm in vms:
        for index, dev in enumerate(vm.pci):
            from vmlaunch.resources.pci import PciBind

            yield PciBind(address=dev.host, driver=dev.driver, vm=vm.name,
                          origin=DiskOrigin(lab.file, ("vm", vm.name, "pci", index), lab.source))
    lab_dir = LabDir.of(lab.file, lab.name)
    if any(needs_lab_dir(vm) for vm in vms):
        yield LabDirResource(lab_dir)
    for vm in vms:
        if vm.hugepages is not None:
            from vmlaunch.resources.hugepages import Hugepages

            yield Hugepages(vm=vm.name, size_kib=vm.hugepages.kib,
                            pages=(vm.memory_mib << 10) // vm.hugepages.kib, reserve=vm.reserve_hugepages)
    for vm in vms:
        vm_dir = lab_dir.vm(vm.name)
        if vm.firmware is Firmware.UEFI and host is not None and host.ovmf is not None:
            yield Nvram(vm=vm.name, path=vm_dir.nvram, template=host.ovmf.vars)
        if vm.image is not None:
            line = lab.source.line_of(("vm", vm.name, "disk_size" if vm.disk_size else "image"))
            yield Overlay(vm=vm.name, image=lab.image(vm.image), path=vm_dir.overlay, size=vm.disk_size,
                          spec=lab.file, line=line)
        if vm.cloud_init is not None:
            mgmt = management_mac(lab.mac_prefix, lab.name, vm.name) if vm.ssh else None
            yield Seed(vm=vm.name, lab=lab, lab_dir=lab_dir, management_mac=mgmt)
    for vm in vms:
        for index, disk in enumerate(vm.disks):  # every disk file is checked; one with a size created
            yield Image(path=disk.file, size=disk.size, format=disk.format, vm=vm.name,
                        readonly=disk.readonly, block_device=disk.block_device,
                        accept_other_owner=disk.accept_other_owner,
                        origin=DiskOrigin(lab.file, ("vm", vm.name, "disk", index), lab.source))
    used = {nic.network for vm in vms for nic in vm.nics}
    for net in lab.networks:
        if isinstance(net, BridgeNetwork) and net.name in used:
            from vmlaunch.resources.bridge import Bridge

            yield Bridge(name=net.bridge, network=net.name, mtu=net.mtu, uplink=net.uplink, vlan=net.vlan)
    for vm in vms:
        for index, nic in enumerate(vm.nics):
            net = lab.network(nic.network)
            if not isinstance(net, TAP_NETWORKS):
                continue
            # Imported here, as the other kinds a lab may not use: `up` builds no class it never uses.
            from vmlaunch.resources.script import ScriptEnv, TapScript
            from vmlaunch.resources.tap import Tap

            bridge = net.bridge if isinstance(net, BridgeNetwork) else None
            tap = tap_name(lab.name, vm.name, index)
            yield Tap(ifname=tap, bridge=bridge, vm=vm.name, mtu=net.mtu, multi_queue=nic.queues > 1)
            if net.up_script is not None:  # right after its tap: the tap is made, on its bridge
                env = ScriptEnv(lab=lab.name, vm=vm.name, nic=index, network=net.name, tap=tap,
                                mac=nic.mac, bridge=bridge, mtu=net.mtu, ip=nic.ip)
                yield TapScript(network=net.name, up_script=net.up_script, down_script=net.down_script,
                                env=env, origin=DiskOrigin(lab.file, ("network", net.name), lab.source))


class _Compiler:
    def __init__(self, lab: LabSpec, host: Host, run_dir: RunDir, placements: dict[str, Placed],
                 kernels: Mapping[Path, KernelBoot]) -> None:
        self.lab = lab
        self.host = host
        self.run_dir = run_dir
        self.placements = placements
        self.kernels = kernels
        self.lab_dir = LabDir.of(lab.file, lab.name)

    def fail(self, path: KeyPath, message: str, hint: str | None = None) -> HostError:
        return HostError(message, hint, self.location(path))

    def location(self, path: KeyPath) -> Location:
        return Location(self.lab.file, self.lab.source.line_of(path), path)

    def need_device(self, path: KeyPath, device: str) -> None:
        if device not in self.host.qemu.devices:
            raise self.fail(path, f"this QEMU ({self.host.qemu.version_text}) has no {device} "
                            "device", f"`{self.host.qemu.binary} -device help` lists what it has")

    def vm(self, vm: VmSpec) -> VmPlan:
        path: KeyPath = ("vm", vm.name)
        accel = self.accel(vm)
        files = self.run_dir.vm(vm.name)
        managed = has_manager(self.lab)
        for sock in files.sockets if managed else (files.qmp, files.console, files.agent, files.qga):
            if len(str(sock).encode()) > UNIX_PATH_MAX:
                raise HostError(f"socket path {sock} is longer than {UNIX_PATH_MAX} bytes",
                                "set VMLAUNCH_RUN_DIR to a shorter directory")
        cpu = vm.cpu_model or ("host" if accel.accel is Accel.KVM else TCG_CPU)
        firmware, machine = self.firmware(path, vm)
        memory = self.memory_backend(path, vm)
        if memory and "-numa" not in memory:
            machine["memory-backend"] = "ram"
        if self.lab.memory.ksm is False:  # not merged even while another lab has KSM on
            machine["mem-merge"] = "off"
        argv = [
            self.host.qemu.binary,
            "-name", opts("", guest=vm.name, process=process_name(vm.name), debug_threads=True),
            "-machine", opts(vm.machine, **machine),
            "-accel", opts("tcg", tb_size=TCG_CACHE_MIB) if accel.accel is Accel.TCG else accel.accel.value,
            "-cpu", cpu,
            "-smp", str(vm.cpus),
            "-m", f"{vm.memory_mib}M",
            "-nodefaults",
            "-no-user-config",
            "-display", "none",
            "-msg", "timestamp=on",
            *self.sandbox(),
            "-chardev", opts("socket", id="qmp", path=str(files.qmp), server=True, wait=False),
            "-mon", "chardev=qmp,mode=control",
        ]
        if managed:  # the lab manager's own monitor: QMP serves one client at a time
            argv += ["-chardev", opts("socket", id="manager", path=str(files.manager_qmp), server=True,
                                      wait=False),
                     "-mon", "chardev=manager,mode=control"]
        argv += [
            "-chardev", opts("socket", id="console", path=str(files.console), server=True,
                             wait=False, logfile=str(files.serial_log)),  # a fresh log per boot
            "-serial", "chardev:console",
            "-pidfile", str(files.pidfile),
            # QEMU's own messages for its whole life, apart from what it says while it starts (stderr)
            "-D", str(files.qemu_log),
        ]
        argv += memory
        if vm.kernel is not None:
            boot = self.kernel_boot(vm)
            argv += ["-kernel", str(boot.elf if boot is not None and boot.elf is not None else vm.kernel)]
        if vm.initrd is not None:
            argv += ["-initrd", str(vm.initrd)]
        append = kernel_append(vm, accel.accel)
        if append is not None:
            argv += ["-append", append]
        argv += firmware
        argv += self.disks(path, vm)
        argv += self.seed(path, vm)
        argv += self.shares(path, vm)
        argv += self.nics(path, vm)
        argv += self.management_nic(path, vm)
        argv += self.pci(path, vm)
        if vm.balloon.enabled:
            self.need_device((*path, "balloon"), "virtio-balloon-pci")
            argv += ["-device", json_arg({
                "driver": "virtio-balloon-pci",
                "id": "balloon0",
                "deflate-on-oom": vm.balloon.deflate_on_oom,
                "free-page-reporting": reports_free_pages(vm),
            })]
        argv += self.panic_device(vm)
        argv += self.generation_id(vm)
        argv += self.channel(path, vm, files)
        argv += self.firmware_log(vm, files)
        argv += self.display(path, vm)
        return VmPlan(name=vm.name, argv=tuple(argv), accel=accel, files=files, vcpus=vm.cpus,
                      notes=tuple(self.notes(vm)),
                      placement=self.placements.get(vm.name),
                      guest_netem=tuple((index, nic.mac, nic.netem) for index, nic in enumerate(vm.nics)
                                        if nic.netem is not None
                                        and netem_side(self.lab, vm, index, self.host) is NetemWhere.GUEST),
                      disk_faults=tuple(StartFaults(f"disk{index}", format_key_path(key), disk.bus,
                                                    disk.readonly, disk.discard, disk.faults,
                                                    tuple(self.location((*key, "fault", number))
                                                          for number in range(len(disk.faults))))
                                        for index, (key, disk) in enumerate(self.boot_disks(vm))
                                        if disk.faults),
                      ssh_user=(vm.cloud_init.user if vm.cloud_init else DEFAULT_CLOUD_USER) if vm.ssh
                      else None)

    def memory_backend(self, path: KeyPath, vm: VmSpec) -> list[str]:
        """The guest's RAM as a memory backend when it needs one: bound to the host node(s) placement
        chose (`host-nodes`, `policy = bind`), one backend per guest node for a VM that spans nodes
        (`-numa node,memdev=`), and from hugepages: a memfd on hugetlbfs, allocated whole when QEMU
        starts (allocated then, a pool too small fails `up` with QEMU's message; allocated as the guest
        touches it, it would kill a running guest with SIGBUS instead)."""
        placed = self.placements.get(vm.name)
        if vm.hugepages is None and placed is None:
            return []
        backend: dict[str, object] = {"qom-type": "memory-backend-ram"}
        if vm.hugepages is not None:
            offered = self.host.hugepage_sizes_kib
            if vm.hugepages.kib not in offered:
                sizes = ", ".join(format_size(kib << 10) for kib in sorted(offered)) or "none"
                raise self.fail((*path, "hugepages"), f"this host has no {vm.hugepages.value} hugepages "
                                f"(it offers: {sizes})",
                                "use a size it offers, or boot the kernel with hugepagesz=1G hugepages=N")
            backend = {"qom-type": "memory-backend-memfd", "hugetlb": True,
                       "hugetlbsize": vm.hugepages.kib << 10, "prealloc": True, "prealloc-threads": vm.cpus}
        if placed is None:
            return ["-object", json_arg({**backend, "id": "ram", "size": vm.memory_mib << 20})]
        if not placed.guest_nodes:
            return ["-object", json_arg({**backend, "id": "ram", "size": vm.memory_mib << 20,
                                         "host-nodes": list(placed.nodes), "policy": "bind"})]
        argv: list[str] = []
        for index, node in enumerate(placed.guest_nodes):
            memdev = f"ram-node{index}"
            argv += ["-object", json_arg({**backend, "id": memdev, "size": node.memory_mib << 20,
                                          "host-nodes": [node.host_node], "policy": "bind"})]
            cpus = {"cpus": f"{node.vcpus[0]}-{node.vcpus[-1]}"} if node.vcpus else {}
            argv += ["-numa", opts("node", nodeid=index, memdev=memdev, **cpus)]
        return argv

    def channel(self, path: KeyPath, vm: VmSpec, files: VmFiles) -> list[str]:
        """The command channel (`agent`): one virtio-serial controller with two ports, each a socket
        server in the run dir: org.vmlaunch.agent.0 for vmlaunch's agent, org.qemu.guest_agent.0 for
        QEMU's guest agent where the guest runs one (rig/agent.py takes whichever answers)."""
        if not agent_on(vm):
            return []
        if vm.agent is None and not {"virtio-serial-pci", "virtserialport"} <= self.host.qemu.devices:
            return []  # on by default only: a QEMU without virtio-serial runs the VM without a channel
        for device in ("virtio-serial-pci", "virtserialport"):
            self.need_device((*path, "agent"), device)
        argv = ["-device", json_arg({"driver": "virtio-serial-pci", "id": "channels"})]
        for chardev, sock, port in (("agent", files.agent, AGENT_PORT), ("qga", files.qga, QGA_PORT)):
            argv += ["-chardev", opts("socket", id=chardev, path=str(sock), server=True, wait=False),
                     "-device", json_arg({"driver": "virtserialport", "bus": "channels.0", "chardev": chardev,
                                          "id": f"{chardev}-port", "name": port})]
        return argv

    def firmware_log(self, vm: VmSpec, files: VmFiles) -> list[str]:
        """SeaBIOS's log, for the boot timeline: it writes to the isa-debugcon port 0x402 whatever it
        boots (OVMF does not: nothing under UEFI)."""
        if vm.firmware is Firmware.UEFI or "isa-debugcon" not in self.host.qemu.devices \
                or not is_pc_machine(vm.machine):
            return []
        return ["-chardev", opts("file", id="firmware", path=str(files.firmware_log)),
                "-device", json_arg({"driver": "isa-debugcon", "iobase": 0x402, "chardev": "firmware"})]

    def display(self, path: KeyPath, vm: VmSpec) -> list[str]:
        """The VM's screen (`video`), for QMP `screendump` and `send-key`; `-display none` stays: the
        screen is read, never shown in a window. Last among the PCI devices, so that adding it moved no
        other device's slot (a guest names its NICs by slot: enp0s2 stays enp0s2). Left to its default,
        a machine or QEMU without VGA has none; asked for, it is an error there."""
        video = video_of(self.lab, vm)
        if video is Video.NONE:
            return []
        driver = VIDEO_DEVICES[video]
        if driver not in self.host.qemu.devices and not self.lab.source.defines((*path, "video")):
            return []
        self.need_device((*path, "video"), driver)
        return ["-device", json_arg({"driver": driver, "id": "video0"})]

    def panic_device(self, vm: VmSpec) -> list[str]:
        """QEMU's pvpanic device on the x86 PC machines (pc, q35) where this QEMU has it: a guest whose
        kernel loads its driver reports a panic to QEMU, which pauses it in run state guest-panicked
        (`-action panic=pause`; QEMU's own default would quit and lose the state), so that `up`'s waits
        end at once, `status` says `panicked` and `logs` keeps the console."""
        if "pvpanic" not in self.host.qemu.devices or not is_pc_machine(vm.machine) \
                or self.host.qemu.version < (6, 0, 0):  # no -action: a panic would quit QEMU
            return []
        return ["-device", json_arg({"driver": "pvpanic", "id": "pvpanic"}), "-action", "panic=pause"]

    def generation_id(self, vm: VmSpec) -> list[str]:
        """QEMU's vmgenid device on the x86 PC machines where this QEMU has it: a VM generation id
        (ACPI) the guest reads, new at every QEMU start (`guid=auto`) and so after every restore of a
        snapshot, which a Linux guest takes for a fork of its machine and reseeds its random number
        generator ("crng reseeded due to virtual machine fork"): two runs from one snapshot never draw
        the same random numbers. It is no PCI device: no slot moves. A device a VM can only have from
        its start, which a fork of a running VM needs."""
        if "vmgenid" not in self.host.qemu.devices or not is_pc_machine(vm.machine):
            return []
        return ["-device", json_arg({"driver": "vmgenid", "id": "vmgenid0"})]

    def firmware(self, path: KeyPath, vm: VmSpec) -> tuple[list[str], dict[str, str]]:
        """UEFI: OVMF's code read-only and shared, the VM's own copy of the variables, as the two
        pflash devices of the machine. BIOS: QEMU's default SeaBIOS, nothing to add."""
        if vm.firmware is not Firmware.UEFI:
            return [], {}
        ovmf = self.host.ovmf
        if ovmf is None:
            raise self.fail((*path, "firmware"), "firmware = \"uefi\" needs OVMF, which this host "
                            "does not have", "apt-get install ovmf")
        if not vm.machine.startswith(("q35", "pc-q35")):
            raise self.fail((*path, "machine"), "firmware = \"uefi\" needs machine = \"q35\"")
        argv: list[str] = []
        for node, file, readonly in (("fw-code", ovmf.code, True),
                                     ("fw-vars", self.lab_dir.vm(vm.name).nvram, False)):
            argv += ["-blockdev", json_arg({"driver": "file", "filename": str(file),
                                            "node-name": f"{node}-file", "read-only": readonly})]
            argv += ["-blockdev", json_arg({"driver": "raw", "node-name": node, "file": f"{node}-file",
                                            "read-only": readonly})]
        return argv, {"pflash0": "fw-code", "pflash1": "fw-vars"}

    def boot_disks(self, vm: VmSpec) -> tuple[tuple[KeyPath, Disk], ...]:
        return boot_disks(self.lab_dir, vm)

    def seed(self, path: KeyPath, vm: VmSpec) -> Iterator[str]:
        """The NoCloud seed as a read-only virtio disk: cloud-init finds it by its label, cidata."""
        if vm.cloud_init is None:
            return
        self.need_device((*path, "cloud_init"), "virtio-blk-pci")
        seed = str(self.lab_dir.vm(vm.name).seed)
        yield from ("-blockdev", json_arg({"driver": "file", "filename": seed, "node-name": "seed-file",
                                           "read-only": True}))
        yield from ("-blockdev", json_arg({"driver": "raw", "node-name": "seed", "file": "seed-file",
                                           "read-only": True}))
        yield from ("-device", json_arg({"driver": "virtio-blk-pci", "id": "seed", "drive": "seed"}))

    def sandbox(self) -> list[str]:
        """QEMU's seccomp filter (host/confine.py says why each): no obsolete system calls, no new process
        (nothing QEMU runs needs one: vmlaunch makes the taps, QEMU runs no script), no change of
        scheduling or priority. `elevateprivileges` stays allowed: `-runas`, which drops root after
        start-up, is a setuid QEMU makes itself once the filter is in place."""
        if not (self.host.confine and self.host.qemu.seccomp):
            return []
        return ["-sandbox", SANDBOX]

    def shares(self, vm_path: KeyPath, vm: VmSpec) -> Iterator[str]:
        """Each share over 9p (virtio): the guest's cloud-init mounts it by its tag.

        security_model=mapped-xattr: what the guest sets (owner, mode, file type) is kept in
        `user.virtfs.*` extended attributes of the host file, never applied to it. QEMU creates every
        host file as a regular file of mode `fmode` (a guest's mknod, mkfifo and symlink too) and every
        folder with `dmode`, so a guest's root cannot plant a setuid, setgid, device, FIFO or symlink
        on the host, nor file capabilities (only user.* and ACL xattrs pass, and ACLs are mapped too).
        Group bits in fmode/dmode: where `up` gives the share's owner a default ACL entry
        (`shareaccess.grant`), a new file's ACL mask is its create mode's group bits; with 0600 that
        entry would grant nothing. Without an ACL, QEMU's umask (vmlaunch's) applies as usual."""
        for index, share in enumerate(vm.shares):
            path = (*vm_path, "share", index)
            self.need_device(path, "virtio-9p-pci")
            fsdev = f"fsdev{index}"
            backend = opts("local", id=fsdev, path=str(share.source),
                           **({"readonly": True} if share.readonly else {}))
            # opts would write security-model; QEMU reads fmode and dmode as C numbers (0 is octal)
            yield from ("-fsdev", f"{backend},security_model=mapped-xattr,fmode={SHARE_FMODE:04o},"
                                  f"dmode={SHARE_DMODE:04o}")
            yield from ("-device", json_arg({"driver": "virtio-9p-pci", "id": f"share{index}",
                                             "fsdev": fsdev, "mount_tag": share.tag}))

    def management_nic(self, path: KeyPath, vm: VmSpec) -> Iterator[str]:
        """The VM's SSH port: QEMU's user network with 127.0.0.1:0 (a free port the kernel picks, read
        back over QMP once QEMU runs: no race with another program) forwarded to 22."""
        if not vm.ssh:
            return
        self.need_device((*path, "ssh"), "virtio-net-pci")
        yield from ("-netdev", json_arg({"type": "user", "id": "mgmt",
                                         "hostfwd": [{"str": "tcp:127.0.0.1:0-:22"}]}))
        yield from ("-device", json_arg({"driver": "virtio-net-pci", "id": "mgmt", "netdev": "mgmt",
                                         "mac": management_mac(self.lab.mac_prefix, self.lab.name,
                                                               vm.name)}))

    def accel(self, vm: VmSpec) -> AccelChoice:
        kvm = self.host.kvm
        if vm.accel is Accel.TCG:
            return AccelChoice(Accel.TCG, "accel = \"tcg\" in the spec")
        if vm.accel is Accel.KVM:
            if not kvm.usable:
                raise self.fail(("vm", vm.name, "accel"), f"accel = \"kvm\", but {kvm.reason}",
                                "use accel = \"auto\" (falls back to TCG) or \"tcg\"")
            return AccelChoice(Accel.KVM, "accel = \"kvm\" in the spec")
        if accel_of(vm.accel, kvm) is Accel.KVM:
            return AccelChoice(Accel.KVM, kvm.reason)
        return AccelChoice(Accel.TCG, f"KVM not usable: {kvm.reason}; TCG emulates (slower)")

    def kernel_boot(self, vm: VmSpec) -> KernelBoot | None:
        """How the VM's kernel boots when it may boot from its decompressed ELF (`fast_boot_wanted`):
        the ELF, or the kernel with the reason."""
        if vm.kernel is None or not fast_boot_wanted(vm, self.host):
            return None
        return self.kernels.get(vm.kernel)

    def kernel_notes(self, vms: Sequence[VmSpec]) -> Iterator[str]:
        """Which kernel boots under TCG and why, once per kernel: `alpha, beta: kernel ... boots ...`;
        not a boot through PVH this host was told of before (`told`)."""
        chosen: dict[KernelBoot, list[str]] = {}
        for vm in vms:
            boot = self.kernel_boot(vm)
            if boot is not None and not boot.told:
                chosen.setdefault(boot, []).append(vm.name)
        for boot, names in chosen.items():
            yield f"{', '.join(names)}: {boot.why}"

    def notes(self, vm: VmSpec) -> Iterator[str]:
        if vm.cpus > self.host.cpus:
            yield (f"{vm.name}: {vm.cpus} vCPUs on a host with {self.host.cpus} CPUs; over-committed "
                   "vCPUs slow every guest (allocate the fewest vCPUs that do the job)")
        for index, (_, disk) in enumerate(self.boot_disks(vm)):
            if disk.faults:
                from vmlaunch.spec.diskfault import describe

                yield (f"{vm.name}: disk{index} breaks from the start ([[fault]]): "
                       f"{'; '.join(describe(fault) for fault in disk.faults)}; `vmlaunch fault SPEC "
                       f"{vm.name} disk{index} clear` takes it off")

    def disks(self, vm_path: KeyPath, vm: VmSpec) -> Iterator[str]:
        if any(disk.bus is DiskBus.SCSI for disk in vm.disks):
            self.need_device(vm_path, "virtio-scsi-pci")
            yield from ("-device", json_arg({"driver": "virtio-scsi-pci", "id": "scsi0"}))
        sata_port = 0
        for index, (path, disk) in enumerate(self.boot_disks(vm)):
            node = f"disk{index}"
            yield from ("-blockdev", json_arg(self.file_node(path, disk, f"{node}-file")))
            cache = {"direct": disk.cache.direct, "no-flush": disk.cache.no_flush}
            fmt: dict[str, object] = {"driver": disk.format.value, "node-name": node,
                                      "file": f"{node}-file", "cache": cache,
                                      "read-only": disk.readonly}
            if disk.discard:
                fmt.update({"discard": "unmap", "detect-zeroes": "unmap"})
            yield from ("-blockdev", json_arg(fmt))
            yield from ("-blockdev", json_arg(fault_slot(node, disk)))
            # QEMU's ide-hd refuses a read-only node ("Block node is read-only"): such a SATA disk is a
            # CD-ROM drive, as libvirt and KubeVirt have it
            driver = "ide-cd" if disk.bus is DiskBus.SATA and disk.readonly else DISK_DEVICES[disk.bus]
            self.need_device(path, driver)
            # serial: the guest finds the disk by the name `status` and `fault` give it
            # (/dev/disk/by-id/virtio-disk1, ...-QEMU_HARDDISK_disk1, ...-QEMU_DVD-ROM_disk1)
            device: dict[str, object] = {"driver": driver, "id": node,
                                         "drive": slot_name(node), "serial": node,
                                         "write-cache": "on" if disk.cache.write_cache else "off"}
            if disk.bus is DiskBus.SCSI:
                device["bus"] = "scsi0.0"
            elif disk.bus is DiskBus.SATA:
                device["bus"] = f"ide.{sata_port}"
                sata_port += 1
            if vm.kernel is None and index == 0:
                device["bootindex"] = 0
            if disk.read_error is not None:
                device["rerror"] = disk.read_error.value
            if disk.write_error is not None:
                device["werror"] = disk.write_error.value
            yield from ("-device", json_arg(device))

    def file_node(self, path: KeyPath, disk: Disk, name: str) -> dict[str, object]:
        aio = disk.aio or self.best_aio(disk)
        if aio is Aio.IO_URING and not self.host.qemu.io_uring:
            raise self.fail((*path, "aio"), "aio = \"io_uring\", but this QEMU or kernel cannot "
                            "use io_uring", "leave aio out to get the fastest that works")
        node: dict[str, object] = {
            "driver": "file",
            "filename": str(disk.file),
            "node-name": name,
            "aio": aio.value,
            "cache": {"direct": disk.cache.direct, "no-flush": disk.cache.no_flush},
            "read-only": disk.readonly,
        }
        if disk.discard:
            node["discard"] = "unmap"
        return node

    def best_aio(self, disk: Disk) -> Aio:
        """io_uring when it works (fastest measured, any cache mode); native needs O_DIRECT."""
        if self.host.qemu.io_uring:
            return Aio.IO_URING
        return Aio.NATIVE if disk.cache.direct else Aio.THREADS

    def nics(self, vm_path: KeyPath, vm: VmSpec) -> Iterator[str]:
        for index, nic in enumerate(vm.nics):
            path = (*vm_path, "nic", index)
            net = self.lab.network(nic.network)
            netdev = f"net{index}"
            if isinstance(net, UserNetwork):
                backend: dict[str, object] = {"type": "user", "id": netdev}
                if net.forward:
                    backend["hostfwd"] = [{"str": rule} for rule in net.forward]
            elif isinstance(net, SocketNetwork):
                # Loopback only: the segment never leaves the host.
                backend = {"type": "socket", "id": netdev, "mcast": f"{net.group}:{net.port}",
                           "localaddr": "127.0.0.1"}
            else:  # bridge and tap networks: the tap vmlaunch made
                backend = self.tap(nic, netdev, tap_name(self.lab.name, vm.name, index))
            yield from ("-netdev", json_arg(backend))
            yield from ("-device", json_arg(self.nic_device(path, nic, net, netdev, index)))

    def tap(self, nic: Nic, netdev: str, ifname: str) -> dict[str, object]:
        backend: dict[str, object] = {"type": "tap", "id": netdev, "ifname": ifname,
                                      "script": "no", "downscript": "no"}
        # vhost moves the data path into the kernel; QEMU aborts when asked for it without the device.
        if self.host.vhost_net and nic.model is NicModel.VIRTIO:
            backend["vhost"] = True
        if nic.queues > 1:
            backend["queues"] = nic.queues
        return backend

    def nic_device(
        self, path: KeyPath, nic: Nic, net: object, netdev: str, index: int
    ) -> dict[str, object]:
        driver = NIC_DEVICES[nic.model]
        self.need_device((*path, "model"), driver)
        device: dict[str, object] = {"driver": driver, "id": f"nic{index}", "netdev": netdev,
                                     "mac": nic.mac}
        if nic.model is NicModel.VIRTIO:
            if nic.queues > 1:
                device.update({"mq": True, "vectors": 2 * nic.queues + 2})
            if isinstance(net, TAP_NETWORKS) and net.mtu:
                device["host_mtu"] = net.mtu  # the guest driver picks the network's MTU up
        return device

    def pci(self, vm_path: KeyPath, vm: VmSpec) -> Iterator[str]:
        for index, dev in enumerate(vm.pci):
            path = (*vm_path, "pci", index)
            if dev.driver is PciDriver.VFIO:
                self.need_device(path, "vfio-pci")
                device = {"driver": "vfio-pci", "id": f"hostdev{index}", "host": dev.host}
            elif "pci-assign" in self.host.qemu.devices:
                device = {"driver": "pci-assign", "id": f"hostdev{index}", "host": dev.host}
            else:
                raise self.fail((*path, "driver"), "driver = \"pci-stub\" is for QEMU's legacy "
                                "device assignment (-pcidevice, pci-assign), which this QEMU "
                                f"({self.host.qemu.version_text}) no longer has",
                                "use driver = \"vfio-pci\"")
            yield from ("-device", json_arg(device))
