"""What every command module of the CLI shares: the one way to register a command, the arguments many
commands take (SPEC, VMs, --timeout, --json) and the lab a command is about.

A command group is a module of `cli/` with `register(commands, root)`; `cli/__init__.py` lists the
groups. Every command is added with `command()`, which ties its name, its one-line help, its
description and the function it runs together, so that help, completion and the generated command
reference read every command the same way. Nothing heavy is imported here: argparse only.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import sys
from collections.abc import Callable, Sequence
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
    """A usage mistake is a UsageError (exit 64, with a hint), not argparse's own exit 2: 2 is a spec's.

    The hint says what was meant where the words show it: a command name close to an unknown one, or
    the order of a command's words (`snapshot save lab.toml s2` for `snapshot lab.toml save s2`); else
    the command's own --help."""

    words: Sequence[str] = ()
    refused: tuple[argparse.Action, str] | None = None  # the argument whose value is not a choice

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self.words = list(sys.argv[1:] if args is None else args)
        return self._options_then_command(self.words, namespace)

    def _options_then_command(self, words: list[str], namespace: argparse.Namespace | None,
                              ) -> tuple[argparse.Namespace, list[str]]:
        """A command whose last argument is a command line (exec, ssh: CMD, argparse.REMAINDER) takes
        its options before `--` wherever they stand, after VM too (`exec SPEC VM --timeout 2 -- sleep
        8`): argparse alone would make them words of CMD. Without `--`, CMD begins at the first word
        after VM, and an option of the command there is refused rather than run in the guest."""
        rest = next((action for action in self._actions if action.nargs == argparse.REMAINDER), None)
        if rest is None:
            return super().parse_known_args(words, namespace)
        if "--" in words:
            at = words.index("--")
            # CMD takes no options there, only a word (its first, then CMD began before `--`)
            rest.nargs, rest.required = argparse.OPTIONAL, False
            try:
                parsed, extra = super().parse_known_args(words[:at], copy.copy(namespace))
            finally:
                rest.nargs, rest.required = argparse.REMAINDER, True
            if getattr(parsed, rest.dest) is None:
                setattr(parsed, rest.dest, words[at + 1:])
                return parsed, extra
            # CMD began before `--`, which is then one of its words (`exec SPEC VM sh -c '...' -- x`)
        parsed, extra = super().parse_known_args(words, namespace)
        command = getattr(parsed, rest.dest)
        if command and command[0] in self._option_string_actions:
            raise UsageError(f"{command[0]} stands where the command begins: options come before --, "
                             "the command after it",
                             f"`{self.prog} SPEC VM {command[0]} ... -- CMD...` (see `{self.prog} --help`)")
        return parsed, extra

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            self.refused = (action, str(value))
            raise

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.usage_hint())

    def usage_hint(self) -> str:
        see = f"see `{self.command_prog()} --help`"
        if self.refused is None or self.refused[0].choices is None:
            return see
        action, value = self.refused
        choices = [str(choice) for choice in action.choices]  # type: ignore[union-attr]
        if not isinstance(action, argparse._SubParsersAction):  # a command's words in another order?
            order = self._order_hint(action, value, choices)
            if order is not None:
                return order
        return f"{did_you_mean(value, choices)}{see}"

    def command_prog(self) -> str:
        """`vmlaunch up` for `vmlaunch up --bogus`: the root parser reports an unknown option after a
        command (argparse leaves it to the root), and the help that lists the right ones is the
        command's."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                given = next((word for word in self.words if word in action.choices), None)
                if given is not None:
                    return str(action.choices[given].prog)
        return self.prog

    def _order_hint(self, action: argparse.Action, value: str, choices: list[str]) -> str | None:
        """`snapshot save lab.toml s2`: a choice given before the argument that comes first. The hint
        moves it to after the word given in its place."""
        if value not in self.words:
            return None
        at = self.words.index(value)
        early = next((word for word in self.words[:at] if word in choices), None)
        if early is None:
            return None
        positionals = [each for each in self._actions if not each.option_strings]
        before = [str(each.metavar or each.dest) for each in positionals[:positionals.index(action)]]
        words = list(self.words)
        words.remove(early)
        words.insert(words.index(value) + 1, early)
        return (f"{' '.join(before) or 'it'} comes first, then {action.metavar or action.dest}: "
                f"`{self.prog} {' '.join(words)}` (see `{self.prog} --help`)")


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`did you mean 'status'? ` when `word` is close to one or two of `choices`, else ''."""
    near = difflib.get_close_matches(word, choices, n=2)
    return f"did you mean {' or '.join(map(repr, near))}? " if near else ""


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


def say_other_spec(run_dir: RunDir, spec: str) -> None:
    """A warning when the lab's name is up from another spec file: what the run dir holds is that
    file's lab, not `spec`'s, even where its VMs have the same names."""
    import logging
    import os

    from vmlaunch.errors import VmlaunchError
    from vmlaunch.lab.journal import Journal

    try:
        other = Journal.load(run_dir).other_spec(spec)
    except (VmlaunchError, OSError):  # the command itself says what is wrong with the journal
        return
    if other is not None:
        logging.getLogger("vmlaunch").warning(
            "lab %s is up from another spec file, %s, not %s: what follows is that lab's VMs, as this "
            "file names them", run_dir.lab, other, os.path.realpath(spec))


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
