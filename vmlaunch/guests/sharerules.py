"""What a VM's share may be: the folders a share must not be, hold or be inside, checked with the
files a spec names (`validate`, `cmdline`, `up`: `specfiles`), each refusal with its line and the fix.

A share's folder is compared after its symlinks are resolved (`/tmp/x -> /etc` is /etc), as are the
folders and files it is compared with; a guest reads a share, and writes a writable one, as the
QEMU serving it can (root, until a lab runs each QEMU as a uid of its own: `shareaccess`). Refused:

- any share that is, holds or is inside vmlaunch's own state: the run root, the lab folder
  `.vmlaunch` beside the spec (the lab's SSH key, every VM's disk), the image cache, the log root;
  and `/`, /etc, /proc, /sys and /dev (the host's secrets, its kernel's interfaces and devices);
- any share that is or holds a user's home folder, or is in one of its hidden folders (~/.ssh: the
  keys a guest could log in elsewhere with; root's and every user's from uid 1000);
- any share that holds a file another VM of the lab uses: its disks, kernel, initrd, the image it
  boots, its cloud-init user_data (its UEFI variables are in the lab folder);
- a writable share of a system folder, or in one: /boot, /usr (and /bin, /sbin, /lib*), /var (but
  for folders in /var/tmp), /run; a writable share of a folder every user writes in or owns a
  folder in, itself: /home, /srv, /opt, /mnt, /media, /tmp, /var/tmp;
- a writable share that holds what vmlaunch reads to run things (the spec, a network's scripts), a
  writable disk of any VM (written behind its QEMU's back, it is corrupted), or a local image.

What cannot be seen here: a hard link to another VM's disk inside the share (`shareaccess.grant`
never gives a hard-linked file to a VM's uid), and what a user mounts there later.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs

from vmlaunch.spec.load import Found
from vmlaunch.spec.model import LabSpec, VmSpec, needs_lab_dir

SECRET_TREES = {  # no share at all may be, hold or be in these
    "/etc": "the host's configuration (its password hashes, its SSH host keys)",
    "/proc": "the kernel's view of every process",
    "/sys": "the kernel's devices and settings",
    "/dev": "the host's devices",
}
SYSTEM_TREES = {  # no writable share may be or be in these
    "/boot": "the host's kernels and boot loader",
    "/usr": "the host's programs", "/bin": "the host's programs", "/sbin": "the host's programs",
    "/lib": "the host's libraries", "/lib32": "the host's libraries", "/lib64": "the host's libraries",
    "/libx32": "the host's libraries",
    "/var": "the host's services' data (crontabs, databases, logs)",
    "/run": "the running services' state",
}
WRITABLE_IN = ("/var/tmp",)  # folders in these are a user's own, though in a system folder
EVERYBODYS = ("/home", "/srv", "/opt", "/mnt", "/media", "/tmp", "/var/tmp")  # no writable share of these
FIRST_USER_UID = 1000  # Debian's; homes of system accounts below it are left out (/bin is sync's)


@attrs.frozen
class Held:
    """A file or folder a share must not hold: where it is (resolved), how a message names it, why."""

    path: str
    what: str
    why: str
    writable_only: bool = False  # only a writable share may not hold it (a guest would change it)
    inside_too: bool = False  # a share inside it is refused as well (a folder of vmlaunch's)


def within(path: str, folder: str) -> bool:
    """`path` is `folder` or in it (both resolved)."""
    return path == folder or folder == "/" or path.startswith(folder + "/")


def refusal(folder: str, *, readonly: bool, held: Iterable[Held] = (),
            homes: Iterable[tuple[str, str]] = ()) -> tuple[str, str] | None:
    """Why a share of `folder` (resolved) is refused, as the end of a sentence that starts with the
    share (`is in /etc, the host's configuration: a guest could read it`), and the fix; None when it
    is not. `held`: what no share (or no writable one) may hold; `homes`: (user, home folder)."""
    held = [item for item in held if not (readonly and item.writable_only)]
    elsewhere = "share another folder"
    could = "read" if readonly else "read and change"
    if folder == "/":
        return f"is the host's whole file system: a guest could {could} any file of the host", elsewhere
    for item in held:
        if item.inside_too and (within(item.path, folder) or within(folder, item.path)):
            return _related(folder, item.path, item.what, item.why), _fix(folder, item.path)
    for tree, what in SECRET_TREES.items():
        if within(folder, tree) or within(tree, folder):
            return _related(folder, tree, what, f"a guest could {could} it"), _fix(folder, tree)
    for user, home in homes:
        if within(home, folder):
            return (_related(folder, home, f"the home folder of user {user}", "a guest could read its "
                             "SSH keys, or plant what the user runs at login"),
                    "share a subfolder of it, not a hidden one" if home == folder else _fix(folder, home))
        below = folder[len(home):].lstrip("/") if within(folder, home) else ""
        if below.startswith("."):
            top = f"{home.rstrip('/')}/{below.split('/')[0]}"
            return (_related(folder, top, f"a hidden folder of user {user}'s home", "a guest could read "
                             "the keys kept there, or plant what the user runs"), elsewhere)
    if not readonly:
        if folder in EVERYBODYS:
            return (f"is {folder}, where every user may keep files: a guest could change theirs",
                    "readonly = true, or share a subfolder of your own")
        for tree, what in SYSTEM_TREES.items():
            if within(folder, tree) and not any(folder.startswith(free + "/") for free in WRITABLE_IN):
                return (_related(folder, tree, what, "a guest could change how the host runs"),
                        f"readonly = true, or share a folder of your own outside {tree}")
    for item in held:
        if within(item.path, folder):
            fix = _fix(folder, item.path)
            return (_related(folder, item.path, item.what, item.why),
                    f"readonly = true, or {fix}" if item.writable_only else fix)
    return None


def _related(folder: str, other: str, what: str, why: str) -> str:
    """`is|holds|is in OTHER, WHAT: WHY`, of a share of `folder`."""
    relation = "is" if folder == other else "holds" if within(other, folder) else "is in"
    return f"{relation} {other}, {what}: {why}"


def _fix(folder: str, other: str) -> str:
    return "share a subfolder that does not hold it" if folder != other and within(other, folder) \
        else "share another folder"


# --- the lab's side: what its shares are compared with, resolved -----------------------------------


def host_refusal(folder: str, *, readonly: bool) -> tuple[str, str] | None:
    """`refusal` by what the host has, without a lab's own files: for `shareaccess.grant`, which
    asks again of the folder it opened (a symlink on its path may name another since `validate`)."""
    return refusal(folder, readonly=readonly, held=list(_vmlaunch_folders()), homes=host_homes())


def share_problems(lab: LabSpec, vms: Sequence[str] = ()) -> list[Found]:
    """Every share of the lab's VMs (those named, or all) that `refusal` refuses, at its `source`."""
    homes = host_homes()
    state = [*_lab_folder(lab), *_vmlaunch_folders()]
    found: list[Found] = []
    for vm in lab.vms:
        if vms and vm.name not in vms:
            continue
        held = [*state, *_files_for(lab, vm)]
        for index, share in enumerate(vm.shares):
            folder = _resolved(share.source)
            if not os.path.isdir(folder):
                continue  # said as a file problem (`specfiles`)
            refused = refusal(folder, readonly=share.readonly, held=held, homes=homes)
            if refused is None:
                continue
            message, hint = refused
            shown = share.source if folder == str(share.source) else f"{share.source} (which is {folder})"
            kind = "a share" if share.readonly else "a writable share"
            found.append((("vm", vm.name, "share", index, "source"), f"{kind} of {shown} is refused: it "
                          f"{message}", hint))
    return found


