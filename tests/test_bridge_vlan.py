"""An uplink's 802.1Q VLAN as a bridge's port (vmlaunch/resources/bridge.py), without a kernel that has
802.1Q: the netlink requests themselves, byte for byte, and the bridge resource run against a fake
kernel that records them. tests/test_links.py runs the same against the real kernel, where it has 8021q,
in a network namespace.
"""

from __future__ import annotations

import errno
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vmlaunch.core.naming import vlan_link_name
from vmlaunch.errors import EXIT_HOST
from vmlaunch.host.bridge_registry import REGISTRY_FILE
from vmlaunch.host.links import Link, LinkError, Netlink, vlan_request
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources import bridge as bridge_module
from vmlaunch.resources.base import Context
from vmlaunch.resources.bridge import Bridge, BridgeRecord

# --- the requests, encoded ---------------------------------------------------------------------------

RTM_NEWLINK = 16
IFLA_IFNAME, IFLA_LINK, IFLA_LINKINFO = 3, 5, 18
IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 2
IFLA_VLAN_ID = 1
IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change


def encode(command: str, **kwargs: Any) -> bytes:
    """The RTM_NEWLINK message pyroute2 sends for `link(command, **kwargs)`, built as its IPRoute does
    (pyroute2.iproute.linux: RTNL_API.link, NetlinkRequest), without a socket."""
    from pyroute2.iproute.linux import get_arguments_processor
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    request = get_arguments_processor("link", command, dict(kwargs))
    msg = ifinfmsg()
    for field in msg.fields:
        msg[field[0]] = request.get_value(field[0], default=0, mode="field")
    for key, value in request.items():
        nla = type(msg).name2nla(key)
        if msg.valid_nla(nla) and value is not None:
            msg["attrs"].append([nla, value])
    msg["header"]["type"] = RTM_NEWLINK
    msg.encode()
    return bytes(msg.data)


def attributes(data: bytes) -> dict[int, bytes]:
    """The netlink attributes of `data` (type without the nested flag -> payload), read by hand."""
    found = {}
    while len(data) >= 4:
        length, kind = struct.unpack_from("=HH", data)
        found[kind & 0x3FFF] = data[4:length]
        data = data[(length + 3) & ~3:]
    return found


def test_the_vlan_request_byte_for_byte() -> None:
    """`ip link add link eth1 name eth1.42 type vlan id 42`, as the kernel receives it."""
    data = encode("add", ifname="eth1.42", **vlan_request(parent=7, vlan=42))
    length, kind = struct.unpack_from("=IH", data)
    assert (length, kind) == (len(data), RTM_NEWLINK)
    family, _, index, _, _ = IFINFOMSG.unpack_from(data, 16)
    assert (family, index) == (0, 0)
    attrs = attributes(data[16 + IFINFOMSG.size:])
    assert attrs[IFLA_IFNAME] == b"eth1.42\0"
    assert struct.unpack("=I", attrs[IFLA_LINK]) == (7,)  # the parent, by ifindex
    info = attributes(attrs[IFLA_LINKINFO])
    assert info[IFLA_INFO_KIND].rstrip(b"\0") == b"vlan"
    data_attrs = attributes(info[IFLA_INFO_DATA])
    assert struct.unpack("=H", data_attrs[IFLA_VLAN_ID]) == (42,)


def test_a_vlan_link_is_read_back_with_its_parent_and_id() -> None:
    from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

    msg = ifinfmsg(encode("add", ifname="eth1.42", index=9, flags=1, ifalias="vmlaunch lab=a net=lan vlan=42",
                          **vlan_request(parent=7, vlan=42)))
    msg.decode()
    link = Link.parse(msg)
    assert (link.name, link.kind, link.parent, link.vlan, link.up, link.lab) == ("eth1.42", "vlan", 7, 42,
                                                                                  True, "a")


