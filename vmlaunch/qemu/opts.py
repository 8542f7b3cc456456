"""The one place spec values become QEMU option text.

QEMU splits option values at commas (a literal comma is written `,,`), so an unescaped comma in a path
would start a new option. Devices, block nodes and netdevs are passed in JSON form instead, which needs
no escaping at all; the few options without a JSON form go through `opts`, which escapes every value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Union

Value = Union[str, int, bool]


def escape(value: str) -> str:
    """Escape one option value: `a,b` -> `a,,b`."""
    return value.replace(",", ",,")


def _text(value: Value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def opts(implied: str, **pairs: Value) -> str:
    """`opts("socket", id="qmp", path="/a,b")` -> `socket,id=qmp,path=/a,,b`.

    Keys are vmlaunch's own (an underscore becomes '-'); only values can come from a spec, and every
    value is escaped.
    """
    parts = [escape(implied)] if implied else []
    parts += [f"{key.replace('_', '-')}={escape(_text(value))}" for key, value in pairs.items()]
    return ",".join(parts)


def json_arg(obj: Mapping[str, object]) -> str:
    """The JSON form QEMU accepts for -device, -blockdev, -netdev and -object."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=False)
