"""A lab across libvirt hosts, on the rig (tests/conftest.py `libvirt_hosts`: three private libvirtds
with an sshd each, reached over `qemu+ssh://`, vmlaunch running in the rig's client namespace).

- Three test guests pinned to three hosts on one bridge network with a subnet: `up`, each host's
  libvirt lists its domain, the guests ping each other across the hosts (VXLAN, MTU 1450 given to
  them), `status` shows them running with their hosts, `balloon` on a remote one, `logs`, and `down`
  leaves no domain, pool, network, bridge or VXLAN link on any host.
- A host whose libvirtd is stopped before `up`: exit 3, nothing created anywhere; killed during `up`:
  the other hosts rolled back, exit 4, and `down` finishes once it is back.
- `down` with a host gone: the others cleaned, what is left named with its host, exit 4.
- A name the lab would define that someone else made: refused before anything changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.qemu, pytest.mark.guest, pytest.mark.libvirt]

PING = "for i in $(seq 90); do ping -c 1 -W 1 {peer} >/dev/null && break; done; ping -c 3 -W 3 {peer}"


def spec(folder: Path, rig: Any, guest: Path, vms: dict[str, str | None], *, name: str = "mh",
         extra: str = "", scripts: dict[str, str] | None = None) -> Path:
    """A lab of test guests on network lan (10.9.0.0/24), VM -> its host (None: placed)."""
    lab: Path = rig.guest_lab(folder / "lab.toml", guest, vms, name=name, extra=extra, scripts=scripts)
    return lab


@pytest.fixture
def vl(libvirt_hosts: Any, run_dir: Path) -> Iterator[Any]:
    """`vl(*args)`: the vmlaunch CLI in the rig's client namespace, with this test's run dir."""
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_dir)}

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done: subprocess.CompletedProcess[str] = libvirt_hosts.run_client(
            [sys.executable, "-m", "vmlaunch", *args], env=env, timeout=timeout)
        return done

    yield run
    for host in libvirt_hosts.hosts:  # whatever a failing test left: the next one starts clean
        if host.virsh("version", check=False).returncode != 0:
            host.start_libvirtd()


def nothing_on(rig: Any, lab: str = "mh") -> dict[str, list[str]]:
    """What of lab `lab` each host has: domains, pools, networks, links, serial console logs."""
    left = {}
    for host in rig.hosts:
        found = [f"domain {n}" for n in host.names("list", "--all", "--name") if n.startswith(f"{lab}-")]
        found += [f"pool {n}" for n in host.names("pool-list", "--all", "--name") if n == f"vmlaunch-{lab}"]
        found += [f"network {n}" for n in host.names("net-list", "--all", "--name")
                  if n.startswith(f"{lab}-")]
        found += [f"link {n}" for n in host.links() if n.startswith(("vx", "vlb"))]
        found += [f"log {n}" for n in host.run("ls", "/var/log/libvirt/qemu").stdout.split()
                  if n.startswith(f"{lab}-") and n.endswith("-serial.log")]
        if found:
            left[host.name] = found
    return left


def wait_for_log(vl: Any, spec_file: Path, vm: str, texts: list[str], timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        out = str(vl("logs", str(spec_file), vm).stdout)
        if all(text in out for text in texts):
            return out
        time.sleep(1)
    raise AssertionError(f"{vm} has not printed {texts}:\n{out[-3000:]}")


def test_three_guests_on_three_hosts_one_network(libvirt_hosts: Any, vl: Any, tmp_path: Path,
                                                  test_guest: Path) -> None:
    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h2", "c": "h3"},
               scripts={"b": PING.format(peer="10.9.0.11") + "; " + PING.format(peer="10.9.0.13")})
    done = vl("up", str(lab))
    try:
        assert done.returncode == 0, done.stderr
        for host, vm in zip(rig.hosts, "abc"):
            assert host.names("list", "--name") == [f"mh-{vm}"]
            assert host.names("pool-list", "--name") == ["vmlaunch-mh"]
        log = wait_for_log(vl, lab, "b", ["vl: run exit"])
        assert log.count("3 packets transmitted, 3 packets received") == 2, log[-3000:]
        # the lowered MTU reached the guest (virtio's host_mtu)
        qemu_log = rig.hosts[1].run("cat", "/var/log/libvirt/qemu/mh-b.log").stdout
        assert '"host_mtu":1450' in qemu_log, qemu_log[-2000:]
        status = vl("status", str(lab), "--json")
        assert status.returncode == 0, status.stderr
        rows = json.loads(status.stdout)
        assert {vm: (row["state"], row["host"]) for vm, row in rows.items()} == {
            "a": ("running", "h1"), "b": ("running", "h2"), "c": ("running", "h3")}
        table = vl("status", str(lab)).stdout
        assert "HOST" in table.splitlines()[0] and " h2 " in table
        shrunk = vl("balloon", str(lab), "c", "100M")
        assert shrunk.returncode == 0, shrunk.stderr
        assert shrunk.stdout.strip().startswith("c: ")
        assert json.loads(vl("status", str(lab), "--json").stdout)["c"]["balloon"] <= 100 << 20
        listed = vl("ls", "--json")
        assert "mh" in json.loads(listed.stdout)
    finally:
        down = vl("down", str(lab))
    assert down.returncode == 0, down.stderr
    assert nothing_on(rig) == {}


def test_placement_spreads_a_lab_that_does_not_fit_one_host(libvirt_hosts: Any, vl: Any, tmp_path: Path,
                                                            test_guest: Path) -> None:
    # each host may give the lab 200 MiB (its budget holds per host): two VMs of 128 MiB need two hosts
    lab = spec(tmp_path, libvirt_hosts, test_guest, {"a": None, "b": None},
               extra='[lab.memory]\nbudget = "200M"\n')
    done = vl("cmdline", str(lab), "--json")
    assert done.returncode == 0, done.stderr
    hosts = {vm: row["host"] for vm, row in json.loads(done.stdout).items()}
    assert hosts["a"] != hosts["b"]
    dry = vl("up", "--dry-run", str(lab))
    assert dry.returncode == 0 and "(placed)" in dry.stdout and "VXLAN" in dry.stdout
    # a lab that fits stays on one host: no network spans hosts
    small = spec(tmp_path, libvirt_hosts, test_guest, {"a": None, "b": None})
    hosts = {vm: row["host"] for vm, row in json.loads(vl("cmdline", str(small), "--json").stdout).items()}
    assert hosts["a"] == hosts["b"]
    assert nothing_on(libvirt_hosts) == {}


def test_a_host_whose_libvirtd_is_stopped_changes_nothing(libvirt_hosts: Any, vl: Any, tmp_path: Path,
                                                          test_guest: Path) -> None:
    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h2"})
    rig.hosts[1].stop_libvirtd()
    try:
        done = vl("up", str(lab))
    finally:
        rig.hosts[1].start_libvirtd()
    assert done.returncode == 3, done.stderr
    assert "host h2" in done.stderr and "nothing was changed" in done.stderr
    assert "Traceback" not in done.stderr
    assert nothing_on(rig) == {}


def test_a_host_killed_during_up_rolls_the_others_back(libvirt_hosts: Any, vl: Any, run_dir: Path,
                                                       tmp_path: Path, test_guest: Path) -> None:
    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h2"})
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_dir)}
    up = subprocess.Popen(rig.client_argv(sys.executable, "-m", "vmlaunch", "up", str(lab)), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # h2's pool made: its volumes are being uploaded
            if rig.hosts[1].names("pool-list", "--all", "--name") or up.poll() is not None:
                break
            time.sleep(0.02)
        rig.hosts[1].stop_libvirtd()
        out, err = up.communicate(timeout=300)
    finally:
        if up.poll() is None:
            up.kill()
        rig.hosts[1].start_libvirtd()
    assert up.returncode == 4, err
    assert "host h2" in err and "Traceback" not in err
    assert "h1" not in nothing_on(rig)  # rolled back where it could be
    done = vl("down", str(lab))  # h2 is back: what was left there goes
    assert done.returncode == 0, done.stderr
    assert nothing_on(rig) == {}


def test_down_with_a_host_gone_cleans_the_others(libvirt_hosts: Any, vl: Any, tmp_path: Path,
                                                 test_guest: Path) -> None:
    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h3"})
    assert vl("up", str(lab)).returncode == 0
    rig.hosts[2].stop_libvirtd()
    try:
        down = vl("down", str(lab))
    finally:
        rig.hosts[2].start_libvirtd()
    assert down.returncode == 4, down.stderr
    assert "host h3" in down.stderr and "domain mh-b" in down.stderr and "Traceback" not in down.stderr
    left = nothing_on(rig)
    assert "h1" not in left and "h3" in left
    again = vl("down", str(lab))
    assert again.returncode == 0, again.stderr
    assert nothing_on(rig) == {}


def test_a_name_someone_else_made_is_refused(libvirt_hosts: Any, vl: Any, tmp_path: Path,
                                             test_guest: Path) -> None:
    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h2"})
    xml = tmp_path / "theirs.xml"
    xml.write_text("<network><name>mh-lan</name><bridge name='theirs0'/></network>")
    rig.hosts[1].virsh("net-define", str(xml))
    try:
        done = vl("up", str(lab))
        assert done.returncode == 3, done.stderr
        assert "host h2: network mh-lan" in done.stderr
        assert rig.hosts[0].names("pool-list", "--all", "--name") == []
        assert rig.hosts[1].names("net-list", "--all", "--name") == ["mh-lan"]  # theirs, left alone
    finally:
        rig.hosts[1].virsh("net-undefine", "mh-lan", check=False)
    assert nothing_on(rig) == {}


def test_an_up_killed_half_way_is_undone_by_the_next_up(libvirt_hosts: Any, vl: Any, run_dir: Path,
                                                         tmp_path: Path, test_guest: Path) -> None:
    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h2"})
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_dir)}
    up = subprocess.Popen(rig.client_argv(sys.executable, "-m", "vmlaunch", "up", str(lab)), env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if rig.hosts[1].names("pool-list", "--all", "--name") or up.poll() is not None:
                break
            time.sleep(0.02)
    finally:
        up.kill()
        up.wait()
    again = vl("up", str(lab))
    assert again.returncode == 0, again.stderr
    for host, vm in zip(rig.hosts, "ab"):
        assert host.names("list", "--name") == [f"mh-{vm}"]
    assert vl("down", str(lab)).returncode == 0
    assert nothing_on(rig) == {}
    assert not (run_dir / "mh").exists()


def test_an_image_vm_gets_its_base_overlay_and_seed_as_volumes(libvirt_hosts: Any, vl: Any, tmp_path: Path,
                                                                test_guest: Path) -> None:
    rig = libvirt_hosts
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "tiny.qcow2"), "32M"],
                   check=True)
    lab = spec(tmp_path, rig, test_guest, {"a": "h2"},
               extra='[image.tiny]\nfile = "tiny.qcow2"\n')
    text = lab.read_text().replace('accel = "tcg"\n', 'accel = "tcg"\nimage = "tiny"\ndisk_size = "64M"\n')
    lab.write_text(text)
    done = vl("up", str(lab))
    try:
        assert done.returncode == 0, done.stderr
        host = rig.hosts[1]
        volumes = host.virsh("vol-list", "vmlaunch-mh").stdout
        for name in ("base-tiny.qcow2", "a-root.qcow2", "a-seed.iso", "a-kernel", "a-initrd"):
            assert name in volumes, volumes
        info = host.run("qemu-img", "info", "--output=json", "-U",
                        "/var/lib/libvirt/images/vmlaunch-mh/a-root.qcow2").stdout
        assert json.loads(info)["backing-filename"].endswith("base-tiny.qcow2")
        assert json.loads(info)["virtual-size"] == 64 << 20
        xml = host.virsh("dumpxml", "mh-a").stdout
        assert "/var/lib/libvirt/images/vmlaunch-mh/a-seed.iso" in xml
        argv = rig.run_client([sys.executable, "-c", "import sys, vmlaunch.multihost.vms as v; "
                               "from vmlaunch.spec.load import load_lab; "
                               f"print(v.ssh_argv(load_lab({str(lab)!r}), 'a', ['true']))"],
                              env={**os.environ, "VMLAUNCH_RUN_DIR": os.environ.get("VMLAUNCH_RUN_DIR", "")})
        assert "-W %h:%p root@10.77.0.12" in argv.stdout and "@10.9.0.11" in argv.stdout, argv.stderr
    finally:
        down = vl("down", str(lab))
    assert down.returncode == 0, down.stderr
    assert nothing_on(rig) == {}


def test_down_of_one_vm_leaves_the_others_and_the_host_is_on_the_network(
        libvirt_hosts: Any, vl: Any, tmp_path: Path, test_guest: Path) -> None:
    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h2"})
    assert vl("up", str(lab)).returncode == 0
    try:
        # the host has an address on the lab network (the subnet's first on h1, its last on h2):
        # `vmlaunch ssh` jumps through it to the VM's address
        wait_for_log(vl, lab, "a", ["VMLAUNCH-GUEST-READY"])
        # (a TCP connection to the guest's closed port 22 refused: the guest answered from the host)
        probe = rig.hosts[0].run(sys.executable, "-c", "import errno, socket; s = socket.socket(); "
                                 "s.settimeout(10); "
                                 "print(errno.errorcode.get(s.connect_ex(('10.9.0.11', 22))))")
        assert probe.stdout.strip() == "ECONNREFUSED", probe.stdout + probe.stderr
        assert "10.9.0.254/24" in rig.hosts[1].run("ip", "-br", "addr").stdout
        done = vl("down", str(lab), "b")
        assert done.returncode == 0, done.stderr
        assert rig.hosts[1].names("list", "--all", "--name") == []
        assert rig.hosts[0].names("list", "--name") == ["mh-a"]
        rows = json.loads(vl("status", str(lab), "--json").stdout)
        assert (rows["a"]["state"], rows["b"]["state"]) == ("running", "down")
    finally:
        assert vl("down", str(lab)).returncode == 0
    assert nothing_on(rig) == {}


def test_ctrl_c_during_up_undoes_it_on_every_host(libvirt_hosts: Any, vl: Any, run_dir: Path,
                                                  tmp_path: Path, test_guest: Path) -> None:
    import signal

    rig = libvirt_hosts
    lab = spec(tmp_path, rig, test_guest, {"a": "h1", "b": "h2", "c": "h3"})
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_dir)}
    up = subprocess.Popen(rig.client_argv(sys.executable, "-m", "vmlaunch", "up", str(lab)), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if rig.hosts[2].names("pool-list", "--all", "--name") or up.poll() is not None:
                break
            time.sleep(0.02)
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode in (0, 130), err  # 0: it was done before the signal came
    if up.returncode == 130:
        assert "Traceback" not in err
        assert nothing_on(rig) == {}
        assert not (run_dir / "mh").exists()
    assert vl("down", str(lab)).returncode == 0
    assert nothing_on(rig) == {}
