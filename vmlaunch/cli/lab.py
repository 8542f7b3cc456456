"""The commands of a lab's life: `validate`, `cmdline`, `up`, `down`, `pause`, `resume`, `reset`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from vmlaunch.cli.common import (
    ONLY,
    Commands,
    add_spec,
    add_timeout,
    add_vms,
    command,
    count,
    lab_vm,
    vm_count,
)

if TYPE_CHECKING:
    from pathlib import Path

    from vmlaunch.compile.plan import Plan
    from vmlaunch.guests.kernels import KernelBoot
    from vmlaunch.layout.rundir import RunDir

log = logging.getLogger("vmlaunch")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    command(
        commands, "validate", cmd_validate, help="check a spec and print a one-line summary",
        description="Check a spec: structure (the JSON schema), references, sizes and clashes. "
        "Prints a one-line summary, or every problem as FILE:LINE: key.path: message.", spec=True)

    cmdline = command(
        commands, "cmdline", cmd_cmdline, help="print each VM's QEMU command line",
        description="Print the QEMU command line of each VM (or of the VMs named), one "
        "shell-quoted line per VM that can be pasted into a shell, or JSON with --json. "
        "Which accelerator was chosen, and why, goes to standard error, with notes: under TCG, which "
        "kernel boots (the bzImage, or the ELF `up` decompressed it to once) and why.", spec=True,
        vms=ONLY)
    cmdline.add_argument("--json", action="store_true", help='print {"VM": ["qemu-system-x86_64", ...], ...}')

    up = command(
        commands, "up", cmd_up, help="bring the lab (or the VMs named) up",
        description="Create what the lab needs on the host (images, bridges, taps, PCI bindings) and "
        "start every VM, in parallel; return when each runs and answers QMP. VMs already running are "
        "left alone. Any failure undoes everything this run did. A lab with [host.NAME] tables runs on "
        "those libvirt hosts instead, all or nothing (the manual's \"Across several hosts\").",
        spec=True, vms=ONLY)
    up.add_argument("--dry-run", action="store_true",
                    help="print the host actions and each QEMU command line; change nothing")
    up.add_argument("--wait-for", metavar="TEXT",
                    help="also wait until each VM's serial console has printed TEXT")
    add_timeout(up, "seconds to wait for the VMs (and for another up/down of the lab); "
                "default 60, 600 with --wait ssh", default=None)
    up.add_argument("--force", action="store_true",
                    help="take the lab over when it is up from another spec file with the same lab name")
    up.add_argument("--wait", metavar="WHAT", choices=("ssh",),
                    help="ssh: also wait until each VM with an SSH port answers SSH")
    up.add_argument("--fresh", action="store_true",
                    help="start the VMs afresh from their images: their overlays, seeds and UEFI "
                    "variables are made anew (what they wrote is lost; their SSH keys stay)")
    up.add_argument("--parallel", metavar="N", type=vm_count,
                    help="boot at most N VMs at once while waiting for them (--wait-for, --wait ssh); "
                    "the others wait paused for their turn (default: as many as this host's CPUs can "
                    "boot, or the lab's boot_parallel; `up --dry-run` shows it)")
    up.add_argument("--timeline", action="store_true",
                    help="then print where each VM's boot time went: QEMU's start, its wait for its turn, "
                    "firmware, kernel loader, kernel, userspace to the ready signal (and cloud-init's own "
                    "figure); `status --json` keeps them as `boot`")
    up.add_argument("--from-snapshot", metavar="NAME",
                    help="start the VMs, which must be down, from snapshot NAME (`vmlaunch snapshot`), "
                    "RAM included: they run on from that instant, without booting")

    for verb, run, description in (
            ("pause", cmd_pause, "Pause the VMs (QMP stop): the guests stop running until `vmlaunch "
             "resume`; a snapshot save or restore leaves a VM you paused paused."),
            ("resume", cmd_resume, "Resume VMs that are paused (QMP cont); for a VM a failed disk "
             "request paused (`status` says which), QEMU sends that request again. A VM an "
             "interrupted snapshot restore left paused is refused: its memory may be half loaded "
             "(restore the snapshot again, which resumes it).")):
        step = command(commands, verb, run, help=f"{verb} the lab's VMs (or those named)",
                       description=description)
        add_spec(step)
        add_vms(step)
        add_timeout(step, "seconds to wait for another vmlaunch of the lab; default 10", default=10.0)

    command(
        commands, "reset", cmd_reset, help="make VMs start afresh from their images at the next up",
        description="Remove the VMs' overlays, cloud-init seeds and UEFI variables (kept beside the "
        "spec in .vmlaunch/LAB/), so the next up boots them as new machines from their images. Their "
        "SSH keys stay. A VM that is up is refused.", spec=True, vms=ONLY)

    down = command(
        commands, "down", cmd_down, help="stop the lab (or the VMs named) and remove every trace of it",
        description="Stop each VM (ACPI power button, then QMP quit, then kill), then remove the taps, "
        "the bridges vmlaunch created, the PCI bindings and the run dir. Works after crashes; a second "
        "down does nothing. Disk images are kept.", spec=True, vms=ONLY)
    add_timeout(down, "seconds each guest gets to power off before it is stopped (0: stop it at once); "
                "default 10", default=10.0, zero_ok=True)
    down.add_argument("--force", action="store_true",
                      help="when the lab's journal cannot be read whole (damaged, or written by "
                      "another vmlaunch version), stop and remove everything it recognises and list "
                      "the rest; also take down a lab of this name that is up from another spec file")


def cmd_validate(args: argparse.Namespace) -> int:
    from vmlaunch.compile.preflight import load_checked
    from vmlaunch.spec.model import BridgeNetwork

    lab = load_checked(args.spec, up_refusals=True)
    locks = {image.lock for image in lab.images if image.catalog is not None and image.lock is not None}
    if locks:  # what `image pull` and `up` would refuse of a lock file, read without the network
        from vmlaunch.guests.catalog_images import read_lock

        for lock in locks:
            read_lock(lock)
    nets = ", ".join(
        f"{net.name} (bridge {net.bridge})" if isinstance(net, BridgeNetwork)
        else f"{net.name} ({net.type.value})"
        for net in lab.networks
    )
    disks = sum(len(vm.disks) + (vm.image is not None) for vm in lab.vms)  # an image: its overlay
    hosts = (f", {count(len(lab.hosts), 'libvirt host')} ({', '.join(host.name for host in lab.hosts)})"
             if lab.hosts else "")
    print(f"{args.spec}: valid: lab {lab.name}: {count(len(lab.vms), 'VM')} "
          f"({', '.join(vm.name for vm in lab.vms)}), {count(len(lab.networks), 'network')}"
          f"{f' ({nets})' if nets else ''}, {count(disks, 'disk')}{hosts}")
    return 0


def cmd_cmdline(args: argparse.Namespace) -> int:
    import json
    import shlex

    from vmlaunch.compile.compiler import compile_lab
    from vmlaunch.compile.preflight import load_checked
    from vmlaunch.guests.kernels import prepare
    from vmlaunch.host.facts import detect_host

    lab = load_checked(args.spec, vms=args.vms)
    if lab.hosts:
        from vmlaunch.cli import hosts

        return hosts.cmdline(args, lab)
    host = detect_host()
    # Writes nothing: a kernel not decompressed yet is said to be, and its bzImage is the command line
    kernels = told_kernels(prepare(lab, host, args.vms, build=False), args.verbose)
    plan = compile_lab(lab, host, args.vms, kernels=kernels)
    for note in plan.notes:
        log.info("note: %s", note)
    log_accel(plan, args.verbose)
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


def cmd_up(args: argparse.Namespace) -> int:
    from vmlaunch.compile.compiler import compile_lab
    from vmlaunch.compile.preflight import load_checked
    from vmlaunch.host.facts import detect_host
    from vmlaunch.lab.running import where_running
    from vmlaunch.layout.rundir import RunDir
    from vmlaunch.runtime import executor
    from vmlaunch.runtime.members import members

    spec_lab = load_checked(args.spec, vms=args.vms)
    if spec_lab.hosts:
        from vmlaunch.cli import hosts

        return hosts.up(args, spec_lab)
    # The lab's clones are its members (the lab manager goes on watching them), but `up` starts only
    # the spec's VMs: a clone is made by `fork`, never booted afresh.
    lab = members(spec_lab)
    only = list(args.vms) or [vm.name for vm in spec_lab.vms]
    host = detect_host()
    from vmlaunch.host.confine import warn_if_off

    warn_if_off(host)
    from vmlaunch.guests.kernels import prepare

    # a kernel is decompressed into the cache here, once (not with --dry-run, which changes nothing)
    kernels = told_kernels(prepare(lab, host, only, build=not args.dry_run), args.verbose)
    plan = compile_lab(lab, host, only, kernels=kernels,
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
    if any(vm.shares for vm in lab.vms):
        from vmlaunch.guests.shareaccess import require_xattrs

        require_xattrs(lab, [vm.name for vm in plan.vms])  # it writes a probe: not for --dry-run
    log_accel(plan, args.verbose)
    from vmlaunch.lab.journal import Journal
    from vmlaunch.lab.running import running_vms

    before = running_vms(Journal.load(plan.run_dir))
    if any(vm.name not in before for vm in plan.vms):  # the lab checks that warn, once, before starting
        from vmlaunch.doctor.run import lab_warnings, one_line

        for finding in lab_warnings(lab, host):
            log.warning("%s", one_line(finding))
    warm = None
    if args.from_snapshot is not None:
        from vmlaunch.saved.snapshot import warm_start

        warm = warm_start(lab, [vm.name for vm in plan.vms], args.from_snapshot, qemu_img=host.qemu.img)
    pids = executor.up(plan, spec=str(lab.file), qemu_img=host.qemu.img, wait_for=args.wait_for,
                       timeout=args.timeout if args.timeout is not None else
                       executor.default_timeout(args.wait == "ssh"),
                       force=args.force, wait_ssh=args.wait == "ssh",
                       fresh=args.fresh, from_snapshot=warm, parallel=args.parallel)
    for vm in plan.vms:
        left = ", already: left alone" if before.get(vm.name) == pids[vm.name] else ""
        print(f"{vm.name}: running (pid {pids[vm.name]}, {vm.accel.accel.value}{left})")
    if args.timeline:
        from vmlaunch.lab.timeline import render

        entries = Journal.load(plan.run_dir).vms
        started = [vm.name for vm in plan.vms if before.get(vm.name) != pids[vm.name]]
        print("\n".join(render({name: entries[name].boot or {} for name in started if name in entries},
                                started)))
    return 0


def told_kernels(kernels: dict[Path, KernelBoot], verbose: bool) -> dict[Path, KernelBoot]:
    """The kernels, each boot through PVH this host was told of before marked so (its note once per
    kernel, and with -v); with -q nothing is shown, so nothing counts as told."""
    if not log.isEnabledFor(logging.INFO):
        return kernels
    from vmlaunch.guests.kernels import told_once

    return told_once(kernels, verbose=verbose)


def log_accel(plan: Plan, verbose: bool) -> None:
    """Each VM's accelerator, and why in full the first time each day on this host (and always with
    -v): `alpha, beta: tcg (KVM not usable: ...)`; else `alpha, beta: tcg`. `doctor` has the why."""
    if not log.isEnabledFor(logging.INFO):  # -q: nothing shown, so nothing counts as told
        return
    from vmlaunch.host.facts import told_today

    told = told_today(sorted({vm.accel.reason for vm in plan.vms}))
    for line in plan.accel_lines(why=verbose or not told):
        log.info("%s", line)


def cmd_pause(args: argparse.Namespace) -> int:
    from vmlaunch.runtime import control

    return _print_done(control.pause, args)


def cmd_resume(args: argparse.Namespace) -> int:
    from vmlaunch.runtime import control

    return _print_done(control.resume, args)


def _print_done(step: Callable[[RunDir, list[str], float], dict[str, str]], args: argparse.Namespace) -> int:
    run_dir, lab = lab_vm(args.spec, *args.vms)
    names = [vm.name for vm in lab.select(args.vms)]
    for name, done in step(run_dir, names, args.timeout).items():
        print(f"{name}: {done}")
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    from vmlaunch.layout.labdir import LabDir
    from vmlaunch.runtime import executor

    run_dir, lab = lab_vm(args.spec, *args.vms)
    names = [vm.name for vm in lab.select(args.vms)]
    executor.reset(run_dir, LabDir.of(lab.file, lab.name), names)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from vmlaunch.layout.dirs import run_root
    from vmlaunch.layout.rundir import RunDir
    from vmlaunch.runtime import executor
    from vmlaunch.spec.load import lab_name

    run_dir = RunDir.of(run_root(), lab_name(args.spec))
    if args.vms:
        lab_vm(args.spec, *args.vms)
    went = executor.down(run_dir, args.vms, timeout=args.timeout, force=args.force, spec=args.spec)
    from vmlaunch.spec.throwaway import is_throwaway

    if is_throwaway(run_dir.lab) and not args.vms:  # a kept throwaway VM: its home goes too
        from vmlaunch.runtime.throwaway import forget

        forget(run_dir.path.parent, run_dir.lab)
    if not went:
        print(f"lab {run_dir.lab} is not up")
    return 0
