"""The parts of `runtime/control.py` that need no QEMU: what `status` makes of QEMU's answers and
the console."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from vmlaunch.layout.rundir import RunDir
from vmlaunch.runtime.control import read_balloon, read_run_state, vm_state


class Answers:
    """A QMP connection that answers each command with what the test gives."""

    def __init__(self, **replies: Any) -> None:
        self.replies = replies

    def cmd(self, command: str, **args: Any) -> Any:
        return self.replies[command.replace("-", "_")]


@pytest.mark.parametrize(("reply", "expected"), [
    ({"actual": 128 << 20}, 128 << 20),
    ({}, None),  # a VM whose snapshot job still runs answered without it
    ({"actual": None}, None),
    ({"actual": True}, None),
    ([], None),
])
def test_a_balloon_size_that_cannot_be_read_is_none(reply: object, expected: int | None) -> None:
    assert read_balloon(cast(Any, Answers(query_balloon=reply))) == expected


@pytest.mark.parametrize(("reply", "expected"), [
    ({"status": "paused", "running": False}, "paused"), ({}, None), ("x", None)])
def test_the_run_state(reply: object, expected: str | None) -> None:
    assert read_run_state(cast(Any, Answers(query_status=reply))) == expected


@pytest.mark.parametrize(("console", "run_state", "expected"), [
    ("[ 1.0] Linux version 6.1\nready\n", "running", ("running", None)),
    ("[ 1.0] Linux version 6.1\n[ 9.0] Kernel panic - not syncing: VFS: Unable to mount root fs\n",
     "running", ("guest-panicked", "Kernel panic - not syncing: VFS: Unable to mount root fs")),
    # a panic before a reboot is not the state of the guest that booted after it
    ("Kernel panic - not syncing: x\n[ 0.0] Linux version 6.1\nready\n", "running", ("running", None)),
    ("", "guest-panicked", ("guest-panicked", "QEMU reported a guest panic (pvpanic)")),
    ("", None, ("unresponsive", "its QMP did not answer within 2 s")),
    ("", "paused", ("paused", "by its user (`vmlaunch pause`, or QMP stop), or by a vmlaunch snapshot "
                              "under way: `vmlaunch resume SPEC VM` resumes it")),
    ("", "internal-error", ("internal-error", "QEMU: internal-error")),
    ("", "postmigrate", ("postmigrate", "QEMU: postmigrate")),
])
def test_what_status_says_of_a_running_qemu(tmp_path: Path, console: str, run_state: str | None,
                                            expected: tuple[str, str | None]) -> None:
    run_dir = RunDir(tmp_path / "lab")
    run_dir.create()
    run_dir.vm("a").serial_log.write_text(console)
    assert vm_state(run_dir.vm("a"), run_state) == expected
