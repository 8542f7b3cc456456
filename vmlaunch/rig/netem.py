"""netem on a running lab's NICs: `vmlaunch netem`, `Vm.netem`, and the spec's `netem = { ... }` once
`up` has the VMs running.

Which direction each figure applies to: delay, jitter, loss, corrupt, duplicate and reorder to the
traffic the VM's NIC sends, so once per round trip (`--delay 100` adds 100 ms to a ping's round trip,
`--loss 30` loses about 30 % of pings); rate to each direction. Setting a NIC's netem replaces what was
set on it before (figures not given are cleared).

Where it runs (`where`):
- host: on the NIC's tap, over netlink (host/netem.py): any guest OS, no agent; bridge and tap networks
  only, and the host kernel needs sch_netem (a HostError, exit 3, naming CONFIG_NET_SCH_NETEM);
- guest: with the guest's own `tc` through the command channel (`agent.run`): what the NIC sends on
  the interface's root qdisc, the rate of what it receives on an IFB (`vlifbN`) its ingress is
  redirected to. A guest without tc, netem, ifb or the mirred action is a HostError too (exit 3): the
  machine asked to shape the traffic cannot, as for the host;
- auto: host where the NIC has a host interface and the host kernel has netem, else guest.

What is set is recorded in wire.json (lab/wire.py) under nics["VM/INDEX"]["netem"]: the figures in
fixed units, "where", and on the host the IFB's name. `down` deletes the IFBs of the VMs it stops
(found by their mark, so what a crash left too) and forgets their records.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import time
from collections.abc import Collection, Iterable
from typing import Any

from vmlaunch.compile.plan import Plan, VmPlan
from vmlaunch.core.naming import netem_ifb_name, tap_name
from vmlaunch.core.textsafe import printable
from vmlaunch.errors import AgentError, HostError, RuntimeFailure, UsageError, VmlaunchError
from vmlaunch.lab import wire
from vmlaunch.layout.rundir import RunDir
from vmlaunch.spec.model import TAP_NETWORKS, LabSpec, Netem, NetemWhere
from vmlaunch.spec.netem import figures, from_json, resolve_where, to_json

log = logging.getLogger(__name__)

GUEST_TIMEOUT = 30.0  # seconds for the tc commands in a guest
AGENT_POLL = 0.5  # seconds between tries while `up` waits for a guest's channel to answer

# How the guest script says what is missing (its exit status), and what it means
NO_INTERFACE, NO_TC, NO_NETEM, NO_IFB, TC_FAILED = 90, 91, 92, 93, 94


def guest_ifb(index: int) -> str:
    """The IFB in the guest that NIC `index`'s ingress is redirected to (for the rate)."""
    return f"vlifb{index}"


def tc_netem_words(netem: Netem, *, rate_only: bool = False) -> list[str]:
    """`netem ...` as tc(8) reads it: times in whole microseconds, rates in bit/s."""
    words = ["netem"]
    if not rate_only:
        if netem.delay_ms is not None:
            words += ["delay", f"{round(netem.delay_ms * 1000)}us"]
            if netem.jitter_ms is not None:
                words.append(f"{round(netem.jitter_ms * 1000)}us")
        for key in ("loss", "corrupt", "duplicate", "reorder"):
            value = getattr(netem, key)
            if value is not None:
                words += [key, f"{value:g}%"]
    if netem.rate_bit is not None:
        words += ["rate", f"{netem.rate_bit}bit"]
    return words


