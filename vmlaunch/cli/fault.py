"""`vmlaunch fault`: faults on a running VM's disks (I/O errors, held requests, slow disks), and the list
of what is set."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

from vmlaunch.cli.common import Commands, add_json, add_spec, command

if TYPE_CHECKING:
    from vmlaunch.spec.model import DiskFault

ACTIONS = ("error", "hang", "release", "slow", "clear")

DESCRIPTION = """\
Break a running VM's disk the way real disks break, while the VM runs; DISK is the disk's name as
`vmlaunch status SPEC --json` lists it: disk0 is the image's overlay (a VM with `image`), then each
[[disk]] (disk1, ...).

  fault SPEC VM DISK error (--read | --write | --flush) [--sector N] [--once] [--errno NAME]
      requests of that kind fail with an errno (EIO unless --errno: ENOSPC, EROFS, ...), at one sector
      (512 bytes, as the guest counts them; the guest reads and writes whole blocks, 4 KiB for Linux, so
      the block around it fails) or, without --sector, all of them; --once: only the first. What the
      VM does then is its disk's on_error (the guest gets the error, or the VM pauses: `vmlaunch resume`
      retries the request).
  fault SPEC VM DISK hang (--read | --write)
      requests of that kind are held: they never complete until `release`.
  fault SPEC VM DISK release
      let the held requests go.
  fault SPEC VM DISK slow [--bps RATE] [--iops N] [--latency MS]
      throttle the disk: RATE with a unit (1M is 1 MiB/s, 512K), N requests a second, or one request
      every MS milliseconds (at most 1000).
  fault SPEC VM DISK clear
      take every fault off the disk (holds released first).
  fault SPEC [--json]
      list what is set.

Faults live in the running QEMU only: nothing is written into an image; `down`, a snapshot and a
crash take them off. Each change goes into the lab's event log (`vmlaunch logs SPEC --events`)."""


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    fault = command(commands, "fault", cmd_fault, raw=True,
                    help="break a running VM's disk: I/O errors, held requests, a slow disk",
                    description=DESCRIPTION)
    add_spec(fault)
    fault.add_argument("vm", metavar="VM", nargs="?", help="the VM")
    fault.add_argument("disk", metavar="DISK", nargs="?", help="the disk: disk0, disk1, ...")
    fault.add_argument("action", metavar="ACTION", nargs="?", choices=ACTIONS,
                       help="error, hang, release, slow or clear")
    ops = fault.add_mutually_exclusive_group()
    for op in ("read", "write", "flush"):
        ops.add_argument(f"--{op}", dest="op", action="store_const", const=op,
                         help=f"{'flushes' if op == 'flush' else op + 's'} "
                         f"(error{', hang' if op != 'flush' else ''})")
    fault.add_argument("--sector", metavar="N", type=_whole, help="error: only at this sector (512 bytes)")
    fault.add_argument("--once", action="store_true", help="error: only the first request fails")
    fault.add_argument("--errno", metavar="NAME", help="error: the errno (default EIO)")
    fault.add_argument("--bps", metavar="RATE", help="slow: bytes a second, with a unit (1M, 512K)")
    fault.add_argument("--iops", metavar="N", type=_whole, help="slow: requests a second")
    fault.add_argument("--latency", metavar="MS", help="slow: one request every MS milliseconds")
    add_json(fault, "list what is set as JSON")


def _whole(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,18}", text, re.ASCII):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 10^18 (decimal digits)")
    return int(text)


