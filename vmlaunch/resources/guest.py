"""What a real guest keeps in the lab dir (`layout/labdir.py`): the lab dir itself, each VM's overlay of its
image, its UEFI variable store and its NoCloud seed.

`down` keeps them all: the next `up` resumes the same machines (`up --fresh` or `vmlaunch reset`
remove a VM's overlay, NVRAM and instance id first). Only a failing `up` removes what it created, so a
first `up` that fails leaves nothing beside the spec. Each file is written under a temporary name in
the lab dir (the user's own, writable by nobody else) and renamed into place when complete: a crash
never leaves a half-made overlay that a later `up` would boot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import attrs

from vmlaunch.core.fsutil import temp_of
from vmlaunch.errors import Location, RuntimeFailure, SpecError
from vmlaunch.errors import Problem as SpecProblem
from vmlaunch.layout.labdir import LabDir
from vmlaunch.resources.base import Context, LabWide, VmFile
from vmlaunch.resources.image import remove
from vmlaunch.spec.model import Image, LabSpec, VmSpec

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _written(path: Path) -> Iterator[Path]:
    """A VM's file made whole or not at all: the block writes the temp file it is given (one a killed
    vmlaunch left is removed first), which is then made 0600, fsync'd and renamed to `path` (never
    followed: rename replaces a link itself); on failure it is removed."""
    temp = temp_of(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)
    try:
        yield temp
        os.chmod(temp, 0o600)
        fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@attrs.frozen
class LabDirRecord:
    kind: ClassVar[str] = "labdir"

    path: Path
    created: bool

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        """Kept by `down` (it holds the machines); removed by a failing `up` that made it."""
        if not (rollback and self.created):
            return
        if not (self.path / ".vmlaunch-lab-dir").is_file():
            return  # not vmlaunch's (any more): never removed
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # .vmlaunch, when no other lab of this folder uses it

    def describe(self) -> str:
        return f"lab dir {self.path} ({'created' if self.created else 'existed'}; kept by down)"


@attrs.frozen
class LabDirResource(LabWide):
    """The lab dir beside the spec: made (0700, marked) when missing, checked against the ownership
    rule when present."""

    kind: ClassVar[str] = "labdir"

    lab_dir: LabDir

    @property
    def key(self) -> str:
        return str(self.lab_dir.path)

    def describe(self) -> str:
        return f"lab dir {self.lab_dir.path} (keys, overlays, seeds: kept by down)"

    def found(self) -> str | None:
        return "exists" if self.lab_dir.path.exists() else None

    def apply(self, ctx: Context) -> LabDirRecord:
        existed = os.path.lexists(self.lab_dir.path)
        self.lab_dir.secure(create=True)
        if existed and not self.lab_dir.mark.is_file():
            raise RuntimeFailure(f"{self.lab_dir.path} exists and was not made by vmlaunch (it has no "
                                 f"{self.lab_dir.mark.name} mark)", "move it away")
        return LabDirRecord(self.lab_dir.path, created=not existed)


@attrs.frozen
class VmFileRecord:
    """A file of a VM in the lab dir: an overlay, a seed or an NVRAM store."""

    kind: ClassVar[str] = "vmfile"

    path: Path
    created: bool
    what: str = "file"

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        if rollback and self.created:
            remove(self.path)

    def describe(self) -> str:
        return f"{self.what} {self.path} ({'created' if self.created else 'existed'}; kept by down)"


class _GuestFile(VmFile):
    """Mixin: a VM's file in the lab dir, made in the VM's folder (made first) when missing and kept
    after, or (`anew`) written by every `up`; its record says whether this `up` created it."""

    __slots__ = ()

    what: ClassVar[str]  # its name in its record
    anew: ClassVar[bool] = False

    def apply(self, ctx: Context) -> VmFileRecord:
        existed = os.path.lexists(self.path)
        if self.anew or not existed:
            _make_vm_dir(self.path.parent)
            self._write(ctx)
        return VmFileRecord(self.path, created=not existed, what=self.what)

    def _write(self, ctx: Context) -> None:
        raise NotImplementedError


@attrs.frozen
class Overlay(_GuestFile):
    """A VM's first disk: a qcow2 overlay backed by its image (pulled into the cache when missing),
    with the VM's `disk_size` (at least the image's)."""

    kind: ClassVar[str] = "vmfile"
    what: ClassVar[str] = "overlay"

    vm: str
    image: Image
    path: Path
    size: int | None
    spec: Path  # for a message naming the line of disk_size
    line: int = 1

    def describe(self) -> str:
        from vmlaunch.core.units import format_size

        size = f", {format_size(self.size)}" if self.size else ""
        return f"overlay {self.path} of image {self.image.name} for {self.vm}{size}"

    def found(self) -> str | None:
        return "exists: the VM resumes from it" if self.path.exists() else None

    def _write(self, ctx: Context) -> None:
        from vmlaunch.guests import catalog_images, images

        base = catalog_images.ensure(self.image)
        info = images.image_info(base, self.image.format)
        if self.size is not None and self.size < info.virtual_size:
            from vmlaunch.core.units import format_size

            raise SpecError([SpecProblem(
                Location(self.spec, self.line, ("vm", self.vm, "disk_size")),
                f"{format_size(self.size)} is smaller than image {self.image.name} "
                f"({format_size(info.virtual_size)})", "leave disk_size out, or make it larger")])
        with _written(self.path) as temp:
            argv = [ctx.qemu_img, "create", "-q", "-f", "qcow2", "-b", str(base), "-F", info.format.value,
                    str(temp)]
            if self.size is not None:
                argv.append(str(self.size))
            try:
                done = subprocess.run(argv, capture_output=True, text=True, check=False,
                                      stdin=subprocess.DEVNULL)
            except OSError as exc:
                raise RuntimeFailure(f"`{' '.join(argv)}` failed: {exc}") from None
            if done.returncode != 0:
                raise RuntimeFailure(f"creating the overlay of {self.vm} failed: "
                                     f"{done.stderr.strip() or f'qemu-img status {done.returncode}'}")


@attrs.frozen
class Nvram(_GuestFile):
    """A VM's UEFI variable store: a copy of the firmware's template, made once."""

    kind: ClassVar[str] = "vmfile"
    what: ClassVar[str] = "UEFI variables"

    vm: str
    path: Path
    template: Path

    def describe(self) -> str:
        return f"UEFI variables {self.path} for {self.vm} (from {self.template})"

    def found(self) -> str | None:
        return "exists" if self.path.exists() else None

    def _write(self, ctx: Context) -> None:
        try:
            with _written(self.path) as temp:
                shutil.copyfile(self.template, temp)
        except OSError as exc:
            raise RuntimeFailure(f"cannot copy the UEFI variables of {self.vm} from {self.template}: "
                                 f"{exc.strerror or exc}") from None


@attrs.frozen
class Seed(_GuestFile):
    """A VM's NoCloud seed: its hostname, the lab's SSH key, its own host key, static addresses,
    shares to mount and the spec's cloud-init settings. Written anew by every `up` (the instance id
    stays, so cloud-init runs its once-per-instance steps on the first boot of an overlay only)."""

    kind: ClassVar[str] = "vmfile"
    what: ClassVar[str] = "cloud-init seed"
    anew: ClassVar[bool] = True

    vm: str
    lab: LabSpec = attrs.field(eq=False, repr=False)
    lab_dir: LabDir
    management_mac: str | None

    @property
    def path(self) -> Path:
        return self.lab_dir.vm(self.vm).seed

    def describe(self) -> str:
        return f"cloud-init seed {self.path} for {self.vm} (written by every up)"

    def found(self) -> str | None:
        return "exists: written anew" if self.path.exists() else None

    def _write(self, ctx: Context) -> None:
        from vmlaunch.guests import cloudinit, sshkeys

        vm: VmSpec = self.lab.vm(self.vm)
        authorized = sshkeys.ensure_lab_key(self.lab_dir)
        host_key = sshkeys.ensure_host_key(self.lab_dir, self.vm)
        sshkeys.pin(self.lab_dir, self.vm, host_key[1])
        cloudinit.write_seed(
            self.path,
            cloudinit.user_data(self.lab, vm, authorized, host_key),
            cloudinit.meta_data(self.lab, vm, cloudinit.instance_id(self.lab_dir, self.vm)),
            cloudinit.network_config(self.lab, vm, self.management_mac),
        )


def _make_vm_dir(path: Path) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)


def reset(lab_dir: LabDir, vm: str) -> list[Path]:
    """Remove what makes a VM the machine it is now (overlay, seed, NVRAM, instance id), so the next
    `up` starts it afresh from its image; its keys stay. Returns what was removed."""
    removed = []
    for path in lab_dir.vm(vm).fresh:
        if os.path.lexists(path):
            remove(path)
            removed.append(path)
    return removed
