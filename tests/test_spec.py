"""Parsing and validation: the example's model, and each class of bad input with message and line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EXAMPLES, write_spec
from vmlaunch.errors import SpecError
from vmlaunch.model import Accel, Aio, BridgeNetwork, CacheMode, DiskBus, DiskFormat, UserNetwork
from vmlaunch.naming import derive_mac
from vmlaunch.spec import load_lab

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
    (HEAD + "[vm.a]\nmemory = \n", "lab.toml:4: TOML syntax error: Invalid value (column 10)"),
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
     "lab.toml:4: vm.a.memory: 8 is too little memory (at least 16M)"),
    # bridge names
    (HEAD + '[network.n]\nbridge = "this-bridge-is-too-long"\n' + VM,
     "lab.toml:4: network.n.bridge: bridge 'this-bridge-is-too-long' is 23 bytes; interface "
     "names have at most 15"),
    (HEAD + '[network.n]\nbridge = "a/b"\n' + VM,
     "lab.toml:4: network.n.bridge: bridge 'a/b' is not a valid interface name (no '/', ':' or "
     "spaces; not '.' or '..')"),
    ('[lab]\nname = "a-long-lab-name"\n[network.network]\n' + VM,
     "lab.toml:3: network.network: bridge 'vl-a-long-lab-name-network' is 26 bytes; interface "
     "names have at most 15 (name it with bridge = \"...\")"),
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
    (HEAD + '[vm.a]\nmemory = 64\n', "lab.toml:3: vm.a: nothing to boot (add kernel = \"...\" or "
     "a [[disk]])"),
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
    import vmlaunch.spec as spec_module

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
