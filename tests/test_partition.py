"""Partitions (rig/partition.py) and the lab's nftables table (host/nftables.py), without a lab:
the groups, where each network is cut, the rules and guest scripts made, and the command's errors.
The real cut, pinged across, is in tests/test_wire_real.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_spec
from vmlaunch.cli import main
from vmlaunch.core.naming import nft_table_name, tap_name
from vmlaunch.errors import AgentError, HostError, RuntimeFailure, UsageError
from vmlaunch.host import nftables
from vmlaunch.host.nftables import BridgeCut
from vmlaunch.lab import wire
from vmlaunch.lab.journal import Journal, VmEntry
from vmlaunch.layout.rundir import RunDir
from vmlaunch.rig import agent, partition
from vmlaunch.rig.agent import Result
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import LabSpec

SPEC = """
[lab]
name = "cut"
[network.lan]
bridge = "vlbr-cut"
[network.mc]
type = "socket"
[network.out]
type = "user"
[vm.a]
memory = "128M"
kernel = "/k"
[[vm.a.nic]]
network = "lan"
[[vm.a.nic]]
network = "out"
[vm.b]
memory = "128M"
kernel = "/k"
[[vm.b.nic]]
network = "lan"
[[vm.b.nic]]
network = "mc"
[vm.c]
memory = "128M"
kernel = "/k"
[[vm.c.nic]]
network = "lan"
[[vm.c.nic]]
network = "mc"
[vm.d]
memory = "128M"
kernel = "/k"
[[vm.d.nic]]
network = "mc"
[[vm.d.nic]]
network = "out"
"""


@pytest.fixture
def lab(tmp_path: Path) -> LabSpec:
    return load_lab(write_spec(tmp_path, SPEC))


def taps(*names: tuple[str, int]) -> tuple[str, ...]:
    return tuple(tap_name("cut", vm, index) for vm, index in names)


# --- the groups --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("before", "vms", "heal", "after"), [
    ([], ["a"], False, [["a"]]),
    ([["a"]], ["a"], False, [["a"]]),  # the same call twice: no change
    ([["a", "b"]], ["a", "b"], False, [["a", "b"]]),
    ([["a"]], ["b"], False, [["a"], ["b"]]),  # one more group
    ([["a", "b"]], ["b", "c"], False, [["a"], ["b", "c"]]),  # b moves
    ([["a"], ["b"]], ["a"], True, [["b"]]),
    ([["a", "b"]], ["b"], True, [["a"]]),
    ([["a"], ["b"]], [], True, []),  # heal alone: everything
    ([], ["c"], True, []),  # healing a VM that is not cut off: nothing to do
])
def test_regroup(before: list[list[str]], vms: list[str], heal: bool, after: list[list[str]]) -> None:
    assert partition.regroup(before, vms, heal=heal) == after


@pytest.mark.parametrize(("vms", "heal", "message"), [
    ([], False, "name the VMs to cut off"),
    (["a", "a"], False, "VM a named twice"),
    (["zz"], False, "no VM named 'zz'"),
    (["b", "zz"], True, "no VM named 'zz'"),
])
def test_bad_names(lab: LabSpec, vms: list[str], heal: bool, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        partition.check_names(lab, vms, heal=heal)


# --- where each network is cut -----------------------------------------------------------------------


def test_plan_cuts_the_bridge_on_the_host_and_the_socket_network_in_the_guests(lab: LabSpec) -> None:
    cuts = partition.plan(lab, [["b"]])
    assert cuts.where == {"lan": "host", "mc": "guest"}  # `out` is a user network: nothing joins VMs
    assert cuts.host == (BridgeCut("lan", (taps(("b", 0)), taps(("a", 0), ("c", 0))),
                                   ("b", "the rest (a,c)")),)
    macs = {vm.name: {nic.network: nic.mac for nic in vm.nics} for vm in lab.vms}
    assert {(cut.vm, cut.mac): set(cut.drop) for cut in cuts.guest} == {
        ("b", macs["b"]["mc"]): {macs["c"]["mc"], macs["d"]["mc"]},
        ("c", macs["c"]["mc"]): {macs["b"]["mc"]},
        ("d", macs["d"]["mc"]): {macs["b"]["mc"]},
    }


def test_a_network_with_one_side_only_is_not_cut(lab: LabSpec) -> None:
    assert partition.plan(lab, [["d"]]).where == {"mc": "guest"}  # d is not on lan
    cuts = partition.plan(lab, [["a", "b", "c"]])  # all of lan on one side
    assert cuts.where == {"mc": "guest"} and cuts.host == ()
    assert partition.plan(lab, []).where == {}


def test_groups_are_cut_from_each_other_and_from_the_rest(lab: LabSpec) -> None:
    (cut,) = partition.plan(lab, [["a"], ["b"]]).host
    assert cut.sides == (taps(("a", 0)), taps(("b", 0)), taps(("c", 0)))
    assert cut.labels == ("a", "b", "the rest (c)")


# --- the nftables rules ------------------------------------------------------------------------------


def test_the_ruleset_replaces_the_table_with_one_drop_rule_per_side() -> None:
    doc = nftables.ruleset("vmlaunch-cut", [BridgeCut("lan", (("t1",), ("t2", "t3")), ("a", "rest"))])
    commands = doc["nftables"]
    ref = {"family": "bridge", "name": "vmlaunch-cut"}
    assert commands[:3] == [{"add": {"table": ref}}, {"delete": {"table": ref}}, {"add": {"table": ref}}]
    assert commands[3]["add"]["chain"] == {"family": "bridge", "table": "vmlaunch-cut", "name": "forward",
                                           "type": "filter", "hook": "forward", "prio": 0,
                                           "policy": "accept"}
    rules = [command["add"]["rule"] for command in commands[4:]]
    assert [rule["comment"] for rule in rules] == ["lan: a cut off", "lan: rest cut off"]

    def names(rule: dict[str, Any], key: str) -> list[str]:
        (match,) = [e["match"] for e in rule["expr"]
                    if "match" in e and e["match"]["left"]["meta"]["key"] == key]
        return list(match["right"]["set"])

    assert (names(rules[0], "iifname"), names(rules[0], "oifname")) == (["t1"], ["t2", "t3"])
    assert (names(rules[1], "iifname"), names(rules[1], "oifname")) == (["t2", "t3"], ["t1"])
    assert all(rule["expr"][-1] == {"drop": None} and "counter" in rule["expr"][-2] for rule in rules)


def test_no_cut_removes_the_table_and_nothing_else() -> None:
    ref = {"family": "bridge", "name": "vmlaunch-cut"}
    assert nftables.ruleset("vmlaunch-cut", []) == {"nftables": [{"add": {"table": ref}},
                                                                 {"delete": {"table": ref}}]}


def test_the_table_is_named_after_the_lab() -> None:
    assert nft_table_name("lab-1") == "vmlaunch-lab-1"


def test_nft_missing_is_a_host_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nftables, "NFT", "/no/such/nft")
    with pytest.raises(HostError, match="the nft program is missing") as caught:
        nftables.apply("vmlaunch-cut", [])
    assert "apt-get install nftables" in str(caught.value)


# --- the guest side ----------------------------------------------------------------------------------


def test_the_guest_script_drops_by_source_mac_and_clears_its_own_filters_first() -> None:
    script = partition.guest_script({"52:54:00:00:00:01": ("52:54:00:00:00:02", "52:54:00:00:00:03"),
                                     "52:54:00:00:00:09": ()})
    lines = script.splitlines()
    assert "dev=$(nic 52:54:00:00:00:01) || exit 3" in lines
    assert 'tc filter del dev "$dev" ingress pref 7 2>/dev/null || :' in lines
    assert ('tc filter add dev "$dev" ingress pref 7 protocol all flower src_mac 52:54:00:00:00:03 '
            "action drop || exit 4") in lines
    after_healed = lines[lines.index("dev=$(nic 52:54:00:00:00:09) || exit 3") + 1:]
    assert after_healed == ['tc filter del dev "$dev" ingress pref 7 2>/dev/null || :']  # nothing to drop


# --- partition and heal on a lab that is "up" (a journal, no QEMU) -----------------------------------


@pytest.fixture
def up(lab: LabSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RunDir, list[Any],
                                                                                  list[tuple[str, str]]]:
    """The lab as if up: its run dir and journal; nft and the guests' channel recorded, not run."""
    run_dir = RunDir.of(tmp_path / "run", "cut")
    run_dir.create()
    Journal(run_dir, spec=str(lab.file), vms={vm.name: VmEntry(1, 0.0, "tcg") for vm in lab.vms}).save()
    applied: list[Any] = []
    scripts: list[tuple[str, str]] = []
    monkeypatch.setattr(nftables, "apply", lambda table, cuts: applied.append((table, tuple(cuts))))

    def run(run_dir: RunDir, vm: str, cmd: str | Sequence[str], **_: Any) -> Result:
        scripts.append((vm, str(cmd)))
        return Result(0, b"", b"")

    monkeypatch.setattr(agent, "run", run)
    return run_dir, applied, scripts


