"""Text from a guest or from QEMU, made safe to show inside vmlaunch's own messages.

A guest controls what its serial console prints. Shown raw on the user's terminal, an escape sequence
could retitle the window, rewrite lines above, or (on some terminals) answer back as typed input.
`logs` and `console` pass the guest's output through untouched: that is what they are for.
"""

from __future__ import annotations

import re

# CSI (ESC [ ... final), OSC/DCS/SOS/PM/APC strings (ESC ] ... BEL or ST), two-byte escapes, and the
# 8-bit forms of CSI (0x9b) and the string introducers (0x90, 0x98, 0x9d-0x9f).
_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d-\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
)
# C0 and C1 controls but newline and tab; the bidirectional overrides and isolates, which reorder
# what the user reads.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` without terminal escape sequences and control characters (newlines and tabs stay; a
    carriage return goes: it would let a line overwrite the message it is part of)."""
    return _CONTROLS.sub("", _ESCAPES.sub("", text))
