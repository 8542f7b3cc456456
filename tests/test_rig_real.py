"""The command channel on the project's test guest (busybox, vmlaunch's sh agent), with the real QEMU
under TCG: `exec` and `cp` from the CLI, `Vm.run`/`succeed`/`fail`/the waits/the copies from the API,
with the guest's only NIC down; timeouts that kill in the guest, bounded output, a guest without the
channel, a hung or closed channel. One lab for the module."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vmlaunch.api import Lab
from vmlaunch.errors import EXIT_AGENT, EXIT_HOST, EXIT_TIMED_OUT, EXIT_USAGE, AgentError, CommandTimedOut
from vmlaunch.rig import agent
from vmlaunch.rig.guest import CommandFailed

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"


@pytest.fixture(scope="module")
def rig(test_guest: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    import tempfile

    folder = tmp_path_factory.mktemp("rig")
    run_root = Path(tempfile.mkdtemp(prefix="vl-"))
    os.environ["VMLAUNCH_RUN_DIR"] = str(run_root)
    spec = folder / "lab.toml"
    spec.write_text(f"""[lab]
name = "rig"
[lab.memory]
ksm = false
[network.wire]
type = "socket"
[vm.a]
memory = "160M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
[[vm.a.nic]]
network = "wire"
[vm.b]
memory = "160M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
[vm.off]
memory = "128M"
accel = "tcg"
agent = false
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
""")
    lab = Lab(spec, wait_for=READY, timeout=300)
    try:
        lab.up()
        yield lab
    finally:
        lab.down(timeout=0)
        del os.environ["VMLAUNCH_RUN_DIR"]
        os.rmdir(run_root)


def vmlaunch(lab: Lab, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], input=input, capture_output=True,
                          timeout=120, check=False, env=os.environ.copy())


def test_exec_passes_status_and_keeps_the_streams_apart_with_every_nic_down(rig: Lab) -> None:
    spec = str(rig.spec)
    a = rig.vm("a")
    a.succeed("ip link set eth0 down")
    assert ",UP" not in a.succeed("ip link show eth0")  # <BROADCAST,MULTICAST>: down
    done = vmlaunch(rig, "exec", spec, "a", "--", "echo out; echo err >&2; exit 7")
    assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n")
    words = vmlaunch(rig, "exec", spec, "a", "--", "printf", "%s|", "two words", "it's", "$HOME")
    assert (words.returncode, words.stdout) == (0, b"two words|it's|$HOME|")
    killed = vmlaunch(rig, "exec", spec, "a", "--", "sh", "-c", "kill -9 $$")
    assert killed.returncode == 128 + 9
    piped = vmlaunch(rig, "exec", "-i", spec, "a", "--", "wc", "-c", input=b"\x00\xff" * 1000)
    assert piped.stdout.strip() == b"2000"
    a.succeed("ip link set eth0 up")


def test_binary_output_and_input_pass_unchanged(rig: Lab) -> None:
    a = rig.vm("a")
    data = bytes(range(256)) * 64
    result = a.run("cat", input=data)
    assert (result.exit_code, result.stdout, result.stderr, result.truncated) == (0, data, b"", False)
    assert a.run(["printf", "%s", "a\nb"]).stdout == b"a\nb"


def test_a_command_that_never_ends_is_killed_in_the_guest(rig: Lab) -> None:
    a = rig.vm("a")
    started = time.monotonic()
    with pytest.raises(CommandTimedOut) as caught:
        a.run("echo started; sleep 1000 & sleep 999; echo never", timeout=2)
    assert time.monotonic() - started < 20
    assert caught.value.result.stdout == b"started\n"  # type: ignore[attr-defined]
    assert caught.value.exit_code == EXIT_TIMED_OUT
    assert a.run("ps").stdout.count(b"sleep 99") == 0  # both sleeps: the whole process group
    timed_out = vmlaunch(rig, "exec", "--timeout", "1", str(rig.spec), "a", "--", "sleep", "100")
    assert timed_out.returncode == EXIT_TIMED_OUT
    assert b"did not end within 1 s" in timed_out.stderr and b"Traceback" not in timed_out.stderr


def test_exec_takes_its_options_after_the_vm(rig: Lab) -> None:
    """Where the help shows them: `exec SPEC VM --timeout 2 -- sleep 8` is `sleep 8` with a timeout
    of 2 s (it was `--timeout 2 -- sleep 8` run in the guest)."""
    started = time.monotonic()
    timed_out = vmlaunch(rig, "exec", str(rig.spec), "a", "--timeout", "2", "--", "sleep", "8")
    assert timed_out.returncode == EXIT_TIMED_OUT, timed_out.stderr
    assert time.monotonic() - started < 7
    assert b"'sleep 8' did not end within 2 s" in timed_out.stderr


def test_an_interrupted_exec_kills_its_command_in_the_guest(rig: Lab) -> None:
    import signal

    running = subprocess.Popen([sys.executable, "-m", "vmlaunch", "exec", "--no-timeout", str(rig.spec), "a",
                                "--", "echo exec-started >/dev/console; sleep 1000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    a = rig.vm("a")
    a.wait_for_console("exec-started", timeout=30)  # the command runs in a's guest
    running.send_signal(signal.SIGINT)
    assert running.wait(30) == 130
    gone = a.wait_until_succeeds("! ps | grep -v grep | grep -q 'sleep 1000' && echo gone", timeout=30)
    assert gone == "gone\n"


def test_output_is_bounded_and_says_so(rig: Lab) -> None:
    a = rig.vm("a")
    result = agent.run(rig.run_dir, "a", "yes | head -c 5000000; echo done >&2", limit=1000)
    assert (len(result.stdout), result.truncated, result.stderr) == (1000, True, b"done\n")
    loud = vmlaunch(rig, "exec", str(rig.spec), "a", "--", "head -c 70000000 /dev/zero")
    assert loud.returncode == 0 and 0 < len(loud.stdout) <= 64 << 20  # this guest's RAM is smaller
    assert b"the output was cut" in loud.stderr
    assert a.run("true").exit_code == 0  # the channel is fine after


def test_succeed_fail_and_the_waits(rig: Lab) -> None:
    b = rig.vm("b")
    assert b.succeed("echo hi") == "hi\n"
    with pytest.raises(CommandFailed, match=r"exited with status 3") as caught:
        b.succeed("echo visible; echo also >&2; exit 3")
    assert "visible" in str(caught.value) and "also" in str(caught.value)
    assert caught.value.result.exit_code == 3
    assert b.fail("false") == ""
    with pytest.raises(CommandFailed, match="expected to fail"):
        b.fail("true")
    b.succeed("rm -f /tmp/flag; (sleep 2; touch /tmp/flag) &")
    assert b.wait_until_succeeds("test -e /tmp/flag && echo there", timeout=30) == "there\n"
    b.succeed("(sleep 1; nc -l -p 8080 >/dev/null) </dev/null >/dev/null 2>&1 &")
    b.wait_for_port(8080, timeout=30)
    with pytest.raises(Exception, match="nothing listened on TCP port 8081 within 1 s"):
        b.wait_for_port(8081, timeout=1)
    with pytest.raises(Exception, match="no systemd"):
        b.wait_for_unit("ssh.service", timeout=5)


def test_cp_round_trips_files_and_folders_with_their_modes(rig: Lab, tmp_path: Path) -> None:
    spec = str(rig.spec)
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "big").write_bytes(os.urandom(10 << 20))
    (src / "sub" / "run.sh").write_text("echo ran\n")
    os.chmod(src / "sub" / "run.sh", 0o750)
    os.symlink("sub/run.sh", src / "link")
    put = vmlaunch(rig, "cp", spec, str(src), "a:/root/")
    assert put.returncode == 0 and put.stdout.decode().strip() == "a:/root/tree", put.stderr
    a = rig.vm("a")
    assert a.succeed("sh /root/tree/link") == "ran\n"
    assert a.succeed("stat -c %a /root/tree/sub/run.sh").strip() == "750"
    back = tmp_path / "back"
    got = vmlaunch(rig, "cp", spec, "a:/root/tree", str(back))
    assert got.returncode == 0, got.stderr
    assert hashlib.sha256((back / "big").read_bytes()).digest() == hashlib.sha256(
        (src / "big").read_bytes()).digest()
    assert stat.S_IMODE((back / "sub" / "run.sh").stat().st_mode) == 0o750
    assert os.readlink(back / "link") == "sub/run.sh"
    between = vmlaunch(rig, "cp", spec, "a:/root/tree/sub/run.sh", "b:/tmp/copied.sh")
    assert between.returncode == 0, between.stderr
    assert rig.vm("b").succeed("cat /tmp/copied.sh") == "echo ran\n"


def test_what_comes_from_a_guest_cannot_harm_the_host(rig: Lab, tmp_path: Path) -> None:
    a = rig.vm("a")
    a.succeed("mkdir -p /root/evil && cp /bin/busybox /root/evil/rootsh && chmod 4755 /root/evil/rootsh"
              " && ln -sf /etc/shadow /root/evil/shadow")
    with pytest.raises(Exception, match="evil/shadow: a link to an absolute path, outside the copy"):
        a.copy_from("/root/evil", tmp_path)
    assert not (tmp_path / "evil").exists() and not list(tmp_path.iterdir())  # nothing left behind
    a.succeed("rm /root/evil/shadow")
    a.copy_from("/root/evil", tmp_path)
    assert stat.S_IMODE((tmp_path / "evil" / "rootsh").stat().st_mode) == 0o755  # no setuid


# What a guest's root can do: replace vmlaunch's agent (init restarts /bin/vmlaunch-agent when it ends)
# with one that answers every `tar -c` with /root/hostile.tar.
HOSTILE_AGENT = r"""set -e
[ -e /root/agent.saved ] || cp /bin/vmlaunch-agent /root/agent.saved
if [ "$1" = on ]; then
    printf '%s\n' '#!/bin/sh' \
        'if grep -q -e "tar -[c] -f -" "$1"; then exec cat /root/hostile.tar; fi' \
        'exec sh -c "$(cat "$1")" sh' >/root/run-hostile
    sed 's|sh -c "$(cat "$W/cmd")" sh|sh /root/run-hostile "$W/cmd"|' /root/agent.saved >/root/agent.new
    grep -q run-hostile /root/agent.new
