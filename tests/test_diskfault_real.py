"""Disk faults on the project's test guest (busybox, vmlaunch's agent), with the real QEMU under TCG:
errors at a sector of a raw and of a qcow2 disk (guest offsets both), a write that pauses the VM and
is retried by `resume`, held writes and their release, a slow disk, faults from the spec, the API's
context managers, bad input, and a `down` with a held request. One lab for the module, which the
`rig` fixture brings up for each test (the events test takes it down); the guest reads and writes
with O_DIRECT, so each request reaches the disk."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.api import Lab
from vmlaunch.core.wait import wait_until
from vmlaunch.errors import EXIT_HOST, EXIT_USAGE, GuestPaused, UsageError, VmlaunchError

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"
BLOCK = 4096  # the guest reads and writes whole 4 KiB blocks: sector 8*K+j is in block K


@pytest.fixture(scope="module")
def shared(test_guest: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    import tempfile

    folder = tmp_path_factory.mktemp("faults")
    run_root = Path(tempfile.mkdtemp(prefix="vl-"))
    os.environ["VMLAUNCH_RUN_DIR"] = str(run_root)
    spec = folder / "lab.toml"
    spec.write_text(f"""[lab]
name = "faults"
[lab.memory]
ksm = false
[vm.a]
memory = "160M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
[[vm.a.disk]]
file = "raw.img"
format = "raw"
size = "16M"
on_error = {{ write = "stop" }}
[[vm.a.disk]]
file = "data.qcow2"
size = "16M"
[[vm.a.disk]]
file = "spec.qcow2"
size = "8M"
[[vm.a.disk.fault]]
type = "error"
read = true
sector = 80
[[vm.a.disk.fault]]
type = "error"
read = true
sector = 800
once = true
errno = "EROFS"
""")
    lab = Lab(spec, wait_for=READY, timeout=300)
    try:
        lab.up()
        yield lab
    finally:
        lab.down(timeout=5)
        del os.environ["VMLAUNCH_RUN_DIR"]
        for leftover in run_root.iterdir():
            pytest.fail(f"left in the run root: {leftover}")
        os.rmdir(run_root)


@pytest.fixture
def rig(shared: Lab) -> Lab:
    """The module's lab, up: booted again where a test took it down (each test takes off the faults
    it set, and the spec's are the test's that spends them)."""
    if not shared.run_dir.path.exists():
        shared.up()
    return shared


def vmlaunch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          timeout=120, check=False, env=os.environ.copy())


def read_block(lab: Lab, device: str, block: int) -> int:
    """The exit status of the guest's direct read of one block."""
    return lab.vm("a").run(f"dd if=/dev/{device} of=/dev/null bs={BLOCK} skip={block} count=1 "
                           "iflag=direct", timeout=60).exit_code


