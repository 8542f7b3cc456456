"""`vmlaunch export SPEC --to libvirt|kubevirt`: a lab as another engine's definitions, in a folder.

Kept light like the rest of `cli/`: argparse only at import; the exporters (`export/`) are imported when the
command runs. This module owns the output folder: each file written whole (a temp file renamed into
place), and `.vmlaunch-export` listing what the last export wrote, so that exporting a lab again
removes the files of VMs and networks it no longer has, and nothing else.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vmlaunch.cli.common import ONLY, Commands, command
from vmlaunch.errors import OutputRefused, RuntimeFailure, UsageError

if TYPE_CHECKING:
    from vmlaunch.export import Export
    from vmlaunch.spec.model import LabSpec

log = logging.getLogger("vmlaunch")

MANIFEST = ".vmlaunch-export"
# what an export writes: the only names an earlier manifest may have removed
EXPORTED_NAME = re.compile(r"(domains|networks|vms)/[A-Za-z0-9_][A-Za-z0-9_.-]*\.(xml|yaml)")


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    """The `export` command."""
    export = command(
        commands, "export", cmd_export,
        help="write the lab as libvirt domains and networks, or as KubeVirt objects", raw=True,
        description="""\
Write the lab (or the VMs named, and the networks they use) as another engine's
definitions, carrying over what vmlaunch would run: devices, disk cache and AIO,
MACs, MTU, balloon, hugepages, CPU pinning and NUMA node, kernel, UEFI, seeds.

  --to libvirt   OUT/domains/VM.xml (domain LAB-VM) and OUT/networks/NET.xml
                 (network LAB-NET): virsh net-define, net-start, define, start
  --to kubevirt  OUT/vms/VM.yaml (kubevirt.io/v1 VirtualMachine LAB-VM) and
                 OUT/networks/NET.yaml (Multus NetworkAttachmentDefinition):
                 kubectl apply -f OUT/networks -f OUT/vms

A setting the engine has no equivalent for is a warning with its spec line
(--strict: an error, exit 3). What to do before defining or applying the files
(uploads, images to build, a bridge the host needs) is said at the end.""",
        spec=True, vms=ONLY)
    export.add_argument("--to", metavar="ENGINE", choices=("libvirt", "kubevirt"), required=True,
                        help="libvirt or kubevirt")
    export.add_argument("--out", metavar="DIR",
                        help="the folder to write into, made when missing (default: export-LAB-ENGINE in "
                        "the current folder); files of an earlier export of the lab there are replaced")
    export.add_argument("--strict", action="store_true",
                        help="fail (exit 3, nothing written) when a setting has no equivalent")
    export.add_argument("--existing-bridge", metavar="NET", action="append", default=[],
                        help="libvirt: export network NET in bridge mode, to a bridge the libvirt host "
                        "has (default: a bridge libvirt makes, as vmlaunch does; a network with an "
                        "uplink is always exported this way); repeatable")
    export.add_argument("--namespace", metavar="NS",
                        help="kubevirt: the namespace of every object (default: none written, "
                        "kubectl's current one)")
    export.add_argument("--ovn-layer2", metavar="NET", action="append", default=[],
                        help="kubevirt: network NET as OVN-Kubernetes layer2, which spans nodes (default: "
                        "the bridge CNI, one bridge per node); repeatable")
    export.add_argument("--ref", metavar="KEY=VALUE", action="append", default=[],
                        help="kubevirt: what the cluster has for a file of the lab: vm.V.kernel=IMAGE, "
                        "vm.V.disk[N]=pvc:CLAIM|dv:NAME|containerdisk:IMAGE, "
                        "image.I=pvc:CLAIM|registry:IMAGE, vm.V.pci[N]=RESOURCE; repeatable")


def cmd_export(args: argparse.Namespace) -> int:
    from vmlaunch.compile.preflight import load_checked
    from vmlaunch.errors import ExportError

    _check_options(args)
    lab = load_checked(args.spec, vms=args.vms)
    lab.select(args.vms)
    export = _export(args, lab)
    if args.strict and export.problems:
        raise ExportError(args.to, export.problems)
    for problem in export.problems:
        log.warning("%s", problem)
    out = Path(args.out) if args.out is not None else Path(f"export-{lab.name}-{args.to}")
    written = write_export(export, out, lab.name, partial=bool(args.vms))
    for path in written:
        print(path)
    todo = list(export.todo)
    missing = [path for path in export.lab_files if not path.exists()]
    if missing:
        todo.append(f"the domains use files `vmlaunch up {args.spec}` makes in {missing[0].parent.parent} "
                    f"(overlays, seeds), which are not there yet: {', '.join(map(str, missing))}")
    for line in todo:
        log.info("to do: %s", line)
    log.info("%s", _next_step(export, out))
    return 0


def _check_options(args: argparse.Namespace) -> None:
    other = {"libvirt": ("--namespace", "--ovn-layer2", "--ref"), "kubevirt": ("--existing-bridge",)}
    given = {"--namespace": args.namespace is not None, "--ovn-layer2": bool(args.ovn_layer2),
             "--ref": bool(args.ref), "--existing-bridge": bool(args.existing_bridge)}
    wrong = [option for option in other[args.to] if given[option]]
    if wrong:
        raise UsageError(f"{', '.join(wrong)}: not for --to {args.to}", "see `vmlaunch export --help`")
    for ref in args.ref:
        if "=" not in ref or not ref.partition("=")[2]:
            raise UsageError(f"--ref {ref!r}: KEY=VALUE, e.g. vm.web.kernel=registry.example/kernel:1")


def _export(args: argparse.Namespace, lab: LabSpec) -> Export:
    if args.to == "libvirt":
        from vmlaunch.export.libvirt import export_libvirt

        unknown = sorted(set(args.existing_bridge) - {net.name for net in lab.networks})
        if unknown:
            raise UsageError(f"--existing-bridge {', '.join(unknown)}: no such network in {lab.file}",
                             f"networks: {', '.join(net.name for net in lab.networks) or 'none'}")
        return export_libvirt(lab, args.vms, existing_bridges=frozenset(args.existing_bridge))
    from vmlaunch.export.kubevirt import KubevirtOptions, export_kubevirt
    from vmlaunch.layout.labdir import LabDir

    refs: dict[str, str] = {}
    for ref in args.ref:
        key, _, value = ref.partition("=")
        refs[key] = value
    options = KubevirtOptions(namespace=args.namespace, ovn_layer2=frozenset(args.ovn_layer2), refs=refs,
                              authorized_key=_read_key(LabDir.of(lab.file, lab.name).lab_pub))
    return export_kubevirt(lab, args.vms, options)


def _read_key(path: Path) -> str | None:
    """The lab's SSH public key, when its first `up` has made one."""
    from vmlaunch.core.fsutil import read_bounded

    try:
        text = read_bounded(path, 64 << 10, follow=False).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.startswith("ssh-") else None


