"""The generated reference (tools/gen_reference.py): every spec key and every command has a description,
docs/reference/*.md are what the code says, and the defaults they give are the ones the loader makes."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import ROOT
from tools import gen_reference
from tools.gen_reference import (
    Key,
    ReferenceError,
    commands_without_help,
    keys_without_description,
    load_schema,
    pages,
    render_spec_keys,
    spec_tables,
    stale,
)
from vmlaunch.cli import build_parser
from vmlaunch.spec import model
from vmlaunch.spec.load import SCHEMA_FILE, parse_lab

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9/3.10 only
    import tomli as tomllib

REGENERATE = "run `make docs` or `python tools/gen_reference.py --write`"


# --- every key and every command is described ------------------------------------------------------


def test_every_schema_key_has_a_description() -> None:
    assert keys_without_description(load_schema()) == []


def test_a_key_without_a_description_is_found() -> None:
    schema = copy.deepcopy(load_schema())
    del schema["$defs"]["disk"]["properties"]["cache"]["description"]
    schema["$defs"]["nic"]["properties"]["queues"]["description"] = "  "
    del schema["properties"]["lab"]["properties"]["memory"]["properties"]["ksm"]["description"]
    assert keys_without_description(schema) == [
        "#/properties/lab/properties/memory/properties/ksm",
        "#/$defs/disk/properties/cache",
        "#/$defs/nic/properties/queues",
    ]


def test_the_walk_reaches_every_kind_of_nested_key() -> None:
    """Arrays' items, additionalProperties and patternProperties schemas, $defs and the kinds of an
    allOf; the conditions of an `if` are not keys."""
    schema: dict[str, Any] = {
        "properties": {
            "a": {"description": "a", "type": "array", "items": {"properties": {"b": {}}}},
            "c": {"description": "c", "additionalProperties": {"properties": {"d": {"description": ""}}}},
            "e": {"description": "e", "patternProperties": {"^x": {"properties": {"f": {"type": "string"}}}}},
        },
        "allOf": [{"if": {"properties": {"kind": {"const": 1}}}, "then": {"properties": {"g": {}}}}],
        "$defs": {"h": {"properties": {"i": {"description": "i"}, "j": {}}}},
    }
    assert keys_without_description(schema) == [
        "#/properties/a/items/properties/b",
        "#/properties/c/additionalProperties/properties/d",
        "#/properties/e/patternProperties/^x/properties/f",
        "#/$defs/h/properties/j",
        "#/allOf/0/then/properties/g",
    ]


def test_no_page_is_written_while_a_key_has_no_description(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    schema = copy.deepcopy(load_schema())
    del schema["$defs"]["vm"]["properties"]["cpus"]["description"]
    monkeypatch.setattr(gen_reference, "load_schema", lambda: schema)
    with pytest.raises(ReferenceError, match="#/\\$defs/vm/properties/cpus"):
        pages()
    assert gen_reference.main(["--check"]) == 1
    assert "no description: spec key #/$defs/vm/properties/cpus" in capsys.readouterr().err


def _sub_parsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any]:
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))


def test_every_command_and_argument_has_help() -> None:
    assert commands_without_help(build_parser()) == []


def test_a_command_or_argument_without_help_is_found() -> None:
    parser = build_parser()
    commands = _sub_parsers(parser)
    up, ls, qmp, snapshot = (commands.choices[name] for name in ("up", "ls", "qmp", "snapshot"))
    up._option_string_actions["--fresh"].help = None
    up.add_argument("--hidden", action="store_true", help=argparse.SUPPRESS)  # hidden on purpose: fine
    next(action for action in commands._choices_actions if action.dest == "ls").help = ""
    ls.description = None
    next(action for action in qmp._actions if action.dest == "vm").help = None
    assert snapshot.description and "\n  list " in snapshot.description
    snapshot.description = snapshot.description.replace("\n  list ", "\n  catalogue ")
    image_pull = _sub_parsers(commands.choices["image"]).choices["pull"]
    next(action for action in image_pull._actions if action.dest == "images").help = " "
    parser._option_string_actions["--quiet"].help = None
    assert commands_without_help(parser) == [
        "vmlaunch --quiet",
        "vmlaunch up --fresh",
        "vmlaunch ls (its one-line help)",
        "vmlaunch ls (its description)",
        "vmlaunch qmp VM",
        "vmlaunch image pull IMAGE",
        "vmlaunch snapshot list (an entry in the description of snapshot)",
    ]


# --- the pages are what the code says --------------------------------------------------------------


def test_the_reference_pages_are_what_the_code_says() -> None:
    differences = stale(pages())
    assert not differences, "\n\n".join(
        f"{path.relative_to(ROOT)} is not what tools/gen_reference.py writes; {REGENERATE}:\n"
        + "\n".join(diff[:60]) for path, diff in differences.items())


def test_each_page_has_a_title_and_says_it_is_generated() -> None:
    for path, text in pages().items():
        title, _, generated = text.split("\n")[:3]
        assert title.startswith("# "), path
        assert generated.startswith("Generated by `tools/gen_reference.py`"), path
        assert "do not edit it by hand" in generated, path


def test_check_and_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    keys_page, commands_page = tmp_path / "reference" / "spec-keys.md", tmp_path / "reference" / "commands.md"
    monkeypatch.setattr(gen_reference, "SPEC_KEYS_PAGE", keys_page)
    monkeypatch.setattr(gen_reference, "COMMANDS_PAGE", commands_page)
    assert gen_reference.main(["--check"]) == 1  # neither exists
    assert gen_reference.main(["--write"]) == 0
    assert gen_reference.main(["--check"]) == 0
    capsys.readouterr()
    text = keys_page.read_text()
    keys_page.write_text(text.replace("- **Default:** `\"none\"`", "- **Default:** writeback"))
    assert gen_reference.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "spec-keys.md is not what the code says (2 lines differ)" in err
    assert "-- **Default:** writeback" in err and "+- **Default:** `\"none\"`" in err
    assert "run `make docs`" in err
    assert "commands.md" not in err


def test_the_output_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    before = pages()
    monkeypatch.setenv("COLUMNS", "33")
    assert pages() == before


# --- the defaults are the loader's -----------------------------------------------------------------

# One spec with every table: each key the spec leaves out takes its default.
# A lab on a libvirt host (MINIMAL has what such a lab refuses: shares, tap and socket networks)
HOSTED = ('[lab]\nname = "h"\n[host.h1]\nuri = "qemu:///system"\n[vm.a]\nmemory = 64\n'
          '[[vm.a.disk]]\nfile = "a.img"\nsize = "16M"\n')

MINIMAL = """\
[lab]
name = "ref"

