"""The commands that look at a lab that is up and drive its VMs: `ls`, `status`, `logs`, `console`,
`ssh`, `balloon`, `qmp`, `numa`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TextIO

from vmlaunch.cli.common import (
    Commands,
    add_json,
    add_timeout,
    add_vm,
    add_vms,
    command,
    lab_vm,
    say_other_spec,
)
from vmlaunch.errors import RuntimeFailure, UsageError

log = logging.getLogger("vmlaunch")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    command(commands, "ls", cmd_ls, help="list the labs that are up on this host",
                 description="The labs that are up on this host (in this user's run dir): "
                 "name, VMs (running or crashed), since when, and the spec file.",
                 json="print JSON keyed by lab name")

    command(commands, "status", cmd_status, help="show each VM: running, stopped or crashed",
                     description="Per VM: state, pid, accelerator, balloon size, uptime; "
                     "and each NIC: its MAC, network (bridge and tap, user network with "
                     "its forwarded ports, or socket group).", spec=True, json="print JSON keyed by VM name")

    logs = command(commands, "logs", cmd_logs, help="print a VM's serial console output, or the lab's events",
                   description="Print what the VM's serial console has printed; after "
                   "`down`, what it printed in its last run (kept in "
                   "/var/log/vmlaunch/LAB as root, else ~/.local/state/vmlaunch/logs/LAB). With "
                   "--events, the lab's event log: what QEMU reported of its VMs (an I/O error, a "
                   "pause, a panic, a reset) and what vmlaunch did to them at runtime (a disk fault), "
                   "one line each. On a terminal the guest's escape sequences and control characters "
                   "are left out; into a pipe or a file its output goes as it is.", spec=True)
    add_vms(logs, "the VM whose console output to print (none with --manager); with --events, only "
            "these VMs' events (default: all)")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing as it grows, until the VM stops (with --events, the lab "
                      "goes down) or Ctrl-C")
    logs.add_argument("--qemu", action="store_true",
                      help="QEMU's own messages (its standard error) instead of the console")
    logs.add_argument("--manager", action="store_true",
                      help="the lab manager's log (balloon decisions and their reasons) instead of a VM's")
    logs.add_argument("--events", action="store_true",
                      help="the lab's event log instead of a console: what happened to its VMs (I/O "
                      "errors, pauses, panics, resets, faults set), one line each")
    add_json(logs, "with --events: the event log's JSON lines as they are")

    console = command(commands, "console", cmd_console, help="attach to a VM's serial console",
                      description="Interactive serial console; Ctrl-] detaches and leaves the VM running.",
                      spec=True)
    add_vm(console, help="the VM whose console to attach to")

    ssh = command(commands, "ssh", cmd_ssh, help="log in to a VM over SSH, or run a command there",
                  description="Run OpenSSH with the lab's key, the VM's user and port and its pinned host "
                  "key. With -- CMD..., run CMD in the VM and exit with its status: as with OpenSSH's own "
                  "ssh, the words are joined by spaces and the guest's shell reads them, so a word that "
                  "holds spaces or quotes is quoted for that shell too: "
                  "-- \"grep -c 'model name' /proc/cpuinfo\".",
                  spec=True)
    add_vm(ssh, help="the VM to log in to")
    ssh.add_argument("command", metavar="CMD", nargs=argparse.REMAINDER,
                     help="-- and the command, text for the guest's shell, e.g. -- 'ls / | wc -l'")

    balloon = command(commands, "balloon", cmd_balloon, help="print or set a VM's balloon size",
                      description="Without SIZE, print the memory the guest has now. With "
                      "SIZE, set the balloon target and wait until the guest follows.", spec=True)
    add_vm(balloon, help="the VM whose balloon to print or set")
    balloon.add_argument("size", metavar="SIZE", nargs="?",
                         help="binary, as every size: 256M, 1G, 512MiB, or a bare number of MiB (512); "
                         "MB and GB are refused (10^6 or 2^20 bytes?)")
    add_timeout(balloon, "seconds the guest gets to follow; default 10", default=10.0)

    qmp = command(commands, "qmp", cmd_qmp, help="send a raw QMP command, print the JSON reply",
                  description="Send one QMP command to the VM and print its reply as JSON, "
                  "e.g. `vmlaunch qmp lab.toml alpha query-status`. A reply that is text "
                  "is printed as text: `vmlaunch qmp lab.toml alpha human-monitor-command "
                  "'{\"command-line\": \"info chardev\"}'`.", spec=True)
    add_vm(qmp, help="the VM to send the command to")
    qmp.add_argument("command", metavar="COMMAND", help="the QMP command, e.g. query-status")
    qmp.add_argument("arguments", metavar="JSON-ARGS", nargs="?", help='e.g. \'{"value": 134217728}\'')

    command(commands, "numa", cmd_numa, help="where each VM's memory is and where its vCPUs run",
                   description="Per VM: its memory per NUMA node (pages, MiB, percent, from "
                   "/proc/PID/numa_maps), the share on the node(s) it is placed on, and each "
                   "vCPU's last CPU and node; per node: CPUs, free memory, the lab's runnable "
                   "vCPUs now and the load the balancer saw last.",
                   spec=True, vms="only these VMs (default: all)", json="print JSON")


def cmd_ls(args: argparse.Namespace) -> int:
    import json
    import time

    from vmlaunch.layout.dirs import run_root
    from vmlaunch.runtime.control import labs_up
    from vmlaunch.spec.throwaway import homes

    if homes(run_root()).exists():  # the throwaway VMs of a vmlaunch that is gone are taken down first
        from vmlaunch.runtime.throwaway import sweep

        sweep(run_root())
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


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.core.textsafe import printable
    from vmlaunch.core.units import human_size
    from vmlaunch.runtime.control import status

    run_dir, lab = lab_vm(args.spec)
    if lab.hosts:
        from vmlaunch.cli import hosts

        return hosts.status(args, lab)
    rows = status(run_dir, [vm.name for vm in lab.vms], lab)
    say_other_spec(run_dir, args.spec)
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
        if row.forked_from:
            print(f"  a clone of {row.forked_from} (`vmlaunch fork`)")
        for nic in row.nics:
            print(f"  nic{nic.index} {nic.describe()}")
        for disk in row.disks:
            if disk.faults:
                from vmlaunch.spec.diskfault import describe, from_json

                said = "; ".join(describe(from_json(fault)) for fault in disk.faults)
                print(f"  {disk.name} fault: {said}")
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


def cmd_logs(args: argparse.Namespace) -> int:
    from vmlaunch.layout import lastrun
    from vmlaunch.runtime.control import follow_log, follow_manager_log, is_up, read_log, read_manager_log

    if args.events:
        if args.qemu or args.manager:
            raise UsageError("--events shows the lab's event log: no --qemu and no --manager with it")
        return _print_events(args)
    if args.json:
        raise UsageError("--json prints the event log's lines: it goes with --events")
    if args.manager:
        if args.vms or args.qemu:
            raise UsageError("--manager shows the lab manager's log: no VM and no --qemu with it")
        run_dir, _ = lab_vm(args.spec)
        text, running = read_manager_log(run_dir)
        if not running:
            log.info("the lab manager of %s does not run: this is its last run's log", run_dir.lab)
        sys.stdout.write(text)
        if args.follow and running:
            for chunk in follow_manager_log(run_dir, len(text.encode())):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        return 0
    if not args.vms:
        raise UsageError("name a VM, or --manager for the lab manager's log, or --events for the lab's "
                         "event log")
    if len(args.vms) > 1:
        raise UsageError(f"one VM's console at a time, not {', '.join(args.vms)}",
                         "--events takes several VMs")
    (vm,) = args.vms
    run_dir, lab = lab_vm(args.spec, vm)
    if lab.hosts:
        from vmlaunch.cli import hosts

        return hosts.logs(args, lab, vm)
    text = read_log(run_dir, vm, qemu_messages=args.qemu)
    if not is_up(run_dir, vm):
        kept = lastrun.path_of(run_dir.lab, vm, "qemu" if args.qemu else "serial")
        log.info("%s is not up: this is its last run's log (%s)", vm, kept)
    shown = _guest_text_for(sys.stdout)
    if not args.follow or args.qemu or not is_up(run_dir, vm):
        sys.stdout.write(shown(text))
        return 0
    for chunk in follow_log(run_dir, vm):
        sys.stdout.write(shown(chunk))
        sys.stdout.flush()
    return 0


def _guest_text_for(stream: TextIO) -> Callable[[str], str]:
    """What a guest printed, as `stream` may get it: on a terminal without escape sequences and control
    characters (the guest is not the user's terminal's to drive), untouched into a pipe or a file."""
    from vmlaunch.core.textsafe import for_terminal

    return for_terminal if stream.isatty() else str


def _print_events(args: argparse.Namespace) -> int:
    """`logs --events`: the lab's event log, of the run that is up or else of the last one."""
    import json

    from vmlaunch.lab.events import Event, render
    from vmlaunch.layout import lastrun
    from vmlaunch.runtime.control import follow_events, lab_is_up, read_events

    run_dir, _ = lab_vm(args.spec, *args.vms)

    def show(events: list[Event]) -> None:
        for event in events:
            print(json.dumps(event.to_json(), separators=(",", ":")) if args.json else render(event))
        sys.stdout.flush()

    if args.follow and lab_is_up(run_dir):
        for events in follow_events(run_dir, args.vms):
            show(events)
        return 0
    events, up = read_events(run_dir, args.vms)
    if not up:
        log.info("lab %s is not up: these are its last run's events (%s)", run_dir.lab,
                 lastrun.events_path(run_dir.lab))
    if not events:
        log.info("no event logged%s", f" of {', '.join(args.vms)}" if args.vms else "")
    show(events)
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from vmlaunch.runtime.control import attach_console

    run_dir, lab = lab_vm(args.spec, args.vm)
    if lab.hosts:
        from vmlaunch.cli import hosts

        return hosts.console(args, lab)
    attach_console(run_dir, args.vm)
    return 0


