"""vmlaunch's own processes known by their command lines (host/processes.py), and `doctor`'s list of
those whose lab no command knows (doctor/strays.py), on a fake proc root (`VMLAUNCH_PROC`).
tests/test_manager_gone_real.py has the same with a real manager and QEMU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmlaunch.doctor.findings import Status
from vmlaunch.doctor.strays import check_strays
from vmlaunch.host.processes import Kind, OwnProcess, of_run_dir, own_processes, recognise
from vmlaunch.lab.journal import Entry, Journal, VmEntry
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.manager import ManagerRecord


def qemu_argv(run_dir: Path, vm: str) -> list[str]:
    return ["/usr/bin/qemu-system-x86_64", "-name", f"guest={vm},process=vl-{vm},debug-threads=on",
            "-chardev", f"socket,id=qmp,path={run_dir}/{vm}.qmp,server=on,wait=off",
            "-pidfile", f"{run_dir}/{vm}.pid", "-S"]


def manager_argv(run_dir: str) -> list[str]:
    return ["/usr/bin/python3", "-m", "vmlaunch.manager.managerd", run_dir, "--ready-fd", "6"]


def test_vmlaunchs_processes_are_known_by_their_command_lines(tmp_path: Path) -> None:
    run = tmp_path / "run" / "lab"
    assert recognise(7, qemu_argv(run, "web"), None) == OwnProcess(7, Kind.QEMU, run, "web")
    assert recognise(8, manager_argv(str(run)), None) == OwnProcess(8, Kind.MANAGER, run)
    assert recognise(8, manager_argv("run/lab"), tmp_path) == OwnProcess(8, Kind.MANAGER, run)
    assert recognise(8, manager_argv("run/lab"), None) is None  # relative, and its folder unknown
    assert recognise(9, ["python3", "-m", "vmlaunch.manager.manager", str(run)], None) is not None
    # Not vmlaunch's: a QEMU someone else started, one without vmlaunch's process name, a shell.
    assert recognise(10, ["qemu-system-x86_64", "-pidfile", "/run/x.pid", "-name", "x"], None) is None
    assert recognise(10, [*qemu_argv(run, "web")[:2], "guest=web,process=web", "-pidfile",
                          f"{run}/web.pid"], None) is None
    assert recognise(11, ["bash", "-c", "-m vmlaunch.manager.managerd"], None) is None


def fake_process(proc: Path, pid: int, argv: list[str]) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


@pytest.fixture
def proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    monkeypatch.setenv("VMLAUNCH_PROC", str(root))
    return root


def test_doctor_names_each_process_whose_lab_no_command_knows(tmp_path: Path, proc: Path) -> None:
    known, gone = RunDir(tmp_path / "run" / "known"), RunDir(tmp_path / "run" / "gone")
    known.create()
    journal = Journal(known, spec="/l/lab.toml")
    journal.add(Entry("manager", "lab", None, ManagerRecord(100, 1, str(known.path))))
    journal.vms["a"] = VmEntry(pid=101, started=0.0, accel="tcg")
    journal.save()
    fake_process(proc, 100, manager_argv(str(known.path)))  # the journaled manager and VM a
    fake_process(proc, 101, qemu_argv(known.path, "a"))
    fake_process(proc, 102, manager_argv(str(known.path)))  # a second manager: not the journal's
    fake_process(proc, 103, qemu_argv(known.path, "b"))  # a VM the journal does not have
    fake_process(proc, 104, manager_argv(str(gone.path)))  # their run dir removed
    fake_process(proc, 105, qemu_argv(gone.path, "a"))
    fake_process(proc, 106, ["sleep", "60"])
    fake_process(proc, os.getpid(), manager_argv(str(gone.path)))  # this process: never listed
    assert [p.pid for p in own_processes()] == [100, 101, 102, 103, 104, 105]
    assert [p.pid for p in of_run_dir(known.path, Kind.MANAGER)] == [100, 102]
    found = list(check_strays(proc))
    assert [(f.status, f.fix) for f in found] == [(Status.WARN, f"kill {pid}")
                                                  for pid in (102, 103, 104, 105)]
    assert found[0].found == (f"a lab manager of lab known (pid 102) runs without its lab: the journal of "
                              f"lab known ({known.state}) does not name it")
    assert found[1].found.startswith("a QEMU of VM b of lab known (pid 103) runs without its lab: the "
                                     "journal of lab known")
    assert found[3].found == f"a QEMU of VM a of lab gone (pid 105) runs without its lab: its run dir " \
        f"{gone.path} is gone"
    assert "nothing of a lab outlives it" in found[0].why


def test_a_lab_whose_up_runs_is_not_listed(tmp_path: Path, proc: Path) -> None:
    """An `up` holds the lab's lock while it starts the manager and journals it: not a stray yet."""
    from vmlaunch.lab.journal import locked

    lab = RunDir(tmp_path / "run" / "busy")
    lab.create()
    fake_process(proc, 100, manager_argv(str(lab.path)))
    with locked(lab, 5):
        assert [f.status for f in check_strays(proc)] == [Status.OK]
    assert [f.status for f in check_strays(proc)] == [Status.WARN]
