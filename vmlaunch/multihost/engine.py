"""`up` of a lab on libvirt hosts: all or nothing, every host worked on at once.

1. Connect to every host at once; one that does not answer stops `up` before anything changes (exit 3).
2. Place each VM (policy/hostplace.py) from each host's free memory and CPUs; VMs that are up stay.
3. Plan each host's share: the lab's pool and its volumes (kernels, initrds, base images uploaded, each
   VM's overlay backed by its base, its disks, its cloud-init seed), a libvirt network per lab network
   used there (its MTU lowered by VXLAN's 50 bytes when it spans hosts), the VXLAN link joining it to
   the other hosts' bridges, and the domains.
4. Refuse a pool, network, domain, bridge or link of a name the plan uses that the journal does not
   say this lab made (exit 3, nothing changed).
5. Make it: a thread per host, each step journaled as soon as it is done. A failure anywhere (a host
   whose libvirtd dies, a refusal) stops every thread and undoes what this `up` made, on every host
   it can reach; what it could not undo is named with its host and stays journaled for `down` (exit 4).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
import threading
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.core import signals
from vmlaunch.core.fsutil import write_atomic
from vmlaunch.errors import HostError, RuntimeFailure, VmlaunchError
from vmlaunch.export import Findings, qualified
from vmlaunch.export.libvirt import SERIAL_LOG_DIR, UUID_NAMESPACE, domain_xml, network_xml
from vmlaunch.host import remote
from vmlaunch.lab.journal import Entry, Journal, locked
from vmlaunch.layout.dirs import run_root
from vmlaunch.layout.labdir import LabDir
from vmlaunch.layout.rundir import RunDir
from vmlaunch.policy.hostplace import HostRoom, place
from vmlaunch.resources.base import Context
from vmlaunch.resources.remote import (
    RemoteDomainRecord,
    RemoteLinkRecord,
    RemoteNetworkRecord,
    RemotePoolRecord,
)
from vmlaunch.spec.hosts import (
    VXLAN_PORT,
    host_addresses,
    is_ip,
    parse_uri,
    pool_name,
    spanning,
    spanning_mtu,
    tunnel_address,
    vni,
    vxlan_name,
)
from vmlaunch.spec.model import Accel, BridgeNetwork, DiskFormat, LabSpec

log = logging.getLogger(__name__)
POOL_ROOT = "/var/lib/libvirt/images"  # where libvirt keeps images on a Debian host
CHUNK = 1 << 20


@attrs.frozen
class HostFacts:
    """What a host says of itself through libvirt."""

    name: str
    uri: str
    free_mib: int
    cpus: int
    kvm: bool
    libvirt_version: int
    hypervisor: str

    @property
    def version(self) -> str:
        major, rest = divmod(self.libvirt_version, 1_000_000)
        return f"{major}.{rest // 1000}.{rest % 1000}"


@attrs.frozen
class Volume:
    name: str
    format: str  # raw | qcow2
    source: Path | None = None  # uploaded from this machine
    size: int = 0  # bytes, for a volume made empty (or an overlay's virtual size)
    backing: str | None = None  # an overlay: the name of the volume it is backed by


@attrs.frozen
class NetworkPlan:
    name: str  # LAB-NET, as the libvirt network
    bridge: str
    xml: str
    link: str | None = None  # the VXLAN link, for a network that spans hosts
    vni: int = 0
    local: str | None = None  # this host's tunnel address
    peers: tuple[str, ...] = ()  # the other hosts' tunnel addresses
    mtu: int | None = None
    address: str | None = None  # the host's own on the bridge ("10.9.0.1/24"): `ssh` jumps through it


@attrs.frozen
class DomainPlan:
    vm: str
    name: str  # LAB-VM
    xml: str


@attrs.frozen
class HostPlan:
    host: str
    uri: str
    pool: str
    pool_path: str
    volumes: tuple[Volume, ...]
    networks: tuple[NetworkPlan, ...]
    domains: tuple[DomainPlan, ...]
    findings: tuple[str, ...] = ()  # what of the spec the domains cannot carry (the export's problems)


@attrs.frozen
class Plan:
    lab: LabSpec = attrs.field(repr=False)
    placement: Mapping[str, str]
    placed_by: Mapping[str, str]  # vm -> "pinned" | "placed" | "up already"
    hosts: tuple[HostPlan, ...]
    facts: Mapping[str, HostFacts]


# --- connecting -----------------------------------------------------------------------------------


def parallel(
    items: list[Any], work: Callable[[Any], Any], *, interrupted: Callable[[], None] | None = None
) -> tuple[dict[Any, Any], dict[Any, BaseException]]:
    """`work(item)` for every item at once, each on a thread: results and failures by item.

    Interrupted while waiting (Ctrl-C), it calls `interrupted` (which tells the threads to stop), waits
    for every thread with signals held, and raises the interruption: nothing runs on behind a caller
    that then rolls back."""
    results: dict[Any, Any] = {}
    failures: dict[Any, BaseException] = {}

    def one(item: Any) -> None:
        try:
            results[item] = work(item)
        except BaseException as exc:  # said by the caller
            failures[item] = exc

    threads = [threading.Thread(target=one, args=(item,), daemon=True) for item in items]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:
        if interrupted is not None:
            interrupted()
        with signals.held():
            for thread in threads:
                thread.join()
        raise
    return results, failures


def host_facts(name: str, uri: str) -> HostFacts:
    conn = remote.connect(name, uri)
    libvirt = remote.binding()
    try:
        cpus = conn.getInfo()[2]
        stats = conn.getMemoryStats(libvirt.VIR_NODE_MEMORY_STATS_ALL_CELLS, 0)
        # free, and what the host gives back when asked (its page cache and buffers): MemFree alone
        # makes a host with a warm cache look full
        free = (stats.get("free", 0) + stats.get("cached", 0) + stats.get("buffers", 0)) >> 10
        caps = ET.fromstring(conn.getCapabilities())
        return HostFacts(
            name=name,
            uri=uri,
            free_mib=int(free),
            cpus=int(cpus),
            kvm=any(domain.get("type") == "kvm" for domain in caps.iter("domain")),
            libvirt_version=int(conn.getLibVersion()),
            hypervisor=str(conn.getType()),
        )
    except libvirt.libvirtError as exc:
        raise remote.HostUnreachable(
            f"host {name} ({uri}) does not answer: {remote.libvirt_error(exc)}"
        ) from None


def connect_all(lab: LabSpec) -> dict[str, HostFacts]:
    """Every host's facts, asked at once; HostUnreachable (exit 3) names every host that failed."""
    results, failures = parallel(
        [host.name for host in lab.hosts], lambda name: host_facts(name, lab.host(name).uri)
    )
    if failures:
        said = "\n".join(f"  {exc}" for exc in failures.values())
        first = next(iter(failures.values()))
        if not isinstance(first, VmlaunchError):
            raise first
        raise remote.HostUnreachable(
            f"lab {lab.name}: {len(failures)} of {len(lab.hosts)} hosts cannot be "
            f"reached, nothing was changed:\n{said}",
            "start libvirtd there, check the URIs, or take those hosts out of the spec",
        )
    return {host.name: results[host.name] for host in lab.hosts}


