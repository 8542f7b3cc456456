"""A local mirror of the distributions' trees for the image catalog's tests: files served over HTTP on
127.0.0.1, laid out as `vmlaunch image catalog --json` says `image pull` fetches them, with checksum
files written the way each distribution writes its own (GNU lines, BSD lines, clearsigned), and an
OpenPGP key of the tests' own to sign them (a mirror that signs with its own key:
VMLAUNCH_IMAGE_KEYRING)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

from tests.conftest import ROOT

# How each distribution writes its checksum file (their own files, as published)
BSD_STYLE = ("fedora-", "rocky-", "almalinux-")
STAR_STYLE = ("ubuntu-",)


class Mirror:
    """A folder served over HTTP; `put` lays a file at a catalog URL's path."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        handler = lambda *a: _Quiet(*a, directory=str(folder))  # noqa: E731
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def path_of(self, url: str) -> Path:
        return self.folder / urlsplit(url).path.lstrip("/")

    def put(self, url: str, data: bytes) -> Path:
        path = self.path_of(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def remove(self, url: str) -> None:
        self.path_of(url).unlink(missing_ok=True)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def checksum_text(entry: str, files: dict[str, bytes], algo: str) -> str:
    """A checksum file for `files` (name -> bytes) in the style of the distribution of `entry`."""
    if entry.startswith("alpine-"):  # IMAGE.sha512 beside the image: its digest alone
        return hashlib.new(algo, list(files.values())[-1]).hexdigest() + "\n"
    lines = []
    for name, data in files.items():
        digest = hashlib.new(algo, data).hexdigest()
        if entry.startswith(BSD_STYLE):
            lines.append(f"# {name}: {len(data)} bytes")
            lines.append(f"{algo.upper()} ({name}) = {digest}")
        elif entry.startswith(STAR_STYLE):
            lines.append(f"{digest} *{name}")
        else:
            lines.append(f"{digest}  {name}")
    return "\n".join(lines) + "\n"


def algo_of(checksum_url: str) -> str:
    name = checksum_url.rsplit("/", 1)[-1].lower()
    return "sha512" if "512" in name else "sha256"


def tiny_qcow2(folder: Path, tag: str) -> bytes:
    """A small qcow2 image (self-contained), its bytes made distinct by `tag`."""
    path = folder / f"tiny-{hashlib.sha256(tag.encode()).hexdigest()[:8]}.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "4M"], check=True)
    data = path.read_bytes()
    return data + tag.encode().ljust(512, b"\0")  # past the image's data: qemu-img check ignores it


def catalog_json(env: dict[str, str]) -> dict[str, dict[str, object]]:
    done = subprocess.run([sys.executable, "-m", "vmlaunch", "image", "catalog", "--json"], env=env,
                          capture_output=True, text=True, check=True, cwd=ROOT)
    data: dict[str, dict[str, object]] = json.loads(done.stdout)
    return data


class Signer:
    """A throw-away OpenPGP key (gpg) that signs checksum files, and its public keyring."""

    def __init__(self) -> None:
        # gpg-agent's socket path must stay short: not under pytest's long tmp_path
        self.home = Path(tempfile.mkdtemp(prefix="vl-gpg-", dir="/tmp"))
        self._gpg("--quick-gen-key", "vmlaunch test mirror <mirror@example.invalid>", "ed25519", "sign",
                  "never")
        self.keyring = self.home / "mirror-keyring.gpg"
        self.keyring.write_bytes(self._gpg("--export").stdout)

    def _gpg(self, *args: str, data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["gpg", "--batch", "--quiet", "--homedir", str(self.home), "--pinentry-mode",
                               "loopback", "--passphrase", "", *args], input=data, capture_output=True,
                              check=True)

    def detached(self, data: bytes) -> bytes:
        return self._gpg("--detach-sign", "--output", "-", data=data).stdout

    def clearsigned(self, text: str) -> bytes:
        return self._gpg("--clearsign", "--output", "-", data=text.encode()).stdout

    def close(self) -> None:
        subprocess.run(["gpgconf", "--homedir", str(self.home), "--kill", "all"], check=False,
                       capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)


def env_with(base: dict[str, str], **extra: str) -> dict[str, str]:
    env = {**base, **extra}
    return {key: value for key, value in env.items() if value}


def environ() -> dict[str, str]:
    return dict(os.environ)
