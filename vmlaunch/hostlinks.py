"""Host network links (bridges, taps, uplinks) over netlink: the layer the bridge and tap resources use.

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

from vmlaunch.errors import EXIT_HOST, RuntimeFailure, needs_root
from vmlaunch.naming import interface_name_problem

# the kernel's IFLA_INFO_KIND of a tap created through pyroute2's "tuntap"
TUN_KIND = "tun"
BRIDGE_KIND = "bridge"

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

    @classmethod
    def parse(cls, msg: Any) -> Link:
        master = msg.get("master")
        return cls(index=int(msg["index"]), name=str(msg.get("ifname")), kind=msg.get(("linkinfo", "kind")),
                   master=int(master) if master else None, carrier=bool(msg.get("carrier")))

    def describe(self) -> str:
        return {BRIDGE_KIND: "a bridge", TUN_KIND: "a tun/tap device", None: "a network device"}.get(
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

    def set(self, link: Link, doing: str, **kwargs: Any) -> None:
        self._call(link.name, doing, lambda: self._ipr.link("set", index=link.index, **kwargs))

    def delete(self, link: Link) -> None:
        """Delete an interface; one already gone is not an error."""
        try:
            self._call(link.name, "deleting it", lambda: self._ipr.link("del", index=link.index))
        except LinkError as exc:
            if exc.code != errno.ENODEV:
                raise


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


def check_name(name: str) -> None:
    """Refuse a name the kernel would refuse (a journal edited by hand, say) before asking it."""
    problem = interface_name_problem(name)
    if problem is not None:
        raise LinkError(name, problem)


