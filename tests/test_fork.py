"""`vmlaunch fork`'s pure parts: the clones' names, addresses, forwarded ports, their VmSpecs as
members of the lab (spec/forks.py), the book of clones (resources/clone.py) and the refusals."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import attrs
import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.errors import RuntimeFailure, UsageError
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.clone import Book, BookError, Forking, read_book, write_book
from vmlaunch.runtime.fork import refusals
from vmlaunch.spec import forks
from vmlaunch.spec.forks import Clone
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import LabSpec, PciDevice, Share, UserNetwork

SPEC = """
[lab]
name = "f"
[network.lan]
type = "socket"
subnet = "10.9.0.0/24"
[network.out]
type = "user"
forward = ["tcp:127.0.0.1:8080-:80", "udp::5353-:53"]
[vm.a]
memory = "256M"
kernel = "/boot/k"
[[vm.a.nic]]
network = "lan"
ip = "10.9.0.254"
[[vm.a.nic]]
network = "out"
[[vm.a.disk]]
file = "data.qcow2"
size = "1G"
[[vm.a.disk]]
file = "ro.raw"
size = "1M"
readonly = true
[vm.b]
memory = "256M"
kernel = "/boot/k"
[[vm.b.nic]]
network = "lan"
ip = "10.9.0.2"
"""


@pytest.fixture
def lab(tmp_path: Path) -> LabSpec:
    return load_lab(write_spec(tmp_path, SPEC))


def test_default_names_count_on_after_the_clones_there_are() -> None:
    assert forks.names(None, "web", 3, {"web"}) == ["web-1", "web-2", "web-3"]
    assert forks.names(None, "web", 2, {"web", "web-1", "web-7", "webx-9"}) == ["web-8", "web-9"]


def test_a_pattern_numbers_from_one_and_must_make_new_vm_names() -> None:
    assert forks.names("node{i}", "web", 2, {"web"}) == ["node1", "node2"]
    with pytest.raises(UsageError, match=r"has no \{i\}"):
        forks.names("node", "web", 2, set())
    with pytest.raises(UsageError, match="not a VM name"):
        forks.names("Node_{i}", "web", 1, set())
    with pytest.raises(UsageError, match="node2 exists already"):
        forks.names("node{i}", "web", 3, {"node2"})
    with pytest.raises(UsageError, match="1 to 64"):
        forks.names(None, "web", 0, set())


def test_the_next_free_address_skips_what_is_used_and_wraps() -> None:
    used = {ipaddress.IPv4Address("10.9.0.12")}
    assert forks.next_address("10.9.0.11/24", used, "10.9.0.0/24") == "10.9.0.13/24"
    # past the end: .2 (.1 is a gateway's by custom)
    assert forks.next_address("10.9.0.254/24", used, None) == "10.9.0.2/24"
    with pytest.raises(UsageError, match="no free address"):
        forks.next_address("10.9.0.1/30", {ipaddress.IPv4Address("10.9.0.2")}, None)


def test_forwarding_rules_get_the_clone_s_ports() -> None:
    assert forks.forward_rules(["tcp:127.0.0.1:8080-:80", "udp::53-10.0.2.15:53"], [4001, 4002]) == (
        "tcp:127.0.0.1:4001-:80", "udp::4002-10.0.2.15:53")


def test_a_clone_is_its_source_with_an_identity_and_disks_of_its_own(lab: LabSpec) -> None:
    clone = Clone("a-1", "a", 1, 1, "a", ("10.9.0.3/24", None),
                  (("out", ("tcp:127.0.0.1:4001-:80", "udp::4002-:53")),))
    members = forks.with_clones(lab, [clone])
    assert [vm.name for vm in members.vms] == ["a", "b", "a-1"]
    a, copy = members.vm("a"), members.vm("a-1")
    assert copy.nics[0].mac != a.nics[0].mac and copy.nics[0].ip == "10.9.0.3/24"
    assert copy.nics[1].mac == a.nics[1].mac  # a user network is the clone's own: its MAC stays
    assert copy.nics[1].network == "out@a-1"
    own = members.network("out@a-1")
    assert isinstance(own, UserNetwork) and own.forward == ("tcp:127.0.0.1:4001-:80", "udp::4002-:53")
    assert copy.disks[0].file == lab.file.parent / ".vmlaunch" / "f" / "a-1" / "disk0.qcow2"
    assert copy.disks[0].size is None and copy.disks[1] == a.disks[1]  # read-only: shared as it is
    assert copy.memory_mib == a.memory_mib and copy.kernel == a.kernel


def test_a_clone_of_a_clone_takes_the_spec_s_vm_and_outlives_its_source(lab: LabSpec) -> None:
    first = Clone("a-1", "a", 1, 1, "a", ("10.9.0.3/24", None))
    second = Clone("a-1-1", "a-1", 2, 1, "a", ("10.9.0.4/24", None))
    assert [vm.name for vm in forks.with_clones(lab, [second]).vms] == ["a", "b", "a-1-1"]
    assert [vm.name for vm in forks.with_clones(lab, [first, second]).vms] == ["a", "b", "a-1", "a-1-1"]


def test_a_clone_whose_vm_left_the_spec_is_not_a_member(lab: LabSpec) -> None:
    assert forks.with_clones(lab, [Clone("z-1", "z", 1, 1)]) is lab


def test_clones_and_the_book_round_trip(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    assert read_book(run_dir) == Book()
    clone = Clone("a-1", "a", 3, 1, "a", ("10.9.0.3/24", None), (("out", ("tcp::1-:2",)),), True,
                  1795000000.25)
    book = Book((clone,), 3, Forking(3, 42, "a", ("a-1",), paused=True))
    write_book(run_dir, book)
    assert read_book(run_dir) == book
    assert read_book(run_dir).without({"a-1"}).clones == ()
    write_book(run_dir, Book())
    assert not run_dir.forks.exists()  # nothing to keep: no file


@pytest.mark.parametrize("doc", ["[]", '{"version": 9}', '{"version": 1, "clones": [{"name": "../x", '
                                 '"source": "a", "fork": 1, "index": 1}]}',
                                 '{"version": 1, "clones": [], "forking": {"fork": "1"}}'])
def test_a_damaged_book_is_an_error_naming_it(tmp_path: Path, doc: str) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    run_dir.forks.write_text(doc)
    with pytest.raises(BookError, match="forks.json"):
        read_book(run_dir)


def test_refusals_say_why(lab: LabSpec, tmp_path: Path) -> None:
    host = fake_host()
    a = lab.vm("a")
    with pytest.raises(RuntimeFailure, match="PCI device") as caught:
        refusals(lab, attrs.evolve(a, pci=(PciDevice("0000:01:00.0"),)), 1, host, ["a"])
    assert caught.value.exit_code == 2  # what the spec gives the VM rules the fork out: exit 2
    with pytest.raises(RuntimeFailure, match="9p share"):
        refusals(lab, attrs.evolve(a, shares=(Share(tmp_path, "/srv", "share0"),)), 1, host, ["a"])
    small = attrs.evolve(lab, memory=attrs.evolve(lab.memory, budget_mib=600))
    with pytest.raises(RuntimeFailure, match="need 512 MiB.*hold 256 MiB of its budget of 600 MiB"):
        refusals(small, a, 2, host, ["a"])
    refusals(small, a, 1, host, ["a"])  # 512 of 600: fits


def test_the_book_json_is_what_to_json_says(tmp_path: Path) -> None:
    clone = Clone("a-1", "a", 1, 2)
    assert json.loads(json.dumps(clone.to_json())) == {
        "name": "a-1", "source": "a", "base": "a", "fork": 1, "index": 2, "addresses": [],
        "forwards": {}, "same_identity": False, "forked": 0.0}
