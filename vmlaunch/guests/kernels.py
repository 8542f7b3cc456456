"""Fast direct boot under TCG: a compressed kernel (bzImage) decompressed once on the host into a cached
ELF, which QEMU boots through its PVH entry.

Why: under TCG the kernel's own decompressor is emulated. The test guest's XZ bzImage spends ~2.9 s of
its 5.1 s to the shell decompressing itself; the same kernel decompressed on the host (0.9 s, once) boots
through PVH (`-kernel vmlinux`, QEMU's `pvh.bin` option ROM) in 2.2 s. Under KVM the decompressor runs
at native speed (a fraction of a second), so KVM VMs keep the bzImage; so do VMs with UEFI firmware
(OVMF loads a bzImage's EFI stub, not an ELF) and VMs with `fast_boot = false`.

What is read (the kernel's Documentation/arch/x86/boot.rst and arch/x86/boot/compressed/): the setup
header (`HdrS` at 0x202, protocol 2.08 or later for `payload_offset`/`payload_length`), the payload
after the setup sectors, its compression from its magic, and its last four bytes: the decompressed size
the kernel's build appends (for gzip, the gzip trailer's own ISIZE), which bounds the output before a
byte is decompressed (`MAX_ELF`) and checks it after. The output is the stripped vmlinux (and, with
CONFIG_X86_NEED_RELOCS, its relocations after it: an ELF loader ignores them). It is booted only when
its program headers hold the Xen note XEN_ELFNOTE_PHYS32_ENTRY (type 18): without it QEMU refuses an
ELF ("without PVH ELF Note").

Compressions: gzip, XZ, LZMA and bzip2 in-process (Python's zlib, lzma, bz2); zstd and LZ4 (legacy frames)
through the `zstd` and `lz4` programs (Debian's zstd and lz4 packages) when they are installed, as no
Python binding of them is a dependency of vmlaunch; LZO is not handled. Whatever is not handled boots as
the bzImage, as before, with a note saying why.

The cache ($VMLAUNCH_CACHE_DIR/kernels, else $XDG_CACHE_HOME/vmlaunch/kernels), keyed by the kernel's
SHA-256:

  sha256-HEX.elf    the decompressed ELF, read-only; renamed into place only once complete and checked
  sha256-HEX.json   what was found: the compression, the ELF's size and SHA-256, or why it is not booted
                    (no PVH note, a payload that does not decompress: the same bytes give the same answer)
  digests.json      kernel identity -> SHA-256 (this boot of the host; see below)
  .lock             flocked by the one process decompressing (or cleaning) at a time

Every use checks the ELF against its record (size, SHA-256, ELF magic and note): a truncated or damaged
file is removed and made again (by `up`; `cmdline` and `up --dry-run` write nothing and boot the bzImage
meanwhile).

Hashing 65 MB of ELF and 8 MB of kernel took ~50 ms of every `up`, so a file's SHA-256 is taken once per
boot of the host and then stands for it while the file is unchanged: while its identity (device, inode,
size, mtime and ctime, in ns) is the one recorded with the digest in this boot of the host
(`/proc/sys/kernel/random/boot_id`). Any write, truncation, chmod or rename sets the ctime to the time of
day, which no call can set back (only a change of the system clock), so a file changed or swapped since
is hashed again; a power cut that lost what was written starts a new boot. An identity is recorded only
for a file untouched for SETTLED seconds (as git's index does with racy timestamps): a write in the same
clock tick as the last one would leave the ctime as it was. The ELF's identity is in its record
(`identity`); the kernels' digests are in `digests.json` (DIGESTS_KEPT at most).

Bounded: at most CACHE_ENTRIES kernels and CACHE_BYTES, the least recently used (its record's mtime)
removed first, except one used in the last GRACE seconds (an `up` may be about to start QEMU on it).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

import attrs

from vmlaunch.core.fsutil import fsync_dir, is_temp_of, lock_if_current, temp_of, write_atomic
from vmlaunch.host.facts import Host, accel_of
from vmlaunch.spec.model import Accel, Firmware, LabSpec, VmSpec

log = logging.getLogger(__name__)

MAX_ELF = 512 << 20  # a decompressed kernel larger than this is not one: refused, the bzImage boots
CACHE_ENTRIES = 8  # kernels kept
CACHE_BYTES = 1 << 30  # bytes of ELFs kept
GRACE = 3600.0  # seconds: an entry used this recently is never removed to make room
SETTLED = 2.0  # seconds a file must be untouched before its identity stands for its digest
DIGESTS = "digests.json"  # in the kernels' cache: kernel identity -> SHA-256, for this boot
DIGESTS_KEPT = 64
CHUNK = 1 << 20  # bytes read, and at most produced, per step
PROGRAM_TIMEOUT = 300.0  # seconds a zstd or lz4 program may take
SUBDIR = "kernels"

# The setup header (boot.rst): sectors of setup code, its magic, protocol version, the payload's place
# and size (2.08+), the load address and the memory the decompressor needs from there (2.10+).
SETUP_SECTS, SETUP_MAGIC, SETUP_VERSION = 0x1F1, 0x202, 0x206
PAYLOAD_OFFSET, PAYLOAD_LENGTH, PREF_ADDRESS, INIT_SIZE = 0x248, 0x24C, 0x258, 0x260
HEADER_BYTES = INIT_SIZE + 4
ELF_MAGIC = b"\x7fELF"
EM_386, EM_X86_64 = 3, 62
PT_NOTE = 4
XEN_ELFNOTE_PHYS32_ENTRY = 18
MAX_NOTES = 1 << 20  # bytes of one PT_NOTE segment read


class Compression(enum.Enum):
    GZIP = "gzip"
    XZ = "xz"
    LZMA = "lzma"
    BZIP2 = "bzip2"
    ZSTD = "zstd"
    LZ4 = "lz4"
    LZO = "lzo"


MAGICS = (  # the first bytes of each compressor's stream, as the kernel's build makes them
    (b"\x1f\x8b", Compression.GZIP), (b"\xfd7zXZ\x00", Compression.XZ), (b"\x5d\x00\x00", Compression.LZMA),
    (b"BZh", Compression.BZIP2), (b"\x28\xb5\x2f\xfd", Compression.ZSTD),
    (b"\x02\x21\x4c\x18", Compression.LZ4), (b"\x89LZO", Compression.LZO))
PROGRAMS = {Compression.ZSTD: ("zstd", "-d", "-c", "-q"), Compression.LZ4: ("lz4", "-d", "-c", "-q")}
HANDLED = "gzip, xz, lzma and bzip2 (and zstd and lz4 with their programs installed)"


@attrs.frozen
class SetupHeader:
    """What an x86 bzImage's setup header says of it."""

    version: int  # the boot protocol, e.g. 0x20f for 2.15
    setup_bytes: int  # the real-mode setup code before the protected-mode kernel
    payload_offset: int  # of the compressed payload, from the protected-mode kernel (2.08+)
    payload_length: int
    pref_address: int  # where the kernel is loaded (2.10+)
    init_size: int  # the memory its decompressor needs from there (2.10+)


