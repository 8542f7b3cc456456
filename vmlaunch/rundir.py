"""The one owner of a lab's run-dir layout: every file name under it is spelled here and nowhere else.

    run_root/LAB/              the run dir (0700)
        state.json             the journal of what `up` did (`journal.py`)
        V.qmp  V.console       QMP and serial console sockets of VM V
        V.pid  V.stderr.log    QEMU's pidfile and its own messages
        V.serial.log           what the guest printed on its serial console
        V.console.lock         held while a `vmlaunch console` is attached
    run_root/.LAB.lock         serialises `up` and `down` of the lab (beside the run dir: `down`
                               removes the run dir while holding it)
"""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class VmFiles:
    """The files of one VM in its lab's run dir."""

    dir: Path
    name: str

    def _file(self, suffix: str) -> Path:
        return self.dir / f"{self.name}{suffix}"

    @property
    def qmp(self) -> Path:
        return self._file(".qmp")

    @property
    def console(self) -> Path:
        return self._file(".console")

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
    def sockets(self) -> tuple[Path, ...]:
        return (self.qmp, self.console)

    @property
    def stale(self) -> tuple[Path, ...]:
        """What a crashed QEMU leaves that would make the next one fail to bind or be found."""
        return (self.qmp, self.console, self.pidfile)

    @property
    def private(self) -> tuple[Path, ...]:
        """What QEMU creates under its own umask (027) and vmlaunch narrows to the owner."""
        return (self.qmp, self.console, self.serial_log)


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
        return self.path / "state.json"

    @property
    def lock(self) -> Path:
        return self.path.parent / f".{self.path.name}.lock"

    def vm(self, name: str) -> VmFiles:
        return VmFiles(self.path, name)

    def __str__(self) -> str:
        return str(self.path)