def cmd_fault(args: argparse.Namespace) -> int:
    from vmlaunch.cli.common import lab_vm
    from vmlaunch.errors import UsageError
    from vmlaunch.rig import diskfault
    from vmlaunch.spec.diskfault import requests

    if args.vm is None:
        _no_options(args, "listing what is set", keep=("json",))
        run_dir, lab = lab_vm(args.spec)
        return _list(diskfault.listing(run_dir), args.json)
    if args.disk is None or args.action is None:
        raise UsageError("fault: name the VM, the disk and what to do: error, hang, release, slow or "
                         "clear", "`vmlaunch fault --help`")
    run_dir, lab = lab_vm(args.spec, args.vm)
    disk = diskfault.disk_name(lab, args.vm, args.disk)
    if args.action == "release":
        _no_options(args, "release")
        held = diskfault.release(run_dir, lab, args.vm, disk)
        print(f"{args.vm} {disk}: released its held {requests(held)}")
        return 0
    if args.action == "clear":
        _no_options(args, "clear")
        cleared = diskfault.clear(run_dir, lab, args.vm, disk)
        print(f"{args.vm} {disk}: " + (f"cleared ({_listed(cleared)})" if cleared else "nothing was set"))
        return 0
    fault = _fault(args)
    now = diskfault.set_fault(run_dir, lab, args.vm, disk, fault)
    print(f"{args.vm} {disk}: {now}")
    return 0


def _fault(args: argparse.Namespace) -> DiskFault:
    from vmlaunch.errors import UsageError
    from vmlaunch.spec.diskfault import parse_fault

    raw: dict[str, Any] = {"type": args.action}
    if args.action == "slow":
        _no_options(args, "slow", keep=("bps", "iops", "latency"))
        for key in ("bps", "iops", "latency"):
            if getattr(args, key) is not None:
                raw[key] = getattr(args, key)
        if isinstance(raw.get("latency"), str) and raw["latency"].strip().isdigit():
            raw["latency"] = int(raw["latency"])
    else:
        keep = ("op", "sector", "once", "errno") if args.action == "error" else ("op",)
        _no_options(args, args.action, keep=keep)
        if args.op is None:
            choices = "--read, --write or --flush" if args.action == "error" else "--read or --write"
            raise UsageError(f"fault ... {args.action}: which requests? {choices}")
        raw["op"] = args.op
        if args.sector is not None:
            raw["sector"] = args.sector
        if args.once:
            raw["once"] = True
        if args.errno is not None:
            raw["errno"] = args.errno
    fault, problems = parse_fault(raw)
    if fault is None:
        key, message, hint = problems[0]
        option = {"op": "", "latency": "--latency: ", "bps": "--bps: ", "iops": "--iops: ",
                  "errno": "--errno: ", "sector": "--sector: "}.get(key, "")
        raise UsageError(f"fault ... {args.action}: {option}{message}", hint or None)
    return fault


def _no_options(args: argparse.Namespace, doing: str, keep: tuple[str, ...] = ()) -> None:
    from vmlaunch.errors import UsageError

    given = {"op": args.op is not None, "sector": args.sector is not None, "once": args.once,
             "errno": args.errno is not None, "bps": args.bps is not None, "iops": args.iops is not None,
             "latency": args.latency is not None, "json": args.json}
    extra = [key for key, on in given.items() if on and key not in keep]
    if extra:
        shown = [f"--{args.op}" if key == "op" else f"--{key}" for key in extra]
        raise UsageError(f"fault: {', '.join(shown)} is not for {doing}", "`vmlaunch fault --help`")


def _listed(faults: list[DiskFault]) -> str:
    from vmlaunch.spec.diskfault import describe

    return "; ".join(describe(fault) for fault in faults)


def _list(found: dict[str, dict[str, list[DiskFault]]], as_json: bool) -> int:
    import json

    from vmlaunch.spec.diskfault import to_json

    if as_json:
        print(json.dumps({vm: {disk: [to_json(fault) for fault in faults] for disk, faults in disks.items()}
                          for vm, disks in found.items() if disks}, indent=2))
        return 0
    lines = [f"{vm} {disk}: {_listed(faults)}"
             for vm, disks in found.items() for disk, faults in disks.items()]
    print("\n".join(lines) if lines else "no disk faults set")
    return 0
