"""What `compile` produces: each VM's QEMU argv and the host resources the lab needs.

A Plan is plain data: `cmdline` and `up --dry-run` print it, the executor carries it out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from vmlaunch.errors import Location
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import RunDir, VmFiles
from vmlaunch.policy.admission import Admission
from vmlaunch.resources.base import Resource
from vmlaunch.spec.model import Accel, DiskBus, DiskFault, Netem

if TYPE_CHECKING:  # an annotation only: a lab without placement never loads placement's classes
    from vmlaunch.policy.placement import Placed


@attrs.frozen
class AccelChoice:
    accel: Accel  # KVM or TCG, never AUTO
    reason: str


@attrs.frozen
class StartFaults:
    """The `[[fault]]`s of one disk, which `up` sets in the VM's QEMU before its guest runs
    (rig/diskfault.py)."""

    disk: str  # diskN
    key: str  # the disk's spec key
    bus: DiskBus
    readonly: bool
    discard: bool
    faults: tuple[DiskFault, ...]
    locations: tuple[Location, ...] = ()  # each fault's place in the spec, for a fault QEMU refuses


@attrs.frozen
class VmPlan:
    name: str
    argv: tuple[str, ...]
    accel: AccelChoice
    files: VmFiles
    notes: tuple[str, ...] = ()  # warnings worth showing a user (vCPU over-commit, ...)
    vcpus: int = 1
    ssh_user: str | None = None  # a VM with an SSH port (management NIC): the user `vmlaunch ssh` logs in as
    placement: Placed | None = None  # the NUMA node(s) and CPUs it runs on, when placed
    # (NIC index, its MAC, the figures) of the spec's netem that runs in the guest: `up` sets it through
    # the command channel once the guest answers (rig/netem.py)
    guest_netem: tuple[tuple[int, str, Netem], ...] = ()
    disk_faults: tuple[StartFaults, ...] = ()  # the spec's disk faults, set before the guest runs


@attrs.frozen
class Plan:
    lab: str
    run_dir: RunDir
    resources: tuple[Resource, ...]
    vms: tuple[VmPlan, ...]
    notes: tuple[str, ...] = ()  # lab-wide warnings (memory over-commit)
    lab_dir: LabDir | None = None  # beside the spec: keys, overlays, seeds (`layout/labdir.py`)
    admission: Admission = Admission(None, "not limited")  # how many VMs boot at once when `up` waits

    def vm(self, name: str) -> VmPlan:
        for vm in self.vms:
            if vm.name == name:
                return vm
        raise KeyError(name)

    def accel_lines(self, *, why: bool = True) -> list[str]:
        """The accelerator chosen and why, once per choice rather than per VM: `alpha, beta: tcg
        (KVM not usable: ...)` (the reason is about the host, the same for every VM); without `why`,
        `alpha, beta: tcg`."""
        chosen: dict[AccelChoice, list[str]] = {}
        for vm in self.vms:
            chosen.setdefault(vm.accel, []).append(vm.name)
        return [f"{', '.join(names)}: {choice.accel.value}" + (f" ({choice.reason})" if why else "")
                for choice, names in chosen.items()]
