"""A NIC's `netem = { ... }` on the host side: netem on its tap and on the IFB its ingress is redirected
to (host/netem.py), applied right after the tap exists and undone at `down`.

The tap goes with the lab; the IFB would outlive it, so the record deletes it (and clears the tap's
qdiscs when the tap is still there: a VM taken down alone). The IFB carries the lab's mark, so
`down --force` finds it without the journal (runtime/salvage.py). `up` records the figures in wire.json
once its VMs run (rig/netem.py), so that `vmlaunch netem SPEC` lists them and `--clear` clears them.

Netem in the guest (`where = "guest"`, or `auto` on a host without netem) is not a host resource: `up`
sets it through the guest's command channel once the guest answers (rig/netem.py).
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import attrs

from vmlaunch.host.links import check_name, netlink
from vmlaunch.resources.base import Context, OfVm
from vmlaunch.resources.links import interface_name
from vmlaunch.spec.model import Netem


@attrs.frozen
class NetemRecord:
    """Netem set on a tap and its IFB (always made by vmlaunch, with the lab's mark)."""

    kind: ClassVar[str] = "netem"

    tap: str = attrs.field(validator=interface_name)
    ifb: str = attrs.field(validator=interface_name)
    vm: str
    index: int

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Clear the tap's qdiscs (when it is still there) and delete the IFB (when it is the lab's)."""
        from vmlaunch.host.netem import clear_on_tap

        check_name(self.ifb)
        with netlink(self.ifb) as nl:
            clear_on_tap(nl, ctx.lab, self.tap, self.ifb)

    def describe(self) -> str:
        return f"netem on tap {self.tap} of {self.vm} (IFB {self.ifb})"


@attrs.frozen
class TapNetem(OfVm):
    """A NIC's netem from the spec, on its tap (and an IFB for what the VM sends)."""

    kind: ClassVar[str] = "netem"

    tap: str
    ifb: str
    vm: str
    index: int
    netem: Netem

    @property
    def key(self) -> str:
        return self.tap

    def describe(self) -> str:
        from vmlaunch.spec.netem import figures

        shown = " ".join(f"{key} {value}" for key, value in figures(self.netem).items())
        return f"netem on tap {self.tap} of {self.vm}: {shown}"

    def found(self) -> str | None:
        return None

    def apply(self, ctx: Context) -> NetemRecord:
        from vmlaunch.host.netem import apply_on_tap, clear_on_tap

        check_name(self.tap)
        check_name(self.ifb)
        record = NetemRecord(tap=self.tap, ifb=self.ifb, vm=self.vm, index=self.index)
        with netlink(self.tap) as nl:
            try:
                apply_on_tap(nl, ctx.lab, self.vm, self.tap, self.ifb, self.netem)
            except BaseException:
                with contextlib.suppress(Exception):  # the error of the apply is the one to say
                    clear_on_tap(nl, ctx.lab, self.tap, self.ifb)
                raise
        return record
