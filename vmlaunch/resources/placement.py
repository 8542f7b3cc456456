"""A VM held where placement put it (`vmlaunch/policy/placement.py`): its QEMU's threads on the node's CPUs,
its vCPUs on the host CPUs `cpu_pinning` names, its memory on the node (QEMU binds its RAM there with
the memory backend's `host-nodes` and `policy = bind`, in the argv the compiler writes).

Through a cpuset cgroup of its own where the host has them (`host/cgroups.py`): `apply` creates it with the
node's CPUs and memory, and once QEMU runs paused `attach` moves every QEMU thread into it; the lab
manager's balancer moves the VM later by rewriting the cgroup (CPUs and memory together), and `down`
removes it. Without cpuset cgroups, `attach` pins each thread with sched_setaffinity instead (the VM
is placed, but not balanced). vCPU threads are found by the thread ids QMP's `query-cpus-fast` gives.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import attrs

from vmlaunch.core.naming import cgroup_name
from vmlaunch.errors import HostError
from vmlaunch.host import cgroups
from vmlaunch.host.cgroups import Cpusets
from vmlaunch.host.numa import format_cpulist
from vmlaunch.policy.placement import Placed
from vmlaunch.resources.base import Context, PerVm

log = logging.getLogger(__name__)


@attrs.frozen
class PlacementRecord:
    kind: ClassVar[str] = "placement"

    vm: str
    cgroup: Path | None  # the VM's cpuset cgroup, None: placed with sched_setaffinity
    nodes: tuple[int, ...]
    cpus: tuple[int, ...]

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        if self.cgroup is not None:
            cgroups.remove(self.cgroup)

    def describe(self) -> str:
        how = f"cpuset cgroup {self.cgroup}" if self.cgroup else "sched_setaffinity"
        return (f"VM {self.vm} on node {', '.join(map(str, self.nodes))} (CPUs {format_cpulist(self.cpus)}; "
                f"{how})")


@attrs.frozen
class VmPlacement(PerVm):
    """Where one VM runs."""

    kind: ClassVar[str] = "placement"

    lab: str
    placed: Placed
    cpusets: Cpusets | None
    qmp: Path  # the VM's monitor: its vCPU threads' ids
    host_nodes: tuple[int, ...] = (0,)  # every node of the host (where QEMU's early memory may be)

    @property
    def vm(self) -> str:
        return self.placed.name

    @property
    def cgroup(self) -> Path | None:
        return self.cpusets.folder(cgroup_name(self.lab, self.placed.name)) if self.cpusets else None

    def describe(self) -> str:
        placed = self.placed
        nodes = ", ".join(map(str, placed.nodes))
        pins = f", vCPUs on CPUs {', '.join(map(str, placed.vcpu_cpus))}" if placed.vcpu_cpus else ""
        how = f"cpuset cgroup {self.cgroup}" if self.cpusets else "sched_setaffinity: no cpuset cgroups here"
        return (f"VM {placed.name} on node{'s' if len(placed.nodes) > 1 else ''} {nodes}, CPUs "
                f"{format_cpulist(placed.cpus)}{pins} ({placed.reason}; {how})")

    def found(self) -> str | None:
        cgroup = self.cgroup
        return f"{cgroup} exists" if cgroup is not None and cgroup.is_dir() else None

    def apply(self, ctx: Context) -> PlacementRecord:
        placed = self.placed
        folder = None
        if self.cpusets is not None:
            folder = cgroups.create(self.cpusets, cgroup_name(self.lab, placed.name), placed.cpus,
                                    placed.nodes)
        return PlacementRecord(placed.name, folder, placed.nodes, placed.cpus)

    def attach(self, pid: int) -> None:
        """Once QEMU runs paused, before any guest code: its threads where they belong."""
        from vmlaunch.host.numa import read_threads

        placed = self.placed
        if self.cgroup is not None:
            cgroups.attach(self.cgroup, pid)
        else:
            for thread in read_threads(pid):
                cgroups.pin(thread.tid, placed.cpus)
            cgroups.migrate_pages(pid, placed.nodes, self.host_nodes)
        if placed.vcpu_cpus:
            threads = vcpu_threads(self.qmp)
            for index, cpu in enumerate(placed.vcpu_cpus):
                tid = threads.get(index)
                if tid is None:
                    raise HostError(f"{placed.name}: QEMU did not give vCPU {index}'s thread id")
                cgroups.pin(tid, (cpu,))
        how = (f"through the cpuset cgroup {self.cgroup}" if self.cgroup is not None else
               "with sched_setaffinity and migrate_pages: this host has no cpuset cgroups, so it stays there")
        log.info("%s: node %s, CPUs %s (%s), %s", placed.name, ",".join(map(str, placed.nodes)),
                 format_cpulist(placed.cpus), placed.reason, how)


def vcpu_threads(qmp_path: Path) -> dict[int, int]:
    """vCPU index -> host thread id, from QMP `query-cpus-fast`."""
    from vmlaunch.qemu.qmp import QuickQmp

    with QuickQmp(qmp_path, timeout=10) as qmp:
        cpus = qmp.cmd("query-cpus-fast")
    return {int(cpu["cpu-index"]): int(cpu["thread-id"]) for cpu in cpus
            if isinstance(cpu, dict) and "thread-id" in cpu}
