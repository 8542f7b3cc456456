"""The compiler against a fake Host: golden argv per example, defaults, host-driven choices, safety."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import EXAMPLES, fake_host, write_spec
from tests.test_qemuopts import split_qemu_opts
from vmlaunch.compile.compiler import TCG_CPU, compile_lab
from vmlaunch.compile.plan import Plan
from vmlaunch.core.naming import tap_name
from vmlaunch.errors import HostError, UsageError
from vmlaunch.host.facts import KvmStatus
from vmlaunch.resources.base import Resource
from vmlaunch.resources.bridge import Bridge
from vmlaunch.resources.image import Image
from vmlaunch.resources.ksm import Ksm, default_settings
from vmlaunch.resources.manager import LabManager
from vmlaunch.resources.pci import PciBind
from vmlaunch.resources.script import ScriptEnv, TapScript
from vmlaunch.resources.tap import Tap
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import Accel, DiskFormat, PciDriver

GOLDEN = Path(__file__).parent / "golden"
EXAMPLE_SPECS = sorted(EXAMPLES.glob("*.toml"))
HEAD = '[lab]\nname = "t"\n'


def argv_of(spec: Path, vm: str = "a", **host: object) -> list[str]:
    return list(compile_lab(load_lab(spec), fake_host(**host)).vm(vm).argv)


def option(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


def devices(argv: list[str]) -> list[dict[str, object]]:
    return [json.loads(arg) for arg in option(argv, "-device")]


def host_changes(plan: Plan) -> tuple[Resource, ...]:
    """What the plan does to the host: its resources but the lab manager, which every lab has (a
    process of the lab's own, not a change to the host)."""
    managers = [r for r in plan.resources if isinstance(r, LabManager)]
    assert len(managers) == 1
    return tuple(r for r in plan.resources if not isinstance(r, LabManager))


@pytest.mark.parametrize("spec", EXAMPLE_SPECS, ids=lambda p: p.stem)
def test_golden_argv(spec: Path) -> None:
    """Set UPDATE_GOLDEN=1 to rewrite the golden files after an intended change."""
    plan = compile_lab(load_lab(spec), fake_host())
    got = {vm.name: [arg.replace(str(EXAMPLES), "{EXAMPLES}") for arg in vm.argv]
           for vm in plan.vms}
    golden = GOLDEN / f"{spec.stem}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(golden.read_text())


def test_demo_plan_actions() -> None:
    plan = compile_lab(load_lab(EXAMPLES / "lab.toml"), fake_host())
    assert plan.run_dir.path == Path("/run/vmlaunch/demo")
    assert host_changes(plan) == (
        Image(path=EXAMPLES / "alpha.img", size=64 << 20, format=DiskFormat.RAW, vm="alpha"),
        Bridge(name="vlbr-demo", network="lan"),
        Tap(ifname=tap_name("demo", "alpha", 0), bridge="vlbr-demo", vm="alpha"),
        Tap(ifname=tap_name("demo", "beta", 0), bridge="vlbr-demo", vm="beta"),
        Ksm(settings=default_settings(True, 256 + 256)),  # two VMs as root: KSM while the lab runs
    )
    assert all(len(a.ifname) <= 15 for a in plan.resources if isinstance(a, Tap))


def test_only_named_vms() -> None:
    plan = compile_lab(load_lab(EXAMPLES / "lab.toml"), fake_host(), ["beta"])
    assert [vm.name for vm in plan.vms] == ["beta"]
    assert not any(isinstance(a, Image) for a in plan.resources)
    with pytest.raises(UsageError, match="no VM named 'gamma'"):
        compile_lab(load_lab(EXAMPLES / "lab.toml"), fake_host(), ["gamma"])


def test_best_practice_defaults(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.n]\n[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.a.disk]]\nfile = "d.img"\n[[vm.a.nic]]\nnetwork = "n"\n')
    argv = argv_of(spec)
    assert option(argv, "-machine") == ["q35"]
    assert option(argv, "-cpu") == [TCG_CPU]  # TCG: -cpu host needs KVM
    assert option(argv, "-smp") == ["1"]
    file_node, fmt_node, slot = (json.loads(a) for a in option(argv, "-blockdev"))
    assert file_node["aio"] == "io_uring"
    # the device reads and writes through its fault slot: raw over the format node, for disk faults
    assert (slot["driver"], slot["node-name"], slot["file"]) == ("raw", "disk0-slot", "disk0")
    assert file_node["cache"] == {"direct": True, "no-flush": False}  # cache=none
    blk, nic, balloon, panic, genid, channels, agent, qga, video = devices(argv)
    assert panic == {"driver": "pvpanic", "id": "pvpanic"}  # a panic is seen at once
    assert genid == {"driver": "vmgenid", "id": "vmgenid0"}  # a new generation id at each start
    assert channels["driver"] == "virtio-serial-pci"  # the command channel: on for a direct boot
    assert (agent["name"], qga["name"]) == ("org.vmlaunch.agent.0", "org.qemu.guest_agent.0")
    assert video == {"driver": "VGA", "id": "video0"}  # a screen for `screenshot`, last: slots stay
    assert option(argv, "-action") == ["panic=pause"]  # and kept, for status and logs
    assert (blk["driver"], blk["write-cache"], blk["drive"]) == ("virtio-blk-pci", "on", "disk0-slot")
    assert nic["driver"] == "virtio-net-pci"
    assert "vhost" not in json.loads(option(argv, "-netdev")[0])
    assert balloon["driver"] == "virtio-balloon-pci"
    assert "-nodefaults" in argv and "-pidfile" in argv


