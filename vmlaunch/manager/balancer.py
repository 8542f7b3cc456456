"""The NUMA balancer as the lab manager runs it: what it reads from the host each round, and the move it
makes when `placement.balance` (the pure decision) asks for one.

Every manager round (a second) it counts each placed VM's runnable vCPU threads (state R in
`/proc/PID/task/TID/stat`, the threads QEMU names "CPU n/TCG" or "CPU n/KVM"); every `interval` (5 s,
the seed's) it averages them per VM, smooths them over rounds, reads the host's nodes (CPUs, free
memory) and where each VM is now (its cpuset cgroup's `cpuset.mems`), and asks for a decision. A
move rewrites the VM's cgroup: its CPUs, then its nodes, and the kernel migrates its memory (the
write returns when it has; it runs in a thread, so the manager's other work goes on). Every decision
is logged as the seed's balancer logged it: per node running vCPUs, CPUs, load, imbalance and VMs,
then the move and how long it took. Nothing is kept that cannot be read back: started again, the
manager finds each VM's node in its cgroup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vmlaunch.host import cgroups
from vmlaunch.host.numa import iter_vcpu_threads, read_threads, read_topology
from vmlaunch.policy.placement import Decision, Node, VmLoad, balance, smooth
from vmlaunch.resources.manager import ManagedVm, ManagerConfig

log = logging.getLogger("vmlaunch.manager.manager")


class Balancer:
    def __init__(self) -> None:
        self.samples: dict[str, list[int]] = {}  # VM -> runnable vCPU threads at each round's sample
        self.loads: dict[str, float] = {}  # VM -> smoothed load
        self.history: dict[str, tuple[int, int]] = {}  # VM -> (round it was moved, node it left)
        self.round_no = 0
        self.last = time.monotonic()
        self.said = ""  # the kind of the last decision logged: log again when it changes
        self.state: dict[str, Any] = {}
        self.moving: asyncio.Task[None] | None = None

    def sample(self, vms: Mapping[str, ManagedVm], running: Mapping[str, int]) -> None:
        for name, vm in vms.items():
            pid = running.get(name)
            if pid is None or not vm.nodes:
                self.samples.pop(name, None)
                continue
            runnable = sum(1 for _, thread in iter_vcpu_threads(read_threads(pid)) if thread.state == "R")
            self.samples.setdefault(name, []).append(runnable)

    async def round(self, config: ManagerConfig, running: Mapping[str, int]) -> None:
        """Called every manager round: sample, and decide when the interval has passed."""
        placed = {vm.name: vm for vm in config.vms if vm.nodes}
        if not placed:
            return
        self.sample(placed, running)
        if time.monotonic() - self.last < config.balance_interval or (self.moving and not self.moving.done()):
            return
        self.last = time.monotonic()
        self.round_no += 1
        topology = read_topology()
        nodes = [Node(node.id, node.cpus, node.free_mib, node.memory_mib) for node in topology.nodes]
        vms = []
        for name, vm in placed.items():
            samples = self.samples.pop(name, [])
            if name not in running or not samples:
                self.loads.pop(name, None)
                continue
            self.loads[name] = smooth(self.loads.get(name), sum(samples) / len(samples))
            node = self.node_of(vm)
            if node is not None:
                vms.append(VmLoad(name, node, self.loads[name], vm.maximum_mib, movable=vm.movable))
        decision = balance(nodes, vms, self.round_no, self.history)
        self.remember(decision, vms)
        self.log(decision)
        if decision.move is not None:
            vm = placed[decision.move.vm]
            assert vm.cgroup is not None  # only movable VMs move
            target = topology.node(decision.move.target)
            assert target is not None
            self.history[vm.name] = (self.round_no, decision.move.source)
            self.moving = asyncio.create_task(self.move(vm.name, Path(vm.cgroup), target.cpus, target.id,
                                                        decision.move.source))

    def node_of(self, vm: ManagedVm) -> int | None:
        """Where the VM is now: the node its cgroup's memory is on, else where `up` put it."""
        if vm.cgroup is not None:
            now = cgroups.place_of(Path(vm.cgroup))
            if now is not None and len(now[1]) == 1:
                return now[1][0]
        return vm.nodes[0] if len(vm.nodes) == 1 else None

    async def move(self, name: str, cgroup: Path, cpus: tuple[int, ...], target: int, source: int) -> None:
        started = time.monotonic()
        try:
            await asyncio.to_thread(cgroups.set_place, cgroup, cpus, (target,))
        except Exception as exc:  # a VM gone half-way, a cgroup removed: log, go on
            log.warning("balancer: moving %s to node %d failed: %s", name, target, exc)
            return
        elapsed = time.monotonic() - started
        log.info("balancer: moved %s from node %d to node %d; VM migration elapsed time: %.3f s", name,
                 source, target, elapsed)
        self.state["last_move"] = {"vm": name, "from": source, "to": target, "seconds": round(elapsed, 3),
                                   "time": time.time()}

    def remember(self, decision: Decision, vms: list[VmLoad]) -> None:
        self.state.update({
            "round": self.round_no, "time": time.time(), "ratio": decision.ratio, "reason": decision.reason,
            "nodes": [{"id": node.id, "cpus": node.cpus, "running": round(node.running, 2),
                       "load": round(node.load, 3), "imbalance": round(node.imbalance, 2)}
                      for node in decision.nodes],
            "vms": {vm.name: {"node": vm.node, "load": round(vm.load, 2), "movable": vm.movable}
                    for vm in vms},
        })

    def log(self, decision: Decision) -> None:
        kind = "move" if decision.move else decision.reason.split(":")[0].split(",")[0]
        if kind == self.said and decision.move is None:
            return
        self.said = kind
        log.info("balancer, round %d:\n%s\n%s", self.round_no, "\n".join(decision.table()),
                 f"moving: {decision.reason}" if decision.move else decision.reason)
