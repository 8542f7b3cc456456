"""Intent before action: an operation that changes live state writes what it is about to do first.

A snapshot save or restore pauses every VM of the lab; killed half-way (SIGKILL, a power cut of the
terminal), it would leave them paused for good, and a later command could not tell vmlaunch's pause
from the user's own. So before it pauses anything, it writes `intent.json` in the run dir: which
operation, which snapshot, which VMs it pauses. It removes the file when it is done, whatever the
outcome. A file still there while nobody holds the lab's lock is an operation that was interrupted:
the next command that takes the lock finishes or undoes it (`snapshot.finish_interrupted`) and says
what it did, and `status` says why such a VM is paused.

The file is written atomically (a temp file, fsync'd, renamed), as the journal is, and read as the
journal is: never through a link, a damaged one is an error naming it.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import stat
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.rundir import RunDir, open_in_run_dir

log = logging.getLogger(__name__)
MAX_SIZE = 1 << 20


class Operation(enum.Enum):
    SAVE = "snapshot save"
    RESTORE = "snapshot restore"


@attrs.frozen
class Intent:
    """An operation under way on a running lab, as written before it paused anything."""

    operation: Operation
    snapshot: str  # the snapshot's name
    vms: tuple[str, ...]  # every VM it works on
    paused: tuple[str, ...]  # the VMs it pauses (they were running): the ones to resume
    pid: int  # the vmlaunch that writes it
    started: float  # time.time()
    # VM -> its snapshot disks as (block node, file), the first holding the RAM: what the next command
    # needs to finish or undo the operation, with no spec to read
    disks: dict[str, tuple[tuple[str, str], ...]] = attrs.field(factory=dict, eq=False)

    def describe(self) -> str:
        return f"{self.operation.value} {self.snapshot!r}"

    def to_json(self) -> dict[str, Any]:
        return {"operation": self.operation.value, "snapshot": self.snapshot, "vms": list(self.vms),
                "paused": list(self.paused), "pid": self.pid, "started": self.started,
                "disks": {vm: [list(disk) for disk in disks] for vm, disks in self.disks.items()}}

    def with_paused(self, paused: tuple[str, ...]) -> Intent:
        return attrs.evolve(self, paused=paused)


class IntentError(RuntimeFailure):
    """The intent file cannot be read: another version wrote it, or it is damaged."""


def begin(run_dir: RunDir, operation: Operation, snapshot: str, vms: tuple[str, ...],
          paused: tuple[str, ...], disks: Mapping[str, Sequence[tuple[str, str]]]) -> Intent:
    """Record the operation (before it pauses anything); the caller holds the lab's lock."""
    intent = Intent(operation, snapshot, vms, paused, os.getpid(), time.time(),
                    {vm: tuple(pairs) for vm, pairs in disks.items()})
    write(run_dir, intent)
    return intent


def write(run_dir: RunDir, intent: Intent) -> None:
    write_atomic(run_dir.intent, json.dumps(intent.to_json(), indent=1) + "\n")


def end(run_dir: RunDir) -> None:
    """The operation is over (done, or undone): nothing is left to finish."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(run_dir.intent)


def read(run_dir: RunDir) -> Intent | None:
    """The operation recorded in the run dir, None when there is none."""
    try:
        fd = open_in_run_dir(run_dir.intent, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IntentError(f"{run_dir.intent} cannot be read: {exc.strerror or exc}") from None
    except RuntimeFailure as exc:  # a planted link
        raise IntentError(exc.message, exc.hint) from None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("it is not a regular file")
            return _parse(json.loads(f.read(MAX_SIZE + 1)))
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise IntentError(f"{run_dir.intent} is damaged ({exc})") from None


def _parse(doc: Any) -> Intent:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    names = {key: doc[key] for key in ("vms", "paused")}
    if not all(isinstance(value, list) and all(isinstance(name, str) for name in value)
               for value in names.values()):
        raise ValueError("vms and paused are lists of VM names")
    snapshot, pid, started, disks = doc["snapshot"], doc["pid"], doc["started"], doc["disks"]
    if not isinstance(snapshot, str) or not isinstance(pid, int) or not isinstance(started, (int, float)):
        raise ValueError("snapshot, pid or started is of the wrong type")
    if not isinstance(disks, dict) or not all(
            isinstance(vm, str) and isinstance(pairs, list) and all(
                isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
                for pair in pairs) for vm, pairs in disks.items()):
        raise ValueError("disks is not a table of VMs' (node, file) pairs")
    return Intent(Operation(doc["operation"]), snapshot, tuple(names["vms"]), tuple(names["paused"]),
                  pid, float(started), {vm: tuple((node, file) for node, file in pairs)
                                        for vm, pairs in disks.items()})


def held_paused(run_dir: RunDir) -> dict[str, str]:
    """VM -> why vmlaunch keeps it paused: an interrupted restore (read without the lock, for `status`
    and `resume`); {} when there is no such VM."""
    try:
        found = read(run_dir)
    except IntentError:
        return {}
    if found is None or found.operation is not Operation.RESTORE:
        return {}
    return {vm: interrupted_restore(found) for vm in found.paused}


def interrupted_restore(found: Intent) -> str:
    """Why a VM an interrupted restore paused stays paused, and how to go on."""
    return (f"by an interrupted snapshot restore of {found.snapshot!r}: its memory may be half loaded; "
            f"`vmlaunch snapshot SPEC restore {found.snapshot}` loads it whole and resumes it, or "
            "`vmlaunch down SPEC` then `vmlaunch reset SPEC` starts it afresh")