# --- the plan -------------------------------------------------------------------------------------


def placed_before(journal: Journal) -> dict[str, str]:
    """Where the journal says the lab's VMs are: vm -> host."""
    return {e.record.vm: e.record.host for e in journal.resources if isinstance(e.record, RemoteDomainRecord)}


def make_plan(lab: LabSpec, facts: Mapping[str, HostFacts], before: Mapping[str, str]) -> Plan:
    """Where each VM goes, and what each host gets. A HostError (exit 3) before anything changes: no
    room, a VM up on a host the spec no longer has, a tunnel address that is not known."""
    gone = sorted({host for host in before.values() if host not in facts})
    if gone:
        raise HostError(
            f"lab {lab.name} has VMs up on hosts the spec no longer has: {', '.join(gone)}",
            f"put them back in the spec, or `vmlaunch down {lab.file}` first",
        )
    rooms = {
        name: HostRoom(
            memory_mib=fact.free_mib,
            cpus=fact.cpus,
            shell=parse_uri(fact.uri).shell and tunnel_address(lab.host(name)) is not None,
        )
        for name, fact in facts.items()
    }
    pinned = attrs.evolve(
        lab, vms=tuple(attrs.evolve(vm, host=before.get(vm.name, vm.host)) for vm in lab.vms)
    )
    # memory of VMs up already is counted in the host's free memory: not again
    rooms_left = dict(rooms)
    for vm in pinned.vms:
        if vm.name in before:
            room = rooms_left[before[vm.name]]
            rooms_left[before[vm.name]] = attrs.evolve(room, memory_mib=room.memory_mib + vm.memory_mib)
    placement = place(pinned, rooms_left)
    placed_by = {
        vm.name: "up already" if vm.name in before else "pinned" if vm.host else "placed" for vm in lab.vms
    }
    spans = spanning(lab, placement)
    tunnels = {host: _tunnel(lab, host) for hosts in spans.values() for host in hosts}
    hosted = attrs.evolve(
        lab,
        networks=tuple(
            attrs.evolve(net, mtu=spanning_mtu(net, ipv6=any(":" in tunnels[h] for h in spans[net.name])))
            if isinstance(net, BridgeNetwork) and net.name in spans
            else net
            for net in lab.networks
        ),
    )
    plans = tuple(
        _host_plan(hosted, host.name, host.uri, facts[host.name], placement, spans, tunnels)
        for host in lab.hosts
    )
    return Plan(lab=lab, placement=placement, placed_by=placed_by, hosts=plans, facts=facts)


