"""The image resource: created sparse when missing, never overwritten, removed only by a failing up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmlaunch.errors import RuntimeFailure
from vmlaunch.model import DiskFormat
from vmlaunch.resources.base import Context
from vmlaunch.resources.image import Image, ImageRecord

CTX = Context(lab="t", qemu_img="qemu-img")


def image(path: Path, fmt: DiskFormat = DiskFormat.RAW) -> Image:
    return Image(path=path, size=64 << 20, format=fmt, vm="a")


def test_creates_sparse_raw(tmp_path: Path) -> None:
    record = image(tmp_path / "a.img").apply(CTX)
    assert record == ImageRecord(tmp_path / "a.img", created=True)
    st = os.stat(tmp_path / "a.img")
    assert st.st_size == 64 << 20
    assert st.st_blocks * 512 < 1 << 20  # sparse


def test_creates_qcow2(tmp_path: Path) -> None:
    image(tmp_path / "a.qcow2", DiskFormat.QCOW2).apply(CTX)
    assert (tmp_path / "a.qcow2").read_bytes()[:4] == b"QFI\xfb"


def test_never_overwrites(tmp_path: Path) -> None:
    existing = tmp_path / "a.img"
    existing.write_bytes(b"precious")
    assert image(existing).found() == "exists: kept"
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


def test_failures_are_clear(tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure, match="cannot create image .*/missing/a.img: No such file"):
        image(tmp_path / "missing" / "a.img").apply(CTX)
    with pytest.raises(RuntimeFailure, match="failed"):
        image(tmp_path / "a.img").apply(Context(lab="t", qemu_img="/nonexistent/qemu-img"))
    assert not (tmp_path / "a.img").exists()  # the claimed file was given back
