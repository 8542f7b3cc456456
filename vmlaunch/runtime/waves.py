"""The VMs of an `up`, continued in waves (`policy/admission.py` says how many boot at once).

Every QEMU starts paused. `Waves` shakes hands with each over QMP first (a guest that already boots
slows down the handshakes still to come), then continues as many as the admission lets boot at once,
and the next one each time a booting VM is ready (its console printed the text `up` waits for, SSH
answers) or has had its share of the time. The waits of `executor.py` tell it which VMs got ready.
A paused VM's QMP connection stays open until its turn (QMP serves one client at a time: once a VM
runs, its monitor is free for `status` and the rest); when each was continued goes to the timeline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence

from vmlaunch.errors import RuntimeFailure
from vmlaunch.lab.timeline import Timeline
from vmlaunch.policy.admission import Admission, Booting
from vmlaunch.qemu.qmp import QmpError, QuickQmp

log = logging.getLogger("vmlaunch")

ALL_AT_ONCE = Admission(None, "not limited")


class Waves:
    """The paused VMs of an `up`: which boot now, which wait for their turn, which are ready."""

    def __init__(self, vms: Sequence[Booting], admission: Admission, share: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.vms = {vm.name: vm for vm in vms}
        self.queue = [vm.name for vm in vms]  # still paused, in the plan's order
        self.booting: dict[str, float] = {}  # name -> when it was continued, while it holds a place
        self.continued: dict[str, float] = {}  # name -> when it was continued (every one, for good)
        self.admission, self.share, self.clock = admission, share, clock
        self.qmps: dict[str, QuickQmp] = {}  # the paused VMs' connections (QMP serves one client)
        self.timeline: Timeline | None = None

    @classmethod
    def open(cls, vms: Sequence[Booting], connect: Callable[[str], QuickQmp], admission: Admission,
             timeout: float, clock: Callable[[], float] = time.monotonic,
             timeline: Timeline | None = None, free: Collection[str] = (),
             share: float | None = None) -> Waves:
        """Shake hands with every VM, continue those `free` of the admission (`up` waits for no ready
        signal of theirs), then the first wave of the others."""
        counted = [vm for vm in vms if vm.name not in free]
        if share is None:
            share = admission.share(timeout, len(counted))
        waves = cls(vms, admission, share, clock)
        waves.timeline = timeline
        try:
            for vm in vms:
                waves.qmps[vm.name] = connect(vm.name)
            freed = [vm.name for vm in vms if vm.name in free]
            for name in freed:
                waves.queue.remove(name)
            waves._cont(freed)
            for name in freed:
                waves.booting.pop(name)  # holds no place
            waves.admit()
        except BaseException:
            waves.close()
            raise
        return waves

    @property
    def limited(self) -> bool:
        return self.admission.width is not None and self.admission.width < len(self.vms)

    def admitted(self, name: str) -> bool:
        return name in self.continued

    @property
    def paused(self) -> list[str]:
        """The VMs still waiting for their turn to boot."""
        return list(self.queue)

    @property
    def all_continued(self) -> bool:
        return not self.queue

    def ready(self, name: str) -> None:
        """`name` reached its ready signal: its place goes to the next VM."""
        self.booting.pop(name, None)
        self.admit()

    def step(self) -> None:
        """A booting VM that had its share of the time gives its place up (it boots on); then the
        next ones are continued."""
        now = self.clock()
        for name, since in list(self.booting.items()):
            if now - since >= self.share:
                log.debug("%s: not ready after its boot share of %.0f s: the next VM boots beside it",
                          name, self.share)
                del self.booting[name]
        self.admit()

    def admit(self) -> None:
        """Continue VMs from the queue while the admission lets them boot beside those booting."""
        wave: list[str] = []
        while self.queue:
            name = self.queue[0]
            booting = [self.vms[other] for other in [*self.booting, *wave]]
            if not self.admission.fits(booting, self.vms[name]):
                break
            wave.append(self.queue.pop(0))
        self._cont(wave)

    def finish(self) -> None:
        """Continue every VM still paused (nothing more to wait for), then let the connections go."""
        wave, self.queue = self.queue, []
        self._cont(wave)
        self.close()

    def _cont(self, names: Sequence[str]) -> None:
        """QMP cont, and each VM must then run (not stay paused on an error, say); their connections
        then go, for `status` and the rest to use. Every command is sent before any answer is read:
        a wave of ten resumes at once, not one round trip after another (each answer waits for a
        QEMU whose guest now boots beside the others)."""
        sent: list[tuple[str, QuickQmp]] = []
        name = ""
        try:
            for name in names:
                qmp = self.qmps.pop(name)
                sent.append((name, qmp))
                qmp.send("cont")
                qmp.send("query-status")
            for name, qmp in sent:
                qmp.reply("cont")
                status = qmp.reply("query-status")
                if status.get("status") != "running":
                    raise RuntimeFailure(f"{name}: QEMU is {status.get('status')}, not running")
                self._continued(name)
        except (OSError, QmpError) as exc:  # its QEMU died while it waited (the OOM killer, a kill)
            raise RuntimeFailure(f"{name}: its QEMU did not take `cont` when its turn to boot came: "
                                 f"{exc}", f"`vmlaunch logs SPEC {name} --qemu` shows what QEMU said "
                                 "(kept after this failed up)") from None
        finally:
            for _, qmp in sent:
                with contextlib.suppress(OSError):
                    qmp.close()

    def _continued(self, name: str) -> None:
        now = self.clock()
        self.continued[name] = now
        self.booting[name] = now
        if self.timeline is not None:
            self.timeline.mark(name, "continued")
        if self.limited:
            log.debug("%s: continued (%d booting, %d waiting to boot)", name, len(self.booting),
                      len(self.queue))

    def close(self) -> None:
        for qmp in self.qmps.values():
            with contextlib.suppress(OSError):
                qmp.close()
        self.qmps.clear()

    def wait_until_continued(self, deadline: float, check: Callable[[], None],
                             interval: float = 0.2) -> None:
        """With nothing to wait for but a width asked for: each VM keeps its place for its share of
        the time, then the next is continued; at the deadline the rest are continued together (there
        is no ready signal to miss). `check` raises for a VM that cannot boot."""
        while self.queue and time.monotonic() < deadline:
            check()
            self.step()
            if self.queue:
                time.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    def summary(self, waiting_for: Sequence[str], *, panicked: Sequence[str] = ()) -> str:
        """One line for the whole lab: "28/40 ready; booting v31..v36; 4 waiting to boot"."""
        count = len(self.vms)
        ready = count - len(waiting_for)
        booting = [name for name in waiting_for if name in self.continued]
        parts = [f"{ready}/{count} ready"]
        if booting:
            parts.append(f"booting {_names(booting)}")
        if self.queue:
            parts.append(f"{len(self.queue)} waiting to boot")
        parts += [f"{name} panicked" for name in panicked]
        return "; ".join(parts)


def _names(names: Sequence[str], most: int = 4) -> str:
    """a, b, c or a..f when long (in the plan's order)."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{names[0]}..{names[-1]} ({len(names)})"
