"""A lab as libvirt definitions: a domain XML per VM and a network XML per bridge network.

Each domain is what vmlaunch would run, as libvirt's QEMU driver writes it: the same devices, disk
options, MACs, memory backing and CPU, checked against `virsh domxml-to-native qemu-argv` by
tests/test_export_libvirt_real.py. The choices vmlaunch makes for a host assume a libvirt host that
has KVM and io_uring (the defaults `accel = "auto"` and `aio` then pick); what libvirt does itself
(vhost-net when the device exists, the monitor, PCI addresses) is left to it.

Names: domain `LAB-VM` and network `LAB-NET` (one libvirt host may hold many labs), each with a
UUID derived from them, so that defining an export again updates the same objects.
"""

from __future__ import annotations

import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from vmlaunch.compile.compiler import (
    SHARE_DMODE,
    SHARE_FMODE,
    TCG_CACHE_MIB,
    TCG_CPU,
    boot_disks,
    is_pc_machine,
    reports_free_pages,
    video_of,
)
from vmlaunch.core.naming import management_mac, vlan_link_name
from vmlaunch.errors import KeyPath
from vmlaunch.export import Export, ExportedFile, Findings, qualified
from vmlaunch.layout.labdir import LabDir
from vmlaunch.spec.model import (
    Accel,
    Aio,
    BalloonPolicy,
    BridgeNetwork,
    DiskBus,
    Firmware,
    LabSpec,
    Nic,
    PciDriver,
    PlacementPolicy,
    SocketNetwork,
    TapNetwork,
    UserNetwork,
    Video,
    VmSpec,
    needs_lab_dir,
)

VIDEO_MODELS = {Video.STD: "vga", Video.VIRTIO: "virtio", Video.NONE: "none"}
# UUIDs of exported domains and networks: version 5, from this namespace and the object's name.
UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "vmlaunch:export:libvirt")
SERIAL_LOG_DIR = Path("/var/log/libvirt/qemu")  # virtlogd's folder for domain logs
DEFAULT_AIO = Aio.IO_URING  # what vmlaunch picks on a host that has it (Debian 12's libvirt and QEMU do)
NIC_MODELS = {"virtio": "virtio", "e1000": "e1000", "e1000e": "e1000e", "rtl8139": "rtl8139"}
DISK_BUSES = {DiskBus.VIRTIO: ("vd", "virtio"), DiskBus.SCSI: ("sd", "scsi"), DiskBus.SATA: ("sd", "sata")}


def domain_type(vm: VmSpec) -> str:
    """`kvm`, unless the spec asks for TCG: libvirt has no fallback like `accel = "auto"`, and a host a
    lab moves to is expected to have KVM."""
    return "qemu" if vm.accel is Accel.TCG else "kvm"


def export_libvirt(lab: LabSpec, only: Sequence[str] = (), *,
                   existing_bridges: Collection[str] = ()) -> Export:
    """Domains of the VMs named in `only` (all when empty) and the networks they use.

    `existing_bridges` names networks exported in libvirt's bridge mode, to a bridge the libvirt
    host has already (as is every network with an `uplink`); the others become bridges libvirt
    makes, as vmlaunch does.
    """
    vms = lab.select(only)
    findings = Findings(lab)
    _lab_findings(lab, findings)
    files: list[ExportedFile] = []
    todo: list[str] = []
    used = {nic.network for vm in vms for nic in vm.nics}
    for net in lab.networks:
        if net.name in used:
            _network_findings(lab, net.name, findings)
            if isinstance(net, BridgeNetwork):
                bridge_mode = net.name in existing_bridges or net.uplink is not None
                xml = network_xml(lab, net, bridge_mode=bridge_mode)
                files.append(ExportedFile(f"networks/{net.name}.xml", xml))
                if bridge_mode:
                    port = (f"{vlan_link_name(net.uplink, net.vlan)} (VLAN {net.vlan} of {net.uplink})"
                            if net.uplink and net.vlan is not None else net.uplink)
                    todo.append(f"network {net.name}: the libvirt host needs the bridge {net.bridge}"
                                + (f", with {port} (or its own uplink) in it" if port else ""))
    if any(_auto_placed(lab, vm) for vm in vms):
        todo.append("install numad on the libvirt host: libvirt asks it where a domain with placement "
                    "'auto' runs (lab.placement.policy = \"auto\")")
    lab_dir = LabDir.of(lab.file, lab.name)
    lab_files: list[Path] = []
    for vm in vms:
        files.append(ExportedFile(f"domains/{vm.name}.xml", domain_xml(lab, vm, findings)))
        if needs_lab_dir(vm):
            vm_dir = lab_dir.vm(vm.name)
            lab_files += [path for path, wanted in ((vm_dir.overlay, vm.image is not None),
                                                    (vm_dir.seed, vm.cloud_init is not None)) if wanted]
    return Export("libvirt", tuple(files), findings.sorted(), tuple(todo), tuple(lab_files))


