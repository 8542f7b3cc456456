"""`vmlaunch run`: a throwaway VM for one command (`runtime/throwaway.py`), and `vmlaunch template`, the
warm templates it starts from (`saved/template.py`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vmlaunch.cli.common import Commands, add_json, command, seconds
from vmlaunch.errors import UsageError

if TYPE_CHECKING:
    from vmlaunch.host.facts import Host
    from vmlaunch.spec.model import LabSpec
    from vmlaunch.spec.throwaway import ExtraShare

log = logging.getLogger("vmlaunch")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    run = command(
        commands, "run", cmd_run, help="run a command in a throwaway VM: a fresh VM, then nothing left",
        description="Make a fresh VM from VM's definition in SPEC (never its running instance: the lab "
        "may be up, and is left alone), run CMD in it through the command channel, and take it down "
        "with everything it made. CMD's standard output and standard error come out apart, and "
        "vmlaunch exits with its status. The VM's NICs are on networks of its own (a user network "
        "without its port forwards; a bridge, tap or socket network as a socket network no one else "
        "joins), its writable disks are copies. With --kernel instead of SPEC VM, the kernel boots with "
        "vmlaunch's own small initramfs (or --initrd), the current folder shared at the same path and CMD "
        "run there. Exit 124: CMD outlived --timeout; exit 6: the guest panicked (its panic line is "
        "said); exit 5: the command channel failed.")
    run.add_argument("spec", metavar="SPEC", nargs="?", help="the lab's TOML file (not with --kernel)")
    run.add_argument("vm", metavar="VM", nargs="?", help="the VM whose definition the throwaway VM takes")
    run.add_argument("command", metavar="CMD", nargs=argparse.REMAINDER,
                     help="-- and the command: one word is run by the guest's shell, several arrive as "
                     "those words")
    run.add_argument("--timeout", metavar="S", type=seconds(False), default=None,
                     help="seconds CMD may run (exit 124 after, the VM gone); default: no limit")
    run.add_argument("--wait", metavar="S", type=seconds(False), default=300.0,
                     help="seconds the guest gets to boot and answer; default 300")
    run.add_argument("--wait-for", metavar="TEXT",
                     help="the guest is ready once its console shows TEXT (then its agent answers); a "
                     "template is made at that point")
    run.add_argument("-i", "--stdin", action="store_true",
                     help="pass vmlaunch's standard input to CMD (read to its end first)")
    run.add_argument("--keep", action="store_true",
                     help="when CMD fails (or the run does), keep the VM and say how to reach it")
    how = run.add_mutually_exclusive_group()
    how.add_argument("--cold", action="store_true", help="always boot, even where a template is")
    how.add_argument("--warm", action="store_true",
                     help="start from the VM's template, made now when there is none (a spec's "
                     "`template = true` does the same)")
    run.add_argument("--share", metavar="DIR[:TARGET][:ro]", action="append", default=[],
                     help="a host folder mounted in the guest at TARGET (default: its own path), read-only "
                     "with :ro; under the rules of a spec's shares. May be given again")
    kernel = run.add_argument_group("a kernel alone (instead of SPEC VM)")
    kernel.add_argument("--kernel", metavar="PATH", help="the kernel to boot (a bzImage)")
    kernel.add_argument("--initrd", metavar="PATH", help="its initramfs; default: vmlaunch's own (busybox "
                        "and the agent, with the modules the boot needs)")
    kernel.add_argument("--modules", metavar="DIR", help="where its modules are: a kernel build tree or a "
                        "/lib/modules/VERSION folder; default /lib/modules/ of its version")
    kernel.add_argument("--append", metavar="ARGS", default="", help="more kernel arguments")
    kernel.add_argument("--memory", metavar="SIZE", default="512M", help="its memory; default 512M")
    kernel.add_argument("--cpus", metavar="N", type=int, default=1, help="its CPUs; default 1")
    kernel.add_argument("--rw", action="store_true", help="share the current folder writable (default "
                        "read-only)")

    tpl = command(commands, "template", cmd_template,
                  help="list or remove the warm templates `run` starts from",
                  description="`vmlaunch run --warm` (or a VM's `template = true`) boots a VM once to its "
                  "ready point and saves it as a template in the cache dir; each run then wakes a copy. "
                  "ls: the templates with their sizes; rm KEY...: remove those; prune: remove those whose "
                  "inputs changed or that are damaged (`--all`: every one).")
    tpl.add_argument("action", metavar="ACTION", choices=("ls", "rm", "prune"), help="ls, rm or prune")
    tpl.add_argument("keys", metavar="KEY", nargs="*", default=[], help="templates to remove (rm)")
    tpl.add_argument("--all", action="store_true", help="prune: every template")
    add_json(tpl, "ls: print JSON")


def cmd_run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    import attrs

    from vmlaunch.errors import CommandTimedOut
    from vmlaunch.spec.throwaway import parse_share

    words = list(args.command or [])
    if words and words[0] == "--":
        words = words[1:]
    if args.kernel is None and args.spec is not None and args.vm is None:
        raise UsageError("run: no VM named", "vmlaunch run SPEC VM -- CMD, or run --kernel PATH -- CMD")
    if not words:
        raise UsageError("run: no command given", "put it after --: vmlaunch run SPEC VM -- CMD...")
    cwd = Path.cwd()
    shares = [parse_share(text, cwd) for text in args.share]
    data = sys.stdin.buffer.read() if args.stdin else None
    cmd: str | list[str] = words[0] if len(words) == 1 else words
    from vmlaunch.host.facts import detect_host
    from vmlaunch.runtime import throwaway

    host = detect_host()
    options = throwaway.Options(timeout=args.timeout, wait=args.wait, input=data, keep=args.keep,
                                cold=args.cold, warm=args.warm, wait_for=args.wait_for)
    if args.kernel is not None:
        if args.spec is not None:
            raise UsageError("run: --kernel takes no SPEC or VM", "vmlaunch run --kernel PATH -- CMD")
        lab, vm, recipe = _kernel_lab(args, shares, cwd, host)
        options = attrs.evolve(options, shares=(), cwd=str(cwd))
        spec = str(Path(args.kernel).absolute())
        wants = False
    else:
        for flag in ("initrd", "modules", "rw"):
            if getattr(args, flag):
                raise UsageError(f"run: --{flag} goes with --kernel", "vmlaunch run --kernel PATH "
                                 f"--{flag} ... -- CMD")
        if args.spec is None:
            raise UsageError("run: give SPEC VM, or --kernel PATH", "vmlaunch run SPEC VM -- CMD")
        from vmlaunch.compile.preflight import load_checked

        lab = load_checked(args.spec, vms=[args.vm])
        lab.select([args.vm])
        vm = args.vm
        recipe = None
        options = attrs.evolve(options, shares=tuple(shares))
        spec = os.path.realpath(args.spec)
        wants = lab.vm(vm).template
    out = sys.stdout.buffer
    sys.stdout.flush()
    try:
        outcome = throwaway.run(lab, vm, cmd, options, host, stdout=out, stderr=sys.stderr.buffer,
                                spec=spec, kernel=recipe, wants_template=wants)
    except CommandTimedOut as timed_out:
        partial = timed_out.result  # type: ignore[attr-defined]
        sys.stderr.buffer.write(partial.stderr)
        raise
    out.flush()
    steps = ", ".join(f"{step} {at:.3f} s" for step, at in outcome.timings.items())
    log.debug("run %s: %s", outcome.name, steps)
    if outcome.result.truncated:
        print("vmlaunch: the output was cut: the command wrote more than 64 MiB on one stream; the rest "
              "was dropped", file=sys.stderr)
    if outcome.kept:
        _say_kept(outcome.name, outcome.vm)
    code = outcome.exit_code
    return code if 0 <= code <= 255 else 255


def _say_kept(name: str, vm: str) -> None:
    log.warning("kept the throwaway VM %s (lab %s): `vmlaunch exec %s %s -- sh -c '...'`, `vmlaunch "
                "console %s %s`, `vmlaunch logs %s`; take it down with `vmlaunch down %s`",
                vm, name, name, vm, name, vm, name, name)


def _kernel_lab(args: argparse.Namespace, shares: list[ExtraShare], here: Path, host: Host
                ) -> tuple[LabSpec, str, dict[str, Any]]:
    from vmlaunch.core.units import parse_size
    from vmlaunch.guests import initramfs
    from vmlaunch.runtime.throwaway import homes
    from vmlaunch.spec.throwaway import ExtraShare, kernel_lab, new_name

    kernel = Path(args.kernel).absolute()
    if not kernel.is_file():
        raise UsageError(f"--kernel {args.kernel}: no such file", "give the kernel's bzImage "
                         "(arch/x86/boot/bzImage of a build tree, or /boot/vmlinuz-VERSION)")
    try:
        memory = int(parse_size(args.memory)) >> 20
    except (ValueError, TypeError):
        raise UsageError(f"--memory {args.memory!r} is not a size", "give one like 512M or 2G") from None
    if not 64 <= memory <= 1 << 20:
        raise UsageError(f"--memory {args.memory}: from 64M to 1T")
    if not 1 <= args.cpus <= 256:
        raise UsageError(f"--cpus {args.cpus}: from 1 to 256")
    initramfs.kernel_release(kernel)  # a file that is no kernel is refused here
    if args.initrd is not None:
        initrd = Path(args.initrd).absolute()
        if not initrd.is_file():
            raise UsageError(f"--initrd {args.initrd}: no such file")
    else:
        initrd = initramfs.build(kernel, Path(args.modules).absolute() if args.modules else None)
    folder = ExtraShare(here, str(here), readonly=not args.rw)
    name = new_name()
    lab = kernel_lab(kernel, initrd, f"console=ttyS0 {args.append}".strip(), memory, args.cpus, name,
                     homes(host.run_root) / name, [folder, *shares])
    recipe = {"kernel": str(kernel), "initrd": str(initrd), "append": args.append, "memory": memory,
              "cpus": args.cpus, "shares": [[str(s.source), s.target, s.readonly] for s in [folder, *shares]]}
    return lab, "vm", recipe


def cmd_template(args: argparse.Namespace) -> int:
    import json
    import time

    from vmlaunch.core.units import human_size
    from vmlaunch.saved import template

    if args.action == "ls":
        listed = template.listing()
        if args.json:
            print(json.dumps([each.to_json() for each in listed], indent=2))
            return 0
        if not listed:
            log.info("no template (in %s)", template.store(create=False))
            return 0
        print(f"{'KEY':<26} {'VM':<12} {'SIZE':>9}  {'LAST USED':<19} SPEC")
        for each in listed:
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(each.used)) if each.used else "-"
            state = "" if each.state == "ok" else f"  ({each.state})"
            print(f"{each.key:<26} {each.vm:<12} {human_size(each.size):>9}  {used:<19} {each.spec}{state}")
        return 0
    if args.action == "rm":
        if not args.keys:
            raise UsageError("template rm: name the templates to remove",
                             "`vmlaunch template ls` lists them")
        known = {each.key: each for each in template.listing()}
        for key in args.keys:
            if key not in known:
                raise UsageError(f"template rm: no template {key!r}", "`vmlaunch template ls` lists them")
        for key in args.keys:
            template.remove(template.store() / key)
            print(f"removed {key} ({human_size(known[key].size)})")
        return 0
    from vmlaunch.host.facts import detect_host
    from vmlaunch.runtime.throwaway import prune_templates

    gone = prune_templates(detect_host(), every=args.all)
    for key, size, why in gone:
        print(f"removed {key} ({human_size(size)}): {why}")
    if not gone:
        log.info("nothing to prune")
    return 0
