"""The memory keys of the spec ([lab.memory], [vm.V.balloon] policy and min, hugepages): their checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmlaunch.errors import SpecError
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import BalloonPolicy, HugepageSize, LabMemory, balloon_min_mib

VM = '[vm.{name}]\nmemory = "{memory}"\nkernel = "k"\n'


def spec(tmp_path: Path, text: str) -> Path:
    (tmp_path / "k").write_bytes(b"kernel")
    path = tmp_path / "lab.toml"
    path.write_text('[lab]\nname = "mem"\n' + text)
    return path


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_lab(spec(tmp_path, text))
    return [str(p).replace(str(tmp_path / "lab.toml"), "lab.toml") for p in caught.value.problems]


def test_the_memory_keys_reach_the_model(tmp_path: Path) -> None:
    lab = load_lab(spec(tmp_path, '[lab.memory]\nbudget = "1G"\nksm = true\nksm_pages_to_scan = 1000\n'
                                  'ksm_sleep_ms = 20\n'
                                  + VM.format(name="db", memory="512M")
                                  + '[vm.db.balloon]\npolicy = "auto"\nmin = "128M"\n'
                                  + VM.format(name="cache", memory="256M")
                                  + 'hugepages = "2M"\nreserve_hugepages = true\n'))
    assert lab.memory == LabMemory(budget_mib=1024, ksm=True, ksm_pages_to_scan=1000, ksm_sleep_ms=20)
    db, cache = lab.vms
    assert (db.balloon.policy, db.balloon.min_mib, balloon_min_mib(db)) == (BalloonPolicy.AUTO, 128, 128)
    assert (cache.hugepages, cache.reserve_hugepages) == (HugepageSize.SIZE_2M, True)
    assert cache.balloon.policy is BalloonPolicy.MANUAL


@pytest.mark.parametrize(("memory", "least"), [("1G", 256), ("128M", 64), ("48M", 48)])
def test_the_default_min_is_a_quarter_at_least_64m(tmp_path: Path, memory: str, least: int) -> None:
    lab = load_lab(spec(tmp_path, VM.format(name="a", memory=memory) + '[vm.a.balloon]\npolicy = "auto"\n'))
    assert balloon_min_mib(lab.vms[0]) == least


@pytest.mark.parametrize(("text", "expected"), [
    (VM.format(name="a", memory="256M") + '[vm.a.balloon]\nmin = "300M"\n',
     ["lab.toml:7: vm.a.balloon.min: 300M is above the VM's memory (256M)"]),
    ('[lab.memory]\nbudget = "300M"\n' + VM.format(name="a", memory="256M")
     + '[vm.a.balloon]\npolicy = "auto"\nmin = "96M"\n' + VM.format(name="b", memory="256M"),
     ["lab.toml:4: lab.memory.budget: 300M is below what the VMs keep at least (352M: the balloon.min "
      "of VMs with policy = \"auto\", the memory of the others)"]),
    (VM.format(name="a", memory="255M") + 'hugepages = "2M"\n',
     ["lab.toml:4: vm.a.memory: 255M is not a whole number of 2M hugepages"]),
    (VM.format(name="a", memory="1536M") + 'hugepages = "1G"\n',
     ["lab.toml:4: vm.a.memory: 1536M is not a whole number of 1G hugepages"]),
    (VM.format(name="a", memory="256M") + 'reserve_hugepages = true\n',
     ["lab.toml:6: vm.a.reserve_hugepages: reserve_hugepages needs hugepages"]),
    (VM.format(name="a", memory="256M") + 'hugepages = "2M"\n[vm.a.balloon]\npolicy = "auto"\n',
     ["lab.toml:8: vm.a.balloon.policy: a VM on hugepages cannot give memory back through its balloon "
      "(the host frees whole hugepages only)"]),
    (VM.format(name="a", memory="256M") + '[vm.a.balloon]\nenabled = false\npolicy = "auto"\n',
     ["lab.toml:8: vm.a.balloon.policy: policy = \"auto\" needs the balloon"]),
    (VM.format(name="a", memory="256M") + 'hugepages = "4M"\n',
     ["lab.toml:6: vm.a.hugepages: '4M' is not one of 2M, 1G"]),
    ('[lab.memory]\nksm = "yes"\nbudget = "lots"\n' + VM.format(name="a", memory="256M"),
     ["lab.toml:4: lab.memory.ksm: expected true or false, got a string",
      "lab.toml:5: lab.memory.budget: 'lots' is not a size (examples: 256M, 2G, 1.5G)"]),
])
def test_memory_mistakes(tmp_path: Path, text: str, expected: list[str]) -> None:
    """Each problem once, at its line (its hint after it, in brackets)."""
    found = problems(tmp_path, text)
    assert len(found) == len(expected) and all(f.startswith(e) for f, e in zip(found, expected)), found


@pytest.mark.parametrize("number", ["{n}", '"{n}"', '" {n} "'])
def test_a_bare_number_is_mib_for_every_memory_key(tmp_path: Path, number: str) -> None:
    """memory, balloon.min and lab.memory.budget: an integer or digits alone count MiB."""
    lab = load_lab(spec(tmp_path, f"[lab.memory]\nbudget = {number.format(n=2048)}\n"
                                  f'[vm.a]\nmemory = {number.format(n=512)}\nkernel = "k"\n'
                                  f'[vm.a.balloon]\npolicy = "auto"\nmin = {number.format(n=128)}\n'))
    assert (lab.memory.budget_mib, lab.vms[0].memory_mib, lab.vms[0].balloon.min_mib) == (2048, 512, 128)


@pytest.mark.parametrize(("text", "expected"), [
    ('[lab.memory]\nbudget = 0\n' + VM.format(name="a", memory="256M"),
     "lab.toml:4: lab.memory.budget: 0 MiB (a bare number is MiB) is no size"),
    (VM.format(name="a", memory="256M") + '[vm.a.balloon]\nmin = 0\n',
     "lab.toml:7: vm.a.balloon.min: 0 MiB (a bare number is MiB) is no size"),
    (VM.format(name="a", memory="256M") + '[vm.a.balloon]\nmin = "0.5"\n',
     "lab.toml:7: vm.a.balloon.min: 0.5 MiB (a bare number is MiB) is not a whole number of MiB"),
    ('[lab.memory]\nbudget = "4 GB"\n' + VM.format(name="a", memory="256M"),
     "lab.toml:4: lab.memory.budget: '4 GB': GB is ambiguous (10^9 or 2^30 bytes?); vmlaunch sizes are "
     "binary: write 4G (= 4 GiB = 4294967296 bytes)"),
    (VM.format(name="a", memory="256 mb"),
     "lab.toml:4: vm.a.memory: '256 mb': MB is ambiguous (10^6 or 2^20 bytes?); vmlaunch sizes are "
     "binary: write 256M (= 256 MiB = 268435456 bytes)"),
])
def test_memory_size_messages_name_their_unit(tmp_path: Path, text: str, expected: str) -> None:
    assert problems(tmp_path, text) == [expected]
