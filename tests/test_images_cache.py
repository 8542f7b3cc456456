"""The image cache (vmlaunch/guests/images.py, `vmlaunch image`): real downloads from a real HTTP server on
127.0.0.1, real qcow2 files from qemu-img, real concurrent processes."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import http.server
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from vmlaunch.cli import main
from vmlaunch.errors import HostError, RuntimeFailure, UsageError
from vmlaunch.guests import images
from vmlaunch.spec.model import DiskFormat, Image

ROOT = Path(__file__).resolve().parent.parent
SIZE = 3 << 20
BLOCK = 64 << 10


class FileServer(http.server.ThreadingHTTPServer):
    """Serves `files` by path; `ranges` False ignores Range (always 200), `range_status` answers that
    HTTP status to every request with a Range, `drop_after` closes the connection after that many
    bytes of the next response, `delay` sleeps between 64 KiB blocks. Of the next response too:
    `drip` = (after, every) sends one byte every `every` seconds from byte `after` on (DRIP_MOST of
    them, then closes), `stall_after` sends nothing more from that byte on (for STALL_MOST seconds at
    most, then closes). /endless sends blocks without a Content-Length (ENDLESS_MOST bytes at most),
    /loop redirects to itself; every wait ends when the test does (`stop`)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.ranges = True
        self.range_status: int | None = None
        self.drop_after: int | None = None
        self.drip: tuple[int, float] | None = None
        self.stall_after: int | None = None
        self.delay = 0.0
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.sent = 0  # body bytes, all responses
        self.stop = threading.Event()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


