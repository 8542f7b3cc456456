"""The lab manager without QEMU: when the compiler plans it and what it gives it, its settings file,
the guest statistics as QEMU reports them, and the `logs --manager` usage (the manager's rounds run
for real in test_manager_real.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.cli import main
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.core.units import human_size
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.manager import LabManager, ManagedVm, ManagerConfig, read_config, write_config
from vmlaunch.runtime.control import guest_stats
from vmlaunch.spec.load import load_lab

M = 1 << 20
VM = '[vm.{name}]\nmemory = "{memory}"\nkernel = "/k"\n'


def lab_text(*vms: str, memory: str = "") -> str:
    return f'[lab]\nname = "t"\n{memory}' + "".join(vms)


def auto(name: str, memory: str = "512M", minimum: str | None = None) -> str:
    text = VM.format(name=name, memory=memory) + f'[vm.{name}.balloon]\npolicy = "auto"\n'
    return text + (f'min = "{minimum}"\n' if minimum else "")


def test_a_lab_with_an_auto_balloon_gets_a_manager_and_every_vm_its_monitor(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, lab_text(auto("a", minimum="128M"), VM.format(name="b", memory="1G"),
                                         memory='[lab.memory]\nbudget = "1280M"\n'))
    plan = compile_lab(load_lab(spec), fake_host())
    managers = [r for r in plan.resources if isinstance(r, LabManager)]
    assert len(managers) == 1
    assert managers[0].config == ManagerConfig(lab="t", budget_mib=1280, vms=(
        ManagedVm("a", 512, 128, auto=True, balloon=True),
        ManagedVm("b", 1024, 1024, auto=False, balloon=True)))
    for vm in plan.vms:
        assert f"path={plan.run_dir.vm(vm.name).manager_qmp},server=on,wait=off" in " ".join(vm.argv)
        assert "chardev=manager,mode=control" in vm.argv
    # `up b` alone still starts the manager, which watches every VM of the lab
    only_b = compile_lab(load_lab(spec), fake_host(), ["b"])
    assert [r for r in only_b.resources if isinstance(r, LabManager)] == managers


def test_the_default_budget_is_80_percent_of_the_host_and_min_a_quarter(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, lab_text(auto("a", memory="1G")))
    plan = compile_lab(load_lab(spec), fake_host(memory_mib=10000))
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    assert manager.config.budget_mib == 8000
    assert manager.config.vms == (ManagedVm("a", 1024, 256, auto=True, balloon=True),)
    assert '"deflate-on-oom":true' in " ".join(plan.vms[0].argv)  # on with auto, unless said otherwise


def test_a_lab_without_an_auto_balloon_has_a_manager_for_its_event_log(tmp_path: Path) -> None:
    """Every lab records its events: its manager runs, on every VM's own monitor, and sizes nothing."""
    spec = write_spec(tmp_path, lab_text(VM.format(name="a", memory="512M")))
    plan = compile_lab(load_lab(spec), fake_host())
    (manager,) = [r for r in plan.resources if isinstance(r, LabManager)]
    assert manager.config.vms == (ManagedVm("a", 512, 512, auto=False, balloon=True),)
    assert not manager.config.balance
    assert manager.describe().startswith("lab manager: the lab's event log (events.jsonl) (log: ")
    assert "chardev=manager,mode=control" in plan.vms[0].argv
    assert '"deflate-on-oom":false' in " ".join(plan.vms[0].argv)
    # its memory is weighed as before: the manager holds no budget over VMs it does not size
    big = write_spec(tmp_path, lab_text(VM.format(name="a", memory="9G")))
    notes = compile_lab(load_lab(big), fake_host(memory_mib=10000)).notes
    assert any(note.startswith("VM a asks for 9G (9216 MiB) of memory") for note in notes), notes


def test_ksm_false_keeps_the_labs_memory_from_being_merged(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, lab_text(VM.format(name="a", memory="512M"),
                                         memory="[lab.memory]\nksm = false\n"))
    machine = compile_lab(load_lab(spec), fake_host()).vms[0].argv
    assert "mem-merge=off" in machine[machine.index("-machine") + 1]


