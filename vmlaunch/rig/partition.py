"""Network partitions of a lab that is up (`vmlaunch partition`, `Lab.partition`, `Lab.heal`).

The partition is a list of groups of VMs. Each group is cut off from every other group and from the
rest of the lab (the VMs in no group), on every network where VMs of two sides meet:

- `partition A B` makes A and B one more group (taking them out of any group they were in), so a
  second call cuts another group off; the same call twice changes nothing;
- `heal A` puts A back with the rest; `heal` alone removes every cut.

Where a cut is made depends on the network:

- bridge (and tap) networks: on the host, in the lab's bridge-family nftables table
  (`host/nftables.py`), which `down` removes (and `down --force` after a crash);
- socket networks, which have no host side (QEMU's multicast joins the VMs): in each guest on it, with
  the guest's own `tc` (a flower filter on the NIC's ingress, preference `GUEST_PREF`, dropping frames
  from the other sides' MACs), through the command channel (`rig/agent.py`); they die with the
  guest;
- user networks join no VMs (each VM has its own NAT): nothing to cut.

The record is `partition` in wire.json (`lab/wire.py`): the groups and, per network cut, where.
Intent before action: before anything changes it names every cut that may exist while the change
runs, marked `unfinished`; it is narrowed when the change is done. A change that fails half-way is
undone; what cannot be undone stays in the record, still `unfinished` (with why), so that a crash
(kill -9) or a failed undo leaves a record naming at least what exists: `partition` shows it,
`--heal` removes it and says so, `down` removes the table.
"""

from __future__ import annotations

import logging
import shlex
import shutil
from collections.abc import Callable, Sequence

import attrs

from vmlaunch.core.naming import nft_table_name, tap_name
from vmlaunch.errors import AgentError, RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.host import nftables
from vmlaunch.host.nftables import BridgeCut
from vmlaunch.lab import wire
from vmlaunch.layout.rundir import RunDir
from vmlaunch.spec.model import BridgeNetwork, LabSpec, SocketNetwork, TapNetwork, agent_on

log = logging.getLogger(__name__)

GUEST_PREF = 7  # the preference of vmlaunch's filters under a guest NIC's ingress qdisc
LOCK_TIMEOUT = 60.0  # seconds to wait for another vmlaunch (`up`, `down`) on the lab
REST = "the rest"
INTERRUPTED = "a change to the partition did not finish (it is under way, or vmlaunch was stopped)"
Groups = list[list[str]]


@attrs.frozen
class GuestCut:
    """What one VM drops on one of its NICs on a network without a host side: frames from `drop`."""

    vm: str
    network: str
    mac: str  # its NIC's MAC: how the guest's interface is found
    drop: tuple[str, ...]  # MACs of the VMs on other sides


@attrs.frozen
class Cuts:
    host: tuple[BridgeCut, ...] = ()
    guest: tuple[GuestCut, ...] = ()  # only those with something to drop
    where: dict[str, str] = attrs.field(factory=dict)  # network -> "host" | "guest"


def regroup(groups: Sequence[Sequence[str]], vms: Sequence[str], *, heal: bool) -> Groups:
    """The groups after `partition vms` (or `--heal vms`; `--heal` alone: none)."""
    if heal and not vms:
        return []
    named = set(vms)
    kept = [[vm for vm in group if vm not in named] for group in groups]
    kept = [group for group in kept if group]
    return kept if heal else [*kept, list(vms)]


def check_names(lab: LabSpec, vms: Sequence[str], *, heal: bool) -> None:
    """UsageError for no VM (but with --heal), a VM named twice, or one the lab does not have."""
    if not vms and not heal:
        raise UsageError("name the VMs to cut off (or --heal)", "vmlaunch partition SPEC VM [VM...]")
    twice = sorted({vm for vm in vms if list(vms).count(vm) > 1})
    if twice:
        raise UsageError(f"VM {', '.join(twice)} named twice", "name each VM once")
    lab.select(vms)


