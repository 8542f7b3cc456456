"""A lab's network checks: the uplinks its bridges enslave and the MTUs along the way."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from vmlaunch.doctor.findings import GUIDE, Finding, Status, where
from vmlaunch.spec.model import BridgeNetwork, LabSpec


def mtu(sysfs: Path, ifname: str) -> int | None:
    try:
        return int((sysfs / "class" / "net" / ifname / "mtu").read_text().strip())
    except (OSError, ValueError):
        return None


def lro(uplink: str) -> tuple[bool | None, str]:
    """Whether large receive offload is on (`ethtool -k`): (on, what ethtool said); None: unknown."""
    ethtool = shutil.which("ethtool")
    if ethtool is None:
        return None, "ethtool is not installed"
    try:
        done = subprocess.run([ethtool, "-k", uplink], capture_output=True, text=True, timeout=10,
                              check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    for line in done.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "large-receive-offload":
            return value.split()[0] == "on" if value.split() else None, line.strip()
    return None, (done.stderr.strip() or "ethtool did not say").splitlines()[0]


def check_network(lab: LabSpec, sysfs: Path) -> Iterator[Finding]:
    for net in lab.networks:
        if not isinstance(net, BridgeNetwork):
            continue
        if net.uplink is not None:
            yield from _uplink(lab, net, sysfs, net.uplink)
        yield from _mtus(lab, net, sysfs)


def _uplink(lab: LabSpec, net: BridgeNetwork, sysfs: Path, uplink: str) -> Iterator[Finding]:
    at = where(lab, ("network", net.name, "uplink"))
    if not (sysfs / "class" / "net" / uplink).exists():
        yield Finding("net.uplink", Status.FAIL, f"the uplink {uplink} of bridge {net.bridge} does not exist",
                      "up enslaves it to the bridge so guests reach the physical network",
                      f"name an interface of this host (ip link) in network.{net.name}.uplink", at)
        return
    on, said = lro(uplink)
    why = (f"Linux bridges cannot forward LRO packets, only GRO ones: with LRO on, guests behind the bridge "
           f"lose the uplink's received traffic or see it mangled ({GUIDE})")
    if on is None:
        yield Finding("net.lro", Status.NOTE, f"{uplink}: large receive offload unknown ({said})", why,
                      "apt-get install ethtool, then vmlaunch doctor again")
    elif on:
        yield Finding("net.lro", Status.WARN, f"{uplink}: {said}", why, f"ethtool -K {uplink} lro off", at)
    else:
        yield Finding("net.lro", Status.OK, f"{uplink}: {said}", why)


def _mtus(lab: LabSpec, net: BridgeNetwork, sysfs: Path) -> Iterator[Finding]:
    found = {name: mtu(sysfs, name) for name in (net.bridge, net.uplink) if name}
    wanted = net.mtu
    why = ("a frame larger than the smallest MTU on its way is dropped (jumbo frames need 9000 everywhere: "
           "guest, tap, bridge and uplink)")
    problems = []
    if wanted is not None:
        problems += [f"{name} has MTU {value}, the lab asks for {wanted}" for name, value in found.items()
                     if value is not None and value < wanted and name == net.uplink]
        bridge = found.get(net.bridge)
        if bridge is not None and bridge != wanted:
            problems.append(f"bridge {net.bridge} exists with MTU {bridge}, the lab asks for {wanted}")
    elif net.uplink and found.get(net.uplink) and found.get(net.bridge) and \
            found[net.uplink] != found[net.bridge]:
        problems.append(f"bridge {net.bridge} has MTU {found[net.bridge]}, its uplink {net.uplink} "
                        f"{found[net.uplink]}")
    if problems:
        fix = (f"ip link set {net.uplink} mtu {wanted}" if wanted and net.uplink else
               f"set network.{net.name}.mtu to the uplink's MTU")
        yield Finding("net.mtu", Status.WARN, "; ".join(problems), why, fix,
                      where(lab, ("network", net.name, "mtu" if wanted else "uplink")))
    elif found and any(value is not None for value in found.values()):
        shown = ", ".join(f"{name} {value}" for name, value in found.items() if value is not None)
        yield Finding("net.mtu", Status.OK, f"network {net.name}: MTUs agree ({shown})", why)
