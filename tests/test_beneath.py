"""A hostile tar stream unpacked beneath a folder (core/beneath.py), as a guest that replaced its agent
or its `tar` could send: every member type and order that could reach outside the destination, as root
and as an unprivileged user, checked against a canary tree (contents, types, modes and owners) that
must not change; and the merge into a folder that already holds links."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vmlaunch.core import beneath

NOBODY = 65534


def entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644,
          link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.uid, info.size = kind, mode, link, 0, len(data)
    return info, data


def stream_of(*members: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.GNU_FORMAT) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    buffer.seek(0)
    return buffer


def tree_state(root: Path, skip: Path | None = None) -> dict[str, tuple[object, ...]]:
    """Every entry under `root` (not under `skip`): type, mode, owner, content or link target."""
    state: dict[str, tuple[object, ...]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if skip is not None and (path == skip or skip in path.parents):
                continue
            st = os.lstat(path)
            what: object = None
            if stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            state[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                                   st.st_uid, st.st_gid, st.st_nlink, what)
    return state


@pytest.fixture
def host() -> Iterator[Path]:
    """A canary tree beside the destination: files of root and of the user, a folder. In a folder of
    /tmp that the user can reach (pytest's own are root's 0700)."""
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="vl-beneath-"))
    os.chmod(tmp_path, 0o755)
    canary = tmp_path / "canary"
    (canary / "folder").mkdir(parents=True)
    (canary / "secret").write_text("root's\n")
    os.chmod(canary / "secret", 0o600)
    (canary / "users").write_text("the user's\n")
    os.chown(canary / "users", NOBODY, NOBODY)
    os.chown(canary / "folder", NOBODY, NOBODY)
    os.chown(canary, NOBODY, NOBODY)
    (tmp_path / "dest").mkdir()
    os.chown(tmp_path / "dest", NOBODY, NOBODY)
    yield tmp_path
    shutil.rmtree(tmp_path)


def unpack(dest: Path, stream: io.BytesIO, top: str = "x") -> None:
    """As `Guest.copy_from` does: into a staging folder beneath DEST, then merged into DEST."""
    where = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mkdir(".staging", 0o700, dir_fd=where)
        with beneath.opened_dir(where, [".staging"]) as staged:
            beneath.extract(stream, staged, top)
            beneath.merge(staged, top, where, top, str(dest / top))
    finally:
        import shutil

        shutil.rmtree(dest / ".staging", ignore_errors=True)
        os.close(where)


def as_user(action: Callable[[], None]) -> str:
    """`action` in a child process running as nobody; what it raised (its type and message) or ''."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        message = b""
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            action()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            message = f"{type(exc).__name__}: {exc}".encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read().decode()
    os.waitpid(pid, 0)
    return out


DOT = entry("x/dot", tarfile.SYMTYPE, link=".")
# x/dot is x, so x/up is three folders above x: outside the destination, through links only
UP = entry("x/up", tarfile.SYMTYPE, link="dot/dot/dot/../../..")

