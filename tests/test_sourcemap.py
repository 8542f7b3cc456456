"""Tests for vmlaunch.sourcemap: TOML key path -> source line."""

from __future__ import annotations

import random
import re
import sys
import textwrap
from pathlib import Path as FsPath
from typing import Any, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmlaunch.core.sourcemap import SourceMap

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Path = tuple[Union[str, int], ...]

SPEC = """\
[lab]
name = "demo"                 # names the run dir and host resources; [a-z0-9-], short
# mac_prefix = "00:16:3e"     # default 52:54:00

[network.lan]                 # type = "bridge" is the default
bridge = "vlbr-demo"          # created by `up` when missing; optional: mtu = 9000, uplink = "eth1"

[network.out]
type = "user"                 # QEMU user networking: no root needed
forward = ["tcp:127.0.0.1:2222-:22"]

[vm.alpha]
memory = "256M"               # "256M", "2G", or an integer number of MiB
cpus = 1
accel = "auto"                # auto | kvm | tcg
kernel = "guest/vmlinuz"      # direct kernel boot; a VM may instead boot from its first disk
initrd = "guest/initrd.gz"
append = "console=ttyS0"

[[vm.alpha.disk]]
file = "alpha.img"
size = "64M"                  # created sparse (qemu-img) when missing; an existing file is never overwritten
format = "raw"                # cache, aio and bus default to best practice

[[vm.alpha.nic]]
network = "lan"               # model defaults to virtio; mac derived from lab, vm and nic index

[[vm.alpha.nic]]
network = "out"

[vm.beta]
memory = 256
kernel = "guest/vmlinuz"
initrd = "guest/initrd.gz"

[[vm.beta.nic]]
network = "lan"
mac = "00:16:3e:00:01:02"
"""  # noqa: E501 - the example spec, verbatim


def smap(text: str) -> SourceMap:
    """Map the dedented `text`, which must be valid TOML: the only input the source map accepts."""
    text = textwrap.dedent(text)
    tomllib.loads(text)
    return SourceMap.from_text(text)


def defined(sm: SourceMap, path: Path) -> bool:
    """Whether the source defines exactly `path` (not just a prefix of it)."""
    return tuple(path) in sm._lines


def line_with(text: str, needle: str, nth: int = 0) -> int:
    """1-based line of the `nth` line of (dedented) `text` that contains `needle`."""
    hits = [i for i, line in enumerate(textwrap.dedent(text).split("\n"), 1) if needle in line]
    return hits[nth]


# -- the example spec ----------------------------------------------------------------------