def sides_of(lab: LabSpec, groups: Sequence[Sequence[str]]) -> dict[str, int]:
    """VM -> its side: the index of its group, or -1 for the rest."""
    side = {vm.name: -1 for vm in lab.vms}
    for index, group in enumerate(groups):
        for vm in group:
            side[vm] = index
    return side


def plan(lab: LabSpec, groups: Sequence[Sequence[str]]) -> Cuts:
    """Where each network with VMs of two sides on it is cut, and how (pure)."""
    side = sides_of(lab, groups)
    host: list[BridgeCut] = []
    guest: list[GuestCut] = []
    where: dict[str, str] = {}
    for net in lab.networks:
        members = [(vm.name, index, nic.mac) for vm in lab.vms for index, nic in enumerate(vm.nics)
                   if nic.network == net.name]
        present = sorted({side[vm] for vm, _, _ in members}, key=lambda s: (s < 0, s))  # the rest last
        if len(present) < 2:
            continue
        if isinstance(net, (BridgeNetwork, TapNetwork)):
            sides = tuple(tuple(tap_name(lab.name, vm, index) for vm, index, _ in members if side[vm] == s)
                          for s in present)
            labels = tuple(_label([vm for vm, _, _ in members if side[vm] == s], s) for s in present)
            host.append(BridgeCut(net.name, sides, labels))
            where[net.name] = "host"
        elif isinstance(net, SocketNetwork):
            for vm, _, mac in members:
                drop = tuple(other_mac for other, _, other_mac in members if side[other] != side[vm])
                guest.append(GuestCut(vm, net.name, mac, drop))
            where[net.name] = "guest"
    return Cuts(tuple(host), tuple(guest), where)


def _label(vms: Sequence[str], side: int) -> str:
    names = ",".join(dict.fromkeys(vms))
    return f"{REST} ({names})" if side < 0 else names


def partition(run_dir: RunDir, lab: LabSpec, vms: Sequence[str]) -> Groups:
    """Cut `vms` off, as one more group; returns the groups now."""
    check_names(lab, vms, heal=False)
    return _change(run_dir, lab, vms, heal=False)


def heal(run_dir: RunDir, lab: LabSpec, vms: Sequence[str] = ()) -> Groups:
    """Put `vms` back with the rest (none: heal every cut); returns the groups now."""
    check_names(lab, vms, heal=True)
    return _change(run_dir, lab, vms, heal=True)


def current(run_dir: RunDir) -> Groups:
    groups = wire.load(run_dir)["partition"].get("groups")
    return [list(group) for group in groups] if isinstance(groups, list) else []


