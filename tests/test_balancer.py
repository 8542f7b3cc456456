"""The lab manager's NUMA balancer (manager/balancer.py) on a fake 2-node host with fake VMs: it counts
their runnable vCPU threads from proc, finds where each is from its cpuset cgroup, and moves one by
rewriting that cgroup; it logs like the seed's balancer and keeps its state for `vmlaunch numa`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tests.fakenuma import make_cgroup, make_cpusets_v1, make_nodes, make_vm, set_state
from vmlaunch.manager.balancer import Balancer
from vmlaunch.resources.manager import ManagedVm, ManagerConfig


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    make_nodes(sysfs, 2, 2, 8192)
    root = make_cpusets_v1(sysfs, "0-3", "0-1")
    proc.mkdir()
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(sysfs))
    monkeypatch.setenv("VMLAUNCH_PROC", str(proc))
    return sysfs, proc, root


def managed(name: str, node: int, cgroup: Path | None, movable: bool = True) -> ManagedVm:
    return ManagedVm(name=name, maximum_mib=512, minimum_mib=512, auto=False, balloon=True, nodes=(node,),
                     movable=movable, cgroup=str(cgroup) if cgroup else None)


def rounds(balancer: Balancer, config: ManagerConfig, running: dict[str, int], count: int) -> None:
    async def go() -> None:
        for _ in range(count):
            balancer.last = 0.0  # the interval has passed
            await balancer.round(config, running)
            if balancer.moving is not None:
                await balancer.moving

    asyncio.run(go())


def test_a_busy_node_gives_a_vm_to_the_idle_one(host: tuple[Path, Path, Path],
                                                caplog: pytest.LogCaptureFixture) -> None:
    _, proc, root = host
    caplog.set_level(logging.INFO, logger="vmlaunch.manager.manager")
    cgroups = {name: make_cgroup(root, f"vmlaunch.lab.{name}", "0-1", "0") for name in ("a", "b", "c")}
    for pid in (100, 200, 300):
        make_vm(proc, pid, [("R", 0), ("R", 1)], {0: 1000})
    vms = (managed("a", 0, cgroups["a"]), managed("b", 0, cgroups["b"]),
           managed("c", 0, cgroups["c"], movable=False))
    config = ManagerConfig(lab="lab", budget_mib=4096, vms=vms, balance=True)
    balancer = Balancer()
    rounds(balancer, config, {"a": 100, "b": 200, "c": 300}, 1)
    moved = [name for name, folder in cgroups.items() if (folder / "cpuset.mems").read_text().strip() == "1"]
    assert moved == ["a"]  # c is pinned; a and b even it alike: the first
    assert (cgroups["a"] / "cpuset.cpus").read_text().strip() == "2-3"
    assert balancer.state["last_move"]["vm"] == "a" and balancer.state["last_move"]["to"] == 1
    assert "node0       6.0     2   3.000" in caplog.text
    assert "moving: load ratio inf > 1.10: a" in caplog.text
    assert "VM migration elapsed time" in caplog.text
    # a is on node 1 now (its cgroup says so): 4 against 2 runnable, and moving b would overshoot
    rounds(balancer, config, {"a": 100, "b": 200, "c": 300}, 1)
    assert balancer.state["vms"]["a"]["node"] == 1 and "no VM's move evens it" in balancer.state["reason"]
    assert [(cgroups[n] / "cpuset.mems").read_text().strip() for n in "abc"] == ["1", "0", "0"]


def test_loads_are_averaged_over_the_round_and_idle_vms_stay(host: tuple[Path, Path, Path]) -> None:
    _, proc, root = host
    cgroup = make_cgroup(root, "vmlaunch.lab.a", "0-1", "0")
    make_vm(proc, 100, [("S", 0), ("S", 1)], {0: 1000})
    config = ManagerConfig(lab="lab", budget_mib=4096, vms=(managed("a", 0, cgroup),), balance=True)
    balancer = Balancer()
    balancer.sample({"a": config.vms[0]}, {"a": 100})
    set_state(proc, 100, 0, "R")
    rounds(balancer, config, {"a": 100}, 1)  # samples: 0 and 1 runnable: 0.5
    assert balancer.state["vms"]["a"]["load"] == 0.5
    assert balancer.state["reason"].startswith("imbalanced") or balancer.state["reason"].startswith("idle")
    assert (cgroup / "cpuset.mems").read_text().strip() == "0"  # one VM: moving it evens nothing


def test_a_vm_that_is_gone_is_left_out(host: tuple[Path, Path, Path]) -> None:
    _, proc, root = host
    cgroup = make_cgroup(root, "vmlaunch.lab.a", "0-1", "0")
    config = ManagerConfig(lab="lab", budget_mib=4096, vms=(managed("a", 0, cgroup),), balance=True)
    balancer = Balancer()
    rounds(balancer, config, {}, 2)
    assert balancer.state["vms"] == {}