class TestSpec:
    sm = SourceMap.from_text(SPEC)

    @pytest.mark.parametrize(
        ("path", "needle", "nth"),
        [
            (("lab",), "[lab]", 0),
            (("lab", "name"), 'name = "demo"', 0),
            (("network",), "[network.lan]", 0),
            (("network", "lan"), "[network.lan]", 0),
            (("network", "lan", "bridge"), "bridge =", 0),
            (("network", "out"), "[network.out]", 0),
            (("network", "out", "type"), 'type = "user"', 0),
            (("network", "out", "forward"), "forward =", 0),
            (("network", "out", "forward", 0), "forward =", 0),
            (("vm",), "[vm.alpha]", 0),
            (("vm", "alpha"), "[vm.alpha]", 0),
            (("vm", "alpha", "cpus"), "cpus = 1", 0),
            (("vm", "alpha", "append"), "append =", 0),
            (("vm", "alpha", "disk"), "[[vm.alpha.disk]]", 0),
            (("vm", "alpha", "disk", 0), "[[vm.alpha.disk]]", 0),
            (("vm", "alpha", "disk", 0, "file"), 'file = "alpha.img"', 0),
            (("vm", "alpha", "disk", 0, "size"), 'size = "64M"', 0),
            (("vm", "alpha", "disk", 0, "format"), 'format = "raw"', 0),
            (("vm", "alpha", "nic"), "[[vm.alpha.nic]]", 0),
            (("vm", "alpha", "nic", 0), "[[vm.alpha.nic]]", 0),
            (("vm", "alpha", "nic", 1), "[[vm.alpha.nic]]", 1),
            (("vm", "alpha", "nic", 0, "network"), 'network = "lan"', 0),
            (("vm", "alpha", "nic", 1, "network"), 'network = "out"', 0),
            (("vm", "beta"), "[vm.beta]", 0),
            (("vm", "beta", "memory"), "memory = 256", 0),
            (("vm", "beta", "nic"), "[[vm.beta.nic]]", 0),
            (("vm", "beta", "nic", 0), "[[vm.beta.nic]]", 0),
            (("vm", "beta", "nic", 0, "network"), 'network = "lan"', 1),
            (("vm", "beta", "nic", 0, "mac"), "mac =", 0),
        ],
    )
    def test_lines(self, path: Path, needle: str, nth: int) -> None:
        assert defined(self.sm, path)
        assert self.sm.line_of(path) == line_with(SPEC, needle, nth)

    def test_concrete_numbers(self) -> None:
        assert self.sm.line_of(("vm", "alpha", "disk", 0, "format")) == 23
        assert self.sm.line_of(("vm", "beta", "nic", 0, "mac")) == 38
        assert self.sm.line_of(("network", "out", "forward", 0)) == 10

    def test_missing_key_falls_back_to_longest_prefix(self) -> None:
        assert not defined(self.sm, ("vm", "beta", "cpus"))
        assert self.sm.line_of(("vm", "beta", "cpus")) == 31  # the [vm.beta] header
        assert self.sm.line_of(["vm", "beta", "nic", 0, "model"]) == 36
        assert self.sm.line_of(("vm", "alpha", "nic", 5, "network")) == 25
        assert self.sm.line_of(("vm", "gamma", "memory")) == 12  # first line creating `vm`

    def test_unknown_and_empty_paths(self) -> None:
        assert self.sm.line_of(()) == 1
        assert self.sm.line_of(("nope", "x")) == 1
        assert not defined(self.sm, ())
        assert not defined(self.sm, ("nope",))

    def test_comments_are_not_keys(self) -> None:
        assert not defined(self.sm, ("lab", "mac_prefix"))
        assert not defined(self.sm, ("network", "lan", "type"))
        assert not defined(self.sm, ("network", "lan", "mtu"))

    def test_every_parsed_path_is_mapped(self) -> None:
        doc = tomllib.loads(SPEC)
        for path, _ in walk(doc):
            assert defined(self.sm, path), path


# -- table headers -------------------------------------------------------------------------


def test_standard_headers_and_implicit_parents() -> None:
    text = """\
        # leading comment
        [vm.alpha.balloon]
        size = 1

        [vm.beta]
        """
    sm = smap(text)
    assert sm.line_of(("vm",)) == 2
    assert sm.line_of(("vm", "alpha")) == 2
    assert sm.line_of(("vm", "alpha", "balloon")) == 2
    assert sm.line_of(("vm", "alpha", "balloon", "size")) == 3
    assert sm.line_of(("vm", "beta")) == 5
    assert defined(sm, ("vm", "alpha")) and defined(sm, ("vm",))


def test_explicit_header_after_implicit_creation_wins() -> None:
    sm = smap(
        """\
        [vm.alpha.balloon]
        size = 1
        [vm.alpha]
        memory = 1
        """
    )
    assert sm.line_of(("vm",)) == 1
    assert sm.line_of(("vm", "alpha")) == 3
    assert sm.line_of(("vm", "alpha", "memory")) == 4
    assert sm.line_of(("vm", "alpha", "balloon", "size")) == 2


def test_quoted_header_keys_and_whitespace() -> None:
    sm = smap(
        """\
        [ a . "b.c" ]
        x = 1
        [ 'lit.eral' . "esc\\"aped\\u00e9\\t" . bare-key_1 ]
        y = 2
        ["" . 'x']
        z = 3
        """
    )
    assert sm.line_of(("a", "b.c")) == 1
    assert sm.line_of(("a", "b.c", "x")) == 2
    assert sm.line_of(("lit.eral", 'esc"aped\u00e9\t', "bare-key_1", "y")) == 4
    assert sm.line_of(("", "x", "z")) == 6
    assert not defined(sm, ("a", "b"))


def test_header_comment_with_brackets() -> None:
    sm = smap('[a] # [b] c = "d"\nk = 1\n')
    assert sm.line_of(("a", "k")) == 2
    assert not defined(sm, ("b",)) and not defined(sm, ("a", "c"))


