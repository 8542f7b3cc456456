"""Hugepages for real (2 MiB pages work on this machine): a VM's RAM from them, a reservation raised
for it and given back by `down` and by a failing `up`, and a pool too small refused before anything."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.cli import main

pytestmark = [pytest.mark.qemu, pytest.mark.guest, pytest.mark.host_wide]
POOL = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
READY = "VMLAUNCH-GUEST-READY"


def spec(tmp_path: Path, guest: Path, extra: str = "", second: str = "") -> Path:
    path = tmp_path / "lab.toml"
    path.write_text(f'[lab]\nname = "huge"\n[vm.a]\nmemory = "128M"\naccel = "tcg"\n'
                    f'kernel = "{guest}/vmlinuz"\ninitrd = "{guest}/initrd.gz"\nhugepages = "2M"\n'
                    f'{extra}{second}')
    return path


def pool() -> tuple[int, int]:
    return int((POOL / "nr_hugepages").read_text()), int((POOL / "free_hugepages").read_text())


@pytest.fixture
def untouched_pool() -> Iterator[tuple[int, int]]:
    """The host's pool as it was; put back whatever a failing test left."""
    if not POOL.is_dir() or not (POOL / "nr_hugepages").stat().st_mode & 0o200:
        pytest.skip("no 2 MiB hugepages pool to write here")
    before = pool()
    yield before
    (POOL / "nr_hugepages").write_text(f"{before[0]}\n")


def test_a_reserved_pool_is_raised_for_the_vm_and_given_back(
        tmp_path: Path, run_dir: Path, test_guest: Path, untouched_pool: tuple[int, int]) -> None:
    nr, free = untouched_pool
    lab = spec(tmp_path, test_guest, "reserve_hugepages = true\n")
    assert main(["up", str(lab), "--wait-for", READY, "--timeout", "60"]) == 0
    try:
        assert pool() == (nr + 64, free)  # 64 pages added, all 64 taken by the guest's RAM
    finally:
        assert main(["down", str(lab)]) == 0
    assert pool() == (nr, free)


def test_a_pool_too_small_is_refused_before_anything_changes(
        tmp_path: Path, run_dir: Path, test_guest: Path, untouched_pool: tuple[int, int],
        capsys: pytest.CaptureFixture[str]) -> None:
    nr, free = untouched_pool
    lab = spec(tmp_path, test_guest)
    if free >= 64:
        pytest.skip("the host has 64 free 2 MiB hugepages already")
    assert main(["up", str(lab)]) == 3
    err = capsys.readouterr().err
    assert f"a need 64 2M hugepages, and the host has {free} free" in err
    assert f"echo {nr + 64 - free} > {POOL}/nr_hugepages" in err
    assert pool() == (nr, free) and not (run_dir / "huge").exists()


def test_a_failing_up_gives_the_reserved_pages_back(
        tmp_path: Path, run_dir: Path, test_guest: Path, untouched_pool: tuple[int, int]) -> None:
    """b's "kernel" is no kernel: its QEMU fails after a's pages were reserved."""
    (tmp_path / "junk").write_bytes(b"not a kernel" * 100)
    second = f'[vm.b]\nmemory = "64M"\naccel = "tcg"\nkernel = "{tmp_path}/junk"\n'
    lab = spec(tmp_path, test_guest, "reserve_hugepages = true\n", second)
    assert main(["up", str(lab)]) == 4
    assert pool() == untouched_pool
