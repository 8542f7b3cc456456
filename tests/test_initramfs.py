"""vmlaunch's own initramfs (guests/initramfs.py): a kernel's release, the modules its boot needs from a
/lib/modules folder or a build tree, what is refused, the cache, and real boots of the test guest's
kernel with it (and with the test guest's own initrd) mounting a share and serving the agent."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.errors import HostError, SpecUnfit, UsageError
from vmlaunch.guests import initramfs, kernels
from vmlaunch.rig.agent import VlaChannel

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def guest(test_guest: Path) -> tuple[Path, Path]:
    """The test guest's kernel and its modules folder (tools/build_guest.py keeps it beside it)."""
    folders = sorted((test_guest / "modules").iterdir())
    assert len(folders) == 1, folders
    return test_guest / "vmlinuz", folders[0]


@pytest.mark.guest_files
def test_the_release_of_the_test_guests_kernel(guest: tuple[Path, Path]) -> None:
    kernel, modules = guest
    assert initramfs.kernel_release(kernel) == modules.name
    assert modules.name.endswith("-amd64")


@pytest.mark.guest_files
def test_the_release_of_an_elf_vmlinux_with_a_pvh_note(guest: tuple[Path, Path]) -> None:
    kernel, modules = guest
    boot = kernels.boot_of(kernel, build=True)
    assert boot.elf is not None, boot.why
    assert initramfs.kernel_release(boot.elf) == modules.name


@pytest.mark.guest_files
def test_without_modules_nor_a_config_it_says_to_give_them(guest: tuple[Path, Path], tmp_path: Path) -> None:
    kernel, modules = guest
    if (Path("/lib/modules") / modules.name).exists() or (Path("/boot") / f"config-{modules.name}").exists():
        pytest.skip(f"this host has the modules of {modules.name}")
    copy = tmp_path / "vmlinuz"
    shutil.copyfile(kernel, copy)
    with pytest.raises(UsageError, match=rf"no modules found for it \(this host has no /lib/modules/"
                       rf"{modules.name}.*\n  hint: give --modules DIR"):
        initramfs.modules_for(copy, None)


def test_a_file_that_is_no_kernel_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("no kernel here\n" * 100)
    with pytest.raises(UsageError, match=r"notes.txt is no Linux kernel: neither a bzImage"):
        initramfs.kernel_release(text)
    with pytest.raises(UsageError, match=r"is an ELF without a PVH entry note"):
        initramfs.kernel_release(Path("/bin/sh").resolve())
    with pytest.raises(UsageError, match=r"kernel .*missing: No such file"):
        initramfs.kernel_release(tmp_path / "missing")
    with pytest.raises(UsageError, match=r"not a regular file"):
        initramfs.kernel_release(tmp_path)


@pytest.mark.guest_files
def test_the_modules_are_found_in_order(guest: tuple[Path, Path]) -> None:
    kernel, modules = guest
    found = initramfs.modules_for(kernel, modules)
    names = found.names
    for name in ("virtio", "virtio_ring", "virtio_pci", "virtio_pci_modern_dev", "virtio_console", "9pnet",
                 "9pnet_virtio", "9p", "netfs", "fscache", "failover", "net_failover", "virtio_net",
                 "virtio_blk"):
        assert name in names
    # each after what it depends on
    assert names.index("virtio_ring") < names.index("virtio") < names.index("virtio_pci")
    assert names.index("9pnet") < names.index("9pnet_virtio")
    assert names.index("netfs") < names.index("fscache") < names.index("9p")
    assert names.index("failover") < names.index("net_failover") < names.index("virtio_net")
    assert found.release == modules.name and found.folder == modules


