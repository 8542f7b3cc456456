"""The lab's members: its spec's VMs and the clones `vmlaunch fork` made that are up (`runtime/fork.py`
makes them, `spec/forks.py` turns them into VMs of the lab). Every command that drives a running lab
asks here, so this module stays light: the book of clones is read only where there is one, and a
fork to settle brings the executor in only then."""

from __future__ import annotations

import logging
import os

from vmlaunch.layout.dirs import run_root
from vmlaunch.layout.rundir import RunDir
from vmlaunch.spec.model import LabSpec

log = logging.getLogger(__name__)


def members(lab: LabSpec) -> LabSpec:
    """The lab with the clones that are up as VMs of it (`spec/forks.with_clones`). A fork killed
    half-way is undone first, when nobody holds the lab's lock (one under way is left to the vmlaunch
    doing it)."""
    run_dir = RunDir.of(run_root(), lab.name)
    if not os.path.lexists(run_dir.forks):
        return lab
    from vmlaunch.resources.clone import BookError, read_book
    from vmlaunch.spec.forks import with_clones

    try:
        book = read_book(run_dir)
        if book.forking is not None:
            from vmlaunch.lab import process
            from vmlaunch.lab.journal import LabBusy, locked

            if not process.alive(book.forking.pid):
                from vmlaunch.runtime.executor import settle_fork

                try:
                    with locked(run_dir, 0):
                        settle_fork(run_dir)
                except LabBusy:
                    pass
                book = read_book(run_dir)
    except BookError as exc:
        log.warning("%s", exc)
        return lab
    return with_clones(lab, book.clones)
