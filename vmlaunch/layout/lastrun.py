"""The logs of each VM's last run, kept when `down` (or a failed `up`) removes the run dir, so that
`vmlaunch logs` still shows why a VM did what it did:

    log_root/LAB/V.serial.log   what the guest printed on its serial console
    log_root/LAB/V.qemu.log     what QEMU said (while starting, then its -D log)
    log_root/LAB/manager.log    what the lab manager did (kept when it stops)
    log_root/LAB/events.jsonl   the lab's event log (`lab/events.py`; kept when the manager stops)

`dirs.log_root()` is /var/log/vmlaunch as root, else ~/.local/state/vmlaunch/logs (VMLAUNCH_LOG_DIR
overrides). Each run replaces the VM's previous logs; the last MAX_BYTES of each are kept. Keeping them
is never worth failing a `down` for: a problem is a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from vmlaunch.core.fsutil import temp_of
from vmlaunch.errors import RuntimeFailure
from vmlaunch.layout.rundir import EVENTS, NOFOLLOW, RunDir, VmFiles, open_in_run_dir

log = logging.getLogger(__name__)

MAX_BYTES = 8 << 20  # the end of a log; a guest that printed more than 8 MiB has shown its problem by then
KINDS = ("serial", "qemu")


def folder(lab: str) -> Path:
    from vmlaunch.layout.dirs import log_root

    return log_root() / lab


def path_of(lab: str, vm: str, kind: str) -> Path:
    assert kind in KINDS
    return folder(lab) / f"{vm}.{kind}.log"


def keep(run_dir: RunDir, vms: Iterable[str]) -> None:
    """Copy each VM's logs out of the run dir (a VM that left none keeps its previous ones)."""
    from vmlaunch.layout.dirs import UnsafeDirectory, log_root, secure_dir

    sources = {vm: _sources(run_dir.vm(vm)) for vm in vms}
    found = {vm: {kind: data or b"" for kind, data in logs.items()}
             for vm, logs in sources.items() if any(data is not None for data in logs.values())}
    if not found:
        return
    try:
        secure_dir(folder(run_dir.lab), top=log_root(), create=True, setting="VMLAUNCH_LOG_DIR")
    except (UnsafeDirectory, OSError) as exc:
        log.warning("the logs of lab %s are not kept: %s", run_dir.lab, exc)
        return
    for vm, kept in found.items():
        for kind, data in kept.items():
            try:
                _replace(path_of(run_dir.lab, vm, kind), data[-MAX_BYTES:])
            except OSError as exc:
                log.warning("%s: its %s log is not kept: %s", vm, kind, exc.strerror or exc)


MANAGER_LOG = "manager.log"  # no VM's log is called that: theirs are V.serial.log and V.qemu.log


def keep_manager(run_dir: RunDir) -> None:
    """Copy the lab manager's log out of the run dir, replacing the previous run's."""
    from vmlaunch.layout.dirs import UnsafeDirectory, log_root, secure_dir

    data = _tail(run_dir.manager_log)
    if data is None:
        return
    try:
        secure_dir(folder(run_dir.lab), top=log_root(), create=True, setting="VMLAUNCH_LOG_DIR")
        _replace(folder(run_dir.lab) / MANAGER_LOG, data[-MAX_BYTES:])
    except (UnsafeDirectory, OSError) as exc:
        log.warning("the lab manager's log of lab %s is not kept: %s", run_dir.lab, exc)


def read_manager(lab: str) -> str | None:
    return _read(folder(lab) / MANAGER_LOG)


def keep_events(run_dir: RunDir) -> None:
    """Copy the lab's event log out of the run dir, replacing the previous run's. A run that logged
    nothing leaves none, and its previous run's goes too: what is kept is always the last run's."""
    from vmlaunch.layout.dirs import UnsafeDirectory, log_root, secure_dir

    data = _tail(run_dir.events)
    try:
        if secure_dir(folder(run_dir.lab), top=log_root(), create=data is not None,
                      setting="VMLAUNCH_LOG_DIR"):
            if data is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(events_path(run_dir.lab))
            else:
                _replace(events_path(run_dir.lab), data)
    except (UnsafeDirectory, OSError) as exc:
        log.warning("the event log of lab %s is not kept: %s", run_dir.lab, exc)


def events_path(lab: str) -> Path:
    return folder(lab) / EVENTS  # the run dir's name: no VM's log is called that either


def read_events(lab: str) -> str | None:
    """The event log of the lab's last run, None when none was kept."""
    return _read(events_path(lab))


def read(lab: str, vm: str, kind: str) -> str | None:
    """The kept log, or None when there is none."""
    return _read(path_of(lab, vm, kind))


def _read(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_BYTES + 1).decode(errors="replace")


def _sources(files: VmFiles) -> dict[str, bytes | None]:
    """Each log of the run (None: the VM left none; b"": it printed nothing, which is kept too)."""
    stderr, qemu = _tail(files.stderr_log), _tail(files.qemu_log)
    return {"serial": _tail(files.serial_log),
            "qemu": None if stderr is None and qemu is None else (stderr or b"") + (qemu or b"")}


def _tail(path: Path) -> bytes | None:
    try:
        fd = open_in_run_dir(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, RuntimeFailure):  # missing, or a planted link: nothing to keep
        return None
    with os.fdopen(fd, "rb") as f:
        with contextlib.suppress(OSError):  # shorter than MAX_BYTES
            f.seek(-MAX_BYTES, os.SEEK_END)
        return f.read(MAX_BYTES)


def _replace(path: Path, data: bytes) -> None:
    """Write `path` anew, atomically, never through a link planted where it or its temp file goes."""
    temp = temp_of(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temp, path)  # replaces a link itself, never what it names
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
