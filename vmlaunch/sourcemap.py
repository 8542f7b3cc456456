"""Map TOML key paths back to the source lines that define them.

``tomllib``/``tomli`` return plain dicts without positions, so validation errors could not
say *where* a bad value lives.  :class:`SourceMap` fills that gap with a small, tolerant
tokenizer that walks the same text and records, for every key path the document defines,
the 1-based line of its definition::

    smap = SourceMap.from_text(text)
    smap.line_of(("vm", "alpha", "disk", 0, "format"))   # line of `format = ...`

A key path is a tuple of ``str`` keys and ``int`` array indices, exactly as produced by
walking the parsed document.  What is recorded:

* ``[a.b]`` table headers (bare, ``"basic"`` and ``'literal'`` keys) -> the header line.
  Tables that only exist implicitly (``vm`` for ``[vm.alpha]``) map to the first line that
  creates them; an explicit header or key seen later takes precedence over that.
* ``[[a.b]]`` array-of-tables headers: the n-th occurrence is path ``(..., "b", n)``; the
  array key itself maps to its first occurrence.  Later headers below it refer to the last
  element, as in TOML.
* ``key = value`` lines, including dotted keys (every intermediate path is recorded), relative
  to the current table.
* Inside values: inline tables (nested keys, on whatever line they are) and arrays (every
  element maps to the line where it starts), to any nesting.

Strings of all four kinds and comments are skipped, so ``#``, ``[``, ``=`` or ``{`` inside
them never confuse the scanner.  Malformed input is handled on a best-effort basis:
:meth:`SourceMap.from_text` never raises and always terminates.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Union

__all__ = ["KeyPath", "SourceMap"]

KeyPath = tuple[Union[str, int], ...]

# Arrays/inline tables nested deeper than this are skipped without being mapped, which keeps
# the recursive scanner far away from the interpreter's recursion limit.
_MAX_DEPTH = 64

_WS = re.compile(r"[ \t]*")
_WS_CR = re.compile(r"[ \t\r]*")
_WS_NL_COMMENT = re.compile(r"(?:[ \t\r\n]+|#[^\n]*)*")
_TO_EOL = re.compile(r"[^\n]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_BASIC = re.compile(r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"?')
_LITERAL = re.compile(r"'[^'\n]*'?")
_ML_BASIC = re.compile(r'"""[^"\\]*(?:(?:\\[\s\S]|"(?!""))[^"\\]*)*(?:"""(?:""?)?)?')
_ML_LITERAL = re.compile(r"'''[^']*(?:'(?!'')[^']*)*(?:'''(?:''?)?)?")
_SCALAR = re.compile(r"[^,\]}#\n]*")
_NESTED_PLAIN = re.compile(r"[^\[\]{}\"'#]+")
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|'[^'\n]*')"""
# `key =` where an array element was expected: the array was never closed.
_LOOKS_LIKE_KEYVAL = re.compile(rf"{_KEY_PART}(?:[ \t]*\.[ \t]*{_KEY_PART})*[ \t]*=")
_ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|([\s\S]))")
_SIMPLE_ESCAPES = {
    "b": "\b",
    "t": "\t",
    "n": "\n",
    "f": "\f",
    "r": "\r",
    "e": "\x1b",
    '"': '"',
    "\\": "\\",
}


def _end(pattern: re.Pattern[str], text: str, pos: int) -> int:
    """End of ``pattern`` matched at ``pos`` (``pos`` itself if it does not match)."""
    match = pattern.match(text, pos)
    return pos if match is None else match.end()


def _escape_repl(match: re.Match[str]) -> str:
    hex_digits = match.group(1) or match.group(2)
    if hex_digits:
        code = int(hex_digits, 16)
        return chr(code) if code <= 0x10FFFF else match.group(0)
    return _SIMPLE_ESCAPES.get(match.group(3), match.group(0))


def _unescape(raw: str) -> str:
    """Decode the escapes of a basic-string key body (unknown escapes are kept verbatim)."""
    if "\\" not in raw:
        return raw
    return _ESCAPE.sub(_escape_repl, raw)


