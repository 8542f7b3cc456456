"""Clones made by `vmlaunch fork` as members of their lab: each is its source's VmSpec under a name of
its own, with the identity a clone needs (its own MACs, static addresses and forwarded host ports).

Pure: `runtime/fork.py` keeps the clones of a running lab in its run dir (`forks.json`) and asks
`with_clones` for the lab they belong to, which every command that drives a running lab (`status`,
`ssh`, `exec`, `balloon`, `snapshot`, `down`, the API) then sees whole: a clone is a VM of the lab
like the others until `down` removes it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from vmlaunch.core.naming import derive_mac
from vmlaunch.errors import UsageError
from vmlaunch.spec.model import (
    BridgeNetwork,
    LabSpec,
    Network,
    SocketNetwork,
    TapNetwork,
    UserNetwork,
    VmSpec,
)

NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")  # as the schema's `name`
INDEX = "{i}"  # where a clone's number goes in a name pattern
MAX_COUNT = 64  # clones of one fork
_HOSTFWD = re.compile(r"(?P<head>(?:tcp|udp):(?:[0-9.]+)?:)(?P<port>[0-9]{1,5})(?P<tail>-.*)")


@attrs.frozen
class Clone:
    """One clone: its name, the VM it was forked from, the fork it came from and its number there;
    its static address per NIC (None: the NIC has none), and its user networks' forwarding rules with
    host ports of its own (network -> rules). `base`: the spec's VM it is a copy of (its source's,
    for a clone of a clone), whose VmSpec it takes."""

    name: str
    source: str
    fork: int
    index: int
    base: str = attrs.field(default=attrs.Factory(lambda self: self.source, takes_self=True))
    addresses: tuple[str | None, ...] = ()
    forwards: tuple[tuple[str, tuple[str, ...]], ...] = ()
    same_identity: bool = False  # forked with --same-identity: the guest was not told who it is
    forked: float = 0.0  # when it was forked (seconds since the epoch; 0: not known): what its disks
    # held before then was its source's (saved/snapshot.py leaves such snapshots out)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "base": self.base, "fork": self.fork,
                "index": self.index,
                "addresses": list(self.addresses),
                "forwards": {network: list(rules) for network, rules in self.forwards},
                "same_identity": self.same_identity, "forked": self.forked}

    @classmethod
    def from_json(cls, doc: Any) -> Clone:
        """Raises ValueError for anything `to_json` did not write."""
        if not isinstance(doc, dict):
            raise ValueError("a clone is a JSON object")
        name, source, fork, index = doc.get("name"), doc.get("source"), doc.get("fork"), doc.get("index")
        base = doc.get("base", source)
        if not (isinstance(name, str) and isinstance(source, str) and isinstance(base, str)
                and all(NAME.fullmatch(each) for each in (name, source, base))):
            raise ValueError("a clone's name, source and base are VM names")
        if not (type(fork) is int and type(index) is int):
            raise ValueError("a clone's fork and index are numbers")
        addresses = doc.get("addresses", [])
        forwards = doc.get("forwards", {})
        if not (isinstance(addresses, list) and all(a is None or isinstance(a, str) for a in addresses)):
            raise ValueError("a clone's addresses are strings or null")
        if not (isinstance(forwards, dict) and all(
                isinstance(rules, list) and all(isinstance(rule, str) for rule in rules)
                for rules in forwards.values())):
            raise ValueError("a clone's forwards are lists of rules by network")
        forked = doc.get("forked", 0.0)
        if not (type(forked) in (int, float) and forked >= 0):
            raise ValueError("a clone's forked is a time")
        return cls(name, source, fork, index, base, tuple(addresses),
                   tuple((str(net), tuple(rules)) for net, rules in sorted(forwards.items())),
                   bool(doc.get("same_identity", False)), float(forked))


def names(pattern: str | None, source: str, count: int, taken: Iterable[str]) -> list[str]:
    """The names of `count` clones of `source`. With a `pattern` (`{i}` where the number goes), from 1;
    without, `SOURCE-i` from the first number after the highest such clone there is, so a second fork
    of a VM goes on counting. A name that is not a VM name, or that exists, is a UsageError."""
    if not 1 <= count <= MAX_COUNT:
        raise UsageError(f"--count {count}: fork makes 1 to {MAX_COUNT} clones at a time")
    taken = set(taken)
    if pattern is None:
        numbered = re.compile(re.escape(source) + r"-([0-9]+)")
        start = 1 + max((int(found[1]) for name in taken if (found := numbered.fullmatch(name))),
                        default=0)
        pattern, numbers = f"{source}-{INDEX}", range(start, start + count)
    else:
        if INDEX not in pattern:
            raise UsageError(f"--name {pattern!r} has no {INDEX}: every clone needs a name of its own",
                             f"e.g. --name '{source}-{INDEX}'")
        numbers = range(1, count + 1)
    # Each name carries its number: never the lab dir's `ssh` folder, which is no VM's.
    made = [pattern.replace(INDEX, str(number)) for number in numbers]
    bad = [name for name in made if NAME.fullmatch(name) is None]
    if bad:
        raise UsageError(f"--name {pattern!r} makes {bad[0]!r}, which is not a VM name",
                         "VM names are 1-32 lowercase letters, digits or '-', not starting or ending "
                         "with '-'")
    there = [name for name in made if name in taken]
    if there:
        raise UsageError(f"{', '.join(there)} {'exists' if len(there) == 1 else 'exist'} already in "
                         "this lab", "give the clones other names with --name PATTERN ({i} is the "
                         "number)")
    return made


def next_address(source: str, used: set[ipaddress.IPv4Address], subnet: str | None) -> str:
    """The next free address after `source` ("10.10.0.11/24") in its network (the network's `subnet`
    when it has one), skipping the network and broadcast addresses, the first host (a gateway's by
    custom) and `used`; the chosen one is added to `used`. UsageError when none is left."""
    interface = ipaddress.IPv4Interface(source)
    network = ipaddress.IPv4Network(subnet) if subnet else interface.network
    first, last = int(network.network_address) + 2, int(network.broadcast_address) - 1
    span = last - first + 1
    if span > 0:
        start = (int(interface.ip) + 1 - first) % span
        for step in range(span):
            candidate = ipaddress.IPv4Address(first + (start + step) % span)
            if candidate not in used:
                used.add(candidate)
                return f"{candidate}/{network.prefixlen}"
    raise UsageError(f"no free address is left in {network} for another clone",
                     "a larger subnet, or fewer clones")


def used_addresses(lab: LabSpec) -> set[ipaddress.IPv4Address]:
    """Every address a NIC of the lab has or names (its own, its gateway, its DNS servers)."""
    used: set[ipaddress.IPv4Address] = set()
    for vm in lab.vms:
        for nic in vm.nics:
            for text in (nic.ip, nic.gateway, *nic.dns):
                if text:
                    with contextlib.suppress(ValueError):
                        used.add(ipaddress.IPv4Interface(text).ip)
    return used


def forward_rules(rules: Sequence[str], ports: Iterable[int]) -> tuple[str, ...]:
    """`rules` (QEMU's hostfwd, "tcp:127.0.0.1:8080-:80") with their host ports replaced by `ports`,
    one each, in order."""
    chosen = iter(ports)
    out = []
    for rule in rules:
        found = _HOSTFWD.fullmatch(rule)
        if found is None:  # the spec's builder refused any other form
            raise ValueError(f"not a forwarding rule: {rule!r}")
        out.append(f"{found['head']}{next(chosen)}{found['tail']}")
    return tuple(out)


def base_network(network: str) -> str:
    """The spec's network a NIC is on: a clone's copy of a user network names it before its '@'."""
    return network.partition("@")[0]


def network_of(network: str, clone: str) -> str:
    """The name of the user network a clone's forwards live on: the source's, with the clone's name.
    (A user network is the NIC's own QEMU process's: a copy of it per clone changes nothing else.)"""
    return f"{network}@{clone}"


def clone_spec(lab: LabSpec, clone: Clone) -> VmSpec:
    """The VmSpec of `clone`: its source's under the clone's name, each NIC with a MAC derived for the
    clone (on a user network, the source's: see below), its address, and its user network's copy
    where that network forwards ports; each writable
    disk a copy in the clone's folder of the lab dir (`VmDir.disk_copy`). Its node and pinned CPUs
    are the source's: the saved memory loads only into RAM laid out as the source's."""
    from vmlaunch.layout.labdir import LabDir

    source = lab.vm(clone.base)
    forwarded = dict(clone.forwards)
    nics = []
    for index, nic in enumerate(source.nics):
        address = clone.addresses[index] if index < len(clone.addresses) else None
        base = base_network(nic.network)
        network = network_of(base, clone.name) if base in forwarded else base
        # A NIC on a user network keeps its MAC: that network is the clone's own QEMU's, and the DHCP
        # server in the state the clone copied ties the guest's address (the one forwarded to) to it.
        own_network = isinstance(lab.network(base), UserNetwork)
        kept = own_network or clone.same_identity  # --same-identity: the guest keeps its MACs
        mac = nic.mac if kept else derive_mac(lab.mac_prefix, lab.name, clone.name, index)
        nics.append(attrs.evolve(nic, mac=mac,
                                 ip=address if nic.ip is not None else None, network=network))
    folder = LabDir.of(lab.file, lab.name).vm(clone.name)
    disks = tuple(disk if disk.readonly else
                  attrs.evolve(disk, file=folder.disk_copy(index, disk.format.value), size=None, faults=())
                  for index, disk in enumerate(source.disks))
    return attrs.evolve(source, name=clone.name, nics=tuple(nics), disks=disks)


def with_clones(lab: LabSpec, clones: Sequence[Clone]) -> LabSpec:
    """The lab with its clones as VMs (after the spec's), and the copies of user networks their
    forwards need. A clone whose spec VM left the spec is left out: its lab is what the spec says."""
    known = {vm.name for vm in lab.vms}
    kept = [clone for clone in clones if clone.base in known and clone.name not in known]
    if not kept:
        return lab
    networks: list[Network] = list(lab.networks)
    by_name = {net.name: net for net in lab.networks}
    for clone in kept:
        for network, rules in clone.forwards:
            base = by_name.get(network)
            if isinstance(base, UserNetwork):
                networks.append(attrs.evolve(base, name=network_of(network, clone.name), forward=rules))
    with_networks = attrs.evolve(lab, networks=tuple(networks))
    vms = tuple(clone_spec(with_networks, clone) for clone in kept)
    return attrs.evolve(with_networks, vms=(*lab.vms, *vms))


def subnet_of(network: Network) -> str | None:
    return network.subnet if isinstance(network, (BridgeNetwork, SocketNetwork, TapNetwork)) else None