def _tunnel(lab: LabSpec, host: str) -> str:
    """The host's address for the lab's tunnels: `address`, or its URI's host (looked up here when it is
    a name)."""
    found = tunnel_address(lab.host(host))
    if found is None:
        raise HostError(
            f"host {host} carries a network that spans hosts, and has no address for its tunnels",
            f'add address = "IP" to [host.{host}]',
        )
    if is_ip(found):
        return found
    try:
        return str(socket.getaddrinfo(found, None, type=socket.SOCK_DGRAM)[0][4][0])
    except OSError as exc:
        raise HostError(
            f"host {host}: its name {found} does not resolve here ({exc}), and the lab's tunnels "
            "need its address",
            f'add address = "IP" to [host.{host}]',
        ) from None


def _host_plan(
    lab: LabSpec,
    host: str,
    uri: str,
    fact: HostFacts,
    placement: Mapping[str, str],
    spans: Mapping[str, tuple[str, ...]],
    tunnels: Mapping[str, str],
) -> HostPlan:
    pool = pool_name(lab.name)
    pool_path = f"{POOL_ROOT}/{pool}"
    vms = [vm for vm in lab.vms if placement[vm.name] == host]
    volumes: dict[str, Volume] = {}
    files: dict[Path, str] = {}

    def volume(local: Path, vol: Volume) -> None:
        volumes.setdefault(vol.name, vol)
        files[local] = f"{pool_path}/{vol.name}"

    lab_dir = LabDir.of(lab.file, lab.name)
    for vm in vms:
        if vm.kernel is not None:
            volume(vm.kernel, Volume(f"{vm.name}-kernel", "raw", source=vm.kernel))
        if vm.initrd is not None:
            volume(vm.initrd, Volume(f"{vm.name}-initrd", "raw", source=vm.initrd))
        if vm.image is not None:
            image = lab.image(vm.image)
            base = f"base-{image.name}.qcow2"
            volumes.setdefault(base, Volume(base, "qcow2", source=None))  # the file: at `up` (_sources)
            volume(
                lab_dir.vm(vm.name).overlay,
                Volume(f"{vm.name}-root.qcow2", "qcow2", size=vm.disk_size or 0, backing=base),
            )
        for index, disk in enumerate(vm.disks):
            fmt = "qcow2" if disk.format is DiskFormat.QCOW2 else "raw"
            volume(
                disk.file,
                Volume(
                    f"{vm.name}-disk{index}.{fmt}",
                    fmt,
                    source=disk.file if disk.file.exists() else None,
                    size=disk.size or 0,
                ),
            )
        if vm.cloud_init is not None:
            volume(
                lab_dir.vm(vm.name).seed,
                Volume(f"{vm.name}-seed.iso", "raw", source=lab_dir.vm(vm.name).seed),
            )
        files[lab_dir.vm(vm.name).nvram] = f"{pool_path}/{vm.name}-VARS.fd"
    used = {nic.network for vm in vms for nic in vm.nics}
    networks = []
    for net in lab.networks:
        if net.name not in used or not isinstance(net, BridgeNetwork):
            continue
        carriers = spans.get(net.name, (host,))
        address = host_addresses(lab, net, carriers).get(host)
        if not parse_uri(uri).shell:
            address = None  # set over SSH, as `vmlaunch ssh` jumps over SSH
        xml = network_xml(lab, net, bridge_mode=False)
        if net.name in spans:
            peers = tuple(tunnels[other] for other in carriers if other != host)
            networks.append(
                NetworkPlan(
                    qualified(lab, net.name),
                    net.bridge,
                    xml,
                    link=vxlan_name(lab.name, net.name),
                    vni=vni(lab.name, net.name),
                    local=tunnels[host],
                    peers=peers,
                    mtu=net.mtu,
                    address=address,
                )
            )
        else:
            networks.append(NetworkPlan(qualified(lab, net.name), net.bridge, xml, address=address))
    findings = Findings(lab)
    domains = []
    for vm in vms:
        run = vm if vm.accel is not Accel.AUTO or fact.kvm else attrs.evolve(vm, accel=Accel.TCG)
        xml = domain_xml(lab, run, findings, files=lambda path: files.get(path, str(path)))
        domains.append(DomainPlan(vm.name, qualified(lab, vm.name), xml))
    return HostPlan(
        host=host,
        uri=uri,
        pool=pool,
        pool_path=pool_path,
        volumes=tuple(volumes.values()),
        networks=tuple(networks),
        domains=tuple(domains),
        findings=tuple(str(problem) for problem in findings.sorted()),
    )


