"""Disk images: every disk file a VM opens is checked (`vmlaunch/guests/diskfiles.py` has the rule), and
one with a `size` is created when missing, so that a crash at any moment leaves nothing that a later
run could take for the user's image.

Creating goes claim -> journal -> create -> rename. `Image.claim` names a partial file next to the
image, `.NAME.vmlaunch-LAB.partial`, which the executor creates (O_EXCL) and journals as its own record
before qemu-img runs; qemu-img writes it, and only once it succeeded (and is on disk) is it renamed to
the image's name, never over a file that appeared meanwhile. A vmlaunch killed half-way leaves the
journaled partial file: the next `up` creates it afresh and finishes, `down` removes it.

An image a failing `up` created is removed again, unless its VM has written to it since (the record
knows the size and mtime qemu-img left): then it is kept and said so.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, NoReturn

import attrs

from vmlaunch.core.fsutil import fsync_dir
from vmlaunch.errors import RuntimeFailure
from vmlaunch.guests.diskfiles import DiskOrigin, Found, Policy, Unsafe, check, opened_by, refusal, refuse
from vmlaunch.resources.base import Context, OfVm, Resource, VmFile
from vmlaunch.spec.model import DiskFormat

log = logging.getLogger(__name__)

QCOW2_MAGIC = b"QFI\xfb"


@attrs.frozen
class ImageRecord:
    """An image `up` looked at: created by it, found and kept, or (`partial`) a file it claimed to
    create one in, which any undo removes."""

    kind: ClassVar[str] = "image"

    path: Path
    created: bool
    partial: bool = False
    # An image `up` created, as qemu-img left it: a rollback keeps it once its VM has changed it.
    mtime_ns: int | None = None
    size: int | None = None
    inode: int | None = None

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Images hold user data: only a failing `up` deletes one, only one it created, and only while
        nothing has written to it. A partial file is never the user's: every undo removes it."""
        if self.partial:
            remove(self.path, "image")
            return
        if not (rollback and self.created):
            return
        if self._changed():
            log.warning("kept image %s: this up created it, but its VM has written to it since; "
                        "remove it by hand if it is not wanted", self.path)
            return
        remove(self.path, "image")

    def _changed(self) -> bool:
        if self.mtime_ns is None:  # written by a vmlaunch that did not record it
            return False
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_mtime_ns, st.st_size, st.st_ino) != (self.mtime_ns, self.size, self.inode)

    def describe(self) -> str:
        if self.partial:
            return f"partial image {self.path} (claimed while qemu-img creates it; removed by down)"
        return f"image {self.path} ({'created' if self.created else 'existed'}; kept by down)"


