"""A clone `vmlaunch fork` made, as a resource of the lab: its place among the lab's members (an entry
in the run dir's `forks.json`) and its folder in the lab dir (its copies of the source's disks, its
seed, its SSH host key), with the known-hosts line that pins that key.

Applied first of the clone's resources, so undone last (`down` of the clone, or a fork rolled back):
once its QEMU is stopped and its taps are gone, the folder is removed, the pin dropped and the clone
is no longer a member. The book (`forks.json`) is also where a fork under way is written before it
changes anything (`runtime/fork.py`): which source, which clones, which vmlaunch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, ClassVar

import attrs

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import RunDir, open_in_run_dir
from vmlaunch.resources.base import Context, PerVm
from vmlaunch.spec.forks import NAME, Clone

BOOK_VERSION = 1
MAX_SIZE = 4 << 20


@attrs.frozen
class Forking:
    """A fork under way, written before it changes anything: the vmlaunch doing it, the source, the
    clones it makes, whether it paused the source (to resume if it was killed while it was)."""

    fork: int
    pid: int
    source: str
    clones: tuple[str, ...]
    paused: bool = False
    lab_dir: str | None = None  # where the clones' folders go (removed when the fork is undone)

    def to_json(self) -> dict[str, Any]:
        return {"fork": self.fork, "pid": self.pid, "source": self.source, "clones": list(self.clones),
                "paused": self.paused, "lab_dir": self.lab_dir}

    @classmethod
    def from_json(cls, doc: Any) -> Forking:
        if not isinstance(doc, dict):
            raise ValueError("a fork under way is a JSON object")
        fork, pid, source, clones = doc.get("fork"), doc.get("pid"), doc.get("source"), doc.get("clones")
        if not (type(fork) is int and type(pid) is int and isinstance(source, str)
                and isinstance(clones, list) and all(isinstance(name, str) for name in clones)):
            raise ValueError("a fork under way has a number, a pid, a source and its clones")
        lab_dir = doc.get("lab_dir")
        if not (lab_dir is None or (isinstance(lab_dir, str) and lab_dir.startswith("/"))):
            raise ValueError("a fork's lab dir is an absolute path")
        if not all(NAME.fullmatch(name) for name in (source, *clones)):
            raise ValueError("a fork's source and clones are VM names")
        return cls(fork, pid, source, tuple(clones), bool(doc.get("paused", False)), lab_dir)


@attrs.frozen
class Book:
    """What `forks.json` holds: the lab's clones, the last fork's number, a fork under way."""

    clones: tuple[Clone, ...] = ()
    last: int = 0
    forking: Forking | None = None

    def to_json(self) -> dict[str, Any]:
        return {"version": BOOK_VERSION, "last": self.last, "clones": [c.to_json() for c in self.clones],
                "forking": self.forking.to_json() if self.forking else None}

    def without(self, names: set[str]) -> Book:
        return attrs.evolve(self, clones=tuple(c for c in self.clones if c.name not in names))


class BookError(RuntimeFailure):
    """forks.json cannot be read as one vmlaunch wrote."""


def read_book(run_dir: RunDir) -> Book:
    """The lab's book of clones (empty when there is none); never read through a link."""
    try:
        fd = open_in_run_dir(run_dir.forks, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return Book()
    except OSError as exc:
        raise BookError(f"{run_dir.forks} cannot be read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("it is not a regular file")
            doc = json.loads(f.read(MAX_SIZE + 1))
            if not isinstance(doc, dict) or doc.get("version") != BOOK_VERSION:
                raise ValueError(f"not version {BOOK_VERSION} of the book of clones")
            last = doc.get("last", 0)
            if type(last) is not int:
                raise ValueError("last is not a number")
            clones = doc.get("clones", [])
            if not isinstance(clones, list):
                raise ValueError("clones is not a list")
            forking = doc.get("forking")
            return Book(tuple(Clone.from_json(c) for c in clones), last,
                        Forking.from_json(forking) if forking is not None else None)
        except (OSError, ValueError, RecursionError) as exc:
            raise BookError(f"{run_dir.forks} is damaged ({exc})",
                            "`vmlaunch down SPEC` takes the lab down; the clones in its journal go "
                            "with it") from None


def write_book(run_dir: RunDir, book: Book) -> None:
    if not book.clones and book.forking is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(run_dir.forks)
        return
    write_atomic(run_dir.forks, json.dumps(book.to_json(), indent=1) + "\n")


@attrs.frozen
class CloneRecord:
    """A clone's membership and folder: undone, the folder goes, its pin and its entry too."""

    kind: ClassVar[str] = "clone"

    vm: str
    run_dir: Path  # the lab's run dir, whose forks.json lists it
    lab_dir: Path  # SPEC_DIR/.vmlaunch/LAB
    lab: str

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        from vmlaunch.guests.sshkeys import unpin

        labdir = LabDir(self.lab_dir, self.lab)
        if labdir.secure():  # the user's own folder, writable by nobody else (else UnsafeDirectory)
            folder = labdir.vm(self.vm).path
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(folder).st_mode):  # a link planted there: removed, not followed
                    shutil.rmtree(folder)  # fd-based: no link inside is followed either
                else:
                    os.unlink(folder)
            unpin(labdir, self.vm)
        run_dir = RunDir(self.run_dir)
        if run_dir.path.is_dir():
            try:
                book = read_book(run_dir)
            except BookError:
                return  # the lab's down removes it with the run dir
            write_book(run_dir, book.without({self.vm}))

    def describe(self) -> str:
        return f"clone {self.vm} (its disks, seed and host key in {Path(self.lab_dir) / self.vm})"


@attrs.frozen
class CloneFiles(PerVm):
    """The clone's folder in the lab dir, made empty and private. One there already is refused: it may
    hold the disks of a VM left out of the spec since (`fork` names its clones around them)."""

    kind: ClassVar[str] = "clone"

    vm: str
    run_dir: RunDir
    lab_dir: LabDir

    def describe(self) -> str:
        return f"clone {self.vm}: a folder of its own in {self.lab_dir}"

    def found(self) -> str | None:
        return "exists" if self.lab_dir.vm(self.vm).path.exists() else None

    def apply(self, ctx: Context) -> CloneRecord:
        record = CloneRecord(self.vm, self.run_dir.path, self.lab_dir.path, self.lab_dir.lab)
        folder = self.lab_dir.vm(self.vm).path
        self.lab_dir.secure(create=True)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            raise RuntimeFailure(f"{folder} exists: it is no clone's, and may hold a VM's disks",
                                 "give the clones other names (--name), or remove it") from None
        return record
