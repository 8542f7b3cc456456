"""The image resource: created sparse when missing, never overwritten, claimed and journaled before
qemu-img runs, removed only by a failing up that created it and only while its VM has not written."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vmlaunch.errors import RuntimeFailure, VmlaunchError
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.base import Context
from vmlaunch.resources.image import Image, ImageClaim, ImageRecord, partial_path
from vmlaunch.runtime import executor
from vmlaunch.spec.model import DiskFormat

CTX = Context(lab="t", qemu_img="qemu-img")


def image(path: Path, fmt: DiskFormat = DiskFormat.RAW, size: int | None = 64 << 20) -> Image:
    return Image(path=path, size=size, format=fmt, vm="a")


def test_creates_sparse_raw(tmp_path: Path) -> None:
    record = image(tmp_path / "a.img").apply(CTX)
    assert record.path == tmp_path / "a.img" and record.created and not record.partial
    st = os.stat(tmp_path / "a.img")
    assert st.st_size == 64 << 20
    assert st.st_blocks * 512 < 1 << 20  # sparse
    assert (record.size, record.mtime_ns, record.inode) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert os.listdir(tmp_path) == ["a.img"]  # the partial file became the image


def test_creates_qcow2(tmp_path: Path) -> None:
    image(tmp_path / "a.qcow2", DiskFormat.QCOW2).apply(CTX)
    assert (tmp_path / "a.qcow2").read_bytes()[:4] == b"QFI\xfb"


def test_never_overwrites(tmp_path: Path) -> None:
    existing = tmp_path / "a.img"
    existing.write_bytes(b"precious")
    assert image(existing).claim(CTX) is None  # nothing to create, nothing claimed
    record = image(existing).apply(CTX)
    assert not record.created
    record.undo(CTX, rollback=True)
    assert existing.read_bytes() == b"precious"


def test_only_a_failing_up_removes_what_it_created(tmp_path: Path) -> None:
    record = image(tmp_path / "b.img").apply(CTX)
    record.undo(CTX, rollback=False)  # down keeps the user's data
    assert (tmp_path / "b.img").exists()
    record.undo(CTX, rollback=True)
    assert not (tmp_path / "b.img").exists()
    record.undo(CTX, rollback=True)  # twice: nothing the second time
    assert "created" in record.describe()


def test_a_rollback_after_the_guest_wrote_keeps_the_image(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    record = image(tmp_path / "b.img").apply(CTX)
    with open(tmp_path / "b.img", "r+b") as disk:  # what a guest that ran does
        disk.seek(1 << 20)
        disk.write(b"the guest's data")
    record.undo(CTX, rollback=True)
    assert (tmp_path / "b.img").exists()
    assert f"kept image {tmp_path}/b.img: this up created it, but its VM has written to it" in caplog.text


def test_failures_are_clear(tmp_path: Path) -> None:
    with pytest.raises(VmlaunchError, match=r"missing does not exist \(on the way to .*/missing/a.img\)"):
        image(tmp_path / "missing" / "a.img").apply(CTX)
    with pytest.raises(RuntimeFailure, match="qemu-img create -f raw .*/a.img 67108864` failed"):
        image(tmp_path / "a.img").apply(Context(lab="t", qemu_img="/nonexistent/qemu-img"))
    assert os.listdir(tmp_path) == []  # the claimed file was given back


def fake_qemu_img(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fake-qemu-img"
    script.write_text(f"#!/bin/sh\n# qemu-img create -q -f FMT TARGET SIZE\ntarget=$5\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_an_image_that_appears_meanwhile_is_never_replaced(tmp_path: Path) -> None:
    fake = fake_qemu_img(tmp_path, f'echo "user" > {tmp_path}/a.img; printf data > "$target"')
    with pytest.raises(RuntimeFailure, match="a.img appeared while qemu-img created it"):
        image(tmp_path / "a.img").apply(Context(lab="t", qemu_img=fake))
    assert (tmp_path / "a.img").read_text() == "user\n"
    assert not partial_path(tmp_path / "a.img", "t").exists()


def test_a_failing_qemu_img_leaves_nothing(tmp_path: Path) -> None:
    fake = fake_qemu_img(tmp_path, 'printf half > "$target"; echo "no space" >&2; exit 1')
    with pytest.raises(RuntimeFailure, match="failed: no space"):
        image(tmp_path / "a.img").apply(Context(lab="t", qemu_img=fake))
    assert sorted(os.listdir(tmp_path)) == ["fake-qemu-img"]


# A vmlaunch applying the image as `up` does, whose qemu-img is killed with it half-way.
KILLED_UP = """
import contextlib, sys
from pathlib import Path
from vmlaunch.runtime import executor
from vmlaunch.lab.journal import Journal
from vmlaunch.spec.model import DiskFormat
from vmlaunch.resources.base import Context
from vmlaunch.resources.image import Image
from vmlaunch.layout.rundir import RunDir

