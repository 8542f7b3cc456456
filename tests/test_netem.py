"""netem at run time: whether the host kernel has it, the netlink requests of the host path (a fake
IPRoute: this machine's kernel has no sch_netem), the guest path's commands (a fake agent.run), the
record in wire.json, `down`'s undo, the spec's netem in the plan, and the CLI's errors."""

from __future__ import annotations

import errno
import gzip
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.cli import main
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.core.naming import interface_mark, netem_ifb_name, tap_name
from vmlaunch.errors import HostError
from vmlaunch.host import netem as host_netem
from vmlaunch.host.links import IFB_KIND, TUN_KIND, LinkError, Netlink
from vmlaunch.lab import wire
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.netem import NetemRecord, TapNetem
from vmlaunch.resources.tap import Tap
from vmlaunch.rig import agent, netem
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import Netem, NetemWhere

LAB = '''[lab]
name = "nt"
[lab.memory]
ksm = false
[network.lan]
[network.nat]
type = "user"
[vm.a]
memory = 64
kernel = "/dev/null"
[[vm.a.nic]]
network = "lan"
[[vm.a.nic]]
network = "nat"
'''


# --- does the kernel have netem? ----------------------------------------------------------------------


def _kernel(tmp_path: Path, *, config: str | None = None, boot: str | None = None, loaded: bool = False,
            builtin: str | None = None) -> bool | None:
    proc, boot_dir, sys_root, modules = (tmp_path / d for d in ("proc", "boot", "sys", "modules"))
    for folder in (proc, boot_dir, sys_root / "module", modules / "6.1"):
        folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (proc / "config.gz").write_bytes(gzip.compress(config.encode()))
    if boot is not None:
        (boot_dir / "config-6.1").write_text(boot)
    if loaded:
        (sys_root / "module" / "sch_netem").mkdir()
    if builtin is not None:
        (modules / "6.1" / "modules.builtin").write_text(builtin)
    return host_netem.kernel_has_netem(proc, boot_dir, sys_root, modules, "6.1")


def test_kernel_netem_from_what_it_says_of_itself(tmp_path: Path) -> None:
    assert _kernel(tmp_path / "1", config="CONFIG_X=y\n# CONFIG_NET_SCH_NETEM is not set\n") is False
    assert _kernel(tmp_path / "2", config="CONFIG_NET_SCH_NETEM=m\n") is True
    assert _kernel(tmp_path / "3", boot="CONFIG_NET_SCH_NETEM=y\n") is True
    assert _kernel(tmp_path / "4", config="CONFIG_NET_SCH_NETEM is not set", loaded=True) is True
    assert _kernel(tmp_path / "5", builtin="kernel/net/sched/sch_netem.ko\n") is True
    assert _kernel(tmp_path / "6", builtin="kernel/net/sched/sch_tbf.ko\n") is False
    assert _kernel(tmp_path / "7") is None
    (tmp_path / "8" / "proc").mkdir(parents=True)
    (tmp_path / "8" / "proc" / "config.gz").write_bytes(b"not gzip")
    assert _kernel(tmp_path / "8", boot="# CONFIG_NET_SCH_NETEM is not set\n") is False


def test_this_machine_has_no_netem() -> None:
    if not Path("/proc/config.gz").exists():
        pytest.skip("the kernel does not say")
    assert host_netem.kernel_has_netem() is False  # as the issue says of this machine


# --- the host path: the netlink requests ----------------------------------------------------------------


