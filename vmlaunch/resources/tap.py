"""The tap device of each NIC on a bridge network, enslaved to its bridge before QEMU opens it.

vmlaunch owns its taps rather than leaving them to ifup/ifdown scripts: a downscript does not run when
QEMU is killed, so scripts leak taps. A tap is journaled like any resource and removed by `down` or a
failed `up`, whatever happened to QEMU.

Coverage: this runs only inside private network namespaces (tests/netns_links.py and the end-to-end
tests, both subprocesses), which `make test`'s in-process coverage figure does not see.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import attrs

from vmlaunch.hostlinks import BRIDGE_KIND, TUN_KIND, LinkError, check_name, netlink
from vmlaunch.naming import interface_name_problem
from vmlaunch.resources.base import Context


def _interface_name(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if interface_name_problem(value):
        raise ValueError(f"{attribute.name}: {interface_name_problem(value)}")


@attrs.frozen
class TapRecord:
    """A tap `Tap.apply` made (always ours: a stale one of the same name is replaced)."""

    kind: ClassVar[str] = "tap"

    name: str = attrs.field(validator=_interface_name)
    bridge: str = attrs.field(validator=_interface_name)

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Delete the tap; one already gone (or an interface of that name that is no tap) is left."""
        with netlink(self.name) as nl:
            tap = nl.get(self.name)
            if tap is not None and tap.kind == TUN_KIND:
                nl.delete(tap)

    def describe(self) -> str:
        return f"tap {self.name} on bridge {self.bridge}"


@attrs.frozen
class Tap:
    """A tap device for one NIC, enslaved to its bridge before QEMU opens it."""

    kind: ClassVar[str] = "tap"

    ifname: str
    bridge: str
    vm: str
    mtu: int | None = None
    multi_queue: bool = False

    @property
    def key(self) -> str:
        return self.ifname

    @property
    def owner(self) -> str | None:
        return self.vm

    def describe(self) -> str:
        return f"tap {self.ifname} for {self.vm} on bridge {self.bridge}"

    def found(self) -> str | None:
        return None

    def apply(self, ctx: Context) -> TapRecord:
        """Create the tap (MTU, port of its bridge, up), replacing a stale one of that name.

        A tap of that name that no process has open (left by a killed vmlaunch) is deleted and
        recreated; one that is open (a running QEMU) or an interface that is not a tap is an error.
        """
        check_name(self.ifname)
        with netlink(self.ifname) as nl:
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
                if old.carrier:
                    raise LinkError(self.ifname, f"the tap of {self.vm} exists and a process has it open",
                                    hint="is this lab already up? (`vmlaunch status`)")
                nl.delete(old)
            # pyroute2 creates taps with the TUNSETIFF ioctl, which attaches to an existing tap of that
            # name rather than failing (hence the look-up above) and fails with EINVAL on a non-tap
            flags = {"no_pi": True, "multi_queue": self.multi_queue}
            if not nl.add(self.ifname, f"creating the tap of {self.vm}", kind="tuntap", mode="tap",
                          ifr=flags):
                raise LinkError(self.ifname, "an interface of that name appeared while creating the tap")
            tap = nl.require(self.ifname, "after creating it")
            try:
                if self.mtu is not None:  # before enslaving: a bridge with a set MTU keeps it
                    nl.set(tap, f"setting mtu {self.mtu}", mtu=self.mtu)
                nl.set(tap, f"enslaving it to bridge {self.bridge}", master=bridge.index)
                nl.set(tap, "bringing it up", state="up")
            except BaseException:
                with contextlib.suppress(LinkError):
                    nl.delete(tap)
                raise
        return TapRecord(name=self.ifname, bridge=self.bridge)
