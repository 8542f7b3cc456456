"""A multi-host lab's hosts, read from their libvirt URIs, and the names of what the lab makes on them.

Pure: nothing here connects anywhere (host/remote.py does).

- `HostUri`: what a `[host.NAME] uri` says: its transport, and for `qemu+ssh` the user, host, port
  and key file that vmlaunch's own SSH to the host uses too (for its host-side links).
- `vni(lab, network)`: the VXLAN network identifier of a lab network that spans hosts: the first 24
  bits of SHA-256 of `LAB/NETWORK`, never 0. Two labs (or two networks) get the same VNI with a
  chance of 1 in 16.7 million per pair; each network's VXLAN also has its own peers.
- Names on every host: the pool `vmlaunch-LAB`, domains and networks `LAB-NAME` (as `export --to
  libvirt`), the VXLAN link `vx` + 10 hex digits of the same hash.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from urllib.parse import parse_qs, unquote, urlsplit

import attrs

from vmlaunch.spec.model import BridgeNetwork, HostSpec, LabSpec

VXLAN_PORT = 4789  # IANA's VXLAN port: what `doctor` checks each host's firewall lets in
VXLAN_OVERHEAD = 50  # outer Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8: what a spanning network's MTU loses
VXLAN_OVERHEAD_V6 = 70  # over IPv6: its header is 40 bytes
DEFAULT_MTU = 1500
SSH_PORT = 22
# Transports whose host vmlaunch can work on itself: the local machine, or SSH as the URI says it.
SSH_TRANSPORTS = ("ssh", "libssh", "libssh2")
LOCAL_TRANSPORTS = ("", "unix")


@attrs.frozen
class HostUri:
    """A libvirt URI taken apart (https://libvirt.org/uri.html)."""

    uri: str
    driver: str  # qemu
    transport: str  # "" (local), unix, ssh, libssh, libssh2, tcp, tls, ext
    user: str | None
    hostname: str | None  # None: this machine
    port: int | None
    keyfile: str | None  # the `keyfile=` parameter
    no_verify: bool  # `no_verify=1`: the host's SSH key is not checked

    @property
    def local(self) -> bool:
        """This machine's own libvirtd."""
        return self.transport in LOCAL_TRANSPORTS and self.hostname in (None, "", "localhost")

    @property
    def ssh(self) -> bool:
        return self.transport in SSH_TRANSPORTS

    @property
    def shell(self) -> bool:
        """vmlaunch can run commands on the host (its host-side links): here, or over SSH."""
        return self.local or self.ssh

    def ssh_argv(self, *, batch: bool = True) -> list[str]:
        """`ssh` to the host with the user, port and key of the URI, options first, the host last."""
        argv = ["ssh", "-o", "ConnectTimeout=10"]
        if batch:
            argv += ["-o", "BatchMode=yes"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.keyfile:
            argv += ["-i", self.keyfile]
        if self.no_verify:
            argv += ["-o", "StrictHostKeyChecking=no"]
        argv.append(self.target)
        return argv

    @property
    def target(self) -> str:
        """user@host, or host."""
        return f"{self.user}@{self.hostname}" if self.user else str(self.hostname)


class BadUri(ValueError):
    """A URI libvirt would not take; the message says why."""


def parse_uri(uri: str) -> HostUri:
    if any(ord(ch) < 0x21 for ch in uri):
        raise BadUri("a libvirt URI has no spaces or control characters")
    parts = urlsplit(uri)
    scheme = parts.scheme
    if not scheme:
        raise BadUri("a libvirt URI starts with its driver, like qemu:///system or qemu+ssh://host/system")
    driver, _, transport = scheme.partition("+")
    if driver != "qemu":
        raise BadUri(f"vmlaunch runs QEMU domains: the URI's driver is {driver!r}, not qemu")
    if transport not in (*LOCAL_TRANSPORTS, *SSH_TRANSPORTS, "tcp", "tls", "ext"):
        raise BadUri(f"{transport!r} is not a libvirt transport (ssh, libssh, libssh2, tcp, tls, unix, ext)")
    if parts.path not in ("/system", "/session"):
        raise BadUri(f"the URI's path is {parts.path or 'missing'}: /system (or /session)")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise BadUri("the URI's port is not a number from 1 to 65535")
    if parts.hostname and not re.fullmatch(r"[A-Za-z0-9_.:\[\]-]+", parts.hostname) or \
            (parts.hostname or "").startswith("-") or (parts.username or "").startswith("-"):
        raise BadUri("the URI's host and user are names or addresses (letters, digits, '.', '-', '_', ':'), "
                     "not starting with '-'")
    query = parse_qs(parts.query)
    keyfile = query.get("keyfile", [None])[-1]
    hostname = parts.hostname
    if transport and transport not in LOCAL_TRANSPORTS and not hostname:
        raise BadUri(f"a {transport} URI names its host: qemu+{transport}://HOST/system")
    return HostUri(
        uri=uri,
        driver=driver,
        transport=transport,
        user=unquote(parts.username) if parts.username else None,
        hostname=hostname,
        port=port,
        keyfile=keyfile,
        no_verify=query.get("no_verify", ["0"])[-1] == "1",
    )


def tunnel_address(host: HostSpec) -> str | None:
    """Where the other hosts send a spanning network's VXLAN packets: `address`, else the URI's host
    when it is an IP address (a name is looked up on the host itself, at `up`). None: not known (a
    local URI without `address`)."""
    if host.address is not None:
        return host.address
    return parse_uri(host.uri).hostname or None


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _digest(lab: str, network: str) -> bytes:
    return hashlib.sha256(f"{lab}/{network}".encode()).digest()


def vni(lab: str, network: str) -> int:
    """The VXLAN network identifier of a spanning network (1 .. 2^24-1)."""
    return int.from_bytes(_digest(lab, network)[:3], "big") or 1


def vxlan_name(lab: str, network: str) -> str:
    """The VXLAN link's name on each host (at most 15 bytes)."""
    return "vx" + _digest(lab, network)[:5].hex()


def pool_name(lab: str) -> str:
    return f"vmlaunch-{lab}"


def spanning_mtu(net: BridgeNetwork, *, ipv6: bool = False) -> int:
    """A spanning network's MTU: its own (1500 when it says none) less the encapsulation (50 bytes over
    IPv4, 70 over IPv6). The underlay between the hosts must carry packets of the network's own MTU."""
    return (net.mtu or DEFAULT_MTU) - (VXLAN_OVERHEAD_V6 if ipv6 else VXLAN_OVERHEAD)


def host_addresses(lab: LabSpec, net: BridgeNetwork, hosts: tuple[str, ...]) -> dict[str, str]:
    """Each host's own address on a bridge network with a subnet, which `vmlaunch ssh` jumps through:
    the subnet's first host address (a gateway's by custom, never given to a NIC by the subnet) for the
    network's first host, then its last, last but one ... for the others. An address a NIC of the lab
    has is skipped: that host gets none."""
    if net.subnet is None:
        return {}
    subnet = ipaddress.ip_network(net.subnet, strict=False)
    used = {nic.ip.split("/")[0] for vm in lab.vms for nic in vm.nics if nic.ip and nic.network == net.name}
    found = {}
    for index, host in enumerate(hosts):
        if subnet.num_addresses < 4 + index:
            break
        address = subnet.network_address + 1 if index == 0 else subnet.broadcast_address - index
        if str(address) not in used:
            found[host] = f"{address}/{subnet.prefixlen}"
    return found


def spanning(lab: LabSpec, placement: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Each bridge network whose VMs sit on more than one host: its hosts, in the spec's order."""
    found = {}
    order = [host.name for host in lab.hosts]
    for net in lab.networks:
        if not isinstance(net, BridgeNetwork):
            continue
        hosts = {
            placement[vm.name]
            for vm in lab.vms
            if vm.name in placement and any(nic.network == net.name for nic in vm.nics)
        }
        if len(hosts) > 1:
            found[net.name] = tuple(name for name in order if name in hosts)
    return found
