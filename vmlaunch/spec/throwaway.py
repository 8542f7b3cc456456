"""The lab of a throwaway VM (`vmlaunch run`): one VM of a spec, alone in a lab of its own, made from its
definition and never from its running instance, beside whatever lab is up.

Pure, like `forks.py`: `runtime/throwaway.py` makes the files this names and runs the lab. What a
throwaway VM keeps of its definition, and what it does not:

- its machine whole (memory, CPUs, machine, firmware, kernel, initrd, append, devices, its command
  channel, its shares), since that is what decides what runs in it;
- its NICs, with their MACs and addresses, but on networks of its own: a user network keeps its NAT
  without host port forwards (the lab's own VM holds those ports), and a bridge, tap or socket network
  becomes a socket network that no one else joins (the same devices in the guest, no traffic to the
  lab, no root needed);
- its writable disks as the caller gives them (copy-on-write overlays of the spec's files, or of a
  template's copies), its read-only disks as they are;
- no pinned CPUs (the lab's VM has them), no PCI device (the lab's VM has it: refused), no balloon
  policy and no KSM (nothing for a lab manager to do), no free page reporting (a run's RAM maps its
  template's file, which a reported page would punch a hole in), no netem.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from vmlaunch.errors import SpecUnfit, UsageError
from vmlaunch.spec.model import (
    Balloon,
    BalloonPolicy,
    Disk,
    LabMemory,
    LabSpec,
    Network,
    Nic,
    Share,
    SocketNetwork,
    UserNetwork,
    VmSpec,
)

RUN_PREFIX = "run-"  # the lab name of a throwaway VM: run-<8 hex>
TEMPLATE_PREFIX = "tpl-"  # the lab a template is made in: tpl-<8 hex>
NAME = re.compile(r"(run|tpl)-[0-9a-f]{8}")
SHARE_TAG = "runshare"  # the 9p tags of --share folders: runshare0, runshare1, ...
HOMES = ".throwaway"  # in the run root: each run's home (a dot: not a lab's run dir)
RECIPE = "recipe.json"  # in a run's home: what its lab is made of, for a kept run's commands


def new_name(prefix: str = RUN_PREFIX) -> str:
    return prefix + secrets.token_hex(4)


def is_throwaway(lab: str) -> bool:
    return NAME.fullmatch(lab) is not None


@attrs.frozen
class ExtraShare:
    """`run --share DIR[:TARGET][:ro]`: a host folder mounted in the guest at TARGET (DIR's own path
    when none is given)."""

    source: Path  # absolute
    target: str
    readonly: bool = False


def parse_share(text: str, cwd: Path) -> ExtraShare:
    """`DIR`, `DIR:ro`, `DIR:TARGET`, `DIR:TARGET:ro`; DIR relative to `cwd`. A UsageError for the rest."""
    parts = text.split(":")
    readonly = False
    if len(parts) > 1 and parts[-1] in ("ro", "rw"):
        readonly = parts.pop() == "ro"
    if len(parts) > 2 or not parts[0]:
        raise UsageError(f"--share {text!r}: give DIR, DIR:TARGET, DIR:ro or DIR:TARGET:ro",
                         "a folder's name with ':' in it cannot be shared this way")
    source = (cwd / parts[0]).absolute()
    target = parts[1] if len(parts) == 2 else str(source)
    if not target.startswith("/") or "\n" in target or "," in target or " " in target:
        raise UsageError(f"--share {text!r}: the target {target!r} must be an absolute path in the guest, "
                         "without commas, spaces or newlines")
    return ExtraShare(source, target, readonly)


def share_words(shares: Sequence[ExtraShare]) -> str:
    """The kernel arguments by which vmlaunch's initramfs and the project's test guest mount `shares`
    (`vl.share=TAG:TARGET[:ro]`, their tags as `throwaway_lab` gives them)."""
    return " ".join(f"vl.share={SHARE_TAG}{index}:{share.target}{':ro' if share.readonly else ''}"
                    for index, share in enumerate(shares))


def isolated(network: Network, name: str) -> Network:
    """The throwaway lab's copy of one of its VM's networks (module docstring)."""
    if isinstance(network, UserNetwork):
        return attrs.evolve(network, forward=())
    digest = hashlib.sha256(f"vmlaunch-run\0{name}\0{network.name}".encode()).digest()
    group = f"239.{digest[0]}.{digest[1]}.{max(1, digest[2])}"
    port = 20000 + int.from_bytes(digest[3:5], "big") % 40000
    return SocketNetwork(network.name, group, port, getattr(network, "subnet", None))


def refusals(lab: LabSpec, vm: VmSpec) -> None:
    """Why `vm` cannot run as a throwaway VM."""
    if lab.hosts:
        hosts = ", ".join(host.name for host in lab.hosts)
        raise UsageError(f"run: {lab.file} is a lab on libvirt hosts ({hosts}); a throwaway VM runs on "
                         "this machine", "run a VM of a lab without [host.NAME]")
    from vmlaunch.spec.model import agent_on

    if not agent_on(vm):
        raise SpecUnfit(f"{vm.name} has no command channel (agent = false), through which `run` runs the "
                        "command", f"set agent = true in [vm.{vm.name}] (its guest must run vmlaunch's "
                        "agent or QEMU's guest agent)")
    if vm.pci:
        raise SpecUnfit(f"{vm.name} has a PCI device passed through ({vm.pci[0].host}): the device is its "
                        "lab's VM's, and a throwaway VM cannot have it too", "run a VM without [[pci]]")


def throwaway_lab(lab: LabSpec, vm_name: str, name: str, home: Path, *,
                  disks: Mapping[int, Disk] | None = None, shares: Sequence[ExtraShare] = ()) -> LabSpec:
    """The lab `name` of one VM: `vm_name` of `lab` as a throwaway (module docstring). `home`: the folder
    its lab dir goes in; `disks`: index -> the disk that stands for the spec's writable disk there."""
    vm = lab.vm(vm_name)
    refusals(lab, vm)
    used = []
    for nic in vm.nics:
        if nic.network not in used:
            used.append(nic.network)
    networks = tuple(isolated(lab.network(net), name) for net in used)
    nics = tuple(attrs.evolve(nic, netem=None) for nic in vm.nics)
    given = disks or {}
    new_disks = tuple(given.get(index, disk) for index, disk in enumerate(vm.disks))
    extra = tuple(Share(source=share.source, target=share.target, tag=f"{SHARE_TAG}{index}",
                        readonly=share.readonly) for index, share in enumerate(shares))
    taken = {share.target for share in vm.shares}
    for share in extra:
        if share.target in taken:
            raise UsageError(f"--share: {share.target} is where {vm.name} mounts a share of its spec already",
                             "give the folder another target: --share DIR:TARGET")
        taken.add(share.target)
    append = vm.append
    if extra and vm.kernel is not None:  # a guest vmlaunch boots itself mounts them as told
        append = f"{append or ''} {share_words(shares)}".strip()
    # No free page reporting: QEMU gives a reported page back by punching a hole in the file behind the
    # RAM, and a run's RAM maps its template's file (copy-on-write for writes, not for holes).
    balloon = attrs.evolve(vm.balloon, policy=BalloonPolicy.MANUAL, free_page_reporting=False)
    run_vm = attrs.evolve(vm, nics=nics, disks=new_disks, shares=(*vm.shares, *extra), cpu_pinning=(),
                          balloon=balloon, host=None, append=append)
    return attrs.evolve(lab, name=name, file=home / "lab.toml", networks=networks, vms=(run_vm,),
                        memory=LabMemory(budget_mib=lab.memory.budget_mib, ksm=False),
                        boot_parallel=None, hosts=())


