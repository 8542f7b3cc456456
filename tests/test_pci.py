"""PCI binding against a fake sysfs tree and a small simulated kernel behind its write-only files.

This machine has no IOMMU and no device to pass through: `FakeSysfs` builds the tree
(bus/pci/devices/BDF/{vendor,device,class,driver_override}, `driver` and `iommu_group` symlinks,
kernel/iommu_groups/N/devices/BDF, bus/pci/drivers/NAME/{bind,unbind,new_id,remove_id}, bus/pci/drivers_probe)
and replaces `vmlaunch.pci._write` with `FakeSysfs.write`, which records every write in order and applies
what the kernel would do.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.errors import EXIT_HOST
from vmlaunch.host import pci
from vmlaunch.host.pci import Binding, PciError, bind, check_viable, restore, sysfs_root
from vmlaunch.lab.journal import Entry, Journal
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.base import Context
from vmlaunch.resources.pci import PciBind
from vmlaunch.spec.model import PciDriver

NIC = "0000:15:00.0"
NIC2 = "0000:15:00.1"
OTHER = "0000:16:00.0"
BRIDGE = "0000:00:1c.0"
IDS_82599 = ("8086", "10fb")
IDS_E1000 = ("8086", "100e")
IDS_BRIDGE = ("8086", "a110")
# The id tables of the fake drivers: what the kernel's default match binds on drivers_probe.
NATIVE = {IDS_82599: "ixgbe", IDS_E1000: "e1000", IDS_BRIDGE: "pcieport"}


class FakeSysfs:
    """A sysfs tree and the kernel behind it; all state is on disk but pci-stub's dynamic ids."""

    def __init__(self, root: Path, build: bool = True) -> None:
        """A new tree at `root`, or (build=False) a fresh kernel over the tree already there."""
        self.root = root
        self.writes: list[tuple[str, str]] = []
        self.failures: dict[str, int] = {}  # path relative to root -> errno the write fails with
        self.refuse: set[str] = set()  # drivers whose probe fails (the device stays unbound)
        self.dynids: dict[str, set[tuple[str, str]]] = {}
        if not build:
            return
        (root / "bus/pci/devices").mkdir(parents=True)
        (root / "kernel/iommu_groups").mkdir(parents=True)
        (root / "bus/pci/drivers_probe").write_text("")
        for name in ("ixgbe", "e1000", "pcieport", "vfio-pci", "pci-stub"):
            self.load(name)

    # building the tree

    def load(self, driver: str) -> None:
        path = self.root / "bus/pci/drivers" / driver
        path.mkdir(parents=True, exist_ok=True)
        for name in ("bind", "unbind", "new_id", "remove_id"):
            (path / name).write_text("")

    def unload(self, driver: str) -> None:
        shutil.rmtree(self.root / "bus/pci/drivers" / driver)

    def add(self, bdf: str, ids: tuple[str, str] = IDS_82599, cls: str = "0x020000",
            driver: str | None = "ixgbe", group: int | None = 1) -> None:
        dev = self.dev(bdf)
        dev.mkdir()
        (dev / "vendor").write_text(f"0x{ids[0]}\n")
        (dev / "device").write_text(f"0x{ids[1]}\n")
        (dev / "class").write_text(f"{cls}\n")
        (dev / "driver_override").write_text("(null)\n")
        if driver is not None:
            self.attach(bdf, driver)
        if group is not None:
            members = self.root / "kernel/iommu_groups" / str(group) / "devices"
            members.mkdir(parents=True, exist_ok=True)
            (dev / "iommu_group").symlink_to(f"../../../../kernel/iommu_groups/{group}")
            (members / bdf).symlink_to(f"../../../../bus/pci/devices/{bdf}")

    def remove(self, bdf: str) -> None:
        shutil.rmtree(self.dev(bdf))

    def dev(self, bdf: str) -> Path:
        return self.root / "bus/pci/devices" / bdf

    def attach(self, bdf: str, driver: str) -> None:
        (self.dev(bdf) / "driver").symlink_to(f"../../drivers/{driver}")

    # reading state

    def driver(self, bdf: str) -> str | None:
        link = self.dev(bdf) / "driver"
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    def override(self, bdf: str) -> str:
        return (self.dev(bdf) / "driver_override").read_text().strip()

    def ids(self, bdf: str) -> tuple[str, str]:
        return ((self.dev(bdf) / "vendor").read_text().strip()[2:],
                (self.dev(bdf) / "device").read_text().strip()[2:])

    def loaded(self, driver: str) -> bool:
        return (self.root / "bus/pci/drivers" / driver).is_dir()

    # the kernel

    def write(self, path: Path, text: str) -> None:
        rel = path.relative_to(self.root).as_posix()
        self.writes.append((rel, text))
        if rel in self.failures:
            code = self.failures[rel]
            raise OSError(code, os.strerror(code), str(path))
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        parts = rel.split("/")
        if parts[:3] == ["bus", "pci", "drivers_probe"]:
            self._need_device(text)
            self._probe(text)
        elif parts[:3] == ["bus", "pci", "drivers"]:
            getattr(self, "_" + parts[4])(parts[3], text)
        elif parts[:3] == ["bus", "pci", "devices"] and parts[4] == "driver_override":
            path.write_text((text.rstrip("\n") or "(null)") + "\n")
        elif parts[:3] == ["bus", "pci", "devices"] and parts[4:] == ["driver", "unbind"]:
            self._unbind(os.path.basename(os.readlink(self.dev(parts[3]) / "driver")), text)
        else:
            raise AssertionError(f"the fake kernel does not know {rel}")

    def _fail(self, code: int) -> OSError:
        return OSError(code, os.strerror(code))

    def _need_device(self, bdf: str) -> None:
        if not self.dev(bdf).is_dir():
            raise self._fail(errno.ENODEV)

    def _matches(self, bdf: str, driver: str) -> bool:
        override = self.override(bdf)
        if override != "(null)":
            return override == driver
        return NATIVE.get(self.ids(bdf)) == driver or self.ids(bdf) in self.dynids.get(driver, set())

    def _try_attach(self, bdf: str, driver: str) -> bool:
        if driver in self.refuse or (driver == "vfio-pci" and not (self.dev(bdf) / "iommu_group").exists()):
            return False  # the driver's probe failed
        self.attach(bdf, driver)
        return True

    def _probe(self, bdf: str) -> None:
        if self.driver(bdf) is not None:
            return
        for driver in sorted(os.listdir(self.root / "bus/pci/drivers")):
            if self._matches(bdf, driver) and self._try_attach(bdf, driver):
                return

    def _bind(self, driver: str, bdf: str) -> None:
        self._need_device(bdf)
        if self.driver(bdf) is not None:
            raise self._fail(errno.EBUSY)
        if not self._matches(bdf, driver) or not self._try_attach(bdf, driver):
            raise self._fail(errno.ENODEV)

    def _unbind(self, driver: str, bdf: str) -> None:
        self._need_device(bdf)
        if self.driver(bdf) != driver:
            raise self._fail(errno.ENODEV)
        (self.dev(bdf) / "driver").unlink()

    def _new_id(self, driver: str, text: str) -> None:
        vendor, device = text.split()
        ids = self.dynids.setdefault(driver, set())
        if (vendor, device) in ids:
            raise self._fail(errno.EEXIST)
        ids.add((vendor, device))
        for bdf in sorted(os.listdir(self.root / "bus/pci/devices")):  # the kernel's driver_attach
            if self.driver(bdf) is None and self._matches(bdf, driver):
                self._try_attach(bdf, driver)

    def _remove_id(self, driver: str, text: str) -> None:
        vendor, device = text.split()
        if (vendor, device) not in self.dynids.get(driver, set()):
            raise self._fail(errno.ENODEV)
        self.dynids[driver].discard((vendor, device))


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSysfs]:
    fake = FakeSysfs(tmp_path / "sys")
    monkeypatch.setattr(pci, "_write", fake.write)
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(fake.root))
    yield fake