def test_vlan_link_names() -> None:
    assert vlan_link_name("eth1", 42) == "eth1.42"
    assert vlan_link_name("enp0s31f6", 4094) == "enp0s31f6.4094"  # 14 bytes: fits
    long = vlan_link_name("enp0s31f6u2", 4000)  # 16 bytes would not
    assert long.startswith("vlq") and len(long) == 15 and long == vlan_link_name("enp0s31f6u2", 4000)
    assert long != vlan_link_name("enp0s31f6u2", 4001)


# --- the bridge resource against a fake kernel ------------------------------------------------------


class FakeKernel:
    """Interfaces by name, the IPRoute calls vmlaunch makes, and every change recorded."""

    def __init__(self, vlans: bool = True) -> None:
        self.vlans = vlans
        self.links: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._next = 2

    def make(self, name: str, kind: str | None, **data: Any) -> dict[str, Any]:
        self.links[name] = {"index": self._next, "ifname": name, "kind": kind, "flags": 0, **data}
        self._next += 1
        return self.links[name]

    def by_index(self, index: int) -> dict[str, Any]:
        return next(link for link in self.links.values() if link["index"] == index)

    # what Netlink calls

    def link(self, command: str, **kwargs: Any) -> list[Any]:
        from pyroute2.netlink.exceptions import NetlinkError

        if command == "get":
            if kwargs["ifname"] not in self.links:
                raise NetlinkError(errno.ENODEV, "No such device")
            return [FakeMsg(self.links[kwargs["ifname"]])]
        self.requests.append((command, kwargs))
        if command == "add":
            if kwargs["ifname"] in self.links:
                raise NetlinkError(errno.EEXIST, "File exists")
            if kwargs["kind"] == "vlan" and not self.vlans:
                raise NetlinkError(errno.EOPNOTSUPP, "Operation not supported")
            extra = {"link": kwargs["link"], "vlan_id": kwargs["vlan_id"]} if kwargs["kind"] == "vlan" else {}
            self.make(kwargs["ifname"], kwargs["kind"], **extra)
        elif command == "set":
            link = self.by_index(kwargs["index"])
            if "master" in kwargs:
                link["master"] = kwargs["master"] or None
            if "ifalias" in kwargs:
                link["ifalias"] = kwargs["ifalias"]
            if kwargs.get("state") == "up":
                link["flags"] |= 1
        elif command == "del":
            gone = self.by_index(kwargs["index"])
            del self.links[gone["ifname"]]
            for link in self.links.values():
                if link.get("master") == gone["index"]:
                    link["master"] = None
        return []

    def get_links(self) -> list[Any]:
        return [FakeMsg(link) for link in self.links.values()]

    def view(self) -> dict[str, dict[str, Any]]:
        """Each interface: kind, master's name, VLAN id and parent's name, mark."""
        names = {link["index"]: name for name, link in self.links.items()}
        return {name: {"kind": link["kind"], "master": names.get(link.get("master")),
                       "vlan": link.get("vlan_id"), "on": names.get(link.get("link")),
                       "alias": link.get("ifalias"), "up": bool(link["flags"] & 1)}
                for name, link in self.links.items()}


class FakeMsg(dict[str, Any]):
    """Answers `msg.get` as pyroute2's ifinfmsg does for the keys Link.parse reads."""

    def get(self, key: Any, default: Any = None) -> Any:
        if key == ("linkinfo", "kind"):
            return super().get("kind")
        if key == ("linkinfo", "data", "vlan_id"):
            return super().get("vlan_id")
        return super().get(key, default)


@pytest.fixture
def kernel(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKernel]:
    """A fake kernel with a trunk (eth1, up) for the bridge resource; labs a and b are up (journaled)."""
    import contextlib

    fake = FakeKernel()
    fake.make("eth1", None, flags=1)

    @contextlib.contextmanager
    def session(_: str) -> Iterator[Netlink]:
        yield Netlink(fake)

    monkeypatch.setattr(bridge_module, "netlink", session)
    for lab in "ab":
        RunDir.of(run_dir, lab).path.mkdir(parents=True)
        RunDir.of(run_dir, lab).state.write_text("{}")
    yield fake


def registry(run_dir: Path) -> dict[str, Any]:
    path = run_dir / REGISTRY_FILE
    return json.loads(path.read_text())["bridges"] if path.exists() else {}