class _Scanner:
    """One pass over the text; fills :attr:`lines` with ``path -> line``."""

    __slots__ = ("text", "size", "newlines", "lines", "explicit", "aot_count", "resync")

    def __init__(self, text: str) -> None:
        self.text = text
        self.size = len(text)
        newlines: list[int] = []
        find = text.find
        pos = find("\n")
        while pos >= 0:
            newlines.append(pos)
            pos = find("\n", pos + 1)
        self.newlines = newlines
        self.lines: dict[KeyPath, int] = {}
        self.explicit: set[KeyPath] = set()
        # resolved path of an array of tables -> number of elements seen so far
        self.aot_count: dict[KeyPath, int] = {}
        # set when a nested value gave up because the next statement seems to have started
        self.resync = False

    # -- helpers ---------------------------------------------------------------------------

    def _record(self, path: KeyPath, pos: int, explicit: bool) -> None:
        lines = self.lines
        if path in lines and (not explicit or path in self.explicit):
            return
        lines[path] = bisect_left(self.newlines, pos) + 1
        if explicit:
            self.explicit.add(path)

    def _key(self, pos: int) -> tuple[list[str], int]:
        """Parse a (possibly dotted) key; returns its parts and the position after it."""
        text = self.text
        size = self.size
        keys: list[str] = []
        while True:
            pos = _end(_WS, text, pos)
            if pos >= size:
                break
            char = text[pos]
            if char == '"':
                end = _end(_BASIC, text, pos)
                body_end = end - 1 if end - pos >= 2 and text[end - 1] == '"' else end
                keys.append(_unescape(text[pos + 1 : body_end]))
            elif char == "'":
                end = _end(_LITERAL, text, pos)
                body_end = end - 1 if end - pos >= 2 and text[end - 1] == "'" else end
                keys.append(text[pos + 1 : body_end])
            else:
                match = _BARE_KEY.match(text, pos)
                if match is None:
                    break
                end = match.end()
                keys.append(match.group())
            pos = _end(_WS, text, end)
            if pos < size and text[pos] == ".":
                pos += 1
                continue
            break
        return keys, pos

    def _skip_string(self, pos: int) -> int:
        text = self.text
        if text.startswith('"""', pos):
            return _end(_ML_BASIC, text, pos)
        if text.startswith("'''", pos):
            return _end(_ML_LITERAL, text, pos)
        if text[pos] == '"':
            return _end(_BASIC, text, pos)
        return _end(_LITERAL, text, pos)

    def _skip_nested(self, pos: int) -> int:
        """Skip a too-deeply nested array/inline table without recursion or mapping."""
        text = self.text
        size = self.size
        depth = 0
        while pos < size:
            char = text[pos]
            if char in "[{":
                depth += 1
                pos += 1
            elif char in "]}":
                if depth == 0:
                    return pos
                depth -= 1
                pos += 1
                if depth == 0:
                    return pos
            elif char in "\"'":
                pos = max(pos + 1, self._skip_string(pos))
            elif char == "#":
                pos = _end(_TO_EOL, text, pos)
            else:
                pos = max(pos + 1, _end(_NESTED_PLAIN, text, pos))
        return pos

    # -- values ----------------------------------------------------------------------------

    def _value(self, pos: int, path: KeyPath, depth: int) -> int:
        if pos >= self.size:
            return pos
        char = self.text[pos]
        if char in "\"'":
            return self._skip_string(pos)
        if char == "[":
            return self._array(pos, path, depth)
        if char == "{":
            return self._inline_table(pos, path, depth)
        return _end(_SCALAR, self.text, pos)

    def _array(self, pos: int, path: KeyPath, depth: int) -> int:
        if depth >= _MAX_DEPTH:
            return self._skip_nested(pos)
        text = self.text
        size = self.size
        pos += 1
        index = 0
        while True:
            pos = _end(_WS_NL_COMMENT, text, pos)
            if pos >= size:
                return pos
            char = text[pos]
            if char == "]":
                return pos + 1
            if char == ",":
                pos += 1
                continue
            if char == "}":
                return pos  # malformed: let the enclosing inline table close
            if _LOOKS_LIKE_KEYVAL.match(text, pos):
                self.resync = True  # unclosed array: a new `key = value` starts here
                return pos
            element = path + (index,)
            self._record(element, pos, True)
            index += 1
            end = self._value(pos, element, depth + 1)
            if self.resync:
                return end
            pos = end if end > pos else pos + 1
            pos = _end(_WS_NL_COMMENT, text, pos)
            if pos < size and text[pos] == ",":
                pos += 1

    def _inline_table(self, pos: int, path: KeyPath, depth: int) -> int:
        if depth >= _MAX_DEPTH:
            return self._skip_nested(pos)
        text = self.text
        size = self.size
        pos += 1
        while True:
            pos = _end(_WS_NL_COMMENT, text, pos)
            if pos >= size:
                return pos
            char = text[pos]
            if char == "}":
                return pos + 1
            if char == ",":
                pos += 1
                continue
            if char == "]":
                return pos  # malformed: let the enclosing array close
            if char == "[":
                self.resync = True  # unclosed inline table: probably a table header
                return pos
            end = self._keyval(pos, path, depth + 1)
            if self.resync:
                return end
            pos = end if end > pos else pos + 1

    def _keyval(self, pos: int, table: KeyPath, depth: int) -> int:
        """Parse ``key = value`` at ``pos`` (no leading whitespace); returns the end."""
        keys, after = self._key(pos)
        if not keys or after >= self.size or self.text[after] != "=":
            return after
        path = table
        last = len(keys) - 1
        for i, key in enumerate(keys):
            path = path + (key,)
            self._record(path, pos, i == last)
        return self._value(_end(_WS, self.text, after + 1), path, depth)

    # -- statements ------------------------------------------------------------------------

    def _header(self, pos: int) -> tuple[KeyPath | None, int]:
        """Parse ``[a.b]`` / ``[[a.b]]`` at ``pos``; returns the resolved table path."""
        array = self.text.startswith("[[", pos)
        keys, after = self._key(pos + (2 if array else 1))
        if not keys:
            return None, after
        path: KeyPath = ()
        last = len(keys) - 1
        for i, key in enumerate(keys):
            path = path + (key,)
            if i < last:
                self._record(path, pos, False)
                count = self.aot_count.get(path)
                if count:
                    path = path + (count - 1,)  # below an array of tables: its last element
            elif array:
                self._record(path, pos, True)
                count = self.aot_count.get(path, 0)
                self.aot_count[path] = count + 1
                path = path + (count,)
                self._record(path, pos, True)
            else:
                self._record(path, pos, True)
        return path, after

    def run(self) -> None:
        text = self.text
        size = self.size
        table: KeyPath = ()
        pos = 0
        while pos < size:
            pos = _end(_WS_CR, text, pos)
            if pos >= size:
                break
            char = text[pos]
            if char == "\n":
                pos += 1
                continue
            if char == "[":
                resolved, pos = self._header(pos)
                if resolved is not None:
                    table = resolved
            elif char != "#":
                pos = self._keyval(pos, table, 0)
                if self.resync:
                    self.resync = False
                    continue  # the value stopped at the start of the next statement
            pos = _end(_TO_EOL, text, pos)


class SourceMap:
    """Key path -> 1-based source line of a TOML document (see the module docstring)."""

    __slots__ = ("_lines",)

    def __init__(self, lines: Mapping[KeyPath, int] | None = None) -> None:
        self._lines: dict[KeyPath, int] = dict(lines) if lines else {}

    @classmethod
    def from_text(cls, text: str) -> SourceMap:
        """Map ``text``; never raises, whatever the text (even invalid TOML)."""
        try:
            scanner = _Scanner(text)
        except Exception:  # not a str at all: nothing to map
            return cls()
        with suppress(Exception):  # defensive: on a scanner bug keep what was mapped so far
            scanner.run()
        return cls(scanner.lines)

    def line_of(self, path: Sequence[str | int]) -> int:
        """1-based line of the longest prefix of `path` that the source defines; 1 if none."""
        key = tuple(path)
        lines = self._lines
        for length in range(len(key), 0, -1):
            line = lines.get(key[:length])
            if line is not None:
                return line
        return 1

    def has(self, path: Sequence[str | int]) -> bool:
        """Whether the source defines exactly `path`."""
        return tuple(path) in self._lines

    def __repr__(self) -> str:
        return f"<SourceMap of {len(self._lines)} paths>"
