"""The files a spec names, checked before anything runs: `validate`, `cmdline` and `up` (also with
`--dry-run`) report a kernel, initrd or disk that cannot work as a spec problem with its line (exit 2),
instead of QEMU's message at `up` after a kilobyte of command line.

Each file must exist (a disk with a `size` is created when missing), be a regular file (a disk may be a
block device with `block_device = true`), be readable (and writable for a disk that is not
`readonly`), and not be empty (a disk `up` creates or resizes may be). Who may change the file and the
folders on its path is `up`'s business (`diskfiles.py`): that rule needs the host as `up` finds it.

Kept apart from `spec.py` on purpose: the spec is checked as text everywhere (`status`, `down` and
`logs` work on a lab whose kernel has since been deleted); its files only where a VM is about to start.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

from vmlaunch.errors import KeyPath, Location, Problem, SpecError
from vmlaunch.model import LabSpec, VmSpec


def check_files(lab: LabSpec, vms: Sequence[str] = (), *, shown: Path | None = None) -> None:
    """Raise SpecError listing every file of the lab's VMs (those named, or all) that cannot work.

    `shown`: the spec path as the user gave it, for messages (default: the lab's absolute path)."""
    problems = [Problem(Location(shown or lab.file, lab.source.line_of(path), path), message, hint)
                for vm in lab.select(vms) for path, message, hint in _vm_problems(vm)]
    if problems:
        raise SpecError(problems)


Found = tuple[KeyPath, str, Optional[str]]  # where, what is wrong, a hint


def _vm_problems(vm: VmSpec) -> Iterator[Found]:
    base: KeyPath = ("vm", vm.name)
    for key, file in (("kernel", vm.kernel), ("initrd", vm.initrd)):
        if file is not None:
            problem = _problem(file, disk=False)
            if problem is not None:
                yield (*base, key), *problem
    for index, disk in enumerate(vm.disks):
        problem = _problem(disk.file, disk=True, writable=not disk.readonly, device_ok=disk.block_device,
                           may_be_missing=disk.size is not None)
        if problem is not None:
            yield (*base, "disk", index, "file"), *problem


def _problem(path: Path, *, disk: bool, writable: bool = False, device_ok: bool = False,
             may_be_missing: bool = False) -> tuple[str, str | None] | None:
    """What is wrong with `path` (a message and a hint), or None."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if may_be_missing:
            return None
        hint = ("give the disk a size to have `up` create it" if disk
                else "relative paths are relative to the spec file")
        return f"{path} does not exist", hint
    except OSError as exc:  # EACCES on a folder of the path, ELOOP, ENAMETOOLONG, ENOTDIR
        return f"{path} cannot be looked at: {exc.strerror or exc}", None
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        return f"{path} is a folder, not a file", None
    if stat.S_ISBLK(mode):
        if not device_ok:
            return (f"{path} is a block device", "add block_device = true to the disk if that is meant"
                    if disk else None)
    elif not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        return f"{path} is {kind}, not a file", None
    elif info.st_size == 0 and not may_be_missing:
        return f"{path} is empty", None
    if not os.access(path, os.R_OK):
        return f"{path} is not readable by you", None
    if writable and not os.access(path, os.W_OK):
        return (f"{path} is not writable by you (the VM writes to this disk)",
                "add readonly = true to the disk if the VM only reads it")
    return None
