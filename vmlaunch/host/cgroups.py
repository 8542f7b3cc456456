"""cpuset cgroups for VMs placed on NUMA nodes: one cgroup per VM whose `cpuset.cpus` and
`cpuset.mems` hold its QEMU (every thread) on a node; changing them moves the VM, CPUs and memory
together (the kernel migrates its pages and rebinds its memory policy: as "Improving the Out-of-Box KVM
Performance" put it, "cpuset can migrate cpus *and* memory").

Where the host has them, under the one sysfs root (`VMLAUNCH_SYSFS`, else /sys):
- cgroup v2: `fs/cgroup` is the unified hierarchy and its `cgroup.subtree_control` has `cpuset`
  (vmlaunch does not turn a controller on for the whole host); a VM's cgroup is
  `fs/cgroup/vmlaunch-LAB-VM`, and the kernel migrates memory whenever `cpuset.mems` changes;
- cgroup v1 (this project's machines): the `fs/cgroup/cpuset` hierarchy; a VM's cgroup is
  `fs/cgroup/cpuset/vmlaunch-LAB-VM`, with `cpuset.memory_migrate` set to 1 so its pages follow.
Without either, placement falls back to sched_setaffinity for the threads and migrate_pages(2) for
what QEMU allocated before it was placed (its guest RAM QEMU binds itself): the VM is placed, but the
balancer cannot move it (QEMU's memory policy could not follow).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import time
from collections.abc import Iterable
from pathlib import Path

import attrs

from vmlaunch.errors import HostError
from vmlaunch.host.numa import format_cpulist, parse_cpulist


class CgroupVersion(enum.Enum):
    V1 = "v1"
    V2 = "v2"


@attrs.frozen
class Cpusets:
    """Where this host's cpuset cgroups are (`Host.cpusets`)."""

    version: CgroupVersion
    root: Path  # the hierarchy's root folder

    def folder(self, name: str) -> Path:
        return self.root / name

    def describe(self) -> str:
        return f"cpuset cgroups ({self.version.value}, {self.root})"


def detect(sysfs: Path | None = None) -> Cpusets | None:
    """The host's cpuset cgroups, None when it has none vmlaunch may use: none, or none it may create
    a cgroup in (not root, a read-only cgroup file system in a container), so placement pins with
    sched_setaffinity instead."""
    from vmlaunch.host.pci import sysfs_root

    base = (sysfs or sysfs_root()) / "fs" / "cgroup"
    found = None
    with contextlib.suppress(OSError):
        if "cpuset" in (base / "cgroup.subtree_control").read_text().split():
            found = Cpusets(CgroupVersion.V2, base)
    if found is None and (base / "cpuset" / "cpuset.cpus").exists() and (base / "cpuset" / "tasks").exists():
        found = Cpusets(CgroupVersion.V1, base / "cpuset")
    return found if found is not None and os.access(found.root, os.W_OK) else None


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as file:
            file.write(value)
    except OSError as exc:
        raise HostError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from None


def create(cpusets: Cpusets, name: str, cpus: Iterable[int], mems: Iterable[int]) -> Path:
    """The VM's cgroup with these CPUs and nodes (one a killed run left is taken as it is)."""
    folder = cpusets.folder(name)
    try:
        folder.mkdir(mode=0o755)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise HostError(f"cannot create the cgroup {folder}: {exc.strerror or exc}",
                        "placing VMs on NUMA nodes through cpusets needs root") from None
    try:
        set_place(folder, cpus, mems)
        if cpusets.version is CgroupVersion.V1:
            _write(folder / "cpuset.memory_migrate", "1")
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return folder


def set_place(folder: Path, cpus: Iterable[int], mems: Iterable[int]) -> None:
    """Move a VM: its CPUs first (its threads follow), then its nodes (its memory follows: the write
    returns once the kernel has migrated it)."""
    _write(folder / "cpuset.cpus", format_cpulist(cpus))
    _write(folder / "cpuset.mems", format_cpulist(mems))


def place_of(folder: Path) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(cpus, mems) a VM's cgroup holds it on now, None when it has none."""
    if not folder.is_dir():
        return None
    try:
        return parse_cpulist(_read(folder / "cpuset.cpus")), parse_cpulist(_read(folder / "cpuset.mems"))
    except ValueError:
        return None


def attach(folder: Path, pid: int) -> None:
    """Every thread of process `pid` into a VM's cgroup (v1 and v2: `cgroup.procs` moves them all)."""
    _write(folder / "cgroup.procs", str(pid))


def remove(folder: Path, timeout: float = 5.0) -> None:
    """Remove a VM's cgroup once its QEMU has exited (the kernel refuses while a thread is in it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise HostError(f"cannot remove the cgroup {folder}: {exc.strerror or exc}",
                                f"a process is still in it: see {folder}/cgroup.procs") from None
        time.sleep(0.1)


SYS_MIGRATE_PAGES = 256  # x86_64


def migrate_pages(pid: int, nodes: Iterable[int], host_nodes: Iterable[int]) -> None:
    """Without a cgroup: move what process `pid` holds on other nodes of `host_nodes` onto `nodes`
    (migrate_pages(2)); QEMU's guest RAM is bound by QEMU itself, this is the rest it allocated while
    it started. Best effort: a kernel without NUMA, or a process gone, leaves it where it is."""
    import ctypes

    wanted, others = set(nodes), set(host_nodes) - set(nodes)
    if not others or not wanted:
        return
    bits = max(wanted | others) + 1
    words = (bits + 63) // 64

    def mask(members: set[int]) -> ctypes.Array[ctypes.c_ulong]:
        array = (ctypes.c_ulong * words)()
        for node in members:
            array[node // 64] |= 1 << (node % 64)
        return array

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(SYS_MIGRATE_PAGES, ctypes.c_long(pid), ctypes.c_ulong(words * 64), mask(others),
                 mask(wanted))


def pin(tid: int, cpus: Iterable[int]) -> None:
    """A thread (a vCPU's, or any of QEMU's) on these host CPUs."""
    try:
        os.sched_setaffinity(tid, set(cpus))
    except ProcessLookupError:
        pass  # the thread ended (QEMU's short-lived workers)
    except OSError as exc:
        raise HostError(f"cannot pin thread {tid} to CPUs {format_cpulist(cpus)}: "
                        f"{exc.strerror or exc}") from None
