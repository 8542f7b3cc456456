"""Scenarios of the bridge and tap resources, run by tests/test_links.py INSIDE A PRIVATE NETWORK
NAMESPACE.

    unshare -n -- python tests/netns_links.py SCENARIO [ARG]

Each scenario prints one JSON object that the test asserts on. The state of the interfaces is read with
`ip -j -d link`, independently of the code under test. Never run this outside a fresh namespace: it
creates and deletes interfaces; it refuses to when the namespace has anything but `lo`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attrs  # noqa: E402

from vmlaunch.core.naming import default_bridge_name, tap_name  # noqa: E402
from vmlaunch.host.bridge_registry import REGISTRY_FILE  # noqa: E402
from vmlaunch.host.links import LinkError, Netlink, netlink  # noqa: E402
from vmlaunch.layout.dirs import run_root  # noqa: E402
from vmlaunch.layout.rundir import RunDir  # noqa: E402
from vmlaunch.resources.base import Context  # noqa: E402
from vmlaunch.resources.bridge import Bridge, BridgeRecord  # noqa: E402
from vmlaunch.resources.tap import Tap, TapRecord  # noqa: E402

CTX = Context(lab="t")
WARNINGS: list[str] = []  # what vmlaunch logged at WARNING, for the scenarios that expect it


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            WARNINGS.append(record.getMessage())


class netdev:  # noqa: N801 - the resources' apply and undo, by the names the scenarios use
    @staticmethod
    def ensure_bridge(bridge: Bridge) -> BridgeRecord:
        return bridge.apply(CTX)

    @staticmethod
    def create_tap(tap: Tap) -> TapRecord:
        return tap.apply(CTX)

    @staticmethod
    def remove_bridge(record: BridgeRecord) -> None:
        record.undo(CTX, rollback=False)

    @staticmethod
    def remove_tap(record: TapRecord) -> None:
        record.undo(CTX, rollback=False)

    @staticmethod
    def interface_exists(name: str) -> bool:
        with netlink(name) as nl:
            return nl.get(name) is not None


def as_json(record: BridgeRecord | TapRecord) -> dict[str, Any]:
    return {"kind": record.kind, **attrs.asdict(record)}

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def links() -> dict[str, dict[str, Any]]:
    """Every interface but lo: its index, kind, master, mtu, alias, VLAN id and the interface it is on
    (`link`), up flags and tun data."""
    out = subprocess.run(["ip", "-j", "-d", "link", "show"], check=True, capture_output=True,
                         text=True).stdout
    result = {}
    for link in json.loads(out):
        if link["ifname"] == "lo":
            continue
        info = link.get("linkinfo", {})
        vlan = info.get("info_data", {}).get("id") if info.get("info_kind") == "vlan" else None
        result[link["ifname"]] = {"index": link["ifindex"], "kind": info.get("info_kind"),
                                  "master": link.get("master"), "mtu": link["mtu"],
                                  "alias": link.get("ifalias"), "vlan": vlan, "link": link.get("link"),
                                  "up": "UP" in link["flags"],
                                  "lower_up": "LOWER_UP" in link["flags"],
                                  "tun": info.get("info_data", {}) if info.get("info_kind") == "tun" else {}}
    return result


def attempt(func: Callable[[], object]) -> dict[str, Any]:
    """Run one call; its LinkError as data (message, hint), anything else propagates."""
    try:
        func()
    except LinkError as exc:
        return {"error": exc.message, "hint": exc.hint, "code": exc.code, "interface": exc.interface}
    return {"error": None}


@contextmanager
def open_tap(name: str) -> Iterator[None]:
    """Hold a tap open like a running QEMU does."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
        yield
    finally:
        os.close(fd)


def lab_bridge(mtu: int | None = None, uplink: str | None = None, name: str = "vlbr-t") -> Bridge:
    return Bridge(name=name, network="lan", mtu=mtu, uplink=uplink)


def lab_tap(name: str, bridge: str = "vlbr-t", mtu: int | None = None,
            multi_queue: bool = False) -> Tap:
    return Tap(ifname=name, bridge=bridge, vm="alpha", mtu=mtu, multi_queue=multi_queue)


