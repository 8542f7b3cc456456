"""What `down --force` takes down of a lab whose journal cannot be read (truncated, damaged, of another
version): everything that can be found without the journal.

- the lab's QEMUs: by the run dir's pidfiles and, for one whose files are gone, by their command line
  (the QMP socket path in the run dir, unique per lab and VM: `qemu.is_our_qemu`); each stopped as
  `down` stops any VM (power button, QMP quit, kill);
- its lab manager: the process running `vmlaunch.manager RUN_DIR`;
- its taps and the IFBs of their netem: the links whose mark (ifalias) names the lab;
- its bridges and its KSM claim: through the host-wide registries, as for an `up` killed before it
  journaled them (`resources/registry.py`);
- its placed VMs' cpuset cgroups (`vmlaunch.LAB.VM`);
- its partition's nftables table (`vmlaunch-LAB`), by its name.

What is still there afterwards is returned, a running QEMU first, so `down --force` can say it and
exit non-zero rather than report a lab down that is not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection
from pathlib import Path

from vmlaunch.errors import VmlaunchError
from vmlaunch.lab import process as qemu
from vmlaunch.layout.rundir import RunDir, vm_of_file
from vmlaunch.qemu.opts import escape

log = logging.getLogger(__name__)

MANAGER_STOP = 5.0  # seconds the lab manager gets to stop after SIGTERM, as `down` gives it


def vm_names(run_dir: RunDir) -> set[str]:
    """The VMs whose files (pidfile, sockets, logs) are in the run dir."""
    return {name for entry in _entries(run_dir.path) if (name := vm_of_file(entry.name)) is not None}


def running_qemus(run_dir: RunDir, skip: Collection[str] = ()) -> dict[str, int]:
    """VM name -> pid of every QEMU serving a QMP socket in the run dir, but those of `skip`."""
    found: dict[str, int] = {}
    for name in sorted(vm_names(run_dir) - set(skip)):
        pid = qemu.find_pid(run_dir.vm(name))
        if pid is not None:
            found[name] = pid
    prefix = f"path={escape(str(run_dir.path))}/".encode()
    for pid, words in _processes():
        cmdline = words.replace(b"\0", b" ")
        at = cmdline.find(prefix)
        if at < 0 or b"qemu" not in cmdline:
            continue
        file = cmdline[at + len(prefix):].split(b",", 1)[0].decode(errors="replace")
        vm = vm_of_file(file) if "/" not in file else None
        if vm is None or vm in skip or vm in found:
            continue
        if qemu.is_our_qemu(pid, run_dir.vm(vm)):  # its QMP socket: the one of VM `vm`
            found[vm] = pid
    return found


def manager_pids(run_dir: RunDir) -> list[int]:
    """The lab manager processes of this run dir (`python -m vmlaunch.manager.managerd RUN_DIR ...`, or
    `vmlaunch.manager.manager` run by hand or by an earlier version)."""
    modules = {b"vmlaunch.manager.managerd", b"vmlaunch.manager.manager"}
    path = os.fsencode(run_dir.path)
    return [pid for pid, cmdline in _processes()
            if path in cmdline.split(b"\0") and modules & set(cmdline.split(b"\0"))]


def stop_managers(run_dir: RunDir) -> None:
    for pid in manager_pids(run_dir):
        log.info("lab manager (pid %d): stopped (found by its command line)", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + MANAGER_STOP
    while manager_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in manager_pids(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def remove_marked_taps(lab: str) -> list[str]:
    """Delete the taps marked as the lab's that no process holds open (their QEMU is gone), and the IFBs
    of their netem; returns what could not be done."""
    from vmlaunch.host.links import IFB_KIND, TUN_KIND, LinkError, netlink

    problems = []
    try:
        with netlink("(every interface)") as nl:
            for link in nl.links("(every interface)", "listing interfaces"):
                if link.kind in (TUN_KIND, IFB_KIND) and link.lab == lab:
                    try:
                        nl.delete(link)
                        what = "tap" if link.kind == TUN_KIND else "IFB (netem)"
                        log.info("%s %s: removed (marked as lab %s's)", what, link.name, lab)
                    except LinkError as exc:
                        problems.append(str(exc))
    except (VmlaunchError, OSError) as exc:  # no netlink here (no pyroute2, no permission)
        problems.append(f"the lab's taps could not be listed: {exc}")
    return problems


def marked_links(lab: str) -> list[str]:
    """Every interface whose mark names the lab, as "NAME (a bridge)", but a bridge (or its VLAN
    uplink) that another lab still uses; [] when they cannot be listed."""
    from vmlaunch.host.bridge_registry import BridgeRegistry
    from vmlaunch.host.links import netlink

    try:
        with BridgeRegistry.locked() as registry:
            shared = {link for name, entry in registry.bridges.items() if entry.labs
                      for link in (name, entry.uplink) if link}
        with netlink("(every interface)") as nl:
            return [f"{link.name} ({link.describe()})"
                    for link in nl.links("(every interface)", "listing interfaces")
                    if link.lab == lab and link.name not in shared]
    except (VmlaunchError, OSError):
        return []


def remove_cgroups(lab: str) -> list[str]:
    """Remove the lab's VMs' cpuset cgroups; returns what could not be removed."""
    from vmlaunch.core.naming import cgroup_name
    from vmlaunch.host import cgroups

    cpusets = cgroups.detect()
    if cpusets is None:
        return []
    problems = []
    for folder in sorted(cpusets.root.glob(cgroup_name(lab, "*"))):
        try:
            cgroups.remove(folder, timeout=2.0)
            log.info("cgroup %s: removed", folder)
        except VmlaunchError as exc:
            problems.append(str(exc))
    return problems


def take_down(run_dir: RunDir, known: Collection[str], timeout: float) -> list[str]:
    """Stop and remove what the lab left that the journal does not list (`known`: the VMs it does).
    Returns what is still there, a running QEMU first, one line each."""
    from vmlaunch.layout import lastrun
    from vmlaunch.resources.base import Context
    from vmlaunch.resources.registry import release_unjournaled
    from vmlaunch.rig import partition

    lab = run_dir.lab
    found = running_qemus(run_dir, skip=known)
    if found:
        stopped = qemu.stop_all({name: (pid, run_dir.vm(name)) for name, pid in found.items()}, timeout)
        lastrun.keep(run_dir, stopped)
        for name, how in stopped.items():
            log.info("%s: %s (found by its pidfile or command line)", name, how)
    stop_managers(run_dir)
    problems = remove_marked_taps(lab)
    problems += partition.remove_table(run_dir)  # by its name: the record may be gone too
    problems += remove_cgroups(lab)
    try:  # the lab holds nothing the registries know of any more: its claims are stale
        problems += release_unjournaled(Context(lab=lab), lambda kind, key: False)
    except (VmlaunchError, OSError) as exc:
        problems.append(str(exc))
    left = [f"QEMU of VM {name} (pid {pid}) still runs"
            for name, pid in running_qemus(run_dir, skip=known).items()]
    left += [f"the lab manager (pid {pid}) still runs" for pid in manager_pids(run_dir)]
    left += [f"interface {link} is still marked as lab {lab}'s" for link in marked_links(lab)]
    return left + problems


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError:
        return []


def _processes() -> list[tuple[int, bytes]]:
    """(pid, command line: its words each ended by a NUL) of every process but this one."""
    found = []
    for entry in _entries(Path("/proc")):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except OSError:
                continue
            found.append((int(entry.name), cmdline))
    return found
