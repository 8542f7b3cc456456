#!/usr/bin/env python3
"""Build the tiny test guest that vmlaunch's integration tests boot under QEMU.

The guest is the current Debian kernel (``linux-image-amd64`` resolved to the concrete
``linux-image-6.1.0-N-amd64`` package) plus an initramfs holding ``busybox-static``, the
virtio, 9p (and ACPI power-button) kernel modules and ``tools/guest/init``. The init script
configures the guest from the kernel command line (``vl.ip=``, ``vl.mark=``, ``vl.run=``, ``vl.share=``),
reports on the serial console and prints ``VMLAUNCH-GUEST-READY`` once it is up, so tests
can check networking, disks, the balloon and ACPI shutdown of a real QEMU.

Usage: ``python3 tools/build_guest.py [--out DIR] [--force]`` writes ``DIR/vmlinuz`` and
``DIR/initrd.gz`` (default DIR: ``examples/guest`` in the repository), and the kernel's modules
the guest uses (with what they depend on) in ``DIR/modules/RELEASE``, laid out as
``/lib/modules/RELEASE`` is (modules.builtin, modules.order, modules.dep, ``kernel/...``): what
``vmlaunch run --kernel DIR/vmlinuz --modules DIR/modules/RELEASE`` reads. Downloaded ``.deb``
files are kept in ``${XDG_CACHE_HOME:-~/.cache}/vmlaunch/guest-debs``. ``DIR/.stamp`` records
the package versions and the hashes of the init script, of this builder and of the vmlaunch files it
uses (the agent, ``vmlaunch/guests/kmod.py`` and ``cpio.py``, loaded by their paths); when it matches,
nothing is downloaded or rebuilt (``--force`` rebuilds). Exit status: 0 success, 3 failure.
Python 3.9+ standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILDER = Path(__file__).resolve()
INIT_SCRIPT = BUILDER.parent / "guest" / "init"
# vmlaunch's agent for the command channel (the sh one: the guest has no python3), /bin/vmlaunch-agent
AGENT_SCRIPT = REPO_ROOT / "vmlaunch" / "guests" / "guest_agent.sh"
DEFAULT_OUT = REPO_ROOT / "examples" / "guest"
# vmlaunch's own code this builder shares, standard library only: loaded by path (see `shared`)
SHARED = {name: REPO_ROOT / "vmlaunch" / "guests" / f"{name}.py" for name in ("kmod", "cpio")}

KERNEL_META = "linux-image-amd64"
BUSYBOX_PKG = "busybox-static"
KERNEL_PKG_RE = re.compile(r"^linux-image-\d[^ ]*-amd64$")

# The guest's modules; what they depend on comes with them, loaded before them (their depends=).
REQUIRED_MODULES = (
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "virtio_balloon",
    "virtio_console",
    "9pnet_virtio",  # shares (vl.share=), as vmlaunch's own initramfs mounts them
    "9p",
)
# ACPI power button (QMP system_powerdown) and evdev, through which busybox acpid sees it.
OPTIONAL_MODULES = ("button", "evdev")
# the files of the package's modules folder kept beside the kernel, with the modules the guest uses
MODULE_INDEXES = ("modules.builtin", "modules.builtin.modinfo")

GUEST_DIRS = (
    "bin",
    "dev",
    "etc",
    "lib",
    "lib/modules",
    "mnt",
    "proc",
    "root",
    "run",
    "sys",
    "tmp",
    "var",
    "var/log",
    "var/run",
)
MODULE_LIST_PATH = "etc/vl-modules"
STAMP_FORMAT = "vmlaunch-test-guest 1"
EXIT_FAILURE = 3


class BuildError(Exception):
    """An expected failure: reported as one line on stderr, exit status 3."""


class PackagesNotFound(BuildError):
    """apt does not know the packages (package lists missing or stale)."""


class Package(NamedTuple):
    name: str
    version: str


def shared(name: str) -> types.ModuleType:
    """vmlaunch/guests/NAME.py, loaded by its path: this builder runs without vmlaunch installed."""
    spec = importlib.util.spec_from_file_location(f"_vmlaunch_{name}", SHARED[name])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {SHARED[name]}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:
    from vmlaunch.guests import cpio as cpio_format
    from vmlaunch.guests import kmod
else:
    kmod, cpio_format = shared("kmod"), shared("cpio")


# --------------------------------------------------------------------------- helpers


def say(message: str) -> None:
    print(f"build_guest: {message}", flush=True)


def run(cmd: list[str], cwd: Path | None = None) -> str:
    """Run a command, return its stdout; raise BuildError naming it and its stderr."""
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise BuildError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        detail = " | ".join(line.strip() for line in proc.stderr.splitlines() if line.strip())
        raise BuildError(
            f"command failed (exit {proc.returncode}): {' '.join(cmd)}: {detail or 'no stderr'}"
        )
    return proc.stdout


def sha256_file(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise BuildError(f"cannot read {path}: {exc.strerror or exc}") from None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "vmlaunch" / "guest-debs"


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write data to path through a temporary file in the same directory and a rename."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Serialise concurrent builders writing into the same output directory."""
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# --------------------------------------------------------------------------- stamp


