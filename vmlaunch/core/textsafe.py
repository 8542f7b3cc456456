"""Text from a guest or from QEMU, made safe to show inside vmlaunch's own messages.

A guest controls what its serial console prints. Shown raw on the user's terminal, an escape sequence
could retitle the window, rewrite lines above, or (on some terminals) answer back as typed input.
`logs` shows the guest's output on a terminal through `for_terminal`, and passes it untouched into a
pipe or a file; `console` is the guest's terminal itself, untouched: that is what it is for.
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


def for_terminal(text: str) -> str:
    """A guest's console output as a terminal may show it: lines and tabs kept (a CRLF ends a line),
    escape sequences and control characters gone (a guest's `ESC [ 6 n` would make the terminal type
    its answer into the user's shell)."""
    return printable(text.replace("\r\n", "\n"))


def last_line(text: str, width: int = 60) -> str:
    """The last console line with something on it, as a progress line shows it: without escapes or
    controls, a line the guest redrew with carriage returns (a progress bar) as it shows last, and cut
    at a word to at most `width` characters ("" when there is none)."""
    for line in reversed(text.splitlines()):
        for part in reversed(line.split("\r")):
            shown = " ".join(printable(part).split())
            if shown:
                return _cut(shown, width)
    return ""


def _cut(line: str, width: int) -> str:
    if len(line) <= width:
        return line
    cut = line[: width - 3]
    space = cut.rfind(" ")
    if space > width // 2:  # a word boundary not too far back; else cut the long word itself
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "..."