def cmd_ssh(args: argparse.Namespace) -> int:
    import signal
    import subprocess

    from vmlaunch.lab.running import ssh_argv_of

    run_dir, lab = lab_vm(args.spec, args.vm)
    words = list(args.command)
    if words and words[0] == "--":
        words = words[1:]
    # as OpenSSH's own command line: the words joined by spaces are the guest's shell's text
    command = " ".join(words) if words else None
    if command is not None and not command.strip():
        raise UsageError("the command after -- is empty", "leave out -- for a login shell")
    if lab.hosts:
        from vmlaunch.multihost.vms import ssh_argv

        argv = ssh_argv(lab, args.vm, command)
    else:
        argv = ssh_argv_of(run_dir, lab, args.vm, command)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for ssh (and the guest)
    try:
        return subprocess.run(argv, check=False).returncode
    except OSError as exc:
        raise RuntimeFailure(f"cannot run {argv[0]}: {exc.strerror or exc}",
                             "install OpenSSH's client: apt-get install openssh-client") from None
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_balloon(args: argparse.Namespace) -> int:
    from vmlaunch.core.units import bare_shown, format_size, parse_size, spelled
    from vmlaunch.runtime.control import PAGE, balloon

    run_dir, lab = lab_vm(args.spec, args.vm)
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
    if lab.hosts:
        from vmlaunch.multihost import vms

        print(f"{args.vm}: {format_size(vms.balloon(lab, args.vm, size))}")
        return 0
    print(f"{args.vm}: {format_size(balloon(run_dir, args.vm, size, args.timeout, memory))}")
    return 0


# How QEMU's human monitor starts the text of a command that failed (`human-monitor-command` itself
# succeeds): an unknown command, and the errors its commands report.
HMP_FAILURES = ("unknown command:", "Error: ")


def cmd_qmp(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.runtime.control import qmp_command

    run_dir, _ = lab_vm(args.spec, args.vm)
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
            from vmlaunch.core.textsafe import printable

            raise RuntimeFailure(f"{args.vm}: the monitor says: {printable(text.strip())}",
                                 "its command `help` lists the commands: vmlaunch qmp SPEC VM "
                                 "human-monitor-command '{\"command-line\": \"help\"}'")
        sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
        return 0
    print(json.dumps(reply, indent=2))
    return 0


def cmd_numa(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.runtime.numareport import render, report

    run_dir, lab = lab_vm(args.spec, *args.vms)
    result = report(run_dir, [vm.name for vm in lab.select(args.vms)])
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print("\n".join(render(result)))
    return 0
