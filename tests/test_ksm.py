"""Host KSM for labs (vmlaunch/resources/ksm.py) on a fake sysfs: claims shared between labs, the
host's settings put back exactly by the last lab, stale and half-made claims, the rate chosen, and the
compiler's refusals. tests/test_ksm_real.py runs it against this machine's kernel."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.errors import HostError, SpecError
from vmlaunch.host.hostwide import RegistryError
from vmlaunch.host.memory import KsmSupport
from vmlaunch.lab.journal import JournalError
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.base import Context
from vmlaunch.resources.ksm import (
    CLAIMS_FILE,
    PASS_SECONDS,
    Claim,
    Ksm,
    KsmRecord,
    combine,
    default_settings,
    explicit_settings,
    release_unjournaled_ksm,
)
from vmlaunch.spec.load import load_lab

HOST_AS_IT_WAS = {"run": "0", "pages_to_scan": "100", "sleep_millisecs": "20", "advisor_mode": "none",
                  "pages_sharing": "0"}


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sys"
    folder = root / "kernel" / "mm" / "ksm"
    folder.mkdir(parents=True)
    for name, value in HOST_AS_IT_WAS.items():
        (folder / name).write_text(value + "\n")
    (folder / "advisor_mode").write_text("[none] scan-time\n")
    monkeypatch.setenv("VMLAUNCH_SYSFS", str(root))
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(tmp_path / "run"))
    return folder


def settings_of(folder: Path) -> dict[str, str]:
    values = {}
    for name in HOST_AS_IT_WAS:
        text = (folder / name).read_text().strip()
        values[name] = text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text
    return values


def journal_lab(tmp_path: Path, lab: str) -> None:
    """Make `lab` look up (a journal in its run dir), so its claim is not stale."""
    run_dir = RunDir.of(tmp_path / "run", lab)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    run_dir.state.write_text("{}")


def up(tmp_path: Path, lab: str, settings: dict[str, str], explicit: bool = False) -> KsmRecord:
    journal_lab(tmp_path, lab)
    return Ksm(settings=settings, explicit=explicit).apply(Context(lab=lab))


ADVISED = default_settings(True, 1024)  # 1 GiB of guests on a kernel with the advisor


def test_one_lab_turns_ksm_on_and_down_puts_back_every_setting(sysfs: Path, tmp_path: Path) -> None:
    record = up(tmp_path, "a", ADVISED)
    now = settings_of(sysfs)
    # 256 Ki pages in 500 wake-ups, rounded up
    assert now == {**HOST_AS_IT_WAS, "run": "1", "pages_to_scan": "525"}
    claims = json.loads((tmp_path / "run" / CLAIMS_FILE).read_text())
    assert claims["saved"] == {"run": "0", "pages_to_scan": "100"}
    record.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs) == HOST_AS_IT_WAS
    assert not (tmp_path / "run" / CLAIMS_FILE).exists()
    record.undo(Context(lab="a"), rollback=False)  # twice: nothing the second time
    assert settings_of(sysfs) == HOST_AS_IT_WAS


def test_ksm_stays_on_while_another_lab_wants_it(sysfs: Path, tmp_path: Path) -> None:
    first = up(tmp_path, "a", ADVISED)
    second = up(tmp_path, "b", explicit_settings(True, 1000, 20), explicit=True)
    assert settings_of(sysfs)["pages_to_scan"] == "1000"  # an explicit rate wins over the default
    assert settings_of(sysfs)["advisor_mode"] == "none"
    second.undo(Context(lab="b"), rollback=False)
    assert settings_of(sysfs)["pages_to_scan"] == "525"  # back to what lab a needs
    first.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs) == HOST_AS_IT_WAS


def test_the_order_labs_go_down_does_not_matter(sysfs: Path, tmp_path: Path) -> None:
    first = up(tmp_path, "a", ADVISED)
    second = up(tmp_path, "b", ADVISED)
    first.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs)["run"] == "1"
    second.undo(Context(lab="b"), rollback=False)
    assert settings_of(sysfs) == HOST_AS_IT_WAS


def test_a_ksm_an_administrator_runs_is_left_alone(sysfs: Path, tmp_path: Path) -> None:
    (sysfs / "run").write_text("1\n")
    (sysfs / "pages_to_scan").write_text("555\n")
    record = up(tmp_path, "a", ADVISED)
    assert settings_of(sysfs) == {**HOST_AS_IT_WAS, "run": "1", "pages_to_scan": "555"}
    other = up(tmp_path, "b", explicit_settings(True, 2000, 10), explicit=True)  # a spec's rate: applied
    assert settings_of(sysfs)["pages_to_scan"] == "2000" and settings_of(sysfs)["sleep_millisecs"] == "10"
    other.undo(Context(lab="b"), rollback=False)
    record.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs) == {**HOST_AS_IT_WAS, "run": "1", "pages_to_scan": "555"}  # still on


def test_a_lab_that_is_gone_does_not_keep_ksm_on(sysfs: Path, tmp_path: Path) -> None:
    up(tmp_path, "gone", ADVISED)
    RunDir.of(tmp_path / "run", "gone").state.unlink()  # its run dir went without a down
    record = up(tmp_path, "a", ADVISED)
    claims = json.loads((tmp_path / "run" / CLAIMS_FILE).read_text())
    assert [(claim["root"], claim["lab"]) for claim in claims["labs"]] == [(str(tmp_path / "run"), "a")]
    assert claims["saved"]["run"] == "0"  # what the host had, not what the gone lab set
    record.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs) == HOST_AS_IT_WAS


def test_a_claim_an_up_killed_before_journaling_left_is_released_by_down(sysfs: Path,
                                                                         tmp_path: Path) -> None:
    up(tmp_path, "a", ADVISED)
    assert release_unjournaled_ksm(Context(lab="a"), lambda kind, key: True) == []  # journaled: kept
    assert settings_of(sysfs)["run"] == "1"
    assert release_unjournaled_ksm(Context(lab="a"), lambda kind, key: False) == []
    assert settings_of(sysfs) == HOST_AS_IT_WAS
    assert release_unjournaled_ksm(Context(lab="b"), lambda kind, key: False) == []  # no claim: nothing


def test_a_failing_write_takes_the_claim_back(sysfs: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    os.unlink(sysfs / "run")
    (sysfs / "run").mkdir()  # reads and writes of it fail
    with pytest.raises(HostError, match="cannot read"):
        up(tmp_path, "a", ADVISED)
    os.rmdir(sysfs / "run")
    (sysfs / "run").write_text("0\n")
    (sysfs / "run").chmod(0o444)
    if os.access(sysfs / "run", os.W_OK):  # root writes anyway: make the write fail instead
        from vmlaunch.resources import ksm

        real = ksm.write

        def refuse(folder: Path, name: str, value: str) -> None:
            if name == "run" and value == "1":
                raise HostError(f"cannot write {folder / name}: permission denied")
            real(folder, name, value)

        monkeypatch.setattr(ksm, "write", refuse)
    with pytest.raises(HostError, match="permission denied"):
        up(tmp_path, "a", ADVISED)
    assert settings_of(sysfs) == HOST_AS_IT_WAS  # what was written before is put back
    assert not (tmp_path / "run" / CLAIMS_FILE).exists()


@pytest.mark.parametrize("doc", ["nonsense", {"version": 9, "labs": {}},
                                 {"version": 1, "saved": {"run": "0; rm -rf /"}, "labs": {}},
                                 {"version": 1, "saved": {"uevent": "1"}, "labs": {}},
                                 {"version": 1, "saved": {}, "labs": {"../x": {"settings": {}}}},
                                 {"version": 2, "saved": {}, "labs": {"a": {"settings": {}}}},
                                 {"version": 2, "saved": {}, "labs": [{"lab": "a", "settings": {}}]},
                                 {"version": 2, "saved": {}, "labs": [{"lab": "a", "root": "rel",
                                                                       "settings": {}}]},
                                 {"version": True, "saved": {}, "labs": []},
                                 {"version": 2, "saved": {"pages_to_scan": "none"}, "labs": []}])
def test_a_damaged_claims_file_is_a_clear_error(sysfs: Path, tmp_path: Path, doc: object) -> None:
    path = tmp_path / "run" / CLAIMS_FILE
    path.parent.mkdir(mode=0o700)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    path.chmod(0o600)
    with pytest.raises(RegistryError, match="the KSM claims .* cannot be read"):
        up(tmp_path, "a", ADVISED)
    assert settings_of(sysfs) == HOST_AS_IT_WAS


def test_combine_picks_the_fastest_and_explicit_first() -> None:
    slow, fast = default_settings(False, 256), default_settings(False, 8192)
    assert int(slow["pages_to_scan"]) < int(fast["pages_to_scan"])
    claims = {"a": Claim(slow), "b": Claim(fast)}
    assert combine(claims, foreign=False) == fast
    mine = explicit_settings(False, 50, 100)
    assert combine({**claims, "c": Claim(mine, explicit=True)}, foreign=False) == mine
    assert combine(claims, foreign=True) == {}  # an administrator's KSM: left alone
    assert combine({"c": Claim(mine, explicit=True)}, foreign=True) == {
        "pages_to_scan": "50", "sleep_millisecs": "100"}  # the rate, not `run`
    assert combine({}, foreign=False) == {}


def test_the_rate_without_the_advisor_scales_with_the_lab() -> None:
    assert default_settings(False, 64)["pages_to_scan"] == "100"  # the kernel's default at least
    # 8 x 512M: 1 Mi pages, a pass in PASS_SECONDS at one wake-up per 20 ms
    wanted = -(-(4096 * 256 * 20) // (PASS_SECONDS * 1000))
    assert default_settings(False, 4096)["pages_to_scan"] == str(wanted)
    assert default_settings(False, 1 << 30)["pages_to_scan"] == "5000"  # a cap
    assert default_settings(True, 4096)["advisor_mode"] == "none"  # it would set the rate itself


def test_a_host_advisor_is_turned_off_for_the_lab_and_back_on_after(sysfs: Path, tmp_path: Path) -> None:
    (sysfs / "advisor_mode").write_text("none [scan-time]\n")
    (sysfs / "pages_to_scan").write_text("500\n")  # what the advisor had set
    record = up(tmp_path, "a", ADVISED)
    assert settings_of(sysfs) == {**HOST_AS_IT_WAS, "run": "1", "pages_to_scan": "525"}
    record.undo(Context(lab="a"), rollback=False)
    now = settings_of(sysfs)
    # pages_to_scan is the advisor's again (the kernel resets it when the mode is set; not this fake)
    assert {**now, "pages_to_scan": "-"} == {**HOST_AS_IT_WAS, "advisor_mode": "scan-time",
                                             "pages_to_scan": "-"}


LAB = '[lab]\nname = "k"\n{memory}' + ''.join(
    f'[vm.{name}]\nmemory = "256M"\naccel = "tcg"\nkernel = "vmlinuz"\n{{extra}}' for name in ("a", "b"))


def plan_ksm(tmp_path: Path, memory: str = "", extra: str = "", **host: object) -> list[Ksm]:
    spec = write_spec(tmp_path, LAB.format(memory=memory, extra=extra))
    plan = compile_lab(load_lab(spec), fake_host(**host))
    return [r for r in plan.resources if isinstance(r, Ksm)]


def test_ksm_is_on_by_default_for_two_vms_as_root(tmp_path: Path) -> None:
    assert plan_ksm(tmp_path) == [Ksm(default_settings(True, 512))]
    assert plan_ksm(tmp_path, "[lab.memory]\nksm = false\n") == []
    assert plan_ksm(tmp_path, ksm=KsmSupport(writable=False, advisor=True)) == []  # not root: left alone
    assert plan_ksm(tmp_path, ksm=None) == []
    # nothing KSM could merge
    assert plan_ksm(tmp_path, extra='hugepages = "2M"\n', hugepage_sizes_kib=frozenset({2048})) == []


def test_a_rate_in_the_spec_is_used_as_given(tmp_path: Path) -> None:
    (ksm,) = plan_ksm(tmp_path, "[lab.memory]\nksm_pages_to_scan = 1000\nksm_sleep_ms = 20\n")
    assert ksm.explicit and ksm.settings == {"advisor_mode": "none", "pages_to_scan": "1000",
                                             "sleep_millisecs": "20", "run": "1"}


@pytest.mark.parametrize("ksm, words", [
    (KsmSupport(writable=False, advisor=True), "needs root"),
    (None, "this kernel has no KSM"),
])
def test_ksm_true_the_host_cannot_do_is_exit_3(tmp_path: Path, ksm: KsmSupport | None, words: str) -> None:
    with pytest.raises(HostError, match=words) as info:
        plan_ksm(tmp_path, "[lab.memory]\nksm = true\n", ksm=ksm)
    assert info.value.exit_code == 3
    assert str(info.value).startswith(f"{tmp_path / 'lab.toml'}:4: lab.memory.ksm: ")


def test_a_rate_with_ksm_off_is_a_spec_error(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, LAB.format(memory="[lab.memory]\nksm = false\nksm_sleep_ms = 50\n", extra=""))
    with pytest.raises(SpecError, match="lab.memory.ksm_sleep_ms: ksm_sleep_ms sets KSM's rate, and ksm = "
                                        "false turns it off"):
        load_lab(spec)


def test_down_force_of_an_unreadable_journal_releases_the_labs_claim(sysfs: Path, tmp_path: Path) -> None:
    """The journal's KSM record cannot be read: once the lab is down, its claim is stale, and KSM goes
    back as the host had it then, not when the next lab comes."""
    from vmlaunch.runtime import executor

    run_dir = RunDir.of(tmp_path / "run", "a")
    run_dir.create()
    Ksm(settings=ADVISED).apply(Context(lab="a"))
    run_dir.state.write_text('{"version": 1, "resources": [{"kind": "what is this"}]}')
    assert settings_of(sysfs)["run"] == "1"
    with pytest.raises(JournalError):
        executor.down(run_dir)  # without --force: the journal is refused, nothing changes
    assert settings_of(sysfs)["run"] == "1"
    executor.down(run_dir, force=True)
    assert settings_of(sysfs) == HOST_AS_IT_WAS
    assert not (tmp_path / "run" / CLAIMS_FILE).exists()


def test_labs_under_other_run_roots_share_the_hosts_claims(sysfs: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """KSM is the host's: a lab under another VMLAUNCH_RUN_DIR still wants it when the first goes.
    (The host's own sysfs keeps its claims in /run/vmlaunch; here the claims dir is the first root.)"""
    import vmlaunch.resources.ksm as ksm

    shared = tmp_path / "run"
    monkeypatch.setattr(ksm, "claims_root", lambda sysfs: shared)
    first = up(tmp_path, "a", ADVISED)
    other = tmp_path / "other"
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(other))
    RunDir.of(other, "a").path.mkdir(parents=True)
    RunDir.of(other, "a").state.write_text("{}")  # up there too, by the same name
    second = Ksm(settings=ADVISED).apply(Context(lab="a"))
    claims = json.loads((shared / CLAIMS_FILE).read_text())
    assert sorted((claim["root"], claim["lab"]) for claim in claims["labs"]) == [
        (str(other), "a"), (str(shared), "a")]
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(shared))
    first.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs)["run"] == "1"  # the other root's lab still wants it
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(other))
    second.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs) == HOST_AS_IT_WAS and not (shared / CLAIMS_FILE).exists()