else
    cp /root/agent.saved /root/agent.new
fi
mv /root/agent.new /bin/vmlaunch-agent
setsid sh -c 'sleep 0.5; for p in /proc/[0-9]*; do
    case "$(tr "\0" " " <"$p/cmdline" 2>/dev/null)" in "sh /bin/vmlaunch-agent"*) kill -9 "${p#/proc/}";; esac
done' </dev/null >/dev/null 2>&1 &
"""


def hostile_agent(vm: Any, on: bool) -> None:
    vm.run(["sh", "-c", "printf HOSTILE >/root/hostile.tar"], timeout=30)
    vm.run(["sh", "-c", HOSTILE_AGENT, "hostile", "on" if on else "off"], timeout=30)
    time.sleep(0.5)  # the old agent is killed after 0.5 s; init's loop starts the new one (the probe sees it)
    probe = "echo 'tar -c -f -' | grep -q . && echo plain"  # the hostile agent answers HOSTILE
    want = "HOSTILE" if on else "plain\n"
    deadline = time.monotonic() + 90  # each try may wait up to the channel's own wait for a greeting
    while time.monotonic() < deadline:
        try:
            if vm.run(["sh", "-c", probe], timeout=10).stdout.decode() == want:
                return
        except Exception:  # noqa: BLE001 - the agent is being replaced
            pass
        time.sleep(0.2)
    raise AssertionError(f"the guest's agent was not switched {'on' if on else 'off'}")


def test_a_guest_that_replaced_its_agent_writes_nothing_outside_its_destination(rig: Lab,
                                                                               tmp_path: Path) -> None:
    """The probe's attack, on the real channel: the guest's root answers `cp` with a tar stream of links
    through links; vmlaunch (root) refuses it with one line, and no host file changes (a canary tree's
    contents, modes and owners). Then a merge into a folder holding a link is refused too."""
    import tarfile

    from tests.test_beneath import entry, stream_of, tree_state

    spec, b = str(rig.spec), rig.vm("b")
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "secret").write_text("root's\n")
    os.chmod(canary / "secret", 0o600)
    dest = tmp_path / "dest"
    dest.mkdir()
    streams = {
        "chain": stream_of(entry("evil", tarfile.DIRTYPE), entry("evil/dot", tarfile.SYMTYPE, link="."),
                           entry("evil/up", tarfile.SYMTYPE, link="dot/dot/../.."),
                           entry("evil/up/canary/secret", data=b"pwned")),
        "hard link": stream_of(entry("evil", tarfile.DIRTYPE), entry("evil/dot", tarfile.SYMTYPE, link="."),
                               entry("evil/up", tarfile.SYMTYPE, link="dot/dot/../.."),
                               entry("evil/h", tarfile.LNKTYPE, link="evil/up/canary/secret"),
                               entry("evil/h", data=b"pwned", mode=0o777)),
        "merge": stream_of(entry("evil", tarfile.DIRTYPE), entry("evil/sub", tarfile.DIRTYPE),
                           entry("evil/sub/secret", data=b"pwned")),
    }
    b.succeed("mkdir -p /root/evil")
    (dest / "evil").mkdir()
    (dest / "evil" / "sub").symlink_to(canary)  # what a first copy or the user left: never followed
    before = tree_state(tmp_path, skip=dest)
    hostile_agent(b, True)
    try:
        for name, stream in streams.items():
            b.run(["sh", "-c", "cat >/root/hostile.tar"], input=stream.getvalue(), timeout=30)
            done = vmlaunch(rig, "cp", spec, "b:/root/evil", f"{dest}/")
            assert done.returncode == 4, (name, done.stderr)
            assert done.stderr.decode().count("\n") <= 2 and b"was refused" in done.stderr, done.stderr
            assert tree_state(tmp_path, skip=dest) == before, name
            with pytest.raises(Exception, match="was refused"):
                b.copy_from("/root/evil", dest)
            assert tree_state(tmp_path, skip=dest) == before, name
    finally:
        hostile_agent(b, False)
    assert sorted(os.listdir(dest)) == ["evil"] and os.listdir(dest / "evil") == ["sub"]


def test_bad_requests_are_one_line_errors(rig: Lab, tmp_path: Path) -> None:
    spec = str(rig.spec)
    cases = [
        (["exec", spec, "nosuch", "--", "true"], EXIT_USAGE, b"no VM named 'nosuch'"),
        (["exec", spec, "a"], EXIT_USAGE, b"no command given"),
        (["exec", spec, "off", "--", "true"], EXIT_AGENT, b"has no command channel"),
        (["cp", spec, "/etc/hostname", "/tmp/x"], EXIT_USAGE, b"neither side names a VM"),
        (["cp", spec, "a:relative", str(tmp_path)], EXIT_USAGE, b"must be absolute"),
        (["cp", spec, str(tmp_path / "missing"), "a:/tmp/"], EXIT_USAGE, b"no such file or folder"),
        (["exec", "--timeout", "0", spec, "a", "--", "true"], EXIT_USAGE, b"more than 0"),
        # busybox's tc has no netem: the guest path says what is missing
        (["netem", spec, "a", "wire", "--delay", "10"], EXIT_HOST, b"no tc of iproute2"),
        (["netem", spec, "a", "wire", "--where", "host", "--delay", "10"], EXIT_USAGE, b"host"),
    ]
    for argv, code, message in cases:
        done = vmlaunch(rig, *argv)
        assert done.returncode == code and message in done.stderr, (argv, done.stderr)
        assert b"Traceback" not in done.stderr


def test_a_channel_nobody_answers_or_that_closes_is_an_agent_error(rig: Lab, tmp_path: Path) -> None:
    """A socket where the agent's should be that accepts and says nothing, then one that closes."""
    files = rig.run_dir.vm("b")
    real = files.agent
    os.rename(real, tmp_path / "agent")
    os.rename(files.qga, tmp_path / "qga")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(real))
        server.listen(1)
        with pytest.raises(AgentError, match="no agent answered"):
            agent.run(rig.run_dir, "b", "true", wait=1)
        server.close()
        os.unlink(real)
        with pytest.raises(AgentError, match="cannot open the channel|has no command channel"):
            agent.run(rig.run_dir, "b", "true", wait=1)
    finally:
        server.close()
        if os.path.exists(real):
            os.unlink(real)
        os.rename(tmp_path / "agent", real)
        os.rename(tmp_path / "qga", files.qga)
    assert rig.vm("b").succeed("echo back") == "back\n"


