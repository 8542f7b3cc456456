"""Faults on the wire set while a lab runs, as one record: each NIC's link state and netem, and the
lab's partition. `wire.json` in the run dir (`RunDir.wire`) holds it, so that `netem --json`, `status`
and the evidence of a failed test can show it, and `down` (or the next command after a crash) can undo
what lives outside the QEMUs: netem on a shared host interface, the partition's nftables table.

    {"version": 1,
     "nics": {"VM/INDEX": {"link": "down", "netem": {"delay_ms": 100, ..., "where": "guest"}}},
     "partition": {"groups": [["a", "b"]], "where": {"lan": "host"}}}

(`partition` also holds `"unfinished": "why"` while a change of it runs, and after one that could not
be finished nor undone: `where` then names every cut that may exist; see `rig/partition.py`.)

Every change goes through `update()`, under the file's lock, written atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.errors import RuntimeFailure, UsageError
from vmlaunch.layout.rundir import RunDir, open_in_run_dir
from vmlaunch.spec.model import LabSpec

VERSION = 1
State = dict[str, Any]


def empty() -> State:
    return {"version": VERSION, "nics": {}, "partition": {"groups": [], "where": {}}}


def nic_key(vm: str, index: int) -> str:
    return f"{vm}/{index}"


def load(run_dir: RunDir) -> State:
    """The wire state; the empty one when nothing was set (or the file is not vmlaunch's)."""
    try:
        fd = open_in_run_dir(run_dir.wire, os.O_RDONLY)
    except FileNotFoundError:
        return empty()
    with os.fdopen(fd) as handle:
        try:
            data = json.load(handle)
        except (ValueError, UnicodeDecodeError):
            return empty()
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return empty()
    state = empty()
    if isinstance(data.get("nics"), dict):
        state["nics"] = data["nics"]
    if isinstance(data.get("partition"), dict):
        state["partition"].update(data["partition"])
    return state


@contextlib.contextmanager
def _locked(run_dir: RunDir) -> Iterator[None]:
    fd = open_in_run_dir(run_dir.wire_lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def update(run_dir: RunDir, change: Callable[[State], None]) -> State:
    """Apply `change` to the wire state under its lock and save it; returns the new state. Nothing is
    written when the lab is not up (its run dir is gone)."""
    if not run_dir.path.is_dir():
        raise RuntimeFailure(f"lab {run_dir.lab} is not up", "`vmlaunch up` it first")
    with _locked(run_dir):
        state = load(run_dir)
        change(state)
        text = json.dumps(state, indent=1, sort_keys=True) + "\n"
        write_atomic(run_dir.wire, text, mode=0o600)
        return state


def resolve_nic(lab: LabSpec, vm: str, text: str) -> int:
    """The index of the NIC `text` names on VM `vm`: its index (`0`), `nicN`/`netN` (QEMU's ids) or
    the name of the network it is on when the VM has one NIC there. UsageError otherwise, naming the
    NICs the VM has."""
    spec = lab.vm(vm)
    count = len(spec.nics)
    choices = ", ".join(f"{index} ({nic.network})" for index, nic in enumerate(spec.nics)) or "none"
    word = text.strip()
    for prefix in ("nic", "net"):
        if word.startswith(prefix) and word[len(prefix):].isdigit():
            word = word[len(prefix):]
    if word.isdigit():
        index = int(word)
        if index < count:
            return index
        raise UsageError(f"VM {vm} has no NIC {text} (its NICs: {choices})")
    matches = [index for index, nic in enumerate(spec.nics) if nic.network == word]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UsageError(f"VM {vm} has {len(matches)} NICs on network {word}: name one by its index",
                         f"its NICs: {choices}")
    raise UsageError(f"VM {vm} has no NIC {text!r} (its NICs: {choices})")
