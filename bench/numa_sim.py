#!/usr/bin/env python3
"""Seed 001's two balancer experiments on a simulated 4-node host, decided by vmlaunch's own code.

The host: 4 nodes x 10 CPUs, 64 GiB each. The VMs: 4 vCPUs and 2 GiB each, each running a workload
that keeps between 3 and 5 of its threads runnable on average (dbench in the seed, whose balancer
output shows 3 to 5 per VM), with +-0.5 of noise from round to round, smoothed as the lab manager
smooths it. Every decision is made by `vmlaunch.placement` (`place` at start, `balance` every round,
as the lab manager calls them); the simulation only stands in for the kernel: it sums runnable threads
per node and moves memory after a move, 2 GiB in 5 s (the seed's "VM migration elapsed time: 4-7 s").

1. 40 VMs, started as the kernel would start them: each VM's vCPUs run where the scheduler finds room
   and its memory is faulted in wherever its vCPUs ran (the seed's numa_maps report: every VM's
   memory over every node). vmlaunch's placement then puts each on one node, and the balancer evens
   the load. Goal: load ratio (busiest / idlest node) under 1.10 within 5 moves.
2. Then 20 of them, those on nodes 0 and 1 (the seed: "select 20 VMs from just the first 2 NUMA
   nodes"), the others stopped. Goal: half of them moved to nodes 2 and 3.
Both: no VM left spanning nodes, no move undone (no VM back on a node it left).

Per round it prints the seed-style table (per node: runnable vCPU threads, CPUs, load, imbalance,
VMs), the move and the memory locality. A model of throughput compares, as the seed did: no balancer
(the kernel's scatter), manual binding (10 VMs per node, fixed), and vmlaunch; a VM's work is its CPU
share times a locality factor (remote memory costs REMOTE_COST of a local access's speed).

    python bench/numa_sim.py [--seed N] [--rounds N] [--quiet]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vmlaunch.policy.placement import Demand, Node, VmLoad, balance, place, smooth  # noqa: E402

NODES, CPUS, NODE_MIB = 4, 10, 64 << 10
VM_MIB, VCPUS = 2048, 4
MIGRATE_MIB_PER_ROUND = 2048  # a round is the seed's 5 s; 2 GiB move in about that
REMOTE_COST = 0.4  # what a remote access loses against a local one (in throughput)


@attrs.define
class SimVm:
    name: str
    demand: float  # runnable threads it would keep on its own
    memory: dict[int, int]  # node -> MiB
    node: int | None = None  # where vmlaunch placed it (None: the kernel's scatter)
    load: float | None = None  # as the lab manager carries it from round to round
    left: list[tuple[int, int]] = attrs.Factory(list)  # (round, node) of each move away

    def local(self) -> float:
        total = sum(self.memory.values())
        return self.memory.get(self.node, 0) / total if self.node is not None and total else 0.0


def host() -> list[Node]:
    return [Node(i, tuple(range(i * CPUS, (i + 1) * CPUS)), NODE_MIB) for i in range(NODES)]


def scatter(rng: random.Random, vm: SimVm) -> None:
    """Memory as the kernel leaves it: faulted in wherever the vCPUs ran, over every node."""
    weights = [rng.random() ** 2 for _ in range(NODES)]
    total = sum(weights)
    vm.memory = {node: int(VM_MIB * w / total) for node, w in enumerate(weights)}


def loads(vms: list[SimVm], rng: random.Random) -> list[VmLoad]:
    """A round's samples (the runnable threads the kernel would show), smoothed as the manager does."""
    for vm in vms:
        vm.load = smooth(vm.load, max(0.0, vm.demand + rng.uniform(-0.5, 0.5)))
    return [VmLoad(vm.name, vm.node, vm.load or 0.0, VM_MIB) for vm in vms if vm.node is not None]


