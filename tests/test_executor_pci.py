"""PCI pass-through through `up`: checked before anything changes, bound, and restored on rollback.

The device tree is fake (this machine has no IOMMU); QEMU is real and fails to open a host device that
does not exist, which is exactly the failure `up` must roll back from.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from tests.test_pci import IDS_E1000, FakeSysfs, sysfs  # noqa: F401 - the fixture
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.errors import HostError, RuntimeFailure
from vmlaunch.host.facts import detect_host
from vmlaunch.host.pci import PciError
from vmlaunch.runtime import executor
from vmlaunch.spec.load import load_lab

pytestmark = [pytest.mark.qemu, pytest.mark.fast]


def plan_for(tmp_path: Path, driver: str):  # type: ignore[no-untyped-def]
    spec = tmp_path / "lab.toml"
    spec.write_text(f'[lab]\nname = "pt"\n[vm.guest]\nmemory = 64\naccel = "tcg"\n'
                    f'[[vm.guest.disk]]\nfile = "guest.img"\nsize = "1M"\n'
                    f'[[vm.guest.pci]]\nhost = "15:00.0"\ndriver = "{driver}"\n')
    host = detect_host()
    # pci-stub needs legacy assignment; pretend this QEMU has it, so the real one fails to start.
    host = attrs.evolve(host, qemu=attrs.evolve(host.qemu, devices=host.qemu.devices | {"pci-assign"}))
    return compile_lab(load_lab(spec), host)


def test_non_viable_group_is_refused_before_anything_changes(
        tmp_path: Path, run_dir: Path, sysfs: FakeSysfs) -> None:  # noqa: F811
    sysfs.add("0000:15:00.0", group=7)
    sysfs.add("0000:15:00.1", ids=IDS_E1000, driver="e1000", group=7)  # same group, on a host driver
    plan = plan_for(tmp_path, "vfio-pci")
    with pytest.raises(PciError, match="0000:15:00.1.*e1000") as caught:
        executor.up(plan, spec=tmp_path / "lab.toml")
    assert str(caught.value).startswith(f"{tmp_path / 'lab.toml'}:10: vm.guest.pci[0].host: PCI 0000:15:00.0")
    assert sysfs.writes == []
    assert not (tmp_path / "guest.img").exists()
    assert not (run_dir / "pt").exists()


@pytest.mark.parametrize("driver", ["vfio-pci", "pci-stub"])
def test_failed_start_restores_the_original_driver(
        tmp_path: Path, run_dir: Path, sysfs: FakeSysfs, driver: str) -> None:  # noqa: F811
    sysfs.add("0000:15:00.0", group=3)
    plan = plan_for(tmp_path, driver)
    with pytest.raises((RuntimeFailure, HostError)) as info:
        executor.up(plan, spec=tmp_path / "lab.toml")
    assert "QEMU exited with status 1" in str(info.value)
    written = [path for path, _ in sysfs.writes]
    assert any(path.endswith(f"drivers/{driver}/bind") or path.endswith("driver_override")
               for path in written)  # it was bound ...
    assert sysfs.driver("0000:15:00.0") == "ixgbe"  # ... and given back
    assert not (tmp_path / "guest.img").exists()
    assert not (run_dir / "pt").exists()


def test_dry_run_says_a_device_that_is_not_there_is_refused(
        tmp_path: Path, run_dir: Path, sysfs: FakeSysfs) -> None:  # noqa: F811
    described = "\n".join(executor.describe(plan_for(tmp_path, "vfio-pci")))
    assert "PCI 0000:15:00.0 for guest: bind to vfio-pci [refused: PCI 0000:15:00.0: no such device" \
        in described