def _change(run_dir: RunDir, lab: LabSpec, vms: Sequence[str], *, heal: bool) -> Groups:
    from vmlaunch.lab.journal import Journal, locked

    if not run_dir.path.is_dir():
        raise RuntimeFailure(f"lab {lab.name} is not up", "`vmlaunch up` it first")
    with locked(run_dir, LOCK_TIMEOUT):  # not while an `up` or `down` of the lab changes it
        up = set(Journal.load(run_dir).vms)
        if not up:
            raise RuntimeFailure(f"lab {lab.name} is not up", "`vmlaunch up` it first")
        before = current(run_dir)
        groups = [group for group in regroup(before, vms, heal=heal) if group]
        if not heal and len(set(sides_of(lab, groups).values())) < 2:
            raise UsageError(f"{', '.join(vms)}: every VM of the lab; nothing is left to cut them off from",
                             "name the VMs of one side only")
        cuts = plan(lab, groups)
        if not heal and not cuts.where:
            log.info("%s: no network joins them to other VMs of the lab; nothing to cut", ", ".join(vms))
        old = wire.load(run_dir)["partition"]
        old_where: dict[str, str] = dict(old.get("where") or {})
        may_exist = {**old_where, **cuts.where}
        guest_nets = {net for net, kind in may_exist.items() if kind == "guest"}
        _check_channels(lab, guest_nets, up)  # before anything changes
        wire.update(run_dir, _record(groups, may_exist, INTERRUPTED))  # what may exist while changing
        try:
            if cuts.host or "host" in old_where.values():
                nftables.apply(nft_table_name(lab.name), cuts.host)
            _apply_guests(run_dir, lab, cuts, guest_nets, up)
        except BaseException as exc:
            failed = _restore(run_dir, lab, before, may_exist, guest_nets, up)
            back = plan(lab, before).where
            left = {**back, **{net: kind for net, kind in may_exist.items() if kind in failed}}
            why = None
            if failed:  # the record keeps naming what may be left, for `--heal` and `down`
                said = exc.message if isinstance(exc, VmlaunchError) else type(exc).__name__
                undo = "; ".join(failed.values())
                why = f"a change failed half-way ({said}) and undoing it failed too ({undo})"
            wire.update(run_dir, _record(before, left, why))
            raise
        wire.update(run_dir, _record(groups, cuts.where, None))
        removed = {net: kind for net, kind in may_exist.items() if net not in cuts.where}
        if old.get("unfinished") and removed:
            log.info("removed what an unfinished change of the partition left: %s",
                     _describe_where(lab, removed, up))
        elif old.get("unfinished"):
            log.info("the unfinished change of the partition is done: every cut is as shown")
        return groups


def _record(groups: Groups, where: dict[str, str], unfinished: str | None) -> Callable[[wire.State], None]:
    def change(state: wire.State) -> None:
        state["partition"] = {"groups": groups, "where": where}
        if unfinished:
            state["partition"]["unfinished"] = unfinished
    return change


def _describe_where(lab: LabSpec, where: dict[str, str], up: set[str]) -> str:
    """`lan (nftables table vmlaunch-LAB), mc (the filters of a, b)`."""
    said = []
    for net, kind in sorted(where.items()):
        if kind == "host":
            said.append(f"{net} (nftables table {nft_table_name(lab.name)})")
        else:
            vms = [vm.name for vm in lab.vms if vm.name in up and any(nic.network == net for nic in vm.nics)]
            said.append(f"{net} (the tc filters of {', '.join(vms) or 'no running VM'})")
    return ", ".join(said)


def _check_channels(lab: LabSpec, networks: set[str], up: set[str]) -> None:
    """A network cut in the guests needs the channel of every running VM on it."""
    for spec in lab.vms:
        if spec.name in up and not agent_on(spec) and any(nic.network in networks for nic in spec.nics):
            net = next(nic.network for nic in spec.nics if nic.network in networks)
            raise AgentError(f"VM {spec.name} has no command channel (agent = false): network {net} has no "
                             "host side, and is cut in the guests through it", "set agent = true on it")


def _restore(run_dir: RunDir, lab: LabSpec, groups: Groups, may_exist: dict[str, str],
             guest_nets: set[str], up: set[str]) -> dict[str, str]:
    """Put back the partition as it was before a change that failed half-way, host and guests each
    tried; returns what could not be put back ("host", "guest" -> why). The error of the change is the
    one the user sees; these are warnings."""
    cuts = plan(lab, groups)
    failed: dict[str, str] = {}
    if "host" in may_exist.values() or cuts.host:
        try:
            nftables.apply(nft_table_name(lab.name), cuts.host)
        except (VmlaunchError, OSError) as exc:
            failed["host"] = exc.message if isinstance(exc, VmlaunchError) else str(exc)
    try:
        _apply_guests(run_dir, lab, cuts, guest_nets, up)
    except (VmlaunchError, OSError) as exc:
        failed["guest"] = exc.message if isinstance(exc, VmlaunchError) else str(exc)
    for why in failed.values():
        log.warning("putting the partition back as it was failed too: %s", why)
    return failed


