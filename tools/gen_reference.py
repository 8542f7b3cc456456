#!/usr/bin/env python3
"""The reference pages, generated from the code so that they cannot drift from it.

    tools/gen_reference.py --write   write docs/reference/spec-keys.md and docs/reference/commands.md
    tools/gen_reference.py --check   exit 1, saying what differs, when the files on disk are not what
                                     --write would write (tests/test_reference.py checks the same)

spec-keys.md has every key of a lab spec, table by table, from the JSON schema (type, allowed values,
description, and the seed or manual section behind the rule: the schema's own `x-source` keyword) and
from the lab model, the one home of defaults (each key's default is the attrs default of the model
field it becomes; where the default is computed, or depends on another key, the schema's `x-default`
says how in words). commands.md has every command, sub-command, argument and option, from the argument
parser, read as the shell completion reads it (`completion.describe`).

Both are plain Markdown (MkDocs renders them), and depend on nothing but the code: no date, no terminal
width. Either refuses to be written while a key or a command has no description
(`keys_without_description`, `commands_without_help`).
"""

from __future__ import annotations

import argparse
import difflib
import enum
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:  # this checkout's vmlaunch, whatever the venv has installed
    sys.path.insert(0, str(ROOT))

# The vmlaunch internals read here, and nowhere else below: re-point these when modules move.
from vmlaunch.cli import build_parser  # noqa: E402
from vmlaunch.cli.completion import Command, Kind, Option, Value, describe  # noqa: E402
from vmlaunch.spec import model  # noqa: E402
from vmlaunch.spec.load import SCHEMA_FILE  # noqa: E402  (the schema the loader checks specs with)

SPEC_KEYS_PAGE = ROOT / "docs" / "reference" / "spec-keys.md"
COMMANDS_PAGE = ROOT / "docs" / "reference" / "commands.md"
REGENERATE = "run `make docs` (or `python tools/gen_reference.py --write`)"

# The model class each table of the schema becomes, by the table's place in the schema: the defaults
# of its attrs fields are the defaults of the table's keys.
MODELS: dict[str, type] = {
    "#/properties/lab": model.LabSpec,
    "#/properties/lab/properties/memory": model.LabMemory,
    "#/properties/lab/properties/placement": model.LabPlacement,
    "#/$defs/bridgeNetwork": model.BridgeNetwork,
    "#/$defs/userNetwork": model.UserNetwork,
    "#/$defs/socketNetwork": model.SocketNetwork,
    "#/$defs/tapNetwork": model.TapNetwork,
    "#/$defs/vm": model.VmSpec,
    "#/$defs/disk": model.Disk,
    "#/$defs/disk/properties/on_error": model.Disk,  # its keys are the disk's read_error and write_error
    "#/$defs/disk/properties/fault/items": model.DiskFault,
    "#/$defs/nic": model.Nic,
    "#/$defs/pci": model.PciDevice,
    "#/$defs/netem": model.Netem,
    "#/$defs/balloon": model.Balloon,
    "#/$defs/cloudInit": model.CloudInit,
    "#/$defs/share": model.Share,
    "#/$defs/image": model.Image,
    "#/$defs/host": model.HostSpec,
}
# Keys whose model field is named otherwise (a unit in the name, a plural). None: no one field holds
# the key, so its x-default says what it is.
FIELDS: dict[tuple[type, str], str | None] = {
    (model.LabMemory, "budget"): "budget_mib",
    (model.LabPlacement, "interval"): "interval_s",
    (model.VmSpec, "memory"): "memory_mib",
    (model.VmSpec, "disk"): "disks",
    (model.VmSpec, "nic"): "nics",
    (model.VmSpec, "share"): "shares",
    (model.Balloon, "min"): "min_mib",
    (model.SocketNetwork, "mcast"): None,  # split into group and port
    (model.Disk, "accept_data_loss"): None,
    (model.Disk, "on_error"): None,  # split into read_error and write_error
    (model.Disk, "read"): "read_error",
    (model.Disk, "write"): "write_error",
    (model.Disk, "fault"): "faults",
    (model.DiskFault, "type"): "kind",
    (model.DiskFault, "read"): None,  # op = "read" said another way
    (model.DiskFault, "write"): None,
    (model.DiskFault, "flush"): None,
    (model.DiskFault, "latency"): "latency_ms",
    (model.Netem, "delay"): "delay_ms",
    (model.Netem, "jitter"): "jitter_ms",
    (model.Netem, "rate"): "rate_bit",  # an opt-in the loader checks; the model keeps nothing of it
}
# The $defs that are a kind of value rather than a table: (what a key's type says, section title).
FORMATS = {"size": ("size", "Sizes"), "duration": ("duration", "Durations"), "name": ("name", "Names"),
           "ifname": ("interface name", "Interface names")}