def test_an_idle_agent_waits_for_a_client_without_polling(rig: Lab) -> None:
    """Between clients the sh agent blocks in a write, which the guest's kernel ends when the host side
    opens: an idle guest starts no process (it polled, a `sleep` each 50 ms to 2 s, before). Counted
    by the guest's last pid (/proc/loadavg), not timed."""
    b = rig.vm("b")

    def last_pid() -> int:
        return int(b.succeed("cat /proc/loadavg").split("/")[-1].split()[1])

    first = last_pid()
    per_command = last_pid() - first  # the processes one command of the agent starts
    before = last_pid()
    time.sleep(3)  # no client: the host side closed
    idle = last_pid() - before - per_command
    assert idle <= 2, f"{idle} processes started while the agent had no client"


def test_a_balloon_the_manager_does_not_size_reports_its_statistics_seldom(rig: Lab) -> None:
    """The lab manager turns a balloon's statistics on for `status`, every HELD_STATS seconds where no
    policy sizes it (each period wakes QEMU and the guest); an auto balloon's come each round."""
    from vmlaunch.core.wait import wait_until
    from vmlaunch.manager.manager import BALLOON, HELD_STATS
    from vmlaunch.qemu.qmp import QuickQmp

    def period() -> object:
        with QuickQmp(rig.run_dir.vm("b").qmp, timeout=10) as qmp:
            return qmp.cmd("qom-get", path=BALLOON, property="guest-stats-polling-interval")

    wait_until(lambda: period() != 0, 30, interval=0.5)  # the manager connects in its first rounds
    assert period() == HELD_STATS