def describe(plan: Plan) -> Iterator[str]:
    """What `up` would do, host by host: for `cmdline` and `up --dry-run`."""
    for host in plan.hosts:
        fact = plan.facts[host.host]
        yield (
            f"host {host.host} ({host.uri}): libvirt {fact.version}, {fact.hypervisor} "
            f"{'with KVM' if fact.kvm else 'without KVM (TCG)'}, {fact.free_mib} MiB free, {fact.cpus} CPUs"
        )
        for dom in host.domains:
            vm = plan.lab.vm(dom.vm)
            yield (
                f"  {dom.vm}: {vm.memory_mib} MiB, {vm.cpus} vCPUs ({plan.placed_by[dom.vm]}), "
                f"domain {dom.name}"
            )
        if host.volumes:
            yield f"  pool {host.pool} ({host.pool_path}): {', '.join(vol.name for vol in host.volumes)}"
        for net in host.networks:
            link = (
                f", VXLAN {net.link} (VNI {net.vni}, UDP {VXLAN_PORT}) from {net.local} to "
                f"{', '.join(net.peers)}, MTU {net.mtu}"
                if net.link
                else ""
            )
            own = f", the host's address {net.address}" if net.address else ""
            yield f"  network {net.name}: bridge {net.bridge}{own}{link}"