DRIP_MOST = 400  # bytes one response drips
STALL_MOST = 20.0  # seconds a stalled response waits before it closes
ENDLESS_MOST = 256 << 20  # bytes /endless sends before it closes


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        server = cast(FileServer, self.server)
        wanted = self.headers.get("Range")
        server.requests.append((self.path, wanted))
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
            return
        if self.path.startswith("/loop"):
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/endless"):
            self.send_response(200)  # no Content-Length: the body ends when the connection does
            self.end_headers()
            self.send_body(None, 0, ENDLESS_MOST)
            return
        body = server.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        if wanted is not None and server.range_status is not None:
            self.send_response(server.range_status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", wanted or "")
        if server.ranges and match is not None:
            start = int(match[1])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.send_body(body, start, len(body))

    def send_body(self, body: bytes | None, start: int, end: int) -> None:
        """Send `body` (None: zeros) from `start` to `end` as the server's settings say; HTTP/1.0:
        returning closes the connection, short of Content-Length when it is not all sent."""
        server = cast(FileServer, self.server)
        drop, server.drop_after = server.drop_after, None
        drip, server.drip = server.drip, None
        stall, server.stall_after = server.stall_after, None
        offset, dripped = start, 0
        try:
            while offset < end and not server.stop.is_set():
                done = offset - start
                if drop is not None and done >= drop:
                    return
                if stall is not None and done >= stall:
                    server.stop.wait(STALL_MOST)
                    return
                if drip is not None and done >= drip[0]:
                    if dripped == DRIP_MOST:
                        return
                    size, dripped = 1, dripped + 1
                else:
                    size = min(BLOCK, end - offset)
                chunk = bytes(size) if body is None else body[offset:offset + size]
                self.wfile.write(chunk)
                self.wfile.flush()
                offset += len(chunk)
                server.sent += len(chunk)
                pause = drip[1] if drip is not None and done >= drip[0] else server.delay
                if pause:
                    server.stop.wait(pause)
        except OSError:  # the client went away
            return


@pytest.fixture
def server() -> Iterator[FileServer]:
    srv = FileServer()
    thread = threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.stop.set()
        srv.shutdown()
        srv.server_close()


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the test's own; no proxy between the client and 127.0.0.1."""
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "images"


def data(seed: int = 0, size: int = SIZE) -> bytes:
    return hashlib.shake_256(f"image {seed}".encode()).digest(size)


def served(server: FileServer, name: str = "debian", body: bytes | None = None, seed: int = 0) -> Image:
    body = data(seed) if body is None else body
    server.files[f"/{name}.img"] = body
    return Image(name=name, url=f"{server.base}/{name}.img", sha512=hashlib.sha512(body).hexdigest())


def partial_of(image: Image, cache: Path) -> Path:
    assert image.checksum is not None
    algo, digest = image.checksum
    return cache / ".partial" / f"{algo}-{digest}.part"


def spec_of(tmp_path: Path, *images_: Image) -> Path:
    text = "[lab]\nname = \"t\"\n\n[vm.a]\nmemory = 256\n"
    text += f"image = \"{images_[0].name}\"\n" if images_ else ""
    for image in images_:
        text += f"\n[image.{image.name}]\nurl = \"{image.url}\"\n"
        text += f"sha512 = \"{image.sha512}\"\n" if image.sha512 else f"sha256 = \"{image.sha256}\"\n"
    spec = tmp_path / "lab.toml"
    spec.write_text(text)
    return spec


# --- downloads ------------------------------------------------------------------------------------


def test_pull_verifies_and_keeps_the_image_read_only(server: FileServer, cache: Path) -> None:
    image = served(server)
    path = images.pull(image, progress=False)
    assert path == cache / f"sha512-{image.sha512}.img"
    assert path.read_bytes() == data()
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    meta = json.loads((cache / f"sha512-{image.sha512}.json").read_text())
    assert meta["url"] == image.url and meta["names"] == ["debian"]
    assert (meta["size"], meta["format"], meta["virtual_size"]) == (SIZE, "raw", SIZE)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", meta["fetched"])
    assert not list((cache / ".partial").iterdir())  # no partial, no lock file left
    requests = len(server.requests)
    assert images.ensure(image) == path  # cached: trusted by its name, nothing fetched
    assert len(server.requests) == requests


def test_a_dropped_connection_keeps_the_partial_and_the_next_pull_resumes(
        server: FileServer, cache: Path) -> None:
    image = served(server)
    server.drop_after = 1 << 20
    with pytest.raises(RuntimeFailure) as caught:
        images.pull(image, progress=False)
    assert image.url is not None and image.url in caught.value.message
    assert f"closed after {1 << 20} of {SIZE} bytes" in caught.value.message
    assert partial_of(image, cache).stat().st_size == 1 << 20
    path = images.pull(image, progress=False)
    assert path.read_bytes() == data()
    assert server.requests[-1] == ("/debian.img", f"bytes={1 << 20}-")
    assert server.sent == SIZE  # every byte once


def test_a_server_that_ignores_range_restarts_from_zero(server: FileServer, cache: Path) -> None:
    image = served(server)
    server.ranges = False
    part = partial_of(image, cache)
    part.parent.mkdir(parents=True, mode=0o700)
    part.write_bytes(b"stale bytes of another download" * 1000)
    path = images.pull(image, progress=False)
    assert server.requests == [("/debian.img", "bytes=31000-")]  # asked to resume, got a 200
    assert path.read_bytes() == data()


def test_a_complete_partial_is_verified_without_a_download(server: FileServer, cache: Path) -> None:
    """Killed between the last byte and the rename: the server answers 416 to a Range at the end."""
    image = served(server)
    part = partial_of(image, cache)
    part.parent.mkdir(parents=True, mode=0o700)
    part.write_bytes(data())
    assert images.pull(image, progress=False).read_bytes() == data()
    assert server.sent == 0


def test_checksum_mismatch_deletes_the_download_and_names_both_sums(
        server: FileServer, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = served(server)
    wrong = "0" * 128
    spec = spec_of(tmp_path, Image(name="debian", url=good.url, sha512=wrong))
    assert main(["image", "pull", str(spec)]) == 4
    err = capsys.readouterr().err
    assert f"expected sha512 {wrong}" in err
    assert f"got sha512 {good.sha512}" in err
    assert good.url is not None and good.url in err
    assert not list(cache.glob("*.img"))
    assert not list((cache / ".partial").iterdir())


def test_file_urls_are_copied_and_hashed(tmp_path: Path, cache: Path) -> None:
    source = tmp_path / "my image.raw"
    source.write_bytes(data(1))
    image = Image(name="local", url=source.as_uri(), sha256=hashlib.sha256(data(1)).hexdigest())
    part = partial_of(image, cache)
    part.parent.mkdir(parents=True, mode=0o700)
    part.write_bytes(data(1)[:12345])  # resumed like a download
    path = images.ensure(image, progress=False)
    assert path.parent == cache and path.read_bytes() == data(1)
    assert source.read_bytes() == data(1)


def test_a_redirect_to_another_scheme_is_refused(server: FileServer) -> None:
    image = Image(name="x", url=f"{server.base}/redirect", sha256="0" * 64)
    with pytest.raises(RuntimeFailure, match=r"redirects to 'file:///etc/passwd'.*http\(s\) only"):
        images.pull(image, progress=False)


def test_an_image_larger_than_the_limit_is_refused(
        server: FileServer, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "MAX_DOWNLOAD", 1 << 20)
    image = served(server)
    with pytest.raises(RuntimeFailure, match="larger than 1.0 MiB; refused"):
        images.pull(image, progress=False)
    assert not partial_of(image, cache).exists()


def test_a_refused_connection_names_the_url_and_why(cache: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}/x.img"
    with pytest.raises(RuntimeFailure, match=f"downloading {re.escape(url)} failed: Connection refused"):
        images.pull(Image(name="x", url=url, sha256="0" * 64), progress=False)
    assert not list((cache / ".partial").iterdir())  # nothing to resume: no empty partial


def test_two_concurrent_pulls_download_once(server: FileServer, tmp_path: Path, cache: Path) -> None:
    image = served(server)
    server.delay = 0.03  # 48 blocks: about 1.5 s, so the second process comes while the first pulls
    spec = spec_of(tmp_path, image)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pulls = [subprocess.Popen([sys.executable, "-m", "vmlaunch", "image", "pull", str(spec)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [pull.communicate(timeout=60) for pull in pulls]
    assert [pull.returncode for pull in pulls] == [0, 0], outputs
    where = cache / f"sha512-{image.sha512}.img"
    assert [out for out, _ in outputs] == [f"debian: {where}\n"] * 2
    assert server.sent == SIZE
    assert len(server.requests) == 1
    assert any("waiting for another vmlaunch pulling it" in err for _, err in outputs), outputs


# --- progress -------------------------------------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> Iterator[Lines]:
    logger = logging.getLogger("vmlaunch.guests.images")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_progress_lines_when_not_on_a_terminal(
        server: FileServer, lines: Lines, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(images, "PROGRESS_EVERY", 0.05)
    server.delay = 0.005
    images.pull(served(server))  # progress=None: standard error (captured) is no terminal
    progress = [line for line in lines.lines if re.fullmatch(
        r"debian: downloading \d+%, [\d.]+ [KM]iB of 3\.0 MiB, [\d.]+ [KM]iB/s", line)]
    assert progress, lines.lines
    assert lines.lines[0] == f"debian: downloading {server.base}/debian.img (3.0 MiB)"
    assert lines.lines[-1].startswith("debian: sha512 verified, in the cache: ")
    assert "\r" not in capsys.readouterr().err


def test_a_progress_bar_on_request(server: FileServer, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(images, "BAR_EVERY", 0.0)
    images.pull(served(server), progress=True)
    err = capsys.readouterr().err
    assert "\rdebian: downloading [" in err
    last = r"\rdebian: downloading \[#{30}\] 100%, 3\.0 MiB of 3\.0 MiB, [\d.]+ [KMG]iB/s\x1b\[K\n$"
    assert re.search(last, err), err[-200:]


# --- servers that never end, drip, stall, loop or will not resume ---------------------------------


def endless(server: FileServer) -> Image:
    """An image at /endless: a body with no Content-Length that does not end (ENDLESS_MOST bytes)."""
    return Image(name="endless", url=f"{server.base}/endless", sha256="0" * 64)


def test_a_download_without_a_size_stops_at_the_cap_and_is_deleted(
        server: FileServer, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VMLAUNCH_IMAGE_MAX_SIZE", "1M")
    image = endless(server)
    with pytest.raises(RuntimeFailure) as caught:
        images.pull(image, progress=False)
    received = 1 << 20  # the cap, passed by the first bytes that did not fit
    match = re.fullmatch(
        rf"image endless: {re.escape(str(image.url))} sent more than 1\.0 MiB, the most an image may be "
        r"\(VMLAUNCH_IMAGE_MAX_SIZE\): stopped at [\d.]+ MiB \((\d+) bytes\) received; the partial "
        r"download was deleted", caught.value.message)
    assert match is not None, caught.value.message
    assert received < int(match[1]) <= received + images.CHUNK
    assert "VMLAUNCH_IMAGE_MAX_SIZE" in str(caught.value.hint)
    assert not partial_of(image, cache).exists()
    assert server.sent < ENDLESS_MOST  # stopped, not run to the server's end
    assert main(["image", "pull", str(spec_of(tmp_path, image))]) == 4  # one line and a hint
    error = capsys.readouterr().err.split("vmlaunch: error: ")[1].splitlines()
    assert error[0].startswith("image endless: ") and error[1].startswith("  hint: ") and len(error) == 2


def test_a_bad_limit_in_the_environment_is_a_usage_error(
        server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = spec_of(tmp_path, served(server))
    for name, value in (("VMLAUNCH_PULL_SPEED_LIMIT", "fast"), ("VMLAUNCH_PULL_SPEED_TIME", "forever"),
                        ("VMLAUNCH_IMAGE_MAX_SIZE", "0")):
        monkeypatch.setenv(name, value)
        assert main(["image", "pull", str(spec)]) == 64
        assert f"vmlaunch: error: {name}={value!r}: " in capsys.readouterr().err
        monkeypatch.delenv(name)
    assert server.requests == []  # refused before anything was asked


def test_a_download_stops_before_the_file_system_fills_and_is_deleted(
        server: FileServer, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system with 3.5 MiB free (per the fake) that keeps 1 MiB free: the endless download
    stops at 2.5 MiB, a download of 3 MiB does not start."""
    image = endless(server)
    part = partial_of(image, cache)
    looked: list[Path] = []

    def room(folder: Path) -> tuple[int, int]:
        looked.append(folder)
        return (7 << 19) - (part.stat().st_size if part.exists() else 0), 1 << 20

    monkeypatch.setattr(images, "disk_room", room)
    with pytest.raises(RuntimeFailure) as caught:
        images.pull(image, progress=False)
    assert re.fullmatch(
        rf"image endless: downloading {re.escape(str(image.url))} stopped after [\d.]+ MiB: "
        rf"{re.escape(str(part.parent))} has [\d.]+ MiB free, and a download leaves 1\.0 MiB free \(5 % "
        r"of the file system, at least 1\.0 GiB, at most 4\.0 GiB\); the partial download was deleted",
        caught.value.message), caught.value.message
    assert "VMLAUNCH_CACHE_DIR" in str(caught.value.hint)
    assert not part.exists() and set(looked) == {part.parent}
    # with a size, it is refused before it starts
    sized = served(server)
    with pytest.raises(RuntimeFailure, match=r"needs 3\.0 MiB more in .*, which has 3\.5 MiB free, and a "
                                             r"download leaves 1\.0 MiB free \(5 % of the file system"):
        images.pull(sized, progress=False)


def test_a_full_file_system_all_the_same_deletes_the_partial_and_says_where(tmp_path: Path) -> None:
    """Another writer may fill the file system between two looks at its free space."""
    part = tmp_path / "sha256-x.part"
    with open(part, "w+b") as out:
        out.write(b"half an image")
        target = images._Target("debian", part, out, hashlib.sha256())
        failure = images._unwritable(target, OSError(errno.ENOSPC, "No space left on device"))
    assert failure.message == (f"image debian: cannot write {part}: No space left on device; the partial "
                               "download was deleted")
    assert "VMLAUNCH_CACHE_DIR" in str(failure.hint) and not part.exists()


def test_the_reserve_is_5_percent_of_the_file_system_between_1_and_4_gib(tmp_path: Path) -> None:
    room = images.disk_room(tmp_path)
    assert room is not None
    free, reserve = room
    vfs = os.statvfs(tmp_path)
    assert free == vfs.f_bavail * vfs.f_frsize
    assert reserve == min(max(vfs.f_blocks * vfs.f_frsize // 20, 1 << 30), 4 << 30)


@pytest.fixture
def slow_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A minimum of 1 KiB/s over 1 s, so that a slow server is found in about a second or two."""
    monkeypatch.setenv("VMLAUNCH_PULL_SPEED_LIMIT", "1K")
    monkeypatch.setenv("VMLAUNCH_PULL_SPEED_TIME", "1")


@pytest.mark.usefixtures("slow_limits")
def test_a_server_that_drips_is_stopped_below_the_minimum_rate_and_the_pull_resumes(
        server: FileServer, cache: Path, lines: Lines, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "PROGRESS_EVERY", 0.05)
    monkeypatch.setattr(images, "RATE_SHOWN", 0.3)
    image = served(server)
    server.drip = (4 * BLOCK, 0.05)  # 256 KiB at once, then 20 bytes a second
    with pytest.raises(RuntimeFailure) as caught:
        images.pull(image)
    assert re.fullmatch(
        rf"image debian: downloading {re.escape(str(image.url))} is too slow: [\d.]+ B/s over the last "
        r"1 s, below the minimum of 1\.0 KiB/s \(VMLAUNCH_PULL_SPEED_LIMIT over VMLAUNCH_PULL_SPEED_TIME\); "
        r"stopped after 256\.\d KiB of 3\.0 MiB; the partial download is kept",
        caught.value.message), caught.value.message
    hint = str(caught.value.hint)
    assert "resumes" in hint and "VMLAUNCH_PULL_SPEED_LIMIT" in hint and "VMLAUNCH_PULL_SPEED_TIME" in hint
    # the progress lines showed the rate as it fell, and that it was below the minimum
    falling = [line for line in lines.lines if re.fullmatch(
        r"debian: downloading \d+%, 256\.\d KiB of 3\.0 MiB, [\d.]+ B/s \(below the minimum of 1\.0 KiB/s\)",
        line)]
    assert falling, lines.lines
    kept = partial_of(image, cache).stat().st_size
    assert kept > 4 * BLOCK
    assert images.pull(image, progress=False).read_bytes() == data()
    assert server.requests[-1] == ("/debian.img", f"bytes={kept}-")


@pytest.mark.usefixtures("slow_limits")
def test_a_server_that_stalls_is_caught_within_the_window_and_the_pull_resumes(
        server: FileServer, cache: Path) -> None:
    image = served(server)
    server.stall_after = 1 << 20
    with pytest.raises(RuntimeFailure) as caught:
        images.pull(image, progress=False)
    assert caught.value.message == (f"image debian: downloading {image.url} stalled: no data for 1 s after "
                                    "1.0 MiB of 3.0 MiB; the partial download is kept")
    assert partial_of(image, cache).stat().st_size == 1 << 20
    assert images.pull(image, progress=False).read_bytes() == data()
    assert server.requests[-1] == ("/debian.img", f"bytes={1 << 20}-")


def test_a_server_that_drips_then_stalls_is_caught_without_a_minimum_rate(
        server: FileServer, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no minimum rate (0), a drip goes on; the read timeout still ends a stall."""
    monkeypatch.setenv("VMLAUNCH_PULL_SPEED_LIMIT", "0")
    monkeypatch.setattr(images, "TIMEOUT", 0.5)
    image = served(server)
    server.drip = (4 * BLOCK, 0.01)  # DRIP_MOST bytes, then closes: the download is short
    with pytest.raises(RuntimeFailure, match=r"the connection closed after 262544 of 3145728 bytes"):
        images.pull(image, progress=False)
    assert partial_of(image, cache).stat().st_size == 4 * BLOCK + DRIP_MOST
    server.drip, server.stall_after = (0, 0.01), 100  # 100 bytes dripped, then nothing
    with pytest.raises(RuntimeFailure) as caught:
        images.pull(image, progress=False)
    assert caught.value.message.endswith(" stalled: no data for 0.5 s after 256.5 KiB of 3.0 MiB; the "
                                         "partial download is kept"), caught.value.message
    assert partial_of(image, cache).stat().st_size == 4 * BLOCK + DRIP_MOST + 100
    assert images.pull(image, progress=False).read_bytes() == data()


@pytest.mark.parametrize("status", [403, 416, 501])
def test_a_server_that_stops_half_way_then_refuses_ranges_restarts_from_zero(
        server: FileServer, cache: Path, lines: Lines, status: int) -> None:
    image = served(server)
    server.drop_after = 1 << 20
    with pytest.raises(RuntimeFailure, match=f"closed after {1 << 20} of {SIZE} bytes"):
        images.pull(image, progress=False)
    server.range_status = status  # from now on: every request with a Range is refused
    assert images.pull(image, progress=False).read_bytes() == data()
    assert server.requests[-2:] == [("/debian.img", f"bytes={1 << 20}-"), ("/debian.img", None)]
    why = [line for line in lines.lines if "does not resume" in line]
    assert re.fullmatch(rf"debian: the server does not resume downloads \(it answered HTTP {status} "
                        rf"[A-Za-z ]+ to a request from byte {1 << 20}\): starting again from 0", why[0]), why


def test_a_redirect_loop_is_one_line_and_no_retry_is_suggested(
        server: FileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    image = Image(name="loop", url=f"{server.base}/loop", sha256="0" * 64)
    assert main(["image", "pull", str(spec_of(tmp_path, image))]) == 4
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"vmlaunch: error: downloading {image.url} failed: the server redirects in a loop (5 redirects "
        f"from {image.url}, the last to {image.url})",
        "  hint: check the URL, or the mirror's configuration: pulling again will not help"]
    missing = Image(name="gone", url=f"{server.base}/gone.img", sha256="0" * 64)
    assert main(["image", "pull", str(spec_of(tmp_path, missing))]) == 4
    err = capsys.readouterr().err
    assert err.splitlines() == [f"vmlaunch: error: downloading {missing.url} failed: HTTP 404 Not Found",
                                "  hint: check the URL: the server refuses it, and pulling again will "
                                "not help while it does"]


# --- image files ----------------------------------------------------------------------------------


def qemu_img(*args: str) -> None:
    binary = shutil.which("qemu-img")
    if binary is None:
        pytest.fail("qemu-img is missing: run `make setup`")
    subprocess.run([binary, *args], check=True, capture_output=True)


def test_a_qcow2_with_a_backing_file_is_refused(tmp_path: Path, server: FileServer, cache: Path) -> None:
    qemu_img("create", "-q", "-f", "raw", str(tmp_path / "base.raw"), "1M")
    qemu_img("create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", str(tmp_path / "x.qcow2"))
    with pytest.raises(images.UnsafeImage, match=r"names a backing file \('base.raw'\)"):
        images.image_info(tmp_path / "x.qcow2")
    body = (tmp_path / "x.qcow2").read_bytes()
    image = served(server, "x", body)  # a download too: verified, refused, not kept
    with pytest.raises(images.UnsafeImage, match=f"image x \\({re.escape(server.base)}/x.img\\)"):
        images.pull(image, progress=False)
    assert not list(cache.glob("*.img")) and not partial_of(image, cache).exists()
    local = Image(name="y", file=tmp_path / "x.qcow2")
    with pytest.raises(images.UnsafeImage):
        images.ensure(local)


def test_a_qcow2_with_an_external_data_file_is_refused(tmp_path: Path) -> None:
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={tmp_path / 'data.raw'}",
             str(tmp_path / "y.qcow2"), "1M")
    with pytest.raises(images.UnsafeImage, match="external data file"):
        images.image_info(tmp_path / "y.qcow2")


def test_image_info_finds_the_format_and_virtual_size(tmp_path: Path) -> None:
    qemu_img("create", "-q", "-f", "qcow2", str(tmp_path / "z.img"), "64M")
    assert images.image_info(tmp_path / "z.img") == images.ImageInfo(DiskFormat.QCOW2, 64 << 20)
    size = (tmp_path / "z.img").stat().st_size
    assert images.image_info(tmp_path / "z.img", DiskFormat.RAW) == images.ImageInfo(DiskFormat.RAW, size)
    (tmp_path / "r.raw").write_bytes(bytes(4096))
    assert images.image_info(tmp_path / "r.raw") == images.ImageInfo(DiskFormat.RAW, 4096)
    with pytest.raises(RuntimeFailure, match="not a qcow2 image"):
        images.image_info(tmp_path / "r.raw", DiskFormat.QCOW2)


def test_a_file_image_is_hashed_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "base.raw"
    file.write_bytes(data(2, 1 << 20))
    image = Image(name="local", file=file, sha256=hashlib.sha256(file.read_bytes()).hexdigest())
    hashed: list[str] = []
    real = images._hash_stream

    def counting(*args: Any, **kwargs: Any) -> str:
        hashed.append("once")
        return real(*args, **kwargs)

    monkeypatch.setattr(images, "_hash_stream", counting)
    assert images.ensure(image) == file
    assert images.ensure(image) == file
    assert len(hashed) == 1
    os.utime(file, ns=(0, 0))  # another version, as far as anyone can tell: hashed again
    assert images.ensure(image) == file
    assert len(hashed) == 2
    file.write_bytes(data(3, 1 << 20))
    with pytest.raises(RuntimeFailure, match=f"expected sha256 {image.sha256}, got sha256 "):
        images.ensure(image)
    assert file.exists()  # the user's file: never removed


# --- list and rm ----------------------------------------------------------------------------------


def test_list_json_and_rm_by_prefix_and_by_name(
        server: FileServer, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = served(server, "alpha", seed=1), served(server, "beta", seed=2)
    for image in (first, second):
        images.pull(image, progress=False)
    capsys.readouterr()
    assert main(["image", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert set(listed) == {f"sha512-{first.sha512}", f"sha512-{second.sha512}"}
    entry = listed[f"sha512-{first.sha512}"]
    assert entry["names"] == ["alpha"] and entry["url"] == first.url
    assert (entry["format"], entry["size"]) == ("raw", SIZE)
    assert main(["image", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["ID", "NAME(S)", "FORMAT", "SIZE", "FETCHED", "URL"]
    assert table[1].split()[:4] == [str(first.sha512)[:12], "alpha", "raw", "3.0"]
    assert main(["image", "rm", str(first.sha512)[:8]]) == 0
    assert capsys.readouterr().out == f"removed {cache / f'sha512-{first.sha512}.img'}\n"
    assert main(["image", "rm", "beta"]) == 0
    assert images.list_cached() == []
    assert sorted(os.listdir(cache)) == [".partial"]


def test_rm_refuses_unknown_and_ambiguous_ids(server: FileServer, capsys: pytest.CaptureFixture[str]) -> None:
    old = served(server, "debian", seed=1)
    images.pull(old, progress=False)
    new = served(server, "debian", seed=2)  # the image updated upstream, pulled again
    images.pull(new, progress=False)
    capsys.readouterr()
    assert main(["image", "rm", "debian"]) == 64
    err = capsys.readouterr().err
    assert "'debian' is ambiguous: it matches" in err
    assert str(old.sha512)[:12] in err and str(new.sha512)[:12] in err
    assert main(["image", "rm", "abc"]) == 64
    assert "no cached image 'abc' (give at least 8 hex digits of a checksum)" in capsys.readouterr().err
    with pytest.raises(UsageError, match="cached images: "):
        images.remove(["ubuntu"])
    assert len(images.list_cached()) == 2


def test_rm_partial_leaves_a_pull_under_way_alone(
        server: FileServer, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale, busy = served(server, "stale", seed=1), served(server, "busy", seed=2)
    for image in (stale, busy):
        partial_of(image, cache).parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        partial_of(image, cache).write_bytes(b"x" * 1000)
    lock = partial_of(busy, cache).with_suffix(".lock")
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a pull under way holds it
        assert main(["image", "rm", "--partial"]) == 0
        assert capsys.readouterr().out == f"removed {partial_of(stale, cache)}\n"
    assert not partial_of(stale, cache).exists() and partial_of(busy, cache).exists()


def test_an_unsafe_cache_is_a_host_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by everyone, not sticky
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(shared))
    with pytest.raises(HostError, match=f"cannot keep images: refusing to use {re.escape(str(shared))}: "
                                        "others may write in it"):
        images.cache_dir()
