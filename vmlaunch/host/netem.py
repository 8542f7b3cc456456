"""netem on the host side of a NIC: its tap, over netlink (pyroute2), and whether this kernel has netem.

A tap's directions are the VM's reversed: what the tap transmits (its root qdisc) goes to the VM, what
it receives (its ingress) is what the VM sends. Ingress has no queue to delay in, so that traffic is
redirected to an IFB (`naming.netem_ifb_name`: named from the tap, marked as the lab's) and shaped on
the IFB's root qdisc:

    VM sends -> tap ingress -> u32 match-all, mirred redirect -> IFB root: netem (every figure)
    VM gets  <- tap root: netem (rate only, when a rate is set)

So delay, jitter, loss, corrupt, duplicate and reorder apply once per round trip (to what the VM
sends), and rate to each direction. Setting a NIC's netem replaces what was set before.

pyroute2 is imported where it is used (host/links.py's `netlink`), never at module level.
"""

from __future__ import annotations

import errno
import gzip
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vmlaunch.core.naming import interface_mark
from vmlaunch.errors import HostError
from vmlaunch.host.links import IFB_KIND, TUN_KIND, Link, LinkError, Netlink
from vmlaunch.spec.model import Netem

CONFIG = "CONFIG_NET_SCH_NETEM"
INGRESS_HANDLE = 0xFFFF0000  # ffff: the ingress qdisc's handle, and the parent of its filters
ROOT_HANDLE = 0x10000  # 1:
ETH_P_ALL = 0x0003
MATCH_ALL = "0x0/0x0+0"  # a u32 key every packet matches (cls_u32: matchall is not in every kernel)
FILTER_PRIO = 1
GONE = (errno.ENOENT, errno.EINVAL, errno.ENODEV)  # "no such qdisc" as kernels say it


def no_netem(detail: str = "") -> HostError:
    """The host kernel has no netem: exit 3, naming what is missing."""
    return HostError(f"this host's kernel has no netem ({CONFIG} is not set){detail}",
                     "use --where guest (the guest's own tc and netem, through its command channel), or a "
                     f"kernel built with {CONFIG} (modprobe sch_netem)")


# --- does this kernel have netem? --------------------------------------------------------------------


def netem_in_config(text: str) -> bool | None:
    """From a kernel config: True (=y or =m), False (not set), None (the config does not say)."""
    for line in text.splitlines():
        if line.startswith(f"{CONFIG}="):
            return line.split("=", 1)[1].strip() in ("y", "m")
        if line.strip() == f"# {CONFIG} is not set":
            return False
    return None


def kernel_has_netem(proc: Path = Path("/proc"), boot: Path = Path("/boot"), sys_root: Path = Path("/sys"),
                     modules: Path = Path("/lib/modules"), release: str | None = None) -> bool | None:
    """Whether the host kernel has sch_netem, from what it says of itself, without side effects: loaded
    (/sys/module), its config (/proc/config.gz, /boot/config-RELEASE), its module lists
    (modules.builtin, modules.dep). None when none of them says."""
    release = release or os.uname().release
    if (sys_root / "module" / "sch_netem").exists():
        return True
    for config in (proc / "config.gz", boot / f"config-{release}"):
        try:
            data = config.read_bytes()
            if config.suffix == ".gz":
                data = gzip.decompress(data)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        said = netem_in_config(data.decode(errors="replace"))
        if said is not None:
            return said
    lists = [modules / release / name for name in ("modules.builtin", "modules.dep")]
    if any(path.exists() for path in lists):
        return any(_names_netem(path) for path in lists)
    return None


def _names_netem(path: Path) -> bool:
    try:
        return "sch_netem.ko" in path.read_text(errors="replace")
    except OSError:
        return False


# A child in a network namespace of its own adds netem to its own loopback: nothing on the host changes
# (a module the kernel loads on demand aside), and the namespace goes with the child.
_PROBE = """
import ctypes, sys
CLONE_NEWNET = 0x40000000
if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
    sys.exit(2)
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
with IPRoute() as ipr:
    lo = ipr.link_lookup(ifname="lo")[0]
    try:
        ipr.tc("add", "netem", lo, 0x10000, delay=1000)
    except NetlinkError:
        sys.exit(1)
"""