def _auto_placed(lab: LabSpec, vm: VmSpec) -> bool:
    """Placed by libvirt with numad's advice: the lab asks for automatic placement, and the VM has no
    node or CPUs of its own."""
    return lab.placement.policy is PlacementPolicy.AUTO and vm.numa_node is None and not vm.cpu_pinning


def _lab_findings(lab: LabSpec, findings: Findings) -> None:
    memory = lab.memory
    if memory.budget_mib is not None:
        findings.add(("lab", "memory", "budget"), "libvirt has no memory budget for a group of "
                     "domains: nothing keeps the guests under it")
    if memory.ksm:
        findings.add(("lab", "memory", "ksm"), "KSM is a setting of the whole libvirt host, not of "
                     "its domains: the domains' memory is mergeable, turning KSM on is the host's "
                     "(Debian's ksmtuned)")
    for key in ("ksm_pages_to_scan", "ksm_sleep_ms"):
        if getattr(memory, key) is not None:
            findings.add(("lab", "memory", key), "the KSM scan rate is the libvirt host's setting "
                         "(/sys/kernel/mm/ksm)")
    placement = lab.placement
    if placement.balance:
        findings.add(("lab", "placement", "balance"), "libvirt does not move running domains between "
                     "NUMA nodes: placement = 'auto' asks numad once, when a domain starts")
    if lab.source.defines(("lab", "placement", "interval")):
        findings.add(("lab", "placement", "interval"), "libvirt has no balancing, so no interval")


def _network_findings(lab: LabSpec, name: str, findings: Findings) -> None:
    net = lab.network(name)
    path: KeyPath = ("network", name)
    if isinstance(net, UserNetwork) and net.forward:
        findings.add((*path, "forward"), "libvirt's user network (QEMU's slirp) has no port "
                     "forwards: the NICs on it are exported, the forwards are not",
                     "reach the VM over a bridge network, or add a forward with "
                     "`virsh qemu-monitor-command --hmp DOMAIN 'hostfwd_add ...'` once it runs")
    if isinstance(net, SocketNetwork):
        findings.add((*path, "type"), "libvirt's multicast socket network has no local address: "
                     "its traffic is not held to the host's loopback, it takes the host's multicast "
                     "route (it may reach other hosts of the LAN)")
    if isinstance(net, BridgeNetwork) and net.uplink is not None:
        findings.add((*path, "uplink"), f"the uplink is the libvirt host's set-up: the network is "
                     f"exported in bridge mode, to a bridge {net.bridge} that host has, with "
                     f"{net.uplink} in it")
    if isinstance(net, BridgeNetwork) and net.vlan is not None:
        findings.add((*path, "vlan"), f"the uplink's VLAN link is the libvirt host's set-up too: the bridge "
                     f"{net.bridge} there needs VLAN {net.vlan} of its uplink in it")
    if isinstance(net, BridgeNetwork):
        for key in ("up_script", "down_script"):
            if getattr(net, key) is not None:
                findings.add((*path, key), "libvirt runs no script for a NIC on a network: the script "
                             "does not carry over", "run it on the libvirt host with a hook "
                             "(/etc/libvirt/hooks/qemu)")
    if isinstance(net, TapNetwork):
        findings.add((*path, "up_script"), "libvirt runs an ethernet interface's script with the tap's "
                     "name only: the VMLAUNCH_* variables the script may read are not set",
                     "make the script work from its argument alone")


