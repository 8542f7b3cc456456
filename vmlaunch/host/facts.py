"""Facts about this host that the compiler needs, gathered once into a frozen `Host`.

Probing QEMU (version, devices, io_uring) and KVM costs a second or more, so the result is cached in
the cache dir, keyed by the QEMU binary (path, size, mtime), the kernel and the boot: a new QEMU, a new
kernel or a reboot probes again. Cheap facts (/dev/vhost-net, CPUs, memory, run dir) are read live.
Tests build a `Host` by hand instead of detecting one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vmlaunch.core.version import __version__
from vmlaunch.errors import HostError
from vmlaunch.host.cgroups import Cpusets
from vmlaunch.host.cgroups import detect as detect_cpusets
from vmlaunch.host.memory import KsmSupport, ksm_support
from vmlaunch.host.numa import Topology, read_topology
from vmlaunch.layout.dirs import run_root, usable_cache_dir
from vmlaunch.spec.model import Accel

if TYPE_CHECKING:
    import subprocess

# subprocess, tempfile, shutil and re are imported inside the probes: a cached host needs none of them.

QEMU_BINARY = "qemu-system-x86_64"
KVM_PROBE_TIMEOUT = 3.0
INSTALL_HINT = "install Debian's qemu-system-x86 and qemu-utils (`make setup` does)"


@attrs.frozen
class KvmStatus:
    """Whether KVM runs a guest here, and the evidence."""

    usable: bool
    reason: str


@attrs.frozen
class QemuInfo:
    binary: str
    version: tuple[int, int, int]
    devices: frozenset[str]
    io_uring: bool  # this QEMU and kernel open images with aio=io_uring
    img: str | None = None  # qemu-img, for creating images
    seccomp: bool = True  # this QEMU was built with -sandbox (seccomp): Debian's is

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


@attrs.frozen
class Host:
    qemu: QemuInfo
    kvm: KvmStatus
    vhost_net: bool = False
    cpus: int = 1
    memory_mib: int = 1024
    run_root: Path = Path("/run/vmlaunch")
    ovmf: Ovmf | None = None  # UEFI firmware, for firmware = "uefi"
    hugepage_sizes_kib: frozenset[int] = frozenset()  # the hugepage sizes the kernel offers, in KiB
    ksm: KsmSupport | None = None  # None: the kernel has no KSM
    numa: Topology | None = None  # NUMA nodes, their CPUs and memory (None: not known, as in tests)
    cpusets: Cpusets | None = None  # cpuset cgroups vmlaunch may place VMs with
    vlan_8021q: bool = True  # the kernel has 802.1Q VLAN links (8021q loaded, built in or installed)
    # Every QEMU in a seccomp sandbox, and as root each under a uid of its own (host/confine.py); off only
    # with VMLAUNCH_CONFINE=off, for measuring and debugging
    confine: bool = True
    as_root: bool = False  # vmlaunch runs as root (a lab that makes bridges and taps)
    netem: bool | None = None  # the kernel has sch_netem (host/netem.py); None: not known


@attrs.frozen
class Ovmf:
    """UEFI firmware for q35: the code (read-only, shared) and the template of a VM's variables."""

    code: Path
    vars: Path


def accel_of(wanted: Accel, kvm: KvmStatus) -> Accel:
    """The accelerator a VM that asks for `wanted` runs under on a host with `kvm`: `auto` is KVM where
    KVM runs a guest, else TCG. (`kvm` where it does not is refused by the compiler.)"""
    if wanted is Accel.AUTO:
        return Accel.KVM if kvm.usable else Accel.TCG
    return wanted


CONFINE_ENV = "VMLAUNCH_CONFINE"


def confinement_wanted() -> bool:
    """False only when VMLAUNCH_CONFINE says off (0, off, no, false): QEMU then runs unconfined."""
    return os.environ.get(CONFINE_ENV, "").strip().lower() not in ("0", "off", "no", "false")