def test_an_error_at_a_sector_fails_reads_there_only_and_clear_heals(rig: Lab) -> None:
    spec = str(rig.spec)
    for disk, device in (("disk0", "vda"), ("disk1", "vdb")):  # raw, then qcow2: guest offsets both
        set_ = vmlaunch("fault", spec, "a", disk, "error", "--read", "--sector", "1000")
        assert set_.returncode == 0, set_.stderr
        assert read_block(rig, device, 1000 // 8) != 0
        assert read_block(rig, device, 1000 // 8 - 1) == 0 and read_block(rig, device, 1000 // 8 + 1) == 0
        assert rig.vm("a").run(f"dd if=/dev/zero of=/dev/{device} bs={BLOCK} seek=125 count=1 "
                               "oflag=direct").exit_code == 0  # a read fault: writes there go on
        listed = json.loads(vmlaunch("fault", spec, "--json").stdout)
        assert listed["a"][disk] == [{"type": "error", "op": "read", "sector": 1000, "once": False,
                                      "errno": "EIO"}]
        cleared = vmlaunch("fault", spec, "a", disk, "clear")
        assert cleared.returncode == 0 and "cleared" in cleared.stdout
        assert read_block(rig, device, 1000 // 8) == 0
    assert "disk0" not in vmlaunch("fault", spec).stdout


def test_failed_flushes_fail_fsync_and_clear_like_the_rest(rig: Lab) -> None:
    """A flush error is armed by every flush: taking it off (or changing the disk's rules) needs the
    node disarmed first, which `clear` and a new fault do."""
    vm, disk = rig.vm("a"), rig.vm("a").disk("disk1")
    fsync = "dd if=/dev/zero of=/dev/vdb bs=4096 seek=3 count=1 conv=fsync"
    with disk.fail("flush"):
        assert vm.run(fsync).exit_code != 0
        assert vm.run("dd if=/dev/zero of=/dev/vdb bs=4096 seek=3 count=1 oflag=direct").exit_code == 0
        disk.fail("read", sector=800)  # a new set of rules, over a node whose flush rule is armed
        assert read_block(rig, "vdb", 100) != 0 and vm.run(fsync).exit_code != 0
    assert vm.run(fsync).exit_code == 0 and read_block(rig, "vdb", 100) == 0
    with pytest.raises(UsageError, match="no sector"):
        disk.fail("flush", sector=8)


def test_a_fault_from_the_spec_is_there_from_the_start(rig: Lab) -> None:
    disk = rig.vm("a").disk("disk2")
    assert read_block(rig, "vdc", 10) != 0 and read_block(rig, "vdc", 11) == 0
    assert disk.faults() == [{"type": "error", "op": "read", "sector": 80, "once": False, "errno": "EIO"},
                             {"type": "error", "op": "read", "sector": 800, "once": True, "errno": "EROFS"}]
    assert read_block(rig, "vdc", 100) != 0 and read_block(rig, "vdc", 100) == 0  # once, from the spec too
    wait_until(lambda: len(disk.faults()) == 1, 30, interval=0.2)  # seen to fire: not set again
    disk.fail("read", sector=8)
    assert read_block(rig, "vdc", 100) == 0 and read_block(rig, "vdc", 1) != 0
    rig.vm("a").disk(2).clear()
    assert read_block(rig, "vdc", 10) == 0


def at_the_disk(lab: Lab, device: str) -> None:
    """Once the guest has a request out at `device` (its in-flight count in /proc/diskstats), a moment
    in which one that is not held would end."""
    lab.vm("a").succeed(f"while [ \"$(awk '$3 == \"{device}\" {{print $12}}' /proc/diskstats)\" = 0 ]; "
                        "do sleep 0.05; done", timeout=30)
    time.sleep(0.5)


WRITE = ("sh -c 'printf failing-write > /tmp/block; dd if=/tmp/block of=/dev/vda bs=4096 seek=256 count=1 "
         "conv=sync oflag=direct; echo $? > /tmp/done' >/dev/null 2>&1 &")


def test_a_failed_write_pauses_the_vm_and_resume_retries_it(rig: Lab) -> None:
    """disk0 has on_error.write = "stop": its write at sector 2048 (block 256) fails once; the VM pauses
    in QEMU's io-error, `status` says why, the event log has the error, `resume` retries the write."""
    a, spec = rig.vm("a"), str(rig.spec)
    earlier = len(rig.events("a"))  # those of other tests
    disk = a.disk("disk0").fail("write", sector=2048 + 5, once=True)

    # The write runs detached in the guest, but the VM may pause before the agent's reply is out: the
    # command then ends with GuestPaused (test_a_command_whose_vm_an_io_error_pauses_ends_at_once).
    def write() -> None:
        with contextlib.suppress(VmlaunchError):
            a.run(WRITE, timeout=120)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    wait_until(lambda: a.qmp("query-status")["status"] == "io-error", 60, interval=0.2)

    row = rig.status()["a"]
    assert (row.state, row.run_state) == ("paused", "io-error")
    assert row.io_error is not None
    assert (row.io_error.disk, row.io_error.operation, row.io_error.reason, row.io_error.action) == (
        "disk0", "write", "Input/output error", "stop")
    assert row.why == ("by an I/O error: disk0 write failed (Input/output error); `vmlaunch resume SPEC a` "
                       "retries it (`vmlaunch logs SPEC --events` shows each error)")
    shown = vmlaunch("status", spec)
    assert "  paused: by an I/O error: disk0 write failed (Input/output error);" in shown.stdout
    assert json.loads(vmlaunch("status", spec, "--json").stdout)["a"]["io_error"]["disk"] == "disk0"

    logged = vmlaunch("logs", spec, "--events")
    assert logged.returncode == 0, logged.stderr
    assert "a BLOCK_IO_ERROR disk0 write: Input/output error (action stop; the VM paused)" in logged.stdout
    assert "a VMLAUNCH_DISK_FAULT disk0 disk fault set error write at sector 2053, once, EIO" in logged.stdout
    errors = [event for event in rig.events("a")[earlier:] if event.event == "BLOCK_IO_ERROR"
              and event.disk == "disk0" and event.data["operation"] == "write"]  # (earlier faults')
    assert len(errors) == 1 and errors[0].data["node-name"] == "disk0-slot"

    assert rig.pause() == {"a": "already paused"}
    resumed = vmlaunch("resume", spec, "a")
    assert resumed.returncode == 0 and "resumed (the failed request is retried)" in resumed.stdout, resumed
    writer.join(120)
    assert a.succeed("while [ ! -e /tmp/done ]; do sleep 0.2; done; cat /tmp/done", timeout=60).strip() == "0"
    assert rig.status()["a"].io_error is None
    assert a.succeed("dd if=/dev/vda bs=4096 skip=256 count=1 iflag=direct 2>/dev/null | head -c 13",
                     timeout=60) == "failing-write"  # the retried write is on the disk
    names = [event.event for event in rig.events("a")[earlier:]]
    assert "RESUME" in names[names.index("BLOCK_IO_ERROR"):]  # logged as it came
    assert disk.faults() == []  # the once error fired: it is gone, and no longer keeps a hang away
    with a.disk("disk1").hang("read"):
        assert [fault["type"] for fault in a.disk("disk1").faults()] == ["hang"]
    disk.clear()


def test_a_command_whose_vm_an_io_error_pauses_ends_at_once(rig: Lab) -> None:
    """A guest frozen by a failed request answers nothing until it is resumed: `run` says so within
    seconds (a test waiting for the reply could never resume it), and the channel serves the next
    command once the VM runs again."""
    a = rig.vm("a")
    a.disk("disk0").fail("write", sector=3000, once=True)
    started = time.monotonic()
    with pytest.raises(GuestPaused, match="a is paused by an I/O error .disk0 write failed") as caught:
        a.run("dd if=/dev/urandom of=/dev/vda bs=4096 seek=375 count=1 oflag=direct", timeout=120)
    assert time.monotonic() - started < 60 and "was sent, and its result is lost" in caught.value.message
    assert caught.value.exit_code == 5
    refused = vmlaunch("exec", str(rig.spec), "a", "--", "true")  # not even sent
    assert refused.returncode == 5 and "was not sent" in refused.stderr, refused.stderr
    assert vmlaunch("resume", str(rig.spec), "a").returncode == 0
    assert a.succeed("echo back", timeout=60).strip() == "back"
    assert a.disk("disk0").faults() == []


def test_held_writes_wait_for_release_while_reads_go_on(rig: Lab) -> None:
    spec, vm = str(rig.spec), rig.vm("a")
    of_spec = vm.disk("disk2").faults()  # the spec's, unless the test that spends them ran
    assert vmlaunch("fault", spec, "a", "disk1", "hang", "--write").returncode == 0
    twice = vmlaunch("fault", spec, "a", "disk1", "hang", "--write")
    assert twice.returncode == EXIT_USAGE and "holds its writes already" in twice.stderr
    vm.run("rm -f /tmp/w1 /tmp/w2; (dd if=/dev/zero of=/dev/vdb bs=4096 seek=30 count=1 oflag=direct; "
           "touch /tmp/w1; dd if=/dev/zero of=/dev/vdb bs=4096 seek=40 count=1 oflag=direct; touch /tmp/w2)"
           " >/dev/null 2>&1 &")
    at_the_disk(rig, "vdb")
    assert read_block(rig, "vdb", 3) == 0  # reads are not held
    assert vm.run("test -e /tmp/w1").exit_code != 0  # the first write is held
    refused = vmlaunch("fault", spec, "a", "disk1", "error", "--read")
    assert refused.returncode == EXIT_USAGE and "release" in refused.stderr
    not_paused = vmlaunch("pause", spec, "a")  # QMP stop would wait for the held write
    assert not_paused.returncode != 0 and "a hang holds the requests of a disk1" in not_paused.stderr, \
        not_paused.stderr
    status = json.loads(vmlaunch("status", spec, "--json").stdout)["a"]
    assert status["state"] == "running"
    assert [disk["faults"] for disk in status["disks"]] == [[], [{"type": "hang", "op": "write"}], of_spec]
    assert "disk1 fault: hang write" in vmlaunch("status", spec).stdout
    released = vmlaunch("fault", spec, "a", "disk1", "release")
    assert released.returncode == 0, released.stderr
    vm.wait_until_succeeds("test -e /tmp/w1 && test -e /tmp/w2", timeout=30)  # and every later one
    again = vmlaunch("fault", spec, "a", "disk1", "release")
    assert again.returncode == EXIT_USAGE and "nothing is held" in again.stderr


def test_reads_and_writes_held_together_are_let_go_together(rig: Lab) -> None:
    """A second hang set while a request is held, and a release of both: none of it waits for the held
    request (each goes through the device's own backend). An error that would pause the VM is refused
    while requests are held (QEMU pauses only once every request is done), and the other way round."""
    spec, vm = str(rig.spec), rig.vm("a")
    assert vmlaunch("fault", spec, "a", "disk1", "hang", "--write").returncode == 0
    vm.run("rm -f /tmp/h1; (dd if=/dev/zero of=/dev/vdb bs=4096 seek=50 count=1 oflag=direct; touch /tmp/h1)"
           " >/dev/null 2>&1 &")
    at_the_disk(rig, "vdb")
    second = vmlaunch("fault", spec, "a", "disk01", "hang", "--read")  # disk01: disk1, said so
    assert second.returncode == 0 and second.stdout.startswith("a disk1: "), second
    pausing = vmlaunch("fault", spec, "a", "disk0", "error", "--write")  # disk0: on_error.write = "stop"
    assert pausing.returncode == EXIT_USAGE and "holds requests" in pausing.stderr, pausing.stderr
    released = vmlaunch("fault", spec, "a", "disk1", "release")
    assert released.returncode == 0 and "reads and writes" in released.stdout, released
    vm.wait_until_succeeds("test -e /tmp/h1", timeout=30)
    assert vmlaunch("fault", spec, "a", "disk0", "error", "--write", "--sector", "4000").returncode == 0
    refused = vmlaunch("fault", spec, "a", "disk1", "hang", "--write")
    assert refused.returncode == EXIT_USAGE and "pauses the VM when it fires" in refused.stderr, refused
    assert vmlaunch("fault", spec, "a", "disk0", "clear").returncode == 0


def test_a_once_error_that_fired_is_not_armed_again(rig: Lab) -> None:
    vm, disk = rig.vm("a"), rig.vm("a").disk("disk1")
    write = "dd if=/dev/zero of=/dev/vdb bs=4096 seek=20 count=1 oflag=direct"
    with disk.fail("write", sector=160, once=True):
        assert vm.run(write).exit_code != 0 and vm.run(write).exit_code == 0
        wait_until(lambda: disk.faults() == [], 30, interval=0.1)  # the lab manager logs the error
        disk.fail("read", sector=900)  # a new set of rules: without the spent one
        assert vm.run(write).exit_code == 0
        assert [fault["op"] for fault in disk.faults()] == ["read"]


def test_once_errors_are_told_apart_by_their_errno(rig: Lab) -> None:
    """QEMU reports which operation failed and with which errno, not which rule: a second error that
    would be reported as a --once one is refused, and one of another errno keeps its own count."""
    spec, disk = str(rig.spec), rig.vm("a").disk("disk1")
    with disk.fail("read", sector=80, once=True):
        alike = vmlaunch("fault", spec, "a", "disk1", "error", "--read", "--sector", "160")
        assert alike.returncode == EXIT_USAGE and "same errno" in alike.stderr, alike.stderr
        disk.fail("read", sector=160, once=True, errno="EROFS")
        assert read_block(rig, "vdb", 10) != 0 and read_block(rig, "vdb", 10) == 0
        wait_until(lambda: len(disk.faults()) == 1, 30, interval=0.2)  # the lab manager logs the error
        assert disk.faults() == [{"type": "error", "op": "read", "sector": 160, "once": True,
                                  "errno": "EROFS"}]
        disk.fail("read", sector=800)  # new rules: the EROFS one has not fired, it stays armed
        assert read_block(rig, "vdb", 20) != 0 and read_block(rig, "vdb", 20) == 0
        assert read_block(rig, "vdb", 100) != 0 and read_block(rig, "vdb", 10) == 0
        # a once error in place of another of the same requests: only its own failure spends it
        disk.fail("read", sector=160, errno="ENOSPC")
        assert read_block(rig, "vdb", 20) != 0 and read_block(rig, "vdb", 20) != 0
        disk.fail("read", sector=160, errno="ENOSPC", once=True)
        assert read_block(rig, "vdb", 20) != 0 and read_block(rig, "vdb", 20) == 0


def test_faults_follow_the_disks_qemu_was_started_with(rig: Lab) -> None:
    """A spec edited since `up` does not change what a fault is checked against: disk0's on_error
    (write = "stop") is QEMU's, so a hang is still refused beside an error that pauses; another spec
    file of the lab's name is refused."""
    spec = Path(rig.spec)
    text = spec.read_text()
    other = spec.with_name("other.toml")
    other.write_text(text)
    try:
        spec.write_text(text.replace('on_error = { write = "stop" }\n', "", 1))
        stop = vmlaunch("fault", str(spec), "a", "disk0", "error", "--write", "--sector", "4096")
        assert stop.returncode == 0, stop.stderr
        refused = vmlaunch("fault", str(spec), "a", "disk1", "hang", "--read")
        assert refused.returncode == EXIT_USAGE and "pauses the VM when it fires" in refused.stderr, refused
        taken = vmlaunch("fault", str(other), "a", "disk0", "clear")
        assert taken.returncode != 0 and "up from another spec" in taken.stderr, taken
    finally:
        spec.write_text(text)
        other.unlink()
    assert vmlaunch("fault", str(spec), "a", "disk0", "clear").returncode == 0


def test_a_slow_disk_is_slow_until_cleared(rig: Lab) -> None:
    vm = rig.vm("a")
    with vm.disk("disk1").slow("1M"):
        started = time.monotonic()
        vm.succeed("dd if=/dev/vdb of=/dev/null bs=1M count=8 iflag=direct", timeout=120)
        slow = time.monotonic() - started
    started = time.monotonic()
    vm.succeed("dd if=/dev/vdb of=/dev/null bs=1M count=8 iflag=direct", timeout=120)
    # 8 MiB at 1 MiB/s: about 7 s (QEMU's limits let the first request through at once)
    assert slow >= 6.0 and time.monotonic() - started < slow, slow
    assert vm.disk("disk1").faults() == []


@pytest.mark.parametrize(("args", "code", "said"), [
    (["a", "disk9", "clear"], EXIT_USAGE, "has no disk 'disk9'"),
    (["nope", "disk0", "clear"], None, "no VM named 'nope'"),
    (["a", "disk1", "error", "--read", "--sector", "32768"], EXIT_USAGE, "past the end"),
    (["a", "disk1", "error", "--read", "--errno", "EWHAT"], EXIT_USAGE, "not an errno name"),
    (["a", "disk1", "error"], EXIT_USAGE, "--read, --write or --flush"),
    (["a", "disk1", "hang", "--flush"], EXIT_USAGE, "read or write"),
    (["a", "disk1", "slow", "--bps", "1000"], EXIT_USAGE, "has no unit"),
    (["a", "disk1", "slow"], EXIT_USAGE, "bps, iops or latency"),
    (["a", "disk1", "slow", "--bps", "1000T"], EXIT_USAGE, "more than QEMU's largest limit"),
    (["a", "disk1", "release"], EXIT_USAGE, "nothing is held"),
    (["a", "disk1", "clear", "--sector", "3"], EXIT_USAGE, "not for clear"),
])
def test_bad_input_is_one_line_and_changes_nothing(rig: Lab, args: list[str], code: int | None,
                                                   said: str) -> None:
    before = vmlaunch("fault", str(rig.spec), "--json").stdout
    done = vmlaunch("fault", str(rig.spec), *args)
    assert done.returncode != 0 and (code is None or done.returncode == code), done
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert vmlaunch("fault", str(rig.spec), "--json").stdout == before


def test_the_api_refuses_bad_figures(rig: Lab) -> None:
    with pytest.raises(UsageError, match="no unit"):
        rig.vm("a").disk("disk1").slow("100")
    with pytest.raises(UsageError, match="has no disk"):
        rig.vm("a").disk("disk7").fail("read")


def test_a_snapshot_and_down_with_a_held_request_succeed_and_leave_nothing(test_guest: Path,
                                                                             tmp_path: Path) -> None:
    """A lab of its own (the module's goes on): a write held when a snapshot is saved, then when `down`
    comes."""
    spec = tmp_path / "lab.toml"
    spec.write_text(f"""[lab]
name = "held"
[lab.memory]
ksm = false
[vm.h]
memory = "128M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
[[vm.h.disk]]
file = "d.qcow2"
size = "8M"
""")
    lab = Lab(spec, wait_for=READY, timeout=300)
    lab.up()
    disk = lab.vm("h").disk("disk0")

    def held_write() -> threading.Thread:
        disk.hang("write")
        writer = threading.Thread(target=lambda: lab.vm("h").run(
            "dd if=/dev/zero of=/dev/vda bs=4096 count=1 oflag=direct", timeout=120), daemon=True)
        writer.start()
        time.sleep(2)
        assert writer.is_alive()
        return writer

    try:
        writer = held_write()
        saved = vmlaunch("snapshot", str(spec), "save", "s1")
        assert saved.returncode == 0, saved.stderr
        assert "disk0: its disk faults were taken off for the snapshot save" in saved.stderr, saved.stderr
        writer.join(60)
        assert not writer.is_alive() and disk.faults() == []
        held_write()
    finally:
        down = vmlaunch("down", str(spec), "--timeout", "20")
    assert down.returncode == 0, down.stderr
    assert "killed" not in down.stderr, down.stderr  # the guest powered off: nothing kept it waiting
    assert not lab.run_dir.path.exists()
    down_again = vmlaunch("fault", str(spec), "h", "disk0", "clear")
    assert down_again.returncode == EXIT_HOST and "not running" in down_again.stderr


def test_a_spec_fault_past_the_disk_is_a_spec_error_and_up_leaves_nothing(test_guest: Path,
                                                                            tmp_path: Path) -> None:
    """A disk `up` makes: validate knows its size; one that exists: `up` asks QEMU, and says the same."""
    spec = tmp_path / "lab.toml"
    text = f"""[lab]
name = "past"
[vm.p]
memory = "128M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
[[vm.p.disk]]
file = "d.qcow2"
size = "1M"
[[vm.p.disk.fault]]
type = "error"
op = "read"
sector = 2048
"""
    spec.write_text(text)
    checked = vmlaunch("validate", str(spec))
    said = f"{spec}:14: vm.p.disk[0].fault[0].sector: sector 2048 is past the end of the disk (2048 sectors"
    assert checked.returncode == 2 and said in checked.stderr, checked.stderr
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "d.qcow2"), "1M"], check=True)
    assert vmlaunch("validate", str(spec)).returncode == 0  # its size is the file's, which QEMU knows
    up = vmlaunch("up", str(spec))
    assert up.returncode == 2, up.stderr
    assert f"{spec}:11: vm.p.disk[0].fault[0]: sector 2048 is past the end of p disk0" in up.stderr, up.stderr
    assert "Traceback" not in up.stderr
    assert vmlaunch("status", str(spec)).stdout.splitlines()[1].split()[:2] == ["p", "stopped"]


def test_after_down_the_last_runs_events_are_kept(rig: Lab) -> None:
    """It takes the module's lab down (the next test's `rig` brings it up again)."""
    disk = rig.vm("a").disk("disk1")
    with disk.fail("read", sector=8, once=True):  # a run's events of its own, in any order
        assert read_block(rig, "vdb", 1) != 0
        wait_until(lambda: disk.faults() == [], 30, interval=0.1)  # the lab manager logs the error
    rig.down()
    logged = vmlaunch("logs", str(rig.spec), "--events", "--json")
    assert logged.returncode == 0, logged.stderr
    names = [json.loads(line)["event"] for line in logged.stdout.splitlines()]
    assert "BLOCK_IO_ERROR" in names and "VMLAUNCH_DISK_FAULT" in names and names[-1] == "SHUTDOWN"
    assert "not up: these are its last run's events" in logged.stderr
