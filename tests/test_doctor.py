"""`vmlaunch doctor` (vmlaunch/doctor/): per check, a fake host or image that makes it pass and one that
makes it fail, with the message and the fix; images partitioned by sfdisk, read through qemu-io."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import fake_host
from tests.test_pci import FakeSysfs
from vmlaunch.cli import main
from vmlaunch.doctor import host as host_checks
from vmlaunch.doctor.disks import Reader, cached_layout, layout
from vmlaunch.doctor.findings import Finding, Status
from vmlaunch.doctor.lab import check_lab
from vmlaunch.doctor.network import check_network
from vmlaunch.doctor.run import lab_warnings, one_line, render
from vmlaunch.host.facts import KvmStatus
from vmlaunch.host.memory import KsmSupport
from vmlaunch.host.numa import NumaNode, Topology
from vmlaunch.spec.load import load_lab


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sys"
    root.mkdir()
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(root))
    return root


@pytest.fixture
def proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    monkeypatch.setenv("VMLAUNCH_PROC", str(root))
    return root


def one(findings: Iterable[Finding], check: str | None = None) -> Finding:
    found = [f for f in findings if check is None or f.id == check]
    assert len(found) == 1, found
    return found[0]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- the host ----------------------------------------------------------------------------------------


def test_qemu_missing_fails_with_the_package_to_install() -> None:
    finding = one(host_checks.check_qemu(None, "qemu-system-x86_64 not found"))
    assert finding.status is Status.FAIL and finding.found == "QEMU: qemu-system-x86_64 not found"
    assert finding.fix is not None and "apt-get install qemu-system-x86 qemu-utils" in finding.fix
    assert one(host_checks.check_qemu(fake_host(), None)).status is Status.OK


@pytest.mark.parametrize("reason, fix", [
    ("no /dev/kvm (KVM module not loaded, or not virtualisation-capable)", "modprobe kvm_intel"),
    ("/dev/kvm is not readable and writable by this user (join group kvm)", "usermod -aG kvm USER"),
    ("/dev/kvm opens, but a test guest did not reach 64-bit mode within 3 s (a nested or paravirtual "
     "KVM that does not run ordinary guests)", "this KVM does not run ordinary guests, TCG does"),
])
def test_kvm_that_does_not_run_guests_says_why_and_what_to_do(sysfs: Path, reason: str, fix: str) -> None:
    finding = one(host_checks.check_kvm(fake_host(kvm=KvmStatus(False, reason)), sysfs))
    assert finding.status is Status.WARN and finding.found == f"KVM does not run a guest here: {reason}"
    assert finding.fix is not None and fix in finding.fix and "TCG" in finding.why
    ok = one(host_checks.check_kvm(fake_host(kvm=KvmStatus(True, "KVM ran a test guest")), sysfs))
    assert ok.status is Status.OK


def test_vhost_net(sysfs: Path) -> None:
    finding = one(host_checks.check_vhost_net(fake_host(vhost_net=False), sysfs))
    assert finding.status is Status.NOTE and finding.fix == "modprobe vhost_net"
    (sysfs / "class" / "misc" / "vhost-net").mkdir(parents=True)
    assert one(host_checks.check_vhost_net(fake_host(vhost_net=False), sysfs)).status is Status.OK


def test_io_uring(proc: Path) -> None:
    write(proc / "sys" / "kernel" / "io_uring_disabled", "2\n")
    finding = one(host_checks.check_io_uring(fake_host(io_uring=False), proc))
    assert finding.status is Status.NOTE and "kernel.io_uring_disabled = 2" in finding.found
    assert finding.fix == "sysctl kernel.io_uring_disabled=0"
    assert one(host_checks.check_io_uring(fake_host(io_uring=True), proc)).status is Status.OK


def test_iommu(sysfs: Path, proc: Path) -> None:
    write(proc / "cmdline", "ro quiet intel_iommu=on\n")
    finding = one(host_checks.check_iommu(sysfs, proc))
    assert finding.status is Status.NOTE and "(intel_iommu=on is on the kernel command line)" in finding.found
    assert finding.fix is not None and "intel_iommu=on iommu=pt" in finding.fix
    for group in ("0", "1"):
        (sysfs / "kernel" / "iommu_groups" / group).mkdir(parents=True)
    assert one(host_checks.check_iommu(sysfs, proc)).found == "IOMMU on: 2 IOMMU groups"


def test_hugepages(sysfs: Path) -> None:
    folder = sysfs / "kernel" / "mm" / "hugepages" / "hugepages-2048kB"
    write(folder / "nr_hugepages", "64\n")
    write(folder / "free_hugepages", "10\n")
    finding = one(host_checks.check_hugepages(fake_host(hugepage_sizes_kib=frozenset({2048})), sysfs))
    assert finding.status is Status.OK and finding.found == "hugepages 2M: 64 reserved, 10 free"
    none = one(host_checks.check_hugepages(fake_host(hugepage_sizes_kib=frozenset()), sysfs))
    assert none.status is Status.NOTE and none.fix == "a kernel with CONFIG_HUGETLBFS"


def test_ksm(sysfs: Path) -> None:
    folder = sysfs / "kernel" / "mm" / "ksm"
    for name, value in (("run", "0"), ("pages_to_scan", "100"), ("sleep_millisecs", "20"),
                        ("pages_sharing", "0")):
        write(folder / name, value + "\n")
    off = one(host_checks.check_ksm(fake_host(), sysfs))
    assert off.status is Status.NOTE and off.found == "KSM is off" and "lab.memory.ksm" in (off.fix or "")
    not_root = one(host_checks.check_ksm(fake_host(ksm=KsmSupport(writable=False, advisor=False)), sysfs))
    assert "echo 1 > /sys/kernel/mm/ksm/run" in (not_root.fix or "")
    write(folder / "run", "1\n")
    on = one(host_checks.check_ksm(fake_host(), sysfs))
    assert on.status is Status.OK and on.found == "KSM runs: 100 pages every 20 ms, 0 pages sharing"
    assert one(host_checks.check_ksm(fake_host(ksm=None), sysfs)).fix == "a kernel with CONFIG_KSM"


def test_a_finding_cites_its_source_by_a_title_a_user_can_look_up(sysfs: Path) -> None:
    """Not by the number of a file in the project's design notes ("seed 000")."""
    write(sysfs / "kernel" / "mm" / "ksm" / "run", "0\n")
    why = one(host_checks.check_ksm(fake_host(), sysfs)).why
    assert why.endswith("(IBM's \"Best practices for KVM\")") and "seed" not in why


