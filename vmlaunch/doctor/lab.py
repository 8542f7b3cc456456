"""A lab's checks: what its spec asks of this host, against the seeds' advice."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from vmlaunch.core.units import format_size, human_size, mib_words
from vmlaunch.doctor.findings import CACHE_STUDY, GUIDE, PASSTHROUGH, Finding, Status, where
from vmlaunch.errors import KeyPath
from vmlaunch.host.facts import Host
from vmlaunch.spec.model import (
    BUDGET_SHARE,
    BalloonPolicy,
    CacheMode,
    DiskBus,
    DiskFormat,
    LabSpec,
    PciDriver,
    VmSpec,
    balloon_min_mib,
)


@attrs.frozen
class DiskFile:
    """An image a VM of the lab uses (or will: `exists` False), with the spec key that names it."""

    vm: str
    key: KeyPath
    path: Path
    format: DiskFormat
    cache: CacheMode
    bus: DiskBus
    size: int | None  # the virtual size, when known
    exists: bool
    readonly: bool = False


def disk_files(lab: LabSpec) -> list[DiskFile]:
    from vmlaunch.layout.labdir import LabDir

    files = []
    lab_dir = LabDir.of(lab.file, lab.name)
    for vm in lab.vms:
        if vm.image is not None:
            overlay = lab_dir.vm(vm.name).overlay
            size = vm.disk_size
            exists = overlay.exists()
            if exists:
                from vmlaunch.guests.images import image_info  # only here: `up` of a lab without images

                with contextlib.suppress(Exception):
                    size = image_info(overlay, DiskFormat.QCOW2).virtual_size if not vm.disk_size else size
            files.append(DiskFile(vm.name, ("vm", vm.name, "image"), overlay, DiskFormat.QCOW2,
                                  CacheMode.NONE, DiskBus.VIRTIO, size, exists))
        for index, disk in enumerate(vm.disks):
            exists = disk.file.is_file() or (disk.block_device and disk.file.is_block_device())
            size = disk.size  # (a FIFO is not opened: it would hang; validate says what it is)
            if exists and not disk.block_device:
                from vmlaunch.guests.images import image_info

                with contextlib.suppress(Exception):
                    size = image_info(disk.file, disk.format).virtual_size
            files.append(DiskFile(vm.name, ("vm", vm.name, "disk", index), disk.file, disk.format, disk.cache,
                                  disk.bus, size, exists, disk.readonly))
    return files


def check_lab(lab: LabSpec, host: Host, *, read_images: bool = True,
              compile: bool = True) -> Iterator[Finding]:
    if compile:
        yield from check_compiles(lab, host)
    yield from check_memory(lab, host)
    yield from check_vcpus(lab, host)
    files = disk_files(lab)
    yield from check_disk_files(lab)
    yield from check_disk_space(lab, files)
    yield from check_o_direct(lab, files)
    yield from check_cache(lab, files, read_images)
    if read_images:
        yield from check_alignment(lab, files, host)
    yield from check_pci(lab, host)
    yield from check_hugepages(lab, host)
    yield from check_confined(lab, host)


CONFINE_WHY = ("a guest that escapes into its QEMU must find neither root nor another VM's files: "
               "test rigs run code nobody reviewed in their guests (libvirt runs each QEMU as its own "
               "user in a seccomp sandbox)")


def check_confined(lab: LabSpec, host: Host) -> Iterator[Finding]:
    """Every running QEMU of the lab in a seccomp sandbox and, in a lab run as root, under a uid of its
    own: read from each one's /proc/PID/status (Uid, Seccomp)."""
    from vmlaunch.errors import VmlaunchError
    from vmlaunch.host.confine import Confinement
    from vmlaunch.lab import process as qemu
    from vmlaunch.lab.journal import Journal
    from vmlaunch.layout.rundir import RunDir

    run_dir = RunDir.of(host.run_root, lab.name)
    try:
        journal = Journal.load(run_dir)
    except VmlaunchError:
        return  # `status` says what is wrong with it
    seen: dict[str, Confinement] = {}
    for name, entry in journal.vms.items():
        pid = qemu.find_pid(run_dir.vm(name), entry.pid)
        if pid is not None:
            seen[name] = Confinement.of(pid)
    if not seen:
        return
    problems = [f"{name}: {problem}" for name, confined in seen.items()
                for problem in confined.problems(as_root=host.as_root)]
    uids = [confined.uid for confined in seen.values()]
    if host.as_root and len(set(uids)) < len(uids):
        problems.append(f"VMs share a uid ({', '.join(map(str, uids))})")
    if problems:
        yield Finding("lab.confined", Status.FAIL, "; ".join(problems), CONFINE_WHY,
                      "take the lab down and up again with VMLAUNCH_CONFINE unset")
        return
    owners = ", ".join(f"{name} uid {confined.uid}" for name, confined in seen.items())
    yield Finding("lab.confined", Status.OK, f"every running QEMU of the lab is in a seccomp sandbox "
                  f"({owners})", CONFINE_WHY)