class FakeIPRoute:
    """IPRoute's link() and tc(), recording every request; interfaces by name."""

    def __init__(self, links: dict[str, dict[str, Any]], tc_error: int | None = None) -> None:
        self.links = links
        self.calls: list[tuple[Any, ...]] = []
        self.tc_error = tc_error
        self.next_index = 100

    def _msg(self, name: str) -> dict[Any, Any]:
        link = self.links[name]
        return {"index": link["index"], "ifname": name, ("linkinfo", "kind"): link.get("kind"),
                "ifalias": link.get("alias"), "flags": 1}

    def _by_index(self, index: int) -> str:
        return next(name for name, link in self.links.items() if link["index"] == index)

    def link(self, command: str, **kwargs: Any) -> list[dict[Any, Any]]:
        from pyroute2.netlink.exceptions import NetlinkError

        self.calls.append(("link", command, kwargs))
        if command == "get":
            if kwargs["ifname"] not in self.links:
                raise NetlinkError(errno.ENODEV, "No such device")
            return [self._msg(kwargs["ifname"])]
        if command == "add":
            self.next_index += 1
            self.links[kwargs["ifname"]] = {"index": self.next_index, "kind": kwargs.get("kind")}
        elif command == "set" and "ifalias" in kwargs:
            self.links[self._by_index(kwargs["index"])]["alias"] = kwargs["ifalias"]
        elif command == "del":
            del self.links[self._by_index(kwargs["index"])]
        return []

    def tc(self, command: str, kind: str | None, index: int, **kwargs: Any) -> list[Any]:
        from pyroute2.netlink.exceptions import NetlinkError

        self.calls.append(("tc", command, kind, self._by_index(index), kwargs))
        if self.tc_error is not None and kind == "netem":
            raise NetlinkError(self.tc_error, "Specified qdisc kind is unknown.")
        if command == "del" and kwargs.get("root"):
            raise NetlinkError(errno.ENOENT, "Cannot delete qdisc with handle of zero.")
        return []


TAP = tap_name("nt", "a", 0)
IFB = netem_ifb_name(TAP)


def _fake(tc_error: int | None = None, ifb: dict[str, Any] | None = None) -> FakeIPRoute:
    links = {TAP: {"index": 7, "kind": TUN_KIND, "alias": interface_mark("nt", vm="a", bridge="br")}}
    if ifb is not None:
        links[IFB] = ifb
    return FakeIPRoute(links, tc_error)


def test_the_ifb_is_named_from_the_tap() -> None:
    assert IFB.startswith("vli") and IFB[3:] == TAP[3:] and len(IFB) == 15


def test_host_path_requests() -> None:
    ipr = _fake()
    netem_ = Netem(delay_ms=100.0, jitter_ms=10.0, loss=30.0, corrupt=1.0, duplicate=2.0, reorder=25.0,
                   rate_bit=10_000_000)
    host_netem.apply_on_tap(Netlink(ipr), "nt", "a", TAP, IFB, netem_)
    assert ipr.links[IFB]["kind"] == IFB_KIND
    assert ipr.links[IFB]["alias"] == f"vmlaunch lab=nt vm=a tap={TAP}"
    assert ("link", "set", {"index": ipr.links[IFB]["index"], "state": "up"}) in ipr.calls
    tc = [call[1:] for call in ipr.calls if call[0] == "tc"]
    assert tc == [
        ("replace", "netem", IFB, {"handle": 0x10000, "rate": 1_250_000, "delay": 100_000,
                                   "jitter": 10_000, "loss": 30.0, "duplicate": 2.0, "prob_corrupt": 1.0,
                                   "prob_reorder": 25.0}),
        ("replace", "ingress", TAP, {"handle": 0xFFFF0000}),
        ("replace-filter", "u32", TAP, {"parent": 0xFFFF0000, "prio": 1, "protocol": 3,
                                        "keys": ["0x0/0x0+0"],
                                        "action": {"kind": "mirred", "direction": "egress",
                                                   "action": "redirect",
                                                   "ifindex": ipr.links[IFB]["index"]}}),
        ("replace", "netem", TAP, {"handle": 0x10000, "rate": 1_250_000}),  # rate: each direction
    ]


def test_host_path_without_a_rate_clears_the_taps_root() -> None:
    ipr = _fake(ifb={"index": 9, "kind": IFB_KIND, "alias": f"vmlaunch lab=nt vm=a tap={TAP}"})
    host_netem.apply_on_tap(Netlink(ipr), "nt", "a", TAP, IFB, Netem(delay_ms=5.0))
    assert not any(call[:2] == ("link", "add") for call in ipr.calls)  # the IFB there is reused
    tc = [call[1:4] for call in ipr.calls if call[0] == "tc"]
    assert tc == [("replace", "netem", IFB), ("replace", "ingress", TAP), ("replace-filter", "u32", TAP),
                  ("del", None, TAP)]


def test_a_kernel_without_netem_is_exit_3() -> None:
    ipr = _fake(tc_error=errno.ENOENT)
    with pytest.raises(HostError) as info:
        host_netem.apply_on_tap(Netlink(ipr), "nt", "a", TAP, IFB, Netem(loss=1.0))
    assert info.value.exit_code == 3 and "CONFIG_NET_SCH_NETEM" in str(info.value)


