"""The record of an operation under way on a running lab (`saved/intent.py`), without QEMU: what it holds,
what `status` makes of it, and a damaged one (the recovery itself runs for real in test_snapshot.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmlaunch.layout.rundir import RunDir
from vmlaunch.saved import intent
from vmlaunch.saved.snapshot import finish_interrupted


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    made = RunDir(tmp_path / "lab")
    made.create()
    return made


def test_an_intent_round_trips_and_ends(run_dir: RunDir) -> None:
    disks = {"a": (("disk0", "/x/a.qcow2"), ("disk1", "/x/a2.qcow2"))}
    written = intent.begin(run_dir, intent.Operation.RESTORE, "base", ("a", "b"), ("a",), disks)
    read = intent.read(run_dir)
    assert read == written and read is not None and read.disks == disks
    assert read.describe() == "snapshot restore 'base'"
    assert set(intent.held_paused(run_dir)) == {"a"}
    assert "snapshot SPEC restore base` loads it whole" in intent.held_paused(run_dir)["a"]
    intent.write(run_dir, read.with_paused(()))
    assert intent.held_paused(run_dir) == {}
    intent.end(run_dir)
    assert intent.read(run_dir) is None
    intent.end(run_dir)  # twice is nothing


def test_a_save_under_way_holds_nothing(run_dir: RunDir) -> None:
    intent.begin(run_dir, intent.Operation.SAVE, "s", ("a",), ("a",), {})
    assert intent.held_paused(run_dir) == {}


@pytest.mark.parametrize("text", ["", "{", "[]", '{"operation": "snapshot fly"}', "\xff"])
def test_a_damaged_intent_is_said_and_removed(run_dir: RunDir, text: str) -> None:
    run_dir.intent.write_text(text, errors="surrogateescape")
    with pytest.raises(intent.IntentError, match="is damaged"):
        intent.read(run_dir)
    assert intent.held_paused(run_dir) == {}
    said = finish_interrupted(run_dir)
    assert len(said) == 1 and "is damaged" in said[0] and "removed" in said[0]
    assert not run_dir.intent.exists()


def test_an_intent_through_a_link_is_refused(run_dir: RunDir, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("{}")
    run_dir.intent.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(intent.IntentError, match="symlink"):
        intent.read(run_dir)
