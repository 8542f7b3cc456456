"""The tap device of each NIC on a bridge network, enslaved to its bridge before QEMU opens it; on a
`type = "tap"` network, a tap alone, which the network's up_script wires (script.py).

vmlaunch owns its taps rather than leaving them to ifup/ifdown scripts: a downscript does not run when
QEMU is killed, so scripts leak taps. A tap is journaled like any resource and removed by `down` or a
failed `up`, whatever happened to QEMU.

Every tap vmlaunch creates carries its lab's mark (ifalias `vmlaunch lab=L vm=V bridge=B`), set before
the tap is made persistent, so no tap outlives vmlaunch without it. A tap is only ever replaced or
deleted when it carries the lab's own mark: a name taken by another lab's tap, or by one vmlaunch did
not create, is refused by `up` and left (with a warning) by `down`.

Coverage: this runs only inside private network namespaces (tests/netns_links.py and the end-to-end
tests, both subprocesses), which `make test`'s in-process coverage figure does not see.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import attrs

from vmlaunch.core.naming import interface_mark
from vmlaunch.host.links import BRIDGE_KIND, TUN_KIND, LinkError, check_name, netlink, new_tap
from vmlaunch.resources.base import Context, OfVm
from vmlaunch.resources.links import LinkRecord, interface_name, lab_tap

log = logging.getLogger(__name__)


@attrs.frozen
class TapRecord(LinkRecord):
    """A tap `Tap.apply` made (always ours: a stale one of the lab's is replaced)."""

    kind: ClassVar[str] = "tap"

    bridge: str | None = attrs.field(validator=interface_name)  # None: a tap network's (no bridge)

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Delete the tap. One already gone is nothing to do; an interface of that name that is not a
        tap with the lab's mark is not ours, and left with a warning."""
        with netlink(self.name) as nl:
            tap = nl.get(self.name)
            if tap is None:
                return
            if not lab_tap(tap, ctx.lab):
                log.warning("tap %s of lab %s: not deleted: the interface of that name is %s, %s",
                            self.name, ctx.lab, tap.describe(), tap.owner_text())
                return
            nl.delete(tap)

    def describe(self) -> str:
        return f"tap {self.name} on bridge {self.bridge}" if self.bridge else f"tap {self.name}"


@attrs.frozen
class Tap(OfVm):
    """A tap device for one NIC, enslaved to its bridge before QEMU opens it."""

    kind: ClassVar[str] = "tap"

    ifname: str
    bridge: str | None  # None: no bridge (a tap network: its up_script wires the tap)
    vm: str
    mtu: int | None = None
    multi_queue: bool = False

    @property
    def key(self) -> str:
        return self.ifname

    def describe(self) -> str:
        return f"tap {self.ifname} for {self.vm}" + (f" on bridge {self.bridge}" if self.bridge else "")

    def found(self) -> str | None:
        return None

    def apply(self, ctx: Context) -> TapRecord:
        """Create the tap (marked, MTU, port of its bridge if it has one, up), replacing a stale one of
        the lab's.

        A tap of that name with the lab's mark that no process has open (left by a killed vmlaunch) is
        deleted and recreated; one that is open (a running QEMU), that is another lab's or not marked by
        vmlaunch, or an interface that is not a tap is an error.
        """
        check_name(self.ifname)
        with netlink(self.ifname) as nl:
            bridge = None
            if self.bridge is not None:
                bridge = nl.get(self.bridge)
                if bridge is None:
                    raise LinkError(self.bridge, f"bridge of tap {self.ifname} ({self.vm}) does not exist")
                if bridge.kind != BRIDGE_KIND:
                    raise LinkError(self.bridge, f"is {bridge.describe()}, not a bridge (tap {self.ifname})")
            old = nl.get(self.ifname)
            if old is not None:
                if old.kind != TUN_KIND:
                    raise LinkError(self.ifname, f"the tap of {self.vm} cannot be created: an interface "
                                    f"of that name exists and is {old.describe()}")
                if old.lab != ctx.lab:
                    raise LinkError(self.ifname, f"the tap of {self.vm} cannot be created: a tap of that "
                                    f"name exists and is {old.owner_text()}",
                                    hint="vmlaunch never removes what is not its lab's; if it is a "
                                    f"leftover, `ip link del {self.ifname}`")
                if old.carrier:
                    raise LinkError(self.ifname, f"the tap of {self.vm} exists and a process has it open",
                                    hint="is this lab already up? (`vmlaunch status`)")
                nl.delete(old)
            mark = interface_mark(ctx.lab, vm=self.vm, **({"bridge": self.bridge} if self.bridge else {}))
            with new_tap(nl, self.ifname, multi_queue=self.multi_queue, mark=mark) as tap:
                if self.mtu is not None:  # before enslaving: a bridge with a set MTU keeps it
                    nl.set(tap, f"setting mtu {self.mtu}", mtu=self.mtu)
                if bridge is not None:
                    nl.set(tap, f"enslaving it to bridge {self.bridge}", master=bridge.index)
                nl.set(tap, "bringing it up", state="up")
        return TapRecord(name=self.ifname, bridge=self.bridge)