def read_setup_header(header: bytes) -> SetupHeader | None:
    """The setup header in the first HEADER_BYTES of a kernel; None when it is no bzImage (no `HdrS`)."""
    if len(header) < SETUP_VERSION + 2 or header[SETUP_MAGIC:SETUP_MAGIC + 4] != b"HdrS":
        return None
    header = header.ljust(HEADER_BYTES, b"\0")
    (version,) = struct.unpack_from("<H", header, SETUP_VERSION)
    sectors = header[SETUP_SECTS] or 4  # 0 means 4 (boot.rst)
    payload_offset, payload_length = struct.unpack_from("<II", header, PAYLOAD_OFFSET)
    (pref_address,) = struct.unpack_from("<Q", header, PREF_ADDRESS)
    (init_size,) = struct.unpack_from("<I", header, INIT_SIZE)
    return SetupHeader(version, (sectors + 1) * 512, payload_offset, payload_length, pref_address, init_size)


@attrs.frozen
class KernelBoot:
    """How a kernel boots under TCG, found before compiling (the compiler does no I/O): the ELF to give
    QEMU instead of it, or None for the kernel as the spec names it, and why, for a note."""

    kernel: Path
    elf: Path | None
    why: str
    told: bool = False  # the note was printed on this host before (`told_once`): not again, but with -v


TOLD = "told.json"  # in the kernels' cache: the ELFs whose boot through PVH was noted on this host


