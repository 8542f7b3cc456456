"""`vmlaunch snapshot SPEC save|restore|list|delete`: snapshots of a whole lab from the command line.

Kept light like the rest of `cli/`: argparse only at import; `saved/snapshot.py` is imported when a
command runs.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vmlaunch.cli.common import Commands, add_json, add_spec, add_timeout, command
from vmlaunch.errors import UsageError

if TYPE_CHECKING:
    from vmlaunch.layout.rundir import RunDir
    from vmlaunch.spec.model import LabSpec

log = logging.getLogger("vmlaunch")


ACTIONS = ("save", "restore", "list", "delete")
NAMED = ("save", "restore", "delete")  # the actions that take a NAME


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    """The `snapshot` command.

    Its sub-command comes after SPEC (`snapshot SPEC save NAME`), so it is a positional argument with
    choices rather than an argparse sub-parser: the completion scripts (`cli/completion.py`) complete a
    command's sub-parsers as its first word, where SPEC goes here, and complete choices in place."""
    snapshot = command(
        commands, "snapshot", cmd_snapshot, help="save, restore, list and delete snapshots of a whole lab",
        raw=True, description="""\
A snapshot holds every VM of the lab at one instant, disks and RAM: the VMs are
paused together, each QEMU saves into its qcow2 disks (the first also holds the
RAM), and they are resumed together.

  save NAME     snapshot every VM of the running lab (each must run); a NAME
                that exists is refused unless --force; on a failure every VM is
                resumed and what was saved of NAME is deleted
  restore NAME  bring every VM of the running lab back to NAME (each must hold
                it whole), then set the clocks of the VMs with SSH
  list          each snapshot of each VM; also while the lab is down
  delete NAME   delete NAME from every VM that has it, up or down (by name
                only: a NAME that is a number is never taken for an ID)

Refused before anything changes: a writable raw disk, a 9p share, a passed-
through PCI device (exit 2, as a problem of the spec; examples/snapshots.toml
is a lab that snapshots); a clone forked after the snapshot, on restore (exit
4). `vmlaunch up SPEC --from-snapshot NAME` starts a lab that is down from a
snapshot, RAM included.""",
    )
    add_spec(snapshot)
    snapshot.add_argument("action", metavar="SUBCOMMAND", choices=ACTIONS,
                          help="save, restore, list or delete")
    snapshot.add_argument("name", metavar="NAME", nargs="?",
                          help="the snapshot (save, restore, delete): a letter or digit, then letters, "
                          "digits, '.', '_' or '-'; not a number (but delete takes one: it deletes by "
                          "name)")
    snapshot.add_argument("--force", action="store_true",
                          help="save: replace a snapshot of that name (deleted first: if the save then "
                          "fails, neither is left)")
    add_json(snapshot, "list: print JSON keyed by snapshot, then VM")
    add_timeout(snapshot, "save, restore, delete: seconds for the whole operation (and to wait for "
                "another up or down of the lab); default 60", default=60.0)


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Check what goes with which sub-command (argparse cannot say it of one parser), then run it."""
    if args.action in NAMED and args.name is None:
        raise UsageError(f"snapshot {args.action} needs a NAME", f"e.g. `vmlaunch snapshot SPEC "
                         f"{args.action} before-upgrade`")
    if args.action not in NAMED and args.name is not None:
        raise UsageError(f"snapshot {args.action} takes no NAME (given {args.name!r})")
    if args.force and args.action != "save":
        raise UsageError("--force goes with save only")
    if args.json and args.action != "list":
        raise UsageError("--json goes with list only")
    run: Callable[[argparse.Namespace], int] = {"save": cmd_save, "restore": cmd_restore,
                                                 "list": cmd_list, "delete": cmd_delete}[args.action]
    return run(args)


def _lab(spec: str) -> tuple[RunDir, LabSpec]:
    from vmlaunch.layout.dirs import run_root
    from vmlaunch.layout.rundir import RunDir
    from vmlaunch.runtime.members import members
    from vmlaunch.spec.load import load_lab

    lab = members(load_lab(spec))  # a clone is a VM of the lab: its disks are snapshotted with the others
    return RunDir.of(run_root(), lab.name), lab


def _qemu_img() -> str:
    from vmlaunch.host.facts import detect_host

    return detect_host().qemu.img or "qemu-img"


def cmd_save(args: argparse.Namespace) -> int:
    from vmlaunch.saved import snapshot

    run_dir, lab = _lab(args.spec)
    snapshot.save(run_dir, lab, args.name, timeout=args.timeout, force=args.force)
    print(f"{args.name}: saved ({', '.join(vm.name for vm in lab.vms)})")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from vmlaunch.saved import snapshot

    run_dir, lab = _lab(args.spec)
    snapshot.restore(run_dir, lab, args.name, timeout=args.timeout)
    print(f"{args.name}: restored ({', '.join(vm.name for vm in lab.vms)})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    import json
    import time

    from vmlaunch.saved import snapshot

    run_dir, lab = _lab(args.spec)
    found = snapshot.list_snapshots(run_dir, lab, qemu_img=_qemu_img())
    if args.json:
        doc: dict[str, dict[str, Any]] = {}
        for snap in found:
            doc.setdefault(snap.name, {})[snap.vm] = snap.to_json()
        print(json.dumps(doc, indent=2))
        return 0
    if not found:
        log.info("lab %s has no snapshot", lab.name)
        return 0
    print(f"{'SNAPSHOT':<20} {'VM':<16} {'TAKEN':<19} {'VM STATE':>9} {'VM CLOCK':>9}")
    for snap in found:
        taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap.taken))
        lacking = f"  incomplete: not on {', '.join(snap.missing)}" if snap.missing else ""
        print(f"{snap.name:<20} {snap.vm:<16} {taken:<19} {snap.vm_state_size / 2**20:>8.1f}M "
              f"{snap.vm_clock:>8.0f}s{lacking}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from vmlaunch.saved import snapshot

    run_dir, lab = _lab(args.spec)
    deleted = snapshot.delete(run_dir, lab, args.name, timeout=args.timeout, qemu_img=_qemu_img())
    print(f"{args.name}: deleted ({', '.join(deleted)})")
    return 0