def detect_host() -> Host:
    """The Host for this machine: cached QEMU and KVM facts plus live cheap ones."""
    binary = os.environ.get("VMLAUNCH_QEMU") or _which(QEMU_BINARY)
    if not binary or not os.access(binary, os.X_OK):
        raise HostError(f"{os.environ.get('VMLAUNCH_QEMU') or QEMU_BINARY} not found", INSTALL_HINT)
    qemu, kvm = _cached_probe(binary)
    return Host(
        qemu=qemu,
        kvm=kvm,
        vhost_net=os.path.exists("/dev/vhost-net"),
        cpus=os.cpu_count() or 1,
        memory_mib=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20,
        run_root=run_root(),
        ovmf=find_ovmf(),
        hugepage_sizes_kib=hugepage_sizes_kib(),
        ksm=ksm_support(),
        numa=read_topology(),
        cpusets=detect_cpusets(),
        vlan_8021q=kernel_has_8021q(),
        confine=confinement_wanted(),
        as_root=os.geteuid() == 0,
        netem=kernel_has_netem(),
    )


def kernel_has_netem() -> bool | None:
    """Whether the kernel has sch_netem, from its config and module lists (no probe: a few reads)."""
    from vmlaunch.host import netem

    return netem.kernel_has_netem()


def kernel_has_8021q() -> bool:
    """Whether `ip link add ... type vlan` can work: 8021q is loaded or built in (/proc/net/vlan, in
    every network namespace then), or installed for the kernel to load on demand. Three stats."""
    from vmlaunch.host.memory import proc_root
    from vmlaunch.host.pci import sysfs_root

    return any(os.path.exists(path) for path in (
        proc_root() / "net" / "vlan", sysfs_root() / "module" / "8021q",
        Path(MODULES_ROOT) / os.uname().release / "kernel" / "net" / "8021q"))


MODULES_ROOT = "/lib/modules"


def hugepage_sizes_kib() -> frozenset[int]:
    """The hugepage sizes the kernel offers (`kernel/mm/hugepages/hugepages-NkB` in sysfs), in KiB."""
    from vmlaunch.host.pci import sysfs_root

    try:
        names = os.listdir(sysfs_root() / "kernel" / "mm" / "hugepages")
    except OSError:
        return frozenset()
    return frozenset(int(name[len("hugepages-"):-len("kB")]) for name in names
                     if name.startswith("hugepages-") and name.endswith("kB")
                     and name[len("hugepages-"):-len("kB")].isdigit())


# Where QEMU's firmware descriptors live (docs/interop/firmware.json), lowest priority first: a file of
# the same name in a later folder replaces an earlier one, and the lowest name wins.
FIRMWARE_DIRS = ("/usr/share/qemu/firmware", "/etc/qemu/firmware")
# Without descriptors: Debian's ovmf package (bookworm ships the 4M images; older ones the 2M).
OVMF_FALLBACKS = (("/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"),
                  ("/usr/share/OVMF/OVMF_CODE.fd", "/usr/share/OVMF/OVMF_VARS.fd"))
# Firmware that needs what vmlaunch does not set up (SMM for secure boot, SEV, enrolled keys).
_UNWANTED_FEATURES = {"secure-boot", "requires-smm", "enrolled-keys", "amd-sev-es", "amd-sev-snp",
                      "intel-tdx"}


