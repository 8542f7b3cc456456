"""The lab as frozen, typed values. After `spec.load_lab` nothing is a raw dict.

Each default lives here (or in the compiler, when it depends on the host) with the reason for it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import attrs

from vmlaunch.core.naming import DEFAULT_MAC_PREFIX
from vmlaunch.core.sourcemap import SourceMap
from vmlaunch.errors import UsageError

DEFAULT_APPEND = "console=ttyS0"
MACHINE_SATA_PORTS = {"q35": 6}  # machines with a built-in AHCI controller, and its ports


def default_of(cls: type, name: str) -> Any:
    """The model's default for a field, for checks that run before the value object exists."""
    return getattr(attrs.fields(cls), name).default


class Accel(enum.Enum):
    AUTO = "auto"  # KVM when it really runs a guest on this host, else TCG
    KVM = "kvm"
    TCG = "tcg"


class CacheMode(enum.Enum):
    """QEMU's cache modes; each is (write-back cache, O_DIRECT, ignore flushes)."""

    NONE = "none"
    WRITEBACK = "writeback"
    WRITETHROUGH = "writethrough"
    DIRECTSYNC = "directsync"
    UNSAFE = "unsafe"

    @property
    def write_cache(self) -> bool:
        return self in (CacheMode.NONE, CacheMode.WRITEBACK, CacheMode.UNSAFE)

    @property
    def direct(self) -> bool:
        return self in (CacheMode.NONE, CacheMode.DIRECTSYNC)

    @property
    def no_flush(self) -> bool:
        return self is CacheMode.UNSAFE


class Aio(enum.Enum):
    IO_URING = "io_uring"
    NATIVE = "native"  # Linux AIO: needs O_DIRECT (cache none or directsync)
    THREADS = "threads"


class DiskFormat(enum.Enum):
    RAW = "raw"
    QCOW2 = "qcow2"


class DiskBus(enum.Enum):
    VIRTIO = "virtio"  # virtio-blk: the paravirtual default (IBM's "Best practices for KVM": "use virtio")
    SCSI = "scsi"  # virtio-scsi: many disks on one controller, SCSI passthrough commands
    SATA = "sata"  # AHCI: for guests without virtio drivers


class NicModel(enum.Enum):
    VIRTIO = "virtio"  # virtio-net-pci: the paravirtual default
    E1000 = "e1000"  # emulated, for guests without virtio drivers
    E1000E = "e1000e"
    RTL8139 = "rtl8139"


class PciDriver(enum.Enum):
    VFIO = "vfio-pci"
    PCI_STUB = "pci-stub"


class Firmware(enum.Enum):
    BIOS = "bios"  # SeaBIOS: QEMU's default, nothing to copy per VM
    UEFI = "uefi"  # OVMF: the code read-only and shared, a per-VM copy of the variable store


class Video(enum.Enum):
    """The VM's display device: what QMP `screendump` (`vmlaunch screenshot`) reads and what a guest's
    graphical console draws on."""

    STD = "std"  # QEMU's standard VGA (`-device VGA`, as `-vga std`): every x86 guest drives it
    VIRTIO = "virtio"  # virtio-vga: a paravirtual GPU (Linux's virtio-gpu driver), VGA-compatible at boot
    NONE = "none"  # no display device: no screen to dump, one PCI slot and 16 MiB of video memory less


class NetworkType(enum.Enum):
    BRIDGE = "bridge"
    USER = "user"
    SOCKET = "socket"
    TAP = "tap"


@attrs.frozen
class BridgeNetwork:
    """A Linux bridge on the host; each NIC on it gets a tap device enslaved to it."""

    name: str
    bridge: str
    mtu: int | None = None
    uplink: str | None = None
    subnet: str | None = None  # "10.10.0.0/24": NICs on it without an `ip` get one from it
    vlan: int | None = None  # the uplink's 802.1Q VLAN: its VLAN link is the bridge's port, not itself
    # A user's scripts, run as `SCRIPT TAP` once the tap is on the bridge / before it is removed
    # (absolute paths; resources/script.py runs them)
    up_script: Path | None = None
    down_script: Path | None = None

    type = NetworkType.BRIDGE


@attrs.frozen
class TapNetwork:
    """Taps alone, no bridge: the network's up_script (always set) wires each tap where it belongs (an
    Open vSwitch bridge, a bridge vmlaunch does not own, a routed link), its down_script unwires it."""

    name: str
    up_script: Path
    down_script: Path | None = None
    mtu: int | None = None
    subnet: str | None = None

    type = NetworkType.TAP


@attrs.frozen
class UserNetwork:
    """QEMU's user-mode network (slirp): NAT to the host, no root, `forward` = hostfwd rules."""

    name: str
    forward: tuple[str, ...] = ()

    type = NetworkType.USER


