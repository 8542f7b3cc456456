"""Binding host PCI devices to a pass-through driver before QEMU starts, and giving them back.

Two ways, both through sysfs:

- vfio-pci (current): write `vfio-pci` to `devices/BDF/driver_override`, BDF to `devices/BDF/driver/unbind`,
  BDF to `bus/pci/drivers_probe`.
- pci-stub (the seed's legacy way): `"VVVV DDDD"` to `drivers/pci-stub/new_id`, unbind, BDF to
  `drivers/pci-stub/bind`, then `remove_id`, since `new_id` grabs every unbound device with those ids.

`check_viable` runs before anything changes; `bind` undoes its own partial work when it fails; `restore`
gives the device back to the driver it had (the `Binding` is journaled, so `down` can do it from
another process). All sysfs access goes through one root, `sysfs_root()` (`VMLAUNCH_SYSFS` or `/sys`), and
every write through `_write`, which tests replace with a simulated kernel.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs

from vmlaunch.core.naming import is_driver_name, is_pci_address
from vmlaunch.errors import HostError, needs_root
from vmlaunch.spec.model import PciDriver


def _address(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not is_pci_address(value):
        raise ValueError(f"{attribute.name}: {value!r} is not a PCI address")


def _pass_through(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in {driver.value for driver in PciDriver}:
        raise ValueError(f"{attribute.name}: {value!r} is not a pass-through driver")


def _driver_name(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not is_driver_name(value):
        raise ValueError(f"{attribute.name}: {value!r} is not a driver name")


@attrs.frozen
class Binding:
    """What binding a device did: enough to give it back (`restore`), from another process too."""

    address: str = attrs.field(validator=_address)  # "0000:15:00.0"
    driver: str = attrs.field(validator=_pass_through)  # what we bound it to
    original_driver: str | None = attrs.field(validator=_driver_name)  # None: it was unbound
    ids: str | None = None  # "8086 10fb" when we added them to pci-stub's new_id (removed again)
    changed: bool = True  # False when it already was on the wanted driver: undo is a no-op


PASS_THROUGH_DRIVERS = frozenset(driver.value for driver in PciDriver)
PCI_BRIDGE_CLASS = 0x0604  # base class 06 (bridge), subclass 04 (PCI-to-PCI)

_ERRNO_HINTS = {
    errno.EACCES: needs_root("binding PCI devices"),
    errno.EPERM: needs_root("binding PCI devices"),
    errno.EBUSY: "the device or its driver is busy: stop whatever uses it (a VM, a host interface) and retry",
    errno.ENODEV: "the driver does not take this device, or the device is gone: check `lspci -nnk -D`",
    errno.EINVAL: "the kernel refused it; `dmesg` says why (vfio-pci needs an IOMMU and a viable group)",
    errno.ENOENT: "the sysfs file is missing: is the driver module loaded (`lsmod`)?",
}


def sysfs_root() -> Path:
    """Where sysfs is: `VMLAUNCH_SYSFS` (tests build a fake tree there), else `/sys`."""
    return Path(os.environ.get("VMLAUNCH_SYSFS") or "/sys")


class PciError(HostError):
    """A PCI device cannot be passed through, bound or given back; `problems` holds one line each."""

    def __init__(self, message: str, hint: str | None = None, problems: Sequence[str] = ()) -> None:
        super().__init__(message, hint)
        self.problems = tuple(problems) or (message,)


# --- reading sysfs ------------------------------------------------------------------------------------


def _root(root: Path | None) -> Path:
    return sysfs_root() if root is None else root


def _device_dir(root: Path, address: str) -> Path:
    return root / "bus" / "pci" / "devices" / address


def _driver_dir(root: Path, driver: str) -> Path:
    return root / "bus" / "pci" / "drivers" / driver


def _check_address(address: str) -> None:
    if not is_pci_address(address):
        raise PciError(f"{address!r} is not a PCI address",
                       hint="write DOMAIN:BUS:SLOT.FUNCTION in lower case, e.g. 0000:15:00.0 (`lspci -D`)")


def _driver_of(device: Path, address: str) -> str | None:
    """The basename of the `driver` symlink's target; None when the device is unbound."""
    link = device / "driver"
    try:
        return os.path.basename(os.readlink(link))
    except FileNotFoundError:
        return None
    except OSError as err:
        raise PciError(f"PCI {address}: cannot read {link}: {err.strerror}",
                       hint="check the device with `lspci -nnk -D`") from err