def lan(vlan: int = 42, name: str = "br-lan") -> Bridge:
    return Bridge(name=name, network="lan", uplink="eth1", vlan=vlan)


A, B = Context(lab="a"), Context(lab="b")


def test_created_marked_enslaved_shared_and_deleted_by_the_last(kernel: FakeKernel, run_dir: Path) -> None:
    first = lan().apply(A)
    assert first == BridgeRecord("br-lan", created=True, uplink="eth1.42", uplink_created=True)
    view = kernel.view()
    assert view["eth1.42"] == {"kind": "vlan", "master": "br-lan", "vlan": 42, "on": "eth1",
                               "alias": "vmlaunch lab=a net=lan vlan=42", "up": True}
    assert view["eth1"]["master"] is None  # the trunk itself is never a port
    add = [kwargs for command, kwargs in kernel.requests if command == "add"]
    assert add[1] == {"ifname": "eth1.42", "kind": "vlan", "link": kernel.links["eth1"]["index"],
                      "vlan_id": 42}
    entry = registry(run_dir)["br-lan"]
    assert (entry["uplink"], entry["uplink_created"], entry["uplink_index"]) == (
        "eth1.42", True, kernel.links["eth1.42"]["index"])
    second = lan().apply(B)  # the same network in another lab: shared
    assert second == BridgeRecord("br-lan", created=True)
    first.undo(A, rollback=False)
    RunDir.of(run_dir, "a").state.unlink()
    assert set(kernel.view()) == {"eth1", "eth1.42", "br-lan"}  # b still uses them
    second.undo(B, rollback=False)
    assert set(kernel.view()) == {"eth1"} and registry(run_dir) == {}


def test_a_vlan_link_that_exists_is_used_and_kept(kernel: FakeKernel, run_dir: Path) -> None:
    kernel.make("eth1.42", "vlan", link=kernel.links["eth1"]["index"], vlan_id=42)  # an administrator's
    record = lan().apply(A)
    assert record == BridgeRecord("br-lan", created=True, uplink="eth1.42", uplink_created=False)
    assert registry(run_dir)["br-lan"]["uplink"] == "eth1.42"
    assert "uplink_created" not in registry(run_dir)["br-lan"]  # older vmlaunch versions read this file
    record.undo(A, rollback=False)
    assert kernel.view()["eth1.42"]["master"] is None and "br-lan" not in kernel.view()


def test_what_a_vlan_link_must_be(kernel: FakeKernel) -> None:
    kernel.make("eth2", None)
    kernel.make("eth1.42", "vlan", link=kernel.links["eth2"]["index"], vlan_id=42)
    kernel.make("eth1.43", None)
    kernel.make("br-other", "bridge")
    kernel.make("eth1.44", "vlan", link=kernel.links["eth1"]["index"], vlan_id=44,
                master=kernel.links["br-other"]["index"])
    errors = {}
    for vlan in (42, 43, 44):
        with pytest.raises(LinkError) as caught:
            lan(vlan).apply(A)
        errors[vlan] = caught.value.message
    assert errors == {42: "interface eth1.42: exists and is VLAN 42 of eth2, not VLAN 42 of eth1",
                      43: "interface eth1.43: exists and is a network device, not VLAN 43 of eth1",
                      44: "interface eth1.44: cannot be the uplink of bridge br-lan: it is already "
                          "enslaved to br-other"}
    with pytest.raises(LinkError, match="the uplink of bridge br-lan does not exist"):
        Bridge(name="br-lan", network="lan", uplink="eth9", vlan=42).apply(A)
    assert "br-lan" not in kernel.view()


