"""Disk images `up` creates when missing, and removes again only when a failing `up` created them."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path
from typing import ClassVar

import attrs

from vmlaunch.errors import RuntimeFailure
from vmlaunch.model import DiskFormat
from vmlaunch.resources.base import Context


@attrs.frozen
class ImageRecord:
    """An image `up` looked at: created by it, or found and kept."""

    kind: ClassVar[str] = "image"

    path: Path
    created: bool

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Images hold user data: only a failing `up` deletes one, and only one it created."""
        if not (rollback and self.created):
            return
        try:
            os.unlink(self.path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise RuntimeFailure(f"cannot remove image {self.path}: {exc.strerror}") from None

    def describe(self) -> str:
        return f"image {self.path} ({'created' if self.created else 'existed'}; kept by down)"


@attrs.frozen
class Image:
    """Create a sparse disk image when the file is missing; an existing file is never touched."""

    kind: ClassVar[str] = "image"

    path: Path
    size: int
    format: DiskFormat
    vm: str

    @property
    def key(self) -> str:
        return str(self.path)

    @property
    def owner(self) -> str | None:
        return self.vm

    def describe(self) -> str:
        from vmlaunch.units import format_size

        return f"image {self.path} ({self.format.value}, {format_size(self.size)}): create if missing"

    def found(self) -> str | None:
        return "exists: kept" if self.path.exists() else None

    def apply(self, ctx: Context) -> ImageRecord:
        """The file is first claimed with O_EXCL, so two runs (or a user's file appearing meanwhile)
        can never make qemu-img overwrite an image that someone else created."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return ImageRecord(self.path, created=False)
        except OSError as exc:
            raise RuntimeFailure(f"cannot create image {self.path}: {exc.strerror}",
                                 "check that its folder exists and is writable") from None
        os.close(fd)
        argv = [ctx.qemu_img, "create", "-q", "-f", self.format.value, str(self.path), str(self.size)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeFailure(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
        except BaseException as exc:
            # Interrupted or failed: the claimed file must not stay behind to pass for the user's image.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            if isinstance(exc, OSError):
                raise RuntimeFailure(f"`{' '.join(argv)}` failed: {exc}") from None
            raise
        return ImageRecord(self.path, created=True)