def test_numa() -> None:
    two = Topology((NumaNode(0, (0, 1), 4096, 2048), NumaNode(1, (2, 3), 4096, 1024)))
    finding = one(host_checks.check_numa(fake_host(numa=two)))
    assert finding.found.startswith("2 NUMA nodes (node 0: CPUs 0-1, 4096 MiB (2048 free); node 1:")
    assert "sched_setaffinity (no cpuset cgroups: no balancing)" in finding.found


@pytest.mark.parametrize("setting, status", [("always [madvise] never", Status.OK),
                                             ("[always] madvise never", Status.OK),
                                             ("always madvise [never]", Status.WARN)])
def test_transparent_hugepages(sysfs: Path, setting: str, status: Status) -> None:
    write(sysfs / "kernel" / "mm" / "transparent_hugepage" / "enabled", setting + "\n")
    finding = one(host_checks.check_thp(sysfs))
    assert finding.status is status
    if status is Status.WARN:
        assert finding.fix == "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.parametrize("scheduler, status", [("none [mq-deadline] kyber bfq", Status.OK),
                                               ("[none] mq-deadline", Status.OK),
                                               ("mq-deadline [bfq]", Status.NOTE),
                                               ("noop deadline [cfq]", Status.WARN)])
def test_the_io_scheduler_of_the_disk_behind_an_image_folder(sysfs: Path, tmp_path: Path, scheduler: str,
                                                             status: Status) -> None:
    images = tmp_path / "images"
    images.mkdir()
    st = os.stat(images)
    disk = sysfs / "devices" / "pci0000:00" / "virtio1" / "block" / "fakedisk"
    partition = disk / "fakedisk1"
    write(partition / "partition", "1\n")
    write(disk / "queue" / "scheduler", scheduler + "\n")
    link = sysfs / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    link.parent.mkdir(parents=True)
    link.symlink_to(partition)
    finding = one(host_checks.check_io_scheduler([images], sysfs))
    assert finding.status is status and finding.found.startswith(f"fakedisk (holding {images}): ")
    if status is not Status.OK:
        assert finding.fix == "echo mq-deadline > /sys/block/fakedisk/queue/scheduler (a udev rule keeps it)"
    assert "Deadline" in finding.why