def test_a_kernel_without_8021q_leaves_nothing(kernel: FakeKernel, run_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAUNCH_PROC", str(tmp_path / "proc"))  # no net/vlan: 8021q is not loaded
    kernel.vlans = False
    with pytest.raises(LinkError) as caught:
        lan().apply(A)
    assert caught.value.exit_code == EXIT_HOST and "modprobe 8021q" in str(caught.value.hint)
    assert set(kernel.view()) == {"eth1"} and registry(run_dir) == {}
    kernel.make("br-lan", "bridge")  # one that existed is kept, as it was
    with pytest.raises(LinkError):
        lan().apply(A)
    assert set(kernel.view()) == {"eth1", "br-lan"} and registry(run_dir) == {}


def test_a_failure_after_creating_it_deletes_it_again(kernel: FakeKernel, run_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real_set = Netlink.set

    def refuse_enslaving(self: Netlink, link: Link, doing: str, **kwargs: Any) -> None:
        if "enslaving" in doing:
            raise LinkError(link.name, f"{doing}: Device or resource busy (EBUSY)", code=errno.EBUSY)
        real_set(self, link, doing, **kwargs)

    monkeypatch.setattr(Netlink, "set", refuse_enslaving)
    with pytest.raises(LinkError, match="EBUSY"):
        lan().apply(A)
    assert set(kernel.view()) == {"eth1"} and registry(run_dir) == {}


def test_a_leftover_of_a_killed_up_is_adopted_and_removed(kernel: FakeKernel, run_dir: Path) -> None:
    kernel.make("eth1.42", "vlan", link=kernel.links["eth1"]["index"], vlan_id=42,
                ifalias="vmlaunch lab=a net=lan vlan=42")  # made, then vmlaunch was killed
    record = lan().apply(A)
    assert record.uplink_created is True
    record.undo(A, rollback=False)
    assert set(kernel.view()) == {"eth1"}


def test_a_registry_lost_still_removes_only_a_marked_vlan_link(kernel: FakeKernel, run_dir: Path) -> None:
    record = lan().apply(A)
    (run_dir / REGISTRY_FILE).unlink()
    kernel.links["eth1.42"]["ifalias"] = None  # not vmlaunch's mark any more: someone else's now
    record.undo(A, rollback=False)
    assert "eth1.42" in kernel.view() and kernel.view()["eth1.42"]["master"] is None


def test_one_uplink_per_bridge(kernel: FakeKernel, run_dir: Path) -> None:
    lan(42).apply(A)
    with pytest.raises(LinkError) as caught:
        lan(43).apply(B)
    assert caught.value.message == ("interface br-lan: its uplink is eth1.42, for lab a: it cannot also "
                                    "take eth1.43 (network lan)")
    with pytest.raises(LinkError, match="eth1.42: cannot be the uplink of bridge br-two: it is the uplink "
                                        "of bridge br-lan, which lab a uses"):
        lan(42, name="br-two").apply(B)
    assert "eth1.43" not in kernel.view() and "br-two" not in kernel.view()


def test_an_uplink_that_refuses_vlans(kernel: FakeKernel, run_dir: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """8021q is loaded (/proc/net/vlan), yet the kernel says EOPNOTSUPP: the uplink cannot carry VLANs."""
    (tmp_path / "proc" / "net" / "vlan").mkdir(parents=True)
    monkeypatch.setenv("VMLAUNCH_PROC", str(tmp_path / "proc"))
    kernel.vlans = False
    with pytest.raises(LinkError) as caught:
        lan().apply(A)
    assert caught.value.message == "interface eth1: cannot carry VLAN 42: the kernel refuses VLANs on it " \
        "(a network device)"
    assert caught.value.exit_code == 4
    assert set(kernel.view()) == {"eth1"} and registry(run_dir) == {}


def test_on_a_bridge_vmlaunch_does_not_own(kernel: FakeKernel, run_dir: Path) -> None:
    """An administrator's bridge: the VLAN link vmlaunch made goes with the last lab, the bridge stays."""
    kernel.make("br-lan", "bridge", flags=1)
    record = lan().apply(A)
    assert record == BridgeRecord("br-lan", created=False, uplink="eth1.42", uplink_created=True)
    assert kernel.view()["eth1.42"]["master"] == "br-lan"
    record.undo(A, rollback=False)
    assert set(kernel.view()) == {"eth1", "br-lan"} and registry(run_dir) == {}
