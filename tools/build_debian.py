#!/usr/bin/env python3
"""Build a Debian bookworm cloud guest image (qcow2) from Debian packages, without loop devices.

The image is meant for labs that boot real distro guests configured by cloud-init (NoCloud: a
volume labelled ``cidata``) and reached over SSH, like Debian's "generic" cloud image but smaller.

Usage: ``tools/build_debian.py [--out DIR] [--force]`` (as root) writes ``DIR/bookworm.qcow2``
and ``DIR/bookworm.json`` (default DIR: ``examples/debian`` in the repository). The manifest
records the image's size, sha256 and sha512, the hash of the build inputs (this file, which holds
every setting, and the host's GRUB packages, whose binaries go into the image) and every package
with its version. When the manifest's inputs hash matches and the image has the recorded size,
nothing is done (``--force`` rebuilds). The archive is not an input: like its packages' versions,
which copy of it the build read (a mirror's URI) does not make the hash, so neither a new mirror
nor a machine with other sources sharing the image rebuilds it, and an up-to-date image needs no
sources at all; the manifest records the entries used (``sources``). Missing host tools are
installed with apt-get. Exit status: 0 success, 3 failure (one line on stderr naming the step;
the whole output of every command is in ``DIR/build.log``).

How it is built (each step one line of progress, the total time at the end):

1. mmdebstrap (``--mode=root``, ``--variant=apt``, no recommends) installs the packages into a
   directory, from the Debian archive as apt's own sources on this machine name it (no archive's
   host is named here): the ``deb`` entries of /etc/apt/sources.list and
   /etc/apt/sources.list.d/*.list (one-line format) and *.sources (deb822) for bookworm,
   bookworm-updates and bookworm-security that have the ``main`` component, with the components
   and options (``signed-by``, ``arch``, ...) the machine gives them; entries whose Release file,
   as apt last fetched it, is not of Origin Debian (a third-party repository that names its suite
   after the release) are left out. They are passed to mmdebstrap as one-line entries and become
   the image's own apt sources. Without an entry for bookworm the build stops, naming the files
   read; a missing updates or security entry is a warning. ``VMLAUNCH_DEBIAN_MIRROR=URI`` (a
   Debian mirror: bookworm and bookworm-updates, ``main``) and optionally
   ``VMLAUNCH_DEBIAN_SECURITY_MIRROR=URI`` (bookworm-security) replace apt's sources. Downloaded
   .debs and apt's package lists are synced into and out of
   ``${XDG_CACHE_HOME:-~/.cache}/vmlaunch/debian-apt``, so a rebuild downloads only what changed.
   /usr is merged by mmdebstrap's merged-usr hook (the ``usrmerge`` package would pull in perl).
   Documentation, man pages and translations are not installed (dpkg path-exclude, kept in the
   image so later installs skip them too).
2. The tree is configured: no SSH host keys and an empty /etc/machine-id (each VM makes its own;
   an empty file, unlike a missing one, does not trigger systemd's first-boot presets that would
   re-enable the timers below); cloud-init looks only for NoCloud (``datasource_list: [NoCloud,
   None]``) and renders its network config for systemd-networkd (enabled; systemd-resolved for
   DNS); the locale is C.UTF-8. For a fast boot to SSH under TCG: timers and services a lab VM
   does not need are disabled (apt-daily*, dpkg-db-backup, e2scrub*, fstrim), generators with
   nothing to do are masked, sshd starts without a separate config-test run, the root file system
   is not fsck-ed at boot (fstab pass 0: ext4's journal recovers a crash, and a check of a clean
   file system does nothing but cost a process) and cloud-init's grub-dpkg module is off.
3. The kernel and its initramfs: Debian's generic kernel (linux-image-amd64, as in Debian's
   "generic" cloud image; the "genericcloud" one's cloud kernel has no 9p, so no shared folders),
   without the modules of hardware a QEMU lab VM never has (dpkg path-exclude, kept in the image).
   It has ext4 and virtio_blk as modules, so an initramfs is needed. It is tiny-initramfs (a
   Debian package: one small static /init that loads the listed modules and their dependencies,
   finds the root by UUID, mounts it and starts systemd) with ext4 and the virtio, SCSI and NVMe
   disk drivers, configured before the kernel is installed so it is built once. It
   replaces initramfs-tools (udev and shell scripts in the initramfs: about 3 s more under TCG)
   and is regenerated with the same configuration when the guest installs a new kernel.
4. Disk layout (GPT, 512-byte sectors, like Debian's cloud images): partition 14 "BIOS boot"
   (1-4 MiB, holds GRUB's BIOS core image), partition 15 EFI system partition (FAT32, 4-128 MiB,
   holds ``EFI/BOOT/BOOTX64.EFI``), partition 1 the ext4 root (128 MiB to the end, last on disk so
   cloud-init's growpart can grow it when the VM's disk is larger). The file systems are made
   in the disk file after sfdisk wrote the table: ``mkfs.ext4 -d TREE -E offset=...`` and
   ``mkfs.vfat --offset`` write each file system straight into its partition (no image file to
   ``dd`` in: that copy of 2 GiB took ~6 s), mtools copies GRUB in (``-i disk.raw@@OFFSET``); then
   ``qemu-img convert -O qcow2 -c`` (zstd). The root is found by its file system UUID (GRUB ``search
   --fs-uuid``, ``root=UUID=`` on the kernel command line, fstab); the ESP is not mounted.
5. Boot loader: GRUB 2 from the host's grub-efi-amd64-bin and grub-pc-bin, both images made with
   ``grub-mkimage`` into files (no grub-install: it wants the target disk as a block device). Each
   embeds the modules it needs and a two-line config that finds the root by UUID and sets the
   prefix to its /boot/grub, where this tool writes grub.cfg (timeout 0, serial and VGA console,
   ``console=tty0 console=ttyS0,115200n8``). The kernel and initrd are loaded through the
   /vmlinuz and /initrd.img links the kernel package maintains, so a kernel upgrade in the guest
   boots without regenerating grub.cfg. UEFI: the x86_64-efi image is the removable-media path
   ``EFI/BOOT/BOOTX64.EFI`` (no NVRAM entry needed; Secure Boot is not supported: unsigned).
   BIOS: what grub-bios-setup would do, done on the file: the i386-pc core image goes into the
   BIOS boot partition with its first sector's block list pointing at the rest, and boot.img's
   first 440 bytes go into the protective MBR with the core image's sector patched in.

Python 3.9+ standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILDER = Path(__file__).resolve()
DEFAULT_OUT = REPO_ROOT / "examples" / "debian"
NAME = "bookworm"
EXIT_FAILURE = 3
STEPS = 8  # the build's steps, each announced by Log.say
MANIFEST_FORMAT = "vmlaunch-debian-image 1"

SUITE = "bookworm"
# The archive's suites the image is made from, in this order: the release, its updates and the
# security archive's. Their entries come from apt's own sources on this machine (archive_sources).
SUITES = (SUITE, f"{SUITE}-updates", f"{SUITE}-security")
REQUIRED_COMPONENT = "main"
APT_ETC = Path("/etc/apt")
APT_LISTS = Path("/var/lib/apt/lists")
# apt and dpkg hold these (fcntl locks) while they run: another apt (unattended-upgrades, a user's
# apt-get) makes ours fail at once, so the build waits for them, up to APT_WAIT seconds.
DPKG_LOCK = Path("/var/lib/dpkg/lock-frontend")
LISTS_LOCK = APT_LISTS / "lock"
APT_WAIT = 300.0
MIRROR_ENV = "VMLAUNCH_DEBIAN_MIRROR"
SECURITY_MIRROR_ENV = "VMLAUNCH_DEBIAN_SECURITY_MIRROR"
# deb822 fields that are options of an entry, and their names in the one-line format
DEB822_OPTIONS = {
    "architectures": "arch",
    "languages": "lang",
    "targets": "target",
    "pdiffs": "pdiffs",
    "by-hash": "by-hash",
    "allow-insecure": "allow-insecure",
    "allow-weak": "allow-weak",
    "allow-downgrade-to-insecure": "allow-downgrade-to-insecure",
    "trusted": "trusted",
    "signed-by": "signed-by",
    "check-valid-until": "check-valid-until",
    "valid-until-min": "valid-until-min",
    "valid-until-max": "valid-until-max",
    "check-date": "check-date",
    "date-max-future": "date-max-future",
    "inrelease-path": "inrelease-path",
    "snapshot": "snapshot",
}
PACKAGES = (
    "linux-image-amd64",  # the cloud flavour has no 9p (CONFIG_NET_9P unset): no shared folders
    "tiny-initramfs",
    "systemd-sysv",
    "systemd-resolved",  # DNS for the addresses systemd-networkd gets by DHCP
    "udev",
    "openssh-server",
    "cloud-init",
    "cloud-guest-utils",  # growpart: cloud-init grows the root partition to the disk's size
    "e2fsprogs",  # resize2fs for cloud-init's resizefs, e2fsck
    "sudo",
    "iproute2",
    "netbase",
    "iputils-ping",
    "qemu-guest-agent",  # QEMU's own agent: the command channel's qga path (vmlaunch's own: the seed)
)
DPKG_OPTIONS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    # Kernel modules for hardware no QEMU lab VM has (sound, cameras, GPUs, radios, InfiniBand,
    # sensors, staging drivers): 170 of the 390 MB the generic kernel installs.
    *(f"path-exclude=/lib/modules/*/kernel/{folder}/*" for folder in (
        "sound", "drivers/media", "drivers/gpu", "drivers/net/wireless", "net/wireless",
        "net/mac80211", "net/bluetooth", "drivers/bluetooth", "drivers/infiniband", "drivers/iio",
        "drivers/staging", "drivers/isdn")),
)
# No fsync after each unpacked file while building (a failed build is thrown away): mmdebstrap
# ~49 s instead of ~63 s here. Removed from the image's dpkg configuration afterwards.
BUILD_ONLY_DPKG_OPTION = "force-unsafe-io"
DPKG_CONFIG = "etc/dpkg/dpkg.cfg.d/99mmdebstrap"  # where mmdebstrap keeps the --dpkgopt lines
DISABLED_UNITS = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
)
ENABLED_UNITS = ("systemd-networkd.service",)
# Generators that find nothing to do in this image but cost a process each at every boot, before
# any unit starts (masked: 3.6 -> 2.8 s from systemd's start to its first job under TCG). There is
# no crypttab, integritytab or veritytab, no hibernation, no offline update, no systemd.run=, no
# rc.local, and gpt-auto acts only under systemd-boot. Unmask one by deleting its /dev/null link
# in /etc/systemd/system-generators.
MASKED_GENERATORS = (
    "systemd-cryptsetup-generator",
    "systemd-integritysetup-generator",
    "systemd-veritysetup-generator",
    "systemd-hibernate-resume-generator",
    "systemd-gpt-auto-generator",
    "systemd-system-update-generator",
    "systemd-run-generator",
    "systemd-rc-local-generator",
)
INITRAMFS_MODULES = ("virtio_pci", "virtio_blk", "virtio_scsi", "sd_mod", "nvme", "ext4")
KERNEL_ARGS = "ro console=tty0 console=ttyS0,115200n8"

SECTOR = 512
MIB = 1 << 20
DISK_SIZE = 2 << 30
EXT4_BLOCK = 4096
# zstd-compressed clusters: a third of the size (112 instead of 339 MiB), made in ~2 s (zlib:
# ~14 s), no measurable cost at boot. Readable by QEMU 5.1 and later.
QCOW2_OPTIONS = ("-f", "raw", "-O", "qcow2", "-c", "-o", "compression_type=zstd")
GPT_TRAILER_SECTORS = 33  # backup table (32 sectors of entries) and header at the disk's end
BIOS_BOOT = (1 * MIB, 3 * MIB)  # (offset, size)
ESP = (4 * MIB, 124 * MIB)
ROOT_OFFSET = 128 * MIB
TYPE_BIOS_BOOT = "21686148-6449-6E6F-744E-656564454649"
TYPE_ESP = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
TYPE_LINUX = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"

GRUB_DIR = Path("/usr/lib/grub")
GRUB_COMMON_MODULES = (
    "part_gpt",
    "part_msdos",
    "ext2",
    "fat",
    "search",
    "search_fs_uuid",
    "normal",
    "linux",
    "configfile",
    "echo",
    "test",
    "ls",
    "cat",
    "serial",
    "terminal",
    "reboot",
    "halt",
)
GRUB_EFI_MODULES = GRUB_COMMON_MODULES + ("efi_gop",)
GRUB_BIOS_MODULES = GRUB_COMMON_MODULES + ("biosdisk",)
# boot.img and diskboot.img fields (grub's include/grub/i386/pc/boot.h), as grub-bios-setup sets them
BOOT_KERNEL_SECTOR = 0x5C
BOOT_DRIVE = 0x64
BOOT_DRIVE_CHECK = 0x66
MBR_CODE_SIZE = 0x1B8  # boot code; the disk signature and partition table after it are kept
DISKBOOT_BLOCKLIST = SECTOR - 12  # start (u64), length in sectors (u16), segment (u16)

# Commands and files the build runs or reads, and the Debian package of each.
HOST_COMMANDS = {
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "mkfs.vfat": "dosfstools",
    "mmd": "mtools",
    "mcopy": "mtools",
    "sfdisk": "fdisk",
    "qemu-img": "qemu-utils",
    "grub-mkimage": "grub-common",
}
HOST_FILES = {
    GRUB_DIR / "x86_64-efi" / "kernel.img": "grub-efi-amd64-bin",
    GRUB_DIR / "i386-pc" / "boot.img": "grub-pc-bin",
}
GRUB_PACKAGES = ("grub-common", "grub-efi-amd64-bin", "grub-pc-bin")


class BuildError(Exception):
    """An expected failure: reported as one line on stderr, exit status 3."""


class Partition(NamedTuple):
    number: int
    offset: int
    size: int
    type_guid: str
    name: str
    part_uuid: str


class Layout(NamedTuple):
    disk_size: int
    disk_guid: str
    bios_boot: Partition
    esp: Partition
    root: Partition
    root_fs_uuid: str
    esp_volume_id: str  # FAT serial, 8 hex digits


# --------------------------------------------------------------------------- helpers


class Log:
    """build.log: every command and its output; the console gets one line per step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.step = 0
        self.current: tuple[str, float] | None = None
        self.seconds: dict[str, float] = {}

    def close(self) -> None:
        self.handle.close()

    def say(self, step: str, message: str) -> None:
        """Start the next step: one line on the console; the previous step's time is kept."""
        self.end_step()
        self.current = (step, time.monotonic())
        self.step += 1
        line = f"[{self.step}/{STEPS}] {message}"
        say(line)
        self.write(f"==> {line}\n")

    def end_step(self) -> dict[str, float]:
        """Close the running step; the seconds each step took so far."""
        if self.current is not None:
            name, began = self.current
            self.seconds[name] = round(time.monotonic() - began, 1)
            self.current = None
        return dict(self.seconds)

    def write(self, text: str) -> None:
        self.handle.write(text)
        self.handle.flush()


