"""A starter lab: the commented `lab.toml` that `vmlaunch init` writes, from its options.

Pure: options in, TOML text out. The text is written to validate as it is (tests/test_init.py loads
every variant): N VMs of a catalog image (cloud-init, optionally SSH) or of the project's tiny test
guest, on one network of the lab. Every value that comes from outside (the test guest's path) is
written as a TOML basic string through `toml_string`; the lab name is reduced to the spec's name rule
first (`lab_name`), so a folder's name cannot add a key, a table or a comment line.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
import re
import unicodedata
from pathlib import Path

import attrs

from vmlaunch.spec.catalog import Entry

SPEC_FILE = "lab.toml"
DEFAULT_VMS = 1  # one VM: a real distro under TCG boots in about a minute and holds 1G; more by --vms
MAX_VMS = 64  # the addresses below stay in one /24, and more is a typo rather than a starter lab
LAB_NAME_MAX = 20  # the spec's rule for [lab] name (the schema's pattern)
DEFAULT_LAB = "lab"
SUBNET = "10.10.0"  # the /24 of the static addresses, where the network type has them
FIRST_HOST = 11  # vm1 is 10.10.0.11, as in the manual's first real guest
BRIDGE_PREFIX = "vlbr-"  # like the demo lab's vlbr-demo; never a tap's vl-<hash> or a default vlb<hash>
IFNAME_MAX = 15  # the kernel's limit on an interface name (IFNAMSIZ less its NUL)
COLUMN = 30  # where the comment after a key starts, as in examples/lab.toml
COMMENT_WIDTH = 100  # a comment paragraph is wrapped to it

# Sizes for a real distro under TCG (a Debian guest boots to cloud-init's end in about a minute on 1G).
IMAGE_MEMORY = "1G"
IMAGE_CPUS = 2
IMAGE_DISK = "8G"
# Images whose own virtual size is more than IMAGE_DISK (their distributions build them 10G and
# larger): their overlays stay the image's size, as an overlay is never smaller than its image.
LARGE_IMAGES = ("almalinux-", "rocky-", "opensuse-leap-")
GUEST_MEMORY = "256M"  # the test guest's kernel and initramfs, as the demo lab gives them
GUEST_FILES = ("vmlinuz", "initrd.gz")  # what tools/build_guest.py writes
USER_NET_ADDRESS = "10.0.2.15/24"  # what QEMU's user network hands out (the test guest has no DHCP)

MANUAL = {
    "first-lab": "Getting started > A first lab (docs/getting-started/first-lab.md)",
    "first-real-guest": "Getting started > A first real guest (docs/getting-started/first-real-guest.md)",
    "spec": "Guides > Writing a spec (docs/guides/spec.md)",
    "keys": "Reference > Spec keys (docs/reference/spec-keys.md)",
    "catalog": "Guides > Images from the catalog (docs/guides/catalog.md)",
    "real-guests": "Guides > Real guests and images (docs/guides/real-guests.md)",
    "cloud-init": "Guides > Real guests and images (docs/guides/real-guests.md#cloud-init)",
    "test-rigs": "Guides > Test rigs (docs/guides/test-rigs.md#the-command-channel)",
    "bridge": "Guides > Networks (docs/guides/networks.md#bridge-networks)",
    "user": "Guides > Networks (docs/guides/networks.md#user-networks)",
    "socket": "Guides > Networks (docs/guides/networks.md#socket-networks)",
    "defaults": "Reference > Why these defaults (docs/reference/defaults.md)",
}


class NetworkKind(enum.Enum):
    """The networks `init` writes, the default first."""

    SOCKET = "socket"
    USER = "user"
    BRIDGE = "bridge"

    @property
    def summary(self) -> str:
        """One line on what it is, for `init --list`."""
        return {
            NetworkKind.SOCKET: "a LAN between the lab's VMs over a multicast group on the host's loopback; "
                                "no root, nothing changes on the host's network",
            NetworkKind.USER: "QEMU's user network: NAT to the outside, no root; each VM's NIC is a NAT of "
                              "its own, so the VMs do not see each other",
            NetworkKind.BRIDGE: "a host bridge with a tap per NIC: the VMs on one LAN (the host has no "
                                "address on it); `up` needs root",
        }[self]

    @property
    def net_name(self) -> str:
        return "nat" if self is NetworkKind.USER else "lan"

    @property
    def has_addresses(self) -> bool:
        """Whether the guest sets static addresses on it (QEMU's user network gives its own by DHCP)."""
        return self is not NetworkKind.USER


DEFAULT_NETWORK = NetworkKind.SOCKET


def _vm_count(instance: object, attribute: object, value: int) -> None:
    if not 1 <= value <= MAX_VMS:
        raise ValueError(f"{value} VMs: from 1 to {MAX_VMS}")


@attrs.frozen
class Starter:
    """What `init` was asked for: the lab's name, how many VMs of what, on which network."""

    lab: str
    vms: int = attrs.field(default=DEFAULT_VMS, validator=_vm_count)
    network: NetworkKind = DEFAULT_NETWORK
    image: Entry | None = None  # a catalog image; None: the tiny test guest
    ssh: bool = False  # a management NIC with a forwarded port, for `vmlaunch ssh` (images only)
    guest: Path | None = None  # the test guest's folder (kernel and initramfs), without an image

    def __attrs_post_init__(self) -> None:
        if (self.image is None) == (self.guest is None):
            raise ValueError("a starter lab has an image or the test guest, one of them")
        if self.ssh and self.image is None:
            raise ValueError("the test guest has no SSH server")
        if LAB_NAME.fullmatch(self.lab) is None:
            raise ValueError(f"{self.lab!r} is not a lab name")

    @property
    def vm_names(self) -> list[str]:
        return [f"vm{index}" for index in range(1, self.vms + 1)]


LAB_NAME = re.compile(rf"[a-z0-9]([a-z0-9-]{{0,{LAB_NAME_MAX - 2}}}[a-z0-9])?")


def lab_name(folder: str) -> str:
    """The lab name for a lab in `folder` (its name): lower case, accents dropped, every run of other
    characters one '-', at most LAB_NAME_MAX characters; DEFAULT_LAB when nothing is left."""
    ascii_only = unicodedata.normalize("NFKD", folder).encode("ascii", "ignore").decode()
    name = re.sub(r"[^a-z0-9]+", "-", ascii_only.lower()).strip("-")
    name = name[:LAB_NAME_MAX].rstrip("-")
    return name if LAB_NAME.fullmatch(name) else DEFAULT_LAB


def bridge_name(lab: str) -> str:
    """The lab's bridge: vlbr-LAB when that fits an interface name, else vlbr- with the start of the
    name and 4 characters of a hash of it (two long names that start alike get two bridges)."""
    whole = BRIDGE_PREFIX + lab
    if len(whole) <= IFNAME_MAX:
        return whole
    digest = base64.b32encode(hashlib.sha256(lab.encode()).digest()).decode().lower()[:4]
    start = lab[:IFNAME_MAX - len(BRIDGE_PREFIX) - len(digest) - 1].rstrip("-")
    return f"{BRIDGE_PREFIX}{start}-{digest}"


def image_name(entry: Entry) -> str:
    """The [image.NAME] of a catalog entry: its name, with what the spec's names do not allow ('.') as '-'."""
    return re.sub(r"[^a-z0-9-]", "-", entry.name.lower())


def toml_string(text: str) -> str:
    """`text` as a TOML basic string. JSON's escapes are TOML's; with ASCII only, DEL and every other
    control character are escaped too. A lone surrogate (a path that is not UTF-8) has none."""
    if any(0xD800 <= ord(char) <= 0xDFFF for char in text):
        raise ValueError(f"{text!r} is not UTF-8 text")
    return json.dumps(text, ensure_ascii=True)


def _line(code: str, comment: str = "") -> str:
    """`code`, and `comment` after it at COLUMN (two spaces further when the code is longer)."""
    if not comment:
        return code
    return f"{code.ljust(COLUMN - 1)} # {comment}" if len(code) < COLUMN - 1 else f"{code}  # {comment}"


def _first(first: bool, code: str, comment: str) -> str:
    """The line with its comment in the first VM's tables; the next VMs' say it without."""
    return _line(code, comment) if first else code


def _prose(*sentences: str, see: str | None = None) -> list[str]:
    """Comment lines: the sentences wrapped at COMMENT_WIDTH, then where the manual says more."""
    import textwrap

    lines = textwrap.wrap(" ".join(sentences), COMMENT_WIDTH - 2, break_on_hyphens=False)
    return [f"# {line}" for line in lines] + ([f"# See the manual: {MANUAL[see]}"] if see else [])


def lab_text(starter: Starter) -> str:
    """The commented spec of the starter lab."""
    parts = [_header(starter), _lab_table(starter)]
    if starter.image is not None:
        parts.append(_image_table(starter.image))
    parts.append(_network_table(starter))
    for index, vm in enumerate(starter.vm_names):
        parts.append(_vm_tables(starter, vm, index))
    return "\n\n".join("\n".join(part) for part in parts) + "\n"


def _header(starter: Starter) -> list[str]:
    what = starter.image.title if starter.image is not None else "the tiny test guest"
    count = f"{starter.vms} VM" + ("s" if starter.vms != 1 else "")
    return [*_prose(f"A lab written by `vmlaunch init`: {count} of {what}, on a {starter.network.value} "
                    "network."),
            *_prose("`vmlaunch validate lab.toml` checks it. Relative paths are relative to this file."),
            *_prose(f"Every key: {MANUAL['keys']}",
                    see="first-real-guest" if starter.image is not None else "first-lab")]


def _lab_table(starter: Starter) -> list[str]:
    return [*_prose(see="spec"), "[lab]",
            _line(f"name = {toml_string(starter.lab)}", "names the run dir and host resources; [a-z0-9-], "
                  f"1-{LAB_NAME_MAX} characters")]


def _image_table(entry: Entry) -> list[str]:
    lines = [*_prose(f"The image, from the catalog (`vmlaunch image catalog`): {entry.title}.",
                     "`up` (or `vmlaunch image pull lab.toml`) downloads it once into the cache, checks it "
                     "against the checksum its distribution publishes, and pins both in lab.toml.lock.",
                     see="catalog"),
             f"[image.{image_name(entry)}]",
             f"catalog = {toml_string(entry.name)}"]
    if entry.example_version:
        lines.append(_line(f"# version = {toml_string(entry.example_version)}",
                           f"a dated build instead of {toml_string(entry.version)}"))
    return lines


NETWORK_PROSE = {
    NetworkKind.SOCKET: "The network between the VMs: a LAN over a multicast group on the host's loopback. "
                        "It needs no root and changes nothing on the host's network (any local user could "
                        "join the group).",
    NetworkKind.BRIDGE: "The network between the VMs: a host bridge, with a tap per NIC on it. `up` needs "
                        "root to make them, and `down` removes them. The host has no address on the bridge.",
    NetworkKind.USER: "QEMU's user network: NAT to the outside, no root needed. Each VM's NIC on it is a NAT "
                      "of its own, inside that VM's QEMU: the VMs do not see each other on it (for a LAN "
                      "between them, type = \"socket\", or \"bridge\" as root).",
}


def _network_table(starter: Starter) -> list[str]:
    kind = starter.network
    lines = [*_prose(NETWORK_PROSE[kind], see=kind.value), f"[network.{kind.net_name}]",
             f"type = {toml_string(kind.value)}"]
    if kind is NetworkKind.BRIDGE:
        lines.append(_line(f"bridge = {toml_string(bridge_name(starter.lab))}",
                           "created by `up` when missing; at most 15 characters"))
    if kind.has_addresses and starter.image is not None:  # the test guest sets its own (vl.ip)
        lines.append(_line(f"subnet = {toml_string(SUBNET + '.0/24')}",
                           "static addresses: each NIC's ip, set by cloud-init"))
    return lines


def _vm_tables(starter: Starter, vm: str, index: int) -> list[str]:
    first = index == 0
    lines = _guest_vm(starter, vm, first) if starter.image is None else _image_vm(starter, vm, first)
    lines += ["", f"[[vm.{vm}.nic]]", f"network = {toml_string(starter.network.net_name)}"]
    if starter.network.has_addresses and starter.image is not None:
        lines.append(f"ip = {toml_string(f'{SUBNET}.{FIRST_HOST + index}')}")
    return lines


def _image_vm(starter: Starter, vm: str, first: bool) -> list[str]:
    entry = starter.image
    assert entry is not None
    lines = _prose(f"The VMs. Each boots a qcow2 overlay of the image, kept beside this file in "
                   f".vmlaunch/{starter.lab}/ (the image itself is never written); cloud-init configures "
                   "it on its first boot.", see="real-guests") if first else []
    lines += [f"[vm.{vm}]", f"image = {toml_string(image_name(entry))}",
              _first(first, f"memory = {toml_string(IMAGE_MEMORY)}",
                     "enough for the distribution under TCG too"),
              f"cpus = {IMAGE_CPUS}"]
    if not entry.name.startswith(LARGE_IMAGES):
        lines.append(_first(first, f"disk_size = {toml_string(IMAGE_DISK)}",
                            "the overlay's size; cloud-init grows the root file system to it"))
    elif first:
        lines.append(_line('# disk_size = "..."', f"left out: the image's own size, more than {IMAGE_DISK}"))
    if entry.firmware == "uefi":
        lines.append(_first(first, 'firmware = "uefi"',
                            "it boots only with UEFI (OVMF; machine q35, the default)"))
    if entry.cpu_model == "max" or entry.cpu_level:
        lines += _cpu_lines(entry, first)
    lines.append(_first(first, f"ssh = {'true' if starter.ssh else 'false'}", _ssh_comment(starter.ssh)))
    lines += ["", f"[vm.{vm}.cloud_init]",
              _first(first, 'user = "dev"',
                     "who `vmlaunch ssh` logs in as: the lab's SSH key, passwordless sudo")]
    if first:
        way_out = "the SSH NIC is its way out (NAT)" if starter.ssh else (
            "its NIC on the user network is its way out" if starter.network is NetworkKind.USER
            else "it needs a way out: ssh = true gives one (NAT)")
        lines += [_line('# packages = ["curl"]', f"installed on the first boot; {way_out}"),
                  _line('# runcmd = ["touch /var/tmp/hello"]', "run on the first boot"),
                  *_prose(see="cloud-init")]
    return lines


def _cpu_lines(entry: Entry, first: bool) -> list[str]:
    """The image needs more than QEMU's base CPU models: said where the defaults give it, set where the
    default under TCG (qemu64 with what x86-64-v2 adds) is not enough."""
    level = entry.cpu_level or "a CPU newer than QEMU's base models"
    if entry.cpu_level == "x86-64-v2":
        return _prose(f"cpu_model is left out: the image needs {level}, which the default gives (\"host\" "
                      "under KVM; under TCG, qemu64 with what x86-64-v2 adds).") if first else []
    if not first:
        return ['cpu_model = "max"']
    return [_line('cpu_model = "max"', f"the image needs {level}, more than the TCG default gives;"),
            _line("", "under KVM, \"max\" is the host's CPU"), *_prose(see="defaults")]


def _ssh_comment(ssh: bool) -> str:
    if ssh:
        return "a NIC on QEMU's user network, a 127.0.0.1 port to 22: `vmlaunch ssh`"
    return "true: a NIC for `vmlaunch ssh`; without it, `vmlaunch exec` reaches the VM"


def _guest_vm(starter: Starter, vm: str, first: bool) -> list[str]:
    assert starter.guest is not None
    kernel, initrd = (toml_string(str(starter.guest / name)) for name in GUEST_FILES)
    user = starter.network is NetworkKind.USER
    append = toml_string("console=ttyS0" + (f" vl.ip=eth0:{USER_NET_ADDRESS}" if user else ""))
    lines = []
    if first:
        addresses = "" if user else (" Each ethN gives itself 10.42.A.B/16, A.B the last two bytes of its "
                                     "MAC.")
        lines += _prose("The VMs: the project's tiny test guest, a kernel and an initramfs (busybox: no SSH "
                        "server) that tools/build_guest.py builds into the checkout's examples/guest/. It "
                        "boots in seconds, prints VMLAUNCH-GUEST-READY on its console, and `vmlaunch exec` "
                        f"reaches it through its command channel.{addresses}", see="first-lab")
        lines.append(f"# and {MANUAL['test-rigs']}")
    lines += [f"[vm.{vm}]",
              _first(first, f"memory = {toml_string(GUEST_MEMORY)}", "\"256M\", \"2G\", or a number of MiB"),
              "cpus = 1",
              _first(first, f"kernel = {kernel}", "direct kernel boot"),
              f"initrd = {initrd}",
              _first(first and user, f"append = {append}",
                     "no DHCP in the guest: the user network's address")]
    return lines
