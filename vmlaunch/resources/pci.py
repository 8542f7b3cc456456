"""Host PCI devices bound to a pass-through driver before QEMU starts, and given back after.

The sysfs work is `host/pci.py`; this module is its resource: the planned binding, the record of
what was done (the driver the device had, the ids added to pci-stub), and the check that runs before
anything changes (every IOMMU group viable).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs

from vmlaunch.guests.diskfiles import DiskOrigin
from vmlaunch.host.pci import Binding
from vmlaunch.resources.base import Context, OfVm
from vmlaunch.spec.model import PciDriver


@attrs.frozen
class PciRecord(Binding):
    """What binding did (`host.pci.Binding`), journaled: enough to give the device back from another
    process."""

    kind: ClassVar[str] = "pci"

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        from vmlaunch.host.pci import restore

        restore(self, ctx.sysfs)

    def describe(self) -> str:
        if not self.changed:
            return f"PCI {self.address} (already on {self.driver})"
        return f"PCI {self.address} on {self.driver} (was {self.original_driver or 'unbound'})"


@attrs.frozen
class PciBind(OfVm):
    """Bind a host PCI device to a pass-through driver (restored on `down`)."""

    kind: ClassVar[str] = "pci"

    address: str
    driver: PciDriver
    vm: str
    origin: DiskOrigin | None = attrs.field(default=None, eq=False)  # where the spec asks for it

    @property
    def key(self) -> str:
        return self.address

    def describe(self) -> str:
        return f"PCI {self.address} for {self.vm}: bind to {self.driver.value}"

    def found(self) -> str | None:
        from vmlaunch.host.pci import device_problems

        problems = device_problems(self.address)
        return f"refused: {'; '.join(problems)}" if problems else None

    def apply(self, ctx: Context) -> PciRecord:
        from vmlaunch.host.pci import bind

        return PciRecord(**attrs.asdict(bind(self.address, self.driver, ctx.sysfs)))

    @staticmethod
    def preflight(binds: Sequence[PciBind]) -> None:
        """Every device to pass through is in a viable IOMMU group, before anything changes."""
        from vmlaunch.host.pci import PciError, check_viable

        try:
            check_viable([b.address for b in binds], drivers={b.driver for b in binds})
        except PciError as err:  # each line of a device: with the file, line and key that ask for it
            lines = [_located(line, binds) for line in err.problems]
            raise PciError("\n".join(lines), err.hint, lines) from None


def _located(line: str, binds: Sequence[PciBind]) -> str:
    for bind in binds:
        if bind.origin is not None and line.startswith(f"PCI {bind.address}:"):
            return f"{bind.origin.location('host')} {line}"
    return line