Schema = dict[str, Any]


class ReferenceError(Exception):
    """The schema, the model or the parser cannot be documented as they are: what to change."""


# --- the spec keys ----------------------------------------------------------------------------------


@attrs.frozen
class ModelDefault:
    """Where a key's default lives: a field of a model class, and the default attrs gives it."""

    cls: type
    field: str | None  # None: no one field holds the key
    default: Any  # attrs.NOTHING: none (required, or found by the loader); else the attrs default


@attrs.frozen
class Key:
    path: str  # as the page names it: "vm.NAME.disk[].cache"
    description: str
    type: str
    allowed: tuple[str, ...]
    default: str | None  # as the page says it; None for a key that is a table
    sources: tuple[tuple[str, str], ...]  # (source id, where in it)
    opens: str | None = None  # the title of the table the key is, when it is one
    kinds: tuple[str, ...] = ()  # the kinds of network that have the key, when not every kind has it
    models: tuple[ModelDefault, ...] = ()  # one per model class the key goes into


@attrs.frozen
class Table:
    title: str  # "[[vm.NAME.disk]]"
    description: str
    keys: tuple[Key, ...]
    names: str | None = None  # what NAME may be, for a table of named tables
    kinds: tuple[tuple[str, str], ...] = ()  # a network's kinds: (type, what it is)


def load_schema(path: Path = SCHEMA_FILE) -> Schema:
    schema: Schema = json.loads(path.read_text())
    return schema


def _target(schema: Schema, node: Schema) -> tuple[str | None, Schema]:
    """The schema `node` refers to ($ref), and its pointer; `node` itself (None) when it refers to none."""
    ref = node.get("$ref")
    if ref is None:
        return None, node
    target: Any = schema
    for part in ref[len("#/"):].split("/"):
        target = target[part]
    return ref, target


def _merged(schema: Schema, node: Schema) -> Schema:
    """`node` with what it refers to: its own keywords win."""
    _, target = _target(schema, node)
    return {**target, **{key: value for key, value in node.items() if key != "$ref"}}


def _ref_name(node: Schema) -> str | None:
    ref = node.get("$ref")
    return str(ref).rsplit("/", 1)[-1] if ref else None


def spec_tables(schema: Schema) -> list[Table]:
    """Every table of the spec, the top level first, each followed by the tables it holds."""
    tables: list[Table] = []
    _add_table(schema, schema, "#", "", "top level", str(schema.get("description", "")), None, tables)
    return tables


def _add_table(schema: Schema, node: Schema, pointer: str, path: str, title: str, description: str,
               names: str | None, tables: list[Table]) -> None:
    if "allOf" in node:
        _add_network_table(schema, node, path, title, description, names, tables)
        return
    cls = MODELS.get(pointer)
    keys: list[Key] = []
    inner: list[tuple[Schema, str, str, str, str, str | None]] = []
    for name, prop in node.get("properties", {}).items():
        key_path = f"{path}.{name}" if path else name
        opened = _opens(schema, prop, f"{pointer}/properties/{name}", key_path)
        if opened is not None:
            table_node, table_pointer, table_path, table_title, table_names = opened
            keys.append(_key(schema, prop, key_path, name, cls, required=name in node.get("required", ()),
                             opens=table_title))
            inner.append((table_node, table_pointer, table_path, table_title,
                          str(table_node.get("description") or prop.get("description", "")), table_names))
        else:
            keys.append(_key(schema, prop, key_path, name, _model_of(pointer, title),
                             required=name in node.get("required", ())))
    tables.append(Table(title, description, tuple(keys), names))
    for table_node, table_pointer, table_path, table_title, table_description, table_names in inner:
        _add_table(schema, table_node, table_pointer, table_path, table_title, table_description,
                   table_names, tables)


def _opens(schema: Schema, prop: Schema, pointer: str,
           path: str) -> tuple[Schema, str, str, str, str | None] | None:
    """(schema, pointer, path, title, NAME rule) of the table the key `prop` is, or None for a value."""
    ref, node = _target(schema, prop)
    pointer = ref or pointer
    if node.get("type") == "object" and "properties" in node:
        return node, pointer, path, f"[{path}]", None
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        items_ref, items = _target(schema, node["items"])
        if items.get("type") == "object" and "properties" in items:
            return items, items_ref or f"{pointer}/items", f"{path}[]", f"[[{path}]]", None
    named = node.get("additionalProperties")
    if node.get("type") == "object" and isinstance(named, dict):
        named_ref, table = _target(schema, named)
        names_rule = _merged(schema, node.get("propertyNames", {})).get("description")
        return (table, named_ref or f"{pointer}/additionalProperties", f"{path}.NAME", f"[{path}.NAME]",
                str(names_rule) if names_rule else None)
    return None


