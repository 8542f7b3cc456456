"""What `compile` produces: each VM's QEMU argv and the host actions the lab needs.

A Plan is plain data: `cmdline` and `up --dry-run` print it, the executor carries it out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import attrs

from vmlaunch.model import Accel, DiskFormat, PciDriver


@attrs.frozen
class AccelChoice:
    accel: Accel  # KVM or TCG, never AUTO
    reason: str


@attrs.frozen
class CreateBridge:
    """Ensure a Linux bridge exists (created only when missing; then removed by `down`)."""

    name: str
    network: str
    mtu: int | None = None
    uplink: str | None = None

    def describe(self) -> str:
        extra = "".join([f" mtu {self.mtu}" if self.mtu else "",
                         f" with uplink {self.uplink}" if self.uplink else ""])
        return f"bridge {self.name} (network {self.network}){extra}: create if missing"


@attrs.frozen
class CreateTap:
    """A tap device for one NIC, enslaved to its bridge before QEMU opens it."""

    ifname: str
    bridge: str
    vm: str
    mtu: int | None = None
    multi_queue: bool = False

    def describe(self) -> str:
        return f"tap {self.ifname} for {self.vm} on bridge {self.bridge}"


@attrs.frozen
class BindPci:
    """Bind a host PCI device to a pass-through driver (restored on `down`)."""

    address: str
    driver: PciDriver
    vm: str

    def describe(self) -> str:
        return f"PCI {self.address} for {self.vm}: bind to {self.driver.value}"


@attrs.frozen
class CreateImage:
    """Create a sparse disk image when the file is missing; an existing file is never touched."""

    path: Path
    size: int
    format: DiskFormat
    vm: str

    def describe(self) -> str:
        from vmlaunch.units import format_size

        return f"image {self.path} ({self.format.value}, {format_size(self.size)}): create if missing"


HostAction = Union[CreateBridge, CreateTap, BindPci, CreateImage]


@attrs.frozen
class VmPlan:
    name: str
    argv: tuple[str, ...]
    accel: AccelChoice
    run_dir: Path
    notes: tuple[str, ...] = ()  # warnings worth showing a user (vCPU over-commit, ...)

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / f"{self.name}.qmp"

    @property
    def console_socket(self) -> Path:
        return self.run_dir / f"{self.name}.console"

    @property
    def serial_log(self) -> Path:
        return self.run_dir / f"{self.name}.serial.log"

    @property
    def pidfile(self) -> Path:
        return self.run_dir / f"{self.name}.pid"


@attrs.frozen
class Plan:
    lab: str
    run_dir: Path
    actions: tuple[HostAction, ...]
    vms: tuple[VmPlan, ...]
    notes: tuple[str, ...] = ()  # lab-wide warnings (memory over-commit)

    def vm(self, name: str) -> VmPlan:
        for vm in self.vms:
            if vm.name == name:
                return vm
        raise KeyError(name)
