"""Base images (`[image.NAME]`): fetched once into the cache, checked against their checksum, never
written; each VM that boots one gets a qcow2 overlay of its own (`resources/guest.py`).

The cache (`cache_dir()`: $VMLAUNCH_CACHE_DIR/images, else $XDG_CACHE_HOME/vmlaunch/images):

  sha512-HEX.img            a verified image, read-only. A file is only ever renamed to this name
                            after its checksum matched, so the name is the proof: it is not hashed again.
  sha512-HEX.json           what is known of it: the URL, the image names seen, size, format, when fetched
  .partial/sha512-HEX.part  a download under way or interrupted; the next pull resumes it
  .partial/sha512-HEX.lock  flocked by the one process pulling (or removing) that image
  .verified/KEY.json        a local `file` image's checksum result, valid while the file's (path, device,
                            inode, size, mtime, ctime) are unchanged, so a 2 GB image is hashed once

Safety: a qcow2 image may name a backing file or an external data file, which QEMU would open for the
guest: any file on this host the user can read. Such images are refused (`image_info`); every image
vmlaunch boots is self-contained.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import attrs

from vmlaunch.core.fsutil import fsync_dir, lock_if_current, write_atomic
from vmlaunch.errors import HostError, RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.spec.model import DiskFormat, Image

if TYPE_CHECKING:
    import http.client
    import urllib.request

log = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_DOWNLOAD = 64 << 30  # more is a wrong URL (or a hostile server), not a VM image: VMLAUNCH_IMAGE_MAX_SIZE
SPEED_LIMIT = 1 << 10  # bytes/s a download must average over SPEED_TIME: VMLAUNCH_PULL_SPEED_LIMIT (0: off)
SPEED_TIME = 60.0  # seconds: VMLAUNCH_PULL_SPEED_TIME, as curl's --speed-limit/--speed-time
RESERVE_SHARE = 0.05  # of the cache's file system a download leaves free,
RESERVE_LEAST = 1 << 30  # at least this,
RESERVE_MOST = 4 << 30  # and at most this (5 % of a 2 TB disk would forbid far too much)
ROOM_EVERY = 16 << 20  # bytes written between two looks at the free space (others write there too)
PROGRESS_EVERY = 5.0  # seconds between progress lines when standard error is not a terminal
BAR_EVERY = 0.1  # seconds between redraws of the progress bar
RATE_SHOWN = 5.0  # seconds over which the progress line's rate is measured
SMALL_DEADLINE = 120.0  # seconds a checksum file or signature may take in all (a server that drips)
TIMEOUT = 30.0  # seconds without a byte (connecting, or between reads) before a download fails
CHUNK = 1 << 20
QCOW2_MAGIC = b"QFI\xfb"
_QCOW2_EXTERNAL_DATA_FILE = 1 << 2  # incompatible_features bit 2
_HEX_DIGITS = {"sha256": 64, "sha512": 128}
_CACHED_NAME = re.compile(r"(sha256|sha512)-([0-9a-f]+)\.img")
_PARTIAL_NAME = re.compile(r"(sha256|sha512)-([0-9a-f]+)\.part")
_MIN_PREFIX = 8  # hex digits of a checksum that name a cached image


@attrs.frozen
class ImageInfo:
    format: DiskFormat
    virtual_size: int  # bytes the guest sees


@attrs.frozen
class Cached:
    """An image in the cache, and what its metadata says of it."""

    algo: str  # sha256 or sha512
    digest: str  # lower-case hex
    path: Path
    size: int  # bytes of the file
    format: str | None  # None: the metadata is missing or damaged
    names: tuple[str, ...] = ()
    url: str | None = None
    fetched: float | None = None  # Unix time

    @property
    def id(self) -> str:
        return f"{self.algo}-{self.digest}"

    @property
    def short(self) -> str:
        return self.digest[:12]

    def to_json(self) -> dict[str, Any]:
        return {"algo": self.algo, "digest": self.digest, "path": str(self.path), "size": self.size,
                "format": self.format, "names": list(self.names), "url": self.url,
                "fetched": _iso(self.fetched) if self.fetched is not None else None}


class Unreachable(RuntimeFailure):
    """The server cannot be reached at all: its name does not resolve, or no route leads to it (an
    offline host). The hint names the ways to an image without the internet."""


class NotFound(RuntimeFailure):
    """The server (or the file system, for file://) has no such file: HTTP 404 or 410, or ENOENT."""


class ChecksumMismatch(RuntimeFailure):
    """A download that is not the bytes its checksum names (deleted, never used)."""


class UnsafeImage(RuntimeFailure):
    """A qcow2 image that would make QEMU open another file: a backing file or an external data file."""


@attrs.frozen
class PullLimits:
    """What a download may take: at most `max_size` bytes (announced or received), and at least
    `speed_limit` bytes/s averaged over the last `speed_time` seconds (0: no minimum)."""

    max_size: int = MAX_DOWNLOAD
    speed_limit: int = SPEED_LIMIT
    speed_time: float = SPEED_TIME

    @classmethod
    def from_env(cls) -> PullLimits:
        """The defaults, or what VMLAUNCH_IMAGE_MAX_SIZE, VMLAUNCH_PULL_SPEED_LIMIT and
        VMLAUNCH_PULL_SPEED_TIME say; UsageError for a value that is not a size or a duration."""
        from vmlaunch.core.units import parse_duration, parse_size

        def cap(text: str) -> int:
            if (size := parse_size(text)) == 0:
                raise ValueError("no image would fit")
            return size

        return cls(max_size=_setting("VMLAUNCH_IMAGE_MAX_SIZE", cap, MAX_DOWNLOAD, "128G"),
                   speed_limit=_setting("VMLAUNCH_PULL_SPEED_LIMIT", parse_size, SPEED_LIMIT, "100K"),
                   speed_time=_setting("VMLAUNCH_PULL_SPEED_TIME", parse_duration, SPEED_TIME, "5m"))

    @property
    def timeout(self) -> float:
        """Seconds without a byte (connecting, or between reads) before a download fails: a server
        that sends nothing is caught within the speed window too."""
        return min(TIMEOUT, self.speed_time) if self.speed_limit else TIMEOUT


def _setting(name: str, parse: Callable[[str], _T], default: _T, example: str) -> _T:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return parse(text)
    except ValueError as exc:
        raise UsageError(f"{name}={text!r}: {exc}", f"e.g. {name}={example}, or unset it") from None


# --- where things are ------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The folder of cached images (made when missing); HostError, naming why, when it fails the
    ownership rule (`dirs.secure_dir`) or cannot be made: images cannot be kept without it."""
    from vmlaunch.layout import dirs

    path = dirs.usable_cache_dir("images")
    if path is not None and path.is_dir():
        return path
    return _secured("images")


def _secured(sub: str) -> Path:
    """The cache's folder `sub`, checked (and made) now; the reason as a HostError when it cannot be."""
    from vmlaunch.layout import dirs

    top = dirs.cache_dir()
    path = top / sub
    try:
        dirs.secure_dir(path, top=top, create=True, setting="VMLAUNCH_CACHE_DIR")
    except dirs.UnsafeDirectory as exc:
        raise HostError(f"cannot keep images: {exc.message}", exc.hint) from None
    except OSError as exc:
        raise HostError(f"cannot keep images in {path}: {exc.strerror or exc}",
                        "set VMLAUNCH_CACHE_DIR to a directory only you can write") from None
    return path


def _partial_dir() -> Path:
    return _secured("images/.partial")


def _checksum(image: Image) -> tuple[str, str]:
    """(algo, hex) of an image that must have one; the hex checked, as it becomes a file name."""
    checksum = image.checksum
    if checksum is None:
        raise UsageError(f"image {image.name} has no checksum", "add sha512 = \"...\" or sha256 = \"...\"")
    algo, digest = checksum
    if re.fullmatch(f"[0-9a-f]{{{_HEX_DIGITS[algo]}}}", digest) is None:
        raise UsageError(f"image {image.name}: {algo} must be {_HEX_DIGITS[algo]} lower-case hex digits")
    return algo, digest


# --- the image a VM boots --------------------------------------------------------------------------


def ensure(image: Image, *, progress: bool | None = None) -> Path:
    """The verified local file of `image`, read-only from then on.

    A URL image: the cached file when there is one, else `pull`. A `file` image: the file itself,
    checked against its checksum when the spec gives one (once per version of the file). Either way a
    qcow2 image that names another file is refused (`UnsafeImage`). `progress`: True a bar on
    standard error, False lines every PROGRESS_EVERY seconds through logging, None the bar when
    standard error is a terminal.
    """
    if image.catalog is not None and image.url is None:
        raise UsageError(f"image {image.name} is a catalog image: it is pinned first (catalog_images.ensure)")
    if image.url is None:
        return _ensure_file(image, progress)
    algo, digest = _checksum(image)
    top = cache_dir()
    final = top / f"{algo}-{digest}.img"
    if not _is_cached(final):
        return pull(image, progress=progress)
    _inspect(final, image.format, f"image {image.name} ({final})")
    _make_read_only(final)
    _note_name(top, algo, digest, image)
    return final


def pull(image: Image, *, progress: bool | None = None) -> Path:
    """Download `image` into the cache, verify it and return its file.

    Under the image's lock: a second pull of the same image waits for the first, then finds it done.
    A partial download is resumed (HTTP Range), or restarted from zero when the server ignores or
    refuses Range. A checksum mismatch deletes the download; so does one past the size cap or one
    that would take the file system's reserve (`PullLimits`, `disk_room`). A broken connection, a
    stall or a server slower than the minimum rate keeps it for the next pull.
    """
    if image.url is None:
        raise UsageError(f"image {image.name} is a local file ({image.file}): there is nothing to pull")
    algo, digest = _checksum(image)
    limits = PullLimits.from_env()
    top = cache_dir()
    final = top / f"{algo}-{digest}.img"
    partial_dir = _partial_dir()
    with _holding(partial_dir / f"{algo}-{digest}.lock", image.name):
        if _is_cached(final):  # pulled by whoever held the lock before us
            log.info("%s: in the cache: %s", image.name, final)
            return ensure(image, progress=progress)
        part = partial_dir / f"{algo}-{digest}.part"
        try:
            got, size = _fetch(image, algo, part, progress, limits)
        except BaseException:
            with contextlib.suppress(OSError):
                if os.lstat(part).st_size == 0:  # nothing to resume: no empty file left behind
                    os.unlink(part)
            raise
        if got != digest:
            _unlink(part)
            raise ChecksumMismatch(
                f"image {image.name}: the download from {image.url} does not match its checksum: "
                f"expected {algo} {digest}, got {algo} {got}; the download was deleted",
                "check the URL and the checksum in the spec (distributions publish them beside the "
                "image, e.g. SHA512SUMS); if both are right the file was damaged on the way: pull again")
        try:
            info = _inspect(part, image.format, f"image {image.name} ({image.url})")
        except VmlaunchError:
            _unlink(part)  # verified, but never usable: no reason to keep 2 GB of it
            raise
        _write_meta(top, algo, digest, {
            "url": image.url, "names": [image.name], "algo": algo, "digest": digest, "size": size,
            "format": info.format.value, "virtual_size": info.virtual_size, "fetched": _iso(time.time())})
        os.replace(part, final)
        fsync_dir(top)
        _make_read_only(final)
        log.info("%s: %s verified, in the cache: %s", image.name, algo, final)
        return final


# --- image files -----------------------------------------------------------------------------------


def image_info(path: Path, format: DiskFormat | None = None) -> ImageInfo:
    """The format (the one given, else found from the first bytes: qcow2 magic, else raw) and virtual
    size of the image at `path`. A qcow2 image with a backing file or an external data file, or of a
    version QEMU's readers other than 2 and 3, is refused (`UnsafeImage`, `RuntimeFailure`)."""
    return _inspect(path, format, str(path))


def _inspect(path: Path, declared: DiskFormat | None, what: str) -> ImageInfo:
    try:
        with open(path, "rb") as file:
            header = file.read(104)
            size = os.fstat(file.fileno()).st_size
            fmt = declared or (DiskFormat.QCOW2 if header[:4] == QCOW2_MAGIC else DiskFormat.RAW)
            if fmt is DiskFormat.RAW:
                return ImageInfo(DiskFormat.RAW, size)
            return ImageInfo(DiskFormat.QCOW2, _qcow2_size(file, header, what))
    except OSError as exc:
        raise RuntimeFailure(f"{what}: cannot read it: {exc.strerror or exc}") from None


def _qcow2_size(file: IO[bytes], header: bytes, what: str) -> int:
    """The virtual size from a qcow2 header, once it is known to name no other file."""
    if header[:4] != QCOW2_MAGIC:
        raise RuntimeFailure(f"{what}: not a qcow2 image (it does not start with QFI\\xfb)",
                             "give the image's real format: format = \"raw\", or leave format out")
    version = int.from_bytes(header[4:8], "big")
    if version not in (2, 3) or len(header) < (104 if version == 3 else 72):
        raise RuntimeFailure(f"{what}: a qcow2 image of version {version} with a header of "
                             f"{len(header)} bytes: vmlaunch reads versions 2 and 3 only")
    backing_offset = int.from_bytes(header[8:16], "big")
    if backing_offset:
        length = min(int.from_bytes(header[16:20], "big"), 1023)
        file.seek(backing_offset)
        name = file.read(length).decode("utf-8", "replace")
        raise UnsafeImage(
            f"{what}: the qcow2 image names a backing file ({name!r}); QEMU would open it for the guest, "
            "so an image could make the guest read any file on this host. vmlaunch boots only "
            "self-contained images",
            "flatten it into one file (qemu-img convert -O qcow2 IMAGE flat.qcow2) and use that, "
            "with its own checksum")
    if version == 3 and int.from_bytes(header[72:80], "big") & _QCOW2_EXTERNAL_DATA_FILE:
        raise UnsafeImage(
            f"{what}: the qcow2 image keeps its data in an external data file; QEMU would open that "
            "file for the guest, so an image could make the guest read any file on this host. "
            "vmlaunch boots only self-contained images",
            "convert it into one file (qemu-img convert -O qcow2 IMAGE flat.qcow2) and use that, "
            "with its own checksum")
    return int.from_bytes(header[24:32], "big")


def _is_cached(final: Path) -> bool:
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode)