def dev(bdf: str, name: str) -> str:
    return f"bus/pci/devices/{bdf}/{name}"


def drv(driver: str, name: str) -> str:
    return f"bus/pci/drivers/{driver}/{name}"


PROBE = "bus/pci/drivers_probe"


# --- sysfs_root ---------------------------------------------------------------------------------------


def test_sysfs_root_honours_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(tmp_path))
    assert sysfs_root() == tmp_path
    monkeypatch.setenv("VMLAUNCH_SYSFS", "")
    assert sysfs_root() == Path("/sys")
    monkeypatch.delenv("VMLAUNCH_SYSFS")
    assert sysfs_root() == Path("/sys")


def test_root_none_means_the_environment(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.VFIO)  # no root: VMLAUNCH_SYSFS
    assert sysfs.driver(NIC) == "vfio-pci"
    restore(binding)
    assert sysfs.driver(NIC) == "ixgbe"


# --- vfio-pci -----------------------------------------------------------------------------------------


def test_vfio_bind_and_restore_exact_writes(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.VFIO, sysfs.root)
    assert binding == Binding(address=NIC, driver="vfio-pci", original_driver="ixgbe")
    assert sysfs.writes == [
        (dev(NIC, "driver_override"), "vfio-pci"),
        (dev(NIC, "driver/unbind"), NIC),
        (PROBE, NIC),
    ]
    assert sysfs.driver(NIC) == "vfio-pci"

    sysfs.writes.clear()
    restore(binding, sysfs.root)
    assert sysfs.writes == [
        (drv("vfio-pci", "unbind"), NIC),
        (dev(NIC, "driver_override"), "\n"),
        (drv("ixgbe", "bind"), NIC),
    ]
    assert sysfs.driver(NIC) == "ixgbe"
    assert sysfs.override(NIC) == "(null)"


