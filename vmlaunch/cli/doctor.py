"""`vmlaunch doctor [SPEC]`: this host, and a lab, checked against the best practices (`doctor/`)."""

from __future__ import annotations

import argparse

from vmlaunch.cli.common import Commands, add_json, command


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    doctor = command(commands, "doctor", cmd_doctor,
                     help="check this host, and a lab, against the best practices",
                     description="Check the host (KVM, vhost-net, io_uring, IOMMU, hugepages, "
                     "KSM, NUMA, THP, the I/O scheduler behind the image folders, memory and "
                     "disk space) and, with SPEC, its bridges and uplinks and the lab itself "
                     "(memory and vCPU over-commit, disk space for sparse images, partition "
                     "alignment, O_DIRECT, cache modes, PCI, hugepages with KSM). Each check: "
                     "ok, note, warn or fail, what was found, why it matters and the fix. "
                     "Exit 0 when nothing fails, 1 when something does.")
    doctor.add_argument("spec", metavar="SPEC", nargs="?", help="a lab's TOML file (default: the host only)")
    add_json(doctor, "print JSON for tools")


def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from vmlaunch.doctor.findings import Finding, Status
    from vmlaunch.doctor.run import doctor, render

    lab = None
    if args.spec is not None:
        from vmlaunch.spec.load import load_lab

        lab = load_lab(args.spec)
    hosts: list[tuple[str, list[Finding]]] = []
    if lab is not None and lab.hosts:  # its VMs run on its libvirt hosts: each is checked
        from vmlaunch.multihost.doctor import checks

        hosts = checks(lab)
        host_findings, lab_findings = doctor(None)
    else:
        host_findings, lab_findings = doctor(lab)
    every = [*host_findings, *lab_findings, *(f for _, found in hosts for f in found)]
    if args.json:
        print(json.dumps({"host": [f.to_json() for f in host_findings],
                          "lab": [f.to_json() for f in lab_findings] if lab is not None else None,
                          "hosts": {title.split()[2]: [f.to_json() for f in found] for title, found in hosts},
                          "failed": any(f.status is Status.FAIL for f in every)}, indent=2))
    else:
        sections = [("host", host_findings)]
        if lab is not None and not lab.hosts:
            sections.append((f"lab {lab.name} ({lab.file})", lab_findings))
        sections += hosts
        print("\n".join(render(sections)))
    return 1 if any(f.status is Status.FAIL for f in every) else 0
