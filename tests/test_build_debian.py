"""tools/build_debian.py takes the Debian archive from apt's own sources on the machine: sample
/etc/apt trees (one-line and deb822 files) in a tmp dir, no archive or mmdebstrap needed."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools import build_debian
from tools.build_debian import BuildError, Source, archive_sources

KEY = "/usr/share/keyrings/debian-archive-keyring.gpg"


def apt_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """An /etc/apt with the given files (paths relative to it)."""
    etc = tmp_path / "etc-apt"
    (etc / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (etc / name).write_text(text)
    return etc


def lines(etc: Path, lists: Path | None = None, environ: dict[str, str] | None = None
          ) -> tuple[list[str], list[str]]:
    sources, missing = archive_sources(etc, lists or etc / "no-lists", environ or {})
    return [s.line() for s in sources], missing


def test_one_line_sources_list(tmp_path: Path) -> None:
    etc = apt_tree(tmp_path, {"sources.list": (
        "# deb http://mirror.example/debian bookworm main\n"
        "deb http://mirror.example/debian bookworm main contrib non-free-firmware # a comment\n"
        "deb-src http://mirror.example/debian bookworm main\n"
        "deb\thttp://mirror.example/debian bookworm-updates main\n"
        "deb http://mirror.example/debian bookworm-backports main\n"
        "deb http://mirror.example/debian trixie main\n"
        "deb http://security.mirror.example/debian-security bookworm-security main\n"
        "\n   \n"
        "deb http://mirror.example/flat ./\n"
    )})
    got, missing = lines(etc)
    assert got == [
        "deb http://mirror.example/debian bookworm main contrib non-free-firmware",
        "deb http://mirror.example/debian bookworm-updates main",
        "deb http://security.mirror.example/debian-security bookworm-security main",
    ]
    assert missing == []


def test_one_line_options_are_kept(tmp_path: Path) -> None:
    etc = apt_tree(tmp_path, {"sources.list.d/debian.list": (
        f"deb [ arch=amd64 signed-by={KEY} ] http://mirror.example/debian bookworm main\n"
        f"deb [signed-by={KEY}] http://mirror.example/debian-security bookworm-security main\n"
    )})
    got, missing = lines(etc)
    assert got == [
        f"deb [arch=amd64 signed-by={KEY}] http://mirror.example/debian bookworm main",
        f"deb [signed-by={KEY}] http://mirror.example/debian-security bookworm-security main",
    ]
    assert missing == ["bookworm-updates"]


def test_deb822_sources(tmp_path: Path) -> None:
    etc = apt_tree(tmp_path, {"sources.list.d/debian.sources": (
        "Types: deb deb-src\n"
        "# a comment inside the stanza\n"
        "URIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates bookworm-backports\n"
        "Components: main non-free-firmware\n"
        f"Signed-By: {KEY}\n"
        "\n"
        "Types: deb\n"
        "URIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
        "Check-Valid-Until: no\n"
        "\n"
        "Types: deb-src\n"
        "URIs: http://mirror.example/sources-only\n"
        "Suites: bookworm\n"
        "Components: main\n"
        "\n"
        "Types: deb\n"
        "URIs: http://mirror.example/disabled\n"
        "Suites: bookworm\n"
        "Components: main\n"
        "Enabled: no\n"
    )})
    got, missing = lines(etc)
    assert got == [
        f"deb [signed-by={KEY}] http://mirror.example/debian bookworm main non-free-firmware",
        f"deb [signed-by={KEY}] http://mirror.example/debian bookworm-updates main non-free-firmware",
        "deb [check-valid-until=no] http://mirror.example/debian-security bookworm-security main",
    ]
    assert missing == []


def test_other_suites_and_components_are_left_out(tmp_path: Path) -> None:
    """A third-party repository named after the release without main, other releases, another
    release's deb822 file: none is an entry of the archive for bookworm."""
    etc = apt_tree(tmp_path, {
        "sources.list.d/vendor.list": "deb https://vendor.example/apt cloud-sdk-bookworm main\n"
                                      "deb https://vendor.example/linux/debian bookworm stable\n",
        "sources.list.d/node.sources": "Types: deb\nURIs: https://vendor.example/node\n"
                                       "Suites: nodistro\nComponents: main\n",
        "sources.list.d/debian.sources": "Types: deb\nURIs: http://mirror.example/debian\n"
                                         "Suites: trixie trixie-updates\nComponents: main\n",
        "sources.list.d/ignored.list.disabled": "deb http://mirror.example/debian bookworm main\n",
    })
    with pytest.raises(BuildError) as caught:
        lines(etc)
    message = str(caught.value)
    assert "no `deb` entry for bookworm with component main" in message
    assert str(etc / "sources.list.d" / "debian.sources") in message
    assert str(etc / "sources.list.d" / "vendor.list") in message
    assert "ignored.list.disabled" not in message
    assert "suites found: bookworm, cloud-sdk-bookworm, nodistro, trixie, trixie-updates" in message
    assert build_debian.MIRROR_ENV in message


def test_no_sources_at_all(tmp_path: Path) -> None:
    etc = apt_tree(tmp_path, {})
    with pytest.raises(BuildError, match=r"read: no sources in .*suites found: none"):
        lines(etc)