def _make_read_only(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_mode & 0o222:
            os.fchmod(fd, 0o444)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# --- local `file` images ---------------------------------------------------------------------------


def _ensure_file(image: Image, progress: bool | None) -> Path:
    path = image.file
    if path is None:
        raise UsageError(f"image {image.name} has neither url nor file")
    what = f"image {image.name} ({path})"
    if image.checksum is not None:
        algo, digest = _checksum(image)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise RuntimeFailure(f"{what}: cannot open it: {exc.strerror or exc}") from None
        with os.fdopen(fd, "rb") as file:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise RuntimeFailure(f"{what}: not a regular file")
            if not _verified_before(path, before, algo, digest):
                log.info("%s: checking its %s (%s)", image.name, algo, human_size(before.st_size))
                got = _hash_stream(file, algo, before.st_size, image.name, progress)
                if got != digest:
                    raise RuntimeFailure(f"{what}: does not match its checksum: expected {algo} "
                                         f"{digest}, got {algo} {got}",
                                         "check the file, or the checksum in the spec")
                if _stamp(os.fstat(fd)) == _stamp(before):  # not changed while it was read
                    _remember_verified(path, before, algo, digest)
    inspect_file_image(image)
    return path


def inspect_file_image(image: Image) -> ImageInfo:
    """A local `file` image's format and size, as `up` reads them; UnsafeImage (or RuntimeFailure)
    when it names another file or is not what its format says. `validate` asks this too."""
    if image.file is None:
        raise UsageError(f"image {image.name} has no file")
    return _inspect(image.file, image.format, f"image {image.name} ({image.file})")


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _verified_record(path: Path) -> Path | None:
    from vmlaunch.layout.dirs import usable_cache_dir

    top = usable_cache_dir("images")  # without a cache, a file image is hashed every time: still right
    if top is None:
        return None
    key = hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:32]
    return top / ".verified" / f"{key}.json"


