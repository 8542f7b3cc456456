"""What every command module of the CLI shares: the one way to register a command, the arguments many
commands take (SPEC, VMs, --timeout, --json) and the lab a command is about.

A command group is a module of `cli/` with `register(commands, root)`; `cli/__init__.py` lists the
groups. Every command is added with `command()`, which ties its name, its one-line help, its
description and the function it runs together, so that help, completion and the generated command
reference read every command the same way. Nothing heavy is imported here: argparse only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from vmlaunch.errors import UsageError

if TYPE_CHECKING:
    from vmlaunch.layout.rundir import RunDir
    from vmlaunch.spec.model import LabSpec

    Commands = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    Commands = Any

Run = Callable[[argparse.Namespace], int]
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: more is a typo, and would overflow the C timeouts below
SPEC_HELP = "the lab's TOML file"
ONLY = "only these VMs"


class Parser(argparse.ArgumentParser):
    """A usage mistake is a UsageError (exit 64, with a hint), not argparse's own exit 2: 2 is a spec's."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"see `{self.prog} --help`")


def command(commands: Commands, name: str, run: Run, *, help: str, description: str, raw: bool = False,
            spec: bool = False, vms: str | None = None, json: str | None = None) -> argparse.ArgumentParser:
    """Add command `name`, which runs `run(args)`; `raw`: its description is laid out by hand. With
    `spec`, it takes SPEC first; with `vms` (their help), VM names after it; with `json`, --json."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help, description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter)
    parser.set_defaults(run=run)
    if spec:
        add_spec(parser)
    if vms is not None:
        add_vms(parser, vms)
    if json is not None:
        add_json(parser, json)
    return parser


def add_spec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", metavar="SPEC", help=SPEC_HELP)


def add_vms(parser: argparse.ArgumentParser, help: str = ONLY) -> None:
    parser.add_argument("vms", metavar="VM", nargs="*", default=[], help=help)


def add_vm(parser: argparse.ArgumentParser, *, optional: bool = False, help: str = "the VM") -> None:
    parser.add_argument("vm", metavar="VM", nargs="?" if optional else None, help=help)


def add_json(parser: argparse.ArgumentParser, help: str = "print JSON") -> None:
    parser.add_argument("--json", action="store_true", help=help)


def add_timeout(parser: argparse.ArgumentParser, help: str, *, default: float | None,
                zero_ok: bool = False) -> None:
    parser.add_argument("--timeout", metavar="S", type=seconds(zero_ok), default=default, help=help)


def seconds(zero_ok: bool) -> Callable[[str], float]:
    """An argparse type for --timeout: a finite number of seconds, more than 0 unless `zero_ok`."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        in_range = 0 <= value <= MAX_TIMEOUT if zero_ok else 0 < value <= MAX_TIMEOUT
        if not in_range:  # NaN and infinities too: NaN fails every comparison
            least = "0 or more" if zero_ok else "more than 0"
            raise argparse.ArgumentTypeError(
                f"{text!r} seconds: must be {least} and at most {MAX_TIMEOUT:.0f} (a week)")
        return value

    return seconds


def vm_count(text: str) -> int:
    """An argparse type for --parallel: a whole number of VMs, 1 or more."""
    if not text.strip().isdigit() or int(text) < 1 or int(text) > 4096:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of VMs from 1 to 4096")
    return int(text)


def lab_vm(spec: str, *vms: str) -> tuple[RunDir, LabSpec]:
    """The lab's run dir and the lab with its clones (`runtime/fork.py`: they are VMs of the lab until
    they go down); each of `vms` must be one of its VMs."""
    from vmlaunch.layout.dirs import run_root
    from vmlaunch.layout.rundir import RunDir
    from vmlaunch.runtime.members import members
    from vmlaunch.spec.load import load_lab

    lab = members(load_lab(spec))
    lab.select(vms)
    return RunDir.of(run_root(), lab.name), lab


# the commands a lab on libvirt hosts (`[host.NAME]`) takes: the others drive vmlaunch's own QEMUs here
ON_HOSTS = frozenset(("validate", "cmdline", "up", "down", "status", "logs", "console", "ssh", "balloon",
                      "export", "graph", "doctor", "image"))


def refuse_on_hosts(args: argparse.Namespace) -> None:
    """A UsageError when the command (`args.verb`) drives vmlaunch's own QEMUs and its SPEC is a lab on
    libvirt hosts, whose VMs are libvirt domains there: rather than its VMs said not to run."""
    from vmlaunch.spec.load import host_names

    spec = getattr(args, "spec", None)
    if args.verb in ON_HOSTS or not isinstance(spec, str):
        return
    hosts = host_names(spec)
    if hosts:
        raise UsageError(f"{args.verb}: {spec} is a lab on libvirt hosts ({', '.join(hosts)}), and "
                         f"{args.verb} drives vmlaunch's own QEMUs on this machine",
                         f"a lab on libvirt hosts takes {', '.join(sorted(ON_HOSTS - {'image'}))} and image "
                         "pull (the manual's \"Across several hosts\")")


def count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