def test_components_of_split_entries_are_merged(tmp_path: Path) -> None:
    etc = apt_tree(tmp_path, {
        "sources.list": "deb http://mirror.example/debian bookworm non-free-firmware\n"
                        "deb http://mirror.example/debian/ bookworm main contrib\n",
    })
    got, missing = lines(etc)
    assert got == ["deb http://mirror.example/debian bookworm non-free-firmware main contrib"]
    assert missing == ["bookworm-updates", "bookworm-security"]


def test_release_origin_other_than_debian_is_left_out(tmp_path: Path) -> None:
    """A third-party repository whose suite is bookworm with a main component: apt's lists say
    its origin is not Debian."""
    etc = apt_tree(tmp_path, {"sources.list": (
        "deb https://vendor.example/repo bookworm main\n"
        "deb http://mirror.example/debian bookworm main\n"
    )})
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "vendor.example_repo_dists_bookworm_InRelease").write_text("Origin: Vendor\nSuite: x\n")
    (lists / "mirror.example_debian_dists_bookworm_InRelease").write_text("Origin: Debian\n")
    got, _ = lines(etc, lists)
    assert got == ["deb http://mirror.example/debian bookworm main"]


def test_lists_file_names_as_apt_does() -> None:
    assert build_debian.lists_file("http://mirror.example/debian", "bookworm", "InRelease") == (
        "mirror.example_debian_dists_bookworm_InRelease")
    assert build_debian.lists_file("https://u:p@mirror.example:8080/de~b_x/", "bookworm", "Release") == (
        "mirror.example:8080_de%7eb%5fx_dists_bookworm_Release")


def test_embedded_key_is_refused(tmp_path: Path) -> None:
    etc = apt_tree(tmp_path, {"sources.list.d/debian.sources": (
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\nComponents: main\n"
        "Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n mQINBF\n"
        " -----END PGP PUBLIC KEY BLOCK-----\n"
    )})
    with pytest.raises(BuildError, match="embedded in Signed-By"):
        lines(etc)


def test_mirror_environment_replaces_apt_sources(tmp_path: Path) -> None:
    etc = apt_tree(tmp_path, {"sources.list": "deb http://mirror.example/debian trixie main\n"})
    env = {build_debian.MIRROR_ENV: "http://local.example/debian"}
    got, missing = lines(etc, environ=env)
    assert got == ["deb http://local.example/debian bookworm main",
                   "deb http://local.example/debian bookworm-updates main"]
    assert missing == ["bookworm-security"]
    env[build_debian.SECURITY_MIRROR_ENV] = "file:/srv/debian-security"
    got, missing = lines(etc, environ=env)
    assert got[-1] == "deb file:/srv/debian-security bookworm-security main" and missing == []
    with pytest.raises(BuildError, match="is not a URI"):
        lines(etc, environ={build_debian.MIRROR_ENV: "local mirror"})
    with pytest.raises(BuildError, match="is set but"):
        lines(etc, environ={build_debian.SECURITY_MIRROR_ENV: "http://local.example/s"})


def test_sources_are_not_in_the_cache_key() -> None:
    """The image's inputs hash names the builder and GRUB, not which mirror served the archive:
    an up-to-date image is found so without reading apt's sources."""
    assert set(build_debian.input_hashes()) == {"builder-sha256", *build_debian.GRUB_PACKAGES}


def test_source_line_round_trips() -> None:
    source = Source("http://mirror.example/debian", "bookworm", ("main",), (f"signed-by={KEY}",), "x")
    assert build_debian.parse_one_line(source.line(), "y") == [source._replace(where="y:1")]


HOLD = ("import fcntl, sys, time\n"
        "handle = open(sys.argv[1], 'r+b')\n"
        "fcntl.lockf(handle, fcntl.LOCK_EX)  # as apt takes /var/lib/dpkg/lock-frontend\n"
        "print('held', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n")
COMM = Path(sys.executable).name[:15]  # the holder's name, as /proc/PID/comm keeps it


@contextlib.contextmanager
def another_apt(lock: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """A process that holds `lock` for `seconds`, as another apt would (fcntl locks of one process
    never block each other, so it must be another process)."""
    lock.touch()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_the_build_waits_for_another_apt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "lock-frontend"
    build_debian.wait_for_apt(lock, bound=5)  # no such file: nothing to wait for
    build_debian.wait_for_apt(lock, bound=5)
    assert capsys.readouterr().out == ""
    with another_apt(lock, 1.0) as holder:
        began = time.monotonic()
        build_debian.wait_for_apt(lock, bound=30, poll=0.1)
        waited = time.monotonic() - began
        assert holder.wait(5) == 0  # it ended on its own: the wait lasted as long as the lock
    assert 0.5 < waited < 10
    assert capsys.readouterr().out.splitlines() == [
        f"build_debian: waiting for another apt or dpkg (pid {holder.pid}: {COMM}) to release {lock}, "
        "at most 30 s",
        f"build_debian: {lock} is free: going on"]


def test_the_wait_for_another_apt_has_a_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "lock-frontend"
    with another_apt(lock, 60) as holder:
        with pytest.raises(BuildError) as raised:
            build_debian.wait_for_apt(lock, bound=0.5, poll=0.1)
        assert holder.poll() is None
    assert str(raised.value) == (
        f"another apt or dpkg (pid {holder.pid}: {COMM}) still holds {lock} after 0.5 s: let it finish "
        "(or stop it), then run tools/build_debian.py again")
    assert "waiting for another apt or dpkg" in capsys.readouterr().out
