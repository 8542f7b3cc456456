"""The throwaway VM's lab (spec/throwaway.py), the template store (saved/template.py) and the parts of
runtime/throwaway.py that need no QEMU: what a run keeps of its VM, --share words, a template's key,
its checks, its bound, the sweep of runs whose vmlaunch is gone. tests/test_run_real.py boots them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.errors import SpecUnfit, UsageError
from vmlaunch.runtime import throwaway
from vmlaunch.saved import template
from vmlaunch.spec import throwaway as spec_throwaway
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import SocketNetwork, UserNetwork

SPEC = """[lab]
name = "tw"
[network.lan]
bridge = "vlbr-tw"
subnet = "10.9.0.0/24"
[network.out]
type = "user"
forward = ["tcp:127.0.0.1:2222-:22"]
[vm.a]
memory = 128
cpus = 2
cpu_pinning = [0, 1]
kernel = "k"
initrd = "i"
balloon = { policy = "auto" }
[[vm.a.nic]]
network = "lan"
ip = "10.9.0.5"
[[vm.a.nic]]
network = "out"
[[vm.a.disk]]
file = "data.raw"
size = "4M"
[[vm.a.disk]]
file = "ro.raw"
readonly = true
[vm.b]
memory = 128
kernel = "k"
"""


@pytest.fixture(autouse=True)
def _own_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A template store of this test's alone (the session's holds the real tests' templates)."""
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def lab(tmp_path: Path):  # type: ignore[no-untyped-def]
    for name in ("k", "i"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "ro.raw").write_bytes(b"\0" * 512)
    return load_lab(write_spec(tmp_path, SPEC))


