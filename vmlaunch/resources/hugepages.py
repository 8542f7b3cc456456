"""Hugepages for a VM whose RAM comes from them (`hugepages = "2M"`): checked free before anything
changes, and with `reserve_hugepages` added to the kernel's pool for the VM and given back after.

The pool is `kernel/mm/hugepages/hugepages-NkB/nr_hugepages` under the one sysfs root
(`VMLAUNCH_SYSFS`, else /sys); `free_hugepages` beside it says how many are unused. A reservation
raises `nr_hugepages` by the VM's pages, whatever is free already (those may be someone else's), and
its record lowers it by as many again: pages QEMU still holds then become surplus pages, which the
kernel frees when QEMU lets them go. Each change reads and writes `nr_hugepages` under an flock of
that file itself, so two labs coming up at once do not undo each other's reservations, and nothing is
left behind for the lock.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import attrs

from vmlaunch.core.units import format_size
from vmlaunch.errors import HostError
from vmlaunch.resources.base import Context, PerVm, Resource


def pool(ctx_sysfs: Path | None, size_kib: int) -> Path:
    from vmlaunch.host.pci import sysfs_root

    return (ctx_sysfs or sysfs_root()) / "kernel" / "mm" / "hugepages" / f"hugepages-{size_kib}kB"


def _read(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError) as exc:
        raise HostError(f"cannot read {path}: {exc}") from None


def _write(path: Path, value: int) -> None:
    try:
        path.write_text(f"{value}\n")
    except PermissionError:
        raise HostError(f"cannot write {path}: permission denied",
                        "reserve_hugepages needs root; or reserve them beforehand and leave it out") from None
    except OSError as exc:
        raise HostError(f"cannot write {path}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _locked(nr: Path) -> Iterator[None]:
    """`nr_hugepages` flocked for a read and a write (other vmlaunch runs wait; they hold it briefly)."""
    import fcntl

    try:
        fd = os.open(nr, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"cannot open {nr}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _add(nr: Path, pages: int) -> tuple[int, int]:
    """Add `pages` (or take them away) to the pool under its lock; (before, after) as the kernel says."""
    with _locked(nr):
        before = _read(nr)
        _write(nr, max(0, before + pages))
        return before, _read(nr)


@attrs.frozen
class HugepagesRecord:
    kind: ClassVar[str] = "hugepages"

    vm: str
    size_kib: int
    added: int  # pages this VM's reservation added to the pool (0: none reserved)
    sysfs: Path | None = None

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        if not self.added:
            return
        _add(pool(self.sysfs or ctx.sysfs, self.size_kib) / "nr_hugepages", -self.added)

    def describe(self) -> str:
        size = format_size(self.size_kib << 10)
        if not self.added:
            return f"{size} hugepages for VM {self.vm} (from the free pool; none reserved)"
        return (f"{self.added} {size} hugepages reserved for VM {self.vm} (nr_hugepages raised; lowered "
                "by down)")


@attrs.frozen
class Hugepages(PerVm):
    """The hugepages a VM's RAM needs."""

    kind: ClassVar[str] = "hugepages"

    vm: str
    size_kib: int
    pages: int
    reserve: bool

    def describe(self) -> str:
        size = format_size(self.size_kib << 10)
        how = "reserved: nr_hugepages raised for it" if self.reserve else "from the free pool"
        return f"{self.pages} {size} hugepages for VM {self.vm} ({how})"

    def found(self) -> str | None:
        return None

    @staticmethod
    def preflight(resources: Sequence[Resource]) -> None:
        """The VMs that take their pages from the free pool find enough free, per size."""
        wanted: dict[int, list[Hugepages]] = {}
        for resource in resources:
            assert isinstance(resource, Hugepages)
            if not resource.reserve:
                wanted.setdefault(resource.size_kib, []).append(resource)
        for size_kib, group in wanted.items():
            folder = pool(None, size_kib)
            need, free, nr = sum(r.pages for r in group), _read(folder / "free_hugepages"), \
                _read(folder / "nr_hugepages")
            if need > free:
                size = format_size(size_kib << 10)
                vms = ", ".join(r.vm for r in group)
                raise HostError(f"{vms} need {need} {size} hugepages, and the host has {free} free",
                                f"echo {nr + need - free} > {folder / 'nr_hugepages'} (as root), or "
                                "reserve_hugepages = true in the VM")

    def apply(self, ctx: Context) -> HugepagesRecord:
        if not self.reserve:
            return HugepagesRecord(self.vm, self.size_kib, 0, ctx.sysfs)
        nr = pool(ctx.sysfs, self.size_kib) / "nr_hugepages"
        before, got = _add(nr, self.pages)
        if got < before + self.pages:  # the kernel found too few free contiguous pages
            _add(nr, before - got)
            size = format_size(self.size_kib << 10)
            raise HostError(f"the kernel could add only {got - before} of {self.pages} {size} hugepages for "
                            f"VM {self.vm} (its free memory is too fragmented or too little)",
                            "echo 1 > /proc/sys/vm/compact_memory, or reserve hugepages at boot "
                            "(kernel command line hugepages=N)")
        return HugepagesRecord(self.vm, self.size_kib, self.pages, ctx.sysfs)
