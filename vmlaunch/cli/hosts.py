"""The lab commands of a lab on libvirt hosts (`[host.NAME]`): each command of cli/lab.py and cli/vms.py
hands such a lab over to the function here of its name. The work is multihost/'s."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from vmlaunch.errors import UsageError
from vmlaunch.spec.model import LabSpec

log = logging.getLogger(__name__)

# `up` options of a lab of vmlaunch's own QEMUs that a lab on libvirt hosts has no use for
LOCAL_UP_OPTIONS = (
    ("wait_for", "--wait-for"),
    ("wait", "--wait"),
    ("fresh", "--fresh"),
    ("parallel", "--parallel"),
    ("timeline", "--timeline"),
    ("from_snapshot", "--from-snapshot"),
)


def refuse_options(args: argparse.Namespace, options: tuple[tuple[str, str], ...], what: str) -> None:
    given = [flag for key, flag in options if getattr(args, key, None)]
    if given:
        raise UsageError(f"{', '.join(given)}: not for a lab on libvirt hosts ({what})")


def up(args: argparse.Namespace, lab: LabSpec) -> int:
    from vmlaunch.multihost import engine

    refuse_options(args, LOCAL_UP_OPTIONS, "its VMs are libvirt domains")
    if args.vms:
        raise UsageError("a lab on libvirt hosts comes up whole: name no VMs", f"vmlaunch up {args.spec}")
    plan = engine.up(
        lab,
        spec=args.spec,
        timeout=args.timeout if args.timeout is not None else 60.0,
        dry_run=args.dry_run,
        force=args.force,
    )
    if args.dry_run:
        for line in engine.describe(plan):
            print(line)
        return 0
    for host in plan.hosts:
        for dom in host.domains:
            print(f"{dom.vm}: running on host {host.host} ({plan.placed_by[dom.vm]}), domain {dom.name}")
    return 0


def cmdline(args: argparse.Namespace, lab: LabSpec) -> int:
    """The plan, and each domain's XML (the QEMU command line is the host's libvirt's to write)."""
    import json

    from vmlaunch.multihost import engine

    plan = engine.up(lab, spec=args.spec, dry_run=True)
    said_findings(plan)
    only = set(args.vms)
    domains = {
        dom.vm: (host.host, dom.xml)
        for host in plan.hosts
        for dom in host.domains
        if not only or dom.vm in only
    }
    if args.json:
        print(
            json.dumps(
                {vm: {"host": host, "domain_xml": xml} for vm, (host, xml) in domains.items()}, indent=2
            )
        )
        return 0
    for line in engine.describe(plan):
        log.info("%s", line)
    for vm, (host, xml) in domains.items():
        print(f"<!-- {vm}: on host {host} -->")
        print(xml, end="")
    return 0


def status(args: argparse.Namespace, lab: LabSpec) -> int:
    import json

    from vmlaunch.core.units import human_size
    from vmlaunch.multihost import vms

    rows = vms.status(lab)
    if args.json:
        print(json.dumps({row.name: row.to_json() for row in rows}, indent=2))
        return 0

    def size(value: int | None) -> str:
        return human_size(value) if value is not None else "-"

    print(f"{'VM':<16} {'STATE':<8} {'HOST':<16} {'MEMORY':>8} {'BALLOON':>8}  DOMAIN")
    for row in rows:
        print(
            f"{row.name:<16} {row.state:<8} {row.host or '-':<16} {size(row.memory):>8} "
            f"{size(row.balloon):>8}  {row.domain or '-'}"
        )
        if row.why:
            print(f"  {row.why}")
    return 0


def logs(args: argparse.Namespace, lab: LabSpec, vm: str) -> int:
    import sys

    from vmlaunch.multihost import vms

    refuse_options(args, (("qemu", "--qemu"), ("follow", "--follow")), "its log is read on its host")
    sys.stdout.write(vms.serial_log(lab, vm))
    return 0


def console(args: argparse.Namespace, lab: LabSpec) -> int:
    """libvirt's own console client, to the VM's host: Ctrl-] leaves it."""
    import subprocess

    from vmlaunch.errors import RuntimeFailure
    from vmlaunch.multihost import vms

    argv = vms.console_argv(lab, args.vm)
    log.info("%s: its serial console on its host (Ctrl-] leaves)", args.vm)
    try:
        return subprocess.run(argv, check=False).returncode
    except OSError as exc:
        raise RuntimeFailure(
            f"cannot run {argv[0]}: {exc.strerror or exc}",
            "install libvirt's clients: apt-get install libvirt-clients",
        ) from None


def said_findings(plan: Any) -> None:
    """What of the spec the domains cannot carry (the export's findings), once each."""
    seen = set()
    for host in plan.hosts:
        for line in host.findings:
            if "memory.budget" in line or line in seen:  # on hosts the budget is placement's, per host
                continue
            seen.add(line)
            log.warning("not on libvirt hosts: %s", line)
