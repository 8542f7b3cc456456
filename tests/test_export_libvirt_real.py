"""`vmlaunch export --to libvirt` checked by libvirt's own tools.

- Every exported domain and network passes `virt-xml-validate` (libvirt's RelaxNG schemas).
- Round trip: for every example lab and tests/data/export/full.toml, the QEMU command line vmlaunch
  would run and the one libvirt would (`virsh domxml-to-native qemu-argv` of the exported domain)
  are taken apart into what the guest gets (machine, CPU, memory and its backing, each disk with its
  format, cache, AIO, discard and read-only, each NIC with its model and MAC, shares, PCI devices,
  balloon, serial console, kernel, firmware) and compared; every difference found must be one the
  mapping table of the manual's export guide names (`DIFFERENCES`), and the guide must name it.
- End to end: libvirt's daemon (Debian's, in a private mount and network namespace:
  tools/private_libvirt.py) defines and starts the exported test-guest lab under TCG, each guest
  prints its ready line on the logged serial console, the two VMs on the exported bridge network
  ping each other, and the domains and network are destroyed and undefined after.

One private libvirtd serves the module (it takes ~10 s to start).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import FAKE_DEVICES, ROOT, fake_host
from tests.test_export import FULL, SPECS
from tools.private_libvirt import PrivateLibvirt
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.export.libvirt import export_libvirt
from vmlaunch.host.facts import KvmStatus, Ovmf
from vmlaunch.spec.load import load_lab

pytestmark = [pytest.mark.qemu]
READY = "VMLAUNCH-GUEST-READY"
EXPORT_GUIDE = ROOT / "docs" / "guides" / "export.md"

if os.geteuid() != 0:  # pragma: no cover - CI and the README's machines run as root
    pytest.skip("a private libvirtd needs root (mount and network namespaces)", allow_module_level=True)


# --------------------------------------------------------------------------- virt-xml-validate


def test_every_export_passes_virt_xml_validate(tmp_path: Path) -> None:
    if shutil.which("virt-xml-validate") is None:
        pytest.fail("virt-xml-validate is missing: run `make setup` (Debian's libvirt-clients)")
    files = []
    for spec in SPECS:
        lab = load_lab(spec)
        every = {net.name for net in lab.networks}
        for variant, export in (("managed", export_libvirt(lab)),
                                ("bridge-mode", export_libvirt(lab, existing_bridges=every))):
            for file in export.files:
                path = tmp_path / spec.stem / variant / file.path
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(file.text)
                files.append(path)
    assert any("networks" in str(path) for path in files) and any("domains" in str(path) for path in files)
    for path in files:
        done = subprocess.run(["virt-xml-validate", str(path)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{path}:\n{done.stdout}{done.stderr}\n{path.read_text()}"
        assert f"{path} validates" in done.stdout + done.stderr


# --------------------------------------------------------------------------- the private libvirtd


@pytest.fixture(scope="module")
def libvirt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateLibvirt]:
    for tool in ("libvirtd", "virtlogd", "virsh", "iptables"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run `make setup` (Debian's libvirt packages)")
    with PrivateLibvirt(tmp_path_factory.mktemp("libvirt")) as private:
        yield private
        assert private.virsh("list", "--all", "--name").stdout.split() == []  # each test cleans up


# --------------------------------------------------------------------------- the round trip

# What may differ between the two command lines: each a row of the export guide's mapping table, found by
# the text given. Anything else the comparison finds fails the test.
DIFFERENCES = {
    "process name": "`-name process=`",
    "monitor": "its own QMP monitor",
    "run dir": "`-pidfile`, `-D`",
    "libvirt options": "`-no-shutdown`",
    "machine version": "`pc-q35-7.2`",
    "PCI topology": "`pcie-root-port`",
    "serial backend": "a pty",
    "to-native NICs": "domxml-to-native",
    "hugepage backing": "`thread-context`",
    "NUMA binding": "`host-nodes`",
    "SATA CD-ROM": "CD-ROM",
    "panics": "`pvpanic`",
    "firmware log": "`isa-debugcon`",
    "kernel command line": "`no_timer_check`",
    "command channel": "`virtserialport`",
}
DEVICE_PLUMBING = {"id", "bus", "addr", "drive", "netdev", "chardev", "fsdev", "multifunction", "port",
                   "chassis", "index", "channel", "scsi-id", "lun", "device_id", "bootindex"}
OPTION_FLAGS = {"-S", "-nodefaults", "-no-user-config", "-no-shutdown", "-daemonize"}
LIBVIRT_ONLY = {"-S", "-uuid", "-overcommit", "-rtc", "-no-shutdown", "-boot", "-sandbox", "-audiodev"}
DISK_DEVICES = {"virtio-blk-pci", "scsi-hd", "ide-hd", "ide-cd"}
NIC_DEVICES = {"virtio-net-pci", "e1000", "e1000e", "rtl8139"}


@attrs.define
class Guest:
    """What a QEMU command line gives the guest, keyed so that two command lines compare."""

    top: dict[str, Any] = attrs.Factory(dict)
    disks: dict[str, dict[str, Any]] = attrs.Factory(dict)
    nics: dict[str, dict[str, Any]] = attrs.Factory(dict)
    shares: dict[str, dict[str, Any]] = attrs.Factory(dict)
    hostdevs: dict[str, dict[str, Any]] = attrs.Factory(dict)
    balloon: dict[str, Any] | None = None
    serial: list[dict[str, Any]] = attrs.Factory(list)
    devices: list[str] = attrs.Factory(list)  # controllers and bridges
    netdevs: list[str] = attrs.Factory(list)
    options: set[str] = attrs.Factory(set)  # options about the process rather than the guest
    differences: list[tuple[str, str]] = attrs.Factory(list)  # found while reading (category, detail)


def keyvalues(text: str) -> tuple[str, dict[str, str]]:
    """`pc-q35-7.2,usb=off,a=b,,c` -> ("pc-q35-7.2", {"usb": "off", "a": "b,c"}) (",," is a comma)."""
    parts = [part.replace("\0", ",") for part in text.replace(",,", "\0").split(",")]
    implied = parts[0] if "=" not in parts[0] else ""
    pairs: dict[str, str] = {}
    for part in parts[bool(implied):]:
        key, equals, value = part.partition("=")
        pairs[key] = value if equals else "on"
    return implied, pairs


def read_argv(argv: list[str]) -> Guest:
    guest = Guest()
    options: list[tuple[str, str | None]] = []
    index = 1
    while index < len(argv):
        if argv[index] in OPTION_FLAGS:
            options.append((argv[index], None))
            index += 1
        else:
            options.append((argv[index], argv[index + 1]))
            index += 2
    nodes: dict[str, dict[str, Any]] = {}
    objects: dict[str, dict[str, Any]] = {}
    chardevs: dict[str, tuple[str, dict[str, str]]] = {}
    fsdevs: dict[str, dict[str, str]] = {}
    devices: list[dict[str, Any]] = []
    machine: dict[str, str] = {}
    for option, value in options:
        if option == "-blockdev":
            node = json.loads(value or "")
            nodes[node["node-name"]] = node
        elif option == "-object":
            obj = json.loads(value or "")
            objects[obj["id"]] = obj
        elif option == "-device":
            devices.append(json.loads(value or ""))
        elif option == "-chardev":
            chardev_kind, pairs = keyvalues(value or "")
            chardevs[pairs["id"]] = (chardev_kind, pairs)
        elif option == "-fsdev":
            _, pairs = keyvalues(value or "")
            fsdevs[pairs["id"]] = pairs
        elif option == "-machine":
            kind, machine = keyvalues(value or "")
            guest.top["machine"] = "q35" if kind == "q35" or kind.startswith("pc-q35-") else kind
            if kind.startswith("pc-q35-"):
                guest.differences.append(("machine version", kind))
            for key in ("usb", "dump-guest-core"):
                if key in machine:
                    guest.differences.append(("machine version", f"{key}={machine[key]}"))
            guest.top["mem-merge"] = machine.get("mem-merge", "on")
        elif option == "-name":
            _, pairs = keyvalues(value or "")
            if "process" in pairs:
                guest.differences.append(("process name", pairs["process"]))
        elif option == "-accel":
            guest.top["accel"] = value
        elif option == "-cpu":
            model, *parts = (value or "").split(",")
            flags: dict[str, str] = {}
            for part in parts:  # +ssse3 is ssse3=on
                key, equals, setting = part.partition("=")
                if equals:
                    flags[key] = setting
                else:
                    flags[part[1:]] = "on" if part[0] == "+" else "off"
            if model == "host" and flags.get("migratable") == "on":
                del flags["migratable"]  # QEMU's default for the host model
            guest.top["cpu"] = (model, flags)
        elif option == "-smp":
            first, pairs = keyvalues(value or "")
            cpus = int(first or pairs.get("cpus", "1"))
            # `-smp N` on a QEMU 6.2+ machine type: N cores of one socket
            guest.top["smp"] = {"cpus": cpus, "sockets": int(pairs.get("sockets", 1)),
                                "dies": int(pairs.get("dies", 1)), "cores": int(pairs.get("cores", cpus)),
                                "threads": int(pairs.get("threads", 1))}
        elif option == "-m":
            guest.top["memory_mib"] = int((value or "").rstrip("M"))
        elif option == "-append" and value is not None and value.endswith(" no_timer_check"):
            guest.top["append"] = value.removesuffix(" no_timer_check")  # vmlaunch's, under TCG
            guest.differences.append(("kernel command line", "no_timer_check"))
        elif option in ("-kernel", "-initrd", "-append"):
            guest.top[option[1:]] = value
        elif option == "-action":
            guest.differences.append(("panics", f"-action {value}"))
        elif option == "-netdev":
            guest.netdevs.append(json.loads(value or "")["type"])
        elif option == "-serial":
            guest.serial.append({"device": "isa-serial", "chardev": (value or "").removeprefix("chardev:")})
        elif option == "-mon":
            guest.differences.append(("monitor", value or ""))
        elif option in ("-pidfile", "-D"):
            guest.differences.append(("run dir", option))
        elif option in LIBVIRT_ONLY:
            guest.differences.append(("libvirt options", option))
        elif option in ("-display", "-nodefaults", "-no-user-config", "-msg"):
            guest.options.add(f"{option} {value or ''}".strip())
        else:
            raise AssertionError(f"an option the comparison does not know: {option} {value}")
    backend_id = machine.get("memory-backend")
    backend = dict(objects.pop(backend_id)) if backend_id else {"qom-type": "memory-backend-ram",
                                                                "size": guest.top["memory_mib"] << 20}
    for key in ("id", "x-use-canonical-path-for-ramblock-id", "prealloc-context"):
        if key in backend and key != "id":
            guest.differences.append(("hugepage backing", key))
        backend.pop(key, None)
    for key in ("host-nodes", "policy"):
        if key in backend:
            guest.differences.append(("NUMA binding", f"{key}={backend.pop(key)}"))
    guest.top["ram"] = backend
    for obj in objects.values():
        category = "hugepage backing" if obj["qom-type"] == "thread-context" else "libvirt options"
        guest.differences.append((category, obj["qom-type"]))
    guest.top["firmware"] = tuple(_file_of(nodes, machine[key]) for key in ("pflash0", "pflash1")
                                  if key in machine)
    boot = [d for d in devices if "bootindex" in d]
    first_boot = min(boot, key=lambda d: int(d["bootindex"]))["drive"] if boot else None
    for device in devices:
        _read_device(guest, device, nodes, fsdevs, chardevs,
                     boots=device.get("drive") == first_boot and "kernel" not in guest.top)
    for serial in guest.serial:
        backend_type, pairs = chardevs.pop(serial.pop("chardev"))
        serial.update(logged="logfile" in pairs, append=pairs.get("logappend", "off"))
        if backend_type != "socket":
            guest.differences.append(("serial backend", backend_type))
    for name, (backend_type, _) in chardevs.items():
        category = {"firmware": "firmware log", "agent": "command channel",
                    "qga": "command channel"}.get(name, "monitor")
        guest.differences.append((category, f"chardev {name} ({backend_type})"))
    return guest


def _file_of(nodes: dict[str, dict[str, Any]], name: str) -> str:
    node = nodes[name]
    while "filename" not in node:
        node = nodes[node["file"]]
    return str(node["filename"])


def _read_device(guest: Guest, device: dict[str, Any], nodes: dict[str, dict[str, Any]],
                 fsdevs: dict[str, dict[str, str]], chardevs: dict[str, tuple[str, dict[str, str]]],
                 boots: bool) -> None:
    driver = device["driver"]
    props = {key: value for key, value in device.items() if key not in DEVICE_PLUMBING}
    if driver in DISK_DEVICES:
        fmt = nodes[device["drive"]]
        if fmt.get("node-name", "").endswith("-slot"):  # vmlaunch's fault slot: raw, passing all through
            fmt = nodes[fmt["file"]]
        storage = nodes[fmt["file"]]
        if driver == "ide-cd":
            guest.differences.append(("SATA CD-ROM", storage["filename"]))
            props["driver"] = "ide-hd"
        guest.disks[storage["filename"]] = {
            **props, "format": fmt["driver"], "read-only": fmt.get("read-only", False),
            "discard": fmt.get("discard", "ignore"), "detect-zeroes": fmt.get("detect-zeroes", "off"),
            "cache": fmt.get("cache", {"direct": False, "no-flush": False}),
            "file-cache": storage.get("cache", {"direct": False, "no-flush": False}),
            "aio": storage.get("aio", "threads"), "boots": boots}
    elif driver in NIC_DEVICES:
        guest.nics[device["mac"]] = props
    elif driver == "virtio-9p-pci":
        fsdev = dict(fsdevs[device["fsdev"]])
        fsdev.pop("id")
        if fsdev.get("readonly") == "on":
            fsdev["readonly"] = "on"
        if fsdev.get("security_model") == "mapped":  # libvirt's spelling; QEMU's alias of mapped-xattr
            fsdev["security_model"] = "mapped-xattr"
        guest.shares[device["mount_tag"]] = {**props, **fsdev}
    elif driver == "vfio-pci":
        guest.hostdevs[device["host"]] = props
    elif driver == "virtio-balloon-pci":
        guest.balloon = props
    elif driver == "isa-serial":
        guest.serial.append({"device": "isa-serial", "chardev": device["chardev"]})
    elif driver in ("pcie-root-port", "pcie-pci-bridge"):
        guest.differences.append(("PCI topology", driver))
    elif driver == "pvpanic":
        guest.differences.append(("panics", driver))
    elif driver == "isa-debugcon":
        guest.differences.append(("firmware log", driver))
    elif driver in ("virtio-serial-pci", "virtserialport"):
        guest.differences.append(("command channel", driver))
    elif driver == "vmgenid":  # no PCI device: where it stands on the line moves nothing
        guest.top["vmgenid"] = True
    else:
        guest.devices.append(driver)


def compare(ours: Guest, theirs: Guest) -> list[tuple[str, str]]:
    """Every difference between the guests of two command lines, as (category, detail)."""
    found = [*ours.differences, *theirs.differences]
    if ours.netdevs != theirs.netdevs:
        as_taps = theirs.netdevs == ["tap"] * len(ours.netdevs)
        found.append(("to-native NICs" if as_taps else "unexplained",
                      f"netdevs {ours.netdevs} against {theirs.netdevs}"))
    for facet in ("top", "disks", "shares", "hostdevs", "balloon", "serial", "devices", "options"):
        mine, other = getattr(ours, facet), getattr(theirs, facet)
        if mine != other:
            found.append(("unexplained", f"{facet}: {mine} against {other}"))
    for mac in sorted(set(ours.nics) | set(theirs.nics)):
        mine, other = ours.nics.get(mac), theirs.nics.get(mac)
        if mine is None or other is None or mine["driver"] != other["driver"]:
            found.append(("unexplained", f"NIC {mac}: {mine} against {other}"))
        elif mine != other:  # what domxml-to-native leaves out of a NIC it shows as a tap
            dropped = {key for key in set(mine) | set(other) if mine.get(key) != other.get(key)}
            category = "to-native NICs" if dropped <= {"host_mtu", "mq", "vectors"} else "unexplained"
            found.append((category, f"NIC {mac}: {sorted(dropped)}"))
    return found


def native_argv(libvirt: PrivateLibvirt, xml: Path) -> list[str]:
    """The command line libvirt would run for the domain. A copy stands in when the domain has what
    domxml-to-native would act on rather than show, and what changes no device of the command line:
    automatic NUMA placement asks numad, which this host does not run (libvirt refuses without its
    advice), and an ethernet NIC's `<script>` is run (on a tap libvirt makes) to convert it."""
    text = original = xml.read_text()
    text = re.sub(r"\s*<numatune>\s*<memory [^>]*placement=\"auto\"[^>]*/>\s*</numatune>", "", text)
    text = re.sub(r"\s*<(?:down)?script path=\"[^\"]*\" />", "", text.replace('placement="auto"',
                                                                           'placement="static"'))
    if text != original:
        xml = xml.with_name(f"{xml.stem}.to-native.xml")
        xml.write_text(text)
    text = libvirt.virsh("domxml-to-native", "qemu-argv", str(xml)).stdout
    words = shlex.split(text)
    while "=" in words[0] and not words[0].startswith("/"):  # the environment libvirt sets
        words.pop(0)
    return words