def test_partition_then_heal(lab: LabSpec, up: tuple[RunDir, list[Any], list[tuple[str, str]]]) -> None:
    run_dir, applied, scripts = up
    assert partition.partition(run_dir, lab, ["b"]) == [["b"]]
    record = wire.load(run_dir)["partition"]
    assert record == {"groups": [["b"]], "where": {"lan": "host", "mc": "guest"}}
    assert applied == [("vmlaunch-cut", partition.plan(lab, [["b"]]).host)]
    assert sorted(vm for vm, _ in scripts) == ["b", "c", "d"]  # every VM on mc
    assert all("action drop" in script for _, script in scripts)
    applied.clear()
    scripts.clear()
    assert partition.heal(run_dir, lab) == []
    assert wire.load(run_dir)["partition"] == {"groups": [], "where": {}}
    assert applied == [("vmlaunch-cut", ())]  # the table removed
    assert sorted(vm for vm, _ in scripts) == ["b", "c", "d"]
    assert not any("action drop" in script for _, script in scripts)  # their filters removed
    applied.clear()
    scripts.clear()
    assert partition.heal(run_dir, lab) == []  # nothing cut: nothing touched
    assert applied == [] and scripts == []


def test_a_bridge_only_cut_never_asks_the_guests(lab: LabSpec,
                                                 up: tuple[RunDir, list[Any], list[tuple[str, str]]]) -> None:
    run_dir, applied, scripts = up
    partition.partition(run_dir, lab, ["a"])
    assert wire.load(run_dir)["partition"]["where"] == {"lan": "host"}
    assert len(applied) == 1 and scripts == []