def remove(path: Path, what: str | None = None) -> None:
    """Remove a file vmlaunch made (an image, a VM's overlay, seed or NVRAM store): one gone already is
    nothing to do; one that cannot be removed is a RuntimeFailure naming it (as `what`, when given)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise RuntimeFailure(f"cannot remove {f'{what} ' if what else ''}{path}: {exc.strerror}") from None


def partial_path(path: Path, lab: str) -> Path:
    """Where qemu-img writes a new image: next to it (so the rename stays in one file system), hidden,
    and named for the lab (two labs never share one)."""
    return path.with_name(f".{path.name}.vmlaunch-{lab}.partial")


@attrs.frozen
class ImageClaim(VmFile):
    """The partial file an image is created in, claimed (O_EXCL) and journaled before qemu-img runs."""

    kind: ClassVar[str] = "image"

    path: Path
    image: Path
    vm: str

    def describe(self) -> str:
        return f"partial image {self.path} for {self.image}"

    def found(self) -> str | None:
        return "exists" if os.path.lexists(self.path) else None

    def apply(self, ctx: Context) -> ImageRecord:
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644))
        except FileExistsError:
            raise RuntimeFailure(f"{self.path} exists, but no journal of lab {ctx.lab} claims it",
                                 "a vmlaunch killed while creating the image may have left it: "
                                 "remove it and run up again") from None
        except OSError as exc:
            raise RuntimeFailure(f"cannot create image {self.image}: {exc.strerror}",
                                 "check that its folder exists and is writable") from None
        return ImageRecord(self.path, created=True, partial=True)


@attrs.frozen
class Image(OfVm):
    """A disk file a VM opens: checked, and created sparse when missing and it has a `size`; an
    existing file is never written to by vmlaunch."""

    kind: ClassVar[str] = "image"

    path: Path
    size: int | None
    format: DiskFormat
    vm: str
    readonly: bool = False
    block_device: bool = False
    accept_other_owner: bool = False
    origin: DiskOrigin | None = attrs.field(default=None, eq=False)  # for messages: key and line
    # (device, inode) of the file `apply` checked or created, for `check_opened` to compare with
    _applied: dict[str, tuple[int, int]] = attrs.field(factory=dict, eq=False, repr=False, init=False)

    @property
    def key(self) -> str:
        return f"{self.vm}:{self.path}"  # a read-only image may be shared: checked for each VM

    @property
    def policy(self) -> Policy:
        return Policy(block_device=self.block_device, accept_other_owner=self.accept_other_owner)

    def describe(self) -> str:
        from vmlaunch.core.units import format_size

        access = "read-only" if self.readonly else "read-write"
        if self.size is None:
            return f"image {self.path} ({self.format.value}) for {self.vm}, {access}"
        return (f"image {self.path} ({self.format.value}, {format_size(self.size)}) for {self.vm}, "
                f"{access}: created if missing")

    def found(self) -> str | None:
        """For `--dry-run`: which existing file the VM will write to (or only read), or why not."""
        try:
            found = self.check_path()
        except Unsafe as problem:
            return f"refused: {problem.message}"
        if found.stat is None:
            return None
        how = f"{self.vm} opens it read-only" if self.readonly else f"{self.vm} writes to it"
        where = "exists" if found.path == self.path else f"exists as {found.path}"
        note = self.size_note(found)
        return f"{where}: {how}" + (f"; note: {note}" if note else "")

    def check_path(self) -> Found:
        """The disk's path under the rule of `guests/diskfiles.py`; raises Unsafe."""
        return check(self.path, self.policy, creating=self.size is not None)

    def checked(self) -> Found:
        """check_path, or the refusal naming the disk's key and spec line."""
        try:
            return self.check_path()
        except Unsafe as problem:
            raise refuse([refusal(self.origin, self.path, problem)]) from None

    @staticmethod
    def preflight(images: Sequence[Resource]) -> None:
        """Before anything changes: every disk file of the plan passes the rule, or all that do not
        are listed."""
        problems = []
        for image in images:
            assert isinstance(image, Image)
            try:
                image.check_path()
            except Unsafe as problem:
                problems.append(refusal(image.origin, image.path, problem))
        if problems:
            raise refuse(problems)

    def claim(self, ctx: Context) -> ImageClaim | None:
        """What to journal before `apply` runs: the partial file of an image to create, else None."""
        if self.size is None or os.path.lexists(self.path):
            return None
        return ImageClaim(partial_path(self.path, ctx.lab), self.path, self.vm)

    def apply(self, ctx: Context) -> ImageRecord:
        found = self.checked()
        if found.stat is not None:
            note = self.size_note(found)
            if note:
                log.info("note: %s", note)
            self._applied["identity"] = (found.stat.st_dev, found.stat.st_ino)
            return ImageRecord(self.path, created=False)
        assert self.size is not None  # checked: a missing file has a size
        record, identity = self._create(ctx, self.size)
        self._applied["identity"] = identity
        return record

    def check_opened(self, pid: int) -> None:
        """Once QEMU runs, paused, before its guest does: it must hold the very file that `apply`
        checked, which the path still names and which still passes the rule; else the path was swapped
        between check and use."""
        found = self.checked()
        if self._applied.get("identity", found.identity) != found.identity:
            raise refuse([refusal(self.origin, self.path, Unsafe(
                f"{self.path} changed after it was checked (it names another file now), so {self.vm} "
                "is stopped before its guest runs"))])
        try:
            held = opened_by(pid)
        except OSError as exc:
            raise RuntimeFailure(f"cannot see which files QEMU (pid {pid}) opened: "
                                 f"{exc.strerror or exc}") from None
        if found.identity not in held:
            raise refuse([refusal(self.origin, self.path, Unsafe(
                f"{self.path} changed between the check and QEMU opening it: QEMU holds another "
                f"file, so {self.vm} is stopped before its guest runs"))])

    def _create(self, ctx: Context, size: int) -> tuple[ImageRecord, tuple[int, int]]:
        """qemu-img writes the partial file (claimed and journaled by the executor), which becomes the
        image only when complete. It is made afresh here: a qemu-img left running by a killed vmlaunch
        keeps writing to the old one, which nobody uses."""
        partial = partial_path(self.path, ctx.lab)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        try:
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644)
        except OSError as exc:
            raise RuntimeFailure(f"cannot create image {self.path}: {exc.strerror}",
                                 "check that its folder exists and is writable") from None
        try:
            os.fchmod(fd, 0o644 & ~ctx.umask)  # the user's file, as `qemu-img create` would make it
            st = self._run_qemu_img(ctx, fd, size)
            _rename_noreplace(partial, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        finally:
            os.close(fd)
        fsync_dir(self.path.parent)
        record = ImageRecord(self.path, created=True, mtime_ns=st.st_mtime_ns, size=st.st_size,
                             inode=st.st_ino)
        return record, (st.st_dev, st.st_ino)

    def _run_qemu_img(self, ctx: Context, fd: int, size: int) -> os.stat_result:
        # qemu-img writes through the descriptor: the file claimed is the file written, whatever
        # happens to the name meanwhile.
        argv = [ctx.qemu_img, "create", "-q", "-f", self.format.value, f"/proc/self/fd/{fd}", str(size)]
        shown = f"{ctx.qemu_img} create -f {self.format.value} {self.path} {size}"
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False,
                                  stdin=subprocess.DEVNULL, pass_fds=(fd,))
        except OSError as exc:
            raise RuntimeFailure(f"`{shown}` failed: {exc}") from None
        if done.returncode != 0:
            raise RuntimeFailure(f"`{shown}` failed: {done.stderr.strip() or f'status {done.returncode}'}")
        os.fsync(fd)  # on disk before it gets the image's name: a power cut must not leave it empty
        return os.fstat(fd)

    def size_note(self, found: Found) -> str | None:
        """When an existing image's virtual size is not the spec's `size`: how to resize it."""
        from vmlaunch.core.units import format_size

        if self.size is None or found.stat is None:
            return None
        actual = virtual_size(found.path, self.format, found.stat)
        if actual is None or actual == self.size:
            return None
        key = f"{self.origin.name}.size" if self.origin else "size"
        said = (f"{self.path} is {format_size(actual)} ({self.format.value}), but {key} is "
                f"{format_size(self.size)}")
        if actual > self.size:
            return (f"{said}; vmlaunch never shrinks an image (that cuts off data): set the size to "
                    f"{format_size(actual)}")
        return (f"{said}; vmlaunch never resizes an existing image: to grow it, with its VM down, run "
                f"`qemu-img resize -f {self.format.value} {self.path} {self.size}`, then grow the "
                f"partition and file system in the guest")