# --- refusing what is not ours ---------------------------------------------------------------------


def _foreign(plan: HostPlan, journal: Journal) -> list[str]:
    """Names the plan would define on the host that exist there, made by someone else."""
    libvirt = remote.binding()
    conn = remote.connect(plan.host, plan.uri)
    mine = {(e.kind, e.key) for e in journal.resources}
    found = []
    try:
        pools = {pool.name() for pool in conn.listAllStoragePools(0)}
        nets = {net.name() for net in conn.listAllNetworks(0)}
        doms = {dom.name() for dom in conn.listAllDomains(0)}
    except libvirt.libvirtError as exc:
        raise remote.HostUnreachable(f"host {plan.host} ({plan.uri}): {remote.libvirt_error(exc)}") from None
    if plan.pool in pools and ("remote-pool", f"{plan.host}/{plan.pool}") not in mine:
        found.append(f"storage pool {plan.pool}")
    for net in plan.networks:
        if net.name in nets and ("remote-network", f"{plan.host}/{net.name}") not in mine:
            found.append(f"network {net.name}")
    for dom in plan.domains:
        if dom.name in doms and ("remote-domain", f"{plan.host}/{dom.name}") not in mine:
            found.append(f"domain {dom.name}")
    links = [net.bridge for net in plan.networks if ("remote-network", f"{plan.host}/{net.name}") not in mine]
    links += [
        net.link
        for net in plan.networks
        if net.link and ("remote-link", f"{plan.host}/{net.link}") not in mine
    ]
    if not parse_uri(plan.uri).shell:
        return found
    # one SSH round trip: the links of those names, and the pool's folder when the pool is not ours
    script = "".join(
        f"ip link show dev {shlex.quote(name)} >/dev/null 2>&1 && echo link {shlex.quote(name)}\n"
        for name in links
    )
    if ("remote-pool", f"{plan.host}/{plan.pool}") not in mine and (plan.volumes or plan.domains):
        script += f"test -e {shlex.quote(plan.pool_path)} && echo folder\n"
    if script:
        for line in remote.shell(plan.host, plan.uri, script + "true\n").splitlines():
            found.append(f"folder {plan.pool_path} (the pool's)" if line == "folder" else line)
    return found


def refuse_foreign(plans: tuple[HostPlan, ...], journal: Journal) -> None:
    results, failures = parallel(list(plans), lambda plan: _foreign(plan, journal))
    if failures:
        raise next(iter(failures.values()))
    said = [f"  host {plan.host}: {', '.join(results[plan])}" for plan in plans if results[plan]]
    if said:
        raise HostError(
            "up would define names that exist on the hosts and were not made by this lab; "
            "nothing was changed:\n" + "\n".join(said),
            "remove them there, or rename the lab ([lab] name)",
        )


# --- making it ------------------------------------------------------------------------------------


class Cancelled(Exception):
    """Another host failed: this one stops."""