def say(message: str) -> None:
    print(f"build_debian: {message}", flush=True)


def run(log: Log, cmd: Sequence[str], what: str, cwd: Path | None = None) -> str:
    """Run a command, logging its output; BuildError naming the step and its last output lines."""
    log.write(f"$ {shlex.join(cmd)}\n")
    try:
        proc = subprocess.run(
            list(cmd),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            check=False,
        )
    except OSError as exc:
        raise BuildError(f"{what}: cannot run {cmd[0]}: {exc.strerror or exc}") from None
    log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        detail = " | ".join(tail[-4:]) or "no output"
        raise BuildError(
            f"{what}: {cmd[0]} failed (exit {proc.returncode}): {detail} (full output: {log.path})"
        )
    return proc.stdout


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "vmlaunch" / "debian-apt"


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    path.write_text(text, encoding="utf-8")
    os.chmod(path, mode)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Serialise concurrent builders writing into the same output directory."""
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below directory (mmdebstrap mounts /proc, /sys, /dev in the chroot)."""
    prefix = str(directory)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return found


@contextlib.contextmanager
def work_dir(parent: Path) -> Iterator[Path]:
    """A scratch directory beside the output; never removed while something is mounted in it."""
    path = Path(tempfile.mkdtemp(prefix=".build-", dir=parent))
    try:
        yield path
    finally:
        for point in sorted(mounts_under(path), key=len, reverse=True):
            subprocess.run(["umount", "--lazy", point], check=False, capture_output=True)
        if mounts_under(path):
            say(f"warning: {path} still has mounts; left in place")
        else:
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- host tools


