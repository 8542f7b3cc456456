"""vmlaunch's own processes on this host, known by their command lines under the proc root
(`VMLAUNCH_PROC`, else /proc): what `down` and the lab manager look for, and what `doctor` lists when
no lab knows them any more.

- A QEMU vmlaunch started (`compile/compiler.py`): `-pidfile RUN_DIR/V.pid` and
  `-name guest=V,process=vl-V,...`: the pidfile's folder is its lab's run dir.
- A lab manager (`resources/manager.py`): `python -m vmlaunch.manager.managerd RUN_DIR ...`, or
  `-m vmlaunch.manager.manager RUN_DIR` run by hand.

The host side of the command channel runs inside the command that uses it (`exec`, `cp`): vmlaunch
leaves no other process running.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

import attrs

from vmlaunch.core.naming import process_name
from vmlaunch.host.memory import proc_root
from vmlaunch.layout.rundir import RunDir, vm_of_file

# the entry point now, and where it was before the runtime was split into rooms (a manager started by an
# older vmlaunch is still one of ours)
MANAGER_MODULES = ("vmlaunch.manager.managerd", "vmlaunch.manager.manager", "vmlaunch.runtime.managerd",
                   "vmlaunch.runtime.manager")
CMDLINE_MAX = 1 << 20  # a command line longer than this is nobody's vmlaunch


class Kind(enum.Enum):
    QEMU = "QEMU"
    MANAGER = "lab manager"


@attrs.frozen
class OwnProcess:
    """A process of vmlaunch's: which kind, and the run dir (absolute) of the lab it serves."""

    pid: int
    kind: Kind
    run_dir: Path
    vm: str | None = None  # a QEMU's VM

    @property
    def lab(self) -> str:
        return self.run_dir.name

    def describe(self) -> str:
        what = f"QEMU of VM {self.vm}" if self.vm is not None else self.kind.value
        return f"{what} of lab {self.lab} (pid {self.pid})"


def recognise(pid: int, argv: list[str], cwd: Path | None) -> OwnProcess | None:
    """The process `argv` is, when it is one of vmlaunch's; a relative path in it is resolved from
    `cwd` (None: unknown, and the process is not recognised)."""

    def absolute(text: str) -> Path | None:
        path = Path(text)
        if path.is_absolute():
            return Path(os.path.normpath(path))
        return Path(os.path.normpath(cwd / path)) if cwd is not None else None

    for index, word in enumerate(argv[:-2]):
        if word == "-m" and argv[index + 1] in MANAGER_MODULES:
            run_dir = absolute(argv[index + 2])
            return OwnProcess(pid, Kind.MANAGER, run_dir) if run_dir is not None else None
    if "-pidfile" not in argv or "-name" not in argv:
        return None
    pidfile = argv[argv.index("-pidfile") + 1] if argv.index("-pidfile") + 1 < len(argv) else ""
    name = argv[argv.index("-name") + 1] if argv.index("-name") + 1 < len(argv) else ""
    vm = vm_of_file(os.path.basename(pidfile))
    if vm is None or RunDir(Path(pidfile).parent).vm(vm).pidfile.name != os.path.basename(pidfile) \
            or f"process={process_name(vm)}" not in name.split(","):
        return None
    run_dir = absolute(pidfile)
    return OwnProcess(pid, Kind.QEMU, run_dir.parent, vm) if run_dir is not None else None


def read_process(pid: int, proc: Path | None = None) -> OwnProcess | None:
    """The process `pid` when it is one of vmlaunch's (and still runs)."""
    folder = (proc or proc_root()) / str(pid)
    try:
        with open(folder / "cmdline", "rb") as file:
            raw = file.read(CMDLINE_MAX + 1)
    except OSError:
        return None
    if not raw or len(raw) > CMDLINE_MAX:
        return None  # a zombie (no command line), or not ours
    argv = raw.rstrip(b"\0").decode(errors="surrogateescape").split("\0")
    try:
        cwd: Path | None = Path(os.readlink(folder / "cwd"))
    except OSError:
        cwd = None
    return recognise(pid, argv, cwd)


def own_processes(proc: Path | None = None) -> list[OwnProcess]:
    """Every process of vmlaunch's on this host (but this one), by pid."""
    root = proc or proc_root()
    try:
        pids = sorted(int(entry) for entry in os.listdir(root) if entry.isdigit())
    except OSError:
        return []
    found = []
    for pid in pids:
        if pid != os.getpid() and (process := read_process(pid, root)) is not None:
            found.append(process)
    return found


def of_run_dir(run_dir: Path, kind: Kind, proc: Path | None = None) -> list[OwnProcess]:
    """vmlaunch's processes of this kind that serve the lab of `run_dir`."""
    path = Path(os.path.abspath(run_dir))
    return [process for process in own_processes(proc) if process.kind is kind and process.run_dir == path]


def lab_locked(lock: Path) -> bool:
    """Whether an `up` or `down` of a lab holds its lock file `lock` now (tried, never waited for)."""
    from vmlaunch.core.fsutil import try_lock

    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return not try_lock(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