def _apply_guests(run_dir: RunDir, lab: LabSpec, cuts: Cuts, networks: set[str], up: set[str]) -> None:
    """Make every running VM on `networks` drop what `cuts` says (nothing: remove its filters)."""
    if not networks:
        return
    drops: dict[str, dict[str, tuple[str, ...]]] = {}  # VM -> its MAC -> MACs to drop
    for spec in lab.vms:
        for nic in spec.nics:
            if nic.network in networks and spec.name in up:
                drops.setdefault(spec.name, {})[nic.mac] = ()
    for cut in cuts.guest:
        if cut.vm in drops:
            drops[cut.vm][cut.mac] = cut.drop
    for vm, nics in drops.items():
        run_guest_script(run_dir, vm, guest_script(nics))


def guest_script(nics: dict[str, tuple[str, ...]]) -> str:
    """The shell script that leaves each NIC (by MAC) dropping frames from exactly the MACs given. A
    filter that is not there is not an error (a heal, or the undo of a cut that failed half-way), nor
    is a guest without tc when nothing is to be dropped: it has no filter of vmlaunch's to remove."""
    no_tc = "exit 0" if not any(nics.values()) else "{ echo 'no tc (iproute2) in the guest' >&2; exit 127; }"
    lines = [
        f"command -v tc >/dev/null 2>&1 || {no_tc}",
        "nic() { for d in /sys/class/net/*; do",
        '  [ "$(cat "$d/address" 2>/dev/null)" = "$1" ] && { echo "${d##*/}"; return 0; }',
        'done; echo "no interface has MAC $1" >&2; return 1; }',
    ]
    for mac, drop in nics.items():
        lines.append(f"dev=$(nic {shlex.quote(mac)}) || exit 3")
        lines.append(f'tc filter del dev "$dev" ingress pref {GUEST_PREF} 2>/dev/null || :')
        if drop:
            lines.append('tc qdisc add dev "$dev" ingress 2>/dev/null')
        for other in drop:
            lines.append(f'tc filter add dev "$dev" ingress pref {GUEST_PREF} protocol all flower '
                         f"src_mac {shlex.quote(other)} action drop || exit 4")
    return "\n".join(lines) + "\n"


def run_guest_script(run_dir: RunDir, vm: str, script: str) -> None:
    from vmlaunch.core.textsafe import printable
    from vmlaunch.rig import agent

    result = agent.run(run_dir, vm, script, timeout=30.0)
    if result.exit_code == 0:
        return
    said = printable(result.stderr.decode(errors="replace").strip())[-300:] or f"exit {result.exit_code}"
    if result.exit_code == 127:
        raise RuntimeFailure(f"{vm}: cannot cut its socket network in the guest: {said}",
                             "install iproute2 in the guest (its tc drops the frames)")
    raise RuntimeFailure(f"{vm}: the guest's tc could not cut its socket network: {said}",
                         "the guest kernel needs cls_flower and act_gact (tc flower ... action drop)")


def remove_table(run_dir: RunDir, *, recorded: bool | None = None) -> list[str]:
    """Remove the lab's nftables table (`down`, `down --force`); returns what failed. `recorded`: the
    record says a host cut may exist (None: read it). Without a record, a table is still looked for
    where nft is installed (a crash before the record), quietly."""
    if recorded is None:
        where = wire.load(run_dir)["partition"].get("where") or {}
        recorded = "host" in dict(where).values()
    table = nft_table_name(run_dir.lab)
    try:
        if recorded:
            nftables.remove(table)
            log.info("nftables table %s: removed (the lab's partition)", table)
        elif shutil.which(nftables.NFT) and table in nftables.tables():
            nftables.remove(table)
            log.info("nftables table %s: removed (left by a partition)", table)
    except VmlaunchError as exc:
        if recorded:
            return [f"the lab's partition (nftables table {table}) could not be removed: {exc.message}"]
        log.debug("looking for the nftables table %s: %s", table, exc.message)
    return []