def _verified_before(path: Path, st: os.stat_result, algo: str, digest: str) -> bool:
    record = _verified_record(path)
    if record is None:
        return False
    data = _read_json(record)
    return data == {"path": os.path.abspath(path), "stamp": _stamp(st), "algo": algo, "digest": digest}


def _remember_verified(path: Path, st: os.stat_result, algo: str, digest: str) -> None:
    record = _verified_record(path)
    if record is None:
        return
    try:
        _secured("images/.verified")
        write_atomic(record, json.dumps({"path": os.path.abspath(path), "stamp": _stamp(st), "algo": algo,
                                         "digest": digest}), durable=False)
    except (OSError, HostError) as exc:  # only a cache: the next up hashes it again
        log.debug("not remembering the checksum of %s: %s", path, exc)


def _hash_stream(file: IO[bytes], algo: str, total: int | None, name: str, progress: bool | None) -> str:
    hasher = hashlib.new(algo)
    meter = _Meter(name, "checking", total, 0, progress)
    done = 0
    while chunk := file.read(CHUNK):
        hasher.update(chunk)
        done += len(chunk)
        meter.update(done)
    meter.finish(done)
    return hasher.hexdigest()


# --- downloading -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _holding(lock: Path, name: str) -> Iterator[None]:
    """Hold the image's lock file: wait (with a line every PROGRESS_EVERY seconds) while another
    vmlaunch holds it. The file goes away with its last holder; a waiter that then gets the lock on
    the removed file notices (`same_file`) and locks anew."""
    from vmlaunch.core.wait import wait_until

    fd = _try_lock_file(lock)
    if fd is None:
        log.info("%s: waiting for another vmlaunch pulling it (%s)", name, lock)
        fd = wait_until(lambda: _try_lock_file(lock), math.inf, interval=0.05,
                        progress=lambda waited: log.info("%s: still waiting for the other pull, %.0f s",
                                                         name, waited),
                        progress_every=PROGRESS_EVERY)
    try:
        yield
    finally:
        _unlink(lock)
        os.close(fd)