def network_xml(lab: LabSpec, net: BridgeNetwork, *, bridge_mode: bool) -> str:
    """A bridge libvirt makes (and removes), like the one vmlaunch makes, or libvirt's bridge mode for
    a bridge the host has (`bridge_mode`)."""
    name = qualified(lab, net.name)
    root = ET.Element("network")
    ET.SubElement(root, "name").text = name
    ET.SubElement(root, "uuid").text = str(uuid.uuid5(UUID_NAMESPACE, f"network:{name}"))
    if bridge_mode:
        ET.SubElement(root, "forward", mode="bridge")
        ET.SubElement(root, "bridge", name=net.bridge)
    else:
        # no <forward>: an isolated LAN between the domains, as a bridge vmlaunch makes without an uplink
        ET.SubElement(root, "bridge", name=net.bridge, stp="off", delay="0")
    if net.mtu is not None:
        ET.SubElement(root, "mtu", size=str(net.mtu))
    return _text(root)


def domain_xml(lab: LabSpec, vm: VmSpec, findings: Findings, *,
               files: Callable[[Path], str] = str) -> str:
    """The VM's domain. `files` gives the host's path of each file of this machine the domain uses
    (its disks, seed, kernel, initrd and UEFI variables): a multi-host lab's volumes on its host
    (multihost/engine.py); the same paths for an export."""
    path: KeyPath = ("vm", vm.name)
    name = qualified(lab, vm.name)
    root = ET.Element("domain", type=domain_type(vm))
    ET.SubElement(root, "name").text = name
    ET.SubElement(root, "uuid").text = str(uuid.uuid5(UUID_NAMESPACE, f"domain:{name}"))
    if is_pc_machine(vm.machine):  # vmlaunch's vmgenid device: libvirt makes one new at each start
        ET.SubElement(root, "genid")
    ET.SubElement(root, "description").text = f"vmlaunch lab {lab.name}, VM {vm.name} ({lab.file})"
    ET.SubElement(root, "memory", unit="MiB").text = str(vm.memory_mib)
    ET.SubElement(root, "currentMemory", unit="MiB").text = str(vm.memory_mib)
    _memory_backing(lab, vm, root, findings)
    auto_placed = _auto_placed(lab, vm)
    ET.SubElement(root, "vcpu", placement="auto" if auto_placed else "static").text = str(vm.cpus)
    if vm.cpu_pinning:
        tune = ET.SubElement(root, "cputune")
        for index, cpu in enumerate(vm.cpu_pinning):
            ET.SubElement(tune, "vcpupin", vcpu=str(index), cpuset=str(cpu))
    if vm.numa_node is not None or auto_placed:
        numa = ET.SubElement(root, "numatune")
        # strict, with no vCPU set: libvirt also runs the vCPUs on the node's CPUs (as vmlaunch does)
        if auto_placed:
            ET.SubElement(numa, "memory", mode="strict", placement="auto")
        else:
            ET.SubElement(numa, "memory", mode="strict", nodeset=str(vm.numa_node))
    _os(lab, vm, root, files)
    features = ET.SubElement(root, "features")
    ET.SubElement(features, "acpi")  # the power button `vmlaunch down` presses
    ET.SubElement(features, "apic")
    if domain_type(vm) == "qemu":
        tcg = ET.SubElement(features, "tcg")
        ET.SubElement(tcg, "tb-cache", unit="MiB").text = str(TCG_CACHE_MIB)
    _cpu(vm, root)
    devices = ET.SubElement(root, "devices")
    _disks(lab, vm, devices, findings, files)
    ET.SubElement(devices, "controller", type="usb", model="none")  # -nodefaults: no USB
    if any(disk.bus is DiskBus.SCSI for disk in vm.disks):
        ET.SubElement(devices, "controller", type="scsi", index="0", model="virtio-scsi")
    for share in vm.shares:
        # mapped: QEMU's security_model=mapped-xattr, with vmlaunch's creation modes (compiler.shares)
        fs = ET.SubElement(devices, "filesystem", type="mount", accessmode="mapped",
                           fmode=f"{SHARE_FMODE:04o}", dmode=f"{SHARE_DMODE:04o}")
        ET.SubElement(fs, "source", dir=str(share.source))
        ET.SubElement(fs, "target", dir=share.tag)
        if share.readonly:
            ET.SubElement(fs, "readonly")
    for nic in vm.nics:
        _interface(lab, nic, devices)
    if vm.ssh:
        findings.add((*path, "ssh"), "libvirt's user network has no port forward: the VM's management "
                     "NIC (NAT) is exported, its SSH port is not",
                     "reach the VM over a bridge network, or `virsh console`")
        iface = ET.SubElement(devices, "interface", type="user")
        ET.SubElement(iface, "mac", address=management_mac(lab.mac_prefix, lab.name, vm.name))
        ET.SubElement(iface, "model", type="virtio")
    for index, dev in enumerate(vm.pci):
        if dev.driver is PciDriver.PCI_STUB:
            findings.add((*path, "pci", index, "driver"), "libvirt assigns devices with vfio-pci only "
                         "(legacy pci-stub assignment is gone from QEMU): exported as vfio-pci")
        hostdev = ET.SubElement(devices, "hostdev", mode="subsystem", type="pci", managed="yes")
        ET.SubElement(hostdev, "driver", name="vfio")
        source = ET.SubElement(hostdev, "source")
        domain, bus, slot_function = dev.host.split(":")
        slot, function = slot_function.split(".")
        ET.SubElement(source, "address", domain=f"0x{domain}", bus=f"0x{bus}", slot=f"0x{slot}",
                      function=f"0x{function}")
    # `virsh console`, and logged (a fresh log per boot)
    serial = ET.SubElement(devices, "serial", type="pty")
    ET.SubElement(serial, "log", file=str(SERIAL_LOG_DIR / f"{name}-serial.log"), append="off")
    ET.SubElement(serial, "target", type="isa-serial", port="0")
    console = ET.SubElement(devices, "console", type="pty")
    ET.SubElement(console, "target", type="serial", port="0")
    _balloon(lab, vm, devices, findings)
    # the screen `virsh screenshot` reads; no <graphics>: as in vmlaunch, never a window or a VNC port
    video = ET.SubElement(devices, "video")
    ET.SubElement(video, "model", type=VIDEO_MODELS[video_of(lab, vm)])
    return _text(root)


