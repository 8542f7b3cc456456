"""Evidence of a lab, for when a test fails: everything that says what its VMs did, copied into a folder
that outlives `down`.

    DIR/README.txt          what was collected, when, and what could not be (and why)
    DIR/status.json         what `vmlaunch status --json` prints
    DIR/wire.json           the faults on the wire set at runtime (link states, netem, partition)
    DIR/manager.log         the lab manager's log
    DIR/events.jsonl        the lab's event log (lab/events.py): what QEMU reported of the VMs (an
                            I/O error, a pause, a panic, ...) and the faults set on them at runtime
    DIR/VM/serial.log       what the guest printed on its serial console
    DIR/VM/qemu.log         QEMU's command line, what it said while starting and then (its -D log)
    DIR/VM/screen.png       the VM's screen, when it runs and has one

Collecting never fails because one piece is missing: each missing piece is a line of README.txt. A VM
that is not up gives the logs of its last run (kept by `down`, `layout/lastrun.py`).

Each file is made new beneath a descriptor of DIR (`fsutil.write_new_at`), its subfolders made and
opened without following links: a symlink, FIFO or device standing at a name in DIR is never written
through nor replaced, only noted. When nothing at all could be saved (a read-only DIR), OutputRefused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import attrs

from vmlaunch.core.fsutil import Unfit, open_folder_at, write_new_at
from vmlaunch.errors import OutputRefused, VmlaunchError
from vmlaunch.lab import process, wire
from vmlaunch.layout import lastrun
from vmlaunch.layout.rundir import RunDir, VmFiles
from vmlaunch.rig import screen
from vmlaunch.runtime.control import VmStatus, is_up, lab_is_up, manager_record, status
from vmlaunch.spec.model import LabSpec

log = logging.getLogger(__name__)

INDEX = "README.txt"


@attrs.frozen
class Evidence:
    """What `collect` wrote into `folder` (paths relative to it) and what it could not, with why;
    `unsaved`: those of `missing` that were there to save but could not be written."""

    folder: Path
    files: tuple[str, ...]
    missing: tuple[str, ...]
    unsaved: tuple[str, ...] = ()


class _Collector:
    def __init__(self, folder: Path, folder_fd: int) -> None:
        self.folder = folder
        self.folder_fd = folder_fd
        self.files: list[str] = []
        self.missing: list[str] = []
        self.unsaved: list[str] = []

    def write(self, name: str, data: bytes | str | None, why_none: str = "") -> None:
        """Write `name` (relative), or note it missing with `why_none` when `data` is None."""
        if data is None:
            self.missing.append(f"{name}: {why_none}")
            return
        *subs, leaf = name.split("/")
        opened: list[int] = []
        try:
            for sub in subs:
                opened.append(open_folder_at(opened[-1] if opened else self.folder_fd, sub, make=True))
            write_new_at(opened[-1] if opened else self.folder_fd, leaf, data)
        except OSError as exc:
            line = f"{name}: cannot write it: {exc.strerror or exc}"
            self.missing.append(line)
            self.unsaved.append(line)
            return
        finally:
            for fd in opened:
                os.close(fd)
        self.files.append(name)

    def attempt(self, name: str, produce: Callable[[], bytes | str | None], why_none: str) -> None:
        """`write(name, produce())`; a vmlaunch error or OSError while producing it is noted, not raised."""
        try:
            data = produce()
        except (VmlaunchError, OSError) as exc:
            self.missing.append(f"{name}: {exc}")
            return
        except Exception as exc:  # evidence of a failure must not fail on a bug of its own
            log.debug("collecting %s failed", name, exc_info=True)
            self.missing.append(f"{name}: {type(exc).__name__}: {exc}")
            return
        self.write(name, data, why_none)


def collect(run_dir: RunDir, lab: LabSpec, names: Sequence[str], folder: Path, *,
            screenshots: bool = True) -> Evidence:
    """Copy the evidence of the VMs `names` of `lab` into `folder` (made when missing; files of the
    same names are replaced, never written through); `screenshots`: a screenshot of each running VM
    with a screen. OutputRefused when `folder` cannot be made, or nothing could be saved in it."""
    folder = Path(os.path.abspath(folder))
    folder_fd = _open_folder(folder)
    try:
        out = _Collector(folder, folder_fd)
        _collect(out, run_dir, lab, names, screenshots)
    finally:
        os.close(folder_fd)
    if not out.files:  # README.txt is always there to save: every write failed
        more = f" (and {len(out.unsaved) - 1} more)" if len(out.unsaved) > 1 else ""
        raise OutputRefused(f"nothing could be saved in {folder}: {out.unsaved[0]}{more}")
    return Evidence(folder, tuple(out.files), tuple(out.missing), tuple(out.unsaved))


def _open_folder(folder: Path) -> int:
    """A descriptor of `folder`, made when missing (the user named it: a symlink to a folder is
    followed); OutputRefused when it cannot be made or is no folder."""
    try:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(parents=True)
        return open_folder_at(None, folder, follow=True)
    except Unfit as exc:
        raise OutputRefused.of(exc) from None
    except OSError as exc:
        raise OutputRefused(f"nothing was saved: cannot make the folder {exc.filename or folder}: "
                            f"{exc.strerror or exc}") from None


def _collect(out: _Collector, run_dir: RunDir, lab: LabSpec, names: Sequence[str],
             screenshots: bool) -> None:
    rows: list[VmStatus] = []

    def status_json() -> str:
        rows[:] = status(run_dir, list(names), lab)
        return json.dumps({row.name: row.to_json() for row in rows}, indent=2) + "\n"

    out.attempt("status.json", status_json, "")
    out.attempt("wire.json", lambda: json.dumps(wire.load(run_dir), indent=2) + "\n", "")
    out.attempt("manager.log", lambda: _manager_log(run_dir),
                "the lab manager is not up, and no earlier run's log was kept")
    out.attempt("events.jsonl", lambda: _events(run_dir), "no event was logged (`vmlaunch logs SPEC "
                "--events`), or the lab is not up and no earlier run's log was kept")
    rows_of = {row.name: row for row in rows}
    for name in names:
        _vm(out, run_dir, name, rows_of.get(name), screenshots)
    _index(out, lab, names)


def _manager_log(run_dir: RunDir) -> str | None:
    if manager_record(run_dir) is not None:
        return process.read_text(run_dir.manager_log)
    return lastrun.read_manager(run_dir.lab)


def _events(run_dir: RunDir) -> str | None:
    if lab_is_up(run_dir):
        return process.read_text(run_dir.events) or None
    return lastrun.read_events(run_dir.lab)


def _vm(out: _Collector, run_dir: RunDir, name: str, row: VmStatus | None, screenshots: bool) -> None:
    files = run_dir.vm(name)
    never = "the VM is not up, and no earlier run of it was kept"
    if is_up(run_dir, name):
        out.attempt(f"{name}/serial.log", partial(_console, files.serial_log), "QEMU has not written it")
        out.attempt(f"{name}/qemu.log", partial(_qemu_log, files, row), "")
    else:
        out.attempt(f"{name}/serial.log", lambda: lastrun.read(run_dir.lab, name, "serial"), never)
        kept = lastrun.read(run_dir.lab, name, "qemu")  # what QEMU said while starting, then its -D log
        out.write(f"{name}/qemu.log", None if kept is None else
                  f"# QEMU of VM {name}, its last run (the VM is not up)\n{kept}", never)
    shot = f"{name}/screen.png"
    if not screenshots:
        out.write(shot, None, "no screenshots asked for")
    elif row is None or row.pid is None or row.state == "unresponsive":
        # a paused or panicked guest's screen is worth having: only a QEMU that is gone or mute has none
        out.write(shot, None, f"the VM is {row.state if row else 'not up'}: no screen to capture")
    else:
        def capture() -> bytes:
            # taken aside, in a folder of our own, then written beneath DIR as every other file is
            with tempfile.TemporaryDirectory(prefix="vmlaunch-screen-") as aside:
                # a VM without a screen: noted
                return screen.screenshot(run_dir, name, Path(aside) / "screen.png").read_bytes()

        out.attempt(shot, capture, "")


def _qemu_log(files: VmFiles, row: VmStatus | None) -> str:
    """What QEMU said while starting (its stderr), then for the rest of its life (its -D log), under
    its command line: the argv is what a reader of a failure asks for first."""
    head = [f"# QEMU of VM {files.name}"]
    if row is not None and row.pid is not None:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{row.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            head.append(f"# pid {row.pid}: {shlex.join(arg.decode(errors='replace') for arg in argv)}")
    started, then = process.read_text(files.stderr_log), process.read_text(files.qemu_log)
    return "\n".join([*head, f"# while starting ({files.stderr_log.name}):", started.rstrip("\n"),
                      f"# then ({files.qemu_log.name}):", then.rstrip("\n")]) + "\n"


def _console(path: Path) -> bytes | None:
    """The console's log; when it is empty, a line saying so (a VM started from a snapshot, or a guest
    that prints nothing on its serial console, leaves it so)."""
    data = _read_bytes(path)
    if data == b"":
        return (b"# vmlaunch: the serial console printed nothing since this QEMU started (a VM started "
                b"from a snapshot prints only what it prints after it)\n")
    return data


def _read_bytes(path: Path) -> bytes | None:
    text = process.read_text(path)  # never through a symlink; "" when missing
    return text.encode() if text or path.exists() else None


def _index(out: _Collector, lab: LabSpec, names: Sequence[str]) -> None:
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    lines = [f"Evidence of lab {lab.name} ({lab.file}), VMs {', '.join(names) or 'none'}, collected {when}.",
             "", "Collected:"]
    lines += [f"  {name}" for name in out.files] or ["  nothing"]
    if out.missing:
        lines += ["", "Not collected:"] + [f"  {line}" for line in out.missing]
    lines += ["", "status.json is `vmlaunch status --json`; wire.json the faults set on the wire at runtime;",
              "events.jsonl the lab's event log (`vmlaunch logs SPEC --events` shows it line by line);",
              "VM/serial.log the VM's console, VM/qemu.log QEMU's command line and messages,",
              "VM/screen.png its screen."]
    out.write(INDEX, "\n".join(lines) + "\n")
