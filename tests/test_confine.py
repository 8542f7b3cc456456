"""Confinement without a guest (`host/confine.py`, `resources/vmuser.py`): the uid range and its checks
against the host's accounts, the host-wide claims, the sandbox in every command line, and a refused
range leaving the host untouched (the real QEMUs: tests/test_confine_real.py)."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.errors import EXIT_HOST, HostError
from vmlaunch.host import confine
from vmlaunch.resources.vmuser import VmUser
from vmlaunch.spec.load import load_lab

SPEC = '[lab]\nname = "conf"\n[vm.a]\nmemory = 64\nkernel = "/k"\n[vm.b]\nmemory = 64\nkernel = "/k"\n'


@pytest.mark.parametrize(("text", "expected"), [
    ("", confine.UidRange(confine.DEFAULT_FIRST, confine.DEFAULT_FIRST + confine.DEFAULT_COUNT - 1)),
    (" 3000000000-3000000009 ", confine.UidRange(3000000000, 3000000009)),
])
def test_the_uid_range(monkeypatch: pytest.MonkeyPatch, text: str, expected: confine.UidRange) -> None:
    monkeypatch.setenv(confine.RANGE_ENV, text)
    assert confine.uid_range() == expected


@pytest.mark.parametrize("text", ["lots", "10", "0-100", "60000-70000", "9-5", "1-4294967295", "-5-9"])
def test_a_range_that_is_not_one_is_refused(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(confine.RANGE_ENV, text)
    with pytest.raises(HostError, match=confine.RANGE_ENV) as caught:
        confine.uid_range()
    assert caught.value.exit_code == EXIT_HOST


def test_collisions_name_accounts_groups_and_subordinate_ranges(tmp_path: Path) -> None:
    (tmp_path / "subuid").write_text("dev:100000:65536\nbroken line\nops:1879048192:10\n")
    (tmp_path / "subgid").write_text("dev:1879113000:1000\n")
    found = confine.collisions(confine.uid_range(), tmp_path)
    assert found == [f"ops's subordinate ids 1879048192-1879048201 ({tmp_path / 'subuid'})",
                     f"dev's subordinate ids 1879113000-1879113999 ({tmp_path / 'subgid'})"]
    assert "user root has uid 0" in confine.collisions(confine.UidRange(0, 0), tmp_path)
    assert "group root has gid 0" in confine.collisions(confine.UidRange(0, 0), tmp_path)


def test_the_default_range_is_free_on_this_host() -> None:
    confine.check_range(confine.uid_range())


def test_every_qemu_gets_the_sandbox_and_as_root_a_uid_resource(tmp_path: Path) -> None:
    lab = load_lab(write_spec(tmp_path, SPEC))
    for host, users in ((fake_host(), []), (fake_host(as_root=True), ["a", "b"])):
        plan = compile_lab(lab, host)
        for vm in plan.vms:
            at = vm.argv.index("-sandbox")
            assert vm.argv[at + 1] == "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
            assert "-daemonize" not in vm.argv
        assert [r.vm for r in plan.resources if isinstance(r, VmUser)] == users
    off = compile_lab(lab, fake_host(as_root=True, confine=False))
    assert not any("-sandbox" in vm.argv for vm in off.vms)
    assert not any(isinstance(r, VmUser) for r in off.resources)
    without = compile_lab(lab, fake_host(seccomp=False))  # a QEMU built without seccomp
    assert not any("-sandbox" in vm.argv for vm in without.vms)


def test_claims_are_one_uid_per_vm_and_stale_ones_are_reused(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(confine, "HOST_ROOT", tmp_path / "host")
    monkeypatch.setenv(confine.RANGE_ENV, "3000000000-3000000002")
    ids = confine.uid_range()
    root = tmp_path / "runs"
    (root / "one").mkdir(parents=True)
    (root / "one" / "state.json").write_text("{}")  # lab one is in use
    a = confine.claim(root, "one", "a", ids)
    b = confine.claim(root, "one", "b", ids)
    assert (a, b) == (3000000000, 3000000001)
    assert confine.claim(root, "one", "a", ids) == a  # the one it holds
    c = confine.claim(root, "gone", "c", ids)  # a lab without a journal: its claim goes stale
    assert c == 3000000002
    with pytest.raises(HostError, match="every uid of VMLAUNCH_UID_RANGE"):
        confine.claim(root, "one", "d", attrs.evolve(ids, last=3000000001))
    assert confine.claim(root, "one", "d", ids) == c  # the stale claim of lab gone is reused
    confine.release(a, root, "one", "a")
    confine.release(b, root, "other", "b")  # not its claim: kept
    assert confine.claim(root, "one", "e", ids) == a
    for uid, vm in ((b, "b"), (c, "d"), (a, "e")):
        confine.release(uid, root, "one", vm)
    assert not (tmp_path / "host" / confine.UIDS_FILE).exists()  # empty: the file goes


@pytest.mark.skipif(os.geteuid() != 0, reason="a lab run as root")
def test_a_range_the_host_uses_is_exit_3_naming_the_setting_and_changes_nothing(
        tmp_path: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from vmlaunch.cli import main

    monkeypatch.setenv(confine.RANGE_ENV, "1-10")  # daemon, bin, sys...: Debian's system accounts
    (tmp_path / "k").write_bytes(b"\0" * 4096)
    spec = write_spec(tmp_path, SPEC.replace('kernel = "/k"', f'kernel = "{tmp_path / "k"}"\naccel = "tcg"'))
    assert main(["up", str(spec)]) == EXIT_HOST
    err = capsys.readouterr().err
    assert "VMLAUNCH_UID_RANGE (1-10) holds ids the host uses: user daemon has uid 1" in err
    assert "set VMLAUNCH_UID_RANGE=FIRST-LAST" in err
    assert list(run_dir.iterdir()) == []


def test_the_confinement_of_a_process() -> None:
    me = confine.Confinement.of(os.getpid())
    assert me.uid == os.geteuid() and me.gid == os.getegid()
    assert confine.Confinement(0, 0, False).problems(as_root=True) == [
        "it runs without a seccomp sandbox (Seccomp is not 2)", "it runs as root"]
    assert confine.Confinement(1879048192, 1879048192, True).problems(as_root=True) == []
    assert confine.Confinement(1000, 1000, True).problems(as_root=False) == []
    assert confine.Confinement.of(2 ** 30) == confine.Confinement(None, None, None)  # no such process


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another uid")
def test_a_vms_uid_is_given_its_shares_and_everything_is_handed_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim journaled first names the uid and the shares: undone (a crash before the record), it
    hands back what the uid made there and frees the uid; the record does the same after the grants."""
    from vmlaunch.resources.base import Context
    from vmlaunch.resources.vmuser import VmUserClaim, VmUserClaimRecord, VmUserRecord

    monkeypatch.setattr(confine, "HOST_ROOT", tmp_path / "host")
    share = tmp_path / "share"
    share.mkdir()
    os.chown(share, 65534, 65534)
    user = VmUser(vm="a", run_root=tmp_path / "runs", shares=((share, False),))
    ctx = Context(lab="conf")
    claimed = VmUserClaim(user).apply(ctx)
    assert isinstance(claimed, VmUserClaimRecord) and claimed.kind == "vm-user-claim"
    assert claimed.shares == (str(share),) and claimed.uid in confine.uid_range()
    made = share / "made-by-the-guest"
    made.write_text("x")
    os.chown(made, claimed.uid, claimed.gid)  # as QEMU would make it
    claimed.undo(ctx, rollback=True)
    assert (made.stat().st_uid, made.stat().st_gid) == (65534, 65534)
    assert not (tmp_path / "host" / confine.UIDS_FILE).exists()  # the uid is free again

    record = user.apply(ctx)
    assert isinstance(record, VmUserRecord) and record.kind == "vm-user"
    assert "system.posix_acl_access" in os.listxattr(share)  # given to the uid
    record.undo(ctx, rollback=False)
    assert "system.posix_acl_access" not in os.listxattr(share)  # as it was
    assert not (tmp_path / "host" / confine.UIDS_FILE).exists()
