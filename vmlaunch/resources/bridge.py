"""Linux bridges for `type = "bridge"` networks: created only when missing, with their MTU and uplink.

Bridges can be shared by labs (two specs that name the same bridge), so whether one is removed is
decided host-wide, in the bridge registry (`bridge_registry.py`): every lab that uses a bridge has a
claim on it there, the last lab to leave a bridge vmlaunch created removes it, and a bridge vmlaunch did
not create is never removed. A bridge vmlaunch creates carries its mark (ifalias `vmlaunch lab=...`).

A default bridge name (no `network.X.bridge` in the spec) belongs to one lab: found on the host without
that lab's mark (another lab's, or none), it is refused, never used or removed.

Coverage: this runs only inside private network namespaces (tests/netns_links.py and the end-to-end
tests, both subprocesses), which `make test`'s in-process coverage figure does not see.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from vmlaunch.hostlinks import BRIDGE_KIND, TUN_KIND, Link, LinkError, Netlink, check_name, netlink
from vmlaunch.naming import default_bridge_name, interface_mark, interface_name_problem
from vmlaunch.resources.base import Context
from vmlaunch.resources.bridge_registry import BridgeEntry, BridgeRegistry

log = logging.getLogger(__name__)


def _interface_name(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and interface_name_problem(value):
        raise ValueError(f"{attribute.name}: {interface_name_problem(value)}")


@attrs.frozen
class BridgeRecord:
    """What `Bridge.apply` did for one lab: its claim on the bridge (the registry has the rest)."""

    kind: ClassVar[str] = "bridge"

    name: str = attrs.field(validator=_interface_name)
    created: bool  # vmlaunch created it (for this lab or another); False: it existed before
    uplink: str | None = attrs.field(default=None, validator=_interface_name)  # enslaved by this lab

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Give up the lab's claim; the last lab to leave a bridge vmlaunch created removes it.

        Missing interfaces are not an error: removing twice does nothing the second time. A record
        the registry does not know (a journal older than it, a registry removed) is undone as it says,
        the bridge deleted only when it carries a vmlaunch mark.
        """
        fallback = BridgeEntry(created=self.created, index=None, uplink=self.uplink)
        with BridgeRegistry.locked() as registry:
            release(registry, self.name, ctx.lab, fallback)

    def describe(self) -> str:
        uplink = f", uplink {self.uplink} enslaved" if self.uplink else ""
        return f"bridge {self.name} ({'created' if self.created else 'existed'}{uplink})"


def release_unjournaled_bridges(ctx: Context, journaled: Callable[[str, str], bool]) -> list[str]:
    """Drop the lab's claims that no journaled record backs: an `up` killed after claiming a bridge
    (and maybe creating it) but before journaling it leaves one. For `down`, under the lab's lock;
    returns what could not be done, one line each."""
    problems = []
    with BridgeRegistry.locked() as registry:
        for name in registry.of_lab(ctx.lab):
            if journaled(BridgeRecord.kind, name):
                continue
            log.info("bridge %s: finishing what a killed `up` of lab %s left", name, ctx.lab)
            try:
                release(registry, name, ctx.lab)
            except LinkError as exc:
                problems.append(str(exc))
    return problems


def release(registry: BridgeRegistry, name: str, lab: str, fallback: BridgeEntry | None = None) -> None:
    """`lab` leaves bridge `name`; the last lab out removes it when vmlaunch created it.

    The lab's own taps still in the bridge (leaked: its taps are undone before its bridge) are removed
    first, whether or not it is the last user; another lab's taps or interfaces vmlaunch did not
    create keep the bridge, and its entry, until they are gone.
    """
    entry = registry.bridges.get(name)
    known = entry is not None
    if entry is None:
        if fallback is None:
            return
        entry = fallback
    entry.leave(lab)
    with netlink(name) as nl:
        bridge = nl.get(name)
        if bridge is not None and bridge.kind == BRIDGE_KIND:
            _remove_leaked_taps(nl, bridge, lab)
        if registry.users(name, but=lab):
            registry.save()  # without this lab's claim, and any stale ones
            return
        if bridge is None or bridge.kind != BRIDGE_KIND:
            _forget(registry, name)  # gone (its ports were released with it), or now something else
            return
        if entry.uplink is not None:
            uplink = nl.get(entry.uplink)
            if uplink is not None and uplink.master == bridge.index:
                nl.set(uplink, f"releasing it from bridge {name}", master=0)
            entry.uplink = None
        if not entry.created:
            _forget(registry, name)  # not ours to delete
            return
        if not _is_ours(bridge, entry, known):
            log.warning("bridge %s: not deleted: it is not the bridge vmlaunch created (%s)", name,
                        bridge.owner_text())
            _forget(registry, name)
            return
        ports = nl.ports(bridge)
        if ports:
            log.warning("bridge %s: kept while it has ports vmlaunch may not remove: %s", name,
                        ", ".join(f"{port.name} ({port.owner_text()})" for port in ports))
            registry.bridges[name] = entry  # with no lab: the next release retries
            registry.save()
            return
        nl.delete(bridge)
    _forget(registry, name)


def _forget(registry: BridgeRegistry, name: str) -> None:
    registry.bridges.pop(name, None)
    registry.save()


def _is_ours(bridge: Link, entry: BridgeEntry, known: bool) -> bool:
    """Whether `bridge` is the one vmlaunch created: the ifindex the registry has (ifindexes are not
    reused); while being created (no index yet), any bridge not marked by another hand; without an
    entry (an old journal), a bridge with a vmlaunch mark."""
    if not known:
        return bridge.lab is not None
    if entry.index is not None:
        return bridge.index == entry.index
    return bridge.alias is None or bridge.lab is not None


