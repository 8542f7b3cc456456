"""Host KSM for real (this machine's kernel has it, with its advisor): two identical idle test guests
with `ksm = true` get merged, `down` puts every setting back exactly, and a second lab that wants KSM
keeps it on until it goes too. tests/test_ksm.py has the same on a fake sysfs, with the corner cases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vmlaunch.cli import main
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.ksm import CLAIMS_FILE, HOST_CLAIMS_DIR, default_settings

pytestmark = [pytest.mark.qemu, pytest.mark.guest, pytest.mark.host_wide]
KSM = Path("/sys/kernel/mm/ksm")
READY = "VMLAUNCH-GUEST-READY"
SETTINGS = ("run", "pages_to_scan", "sleep_millisecs", "advisor_mode", "advisor_target_scan_time",
            "advisor_max_cpu")


def settings() -> dict[str, str]:
    return {name: (KSM / name).read_text().strip() for name in SETTINGS if (KSM / name).exists()}


@pytest.fixture
def host_ksm() -> Iterator[dict[str, str]]:
    """The host's KSM settings as they were (a test that fails half-way must not change them); not
    quite the defaults, so that putting back the defaults instead would show."""
    if not (KSM / "run").exists() or not (KSM / "run").stat().st_mode & 0o200:
        pytest.skip("no KSM to write here")
    before = settings()
    (KSM / "sleep_millisecs").write_text("21\n")
    if "advisor_max_cpu" in before:
        (KSM / "advisor_max_cpu").write_text("69\n")
    changed = settings()
    yield changed
    for name in ("advisor_mode", "pages_to_scan", "sleep_millisecs", "advisor_target_scan_time",
                 "advisor_max_cpu", "run"):
        if name in before:
            value = before[name].split("[", 1)[1].split("]", 1)[0] if "[" in before[name] else before[name]
            (KSM / name).write_text(value + "\n")


def lab(tmp_path: Path, guest: Path, name: str, memory: str = "ksm = true\n") -> Path:
    vms = "".join(f'[vm.{vm}]\nmemory = "256M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                  f'initrd = "{guest}/initrd.gz"\n' for vm in ("a", "b"))
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[lab]\nname = "{name}"\n[lab.memory]\n{memory}{vms}')
    return path


def pages_sharing() -> int:
    return int((KSM / "pages_sharing").read_text())


def test_two_idle_guests_are_merged_and_down_puts_ksm_back(
        tmp_path: Path, run_dir: Path, test_guest: Path, host_ksm: dict[str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    if host_ksm["run"] != "0":
        pytest.skip("KSM runs on this host already: vmlaunch leaves an administrator's KSM alone")
    spec = lab(tmp_path, test_guest, "ksm")
    assert main(["up", str(spec), "--wait-for", READY, "--timeout", "90"]) == 0
    try:
        assert settings()["run"] == "1"
        journal = Journal.load(RunDir.of(run_dir, "ksm"))
        assert [e.kind for e in journal.resources] == ["ksm", "manager", "vm-user", "vm-user"]  # as root
        before, deadline = pages_sharing(), time.monotonic() + 120
        while pages_sharing() < before + (32 << 20) // 4096 and time.monotonic() < deadline:
            time.sleep(2)  # the rate vmlaunch sets merges idle guests within a minute or two
        assert pages_sharing() >= before + (32 << 20) // 4096, "KSM merged less than 32 MiB in 2 minutes"
        capsys.readouterr()
        assert main(["status", str(spec)]) == 0
        out = capsys.readouterr().out
        assert "ksm: on while the lab runs" in out and "KSM saves the host" in out and "merged" in out
    finally:
        assert main(["down", str(spec)]) == 0
    assert settings() == host_ksm


def test_ksm_stays_on_while_another_lab_wants_it(
        tmp_path: Path, run_dir: Path, test_guest: Path, host_ksm: dict[str, str]) -> None:
    if host_ksm["run"] != "0":
        pytest.skip("KSM runs on this host already")
    first = lab(tmp_path, test_guest, "one")
    second = lab(tmp_path, test_guest, "two", "ksm_pages_to_scan = 300\nksm_sleep_ms = 30\n")
    # These labs are not waited for, and a guest still booting cannot hear the ACPI button: `down
    # --timeout 1`, not the 10 s a clean power-off gets (KSM's settings are what is tested).
    assert main(["up", str(first)]) == 0
    try:
        assert main(["up", str(second)]) == 0
        try:
            now = settings()
            assert now["run"] == "1" and now["pages_to_scan"] == "300" and now["sleep_millisecs"] == "30"
        finally:
            assert main(["down", str(second), "--timeout", "1"]) == 0
        wanted = default_settings("advisor_mode" in host_ksm, 2 * 256)  # lab one's rate again
        assert {name: settings()[name] for name in ("run", "pages_to_scan", "sleep_millisecs")} == {
            name: wanted[name] for name in ("run", "pages_to_scan", "sleep_millisecs")}
    finally:
        assert main(["down", str(first), "--timeout", "1"]) == 0
    assert settings() == host_ksm


def test_a_failing_up_puts_ksm_back(tmp_path: Path, run_dir: Path, test_guest: Path,
                                    host_ksm: dict[str, str]) -> None:
    """b's kernel is no kernel: its QEMU fails after KSM was turned on for the lab."""
    (tmp_path / "junk").write_bytes(b"not a kernel" * 100)
    spec = tmp_path / "bad.toml"
    spec.write_text(f'[lab]\nname = "bad"\n[lab.memory]\nksm = true\n'
                    f'[vm.a]\nmemory = "128M"\naccel = "tcg"\nkernel = "{test_guest}/vmlinuz"\n'
                    f'initrd = "{test_guest}/initrd.gz"\n'
                    f'[vm.b]\nmemory = "128M"\naccel = "tcg"\nkernel = "{tmp_path}/junk"\n')
    assert main(["up", str(spec)]) == 4
    assert settings() == host_ksm
    assert not (HOST_CLAIMS_DIR / CLAIMS_FILE).exists() and not (run_dir / CLAIMS_FILE).exists()