def _memory_backing(lab: LabSpec, vm: VmSpec, root: ET.Element, findings: Findings) -> None:
    if vm.reserve_hugepages:
        findings.add(("vm", vm.name, "reserve_hugepages"), "the hugepage pool is the libvirt host's "
                     "(vm.nr_hugepages): nothing reserves pages for the domain")
    merge = lab.memory.ksm is not False
    if vm.hugepages is None and merge:
        return
    backing = ET.SubElement(root, "memoryBacking")
    if vm.hugepages is not None:
        pages = ET.SubElement(backing, "hugepages")
        ET.SubElement(pages, "page", size=str(vm.hugepages.kib), unit="KiB")
    if not merge:
        ET.SubElement(backing, "nosharepages")  # mem-merge=off
    if vm.hugepages is not None:
        # a memfd on hugetlbfs, allocated whole when QEMU starts, as vmlaunch does
        ET.SubElement(backing, "source", type="memfd")
        ET.SubElement(backing, "allocation", mode="immediate", threads=str(vm.cpus))


def _os(lab: LabSpec, vm: VmSpec, root: ET.Element, files: Callable[[Path], str]) -> None:
    uefi = vm.firmware is Firmware.UEFI
    os_ = ET.SubElement(root, "os", firmware="efi") if uefi else ET.SubElement(root, "os")
    ET.SubElement(os_, "type", arch="x86_64", machine=vm.machine).text = "hvm"
    if uefi:
        # OVMF as vmlaunch picks it (no Secure Boot), its variables the VM's own, kept in the lab dir
        firmware = ET.SubElement(os_, "firmware")
        ET.SubElement(firmware, "feature", enabled="no", name="secure-boot")
        ET.SubElement(os_, "nvram").text = files(LabDir.of(lab.file, lab.name).vm(vm.name).nvram)
    if vm.kernel is not None:
        ET.SubElement(os_, "kernel").text = files(vm.kernel)
    if vm.initrd is not None:
        ET.SubElement(os_, "initrd").text = files(vm.initrd)
    if vm.append is not None:
        ET.SubElement(os_, "cmdline").text = vm.append


