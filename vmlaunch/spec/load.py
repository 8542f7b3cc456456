"""Read a TOML lab spec into a `model.Lab`, or raise `SpecError` listing every problem found.

Four passes: TOML syntax, one walk over every key and string (no NUL, no absurd nesting), structure
(the JSON schema in schemas/, the single source of structure), then meaning (references, sizes,
clashes), which only looks at the parts the schema accepted so that one typo does not hide the other
problems nor drown them in follow-on errors. Each problem is reported once.

The spec file itself is refused before it is read when it is not a regular file (a FIFO or /dev/zero
would never end) or is larger than any lab needs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import attrs

from vmlaunch.core.fsutil import Unfit, read_bounded
from vmlaunch.core.naming import (
    DEFAULT_MAC_PREFIX,
    default_bridge_name,
    derive_mac,
    derive_mcast,
    interface_name_problem,
    is_multicast_mac,
    management_mac,
    normalise_pci_address,
)
from vmlaunch.core.sourcemap import SourceMap
from vmlaunch.core.units import bare_shown, format_size, parse_duration, parse_size, spelled
from vmlaunch.core.version import __version__
from vmlaunch.errors import KeyPath, Location, Problem, SpecError, format_key_path
from vmlaunch.layout.dirs import usable_cache_dir
from vmlaunch.spec.model import (
    MACHINE_SATA_PORTS,
    Accel,
    Aio,
    Balloon,
    BalloonPolicy,
    BridgeNetwork,
    CacheMode,
    CloudInit,
    Disk,
    DiskBus,
    DiskFault,
    DiskFormat,
    FaultKind,
    Firmware,
    HostSpec,
    HugepageSize,
    Image,
    LabMemory,
    LabPlacement,
    LabSpec,
    Netem,
    NetemWhere,
    Network,
    Nic,
    NicModel,
    OnError,
    PciDevice,
    PciDriver,
    PlacementPolicy,
    Share,
    SocketNetwork,
    TapNetwork,
    UserNetwork,
    Video,
    VmSpec,
    balloon_min_mib,
    default_of,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9/3.10 only
    import tomli as tomllib

SCHEMA_FILE = Path(__file__).resolve().parent / "vmlaunch.schema.json"
# Bumped when the checks below change what they accept, so that no spec remembered as valid by an
# older check skips the new one (see _check_structure).
_CHECKS_REVISION = b"2"

MAX_SPEC_BYTES = 1 << 20  # a 50-VM lab is 10 KiB; more is a mistake (or /dev/zero behind a link)
MAX_DEPTH = 16  # the deepest key a lab has is vm.NAME.disk[0].file (5): 16 is generous
MAX_MEMORY = 16 << 40  # 16 TiB: more than any host has, and past the guest physical address bits
MAX_DISK_SIZE = 1 << 50  # 1 PiB: qcow2 with its default 64 KiB clusters takes up to 2 PiB
# A bare disk size meant bytes in earlier versions: as MiB, the byte count of even a 1 MiB disk is 1 TiB.
BARE_DISK_LIMIT = 1 << 40
# Values that make QEMU print a list and exit instead of starting a VM (QEMU's is_help_option).
_QEMU_QUERIES = ("help", "?")

Doc = dict[str, Any]


class _Problems:
    """Collects problems for one spec file, resolving key paths to lines."""

    def __init__(self, file: Path, source: SourceMap) -> None:
        self.file = file
        self.source = source
        self.items: list[Problem] = []
        self._seen: set[Problem] = set()

    def add(self, path: KeyPath, message: str, hint: str | None = None) -> None:
        location = Location(self.file, self.source.line_of(path), _printable_path(path))
        problem = Problem(location, message, hint)
        if problem not in self._seen:  # one schema rule may fail twice in one place
            self._seen.add(problem)
            self.items.append(problem)


def _printable_path(path: KeyPath) -> KeyPath:
    """Keys as TOML would quote them when they are not bare ("a.b", "x\\u0000"), so a message never
    carries a NUL, a newline or an escape sequence to the terminal, and a dotted key stays one key."""
    import json

    return tuple(part if isinstance(part, int) or _BARE_KEY.fullmatch(part) else json.dumps(part)
                 for part in path)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _as_bytes(value: str | int) -> str:
    """How a bare number is written as bytes: 'bytes take a B suffix: "1073741824B", that is "1G"'."""
    digits = str(value).strip(" ")
    if len(digits) > 24 or not digits.isdigit():
        return "bytes take a B suffix: \"4096B\""
    size = int(digits)
    short = format_size(size)
    return f"bytes take a B suffix: \"{size}B\"" + ("" if short.endswith("B") else f", that is \"{short}\"")


def _shown(value: object) -> str:
    """A value as messages show it: its repr, cut short when long (a size of 400 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:48]}...({len(text)} characters)"


Found = tuple[KeyPath, str, Optional[str]]  # a problem of a file the spec names: where, what, a hint


@attrs.frozen
class Named:
    """A file (or folder) a spec names, where it names it, and what it must be."""

    path: KeyPath
    file: Path
    kind: str = "file"  # file | disk | folder | script (a network's up_script or down_script)
    writable: bool = False  # a disk the VM writes to
    device_ok: bool = False  # block_device = true
    may_be_missing: bool = False  # a disk with a size: `up` creates it

    @property
    def vm(self) -> str | None:
        return str(self.path[1]) if self.path[0] == "vm" else None


@attrs.frozen
class Built:
    """A lab as built, with what the build noted for the checks of its files: every file the spec
    names (of every VM, built or not: a broken key elsewhere never hides a missing kernel) and the
    image each VM boots."""

    lab: LabSpec
    named: tuple[Named, ...]
    vm_images: Mapping[str, str]


# The checks of the files a spec names (`compile/preflight.py` has them): asked of the built lab, and
# reported with every other problem at once.
FileChecks = Callable[[Built], Iterable[Found]]


def load_lab(path: str | Path, *, files: FileChecks | None = None) -> LabSpec:
    """Parse, check and build the lab of the spec at `path`. With `files`, also what those checks
    find (`compile.preflight.load_checked` passes them), reported with every other problem at once."""
    file = Path(path)
    if _kept_run(path):
        from vmlaunch.spec import throwaway

        return throwaway.kept_lab(str(path), load_lab)
    return parse_lab(read_spec(file), file, files=files)


def _kept_run(path: str | Path) -> bool:
    """A throwaway VM's name given for SPEC (`vmlaunch exec run-1a2b3c4d VM`) where no such file is."""
    from vmlaunch.spec.throwaway import is_throwaway

    return isinstance(path, str) and is_throwaway(path) and not os.path.lexists(path)


def read_spec(file: Path) -> bytes:
    """The bytes of the spec at `file`; SpecError when it is not a regular file of a sane size
    (`fsutil.read_bounded`: a FIFO cannot hang us, a device is never opened). A spec the user named
    may be a symlink: it is followed, and what it leads to checked."""
    def refuse(reason: str) -> SpecError:
        return SpecError([Problem(Location(file, 1), f"cannot read the spec: {reason}")])

    try:
        return read_bounded(file, MAX_SPEC_BYTES)
    except Unfit as exc:
        raise refuse(exc.what) from None
    except OSError as exc:
        raise refuse(exc.strerror or str(exc)) from None
    except ValueError as exc:  # a NUL in the path (from the Python API; argv cannot hold one)
        raise refuse(str(exc)) from None


def parse_lab(data: bytes, file: Path, *, files: FileChecks | None = None) -> LabSpec:
    """Like `load_lab` for spec text already read; relative paths resolve against `file`'s folder."""
    text = _decode(data, file)
    doc = _parse_toml(text, file)
    source = SourceMap.from_text(text)
    problems = _Problems(file, source)
    walked = _walk(doc, problems)
    invalid = _check_structure(doc, data, problems, walked)
    builder = _Builder(doc, file.resolve(), source, problems, invalid)
    lab = builder.build()
    if files is not None:
        for path, message, hint in files(Built(lab, tuple(builder.named), dict(builder.vm_images))):
            problems.add(path, message, hint)
    if problems.items:
        raise SpecError(sorted(problems.items, key=lambda problem: problem.location.line))
    return lab


def lab_name(path: str | Path) -> str:
    """The lab's name, for `down`: from the checked spec, or, when the spec no longer validates
    (edited since `up`), from its `[lab] name` alone, so a broken spec never strands a running lab."""
    if _kept_run(path):
        return str(path)
    file = Path(path)
    data = read_spec(file)
    try:
        return parse_lab(data, file).name
    except SpecError as exc:
        try:
            name = tomllib.loads(data.decode()).get("lab", {}).get("name")
        except (ValueError, RecursionError, AttributeError):  # bad text, deep nesting, lab not a table
            name = None
        if isinstance(name, str) and _ecma_search(_lab_name_pattern(), name):
            return name
        raise exc from None


def host_names(path: str | Path) -> list[str]:
    """The names of the spec's `[host.NAME]` tables, read from its TOML alone (a lab on libvirt hosts);
    none for a spec that cannot be read: the command that loads it says why."""
    try:
        data = tomllib.loads(read_spec(Path(path)).decode())
    except (SpecError, ValueError, RecursionError):
        return []
    hosts = data.get("host")
    return [name for name in hosts if isinstance(hosts[name], dict)] if isinstance(hosts, dict) else []


def _lab_name_pattern() -> str:
    import json

    return str(json.loads(SCHEMA_FILE.read_bytes())["properties"]["lab"]["properties"]["name"]["pattern"])


