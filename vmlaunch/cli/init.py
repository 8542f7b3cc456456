"""`vmlaunch init`: write a commented starter `lab.toml` into a folder, and nothing else.

The text is `spec/starter.py`'s (pure); this module checks the command line, finds the test guest of
the checkout when no image is named, and writes the file once it is sure it replaces nothing it should
not: an existing lab.toml only with --force, and never through a symlink.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from vmlaunch.cli.common import Commands, command
from vmlaunch.errors import HostError, RuntimeFailure, UsageError

if TYPE_CHECKING:
    from pathlib import Path

    from vmlaunch.spec.catalog import Entry
    from vmlaunch.spec.starter import Starter

log = logging.getLogger("vmlaunch")

# Kept here as well as in spec/starter.py so that building the parser imports argparse only;
# tests/test_init.py checks that the two agree.
NETWORKS = ("socket", "user", "bridge")
MAX_VMS = 64


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    init = command(
        commands, "init", cmd_init, help="write a commented starter lab.toml",
        description="Write a commented lab.toml into DIR (default: the current folder, made when "
        "missing), and nothing else: N VMs (vm1 ... vmN) of a catalog image with cloud-init (--image), or "
        "of the project's tiny test guest, on one network of the lab. The lab is named after DIR. The file "
        "validates as written; its comments point into the manual. An existing lab.toml, or another spec "
        "in DIR, is left alone unless --force. `init --list` shows the images and networks to choose from.")
    init.add_argument("dir", metavar="DIR", nargs="?", default=".",
                      help="the lab's folder (default: the current one)")
    init.add_argument("--image", metavar="NAME",
                      help="a catalog image (`vmlaunch image catalog`); default: the tiny test guest, "
                      "built by tools/build_guest.py into the checkout's examples/guest/")
    init.add_argument("--vms", metavar="N", type=_vms, default=1,
                      help=f"how many VMs, 1 to {MAX_VMS} (default 1)")
    init.add_argument("--network", metavar="TYPE", choices=NETWORKS, default=NETWORKS[0],
                      help="socket (default): a LAN between the VMs over multicast on loopback, no root; "
                      "user: QEMU's NAT, no root, the VMs do not see each other; bridge: a host bridge, "
                      "`up` needs root")
    init.add_argument("--ssh", action="store_true",
                      help="give each VM a management NIC with a forwarded port, for `vmlaunch ssh` and "
                      "`up --wait ssh`: the VMs of an --image always have it (the test guest has no SSH "
                      "server)")
    init.add_argument("--force", action="store_true",
                      help="overwrite DIR/lab.toml (replaced whole; a symlink there is replaced, never "
                      "followed), and write it beside another spec in DIR")
    init.add_argument("--list", action="store_true",
                      help="show the images and networks to choose from; write nothing")


def _vms(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_VMS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of VMs from 1 to {MAX_VMS}")
    return int(text)


def cmd_init(args: argparse.Namespace) -> int:
    if args.list:
        return _print_choices()
    import os
    from pathlib import Path

    from vmlaunch.spec import starter

    folder = Path(args.dir)
    entry = _catalog_entry(args.image) if args.image is not None else None
    if args.ssh and entry is None:
        raise UsageError("--ssh needs --image NAME: the tiny test guest has no SSH server (busybox only)",
                         "`vmlaunch exec SPEC VM -- CMD` reaches it through its command channel, `vmlaunch "
                         "console SPEC VM` its serial console; `vmlaunch init --list` shows the images")
    guest = _test_guest() if entry is None else None  # before DIR is made: a refusal leaves nothing
    target = _target(folder, args.force)
    # the name the user gave DIR (or the current folder's), not where a symlink leads
    lab = starter.lab_name(Path(os.path.abspath(folder)).name)
    plan = starter.Starter(lab=lab, vms=args.vms, network=starter.NetworkKind(args.network), image=entry,
                           ssh=args.ssh or entry is not None, guest=guest)
    try:
        text = starter.lab_text(plan)
    except ValueError as exc:  # the checkout's path is not UTF-8: TOML cannot hold it
        raise HostError(f"the test guest's path cannot be written in TOML: {exc}",
                        "move the checkout to a path of UTF-8 text") from None
    _write(target, text)
    print(target)
    _log_next(target, plan)
    return 0


def _catalog_entry(name: str) -> Entry:
    from vmlaunch.spec import catalog

    entry = catalog.entries().get(name)
    if entry is None:
        near = catalog.closest(name)
        raise UsageError(f"{name!r} is not in the image catalog",
                         (f"did you mean {' or '.join(near)}? " if near else "")
                         + "`vmlaunch init --list` shows the images")
    arch = catalog.host_arch()
    if arch not in entry.builds:
        built = ", ".join(sorted(entry.builds))
        raise UsageError(f"{name} has no {arch} build",
                         f"{name} is built for {built}; `vmlaunch init --list` shows this host's images")
    return entry


def _target(folder: Path, force: bool) -> Path:
    """DIR/lab.toml, once DIR is a folder vmlaunch may write in (made when missing) and nothing there
    stands in the way: an existing lab.toml (a symlink too, even a dangling one) or another spec."""
    import os

    from vmlaunch.spec.starter import SPEC_FILE

    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{_shown(folder)} is not a folder", "give the folder the lab is to be written in")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make the folder {_shown(folder)}: {exc.strerror or exc}",
                         "give a folder you can write in") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write in {_shown(folder)}: permission denied",
                         "give a folder you can write in")
    target = folder / SPEC_FILE
    if os.path.lexists(target):
        if target.is_dir() and not target.is_symlink():
            raise UsageError(f"{_shown(target)} is a folder", "give another DIR, or move that folder away")
        if not force:
            kind = "a symlink" if target.is_symlink() else "a file"
            raise UsageError(f"{_shown(target)} exists ({kind}): init writes a new lab and replaces nothing",
                             "--force overwrites it (a symlink is replaced, not followed)")
        return target
    other = _other_spec(folder, SPEC_FILE)
    if other is not None and not force:
        raise UsageError(f"{_shown(folder)} already holds a vmlaunch spec, {_shown(other.name)}",
                         "give another DIR; --force writes lab.toml beside it (two labs of one name "
                         "share a run dir: rename one)")
    return target


def _shown(path: Path | str) -> str:
    """A path in a message, JSON-quoted when it holds a control character (a newline in DIR would
    otherwise split the one-line message)."""
    import json

    text = str(path)
    return json.dumps(text) if any(ord(char) < 32 or ord(char) == 127 for char in text) else text


def _other_spec(folder: Path, skip: str) -> Path | None:
    """A *.toml in `folder` that reads as a vmlaunch spec (a [lab] or [vm.*] table), if there is one."""
    import sys

    from vmlaunch.core.fsutil import read_bounded
    from vmlaunch.spec.load import MAX_SPEC_BYTES

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.9/3.10 only
        import tomli as tomllib

    for path in sorted(folder.glob("*.toml")):
        if path.name == skip or not path.is_file():
            continue
        try:
            doc = tomllib.loads(read_bounded(path, MAX_SPEC_BYTES).decode("utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue  # not a spec anyone could run
        if isinstance(doc.get("lab"), dict) or isinstance(doc.get("vm"), dict):
            return path
    return None


def _checkout() -> Path:
    """Where the vmlaunch package that runs sits: a checkout of its repository, or an installed copy."""
    from pathlib import Path

    return Path(__file__).resolve().parents[2]  # vmlaunch/cli/init.py


def _test_guest() -> Path:
    """The test guest's folder in the checkout vmlaunch runs from, with its kernel and initramfs."""
    from vmlaunch.spec.starter import GUEST_FILES

    checkout = _checkout()
    folder = checkout / "examples" / "guest"
    builder = checkout / "tools" / "build_guest.py"
    if not builder.is_file():
        raise HostError("the tiny test guest comes with a checkout of vmlaunch's repository, and this "
                        f"vmlaunch runs from {checkout}, which is not one",
                        "give --image NAME (`vmlaunch init --list` shows the images)")
    missing = [name for name in GUEST_FILES if not (folder / name).is_file()]
    if missing:
        raise HostError(f"the tiny test guest is not built: {folder} has no {' or '.join(missing)}",
                        f"`make setup` in {checkout} builds it (or `python3 tools/build_guest.py`); "
                        "or give --image NAME")
    return folder