def check_compiles(lab: LabSpec, host: Host) -> Iterator[Finding]:
    """What `up` would refuse on this host (a node or CPU it lacks, KSM without root, a device QEMU
    lacks): the compiler's own answer."""
    from vmlaunch.compile.compiler import compile_lab
    from vmlaunch.errors import VmlaunchError

    try:
        compile_lab(lab, host)
    except VmlaunchError as exc:
        location = getattr(exc, "location", None)
        yield Finding("lab.host", Status.FAIL, exc.message.removeprefix(f"{location} ") if location else
                      exc.message, "up would refuse to start the lab on this host (exit 3)", exc.hint,
                      str(location).rstrip(":") if location else None)


def check_memory(lab: LabSpec, host: Host) -> Iterator[Finding]:
    from vmlaunch.host.memory import meminfo

    auto = any(vm.balloon.enabled and vm.balloon.policy is BalloonPolicy.AUTO for vm in lab.vms)
    total = sum(vm.memory_mib for vm in lab.vms)
    target = int(host.memory_mib * BUDGET_SHARE)
    why = (f"target system use at 80 % or lower, and over-commit memory with page sharing (KSM) or "
           f"ballooning rather than swapping ({GUIDE})")
    vms = f"the lab's {len(lab.vms)} VMs" if len(lab.vms) != 1 else f"the lab's one VM, {lab.vms[0].name},"
    together = " together" if len(lab.vms) != 1 else ""
    of_host = f"of the host's {mib_words(host.memory_mib)}"
    if auto:
        budget = lab.memory.budget_mib or target
        floors = sum(balloon_min_mib(vm) if vm.balloon.policy is BalloonPolicy.AUTO else vm.memory_mib
                     for vm in lab.vms)
        within = (f"{vms} may grow to {mib_words(total)}{together}; the lab manager keeps them within a "
                  f"budget of {mib_words(budget)}")
        found = f"{within}, never below {format_size(floors << 20)}"
        if budget > target:
            yield Finding("lab.memory", Status.WARN, f"{within}, more than 80 % {of_host}", why,
                          "lower lab.memory.budget", where(lab, ("lab", "memory", "budget")))
            return
    else:
        asked = f"{vms} ask{'s' if len(lab.vms) == 1 else ''} for {mib_words(total)}{together}"
        found = f"{asked}, {of_host}"
        if total > target:
            yield Finding("lab.memory", Status.WARN, f"{asked}, more than 80 % {of_host}", why,
                          "balloon.policy = \"auto\" with a lab.memory.budget, KSM (lab.memory.ksm), or "
                          "smaller VMs")
            return
    info = meminfo()
    need = (lab.memory.budget_mib or target) if auto else total
    if info is not None and (need << 20) > info.available:
        yield Finding("lab.memory", Status.WARN, f"{found}; the host has {human_size(info.available)} "
                      "available now", why, "stop other guests or programs, or shrink the lab")
        return
    yield Finding("lab.memory", Status.OK, found, why)