# --- scenarios ---------------------------------------------------------------------------------------


def basic(_: str) -> dict[str, Any]:
    """A bridge with mtu 9000 and two taps, then removed: nothing left."""
    bridge = netdev.ensure_bridge(lab_bridge(mtu=9000))
    taps = [netdev.create_tap(lab_tap(name, mtu=9000)) for name in ("vltap-a", "vltap-b")]
    up = links()
    exists = [netdev.interface_exists(name) for name in ("vlbr-t", "vltap-a", "nope")]
    for tap in taps:
        netdev.remove_tap(tap)
    netdev.remove_bridge(bridge)
    return {"bridge": as_json(bridge), "taps": [as_json(t) for t in taps], "up": up, "exists": exists,
            "down": links()}


def existing(_: str) -> dict[str, Any]:
    """A bridge that was there before is used, and kept on remove."""
    ip("link", "add", "vlbr-t", "type", "bridge")
    bridge = netdev.ensure_bridge(lab_bridge())
    tap = netdev.create_tap(lab_tap("vltap-a"))
    up = links()
    netdev.remove_tap(tap)
    netdev.remove_bridge(bridge)
    return {"bridge": as_json(bridge), "up": up, "down": links()}


def foreign(_: str) -> dict[str, Any]:
    """A bridge we created that another lab's tap still uses is left; deleted once it is free."""
    bridge = netdev.ensure_bridge(lab_bridge())
    mine = netdev.create_tap(lab_tap("vltap-a"))
    ip("tuntap", "add", "dev", "other-tap", "mode", "tap")
    ip("link", "set", "other-tap", "master", "vlbr-t")
    netdev.remove_tap(mine)
    netdev.remove_bridge(bridge)
    still = links()
    ip("link", "del", "other-tap")
    netdev.remove_bridge(bridge)
    return {"bridge": as_json(bridge), "still": still, "down": links()}


def uplink(_: str) -> dict[str, Any]:
    """An uplink (a veth end) is enslaved and brought up, then released (not deleted)."""
    ip("link", "add", "vl-up0", "type", "veth", "peer", "name", "vl-up1")
    bridge = netdev.ensure_bridge(lab_bridge(mtu=1500, uplink="vl-up0"))
    up = links()
    netdev.remove_bridge(bridge)
    down = links()
    # already a port of an existing bridge: used, not recorded, so not released
    ip("link", "add", "vlbr-pre", "type", "bridge")
    ip("link", "set", "vl-up1", "master", "vlbr-pre")
    pre = netdev.ensure_bridge(lab_bridge(name="vlbr-pre", uplink="vl-up1"))
    netdev.remove_bridge(pre)
    kept = links()
    # a port of another bridge, a missing one, the bridge itself: errors, and no bridge is left behind
    errors = {
        "other-master": attempt(lambda: netdev.ensure_bridge(lab_bridge(uplink="vl-up1"))),
        "missing": attempt(lambda: netdev.ensure_bridge(lab_bridge(uplink="vl-nope"))),
        "itself": attempt(lambda: netdev.ensure_bridge(lab_bridge(uplink="vlbr-t"))),
    }
    return {"bridge": as_json(bridge), "pre": as_json(pre), "up": up, "down": down, "kept": kept,
            "errors": errors, "after_errors": links()}


def not_bridge(_: str) -> dict[str, Any]:
    """Interfaces of the wrong kind are errors and are left untouched."""
    ip("link", "add", "vlbr-t", "type", "veth", "peer", "name", "vl-peer")
    before = links()
    errors = {
        "bridge": attempt(lambda: netdev.ensure_bridge(lab_bridge())),
        "tap-on-non-bridge": attempt(lambda: netdev.create_tap(lab_tap("vltap-a"))),
        "tap-on-missing": attempt(lambda: netdev.create_tap(lab_tap("vltap-a", bridge="vlbr-nope"))),
        "long-name": attempt(lambda: netdev.ensure_bridge(lab_bridge(name="x" * 16))),
    }
    netdev.ensure_bridge(lab_bridge(name="vlbr-ok"))
    errors["tap-is-veth"] = attempt(lambda: netdev.create_tap(lab_tap("vl-peer", bridge="vlbr-ok")))
    # remove never deletes what is not of the recorded kind
    netdev.remove_bridge(BridgeRecord(name="vlbr-t", created=True))
    netdev.remove_tap(TapRecord(name="vl-peer", bridge="vlbr-ok"))
    return {"before": before, "errors": errors, "after": links()}


