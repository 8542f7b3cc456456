"""Disk faults without a VM: the one parser of the spec, the CLI and the API (spec/diskfault.py), what
QEMU is asked for (blkdebug's rules, the I/O limits), the spec's [[fault]]s through validate and the
compiler, and the CLI's refusals before any QEMU is asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.errors import EXIT_HOST, EXIT_SPEC, EXIT_USAGE, SpecError
from vmlaunch.rig.diskfault import DISARM, _limits, _rules
from vmlaunch.spec.diskfault import (
    describe,
    errno_number,
    fired_by,
    from_json,
    iops_of,
    mistaken_for,
    parse_fault,
    parse_rate,
    replaces,
    to_json,
)
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import DiskFault, FaultKind

HEAD = '[lab]\nname = "t"\n[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.disk]]\nfile = "d.img"\nsize = "16M"\n'


@pytest.mark.parametrize(("raw", "fault"), [
    ({"type": "error", "op": "read"}, DiskFault(FaultKind.ERROR, op="read")),
    ({"type": "error", "write": True, "sector": 8, "once": True, "errno": "enospc"},
     DiskFault(FaultKind.ERROR, op="write", sector=8, once=True, errno="ENOSPC")),
    ({"type": "error", "flush": True}, DiskFault(FaultKind.ERROR, op="flush")),
    ({"type": "hang", "op": "write"}, DiskFault(FaultKind.HANG, op="write")),
    ({"type": "slow", "bps": "1M"}, DiskFault(FaultKind.SLOW, bps=1 << 20)),
    ({"type": "slow", "bps": "512KiB/s", "iops": 50}, DiskFault(FaultKind.SLOW, bps=512 << 10, iops=50)),
    ({"type": "slow", "latency": "20ms"}, DiskFault(FaultKind.SLOW, latency_ms=20)),
    ({"type": "slow", "latency": 250}, DiskFault(FaultKind.SLOW, latency_ms=250)),
])
def test_faults_parse_one_way_everywhere(raw: dict[str, object], fault: DiskFault) -> None:
    parsed, problems = parse_fault(raw)
    assert problems == [] and parsed == fault
    assert from_json(to_json(fault)) == fault and describe(fault)


@pytest.mark.parametrize(("raw", "said"), [
    ({"type": "error"}, "which requests"),
    ({"type": "oops", "op": "read"}, "type must be one of"),
    ({"type": "hang", "op": "flush"}, "read or write"),
    ({"type": "error", "read": True, "write": True}, "one kind of request"),
    ({"type": "error", "op": "read", "write": True}, "say two things"),
    ({"type": "error", "op": "flush", "sector": 3}, "no sector"),
    ({"type": "error", "op": "read", "sector": -1}, "whole number"),
    ({"type": "error", "op": "read", "errno": "EWHAT"}, "not an errno name"),
    ({"type": "error", "op": "read", "bps": "1M"}, "for a slow fault"),
    ({"type": "hang", "op": "read", "once": True}, "for an error fault"),
    ({"type": "slow"}, "needs bps, iops or latency"),
    ({"type": "slow", "bps": "1000"}, "has no unit"),
    ({"type": "slow", "bps": 1000}, "has no unit"),
    ({"type": "slow", "bps": "1MB"}, "rate"),
    ({"type": "slow", "bps": "0K"}, "zero"),
    ({"type": "slow", "bps": "0"}, "zero"),
    ({"type": "slow", "latency": 5000}, "1 to 1000"),
    ({"type": "slow", "iops": 0}, "1 to"),
    ({"type": "slow", "iops": 10, "latency": 10}, "give one"),
    ({"type": "slow", "op": "read", "bps": "1M"}, "not for a slow disk"),
    ({"type": "error", "op": "read", "color": "red"}, "unknown field"),
])
def test_bad_faults_say_why(raw: dict[str, object], said: str) -> None:
    fault, problems = parse_fault(raw)
    assert fault is None and any(said in message for _, message, _ in problems), problems


def test_rates_and_errnos() -> None:
    assert parse_rate("1M") == 1 << 20 and parse_rate("2 MiB/s") == 2 << 20 and parse_rate("100B") == 100
    assert errno_number("eio") == 5 and errno_number("ENOSPC") == 28
    with pytest.raises(ValueError, match="closest: EIO"):
        errno_number("EIOO")
    with pytest.raises(ValueError):
        errno_number("")
    with pytest.raises(ValueError, match="more than QEMU's largest limit"):
        parse_rate("1000T")
    assert parse_rate("909T") == 909 << 40
    assert iops_of(DiskFault(FaultKind.SLOW, latency_ms=100)) == 10
    assert iops_of(DiskFault(FaultKind.SLOW, latency_ms=1000)) == 1


def test_each_rule_names_its_iotype_and_a_hold_splits_the_limits() -> None:
    rules = _rules([DiskFault(FaultKind.ERROR, op="read", sector=8),
                    DiskFault(FaultKind.ERROR, op="write", once=True, errno="ENOSPC"),
                    DiskFault(FaultKind.ERROR, op="flush"), DiskFault(FaultKind.SLOW, bps=1)])
    assert rules == [
        {"event": "read_aio", "iotype": "read", "errno": 5, "once": False, "sector": 8},
        {"event": "write_aio", "iotype": "write", "errno": 28, "once": True},
        {"event": "write_aio", "iotype": "write-zeroes", "errno": 28, "once": True},
        {"event": "flush_to_disk", "iotype": "flush", "errno": 5, "once": False},
        DISARM,  # with a flush rule: the rule a read puts in force, to take the node off again
    ]
    assert DISARM not in _rules([DiskFault(FaultKind.ERROR, op="read")])
    slow = DiskFault(FaultKind.SLOW, bps=1 << 20, latency_ms=50)
    assert _limits([slow]) == {"bps": 1 << 20, "bps_rd": 0, "bps_wr": 0, "iops": 20, "iops_rd": 0,
                               "iops_wr": 0}
    # QEMU refuses a total beside a per-direction limit: with a hold, the totals go per direction
    assert _limits([slow, DiskFault(FaultKind.HANG, op="write")]) == {
        "bps": 0, "bps_rd": 1 << 20, "bps_wr": 1, "iops": 0, "iops_rd": 20, "iops_wr": 20}
    assert _limits([]) == dict.fromkeys(("bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr"), 0)


def test_spec_faults_reach_the_plan(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + '[[vm.a.disk.fault]]\ntype = "error"\nwrite = true\nsector = 100\n'
                      '[[vm.a.disk.fault]]\ntype = "slow"\nbps = "2M"\n')
    lab = load_lab(spec)
    assert lab.vm("a").disks[0].faults == (DiskFault(FaultKind.ERROR, op="write", sector=100),
                                           DiskFault(FaultKind.SLOW, bps=2 << 20))
    plan = compile_lab(lab, fake_host()).vm("a")
    (start,) = plan.disk_faults
    assert (start.disk, start.key, start.faults) == ("disk0", "vm.a.disk[0]", lab.vm("a").disks[0].faults)
    assert start.locations[1].line == 13  # each fault's table, for a fault QEMU refuses at up
    # cmdline and up --dry-run say it
    assert "a: disk0 breaks from the start ([[fault]]): error write at sector 100, EIO; slow 2M/s" \
        in " ".join(plan.notes)


@pytest.mark.parametrize(("fault", "said"), [
    ('type = "error"\nwrite = true\n', "read-only disk has no writes"),
    ('type = "slow"\nbps = "1000"\n', "has no unit"),
    ('type = "error"\nop = "read"\ncolour = 1\n', "colour"),
    ('type = "hang"\nop = "read"\n[[vm.a.disk.fault]]\ntype = "hang"\nop = "read"\n', "second hang"),
    ('type = "slow"\nbps = "1000T"\n', "more than QEMU's largest limit"),
    ('type = "error"\nread = true\nsector = 8\n[[vm.a.disk.fault]]\ntype = "error"\nread = true\n'
     'sector = 8\n', "a second error of the reads at sector 8"),
    ('type = "error"\nread = true\nsector = 8\nonce = true\n[[vm.a.disk.fault]]\ntype = "error"\n'
     'read = true\nsector = 16\n', "fails the same requests with the same errno"),
])
def test_spec_faults_are_checked_with_their_line(tmp_path: Path, fault: str, said: str) -> None:
    spec = write_spec(tmp_path, HEAD + "readonly = true\n[[vm.a.disk.fault]]\n" + fault)
    with pytest.raises(SpecError) as caught:
        load_lab(spec)
    text = str(caught.value)
    assert said in text and "lab.toml:" in text, text


def vmlaunch(*args: str, run_root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, "VMLAUNCH_RUN_DIR": str(run_root)})


def test_the_cli_refuses_before_asking_qemu(tmp_path: Path) -> None:
    spec = str(write_spec(tmp_path, HEAD))
    root = tmp_path / "run"
    down = vmlaunch("fault", spec, "a", "disk0", "error", "--read", run_root=root)
    assert down.returncode == EXIT_HOST and "not running" in down.stderr, down.stderr
    for args, said in ((["a", "disk3", "clear"], "has no disk 'disk3'"),
                       (["a", "disk0"], "name the VM, the disk and what to do"),
                       (["a", "disk0", "slow", "--bps", "5"], "has no unit"),
                       (["a", "disk0", "error", "--read", "--bps", "1M"], "--bps is not for error"),
                       (["a", "disk0", "error", "--read", "--write"], "not allowed with"),
                       (["a", "disk0", "clear", "--json"], "--json is not for clear")):
        done = vmlaunch("fault", spec, *args, run_root=root)
        assert done.returncode == EXIT_USAGE and said in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    listed = vmlaunch("fault", spec, run_root=root)
    assert listed.returncode == 0 and listed.stdout.strip() == "no disk faults set"
    broken = vmlaunch("fault", str(write_spec(tmp_path, HEAD + "[[vm.a.disk.fault]]\ntype = 3\n", "b.toml")),
                      run_root=root)
    assert broken.returncode == EXIT_SPEC


def test_once_errors_are_told_apart_by_what_qemu_reports() -> None:
    """QEMU's BLOCK_IO_ERROR names the operation and the errno's text, not the rule nor the sector: an
    event is a --once error's only when no other error of the disk is reported alike."""
    once = DiskFault(FaultKind.ERROR, op="read", sector=8, once=True)
    assert mistaken_for(once, [DiskFault(FaultKind.ERROR, op="read", sector=16)]) is not None
    assert mistaken_for(once, [DiskFault(FaultKind.ERROR, op="read", sector=16, errno="EROFS")]) is None
    assert mistaken_for(once, [DiskFault(FaultKind.ERROR, op="write", sector=8)]) is None
    assert mistaken_for(once, [DiskFault(FaultKind.ERROR, op="read", sector=8)]) is None  # replaced by it
    flush = DiskFault(FaultKind.ERROR, op="flush", once=True)  # a failed flush is a failed write to QEMU
    assert mistaken_for(flush, [DiskFault(FaultKind.ERROR, op="write", sector=8)]) is not None
    plain = DiskFault(FaultKind.ERROR, op="read", sector=16)
    assert mistaken_for(plain, [DiskFault(FaultKind.ERROR, op="read", sector=8)]) is None  # none once
    assert fired_by({"operation": "read", "reason": "Input/output error"}, once)
    assert not fired_by({"operation": "read", "reason": "Read-only file system"}, once)
    assert not fired_by({"operation": "write", "reason": "Input/output error"}, once)
    assert fired_by({"operation": "write", "reason": "Input/output error"}, flush)
    assert replaces(DiskFault(FaultKind.SLOW, bps=1), DiskFault(FaultKind.SLOW, iops=3))
    assert not replaces(once, DiskFault(FaultKind.ERROR, op="read", sector=9))