def migrate(vms: list[SimVm]) -> None:
    """The memory of moved VMs follows them, MIGRATE_MIB_PER_ROUND a round."""
    for vm in vms:
        budget, home = MIGRATE_MIB_PER_ROUND, vm.node
        if home is None:
            continue
        for node in sorted(vm.memory):
            if node == home or budget <= 0:
                continue
            step = min(budget, vm.memory[node])
            vm.memory[node] -= step
            vm.memory[home] = vm.memory.get(home, 0) + step
            budget -= step


def throughput(vms: list[SimVm], placement: dict[str, int] | None) -> tuple[float, float]:
    """(work done, off-node share of memory accesses) in model units. `placement`: VM -> node its
    threads are kept on; None: the kernel spreads every thread evenly over the host."""
    if placement is None:
        share = min(1.0, NODES * CPUS / sum(vm.demand for vm in vms))
        work = remote = 0.0
        for vm in vms:
            local = 1 / NODES  # its threads run anywhere, its memory anywhere
            work += vm.demand * share * (1 - REMOTE_COST * (1 - local))
            remote += vm.demand * share * (1 - local)
        return work, remote / sum(vm.demand * share for vm in vms)
    running = {node: 0.0 for node in range(NODES)}
    for vm in vms:
        running[placement[vm.name]] += vm.demand
    work = remote = busy = 0.0
    for vm in vms:
        node = placement[vm.name]
        share = min(1.0, CPUS / running[node])
        local = vm.memory.get(node, 0) / max(1, sum(vm.memory.values()))
        work += vm.demand * share * (1 - REMOTE_COST * (1 - local))
        remote += vm.demand * share * (1 - local)
        busy += vm.demand * share
    return work, remote / busy