@attrs.frozen
class SocketNetwork:
    """A LAN without root: every NIC joins one multicast group on the host's loopback."""

    name: str
    group: str  # "239.x.y.z"
    port: int
    subnet: str | None = None

    type = NetworkType.SOCKET


Network = Union[BridgeNetwork, UserNetwork, SocketNetwork, TapNetwork]
TAP_NETWORKS = (BridgeNetwork, TapNetwork)  # the networks whose NICs are host taps


@attrs.frozen
class Disk:
    file: Path  # absolute
    format: DiskFormat
    size: int | None = None  # bytes; the image is created (sparse) when missing
    cache: CacheMode = CacheMode.NONE
    aio: Aio | None = None  # None: the fastest this host supports (the compiler picks)
    bus: DiskBus = DiskBus.VIRTIO
    readonly: bool = False
    discard: bool = True  # pass guest TRIM through: images stay sparse
    # Opt-ins for disk files vmlaunch refuses by default (vmlaunch/guests/diskfiles.py has the rule):
    block_device: bool = False  # the file may be a block device, not only a regular file
    accept_other_owner: bool = False  # the file, or a folder on its path, may be another user's
    read_error: OnError | None = None  # on_error.read; None: QEMU's default (report)
    write_error: OnError | None = None  # on_error.write; None: QEMU's default (enospc)
    faults: tuple[DiskFault, ...] = ()  # [[fault]]: set on the running VM before its guest runs


class FaultKind(enum.Enum):
    """A fault on a disk (spec/diskfault.py parses them, rig/diskfault.py sets them)."""

    ERROR = "error"  # requests fail with an errno (QEMU's blkdebug)
    HANG = "hang"  # requests are held until `release`
    SLOW = "slow"  # requests are throttled (QEMU's I/O limits)


@attrs.frozen
class DiskFault:
    """One fault on one disk, as `vmlaunch fault SPEC VM DISK KIND ...` and `[[vm.V.disk.fault]]` give
    it. `op`: "read", "write" or "flush" (errors), "read" or "write" (hangs), None (slow). `sector`: of
    512 bytes as the guest counts them, None: every request. `errno`: the error's name ("EIO")."""

    kind: FaultKind
    op: str | None = None
    sector: int | None = None
    once: bool = False
    errno: str = "EIO"
    bps: int | None = None  # bytes per second
    iops: int | None = None
    latency_ms: int | None = None


class OnError(enum.Enum):
    """What QEMU does when a disk's read or write fails on the host (its `rerror`, `werror`)."""

    REPORT = "report"  # the guest gets the error (EIO)
    STOP = "stop"  # the VM pauses (run state io-error) until `resume`, which retries the request
    IGNORE = "ignore"  # the guest is told the request succeeded
    ENOSPC = "enospc"  # writes: pause on ENOSPC (a full host file system), report anything else


class NetemWhere(enum.Enum):
    """Where a NIC's netem runs (spec/netem.py says what each figure does)."""

    AUTO = "auto"  # host where the host kernel has sch_netem and the NIC a host interface, else guest
    HOST = "host"  # on the NIC's tap, through netlink: any guest OS, no agent
    GUEST = "guest"  # in the guest, with its own tc, through the command channel


@attrs.frozen
class Netem:
    """Impairments of one NIC's traffic (the kernel's netem). Delay, jitter, loss, corrupt, duplicate
    and reorder apply to what the NIC sends, so once per round trip; rate to each direction. None:
    not set. Parsed by spec/netem.py, one parser for the spec, the CLI and the API."""

    delay_ms: float | None = None
    jitter_ms: float | None = None
    loss: float | None = None  # percent, 0-100
    corrupt: float | None = None
    duplicate: float | None = None
    reorder: float | None = None
    rate_bit: int | None = None  # bits per second
    where: NetemWhere = NetemWhere.AUTO


@attrs.frozen
class Nic:
    network: str
    mac: str  # always set: explicit, or derived from (lab, vm, index)
    model: NicModel = NicModel.VIRTIO
    queues: int = 1
    # A static address, "10.10.0.11/24" (given, or derived from the network's subnet); set in the
    # guest by cloud-init, matched by MAC. None: the guest configures the NIC itself.
    ip: str | None = None
    gateway: str | None = None
    dns: tuple[str, ...] = ()
    netem: Netem | None = None  # impairments `up` sets on its traffic (`netem = { ... }`)


