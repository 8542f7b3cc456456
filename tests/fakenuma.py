"""Fake NUMA hosts and fake VMs for tests: the sysfs nodes of a 2- or 4-node host, cpuset cgroups, and
a QEMU's /proc entries (numa_maps, its threads' stat and status), in folders that VMLAUNCH_SYSFS and
VMLAUNCH_PROC point at. This machine has one node; these are the only way to show vmlaunch more."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vmlaunch.host.numa import format_cpulist


def make_nodes(sysfs: Path, nodes: int, cpus_per_node: int, memory_mib: int,
               free_mib: Sequence[int] | None = None) -> None:
    """`devices/system/node/nodeN/{cpulist,meminfo,distance}` of a host with these nodes."""
    folder = sysfs / "devices" / "system" / "node"
    for node in range(nodes):
        node_dir = folder / f"node{node}"
        node_dir.mkdir(parents=True, exist_ok=True)
        cpus = range(node * cpus_per_node, (node + 1) * cpus_per_node)
        (node_dir / "cpulist").write_text(format_cpulist(cpus) + "\n")
        free = free_mib[node] if free_mib is not None else memory_mib * 3 // 4
        (node_dir / "meminfo").write_text(
            f"Node {node} MemTotal:       {memory_mib << 10} kB\n"
            f"Node {node} MemFree:        {free << 10} kB\n"
            f"Node {node} MemUsed:        {(memory_mib - free) << 10} kB\n")
        (node_dir / "distance").write_text(" ".join("10" if other == node else "21"
                                                    for other in range(nodes)) + "\n")
    (folder / "online").write_text(f"0-{nodes - 1}\n")
    cpu = sysfs / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True, exist_ok=True)
    (cpu / "online").write_text(f"0-{nodes * cpus_per_node - 1}\n")


def make_cpusets_v1(sysfs: Path, cpus: str, mems: str) -> Path:
    """The root of a cgroup v1 cpuset hierarchy (plain files: what vmlaunch writes stays readable)."""
    root = sysfs / "fs" / "cgroup" / "cpuset"
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpuset.cpus").write_text(cpus + "\n")
    (root / "cpuset.mems").write_text(mems + "\n")
    (root / "tasks").write_text("")
    (root / "cgroup.procs").write_text("")
    return root


def make_cgroup(root: Path, name: str, cpus: str, mems: str) -> Path:
    """A VM's cgroup as `cgroups.create` leaves it (a fake tree has no kernel to make its files)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for file, value in (("cpuset.cpus", cpus), ("cpuset.mems", mems), ("cgroup.procs", ""),
                        ("cpuset.memory_migrate", "0")):
        (folder / file).write_text(value + "\n" if value else "")
    return folder


def stat_line(tid: int, name: str, state: str, ticks: int = 0, cpu: int = 0) -> str:
    """A /proc/PID/task/TID/stat line: fields 3 (state), 14-15 (utime, stime), 39 (processor)."""
    fields = [state, "1", "1", "0", "0", "-1", "0", "0", "0", "0", "0", str(ticks), "0", "0", "0", "20",
              "0", "1", "0", "100", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0",
              "0", "17", str(cpu), "0", "0"]
    return f"{tid} ({name}) {' '.join(fields)}\n"


def make_vm(proc: Path, pid: int, vcpus: Sequence[tuple[str, int]], pages_per_node: dict[int, int],
            policy: str = "default", allowed: str = "0-3") -> None:
    """A QEMU's /proc entries: its threads (the main one, then one per vCPU with (state, last CPU)) and
    its numa_maps (one large anonymous mapping of guest RAM, pages per node)."""
    folder = proc / str(pid)
    threads = [(pid, "qemu-system-x86", "S", 0), *((pid + 1 + i, f"CPU {i}/TCG", state, cpu)
                                                   for i, (state, cpu) in enumerate(vcpus))]
    for tid, name, state, cpu in threads:
        task = folder / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "stat").write_text(stat_line(tid, name, state, cpu=cpu))
        (task / "status").write_text(f"Name:\t{name}\nCpus_allowed_list:\t{allowed}\n")
    counts = " ".join(f"N{node}={pages}" for node, pages in sorted(pages_per_node.items()))
    total = sum(pages_per_node.values())
    (folder / "numa_maps").write_text(
        f"55d0c0a00000 default file=/usr/bin/qemu-system-x86_64 mapped=800 N0=800 kernelpagesize_kB=4\n"
        f"7f0000000000 {policy} anon={total} dirty={total} active=0 {counts} kernelpagesize_kB=4\n"
        f"7f8000000000 default heap anon=300 dirty=300 N0=300 kernelpagesize_kB=4\n")
    (folder / "status").write_text(f"Name:\tqemu\nCpus_allowed_list:\t{allowed}\n")


def set_state(proc: Path, pid: int, vcpu: int, state: str, cpu: int = 0) -> None:
    tid = pid + 1 + vcpu
    stat = proc / str(pid) / "task" / str(tid) / "stat"
    stat.write_text(stat_line(tid, f"CPU {vcpu}/TCG", state, cpu=cpu))
