"""The command channel without a VM: the host's client (rig/agent.py) against vmlaunch's Python
agent (guests/guest_agent.py, run here on a socket instead of a virtio-serial port), against a fake
QEMU guest agent and against agents that lie, hang or close; what the rig makes of the results; the
tar streams a guest sends back."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vmlaunch.core.wait import wait_until
from vmlaunch.errors import AgentError, CommandTimedOut, RuntimeFailure, UsageError
from vmlaunch.guests import guest_agent
from vmlaunch.layout.rundir import RunDir
from vmlaunch.rig import agent
from vmlaunch.rig.guest import CommandFailed, Guest, split_vm_path


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="vl-"))  # socket paths are short
    (folder / "lab").mkdir()
    (folder / "lab" / "a.pid").write_text("1\n")
    return RunDir(folder / "lab")


def ended(pid: int) -> bool:
    """The process is gone, or dead and not reaped yet (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def serve(path: Path, handler: Callable[[socket.socket], None]) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)

    def loop() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                handler(conn)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def python_agent(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[RunDir]:
    """vmlaunch's Python agent serving the VM's channel socket (one connection at a time)."""
    monkeypatch.setattr(guest_agent, "WORK", str(tmp_path))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(run_dir.vm("a").agent))
    server.listen(4)
    stop = threading.Event()

    def loop() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            channel = guest_agent.Channel.__new__(guest_agent.Channel)
            conn.setblocking(False)
            channel.fd, channel.buffer = conn.fileno(), b""
            try:
                guest_agent.serve(channel)
            except guest_agent.HostGone:
                pass
            finally:
                conn.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield run_dir
    stop.set()
    thread.join(5)
    server.close()


def test_the_python_agent_runs_commands_bytes_safe(python_agent: RunDir) -> None:
    result = agent.run(python_agent, "a", "printf 'out\\0x'; printf err >&2; exit 7")
    assert (result.exit_code, result.stdout, result.stderr, result.truncated) == (7, b"out\0x", b"err", False)
    words = agent.run(python_agent, "a", ["printf", "%s|", "two words", "it's", "$HOME", "a\nb"])
    assert words.stdout == b"two words|it's|$HOME|a\nb|"
    data = bytes(range(256)) * 300
    assert agent.run(python_agent, "a", "cat", input=data).stdout == data
    assert agent.run(python_agent, "a", "kill -9 $$").exit_code == 137


def test_the_python_agent_bounds_output_and_kills_on_timeout(python_agent: RunDir, tmp_path: Path) -> None:
    result = agent.run(python_agent, "a", "head -c 300000 /dev/zero; echo done >&2", limit=1000)
    assert (len(result.stdout), result.truncated, result.stderr) == (1000, True, b"done\n")
    marker = tmp_path / "survived"
    started = time.monotonic()
    with pytest.raises(CommandTimedOut, match="did not end within 1 s") as caught:
        agent.run(python_agent, "a", f"echo begun; (sleep 30; touch {marker}) & echo $!; sleep 30",
                  timeout=1)
    assert time.monotonic() - started < 10
    begun, child = caught.value.result.stdout.splitlines()  # type: ignore[attr-defined]
    assert begun == b"begun"
    # The whole process group was killed, its background child too (it would sleep for 30 s).
    wait_until(lambda: ended(int(child)), 5)
    assert not marker.exists()


def test_a_command_whose_host_side_goes_away_is_killed(python_agent: RunDir, tmp_path: Path) -> None:
    """What `exec` interrupted (Ctrl-C) leaves: the connection closes mid-command; the agent kills the
    command's process group, and serves the next client."""
    marker = tmp_path / "survived"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(python_agent.vm("a").agent))
    conn.sendall(b"VLA1 hello n1\n")
    assert conn.recv(100) == b"VLA1 n1 ready 1 py\n"
    started = tmp_path / "pid"
    command = f"echo $$ >{started}; sleep 30; touch {marker}".encode()
    conn.sendall(b"VLA1 exec r1 %d 0 0 100\n" % len(command) + command + b"VLA1 end r1\n")
    wait_until(lambda: started.exists() and started.read_text().strip(), 10)  # it runs
    pid = int(started.read_text())
    conn.close()
    wait_until(lambda: ended(pid), 5)  # killed with its group (it would sleep for 30 s)
    assert not marker.exists()
    assert agent.run(python_agent, "a", "echo next").stdout == b"next\n"