@contextlib.contextmanager
def holding(key: str, name: str) -> Iterator[None]:
    """Hold one of the cache's locks, `key` (a file name's stem, in .partial/), as `_holding` does:
    what others than a pull serialise on (a spec's lock file, guests/catalog_images.py)."""
    with _holding(_partial_dir() / f"{key}.lock", name):
        yield


def _try_lock_file(lock: Path) -> int | None:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return lock_if_current(fd, lock)


def _fetch(image: Image, algo: str, part: Path, progress: bool | None,
           limits: PullLimits) -> tuple[str, int]:
    """Download (or finish downloading) `image` into `part`, hashing as it goes: (hex, size)."""
    assert image.url is not None
    url = image.url
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "r+b") as out:
        have = os.fstat(fd).st_size
        if have > limits.max_size:
            out.truncate(0)
            have = 0
        hasher = hashlib.new(algo)
        if have:  # what is there already goes into the hash first
            log.info("%s: resuming the download at %s (checking what is there)", image.name, human_size(have))
            have = _hash_into(out, hasher, have)
        source = _open(url, have, limits.timeout)
        try:
            if source.start != have:
                if have:
                    log.info("%s: the server does not resume downloads%s: starting again from 0",
                             image.name, f" ({source.why})" if source.why else "")
                out.seek(0)
                out.truncate(0)
                hasher, have = hashlib.new(algo), 0
            _check_room(image.name, url, part, source.total, have, limits)
            out.seek(have)
            if source.total is not None and have >= source.total:
                log.info("%s: the download is complete", image.name)
            else:
                log.info("%s: downloading %s (%s)", image.name, url,
                         human_size(source.total) if source.total is not None else "size unknown")
            have = _copy(_Target(image.name, part, out, hasher), source, have, progress, limits)
        finally:
            source.close()
        out.flush()
        os.fsync(fd)
    if source.total is not None and have != source.total:
        raise RuntimeFailure(f"downloading {url} failed: the connection closed after {have} of "
                             f"{source.total} bytes", "pull again: the download resumes from there")
    fsync_dir(part.parent)
    return hasher.hexdigest(), have


def _hash_into(out: IO[bytes], hasher: Any, have: int) -> int:
    out.seek(0)
    done = 0
    while done < have and (chunk := out.read(min(CHUNK, have - done))):
        hasher.update(chunk)
        done += len(chunk)
    return done


@attrs.frozen
class _Target:
    """Where a download goes: the image's partial file, open, and the hash of what it holds."""

    name: str  # the image's
    part: Path
    out: IO[bytes]
    hasher: Any

    def discard(self) -> None:
        """Delete the partial file: what it holds is of no use to a later pull."""
        self.out.truncate(0)
        _unlink(self.part)


_SLOW_HINT = ("pull again later, or from another mirror: the download resumes from there; to wait for "
              "a slow server, lower VMLAUNCH_PULL_SPEED_LIMIT (0: no minimum) or raise "
              "VMLAUNCH_PULL_SPEED_TIME")


def _copy(target: _Target, source: _Source, have: int, progress: bool | None, limits: PullLimits) -> int:
    """Copy the rest of `source` into the target from byte `have`: the bytes it holds then.

    Past `limits.max_size` bytes received, or when the file system would keep less than its reserve
    free (`disk_room`), the download stops and the partial file is deleted: more of it can only be
    more of the same. Slower than `limits.speed_limit` over `limits.speed_time`, or no byte for
    `limits.timeout`, it stops and the partial file is kept for the next pull to resume.
    """
    meter = _Meter(target.name, "downloading", source.total, have, progress, floor=limits.speed_limit)
    speed = _Rate(limits.speed_time, meter.began, have)
    room = _Room(target.part.parent)
    try:
        while True:
            try:
                chunk = source.read(CHUNK)
            except (OSError, _http_errors()) as exc:
                raise _broken(target.name, source, have, exc, limits) from None
            if not chunk:
                return have
            if have + len(chunk) > limits.max_size:
                target.discard()
                raise _too_large(target.name, source.url, have + len(chunk), limits)
            if not room.take(len(chunk)):
                target.discard()
                raise _no_room(target.name, source.url, have, room)
            try:
                target.out.write(chunk)
            except OSError as exc:
                raise _unwritable(target, exc) from None
            target.hasher.update(chunk)
            have += len(chunk)
            now = time.monotonic()
            meter.update(have, now)
            speed.add(now, have)
            rate = speed.over_span(now, have)
            if limits.speed_limit and rate is not None and rate < limits.speed_limit:
                raise RuntimeFailure(
                    f"image {target.name}: downloading {source.url} is too slow: {_rate_text(rate)} "
                    f"over the last {limits.speed_time:g} s, below the minimum of "
                    f"{_rate_text(limits.speed_limit)} (VMLAUNCH_PULL_SPEED_LIMIT over "
                    f"VMLAUNCH_PULL_SPEED_TIME); stopped after "
                    f"{_amount(have, source.total)}; the partial download is kept", _SLOW_HINT)
    finally:
        meter.finish(have)


def _broken(name: str, source: _Source, have: int, exc: BaseException, limits: PullLimits) -> RuntimeFailure:
    """The failure of a read: a stall (no byte within the timeout) or a broken connection."""
    if _is_timeout(exc):
        return RuntimeFailure(f"image {name}: downloading {source.url} stalled: no data for "
                              f"{limits.timeout:g} s after {_amount(have, source.total)}; the partial "
                              "download is kept", _SLOW_HINT)
    return RuntimeFailure(f"downloading {source.url} failed after {have} bytes: "
                          f"{_reason(exc, limits.timeout)}", "pull again: the download resumes from there")


