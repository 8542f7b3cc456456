"""Shared fixtures: a fake Host for pure tests, the real host and test guest for QEMU tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vmlaunch.host.facts import Host, KvmStatus, QemuInfo
from vmlaunch.host.memory import KsmSupport

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GUEST_DIR = EXAMPLES / "guest"

FAKE_DEVICES = frozenset({
    "virtio-blk-pci", "virtio-scsi-pci", "scsi-hd", "ide-hd", "ide-cd", "virtio-net-pci", "e1000",
    "e1000e", "rtl8139", "virtio-balloon-pci", "vfio-pci", "pvpanic", "virtio-serial-pci", "virtserialport",
    "VGA", "virtio-vga", "vmgenid",
})


def fake_host(**changes: Any) -> Host:
    """A host with QEMU 7.2 at /usr/bin, io_uring, no usable KVM, no vhost-net, KSM with its advisor
    (as root): like this machine."""
    qemu = QemuInfo(binary="/usr/bin/qemu-system-x86_64", version=(7, 2, 0), devices=FAKE_DEVICES,
                    io_uring=True, img="/usr/bin/qemu-img")
    host = Host(qemu=qemu, kvm=KvmStatus(False, "fake: no KVM"), vhost_net=False, cpus=2,
                memory_mib=24000, run_root=Path("/run/vmlaunch"),
                ksm=KsmSupport(writable=True, advisor=True))
    return host if not changes else _evolve(host, changes)


def _evolve(host: Host, changes: dict[str, Any]) -> Host:
    import attrs

    qemu_changes = {k: v for k, v in changes.items() if k in attrs.fields_dict(QemuInfo)}
    host_changes = {k: v for k, v in changes.items() if k not in qemu_changes}
    return attrs.evolve(host, qemu=attrs.evolve(host.qemu, **qemu_changes), **host_changes)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never read or write the user's cache or logs; the host probe is shared by the session."""
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("VMLAUNCH_LOG_DIR", str(tmp_path_factory.getbasetemp() / "logs"))


# The host-wide settings vmlaunch may change (KSM, the 2 MiB hugepage pool), in the order they are put
# back: KSM's advisor first (it resets pages_to_scan), `run` last.
HOST_SETTINGS = tuple(Path("/sys/kernel/mm/ksm") / name
                      for name in ("advisor_mode", "pages_to_scan", "sleep_millisecs", "run")) + (
    Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),)


def _host_settings() -> dict[Path, str]:
    values = {}
    for path in HOST_SETTINGS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        values[path] = text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text
    return values


def _nft_tables() -> set[str]:
    """vmlaunch's nftables tables (a lab's partition, `vmlaunch-LAB`) in the host's network namespace."""
    if shutil.which("nft") is None:
        return set()
    done = subprocess.run(["nft", "list", "tables", "bridge"], capture_output=True, text=True, check=False)
    return {words[2] for line in done.stdout.splitlines()
            if len(words := line.split()) == 3 and words[2].startswith("vmlaunch-")}


@pytest.fixture(scope="module", autouse=True)
def _host_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test module leaves the real host's KSM and hugepage settings, and its nftables, as it found
    them ("never a leftover"); one that does not fails, naming what it changed, and the settings are
    put back (a table left is removed)."""
    before = _host_settings()
    tables = _nft_tables()
    yield
    changed = {path: (value, now) for path, value in before.items()
               if (now := _host_settings().get(path)) != value}
    for path, (value, _) in changed.items():
        with contextlib.suppress(OSError):
            path.write_text(value + "\n")
    left = sorted(_nft_tables() - tables)
    for table in left:
        subprocess.run(["nft", "delete", "table", "bridge", table], capture_output=True, check=False)
    if changed or left:
        pytest.fail(f"{request.module.__name__} left host settings changed: "
                    + ", ".join([f"{path} {value} -> {now}" for path, (value, now) in changed.items()]
                                + [f"nftables table bridge {table} left" for table in left]))


def write_spec(tmp_path: Path, text: str, name: str = "lab.toml") -> Path:
    spec = tmp_path / name
    spec.write_text(text)
    return spec


@pytest.fixture(scope="session")
def qemu_binary() -> str:
    binary = shutil.which("qemu-system-x86_64")
    if binary is None:
        pytest.fail("qemu-system-x86_64 is missing: run `make setup`")
    return binary


@pytest.fixture(scope="session")
def test_guest() -> Path:
    """The test guest (kernel + busybox initramfs), built once and cached by tools/build_guest.py."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "build_guest.py")],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"building the test guest failed:\n{done.stdout}\n{done.stderr}")
    return GUEST_DIR


@pytest.fixture(scope="session")
def libvirt_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Three libvirt hosts reached over SSH, built once per session (tools/libvirt_hosts.py): private
    libvirtds with an sshd each in namespaces of their own, on an underlay whose switch namespace is
    the client vmlaunch runs in (`rig.run_client`). Torn down after the session."""
    if os.geteuid() != 0:  # pragma: no cover - CI and the README's machines run as root
        pytest.skip("the rig of libvirt hosts needs root (mount and network namespaces)")
    from tools.libvirt_hosts import LibvirtHosts

    with LibvirtHosts(Path(tempfile.mkdtemp(prefix="vlh-")), count=3) as rig:
        yield rig
    shutil.rmtree(rig.work, ignore_errors=True)


def netns_argv(argv: list[str]) -> list[str]:
    """Run argv in a private network namespace, so the host's own network is never touched."""
    return ["unshare", "-n", "--", *argv] if os.geteuid() == 0 else ["unshare", "-rn", "--", *argv]


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short run dir (unix socket paths have a 107-byte limit)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="vl-"))
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