def test_kvm_when_it_runs_guests(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n')
    plan = compile_lab(load_lab(spec), fake_host(kvm=KvmStatus(True, "ran a guest")))
    assert plan.vms[0].accel.accel is Accel.KVM
    assert option(list(plan.vms[0].argv), "-accel") == ["kvm"]
    assert option(list(plan.vms[0].argv), "-cpu") == ["host"]


def test_explicit_kvm_on_a_host_without_it(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\naccel = "kvm"\nkernel = "k"\n')
    with pytest.raises(HostError) as info:
        compile_lab(load_lab(spec), fake_host())
    assert str(info.value).startswith(f"{spec}:5: vm.a.accel: accel = \"kvm\", but fake: no KVM")


@pytest.mark.parametrize(("cache", "io_uring", "aio"), [
    ("none", True, "io_uring"), ("writeback", True, "io_uring"),
    ("none", False, "native"), ("directsync", False, "native"),
    ("writeback", False, "threads"), ("writethrough", False, "threads"),
])
def test_fastest_aio_this_host_supports(tmp_path: Path, cache: str, io_uring: bool,
                                        aio: str) -> None:
    spec = write_spec(tmp_path, HEAD + f'[vm.a]\nmemory = 64\n[[vm.a.disk]]\nfile = "d"\n'
                      f'cache = "{cache}"\n')
    file_node = json.loads(option(argv_of(spec, io_uring=io_uring), "-blockdev")[0])
    assert file_node["aio"] == aio


def test_io_uring_asked_for_but_missing(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\n[[vm.a.disk]]\nfile = "d"\n'
                      'aio = "io_uring"\n')
    with pytest.raises(HostError, match=r":7: vm.a.disk\[0\].aio: aio = \"io_uring\", but"):
        argv_of(spec, io_uring=False)


def test_vhost_only_with_dev_vhost_net(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.n]\n[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.a.nic]]\nnetwork = "n"\nqueues = 4\n')
    netdev = json.loads(option(argv_of(spec, vhost_net=True), "-netdev")[0])
    assert (netdev["vhost"], netdev["queues"]) == (True, 4)
    assert devices(argv_of(spec))[0]["vectors"] == 10


def test_boot_from_first_disk(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\n[[vm.a.disk]]\nfile = "a"\n'
                      '[[vm.a.disk]]\nfile = "b"\nbus = "sata"\n')
    first, second = devices(argv_of(spec))[:2]
    assert first["bootindex"] == 0 and "bootindex" not in second
    assert (second["driver"], second["bus"]) == ("ide-hd", "ide.0")


def test_a_read_only_sata_disk_is_a_cd_rom_drive(tmp_path: Path) -> None:
    """QEMU's ide-hd refuses a read-only node: the drive is ide-cd, as libvirt and KubeVirt have it."""
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.disk]]\nfile = "a"\n'
                      'bus = "sata"\nreadonly = true\n[[vm.a.disk]]\nfile = "b"\nbus = "sata"\n')
    first, second = devices(argv_of(spec))[:2]
    assert (first["driver"], first["bus"], first["serial"]) == ("ide-cd", "ide.0", "disk0")
    assert (second["driver"], second["bus"]) == ("ide-hd", "ide.1")


def test_pass_through(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.a.pci]]\nhost = "15:00.0"\n')
    plan = compile_lab(load_lab(spec), fake_host())
    assert devices(list(plan.vms[0].argv))[0] == {"driver": "vfio-pci", "id": "hostdev0",
                                                  "host": "0000:15:00.0"}
    assert plan.resources[0] == PciBind(address="0000:15:00.0", driver=PciDriver.VFIO, vm="a")
    assert "-pcidevice" not in plan.vms[0].argv