def test_an_interface_that_is_not_the_labs_ifb_is_refused() -> None:
    ipr = _fake(ifb={"index": 9, "kind": "dummy"})
    with pytest.raises(LinkError, match="not marked by vmlaunch"):
        host_netem.apply_on_tap(Netlink(ipr), "nt", "a", TAP, IFB, Netem(loss=1.0))
    ipr = FakeIPRoute({})
    with pytest.raises(LinkError, match="the tap of a does not exist"):
        host_netem.apply_on_tap(Netlink(ipr), "nt", "a", TAP, IFB, Netem(loss=1.0))


def test_clear_on_tap() -> None:
    ipr = _fake(ifb={"index": 9, "kind": IFB_KIND, "alias": "vmlaunch lab=nt vm=a"})
    host_netem.clear_on_tap(Netlink(ipr), "nt", TAP, IFB)
    assert IFB not in ipr.links
    tc = [call[1:] for call in ipr.calls if call[0] == "tc"]
    assert tc == [("del", None, TAP, {"root": True, "handle": 0x10000}),
                  ("del", "ingress", TAP, {"handle": 0xFFFF0000})]
    other = _fake(ifb={"index": 9, "kind": IFB_KIND, "alias": "vmlaunch lab=other vm=a"})
    host_netem.clear_on_tap(Netlink(other), "nt", TAP, IFB)
    assert IFB in other.links  # another lab's: left


def test_lab_ifbs_by_mark() -> None:
    from vmlaunch.host.links import Link

    links = [Link(1, "vli1", IFB_KIND, None, False, alias="vmlaunch lab=nt vm=a tap=x"),
             Link(2, "vli2", IFB_KIND, None, False, alias="vmlaunch lab=nt vm=b tap=y"),
             Link(3, "vli3", IFB_KIND, None, False, alias="vmlaunch lab=zz vm=a tap=z"),
             Link(4, "vl-4", TUN_KIND, None, False, alias="vmlaunch lab=nt vm=a")]
    assert [link.name for link in host_netem.lab_ifbs(links, "nt")] == ["vli1", "vli2"]
    assert [link.name for link in host_netem.lab_ifbs(links, "nt", ["b"])] == ["vli2"]


def test_the_spec_resource_undoes_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    from vmlaunch.resources import netem as resource
    from vmlaunch.resources.base import Context

    ipr = _fake()

    @contextlib.contextmanager
    def fake_netlink(name: str) -> Any:
        yield Netlink(ipr)

    monkeypatch.setattr(resource, "netlink", fake_netlink)
    done = TapNetem(tap=TAP, ifb=IFB, vm="a", index=0, netem=Netem(loss=1.0)).apply(Context(lab="nt"))
    assert done == NetemRecord(tap=TAP, ifb=IFB, vm="a", index=0) and IFB in ipr.links
    done.undo(Context(lab="nt"), rollback=False)
    assert IFB not in ipr.links
    done.undo(Context(lab="nt"), rollback=False)  # twice: nothing to do


# --- the spec's netem in the plan ---------------------------------------------------------------------


def test_spec_netem_in_the_plan(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, LAB.replace('network = "lan"\n', 'network = "lan"\nnetem = { loss = 1 }\n')
                      .replace('network = "nat"\n', 'network = "nat"\nnetem = { delay = "5ms" }\n'))
    lab = load_lab(spec)
    plan = compile_lab(lab, fake_host(netem=True))
    kinds = [type(r).__name__ for r in plan.resources if isinstance(r, (Tap, TapNetem))]
    assert kinds == ["Tap", "TapNetem"]  # right after its tap
    assert plan.vm("a").guest_netem == ((1, lab.vm("a").nics[1].mac, Netem(delay_ms=5.0)),)
    plan = compile_lab(lab, fake_host(netem=False))  # auto: the guest where the host has no netem
    assert not any(isinstance(r, TapNetem) for r in plan.resources)
    assert [index for index, _, _ in plan.vm("a").guest_netem] == [0, 1]


def test_spec_netem_on_the_host_of_a_kernel_without_it(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, LAB.replace('network = "lan"\n',
                                            'network = "lan"\nnetem = { loss = 1, where = "host" }\n'))
    with pytest.raises(HostError) as info:
        compile_lab(load_lab(spec), fake_host(netem=False))
    assert str(info.value).startswith(f"{spec}:13: vm.a.nic[0].netem: this host's kernel has no netem "
                                      "(CONFIG_NET_SCH_NETEM is not set)")