def test_unbound_device_is_bound_and_restored_to_unbound(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC, driver=None)
    binding = bind(NIC, PciDriver.VFIO, sysfs.root)
    assert binding.original_driver is None
    assert sysfs.writes == [(dev(NIC, "driver_override"), "vfio-pci"), (PROBE, NIC)]

    sysfs.writes.clear()
    restore(binding, sysfs.root)
    assert sysfs.writes == [(drv("vfio-pci", "unbind"), NIC), (dev(NIC, "driver_override"), "\n")]
    assert sysfs.driver(NIC) is None  # not handed to ixgbe: it was unbound before


@pytest.mark.parametrize("driver", list(PciDriver))
def test_already_on_the_wanted_driver_is_a_no_op(sysfs: FakeSysfs, driver: PciDriver) -> None:
    sysfs.add(NIC, driver=driver.value)
    binding = bind(NIC, driver, sysfs.root)
    assert binding == Binding(NIC, driver.value, original_driver=driver.value, changed=False)
    restore(binding, sysfs.root)
    assert sysfs.writes == []
    assert sysfs.driver(NIC) == driver.value


def test_restore_is_idempotent(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.VFIO, sysfs.root)
    restore(binding, sysfs.root)
    sysfs.writes.clear()
    restore(binding, sysfs.root)
    assert sysfs.writes == []
    assert sysfs.driver(NIC) == "ixgbe"


def test_restore_after_someone_gave_it_back_by_hand(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.VFIO, sysfs.root)
    sysfs.write(sysfs.root / drv("vfio-pci", "unbind"), NIC)
    sysfs.write(sysfs.root / dev(NIC, "driver_override"), "\n")
    sysfs.write(sysfs.root / drv("ixgbe", "bind"), NIC)
    sysfs.writes.clear()
    restore(binding, sysfs.root)
    assert sysfs.writes == []


def test_restore_a_vanished_device_is_a_silent_no_op(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.VFIO, sysfs.root)
    sysfs.remove(NIC)
    sysfs.writes.clear()
    restore(binding, sysfs.root)
    assert sysfs.writes == []


