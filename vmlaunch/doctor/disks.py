"""What is inside a disk image: its partitions (MBR, with its logical partitions, or GPT) and the file
system at the start of each, read through `qemu-io -r` (QEMU's own reader, so raw and qcow2 alike,
an overlay through its backing image, read-only and never a mount; `qemu-img dd` would do, but 7.2's
counts its `count` from the start of the image, not from `skip`). The guide's alignment advice needs the
first: a partition that does not start on a 4 KiB boundary turns each of the guest's 4 KiB writes
into two on the host. The cache study's advice needs the second: an ext3 file system ran without
write barriers by default in its day, so host write-back caching can lose what it thinks is on disk.

Answers are kept in the cache dir (`doctor-images.json`), keyed by each file's inode, size and
modification time, so `up` pays for the reads once per version of an image.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
from pathlib import Path
from typing import Any

import attrs

SECTOR = 512
MAX_ENTRIES_LBA = 2048  # a GPT's entries start at sector 2; tools put them within the first MiB
HEAD_SECTORS = 34  # the MBR, a GPT header and its 128 entries
EXTENDED_TYPES = {0x05, 0x0F, 0x85}
GPT_PROTECTIVE = 0xEE
EXT_MAGIC = 0xEF53
EXT_INCOMPAT_EXTENTS = 0x40
EXT_INCOMPAT_64BIT = 0x80
EXT_COMPAT_JOURNAL = 0x4
CACHE_FILE = "doctor-images.json"
CACHE_ENTRIES = 256


@attrs.frozen
class Partition:
    number: int  # 1-4 primary, 5+ logical (MBR); 1.. (GPT)
    start: int  # first sector (512 bytes)
    sectors: int
    filesystem: str | None = None  # "ext2", "ext3", "ext4", None: something else or unknown

    @property
    def aligned(self) -> bool:
        return self.start * SECTOR % 4096 == 0


@attrs.frozen
class ImageLayout:
    table: str  # "mbr", "gpt", "none"
    partitions: tuple[Partition, ...] = ()
    error: str | None = None  # why it could not be read


class Reader:
    """Reads sectors of one image through `qemu-io -r` (`-U`: also while a QEMU has it open)."""

    def __init__(self, path: Path, fmt: str, qemu_io: str = "qemu-io") -> None:
        self.path, self.fmt, self.qemu_io = path, fmt, qemu_io

    def read(self, start: int, count: int) -> bytes:
        """`count` sectors from sector `start`; fewer past the end of the image."""
        done = subprocess.run([self.qemu_io, "-r", "-U", "-f", self.fmt, "-c",
                               f"read -v {start * SECTOR} {count * SECTOR}", "--", str(self.path)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
                              timeout=60)
        if done.returncode != 0 or "read failed" in done.stdout:
            said = (done.stderr + done.stdout).strip().splitlines()
            raise OSError(said[-1] if said else f"qemu-io exited {done.returncode}")
        data = bytearray()
        for line in done.stdout.splitlines():
            address, colon, rest = line.partition(":  ")
            if colon and len(address) == 8 and all(c in "0123456789abcdef" for c in address):
                data += bytes.fromhex(rest[:47])
        return bytes(data)


def layout(reader: Reader) -> ImageLayout:
    """The image's partitions, with the file system each starts with."""
    try:
        head = reader.read(0, HEAD_SECTORS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ImageLayout("none", error=str(exc))
    try:
        table, partitions = _partitions(reader, head)
        found = tuple(attrs.evolve(part, filesystem=_filesystem(reader, head, part)) for part in partitions)
    except (OSError, subprocess.TimeoutExpired, struct.error, ValueError) as exc:
        return ImageLayout("none", error=str(exc))
    return ImageLayout(table, found)


def _partitions(reader: Reader, head: bytes) -> tuple[str, list[Partition]]:
    if len(head) < SECTOR or head[510:512] != b"\x55\xaa":
        return "none", []
    entries = [struct.unpack_from("<B3xBxxxII", head, 446 + 16 * i) for i in range(4)]
    if any(kind == GPT_PROTECTIVE for _, kind, _, _ in entries):
        return "gpt", _gpt(reader, head)
    parts = [Partition(i + 1, start, count) for i, (_, kind, start, count) in enumerate(entries)
             if kind and count and kind not in EXTENDED_TYPES]
    for _, kind, start, count in entries:
        if kind in EXTENDED_TYPES and count:
            parts += _logical(reader, start)
    return "mbr", parts


def _logical(reader: Reader, extended: int) -> list[Partition]:
    """The logical partitions: a chain of extended boot records, each relative to the extended one."""
    parts: list[Partition] = []
    ebr, seen = extended, set()
    while ebr and ebr not in seen and len(parts) < 64:
        seen.add(ebr)
        record = reader.read(ebr, 1)
        if record[510:512] != b"\x55\xaa":
            break
        _, kind, start, count = struct.unpack_from("<B3xBxxxII", record, 446)
        if kind and count:
            parts.append(Partition(5 + len(parts), ebr + start, count))
        _, next_kind, next_start, _ = struct.unpack_from("<B3xBxxxII", record, 462)
        ebr = extended + next_start if next_kind in EXTENDED_TYPES and next_start else 0
    return parts


def _gpt(reader: Reader, head: bytes) -> list[Partition]:
    header = head[SECTOR:2 * SECTOR]
    if header[:8] != b"EFI PART":
        raise ValueError("a protective MBR without a GPT header")
    entries_lba, count, size = struct.unpack_from("<QII", header, 72)
    if not 0 < size <= 4096 or count > 1024 or not 2 <= entries_lba <= MAX_ENTRIES_LBA:
        raise ValueError(f"a GPT header with {count} entries of {size} bytes at sector {entries_lba}")
    need = entries_lba * SECTOR + count * size
    if need <= len(head):
        data, base = head, entries_lba * SECTOR
    else:  # only the entries: the image's header decides where they are, never how much is read
        data, base = reader.read(entries_lba, -(-(count * size) // SECTOR)), 0
    parts = []
    for index in range(count):
        offset = base + index * size
        type_guid = data[offset:offset + 16]
        if type_guid == bytes(16):
            continue
        first, last = struct.unpack_from("<QQ", data, offset + 32)
        parts.append(Partition(index + 1, first, last - first + 1))
    return parts


def _filesystem(reader: Reader, head: bytes, part: Partition) -> str | None:
    """ext2/3/4 from the superblock 1 KiB into the partition; None for anything else."""
    offset = part.start * SECTOR + 1024
    block = head[offset:offset + 1024] if offset + 1024 <= len(head) else reader.read(part.start + 2, 2)
    if len(block) < 100 or struct.unpack_from("<H", block, 56)[0] != EXT_MAGIC:
        return None
    compat, incompat = struct.unpack_from("<II", block, 92)
    if incompat & (EXT_INCOMPAT_EXTENTS | EXT_INCOMPAT_64BIT):
        return "ext4"
    return "ext3" if compat & EXT_COMPAT_JOURNAL else "ext2"


# --- kept between runs -------------------------------------------------------------------------------


def cached_layout(path: Path, fmt: str, qemu_io: str = "qemu-io") -> ImageLayout:
    """`layout` of the image, from the cache when the file is the one it was read from."""
    from vmlaunch.layout.dirs import usable_cache_dir

    st = os.stat(path)
    key = [st.st_ino, st.st_size, st.st_mtime_ns, fmt]
    folder = usable_cache_dir()
    cache: dict[str, Any] = {}
    if folder is not None:
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads((folder / CACHE_FILE).read_text())
            cache = loaded if isinstance(loaded, dict) else {}
        entry = cache.get(str(path))
        if isinstance(entry, dict) and entry.get("key") == key:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                return ImageLayout(entry["table"], tuple(Partition(**part) for part in entry["partitions"]))
    found = layout(Reader(path, fmt, qemu_io))
    if folder is not None and found.error is None:
        cache[str(path)] = {"key": key, "table": found.table,
                            "partitions": [attrs.asdict(part) for part in found.partitions]}
        for old in list(cache)[:-CACHE_ENTRIES]:
            del cache[old]
        from vmlaunch.core.fsutil import write_atomic

        with contextlib.suppress(OSError):
            write_atomic(folder / CACHE_FILE, json.dumps(cache) + "\n", durable=False)
    return found
