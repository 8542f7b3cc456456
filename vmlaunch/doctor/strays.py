"""Processes of vmlaunch's (a QEMU it started, a lab manager) whose lab no command knows any more: its
run dir is gone, or its lab's journal does not name it. `down` cannot reach them, `status` and `ls`
do not show them; they hold memory, sockets and files until someone ends them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vmlaunch.doctor.findings import Finding, Status
from vmlaunch.host.processes import Kind, OwnProcess, lab_locked, own_processes

WHY = ("no vmlaunch command knows this process any more (`down` cannot stop it, `status` and `ls` do not "
       "show it), yet it holds memory, sockets and open files: vmlaunch's promise is that nothing of a "
       "lab outlives it")


def why_stray(process: OwnProcess) -> str | None:
    """Why no command knows `process`'s lab; None when one does, or might (an `up` or `down` of the
    lab runs, its journal cannot be read)."""
    from vmlaunch.errors import VmlaunchError
    from vmlaunch.lab.journal import Journal
    from vmlaunch.layout.rundir import RunDir

    run_dir = RunDir(process.run_dir)
    if not process.run_dir.is_dir():
        return f"its run dir {process.run_dir} is gone"
    if lab_locked(run_dir.lock):
        return None
    try:
        journal = Journal.load(run_dir)
    except (VmlaunchError, OSError):
        return None
    if process.kind is Kind.MANAGER:
        mine = journal.entry("manager", "lab")
        if mine is None or getattr(mine.record, "pid", None) != process.pid:
            return f"the journal of lab {process.lab} ({run_dir.state}) does not name it"
        return None
    if process.vm not in journal.vms:
        return f"the journal of lab {process.lab} ({run_dir.state}) has no VM {process.vm}"
    return None


def check_strays(proc: Path) -> Iterator[Finding]:
    """One finding for each process of vmlaunch's whose lab is gone, with the command that ends it."""
    found = 0
    for process in own_processes(proc):
        why = why_stray(process)
        if why is None:
            continue
        found += 1
        yield Finding("host.stray_process", Status.WARN,
                      f"a {process.describe()} runs without its lab: {why}", WHY, f"kill {process.pid}")
    if not found:
        yield Finding("host.stray_process", Status.OK, "no process of vmlaunch's runs without its lab")