def _remove_leaked_taps(nl: Netlink, bridge: Link, lab: str) -> None:
    for port in nl.ports(bridge):
        if port.kind == TUN_KIND and port.lab == lab and not port.carrier:
            log.info("bridge %s: removing tap %s that lab %s left in it", bridge.name, port.name, lab)
            nl.delete(port)


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
        """Make the bridge an up bridge with its MTU and uplink, and claim it for the lab.

        An existing bridge is used as it is (its MTU set when the spec gives one); a non-bridge of that
        name is an error, and so is a bridge of the lab's default name that is not the lab's. The
        uplink must exist and be free or already a port of this bridge. The claim is registered
        before the bridge is created; on failure the claim is dropped and a bridge created here is
        deleted again.
        """
        check_name(self.name)
        if self.uplink is not None:
            check_name(self.uplink)
            if self.uplink == self.name:
                raise LinkError(self.name, "a bridge cannot be its own uplink")
        with BridgeRegistry.locked() as registry, netlink(self.name) as nl:
            existing = nl.get(self.name)
            if existing is not None and existing.kind != BRIDGE_KIND:
                raise LinkError(self.name, f"exists and is {existing.describe()}, not a bridge",
                                hint=f"remove it or give network.{self.network}.bridge another name")
            uplink = self._free_uplink(nl, existing) if self.uplink is not None else None
            entry = registry.bridges.get(self.name)
            if existing is not None:
                entry = self._adopt(ctx, nl, existing, entry)
            else:
                # the claim first: a vmlaunch killed after creating the bridge leaves the claim for the
                # next up or down of this lab (the bridge is not journaled yet)
                entry = BridgeEntry(created=True, index=None, uplink=None,
                                    labs=entry.labs if entry is not None else [])
            entry.claim(ctx.lab)
            registry.bridges[self.name] = entry
            registry.save()
            created = False
            try:
                if existing is None:
                    created = nl.add(self.name, f"creating bridge for network {self.network}",
                                     kind=BRIDGE_KIND)
                    bridge = self._mark_new(ctx, nl, created, entry, registry)
                else:
                    bridge = existing
                enslave = uplink is not None and uplink.master != bridge.index
                settings: dict[str, Any] = {"state": "up"}
                if self.mtu is not None:
                    settings["mtu"] = self.mtu
                nl.set(bridge, "bringing it up" + (f" with mtu {self.mtu}" if self.mtu else ""), **settings)
                if uplink is not None and enslave:
                    entry.uplink = self.uplink  # first: a kill after enslaving leaves it to be released
                    registry.save()
                    nl.set(uplink, f"enslaving it to bridge {self.name}", master=bridge.index, state="up")
            except BaseException:
                if created:
                    with contextlib.suppress(LinkError):
                        nl.delete(nl.require(self.name, "deleting it again"))
                entry.leave(ctx.lab)
                if existing is None or (not entry.created and not entry.labs):
                    registry.bridges.pop(self.name, None)  # the claim written above, or one of no use
                with contextlib.suppress(OSError):
                    registry.save()
                raise
        return BridgeRecord(name=self.name, created=entry.created,
                            uplink=self.uplink if enslave else None)

    def _mark_new(self, ctx: Context, nl: Netlink, created: bool, entry: BridgeEntry,
                  registry: BridgeRegistry) -> Link:
        """Mark the bridge just created as the lab's and record its ifindex."""
        if not created:
            raise LinkError(self.name, "an interface of that name appeared while creating the bridge")
        bridge = nl.require(self.name, "after creating it")
        nl.mark(bridge, interface_mark(ctx.lab, net=self.network))
        entry.index = bridge.index
        registry.save()
        return bridge

    def _adopt(self, ctx: Context, nl: Netlink, bridge: Link, entry: BridgeEntry | None) -> BridgeEntry:
        """The registry entry of a bridge found on the host, checked to be one this lab may use.

        A bridge vmlaunch began to create (a claim without its ifindex: the creator was killed) is
        finished: marked and its ifindex recorded. One the registry does not know is vmlaunch's when it
        carries a vmlaunch mark. The lab's default bridge name must name the lab's own bridge.
        """
        unfinished = (entry is not None and entry.created and entry.index is None
                      and (bridge.alias is None or bridge.lab is not None))
        if self.name == default_bridge_name(ctx.lab, self.network):
            own = bridge.lab == ctx.lab or (unfinished and bridge.alias is None and entry is not None
                                            and ctx.lab in entry.labs)
            if not own:
                raise LinkError(self.name, f"the default bridge of network {self.network} cannot be "
                                f"used: a bridge of that name exists and is {bridge.owner_text()}",
                                hint="remove it if it is a leftover, or give "
                                f"network.{self.network}.bridge a name")
        if entry is None:
            return BridgeEntry(created=bridge.lab is not None,
                               index=bridge.index if bridge.lab is not None else None)
        if unfinished:
            if bridge.alias is None:
                nl.mark(bridge, interface_mark(ctx.lab, net=self.network))
            entry.index = bridge.index
        elif entry.created and entry.index != bridge.index:
            log.warning("bridge %s: not the one vmlaunch created (it was made again, %s): kept when "
                        "the last lab leaves it", self.name, bridge.owner_text())
            return BridgeEntry(created=False, labs=entry.labs)
        return entry

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