def find_ovmf() -> Ovmf | None:
    """The UEFI firmware QEMU's descriptors name for x86_64 q35 without secure boot, else Debian's
    files, else None. Cheap: a few small JSON files."""
    import fnmatch
    import json

    dirs = [*FIRMWARE_DIRS]
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    dirs.append(os.path.join(config, "qemu", "firmware"))
    files: dict[str, str] = {}
    for folder in dirs:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        files.update({name: os.path.join(folder, name) for name in names if name.endswith(".json")})
    for name in sorted(files):
        try:
            with open(files[name], encoding="utf-8") as f:
                doc = json.load(f)
            mapping = doc["mapping"]
            if ("uefi" not in doc.get("interface-types", ()) or mapping.get("device") != "flash"
                    or _UNWANTED_FEATURES & set(doc.get("features", ()))):
                continue
            if not any(target.get("architecture") == "x86_64"
                       and any(fnmatch.fnmatch("pc-q35-7.2", m) for m in target.get("machines", ()))
                       for target in doc.get("targets", ())):
                continue
            code, template = mapping["executable"], mapping["nvram-template"]
            if code.get("format", "raw") != "raw" or template.get("format", "raw") != "raw":
                continue
            found = Ovmf(Path(code["filename"]), Path(template["filename"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not a descriptor vmlaunch can use
        if found.code.is_file() and found.vars.is_file():
            return found
    for code_file, vars_file in OVMF_FALLBACKS:
        if os.path.isfile(code_file) and os.path.isfile(vars_file):
            return Ovmf(Path(code_file), Path(vars_file))
    return None


def _which(name: str, path: str | None = None) -> str | None:
    for folder in (path or os.environ.get("PATH", os.defpath)).split(os.pathsep):
        candidate = os.path.join(folder, name)
        if folder and os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


def _probe_key(binary: str) -> dict[str, Any]:
    st = os.stat(binary)
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return {
        "vmlaunch": __version__,
        "binary": binary,
        "size": st.st_size,
        "mtime": st.st_mtime_ns,
        "kernel": os.uname().release,
        "boot": boot_id,
        "kvm": os.access("/dev/kvm", os.R_OK | os.W_OK),
    }


def _cached_probe(binary: str) -> tuple[QemuInfo, KvmStatus]:
    key = _probe_key(binary)
    folder = usable_cache_dir()
    cache = folder / "host.json" if folder is not None else None
    try:
        if cache is None:
            raise FileNotFoundError("no usable cache")
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            return _qemu_from_json(saved["qemu"]), KvmStatus(**saved["kvm"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    qemu = probe_qemu(binary)
    kvm = probe_kvm(binary)
    record = {"key": key, "qemu": attrs.asdict(qemu), "kvm": attrs.asdict(kvm)}
    record["qemu"]["devices"] = sorted(qemu.devices)
    if cache is not None:
        _write_cache(cache, json.dumps(record, indent=1))
    return qemu, kvm


ACCEL_TOLD = "accel-told.json"  # in the cache dir: the accelerator reasons printed in full today


def told_today(reasons: Collection[str]) -> bool:
    """Whether each of these reasons (why an accelerator was chosen) was printed in full today on this
    host; records them when not. `up` and `cmdline` give the reason once a day and then only the
    accelerator: it is about the host, the same at every run (`doctor` has it). Without a usable
    cache: False, the reason every time."""
    import time

    folder = usable_cache_dir()
    if folder is None:
        return False
    path = folder / ACCEL_TOLD
    stamp = {"host": os.uname().nodename, "day": time.strftime("%Y-%m-%d")}
    told: list[str] = []
    try:
        saved = json.loads(path.read_text())
        if all(saved[key] == value for key, value in stamp.items()) and isinstance(saved["reasons"], list):
            told = [reason for reason in saved["reasons"] if isinstance(reason, str)]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    if all(reason in told for reason in reasons):
        return True
    _write_cache(path, json.dumps({**stamp, "reasons": sorted({*told, *reasons})}, indent=1))
    return False


def _qemu_from_json(data: dict[str, Any]) -> QemuInfo:
    return QemuInfo(
        binary=data["binary"],
        version=(int(data["version"][0]), int(data["version"][1]), int(data["version"][2])),
        devices=frozenset(data["devices"]),
        io_uring=data["io_uring"],
        img=data["img"],
        seccomp=data["seccomp"],  # missing in an older cache: KeyError, probed again
    )


def _write_cache(path: Path, text: str) -> None:
    from vmlaunch.core.fsutil import write_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, 0o644, durable=False)
    except OSError:
        pass  # without a cache every run probes again: slower, still right


def _run(argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess[str]:
    import subprocess

    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostError(f"`{' '.join(argv)}` failed: {exc}", INSTALL_HINT) from None


def probe_qemu(binary: str) -> QemuInfo:
    import re

    out = _run([binary, "-version"])
    found = re.search(r"version (\d+)\.(\d+)(?:\.(\d+))?", out.stdout)
    if out.returncode != 0 or not found:
        raise HostError(f"`{binary} -version` did not report a version: {out.stderr.strip()}",
                        INSTALL_HINT)
    version = (int(found.group(1)), int(found.group(2)), int(found.group(3) or 0))
    help_out = _run([binary, "-nodefaults", "-machine", "none", "-device", "help"])
    devices = frozenset(re.findall(r'^name "([^"]+)"', help_out.stdout, re.MULTILINE))
    img = _which("qemu-img", f"{Path(binary).parent}:{os.environ.get('PATH', '')}")
    # -sandbox is in the help only of a QEMU built with seccomp
    seccomp = re.search(r"^-sandbox on", _run([binary, "-help"]).stdout, re.MULTILINE) is not None
    return QemuInfo(binary=binary, version=version, devices=devices,
                    io_uring=_probe_io_uring(img), img=img, seccomp=seccomp)


def _probe_io_uring(img: str | None) -> bool:
    """Open a file with aio=io_uring through qemu-img: proves both the QEMU build and the kernel."""
    import tempfile

    if img is None:
        return False
    with tempfile.NamedTemporaryFile(prefix="vmlaunch-probe-") as tmp:
        tmp.write(b"\0" * 4096)
        tmp.flush()
        spec = f"driver=file,filename={tmp.name.replace(',', ',,')},aio=io_uring"
        return _run([img, "info", "--image-opts", spec]).returncode == 0


# A flat 64 KiB BIOS (tools/kvm-probe.S): from the reset vector it enters protected mode, then long
# mode with paging, writes through the page tables and writes 0x13 to isa-debug-exit, so QEMU exits
# with status (0x13 << 1) | 1 = 39. A KVM that can only run real-mode code (seen: a paravirtual nested
# KVM) hangs on the way, which a bare `/dev/kvm` open or query-kvm cannot tell.
_PROBE_CODE = bytes.fromhex(
    "fa31c08ed82e660f0116c0000f20c06683c8010f22c066ea1e000f00080066b810008ed88ec08ed0bf00100000"
    "31c0b9000c0000f3abc7050010000003200000c7050020000003300000c70500300000830000000f20e083c820"
    "0f22e0b8001000000f22d8b9800000c00f320d000100000f300f20c00d000000800f22c0ea85000f00180066b8"
    "10008ed848c704250040000034120000b013e6f4f48db400000000000000000000ffff0000009acf00ffff0000"
    "0092cf00ffff0000009aaf001f00a0000f00"
)
_PROBE_RESET = bytes.fromhex("ea000000f0")  # ljmp f000:0000
_PROBE_EXIT = 39


def probe_bios() -> bytes:
    image = bytearray(0x10000)
    image[: len(_PROBE_CODE)] = _PROBE_CODE
    image[0xFFF0 : 0xFFF0 + len(_PROBE_RESET)] = _PROBE_RESET
    return bytes(image)


def _die_with_parent() -> None:
    """In the probe's child: a probe guest that hangs (the case it detects) must not outlive a vmlaunch
    killed while waiting for it; it would spin a host CPU for ever."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def probe_kvm(binary: str, cpu: str = "host") -> KvmStatus:
    """Boot the probe BIOS under KVM with the CPU model vmlaunch would use; see `_PROBE_CODE`."""
    import contextlib
    import signal
    import subprocess
    import tempfile
    import time

    if not os.path.exists("/dev/kvm"):
        return KvmStatus(False, "no /dev/kvm (KVM module not loaded, or not virtualisation-capable)")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return KvmStatus(False, "/dev/kvm is not readable and writable by this user (join group kvm)")
    with tempfile.NamedTemporaryFile(prefix="vmlaunch-kvm-probe-", suffix=".bin") as bios:
        bios.write(probe_bios())
        bios.flush()
        argv = [binary, "-accel", "kvm", "-cpu", cpu, "-machine", "pc", "-m", "16", "-nodefaults",
                "-no-user-config", "-display", "none", "-bios", bios.name,
                "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"]
        start = time.monotonic()
        try:
            # Its own process group: a QEMU behind a wrapper script is killed with the script.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        except OSError as exc:
            return KvmStatus(False, f"could not run {binary}: {exc}")
        try:
            _, stderr = proc.communicate(timeout=KVM_PROBE_TIMEOUT)
        except subprocess.TimeoutExpired:
            return KvmStatus(False, f"/dev/kvm opens, but a test guest did not reach 64-bit mode "
                             f"within {KVM_PROBE_TIMEOUT:g} s (a nested or paravirtual KVM that "
                             "does not run ordinary guests)")
        finally:
            with contextlib.suppress(OSError):  # none left, the usual case
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    elapsed = time.monotonic() - start
    if proc.returncode == _PROBE_EXIT:
        return KvmStatus(True, f"KVM ran a test guest to 64-bit mode in {elapsed:.2f} s")
    lines = [line for line in stderr.splitlines() if "warning" not in line]
    detail = lines[0] if lines else f"exit status {proc.returncode}"
    return KvmStatus(False, f"QEMU could not run a test guest under KVM with -cpu {cpu}: {detail}")