def virtual_size(path: Path, fmt: DiskFormat, st: os.stat_result) -> int | None:
    """The size the guest sees, read from the file (the qcow2 header's size field), None if unknown."""
    try:
        with open(path, "rb") as f:
            if fmt is DiskFormat.QCOW2:
                header = f.read(32)
                if len(header) < 32 or header[:4] != QCOW2_MAGIC:
                    return None
                return int.from_bytes(header[24:32], "big")
            if stat.S_ISBLK(st.st_mode):
                return f.seek(0, os.SEEK_END)
            return st.st_size
    except OSError:
        return None


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename, failing when `dst` exists (renameat2 RENAME_NOREPLACE; link and unlink where a file
    system lacks it): an image that appeared meanwhile is never replaced."""
    at_fdcwd, rename_noreplace = -100, 1
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            _rename_failed(dst, OSError(err, os.strerror(err)))
    try:
        os.link(src, dst)
    except OSError as exc:
        _rename_failed(dst, exc)
    os.unlink(src)


def _rename_failed(dst: Path, exc: OSError) -> NoReturn:
    if exc.errno == errno.EEXIST:
        raise RuntimeFailure(f"{dst} appeared while qemu-img created it: kept it, removed the new one",
                             "run up again to use it") from None
    raise RuntimeFailure(f"cannot create image {dst}: {exc.strerror}") from None

