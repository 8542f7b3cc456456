"""The one owner of a lab's run-dir layout: every file name under it is spelled here and nowhere else.

    run_root/LAB/              the run dir (0700)
        .vmlaunch-run-dir      vmlaunch's mark: only a run dir that has it is ever removed
        state.json             the journal of what `up` did (`lab/journal.py`)
        V.qmp  V.console       QMP and serial console sockets of VM V
        V.agent  V.qga         the command channel (vmlaunch's agent, QEMU's guest agent) of VM V
        V.manager.qmp          the lab manager's own QMP monitor of VM V
        V.pid                  QEMU's pidfile
        V.stderr.log           QEMU's messages while it starts (before it opens V.qemu.log)
        V.qemu.log             QEMU's messages from then on (-D), kept by `down` (`layout/lastrun.py`)
        V.serial.log           what the guest printed on its serial console
        V.console.lock         held while a `vmlaunch console` is attached
        manager.log            what the lab manager did and why (`manager/manager.py`), kept by `down`
        manager.json           the lab manager's settings, written by `up` (`resources/manager.py`)
        manager.state.json     what the lab manager saw and set last, read by `status`
        events.jsonl           the lab's event log: what QEMU reported of each VM (an I/O error, a
                               pause, a panic, ...) as the lab manager heard it, and what vmlaunch
                               did to a VM at runtime (a disk fault), one JSON object a line
                               (`lab/events.py`), kept by `down`
        wire.json  wire.lock   faults on the wire set at runtime: link states, netem, partitions
        disk-faults.json       faults on the VMs' disks set at runtime (`rig/diskfault.py`)
        forks.json             the clones `vmlaunch fork` made, members of the lab until they go
                               down, and a fork under way (`runtime/fork.py`)
        fork.state             the state of the VM a fork is copying (RAM and devices), while it does
        fork.mem               the RAM clones of a `fork --shared-memory` map copy-on-write, until
                               they have (then removed: their mappings keep it)
    run_root/.LAB.lock         serialises `up` and `down` of the lab (beside the run dir: `down`
                               removes the run dir while holding it)
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

import attrs

from vmlaunch.core.fsutil import is_temp_of
from vmlaunch.errors import RuntimeFailure

MARK = ".vmlaunch-run-dir"
STATE = "state.json"
VM_SUFFIXES = (".qmp", ".manager.qmp", ".console", ".agent", ".qga", ".agent.lock", ".console.lock",
               ".serial.log", ".pid", ".stderr.log", ".qemu.log", ".firmware.log")
MANAGER_LOG = "manager.log"
MANAGER_CONFIG = "manager.json"
MANAGER_STATE = "manager.state.json"
WIRE = "wire.json"  # faults on the wire set at runtime (lab/wire.py)
WIRE_LOCK = "wire.lock"
DISK_FAULTS = "disk-faults.json"  # faults on the disks set at runtime (rig/diskfault.py)
INTENT = "intent.json"  # an operation on the running lab under way, or interrupted (saved/intent.py)
EVENTS = "events.jsonl"  # the lab's event log (lab/events.py)
FORKS = "forks.json"  # the lab's clones, and a fork under way (runtime/fork.py)
FORK_STATE = "fork.state"  # a forked VM's saved state, while the fork copies it
FORK_MEMORY = "fork.mem"  # the RAM the clones of `fork --shared-memory` map, while they start
HOSTS_UP = "hosts-up"  # an `up` on libvirt hosts under way, or killed half-way (multihost/engine.py)
LAB_FILES = (MANAGER_LOG, MANAGER_CONFIG, MANAGER_STATE, INTENT, WIRE, WIRE_LOCK, DISK_FAULTS, EVENTS,
             FORKS, FORK_STATE, FORK_MEMORY, HOSTS_UP)
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def open_in_run_dir(path: Path, flags: int, mode: int = 0o600) -> int:
    """os.open that never follows a symlink: nothing in a run dir is one, so a link found there was
    planted, and root must not create, truncate or read a file through it."""
    try:
        return os.open(path, flags | NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise RuntimeFailure(f"refusing to open {path}: it is a symlink, and vmlaunch never makes "
                                 "one there", "remove it; someone may have planted it") from None
        raise


def vm_of_file(name: str) -> str | None:
    """The VM whose file of the run dir this is (by its suffix: `a.manager.qmp` is VM a's), None for
    a file that is no VM's."""
    for suffix in sorted(VM_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return None


@attrs.frozen
class VmFiles:
    """The files of one VM in its lab's run dir."""

    dir: Path
    name: str

    def _file(self, suffix: str) -> Path:
        assert suffix in VM_SUFFIXES
        return self.dir / f"{self.name}{suffix}"

    @property
    def qmp(self) -> Path:
        return self._file(".qmp")

    @property
    def manager_qmp(self) -> Path:
        """A second QMP monitor for the lab manager: the first one stays free for users."""
        return self._file(".manager.qmp")

    @property
    def console(self) -> Path:
        return self._file(".console")

    @property
    def agent(self) -> Path:
        """The command channel to vmlaunch's own agent in the guest (virtio-serial port
        org.vmlaunch.agent.0): root in the guest to whoever can open it, hence 0600 like QMP."""
        return self._file(".agent")

    @property
    def qga(self) -> Path:
        """The command channel to QEMU's guest agent, where the guest runs one (virtio-serial port
        org.qemu.guest_agent.0)."""
        return self._file(".qga")

    @property
    def agent_lock(self) -> Path:
        """Held while one command uses the channel: a channel serves one client at a time."""
        return self._file(".agent.lock")

    @property
    def console_lock(self) -> Path:
        return self._file(".console.lock")

    @property
    def serial_log(self) -> Path:
        return self._file(".serial.log")

    @property
    def pidfile(self) -> Path:
        return self._file(".pid")

    @property
    def stderr_log(self) -> Path:
        return self._file(".stderr.log")

    @property
    def qemu_log(self) -> Path:
        return self._file(".qemu.log")

    @property
    def firmware_log(self) -> Path:
        """What SeaBIOS writes to its debug port (isa-debugcon 0x402), for the boot timeline."""
        return self._file(".firmware.log")

    @property
    def sockets(self) -> tuple[Path, ...]:
        return (self.qmp, self.manager_qmp, self.console, self.agent, self.qga)

    @property
    def every(self) -> tuple[Path, ...]:
        return tuple(self._file(suffix) for suffix in VM_SUFFIXES)

    @property
    def stale(self) -> tuple[Path, ...]:
        """What a crashed QEMU leaves that would make the next one fail to bind or be found."""
        return (self.qmp, self.manager_qmp, self.console, self.agent, self.qga, self.pidfile)

    @property
    def private(self) -> tuple[Path, ...]:
        """What QEMU creates under its own umask (027) and vmlaunch narrows to the owner."""
        return (self.qmp, self.manager_qmp, self.console, self.agent, self.qga, self.serial_log,
                self.qemu_log, self.firmware_log)


@attrs.frozen
class RunDir:
    """A lab's run dir: `root/LAB`."""

    path: Path

    @classmethod
    def of(cls, root: Path, lab: str) -> RunDir:
        return cls(root / lab)

    @property
    def lab(self) -> str:
        return self.path.name

    @property
    def state(self) -> Path:
        return self.path / STATE

    @property
    def mark(self) -> Path:
        return self.path / MARK

    @property
    def manager_log(self) -> Path:
        return self.path / MANAGER_LOG

    @property
    def manager_config(self) -> Path:
        return self.path / MANAGER_CONFIG

    @property
    def manager_state(self) -> Path:
        return self.path / MANAGER_STATE

    @property
    def wire(self) -> Path:
        return self.path / WIRE

    @property
    def wire_lock(self) -> Path:
        return self.path / WIRE_LOCK

    @property
    def disk_faults(self) -> Path:
        return self.path / DISK_FAULTS

    @property
    def forks(self) -> Path:
        return self.path / FORKS

    @property
    def hosts_up(self) -> Path:
        return self.path / HOSTS_UP

    @property
    def fork_state(self) -> Path:
        return self.path / FORK_STATE

    @property
    def fork_memory(self) -> Path:
        return self.path / FORK_MEMORY

    @property
    def intent(self) -> Path:
        return self.path / INTENT

    @property
    def events(self) -> Path:
        """The lab's event log: JSON lines, appended to (O_APPEND, one write a line) by the lab manager
        and by vmlaunch's runtime commands alike."""
        return self.path / EVENTS

    def secure(self, *, create: bool = False) -> bool:
        """Check the run root and this run dir against the ownership rule (`dirs.secure_dir`); with
        `create`, make what is missing. Returns whether the run dir exists."""
        from vmlaunch.layout.dirs import secure_dir

        return secure_dir(self.path, top=self.path.parent, create=create)

    def create(self) -> None:
        """Make the run dir (0700, marked as vmlaunch's), or check the one there is vmlaunch's."""
        existed = self.path.exists()
        self.secure(create=True)
        if existed and not self.marked():
            raise RuntimeFailure(f"{self.path} exists and was not made by vmlaunch (it has no "
                                 f"{MARK} mark), so lab {self.lab} cannot use it",
                                 "move it away, or give the lab another name")
        os.chmod(self.path, 0o700)
        if not existed:
            fd = open_in_run_dir(self.mark, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            with os.fdopen(fd, "w") as out:
                out.write(f"vmlaunch run dir of lab {self.lab}\n")

    def marked(self) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.mark).st_mode)
        except FileNotFoundError:
            return False

    def remove(self, vms: Iterable[str] = ()) -> str | None:
        """Remove the run dir if it is vmlaunch's (marked) and holds only what vmlaunch puts there
        (the journal, the files of the VMs named); else leave it and return why. Files are removed
        one by one, never through a link."""
        known = {MARK, STATE, *LAB_FILES} | {f"{vm}{suffix}" for vm in vms for suffix in VM_SUFFIXES}
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"it cannot be opened ({exc.strerror})"
        try:
            names = os.listdir(fd)
            if MARK not in names:
                return f"it has no {MARK} mark, so vmlaunch did not make it"
            temps = (STATE, MANAGER_CONFIG, MANAGER_STATE, INTENT, FORKS)  # what write_atomic writes
            strangers = [n for n in names if not (n in known or any(is_temp_of(n, f) for f in temps))
                         or stat.S_ISDIR(os.lstat(n, dir_fd=fd).st_mode)]
            if strangers:
                return f"it holds what vmlaunch did not put there: {', '.join(sorted(strangers)[:5])}"
            for name in names:
                if name != MARK:
                    os.unlink(name, dir_fd=fd)
            os.unlink(MARK, dir_fd=fd)  # last: a removal cut short leaves a run dir still marked
        except OSError as exc:
            return f"it could not be emptied ({exc.strerror})"
        finally:
            os.close(fd)
        try:
            os.rmdir(self.path)
        except OSError as exc:
            return f"it could not be removed ({exc.strerror})"
        return None

    @property
    def lock(self) -> Path:
        return self.path.parent / f".{self.path.name}.lock"

    def vm(self, name: str) -> VmFiles:
        return VmFiles(self.path, name)

    def __str__(self) -> str:
        return str(self.path)