@attrs.frozen
class Image:
    """A base image (`[image.NAME]`): fetched once into the cache (or a local file), never written;
    each VM that boots it gets a qcow2 overlay of its own."""

    name: str
    url: str | None = None  # http://, https:// or file://; None: `file`
    file: Path | None = None  # absolute
    sha256: str | None = None  # lower-case hex; a URL needs one of the two
    sha512: str | None = None
    format: DiskFormat | None = None  # None: by suffix (.qcow2, .raw), else found from the file itself
    catalog: str | None = None  # an entry of the image catalog (spec/catalog.py): url and digest come
    version: str | None = None  # from its checksum file at `image pull`, pinned in `lock`
    lock: Path | None = None  # SPEC.lock, beside the spec: where a catalog image's URL and digest are kept

    @property
    def checksum(self) -> tuple[str, str] | None:
        """("sha512", hex) or ("sha256", hex): the strongest given."""
        if self.sha512:
            return ("sha512", self.sha512)
        return ("sha256", self.sha256) if self.sha256 else None


DEFAULT_CLOUD_USER = "vmlaunch"


@attrs.frozen
class CloudInit:
    """What the VM's NoCloud seed asks of cloud-init, on top of what vmlaunch always puts in it (the
    hostname, the lab's SSH key, the VM's host keys, static addresses, share mounts)."""

    user: str = DEFAULT_CLOUD_USER  # gets the lab's SSH key and passwordless sudo
    packages: tuple[str, ...] = ()
    runcmd: tuple[str, ...] = ()
    user_data: Path | None = None  # a cloud-config file merged over the generated one


@attrs.frozen
class Share:
    """A host directory mounted in the guest over 9p (virtio)."""

    source: Path  # absolute
    target: str  # absolute path in the guest
    tag: str  # the 9p mount tag, derived from the VM and the share's index
    readonly: bool = False


@attrs.frozen
class PciDevice:
    host: str  # normalised "0000:15:00.0"
    driver: PciDriver = PciDriver.VFIO


class BalloonPolicy(enum.Enum):
    MANUAL = "manual"  # the balloon moves when a user says (`vmlaunch balloon`, the API)
    AUTO = "auto"  # the lab manager sizes the guest (policy/balloon.py)


@attrs.frozen
class Balloon:
    enabled: bool = True
    # Off, as in libvirt: with it on, Linux guests keep ballooned pages in MemTotal (the balloon only
    # shows in MemFree) and may take memory back under pressure; opt in for that safety net. With policy
    # "auto" it is on unless the spec says otherwise (spec/load.py).
    deflate_on_oom: bool = False
    free_page_reporting: bool = True  # freed guest pages go back to the host
    policy: BalloonPolicy = BalloonPolicy.MANUAL
    min_mib: int | None = None  # the least the manager leaves the guest; None: DEFAULT_MIN_SHARE of it


# `balloon.min` when the spec gives none: a quarter of the VM's memory, at least 64 MiB (what a small
# Linux guest needs to keep running while its page cache is squeezed).
DEFAULT_MIN_SHARE = 4
DEFAULT_MIN_FLOOR_MIB = 64