ROUND_TRIP_HOST = fake_host(
    kvm=KvmStatus(True, "fake: KVM runs guests"), devices=FAKE_DEVICES | {"virtio-9p-pci"},
    ovmf=Ovmf(Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/usr/share/OVMF/OVMF_VARS_4M.fd")),
    hugepage_sizes_kib=frozenset({2048}))


@pytest.mark.libvirt
def test_round_trip_differs_only_where_the_export_guide_says(libvirt: PrivateLibvirt, tmp_path: Path) -> None:
    seen: dict[str, set[str]] = {}
    unexplained = []
    compared = 0
    for spec in SPECS:
        lab = load_lab(spec)
        plan = compile_lab(lab, ROUND_TRIP_HOST)
        for file in export_libvirt(lab).files:
            if not file.path.startswith("domains/"):
                continue
            xml = tmp_path / spec.stem / file.path
            xml.parent.mkdir(parents=True, exist_ok=True)
            xml.write_text(file.text)
            vm = plan.vm(Path(file.path).stem)
            for category, detail in compare(read_argv(list(vm.argv)), read_argv(native_argv(libvirt, xml))):
                seen.setdefault(category, set()).add(detail)
                if category not in DIFFERENCES:
                    unexplained.append(f"{spec.stem}/{vm.name}: {detail}")
            compared += 1
    assert compared >= 8
    assert unexplained == [], "\n".join(unexplained)
    guide = EXPORT_GUIDE.read_text()
    for category, marker in DIFFERENCES.items():
        assert marker in guide, f"the export guide's mapping table does not name {category!r} ({marker})"
    # the comparison sees what it is there to see: the labs have these
    assert {"PCI topology", "to-native NICs", "hugepage backing", "NUMA binding", "SATA CD-ROM"} <= set(seen)


def test_the_comparison_catches_a_changed_disk_option() -> None:
    lab = load_lab(FULL)
    argv = list(compile_lab(lab, ROUND_TRIP_HOST).vm("db").argv)
    changed = [arg.replace('"aio":"threads"', '"aio":"native"') for arg in argv]
    found = compare(read_argv(argv), read_argv(changed))
    assert [category for category, _ in found if category == "unexplained"] == ["unexplained"]
    swapped = [arg.replace("52:54:00:36:c6:49", "52:54:00:36:c6:4a") for arg in argv]
    found = compare(read_argv(argv), read_argv(swapped))
    assert any("NIC 52:54:00:36:c6:4a" in detail for _, detail in found)


# --------------------------------------------------------------------------- end to end


def e2e_lab(folder: Path, guest: Path) -> Path:
    """Two test guests on a bridge network with jumbo frames; b pings a once both are up."""
    script = ("for i in $(seq 60); do ping -c 1 -W 1 10.9.0.1 >/dev/null && break; done; "
              "ping -c 3 -W 3 10.9.0.1")
    run = base64.b64encode(script.encode()).decode()
    text = '[lab]\nname = "lvx"\n[network.lan]\nbridge = "vlbr-lvx"\nmtu = 9000\n'
    for vm, host, extra in (("a", 1, ""), ("b", 2, f" vl.run={run}")):
        text += (f'[vm.{vm}]\nmemory = "128M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                 f'initrd = "{guest}/initrd.gz"\n'
                 f'append = "console=ttyS0 vl.ip=eth0:10.9.0.{host}/24{extra}"\n'
                 f'[[vm.{vm}.disk]]\nfile = "{vm}.img"\nsize = "16M"\n'
                 f'[[vm.{vm}.nic]]\nnetwork = "lan"\n')
    spec = folder / "lab.toml"
    spec.write_text(text)
    return spec


def wait_for_log(libvirt: PrivateLibvirt, path: str, texts: list[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    log = ""
    while time.monotonic() < deadline:
        log = libvirt.run("cat", path, check=False).stdout
        if all(text in log for text in texts):
            return log
        time.sleep(1)
    raise AssertionError(f"{path} has not printed {texts} in {timeout:.0f} s:\n{log[-3000:]}")


@pytest.mark.guest
@pytest.mark.libvirt
def test_libvirt_runs_the_exported_lab(libvirt: PrivateLibvirt, tmp_path: Path, test_guest: Path) -> None:
    spec = e2e_lab(tmp_path, test_guest)
    for vm in ("a", "b"):  # what `vmlaunch up` would create: the exported domains use the files
        subprocess.run(["qemu-img", "create", "-q", "-f", "raw", str(tmp_path / f"{vm}.img"), "16M"],
                       check=True)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "vmlaunch", "export", str(spec), "--to", "libvirt",
                           "--strict", "--out", str(out)], capture_output=True, text=True, check=False,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    try:
        libvirt.virsh("net-define", str(out / "networks" / "lan.xml"))
        libvirt.virsh("net-start", "lvx-lan")
        for vm in ("a", "b"):
            libvirt.virsh("define", str(out / "domains" / f"{vm}.xml"))
            libvirt.virsh("start", f"lvx-{vm}", timeout=120)
        logs = "/var/log/libvirt/qemu"
        wait_for_log(libvirt, f"{logs}/lvx-a-serial.log", [READY], timeout=240)
        log = wait_for_log(libvirt, f"{logs}/lvx-b-serial.log", [READY, "vl: run exit"], timeout=240)
        assert "3 packets transmitted, 3 packets received, 0% packet loss" in log, log[-2000:]
        assert "vl: eth0 52:54:00:" in log  # the MAC vmlaunch derived (prefix 52:54:00)
        mac = re.search(r"vl: eth0 (\S+)", log)
        assert mac is not None and mac[1] == load_lab(spec).vm("b").nics[0].mac
        # what libvirt really ran: the bridge's MTU given to the guest, as vmlaunch does (host_mtu)
        qemu_log = libvirt.run("cat", f"{logs}/lvx-b.log").stdout
        assert '"host_mtu":9000' in qemu_log, qemu_log[-3000:]
        links = json.loads(libvirt.run("ip", "-j", "link", "show", "vlbr-lvx").stdout)
        assert links[0]["mtu"] == 9000
    finally:
        for vm in ("a", "b"):
            libvirt.virsh("destroy", f"lvx-{vm}", check=False)
            libvirt.virsh("undefine", "--nvram", f"lvx-{vm}", check=False)
        libvirt.virsh("net-destroy", "lvx-lan", check=False)
        libvirt.virsh("net-undefine", "lvx-lan", check=False)
    assert libvirt.virsh("list", "--all", "--name").stdout.split() == []
    assert libvirt.virsh("net-list", "--all", "--name").stdout.split() == []
    assert "vlbr-lvx" not in libvirt.run("ip", "-br", "link").stdout
