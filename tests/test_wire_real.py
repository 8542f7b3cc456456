"""Faults on the wire for real: three test guests on one bridge in a private network namespace, `a`
pinging `b` and `c` in a loop and `b` printing its carrier, both on their consoles (the guests' `vl.run`
script). `link` takes b's carrier away and back; `partition` cuts c, then b, off through the lab's
nftables table and heals them; `down`, and `down --force` after the journal is lost, leave no table.
One lab for every case, which the `rig` fixture brings up where a test took it down: the guests boot
twice in all (three times where the down test is not the last)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_e2e import READY, Netns, netns_named

pytestmark = [pytest.mark.qemu, pytest.mark.guest]

PINGER = ("( n=0; while :; do n=$((n+1)); r=''; for ip in 10.77.0.2 10.77.0.3; do "
          "if ping -c 1 -W 1 $ip >/dev/null 2>&1; then r=\"$r 1\"; else r=\"$r 0\"; fi; done; "
          "echo \"PINGS $n$r\"; sleep 0.2; done ) &\n")
CARRIER = ("( last=x; while :; do c=$(cat /sys/class/net/eth0/carrier 2>/dev/null || echo 0); "
           "[ \"$c\" != \"$last\" ] && echo \"CARRIER $c\"; last=$c; sleep 0.2; done ) &\n")


class Rig:
    def __init__(self, netns: Netns, spec: Path, name: str) -> None:
        self.netns = netns
        self.spec = spec
        self.name = name
        self.table = f"vmlaunch-{name}"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.netns.vmlaunch(*args[:1], str(self.spec), *args[1:], timeout=300)

    def ok(self, *args: str) -> str:
        done = self.run(*args)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        return done.stdout

    def console(self, vm: str) -> str:
        return (self.netns.run_root / self.name / f"{vm}.serial.log").read_text(errors="replace")

    def pings(self, expect: str, timeout: float = 90.0) -> None:
        """Wait until two rounds of a's pings that began after now both say `expect` ("1 0": b
        answers, c does not)."""
        start = len(self.console("a"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rounds = re.findall(r"^PINGS \d+ ([01] [01])\r?$", self.console("a")[start:], re.M)[1:]
            if rounds[-2:] == [expect, expect]:
                return
            time.sleep(0.3)
        pytest.fail(f"a's pings never said {expect!r} twice: {self.console('a')[start:][-600:]}")

    def carrier(self, vm: str, value: str, since: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"CARRIER {value}" in self.console(vm)[since:]:
                return
            time.sleep(0.2)
        pytest.fail(f"{vm} never printed CARRIER {value}: {self.console(vm)[since:][-400:]}")

    def nft(self, *args: str) -> str:
        return subprocess.run(["ip", "netns", "exec", self.netns.name, "nft", *args], capture_output=True,
                              text=True, check=True).stdout

    def tables(self) -> list[str]:
        reply = json.loads(self.nft("-j", "list", "tables"))
        return [item["table"]["name"] for item in reply["nftables"] if "table" in item]

    def drops(self) -> dict[str, int]:
        reply = json.loads(self.nft("-j", "list", "table", "bridge", self.table))
        return {item["rule"]["comment"]: sum(e["counter"]["packets"] for e in item["rule"]["expr"]
                                             if "counter" in e)
                for item in reply["nftables"] if "rule" in item}


def spec_text(name: str, guest: Path) -> str:
    text = f'[lab]\nname = "{name}"\n[lab.memory]\nksm = false\n[network.lan]\nbridge = "vlbr-{name[-6:]}"\n'
    for host, vm in enumerate("abc", start=1):
        script = {"a": PINGER, "b": CARRIER}.get(vm, "")
        run = f" vl.run={base64.b64encode(script.encode()).decode()}" if script else ""
        text += (f'[vm.{vm}]\nmemory = "128M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                 f'initrd = "{guest}/initrd.gz"\nappend = "console=ttyS0 vl.ip=eth0:10.77.0.{host}/24{run}"\n'
                 f'[[vm.{vm}.nic]]\nnetwork = "lan"\n')
    return text


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, test_guest: Path) -> Iterator[Rig]:
    """The module's lab in its namespace, down until a test's `rig` brings it up."""
    name = f"wire{uuid.uuid4().hex[:6]}"
    spec = tmp_path_factory.mktemp("wire") / "lab.toml"
    spec.write_text(spec_text(name, test_guest))
    with netns_named() as netns:
        made = Rig(netns, spec, name)
        try:
            yield made
        finally:
            made.run("down", "--timeout", "0")


@pytest.fixture
def rig(shared: Rig) -> Rig:
    """The module's lab up, a's pings answered by b and c (each test heals what it cut)."""
    if not (shared.netns.run_root / shared.name / "state.json").exists():
        shared.ok("up", "--wait-for", READY, "--timeout", "300")
        shared.pings("1 1")
    return shared


def test_link_down_takes_the_carrier_away_and_up_brings_it_back(rig: Rig) -> None:
    since = len(rig.console("b"))
    assert rig.ok("link", "b", "lan", "down") == "b: nic0 (lan) link down\n"
    rig.carrier("b", "0", since)
    rig.pings("0 1")
    status = json.loads(rig.ok("status", "--json"))
    assert [nic["link"] for nic in status["b"]["nics"]] == ["down"]
    assert [nic["link"] for nic in status["a"]["nics"]] == ["up"]
    assert "link down" in rig.ok("status")
    since = len(rig.console("b"))
    rig.ok("link", "b", "nic0", "up")
    rig.carrier("b", "1", since)
    rig.pings("1 1")
    assert json.loads(rig.ok("status", "--json"))["b"]["nics"][0]["link"] == "up"


def test_partition_cuts_and_heal_heals(rig: Rig) -> None:
    assert rig.ok("partition", "c").startswith("partition: c | the rest: a, b (cut on lan: host)")
    rig.pings("1 0")
    drops = rig.drops()
    assert set(drops) == {"lan: c cut off", "lan: the rest (a,b) cut off"}
    assert drops["lan: the rest (a,b) cut off"] > 0, rig.nft("list", "table", "bridge", rig.table)  # a's
    rig.ok("partition", "c")  # again: the same partition
    assert json.loads(rig.ok("partition", "--json")) == {"groups": [["c"]], "where": {"lan": "host"}}
    rig.ok("partition", "b")  # one more group: b is cut off from a and from c
    rig.pings("0 0")
    rig.ok("partition", "--heal", "c")
    rig.pings("0 1")
    assert rig.ok("partition", "--heal").startswith("no partition")
    rig.pings("1 1")
    assert rig.table not in rig.tables()  # healed: no table left


def test_bad_input_is_one_line_and_the_lab_runs_on(rig: Rig) -> None:
    for args, code, text in ((("partition", "a", "a"), 64, "VM a named twice"),
                             (("partition", "zz"), 64, "no VM named 'zz'"),
                             (("partition", "a", "b", "c"), 64, "every VM of the lab"),
                             (("link", "a", "wan", "down"), 64, "VM a has no NIC 'wan'")):
        done = rig.run(*args)
        assert done.returncode == code and text in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert rig.table not in rig.tables()


def test_down_and_down_force_leave_no_table(rig: Rig) -> None:
    rig.ok("partition", "a")
    rig.ok("link", "b", "0", "down")
    assert rig.table in rig.tables()
    rig.ok("down", "--timeout", "0")
    assert rig.table not in rig.tables()
    assert not (rig.netns.run_root / rig.name).exists()
    done = rig.run("partition", "a")
    assert done.returncode == 4 and f"lab {rig.name} is not up" in done.stderr
    # after a crash: the journal lost, the table still there; `down --force` finds it by its name
    rig.ok("up", "--timeout", "300")
    assert json.loads(rig.ok("status", "--json"))["b"]["nics"][0]["link"] == "up"  # a new QEMU
    rig.ok("partition", "b")
    assert rig.table in rig.tables()
    (rig.netns.run_root / rig.name / "state.json").write_text("")
    (rig.netns.run_root / rig.name / "wire.json").write_text("")
    rig.ok("down", "--force", "--timeout", "0")
    assert rig.table not in rig.tables()
    assert rig.tables() == []  # nothing of vmlaunch's, nothing else either, in the lab's namespace
