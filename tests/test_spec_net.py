"""The wiring keys of networks: `type = "tap"`, up_script and down_script, `vlan` with `uplink`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import write_spec
from vmlaunch.compile.preflight import load_checked
from vmlaunch.errors import SpecError
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import BridgeNetwork, TapNetwork

HEAD = '[lab]\nname = "t"\n'
NIC = '[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "n"\n'


def problems(tmp_path: Path, text: str, *, files: bool = False) -> list[str]:
    spec = write_spec(tmp_path, text)
    with pytest.raises(SpecError) as info:
        (load_checked if files else load_lab)(spec)
    return [str(p).replace(str(spec), "lab.toml") for p in info.value.problems]


def script(path: Path, mode: int = 0o755) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(mode)
    return path


def test_a_tap_network_and_its_scripts(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.n]\ntype = "tap"\nup_script = "./wire/ifup"\n'
                      'down_script = "~/ifdown"\nmtu = 1400\nsubnet = "10.9.0.0/24"\n' + NIC)
    lab = load_lab(spec)
    (net,) = lab.networks
    assert net == TapNetwork(name="n", up_script=tmp_path / "wire" / "ifup",
                             down_script=Path.home() / "ifdown", mtu=1400, subnet="10.9.0.0/24")
    assert lab.vms[0].nics[0].ip is not None and lab.vms[0].nics[0].ip.startswith("10.9.0.")


def test_a_bridge_network_with_a_vlan_and_scripts(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.n]\nuplink = "eth1"\nvlan = 42\n'
                      'up_script = "/etc/vl/up"\n' + NIC)
    (net,) = load_lab(spec).networks
    assert isinstance(net, BridgeNetwork)
    assert (net.uplink, net.vlan, net.up_script, net.down_script) == ("eth1", 42, Path("/etc/vl/up"), None)


@pytest.mark.parametrize(("network", "expected"), [
    ('type = "tap"\n',
     ["lab.toml:3: network.n: a tap network without up_script: nothing would wire its taps, so its VMs "
      "would reach nothing (add up_script = \"./ifup\" to put each tap where it belongs, or leave type "
      "out for a bridge vmlaunch makes)"]),
    ('type = "tap"\nup_script = ""\n', ["lab.toml:5: network.n.up_script: must not be empty"]),
    ('down_script = "./down"\n',
     ["lab.toml:4: network.n.down_script: a down_script runs for each up_script that ran, and the "
      "network has no up_script (add the up_script it undoes, or remove down_script)"]),
    ('type = "tap"\nup_script = "./up"\nbridge = "br0"\n',
     ["lab.toml:6: network.n.bridge: unknown key 'bridge' (known keys: down_script, mtu, subnet, "
      "type, up_script)"]),
    ('type = "tap"\nup_script = "./up"\nvlan = 4\n',
     ["lab.toml:6: network.n.vlan: unknown key 'vlan' (known keys: down_script, mtu, subnet, type, "
      "up_script)"]),
    ('vlan = 42\n', ["lab.toml:4: network.n.vlan: vlan = 42 tags the traffic of an uplink, and the "
                     "network has none (add uplink = \"eth1\": the interface that carries VLAN 42)"]),
    ('uplink = "eth1"\nvlan = 0\n', ["lab.toml:5: network.n.vlan: 0 is less than the minimum 1"]),
    ('uplink = "eth1"\nvlan = 4095\n', ["lab.toml:5: network.n.vlan: 4095 is more than the maximum 4094"]),
    ('uplink = "eth1"\nvlan = "42"\n', ["lab.toml:5: network.n.vlan: expected an integer, got a string"]),
    ('type = "user"\nup_script = "./up"\n',
     ["lab.toml:5: network.n.up_script: unknown key 'up_script' (known keys: forward, type)"]),
], ids=["tap-without-up", "empty-up", "down-without-up", "tap-with-bridge", "tap-with-vlan",
        "vlan-without-uplink", "vlan-0", "vlan-4095", "vlan-string", "user-with-script"])
def test_wiring_mistakes(tmp_path: Path, network: str, expected: list[str]) -> None:
    assert problems(tmp_path, HEAD + "[network.n]\n" + network + NIC) == expected


def test_one_uplink_or_vlan_per_network(tmp_path: Path) -> None:
    text = (HEAD + '[network.n]\nuplink = "eth1"\nvlan = 42\n[network.m]\nuplink = "eth1"\nvlan = 42\n'
            '[network.o]\nuplink = "eth1"\nvlan = 43\n[network.p]\nuplink = "eth1"\n'
            '[network.q]\nuplink = "eth1"\n' + NIC)
    assert problems(tmp_path, text) == [
        "lab.toml:8: network.m.vlan: VLAN 42 of eth1 is also network 'n''s (an interface is a port of "
        "one bridge only: put both networks' VMs on one network)",
        "lab.toml:15: network.q.uplink: uplink 'eth1' is also network 'p''s (an interface is a port of "
        "one bridge only: put both networks' VMs on one network)"]


def test_scripts_are_checked_with_the_files(tmp_path: Path) -> None:
    script(tmp_path / "up")
    script(tmp_path / "plain", 0o644)
    (tmp_path / "empty").touch()
    (tmp_path / "empty").chmod(0o755)
    (tmp_path / "folder").mkdir()
    (tmp_path / "k").write_bytes(b"kernel")
    text = (HEAD + '[network.n]\ntype = "tap"\nup_script = "./up"\ndown_script = "./missing"\n'
            '[network.m]\nup_script = "plain"\ndown_script = "folder"\n'
            '[network.o]\ntype = "tap"\nup_script = "empty"\n'
            '[vm.a]\nmemory = 64\nkernel = "k"\n' + "".join(
                f'[[vm.a.nic]]\nnetwork = "{net}"\n' for net in "nmo"))
    assert problems(tmp_path, text, files=True) == [
        f"lab.toml:6: network.n.down_script: {tmp_path}/missing does not exist (relative paths are "
        "relative to the spec file)",
        f"lab.toml:8: network.m.up_script: {tmp_path}/plain is not executable: vmlaunch runs it as "
        f"`SCRIPT TAP`, without a shell (chmod +x {tmp_path}/plain, and start it with a #! line)",
        f"lab.toml:9: network.m.down_script: {tmp_path}/folder is a folder, not a file",
        f"lab.toml:12: network.o.up_script: {tmp_path}/empty is empty",
    ]
    assert len(load_lab(tmp_path / "lab.toml").networks) == 3  # the files are not looked at by default
