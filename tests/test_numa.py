"""The host's NUMA topology and a VM's NUMA state as read from sysfs and proc (vmlaunch/host/numa.py), on
fake 2- and 4-node hosts, and the `numa` report (vmlaunch/runtime/numareport.py) from fake numa_maps."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fakenuma import make_nodes, make_vm
from vmlaunch.host.numa import (
    Topology,
    allowed_cpus,
    format_cpulist,
    iter_vcpu_threads,
    parse_cpulist,
    parse_numa_maps,
    read_numa_maps,
    read_threads,
    read_topology,
    vcpu_index,
)
from vmlaunch.resources.placement import PlacementRecord
from vmlaunch.runtime.numareport import NodeReport, NumaReport, render, vm_report


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    sysfs.mkdir()
    proc.mkdir()
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(sysfs))
    monkeypatch.setenv("VMLAUNCH_PROC", str(proc))
    return sysfs, proc


@pytest.mark.parametrize("text, cpus", [
    ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-1,8,10-11\n", (0, 1, 8, 10, 11)), ("", ()),
    ("3,1,2", (1, 2, 3)),
])
def test_cpulists(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "1-", "3-1", "0-99999999", "1,,x"])
def test_bad_cpulists(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(text)


@given(st.sets(st.integers(0, 300)))
def test_cpulist_round_trip(cpus: set[int]) -> None:
    assert parse_cpulist(format_cpulist(cpus)) == tuple(sorted(cpus))


@pytest.mark.parametrize("nodes, per_node", [(2, 4), (4, 10)])
def test_topology_of_fake_hosts(roots: tuple[Path, Path], nodes: int, per_node: int) -> None:
    sysfs, _ = roots
    make_nodes(sysfs, nodes, per_node, 16384, free_mib=[1000 * (i + 1) for i in range(nodes)])
    topology = read_topology()
    assert [node.id for node in topology.nodes] == list(range(nodes))
    assert topology.nodes[1].cpus == tuple(range(per_node, 2 * per_node))
    assert topology.nodes[1].memory_mib == 16384 and topology.nodes[1].free_mib == 2000
    assert topology.nodes[0].distances[:2] == (10, 21)
    assert topology.multi_node and topology.cpus == frozenset(range(nodes * per_node))
    assert topology.node_of_cpu(per_node) == 1 and topology.node_of_cpu(9999) is None


def test_a_kernel_without_numa_is_one_node(roots: tuple[Path, Path]) -> None:
    sysfs, proc = roots
    (sysfs / "devices" / "system" / "cpu").mkdir(parents=True)
    (sysfs / "devices" / "system" / "cpu" / "online").write_text("0-5\n")
    (proc / "meminfo").write_text("MemTotal:       8388608 kB\nMemFree:        4194304 kB\n")
    topology = read_topology()
    assert topology == Topology((topology.nodes[0],))
    assert topology.nodes[0].cpus == tuple(range(6)) and topology.nodes[0].memory_mib == 8192
    assert not topology.multi_node


def test_this_host_has_at_least_one_node() -> None:
    topology = read_topology()
    assert topology.nodes and topology.cpus


def test_numa_maps_are_summed_per_node() -> None:
    text = ("7f00 bind:1 anon=3 dirty=3 N1=262144 kernelpagesize_kB=4\n"
            "7f01 default file=/x mapped=10 N0=4 N1=6 kernelpagesize_kB=4\n"
            "7f02 interleave:0-1 huge N0=8 N1=8 kernelpagesize_kB=2048\n")
    memory = parse_numa_maps(text)
    assert memory.per_node == {0: 4 * 4096 + 8 * (2 << 20), 1: (262144 + 6) * 4096 + 8 * (2 << 20)}
    assert memory.policies == ("bind:1", "interleave:0-1")  # the mappings of 16 MiB or more
    assert memory.local_share([1]) == pytest.approx(memory.per_node[1] / memory.total)
    assert parse_numa_maps("").local_share([0]) is None


def test_a_vms_threads_and_memory_from_proc(roots: tuple[Path, Path]) -> None:
    _, proc = roots
    make_vm(proc, 500, [("R", 5), ("S", 6)], {0: 1000, 1: 3000}, policy="bind:1", allowed="4-7")
    threads = read_threads(500)
    assert [(t.tid, t.name, t.state, t.last_cpu) for t in threads] == [
        (500, "qemu-system-x86", "S", 0), (501, "CPU 0/TCG", "R", 5), (502, "CPU 1/TCG", "S", 6)]
    assert [index for index, _ in iter_vcpu_threads(threads)] == [0, 1]
    assert allowed_cpus(500, 501) == (4, 5, 6, 7) and allowed_cpus(500) == (4, 5, 6, 7)
    memory = read_numa_maps(500)
    assert memory is not None and memory.per_node == {0: (1000 + 800 + 300) * 4096, 1: 3000 * 4096}
    assert read_threads(999) == [] and read_numa_maps(999) is None and allowed_cpus(999) == ()


@pytest.mark.parametrize("name, index", [("CPU 0/TCG", 0), ("CPU 12/KVM", 12), ("worker", None),
                                         ("CPU x/TCG", None), ("IO mon_iothread", None)])
def test_vcpu_threads_by_name(name: str, index: int | None) -> None:
    assert vcpu_index(name) == index


def test_the_numa_report_reads_like_the_seeds(roots: tuple[Path, Path], tmp_path: Path) -> None:
    sysfs, proc = roots
    make_nodes(sysfs, 2, 4, 8192)
    make_vm(proc, 700, [("R", 5), ("S", 1)], {0: 8192, 1: 24576}, policy="bind:1", allowed="4-7")
    record = PlacementRecord("db", None, (1,), (4, 5, 6, 7))
    vm = vm_report("db", 700, record, read_topology())
    assert vm.placed == (1,) and vm.how == "sched_setaffinity"
    assert vm.page_counts == {0: 8192 + 1100, 1: 24576}
    assert vm.local == pytest.approx(24576 / (24576 + 9292))
    assert [(v.index, v.cpu, v.node, v.allowed, v.running) for v in vm.vcpus] == [
        (0, 5, 1, "4-7", True), (1, 1, 0, "4-7", False)]
    report = NumaReport((NodeReport(0, "0-3", 8 << 30, 6 << 30, 0, 0.25),
                         NodeReport(1, "4-7", 8 << 30, 5 << 30, 1, None)), (vm,), None)
    lines = render(report)
    assert lines[0] == "[db(700)] node 1, 72.6% local (sched_setaffinity; memory policy bind:1)"
    assert lines[1] == "  node:[0] pages:[0009292] MiB:[00036] percent[027.44]"
    assert lines[2] == "  node:[1] pages:[0024576] MiB:[00096] percent[072.56]"
    assert "  vCPU 0 (thread 701): last ran on CPU 5 (node 1), may run on 4-7; running" in lines
    assert lines[-2].split() == ["0", "0-3", "8192", "Mi", "6144", "Mi", "0", "0.250"]
    assert report.to_json()["vms"][0]["memory"] == {"0": 9292 * 4096, "1": 24576 * 4096}
