"""Which labs use which bridge, host-wide, and whether vmlaunch created it: `bridges.json` in the run root.

A bridge can be shared: two labs whose specs name the same `network.X.bridge`. Whether it is removed
must not depend on which lab saw it first, nor on the order the labs go down, so one file records, for
every bridge a lab uses, the labs that use it and whether vmlaunch created it; the last lab to leave a
bridge vmlaunch created removes it, and a bridge vmlaunch did not create is never removed.

    {"version": 1,
     "bridges": {"br0": {"created": true, "index": 7, "uplink": "eth1", "labs": ["a", "b"]},
                 "br1": {"created": false, "index": null, "uplink": "eth1.42", "uplink_created": true,
                         "uplink_index": 9, "labs": ["c"]}}}

- `created`: vmlaunch created the bridge, the interface whose ifindex is `index`. The claim is written
  before the bridge is created, with `index` null until it is: a vmlaunch killed in between leaves a
  claim that the next `up` or `down` of its lab finishes (ifindexes are not reused, so a bridge
  deleted and made again by someone else is not taken for ours).
- `uplink`: the uplink vmlaunch enslaved to it, released when the last lab leaves. With
  `uplink_created`, vmlaunch created it, an 802.1Q VLAN link (`eth1.42`) whose ifindex is
  `uplink_index` (null until made): deleted when the last lab leaves, whatever became of the bridge.
- `labs`: the labs that use it. A lab whose run dir has no journal and that no `up` or `down` holds
  the lock of is gone (its run dir was removed, or a killed `up` never journaled anything): its claim
  is stale and dropped, so it never keeps a bridge alive.

The file and its lock are kept as every host-wide file of the run root is (`hostwide.py`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.core.naming import interface_name_problem
from vmlaunch.host import hostwide
from vmlaunch.host.hostwide import LAB_NAME, LOCK_TIMEOUT, RegistryError, lab_in_use

__all__ = ["REGISTRY_FILE", "REGISTRY_LOCK", "BridgeEntry", "BridgeRegistry", "RegistryError", "lab_in_use"]

REGISTRY_VERSION = 1
REGISTRY_FILE = "bridges.json"  # no lab is called that: lab names have no '.'
REGISTRY_LOCK = "bridges.lock"  # a lab's lock is ".LAB.lock"


@attrs.define
class BridgeEntry:
    """One bridge some lab uses (see the module docstring)."""

    created: bool
    index: int | None = None
    uplink: str | None = None
    labs: list[str] = attrs.Factory(list)
    uplink_created: bool = False
    uplink_index: int | None = None

    def claim(self, lab: str) -> None:
        if lab not in self.labs:
            self.labs.append(lab)

    def leave(self, lab: str) -> None:
        self.labs = [other for other in self.labs if other != lab]


@attrs.define
class BridgeRegistry:
    """The registry as read under its lock; `save` writes it back."""

    root: Path
    bridges: dict[str, BridgeEntry] = attrs.Factory(dict)

    @property
    def path(self) -> Path:
        return self.root / REGISTRY_FILE

    @classmethod
    @contextlib.contextmanager
    def locked(cls, root: Path | None = None, timeout: float = LOCK_TIMEOUT) -> Iterator[BridgeRegistry]:
        """The registry, read under its lock, held for the block (which saves what it changes)."""
        with hostwide.locked(REGISTRY_FILE, REGISTRY_LOCK, "bridge registry", root, timeout) as where:
            yield cls.load(where)

    @classmethod
    def load(cls, root: Path) -> BridgeRegistry:
        registry = cls(root)
        doc = hostwide.read_document(registry.path, REGISTRY_VERSION, registry._damaged)
        if doc is None:
            return registry
        try:
            bridges = doc.get("bridges")
            if not isinstance(bridges, dict):
                raise ValueError("no table of bridges")
            registry.bridges = {name: _entry(name, data) for name, data in bridges.items()}
        except ValueError as exc:
            raise registry._damaged(str(exc)) from exc
        return registry

    def _damaged(self, problem: str) -> RegistryError:
        return RegistryError(f"the bridge registry {self.path} cannot be read: {problem}",
                             "remove it: vmlaunch then keeps every bridge that exists (it cannot know "
                             "which ones it created) and records anew")

    def save(self) -> None:
        if not self.bridges:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return
        doc = {"version": REGISTRY_VERSION,
               "bridges": {name: _plain(entry) for name, entry in sorted(self.bridges.items())}}
        write_atomic(self.path, json.dumps(doc, indent=1) + "\n")

    def users(self, name: str, but: str) -> list[str]:
        """The labs other than `but` that still use bridge `name`; stale claims are dropped."""
        entry = self.bridges.get(name)
        if entry is None:
            return []
        entry.labs = [lab for lab in entry.labs if lab == but or lab_in_use(self.root, lab)]
        return [lab for lab in entry.labs if lab != but]

    def of_lab(self, lab: str) -> list[str]:
        """The bridges `lab` has a claim on."""
        return [name for name, entry in self.bridges.items() if lab in entry.labs]


def _plain(entry: BridgeEntry) -> dict[str, Any]:
    """The entry as JSON; the VLAN link's keys only when it has one, so a vmlaunch older than them
    still reads a registry without VLANs."""
    plain = attrs.asdict(entry)
    if not entry.uplink_created:
        del plain["uplink_created"], plain["uplink_index"]
    return plain


def _entry(name: str, data: Any) -> BridgeEntry:
    if interface_name_problem(name):
        raise ValueError(f"bridge {name!r}: {interface_name_problem(name)}")
    if not isinstance(data, dict) or set(data) - {"created", "index", "uplink", "labs", "uplink_created",
                                                  "uplink_index"}:
        raise ValueError(f"bridge {name}: not an object with created, index, uplink and labs")
    created, index, uplink, labs = (data.get(k) for k in ("created", "index", "uplink", "labs"))
    uplink_created, uplink_index = data.get("uplink_created", False), data.get("uplink_index")
    if not isinstance(created, bool) or not (index is None or type(index) is int):
        raise ValueError(f"bridge {name}: created must be true or false, index a number or null")
    if not isinstance(uplink_created, bool) or not (uplink_index is None or type(uplink_index) is int):
        raise ValueError(f"bridge {name}: uplink_created must be true or false, uplink_index a number "
                         "or null")
    if uplink is not None and (not isinstance(uplink, str) or interface_name_problem(uplink)):
        raise ValueError(f"bridge {name}: uplink {uplink!r} is not an interface name")
    if not isinstance(labs, list) or not all(isinstance(lab, str) and LAB_NAME.fullmatch(lab)
                                             for lab in labs):
        raise ValueError(f"bridge {name}: labs must be a list of lab names")
    return BridgeEntry(created=created, index=index, uplink=uplink, labs=list(labs),
                       uplink_created=uplink_created and uplink is not None, uplink_index=uplink_index)
