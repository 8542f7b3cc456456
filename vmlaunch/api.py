"""The Python API for test rigs; the CLI's up/down/status/balloon/qmp, as objects.

    with vmlaunch.Lab("lab.toml") as lab:
        lab.vm("alpha").wait_for_console("ready", timeout=30)
        lab.vm("alpha").balloon(128 << 20)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from vmlaunch import control, executor
from vmlaunch.compiler import compile_lab
from vmlaunch.control import VmStatus
from vmlaunch.errors import RuntimeFailure, VmlaunchError
from vmlaunch.host import detect_host
from vmlaunch.plan import Plan
from vmlaunch.rundir import RunDir
from vmlaunch.spec import load_lab
from vmlaunch.wait import TimedOut, wait_until

log = logging.getLogger("vmlaunch")


class Lab:
    """A lab from its spec. As a context manager: up on enter, down on exit, whatever happened."""

    def __init__(self, spec: str | Path, vms: Sequence[str] = (), *, wait_for: str | None = None,
                 timeout: float = 60.0) -> None:
        self.spec = Path(spec)
        self.model = load_lab(self.spec)
        self.host = detect_host()
        self.plan: Plan = compile_lab(self.model, self.host, vms)
        self.only = tuple(vms)  # empty: the whole lab
        self.wait_for = wait_for
        self.timeout = timeout

    @property
    def run_dir(self) -> RunDir:
        return self.plan.run_dir

    def up(self, wait_for: str | None = None, timeout: float | None = None) -> None:
        executor.up(self.plan, spec=str(self.model.file), qemu_img=self.host.qemu.img,
                    wait_for=wait_for or self.wait_for, timeout=timeout or self.timeout)

    def down(self, timeout: float = 10.0) -> None:
        executor.down(self.run_dir, self.only, timeout=timeout, spec=self.model.file)

    def vm(self, name: str) -> Vm:
        self.model.select([name])
        return Vm(self, name)

    def status(self) -> dict[str, VmStatus]:
        return {row.name: row for row in control.status(self.run_dir, [v.name for v in self.plan.vms])}

    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.down()
        except VmlaunchError as error:
            if exc is None:
                raise
            log.error("taking lab %s down failed: %s", self.model.name, error)  # keep exc visible


class Vm:
    """One VM of a lab that is up."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab = lab
        self.name = name

    @property
    def pid(self) -> int:
        return control.running_pid(self.lab.run_dir, self.name)

    def console_output(self) -> str:
        return control.read_log(self.lab.run_dir, self.name)

    def wait_for_console(self, text: str, timeout: float = 30.0) -> str:
        """Wait until the serial console has printed `text`; return the output so far."""
        def printed() -> str | None:
            output = self.console_output()
            if text in output:
                return output
            self.pid  # noqa: B018 - raises when the VM stopped: no point waiting on
            return None

        try:
            return wait_until(printed, timeout)
        except TimedOut:
            log_file = self.lab.run_dir.vm(self.name).serial_log
            raise RuntimeFailure(f"{self.name}: {text!r} did not appear on the console within "
                                 f"{timeout:g} s", f"see {log_file}") from None

    def balloon(self, size: int | None = None, timeout: float = 10.0) -> int:
        """Set the balloon target in bytes and wait for the guest, or read it; returns the size."""
        return control.balloon(self.lab.run_dir, self.name, size, timeout)

    def qmp(self, command: str, **args: Any) -> Any:
        return control.qmp_command(self.lab.run_dir, self.name, command, args)

    def status(self) -> VmStatus:
        return self.lab.status()[self.name]
