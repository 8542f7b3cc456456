"""Where a lab's VMs run on a NUMA host: the initial placement at `up` and the balancer's moves, as
pure functions over plain values (table-tested; bench/numa_sim.py runs them against a model host).

A. Theurer's "Improving the Out-of-Box KVM Performance" (2011) measured what the kernel does with
long-lived VMs on a 4-node host: each VM's vCPUs and memory end up scattered over every node. Its balancer put
each VM on one node, then every 5 s moved one VM, CPUs and memory together, from the most to the
least loaded node. vmlaunch does the same:

- `place`: each VM on the node with the least vCPU load that fits it whole, the most free memory
  breaking ties (VMs with `numa_node` or `cpu_pinning` first, where they asked; then the others,
  largest first). A VM larger than every node spans the node with the most free memory and the
  nearest others until they hold it, and is given a guest NUMA topology that mirrors them (one guest
  node per host node, its memory and vCPUs in proportion).
- `balance`: load per node = runnable vCPU threads / CPUs of the node (the seed's nr_running /
  nr_cpus). When the most loaded node's load is more than THRESHOLD times the least loaded one's, the
  one VM whose move from the first to the second evens the load best is moved, if it makes the spread
  smaller by at least MIN_GAIN; at most one move a round, and no VM moves again within COOLDOWN rounds
  or back to the node it left within RETURN_AFTER rounds (no VM goes back and forth).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

THRESHOLD = 1.10  # highest / lowest node load that calls for a move (the seed stopped at 1.05)
MIN_GAIN = 0.05  # the least a move must shrink the spread of loads (runnable vCPUs per CPU)
SMOOTHING = 0.5  # weight of a round's sample in a VM's load (the rest: the load before)
IDLE = 0.05  # a host whose busiest node is below this load (per CPU) is left alone
COOLDOWN = 3  # rounds a VM stays where it was moved
RETURN_AFTER = 12  # rounds before a VM may go back to the node it left
HOST_RESERVE_MIB = 256  # what placement leaves free on a node for the host


@attrs.frozen
class Node:
    """A host NUMA node as placement sees it."""

    id: int
    cpus: tuple[int, ...]
    free_mib: int
    memory_mib: int | None = None  # its total (None: take free for it)
    distances: tuple[int, ...] = ()  # to node 0, 1, ... (the kernel's SLIT: 10 is local)

    def distance(self, other: int) -> int:
        return self.distances[other] if other < len(self.distances) else 20

    @property
    def total_mib(self) -> int:
        return self.free_mib if self.memory_mib is None else self.memory_mib


@attrs.frozen
class Demand:
    """What a VM asks of the host."""

    name: str
    vcpus: int
    memory_mib: int
    node: int | None = None  # `numa_node`
    pinned: tuple[int, ...] = ()  # `cpu_pinning`
    page_mib: int = 2  # memory per guest node is a multiple of this (the hugepage size, or 2 MiB)


class Binding(enum.Enum):
    PLACED = "placed"  # on the node placement chose: the balancer may move it
    NODE = "numa_node"  # on the node the spec names
    PINNED = "cpu_pinning"  # its vCPUs on the host CPUs the spec names
    SPANS = "spans"  # larger than any node: a guest NUMA topology over several


@attrs.frozen
class GuestNode:
    """One guest NUMA node of a VM that spans host nodes: the host node its memory is bound to."""

    host_node: int
    memory_mib: int
    vcpus: tuple[int, ...]  # the vCPUs of this guest node


@attrs.frozen
class Placed:
    """Where a VM runs: its memory bound to `nodes`, QEMU's threads on `cpus`, vCPU i on
    `vcpu_cpus[i]` when pinned; `guest_nodes` when it spans host nodes."""

    name: str
    binding: Binding
    nodes: tuple[int, ...]
    cpus: tuple[int, ...]
    vcpu_cpus: tuple[int, ...] = ()
    guest_nodes: tuple[GuestNode, ...] = ()
    reason: str = ""

    @property
    def movable(self) -> bool:
        return self.binding is Binding.PLACED


def place(demands: Sequence[Demand], nodes: Sequence[Node],
          vcpus_on: Mapping[int, int] | None = None) -> dict[str, Placed]:
    """Each VM's place (pure). `vcpus_on`: vCPUs already running on each node (VMs up already)."""
    load = {node.id: (vcpus_on or {}).get(node.id, 0) for node in nodes}
    free = {node.id: node.free_mib - HOST_RESERVE_MIB for node in nodes}
    by_id = {node.id: node for node in nodes}
    placed: dict[str, Placed] = {}
    fixed = [d for d in demands if d.node is not None or d.pinned]
    others = sorted((d for d in demands if d.node is None and not d.pinned),
                    key=lambda d: (-d.memory_mib, -d.vcpus, d.name))
    for demand in fixed:
        if demand.pinned:
            vcpu_cpus = tuple(demand.pinned[i % len(demand.pinned)] for i in range(demand.vcpus))
            pin_nodes = tuple(sorted({n.id for n in nodes if set(n.cpus) & set(demand.pinned)}))
            mem_nodes = (demand.node,) if demand.node is not None else pin_nodes or (nodes[0].id,)
            for cpu in vcpu_cpus:
                owner = next((n.id for n in nodes if cpu in n.cpus), None)
                if owner is not None:
                    load[owner] += 1
            placed[demand.name] = Placed(demand.name, Binding.PINNED, mem_nodes,
                                         tuple(sorted(set(demand.pinned))), vcpu_cpus,
                                         reason="pinned by cpu_pinning")
        else:
            assert demand.node is not None
            mem_nodes = (demand.node,)
            load[demand.node] += demand.vcpus
            placed[demand.name] = Placed(demand.name, Binding.NODE, mem_nodes, by_id[demand.node].cpus,
                                         reason=f"bound to node {demand.node} by numa_node")
        for node_id, share in zip(mem_nodes, _split(demand.memory_mib, [max(free[n], 1) for n in mem_nodes],
                                                    demand.page_mib)):
            free[node_id] -= share
    with_cpus = [n for n in nodes if n.cpus] or list(nodes)  # a memory-only node (CXL) runs no vCPU
    for demand in others:
        fits = [n for n in with_cpus if free[n.id] >= demand.memory_mib]
        if fits:
            best = min(fits, key=lambda n: ((load[n.id] + demand.vcpus) / max(1, len(n.cpus)),
                                            -free[n.id], n.id))
            why = f"the least vCPU load of the nodes with {demand.memory_mib} MiB free"
        elif len(nodes) > 1 and all(n.total_mib < demand.memory_mib for n in nodes):
            placed[demand.name] = _spread(demand, nodes, free, load)
            continue
        else:  # it would fit a node, were the host's memory free: on the one with the most
            best = min(with_cpus, key=lambda n: (-free[n.id], n.id))
            why = f"no node has {demand.memory_mib} MiB free; this one has the most"
        free[best.id] -= demand.memory_mib
        load[best.id] += demand.vcpus
        placed[demand.name] = Placed(demand.name, Binding.PLACED, (best.id,), best.cpus,
                                     reason=f"placed on node {best.id}: {why}")
    return placed