# -- arrays of tables ----------------------------------------------------------------------


def test_array_of_tables_counts_elements() -> None:
    sm = smap(
        """\
        [[a]]
        x = 1
        [[a]]
        x = 2
        [a.b]
        y = 3
        [[a.c]]
        [[a.c]]
        z = 4
        """
    )
    assert sm.line_of(("a",)) == 1
    assert sm.line_of(("a", 0)) == 1
    assert sm.line_of(("a", 0, "x")) == 2
    assert sm.line_of(("a", 1)) == 3
    assert sm.line_of(("a", 1, "x")) == 4
    assert sm.line_of(("a", 1, "b")) == 5
    assert sm.line_of(("a", 1, "b", "y")) == 6
    assert not defined(sm, ("a", "b"))
    assert sm.line_of(("a", 1, "c")) == 7
    assert sm.line_of(("a", 1, "c", 0)) == 7
    assert sm.line_of(("a", 1, "c", 1)) == 8
    assert sm.line_of(("a", 1, "c", 1, "z")) == 9
    assert not defined(sm, ("a", 2))


def test_nested_arrays_of_tables_restart_per_parent_element() -> None:
    sm = smap(
        """\
        [[fruit]]
        name = "apple"
        [[fruit.variety]]
        name = "red"
        [[fruit.variety]]
        name = "green"
        [[fruit]]
        name = "banana"
        [[fruit.variety]]
        name = "plantain"
        [fruit.physical]
        color = "yellow"
        """
    )
    assert sm.line_of(("fruit", 0, "variety", 1, "name")) == 6
    assert sm.line_of(("fruit", 1, "name")) == 8
    assert sm.line_of(("fruit", 1, "variety")) == 9
    assert sm.line_of(("fruit", 1, "variety", 0, "name")) == 10
    assert not defined(sm, ("fruit", 1, "variety", 1))
    assert sm.line_of(("fruit", 1, "physical", "color")) == 12


def test_array_of_tables_under_array_of_tables_in_header_path() -> None:
    sm = smap("[[a]]\n[[a]]\n[[a.b.c]]\n[a.b.d]\n")
    assert sm.line_of(("a", 1, "b")) == 3
    assert sm.line_of(("a", 1, "b", "c", 0)) == 3
    assert sm.line_of(("a", 1, "b", "d")) == 4


# -- key/value lines -----------------------------------------------------------------------


def test_keys_bare_quoted_dotted() -> None:
    text = """\
        top = 1
        "quoted key" = 2
        'literal "key"' = 3
        a.b.c = 4
        a . "d.e" = 5
        1234 = 6
        [t]
        x.y = 7
        "" = 8
        """
    sm = smap(text)
    assert sm.line_of(("top",)) == 1
    assert sm.line_of(("quoted key",)) == 2
    assert sm.line_of(('literal "key"',)) == 3
    assert sm.line_of(("a",)) == 4
    assert sm.line_of(("a", "b")) == 4
    assert sm.line_of(("a", "b", "c")) == 4
    assert sm.line_of(("a", "d.e")) == 5
    assert sm.line_of(("1234",)) == 6
    assert sm.line_of(("t", "x")) == 8
    assert sm.line_of(("t", "x", "y")) == 8
    assert sm.line_of(("t", "")) == 9
    assert not defined(sm, (1234,))
    assert tomllib.loads(textwrap.dedent(text))  # the text is valid TOML


def test_keys_inside_array_of_table_elements() -> None:
    sm = smap("[[d]]\nf.g = 1\n[[d]]\nf.g = 2\n")
    assert sm.line_of(("d", 0, "f", "g")) == 2
    assert sm.line_of(("d", 1, "f")) == 4


# -- values --------------------------------------------------------------------------------


def test_inline_tables() -> None:
    sm = smap("x = { a = 1, b = { c = 2, 'd e' = [3] }, f.g = {} }\ny = {}\n")
    for path in [("x",), ("x", "a"), ("x", "b", "c"), ("x", "b", "d e", 0), ("x", "f", "g")]:
        assert sm.line_of(path) == 1, path
    assert sm.line_of(("y",)) == 2
    assert not defined(sm, ("y", "a"))