def dpkg_version(package: str) -> str:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f", "${db:Status-Status} ${Version}", package],
        capture_output=True,
        text=True,
        check=False,
    )
    status, _, version = proc.stdout.partition(" ")
    return version if proc.returncode == 0 and status == "installed" else ""


def missing_host_packages() -> list[str]:
    missing = {pkg for cmd, pkg in HOST_COMMANDS.items() if shutil.which(cmd) is None}
    missing |= {pkg for path, pkg in HOST_FILES.items() if not path.exists()}
    return sorted(missing)


def lock_holder(path: Path) -> int | None:
    """The process holding the fcntl lock on `path` as apt and dpkg take it (0 when its pid is not
    known), or None when it is free or is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # struct flock: l_type, l_whence, l_start, l_len, l_pid (F_GETLK asks who would block a write lock)
        asked = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        try:
            answer = fcntl.fcntl(fd, fcntl.F_GETLK, asked)
        except OSError:
            return 0 if _locked(path) else None
        kind, _, _, _, pid = struct.unpack("hhqqi", answer)
        return None if kind == fcntl.F_UNLCK else max(pid, 0)
    finally:
        os.close(fd)


def _locked(path: Path) -> bool:
    """Whether a write lock on `path` would block: the fallback where F_GETLK is refused."""
    try:
        with open(path, "r+b") as handle:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def wait_for_apt(lock: Path, bound: float = APT_WAIT, poll: float = 0.5) -> None:
    """Wait until no other apt or dpkg holds `lock`, at most `bound` seconds, saying so once;
    BuildError naming the holder at the bound."""
    holder = lock_holder(lock)
    if holder is None:
        return
    who = f"another apt or dpkg (pid {holder}{_command_of(holder)})" if holder else "another apt or dpkg"
    say(f"waiting for {who} to release {lock}, at most {bound:g} s")
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        time.sleep(min(poll, max(deadline - time.monotonic(), 0)))
        if lock_holder(lock) is None:
            say(f"{lock} is free: going on")
            return
    raise BuildError(f"{who} still holds {lock} after {bound:g} s: let it finish (or stop it), "
                     "then run tools/build_debian.py again")


def _command_of(pid: int) -> str:
    try:
        return ": " + Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def ensure_host_tools(log: Log) -> None:
    missing = missing_host_packages()
    if not missing:
        log.write("host tools: all present\n")
        return
    # apt's own wait for the lock (DPkg::Lock::Timeout) backs ours up: another apt may take the lock
    # between our look and apt's start
    apt_get = ["apt-get", "-o", f"DPkg::Lock::Timeout={APT_WAIT:.0f}"]
    command = [*apt_get, "install", "-y", "--no-install-recommends", *missing]
    say(f"installing host packages: {' '.join(missing)}")
    env_cmd = ["env", "DEBIAN_FRONTEND=noninteractive", *command]
    wait_for_apt(DPKG_LOCK)
    try:
        run(log, env_cmd, "installing host packages")
    except BuildError:
        wait_for_apt(LISTS_LOCK)
        run(log, [*apt_get, "update"], "apt-get update")
        wait_for_apt(DPKG_LOCK)
        run(log, env_cmd, "installing host packages")
    still = missing_host_packages()
    if still:
        raise BuildError(f"installed {' '.join(missing)}, yet still missing: {' '.join(still)}")


# --------------------------------------------------------------------------- the archive


class Source(NamedTuple):
    """One `deb` entry of apt's sources: an archive's URI, one suite, its components."""

    uri: str
    suite: str
    components: tuple[str, ...]
    options: tuple[str, ...]  # one-line options, e.g. "signed-by=/usr/share/keyrings/x.gpg"
    where: str  # the file (and line) it was read from

    def line(self) -> str:
        """The entry in apt's one-line format, as mmdebstrap takes it."""
        options = f"[{' '.join(self.options)}] " if self.options else ""
        return f"deb {options}{self.uri} {self.suite} {' '.join(self.components)}"