def _spread(demand: Demand, nodes: Sequence[Node], free: dict[int, int], load: dict[int, int]) -> Placed:
    """A VM larger than any node: the node with the most free memory, then the nearest ones (most free
    first among equals) until they hold it."""
    roomiest = min(nodes, key=lambda n: (-free[n.id], n.id))
    chosen: list[Node] = []
    for node in sorted(nodes, key=lambda n: (n.id != roomiest.id, roomiest.distance(n.id), -free[n.id],
                                             n.id)):
        chosen.append(node)
        if sum(max(free[n.id], 0) for n in chosen) >= demand.memory_mib:
            break
    chosen.sort(key=lambda n: n.id)
    room = [max(free[n.id], 1) for n in chosen]
    memory = _split(demand.memory_mib, room, demand.page_mib)
    counts = _split(demand.vcpus, memory, 1)
    guest_nodes, first = [], 0
    for node, share, count in zip(chosen, memory, counts):
        free[node.id] -= share
        load[node.id] += count
        guest_nodes.append(GuestNode(node.id, share, tuple(range(first, first + count))))
        first += count
    cpus = tuple(sorted(cpu for node in chosen for cpu in node.cpus))
    short = "" if sum(room) >= demand.memory_mib else ", more than they have free"
    return Placed(demand.name, Binding.SPANS, tuple(n.id for n in chosen), cpus, (), tuple(guest_nodes),
                  reason=f"spans nodes {', '.join(str(n.id) for n in chosen)}: larger than any node"
                         f"{short}")