def split_cpu(text: str) -> tuple[str, list[str], list[str]]:
    """`qemu64,+ssse3,-x2apic` -> ("qemu64", ["ssse3"], ["x2apic"])."""
    model, *flags = text.split(",")
    return (model, [flag[1:] for flag in flags if flag.startswith("+")],
            [flag[1:] for flag in flags if flag.startswith("-")])


def _cpu(vm: VmSpec, root: ET.Element) -> None:
    model = vm.cpu_model or ("host" if domain_type(vm) == "kvm" else TCG_CPU)
    if model == "host":
        cpu = ET.SubElement(root, "cpu", mode="host-passthrough", check="none")
    elif model == "max":
        cpu = ET.SubElement(root, "cpu", mode="maximum", check="none")
    else:
        cpu = ET.SubElement(root, "cpu", mode="custom", match="exact", check="none")
        name, required, disabled = split_cpu(model)
        ET.SubElement(cpu, "model", fallback="forbid").text = name
    # `-smp N` on QEMU 7.2's q35: N cores of one socket
    ET.SubElement(cpu, "topology", sockets="1", dies="1", cores=str(vm.cpus), threads="1")
    if model not in ("host", "max"):
        for flag in required:
            ET.SubElement(cpu, "feature", policy="require", name=flag)
        for flag in disabled:
            ET.SubElement(cpu, "feature", policy="disable", name=flag)


def _disks(lab: LabSpec, vm: VmSpec, devices: ET.Element, findings: Findings,
           files: Callable[[Path], str]) -> None:
    lab_dir = LabDir.of(lab.file, lab.name)
    used = {"vd": 0, "sd": 0}
    for index, (path, disk) in enumerate(boot_disks(lab_dir, vm)):
        prefix, bus = DISK_BUSES[disk.bus]
        cdrom = disk.bus is DiskBus.SATA and disk.readonly
        if cdrom:
            findings.add((*path, "readonly"), "libvirt refuses a read-only SATA disk: exported as a "
                         "SATA CD-ROM, which the guest sees as a CD-ROM drive")
        element = ET.SubElement(devices, "disk", type="file", device="cdrom" if cdrom else "disk")
        options = {"name": "qemu", "type": disk.format.value, "cache": disk.cache.value,
                   "io": (disk.aio or DEFAULT_AIO).value}
        if disk.discard:
            options.update(discard="unmap", detect_zeroes="unmap")
        if disk.write_error is not None:  # libvirt spells QEMU's enospc "enospace"
            policy = disk.write_error.value
            options["error_policy"] = "enospace" if policy == "enospc" else policy
        if disk.read_error is not None:
            options["rerror_policy"] = disk.read_error.value
        ET.SubElement(element, "driver", options)
        ET.SubElement(element, "source", file=files(disk.file))
        ET.SubElement(element, "target", dev=_disk_name(prefix, used[prefix]), bus=bus)
        used[prefix] += 1
        ET.SubElement(element, "serial").text = f"disk{index}"  # the guest finds it by vmlaunch's name
        if disk.faults:
            findings.add((*path, "fault"), "libvirt has no disk faults: the disk's [[fault]]s are "
                         "left out (`vmlaunch fault` sets them in vmlaunch's own QEMUs)")
        if disk.readonly:
            ET.SubElement(element, "readonly")
        if vm.kernel is None and index == 0:
            ET.SubElement(element, "boot", order="1")
    if vm.cloud_init is not None:  # the NoCloud seed `up` writes, read-only on virtio
        element = ET.SubElement(devices, "disk", type="file", device="disk")
        ET.SubElement(element, "driver", name="qemu", type="raw")
        ET.SubElement(element, "source", file=files(lab_dir.vm(vm.name).seed))
        ET.SubElement(element, "target", dev=_disk_name("vd", used["vd"]), bus="virtio")
        ET.SubElement(element, "readonly")


