"""The typed journal: every kind round-trips; versions, damaged records and unknown kinds are clear
errors naming the file and the record; `force` keeps what it recognises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vmlaunch.lab.journal import JOURNAL_VERSION, Entry, Journal, JournalError, VmEntry
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.bridge import BridgeRecord
from vmlaunch.resources.clone import CloneRecord
from vmlaunch.resources.guest import LabDirRecord, VmFileRecord
from vmlaunch.resources.hugepages import HugepagesRecord
from vmlaunch.resources.image import ImageRecord
from vmlaunch.resources.ksm import KsmRecord
from vmlaunch.resources.manager import ManagerRecord
from vmlaunch.resources.netem import NetemRecord
from vmlaunch.resources.pci import PciRecord
from vmlaunch.resources.placement import PlacementRecord
from vmlaunch.resources.registry import RECORDS
from vmlaunch.resources.remote import (
    RemoteDomainRecord,
    RemoteLinkRecord,
    RemoteNetworkRecord,
    RemotePoolRecord,
)
from vmlaunch.resources.script import ScriptEnv, ScriptRecord
from vmlaunch.resources.tap import TapRecord
from vmlaunch.resources.vmuser import VmUserClaimRecord, VmUserRecord

SAMPLES = [
    Entry("image", "/l/a.img", "a", ImageRecord(Path("/l/a.img"), created=True)),
    Entry("bridge", "vlbr-demo", None, BridgeRecord("vlbr-demo", created=True, uplink="eth1")),
    Entry("bridge", "br0", None, BridgeRecord("br0", created=False)),
    Entry("bridge", "br1", None, BridgeRecord("br1", created=False, uplink="eth1.42", uplink_created=True)),
    Entry("tap", "vl-1234abcd-0", "a", TapRecord("vl-1234abcd-0", bridge="vlbr-demo")),
    Entry("tap", "vl-1234abcd-1", "a", TapRecord("vl-1234abcd-1", bridge=None)),
    Entry("script", "vl-1234abcd-1 (starting)", "a", ScriptRecord(
        "ovs", Path("/l/ovs-ifup"), Path("/l/ovs-ifdown"),
        ScriptEnv("lab", "a", 1, "ovs", "vl-1234abcd-1", "52:54:00:12:34:56", mtu=9000, ip="10.0.0.1/24"))),
    Entry("script", "vl-1234abcd-0", "a", ScriptRecord(
        "lan", Path("/l/ifup"), None, ScriptEnv("lab", "a", 0, "lan", "vl-1234abcd-0", "52:54:00:12:34:57",
                                                bridge="vlbr-demo"))),
    Entry("pci", "0000:15:00.0", "a", PciRecord("0000:15:00.0", "pci-stub", "ixgbe", ids="8086 10fb")),
    Entry("pci", "0000:16:00.0", "a", PciRecord("0000:16:00.0", "vfio-pci", None, changed=True)),
    Entry("labdir", "/l/.vmlaunch/lab", None, LabDirRecord(Path("/l/.vmlaunch/lab"), created=True)),
    Entry("vmfile", "/l/.vmlaunch/lab/a/disk.qcow2", "a",
          VmFileRecord(Path("/l/.vmlaunch/lab/a/disk.qcow2"), created=False, what="overlay")),
    Entry("hugepages", "a", "a", HugepagesRecord("a", 2048, 64)),
    Entry("hugepages", "b", "b", HugepagesRecord("b", 1048576, 0, Path("/fake/sys"))),
    Entry("manager", "lab", None, ManagerRecord(4242, 123456, "/run/vmlaunch/lab")),
    Entry("ksm", "host", None, KsmRecord({"run": "1", "advisor_mode": "scan-time"})),
    Entry("ksm", "host", None, KsmRecord({"run": "1", "pages_to_scan": "1000"}, Path("/fake/sys"))),
    Entry("placement", "a", "a", PlacementRecord("a", Path("/sys/fs/cgroup/cpuset/vmlaunch.lab.a"), (1,),
                                                  (8, 9, 10, 11))),
    Entry("placement", "b", "b", PlacementRecord("b", None, (0, 1), (0, 1, 2, 3))),
    Entry("vm-user", "a", "a", VmUserRecord("a", 1879048192, "/run/vmlaunch", ("/l/share",))),
    Entry("vm-user-claim", "b", "b", VmUserClaimRecord("b", 1879048193, "/run/vmlaunch")),
    Entry("netem", "vl-abcdefghijkl", "a", NetemRecord("vl-abcdefghijkl", "vliabcdefghijkl", "a", 0)),
    Entry("clone", "a-1", "a-1", CloneRecord("a-1", Path("/run/vmlaunch/l"), Path("/l/.vmlaunch/l"), "l")),
    Entry("remote-pool", "h1/vmlaunch-l", None,
          RemotePoolRecord("h1", "qemu+ssh://h1/system", "vmlaunch-l", "7e1c", "/var/lib/libvirt/images/l")),
    Entry("remote-network", "h1/l-lan", None,
          RemoteNetworkRecord("h1", "qemu:///system", "l-lan", "a1", "vlb1")),
    Entry("remote-link", "h1/vx0a", None,
          RemoteLinkRecord("h1", "qemu:///system", "vx0a", 4242)),
    Entry("remote-domain", "h1/l-a", "a", RemoteDomainRecord("h1", "qemu:///system", "l-a", "b2", "a",
                                                             "/var/log/libvirt/qemu/l-a-serial.log")),
]


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    return RunDir(tmp_path / "lab")


def write(run_dir: RunDir, doc: Any) -> None:
    run_dir.path.mkdir(exist_ok=True)
    run_dir.state.write_text(json.dumps(doc))


def good(resources: list[Any] | None = None, **changes: Any) -> dict[str, Any]:
    doc = {"version": JOURNAL_VERSION, "spec": "/l/lab.toml", "resources": resources or [],
           "vms": {"a": {"pid": 12, "started": 1.5, "accel": "tcg"}}}
    return {**doc, **changes}


def test_registry_covers_every_record_kind() -> None:
    assert set(RECORDS) == {"image", "bridge", "tap", "pci", "labdir", "vmfile", "hugepages",
                            "manager", "ksm", "placement", "script", "vm-user", "vm-user-claim", "netem",
                            "clone", "remote-pool", "remote-network", "remote-link", "remote-domain"}
    assert {e.kind for e in SAMPLES} == set(RECORDS)


def test_every_kind_round_trips(run_dir: RunDir) -> None:
    journal = Journal(run_dir, spec="/l/lab.toml")
    for entry in SAMPLES:
        journal.add(entry)
    journal.vms["a"] = VmEntry(pid=None, started=3.0, accel="kvm")
    journal.save()
    again = Journal.load(run_dir)
    assert again.resources == SAMPLES and again.vms == journal.vms and again.spec == "/l/lab.toml"
    assert all(isinstance(e.record.describe(), str) for e in again.resources)
    assert json.loads(run_dir.state.read_text())["version"] == JOURNAL_VERSION
    assert oct(run_dir.state.stat().st_mode & 0o777) == "0o600"


def test_missing_journal_is_empty(run_dir: RunDir) -> None:
    assert Journal.load(run_dir).empty


@pytest.mark.parametrize(("version", "words"), [(1, "an older vmlaunch"), (99, "a newer vmlaunch"),
                                                (None, "is not one vmlaunch wrote"),
                                                ("2", "is not one vmlaunch wrote")])
def test_other_versions_are_refused_by_name(run_dir: RunDir, version: Any, words: str) -> None:
    write(run_dir, good(version=version))
    with pytest.raises(JournalError) as info:
        Journal.load(run_dir)
    assert str(run_dir.state) in info.value.message and words in info.value.message
    assert info.value.hint is not None and "--force" in info.value.hint


@pytest.mark.parametrize("record", [
    {"kind": "bridge", "key": "br0", "vm": None, "record": {"name": "br0"}},
    {"kind": "bridge", "key": "br0", "vm": None, "record": {"name": "br0", "created": "yes"}},
    {"kind": "bridge", "key": "br0", "vm": None, "record": {"name": "", "created": True}},
    {"kind": "bridge", "key": "br0", "vm": None, "record": {"name": "x" * 16, "created": True}},
    {"kind": "bridge", "key": "br0", "vm": None, "record": {"name": "br0", "created": 1}},
    {"kind": "tap", "key": "t", "vm": "a", "record": {"name": "tap0"}},
    {"kind": "tap", "key": "t", "vm": "a", "record": {"name": "tap0", "bridge": "br0", "extra": 1}},
    {"kind": "pci", "key": "p", "vm": "a", "record": {"address": "15:00.0", "driver": "vfio-pci",
                                                       "original_driver": None}},
    {"kind": "pci", "key": "p", "vm": "a", "record": {"address": "0000:15:00.0", "driver": "e1000",
                                                       "original_driver": None}},
    {"kind": "pci", "key": "p", "vm": "a", "record": {"address": "0000:15:00.0", "driver": "vfio-pci",
                                                       "original_driver": "../../x"}},
    {"kind": "image", "key": "i", "vm": "a", "record": {"path": 5, "created": True}},
    {"kind": "image", "key": "i", "vm": "a", "record": []},
    {"kind": "tap", "key": 5, "record": {}},
    "not an object",
])
def test_a_damaged_record_names_file_and_record(run_dir: RunDir, record: Any) -> None:
    write(run_dir, good([{"kind": "image", "key": "/l/a.img", "vm": "a",
                          "record": {"path": "/l/a.img", "created": False}}, record]))
    with pytest.raises(JournalError, match=r"record 1 .*is damaged") as info:
        Journal.load(run_dir)
    assert str(run_dir.state) in info.value.message


def test_unknown_kind_says_which(run_dir: RunDir) -> None:
    write(run_dir, good([{"kind": "teleporter", "key": "k", "vm": None, "record": {}}]))
    with pytest.raises(JournalError, match="unknown kind 'teleporter'"):
        Journal.load(run_dir)


@pytest.mark.parametrize("doc", [[], "x", 3, {"version": 2, "resources": {}},
                                 {"version": 2, "vms": []},
                                 {"version": 2, "vms": {"a": {"pid": "1", "started": 1, "accel": "t"}}}])
def test_wrong_shapes_are_errors_not_crashes(run_dir: RunDir, doc: Any) -> None:
    write(run_dir, doc)
    with pytest.raises(JournalError):
        Journal.load(run_dir)


def test_not_json(run_dir: RunDir) -> None:
    run_dir.path.mkdir()
    run_dir.state.write_bytes(b"{\x00")
    with pytest.raises(JournalError, match="cannot be read"):
        Journal.load(run_dir)


def test_force_keeps_what_it_recognises(run_dir: RunDir) -> None:
    write(run_dir, good([
        {"kind": "tap", "key": "t0", "vm": "a", "record": {"name": "t0", "bridge": "br0"}},
        {"kind": "teleporter", "key": "k", "vm": None, "record": {}},
        {"kind": "bridge", "key": "br0", "vm": None, "record": {"name": "br0"}},
        # a record of version 1 carried its kind inside: still recognised with force
        {"kind": "bridge", "key": "br1", "vm": None,
         "record": {"kind": "bridge", "name": "br1", "created": True, "uplink": None}},
    ], version=1))
    journal = Journal.load(run_dir, force=True)
    assert [e.key for e in journal.resources] == ["t0", "br1"]
    assert len(journal.unreadable) == 3  # the version, the unknown kind and the damaged bridge
    assert any("teleporter" in line for line in journal.unreadable)
