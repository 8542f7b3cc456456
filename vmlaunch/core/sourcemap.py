"""Map TOML key paths back to the source lines that define them, for error messages.

``tomllib`` returns plain dicts without positions, so :class:`SourceMap` walks the text once more and
records the 1-based line defining each key path (a tuple of ``str`` keys and ``int`` array indices,
as produced by walking the parsed document)::

    SourceMap.from_text(text).line_of(("vm", "alpha", "disk", 0, "format"))  # line of `format = ...`

Headers and ``key = value`` lines (dotted keys too) map to their line, the n-th ``[[a.b]]`` header to
``(..., "b", n)``, inline-table keys and array elements to the line where they start, at any depth.
A table that only exists implicitly (``vm`` for ``[vm.alpha]``) maps to the first line creating it,
unless a later line defines it explicitly.

It only maps text tomllib accepted: there is no error recovery, and other text may raise.
"""

from __future__ import annotations

import re
import sys
from bisect import bisect_left
from collections.abc import Sequence
from typing import Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["KeyPath", "SourceMap"]

KeyPath = tuple[Union[str, int], ...]

# Patterns as text, compiled by the scanner: a spec without problems is never scanned.
_SKIP = r"(?:[ \t\r\n]+|#[^\n]*)*"  # whitespace, newlines and comments
_KEY_PART = r"""[ \t]*([A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')[ \t]*"""
_VALUE = (
    r'"""(?:[^\\]|\\[\s\S])*?"{3,5}'  # multi-line basic string; may end in one or two quotes
    r"|'''[\s\S]*?'{3,5}"  # multi-line literal string, likewise
    r'|"(?:[^"\\]|\\.)*"'  # basic string
    r"|'[^']*'"  # literal string
    r"|[\[{]"  # start of an array or an inline table
    r"|[^,\]}#\n]+"  # number, boolean or date-time (which may contain a space)
)


def _match(pattern: str, text: str, pos: int) -> re.Match[str]:
    match = re.compile(pattern).match(text, pos)  # compiled once: re caches compiled patterns
    if match is None:
        raise ValueError(f"not valid TOML at offset {pos}")
    return match


class _Scanner:
    """One pass over the text, recording the line of every path it defines."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.newlines = [match.start() for match in re.finditer("\n", text)]
        self.implicit: dict[KeyPath, int] = {}  # tables created by a header or dotted key below them
        self.explicit: dict[KeyPath, int] = {}
        self.arrays: dict[KeyPath, int] = {}  # array of tables -> number of [[headers]] so far

    def record(self, path: KeyPath, pos: int, explicit: bool = True) -> None:
        (self.explicit if explicit else self.implicit).setdefault(path, bisect_left(self.newlines, pos) + 1)

    def skip(self, pos: int) -> int:
        return _match(_SKIP, self.text, pos).end()

    def key(self, pos: int, table: KeyPath) -> tuple[KeyPath, int]:
        """Map the (dotted) key at `pos` below `table`; returns its path and the position after it."""
        path = table
        while True:
            match = _match(_KEY_PART, self.text, pos)
            part = match.group(1)
            if part[0] in "\"'":  # quoted: let tomllib decode its escapes
                part = str(tomllib.loads(f"k = {part}")["k"])
            path += (part,)
            pos = match.end()
            dotted = self.text[pos] == "."
            self.record(path, match.start(1), explicit=not dotted)  # a dotted key's tables are implicit
            if not dotted:
                return path, pos
            if path in self.arrays:  # a header below an array of tables: its last element
                path += (self.arrays[path] - 1,)
            pos += 1

    def header(self, pos: int) -> tuple[KeyPath, int]:
        """Map the `[table]` or `[[array.of.tables]]` header at `pos`; returns its table and end."""
        width = 2 if self.text.startswith("[[", pos) else 1
        path, pos = self.key(pos + width, ())
        if width == 2:
            count = self.arrays.get(path, 0)
            self.arrays[path] = count + 1
            path += (count,)
            self.record(path, pos)
        return path, pos + width

    def value(self, pos: int, path: KeyPath) -> int:
        """Map the value of `path` at `pos` (array elements, inline-table keys); returns its end."""
        text = self.text
        open_: list[tuple[KeyPath, int]] = []  # open arrays (path, next index), inline tables (path, -1)
        while True:
            token = _match(_VALUE, text, pos).group()
            pos += len(token)
            if token in ("[", "{"):
                open_.append((path, 0 if token == "[" else -1))
            while open_:  # find the next element or key, closing what ends before it
                pos = self.skip(pos)
                if text[pos] in ",]}":
                    if text[pos] != ",":
                        open_.pop()
                    pos += 1
                    continue
                container, index = open_[-1]
                if index < 0:
                    path, pos = self.key(pos, container)
                    pos = self.skip(pos + 1)  # after the "="
                else:
                    path = container + (index,)
                    open_[-1] = (container, index + 1)
                    self.record(path, pos)
                break
            if not open_:
                return pos

    def run(self) -> dict[KeyPath, int]:
        table: KeyPath = ()
        pos = self.skip(0)
        while pos < len(self.text):
            if self.text[pos] == "[":
                table, pos = self.header(pos)
            else:
                path, pos = self.key(pos, table)
                pos = self.value(self.skip(pos + 1), path)
            pos = self.skip(pos)
        return {**self.implicit, **self.explicit}


class SourceMap:
    """Key path -> 1-based source line of a TOML document (see the module docstring).

    The text is only scanned when a line is first asked for: a spec without problems never is.
    """

    __slots__ = ("_text", "_map")

    def __init__(self, text: str) -> None:
        self._text = text
        self._map: dict[KeyPath, int] | None = None

    @classmethod
    def from_text(cls, text: str) -> SourceMap:
        """Map `text`, which tomllib must have accepted."""
        return cls(text)

    @property
    def _lines(self) -> dict[KeyPath, int]:
        if self._map is None:
            self._map = _Scanner(self._text).run()
        return self._map

    def line_of(self, path: Sequence[str | int]) -> int:
        """1-based line of the longest prefix of `path` that the source defines; 1 if none."""
        key = tuple(path)
        lines = self._lines
        for length in range(len(key), 0, -1):
            line = lines.get(key[:length])
            if line is not None:
                return line
        return 1

    def defines(self, path: Sequence[str | int]) -> bool:
        """Whether the source itself writes `path` (a key left to its default is not written)."""
        return tuple(path) in self._lines