def _disk_name(prefix: str, index: int) -> str:
    """vda..vdz, vdaa..: the names libvirt gives its targets."""
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("a") + rest) + letters
    return prefix + letters


def _interface(lab: LabSpec, nic: Nic, devices: ET.Element) -> None:
    net = lab.network(nic.network)
    if isinstance(net, BridgeNetwork):
        iface = ET.SubElement(devices, "interface", type="network")
        ET.SubElement(iface, "mac", address=nic.mac)
        ET.SubElement(iface, "source", network=qualified(lab, net.name))
    elif isinstance(net, UserNetwork):
        iface = ET.SubElement(devices, "interface", type="user")
        ET.SubElement(iface, "mac", address=nic.mac)
    elif isinstance(net, TapNetwork):  # a tap libvirt makes, wired by the network's scripts
        iface = ET.SubElement(devices, "interface", type="ethernet")
        ET.SubElement(iface, "mac", address=nic.mac)
        ET.SubElement(iface, "script", path=str(net.up_script))
        if net.down_script is not None:
            ET.SubElement(iface, "downscript", path=str(net.down_script))
    else:
        iface = ET.SubElement(devices, "interface", type="mcast")
        ET.SubElement(iface, "mac", address=nic.mac)
        ET.SubElement(iface, "source", address=net.group, port=str(net.port))
    ET.SubElement(iface, "model", type=NIC_MODELS[nic.model.value])
    if nic.queues > 1:
        ET.SubElement(iface, "driver", queues=str(nic.queues))
    if isinstance(net, (BridgeNetwork, TapNetwork)) and net.mtu is not None:
        ET.SubElement(iface, "mtu", size=str(net.mtu))  # the tap's, and host_mtu for a virtio guest


def _balloon(lab: LabSpec, vm: VmSpec, devices: ET.Element, findings: Findings) -> None:
    balloon = vm.balloon
    if not balloon.enabled:
        ET.SubElement(devices, "memballoon", model="none")
        return
    if balloon.policy is BalloonPolicy.AUTO:
        findings.add(("vm", vm.name, "balloon", "policy"), "libvirt has no balloon policy (vmlaunch's "
                     "lab manager): the balloon stays where it is set (`virsh setmem`)")
    if balloon.min_mib is not None:
        findings.add(("vm", vm.name, "balloon", "min"), "libvirt has no balloon policy, so no minimum")
    ET.SubElement(devices, "memballoon", model="virtio",
                  autodeflate="on" if balloon.deflate_on_oom else "off",
                  freePageReporting="on" if reports_free_pages(vm) else "off")


def _text(root: ET.Element) -> str:
    ET.indent(root, "  ")
    return ET.tostring(root, encoding="unicode") + "\n"
