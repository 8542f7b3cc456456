"""Every name vmlaunch derives, and the rules names must follow, in one place.

Derived names are stable across runs (a hash of what they belong to), so a lab comes back with the
same MACs, taps and multicast groups, and differ between labs.

Interface names: the default bridge of a network and the tap of a NIC are a 60-bit hash in base32 of
what they belong to, `vlb<12>` for bridges and `vl-<12>` for taps, 15 bytes (the kernel's limit); an
uplink's VLAN link is `UPLINK.VLAN` as administrators name them, `vlq<12>` when that is too long; the
IFB of a tap's netem is `vli` and the tap's 12. The lab and VM names the spec allows (up to 20 and 32
bytes) do not fit IFNAMSIZ whole, so no injective name exists; 60 bits are enough because:

- by accident: among n names the chance that any two collide is about n^2 / 2^61, one in 2 * 10^10
  for 10,000 interfaces on one host;
- on purpose: taking another lab's name needs a second preimage of SHA-256 cut to 60 bits, ~2^60
  hashes (centuries of CPU time); a birthday collision (~2^30 hashes, minutes) needs both names
  chosen by the attacker, so it only hits the attacker's own labs;
- and whatever happens, an interface vmlaunch creates carries a mark (its ifalias, `vmlaunch lab=...`)
  and vmlaunch never deletes an interface whose mark is not the lab's own: a collision is refused, it
  never removes another lab's interface.

The previous names were `vl-{lab}-{network}` (not injective: lab `p` network `q-r` and lab `p-q`
network `r` shared a bridge) and a 32-bit hash for taps (collisions found in under a second).
"""

from __future__ import annotations

import base64
import hashlib
import re

IFNAMSIZ = 16  # the kernel's limit for interface names, including the terminating NUL
DEFAULT_MAC_PREFIX = "52:54:00"  # QEMU's and libvirt's locally administered range
NAME_HASH_CHARS = 12  # base32: 5 bits each, 60 bits

# Printable ASCII without the space. The kernel takes any other byte too (control characters,
# non-ASCII); such names cannot be shown or typed safely, and a trailing newline passes `$`.
_INTERFACE_NAME = re.compile(r"[!-~]+")

MARK = "vmlaunch"  # the first word of the ifalias of every interface vmlaunch creates
_MARK_FIELD = re.compile(r"([a-z]+)=([!-~]+)")


def interface_name_problem(name: str) -> str | None:
    """Why `name` cannot be a network interface name vmlaunch creates or uses, or None.

    At least as strict as the kernel's dev_valid_name (net/core/dev.c): 1 to IFNAMSIZ - 1 bytes, not
    "." or "..", no '/', ':' or white space; also no '%' (a format to the kernel) and nothing but
    printable ASCII (no NUL, control characters, or non-ASCII).
    """
    if not name:
        return "an interface name must not be empty"
    if len(name.encode()) >= IFNAMSIZ:
        return f"{name!r} is {len(name.encode())} bytes; interface names have at most {IFNAMSIZ - 1}"
    if name in (".", "..") or any(c in name for c in "/:") or any(c.isspace() for c in name):
        return f"{name!r} is not a valid interface name (no '/', ':' or spaces; not '.' or '..')"
    if "%" in name:
        return f"{name!r} is not a valid interface name (no '%': the kernel reads \"%d\" as a number to pick)"
    if _INTERFACE_NAME.fullmatch(name) is None:
        return f"{name!r} is not a valid interface name (printable ASCII only: no NUL, control or non-ASCII)"
    return None


def _name_hash(*parts: str) -> str:
    """NAME_HASH_CHARS of base32 (lower case) of SHA-256 over `parts`, which never hold a NUL."""
    digest = hashlib.sha256("\0".join(parts).encode()).digest()
    return base64.b32encode(digest).decode().lower()[:NAME_HASH_CHARS]


def default_bridge_name(lab: str, network: str) -> str:
    """The bridge of a network whose spec names none: vlb<60-bit hash of lab and network>."""
    return f"vlb{_name_hash('bridge', lab, network)}"


def tap_name(lab: str, vm: str, index: int) -> str:
    """The tap of NIC `index` of a VM: vl-<60-bit hash of lab, VM and NIC index>.

    Never equal to a default bridge name (the third character differs).
    """
    return f"vl-{_name_hash('tap', lab, vm, str(index))}"


