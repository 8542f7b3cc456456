"""The commands that put faults on a running lab's wire: `link` (a NIC's carrier) and `partition`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vmlaunch.cli.common import Commands, add_json, add_spec, add_vm, command, lab_vm

if TYPE_CHECKING:
    from vmlaunch.spec.model import VmSpec

log = logging.getLogger("vmlaunch")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    link = command(commands, "link", cmd_link, help="set a NIC's link up or down",
                   description="Take a running VM's NIC off the wire or put it back (QMP set_link): "
                   "while it is down the guest sees no carrier and nothing passes either way. A new "
                   "QEMU starts with every link up; `status` shows a link that is down.", spec=True)
    add_vm(link, help="the VM whose NIC it is")
    link.add_argument("nic", metavar="NIC",
                      help="the NIC: its index (0), nicN, or the name of the network it is on")
    link.add_argument("state", metavar="up|down", choices=("up", "down"), help="the link's new state")

    part = command(commands, "partition", cmd_partition, help="cut VMs off from the rest of the lab, "
                   "or heal it",
                   description="Cut the VMs named off from the rest of the lab on every network they "
                   "share with other VMs: bridge networks on the host (the lab's nftables table "
                   "vmlaunch-LAB, removed at `down`), socket networks in the guests (their tc, through "
                   "the command channel); user networks join no VMs. Each call cuts one more group off "
                   "from every other and from the rest; naming a VM again moves it. --heal puts the VMs "
                   "named back (all of them when none are named). Without VMs or --heal, print the "
                   "partition.")
    add_spec(part)
    part.add_argument("vms", metavar="VM", nargs="*", default=[], help="the VMs of one side")
    part.add_argument("--heal", metavar="VM", nargs="*", default=None,
                      help="put the VMs named (before or after it) back with the rest; none named: "
                      "heal everything")
    add_json(part, "print the partition as JSON: its groups and where each network is cut")


def cmd_link(args: argparse.Namespace) -> int:
    from vmlaunch.rig.link import set_link

    run_dir, lab = lab_vm(args.spec, args.vm)
    index = set_link(run_dir, lab, args.vm, args.nic, args.state == "up")
    print(f"{args.vm}: nic{index} ({lab.vm(args.vm).nics[index].network}) link {args.state}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.lab import wire
    from vmlaunch.rig import partition

    run_dir, lab = lab_vm(args.spec)
    if args.heal is not None:
        partition.heal(run_dir, lab, [*args.vms, *args.heal])
    elif args.vms:
        partition.partition(run_dir, lab, args.vms)
    elif not run_dir.path.is_dir():
        from vmlaunch.errors import RuntimeFailure

        raise RuntimeFailure(f"lab {lab.name} is not up", "`vmlaunch up` it first")
    record = wire.load(run_dir)["partition"]
    groups = [list(group) for group in record.get("groups") or []]
    unfinished = record.get("unfinished")
    if args.json:
        shown = {"groups": groups, "where": record.get("where") or {}}
        print(json.dumps({**shown, "unfinished": unfinished} if unfinished else shown, indent=2))
        return 0
    said = describe(lab.vms, groups, record.get("where") or {})
    print(said if groups or not unfinished else "no partition")  # but the line below
    if unfinished:
        print(f"unfinished: {unfinished}; cuts may be left on "
              + ", ".join(f"{net} ({kind})" for net, kind in sorted((record.get("where") or {}).items()))
              + f": `vmlaunch partition {args.spec} --heal` removes them")
    return 0


def describe(vms: Sequence[VmSpec], groups: list[list[str]], where: dict[str, str]) -> str:
    """`a, b | c | the rest: d, e (cut on lan: host, mc: guest)`, or `no partition`."""
    if not groups:
        return "no partition: every VM reaches every other on the networks it shares with them"
    named = {vm for group in groups for vm in group}
    rest = [vm.name for vm in vms if vm.name not in named]
    sides = [", ".join(group) for group in groups] + ([f"the rest: {', '.join(rest)}"] if rest else [])
    cut = ", ".join(f"{net}: {kind}" for net, kind in sorted(where.items())) or "no network is shared"
    return f"partition: {' | '.join(sides)} (cut on {cut})"