def told_once(kernels: Mapping[Path, KernelBoot], *, verbose: bool) -> dict[Path, KernelBoot]:
    """`kernels` with `told` set on each that boots through PVH from an ELF whose note this host has
    printed before (it says the same at every `up`, `cmdline` and `--dry-run`: once per kernel, and with
    -v), recording the others as told. Why a kernel does not boot through PVH is said every time: it
    asks for something. Without a usable cache: every note, every time."""
    from vmlaunch.core.fsutil import read_bounded
    from vmlaunch.layout.dirs import usable_cache_dir

    fast = {boot.elf.name for boot in kernels.values() if boot.elf is not None}
    folder = usable_cache_dir(SUBDIR) if fast else None
    if folder is None:
        return dict(kernels)
    told: set[str] = set()
    with contextlib.suppress(OSError, ValueError, TypeError, RecursionError):
        saved = json.loads(read_bounded(folder / TOLD, 1 << 20))
        told = {name for name in saved["told"] if isinstance(name, str)} if isinstance(saved, dict) else set()
    if not fast <= told:
        # forget the ELFs the cache no longer holds (the bound removed them: made again, noted again)
        kept = sorted(name for name in told | fast if (folder / name).exists())
        with contextlib.suppress(OSError):
            write_atomic(folder / TOLD, json.dumps({"told": kept}, indent=1), 0o644, durable=False)
    return {path: attrs.evolve(boot, told=not verbose and boot.elf is not None and boot.elf.name in told)
            for path, boot in kernels.items()}


def fast_boot_wanted(vm: VmSpec, host: Host) -> bool:
    """A VM whose kernel boots from the cached ELF when there is one: a direct-boot kernel under TCG,
    with BIOS firmware (OVMF would need the bzImage's EFI stub), `fast_boot` not turned off."""
    return (vm.kernel is not None and vm.fast_boot and vm.firmware is Firmware.BIOS
            and accel_of(vm.accel, host.kvm) is Accel.TCG)


def prepare(lab: LabSpec, host: Host, vms: Sequence[str] = (), *, build: bool) -> dict[Path, KernelBoot]:
    """How the kernel of each VM named (all when none are) that wants a fast boot boots, by kernel file.
    `build`: decompress a kernel not in the cache yet (`up`), else only say that `up` would (`cmdline`,
    `up --dry-run`). Never raises for a kernel: what cannot be done is a note, and the bzImage boots."""
    found: dict[Path, KernelBoot] = {}
    for vm in lab.select(vms):
        if vm.kernel is not None and vm.kernel not in found and fast_boot_wanted(vm, host):
            found[vm.kernel] = boot_of(vm.kernel, build=build)
    return found


def boot_of(kernel: Path, *, build: bool) -> KernelBoot:
    """How `kernel` boots (see `prepare`)."""
    try:
        return _boot_of(kernel, build)
    except _Fallback as fallback:
        return KernelBoot(kernel, None, f"kernel {_p(kernel)} {fallback}")
    except OSError as exc:  # a read that failed half-way (EIO), the cache's folder gone: never a failed up
        return KernelBoot(kernel, None, f"kernel {_p(kernel)} boots as given: {exc.strerror or exc}"
                          + (f" ({exc.filename})" if exc.filename else ""))
    except (ValueError, OverflowError, struct.error) as exc:  # headers pointing past any file's end
        return KernelBoot(kernel, None, f"kernel {_p(kernel)} boots as given: its headers do not add up "
                          f"({exc})")


class _Fallback(Exception):
    """Why the kernel boots as given: the rest of a one-line note after "kernel PATH "."""


class _Corrupt(Exception):
    """The payload does not decompress, or not to what its size says. `lasting`: the same bytes would
    give the same answer (not so for a program killed by a signal: a timeout, a lack of memory)."""

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


@attrs.frozen
class _Payload:
    compression: Compression
    start: int  # of the compressed stream, in the kernel file
    length: int  # of the compressed stream, without the size the build appended
    size: int  # bytes it decompresses to