# --- the guest path -----------------------------------------------------------------------------------


class FakeAgent:
    def __init__(self, exit_code: int = 0, stderr: bytes = b"") -> None:
        self.sent: list[tuple[str, Any, float | None]] = []
        self.exit_code, self.stderr = exit_code, stderr

    def __call__(self, run_dir: RunDir, vm: str, cmd: Any, *, timeout: float | None = 60.0,
                 input: bytes | None = None) -> agent.Result:
        self.sent.append((vm, cmd, timeout))
        return agent.Result(self.exit_code, b"", self.stderr)


def test_guest_tc_words() -> None:
    netem_ = Netem(delay_ms=100.0, jitter_ms=0.5, loss=30.0, corrupt=0.1, duplicate=1.0, reorder=25.0,
                   rate_bit=10_000_000)
    assert netem.tc_netem_words(netem_) == ["netem", "delay", "100000us", "500us", "loss", "30%",
                                            "corrupt", "0.1%", "duplicate", "1%", "reorder", "25%",
                                            "rate", "10000000bit"]
    assert netem.tc_netem_words(netem_, rate_only=True) == ["netem", "rate", "10000000bit"]


def test_guest_script() -> None:
    script = netem.guest_script("52:54:00:AA:BB:CC", 1, Netem(delay_ms=100.0, rate_bit=8000))
    assert "mac=52:54:00:aa:bb:cc; ifb=vlifb1; dev=" in script
    assert 'tc qdisc replace dev "$dev" root netem delay 100000us rate 8000bit' in script
    assert 'ip link add "$ifb" type ifb' in script
    assert ('tc filter replace dev "$dev" parent ffff: protocol all prio 1 u32 match u32 0 0 action mirred '
            'egress redirect dev "$ifb"') in script
    assert 'tc qdisc replace dev "$ifb" root netem rate 8000bit' in script
    no_rate = netem.guest_script("52:54:00:aa:bb:cc", 0, Netem(loss=30.0))
    assert "ifb type ifb" not in no_rate and "netem loss 30%" in no_rate
    clear = netem.guest_script("52:54:00:aa:bb:cc", 0, None)
    assert "netem" not in clear.replace("sch_netem", "") and 'tc qdisc del dev "$dev" root' in clear


def test_guest_script_runs_in_a_shell(tmp_path: Path) -> None:
    """The script is valid sh: with no interface of that MAC it says so (exit 90)."""
    import subprocess

    script = netem.guest_script("02:00:00:00:00:01", 0, Netem(delay_ms=1.0))
    done = subprocess.run(["sh", "-c", script], capture_output=True, check=False)
    assert done.returncode == netem.NO_INTERFACE
    assert b"no interface with MAC 02:00:00:00:00:01" in done.stderr


@pytest.mark.parametrize(("code", "stderr", "error", "words"), [
    (netem.NO_TC, b"", HostError, "the guest has no tc of iproute2"),
    (netem.NO_NETEM, b"Error: Specified qdisc kind is unknown.", HostError,
     "the guest's kernel has no netem (sch_netem): Error: Specified qdisc kind is unknown."),
    (netem.NO_IFB, b"RTNETLINK answers: Operation not supported", HostError, "cannot make an IFB"),
    (netem.NO_INTERFACE, b"", RuntimeError, "no interface with the NIC's MAC"),
    (netem.TC_FAILED, b"bad\nError: oops", RuntimeError, "failed (exit 94): Error: oops"),
])
def test_guest_failures(monkeypatch: pytest.MonkeyPatch, run_dir: Path, code: int, stderr: bytes,
                        error: type[Exception], words: str) -> None:
    from vmlaunch.errors import RuntimeFailure, VmlaunchError

    monkeypatch.setattr(agent, "run", FakeAgent(code, stderr))
    with pytest.raises(VmlaunchError) as info:
        netem.run_in_guest(RunDir(run_dir / "nt"), "a", "52:54:00:00:00:01", 0, Netem(loss=1.0))
    assert words in str(info.value)
    assert isinstance(info.value, HostError if error is HostError else RuntimeFailure)
    assert info.value.exit_code == (3 if error is HostError else 4)