class _Run:
    """One `up`: the journal (written by every host's thread under a lock) and what this up made."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.lock = threading.Lock()
        self.made: list[Entry] = []
        self.stop = threading.Event()

    def has(self, kind: str, key: str) -> bool:
        with self.lock:
            return self.journal.has(kind, key)

    def add(self, entry: Entry) -> None:
        with self.lock, signals.held():
            self.journal.add(entry)
            self.made.append(entry)

    def check(self) -> None:
        if self.stop.is_set():
            raise Cancelled


def _upload(conn: Any, volume: Any, source: Path, run: _Run) -> None:
    try:
        file = open(source, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise HostError(f"cannot read {source}: {exc.strerror or exc}") from None
    with file:
        stream = conn.newStream(0)
        volume.upload(stream, 0, os.fstat(file.fileno()).st_size, 0)
        try:
            while chunk := file.read(CHUNK):
                run.check()
                _send(stream, chunk)
            stream.finish()
        except BaseException:
            with contextlib.suppress(Exception):
                stream.abort()
            raise


def _send(stream: Any, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = stream.send(bytes(view[:CHUNK]))
        if sent < 0:
            raise RuntimeFailure("the host stopped taking the upload")
        view = view[sent:]


def _volume_xml(vol: Volume, capacity: int, backing_path: str | None) -> str:
    root = ET.Element("volume")
    ET.SubElement(root, "name").text = vol.name
    ET.SubElement(root, "capacity", unit="bytes").text = str(capacity)
    target = ET.SubElement(root, "target")
    ET.SubElement(target, "format", type=vol.format)
    if backing_path is not None:
        backing = ET.SubElement(root, "backingStore")
        ET.SubElement(backing, "path").text = backing_path
        ET.SubElement(backing, "format", type="qcow2")
    return ET.tostring(root, encoding="unicode")


def _pool_xml(plan: HostPlan) -> str:
    root = ET.Element("pool", type="dir")
    ET.SubElement(root, "name").text = plan.pool
    ET.SubElement(root, "uuid").text = str(uuid.uuid5(UUID_NAMESPACE, f"pool:{plan.host}:{plan.pool}"))
    target = ET.SubElement(root, "target")
    ET.SubElement(target, "path").text = plan.pool_path
    return ET.tostring(root, encoding="unicode")


def _vxlan_script(net: NetworkPlan) -> str:
    link, bridge = shlex.quote(str(net.link)), shlex.quote(net.bridge)
    lines = [
        f"ip link add {link} type vxlan id {net.vni} local {shlex.quote(str(net.local))} "
        f"dstport {VXLAN_PORT} nolearning",
        *(f"bridge fdb append 00:00:00:00:00:00 dev {link} dst {shlex.quote(peer)}" for peer in net.peers),
        f"ip link set {link} mtu {net.mtu} master {bridge} up",
    ]
    return "\n".join(lines) + "\n"


def _uuid_of(xml: str) -> str:
    """The UUID a definition carries (the export's builders and `_pool_xml` give each one)."""
    return str(ET.fromstring(xml).findtext("uuid"))


def _claim(run: _Run, record: Any, vm: str | None = None) -> bool:
    """Journal `record` (a pool, network, link or domain about to be made) unless the journal has it:
    whether it is to be made now."""
    key = f"{record.host}/{record.name}"
    if run.has(record.kind, key):
        return False
    run.add(Entry(record.kind, key, vm, record))
    return True


def _work(plan: HostPlan, run: _Run, sources: Mapping[str, Path], sizes: Mapping[str, int]) -> None:
    """Make the host's share of the lab. Each pool, network, link and domain is journaled before it is
    defined (its UUID is in its XML): killed in between, the record's undo finds it, or finds it gone."""
    libvirt = remote.binding()
    conn = remote.connect(plan.host, plan.uri)
    where = {"host": plan.host, "uri": plan.uri}
    try:
        run.check()
        if plan.volumes or any("-VARS.fd" in dom.xml for dom in plan.domains):
            xml = _pool_xml(plan)
            if _claim(
                run, RemotePoolRecord(**where, name=plan.pool, uuid=_uuid_of(xml), path=plan.pool_path)
            ):
                conn.storagePoolDefineXML(xml, 0)
            pool = conn.storagePoolLookupByName(plan.pool)
            if not pool.isActive():
                pool.build(0)  # its folder (kept when it is there already)
                pool.create(0)
            pool.refresh(0)
            have = set(pool.listVolumes())
            for vol in plan.volumes:
                run.check()
                if vol.name not in have:
                    _volume(conn, pool, plan, vol, run, sources.get(vol.name), sizes)
        for net in plan.networks:
            run.check()
            record = RemoteNetworkRecord(**where, name=net.name, uuid=_uuid_of(net.xml), bridge=net.bridge)
            if _claim(run, record):
                conn.networkDefineXML(net.xml)
            libvirt_net = conn.networkLookupByName(net.name)
            if not libvirt_net.isActive():
                libvirt_net.create()
            script = ""  # one SSH round trip for the host's side of the network
            if net.address is not None:  # the host's own on the bridge, for `vmlaunch ssh`'s jump
                script += f"ip addr replace {shlex.quote(net.address)} dev {shlex.quote(net.bridge)}\n"
            if net.link and _claim(run, RemoteLinkRecord(**where, name=net.link, vni=net.vni)):
                script += _vxlan_script(net)
            if script:
                remote.shell(plan.host, plan.uri, "set -e\n" + script)
        for dom in plan.domains:
            run.check()
            if _claim(
                run,
                RemoteDomainRecord(
                    **where,
                    name=dom.name,
                    uuid=_uuid_of(dom.xml),
                    vm=dom.vm,
                    log=str(SERIAL_LOG_DIR / f"{dom.name}-serial.log"),
                ),
                dom.vm,
            ):
                conn.defineXML(dom.xml)
            domain = conn.lookupByName(dom.name)
            if not domain.isActive():
                domain.create()
    except libvirt.libvirtError as exc:
        raise RuntimeFailure(f"host {plan.host}: {remote.failed(plan.uri, conn, exc)}") from None


def _volume(
    conn: Any, pool: Any, plan: HostPlan, vol: Volume, run: _Run, base: Path | None, sizes: Mapping[str, int]
) -> None:
    """Make one volume of the lab's pool: uploaded from this machine, empty, or an overlay of its base."""
    source = vol.source or base
    backing = f"{plan.pool_path}/{vol.backing}" if vol.backing else None
    if vol.backing:
        capacity = vol.size or sizes.get(vol.backing, 0)
    else:
        capacity = _size_of(source) if source is not None else vol.size
    made = pool.createXML(_volume_xml(vol, capacity, backing), 0)
    if source is not None and vol.backing is None:
        try:
            _upload(conn, made, source, run)
        except BaseException:
            with contextlib.suppress(Exception):
                made.delete(0)  # never a half-uploaded volume left for a later up
            raise


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from None


def _sources(lab: LabSpec, plan: Plan) -> tuple[dict[str, Path], dict[str, int]]:
    """The base images' files on this machine (pulled when they are not), by volume name, with their
    virtual sizes; and each VM's seed, written."""
    sources: dict[str, Path] = {}
    sizes: dict[str, int] = {}
    for name in sorted({vm.image for vm in lab.vms if vm.image is not None}):
        image = lab.image(name)
        if image.catalog is not None:
            from vmlaunch.guests.catalog_images import ensure as ensure_catalog

            path = ensure_catalog(image)
        else:
            from vmlaunch.guests.images import ensure

            path = ensure(image)
        from vmlaunch.guests.images import image_info

        info = image_info(path, image.format)
        if info.format is not DiskFormat.QCOW2:
            raise HostError(
                f"image {name} is {info.format.value}: a lab on libvirt hosts backs its overlays "
                "with qcow2 images",
                "convert it: qemu-img convert -O qcow2",
            )
        sources[f"base-{name}.qcow2"] = path
        sizes[f"base-{name}.qcow2"] = info.virtual_size
    lab_dir = LabDir.of(lab.file, lab.name)
    seeded = [vm for vm in lab.vms if vm.cloud_init is not None and plan.placed_by[vm.name] != "up already"]
    if seeded:  # written here (the lab dir keeps the lab's SSH keys, as on this machine), then uploaded
        from vmlaunch.resources.guest import LabDirResource, Seed

        ctx = Context(lab=lab.name)
        LabDirResource(lab_dir).apply(ctx)
        for vm in seeded:
            Seed(vm=vm.name, lab=lab, lab_dir=lab_dir, management_mac=None).apply(ctx)
    return sources, sizes


def _roll_back(run: _Run) -> list[str]:
    """Undo what this up made, newest first, every host at once. What could not be undone, said."""
    by_host: dict[str, list[Entry]] = {}
    for entry in run.made:
        by_host.setdefault(getattr(entry.record, "host", ""), []).append(entry)
    left: list[str] = []

    def undo(host: str) -> None:
        for entry in reversed(by_host[host]):
            try:
                entry.record.undo(Context(lab=""), rollback=True)
            except VmlaunchError as exc:
                with run.lock:
                    left.append(str(exc))
                continue
            with run.lock, contextlib.suppress(OSError):
                run.journal.drop(entry)

    with signals.held():
        parallel(list(by_host), undo)
    return left


def up(
    lab: LabSpec,
    *,
    spec: str | os.PathLike[str],
    timeout: float = 60.0,
    dry_run: bool = False,
    force: bool = False,
) -> Plan:
    """Bring the lab up on its hosts; the plan it followed."""
    run_dir = RunDir.of(run_root(), lab.name)
    if dry_run:
        journal = Journal.load(run_dir)
        return make_plan(lab, connect_all(lab), placed_before(journal))
    with locked(run_dir, timeout + 30):
        journal = Journal.load(run_dir, force=False)
        journal.check_spec(spec, force=force)
        if os.path.lexists(run_dir.hosts_up):  # an up killed half-way (the lock is ours: it is dead)
            from vmlaunch.runtime.executor import take_down

            log.warning("an earlier up of lab %s was stopped half-way: undoing what it made first", lab.name)
            take_down(run_dir, timeout=0, spec=spec, force=force)
            with contextlib.suppress(FileNotFoundError):
                run_dir.hosts_up.unlink()
            journal = Journal.load(run_dir, force=False)
        journal.spec = os.path.realpath(spec)
        facts = connect_all(lab)
        plan = make_plan(lab, facts, placed_before(journal))
        refuse_foreign(plan.hosts, journal)
        sources, sizes = _sources(lab, plan)
        run = _Run(journal)
        run_dir.create()
        write_atomic(run_dir.hosts_up, "")  # until every host is done, or what was made is undone
        failures: dict[Any, BaseException] = {}
        try:

            def work(host: HostPlan) -> None:
                try:
                    _work(host, run, sources, sizes)
                except BaseException:
                    run.stop.set()  # the other hosts stop too
                    raise

            _, failures = parallel(list(plan.hosts), work, interrupted=run.stop.set)
        except BaseException:  # Ctrl-C: the threads stopped at their next step, and are done
            _fail(run_dir, run)
            raise
        if failures:
            real = [exc for exc in failures.values() if not isinstance(exc, Cancelled)]
            if real and not isinstance(real[0], VmlaunchError):
                _fail(run_dir, run)
                raise real[0]  # a bug: its traceback, after the rollback
            said = "\n".join(f"  {exc}" for exc in real)
            left = _fail(run_dir, run)
            if left:
                raise RuntimeFailure(
                    f"up failed, and what it made could not all be undone:\n{said}\nleft:\n"
                    + "\n".join(f"  {line}" for line in left),
                    "bring the host back, then `vmlaunch down SPEC` removes the rest",
                )
            raise RuntimeFailure(f"up failed; what it made on every host was undone:\n{said}")
        with contextlib.suppress(FileNotFoundError):
            run_dir.hosts_up.unlink()
        return plan


def _fail(run_dir: RunDir, run: _Run) -> list[str]:
    """Roll back what this up made; the marker goes once nothing it made is left undone."""
    with signals.held():
        left = _roll_back(run)
        if not left:
            with contextlib.suppress(FileNotFoundError):
                run_dir.hosts_up.unlink()
        _finish(run_dir, run.journal)
    if left:
        log.warning("rolling back, could not undo:\n%s", "\n".join(left))
    return left


def _finish(run_dir: RunDir, journal: Journal) -> None:
    """After a rollback: the journal saved, or the run dir removed when nothing is left in it."""
    from vmlaunch.runtime.executor import settle_journal

    for problem in settle_journal(journal, ()):
        log.warning("%s", problem)