def guest_script(mac: str, index: int, netem: Netem | None) -> str:
    """The shell script that sets (or, with None, clears) a NIC's netem in the guest. The interface is
    the one with the NIC's MAC that is a device (not a bridge or bond that took its MAC)."""
    ifb = guest_ifb(index)
    lines = [
        "PATH=$PATH:/usr/sbin:/sbin",
        f"mac={shlex.quote(mac.lower())}; ifb={ifb}; dev=",
        'for d in /sys/class/net/*; do [ -e "$d/device" ] || continue',
        '  [ "$(cat "$d/address" 2>/dev/null)" = "$mac" ] && { dev=${d##*/}; break; }; done',
        f'[ -n "$dev" ] || {{ echo "no interface with MAC $mac" >&2; exit {NO_INTERFACE}; }}',
        f'command -v tc >/dev/null 2>&1 || {{ echo "no tc command (iproute2)" >&2; exit {NO_TC}; }}',
        # busybox's tc has no netem: only iproute2's will do
        f'tc -V 2>&1 | grep -q iproute2 || {{ echo "tc is not iproute2\'s" >&2; exit {NO_TC}; }}',
        'tc qdisc del dev "$dev" root 2>/dev/null; tc qdisc del dev "$dev" ingress 2>/dev/null',
        'ip link del "$ifb" 2>/dev/null',
    ]
    if netem is None:
        return "\n".join([*lines, "exit 0", ""])
    # "Specified qdisc kind is unknown" (or an old tc's "Unknown qdisc"): no sch_netem
    fail = (f'case $out in *nknown*) echo "$out" >&2; exit {NO_NETEM};; esac; echo "$out" >&2; '
            f"exit {TC_FAILED}")
    lines += [
        "modprobe sch_netem 2>/dev/null",
        f'out=$(tc qdisc replace dev "$dev" root {shlex.join(tc_netem_words(netem))} 2>&1) || {{ {fail}; }}',
    ]
    if netem.rate_bit is not None:
        lines += [
            "modprobe ifb 2>/dev/null",
            f'out=$(ip link add "$ifb" type ifb 2>&1) || {{ echo "$out" >&2; exit {NO_IFB}; }}',
            'ip link set "$ifb" up',
            f'out=$(tc qdisc replace dev "$dev" handle ffff: ingress 2>&1) || {{ {fail}; }}',
            'out=$(tc filter replace dev "$dev" parent ffff: protocol all prio 1 u32 match u32 0 0 '
            f'action mirred egress redirect dev "$ifb" 2>&1) || {{ {fail}; }}',
            f'out=$(tc qdisc replace dev "$ifb" root {shlex.join(tc_netem_words(netem, rate_only=True))} '
            f"2>&1) || {{ {fail}; }}",
        ]
    return "\n".join([*lines, "exit 0", ""])


def run_in_guest(run_dir: RunDir, vm: str, mac: str, index: int, netem: Netem | None,
                 timeout: float = GUEST_TIMEOUT) -> None:
    """Set (or clear) NIC `index`'s netem in the guest through its command channel; a guest that cannot
    is a HostError (exit 3) naming what it lacks."""
    from vmlaunch.rig import agent

    result = agent.run(run_dir, vm, guest_script(mac, index, netem), timeout=timeout)
    if result.exit_code == 0:
        return
    said = printable(result.stderr.decode(errors="replace").strip()).splitlines()
    detail = f": {said[-1]}" if said else ""
    where = f"{vm} (NIC {index}, MAC {mac})"
    if result.exit_code == NO_TC:
        raise HostError(f"{where}: the guest has no tc of iproute2 (busybox's tc cannot set netem)",
                        "install iproute2 in the guest")
    if result.exit_code == NO_NETEM:
        raise HostError(f"{where}: the guest's kernel has no netem (sch_netem){detail}",
                        "a guest kernel with CONFIG_NET_SCH_NETEM, or --where host on a bridge network")
    if result.exit_code == NO_IFB:
        raise HostError(f"{where}: the guest cannot make an IFB for the rate of what the NIC receives"
                        f"{detail}", "a guest kernel with CONFIG_IFB (modprobe ifb)")
    if result.exit_code == NO_INTERFACE:
        raise RuntimeFailure(f"{where}: the guest has no interface with the NIC's MAC",
                             "is the NIC's driver loaded in the guest?")
    raise RuntimeFailure(f"{where}: setting netem in the guest failed (exit {result.exit_code}){detail}")


# --- the NIC, and where its netem goes ---------------------------------------------------------------


def resolve_side(lab: LabSpec, vm: str, index: int, where: NetemWhere,
                 host_netem: bool | None = None) -> NetemWhere:
    """HOST or GUEST for NIC `index` of `vm`: `host` on a NIC without a host interface is a UsageError,
    on a host kernel without netem a HostError (exit 3, naming CONFIG_NET_SCH_NETEM)."""
    from vmlaunch.host import netem as host

    nic = lab.vm(vm).nics[index]
    net = lab.network(nic.network)
    host_side = isinstance(net, TAP_NETWORKS)
    if where is NetemWhere.HOST and not host_side:
        raise UsageError(f"NIC {index} of {vm} is on {net.type.value} network {net.name!r}, which has no "
                         "host interface to shape", "use --where guest (or auto)")
    if where is not NetemWhere.GUEST and host_netem is None:
        host_netem = host.host_has_netem()
    side = resolve_where(where, host_side=host_side, host_netem=bool(host_netem))
    if side is NetemWhere.HOST and not host_netem:
        raise host.no_netem()
    return side


