"""Parsing and validation: the example's model, and each class of bad input with message and line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import EXAMPLES, write_spec
from vmlaunch.compile.preflight import load_checked
from vmlaunch.core.naming import derive_mac
from vmlaunch.errors import SpecError
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import Accel, Aio, BridgeNetwork, CacheMode, DiskBus, DiskFormat, UserNetwork

HEAD = '[lab]\nname = "t"\n'
VM = '[vm.a]\nmemory = 64\nkernel = "k"\n'


def problems(tmp_path: Path, text: str) -> list[str]:
    """The problems vmlaunch reports for `text`, with the file shown as lab.toml."""
    spec = write_spec(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_lab(spec)
    return [str(p).replace(str(spec), "lab.toml") for p in info.value.problems]


def test_example_lab() -> None:
    lab = load_lab(EXAMPLES / "lab.toml")
    assert lab.name == "demo"
    assert lab.mac_prefix == "52:54:00"
    lan, out = lab.networks
    assert lan == BridgeNetwork(name="lan", bridge="vlbr-demo")
    assert out == UserNetwork(name="out", forward=("tcp:127.0.0.1:2222-:22",))
    alpha, beta = lab.vms
    assert (alpha.memory_mib, alpha.cpus, alpha.accel) == (256, 1, Accel.AUTO)
    assert alpha.kernel == EXAMPLES / "guest" / "vmlinuz"
    (disk,) = alpha.disks
    assert disk.file == EXAMPLES / "alpha.img"
    assert (disk.size, disk.format, disk.cache, disk.aio, disk.bus) == (
        64 << 20, DiskFormat.RAW, CacheMode.NONE, None, DiskBus.VIRTIO)
    assert [nic.mac for nic in alpha.nics] == [derive_mac("52:54:00", "demo", "alpha", i)
                                               for i in (0, 1)]
    assert beta.memory_mib == 256
    assert beta.append == "console=ttyS0"  # default for direct kernel boot
    assert beta.nics[0].mac == "00:16:3e:00:01:02"
    assert beta.balloon.enabled


def test_macs_are_stable_and_distinct() -> None:
    assert derive_mac("52:54:00", "demo", "alpha", 0) == derive_mac("52:54:00", "demo", "alpha", 0)
    macs = {derive_mac("52:54:00", lab, vm, i) for lab in "ab" for vm in "xy" for i in range(3)}
    assert len(macs) == 12


def test_defaults_qcow2_from_extension_and_pci_normalised(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = "1G"\n[[vm.a.disk]]\nfile = "x.qcow2"\n'
                      '[[vm.a.pci]]\nhost = "15:00.0"\n')
    vm = load_lab(spec).vms[0]
    assert vm.disks[0].format is DiskFormat.QCOW2
    assert vm.pci[0].host == "0000:15:00.0"
    assert vm.memory_mib == 1024


@pytest.mark.parametrize(("text", "expected"), [
    # TOML syntax
    (HEAD + "[vm.a]\nmemory = \n", "lab.toml:4: TOML syntax error: a value is missing or is not a "
     'TOML value (column 10) (strings need quotes: name = "web", memory = "1G")'),
    # structure: unknown key, with a suggestion
    (HEAD + VM + "[[vm.a.nic]]\nnetwork = \"n\"\nmodle = \"virtio\"\n",
     "lab.toml:8: vm.a.nic[0].modle: unknown key 'modle' (did you mean 'model'?)"),
    # structure: enum
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d"\ncache = "fast"\n',
     "lab.toml:8: vm.a.disk[0].cache: 'fast' is not one of none, writeback, writethrough, "
     "directsync, unsafe"),
    # structure: type
    (HEAD + '[vm.a]\nmemory = 64\ncpus = "two"\nkernel = "k"\n',
     "lab.toml:5: vm.a.cpus: expected an integer, got a string"),
    # structure: missing key, on the table's header line
    (HEAD + '[vm.a]\nkernel = "k"\n', "lab.toml:3: vm.a: missing required key 'memory'"),
    (HEAD, "lab.toml:1: missing required key 'vm'"),
    # structure: names
    ('[lab]\nname = "Bad_Lab"\n' + VM,
     "lab.toml:2: lab.name: 'Bad_Lab' must be 1-20 lowercase letters, digits or '-', not "
     "starting or ending with '-'"),
    (HEAD + '[vm.A]\nmemory = 64\nkernel = "k"\n',
     "lab.toml:3: vm.A: the name 'A' must be 1-32 lowercase letters, digits or '-', not "
     "starting or ending with '-'"),
    # sizes
    (HEAD + '[vm.a]\nmemory = "12X"\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: '12X' is not a size (examples: 256M, 2G, 1.5G)"),
    (HEAD + '[vm.a]\nmemory = "1.0001G"\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: '1.0001G' is not a whole number of bytes"),
    (HEAD + '[vm.a]\nmemory = 8\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: 8 MiB (a bare number is MiB) is too little memory; at least 16M (16 MiB)"),
    # bridge names
    (HEAD + '[network.n]\nbridge = "this-bridge-is-too-long"\n' + VM,
     "lab.toml:4: network.n.bridge: bridge 'this-bridge-is-too-long' is 23 bytes; interface "
     "names have at most 15"),
    (HEAD + '[network.n]\nbridge = "a/b"\n' + VM,
     "lab.toml:4: network.n.bridge: bridge 'a/b' is not a valid interface name (no '/', ':' or "
     "spaces; not '.' or '..')"),
    (HEAD + '[network.n]\nbridge = "br%d"\n' + VM,
     "lab.toml:4: network.n.bridge: bridge 'br%d' is not a valid interface name (no '%': the kernel "
     "reads \"%d\" as a number to pick)"),
    # network references
    (HEAD + '[network.lan]\n' + VM + '[[vm.a.nic]]\nnetwork = "wan"\n',
     "lab.toml:8: vm.a.nic[0].network: no network named 'wan' (networks: lan)"),
    # MACs
    (HEAD + VM + '[network.n]\n[[vm.a.nic]]\nnetwork = "n"\nmac = "01:00:5e:00:00:01"\n',
     "lab.toml:9: vm.a.nic[0].mac: '01:00:5e:00:00:01' is a multicast address (the first octet "
     "must be even)"),
    (HEAD + VM + '[network.n]\n[[vm.a.nic]]\nnetwork = "n"\nmac = "52:54:00:00:00:01"\n'
     '[[vm.a.nic]]\nnetwork = "n"\nmac = "52:54:00:00:00:01"\n',
     "lab.toml:12: vm.a.nic[1].mac: MAC 52:54:00:00:00:01 is also used at vm.a.nic[0] (every "
     "NIC in a lab needs its own MAC; set mac = \"...\")"),
    (HEAD + VM + '[network.n]\n[[vm.a.nic]]\nnetwork = "n"\nmac = "52:54:00:00:00:1"\n',
     "lab.toml:9: vm.a.nic[0].mac: '52:54:00:00:00:1' must be a MAC address like "
     "52:54:00:12:34:56"),
    # PCI
    (HEAD + VM + '[[vm.a.pci]]\nhost = "15:00"\n',
     "lab.toml:7: vm.a.pci[0].host: '15:00' must be a PCI address like 15:00.0 or 0000:15:00.0"),
    (HEAD + VM + '[[vm.a.pci]]\nhost = "15:00.0"\n[vm.b]\nmemory = 64\nkernel = "k"\n'
     '[[vm.b.pci]]\nhost = "0000:15:00.0"\n',
     "lab.toml:12: vm.b.pci[0].host: PCI device 0000:15:00.0 is already passed through at "
     "vm.a.pci[0]"),
    # disks shared between VMs
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d.img"\n[vm.b]\nmemory = 64\nkernel = "k"\n'
     '[[vm.b.disk]]\nfile = "./d.img"\n',
     "lab.toml:12: vm.b.disk[0].file: './d.img' is already a writable disk at vm.a.disk[0] (two "
     "writers corrupt an image; use readonly = true or a qcow2 overlay per VM)"),
    # aio and cache
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d"\ncache = "writeback"\naio = "native"\n',
     "lab.toml:9: vm.a.disk[0].aio: aio = \"native\" needs O_DIRECT, which cache = \"writeback\" "
     "does not use (use cache = \"none\" or \"directsync\", or aio = \"io_uring\" or \"threads\")"),
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d"\ncache = "unsafe"\n',
     "lab.toml:8: vm.a.disk[0].cache: cache = \"unsafe\" ignores flushes: a host crash corrupts "
     "the image (add accept_data_loss = true if that is fine)"),
    # boot
    (HEAD + '[vm.a]\nmemory = 64\n', "lab.toml:3: vm.a: nothing to boot (add image = \"...\", "
     "kernel = \"...\" or a [[disk]])"),
    (HEAD + '[vm.a]\nmemory = 64\nappend = "x"\n[[vm.a.disk]]\nfile = "d"\n',
     "lab.toml:5: vm.a.append: append needs kernel (add kernel = \"...\")"),
    # user networks
    (HEAD + '[network.u]\ntype = "user"\nforward = ["22"]\n' + VM,
     "lab.toml:5: network.u.forward[0]: '22' must look like \"tcp:127.0.0.1:2222-:22\" "
     "(PROTO:[HOSTADDR]:HOSTPORT-[GUESTADDR]:GUESTPORT)"),
    (HEAD + '[network.u]\ntype = "user"\nforward = ["tcp::2222-:22"]\n' + VM
     + '[[vm.a.nic]]\nnetwork = "u"\n[vm.b]\nmemory = 64\nkernel = "k"\n[[vm.b.nic]]\nnetwork = "u"\n',
     "lab.toml:15: vm.b.nic[0].network: network 'u' forwards host ports and is already used at "
     "vm.a.nic[0] (a forwarded host port reaches one NIC: give each VM its own user network)"),
    (HEAD + '[network.u]\ntype = "user"\nbridge = "br0"\n' + VM,
     "lab.toml:5: network.u.bridge: unknown key 'bridge' (known keys: forward, type)"),
])
def test_bad_input(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in problems(tmp_path, text)


def test_every_problem_is_reported(tmp_path: Path) -> None:
    found = problems(tmp_path, '[lab]\nname = "t"\n[vm.a]\nmemory = "12X"\ncpus = 0\nkernel = "k"\n'
                     '[[vm.a.disk]]\nfile = "d"\ncache = "fast"\n'
                     '[vm.b]\nmemory = 64\nkernel = "k"\n[[vm.b.nic]]\nnetwork = "nowhere"\n')
    assert [line.split(":")[1] for line in found] == ["4", "5", "9", "14"]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read the spec: No such file or directory"):
        load_lab(tmp_path / "nope.toml")


def test_not_utf8(tmp_path: Path) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_bytes(b'[lab]\nname = "\xff"\n')
    with pytest.raises(SpecError, match=r"lab.toml:2: the spec is not UTF-8 text"):
        load_lab(spec)


def test_valid_spec_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec that validated clean skips jsonschema next time; an edited one is checked again."""
    import vmlaunch.spec.load as spec_module

    spec = write_spec(tmp_path, HEAD + VM)
    load_lab(spec)
    calls: list[int] = []
    real = spec_module._schema_errors

    def counted(doc: Any, schema: Any) -> Any:
        calls.append(1)
        return real(doc, schema)

    monkeypatch.setattr(spec_module, "_schema_errors", counted)
    load_lab(spec)
    assert calls == []
    spec.write_text(HEAD + VM.replace("64", "65"))
    load_lab(spec)
    assert calls == [1]


