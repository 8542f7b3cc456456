from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmlaunch.errors import RuntimeFailure
from vmlaunch.images import ImageRecord, create_image, remove_image
from vmlaunch.model import DiskFormat
from vmlaunch.plan import CreateImage


def action(path: Path, fmt: DiskFormat = DiskFormat.RAW) -> CreateImage:
    return CreateImage(path=path, size=64 << 20, format=fmt, vm="a")


def test_creates_sparse_raw(tmp_path: Path) -> None:
    record = create_image(action(tmp_path / "a.img"))
    assert record == ImageRecord(tmp_path / "a.img", created=True)
    st = os.stat(tmp_path / "a.img")
    assert st.st_size == 64 << 20
    assert st.st_blocks * 512 < 1 << 20  # sparse


def test_creates_qcow2(tmp_path: Path) -> None:
    create_image(action(tmp_path / "a.qcow2", DiskFormat.QCOW2))
    assert (tmp_path / "a.qcow2").read_bytes()[:4] == b"QFI\xfb"


def test_never_overwrites(tmp_path: Path) -> None:
    existing = tmp_path / "a.img"
    existing.write_bytes(b"precious")
    record = create_image(action(existing))
    assert not record.created
    remove_image(record)
    assert existing.read_bytes() == b"precious"


def test_record_round_trips(tmp_path: Path) -> None:
    record = create_image(action(tmp_path / "b.img"))
    assert ImageRecord.from_json(record.to_json()) == record
    remove_image(record)
    assert not (tmp_path / "b.img").exists()


def test_failures_are_clear(tmp_path: Path) -> None:
    with pytest.raises(RuntimeFailure, match="cannot create image .*/missing/a.img: No such file"):
        create_image(action(tmp_path / "missing" / "a.img"))
    with pytest.raises(RuntimeFailure, match="failed"):
        create_image(action(tmp_path / "a.img"), qemu_img="/nonexistent/qemu-img")
    assert not (tmp_path / "a.img").exists()  # the claimed file was given back