def balloon_min_mib(vm: VmSpec) -> int:
    """The least the lab manager may leave `vm` (`balloon.min`, or its default)."""
    if vm.balloon.min_mib is not None:
        return vm.balloon.min_mib
    return min(vm.memory_mib, max(DEFAULT_MIN_FLOOR_MIB, vm.memory_mib // DEFAULT_MIN_SHARE))


class HugepageSize(enum.Enum):
    """Guest RAM from the host's hugepages of this size (hugetlbfs through a memfd)."""

    SIZE_2M = "2M"
    SIZE_1G = "1G"

    @property
    def kib(self) -> int:
        return {"2M": 2048, "1G": 1048576}[self.value]


@attrs.frozen
class LabMemory:
    """`[lab.memory]`: what the lab's guests may hold together, and KSM while the lab runs."""

    budget_mib: int | None = None  # None: BUDGET_SHARE of the host's memory (known at compile time)
    ksm: bool | None = None  # None: on where vmlaunch may turn it on (root), else left as it is
    ksm_pages_to_scan: int | None = None  # None: the default rate (resources/ksm.py)
    ksm_sleep_ms: int | None = None


BUDGET_SHARE = 0.8  # the KVM guide: keep guests within 80 % of the host's memory


class PlacementPolicy(enum.Enum):
    AUTO = "auto"  # vmlaunch puts each VM on one NUMA node, memory and vCPUs together
    NONE = "none"  # the kernel's scheduler decides


@attrs.frozen
class LabPlacement:
    """`[lab.placement]`: where the lab's VMs run on a NUMA host (the balancer of "Improving
    the Out-of-Box KVM Performance")."""

    policy: PlacementPolicy | None = None  # None: auto on a host with more than one NUMA node, else none
    balance: bool | None = None  # None: on with policy auto
    interval_s: float = 5.0  # the seed's balancing period


@attrs.frozen
class VmSpec:
    """One VM as the spec describes it (the running VM is `api.Vm`)."""

    name: str
    memory_mib: int
    cpus: int = 1
    numa_node: int | None = None  # the host node its memory and vCPUs are bound to; None: placement's
    cpu_pinning: tuple[int, ...] = ()  # host CPU of vCPU i; a pinned VM is never balanced
    accel: Accel = Accel.AUTO
    cpu_model: str | None = None  # None: "host" under KVM, "max" under TCG
    machine: str = "q35"
    kernel: Path | None = None
    initrd: Path | None = None
    # a direct-boot kernel without a console= argument would leave the serial log empty
    append: str | None = attrs.field(
        default=attrs.Factory(lambda vm: DEFAULT_APPEND if vm.kernel else None, takes_self=True))
    # under TCG the kernel boots from the ELF its bzImage decompresses to, made once (guests/kernels.py)
    fast_boot: bool = True
    disks: tuple[Disk, ...] = ()
    nics: tuple[Nic, ...] = ()
    pci: tuple[PciDevice, ...] = ()
    balloon: Balloon = Balloon()
    image: str | None = None  # the [image.NAME] its first disk is an overlay of
    disk_size: int | None = None  # bytes: the overlay's virtual size (None: the image's)
    firmware: Firmware = Firmware.BIOS
    cloud_init: CloudInit | None = None  # always set when the VM has an image
    shares: tuple[Share, ...] = ()
    ssh: bool = False  # a management NIC with a 127.0.0.1 port forwarded to 22, and `vmlaunch ssh`
    hugepages: HugepageSize | None = None  # guest RAM from hugepages of this size
    reserve_hugepages: bool = False  # vmlaunch raises nr_hugepages for it, and gives them back
    # the command channel (virtio-serial ports for vmlaunch's agent and QEMU's guest agent); None: on
    # when vmlaunch configures the guest (`agent_on`)
    agent: bool | None = None
    # On by default: a test rig expects `screenshot` to show the guest's screen, as a libvirt or
    # NixOS-test VM has one. Left out, on a machine or QEMU without VGA, the VM has none (compiler).
    video: Video = Video.STD
    host: str | None = None  # the [host.NAME] it runs on (a multi-host lab); None: placement's
    template: bool = False  # `vmlaunch run` starts it from a warm template, made on first use


def agent_on(vm: VmSpec) -> bool:
    """Whether the VM has the command channel: as `agent` says, else when vmlaunch configures the
    guest, through its cloud-init seed (which installs vmlaunch's agent) or by booting its kernel
    itself (the project's test guest has the agent built in)."""
    if vm.agent is not None:
        return vm.agent
    return vm.cloud_init is not None or vm.kernel is not None


def needs_lab_dir(vm: VmSpec) -> bool:
    """A VM keeps files beside the spec when it boots an image, has a seed or UEFI variables."""
    return vm.image is not None or vm.cloud_init is not None or vm.firmware is Firmware.UEFI


@attrs.frozen
class HostSpec:
    """`[host.NAME]`: a libvirt host the lab's VMs may run on (spec/hosts.py reads its URI)."""

    name: str
    uri: str  # any libvirt URI: qemu:///system, qemu+ssh://root@host/system?keyfile=...
    address: str | None = None  # its address on the network carrying the lab's tunnels; None: the URI's host


@attrs.frozen
class LabSpec:
    """The lab as the spec describes it (the lab brought up is `api.Lab`)."""

    name: str
    file: Path  # the spec file, absolute
    source: SourceMap = attrs.field(eq=False, repr=False)  # key path -> line, for messages
    networks: tuple[Network, ...] = ()
    vms: tuple[VmSpec, ...] = ()
    mac_prefix: str = DEFAULT_MAC_PREFIX
    images: tuple[Image, ...] = ()
    memory: LabMemory = LabMemory()
    placement: LabPlacement = LabPlacement()
    boot_parallel: int | None = None  # how many VMs boot at once (`up` waiting); None: from the host
    hosts: tuple[HostSpec, ...] = ()  # libvirt hosts: none, and the lab runs here as vmlaunch's QEMUs

    def host(self, name: str) -> HostSpec:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def image(self, name: str) -> Image:
        for image in self.images:
            if image.name == name:
                return image
        raise KeyError(name)

    def network(self, name: str) -> Network:
        for net in self.networks:
            if net.name == name:
                return net
        raise KeyError(name)

    def vm(self, name: str) -> VmSpec:
        for vm in self.vms:
            if vm.name == name:
                return vm
        raise KeyError(name)

    def select(self, names: Sequence[str] = ()) -> tuple[VmSpec, ...]:
        """The VMs named (all of them when none are): the one check of VM names a user gives."""
        known = [vm.name for vm in self.vms]
        unknown = [name for name in names if name not in known]
        if unknown:
            raise UsageError(f"{self.file}: no VM named {', '.join(map(repr, unknown))}",
                             f"VMs in this lab: {', '.join(known) or 'none'}")
        return tuple(vm for vm in self.vms if not names or vm.name in names)
