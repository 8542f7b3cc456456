"""The `vmlaunch` command: a thin layer that turns arguments into calls and errors into exit codes.

One module per command group, each with `register(commands, root)` adding its commands the one way
(`common.command`): `init` (a starter lab.toml), `lab` (validate, cmdline, up, down, pause, resume,
reset), `run` (run, template: throwaway VMs), `vms` (ls, status, logs, console, ssh, balloon, qmp,
numa), `rig` (exec, cp), `wire` (link, partition), `netem`, `fault` (faults on the disks), `screen`
(screenshot, send-keys, evidence), `image`, `snapshot`, `export`, `graph`, `doctor`, `help` (help,
completion). This module builds the parser from them and owns what every command shares: the exit codes,
the log lines on standard error, signals and a closed pipe.

Start-up is kept light: a group imports argparse only; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from vmlaunch.cli import (
    doctor,
    export,
    fault,
    fork,
    graph,
    help,
    image,
    init,
    lab,
    netem,
    rig,
    run,
    screen,
    snapshot,
    vms,
    wire,
)
from vmlaunch.cli.common import Parser, refuse_on_hosts
from vmlaunch.core.version import __version__
from vmlaunch.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    SpecError,
    VmlaunchError,
)

log = logging.getLogger("vmlaunch")

# The command groups, in the order `vmlaunch --help` lists their commands.
GROUPS = (init, lab, run, fork, vms, rig, wire, netem, fault, screen, image, snapshot, export, graph, doctor,
          help)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="vmlaunch",
        description="Declarative QEMU/KVM labs: a TOML spec of VMs and networks, compiled into "
        "QEMU command lines that follow KVM best practice.",
        epilog="`vmlaunch help COMMAND` (or `vmlaunch COMMAND --help`) shows a command's options. "
        "Exit status: 0 ok, 2 the spec is wrong, 3 the host cannot do it (or, for export --strict, the "
        "engine), 4 a run-time failure, 5 the command channel into a guest failed, 64 bad usage, "
        "124 a command in a guest timed out, 130 interrupted, 141 the reader of the output went away; "
        "`exec` exits with the guest command's own status.",
    )
    parser.add_argument("--version", action="version", version=f"vmlaunch {__version__}")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="also print debug lines")
    verbosity.add_argument("-q", "--quiet", action="store_true",
                           help="print only warnings and errors (no progress or notes)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    # Not required: `vmlaunch` alone prints this help (see _main), as `vmlaunch help` does.

    for group in GROUPS:
        group.register(commands, parser)
    for name, command in commands.choices.items():  # `command` itself may be a command's argument (exec)
        command.set_defaults(verb=name)
    return parser


def _stop_on_signal(signum: int, frame: object) -> None:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal) unwind: an `up` in progress rolls back.

    Further ones are ignored from here on: the rollback this starts must run to its end.
    """
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _stop_on_signal) for sig in stopping}
    if argv is None:  # the process is the command
        _collect_less()
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is seen below
        sys.stderr.flush()
        if argv is None:  # the process is the command, and ends now
            _spare_the_last_collection()
        return code
    except BrokenPipeError:
        # `vmlaunch cmdline lab.toml | head -1`: the reader has all it wanted. Exit as a process
        # killed by SIGPIPE would, silently; what is still buffered goes to /dev/null, not to an
        # "Exception ignored" message at exit.
        _discard_output()
        return EXIT_BROKEN_PIPE
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _collect_less() -> None:
    """A young-generation collection every 50,000 allocations, not every 700: a command's start-up
    (its modules, ~90 attrs classes) allocates much and frees little, and each collection walks it all
    again (~5-9 % of `up`'s CPU, measured). A long-lived command (`console`, `logs --follow`) still
    collects, less often."""
    import gc

    gc.set_threshold(50_000, *gc.get_threshold()[1:])


def _spare_the_last_collection() -> None:
    """Python's exit walks every object left for a last garbage collection (~50 ms after an `up`, a
    quarter of it): frozen, they are skipped. The exit itself (atexit, flushing, closing) is as
    ever. Only for the command's own process: in a caller that goes on, frozen objects would
    never be collected."""
    import gc

    if "libvirt" in sys.modules:  # its connections' finalizers need the module: collected as ever
        return
    gc.freeze()


def _reader_gone() -> bool:
    """True when whoever read our standard output (or error) has closed it."""
    import contextlib
    import select

    poller = select.poll()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # not a real file (tests capture output)
            poller.register(stream.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _discard_output() -> None:
    import contextlib

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # not a real file (tests capture output)
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


class _Formatter(logging.Formatter):
    """`vmlaunch: message`, with `warning: `/`error: ` before what is one."""

    def format(self, record: logging.LogRecord) -> str:
        label = {logging.WARNING: "warning: ", logging.ERROR: "error: ",
                 logging.CRITICAL: "error: ", logging.DEBUG: "debug: "}.get(record.levelno, "")
        return f"vmlaunch: {label}{record.getMessage()}"


def _log_to_stderr(verbose: bool, quiet: bool) -> logging.Handler:
    """The CLI owns how library log lines look: one handler on the `vmlaunch` logger."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger("vmlaunch")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    root.propagate = False
    return handler


def _main(argv: Sequence[str] | None) -> int:
    handler = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        handler = _log_to_stderr(args.verbose, args.quiet)
        if args.command is None:  # `vmlaunch` alone: what it can do, rather than an error
            parser.print_help()
            return 0
        refuse_on_hosts(args)
        return int(args.run(args))
    except SpecError as exc:
        print(exc, file=sys.stderr)
        count = len(exc.problems)
        print(f"vmlaunch: {count} problem{'s' if count != 1 else ''} in the spec", file=sys.stderr)
        return exc.exit_code
    except VmlaunchError as exc:
        print(f"vmlaunch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("vmlaunch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as exc:
        if exc.code in (128 + 1, 128 + 15):
            print("vmlaunch: terminated", file=sys.stderr)
        raise
    except OSError as exc:  # the host: a run dir that cannot be made, a full disk, ...
        if isinstance(exc, BrokenPipeError) and _reader_gone():
            raise  # handled in main; a QMP socket closing on us is a failure like any other
        print(f"vmlaunch: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except Exception as exc:  # a bug in vmlaunch, not the user's mistake
        if os.environ.get("VMLAUNCH_DEBUG"):
            raise
        print(f"vmlaunch: internal error: {type(exc).__name__}: {exc}\n"
              "  this is a bug in vmlaunch; VMLAUNCH_DEBUG=1 shows the traceback", file=sys.stderr)
        return 1
    finally:
        if handler is not None:
            logging.getLogger("vmlaunch").removeHandler(handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
