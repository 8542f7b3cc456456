"""A network's up_script and down_script (vmlaunch/resources/script.py): how they run, what they are
told, how they fail, which ones are refused, and that each down_script runs exactly once whatever
happens to the `up` that ran its up_script. No network is touched: the scripts here write files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.core import signals
from vmlaunch.errors import RuntimeFailure
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.base import Context, UndoneWithError
from vmlaunch.resources.script import (
    ScriptEnv,
    ScriptFailed,
    ScriptRecord,
    ScriptRefused,
    TapScript,
    environment,
    run_checked,
)
from vmlaunch.runtime import executor
from vmlaunch.spec.load import load_lab

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of another user)")
ENV = ScriptEnv(lab="t", vm="a", nic=1, network="lan", tap="vl-abc", mac="52:54:00:01:02:03",
                bridge="br0", mtu=1400, ip="10.0.0.5/24")
CTX = Context(lab="t")


def script(path: Path, body: str, mode: int = 0o755) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(mode)
    return path


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_argv_folder_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", "/somewhere")  # vmlaunch's own setting: not the script's
    monkeypatch.setenv("MY_SETTING", "kept")
    up = script(tmp_path / "up", 'printf "%s\\n" "$0" "$#" "$1" "$(pwd)" > seen\nenv > env\n')
    run_checked(up, ENV, "up", "network lan: up_script")
    assert lines(tmp_path / "seen") == [str(up), "1", "vl-abc", str(tmp_path)]
    env = dict(line.split("=", 1) for line in lines(tmp_path / "env") if "=" in line)
    assert {key: value for key, value in env.items() if key.startswith("VMLAUNCH_")} == {
        "VMLAUNCH_LAB": "t", "VMLAUNCH_VM": "a", "VMLAUNCH_NIC": "1", "VMLAUNCH_NETWORK": "lan",
        "VMLAUNCH_TAP": "vl-abc", "VMLAUNCH_MAC": "52:54:00:01:02:03", "VMLAUNCH_BRIDGE": "br0",
        "VMLAUNCH_MTU": "1400", "VMLAUNCH_IP": "10.0.0.5/24", "VMLAUNCH_ACTION": "up"}
    assert env["MY_SETTING"] == "kept" and env["PATH"] == os.environ["PATH"]


def test_unset_values_are_not_in_the_environment() -> None:
    plain = ScriptEnv(lab="t", vm="a", nic=0, network="ovs", tap="vl-x", mac="52:54:00:00:00:01")
    assert set(environment(plain.variables("down"))) >= {"VMLAUNCH_TAP", "VMLAUNCH_ACTION"}
    assert not {"VMLAUNCH_BRIDGE", "VMLAUNCH_MTU", "VMLAUNCH_IP"} & set(plain.variables("down"))


def test_a_failure_says_the_status_and_the_output(tmp_path: Path) -> None:
    up = script(tmp_path / "up", 'echo "wiring $1"\necho "no switch \\033[31mbr-x\\033[0m" >&2\nexit 3\n')
    with pytest.raises(ScriptFailed) as caught:
        run_checked(up, ENV, "up", "network lan: up_script")
    assert str(caught.value) == (f"network lan: up_script `{up} vl-abc` failed with exit status 3; its "
                                 "output:\n  | wiring vl-abc\n  | no switch br-x")  # no escapes
    assert caught.value.exit_code == 4
    quiet = script(tmp_path / "quiet", "kill -9 $$\n")
    with pytest.raises(ScriptFailed, match=r"quiet vl-abc` was killed by SIGKILL \(it printed nothing\)"):
        run_checked(quiet, ENV, "up", "network lan: up_script")


def test_a_script_that_cannot_be_run(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.write_text("echo no interpreter line\n")
    bare.chmod(0o755)
    with pytest.raises(ScriptFailed) as caught:
        run_checked(bare, ENV, "up", "network lan: up_script")
    assert "cannot be run: Exec format error" in str(caught.value)
    assert caught.value.hint is not None and "#!" in caught.value.hint


def test_a_hanging_script_is_killed_with_what_it_started(tmp_path: Path) -> None:
    up = script(tmp_path / "up", "echo started\nsleep 300 &\necho $! > child\nwait\n")
    with pytest.raises(ScriptFailed) as caught:
        run_checked(up, ENV, "up", "network lan: up_script", timeout=1)
    assert "did not finish within 1 s, so it was killed, with what it started; its output:\n  | started" \
        in str(caught.value)
    child = int((tmp_path / "child").read_text())
    for _ in range(100):  # SIGKILL is delivered at once; reaping by init may take a moment
        if not Path(f"/proc/{child}").exists() or "Z" in _state(child):
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "Z"


def test_a_daemon_left_running_does_not_keep_up_waiting(tmp_path: Path) -> None:
    """Its output goes to a file: a background process still holding it is no reason to wait."""
    up = script(tmp_path / "up", "sleep 120 &\necho $! > daemon\necho wired\n")
    try:
        run_checked(up, ENV, "up", "network lan: up_script", timeout=60)
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp_path / "daemon").read_text()), signal.SIGKILL)


def test_signals_a_rollback_holds_are_not_held_in_the_script(tmp_path: Path) -> None:
    down = script(tmp_path / "down", "grep SigBlk /proc/self/status > mask\n")
    with signals.held():
        run_checked(down, ENV, "down", "network lan: down_script")
    assert lines(tmp_path / "mask") == ["SigBlk:\t0000000000000000"]


def test_a_script_dies_with_a_vmlaunch_killed_while_it_runs(tmp_path: Path) -> None:
    """SIGKILL leaves vmlaunch no time to kill anything: the script goes with it all the same."""
    import subprocess
    import sys

    up = script(tmp_path / "up", "echo $$ > pid\nexec sleep 300\n")
    runner = subprocess.Popen([sys.executable, "-c",
                               "import sys; from pathlib import Path; from tests.test_script import ENV; "
                               "from vmlaunch.resources.script import run_checked; "
                               "run_checked(Path(sys.argv[1]), ENV, 'up', 'network lan: up_script')",
                               str(up)], cwd=Path(__file__).resolve().parent.parent)
    try:
        for _ in range(200):
            if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip():
                break
            time.sleep(0.05)
        pid = int((tmp_path / "pid").read_text())
        assert _state(pid) != "Z"
    finally:
        runner.kill()
        runner.wait()
    for _ in range(100):
        if "Z" in _state(pid):
            break
        time.sleep(0.05)
    assert "Z" in _state(pid)


# --- scripts another user could change are refused --------------------------------------------------


def tap_scripts(tmp_path: Path, network: str) -> list[TapScript]:
    (tmp_path / "k").write_bytes(b"kernel")
    spec = write_spec(tmp_path, '[lab]\nname = "t"\n[network.n]\n' + network +
                      '[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "n"\n'
                      '[[vm.a.nic]]\nnetwork = "n"\n')
    return [r for r in compile_lab(load_lab(spec), fake_host()).resources if isinstance(r, TapScript)]


def test_scripts_others_may_change_are_refused_before_anything(tmp_path: Path) -> None:
    script(tmp_path / "up", "exit 0\n", 0o757)  # anyone may write it
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may replace what is in it
    script(shared / "down", "exit 0\n")
    planned = tap_scripts(tmp_path, 'type = "tap"\nup_script = "up"\ndown_script = "shared/down"\n')
    assert len(planned) == 2  # one per NIC, each checked once
    with pytest.raises(ScriptRefused) as caught:
        TapScript.preflight(planned)
    spec = tmp_path / "lab.toml"
    assert str(caught.value).splitlines() == [
        f"{spec}:5: network.n.up_script: {tmp_path}/up may be written by other users (mode 0757) "
        f"(chmod go-w {tmp_path}/up)",
        f"{spec}:6: network.n.down_script: {shared}/down can be replaced by other users: {shared} is "
        "writable by everyone",
        "  hint: vmlaunch runs only scripts that no user but you and root can change, by a path no other "
        "user can change either"]
    assert caught.value.exit_code == 3


@as_root
def test_a_script_of_another_user_is_refused_at_down_too(tmp_path: Path) -> None:
    down = script(tmp_path / "down", "touch ran\n")
    os.chown(down, NOBODY, NOBODY)  # since up checked it
    record = ScriptRecord("lan", tmp_path / "up", down, ENV)
    with pytest.raises(UndoneWithError) as caught:
        record.undo(CTX, rollback=False)
    assert "not run: " in str(caught.value) and "belongs to uid 65534 (nobody)" in str(caught.value)
    assert not (tmp_path / "ran").exists()


def test_a_missing_or_failing_down_script_is_reported_once(tmp_path: Path) -> None:
    record = ScriptRecord("lan", tmp_path / "up", tmp_path / "gone", ENV)
    with pytest.raises(UndoneWithError, match=r"down_script `.*/gone vl-abc` not run: .*/gone does not "
                                              r"exist"):
        record.undo(CTX, rollback=False)
    failing = ScriptRecord("lan", tmp_path / "up", script(tmp_path / "down", "echo busy >&2; exit 1\n"), ENV)
    with pytest.raises(UndoneWithError, match=r"failed with exit status 1; its output:\n  \| busy"):
        failing.undo(CTX, rollback=False)
    ScriptRecord("lan", tmp_path / "up", None, ENV).undo(CTX, rollback=False)  # no down_script: nothing


# --- exactly once, through the executor's journal ----------------------------------------------------


@pytest.fixture
def journal(run_dir: Path) -> Journal:
    """The journal of lab t in a run root of its own (VMLAUNCH_RUN_DIR: conftest's run_dir)."""
    return Journal(RunDir(run_dir / "t"))


def wired(tmp_path: Path, up_body: str = 'echo "up $1" >> log\n') -> TapScript:
    up = script(tmp_path / "up", up_body)
    down = script(tmp_path / "down", 'echo "down $1 $VMLAUNCH_ACTION" >> log\n')
    return TapScript(network="lan", up_script=up, down_script=down, env=ENV)


def test_a_failing_up_script_runs_its_down_script_once(tmp_path: Path, journal: Journal) -> None:
    """It may have done half its work: the claim journaled before it started is undone."""
    resource = wired(tmp_path, 'echo "up $1" >> log\necho "half done" >&2\nexit 2\n')
    with pytest.raises(ScriptFailed, match="half done"), contextlib.ExitStack() as stack:
        executor._apply(resource, CTX, journal, stack)
    assert lines(tmp_path / "log") == ["up vl-abc", "down vl-abc down"]
    assert journal.resources == []


def test_a_later_failure_runs_the_down_script_once(tmp_path: Path, journal: Journal) -> None:
    resource = wired(tmp_path)
    with pytest.raises(RuntimeError), contextlib.ExitStack() as stack:
        executor._apply(resource, CTX, journal, stack)
        assert [(e.kind, e.key) for e in journal.resources] == [("script", "vl-abc")]  # the claim replaced
        raise RuntimeError("QEMU did not start")
    assert lines(tmp_path / "log") == ["up vl-abc", "down vl-abc down"]
    assert journal.resources == []


def test_an_up_killed_in_the_up_script_leaves_the_claim_for_down(tmp_path: Path, journal: Journal) -> None:
    resource = wired(tmp_path)
    stack = contextlib.ExitStack()
    claim = resource.claim(CTX)
    assert claim is not None
    executor._apply(claim, CTX, journal, stack)  # journaled: then vmlaunch is killed
    stack.pop_all()
    again = Journal.load(journal.run_dir)
    assert [(e.kind, e.key) for e in again.resources] == [("script", "vl-abc (starting)")]
    assert executor.down(journal.run_dir) is True
    assert lines(tmp_path / "log") == ["down vl-abc down"]
    assert not journal.run_dir.path.exists()


def test_down_runs_the_script_recorded_at_up(tmp_path: Path, journal: Journal) -> None:
    """The journal holds the script and its environment: a spec changed since does not matter."""
    resource = wired(tmp_path)
    with contextlib.ExitStack() as stack:
        executor._apply(resource, CTX, journal, stack)
        stack.pop_all()
    record = json.loads(journal.path.read_text())["resources"][0]["record"]
    assert record["down_script"] == str(tmp_path / "down") and record["env"]["mac"] == ENV.mac
    script(tmp_path / "down", 'echo "down $1" >> log\nexit 5\n')  # changed since, and now failing
    with pytest.raises(RuntimeFailure, match="exit status 5"):
        executor.down(journal.run_dir)
    assert lines(tmp_path / "log") == ["up vl-abc", "down vl-abc"]
    assert executor.down(journal.run_dir) is False  # reported once, and never run again
    assert lines(tmp_path / "log") == ["up vl-abc", "down vl-abc"]


# --- the Open vSwitch example's scripts, against a stand-in ovs-vsctl ---------------------------------


def test_the_open_vswitch_scripts_ask_ovs_vsctl_as_documented(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What examples/ovs-ifup and ovs-ifdown pass to ovs-vsctl (tests/test_e2e_wiring.py runs them
    against a real Open vSwitch where it is installed)."""
    from tests.conftest import EXAMPLES

    fake = tmp_path / "bin"
    fake.mkdir()
    script(fake / "ovs-vsctl", f'for word in "$@"; do echo "$word"; done > {tmp_path}/argv\necho ---\n')
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    env = ScriptEnv(lab="ovs", vm="left", nic=0, network="ovs", tap="vl-abc", mac="52:54:00:be:45:79")
    run_checked(EXAMPLES / "ovs-ifup", env, "up", "network ovs: up_script")
    assert lines(tmp_path / "argv") == [
        "--timeout=10", "--", "--may-exist", "add-port", "br-lab", "vl-abc",
        "--", "set", "interface", "vl-abc", 'external-ids:vmlaunch-lab="ovs"',
        'external-ids:vmlaunch-vm="left"', 'external-ids:attached-mac="52:54:00:be:45:79"']
    monkeypatch.setenv("OVS_BRIDGE", "br-test")
    monkeypatch.setenv("OVS_TAG", "42")
    run_checked(EXAMPLES / "ovs-ifup", env, "up", "network ovs: up_script")
    assert lines(tmp_path / "argv")[3:7] == ["add-port", "br-test", "vl-abc", "tag=42"]
    run_checked(EXAMPLES / "ovs-ifdown", env, "down", "network ovs: down_script")
    assert lines(tmp_path / "argv") == ["--timeout=10", "--if-exists", "del-port", "br-test", "vl-abc"]
