"""The commands a test rig drives its guests with through the command channel, which needs neither
the guest's network nor SSH: `exec` and `cp`."""

from __future__ import annotations

import argparse
import sys

from vmlaunch.cli.common import Commands, add_timeout, add_vm, command, lab_vm, seconds
from vmlaunch.errors import UsageError

VIA_HELP = ("the way into the guest: the command channel (default: vmlaunch's agent, else QEMU's guest "
            "agent; 'agent' or 'qga' to use only that one) or 'ssh'")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    run = command(commands, "exec", cmd_exec, help="run a command in a VM through its command channel",
                  description="Run CMD in the VM through its command channel (spec key `agent`), which needs "
                  "neither the guest's network nor SSH: it works with every NIC of the VM down. The "
                  "command's standard output and standard error come out on vmlaunch's own, apart, and "
                  "vmlaunch exits with its status (128+N when a signal N ended it). Exit 124: it did not "
                  "end within --timeout and was killed in the guest, with what it started (or the guest "
                  "did not say so within 5 s more); exit 5: the channel failed (no agent answered, or it "
                  "closed or hung). Options go before --, after VM too: every word after -- is the "
                  "command's.", spec=True)
    add_vm(run, help="the VM to run the command in")
    run.add_argument("command", metavar="CMD", nargs=argparse.REMAINDER,
                     help="-- and the command: one word is run by the guest's shell (-- 'ls /tmp | wc -l'), "
                     "several arrive as those words (-- printf '%%s' 'two words')")
    add_timeout(run, "seconds the command may run; default 60", default=60.0)
    run.add_argument("--no-timeout", action="store_true", help="let the command run as long as it runs")
    run.add_argument("--wait", metavar="S", type=seconds(False), default=60.0,
                     help="seconds to wait for the guest's agent to answer (a guest still booting); "
                     "default 60")
    run.add_argument("-i", "--stdin", action="store_true",
                     help="pass vmlaunch's standard input to the command (read to its end first)")
    run.add_argument("--via", choices=("agent", "qga", "ssh"), default=None, help=VIA_HELP)

    cp = command(commands, "cp", cmd_cp, help="copy files and folders into or out of a VM",
                 description="Copy a file or folder between the host and a VM (or two VMs) through the "
                 "command channel, as `cp -r` would: into DST when DST is a folder. VM:PATH names a "
                 "path in a VM (absolute); anything else is a host path (write ./a:b for a host path "
                 "with a colon). Modes are kept; copies in a guest belong to root; what comes from a "
                 "guest loses setuid and setgid bits and may not hold device nodes or links that "
                 "point out of the copy.", spec=True)
    cp.add_argument("source", metavar="SRC", help="VM:PATH or a host path")
    cp.add_argument("target", metavar="DST", help="VM:PATH or a host path")
    add_timeout(cp, "seconds the copy may take; default 600", default=600.0)
    cp.add_argument("--via", choices=("agent", "qga", "ssh"), default=None, help=VIA_HELP)


def cmd_exec(args: argparse.Namespace) -> int:
    from vmlaunch.errors import CommandTimedOut
    from vmlaunch.rig.guest import Guest

    words = list(args.command)
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise UsageError("no command given", "put it after --: vmlaunch exec SPEC VM -- CMD...")
    run_dir, lab = lab_vm(args.spec, args.vm)
    data = sys.stdin.buffer.read() if args.stdin else None
    cmd: str | list[str] = words[0] if len(words) == 1 else words
    guest = Guest(run_dir, args.vm, lab, args.via)
    try:
        result = guest.run(cmd, timeout=None if args.no_timeout else args.timeout, input=data, wait=args.wait)
    except CommandTimedOut as timed_out:
        partial = timed_out.result  # type: ignore[attr-defined]
        _emit(partial.stdout, partial.stderr)
        raise
    _emit(result.stdout, result.stderr)
    if result.truncated:
        print("vmlaunch: the output was cut: the command wrote more than 64 MiB on one stream (or more "
              "than the guest had room for); the rest was dropped", file=sys.stderr)
    return result.exit_code if 0 <= result.exit_code <= 255 else 255


def _emit(out: bytes, err: bytes) -> None:
    sys.stdout.flush()
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()
    sys.stderr.flush()
    sys.stderr.buffer.write(err)
    sys.stderr.buffer.flush()


def cmd_cp(args: argparse.Namespace) -> int:
    import tempfile

    from vmlaunch.rig.guest import Guest, split_vm_path

    source_vm, source = split_vm_path(args.source)
    target_vm, target = split_vm_path(args.target)
    if source_vm is None and target_vm is None:
        raise UsageError("neither side names a VM",
                         "write VM:PATH on one side: vmlaunch cp SPEC ./file vm:/tmp/")
    run_dir, lab = lab_vm(args.spec, *(vm for vm in (source_vm, target_vm) if vm is not None))
    if source_vm is not None and target_vm is not None:
        with tempfile.TemporaryDirectory(prefix="vmlaunch-cp-") as staging:
            here = Guest(run_dir, source_vm, lab, args.via).copy_from(source, staging, args.timeout)
            written = Guest(run_dir, target_vm, lab, args.via).copy_to(here, target, args.timeout)
        print(f"{target_vm}:{written}")
    elif target_vm is not None:
        written = Guest(run_dir, target_vm, lab, args.via).copy_to(source, target, args.timeout)
        print(f"{target_vm}:{written}")
    else:
        assert source_vm is not None
        print(Guest(run_dir, source_vm, lab, args.via).copy_from(source, target, args.timeout))
    return 0