def _write(target: Path, text: str) -> None:
    from vmlaunch.core.fsutil import write_atomic

    try:
        # A rename into place: a symlink at `target` is replaced, never written through.
        write_atomic(target, text, 0o644)
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {_shown(target)}: {exc.strerror or exc}") from None


def _log_next(target: Path, plan: Starter) -> None:
    import shlex

    shown = str(target)
    spec = shlex.quote(f"./{shown}" if shown.startswith("-") else shown)  # not read as an option
    what = plan.image.title if plan.image is not None else "the tiny test guest"
    log.info("lab %s: %s (%s) on a %s network", plan.lab, ", ".join(plan.vm_names), what, plan.network.value)
    root = " (as root: the bridge needs it)" if plan.network.value == "bridge" else ""
    if plan.image is None:
        steps = [f"vmlaunch up {spec} --wait-for VMLAUNCH-GUEST-READY{root}",
                 f"vmlaunch console {spec} vm1   (Ctrl-] detaches)",
                 f"vmlaunch exec {spec} vm1 -- uname -a"]
    elif plan.ssh:
        steps = [f"vmlaunch up {spec} --wait ssh{root}", f"vmlaunch ssh {spec} vm1"]
    else:
        steps = [f"vmlaunch up {spec}{root}",
                 f"vmlaunch exec {spec} vm1 --wait 600 -- cloud-init status --wait"]
    log.info("next: %s", steps[0])
    for step in steps[1:]:
        log.info("then: %s", step)


def _print_choices() -> int:
    from vmlaunch.spec import catalog, starter

    print("IMAGES (--image NAME)")
    print(f"  {'NAME':<20} {'BUILD':<8} {'NEEDS':<30} IMAGE")
    for name, entry in catalog.entries().items():
        if catalog.host_arch() in entry.builds:
            print(f"  {name:<20} {entry.version:<8} {entry.needs or '-':<30} {entry.title}")
    print(f"  {'(no --image)':<20} {'-':<8} {'-':<30} the tiny test guest: a kernel and busybox, booting "
          "in seconds (tools/build_guest.py; no SSH)")
    print("NETWORKS (--network TYPE)")
    for kind in starter.NetworkKind:
        default = " (default)" if kind is starter.DEFAULT_NETWORK else ""
        print(f"  {kind.value + default:<18} {kind.summary}")
    return 0
