"""A failed disk write on the project's test guest, with the real QEMU under TCG: a disk with
`on_error = { write = "stop" }` whose next write at one sector fails once (QEMU's blkdebug, put in the
disk's fault slot over QMP, as `vmlaunch fault` will), the guest writing there: the VM pauses in
QEMU's io-error, `status` says it is paused and why (the disk, the operation, QEMU's reason), the lab's
event log has the BLOCK_IO_ERROR, `pause` finds it paused already, and `resume` retries the write,
which then succeeds. After `down`, `logs --events` shows the last run's events."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.api import Lab
from vmlaunch.core.wait import wait_until
from vmlaunch.errors import VmlaunchError

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"
# The guest's data disk is /dev/vda (a direct-boot guest has no image: its first disk is disk0). Its
# write at byte 1 MiB (4 KiB blocks, block 256: sector 2048) is the one that fails, once.
FAULT = {"driver": "blkdebug", "node-name": "disk0-f1", "image": "disk0", "inject-error": [
    {"event": "write_aio", "iotype": "write", "errno": 5, "sector": 2048, "once": True}]}
WRITE = ("sh -c 'printf failing-write > /tmp/block; dd if=/tmp/block of=/dev/vda bs=4096 seek=256 count=1 "
         "conv=sync oflag=direct; echo $? > /tmp/done' >/dev/null 2>&1 &")


@pytest.fixture(scope="module")
def lab(test_guest: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    folder = tmp_path_factory.mktemp("events")
    run_root = Path(tempfile.mkdtemp(prefix="vl-"))
    os.environ["VMLAUNCH_RUN_DIR"] = str(run_root)
    spec = folder / "lab.toml"
    spec.write_text(f"""[lab]
name = "ioerr"
[lab.memory]
ksm = false
[vm.a]
memory = "160M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
[[vm.a.disk]]
file = "d.img"
format = "raw"
size = "16M"
on_error = {{ write = "stop" }}
""")
    lab = Lab(spec, wait_for=READY, timeout=300)
    try:
        lab.up()
        yield lab
    finally:
        lab.down(timeout=0)
        del os.environ["VMLAUNCH_RUN_DIR"]
        os.rmdir(run_root)


def vmlaunch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          timeout=120, check=False, env=os.environ.copy())


def test_a_failed_write_pauses_the_vm_and_resume_retries_it(lab: Lab) -> None:
    a = lab.vm("a")
    spec = str(lab.spec)
    a.qmp("blockdev-add", **FAULT)
    a.qmp("blockdev-reopen", options=[{"driver": "raw", "node-name": "disk0-slot", "file": "disk0-f1",
                                       "read-only": False}])
    # The write runs detached in the guest, but the VM may pause before the agent's reply is out: the
    # command then ends only once the VM runs again, so it is sent from a thread of its own.
    def write() -> None:
        with contextlib.suppress(VmlaunchError):
            a.run(WRITE, timeout=120)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    wait_until(lambda: a.qmp("query-status")["status"] == "io-error", 60, interval=0.2)

    row = lab.status()["a"]
    assert (row.state, row.run_state) == ("paused", "io-error")
    assert row.io_error is not None
    assert (row.io_error.disk, row.io_error.operation, row.io_error.reason, row.io_error.action) == (
        "disk0", "write", "Input/output error", "stop")
    assert row.why == ("by an I/O error: disk0 write failed (Input/output error); `vmlaunch resume SPEC a` "
                       "retries it (`vmlaunch logs SPEC --events` shows each error)")
    shown = vmlaunch("status", spec)
    assert shown.returncode == 0, shown.stderr
    assert "a                paused" in shown.stdout
    assert "  paused: by an I/O error: disk0 write failed (Input/output error);" in shown.stdout
    as_json = vmlaunch("status", spec, "--json")
    assert json.loads(as_json.stdout)["a"]["io_error"]["disk"] == "disk0"

    logged = vmlaunch("logs", spec, "--events")
    assert logged.returncode == 0, logged.stderr
    assert "a BLOCK_IO_ERROR disk0 write: Input/output error (action stop; the VM paused)" in logged.stdout
    errors = [event for event in lab.events("a") if event.event == "BLOCK_IO_ERROR"]
    assert len(errors) == 1 and errors[0].data["node-name"] == "disk0-slot"

    assert lab.pause() == {"a": "already paused"}
    assert lab.resume() == {"a": "resumed (the failed request is retried)"}
    writer.join(120)
    assert a.succeed("while [ ! -e /tmp/done ]; do sleep 0.2; done; cat /tmp/done", timeout=60).strip() == "0"
    assert a.qmp("query-status")["status"] == "running"
    assert lab.status()["a"].io_error is None
    assert a.succeed("dd if=/dev/vda bs=4096 skip=256 count=1 iflag=direct 2>/dev/null | head -c 13",
                     timeout=60) == "failing-write"  # the retried write is on the disk
    names = [event.event for event in lab.events("a")]
    assert "RESUME" in names[names.index("BLOCK_IO_ERROR"):]  # logged as it came


def test_after_down_the_last_runs_events_are_kept(lab: Lab) -> None:
    lab.down()
    logged = vmlaunch("logs", str(lab.spec), "--events", "--json")
    assert logged.returncode == 0, logged.stderr
    names = [json.loads(line)["event"] for line in logged.stdout.splitlines()]
    assert "BLOCK_IO_ERROR" in names and names[-1] == "SHUTDOWN"  # down powered it off
    assert "not up: these are its last run's events" in logged.stderr
