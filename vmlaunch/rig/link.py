"""A NIC's link, up or down, in a running VM (`vmlaunch link`, `Vm.link`).

QMP `set_link` on the NIC's device (`nicN`, the id the compiler gives it): QEMU marks the device's
link down, the guest's driver reports no carrier, and QEMU drops what the guest sends on it and what
arrives for it. (Naming the netdev, `netN`, would do the same and mark the backend too.) The state
lives in QEMU only: a new QEMU starts with every link up, so nothing is left to undo at `down`, and
the record in wire.json (`nics["VM/INDEX"]["link"]`, with the pid of the QEMU it was set in) is only
read while that QEMU runs.
"""

from __future__ import annotations

import logging

from vmlaunch.errors import UsageError
from vmlaunch.lab import wire
from vmlaunch.lab.running import running_pid
from vmlaunch.layout.rundir import RunDir
from vmlaunch.qemu.qmp import QuickQmp
from vmlaunch.spec.model import LabSpec

log = logging.getLogger(__name__)

UP, DOWN = "up", "down"
QMP_TIMEOUT = 5.0  # seconds QEMU gets to answer


def set_link(run_dir: RunDir, lab: LabSpec, vm: str, nic: str | int, up: bool) -> int:
    """Set the link of NIC `nic` (an index, `nicN`/`netN` or its network's name) of running VM `vm`;
    returns the NIC's index. UsageError for an unknown VM or NIC, RuntimeFailure when it is not up."""
    if not isinstance(up, bool):
        raise UsageError(f"link: up must be True or False, not {up!r}")
    lab.select([vm])
    index = wire.resolve_nic(lab, vm, str(nic))
    pid = running_pid(run_dir, vm)
    with QuickQmp(run_dir.vm(vm).qmp, timeout=QMP_TIMEOUT) as qmp:
        qmp.cmd("set_link", name=f"nic{index}", up=up)
    key = wire.nic_key(vm, index)

    def record(state: wire.State) -> None:
        entry = state["nics"].setdefault(key, {})
        if up:
            entry.pop("link", None)
            entry.pop("link_qemu", None)
        else:
            entry.update({"link": DOWN, "link_qemu": pid})
        if not entry:
            del state["nics"][key]

    wire.update(run_dir, record)
    log.debug("%s: nic%d link %s", vm, index, UP if up else DOWN)
    return index


def link_of(state: wire.State, vm: str, index: int, pid: int | None) -> str:
    """"up" or "down": what the record says of the NIC while the QEMU it was set in (`pid`) runs."""
    entry = state["nics"].get(wire.nic_key(vm, index))
    if not isinstance(entry, dict) or entry.get("link") != DOWN or pid is None:
        return UP
    return DOWN if entry.get("link_qemu") in (None, pid) else UP


def forget(run_dir: RunDir, vms: set[str]) -> None:
    """Drop the link records of `vms` (taken down: their links died with their QEMUs)."""
    def change(state: wire.State) -> None:
        for key in list(state["nics"]):
            entry = state["nics"][key]
            if key.split("/", 1)[0] in vms and isinstance(entry, dict):
                entry.pop("link", None)
                entry.pop("link_qemu", None)
                if not entry:
                    del state["nics"][key]

    if run_dir.wire.exists():
        wire.update(run_dir, change)
