"""A lab across libvirt hosts, the pure parts: URIs, names, VNIs, placement, the spec's checks and
each host's plan (no host is reached: the hosts' facts are given)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmlaunch.errors import HostError, SpecError
from vmlaunch.multihost.engine import HostFacts, make_plan
from vmlaunch.policy.hostplace import HostRoom, place
from vmlaunch.spec.hosts import BadUri, parse_uri, vni, vxlan_name
from vmlaunch.spec.load import load_lab


def lab_file(tmp_path: Path, hosts: str, vms: str, extra: str = "") -> Path:
    (tmp_path / "vmlinuz").write_bytes(b"k" * 64)
    path = tmp_path / "lab.toml"
    path.write_text(f'[lab]\nname = "mh"\n{extra}{hosts}[network.lan]\nsubnet = "10.9.0.0/24"\n{vms}')
    return path


SSH_HOSTS = ('[host.h1]\nuri = "qemu+ssh://root@10.0.0.1/system?keyfile=/k"\n'
             '[host.h2]\nuri = "qemu+ssh://root@10.0.0.2:2222/system"\n')


def vm(name: str, host: str | None = None, memory: str = "128M", keys: str = "") -> str:
    pin = f'host = "{host}"\n' if host else ""
    return (f'[vm.{name}]\nmemory = "{memory}"\nkernel = "vmlinuz"\n{keys}{pin}'
            + f'[[vm.{name}.nic]]\nnetwork = "lan"\n')


def test_uris() -> None:
    uri = parse_uri("qemu+ssh://admin@h.example:2222/system?keyfile=/root/k&no_verify=1")
    assert (uri.transport, uri.user, uri.hostname, uri.port, uri.keyfile, uri.no_verify) == (
        "ssh", "admin", "h.example", 2222, "/root/k", True)
    assert uri.ssh_argv()[-1] == "admin@h.example" and "-p" in uri.ssh_argv()
    assert uri.ssh_argv()[uri.ssh_argv().index("-p") + 1] == "2222"
    assert parse_uri("qemu:///system").local and parse_uri("qemu:///system").shell
    assert not parse_uri("qemu+tcp://h/system").shell
    for bad in ("xen:///system", "qemu+carrier://h/system", "qemu+ssh:///system", "qemu://h/nope", "host",
                "qemu+ssh://h:99999/system", "qemu:///system x"):
        with pytest.raises(BadUri):
            parse_uri(bad)


def test_vni_and_link_names_are_stable_and_fit() -> None:
    assert vni("mh", "lan") == vni("mh", "lan") != vni("mh", "wan")
    assert 1 <= vni("a", "b") < 1 << 24
    assert len(vxlan_name("a-long-lab-name", "a-long-network")) <= 15
    assert vxlan_name("mh", "lan") != vxlan_name("mh2", "lan")


def test_the_spec_checks_hosts(tmp_path: Path) -> None:
    lab = load_lab(lab_file(tmp_path, SSH_HOSTS, vm("a", "h1") + vm("b")))
    assert [h.name for h in lab.hosts] == ["h1", "h2"]
    assert lab.vm("a").host == "h1" and lab.vm("b").host is None
    cases = {
        vm("a", "nope"): "no [host.nope]",
        vm("a", "h1") + '[[vm.a.share]]\nsource = "."\ntarget = "/mnt"\n': "has no shares",
        vm("a", "h1", keys="ssh = true\n"): "ssh = true",
    }
    for vms, said in cases.items():
        with pytest.raises(SpecError, match=said.replace("[", r"\[")):
            load_lab(lab_file(tmp_path, SSH_HOSTS, vms))
    tcp = '[host.h1]\nuri = "qemu+ssh://10.0.0.1/system"\n[host.h2]\nuri = "qemu+tcp://10.0.0.2/system"\n'
    with pytest.raises(SpecError, match="spans hosts"):
        load_lab(lab_file(tmp_path, tcp, vm("a", "h1") + vm("b", "h2")))
    with pytest.raises(SpecError, match="not a libvirt URI"):
        load_lab(lab_file(tmp_path, '[host.h1]\nuri = "xen:///"\n', vm("a")))
    with pytest.raises(SpecError, match="is not a \\[host.NAME\\]"):
        load_lab(lab_file(tmp_path, "", vm("a", "h1")))
    socket = '[network.s]\ntype = "socket"\n'
    with pytest.raises(SpecError, match="not socket networks"):
        load_lab(lab_file(tmp_path, SSH_HOSTS, vm("a", "h1"), extra=socket))


def test_placement_packs_then_spreads(tmp_path: Path) -> None:
    lab = load_lab(lab_file(tmp_path, SSH_HOSTS, vm("a") + vm("b") + vm("c", memory="1G")))
    roomy = {"h1": HostRoom(8192, 4), "h2": HostRoom(8192, 4)}
    assert len(set(place(lab, roomy).values())) == 1  # fits one host: stays together
    tight = {"h1": HostRoom(1200, 4), "h2": HostRoom(1200, 4)}
    placed = place(lab, tight)
    assert placed["c"] != placed["a"] or placed["c"] != placed["b"]
    with pytest.raises(HostError, match="no host has room for VM c"):
        place(lab, {"h1": HostRoom(512, 4), "h2": HostRoom(512, 4)})
    # a host vmlaunch cannot run commands on never gets half of a network
    shell_less = {"h1": HostRoom(1200, 4), "h2": HostRoom(8192, 4, shell=False)}
    placed = place(lab, shell_less)
    assert len(set(placed.values())) == 1
    pinned = load_lab(lab_file(tmp_path, SSH_HOSTS, vm("a", "h2", memory="2G")))
    with pytest.raises(HostError, match="VM a needs 2048 MiB on host h2"):
        place(pinned, roomy | {"h2": HostRoom(1024, 4)})


def test_a_spanning_network_gets_vxlan_and_a_lower_mtu(tmp_path: Path) -> None:
    lab = load_lab(lab_file(tmp_path, SSH_HOSTS, vm("a", "h1") + vm("b", "h2")))
    facts = {name: HostFacts(name, lab.host(name).uri, 4096, 2, kvm=False, libvirt_version=9000000,
                             hypervisor="QEMU") for name in ("h1", "h2")}
    plan = make_plan(lab, facts, {})
    h1, h2 = plan.hosts
    assert h1.networks[0].link == h2.networks[0].link == vxlan_name("mh", "lan")
    assert h1.networks[0].peers == ("10.0.0.2",) and h2.networks[0].peers == ("10.0.0.1",)
    assert h1.networks[0].mtu == 1450 and "<mtu size=\"1450\"" in h1.networks[0].xml
    dom = h1.domains[0].xml
    assert "<mtu size=\"1450\"" in dom and "type=\"qemu\"" in dom  # no KVM there: TCG
    assert f"<kernel>{h1.pool_path}/a-kernel</kernel>" in dom
    assert [v.name for v in h1.volumes] == ["a-kernel"]
    together = make_plan(load_lab(lab_file(tmp_path, SSH_HOSTS, vm("a", "h1") + vm("b", "h1"))), facts, {})
    assert together.hosts[0].networks[0].link is None and together.hosts[1].networks == ()


@pytest.mark.parametrize("argv", [
    ["fault", "{spec}", "a", "disk0", "error", "--read"], ["fault", "{spec}"],
    ["exec", "{spec}", "a", "--", "true"], ["cp", "{spec}", "/etc/hostname", "a:/tmp"],
    ["snapshot", "{spec}", "save", "s1"], ["pause", "{spec}"], ["fork", "{spec}", "a", "--count", "1"],
    ["netem", "{spec}", "a", "0", "--delay", "5ms"], ["numa", "{spec}"],
    ["screenshot", "{spec}", "a", "/tmp/x.png"], ["evidence", "{spec}", "/tmp/ev"], ["reset", "{spec}"],
])
def test_commands_of_own_qemus_refuse_a_lab_on_hosts(tmp_path: Path, argv: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Not "VM a is not running" of a VM that runs on its host, nor a file left in the run dir."""
    from vmlaunch.cli import main

    spec = lab_file(tmp_path, SSH_HOSTS, vm("a", "h1"))
    assert main([word.replace("{spec}", str(spec)) for word in argv]) == 64
    err = capsys.readouterr().err
    assert f"{argv[0]}: {spec} is a lab on libvirt hosts (h1, h2)" in err and "Traceback" not in err


def test_the_api_refuses_a_lab_on_hosts(tmp_path: Path) -> None:
    from vmlaunch.api import Lab
    from vmlaunch.errors import UsageError

    with pytest.raises(UsageError, match="runs on libvirt hosts .h1, h2."):
        Lab(lab_file(tmp_path, SSH_HOSTS, vm("a", "h1")))
