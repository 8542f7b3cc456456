"""Kernel modules as an initramfs holds them: where a modules folder keeps each one, which are built in,
their bytes (decompressed), what their `.modinfo` says, and the order they load in (each after the
modules its `depends=` names).

A modules folder is either an installed one (`/lib/modules/RELEASE`: modules.dep or modules.order
naming `kernel/...ko[.xz|.zst|.gz]`, modules.builtin) or a kernel build tree (modules.order naming
`drivers/...o` beside each built `.ko`, modules.builtin, `.config`).

Standard library only, Python 3.9+: tools/build_guest.py (which runs without vmlaunch installed) loads
this file by its path. Errors are `ModuleError`; a caller says them in its own terms.
"""

from __future__ import annotations

import lzma
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")
MAX_MODULE = 64 << 20  # bytes of one decompressed module: more is no module (a decompression bomb)
MAX_LISTING = 16 << 20  # bytes of modules.dep, modules.order, modules.builtin or .config read
ZSTD_TIMEOUT = 60.0  # seconds the zstd program may take for one module


class ModuleError(Exception):
    """A module that cannot be read, decompressed or ordered."""


class Module(NamedTuple):
    name: str
    data: bytes  # the .ko, decompressed
    path: Path | None = None  # where it was read from


def module_name(filename: str) -> str:
    """`virtio-pci.ko.xz` -> `virtio_pci`; "" for a file that is no module."""
    for suffix in SUFFIXES:
        if filename.endswith(suffix):
            return filename[: -len(suffix)].replace("-", "_")
    return ""


def _listing(path: Path) -> list[str]:
    """The lines of a small text file of a modules folder; [] when it is missing or unreadable."""
    try:
        with open(path, "rb") as file:
            return file.read(MAX_LISTING).decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def index_modules(folder: Path) -> dict[str, Path]:
    """Module name -> its file in `folder`: from modules.dep, else modules.order (a build tree's names
    `.o`), else every module file under it."""
    named = [line.split(":", 1)[0].strip() for line in _listing(folder / "modules.dep")]
    named = [name for name in named if name] or [line.strip() for line in _listing(folder / "modules.order")]
    index: dict[str, Path] = {}
    for entry in filter(None, named):
        stem = entry[:-2] if entry.endswith(".o") else entry
        for suffix in SUFFIXES:
            stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
        for suffix in SUFFIXES:
            path = folder / (stem + suffix)
            if path.is_file():
                index.setdefault(module_name(path.name), path)
                break
    if not index:
        for dirpath, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for filename in sorted(files):
                name = module_name(filename)
                if name:
                    index.setdefault(name, Path(dirpath) / filename)
    return index


def builtin_modules(folder: Path) -> set[str]:
    """The modules `folder`'s modules.builtin says are built into the kernel."""
    return {module_name(Path(line.strip()).name) for line in _listing(folder / "modules.builtin")} - {""}


def config_values(path: Path) -> dict[str, str]:
    """`CONFIG_X` -> `y`, `m` or a value, from a kernel's .config (or /boot/config-RELEASE)."""
    values = {}
    for line in _listing(path):
        key, eq, value = line.partition("=")
        if eq and key.startswith("CONFIG_"):
            values[key] = value.strip()
    return values


def read_module(path: Path) -> Module:
    """The module at `path`, decompressed (xz, gzip, zstd by its name)."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_MODULE + 1)
    except OSError as exc:
        raise ModuleError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = _decompressed(path, raw)
    except (lzma.LZMAError, zlib.error, EOFError, OSError) as exc:
        raise ModuleError(f"{path} does not decompress: {exc}") from None
    if len(data) > MAX_MODULE:
        raise ModuleError(f"{path} is larger than {MAX_MODULE >> 20} MiB: no kernel module")
    if not data.startswith(b"\x7fELF"):
        raise ModuleError(f"{path} is no kernel module (no ELF)")
    return Module(module_name(path.name), data, path)


def _decompressed(path: Path, raw: bytes) -> bytes:
    if path.name.endswith(".ko.xz"):
        return lzma.LZMADecompressor().decompress(raw, MAX_MODULE + 1)
    if path.name.endswith(".ko.gz"):
        return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS).decompress(raw, MAX_MODULE + 1)
    if path.name.endswith(".ko.zst"):
        return _unzstd(path, raw)
    return raw


def _unzstd(path: Path, raw: bytes) -> bytes:
    """zstd in the standard library (Python 3.14+), else the zstd program."""
    try:
        from compression import zstd  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        pass
    else:
        return bytes(zstd.ZstdDecompressor().decompress(raw, MAX_MODULE + 1))
    if shutil.which("zstd") is None:
        raise ModuleError(f"{path} is zstd-compressed: install zstd")
    try:
        done = subprocess.run(["zstd", "-dcq"], input=raw, capture_output=True, check=False,
                              timeout=ZSTD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ModuleError(f"zstd took more than {ZSTD_TIMEOUT:g} s for {path}") from None
    if done.returncode != 0:
        raise ModuleError(f"zstd cannot decompress {path}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def modinfo(data: bytes, field: str) -> str | None:
    """A field of a module's .modinfo section (`depends`, `vermagic`), None when it has none."""
    match = re.search(rb"(?:^|\x00)" + re.escape(field.encode()) + rb"=([^\x00]*)\x00", data)
    return None if match is None else match.group(1).decode("utf-8", "replace")


def depends(data: bytes) -> list[str]:
    """The modules a module needs loaded before it."""
    return [name.strip().replace("-", "_") for name in (modinfo(data, "depends") or "").split(",")
            if name.strip()]


def gather(roots: Sequence[str], index: Mapping[str, Path], builtin: Iterable[str],
           read: Callable[[Path], Module] = read_module) -> tuple[list[Module], dict[str, str]]:
    """The modules `roots` need, in load order (each after what it depends on; built-in ones left
    out), and the ones missing: name -> the module that needs it ("" for a root)."""
    built = set(builtin)
    loaded: list[Module] = []
    missing: dict[str, str] = {}
    done: set[str] = set()
    visiting: list[str] = []

    def visit(name: str, needed_by: str) -> None:
        if name in done or name in built:
            return
        if name in visiting:
            raise ModuleError(f"modules depend on each other in a circle: {' -> '.join(visiting + [name])}")
        if name not in index:
            missing.setdefault(name, needed_by)
            return
        module = read(index[name])
        visiting.append(name)
        for dep in depends(module.data):
            visit(dep, name)
        visiting.pop()
        done.add(name)
        loaded.append(Module(name, module.data, module.path))

    for root in roots:
        visit(root.replace("-", "_"), "")
    return loaded, missing