def _add_network_table(schema: Schema, node: Schema, path: str, title: str, description: str,
                       names: str | None, tables: list[Table]) -> None:
    """A network is one table whatever its type: the keys of every kind (`allOf`: if type is K, then
    K's schema), each said once with the kinds that have it."""
    kinds: dict[str, tuple[str, Schema]] = {}  # type -> (pointer, schema of that kind)
    for case in node["allOf"]:
        ref, then = _target(schema, case["then"])
        kinds[str(case["if"]["properties"]["type"]["const"])] = (str(ref), then)
    order = [str(kind) for kind in node["properties"]["type"]["enum"]]
    if sorted(order) != sorted(kinds):
        raise ReferenceError(f"{path}: the network types {order} and the kinds of its allOf "
                             f"{sorted(kinds)} differ")
    keys = [_key(schema, node["properties"]["type"], f"{path}.type", "type", None, required=False)]
    seen: dict[str, tuple[str, Schema]] = {}
    holders: dict[str, list[str]] = {}
    for kind in order:
        for name, prop in kinds[kind][1]["properties"].items():
            if name == "type":
                continue
            first = seen.setdefault(name, (kind, prop))
            if first[1] != prop:
                raise ReferenceError(f"{path}.{name}: the {first[0]} and {kind} networks describe it "
                                     "differently; give both the same schema")
            holders.setdefault(name, []).append(kind)
    for name, (_, prop) in seen.items():
        classes = [_model_of(kinds[kind][0], f"{title} ({kind})") for kind in holders[name]]
        models = tuple(found for cls in classes for found in _model_defaults(cls, name, f"{path}.{name}"))
        key = _key(schema, prop, f"{path}.{name}", name, None, required=False, models=models)
        keys.append(attrs.evolve(key, kinds=tuple(holders[name]) if len(holders[name]) < len(order) else ()))
    described = tuple((kind, str(kinds[kind][1].get("description", ""))) for kind in order)
    tables.append(Table(title, description, tuple(keys), names, described))


def _model_of(pointer: str, title: str) -> type:
    cls = MODELS.get(pointer)
    if cls is None:
        raise ReferenceError(f"{title}: no model class for {pointer}; add the class its keys become to "
                             "tools/gen_reference.py's MODELS")
    return cls


def _model_defaults(cls: type | None, name: str, path: str) -> tuple[ModelDefault, ...]:
    if cls is None:
        return ()
    field = FIELDS.get((cls, name), name)
    if field is None:
        return (ModelDefault(cls, None, attrs.NOTHING),)
    fields = attrs.fields_dict(cls)
    if field not in fields:
        raise ReferenceError(f"{path}: {cls.__name__} has no field {field!r}; map the key to its field "
                             "in tools/gen_reference.py's FIELDS")
    return (ModelDefault(cls, field, fields[field].default),)


def _key(schema: Schema, prop: Schema, path: str, name: str, cls: type | None, *, required: bool,
         opens: str | None = None, models: tuple[ModelDefault, ...] | None = None) -> Key:
    if models is None:
        models = _model_defaults(cls, name, path)
    node = _merged(schema, prop)
    default = None if opens else _default_text(schema, prop, path, required, models)
    return Key(path=path, description=str(prop.get("description", "")), type=_type_text(schema, prop, opens),
               allowed=() if opens else tuple(_allowed(schema, prop)), default=default,
               sources=_sources(schema, node, path), opens=opens, models=models)


def _sources(schema: Schema, node: Schema, path: str) -> tuple[tuple[str, str], ...]:
    given = node.get("x-source", [])
    known = schema.get("x-sources", {})
    found = []
    for text in [given] if isinstance(given, str) else given:
        source, _, where = str(text).partition(":")
        if source not in known:
            raise ReferenceError(f"{path}: x-source {text!r} names no source of the schema's x-sources "
                                 f"({', '.join(known)})")
        found.append((source, where.strip()))
    return tuple(found)


_TYPE_WORDS = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean",
               "object": "table", "array": "array"}


