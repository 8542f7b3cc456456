"""The host's memory as the kernel reports it: /proc/meminfo and the KSM counters, through the one
proc root (`VMLAUNCH_PROC`, else /proc) and the one sysfs root (`VMLAUNCH_SYSFS`, else /sys), so
tests can show vmlaunch any host."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_root() -> Path:
    """Where procfs is: `VMLAUNCH_PROC` (tests build a fake tree there), else `/proc`."""
    return Path(os.environ.get("VMLAUNCH_PROC") or "/proc")


@attrs.frozen
class MemInfo:
    total: int  # bytes: MemTotal
    available: int  # bytes: MemAvailable


def ksmd_cpu_seconds() -> float | None:
    """CPU time KSM's kernel thread has used (utime + stime of ksmd), None when there is none."""
    root = proc_root()
    for pid in os.listdir(root):
        if not pid.isdigit():
            continue
        try:
            stat = (root / pid / "stat").read_text()
        except OSError:
            continue
        if stat[stat.find("(") + 1:stat.rfind(")")] == "ksmd":
            fields = stat[stat.rindex(")") + 2:].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def ksm_merging(pid: int) -> int | None:
    """Bytes of the process's memory that KSM has merged (/proc/PID/ksm_merging_pages, Linux 6.1+)."""
    try:
        return int((proc_root() / str(pid) / "ksm_merging_pages").read_text()) * PAGE
    except (OSError, ValueError):
        return None


def meminfo() -> MemInfo | None:
    """MemTotal and MemAvailable, None when /proc/meminfo cannot be read."""
    values: dict[str, int] = {}
    try:
        for line in (proc_root() / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if key in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
                values[key] = int(parts[0]) << 10  # kB
    except OSError:
        return None
    if len(values) < 2:
        return None
    return MemInfo(total=values["MemTotal"], available=values["MemAvailable"])


@attrs.frozen
class KsmCounters:
    run: int  # 0 off, 1 merging, 2 unmerging
    pages_shared: int  # pages KSM keeps, each standing for several
    pages_sharing: int  # the pages that point at them: the pages saved
    pages_unshared: int

    @property
    def saved(self) -> int:
        """Bytes the host does not spend thanks to KSM."""
        return self.pages_sharing * PAGE

    def to_json(self) -> dict[str, int]:
        return {**attrs.asdict(self), "saved": self.saved}


def ksm_dir(sysfs: Path | None = None) -> Path:
    from vmlaunch.host.pci import sysfs_root

    return (sysfs or sysfs_root()) / "kernel" / "mm" / "ksm"


@attrs.frozen
class KsmSupport:
    """What this host's KSM is (`Host.ksm`)."""

    writable: bool  # vmlaunch may change its settings (root)
    advisor: bool  # the kernel adapts the scan rate itself (advisor_mode, Linux 6.7+)


def ksm_support() -> KsmSupport | None:
    """None when the kernel has no KSM."""
    folder = ksm_dir()
    try:
        mode = (folder / "run").stat().st_mode
    except OSError:
        return None
    # Root's alone, whatever a file's mode says (root could write a fake tree's files); and not on a
    # read-only /sys (a container), which the mode does not show
    return KsmSupport(writable=os.geteuid() == 0 and bool(mode & 0o200)
                      and os.access(folder / "run", os.W_OK),
                      advisor=(folder / "advisor_mode").exists())


def ksm_counters() -> KsmCounters | None:
    """The KSM counters, None when the kernel has no KSM (or they cannot be read)."""
    folder = ksm_dir()
    try:
        read = {name: int((folder / name).read_text().split()[0])
                for name in ("run", "pages_shared", "pages_sharing", "pages_unshared")}
    except (OSError, ValueError, IndexError):
        return None
    return KsmCounters(**read)
