"""`vmlaunch fork`: running copies of a running VM, new members of its lab (`runtime/fork.py`)."""

from __future__ import annotations

import argparse
import logging

from vmlaunch.cli.common import Commands, add_json, add_spec, add_timeout, add_vm, command

log = logging.getLogger("vmlaunch")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    fork = command(
        commands, "fork", cmd_fork, help="make running copies of a running VM, new members of its lab",
        description="Save the VM's state once (it pauses for as long as that and the copies of its "
        "disks take) and start COUNT clones from it: each runs on from that instant, on copies of its "
        "disks, with its own MACs, taps and SSH port, and is given an identity of its own through the "
        "command channel: MACs seen by the guest, the next free static address on networks with one, "
        "hostname, machine-id, SSH host keys (pinned), clock, forwarded ports. The clones are VMs of "
        "the lab (status, ssh, exec, balloon, snapshot) until `down` removes them with their files. "
        "A fork killed half-way is undone by the next command.")
    add_spec(fork)
    add_vm(fork, help="the running VM to fork")
    fork.add_argument("--count", metavar="N", type=int, default=1, help="how many clones (default 1)")
    fork.add_argument("--name", metavar="PATTERN",
                      help="the clones' names, {i} being the number from 1 (default VM-{i}, counting on "
                      "after the VM's clones there are)")
    fork.add_argument("--shared-memory", action="store_true",
                      help="the clones map one file of the saved memory copy-on-write instead of each "
                      "loading it: the pages no clone changed are held once on the host")
    fork.add_argument("--keep-going", action="store_true",
                      help="a clone that fails to load or to take its identity is removed and the others "
                      "kept (default: the whole fork is rolled back)")
    fork.add_argument("--same-identity", action="store_true",
                      help="fork a guest without a command channel: the clones keep the source's MACs, "
                      "addresses, hostname, machine-id and SSH host keys (they collide on a network)")
    add_timeout(fork, "seconds to wait for another vmlaunch of the lab; default 60", default=60.0)
    add_json(fork, "print JSON keyed by clone name")


def cmd_fork(args: argparse.Namespace) -> int:
    import json
    import time

    started = time.monotonic() - _age()
    from vmlaunch.compile.preflight import load_checked
    from vmlaunch.host.facts import detect_host
    from vmlaunch.runtime import fork

    lab = load_checked(args.spec)
    made = fork.fork(lab, detect_host(), args.vm, args.count, pattern=args.name,
                     shared_memory=args.shared_memory, keep_going=args.keep_going,
                     same_identity=args.same_identity, timeout=args.timeout, started=started)
    if args.json:
        print(json.dumps({each.name: each.to_json() for each in made}, indent=2))
        return 0
    for each in made:
        print(fork.describe(each))
    return 0


def _age() -> float:
    """Seconds since this process started (its start time in /proc/self/stat, in clock ticks since
    boot), so that a clone's `ready` counts Python's start-up too; 0 when it cannot be read."""
    import os

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
