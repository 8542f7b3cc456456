"""Linux bridges for `type = "bridge"` networks: created only when missing, with their MTU and uplink.

Bridges can be shared by labs (two specs that name the same bridge), so whether one is removed is
decided host-wide, in the bridge registry (`bridge_registry.py`): every lab that uses a bridge has a
claim on it there, the last lab to leave a bridge vmlaunch created removes it, and a bridge vmlaunch did
not create is never removed. A bridge vmlaunch creates carries its mark (ifalias `vmlaunch lab=...`).

A default bridge name (no `network.X.bridge` in the spec) belongs to one lab: found on the host without
that lab's mark (another lab's, or none), it is refused, never used or removed.

With `vlan`, the bridge's port is not the uplink but its 802.1Q VLAN link (`eth1.42`): one that exists
already is used as it is (and never removed unless vmlaunch made it); otherwise vmlaunch creates it
(marked), and the registry records that, so the last lab to leave the bridge deletes it, and a crash
between creating and journaling leaves it to the next `up` or `down`. The uplink itself, the trunk, is
never changed. A kernel without 802.1Q refuses the link: a host error (exit 3) naming the module.

Coverage: this runs only inside private network namespaces (tests/netns_links.py and the end-to-end
tests, both subprocesses), which `make test`'s in-process coverage figure does not see.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from vmlaunch.core.naming import default_bridge_name, interface_mark, vlan_link_name
from vmlaunch.host.bridge_registry import BridgeEntry, BridgeRegistry
from vmlaunch.host.links import (
    BRIDGE_KIND,
    VLAN_KIND,
    Link,
    LinkError,
    Netlink,
    check_name,
    netlink,
)
from vmlaunch.resources.base import Context, LabWide
from vmlaunch.resources.links import LinkRecord, interface_name, lab_tap

log = logging.getLogger(__name__)


@attrs.frozen
class BridgeRecord(LinkRecord):
    """What `Bridge.apply` did for one lab: its claim on the bridge (the registry has the rest)."""

    kind: ClassVar[str] = "bridge"

    created: bool  # vmlaunch created it (for this lab or another); False: it existed before
    uplink: str | None = attrs.field(default=None, validator=interface_name)  # enslaved by this lab
    uplink_created: bool = False  # the uplink is a VLAN link vmlaunch created (for this lab or another)

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Give up the lab's claim; the last lab to leave a bridge vmlaunch created removes it.

        Missing interfaces are not an error: removing twice does nothing the second time. A record
        the registry does not know (a journal older than it, a registry removed) is undone as it says,
        the bridge (and a VLAN link) deleted only when it carries a vmlaunch mark.
        """
        fallback = BridgeEntry(created=self.created, index=None, uplink=self.uplink,
                               uplink_created=self.uplink_created)
        with BridgeRegistry.locked() as registry:
            release(registry, self.name, ctx.lab, fallback)

    def describe(self) -> str:
        made = "created and enslaved" if self.uplink_created else "enslaved"
        uplink = f", uplink {self.uplink} {made}" if self.uplink else ""
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
        found = nl.get(name)
        bridge = found if found is not None and found.kind == BRIDGE_KIND else None
        if bridge is not None:
            _remove_leaked_taps(nl, bridge, lab)
        if registry.users(name, but=lab):
            registry.save()  # without this lab's claim, and any stale ones
            return
        drop_uplink(nl, name, bridge, entry)
        if bridge is None:
            _forget(registry, name)  # gone (its ports were released with it), or now something else
            return
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


def drop_uplink(nl: Netlink, name: str, bridge: Link | None, entry: BridgeEntry) -> None:
    """Release the uplink vmlaunch enslaved to bridge `name`, and delete the VLAN link vmlaunch
    created for it (the one whose ifindex the registry has; without one, one with a vmlaunch mark)."""
    if entry.uplink is None:
        return
    uplink = nl.get(entry.uplink)
    if uplink is not None and bridge is not None and uplink.master == bridge.index:
        nl.set(uplink, f"releasing it from bridge {name}", master=0)
    if uplink is not None and entry.uplink_created:
        ours = uplink.kind == VLAN_KIND and (uplink.index == entry.uplink_index if entry.uplink_index
                                             is not None else uplink.lab is not None)
        if ours:
            nl.delete(uplink)
        else:
            log.warning("interface %s: not deleted: it is not the VLAN link vmlaunch created for bridge "
                        "%s (%s, %s)", uplink.name, name, uplink.describe(), uplink.owner_text())
    entry.uplink, entry.uplink_created, entry.uplink_index = None, False, None


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
        if lab_tap(port, lab) and not port.carrier:
            log.info("bridge %s: removing tap %s that lab %s left in it", bridge.name, port.name, lab)
            nl.delete(port)


