"""Reaching a libvirt host: its libvirtd through libvirt's own Python binding, its shell over SSH.

The binding is `libvirt-python` (PyPI's, the `hosts` extra, built against Debian's libvirt-dev by
`make setup`): it installs into vmlaunch's venv whatever Python made it, and is pinned with vmlaunch's
other dependencies; Debian's python3-libvirt lives in the system Python's dist-packages, which a venv
does not see. It is imported only here, only by a multi-host lab's commands.

A host that does not answer costs one timeout per process, not one per call: `connect` first opens a
plain TCP connection to the URI's SSH, TCP or TLS port (10 s), which a dead host refuses or lets time
out; libvirt's own connect over SSH would wait for SSH's much longer one. What failed once is
remembered (`broken`): later calls of the same process fail at once with the same words.
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import threading
from typing import Any

from vmlaunch.errors import HostError
from vmlaunch.spec.hosts import SSH_PORT, HostUri, parse_uri

CONNECT_TIMEOUT = 10.0
KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 5, 3  # a host silent for 15 s is gone
LIBVIRT_PORTS = {"tcp": 16509, "tls": 16514}

_lock = threading.Lock()
_open: dict[str, Any] = {}  # uri -> virConnect
broken: dict[str, str] = {}  # uri -> why it could not be reached


class HostUnreachable(HostError):
    """A libvirt host that does not answer, or refuses us (exit 3)."""


def binding() -> Any:
    """The `libvirt` module, or a HostError saying how to install it."""
    try:
        import libvirt
    except ImportError:
        raise HostError(
            "a lab with [host.NAME] tables needs libvirt's Python binding, which is not installed",
            "run `make setup`, or: apt-get install libvirt-dev pkg-config && "
            ".venv/bin/pip install 'libvirt-python>=9.0'",
        ) from None
    _start_events(libvirt)
    return libvirt


_events_started = False


def _start_events(libvirt: Any) -> None:
    """Once per process: libvirt's default event loop on a thread of its own, which its keepalive
    needs (a host that stops answering, its network cut, is dropped in 15 s instead of hanging a
    call), and errors raised, not also printed."""
    global _events_started
    with _lock:
        if _events_started:
            return
        _events_started = True
        libvirt.registerErrorHandler(lambda *_: None, None)
        libvirt.virEventRegisterDefaultImpl()

    def loop() -> None:
        while True:
            libvirt.virEventRunDefaultImpl()

    threading.Thread(target=loop, name="libvirt-events", daemon=True).start()


def libvirt_error(exc: Exception) -> str:
    """libvirt's own words for an error, without the function it came from."""
    get = getattr(exc, "get_error_message", None)
    text = get() if get is not None else None
    return str(text or exc).strip()


def _probe(uri: HostUri) -> str | None:
    """Why the URI's host cannot be reached at its transport's port, or None."""
    if uri.local or uri.hostname is None:
        return None
    port = uri.port or (SSH_PORT if uri.ssh else LIBVIRT_PORTS.get(uri.transport))
    if port is None:
        return None
    try:
        socket.getaddrinfo(uri.hostname, port, type=socket.SOCK_STREAM)
    except OSError:  # a name only the SSH configuration knows (a Host alias): SSH itself finds it
        return None
    try:
        with socket.create_connection((uri.hostname, port), timeout=CONNECT_TIMEOUT):
            return None
    except socket.timeout:
        return f"{uri.hostname}:{port} did not answer in {CONNECT_TIMEOUT:.0f} s"
    except OSError as exc:
        return f"{uri.hostname}:{port}: {exc.strerror or exc}"


def connect(name: str, uri_text: str) -> Any:
    """The host's libvirt connection (one per process and URI), or HostUnreachable naming the host."""
    with _lock:
        if uri_text in _open:
            return _open[uri_text]
        if uri_text in broken:
            raise HostUnreachable(f"host {name} ({uri_text}) cannot be reached: {broken[uri_text]}")
    libvirt = binding()
    why = _probe(parse_uri(uri_text))
    conn = None
    if why is None:
        try:
            conn = libvirt.open(uri_text)
            with contextlib.suppress(libvirt.libvirtError):  # a local connection has none
                conn.setKeepAlive(KEEPALIVE_INTERVAL, KEEPALIVE_COUNT)
        except libvirt.libvirtError as exc:
            why = libvirt_error(exc)
    with _lock:
        if conn is None:
            broken[uri_text] = why or "no answer"
            raise HostUnreachable(
                f"host {name} ({uri_text}) cannot be reached: {broken[uri_text]}",
                "start libvirtd there, or check the URI, its user and key",
            )
        _open[uri_text] = conn
        return conn


def failed(uri_text: str, conn: Any, exc: Exception) -> str:
    """libvirt's words for a call on `conn` that failed. When the connection itself is gone (its
    libvirtd died, the host went silent), it is forgotten: later calls of this process fail at once."""
    why = libvirt_error(exc)
    alive = False
    with contextlib.suppress(Exception):
        alive = bool(conn.isAlive())
    if not alive:
        with _lock:
            _open.pop(uri_text, None)
            broken[uri_text] = why
        with contextlib.suppress(Exception):
            conn.close()
    return why


def shell(name: str, uri_text: str, script: str, timeout: float = 60.0) -> str:
    """Run a POSIX sh script on the host: here for a local URI, else over SSH with the user, port and
    key of its URI. Its standard output, or HostUnreachable / HostError with what it said."""
    uri = parse_uri(uri_text)
    with _lock:
        if uri_text in broken:
            raise HostUnreachable(f"host {name} ({uri_text}) cannot be reached: {broken[uri_text]}")
    if uri.local:
        argv = ["sh", "-s"]
    elif uri.ssh:
        argv = [*uri.ssh_argv(), "sh", "-s"]
    else:
        raise HostError(
            f"host {name} is reached over {uri.transport}: vmlaunch cannot run its host-side set-up there",
            "reach it with qemu+ssh://",
        )
    try:
        done = subprocess.run(
            argv, input=script, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise HostUnreachable(
            f"host {name}: {shlex.join(argv[:-2])} did not end in {timeout:.0f} s"
        ) from None
    except OSError as exc:
        raise HostError(
            f"cannot run {argv[0]}: {exc.strerror or exc}",
            "install OpenSSH's client: apt-get install openssh-client",
        ) from None
    if done.returncode == 255 and uri.ssh:
        raise HostUnreachable(f"host {name}: ssh to {uri.target} failed: {done.stderr.strip()[-300:]}")
    if done.returncode != 0:
        raise HostError(f"host {name}: {done.stderr.strip()[-500:] or f'exit {done.returncode}'}")
    return done.stdout
