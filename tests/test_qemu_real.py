"""The real QEMU accepts what the compiler emits, and the test guest boots from a compiled argv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EXAMPLES, netns_argv
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.compile.plan import Plan
from vmlaunch.host.facts import detect_host, probe_bios
from vmlaunch.resources.tap import Tap
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import Accel

DRIVER = Path(__file__).parent / "qemu_driver.py"
pytestmark = pytest.mark.qemu


def drive(plan: Plan, tmp_path: Path, **job: Any) -> dict[str, Any]:
    """Run the plan's VMs in a private network namespace through tests/qemu_driver.py."""
    plan.run_dir.path.mkdir(parents=True, exist_ok=True)
    vms = {vm.name: {"argv": list(job.pop("argv_of", {}).get(vm.name, vm.argv)),
                     "qmp": str(vm.files.qmp), "serial": str(vm.files.serial_log)} for vm in plan.vms}
    taps = [[a.ifname, a.multi_queue] for a in plan.resources if isinstance(a, Tap)]
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"taps": taps, "vms": vms, **job}))
    done = subprocess.run(netns_argv([sys.executable, str(DRIVER), str(job_file)]),
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    results: dict[str, Any] = json.loads(done.stdout)
    return results


def make_images(plan: Plan, lab_dir: Path) -> None:
    """Create the images `up` would create, and a small one for disks that must pre-exist."""
    for vm in load_lab(lab_dir / "lab.toml").vms:
        for disk in vm.disks:
            if not disk.file.exists():
                size = str(disk.size or 16 << 20)
                subprocess.run(["qemu-img", "create", "-f", disk.format.value, str(disk.file),
                                size], check=True, capture_output=True)


def without_vfio(argv: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if '"driver":"vfio-pci"' in arg:
            out.pop()  # its "-device"
        else:
            out.append(arg)
    return out


def copy_example(spec: Path, tmp_path: Path, guest: Path) -> Path:
    lab_dir = tmp_path / "lab"
    lab_dir.mkdir()
    shutil.copy(spec, lab_dir / "lab.toml")
    (lab_dir / "guest").symlink_to(guest)
    return lab_dir


@pytest.mark.fast
def test_kvm_probe_bios_reaches_long_mode_under_tcg(qemu_binary: str, tmp_path: Path) -> None:
    """The probe that decides accel=auto works: under TCG it always gets to its exit."""
    bios = tmp_path / "probe.bin"
    bios.write_bytes(probe_bios())
    done = subprocess.run([qemu_binary, "-accel", "tcg", "-cpu", "max", "-machine", "pc", "-m", "16",
                           "-nodefaults", "-display", "none", "-bios", str(bios), "-device",
                           "isa-debug-exit,iobase=0xf4,iosize=0x04"], timeout=30, check=False,
                          capture_output=True)
    assert done.returncode == 39


@pytest.mark.fast
def test_host_detection(qemu_binary: str) -> None:
    host = detect_host()
    assert host.qemu.version >= (5, 0, 0)
    assert {"virtio-blk-pci", "virtio-net-pci", "virtio-balloon-pci"} <= host.qemu.devices
    if os.path.exists("/dev/kvm") and not host.kvm.usable:
        assert host.kvm.reason  # says why, e.g. this host's KVM that hangs ordinary guests
    again = detect_host()  # QEMU and KVM facts cached; free memory is read live each time
    assert (again.qemu, again.kvm) == (host.qemu, host.kvm)


@pytest.mark.fast
@pytest.mark.guest_files
@pytest.mark.parametrize("spec", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_qemu_accepts_example(spec: Path, tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    lab_dir = copy_example(spec, tmp_path, test_guest)
    plan = compile_lab(load_lab(lab_dir / "lab.toml"), detect_host())
    make_images(plan, lab_dir)
    # No PCI device can be passed through here: drop vfio-pci (the compiler checked QEMU has it).
    argv_of = {vm.name: without_vfio(list(vm.argv)) for vm in plan.vms}
    results = drive(plan, tmp_path, argv_of=argv_of)
    for vm in plan.vms:
        assert results[vm.name]["ok"], results[vm.name]
        assert results[vm.name]["replies"]["query-status"]["status"] == "prelaunch"


@pytest.mark.guest
def test_guest_boots_from_compiled_argv(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    lab_dir = tmp_path / "lab"
    lab_dir.mkdir()
    (lab_dir / "lab.toml").write_text(f"""
[lab]
name = "boot"
[network.out]
type = "user"
[vm.solo]
memory = "256M"
accel = "auto"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
append = "console=ttyS0 vl.mark=compiled"
[[vm.solo.disk]]
file = "solo.img"
size = "16M"
[[vm.solo.nic]]
network = "out"
""")
    plan = compile_lab(load_lab(lab_dir / "lab.toml"), detect_host())
    assert plan.vms[0].accel.accel in (Accel.KVM, Accel.TCG)
    make_images(plan, lab_dir)
    results = drive(plan, tmp_path, wait_for="VMLAUNCH-GUEST-READY", timeout=120,
                    qmp=[["query-balloon", {}]])
    result = results["solo"]
    assert result["ok"], result
    assert result["replies"]["query-status"]["status"] == "running"
    assert result["replies"]["query-balloon"]["actual"] == 256 << 20
    assert (lab_dir / "solo.img").read_bytes().startswith(b"VMLAUNCH-MARK:compiled\n")
    log = plan.vms[0].files.serial_log.read_text()
    assert "vl: eth0 " + load_lab(lab_dir / "lab.toml").vms[0].nics[0].mac in log


@pytest.mark.fast
@pytest.mark.guest_files
def test_odd_file_names_open_that_file(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    """`a:b,c.img` is a file name to QEMU, not a protocol `a` nor an extra option `c.img`."""
    lab_dir = tmp_path / "lab"
    lab_dir.mkdir()
    (lab_dir / "lab.toml").write_text(
        '[lab]\nname = "odd"\n[vm.odd]\nmemory = 64\n[[vm.odd.disk]]\nfile = "a:b,c.img"\nsize = "1M"\n')
    plan = compile_lab(load_lab(lab_dir / "lab.toml"), detect_host())
    make_images(plan, lab_dir)
    results = drive(plan, tmp_path, qmp=[["query-named-block-nodes", {}]])
    assert results["odd"]["ok"], results["odd"]
    files = {node["file"] for node in results["odd"]["replies"]["query-named-block-nodes"]}
    assert str(lab_dir / "a:b,c.img") in files


@pytest.mark.fast
@pytest.mark.guest_files
def test_qemu_takes_the_disks_error_policies(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    lab_dir = tmp_path / "lab"
    lab_dir.mkdir()
    (lab_dir / "lab.toml").write_text(f"""
[lab]
name = "onerr"
[vm.solo]
memory = "128M"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
[[vm.solo.disk]]
file = "a.img"
size = "16M"
on_error = {{ read = "stop", write = "stop" }}
[[vm.solo.disk]]
file = "b.img"
size = "16M"
bus = "scsi"
on_error = {{ read = "ignore", write = "enospc" }}
[[vm.solo.disk]]
file = "c.img"
size = "16M"
bus = "sata"
on_error = {{ write = "report" }}
[[vm.solo.disk]]
file = "d.img"
bus = "sata"
readonly = true
on_error = {{ read = "stop" }}
""")
    (lab_dir / "d.img").write_bytes(bytes(1 << 20))  # a read-only SATA disk: QEMU's ide-cd
    plan = compile_lab(load_lab(lab_dir / "lab.toml"), detect_host())
    make_images(plan, lab_dir)
    results = drive(plan, tmp_path)
    assert results["solo"]["ok"], results["solo"]
    assert results["solo"]["replies"]["query-status"]["status"] == "prelaunch"