def run_balancer(vms: list[SimVm], rounds: int, rng: random.Random, quiet: bool,
                 stop_at: float | None = None) -> tuple[int, float | None, list[str]]:
    """Rounds of vmlaunch's balancer; (moves made, the last load ratio, problems found)."""
    nodes, moves, problems = host(), 0, []
    history: dict[str, tuple[int, int]] = {}
    ratio: float | None = None
    for round_no in range(1, rounds + 1):
        decision = balance(nodes, loads(vms, rng), round_no, history)
        ratio = decision.ratio
        if not quiet:
            print(f"\n[round {round_no}]")
            print("\n".join(decision.table()))
        if decision.move is None:
            if not quiet:
                print(f"  {decision.reason}")
            migrate(vms)
            if stop_at is not None and ratio is not None and ratio < stop_at:
                break
            continue
        move = decision.move
        vm = next(v for v in vms if v.name == move.vm)
        if any(node == move.target for _, node in vm.left):
            problems.append(f"{vm.name} moved back to node {move.target}")
        vm.left.append((round_no, move.source))
        vm.node = move.target
        history[vm.name] = (round_no, move.source)
        moves += 1
        migrate(vms)
        if not quiet:
            local = sum(v.local() for v in vms) / len(vms)
            print(f"  move {moves}: {move.reason}; memory local on average {local:.1%}")
    for _ in range(3):  # let the last moves' memory arrive
        migrate(vms)
    problems += [f"{vm.name} spans nodes {sorted(n for n, mib in vm.memory.items() if mib)}"
                 for vm in vms if sum(1 for mib in vm.memory.values() if mib) > 1]
    return moves, ratio, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quiet", action="store_true", help="the summary only")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    vms = [SimVm(f"vg-db{i:04d}", rng.uniform(3.0, 5.0), {}) for i in range(1, 41)]
    for vm in vms:
        scatter(rng, vm)
    print(f"host: {NODES} nodes x {CPUS} CPUs, {NODE_MIB >> 10} GiB each; {len(vms)} VMs x {VCPUS} vCPUs x "
          f"{VM_MIB >> 10} GiB, runnable threads per VM {min(v.demand for v in vms):.1f}-"
          f"{max(v.demand for v in vms):.1f}")
    kernel_work, kernel_remote = throughput(vms, None)
    example = vms[0]
    print(f"\nas the kernel starts them: {example.name}'s memory "
          + ", ".join(f"node {n}: {mib} MiB" for n, mib in sorted(example.memory.items()))
          + f"; off-node accesses {kernel_remote:.1%}")

    # 1. vmlaunch's placement, then its balancer
    placed = place([Demand(vm.name, VCPUS, VM_MIB) for vm in vms], host())
    for vm in vms:
        vm.node = placed[vm.name].nodes[0]
    migrate(vms)  # up binds the memory to the node: it is faulted in there, not migrated
    for vm in vms:
        vm.memory = {vm.node: VM_MIB}  # type: ignore[dict-item]
    print("\n=== 1. 40 VMs: vmlaunch's initial placement, then its balancer ===")
    moves1, ratio1, problems1 = run_balancer(vms, args.rounds, rng, args.quiet, stop_at=1.10)
    work1, remote1 = throughput(vms, {vm.name: vm.node for vm in vms if vm.node is not None})
    manual = {vm.name: i // 10 for i, vm in enumerate(vms)}
    manual_vms = [attrs.evolve(vm, memory={manual[vm.name]: VM_MIB}) for vm in vms]
    work1_manual, remote1_manual = throughput(manual_vms, manual)

    # 2. 20 of them on nodes 0 and 1, 10 each (the seed's "20 VMs from just the first 2 NUMA nodes")
    crowded = [SimVm(vm.name, vm.demand, {i // 10: VM_MIB}, node=i // 10) for i, vm in enumerate(vms[:20])]
    before = {vm.name: vm.node for vm in crowded}
    print(f"\n=== 2. {len(crowded)} VMs crowded on nodes 0 and 1 (the others stopped) ===")
    moves2, ratio2, problems2 = run_balancer(crowded, args.rounds, rng, args.quiet)
    moved = sum(1 for vm in crowded if vm.node != before[vm.name])
    work2, remote2 = throughput(crowded, {vm.name: vm.node for vm in crowded if vm.node is not None})
    stuck = {vm.name: i // 10 for i, vm in enumerate(crowded)}
    stuck_vms = [attrs.evolve(vm, memory={stuck[vm.name]: VM_MIB}) for vm in crowded]
    work2_stuck, remote2_stuck = throughput(stuck_vms, stuck)
    kernel2_work, kernel2_remote = throughput(crowded, None)

    print("\n=== summary (model units: work = CPU share x locality) ===")
    print(f"{'':<34}{'no balancer':>14}{'manual binding':>16}{'vmlaunch':>10}")
    print(f"{'40 VMs: work':<34}{kernel_work:>14.1f}{work1_manual:>16.1f}{work1:>10.1f}")
    print(f"{'40 VMs: off-node accesses':<34}{kernel_remote:>14.1%}{remote1_manual:>16.1%}{remote1:>10.1%}")
    print(f"{'20 crowded VMs: work':<34}{kernel2_work:>14.1f}{work2_stuck:>16.1f}{work2:>10.1f}")
    print(f"{'20 crowded VMs: off-node accesses':<34}{kernel2_remote:>14.1%}{remote2_stuck:>16.1%}"
          f"{remote2:>10.1%}")
    ok1 = ratio1 is not None and ratio1 < 1.10 and moves1 <= 5
    ok2 = moved >= len(crowded) // 2
    print(f"1. load ratio {ratio1 if ratio1 is None else f'{ratio1:.3f}'} after {moves1} moves (goal < 1.10 "
          f"within 5 moves: {'met' if ok1 else 'NOT met'})")
    print(f"2. {moved} of {len(crowded)} crowded VMs moved in {moves2} moves, load ratio "
          f"{ratio2 if ratio2 is None else f'{ratio2:.3f}'} "
          f"(goal: half moved: {'met' if ok2 else 'NOT met'})")
    problems = problems1 + problems2
    print(f"VMs spanning nodes or moved back: {'; '.join(problems) if problems else 'none'}")
    return 0 if ok1 and ok2 and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
