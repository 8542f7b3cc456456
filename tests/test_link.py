"""`vmlaunch link` and `Vm.link` (rig/link.py) against a recorded QMP: the command sent, the record
in wire.json, and how `status` reads it. The guest seeing its carrier go is in tests/test_wire_real.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_spec
from vmlaunch.errors import UsageError
from vmlaunch.lab import wire
from vmlaunch.layout.rundir import RunDir
from vmlaunch.rig import link
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import LabSpec

SPEC = """
[lab]
name = "links"
[network.lan]
bridge = "vlbr-links"
[network.out]
type = "user"
[vm.a]
memory = "128M"
kernel = "/k"
[[vm.a.nic]]
network = "out"
[[vm.a.nic]]
network = "lan"
"""


class RecordedQmp:
    sent: list[tuple[str, dict[str, Any]]] = []

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path

    def __enter__(self) -> RecordedQmp:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def cmd(self, command: str, **args: Any) -> Any:
        self.sent.append((command, args))
        return {}


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LabSpec, RunDir]:
    run_dir = RunDir.of(tmp_path / "run", "links")
    run_dir.create()
    RecordedQmp.sent = []
    monkeypatch.setattr(link, "QuickQmp", RecordedQmp)
    monkeypatch.setattr(link, "running_pid", lambda run_dir, vm: 4242)
    return load_lab(write_spec(tmp_path, SPEC)), run_dir


@pytest.mark.parametrize(("nic", "index"), [("1", 1), ("nic1", 1), ("net1", 1), ("lan", 1), (0, 0),
                                            ("out", 0)])
def test_the_nic_is_named_as_everywhere(lab: tuple[LabSpec, RunDir], nic: str | int, index: int) -> None:
    spec, run_dir = lab
    assert link.set_link(run_dir, spec, "a", nic, False) == index
    assert RecordedQmp.sent == [("set_link", {"name": f"nic{index}", "up": False})]  # the device's id


def test_down_is_recorded_with_its_qemu_and_up_clears_it(lab: tuple[LabSpec, RunDir]) -> None:
    spec, run_dir = lab
    link.set_link(run_dir, spec, "a", "lan", False)
    state = wire.load(run_dir)
    assert state["nics"] == {"a/1": {"link": "down", "link_qemu": 4242}}
    assert link.link_of(state, "a", 1, 4242) == "down"
    assert link.link_of(state, "a", 0, 4242) == "up"
    assert link.link_of(state, "a", 1, 999) == "up"  # another QEMU now: it started with its link up
    assert link.link_of(state, "a", 1, None) == "up"
    link.set_link(run_dir, spec, "a", "lan", True)
    assert wire.load(run_dir)["nics"] == {}


def test_down_of_the_vm_forgets_its_links_but_keeps_other_faults(lab: tuple[LabSpec, RunDir]) -> None:
    spec, run_dir = lab
    link.set_link(run_dir, spec, "a", "lan", False)

    def add_netem(state: wire.State) -> None:
        state["nics"]["a/1"]["netem"] = {"delay_ms": 5, "where": "guest"}

    wire.update(run_dir, add_netem)
    link.forget(run_dir, {"a"})
    assert wire.load(run_dir)["nics"] == {"a/1": {"netem": {"delay_ms": 5, "where": "guest"}}}


@pytest.mark.parametrize(("vm", "nic", "up", "message"), [
    ("zz", "0", False, "no VM named 'zz'"),
    ("a", "nic5", False, "VM a has no NIC nic5"),
    ("a", "wan", False, "VM a has no NIC 'wan'"),
    ("a", "0", "down", "up must be True or False"),
])
def test_bad_input_is_a_usage_error(lab: tuple[LabSpec, RunDir], vm: str, nic: str, up: Any,
                                    message: str) -> None:
    spec, run_dir = lab
    with pytest.raises(UsageError, match=message):
        link.set_link(run_dir, spec, vm, nic, up)
    assert RecordedQmp.sent == []


def test_status_shows_a_link_that_is_down() -> None:
    from vmlaunch.runtime.control import NicStatus

    nic = NicStatus(1, "lan", "bridge", "52:54:00:00:00:01", "virtio", bridge="br0", tap="vl-x")
    assert not nic.describe().endswith("link down")
    import attrs

    down = attrs.evolve(nic, link="down")
    assert down.describe().endswith("(bridge br0, tap vl-x), link down")
    assert attrs.asdict(down)["link"] == "down"
