"""Disk images that `up` creates when missing, and removes again only if it created them."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.errors import RuntimeFailure
from vmlaunch.plan import CreateImage


@attrs.frozen
class ImageRecord:
    """What `create_image` did, enough for another process to undo it."""

    path: Path
    created: bool

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "created": self.created}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageRecord:
        return cls(path=Path(data["path"]), created=bool(data["created"]))


def create_image(action: CreateImage, qemu_img: str = "qemu-img") -> ImageRecord:
    """Create a sparse image unless the file exists; an existing file is never touched.

    The file is first claimed with O_EXCL, so two runs (or a user's file appearing meanwhile) can
    never make qemu-img overwrite an image that someone else created.
    """
    try:
        fd = os.open(action.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return ImageRecord(action.path, created=False)
    except OSError as exc:
        raise RuntimeFailure(f"cannot create image {action.path}: {exc.strerror}",
                             "check that its folder exists and is writable") from None
    os.close(fd)
    argv = [qemu_img, "create", "-q", "-f", action.format.value, str(action.path), str(action.size)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeFailure(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    except BaseException as exc:
        # Interrupted or failed: the claimed file must not stay behind to pass for the user's image.
        with contextlib.suppress(OSError):
            os.unlink(action.path)
        if isinstance(exc, OSError):
            raise RuntimeFailure(f"`{' '.join(argv)}` failed: {exc}") from None
        raise
    return ImageRecord(action.path, created=True)


def remove_image(record: ImageRecord) -> None:
    """Undo `create_image`: delete the image only if this run created it."""
    if not record.created:
        return
    try:
        os.unlink(record.path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise RuntimeFailure(f"cannot remove image {record.path}: {exc.strerror}") from None

