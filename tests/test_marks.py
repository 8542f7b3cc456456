"""The suite's own marks stay true (tests/conftest.py): a test that uses the test guest, a lab fixture
or the rig of libvirt hosts without the mark that says so fails, naming the test and the mark, before
its fixtures run; `-m` (and `make test-fast`) select by these marks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).parent / "conftest.py"
MAKEFILE = Path(__file__).parent.parent / "Makefile"
TESTS = '''
import pytest

@pytest.fixture(scope="session")
def test_guest():  # the suite's builds the guest: what matters here is its name
    return "guest"

@pytest.fixture(scope="session")
def libvirt_hosts():
    return "rig"

@pytest.fixture
def booted(test_guest):  # a test's own fixture over the test guest counts too
    return test_guest

def test_unmarked(test_guest):
    pass

def test_unmarked_through_a_fixture(booted):
    pass

@pytest.mark.guest
def test_boots(booted):
    pass

@pytest.mark.guest_files
def test_reads_the_kernel(test_guest):
    pass

@pytest.mark.guest
def test_rig_without_its_mark(libvirt_hosts):
    pass

@pytest.mark.guest
@pytest.mark.libvirt
def test_rig(libvirt_hosts):
    pass

def test_pure():
    pass
'''


def test_a_test_without_the_mark_of_what_it_uses_fails_naming_it(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_x=TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rE")
    result.assert_outcomes(passed=4, errors=3)
    result.stdout.fnmatch_lines_random([
        "*test_x.py::test_unmarked: test_guest needs the mark guest or guest_files (pyproject.toml's *",
        "*test_x.py::test_unmarked_through_a_fixture: test_guest needs the mark guest or guest_files*",
        "*test_x.py::test_rig_without_its_mark: libvirt_hosts needs the mark libvirt*",
    ])


def test_the_marks_select_what_they_say(pytester: pytest.Pytester) -> None:
    """`make test-fast`'s expression leaves out what boots a guest, unless it is marked fast."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_x=TESTS.replace("def test_boots(", "@pytest.mark.fast\ndef test_boots("))
    fast = re.search(r'^test-fast:.*?-m "([^"]+)"', MAKEFILE.read_text(), re.M | re.S)
    assert fast is not None, "the Makefile's test-fast has no -m"
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", fast.group(1), "-v")
    result.stdout.fnmatch_lines_random(["*::test_boots PASSED*", "*::test_reads_the_kernel PASSED*",
                                        "*::test_pure PASSED*"])
    assert "::test_rig PASSED" not in result.stdout.str()


def test_each_tests_cpu_is_written_and_the_costliest_said(pytester: pytest.Pytester,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """VMLAUNCH_TEST_CPU=FILE: a line per test (CPU seconds, wall seconds, the test) and a summary."""
    out = pytester.path / "cpu.tsv"
    monkeypatch.setenv("VMLAUNCH_TEST_CPU", str(out))
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_x="import time\n\ndef test_spins():\n    end = time.monotonic() + 0.3\n"
                               "    while time.monotonic() < end:\n        pass\n\n"
                               "def test_pure():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    assert [row[2] for row in rows] == ["test_x.py::test_spins", "test_x.py::test_pure"]
    assert float(rows[0][0]) >= 0.1 and float(rows[0][1]) >= 0.3  # it spun a core for 0.3 s
    result.stdout.fnmatch_lines(["*the 25 tests that cost the host the most CPU*",
                                 "*cpu in all, over 2 tests*"])


def test_the_modules_started_first_are_the_suites() -> None:
    """LONGEST_FIRST names test modules that exist (a renamed one would silently start last)."""
    from tests.conftest import LONGEST_FIRST

    missing = [name for name in LONGEST_FIRST if not (CONFTEST.parent / f"{name}.py").is_file()]
    assert not missing, missing