def check_vcpus(lab: LabSpec, host: Host) -> Iterator[Finding]:
    why = (f"allocate the fewest vCPUs that do the job: an idle vCPU still costs the host scheduling, and "
           f"more vCPUs than CPUs contend ({GUIDE})")
    for vm in lab.vms:
        if vm.cpus > host.cpus:
            yield Finding("lab.vcpus", Status.WARN, f"{vm.name}: {vm.cpus} vCPUs on a host with {host.cpus} "
                          "CPUs", why, f"cpus = {host.cpus} or fewer", where(lab, ("vm", vm.name, "cpus")))
    total = sum(vm.cpus for vm in lab.vms)
    if total > host.cpus:
        yield Finding("lab.vcpus", Status.NOTE,
                      f"{total} vCPUs in all on {host.cpus} host CPUs: over-committed",
                      why + "; fine while they are mostly idle, slow when they are all busy")
    elif not any(vm.cpus > host.cpus for vm in lab.vms):
        yield Finding("lab.vcpus", Status.OK, f"{total} vCPUs in all on {host.cpus} host CPUs", why)


def check_disk_files(lab: LabSpec) -> Iterator[Finding]:
    """A disk that is no image file (a FIFO, a folder, a device): `validate` and `up` refuse it, in
    these words; the other checks leave it unopened."""
    from vmlaunch.compile.preflight import not_a_file

    for vm in lab.vms:
        for index, disk in enumerate(vm.disks):
            try:
                mode = os.stat(disk.file).st_mode
            except OSError:
                continue  # missing: `up` creates a disk with a size
            problem = not_a_file(disk.file, mode, disk=True, device_ok=disk.block_device)
            if problem is not None:
                message, fix = problem
                yield Finding("lab.disk_file", Status.FAIL, f"{vm.name}: {message}",
                              "QEMU opens a disk's file as an image: up refuses anything else",
                              fix or "name an image file", where(lab, ("vm", vm.name, "disk", index, "file")))


def check_disk_space(lab: LabSpec, files: Sequence[DiskFile]) -> Iterator[Finding]:
    """Sparse images may grow to their virtual size: do they fit what their file system has free?"""
    growth: dict[int, tuple[Path, int, list[str]]] = {}
    for disk in files:
        if disk.readonly or disk.size is None:
            continue
        folder = disk.path if disk.exists else disk.path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            st = os.stat(disk.path) if disk.exists else None
            device = (st or os.stat(folder)).st_dev
        except OSError:
            continue
        if st is not None and not stat.S_ISREG(st.st_mode):
            continue  # a block device: nothing grows
        allocated = st.st_blocks * 512 if st is not None else 0
        grow = max(0, disk.size - allocated)
        path, total, names = growth.get(device, (folder, 0, []))
        growth[device] = (path, total + grow, [*names, f"{disk.vm} {disk.path.name}"])
    why = (f"sparse images over-commit disk space: when they grow past the free space of their file system, "
           f"every guest writing to it stops ({GUIDE})")
    for path, total, names in growth.values():
        try:
            vfs = os.statvfs(path if path.is_dir() else path.parent)
        except OSError:
            continue
        free = vfs.f_bavail * vfs.f_frsize
        found = (f"the images on {path if path.is_dir() else path.parent}'s file system ({', '.join(names)}) "
                 f"may still grow by {human_size(total)}; it has {human_size(free)} free")
        if total > free:
            yield Finding("lab.disk_space", Status.WARN, found, why,
                          "free space there, move the images to a larger file system, or make them smaller")
        else:
            yield Finding("lab.disk_space", Status.OK, found, why)


def o_direct(path: Path, exists: bool) -> str | None:
    """None when the file (or a new file in its folder) opens with O_DIRECT; else why not."""
    if exists:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            return exc.strerror if exc.errno == errno.EINVAL else None
        os.close(fd)
        return None
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    probe = folder / f".vmlaunch-o-direct-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return exc.strerror if exc.errno == errno.EINVAL else None
    os.close(fd)
    with contextlib.suppress(OSError):
        probe.unlink()
    return None