def _resolved(path: Path) -> str:
    return os.path.realpath(path)


def _lab_folder(lab: LabSpec) -> Iterator[Held]:
    """The lab folders beside the spec (`.vmlaunch`, every lab's of that folder), where this lab has
    one or another lab made them: no share may be, hold or be in them."""
    from vmlaunch.layout.labdir import LabDir

    top = LabDir.of(lab.file, lab.name).top
    if any(needs_lab_dir(vm) for vm in lab.vms) or os.path.lexists(top):
        yield Held(_resolved(top), "vmlaunch's lab folder (the lab's SSH key, its VMs' disks)", _STATE_WHY,
                   inside_too=True)


def _vmlaunch_folders() -> Iterator[Held]:
    """vmlaunch's own folders of this host: no share may be, hold or be in them."""
    from vmlaunch.layout import dirs

    yield Held(_resolved(dirs.run_root()), "vmlaunch's run folder (every lab's sockets and journal)",
               _STATE_WHY, inside_too=True)
    yield Held(_resolved(dirs.cache_dir()), "vmlaunch's cache (its images)", _STATE_WHY, inside_too=True)
    yield Held(_resolved(dirs.log_root()), "vmlaunch's logs (every VM's console)", _STATE_WHY,
               inside_too=True)


_STATE_WHY = "a guest could read what vmlaunch keeps there"


def _files_for(lab: LabSpec, vm: VmSpec) -> Iterator[Held]:
    """What a share of `vm` must not hold: the other VMs' files; when writable, what vmlaunch reads
    to run things, every writable disk, and local images."""
    for other in lab.vms:
        for path, what, writable in _files_of(lab, other):
            if other.name != vm.name:
                yield Held(_resolved(path), f"vm.{other.name}'s {what}",
                           "a guest could read another VM's files" if not writable
                           else "a guest could read and write another VM's disk")
            elif writable:
                yield Held(_resolved(path), f"its own {what}", "written behind QEMU's back, the disk is "
                           "corrupted", writable_only=True)
    yield Held(_resolved(lab.file), "the lab's spec", "a guest could rewrite the lab", writable_only=True)
    for net in lab.networks:
        for key in ("up_script", "down_script"):
            script = getattr(net, key, None)
            if script is not None:
                yield Held(_resolved(script), f"network {net.name}'s {key}",
                           "vmlaunch runs it: a guest could change what", writable_only=True)
    for image in lab.images:
        if image.file is not None:
            yield Held(_resolved(image.file), f"image {image.name}'s file",
                       "the VMs booting it would see what a guest wrote", writable_only=True)


def _files_of(lab: LabSpec, vm: VmSpec) -> Iterator[tuple[Path, str, bool]]:
    """The files `vm` uses, what each is, and whether it writes it."""
    for key, file in (("kernel", vm.kernel), ("initrd", vm.initrd)):
        if file is not None:
            yield file, key, False
    for index, disk in enumerate(vm.disks):
        yield disk.file, f"disk[{index}]", not disk.readonly
    if vm.image is not None:
        with_file = [image for image in lab.images if image.name == vm.image and image.file is not None]
        for image in with_file:
            assert image.file is not None
            yield image.file, f"image {image.name}", False
    if vm.cloud_init is not None and vm.cloud_init.user_data is not None:
        yield vm.cloud_init.user_data, "cloud-init user_data", False


def host_homes() -> list[tuple[str, str]]:
    """(user, resolved home folder) of root and of every user from FIRST_USER_UID (not nobody's)."""
    import pwd

    homes = []
    for entry in pwd.getpwall():
        if (entry.pw_uid == 0 or FIRST_USER_UID <= entry.pw_uid < 65534) and entry.pw_dir.startswith("/"):
            home = _resolved(Path(entry.pw_dir))
            if home != "/":
                homes.append((entry.pw_name, home))
    return homes