def _next_step(export: Export, out: Path) -> str:
    written = {file.path.split("/", 1)[0] for file in export.files}  # no networks/ for a lab without
    if export.target == "libvirt":
        kinds = [(sub, define, start) for sub, define, start in (("networks", "net-define", "net-start"),
                                                                  ("domains", "define", "start"))
                 if sub in written]
        steps = [f"for f in {out}/{sub}/*.xml; do virsh {define} \"$f\"; done" for sub, define, _ in kinds]
        return f"define them: {'; '.join(steps)} (then virsh {', '.join(start for *_, start in kinds)})"
    return "apply them: kubectl apply " + " ".join(f"-f {out}/{sub}" for sub in ("networks", "vms")
                                                   if sub in written)


def write_export(export: Export, out: Path, lab: str, *, partial: bool) -> list[Path]:
    """Write the files under `out`, each whole; remove those of an earlier export of this lab and
    engine that this one (when not `partial`: only some VMs) no longer has. Returns what it wrote."""
    import json

    from vmlaunch.core.fsutil import Unfit, write_new

    manifest = out / MANIFEST
    earlier = _read_manifest(manifest)
    if earlier is not None and (earlier.get("lab"), earlier.get("target")) != (lab, export.target):
        raise UsageError(f"{out} holds the {earlier.get('target')} export of lab {earlier.get('lab')}",
                         "choose another folder with --out")
    names = [file.path for file in export.files]
    # only what an export writes: a manifest someone edited never names a file elsewhere to remove
    old = [name for name in (earlier or {}).get("files", [])
           if isinstance(name, str) and EXPORTED_NAME.fullmatch(name)]
    keep = sorted(set(names) | set(old)) if partial else sorted(names)
    written = []
    try:
        for sub in sorted({name.split("/", 1)[0] for name in [*names, *old]}):
            if (out / sub).is_symlink():  # writing or removing through it would reach elsewhere
                raise RuntimeFailure(f"{out / sub} is a symbolic link: the export writes only inside "
                                     f"{out}", "remove the link, or choose another folder with --out")
        for file in export.files:
            path = out / file.path
            path.parent.mkdir(parents=True, exist_ok=True)
            write_new(path, file.text, 0o644)
            written.append(path)
        for name in sorted(set(old) - set(keep)):
            (out / name).unlink(missing_ok=True)
        write_new(manifest, json.dumps({"lab": lab, "target": export.target, "files": keep}, indent=1)
                  + "\n", 0o644)
    except Unfit as exc:
        raise OutputRefused.of(exc) from None
    except OSError as exc:
        where = exc.filename or out
        raise RuntimeFailure(f"cannot write the export to {where}: {exc.strerror or exc}",
                             "choose a folder you can write with --out") from None
    return written


def _read_manifest(path: Path) -> dict[str, Any] | None:
    import json

    from vmlaunch.core.fsutil import read_bounded

    try:
        found = json.loads(read_bounded(path, 1 << 20, follow=False))
    except (OSError, ValueError):  # none, or damaged: nothing known to remove
        return None
    return found if isinstance(found, dict) else None