def test_no_block_device_no_scheduler(sysfs: Path, tmp_path: Path) -> None:
    assert list(host_checks.check_io_scheduler([tmp_path], sysfs)) == []


@pytest.mark.parametrize("available_kib, status", [(8 << 20, Status.OK), (1 << 20, Status.WARN)])
def test_host_memory_against_the_80_percent_target(proc: Path, available_kib: int, status: Status) -> None:
    write(proc / "meminfo", f"MemTotal:       {16 << 20} kB\nMemFree:  1 kB\n"
                            f"MemAvailable:   {available_kib} kB\n")
    finding = one(host_checks.check_memory())
    assert finding.status is status and "80 %" in finding.why


@pytest.mark.parametrize("free, status", [(100 << 30, Status.OK), (1 << 30, Status.WARN),
                                          (100 << 20, Status.FAIL)])
def test_disk_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int, status: Status) -> None:
    class Vfs:
        f_frsize = 4096
        f_bavail = free // 4096
        f_blocks = (200 << 30) // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Vfs())
    finding = one(host_checks.check_disk_space([tmp_path]))
    assert finding.status is status and "a full file system stops every guest" in finding.why


# --- the network -------------------------------------------------------------------------------------


def lab_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lab.toml"
    path.write_text('[lab]\nname = "doc"\n' + text)
    return path


VM = '[vm.{name}]\nmemory = "{memory}"\ncpus = {cpus}\nkernel = "vmlinuz"\n{extra}'


def vm(name: str = "a", memory: str = "256M", cpus: int = 1, extra: str = "") -> str:
    return VM.format(name=name, memory=memory, cpus=cpus, extra=extra)


@pytest.fixture
def ethtool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ethtool on PATH that says what `lro` holds."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "ethtool"
    script.write_text('#!/bin/sh\necho "Features for $2:"\necho "large-receive-offload: $(cat '
                      f'{folder}/lro)"\necho "generic-receive-offload: on"\n')
    script.chmod(0o755)
    (folder / "lro").write_text("on\n")
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return folder / "lro"


def test_lro_on_a_bridge_uplink(tmp_path: Path, sysfs: Path, ethtool: Path) -> None:
    write(sysfs / "class" / "net" / "eth1" / "mtu", "1500\n")
    spec = lab_spec(tmp_path, '[network.lan]\nbridge = "br7"\nuplink = "eth1"\n' + vm())
    lab = load_lab(spec)
    finding = one(check_network(lab, sysfs), "net.lro")
    assert finding.status is Status.WARN and finding.found == "eth1: large-receive-offload: on"
    assert finding.fix == "ethtool -K eth1 lro off" and finding.where == f"{spec}:5: network.lan.uplink"
    assert "cannot forward LRO packets, only GRO" in finding.why
    ethtool.write_text("off [fixed]\n")
    assert one(check_network(lab, sysfs), "net.lro").status is Status.OK