def test_brackets_and_hashes_inside_strings_in_values() -> None:
    sm = smap('x = { a = "}", b = \'{\', c = [ "]", { d = "#" } ] }  # } ]\ny = ["[", \'#\', "\\"]"]\n')
    for path in [("x", "a"), ("x", "b"), ("x", "c", 0), ("x", "c", 1, "d")]:
        assert sm.line_of(path) == 1, path
    assert sm.line_of(("y", 2)) == 2 and not defined(sm, ("y", 3))


def test_inline_table_spanning_lines_via_values() -> None:
    text = 'x = { a = """\nmulti { b = 1 }\n""", c = [\n  1,\n  2,\n], d = 3 }\nz = 0\n'
    assert tomllib.loads(text)["x"]["d"] == 3
    sm = SourceMap.from_text(text)
    assert sm.line_of(("x", "a")) == 1
    assert not defined(sm, ("x", "b"))
    assert sm.line_of(("x", "c")) == 3
    assert sm.line_of(("x", "c", 0)) == 4
    assert sm.line_of(("x", "c", 1)) == 5
    assert sm.line_of(("x", "d")) == 6
    assert sm.line_of(("z",)) == 7


def test_arrays_single_and_multi_line() -> None:
    text = """\
        forward = ["a", "b"]
        multi = [
          "first",   # a comment with [brackets] and "quotes"
          # a full-line comment, ]
          'second', "third",
          4
        ]
        empty = []
        after = 1
        """
    sm = smap(text)
    assert sm.line_of(("forward",)) == 1
    assert sm.line_of(("forward", 0)) == 1
    assert sm.line_of(("forward", 1)) == 1
    assert not defined(sm, ("forward", 2))
    assert sm.line_of(("multi",)) == 2
    assert sm.line_of(("multi", 0)) == 3
    assert sm.line_of(("multi", 1)) == 5
    assert sm.line_of(("multi", 2)) == 5
    assert sm.line_of(("multi", 3)) == 6
    assert not defined(sm, ("multi", 4))
    assert defined(sm, ("empty",)) and not defined(sm, ("empty", 0))
    assert sm.line_of(("after",)) == 9


def test_arrays_of_inline_tables_and_nested_arrays() -> None:
    text = """\
        nic = [ {network="lan"}, {network="out", mac = "x"} ]
        grid = [
          [1, 2],
          [
            [3],
            {deep = [{k = 1}]},
          ],
        ]
        """
    sm = smap(text)
    assert sm.line_of(("nic", 0, "network")) == 1
    assert sm.line_of(("nic", 1, "network")) == 1
    assert sm.line_of(("nic", 1, "mac")) == 1
    assert sm.line_of(("grid", 0)) == 3
    assert sm.line_of(("grid", 0, 1)) == 3
    assert sm.line_of(("grid", 1)) == 4
    assert sm.line_of(("grid", 1, 0)) == 5
    assert sm.line_of(("grid", 1, 0, 0)) == 5
    assert sm.line_of(("grid", 1, 1, "deep", 0, "k")) == 6
    assert not defined(sm, ("grid", 2))


def test_scalars_of_every_kind() -> None:
    text = """\
        a = 1979-05-27 07:32:00Z  # datetime with a space
        b = -inf
        c = 0xdead_beef
        d = true
        e = [1.5, nan, 1979-05-27, 07:32:00]
        f = 1
        """
    sm = smap(text)
    assert [sm.line_of((k,)) for k in "abcdef"] == [1, 2, 3, 4, 5, 6]
    assert sm.line_of(("e", 3)) == 5 and not defined(sm, ("e", 4))


# -- strings and comments ------------------------------------------------------------------


def test_strings_hide_syntax() -> None:
    text = r"""
        a = "a \" # [x] = { y"
        b = 'c:\path\' # [not] = {a'
        c = ""
        d = '' # ]
        e = "\\"
        f = 1
        """
    sm = smap(text)
    assert [sm.line_of((k,)) for k in "abcdef"] == [2, 3, 4, 5, 6, 7]
    assert set(tomllib.loads(textwrap.dedent(text))) == set("abcdef")
    assert not defined(sm, ("x",)) and not defined(sm, ("not",))