@pytest.fixture
def lab_up(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RunDir, Any]:
    from vmlaunch.lab import running

    lab = load_lab(write_spec(tmp_path, LAB))
    rd = RunDir(run_dir / "nt")
    rd.create()
    monkeypatch.setattr(running, "running_pid", lambda run_dir, name: 1)
    return rd, lab


def test_set_and_clear_in_the_guest(monkeypatch: pytest.MonkeyPatch, lab_up: tuple[RunDir, Any]) -> None:
    rd, lab = lab_up
    fake = FakeAgent()
    monkeypatch.setattr(agent, "run", fake)
    data = netem.set_netem(rd, lab, "a", 1, Netem(delay_ms=100.0, loss=30.0), timeout=7.0)
    assert data == {"delay_ms": 100.0, "loss": 30.0, "where": "guest"}
    ((vm, script, timeout),) = fake.sent
    assert (vm, timeout) == ("a", 7.0) and lab.vm("a").nics[1].mac in script
    assert wire.load(rd)["nics"]["a/1"]["netem"] == data
    assert netem.listing(rd, lab) == [{"vm": "a", "nic": 1, "network": "nat", "where": "guest",
                                       "delay": "100ms", "loss": "30%"}]
    assert netem.clear_netem(rd, lab, "a", 1) is True
    assert "root netem" not in fake.sent[-1][1]
    assert wire.load(rd)["nics"] == {} and netem.listing(rd, lab) == []
    assert netem.clear_netem(rd, lab, "a", 1) is False


def test_host_on_a_user_network_is_a_usage_error(lab_up: tuple[RunDir, Any]) -> None:
    from vmlaunch.errors import UsageError

    rd, lab = lab_up
    with pytest.raises(UsageError, match="NIC 1 of a is on user network 'nat', which has no host interface"):
        netem.set_netem(rd, lab, "a", 1, Netem(loss=1.0, where=NetemWhere.HOST))


def test_host_path_records_first_and_down_removes_the_ifb(monkeypatch: pytest.MonkeyPatch,
                                                          lab_up: tuple[RunDir, Any]) -> None:
    rd, lab = lab_up
    applied: list[tuple[str, Netem | None]] = []

    def fake_apply(lab_name: str, vm: str, index: int, netem_: Netem | None) -> str:
        assert wire.load(rd)["nics"]["a/0"]["netem"]["where"] == "host"  # recorded before
        applied.append((vm, netem_))
        return IFB

    monkeypatch.setattr(netem, "_apply_host", fake_apply)
    data = netem.set_netem(rd, lab, "a", 0, Netem(rate_bit=10**6), host_netem=True)
    assert data == {"rate_bit": 1_000_000, "where": "host", "ifb": IFB}
    removed: list[Any] = []

    def remove(lab_name: str, vms: Any) -> list[str]:
        removed.append((lab_name, vms))
        return []

    monkeypatch.setattr(netem, "remove_lab_ifbs", remove)
    assert netem.undo_at_down(rd, "nt", ["a"]) == []
    assert removed == [("nt", ["a"])] and wire.load(rd)["nics"]["a/0"] == {}
    assert netem.undo_at_down(rd, "nt", None) == [] and len(removed) == 1  # nothing hosted is left


def test_a_failing_host_apply_leaves_no_record(monkeypatch: pytest.MonkeyPatch,
                                               lab_up: tuple[RunDir, Any]) -> None:
    rd, lab = lab_up

    def failing(*args: Any) -> str:
        raise host_netem.no_netem()

    monkeypatch.setattr(netem, "_apply_host", failing)
    with pytest.raises(HostError):
        netem.set_netem(rd, lab, "a", 0, Netem(loss=1.0), host_netem=True)
    assert "a/0" not in wire.load(rd)["nics"]


