"""The files a spec names, checked before anything runs: `validate`, `cmdline` and `up` (also with
`--dry-run`) report a kernel, initrd or disk that cannot work as a spec problem with its line (exit 2),
instead of QEMU's message at `up` after a kilobyte of command line.

Each file must exist (a disk with a `size` is created when missing), be a regular file (a disk may be a
block device with `block_device = true`), be readable (and writable for a disk that is not
`readonly`, executable for a network's script), and not be empty (a disk `up` creates or resizes may
be). Who may change the file and the folders on its path is `up`'s business (`guests/diskfiles.py`, and
`resources/script.py` for scripts): that rule needs the host as `up` finds it. `validate` asks it of
a network's scripts all the same, and asks whether a local image names another file
(`up_refusals`): the same checks `up` makes, with its messages. What a share's folder may be (not
`/etc`, not one that holds the lab's SSH key or another VM's disk) is `guests/sharerules.py`'s, asked here
too: it compares folders with their symlinks resolved.

Kept apart from `spec/load.py` on purpose: the spec is checked as text everywhere (`status`, `down` and
`logs` work on a lab whose kernel has since been deleted); its files only where a VM is about to start.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from vmlaunch.errors import VmlaunchError
from vmlaunch.spec.load import Built, Found, Named, load_lab
from vmlaunch.spec.model import LabSpec, VmSpec


def load_checked(path: str | Path, *, vms: Sequence[str] = (), up_refusals: bool = False) -> LabSpec:
    """The lab of the spec at `path`, its files checked too (of the VMs named, or all), every problem
    reported at once with its line (exit 2); with `up_refusals`, also what `up` refuses of the files
    that are there (`validate`)."""
    return load_lab(path, files=functools.partial(file_problems, vms=vms, up_refusals=up_refusals))


def file_problems(built: Built, vms: Sequence[str] = (), up_refusals: bool = False) -> list[Found]:
    """What is wrong with the files the built lab names, of the VMs named (all when none are)."""
    from vmlaunch.guests.sharerules import share_problems

    lab = built.lab
    return [*named_problems(built.named, vms, built.vm_images), *disk_size_problems(lab, vms),
            *kernel_memory_problems(lab, vms), *share_problems(lab, vms),
            *(refused_by_up(lab, vms) if up_refusals else [])]


def named_problems(named: Iterable[Named], vms: Sequence[str] = (),
                   images: Mapping[str, str] | None = None) -> list[Found]:
    """What is wrong with each named file of the VMs named (all when none are), and of the images
    those VMs boot (`images`: VM -> image name; None: every image)."""
    wanted_images = None if images is None else {image for vm, image in images.items()
                                                  if not vms or vm in vms}
    found: list[Found] = []
    for item in named:
        if item.vm is not None and vms and item.vm not in vms:
            continue
        if item.path[0] == "image" and wanted_images is not None and item.path[1] not in wanted_images:
            continue
        if item.kind == "folder":
            missing = _folder_problem(item.file)
            if missing is not None:
                found.append((item.path, missing, None))
            continue
        problem = _problem(item.file, disk=item.kind == "disk", writable=item.writable,
                           device_ok=item.device_ok, may_be_missing=item.may_be_missing,
                           executable=item.kind == "script")
        if problem is not None:
            found.append((item.path, *problem))
    return found


def refused_by_up(lab: LabSpec, vms: Sequence[str] = ()) -> list[Found]:
    """What `up` refuses of files that are there, with its own messages, asked of the functions it
    asks: a local image (of the VMs named, or all) that names another file (`images`), a network's
    script that another user could change (`resources/script.py`). For `validate`: who may change a
    file depends on who runs vmlaunch, and `up` runs as root."""
    from vmlaunch.guests.diskfiles import Unsafe
    from vmlaunch.guests.images import inspect_file_image
    from vmlaunch.resources.script import REFUSED_HINT, check_script

    found: list[Found] = []
    wanted = {vm.image for vm in lab.vms if vm.image is not None and (not vms or vm.name in vms)}
    for image in lab.images:
        if image.file is None or image.name not in wanted or not image.file.is_file():
            continue  # a missing file, a FIFO: said by `named_problems`
        try:
            inspect_file_image(image)
        except VmlaunchError as exc:
            found.append((("image", image.name, "file"), exc.message, exc.hint))
    for net in lab.networks:
        for key in ("up_script", "down_script"):
            script = getattr(net, key, None)
            if script is None or not script.is_file():
                continue
            try:
                check_script(script)
            except Unsafe as problem:
                fix = f" ({problem.plain_fix})" if problem.plain_fix else ""
                found.append((("network", net.name, key), f"{problem.message}{fix}", REFUSED_HINT))
    return found


def disk_size_problems(lab: LabSpec, vms: Sequence[str] = ()) -> list[Found]:
    return [item for vm in lab.vms if not vms or vm.name in vms for item in _disk_size_problems(lab, vm)]


def kernel_memory_problems(lab: LabSpec, vms: Sequence[str] = ()) -> list[Found]:
    return [item for vm in lab.vms if not vms or vm.name in vms for item in _kernel_memory_problems(vm)]


def _disk_size_problems(lab: LabSpec, vm: VmSpec) -> Iterator[Found]:
    """disk_size below the image's own size, when the image is known here (a local file)."""
    if vm.image is None or vm.disk_size is None:
        return
    image = lab.image(vm.image)
    if image.file is None or not image.file.is_file():
        return  # downloaded: checked once it is (`up`)
    from vmlaunch.core.units import format_size
    from vmlaunch.guests.images import image_info

    try:
        size = image_info(image.file, image.format).virtual_size
    except (OSError, VmlaunchError):
        return  # said when `up` opens it
    if vm.disk_size < size:
        yield (("vm", vm.name, "disk_size"), f"{format_size(vm.disk_size)} is smaller than image "
               f"{image.name} ({format_size(size)})", "leave disk_size out, or make it larger")