HOSTILE: dict[str, list[tuple[tarfile.TarInfo, bytes]]] = {
    "a file through a chain of links": [
        entry("x", tarfile.DIRTYPE, mode=0o755), DOT, UP, entry("x/up/canary/secret", data=b"pwned")],
    "a hard link reached through a link": [
        entry("x", tarfile.DIRTYPE), DOT, UP, entry("x/h", tarfile.LNKTYPE, link="x/up/canary/secret"),
        entry("x/h", data=b"pwned", mode=0o777)],
    "a link out, then a file through it": [
        entry("x", tarfile.DIRTYPE), entry("x/out", tarfile.SYMTYPE, link="../../canary"),
        entry("x/out/secret", data=b"pwned")],
    "a link to an absolute path, then a file through it": [
        entry("x", tarfile.DIRTYPE), entry("x/abs", tarfile.SYMTYPE, link="/"),
        entry("x/abs/etc/vmlaunch-pwned", data=b"pwned")],
    "a folder that is a link": [entry("x", tarfile.SYMTYPE, link=".."), entry("x/canary/secret", data=b"p")],
    "dot-dot in a name": [entry("x", tarfile.DIRTYPE), entry("x/../canary/secret", data=b"pwned")],
    "an absolute name": [entry("/canary/secret", data=b"pwned")],
    "another top": [entry("y/secret", data=b"pwned")],
    "a hard link to an absolute name": [entry("x", tarfile.DIRTYPE),
                                        entry("x/h", tarfile.LNKTYPE, link="/etc/passwd")],
    "a hard link climbing out": [entry("x", tarfile.DIRTYPE),
                                 entry("x/h", tarfile.LNKTYPE, link="x/../../canary/secret")],
    "a hard link to a link": [entry("x", tarfile.DIRTYPE), entry("x/l", tarfile.SYMTYPE, link="f"),
                              entry("x/h", tarfile.LNKTYPE, link="x/l")],
    "a device node": [entry("x", tarfile.DIRTYPE), entry("x/null", tarfile.CHRTYPE)],
    "a block device": [entry("x", tarfile.DIRTYPE), entry("x/sda", tarfile.BLKTYPE)],
    "a FIFO": [entry("x", tarfile.DIRTYPE), entry("x/fifo", tarfile.FIFOTYPE)],
    "a file, then a link of the same name out": [
        entry("x", tarfile.DIRTYPE), entry("x/f", data=b"a"),
        entry("x/f", tarfile.SYMTYPE, link="../canary")],
    "a link inside, then a file through it replacing a folder": [
        entry("x", tarfile.DIRTYPE), entry("x/d", tarfile.DIRTYPE), entry("x/d", tarfile.SYMTYPE, link="..")],
    # x/missing/../m/.. is x/m/.., above x, once something makes x/missing (a merge, the user)
    "a link out through a name that does not exist yet": [
        entry("x", tarfile.DIRTYPE), entry("x/m", tarfile.SYMTYPE, link="."),
        entry("x/l", tarfile.SYMTYPE, link="missing/../m/..")],
    "a link that loops": [entry("x", tarfile.DIRTYPE), entry("x/a", tarfile.SYMTYPE, link="b"),
                          entry("x/b", tarfile.SYMTYPE, link="a")],
    "a name longer than a file name": [entry("x", tarfile.DIRTYPE), entry("x/" + "n" * 300, data=b"a")],
    "a file where a folder is needed": [entry("x", data=b"a"), entry("x/y", data=b"b")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("who", ["root", "user"])
def test_a_hostile_stream_changes_nothing_outside_its_destination(host: Path, case: str, who: str) -> None:
    before = tree_state(host, skip=host / "dest")
    etc = tree_state(Path("/etc"), skip=None) if case.startswith("a link to an absolute") else None
    stream = stream_of(*HOSTILE[case])
    if who == "root":
        with pytest.raises(beneath.Refused):
            unpack(host / "dest", stream)
    else:
        assert as_user(lambda: unpack(host / "dest", stream)).startswith("Refused: ")
    assert tree_state(host, skip=host / "dest") == before
    if etc is not None:
        assert tree_state(Path("/etc")) == etc
    assert not (host / "dest" / "x" / "up").exists()


def test_a_hostile_stream_leaves_the_destination_as_it_was(host: Path) -> None:
    (host / "dest" / "x").mkdir()
    (host / "dest" / "x" / "mine").write_text("kept\n")
    (host / "dest" / "x" / "sub").symlink_to(host / "canary" / "folder")
    before = tree_state(host)
    with pytest.raises(beneath.Refused, match="sub is a symbolic link"):
        unpack(host / "dest", stream_of(entry("x", tarfile.DIRTYPE), entry("x/new", data=b"n"),
                                        entry("x/sub", tarfile.DIRTYPE), entry("x/sub/f", data=b"p")))
    assert tree_state(host) == before  # checked whole before anything moved: x/new is not there either


def test_a_second_copy_never_follows_what_the_first_left(host: Path) -> None:
    first = stream_of(entry("x", tarfile.DIRTYPE), entry("x/self", tarfile.SYMTYPE, link="."),
                      entry("x/f", data=b"one"))
    unpack(host / "dest", first)
    assert os.readlink(host / "dest" / "x" / "self") == "."
    before = tree_state(host, skip=host / "dest")
    # the same folder again: x/self is now a folder in the stream, and the link it meets is not followed
    with pytest.raises(beneath.Refused, match="self is a symbolic link"):
        unpack(host / "dest", stream_of(entry("x", tarfile.DIRTYPE), entry("x/self", tarfile.DIRTYPE),
                                        entry("x/self/f", data=b"two")))
    assert (host / "dest" / "x" / "f").read_bytes() == b"one"
    # a file over a link that the user left pointing outside replaces the link, never its target
    (host / "dest" / "x" / "g").symlink_to(host / "canary" / "users")
    unpack(host / "dest", stream_of(entry("x", tarfile.DIRTYPE), entry("x/g", data=b"new")))
    assert (host / "dest" / "x" / "g").read_bytes() == b"new" and not (host / "dest" / "x" / "g").is_symlink()
    assert tree_state(host, skip=host / "dest") == before


def test_a_plain_tree_is_copied_whole_with_links_inside_it(host: Path) -> None:
    unpack(host / "dest", stream_of(
        entry("x", tarfile.DIRTYPE, mode=0o2755), entry("x/sub", tarfile.DIRTYPE, mode=0o500),
        entry("x/sub/run", data=b"#!/bin/sh\n", mode=0o4755), entry("x/rel", tarfile.SYMTYPE, link="sub/run"),
        entry("x/sub/back", tarfile.SYMTYPE, link="../rel"),
        entry("x/hard", tarfile.LNKTYPE, link="x/sub/run"),
        entry("x/dangling", tarfile.SYMTYPE, link="nothing/here"),
        entry("x/sub/run", data=b"replaced\n", mode=0o644),  # a later member of the same name wins
        fmt=tarfile.PAX_FORMAT))
    x = host / "dest" / "x"
    assert (x / "rel").read_bytes() == b"replaced\n" and (x / "sub" / "back").read_bytes() == b"replaced\n"
    assert (x / "hard").read_bytes() == b"#!/bin/sh\n"  # the replacement did not write through the link
    assert stat.S_IMODE((x / "hard").stat().st_mode) == 0o755  # setuid gone
    assert stat.S_IMODE(x.stat().st_mode) == 0o755 and stat.S_IMODE((x / "sub").stat().st_mode) == 0o700
    assert (x / "sub" / "run").stat().st_uid == os.geteuid()


def test_a_copy_as_a_user_belongs_to_the_user(host: Path) -> None:
    stream = stream_of(entry("x", tarfile.DIRTYPE), entry("x/f", data=b"a", mode=0o640))
    assert as_user(lambda: unpack(host / "dest", stream)) == ""
    assert (host / "dest" / "x" / "f").stat().st_uid == NOBODY


def test_headers_and_counts_are_bounded(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    huge = entry("x/" + "n/" * 120 + "f", data=b"a")
    with pytest.raises(beneath.Refused, match="folders deep"):
        monkeypatch.setattr(beneath, "MAX_DEPTH", 100)
        unpack(host / "dest", stream_of(entry("x", tarfile.DIRTYPE), huge, fmt=tarfile.PAX_FORMAT))
    monkeypatch.setattr(beneath, "MAX_HEADER", 1024)
    monkeypatch.setattr(beneath, "CHUNK", 1024)
    with pytest.raises(beneath.Refused, match="header"):
        unpack(host / "dest", stream_of(entry("x/" + "n" * 3000, data=b"a"), fmt=tarfile.PAX_FORMAT))
    monkeypatch.setattr(beneath, "MAX_MEMBERS", 3)
    with pytest.raises(beneath.Refused, match="more than 3 members"):
        unpack(host / "dest", stream_of(*(entry(f"x/{i}", data=b"") for i in range(5))))
    for junk in (b"", b"not a tar stream at all" * 40):
        with pytest.raises(beneath.Refused):
            unpack(host / "dest", io.BytesIO(junk))
    assert sorted(os.listdir(host / "dest")) == []