def test_multiline_strings() -> None:
    text = '''\
        a = """
        [fake]
        key = "value" # }
        quote " and "" and \\""" still inside
        """
        b = 1
        c = \'\'\'
        [fake2]
        'single' and '' quotes, a \\ backslash
        \'\'\'
        d = """x""""
        e = \'\'\'y\'\'\'\'\'
        f = [
          """
          ]
        """,
          \'\'\'#\'\'\',
        ]
        g = 2
        '''
    doc = tomllib.loads(textwrap.dedent(text))
    assert doc["d"] == 'x"' and doc["e"] == "y''"
    sm = smap(text)
    assert sm.line_of(("a",)) == 1
    assert sm.line_of(("b",)) == 6
    assert sm.line_of(("c",)) == 7
    assert sm.line_of(("d",)) == 11
    assert sm.line_of(("e",)) == 12
    assert sm.line_of(("f", 0)) == 14
    assert sm.line_of(("f", 1)) == 17
    assert not defined(sm, ("f", 2))
    assert sm.line_of(("g",)) == 19
    assert not defined(sm, ("fake",)) and not defined(sm, ("fake2",)) and not defined(sm, ("key",))
    assert set(doc) == {"a", "b", "c", "d", "e", "f", "g"}


def test_crlf_line_endings() -> None:
    text = "[a]\r\nx = 1\r\n\r\n[[b]]\r\ny = [\r\n 1,\r\n 2]\r\n"
    assert tomllib.loads(text)["b"][0]["y"] == [1, 2]
    sm = SourceMap.from_text(text)
    assert sm.line_of(("a", "x")) == 2
    assert sm.line_of(("b", 0, "y")) == 5
    assert sm.line_of(("b", 0, "y", 1)) == 7


# -- deep nesting and odd corners ---------------------------------------------------------


def test_empty_and_comment_only_documents() -> None:
    for text in ["", "\n\n", "# only a comment\n", "  \t\r\n# x = 1\n"]:
        sm = smap(text)
        assert sm._lines == {}
        assert sm.line_of(("a", "b")) == 1


def test_deep_nesting_keeps_later_keys() -> None:
    text = "a = " + "[" * 200 + "]" * 200 + "\nb = 1\n"
    sm = smap(text)
    assert sm.line_of(("b",)) == 2
    assert sm.line_of(("a", 0, 0, 0)) == 1
    assert sm.line_of(("a",) + (0,) * 199) == 1
    assert not defined(sm, ("a",) + (0,) * 200)


def test_nesting_deeper_than_the_recursion_limit() -> None:
    # Valid TOML (the specification sets no limit), deeper than tomllib itself can parse.
    def nested(depth: int) -> str:
        return "a = " + "[\n{x = " * depth + "1" + "}]" * depth + "\nb = 2\n"

    assert tomllib.loads(nested(3)) == {"a": [{"x": [{"x": [{"x": 1}]}]}], "b": 2}
    depth = sys.getrecursionlimit() * 3
    sm = SourceMap.from_text(nested(depth))
    deepest = ("a",) + (0, "x") * depth
    assert sm.line_of(deepest) == depth + 1
    assert sm.line_of(deepest[:3]) == 2
    assert sm.line_of(deepest[:5]) == 3
    assert sm.line_of(("b",)) == depth + 2


def test_escaped_quote_then_equals_in_array_is_not_a_new_key() -> None:
    text = '\'\' = [\n  "\\"=", # ], {x = 1}\n  "a\\\\" ,\n]\nb = 1\n'
    assert tomllib.loads(text) == {"": ['"=', "a\\"], "b": 1}
    sm = SourceMap.from_text(text)
    assert sm.line_of(("", 0)) == 2
    assert sm.line_of(("", 1)) == 3
    assert sm.line_of(("b",)) == 5


# -- the example specs ---------------------------------------------------------------------

EXAMPLES = sorted((FsPath(__file__).parent.parent / "examples").glob("*.toml"))


