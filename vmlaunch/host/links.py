"""Host network links (bridges, taps, uplinks and their 802.1Q VLAN links) over netlink: the layer the
bridge and tap resources use.

Every netlink failure becomes a `LinkError` naming the interface and what was being done.

pyroute2 costs ~200 ms to import: it is imported inside the functions that talk to the kernel, never at
module level, so that `vmlaunch validate` and `cmdline` do not pay for it.

Coverage: this runs only inside private network namespaces (tests/netns_links.py and the end-to-end
tests, both subprocesses), which `make test`'s in-process coverage figure does not see.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs

from vmlaunch.core.naming import interface_name_problem, mark_lab
from vmlaunch.errors import EXIT_HOST, RuntimeFailure, needs_root

# the kernel's IFLA_INFO_KIND of a tap (a tun device in tap mode), a bridge, an 802.1Q VLAN link
TUN_KIND = "tun"
BRIDGE_KIND = "bridge"
VLAN_KIND = "vlan"
IFB_KIND = "ifb"  # an intermediate functional block: where netem shapes what a tap receives
IFF_UP = 0x1

_R = TypeVar("_R")


class LinkError(RuntimeFailure):
    """A netlink operation on a host interface failed, or an interface is not what the lab needs.

    Refused for lack of privilege, it is a host error like every "needs root" (exit 3).
    """

    def __init__(self, interface: str, message: str, code: int | None = None,
                 hint: str | None = None) -> None:
        if code in (errno.EPERM, errno.EACCES):
            hint = hint or needs_root("creating and changing host network interfaces", "CAP_NET_ADMIN")
            self.exit_code = EXIT_HOST
        super().__init__(f"interface {interface}: {message}", hint)
        self.interface = interface
        self.code = code


# --- netlink, wrapped --------------------------------------------------------------------------------


@attrs.frozen
class Link:
    index: int
    name: str
    kind: str | None  # IFLA_INFO_KIND: "bridge", "tun" (taps), "veth", None (physical NICs, lo)
    master: int | None
    carrier: bool  # for a tap: a process (QEMU) has it open
    alias: str | None = None  # IFLA_IFALIAS: vmlaunch's mark on what it created (naming.interface_mark)
    up: bool = False  # IFF_UP: set administratively up
    parent: int | None = None  # IFLA_LINK of a VLAN link: the interface it is on
    vlan: int | None = None  # the VLAN id of a VLAN link

    @classmethod
    def parse(cls, msg: Any) -> Link:
        master = msg.get("master")
        alias = msg.get("ifalias")
        kind = msg.get(("linkinfo", "kind"))
        parent = msg.get("link") if kind == VLAN_KIND else None
        vlan = msg.get(("linkinfo", "data", "vlan_id")) if kind == VLAN_KIND else None
        return cls(index=int(msg["index"]), name=str(msg.get("ifname")), kind=kind,
                   master=int(master) if master else None, carrier=bool(msg.get("carrier")),
                   alias=str(alias) if alias else None, up=bool(int(msg.get("flags") or 0) & IFF_UP),
                   parent=int(parent) if parent else None, vlan=int(vlan) if vlan is not None else None)

    @property
    def lab(self) -> str | None:
        """The lab whose vmlaunch created this interface (its mark), None when not marked by vmlaunch."""
        return mark_lab(self.alias)

    def owner_text(self) -> str:
        """Whose it is, for a message: "lab demo's (marked ...)" or "not marked by vmlaunch"."""
        if self.lab is not None:
            return f"lab {self.lab}'s (marked {self.alias!r})"
        return "not marked by vmlaunch" + (f" (alias {self.alias!r})" if self.alias else "")

    def describe(self) -> str:
        if self.kind == VLAN_KIND:
            return f"VLAN {self.vlan} of interface #{self.parent}"
        return {BRIDGE_KIND: "a bridge", TUN_KIND: "a tun/tap device", IFB_KIND: "an IFB device",
                None: "a network device"}.get(
            self.kind, f"a {self.kind} device")


class Netlink:
    """One IPRoute socket; every failure becomes a LinkError naming the interface and the operation."""

    def __init__(self, ipr: Any) -> None:
        self._ipr = ipr

    def _call(self, ifname: str, doing: str, func: Callable[[], _R]) -> _R:
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            return func()
        except NetlinkError as exc:
            raise _netlink_error(ifname, doing, exc.code, exc.args) from exc
        except OSError as exc:
            raise _netlink_error(ifname, doing, exc.errno, (exc.errno, exc.strerror)) from exc

    def get(self, name: str) -> Link | None:
        """The interface called `name`, None when there is none."""
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            msgs = self._call(name, "looking it up", lambda: self._ipr.link("get", ifname=name))
        except LinkError as exc:
            if exc.code == errno.ENODEV and isinstance(exc.__cause__, NetlinkError):
                return None
            raise
        return Link.parse(msgs[0])

    def require(self, name: str, doing: str) -> Link:
        link = self.get(name)
        if link is None:
            raise LinkError(name, f"{doing}: it vanished")
        return link

    def links(self, ifname: str, doing: str) -> list[Link]:
        return [Link.parse(msg) for msg in self._call(ifname, doing, lambda: tuple(self._ipr.get_links()))]

    def ports(self, bridge: Link) -> list[Link]:
        return [link for link in self.links(bridge.name, "listing its ports") if link.master == bridge.index]

    def name_of(self, index: int) -> str:
        for link in self.links(f"#{index}", "listing interfaces"):
            if link.index == index:
                return link.name
        return f"interface #{index}"

    def add(self, name: str, doing: str, **kwargs: Any) -> bool:
        """Create an interface; False when one of that name appeared meanwhile (EEXIST)."""
        try:
            self._call(name, doing, lambda: self._ipr.link("add", ifname=name, **kwargs))
        except LinkError as exc:
            if exc.code == errno.EEXIST:
                return False
            raise
        return True

    def add_vlan(self, name: str, parent: Link, vlan: int) -> bool:
        """Create VLAN `vlan` of `parent` called `name`; False when one of that name appeared meanwhile.
        A kernel without 802.1Q is a host error (exit 3) that names the module to load."""
        try:
            return self.add(name, f"creating VLAN {vlan} of {parent.name}",
                            **vlan_request(parent.index, vlan))
        except LinkError as exc:
            if exc.code != errno.EOPNOTSUPP:
                raise
            from vmlaunch.host.memory import proc_root

            if not (proc_root() / "net" / "vlan").exists():  # 8021q is not loaded (nor could be)
                raise no_8021q(name, vlan, parent.name) from exc
            raise LinkError(parent.name, f"cannot carry VLAN {vlan}: the kernel refuses VLANs on it "
                            f"({parent.describe()})", code=exc.code,
                            hint="give the network an uplink that is an Ethernet device (or a bond, "
                            "a veth, a bridge)") from exc

    def set(self, link: Link, doing: str, **kwargs: Any) -> None:
        self._call(link.name, doing, lambda: self._ipr.link("set", index=link.index, **kwargs))

    def tc(self, link: Link, doing: str, command: str, kind: str | None = None, **kwargs: Any) -> Any:
        """One traffic-control request (qdisc or filter) on `link`: IPRoute.tc(command, kind, index)."""
        return self._call(link.name, doing, lambda: self._ipr.tc(command, kind, link.index, **kwargs))

    def mark(self, link: Link, mark: str) -> None:
        """Mark an interface vmlaunch created as its own (its ifalias, `ip link` shows it as alias)."""
        self.set(link, "marking it as vmlaunch's", ifalias=mark)

    def delete(self, link: Link) -> None:
        """Delete an interface; one already gone is not an error."""
        try:
            self._call(link.name, "deleting it", lambda: self._ipr.link("del", index=link.index))
        except LinkError as exc:
            if exc.code != errno.ENODEV:
                raise


def vlan_request(parent: int, vlan: int) -> dict[str, Any]:
    """The RTM_NEWLINK attributes of an 802.1Q link (`ip link add link PARENT name N type vlan id V`):
    IFLA_LINK = parent, IFLA_LINKINFO {IFLA_INFO_KIND "vlan", IFLA_INFO_DATA {IFLA_VLAN_ID V}}."""
    return {"kind": VLAN_KIND, "link": parent, "vlan_id": vlan}


def no_8021q(name: str, vlan: int, parent: str) -> LinkError:
    """The kernel refused a VLAN link with EOPNOTSUPP ("Unknown device type"): it has no 8021q."""
    error = LinkError(name, f"VLAN {vlan} of {parent} cannot be created: this kernel lacks 802.1Q VLAN "
                      "support (Unknown device type)", code=errno.EOPNOTSUPP,
                      hint="load the module: `modprobe 8021q` (a kernel built with CONFIG_VLAN_8021Q)")
    error.exit_code = EXIT_HOST
    return error


def _netlink_error(ifname: str, doing: str, code: int | None, args: tuple[Any, ...]) -> LinkError:
    text = args[1] if len(args) > 1 and isinstance(args[1], str) and args[1] else None
    if text is None:
        text = os.strerror(code) if code else str(args)
    label = errno.errorcode.get(code, str(code)) if code else "?"
    return LinkError(ifname, f"{doing}: {text} ({label})", code=code)


@contextlib.contextmanager
def netlink(ifname: str) -> Iterator[Netlink]:
    """A netlink session for one call: the socket is always closed."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr = IPRoute()
    except (NetlinkError, OSError) as exc:
        code = exc.code if isinstance(exc, NetlinkError) else exc.errno
        raise _netlink_error(ifname, "opening a netlink socket", code, exc.args) from exc
    with ipr:
        yield Netlink(ipr)