def netem_ifb_name(tap: str) -> str:
    """The IFB that a tap's ingress (what its VM sends) is redirected to for netem: `vli` and the tap's
    hash, so named from the tap and found with it. Marked as the lab's like the tap (kind "ifb").

    Never a default bridge's, a tap's nor a VLAN link's name (the third character differs)."""
    return f"vli{tap[3:]}"


def vlan_link_name(uplink: str, vlan: int) -> str:
    """The 802.1Q link of `uplink` for VLAN `vlan`: `eth1.42`, as `ip link` and ifupdown name it, or
    vlq<60-bit hash of uplink and VLAN> when that does not fit in IFNAMSIZ (`enp0s31f6u2.4000`).

    Never a default bridge's nor a tap's name (the third character differs from theirs)."""
    name = f"{uplink}.{vlan}"
    if interface_name_problem(name) is None:
        return name
    return f"vlq{_name_hash('vlan', uplink, str(vlan))}"


def interface_mark(lab: str, **fields: str) -> str:
    """The ifalias vmlaunch gives an interface it creates: `vmlaunch lab=LAB key=value ...`."""
    return " ".join([MARK, f"lab={lab}", *(f"{key}={value}" for key, value in fields.items())])


def mark_fields(alias: str | None) -> dict[str, str] | None:
    """The fields of a vmlaunch mark (always with "lab"), None when `alias` is not one."""
    words = (alias or "").split(" ")
    if words[0] != MARK:
        return None
    fields: dict[str, str] = {}
    for word in words[1:]:
        found = _MARK_FIELD.fullmatch(word)
        if found is None or found[1] in fields:
            return None
        fields[found[1]] = found[2]
    return fields if "lab" in fields else None


def mark_lab(alias: str | None) -> str | None:
    """The lab a vmlaunch mark names, None when `alias` is not a vmlaunch mark."""
    fields = mark_fields(alias)
    return None if fields is None else fields["lab"]


def derive_mac(prefix: str, lab: str, vm: str, index: int | str) -> str:
    """A MAC that is stable across runs and differs between labs, VMs and NICs."""
    digest = hashlib.sha256(f"{lab}\0{vm}\0{index}".encode()).digest()
    return prefix.lower() + "".join(f":{byte:02x}" for byte in digest[:3])


def management_mac(prefix: str, lab: str, vm: str) -> str:
    """The MAC of a VM's management NIC (its SSH port on QEMU's user network): a spec NIC's index is
    never "mgmt", so it cannot be one of theirs unless the 24-bit hashes meet (the builder checks)."""
    return derive_mac(prefix, lab, vm, "mgmt")


def is_multicast_mac(mac: str) -> bool:
    return bool(int(mac[:2], 16) & 1)


def derive_mcast(lab: str, network: str) -> str:
    """A multicast group:port in the administratively scoped 239/8, distinct per (lab, network)."""
    digest = hashlib.sha256(f"{lab}\0{network}".encode()).digest()
    port = 20000 + int.from_bytes(digest[3:5], "big") % 40000
    return f"239.{digest[0]}.{digest[1]}.{digest[2] or 1}:{port}"


def normalise_pci_address(text: str) -> str:
    """ "15:00.0" -> "0000:15:00.0"."""
    text = text.lower()
    return text if text.count(":") == 2 else f"0000:{text}"


def process_name(vm: str) -> str:
    """QEMU's process name (`-name process=`): shows in ps and top."""
    return f"vl-{vm}"


def nft_table_name(lab: str) -> str:
    """The lab's nftables table (`vmlaunch partition`): a lab name ([a-z0-9-], starting with neither
    '-') is a valid nft identifier after `vmlaunch-`, and no two labs share one."""
    return f"vmlaunch-{lab}"


def cgroup_name(lab: str, vm: str) -> str:
    """A VM's cpuset cgroup: '.' is in no lab or VM name, so no two VMs of any labs share one."""
    return f"vmlaunch.{lab}.{vm}"


def is_pci_address(text: str) -> bool:
    """A normalised PCI address: "0000:15:00.0" (domain:bus:slot.function, lower case)."""
    return re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", text) is not None


def is_driver_name(name: str) -> bool:
    """A kernel driver name as it appears under /sys/bus/pci/drivers (never a path)."""
    return re.fullmatch(r"[A-Za-z0-9_.+-]+", name) is not None and name not in (".", "..")