def test_the_rig_on_the_python_agent(python_agent: RunDir, tmp_path: Path) -> None:
    guest = Guest(python_agent, "a")
    assert guest.succeed("echo hi") == "hi\n"
    with pytest.raises(CommandFailed, match="exited with status 3") as caught:
        guest.succeed("echo shown; exit 3")
    assert "stdout: shown" in str(caught.value)
    assert guest.fail("false") == ""
    flag = tmp_path / "flag"
    guest.succeed(f"(sleep 1; touch {flag}) >/dev/null 2>&1 &")
    assert guest.wait_until_succeeds(f"test -e {flag} && echo yes", timeout=20) == "yes\n"
    with pytest.raises(CommandFailed, match="did not succeed within 1 s"):
        guest.wait_until_succeeds("false", timeout=1)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "x").write_bytes(b"\0" * 5000)
    os.chmod(src / "sub" / "x", 0o640)
    into = tmp_path / "into"
    into.mkdir()
    assert guest.copy_to(src, str(into)) == f"{into}/src"
    assert (into / "src" / "sub" / "x").read_bytes() == b"\0" * 5000
    back = guest.copy_from(f"{into}/src", tmp_path / "back")
    assert back == tmp_path / "back" and oct((back / "sub" / "x").stat().st_mode & 0o777) == "0o640"
    with pytest.raises(CommandFailed, match="cannot read /nonexistent"):
        guest.copy_from("/nonexistent", tmp_path)
    for bad in ("relative", "/with\nnewline"):
        with pytest.raises(UsageError):
            guest.copy_to(src, bad)


