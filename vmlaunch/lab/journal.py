"""The journal of a lab (`state.json` in its run dir) and the lock that serialises `up` and `down`.

Every host change is journaled as soon as it is made (atomically: a temp file, fsync'd, renamed over
the old one), so `down` can undo it from another process even when the `up` that made it was killed
half-way. The file is read and written through attrs classes with cattrs; each resource record is
structured as the class its kind names in `resources.registry`, so a record is either the frozen value
vmlaunch wrote or a clear error naming the file and the record.

    {"version": 2, "spec": "/path/lab.toml",
     "resources": [{"kind": "tap", "key": "vl-...", "vm": "alpha", "record": {...}}, ...],
     "vms": {"alpha": {"pid": 1234, "started": 1700000000.0, "accel": "tcg"}}}
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs

from vmlaunch.core.fsutil import lock_if_current, write_atomic
from vmlaunch.core.wait import TimedOut, wait_until
from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.rundir import RunDir, open_in_run_dir
from vmlaunch.resources.base import Record

MAX_SIZE = 64 << 20  # a journal of thousands of resources is under a megabyte
JOURNAL_VERSION = 2  # 1: vmlaunch 0.1.0, records as loose JSON objects

log = logging.getLogger(__name__)
T = TypeVar("T")


class JournalError(RuntimeFailure):
    """The journal cannot be read as one this vmlaunch wrote."""


class LabTaken(RuntimeFailure):
    """The lab's name is up from another spec file."""


class LabBusy(RuntimeFailure):
    """Another vmlaunch holds the lab's lock for longer than we were willing to wait."""


@attrs.frozen
class Entry:
    """One applied resource: its kind and key (unique per kind), the VM that needs it (None: the lab)."""

    kind: str
    key: str
    vm: str | None
    record: Record


@attrs.frozen
class VmEntry:
    """A VM `up` started: written before its QEMU starts (pid None), then with the pid."""

    pid: int | None
    started: float
    accel: str
    ssh_port: int | None = None  # the 127.0.0.1 port forwarded to the guest's 22 (a VM with ssh)
    boot: dict[str, float] | None = None  # where its boot time went (lab/timeline.py), once up


# --- (un)structuring ---------------------------------------------------------------------------------


def _exact(kind: type[T]) -> Callable[[Any, Any], T]:
    """cattrs converts `"5"` to 5 and `0` to False by default: a journal must hold exactly the type."""

    def structure(value: Any, _: Any) -> T:
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise TypeError(f"expected {kind.__name__}, got {value!r}")
        return kind(value)  # type: ignore[call-arg]

    return structure


def _path(value: Any, _: Any) -> Path:
    if not isinstance(value, str) or not value or "\0" in value:
        raise TypeError(f"expected a path, got {value!r}")
    return Path(value)


@functools.lru_cache(maxsize=2)
def _converter(strict: bool) -> Any:
    import cattrs  # only where a journal is read or written: ~15 ms

    conv = cattrs.Converter(forbid_extra_keys=strict)
    for kind in (str, int, bool, float):
        conv.register_structure_hook(kind, _exact(kind))
    conv.register_structure_hook(Path, _path)
    return conv


def _plain(value: Any) -> dict[str, Any]:
    return attrs.asdict(value, value_serializer=lambda _, __, v: str(v) if isinstance(v, Path) else v)


def _problem(exc: Exception) -> str:
    import cattrs

    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc))
    return str(exc)


def _entry(data: Any, strict: bool) -> Entry:
    from vmlaunch.resources.registry import RECORDS

    if not isinstance(data, dict) or not {"kind", "key", "record"} <= set(data):
        raise ValueError("not an object with kind, key and record")
    kind, key, vm = data["kind"], data["key"], data.get("vm")
    if not isinstance(kind, str) or not isinstance(key, str) or not (vm is None or isinstance(vm, str)):
        raise ValueError("kind, key and vm must be strings")
    if kind not in RECORDS:
        raise ValueError(f"unknown kind {kind!r} (this vmlaunch knows {', '.join(sorted(RECORDS))})")
    record = _converter(strict).structure(data["record"], RECORDS[kind])
    return Entry(kind=kind, key=key, vm=vm, record=record)


def _describe_raw(data: Any) -> str:
    if isinstance(data, dict):
        return f"{data.get('kind', '?')} {data.get('key', '?')}"
    return repr(data)[:60]


# --- the journal -------------------------------------------------------------------------------------