def parse_one_line(text: str, where: str) -> list[Source]:
    """The `deb` entries of a sources.list (apt's one-line format); deb-src and comments skipped."""
    found = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()  # apt ends an entry at '#'
        kind, *tail = line.split(None, 1) or [""]
        if kind != "deb" or not tail:
            continue
        options: tuple[str, ...] = ()
        rest = tail[0]
        if rest.startswith("["):
            inside, closed, rest = rest[1:].partition("]")
            if not closed:
                continue  # apt rejects the line too
            options = tuple(inside.split())
        words = rest.split()
        if len(words) < 2 or words[1].endswith("/"):
            continue  # malformed, or a flat repository (an exact path, no suite)
        found.append(Source(words[0], words[1], tuple(words[2:]), options, f"{where}:{number}"))
    return found


def deb822_stanzas(text: str) -> list[tuple[int, dict[str, str]]]:
    """(first line, fields) of each stanza; field names lower-cased, continuation lines joined."""
    stanzas: list[tuple[int, dict[str, str]]] = []
    fields: dict[str, str] = {}
    start, name = 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                stanzas.append((start, fields))
            fields, name = {}, ""
            continue
        if line[0] in " \t":
            if name:
                fields[name] += "\n" + line.strip()
            continue
        key, colon, value = line.partition(":")
        if not colon:
            continue
        if not fields:
            start = number
        name = key.strip().lower()
        fields[name] = value.strip()
    if fields:
        stanzas.append((start, fields))
    return stanzas


def parse_deb822(text: str, where: str) -> list[Source]:
    """The `deb` entries of a .sources file (deb822: Types, URIs, Suites, Components, options)."""
    found = []
    for start, fields in deb822_stanzas(text):
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").strip().lower() in ("no", "false", "0"):
            continue
        options = []
        for field, value in fields.items():
            option = DEB822_OPTIONS.get(field)
            if option is None:
                continue
            if "\n" in value:  # an embedded key (Signed-By): no one-line form
                options.append(f"{option}=<embedded key>")
            else:
                options.append(f"{option}={','.join(value.replace(',', ' ').split())}")
        components = tuple(fields.get("components", "").split())
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                if not suite.endswith("/"):
                    found.append(Source(uri, suite, components, tuple(options), f"{where}:{start}"))
    return found


def apt_source_files(etc: Path) -> list[Path]:
    """apt's source files in the order apt reads them."""
    files = [etc / "sources.list"] if (etc / "sources.list").is_file() else []
    folder = etc / "sources.list.d"
    if folder.is_dir():
        files += sorted(p for p in folder.iterdir() if p.suffix in (".list", ".sources") and p.is_file())
    return files


def read_apt_sources(files: Sequence[Path]) -> list[Source]:
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise BuildError(f"cannot read {path}: {exc.strerror or exc}") from None
        parse = parse_deb822 if path.suffix == ".sources" else parse_one_line
        found += parse(text, str(path))
    return found


def lists_file(uri: str, suite: str, name: str) -> str:
    """The name apt gives a file of the archive in /var/lib/apt/lists (apt's URItoFileName)."""
    address = f"{uri.rstrip('/')}/dists/{suite}/{name}"
    scheme, sep, rest = address.partition("://")
    if not sep:
        rest = address.partition(":")[2].lstrip("/") if ":" in address else address
    host, slash, path = rest.partition("/")
    host = host.rpartition("@")[2]  # no user or password
    quoted = "".join(
        f"%{ord(c):02x}" if c in '\\|{}[]<>"^~_=!@#$%&*' or ord(c) <= 0x20 or ord(c) >= 0x7F else c
        for c in host + slash + path
    )
    return quoted.replace("/", "_")


def release_origin(source: Source, lists: Path) -> str:
    """The Origin of the entry's Release file as apt last fetched it; "" when apt has none."""
    for name in ("InRelease", "Release"):
        try:
            text = (lists / lists_file(source.uri, source.suite, name)).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Origin:"):
                return line.partition(":")[2].strip()
        return ""
    return ""


def merge_sources(sources: Sequence[Source]) -> list[Source]:
    """One entry per (URI, suite, options), with the components of all such entries."""
    merged: dict[tuple[str, str, tuple[str, ...]], Source] = {}
    for source in sources:
        key = (source.uri.rstrip("/"), source.suite, source.options)
        if key in merged:
            known = merged[key]
            extra = tuple(c for c in source.components if c not in known.components)
            merged[key] = known._replace(components=known.components + extra)
        else:
            merged[key] = source
    return list(merged.values())