def _read(path: Path, address: str) -> str:
    try:
        return path.read_text().strip()
    except OSError as err:
        raise PciError(f"PCI {address}: cannot read {path}: {err.strerror}",
                       hint="check the device with `lspci -nnk -D`") from err


def _override(device: Path, address: str) -> str | None:
    """The device's driver_override; None when unset (the kernel shows "(null)") or unsupported."""
    path = device / "driver_override"
    if not path.exists():
        return None
    text = _read(path, address)
    return None if text in ("", "(null)") else text


def _device_ids(device: Path, address: str) -> str:
    """ "8086 10fb", the form new_id and remove_id take, from the `vendor` and `device` files."""
    parts = []
    for name in ("vendor", "device"):
        text = _read(device / name, address).lower()
        text = text[2:] if text.startswith("0x") else text
        if len(text) != 4 or any(c not in "0123456789abcdef" for c in text):
            raise PciError(f"PCI {address}: {device / name} holds {text!r}, not a 4-digit hex id",
                           hint="check the device with `lspci -nn -D`")
        parts.append(text)
    return " ".join(parts)


def _is_bridge(device: Path) -> bool:
    try:
        return int((device / "class").read_text().strip(), 16) >> 8 == PCI_BRIDGE_CLASS
    except (OSError, ValueError):
        return False


# --- writing sysfs ------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    """The one place that writes to sysfs: one write(2) on an existing file (tests put a fake kernel here)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _sysfs_write(address: str, path: Path, text: str) -> None:
    """`_write`, with the kernel's refusal (ENODEV, EBUSY, EINVAL, ...) turned into a PciError."""
    try:
        _write(path, text)
    except OSError as err:
        code = err.errno or 0
        reason = err.strerror or str(err)
        name = errno.errorcode.get(code, str(code))
        raise PciError(f"PCI {address}: writing {text!r} to {path} failed: {reason} ({name})",
                       hint=_ERRNO_HINTS.get(code, "`dmesg` says why")) from err


def _state(device: Path, address: str) -> str:
    driver = _driver_of(device, address)
    return f"{device / 'driver'} points at {driver}" if driver else f"it is unbound (no {device / 'driver'})"


# --- checking -----------------------------------------------------------------------------------------


def check_viable(addresses: Sequence[str], root: Path | None = None, *,
                 drivers: Iterable[PciDriver] = (PciDriver.VFIO,)) -> None:
    """Before anything changes: each device exists, has a viable IOMMU group, and each of `drivers` is loaded.

    A group is viable when every other device in it is unbound, on vfio-pci or pci-stub, one of
    `addresses` itself, or a PCI bridge. Every problem is reported in one PciError, one line each.
    """
    root = _root(root)
    problems: list[str] = []
    for name in sorted({driver.value for driver in drivers}):
        path = _driver_dir(root, name)
        if not path.is_dir():
            problems.append(f"driver {name} is not loaded ({path} is missing): modprobe {name}")
    wanted = set(addresses)
    blockers: set[tuple[str, str]] = set()
    for address in dict.fromkeys(addresses):
        try:
            problems += _group_problems(root, address, wanted, blockers)
        except PciError as err:
            problems.append(err.message)
    if problems:
        raise PciError("\n".join(problems), problems=problems)