def test_ksm_true_without_root_is_exit_3(tmp_path: Path, run_dir: Path, test_guest: Path,
                                        host_ksm: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """vmlaunch run by another user than root (its euid is all it asks): refused before anything."""
    import os

    spec = lab(tmp_path, test_guest, "user")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["up", str(spec)]) == 3
    assert f"{spec}:4: lab.memory.ksm: turning host KSM on needs root" in capsys.readouterr().err
    monkeypatch.undo()
    assert settings() == host_ksm and not (run_dir / "user").exists()


def claims() -> dict[str, object] | None:
    import json

    path = HOST_CLAIMS_DIR / CLAIMS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def test_labs_under_two_run_roots_share_one_record_of_the_hosts_ksm(
        tmp_path: Path, run_dir: Path, test_guest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42 item 22: the host's settings before any lab are recorded once for the host (in
    /run/vmlaunch, whatever a lab's VMLAUNCH_RUN_DIR), so the first lab to go under one run root
    leaves KSM on for a lab under another, and the last one puts back what the host had. Labs of
    other runs on this host may hold KSM meanwhile: then the record they share keeps the host's
    settings as they were before the first of them, whatever these two labs do."""
    import shutil
    import tempfile

    if not (KSM / "run").exists() or not (KSM / "run").stat().st_mode & 0o200:
        pytest.skip("no KSM to write here")
    before, record = settings(), claims()
    if record is None and before["run"] != "0":
        pytest.skip("KSM runs on this host already (an administrator's)")
    other = Path(tempfile.mkdtemp(prefix="vl-"))
    first = lab(tmp_path, test_guest, "root1")
    second = lab(tmp_path, test_guest, "root2", "ksm_pages_to_scan = 300\nksm_sleep_ms = 30\n")
    try:
        assert main(["up", str(first)]) == 0
        monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(other))
        assert main(["up", str(second)]) == 0
        shared = claims()
        assert shared is not None
        assert not (other / CLAIMS_FILE).exists() and not (run_dir / CLAIMS_FILE).exists()
        labs = shared["labs"]
        assert isinstance(labs, list)
        assert {(str(run_dir), "root1"), (str(other), "root2")} <= {(c["root"], c["lab"]) for c in labs}
        if record is not None:
            assert shared["saved"] == record["saved"]  # the host's own, from before the first lab
        monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(run_dir))
        assert main(["down", str(first), "--timeout", "1"]) == 0
        now = settings()
        assert now["run"] == "1" and int(now["pages_to_scan"]) >= 300, now  # root2 still wants it
        monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(other))
        assert main(["down", str(second), "--timeout", "1"]) == 0
        after = claims()
        if record is None:
            assert settings() == before and after is None
        else:  # other runs' labs still hold it: nothing of these two is left in the record
            assert after is None or not {"root1", "root2"} & {c["lab"] for c in after["labs"]}  # type: ignore
    finally:
        monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(run_dir))
        main(["down", str(first), "--timeout", "1"])
        monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(other))
        main(["down", str(second), "--timeout", "1"])
        shutil.rmtree(other, ignore_errors=True)
