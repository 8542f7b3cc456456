"""The commands of a lab on libvirt hosts, on its domains: status, balloon, logs, console, ssh.

Where each VM runs is what the journal says (`up` placed it), so these need no placement and no
host but the VM's own.
"""

from __future__ import annotations

import shlex
from typing import Any

import attrs

from vmlaunch.errors import RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.guests.sshkeys import ssh_argv as lab_ssh_argv
from vmlaunch.host import remote
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.dirs import run_root
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.remote import RemoteDomainRecord
from vmlaunch.spec.hosts import SSH_PORT, parse_uri
from vmlaunch.spec.model import DEFAULT_CLOUD_USER, BridgeNetwork, LabSpec

# libvirt's virDomainState values, as `status` says them
STATES = {
    0: "unknown",
    1: "running",
    2: "blocked",
    3: "paused",
    4: "stopping",
    5: "stopped",
    6: "crashed",
    7: "suspended",
}


@attrs.frozen
class Row:
    name: str
    state: str
    host: str | None
    domain: str | None
    memory: int | None = None  # bytes the domain may have
    balloon: int | None = None  # bytes the guest has now (the balloon's actual)
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in attrs.asdict(self).items() if key != "name"}


def domains(lab: LabSpec) -> dict[str, RemoteDomainRecord]:
    journal = Journal.load(RunDir.of(run_root(), lab.name))
    return {e.record.vm: e.record for e in journal.resources if isinstance(e.record, RemoteDomainRecord)}


def _domain(lab: LabSpec, vm: str) -> tuple[RemoteDomainRecord, Any]:
    lab.select([vm])
    record = domains(lab).get(vm)
    if record is None:
        raise RuntimeFailure(f"{vm} is not up", f"vmlaunch up {lab.file}")
    conn = remote.connect(record.host, record.uri)
    libvirt = remote.binding()
    try:
        return record, conn.lookupByName(record.name)
    except libvirt.libvirtError as exc:
        raise RuntimeFailure(
            f"{vm} (domain {record.name} on host {record.host}): {remote.libvirt_error(exc)}"
        ) from None


def status(lab: LabSpec) -> list[Row]:
    found = domains(lab)
    rows = []
    for vm in lab.vms:
        record = found.get(vm.name)
        if record is None:
            rows.append(Row(vm.name, "down", None, None))
            continue
        libvirt = remote.binding()
        try:
            dom = remote.connect(record.host, record.uri).lookupByName(record.name)
            state, _ = dom.state()
            _, most_kib, now_kib, *_ = dom.info()
            actual = dom.memoryStats().get("actual") if state == 1 else None
            row = Row(
                vm.name,
                STATES.get(state, "unknown"),
                record.host,
                record.name,
                most_kib << 10,
                (actual or now_kib) << 10,
            )
        except libvirt.libvirtError as exc:
            row = Row(vm.name, "unknown", record.host, record.name, why=remote.libvirt_error(exc))
        except VmlaunchError as exc:  # its host cannot be reached
            row = Row(vm.name, "unknown", record.host, record.name, why=exc.message)
        rows.append(row)
    return rows


def balloon(lab: LabSpec, vm: str, size: int | None) -> int:
    """Set the guest's memory through its balloon (libvirt's setMemory), or read it: bytes."""
    libvirt = remote.binding()
    record, dom = _domain(lab, vm)
    try:
        if size is not None:
            dom.setMemoryFlags(size >> 10, libvirt.VIR_DOMAIN_AFFECT_LIVE)
        stats = dom.memoryStats()
        return int(stats.get("actual", dom.info()[2])) << 10
    except libvirt.libvirtError as exc:
        raise RuntimeFailure(f"{vm} (host {record.host}): {remote.libvirt_error(exc)}") from None


def serial_log(lab: LabSpec, vm: str) -> str:
    """The VM's serial console log, read on its host."""
    record, _ = _domain(lab, vm)
    uri = parse_uri(record.uri)
    if not uri.shell:
        raise RuntimeFailure(
            f"{vm} runs on host {record.host}, reached over {uri.transport}: vmlaunch cannot "
            "read its log there",
            f"virsh -c '{record.uri}' console {record.name}",
        )
    return remote.shell(record.host, record.uri, f"cat {shlex.quote(record.log)}\n")


def console_argv(lab: LabSpec, vm: str) -> list[str]:
    record, _ = _domain(lab, vm)
    return ["virsh", "--connect", record.uri, "console", record.name]


def ssh_argv(lab: LabSpec, vm: str, command: str | list[str] | None) -> list[str]:
    """`ssh` to the VM's address on a lab network, jumping through its host with the host's SSH."""
    record, _ = _domain(lab, vm)
    spec = lab.vm(vm)
    address = next(
        (
            nic.ip.split("/")[0]
            for nic in spec.nics
            if nic.ip is not None and isinstance(lab.network(nic.network), BridgeNetwork)
        ),
        None,
    )
    if address is None:
        raise UsageError(
            f"{vm} has no address on a bridge network: `vmlaunch ssh` reaches a VM on libvirt hosts there",
            "give its NIC an ip, or its network a subnet",
        )
    uri = parse_uri(record.uri)
    jump = uri.ssh_argv() if uri.ssh else None
    user = spec.cloud_init.user if spec.cloud_init is not None else DEFAULT_CLOUD_USER
    return lab_ssh_argv(
        LabDir.of(lab.file, lab.name), vm, user, SSH_PORT, command, address=address, jump=jump
    )