def _apply_host(lab: str, vm: str, index: int, netem: Netem | None) -> str:
    """Set (or clear) netem on the NIC's tap; returns the IFB's name."""
    from vmlaunch.host.links import netlink
    from vmlaunch.host.netem import apply_on_tap, clear_on_tap

    tap = tap_name(lab, vm, index)
    ifb = netem_ifb_name(tap)
    with netlink(tap) as nl:
        if netem is None:
            clear_on_tap(nl, lab, tap, ifb)
            return ifb
        try:
            apply_on_tap(nl, lab, vm, tap, ifb, netem)
        except BaseException:
            with contextlib.suppress(Exception):  # the apply's error is the one to say
                clear_on_tap(nl, lab, tap, ifb)
            raise
    return ifb


def record(netem: Netem, where: NetemWhere, ifb: str | None = None) -> dict[str, Any]:
    """The wire.json record of a NIC's netem."""
    data: dict[str, Any] = {**to_json(netem), "where": where.value}
    if ifb is not None:
        data["ifb"] = ifb
    return data


def _save(run_dir: RunDir, key: str, data: dict[str, Any] | None) -> None:
    def change(state: wire.State) -> None:
        nic = state["nics"].setdefault(key, {})
        if data is None:
            nic.pop("netem", None)
            if not nic:
                del state["nics"][key]
        else:
            nic["netem"] = data

    wire.update(run_dir, change)


def set_netem(run_dir: RunDir, lab: LabSpec, vm: str, index: int, netem: Netem, *,
              timeout: float = GUEST_TIMEOUT, host_netem: bool | None = None) -> dict[str, Any]:
    """Set NIC `index`'s netem (replacing what it had) where `netem.where` says; returns its record."""
    from vmlaunch.lab.running import running_pid

    side = resolve_side(lab, vm, index, netem.where, host_netem)  # first: a host without netem never can
    running_pid(run_dir, vm)  # a RuntimeFailure when the VM is not running
    key = wire.nic_key(vm, index)
    before = wire.load(run_dir)["nics"].get(key, {}).get("netem")
    if isinstance(before, dict) and before.get("where") != side.value:  # moved: cleared where it was
        _clear_at(run_dir, lab, vm, index, before.get("where"), timeout)
    ifb = None
    if side is NetemWhere.HOST:
        # recorded first: an IFB a crash leaves behind is one `down` knows to look for
        _save(run_dir, key, record(netem, side, netem_ifb_name(tap_name(lab.name, vm, index))))
        try:
            ifb = _apply_host(lab.name, vm, index, netem)
        except BaseException:
            _save(run_dir, key, None)
            raise
    else:
        run_in_guest(run_dir, vm, lab.vm(vm).nics[index].mac, index, netem, timeout)
    data = record(netem, side, ifb)
    _save(run_dir, key, data)
    return data


def _clear_at(run_dir: RunDir, lab: LabSpec, vm: str, index: int, where: object, timeout: float) -> None:
    if where == NetemWhere.HOST.value:
        _apply_host(lab.name, vm, index, None)
    elif where == NetemWhere.GUEST.value:
        run_in_guest(run_dir, vm, lab.vm(vm).nics[index].mac, index, None, timeout)


def clear_netem(run_dir: RunDir, lab: LabSpec, vm: str, index: int, *,
                timeout: float = GUEST_TIMEOUT) -> bool:
    """Clear NIC `index`'s netem where it was set; False when none was set."""
    from vmlaunch.lab.running import running_pid

    running_pid(run_dir, vm)
    key = wire.nic_key(vm, index)
    before = wire.load(run_dir)["nics"].get(key, {}).get("netem")
    if not isinstance(before, dict):
        return False
    _clear_at(run_dir, lab, vm, index, before.get("where"), timeout)
    _save(run_dir, key, None)
    return True


