"""The commands for a VM's screen and keyboard, and the evidence of a lab: `screenshot`, `send-keys`,
`evidence`."""

from __future__ import annotations

import argparse
import logging

from vmlaunch.cli.common import Commands, add_vm, command, lab_vm

log = logging.getLogger("vmlaunch")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    shot = command(commands, "screenshot", cmd_screenshot, help="save a VM's screen as a PNG",
                   description="Save what the VM's screen shows (its display device: `video` in the "
                   "spec, VGA by default) as a PNG, through QMP screendump, and print its path. The "
                   "file is written by vmlaunch, as you, and replaced atomically.", spec=True)
    add_vm(shot, help="the VM whose screen to save")
    shot.add_argument("file", metavar="FILE", nargs="?",
                      help="the PNG to write (default: VM-YYYYMMDD-HHMMSS.png in the working directory)")

    keys = command(commands, "send-keys", cmd_send_keys, help="press keys on a VM's keyboard",
                   description="Press each KEYS combination in turn, as QMP send-key: QEMU's key names "
                   "(qcodes: ctrl, alt, shift, delete, ret, esc, tab, spc, a-z, 0-9, f1-f12, up, pgdn, "
                   "kp_add, ...) or aliases (enter, space, del, super), joined by - to be pressed "
                   "together: `vmlaunch send-keys lab.toml alpha ctrl-alt-delete`. --text types text "
                   "after them on a US keyboard layout (shift for capitals and symbols).", spec=True)
    add_vm(keys, help="the VM whose keyboard to use")
    keys.add_argument("keys", metavar="KEYS", nargs="*", default=[],
                      help="key combinations, e.g. ctrl-alt-delete alt-f2 ret")
    keys.add_argument("--text", metavar="TEXT", help="text to type after the keys, e.g. 'root\\n' "
                      "(a real newline; in a shell: --text $'root\\n')")
    keys.add_argument("--hold", metavar="MS", type=_milliseconds,
                      help="how long each combination is held down (default: QEMU's 100 ms)")

    collect = command(commands, "evidence", cmd_evidence, help="save the evidence of a lab into a folder",
                      description="Save what says what the lab's VMs did into DIR: each VM's console log, "
                      "QEMU's logs and a screenshot, status --json, the faults set on the wire, the lab "
                      "manager's log, the lab's event log; DIR/README.txt lists what was saved and what "
                      "could not be. After `down`, the logs of the last run.", spec=True)
    collect.add_argument("dir", metavar="DIR", help="the folder to save into (made when missing)")
    collect.add_argument("--no-screenshots", action="store_true", help="save no screenshots")


def _milliseconds(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 60_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds from 1 to 60000")
    return int(text)


def cmd_screenshot(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from vmlaunch.compile.compiler import video_of
    from vmlaunch.rig import screen
    from vmlaunch.spec.model import Video

    run_dir, lab = lab_vm(args.spec, args.vm)
    if video_of(lab, lab.vm(args.vm)) is Video.NONE:
        raise screen.no_screen(args.vm)
    file = Path(args.file) if args.file else Path(f"{args.vm}-{time.strftime('%Y%m%d-%H%M%S')}.png")
    print(screen.screenshot(run_dir, args.vm, file))
    return 0


def cmd_send_keys(args: argparse.Namespace) -> int:
    from vmlaunch.rig import screen

    run_dir, _ = lab_vm(args.spec, args.vm)
    sent = screen.send_keys(run_dir, args.vm, screen.keys_to_send(args.keys, args.text), args.hold)
    log.info("%s: sent %d key combination%s", args.vm, sent, "" if sent == 1 else "s")
    return 0


def cmd_evidence(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vmlaunch.runtime.evidence import collect

    run_dir, lab = lab_vm(args.spec)
    evidence = collect(run_dir, lab, [vm.name for vm in lab.vms], Path(args.dir),
                       screenshots=not args.no_screenshots)
    for line in evidence.missing:  # README.txt in DIR lists them too
        if line in evidence.unsaved:
            log.warning("not saved: %s", line)
        else:
            log.debug("not saved: %s", line)
    print(evidence.folder)
    return 0
