"""`vmlaunch netem SPEC [VM NIC] [figures] [--where] [--clear] [--json]`: impairments of a NIC's traffic
(the kernel's netem) while the lab runs, and the list of what is set.

Kept light like the rest of `cli/`: argparse only at import; `rig/netem.py` when a command runs.
"""

from __future__ import annotations

import argparse

from vmlaunch.cli.common import Commands, add_json, add_spec, add_timeout, command
from vmlaunch.errors import UsageError

FIGURE_OPTIONS = (
    ("delay", "MS", "added to each packet the NIC sends: milliseconds (100), or with a unit (20ms, "
     "500us, 1s)"),
    ("jitter", "MS", "random variation of the delay (needs --delay)"),
    ("loss", "PCT", "percent of the packets the NIC sends that are dropped (0-100)"),
    ("rate", "RATE", "the most the NIC carries, in each direction, with a unit as tc writes it: 10mbit, "
     "1gbit, 125kbps (bit kbit mbit gbit tbit; bps kbps mbps gbps: bytes/s)"),
    ("corrupt", "PCT", "percent of the packets the NIC sends that get a flipped bit"),
    ("duplicate", "PCT", "percent of the packets the NIC sends that are sent twice"),
    ("reorder", "PCT", "percent of the packets the NIC sends that go at once while the rest wait for the "
     "delay (needs --delay)"),
)


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    netem = command(
        commands, "netem", cmd_netem, help="delay, lose, corrupt or rate-limit a NIC's traffic (netem)",
        raw=True, description="""\
Set the kernel's netem on one NIC of a running VM, clear it, or (SPEC alone) list
what is set on the lab and where.

Directions: --delay, --jitter, --loss, --corrupt, --duplicate and --reorder apply
to the traffic the VM's NIC sends, so once per round trip (--delay 100 adds
100 ms to a ping's round trip; --loss 30 loses about 30 % of pings); --rate
applies to each direction. Setting a NIC's netem replaces what it had (figures
not given are cleared).

Where (--where):
  host   on the NIC's tap: any guest, no agent; bridge and tap networks only,
         and the host kernel needs netem (CONFIG_NET_SCH_NETEM), else exit 3
  guest  in the guest, with its own tc, through the command channel: works on
         user and socket networks; a guest without tc or netem is exit 3
  auto   host where the NIC has a tap and the host kernel has netem, else guest

NIC: its index (0), nicN, or the name of its network. What is set is undone at
`down` (and by `down --force` after a crash).""",
    )
    add_spec(netem)
    netem.add_argument("vm", metavar="VM", nargs="?", help="the VM (none: list what is set)")
    netem.add_argument("nic", metavar="NIC", nargs="?", help="the NIC: index, nicN or network name")
    for name, metavar, text in FIGURE_OPTIONS:
        netem.add_argument(f"--{name}", metavar=metavar, help=text)
    netem.add_argument("--where", choices=("auto", "host", "guest"), default="auto",
                       help="where netem runs (default auto)")
    netem.add_argument("--clear", action="store_true", help="clear the NIC's netem")
    add_json(netem, "print JSON")
    add_timeout(netem, "seconds the guest's tc commands get (the guest path); default 30", default=30.0)


def cmd_netem(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.cli.common import lab_vm
    from vmlaunch.lab import wire
    from vmlaunch.rig import netem
    from vmlaunch.spec.netem import figures, parse_netem

    given = {name: getattr(args, name) for name, _, _ in FIGURE_OPTIONS if getattr(args, name) is not None}
    if args.vm is None:
        if given or args.clear:
            raise UsageError("name the VM and NIC whose netem to set or clear",
                             "vmlaunch netem SPEC VM NIC ...")
        run_dir, lab = lab_vm(args.spec)
        rows = netem.listing(run_dir, lab)
        if args.json:
            print(json.dumps(rows, indent=2))
        elif not rows:
            print(f"lab {lab.name}: no netem set")
        for row in rows if not args.json else []:
            shown = " ".join(f"{key} {row[key]}" for key in ("delay", "jitter", "loss", "corrupt",
                                                             "duplicate", "reorder", "rate") if key in row)
            print(f"{row['vm']} nic {row['nic']} ({row['network']}): {shown} [{row['where']}]")
        return 0
    if args.nic is None:
        raise UsageError(f"name the NIC of {args.vm} (its index, nicN or network name)")
    run_dir, lab = lab_vm(args.spec, args.vm)
    index = wire.resolve_nic(lab, args.vm, args.nic)
    if args.clear:
        if given:
            raise UsageError("--clear takes no figures", "clear alone, or set new figures (they replace)")
        done = netem.clear_netem(run_dir, lab, args.vm, index, timeout=args.timeout)
        if args.json:
            print(json.dumps({"vm": args.vm, "nic": index, "cleared": done}))
        else:
            print(f"{args.vm} nic {index}: {'netem cleared' if done else 'no netem was set'}")
        return 0
    if not given:
        raise UsageError("give one or more of --delay, --jitter, --loss, --rate, --corrupt, --duplicate, "
                         "--reorder, or --clear")
    parsed, problems = parse_netem({**given, "where": args.where}, bare_ms=True)
    if parsed is None:
        key, message, hint = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(f"--{key}: {message}{more}" if key else message, hint)
    data = netem.set_netem(run_dir, lab, args.vm, index, parsed, timeout=args.timeout)
    if args.json:
        print(json.dumps({"vm": args.vm, "nic": index, **data}))
    else:
        shown = " ".join(f"{key} {value}" for key, value in figures(parsed).items())
        print(f"{args.vm} nic {index}: {shown} [{data['where']}]")
    return 0
