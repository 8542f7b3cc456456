"""Boot admission: how many guests `up` lets boot at once, so that none starves.

A booting guest is the costliest thing a VM does: under TCG every instruction of its firmware, kernel
decompression and init is translated, and a vCPU that gets too little of a host CPU trips the guest
kernel's own timing checks (a Linux kernel whose vCPU was starved panics with "IO-APIC + timer doesn't
work!"). Continued all at once, 40 test guests on 2 cores did just that. So the QEMUs still start
together (paused), but they are continued in waves: the next VM as soon as a booting one reaches its
ready signal, or has had its share of the time.

The budget is counted in host CPUs: a booting TCG vCPU takes one whole CPU (translation, and the
host's own work beside it), a KVM vCPU a quarter of one (KVM boots run at native speed and mostly
wait).
A VM bigger than the budget still boots, alone. Pure: table-tested, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

# What a booting vCPU costs, in quarters of a host CPU: under TCG a whole CPU (it translates every
# instruction, and the kernel's timer check fails on a starved vCPU); under KVM a quarter (it boots at
# native speed and mostly waits on I/O).
TCG_COST, KVM_COST = 4, 1
# The least time a booting VM keeps its place when it never says it is ready: the next one is let in
# after this, so that one guest that never prints its ready text cannot hold the whole lab back.
MIN_SHARE = 10.0


@attrs.frozen
class Booting:
    """A VM to boot: its name, its vCPUs and whether it runs under TCG."""

    name: str
    vcpus: int
    tcg: bool

    @property
    def cost(self) -> int:
        return self.vcpus * (TCG_COST if self.tcg else KVM_COST)


@attrs.frozen
class Admission:
    """How a lab's VMs are let boot: at most `width` VMs at once (`width` None: all at once), each
    keeping its place `share` seconds at most, and why (for `up --dry-run`)."""

    width: int | None
    reason: str
    budget: int = 0  # in quarters of a host CPU; 0 when `width` was asked for
    asked: bool = False  # set by the user (`up --parallel`, [lab] boot_parallel)

    def share(self, timeout: float, count: int, floor: float = MIN_SHARE) -> float:
        """How long a booting VM that is not ready yet keeps its place: its part of the timeout, were
        the VMs booted `width` at a time, and at least `floor`."""
        if self.width is None or count <= self.width:
            return timeout
        return max(floor, timeout * self.width / count)

    def fits(self, booting: Iterable[Booting], vm: Booting) -> bool:
        """Whether `vm` may start booting beside those `booting` now."""
        now = list(booting)
        if not now:
            return True  # one VM always boots, however big
        if self.width is None:
            return True
        if len(now) >= self.width:
            return False
        if not self.budget:
            return True  # the width was asked for: counted in VMs only
        return sum(other.cost for other in now) + vm.cost <= self.budget

    def describe(self, count: int) -> str:
        if self.width is None or count <= self.width:
            return f"boot: all {count} VMs at once ({self.reason})"
        return f"boot: at most {self.width} of the {count} VMs at once ({self.reason})"


def admission(host_cpus: int, vms: Sequence[Booting], *, asked: int | None = None,
              asked_by: str = "--parallel") -> Admission:
    """The admission of these VMs on a host of `host_cpus` CPUs; `asked`: a width the user set."""
    if asked is not None:
        return Admission(asked, f"{asked_by} {asked}", asked=True)
    budget = max(1, host_cpus) * TCG_COST
    tcg = any(vm.tcg for vm in vms)
    costs = sorted((vm.cost for vm in vms), reverse=False)
    width, used = 0, 0
    for cost in costs:  # as many of the cheapest as the budget holds: the most that can ever boot at once
        if used + cost > budget and width:
            break
        width, used = width + 1, used + cost
    cpus = f"{host_cpus} host CPU{'s' if host_cpus != 1 else ''}"
    how = ("TCG: a booting vCPU takes a host CPU" if tcg else
           "KVM: a booting vCPU takes a quarter of a host CPU")
    return Admission(max(1, width), f"{cpus}; {how}; `up --parallel N` or [lab] boot_parallel sets it",
                     budget)
