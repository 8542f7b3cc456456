"""Host network resources of `up`/`down`: bridges, their uplinks and the taps of the NICs, via netlink.

Every change returns a record (JSON-serialisable) of what was really done, so that `down`, in another
process, undoes exactly that and nothing more: a bridge that existed before is never deleted, an uplink
that was already enslaved is never released, a bridge that still has other ports (another lab's taps)
is left in place.

pyroute2 costs ~200 ms to import: it is imported inside the functions that talk to the kernel, never at
module level, so that `vmlaunch validate` and `cmdline` do not pay for it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs

from vmlaunch.errors import RuntimeFailure
from vmlaunch.plan import CreateBridge, CreateTap

IFNAMSIZ = 16  # the kernel's limit, NUL included: names are at most 15 bytes
PERMISSION_HINT = "creating and changing host network interfaces needs root (or CAP_NET_ADMIN)"

# the kernel's IFLA_INFO_KIND of a tap created through pyroute2's "tuntap"
_TUN_KIND = "tun"
_BRIDGE_KIND = "bridge"

_R = TypeVar("_R")


class NetdevError(RuntimeFailure):
    """A netlink operation on a host interface failed, or an interface is not what the lab needs."""

    def __init__(self, interface: str, message: str, code: int | None = None,
                 hint: str | None = None) -> None:
        if hint is None and code in (errno.EPERM, errno.EACCES):
            hint = PERMISSION_HINT
        super().__init__(f"interface {interface}: {message}", hint)
        self.interface = interface
        self.code = code


# --- records -----------------------------------------------------------------------------------------


def _field(data: dict[str, Any], key: str, kind: type, what: str, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is str and not value):
        expected = "a non-empty string" if kind is str else f"a {kind.__name__}"
        raise NetdevError(str(data.get("name", "?")),
                          f"invalid {what} record: `{key}` must be {expected}, not {value!r}")
    return value


def _check_kind(data: dict[str, Any], kind: str) -> None:
    if not isinstance(data, dict):
        raise NetdevError("?", f"invalid {kind} record: {data!r} is not an object")
    if data.get("kind", kind) != kind:
        raise NetdevError(str(data.get("name", "?")),
                          f"invalid {kind} record: it is a {data['kind']!r} record")


@attrs.frozen
class BridgeRecord:
    """What `ensure_bridge` did, so that `remove_bridge` (maybe in another process) can undo it."""

    name: str
    created: bool  # False: it existed before; we never delete what we did not create
    uplink: str | None = None  # enslaved by us (only then released on undo)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "bridge", "name": self.name, "created": self.created, "uplink": self.uplink}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BridgeRecord:
        _check_kind(data, "bridge")
        return cls(name=_field(data, "name", str, "bridge"), created=_field(data, "created", bool, "bridge"),
                   uplink=_field(data, "uplink", str, "bridge", optional=True))


@attrs.frozen
class TapRecord:
    """A tap `create_tap` made (always ours: a stale one of the same name is replaced)."""

    name: str
    bridge: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": "tap", "name": self.name, "bridge": self.bridge}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TapRecord:
        _check_kind(data, "tap")
        return cls(name=_field(data, "name", str, "tap"), bridge=_field(data, "bridge", str, "tap"))


# --- netlink, wrapped --------------------------------------------------------------------------------


@attrs.frozen
class _Link:
    index: int
    name: str
    kind: str | None  # IFLA_INFO_KIND: "bridge", "tun" (taps), "veth", None (physical NICs, lo)
    master: int | None
    carrier: bool  # for a tap: a process (QEMU) has it open

    @classmethod
    def parse(cls, msg: Any) -> _Link:
        master = msg.get("master")
        return cls(index=int(msg["index"]), name=str(msg.get("ifname")), kind=msg.get(("linkinfo", "kind")),
                   master=int(master) if master else None, carrier=bool(msg.get("carrier")))

    def describe(self) -> str:
        return {_BRIDGE_KIND: "a bridge", _TUN_KIND: "a tun/tap device", None: "a network device"}.get(
            self.kind, f"a {self.kind} device")


class _Netlink:
    """One IPRoute socket; every failure becomes a NetdevError naming the interface and the operation."""

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

    def get(self, name: str) -> _Link | None:
        """The interface called `name`, None when there is none."""
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            msgs = self._call(name, "looking it up", lambda: self._ipr.link("get", ifname=name))
        except NetdevError as exc:
            if exc.code == errno.ENODEV and isinstance(exc.__cause__, NetlinkError):
                return None
            raise
        return _Link.parse(msgs[0])

    def require(self, name: str, doing: str) -> _Link:
        link = self.get(name)
        if link is None:
            raise NetdevError(name, f"{doing}: it vanished")
        return link

    def links(self, ifname: str, doing: str) -> list[_Link]:
        return [_Link.parse(msg) for msg in self._call(ifname, doing, lambda: tuple(self._ipr.get_links()))]

    def ports(self, bridge: _Link) -> list[_Link]:
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
        except NetdevError as exc:
            if exc.code == errno.EEXIST:
                return False
            raise
        return True

    def set(self, link: _Link, doing: str, **kwargs: Any) -> None:
        self._call(link.name, doing, lambda: self._ipr.link("set", index=link.index, **kwargs))

    def delete(self, link: _Link) -> None:
        """Delete an interface; one already gone is not an error."""
        try:
            self._call(link.name, "deleting it", lambda: self._ipr.link("del", index=link.index))
        except NetdevError as exc:
            if exc.code != errno.ENODEV:
                raise


def _netlink_error(ifname: str, doing: str, code: int | None, args: tuple[Any, ...]) -> NetdevError:
    text = args[1] if len(args) > 1 and isinstance(args[1], str) and args[1] else None
    if text is None:
        text = os.strerror(code) if code else str(args)
    label = errno.errorcode.get(code, str(code)) if code else "?"
    return NetdevError(ifname, f"{doing}: {text} ({label})", code=code)


@contextlib.contextmanager
def _netlink(ifname: str) -> Iterator[_Netlink]:
    """A netlink session for one call: the socket is always closed."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr = IPRoute()
    except (NetlinkError, OSError) as exc:
        code = exc.code if isinstance(exc, NetlinkError) else exc.errno
        raise _netlink_error(ifname, "opening a netlink socket", code, exc.args) from exc
    with ipr:
        yield _Netlink(ipr)