def device_problems(address: str, root: Path | None = None) -> list[str]:
    """What keeps this one device from being passed through (for `up --dry-run`)."""
    try:
        return _group_problems(_root(root), address, {address}, set())
    except PciError as err:
        return [err.message]


def _group_problems(root: Path, address: str, wanted: set[str], blockers: set[tuple[str, str]]) -> list[str]:
    if not is_pci_address(address):
        return [f"{address!r} is not a PCI address: write DOMAIN:BUS:SLOT.FUNCTION, e.g. 0000:15:00.0"]
    device = _device_dir(root, address)
    if not device.is_dir():
        return [f"PCI {address}: no such device ({device} does not exist): check the address with `lspci -D`"]
    link = device / "iommu_group"
    if not link.is_dir():
        return [f"PCI {address}: no IOMMU group ({link} is missing): enable VT-d/AMD-Vi in the firmware "
                f"and boot with intel_iommu=on (Intel) or amd_iommu=on (AMD)"]
    try:
        group = os.path.basename(os.readlink(link))
        members = sorted(os.listdir(link / "devices"))
    except OSError as err:
        return [f"PCI {address}: cannot read its IOMMU group ({link}): {err.strerror}"]
    problems = []
    for other in members:
        if other in wanted or (group, other) in blockers:
            continue
        member = link / "devices" / other
        driver = _driver_of(member, other)
        if driver is None or driver in PASS_THROUGH_DRIVERS or _is_bridge(member):
            continue
        blockers.add((group, other))
        problems.append(
            f"PCI {address}: IOMMU group {group} is not viable: {other} in the same group is bound to "
            f"{driver} ({member / 'driver'}); pass {other} through too, or unbind it "
            f"(echo {other} > {_driver_dir(root, driver) / 'unbind'})")
    return problems


# --- binding and restoring ----------------------------------------------------------------------------


def bind(address: str, driver: PciDriver, root: Path | None = None) -> Binding:
    """Bind `address` to `driver`; on any failure give it back as it was and raise PciError."""
    root = _root(root)
    _check_address(address)
    device = _device_dir(root, address)
    if not device.is_dir():
        raise PciError(f"PCI {address}: no such device ({device} does not exist)",
                       hint="check the address with `lspci -D`")
    wanted = driver.value
    current = _driver_of(device, address)
    if current == wanted:
        return Binding(address=address, driver=wanted, original_driver=current, changed=False)
    driver_dir = _driver_dir(root, wanted)
    if not driver_dir.is_dir():
        raise PciError(f"PCI {address}: driver {wanted} is not loaded ({driver_dir} is missing)",
                       hint=f"modprobe {wanted}")
    if driver is PciDriver.VFIO:
        return _bind_vfio(root, address, device, current)
    return _bind_stub(root, address, device, current)


def _bind_vfio(root: Path, address: str, device: Path, current: str | None) -> Binding:
    wanted = PciDriver.VFIO.value
    binding = Binding(address=address, driver=wanted, original_driver=current)
    try:
        _sysfs_write(address, device / "driver_override", wanted)
        if current is not None:
            _sysfs_write(address, device / "driver" / "unbind", address)
        _sysfs_write(address, root / "bus" / "pci" / "drivers_probe", address)
        _verify(device, address, wanted)
    except PciError as err:
        _roll_back(binding, root, err)
    return binding


