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

from vmlaunch.hostlinks import LinkError, netlink  # noqa: E402
from vmlaunch.resources.base import Context  # noqa: E402
from vmlaunch.resources.bridge import Bridge, BridgeRecord  # noqa: E402
from vmlaunch.resources.tap import Tap, TapRecord  # noqa: E402

CTX = Context(lab="t")


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
    """Every interface but lo: its index, kind, master, mtu, up flag and tun data."""
    out = subprocess.run(["ip", "-j", "-d", "link", "show"], check=True, capture_output=True,
                         text=True).stdout
    result = {}
    for link in json.loads(out):
        if link["ifname"] == "lo":
            continue
        info = link.get("linkinfo", {})
        result[link["ifname"]] = {"index": link["ifindex"], "kind": info.get("info_kind"),
                                  "master": link.get("master"), "mtu": link["mtu"],
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
    """A tap left by a killed run (other flags, no master) is replaced; one held open is not."""
    netdev.ensure_bridge(lab_bridge())
    ip("tuntap", "add", "dev", "vltap-a", "mode", "tap", "multi_queue")
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


SCENARIOS: dict[str, Callable[[str], dict[str, Any]]] = {
    f.__name__: f for f in (basic, existing, foreign, uplink, not_bridge, stale, twice, step_up, step_down,
                            fresh_process, no_cap, no_cap_tap, qemu_queues)
}


def main() -> None:
    name, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    if name not in ("step_up", "step_down") and set(links()) - {"vlbr-pre"}:
        sys.exit(f"netns_links.py: refusing to run {name}: not in a fresh network namespace")
    print(json.dumps(SCENARIOS[name](arg)))


if __name__ == "__main__":
    main()