def _decode(data: bytes, file: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError([Problem(Location(file, line), "the spec is not UTF-8 text",
                                 f"byte {data[exc.start]:#04x} at offset {exc.start}")]) from None


# tomllib's words -> plain words, with what to do (Python 3.11's messages; others are kept as they are)
_TOML_MESSAGES = {
    "Illegal character '\\n'": ("unterminated string: a \"...\" or '...' string must end on the line "
                                 "it starts", 'close it, or use """...""" for text of several lines'),
    "Unterminated string": ("unterminated string: the file ends inside it", "close the string"),
    "Unclosed array": ("unclosed array: '[' without its ']'", "an array may span lines, but "
                       "needs its ']' before the next key or [table]"),
    "Cannot overwrite a value": ("this key already has a value", "give each key once per table"),
    "Unclosed inline table": ("unclosed inline table: '{' without its '}', or it spans lines",
                              "an inline table must be on one line; use a [table] for more"),
    "Invalid value": ("a value is missing or is not a TOML value",
                      'strings need quotes: name = "web", memory = "1G"'),
    "Invalid statement": ("not a key = value line nor a [table] header", None),
    "Expected '=' after a key in a key/value pair": ("expected '=' after the key", None),
}


def _parse_toml(text: str, file: Path) -> Doc:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        line = getattr(exc, "lineno", None)
        column = getattr(exc, "colno", None)
        found = re.search(r"\(at line ([0-9]+), column ([0-9]+)\)\Z", message)
        if found:
            line, column = line or int(found.group(1)), column or int(found.group(2))
            message = message[: found.start()].strip()
        elif message.endswith("(at end of document)"):
            line = line or text.rstrip().count("\n") + 1  # the last line with text on it
            message = message[: -len("(at end of document)")].strip()
        if message.startswith("Illegal character") and message not in _TOML_MESSAGES:
            message += " (control characters must be written as escapes, e.g. \\u0000)"
        if message == "Unclosed array" and line:
            line, column = _unclosed_array_line(text, line), None
        words, hint = _TOML_MESSAGES.get(message, (message, None))
        declared = re.fullmatch(r"Cannot declare \((.*)\) twice", message)
        if declared:  # tomllib says it as a Python tuple: ('vm', 'a')
            table = ".".join(re.findall(r"'((?:[^'\\]|\\.)*)'", declared.group(1)))
            words, hint = f"table [{table}] is declared twice", "give each [table] once; add its keys there"
        where = f" (column {column})" if column else ""
        problem = Problem(Location(file, line or 1), f"TOML syntax error: {words}{where}", hint)
    except RecursionError:  # tomllib recurses once per level of nested arrays or inline tables
        problem = Problem(Location(file, _deep_line(text)), "arrays or inline tables are nested "
                          "too deeply", f"a lab needs at most {MAX_DEPTH} levels")
    except ValueError:  # int() refuses integers of more than 4300 digits before tomllib sees them
        line = _line_at(text, re.search(r"[0-9_]{4000,}", text))
        problem = Problem(Location(file, line), "a number has thousands of digits")
    raise SpecError([problem]) from None


def _unclosed_array_line(text: str, reported: int) -> int:
    """tomllib notices an unclosed array where the next line fails to continue it; the user wants
    the line that opened it: the last `key = [` line before that with more '[' than ']'."""
    lines = text.splitlines()
    for number in range(min(reported, len(lines)), 0, -1):
        line = lines[number - 1].split("#", 1)[0]
        if "=" in line and line.count("[") > line.count("]"):
            return number
    return reported


def _deep_line(text: str) -> int:
    return _line_at(text, re.search(rf"[\[{{](?:[ \t\r\n]*[\[{{]){{{MAX_DEPTH}}}", text))


def _line_at(text: str, found: re.Match[str] | None) -> int:
    return text.count("\n", 0, found.start()) + 1 if found else 1


# --- every key and string --------------------------------------------------------------------------


def _walk(doc: Doc, problems: _Problems) -> list[KeyPath]:
    """One pass over the whole document: no key or string holds a NUL (no file name, QEMU option or
    kernel argument can), and nothing nests deeper than MAX_DEPTH. Returns the paths it reported.

    Iterative, so it cannot run out of stack; raises SpecError at once on absurd nesting, which the
    schema check (recursive) must not see.
    """
    found: list[KeyPath] = []
    too_deep = False
    todo: list[tuple[KeyPath, Any]] = [((), doc)]
    while todo:
        path, node = todo.pop()
        if len(path) > MAX_DEPTH:
            problems.add(path, f"nested more than {MAX_DEPTH} levels deep",
                         "a lab needs only a few levels (vm.NAME.disk[0].file)")
            found.append(path)
            too_deep = True
            continue
        if isinstance(node, str) and "\0" in node:
            problems.add(path, f"{_shown(node)} holds a NUL character, which no file name, option "
                         "or argument can hold", "remove the \\u0000")
            found.append(path)
        elif isinstance(node, dict):
            for key, value in reversed(node.items()):
                if "\0" in key:
                    problems.add((*path, key), "a key holds a NUL character", "remove the \\u0000")
                    found.append((*path, key))
                else:
                    todo.append(((*path, key), value))
        elif isinstance(node, list):
            todo.extend(((*path, index), value) for index, value in reversed(list(enumerate(node))))
    if too_deep:
        raise SpecError(problems.items)
    return found


# --- structure ------------------------------------------------------------------------------------


def _check_structure(doc: Doc, data: bytes, problems: _Problems, walked: list[KeyPath]) -> list[KeyPath]:
    """Validate against the JSON schema; return the key paths of the parts it (or `_walk`, whose
    `walked` paths it does not report again) rejected.

    A spec that validated clean before (same bytes, same schema, same checks, same vmlaunch) is
    remembered by hash, so the common case skips importing jsonschema (~70 ms, more than Python's own
    start-up).
    """
    schema_bytes = SCHEMA_FILE.read_bytes()
    digest = hashlib.sha256(b"\0".join([__version__.encode(), _CHECKS_REVISION, schema_bytes, data]))
    cache = usable_cache_dir("valid")  # a stamp another user could plant would skip the schema check
    stamp = cache / digest.hexdigest() if cache is not None else None
    if not walked and stamp is not None and stamp.exists():
        return []
    import json

    invalid = list(walked)
    try:
        errors = list(_schema_errors(doc, json.loads(schema_bytes)))
    except RecursionError:  # cannot happen below MAX_DEPTH; a message, not a crash, if it does
        problems.add((), "the spec is nested too deeply to check")
        raise SpecError(problems.items) from None
    for path, message, hint in errors:
        if any(path[: len(bad)] == bad for bad in walked):
            continue  # already reported by the walk, which says better what is wrong
        problems.add(path, message, hint)
        invalid.append(path)
    if not invalid and stamp is not None:
        _touch(stamp)
    return invalid


def _touch(stamp: Path) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:
        pass  # a read-only cache only costs speed


def _schema_errors(doc: Doc, schema: Doc) -> Iterator[tuple[KeyPath, str, str | None]]:
    validator = _validator_class()(schema)
    for error in validator.iter_errors(doc):
        yield from _describe(error)


@functools.cache
def _validator_class() -> Any:
    """Draft 2020-12 as TOML needs it: an integer is a TOML integer (JSON Schema takes 2.0 for one,
    and true is not one), and a pattern is matched as ECMA-262 does (`$` only at the very end)."""
    import jsonschema  # heavy: only when a spec is not known to be valid
    from jsonschema import validators

    base = jsonschema.Draft202012Validator

    def is_integer(checker: Any, value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def pattern(validator: Any, regex: str, instance: object, schema: Doc) -> Iterator[Any]:
        if isinstance(instance, str) and not _ecma_search(regex, instance):
            yield jsonschema.ValidationError(f"{_shown(instance)} does not match {regex!r}")

    def unique_items(validator: Any, unique: bool, instance: object, schema: Doc) -> Iterator[Any]:
        # jsonschema's own compares every pair when the items do not sort (1 and "a"): 60,000 of
        # them took minutes. One set of canonical forms is linear.
        if unique and isinstance(instance, list):
            import json

            forms = [json.dumps(item, sort_keys=True, default=repr) for item in instance]
            if len(set(forms)) != len(forms):
                yield jsonschema.ValidationError("has non-unique elements")

    return validators.extend(base, {"pattern": pattern, "uniqueItems": unique_items},
                             type_checker=base.TYPE_CHECKER.redefine("integer", is_integer))


def _ecma_search(pattern: str, text: str) -> bool:
    """`pattern` (ECMA-262, as the schema writes it) searched in `text` as ECMA-262 would."""
    return _python_regex(pattern).search(text) is not None


@functools.cache
def _python_regex(pattern: str) -> re.Pattern[str]:
    """Python's `$` also matches before a final newline, ECMA-262's only at the end: `$` -> `\\Z`.

    The schema's patterns keep to what both dialects read alike otherwise (tests/test_spec.py checks).
    """
    out, in_class, escaped = [], False, False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "[":
            in_class = True
        elif char == "]":
            in_class = False
        elif char == "$" and not in_class:
            char = "\\Z"
        out.append(char)
    return re.compile("".join(out))


def _describe(error: Any) -> Iterator[tuple[KeyPath, str, str | None]]:
    """Turn a jsonschema error into (key path, message, hint)s a user can act on."""
    path: KeyPath = tuple(error.absolute_path)
    kind = error.validator
    value = error.instance
    schema = error.schema
    if "propertyNames" in error.absolute_schema_path:
        yield (*path, value), f"the name {_shown(value)} {_schema_message(error)}", None
    elif kind == "required":
        import difflib

        missing = [key for key in error.validator_value if key not in value]
        # `memroy = 64` is one mistake: the unknown key's "did you mean 'memory'?" says it all
        unknown = [key for key in value if key not in schema.get("properties", {})]
        missing = [key for key in missing if not difflib.get_close_matches(key, unknown, n=1)]
        if missing:
            yield path, f"missing required key {', '.join(map(repr, missing))}", None
    elif kind == "additionalProperties":
        import difflib

        allowed = sorted(schema.get("properties", {}))
        for key in (key for key in value if key not in allowed):  # every one, not only the first
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(allowed)}"
            yield (*path, key), f"unknown key {_shown(key)}", hint
    elif kind in ("enum", "const"):
        options = error.validator_value if kind == "enum" else [error.validator_value]
        yield path, f"{_shown(value)} is not one of {', '.join(map(str, options))}", None
    elif kind == "type":
        yield path, f"expected {_type_words(error.validator_value)}, got {_toml_type(value)}", None
    elif kind == "minProperties":
        yield path, _schema_message(error), None
    elif kind == "minimum" and schema.get("x-size"):
        yield path, f"{bare_shown(value) or _shown(value)} is {'no size' if value == 0 else 'negative'}", None
    elif kind == "minimum":
        yield path, f"{_shown(value)} is less than the minimum {error.validator_value}", None
    elif kind == "maximum":
        yield path, f"{_shown(value)} is more than the maximum {error.validator_value}", None
    elif kind == "minLength":
        yield path, "must not be empty", None
    elif kind == "uniqueItems":
        yield path, "has duplicate entries", None
    elif kind == "pattern" and schema.get("x-size"):
        yield path, _size_message(value) or f"{_shown(value)} {_schema_message(error)}", None
    elif kind == "pattern":
        yield path, f"{_shown(value)} {_schema_message(error)}", None
    else:
        yield path, str(error.message), None


def _size_message(value: str) -> str | None:
    """Why the size pattern refused `value`, as parse_size says it ("128MB" is ambiguous)."""
    try:
        parse_size(value)
    except ValueError as exc:
        return str(exc)
    return None


def _schema_message(error: Any) -> str:
    message = error.schema.get("x-message")
    return str(message) if message else str(error.message)


def _type_words(types: str | list[str]) -> str:
    words = {
        "string": "a string",
        "integer": "an integer",
        "boolean": "true or false",
        "object": "a table",
        "array": "an array",
        "number": "a number",
    }
    names = [types] if isinstance(types, str) else types
    return " or ".join(words.get(name, name) for name in names)


_TOML_TYPES = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
               (dict, "a table"), (list, "an array"))  # bool first: it is an int to Python


