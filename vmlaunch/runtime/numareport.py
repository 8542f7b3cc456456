"""`vmlaunch numa SPEC`: where each VM's memory is and where its vCPUs ran, per node the load and the
free memory; the numa_maps report of "Improving the Out-of-Box KVM
Performance", for a lab.

Per VM: its memory per node from `/proc/PID/numa_maps` (pages, MiB and the share of it), the share
on the node(s) it is placed on (its cpuset cgroup's `cpuset.mems`, else where `up` put it), and for
each vCPU the CPU it last ran on, that CPU's node and the CPUs it may run on. Per node: its CPUs, free
memory, the lab's runnable vCPU threads on it now, and the load the lab manager's balancer saw last.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.host import cgroups
from vmlaunch.host.numa import (
    MIB,
    Topology,
    allowed_cpus,
    format_cpulist,
    iter_vcpu_threads,
    read_numa_maps,
    read_threads,
    read_topology,
)
from vmlaunch.lab import process as qemu
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.rundir import RunDir


@attrs.frozen
class VcpuReport:
    index: int
    thread: int
    cpu: int  # the CPU it last ran on
    node: int | None
    allowed: str  # the CPUs it may run on, as a CPU list
    running: bool  # runnable now (state R)


@attrs.frozen
class VmReport:
    name: str
    state: str  # running | stopped
    pid: int | None = None
    placed: tuple[int, ...] = ()  # the node(s) it is held on; () when not placed
    how: str = ""  # "cpuset cgroup ...", "sched_setaffinity", "not placed"
    memory: dict[int, int] = attrs.Factory(dict)  # node -> bytes
    page_counts: dict[int, int] = attrs.Factory(dict)  # node -> 4 KiB pages
    local: float | None = None  # share of its memory on `placed`
    policies: tuple[str, ...] = ()  # the memory policies numa_maps shows for its large mappings
    vcpus: tuple[VcpuReport, ...] = ()


@attrs.frozen
class NodeReport:
    id: int
    cpus: str
    memory: int  # bytes
    free: int  # bytes
    running: int  # the lab's runnable vCPU threads on it now
    load: float | None  # what the balancer saw last (runnable vCPUs per CPU), None: no balancer


@attrs.frozen
class NumaReport:
    nodes: tuple[NodeReport, ...]
    vms: tuple[VmReport, ...]
    balancer: dict[str, Any] | None  # the lab manager's last decision, as it saved it

    def to_json(self) -> dict[str, Any]:
        doc = attrs.asdict(self)
        for vm in doc["vms"]:  # JSON keys are strings: say so plainly
            vm["memory"] = {str(node): size for node, size in vm["memory"].items()}
            vm["page_counts"] = {str(node): pages for node, pages in vm["page_counts"].items()}
        return doc


def report(run_dir: RunDir, names: Sequence[str]) -> NumaReport:
    from vmlaunch.resources.placement import PlacementRecord
    from vmlaunch.runtime.control import manager_state

    topology = read_topology()
    journal = Journal.load(run_dir)
    vms = []
    running_on: dict[int, int] = {node.id: 0 for node in topology.nodes}
    for name in names:
        entry = journal.vms.get(name)
        pid = qemu.find_pid(run_dir.vm(name), entry.pid) if entry is not None else None
        if pid is None:
            vms.append(VmReport(name, "stopped"))
            continue
        record = journal.entry(PlacementRecord.kind, name)
        placement = record.record if record is not None else None
        if not isinstance(placement, PlacementRecord):
            placement = None
        vm = vm_report(name, pid, placement, topology)
        for vcpu in vm.vcpus:
            if vcpu.running and vcpu.node is not None:
                running_on[vcpu.node] = running_on.get(vcpu.node, 0) + 1
        vms.append(vm)
    balancer = manager_state(run_dir).get("placement")
    if not isinstance(balancer, dict):
        balancer = None
    loads = {node.get("id"): node.get("load") for node in (balancer or {}).get("nodes", [])
             if isinstance(node, dict)}
    nodes = tuple(NodeReport(node.id, format_cpulist(node.cpus), node.memory_mib * MIB, node.free_mib * MIB,
                             running_on.get(node.id, 0), loads.get(node.id)) for node in topology.nodes)
    return NumaReport(nodes, tuple(vms), balancer)


def vm_report(name: str, pid: int, placement: Any, topology: Topology) -> VmReport:
    placed: tuple[int, ...] = ()
    how = "not placed"
    if placement is not None:
        placed, how = tuple(placement.nodes), "sched_setaffinity"
        if placement.cgroup is not None:
            now = cgroups.place_of(Path(placement.cgroup))
            placed = now[1] if now is not None else placed
            how = f"cpuset cgroup {placement.cgroup}"
    memory = read_numa_maps(pid)
    vcpus = tuple(VcpuReport(index, thread.tid, thread.last_cpu, topology.node_of_cpu(thread.last_cpu),
                             format_cpulist(allowed_cpus(pid, thread.tid)), thread.state == "R")
                  for index, thread in sorted(iter_vcpu_threads(read_threads(pid))))
    if memory is None:
        return VmReport(name, "running", pid, placed, how, vcpus=vcpus)
    return VmReport(name, "running", pid, placed, how, dict(sorted(memory.per_node.items())),
                    {node: size // 4096 for node, size in sorted(memory.per_node.items())},
                    memory.local_share(placed) if placed else None, memory.policies, vcpus)


def render(result: NumaReport) -> list[str]:
    """The report as the seed showed numa_maps: per VM, per node pages, MiB and percent."""
    lines = []
    for vm in result.vms:
        if vm.state != "running":
            lines.append(f"[{vm.name}] {vm.state}")
            continue
        where = f"node {', '.join(map(str, vm.placed))}" if vm.placed else "not placed"
        local = f", {vm.local:.1%} local" if vm.local is not None else ""
        lines.append(f"[{vm.name}({vm.pid})] {where}{local} ({vm.how}; memory policy "
                     f"{', '.join(vm.policies) or 'default'})")
        total = sum(vm.memory.values()) or 1
        for node, size in vm.memory.items():
            lines.append(f"  node:[{node}] pages:[{vm.page_counts[node]:07d}] MiB:[{size // MIB:05d}] "
                         f"percent[{size / total * 100:06.2f}]")
        for vcpu in vm.vcpus:
            on = f"node {vcpu.node}" if vcpu.node is not None else "node ?"
            lines.append(f"  vCPU {vcpu.index} (thread {vcpu.thread}): last ran on CPU {vcpu.cpu} ({on}), "
                         f"may run on {vcpu.allowed}{'; running' if vcpu.running else ''}")
    lines.append(f"{'node':<6}{'cpus':<12}{'memory':>9}{'free':>9}{'running':>9}{'load':>8}")
    for row in result.nodes:
        load = f"{row.load:.3f}" if row.load is not None else "-"
        lines.append(f"{row.id:<6}{row.cpus:<12}{row.memory // MIB:>6} Mi{row.free // MIB:>6} Mi"
                     f"{row.running:>9}{load:>8}")
    if result.balancer:
        lines.append(f"balancer (round {result.balancer.get('round')}): {result.balancer.get('reason')}")
        move = result.balancer.get("last_move")
        if isinstance(move, dict):
            lines.append(f"  last move: {move.get('vm')} from node {move.get('from')} to node "
                         f"{move.get('to')} in {move.get('seconds')} s")
    return lines