def test_a_run_keeps_the_machine_and_isolates_its_networks(lab, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = spec_throwaway.throwaway_lab(lab, "a", "run-0123abcd", tmp_path / "home")
    assert run.name == "run-0123abcd" and [vm.name for vm in run.vms] == ["a"]
    vm, source = run.vm("a"), lab.vm("a")
    assert (vm.memory_mib, vm.cpus, vm.kernel, vm.disks) == (source.memory_mib, source.cpus, source.kernel,
                                                               source.disks)
    assert [nic.mac for nic in vm.nics] == [nic.mac for nic in source.nics]
    assert vm.cpu_pinning == () and vm.balloon.policy.value == "manual"
    assert not vm.balloon.free_page_reporting  # a reported page would punch a hole in the template's RAM
    lan, out = run.network("lan"), run.network("out")
    assert isinstance(lan, SocketNetwork) and lan.subnet == "10.9.0.0/24"
    assert isinstance(out, UserNetwork) and out.forward == ()
    other = spec_throwaway.throwaway_lab(lab, "a", "run-99999999", tmp_path / "home")
    assert (other.network("lan").group, other.network("lan").port) != (lan.group, lan.port)  # type: ignore[union-attr]
    assert run.file == tmp_path / "home" / "lab.toml" and not run.memory.ksm


def test_shares_and_their_words(lab, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    share = spec_throwaway.parse_share("src:/mnt/src:ro", tmp_path)
    assert share == spec_throwaway.ExtraShare(tmp_path / "src", "/mnt/src", True)
    assert spec_throwaway.parse_share("src", tmp_path).target == str(tmp_path / "src")
    assert spec_throwaway.parse_share("src:rw", tmp_path).readonly is False
    for bad in ("", "a:b:c", "a:rel", ":x", "a:/with space", "a:/x,y"):
        with pytest.raises(UsageError):
            spec_throwaway.parse_share(bad, tmp_path)
    run = spec_throwaway.throwaway_lab(lab, "b", "run-0123abcd", tmp_path, shares=[share])
    assert run.vm("b").shares[0].tag == "runshare0"
    assert "vl.share=runshare0:/mnt/src:ro" in (run.vm("b").append or "")


def test_refusals(lab, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    no_agent = attrs.evolve(lab, vms=(attrs.evolve(lab.vm("b"), agent=False),))
    with pytest.raises(SpecUnfit, match="command channel"):
        spec_throwaway.throwaway_lab(no_agent, "b", "run-0123abcd", tmp_path)
    assert spec_throwaway.is_throwaway("run-0123abcd") and not spec_throwaway.is_throwaway("run-x")


def test_the_key_follows_what_decides_the_state(lab, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    host = fake_host()
    key = throwaway.template_key(lab, lab.vm("b"), host)
    assert key == throwaway.template_key(lab, lab.vm("b"), host)
    more = attrs.evolve(lab, vms=(lab.vm("a"), attrs.evolve(lab.vm("b"), memory_mib=256)))
    assert throwaway.template_key(more, more.vm("b"), host) != key
    time.sleep(0.01)
    (tmp_path / "k").write_bytes(b"a new kernel")
    assert throwaway.template_key(lab, lab.vm("b"), host) != key
    assert throwaway.template_key(lab, lab.vm("b"), attrs.evolve(host, qemu=attrs.evolve(
        host.qemu, version=(9, 0, 0)))) != throwaway.template_key(lab, lab.vm("b"), host)


def made(key: str, size: int = 4096) -> Path:
    folder = template.temporary(key)
    (folder / template.RAM).write_bytes(b"r" * size)
    (folder / template.STATE).write_bytes(b"state")
    (folder / template.HOME).mkdir()
    return template.seal(folder, key, {"spec": "/x/lab.toml", "vm": "w", "lab": "tpl-00000000"}).path


def test_a_template_is_checked_whole() -> None:
    path = made("k1")
    found = template.find("k1")
    assert found is not None and found.state == path / "state" and not list(path.parent.glob("*.tmp-*"))
    with open(path / "ram", "r+b") as handle:
        handle.truncate(100)
    assert template.find("k1") is None and not path.exists()  # refused, and removed: made again
    path = made("k2")
    (path / "state").write_bytes(b"other")
    assert template.check(path)[1] is not None
    path = made("k3")
    (path / "meta.json").write_text("{")
    assert template.check(path)[1] == "its meta.json is missing or unreadable"


def test_the_store_is_bounded_least_recently_used_first(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("old", "mid", "new"):
        path = made(key, 256 << 10)
        os.utime(path / "meta.json", (time.time() - {"old": 300, "mid": 200, "new": 100}[key],) * 2)
    monkeypatch.setenv(template.LIMIT_ENV, "600K")
    assert template.bound(keep="old") == ["mid"]  # the least recently used that may go, until it fits
    assert (template.store() / "old").exists() and (template.store() / "new").exists()
    monkeypatch.setenv(template.LIMIT_ENV, "lots")
    with pytest.raises(UsageError):
        template.limit()


def test_two_makers_of_one_template_take_turns() -> None:
    with template.making("k9", 1.0) as mine:
        assert mine
        code = ("import sys; from vmlaunch.saved import template\n"
                "with template.making('k9', 0.3) as mine: sys.exit(0 if not mine else 1)")
        assert subprocess.run([sys.executable, "-c", code], env=os.environ, check=False).returncode == 0


def test_a_run_of_a_vmlaunch_that_is_gone_is_swept(tmp_path: Path) -> None:
    homes = spec_throwaway.homes(tmp_path)
    gone, alive, kept = (homes / f"run-{n}" for n in ("0000000a", "0000000b", "0000000c"))
    for home in (gone, alive, kept):
        home.mkdir(parents=True)
    (gone / "owner.json").write_text(json.dumps({"pid": 2 ** 22 + 7, "ticks": "1", "kept": False}))
    throwaway._write_owner(alive)
    (kept / "owner.json").write_text(json.dumps({"pid": 2 ** 22 + 7, "ticks": "1", "kept": True}))
    staging = homes / ".run-0000000d"  # a home being made by a vmlaunch that died before its rename
    staging.mkdir()
    (staging / "owner.json").write_text(json.dumps({"pid": 2 ** 22 + 7, "ticks": "1", "kept": False}))
    assert throwaway.sweep(tmp_path) == ["run-0000000a"]
    assert not gone.exists() and alive.exists() and kept.exists() and not staging.exists()
    made = throwaway._make_home(tmp_path, "run-0000000e")  # whole, with its owner, from the start
    assert json.loads((made / "owner.json").read_text())["pid"] == os.getpid()
    assert throwaway.sweep(tmp_path) == [] and made.exists()
    # a home another run has just made, its owner not written yet: left to it (a sweep that removed it
    # failed that run); without an owner a minute on, its maker died in that moment
    making = homes / ".run-0000000f"
    making.mkdir()
    assert throwaway.sweep(tmp_path) == [] and making.exists()
    old = time.time() - throwaway.STAGING_GRACE - 1
    os.utime(making, (old, old))
    assert throwaway.sweep(tmp_path) == [] and not making.exists()


def test_a_kept_run_is_a_lab_by_name(lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(tmp_path / "root"))
    home = spec_throwaway.homes(tmp_path / "root") / "run-0000abcd"
    home.mkdir(parents=True)
    (home / spec_throwaway.RECIPE).write_text(json.dumps({
        "spec": str(lab.file), "vm": "a", "kernel": None, "disks": {"0": [str(home / "disk0.raw"), "raw"]},
        "shares": []}))
    kept = load_lab("run-0000abcd")
    assert kept.name == "run-0000abcd" and kept.vm("a").disks[0].file == home / "disk0.raw"
    with pytest.raises(UsageError, match="no kept throwaway VM"):
        load_lab("run-0000ffff")
