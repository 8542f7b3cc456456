"""A lab as KubeVirt objects: a kubevirt.io/v1 VirtualMachine per VM, a Multus
NetworkAttachmentDefinition per network its VMs share.

What lives on the lab's host becomes a reference to a cluster object, each with a name derived from
the lab (or one a user gives with `--ref KEY=VALUE`, KEY a spec key path):

- an image with a `url`: a DataVolume template per VM importing it (CDI, HTTP); an image `file`: a
  DataVolume cloned from the PVC `LAB-image-NAME` (uploaded once); `--ref image.NAME=pvc:CLAIM` or
  `=registry:IMAGE` (a containerdisk image, imported);
- a `[[disk]]` with a `size`: a blank DataVolume template of that size (`up` makes an empty image);
  one without: the PVC `LAB-FILE` (uploaded; VMs that share a read-only file share it);
  `--ref vm.V.disk[N]=pvc:CLAIM|dv:NAME|containerdisk:IMAGE`;
- a direct-boot kernel: a container image holding the kernel and initrd (`--ref vm.V.kernel=IMAGE`);
- a PCI device: the resource name the cluster's permittedHostDevices gives it (`--ref vm.V.pci[N]=NAME`).

A bridge network is the bridge CNI (on each node: VMs on different nodes are not on one LAN unless the
nodes' bridges are joined), or with `ovn_layer2` OVN-Kubernetes' layer2 topology, which spans nodes. A
socket network, vmlaunch's LAN between the lab's VMs, is one of them too. The first user network NIC
(else the management NIC of a VM with `ssh`) is the pod network, with masquerade; `virtctl ssh` reaches
the VM through it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from vmlaunch.compile.compiler import TCG_CPU, reports_free_pages, video_of
from vmlaunch.core.naming import default_bridge_name, management_mac
from vmlaunch.errors import KeyPath, UsageError, format_key_path
from vmlaunch.export import Export, ExportedFile, Findings, qualified
from vmlaunch.spec.model import (
    Accel,
    Aio,
    BalloonPolicy,
    BridgeNetwork,
    CacheMode,
    Disk,
    DiskBus,
    Firmware,
    Image,
    LabSpec,
    PciDriver,
    TapNetwork,
    UserNetwork,
    Video,
    VmSpec,
)

API = "kubevirt.io/v1"
NAD_API = "k8s.cni.cncf.io/v1"
CNI_VERSION = "0.3.1"
PART_OF = "app.kubernetes.io/part-of"
FREE_PAGE_REPORTING_DISABLED = "kubevirt.io/free-page-reporting-disabled"
CACHES = {CacheMode.NONE: "none", CacheMode.WRITEBACK: "writeback", CacheMode.WRITETHROUGH: "writethrough"}
IOS = {Aio.NATIVE: "native", Aio.THREADS: "threads"}
BUSES = {DiskBus.VIRTIO: "virtio", DiskBus.SCSI: "scsi", DiskBus.SATA: "sata"}
REF_KINDS = {"disk": ("pvc", "dv", "containerdisk"), "image": ("pvc", "registry")}


@attrs.frozen
class KubevirtOptions:
    namespace: str | None = None  # metadata.namespace of every object; None: kubectl's current one
    ovn_layer2: frozenset[str] = frozenset()  # networks exported as OVN-Kubernetes layer2
    refs: Mapping[str, str] = attrs.field(factory=dict)  # "vm.web.kernel" -> what the cluster has
    authorized_key: str | None = None  # the lab's SSH public key, for cloud-init (None: none given)


def export_kubevirt(lab: LabSpec, only: Sequence[str] = (), options: KubevirtOptions | None = None) -> Export:
    """VirtualMachines of the VMs named in `only` (all when empty) and the networks they use."""
    options = options or KubevirtOptions()
    vms = lab.select(only)
    exporter = _Exporter(lab, options)
    _check_names(lab, options)
    exporter.lab_findings()
    files: list[ExportedFile] = []
    used = {nic.network for vm in vms for nic in vm.nics}
    for net in lab.networks:
        if net.name in used and not isinstance(net, UserNetwork):
            files.append(ExportedFile(f"networks/{net.name}.yaml", dump(exporter.network(net.name))))
    for vm in vms:
        files.append(ExportedFile(f"vms/{vm.name}.yaml", dump(exporter.vm(vm))))
    unused = sorted(set(options.refs) - exporter.refs_used)
    if unused:
        raise UsageError(f"--ref {', '.join(unused)}: no such key in what is exported of {lab.file}",
                         "keys: " + (", ".join(sorted(exporter.ref_keys)) or "none"))
    return Export("kubevirt", tuple(files), exporter.findings.sorted(), tuple(exporter.todo))


def _check_names(lab: LabSpec, options: KubevirtOptions) -> None:
    unknown = sorted(set(options.ovn_layer2) - {net.name for net in lab.networks})
    if unknown:
        raise UsageError(f"--ovn-layer2 {', '.join(unknown)}: no such network in {lab.file}",
                         f"networks: {', '.join(net.name for net in lab.networks) or 'none'}")
    for net in lab.networks:
        if net.name in options.ovn_layer2 and isinstance(net, UserNetwork):
            raise UsageError(f"--ovn-layer2 {net.name}: a user network is the pod network on KubeVirt")


def claim_name(text: str) -> str:
    """A file name as a DNS label: `Lenny64_orig.img` -> `lenny64-orig-img`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "disk"


