"""The shape every host resource has: a planned `Resource` that applies itself, and the `Record` it
returns, which is journaled and knows how to undo itself.

Adding a kind is one module (its resource and record classes) and one line in `registry.py`; the
executor does not change. Besides the protocol, a resource class may define, and the executor then
calls:

- `preflight(resources)` (static): check the kind's resources as a group before anything changes;
- `claim(ctx) -> Resource | None`: a resource applied and journaled before `apply` runs, for a change
  that takes a while (an image qemu-img writes): a crash leaves a journaled claim `down` can undo;
- `check_opened(pid)`: once the QEMUs run paused, check what this VM's QEMU opened (the disk file the
  path named when it was checked), before any guest runs;
- `attach(pid)`: then, still before any guest runs, put this VM's QEMU where the resource keeps it
  (its threads into a cpuset cgroup, its vCPUs on their CPUs);
- `refresh(ctx)`: for an `up` that finds the resource journaled already, bring what it keeps up to
  this plan (the lab manager's settings).

and a record may define `alive() -> bool`: a process that `up` starts again when it finds it gone
(the lab manager); its record is dropped from the journal and the resource applied anew.

A resource's `key` and `owner` are often the same few words; the mixins below say them once: `PerVm`
(one of its kind per VM: the VM is its key and its owner), `VmFile` (a VM's file, keyed by its path),
`OfVm` (a VM's, keyed otherwise) and `LabWide` (the whole lab's, keyed otherwise).

A claim's record covers what the resource did until the resource's own record replaces it: from then
on only the latter is undone, by a failing `up` as by `down`.

An undo that fails raises a VmlaunchError and stays journaled, for the next `down` to try again; one
that must not run twice (a user's down_script) raises `UndoneWithError`: reported, and dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import attrs

from vmlaunch.errors import RuntimeFailure


class UndoneWithError(RuntimeFailure):
    """Raised by `Record.undo` when what it did is final but failed (a down_script that exited non-zero):
    the record is done, never undone again, and the message is reported (a `down` then exits 4)."""


@attrs.frozen
class Context:
    """What resources may need from the run that applies or undoes them."""

    lab: str
    qemu_img: str = "qemu-img"
    sysfs: Path | None = None  # None: VMLAUNCH_SYSFS, else /sys
    # The umask of whoever runs vmlaunch: a file made for the user (a disk `up` creates beside the
    # spec) takes it, not the 077 under which the run dir and its logs are made.
    umask: int = 0o022


@runtime_checkable
class Record(Protocol):
    """What a resource did, journaled as soon as it is done; frozen, (un)structured by the journal."""

    kind: ClassVar[str]

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Undo exactly what was done. `rollback`: a failing `up` undoes it (not a `down`).

        Undoing twice does nothing the second time; a failure raises a VmlaunchError.
        """

    def describe(self) -> str:
        """One line for `status` and `down`: what it is and what vmlaunch did to it."""


@runtime_checkable
class Resource(Protocol):
    """A host change the plan asks for."""

    kind: ClassVar[str]

    @property
    def key(self) -> str:
        """Unique among the resources of its kind in a lab: how the journal knows it is done."""

    @property
    def owner(self) -> str | None:
        """The VM that needs it (undone when that VM goes down alone), None for the whole lab."""

    def describe(self) -> str:
        """One line for `up --dry-run`."""

    def found(self) -> str | None:
        """For `--dry-run`: what is on the host already that `apply` would keep, else None."""

    def apply(self, ctx: Context) -> Record:
        """Make the change; on failure leave nothing behind and raise a VmlaunchError."""


class OfVm:
    """Mixin: a resource one VM needs, so undone when that VM goes down alone; its owner is its `vm`."""

    __slots__ = ()

    @property
    def vm(self) -> str:
        raise NotImplementedError  # a field (or property) of the resource

    @property
    def owner(self) -> str | None:
        return self.vm


class PerVm(OfVm):
    """Mixin: one of its kind per VM, keyed by the VM too."""

    __slots__ = ()

    @property
    def key(self) -> str:
        return self.vm


class VmFile(OfVm):
    """Mixin: a file of one VM, keyed by its path."""

    __slots__ = ()

    @property
    def path(self) -> Path:
        raise NotImplementedError  # a field (or property) of the resource

    @property
    def key(self) -> str:
        return str(self.path)


class LabWide:
    """Mixin: a resource of the whole lab (its VMs share it): no VM owns it."""

    __slots__ = ()

    @property
    def owner(self) -> str | None:
        return None


def preflight(resources: Sequence[Resource]) -> None:
    """Before anything changes: each kind that can check its resources as a group does so (PCI: every
    IOMMU group viable), so a plan that cannot work is refused with the host untouched."""
    by_kind: dict[type[Resource], list[Resource]] = {}
    for resource in resources:
        by_kind.setdefault(type(resource), []).append(resource)
    for kind, group in by_kind.items():
        check = getattr(kind, "preflight", None)
        if check is not None:
            check(group)
