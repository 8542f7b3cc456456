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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from vmlaunch.errors import HostError, RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.fsutil import fsync_dir, lock_if_current, write_atomic
from vmlaunch.model import DiskFormat, Image

if TYPE_CHECKING:
    import http.client
    import urllib.request

log = logging.getLogger(__name__)

MAX_DOWNLOAD = 64 << 30  # more is a wrong URL (or a hostile server), not a VM image
PROGRESS_EVERY = 5.0  # seconds between progress lines when standard error is not a terminal
BAR_EVERY = 0.1  # seconds between redraws of the progress bar
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


class UnsafeImage(RuntimeFailure):
    """A qcow2 image that would make QEMU open another file: a backing file or an external data file."""


# --- where things are ------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The folder of cached images (made when missing); HostError, naming why, when it fails the
    ownership rule (`dirs.secure_dir`) or cannot be made: images cannot be kept without it."""
    from vmlaunch import dirs

    path = dirs.usable_cache_dir("images")
    if path is not None and path.is_dir():
        return path
    return _secured("images")


def _secured(sub: str) -> Path:
    """The cache's folder `sub`, checked (and made) now; the reason as a HostError when it cannot be."""
    from vmlaunch import dirs

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
    A partial download is resumed (HTTP Range), or restarted from zero when the server ignores Range.
    A checksum mismatch deletes the download; a broken connection keeps it for the next pull.
    """
    if image.url is None:
        raise UsageError(f"image {image.name} is a local file ({image.file}): there is nothing to pull")
    algo, digest = _checksum(image)
    top = cache_dir()
    final = top / f"{algo}-{digest}.img"
    partial_dir = _partial_dir()
    with _holding(partial_dir / f"{algo}-{digest}.lock", image.name):
        if _is_cached(final):  # pulled by whoever held the lock before us
            log.info("%s: in the cache: %s", image.name, final)
            return ensure(image, progress=progress)
        part = partial_dir / f"{algo}-{digest}.part"
        try:
            got, size = _fetch(image, algo, part, progress)
        except BaseException:
            with contextlib.suppress(OSError):
                if os.lstat(part).st_size == 0:  # nothing to resume: no empty file left behind
                    os.unlink(part)
            raise
        if got != digest:
            _unlink(part)
            raise RuntimeFailure(
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
    from vmlaunch.dirs import usable_cache_dir

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
    from vmlaunch.wait import wait_until

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


def _try_lock_file(lock: Path) -> int | None:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return lock_if_current(fd, lock)


def _fetch(image: Image, algo: str, part: Path, progress: bool | None) -> tuple[str, int]:
    """Download (or finish downloading) `image` into `part`, hashing as it goes: (hex, size)."""
    assert image.url is not None
    url = image.url
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "r+b") as out:
        have = os.fstat(fd).st_size
        if have > MAX_DOWNLOAD:
            out.truncate(0)
            have = 0
        hasher = hashlib.new(algo)
        if have:  # what is there already goes into the hash first
            log.info("%s: resuming the download at %s (checking what is there)", image.name, human_size(have))
            have = _hash_into(out, hasher, have)
        source = _open(url, have)
        try:
            if source.start != have:
                if have:
                    log.info("%s: the server does not resume downloads: starting again from 0", image.name)
                out.seek(0)
                out.truncate(0)
                hasher, have = hashlib.new(algo), 0
            _check_room(url, part, source.total, have)
            out.seek(have)
            if source.total is not None and have >= source.total:
                log.info("%s: the download is complete", image.name)
            else:
                log.info("%s: downloading %s (%s)", image.name, url,
                         human_size(source.total) if source.total is not None else "size unknown")
            have = _copy(source, out, hasher, have, image.name, progress)
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


def _copy(source: _Source, out: IO[bytes], hasher: Any, have: int, name: str,
          progress: bool | None) -> int:
    meter = _Meter(name, "downloading", source.total, have, progress)
    try:
        while True:
            try:
                chunk = source.read(CHUNK)
            except (OSError, _http_errors()) as exc:
                raise RuntimeFailure(f"downloading {source.url} failed after {have} bytes: {_reason(exc)}",
                                     "pull again: the download resumes from there") from None
            if not chunk:
                return have
            out.write(chunk)
            hasher.update(chunk)
            have += len(chunk)
            if have > MAX_DOWNLOAD:
                out.truncate(0)
                raise RuntimeFailure(f"downloading {source.url}: more than {human_size(MAX_DOWNLOAD)}; "
                                     "refused (no VM image is that large)", "check the URL")
            meter.update(have)
    finally:
        meter.finish(have)


def _check_room(url: str, part: Path, total: int | None, have: int) -> None:
    if total is None:
        return
    if total > MAX_DOWNLOAD:
        _unlink(part)
        raise RuntimeFailure(f"{url} is {human_size(total)}: larger than {human_size(MAX_DOWNLOAD)}; refused "
                             "(no VM image is that large)", "check the URL")
    with contextlib.suppress(OSError):
        vfs = os.statvfs(part.parent)
        free = vfs.f_bavail * vfs.f_frsize
        if total - have > free:
            raise RuntimeFailure(f"{url} needs {human_size(total - have)} more in {part.parent}, which has "
                                 f"{human_size(free)} free", "make room, or set VMLAUNCH_CACHE_DIR elsewhere")


class _Source:
    """An open download: its stream from byte `start`, and the whole file's size when known."""

    def __init__(self, url: str, stream: IO[bytes] | None, start: int, total: int | None) -> None:
        self.url = url
        self.stream = stream
        self.start = start
        self.total = total

    def read(self, size: int) -> bytes:
        return self.stream.read(size) if self.stream is not None else b""

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def _open(url: str, offset: int) -> _Source:
    if url.lower().startswith("file://"):
        return _open_file(url, offset)
    return _open_http(url, offset)