def _type_text(schema: Schema, prop: Schema, opens: str | None) -> str:
    ref_name = _ref_name(prop)
    if ref_name in FORMATS:
        words, section = FORMATS[ref_name]
        return f"{words} (see [{section}](#{slug(section)}))"
    node = _merged(schema, prop)
    if opens is not None:
        what = ("array of tables" if node.get("type") == "array" else
                "table of named tables" if isinstance(node.get("additionalProperties"), dict) else "table")
        return f"{what}: see [Table `{opens}`](#{slug('Table ' + opens)})"
    if "enum" in node or "const" in node:
        values = node.get("enum", [node.get("const")])
        return "string" if all(isinstance(value, str) for value in values) else "value"
    kind = node.get("type")
    if kind == "array":
        return f"array of {_type_text(schema, node.get('items', {}), None)}s"
    kinds = kind if isinstance(kind, list) else [kind]
    return " or ".join(_TYPE_WORDS.get(str(each), str(each)) for each in kinds)


def _allowed(schema: Schema, prop: Schema) -> Iterator[str]:
    """The values `prop` takes, in words: its choices, pattern, range, length."""
    own = {key: value for key, value in prop.items() if key != "$ref"}
    node = own if _ref_name(prop) in ("size", "duration") else _merged(schema, prop)  # (their sections say)
    if "enum" in node:
        yield "one of " + ", ".join(code(toml(value)) for value in node["enum"])
    if "const" in node:
        yield code(toml(node["const"]))
    if "pattern" in node:
        message = node.get("x-message")
        pattern = f"pattern {code(node['pattern'])}"
        yield f"{message[0].upper()}{message[1:]}; {pattern}" if message else f"matches the {pattern}"
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None and high is not None:
        yield f"{low} to {high}"
    elif low is not None:
        yield f"at least {low}"
    elif high is not None:
        yield f"at most {high}"
    if "exclusiveMinimum" in node:
        yield f"more than {node['exclusiveMinimum']}"
    if node.get("minLength") == 1:
        yield "not empty"
    elif "minLength" in node or "maxLength" in node:
        yield f"{node.get('minLength', 0)} to {node.get('maxLength', 'any number of')} characters"
    if "minItems" in node or "maxItems" in node:
        yield f"{node.get('minItems', 0)} to {node.get('maxItems', 'any number of')} entries"
    if node.get("uniqueItems"):
        yield "no entry twice"
    if isinstance(node.get("items"), dict):
        yield from (f"each entry: {rule[0].lower()}{rule[1:]}" for rule in _allowed(schema, node["items"]))


def _is_factory(value: object) -> bool:
    return hasattr(value, "factory") and hasattr(value, "takes_self")  # attrs.Factory


def _default_text(schema: Schema, prop: Schema, path: str, required: bool,
                  models: tuple[ModelDefault, ...]) -> str:
    """The default as the page says it: "required", the model's default as TOML (with the x-default's
    words when the default changes with other keys), or the x-default's words alone when the model holds
    none (None: found when the lab comes up; no field, or no plain default: found by the loader)."""
    if required:
        return "required"
    words = prop.get("x-default")
    texts: list[tuple[str, str]] = []
    for model_default in models or (ModelDefault(type(None), None, attrs.NOTHING),):
        value = model_default.default
        if value is attrs.NOTHING or _is_factory(value):
            if not words:
                where = (f"{model_default.cls.__name__}.{model_default.field}" if model_default.field else
                         "the model")
                raise ReferenceError(f"{path}: {where} has no plain default; say how the default is found "
                                     "in the key's x-default")
            text = str(words)
        elif value is None:
            text = str(words) if words else "none"
        else:
            text = code(toml(value, _ref_name(prop)))
            text = f"{text}; {words}" if words else text
        texts.append((model_default.cls.__name__, text))
    if len({text for _, text in texts}) == 1:
        return texts[0][1]
    return "; ".join(f"{cls}: {text}" for cls, text in texts)  # pragma: no cover - none differ today