def _split(total: int, weights: Sequence[int], unit: int) -> list[int]:
    """`total` split in proportion to `weights`, in multiples of `unit` (the last takes what is left)."""
    if len(weights) == 1:
        return [total]
    whole = sum(weights) or 1
    shares = [total * weight // whole // unit * unit for weight in weights[:-1]]
    return [*shares, total - sum(shares)]


# --- the balancer ---------------------------------------------------------------------------------


@attrs.frozen
class VmLoad:
    """A running VM as the balancer sees it."""

    name: str
    node: int
    load: float  # runnable vCPU threads, averaged over the round
    memory_mib: int
    movable: bool = True


@attrs.frozen
class NodeLoad:
    id: int
    cpus: int
    running: float  # runnable vCPU threads on it
    load: float  # running / cpus
    imbalance: float  # % off the average load
    vms: tuple[tuple[str, float], ...]


@attrs.frozen
class Move:
    vm: str
    source: int
    target: int
    reason: str


@attrs.frozen
class Decision:
    nodes: tuple[NodeLoad, ...]
    ratio: float | None  # highest / lowest load (None: a node is idle)
    move: Move | None
    reason: str

    def table(self) -> list[str]:
        """The seed's balancer output: per node running, CPUs, load, imbalance and VMs."""
        lines = [f"{'node':<7}{'running':>8}{'cpus':>6}{'load':>8}{'imbalance':>11}  VMs(running)"]
        for node in self.nodes:
            vms = " ".join(f"{name}: {running:.1f}" for name, running in node.vms)
            lines.append(f"node{node.id:<3}{node.running:>8.1f}{node.cpus:>6}{node.load:>8.3f}"
                         f"{node.imbalance:>+10.2f}%  {vms}")
        running, cpus = sum(n.running for n in self.nodes), sum(n.cpus for n in self.nodes)
        lines.append(f"{'all':<7}{running:>8.1f}{cpus:>6}{running / max(1, cpus):>8.3f}{0:>+10.2f}%")
        return lines


def smooth(before: float | None, sample: float, weight: float = SMOOTHING) -> float:
    """A VM's load carried from round to round: a burst of one round does not move a VM."""
    return sample if before is None else before + weight * (sample - before)


def node_loads(nodes: Sequence[Node], vms: Sequence[VmLoad]) -> tuple[NodeLoad, ...]:
    running = {node.id: 0.0 for node in nodes}
    members: dict[int, list[tuple[str, float]]] = {node.id: [] for node in nodes}
    for vm in vms:
        if vm.node in running:
            running[vm.node] += vm.load
            members[vm.node].append((vm.name, vm.load))
    loads = {node.id: running[node.id] / max(1, len(node.cpus)) for node in nodes}
    average = sum(running.values()) / max(1, sum(len(node.cpus) for node in nodes))
    return tuple(NodeLoad(node.id, len(node.cpus), running[node.id], loads[node.id],
                          (loads[node.id] - average) / average * 100 if average else 0.0,
                          tuple(members[node.id])) for node in nodes)


def balance(nodes: Sequence[Node], vms: Sequence[VmLoad], round_no: int,
            history: Mapping[str, tuple[int, int]] | None = None,
            threshold: float = THRESHOLD) -> Decision:
    """At most one move that evens the load (pure). `history`: VM -> (round it was moved, the node
    it left)."""
    history = history or {}
    nodes = [node for node in nodes if node.cpus] or list(nodes)  # a memory-only node runs no vCPU
    table = node_loads(nodes, vms)
    if len(table) < 2:
        return Decision(table, None, None, "one node: nothing to balance")
    high = max(table, key=lambda n: (n.load, -n.id))
    low = min(table, key=lambda n: (n.load, n.id))
    ratio = high.load / low.load if low.load > 0 else None
    if high.load < IDLE:
        return Decision(table, ratio, None, "idle: nothing to balance")
    if ratio is not None and ratio <= threshold:
        return Decision(table, ratio, None, f"balanced: load ratio {ratio:.3f} <= {threshold:.2f}")
    spread = high.load - low.load
    free = {node.id: node.free_mib - HOST_RESERVE_MIB for node in nodes}
    best: tuple[float, Move] | None = None
    skipped: list[str] = []
    for vm in sorted(vms, key=lambda v: v.name):
        if vm.node != high.id or not vm.movable or vm.load <= 0:
            continue
        moved = history.get(vm.name)
        if moved is not None and round_no - moved[0] < COOLDOWN:
            skipped.append(f"{vm.name} (moved {round_no - moved[0]} rounds ago)")
            continue
        if moved is not None and moved[1] == low.id and round_no - moved[0] < RETURN_AFTER:
            skipped.append(f"{vm.name} (left node {low.id} {round_no - moved[0]} rounds ago)")
            continue
        if free[low.id] < vm.memory_mib:
            skipped.append(f"{vm.name} ({vm.memory_mib} MiB; node {low.id} has {max(0, free[low.id])} free)")
            continue
        after_high = (high.running - vm.load) / max(1, high.cpus)
        after_low = (low.running + vm.load) / max(1, low.cpus)
        others = [n.load for n in table if n.id not in (high.id, low.id)]
        new_spread = max([after_high, after_low, *others]) - min([after_high, after_low, *others])
        gain = spread - new_spread
        if gain < MIN_GAIN or after_low > high.load:
            continue
        if best is None or gain > best[0] + 1e-9:
            best = (gain, Move(vm.name, high.id, low.id,
                               f"load ratio {'inf' if ratio is None else f'{ratio:.3f}'} > {threshold:.2f}: "
                               f"{vm.name} ({vm.load:.1f} running) from node {high.id} ({high.load:.3f}) "
                               f"to node {low.id} ({low.load:.3f}) evens the spread by {gain:.3f}"))
    if best is None:
        why = "no VM's move evens it" + (f" (held: {', '.join(skipped)})" if skipped else "")
        return Decision(table, ratio, None, f"imbalanced, but {why}")
    return Decision(table, ratio, best[1], best[1].reason)
