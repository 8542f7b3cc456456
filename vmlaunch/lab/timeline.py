"""Where a VM's boot time goes, as the host can see it: `up --timeline`, `status --json`'s `boot`.

The phases, each the seconds from the end of the one before:
- `qemu`: QEMU started, until its QMP answered;
- `wave`: waiting paused for its turn to boot (`policy/admission.py`);
- `firmware`: SeaBIOS, until it hands over (it logs to the isa-debugcon port, 0x402, which the
  compiler gives every SeaBIOS VM: `Booting from ROM...` with a direct-boot kernel, `Booting from
  Hard Disk...` from a disk); OVMF logs nothing there, so under UEFI this phase is part of the next;
- `loader`: the boot loader and the kernel's own decompressor, until the kernel starts (the instant
  its printk clock counts from, found from the time stamps of its console lines);
- `kernel`: the kernel's start-up, until it runs the first program (`Run /init as init process`);
- `userspace`: from there to the ready signal `up` waited for (a console text, SSH);
- `cloud-init`: for a guest whose cloud-init printed its `finished at ... Up N seconds` line, the
  guest's uptime when cloud-init finished (the guest's own figure, not a phase of the others).

The waits read each VM's console as they poll it (`observe`): what a host sees when it reads a log
every fifth of a second is good to a fifth of a second; the kernel's own instants come from its time
stamps, and are finer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence

from vmlaunch.lab import process
from vmlaunch.layout.rundir import VmFiles

PHASES = ("qemu", "wave", "firmware", "loader", "kernel", "userspace")
CLOUD_INIT = "cloud-init"

_STAMPED = re.compile(r"^\[\s*(\d+\.\d+)\] (.*)$", re.M)
_USERSPACE = re.compile(r"Run \S+ as init process|Freeing unused kernel (image )?memory")
_FIRMWARE_DONE = ("Booting from ",)
_CLOUD_INIT_DONE = re.compile(r"Cloud-init v\. \S+ finished at .*?Up (\d+(?:\.\d+)?) seconds")


class VmBoot:
    """What was seen of one VM's boot, in host wall-clock seconds."""

    def __init__(self, files: VmFiles, started: float) -> None:
        self.files = files
        self.marks: dict[str, float] = {"started": started}
        self.kernel_zero: float | None = None  # the host time the kernel's printk clock counts from
        self.userspace_stamp: float | None = None  # the kernel's time stamp of its first program
        self.cloud_init: float | None = None

    def mark(self, what: str, when: float | None = None) -> None:
        self.marks.setdefault(what, time.time() if when is None else when)

    def observe(self, console: str, now: float | None = None) -> None:
        """Read what the console (and the firmware's log) say by now."""
        now = time.time() if now is None else now
        if "firmware" not in self.marks:
            firmware = process.read_text(self.files.firmware_log, tail=16 << 10)
            if any(done in firmware for done in _FIRMWARE_DONE):
                self.mark("firmware", now)
        stamps = list(_STAMPED.finditer(console))
        if stamps:
            last = float(stamps[-1].group(1))
            zero = now - last  # no later than the truth: the line was printed by now
            self.kernel_zero = zero if self.kernel_zero is None else min(self.kernel_zero, zero)
            if self.userspace_stamp is None:
                for match in stamps:
                    if _USERSPACE.search(match.group(2)):
                        self.userspace_stamp = float(match.group(1))
                        break
        if self.cloud_init is None:
            found = _CLOUD_INIT_DONE.search(console)
            if found:
                self.cloud_init = float(found.group(1))

    def phases(self) -> dict[str, float]:
        """Each phase seen, in seconds (rounded to the hundredth); phases not seen are left out (and
        their time counts in the next one seen)."""
        firmware = self.marks.get("firmware")
        if firmware is not None and self.kernel_zero is not None:  # a poll saw it late: not after the
            firmware = min(firmware, self.kernel_zero)  # kernel it handed over to had started
        points: list[tuple[str, float | None]] = [
            ("qemu", self.marks.get("qmp")),
            ("wave", self.marks.get("continued")),
            ("firmware", firmware),
            ("loader", self.kernel_zero),
            ("kernel", None if self.kernel_zero is None or self.userspace_stamp is None
             else self.kernel_zero + self.userspace_stamp),
            ("userspace", self.marks.get("ready")),
        ]
        found: dict[str, float] = {}
        before = self.marks["started"]
        for name, when in points:
            if when is None:
                continue
            found[name] = round(max(0.0, when - before), 2)
            before = max(before, when)
        if self.cloud_init is not None:
            found[CLOUD_INIT] = round(self.cloud_init, 2)
        return found


class Timeline:
    """The boots of an `up`'s VMs."""

    def __init__(self, vms: Mapping[str, tuple[VmFiles, float]]) -> None:
        self.vms = {name: VmBoot(files, started) for name, (files, started) in vms.items()}

    def mark(self, name: str, what: str, when: float | None = None) -> None:
        if name in self.vms:
            self.vms[name].mark(what, when)

    def observe(self, name: str, console: str) -> None:
        if name in self.vms:
            self.vms[name].observe(console)

    def phases(self) -> dict[str, dict[str, float]]:
        return {name: boot.phases() for name, boot in self.vms.items()}


def render(phases: Mapping[str, Mapping[str, float]], order: Iterable[str] | None = None) -> list[str]:
    """The table `up --timeline` prints: a row per VM, a column per phase, and the total."""
    names = list(order) if order is not None else sorted(phases)
    columns: Sequence[str] = [*PHASES, CLOUD_INIT] if any(CLOUD_INIT in p for p in phases.values()) \
        else PHASES
    width = max([4, *(len(name) for name in names)])
    lines = [f"{'VM':<{width}} " + " ".join(f"{column:>9}" for column in columns) + f" {'total':>7}"]
    for name in names:
        row = phases.get(name, {})
        total = sum(value for key, value in row.items() if key in PHASES)
        cells = " ".join(f"{row[column]:>8.2f}s" if column in row else f"{'-':>9}" for column in columns)
        lines.append(f"{name:<{width}} {cells} {total:>6.2f}s")
    return lines
