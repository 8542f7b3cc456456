"""`vmlaunch help [COMMAND]` and `vmlaunch completion SHELL`: what the command line itself offers."""

from __future__ import annotations

import argparse
import functools
import sys

from vmlaunch.cli.common import Commands, command, did_you_mean
from vmlaunch.errors import UsageError


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    help_ = command(commands, "help", functools.partial(cmd_help, root, commands),
                    help="print this help, or a command's",
                    description="Print the help of vmlaunch, or of COMMAND "
                    "(the same as `vmlaunch COMMAND --help`).")
    help_.add_argument("topic", metavar="COMMAND", nargs="?", help="e.g. up")

    completion = command(
        commands, "completion", functools.partial(cmd_completion, root),
        help="print the shell completion script for bash or zsh",
        description="Print the completion script for SHELL, generated from vmlaunch's own options: "
        "`eval \"$(vmlaunch completion bash)\"` in ~/.bashrc, `source <(vmlaunch completion zsh)` "
        "in ~/.zshrc (`make install` also puts both where the shells look).")
    completion.add_argument("shell", metavar="SHELL", nargs="?", choices=("bash", "zsh"), help="bash or zsh")
    completion.add_argument("--vms", metavar="SPEC",
                            help="print the VM names of SPEC, one a line (nothing when it does not "
                            "validate); the scripts use it")


def cmd_help(parser: argparse.ArgumentParser, commands: Commands, args: argparse.Namespace) -> int:
    if args.topic is None:
        parser.print_help()
        return 0
    if args.topic not in commands.choices:
        raise UsageError(f"no command {args.topic!r}", f"{did_you_mean(args.topic, list(commands.choices))}"
                         f"commands: {', '.join(commands.choices)}")
    commands.choices[args.topic].print_help()
    return 0


def cmd_completion(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from vmlaunch.cli.completion import script, vm_names

    if args.vms is not None and args.shell is None:
        sys.stdout.writelines(f"{name}\n" for name in vm_names(args.vms))
        return 0
    if args.vms is not None or args.shell is None:
        raise UsageError("give either SHELL (bash or zsh) or --vms SPEC",
                         "e.g. `eval \"$(vmlaunch completion bash)\"` in ~/.bashrc")
    sys.stdout.write(script(args.shell, parser))
    return 0
