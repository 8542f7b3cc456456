"""Every name vmlaunch derives, and the rules names must follow, in one place.

Derived names are stable across runs (a hash of what they belong to), so a lab comes back with the
same MACs, taps and multicast groups, and differ between labs.
"""

from __future__ import annotations

import hashlib

IFNAMSIZ = 16  # the kernel's limit for interface names, including the terminating NUL
DEFAULT_MAC_PREFIX = "52:54:00"  # QEMU's and libvirt's locally administered range


def interface_name_problem(name: str) -> str | None:
    """Why the kernel would refuse `name` as a network interface name, or None."""
    if not name:
        return "an interface name must not be empty"
    if len(name.encode()) >= IFNAMSIZ:
        return f"{name!r} is {len(name.encode())} bytes; interface names have at most {IFNAMSIZ - 1}"
    if name in (".", "..") or any(c in name for c in "/:") or any(c.isspace() for c in name):
        return f"{name!r} is not a valid interface name (no '/', ':' or spaces; not '.' or '..')"
    return None


def default_bridge_name(lab: str, network: str) -> str:
    return f"vl-{lab}-{network}"


def tap_name(lab: str, vm: str, index: int) -> str:
    """A tap name that fits IFNAMSIZ, is stable, and differs between labs: vl-<hash>-<nic>."""
    digest = hashlib.sha256(f"{lab}\0{vm}".encode()).hexdigest()
    return f"vl-{digest[:8]}-{index}"


def derive_mac(prefix: str, lab: str, vm: str, index: int) -> str:
    """A MAC that is stable across runs and differs between labs, VMs and NICs."""
    digest = hashlib.sha256(f"{lab}\0{vm}\0{index}".encode()).digest()
    return prefix.lower() + "".join(f":{byte:02x}" for byte in digest[:3])


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


def is_pci_address(text: str) -> bool:
    """A normalised PCI address: "0000:15:00.0" (domain:bus:slot.function, lower case)."""
    import re

    return re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", text) is not None


def is_driver_name(name: str) -> bool:
    """A kernel driver name as it appears under /sys/bus/pci/drivers (never a path)."""
    import re

    return re.fullmatch(r"[A-Za-z0-9_.+-]+", name) is not None and name not in (".", "..")
