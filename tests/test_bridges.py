"""The host-wide bridge registry (vmlaunch/host/bridge_registry.py): its file, its lock, stale
claims. What it does with real bridges is in tests/test_links.py (in a network namespace)."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

import pytest

from vmlaunch.host.bridge_registry import (
    REGISTRY_FILE,
    REGISTRY_LOCK,
    BridgeEntry,
    BridgeRegistry,
    RegistryError,
    lab_in_use,
)
from vmlaunch.layout.rundir import RunDir


def write(root: Path, doc: object) -> Path:
    path = root / REGISTRY_FILE
    path.write_text(json.dumps(doc))
    path.chmod(0o600)
    return path


def test_round_trip_and_modes(tmp_path: Path) -> None:
    with BridgeRegistry.locked(tmp_path) as registry:
        assert registry.bridges == {}
        registry.bridges["br0"] = BridgeEntry(created=True, index=7, uplink="eth1", labs=["a", "b"])
        registry.save()
    for name in (REGISTRY_FILE, REGISTRY_LOCK):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    assert json.loads((tmp_path / REGISTRY_FILE).read_text()) == {"version": 1, "bridges": {
        "br0": {"created": True, "index": 7, "uplink": "eth1", "labs": ["a", "b"]}}}
    with BridgeRegistry.locked(tmp_path) as registry:
        assert registry.bridges["br0"] == BridgeEntry(created=True, index=7, uplink="eth1", labs=["a", "b"])
        assert registry.of_lab("b") == ["br0"] and registry.of_lab("c") == []
        registry.bridges.clear()
        registry.save()
    assert list(tmp_path.iterdir()) == []  # no bridge left: no file, no lock


def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text('{"version": 1, "bridges": {}}')
    (tmp_path / REGISTRY_FILE).symlink_to(target)
    with pytest.raises(RegistryError, match="cannot be read"), BridgeRegistry.locked(tmp_path):
        pass
    (tmp_path / REGISTRY_FILE).unlink()
    (tmp_path / REGISTRY_LOCK).unlink()
    (tmp_path / REGISTRY_LOCK).symlink_to(tmp_path / "lock-target")
    with pytest.raises(RegistryError, match="lock"), BridgeRegistry.locked(tmp_path):
        pass
    assert not (tmp_path / "lock-target").exists()


def test_a_file_others_may_write_is_refused(tmp_path: Path) -> None:
    write(tmp_path, {"version": 1, "bridges": {}}).chmod(0o666)
    with pytest.raises(RegistryError, match="not a file of this user's alone"), \
            BridgeRegistry.locked(tmp_path):
        pass


@pytest.mark.parametrize("doc", [
    "not json",
    {"version": 2, "bridges": {}},
    {"version": 1, "bridges": []},
    {"version": 1, "bridges": {"br0\n": {"created": True, "index": None, "uplink": None, "labs": []}}},
    {"version": 1, "bridges": {"br0": {"created": 1, "index": None, "uplink": None, "labs": []}}},
    {"version": 1, "bridges": {"br0": {"created": True, "index": None, "uplink": None,
                                       "labs": ["../etc"]}}},
    {"version": 1, "bridges": {"br0": {"created": True, "index": None, "uplink": "a%d", "labs": []}}},
])
def test_a_damaged_registry_is_a_clear_error(tmp_path: Path, doc: object) -> None:
    path = tmp_path / REGISTRY_FILE
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    path.chmod(0o600)
    with pytest.raises(RegistryError) as info, BridgeRegistry.locked(tmp_path):
        pass
    assert str(info.value).startswith(f"the bridge registry {path} cannot be read: ")
    assert info.value.hint is not None and "remove it" in info.value.hint


def test_stale_claims_are_dropped(tmp_path: Path) -> None:
    # up: a journal; busy: an up that holds its lock and has not journaled yet; gone: neither
    up = RunDir.of(tmp_path, "up")
    up.path.mkdir()
    up.state.write_text("{}")
    busy = RunDir.of(tmp_path, "busy")
    fd = os.open(busy.lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    RunDir.of(tmp_path, "idle").lock.write_text("")  # a lock file nobody holds
    try:
        assert lab_in_use(tmp_path, "up") and lab_in_use(tmp_path, "busy")
        assert not lab_in_use(tmp_path, "gone") and not lab_in_use(tmp_path, "idle")
        registry = BridgeRegistry(tmp_path, {"br0": BridgeEntry(created=True, labs=[
            "gone", "up", "me", "idle", "busy"])})
        assert registry.users("br0", but="me") == ["up", "busy"]
        assert registry.bridges["br0"].labs == ["up", "me", "busy"]
        assert registry.users("nothing", but="me") == []
    finally:
        os.close(fd)
    assert not lab_in_use(tmp_path, "busy")  # its up was killed before journaling anything


def test_the_lock_is_exclusive(tmp_path: Path) -> None:
    with BridgeRegistry.locked(tmp_path), pytest.raises(RegistryError, match="busy"), \
            BridgeRegistry.locked(tmp_path, timeout=0.2):
        pass
