"""The uid (and gid) a VM's QEMU runs as in a lab run as root (confine.py): claimed host-wide before the
QEMU starts, released when the VM goes down. The executor starts the QEMU with `-runas UID:GID` from
this record.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import attrs

from vmlaunch import confine
from vmlaunch.resources.base import Context, Resource

log = logging.getLogger(__name__)


@attrs.frozen
class VmUserRecord:
    """The uid a VM holds (its gid is the same number)."""

    kind: ClassVar[str] = "vm-user"

    vm: str
    uid: int
    root: str  # the lab's run root, as the claim names it

    @property
    def gid(self) -> int:
        return self.uid

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        confine.release(self.uid, Path(self.root), ctx.lab, self.vm)

    def describe(self) -> str:
        return f"VM {self.vm} runs as uid {self.uid}"


@attrs.frozen
class VmUser:
    """A uid of its own for the VM's QEMU, from VMLAUNCH_UID_RANGE."""

    kind: ClassVar[str] = "vm-user"

    vm: str
    run_root: Path

    @property
    def key(self) -> str:
        return self.vm

    @property
    def owner(self) -> str | None:
        return self.vm

    def describe(self) -> str:
        return (f"VM {self.vm}: QEMU runs as a uid of its own, from {confine.RANGE_ENV} "
                f"({confine.uid_range()})")

    def found(self) -> str | None:
        return None

    @staticmethod
    def preflight(resources: Sequence[Resource]) -> None:
        """The range is the host's to give: no account, group or subordinate range may use it."""
        confine.check_range(confine.uid_range())

    def apply(self, ctx: Context) -> VmUserRecord:
        uid = confine.claim(self.run_root, ctx.lab, self.vm, confine.uid_range())
        log.debug("%s: QEMU runs as uid %d", self.vm, uid)
        return VmUserRecord(self.vm, uid, str(self.run_root))