def test_pci_stub_needs_legacy_assignment(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.a.pci]]\nhost = "15:00.0"\ndriver = "pci-stub"\n')
    with pytest.raises(HostError, match=r":8: vm.a.pci\[0\].driver: driver = \"pci-stub\" is for "
                       r"QEMU's legacy device assignment"):
        argv_of(spec)
    old = fake_host(devices=frozenset({"pci-assign", "virtio-balloon-pci"}))
    argv = list(compile_lab(load_lab(spec), old).vms[0].argv)
    assert devices(argv)[0]["driver"] == "pci-assign"


def test_missing_device_is_named(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n')
    with pytest.raises(HostError, match=r"vm.a.balloon: this QEMU \(7.2.0\) has no "
                       "virtio-balloon-pci device"):
        argv_of(spec, devices=frozenset())


def test_long_run_dir_is_refused(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n')
    with pytest.raises(HostError, match="VMLAUNCH_RUN_DIR"):
        argv_of(spec, run_root=Path("/" + "x" * 100))


def test_overcommit_is_noted() -> None:
    plan = compile_lab(load_lab(EXAMPLES / "seed-passthrough.toml"), fake_host(memory_mib=3000))
    assert "8 vCPUs on a host with 2 CPUs" in plan.vms[0].notes[0]
    assert plan.notes == ("VM lenny64guest1 asks for 3G (3072 MiB) of memory, more than 80% of the host's "
                          "3000 MiB; ballooning and KSM help, swapping hurts every guest",)
    assert compile_lab(load_lab(EXAMPLES / "seed-passthrough.toml"), fake_host()).notes == ()


NASTY = st.text(alphabet=st.sampled_from(list(",=:\"'{}\\ -?a/.\n")), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NASTY, append=NASTY)
def test_no_spec_value_adds_an_option(tmp_path: Path, name: str, append: str) -> None:
    """File names and kernel arguments stay single values, whatever they contain."""
    spec = tmp_path / "lab.toml"
    spec.write_text(HEAD + f"[vm.a]\nmemory = 64\nkernel = {json.dumps(name)}\n"
                    f"append = {json.dumps(append)}\n[[vm.a.disk]]\nfile = {json.dumps(name)}\n")
    argv = argv_of(spec)
    expected = str(tmp_path / os.path.expanduser(name))
    assert option(argv, "-kernel") == [expected]
    assert option(argv, "-append") == [f"{append} no_timer_check"]  # under TCG (compiler.kernel_append)
    assert json.loads(option(argv, "-blockdev")[0])["filename"] == expected
    for value in option(argv, "-chardev"):
        assert all("=" in part for part in split_qemu_opts(value)[1:])
    plain = argv_of(write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n'
                               'append = "x"\n[[vm.a.disk]]\nfile = "d"\n', "plain.toml"))
    assert len(argv) == len(plain)
    assert [a for a, p in zip(argv, plain) if p.startswith("-")] == [
        p for p in plain if p.startswith("-")]


def test_socket_network_is_a_loopback_multicast_lan(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.lan]\ntype = "socket"\n[network.fixed]\ntype = "socket"\n'
                      'mcast = "239.1.2.3:5000"\n[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.a.nic]]\nnetwork = "lan"\n[[vm.a.nic]]\nnetwork = "fixed"\n')
    plan = compile_lab(load_lab(spec), fake_host())
    derived, fixed = (json.loads(arg) for arg in option(list(plan.vms[0].argv), "-netdev"))
    assert derived["type"] == "socket" and derived["localaddr"] == "127.0.0.1"
    assert derived["mcast"].startswith("239.")
    assert fixed["mcast"] == "239.1.2.3:5000"
    assert host_changes(plan) == ()  # nothing on the host: no root needed
    other = write_spec(tmp_path, HEAD.replace('"t"', '"u"') + '[network.lan]\ntype = "socket"\n'
                       '[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "lan"\n', "u.toml")
    other_netdev = json.loads(option(list(compile_lab(load_lab(other), fake_host()).vms[0].argv),
                                     "-netdev")[0])
    assert other_netdev["mcast"] != derived["mcast"]  # labs do not share a segment


