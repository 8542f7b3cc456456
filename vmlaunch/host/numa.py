"""The host's NUMA topology, and where a running VM's memory and vCPUs are, as the kernel tells.

Everything is read through the one sysfs root (`VMLAUNCH_SYSFS`, else /sys) and the one proc root
(`VMLAUNCH_PROC`, else /proc), so tests show vmlaunch fake 2- and 4-node hosts and fake VMs:

- nodes: `devices/system/node/nodeN/{cpulist,meminfo,distance}`; a kernel without NUMA (no node
  folders) is one node with every online CPU (`devices/system/cpu/online`) and /proc/meminfo's memory;
- a VM's memory per node: `/proc/PID/numa_maps` (`N<node>=<pages>` and `kernelpagesize_kB=` per
  mapping, as the seed's numa_maps report reads it);
- its threads: `/proc/PID/task/TID/stat` (state, CPU time, the CPU each last ran on) and `.../status`
  (`Cpus_allowed_list`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs

from vmlaunch.host.memory import proc_root

MIB = 1 << 20


def sysfs_root() -> Path:
    from vmlaunch.host.pci import sysfs_root as root

    return root()


def parse_cpulist(text: str) -> tuple[int, ...]:
    """`0-3,8,10-11` -> (0, 1, 2, 3, 8, 10, 11); raises ValueError for anything else."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"not a CPU list: {text.strip()!r}")
        first, last = int(low), int(high or low)
        if last < first or last - first > 65536:
            raise ValueError(f"not a CPU list: {text.strip()!r}")
        cpus.extend(range(first, last + 1))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> `0-3,8`: the form cpuset files and the kernel use."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = None
    for cpu in [*ordered, None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


@attrs.frozen
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    memory_mib: int  # MemTotal
    free_mib: int  # MemFree when it was read
    distances: tuple[int, ...] = ()  # to node 0, 1, ... (SLIT: 10 is local)


@attrs.frozen
class Topology:
    nodes: tuple[NumaNode, ...]

    @property
    def cpus(self) -> frozenset[int]:
        return frozenset(cpu for node in self.nodes for cpu in node.cpus)

    def node(self, node_id: int) -> NumaNode | None:
        return next((node for node in self.nodes if node.id == node_id), None)

    def node_of_cpu(self, cpu: int) -> int | None:
        return next((node.id for node in self.nodes if cpu in node.cpus), None)

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    def describe(self) -> str:
        return "; ".join(f"node {node.id}: CPUs {format_cpulist(node.cpus) or 'none'}, "
                         f"{node.memory_mib} MiB ({node.free_mib} free)" for node in self.nodes)


def _meminfo_mib(path: Path, prefix: str = "") -> dict[str, int]:
    values: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.removeprefix(prefix).partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) >> 10  # kB
    return values


def read_topology(sysfs: Path | None = None) -> Topology:
    """The host's nodes. A kernel without NUMA support, or without node folders, is one node."""
    root = sysfs or sysfs_root()
    folder = root / "devices" / "system" / "node"
    nodes = []
    try:
        names = sorted((name for name in os.listdir(folder) if re.fullmatch(r"node\d+", name)),
                       key=lambda name: int(name[4:]))
    except OSError:
        names = []
    for name in names:
        node_dir = folder / name
        node_id = int(name[4:])
        try:
            cpus = parse_cpulist((node_dir / "cpulist").read_text())
            memory = _meminfo_mib(node_dir / "meminfo", f"Node {node_id} ")
            distances = tuple(int(value) for value in (node_dir / "distance").read_text().split())
        except (OSError, ValueError):
            continue  # a node that went offline as it was read
        nodes.append(NumaNode(node_id, cpus, memory.get("MemTotal", 0), memory.get("MemFree", 0),
                              distances))
    if nodes:
        return Topology(tuple(nodes))
    try:
        cpus = parse_cpulist((root / "devices" / "system" / "cpu" / "online").read_text())
    except (OSError, ValueError):
        cpus = tuple(range(os.cpu_count() or 1))
    try:
        memory = _meminfo_mib(proc_root() / "meminfo")
    except OSError:
        memory = {}
    return Topology((NumaNode(0, cpus, memory.get("MemTotal", 0), memory.get("MemFree", 0), (10,)),))


