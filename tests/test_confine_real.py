"""Every QEMU confined, for real (TCG, the test guest): a lab run as root of two VMs on a bridge, each
QEMU under a uid of its own in a seccomp sandbox, and everything a lab does still works: they ping each
other, balloon, snapshot save and restore, warm start, down; nothing of the lab is left owned by a VM's
uid. In a private network namespace, as every test that makes bridges and taps."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_e2e import READY, Netns, assert_clean, lab, netns_named, pair
from vmlaunch.host import confine
from vmlaunch.host.confine import Confinement, process_status
from vmlaunch.qemu.qmp import QuickQmp

pytestmark = [pytest.mark.qemu, pytest.mark.guest]

if os.geteuid() != 0:  # pragma: no cover - CI and the README's machines run as root
    pytest.skip("a lab run as root", allow_module_level=True)


@pytest.fixture
def netns() -> Iterator[Netns]:
    with netns_named() as made:
        yield made


def disks(text: str) -> str:
    return text + "".join(f'[[vm.{vm}.disk]]\nfile = "{vm}.qcow2"\nsize = "16M"\nformat = "qcow2"\n'
                          for vm in ("a", "b"))


def qemus(netns: Netns) -> dict[str, int]:
    run = netns.run_root / "conf"
    return {vm: int((run / f"{vm}.pid").read_text()) for vm in ("a", "b")}


def owned_by(folder: Path, uids: set[int]) -> list[str]:
    found = []
    for top, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            if os.lstat(os.path.join(top, name)).st_uid in uids:
                found.append(os.path.join(top, name))
    return found


def test_a_root_lab_runs_each_qemu_confined_and_works_as_before(tmp_path: Path, netns: Netns,
                                                                 test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, disks(pair("conf", '[network.lan]\nbridge = "vlbr-conf"',
                                                ping="10.9.0.1")))
    done = netns.vmlaunch("up", str(spec), "--wait-for", READY, "--timeout", "150")
    assert done.returncode == 0, done.stderr
    pids = qemus(netns)
    uids = set()
    for pid in pids.values():
        status = process_status(pid)
        real, effective, saved, _ = map(int, status["Uid"].split())
        assert real == effective == saved != 0 and real in confine.uid_range()
        assert status["Gid"].split()[:3] == [str(real)] * 3
        assert (status["Seccomp"], status["CapEff"]) == ("2", "0000000000000000")
        uids.add(real)
    assert len(uids) == 2  # one of its own per VM
    rows = json.loads(netns.vmlaunch("status", str(spec), "--json").stdout)
    assert {vm: (row["uid"], row["sandbox"]) for vm, row in rows.items()} == {
        vm: (Confinement.of(pid).uid, True) for vm, pid in pids.items()}
    doctor = json.loads(netns.vmlaunch("doctor", str(spec), "--json").stdout)
    confined = next(check for check in doctor["lab"] if check["id"] == "lab.confined")
    assert confined["status"] == "ok", confined

    log = (netns.run_root / "conf" / "b.serial.log").read_text()
    assert "3 packets transmitted, 3 packets received, 0% packet loss" in log, log[-2000:]
    balloon = netns.vmlaunch("balloon", str(spec), "a", "96M")
    assert (balloon.returncode, balloon.stdout.strip()) == (0, "a: 96M"), balloon.stderr
    for words in (("save", "s1"), ("restore", "s1")):  # into the qcow2 files QEMU holds open
        step = netns.vmlaunch("snapshot", str(spec), *words)
        assert step.returncode == 0, step.stderr
    assert netns.vmlaunch("down", str(spec)).returncode == 0
    for vm in ("a", "b"):  # the case: root's disks, 0600 (up makes them with the caller's umask)
        os.chmod(tmp_path / f"{vm}.qcow2", 0o600)
    warm = netns.vmlaunch("up", str(spec), "--from-snapshot", "s1")
    assert warm.returncode == 0, warm.stderr
    # the confined QEMU reopened its disk with O_DIRECT (cache = "none", as compiled) after the load,
    # through the descriptor vmlaunch handed it: it cannot open root's 0600 file by its path
    assert "page cache" not in warm.stderr and "Permission denied" not in warm.stderr, warm.stderr
    for vm, pid in qemus(netns).items():
        assert Confinement.of(pid).problems(as_root=True) == []
        assert Confinement.of(pid).uid in confine.uid_range()
        with QuickQmp(netns.run_root / "conf" / f"{vm}.qmp", timeout=5) as qmp:
            nodes = {node["node-name"]: node for node in qmp.cmd("query-named-block-nodes", flat=True)}
        assert nodes["disk0-file"]["cache"]["direct"] is True, nodes["disk0-file"]
        disk = os.stat(tmp_path / f"{vm}.qcow2")
        assert (disk.st_uid, disk.st_mode & 0o777) == (0, 0o600)  # given to nobody
    assert netns.vmlaunch("down", str(spec)).returncode == 0
    assert netns.links() == {"lo"}
    assert_clean(netns, "conf")
    assert owned_by(tmp_path, uids) == [] and owned_by(netns.run_root, uids) == []
    assert not (confine.HOST_ROOT / confine.UIDS_FILE).exists() or all(
        claim["lab"] != "conf" for claim in json.loads((confine.HOST_ROOT / confine.UIDS_FILE).read_text())
        ["claims"])