def _toml_type(value: object) -> str:
    for kind, words in _TOML_TYPES:
        if isinstance(value, kind):
            return words
    return type(value).__name__  # dates and times


# --- meaning --------------------------------------------------------------------------------------


# The values the builder takes apart. The schema checks their shape first; these are matched whole
# (re.fullmatch: `$` would let a trailing newline through) so that nothing else reaches QEMU either way.
_MAC = re.compile(r"[0-9a-f]{2}(?::[0-9a-f]{2}){5}")
_MAC_PREFIX = re.compile(r"[0-9a-fA-F]{2}(?::[0-9a-fA-F]{2}){2}")
_PCI_ADDRESS = re.compile(r"(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[01][0-9a-fA-F]\.[0-7]")
_IPV4 = r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}"
_MCAST = re.compile(r"(?P<group>2(?:2[4-9]|3[0-9])(?:\.[0-9]{1,3}){3}):(?P<port>[0-9]{1,5})")
_HOSTFWD = re.compile(rf"(?:tcp|udp):(?P<host_addr>{_IPV4})?:(?P<host_port>[0-9]{{1,5}})"
                      rf"-(?P<guest_addr>{_IPV4})?:(?P<guest_port>[0-9]{{1,5}})")


def _is_ipv4(text: str) -> bool:
    return all(int(octet) <= 255 for octet in text.split("."))


def _is_port(text: str) -> bool:
    return 1 <= int(text) <= 65535


@functools.lru_cache(maxsize=1)
def _network_keys() -> frozenset[str]:
    """Every key some kind of network has (from the schema)."""
    import json

    defs = json.loads(SCHEMA_FILE.read_bytes())["$defs"]
    return frozenset(key for kind in ("bridgeNetwork", "userNetwork", "socketNetwork", "tapNetwork")
                     for key in defs[kind]["properties"])


def _format_from_name(file: str) -> DiskFormat:
    return DiskFormat.QCOW2 if file.lower().endswith(".qcow2") else DiskFormat.RAW


def _format_by_suffix(name: str) -> DiskFormat | None:
    """An image's format from its name when that says it; None: found from the file's first bytes
    (cloud images named .img are often qcow2)."""
    lowered = name.lower().split("?", 1)[0]
    return (DiskFormat.QCOW2 if lowered.endswith(".qcow2") else DiskFormat.RAW
            if lowered.endswith(".raw") else None)


