"""The QMP module against a fake QEMU on a unix socket: both clients read replies, events and errors
the same way."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from vmlaunch.qemu import qmp as qmp_module
from vmlaunch.qemu.qmp import Qmp, QmpError, QuickQmp, result

GREETING = {"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 0}, "package": ""},
                    "capabilities": []}}


class FakeQemu:
    """Answers QMP like QEMU: a greeting, then one reply per command; an event before some replies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(4)
        self.commands: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self.client, args=(conn,), daemon=True).start()

    def client(self, conn: socket.socket) -> None:
        """QMP is a stream of JSON objects, not lines: qemu.qmp sends no newline after its commands."""
        decoder = json.JSONDecoder()
        buffer = ""
        with conn:
            self.send(conn, GREETING)
            while data := conn.recv(4096):
                buffer += data.decode()
                while buffer.strip():
                    try:
                        message, end = decoder.raw_decode(buffer.lstrip())
                    except ValueError:
                        break  # the rest of it is still on its way
                    buffer = buffer.lstrip()[end:]
                    self.commands.append(message)
                    if message["execute"] == "query-status":
                        self.send(conn, {"event": "RESUME", "timestamp": {"seconds": 1, "microseconds": 2}})
                    reply = self.answer(message)
                    self.send(conn, {**reply, "id": message["id"]} if "id" in message else reply)

    @staticmethod
    def send(conn: socket.socket, message: dict[str, Any]) -> None:
        conn.sendall(json.dumps(message).encode() + b"\r\n")

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        command = message["execute"]
        if command in ("qmp_capabilities", "cont"):
            return {"return": {}}
        if command == "query-status":
            return {"return": {"status": "running", "running": True}}
        if command == "balloon":
            return {"return": {}} if message.get("arguments", {}).get("value") else \
                {"error": {"class": "GenericError", "desc": "Parameter 'value' is missing"}}
        return {"error": {"class": "CommandNotFound", "desc": f"The command {command} has not been found"}}

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeQemu]:
    server = FakeQemu(tmp_path / "vm.qmp")
    yield server
    server.close()


def test_result_reads_values_and_errors() -> None:
    assert result("x", {"return": 5}) == 5
    with pytest.raises(QmpError, match="QMP x failed: nope"):
        result("x", {"error": {"desc": "nope"}})


def test_quick_client_skips_events_and_passes_arguments(fake: FakeQemu) -> None:
    with QuickQmp(fake.path, timeout=2) as qmp:
        assert qmp.cmd("query-status")["status"] == "running"
        assert qmp.cmd("balloon", value=1 << 27) == {}
    assert fake.commands[0] == {"execute": "qmp_capabilities"}
    assert fake.commands[-1] == {"execute": "balloon", "arguments": {"value": 1 << 27}}



def test_quick_client_sends_ahead_and_reads_the_answers_in_order(fake: FakeQemu) -> None:
    """`send` writes without waiting (how `up` resumes a wave of VMs at once); `reply` reads each
    answer in turn, skipping events, and a refused command is its error."""
    with QuickQmp(fake.path, timeout=2) as qmp:
        qmp.send("cont")
        qmp.send("query-status")
        qmp.send("frobnicate")
        assert qmp.reply("cont") == {}
        assert qmp.reply("query-status")["status"] == "running"  # the RESUME event before it skipped
        with pytest.raises(QmpError, match="QMP frobnicate failed"):
            qmp.reply("frobnicate")
    assert [c["execute"] for c in fake.commands] == ["qmp_capabilities", "cont", "query-status", "frobnicate"]

@pytest.mark.parametrize("client", [QuickQmp, Qmp])
def test_both_clients_report_a_refused_command_alike(fake: FakeQemu, client: Any) -> None:
    with client(fake.path, timeout=2) as qmp, pytest.raises(QmpError) as info:
        qmp.cmd("frobnicate")
    assert info.value.message == "QMP frobnicate failed: The command frobnicate has not been found"


def test_library_client(fake: FakeQemu) -> None:
    with Qmp(fake.path, timeout=2) as qmp:
        assert qmp.cmd("query-status")["running"] is True
        with pytest.raises(QmpError, match="QMP balloon failed: Parameter 'value' is missing"):
            qmp.cmd("balloon")


@pytest.mark.parametrize("client", [QuickQmp, Qmp])
def test_nobody_listening_is_a_clear_error(tmp_path: Path, client: Any) -> None:
    with pytest.raises(QmpError, match=r"no QMP answer on .*/none.qmp"):
        client(tmp_path / "none.qmp", timeout=0.2)


def test_quick_client_waits_for_qemu_to_listen(tmp_path: Path) -> None:
    path = tmp_path / "late.qmp"
    servers: list[FakeQemu] = []
    timer = threading.Timer(0.2, lambda: servers.append(FakeQemu(path)))
    timer.start()
    try:
        with QuickQmp(path, timeout=3) as qmp:
            assert qmp.cmd("cont") == {}
    finally:
        timer.join()
        for server in servers:
            server.close()


def test_events_wait_in_a_bounded_backlog(fake: FakeQemu, monkeypatch: pytest.MonkeyPatch) -> None:
    """qemu.qmp's own listener keeps every event for ever: a lab manager that lives for weeks would
    grow with each BALLOON_CHANGE. In its place, the last EVENT_BACKLOG wait; older ones are dropped."""
    monkeypatch.setattr(qmp_module, "EVENT_BACKLOG", 3)
    with Qmp(fake.path, timeout=2) as qmp:
        client = qmp.client
        assert client.client._listeners == [cast(Any, client.events)]  # the unbounded default is gone
        for _ in range(5):  # each query-status: a RESUME event first
            qmp.cmd("query-status")
        assert client.dropped_events == 2
        taken = client.take_events()
        assert [event["event"] for event in taken] == ["RESUME"] * 3
        assert taken[0]["timestamp"] == {"seconds": 1, "microseconds": 2}
        assert client.take_events() == []
        qmp.cmd("query-status")
        assert qmp.loop.run_until_complete(client.next_event())["event"] == "RESUME"
