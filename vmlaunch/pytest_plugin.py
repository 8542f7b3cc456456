"""pytest plugin (registered through the `pytest11` entry point): the `vmlaunch_lab` and
`vmlaunch_fresh` fixtures.

    def test_ping(vmlaunch_lab):
        lab = vmlaunch_lab("lab.toml", wait_for="login:")
        lab.vm("alpha").qmp("query-status")

    def test_uname(vmlaunch_fresh):
        vm = vmlaunch_fresh("lab.toml", "alpha")  # a throwaway VM for this test alone (`Lab.fresh`)
        assert vm.succeed("uname -s") == "Linux\n"

A relative spec path is taken from the directory of the test file, wherever pytest runs. Every lab
the fixture brought up is brought down when the test ends, pass or fail.

Evidence: when the test fails (in its setup or its body), each lab's evidence (`Lab.collect`: the
consoles, QEMU's logs, screenshots, `status --json`, the wire state, the lab manager's log, the lab's
event log) is saved before `down` into the test's own `tmp_path`, as `vmlaunch-LAB`; the report names
the folder (a section of the failure, the test's `user_properties`, and a line in the terminal
summary). A passing test saves nothing unless pytest runs with `--vmlaunch-keep`.

Coverage: pytest imports this plugin (an entry point) before coverage starts, so `make test` reports
it as unrun although tests/test_api.py uses the fixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from vmlaunch.api import Lab, Vm

LabFactory = Callable[..., "Lab"]
FreshFactory = Callable[..., "Vm"]
EVIDENCE = "vmlaunch evidence"  # the name of the report section and of the user property
KEEP = "--vmlaunch-keep"
_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
_PACKAGE = str(Path(__file__).resolve().parent) + os.sep  # vmlaunch's own files


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vmlaunch")
    group.addoption(KEEP, action="store_true", default=False,
                    help="save the evidence of every vmlaunch_lab lab (consoles, QEMU logs, screenshots, "
                    "status) for passing tests too; a failing test's is always saved")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item: the fixture's teardown reads whether the test failed.
    A vmlaunch error's traceback is trimmed to the test's own frames before the report is made."""
    if not item.config.getoption("fulltrace"):
        _hide_vmlaunch_frames(call)
    outcome: Any = yield
    report: pytest.TestReport = outcome.get_result()
    item.stash.setdefault(_REPORTS, {})[report.when] = report


def _hide_vmlaunch_frames(call: pytest.CallInfo[None]) -> None:
    """A VmlaunchError says in its message what failed (a guest's command, a lab that would not come
    up): the frames of vmlaunch that raised it are noise in front of that line, so the traceback keeps
    the test's own. Any other exception from vmlaunch is a bug of vmlaunch: its frames stay, as do all
    with `pytest --full-trace`."""
    from vmlaunch.errors import VmlaunchError

    excinfo = call.excinfo
    if excinfo is None or not isinstance(excinfo.value, VmlaunchError):
        return
    # pytest cuts a traceback to the test's frames by walking the raw chain (`tb_next`) again, so the
    # chain itself skips vmlaunch's frames; the first frame is pytest's, never one of them.
    raw: TracebackType | None = excinfo.tb
    while raw is not None:
        following = raw.tb_next
        while following is not None and _in_vmlaunch(following):
            following = following.tb_next
        raw.tb_next = following
        raw = following
    excinfo.traceback = excinfo.traceback.filter(lambda entry: not str(entry.path).startswith(_PACKAGE))


def _in_vmlaunch(raw: TracebackType) -> bool:
    return raw.tb_frame.f_code.co_filename.startswith(_PACKAGE)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """A line per saved evidence folder, after the failures (teardown reports carry them, also from
    pytest-xdist's workers)."""
    saved = [(report.nodeid, value) for reports in terminalreporter.stats.values() for report in reports
             if getattr(report, "when", None) == "teardown"
             for name, value in getattr(report, "user_properties", ()) if name == EVIDENCE]
    if saved:
        terminalreporter.section(EVIDENCE)
        for nodeid, folder in saved:
            terminalreporter.line(f"{nodeid}: {folder}")


@pytest.fixture
def vmlaunch_lab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LabFactory]:
    """`vmlaunch_lab(spec, vms=(), *, wait_for=None, timeout=None, wait_ssh=False)` brings a lab up
    (`Lab.up`) and returns it; a relative `spec` is taken from the test file's directory. When the
    test fails, each lab's evidence is saved into `tmp_path / "vmlaunch-LAB"` before it goes down."""
    from vmlaunch.api import Lab, _locate_spec

    labs: list[Lab] = []
    test_file = request.path

    def start(spec: str | os.PathLike[str], vms: Sequence[str] = (), *, wait_for: str | None = None,
              timeout: float | None = None, wait_ssh: bool = False) -> Lab:
        path = _locate_spec(spec, test_file.parent, f"the directory of the test file, {test_file}")
        lab = Lab(path, vms, wait_for=wait_for, timeout=timeout, wait_ssh=wait_ssh)
        labs.append(lab)
        lab.up()
        return lab

    yield start
    reports = request.node.stash.get(_REPORTS, {})
    failed = [report for report in reports.values() if report.failed]
    if labs and (failed or request.config.getoption(KEEP)):
        _save_evidence(request.node, labs, tmp_path, failed)
    errors = []
    for lab in reversed(labs):
        try:
            lab.down()
        except Exception as exc:  # keep tearing down the others; report all at the end
            errors.append(f"{lab.spec}: {exc}")
    if errors:
        pytest.fail("vmlaunch_lab teardown failed:\n" + "\n".join(errors), pytrace=False)


@pytest.fixture
def vmlaunch_fresh(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FreshFactory]:
    """`vmlaunch_fresh(spec, vm, *, cold=False)`: a throwaway VM made from `vm` of the spec for this test
    alone (`Lab.fresh`: woken from the VM's warm template, made once, unless `cold`), gone when the test
    ends. When the test fails, its evidence is saved into `tmp_path / "vmlaunch-run-..."` first."""
    import contextlib

    from vmlaunch.api import Lab, _locate_spec

    stack = contextlib.ExitStack()
    made: list[Vm] = []
    test_file = request.path

    def fresh(spec: str | os.PathLike[str], vm: str, *, cold: bool = False) -> Vm:
        path = _locate_spec(spec, test_file.parent, f"the directory of the test file, {test_file}")
        one = stack.enter_context(Lab(path, [vm]).fresh(vm, cold=cold))
        made.append(one)
        return one

    with stack:
        yield fresh
        reports = request.node.stash.get(_REPORTS, {})
        failed = [report for report in reports.values() if report.failed]
        if made and (failed or request.config.getoption(KEEP)):
            _save_evidence(request.node, [vm.lab for vm in made], tmp_path, failed)


def _save_evidence(item: pytest.Item, labs: Sequence[Lab], tmp_path: Path,
                   failed: Sequence[pytest.TestReport]) -> None:
    """Each lab's evidence into the test's tmp_path, named in the report; never an error of its own."""
    lines = []
    for lab in labs:
        folder = tmp_path / f"vmlaunch-{lab.name}"
        try:
            lab.collect(folder)
        except Exception as exc:  # the test's own failure is what matters: say why, go on
            lines.append(f"lab {lab.name}: collecting its evidence failed: {exc}")
            continue
        item.user_properties.append((EVIDENCE, str(folder)))
        lines.append(f"lab {lab.name}: {folder} (README.txt lists what is there)")
    for report in failed:
        report.sections.append((EVIDENCE, "\n".join(lines)))
