"""vmlaunch's own small initramfs, for `vmlaunch run --kernel` without `--initrd`: a static busybox,
vmlaunch's agent (`guest_agent.sh`, as /bin/vmlaunch-agent), the kernel's modules the boot needs and
`run_init.sh` as /init (it mounts the `vl.share=TAG:PATH[:ro]` shares, configures the network by DHCP,
starts the agent on the command channel's port and prints VMLAUNCH-GUEST-READY).

The modules: virtio PCI (and what it depends on), virtio_console (the command channel is a virtio-serial
port), 9p over virtio (shares) and virtio_net, each either a module file or built into the kernel;
virtio_blk when the kernel has it. They come from `--modules DIR` (a kernel build tree or a
/lib/modules/RELEASE folder), else from the build tree the kernel sits in (`TREE/arch/x86/boot/bzImage`),
else from this host's /lib/modules/RELEASE. A module is built in when modules.builtin says so or the
kernel's .config (the tree's, else /boot/config-RELEASE) has it `=y`. Their load order is their
`depends=`; each module's `vermagic=` must name the kernel's release (a module of another kernel does
not load).

The archive (gzip'd newc cpio) is built once and kept in the cache ($VMLAUNCH_CACHE_DIR/initramfs),
named for the SHA-256 of what goes in (busybox, init, agent, each module's bytes): written to a temp
name and renamed, so two vmlaunch building it at once each write their own, and none reads half a file.
At most CACHE_ENTRIES are kept, least recently used removed first (never one used in the last GRACE s).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import logging
import os
import re
import stat
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

from vmlaunch.errors import HostError, SpecUnfit, UsageError
from vmlaunch.guests import kmod
from vmlaunch.guests.cpio import CpioWriter

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
INIT = HERE / "run_init.sh"
BUSYBOXES = (Path("/bin/busybox"), Path("/usr/bin/busybox"))  # Debian's busybox-static puts it there
FORMAT = "vmlaunch-initramfs 1"  # changes when the archive's layout does
SUBDIR = "initramfs"
CACHE_ENTRIES = 8
GRACE = 3600.0  # seconds: an archive used this recently is never removed (a run may be booting it)
MAX_KERNEL = 512 << 20  # bytes of a kernel read at most (a larger file is no kernel)
MAX_BUSYBOX = 16 << 20
SETUP_MAGIC, KERNEL_VERSION = 0x202, 0x20E  # the setup header (Documentation/arch/x86/boot.rst)
BANNER = b"Linux version "  # how an ELF vmlinux's linux_banner begins
RELEASE = re.compile(r"[0-9][A-Za-z0-9._+~-]{0,127}\Z")
GUEST_DIRS = ("bin", "dev", "etc", "lib", "lib/modules", "mnt", "proc", "root", "run", "sys", "tmp", "var")
MODULE_LIST = "etc/vl-modules"


@attrs.frozen
class Needed:
    """A module the boot needs: its name, the kernel option that provides it, what it is for."""

    name: str
    option: str
    purpose: str


# The boot's modules; what they depend on (virtio, virtio_ring, virtio_pci_modern_dev, netfs, failover...)
# is read from each module's depends=.
REQUIRED = (
    Needed("virtio_pci", "CONFIG_VIRTIO_PCI", "virtio PCI devices"),
    Needed("virtio_console", "CONFIG_VIRTIO_CONSOLE", "the command channel, a virtio-serial port"),
    Needed("9pnet_virtio", "CONFIG_NET_9P_VIRTIO", "shares: 9p over virtio"),
    Needed("9p", "CONFIG_9P_FS", "shares: the 9p file system"),
    Needed("virtio_net", "CONFIG_VIRTIO_NET", "the network"),
)
OPTIONAL = (Needed("virtio_blk", "CONFIG_VIRTIO_BLK", "disks"),)
# The options of the modules the needed ones depend on (for a refusal's words and a .config's =y).
OPTIONS = {**{n.name: n.option for n in REQUIRED + OPTIONAL}, "virtio": "CONFIG_VIRTIO",
           "virtio_ring": "CONFIG_VIRTIO", "virtio_pci_modern_dev": "CONFIG_VIRTIO_PCI_LIB",
           "virtio_pci_legacy_dev": "CONFIG_VIRTIO_PCI_LIB_LEGACY", "9pnet": "CONFIG_NET_9P",
           "netfs": "CONFIG_NETFS_SUPPORT", "fscache": "CONFIG_FSCACHE", "failover": "CONFIG_FAILOVER",
           "net_failover": "CONFIG_NET_FAILOVER"}


@attrs.frozen
class ModuleSet:
    """The modules a kernel's boot needs: the files to load, in load order, and the needed ones it has
    built in. `folder`: where the files came from (None: none needed, or none found)."""

    kernel: Path
    release: str
    folder: Path | None
    modules: tuple[kmod.Module, ...]
    builtin: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(module.name for module in self.modules)


# --- the kernel's release ---------------------------------------------------------------------------


def kernel_release(path: Path) -> str:
    """The release of the kernel at `path` (`6.1.0-56-amd64`): from a bzImage's setup header (its
    kernel_version string), or from the banner of an ELF vmlinux that QEMU can boot (one with a PVH
    entry note). UsageError for a file that is neither, or that cannot be read."""
    with _open_kernel(path) as file:
        head = file.read(1 << 16)
        if head[SETUP_MAGIC:SETUP_MAGIC + 4] == b"HdrS":
            return _setup_release(path, head)
        if head[:4] == b"\x7fELF":
            return _elf_release(path, file)
    raise UsageError(f"kernel {path} is no Linux kernel: neither a bzImage (no 'HdrS' setup header at "
                     "0x202) nor an ELF vmlinux", "give the kernel build's arch/x86/boot/bzImage")


@contextlib.contextmanager
def _open_kernel(path: Path) -> Iterator[io.BufferedReader]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"kernel {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"kernel {path} is no kernel: it is not a regular file")
    with os.fdopen(fd, "rb") as file:
        yield file


def _setup_release(path: Path, head: bytes) -> str:
    from vmlaunch.guests.kernels import read_setup_header

    header = read_setup_header(head)
    (pointer,) = struct.unpack_from("<H", head, KERNEL_VERSION)
    start = pointer + 0x200
    if header is None or header.version < 0x200 or not pointer or start >= min(len(head), header.setup_bytes):
        raise UsageError(f"kernel {path} is a bzImage without a version string in its setup header "
                         "(boot protocol 2.00 or later has one)", "give a kernel built by Linux's own build")
    text = head[start:start + 256].split(b"\0", 1)[0].decode("ascii", "replace")
    return _release_of(path, text, "its setup header's version")


def _elf_release(path: Path, file: io.BufferedReader) -> str:
    from vmlaunch.guests.kernels import _pvh_entry

    if _pvh_entry(file) is None:
        raise UsageError(f"kernel {path} is an ELF without a PVH entry note: QEMU boots an ELF kernel only "
                         "through PVH (a kernel built with CONFIG_PVH)", "give arch/x86/boot/bzImage")
    file.seek(0)
    tail, read = b"", 0
    while read < MAX_KERNEL and (chunk := file.read(1 << 20)):
        read += len(chunk)
        data = tail + chunk
        at = data.find(BANNER)
        while 0 <= at < len(data) - 256:  # the banner names the release, then " (" and who built it
            words = data[at + len(BANNER):at + 256].decode("ascii", "replace").split(" ")
            if len(words) > 1 and RELEASE.match(words[0]) and words[1].startswith("("):
                return words[0]
            at = data.find(BANNER, at + 1)
        tail = data[-256:]
    raise UsageError(f"kernel {path} is an ELF without a 'Linux version' banner: no vmlinux")


def _release_of(path: Path, text: str, where: str) -> str:
    release = text.split(" ", 1)[0]
    if not RELEASE.match(release):
        raise UsageError(f"kernel {path}: {where} names no release ({text[:40]!r})")
    return release


# --- the modules -----------------------------------------------------------------------------------


def modules_for(kernel: Path, modules: Path | None = None) -> ModuleSet:
    """The modules `kernel`'s boot needs, in load order (see the module's docstring for where they are
    looked for). UsageError when `kernel` is no kernel, `modules` is no modules folder, a module is
    built for another kernel, or nothing says what the kernel has; SpecUnfit naming each needed module
    the kernel has neither as a file nor built in, and the option that provides it."""
    release = kernel_release(kernel)
    folder = _folder_for(kernel, release, modules)
    config = kmod.config_values(_config_of(folder, release))
    if folder is None and not config:
        raise UsageError(f"kernel {kernel} ({release}): no modules found for it (this host has no "
                         f"/lib/modules/{release}, and no /boot/config-{release} says what it has built in)",
                         f"give --modules DIR: its build tree, or its /lib/modules/{release} folder")
    builtin = (kmod.builtin_modules(folder) if folder is not None else set()) | {
        name for name, option in OPTIONS.items() if config.get(option) == "y"}
    index = kmod.index_modules(folder) if folder is not None else {}
    roots = [n.name for n in REQUIRED] + [n.name for n in OPTIONAL if n.name in index]
    try:
        loaded, missing = kmod.gather(roots, index, builtin)
    except kmod.ModuleError as exc:
        raise UsageError(f"kernel {kernel}: {exc}") from None
    if missing:
        raise SpecUnfit(_missing(kernel, release, folder, missing, config),
                        "build the kernel with each of these =y or =m (and `make modules`), or give "
                        "--modules the folder that holds them")
    for module in loaded:
        magic = (kmod.modinfo(module.data, "vermagic") or "").split(" ", 1)[0]
        if magic != release:
            raise UsageError(f"module {module.path} is built for kernel {magic or 'no release'}, not "
                             f"{release} (kernel {kernel})", "give --modules the modules of this kernel")
    needed = {n.name for n in REQUIRED + OPTIONAL}
    return ModuleSet(kernel, release, folder, tuple(loaded), tuple(sorted(needed & builtin)))


def _folder_for(kernel: Path, release: str, given: Path | None) -> Path | None:
    if given is not None:
        if not given.is_dir():
            raise UsageError(f"--modules {given}: not a folder", "give a kernel build tree or a "
                             "/lib/modules/RELEASE folder")
        if not any((given / name).exists() for name in ("modules.builtin", "modules.order", "modules.dep",
                                                         ".config", "kernel")):
            raise UsageError(f"--modules {given}: no kernel modules folder (it has no modules.builtin, "
                             "modules.order, modules.dep, .config nor kernel/)",
                             f"give the kernel's build tree, or its /lib/modules/{release} folder")
        return given
    real = kernel.resolve()
    # the kernel where its build leaves it: TREE/arch/x86/boot/bzImage or TREE/vmlinux, beside .config
    trees = [(real.parent, "vmlinux")] + ([(real.parents[3], "arch/x86/boot/bzImage")]
                                          if len(real.parents) > 3 else [])
    for tree, place in trees:
        if real == tree / place and (tree / ".config").is_file() and (tree / "Makefile").is_file():
            return tree
    host = Path("/lib/modules") / release
    return host if host.is_dir() else None


def _config_of(folder: Path | None, release: str) -> Path:
    if folder is not None and (folder / ".config").is_file():
        return folder / ".config"
    return Path("/boot") / f"config-{release}"


def _missing(kernel: Path, release: str, folder: Path | None, missing: dict[str, str],
             config: dict[str, str]) -> str:
    words = []
    for name, needed_by in missing.items():
        option = OPTIONS.get(name)
        purpose = next((n.purpose for n in REQUIRED + OPTIONAL if n.name == name), f"needed by {needed_by}")
        said = f" (its .config says {option}={config[option]})" if option and option in config else ""
        words.append(f"{name} ({option or 'its option'}: {purpose}){said}")
    where = f"in {folder}" if folder is not None else "anywhere (no modules folder)"
    return (f"kernel {kernel} ({release}) lacks what vmlaunch's guest needs, neither a module {where} nor "
            f"built in: {'; '.join(words)}")


# --- the archive -----------------------------------------------------------------------------------


def busybox() -> tuple[Path, bytes]:
    """This host's static busybox. HostError when there is none, or only a dynamically linked one."""
    found = next((path for path in BUSYBOXES if path.is_file()), None)
    if found is None:
        raise HostError("no busybox on this host: vmlaunch's own initramfs needs a static one "
                        "(/bin/busybox)", "install Debian's busybox-static, or give --initrd")
    try:
        with open(found, "rb") as file:
            data = file.read(MAX_BUSYBOX + 1)
    except OSError as exc:
        raise HostError(f"cannot read {found}: {exc.strerror or exc}") from None
    if len(data) > MAX_BUSYBOX or not _static_elf(data):
        raise HostError(f"{found} is no statically linked busybox (the initramfs has no libraries to "
                        "run it with)", "install Debian's busybox-static (it replaces busybox), or give "
                        "--initrd")
    return found, data


