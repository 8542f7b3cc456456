"""Run the checks and show what they found."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from vmlaunch.doctor.findings import Finding, Status
from vmlaunch.host.facts import Host
from vmlaunch.spec.model import LabSpec


def roots() -> tuple[Path, Path]:
    from vmlaunch.host.memory import proc_root
    from vmlaunch.host.pci import sysfs_root

    return sysfs_root(), proc_root()


def image_folders(lab: LabSpec | None) -> list[Path]:
    """Where guests' images live: the image cache, and the lab's folder and its disks' folders."""
    from vmlaunch.layout.dirs import cache_dir

    folders = [cache_dir()]
    if lab is not None:
        folders.append(lab.file.parent)
        folders += [disk.file.parent for vm in lab.vms for disk in vm.disks]
    found = []
    for folder in folders:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if folder not in found:
            found.append(folder)
    return found


def host_checks(host: Host | None, problem: str | None, lab: LabSpec | None = None) -> list[Finding]:
    from vmlaunch.doctor import host as checks
    from vmlaunch.doctor.strays import check_strays

    sysfs, proc = roots()
    found = list(checks.check_qemu(host, problem))
    if host is not None:
        found += [*checks.check_kvm(host, sysfs), *checks.check_vhost_net(host, sysfs),
                  *checks.check_io_uring(host, proc), *checks.check_hugepages(host, sysfs),
                  *checks.check_ksm(host, sysfs), *checks.check_numa(host)]
    folders = image_folders(lab)
    found += [*checks.check_iommu(sysfs, proc), *checks.check_thp(sysfs),
              *checks.check_io_scheduler(folders, sysfs), *checks.check_memory(),
              *checks.check_disk_space(folders), *check_strays(proc)]
    return found


def lab_checks(lab: LabSpec, host: Host, *, compile: bool = True) -> list[Finding]:
    from vmlaunch.doctor.lab import check_lab
    from vmlaunch.doctor.network import check_network

    sysfs, _ = roots()
    return [*check_network(lab, sysfs), *check_lab(lab, host, compile=compile)]


def doctor(lab: LabSpec | None) -> tuple[list[Finding], list[Finding]]:
    """(the host's findings, the lab's); the host as `detect_host` sees it, or a failing finding
    when it cannot (no QEMU)."""
    from vmlaunch.errors import HostError
    from vmlaunch.host.facts import detect_host

    host: Host | None
    try:
        host, problem = detect_host(), None
    except HostError as exc:
        host, problem = None, exc.message
    found_host = host_checks(host, problem, lab)
    found_lab = lab_checks(lab, host) if lab is not None and host is not None else []
    return found_host, found_lab


def lab_warnings(lab: LabSpec, host: Host) -> list[Finding]:
    """For `up`, once the lab compiled: the lab's checks that warn or fail."""
    return [finding for finding in lab_checks(lab, host, compile=False)
            if finding.status in (Status.WARN, Status.FAIL)]


def one_line(finding: Finding) -> str:
    """A finding as `up` shows it: what, where, and the fix."""
    where = f"{finding.where}: " if finding.where else ""
    fix = f" (fix: {finding.fix})" if finding.fix else ""
    return f"{finding.status.value} {finding.id}: {where}{finding.found}{fix}"


def render(sections: Sequence[tuple[str, Sequence[Finding]]], width: int = 100) -> list[str]:
    lines = []
    for title, findings in sections:
        if not findings:
            continue
        lines.append(title)
        for finding in findings:
            head = f"  {finding.status.value:<5} {finding.id:<18} "
            lines += textwrap.wrap(finding.found, width, initial_indent=head,
                                   subsequent_indent=" " * len(head)) or [head.rstrip()]
            pad = " " * len(head)
            if finding.status is not Status.OK:
                if finding.where:
                    lines.append(f"{pad}at:  {finding.where}")
                if finding.why:
                    lines += textwrap.wrap(finding.why, width, initial_indent=f"{pad}why: ",
                                           subsequent_indent=pad + "     ")
                if finding.fix:
                    lines += textwrap.wrap(finding.fix, width, initial_indent=f"{pad}fix: ",
                                           subsequent_indent=pad + "     ", break_on_hyphens=False)
    every = [finding for _, findings in sections for finding in findings]
    counts = {status: sum(1 for finding in every if finding.status is status) for status in Status}
    lines.append(f"{len(every)} checks: {counts[Status.OK]} ok, {counts[Status.NOTE]} notes, "
                 f"{counts[Status.WARN]} warnings, {counts[Status.FAIL]} failures")
    return lines