def _bind_stub(root: Path, address: str, device: Path, current: str | None) -> Binding:
    wanted = PciDriver.PCI_STUB.value
    stub = _driver_dir(root, wanted)
    ids = _device_ids(device, address)
    # new_id binds every unbound device with these ids: note them now to let the others go afterwards.
    others = [other for other in _unbound_devices(root)
              if other != address and _ids_or_none(root, other) == ids]
    added = True
    try:
        _sysfs_write(address, stub / "new_id", ids)
    except PciError as err:
        if not isinstance(err.__cause__, OSError) or err.__cause__.errno != errno.EEXIST:
            raise
        added = False  # someone else's dynamic id: not ours to remove
    binding = Binding(address=address, driver=wanted, original_driver=current, ids=ids if added else None)
    error: PciError | None = None
    try:
        if current is not None:
            _sysfs_write(address, device / "driver" / "unbind", address)
        if _driver_of(device, address) != wanted:
            try:
                _sysfs_write(address, stub / "bind", address)
            except PciError:
                if _driver_of(device, address) != wanted:  # EEXIST/EBUSY after new_id grabbed it: fine
                    raise
    except PciError as err:
        error = err
    if added:
        try:
            _sysfs_write(address, stub / "remove_id", ids)
        except PciError as err:
            error = error or err
    for other in others:
        try:
            if _driver_of(_device_dir(root, other), other) == wanted:
                _sysfs_write(other, stub / "unbind", other)
        except PciError as err:
            error = error or err
    try:
        if error is None:
            _verify(device, address, wanted)
    except PciError as err:
        error = err
    if error is not None:
        _roll_back(binding, root, error)
    return binding


def _ids_or_none(root: Path, address: str) -> str | None:
    try:
        return _device_ids(_device_dir(root, address), address)
    except PciError:
        return None


def _unbound_devices(root: Path) -> list[str]:
    devices = root / "bus" / "pci" / "devices"
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return []
    return [name for name in names if is_pci_address(name) and _driver_of(devices / name, name) is None]


def _verify(device: Path, address: str, wanted: str) -> None:
    if _driver_of(device, address) != wanted:
        raise PciError(f"PCI {address}: not on {wanted} after binding: {_state(device, address)}",
                       hint="`dmesg` says why the driver refused it (vfio-pci needs an IOMMU group)")


def _roll_back(binding: Binding, root: Path, error: PciError) -> NoReturn:
    """Give the device back after a failed bind, then raise `error` (with the restore failure, if any)."""
    try:
        restore(binding, root)
    except PciError as undo:
        raise PciError(f"{error.message}\nthen giving it back failed too: {undo.message}",
                       hint=undo.hint or error.hint) from error
    raise error


def restore(binding: Binding, root: Path | None = None) -> None:
    """Undo `bind`: unbind from our driver, clear driver_override, give it back to the original driver.

    Idempotent: a device already back (or still unbound, when it was), or a device that vanished, is fine.
    A device someone else has since bound to a third driver is left alone.
    """
    if not binding.changed:
        return
    root = _root(root)
    address, ours, original = binding.address, binding.driver, binding.original_driver
    _check_address(address)
    device = _device_dir(root, address)
    if not device.is_dir():
        return
    current = _driver_of(device, address)
    if current == ours:
        _sysfs_write(address, _driver_dir(root, ours) / "unbind", address)
        current = _driver_of(device, address)
        if current == ours:
            unbind = _driver_dir(root, ours) / "unbind"
            raise PciError(f"PCI {address}: still on {ours} after unbinding it",
                           hint=f"stop what uses it, then echo {address} > {unbind}")
    if ours == PciDriver.VFIO.value and _override(device, address) == ours:
        _sysfs_write(address, device / "driver_override", "\n")
    if current is not None or original is None:
        return  # back on its driver, left unbound as it was, or taken by someone else since
    bind_file = _driver_dir(root, original) / "bind"
    failure: PciError | None = None
    if bind_file.exists():
        try:
            _sysfs_write(address, bind_file, address)
        except PciError as err:
            failure = err
    if _driver_of(device, address) != original:
        try:
            _sysfs_write(address, root / "bus" / "pci" / "drivers_probe", address)
        except PciError as err:
            failure = failure or err
    if _driver_of(device, address) != original:
        because = f" ({failure.message})" if failure else ""
        raise PciError(f"PCI {address}: could not give it back to {original}: "
                       f"{_state(device, address)}{because}",
                       hint=f"modprobe {original}, then echo {address} > {bind_file}")
