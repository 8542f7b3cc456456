"""Exporting a lab to other engines: `export(lab, ...) -> Export`, pure functions like the compiler.

- `libvirt.py`: a domain XML per VM, a network XML per bridge network.
- `kubevirt.py`: a kubevirt.io/v1 VirtualMachine per VM, a Multus NetworkAttachmentDefinition per
  network (bridge CNI, or OVN-Kubernetes layer2 for a network that must span nodes).

Each exporter carries over what vmlaunch itself would do (the compiler's choices, not only the spec's
keys), and reports each spec key the target has no equivalent for as a `Problem` with its line:
a warning, or with `--strict` an error (`ExportError`, exit 3). Same lab, same bytes: output is
deterministic (golden tests). The files are written by `cli/export.py`; nothing here touches the disk,
except that the KubeVirt exporter reads a VM's `cloud_init.user_data` file, as `up` would.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from vmlaunch.errors import KeyPath, Location, Problem
from vmlaunch.spec.model import LabSpec

TARGETS = ("libvirt", "kubevirt")


@attrs.frozen
class ExportedFile:
    path: str  # relative to the output folder: "domains/alpha.xml"
    text: str


@attrs.frozen
class Export:
    """What an exporter made of a lab."""

    target: str  # one of TARGETS
    files: tuple[ExportedFile, ...]
    problems: tuple[Problem, ...] = ()  # spec keys without an equivalent: warnings, or --strict errors
    todo: tuple[str, ...] = ()  # what a user does before defining or applying the files
    lab_files: tuple[Path, ...] = ()  # files of the lab dir the definitions use (made by `vmlaunch up`)


class Findings:
    """Collects the problems of one export, each with the line of its key."""

    def __init__(self, lab: LabSpec) -> None:
        self.lab = lab
        self.problems: list[Problem] = []

    def add(self, path: KeyPath, message: str, hint: str | None = None) -> None:
        location = Location(self.lab.file, self.lab.source.line_of(path), path)
        problem = Problem(location, message, hint)
        if problem not in self.problems:
            self.problems.append(problem)

    def sorted(self) -> tuple[Problem, ...]:
        return tuple(sorted(self.problems, key=lambda p: (p.location.line, str(p.location))))


def qualified(lab: LabSpec, name: str) -> str:
    """The name of a VM's or network's object on the target: `LAB-NAME`, so that two labs with a VM
    `web` can share a libvirt host or a namespace (both names are DNS labels: so is the result)."""
    return f"{lab.name}-{name}"