def test_without_ethtool_lro_is_unknown(tmp_path: Path, sysfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    write(sysfs / "class" / "net" / "eth1" / "mtu", "1500\n")
    lab = load_lab(lab_spec(tmp_path, '[network.lan]\nuplink = "eth1"\n' + vm()))
    finding = one(check_network(lab, sysfs), "net.lro")
    assert finding.status is Status.NOTE
    assert finding.fix == "apt-get install ethtool, then vmlaunch doctor again"


def test_a_missing_uplink_fails(tmp_path: Path, sysfs: Path) -> None:
    spec = lab_spec(tmp_path, '[network.lan]\nuplink = "eth9"\n' + vm())
    finding = one(check_network(load_lab(spec), sysfs), "net.uplink")
    assert finding.status is Status.FAIL and finding.found.startswith("the uplink eth9 of bridge ")


def test_mtu_mismatch_between_the_lab_and_its_uplink(tmp_path: Path, sysfs: Path, ethtool: Path) -> None:
    write(sysfs / "class" / "net" / "eth1" / "mtu", "1500\n")
    write(sysfs / "class" / "net" / "br7" / "mtu", "1500\n")
    spec = lab_spec(tmp_path, '[network.lan]\nbridge = "br7"\nuplink = "eth1"\nmtu = 9000\n' + vm())
    finding = one(check_network(load_lab(spec), sysfs), "net.mtu")
    assert finding.status is Status.WARN
    assert finding.found == ("eth1 has MTU 1500, the lab asks for 9000; bridge br7 exists with MTU 1500, "
                             "the lab asks for 9000")
    assert finding.fix == "ip link set eth1 mtu 9000" and finding.where == f"{spec}:6: network.lan.mtu"
    write(sysfs / "class" / "net" / "eth1" / "mtu", "9000\n")
    write(sysfs / "class" / "net" / "br7" / "mtu", "9000\n")
    assert one(check_network(load_lab(spec), sysfs), "net.mtu").status is Status.OK


# --- the lab -----------------------------------------------------------------------------------------


def lab_findings(spec: Path, check: str, **host: Any) -> list[Finding]:
    return [f for f in check_lab(load_lab(spec), fake_host(**host)) if f.id == check]


def test_memory_over_commit_against_80_percent(tmp_path: Path) -> None:
    spec = lab_spec(tmp_path, vm("a", "12G") + vm("b", "12G"))
    finding = one(lab_findings(spec, "lab.memory", memory_mib=24000))
    assert finding.status is Status.WARN
    assert finding.found == ("the lab's 2 VMs ask for 24G (24576 MiB) together, more than 80 % of the host's "
                             "23.4G (24000 MiB)")
    assert "balloon.policy" in (finding.fix or "")
    small = lab_spec(tmp_path, vm("a", "1G"))
    assert one(lab_findings(small, "lab.memory", memory_mib=24000)).status is Status.OK


def test_up_of_one_vm_notes_its_memory_and_doctor_the_labs(tmp_path: Path) -> None:
    """`up SPEC web` with memory = "1T": the note weighs web (the VM started), the doctor line the
    whole lab; each says which, in a form a human reads first."""
    from vmlaunch.compile.compiler import compile_lab

    lab = load_lab(lab_spec(tmp_path, vm("web", "1T") + vm("db", "256M")))
    host = fake_host(memory_mib=16000)
    assert compile_lab(lab, host, ["web"]).notes == (
        "VM web asks for 1T (1048576 MiB) of memory, more than 80% of the host's 15.6G (16000 MiB); "
        "ballooning and KSM help, swapping hurts every guest",)
    assert compile_lab(lab, host).notes == (
        "the lab's 2 VMs ask for 1024.2G (1048832 MiB) of memory together, more than 80% of the host's "
        "15.6G (16000 MiB); ballooning and KSM help, swapping hurts every guest",)
    assert one(check_lab(lab, host), "lab.memory").found == (
        "the lab's 2 VMs ask for 1024.2G (1048832 MiB) together, more than 80 % of the host's 15.6G "
        "(16000 MiB)")
    three = load_lab(lab_spec(tmp_path, vm("web", "1T") + vm("db", "256M") + vm("cache", "512M")))
    assert compile_lab(three, host, ["web", "db"]).notes[0].startswith(
        "the 2 VMs started (web, db) ask for 1024.2G (1048832 MiB) of memory together, more than 80%")


def test_a_budget_past_80_percent_warns_at_its_line(tmp_path: Path) -> None:
    auto = vm(extra='[vm.a.balloon]\npolicy = "auto"\n')
    spec = lab_spec(tmp_path, '[lab.memory]\nbudget = "20G"\n' + auto)
    finding = one(lab_findings(spec, "lab.memory", memory_mib=24000))
    assert finding.status is Status.WARN and finding.where == f"{spec}:4: lab.memory.budget"
    assert finding.fix == "lower lab.memory.budget"


def test_vcpus_beyond_the_hosts_cpus(tmp_path: Path) -> None:
    spec = lab_spec(tmp_path, vm("a", cpus=4) + vm("b", cpus=1))
    found = lab_findings(spec, "lab.vcpus", cpus=2)
    assert [(f.status, f.found) for f in found] == [
        (Status.WARN, "a: 4 vCPUs on a host with 2 CPUs"),
        (Status.NOTE, "5 vCPUs in all on 2 host CPUs: over-committed")]
    assert found[0].fix == "cpus = 2 or fewer" and found[0].where == f"{spec}:5: vm.a.cpus"
    assert "fewest vCPUs" in found[0].why
    assert one(lab_findings(lab_spec(tmp_path, vm()), "lab.vcpus", cpus=2)).status is Status.OK


def test_sparse_images_that_outgrow_their_file_system(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    subprocess.run(["truncate", "-s", "40G", str(tmp_path / "big.img")], check=True)
    spec = lab_spec(tmp_path, vm(extra='[[vm.a.disk]]\nfile = "big.img"\n[[vm.a.disk]]\nfile = "new.img"\n'
                                      'size = "30G"\n'))
    real = os.statvfs

    class Vfs:
        f_frsize = 4096
        f_bavail = (50 << 30) // 4096

    monkeypatch.setattr(os, "statvfs",
                        lambda path: Vfs() if str(path).startswith(str(tmp_path)) else real(path))
    finding = one(lab_findings(spec, "lab.disk_space"))
    assert finding.status is Status.WARN
    assert "(a big.img, a new.img) may still grow by 70.0G; it has 50.0G free" in finding.found
    Vfs.f_bavail = (100 << 30) // 4096
    assert one(lab_findings(spec, "lab.disk_space")).status is Status.OK


def test_cache_none_on_a_file_system_without_o_direct(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder whose file system refuses O_DIRECT (tmpfs did before Linux 6.6, some FUSE ones do): the
    kernel's answer, EINVAL, stood in for by a fake `open`."""
    import errno

    refusing = tmp_path / "nodirect"
    refusing.mkdir()
    (refusing / "disk.img").write_bytes(bytes(1 << 20))
    real_open = os.open

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT and str(path).startswith(str(refusing)):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    spec = lab_spec(tmp_path, vm(extra='[[vm.a.disk]]\nfile = "nodirect/disk.img"\n'))
    finding = one(lab_findings(spec, "lab.o_direct"))
    assert finding.status is Status.FAIL and finding.where == f"{spec}:7: vm.a.disk[0].cache"
    assert "cannot do O_DIRECT (Invalid argument), and cache = \"none\" needs it" in finding.found
    assert finding.fix is not None and finding.fix.startswith("cache = \"writeback\" for this disk")
    new = lab_spec(tmp_path, vm(extra='[[vm.a.disk]]\nfile = "nodirect/new.img"\nsize = "1G"\n'))
    assert one(lab_findings(new, "lab.o_direct")).status is Status.FAIL  # its folder is probed
    written = lab_spec(tmp_path, vm(extra='[[vm.a.disk]]\nfile = "nodirect/disk.img"\ncache = "writeback"\n'))
    assert lab_findings(written, "lab.o_direct") == []  # no O_DIRECT asked
    on_disk = lab_spec(tmp_path, vm(extra='[[vm.a.disk]]\nfile = "disk.img"\nsize = "1G"\n'))
    assert lab_findings(on_disk, "lab.o_direct") == []
    assert not list(tmp_path.glob(".vmlaunch-o-direct-*"))  # the probe file is gone


def partitioned(path: Path, script: str, fmt: str = "raw", ext3_at: int | None = None) -> Path:
    raw = path.with_suffix(".raw")
    subprocess.run(["truncate", "-s", "64M", str(raw)], check=True)
    subprocess.run(["sfdisk", "-q", str(raw)], input=script, text=True, check=True, capture_output=True)
    if ext3_at is not None:
        subprocess.run(["mkfs.ext3", "-q", "-F", "-E", f"offset={ext3_at * 512}", str(raw), "8M"], check=True,
                       capture_output=True)
    if fmt == "raw":
        raw.rename(path)
    else:
        subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(path)], check=True)
        raw.unlink()
    return path


needs_sfdisk = pytest.mark.skipif(not shutil.which("sfdisk") or not shutil.which("qemu-io"),
                                  reason="needs sfdisk and qemu-io")


@needs_sfdisk
@pytest.mark.parametrize("fmt", ["raw", "qcow2"])
def test_misaligned_partitions_are_found_through_qemu(tmp_path: Path, fmt: str) -> None:
    dos = ("label: dos\nstart=63, size=20000, type=83\nstart=40960, type=5\n"
           "start=43008, size=8192, type=83\nstart=53249, size=4096, type=83\n")
    bad = partitioned(tmp_path / f"bad.{fmt}", dos, fmt)
    gpt = "label: gpt\nstart=2048, size=20480\nstart=22528, size=4096\n"
    good = partitioned(tmp_path / f"good.{fmt}", gpt, fmt)
    disks = f'[[vm.a.disk]]\nfile = "bad.{fmt}"\n[[vm.a.disk]]\nfile = "good.{fmt}"\n'
    spec = lab_spec(tmp_path, vm(extra=disks))
    warn, ok = lab_findings(spec, "lab.alignment")
    assert warn.status is Status.WARN and warn.where == f"{spec}:7: vm.a.disk[0]"
    assert warn.found == f"a: bad.{fmt} (MBR): partition 1 at sector 63, 6 at sector 53249: not 4 KiB aligned"
    assert "multiple of 8 sectors" in (warn.fix or "") and "two partial ones" in warn.why
    assert ok.status is Status.OK and ok.found == f"a: good.{fmt} (GPT): 2 partitions, all 4 KiB aligned"
    assert layout(Reader(good, fmt)).table == "gpt"
    assert cached_layout(bad, fmt).partitions[2].start == 53249  # from the cache the first read left


@needs_sfdisk
def test_a_gpt_header_never_decides_how_much_is_read(tmp_path: Path) -> None:
    """A guest wrote a GPT header whose entries are far into the disk: refused, not read up to there."""
    import struct

    image = partitioned(tmp_path / "gpt.img", "label: gpt\nstart=2048, size=20480\n")
    with open(image, "r+b") as file:
        file.seek(512 + 72)
        file.write(struct.pack("<Q", 100_000))
    found = layout(Reader(image, "raw"))
    assert found.table == "none" and "at sector 100000" in (found.error or "")


def test_doctor_does_not_open_a_fifo_named_as_a_disk(tmp_path: Path) -> None:
    """validate says what it is; doctor must not hang on it either."""
    import sys

    os.mkfifo(tmp_path / "disk.img")
    (tmp_path / "vmlinuz").write_bytes(b"a kernel")
    spec = lab_spec(tmp_path, vm(extra='[[vm.a.disk]]\nfile = "disk.img"\n'))
    done = subprocess.run([sys.executable, "-m", "vmlaunch", "doctor", str(spec), "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    found = [f for f in json.loads(done.stdout)["lab"] if f["id"] == "lab.disk_file"]
    assert found == [{"id": "lab.disk_file", "status": "fail",
                      "found": f"a: {tmp_path}/disk.img is a FIFO, not a file",
                      "why": "QEMU opens a disk's file as an image: up refuses anything else",
                      "fix": "name an image file", "where": f"{spec}:8: vm.a.disk[0].file"}]


@needs_sfdisk
def test_writeback_over_an_ext3_file_system_warns(tmp_path: Path) -> None:
    partitioned(tmp_path / "old.img", "label: dos\nstart=2048, size=20480, type=83\n", ext3_at=2048)
    spec = lab_spec(tmp_path, vm(extra='[[vm.a.disk]]\nfile = "old.img"\ncache = "writeback"\n'))
    finding = one(lab_findings(spec, "lab.cache"))
    assert finding.status is Status.WARN
    assert finding.found == 'a: old.img holds an ext3 file system (partition 1), and cache = "writeback"'
    assert finding.fix == 'cache = "none"; or mount it with barrier=1 in the guest'
    assert "write barriers" in finding.why and finding.where == f"{spec}:9: vm.a.disk[0].cache"


@pytest.mark.parametrize("extra, status, words", [
    ('cache = "writeback"\nbus = "sata"\n', Status.WARN, 'cache = "writeback" on a SATA disk'),
    ('cache = "writeback"\n', Status.NOTE, 'cache = "writeback" on plain.img'),
    ('cache = "unsafe"\naccept_data_loss = true\n', Status.WARN, "the guest's flushes are ignored"),
])
def test_cache_modes(tmp_path: Path, extra: str, status: Status, words: str) -> None:
    (tmp_path / "plain.img").write_bytes(bytes(1 << 20))
    spec = lab_spec(tmp_path, vm(extra=f'[[vm.a.disk]]\nfile = "plain.img"\n{extra}'))
    finding = one(lab_findings(spec, "lab.cache"))
    assert finding.status is status and words in finding.found


def test_pci_groups_and_pci_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSysfs(tmp_path / "sys")
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(fake.root))
    fake.add("0000:15:00.0", group=1)
    fake.add("0000:15:00.1", group=1, driver="e1000")  # in use by the host: the group is not viable
    fake.add("0000:16:00.0", group=2)
    spec = lab_spec(tmp_path, vm(extra='[[vm.a.pci]]\nhost = "15:00.0"\n[[vm.a.pci]]\nhost = "16:00.0"\n'
                                      'driver = "pci-stub"\n[[vm.a.pci]]\nhost = "99:00.0"\n'))
    findings = list(check_lab(load_lab(spec), fake_host()))
    groups = [f for f in findings if f.id == "lab.pci_iommu"]
    assert [f.status for f in groups] == [Status.FAIL, Status.OK]
    assert "0000:15:00.1" in groups[0].found and groups[0].where == f"{spec}:7: vm.a.pci[0]"
    stub = one(findings, "lab.pci_stub")
    assert stub.status is Status.FAIL and stub.fix == 'driver = "vfio-pci"'
    missing = one(findings, "lab.pci")
    assert "no such device" in missing.found and missing.fix == "name one `lspci -D` lists"


def test_hugepages_with_ksm_and_too_few_free(tmp_path: Path, sysfs: Path) -> None:
    folder = sysfs / "kernel" / "mm" / "hugepages" / "hugepages-2048kB"
    write(folder / "free_hugepages", "10\n")
    write(folder / "nr_hugepages", "10\n")
    spec = lab_spec(tmp_path, '[lab.memory]\nksm = true\n' + vm(extra='hugepages = "2M"\n'))
    findings = list(check_lab(load_lab(spec), fake_host(hugepage_sizes_kib=frozenset({2048}))))
    merged = one(findings, "lab.hugepages_ksm")
    assert merged.status is Status.NOTE and "its memory is never merged" in merged.found
    short = one(findings, "lab.hugepages")
    assert short.status is Status.FAIL and short.found == "a needs 128 2M hugepages, the host has 10 free"
    assert short.fix == f"reserve_hugepages = true, or echo N > {folder / 'nr_hugepages'}"


def test_what_up_would_refuse_is_a_failure_with_its_line(tmp_path: Path) -> None:
    spec = lab_spec(tmp_path, vm(extra="numa_node = 3\n"))
    two = Topology((NumaNode(0, (0,), 4096, 2048), NumaNode(1, (1,), 4096, 1024)))
    finding = one(lab_findings(spec, "lab.host", numa=two))
    assert finding.status is Status.FAIL and finding.found == "this host has no NUMA node 3 (its nodes: 0, 1)"
    assert finding.where == f"{spec}:7: vm.a.numa_node"


# --- the command -------------------------------------------------------------------------------------


def test_render_and_one_line() -> None:
    findings = [Finding("host.x", Status.OK, "fine"),
                Finding("lab.y", Status.WARN, "not fine", "because", "do this", "lab.toml:3: vm.a")]
    lines = render([("host", findings)])
    assert lines[0] == "host" and lines[1].split() == ["ok", "host.x", "fine"]
    assert "at:  lab.toml:3: vm.a" in lines[3]
    assert lines[-1] == "2 checks: 1 ok, 0 notes, 1 warnings, 0 failures"
    assert one_line(findings[1]) == "warn lab.y: lab.toml:3: vm.a: not fine (fix: do this)"


def test_doctor_exits_1_when_something_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = lab_spec(tmp_path, vm(extra='[[vm.a.pci]]\nhost = "99:00.0"\n'))
    assert main(["doctor", str(spec), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["failed"] is True and any(f["id"] == "lab.pci" and f["status"] == "fail" for f in doc["lab"])
    assert {f["id"] for f in doc["host"]} >= {"host.qemu", "host.kvm", "host.memory", "host.disk_space"}
    assert main(["doctor"]) == 0  # this machine's host: nothing fails
    out = capsys.readouterr().out
    assert out.startswith("host\n") and "host.kvm" in out


def test_up_prints_the_lab_checks_that_warn(tmp_path: Path) -> None:
    spec = lab_spec(tmp_path, vm("a", cpus=4))
    warnings = lab_warnings(load_lab(spec), fake_host(cpus=2))
    assert [one_line(f) for f in warnings] == [
        f"warn lab.vcpus: {spec}:5: vm.a.cpus: a: 4 vCPUs on a host with 2 CPUs (fix: cpus = 2 or fewer)"]