SANE_BYTES = 1 << 30  # setup header values past 1 GiB are not a kernel's: left to QEMU


def kernel_needs_bytes(kernel: Path, initrd: Path | None) -> tuple[int, int, int] | None:
    """What a direct-boot kernel needs of guest memory before it runs: (its load address, the memory
    its decompressor uses from there, the initrd's size) in bytes; None for what is not an x86 bzImage
    of protocol 2.10 or later (another architecture, an unreadable file: QEMU says)."""
    from vmlaunch.guests.kernels import HEADER_BYTES, read_setup_header

    try:
        fd = os.open(kernel, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not hang us
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None  # said as a file problem
            header = file.read(HEADER_BYTES)
        initrd_size = os.stat(initrd).st_size if initrd is not None else 0
    except OSError:
        return None
    setup = read_setup_header(header)
    if setup is None or len(header) < HEADER_BYTES or setup.version < 0x20A:
        return None
    if setup.pref_address > SANE_BYTES or setup.init_size > SANE_BYTES:
        return None
    return setup.pref_address, setup.init_size, initrd_size


def _kernel_memory_problems(vm: VmSpec) -> Iterator[Found]:
    """A VM whose memory cannot hold its kernel while it unpacks, and its initrd: the guest would
    stop before its first line (the decompressor has nowhere to go, and says nothing), or panic out
    of memory at once."""
    if vm.kernel is None:
        return
    needs = kernel_needs_bytes(vm.kernel, vm.initrd)
    if needs is None:
        return
    load, init, initrd = needs
    mib = 1 << 20
    total = -(-(load + init + initrd) // mib)
    if vm.memory_mib >= total:
        return
    with_initrd = f", plus {initrd / mib:.1f} MiB for initrd {_p(vm.initrd)}" if vm.initrd is not None else ""
    yield (("vm", vm.name, "memory"),
           f"{vm.memory_mib} MiB cannot hold kernel {_p(vm.kernel)}: its setup header asks for "
           f"{init / mib:.1f} MiB from the {load / mib:.0f} MiB mark to unpack itself{with_initrd}, "
           f"{total} MiB in all; the guest would stop before its first line, or panic out of memory",
           f'memory = "{-(-(total + 8) // 32) * 32}M" or more: the kernel needs room to run as well')


def _p(path: Path) -> str:
    """A path inside a message: quoted with escapes when it holds a control character (a newline in
    a spec string would break the one-line-per-problem format)."""
    text = str(path)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        import json

        return json.dumps(text)
    return text


def _folder_problem(path: Path) -> str | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return f"{_p(path)} does not exist"
    except OSError as exc:
        return f"{_p(path)} cannot be looked at: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{_p(path)} is not a folder"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{_p(path)} is not readable by you"
    return None


# What tools/build_guest.py writes into a checkout's examples/guest/: the test guest of the demo lab.
TEST_GUEST_FILES = ("vmlinuz", "initrd.gz")


def _test_guest_hint(path: Path) -> str | None:
    """How to build the test guest, for a file of it that a fresh checkout does not have yet."""
    folder = Path(os.path.abspath(path)).parent
    checkout = folder.parent.parent
    if (path.name not in TEST_GUEST_FILES or folder.name != "guest" or folder.parent.name != "examples"
            or not (checkout / "tools" / "build_guest.py").is_file()):
        return None
    return (f"the test guest is not built yet: `make demo` in {_p(checkout)} builds it, or `make setup` "
            "(tools/build_guest.py) to only build it")


def _whose(info: os.stat_result) -> str:
    """`: it is root's, mode 0600`, for a file another user owns: the why of "not readable by you"."""
    if info.st_uid == os.geteuid():
        return ""
    return f": it is {_user(info.st_uid)}'s, mode {stat.S_IMODE(info.st_mode):04o}"


def _give_back(path: Path, info: os.stat_result, may_be_missing: bool) -> str | None:
    """What to do about a file another user owns (a disk a lab brought up as root made, in a shared
    checkout): have it given back, or, when `up` makes it anew from its size, removed."""
    if info.st_uid == os.geteuid():
        return None
    owner = _user(info.st_uid)
    anew = " (or remove it, if its data may go: `up` makes it anew)" if may_be_missing else ""
    return (f"a lab brought up by {owner} made it or used it: `sudo chown {_user(os.geteuid())}: "
            f"{_p(path)}` gives it to you{anew}")


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def not_a_file(path: Path, mode: int, *, disk: bool,
               device_ok: bool = False) -> tuple[str, str | None] | None:
    """What `path` (of st_mode `mode`) is when it is no file a spec may name there (a folder, a FIFO,
    a device, a socket; a block device unless `device_ok`): a message and a hint. `doctor` asks it too."""
    if stat.S_ISDIR(mode):
        return f"{_p(path)} is a folder, not a file", None
    if stat.S_ISBLK(mode):
        if device_ok:
            return None
        return (f"{_p(path)} is a block device", "add block_device = true to the disk if that is meant"
                if disk else None)
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        return f"{_p(path)} is {kind}, not a file", None
    return None


def _problem(path: Path, *, disk: bool, writable: bool = False, device_ok: bool = False,
             may_be_missing: bool = False, executable: bool = False) -> tuple[str, str | None] | None:
    """What is wrong with `path` (a message and a hint), or None."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if may_be_missing:
            return None
        hint = ("give the disk a size to have `up` create it" if disk
                else _test_guest_hint(path) or "relative paths are relative to the spec file")
        return f"{_p(path)} does not exist", hint
    except OSError as exc:  # EACCES on a folder of the path, ELOOP, ENAMETOOLONG, ENOTDIR
        return f"{_p(path)} cannot be looked at: {exc.strerror or exc}", None
    mode = info.st_mode
    kind = not_a_file(path, mode, disk=disk, device_ok=device_ok)
    if kind is not None:
        return kind
    if stat.S_ISREG(mode) and info.st_size == 0 and not may_be_missing:
        return f"{_p(path)} is empty", None
    if not os.access(path, os.R_OK):
        return f"{_p(path)} is not readable by you{_whose(info)}", _give_back(path, info, may_be_missing)
    if writable and not os.access(path, os.W_OK):
        readonly = "add readonly = true to the disk if the VM only reads it"
        given = _give_back(path, info, may_be_missing)
        return (f"{_p(path)} is not writable by you (the VM writes to this disk){_whose(info)}",
                f"{given}; or {readonly}" if given else readonly)
    if executable and not (os.access(path, os.X_OK) and stat.S_IMODE(mode) & 0o111):
        return (f"{_p(path)} is not executable: vmlaunch runs it as `SCRIPT TAP`, without a shell",
                f"chmod +x {_p(path)}, and start it with a #! line")
    return None
