"""The host's checks: what vmlaunch and its guests get from this machine."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from vmlaunch.core.units import format_size, human_size
from vmlaunch.doctor.findings import GUIDE, NUMA_TALK, PASSTHROUGH, Finding, Status
from vmlaunch.host.facts import Host

GOOD_SCHEDULERS = {"mq-deadline", "deadline", "none", "noop"}
MEMORY_TARGET = 0.8  # the guide: target system use at 80 % or lower
DISK_LOW = 2 << 30  # free space on the image folder's file system under which guests risk a full disk
DISK_FULL = 512 << 20


def read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def chosen(text: str | None) -> str | None:
    """The bracketed choice of a sysfs setting: "always [madvise] never" -> "madvise"."""
    if text is None:
        return None
    if "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text.split()[0] if text.split() else None


def check_qemu(host: Host | None, problem: str | None) -> Iterator[Finding]:
    if host is None:
        yield Finding("host.qemu", Status.FAIL, f"QEMU: {problem}", "vmlaunch runs every VM with QEMU",
                      "apt-get install qemu-system-x86 qemu-utils (`make setup` does)")
        return
    yield Finding("host.qemu", Status.OK, f"QEMU {host.qemu.version_text} at {host.qemu.binary}")


def check_kvm(host: Host, sysfs: Path) -> Iterator[Finding]:
    kvm = host.kvm
    if kvm.usable:
        yield Finding("host.kvm", Status.OK, kvm.reason)
        return
    why = ("without KVM every guest runs under TCG, QEMU's emulator: correct, but many times slower "
           f"({GUIDE}: KVM is the hypervisor; vmlaunch's accel = \"auto\" falls back to TCG)")
    if "no /dev/kvm" in kvm.reason:
        loaded = (sysfs / "module" / "kvm").exists()
        fix = ("enable virtualisation (VT-x / AMD-V) in the firmware" if loaded else
               "modprobe kvm_intel (or kvm_amd), after enabling VT-x / AMD-V in the firmware")
    elif "not readable and writable" in kvm.reason:
        fix = "add the user to group kvm: usermod -aG kvm USER (then log in again)"
    elif "did not reach 64-bit mode" in kvm.reason:
        fix = ("nothing to do here: this KVM does not run ordinary guests, TCG does (accel = \"auto\"); "
               "on bare metal, or with nested virtualisation exposing VMX/SVM, KVM works")
    else:
        fix = ("QEMU's message says why; until then accel = \"auto\" runs guests under TCG "
               "(accel = \"tcg\" says so in the spec)")
    yield Finding("host.kvm", Status.WARN, f"KVM does not run a guest here: {kvm.reason}", why, fix)


def check_vhost_net(host: Host, sysfs: Path) -> Iterator[Finding]:
    if host.vhost_net or (sysfs / "class" / "misc" / "vhost-net").exists():
        yield Finding("host.vhost_net", Status.OK,
                      "/dev/vhost-net: virtio-net's data path runs in the kernel")
        return
    yield Finding("host.vhost_net", Status.NOTE, "no /dev/vhost-net: virtio-net's packets go through QEMU",
                  "vhost-net moves the data path of virtio-net into the host kernel: lower latency and more "
                  "throughput on tap networks (vmlaunch turns it on when the device exists)",
                  "modprobe vhost_net")


def check_io_uring(host: Host, proc: Path) -> Iterator[Finding]:
    if host.qemu.io_uring:
        yield Finding("host.io_uring", Status.OK, "QEMU opens images with aio=io_uring (vmlaunch's default)")
        return
    disabled = read(proc / "sys" / "kernel" / "io_uring_disabled")
    found = ("io_uring is turned off (kernel.io_uring_disabled = " + disabled + ")"
             if disabled not in (None, "0") else "this QEMU or kernel cannot use io_uring")
    yield Finding("host.io_uring", Status.NOTE, f"{found}: disks use aio=native (O_DIRECT) or threads",
                  "measured here: io_uring 0.26 s, native 0.41 s, threads with cache=none 1.92 s for the "
                  "same 4k random writes (the manual: Why these defaults)",
                  "sysctl kernel.io_uring_disabled=0" if disabled not in (None, "0")
                  else "a kernel of 5.1 or later and a QEMU built with liburing")


def check_iommu(sysfs: Path, proc: Path) -> Iterator[Finding]:
    groups = sysfs / "kernel" / "iommu_groups"
    try:
        count = len(os.listdir(groups))
    except OSError:
        count = 0
    if count:
        yield Finding("host.iommu", Status.OK, f"IOMMU on: {count} IOMMU groups")
        return
    cmdline = read(proc / "cmdline") or ""
    asked = [word for word in cmdline.split() if word.startswith(("intel_iommu=", "amd_iommu="))]
    yield Finding("host.iommu", Status.NOTE,
                  "no IOMMU groups: PCI devices cannot be passed through"
                  + (f" ({' '.join(asked)} is on the kernel command line)" if asked else ""),
                  f"vfio-pci hands a device to a guest only behind an IOMMU ({PASSTHROUGH})",
                  "enable VT-d / AMD-Vi in the firmware and boot with intel_iommu=on iommu=pt "
                  "(or amd_iommu=on)")


def check_hugepages(host: Host, sysfs: Path) -> Iterator[Finding]:
    if not host.hugepage_sizes_kib:
        yield Finding("host.hugepages", Status.NOTE, "the kernel offers no hugepages",
                      "guest RAM on hugepages (vm.V.hugepages) has fewer TLB misses and is never swapped",
                      "a kernel with CONFIG_HUGETLBFS")
        return
    parts = []
    for kib in sorted(host.hugepage_sizes_kib):
        folder = sysfs / "kernel" / "mm" / "hugepages" / f"hugepages-{kib}kB"
        nr, free = read(folder / "nr_hugepages"), read(folder / "free_hugepages")
        parts.append(f"{format_size(kib << 10)}: {nr or '?'} reserved, {free or '?'} free")
    yield Finding("host.hugepages", Status.OK, "hugepages " + "; ".join(parts),
                  "a VM with hugepages = \"2M\" takes its RAM from the free ones (reserve_hugepages raises "
                  "the pool for it)")


def check_ksm(host: Host, sysfs: Path) -> Iterator[Finding]:
    folder = sysfs / "kernel" / "mm" / "ksm"
    if host.ksm is None:
        yield Finding("host.ksm", Status.NOTE, "the kernel has no KSM",
                      f"KSM merges the pages identical guests hold alike ({GUIDE})",
                      "a kernel with CONFIG_KSM")
        return
    run = read(folder / "run")
    if run == "1":
        yield Finding("host.ksm", Status.OK, f"KSM runs: {read(folder / 'pages_to_scan')} pages every "
                      f"{read(folder / 'sleep_millisecs')} ms, {read(folder / 'pages_sharing')} pages "
                      "sharing")
        return
    how = ("vmlaunch turns it on while a lab of two VMs or more runs (lab.memory.ksm)" if host.ksm.writable
           else "as root, vmlaunch turns it on while a lab of two VMs or more runs; or an administrator: "
           "echo 1 > /sys/kernel/mm/ksm/run")
    yield Finding("host.ksm", Status.NOTE, "KSM is off", f"KSM merges the pages identical guests hold "
                  f"alike: the guide's first way to over-commit memory ({GUIDE})", how)


def check_numa(host: Host) -> Iterator[Finding]:
    topology = host.numa
    if topology is None:
        return
    how = host.cpusets.describe() if host.cpusets else "sched_setaffinity (no cpuset cgroups: no balancing)"
    if topology.multi_node:
        yield Finding("host.numa", Status.OK, f"{len(topology.nodes)} NUMA nodes ({topology.describe()}); "
                      f"vmlaunch places each VM on one, through {how}",
                      f"a VM spread over nodes reads remote memory ({NUMA_TALK})")
        return
    yield Finding("host.numa", Status.OK, f"one NUMA node ({topology.describe()}): nothing to place")


def check_thp(sysfs: Path) -> Iterator[Finding]:
    enabled = chosen(read(sysfs / "kernel" / "mm" / "transparent_hugepage" / "enabled"))
    if enabled is None:
        return
    if enabled in ("always", "madvise"):
        yield Finding("host.thp", Status.OK,
                      f"transparent hugepages: {enabled} (QEMU asks for them on guest RAM)")
        return
    yield Finding("host.thp", Status.WARN, f"transparent hugepages: {enabled}",
                  "QEMU asks for transparent hugepages on guest RAM (madvise); with them off, every guest "
                  "memory access walks 4 KiB pages: more TLB misses",
                  "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled")


def block_device(path: Path, sysfs: Path) -> tuple[str, Path] | None:
    """The disk a path's file system lives on: (name, its sysfs folder), following partitions and
    device-mapper/md to the first disk below; None for a file system on no block device (tmpfs)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    folder = sysfs / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        real = folder.resolve(strict=True)
    except OSError:
        return None
    for _ in range(8):
        if (real / "partition").exists():
            real = real.parent
            continue
        slaves = sorted((real / "slaves").iterdir()) if (real / "slaves").is_dir() else []
        if slaves and not (real / "queue" / "scheduler").exists():
            real = slaves[0].resolve()
            continue
        break
    return real.name, real