def _static_elf(data: bytes) -> bool:
    """An x86-64 ELF executable without a program interpreter (PT_INTERP)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    if phentsize < 56 or phoff + phentsize * phnum > len(data):
        return False
    return all(struct.unpack_from("<I", data, phoff + i * phentsize)[0] != 3 for i in range(phnum))


def build(kernel: Path, modules: Path | None = None) -> Path:
    """vmlaunch's initramfs for `kernel` (gzip'd newc cpio), from the cache when it was built before.
    Raises as `modules_for` does; HostError without a static busybox or a usable cache."""
    return build_for(modules_for(kernel, modules))


def build_for(found: ModuleSet) -> Path:
    """The initramfs holding `found`'s modules (see `build`)."""
    from vmlaunch.guests.channel import AGENT_SH
    from vmlaunch.layout.dirs import usable_cache_dir

    _, box = busybox()
    init, agent = INIT.read_bytes(), AGENT_SH.read_bytes()
    key = hashlib.sha256(FORMAT.encode())
    for part in (box, init, agent):
        key.update(hashlib.sha256(part).digest())
    for module in found.modules:
        key.update(module.name.encode() + b"\0" + hashlib.sha256(module.data).digest())
    cache = usable_cache_dir(SUBDIR)
    if cache is None:
        raise HostError("vmlaunch's initramfs cannot be kept: the cache folder is unusable (said above)",
                        "set VMLAUNCH_CACHE_DIR to a folder only you can write, or give --initrd")
    path = cache / f"sha256-{key.hexdigest()}.cpio.gz"
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.utime(path)  # used now: the least-recently-used rule keeps it
            return path
    log.info("building vmlaunch's initramfs for kernel %s (modules: %s)", found.release,
             " ".join(found.names) or "all built in")
    from vmlaunch.core.fsutil import write_atomic

    try:
        write_atomic(path, _archive(box, init, agent, found.modules), 0o644, durable=False)
    except OSError as exc:
        raise HostError(f"cannot write vmlaunch's initramfs in {cache}: {exc.strerror or exc}") from None
    _bound(cache, keep=path)
    return path