[lab.memory]

[lab.placement]

[network.br]

[network.nat]
type = "user"

[network.mc]
type = "socket"

[network.taps]
type = "tap"
up_script = "ifup"

[image.remote]
url = "https://example.org/base.img"
sha256 = "0000000000000000000000000000000000000000000000000000000000000000"

[image.local]
file = "base.img"

[vm.a]
memory = 64

[[vm.a.disk]]
file = "a.img"
[[vm.a.disk.fault]]
type = "error"
op = "read"
[[vm.a.disk.fault]]
type = "slow"
bps = "1M"

[[vm.a.nic]]
network = "br"
netem = { loss = 1 }

[[vm.a.nic]]
network = "mc"
netem = { delay = "1ms", where = "guest" }

[[vm.a.pci]]
host = "15:00.0"

[vm.a.balloon]

[[vm.a.share]]
source = "shared"
target = "/mnt/shared"

[vm.b]
memory = 64
image = "local"

[vm.b.cloud_init]
"""


def _built(tmp_path: Path) -> dict[type, list[tuple[object, dict[str, Any]]]]:
    """Each model class, with the objects of MINIMAL's lab that are one and the table they come from."""
    file = tmp_path / "lab.toml"
    raw = tomllib.loads(MINIMAL)
    lab = parse_lab(MINIMAL.encode(), file)
    a, b = lab.vm("a"), lab.vm("b")
    vm_a = raw["vm"]["a"]
    assert b.cloud_init is not None
    hosted_raw = tomllib.loads(HOSTED)
    hosted = parse_lab(HOSTED.encode(), file)
    return {
        model.HostSpec: [(hosted.host("h1"), hosted_raw["host"]["h1"])],
        model.LabSpec: [(lab, raw["lab"])],
        model.LabMemory: [(lab.memory, raw["lab"]["memory"])],
        model.LabPlacement: [(lab.placement, raw["lab"]["placement"])],
        model.BridgeNetwork: [(lab.network("br"), raw["network"]["br"])],
        model.UserNetwork: [(lab.network("nat"), raw["network"]["nat"])],
        model.SocketNetwork: [(lab.network("mc"), raw["network"]["mc"])],
        model.TapNetwork: [(lab.network("taps"), raw["network"]["taps"])],
        model.Image: [(lab.image(name), raw["image"][name]) for name in ("remote", "local")],
        model.VmSpec: [(a, vm_a)],  # (b has an image: its ssh is on)
        model.Disk: [(a.disks[0], vm_a["disk"][0])],
        model.DiskFault: [(a.disks[0].faults[i], vm_a["disk"][0]["fault"][i]) for i in (0, 1)],
        model.Nic: [(a.nics[0], vm_a["nic"][0])],
        model.Netem: [(a.nics[i].netem, vm_a["nic"][i]["netem"]) for i in (0, 1)],
        model.PciDevice: [(a.pci[0], vm_a["pci"][0])],
        model.Balloon: [(a.balloon, vm_a["balloon"])],
        model.Share: [(a.shares[0], vm_a["share"][0])],
        model.CloudInit: [(b.cloud_init, raw["vm"]["b"]["cloud_init"])],
    }