IFF_TAP, IFF_NO_PI, IFF_MULTI_QUEUE, IFF_TUN_EXCL = 0x0002, 0x1000, 0x0100, 0x8000


@contextlib.contextmanager
def new_tap(nl: Netlink, name: str, *, multi_queue: bool, mark: str) -> Iterator[Link]:
    """Create a tap and mark it; set it up in the block; it persists only when the block succeeds.

    The tap is created without TUNSETPERSIST, so it lives only while our file descriptor is open:
    killed (even by SIGKILL) before the end of the block, vmlaunch leaves no tap behind, and every tap
    that outlives it carries its mark. IFF_TUN_EXCL makes the kernel refuse a name in use (EBUSY)
    rather than attach to that interface.
    """
    import fcntl
    import struct

    from pyroute2.netlink.rtnl.ifinfmsg.tuntap import TUNSETIFF, TUNSETPERSIST

    flags = IFF_TAP | IFF_NO_PI | IFF_TUN_EXCL | (IFF_MULTI_QUEUE if multi_queue else 0)
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise _netlink_error(name, "opening /dev/net/tun", exc.errno, (exc.errno, exc.strerror)) from exc
    try:
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))  # struct ifreq
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise LinkError(name, "an interface of that name appeared while creating the tap",
                                code=exc.errno) from exc
            raise _netlink_error(name, "creating the tap", exc.errno, (exc.errno, exc.strerror)) from exc
        tap = nl.require(name, "after creating it")
        nl.mark(tap, mark)
        yield nl.require(name, "after marking it")
        try:
            fcntl.ioctl(fd, TUNSETPERSIST, 1)
        except OSError as exc:
            raise _netlink_error(name, "making the tap persistent", exc.errno,
                                 (exc.errno, exc.strerror)) from exc
    finally:
        os.close(fd)  # before TUNSETPERSIST: the kernel removes the tap


def check_name(name: str) -> None:
    """Refuse a name the kernel would refuse (a journal edited by hand, say) before asking it."""
    problem = interface_name_problem(name)
    if problem is not None:
        raise LinkError(name, problem)