def probe_netem() -> bool | None:
    """Ask the kernel: add netem to the loopback of a throwaway network namespace (needs root). None when
    the probe cannot run."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(done.returncode)


def host_has_netem() -> bool:
    """Whether netem can run on this host: what the kernel says of itself, else the probe."""
    said = kernel_has_netem()
    if said is None:
        said = probe_netem()
    return bool(said)


# --- the netlink requests ----------------------------------------------------------------------------


def netem_options(netem: Netem, *, rate_only: bool = False) -> dict[str, Any]:
    """pyroute2's netem options (sched_netem.get_parameters): delay and jitter in microseconds,
    percentages as they are, the rate in bytes per second (TCA_NETEM_RATE)."""
    options: dict[str, Any] = {}
    if netem.rate_bit is not None:
        options["rate"] = max(1, netem.rate_bit // 8)
    if rate_only:
        return options
    if netem.delay_ms is not None:
        options["delay"] = round(netem.delay_ms * 1000)
    if netem.jitter_ms is not None:
        options["jitter"] = round(netem.jitter_ms * 1000)
    for key, option in (("loss", "loss"), ("duplicate", "duplicate"), ("corrupt", "prob_corrupt"),
                        ("reorder", "prob_reorder")):
        value = getattr(netem, key)
        if value is not None:
            options[option] = value
    return options


def redirect_action(ifb: Link) -> dict[str, Any]:
    """`action mirred egress redirect dev IFB`."""
    return {"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": ifb.index}


def our_ifb(link: Link, lab: str) -> bool:
    return link.kind == IFB_KIND and link.lab == lab


def apply_on_tap(nl: Netlink, lab: str, vm: str, tap_name: str, ifb_name: str, netem: Netem) -> None:
    """Set `netem` on the tap of a NIC (replacing what was set): every figure on the IFB its ingress is
    redirected to, the rate on its root qdisc as well. A kernel without netem is a HostError (exit 3)."""
    tap = nl.get(tap_name)
    if tap is None or tap.kind != TUN_KIND or tap.lab != lab:
        what = "does not exist" if tap is None else f"is {tap.describe()}, {tap.owner_text()}"
        raise LinkError(tap_name, f"the tap of {vm} {what}", hint="is the VM up? (`vmlaunch status`)")
    ifb = _ifb(nl, lab, vm, tap, ifb_name)
    try:
        nl.tc(ifb, "setting netem on it", "replace", "netem", handle=ROOT_HANDLE, **netem_options(netem))
        nl.tc(tap, "adding its ingress qdisc", "replace", "ingress", handle=INGRESS_HANDLE)
        nl.tc(tap, f"redirecting its ingress to {ifb_name}", "replace-filter", "u32", parent=INGRESS_HANDLE,
              prio=FILTER_PRIO, protocol=ETH_P_ALL, keys=[MATCH_ALL], action=redirect_action(ifb))
        if netem.rate_bit is not None:
            nl.tc(tap, "setting netem's rate on it", "replace", "netem", handle=ROOT_HANDLE,
                  **netem_options(netem, rate_only=True))
        else:
            _delete_qdisc(nl, tap, "root")
    except LinkError as exc:
        if exc.code in (errno.ENOENT, errno.EOPNOTSUPP):  # "Specified qdisc kind is unknown"
            raise no_netem(f" ({exc.message})") from exc
        raise


def _ifb(nl: Netlink, lab: str, vm: str, tap: Link, name: str) -> Link:
    """The NIC's IFB: made (marked as the lab's, up) when missing; one of that name that is not the lab's
    IFB is refused."""
    ifb = nl.get(name)
    if ifb is not None:
        if not our_ifb(ifb, lab):
            raise LinkError(name, f"the IFB for the netem of tap {tap.name} cannot be made: an interface "
                            f"of that name is {ifb.describe()}, {ifb.owner_text()}")
        return ifb
    if not nl.add(name, f"creating the IFB for the netem of tap {tap.name}", kind=IFB_KIND):
        raise LinkError(name, "an interface of that name appeared while creating the IFB")
    ifb = nl.require(name, "after creating it")
    nl.mark(ifb, interface_mark(lab, vm=vm, tap=tap.name))
    nl.set(ifb, "bringing it up", state="up")
    return nl.require(name, "after bringing it up")


def _delete_qdisc(nl: Netlink, link: Link, which: str) -> None:
    """Delete the root (or ingress) qdisc of `link`; none there is nothing to do."""
    try:
        if which == "ingress":  # the plugin says its parent (TC_H_INGRESS)
            nl.tc(link, "deleting its ingress qdisc", "del", "ingress", handle=INGRESS_HANDLE)
        else:
            nl.tc(link, "deleting its root qdisc", "del", root=True, handle=ROOT_HANDLE)
    except LinkError as exc:
        if exc.code not in GONE:
            raise


def clear_on_tap(nl: Netlink, lab: str, tap_name: str, ifb_name: str) -> None:
    """Undo `apply_on_tap`: the tap's root and ingress qdiscs (when the tap is still there) and the IFB
    (when it is the lab's)."""
    tap = nl.get(tap_name)
    if tap is not None and tap.kind == TUN_KIND and tap.lab == lab:
        _delete_qdisc(nl, tap, "root")
        _delete_qdisc(nl, tap, "ingress")
    ifb = nl.get(ifb_name)
    if ifb is not None and our_ifb(ifb, lab):
        nl.delete(ifb)


def lab_ifbs(links: Iterable[Link], lab: str, vms: Iterable[str] | None = None) -> list[Link]:
    """The IFBs marked as the lab's (those of `vms` only, when given)."""
    from vmlaunch.core.naming import mark_fields

    wanted = None if vms is None else set(vms)
    found = []
    for link in links:
        fields = mark_fields(link.alias) or {}
        if our_ifb(link, lab) and (wanted is None or fields.get("vm") in wanted):
            found.append(link)
    return found