def test_a_version_1_claims_file_is_read_as_its_run_roots(sysfs: Path, tmp_path: Path) -> None:
    """What an earlier vmlaunch wrote (labs by name, all of that run root) is still honoured."""
    path = tmp_path / "run" / CLAIMS_FILE
    path.parent.mkdir(mode=0o700)
    journal_lab(tmp_path, "old")
    (sysfs / "run").write_text("1\n")
    path.write_text(json.dumps({"version": 1, "saved": {"run": "0"}, "foreign": False,
                                "labs": {"old": {"settings": {"run": "1"}, "explicit": False}}}))
    path.chmod(0o600)
    record = up(tmp_path, "a", ADVISED)
    record.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs)["run"] == "1"  # lab old still runs
    RunDir.of(tmp_path / "run", "old").state.unlink()
    up(tmp_path, "b", ADVISED).undo(Context(lab="b"), rollback=False)
    assert settings_of(sysfs) == HOST_AS_IT_WAS


def test_the_hosts_own_ksm_has_one_claims_file_for_every_run_root(tmp_path: Path) -> None:
    from vmlaunch.resources.ksm import HOST_CLAIMS_DIR, claims_root

    assert claims_root(tmp_path) is None  # a fake sysfs: the run root's
    if os.geteuid() == 0 and Path("/sys/kernel/mm/ksm").is_dir():
        assert claims_root(Path("/sys")) == HOST_CLAIMS_DIR


def test_a_relative_run_root_is_claimed_by_its_absolute_path(sysfs: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", "run")
    record = up(tmp_path, "a", ADVISED)
    claims = json.loads((tmp_path / "run" / CLAIMS_FILE).read_text())
    assert [claim["root"] for claim in claims["labs"]] == [str(tmp_path / "run")]
    up(tmp_path, "b", ADVISED).undo(Context(lab="b"), rollback=False)  # the file reads back
    record.undo(Context(lab="a"), rollback=False)
    assert settings_of(sysfs) == HOST_AS_IT_WAS