def _unwritable(target: _Target, exc: OSError) -> RuntimeFailure:
    """A write that failed: the file system is full after all (another writer beat `_Room`), or broken."""
    import errno

    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if full:
        with contextlib.suppress(OSError):
            target.discard()  # the disk is full: a partial file would keep it so
    return RuntimeFailure(f"image {target.name}: cannot write {target.part}: {exc.strerror or exc}"
                          + ("; the partial download was deleted" if full else ""),
                          "make room there, or set VMLAUNCH_CACHE_DIR to a larger file system"
                          if full else "check the cache's file system")


def _too_large(name: str, url: str, received: int, limits: PullLimits) -> RuntimeFailure:
    return RuntimeFailure(
        f"image {name}: {url} sent more than {human_size(limits.max_size)}, the most an image may be "
        f"(VMLAUNCH_IMAGE_MAX_SIZE): stopped at {human_size(received)} ({received} bytes) received; the "
        "partial download was deleted",
        "check the URL: no VM image is that large, and a server that sends no size may never stop; for "
        "a larger image set VMLAUNCH_IMAGE_MAX_SIZE (e.g. 128G)")


def _no_room(name: str, url: str, have: int, room: _Room) -> RuntimeFailure:
    return RuntimeFailure(
        f"image {name}: downloading {url} stopped after {human_size(have)}: {room.folder} has "
        f"{human_size(room.free)} free, and a download leaves {human_size(room.reserve)} free "
        f"({_reserve_rule()}); the partial download was deleted",
        "make room there, or set VMLAUNCH_CACHE_DIR to a larger file system; a server that sends no "
        "size may never stop: check the URL")


def _amount(have: int, total: int | None) -> str:
    return f"{human_size(have)} of {human_size(total)}" if total is not None else human_size(have)


def _reserve_rule() -> str:
    return (f"{RESERVE_SHARE * 100:g} % of the file system, at least {human_size(RESERVE_LEAST)}, "
            f"at most {human_size(RESERVE_MOST)}")


def disk_room(folder: Path) -> tuple[int, int] | None:
    """(bytes free, bytes a download leaves free) on the file system of `folder`; None when it
    cannot be told (no statvfs, or a file system that gives no size)."""
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return None
    if vfs.f_blocks == 0:
        return None
    share = int(vfs.f_blocks * vfs.f_frsize * RESERVE_SHARE)
    return vfs.f_bavail * vfs.f_frsize, min(max(share, RESERVE_LEAST), RESERVE_MOST)


