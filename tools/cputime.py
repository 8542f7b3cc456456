"""Run a command; then print its wall time and the CPU time (user + system) of everything it ran.

    python3 tools/cputime.py [--label TEXT] -- COMMAND [ARG...]

`make test` runs pytest under it, so that every run of the suite ends with what it cost. The CPU time
is the command's and all its descendants': also the processes that leave it to run on their own (a
lab's QEMUs and its lab manager are started detached, and their parent exits), which would otherwise
be adopted by init and never counted. This process makes itself their child subreaper
(PR_SET_CHILD_SUBREAPER), so they are adopted by it, and reaps them: the kernel then adds their CPU
time to its own children's (getrusage RUSAGE_CHILDREN). A process still running when the command
has ended is not counted; their number is said.

The exit status is the command's (128 + N when a signal N ended it). SIGINT, SIGTERM and SIGHUP are
passed on to the command.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def adopted() -> int:
    """How many processes of which this one is the parent still run (not counted)."""
    me, count = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--label", default="", help="what the figures are of (printed with them)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # Linux only; without it, children only
        print("cputime: cannot adopt detached processes: their CPU time is not counted", file=sys.stderr)
    start = time.monotonic()
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"cputime: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    status = None
    while status is None:  # reap everything: the command, and whatever it left that ends meanwhile
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(wait_status)
    wall = time.monotonic() - start
    while True:  # what has ended since, not waiting for the rest
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    left = adopted()
    label = f" of {args.label}" if args.label else ""
    print(f"\nCPU time{label}: {cpu:.1f} s (user {usage.ru_utime:.1f} s + system {usage.ru_stime:.1f} s, "
          f"children included); wall {wall:.1f} s; {cpu / wall if wall else 0:.2f} cores on average"
          + (f"; {left} process(es) still running, not counted" if left else ""))
    if status is None:
        return 1
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