def _check_name(name: str) -> None:
    size = len(name.encode())
    if not 0 < size < IFNAMSIZ or "/" in name or any(c.isspace() for c in name):
        raise NetdevError(name, f"not a valid interface name (1-{IFNAMSIZ - 1} bytes, no '/' or spaces)")


# --- bridges -----------------------------------------------------------------------------------------


def ensure_bridge(action: CreateBridge) -> BridgeRecord:
    """Make `action.name` an up bridge (with its MTU and uplink); record what had to be done.

    An existing bridge is used as it is (its MTU set when the spec gives one); a non-bridge of that name
    is an error. The uplink must exist and be free or already a port of this bridge. When the uplink
    cannot be enslaved, a bridge created here is deleted again.
    """
    _check_name(action.name)
    if action.uplink is not None:
        _check_name(action.uplink)
        if action.uplink == action.name:
            raise NetdevError(action.name, "a bridge cannot be its own uplink")
    with _netlink(action.name) as nl:
        existing = nl.get(action.name)
        if existing is not None and existing.kind != _BRIDGE_KIND:
            raise NetdevError(action.name, f"exists and is {existing.describe()}, not a bridge",
                              hint=f"remove it or give network.{action.network}.bridge another name")
        uplink = _free_uplink(nl, action, existing) if action.uplink is not None else None
        created = existing is None and nl.add(action.name, f"creating bridge for network {action.network}",
                                              kind=_BRIDGE_KIND)
        bridge = nl.require(action.name, "after creating it")
        if bridge.kind != _BRIDGE_KIND:  # someone else created it meanwhile, and not as a bridge
            raise NetdevError(action.name, f"exists and is {bridge.describe()}, not a bridge")
        enslave = uplink is not None and uplink.master != bridge.index
        settings: dict[str, Any] = {"state": "up"}
        if action.mtu is not None:
            settings["mtu"] = action.mtu
        try:
            nl.set(bridge, "bringing it up" + (f" with mtu {action.mtu}" if action.mtu else ""), **settings)
            if uplink is not None and enslave:
                nl.set(uplink, f"enslaving it to bridge {action.name}", master=bridge.index, state="up")
        except BaseException:
            if created:
                with contextlib.suppress(NetdevError):
                    nl.delete(bridge)
            raise
    return BridgeRecord(name=action.name, created=created, uplink=action.uplink if enslave else None)


