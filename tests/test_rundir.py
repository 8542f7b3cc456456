"""One owner per name: the run dir's file names are spelled in layout/rundir.py only, QMP lives in
qemu/qmp.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vmlaunch.layout.rundir import RunDir

PACKAGE = Path(__file__).resolve().parent.parent / "vmlaunch"
SUFFIXES = (".qmp", ".console", ".pid", ".stderr.log", ".serial.log", ".lock", "state.json")


def sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}


def test_run_dir_names_are_spelled_in_one_module() -> None:
    for name, text in sources().items():
        # the caches' own locks, and the spec's lock file (SPEC.lock, beside the spec: the lab dir's room)
        if name in ("layout/rundir.py", "layout/labdir.py", "guests/images.py", "guests/kernels.py",
                    "saved/template.py"):
            continue
        for suffix in SUFFIXES:
            # a name built from a suffix: f"{name}.qmp", "state.json", ... (not "qemu.qmp", a module)
            built = rf"(\}}|[\"'/]){re.escape(suffix)}[\"']"
            assert not re.search(built, text), (name, suffix)


def test_one_qmp_module() -> None:
    library = ("from qemu.qmp", "import qemu.qmp", "QMPClient")  # QEMU's own QMP package, not ours
    users = {name for name, text in sources().items() if any(word in text for word in library)}
    assert users == {"qemu/qmp.py"}


def test_layout() -> None:
    run_dir = RunDir.of(Path("/run/vmlaunch"), "demo")
    files = run_dir.vm("alpha")
    assert (run_dir.state, run_dir.lock) == (Path("/run/vmlaunch/demo/state.json"),
                                             Path("/run/vmlaunch/.demo.lock"))
    assert [p.name for p in (files.qmp, files.console, files.pidfile, files.serial_log,
                             files.stderr_log, files.console_lock)] == [
        "alpha.qmp", "alpha.console", "alpha.pid", "alpha.serial.log", "alpha.stderr.log",
        "alpha.console.lock"]
    assert run_dir.lab == "demo" and str(run_dir) == "/run/vmlaunch/demo"
    assert run_dir.events == Path("/run/vmlaunch/demo/events.jsonl")


def test_ls_lists_only_labs_that_are_up(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Folders vmlaunch did not make, labs with nothing up and unreadable journals are not labs up."""
    from vmlaunch.runtime.control import labs_up

    (run_dir / "stranger").mkdir()
    (run_dir / "bridges.json").write_text("{}")  # the run root holds files too
    for name, journal in (("empty", '{"version": 2, "spec": null, "resources": [], "vms": {}}'),
                          ("broken", "{")):
        RunDir.of(run_dir, name).create()
        (run_dir / name / "state.json").write_text(journal)
    assert labs_up(run_dir) == []
    assert "broken" in caplog.text
    assert labs_up(run_dir / "missing") == []
