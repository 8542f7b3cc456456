"""The cpio "newc" (070701) format the kernel unpacks as an initramfs, written with fixed times and
owners so that the same files give the same bytes.

Standard library only, Python 3.9+: tools/build_guest.py (which runs without vmlaunch installed) loads
this file by its path.
"""

from __future__ import annotations

from typing import BinaryIO


class CpioWriter:
    """Entries of a newc archive written one after another to `stream`; `finish` writes its trailer."""

    def __init__(self, stream: BinaryIO, mtime: int = 0) -> None:
        self.stream = stream
        self.mtime = mtime
        self.ino = 0

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0),
               nlink: int = 1) -> None:
        self.ino += 1
        encoded = name.encode() + b"\x00"
        fields = (self.ino, mode, 0, 0, nlink, self.mtime, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
        header = b"070701" + b"".join(b"%08X" % field for field in fields)
        self.stream.write(header + encoded + self._pad(len(header) + len(encoded)))
        self.stream.write(data + self._pad(len(data)))

    @staticmethod
    def _pad(length: int) -> bytes:
        return b"\x00" * (-length % 4)

    def directory(self, name: str, perm: int = 0o755) -> None:
        self._entry(name, 0o040000 | perm, nlink=2)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, 0o100000 | perm, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name: str, major: int, minor: int, perm: int = 0o600) -> None:
        self._entry(name, 0o020000 | perm, rdev=(major, minor))

    def finish(self) -> None:
        self._entry("TRAILER!!!", 0, nlink=1)
