"""Linux bridges for `type = "bridge"` networks: created only when missing, with their MTU and uplink.

The record says what was really done, so `down` undoes exactly that: a bridge that existed before is
never deleted, an uplink that was already enslaved is never released, and a bridge that still has
ports (another lab's taps) is left in place.

Coverage: this runs only inside private network namespaces (tests/netns_links.py and the end-to-end
tests, both subprocesses), which `make test`'s in-process coverage figure does not see.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import attrs

from vmlaunch.hostlinks import BRIDGE_KIND, Link, LinkError, Netlink, check_name, netlink
from vmlaunch.naming import interface_name_problem
from vmlaunch.resources.base import Context


def _interface_name(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and interface_name_problem(value):
        raise ValueError(f"{attribute.name}: {interface_name_problem(value)}")


@attrs.frozen
class BridgeRecord:
    """What `Bridge.apply` did."""

    kind: ClassVar[str] = "bridge"

    name: str = attrs.field(validator=_interface_name)
    created: bool  # False: it existed before; we never delete what we did not create
    uplink: str | None = attrs.field(default=None, validator=_interface_name)  # enslaved by us

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Release our uplink; delete the bridge if we created it and it has no ports left.

        Missing interfaces are not an error: removing twice does nothing the second time.
        """
        with netlink(self.name) as nl:
            bridge = nl.get(self.name)
            if bridge is None or bridge.kind != BRIDGE_KIND:
                return  # gone (its ports were released with it), or the name is now something else's
            if self.uplink is not None:
                uplink = nl.get(self.uplink)
                if uplink is not None and uplink.master == bridge.index:
                    nl.set(uplink, f"releasing it from bridge {self.name}", master=0)
            if not self.created or nl.ports(bridge):
                return
            nl.delete(bridge)

    def describe(self) -> str:
        uplink = f", uplink {self.uplink} enslaved" if self.uplink else ""
        return f"bridge {self.name} ({'created' if self.created else 'existed'}{uplink})"


@attrs.frozen
class Bridge:
    """Ensure a Linux bridge exists (created only when missing; then removed by `down`)."""

    kind: ClassVar[str] = "bridge"

    name: str
    network: str
    mtu: int | None = None
    uplink: str | None = None

    @property
    def key(self) -> str:
        return self.name

    @property
    def owner(self) -> str | None:
        return None  # shared by the lab's VMs

    def describe(self) -> str:
        extra = "".join([f" mtu {self.mtu}" if self.mtu else "",
                         f" with uplink {self.uplink}" if self.uplink else ""])
        return f"bridge {self.name} (network {self.network}){extra}: create if missing"

    def found(self) -> str | None:
        return None

    def apply(self, ctx: Context) -> BridgeRecord:
        """Make the bridge an up bridge with its MTU and uplink.

        An existing bridge is used as it is (its MTU set when the spec gives one); a non-bridge of that
        name is an error. The uplink must exist and be free or already a port of this bridge. When the
        uplink cannot be enslaved, a bridge created here is deleted again.
        """
        check_name(self.name)
        if self.uplink is not None:
            check_name(self.uplink)
            if self.uplink == self.name:
                raise LinkError(self.name, "a bridge cannot be its own uplink")
        with netlink(self.name) as nl:
            existing = nl.get(self.name)
            if existing is not None and existing.kind != BRIDGE_KIND:
                raise LinkError(self.name, f"exists and is {existing.describe()}, not a bridge",
                                hint=f"remove it or give network.{self.network}.bridge another name")
            uplink = self._free_uplink(nl, existing) if self.uplink is not None else None
            created = existing is None and nl.add(self.name, f"creating bridge for network {self.network}",
                                                  kind=BRIDGE_KIND)
            bridge = nl.require(self.name, "after creating it")
            if bridge.kind != BRIDGE_KIND:  # someone else created it meanwhile, and not as a bridge
                raise LinkError(self.name, f"exists and is {bridge.describe()}, not a bridge")
            enslave = uplink is not None and uplink.master != bridge.index
            settings: dict[str, Any] = {"state": "up"}
            if self.mtu is not None:
                settings["mtu"] = self.mtu
            try:
                nl.set(bridge, "bringing it up" + (f" with mtu {self.mtu}" if self.mtu else ""), **settings)
                if uplink is not None and enslave:
                    nl.set(uplink, f"enslaving it to bridge {self.name}", master=bridge.index, state="up")
            except BaseException:
                if created:
                    with contextlib.suppress(LinkError):
                        nl.delete(bridge)
                raise
        return BridgeRecord(name=self.name, created=created, uplink=self.uplink if enslave else None)

    def _free_uplink(self, nl: Netlink, bridge: Link | None) -> Link:
        assert self.uplink is not None
        uplink = nl.get(self.uplink)
        if uplink is None:
            raise LinkError(self.uplink, f"the uplink of bridge {self.name} does not exist",
                            hint=f"check network.{self.network}.uplink (`ip link` lists the interfaces)")
        if uplink.master is not None and (bridge is None or uplink.master != bridge.index):
            master = nl.name_of(uplink.master)
            raise LinkError(self.uplink, f"cannot be the uplink of bridge {self.name}: it is already "
                            f"enslaved to {master}",
                            hint=f"release it first (`ip link set {self.uplink} nomaster`)")
        return uplink
