"""What of a lab runs, as its journal and the kernel tell: each VM's QEMU pid, the nodes its placed VMs
are on, and the SSH command line into one. The one place the rest of the runtime asks."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from vmlaunch.errors import RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.lab import process as qemu
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.rundir import RunDir

if TYPE_CHECKING:
    from vmlaunch.host.numa import Topology
    from vmlaunch.spec.model import LabSpec


def running_vms(journal: Journal, names: Collection[str] | None = None) -> dict[str, int]:
    """The VMs of the journal (those named, or all) whose QEMU runs, with its pid."""
    found = {name: qemu.find_pid(journal.run_dir.vm(name), vm.pid) for name, vm in journal.vms.items()
             if names is None or name in names}
    return {name: pid for name, pid in found.items() if pid is not None}


def running_pid(run_dir: RunDir, name: str) -> int:
    vm = Journal.load(run_dir).vms.get(name)
    pid = qemu.find_pid(run_dir.vm(name), vm.pid) if vm is not None else None
    if pid is None:
        raise RuntimeFailure(f"VM {name} is not running", f"start it with `vmlaunch up SPEC {name}`")
    return pid


def no_ssh(lab: LabSpec, name: str) -> UsageError:
    """The error for a VM without an SSH port, with the spec line of the VM's table."""
    return UsageError(f"VM {name} has no SSH port", f"give it ssh = true in [vm.{name}], "
                      f"{lab.file}:{lab.source.line_of(('vm', name))} (and an image or "
                      f"[vm.{name}.cloud_init])")


def ssh_argv_of(run_dir: RunDir, lab: LabSpec, name: str, command: str | Sequence[str] | None) -> list[str]:
    """The OpenSSH command line into a running VM (`vmlaunch ssh`, `Vm.ssh`); `command` as
    `guests/sshkeys.ssh_argv` takes it (shell text, or words that arrive as words)."""
    from vmlaunch.guests.sshkeys import ssh_argv
    from vmlaunch.layout.labdir import LabDir
    from vmlaunch.spec.model import DEFAULT_CLOUD_USER

    vm = lab.vm(name)
    if not vm.ssh:
        raise no_ssh(lab, name)
    running_pid(run_dir, name)
    entry = Journal.load(run_dir).vms[name]
    if entry.ssh_port is None:
        raise RuntimeFailure(f"VM {name} was started without an SSH port",
                             f"restart it: `vmlaunch down SPEC {name}` then `vmlaunch up SPEC {name}`")
    user = vm.cloud_init.user if vm.cloud_init is not None else DEFAULT_CLOUD_USER
    return ssh_argv(LabDir.of(lab.file, lab.name), name, user, entry.ssh_port, command)


def where_running(run_dir: RunDir, topology: Topology | None) -> dict[str, tuple[int, ...]]:
    """The nodes each placed VM of the lab that runs now is on: its cgroup's nodes (where the balancer
    may have moved it since `up`), else the nodes of the CPUs its QEMU may run on. For an `up` that
    starts more of a running lab's VMs: they are placed beside these as they are, not as they were.
    Empty without several nodes, or a journal that cannot be read (`up` says so itself)."""
    if topology is None or not topology.multi_node:
        return {}
    from vmlaunch.host import cgroups
    from vmlaunch.host.numa import allowed_cpus, nodes_of
    from vmlaunch.resources.placement import PlacementRecord
    try:
        journal = Journal.load(run_dir)
    except (VmlaunchError, OSError):
        return {}
    found: dict[str, tuple[int, ...]] = {}
    for name, entry in journal.vms.items():
        record = journal.entry(PlacementRecord.kind, name)
        if record is None or not isinstance(record.record, PlacementRecord):
            continue
        pid = qemu.find_pid(run_dir.vm(name), entry.pid)
        if pid is None:
            continue
        place = cgroups.place_of(record.record.cgroup) if record.record.cgroup is not None else None
        nodes = place[1] if place is not None else nodes_of(allowed_cpus(pid), topology)
        nodes = tuple(node for node in nodes if topology.node(node) is not None)
        if nodes:
            found[name] = nodes
    return found