def lying_agent(reply: Callable[[str], bytes], *, close: bool = True) -> Callable[[socket.socket], None]:
    def handler(conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        while True:
            line = stream.readline().decode()
            if not line:
                return
            words = line.split()
            if len(words) < 3 or words[0] != "VLA1":  # not a line of the protocol: skipped, as the agents do
                continue
            if words[1] == "hello":
                conn.sendall(f"VLA1 {words[2]} ready 1 fake\n".encode())
            elif words[1] == "exec":
                stream.read(int(words[3]) + int(words[4]))
                stream.readline()
                conn.sendall(reply(words[2]))
                if close:
                    return
    return handler


@pytest.mark.parametrize(("reply", "message"), [
    (lambda rid: f"VLA1 {rid} done 0 0 999999999999 0 0\n".encode(), "announced 999999999999 bytes"),
    (lambda rid: f"VLA1 {rid} done zero\n".encode(), "answered garbage"),
    (lambda rid: f"VLA1 {rid} error the guest is full\n".encode(),
     "could not run the command: the guest is full"),
    (lambda rid: f"VLA1 {rid} done 0 0 10 0 0\nshort".encode(), "closed"),
])
def test_an_agent_that_lies_or_closes_is_an_agent_error(run_dir: RunDir, reply: Callable[[str], bytes],
                                                        message: str) -> None:
    serve(run_dir.vm("a").agent, lying_agent(reply))
    with pytest.raises(AgentError, match=message):
        agent.run(run_dir, "a", "true", timeout=2)


def test_an_agent_that_stops_answering_is_a_hung_channel(run_dir: RunDir,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "GRACE", 0.5)
    serve(run_dir.vm("a").agent, lying_agent(lambda rid: f"VLA1 {rid} done 0 0 10 0 0\nab".encode(),
                                             close=False))
    with pytest.raises(AgentError, match=r"stopped answering \(reading the output\)"):
        agent.run(run_dir, "a", "true", timeout=1)


@pytest.mark.parametrize("babbles", [False, True])
def test_an_agent_that_never_says_the_command_ended_times_out(run_dir: RunDir,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             babbles: bool) -> None:
    """Silence, or lines that are not the answer, after the command was sent: the command times out
    (exit 124) at its timeout and SETTLE, counted from before it was sent, whatever comes meanwhile."""
    monkeypatch.setattr(agent, "SETTLE", 1.0)

    def babble(rid: str) -> bytes:
        return f"VLA1 {rid}x done 0 0 0 0 0\n".encode()  # a line of the protocol, not the answer

    def handler(conn: socket.socket) -> None:
        answer = lying_agent(babble if babbles else lambda rid: b"", close=False)
        if not babbles:
            answer(conn)
            return
        threading.Thread(target=answer, args=(conn,), daemon=True).start()
        with contextlib.suppress(OSError):
            for _ in range(200):  # and again every 50 ms, for 10 s
                time.sleep(0.05)
                conn.sendall(babble("r"))

    serve(run_dir.vm("a").agent, handler)
    started = time.monotonic()
    with pytest.raises(CommandTimedOut, match="did not say it ended it") as caught:
        agent.run(run_dir, "a", "sleep 8", timeout=1)
    assert time.monotonic() - started < 1 + 1 + 2
    assert caught.value.exit_code == 124
    assert caught.value.result.timed_out  # type: ignore[attr-defined]


def test_a_greeting_cut_short_is_sent_again(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the guest, what watched for the host side of a command whose client went away may take the
    first byte of the next client's greeting: the agent then reads a line that is not one, and
    answers nothing until another greeting comes."""
    monkeypatch.setattr(agent, "REGREET", 0.2)
    answer = lying_agent(lambda rid: f"VLA1 {rid} done 0 0 2 0 0\nok".encode())

    def eaten(conn: socket.socket) -> None:
        assert conn.recv(1) == b"V"
        answer(conn)

    serve(run_dir.vm("a").agent, eaten)
    assert agent.run(run_dir, "a", "true", timeout=5, wait=5).stdout == b"ok"


def test_a_channel_that_never_answers_is_opened_again(run_dir: RunDir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The guest's end of the port may miss that a client opened it (one before went away while the
    VM was paused): after REOPEN seconds the channel is opened again."""
    monkeypatch.setattr(agent, "REOPEN", 0.5)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(run_dir.vm("a").agent))
    server.listen(4)
    answer = lying_agent(lambda rid: f"VLA1 {rid} done 0 0 2 0 0\nok".encode())

    def loop() -> None:
        with server:
            deaf, _ = server.accept()  # reads, never answers
            conn, _ = server.accept()
            with deaf, conn:
                answer(conn)

    threading.Thread(target=loop, daemon=True).start()
    assert agent.run(run_dir, "a", "true", timeout=5, wait=10).stdout == b"ok"


def test_no_channel_or_no_lab(run_dir: RunDir, tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="has no command channel") as caught:
        agent.run(run_dir, "a", "true", wait=1)
    assert caught.value.exit_code == 5
    with pytest.raises(RuntimeFailure, match="not running"):
        agent.run(RunDir(tmp_path / "gone"), "a", "true", wait=1)
    with pytest.raises(UsageError, match="give a number of seconds above 0"):
        agent.run(run_dir, "a", "true", timeout=0)
    with pytest.raises(AgentError, match="NUL"):
        agent.run(run_dir, "a", ["printf", "a\0b"])


def fake_qga(exits: dict[str, object]) -> Callable[[socket.socket], None]:
    """QEMU's guest agent, as far as the channel uses it."""
    def handler(conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        while True:
            line = stream.readline()
            if not line:
                return
            request = json.loads(line.lstrip(b"\xff"))
            command, args = request["execute"], request.get("arguments", {})
            if command == "guest-sync-delimited":
                reply: object = args["id"]
                conn.sendall(b"\xff")
            elif command == "guest-exec":
                exits.setdefault("calls", []).append(args)  # type: ignore[attr-defined]
                reply = {"pid": 42}
            else:
                reply = exits["status"]
            conn.sendall(json.dumps({"return": reply}).encode() + b"\n")
    return handler


def test_qemus_guest_agent_is_used_when_it_answers(run_dir: RunDir) -> None:
    seen: dict[str, object] = {"status": {"exited": True, "exitcode": 3,
                                          "out-data": base64.b64encode(b"out").decode(),
                                          "err-data": base64.b64encode(b"err").decode()}}
    serve(run_dir.vm("a").qga, fake_qga(seen))
    result = agent.run(run_dir, "a", "echo hi", input=b"in", wait=5)
    assert (result.exit_code, result.stdout, result.stderr, result.via) == (3, b"out", b"err", "qga")
    call = seen["calls"][0]  # type: ignore[index]
    assert call["arg"][-1] == "echo hi" and base64.b64decode(call["input-data"]) == b"in"


def hung_up_ok(handler: Callable[[socket.socket], None]) -> Callable[[socket.socket], None]:
    """`handler`, for a client that goes away while it still answers."""
    def quietly(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            handler(conn)
    return quietly


def test_qemus_guest_agent_still_running_forever_times_out(run_dir: RunDir,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A qemu-ga (or what stands in its place) that answers "still running" to every poll, also after
    the command was killed: the command times out (exit 124) at its timeout and SETTLE."""
    monkeypatch.setattr(agent, "SETTLE", 1.0)
    seen: dict[str, object] = {"status": {"exited": False}}
    serve(run_dir.vm("a").qga, hung_up_ok(fake_qga(seen)))
    started = time.monotonic()
    with pytest.raises(CommandTimedOut, match="QEMU's guest agent did not say it ended it") as caught:
        agent.run(run_dir, "a", "sleep 8", timeout=1, wait=5)
    assert time.monotonic() - started < 1 + agent.SETTLE + 2
    assert caught.value.exit_code == 124
    assert "kill -KILL" in seen["calls"][1]["arg"][1]  # type: ignore[index]


def endless_qga(piece: bytes, pause: float) -> Callable[[socket.socket], None]:
    """A qemu-ga whose reply to guest-exec-status never ends: `piece` after `piece`, no newline."""
    def handler(conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        with contextlib.suppress(OSError):
            while line := stream.readline():
                request = json.loads(line.lstrip(b"\xff"))
                if request["execute"] == "guest-sync-delimited":
                    answer = {"return": request["arguments"]["id"]}
                    conn.sendall(b"\xff" + json.dumps(answer).encode() + b"\n")
                elif request["execute"] == "guest-exec":
                    conn.sendall(b'{"return": {"pid": 42}}\n')
                else:
                    conn.sendall(b'{"return": {"exited": true, "out-data": "')
                    for _ in range(100_000):
                        conn.sendall(piece)
                        time.sleep(pause)
    return handler


def test_qemus_guest_agent_with_an_endless_reply(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply longer than QGA_LONGEST is refused once that much came; one that trickles forever ends
    at the command's timeout and SETTLE."""
    monkeypatch.setattr(agent, "QGA_LONGEST", 4 << 20)
    serve(run_dir.vm("a").qga, endless_qga(b"A" * 65536, 0))
    started = time.monotonic()
    with pytest.raises(AgentError, match="a line longer than 4194304 bytes"):
        agent.run(run_dir, "a", "true", timeout=60, wait=5)
    assert time.monotonic() - started < 10
    monkeypatch.setattr(agent, "SETTLE", 1.0)
    (run_dir.vm("a").qga).unlink()
    serve(run_dir.vm("a").qga, endless_qga(b"AAAA", 0.01))
    started = time.monotonic()
    with pytest.raises(CommandTimedOut):
        agent.run(run_dir, "a", "true", timeout=1, wait=5)
    assert time.monotonic() - started < 1 + 1 + 2


@pytest.mark.parametrize(("status", "message"), [
    ({"exited": True, "exitcode": 0, "out-data": 7}, "garbage to guest-exec-status"),
    ({"exited": True, "exitcode": 0, "out-data": "not base64!"}, "garbage to guest-exec-status"),
    ({"exited": True, "exitcode": "0"}, "garbage to guest-exec-status"),
    (["exited"], "garbage to guest-exec-status"),
])
def test_qemus_guest_agent_answering_garbage_is_an_agent_error(run_dir: RunDir, status: object,
                                                               message: str) -> None:
    serve(run_dir.vm("a").qga, fake_qga({"status": status}))
    with pytest.raises(AgentError, match=message):
        agent.run(run_dir, "a", "true", timeout=5, wait=5)


def test_qemus_guest_agent_output_is_kept_to_the_limit(run_dir: RunDir) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB
    serve(run_dir.vm("a").qga, fake_qga({"status": {"exited": True, "exitcode": 0,
                                                     "out-data": base64.b64encode(big).decode()}}))
    result = agent.run(run_dir, "a", "true", timeout=5, wait=5, limit=1000)
    assert (result.stdout, result.truncated) == (big[:1000], True)


def test_a_command_word_list_is_quoted_for_the_shell() -> None:
    assert agent.command_line(["printf", "%s", "it's $HOME"]) == b"exec printf %s 'it'\"'\"'s $HOME'"
    assert agent.command_line("ls | wc -l") == b"ls | wc -l"
    assert split_vm_path("a:/tmp/x") == ("a", "/tmp/x")
    assert split_vm_path("./a:b") == (None, "./a:b")
    assert split_vm_path("/abs/a:b") == (None, "/abs/a:b")


def hostile_tar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                *members: tuple[tarfile.TarInfo, bytes]) -> str:
    """The 'guest' (this host, through the Python agent) answers every tar with the stream `members`:
    what a guest whose root replaced its `tar` or its agent sends."""
    from tests.test_beneath import stream_of

    bin_dir = tmp_path / "hostile-bin"
    (bin_dir / "x").mkdir(parents=True)  # what the copy names exists; what comes back is the stream
    (bin_dir / "stream.tar").write_bytes(stream_of(*members).getvalue())
    (bin_dir / "tar").write_text(f"#!/bin/sh\ncat {bin_dir}/stream.tar\n")
    os.chmod(bin_dir / "tar", 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return f"{bin_dir}/x"


def test_copy_from_a_hostile_guest_writes_nothing_outside(python_agent: RunDir, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_beneath import entry, tree_state

    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "secret").write_text("root's\n")
    dest = tmp_path / "dest"
    dest.mkdir()
    source = hostile_tar(tmp_path, monkeypatch, entry("x", tarfile.DIRTYPE),
                         entry("x/dot", tarfile.SYMTYPE, link="."),
                         entry("x/up", tarfile.SYMTYPE, link="dot/dot/../.."),
                         entry("x/h", tarfile.LNKTYPE, link="x/up/canary/secret"),
                         entry("x/h", data=b"pwned", mode=0o777))
    before = tree_state(tmp_path, skip=dest)
    with pytest.raises(RuntimeFailure, match=r"^a: the copy of .*/x was refused: x/up is not a folder"):
        Guest(python_agent, "a").copy_from(source, f"{dest}/")
    assert tree_state(tmp_path, skip=dest) == before
    assert os.listdir(dest) == []  # nor the staging folder


def test_copy_from_merges_without_following_links(python_agent: RunDir, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_beneath import entry

    dest = tmp_path / "dest"
    (dest / "x").mkdir(parents=True)
    (dest / "x" / "sub").symlink_to(tmp_path)
    source = hostile_tar(tmp_path, monkeypatch, entry("x", tarfile.DIRTYPE), entry("x/sub", tarfile.DIRTYPE),
                         entry("x/sub/planted", data=b"p"))
    with pytest.raises(RuntimeFailure, match="x/sub is a symbolic link: a copy never writes through it"):
        Guest(python_agent, "a").copy_from(source, dest)
    assert not (tmp_path / "planted").exists()


def recorder(heard: list[bytes]) -> Callable[[socket.socket], None]:
    """A channel that keeps what it is sent and answers nothing, until the client goes away."""
    def handler(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(4096):
                heard.append(data)
    return handler


def test_qemus_guest_agent_is_not_greeted_when_vmlaunchs_answers(python_agent: RunDir) -> None:
    """qemu-ga with a reply for a client that went away retries its write for as long as no client is
    there (the guest's shutdown then waits 90 s for it): a channel that is not chosen is not greeted."""
    heard: list[bytes] = []
    listening = serve(python_agent.vm("a").qga, recorder(heard))
    result = agent.run(python_agent, "a", "echo hi", wait=5)
    assert (result.stdout, result.via) == (b"hi\n", "agent")
    listening.join(5)  # the client went away: the qga channel was opened, and closed with nothing sent
    assert not listening.is_alive() and heard == []


def test_qemus_guest_agent_is_greeted_when_vmlaunchs_is_silent(run_dir: RunDir) -> None:
    heard: list[bytes] = []
    serve(run_dir.vm("a").agent, recorder(heard))  # a port nobody reads in the guest
    seen: dict[str, object] = {"status": {"exited": True, "exitcode": 0,
                                          "out-data": base64.b64encode(b"out").decode()}}
    serve(run_dir.vm("a").qga, fake_qga(seen))
    started = time.monotonic()
    result = agent.run(run_dir, "a", "true", wait=5)
    assert (result.stdout, result.via) == (b"out", "qga")
    assert agent.PREFER <= time.monotonic() - started < agent.PREFER + 2
    assert heard and heard[0].startswith(b"VLA1 hello ")  # vmlaunch's was greeted first
