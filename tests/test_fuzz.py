"""Malformed specs fed to every command that reads one: a message and an exit code, never a crash.

Each generated spec goes through `validate`, `cmdline`, `up --dry-run`, `status`, `logs` and `down`
(of a lab that is not up), in process, and must end with one of the documented exit codes, without
"internal error" or a traceback, within seconds. Nothing here boots a guest or touches the host: the
run and cache dirs are private, and `up` only ever runs with --dry-run.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmlaunch.cli import main

# 1 would be an internal error; 3 and 4 are the host's answers (no KVM, a lab that is not up).
DOCUMENTED_EXITS = {0, 2, 3, 4, 64}
COMMANDS = (["validate"], ["cmdline"], ["up", "--dry-run"], ["status"], ["logs", "a"],
            ["down", "--timeout", "0"], ["export", "--to", "libvirt", "--out", "{folder}/libvirt"],
            ["export", "--to", "kubevirt", "--out", "{folder}/kubevirt"])
SLOW = 10.0  # seconds; a command taking longer on a spec of a few KiB hangs in all but name

VALID_LAB: dict[str, Any] = {
    "lab": {"name": "fz"},
    "network": {"lan": {"bridge": "vlfz0"}, "out": {"type": "user", "forward": ["tcp::2222-:22"]},
                "mc": {"type": "socket"}},
    "vm": {
        "a": {"memory": "64M", "kernel": "vmlinuz", "append": "console=ttyS0",
              "disk": [{"file": "a.qcow2", "size": "1G"}],
              "nic": [{"network": "lan"}, {"network": "out", "mac": "52:54:00:12:34:56"}],
              "balloon": {"enabled": True}},
        "b": {"memory": 64, "cpus": 2, "kernel": "vmlinuz", "nic": [{"network": "mc"}]},
    },
}

# Every key the schema knows, as a path into VALID_LAB (ints index arrays of tables).
SCHEMA_KEYS: list[tuple[str | int, ...]] = [
    ("lab", "name"), ("lab", "mac_prefix"),
    ("network", "lan", "type"), ("network", "lan", "bridge"), ("network", "lan", "mtu"),
    ("network", "lan", "uplink"), ("network", "out", "forward"), ("network", "out", "forward", 0),
    ("network", "mc", "mcast"),
    *(("vm", "a", key) for key in ("memory", "cpus", "accel", "cpu_model", "machine", "kernel", "initrd",
                                   "append", "disk", "nic", "pci", "balloon")),
    *(("vm", "a", "disk", 0, key) for key in ("file", "size", "format", "cache", "aio", "bus", "readonly",
                                              "discard", "accept_data_loss")),
    *(("vm", "a", "nic", 0, key) for key in ("network", "mac", "model", "queues")),
    ("vm", "a", "pci", 0, "host"), ("vm", "a", "pci", 0, "driver"),
    *(("vm", "a", "balloon", key) for key in ("enabled", "deflate_on_oom", "free_page_reporting")),
    ("lab",), ("network",), ("vm",), ("vm", "a"), ("vm", "a", "disk", 0), ("network", "lan"),
]

# --- a small TOML writer (the values hypothesis makes are ones TOML can hold) -----------------------


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) \
            else repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_string(text: str) -> str:
    # JSON's escapes are TOML's, but for DEL, which TOML wants escaped too
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_document(doc: dict[str, Any]) -> str:
    """Tables as [headers] (so the source map sees headers), everything below them inline."""
    lines = [f"{toml_string(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for key, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{toml_string(key)}]")
            lines += [f"{toml_string(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12) | st.sampled_from([
    "", "help", "?", "q35,help", "t\n", "a\x00b", "256B", "16777216B", "256.0", "99999999999999999999G",
    "-1", "1e3", "0x10", "tcp:1.2.3.4:99999-:22", "239.1.2.3:0", "52:54:00:00:00:0g\n", "15:00.0\n",
    "../../etc/passwd", "~root/x", "-machine", "%s%n", "\u202e", "٢٥٦M", "256\u212a",
])
SCALARS = (
    st.integers() | st.integers(min_value=-(10**400), max_value=10**400) | st.booleans()
    | st.floats(allow_nan=True, allow_infinity=True) | TEXT | st.dates() | st.times()
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)


def deep_copy(doc: Any) -> Any:
    return json.loads(json.dumps(doc))


def set_path(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """`doc` with `value` at `path`, creating the tables and arrays of tables on the way."""
    node: Any = doc
    for key, after in zip(path, (*path[1:], None)):
        if after is None:
            if isinstance(key, int) and len(node) <= key:
                node.append(value)
            else:
                node[key] = value
        elif isinstance(key, int):
            if len(node) <= key:
                node.append({})
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(after, int) else {})
    return doc


# --- running the commands -------------------------------------------------------------------------


@pytest.fixture
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Private run and cache dirs for the whole test (hypothesis runs many examples in one call)."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "vmlinuz").write_bytes(b"a kernel")  # the files VALID_LAB names exist (preflight)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VMLAUNCH_RUN_DIR", str(root / "run"))
        patch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
        patch.delenv("VMLAUNCH_DEBUG", raising=False)
        yield root


def run_every_command(spec: Path) -> None:
    for command in COMMANDS:
        args = command_line(command, spec)
        out, err = io.StringIO(), io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
        took = time.monotonic() - start
        text = out.getvalue() + err.getvalue()
        assert code in DOCUMENTED_EXITS, (args, code, text[-2000:])
        assert "internal error" not in text and "Traceback" not in text, (args, text[-2000:])
        assert took < SLOW, (args, took)
        if code == 2:
            assert "problem" in text, (args, text[-2000:])


def command_line(command: list[str], spec: Path) -> list[str]:
    """The command with SPEC, its folders in the spec's (an export's output)."""
    return [command[0], str(spec), *(arg.replace("{folder}", str(spec.parent)) for arg in command[1:])]


def write(folder: Path, data: bytes | str) -> Path:
    spec = folder / "lab.toml"
    spec.write_bytes(data.encode() if isinstance(data, str) else data)
    return spec


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_the_valid_lab_is_valid(sandbox: Path) -> None:
    """The base of the mutations below passes every command (`logs`: the lab is not up), so what
    they find comes from the mutation."""
    spec = write(sandbox, toml_document(VALID_LAB))
    for command in COMMANDS:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main(command_line(command, spec)) == (4 if command[0] == "logs" else 0)


@fuzz(60)
@given(path=st.sampled_from(SCHEMA_KEYS), value=VALUES)
def test_any_value_for_any_key(sandbox: Path, path: tuple[str | int, ...], value: Any) -> None:
    run_every_command(write(sandbox, toml_document(set_path(deep_copy(VALID_LAB), path, value))))


@fuzz(40)
@given(table=st.sampled_from([(), ("lab",), ("vm", "a"), ("vm", "a", "disk", 0), ("network", "out"),
                              ("vm", "a", "balloon"), ("vm", "a", "nic", 1)]),
       extra=st.dictionaries(TEXT, VALUES, min_size=1, max_size=3))
def test_unknown_keys_anywhere(sandbox: Path, table: tuple[str | int, ...], extra: dict[str, Any]) -> None:
    doc = deep_copy(VALID_LAB)
    node: Any = doc
    for key in table:
        node = node[key]
    node.update(extra)
    run_every_command(write(sandbox, toml_document(doc)))


@fuzz(40)
@given(doc=st.dictionaries(TEXT, VALUES, max_size=4))
def test_random_documents(sandbox: Path, doc: dict[str, Any]) -> None:
    run_every_command(write(sandbox, toml_document(doc)))


@fuzz(40)
@given(data=st.binary(max_size=200) | st.builds(lambda head, tail: head + tail,
                                                st.sampled_from([toml_document(VALID_LAB).encode(), b""]),
                                                st.binary(max_size=40)))
def test_random_bytes(sandbox: Path, data: bytes) -> None:
    run_every_command(write(sandbox, data))


@fuzz(15)
@given(depth=st.integers(min_value=1, max_value=3000), opener=st.sampled_from(["[", "{a = "]),
       where=st.sampled_from(["x = ", '[lab]\nname = "fz"\nx = ', '[vm.a]\nmemory = 64\ndisk = ']))
def test_deep_nesting(sandbox: Path, depth: int, opener: str, where: str) -> None:
    closer = "]" if opener == "[" else "}"
    run_every_command(write(sandbox, where + opener * depth + closer * depth + "\n"))


# --- what only a real process shows: a file that never ends, a hang -------------------------------


def vmlaunch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          check=False, env={**os.environ, **env}, timeout=30)


def test_specs_that_are_not_files(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    env = {"VMLAUNCH_RUN_DIR": str(tmp_path / "run"), "VMLAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    for spec, why in (("/dev/zero", "it is a character device"), (str(fifo), "it is a FIFO"),
                      (str(tmp_path), "it is a folder")):
        for command in (["validate"], ["down"], ["status"]):
            done = vmlaunch(command[0], spec, env=env)
            assert done.returncode == 2, (command, spec, done.stderr)
            assert f"cannot read the spec: {why}" in done.stderr


def test_pathological_specs_answer_quickly(tmp_path: Path) -> None:
    """Each of these crashed or hung before: recursion, quadratic checks, 400-digit numbers."""
    mixed = ", ".join(str(i) if i % 2 else f'"s{i}"' for i in range(60000))
    env = {"VMLAUNCH_RUN_DIR": str(tmp_path / "run"), "VMLAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    texts = [
        "x = " + "[" * 10000 + "]" * 10000 + "\n",
        '[lab]\nname = "t"\n[network.u]\ntype = "user"\nforward = [' + mixed + ']\n',
        '[lab]\nname = "t"\n[vm.a]\nmemory = 1' + "0" * 400 + '\nkernel = "k"\n',
        '[lab]\nname = "t"\n[vm.a]\nmemory = "' + "9" * 400 + 'G"\nkernel = "k"\n',
        '[lab]\nname = "t"\n[vm.a]\nmemory = "1' + " " * 100000 + 'x"\nkernel = "k"\n',
        "x = 1" + "0" * 5000 + "\n",
    ]
    for index, text in enumerate(texts):
        spec = tmp_path / f"{index}.toml"
        spec.write_text(text)
        start = time.monotonic()
        done = vmlaunch("validate", str(spec), env=env)
        assert done.returncode == 2, (index, done.stderr[-500:])
        assert "internal error" not in done.stderr and "Traceback" not in done.stderr, index
        assert time.monotonic() - start < SLOW, index
