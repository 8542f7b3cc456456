"""Key names, typed text and evidence without a running lab: pure parts of rig/screen.py and
runtime/evidence.py (tests/test_screen_real.py drives a real guest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import write_spec
from vmlaunch.errors import UsageError
from vmlaunch.layout.rundir import RunDir
from vmlaunch.rig.screen import QKEYCODES, combination, keys_to_send, typed
from vmlaunch.runtime.evidence import collect
from vmlaunch.spec.load import load_lab


@pytest.mark.parametrize(("text", "keys"), [
    ("ctrl-alt-delete", ("ctrl", "alt", "delete")),
    ("Ctrl-Alt-Del", ("ctrl", "alt", "delete")),
    ("enter", ("ret",)), ("space", ("spc",)), ("esc", ("esc",)), ("super-l", ("meta_l", "l")),
    ("alt-sysrq-h", ("alt", "sysrq", "h")), ("-", ("minus",)), ("ctrl-minus", ("ctrl", "minus")),
    ("shift-/", ("shift", "slash")), ("kp_add", ("kp_add",)), ("F12", ("f12",)), ("PageDown", ("pgdn",)),
])
def test_key_combinations(text: str, keys: tuple[str, ...]) -> None:
    assert combination(text) == keys
    assert set(keys) <= QKEYCODES


@pytest.mark.parametrize(("text", "message"), [
    ("ctrl-alt-deleet", "unknown key 'deleet' in 'ctrl-alt-deleet'"),
    ("unmapped", "unknown key 'unmapped'"),
    ("ctrl--", "not a key combination"), ("", "not a key combination"), ("ctrl-", "not a key combination"),
])
def test_unknown_keys_are_named(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        combination(text)


def test_text_is_typed_on_a_us_layout() -> None:
    assert typed("aZ 9!\n") == [("a",), ("shift", "z"), ("spc",), ("9",), ("shift", "1"), ("ret",)]
    assert typed('~_+{}|:"<>?') == [("shift", key) for key in ("grave_accent", "minus", "equal",
                                                                "bracket_left", "bracket_right", "backslash",
                                                                "semicolon", "apostrophe", "comma", "dot",
                                                                "slash")]
    assert typed("-=[]\\;',./`\t") == [(key,) for key in ("minus", "equal", "bracket_left", "bracket_right",
                                                           "backslash", "semicolon", "apostrophe", "comma",
                                                           "dot", "slash", "grave_accent", "tab")]
    assert all(set(combo) <= QKEYCODES for combo in typed("".join(map(chr, range(32, 127)))))
    with pytest.raises(UsageError, match=r"cannot type 'é' \(character 2 of the text\)"):
        typed("hé")


def test_every_key_is_checked_before_any_is_sent() -> None:
    assert keys_to_send(["ctrl-alt-f1"], "ok") == [("ctrl", "alt", "f1"), ("o",), ("k",)]
    with pytest.raises(UsageError, match="unknown key 'bogus'"):
        keys_to_send(["ret", "bogus"], "text")
    with pytest.raises(UsageError, match="no keys to send"):
        keys_to_send([], None)


def test_evidence_of_a_lab_that_is_not_up_notes_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "k").write_bytes(b"kernel")
    lab = load_lab(write_spec(tmp_path, '[lab]\nname = "ev"\n[vm.a]\nmemory = 64\nkernel = "k"\n'))
    run_dir = RunDir.of(tmp_path / "run", "ev")  # never made: the lab is not up
    evidence = collect(run_dir, lab, ["a"], tmp_path / "out")
    assert evidence.folder == tmp_path / "out"
    assert set(evidence.files) == {"status.json", "wire.json", "README.txt"}
    assert json.loads((tmp_path / "out" / "status.json").read_text())["a"]["state"] == "stopped"
    assert json.loads((tmp_path / "out" / "wire.json").read_text())["nics"] == {}
    readme = (tmp_path / "out" / "README.txt").read_text()
    for line in ("manager.log: the lab manager is not up, and no earlier run's log was kept",
                 "events.jsonl: no event was logged",
                 "a/serial.log: the VM is not up, and no earlier run of it was kept",
                 "a/screen.png: the VM is stopped: no screen to capture"):
        assert line in readme