@attrs.define
class Journal:
    """Resources applied (in order) and VMs started, saved on every change."""

    run_dir: RunDir
    spec: str | None = None
    resources: list[Entry] = attrs.Factory(list)
    vms: dict[str, VmEntry] = attrs.Factory(dict)
    # `load(force=True)` only: what could not be read, one line each, for the user to handle by hand
    unreadable: list[str] = attrs.Factory(list)

    @property
    def path(self) -> Path:
        return self.run_dir.state

    @classmethod
    def load(cls, run_dir: RunDir, *, force: bool = False) -> Journal:
        """The lab's journal (empty when there is none).

        A file of another version, or with a damaged record or an unknown kind, is a JournalError naming
        the file and the record; with `force`, whatever can be read is kept and the rest listed in
        `unreadable`, so `down --force` removes everything it recognises.
        """
        journal = cls(run_dir)
        if not run_dir.secure():
            return journal
        try:
            fd = open_in_run_dir(journal.path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang us
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError("it is not a regular file")
                doc = json.loads(f.read(MAX_SIZE + 1))
        except FileNotFoundError:
            return journal
        except (OSError, ValueError, RecursionError) as exc:
            journal._fail(f"cannot be read: {exc}", force)
            return journal
        except RuntimeFailure as exc:  # a planted link
            journal._fail(f"cannot be read: {exc.message}", force)
            return journal
        if not isinstance(doc, dict):
            journal._fail("is not one vmlaunch wrote (not a JSON object)", force)
            return journal
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            journal._fail(f"is not one vmlaunch wrote (no journal version, found {version!r})", force)
        elif version != JOURNAL_VERSION:
            age = "an older" if version < JOURNAL_VERSION else "a newer"
            journal._fail(f"was written by {age} vmlaunch (journal version {version}; this one reads "
                          f"version {JOURNAL_VERSION})", force)
        spec = doc.get("spec")
        journal.spec = spec if isinstance(spec, str) else None
        resources = doc.get("resources", [])
        if not isinstance(resources, list):
            journal._fail("has no list of resources", force)
            resources = []
        for index, data in enumerate(resources):
            try:
                journal.resources.append(_entry(data, strict=not force))
            except Exception as exc:  # cattrs raises exception groups, validators ValueError, ...
                journal._fail(f"record {index} ({_describe_raw(data)}) is damaged: {_problem(exc)}",
                              force, data)
        vms = doc.get("vms", {})
        if not isinstance(vms, dict):
            journal._fail("has no table of VMs", force)
            vms = {}
        for name, data in vms.items():
            try:
                journal.vms[name] = _converter(not force).structure(data, VmEntry)
            except Exception as exc:
                journal._fail(f"the record of VM {name!r} is damaged: {_problem(exc)}", force, data)
        return journal

    def _fail(self, problem: str, force: bool, data: Any = None) -> None:
        if not force:
            raise JournalError(f"the lab's journal {self.path} {problem}",
                               "`vmlaunch down SPEC --force` stops and removes everything it "
                               "recognises; the rest is listed for you to remove by hand")
        self.unreadable.append(problem if data is None else f"{problem}: {json.dumps(data)[:200]}")

    def check_spec(self, spec: str | os.PathLike[str], *, force: bool) -> None:
        """Two spec files with one lab name would share this run dir: a lab that is up answers only
        to the spec that brought it up (compared as resolved paths), unless `force` takes it over."""
        other = self.other_spec(spec)
        if other is None or force:
            return
        mine = os.path.realpath(spec)
        raise LabTaken(f"lab {self.run_dir.lab} is up from another spec, {other}, not {mine}",
                       "use that spec, give this lab another name, or add --force to take it over")

    def other_spec(self, spec: str | os.PathLike[str]) -> str | None:
        """The spec file the lab is up from when it is not `spec` (compared as resolved paths): its
        run dir is that file's lab, whose VMs are not `spec`'s even where their names are."""
        if self.spec is None or self.empty or os.path.realpath(self.spec) == os.path.realpath(spec):
            return None
        if str(spec) == self.run_dir.lab and not os.path.lexists(spec):  # a kept throwaway VM, by name
            return None
        return self.spec

    @property
    def empty(self) -> bool:
        return not self.resources and not self.vms

    def document(self) -> dict[str, Any]:
        """The JSON document. Written with attrs alone: cattrs (~15 ms to import) is only needed to
        read one back, which a fresh `up` never does; tests/test_journal.py checks the round trip."""
        return {
            "version": JOURNAL_VERSION,
            "spec": self.spec,
            "resources": [{"kind": e.kind, "key": e.key, "vm": e.vm, "record": _plain(e.record)}
                          for e in self.resources],
            "vms": {name: _plain(vm) for name, vm in self.vms.items()},
        }

    def save(self) -> None:
        if not self.run_dir.path.is_dir():
            self.run_dir.create()
        write_atomic(self.path, json.dumps(self.document(), indent=1))

    def add(self, entry: Entry) -> None:
        self.resources.append(entry)
        self.save()

    def drop(self, entry: Entry) -> None:
        with contextlib.suppress(ValueError):
            self.resources.remove(entry)
        self.save()

    def has(self, kind: str, key: str) -> bool:
        return self.entry(kind, key) is not None

    def entry(self, kind: str, key: str) -> Entry | None:
        return next((e for e in self.resources if e.kind == kind and e.key == key), None)


# --- the lock ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(run_dir: RunDir, timeout: float) -> Iterator[None]:
    """Hold the lab's lock; wait up to `timeout` seconds for another `up`/`down` to finish.

    The lock file goes away with the lab: when the run dir is gone at the end, the holder removes it.
    A waiter that then gets the lock on the removed file notices (the path names another inode, or
    none) and locks anew, so two processes never both hold the lab.
    """
    from vmlaunch.layout.dirs import secure_dir

    root = run_dir.path.parent
    secure_dir(root, top=root, create=True)
    lock_path = run_dir.lock

    def take() -> int | None:
        try:
            fd = open_in_run_dir(lock_path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            if exc.errno != errno.EROFS:
                raise
            fd = open_in_run_dir(lock_path, os.O_RDONLY)  # a read-only run root: `down` still runs
        return lock_if_current(fd, lock_path)

    fd = take()
    if fd is None:
        log.info("waiting for another vmlaunch on lab %s", run_dir.lab)
        try:
            fd = wait_until(take, timeout)
        except TimedOut:
            raise LabBusy(f"lab {run_dir.lab} is busy: another vmlaunch up or down holds "
                          f"{lock_path}", "wait for it to finish, or raise --timeout") from None
    try:
        yield
    finally:
        if not run_dir.path.exists():
            with contextlib.suppress(FileNotFoundError):
                lock_path.unlink()
        os.close(fd)

