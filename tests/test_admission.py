"""Boot admission without QEMU: how many VMs boot at once (policy/admission.py), and the waves that
continue them (runtime/waves.py) against fake QMP connections and a fake clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vmlaunch.errors import RuntimeFailure
from vmlaunch.policy.admission import MIN_SHARE, Admission, Booting, admission
from vmlaunch.runtime.waves import ALL_AT_ONCE, Waves


def tcg(name: str, vcpus: int = 1) -> Booting:
    return Booting(name, vcpus, tcg=True)


def kvm(name: str, vcpus: int = 1) -> Booting:
    return Booting(name, vcpus, tcg=False)


@pytest.mark.parametrize(("cpus", "vms", "width"), [
    (2, [tcg(f"v{i}") for i in range(40)], 2),  # a booting TCG vCPU takes a host CPU
    (2, [kvm(f"v{i}") for i in range(40)], 8),  # a KVM one a quarter of one
    (8, [tcg(f"v{i}", 2) for i in range(10)], 4),
    (2, [tcg("big", 4), tcg("small")], 1),  # the cheapest fits alone; the big one boots alone too
    (1, [tcg("a"), tcg("b")], 1),
    (64, [tcg("a"), tcg("b")], 2),  # never wider than the lab
    (0, [tcg("a")], 1),  # a host that does not say its CPUs: one at a time
])
def test_the_width_comes_from_the_host_cpus_and_the_vms(cpus: int, vms: list[Booting], width: int) -> None:
    chosen = admission(cpus, vms)
    assert chosen.width == width
    assert not chosen.asked
    assert f"{cpus} host CPU" in chosen.reason


def test_a_width_asked_for_counts_vms_only() -> None:
    chosen = admission(2, [tcg("a", 8), tcg("b", 8), tcg("c", 8)], asked=2, asked_by="[lab] boot_parallel")
    assert (chosen.width, chosen.asked, chosen.reason) == (2, True, "[lab] boot_parallel 2")
    assert chosen.fits([tcg("a", 8)], tcg("b", 8))
    assert not chosen.fits([tcg("a", 8), tcg("b", 8)], tcg("c", 8))


def test_the_budget_keeps_a_big_vm_waiting_until_it_fits() -> None:
    chosen = admission(2, [tcg("a"), tcg("b"), tcg("big", 2)])
    assert chosen.width == 2
    assert chosen.fits([], tcg("big", 2))  # one VM always boots, however big
    assert not chosen.fits([tcg("a")], tcg("big", 2))
    assert chosen.fits([tcg("a")], tcg("b"))


@pytest.mark.parametrize(("timeout", "count", "share"), [
    (900.0, 40, 45.0), (60.0, 40, MIN_SHARE), (60.0, 2, 60.0)])
def test_a_vm_keeps_its_place_for_its_part_of_the_timeout(timeout: float, count: int, share: float) -> None:
    assert Admission(2, "", 4).share(timeout, count) == share


def test_describe_says_how_many_and_why() -> None:
    chosen = admission(2, [tcg(f"v{i}") for i in range(5)])
    assert chosen.describe(5).startswith("boot: at most 2 of the 5 VMs at once (2 host CPUs; TCG")
    assert admission(2, [tcg("a")]).describe(1).startswith("boot: all 1 VMs at once")


class FakeQmp:
    def __init__(self, name: str, log: list[str], state: str = "running") -> None:
        self.name, self.log, self.state = name, log, state
        self.closed = False

    def cmd(self, command: str, **args: Any) -> Any:
        self.send(command, **args)
        return self.reply(command)

    def send(self, command: str, **args: Any) -> None:
        if command == "cont":
            self.log.append(self.name)

    def reply(self, command: str) -> Any:
        return {"status": self.state}

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> FakeQmp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def waves_of(vms: list[Booting], chosen: Admission, timeout: float = 100.0,
             state: str = "running") -> tuple[Waves, list[str], Clock, dict[str, FakeQmp]]:
    order: list[str] = []
    made: dict[str, FakeQmp] = {}

    def connect(name: str) -> Any:
        made[name] = FakeQmp(name, order, state)
        return made[name]

    clock = Clock()
    waves = Waves.open(vms, connect, chosen, timeout, clock)
    return waves, order, clock, made


def test_the_next_vm_boots_when_one_is_ready() -> None:
    vms = [tcg(f"v{i}") for i in range(5)]
    waves, order, _, made = waves_of(vms, admission(2, vms))
    assert order == ["v0", "v1"] and waves.paused == ["v2", "v3", "v4"]
    assert made["v0"].closed and not made["v2"].closed  # a continued VM's monitor is free for others
    waves.ready("v1")
    assert order == ["v0", "v1", "v2"]
    assert waves.summary(["v0", "v2", "v3", "v4"]) == "1/5 ready; booting v0, v2; 2 waiting to boot"
    waves.finish()
    assert order == ["v0", "v1", "v2", "v3", "v4"] and waves.all_continued
    assert all(qmp.closed for qmp in made.values())


def test_a_vm_that_is_never_ready_gives_its_place_up_after_its_share() -> None:
    vms = [tcg(f"v{i}") for i in range(40)]
    waves, order, clock, _ = waves_of(vms, admission(2, vms), timeout=400.0)
    assert waves.share == 20.0
    clock.now = 19.0
    waves.step()
    assert order == ["v0", "v1"]
    clock.now = 20.0
    waves.step()
    assert order == ["v0", "v1", "v2", "v3"]


def test_all_at_once_continues_every_vm_at_the_start() -> None:
    vms = [tcg(f"v{i}") for i in range(5)]
    waves, order, _, _ = waves_of(vms, Admission(None, "not limited"))
    assert order == [vm.name for vm in vms] and not waves.limited


def test_a_vm_that_does_not_run_after_cont_fails_the_up() -> None:
    with pytest.raises(RuntimeFailure, match="v0: QEMU is inmigrate, not running"):
        waves_of([tcg("v0")], Admission(None, "not limited"), state="inmigrate")


def test_long_lists_of_names_are_cut_short() -> None:
    vms = [tcg(f"v{i:02}") for i in range(12)]
    waves, _, _, _ = waves_of(vms, Admission(8, "", asked=True))
    waiting = [vm.name for vm in vms]
    assert waves.summary(waiting, panicked=["v03"]) == (
        "0/12 ready; booting v00..v07 (8); 4 waiting to boot; v03 panicked")


# --- the boot timeline (lab/timeline.py) ---------------------------------------------------------


def test_the_phases_come_from_the_marks_and_the_kernels_time_stamps(tmp_path: Path) -> None:
    from vmlaunch.lab.timeline import VmBoot, render
    from vmlaunch.layout.rundir import VmFiles

    files = VmFiles(tmp_path, "a")
    boot = VmBoot(files, started=100.0)
    boot.mark("qmp", 100.1)
    boot.mark("continued", 101.0)
    files.firmware_log.write_text("SeaBIOS (version 1.16)\nBooting from ROM...\n")
    boot.observe("", now=101.2)  # a poll finds the firmware done
    console = "[    0.000000] Linux version 6.1\n[    1.500000] Run /init as init process\n"
    boot.observe(console, now=104.0)  # the kernel started at 102.5 at the latest
    boot.observe(console + "[    1.800000] later\n", now=104.2)  # 102.4: a closer bound
    boot.mark("ready", 105.0)
    boot.observe("Cloud-init v. 22.4.2 finished at Thu, 26 Nov 2026. Datasource DataSourceNoCloud. "
                 "Up 41.27 seconds\n", now=105.0)
    phases = boot.phases()
    assert phases == {"qemu": 0.1, "wave": 0.9, "firmware": 0.2, "loader": 1.2, "kernel": 1.5,
                      "userspace": 1.1, "cloud-init": 41.27}
    table = render({"a": phases})
    assert table[0].split() == ["VM", "qemu", "wave", "firmware", "loader", "kernel", "userspace",
                                "cloud-init", "total"]
    assert table[1].startswith("a ")


def test_phases_not_seen_count_in_the_next_one(tmp_path: Path) -> None:
    from vmlaunch.lab.timeline import VmBoot
    from vmlaunch.layout.rundir import VmFiles

    boot = VmBoot(VmFiles(tmp_path, "b"), started=10.0)
    boot.mark("qmp", 10.5)
    boot.mark("ready", 14.0)  # no console time stamps, no firmware log (UEFI, or another OS)
    assert boot.phases() == {"qemu": 0.5, "userspace": 3.5}


def test_vms_without_a_ready_signal_boot_at_once_and_hold_no_place() -> None:
    """`up --wait ssh`: a VM without SSH (a router) never says it is ready: it is continued at once,
    and the VMs that do wait take the places."""
    order: list[str] = []
    vms = [tcg("router"), tcg("h1"), tcg("h2"), tcg("h3")]
    fake: Any = lambda name: FakeQmp(name, order)  # noqa: E731 - QuickQmp's shape, without QEMU
    waves = Waves.open(vms, fake, admission(1, vms[1:]), 600.0, Clock(), free={"router"})
    assert order == ["router", "h1"] and waves.paused == ["h2", "h3"]
    assert waves.share == 200.0  # the timeout shared by the three that wait
    waves.ready("h1")
    assert order == ["router", "h1", "h2"]


def test_with_nothing_to_wait_for_the_rest_go_at_the_deadline() -> None:
    import time as clock

    vms = [tcg(f"v{i}") for i in range(4)]
    waves, order, _, _ = waves_of(vms, Admission(1, "--parallel 1", asked=True), timeout=1000.0)
    waves.wait_until_continued(clock.monotonic() - 1, lambda: None)  # the deadline has passed
    assert order == ["v0"]  # nothing raised: finish() lets the rest go
    waves.finish()
    assert order == ["v0", "v1", "v2", "v3"]


def test_a_qemu_that_died_while_it_waited_is_named() -> None:
    class Dead(FakeQmp):
        def send(self, command: str, **args: Any) -> None:
            if command == "cont" and self.name == "v1":
                raise BrokenPipeError(32, "Broken pipe")
            super().send(command, **args)

    order: list[str] = []
    vms = [tcg("v0"), tcg("v1")]
    dead: Any = lambda name: Dead(name, order)  # noqa: E731
    waves = Waves.open(vms, dead, Admission(1, "", asked=True), 100.0, Clock())
    with pytest.raises(RuntimeFailure, match="v1: its QEMU did not take `cont` when its turn to boot came"):
        waves.ready("v0")


def test_a_wave_is_resumed_with_one_round_trip() -> None:
    """Every VM of a wave is sent `cont` (and `query-status`) before any answer is read: ten paused
    VMs resume together, not each a QMP round trip after the one before (whose guest already boots)."""
    events: list[str] = []

    class Traced(FakeQmp):
        def send(self, command: str, **args: Any) -> None:
            events.append(f"send {command} {self.name}")
            super().send(command, **args)

        def reply(self, command: str) -> Any:
            events.append(f"read {command} {self.name}")
            return super().reply(command)

    vms = [tcg(f"v{i}") for i in range(3)]
    made: dict[str, Traced] = {}

    def connect(name: str) -> Any:
        made[name] = Traced(name, [])
        return made[name]

    waves = Waves.open(vms, connect, ALL_AT_ONCE, 100.0, Clock())
    sends = [event for event in events if event.startswith("send")]
    assert events[:len(sends)] == sends and len(sends) == 6  # all sent, then the answers read
    assert waves.all_continued and all(fake.closed for fake in made.values())
