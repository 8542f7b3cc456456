"""The one owner of a lab directory's layout: what a lab keeps between `down` and `up`, beside its spec
(as Vagrant keeps `.vagrant/` beside a Vagrantfile). Every file name under it is spelled here.

    SPEC_DIR/.vmlaunch/LAB/            the lab dir (0700)
        .vmlaunch-lab-dir              vmlaunch's mark
        ssh/id_ed25519{,.pub}          the lab's SSH key pair: the login into each of its VMs
        ssh/known_hosts                each VM's host key, under the alias vmlaunch-LAB-VM
        VM/disk.qcow2                  the VM's first disk: a qcow2 overlay of its image
        VM/seed.iso                    its NoCloud seed (`cidata`), written anew by every `up`
        VM/nvram.fd                    its UEFI variable store (firmware = "uefi")
        VM/instance-id                 its cloud-init instance-id: made with the overlay, kept with it
        VM/ssh_host_ed25519_key{,.pub} its SSH host key pair, given to the guest by cloud-init

Beside the spec too, SPEC.lock (`lab.toml.lock`): the catalog images pinned (`lock_file`).

`down` keeps all of it: the next `up` resumes the same machines. `up --fresh` and `vmlaunch reset`
recreate a VM's overlay, seed, NVRAM and instance-id (so cloud-init sets the new disk up); the keys
stay, so known_hosts stays true.
"""

from __future__ import annotations

from pathlib import Path

import attrs

TOP = ".vmlaunch"
MARK = ".vmlaunch-lab-dir"
LOCK_SUFFIX = ".lock"


def lock_file(spec: Path) -> Path:
    """The lock file of a spec: its name and `.lock`, beside it (guests/catalog_images.py)."""
    return spec.with_name(spec.name + LOCK_SUFFIX)


def spec_of_lock(lock: Path) -> Path:
    """The spec a lock file is of."""
    return lock.with_name(lock.name.removesuffix(LOCK_SUFFIX))


@attrs.frozen
class VmDir:
    """The kept files of one VM."""

    path: Path

    @property
    def overlay(self) -> Path:
        return self.path / "disk.qcow2"

    @property
    def seed(self) -> Path:
        return self.path / "seed.iso"

    def disk_copy(self, index: int, format: str) -> Path:
        """A clone's copy of its source's `[[disk]]` number `index` (`vmlaunch fork`)."""
        return self.path / f"disk{index}.{format}"

    @property
    def nvram(self) -> Path:
        return self.path / "nvram.fd"

    @property
    def instance_id(self) -> Path:
        """Its cloud-init instance-id (`cloudinit.instance_id`): the same while the overlay lives."""
        return self.path / "instance-id"

    @property
    def host_key(self) -> Path:
        return self.path / "ssh_host_ed25519_key"

    @property
    def host_pub(self) -> Path:
        return self.path / "ssh_host_ed25519_key.pub"

    @property
    def fresh(self) -> tuple[Path, ...]:
        """What `up --fresh` and `reset` recreate: the machine's state, not its identity (keys)."""
        return (self.overlay, self.seed, self.nvram, self.instance_id)


@attrs.frozen
class LabDir:
    """`SPEC_DIR/.vmlaunch/LAB`."""

    path: Path
    lab: str

    @classmethod
    def of(cls, spec_file: Path, lab: str) -> LabDir:
        return cls(spec_file.resolve().parent / TOP / lab, lab)

    @property
    def top(self) -> Path:
        """`SPEC_DIR/.vmlaunch`: where vmlaunch's own folders begin (`dirs.secure_dir`'s `top`)."""
        return self.path.parent

    @property
    def mark(self) -> Path:
        return self.path / MARK

    @property
    def ssh_dir(self) -> Path:
        return self.path / "ssh"

    @property
    def lab_key(self) -> Path:
        return self.ssh_dir / "id_ed25519"

    @property
    def lab_pub(self) -> Path:
        return self.ssh_dir / "id_ed25519.pub"

    @property
    def known_hosts(self) -> Path:
        return self.ssh_dir / "known_hosts"

    def host_alias(self, vm: str) -> str:
        """The name a VM's host key is pinned under in known_hosts (ssh's HostKeyAlias): its port
        changes with every start, its identity does not."""
        return f"vmlaunch-{self.lab}-{vm}"

    def vm(self, name: str) -> VmDir:
        return VmDir(self.path / name)

    def secure(self, *, create: bool = False) -> bool:
        """Check the lab dir against the ownership rule (`dirs.secure_dir`: the user's own, writable
        by nobody else); with `create`, make it (and mark it). Returns whether it exists."""
        import os

        from vmlaunch.layout.dirs import secure_dir

        existed = os.path.lexists(self.path)
        found = secure_dir(self.path, top=self.top, create=create, setting="the spec's folder")
        if create and not existed:
            fd = os.open(self.mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(f"vmlaunch lab dir of lab {self.lab}\n")
        return found

    def __str__(self) -> str:
        return str(self.path)