class _Exporter:
    def __init__(self, lab: LabSpec, options: KubevirtOptions) -> None:
        self.lab = lab
        self.options = options
        self.findings = Findings(lab)
        self.todo: list[str] = []
        self.refs_used: set[str] = set()
        self.ref_keys: set[str] = set()
        self.claims: dict[str, str] = {}  # file -> PVC name, shared by the VMs that use the file

    def metadata(self, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name}
        if self.options.namespace is not None:
            meta["namespace"] = self.options.namespace
        meta["labels"] = {PART_OF: self.lab.name}
        return meta

    def ref(self, path: KeyPath) -> str | None:
        key = format_key_path(path)
        self.ref_keys.add(key)
        if key in self.options.refs:
            self.refs_used.add(key)
            return self.options.refs[key]
        return None

    def todo_once(self, text: str) -> None:
        if text not in self.todo:
            self.todo.append(text)

    # ---------------------------------------------------------------- the lab

    def lab_findings(self) -> None:
        lab, add = self.lab, self.findings.add
        if lab.memory.budget_mib is not None:
            add(("lab", "memory", "budget"), "KubeVirt has no memory budget for a group of VMs",
                "a ResourceQuota on the namespace limits what its VMs may request")
        for key in ("ksm", "ksm_pages_to_scan", "ksm_sleep_ms"):
            if lab.source.defines(("lab", "memory", key)):
                add(("lab", "memory", key), "KSM is each node's setting (KubeVirt's ksmConfiguration "
                    "in the KubeVirt resource), not a VM's")
        for key in ("policy", "balance", "interval"):
            if lab.source.defines(("lab", "placement", key)):
                add(("lab", "placement", key), "where a VM runs on a node's NUMA nodes is the kubelet's "
                    "(its CPU and Topology Managers), not the VM's")

    # ---------------------------------------------------------------- networks

    def network(self, name: str) -> dict[str, Any]:
        net = self.lab.network(name)
        path: KeyPath = ("network", name)
        full = qualified(self.lab, name)
        config: dict[str, Any] = {"cniVersion": CNI_VERSION, "name": full}
        mtu = net.mtu if isinstance(net, (BridgeNetwork, TapNetwork)) else None
        if name in self.options.ovn_layer2:
            namespace = self.options.namespace or "default"
            config.update({"type": "ovn-k8s-cni-overlay", "topology": "layer2",
                           "netAttachDefName": f"{namespace}/{full}"})
            if self.options.namespace is None:
                self.todo_once(f"network {name}: OVN-Kubernetes names its attachment by namespace: apply "
                               "it in the namespace default, or export again with --namespace")
        else:
            bridge = (net.bridge if isinstance(net, BridgeNetwork)
                      else default_bridge_name(self.lab.name, name))
            config.update({"type": "bridge", "bridge": bridge})
            if isinstance(net, BridgeNetwork) and net.vlan is not None:
                config["vlan"] = net.vlan  # the bridge CNI tags the pods' ports with it
            users = [vm.name for vm in self.lab.vms if any(nic.network == name for nic in vm.nics)]
            if len(users) > 1:
                self.todo_once(f"network {name}: the bridge CNI makes the bridge {bridge} on each node: "
                               "its VMs are on one LAN when they run on one node (or the nodes' "
                               f"bridges are joined); --ovn-layer2 {name} spans nodes")
        if mtu is not None:
            config["mtu"] = mtu
        if name not in self.options.ovn_layer2:
            config["ipam"] = {}  # addresses are the guests' own (cloud-init), as vmlaunch sets them
        if isinstance(net, BridgeNetwork) and net.uplink is not None:
            self.findings.add((*path, "uplink"), "a node's uplink is the node's network set-up, not a "
                              "network attachment's", "join each node's bridge to its uplink there")
        scripts = ("up_script", "down_script") if isinstance(net, (BridgeNetwork, TapNetwork)) else ()
        for key in scripts:
            if getattr(net, key) is not None:
                self.findings.add((*path, key), "a cluster's pods are wired by their CNI plugins, not by "
                                  "scripts: the script does not carry over (the network becomes a bridge "
                                  "CNI attachment)", "a CNI plugin of the cluster's that wires the same")
        return {"apiVersion": NAD_API, "kind": "NetworkAttachmentDefinition", "metadata": self.metadata(full),
                "spec": {"config": json.dumps(config, indent=2) + "\n"}}

    # ---------------------------------------------------------------- a VM

    def vm(self, vm: VmSpec) -> dict[str, Any]:
        name = qualified(self.lab, vm.name)
        self.vm_findings(vm)
        templates: list[dict[str, Any]] = []
        disks: list[dict[str, Any]] = []
        volumes: list[dict[str, Any]] = []
        self.disks(vm, templates, disks, volumes)
        interfaces, networks = self.interfaces(vm)
        devices: dict[str, Any] = {"disks": disks}
        if interfaces:
            devices["interfaces"] = interfaces
        else:
            devices["autoattachPodInterface"] = False  # no NAT, as in vmlaunch: no NIC on a user network
        if any(nic.queues > 1 for nic in vm.nics):
            devices["networkInterfaceMultiqueue"] = True
        if not vm.balloon.enabled:
            devices["autoattachMemBalloon"] = False
        if video_of(self.lab, vm) is Video.NONE:
            devices["autoattachGraphicsDevice"] = False  # KubeVirt's own VGA (and VNC) otherwise
        devices["logSerialConsole"] = True  # the console's output, kept (the guest-console-log container)
        host_devices = self.host_devices(vm)
        if host_devices:
            devices["hostDevices"] = host_devices
        domain: dict[str, Any] = {
            "machine": {"type": vm.machine},
            "cpu": self.cpu(vm),
            "memory": self.memory(vm),
            "resources": {"requests": {"memory": f"{vm.memory_mib}Mi"}},
        }
        firmware = self.firmware(vm)
        if firmware:
            domain["firmware"] = firmware
        domain["devices"] = devices
        template_meta: dict[str, Any] = {"labels": {PART_OF: self.lab.name}}
        if vm.balloon.enabled and not reports_free_pages(vm):
            template_meta["annotations"] = {FREE_PAGE_REPORTING_DISABLED: "true"}
        spec: dict[str, Any] = {"runStrategy": "RerunOnFailure"}  # a guest that powers off stays off
        if templates:
            spec["dataVolumeTemplates"] = templates
        spec["template"] = {"metadata": template_meta,
                            "spec": {"domain": domain, "networks": networks, "volumes": volumes}}
        if not networks:
            del spec["template"]["spec"]["networks"]
        return {"apiVersion": API, "kind": "VirtualMachine", "metadata": self.metadata(name), "spec": spec}

    def vm_findings(self, vm: VmSpec) -> None:
        path: KeyPath = ("vm", vm.name)
        add = self.findings.add
        if vm.accel is Accel.TCG:
            add((*path, "accel"), "KubeVirt runs VMs under KVM; it emulates only where the cluster allows "
                "it for every VM (useEmulation in the KubeVirt resource)")
        if not vm.machine.startswith(("q35", "pc-q35")):
            add((*path, "machine"), "KubeVirt's x86 machines are q35 ones (its emulatedMachines)")
        if vm.numa_node is not None:
            add((*path, "numa_node"), "KubeVirt does not bind a VM to a NUMA node of its own choosing: "
                "the kubelet's Topology Manager places it")
        if vm.cpu_pinning:
            add((*path, "cpu_pinning"), "exported as dedicatedCpuPlacement: each vCPU on a host CPU of "
                "its own, which the kubelet's CPU Manager picks (not these numbers)")
        if vm.reserve_hugepages:
            add((*path, "reserve_hugepages"), "a node's hugepages are reserved by the node (its kernel "
                "command line or nr_hugepages), not by a VM")
        balloon = vm.balloon
        if balloon.enabled and balloon.policy is BalloonPolicy.AUTO:
            add((*path, "balloon", "policy"), "KubeVirt has no balloon policy (vmlaunch's lab manager): "
                "the guest keeps its memory, less what free page reporting gives back")
        if balloon.enabled and balloon.min_mib is not None:
            add((*path, "balloon", "min"), "KubeVirt has no balloon policy, so no minimum")
        if balloon.enabled and balloon.deflate_on_oom and self.lab.source.defines((*path, "balloon",
                                                                                    "deflate_on_oom")):
            add((*path, "balloon", "deflate_on_oom"), "KubeVirt's balloon has no deflate-on-OOM")
        if vm.video is Video.VIRTIO:
            add((*path, "video"), "KubeVirt picks the graphics device itself (VGA, or bochs under UEFI): "
                "exported as its default")
        for index, _ in enumerate(vm.shares):
            add((*path, "share", index), "a folder of the lab's host has no equivalent on a cluster: not "
                "exported (nor mounted by cloud-init)",
                "a PVC shared over virtiofs (spec.domain.devices.filesystems) is the nearest")

    def cpu(self, vm: VmSpec) -> dict[str, Any]:
        cpu: dict[str, Any] = {"sockets": 1, "cores": vm.cpus, "threads": 1}
        model = vm.cpu_model or ("host" if vm.accel is not Accel.TCG else TCG_CPU)
        if model == "max":
            self.findings.add(("vm", vm.name, "cpu_model"), "KubeVirt has no `max` CPU model: exported "
                              "as host-passthrough (the same under KVM)")
            model = "host"
        if model == "host":
            cpu["model"] = "host-passthrough"
        else:
            from vmlaunch.export.libvirt import split_cpu

            name, required, disabled = split_cpu(model)
            cpu["model"] = name
            features = ([{"name": flag, "policy": "require"} for flag in required]
                        + [{"name": flag, "policy": "disable"} for flag in disabled])
            if features:
                cpu["features"] = features
        if vm.cpu_pinning:
            cpu["dedicatedCpuPlacement"] = True
        return cpu

    def memory(self, vm: VmSpec) -> dict[str, Any]:
        memory: dict[str, Any] = {"guest": f"{vm.memory_mib}Mi"}
        if vm.hugepages is not None:
            memory["hugepages"] = {"pageSize": {"2M": "2Mi", "1G": "1Gi"}[vm.hugepages.value]}
        return memory

    def firmware(self, vm: VmSpec) -> dict[str, Any]:
        firmware: dict[str, Any] = {}
        if vm.firmware is Firmware.UEFI:
            # OVMF without Secure Boot, its variables kept across restarts as vmlaunch keeps nvram.fd
            firmware["bootloader"] = {"efi": {"secureBoot": False, "persistent": True}}
            self.todo_once("UEFI VMs keep their variables (efi.persistent): the cluster needs the "
                           "VMPersistentState feature gate")
        if vm.kernel is not None:
            path: KeyPath = ("vm", vm.name, "kernel")
            image = self.ref(path)
            if image is None:
                image = f"{self.lab.name}-{vm.name}-kernel:latest"
                self.findings.add(path, "KubeVirt boots a kernel from a container image: the image "
                                  f"exported ({image}) is a name to replace",
                                  f"build one holding /{vm.kernel.name}"
                                  + (f" and /{vm.initrd.name}" if vm.initrd else "")
                                  + f", and name it with --ref {format_key_path(path)}=IMAGE")
            container: dict[str, Any] = {"image": image, "kernelPath": f"/{vm.kernel.name}"}
            if vm.initrd is not None:
                container["initrdPath"] = f"/{vm.initrd.name}"
            boot: dict[str, Any] = {"container": container}
            if vm.append is not None:
                boot["kernelArgs"] = vm.append
            firmware["kernelBoot"] = boot
        return firmware

    # ---------------------------------------------------------------- disks

    def disks(self, vm: VmSpec, templates: list[dict[str, Any]], disks: list[dict[str, Any]],
              volumes: list[dict[str, Any]]) -> None:
        boot = vm.kernel is None
        if vm.image is not None:
            name = f"{qualified(self.lab, vm.name)}-root"
            templates.append(self.root_template(vm, self.lab.image(vm.image), name))
            disk = self.disk_entry(vm, ("vm", vm.name, "image"), "root", None, boot)
            disks.append(disk)
            volumes.append({"name": "root", "dataVolume": {"name": name}})
            boot = False
        for index, spec_disk in enumerate(vm.disks):
            path: KeyPath = ("vm", vm.name, "disk", index)
            volume = f"disk{index}"
            disks.append(self.disk_entry(vm, path, volume, spec_disk, boot))
            boot = False
            volumes.append({"name": volume, **self.disk_source(vm, path, spec_disk, templates)})
        if vm.cloud_init is not None:
            disks.append({"name": "cloudinit", "disk": {"bus": "virtio"}})
            volumes.append({"name": "cloudinit", "cloudInitNoCloud": self.cloud_init(vm)})

    def disk_entry(self, vm: VmSpec, path: KeyPath, name: str, disk: Disk | None,
                   boot: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": name}
        bus = BUSES[disk.bus] if disk is not None else "virtio"
        if disk is not None and disk.bus is DiskBus.SATA and disk.readonly:
            self.findings.add((*path, "readonly"), "libvirt, under KubeVirt, refuses a read-only SATA "
                              "disk: exported as a SATA CD-ROM, which the guest sees as a CD-ROM drive")
            entry["cdrom"] = {"bus": bus, "readonly": True}
        else:
            target: dict[str, Any] = {"bus": bus}
            if disk is not None and disk.readonly:
                target["readonly"] = True
            entry["disk"] = target
        if boot:
            entry["bootOrder"] = 1
        cache = disk.cache if disk is not None else CacheMode.NONE
        if cache in CACHES:
            entry["cache"] = CACHES[cache]
        else:
            self.findings.add((*path, "cache"), f"KubeVirt has no cache = \"{cache.value}\" (only none, "
                              "writethrough, writeback): left to KubeVirt (none where O_DIRECT works)")
        if disk is not None and disk.aio is not None:
            if disk.aio in IOS:
                entry["io"] = IOS[disk.aio]
            else:
                self.findings.add((*path, "aio"), "KubeVirt has no io_uring (only native and threads): "
                                  "left to KubeVirt")
        if disk is not None and (disk.read_error is not None or disk.write_error is not None):
            self.findings.add((*path, "on_error"), "KubeVirt has no per-disk error policy (it pauses the "
                              "VM on an I/O error): left to KubeVirt")
        if disk is not None and disk.faults:
            self.findings.add((*path, "fault"), "KubeVirt has no disk faults: the disk's [[fault]]s are "
                              "left out")
        if disk is not None and not disk.discard:
            self.findings.add((*path, "discard"), "KubeVirt passes discards through on every disk its "
                              "storage allows: there is no turning it off per disk")
        return entry

    def disk_source(self, vm: VmSpec, path: KeyPath, disk: Disk,
                    templates: list[dict[str, Any]]) -> dict[str, Any]:
        ref = self.ref(path)
        key = format_key_path(path)
        if ref is not None:
            kind, _, value = ref.partition(":")
            if kind not in REF_KINDS["disk"] or not value:
                raise UsageError(f"--ref {key}={ref}: a disk is pvc:CLAIM, dv:NAME or containerdisk:IMAGE")
            if kind == "pvc":
                return _claim(value, disk.readonly)
            if kind == "dv":
                return {"dataVolume": {"name": value}}
            return {"containerDisk": {"image": value}}
        if disk.size is not None:
            name = f"{qualified(self.lab, vm.name)}-disk{len(templates)}"
            templates.append({"metadata": {"name": name},
                              "spec": {"source": {"blank": {}}, "storage": self.storage(disk.size)}})
            return {"dataVolume": {"name": name}}
        claim = self.claim(str(disk.file))
        mode = " --access-mode=ReadOnlyMany" if disk.readonly else ""
        self.todo_once(f"upload {disk.file} as the PVC {claim}: virtctl image-upload pvc {claim} "
                       f"--image-path={disk.file} --size=SIZE{mode} (SIZE: at least its virtual size)")
        return _claim(claim, disk.readonly)

    def claim(self, file: str) -> str:
        """The PVC of a file of the lab's host, one per file: `LAB-FILENAME`, made unique."""
        if file not in self.claims:
            base = f"{self.lab.name}-{claim_name(file.rsplit('/', 1)[-1])}"[:63].rstrip("-")
            name, n = base, 1
            while name in self.claims.values():
                n += 1
                name = f"{base[:60]}-{n}"
            self.claims[file] = name
        return self.claims[file]

    def storage(self, size: int | None) -> dict[str, Any]:
        if size is None:
            return {}
        return {"resources": {"requests": {"storage": _quantity(size)}}}

    def root_template(self, vm: VmSpec, image: Image, name: str) -> dict[str, Any]:
        """The VM's own copy of its image, as vmlaunch's overlay: imported or cloned by CDI."""
        path: KeyPath = ("image", image.name)
        ref = self.ref(path)
        source: dict[str, Any]
        if ref is not None:
            kind, _, value = ref.partition(":")
            if kind not in REF_KINDS["image"] or not value:
                raise UsageError(f"--ref {format_key_path(path)}={ref}: an image is pvc:CLAIM or "
                                 "registry:IMAGE")
            source = (self.clone_source(value) if kind == "pvc"
                      else {"registry": {"url": f"docker://{value}"}})
        elif image.catalog is not None:
            url, pinned = _catalog_url(image)
            source = {"http": {"url": url}}
            if not pinned:
                self.findings.add((*path, "catalog"), "exported with the catalog entry's moving URL: "
                                  "`vmlaunch image pull` pins the build (SPEC.lock) that export then names")
        elif image.url is not None:
            source = {"http": {"url": image.url}}
            if image.checksum is not None:
                algorithm, _ = image.checksum
                self.findings.add((*path, algorithm), "CDI does not check an image's checksum when it "
                                  "imports it")
        else:
            claim = f"{self.lab.name}-image-{image.name}"
            source = self.clone_source(claim)
            self.todo_once(f"upload {image.file} as the PVC {claim}: virtctl image-upload pvc {claim} "
                           f"--image-path={image.file} --size=SIZE (each VM of the image clones it)")
        if vm.disk_size is None and "pvc" not in source:
            self.findings.add(("vm", vm.name, "image"), "CDI needs the size of a disk it imports into: "
                              "exported without one", f"set vm.{vm.name}.disk_size")
        return {"metadata": {"name": name}, "spec": {"source": source, "storage": self.storage(vm.disk_size)}}

    def clone_source(self, claim: str) -> dict[str, Any]:
        """CDI clones a PVC named with its namespace: the export's, else `default` (said so)."""
        if self.options.namespace is None:
            self.todo_once("the images' PVCs are cloned from the namespace default: export with "
                           "--namespace to name another")
        return {"pvc": {"name": claim, "namespace": self.options.namespace or "default"}}

    def cloud_init(self, vm: VmSpec) -> dict[str, Any]:
        from vmlaunch.guests import cloudinit

        # no share on a cluster, so none to mount; no host key from vmlaunch: the guest makes its own
        guest = attrs.evolve(vm, shares=())
        if self.options.authorized_key is None:
            self.todo_once("the lab has no SSH key yet (its first `vmlaunch up` makes one): the VMs' "
                           "user gets none; export again after, or add yours in cloud_init.user_data")
        key = self.options.authorized_key
        no_cloud: dict[str, Any] = {"userData": cloudinit.user_data(self.lab, guest, key, None, agent=False)}
        mgmt = self.pod_nic(vm)
        network = cloudinit.network_config(self.lab, vm, management_mac(self.lab.mac_prefix, self.lab.name,
                                                                         vm.name)
                                           if mgmt == "mgmt" else None)
        if network is not None:
            no_cloud["networkData"] = network
        return no_cloud

    # ---------------------------------------------------------------- NICs and devices

    def pod_nic(self, vm: VmSpec) -> str | None:
        """Which NIC is the pod network: the first on a user network, else the management NIC."""
        for index, nic in enumerate(vm.nics):
            if isinstance(self.lab.network(nic.network), UserNetwork):
                return f"nic{index}"
        return "mgmt" if vm.ssh else None

    def interfaces(self, vm: VmSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        interfaces: list[dict[str, Any]] = []
        networks: list[dict[str, Any]] = []
        pod = self.pod_nic(vm)
        if pod == "mgmt":
            interfaces.append({"name": "mgmt", "masquerade": {},
                               "macAddress": management_mac(self.lab.mac_prefix, self.lab.name, vm.name),
                               "model": "virtio"})
            networks.append({"name": "mgmt", "pod": {}})
        for index, nic in enumerate(vm.nics):
            path: KeyPath = ("vm", vm.name, "nic", index)
            name = f"nic{index}"
            net = self.lab.network(nic.network)
            if nic.queues > 1 and nic.queues != vm.cpus:
                self.findings.add((*path, "queues"), f"KubeVirt gives a virtio NIC one queue per vCPU "
                                  f"({vm.cpus}), not {nic.queues}")
            if isinstance(net, UserNetwork):
                if name != pod:
                    self.findings.add((*path, "network"), "KubeVirt has one pod network per VM: this "
                                      "second NIC on a user network is not exported")
                    continue
                if net.forward:
                    self.findings.add(("network", net.name, "forward"), "a pod network has no host "
                                      "port forwards", f"expose the VM with a Service: virtctl expose vm "
                                      f"{qualified(self.lab, vm.name)} --name=NAME --port=PORT "
                                      "--target-port=GUEST_PORT --type=NodePort")
                binding: dict[str, Any] = {"masquerade": {}}
                network: dict[str, Any] = {"name": name, "pod": {}}
            else:
                binding = {"bridge": {}}
                network = {"name": name, "multus": {"networkName": qualified(self.lab, nic.network)}}
            interfaces.append({"name": name, **binding, "macAddress": nic.mac, "model": nic.model.value})
            networks.append(network)
        return interfaces, networks

    def host_devices(self, vm: VmSpec) -> list[dict[str, Any]]:
        devices = []
        for index, dev in enumerate(vm.pci):
            path: KeyPath = ("vm", vm.name, "pci", index)
            if dev.driver is PciDriver.PCI_STUB:
                self.findings.add((*path, "driver"), "KubeVirt assigns devices with vfio-pci only")
            name = self.ref(path)
            if name is None:
                name = f"pci.vmlaunch/{dev.host.replace(':', '-')}"
                self.findings.add((*path, "host"), "KubeVirt assigns a PCI device by the resource name the "
                                  f"cluster gives it, not by its address: the name exported ({name}) is "
                                  "one to replace",
                                  "list the device in the KubeVirt resource's permittedHostDevices and "
                                  f"name it with --ref {format_key_path(path)}=RESOURCE")
            devices.append({"name": f"hostdev{index}", "deviceName": name})
        return devices


def _claim(name: str, readonly: bool) -> dict[str, Any]:
    claim: dict[str, Any] = {"claimName": name}
    if readonly:
        claim["readOnly"] = True
    return {"persistentVolumeClaim": claim}


def _quantity(size: int) -> str:
    """Bytes as a Kubernetes quantity: the largest binary unit that divides them."""
    for unit, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def dump(document: Mapping[str, Any]) -> str:
    """YAML as kubectl users write it: keys in the order given, multi-line text as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        # a literal block keeps text as it is, unless a line ends in spaces (YAML would drop them)
        block = "\n" in value and all(line == line.rstrip() for line in value.splitlines())
        style = "|" if block else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return str(yaml.dump(dict(document), Dumper=Dumper, sort_keys=False, default_flow_style=False,
                         allow_unicode=False, width=100))


def _catalog_url(image: Image) -> tuple[str, bool]:
    """A catalog image's URL: the pinned build's when the lock file has one, else the entry's own
    (the distribution's server: a cluster fetches it, not this host's mirror). Reads no network."""
    from vmlaunch.guests import catalog_images

    pins = catalog_images.read_lock(image.lock) if image.lock is not None else {}
    held = pins.get(image.name)
    if held is not None and held.catalog == image.catalog:
        return held.url, True
    url, _ = catalog_images.entry_of(image).locations(image.version)
    return url, False