def test_aio_default_left_to_compiler(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + VM + '[[vm.a.disk]]\nfile = "d"\naio = "threads"\n')
    assert load_lab(spec).vms[0].disks[0].aio is Aio.THREADS


# --- hardening (issue 7): values QEMU would take for a query, trailing newlines, NUL, nesting -------


@pytest.mark.parametrize(("key", "value"), [
    ("machine", "help"), ("machine", "HELP"), ("cpu_model", "help"), ("machine", "?"),
    ("machine", "q35,help"), ("cpu_model", "max,help"), ("cpu_model", "?"),
])
def test_qemu_queries_never_reach_qemu(tmp_path: Path, key: str, value: str) -> None:
    found = problems(tmp_path, HEAD + VM + f'{key} = "{value}"\n')
    assert len(found) == 1 and found[0].startswith(f"lab.toml:6: vm.a.{key}: "), found


def test_help_as_a_machine_says_why(tmp_path: Path) -> None:
    assert problems(tmp_path, HEAD + VM + 'machine = "help"\n') == [
        "lab.toml:6: vm.a.machine: 'help' would make QEMU list its machine types and exit instead of "
        "starting the VM (name one; `qemu-system-x86_64 -machine help` lists them)"]


@pytest.mark.parametrize(("text", "where"), [
    ('[lab]\nname = "t\\n"\n' + VM, "lab.toml:2: lab.name: "),
    ('[lab]\nname = "t"\nmac_prefix = "52:54:00\\n"\n' + VM, "lab.toml:3: lab.mac_prefix: "),
    (HEAD + '[vm."a\\n"]\nmemory = 64\nkernel = "k"\n', 'lab.toml:3: vm."a\\n": '),
    (HEAD + '[network."n\\n"]\n' + VM, 'lab.toml:3: network."n\\n": '),
    (HEAD + VM + 'machine = "q35\\n"\n', "lab.toml:6: vm.a.machine: "),
    (HEAD + VM + 'cpu_model = "max\\n"\n', "lab.toml:6: vm.a.cpu_model: "),
    (HEAD + '[vm.a]\nmemory = "64M\\n"\nkernel = "k"\n', "lab.toml:4: vm.a.memory: "),
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d"\nsize = "1G\\n"\n', "lab.toml:8: vm.a.disk[0].size: "),
    (HEAD + VM + '[network.n]\n[[vm.a.nic]]\nnetwork = "n"\nmac = "52:54:00:00:00:01\\n"\n',
     "lab.toml:9: vm.a.nic[0].mac: "),
    (HEAD + VM + '[[vm.a.pci]]\nhost = "15:00.0\\n"\n', "lab.toml:7: vm.a.pci[0].host: "),
    (HEAD + '[network.m]\ntype = "socket"\nmcast = "239.1.2.3:5000\\n"\n' + VM,
     "lab.toml:5: network.m.mcast: "),
    (HEAD + '[network.u]\ntype = "user"\nforward = ["tcp::2222-:22\\n"]\n' + VM,
     "lab.toml:5: network.u.forward[0]: "),
])
def test_a_trailing_newline_passes_no_pattern(tmp_path: Path, text: str, where: str) -> None:
    found = problems(tmp_path, text)
    assert [line for line in found if line.startswith(where)], found