def toml(value: Any, format_name: str | None = None) -> str:
    """`value` as a spec would write it (a model default: enums as their value, sizes from MiB)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if format_name == "duration" and isinstance(value, (int, float)):
        return f'"{value:g}s"'
    if format_name == "size" and isinstance(value, int):
        return f'"{value}M"'
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml(item) for item in value) + "]"
    raise ReferenceError(f"no TOML form for the default {value!r}")


def keys_without_description(schema: Schema) -> list[str]:
    """Every key of the schema without a description of its own, as a JSON pointer: the keys of the
    top level, of nested tables, of arrays' items, of additionalProperties and patternProperties
    schemas, of every $defs entry (the conditions of an `if` are not keys)."""
    missing: list[str] = []

    def walk(node: Any, where: str) -> None:
        if not isinstance(node, dict):
            return
        for name, prop in node.get("properties", {}).items():
            if not isinstance(prop, dict) or not str(prop.get("description", "")).strip():
                missing.append(f"{where}/properties/{name}")
            walk(prop, f"{where}/properties/{name}")
        for keyword in ("$defs", "patternProperties"):
            for name, sub in node.get(keyword, {}).items():
                walk(sub, f"{where}/{keyword}/{name}")
        for keyword in ("items", "additionalProperties", "then", "else"):
            walk(node.get(keyword), f"{where}/{keyword}")
        for keyword in ("allOf", "anyOf", "oneOf", "prefixItems"):
            for index, sub in enumerate(node.get(keyword, [])):
                walk(sub, f"{where}/{keyword}/{index}")

    walk(schema, "#")
    return missing


def render_spec_keys(schema: Schema) -> str:
    tables = spec_tables(schema)
    defs = schema.get("$defs", {})
    out = [
        "# Spec keys",
        "",
        f"Generated by `tools/gen_reference.py` from the JSON schema (`{_shown_path(SCHEMA_FILE)}`) and "
        f"the defaults of the lab model; do not edit it by hand: {REGENERATE} after changing either.",
        "",
        "Every key a lab spec may hold, table by table: its type, its default, the values it allows, what "
        "it does, and the seed or manual section the rule comes from. `NAME` stands for a name the spec "
        "gives (of a VM, a network, an image); `[]` marks an array of tables: `vm.NAME.disk[].cache` is "
        "the `cache` of each `[[vm.NAME.disk]]`. A path in a value is relative to the spec file. A "
        "default that depends on the host is found when the lab comes up (`vmlaunch cmdline` shows it).",
        "",
        "## Tables",
        "",
    ]
    for table in tables:
        heading = _table_heading(table)
        out.append(f"- [{heading}](#{slug(heading)}): {md(table.description)}")
    out += ["", "## Value formats", ""]
    for name, (_, section) in FORMATS.items():
        if name in defs:
            out += [f"### {section}", "", md(str(defs[name].get("description", ""))), ""]
    for table in tables:
        out += _render_table(table)
    out += _render_sources(schema, tables)
    return "\n".join(out).rstrip("\n") + "\n"


def _table_heading(table: Table) -> str:
    return "The top level" if table.title == "top level" else f"Table `{table.title}`"


def _render_table(table: Table) -> list[str]:
    out = [f"## {_table_heading(table)}", "", md(table.description), ""]
    if table.names:
        out += [f"`NAME`: {md(table.names)}", ""]
    if table.kinds:
        out += ["By `type`:", ""]
        out += [f"- `{kind}`: {md(text)}" for kind, text in table.kinds]
        out.append("")
    for key in table.keys:
        out += [f"### `{key.path}`", "", md(key.description), ""]
        out.append(f"- **Type:** {key.type}")
        if key.default is not None:
            out.append(f"- **Default:** {md(key.default)}")
        if key.allowed:
            out.append(f"- **Allowed:** {'; '.join(key.allowed)}")
        if key.kinds:
            out.append(f"- **Network types:** {', '.join(key.kinds)}")
        if key.sources:
            sources = "; ".join(_source_text(source, where) for source, where in key.sources)
            out.append(f"- **Source:** {sources}")
        out.append("")
    return out


def _source_text(source: str, where: str) -> str:
    return f"[{source}](#sources)" + (f": {md(where)}" if where else "")


def _render_sources(schema: Schema, tables: list[Table]) -> list[str]:
    out = ["## Sources", "", "The documents a rule of the spec comes from, and the keys that cite each.",
           ""]
    cited: dict[str, list[str]] = {}
    for table in tables:
        for key in table.keys:
            for source, _ in key.sources:
                if key.path not in cited.setdefault(source, []):
                    cited[source].append(key.path)
    for source, title in schema.get("x-sources", {}).items():
        keys = ", ".join(f"[`{path}`](#{slug(path)})" for path in cited.get(source, []))
        out.append(f"- **{source}**: {md(str(title))}." + (f" Keys: {keys}." if keys else ""))
    return out + [""]


def _shown_path(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:  # pragma: no cover - a schema outside the checkout
        return str(path)


# --- the commands ---------------------------------------------------------------------------------


@attrs.frozen
class Argument:
    """A positional argument or an option, as the page lists it."""

    names: str  # "`SPEC`", "`-f`, `--follow`", "`--timeout S`"
    usage: str  # in the usage line: "SPEC", "[VM ...]", "[--timeout S]"
    help: str
    notes: tuple[str, ...] = ()  # "optional", "default `10`", "one of ..."
    excludes: tuple[str, ...] = ()  # options it cannot go with (mutually exclusive), by usage name


@attrs.frozen
class Block:
    """A paragraph of a description, or (with `entries`) a list of TERM: text."""

    text: str = ""
    entries: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class CommandDoc:
    path: str  # "vmlaunch image pull"
    help: str  # the one line `vmlaunch --help` shows
    usage: str
    description: tuple[Block, ...]
    arguments: tuple[Argument, ...]
    options: tuple[Argument, ...]
    commands: tuple[CommandDoc, ...] = ()  # its sub-commands (sub-parsers, or a SUBCOMMAND argument's)


def _sub_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction)]


def command_docs(parser: argparse.ArgumentParser) -> CommandDoc:
    """The command line as the page shows it: `vmlaunch` with its options, its commands within."""
    line = describe(parser)
    options = tuple(_option(parser, option) for option in line.options if not _is_help(parser, option))
    commands = tuple(_command_doc(parser, command, parser.prog) for command in line.commands)
    usage = " ".join([parser.prog, *_usage_options(options), "COMMAND ..."])
    description = _blocks(parser.description or "", _is_raw(parser)) + _blocks(parser.epilog or "", False)
    return CommandDoc(parser.prog, "", usage, description, (), options, commands)


def _command_doc(parent: argparse.ArgumentParser, command: Command, prefix: str) -> CommandDoc:
    parser = _sub_parsers(parent)[command.name]
    path = f"{prefix} {command.name}"
    options = tuple(_option(parser, option) for option in command.options if not _is_help(parser, option))
    actions = _positionals(parser)
    if len(actions) != len(command.arguments):  # nargs=N would read as N arguments
        raise ReferenceError(f"{path}: {len(actions)} positional arguments, read as {len(command.arguments)}")
    arguments = tuple(_argument(action, value) for action, value in zip(actions, command.arguments))
    description = _blocks(parser.description or "", _is_raw(parser))
    subcommands = tuple(_command_doc(parser, sub, path) for sub in command.commands)
    usage_args = [argument.usage for argument in arguments] + (["SUBCOMMAND ..."] if subcommands else [])
    usage = " ".join([path, *usage_args, *_usage_options(options)])
    in_place = [(index, value) for index, value in enumerate(command.arguments) if _is_in_place(value)]
    if in_place:
        index, value = in_place[0]
        subcommands += tuple(_in_place_command(path, command, value, description, arguments[:index], options))
    return CommandDoc(path, command.help, usage, description, arguments, options, subcommands)


def _is_in_place(value: Value) -> bool:
    """A positional SUBCOMMAND with choices: sub-commands after other arguments (`snapshot SPEC save`)."""
    return value.kind is Kind.CHOICE and value.name == "SUBCOMMAND"


def _in_place_command(path: str, command: Command, value: Value, description: tuple[Block, ...],
                      before: Sequence[Argument], options: Sequence[Argument]) -> Iterator[CommandDoc]:
    """Each choice of a SUBCOMMAND argument as a command of its own: what it does is the entry of the
    command's description list whose term starts with it (`save NAME  snapshot every VM ...`); its
    options are those whose help starts with the sub-commands they go with ("save, restore: ...") and
    those that go with every one."""
    terms = {entry[0].split()[0]: entry for block in description for entry in block.entries}
    for choice in value.choices:
        if choice not in terms:
            raise ReferenceError(f"{path} {choice}: the description of `{command.name}` has no entry for "
                                 f"it (a line '  {choice} ...  what it does')")
        term, text = terms[choice]
        chosen = [option for option in options if _goes_with(option.help, choice, value.choices)]
        usage = " ".join([path, *(argument.usage for argument in before), term,
                          *_usage_options(chosen)])
        yield CommandDoc(f"{path} {choice}", text, usage, (Block(_sentence(text)),), (), tuple(chosen))


def _sentence(text: str) -> str:
    """A help line as a sentence: "snapshot every VM" -> "Snapshot every VM."."""
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _goes_with(help_text: str, choice: str, choices: Sequence[str]) -> bool:
    found = re.match(r"([a-z]+(?:(?:, | or )[a-z]+)*): ", help_text)
    named = re.split(r", | or ", found.group(1)) if found else []
    if not named or not set(named) <= set(choices):
        return True  # no sub-commands named: it goes with every one
    return choice in named


def _is_help(parser: argparse.ArgumentParser, option: Option) -> bool:
    return isinstance(parser._option_string_actions[option.names[0]], argparse._HelpAction)


def _is_raw(parser: argparse.ArgumentParser) -> bool:
    formatter = parser.formatter_class
    return isinstance(formatter, type) and issubclass(formatter, argparse.RawDescriptionHelpFormatter)


def _option(parser: argparse.ArgumentParser, option: Option) -> Argument:
    action = parser._option_string_actions[option.names[0]]
    metavar = f" {option.value.name}" if option.value is not None else ""
    names = ", ".join(f"`{name}{metavar}`" for name in option.names)
    notes = []
    if action.required:
        notes.append("required")
    if isinstance(action, argparse._AppendAction):
        notes.append("repeatable")
    if option.value is not None and option.value.choices:
        notes.append("one of " + ", ".join(f"`{choice}`" for choice in option.value.choices))
    default = _default_shown(action)
    if default is not None:
        notes.append(f"default `{default}`")
    usage = f"{option.names[0]}{metavar}"
    excludes = tuple(name for name in option.excludes if name not in option.names)
    return Argument(names, usage if action.required else f"[{usage}]", option.help, tuple(notes), excludes)


def _default_shown(action: argparse.Action) -> str | None:
    default = action.default
    if action.nargs == 0 or default in (None, False, [], argparse.SUPPRESS):
        return None
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def _argument(action: argparse.Action, value: Value) -> Argument:
    name = value.name
    nargs = action.nargs
    usage, notes = {
        None: (name, ()),
        argparse.OPTIONAL: (f"[{name}]", ("optional",)),
        argparse.ZERO_OR_MORE: (f"[{name} ...]", ("any number, or none",)),
        argparse.ONE_OR_MORE: (f"{name} [{name} ...]", ("one or more",)),
        argparse.REMAINDER: (f"[{name} ...]", ("the rest of the line",)),
    }.get(nargs if isinstance(nargs, (str, type(None))) else "", (name, ()))
    if value.choices:
        notes += ("one of " + ", ".join(f"`{choice}`" for choice in value.choices),)
    help_text = "" if action.help == argparse.SUPPRESS else " ".join((action.help or "").split())
    return Argument(f"`{name}`", usage, help_text, notes)


def _usage_options(options: Sequence[Argument]) -> list[str]:
    """Options for a usage line; mutually exclusive ones together: [-v | -q]."""
    words: list[str] = []
    done: set[str] = set()
    for option in options:
        if option.usage in done:
            continue
        group = [option] + [other for other in options if other is not option
                            and other.usage.strip("[]").split()[0] in option.excludes]
        done.update(member.usage for member in group)
        words.append(option.usage if len(group) == 1 else
                     "[" + " | ".join(member.usage.strip("[]") for member in group) + "]")
    return words


def _blocks(text: str, raw: bool) -> tuple[Block, ...]:
    """A description as paragraphs; a raw one (laid out by hand) also as lists: a line indented by two
    spaces starts an entry `TERM  text`, lines indented more continue it."""
    if not text.strip():
        return ()
    if not raw:
        return (Block(" ".join(text.split())),)
    blocks = []
    for chunk in re.split(r"\n[ \t]*\n", text.strip("\n")):
        lines = chunk.splitlines()
        if not lines[0].startswith("  "):
            blocks.append(Block(_joined(lines)))
            continue
        entries: list[list[str]] = []
        for line in lines:
            found = re.fullmatch(r"  (\S.*?)(?: {2,}(\S.*))?", line)
            if found and entries and line.startswith("   "):
                found = None
            if found:
                entries.append([found.group(1), found.group(2) or ""])
            elif entries:
                entries[-1][1] = _joined([entries[-1][1], line])
        blocks.append(Block(entries=tuple((term, text) for term, text in entries)))
    return tuple(blocks)


def _joined(lines: Sequence[str]) -> str:
    """Lines of text as one: a word broken after a hyphen ("passed-" / "through") is joined again."""
    text = ""
    for line in (line.strip() for line in lines):
        if not line:
            continue
        glue = "" if not text or (re.search(r"[a-z]-$", text) and line[:1].islower()) else " "
        text += glue + line
    return text


def commands_without_help(parser: argparse.ArgumentParser) -> list[str]:
    """Every command, sub-command, positional argument and option without a help text (those hidden
    with argparse.SUPPRESS aside), and each command without a description: "image pull IMAGE"."""
    line = describe(parser)
    missing = [f"{parser.prog} {option.names[-1]}" for option in line.options if not option.help]

    def walk(parent: argparse.ArgumentParser, commands: Sequence[Command], prefix: str) -> None:
        subs = _sub_parsers(parent)
        for command in commands:
            path = f"{prefix} {command.name}"
            sub = subs[command.name]
            if not command.help:
                missing.append(f"{path} (its one-line help)")
            if not (sub.description or "").strip():
                missing.append(f"{path} (its description)")
            missing.extend(f"{path} {option.names[-1]}" for option in command.options if not option.help)
            for action, value in zip(_positionals(sub), command.arguments):
                if action.help != argparse.SUPPRESS and not (action.help or "").strip():
                    missing.append(f"{path} {value.name}")
                if _is_in_place(value):
                    terms = {entry[0].split()[0] for block in _blocks(sub.description or "", _is_raw(sub))
                             for entry in block.entries}
                    missing.extend(f"{path} {choice} (an entry in the description of {command.name})"
                                   for choice in value.choices if choice not in terms)
            walk(sub, command.commands, path)

    walk(parser, line.commands, parser.prog)
    return missing


def render_commands(parser: argparse.ArgumentParser) -> str:
    top = command_docs(parser)
    out = [
        "# Commands",
        "",
        "Generated by `tools/gen_reference.py` from vmlaunch's argument parser; do not edit it by hand: "
        f"{REGENERATE} after changing a command.",
        "",
        "Every command, sub-command, argument and option of `vmlaunch`, as `vmlaunch help COMMAND` (or "
        "`vmlaunch COMMAND --help`) prints them. Every command also takes `-h`, `--help`: print its help "
        "and exit.",
        "",
        "## All commands",
        "",
    ]
    for command in _all(top.commands):
        heading = f"`{command.path}`"
        out.append(f"- [{heading}](#{slug(command.path)}): {md(command.help)}")
    out.append("")
    out += _render_command(attrs.evolve(top, commands=()), "##")  # (listed above)
    for command in top.commands:
        out += _render_command(command, "##")
        for sub in command.commands:
            out += _render_command(sub, "###")
    return "\n".join(out).rstrip("\n") + "\n"


def _all(commands: Sequence[CommandDoc]) -> Iterator[CommandDoc]:
    for command in commands:
        yield command
        yield from _all(command.commands)


def _render_command(command: CommandDoc, level: str) -> list[str]:
    out = [f"{level} `{command.path}`", "", "```text", command.usage, "```", ""]
    for block in command.description:
        if block.entries:
            out += [f"- `{term}`: {md(text)}" for term, text in block.entries]
        else:
            out.append(md(block.text))
        out.append("")
    for title, arguments in (("Arguments", command.arguments), ("Options", command.options)):
        if arguments:
            out += [f"**{title}**", ""]
            for argument in arguments:
                notes = f" ({'; '.join(argument.notes)})" if argument.notes else ""
                out.append(f"- {argument.names}{notes}: {md(argument.help)}")
            out.append("")
    if command.commands:
        out += ["**Sub-commands**", ""]
        out += [f"- [`{sub.path}`](#{slug(sub.path)}): {md(sub.help)}" for sub in command.commands]
        out.append("")
    return out


# --- Markdown -------------------------------------------------------------------------------------


def code(text: str) -> str:
    """`text` as a code span."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md(text: str) -> str:
    """Plain text as Markdown: code spans (`...`) kept, and nothing else read as markup."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(part if part.startswith("`") and part.endswith("`") and len(part) > 1 else
                   part.replace("\\", "\\\\").replace("*", "\\*").replace("[", "\\[").replace("]", "\\]")
                   .replace("<", "&lt;") for part in parts)


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc: code marks dropped, then its slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


# --- the command ----------------------------------------------------------------------------------


def pages() -> dict[Path, str]:
    """Each page and what it should hold; ReferenceError when something has no description."""
    schema = load_schema()
    parser = build_parser()
    missing = ([f"spec key {pointer}" for pointer in keys_without_description(schema)] +
               [f"command {where}" for where in commands_without_help(parser)])
    if missing:
        raise ReferenceError("no description: " + ", ".join(missing))
    return {SPEC_KEYS_PAGE: render_spec_keys(schema), COMMANDS_PAGE: render_commands(parser)}


def stale(expected: dict[Path, str]) -> dict[Path, list[str]]:
    """The pages on disk that differ from `expected`, each with a unified diff of the difference."""
    found = {}
    for path, text in expected.items():
        current = path.read_text() if path.exists() else ""
        if current != text:
            name = _shown_path(path)
            found[path] = list(difflib.unified_diff(current.splitlines(), text.splitlines(),
                                                    f"{name} (on disk)", f"{name} (generated)", lineterm=""))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="write the pages")
    what.add_argument("--check", action="store_true", help="exit 1 when the pages on disk are not up to date")
    args = parser.parse_args(argv)
    try:
        expected = pages()
    except ReferenceError as exc:
        print(f"gen_reference: {exc}", file=sys.stderr)
        return 1
    if args.write:
        for path, text in expected.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                print(f"wrote {_shown_path(path)}")
        return 0
    differences = stale(expected)
    for path, diff in differences.items():
        changed = sum(1 for line in diff[2:] if line[:1] in "+-")
        print(f"{_shown_path(path)} is not what the code says ({changed} lines differ):", file=sys.stderr)
        print("\n".join(diff[:40] + (["..."] if len(diff) > 40 else [])), file=sys.stderr)
    if differences:
        print(f"{REGENERATE} to write them anew", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
