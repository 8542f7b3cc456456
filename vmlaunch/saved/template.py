"""Warm templates of throwaway VMs: a VM booted once to its ready point, its state saved, so that each
`vmlaunch run` (and `vmlaunch_fresh`, `Lab.fresh`) wakes a copy instead of booting.

The store, in the cache dir (`templates/`), one folder a template, named by its key:

    KEY/meta.json   what it was made of (the spec, the VM, the inputs that made its key), when it was
                    made and last used, each file's size and mtime, the saved state's SHA-256
    KEY/ram         the guest's RAM at the ready point (a `memory-backend-file` the template's QEMU
                    shared: each run maps it copy-on-write, so N runs share its pages in the page cache)
    KEY/state       its devices' state without the RAM (QEMU's migration stream, `x-ignore-shared`)
    KEY/home/       the template lab's own files: its disks (qcow2 overlays each run puts an overlay
                    of its own on), its lab dir (overlay of its image, UEFI variables, seed, SSH keys)

A template is keyed by everything that decides the VM's state at its ready point: the VM's definition
(memory, CPUs, machine, firmware, kernel, initrd, append, disks, NICs, image, cloud-init), the identity
(device, inode, size, mtime) of every file it reads (kernel, initrd, disks, the image), QEMU's binary
and version, the accelerator, and vmlaunch's own version. Any of it changed: another key, so a new
template, said in one line; the old one is pruned. A template whose own files changed since it was made
(truncated, rewritten: their size or mtime, the state's digest) is refused and made again.

Made in a folder of its own (`KEY.tmp-PID`) and renamed into place whole, under a lock per key
(`KEY.lock`): two runs that want the same template make it once (the other waits); a disk that fills
while it is made leaves no template, never half of one. The store is bounded (`VMLAUNCH_TEMPLATE_CACHE`,
a size, default 4G): after a template is made, those used least recently go until the rest fit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.errors import HostError, UsageError

log = logging.getLogger(__name__)

FORMAT = 1  # of meta.json and of what goes into a key
META = "meta.json"
RAM = "ram"
STATE = "state"
HOME = "home"
LIMIT_ENV = "VMLAUNCH_TEMPLATE_CACHE"
DEFAULT_LIMIT = 4 << 30
STATE_LONGEST = 256 << 20  # bytes of a saved device state read to check its digest


def store(*, create: bool = True) -> Path:
    """The templates' folder in the cache dir; HostError when the cache dir cannot be used."""
    from vmlaunch.layout.dirs import cache_dir, usable_cache_dir

    if not create:
        return cache_dir() / "templates"
    found = usable_cache_dir("templates")
    if found is None:
        raise HostError(f"the cache dir {cache_dir()} cannot hold templates (said above)",
                        "set VMLAUNCH_CACHE_DIR to a folder of your own, or run with --cold")
    return found


def limit() -> int:
    from vmlaunch.core.units import parse_size

    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT
    try:
        return int(parse_size(text))
    except (ValueError, TypeError):
        raise UsageError(f"{LIMIT_ENV}={text!r} is not a size", "give one like 4G or 512M") from None