def _schema_patterns() -> list[str]:
    import json

    from vmlaunch.spec.load import SCHEMA_FILE

    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(SCHEMA_FILE.read_text()))
    return found


def test_schema_patterns_read_alike_in_python_and_ecma() -> None:
    """Anchored at both ends, `$` only at the end (vmlaunch reads it as \\Z), and no class that
    differs between the dialects."""
    patterns = _schema_patterns()
    assert len(patterns) >= 8
    for pattern in patterns:
        assert pattern.startswith("^") and pattern.endswith("$") and "$" not in pattern[:-1], pattern
        for escape in ("\\d", "\\w", "\\s", "\\b", "\\D", "\\W", "\\S", "\\B"):
            assert escape not in pattern, pattern


@pytest.mark.parametrize(("text", "where"), [
    ('[lab]\nname = "t\\u0000"\n' + VM, "lab.toml:2: lab.name: "),
    (HEAD + '[vm.a]\nmemory = 64\nkernel = "k\\u0000x"\n', "lab.toml:5: vm.a.kernel: "),
    (HEAD + VM + 'append = "console=ttyS0\\u0000 init=/bin/sh"\n', "lab.toml:6: vm.a.append: "),
    (HEAD + VM + 'initrd = "\\u0000"\n', "lab.toml:6: vm.a.initrd: "),
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d\\u0000.img"\n', "lab.toml:7: vm.a.disk[0].file: "),
    (HEAD + '[network.n]\nbridge = "br\\u0000"\n' + VM, "lab.toml:4: network.n.bridge: "),
    (HEAD + '[network.u]\ntype = "user"\nforward = ["tcp::2222-:22", "\\u0000"]\n' + VM,
     "lab.toml:5: network.u.forward[1]: "),
    (HEAD + VM + '"x\\u0000" = 1\n', 'lab.toml:6: vm.a."x\\u0000": '),
    (HEAD + '[vm."a\\u0000"]\nmemory = 64\nkernel = "k"\n', 'lab.toml:3: vm."a\\u0000": '),
    (HEAD + '[network.n]\n' + VM + '[[vm.a.nic]]\nnetwork = "n\\u0000"\n',
     "lab.toml:8: vm.a.nic[0].network: "),
])
def test_nul_anywhere_is_one_problem_with_its_key_and_line(tmp_path: Path, text: str, where: str) -> None:
    found = problems(tmp_path, text)
    assert len(found) == 1 and found[0].startswith(where) and "NUL" in found[0], found
    assert "\0" not in found[0]