def _keys() -> list[Key]:
    return [key for table in spec_tables(load_schema()) for key in table.keys]


def _key(path: str) -> Key:
    return next(key for key in _keys() if key.path == path)


def test_every_model_default_the_page_gives_is_the_loaders(tmp_path: Path) -> None:
    """Each default the generator takes from the model is what parse_lab makes of a spec that leaves
    the key out (on the objects where no other key changes it: the x-default's cases)."""
    built = _built(tmp_path)
    checked = []
    for key in _keys():
        if key.opens:
            continue
        name = key.path.rsplit(".", 1)[-1]
        for found in key.models:
            plain = found.default is not attrs.NOTHING and not gen_reference._is_factory(found.default)
            if found.field is None or not plain:
                continue
            compared = [obj for obj, raw in built[found.cls] if name not in raw]
            assert compared, f"MINIMAL leaves {key.path} out of no {found.cls.__name__}"
            for obj in compared:
                assert getattr(obj, found.field) == found.default, (key.path, obj)
            checked.append(f"{found.cls.__name__}.{found.field}")
    assert len(checked) >= 50, checked
    for field in ("Disk.cache", "Nic.model", "VmSpec.machine", "LabPlacement.interval_s", "Balloon.policy",
                  "CloudInit.user", "LabSpec.mac_prefix", "UserNetwork.forward", "PciDevice.driver"):
        assert field in checked


def test_the_defaults_as_the_page_says_them() -> None:
    assert _key("vm.NAME.disk[].cache").default == '`"none"`'
    assert _key("vm.NAME.cpus").default == "`1`"
    assert _key("vm.NAME.balloon.enabled").default == "`true`"
    assert _key("vm.NAME.cpu_pinning").default == "`[]`"
    assert _key("lab.placement.interval").default == '`"5s"`'  # the model's 5.0 seconds, as a duration
    assert _key("lab.mac_prefix").default == '`"52:54:00"`'
    assert _key("vm.NAME.memory").default == "required"
    assert _key("vm.NAME.ssh").default == "`false`; `true` when the VM has `image` or `cloud_init`"
    assert str(_key("vm.NAME.disk[].format").default).startswith('`"qcow2"` when `file` ends in')  # x-default
    assert str(_key("vm.NAME.cpu_model").default).startswith("`host` under KVM")  # None in the model
    assert _key("vm.NAME.kernel").default == "none"
    assert _key("network.NAME.up_script").default == "none; a tap network needs one"
    assert _key("network.NAME.up_script").kinds == ("bridge", "tap")
    page = render_spec_keys(load_schema())
    assert "### `vm.NAME.disk[].cache`\n" in page
    section = page.split("### `vm.NAME.disk[].cache`\n", 1)[1].split("###", 1)[0]
    assert '- **Default:** `"none"`' in section
    assert ('- **Allowed:** one of `"none"`, `"writeback"`, `"writethrough"`, `"directsync"`, `"unsafe"`'
            in section)
    assert "- **Source:** [kvm-cache-settings](#sources): Conclusions" in section


def test_a_computed_default_needs_words() -> None:
    schema = copy.deepcopy(load_schema())
    del schema["$defs"]["vm"]["properties"]["append"]["x-default"]  # the model's default is a Factory
    with pytest.raises(ReferenceError, match="vm.NAME.append: VmSpec.append has no plain default"):
        spec_tables(schema)


def test_a_key_the_model_has_no_field_for_is_refused() -> None:
    schema = copy.deepcopy(load_schema())
    schema["$defs"]["disk"]["properties"]["iothread"] = {"description": "x", "type": "boolean"}
    with pytest.raises(ReferenceError, match="Disk has no field 'iothread'"):
        spec_tables(schema)


def test_a_source_must_be_one_the_schema_lists() -> None:
    schema = copy.deepcopy(load_schema())
    schema["$defs"]["disk"]["properties"]["cache"]["x-source"] = "seed-009: somewhere"
    with pytest.raises(ReferenceError, match="seed-009"):
        spec_tables(schema)


# --- the schema stays a schema ---------------------------------------------------------------------


def test_the_schema_with_its_own_keywords_is_valid_draft_2020_12() -> None:
    import jsonschema

    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(tomllib.loads(MINIMAL)))


def test_the_schema_copies_are_the_same() -> None:
    assert (ROOT / "schemas" / "vmlaunch.schema.json").read_bytes() == SCHEMA_FILE.read_bytes()
    assert json.loads(SCHEMA_FILE.read_text())["x-sources"]