run_dir = RunDir.of(Path(sys.argv[1]), "t")
run_dir.create()
journal = Journal.load(run_dir)
image = Image(path=Path(sys.argv[2]), size=64 << 20, format=DiskFormat.RAW, vm="a")
executor._apply(image, Context(lab="t", qemu_img=sys.argv[3]), journal, contextlib.ExitStack())
"""


def killed_up(tmp_path: Path, run_dir: RunDir) -> Path:
    """Run KILLED_UP; its fake qemu-img writes part of the image, then kills vmlaunch and itself."""
    fake = fake_qemu_img(tmp_path, 'printf half > "$target"; kill -KILL $PPID; kill -KILL $$')
    target = tmp_path / "disk.img"
    done = subprocess.run([sys.executable, "-c", KILLED_UP, str(run_dir.path.parent), str(target), fake],
                          capture_output=True, text=True, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr
    return target


@pytest.fixture
def lab_dir(tmp_path: Path) -> RunDir:
    (tmp_path / "run").mkdir(mode=0o700)
    return RunDir.of(tmp_path / "run", "t")


def test_qemu_img_killed_half_way_leaves_no_image_and_down_removes_the_rest(
        tmp_path: Path, lab_dir: RunDir) -> None:
    target = killed_up(tmp_path, lab_dir)
    assert not target.exists()  # never mistaken for the user's image
    partial = partial_path(target, "t")
    assert partial.read_bytes() == b"half"
    journal = Journal.load(lab_dir)
    assert [(e.key, e.record) for e in journal.resources] == [
        (str(partial), ImageRecord(partial, created=True, partial=True))]
    assert executor.down(lab_dir)
    assert not partial.exists() and not target.exists() and Journal.load(lab_dir).empty


def test_qemu_img_killed_half_way_is_finished_by_the_next_up(tmp_path: Path, lab_dir: RunDir) -> None:
    target = killed_up(tmp_path, lab_dir)
    journal = Journal.load(lab_dir)
    with contextlib.ExitStack() as stack:
        executor._apply(image(target), CTX, journal, stack)
        stack.pop_all()
    assert os.stat(target).st_size == 64 << 20 and not partial_path(target, "t").exists()
    saved = json.loads(lab_dir.state.read_text())["resources"]
    assert [(e["key"], e["record"]["created"], e["record"]["partial"]) for e in saved] == [
        (f"a:{target}", True, False)]  # the finished record replaced the claim


def test_an_unjournaled_partial_file_is_not_taken(tmp_path: Path) -> None:
    target = tmp_path / "a.img"
    partial_path(target, "t").write_bytes(b"someone's")
    claim = image(target).claim(CTX)
    assert claim == ImageClaim(partial_path(target, "t"), target, "a")
    with pytest.raises(RuntimeFailure, match="exists, but no journal of lab t claims it"):
        claim.apply(CTX)
    assert partial_path(target, "t").read_bytes() == b"someone's"


# --- the size of an existing image ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [DiskFormat.RAW, DiskFormat.QCOW2])
def test_a_size_change_is_noted_with_how_to_resize(tmp_path: Path, fmt: DiskFormat,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vmlaunch")
    path = tmp_path / f"a.{fmt.value}"
    subprocess.run(["qemu-img", "create", "-q", "-f", fmt.value, str(path), "32M"], check=True)
    bigger = image(path, fmt, size=64 << 20)
    record = bigger.apply(CTX)
    assert not record.created and os.stat(path).st_size < 64 << 20  # noted, not resized
    expected = (f"note: {path} is 32M ({fmt.value}), but size is 64M; vmlaunch never resizes an "
                f"existing image: to grow it, with its VM down, run `qemu-img resize -f {fmt.value} "
                f"{path} 67108864`")
    assert expected in caplog.text
    assert f"exists: a writes to it; {expected}" in (bigger.found() or "")
    smaller = image(path, fmt, size=16 << 20).found() or ""
    assert ("but size is 16M; vmlaunch never shrinks an image (that cuts off data): set the size to "
            "32M") in smaller
    assert image(path, fmt, size=32 << 20).found() == "exists: a writes to it"