def _copy_modules(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


@pytest.mark.guest_files
def test_a_modules_folder_without_9p_is_refused_naming_it(guest: tuple[Path, Path], tmp_path: Path) -> None:
    kernel, modules = guest
    folder = _copy_modules(modules, tmp_path / modules.name)
    (folder / "kernel" / "fs" / "9p" / "9p.ko").unlink()
    lacks = r"lacks what vmlaunch's guest needs.*: 9p \(CONFIG_9P_FS: shares"
    with pytest.raises(SpecUnfit, match=lacks) as err:
        initramfs.modules_for(kernel, folder)
    assert err.value.exit_code == 2
    # built into the kernel (its .config says so): nothing missing
    (folder / ".config").write_text("CONFIG_9P_FS=y\n")
    found = initramfs.modules_for(kernel, folder)
    assert "9p" not in found.names and "9p" in found.builtin


@pytest.mark.guest_files
def test_modules_of_another_kernel_are_refused(guest: tuple[Path, Path], tmp_path: Path) -> None:
    kernel, modules = guest
    folder = _copy_modules(modules, tmp_path / "other")
    ko = folder / "kernel" / "drivers" / "char" / "virtio_console.ko"
    data = ko.read_bytes()
    other = "9" + modules.name[1:]  # another release of the same length
    ko.write_bytes(data.replace(f"vermagic={modules.name}".encode(), f"vermagic={other}".encode()))
    refused = rf"virtio_console.ko is built for kernel {other}, not {modules.name} "
    with pytest.raises(UsageError, match=refused):
        initramfs.modules_for(kernel, folder)


@pytest.mark.guest_files
def test_a_folder_that_holds_no_modules_is_refused(guest: tuple[Path, Path], tmp_path: Path) -> None:
    kernel, _ = guest
    with pytest.raises(UsageError, match=r"--modules .*: no kernel modules folder"):
        initramfs.modules_for(kernel, tmp_path)
    with pytest.raises(UsageError, match=r"--modules .*: not a folder"):
        initramfs.modules_for(kernel, tmp_path / "missing")


def _build_tree(kernel: Path, modules: Path, tree: Path) -> Path:
    """A kernel build tree as `make` leaves it: .config, Makefile, modules.order naming .o files, each
    .ko beside its object, modules.builtin, and the kernel at arch/x86/boot/bzImage."""
    order = []
    for line in (modules / "modules.order").read_text().splitlines():
        relative = line.removeprefix("kernel/")
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(modules / line, tree / relative)
        order.append(relative.removesuffix(".ko") + ".o")
    (tree / "modules.order").write_text("\n".join(order) + "\n")
    (tree / "modules.builtin").write_text("drivers/virtio/virtio_mmio.ko\n")
    (tree / ".config").write_text("CONFIG_VIRTIO=m\nCONFIG_9P_FS=m\n")
    (tree / "Makefile").write_text("# the kernel's\n")
    boot = tree / "arch" / "x86" / "boot"
    boot.mkdir(parents=True)
    shutil.copyfile(kernel, boot / "bzImage")
    return boot / "bzImage"


@pytest.mark.guest_files
def test_a_build_tree_is_read(guest: tuple[Path, Path], tmp_path: Path) -> None:
    kernel, modules = guest
    tree = tmp_path / "linux"
    bzimage = _build_tree(kernel, modules, tree)
    given = initramfs.modules_for(kernel, tree)
    assert given.folder == tree
    assert given.names == initramfs.modules_for(kernel, modules).names
    assert all(module.path is not None and tree in module.path.parents for module in given.modules)
    # the kernel in its tree: its modules found without --modules
    assert initramfs.modules_for(bzimage, None).folder == tree.resolve()


@pytest.mark.guest_files
def test_the_initramfs_is_cached(guest: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, modules = guest
    first = initramfs.build(kernel, modules)
    assert first.name.startswith("sha256-") and first.stat().st_size > 100_000
    made = first.stat().st_ino

    def no_rebuild(*_: object) -> bytes:
        raise AssertionError("built again")

    monkeypatch.setattr(initramfs, "_archive", no_rebuild)
    assert initramfs.build(kernel, modules) == first
    assert first.stat().st_ino == made
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temp file left


def test_busybox_must_be_static(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(initramfs, "BUSYBOXES", (Path("/bin/sh").resolve(),))
    with pytest.raises(HostError, match=r"is no statically linked busybox"):
        initramfs.busybox()
    monkeypatch.setattr(initramfs, "BUSYBOXES", (tmp_path / "busybox",))
    with pytest.raises(HostError, match=r"no busybox on this host") as err:
        initramfs.busybox()
    assert "busybox-static" in str(err.value)


# --- real boots -------------------------------------------------------------------------------------


@pytest.fixture
def booted(request: pytest.FixtureRequest, guest: tuple[Path, Path], qemu_binary: str,
           tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The test guest's kernel (through PVH, as vmlaunch boots it under TCG) with the initrd the test
    names, a read-only 9p share s0 at /tmp/x and the agent's port; yields (console log, agent socket)."""
    import tempfile

    kernel, modules = guest
    initrd = initramfs.build(kernel, modules) if request.param == "own" else ROOT / "examples/guest/initrd.gz"
    boot = kernels.boot_of(kernel, build=True)
    assert boot.elf is not None, boot.why
    share = tmp_path / "share"
    share.mkdir()
    (share / "hello.txt").write_text("hello from the host\n")
    sockets = Path(tempfile.mkdtemp(prefix="vli-"))  # a socket's path holds 107 bytes at most
    console, agent = tmp_path / "console.log", sockets / "agent.sock"
    argv = [qemu_binary, "-machine", "q35", "-accel", "tcg", "-m", "256", "-nodefaults", "-display", "none",
            "-no-reboot", "-kernel", str(boot.elf), "-initrd", str(initrd),
            "-append", "console=ttyS0 rdinit=/init panic=-1 vl.share=s0:/tmp/x:ro",
            "-serial", f"file:{console}", "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=agent,path={agent},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=org.vmlaunch.agent.0",
            "-fsdev", f"local,id=s0,path={share},security_model=none,readonly=on",
            "-device", "virtio-9p-pci,fsdev=s0,mount_tag=s0",
            "-netdev", "user,id=n0", "-device", "virtio-net-pci,netdev=n0"]
    qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield console, agent
    finally:
        qemu.kill()
        qemu.wait()
        assert qemu.stdout is not None
        qemu.stdout.close()
        shutil.rmtree(sockets, ignore_errors=True)


def _wait_for(console: Path, text: str, timeout: float = 90.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = console.read_text(errors="replace") if console.exists() else ""
        if text in seen:
            return seen
        time.sleep(0.1)
    pytest.fail(f"no {text!r} on the console within {timeout:g} s:\n{seen[-3000:]}")


def _agent_runs(agent: Path, command: bytes) -> tuple[int, bytes]:
    deadline = time.monotonic() + 30
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.fspath(agent))
    conn.setblocking(False)  # as the rig opens it: the channel reads what there is
    channel = VlaChannel(conn, "guest")
    try:
        while not channel.answered():
            assert time.monotonic() < deadline, "the agent did not answer"
            channel.greet(deadline)
            time.sleep(0.5)
        result = channel.exec(command, b"", 30, 1 << 16, None)
    finally:
        channel.close()
    return result.exit_code, result.stdout + result.stderr


@pytest.mark.qemu
@pytest.mark.guest
@pytest.mark.parametrize("booted", ["own", "test-guest"], indirect=True)
def test_a_kernel_boots_with_it_mounting_the_share(booted: tuple[Path, Path],
                                                   request: pytest.FixtureRequest) -> None:
    console, agent = booted
    seen = _wait_for(console, "VMLAUNCH-GUEST-READY")
    assert "vl: share s0 at /tmp/x" in seen
    if request.node.callspec.params["booted"] == "own":  # QEMU's user network answers DHCP
        assert "vl: eth0 dhcp 10.0.2.15/24" in seen
    assert "vl: agent started" in seen
    status, output = _agent_runs(agent, b"cat /tmp/x/hello.txt && ! touch /tmp/x/new 2>/dev/null")
    assert (status, output) == (0, b"hello from the host\n")
