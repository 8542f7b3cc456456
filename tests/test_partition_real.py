"""A partition that fails half-way, for real: two test guests on a bridge network (cut on the host,
in the lab's nftables table) and a socket network (cut in the guests, with their tc). The test guest's
tc is busybox's, which has no flower filter: the cut fails in the guests after the host's rules were
made, as in a guest kernel without cls_flower/act_gact. Nothing may stay cut that the record does not
name: the failed cut takes its host rules back, a vmlaunch killed between the host and the guests
leaves a record that `partition` shows and `--heal` and `down` remove. Inside a private network
namespace; one lab, booted once (again where the test that takes it down is not the last)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_e2e import READY, Netns, netns_named

pytestmark = [pytest.mark.qemu, pytest.mark.guest]

class Rig:
    def __init__(self, netns: Netns, spec: Path, name: str) -> None:
        self.netns = netns
        self.spec = spec
        self.name = name
        self.table = f"vmlaunch-{name}"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.netns.vmlaunch(*args[:1], str(self.spec), *args[1:], timeout=300)

    def ok(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = self.run(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        return done

    def record(self) -> dict[str, object]:
        shown: dict[str, object] = json.loads(self.ok("partition", "--json").stdout)
        return shown

    def tables(self) -> list[str]:
        listed = subprocess.run(["ip", "netns", "exec", self.netns.name, "nft", "-j", "list", "tables"],
                                capture_output=True, text=True, check=True).stdout
        return [item["table"]["name"] for item in json.loads(listed)["nftables"] if "table" in item]


def spec_text(name: str, guest: Path) -> str:
    text = (f'[lab]\nname = "{name}"\n[lab.memory]\nksm = false\n[network.lan]\nbridge = "vlbr-{name[-6:]}"\n'
            '[network.mc]\ntype = "socket"\n')
    for vm in "ab":
        text += (f'[vm.{vm}]\nmemory = "128M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                 f'initrd = "{guest}/initrd.gz"\nappend = "console=ttyS0"\n'
                 f'[[vm.{vm}.nic]]\nnetwork = "lan"\n[[vm.{vm}.nic]]\nnetwork = "mc"\n')
    return text


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, test_guest: Path) -> Iterator[Rig]:
    """The module's lab in its namespace, down until a test's `rig` brings it up."""
    name = f"part{uuid.uuid4().hex[:6]}"
    spec = tmp_path_factory.mktemp("partition") / "lab.toml"
    spec.write_text(spec_text(name, test_guest))
    with netns_named() as netns:
        made = Rig(netns, spec, name)
        try:
            yield made
        finally:
            made.run("down", "--timeout", "0")


@pytest.fixture
def rig(shared: Rig) -> Rig:
    """The module's lab up, nothing cut (each test heals what it cut, or takes the lab down)."""
    if not (shared.netns.run_root / shared.name / "state.json").exists():
        shared.ok("up", "--wait-for", READY, "--timeout", "300")
    return shared


def test_a_cut_the_guests_cannot_make_leaves_nothing_cut(rig: Rig) -> None:
    done = rig.run("partition", "b")
    assert done.returncode == 4, done.stderr
    said = done.stderr.splitlines()
    assert said[0].startswith("vmlaunch: error: a: the guest's tc could not cut its socket network"), said
    assert len(said) == 2 and "cls_flower" in said[1], said  # the error and its hint, no warning: undone
    assert rig.table not in rig.tables()  # the host's rules were taken back
    assert rig.record() == {"groups": [], "where": {}}
    assert rig.ok("partition").stdout.startswith("no partition")


def cut_and_kill(rig: Rig, vm: str) -> None:
    """`partition SPEC VM` killed (SIGKILL) once the host is cut, while it waits on paused a's channel."""
    rig.ok("pause", "a")
    cut = rig.netns.spawn("partition", str(rig.spec), vm, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 25  # a's channel gives up after 30 s
        while rig.table not in rig.tables():
            assert cut.poll() is None and time.monotonic() < deadline, "the host's rules never came"
            time.sleep(0.1)
    finally:
        cut.send_signal(signal.SIGKILL)
        cut.wait()
    rig.ok("resume", "a")


def test_a_cut_killed_half_way_is_recorded_and_healed(rig: Rig) -> None:
    cut_and_kill(rig, "b")
    record = rig.record()  # written before nft ran
    assert (record["groups"], record["where"]) == ([["b"]], {"lan": "host", "mc": "guest"})
    assert "did not finish" in str(record["unfinished"])
    shown = rig.ok("partition").stdout
    healed = rig.ok("partition", "--heal")
    assert rig.table not in rig.tables()
    assert rig.record() == {"groups": [], "where": {}}
    # what the manual shows, word for word
    transcript = f"$ vmlaunch partition lab.toml\n{shown}$ vmlaunch partition lab.toml --heal\n"
    transcript += healed.stderr + healed.stdout
    transcript = transcript.replace(str(rig.spec), "lab.toml").replace(rig.table, "vmlaunch-LAB")
    assert f"```\n{transcript}```\n" in (ROOT / "docs" / "guides" / "test-rigs.md").read_text(), transcript


def test_down_removes_a_cut_killed_half_way(rig: Rig) -> None:
    cut_and_kill(rig, "a")
    assert "unfinished" in rig.record()
    rig.ok("down", "--timeout", "0")
    assert rig.table not in rig.tables()
    assert rig.tables() == []