def identity(path: Path) -> list[int] | None:
    """What says a file is the same one: device, inode, size, mtime (ns); None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def key_of(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([FORMAT, inputs], sort_keys=True, default=str).encode()).hexdigest()[:24]


@attrs.frozen
class Template:
    """A template in the store, checked whole."""

    key: str
    path: Path
    meta: dict[str, Any] = attrs.field(eq=False, repr=False)

    @property
    def ram(self) -> Path:
        return self.path / RAM

    @property
    def state(self) -> Path:
        return self.path / STATE

    @property
    def home(self) -> Path:
        return self.path / HOME

    @property
    def lab(self) -> str:
        """The name of the lab it was made in (its lab dir is `home/.vmlaunch/LAB`)."""
        return str(self.meta["lab"])

    @property
    def size(self) -> int:
        return folder_size(self.path)

    def used(self) -> None:
        """Mark it used now (the store's bound drops those used least recently first)."""
        with contextlib.suppress(OSError):
            os.utime(self.path / META)


def folder_size(path: Path) -> int:
    """Bytes a folder takes on disk (sparse files count what they hold)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def read_meta(path: Path) -> dict[str, Any] | None:
    from vmlaunch.core.fsutil import read_bounded

    try:
        data = json.loads(read_bounded(path / META, 1 << 20, follow=False))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def check(path: Path) -> tuple[Template | None, str | None]:
    """The template at `path` if it is whole and unchanged; else why not (None, None: there is none)."""
    if not path.is_dir():
        return None, None
    meta = read_meta(path)
    if meta is None:
        return None, "its meta.json is missing or unreadable"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return None, "its meta.json lists no files"
    for name, recorded in files.items():
        file = path / name
        try:
            st = os.lstat(file)
        except OSError:
            return None, f"{name} is gone"
        if not isinstance(recorded, list) or len(recorded) != 2:
            return None, f"its meta.json is damaged at {name}"
        if [st.st_size, st.st_mtime_ns] != recorded:
            return None, f"{name} changed since it was made ({st.st_size} bytes, recorded {recorded[0]})"
    try:
        from vmlaunch.core.fsutil import read_bounded

        digest = hashlib.sha256(read_bounded(path / STATE, STATE_LONGEST, follow=False)).hexdigest()
    except OSError as exc:
        return None, f"its state cannot be read ({exc.strerror or exc})"
    if digest != meta.get("state_sha256"):
        return None, "its saved state does not match its digest"
    return Template(path.name, path, meta), None


def find(key: str) -> Template | None:
    """The template `key`, checked; one that fails the check is removed (and said so): it is made again."""
    path = store() / key
    template, why = check(path)
    if why is not None:
        log.warning("template %s: %s: removed, it is made again", key, why)
        remove(path)
    return template


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


@contextlib.contextmanager
def making(key: str, timeout: float) -> Iterator[bool]:
    """Hold the lock of template `key` while it is made; yields False when another process held it
    longer than `timeout` seconds (the caller then boots cold: never do two processes write it)."""
    path = store() / f"{key}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() > deadline:
                yield False
                return
            if not said:
                log.info("template %s is being made by another vmlaunch: waiting for it", key)
                said = True
            time.sleep(0.1)
        yield True
    finally:
        os.close(fd)


def temporary(key: str) -> Path:
    """The folder a template is made in, renamed to its key once whole."""
    path = store() / f"{key}.tmp-{os.getpid()}"
    remove(path)
    path.mkdir(mode=0o700)
    return path


def seal(folder: Path, key: str, meta: dict[str, Any]) -> Template:
    """Record the files of the template made in `folder`, make them durable and move it into place."""
    files: dict[str, list[int]] = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            file = Path(root) / name
            st = os.lstat(file)
            if not os.path.isfile(file) or os.path.islink(file):
                continue
            with open(file, "rb") as handle:  # durable before the rename makes it a template
                os.fsync(handle.fileno())
            files[str(file.relative_to(folder))] = [st.st_size, st.st_mtime_ns]
    from vmlaunch.core.fsutil import read_bounded

    meta = {**meta, "format": FORMAT, "key": key, "made": time.time(), "files": files,
            "state_sha256": hashlib.sha256(read_bounded(folder / STATE, STATE_LONGEST)).hexdigest()}
    from vmlaunch.core.fsutil import write_atomic

    write_atomic(folder / META, json.dumps(meta, indent=1, sort_keys=True))
    final = folder.parent / key
    remove(final)
    os.rename(folder, final)
    return Template(key, final, meta)


@attrs.frozen
class Listed:
    key: str
    spec: str
    vm: str
    size: int
    made: float
    used: float
    state: str  # "ok", or why it would be made again
    wait_for: str | None = None  # the console text of its ready point, if any (`run --wait-for`)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def listing() -> list[Listed]:
    """Every template in the store, the most recently used first; the half-made ones of a process that
    is gone are removed on the way."""
    try:
        root = store(create=False)
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    found = []
    for entry in entries:
        path = root / entry
        if ".tmp-" in entry:
            pid = entry.rpartition("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                remove(path)
            continue
        if entry.endswith(".lock") or not path.is_dir():
            continue
        template, why = check(path)
        meta = template.meta if template is not None else (read_meta(path) or {})
        used = os.stat(path / META).st_mtime if (path / META).exists() else 0.0
        found.append(Listed(entry, str(meta.get("spec", "?")), str(meta.get("vm", "?")), folder_size(path),
                            float(meta.get("made", 0.0)), used, "ok" if why is None else why,
                            meta.get("wait_for") if isinstance(meta.get("wait_for"), str) else None))
    return sorted(found, key=lambda each: -each.used)


def bound(keep: str | None = None) -> list[str]:
    """Remove the templates used least recently until the store fits its limit (never `keep`); what went."""
    most = limit()
    listed = listing()
    total = sum(each.size for each in listed)
    gone = []
    for each in reversed(listed):
        if total <= most:
            break
        if each.key == keep:
            continue
        remove(store() / each.key)
        total -= each.size
        gone.append(each.key)
    for key in gone:
        log.info("template %s removed: the templates passed %s (%s)", key, LIMIT_ENV, most)
    return gone