def test_up_waits_for_the_guests_channel(monkeypatch: pytest.MonkeyPatch, lab_up: tuple[RunDir, Any]) -> None:
    import time

    from vmlaunch.errors import AgentError

    rd, lab = lab_up
    calls = []

    def late(run_dir: RunDir, vm: str, cmd: Any, *, timeout: float | None = 60.0,
             input: bytes | None = None) -> agent.Result:
        calls.append(vm)
        if len(calls) < 3:
            raise AgentError(f"{vm}: no agent answers")
        return agent.Result(0, b"", b"")

    monkeypatch.setattr(agent, "run", late)
    monkeypatch.setattr(netem, "AGENT_POLL", 0.01)
    plan = compile_lab(load_lab(write_spec(Path(rd.path), LAB.replace(
        'network = "nat"\n', 'network = "nat"\nnetem = { loss = "2%" }\n'))), fake_host(netem=False))
    plan = __import__("attrs").evolve(plan, run_dir=rd)
    netem.apply_at_up(plan, plan.vms, time.monotonic() + 5)
    assert len(calls) == 3 and wire.load(rd)["nics"]["a/1"]["netem"] == {"loss": 2.0, "where": "guest"}
    monkeypatch.setattr(agent, "run", lambda *a, **k: (_ for _ in ()).throw(AgentError("a: gone")))
    with pytest.raises(AgentError, match="did not answer in time"):
        netem.apply_at_up(plan, plan.vms, time.monotonic() + 0.05)


# --- the CLI ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "code", "words"), [
    (["a", "lan", "--where", "host", "--delay", "100"], 3, "CONFIG_NET_SCH_NETEM"),
    (["a", "nat", "--where", "host", "--loss", "1"], 64, "has no host interface"),
    (["a", "0", "--delay", "-5"], 64, "--delay: '-5' is negative"),
    (["a", "0", "--loss", "101"], 64, "--loss: '101' is not a percentage from 0 to 100"),
    (["a", "0", "--rate", "10"], 64, "--rate: '10' has no unit"),
    (["a", "0", "--jitter", "5"], 64, "--jitter: jitter needs a delay"),
    (["a", "0", "--reorder", "5"], 64, "--reorder: reorder needs a delay"),
    (["a", "0"], 64, "give one or more of --delay"),
    (["a", "0", "--clear", "--loss", "1"], 64, "--clear takes no figures"),
    (["a"], 64, "name the NIC of a"),
    (["b", "0", "--loss", "1"], 64, "no VM named 'b'"),
    (["a", "7", "--loss", "1"], 64, "VM a has no NIC 7"),
    (["a", "nat", "--loss", "1"], 4, "VM a is not running"),
    (["--loss", "1"], 64, "name the VM and NIC"),
])
def test_cli_errors(tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                    code: int, words: str) -> None:
    if code == 3 and host_netem.host_has_netem():
        pytest.skip("this host's kernel has netem")
    spec = write_spec(tmp_path, LAB)
    assert main(["netem", str(spec), *args]) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if not line.startswith("  hint:")]) == 1


def test_cli_lists_nothing(tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, LAB)
    assert main(["netem", str(spec)]) == 0
    assert capsys.readouterr().out == "lab nt: no netem set\n"
    assert main(["netem", str(spec), "--json"]) == 0
    assert capsys.readouterr().out == "[]\n"


def test_cli_sets_lists_and_clears(tmp_path: Path, lab_up: tuple[RunDir, Any],
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    monkeypatch.setattr(agent, "run", FakeAgent())
    spec = write_spec(tmp_path, LAB)
    assert main(["netem", str(spec), "a", "nat", "--delay", "100", "--loss", "30%", "--rate", "1mbit"]) == 0
    assert capsys.readouterr().out == "a nic 1: delay 100ms loss 30% rate 1mbit [guest]\n"
    assert main(["netem", str(spec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"vm": "a", "nic": 1, "network": "nat", "where": "guest",
                                                    "delay": "100ms", "loss": "30%", "rate": "1mbit"}]
    assert main(["netem", str(spec), "a", "nic1", "--clear"]) == 0
    assert capsys.readouterr().out == "a nic 1: netem cleared\n"


def test_api_netem(tmp_path: Path, lab_up: tuple[RunDir, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from vmlaunch.api import Vm
    from vmlaunch.errors import UsageError

    rd, lab = lab_up
    monkeypatch.setattr(agent, "run", FakeAgent())

    class FakeLab:
        model = lab
        run_dir = rd

    vm = Vm(FakeLab(), "a")  # type: ignore[arg-type]
    assert vm.netem("nat", delay=100, loss=30) == {"delay_ms": 100.0, "loss": 30.0, "where": "guest"}
    with pytest.raises(UsageError, match="rate: '10' has no unit"):
        vm.netem(1, rate="10")
    assert vm.netem(1, clear=True) == {}
    assert os.path.exists(rd.wire)