def test_the_settings_file_round_trips_and_refuses_what_up_did_not_write(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    config = ManagerConfig(lab="t", budget_mib=640, vms=(ManagedVm("a", 256, 96, True, True),))
    write_config(run_dir, config)
    assert read_config(run_dir) == config
    run_dir.manager_config.write_text(json.dumps({"lab": "t", "vms": [{"name": "a"}]}))
    with pytest.raises(ValueError, match="not a lab manager config"):
        read_config(run_dir)


@pytest.mark.parametrize(("reply", "expected"), [
    ({"stats": {"stat-free-memory": 5 * M}, "last-update": 0}, {}),  # before the guest's first report
    ({"stats": {"stat-free-memory": 5 * M, "stat-swap-in": 2**64 - 1}, "last-update": 17},
     {"stat-free-memory": 5 * M}),  # (uint64) -1: not reported
    ({"stats": "nonsense", "last-update": 17}, {}),
    (None, {}),
])
def test_guest_stats(reply: object, expected: dict[str, int]) -> None:
    assert guest_stats(reply) == expected


@pytest.mark.parametrize(("size", "shown"), [(0, "0M"), (1000, "<1M"), (123456789, "118M"),
                                             (1 << 30, "1G"), (15 << 30, "15.0G")])
def test_human_size(size: int, shown: str) -> None:
    assert human_size(size) == shown


@pytest.mark.parametrize(("argv", "message"), [
    (["a", "--manager"], "no VM and no --qemu"),
    (["--manager", "--qemu"], "no VM and no --qemu"),
    ([], "name a VM, or --manager"),
])
def test_logs_usage(tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                    message: str) -> None:
    spec = write_spec(tmp_path, lab_text(auto("a")))
    assert main(["logs", str(spec), *argv]) == 64  # a usage error
    assert message in capsys.readouterr().err


def test_logs_of_a_lab_whose_manager_never_ran(tmp_path: Path, run_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, lab_text(auto("a")))
    assert main(["logs", str(spec), "--manager"]) == 4
    assert "has no lab manager log" in capsys.readouterr().err


def test_notes_weigh_the_budget_when_a_manager_keeps_to_it(tmp_path: Path) -> None:
    over = write_spec(tmp_path, lab_text(auto("a", memory="8G"), memory='[lab.memory]\nbudget = "9G"\n'))
    notes = compile_lab(load_lab(over), fake_host(memory_mib=10240)).notes
    assert ("the lab's memory budget, 9G (9216 MiB), is more than 80% of the host's 10G (10240 MiB): the "
            "host may swap, which hurts every guest") in notes
    fits = write_spec(tmp_path, lab_text(auto("a", memory="16G"), memory='[lab.memory]\nbudget = "6G"\n'),
                      name="fits.toml")
    assert compile_lab(load_lab(fits), fake_host(memory_mib=10240)).notes == ()  # 16G over-committed
    floors = write_spec(tmp_path, lab_text(auto("a", memory="16G", minimum="9G")), name="floors.toml")
    assert any("holds them at their minimums" in note
               for note in compile_lab(load_lab(floors), fake_host(memory_mib=10240)).notes)


def test_a_manager_missing_from_its_journal_stops_itself(tmp_path: Path) -> None:
    """Started by an `up` killed before it journaled the manager (or taken out of the journal): nothing
    would stop it, so once no `up` holds the lab's lock (the grace period) it stops itself; one that is
    journaled goes on."""
    import asyncio

    from vmlaunch.lab.journal import Entry, Journal, locked
    from vmlaunch.manager.manager import ORPHAN_AFTER, Manager
    from vmlaunch.resources.manager import ManagerRecord

    run_dir = RunDir(tmp_path / "t")
    run_dir.create()
    write_config(run_dir, ManagerConfig(lab="t", budget_mib=640, vms=()))

    async def rounds(journaled: bool) -> bool:
        manager = Manager(run_dir)
        if journaled:
            journal = Journal(run_dir, spec="/l/lab.toml")
            journal.add(Entry("manager", "lab", None, ManagerRecord(os.getpid(), 1, str(run_dir.path))))
        with locked(run_dir, 5):  # the `up` that started it, still under way
            await manager.round()
        assert not manager.stopping.is_set()  # in its grace period
        manager.started -= ORPHAN_AFTER + 1
        await manager.round()
        return manager.stopping.is_set()

    assert asyncio.run(rounds(journaled=True)) is False
    run_dir.state.unlink()
    assert asyncio.run(rounds(journaled=False)) is True


def test_the_manager_notes_a_guests_floor_when_its_balloon_stops_short(tmp_path: Path) -> None:
    """A balloon that gave some of the way to a lower target and then stopped for a round, or a guest
    whose console says it ran out of pages ("Out of puff") or of memory: the floor the policy then
    keeps it over. One that has not moved yet (its driver is still loading) has shown no floor."""
    from typing import Any, cast

    from vmlaunch.manager.manager import Manager, Watched

    run_dir = RunDir(tmp_path / "t")
    run_dir.create()
    log = run_dir.vm("a").serial_log
    log.write_text("[    1.0] booted\n")
    manager = Manager(run_dir)

    def watched() -> Watched:
        vm = Watched("a", 1, cast(Any, None), target=64 * M, console_seen=log.stat().st_size)
        vm.set_from = 128 * M
        return vm

    vm = watched()
    for actual in (128 * M, 128 * M, 100 * M):  # not moved yet, then on its way
        manager.observe_floor(vm, actual)
        assert vm.floor is None
    manager.observe_floor(vm, 77 * M)
    assert vm.floor is None
    manager.observe_floor(vm, 77 * M)  # a round without a move, still short
    assert vm.floor == 77 * M
    vm = watched()
    with log.open("a") as f:
        f.write("[    9.9] virtio_balloon virtio0: Out of puff! Can't get 1 pages\n")
    manager.observe_floor(vm, 90 * M)
    assert vm.floor == 90 * M
    vm = watched()
    manager.observe_floor(vm, 90 * M)  # the same console line is not read twice
    assert vm.floor is None
    vm.target = 100 * M
    manager.observe_floor(vm, 100 * M)  # at its target: no floor to see
    manager.observe_floor(vm, 100 * M)
    assert vm.floor is None


@pytest.mark.parametrize("loss", ["settings", "journal", "run dir", "run dir made anew"])
def test_a_manager_whose_lab_is_gone_stops_and_says_why(tmp_path: Path, loss: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Whatever of its lab goes first (issue 48): a round that finds it gone stops the manager, and
    its log says why."""
    import asyncio
    import shutil

    from vmlaunch.lab.journal import Entry, Journal, VmEntry
    from vmlaunch.manager.manager import Manager
    from vmlaunch.resources.manager import ManagerRecord

    run_dir = RunDir(tmp_path / "t")
    run_dir.create()
    write_config(run_dir, ManagerConfig(lab="t", budget_mib=640, vms=()))
    journal = Journal(run_dir, spec="/l/lab.toml")
    journal.add(Entry("manager", "lab", None, ManagerRecord(os.getpid(), 1, str(run_dir.path))))
    journal.vms["a"] = VmEntry(pid=None, started=0.0, accel="tcg")  # still starting: nothing to watch
    journal.save()

    async def rounds() -> tuple[bool, bool]:
        manager = Manager(run_dir)
        await manager.round()
        first = manager.stopping.is_set()
        if loss == "settings":
            run_dir.manager_config.unlink()
        elif loss == "journal":
            run_dir.state.unlink()
        else:
            shutil.rmtree(run_dir.path)
            if loss == "run dir made anew":
                run_dir.create()
                write_config(run_dir, ManagerConfig(lab="t", budget_mib=640, vms=()))
        await manager.round()
        return first, manager.stopping.is_set()

    caplog.set_level("INFO", "vmlaunch.manager.manager")
    assert asyncio.run(rounds()) == (False, True)
    said = {"settings": f"its settings {run_dir.manager_config} are gone",
            "journal": f"the lab's journal {run_dir.state} is gone",
            "run dir": f"its run dir {run_dir.path} is gone",
            # (another run's journal, or none; the file system may give the new one the same inode)
            "run dir made anew": f"its run dir {run_dir.path} was removed (the one there now is another "
                                 "run's)"}
    stops = ": nothing of the lab is left to manage, so the lab manager stops"
    assert f"{said[loss]}{stops}" in caplog.text or (
        loss == "run dir made anew" and f"{said['journal']}{stops}" in caplog.text)


def test_a_manager_of_a_lab_without_vms_stops_after_the_grace_period(tmp_path: Path) -> None:
    """Journaled, but no VM in the journal and no QEMU of the lab running, and no `up` under way
    (an `up` killed before its VMs were journaled, never taken down): nothing to manage."""
    import asyncio

    from vmlaunch.lab.journal import Entry, Journal
    from vmlaunch.manager.manager import ORPHAN_AFTER, Manager
    from vmlaunch.resources.manager import ManagerRecord

    run_dir = RunDir(tmp_path / "t")
    run_dir.create()
    write_config(run_dir, ManagerConfig(lab="t", budget_mib=640, vms=()))
    Journal(run_dir, spec="/l/lab.toml").add(
        Entry("manager", "lab", None, ManagerRecord(os.getpid(), 1, str(run_dir.path))))

    async def rounds() -> tuple[bool, bool]:
        manager = Manager(run_dir)
        await manager.round()
        first = manager.stopping.is_set()
        assert manager.idle_since is not None
        manager.idle_since -= ORPHAN_AFTER + 1
        await manager.round()
        return first, manager.stopping.is_set()

    assert asyncio.run(rounds()) == (False, True)


def test_a_manager_started_by_up_waits_for_it_to_finish_at_most_its_head_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` starts the manager detached and goes on; the manager loads its modules once the `up` lets
    the lab's lock go (not on a CPU the QEMUs starting need), or after UP_HEAD_START at the latest."""
    import fcntl
    import time

    from vmlaunch.manager import managerd

    run_dir = RunDir(tmp_path / "lab")
    run_dir.lock.write_text("")
    monkeypatch.setattr(managerd, "UP_HEAD_START", 0.3)
    start = time.monotonic()
    managerd._after_up(run_dir.path)  # nobody holds the lock: at once
    assert time.monotonic() - start < 0.2
    with open(run_dir.lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # an `up` under way
        start = time.monotonic()
        managerd._after_up(run_dir.path)
        assert time.monotonic() - start >= 0.3
    managerd._after_up(tmp_path / "gone")  # no lock file at all: at once


def test_a_quiet_labs_manager_runs_a_full_round_only_when_the_lab_changes(tmp_path: Path) -> None:
    """Nothing to size or balance, no `up` under way, no VM starting: the next full round waits for a
    change of the journal or the settings, or IDLE_EVERY; while there is work, one each interval.
    Rounds, not time: `due` is asked at chosen instants."""
    import asyncio
    import time

    import attrs

    from vmlaunch.lab.journal import Entry, Journal, VmEntry, locked
    from vmlaunch.manager.manager import IDLE_EVERY, Manager
    from vmlaunch.resources.manager import ManagerRecord

    run_dir = RunDir(tmp_path / "t")
    run_dir.create()
    config = ManagerConfig(lab="t", budget_mib=640, vms=(ManagedVm("a", 128, 128, auto=False, balloon=True),))
    write_config(run_dir, config)
    journal = Journal(run_dir, spec="/l/lab.toml")
    journal.add(Entry("manager", "lab", None, ManagerRecord(os.getpid(), 1, str(run_dir.path))))
    journal.vms["a"] = VmEntry(pid=None, started=0.0, accel="tcg")  # still starting
    journal.save()

    async def rounds() -> None:
        manager = Manager(run_dir)
        now = time.monotonic()
        assert manager.due(now)
        await manager.full_round(now)
        assert not manager.quiet and manager.due(now + 1)  # a VM starting: rounds go on
        journal.vms["a"] = VmEntry(pid=2 ** 22 + 1, started=0.0, accel="tcg")  # started (and gone)
        journal.save()
        assert manager.due(now + 1)
        await manager.full_round(now + 1)
        assert manager.quiet
        assert not manager.due(now + 2) and not manager.due(now + IDLE_EVERY)
        assert manager.due(now + 1 + IDLE_EVERY)  # at the latest
        write_config(run_dir, attrs.evolve(config, budget_mib=512))  # an `up` of the lab: at once
        assert manager.due(now + 2)
        with locked(run_dir, 5):  # an `up` under way: every interval
            await manager.full_round(now + 2)
        assert not manager.quiet and manager.due(now + 3)
        await manager.full_round(now + 3)
        assert manager.quiet and not manager.due(now + 4)
        manager.quiet = False  # an event heard (the listener's doing): its repeats wait for a round
        assert manager.due(now + 4)

    asyncio.run(rounds())


def test_a_steady_auto_balloon_reports_less_often_and_its_size_comes_from_events(tmp_path: Path) -> None:
    """An auto balloon the policy left where it is for SETTLE rounds, not moving, on a host whose
    available memory holds: its statistics come every STEADY_STATS seconds and are read only once the
    guest can have sent newer ones; any change brings it back to each round. Its actual size is asked
    once, then kept from BALLOON_CHANGE. Rounds, not time: a stub monitor records what is asked."""
    import asyncio
    import time
    from typing import Any, cast

    from vmlaunch.manager.manager import SETTLE, STEADY_STATS, Manager, Watched, stats_due
    from vmlaunch.policy.balloon import Host

    class Monitor:
        def __init__(self) -> None:
            self.asked: list[tuple[str, dict[str, Any]]] = []
            self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            self.dropped_events = 0

        async def cmd(self, command: str, **args: Any) -> Any:
            self.asked.append((command, args))
            if command == "query-balloon":
                return {"actual": 128 * M}
            if command == "qom-get":
                return {"last-update": int(time.time()), "stats": {"stat-available-memory": 100 * M}}
            return {}

        async def next_event(self) -> dict[str, Any]:
            return await self.events.get()

        async def close(self) -> None:
            pass

    run_dir = RunDir(tmp_path / "t")
    run_dir.create()
    vm = ManagedVm("a", 128, 64, auto=True, balloon=True)

    async def rounds() -> None:
        manager = Manager(run_dir)
        monitor = Monitor()
        watched = Watched("a", 1, cast(Any, monitor), period=1)
        watched.listener = asyncio.create_task(manager.listen(watched))
        manager.watched["a"] = watched
        host = Host(total=1024 * M, available=512 * M)

        def asked(command: str) -> int:
            return sum(1 for name, _ in monitor.asked if name == command)

        def periods() -> list[int]:
            return [args["value"] for name, args in monitor.asked if name == "qom-set"]

        for _ in range(SETTLE + 1):  # its first round is its first sight: not yet still
            await manager.sample(vm)
            await manager.pace([vm], set(), host)
        assert asked("query-balloon") == 1 and asked("qom-get") == SETTLE + 1  # each round while settling
        assert periods() == [STEADY_STATS] and watched.period == STEADY_STATS
        before = asked("qom-get")
        for _ in range(3):  # the guest sent none newer since: not asked
            await manager.sample(vm)
            await manager.pace([vm], set(), host)
        assert asked("qom-get") == before and periods() == [STEADY_STATS]
        await monitor.events.put({"event": "BALLOON_CHANGE", "data": {"actual": 120 * M}})
        await asyncio.sleep(0)
        assert watched.actual == 120 * M  # from the event, not asked
        guest = await manager.sample(vm)
        assert guest is not None and guest.actual == 120 * M and asked("query-balloon") == 1
        await manager.pace([vm], set(), host)  # it moved: each round again
        assert periods() == [STEADY_STATS, 1] and watched.still == 0
        await manager.sample(vm)
        assert asked("qom-get") == before + 1
        for _ in range(SETTLE + 1):
            await manager.pace([vm], set(), host)
        assert periods()[-1] == STEADY_STATS
        await manager.pace([vm], {"a"}, host)  # the policy set it a target
        assert periods()[-1] == 1
        for _ in range(SETTLE):
            await manager.pace([vm], set(), host)
        await manager.pace([vm], set(), Host(total=1024 * M, available=400 * M))  # the host moved
        assert periods()[-1] == 1
        await watched.close()

    asyncio.run(rounds())
    # When newer statistics can be there: each round at a period of one round; else a period after
    # their last update (whole seconds), never later than a period from now.
    now = time.monotonic()
    assert stats_due({"last-update": int(time.time())}, 1, 1.0) <= time.monotonic()
    assert now + 4 < stats_due({"last-update": int(time.time())}, 5, 1.0) <= time.monotonic() + 5
    assert stats_due({"last-update": int(time.time()) - 4}, 5, 1.0) <= time.monotonic() + 2
    assert now + 4.9 < stats_due({"last-update": 0}, 5, 1.0)
    assert stats_due({"last-update": int(time.time()) - 60}, 5, 1.0) <= time.monotonic() + 0.5


def test_a_busy_labs_rounds_read_the_journal_and_settings_only_when_they_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round of a lab with work needs the VMs that run: the journal is read again only when it
    changed (or one of the QEMUs it named ended), and the settings only when they changed."""
    import subprocess
    import sys
    from typing import Any

    from vmlaunch.lab.journal import Entry, Journal, VmEntry
    from vmlaunch.manager.manager import Manager
    from vmlaunch.qemu.opts import escape
    from vmlaunch.resources import manager as settings
    from vmlaunch.resources.manager import ManagerRecord

    run_dir = RunDir(tmp_path / "t")
    run_dir.create()
    write_config(run_dir, ManagerConfig(lab="t", budget_mib=640, vms=(ManagedVm("a", 128, 64, auto=True,
                                                                                  balloon=True),)))
    qmp = escape(str(run_dir.vm("a").qmp))
    qemu = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"path={qmp},"])
    try:
        journal = Journal(run_dir, spec="/l/lab.toml")
        journal.add(Entry("manager", "lab", None, ManagerRecord(os.getpid(), 1, str(run_dir.path))))
        journal.vms["a"] = VmEntry(pid=qemu.pid, started=0.0, accel="tcg")
        journal.save()
        loads: list[int] = []
        reads: list[int] = []
        real_load, real_read = Journal.load, settings.read_config
        def load(*args: Any, **kwargs: Any) -> Any:
            loads.append(1)
            return real_load(*args, **kwargs)

        def read(*args: Any, **kwargs: Any) -> Any:
            reads.append(1)
            return real_read(*args, **kwargs)

        monkeypatch.setattr(Journal, "load", load)
        monkeypatch.setattr("vmlaunch.manager.manager.read_config", read)
        manager = Manager(run_dir)
        manager.lab_busy = False
        for _ in range(3):
            manager.config = manager._read_config()
            assert manager._running() == {"a": qemu.pid}
        assert len(loads) == 1 and len(reads) == 1
        journal.save()  # an `up` or `down` of the lab: read again
        write_config(run_dir, ManagerConfig(lab="t", budget_mib=512, vms=()))
        manager.config = manager._read_config()
        assert manager._running() == {"a": qemu.pid}
        assert manager.config is not None and manager.config.budget_mib == 512
        assert len(loads) == 2 and len(reads) == 2
        qemu.kill()
        qemu.wait()
        assert manager._running() == {} and len(loads) == 3  # its QEMU ended: the journal is read
    finally:
        qemu.kill()
        qemu.wait()