def mirror_sources(environ: Mapping[str, str]) -> list[Source]:
    """The entries the environment names instead of apt's sources (VMLAUNCH_DEBIAN_MIRROR)."""
    found = []
    for variable, suites in ((MIRROR_ENV, SUITES[:2]), (SECURITY_MIRROR_ENV, SUITES[2:])):
        uri = environ.get(variable, "").strip()
        if not uri:
            continue
        if ":" not in uri or " " in uri:
            raise BuildError(f"{variable}={uri!r} is not a URI (like scheme://host/path)")
        found += [Source(uri, suite, (REQUIRED_COMPONENT,), (), variable) for suite in suites]
    return found


def archive_sources(
    etc: Path = APT_ETC, lists: Path = APT_LISTS, environ: Mapping[str, str] | None = None
) -> tuple[list[Source], list[str]]:
    """The `deb` entries of the Debian archive for SUITES, and the suites found missing.

    From VMLAUNCH_DEBIAN_MIRROR (and VMLAUNCH_DEBIAN_SECURITY_MIRROR) when set, else from apt's
    sources on this machine: the entries of SUITES whose components include main (the components
    of entries for the same URI, suite and options are merged), less those apt knows to be from
    another origin than Debian (the Origin of their Release file in apt's lists: a third-party
    repository may name its suite after the release). BuildError when there is none for SUITE.
    """
    environ = os.environ if environ is None else environ
    if environ.get(MIRROR_ENV, "").strip():
        chosen = mirror_sources(environ)
        read = f"${MIRROR_ENV}"
    elif environ.get(SECURITY_MIRROR_ENV, "").strip():
        raise BuildError(f"{SECURITY_MIRROR_ENV} is set but {MIRROR_ENV} is not")
    else:
        files = apt_source_files(etc)
        read = ", ".join(str(p) for p in files) or f"no sources in {etc}"
        found = merge_sources(read_apt_sources(files))
        chosen = [
            s for s in found
            if s.suite in SUITES and REQUIRED_COMPONENT in s.components
            and release_origin(s, lists) in ("", "Debian")
        ]
        if not any(s.suite == SUITE for s in chosen):
            suites = sorted({s.suite for s in found}) or ["none"]
            raise BuildError(
                f"apt's sources on this machine have no `deb` entry for {SUITE} with component "
                f"{REQUIRED_COMPONENT} of the Debian archive (read: {read}; suites found: "
                f"{', '.join(suites)}); add one, or set {MIRROR_ENV} to the URI of a Debian "
                f"mirror (and {SECURITY_MIRROR_ENV} to one of the security archive)"
            )
    embedded = [s.where for s in chosen if any("<embedded key>" in o for o in s.options)]
    if embedded:
        raise BuildError(
            f"an entry for {SUITE} has its key embedded in Signed-By ({', '.join(embedded)}), which "
            f"mmdebstrap's one-line entries cannot carry: point Signed-By at a keyring file, or set "
            f"{MIRROR_ENV}"
        )
    chosen.sort(key=lambda s: SUITES.index(s.suite))
    missing = [suite for suite in SUITES if not any(s.suite == suite for s in chosen)]
    return chosen, missing


def log_sources(log: Log, sources: Sequence[Source], missing: Sequence[str]) -> None:
    for source in sources:
        log.write(f"archive: {source.line()} (from {source.where})\n")
    if missing:
        line = (f"warning: no entry for {', '.join(missing)} in the archive's sources: "
                "the image lacks those updates")
        say(line)
        log.write(line + "\n")



# --------------------------------------------------------------------------- manifest


def input_hashes() -> dict[str, str]:
    """What the image is made from besides the archive: this file and the host's GRUB.

    Not the archive's entries (archive_sources): mirrors serve the same archive, whose changing
    contents no key follows anyway (``--force``); the suites and the packages are this file's.
    """
    try:
        builder = hashlib.sha256(BUILDER.read_bytes()).hexdigest()
    except OSError as exc:
        raise BuildError(f"cannot read {BUILDER}: {exc.strerror or exc}") from None
    inputs = {"builder-sha256": builder}
    inputs.update({pkg: dpkg_version(pkg) for pkg in GRUB_PACKAGES})
    return inputs


