"""The Python API for test rigs; the CLI's up/down/status/balloon/qmp, as objects.

    with vmlaunch.Lab("lab.toml") as lab:
        lab.vm("alpha").wait_for_console("ready", timeout=30)
        lab.vm("alpha").balloon(128 << 20)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from vmlaunch import control, executor
from vmlaunch.compiler import compile_lab
from vmlaunch.control import VmStatus
from vmlaunch.errors import RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.host import detect_host
from vmlaunch.plan import Plan
from vmlaunch.spec import load_lab

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
    def run_dir(self) -> Path:
        return self.plan.run_dir

    def up(self, wait_for: str | None = None, timeout: float | None = None) -> None:
        executor.up(self.plan, spec=self.model.file, qemu_img=self.host.qemu.img,
                    wait_for=wait_for or self.wait_for, timeout=timeout or self.timeout, say=log.info)

    def down(self, timeout: float = 10.0) -> None:
        executor.down(self.run_dir, self.only, timeout=timeout, say=log.info)

    def vm(self, name: str) -> Vm:
        if name not in {vm.name for vm in self.plan.vms}:
            raise UsageError(f"{self.spec}: no VM named {name!r} in this lab")
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
        deadline = time.monotonic() + timeout
        while True:
            output = self.console_output()
            if text in output:
                return output
            if time.monotonic() >= deadline:
                raise RuntimeFailure(f"{self.name}: {text!r} did not appear on the console within "
                                     f"{timeout:g} s", f"see {self.lab.run_dir / self.name}.serial.log")
            self.pid  # noqa: B018 - raises when the VM stopped: no point waiting on
            time.sleep(0.1)

    def balloon(self, size: int | None = None, timeout: float = 10.0) -> int:
        """Set the balloon target in bytes and wait for the guest, or read it; returns the size."""
        return control.balloon(self.lab.run_dir, self.name, size, timeout)

    def qmp(self, command: str, **args: Any) -> Any:
        return control.qmp_command(self.lab.run_dir, self.name, command, args)

    def status(self) -> VmStatus:
        return self.lab.status()[self.name]