def test_nesting(tmp_path: Path) -> None:
    deep = HEAD + VM + "x = " + "[" * 10000 + "]" * 10000 + "\n"
    assert problems(tmp_path, deep) == [
        "lab.toml:6: arrays or inline tables are nested too deeply (a lab needs at most 16 levels)"]
    found = problems(tmp_path, HEAD + VM + "x = " + "[" * 100 + "]" * 100 + "\n")
    assert found == ["lab.toml:6: vm.a.x[0][0][0][0][0][0][0][0][0][0][0][0][0][0]: nested more than 16 "
                     "levels deep (a lab needs only a few levels (vm.NAME.disk[0].file))"]


@pytest.mark.parametrize(("text", "expected"), [
    (HEAD + '[vm.a]\nmemory = 1' + "0" * 400 + '\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: 100000000000000000000000000000...(401 digits) MiB (a bare number is MiB) "
     "is too large"),
    (HEAD + '[vm.a]\nmemory = "' + "9" * 400 + 'G"\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: '99999999999999999999999999999...(403 characters) is too large"),
    (HEAD + VM + "cpus = 1" + "0" * 400 + "\n",
     "lab.toml:6: vm.a.cpus: 100000000000000000000000000000000000000000000000...(401 characters) is "
     "more than the maximum 1024"),
    (HEAD + VM + "x = 1" + "0" * 5000 + "\n", "lab.toml:6: a number has thousands of digits"),
    # absurd sizes
    (HEAD + '[vm.a]\nmemory = "17T"\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: '17T' is more memory than a VM can have; at most 16T (16 TiB)"),
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d"\nsize = "1025T"\n',
     "lab.toml:8: vm.a.disk[0].size: '1025T' is larger than a disk image can be; at most 1024T (1024 TiB)"),
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d"\nsize = "0M"\n',
     "lab.toml:8: vm.a.disk[0].size: '0M' is no size (e.g. 64M or 20G)"),
    (HEAD + VM + '[[vm.a.disk]]\nfile = "d"\nsize = "1000B"\n',
     "lab.toml:8: vm.a.disk[0].size: '1000B' is not a whole number of 512-byte sectors (e.g. 64M or 20G)"),
    # B is bytes
    (HEAD + '[vm.a]\nmemory = "256B"\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: '256B' is not a whole number of MiB"),
    # impossible addresses and ports
    (HEAD + '[network.u]\ntype = "user"\nforward = ["tcp:127.0.0.1:65536-:22"]\n' + VM,
     "lab.toml:5: network.u.forward[0]: 'tcp:127.0.0.1:65536-:22': host port 65536 is not 1-65535"),
    (HEAD + '[network.u]\ntype = "user"\nforward = ["udp::53-10.0.2.256:0"]\n' + VM,
     "lab.toml:5: network.u.forward[0]: 'udp::53-10.0.2.256:0': 10.0.2.256 is not an IPv4 address"),
    (HEAD + '[network.u]\ntype = "user"\nforward = ["tcp::0-:22"]\n' + VM,
     "lab.toml:5: network.u.forward[0]: 'tcp::0-:22': host port 0 is not 1-65535"),
    (HEAD + '[network.m]\ntype = "socket"\nmcast = "239.1.2.300:5000"\n' + VM,
     "lab.toml:5: network.m.mcast: '239.1.2.300:5000' is not a valid group:port (a multicast group "
     "224.0.0.0-239.255.255.255, a port 1-65535)"),
    # a table where an array of tables belongs
    (HEAD + VM + 'disk = {file = "x"}\n', "lab.toml:6: vm.a.disk: expected an array, got a table"),
    (HEAD + VM + 'nic = {network = "n"}\n', "lab.toml:6: vm.a.nic: expected an array, got a table"),
    (HEAD + VM + 'pci = {host = "15:00.0"}\n', "lab.toml:6: vm.a.pci: expected an array, got a table"),
    (HEAD + VM + 'disk = ["x"]\n', "lab.toml:6: vm.a.disk[0]: expected a table, got a string"),
    # a float where an integer or a size belongs
    (HEAD + '[vm.a]\nmemory = 256.0\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: expected a string or an integer, got a float"),
    (HEAD + VM + "cpus = 2.0\n", "lab.toml:6: vm.a.cpus: expected an integer, got a float"),
    (HEAD + '[network.n]\nmtu = 1500.0\n' + VM,
     "lab.toml:4: network.n.mtu: expected an integer, got a float"),
    (HEAD + '[vm.a]\nmemory = true\nkernel = "k"\n',
     "lab.toml:4: vm.a.memory: expected a string or an integer, got a boolean"),
    # TOML syntax, in plain words
    (HEAD + '[vm.a]\nmemory = 64\nkernel = "k\n',
     "lab.toml:5: TOML syntax error: unterminated string: a \"...\" or '...' string must end on the "
     "line it starts (column 12) (close it, or use \"\"\"...\"\"\" for text of several lines)"),
    (HEAD + '[vm.a]\nmemory = 64\nkernel = """k\n',
     "lab.toml:5: TOML syntax error: unterminated string: the file ends inside it (close the string)"),
    (HEAD + '[vm.a]\nmemory = 64\nkernel = "k\x01"\n',
     "lab.toml:5: TOML syntax error: Illegal character '\\x01' (control characters must be written "
     "as escapes, e.g. \\u0000) (column 12)"),
])
def test_hardening_bad_input(tmp_path: Path, text: str, expected: str) -> None:
    assert problems(tmp_path, text) == [expected]


def test_memory_up_to_16t_is_fine(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = "16T"\nkernel = "k"\n')
    assert load_lab(spec).vms[0].memory_mib == 16 << 20


# --- sizes: one rule for every key ------------------------------------------------------------------

IMAGE = f'[image.deb]\nurl = "https://example.org/debian.qcow2"\nsha512 = "{"ab" * 64}"\n'


@pytest.mark.parametrize(("size", "expected"), [
    ("1024", 1 << 30), ('"2048"', 2 << 30), ('" 512 "', 512 << 20), ('"1.5"', 1536 << 10),
    (1048575, 1048575 << 20), ('"64M"', 64 << 20), ('"1.5GiB"', 1536 << 20), ('"64k"', 64 << 10),
    ('"20 G"', 20 << 30), ('"1073741824B"', 1 << 30), ('"4096 b"', 4096),
])
def test_a_bare_disk_size_is_mib_like_every_size(tmp_path: Path, size: str | int, expected: int) -> None:
    spec = write_spec(tmp_path, HEAD + VM + f'[[vm.a.disk]]\nfile = "d.img"\nsize = {size}\n'
                      + IMAGE + f'[vm.g]\nmemory = 64\nimage = "deb"\ndisk_size = {size}\n')
    a, g = load_lab(spec).vms
    assert (a.disks[0].size, g.disk_size) == (expected, expected)


@pytest.mark.parametrize("size", ["1073741824", '"1073741824"'])
def test_a_bare_disk_size_meant_as_bytes_is_refused_and_told(tmp_path: Path, size: str) -> None:
    """A bare disk size was bytes in earlier versions: as MiB, any byte count of 1 MiB or more makes a
    disk of a TiB or more, refused with how to write bytes."""
    found = problems(tmp_path, HEAD + VM + f'[[vm.a.disk]]\nfile = "d"\nsize = {size}\n'
                     + IMAGE + f'[vm.g]\nmemory = 64\nimage = "deb"\ndisk_size = {size}\n')
    said = ("1073741824 MiB (a bare number is MiB) would make a 1024T disk; a bare disk size meant bytes "
            "in earlier vmlaunch versions, so one of 1T or more is refused (bytes take a B suffix: "
            "\"1073741824B\", that is \"1G\"; write a disk of 1T or more with a unit: \"1024T\")")
    assert found == [f"lab.toml:8: vm.a.disk[0].size: {said}", f"lab.toml:15: vm.g.disk_size: {said}"]


def test_a_huge_bare_disk_size_says_its_unit_and_the_limit(tmp_path: Path) -> None:
    found = problems(tmp_path, HEAD + VM + '[[vm.a.disk]]\nfile = "d"\nsize = 10737418240\n')
    assert found == ["lab.toml:8: vm.a.disk[0].size: 10737418240 MiB (a bare number is MiB) would make a "
                     "10240T disk; a bare disk size meant bytes in earlier vmlaunch versions, so one of 1T "
                     "or more is refused (bytes take a B suffix: \"10737418240B\", that is \"10G\"; a disk "
                     "image is at most 1024T)"]


@pytest.mark.parametrize(("text", "expected"), [
    ("memory = 134217728", "134217728 MiB (a bare number is MiB) is more memory than a VM can have; at most "
                           "16T (16 TiB)"),
    ('memory = "16777217"', "16777217 MiB (a bare number is MiB) is more memory than a VM can have; at "
                            "most 16T (16 TiB)"),
    ('memory = "8"', "8 MiB (a bare number is MiB) is too little memory; at least 16M (16 MiB)"),
    ('memory = "64.5"', "64.5 MiB (a bare number is MiB) is not a whole number of MiB"),
    ("memory = 0", "0 MiB (a bare number is MiB) is no size"),
    ("memory = -64", "-64 MiB (a bare number is MiB) is negative"),
])
def test_a_bare_memory_says_it_is_mib(tmp_path: Path, text: str, expected: str) -> None:
    found = problems(tmp_path, HEAD + f'[vm.a]\n{text}\nkernel = "k"\n')
    assert found == [f"lab.toml:4: vm.a.memory: {expected}"]


@given(st.text(alphabet=" 0123456789.kKmMgGtTiIbBx", max_size=8))
def test_the_schema_takes_the_shape_of_size_that_parse_size_takes(text: str) -> None:
    """An editor with the schema flags "128MB" too: the size pattern refuses what parse_size refuses
    for its shape (not a size, or MB and the like), and no more."""
    import json

    from vmlaunch.core.units import parse_size
    from vmlaunch.spec.load import SCHEMA_FILE, _ecma_search

    pattern = json.loads(SCHEMA_FILE.read_text())["$defs"]["size"]["pattern"]
    try:
        parse_size(text)
        shape = True
    except ValueError as exc:
        shape = "is not a size" not in str(exc) and "is ambiguous" not in str(exc)
    assert _ecma_search(pattern, text) == shape


@pytest.mark.parametrize(("value", "meaning"), [
    ("128MB", "MB is ambiguous (10^6 or 2^20 bytes?); vmlaunch sizes are binary: write 128M (= 128 MiB = "
              "134217728 bytes)"),
    ("2gb", "GB is ambiguous (10^9 or 2^30 bytes?); vmlaunch sizes are binary: write 2G (= 2 GiB = "
            "2147483648 bytes)"),
    ("512 MB", "MB is ambiguous (10^6 or 2^20 bytes?); vmlaunch sizes are binary: write 512M (= 512 MiB = "
               "536870912 bytes)"),
    ("1 TB", "TB is ambiguous (10^12 or 2^40 bytes?); vmlaunch sizes are binary: write 1T (= 1 TiB = "
             "1099511627776 bytes)"),
    ("65536kb", "KB is ambiguous (10^3 or 2^10 bytes?); vmlaunch sizes are binary: write 65536K (= 65536 "
                "KiB = 67108864 bytes)"),
])
def test_mb_and_gb_are_refused_for_every_size_key(tmp_path: Path, value: str, meaning: str) -> None:
    text = (HEAD + f'[lab.memory]\nbudget = "{value}"\n'
            + f'[vm.a]\nmemory = "{value}"\nkernel = "k"\n[vm.a.balloon]\nmin = "{value}"\n'
            + f'[[vm.a.disk]]\nfile = "d"\nsize = "{value}"\n'
            + IMAGE + f'[vm.g]\nmemory = 64\nimage = "deb"\ndisk_size = "{value}"\n')
    found = problems(tmp_path, text)
    keys = ["4: lab.memory.budget", "6: vm.a.memory", "9: vm.a.balloon.min", "12: vm.a.disk[0].size",
            "19: vm.g.disk_size"]
    assert found == [f"lab.toml:{key}: {value!r}: {meaning}" for key in keys]



def test_every_unknown_key_once(tmp_path: Path) -> None:
    found = problems(tmp_path, '[lab]\nname = "t"\nfoo = 1\nbar = 2\n' + VM + "x = 1\ny = 2\n")
    assert [line.split(": ")[1] for line in found] == ["lab.foo", "lab.bar", "vm.a.x", "vm.a.y"]


@pytest.mark.parametrize(("text", "expected"), [
    # a bad network type: once, and no "unknown key" for a key of the kind it meant
    (HEAD + '[network.u]\ntype = "usr"\nforward = ["tcp::2222-:22"]\n' + VM,
     ["lab.toml:4: network.u.type: 'usr' is not one of bridge, user, socket, tap"]),
    (HEAD + '[network.u]\ntype = 5\n' + VM,
     ["lab.toml:4: network.u.type: 5 is not one of bridge, user, socket, tap"]),
    (HEAD + "network = {u = 5}\n" + VM, ["lab.toml:3: lab.network: unknown key 'network' (known keys: "
                                         "boot_parallel, mac_prefix, memory, name, placement)"]),
    ('network = {u = 5}\n' + HEAD + VM, ["lab.toml:1: network.u: expected a table, got an integer"]),
    ("", ["lab.toml:1: missing required key 'lab', 'vm'"]),
])
def test_each_problem_once(tmp_path: Path, text: str, expected: list[str]) -> None:
    assert problems(tmp_path, text) == expected


@pytest.mark.parametrize("kind", ["fifo", "directory", "device", "too large"])
def test_spec_must_be_a_regular_file_of_sane_size(tmp_path: Path, kind: str) -> None:
    from vmlaunch.spec.load import lab_name

    path = tmp_path / "lab.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path.write_text(HEAD + VM)
        os.truncate(path, 2 << 20)  # sparse: costs nothing
    for read in (load_lab, lab_name):
        with pytest.raises(SpecError, match="cannot read the spec: it is"):
            read(path)


def test_lab_name_of_a_broken_spec_is_still_a_valid_name(tmp_path: Path) -> None:
    """`down` of a spec edited since `up` takes the name alone, but only a name `up` could have used."""
    from vmlaunch.spec.load import lab_name

    assert lab_name(write_spec(tmp_path, '[lab]\nname = "t"\n[vm.a]\nmemory = "12X"\n')) == "t"
    for name in ("t\\n", "../t", "t\\u0000"):
        with pytest.raises(SpecError):
            lab_name(write_spec(tmp_path, f'[lab]\nname = "{name}"\n[vm.a]\nmemory = "12X"\n'))


# --- every problem at once (a mistake in one key never hides one in another) ------------------------


def test_every_problem_of_a_table_at_once(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[network.u]\ntype = "user"\n'
                      '[vm.a]\nmemory = "1.5M"\ncolour = "blue"\nkernel = "gone"\n'
                      '[[vm.a.nic]]\nnetwork = "u"\nmac = "01:00:00:00:00:01"\nspeed = 10\n'
                      '[[vm.a.disk]]\nfile = "d.img"\ncache = "unsafe"\nformt = "raw"\n')
    with pytest.raises(SpecError) as caught:
        load_checked(spec)
    assert [str(p).replace(str(spec), "lab.toml") for p in caught.value.problems] == [
        "lab.toml:6: vm.a.memory: '1.5M' is not a whole number of MiB",
        "lab.toml:7: vm.a.colour: unknown key 'colour' (known keys: accel, agent, append, balloon, "
        "cloud_init, cpu_model, cpu_pinning, cpus, disk, disk_size, fast_boot, firmware, host, hugepages, "
        "image, initrd, kernel, machine, memory, nic, numa_node, pci, reserve_hugepages, share, ssh, "
        "template, video)",
        f"lab.toml:8: vm.a.kernel: {tmp_path}/gone does not exist (relative paths are relative to the "
        "spec file)",
        "lab.toml:11: vm.a.nic[0].mac: '01:00:00:00:00:01' is a multicast address (the first octet must "
        "be even)",
        "lab.toml:12: vm.a.nic[0].speed: unknown key 'speed' (known keys: dns, gateway, ip, mac, model, "
        "netem, network, queues)",
        f"lab.toml:14: vm.a.disk[0].file: {tmp_path}/d.img does not exist (give the disk a size to have "
        "`up` create it)",
        "lab.toml:15: vm.a.disk[0].cache: cache = \"unsafe\" ignores flushes: a host crash corrupts the "
        "image (add accept_data_loss = true if that is fine)",
        "lab.toml:16: vm.a.disk[0].formt: unknown key 'formt' (did you mean 'format'?)",
    ]
    lines = [p.location.line for p in caught.value.problems]
    assert lines == sorted(lines) and len(lines) == 8


@pytest.mark.parametrize(("text", "expected"), [
    # a misspelt required key is one mistake, said once
    (HEAD + '[vm.a]\nmemroy = 64\nkernel = "k"\n',
     ["lab.toml:4: vm.a.memroy: unknown key 'memroy' (did you mean 'memory'?)"]),
    # a network of an unknown type still has its unknown keys reported
    (HEAD + '[network.u]\ntype = "usr"\nfowrard = ["tcp::2222-:22"]\n' + VM,
     ["lab.toml:4: network.u.type: 'usr' is not one of bridge, user, socket, tap",
      "lab.toml:5: network.u.fowrard: unknown key 'fowrard' (did you mean 'forward'?)"]),
    # a host port forwarded twice: QEMU would fail at up
    (HEAD + '[network.u]\ntype = "user"\nforward = ["tcp:127.0.0.1:2222-:22", "tcp::2222-:23"]\n' + VM,
     ["lab.toml:5: network.u.forward[1]: tcp host port 2222 is also forwarded at network.u.forward[0] "
      "(each forward needs its own host port)"]),
    (HEAD + '[network.u]\ntype = "user"\nforward = ["tcp::2222-:22"]\n[network.v]\ntype = "user"\n'
     'forward = ["udp::2222-:53", "tcp:127.0.0.2:2222-:22"]\n' + VM,
     ["lab.toml:8: network.v.forward[1]: tcp host port 2222 is also forwarded at network.u.forward[0] "
      "(each forward needs its own host port)"]),
    # TOML mistakes in plain words, at the line that has them
    (HEAD + '[vm.a]\nmemory = 64\nmemory = 128\n',
     ["lab.toml:5: TOML syntax error: this key already has a value (column 13) (give each key once "
      "per table)"]),
    (HEAD + '[vm.a]\nmemory = 64\n[vm.a]\nkernel = "k"\n',
     ["lab.toml:5: TOML syntax error: table [vm.a] is declared twice (column 6) (give each [table] "
      "once; add its keys there)"]),
    (HEAD + 'forward = ["a", "b"\n[vm.a]\nmemory = 128\n',
     ["lab.toml:3: TOML syntax error: unclosed array: '[' without its ']' (an array may span lines, "
      "but needs its ']' before the next key or [table])"]),
])
def test_one_mistake_one_line(tmp_path: Path, text: str, expected: list[str]) -> None:
    spec = write_spec(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        load_lab(spec)
    assert [str(p).replace(str(spec), "lab.toml") for p in caught.value.problems] == expected


def test_a_control_character_in_a_path_stays_on_the_line(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[vm.a]\nmemory = 64\nkernel = "C:\\new"\n')
    with pytest.raises(SpecError) as caught:
        load_checked(spec)
    (problem,) = caught.value.problems
    assert "\n" not in str(problem) and f'"{tmp_path}/C:\\new" does not exist' in str(problem)
