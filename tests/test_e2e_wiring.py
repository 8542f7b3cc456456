"""End to end: networks wired by a user's scripts, VLAN uplinks, the Open vSwitch example: the real
`vmlaunch up` / `down` with QEMU (TCG) and the test guest, each test in network namespaces of its own
(tests/test_e2e.py's), so the host's own network is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_e2e import READY, Netns, assert_clean, lab, netns_named, pair, qemu_pids
from vmlaunch.core.naming import tap_name
from vmlaunch.spec.load import load_lab

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def netns() -> Iterator[Netns]:
    with netns_named() as made:
        yield made


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def marks(folder: Path) -> list[str]:
    path = folder / "marks"
    return path.read_text().splitlines() if path.exists() else []


def ports(netns: Netns, bridge: str) -> set[str]:
    return {link["ifname"] for link in json.loads(netns.ip("-j", "link", "show", "master", bridge))}


def test_scripts_wire_taps_and_unwire_them_once_after_a_crash(tmp_path: Path, netns: Netns,
                                                             test_guest: Path) -> None:
    """A tap network: the up_script puts each tap on a bridge the test made (vmlaunch makes none) and
    writes a mark; two VMs ping over it. The spec then changes, both QEMUs are killed (-9), and `down`
    runs the down_script recorded at `up` once per tap."""
    netns.ip("link", "add", "br-test", "type", "bridge")
    netns.ip("link", "set", "br-test", "up")
    script(tmp_path / "ifup", 'set -e\nip link set "$1" master br-test\n'
           'echo "up $1 $VMLAUNCH_LAB $VMLAUNCH_VM $VMLAUNCH_NIC $VMLAUNCH_NETWORK $VMLAUNCH_MAC '
           '$VMLAUNCH_MTU ${VMLAUNCH_BRIDGE:-nobridge} $(cat /sys/class/net/$1/mtu)" >> marks\n')
    script(tmp_path / "ifdown", 'ip link set "$1" nomaster\n'
           'echo "down $1 $VMLAUNCH_VM $VMLAUNCH_ACTION" >> marks\n')
    script(tmp_path / "other", 'echo "the spec changed: not me" >> marks\n')
    network = '[network.lan]\ntype = "tap"\nup_script = "./ifup"\ndown_script = "./ifdown"\nmtu = 1400'
    spec = lab(tmp_path, test_guest, pair("wired", network, ping="10.9.0.1"))
    done = netns.vmlaunch("up", str(spec), "--wait-for", READY, "--timeout", "150")
    assert done.returncode == 0, done.stderr
    taps = [tap_name("wired", vm, 0) for vm in "ab"]
    macs = [load_lab(spec).vm(vm).nics[0].mac for vm in "ab"]
    assert marks(tmp_path) == [f"up {tap} wired {vm} 0 lan {mac} 1400 nobridge 1400"
                               for tap, vm, mac in zip(taps, "ab", macs)]
    assert ports(netns, "br-test") == set(taps)
    log = (netns.run_root / "wired" / "b.serial.log").read_text()
    assert "3 packets transmitted, 3 packets received, 0% packet loss" in log, log[-2000:]
    status = json.loads(netns.vmlaunch("status", str(spec), "--json").stdout)
    assert status["a"]["nics"][0]["type"] == "tap" and status["a"]["nics"][0]["tap"] == taps[0]

    spec.write_text(spec.read_text().replace("./ifdown", "./other"))  # down runs what up recorded
    for pid in qemu_pids(netns.run_root):
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    done = netns.vmlaunch("down", str(spec))
    assert done.returncode == 0, done.stderr
    assert marks(tmp_path)[2:] == [f"down {tap} {vm} down" for tap, vm in reversed(list(zip(taps, "ab")))]
    assert netns.links() == {"lo", "br-test"} and ports(netns, "br-test") == set()
    assert_clean(netns, "wired")
    again = netns.vmlaunch("down", str(spec))
    assert (again.returncode, again.stdout.strip()) == (0, "lab wired is not up")
    assert len(marks(tmp_path)) == 4  # once, and only once


def test_a_failing_up_script_rolls_back_and_shows_why(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    """On a bridge network the up_script runs with the tap on the bridge; it fails: `up` says how, with
    its output, runs the down_script (the up_script may have done half its work), and leaves nothing."""
    script(tmp_path / "ifup", 'echo "up $1 on $(basename $(readlink /sys/class/net/$1/master))" >> marks\n'
           'echo "switch port $1: no such VLAN" >&2\nexit 3\n')
    script(tmp_path / "ifdown", 'echo "down $1" >> marks\n')
    spec = lab(tmp_path, test_guest, '[lab]\nname = "failing"\n[network.lan]\nbridge = "vlbr-fail"\n'
               'up_script = "ifup"\ndown_script = "ifdown"\n[vm.a]\nmemory = "128M"\naccel = "tcg"\n'
               'kernel = "GUEST/vmlinuz"\ninitrd = "GUEST/initrd.gz"\n[[vm.a.disk]]\nfile = "a.img"\n'
               'size = "1M"\n[[vm.a.nic]]\nnetwork = "lan"\n')
    done = netns.vmlaunch("up", str(spec))
    assert done.returncode == 4, done.stderr
    tap = tap_name("failing", "a", 0)
    assert (f"network lan: up_script `{tmp_path}/ifup {tap}` failed with exit status 3; its output:\n"
            f"  | switch port {tap}: no such VLAN") in done.stderr
    assert "Traceback" not in done.stderr
    assert marks(tmp_path) == [f"up {tap} on vlbr-fail", f"down {tap}"]
    assert netns.links() == {"lo"}  # tap and bridge rolled back
    assert not (tmp_path / "a.img").exists()
    assert_clean(netns, "failing")


def test_a_vlan_lab_on_a_kernel_without_8021q_fails_plainly(tmp_path: Path, netns: Netns,
                                                           test_guest: Path) -> None:
    from tests.test_links import kernel_vlans

    if kernel_vlans() is None:
        pytest.skip("this kernel has 802.1Q VLAN links: test_vlans_across_a_trunk runs instead")
    netns.ip("link", "add", "trunk0", "type", "veth", "peer", "name", "trunk1")
    spec = lab(tmp_path, test_guest, '[lab]\nname = "tagged"\n[network.lan]\nuplink = "trunk0"\nvlan = 42\n'
               '[vm.a]\nmemory = "128M"\naccel = "tcg"\nkernel = "GUEST/vmlinuz"\n'
               'initrd = "GUEST/initrd.gz"\n[[vm.a.disk]]\nfile = "a.img"\nsize = "1M"\n'
               '[[vm.a.nic]]\nnetwork = "lan"\n')
    done = netns.vmlaunch("up", str(spec))
    assert done.returncode == 3, done.stderr
    assert (f"{spec}:5: network.lan.vlan: VLAN 42 of trunk0: this kernel lacks 802.1Q VLAN support"
            in done.stderr), done.stderr
    assert "modprobe 8021q" in done.stderr and "Traceback" not in done.stderr
    assert netns.links() == {"lo", "trunk0", "trunk1"}
    assert not (tmp_path / "a.img").exists()
    assert_clean(netns, "tagged")


def vm_lab(name: str, uplink: str, vlan: int, address: str, ping: str | None = None) -> str:
    """One VM on VLAN `vlan` of `uplink`, at `address`, pinging `ping` at boot."""
    import base64

    run = f" vl.run={base64.b64encode(f'sleep 1; ping -c 3 -W 3 {ping}'.encode()).decode()}" if ping else ""
    return (f'[lab]\nname = "{name}"\n[network.lan]\nbridge = "vlbr-{vlan}"\nuplink = "{uplink}"\n'
            f'vlan = {vlan}\n[vm.{name}]\nmemory = "128M"\naccel = "tcg"\nkernel = "GUEST/vmlinuz"\n'
            f'initrd = "GUEST/initrd.gz"\nappend = "console=ttyS0 vl.ip=eth0:{address}/24{run}"\n'
            f'[[vm.{name}.nic]]\nnetwork = "lan"\n')


def test_vlans_across_a_trunk(tmp_path: Path, test_guest: Path) -> None:
    """A veth pair is a trunk between two namespaces: labs on VLAN 42 at both ends ping each other, a
    lab on VLAN 43 does not reach them; `down` removes each VLAN link and leaves the trunk."""
    from tests.test_links import kernel_vlans

    reason = kernel_vlans()
    if reason is not None:
        pytest.skip(f"this kernel has no 802.1Q VLAN links (`ip link add ... type vlan`: {reason}): "
                    "test_a_vlan_lab_on_a_kernel_without_8021q_fails_plainly runs instead")
    with netns_named() as left, netns_named() as right:
        subprocess.run(["ip", "link", "add", "trunk0", "netns", left.name, "type", "veth", "peer", "name",
                        "trunk1", "netns", right.name], check=True)
        left.ip("link", "set", "trunk0", "up")
        right.ip("link", "set", "trunk1", "up")
        specs = {}
        for where, name, uplink, vlan, address, ping in (
                (left, "here", "trunk0", 42, "10.42.0.1", None),
                (right, "there", "trunk1", 42, "10.42.0.2", "10.42.0.1"),
                (right, "elsewhere", "trunk1", 43, "10.42.0.3", "10.42.0.1")):
            folder = tmp_path / name
            folder.mkdir()
            specs[name] = (where, lab(folder, test_guest, vm_lab(name, uplink, vlan, address, ping)))
            done = where.vmlaunch("up", str(specs[name][1]), "--wait-for", READY, "--timeout", "150")
            assert done.returncode == 0, done.stderr
        assert {"trunk0.42"} <= left.links() and {"trunk1.42", "trunk1.43"} <= right.links()
        there = (right.run_root / "there" / "there.serial.log").read_text()
        assert "3 packets transmitted, 3 packets received, 0% packet loss" in there, there[-2000:]
        elsewhere = (right.run_root / "elsewhere" / "elsewhere.serial.log").read_text()
        assert "3 packets transmitted, 0 packets received, 100% packet loss" in elsewhere, elsewhere[-2000:]
        done = right.vmlaunch("down", str(specs["there"][1]), "--timeout", "2")
        assert done.returncode == 0, done.stderr
        assert "trunk1.42" not in right.links() and {"trunk1", "trunk1.43"} <= right.links()
        for name in ("elsewhere", "here"):
            where, spec = specs[name]
            done = where.vmlaunch("down", str(spec), "--timeout", "2")
            assert done.returncode == 0, done.stderr
        assert left.links() == {"lo", "trunk0"} and right.links() == {"lo", "trunk1"}  # the trunk stays
        for where, name in ((left, "here"), (right, "there"), (right, "elsewhere")):
            assert_clean(where, name)


OVS_SCHEMA = Path("/usr/share/openvswitch/vswitch.ovsschema")


def test_the_open_vswitch_example(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    """examples/ovs-ifup and ovs-ifdown with a private Open vSwitch (its own database and daemon, in
    the test's namespace, userspace datapath): two VMs on its bridge ping; down takes the ports off."""
    if shutil.which("ovs-vsctl") is None or not OVS_SCHEMA.exists():
        pytest.skip("Open vSwitch is not installed (ovs-vsctl): the example's scripts are not run here")
    ovs = Path(tempfile.mkdtemp(prefix="vl-ovs-"))  # short: OVS's sockets live here
    env = {"OVS_RUNDIR": str(ovs), "OVS_DBDIR": str(ovs), "OVS_LOGDIR": str(ovs), "OVS_SYSCONFDIR": str(ovs)}

    def run(*argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", netns.name, *argv], check=True, capture_output=True,
                       env={**os.environ, **env}, timeout=60)

    try:
        run("ovsdb-tool", "create", str(ovs / "conf.db"), str(OVS_SCHEMA))
        run("ovsdb-server", f"--remote=punix:{ovs}/db.sock", "--pidfile", "--detach", "--log-file",
            str(ovs / "conf.db"))
        run("ovs-vsctl", "--no-wait", "init")
        run("ovs-vswitchd", "--pidfile", "--detach", "--log-file")
        run("ovs-vsctl", "add-br", "br-lab", "--", "set", "bridge", "br-lab", "datapath_type=netdev")
        shutil.copy(ROOT / "examples" / "ovs-ifup", tmp_path)
        shutil.copy(ROOT / "examples" / "ovs-ifdown", tmp_path)
        network = '[network.ovs]\ntype = "tap"\nup_script = "./ovs-ifup"\ndown_script = "./ovs-ifdown"'
        spec = lab(tmp_path, test_guest, pair("ovs", network, ping="10.5.0.1").replace('"lan"', '"ovs"'))
        netns.env = env
        done = netns.vmlaunch("up", str(spec), "--wait-for", READY, "--timeout", "150")
        assert done.returncode == 0, done.stderr
        listed = subprocess.run(["ovs-vsctl", "list-ports", "br-lab"], capture_output=True, text=True,
                                env={**os.environ, **env}, check=True).stdout.split()
        assert set(listed) == {tap_name("ovs", vm, 0) for vm in "ab"}
        log = (netns.run_root / "ovs" / "b.serial.log").read_text()
        assert "3 packets transmitted, 3 packets received, 0% packet loss" in log, log[-2000:]
        done = netns.vmlaunch("down", str(spec))
        assert done.returncode == 0, done.stderr
        listed = subprocess.run(["ovs-vsctl", "list-ports", "br-lab"], capture_output=True, text=True,
                                env={**os.environ, **env}, check=True).stdout.split()
        assert listed == []
        assert_clean(netns, "ovs")
    finally:
        for daemon in ("ovs-vswitchd", "ovsdb-server"):
            pidfile = ovs / f"{daemon}.pid"
            if pidfile.exists():
                subprocess.run(["kill", pidfile.read_text().strip()], check=False)
        shutil.rmtree(ovs, ignore_errors=True)
