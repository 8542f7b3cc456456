"""The command channel without a VM: the host's client (runtime/agent.py) against vmlaunch's Python
agent (guests/guest_agent.py, run here on a socket instead of a virtio-serial port), against a fake
QEMU guest agent and against agents that lie, hang or close; what the rig makes of the results; the
tar streams a guest sends back."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vmlaunch.errors import AgentError, CommandTimedOut, RuntimeFailure, UsageError
from vmlaunch.guests import guest_agent
from vmlaunch.layout.rundir import RunDir
from vmlaunch.runtime import agent
from vmlaunch.runtime.rig import CommandFailed, Guest, safe_members, split_vm_path


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="vl-"))  # socket paths are short
    (folder / "lab").mkdir()
    (folder / "lab" / "a.pid").write_text("1\n")
    return RunDir(folder / "lab")


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
        agent.run(python_agent, "a", f"echo begun; (sleep 3; touch {marker}) & sleep 30", timeout=1)
    assert time.monotonic() - started < 10
    assert caught.value.result.stdout == b"begun\n"  # type: ignore[attr-defined]
    time.sleep(3.5)
    assert not marker.exists()  # the whole process group was killed, its background child too


def test_a_command_whose_host_side_goes_away_is_killed(python_agent: RunDir, tmp_path: Path) -> None:
    """What `exec` interrupted (Ctrl-C) leaves: the connection closes mid-command; the agent kills the
    command's process group, and serves the next client."""
    marker = tmp_path / "survived"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(python_agent.vm("a").agent))
    conn.sendall(b"VLA1 hello n1\n")
    assert conn.recv(100) == b"VLA1 n1 ready 1 py\n"
    command = f"sleep 2; touch {marker}".encode()
    conn.sendall(b"VLA1 exec r1 %d 0 0 100\n" % len(command) + command + b"VLA1 end r1\n")
    time.sleep(0.5)
    conn.close()
    time.sleep(3)
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
    serve(run_dir.vm("a").agent, lying_agent(lambda rid: b"", close=False))
    with pytest.raises(AgentError, match="stopped answering"):
        agent.run(run_dir, "a", "true", timeout=1)


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


def test_a_command_word_list_is_quoted_for_the_shell() -> None:
    assert agent.command_line(["printf", "%s", "it's $HOME"]) == b"exec printf %s 'it'\"'\"'s $HOME'"
    assert agent.command_line("ls | wc -l") == b"ls | wc -l"
    assert split_vm_path("a:/tmp/x") == ("a", "/tmp/x")
    assert split_vm_path("./a:b") == (None, "./a:b")
    assert split_vm_path("/abs/a:b") == (None, "/abs/a:b")


def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> tarfile.TarFile:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    buffer.seek(0)
    return tarfile.open(fileobj=buffer, mode="r")


def member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.uid = kind, mode, link, 0
    return info


@pytest.mark.parametrize(("bad", "message"), [
    (member("/etc/passwd"), "outside"),
    (member("x/../../etc/passwd"), "outside"),
    (member("other/file"), "outside"),
    (member("x/dev", tarfile.CHRTYPE), "device node"),
    (member("x/fifo", tarfile.FIFOTYPE), "device node or FIFO"),
    (member("x/link", tarfile.SYMTYPE, link="/etc/shadow"), "links to /etc/shadow"),
    (member("x/link", tarfile.SYMTYPE, link="../../etc"), "outside the copy"),
    (member("x/hard", tarfile.LNKTYPE, link="etc/shadow"), "outside the copy"),
])
def test_a_tar_from_a_guest_is_refused_when_it_reaches_out(bad: tarfile.TarInfo, message: str) -> None:
    with pytest.raises(RuntimeFailure, match=message):
        safe_members(tar_of((member("x", tarfile.DIRTYPE, 0o755), b""), (bad, b"")), "x")


def test_a_tar_from_a_guest_loses_setuid_and_owners() -> None:
    members = safe_members(tar_of((member("x", tarfile.DIRTYPE, 0o3777), b""),
                                  (member("x/sh", mode=0o4755), b"#!"),
                                  (member("x/ok", tarfile.SYMTYPE, link="sh"), b"")), "x")
    assert [(m.name, m.mode, m.uid) for m in members] == [("x", 0o777, os.geteuid()),
                                                         ("x/sh", 0o755, os.geteuid()),
                                                         ("x/ok", 0o644, os.geteuid())]