def _free_uplink(nl: _Netlink, action: CreateBridge, bridge: _Link | None) -> _Link:
    assert action.uplink is not None
    uplink = nl.get(action.uplink)
    if uplink is None:
        raise NetdevError(action.uplink, f"the uplink of bridge {action.name} does not exist",
                          hint=f"check network.{action.network}.uplink (`ip link` lists the interfaces)")
    if uplink.master is not None and (bridge is None or uplink.master != bridge.index):
        master = nl.name_of(uplink.master)
        raise NetdevError(action.uplink, f"cannot be the uplink of bridge {action.name}: it is already "
                          f"enslaved to {master}",
                          hint=f"release it first (`ip link set {action.uplink} nomaster`)")
    return uplink


def remove_bridge(record: BridgeRecord) -> None:
    """Undo `ensure_bridge`: release our uplink; delete the bridge if we created it and it has no ports.

    A bridge that still has ports (another lab's taps, an uplink added by hand) is left alone. Missing
    interfaces are not an error: removing twice does nothing the second time.
    """
    with _netlink(record.name) as nl:
        bridge = nl.get(record.name)
        if bridge is None or bridge.kind != _BRIDGE_KIND:
            return  # gone (its ports were released with it), or the name is now something else's
        if record.uplink is not None:
            uplink = nl.get(record.uplink)
            if uplink is not None and uplink.master == bridge.index:
                nl.set(uplink, f"releasing it from bridge {record.name}", master=0)
        if not record.created or nl.ports(bridge):
            return
        nl.delete(bridge)


# --- taps --------------------------------------------------------------------------------------------


def create_tap(action: CreateTap) -> TapRecord:
    """Create the tap of one NIC (MTU, port of its bridge, up), replacing a stale one of that name.

    A tap of that name that no process has open (left by a killed vmlaunch) is deleted and recreated;
    one that is open (a running QEMU) or an interface that is not a tap is an error.
    """
    _check_name(action.ifname)
    with _netlink(action.ifname) as nl:
        bridge = nl.get(action.bridge)
        if bridge is None:
            raise NetdevError(action.bridge, f"bridge of tap {action.ifname} ({action.vm}) does not exist")
        if bridge.kind != _BRIDGE_KIND:
            raise NetdevError(action.bridge, f"is {bridge.describe()}, not a bridge (tap {action.ifname})")
        old = nl.get(action.ifname)
        if old is not None:
            if old.kind != _TUN_KIND:
                raise NetdevError(action.ifname, f"the tap of {action.vm} cannot be created: an interface of "
                                  f"that name exists and is {old.describe()}")
            if old.carrier:
                raise NetdevError(action.ifname, f"the tap of {action.vm} exists and a process has it open",
                                  hint="is this lab already up? (`vmlaunch status`)")
            nl.delete(old)
        # pyroute2 creates taps with the TUNSETIFF ioctl, which attaches to an existing tap of that name
        # rather than failing (hence the look-up above) and fails with EINVAL on a non-tap of that name
        flags = {"no_pi": True, "multi_queue": action.multi_queue}
        if not nl.add(action.ifname, f"creating the tap of {action.vm}", kind="tuntap", mode="tap",
                      ifr=flags):
            raise NetdevError(action.ifname, "an interface of that name appeared while creating the tap")
        tap = nl.require(action.ifname, "after creating it")
        try:
            if action.mtu is not None:  # before enslaving: a bridge with a set MTU keeps it
                nl.set(tap, f"setting mtu {action.mtu}", mtu=action.mtu)
            nl.set(tap, f"enslaving it to bridge {action.bridge}", master=bridge.index)
            nl.set(tap, "bringing it up", state="up")
        except BaseException:
            with contextlib.suppress(NetdevError):
                nl.delete(tap)
            raise
    return TapRecord(name=action.ifname, bridge=action.bridge)


def remove_tap(record: TapRecord) -> None:
    """Delete the tap; one already gone (or an interface of that name that is no tap) is left alone."""
    with _netlink(record.name) as nl:
        tap = nl.get(record.name)
        if tap is not None and tap.kind == _TUN_KIND:
            nl.delete(tap)


def interface_exists(name: str) -> bool:
    with _netlink(name) as nl:
        return nl.get(name) is not None


# --- scoped use --------------------------------------------------------------------------------------


def _undo_after_failure(undo: Callable[[], None], what: str) -> None:
    try:
        undo()
    except NetdevError as exc:  # the original failure is the one to report
        print(f"vmlaunch: warning: could not undo {what}: {exc}", file=sys.stderr)
