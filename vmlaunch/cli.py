"""The `vmlaunch` command: a thin layer that turns arguments into calls and errors into exit codes.

Start-up is kept light: each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from vmlaunch import __version__
from vmlaunch.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    RuntimeFailure,
    SpecError,
    UsageError,
    VmlaunchError,
)

log = logging.getLogger("vmlaunch")

if TYPE_CHECKING:
    from vmlaunch.model import LabSpec
    from vmlaunch.plan import Plan
    from vmlaunch.rundir import RunDir


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message, f"see `{self.prog} --help`")


MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: more is a typo, and would overflow the C timeouts below


def _seconds(zero_ok: bool) -> Callable[[str], float]:
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vmlaunch",
        description="Declarative QEMU/KVM labs: a TOML spec of VMs and networks, compiled into "
        "QEMU command lines that follow KVM best practice.",
        epilog="`vmlaunch help COMMAND` (or `vmlaunch COMMAND --help`) shows a command's options. "
        "Exit status: 0 ok, 2 the spec is wrong, 3 the host cannot do it (or, for export --strict, the "
        "engine), 4 a run-time failure, "
        "64 bad usage, 130 interrupted, 141 the reader of the output went away.",
    )
    parser.add_argument("--version", action="version", version=f"vmlaunch {__version__}")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="also print debug lines")
    verbosity.add_argument("-q", "--quiet", action="store_true",
                           help="print only warnings and errors (no progress or notes)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # Not required: `vmlaunch` alone prints this help (see _main), as `vmlaunch help` does.

    validate = commands.add_parser(
        "validate", help="check a spec and print a one-line summary",
        description="Check a spec: structure (the JSON schema), references, sizes and clashes. "
        "Prints a one-line summary, or every problem as FILE:LINE: key.path: message.",
    )
    validate.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    validate.set_defaults(run=cmd_validate)

    cmdline = commands.add_parser(
        "cmdline", help="print each VM's QEMU command line",
        description="Print the QEMU command line of each VM (or of the VMs named), one "
        "shell-quoted line per VM that can be pasted into a shell, or JSON with --json. "
        "Which accelerator was chosen, and why, goes to standard error.",
    )
    cmdline.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    cmdline.add_argument("vms", metavar="VM", nargs="*", default=[], help="only these VMs")
    cmdline.add_argument("--json", action="store_true",
                         help='print {"VM": ["qemu-system-x86_64", ...], ...}')
    cmdline.set_defaults(run=cmd_cmdline)

    up = commands.add_parser(
        "up", help="bring the lab (or the VMs named) up",
        description="Create what the lab needs on the host (images, bridges, taps, PCI bindings) and "
        "start every VM, in parallel; return when each runs and answers QMP. VMs already running are "
        "left alone. Any failure undoes everything this run did.",
    )
    up.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    up.add_argument("vms", metavar="VM", nargs="*", default=[], help="only these VMs")
    up.add_argument("--dry-run", action="store_true",
                    help="print the host actions and each QEMU command line; change nothing")
    up.add_argument("--wait-for", metavar="TEXT",
                    help="also wait until each VM's serial console has printed TEXT")
    up.add_argument("--timeout", metavar="S", type=_seconds(zero_ok=False),
                    help="seconds to wait for the VMs (and for another up/down of the lab); "
                         "default 60, 600 with --wait ssh")
    up.add_argument("--force", action="store_true",
                    help="take the lab over when it is up from another spec file with the same lab name")
    up.add_argument("--wait", metavar="WHAT", choices=("ssh",),
                    help="ssh: also wait until each VM with an SSH port answers SSH")
    up.add_argument("--fresh", action="store_true",
                    help="start the VMs afresh from their images: their overlays, seeds and UEFI "
                    "variables are made anew (what they wrote is lost; their SSH keys stay)")
    up.add_argument("--from-snapshot", metavar="NAME",
                    help="start the VMs, which must be down, from snapshot NAME (`vmlaunch snapshot`), "
                    "RAM included: they run on from that instant, without booting")
    up.set_defaults(run=cmd_up)

    ssh = commands.add_parser(
        "ssh", help="log in to a VM over SSH, or run a command there",
        description="Run OpenSSH with the lab's key, the VM's user and port and its pinned host key. "
        "With -- CMD..., run CMD in the VM (each word arrives as a word) and exit with its status.",
    )
    ssh.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    ssh.add_argument("vm", metavar="VM", help="the VM to log in to")
    ssh.add_argument("command", metavar="CMD", nargs=argparse.REMAINDER,
                     help="-- and the command to run, e.g. -- sh -c 'exit 7'")
    ssh.set_defaults(run=cmd_ssh)

    for verb, what in (("pause", "pause"), ("resume", "resume")):
        command = commands.add_parser(
            verb, help=f"{what} the lab's VMs (or those named)",
            description=("Pause the VMs (QMP stop): the guests stop running until `vmlaunch resume`; "
                         "a snapshot save or restore leaves a VM you paused paused." if verb == "pause" else
                         "Resume VMs that are paused (QMP cont). A VM an interrupted snapshot restore "
                         "left paused is refused: its memory may be half loaded (restore the snapshot "
                         "again, which resumes it)."))
        command.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
        command.add_argument("vms", metavar="VM", nargs="*", default=[], help="only these VMs")
        command.add_argument("--timeout", metavar="S", type=_seconds(zero_ok=False), default=10.0,
                             help="seconds to wait for another vmlaunch of the lab; default 10")
        command.set_defaults(run=cmd_pause if verb == "pause" else cmd_resume)

    reset = commands.add_parser(
        "reset", help="make VMs start afresh from their images at the next up",
        description="Remove the VMs' overlays, cloud-init seeds and UEFI variables (kept beside the "
        "spec in .vmlaunch/LAB/), so the next up boots them as new machines from their images. Their "
        "SSH keys stay. A VM that is up is refused.",
    )
    reset.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    reset.add_argument("vms", metavar="VM", nargs="*", default=[], help="only these VMs")
    reset.set_defaults(run=cmd_reset)

    down = commands.add_parser(
        "down", help="stop the lab (or the VMs named) and remove every trace of it",
        description="Stop each VM (ACPI power button, then QMP quit, then kill), then remove the taps, "
        "the bridges vmlaunch created, the PCI bindings and the run dir. Works after crashes; a second "
        "down does nothing. Disk images are kept.",
    )
    down.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    down.add_argument("vms", metavar="VM", nargs="*", default=[], help="only these VMs")
    down.add_argument("--timeout", metavar="S", type=_seconds(zero_ok=True), default=10.0,
                      help="seconds each guest gets to power off before it is stopped (0: stop it "
                      "at once); default 10")
    down.add_argument("--force", action="store_true",
                      help="when the lab's journal cannot be read whole (damaged, or written by "
                      "another vmlaunch version), stop and remove everything it recognises and list "
                      "the rest; also take down a lab of this name that is up from another spec file")
    down.set_defaults(run=cmd_down)

    status = commands.add_parser("status", help="show each VM: running, stopped or crashed",
                                 description="Per VM: state, pid, accelerator, balloon size, uptime; "
                                 "and each NIC: its MAC, network (bridge and tap, user network with "
                                 "its forwarded ports, or socket group).")
    status.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    status.add_argument("--json", action="store_true", help="print JSON keyed by VM name")
    status.set_defaults(run=cmd_status)

    numa = commands.add_parser("numa", help="where each VM's memory is and where its vCPUs run",
                               description="Per VM: its memory per NUMA node (pages, MiB, percent, from "
                               "/proc/PID/numa_maps), the share on the node(s) it is placed on, and each "
                               "vCPU's last CPU and node; per node: CPUs, free memory, the lab's runnable "
                               "vCPUs now and the load the balancer saw last.")
    numa.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    numa.add_argument("vms", metavar="VM", nargs="*", help="only these VMs (default: all)")
    numa.add_argument("--json", action="store_true", help="print JSON")
    numa.set_defaults(run=cmd_numa)

    doctor = commands.add_parser("doctor", help="check this host, and a lab, against the best practices",
                                 description="Check the host (KVM, vhost-net, io_uring, IOMMU, hugepages, "
                                 "KSM, NUMA, THP, the I/O scheduler behind the image folders, memory and "
                                 "disk space) and, with SPEC, its bridges and uplinks and the lab itself "
                                 "(memory and vCPU over-commit, disk space for sparse images, partition "
                                 "alignment, O_DIRECT, cache modes, PCI, hugepages with KSM). Each check: "
                                 "ok, note, warn or fail, what was found, why it matters and the fix. "
                                 "Exit 0 when nothing fails, 1 when something does.")
    doctor.add_argument("spec", metavar="SPEC", nargs="?", help="a lab's TOML file (default: the host only)")
    doctor.add_argument("--json", action="store_true", help="print JSON for tools")
    doctor.set_defaults(run=cmd_doctor)

    ls = commands.add_parser("ls", help="list the labs that are up on this host",
                             description="The labs that are up on this host (in this user's run dir): "
                             "name, VMs (running or crashed), since when, and the spec file.")
    ls.add_argument("--json", action="store_true", help="print JSON keyed by lab name")
    ls.set_defaults(run=cmd_ls)

    logs = commands.add_parser("logs", help="print a VM's serial console output",
                               description="Print what the VM's serial console has printed; after "
                               "`down`, what it printed in its last run (kept in "
                               "/var/log/vmlaunch/LAB as root, else ~/.local/state/vmlaunch/logs/LAB).")
    logs.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    logs.add_argument("vm", metavar="VM", nargs="?",
                      help="the VM whose console output to print (none with --manager)")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing as it grows, until the VM stops or Ctrl-C")
    logs.add_argument("--qemu", action="store_true",
                      help="QEMU's own messages (its standard error) instead of the console")
    logs.add_argument("--manager", action="store_true",
                      help="the lab manager's log (balloon decisions and their reasons) instead of a VM's")
    logs.set_defaults(run=cmd_logs)

    console = commands.add_parser("console", help="attach to a VM's serial console",
                                  description="Interactive serial console; Ctrl-] detaches and "
                                  "leaves the VM running.")
    console.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    console.add_argument("vm", metavar="VM", help="the VM whose console to attach to")
    console.set_defaults(run=cmd_console)

    balloon = commands.add_parser("balloon", help="print or set a VM's balloon size",
                                  description="Without SIZE, print the memory the guest has now. With "
                                  "SIZE, set the balloon target and wait until the guest follows.")
    balloon.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    balloon.add_argument("vm", metavar="VM", help="the VM whose balloon to print or set")
    balloon.add_argument("size", metavar="SIZE", nargs="?",
                         help="binary, as every size: 256M, 1G, 512MiB, or a bare number of MiB (512); "
                         "MB and GB are refused (10^6 or 2^20 bytes?)")
    balloon.add_argument("--timeout", metavar="S", type=_seconds(zero_ok=False), default=10.0,
                         help="seconds the guest gets to follow; default 10")
    balloon.set_defaults(run=cmd_balloon)

    qmp = commands.add_parser("qmp", help="send a raw QMP command, print the JSON reply",
                              description="Send one QMP command to the VM and print its reply as JSON, "
                              "e.g. `vmlaunch qmp lab.toml alpha query-status`. A reply that is text "
                              "is printed as text: `vmlaunch qmp lab.toml alpha human-monitor-command "
                              "'{\"command-line\": \"info chardev\"}'`.")
    qmp.add_argument("spec", metavar="SPEC", help="the lab's TOML file")
    qmp.add_argument("vm", metavar="VM", help="the VM to send the command to")
    qmp.add_argument("command", metavar="COMMAND", help="the QMP command, e.g. query-status")
    qmp.add_argument("arguments", metavar="JSON-ARGS", nargs="?", help='e.g. \'{"value": 134217728}\'')
    qmp.set_defaults(run=cmd_qmp)

    help_ = commands.add_parser("help", help="print this help, or a command's",
                                description="Print the help of vmlaunch, or of COMMAND "
                                "(the same as `vmlaunch COMMAND --help`).")
    help_.add_argument("topic", metavar="COMMAND", nargs="?", help="e.g. up")
    help_.set_defaults(run=lambda args: cmd_help(parser, commands, args.topic))

    completion = commands.add_parser(
        "completion", help="print the shell completion script for bash or zsh",
        description="Print the completion script for SHELL, generated from vmlaunch's own options: "
        "`eval \"$(vmlaunch completion bash)\"` in ~/.bashrc, `source <(vmlaunch completion zsh)` "
        "in ~/.zshrc (`make install` also puts both where the shells look).",
    )
    completion.add_argument("shell", metavar="SHELL", nargs="?", choices=("bash", "zsh"),
                            help="bash or zsh")
    completion.add_argument("--vms", metavar="SPEC",
                            help="print the VM names of SPEC, one a line (nothing when it does not "
                            "validate); the scripts use it")
    completion.set_defaults(run=cmd_completion)

    from vmlaunch.imagecmd import add_parser as add_image_commands  # argparse only: stays light

    add_image_commands(commands)
    from vmlaunch.snapshotcmd import add_parser as add_snapshot_commands  # argparse only: stays light

    add_snapshot_commands(commands)
    from vmlaunch.exportcmd import add_parser as add_export_command  # argparse only: stays light

    add_export_command(commands)
    return parser


def cmd_help(parser: argparse.ArgumentParser, commands: argparse._SubParsersAction[Any],
             topic: str | None) -> int:
    if topic is None:
        parser.print_help()
        return 0
    if topic not in commands.choices:
        raise UsageError(f"no command {topic!r}", f"commands: {', '.join(commands.choices)}")
    commands.choices[topic].print_help()
    return 0


def _lab_vm(spec: str, *vms: str) -> tuple[RunDir, LabSpec]:
    """The lab's run dir and the lab; each of `vms` must be one of its VMs."""
    from vmlaunch.dirs import run_root
    from vmlaunch.rundir import RunDir
    from vmlaunch.spec import load_lab

    lab = load_lab(spec)
    lab.select(vms)
    return RunDir.of(run_root(), lab.name), lab


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.control import status
    from vmlaunch.textsafe import printable
    from vmlaunch.units import human_size

    run_dir, lab = _lab_vm(args.spec)
    rows = status(run_dir, [vm.name for vm in lab.vms], lab)
    if args.json:
        print(json.dumps({row.name: row.to_json() for row in rows}, indent=2))
        return 0
    def size(value: int | None) -> str:
        return human_size(value) if value is not None else "-"

    print(f"{'VM':<16} {'STATE':<8} {'PID':>8} {'ACCEL':<5} {'BALLOON':>8} {'UPTIME':>8} {'MAX':>6} "
          f"{'TARGET':>7} {'FREE':>6}")
    for row in rows:
        uptime = f"{row.uptime:.0f}s" if row.uptime is not None else "-"
        ssh = f"  ssh 127.0.0.1:{row.ssh_port}" if row.ssh_port else ""
        memory = row.memory
        target = "-" if memory is None else size(memory.target) if memory.policy == "auto" else \
            (memory.policy or "-")
        most, free = (memory.max, memory.guest_free) if memory else (None, None)
        print(f"{row.name:<16} {row.state:<8} {row.pid or '-':>8} {row.accel or '-':<5} "
              f"{size(row.balloon_bytes):>8} {uptime:>8} {size(most):>6} {target:>7} {size(free):>6}{ssh}")
        if row.why:
            print(f"  {row.state}: {printable(row.why)}")
        for nic in row.nics:
            print(f"  nic{nic.index} {nic.describe()}")
    lab_memory = rows[0].lab_memory if rows else None
    if lab_memory is not None:
        ksm = lab_memory.ksm
        shared = ("KSM off on the host" if not ksm or not ksm["run"] else
                  f"KSM saves the host {size(ksm['saved'])} ({ksm['pages_sharing']} pages sharing)")
        merged = f", {size(lab_memory.ksm_merged)} of it merged," if lab_memory.ksm_merged else ""
        print(f"memory: the guests hold {size(lab_memory.actual)}{merged} of a budget of "
              f"{size(lab_memory.budget)}; lab manager: {lab_memory.manager}")
        print(f"ksm: {lab_memory.ksm_setting}; {shared}")
    return 0