def _boot_of(kernel: Path, build: bool) -> KernelBoot:
    try:
        fd = os.open(kernel, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not hang us
    except OSError as exc:
        raise _Fallback(f"cannot be read ({exc.strerror or exc}): booted as given") from None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Fallback("is not a regular file: booted as given")
        payload = _payload(file, st.st_size)
        cache = _cache_dir()
        digest = _kernel_digest(file, st, cache, remember=build)
        entry = _Entry(cache, digest, remember=build)
        found = entry.check(payload.compression, repair=False)
        if found is not None:
            return found.boot(kernel)
        if not build:
            raise _Fallback(f"boots as a bzImage for now: `up` decompresses its {payload.compression.value} "
                            f"payload once ({_mib(payload.size)}) into {cache} and then boots it "
                            "through its PVH entry, if the ELF has one")
        with _locked(cache):
            found = entry.check(payload.compression, repair=True)  # made by whoever held the lock before
            if found is None:
                found = entry.make(file, payload, kernel)
            _bound(cache, keep=entry)
        return found.boot(kernel)


def _payload(file: IO[bytes], size: int) -> _Payload:
    """Where the compressed kernel is in a bzImage, and how it is compressed; _Fallback for a kernel
    that is no bzImage of protocol 2.08+, or whose payload vmlaunch does not decompress."""
    head = file.read(HEADER_BYTES)
    if head[:4] == ELF_MAGIC:
        file.seek(0)
        entry = _pvh_entry(file)
        raise _Fallback("is an ELF already: booted as given" + (
            "" if entry is not None else " (it has no PVH entry note: QEMU may refuse it)"))
    setup = read_setup_header(head)
    if setup is None:
        raise _Fallback("is neither a bzImage nor an ELF: booted as given")
    if setup.version < 0x208:
        raise _Fallback(f"is a bzImage of boot protocol {setup.version >> 8}.{setup.version & 0xFF:02d}, "
                        "which does not say where its payload is (2.08 does): booted as a bzImage")
    start = setup.setup_bytes + setup.payload_offset
    if setup.payload_length < 8 or start + setup.payload_length > size:
        raise _Fallback("has a setup header whose payload lies outside the file: booted as a bzImage")
    file.seek(start)
    magic = file.read(8)
    compression = next((kind for prefix, kind in MAGICS if magic.startswith(prefix)), None)
    if compression is None:
        raise _Fallback(f"has a payload in a compression vmlaunch does not know (it starts with "
                        f"{magic[:6].hex(' ')}): booted as a bzImage")
    if compression is Compression.LZO:
        raise _Fallback(f"has an LZO payload, which vmlaunch does not decompress ({HANDLED} it does): "
                        "booted as a bzImage")
    program = PROGRAMS.get(compression)
    if program is not None and shutil.which(program[0]) is None:
        raise _Fallback(f"has a {compression.value} payload, which needs the {program[0]} program to "
                        f"decompress (Debian's {program[0]} package): booted as a bzImage")
    file.seek(start + setup.payload_length - 4)
    (decompressed,) = struct.unpack("<I", file.read(4))
    if decompressed > MAX_ELF:
        raise _Fallback(f"says its payload decompresses to {_mib(decompressed)}, more than the "
                        f"{_mib(MAX_ELF)} a kernel may be: booted as a bzImage")
    # gzip's stream ends with the size itself; every other compressor's is followed by it
    length = setup.payload_length - (0 if compression is Compression.GZIP else 4)
    return _Payload(compression, start, length, decompressed)


def _sha256(file: IO[bytes]) -> str:
    file.seek(0)
    hasher = hashlib.sha256()
    while chunk := file.read(CHUNK):
        hasher.update(chunk)
    return hasher.hexdigest()


def _identity(st: os.stat_result) -> list[object]:
    """What stands for a file's content while it is unchanged, in this boot of the host (see the
    module's doc); [] when the boot cannot be told (then nothing stands for a digest)."""
    boot = _boot_id()
    return [boot, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] if boot else []


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _settled(st: os.stat_result) -> bool:
    """The file was last changed SETTLED seconds ago or more: a change from now on gets a later ctime."""
    return time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= SETTLED * 1e9


def _hash_unchanged(file: IO[bytes], st: os.stat_result) -> tuple[str, bool]:
    """The file's SHA-256, and whether its identity may stand for it: settled before, and the same
    after (nothing wrote it while it was read)."""
    digest = _sha256(file)
    again = os.fstat(file.fileno())
    return digest, _settled(st) and bool(_identity(st)) and _identity(again) == _identity(st)


def _kernel_digest(file: IO[bytes], st: os.stat_result, folder: Path, *, remember: bool) -> str:
    """The kernel's SHA-256: the one `digests.json` has for its identity, else hashed (and kept, when
    `remember`: not by `cmdline`, which writes nothing)."""
    identity = _identity(st)
    saved = _read_json(folder / DIGESTS).get("kernels")
    known = [(item[0], item[1]) for item in (saved if isinstance(saved, list) else [])
             if isinstance(item, list) and len(item) == 2 and isinstance(item[0], list)
             and isinstance(item[1], str)]
    for key, digest in known:
        if identity and key == identity:
            return digest
    digest, stands = _hash_unchanged(file, st)
    if stands and remember:
        kept = [[key, value] for key, value in known if key[:1] == identity[:1] and key != identity]
        with contextlib.suppress(OSError):  # only a cache: hashed again next time
            write_atomic(folder / DIGESTS, _json({"kernels": [[identity, digest], *kept][:DIGESTS_KEPT]}),
                         durable=False)
    return digest


def _cache_dir() -> Path:
    from vmlaunch.layout.dirs import cache_dir, usable_cache_dir

    path = usable_cache_dir(SUBDIR)
    if path is None:
        raise _Fallback(f"boots as a bzImage: the cache ({cache_dir() / SUBDIR}) cannot be used (see the "
                        "warning above)")
    return path


# --- one entry -----------------------------------------------------------------------------------------


@attrs.frozen
class _Found:
    """What the cache knows of a kernel: its ELF, or why it does not boot through PVH."""

    compression: str
    elf: Path | None
    problem: str | None = None

    def boot(self, kernel: Path) -> KernelBoot:
        if self.elf is None:
            return KernelBoot(kernel, None, f"kernel {_p(kernel)} {self.problem}")
        return KernelBoot(kernel, self.elf, f"kernel {_p(kernel)} boots through its PVH entry from the ELF "
                          f"its {self.compression} payload decompresses to, made once and kept in the "
                          "cache: under TCG its own decompressor would take seconds at every boot")


class _Entry:
    def __init__(self, cache: Path, digest: str, *, remember: bool = True) -> None:
        self.cache = cache
        self.remember = remember  # an ELF's identity may be recorded (not by `cmdline`)
        self.elf = cache / f"sha256-{digest}.elf"
        self.meta = cache / f"sha256-{digest}.json"

    def check(self, compression: Compression, *, repair: bool) -> _Found | None:
        """The entry when it is there and sound; None when it must be made. `repair` (the cache's lock
        held): a damaged one is removed, to be made again; without it, it is left for `up`."""
        meta = _read_json(self.meta)
        if meta.get("compression") != compression.value:
            return None
        problem = meta.get("problem")
        if isinstance(problem, str):
            _touch(self.meta)
            return _Found(compression.value, None, problem)
        damage = self.damage(meta)
        if damage is None:
            _touch(self.meta)  # not the ELF: its times are part of its identity
            return _Found(compression.value, self.elf)
        if not repair:
            return None
        log.warning("kernel cache: %s %s: it is removed and made again", self.elf, damage)
        self.remove()
        return None

    def damage(self, meta: Mapping[str, object]) -> str | None:
        """What is wrong with the cached ELF against its record, or None."""
        try:
            fd = os.open(self.elf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return "is missing"
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        with os.fdopen(fd, "rb") as file:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "is not a regular file"
            if st.st_size != meta.get("size"):
                return f"has {st.st_size} bytes where its record says {meta.get('size')}"
            if _pvh_entry(file) is None:
                return "is no ELF with a PVH entry note"
            identity = _identity(st)
            if identity and meta.get("identity") == identity:
                return None  # hashed in this boot, untouched since (see the module's doc)
            digest, stands = _hash_unchanged(file, st)
            if digest != meta.get("sha256"):
                return "does not match its recorded SHA-256"
        if stands and self.remember:
            with contextlib.suppress(OSError):  # only a cache: hashed again next time
                write_atomic(self.meta, _json({**meta, "identity": identity}), durable=False)
        return None

    def remove(self) -> None:
        for path in (self.meta, self.elf):  # the record first: without it no reader trusts the ELF
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def make(self, file: IO[bytes], payload: _Payload, kernel: Path) -> _Found:
        """Decompress the payload into the cache (the cache's lock held), or say why not."""
        kind = payload.compression.value
        room = _room_for(self.cache)
        if room is not None and room < payload.size:
            raise _Fallback(f"boots as a bzImage: {self.cache} has too little room for its "
                            f"{_mib(payload.size)} decompressed (a file system's reserve is kept free)")
        log.info("kernel %s: decompressing its %s payload (%s) once into the cache, for TCG",
                 _p(kernel), kind, _mib(payload.length))
        tmp = temp_of(self.elf)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a process killed half-way (the lock is ours now)
        try:
            out_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _Fallback(f"boots as a bzImage: cannot write in {self.cache} "
                            f"({exc.strerror or exc})") from None
        try:
            with os.fdopen(out_fd, "w+b") as out:
                try:
                    written, digest = _decompress(file, payload, out)
                except _Corrupt as exc:
                    problem = (f"boots as a bzImage: its {kind} payload does not decompress ({exc}); its own "
                               "decompressor may fare no better")
                    if not exc.lasting:
                        raise _Fallback(problem) from None  # not remembered: the next up tries again
                    return self.record(kind, problem)
                out.seek(0)
                entry = _pvh_entry(out)
                if written != payload.size:
                    return self.record(kind, f"boots as a bzImage: its {kind} payload decompressed to "
                                       f"{written} bytes where the kernel says {payload.size} (corrupt)")
                if entry is None:
                    out.seek(0)
                    head = out.read(4)
                    what = "an ELF without a PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY; a kernel built " \
                           "without CONFIG_PVH)" if head == ELF_MAGIC else "no ELF"
                    return self.record(kind, f"boots as a bzImage: its {kind} payload decompresses to {what}")
                os.fchmod(out.fileno(), 0o444)
            # The ELF, then its record: a reader trusts an ELF only with a record that matches it. Not
            # fsynced: what a power cut damages is caught when it is next used, and made again.
            os.replace(tmp, self.elf)
            write_atomic(self.meta, _json({"compression": kind, "size": written, "sha256": digest,
                                           "pvh_entry": entry, "made": time.time()}), durable=False)
            fsync_dir(self.cache)
        except OSError as exc:  # ENOSPC, EDQUOT, EIO
            self.remove()
            raise _Fallback(f"boots as a bzImage: its decompressed ELF could not be kept in {self.cache} "
                            f"({exc.strerror or exc})") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return _Found(kind, self.elf)

    def record(self, kind: str, problem: str) -> _Found:
        """Remember why the kernel does not boot through PVH: the same bytes give the same answer."""
        with contextlib.suppress(OSError):  # only a cache: the next up finds it out again
            write_atomic(self.meta, _json({"compression": kind, "problem": problem, "made": time.time()}),
                         durable=False)
        return _Found(kind, None, problem)


def _room_for(folder: Path) -> int | None:
    """Bytes that may be written in `folder` leaving the file system's reserve free (as image
    downloads do); None when it cannot be told."""
    from vmlaunch.guests.images import disk_room

    room = disk_room(folder)
    return None if room is None else room[0] - room[1]


def _touch(path: Path) -> None:
    """Mark an entry used now (its mtime), for the least-recently-used rule."""
    with contextlib.suppress(OSError):
        os.utime(path)


# --- decompressing ---------------------------------------------------------------------------------------


def _decompress(file: IO[bytes], payload: _Payload, out: IO[bytes]) -> tuple[int, str]:
    """Decompress the payload into `out`: (bytes written, their SHA-256). _Corrupt when it does not
    decompress or would be larger than it says it is."""
    hasher = hashlib.sha256()
    written = 0
    for chunk in _inflated(_compressed(file, payload), payload.compression):
        written += len(chunk)
        if written > payload.size:
            raise _Corrupt(f"it decompresses to more than the {payload.size} bytes it says")
        hasher.update(chunk)
        out.write(chunk)
    out.flush()
    return written, hasher.hexdigest()


def _compressed(file: IO[bytes], payload: _Payload) -> Iterator[bytes]:
    file.seek(payload.start)
    left = payload.length
    while left > 0:
        chunk = file.read(min(CHUNK, left))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


def _inflated(source: Iterable[bytes], compression: Compression) -> Iterator[bytes]:
    """The decompressed bytes of `source`, at most CHUNK at a time (a small payload of zeros cannot
    fill the memory)."""
    if compression in PROGRAMS:
        yield from _through_program(source, PROGRAMS[compression])
        return
    import bz2
    import lzma
    import zlib

    inflater: _Inflater
    if compression is Compression.GZIP:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        errors: tuple[type[Exception], ...] = (zlib.error,)
    elif compression is Compression.BZIP2:
        inflater, errors = bz2.BZ2Decompressor(), (OSError, ValueError)
    else:
        kind = lzma.FORMAT_XZ if compression is Compression.XZ else lzma.FORMAT_ALONE
        inflater, errors = lzma.LZMADecompressor(kind), (lzma.LZMAError,)
    try:
        yield from _stepped(source, inflater)
    except errors as exc:
        raise _Corrupt(str(exc) or type(exc).__name__) from None


class _Inflater(Protocol):
    """What zlib's, lzma's and bz2's decompressors have in common."""

    @property
    def eof(self) -> bool: ...

    def decompress(self, data: bytes, max_length: int, /) -> bytes: ...


def _stepped(source: Iterable[bytes], inflater: _Inflater) -> Iterator[bytes]:
    """Drive a zlib, lzma or bz2 decompressor with bounded output until its stream ends. zlib hands
    back the input it did not use (`unconsumed_tail`); lzma and bz2 keep it themselves."""
    for chunk in source:
        data = chunk
        while True:
            out = inflater.decompress(data, CHUNK)
            if out:
                yield out
            data = getattr(inflater, "unconsumed_tail", b"")
            if inflater.eof:
                return
            if not data and not out:
                break
    raise _Corrupt("it ends before its compressed stream does (truncated)")


def _through_program(source: Iterable[bytes], argv: Sequence[str]) -> Iterator[bytes]:
    """The output of a decompressing program fed `source` (by a thread, so that neither side waits on a
    full pipe); killed after PROGRAM_TIMEOUT, or when the caller stops reading."""
    import subprocess

    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr

    def feed() -> None:
        with contextlib.suppress(OSError):  # a program that stopped reading: its exit status says why
            for chunk in source:
                stdin.write(chunk)
        with contextlib.suppress(OSError):
            stdin.close()

    said: list[bytes] = [b""]

    def drain() -> None:  # all of it read (a full pipe would stop the program), its end kept
        while chunk := stderr.read(4096):
            said[0] = (said[0] + chunk)[-4096:]

    threads = [threading.Thread(target=feed, daemon=True), threading.Thread(target=drain, daemon=True)]
    for thread in threads:
        thread.start()
    timer = threading.Timer(PROGRAM_TIMEOUT, proc.kill)
    timer.start()
    try:
        while chunk := stdout.read1(CHUNK):  # type: ignore[attr-defined]
            yield chunk
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for thread in threads:
            thread.join(5)
        stdout.close()
        stderr.close()
    if code < 0:
        import signal

        raise _Corrupt(f"{argv[0]} was killed by {signal.Signals(-code).name}", lasting=False)
    if code != 0:
        lines = said[0].decode(errors="replace").strip().splitlines()
        raise _Corrupt(f"{argv[0]} exited with {code}" + (f": {lines[-1][:200]}" if lines else ""))


# --- the ELF -------------------------------------------------------------------------------------------


def _pvh_entry(file: IO[bytes]) -> int | None:
    """The PVH entry address the ELF in `file` gives in its Xen note XEN_ELFNOTE_PHYS32_ENTRY, or None
    (no x86 ELF, or no such note). Reads the ELF header, program headers and note segments only."""
    file.seek(0)
    ident = file.read(64)
    if len(ident) < 52 or ident[:4] != ELF_MAGIC or ident[5] != 1:  # little-endian only (x86)
        return None
    is64 = ident[4] == 2
    (machine,) = struct.unpack_from("<H", ident, 18)
    if machine not in (EM_386, EM_X86_64) or (is64 and len(ident) < 64):
        return None
    if is64:
        (phoff,) = struct.unpack_from("<Q", ident, 32)
        phentsize, phnum = struct.unpack_from("<HH", ident, 54)
    else:
        (phoff,) = struct.unpack_from("<I", ident, 28)
        phentsize, phnum = struct.unpack_from("<HH", ident, 42)
    if phentsize < (56 if is64 else 32) or phnum == 0:
        return None
    file.seek(phoff)
    table = file.read(phentsize * phnum)
    for index in range(len(table) // phentsize):
        base = index * phentsize
        (kind,) = struct.unpack_from("<I", table, base)
        if kind != PT_NOTE:
            continue
        offset, size = (struct.unpack_from("<QxxxxxxxxxxxxxxxxQ", table, base + 8) if is64
                        else struct.unpack_from("<IxxxxxxxxI", table, base + 4))
        file.seek(offset)
        entry = _xen_entry(file.read(min(size, MAX_NOTES)))
        if entry is not None:
            return entry
    return None


def _xen_entry(notes: bytes) -> int | None:
    """The entry address of the Xen PHYS32_ENTRY note among `notes` (a PT_NOTE segment), or None."""
    at = 0
    while at + 12 <= len(notes):
        namesz, descsz, kind = struct.unpack_from("<III", notes, at)
        name_at = at + 12
        desc_at = name_at + (namesz + 3) // 4 * 4
        at = desc_at + (descsz + 3) // 4 * 4
        if at > len(notes):
            return None
        if kind == XEN_ELFNOTE_PHYS32_ENTRY and notes[name_at:name_at + namesz].rstrip(b"\0") == b"Xen" \
                and descsz in (4, 8):
            return int.from_bytes(notes[desc_at:desc_at + descsz], "little")
    return None


# --- the cache as a whole ------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """The cache's lock: one process decompresses or removes at a time; a second waits, then finds
    the kernel done."""
    from vmlaunch.core.wait import wait_until

    lock = cache / ".lock"

    def take() -> int | None:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _Fallback(f"boots as a bzImage: cannot lock {lock} ({exc.strerror or exc})") from None
        return lock_if_current(fd, lock)

    fd = take()
    if fd is None:
        log.info("kernel cache: waiting for another vmlaunch decompressing a kernel (%s)", lock)
        fd = wait_until(take, float("inf"), interval=0.05, progress_every=5.0,
                        progress=lambda waited: log.info("kernel cache: still waiting, %.0f s", waited))
    try:
        yield
    finally:
        os.close(fd)  # the lock file stays: removing it would race a waiter


@attrs.frozen
class CachedKernel:
    digest: str
    elf: Path | None  # None: a record of a kernel that does not boot through PVH
    size: int  # bytes of its files
    used: float  # Unix time it was last used


def list_cached(cache: Path) -> list[CachedKernel]:
    """The entries of the kernel cache, most recently used first."""
    entries: dict[str, list[os.DirEntry[str]]] = {}
    with os.scandir(cache) as found:
        for item in found:
            stem, dot, suffix = item.name.partition(".")
            if stem.startswith("sha256-") and dot and suffix in ("elf", "json"):
                entries.setdefault(stem[len("sha256-"):], []).append(item)
    kernels = []
    for digest, items in entries.items():
        stats = [(item.name, item.stat(follow_symlinks=False)) for item in items]
        elf = next((cache / name for name, _ in stats if name.endswith(".elf")), None)
        kernels.append(CachedKernel(digest, elf, sum(st.st_size for _, st in stats),
                                    max(st.st_mtime for _, st in stats)))
    return sorted(kernels, key=lambda k: k.used, reverse=True)


def cached() -> tuple[Path | None, list[CachedKernel]]:
    """The kernel cache's folder (None: it cannot be used) and its entries, most recently used first."""
    from vmlaunch.layout.dirs import usable_cache_dir

    cache = usable_cache_dir(SUBDIR)
    return cache, list_cached(cache) if cache is not None else []


def remove_all() -> list[Path]:
    """Remove every entry of the kernel cache (`image rm --kernels`), under its lock (waiting for an
    `up` decompressing one): the files removed. The next `up` under TCG makes what it needs again."""
    from vmlaunch.errors import HostError

    cache, _ = cached()
    if cache is None:
        return []
    removed = []
    try:
        with _locked(cache):
            for kernel in list_cached(cache):
                entry = _Entry(cache, kernel.digest)
                removed += [path for path in (entry.meta, entry.elf) if path.exists()]
                entry.remove()
            _bound(cache, keep=_Entry(cache, ""))  # and the temp files of killed processes
    except _Fallback as exc:
        raise HostError(f"cannot remove the kernel cache: {str(exc).split(': ', 1)[-1]}") from None
    return removed


def _bound(cache: Path, keep: _Entry) -> None:
    """Remove the least recently used entries past CACHE_ENTRIES or CACHE_BYTES (not `keep`, nor one used
    in the last GRACE seconds), and temp files of processes killed while writing (the lock is ours)."""
    now = time.time()
    count = total = 0
    for kernel in list_cached(cache):
        count += 1
        total += kernel.size
        mine = kernel.elf == keep.elf or cache / f"sha256-{kernel.digest}.json" == keep.meta
        if (count <= CACHE_ENTRIES and total <= CACHE_BYTES) or mine or now - kernel.used < GRACE:
            continue
        log.info("kernel cache: removing %s (least recently used; the cache keeps %d kernels, %s)",
                 kernel.digest[:12], CACHE_ENTRIES, _mib(CACHE_BYTES))
        _Entry(cache, kernel.digest).remove()
        count -= 1
        total -= kernel.size
    for name in os.listdir(cache):
        parts = name[1:].split(".", 2)
        if len(parts) == 3 and is_temp_of(name, f"{parts[0]}.{parts[1]}") and (
                parts[0].startswith("sha256-") or f"{parts[0]}.{parts[1]}" == DIGESTS):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cache / name)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size / 1024:.0f} KiB"


def _read_json(path: Path) -> dict[str, object]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            data = json.loads(file.read(1 << 16))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _json(data: Mapping[str, object]) -> str:
    return json.dumps(data, indent=2) + "\n"


def _p(path: Path) -> str:
    """A kernel's path in a note: relative to the working directory when it is under it (as a spec's
    relative path reads), quoted with escapes when it holds a control character."""
    text = str(path)
    with contextlib.suppress(ValueError, OSError):
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            text = relative
    return json.dumps(text) if any(ord(c) < 32 or ord(c) == 127 for c in text) else text