def input_hashes() -> dict[str, str]:
    hashes = {"init-sha256": sha256_file(INIT_SCRIPT), "agent-sha256": sha256_file(AGENT_SCRIPT),
              "builder-sha256": sha256_file(BUILDER)}
    hashes.update({f"{name}-sha256": sha256_file(path) for name, path in SHARED.items()})
    return hashes


def read_stamp(out: Path) -> dict[str, str]:
    try:
        lines = (out / ".stamp").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    if not lines or lines[0] != STAMP_FORMAT:
        return {}
    fields = (line.split(" ", 1) for line in lines[1:] if " " in line)
    return {key: value for key, value in fields}


def stamp_text(packages: list[Package], kernel: str, sizes: dict[str, int]) -> str:
    lines = [STAMP_FORMAT, f"kernel {kernel}"]
    lines += [f"package:{pkg.name} {pkg.version}" for pkg in packages]
    lines += [f"{key} {value}" for key, value in input_hashes().items()]
    lines += [f"size:{name} {size}" for name, size in sorted(sizes.items())]
    return "\n".join(lines) + "\n"


def is_up_to_date(out: Path) -> bool:
    """True when the stamp matches this builder and init and both outputs are intact."""
    stamp = read_stamp(out)
    if not stamp or any(stamp.get(k) != v for k, v in input_hashes().items()):
        return False
    for name in ("vmlinuz", "initrd.gz"):
        try:
            size = (out / name).stat().st_size
        except OSError:
            return False
        if stamp.get(f"size:{name}") != str(size):
            return False
    return (out / "modules" / stamp.get("kernel", "-") / "modules.dep").is_file()


# --------------------------------------------------------------------------- apt