def kernel_lab(kernel: Path, initrd: Path, append: str, memory_mib: int, cpus: int, name: str,
               home: Path, shares: Sequence[ExtraShare]) -> LabSpec:
    """`run --kernel`: a lab of one VM `vm` that boots `kernel` with `initrd`, a NIC on QEMU's user
    network, its command channel and `shares`."""
    from vmlaunch.core.naming import DEFAULT_MAC_PREFIX, derive_mac
    from vmlaunch.core.sourcemap import SourceMap

    vm = VmSpec(name="vm", memory_mib=memory_mib, cpus=cpus, kernel=kernel, initrd=initrd,
                append=f"{append} {share_words(shares)}".strip(),
                nics=(Nic(network="net", mac=derive_mac(DEFAULT_MAC_PREFIX, name, "vm", 0)),),
                balloon=Balloon(), agent=True,
                shares=tuple(Share(source=share.source, target=share.target, tag=f"{SHARE_TAG}{index}",
                                   readonly=share.readonly) for index, share in enumerate(shares)))
    return LabSpec(name=name, file=home / "lab.toml", source=SourceMap(""),
                   networks=(UserNetwork("net"),), vms=(vm,), memory=LabMemory(ksm=False))


def homes(root: Path) -> Path:
    """The folder of every run's home, in the run root."""
    return root / HOMES


def kept_lab(name: str, load: Callable[[Path], LabSpec]) -> LabSpec:
    """The lab of the kept run `name` (`vmlaunch exec run-... VM`), made again from its recipe: from its
    spec (loaded with `load`) or its kernel."""
    import json

    from vmlaunch.layout.dirs import run_root

    home = homes(run_root()) / name
    try:
        recipe = json.loads((home / RECIPE).read_text())
        shares = [ExtraShare(Path(source), target, bool(readonly)) for source, target, readonly
                  in recipe.get("shares") or []]
        kernel = recipe.get("kernel")
        if kernel:
            return kernel_lab(Path(kernel["kernel"]), Path(kernel["initrd"]), kernel["append"],
                              int(kernel["memory"]), int(kernel["cpus"]), name, home,
                              [ExtraShare(Path(s), t, bool(r)) for s, t, r in kernel["shares"]])
        source = load(Path(recipe["spec"]))
        vm = source.vm(recipe["vm"])
        from vmlaunch.spec.model import DiskFormat

        disks = {int(index): attrs.evolve(vm.disks[int(index)], file=Path(file), format=DiskFormat(fmt),
                                          size=None)
                 for index, (file, fmt) in recipe["disks"].items()}
        return throwaway_lab(source, vm.name, name, home, disks=disks, shares=shares)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        raise UsageError(f"{name}: no such file, and no kept throwaway VM of that name",
                         "`vmlaunch ls` lists the labs up; a run kept by `run --keep` is one") from None
