"""Placement and the balancer as pure functions (vmlaunch/policy/placement.py), table-tested on fake 2- and
4-node hosts, with properties for any host; and what the compiler makes of them (argv, refusals,
notes, the lab manager's settings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import fake_host
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.errors import HostError
from vmlaunch.host.cgroups import CgroupVersion, Cpusets
from vmlaunch.host.numa import NumaNode, Topology
from vmlaunch.policy.placement import (
    COOLDOWN,
    RETURN_AFTER,
    Binding,
    Demand,
    GuestNode,
    Node,
    VmLoad,
    balance,
    place,
)
from vmlaunch.resources.manager import LabManager
from vmlaunch.resources.placement import VmPlacement
from vmlaunch.spec.load import load_lab


def nodes(count: int, cpus: int = 4, free: int = 8192, total: int | None = None) -> list[Node]:
    return [Node(i, tuple(range(i * cpus, (i + 1) * cpus)), free, total) for i in range(count)]


# --- initial placement -----------------------------------------------------------------------------


def test_each_vm_on_the_least_loaded_node_that_holds_it() -> None:
    placed = place([Demand("a", 2, 1024), Demand("b", 2, 1024), Demand("c", 2, 1024), Demand("d", 1, 512)],
                   nodes(2))
    assert {name: p.nodes for name, p in placed.items()} == {"a": (0,), "b": (1,), "c": (0,), "d": (1,)}
    assert placed["a"].binding is Binding.PLACED and placed["a"].movable
    assert placed["a"].cpus == (0, 1, 2, 3) and placed["b"].cpus == (4, 5, 6, 7)


def test_free_memory_breaks_ties_and_a_full_node_is_skipped() -> None:
    host = [Node(0, (0, 1), 2000), Node(1, (2, 3), 6000), Node(2, (4, 5), 9000)]
    placed = place([Demand("big", 1, 5000), Demand("small", 1, 100)], host)
    assert placed["big"].nodes == (2,)  # the most free of the idle nodes that hold it
    assert placed["small"].nodes == (1,)  # idle, and more free than node 0


def test_vcpus_already_running_count() -> None:
    placed = place([Demand("new", 2, 512)], nodes(2), vcpus_on={0: 6})
    assert placed["new"].nodes == (1,)


def test_numa_node_and_pinning_are_kept_and_counted() -> None:
    placed = place([Demand("db", 4, 2048, node=1), Demand("pin", 2, 512, pinned=(2, 3)),
                    Demand("free", 4, 1024)], nodes(2))
    assert placed["db"].binding is Binding.NODE and placed["db"].nodes == (1,) and not placed["db"].movable
    assert placed["pin"].binding is Binding.PINNED and placed["pin"].vcpu_cpus == (2, 3)
    assert placed["pin"].nodes == (0,) and placed["pin"].cpus == (2, 3)
    # node 0: 2 pinned vCPUs on 4 CPUs; node 1: 4 of db's: the free VM goes to node 0
    assert placed["free"].nodes == (0,)


def test_fewer_pinned_cpus_than_vcpus_wrap_around() -> None:
    placed = place([Demand("pin", 4, 512, pinned=(5, 6))], nodes(2))
    assert placed["pin"].vcpu_cpus == (5, 6, 5, 6) and placed["pin"].nodes == (1,)


def test_pinning_over_two_nodes_binds_memory_to_both() -> None:
    placed = place([Demand("wide", 2, 512, pinned=(3, 4))], nodes(2))
    assert placed["wide"].nodes == (0, 1)


def test_a_vm_larger_than_every_node_spans_them_with_a_guest_topology() -> None:
    host = [Node(0, (0, 1, 2, 3), 20000, 32768), Node(1, (4, 5, 6, 7), 30000, 32768),
            Node(2, (8, 9, 10, 11), 10000, 32768)]
    placed = place([Demand("huge", 6, 40960)], host)["huge"]
    assert placed.binding is Binding.SPANS and not placed.movable
    assert placed.nodes == (0, 1)  # the fewest nodes, most free first
    assert [node.host_node for node in placed.guest_nodes] == [0, 1]
    assert sum(node.memory_mib for node in placed.guest_nodes) == 40960
    assert all(node.memory_mib % 2 == 0 for node in placed.guest_nodes)
    assert [node.vcpus for node in placed.guest_nodes] == [(0, 1), (2, 3, 4, 5)]  # in proportion


def test_a_vm_that_spans_takes_the_nearest_nodes() -> None:
    far, near = (10, 30, 30, 12), (12, 30, 30, 10)
    host = [Node(0, (0,), 9000, 9000, far), Node(1, (1,), 8900, 9000, (30, 10, 12, 30)),
            Node(2, (2,), 8900, 9000, (30, 12, 10, 30)), Node(3, (3,), 5000, 9000, near)]
    assert place([Demand("huge", 2, 12000)], host)["huge"].nodes == (0, 3)  # not 1, with more free


def test_a_vm_that_fits_a_node_but_not_its_free_memory_is_not_split() -> None:
    host = [Node(0, (0, 1), 1000, 8192), Node(1, (2, 3), 3000, 8192)]
    placed = place([Demand("a", 1, 4096)], host)["a"]
    assert placed.binding is Binding.PLACED and placed.nodes == (1,)
    assert "no node has 4096 MiB free" in placed.reason


def test_hugepage_vms_are_split_in_whole_pages() -> None:
    host = [Node(0, (0,), 3000, 3072), Node(1, (1,), 2000, 3072)]
    placed = place([Demand("h", 2, 4096, page_mib=1024)], host)["h"]
    assert [node.memory_mib for node in placed.guest_nodes] == [2048, 2048]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(64, 20000)), min_size=1, max_size=12),
       st.integers(1, 4))
def test_every_vm_is_placed_once_and_a_vm_that_fits_is_never_split(vms: list[tuple[int, int]],
                                                                   count: int) -> None:
    host = nodes(count, 4, 16384, 16384)
    placed = place([Demand(f"v{i}", cpus, mib) for i, (cpus, mib) in enumerate(vms)], host)
    assert set(placed) == {f"v{i}" for i in range(len(vms))}
    for i, (cpus, mib) in enumerate(vms):
        where = placed[f"v{i}"]
        if mib <= 16384 or count == 1:
            assert len(where.nodes) == 1 and not where.guest_nodes
        else:
            assert sum(node.memory_mib for node in where.guest_nodes) == mib
            assert sorted(v for node in where.guest_nodes for v in node.vcpus) == list(range(cpus))


# --- the balancer ------------------------------------------------------------------------------------


def test_a_balanced_host_is_left_alone() -> None:
    decision = balance(nodes(2), [VmLoad("a", 0, 2.0, 512), VmLoad("b", 1, 2.1, 512)], 1)
    assert decision.move is None and decision.reason.startswith("balanced: load ratio 1.050")


def test_one_vm_moves_from_the_busiest_to_the_idlest_node() -> None:
    vms = [VmLoad("a", 0, 3.0, 512), VmLoad("b", 0, 1.0, 512), VmLoad("c", 0, 2.0, 512),
           VmLoad("d", 1, 1.0, 512)]
    decision = balance(nodes(2), vms, 1)
    assert decision.move is not None
    # a (3.0) leaves 3.0 against 4.0, c (2.0) 4.0 against 3.0: alike, the first by name; b (1.0) less
    assert (decision.move.vm, decision.move.source, decision.move.target) == ("a", 0, 1)
    assert [node.running for node in decision.nodes] == [6.0, 1.0]
    assert decision.nodes[0].imbalance == pytest.approx(71.43, abs=0.01)


def test_the_seed_format_table() -> None:
    vms = [VmLoad("vg-db0030", 0, 4, 2048), VmLoad("vg-db0018", 1, 5, 2048)]
    decision = balance(nodes(2, cpus=20), vms, 1)
    table = decision.table()
    assert table[0].split() == ["node", "running", "cpus", "load", "imbalance", "VMs(running)"]
    assert table[1].split() == ["node0", "4.0", "20", "0.200", "-11.11%", "vg-db0030:", "4.0"]
    assert table[-1].split() == ["all", "9.0", "40", "0.225", "+0.00%"]


def test_an_idle_host_and_one_node_are_left_alone() -> None:
    assert balance(nodes(2), [VmLoad("a", 0, 0.1, 512)], 1).reason.startswith("idle")
    assert balance(nodes(1), [VmLoad("a", 0, 4.0, 512)], 1).reason == "one node: nothing to balance"


def test_pinned_vms_and_vms_that_do_not_fit_stay() -> None:
    host = [Node(0, (0, 1), 8192), Node(1, (2, 3), 600)]
    vms = [VmLoad("pinned", 0, 2.0, 512, movable=False), VmLoad("big", 0, 2.0, 4096)]
    decision = balance(host, vms, 1)
    assert decision.move is None and "big (4096 MiB; node 1 has 344 free)" in decision.reason


def test_no_vm_moves_twice_in_a_row_nor_back() -> None:
    host = nodes(2)
    vms = [VmLoad("a", 1, 3.0, 512), VmLoad("b", 1, 3.0, 512), VmLoad("c", 0, 0.5, 512)]
    assert balance(host, vms, 10, {"a": (9, 0), "b": (9, 0)}).move is None  # both just moved here
    held = balance(host, vms, 10 + COOLDOWN, {"a": (10, 0), "b": (10, 0)})
    assert held.move is None and "left node 0" in held.reason  # not back to the node they left
    later = balance(host, vms, 10 + RETURN_AFTER, {"a": (10, 0), "b": (10, 0)})
    assert later.move is not None and later.move.vm == "a"


def test_a_move_that_would_overshoot_is_not_made() -> None:
    decision = balance(nodes(2), [VmLoad("a", 0, 4.0, 512), VmLoad("b", 1, 3.0, 512)], 1)
    assert decision.move is None and "no VM's move evens it" in decision.reason


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 4.0), min_size=4, max_size=24), st.integers(2, 4), st.randoms())
def test_the_balancer_settles_without_undoing_a_move(loads: list[float], count: int, rng: object) -> None:
    host = nodes(count, 4)
    where = {f"v{i}": i % count for i in range(len(loads))}
    history: dict[str, tuple[int, int]] = {}
    left: dict[str, set[int]] = {name: set() for name in where}
    moves = 0
    for round_no in range(1, 60):
        vms = [VmLoad(name, where[name], load, 512) for name, load in zip(where, loads)]
        decision = balance(host, vms, round_no, history)
        if decision.move is None:
            continue
        move = decision.move
        assert move.source == max(decision.nodes, key=lambda n: (n.load, -n.id)).id
        assert move.target not in left[move.vm]  # never back where it was
        left[move.vm].add(move.source)
        history[move.vm] = (round_no, move.source)
        where[move.vm] = move.target
        moves += 1
    assert moves <= len(loads) * (count - 1)


def test_migrate_pages_is_best_effort() -> None:
    """This one-node host: node 1 does not exist, and nothing moves (no error either)."""
    import os

    from vmlaunch.host.cgroups import migrate_pages

    migrate_pages(os.getpid(), (0,), (0, 1))
    migrate_pages(os.getpid(), (0,), (0,))  # nothing elsewhere: no call


# --- what the compiler makes of it ------------------------------------------------------------------


def topology(count: int, cpus: int = 4, memory: int = 8192, free: int = 6000) -> Topology:
    return Topology(tuple(NumaNode(i, tuple(range(i * cpus, (i + 1) * cpus)), memory, free,
                                   tuple(10 if j == i else 21 for j in range(count))) for i in range(count)))


V1 = Cpusets(CgroupVersion.V1, Path("/sys/fs/cgroup/cpuset"))


def spec(tmp_path: Path, vms: str, lab: str = "") -> Path:
    path = tmp_path / "lab.toml"
    path.write_text(f'[lab]\nname = "numa"\n{lab}{vms}')
    return path


def vm(name: str, memory: str = "1G", cpus: int = 2, extra: str = "") -> str:
    return f'[vm.{name}]\nmemory = "{memory}"\ncpus = {cpus}\nkernel = "vmlinuz"\n{extra}'


def objects(argv: tuple[str, ...]) -> list[dict[str, object]]:
    return [json.loads(argv[i + 1]) for i, arg in enumerate(argv) if arg == "-object"]


def test_placement_is_on_by_default_on_a_host_of_several_nodes(tmp_path: Path) -> None:
    path = spec(tmp_path, vm("a") + vm("b"))
    plan = compile_lab(load_lab(path), fake_host(numa=topology(2), cpusets=V1))
    ram = objects(plan.vm("a").argv)
    assert ram == [{"qom-type": "memory-backend-ram", "id": "ram", "size": 1 << 30, "host-nodes": [0],
                    "policy": "bind"}]
    assert "memory-backend=ram" in plan.vm("a").argv[plan.vm("a").argv.index("-machine") + 1]
    assert objects(plan.vm("b").argv)[0]["host-nodes"] == [1]
    placements = [r for r in plan.resources if isinstance(r, VmPlacement)]
    assert [(p.placed.name, p.placed.nodes, p.cgroup) for p in placements] == [
        ("a", (0,), Path("/sys/fs/cgroup/cpuset/vmlaunch.numa.a")),
        ("b", (1,), Path("/sys/fs/cgroup/cpuset/vmlaunch.numa.b"))]
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    assert manager.config.balance and manager.config.balance_interval == 5.0
    assert [(v.name, v.nodes, v.movable) for v in manager.config.vms] == [("a", (0,), True),
                                                                          ("b", (1,), True)]
    assert "NUMA balancer every 5 s (may move: a, b)" in manager.describe()


def test_one_node_places_nothing_unless_asked(tmp_path: Path) -> None:
    plan = compile_lab(load_lab(spec(tmp_path, vm("a"))), fake_host(numa=topology(1), cpusets=V1))
    assert objects(plan.vm("a").argv) == [] and not any(isinstance(r, VmPlacement) for r in plan.resources)
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]  # for the event log only
    assert not manager.config.balance
    asked = spec(tmp_path, vm("a"), '[lab.placement]\npolicy = "auto"\ninterval = "2s"\n')
    plan = compile_lab(load_lab(asked), fake_host(numa=topology(1), cpusets=V1))
    assert objects(plan.vm("a").argv)[0]["host-nodes"] == [0]
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    assert manager.config.balance and manager.config.balance_interval == 2.0


def test_policy_none_and_balance_false(tmp_path: Path) -> None:
    none = spec(tmp_path, vm("a"), '[lab.placement]\npolicy = "none"\n')
    plan = compile_lab(load_lab(none), fake_host(numa=topology(4), cpusets=V1))
    assert objects(plan.vm("a").argv) == []
    still = spec(tmp_path, vm("a"), "[lab.placement]\nbalance = false\n")
    plan = compile_lab(load_lab(still), fake_host(numa=topology(4), cpusets=V1))
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]  # for the event log only
    assert objects(plan.vm("a").argv) and not manager.config.balance


def test_without_cpusets_placement_pins_and_nothing_is_moved(tmp_path: Path) -> None:
    plan = compile_lab(load_lab(spec(tmp_path, vm("a"))), fake_host(numa=topology(2), cpusets=None))
    (placement,) = [r for r in plan.resources if isinstance(r, VmPlacement)]
    assert placement.cgroup is None and "sched_setaffinity" in placement.describe()
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    assert [v.movable for v in manager.config.vms] == [False]


def test_a_vm_larger_than_any_node_gets_a_guest_numa_topology(tmp_path: Path) -> None:
    path = spec(tmp_path, vm("big", "12G", 4))
    plan = compile_lab(load_lab(path), fake_host(numa=topology(4, memory=8192, free=7000), cpusets=V1))
    argv = plan.vm("big").argv
    rams = objects(argv)
    assert [(ram["id"], ram["host-nodes"]) for ram in rams] == [("ram-node0", [0]), ("ram-node1", [1])]
    assert sum(int(str(ram["size"])) for ram in rams) == 12 << 30
    numa = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-numa"]
    assert numa == ["node,nodeid=0,memdev=ram-node0,cpus=0-1", "node,nodeid=1,memdev=ram-node1,cpus=2-3"]
    assert "memory-backend" not in argv[argv.index("-machine") + 1]
    placed = plan.vm("big").placement
    assert placed is not None
    assert placed.guest_nodes[0] == GuestNode(0, int(str(rams[0]["size"])) >> 20, (0, 1))


def test_pinning_and_numa_node_in_the_argv_and_the_plan(tmp_path: Path) -> None:
    path = spec(tmp_path, vm("db", extra="numa_node = 1\n") + vm("web", extra="cpu_pinning = [2, 3]\n"))
    plan = compile_lab(load_lab(path), fake_host(numa=topology(2), cpusets=V1))
    assert objects(plan.vm("db").argv)[0]["host-nodes"] == [1]
    web = plan.vm("web").placement
    assert web is not None and web.vcpu_cpus == (2, 3) and web.nodes == (0,)
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    assert [v.movable for v in manager.config.vms] == [False, False]  # bound and pinned stay


@pytest.mark.parametrize("extra, words, key", [
    ("numa_node = 2\n", "this host has no NUMA node 2 (its nodes: 0, 1)", "vm.a.numa_node"),
    ("cpu_pinning = [1, 9]\n", "this host has no CPU 9 (its CPUs: 0-7)", "vm.a.cpu_pinning"),
])
def test_nodes_and_cpus_the_host_lacks_are_exit_3(tmp_path: Path, extra: str, words: str, key: str) -> None:
    path = spec(tmp_path, vm("a", extra=extra))
    with pytest.raises(HostError) as info:
        compile_lab(load_lab(path), fake_host(numa=topology(2), cpusets=V1))
    assert info.value.exit_code == 3
    assert str(info.value).startswith(f"{path}:7: {key}: {words}")


def test_a_vm_larger_than_the_node_it_names_is_exit_3(tmp_path: Path) -> None:
    path = spec(tmp_path, vm("a", "12G", extra="numa_node = 1\n"))
    with pytest.raises(HostError, match=r"12G does not fit node 1 \(8G in all\)") as info:
        compile_lab(load_lab(path), fake_host(numa=topology(2), cpusets=V1))
    assert "placement spreads a VM larger than any node" in str(info.value)


def test_pinning_that_over_commits_is_a_note_that_says_which(tmp_path: Path) -> None:
    path = spec(tmp_path, vm("a", cpus=3, extra="cpu_pinning = [1, 2]\nnuma_node = 1\n")
                + vm("b", cpus=1, extra="cpu_pinning = [2, 3, 4]\n"))
    notes = compile_lab(load_lab(path), fake_host(numa=topology(2), cpusets=V1)).notes
    assert "a: over-committed by its pinning: vCPUs 0, 2 share CPU 1" in notes
    assert ("b: cpu_pinning names 3 host CPUs for 1 vCPU: CPUs 3, 4 carry no vCPU (QEMU's other threads "
            "use every pinned CPU)") in notes
    assert "host CPU 2 is pinned in a and b: their vCPUs take turns on it (over-committed)" in notes
    assert any(note.startswith("a: vCPUs pinned to CPUs 1, 2, off node 1") for note in notes)
    again = spec(tmp_path, vm("c", cpus=1, extra="cpu_pinning = [0, 0, 5]\n"))
    notes = compile_lab(load_lab(again), fake_host(numa=topology(2), cpusets=V1)).notes
    assert ("c: cpu_pinning names 3 host CPUs for 1 vCPU: CPU 5 carries no vCPU (QEMU's other threads use "
            "every pinned CPU)") in notes  # CPU 0, named twice, runs vCPU 0


def test_up_of_more_vms_places_them_beside_the_running_ones_where_they_are_now(tmp_path: Path) -> None:
    """The balancer moved a and b to node 0 since `up`: `up c` counts their vCPUs there, not where a
    fresh placement of the whole lab would have put them."""
    lab = load_lab(spec(tmp_path, vm("a") + vm("b") + vm("c")))
    host = fake_host(numa=topology(2), cpusets=V1)
    fresh = compile_lab(lab, host, ["c"])
    assert objects(fresh.vm("c").argv)[0]["host-nodes"] == [0]
    plan = compile_lab(lab, host, ["c"], running={"a": (0,), "b": (0,)})
    assert objects(plan.vm("c").argv)[0]["host-nodes"] == [1]
    (placement,) = [r for r in plan.resources if isinstance(r, VmPlacement)]
    assert placement.placed.name == "c" and placement.placed.nodes == (1,)
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    assert [(v.name, v.nodes, v.movable) for v in manager.config.vms] == [
        ("a", (0,), True), ("b", (0,), True), ("c", (1,), True)]


def test_running_vms_keep_their_binding_and_bad_nodes_are_ignored(tmp_path: Path) -> None:
    lab = load_lab(spec(tmp_path, vm("a", extra="numa_node = 1\n") + vm("b")
                        + vm("p", extra="cpu_pinning = [2, 3]\n") + vm("d")))
    host = fake_host(numa=topology(2), cpusets=V1)
    plan = compile_lab(lab, host, ["d"], running={"a": (1,), "b": (7,), "p": (1,), "x": (0,)})
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    where = {v.name: (v.nodes, v.movable) for v in manager.config.vms}
    assert where["a"] == ((1,), False)  # numa_node: still not the balancer's to move
    assert where["p"] == ((0,), False)  # pinned: where its CPUs are, whatever was said
    assert where["b"][1] is True  # node 7 does not exist: placed afresh


def test_where_running_reads_the_cgroup_else_the_cpus_allowed(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from vmlaunch.lab import process as qemu
    from vmlaunch.lab.journal import Entry, Journal, VmEntry
    from vmlaunch.lab.running import where_running
    from vmlaunch.layout.rundir import RunDir
    from vmlaunch.resources.placement import PlacementRecord

    run_dir = RunDir(tmp_path / "run" / "numa")
    run_dir.create()
    cgroup = tmp_path / "cgroup" / "vmlaunch.numa.a"
    cgroup.mkdir(parents=True)
    (cgroup / "cpuset.cpus").write_text("4-7\n")
    (cgroup / "cpuset.mems").write_text("1\n")  # moved by the balancer: placed on 0 at up
    journal = Journal(run_dir, spec=str(tmp_path / "lab.toml"))
    for name, folder in (("a", cgroup), ("b", None), ("gone", None)):
        journal.vms[name] = VmEntry(pid=os.getpid(), started=0.0, accel="tcg")
        record = PlacementRecord(name, folder, (0,), (0, 1, 2, 3))
        journal.add(Entry(PlacementRecord.kind, name, name, record))
    journal.vms["unplaced"] = VmEntry(pid=os.getpid(), started=0.0, accel="tcg")
    journal.save()
    monkeypatch.setattr(qemu, "find_pid", lambda files, pid: None if files.name == "gone" else pid)
    monkeypatch.setattr("vmlaunch.host.numa.allowed_cpus", lambda pid, tid=None: (1, 2))
    assert where_running(run_dir, topology(2)) == {"a": (1,), "b": (0,)}
    assert where_running(run_dir, topology(1)) == {}  # one node: nothing to place beside
    assert where_running(RunDir(tmp_path / "run" / "none"), topology(2)) == {}


def test_a_memory_only_node_is_never_where_vcpus_go() -> None:
    """A node without CPUs (CXL memory) has the most free memory, and still no VM is placed or moved there."""
    hosts = [Node(0, (0, 1, 2, 3), 4000), Node(1, (), 60000), Node(2, (4, 5, 6, 7), 4000)]
    placed = place([Demand("a", 2, 2048), Demand("b", 2, 2048), Demand("big", 2, 3900)], hosts)
    assert {name: p.nodes for name, p in placed.items()} == {"big": (0,), "a": (2,), "b": (2,)}
    assert all(p.cpus for p in placed.values())
    busy = [VmLoad("a", 0, 4.0, 1024), VmLoad("b", 0, 4.0, 1024)]
    decision = balance(hosts, busy, round_no=10)
    assert decision.move is not None and decision.move.target == 2


def test_numa_node_naming_a_memory_only_node_is_exit_3(tmp_path: Path) -> None:
    memory_only = Topology((NumaNode(0, (0, 1), 8192, 6000, (10, 21)),
                            NumaNode(1, (), 65536, 60000, (21, 10))))
    lab = load_lab(spec(tmp_path, vm("a", extra="numa_node = 1\n")))
    with pytest.raises(HostError, match="node 1 has memory but no CPUs") as caught:
        compile_lab(lab, fake_host(numa=memory_only, cpusets=V1))
    assert caught.value.exit_code == 3