class _Builder:
    """Builds the typed lab from a schema-checked document, adding semantic problems."""

    def __init__(
        self, doc: Doc, file: Path, source: SourceMap, problems: _Problems, invalid: list[KeyPath]
    ) -> None:
        self.doc = doc
        self.file = file
        self.base = file.parent
        self.source = source
        self.problems = problems
        self.invalid = invalid
        self.macs: dict[str, KeyPath] = {}
        self.named: list[Named] = []  # each file the spec names, for the checks of its files
        self.vm_images: dict[str, str] = {}
        self.catalog_entries: dict[str, Any] = {}  # image name -> its catalog Entry
        self.host_ports: dict[tuple[str, str, int], KeyPath] = {}
        self.writable_images: dict[Path, KeyPath] = {}
        self.pci_hosts: dict[str, KeyPath] = {}

    def is_valid(self, path: KeyPath) -> bool:
        """True when the schema found nothing wrong at or below `path`."""
        return not any(bad[: len(path)] == path for bad in self.invalid)

    def value(self, path: KeyPath, raw: Doc, key: str, default: Any = None) -> Any:
        """raw[key] when the schema found nothing wrong with it, else `default`: each key is checked on
        its own, so a mistake in one key of a table never hides a mistake in another."""
        return raw[key] if key in raw and self.is_valid((*path, key)) else default

    def table(self, path: KeyPath) -> Doc:
        node: Any = self.doc
        for key in path:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        return node if isinstance(node, dict) else {}

    @staticmethod
    def tables(raw: Doc, key: str) -> list[Doc]:
        """The array of tables `raw[key]`; nothing when it is not one (the schema said so already,
        at the array, which `is_valid` of an element does not see)."""
        items = raw.get(key, [])
        return [item if isinstance(item, dict) else {} for item in items] if isinstance(items, list) else []

    def build(self) -> LabSpec:
        lab = self.table(("lab",))
        lab_ok = self.is_valid(("lab",))
        name = str(lab.get("name", "lab")) if lab_ok else "lab"
        prefix = str(lab.get("mac_prefix", DEFAULT_MAC_PREFIX)) if lab_ok else DEFAULT_MAC_PREFIX
        if _MAC_PREFIX.fullmatch(prefix) is None:  # the schema's pattern refused it already
            self.problems.add(("lab", "mac_prefix"), f"{_shown(prefix)} is not three octets like 52:54:00")
            prefix = DEFAULT_MAC_PREFIX
        elif is_multicast_mac(prefix):
            self.problems.add(("lab", "mac_prefix"), f"{prefix!r} is a multicast prefix",
                              "the first octet must be even, e.g. 52:54:00")
        self.lab_name, self.mac_prefix = name, prefix
        images = tuple(self.images())
        self.image_names = {image.name for image in images}
        self.broken_images = {key for key in self.table(("image",)) if key not in self.image_names}
        self.subnets: dict[str, Any] = {}  # network -> its IPv4Network, for NIC addresses
        self.wanted: list[Any] = []  # addresses.Wanted of every NIC, for `assign` once all are known
        networks = tuple(self.networks())
        known = {net.name for net in networks}
        self.forwarding: dict[str, KeyPath] = {
            net.name: () for net in networks if isinstance(net, UserNetwork) and net.forward}
        self.forwarding_or_user = {net.name for net in networks if isinstance(net, UserNetwork)}
        self.socket_networks = {net.name for net in networks if isinstance(net, SocketNetwork)}
        broken = {key for key in self.table(("network",)) if key not in known}
        vms = self.with_addresses(tuple(self.vms(known, broken)))
        memory = self.lab_memory(vms)
        placement = self.lab_placement(vms)
        boot_parallel = self.value(("lab",), lab, "boot_parallel") if lab_ok else None
        hosts = tuple(self.hosts())
        if self.table(("host",)):  # on libvirt hosts, `ssh` reaches a VM through its host: no forward here
            vms = tuple(vm if "ssh" in self.table(("vm", vm.name)) else attrs.evolve(vm, ssh=False)
                        for vm in vms)
        self.check_hosts(hosts, vms, networks)
        return LabSpec(name=name, file=self.file, source=self.source, networks=networks, vms=vms,
                       mac_prefix=prefix.lower(), images=images, memory=memory, placement=placement,
                       boot_parallel=boot_parallel, hosts=hosts)

    def hosts(self) -> Iterator[HostSpec]:
        """`[host.NAME]`: libvirt hosts (spec/hosts.py reads their URIs)."""
        from vmlaunch.spec.hosts import BadUri, is_ip, parse_uri

        tunnels: dict[str, KeyPath] = {}
        uris: dict[str, str] = {}
        for host_name, raw in self.table(("host",)).items():
            path: KeyPath = ("host", host_name)
            if not self.is_valid(path):
                continue
            try:
                uri = parse_uri(raw["uri"])
            except BadUri as exc:
                self.problems.add((*path, "uri"), f"{_shown(raw['uri'])} is not a libvirt URI: {exc}",
                                  "for example qemu:///system, or qemu+ssh://root@host/system")
                continue
            address = raw.get("address")
            if address is not None and not is_ip(address):
                self.problems.add((*path, "address"), f"{_shown(address)} is not an IP address",
                                  "the host's address on the network that carries the lab's tunnels")
                continue
            if raw["uri"] in uris:
                self.problems.add((*path, "uri"), f"host {host_name} has the URI of host {uris[raw['uri']]}",
                                  "each host of the lab is another libvirtd")
                continue
            uris[raw["uri"]] = host_name
            tunnel = address or uri.hostname
            if tunnel and tunnel in tunnels:
                self.problems.add((*path, "address" if address else "uri"), f"host {host_name} has the "
                                  f"address {tunnel} of host {tunnels[tunnel][1]} too",
                                  "each host of the lab is another machine")
                continue
            if tunnel:
                tunnels[tunnel] = path
            yield HostSpec(name=host_name, uri=raw["uri"], address=address)

    def check_hosts(self, hosts: tuple[HostSpec, ...], vms: tuple[VmSpec, ...],
                    networks: tuple[Network, ...]) -> None:
        """What a lab on libvirt hosts cannot have, and VMs pinned to hosts that are not there."""
        from vmlaunch.spec.hosts import parse_uri, tunnel_address

        declared = set(self.table(("host",)))
        known = {host.name for host in hosts}
        for vm in vms:
            if vm.host is None:
                continue
            if not declared:
                self.problems.add(("vm", vm.name, "host"), f"host {_shown(vm.host)} is not a [host.NAME] "
                                  "of this lab", "add [host.NAME] with uri = \"qemu+ssh://...\"")
            elif vm.host not in known and vm.host not in declared:
                self.problems.add(("vm", vm.name, "host"), f"no [host.{vm.host}] in this lab",
                                  f"hosts: {', '.join(sorted(declared))}")
        if not hosts:
            return
        for vm in vms:
            path: KeyPath = ("vm", vm.name)
            if vm.pci and vm.host is None:
                self.problems.add((*path, "pci"), "PCI pass-through is a device of one host: a VM of a "
                                  "lab on libvirt hosts with one needs its host = \"NAME\"")
            for key in ("numa_node", "cpu_pinning"):
                if getattr(vm, key) not in (None, ()) and vm.host is None:
                    self.problems.add((*path, key), f"{key} names a NUMA node or CPUs of one host: a VM of a "
                                      "lab on libvirt hosts with it needs its host = \"NAME\"")
            if vm.shares:
                self.problems.add((*path, "share"), "a VM on a libvirt host has no shares: the folder "
                                  "would have to be on that host", "copy files in with a cloud-init "
                                  "write_files, or over `vmlaunch ssh`")
            if vm.ssh:
                self.problems.add((*path, "ssh"), "a VM on a libvirt host is reached over a lab network "
                                  "(`vmlaunch ssh` jumps through its host): ssh = true's forwarded port "
                                  "is this machine's", "give it a NIC on a bridge network with a subnet")
        for net in networks:
            path = ("network", net.name)
            if not isinstance(net, (BridgeNetwork, UserNetwork)):
                self.problems.add((*path, "type"), f"a lab on libvirt hosts has bridge and user networks, "
                                  f"not {net.type.value} networks")
            elif isinstance(net, UserNetwork) and net.forward:
                self.problems.add((*path, "forward"), "libvirt's user network has no port forwards",
                                  "reach the VMs over a bridge network (`vmlaunch ssh` jumps through "
                                  "the VM's host)")
            elif isinstance(net, BridgeNetwork):
                for key in ("uplink", "up_script", "down_script"):
                    if getattr(net, key) is not None:
                        self.problems.add((*path, key), f"{key} is a set-up of this machine: a lab on "
                                          "libvirt hosts makes its bridges on them, joined by VXLAN")
                pinned = {vm.host for vm in vms if vm.host is not None
                          and any(nic.network == net.name for nic in vm.nics)}
                by_name = {host.name: host for host in hosts}
                if len(pinned) > 1:
                    for name in sorted(pinned):
                        host = by_name.get(name)
                        if host is None:
                            continue
                        uri = parse_uri(host.uri)
                        if not uri.shell:
                            self.problems.add(("host", name, "uri"), f"network {net.name} spans hosts "
                                              f"{', '.join(sorted(pinned))}: its VXLAN link is set up on "
                                              f"each host over SSH, and host {name} is reached over "
                                              f"{uri.transport}", "reach it with qemu+ssh://, or keep the "
                                              "network's VMs on one host")
                        elif tunnel_address(host) is None:
                            self.problems.add(("host", name), f"network {net.name} spans hosts: host "
                                              f"{name} needs its address on the network between them",
                                              "add address = \"192.0.2.10\"")

    def images(self) -> Iterator[Image]:
        for image_name, raw in self.table(("image",)).items():
            path: KeyPath = ("image", image_name)
            if not self.is_valid(path):
                continue
            sources = [key for key in ("url", "file", "catalog") if key in raw]
            if len(sources) != 1:
                self.problems.add(path, "an image needs url = \"...\", file = \"...\" or catalog = \"...\""
                                  if not sources else f"an image has one of url, file and catalog, not "
                                  f"{' and '.join(sources)}",
                                  "`vmlaunch image catalog` lists the images catalog can name"
                                  if not sources else None)
                continue
            if "version" in raw and "catalog" not in raw:
                self.problems.add((*path, "version"), "version names a build of a catalog image",
                                  "add catalog = \"...\", or leave version out")
                continue
            if "catalog" in raw:
                image = self.catalog_image(path, raw)
                if image is not None:
                    yield image
                continue
            if "url" in raw and "sha256" not in raw and "sha512" not in raw:
                self.problems.add((*path, "url"), "a downloaded image needs a checksum",
                                  "add sha512 = \"...\" or sha256 = \"...\" (the distro publishes "
                                  "them beside the image, e.g. SHA512SUMS)")
                continue
            url = raw.get("url")
            if url is not None and url.startswith("file://"):
                from urllib.parse import unquote, urlsplit

                parts = urlsplit(url)
                if parts.netloc not in ("", "localhost") or not parts.path:
                    self.problems.add((*path, "url"), f"{_shown(url)}: a file:// URL names a path on "
                                      "this host, like file:///srv/images/debian.qcow2")
                    continue
                if "\0" in unquote(parts.path):
                    self.problems.add((*path, "url"), f"{_shown(url)} holds a NUL")
                    continue
            given = raw.get("file")
            if given is not None:
                self.named.append(Named((*path, "file"), self.base / os.path.expanduser(given)))
            fmt = DiskFormat(raw["format"]) if "format" in raw else _format_by_suffix(url or given or "")
            yield Image(name=image_name, url=url, file=self.path_of(given), format=fmt,
                        sha256=raw["sha256"].lower() if "sha256" in raw else None,
                        sha512=raw["sha512"].lower() if "sha512" in raw else None)

    def catalog_image(self, path: KeyPath, raw: Doc) -> Image | None:
        """An image of the catalog: known there, with no checksum of its own (its distribution's is
        read and pinned in SPEC.lock at `image pull`)."""
        from vmlaunch.layout.labdir import lock_file
        from vmlaunch.spec import catalog

        name = raw["catalog"]
        entry = catalog.entries().get(name)
        if entry is None:
            near = catalog.closest(name)
            self.problems.add((*path, "catalog"), f"{_shown(name)} is not in the image catalog",
                              (f"did you mean {' or '.join(near)}? " if near else "")
                              + "`vmlaunch image catalog` lists the images")
            return None
        arch = catalog.host_arch()
        if arch not in entry.builds:
            self.problems.add((*path, "catalog"), f"{name} has no {arch} build",
                              f"{name} is built for {', '.join(sorted(entry.builds))}")
            return None
        for key in ("sha256", "sha512"):
            if key in raw:
                self.problems.add((*path, key), "a catalog image's checksum is its distribution's, read "
                                  "from the checksum file they publish and pinned in the lock file beside "
                                  "the spec", f"leave {key} out (or give url and {key} instead of catalog)")
                return None
        self.catalog_entries[str(path[-1])] = entry
        url, _ = entry.locations(raw.get("version"), arch)
        fmt = DiskFormat(raw["format"]) if "format" in raw else (
            DiskFormat(entry.format) if entry.format else _format_by_suffix(url))
        return Image(name=str(path[-1]), catalog=name, version=raw.get("version"), format=fmt,
                     lock=lock_file(self.file))

    def with_addresses(self, vms: tuple[VmSpec, ...]) -> tuple[VmSpec, ...]:
        """Each NIC's static address: given (checked against its network) or derived from the subnet."""
        from vmlaunch.spec.addresses import assign

        addresses, problems = assign(self.wanted)
        for where, message, hint in problems:
            self.problems.add(where, message, hint)
        if not addresses:
            return vms
        return tuple(attrs.evolve(vm, nics=tuple(
            attrs.evolve(nic, ip=addresses.get(("vm", vm.name, "nic", index), nic.ip))
            for index, nic in enumerate(vm.nics))) for vm in vms)

    def networks(self) -> Iterator[Network]:
        bridges: dict[str, KeyPath] = {}
        uplinks: dict[tuple[str, int | None], KeyPath] = {}
        for net_name, raw in self.table(("network",)).items():
            path: KeyPath = ("network", net_name)
            if not self.is_valid(path):
                if isinstance(raw, dict) and not self.is_valid((*path, "type")):
                    self.unknown_network_keys(path, raw)  # no kind's checks ran: say what no kind has
                continue
            if raw.get("type") == "user":
                forward = tuple(raw.get("forward", ()))
                bad = [self.forward_problem((*path, "forward", i), rule) or
                       self.forwarded_twice((*path, "forward", i), rule) for i, rule in enumerate(forward)]
                if not any(bad):
                    yield UserNetwork(name=net_name, forward=forward)
                continue
            if raw.get("type") == "socket":
                mcast = raw.get("mcast", derive_mcast(self.lab_name, net_name))
                found = _MCAST.fullmatch(mcast)
                if found is None or not _is_ipv4(found["group"]) or not _is_port(found["port"]):
                    self.problems.add((*path, "mcast"), f"{_shown(mcast)} is not a valid group:port",
                                      "a multicast group 224.0.0.0-239.255.255.255, a port 1-65535")
                    continue
                yield SocketNetwork(name=net_name, group=found["group"], port=int(found["port"]),
                                    subnet=self.subnet(path, raw))
                continue
            scripts = self.scripts(path, raw)
            if raw.get("type") == "tap":
                if scripts is None:
                    continue
                up_script, down_script = scripts
                if up_script is None:
                    if "up_script" in raw:
                        continue  # the schema said what is wrong with it
                    self.problems.add(path, "a tap network without up_script: nothing would wire its "
                                      "taps, so its VMs would reach nothing",
                                      'add up_script = "./ifup" to put each tap where it belongs, or '
                                      'leave type out for a bridge vmlaunch makes')
                    continue
                yield TapNetwork(name=net_name, up_script=up_script, down_script=down_script,
                                 mtu=raw.get("mtu"), subnet=self.subnet(path, raw))
                continue
            bridge_path = (*path, "bridge") if "bridge" in raw else path
            bridge = raw.get("bridge") or default_bridge_name(self.lab_name, net_name)
            problem = interface_name_problem(bridge)
            if problem:
                hint = None if "bridge" in raw else 'name it with bridge = "..."'
                self.problems.add(bridge_path, f"bridge {problem}", hint)
            elif bridge in bridges:
                first = bridges[bridge][1]
                self.problems.add(bridge_path, f"bridge {bridge!r} is also network {first!r}'s",
                                  "two networks of one lab cannot share a bridge")
            bridges.setdefault(bridge, path)
            uplink, vlan = self.uplink(path, raw, uplinks)
            if scripts is None:
                continue
            yield BridgeNetwork(name=net_name, bridge=bridge, mtu=raw.get("mtu"), uplink=uplink,
                                subnet=self.subnet(path, raw), vlan=vlan, up_script=scripts[0],
                                down_script=scripts[1])

    def uplink(self, path: KeyPath, raw: Doc,
               uplinks: dict[tuple[str, int | None], KeyPath]) -> tuple[str | None, int | None]:
        """The bridge's uplink and its VLAN. An interface (or one VLAN of it) can be a port of one
        bridge only, so two networks of a lab cannot share one."""
        uplink, vlan = raw.get("uplink"), raw.get("vlan")
        if vlan is not None and uplink is None:
            self.problems.add((*path, "vlan"), f"vlan = {vlan} tags the traffic of an uplink, and "
                              "the network has none", 'add uplink = "eth1": the interface that carries '
                              f"VLAN {vlan}")
            return None, None
        if uplink is None:
            return None, None
        problem = interface_name_problem(uplink)
        if problem:
            self.problems.add((*path, "uplink"), f"uplink {problem}")
            return None, None
        first = uplinks.setdefault((uplink, vlan), path)
        if first != path:
            what = f"VLAN {vlan} of {uplink}" if vlan is not None else f"uplink {uplink!r}"
            self.problems.add((*path, "vlan" if vlan is not None else "uplink"),
                              f"{what} is also network {first[-1]!r}'s", "an interface is a port of "
                              "one bridge only: put both networks' VMs on one network")
            return None, None
        return uplink, vlan

    def scripts(self, path: KeyPath, raw: Doc) -> tuple[Path | None, Path | None] | None:
        """A network's up_script and down_script (absolute), noted for the file checks; None when
        they do not go together (the problem is reported)."""
        found: dict[str, Path] = {}
        for key in ("up_script", "down_script"):
            value = self.value(path, raw, key)
            if value is not None:
                found[key] = self.base / os.path.expanduser(value)
                self.named.append(Named((*path, key), found[key], "script"))
        if "down_script" in found and "up_script" not in found:
            self.problems.add((*path, "down_script"), "a down_script runs for each up_script that ran, "
                              "and the network has no up_script", "add the up_script it undoes, or "
                              "remove down_script")
            return None
        return found.get("up_script"), found.get("down_script")

    def subnet(self, path: KeyPath, raw: Doc) -> str | None:
        from vmlaunch.spec.addresses import parse_subnet

        if "subnet" not in raw:
            return None
        network, problem = parse_subnet(raw["subnet"])
        if network is None:
            self.problems.add((*path, "subnet"), problem or "not an IPv4 network")
            return None
        self.subnets[str(path[-1])] = network
        return str(network)

    def forwarded_twice(self, path: KeyPath, rule: str) -> bool:
        """A host port can be forwarded once (per protocol): QEMU fails at `up` on the second."""
        found = _HOSTFWD.fullmatch(rule)
        assert found is not None  # forward_problem checked it
        proto, address, port = rule.split(":", 1)[0], found["host_addr"] or "", int(found["host_port"])
        for (other_proto, other_address, other_port), first in self.host_ports.items():
            if (other_proto, other_port) == (proto, port) and (
                    address == other_address or "" in (address, other_address)):
                self.problems.add(path, f"{proto} host port {port} is also forwarded at "
                                  f"{format_key_path(first)}", "each forward needs its own host port")
                return True
        self.host_ports[(proto, address, port)] = path
        return False

    def unknown_network_keys(self, path: KeyPath, raw: Doc) -> None:
        import difflib

        known = _network_keys()
        for key in raw:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
                self.problems.add((*path, key), f"unknown key {_shown(key)}", hint)

    def forward_problem(self, path: KeyPath, rule: str) -> bool:
        """Adds a problem and returns True when a hostfwd rule is impossible (port 99999, 300.1.1.1)."""
        found = _HOSTFWD.fullmatch(rule)
        if found is None:  # the schema's pattern refused it already, unless it changed
            self.problems.add(path, f"{_shown(rule)} is not a port forward like \"tcp:127.0.0.1:2222-:22\"")
            return True
        for side in ("host", "guest"):
            address, port = found[f"{side}_addr"], found[f"{side}_port"]
            if address and not _is_ipv4(address):
                self.problems.add(path, f"{_shown(rule)}: {address} is not an IPv4 address")
                return True
            if not _is_port(port):
                self.problems.add(path, f"{_shown(rule)}: {side} port {int(port)} is not 1-65535")
                return True
        return False

    def vms(self, networks: set[str], broken: set[str]) -> Iterator[VmSpec]:
        for vm_name in self.table(("vm",)):
            path: KeyPath = ("vm", vm_name)
            vm = self.vm(path, vm_name, networks, broken)
            if vm is not None:
                yield vm

    def vm(self, path: KeyPath, name: str, networks: set[str], broken: set[str]) -> VmSpec | None:
        raw = self.table(path)
        disks = tuple(self.disks(path, self.tables(raw, "disk")))
        self.hangs_and_pauses(path, disks)
        nics = tuple(self.nics(path, name, self.tables(raw, "nic"), networks, broken,
                               agent_off=raw.get("agent") is False))
        pci = tuple(self.pci(path, self.tables(raw, "pci")))
        queries = [key for key in ("machine", "cpu_model")
                   if self.is_valid((*path, key)) and self.is_qemu_query((*path, key), raw.get(key))]
        # Each key on its own: a mistake in one never hides a mistake in another.
        memory = (self.memory_mib((*path, "memory"), raw["memory"])
                  if self.value(path, raw, "memory") is not None else None)
        kernel = self.path_of(self.value(path, raw, "kernel"))
        self.name_files(path, raw)
        for key in ("initrd", "append", "fast_boot"):
            if key in raw and "kernel" not in raw:
                self.problems.add((*path, key), f"{key} needs kernel", "add kernel = \"...\"")
        if not raw.get("kernel") and not raw.get("disk") and not raw.get("image"):
            self.problems.add(path, "nothing to boot", "add image = \"...\", kernel = \"...\" or a [[disk]]")
        sata_ok = self.sata_fits(path, raw, disks)
        guest = self.guest(path, raw)
        if not self.is_valid(path) or queries or memory is None or not sata_ok:
            return None  # the schema or a check above said why
        keys = ("cpus", "cpu_model", "machine", "append", "fast_boot", "numa_node", "agent", "host",
                "template")
        given: dict[str, Any] = {key: raw[key] for key in keys if key in raw}
        if "cpu_pinning" in raw:
            given["cpu_pinning"] = tuple(raw["cpu_pinning"])
        if "accel" in raw:
            given["accel"] = Accel(raw["accel"])
        if "video" in raw:
            given["video"] = Video(raw["video"])
        if "initrd" in raw:
            given["initrd"] = self.path_of(raw["initrd"])
        given.update(guest)
        balloon = self.balloon(path, raw, memory)
        hugepages = self.hugepages(path, raw, memory)
        if balloon is None or hugepages is None:
            return None
        return VmSpec(name=name, memory_mib=memory or 1, kernel=kernel, disks=disks, nics=nics, pci=pci,
                      balloon=balloon, **hugepages, **given)

    def balloon(self, vm_path: KeyPath, raw: Doc, memory_mib: int) -> Balloon | None:
        path = (*vm_path, "balloon")
        table = dict(self.table(path)) if "balloon" in raw else {}
        switches = ("enabled", "deflate_on_oom", "free_page_reporting")
        given: dict[str, Any] = {key: table[key] for key in switches if key in table}
        ok = True
        if "policy" in table:
            given["policy"] = BalloonPolicy(table["policy"])
        if "min" in table:
            least = self.memory_mib((*path, "min"), table["min"], floor=False)
            if least is None:
                ok = False
            elif least > memory_mib:
                self.problems.add((*path, "min"), f"{format_size(least << 20)} is above the VM's memory "
                                  f"({format_size(memory_mib << 20)})", "min is the least the guest keeps")
                ok = False
            else:
                given["min_mib"] = least
        if given.get("policy") is BalloonPolicy.AUTO:
            # The manager grows a short guest within a round or two; a burst of allocations faster than
            # that takes pages back from the balloon (the guest's OOM notifier) instead of killing.
            given.setdefault("deflate_on_oom", True)
            if given.get("enabled") is False:
                self.problems.add((*path, "policy"), "policy = \"auto\" needs the balloon",
                                  "remove enabled = false, or use policy = \"manual\"")
                ok = False
            if raw.get("hugepages"):
                self.problems.add((*path, "policy"), "a VM on hugepages cannot give memory back through "
                                  "its balloon (the host frees whole hugepages only)",
                                  "use policy = \"manual\", or leave hugepages out")
                ok = False
        return Balloon(**given) if ok else None

    def hugepages(self, path: KeyPath, raw: Doc, memory_mib: int) -> dict[str, Any] | None:
        if "hugepages" not in raw:
            if raw.get("reserve_hugepages"):
                self.problems.add((*path, "reserve_hugepages"), "reserve_hugepages needs hugepages",
                                  "add hugepages = \"2M\" (or \"1G\")")
                return None
            return {}
        size = HugepageSize(raw["hugepages"])
        if (memory_mib << 10) % size.kib:
            self.problems.add((*path, "memory"), f"{format_size(memory_mib << 20)} is not a whole number "
                              f"of {size.value} hugepages", f"make memory a multiple of {size.value}")
            return None
        return {"hugepages": size, "reserve_hugepages": bool(raw.get("reserve_hugepages", False))}

    def lab_memory(self, vms: tuple[VmSpec, ...]) -> LabMemory:
        path: KeyPath = ("lab", "memory")
        table = self.table(path)
        if not table or not self.is_valid(path):
            return LabMemory()
        given: dict[str, Any] = {key: table[key] for key in ("ksm", "ksm_pages_to_scan", "ksm_sleep_ms")
                                 if key in table}
        rates = [key for key in ("ksm_pages_to_scan", "ksm_sleep_ms") if key in table]
        if rates and table.get("ksm") is False:
            self.problems.add((*path, rates[0]), f"{rates[0]} sets KSM's rate, and ksm = false turns it off",
                              "remove one of them")
        elif rates:
            given["ksm"] = True  # a rate asks for KSM
        if "budget" in table:
            budget = self.memory_mib((*path, "budget"), table["budget"], floor=False, most=None)
            if budget is not None:
                given["budget_mib"] = budget
                floors = sum(balloon_min_mib(vm) if vm.balloon.policy is BalloonPolicy.AUTO else vm.memory_mib
                             for vm in vms)
                per_host = bool(self.table(("host",)))  # on libvirt hosts the budget holds per host
                if vms and floors > budget and not per_host:
                    self.problems.add((*path, "budget"), f"{format_size(budget << 20)} is below what the VMs "
                                      f"keep at least ({format_size(floors << 20)}: the balloon.min of VMs "
                                      "with policy = \"auto\", the memory of the others)",
                                      "raise the budget, or lower the VMs' balloon.min")
        return LabMemory(**given)

    def lab_placement(self, vms: tuple[VmSpec, ...]) -> LabPlacement:
        """`[lab.placement]`; what depends on the host (nodes, CPUs) is checked by the compiler."""
        path: KeyPath = ("lab", "placement")
        table = self.table(path)
        if not table or not self.is_valid(path):
            return LabPlacement()
        given: dict[str, Any] = {}
        if "policy" in table:
            given["policy"] = PlacementPolicy(table["policy"])
        if "balance" in table:
            given["balance"] = table["balance"]
            if table["balance"] and given.get("policy") is PlacementPolicy.NONE:
                self.problems.add((*path, "balance"), "balance = true moves VMs that placement put on a "
                                  "node, and policy = \"none\" places none", "remove one of them")
        if "interval" in table:
            try:
                given["interval_s"] = parse_duration(table["interval"])
            except ValueError as exc:
                self.problems.add((*path, "interval"), str(exc))
        if given.get("policy") is PlacementPolicy.NONE:
            for vm in vms:
                if vm.numa_node is not None:
                    self.problems.add(("vm", vm.name, "numa_node"), "numa_node places the VM, and "
                                      "lab.placement.policy = \"none\" asks for no placement",
                                      "remove one of them")
        return LabPlacement(**given)

    def name_files(self, path: KeyPath, raw: Doc) -> None:
        """Note each file this VM's table names (where the key itself is right), for `files=True`."""
        for key in ("kernel", "initrd"):
            value = self.value(path, raw, key)
            if value is not None:
                self.named.append(Named((*path, key), self.base / os.path.expanduser(value)))
        image = self.value(path, raw, "image")
        if image is not None:
            self.vm_images[str(path[-1])] = image
        seed = raw.get("cloud_init")
        if isinstance(seed, dict) and self.value((*path, "cloud_init"), seed, "user_data") is not None:
            self.named.append(Named((*path, "cloud_init", "user_data"),
                                    self.base / os.path.expanduser(seed["user_data"])))
        for index, share in enumerate(self.tables(raw, "share")):
            where = (*path, "share", index)
            if self.value(where, share, "source") is not None:
                self.named.append(Named((*where, "source"),
                                        self.base / os.path.expanduser(share["source"]), "folder"))

    def catalog_needs(self, path: KeyPath, raw: Doc, entry: Any, given: dict[str, Any]) -> None:
        """What a catalog image needs of its VM: UEFI firmware by default where it boots only so (said
        where the spec asks for BIOS), cpu_model "max" by default for an x86-64-v3 image (vmlaunch's
        own default under TCG is v2), and no CPU model older than it runs on."""
        from vmlaunch.spec.catalog import BASE_CPU_MODELS

        if entry.firmware == "uefi":
            if "firmware" not in raw:
                given["firmware"] = Firmware.UEFI
            elif given.get("firmware") is not Firmware.UEFI:
                self.problems.add((*path, "firmware"), f"image {raw['image']} ({entry.name}) boots only with "
                                  "UEFI firmware", "set firmware = \"uefi\", or leave firmware out")
        model = raw.get("cpu_model")
        if entry.cpu_model and "cpu_model" not in raw:
            given["cpu_model"] = entry.cpu_model
        if entry.cpu_level and isinstance(model, str) and model in BASE_CPU_MODELS:
            self.problems.add((*path, "cpu_model"), f"image {raw['image']} ({entry.name}) needs a "
                              f"{entry.cpu_level or 'newer'} CPU, which {model!r} is not",
                              "leave cpu_model out (\"host\" under KVM, \"max\" under TCG), or set \"max\"")

    def guest(self, path: KeyPath, raw: Doc) -> dict[str, Any]:
        """The keys of a real guest: its image, firmware, cloud-init seed, shares and SSH."""
        given: dict[str, Any] = {}
        image = self.value(path, raw, "image")
        if image is not None:
            if image not in self.image_names and image not in self.broken_images:
                known = ", ".join(sorted(self.image_names)) or "none defined"
                self.problems.add((*path, "image"), f"no image named {image!r}", f"images: {known}")
            given["image"] = image
        if self.value(path, raw, "disk_size") is not None:
            if "image" not in raw:
                self.problems.add((*path, "disk_size"), "disk_size sizes the overlay of an image",
                                  "add image = \"...\", or give a [[disk]] its size")
            size = self.disk_bytes((*path, "disk_size"), raw["disk_size"])
            if size is not None:
                given["disk_size"] = size
        if self.value(path, raw, "firmware") is not None:
            given["firmware"] = Firmware(raw["firmware"])
        entry = self.catalog_entries.get(image) if image is not None else None
        if entry is not None:
            self.catalog_needs(path, raw, entry, given)
        shares = tuple(self.shares(path, self.tables(raw, "share")))
        if shares:
            given["shares"] = shares
        ssh = bool(self.value(path, raw, "ssh", "image" in raw or "cloud_init" in raw))
        given["ssh"] = ssh
        if ssh:
            mgmt = management_mac(self.mac_prefix, self.lab_name, str(path[-1]))
            if mgmt in self.macs:
                self.problems.add(self.macs[mgmt], f"MAC {mgmt} is also the SSH NIC's of vm.{path[-1]}",
                                  "set mac = \"...\"")
        if "image" in raw or "cloud_init" in raw or ssh:
            seed_path = (*path, "cloud_init")
            seed = raw.get("cloud_init") if isinstance(raw.get("cloud_init"), dict) else {}
            assert isinstance(seed, dict)
            extra: dict[str, Any] = {key: tuple(seed[key]) for key in ("packages", "runcmd")
                                     if self.value(seed_path, seed, key) is not None}
            if self.value(seed_path, seed, "user") is not None:
                extra["user"] = seed["user"]
                if seed["user"] == "root":
                    self.problems.add((*path, "cloud_init", "user"), "the SSH user is made with "
                                      "passwordless sudo; root is not such a user", "name another user")
            if self.value(seed_path, seed, "user_data") is not None:
                extra["user_data"] = self.path_of(seed["user_data"])
            given["cloud_init"] = CloudInit(**extra)
        return given

    def shares(self, vm_path: KeyPath, items: Iterable[Doc]) -> Iterator[Share]:
        targets: dict[str, KeyPath] = {}
        for index, raw in enumerate(items):
            path = (*vm_path, "share", index)
            if not self.is_valid(path):
                continue
            target = os.path.normpath(raw["target"])
            if target == "/":
                self.problems.add((*path, "target"), "a share cannot be mounted over /")
                continue
            if target in targets:
                self.problems.add((*path, "target"), f"{target} is also the target of "
                                  f"{format_key_path(targets[target])}")
                continue
            targets[target] = path
            source = self.path_of(raw["source"])
            assert source is not None
            yield Share(source=source, target=target, tag=f"share{index}",
                        readonly=bool(raw.get("readonly", False)))

    def is_qemu_query(self, path: KeyPath, value: object) -> bool:
        """machine = "help" (or "?", or help after a comma) would make QEMU list its machines and exit
        instead of starting the VM: report it, and return True."""
        if not isinstance(value, str):
            return False
        parts = [part.strip().lower() for part in value.split(",")]
        if not any(part in _QEMU_QUERIES or part.startswith("help=") for part in parts):
            return False
        what, option = ("machine types", "-machine") if path[-1] == "machine" else ("CPU models", "-cpu")
        self.problems.add(path, f"{_shown(value)} would make QEMU list its {what} and exit instead of "
                          "starting the VM", f"name one; `qemu-system-x86_64 {option} help` lists them")
        return True

    def sata_fits(self, path: KeyPath, raw: Doc, disks: tuple[Disk, ...]) -> bool:
        """SATA disks need a machine with a built-in AHCI controller, one disk per port."""
        sata = sum(disk.bus is DiskBus.SATA for disk in disks)
        if not sata:
            return True
        machine = self.value(path, raw, "machine", default_of(VmSpec, "machine"))
        ports = next((n for prefix, n in MACHINE_SATA_PORTS.items() if machine.startswith(prefix)), None)
        if ports is None:
            self.problems.add((*path, "machine"), "bus = \"sata\" disks need machine = \"q35\" "
                              "(its built-in AHCI controller)")
            return False
        if sata > ports:
            self.problems.add((*path, "disk"), f"at most {ports} sata disks (AHCI ports)")
            return False
        return True

    def path_of(self, value: str | None) -> Path | None:
        if value is None:
            return None
        # Absolute, so no spec value can look like an option ("-x", "help") or a protocol ("a:b").
        return self.base / os.path.expanduser(value)

    def memory_mib(self, path: KeyPath, value: str | int, *, floor: bool = True,
                   most: int | None = MAX_MEMORY) -> int | None:
        try:
            size = parse_size(value)
        except ValueError as exc:
            self.problems.add(path, str(exc))
            return None
        shown = bare_shown(value) or _shown(value)
        if size % (1 << 20):
            self.problems.add(path, f"{shown} is not a whole number of MiB")
            return None
        if floor and size < 16 << 20:
            self.problems.add(path, f"{shown} is too little memory; at least {spelled(16 << 20)}")
            return None
        if most is not None and size > most:
            self.problems.add(path, f"{shown} is more memory than a VM can have; at most {spelled(most)}")
            return None
        return size >> 20

    def disks(self, vm_path: KeyPath, items: Iterable[Doc]) -> Iterator[Disk]:
        for index, raw in enumerate(items):
            path = (*vm_path, "disk", index)
            disk = self.disk(path, raw)
            if disk is not None and self.is_valid(path):
                yield disk

    def disk(self, path: KeyPath, raw: Doc) -> Disk | None:
        ok = True
        size = None
        if self.value(path, raw, "size") is not None:
            size = self.disk_bytes((*path, "size"), raw["size"])
            ok = size is not None
        cache_value = self.value(path, raw, "cache")
        cache = CacheMode(cache_value) if cache_value is not None else default_of(Disk, "cache")
        if cache is CacheMode.UNSAFE and not self.value(path, raw, "accept_data_loss", False):
            self.problems.add((*path, "cache"), "cache = \"unsafe\" ignores flushes: a host crash "
                              "corrupts the image", "add accept_data_loss = true if that is fine")
            ok = False
        aio = Aio(raw["aio"]) if self.value(path, raw, "aio") is not None else None
        if aio is Aio.NATIVE and not cache.direct:
            self.problems.add((*path, "aio"), f"aio = \"native\" needs O_DIRECT, which cache = "
                              f"\"{cache.value}\" does not use", "use cache = \"none\" or "
                              "\"directsync\", or aio = \"io_uring\" or \"threads\"")
            ok = False
        file = self.path_of(self.value(path, raw, "file"))
        if file is None:
            return None  # the schema said why
        self.named.append(Named((*path, "file"), file, "disk",
                                writable=not self.value(path, raw, "readonly", False),
                                device_ok=bool(self.value(path, raw, "block_device", False)),
                                may_be_missing="size" in raw))
        readonly = bool(self.value(path, raw, "readonly", default_of(Disk, "readonly")))
        if not readonly:
            key = Path(os.path.normpath(file))
            first = self.writable_images.get(key)
            if first is not None:
                self.problems.add((*path, "file"), f"{raw['file']!r} is already a writable disk "
                                  f"at {format_key_path(first)}", "two writers corrupt an image; use "
                                  "readonly = true or a qcow2 overlay per VM")
                ok = False
            self.writable_images.setdefault(key, path)
        if not ok or not self.is_valid(path):
            return None
        given: dict[str, Any] = {key: raw[key] for key in ("discard", "block_device", "accept_other_owner")
                                 if key in raw}
        if "bus" in raw:
            given["bus"] = DiskBus(raw["bus"])
        on_error = raw.get("on_error", {})
        for operation, field in (("read", "read_error"), ("write", "write_error")):
            if operation in on_error:
                given[field] = OnError(on_error[operation])
        if readonly and "write" in on_error:
            self.problems.add((*path, "on_error", "write"), "a read-only disk has no writes to fail",
                              "leave on_error.write out, or readonly")
            return None
        faults = self.disk_faults(path, raw.get("fault") if self.is_valid((*path, "fault")) else None,
                                  readonly, size if size is not None and not file.exists() else None)
        if faults is None:
            return None
        if faults:
            given["faults"] = faults
        return Disk(
            file=file,
            format=DiskFormat(raw["format"]) if "format" in raw else _format_from_name(raw["file"]),
            size=size,
            cache=cache,
            aio=aio,
            readonly=readonly,
            **given,
        )

    def hangs_and_pauses(self, path: KeyPath, disks: Sequence[Disk]) -> None:
        """A hang and an error that pauses the VM are not set on one VM: QEMU pauses a VM only once
        every request is done, and would wait for the held one for ever (spec/diskfault.py)."""
        from vmlaunch.spec.diskfault import may_pause

        hang = next(((index, number) for index, disk in enumerate(disks)
                     for number, fault in enumerate(disk.faults) if fault.kind is FaultKind.HANG), None)
        pausing = [index for index, disk in enumerate(disks)
                   if any(may_pause(fault, disk.read_error, disk.write_error) for fault in disk.faults)]
        if hang is not None and pausing:
            self.problems.add((*path, "disk", hang[0], "fault", hang[1]),
                              f"a hang, and an error on disk[{pausing[0]}] that pauses the VM when it fires: "
                              "QEMU pauses a VM only once every request is done, and would wait for the "
                              "held one for ever", "give that disk on_error = \"report\", or drop one")

    def disk_faults(self, path: KeyPath, items: Any, readonly: bool,
                    size: int | None = None) -> tuple[DiskFault, ...] | None:
        """The disk's [[fault]]s (spec/diskfault.py parses them as the CLI's), None after a problem."""
        from vmlaunch.spec.diskfault import describe, mistaken_for, parse_fault, plural, replaces

        faults: list[DiskFault] = []
        ok = True
        for index, raw in enumerate(items or []):
            where = (*path, "fault", index)
            fault, problems = parse_fault(raw)
            for key, message, hint in problems:
                self.problems.add((*where, key) if key else where, message, hint or None)
            if fault is None:
                ok = False
                continue
            if readonly and fault.op in ("write", "flush"):
                verb = "hold" if fault.kind is FaultKind.HANG else "fail"
                self.problems.add((*where, "op"), f"a read-only disk has no {plural(fault.op)} to {verb}",
                                  "leave the fault out, or readonly")
                ok = False
            if size is not None and fault.sector is not None and fault.sector * 512 >= size:
                self.problems.add((*where, "sector"), f"sector {fault.sector} is past the end of the disk "
                                  f"({size // 512} sectors of 512 bytes: 0 to {size // 512 - 1})")
                ok = False
            kinds = [(old.kind, old.op) for old in faults]
            if fault.kind is FaultKind.HANG and (fault.kind, fault.op) in kinds:
                self.problems.add(where, f"a second hang of the {plural(fault.op)}", "one is enough")
                ok = False
            if fault.kind is FaultKind.SLOW and any(kind is FaultKind.SLOW for kind, _ in kinds):
                self.problems.add(where, "a second slow fault on the disk", "give bps, iops and "
                                  "latency in one")
                ok = False
            if fault.kind is FaultKind.ERROR and any(replaces(fault, old) for old in faults):
                at = f" at sector {fault.sector}" if fault.sector is not None else ""
                self.problems.add(where, f"a second error of the {plural(fault.op)}{at}", "one is enough")
                ok = False
            elif (other := mistaken_for(fault, faults)) is not None:
                self.problems.add(where, f"{describe(other)} fails the same requests with the same errno, "
                                  "and QEMU does not say which error failed a request, so vmlaunch could "
                                  "not tell when the once one fired", "give one of them another errno")
                ok = False
            faults.append(fault)
        return tuple(faults) if ok else None

    def disk_bytes(self, path: KeyPath, value: str | int) -> int | None:
        """A disk's size in bytes (whole 512-byte sectors, up to MAX_DISK_SIZE), or a problem. A bare
        number is MiB, as for every size; it meant bytes for a disk in earlier versions, so one that makes
        a disk of a TiB or more (1048576: any byte count from 1 MiB up) is refused, not taken."""
        try:
            size = parse_size(value)
        except ValueError as exc:
            self.problems.add(path, str(exc))
            return None
        bare = bare_shown(value)
        shown = bare or _shown(value)
        if bare is not None and size >= BARE_DISK_LIMIT:
            self.problems.add(path, f"{bare} would make a {format_size(size)} disk; a bare disk size meant "
                              "bytes in earlier vmlaunch versions, so one of 1T or more is refused",
                              f"{_as_bytes(value)}; " + (f"write a disk of 1T or more with a unit: "
                              f"\"{format_size(size)}\"" if size <= MAX_DISK_SIZE else
                              f"a disk image is at most {format_size(MAX_DISK_SIZE)}"))
            return None
        if size == 0 or size % 512:
            what = "no size" if size == 0 else "not a whole number of 512-byte sectors"
            self.problems.add(path, f"{shown} is {what}", "e.g. 64M or 20G")
            return None
        if size > MAX_DISK_SIZE:
            self.problems.add(path, f"{shown} is larger than a disk image can be; at most "
                              f"{spelled(MAX_DISK_SIZE)}")
            return None
        return size

    def nics(
        self, vm_path: KeyPath, vm: str, items: Iterable[Doc], networks: set[str], broken: set[str],
        *, agent_off: bool = False,
    ) -> Iterator[Nic]:
        for index, raw in enumerate(items):
            path = (*vm_path, "nic", index)
            mac = self.mac(path, raw.get("mac"), vm, index) if self.is_valid((*path, "mac")) else None
            network = self.value(path, raw, "network")
            if network is None:
                continue
            if network not in networks:
                if network not in broken:
                    known = ", ".join(sorted(networks)) or "none defined"
                    self.problems.add((*path, "network"), f"no network named {network!r}",
                                      f"networks: {known}")
                continue
            forwarded = self.forwarding.get(network)
            if forwarded is not None:
                if forwarded:
                    self.problems.add((*path, "network"), f"network {network!r} forwards host ports "
                                      f"and is already used at {format_key_path(forwarded)}",
                                      "a forwarded host port reaches one NIC: give each VM its own "
                                      "user network")
                self.forwarding[network] = path
            if not self.address_fits(path, raw, network) or not self.is_valid(path):
                continue
            given: dict[str, Any] = {k: raw[k] for k in ("queues", "gateway") if k in raw}
            if "dns" in raw:
                given["dns"] = tuple(raw["dns"])
            if "netem" in raw:
                netem = self.netem((*path, "netem"), raw["netem"], network, agent_off=agent_off)
                if netem is None:
                    continue
                given["netem"] = netem
            nic = Nic(network=network, mac=mac or "", model=NicModel(raw["model"]) if "model" in raw
                      else default_of(Nic, "model"), **given)
            if nic.queues > 1 and nic.model is not NicModel.VIRTIO:
                self.problems.add((*path, "queues"), "multi-queue needs model = \"virtio\"")
            if mac is not None:
                yield nic

    def netem(self, path: KeyPath, raw: Doc, network: str, *, agent_off: bool = False) -> Netem | None:
        """A NIC's `netem = { ... }`: every figure checked (spec/netem.py, the CLI's parser too);
        `where = "host"` needs a NIC with a host interface (a bridge or tap network's), netem in the
        guest (`where = "guest"`, or any on a network without a host side) the VM's command channel."""
        from vmlaunch.spec.netem import parse_netem

        netem, problems = parse_netem(raw, bare_ms=False)
        for key, message, hint in problems:
            self.problems.add((*path, key) if key else path, message, hint)
        if netem is None:
            return None
        if netem.where is NetemWhere.HOST and (network in self.forwarding_or_user
                                               or network in self.socket_networks):
            self.problems.add((*path, "where"), f"network {network!r} has no host interface to shape "
                              "(QEMU's user and socket networks)", 'use where = "guest" (or "auto")')
            return None
        no_host_side = network in self.forwarding_or_user or network in self.socket_networks
        if agent_off and (netem.where is NetemWhere.GUEST or no_host_side):
            self.problems.add(path, "netem in the guest is set through its command channel, and the VM has "
                              "agent = false", "turn the agent on" + ("" if no_host_side else
                                                                       ', or use where = "host"'))
            return None
        return netem

    def address_fits(self, path: KeyPath, raw: Doc, network: str) -> bool:
        """ip, gateway and dns are for networks whose addresses the guest sets itself (bridge, socket);
        QEMU's user network hands out its own by DHCP. Queues the NIC for `with_addresses`."""
        from vmlaunch.spec.addresses import Wanted

        keys = [key for key in ("ip", "gateway", "dns") if key in raw]
        if any(not self.is_valid((*path, key)) for key in keys):
            return False  # the schema said what is wrong
        if keys and network in self.forwarding_or_user:
            self.problems.add((*path, keys[0]), f"network {network!r} is QEMU's user network, which "
                              "gives its NICs addresses by DHCP (10.0.2.15)", f"remove {keys[0]}")
            return False
        addresses: list[tuple[KeyPath, str]] = [((*path, "dns", i), value)
                                                for i, value in enumerate(raw.get("dns", ()))]
        if "gateway" in raw:
            addresses.insert(0, ((*path, "gateway"), raw["gateway"]))
        for where, value in addresses:
            if not _is_ipv4(value):
                self.problems.add(where, f"{_shown(value)} is not an IPv4 address")
                return False
        if network not in self.forwarding_or_user:
            self.wanted.append(Wanted(path=path, network=network, subnet=self.subnets.get(network),
                                      ip=raw.get("ip"), seed=f"{self.lab_name}/{path[1]}/{path[-1]}"))
        return True

    def mac(self, path: KeyPath, explicit: str | None, vm: str, index: int) -> str | None:
        if explicit is not None:
            mac = explicit.lower()
            if _MAC.fullmatch(mac) is None:  # the schema's pattern refused it already
                self.problems.add((*path, "mac"), f"{_shown(explicit)} is not a MAC address")
                return None
            if is_multicast_mac(mac):
                self.problems.add((*path, "mac"), f"{explicit!r} is a multicast address",
                                  "the first octet must be even")
                return None
        else:
            mac = derive_mac(self.mac_prefix, self.lab_name, vm, index)
        first = self.macs.get(mac)
        if first is not None:
            where = (*path, "mac") if explicit else path
            self.problems.add(where, f"MAC {mac} is also used at {format_key_path(first)}",
                              "every NIC in a lab needs its own MAC; set mac = \"...\"")
            return None
        self.macs[mac] = path
        return mac

    def pci(self, vm_path: KeyPath, items: Iterable[Doc]) -> Iterator[PciDevice]:
        for index, raw in enumerate(items):
            path = (*vm_path, "pci", index)
            if not self.is_valid(path):
                continue
            if _PCI_ADDRESS.fullmatch(raw["host"]) is None:  # the schema's pattern refused it already
                self.problems.add((*path, "host"), f"{_shown(raw['host'])} is not a PCI address")
                continue
            host = normalise_pci_address(raw["host"])
            first = self.pci_hosts.get(host)
            if first is not None:
                self.problems.add((*path, "host"), f"PCI device {host} is already passed "
                                  f"through at {format_key_path(first)}")
                continue
            self.pci_hosts[host] = path
            yield PciDevice(host=host, **({"driver": PciDriver(raw["driver"])} if "driver" in raw else {}))
