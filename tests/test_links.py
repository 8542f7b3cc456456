"""The bridge and tap resources (vmlaunch/resources/bridge.py, tap.py) over netlink (host/links.py).

Every netlink operation runs in a private network namespace (`unshare -n`): tests/netns_links.py runs
one scenario there and prints what it saw as JSON. The host's interfaces are never touched.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from vmlaunch.errors import EXIT_HOST, EXIT_RUNTIME
from vmlaunch.host.links import LinkError

SCRIPT = Path(__file__).resolve().parent / "netns_links.py"
# as root a network namespace is enough; otherwise a user namespace gives CAP_NET_ADMIN inside it
NETNS = ["unshare", "-n", "--"] if os.geteuid() == 0 else ["unshare", "-rn", "--"]
NO_NET_ADMIN = ["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin", "--"]


@pytest.fixture(scope="module", autouse=True)
def _netns_usable() -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare (util-linux) and ip (iproute2)")
    probe = subprocess.run([*NETNS, "ip", "link", "show"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no private network namespace here: {probe.stderr.strip()}")


def in_netns(scenario: str, *args: str, wrap: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run one scenario of netns_links.py in a fresh network namespace (and a run root of its own, for
    the bridge registry); its JSON result."""
    with tempfile.TemporaryDirectory(prefix="vl-links-") as run_root:
        os.chmod(run_root, 0o755)  # a scenario may drop privileges
        env = {**os.environ, "VMLAUNCH_RUN_DIR": run_root}
        done = subprocess.run([*NETNS, *wrap, sys.executable, str(SCRIPT), scenario, *args],
                              capture_output=True, text=True, check=False, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# --- without a namespace -----------------------------------------------------------------------------


def test_import_does_not_load_pyroute2() -> None:
    code = ("import sys, vmlaunch.resources.registry, vmlaunch.compile.compiler; "
            "print(sorted(m for m in sys.modules if m.startswith('pyroute2')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_error_names_interface_and_permission_is_a_host_error() -> None:
    error = LinkError("vlbr-demo", "creating bridge: Operation not permitted (EPERM)", code=1)
    assert error.exit_code == EXIT_HOST  # "needs root" is exit 3 everywhere
    assert str(error).startswith("interface vlbr-demo: creating bridge")
    assert error.hint is not None and "CAP_NET_ADMIN" in error.hint
    assert LinkError("br0", "exists", code=17).hint is None
    assert LinkError("br0", "exists", code=17).exit_code == EXIT_RUNTIME


# --- in a private network namespace ------------------------------------------------------------------


def test_bridge_with_two_taps_then_nothing_left() -> None:
    result = in_netns("basic")
    assert result["bridge"] == {"kind": "bridge", "name": "vlbr-t", "created": True, "uplink": None,
                                "uplink_created": False}
    assert [t["name"] for t in result["taps"]] == ["vltap-a", "vltap-b"]
    up = result["up"]
    assert set(up) == {"vlbr-t", "vltap-a", "vltap-b"}
    assert up["vlbr-t"]["kind"] == "bridge" and up["vlbr-t"]["mtu"] == 9000 and up["vlbr-t"]["up"]
    for name in ("vltap-a", "vltap-b"):
        assert up[name]["kind"] == "tun" and up[name]["tun"]["type"] == "tap"
        assert up[name]["master"] == "vlbr-t" and up[name]["mtu"] == 9000 and up[name]["up"]
        assert up[name]["tun"]["multi_queue"] is False and up[name]["tun"]["pi"] is False
    assert result["exists"] == [True, True, False]
    assert result["down"] == {}


def test_existing_bridge_is_kept() -> None:
    result = in_netns("existing")
    assert result["bridge"]["created"] is False
    assert result["up"]["vltap-a"]["master"] == "vlbr-t"
    assert set(result["down"]) == {"vlbr-t"}
    assert result["down"]["vlbr-t"]["index"] == result["up"]["vlbr-t"]["index"]


def test_bridge_used_by_a_foreign_tap_is_not_deleted() -> None:
    result = in_netns("foreign")
    assert result["bridge"]["created"] is True
    assert set(result["still"]) == {"vlbr-t", "other-tap"}
    assert result["still"]["other-tap"]["master"] == "vlbr-t"
    assert result["down"] == {}  # deleted once nothing else used it


def test_uplink_enslaved_and_released() -> None:
    result = in_netns("uplink")
    assert result["bridge"] == {"kind": "bridge", "name": "vlbr-t", "created": True, "uplink": "vl-up0",
                                "uplink_created": False}
    assert result["up"]["vl-up0"]["master"] == "vlbr-t" and result["up"]["vl-up0"]["up"]
    assert result["down"]["vl-up0"]["master"] is None
    assert "vlbr-t" not in result["down"]
    # an uplink that already was a port of the (existing) bridge is not ours to release
    assert result["pre"] == {"kind": "bridge", "name": "vlbr-pre", "created": False, "uplink": None,
                             "uplink_created": False}
    assert result["kept"]["vl-up1"]["master"] == "vlbr-pre"
    errors = result["errors"]
    assert "already enslaved to vlbr-pre" in errors["other-master"]["error"]
    assert "nomaster" in errors["other-master"]["hint"]
    assert errors["missing"]["interface"] == "vl-nope" and "does not exist" in errors["missing"]["error"]
    assert "its own uplink" in errors["itself"]["error"]
    assert "vlbr-t" not in result["after_errors"]  # a failed ensure_bridge leaves no bridge behind


def test_wrong_kinds_are_errors_and_left_untouched() -> None:
    result = in_netns("not_bridge")
    errors = result["errors"]
    assert errors["bridge"]["error"] == "interface vlbr-t: exists and is a veth device, not a bridge"
    assert "network.lan.bridge" in errors["bridge"]["hint"]
    assert "not a bridge" in errors["tap-on-non-bridge"]["error"]
    assert errors["tap-on-missing"]["error"] == \
        "interface vlbr-nope: bridge of tap vltap-a (alpha) does not exist"
    assert "interface names have at most 15" in errors["long-name"]["error"]
    assert "exists and is a veth device" in errors["tap-is-veth"]["error"]
    after = result["after"]
    assert {k: v for k, v in after.items() if k != "vlbr-ok"} == result["before"]
    assert "vltap-a" not in after


def test_stale_tap_is_recreated_but_an_open_one_is_not() -> None:
    result = in_netns("stale")
    old, new = result["old"], result["new"]
    assert old["tun"]["multi_queue"] is True and old["master"] is None
    assert new["index"] != old["index"]
    assert new["tun"]["multi_queue"] is False and new["master"] == "vlbr-t" and new["mtu"] == 1400
    assert "a process has it open" in result["busy"]["error"]
    assert result["during"]["index"] == new["index"]  # not deleted under its user


def test_remove_twice_is_a_no_op() -> None:
    assert in_netns("twice") == {"down": {}}


def test_records_undone_from_a_fresh_process() -> None:
    result = in_netns("fresh_process")
    records = result["records"]
    assert records["bridge"] == {"kind": "bridge", "name": "vlbr-t", "created": True, "uplink": "vl-up0",
                                 "uplink_created": False}
    assert {name for name, link in result["up"].items() if link["master"] == "vlbr-t"} == {
        "vl-up0", "vltap-a", "vltap-b"}
    assert set(result["down"]) == {"vl-up0", "vl-up1"}
    assert result["down"]["vl-up0"]["master"] is None


def test_without_cap_net_admin_a_clear_error() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    result = in_netns("no_cap", wrap=tuple(NO_NET_ADMIN))
    assert result["bridge"]["error"] == "interface vlbr-t: creating bridge for network lan: " \
        "Operation not permitted (EPERM)"
    assert "CAP_NET_ADMIN" in result["bridge"]["hint"]
    assert result["exists"] is True  # reading needs no privilege
    wrap = ("sh", "-c", 'ip link add vlbr-pre type bridge && exec "$@"', "sh", *NO_NET_ADMIN)
    tap = in_netns("no_cap_tap", wrap=wrap)["tap"]
    assert tap["code"] == 1 and "CAP_NET_ADMIN" in tap["hint"]


@pytest.mark.qemu
@pytest.mark.fast
def test_qemu_opens_multi_queue_tap_with_two_queues(qemu_binary: str) -> None:
    result = in_netns("qemu_queues", qemu_binary)
    assert result["running"], result["stderr"]
    opened = result["opened"]
    assert opened["vltap-mq"]["lower_up"] and opened["vltap-mq"]["tun"]["numqueues"] == 2
    assert opened["vltap-sq"]["lower_up"] and opened["vltap-sq"]["tun"]["multi_queue"] is False


# --- labs that share a host (issue 7) ----------------------------------------------------------------


def test_marks_are_set_on_what_vmlaunch_creates() -> None:
    up = in_netns("basic")["up"]
    assert up["vlbr-t"]["alias"] == "vmlaunch lab=t net=lan"
    assert up["vltap-a"]["alias"] == "vmlaunch lab=t vm=alpha bridge=vlbr-t"


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_shared_bridge_goes_with_the_last_lab_in_either_order(order: str) -> None:
    result = in_netns("shared", order)
    # created by the first lab; for the registry it is vmlaunch's whichever lab goes first
    assert result["records"]["a"]["created"] is True and result["records"]["b"]["created"] is True
    assert result["up_registry"]["vlbr-s"]["labs"] == ["a", "b"]
    assert result["up_registry"]["vlbr-s"]["index"] == result["up"]["vlbr-s"]["index"]
    first, last = result["steps"]
    assert set(first["links"]) == {"vlbr-s", f"vltap-{order[1]}"}  # kept for the other lab
    assert first["registry"]["vlbr-s"]["labs"] == [order[1]]
    assert last == {"links": {}, "registry": {}}


def test_stale_claim_does_not_keep_a_bridge_and_a_foreign_bridge_is_never_removed() -> None:
    result = in_netns("shared_stale")
    assert result["before"]["vlbr-s"]["labs"] == ["a", "b"]
    assert result["after_stale"] == {"links": {}, "registry": {}}
    assert all(record["created"] is False for record in result["pre"].values())
    assert set(result["after_pre"]["links"]) == {"vlbr-pre"} and result["after_pre"]["registry"] == {}


def test_up_killed_between_creating_and_journaling_a_bridge() -> None:
    for mode, result in in_netns("killed").items():
        name, killed = result["name"], result["after_kill"]
        assert killed["rc"] == 9, mode
        assert set(killed["links"]) == {name}, mode  # the bridge is there, and so is the claim
        assert killed["registry"][name]["labs"] == ["k"] and killed["registry"][name]["created"], mode
        if mode.endswith("-up"):  # the next up finishes it: vmlaunch's, marked, its index recorded
            assert result["record"]["created"] is True
            assert result["up"]["links"][name]["alias"] == "vmlaunch lab=k net=lan"
            assert result["up"]["registry"][name]["index"] == result["up"]["links"][name]["index"]
        assert result["after"] == {"links": {}, "registry": {}}, mode


def test_own_leaked_tap_does_not_keep_the_bridge_another_labs_does() -> None:
    result = in_netns("leaked_tap")
    assert result["up"]["vltap-a"]["master"] == "vlbr-t"
    assert result["own"] == {}  # the lab's leaked tap, then the bridge
    other = result["other"]
    assert set(other["links"]) == {"vlbr-t", "vltap-o"}
    assert other["links"]["vltap-o"]["alias"] == "vmlaunch lab=other vm=vm bridge=vlbr-t"
    assert other["registry"]["vlbr-t"] == {"created": True, "index": other["links"]["vlbr-t"]["index"],
                                           "uplink": None, "labs": []}
    assert any("vltap-o (lab other's" in line for line in other["warnings"])
    assert result["down"] == {}  # released again once the other tap is gone


def test_interfaces_of_other_labs_or_not_vmlaunchs_are_refused_and_kept() -> None:
    result = in_netns("marks")
    assert "a tap of that name exists and is lab other's" in result["up_other"]["error"]
    assert "ip link del" in result["up_other"]["hint"]
    assert "exists and is not marked by vmlaunch" in result["up_unmarked"]["error"]
    taken = [name for name, link in result["before"].items() if link["kind"] == "tun"]
    assert len(taken) == 2
    for name in taken:  # neither up nor down touched them
        assert result["after"][name]["index"] == result["before"][name]["index"]
        assert any(line.startswith(f"tap {name} of lab t: not deleted") for line in result["warnings"])
    assert "is not marked by vmlaunch" in result["bridge_unmarked"]["error"]
    assert "network.lan.bridge" in result["bridge_unmarked"]["hint"]
    assert "is lab other's" in result["bridge_other"]["error"]
    assert result["bridge_own"]["created"] is True  # marked by this lab: a leftover of its own


# --- taps without a bridge, VLAN uplinks --------------------------------------------------------------


def test_a_tap_without_a_bridge() -> None:
    result = in_netns("tap_alone")
    assert result["record"] == {"kind": "tap", "name": "vltap-a", "bridge": None}
    tap = result["up"]["vltap-a"]
    assert tap["kind"] == "tun" and tap["master"] is None and tap["mtu"] == 1400 and tap["up"]
    assert tap["alias"] == "vmlaunch lab=t vm=alpha"
    assert result["down"] == {}


@functools.cache
def kernel_vlans() -> str | None:
    """None when this kernel makes 802.1Q VLAN links (in a namespace of their own), else what `ip` said."""
    probe = subprocess.run([*NETNS, "sh", "-c", "ip link add t0 type veth peer name t1 && "
                            "ip link add link t0 name t0.42 type vlan id 42"],
                           capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"status {probe.returncode}")


def test_without_8021q_a_vlan_bridge_fails_plainly_and_leaves_nothing() -> None:
    if kernel_vlans() is None:
        pytest.skip("this kernel has 802.1Q VLAN links: test_vlan_uplink_made_shared_and_removed runs "
                    "instead")
    result = in_netns("vlan_missing")
    made = result["made"]
    assert made["interface"] == "trunk0.42" and made["code"] == errno.EOPNOTSUPP
    assert made["error"] == ("interface trunk0.42: VLAN 42 of trunk0 cannot be created: this kernel lacks "
                             "802.1Q VLAN support (Unknown device type)")
    assert "modprobe 8021q" in made["hint"]
    assert result["exit_code"] == EXIT_HOST
    assert result["made_links"] == result["before"]  # no bridge, no VLAN link; the trunk as it was
    assert result["made_registry"] == {}
    assert result["existing"]["code"] == errno.EOPNOTSUPP
    assert set(result["existing_links"]) == {"trunk0", "trunk1", "vlbr-pre"}  # the bridge that was there
    assert result["existing_registry"] == {}


def test_vlan_uplink_made_shared_and_removed() -> None:
    reason = kernel_vlans()
    if reason is not None:
        pytest.skip(f"this kernel has no 802.1Q VLAN links (`ip link add ... type vlan`: {reason}): "
                    "test_without_8021q_a_vlan_bridge_fails_plainly_and_leaves_nothing runs instead, and "
                    "tests/test_bridge_vlan.py runs the VLAN uplink against a fake kernel")
    result = in_netns("vlan")
    shared = result["shared"]
    assert shared["records"]["a"] == {"kind": "bridge", "name": "vlbr-s", "created": True,
                                      "uplink": "trunk0.42", "uplink_created": True}
    assert shared["records"]["b"] == {"kind": "bridge", "name": "vlbr-s", "created": True, "uplink": None,
                                      "uplink_created": False}
    link = shared["links"]["trunk0.42"]
    assert (link["kind"], link["vlan"], link["link"], link["master"], link["up"]) == (
        "vlan", 42, "trunk0", "vlbr-s", True)
    assert link["alias"] == "vmlaunch lab=a net=lan vlan=42"
    entry = shared["registry"]["vlbr-s"]
    assert (entry["uplink"], entry["uplink_created"], entry["uplink_index"], entry["labs"]) == (
        "trunk0.42", True, link["index"], ["a", "b"])
    first, last = result["steps"]
    assert "trunk0.42" in first["links"] and "vlbr-s" in first["links"]  # b still uses them
    assert set(last["links"]) == {"trunk0", "trunk1"} and last["registry"] == {}  # the trunk stays
    admins = result["admins"]
    assert admins["record"]["uplink"] == "trunk0.43" and admins["record"]["uplink_created"] is False
    assert admins["links"]["trunk0.43"]["master"] == "vlbr-t"
    assert admins["after"]["trunk0.43"]["master"] is None  # released, kept
    assert result["wrong"]["error"] == ("interface trunk0.44: exists and is VLAN 44 of trunk1, not VLAN "
                                        "44 of trunk0")
    assert "trunk0.44" in result["wrong_links"] and "vlbr-t" not in result["wrong_links"]
    assert result["left"]["record"]["uplink_created"] is True  # vmlaunch's mark: a leftover of ours
    assert "trunk0.45" not in result["left"]["after"] and "trunk0.43" in result["left"]["after"]
