"""Which libvirt host each VM of a multi-host lab runs on: pure, from the room each host has.

A VM with `host = "NAME"` runs there. The others are placed one at a time, the largest first: on a
host with room for its memory (the host's free memory as libvirt counts it, capped by the lab's memory
budget, which holds per host) and for its vCPUs (no more than the host's CPUs), preferring a host where
a VM it shares a network with already is (fewer networks span hosts), then the host with the most
memory left. So a lab that fits one host stays on it, and one that does not spreads.

A bridge network that spans hosts needs a VXLAN link set up on each of them over SSH: a host
vmlaunch cannot run commands on (`shell` False) only gets a VM whose bridge networks stay on it.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from vmlaunch.errors import HostError
from vmlaunch.spec.model import BridgeNetwork, LabSpec, VmSpec


@attrs.frozen
class HostRoom:
    """What a host offers the lab."""

    memory_mib: int  # free memory
    cpus: int
    shell: bool = True  # vmlaunch can set up host-side links there (local, or SSH)


def _bridges(lab: LabSpec, vm: VmSpec) -> set[str]:
    return {nic.network for nic in vm.nics if isinstance(lab.network(nic.network), BridgeNetwork)}


def place(lab: LabSpec, rooms: Mapping[str, HostRoom]) -> dict[str, str]:
    """VM name -> host name, for every VM of the lab. A HostError (exit 3) names the VM that fits on
    no host, and why."""
    budget = lab.memory.budget_mib
    left = {
        name: min(room.memory_mib, budget) if budget is not None else room.memory_mib
        for name, room in rooms.items()
    }
    placed: dict[str, str] = {}
    net_hosts: dict[str, set[str]] = {}

    def take(vm: VmSpec, host: str) -> None:
        placed[vm.name] = host
        left[host] -= vm.memory_mib
        for net in _bridges(lab, vm):
            net_hosts.setdefault(net, set()).add(host)

    for vm in lab.vms:
        if vm.host is None:
            continue
        if vm.memory_mib > left[vm.host]:
            raise HostError(
                f"{lab.file}: VM {vm.name} needs {vm.memory_mib} MiB on host {vm.host}, which "
                f"has {max(left[vm.host], 0)} MiB left for the lab",
                "pin it to another host, or leave its host to placement",
            )
        if vm.cpus > rooms[vm.host].cpus:
            raise HostError(
                f"{lab.file}: VM {vm.name} has {vm.cpus} vCPUs, host {vm.host} has {rooms[vm.host].cpus} CPUs"
            )
        take(vm, vm.host)

    def spans_badly(vm: VmSpec, host: str) -> bool:
        for net in _bridges(lab, vm):
            hosts = net_hosts.get(net, set()) | {host}
            if len(hosts) > 1 and not all(rooms[name].shell for name in hosts):
                return True
        return False

    for vm in sorted((vm for vm in lab.vms if vm.host is None), key=lambda vm: -vm.memory_mib):
        nets = _bridges(lab, vm)
        fits = [
            name
            for name in rooms
            if left[name] >= vm.memory_mib and rooms[name].cpus >= vm.cpus and not spans_badly(vm, name)
        ]
        if not fits:
            most = max(rooms, key=lambda name: left[name])
            raise HostError(
                f"{lab.file}: no host has room for VM {vm.name} ({vm.memory_mib} MiB, "
                f"{vm.cpus} vCPUs): the most is {max(left[most], 0)} MiB on host {most}",
                "add a host, or give the VM less memory",
            )
        order = list(rooms)
        best = max(
            fits,
            key=lambda name: (
                any(name in net_hosts.get(net, ()) for net in nets),
                left[name],
                -order.index(name),
            ),
        )
        take(vm, best)
    return {vm.name: placed[vm.name] for vm in lab.vms}