def parse_stanzas(text: str) -> list[dict[str, str]]:
    """Parse deb822 stanzas (apt-cache show output) into dicts of field -> value."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        if not line.strip():
            if current:
                stanzas.append(current)
            current, key = {}, ""
        elif line[0] in " \t" and key:
            current[key] += "\n" + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


def apt_show(names: list[str]) -> dict[str, dict[str, str]]:
    """Candidate stanza of each package; PackagesNotFound if apt does not know one."""
    try:
        text = run(["apt-cache", "show", "--no-all-versions", *names])
    except BuildError as exc:
        raise PackagesNotFound(str(exc)) from None
    found = {st["Package"]: st for st in parse_stanzas(text) if "Package" in st}
    missing = [name for name in names if name not in found]
    if missing:
        raise PackagesNotFound(f"apt-cache knows no package {', '.join(missing)}")
    return found


def kernel_dependency(meta: dict[str, str]) -> str:
    """The concrete linux-image-*-amd64 package the metapackage depends on."""
    for alternatives in meta.get("Depends", "").split(","):
        for alternative in alternatives.split("|"):
            name = alternative.strip().split(" ", 1)[0]
            if KERNEL_PKG_RE.match(name):
                return name
    raise PackagesNotFound(f"{KERNEL_META} depends on no linux-image-*-amd64 package")


def resolve_packages() -> list[Package]:
    meta = apt_show([KERNEL_META, BUSYBOX_PKG])
    kernel_pkg = kernel_dependency(meta[KERNEL_META])
    kernel = apt_show([kernel_pkg])[kernel_pkg]
    return [
        Package(kernel_pkg, kernel["Version"]),
        Package(BUSYBOX_PKG, meta[BUSYBOX_PKG]["Version"]),
    ]


def cached_deb(cache: Path, pkg: Package) -> Path | None:
    """The .deb of exactly this package version in the cache, if any (as apt names it)."""
    prefix = f"{pkg.name}_{pkg.version.replace(':', '%3a')}_"
    for path in sorted(cache.glob(f"{pkg.name}_*.deb")):
        if path.name.startswith(prefix):
            return path
    return None


def check_deb(path: Path, pkg: Package) -> None:
    fields = run(["dpkg-deb", "--field", str(path), "Package", "Version"])
    info = {st.get("Package"): st.get("Version") for st in parse_stanzas(fields)}
    if info.get(pkg.name) != pkg.version:
        raise BuildError(f"{path} is not {pkg.name} {pkg.version}")


def prune_cache(cache: Path, keep: dict[str, Path]) -> None:
    """Delete other versions of the packages we use from the cache."""
    for name, path in keep.items():
        for old in cache.glob(f"{name}_*.deb"):
            if old != path:
                with contextlib.suppress(OSError):
                    old.unlink()


def download(packages: list[Package], cache: Path) -> dict[str, Path]:
    """Return name -> .deb path, downloading with apt-get what the cache lacks."""
    cache.mkdir(parents=True, exist_ok=True)
    debs = {pkg.name: cached_deb(cache, pkg) for pkg in packages}
    wanted = [pkg for pkg in packages if debs[pkg.name] is None]
    if wanted:
        say("downloading " + ", ".join(f"{p.name} {p.version}" for p in wanted))
        with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
            run(["apt-get", "download", *(f"{p.name}={p.version}" for p in wanted)], cwd=Path(tmp))
            for pkg in wanted:
                got = cached_deb(Path(tmp), pkg)
                if got is None:
                    raise BuildError(f"apt-get download left no .deb for {pkg.name} {pkg.version}")
                check_deb(got, pkg)
                debs[pkg.name] = Path(shutil.move(str(got), str(cache / got.name)))
    result = {name: path for name, path in debs.items() if path is not None}
    prune_cache(cache, result)
    return result


def acquire(cache: Path) -> tuple[list[Package], dict[str, Path]]:
    """Resolve and download the packages, running apt-get update once if that helps."""
    updated = False
    while True:
        try:
            packages = resolve_packages()
            return packages, download(packages, cache)
        except BuildError as exc:
            if updated or os.geteuid() != 0:
                if isinstance(exc, PackagesNotFound):
                    hint = "even after apt-get update" if updated else "run apt-get update as root"
                    raise BuildError(
                        f"apt cannot find {KERNEL_META}/{BUSYBOX_PKG} ({hint}): {exc}"
                    ) from None
                raise
            say(f"{exc}; running apt-get update and retrying")
            try:
                run(["apt-get", "update"])
            except BuildError as update_exc:
                raise BuildError(f"{exc}; then {update_exc}") from None
            updated = True


# --------------------------------------------------------------------------- kernel tree


def kernel_version(root: Path) -> str:
    versions = sorted(p.name for p in (root / "lib" / "modules").glob("*") if p.is_dir())
    if len(versions) != 1:
        raise BuildError(f"expected one kernel in the package, found {versions or 'none'}")
    return versions[0]


def collect_modules(root: Path, kernel: str) -> list[kmod.Module]:
    """The guest's modules in insmod order, what they depend on first; built-in ones skipped, a missing
    required one fails."""
    moddir = root / "lib" / "modules" / kernel
    index, builtin = kmod.index_modules(moddir), kmod.builtin_modules(moddir)
    roots = list(REQUIRED_MODULES) + [name for name in OPTIONAL_MODULES if name in index]
    try:
        modules, missing = kmod.gather(roots, index, builtin)
    except kmod.ModuleError as exc:
        raise BuildError(str(exc)) from None
    if missing:
        names = ", ".join(sorted(missing))
        raise BuildError(f"kernel {kernel} has no module {names}, neither file nor built-in")
    return modules


def keep_modules(root: Path, kernel: str, modules: list[kmod.Module], out: Path) -> None:
    """Keep the guest's modules beside the kernel, as /lib/modules/KERNEL holds them: OUT/modules/KERNEL
    with the package's modules.builtin, a modules.order and modules.dep of the modules kept, and their
    files under kernel/. Other kernels' folders there are removed."""
    moddir = root / "lib" / "modules" / kernel
    folder = out / "modules"
    folder.mkdir(exist_ok=True)
    made = Path(tempfile.mkdtemp(prefix=f".{kernel}.", dir=folder))
    try:
        for name in MODULE_INDEXES:
            if (moddir / name).is_file():
                shutil.copyfile(moddir / name, made / name)
        names = {module.name: module.path.relative_to(moddir).as_posix() for module in modules
                 if module.path is not None}
        for relative in names.values():
            (made / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(moddir / relative, made / relative)
        dep_lines = []
        closure: dict[str, set[str]] = {}  # each module's dependencies, theirs too (as depmod lists them)
        for module in modules:
            direct = [dep for dep in kmod.depends(module.data) if dep in names]
            closure[module.name] = set(direct).union(*(closure[dep] for dep in direct))
            # depmod's order: what is loaded last first
            deps = [names[m.name] for m in reversed(modules) if m.name in closure[module.name]]
            dep_lines.append(f"{names[module.name]}: {' '.join(deps)}".rstrip() + "\n")
        (made / "modules.order").write_text("".join(f"{names[m.name]}\n" for m in modules))
        (made / "modules.dep").write_text("".join(dep_lines))
        os.chmod(made, 0o755)
        for old in folder.iterdir():
            if not old.name.startswith("."):
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        os.rename(made, folder / kernel)
    finally:
        shutil.rmtree(made, ignore_errors=True)


# --------------------------------------------------------------------------- initramfs


def build_initramfs(busybox: bytes, init: bytes, modules: list[kmod.Module], agent: bytes = b"") -> bytes:
    """gzip-compressed newc cpio archive (reproducible: fixed mtimes)."""
    raw = io.BytesIO()
    cpio = cpio_format.CpioWriter(raw)
    for directory in GUEST_DIRS:
        cpio.directory(directory, 0o1777 if directory == "tmp" else 0o755)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", busybox, 0o755)
    cpio.file("init", init, 0o755)
    if agent:
        cpio.file("bin/vmlaunch-agent", agent, 0o755)
    for module in modules:
        cpio.file(f"lib/modules/{module.name}.ko", module.data)
    cpio.file(MODULE_LIST_PATH, "".join(f"{m.name}\n" for m in modules).encode())
    cpio.finish()
    compressed = io.BytesIO()
    with gzip.GzipFile(fileobj=compressed, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(raw.getvalue())
    return compressed.getvalue()


# --------------------------------------------------------------------------- build


def read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise BuildError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def build(out: Path) -> None:
    init = read_bytes(INIT_SCRIPT, "init script")
    agent = read_bytes(AGENT_SCRIPT, "agent script")
    packages, debs = acquire(cache_dir())
    with tempfile.TemporaryDirectory(prefix="vmlaunch-guest-") as tmp:
        root = Path(tmp)
        say("extracting " + ", ".join(pkg.name for pkg in packages))
        for deb in debs.values():
            run(["dpkg-deb", "-x", str(deb), str(root)])
        kernel = kernel_version(root)
        vmlinuz = read_bytes(root / "boot" / f"vmlinuz-{kernel}", "kernel image")
        busybox = read_bytes(root / "bin" / "busybox", "busybox")
        modules = collect_modules(root, kernel)
        keep_modules(root, kernel, modules, out)
    initrd = build_initramfs(busybox, init, modules, agent)
    with contextlib.suppress(FileNotFoundError):
        (out / ".stamp").unlink()
    atomic_write(out / "vmlinuz", vmlinuz)
    atomic_write(out / "initrd.gz", initrd)
    sizes = {"vmlinuz": len(vmlinuz), "initrd.gz": len(initrd)}
    atomic_write(out / ".stamp", stamp_text(packages, kernel, sizes).encode())
    say(
        f"built {out} (kernel {kernel}, busybox {packages[1].version}, "
        f"modules {' '.join(m.name for m in modules)})"
    )


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
    try:
        if not args.force and is_up_to_date(out):
            print(f"test guest up to date: {out}")
            return 0
        out.mkdir(parents=True, exist_ok=True)
        with locked(out):
            if not args.force and is_up_to_date(out):  # another builder finished meanwhile
                print(f"test guest up to date: {out}")
                return 0
            build(out)
    except BuildError as exc:
        print(f"build_guest: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"build_guest: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("build_guest: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