class _Room:
    """Whether a download may write more without taking the file system's reserve: the free space
    is looked at again every ROOM_EVERY bytes (others write there too), and whenever the last look
    leaves too little."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.free = self.reserve = 0
        self.left: int | None = None  # bytes that may be written; None: unknown, so not limited
        self.since = 0  # bytes written since the last look
        self.look()

    def look(self) -> None:
        room = disk_room(self.folder)
        self.since = 0
        if room is None:
            self.left = None
            return
        self.free, self.reserve = room
        self.left = self.free - self.reserve

    def take(self, size: int) -> bool:
        """Count `size` more bytes about to be written: False when they do not fit."""
        if self.since + size > ROOM_EVERY or (self.left is not None and size > self.left):
            self.look()
        self.since += size
        if self.left is None:
            return True
        if size > self.left:
            return False
        self.left -= size
        return True


def _check_room(name: str, url: str, part: Path, total: int | None, have: int, limits: PullLimits) -> None:
    """Refuse a download whose announced size is over the cap, or does not fit beside the reserve."""
    if total is None:
        return
    if total > limits.max_size:
        _unlink(part)
        raise RuntimeFailure(f"image {name}: {url} is {human_size(total)}: larger than "
                             f"{human_size(limits.max_size)}; refused (no VM image is that large)",
                             "check the URL; for a larger image set VMLAUNCH_IMAGE_MAX_SIZE (e.g. 128G)")
    room = disk_room(part.parent)
    if room is not None and total - have > room[0] - room[1]:
        free, reserve = room
        raise RuntimeFailure(f"image {name}: {url} needs {human_size(total - have)} more in {part.parent}, "
                             f"which has {human_size(free)} free, and a download leaves "
                             f"{human_size(reserve)} free ({_reserve_rule()})",
                             "make room, or set VMLAUNCH_CACHE_DIR to a larger file system")


class _Source:
    """An open download: its stream from byte `start`, and the whole file's size when known. `why`
    says why it starts at 0 when a resume was asked for (what the server answered)."""

    def __init__(self, url: str, stream: IO[bytes] | None, start: int, total: int | None,
                 read: Callable[[int], bytes] | None = None) -> None:
        self.url = url
        self.stream = stream
        self.start = start
        self.total = total
        self.why: str | None = None
        # an HTTP response's read1: what has come, at once (its read(n) waits for all n bytes, so a
        # server that drips would show no progress, and could not be found slow)
        self._read = read if read is not None else stream.read if stream is not None else None

    def read(self, size: int) -> bytes:
        return self._read(size) if self._read is not None else b""

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def _open(url: str, offset: int, timeout: float) -> _Source:
    if url.lower().startswith("file://"):
        return _open_file(url, offset)
    return _open_http(url, offset, timeout)


def _open_file(url: str, offset: int) -> _Source:
    from urllib.parse import urlsplit
    from urllib.request import url2pathname

    path = url2pathname(urlsplit(url).path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO cannot hang us
    except FileNotFoundError as exc:
        raise NotFound(f"cannot read {url}: {exc.strerror or exc}") from None
    except OSError as exc:
        raise RuntimeFailure(f"cannot read {url}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RuntimeFailure(f"cannot read {url}: not a regular file")
    stream = os.fdopen(fd, "rb")
    start = offset if offset <= st.st_size else 0
    stream.seek(start)
    return _Source(url, stream, start, st.st_size)


def _open_http(url: str, offset: int, timeout: float) -> _Source:
    import urllib.error
    import urllib.request

    from vmlaunch.core.version import __version__

    headers = {"User-Agent": f"vmlaunch/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    network_hint = ("check the URL and this host's network (or proxy); a partial download resumes at the "
                    "next pull")
    try:
        response = _opener().open(urllib.request.Request(url, headers=headers), timeout=timeout)
    except _RedirectLoop as exc:
        raise RuntimeFailure(f"downloading {url} failed: the server redirects in a loop ({exc.count} "
                             f"redirects from {url}, the last to {exc.last})",
                             "check the URL, or the mirror's configuration: pulling again will not "
                             "help") from None
    except urllib.error.HTTPError as exc:
        exc.close()
        said = f"HTTP {exc.code} {_one_line(exc.reason)}".rstrip()
        if exc.code == 416 and offset:  # the partial is the whole file (or more: start again)
            match = re.fullmatch(r"bytes \*/(\d+)", (exc.headers.get("Content-Range") or "").strip())
            if match is not None and int(match[1]) == offset:
                return _Source(url, None, offset, offset)
            return _restarted(url, timeout, f"it answered {said} to a request from byte {offset}")
        if offset and _refuses_range(exc.code):  # it may still send the whole file
            return _restarted(url, timeout, f"it answered {said} to a request from byte {offset}")
        failure = NotFound if exc.code in (404, 410) else RuntimeFailure
        raise failure(f"downloading {url} failed: {said}", _http_hint(exc.code)) from None
    except urllib.error.URLError as exc:
        if _unreachable(exc.reason):
            raise Unreachable(f"downloading {url} failed: {_reason(exc.reason, timeout)}",
                              _offline_hint(url)) from None
        raise RuntimeFailure(f"downloading {url} failed: {_reason(exc.reason, timeout)}",
                             network_hint) from None
    except (OSError, ValueError, _http_errors()) as exc:
        raise RuntimeFailure(f"downloading {url} failed: {_reason(exc, timeout)}", network_hint) from None
    length = _int(response.headers.get("Content-Length"))
    if response.status == 206 and offset:
        content_range = (response.headers.get("Content-Range") or "").strip()
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range)
        if match is None or int(match[1]) != offset:  # not the part asked for: the whole file then
            response.close()
            return _restarted(url, timeout, f"it sent another part ({content_range or 'no Content-Range'})")
        total = int(match[3]) if match[3] != "*" else offset + length if length is not None else None
        return _Source(url, response, offset, total, response.read1)
    if response.status == 200:  # from the start, also when the server ignored the Range asked for
        source = _Source(url, response, 0, length, response.read1)
        source.why = "it sent the whole file" if offset else None
        return source
    response.close()
    raise RuntimeFailure(f"downloading {url} failed: unexpected HTTP {response.status}", network_hint)


def fetch_small(url: str, limit: int) -> bytes:
    """The whole of a small file (a checksum file, a signature) at `url`: http(s):// or file://, with
    the redirect rules and time-outs of image downloads. NotFound when there is none; RuntimeFailure
    when it fails or holds more than `limit` bytes."""
    hint = "check the URL and this host's network (or proxy), then pull again"
    start = time.monotonic()
    try:
        source = _open(url, 0, PullLimits.from_env().timeout)
    except (NotFound, Unreachable):
        raise
    except RuntimeFailure as exc:
        raise RuntimeFailure(exc.message, hint) from None
    try:
        if source.total is not None and source.total > limit:
            raise RuntimeFailure(f"{url}: {human_size(source.total)}, more than the {human_size(limit)} a "
                                 "checksum file or signature may be", "check the URL or the mirror")
        data = bytearray()
        while len(data) <= limit and (chunk := source.read(min(CHUNK, limit + 1 - len(data)))):
            data += chunk
            if time.monotonic() - start > SMALL_DEADLINE:
                raise RuntimeFailure(f"downloading {url} failed: {human_size(len(data))} in "
                                     f"{SMALL_DEADLINE:.0f} s, and not done (a file of at most "
                                     f"{human_size(limit)})", hint)
    except (OSError, ValueError, _http_errors()) as exc:
        raise RuntimeFailure(f"downloading {url} failed: {_reason(exc, TIMEOUT)}", hint) from None
    finally:
        source.close()
    if len(data) > limit:
        raise RuntimeFailure(f"{url}: more than the {human_size(limit)} a checksum file or signature may be",
                             "check the URL or the mirror")
    return bytes(data)


def _restarted(url: str, timeout: float, why: str) -> _Source:
    """The whole file, asked for again without a Range: the server would not resume."""
    source = _open_http(url, 0, timeout)
    source.why = why
    return source


def _refuses_range(code: int) -> bool:
    """Whether an HTTP error to a request with a Range may be the server refusing ranges (so a request
    for the whole file may succeed): 4xx but for a missing file and "try later", or 501."""
    return code == 501 or (400 <= code < 500 and code not in (404, 408, 410, 429))


def _unreachable(reason: object) -> bool:
    """Whether a URLError's reason says the server cannot be reached at all: a name that does not
    resolve ("Name or service not known", "Temporary failure in name resolution") or no route."""
    import errno
    import socket

    return isinstance(reason, socket.gaierror) or (
        isinstance(reason, OSError) and reason.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH))


def _offline_hint(url: str) -> str:
    """The manual's two ways to an image without the internet ("Without the internet" on the first
    real guest's page): a mirror of the distributions' trees, and a Debian image built from packages."""
    from urllib.parse import urlsplit

    from vmlaunch.spec.catalog import MIRROR_SETTING, mirror

    host = urlsplit(url).hostname or url
    built = ("or build a Debian image from Debian's packages with tools/build_debian.py (here, or on a "
             "host that is online, then copy it over)")
    through = mirror()
    if through is not None and urlsplit(through).hostname == urlsplit(url).hostname:
        return f"{MIRROR_SETTING}={through} names {host}, which this host cannot reach: check it, {built}"
    return (f"this host cannot reach {host} (offline?); without the internet, pull catalog images from a "
            f"mirror of the distributions' trees ({MIRROR_SETTING}=http://HOST:PORT), {built}; see "
            "\"Without the internet\" in the manual's first real guest")


def _http_hint(code: int) -> str:
    if 400 <= code < 500 and code not in (408, 429):
        return "check the URL: the server refuses it, and pulling again will not help while it does"
    return ("the server failed or is busy: pull again later, or from another mirror (a partial download "
            "resumes)")


class _RedirectLoop(Exception):
    """The server redirects more often than urllib follows (a loop, or a chain longer than 10)."""

    def __init__(self, count: int, last: str) -> None:
        super().__init__(count, last)
        self.count = count
        self.last = last


def _opener() -> urllib.request.OpenerDirector:
    import urllib.error
    import urllib.request
    from urllib.parse import urljoin, urlsplit

    class Redirects(urllib.request.HTTPRedirectHandler):
        """Redirects to http(s) only: urllib alone follows ftp:// too, and a checksum is no reason
        to fetch from wherever a server points. A loop ends as `_RedirectLoop`, not as urllib's
        text of three lines."""

        def http_error_302(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                           headers: http.client.HTTPMessage) -> Any:
            target = headers.get("Location") or headers.get("URI")
            if target is not None:
                scheme = urlsplit(urljoin(req.full_url, target)).scheme.lower()
                if scheme not in ("http", "https"):
                    fp.close()
                    raise RuntimeFailure(f"downloading {req.full_url}: the server redirects to "
                                         f"{target!r}; vmlaunch follows redirects to http(s) only")
            try:
                return super().http_error_302(req, fp, code, msg, headers)
            except urllib.error.HTTPError as exc:
                if not str(exc.reason).startswith(self.inf_msg):
                    raise
                exc.close()
                followed = sum(getattr(req, "redirect_dict", {}).values())
                raise _RedirectLoop(followed + 1, urljoin(req.full_url, target or "")) from None

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    return urllib.request.build_opener(Redirects)


def _http_errors() -> type[Exception]:
    import http.client

    return http.client.HTTPException


def _is_timeout(exc: object) -> bool:
    return isinstance(exc, TimeoutError) or type(exc).__name__ == "timeout"


def _reason(exc: object, timeout: float) -> str:
    if _is_timeout(exc):
        return f"no data for {timeout:g} s (timed out)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if type(exc).__name__ == "IncompleteRead":
        return "the connection closed early"
    return _one_line(exc) or type(exc).__name__


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


# --- metadata ----------------------------------------------------------------------------------------


def _meta_path(top: Path, algo: str, digest: str) -> Path:
    return top / f"{algo}-{digest}.json"


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when it is missing, damaged or not an object."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            data = json.loads(file.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_meta(top: Path, algo: str, digest: str, meta: dict[str, Any]) -> None:
    write_atomic(_meta_path(top, algo, digest), json.dumps(meta, indent=2) + "\n")


def _note_name(top: Path, algo: str, digest: str, image: Image) -> None:
    """Add the image's name to the cached file's metadata (rebuilt when lost)."""
    path = _meta_path(top, algo, digest)
    meta = _read_json(path)
    names = meta.get("names")
    if isinstance(names, list) and image.name in names:
        return
    if not meta:
        final = top / f"{algo}-{digest}.img"
        info = _inspect(final, image.format, str(final))
        meta = {"url": image.url, "names": [], "algo": algo, "digest": digest, "size": final.stat().st_size,
                "format": info.format.value, "virtual_size": info.virtual_size,
                "fetched": _iso(final.stat().st_mtime)}
    meta["names"] = [*(names if isinstance(names, list) else []), image.name]
    try:
        write_atomic(path, json.dumps(meta, indent=2) + "\n", durable=False)
    except OSError as exc:  # a name for `image list`: not worth failing an up for
        log.debug("cannot update %s: %s", path, exc)


def _iso(when: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="seconds")


def _from_iso(text: object) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp() if isinstance(text, str) else None
    except ValueError:
        return None


# --- listing and removing ------------------------------------------------------------------------------


def list_cached() -> list[Cached]:
    """Every image in the cache, by name (then by when it was fetched)."""
    top = cache_dir()
    found = []
    with os.scandir(top) as entries:
        for entry in entries:
            match = _CACHED_NAME.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            algo, digest = match[1], match[2]
            meta = _read_json(_meta_path(top, algo, digest))
            names = meta.get("names")
            fmt, url = meta.get("format"), meta.get("url")
            found.append(Cached(
                algo=algo, digest=digest, path=Path(entry.path),
                size=entry.stat(follow_symlinks=False).st_size,
                format=fmt if isinstance(fmt, str) else None,
                names=tuple(str(name) for name in names) if isinstance(names, list) else (),
                url=url if isinstance(url, str) else None, fetched=_from_iso(meta.get("fetched"))))
    return sorted(found, key=lambda c: (c.names, c.fetched or 0.0, c.digest))


def partials() -> list[Path]:
    """The partial downloads in the cache (in progress or interrupted)."""
    folder = cache_dir() / ".partial"
    if not folder.is_dir():
        return []
    return sorted(folder / name for name in os.listdir(folder) if _PARTIAL_NAME.fullmatch(name))


def resolve(ids: Sequence[str], cached: Sequence[Cached] | None = None) -> list[Cached]:
    """The cached images `ids` name: each a checksum's hex (a unique prefix of at least 8 digits will
    do, `sha512-` before it too), or a name or URL from the metadata. UsageError for an id that names
    no image, or several, listing the candidates."""
    cached = list_cached() if cached is None else cached
    chosen: list[Cached] = []
    problems = []
    for text in ids:
        hits = _match(text, cached)
        if len(hits) == 1:
            if hits[0] not in chosen:
                chosen.append(hits[0])
        elif hits:
            problems.append(f"{text!r} is ambiguous: it matches {', '.join(_shown(c) for c in hits)}")
        else:
            short = re.fullmatch(f"[0-9a-fA-F]{{1,{_MIN_PREFIX - 1}}}", text) is not None
            problems.append(f"no cached image {text!r}" + (f" (give at least {_MIN_PREFIX} hex digits "
                                                           "of a checksum)" if short else ""))
    if problems:
        known = "; ".join(_shown(c) for c in cached) or "none (the cache is empty)"
        raise UsageError("; ".join(problems), f"cached images: {known}")
    return chosen


def _match(text: str, cached: Sequence[Cached]) -> list[Cached]:
    hexed = re.fullmatch(f"(?:(sha256|sha512)-)?([0-9a-f]{{{_MIN_PREFIX},128}})", text.lower())
    if hexed is not None:
        hits = [c for c in cached if c.digest.startswith(hexed[2]) and hexed[1] in (None, c.algo)]
        if hits:
            return hits
    return [c for c in cached if text in c.names or text == c.url]


def _shown(item: Cached) -> str:
    return f"{item.short} ({', '.join(item.names) or item.url or 'no name'})"


def remove(ids: Sequence[str], *, every: bool = False) -> list[Path]:
    """Remove the cached images `ids` name (see `resolve`), or all of them with `every`: the image
    files removed. An image being pulled right now is left alone (and said so)."""
    cached = list_cached()
    targets = cached if every else resolve(ids, cached)
    top = cache_dir()
    partial_dir = _partial_dir()
    removed = []
    for item in targets:
        lock = partial_dir / f"{item.id}.lock"
        fd = _try_lock_file(lock)
        if fd is None:
            log.warning("%s: kept: another vmlaunch is pulling it", _shown(item))
            continue
        try:
            _unlink(_meta_path(top, item.algo, item.digest))
            if item.path.exists():
                os.unlink(item.path)
                removed.append(item.path)
        finally:
            _unlink(lock)
            os.close(fd)
    fsync_dir(top)
    return removed


def remove_partials() -> tuple[list[Path], list[Path]]:
    """Remove the partial downloads no pull is working on: (removed, kept because in use)."""
    removed, busy = [], []
    folder = _partial_dir()
    for part in partials():
        lock = folder / f"{part.stem}.lock"
        fd = _try_lock_file(lock)
        if fd is None:
            busy.append(part)
            continue
        try:
            _unlink(part)
            removed.append(part)
        finally:
            _unlink(lock)
            os.close(fd)
    return removed, busy


# --- progress ------------------------------------------------------------------------------------------


class _Rate:
    """Bytes per second over the last `span` seconds: a sliding window of (time, bytes) samples, the
    oldest kept being the newest one at least `span` old."""

    def __init__(self, span: float, now: float, done: int) -> None:
        self.span = span
        self.samples: deque[tuple[float, int]] = deque([(now, done)])

    def add(self, now: float, done: int) -> None:
        if now - self.samples[-1][0] >= self.span / 20:
            self.samples.append((now, done))
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.span:
            self.samples.popleft()

    def over_span(self, now: float, done: int) -> float | None:
        """The rate over the last `span` seconds; None until that long has passed."""
        then, before = self.samples[0]
        return (done - before) / (now - then) if now - then >= self.span else None

    def recent(self, now: float, done: int) -> float:
        """The rate over the last `span` seconds, or since the start when that is shorter."""
        then, before = self.samples[0]
        return (done - before) / max(now - then, 1e-6)


class _Meter:
    """How far a download (or a checksum) is: a bar on a terminal, else a log line every
    PROGRESS_EVERY seconds. The rate shown is the one of the last RATE_SHOWN seconds, so a server
    that slows down shows it; below `floor` bytes/s (the minimum a download must keep), it says so."""

    def __init__(self, name: str, doing: str, total: int | None, start: int, progress: bool | None,
                 *, floor: int = 0) -> None:
        self.name, self.doing, self.total, self.start, self.floor = name, doing, total, start, floor
        self.began = time.monotonic()
        self.rate = _Rate(RATE_SHOWN, self.began, start)
        if progress is None:
            progress = _is_terminal() and log.isEnabledFor(logging.INFO)
        self.bar = progress
        self.next = self.began + (BAR_EVERY if self.bar else PROGRESS_EVERY)
        self.drawn = False

    def update(self, done: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.rate.add(now, done)
        if now < self.next:
            return
        rate = self.rate.recent(now, done)
        slow = rate < self.floor and now - self.began >= RATE_SHOWN
        if self.bar:
            sys.stderr.write(f"\r{self.line(done, rate, bar=True, slow=slow)}\x1b[K")
            sys.stderr.flush()
            self.drawn = True
            self.next = now + BAR_EVERY
        else:
            log.info("%s", self.line(done, rate, bar=False, slow=slow))
            self.next = now + PROGRESS_EVERY

    def finish(self, done: int) -> None:
        if self.drawn:  # the last line shows the average
            rate = (done - self.start) / max(time.monotonic() - self.began, 1e-6)
            sys.stderr.write(f"\r{self.line(done, rate, bar=True)}\x1b[K\n")
            sys.stderr.flush()

    def line(self, done: int, rate: float, *, bar: bool, slow: bool = False) -> str:
        shown = _rate_text(rate) + (f" (below the minimum of {_rate_text(self.floor)})" if slow else "")
        if self.total:
            share = min(done / self.total, 1.0)
            gauge = f"[{'#' * int(share * 30):.<30}] " if bar else ""
            return (f"{self.name}: {self.doing} {gauge}{share * 100:.0f}%, {human_size(done)} of "
                    f"{human_size(self.total)}, {shown}")
        return f"{self.name}: {self.doing} {human_size(done)}, {shown}"


def _rate_text(rate: float) -> str:
    return f"{rate:.1f} B/s" if rate < 10 else f"{human_size(int(rate))}/s"


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