# --- a running VM ----------------------------------------------------------------------------------


@attrs.frozen
class ThreadSample:
    tid: int
    name: str  # comm: "CPU 0/TCG", "CPU 1/KVM", "qemu-system-x86", "worker", ...
    state: str  # R, S, D, ...
    cpu_ticks: int  # utime + stime, clock ticks
    last_cpu: int  # the CPU it last ran on


def read_threads(pid: int) -> list[ThreadSample]:
    """The process's threads, [] when it is gone."""
    folder = proc_root() / str(pid) / "task"
    samples = []
    try:
        tids = [int(name) for name in os.listdir(folder) if name.isdigit()]
    except OSError:
        return []
    for tid in sorted(tids):
        try:
            text = (folder / str(tid) / "stat").read_text()
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            samples.append(ThreadSample(tid, name, fields[0], int(fields[11]) + int(fields[12]),
                                        int(fields[36])))
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended as it was read
    return samples


_VCPU_THREAD = re.compile(r"CPU (\d+)/(?:TCG|KVM|HVF|WHPX)")


def vcpu_index(thread_name: str) -> int | None:
    """The vCPU a thread runs, from the name QEMU gives it (`-name debug-threads=on`)."""
    found = _VCPU_THREAD.fullmatch(thread_name)
    return int(found.group(1)) if found else None


def allowed_cpus(pid: int, tid: int | None = None) -> tuple[int, ...]:
    """`Cpus_allowed_list` of a process (or one of its threads); () when it is gone."""
    path = proc_root() / str(pid) / ("task/" + str(tid) if tid is not None else "") / "status"
    try:
        for line in path.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpulist(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return ()


@attrs.frozen
class MemoryMap:
    """Where a process's memory is: bytes per node, and the policies its mappings carry."""

    per_node: dict[int, int]  # node -> bytes
    policies: tuple[str, ...]  # each distinct policy of the large mappings ("bind:0", "default", ...)

    @property
    def total(self) -> int:
        return sum(self.per_node.values())

    def local_share(self, nodes: Sequence[int]) -> float | None:
        """The share of its memory on `nodes`; None when it has none."""
        return sum(self.per_node.get(node, 0) for node in nodes) / self.total if self.total else None


_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)\b")
_PAGE_SIZE = re.compile(r"\bkernelpagesize_kB=(\d+)\b")
LARGE = 16 * MIB  # anonymous (or hugetlbfs) mappings this big count as guest RAM for the policies shown


def read_numa_maps(pid: int) -> MemoryMap | None:
    """`/proc/PID/numa_maps` summed per node; None when the process is gone (or the kernel has no
    NUMA maps)."""
    try:
        text = (proc_root() / str(pid) / "numa_maps").read_text()
    except OSError:
        return None
    return parse_numa_maps(text)


def parse_numa_maps(text: str) -> MemoryMap:
    per_node: dict[int, int] = {}
    policies: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        size = _PAGE_SIZE.search(line)
        page = int(size.group(1)) << 10 if size else 4096
        mapped = 0
        for node, pages in _NODE_PAGES.findall(line):
            per_node[int(node)] = per_node.get(int(node), 0) + int(pages) * page
            mapped += int(pages) * page
        ram = "file=" not in line or " huge" in line  # guest RAM: anonymous, or from hugetlbfs (a
        if ram and mapped >= LARGE and fields[1] not in policies:  # kernel QEMU maps is no RAM)
            policies.append(fields[1])
    return MemoryMap(per_node, tuple(policies))


def nodes_of(cpus: Iterable[int], topology: Topology) -> tuple[int, ...]:
    """The nodes these CPUs belong to, in order."""
    found = {topology.node_of_cpu(cpu) for cpu in cpus}
    return tuple(sorted(node for node in found if node is not None))


def iter_vcpu_threads(threads: Sequence[ThreadSample]) -> Iterator[tuple[int, ThreadSample]]:
    for thread in threads:
        index = vcpu_index(thread.name)
        if index is not None:
            yield index, thread