@pytest.mark.parametrize("file", EXAMPLES, ids=lambda file: file.name)
def test_example_specs(file: FsPath) -> None:
    text = file.read_text(encoding="utf-8")
    sm = SourceMap.from_text(text)
    lines = text.split("\n")
    leaves = 0
    for path, value in walk(tomllib.loads(text)):
        assert defined(sm, path), path
        line = lines[sm.line_of(path) - 1]
        if isinstance(path[-1], str):
            assert path[-1] in line, (path, line)
        if not isinstance(value, (dict, list)):
            leaves += 1
            if isinstance(path[-1], str):
                assert re.match(rf"\s*{re.escape(path[-1])}\s*=", line), (path, line)
            else:
                assert str(value) in line, (path, line)
    assert leaves >= 5


# -- property test: random documents through a tiny TOML dumper ---------------------------

BARE = re.compile(r"[A-Za-z0-9_-]+\Z")


def walk(node: Any, prefix: Path = ()) -> list[tuple[Path, Any]]:
    """Every (path, value) below `node` (containers included), as the validator walks it."""
    out: list[tuple[Path, Any]] = []
    if isinstance(node, dict):
        items: list[tuple[str | int, Any]] = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return out
    for key, value in items:
        path = prefix + (key,)
        out.append((path, value))
        out.extend(walk(value, path))
    return out


def _escape_basic(s: str, multiline: bool) -> str:
    out = []
    quotes = 0
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            if multiline and quotes < 2:
                out.append('"')
                quotes += 1
                continue
            out.append('\\"')
        elif ch == "\n" and multiline:
            out.append("\n")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\t")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
        quotes = 0
    return "".join(out)


def _literal_ok(s: str, multiline: bool) -> bool:
    allowed = "\t\n" if multiline else "\t"
    if any((ord(c) < 0x20 and c not in allowed) or c == "\x7f" for c in s):
        return False
    return "'''" not in s if multiline else "'" not in s


