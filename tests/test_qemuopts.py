"""No spec value can add a QEMU option: every value is escaped or passed as JSON."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from vmlaunch.qemu.opts import escape, json_arg, opts


def split_qemu_opts(text: str) -> list[str]:
    """QEMU's own rule: split at single commas, `,,` is a literal comma."""
    parts, current, i = [], "", 0
    while i < len(text):
        if text[i] == ",":
            if text[i + 1 : i + 2] == ",":
                current += ","
                i += 2
                continue
            parts.append(current)
            current = ""
        else:
            current += text[i]
        i += 1
    parts.append(current)
    return parts


def test_escape_doubles_commas() -> None:
    assert escape("/a,b,,c") == "/a,,b,,,,c"
    assert opts("socket", id="qmp", path="/x,server=off") == "socket,id=qmp,path=/x,,server=off"


@given(st.text())
def test_a_value_stays_one_option(value: str) -> None:
    parts = split_qemu_opts(opts("file", id="x", path=value))
    assert parts == ["file", "id=x", f"path={value}"]


@given(st.dictionaries(st.text(), st.text() | st.integers() | st.booleans()))
def test_json_args_round_trip(obj: dict[str, object]) -> None:
    assert json.loads(json_arg(obj)) == obj