def inputs_digest(inputs: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def read_manifest(out: Path) -> dict[str, object]:
    try:
        data = json.loads((out / f"{NAME}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT else {}


def is_up_to_date(out: Path) -> bool:
    manifest = read_manifest(out)
    if not manifest or manifest.get("inputs_sha256") != inputs_digest(input_hashes()):
        return False
    try:
        return (out / f"{NAME}.qcow2").stat().st_size == manifest.get("size")
    except OSError:
        return False


def file_digests(path: Path) -> tuple[str, str]:
    sha256, sha512 = hashlib.sha256(), hashlib.sha512()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(4 * MIB), b""):
            sha256.update(block)
            sha512.update(block)
    return sha256.hexdigest(), sha512.hexdigest()


def installed_packages(root: Path) -> dict[str, str]:
    proc = subprocess.run(
        ["dpkg-query", f"--admindir={root}/var/lib/dpkg", "-W", "-f", "${Package}\t${Version}\n"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BuildError(f"cannot list the image's packages: {proc.stderr.strip()}")
    pairs = (line.split("\t", 1) for line in proc.stdout.splitlines() if "\t" in line)
    return dict(sorted((name, version) for name, version in pairs))


def kernel_release(root: Path) -> str:
    found = sorted(p.name[len("vmlinuz-") :] for p in (root / "boot").glob("vmlinuz-*"))
    if len(found) != 1:
        raise BuildError(f"expected one kernel in the image's /boot, found {found or 'none'}")
    return found[0]


# --------------------------------------------------------------------------- bootstrap


def early_overlay(directory: Path) -> None:
    """Files that must be in place before the packages are configured (the initramfs config)."""
    modules = ",".join(INITRAMFS_MODULES)
    write_file(
        directory / "etc/tiny-initramfs/tiny-initramfs.conf",
        "# vmlaunch: the disk drivers of QEMU guests, not what the build host uses\n"
        f"AUTO_MODULES=no\nINCLUDE_MODULES={modules}\nMICROCODE=no\nDEBUG=no\n",
    )


def bootstrap(log: Log, root: Path, overlay: Path, cache: Path, sources: Sequence[Source]) -> None:
    archives, lists = cache / "archives", cache / "lists"
    archives.mkdir(parents=True, exist_ok=True)
    lists.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mmdebstrap",
        "--mode=root",
        "--variant=apt",
        "--format=directory",
        "--verbose",
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        "--skip=essential/unlink",  # keep the downloaded .debs for the cache
        f"--include={','.join(PACKAGES)}",
        *(f"--dpkgopt={option}" for option in DPKG_OPTIONS),
        f"--dpkgopt={BUILD_ONLY_DPKG_OPTION}",
        '--setup-hook=mkdir -p "$1/var/cache/apt/archives" "$1/var/lib/apt/lists"',
        f"--setup-hook=sync-in {archives} /var/cache/apt/archives",
        f"--setup-hook=sync-in {lists} /var/lib/apt/lists",
        f'--essential-hook=cp -a {shlex.quote(str(overlay))}/. "$1/"',
        f"--customize-hook=sync-out /var/cache/apt/archives {archives}",
        f"--customize-hook=sync-out /var/lib/apt/lists {lists}",
        SUITE,
        str(root),
        *(source.line() for source in sources),
    ]
    run(log, cmd, "mmdebstrap")


def prune_cache(cache: Path, packages: dict[str, str]) -> None:
    """Drop cached .debs of versions the image no longer has."""
    wanted = {f"{name}_{version.replace(':', '%3a')}_" for name, version in packages.items()}
    for deb in (cache / "archives").glob("*.deb"):
        if not any(deb.name.startswith(prefix) for prefix in wanted):
            with contextlib.suppress(OSError):
                deb.unlink()


# --------------------------------------------------------------------------- configure


def configure(log: Log, root: Path, layout: Layout) -> None:
    forget_build_settings(root)
    remove_host_identity(root)
    write_guest_config(root, layout)
    tune_boot(log, root)
    check_no_host_identity(root)


def forget_build_settings(root: Path) -> None:
    dpkg_config = root / DPKG_CONFIG
    kept = [line for line in dpkg_config.read_text().splitlines() if line != BUILD_ONLY_DPKG_OPTION]
    write_file(dpkg_config, "".join(f"{line}\n" for line in kept))


def remove_host_identity(root: Path) -> None:
    """What each VM must make for itself, and what mmdebstrap copied from the build host."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    write_file(root / "etc/machine-id", "")
    with contextlib.suppress(FileNotFoundError):
        (root / "var/lib/dbus/machine-id").unlink()
    write_file(root / "etc/hostname", "localhost\n")
    write_file(
        root / "etc/hosts",
        "127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\t\tip6-allnodes\nff02::2\t\tip6-allrouters\n",
    )
    resolv = root / "etc/resolv.conf"
    if resolv.exists() or resolv.is_symlink():
        resolv.unlink()
    resolv.symlink_to("../run/systemd/resolve/stub-resolv.conf")


def write_guest_config(root: Path, layout: Layout) -> None:
    # cloud-init's locale module would otherwise try to generate and set a default locale
    write_file(root / "etc/default/locale", "LANG=C.UTF-8\n")
    write_file(
        root / "etc/fstab",
        "# <file system> <mount point> <type> <options> <dump> <pass>\n"
        f"UUID={layout.root_fs_uuid} / ext4 rw,discard,errors=remount-ro 0 0\n",
    )
    write_file(
        root / "etc/cloud/cloud.cfg.d/99_vmlaunch.cfg",
        "# vmlaunch: look only for a NoCloud seed (a volume labelled 'cidata'); None lets the\n"
        "# boot finish without one.\n"
        "datasource_list: [ NoCloud, None ]\n"
        "# GRUB is not a package in this image (its images are made by the builder): nothing for\n"
        "# the grub-dpkg module to configure (it took ~3 s of the config stage).\n"
        "grub_dpkg:\n  enabled: false\n",
    )
    write_file(root / "boot/grub/grub.cfg", grub_config(layout))


def tune_boot(log: Log, root: Path) -> None:
    """Less work between the kernel and the first SSH login (each process counts under TCG)."""
    write_file(
        root / "etc/systemd/system/ssh.service.d/vmlaunch.conf",
        "# vmlaunch: start sshd at once, without a first sshd run that only tests the config (ssh\n"
        "# started 1.5 s sooner under TCG); a broken config still fails the start.\n"
        "[Service]\nExecStartPre=\n",
    )
    generators = root / "etc/systemd/system-generators"
    generators.mkdir(parents=True, exist_ok=True)
    for name in MASKED_GENERATORS:
        (generators / name).unlink(missing_ok=True)
        (generators / name).symlink_to("/dev/null")
    units = [unit for unit in DISABLED_UNITS if unit_exists(root, unit)]
    run(log, ["chroot", str(root), "systemctl", "disable", *units], "disabling units")
    run(log, ["chroot", str(root), "systemctl", "enable", *ENABLED_UNITS], "enabling units")


def check_no_host_identity(root: Path) -> None:
    leftovers = sorted(str(p.relative_to(root)) for p in (root / "etc/ssh").glob("ssh_host_*"))
    if leftovers or (root / "etc/machine-id").stat().st_size:
        raise BuildError(f"the image would carry host identity: {leftovers or 'etc/machine-id'}")


def unit_exists(root: Path, unit: str) -> bool:
    return any((root / d / unit).exists() for d in ("usr/lib/systemd/system", "lib/systemd/system"))


# --------------------------------------------------------------------------- boot loader


def grub_early_config(layout: Layout) -> str:
    return (
        f"search --no-floppy --fs-uuid --set=root {layout.root_fs_uuid}\n"
        "set prefix=($root)/boot/grub\n"
    )


def grub_config(layout: Layout) -> str:
    return (
        "# Written by vmlaunch's tools/build_debian.py. The root is found by UUID by the early\n"
        "# config built into the GRUB images; /vmlinuz and /initrd.img follow kernel upgrades.\n"
        "set default=0\n"
        "set timeout=0\n"
        'if [ "$grub_platform" = "pc" ]; then\n'
        "  serial --unit=0 --speed=115200\n"
        "  terminal_input console serial\n"
        "  terminal_output console serial\n"
        "fi\n"
        "menuentry 'Debian GNU/Linux 12 (bookworm)' {\n"
        f"  linux /vmlinuz root=UUID={layout.root_fs_uuid} {KERNEL_ARGS}\n"
        "  initrd /initrd.img\n"
        "}\n"
    )


def make_grub_image(log: Log, platform: str, modules: Sequence[str], early: Path, out: Path) -> None:
    cmd = [
        "grub-mkimage",
        f"--directory={GRUB_DIR / platform}",
        f"--format={platform}",
        f"--config={early}",
        "--prefix=/boot/grub",
        f"--output={out}",
        *modules,
    ]
    run(log, cmd, f"grub-mkimage {platform}")


def bios_boot_code(core: bytes, boot_img: bytes, core_sector: int) -> tuple[bytes, bytes]:
    """(MBR boot code, core image) as grub-bios-setup writes them for an embedded core image.

    boot.img loads the core image's first sector (diskboot) from core_sector; diskboot's block
    list names the sectors of the rest, which follow it contiguously in the BIOS boot partition.
    """
    if len(boot_img) != SECTOR:
        raise BuildError(f"boot.img is {len(boot_img)} bytes, expected {SECTOR}")
    core = core + b"\0" * (-len(core) % SECTOR)
    sectors = len(core) // SECTOR
    boot = bytearray(boot_img)
    struct.pack_into("<Q", boot, BOOT_KERNEL_SECTOR, core_sector)
    boot[BOOT_DRIVE] = 0xFF  # use the drive the BIOS booted from
    boot[BOOT_DRIVE_CHECK : BOOT_DRIVE_CHECK + 2] = b"\x90\x90"  # trust it is a hard disk
    patched = bytearray(core)
    _start, _length, segment = struct.unpack_from("<QHH", patched, DISKBOOT_BLOCKLIST)
    struct.pack_into("<QHH", patched, DISKBOOT_BLOCKLIST, core_sector + 1, sectors - 1, segment)
    struct.pack_into("<QHH", patched, DISKBOOT_BLOCKLIST - 12, 0, 0, 0)  # list terminator
    return bytes(boot[:MBR_CODE_SIZE]), bytes(patched)


# --------------------------------------------------------------------------- disk


def plan_layout() -> Layout:
    def part(number: int, offset: int, size: int, type_guid: str, name: str) -> Partition:
        return Partition(number, offset, size, type_guid, name, str(uuid.uuid4()).upper())

    last_usable = DISK_SIZE - GPT_TRAILER_SECTORS * SECTOR
    root_size = (last_usable - ROOT_OFFSET) // MIB * MIB
    return Layout(
        disk_size=DISK_SIZE,
        disk_guid=str(uuid.uuid4()).upper(),
        bios_boot=part(14, *BIOS_BOOT, TYPE_BIOS_BOOT, "bios"),
        esp=part(15, *ESP, TYPE_ESP, "esp"),
        root=part(1, ROOT_OFFSET, root_size, TYPE_LINUX, "root"),
        root_fs_uuid=str(uuid.uuid4()),
        esp_volume_id=uuid.uuid4().hex[:8].upper(),
    )


def sfdisk_script(disk: Path, layout: Layout) -> str:
    lines = ["label: gpt", f"label-id: {layout.disk_guid}", "unit: sectors", "first-lba: 2048"]
    for p in (layout.root, layout.bios_boot, layout.esp):
        lines.append(
            f"{disk}{p.number} : start={p.offset // SECTOR}, size={p.size // SECTOR}, "
            f'type={p.type_guid}, uuid={p.part_uuid}, name="{p.name}"'
        )
    return "\n".join(lines) + "\n"


def check_disk(log: Log, disk: Path, layout: Layout) -> None:
    """The partition table as asked, after the file systems were made into the file."""
    table = json.loads(run(log, ["sfdisk", "--json", str(disk)], "reading the partition table"))
    got = {
        (int(p["start"]) * SECTOR, int(p["size"]) * SECTOR, str(p["uuid"]).upper())
        for p in table["partitiontable"]["partitions"]
    }
    want = {(p.offset, p.size, p.part_uuid) for p in (layout.root, layout.bios_boot, layout.esp)}
    if got != want:
        raise BuildError(f"the disk's partition table is not the one planned: {got} != {want}")


def partition_disk(log: Log, disk: Path, layout: Layout) -> None:
    with open(disk, "wb") as handle:
        handle.truncate(layout.disk_size)
    script = sfdisk_script(disk, layout)
    log.write(script)
    cmd = ["sfdisk", "--no-reread", "--no-tell-kernel", "--quiet", str(disk)]
    log.write(f"$ {shlex.join(cmd)} <<script\n")
    proc = subprocess.run(cmd, input=script, capture_output=True, text=True, check=False)
    log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise BuildError(f"sfdisk failed (exit {proc.returncode}): {proc.stderr.strip()}")
    check_disk(log, disk, layout)


def make_root_fs(log: Log, tree: Path, disk: Path, layout: Layout) -> None:
    """ext4 from the tree, made in place in the root partition of the disk file.

    mke2fs writes at an offset into the file, which spares a 2 GiB image and its copy (dd).
    """
    cmd = [
        "mkfs.ext4",
        "-q",
        "-F",
        "-d",
        str(tree),
        "-U",
        layout.root_fs_uuid,
        "-b",
        str(EXT4_BLOCK),
        # zero the inode tables and journal now, not in the guest's first minutes (ext4lazyinit)
        "-E",
        f"offset={layout.root.offset},lazy_itable_init=0,lazy_journal_init=0",
        str(disk),
        str(layout.root.size // EXT4_BLOCK),
    ]
    run(log, cmd, "mkfs.ext4")


def make_esp(log: Log, disk: Path, efi_binary: Path, layout: Layout) -> None:
    """FAT32 made in place in the EFI system partition; mtools address it as FILE@@OFFSET."""
    cmd = [
        "mkfs.vfat",
        "-F",
        "32",
        "-s",
        "1",
        "-n",
        "EFI",
        "-i",
        layout.esp_volume_id,
        f"--offset={layout.esp.offset // SECTOR}",
        str(disk),
        str(layout.esp.size // 1024),
    ]
    run(log, cmd, "mkfs.vfat")
    image = f"{disk}@@{layout.esp.offset}"
    run(log, ["mmd", "-i", image, "::/EFI", "::/EFI/BOOT"], "mmd")
    run(log, ["mcopy", "-i", image, str(efi_binary), "::/EFI/BOOT/BOOTX64.EFI"], "mcopy")


def write_at(disk: Path, offset: int, data: bytes) -> None:
    with open(disk, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


# --------------------------------------------------------------------------- build


class Tree(NamedTuple):
    """The installed, configured root tree and what the manifest says about it."""

    path: Path
    kernel: str
    packages: dict[str, str]


class BootCode(NamedTuple):
    efi_binary: Path  # EFI/BOOT/BOOTX64.EFI
    mbr_code: bytes  # the first 440 bytes of the disk
    core: bytes  # the BIOS core image, for the BIOS boot partition


def make_tree(log: Log, work: Path, layout: Layout, sources: Sequence[Source]) -> Tree:
    cache = cache_dir()
    root, overlay = work / "root", work / "overlay"
    early_overlay(overlay)
    log.say("mmdebstrap", f"mmdebstrap {SUITE}: {len(PACKAGES)} packages and their dependencies")
    log.write(f"apt cache: {cache}\n")
    bootstrap(log, root, overlay, cache, sources)
    packages = installed_packages(root)
    prune_cache(cache, packages)
    kernel = kernel_release(root)
    log.say("configure", f"configuring the tree ({len(packages)} packages, kernel {kernel})")
    configure(log, root, layout)
    return Tree(root, kernel, packages)


def make_boot_code(log: Log, work: Path, layout: Layout) -> BootCode:
    log.say("grub", "GRUB images: x86_64-efi (UEFI) and i386-pc (BIOS)")
    early = work / "early.cfg"
    early.write_text(grub_early_config(layout), encoding="utf-8")
    efi_binary, core_img = work / "BOOTX64.EFI", work / "core.img"
    make_grub_image(log, "x86_64-efi", GRUB_EFI_MODULES, early, efi_binary)
    make_grub_image(log, "i386-pc", GRUB_BIOS_MODULES, early, core_img)
    mbr_code, core = bios_boot_code(
        core_img.read_bytes(),
        (GRUB_DIR / "i386-pc" / "boot.img").read_bytes(),
        layout.bios_boot.offset // SECTOR,
    )
    if len(core) > layout.bios_boot.size:
        raise BuildError(f"GRUB's core image ({len(core)} bytes) exceeds the BIOS boot partition")
    return BootCode(efi_binary, mbr_code, core)


def make_disk(log: Log, work: Path, tree: Tree, boot: BootCode, layout: Layout) -> Path:
    """The raw disk: partition table, file systems made in their partitions, boot code."""
    log.say("disk", f"disk: GPT by sfdisk ({layout.disk_size // MIB} MiB), GRUB in the MBR and BIOS boot")
    disk = work / "disk.raw"
    partition_disk(log, disk, layout)
    write_at(disk, layout.bios_boot.offset, boot.core)
    write_at(disk, 0, boot.mbr_code)

    log.say("root-fs", f"root file system: mkfs.ext4 -d ({layout.root.size // MIB} MiB)")
    make_root_fs(log, tree.path, disk, layout)
    shutil.rmtree(tree.path, ignore_errors=True)

    log.say("esp", f"EFI system partition: FAT32 ({layout.esp.size // MIB} MiB), EFI/BOOT/BOOTX64.EFI")
    make_esp(log, disk, boot.efi_binary, layout)
    check_disk(log, disk, layout)
    return disk


def manifest_for(
    qcow2: Path, tree: Tree, layout: Layout, inputs: dict[str, str], sources: Sequence[Source]
) -> dict[str, object]:
    sha256, sha512 = file_digests(qcow2)
    return {
        "format": MANIFEST_FORMAT,
        "image": qcow2.name,
        "size": qcow2.stat().st_size,
        "virtual_size": layout.disk_size,
        "sha256": sha256,
        "sha512": sha512,
        "inputs_sha256": inputs_digest(inputs),
        "inputs": inputs,
        "suite": SUITE,
        "sources": [source.line() for source in sources],
        "kernel": tree.kernel,
        "kernel_args": f"root=UUID={layout.root_fs_uuid} {KERNEL_ARGS}",
        "boot": ["uefi", "bios"],
        "root_fs_uuid": layout.root_fs_uuid,
        "partitions": {
            p.name: {"number": p.number, "offset": p.offset, "size": p.size, "uuid": p.part_uuid}
            for p in (layout.bios_boot, layout.esp, layout.root)
        },
        "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "requested_packages": list(PACKAGES),
        "packages": tree.packages,
    }


def install(out: Path, qcow2: Path, manifest: dict[str, object]) -> None:
    """Move the image into place; the manifest last, so a crash leaves no stale one."""
    with contextlib.suppress(FileNotFoundError):
        (out / f"{NAME}.json").unlink()
    os.replace(qcow2, out / qcow2.name)
    tmp = out / f".{NAME}.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / f"{NAME}.json")


def build(
    log: Log, out: Path, inputs: dict[str, str], sources: Sequence[Source], started: float
) -> None:
    layout = plan_layout()
    with work_dir(out) as work:
        tree = make_tree(log, work, layout, sources)
        boot = make_boot_code(log, work, layout)
        disk = make_disk(log, work, tree, boot, layout)
        log.say("qcow2", "qemu-img convert -O qcow2 -c (zstd)")
        qcow2 = work / f"{NAME}.qcow2"
        run(log, ["qemu-img", "convert", *QCOW2_OPTIONS, str(disk), str(qcow2)], "qemu-img")
        log.say("manifest", "manifest: sha256, sha512")
        manifest = manifest_for(qcow2, tree, layout, inputs, sources)
        manifest["build_step_seconds"] = log.end_step()
        manifest["build_seconds"] = round(time.monotonic() - started, 1)
        install(out, qcow2, manifest)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    started = time.monotonic()
    image = out / f"{NAME}.qcow2"
    try:
        if not args.force and is_up_to_date(out):
            print(f"debian image up to date: {image}")
            return 0
        if os.geteuid() != 0:
            raise BuildError("must run as root (mmdebstrap --mode=root, chroot, device nodes)")
        out.mkdir(parents=True, exist_ok=True)
        with locked(out):
            if not args.force and is_up_to_date(out):  # another builder finished meanwhile
                print(f"debian image up to date: {image}")
                return 0
            log = Log(out / "build.log")
            try:
                sources, missing = archive_sources()
                log_sources(log, sources, missing)
                ensure_host_tools(log)
                build(log, out, input_hashes(), sources, started)
            finally:
                log.close()
    except BuildError as exc:
        print(f"build_debian: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"build_debian: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("build_debian: interrupted", file=sys.stderr)
        return 130
    size, seconds = image.stat().st_size, time.monotonic() - started
    say(f"built {image} ({size / MIB:.0f} MiB, {DISK_SIZE >> 30} GiB virtual) in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