@attrs.frozen
class Bridge(LabWide):
    """Ensure a Linux bridge exists (created only when missing; then removed by `down`)."""

    kind: ClassVar[str] = "bridge"

    name: str
    network: str
    mtu: int | None = None
    uplink: str | None = None
    vlan: int | None = None  # the uplink's 802.1Q VLAN: its VLAN link is the bridge's port

    @property
    def key(self) -> str:
        return self.name

    @property
    def port(self) -> str | None:
        """The interface enslaved to the bridge: the uplink, or its VLAN link (`eth1.42`)."""
        if self.uplink is None:
            return None
        return vlan_link_name(self.uplink, self.vlan) if self.vlan is not None else self.uplink

    def describe(self) -> str:
        vlan = f" (VLAN {self.vlan} of {self.uplink})" if self.vlan is not None else ""
        extra = "".join([f" mtu {self.mtu}" if self.mtu else "",
                         f" with uplink {self.port}{vlan}" if self.uplink else ""])
        return f"bridge {self.name} (network {self.network}){extra}: create if missing"

    def found(self) -> str | None:
        return None

    def apply(self, ctx: Context) -> BridgeRecord:
        """Make the bridge an up bridge with its MTU and uplink, and claim it for the lab.

        An existing bridge is used as it is (its MTU set when the spec gives one); a non-bridge of that
        name is an error, and so is a bridge of the lab's default name that is not the lab's. The
        uplink must exist and its port (the uplink, or its VLAN link) be free or already a port of
        this bridge; a bridge has one uplink, whichever lab enslaved it. The claim is registered
        before the bridge (or VLAN link) is created; on failure the claim is dropped and what was
        created here is deleted again.
        """
        check_name(self.name)
        port = self.port
        if self.uplink is not None:
            check_name(self.uplink)
            if self.name in (self.uplink, port):
                raise LinkError(self.name, "a bridge cannot be its own uplink")
        with BridgeRegistry.locked() as registry, netlink(self.name) as nl:
            existing = nl.get(self.name)
            if existing is not None and existing.kind != BRIDGE_KIND:
                raise LinkError(self.name, f"exists and is {existing.describe()}, not a bridge",
                                hint=f"remove it or give network.{self.network}.bridge another name")
            parent = self._existing_uplink(nl) if self.uplink is not None else None
            uplink = self._port(nl, registry, existing, parent)
            entry = registry.bridges.get(self.name)
            if existing is not None:
                entry = self._adopt(ctx, nl, existing, entry)
                self._one_uplink(ctx, nl, registry, existing, entry)
            else:
                if entry is not None:  # a stale entry of a bridge gone: what vmlaunch made for it goes
                    drop_uplink(nl, self.name, None, entry)
                # the claim first: a vmlaunch killed after creating the bridge leaves the claim for the
                # next up or down of this lab (the bridge is not journaled yet)
                entry = BridgeEntry(created=True, index=None, uplink=None,
                                    labs=entry.labs if entry is not None else [])
            entry.claim(ctx.lab)
            registry.bridges[self.name] = entry
            registry.save()
            created = vlan_claimed = vlan_created = False
            try:
                if existing is None:
                    created = nl.add(self.name, f"creating bridge for network {self.network}",
                                     kind=BRIDGE_KIND)
                    bridge = self._mark_new(ctx, nl, created, entry, registry)
                else:
                    bridge = existing
                if self.vlan is not None and parent is not None and port is not None:
                    if uplink is None:
                        # first: a kill after creating it leaves the VLAN link for the next up or down
                        entry.uplink, entry.uplink_created, entry.uplink_index = port, True, None
                        vlan_claimed = True
                        registry.save()
                        vlan_created = nl.add_vlan(port, parent, self.vlan)
                        uplink = self._mark_vlan(ctx, nl, vlan_created, entry, registry)
                    elif uplink.lab is not None and not (entry.uplink == port and entry.uplink_created):
                        # one vmlaunch made, which no entry claims (a killed up): deleted when done
                        entry.uplink, entry.uplink_created, entry.uplink_index = port, True, uplink.index
                        registry.save()
                enslave = uplink is not None and uplink.master != bridge.index
                settings: dict[str, Any] = {"state": "up"}
                if self.mtu is not None:
                    settings["mtu"] = self.mtu
                nl.set(bridge, "bringing it up" + (f" with mtu {self.mtu}" if self.mtu else ""), **settings)
                if uplink is not None and enslave:
                    entry.uplink = port  # first: a kill after enslaving leaves it to be released
                    registry.save()
                    nl.set(uplink, f"enslaving it to bridge {self.name}", master=bridge.index, state="up")
            except BaseException:
                if vlan_created:
                    with contextlib.suppress(LinkError):
                        nl.delete(nl.require(str(port), "deleting it again"))
                if vlan_claimed:
                    entry.uplink, entry.uplink_created, entry.uplink_index = None, False, None
                if created:
                    with contextlib.suppress(LinkError):
                        nl.delete(nl.require(self.name, "deleting it again"))
                entry.leave(ctx.lab)
                if existing is None or (not entry.created and not entry.labs):
                    registry.bridges.pop(self.name, None)  # the claim written above, or one of no use
                with contextlib.suppress(OSError):
                    registry.save()
                raise
        return BridgeRecord(name=self.name, created=entry.created, uplink=port if enslave else None,
                            uplink_created=entry.uplink_created if enslave else False)

    def _existing_uplink(self, nl: Netlink) -> Link:
        assert self.uplink is not None
        uplink = nl.get(self.uplink)
        if uplink is None:
            raise LinkError(self.uplink, f"the uplink of bridge {self.name} does not exist",
                            hint=f"check network.{self.network}.uplink (`ip link` lists the interfaces)")
        if self.vlan is not None and not uplink.up:
            log.warning("interface %s is down: VLAN %s of it carries nothing until it is up (`ip link set "
                        "%s up`)", uplink.name, self.vlan, uplink.name)
        return uplink

    def _port(self, nl: Netlink, registry: BridgeRegistry, bridge: Link | None,
              parent: Link | None) -> Link | None:
        """The interface to enslave (the uplink, or its VLAN link), checked to be free or already this
        bridge's port; None when there is none, or the VLAN link is yet to be created."""
        port = self.port
        if port is None or parent is None:
            return None
        for name, other in registry.bridges.items():
            if name != self.name and other.uplink == port and registry.users(name, but=""):
                raise LinkError(port, f"cannot be the uplink of bridge {self.name}: it is the uplink of "
                                f"bridge {name}, which lab {', '.join(other.labs)} uses")
        link = parent if self.vlan is None else nl.get(port)
        if link is None:
            return None
        if self.vlan is not None and (link.kind != VLAN_KIND or link.parent != parent.index
                                      or link.vlan != self.vlan):
            what = (f"VLAN {link.vlan} of {nl.name_of(link.parent)}" if link.kind == VLAN_KIND
                    and link.parent is not None else link.describe())
            raise LinkError(port, f"exists and is {what}, not VLAN {self.vlan} of {self.uplink}",
                            hint=f"it is not vmlaunch's to change: remove it, or use another "
                            f"network.{self.network}.vlan")
        if link.master is not None and (bridge is None or link.master != bridge.index):
            master = nl.name_of(link.master)
            raise LinkError(port, f"cannot be the uplink of bridge {self.name}: it is already "
                            f"enslaved to {master}",
                            hint=f"release it first (`ip link set {port} nomaster`)")
        return link

    def _one_uplink(self, ctx: Context, nl: Netlink, registry: BridgeRegistry, bridge: Link,
                    entry: BridgeEntry) -> None:
        """A bridge has the one uplink vmlaunch enslaved to it: another lab's that differs from this
        lab's is an error; one no lab uses any more is released (and deleted if vmlaunch made it)."""
        if entry.uplink is None or self.port is None or entry.uplink == self.port:
            return
        others = registry.users(self.name, but=ctx.lab)
        if others:
            raise LinkError(self.name, f"its uplink is {entry.uplink}, for lab {', '.join(others)}: "
                            f"it cannot also take {self.port} (network {self.network})",
                            hint="give the networks the same uplink (and vlan), or bridges of their own")
        drop_uplink(nl, self.name, bridge, entry)

    def _mark_vlan(self, ctx: Context, nl: Netlink, created: bool, entry: BridgeEntry,
                   registry: BridgeRegistry) -> Link:
        """Mark the VLAN link just created as vmlaunch's and record its ifindex."""
        port = str(self.port)
        if not created:
            raise LinkError(port, "an interface of that name appeared while creating the VLAN link")
        link = nl.require(port, "after creating it")
        nl.mark(link, interface_mark(ctx.lab, net=self.network, vlan=str(self.vlan)))
        entry.uplink_index = link.index
        registry.save()
        return nl.require(port, "after marking it")

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
            return BridgeEntry(created=False, labs=entry.labs, uplink=entry.uplink,
                               uplink_created=entry.uplink_created, uplink_index=entry.uplink_index)
        return entry