class Dumper:
    """A tiny TOML writer that remembers the line on which it defines every path."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.parts: list[str] = []
        self.line = 1
        self.expected: dict[Path, int] = {}
        self.tokens: dict[Path, str] = {}
        self.pending: list[Path] = []  # tables without header: defined by the next header

    def w(self, s: str) -> None:
        self.parts.append(s)
        self.line += s.count("\n")

    def text(self) -> str:
        return "".join(self.parts)

    def define(self, path: Path, token: str | None = None) -> None:
        self.expected.setdefault(path, self.line)
        if token is not None:
            self.tokens.setdefault(path, token)

    def noise(self) -> None:
        r = self.rng.random()
        if r < 0.15:
            self.w("\n")
        elif r < 0.25:
            self.w('# comment [x.y] = { "z" \n')

    def key(self, k: str) -> str:
        if BARE.match(k) and self.rng.random() < 0.8:
            return k
        if _literal_ok(k, False) and self.rng.random() < 0.5:
            return f"'{k}'"
        return '"' + _escape_basic(k, False) + '"'

    def string(self, s: str) -> str:
        choice = self.rng.randrange(4)
        if choice == 1 and _literal_ok(s, False):
            return f"'{s}'"
        if choice == 2:
            return '"""\n' + _escape_basic(s, True) + '"""'
        if choice == 3 and _literal_ok(s, True) and not s.endswith("''") and "\r" not in s:
            return "'''\n" + s + "'''"
        return '"' + _escape_basic(s, False) + '"'

    def value(self, v: Any, path: Path) -> None:
        if isinstance(v, bool):
            self.w("true" if v else "false")
        elif isinstance(v, int):
            self.w(str(v))
        elif isinstance(v, str):
            self.w(self.string(v))
        elif isinstance(v, list):
            multi = self.rng.random() < 0.5
            self.w("[")
            for i, item in enumerate(v):
                if multi:
                    self.w("\n  ")
                elif i:
                    self.w(" ")
                self.define(path + (i,))
                self.value(item, path + (i,))
                if i < len(v) - 1 or (multi and self.rng.random() < 0.5):
                    self.w(",")
                if multi and self.rng.random() < 0.2:
                    self.w(" # ], {x = 1}")
            self.w("\n]" if multi and v else "]")
        else:
            self.w("{")
            for i, (k, item) in enumerate(v.items()):
                token = self.key(k)
                self.w(", " if i else " ")
                self.define(path + (k,), token)
                self.w(f"{token} = ")
                self.value(item, path + (k,))
            self.w(" }" if v else "}")

    def dotted(self, d: dict[str, Any], prefix: list[str], path: Path) -> None:
        for k, v in d.items():
            token = self.key(k)
            sub = path + (k,)
            if isinstance(v, dict) and v and self.rng.random() < 0.5:
                self.tokens.setdefault(sub, token)
                self.dotted(v, prefix + [token], sub)
                continue
            self.noise()
            for depth in range(len(prefix)):  # intermediate tables created by this line
                self.define(path[: len(path) - len(prefix) + depth + 1])
            self.define(sub, token)
            sep = self.rng.choice([".", " . "])
            self.w(sep.join(prefix + [token]) + " = ")
            self.value(v, sub)
            self.w("\n")

    def header(self, open_: str, close: str, tokens: list[str], defines: list[Path]) -> None:
        self.noise()
        sep = self.rng.choice([".", " . "])
        for path in self.pending + defines:
            self.define(path)
        self.pending.clear()
        self.w(f"{open_}{sep.join(tokens)}{close}")
        if self.rng.random() < 0.2:
            self.w('  # [[not.a.header]] = "x"')
        self.w("\n")

    def body(self, d: dict[str, Any], hdr: list[str], path: Path, own_header: bool) -> None:
        styles: dict[str, str] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                styles[k] = self.rng.choice(["header", "dotted", "inline"] if v else ["header"])
                if not v and self.rng.random() < 0.5:
                    styles[k] = "inline"
            elif isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
                styles[k] = "aot" if self.rng.random() < 0.6 else "inline"
            else:
                styles[k] = "inline"
        tables = [k for k in d if styles[k] in ("header", "aot")]
        if own_header:
            if len(tables) == len(d) and tables and self.rng.random() < 0.4:
                self.pending.append(path)  # implicit: created by the first sub-header
            else:
                self.header("[", "]", hdr, [path])
        for k, v in d.items():
            sub = path + (k,)
            if styles[k] == "inline":
                self.noise()
                token = self.key(k)
                self.define(sub, token)
                self.w(f"{token} = ")
                self.value(v, sub)
                self.w("  # trailing\n" if self.rng.random() < 0.2 else "\n")
            elif styles[k] == "dotted":
                token = self.key(k)
                self.tokens.setdefault(sub, token)
                self.dotted(v, [token], sub)
        for k in tables:
            v = d[k]
            sub = path + (k,)
            token = self.key(k)
            if styles[k] == "header":
                self.tokens.setdefault(sub, token)
                self.body(v, hdr + [token], sub, True)
            else:
                self.tokens.setdefault(sub, token)
                for i, element in enumerate(v):
                    self.header("[[", "]]", hdr + [token], [sub, sub + (i,)])
                    self.body(element, hdr + [token], sub + (i,), False)


KEYS = st.text(alphabet=list("abXY019_- .#[]={}\"'\\\n\té"), max_size=5)
STRINGS = st.text(alphabet=list("ab #[]={},.\"'\\\n\t\x01é"), max_size=12)
SCALARS = st.one_of(st.integers(-(10**6), 10**6), st.booleans(), STRINGS)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(KEYS, children, max_size=4),
        st.lists(st.dictionaries(KEYS, children, max_size=3), min_size=1, max_size=3),
    ),
    max_leaves=25,
)
DOCS = st.dictionaries(KEYS, VALUES, max_size=6)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCS, st.randoms(use_true_random=False))
def test_generated_documents_map_every_path(doc: dict[str, Any], rng: random.Random) -> None:
    dumper = Dumper(rng)
    dumper.body(doc, [], (), False)
    text = dumper.text()
    parsed = tomllib.loads(text)
    assert parsed == doc, text

    sm = SourceMap.from_text(text)
    lines = text.split("\n")
    for path, value in walk(parsed):
        assert defined(sm, path), (path, text)
        line = sm.line_of(path)
        assert 1 <= line <= len(lines)
        assert line == dumper.expected[path], (path, text)
        if isinstance(path[-1], str):
            token = dumper.tokens[path]
            assert token in lines[line - 1], (path, token, text)
            if BARE.match(path[-1]):
                assert path[-1] in lines[line - 1]
        if not isinstance(value, (dict, list)):  # a leaf: nothing deeper is mapped
            assert not any(p[: len(path)] == path and p != path for p in sm._lines)
