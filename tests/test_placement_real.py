"""NUMA placement for real on this one-node machine: a placed VM's QEMU in its cpuset cgroup and its
memory bound to node 0 (numa_maps), pinned vCPU threads on the CPUs the spec names (read back from
/proc/PID/task/*/status), the balancer's loop running against the real VMs without moving anything,
`vmlaunch numa`, and nothing left after `down` or a failed `up`; then the same without cgroups
(sched_setaffinity)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.cli import main
from vmlaunch.core.naming import cgroup_name
from vmlaunch.host.cgroups import detect
from vmlaunch.host.numa import allowed_cpus, read_numa_maps, read_threads, read_topology, vcpu_index

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"


def lab(tmp_path: Path, guest: Path, name: str, b_extra: str = "cpu_pinning = [1, 0]\n") -> Path:
    cpus = sorted(read_topology().nodes[0].cpus)
    if len(cpus) < 2:
        pytest.skip("needs a host with two CPUs")
    common = f'accel = "tcg"\nkernel = "{guest}/vmlinuz"\ninitrd = "{guest}/initrd.gz"\n'
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[lab]\nname = "{name}"\n[lab.memory]\nksm = false\n'
                    f'[lab.placement]\npolicy = "auto"\ninterval = "1s"\n'
                    f'[vm.a]\nmemory = "128M"\n{common}[vm.b]\nmemory = "128M"\ncpus = 2\n{b_extra}{common}')
    return path


def pid_of(run_dir: Path, lab_name: str, vm: str) -> int:
    return int((run_dir / lab_name / f"{vm}.pid").read_text())


def vcpu_allowed(pid: int) -> dict[int, tuple[int, ...]]:
    return {index: allowed_cpus(pid, thread.tid) for thread in read_threads(pid)
            if (index := vcpu_index(thread.name)) is not None}


@pytest.fixture
def node0_cpus() -> tuple[int, ...]:
    return read_topology().nodes[0].cpus


@pytest.fixture
def cpusets() -> Iterator[Path]:
    found = detect()
    if found is None:
        pytest.skip("no cpuset cgroups on this host")
    yield found.root


def test_placed_vms_are_bound_pinned_and_balanced_without_moves(
        tmp_path: Path, run_dir: Path, test_guest: Path, cpusets: Path, node0_cpus: tuple[int, ...],
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = lab(tmp_path, test_guest, "place")
    assert main(["up", str(spec), "--wait-for", READY, "--timeout", "90"]) == 0
    try:
        a, b = pid_of(run_dir, "place", "a"), pid_of(run_dir, "place", "b")
        for vm, pid in (("a", a), ("b", b)):
            folder = cpusets / cgroup_name("place", vm)
            assert str(pid) in (folder / "cgroup.procs").read_text().split()
            assert (folder / "cpuset.mems").read_text().strip() == "0"
            memory = read_numa_maps(pid)
            assert memory is not None and "bind:0" in memory.policies  # the guest's RAM
            assert set(memory.per_node) == {0}
        assert allowed_cpus(a) == node0_cpus  # QEMU's threads on the node placement chose
        assert vcpu_allowed(a) == {0: node0_cpus}
        assert vcpu_allowed(b) == {0: (1,), 1: (0,)}  # vCPU i on cpu_pinning[i]
        deadline = time.monotonic() + 30
        log = ""
        while log.count("balancer, round") < 1 and time.monotonic() < deadline:
            time.sleep(1)
            log = (run_dir / "place" / "manager.log").read_text()
        assert "one node: nothing to balance" in log and "moved" not in log
        capsys.readouterr()
        assert main(["numa", str(spec), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert [(vm["name"], vm["placed"], vm["local"]) for vm in report["vms"]] == [("a", [0], 1.0),
                                                                                    ("b", [0], 1.0)]
        assert report["balancer"]["reason"] == "one node: nothing to balance"
        assert [vcpu["allowed"] for vcpu in report["vms"][1]["vcpus"]] == ["1", "0"]
        assert main(["numa", str(spec)]) == 0
        text = capsys.readouterr().out
        assert re.search(r"^\[a\(\d+\)\] node 0, 100\.0% local \(cpuset cgroup .*; memory policy bind:0",
                         text, re.M)
    finally:
        assert main(["down", str(spec)]) == 0
    assert not any(name.startswith("vmlaunch.place.") for name in os.listdir(cpusets))


def test_a_failing_up_removes_the_cgroups(tmp_path: Path, run_dir: Path, test_guest: Path,
                                          cpusets: Path) -> None:
    """b's "kernel" is no kernel: its QEMU fails after both cgroups were made."""
    (tmp_path / "junk").write_bytes(b"not a kernel" * 100)
    spec = tmp_path / "failing.toml"
    spec.write_text(f'[lab]\nname = "failing"\n[lab.placement]\npolicy = "auto"\n'
                    f'[vm.a]\nmemory = "128M"\naccel = "tcg"\nkernel = "{test_guest}/vmlinuz"\n'
                    f'initrd = "{test_guest}/initrd.gz"\n'
                    f'[vm.b]\nmemory = "128M"\naccel = "tcg"\nkernel = "{tmp_path}/junk"\n')
    assert main(["up", str(spec)]) == 4
    assert not any(name.startswith("vmlaunch.failing.") for name in os.listdir(cpusets))
    assert not (run_dir / "failing").exists()


def test_without_cpusets_the_threads_are_pinned_by_affinity(
        tmp_path: Path, run_dir: Path, test_guest: Path, node0_cpus: tuple[int, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vmlaunch.host.facts.detect_cpusets", lambda: None)
    spec = lab(tmp_path, test_guest, "affine", "cpu_pinning = [0]\n")
    assert main(["up", str(spec), "--wait-for", READY, "--timeout", "90"]) == 0
    try:
        b = pid_of(run_dir, "affine", "b")
        assert vcpu_allowed(b) == {0: (0,), 1: (0,)}  # two vCPUs on one pinned CPU: over-committed
        assert allowed_cpus(b) == (0,)  # QEMU's other threads on the pinned CPUs too
        a = pid_of(run_dir, "affine", "a")
        assert allowed_cpus(a) == node0_cpus
        assert Path(f"/proc/{a}/cpuset").read_text().strip() == "/"  # in no cgroup of vmlaunch's
        log = (run_dir / "affine" / "manager.log").read_text()
        assert "moved" not in log
    finally:
        assert main(["down", str(spec)]) == 0