def check_o_direct(lab: LabSpec, files: Sequence[DiskFile]) -> Iterator[Finding]:
    for disk in files:
        if not disk.cache.direct:
            continue
        problem = o_direct(disk.path, disk.exists)
        if problem is not None:
            yield Finding("lab.o_direct", Status.FAIL,
                          f"{disk.vm}: {disk.path} is on a file system that cannot do O_DIRECT ({problem}), "
                          f"and cache = \"{disk.cache.value}\" needs it",
                          "QEMU opens the image with O_DIRECT for cache = \"none\" and \"directsync\" and "
                          "refuses to start on a file system without it (tmpfs, some FUSE file systems)",
                          "cache = \"writeback\" for this disk, or the image on a disk-backed file system",
                          where(lab, (*disk.key, "cache") if disk.key[2] == "disk" else disk.key))


def check_cache(lab: LabSpec, files: Sequence[DiskFile], read_images: bool) -> Iterator[Finding]:
    for disk in files:
        if disk.cache not in (CacheMode.WRITEBACK, CacheMode.UNSAFE) or disk.readonly:
            continue
        at = where(lab, (*disk.key, "cache"))
        if disk.cache is CacheMode.UNSAFE:
            yield Finding("lab.cache", Status.WARN, f"{disk.vm}: cache = \"unsafe\" on {disk.path.name}: "
                          "the guest's flushes are ignored", "a host crash loses what the guest thinks it "
                          f"wrote, whatever the guest does ({CACHE_STUDY})",
                          "cache = \"none\" unless the data is disposable", at)
            continue
        old = None
        if read_images and disk.exists:
            old = ext3_partitions(disk)
        why = ("with cache = \"writeback\" the host caches the guest's writes: safe only when the guest "
               "sends flushes (write barriers); ext4 and xfs do by default, ext3 and older guests often did "
               f"not ({CACHE_STUDY})")
        if old:
            yield Finding("lab.cache", Status.WARN, f"{disk.vm}: {disk.path.name} holds an ext3 file system "
                          f"(partition {', '.join(map(str, old))}), and cache = \"writeback\"", why,
                          "cache = \"none\"; or mount it with barrier=1 in the guest", at)
        elif disk.bus is DiskBus.SATA:
            yield Finding("lab.cache", Status.WARN, f"{disk.vm}: cache = \"writeback\" on a SATA disk (the "
                          "bus for guests without virtio, often old ones)", why,
                          "cache = \"none\", unless the guest's file systems use barriers", at)
        else:
            yield Finding("lab.cache", Status.NOTE, f"{disk.vm}: cache = \"writeback\" on {disk.path.name}",
                          why, "cache = \"none\" if the guest's file systems run without barriers", at)


def ext3_partitions(disk: DiskFile) -> list[int]:
    from vmlaunch.doctor.disks import cached_layout

    with contextlib.suppress(OSError):
        return [part.number for part in cached_layout(disk.path, disk.format.value).partitions
                if part.filesystem == "ext3"]
    return []


def check_alignment(lab: LabSpec, files: Sequence[DiskFile], host: Host) -> Iterator[Finding]:
    from vmlaunch.doctor.disks import cached_layout

    qemu_io = str(Path(host.qemu.img).with_name("qemu-io")) if host.qemu.img else "qemu-io"
    why = (f"a partition that does not start on a 4 KiB boundary turns each 4 KiB write of the guest into "
           f"two partial ones on the host ({GUIDE}: start partitions on a multiple of 8 sectors)")
    for disk in files:
        if not disk.exists:
            continue
        try:
            found = cached_layout(disk.path, disk.format.value, qemu_io)
        except OSError as exc:
            yield Finding("lab.alignment", Status.NOTE, f"{disk.vm}: {disk.path} could not be read ({exc})",
                          why)
            continue
        if found.error is not None:
            yield Finding("lab.alignment", Status.NOTE, f"{disk.vm}: {disk.path}'s partitions could not be "
                          f"read ({found.error})", why)
            continue
        if not found.partitions:
            continue  # a whole-disk file system, or empty: nothing to align
        bad = [part for part in found.partitions if not part.aligned]
        at = where(lab, disk.key)
        table = found.table.upper()
        if bad:
            shown = ", ".join(f"{part.number} at sector {part.start}" for part in bad)
            yield Finding("lab.alignment", Status.WARN, f"{disk.vm}: {disk.path.name} ({table}): partition "
                          f"{shown}: not 4 KiB aligned", why,
                          "recreate them starting on a multiple of 8 sectors (sfdisk/parted use 2048 by "
                          "default)", at)
        else:
            yield Finding("lab.alignment", Status.OK, f"{disk.vm}: {disk.path.name} ({table}): "
                          f"{len(found.partitions)} partitions, all 4 KiB aligned", why)