def _archive(box: bytes, init: bytes, agent: bytes, modules: tuple[kmod.Module, ...]) -> bytes:
    raw = io.BytesIO()
    cpio = CpioWriter(raw)
    for directory in GUEST_DIRS:
        cpio.directory(directory, 0o1777 if directory == "tmp" else 0o755)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", box, 0o755)
    cpio.file("bin/vmlaunch-agent", agent, 0o755)
    cpio.file("init", init, 0o755)
    for module in modules:
        cpio.file(f"lib/modules/{module.name}.ko", module.data)
    cpio.file(MODULE_LIST, "".join(f"{module.name}\n" for module in modules).encode())
    cpio.finish()
    # level 1: a few percent larger than 9, several times faster to make; the kernel inflates either
    return gzip.compress(raw.getvalue(), compresslevel=1, mtime=0)


def _bound(cache: Path, keep: Path) -> None:
    """Remove the least recently used archives past CACHE_ENTRIES (not `keep`, none used in GRACE s)."""
    now = time.time()
    entries = []
    with contextlib.suppress(OSError), os.scandir(cache) as found:
        for item in found:
            if item.name.startswith("sha256-") and item.name.endswith(".cpio.gz"):
                with contextlib.suppress(OSError):
                    entries.append((item.stat(follow_symlinks=False).st_mtime, Path(item.path)))
    for used, path in sorted(entries, reverse=True)[CACHE_ENTRIES:]:
        if path != keep and now - used >= GRACE:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