def stale(_: str) -> dict[str, Any]:
    """A tap of the lab's left by a killed run (other flags, no master) is replaced; one held open is
    not."""
    netdev.ensure_bridge(lab_bridge())
    ip("tuntap", "add", "dev", "vltap-a", "mode", "tap", "multi_queue")
    ip("link", "set", "vltap-a", "alias", "vmlaunch lab=t vm=alpha bridge=vlbr-t")  # a killed up's
    old = links()["vltap-a"]
    tap = netdev.create_tap(lab_tap("vltap-a", mtu=1400))
    new = links()["vltap-a"]
    with open_tap("vltap-a"):
        busy = attempt(lambda: netdev.create_tap(lab_tap("vltap-a")))
        during = links()["vltap-a"]
    return {"tap": as_json(tap), "old": old, "new": new, "busy": busy, "during": during}


def twice(_: str) -> dict[str, Any]:
    """Removing twice, or removing what was never there, does nothing."""
    bridge = netdev.ensure_bridge(lab_bridge(uplink=None))
    tap = netdev.create_tap(lab_tap("vltap-a"))
    for _round in range(2):
        netdev.remove_tap(tap)
        netdev.remove_bridge(bridge)
    netdev.remove_tap(TapRecord(name="vltap-x", bridge="vlbr-x"))
    netdev.remove_bridge(BridgeRecord(name="vlbr-x", created=True, uplink="vl-x"))
    return {"down": links()}


def step_up(_: str) -> dict[str, Any]:
    bridge = netdev.ensure_bridge(lab_bridge(mtu=9000, uplink="vl-up0"))
    taps = [netdev.create_tap(lab_tap(name, mtu=9000)) for name in ("vltap-a", "vltap-b")]
    return {"bridge": as_json(bridge), "taps": [as_json(t) for t in taps]}


def step_down(records: str) -> dict[str, Any]:
    data = json.loads(records)
    for tap in data["taps"]:
        netdev.remove_tap(TapRecord(name=tap["name"], bridge=tap["bridge"]))
    bridge = data["bridge"]
    netdev.remove_bridge(BridgeRecord(**{key: bridge[key] for key in ("name", "created", "uplink")}))
    return {}


def fresh_process(_: str) -> dict[str, Any]:
    """`up` and `down` in two processes (in this namespace), the records passed as JSON text."""
    ip("link", "add", "vl-up0", "type", "veth", "peer", "name", "vl-up1")

    def step(*args: str) -> str:
        return subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True,
                              text=True).stdout
    records = step("step_up")
    up = links()
    step("step_down", records)
    return {"records": json.loads(records), "up": up, "down": links()}


def no_cap(_: str) -> dict[str, Any]:
    """Run without CAP_NET_ADMIN (see the test): a clear error with a hint, no traceback."""
    return {"bridge": attempt(lambda: netdev.ensure_bridge(lab_bridge())),
            "exists": netdev.interface_exists("lo")}


def no_cap_tap(_: str) -> dict[str, Any]:
    return {"tap": attempt(lambda: netdev.create_tap(lab_tap("vltap-a", bridge="vlbr-pre")))}