def cmd_numa(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.numareport import render, report

    run_dir, lab = _lab_vm(args.spec, *args.vms)
    result = report(run_dir, [vm.name for vm in lab.select(args.vms)])
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print("\n".join(render(result)))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.doctor.findings import Status
    from vmlaunch.doctor.run import doctor, render

    lab = None
    if args.spec is not None:
        from vmlaunch.spec import load_lab

        lab = load_lab(args.spec)
    host_findings, lab_findings = doctor(lab)
    every = [*host_findings, *lab_findings]
    if args.json:
        print(json.dumps({"host": [f.to_json() for f in host_findings],
                          "lab": [f.to_json() for f in lab_findings] if lab is not None else None,
                          "failed": any(f.status is Status.FAIL for f in every)}, indent=2))
    else:
        sections = [("host", host_findings)]
        if lab is not None:
            sections.append((f"lab {lab.name} ({lab.file})", lab_findings))
        print("\n".join(render(sections)))
    return 1 if any(f.status is Status.FAIL for f in every) else 0


def cmd_ls(args: argparse.Namespace) -> int:
    import json
    import time

    from vmlaunch.control import labs_up
    from vmlaunch.dirs import run_root

    labs = labs_up(run_root())
    if args.json:
        print(json.dumps({lab.name: lab.to_json() for lab in labs}, indent=2))
        return 0
    if not labs:
        log.info("no lab is up (run dir %s)", run_root())
        return 0
    print(f"{'LAB':<16} {'VMS':<24} {'SINCE':<19} SPEC")
    for lab in labs:
        vms = ", ".join(name if state == "running" else f"{name} ({state})"
                        for name, state in lab.vms.items())
        if len(vms) > 24:
            running = sum(state == "running" for state in lab.vms.values())
            vms = f"{running} of {len(lab.vms)} running"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lab.since))
        print(f"{lab.name:<16} {vms:<24} {since:<19} {lab.spec or '-'}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from vmlaunch import lastrun
    from vmlaunch.control import follow_log, follow_manager_log, is_up, read_log, read_manager_log

    if args.manager:
        if args.vm is not None or args.qemu:
            raise UsageError("--manager shows the lab manager's log: no VM and no --qemu with it")
        run_dir, _ = _lab_vm(args.spec)
        text, running = read_manager_log(run_dir)
        if not running:
            log.info("the lab manager of %s does not run: this is its last run's log", run_dir.lab)
        sys.stdout.write(text)
        if args.follow and running:
            for chunk in follow_manager_log(run_dir, len(text.encode())):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        return 0
    if args.vm is None:
        raise UsageError("name a VM, or --manager for the lab manager's log")
    run_dir, _ = _lab_vm(args.spec, args.vm)
    text = read_log(run_dir, args.vm, qemu_messages=args.qemu)
    if not is_up(run_dir, args.vm):
        kept = lastrun.path_of(run_dir.lab, args.vm, "qemu" if args.qemu else "serial")
        log.info("%s is not up: this is its last run's log (%s)", args.vm, kept)
    if not args.follow or args.qemu or not is_up(run_dir, args.vm):
        sys.stdout.write(text)
        return 0
    for chunk in follow_log(run_dir, args.vm):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from vmlaunch.control import attach_console

    run_dir, _ = _lab_vm(args.spec, args.vm)
    attach_console(run_dir, args.vm)
    return 0


def cmd_balloon(args: argparse.Namespace) -> int:
    from vmlaunch.control import PAGE, balloon
    from vmlaunch.units import bare_shown, format_size, parse_size, spelled

    run_dir, lab = _lab_vm(args.spec, args.vm)
    memory = lab.vm(args.vm).memory_mib << 20
    size = None
    if args.size is not None:
        try:
            size = parse_size(args.size)
        except ValueError as exc:
            raise UsageError(f"SIZE: {exc}") from None
        if not PAGE <= size <= memory:
            raise UsageError(f"SIZE: {bare_shown(args.size) or repr(args.size)} is not between 4K (a page) "
                             f"and the memory of {args.vm}, {spelled(memory)}")
    print(f"{args.vm}: {format_size(balloon(run_dir, args.vm, size, args.timeout, memory))}")
    return 0


# How QEMU's human monitor starts the text of a command that failed (`human-monitor-command` itself
# succeeds): an unknown command, and the errors its commands report.
HMP_FAILURES = ("unknown command:", "Error: ")


def cmd_qmp(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.control import qmp_command

    run_dir, _ = _lab_vm(args.spec, args.vm)
    try:
        arguments = json.loads(args.arguments) if args.arguments else {}
    except ValueError as exc:
        raise UsageError(f"JSON-ARGS is not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise UsageError("JSON-ARGS must be a JSON object, e.g. '{\"value\": 134217728}'")
    reply = qmp_command(run_dir, args.vm, args.command, arguments)
    if isinstance(reply, str):  # human-monitor-command answers with the monitor's text: print it
        text = reply.replace("\r\n", "\n")  # the monitor speaks to a terminal
        if text.startswith(HMP_FAILURES):  # QMP says success: the monitor's failure is only text
            from vmlaunch.textsafe import printable

            raise RuntimeFailure(f"{args.vm}: the monitor says: {printable(text.strip())}",
                                 "its command `help` lists the commands: vmlaunch qmp SPEC VM "
                                 "human-monitor-command '{\"command-line\": \"help\"}'")
        sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
        return 0
    print(json.dumps(reply, indent=2))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from vmlaunch import executor
    from vmlaunch.compiler import compile_lab
    from vmlaunch.host import detect_host
    from vmlaunch.resources.placement import where_running
    from vmlaunch.rundir import RunDir
    from vmlaunch.spec import load_lab

    lab = load_lab(args.spec, files=True, vms=args.vms)
    host = detect_host()
    from vmlaunch.confine import warn_if_off

    warn_if_off(host)
    plan = compile_lab(lab, host, args.vms,
                       running=where_running(RunDir.of(host.run_root, lab.name), host.numa))
    for note in plan.notes:
        log.info("note: %s", note)
    for vm in plan.vms:
        for note in vm.notes:
            log.info("note: %s", note)
    if args.dry_run:
        for line in executor.describe(plan):
            print(line)
        return 0
    from vmlaunch.shareaccess import require_xattrs

    require_xattrs(lab, [vm.name for vm in plan.vms])  # it writes a probe: not for --dry-run
    _log_accel(plan, args.verbose)
    from vmlaunch.journal import Journal

    before = executor.running_vms(Journal.load(plan.run_dir))
    if any(vm.name not in before for vm in plan.vms):  # the lab checks that warn, once, before starting
        from vmlaunch.doctor.run import lab_warnings, one_line

        for finding in lab_warnings(lab, host):
            log.warning("%s", one_line(finding))
    warm = None
    if args.from_snapshot is not None:
        from vmlaunch.snapshot import warm_start

        warm = warm_start(lab, [vm.name for vm in plan.vms], args.from_snapshot, qemu_img=host.qemu.img)
    pids = executor.up(plan, spec=str(lab.file), qemu_img=host.qemu.img, wait_for=args.wait_for,
                       timeout=args.timeout if args.timeout is not None else
                       executor.default_timeout(args.wait == "ssh"),
                       force=args.force, wait_ssh=args.wait == "ssh",
                       fresh=args.fresh, from_snapshot=warm)
    for vm in plan.vms:
        left = ", already: left alone" if before.get(vm.name) == pids[vm.name] else ""
        print(f"{vm.name}: running (pid {pids[vm.name]}, {vm.accel.accel.value}{left})")
    return 0


def _log_accel(plan: Plan, verbose: bool) -> None:
    """Each VM's accelerator, and why in full the first time each day on this host (and always with
    -v): `alpha, beta: tcg (KVM not usable: ...)`; else `alpha, beta: tcg`. `doctor` has the why."""
    if not log.isEnabledFor(logging.INFO):  # -q: nothing shown, so nothing counts as told
        return
    from vmlaunch.host import told_today

    told = told_today(sorted({vm.accel.reason for vm in plan.vms}))
    for line in plan.accel_lines(why=verbose or not told):
        log.info("%s", line)


def cmd_ssh(args: argparse.Namespace) -> int:
    import signal
    import subprocess

    from vmlaunch.control import ssh_argv_of

    run_dir, lab = _lab_vm(args.spec, args.vm)
    words = list(args.command)
    if words and words[0] == "--":
        words = words[1:]
    argv = ssh_argv_of(run_dir, lab, args.vm, words or None)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for ssh (and the guest)
    try:
        return subprocess.run(argv, check=False).returncode
    except OSError as exc:
        raise RuntimeFailure(f"cannot run {argv[0]}: {exc.strerror or exc}",
                             "install OpenSSH's client: apt-get install openssh-client") from None
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_pause(args: argparse.Namespace) -> int:
    from vmlaunch import control

    return _print_done(control.pause, args)


def cmd_resume(args: argparse.Namespace) -> int:
    from vmlaunch import control

    return _print_done(control.resume, args)


def _print_done(step: Callable[[RunDir, list[str], float], dict[str, str]], args: argparse.Namespace) -> int:
    run_dir, lab = _lab_vm(args.spec, *args.vms)
    names = [vm.name for vm in lab.select(args.vms)]
    for name, done in step(run_dir, names, args.timeout).items():
        print(f"{name}: {done}")
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    from vmlaunch import executor
    from vmlaunch.labdir import LabDir

    run_dir, lab = _lab_vm(args.spec, *args.vms)
    names = [vm.name for vm in lab.select(args.vms)]
    executor.reset(run_dir, LabDir.of(lab.file, lab.name), names)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from vmlaunch import executor
    from vmlaunch.dirs import run_root
    from vmlaunch.rundir import RunDir
    from vmlaunch.spec import lab_name

    run_dir = RunDir.of(run_root(), lab_name(args.spec))
    if args.vms:
        _lab_vm(args.spec, *args.vms)
    if not executor.down(run_dir, args.vms, timeout=args.timeout, force=args.force, spec=args.spec):
        print(f"lab {run_dir.lab} is not up")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from vmlaunch.model import BridgeNetwork
    from vmlaunch.spec import load_lab

    lab = load_lab(args.spec, files=True, up_refusals=True)
    nets = ", ".join(
        f"{net.name} (bridge {net.bridge})" if isinstance(net, BridgeNetwork)
        else f"{net.name} ({net.type.value})"
        for net in lab.networks
    )
    disks = sum(len(vm.disks) + (vm.image is not None) for vm in lab.vms)  # an image: its overlay
    print(f"{args.spec}: valid: lab {lab.name}: {_count(len(lab.vms), 'VM')} "
          f"({', '.join(vm.name for vm in lab.vms)}), {_count(len(lab.networks), 'network')}"
          f"{f' ({nets})' if nets else ''}, {_count(disks, 'disk')}")
    return 0


def cmd_cmdline(args: argparse.Namespace) -> int:
    import json
    import shlex

    from vmlaunch.compiler import compile_lab
    from vmlaunch.host import detect_host
    from vmlaunch.spec import load_lab

    lab = load_lab(args.spec, files=True, vms=args.vms)
    plan = compile_lab(lab, detect_host(), args.vms)
    for note in plan.notes:
        log.info("note: %s", note)
    _log_accel(plan, args.verbose)
    for vm in plan.vms:
        for note in vm.notes:
            log.info("note: %s", note)
    if args.json:
        print(json.dumps({vm.name: list(vm.argv) for vm in plan.vms}, indent=2))
        return 0
    for vm in plan.vms:
        if len(plan.vms) > 1:
            print(f"# {vm.name}")
        print(shlex.join(vm.argv))
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    from vmlaunch.completion import script, vm_names

    if args.vms is not None and args.shell is None:
        sys.stdout.writelines(f"{name}\n" for name in vm_names(args.vms))
        return 0
    if args.vms is not None or args.shell is None:
        raise UsageError("give either SHELL (bash or zsh) or --vms SPEC",
                         "e.g. `eval \"$(vmlaunch completion bash)\"` in ~/.bashrc")
    sys.stdout.write(script(args.shell, build_parser()))
    return 0


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


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
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is seen below
        sys.stderr.flush()
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