def test_restore_falls_back_to_drivers_probe(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.VFIO, sysfs.root)
    sysfs.failures[drv("ixgbe", "bind")] = errno.EBUSY
    sysfs.writes.clear()
    restore(binding, sysfs.root)
    assert sysfs.writes[-2:] == [(drv("ixgbe", "bind"), NIC), (PROBE, NIC)]
    assert sysfs.driver(NIC) == "ixgbe"


def test_restore_when_the_original_driver_is_gone(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.VFIO, sysfs.root)
    sysfs.unload("ixgbe")
    with pytest.raises(PciError) as caught:
        restore(binding, sysfs.root)
    assert sysfs.writes[-1] == (PROBE, NIC)  # no bind file to write: the default match is the fallback
    message = str(caught.value)
    assert f"PCI {NIC}: could not give it back to ixgbe" in message
    assert "modprobe ixgbe" in message
    assert sysfs.driver(NIC) is None and sysfs.override(NIC) == "(null)"


def test_vfio_bind_failure_rolls_back_with_the_file_and_errno(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    sysfs.failures[PROBE] = errno.EINVAL
    with pytest.raises(PciError) as caught:
        bind(NIC, PciDriver.VFIO, sysfs.root)
    message = str(caught.value)
    assert f"PCI {NIC}: writing '{NIC}' to {sysfs.root / PROBE} failed: Invalid argument (EINVAL)" in message
    assert "hint:" in message
    assert caught.value.exit_code == EXIT_HOST
    assert sysfs.driver(NIC) == "ixgbe" and sysfs.override(NIC) == "(null)"
    assert sysfs.writes[3:] == [(dev(NIC, "driver_override"), "\n"), (drv("ixgbe", "bind"), NIC)]


def test_vfio_bind_verifies_the_driver_took_it(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    sysfs.refuse.add("vfio-pci")  # probe fails quietly, as vfio-pci does without a usable IOMMU group
    with pytest.raises(PciError, match=r"not on vfio-pci after binding: it is unbound"):
        bind(NIC, PciDriver.VFIO, sysfs.root)
    assert sysfs.driver(NIC) == "ixgbe" and sysfs.override(NIC) == "(null)"


def test_busy_unbind_is_a_pci_error_and_nothing_is_left_changed(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    sysfs.failures[dev(NIC, "driver/unbind")] = errno.EBUSY
    with pytest.raises(PciError, match=r"Device or resource busy \(EBUSY\)") as caught:
        bind(NIC, PciDriver.VFIO, sysfs.root)
    assert str(sysfs.root / dev(NIC, "driver/unbind")) in str(caught.value)
    assert sysfs.driver(NIC) == "ixgbe" and sysfs.override(NIC) == "(null)"


# --- pci-stub -----------------------------------------------------------------------------------------


def test_pci_stub_bind_and_restore_exact_writes(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    binding = bind(NIC, PciDriver.PCI_STUB, sysfs.root)
    assert binding == Binding(address=NIC, driver="pci-stub", original_driver="ixgbe", ids="8086 10fb")
    assert sysfs.writes == [
        (drv("pci-stub", "new_id"), "8086 10fb"),
        (dev(NIC, "driver/unbind"), NIC),
        (drv("pci-stub", "bind"), NIC),
        (drv("pci-stub", "remove_id"), "8086 10fb"),
    ]
    assert sysfs.driver(NIC) == "pci-stub"
    assert sysfs.dynids["pci-stub"] == set()

    sysfs.writes.clear()
    restore(binding, sysfs.root)
    assert sysfs.writes == [(drv("pci-stub", "unbind"), NIC), (drv("ixgbe", "bind"), NIC)]
    assert sysfs.driver(NIC) == "ixgbe"


def test_pci_stub_new_id_grabbing_it_is_fine(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC, driver=None)
    binding = bind(NIC, PciDriver.PCI_STUB, sysfs.root)
    # new_id bound the unbound device already: no bind write, remove_id still follows.
    assert sysfs.writes == [(drv("pci-stub", "new_id"), "8086 10fb"),
                            (drv("pci-stub", "remove_id"), "8086 10fb")]
    assert sysfs.driver(NIC) == "pci-stub"
    restore(binding, sysfs.root)
    assert sysfs.driver(NIC) is None


def test_pci_stub_bind_error_after_new_id_grabbed_it_is_tolerated(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)

    def grabbed_meanwhile(driver: str, bdf: str) -> None:  # the dynamic id matched first: bind says busy
        sysfs.attach(bdf, driver)
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    sysfs._bind = grabbed_meanwhile  # type: ignore[method-assign]
    binding = bind(NIC, PciDriver.PCI_STUB, sysfs.root)
    assert sysfs.driver(NIC) == "pci-stub" and binding.changed
    assert sysfs.writes[-1] == (drv("pci-stub", "remove_id"), "8086 10fb")


def test_pci_stub_lets_go_of_other_unbound_devices_new_id_grabbed(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    sysfs.add(NIC2, driver=None)  # the other port, unbound: new_id binds it to pci-stub too
    bind(NIC, PciDriver.PCI_STUB, sysfs.root)
    assert sysfs.driver(NIC) == "pci-stub"
    assert sysfs.driver(NIC2) is None
    assert sysfs.writes[-1] == (drv("pci-stub", "unbind"), NIC2)


def test_pci_stub_bind_failure_removes_the_id_and_rolls_back(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    sysfs.failures[drv("pci-stub", "bind")] = errno.ENODEV
    with pytest.raises(PciError, match=r"pci-stub/bind failed: No such device \(ENODEV\)"):
        bind(NIC, PciDriver.PCI_STUB, sysfs.root)
    assert [w[0] for w in sysfs.writes] == [drv("pci-stub", "new_id"), dev(NIC, "driver/unbind"),
                                             drv("pci-stub", "bind"), drv("pci-stub", "remove_id"),
                                             drv("ixgbe", "bind")]
    assert sysfs.driver(NIC) == "ixgbe" and sysfs.dynids["pci-stub"] == set()


def test_pci_stub_existing_dynamic_id_is_not_ours_to_remove(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    sysfs.dynids["pci-stub"] = {IDS_82599}
    binding = bind(NIC, PciDriver.PCI_STUB, sysfs.root)
    assert binding.ids is None
    assert drv("pci-stub", "remove_id") not in [w[0] for w in sysfs.writes]
    assert sysfs.dynids["pci-stub"] == {IDS_82599}


# --- check_viable -------------------------------------------------------------------------------------


def test_viable_group(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC, group=7)
    sysfs.add(NIC2, group=7)  # on ixgbe, but passed through too
    sysfs.add(OTHER, ids=IDS_E1000, driver=None, group=7)  # unbound
    sysfs.add("0000:16:00.1", ids=IDS_E1000, driver="vfio-pci", group=7)
    sysfs.add("0000:16:00.2", ids=IDS_E1000, driver="pci-stub", group=7)
    check_viable([NIC, NIC2], sysfs.root)
    assert sysfs.writes == []


def test_bridge_in_the_group_is_fine(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC, group=3)
    sysfs.add(BRIDGE, ids=IDS_BRIDGE, cls="0x060400", driver="pcieport", group=3)
    check_viable([NIC], sysfs.root)


def test_non_viable_group_is_refused_before_any_write(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC, group=7)
    sysfs.add(OTHER, ids=IDS_E1000, driver="e1000", group=7)
    with pytest.raises(PciError) as caught:
        check_viable([NIC], sysfs.root)
    assert str(caught.value) == (
        f"PCI {NIC}: IOMMU group 7 is not viable: {OTHER} in the same group is bound to e1000 "
        f"({sysfs.root}/bus/pci/devices/{NIC}/iommu_group/devices/{OTHER}/driver); pass {OTHER} through too, "
        f"or unbind it (echo {OTHER} > {sysfs.root}/bus/pci/drivers/e1000/unbind)")
    assert sysfs.writes == []
    assert sysfs.driver(NIC) == "ixgbe"


def test_missing_device(sysfs: FakeSysfs) -> None:
    with pytest.raises(PciError, match=rf"PCI {NIC}: no such device \(.*/devices/{NIC} does not exist\)"):
        check_viable([NIC], sysfs.root)
    with pytest.raises(PciError, match="no such device"):
        bind(NIC, PciDriver.VFIO, sysfs.root)
    assert sysfs.writes == []


def test_no_iommu_group(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC, group=None)
    with pytest.raises(PciError, match=r"no IOMMU group .*iommu_group is missing\): enable VT-d/AMD-Vi .*"
                                       r"intel_iommu=on"):
        check_viable([NIC], sysfs.root)


def test_driver_module_not_loaded(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC)
    sysfs.unload("vfio-pci")
    with pytest.raises(PciError, match=r"vfio-pci is not loaded \(.*is missing\): modprobe vfio-pci"):
        check_viable([NIC], sysfs.root)
    check_viable([NIC], sysfs.root, drivers=[PciDriver.PCI_STUB])
    with pytest.raises(PciError, match="modprobe vfio-pci"):
        bind(NIC, PciDriver.VFIO, sysfs.root)
    assert sysfs.writes == []


def test_every_problem_in_one_error(sysfs: FakeSysfs) -> None:
    sysfs.unload("vfio-pci")
    sysfs.add(NIC, group=None)
    sysfs.add(NIC2, group=2)
    sysfs.add(OTHER, ids=IDS_E1000, driver="e1000", group=2)
    with pytest.raises(PciError) as caught:
        check_viable([NIC, NIC2, "0000:99:00.0", "15:00.0"], sysfs.root)
    lines = str(caught.value).splitlines()
    assert caught.value.problems == tuple(lines)
    assert len(lines) == 5
    assert "modprobe vfio-pci" in lines[0]
    assert "no IOMMU group" in lines[1]
    assert f"{OTHER} in the same group is bound to e1000" in lines[2]
    assert "0000:99:00.0: no such device" in lines[3]
    assert "'15:00.0' is not a PCI address" in lines[4]


def test_a_blocker_shared_by_two_devices_is_reported_once(sysfs: FakeSysfs) -> None:
    sysfs.add(NIC, group=2)
    sysfs.add(NIC2, group=2)
    sysfs.add(OTHER, ids=IDS_E1000, driver="e1000", group=2)
    with pytest.raises(PciError) as caught:
        check_viable([NIC, NIC2], sysfs.root)
    assert len(caught.value.problems) == 1


# --- journaled records, another process -----------------------------------------------------------


@pytest.mark.parametrize("driver", list(PciDriver))
def test_restore_from_the_journal_in_a_new_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: PciDriver) -> None:
    up = FakeSysfs(tmp_path / "sys")
    up.add(NIC)
    monkeypatch.setattr(pci, "_write", up.write)
    journal = Journal(RunDir(tmp_path / "run" / "lab"))
    resource = PciBind(address=NIC, driver=driver, vm="a")
    ctx = Context(lab="lab", sysfs=up.root)
    journal.add(Entry(resource.kind, resource.key, resource.owner, resource.apply(ctx)))

    # `down`: nothing shared with `up` but the sysfs tree and the journal.
    down = FakeSysfs(tmp_path / "sys", build=False)
    monkeypatch.setattr(pci, "_write", down.write)
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(down.root))
    for entry in Journal.load(journal.run_dir).resources:
        entry.record.undo(Context(lab="lab"), rollback=False)
    assert down.driver(NIC) == "ixgbe" and down.override(NIC) == "(null)"
    assert down.writes[0] == (drv(driver.value, "unbind"), NIC)
    assert down.writes[-1] == (drv("ixgbe", "bind"), NIC)


def test_real_write_goes_to_the_file(tmp_path: Path) -> None:
    """The real `_write` (not the fake kernel): one write to an existing file, never creating one."""
    target = tmp_path / "bind"
    target.write_text("")
    pci._write(target, NIC)
    assert target.read_text() == NIC
    with pytest.raises(FileNotFoundError):
        pci._write(tmp_path / "missing", NIC)
