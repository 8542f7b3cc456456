"""`python -m vmlaunch.manager.managerd RUN_DIR --ready-fd FD`: how `up` starts the lab manager
(`manager/manager.py`). Light on purpose: it forks (the manager is nobody's child), says it runs, and
only then imports the manager, whose modules take 0.15-0.3 s to load, which `up` need not wait for. A
manager that fails after that says why in its log (`manager.log`), and `status` shows it gone."""

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
    args = parser.parse_args(argv)
    if os.fork():
        return 0  # the caller waits for this one; the manager goes on in the child, nobody's child
    if args.ready_fd is not None:
        with contextlib.suppress(OSError):
            os.write(args.ready_fd, f"{os.getpid()}\n".encode())
            os.close(args.ready_fd)
    from vmlaunch.manager.manager import run

    return run(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