def test_a_tap_network_plans_taps_and_their_scripts(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.ovs]\ntype = "tap"\nup_script = "ifup"\n'
                      'down_script = "ifdown"\nmtu = 9000\n[network.lan]\nbridge = "br-lan"\n'
                      'up_script = "/etc/lan-up"\n[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.a.nic]]\nnetwork = "ovs"\nip = "10.1.0.5/24"\n[[vm.a.nic]]\nnetwork = "lan"\n')
    plan = compile_lab(load_lab(spec), fake_host())
    taps = [tap_name("t", "a", index) for index in (0, 1)]
    mac = [nic.mac for nic in load_lab(spec).vms[0].nics]
    assert host_changes(plan) == (
        Bridge(name="br-lan", network="lan"),
        Tap(ifname=taps[0], bridge=None, vm="a", mtu=9000),
        TapScript(network="ovs", up_script=tmp_path / "ifup", down_script=tmp_path / "ifdown",
                  env=ScriptEnv(lab="t", vm="a", nic=0, network="ovs", tap=taps[0], mac=mac[0], mtu=9000,
                                ip="10.1.0.5/24")),
        Tap(ifname=taps[1], bridge="br-lan", vm="a"),
        TapScript(network="lan", up_script=Path("/etc/lan-up"), down_script=None,
                  env=ScriptEnv(lab="t", vm="a", nic=1, network="lan", tap=taps[1], mac=mac[1],
                                bridge="br-lan")),
    )
    netdevs = [json.loads(arg) for arg in option(list(plan.vms[0].argv), "-netdev")]
    assert netdevs[0] == {"type": "tap", "id": "net0", "ifname": taps[0], "script": "no", "downscript": "no"}
    assert devices(list(plan.vms[0].argv))[0]["host_mtu"] == 9000
    scripted = [r for r in plan.resources if isinstance(r, TapScript)]
    assert scripted[0].origin is not None and str(scripted[0].origin.location("up_script")) == \
        f"{spec}:5: network.ovs.up_script:"


def test_a_vlan_needs_8021q(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.lan]\nbridge = "br-lan"\nuplink = "eth1"\nvlan = 42\n'
                      '[network.idle]\nuplink = "eth2"\nvlan = 7\n'
                      '[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "lan"\n')
    plan = compile_lab(load_lab(spec), fake_host(vlan_8021q=True))
    assert plan.resources[0] == Bridge(name="br-lan", network="lan", uplink="eth1", vlan=42)
    assert plan.resources[0].port == "eth1.42"
    with pytest.raises(HostError) as caught:
        compile_lab(load_lab(spec), fake_host(vlan_8021q=False))
    assert str(caught.value) == (
        f"{spec}:6: network.lan.vlan: VLAN 42 of eth1: this kernel lacks 802.1Q VLAN support (no 8021q "
        "module loaded, built in or installed)\n  hint: load the module: `modprobe 8021q` (a kernel built "
        "with CONFIG_VLAN_8021Q); or tag the VLAN elsewhere: a switch port, Open vSwitch through type = "
        "\"tap\" scripts (examples/ovs.toml)")
    assert caught.value.exit_code == 3
    alone = write_spec(tmp_path, HEAD + '[network.idle]\nuplink = "eth2"\nvlan = 7\n'
                       '[vm.a]\nmemory = 64\nkernel = "k"\n', "idle.toml")
    compile_lab(load_lab(alone), fake_host(vlan_8021q=False))  # no VM on it: nothing to refuse


# --- the screen (`video`) ------------------------------------------------------------------------


@pytest.mark.parametrize(("line", "expected"), [
    ("", "VGA"), ('video = "std"\n', "VGA"), ('video = "virtio"\n', "virtio-vga"),
    ('video = "none"\n', None)])
def test_a_screen_for_screenshots(tmp_path: Path, line: str, expected: str | None) -> None:
    spec = write_spec(tmp_path, HEAD + f'[vm.a]\nmemory = 64\nkernel = "k"\n{line}')
    argv = argv_of(spec)
    screens = [d for d in devices(argv) if d.get("id") == "video0"]
    assert screens == ([{"driver": expected, "id": "video0"}] if expected else [])
    assert option(argv, "-display") == ["none"]  # read over QMP, never shown in a window


def test_no_default_screen_where_there_is_no_vga(tmp_path: Path) -> None:
    left_out = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\nmachine = "microvm"\n')
    assert not [d for d in devices(argv_of(left_out)) if d.get("id") == "video0"]
    plain = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n', "plain.toml")
    assert not [d for d in devices(argv_of(plain, devices=frozenset({"virtio-balloon-pci", "pvpanic"})))
                if d.get("id") == "video0"]
    asked = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\nvideo = "virtio"\n', "asked.toml")
    with pytest.raises(HostError, match=r"asked.toml:6: vm.a.video: this QEMU \(.*\) has no virtio-vga"):
        argv_of(asked, devices=frozenset({"virtio-balloon-pci", "VGA"}))


@pytest.mark.parametrize("bus", ["virtio", "scsi", "sata"])
def test_on_error_becomes_the_devices_rerror_and_werror(tmp_path: Path, bus: str) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\n'
                      f'[[vm.a.disk]]\nfile = "d.img"\nbus = "{bus}"\n'
                      'on_error = { read = "stop", write = "enospc" }\n'
                      f'[[vm.a.disk]]\nfile = "e.img"\nbus = "{bus}"\n')
    disks = [device for device in devices(argv_of(spec)) if device.get("drive")]
    assert (disks[0]["rerror"], disks[0]["werror"]) == ("stop", "enospc")
    assert "rerror" not in disks[1] and "werror" not in disks[1]  # QEMU's defaults when absent
