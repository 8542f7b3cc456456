"""What a check found: its id, its status, what was found, why it matters and the fix."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import attrs

from vmlaunch.errors import KeyPath, format_key_path

if TYPE_CHECKING:
    from vmlaunch.spec.model import LabSpec


class Status(enum.Enum):
    OK = "ok"
    NOTE = "note"  # worth knowing, nothing to do unless it matters to the user
    WARN = "warn"  # works, but against the best practice: slower, riskier, or about to fail
    FAIL = "fail"  # will not work as the spec or the host is (doctor exits 1)


@attrs.frozen
class Finding:
    id: str  # "host.kvm", "lab.alignment", ...: stable, for tools
    status: Status
    found: str  # what the check found, in a sentence
    why: str = ""  # why it matters, and where that comes from (a seed, QEMU's or the kernel's docs)
    fix: str | None = None  # the exact fix: a command, a package, a spec key
    where: str | None = None  # the spec line it is about, `FILE:LINE: key.path`

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "status": self.status.value}


def where(lab: LabSpec, path: KeyPath) -> str:
    """A finding's `where`: the spec line of key `path` in `lab`, `FILE:LINE: key.path`."""
    return f"{lab.file}:{lab.source.line_of(path)}: {format_key_path(path)}"


# Where the advice comes from, cited in `why` by a title a user can look up (the documents vmlaunch was
# designed from; the spec reference's Sources list them in full).
GUIDE = "IBM's \"Best practices for KVM\""
NUMA_TALK = "Theurer's \"Improving the Out-of-Box KVM Performance\""
CACHE_STUDY = "Red Hat's \"KVM storage performance and cache settings\""
PASSTHROUGH = "the LIO wiki's KVM guests with pass-through NICs"
