"""What the link resources share (bridges, `bridge.py`, and taps, `tap.py`; a tap's scripts, `script.py`,
name its interfaces too): the rule every journaled interface name passes, the record of an interface
known by its name, and which taps are a lab's own to delete.
"""

from __future__ import annotations

from typing import Any

import attrs

from vmlaunch.core.naming import interface_name_problem
from vmlaunch.host.links import TUN_KIND, Link


def interface_name(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """attrs validator: an interface name (or None) that the kernel would take, so that a journal
    read back never hands netlink anything else."""
    problem = interface_name_problem(value) if value is not None else None
    if problem:
        raise ValueError(f"{attribute.name}: {problem}")


@attrs.frozen
class LinkRecord:
    """A network interface a link resource made or claimed, journaled by its name."""

    name: str = attrs.field(validator=interface_name)


def lab_tap(link: Link, lab: str) -> bool:
    """Whether `link` is a tap with `lab`'s mark: the only taps vmlaunch deletes for the lab (a stale one
    no process holds open when it finds one, its own when the lab goes down)."""
    return link.kind == TUN_KIND and link.lab == lab
