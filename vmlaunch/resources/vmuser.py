"""The uid (and gid) a VM's QEMU runs as in a lab run as root (host/confine.py), and its shares given to that
uid (guests/shareaccess.py): claimed host-wide before the QEMU starts, taken back when the VM goes down. The
executor starts the QEMU with `-runas UID:GID` from this record.

The uid and the shares are journaled first (a claim: `VmUserClaimRecord`), before any share is given:
a vmlaunch killed while it gives them leaves a record whose undo takes every share back (hand_back
needs no grant before it) and releases the uid; the next `up` gives them again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import attrs

from vmlaunch.host import confine
from vmlaunch.resources.base import Context, PerVm, Resource, UndoneWithError

log = logging.getLogger(__name__)


@attrs.frozen
class VmUserRecord:
    """The uid a VM holds (its gid is the same number) and the share folders given to it."""

    kind: ClassVar[str] = "vm-user"

    vm: str
    uid: int
    root: str  # the lab's run root, as the claim names it
    shares: tuple[str, ...] = ()  # folders given to the uid (shareaccess.grant)

    @property
    def gid(self) -> int:
        return self.uid

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Every share back to its folder's owner (what the guest made there included), then the uid
        released. What could not be handed back is reported, and not tried again: the uid is free."""
        from vmlaunch.guests.shareaccess import hand_back

        problems = [f"share {folder}: {problem}" for folder in self.shares
                    for problem in hand_back(Path(folder), self.uid, self.gid)]
        confine.release(self.uid, Path(self.root), ctx.lab, self.vm)
        if problems:
            raise UndoneWithError(f"VM {self.vm}: what its uid {self.uid} made could not all be handed "
                                  "back:\n" + "\n".join(problems))

    def describe(self) -> str:
        shared = f", given {', '.join(self.shares)}" if self.shares else ""
        return f"VM {self.vm} runs as uid {self.uid}{shared}"


@attrs.frozen
class VmUserClaimRecord(VmUserRecord):
    """The same, journaled before the shares are given (see the module's docstring)."""

    kind: ClassVar[str] = "vm-user-claim"


@attrs.frozen
class VmUserClaim(PerVm):
    kind: ClassVar[str] = "vm-user-claim"

    user: VmUser

    @property
    def vm(self) -> str:
        return self.user.vm

    def describe(self) -> str:
        return self.user.describe()

    def found(self) -> str | None:
        return None

    def apply(self, ctx: Context) -> VmUserClaimRecord:
        uid = confine.claim(self.user.run_root, ctx.lab, self.user.vm, confine.uid_range())
        return VmUserClaimRecord(self.user.vm, uid, str(self.user.run_root),
                                 tuple(str(folder) for folder, _ in self.user.shares))


@attrs.frozen
class VmUser(PerVm):
    """A uid of its own for the VM's QEMU, from VMLAUNCH_UID_RANGE, and its shares given to it."""

    kind: ClassVar[str] = "vm-user"

    vm: str
    run_root: Path
    shares: tuple[tuple[Path, bool], ...] = ()  # (folder, readonly)

    def describe(self) -> str:
        folders = ", ".join(str(folder) for folder, _ in self.shares)
        shared = f"; its shares given to it: {folders}" if self.shares else ""
        return (f"VM {self.vm}: QEMU runs as a uid of its own, from {confine.RANGE_ENV} "
                f"({confine.uid_range()}){shared}")

    def found(self) -> str | None:
        return None

    @staticmethod
    def preflight(resources: Sequence[Resource]) -> None:
        """The range is the host's to give: no account, group or subordinate range may use it."""
        confine.check_range(confine.uid_range())

    def claim(self, ctx: Context) -> Resource:
        return VmUserClaim(self)

    def apply(self, ctx: Context) -> VmUserRecord:
        uid = confine.claim(self.run_root, ctx.lab, self.vm, confine.uid_range())  # the claim's
        for folder, readonly in self.shares:
            from vmlaunch.guests.shareaccess import grant  # here: a VM without shares has no use for it

            given = grant(folder, uid, uid, readonly=readonly)
            for note in given.notes:
                log.info("%s: share %s: %s", self.vm, folder, note)
        log.debug("%s: QEMU runs as uid %d", self.vm, uid)
        return VmUserRecord(self.vm, uid, str(self.run_root), tuple(str(folder) for folder, _ in self.shares))