def check_pci(lab: LabSpec, host: Host) -> Iterator[Finding]:
    from vmlaunch.host.pci import device_problems

    for vm in lab.vms:
        for index, dev in enumerate(vm.pci):
            at = where(lab, ("vm", vm.name, "pci", index))
            if dev.driver is PciDriver.PCI_STUB and "pci-assign" not in host.qemu.devices:
                yield Finding("lab.pci_stub", Status.FAIL, f"{vm.name}: {dev.host} with driver = "
                              f"\"pci-stub\", and this QEMU ({host.qemu.version_text}) has no legacy device "
                              "assignment",
                              f"pci-stub serves QEMU's old pci-assign, gone since QEMU 2.12 ({PASSTHROUGH})",
                              "driver = \"vfio-pci\"", where(lab, ("vm", vm.name, "pci", index, "driver")))
            problems = device_problems(dev.host)
            if any("no such device" in problem for problem in problems):
                yield Finding("lab.pci", Status.FAIL, f"{vm.name}: " + "; ".join(problems),
                              "a device the host does not have cannot be passed through",
                              "name one `lspci -D` lists", at)
            elif problems:
                yield Finding("lab.pci_iommu", Status.FAIL, f"{vm.name}: {dev.host}: " + "; ".join(problems),
                              f"vfio-pci needs every device of the IOMMU group unbound, on vfio-pci or "
                              f"pci-stub, or passed through too ({PASSTHROUGH})",
                              "pass the whole group, or unbind its other devices", at)
            else:
                yield Finding("lab.pci_iommu", Status.OK, f"{vm.name}: {dev.host}: its IOMMU group is viable")


def check_hugepages(lab: LabSpec, host: Host) -> Iterator[Finding]:
    for vm in lab.vms:
        if vm.hugepages is None:
            continue
        if lab.memory.ksm:
            yield Finding("lab.hugepages_ksm", Status.NOTE, f"{vm.name}: on hugepages, in a lab with KSM "
                          "on: its memory is never merged", "KSM merges 4 KiB pages only; hugepage-backed "
                          "guest RAM is left out (so is the balloon)",
                          "leave hugepages out of VMs KSM should merge",
                          where(lab, ("vm", vm.name, "hugepages")))
        yield from _free_pages(lab, vm)


def _free_pages(lab: LabSpec, vm: VmSpec) -> Iterator[Finding]:
    from vmlaunch.resources.hugepages import pool

    assert vm.hugepages is not None
    if vm.reserve_hugepages:
        return
    folder = pool(None, vm.hugepages.kib)
    try:
        free = int((folder / "free_hugepages").read_text())
    except (OSError, ValueError):
        return
    need = (vm.memory_mib << 10) // vm.hugepages.kib
    if need > free:
        yield Finding("lab.hugepages", Status.FAIL, f"{vm.name} needs {need} {vm.hugepages.value} hugepages, "
                      f"the host has {free} free", "QEMU allocates the guest's RAM whole when it starts",
                      f"reserve_hugepages = true, or echo N > {folder / 'nr_hugepages'}",
                      where(lab, ("vm", vm.name, "hugepages")))