def check_io_scheduler(folders: Sequence[Path], sysfs: Path) -> Iterator[Finding]:
    seen: set[str] = set()
    for folder in folders:
        found = block_device(folder, sysfs)
        if found is None:
            continue
        name, device = found
        if name in seen:
            continue
        seen.add(name)
        scheduler = chosen(read(device / "queue" / "scheduler"))
        if scheduler is None:
            continue
        why = (f"many guests on one disk: the guide measured the Deadline scheduler best ({GUIDE}); today "
               "mq-deadline, or none on fast SSDs and NVMe")
        if scheduler in GOOD_SCHEDULERS:
            yield Finding("host.io_scheduler", Status.OK, f"{name} (holding {folder}): {scheduler}", why)
        else:
            yield Finding("host.io_scheduler", Status.NOTE if scheduler in ("bfq", "kyber") else Status.WARN,
                          f"{name} (holding {folder}): {scheduler}", why,
                          f"echo mq-deadline > /sys/block/{name}/queue/scheduler (a udev rule keeps it)")


def check_memory() -> Iterator[Finding]:
    from vmlaunch.host.memory import meminfo

    info = meminfo()
    if info is None:
        return
    used = 1 - info.available / info.total
    found = f"{human_size(info.available)} of {human_size(info.total)} available ({used:.0%} in use)"
    why = f"target system use at 80 % or lower: beyond it swapping and reclaim slow every guest ({GUIDE})"
    if used > MEMORY_TARGET:
        yield Finding("host.memory", Status.WARN, found, why,
                      "stop or shrink guests (vmlaunch balloon, balloon.policy = \"auto\"), or add memory")
        return
    yield Finding("host.memory", Status.OK, found, why)


def check_disk_space(folders: Sequence[Path]) -> Iterator[Finding]:
    seen: set[int] = set()
    for folder in folders:
        try:
            st, vfs = os.stat(folder), os.statvfs(folder)
        except OSError:
            continue
        if st.st_dev in seen:
            continue
        seen.add(st.st_dev)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
        found = f"{human_size(free)} free of {human_size(total)} on the file system of {folder}"
        why = (f"sparse images grow as guests write; a full file system stops every guest on it ({GUIDE})")
        if free < DISK_FULL:
            yield Finding("host.disk_space", Status.FAIL, found, why, f"free space on {folder}'s file system")
        elif free < DISK_LOW or free < total // 10:
            yield Finding("host.disk_space", Status.WARN, found, why, f"free space on {folder}'s file system")
        else:
            yield Finding("host.disk_space", Status.OK, found, why)