def test_cutting_every_vm_off_is_refused(lab: LabSpec,
                                         up: tuple[RunDir, list[Any], list[tuple[str, str]]]) -> None:
    run_dir, applied, _ = up
    with pytest.raises(UsageError, match="every VM of the lab"):
        partition.partition(run_dir, lab, ["a", "b", "c", "d"])
    assert applied == []


def test_a_guest_without_a_channel_or_tc_is_a_clear_error(
        lab: LabSpec, up: tuple[RunDir, list[Any], list[tuple[str, str]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, _, _ = up

    def no_channel(run_dir: RunDir, vm: str, cmd: object, **_: Any) -> Result:
        raise AgentError(f"{vm}: the command channel is not built yet")

    monkeypatch.setattr(agent, "run", no_channel)
    with pytest.raises(AgentError, match="command channel"):
        partition.partition(run_dir, lab, ["d"])
    record = wire.load(run_dir)["partition"]  # the undo could not reach the guests either: kept
    assert (record["groups"], record["where"]) == ([], {"mc": "guest"})
    assert record["unfinished"].startswith("a change failed half-way (b: the command channel is not built")

    def no_tc(run_dir: RunDir, vm: str, cmd: str, **_: Any) -> Result:  # a guest without tc removes fine
        cut = "action drop" in cmd
        return Result(127, b"", b"no tc (iproute2) in the guest\n") if cut else Result(0, b"", b"")

    monkeypatch.setattr(agent, "run", no_tc)
    with pytest.raises(RuntimeFailure, match=r"cannot cut its socket network in the guest: no tc") as caught:
        partition.partition(run_dir, lab, ["d"])
    assert "install iproute2" in str(caught.value)
    assert wire.load(run_dir)["partition"] == {"groups": [], "where": {}}  # a cut that failed: not kept


def test_a_failed_heal_keeps_the_partition(lab: LabSpec, up: tuple[RunDir, list[Any], list[tuple[str, str]]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, applied, _ = up
    partition.partition(run_dir, lab, ["b"])
    kept = wire.load(run_dir)["partition"]
    monkeypatch.setattr(agent, "run", lambda *a, **k: Result(4, b"", b"RTNETLINK answers: busy\n"))
    with pytest.raises(RuntimeFailure, match="RTNETLINK answers: busy"):
        partition.heal(run_dir, lab)
    record = wire.load(run_dir)["partition"]
    assert {key: record[key] for key in kept} == kept  # still cut, as recorded
    assert "undoing it failed too (b: the guest's tc could not" in record["unfinished"]  # busy again
    assert applied[-1] == ("vmlaunch-cut", partition.plan(lab, [["b"]]).host)  # the table put back


def test_a_cut_that_fails_in_the_guests_takes_its_host_cut_back(
        lab: LabSpec, up: tuple[RunDir, list[Any], list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    run_dir, applied, _ = up
    monkeypatch.setattr(agent, "run", lambda *a, **k: Result(4, b"", b"Unknown filter \"flower\"\n"))
    with pytest.raises(RuntimeFailure, match="cls_flower"):
        partition.partition(run_dir, lab, ["b"])
    assert applied == [("vmlaunch-cut", partition.plan(lab, [["b"]]).host), ("vmlaunch-cut", ())]
    record = wire.load(run_dir)["partition"]  # the guests' undo failed too: what may be left is named
    assert (record["groups"], record["where"]) == ([], {"mc": "guest"})
    monkeypatch.setattr(agent, "run", lambda *a, **k: Result(0, b"", b""))
    with caplog.at_level(logging.INFO):
        assert partition.heal(run_dir, lab) == []
    assert wire.load(run_dir)["partition"] == {"groups": [], "where": {}}
    assert "unfinished change of the partition left: mc (the tc filters of b, c, d)" in caplog.text


def test_a_change_names_what_it_may_leave_before_it_touches_anything(
        lab: LabSpec, up: tuple[RunDir, list[Any], list[tuple[str, str]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, _, _ = up
    seen: list[Any] = []
    monkeypatch.setattr(nftables, "apply", lambda table, cuts: seen.append(wire.load(run_dir)["partition"]))
    partition.partition(run_dir, lab, ["a"])
    assert seen == [{"groups": [["a"]], "where": {"lan": "host"}, "unfinished": partition.INTERRUPTED}]
    assert "unfinished" not in wire.load(run_dir)["partition"]


def test_a_guest_cut_needs_every_guest_on_the_network_to_have_a_channel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tmp_path / "off.toml"
    spec.write_text('[lab]\nname = "cut"\n[network.mc]\ntype = "socket"\n'
                    + "".join(f'[vm.{vm}]\nmemory = 64\nkernel = "k"\n{extra}'
                              f'[[vm.{vm}.nic]]\nnetwork = "mc"\n'
                              for vm, extra in (("a", ""), ("b", "agent = false\n"))))
    (tmp_path / "k").write_bytes(b"")
    off = load_lab(spec)
    run_dir = RunDir.of(tmp_path / "run", "cut")
    run_dir.create()
    Journal(run_dir, spec=str(spec), vms={vm.name: VmEntry(1, 0.0, "tcg") for vm in off.vms}).save()
    asked: list[str] = []

    def run(run_dir: RunDir, vm: str, *args: Any, **kwargs: Any) -> Result:
        asked.append(vm)
        return Result(0, b"", b"")

    monkeypatch.setattr(agent, "run", run)
    with pytest.raises(AgentError, match="VM b has no command channel"):
        partition.partition(run_dir, off, ["a"])
    assert asked == [] and wire.load(run_dir)["partition"]["groups"] == []


def test_a_lab_that_is_not_up_is_refused(lab: LabSpec, tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure, match="lab cut is not up"):
        partition.partition(RunDir.of(tmp_path, "cut"), lab, ["a"])


def test_down_removes_the_table_the_record_names(up: tuple[RunDir, list[Any], list[tuple[str, str]]],
                                                 lab: LabSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, applied, _ = up
    partition.partition(run_dir, lab, ["a"])
    applied.clear()
    assert partition.remove_table(run_dir) == []
    assert applied == [("vmlaunch-cut", ())]

    def fails(table: str, cuts: object) -> None:
        raise HostError("nft failed: no")

    monkeypatch.setattr(nftables, "apply", fails)
    assert partition.remove_table(run_dir) == ["the lab's partition (nftables table vmlaunch-cut) could "
                                               "not be removed: nft failed: no"]


def test_without_a_record_a_table_left_is_still_removed(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = RunDir.of(tmp_path, "cut")
    removed: list[str] = []
    monkeypatch.setattr("shutil.which", lambda name: "/usr/sbin/nft")
    monkeypatch.setattr(nftables, "tables", lambda: ["vmlaunch-cut", "vmlaunch-other"])
    monkeypatch.setattr(nftables, "remove", removed.append)
    assert partition.remove_table(run_dir) == []
    assert removed == ["vmlaunch-cut"]


# --- the command -------------------------------------------------------------------------------------


def test_the_command_refuses_bad_names_and_a_lab_that_is_not_up(tmp_path: Path, run_dir: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(write_spec(tmp_path, SPEC))
    assert main(["partition", spec, "a", "a"]) == 64
    assert "VM a named twice" in capsys.readouterr().err
    assert main(["partition", spec, "nope"]) == 64
    assert "no VM named 'nope'" in capsys.readouterr().err
    assert main(["partition", spec, "a"]) == 4
    err = capsys.readouterr().err
    assert "lab cut is not up" in err and "Traceback" not in err
    assert main(["partition", spec]) == 4
    assert main(["link", spec, "a", "0", "sideways"]) == 64
    assert main(["link", spec, "a", "7", "down"]) == 64
    assert "VM a has no NIC 7 (its NICs: 0 (lan), 1 (out))" in capsys.readouterr().err
    assert main(["link", spec, "a", "lan", "down"]) == 4
    assert "Traceback" not in capsys.readouterr().err


def test_the_command_prints_the_partition(lab: LabSpec, up: tuple[RunDir, list[Any], list[tuple[str, str]]],
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _, _ = up
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(run_dir.path.parent))
    assert main(["partition", str(lab.file), "b"]) == 0
    assert capsys.readouterr().out == "partition: b | the rest: a, c, d (cut on lan: host, mc: guest)\n"
    assert main(["partition", str(lab.file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"groups": [["b"]], "where": {"lan": "host", "mc": "guest"}}
    assert main(["partition", str(lab.file), "--heal", "b"]) == 0
    assert capsys.readouterr().out.startswith("no partition")
    assert main(["partition", str(lab.file), "c", "d"]) == 0
    assert main(["partition", str(lab.file), "c", "--heal"]) == 0  # the VMs before --heal count too
    assert capsys.readouterr().out.splitlines()[-1] == "partition: d | the rest: a, b, c (cut on mc: guest)"