def _open_file(url: str, offset: int) -> _Source:
    from urllib.parse import urlsplit
    from urllib.request import url2pathname

    path = url2pathname(urlsplit(url).path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO cannot hang us
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


def _open_http(url: str, offset: int) -> _Source:
    import urllib.error
    import urllib.request

    from vmlaunch import __version__

    headers = {"User-Agent": f"vmlaunch/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    hint = "check the URL and this host's network (or proxy); pull again to resume"
    try:
        response = _opener().open(urllib.request.Request(url, headers=headers), timeout=TIMEOUT)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and offset:  # the partial is the whole file (or more: start again)
            match = re.fullmatch(r"bytes \*/(\d+)", (exc.headers.get("Content-Range") or "").strip())
            if match is not None and int(match[1]) == offset:
                return _Source(url, None, offset, offset)
            return _open_http(url, 0)
        raise RuntimeFailure(f"downloading {url} failed: HTTP {exc.code} {exc.reason}", hint) from None
    except urllib.error.URLError as exc:
        raise RuntimeFailure(f"downloading {url} failed: {_reason(exc.reason)}", hint) from None
    except (OSError, ValueError, _http_errors()) as exc:
        raise RuntimeFailure(f"downloading {url} failed: {_reason(exc)}", hint) from None
    length = _int(response.headers.get("Content-Length"))
    if response.status == 206 and offset:
        content_range = (response.headers.get("Content-Range") or "").strip()
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range)
        if match is None or int(match[1]) != offset:  # not the part asked for: the whole file then
            response.close()
            return _open_http(url, 0)
        total = int(match[3]) if match[3] != "*" else offset + length if length is not None else None
        return _Source(url, response, offset, total)
    if response.status == 200:  # from the start, also when the server ignored the Range asked for
        return _Source(url, response, 0, length)
    response.close()
    raise RuntimeFailure(f"downloading {url} failed: unexpected HTTP {response.status}", hint)


def _opener() -> urllib.request.OpenerDirector:
    import urllib.request
    from urllib.parse import urljoin, urlsplit

    class Redirects(urllib.request.HTTPRedirectHandler):
        """Redirects to http(s) only: urllib alone follows ftp:// too, and a checksum is no reason
        to fetch from wherever a server points."""

        def http_error_302(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                           headers: http.client.HTTPMessage) -> Any:
            target = headers.get("Location") or headers.get("URI")
            if target is not None:
                scheme = urlsplit(urljoin(req.full_url, target)).scheme.lower()
                if scheme not in ("http", "https"):
                    fp.close()
                    raise RuntimeFailure(f"downloading {req.full_url}: the server redirects to "
                                         f"{target!r}; vmlaunch follows redirects to http(s) only")
            return super().http_error_302(req, fp, code, msg, headers)

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    return urllib.request.build_opener(Redirects)


def _http_errors() -> type[Exception]:
    import http.client

    return http.client.HTTPException


def _reason(exc: object) -> str:
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "timeout":
        return f"no data for {TIMEOUT:.0f} s (timed out)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if type(exc).__name__ == "IncompleteRead":
        return "the connection closed early"
    return str(exc) or type(exc).__name__


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


class _Meter:
    """How far a download (or a checksum) is: a bar on a terminal, else a log line every
    PROGRESS_EVERY seconds."""

    def __init__(self, name: str, doing: str, total: int | None, start: int, progress: bool | None) -> None:
        self.name, self.doing, self.total, self.start = name, doing, total, start
        self.began = time.monotonic()
        if progress is None:
            progress = _is_terminal() and log.isEnabledFor(logging.INFO)
        self.bar = progress
        self.next = self.began + (BAR_EVERY if self.bar else PROGRESS_EVERY)
        self.drawn = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        if self.bar:
            sys.stderr.write(f"\r{self.line(done, now, bar=True)}\x1b[K")
            sys.stderr.flush()
            self.drawn = True
            self.next = now + BAR_EVERY
        else:
            log.info("%s", self.line(done, now, bar=False))
            self.next = now + PROGRESS_EVERY

    def finish(self, done: int) -> None:
        if self.drawn:
            sys.stderr.write(f"\r{self.line(done, time.monotonic(), bar=True)}\x1b[K\n")
            sys.stderr.flush()

    def line(self, done: int, now: float, *, bar: bool) -> str:
        elapsed = max(now - self.began, 1e-6)
        rate = f"{human_size(int((done - self.start) / elapsed))}/s"
        if self.total:
            share = min(done / self.total, 1.0)
            gauge = f"[{'#' * int(share * 30):.<30}] " if bar else ""
            return (f"{self.name}: {self.doing} {gauge}{share * 100:.0f}%, {human_size(done)} of "
                    f"{human_size(self.total)}, {rate}")
        return f"{self.name}: {self.doing} {human_size(done)}, {rate}"


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
