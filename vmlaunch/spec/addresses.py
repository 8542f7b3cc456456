"""Static IPv4 addresses of NICs: checked against their network's subnet, unique per network, and
derived (stable: from the lab, VM and NIC index) for a NIC on a subnet that names none.

Pure: the spec builder calls `assign` with what it parsed and reports the problems it returns.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable
from typing import Optional

import attrs

from vmlaunch.errors import KeyPath, format_key_path

MAX_PREFIX = 30  # a /31 or /32 has no room for guests


@attrs.frozen
class Wanted:
    """One NIC as the spec gives it: where it is, its network's subnet, and its `ip` if any."""

    path: KeyPath
    network: str
    subnet: ipaddress.IPv4Network | None
    ip: str | None
    seed: str  # what a derived address hashes: "lab/vm/index"


Problem = tuple[KeyPath, str, Optional[str]]  # where (the NIC's key, or its "ip"), message, hint


def parse_subnet(text: str) -> tuple[ipaddress.IPv4Network | None, str | None]:
    """The network of `subnet = "..."`, or a problem."""
    try:
        net = ipaddress.IPv4Network(text, strict=False)
    except ValueError as exc:
        return None, f"{text!r} is not an IPv4 network: {exc}"
    if str(net) != text.strip():
        return None, f"{text!r} has host bits set: the network is {net}"
    if net.prefixlen > MAX_PREFIX:
        return None, f"{text!r} has no room for guests (at most /{MAX_PREFIX})"
    return net, None


def assign(nics: Iterable[Wanted]) -> tuple[dict[KeyPath, str], list[Problem]]:
    """Every NIC's address as "a.b.c.d/prefix" (only those that have one), and the problems.

    Given addresses are checked first, so a derived one never takes an address a NIC names, whatever
    the order of the VMs in the spec. A derived address is the first free one from a hash of the NIC's
    seed, skipping the network and broadcast addresses and the first host (a gateway's by custom)."""
    wanted = list(nics)
    addresses: dict[KeyPath, str] = {}
    problems: list[Problem] = []
    taken: dict[tuple[str, ipaddress.IPv4Address], KeyPath] = {}
    for nic in wanted:
        if nic.ip is None:
            continue
        found = _given(nic, problems)
        if found is None:
            continue
        address, prefix = found
        first = taken.get((nic.network, address))
        if first is not None:
            problems.append(((*nic.path, "ip"), f"{address} is also the address of {_key(first)}",
                             "every NIC on a network needs its own address"))
            continue
        taken[(nic.network, address)] = nic.path
        addresses[nic.path] = f"{address}/{prefix}"
    for nic in wanted:
        if nic.ip is not None or nic.subnet is None:
            continue
        derived = _derive(nic, {a for (net, a) in taken if net == nic.network})
        if derived is None:
            problems.append((nic.path, f"network {nic.network!r}: subnet {nic.subnet} has no free "
                             "address left", "a larger subnet"))
            continue
        taken[(nic.network, derived)] = nic.path
        addresses[nic.path] = f"{derived}/{nic.subnet.prefixlen}"
    return addresses, problems


def _given(nic: Wanted, problems: list[Problem]) -> tuple[ipaddress.IPv4Address, int] | None:
    assert nic.ip is not None
    where = (*nic.path, "ip")
    try:
        interface = ipaddress.IPv4Interface(nic.ip)
    except ValueError as exc:
        problems.append((where, f"{nic.ip!r} is not an IPv4 address: {exc}", None))
        return None
    address = interface.ip
    if "/" not in nic.ip:
        if nic.subnet is None:
            problems.append((where, f"{nic.ip!r} has no prefix, and network {nic.network!r} no subnet",
                             f'write "{nic.ip}/24", or give the network subnet = "..."'))
            return None
        prefix = nic.subnet.prefixlen
    else:
        prefix = interface.network.prefixlen
        if prefix > MAX_PREFIX:
            problems.append((where, f"{nic.ip!r}: a /{prefix} has no room for other hosts", None))
            return None
    network = nic.subnet or interface.network
    if address not in network:
        problems.append((where, f"{address} is outside network {nic.network!r}'s subnet {network}", None))
        return None
    if nic.subnet is not None and "/" in nic.ip and prefix != nic.subnet.prefixlen:
        problems.append((where, f"{nic.ip!r}: the prefix differs from the subnet's ({nic.subnet})",
                         f'write "{address}"'))
        return None
    if address in (network.network_address, network.broadcast_address):
        what = "network" if address == network.network_address else "broadcast"
        problems.append((where, f"{address} is the {what} address of {network}", None))
        return None
    if address.is_multicast or address.is_loopback or address.is_unspecified:
        problems.append((where, f"{address} cannot be a NIC's address", None))
        return None
    return address, prefix


def _derive(nic: Wanted, used: set[ipaddress.IPv4Address]) -> ipaddress.IPv4Address | None:
    assert nic.subnet is not None
    hosts = nic.subnet.num_addresses - 3  # not the network, the first host or the broadcast
    if hosts <= 0:
        return None
    start = int.from_bytes(hashlib.sha256(nic.seed.encode()).digest()[:8], "big") % hosts
    base = int(nic.subnet.network_address) + 2
    for step in range(hosts):
        address = ipaddress.IPv4Address(base + (start + step) % hosts)
        if address not in used:
            return address
    return None


def _key(path: KeyPath) -> str:
    return format_key_path(path)