def qemu_queues(qemu: str) -> dict[str, Any]:
    """QEMU opens our multi-queue tap with queues=2 and our single-queue tap as it is."""
    netdev.ensure_bridge(lab_bridge())
    netdev.create_tap(lab_tap("vltap-mq", multi_queue=True))
    netdev.create_tap(lab_tap("vltap-sq"))
    argv = [qemu, "-machine", "none", "-nodefaults", "-display", "none", "-S",
            "-netdev", "tap,id=n0,ifname=vltap-mq,script=no,downscript=no,vhost=off,queues=2",
            "-netdev", "tap,id=n1,ifname=vltap-sq,script=no,downscript=no,vhost=off"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        opened = links()
        while time.monotonic() < deadline and proc.poll() is None:
            if opened["vltap-mq"]["lower_up"] and opened["vltap-sq"]["lower_up"]:  # carrier: QEMU has them
                break
            time.sleep(0.1)
            opened = links()
        running = proc.poll() is None
    finally:
        proc.kill()
        _, stderr = proc.communicate()
    return {"running": running, "opened": opened, "stderr": stderr}


# --- labs that share a host --------------------------------------------------------------------------


def journal_of(lab: str) -> None:
    """Make `lab` look up (a journal in its run dir): its claims on bridges are live."""
    run_dir = RunDir.of(run_root(), lab)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    run_dir.state.write_text("{}")


def gone(lab: str) -> None:
    """`lab` went down: its run dir is removed, as `down` does."""
    run_dir = RunDir.of(run_root(), lab)
    run_dir.state.unlink()
    run_dir.path.rmdir()


def registry() -> dict[str, Any]:
    path = run_root() / REGISTRY_FILE
    if not path.exists():
        return {}
    bridges: dict[str, Any] = json.loads(path.read_text())["bridges"]
    return bridges


def shared(order: str) -> dict[str, Any]:
    """Labs a and b share bridge vlbr-s, each with a tap on it; they go down in `order` ("ab", "ba")."""
    records = {}
    for lab in "ab":
        journal_of(lab)
        ctx = Context(lab=lab)
        bridge = Bridge(name="vlbr-s", network="lan").apply(ctx)
        tap = Tap(ifname=f"vltap-{lab}", bridge="vlbr-s", vm="vm").apply(ctx)
        records[lab] = (bridge, tap)
    up, up_registry = links(), registry()
    steps = []
    for lab in order:
        bridge, tap = records[lab]
        tap.undo(Context(lab=lab), rollback=False)
        bridge.undo(Context(lab=lab), rollback=False)
        gone(lab)
        steps.append({"links": links(), "registry": registry()})
    return {"records": {lab: as_json(b) for lab, (b, _) in records.items()}, "up": up,
            "up_registry": up_registry, "steps": steps}


def shared_stale(_: str) -> dict[str, Any]:
    """Lab a's claim is stale (its run dir was removed without a down): b, the last live user,
    removes the bridge vmlaunch created; a bridge that existed before is kept however labs leave."""
    journal_of("a")
    Bridge(name="vlbr-s", network="lan").apply(Context(lab="a"))
    journal_of("b")
    record = Bridge(name="vlbr-s", network="lan").apply(Context(lab="b"))
    gone("a")  # no down: its claim stays in the registry
    before = registry()
    record.undo(Context(lab="b"), rollback=False)
    after_stale = {"links": links(), "registry": registry()}
    ip("link", "add", "vlbr-pre", "type", "bridge")
    pre = {lab: Bridge(name="vlbr-pre", network="lan").apply(Context(lab=lab)) for lab in "ab"}
    for lab in "ab":
        pre[lab].undo(Context(lab=lab), rollback=False)
    return {"before": before, "after_stale": after_stale, "pre": {k: as_json(v) for k, v in pre.items()},
            "after_pre": {"links": links(), "registry": registry()}}


def killed_step(mode: str) -> dict[str, Any]:
    """Lab k's up, killed (SIGKILL: no rollback) after creating its bridge: before marking it
    (`create`), or after apply returned, before the executor journaled the record (`apply`)."""
    bridge = Bridge(name=default_bridge_name("k", "lan"), network="lan")
    if mode == "create":
        add = Netlink.add

        def add_then_die(self: Netlink, name: str, doing: str, **kwargs: Any) -> bool:
            add(self, name, doing, **kwargs)
            os._exit(9)

        Netlink.add = add_then_die  # type: ignore[method-assign]
    bridge.apply(Context(lab="k"))
    os._exit(9)


def killed(_: str) -> dict[str, Any]:
    """After a killed up (`killed_step`), `down` of lab k removes the bridge; or the next up finishes
    it (the record says created) and its down removes it. One result per way."""
    from vmlaunch.runtime import executor

    name = default_bridge_name("k", "lan")
    results: dict[str, Any] = {}
    for mode in ("create-down", "apply-down", "create-up", "apply-up"):
        step = subprocess.run([sys.executable, __file__, "killed_step", mode.split("-")[0]],
                              capture_output=True, text=True, check=False)
        after_kill = {"rc": step.returncode, "links": links(), "registry": registry()}
        result: dict[str, Any] = {"name": name, "after_kill": after_kill}
        if mode.endswith("-down"):
            result["down"] = executor.down(RunDir.of(run_root(), "k"))
        else:
            record = Bridge(name=name, network="lan").apply(Context(lab="k"))
            result["record"] = as_json(record)
            result["up"] = {"links": links(), "registry": registry()}
            record.undo(Context(lab="k"), rollback=False)
        result["after"] = {"links": links(), "registry": registry()}
        results[mode] = result
    return results


def leaked_tap(_: str) -> dict[str, Any]:
    """The lab's own tap leaked in its bridge (its record lost): removing the bridge removes it
    first. Another lab's tap keeps the bridge (and is untouched) until it is gone."""
    bridge = netdev.ensure_bridge(lab_bridge())
    netdev.create_tap(lab_tap("vltap-a"))  # its record is lost
    up = links()
    netdev.remove_bridge(bridge)
    own = links()
    bridge = netdev.ensure_bridge(lab_bridge())
    Tap(ifname="vltap-o", bridge="vlbr-t", vm="vm").apply(Context(lab="other"))
    netdev.remove_bridge(bridge)
    other = {"links": links(), "registry": registry(), "warnings": list(WARNINGS)}
    ip("link", "del", "vltap-o")
    netdev.remove_bridge(bridge)
    return {"up": up, "own": own, "other": other, "down": links()}


def marks(_: str) -> dict[str, Any]:
    """Taps of another lab, or not vmlaunch's, are never replaced or deleted; a default bridge name
    taken by another lab's bridge or an unmarked one is refused."""
    netdev.ensure_bridge(lab_bridge())
    name = tap_name("t", "alpha", 0)
    Tap(ifname=name, bridge="vlbr-t", vm="web").apply(Context(lab="other"))
    ip("tuntap", "add", "dev", "vltap-u", "mode", "tap")
    before = links()
    result: dict[str, Any] = {
        "up_other": attempt(lambda: netdev.create_tap(lab_tap(name))),
        "up_unmarked": attempt(lambda: netdev.create_tap(lab_tap("vltap-u"))),
    }
    netdev.remove_tap(TapRecord(name=name, bridge="vlbr-t"))
    netdev.remove_tap(TapRecord(name="vltap-u", bridge="vlbr-t"))
    result["warnings"] = list(WARNINGS)
    mine = default_bridge_name("t", "lan")
    ip("link", "add", mine, "type", "bridge")
    result["bridge_unmarked"] = attempt(lambda: netdev.ensure_bridge(Bridge(name=mine, network="lan")))
    ip("link", "set", mine, "alias", "vmlaunch lab=other net=lan")
    result["bridge_other"] = attempt(lambda: netdev.ensure_bridge(Bridge(name=mine, network="lan")))
    ip("link", "set", mine, "alias", "vmlaunch lab=t net=lan")
    result["bridge_own"] = as_json(netdev.ensure_bridge(Bridge(name=mine, network="lan")))
    return {**result, "before": before, "after": links()}


# --- taps without a bridge, VLAN uplinks --------------------------------------------------------------


def tap_alone(_: str) -> dict[str, Any]:
    """A tap network's tap: made, marked, up, on no bridge; removed again."""
    record = Tap(ifname="vltap-a", bridge=None, vm="alpha", mtu=1400).apply(CTX)
    up = links()
    record.undo(CTX, rollback=False)
    return {"record": as_json(record), "up": up, "down": links()}


def trunk() -> None:
    """A veth pair standing in for a host's trunk port (trunk0) and the switch behind it (trunk1)."""
    ip("link", "add", "trunk0", "type", "veth", "peer", "name", "trunk1")
    ip("link", "set", "trunk0", "up")
    ip("link", "set", "trunk1", "up")


def vlan_missing(_: str) -> dict[str, Any]:
    """On a kernel without 802.1Q: a VLAN bridge fails plainly and leaves nothing, a bridge that
    existed included (kept as it was)."""
    trunk()
    before = links()
    made = attempt(lambda: Bridge(name="vlbr-t", network="lan", uplink="trunk0", vlan=42).apply(CTX))
    made_links, made_registry = links(), registry()
    ip("link", "add", "vlbr-pre", "type", "bridge")
    existing = attempt(lambda: Bridge(name="vlbr-pre", network="lan", uplink="trunk0", vlan=42).apply(CTX))
    return {"before": before, "made": made, "made_links": made_links, "made_registry": made_registry,
            "existing": existing, "existing_links": links(), "existing_registry": registry(),
            "exit_code": _exit_code(lambda: Bridge(name="vlbr-t", network="lan", uplink="trunk0",
                                                   vlan=42).apply(CTX))}


def _exit_code(func: Callable[[], object]) -> int | None:
    try:
        func()
    except LinkError as exc:
        return exc.exit_code
    return None


def vlan(_: str) -> dict[str, Any]:
    """Where the kernel has 802.1Q: labs a and b share bridge vlbr-s on VLAN 42 of trunk0, which the
    first creates and the last deletes (trunk0 stays); an administrator's VLAN link is used and kept; a
    VLAN link of that name that is something else is refused; one vmlaunch left behind is adopted."""
    trunk()
    result: dict[str, Any] = {}
    records = {}
    for lab in "ab":
        journal_of(lab)
        records[lab] = Bridge(name="vlbr-s", network="lan", uplink="trunk0", vlan=42).apply(Context(lab=lab))
    result["shared"] = {"records": {lab: as_json(r) for lab, r in records.items()}, "links": links(),
                        "registry": registry()}
    steps = []
    for lab in "ab":
        records[lab].undo(Context(lab=lab), rollback=False)
        gone(lab)
        steps.append({"links": links(), "registry": registry()})
    result["steps"] = steps
    ip("link", "add", "link", "trunk0", "name", "trunk0.43", "type", "vlan", "id", "43")
    admins = Bridge(name="vlbr-t", network="lan", uplink="trunk0", vlan=43).apply(CTX)
    result["admins"] = {"record": as_json(admins), "links": links()}
    admins.undo(CTX, rollback=False)
    result["admins"]["after"] = links()
    ip("link", "add", "link", "trunk1", "name", "trunk0.44", "type", "vlan", "id", "44")
    result["wrong"] = attempt(lambda: Bridge(name="vlbr-t", network="lan", uplink="trunk0",
                                             vlan=44).apply(CTX))
    result["wrong_links"] = links()
    ip("link", "add", "link", "trunk0", "name", "trunk0.45", "type", "vlan", "id", "45")
    ip("link", "set", "trunk0.45", "alias", "vmlaunch lab=t net=lan vlan=45")
    left = Bridge(name="vlbr-t", network="lan", uplink="trunk0", vlan=45).apply(CTX)
    result["left"] = {"record": as_json(left), "registry": registry()}
    left.undo(CTX, rollback=False)
    result["left"]["after"] = links()
    return result


SCENARIOS: dict[str, Callable[[str], dict[str, Any]]] = {
    f.__name__: f for f in (basic, existing, foreign, uplink, not_bridge, stale, twice, step_up, step_down,
                            fresh_process, no_cap, no_cap_tap, qemu_queues, shared, shared_stale,
                            killed_step, killed, leaked_tap, marks, tap_alone, vlan_missing, vlan)
}


def main() -> None:
    name, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    if not os.environ.get("VMLAUNCH_RUN_DIR"):  # the bridge registry: never the host's own
        sys.exit("netns_links.py: set VMLAUNCH_RUN_DIR to a directory of the test's own")
    logging.getLogger("vmlaunch").addHandler(_Collect())
    if name not in ("step_up", "step_down", "killed_step") and set(links()) - {"vlbr-pre"}:
        sys.exit(f"netns_links.py: refusing to run {name}: not in a fresh network namespace")
    print(json.dumps(SCENARIOS[name](arg)))


if __name__ == "__main__":
    main()
