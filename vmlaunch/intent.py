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
import os
import stat
import time
from typing import Any

import attrs

from vmlaunch.errors import RuntimeFailure
from vmlaunch.fsutil import write_atomic
from vmlaunch.rundir import RunDir, open_in_run_dir

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

    def describe(self) -> str:
        return f"{self.operation.value} {self.snapshot!r}"

    def to_json(self) -> dict[str, Any]:
        return {"operation": self.operation.value, "snapshot": self.snapshot, "vms": list(self.vms),
                "paused": list(self.paused), "pid": self.pid, "started": self.started}


class IntentError(RuntimeFailure):
    """The intent file cannot be read: another version wrote it, or it is damaged."""


def begin(run_dir: RunDir, operation: Operation, snapshot: str, vms: tuple[str, ...],
          paused: tuple[str, ...]) -> Intent:
    """Record the operation (before it pauses anything); the caller holds the lab's lock."""
    intent = Intent(operation, snapshot, vms, paused, os.getpid(), time.time())
    write_atomic(run_dir.intent, json.dumps(intent.to_json(), indent=1) + "\n")
    return intent


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
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("it is not a regular file")
            return _parse(json.loads(f.read(MAX_SIZE + 1)))
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise IntentError(f"{run_dir.intent} is damaged: {exc}",
                              "`vmlaunch resume SPEC` resumes the VMs that are paused; then remove "
                              "the file") from None


def _parse(doc: Any) -> Intent:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    names = {key: doc[key] for key in ("vms", "paused")}
    if not all(isinstance(value, list) and all(isinstance(name, str) for name in value)
               for value in names.values()):
        raise ValueError("vms and paused are lists of VM names")
    snapshot, pid, started = doc["snapshot"], doc["pid"], doc["started"]
    if not isinstance(snapshot, str) or not isinstance(pid, int) or not isinstance(started, (int, float)):
        raise ValueError("snapshot, pid or started is of the wrong type")
    return Intent(Operation(doc["operation"]), snapshot, tuple(names["vms"]), tuple(names["paused"]),
                  pid, float(started))