def listing(run_dir: RunDir, lab: LabSpec) -> list[dict[str, Any]]:
    """Every NIC with netem set, as {"vm", "nic", "network", "where", figures shown as text}."""
    rows = []
    state = wire.load(run_dir)
    for vm in lab.vms:
        for index, nic in enumerate(vm.nics):
            data = state["nics"].get(wire.nic_key(vm.name, index), {}).get("netem")
            netem = from_json(data) if isinstance(data, dict) else None
            if netem is None or not isinstance(data, dict):
                continue
            rows.append({"vm": vm.name, "nic": index, "network": nic.network,
                         "where": str(data.get("where")), **figures(netem)})
    return rows


# --- up and down ---------------------------------------------------------------------------------------


def apply_at_up(plan: Plan, vms: Iterable[VmPlan], deadline: float) -> None:
    """Once `up` has the VMs running: record the spec's netem the host resources set on their taps, and
    set what runs in the guests through their channels, waiting for each channel to answer until
    `deadline`."""
    from vmlaunch.resources.netem import TapNetem

    started = {vm.name: vm for vm in vms}
    for resource in plan.resources:
        if isinstance(resource, TapNetem) and resource.vm in started:
            _save(plan.run_dir, wire.nic_key(resource.vm, resource.index),
                  record(resource.netem, NetemWhere.HOST, resource.ifb))
    for vm in started.values():
        for index, mac, netem in vm.guest_netem:
            _wait_for_guest(plan.run_dir, vm.name, mac, index, netem, deadline)
            _save(plan.run_dir, wire.nic_key(vm.name, index), record(netem, NetemWhere.GUEST))
            log.info("%s: netem on NIC %d in the guest: %s", vm.name, index, _shown(netem))


def _shown(netem: Netem) -> str:
    return " ".join(f"{key} {value}" for key, value in figures(netem).items())


def _wait_for_guest(run_dir: RunDir, vm: str, mac: str, index: int, netem: Netem, deadline: float) -> None:
    """Set netem in the guest once its channel answers; AgentError when it never does by `deadline`."""
    while True:
        try:
            run_in_guest(run_dir, vm, mac, index, netem, timeout=max(1.0, min(GUEST_TIMEOUT,
                                                                           deadline - time.monotonic())))
            return
        except AgentError as exc:
            if time.monotonic() >= deadline:
                raise AgentError(f"{vm}: the spec's netem of NIC {index} runs in the guest, and its command "
                                 f"channel did not answer in time ({exc.message})",
                                 "give `up` a longer --timeout, or use where = \"host\" on a bridge "
                                 "network of a host with netem") from None
            time.sleep(AGENT_POLL)


def undo_at_down(run_dir: RunDir, lab: str, vms: Collection[str] | None) -> list[str]:
    """For `down` (of `vms`, or the whole lab with None): delete the lab's netem IFBs of those VMs, found
    by their mark (what a crash left too), and forget their wire records. Returns what failed."""
    problems: list[str] = []
    state = wire.load(run_dir)
    hosted = any(isinstance(nic, dict) and isinstance(nic.get("netem"), dict)
                 and nic["netem"].get("where") == NetemWhere.HOST.value
                 and (vms is None or key.split("/", 1)[0] in vms) for key, nic in state["nics"].items())
    if hosted:  # else nothing to look for (the spec's own are the journal's to undo)
        problems += remove_lab_ifbs(lab, vms)
    if vms is not None and run_dir.path.is_dir() and state["nics"]:
        def forget(state: wire.State) -> None:
            for key in list(state["nics"]):
                if key.split("/", 1)[0] in vms and isinstance(state["nics"][key], dict):
                    state["nics"][key].pop("netem", None)

        with contextlib.suppress(VmlaunchError, OSError):
            wire.update(run_dir, forget)
    return problems


def remove_lab_ifbs(lab: str, vms: Collection[str] | None = None) -> list[str]:
    """Delete the IFBs marked as the lab's (of `vms` only, when given); returns what failed."""
    from vmlaunch.host.links import LinkError, netlink
    from vmlaunch.host.netem import lab_ifbs

    problems = []
    try:
        with netlink("(every interface)") as nl:
            for link in lab_ifbs(nl.links("(every interface)", "listing interfaces"), lab, vms):
                try:
                    nl.delete(link)
                    log.info("IFB %s: removed (netem of lab %s)", link.name, lab)
                except LinkError as exc:
                    problems.append(str(exc))
    except (VmlaunchError, OSError) as exc:  # no netlink here (no permission)
        problems.append(f"the lab's netem IFBs could not be listed: {exc}")
    return problems
