"""`python -m vmlaunch.manager.managerd RUN_DIR [--ready-fd FD | --detached]`: how the lab manager
(`manager/manager.py`) is started. Light on purpose: it forks (the manager is nobody's child; with
`--detached`, how `up` starts it through sh, its starter saw to that), says it runs, and only then imports
the manager, whose modules take 0.15-0.3 s to load, which `up` need not wait for. A manager that fails
after that says why in its log (`manager.log`), and `status` shows it gone."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmlaunch.manager.managerd",
                                     description="Start the lab manager (as `vmlaunch up` does).")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--ready-fd", type=int, default=None,
                        help="write the manager's pid and a newline here once it runs")
    parser.add_argument("--detached", action="store_true",
                        help="do not fork: the caller made it nobody's child (`up` starts it through sh)")
    args = parser.parse_args(argv)
    if not args.detached and os.fork():
        return 0  # the caller waits for this one; the manager goes on in the child, nobody's child
    if args.ready_fd is not None:
        with contextlib.suppress(OSError):
            os.write(args.ready_fd, f"{os.getpid()}\n".encode())
            os.close(args.ready_fd)
    if args.detached:
        _after_up(args.run_dir)
    from vmlaunch.manager.manager import run

    return run(args.run_dir)


UP_HEAD_START = 1.0  # seconds the manager waits, at most, for the `up` that started it to finish


def _after_up(run_dir: Path) -> None:
    """Let the `up` that started the manager finish first (it holds the lab's lock until then): the
    manager's modules, loaded at the same time, would take a CPU from the QEMUs starting. At most
    UP_HEAD_START: beside an `up` that waits for its guests to boot, the manager does its work."""
    import fcntl

    from vmlaunch.core.wait import TimedOut, wait_until
    from vmlaunch.layout.rundir import RunDir

    try:
        fd = os.open(RunDir(run_dir).lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return  # no lock file: no `up` holds it

    def free() -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    try:
        wait_until(free, UP_HEAD_START, interval=0.01)
    except (TimedOut, OSError):
        pass
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
