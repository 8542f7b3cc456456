"""What a multi-host lab makes on its libvirt hosts, each journaled as it is made and undone by its own
record: the lab's storage pool (with every volume in it), a libvirt network (the bridge of a lab
network on that host), a VXLAN link joining that bridge to the other hosts' (made over SSH), and a
domain. The engine that makes them is multihost/engine.py.

Each record names its host and the host's URI, so `down` undoes it from the journal alone, even with
a spec changed since. An undo that cannot reach its host raises: the record stays journaled, and
`down` says what is left on which host (exit 4). Pools, networks and domains are undone only when
the object of that name still has the UUID the record keeps: one made since by someone else is left.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from vmlaunch.errors import HostError, RuntimeFailure, VmlaunchError
from vmlaunch.host import remote
from vmlaunch.resources.base import Context
from vmlaunch.spec.hosts import parse_uri


def _undo_object(record: Any, lookup: str, what: str, undo: Callable[[Any, Any], None]) -> None:
    """Undo a pool, network or domain of the record's: looked up by name (`conn.<lookup>`), left alone
    when it is gone or has another UUID than the record's, else `undo(libvirt, object)`. A host that
    cannot be reached, or a call that fails, is a RuntimeFailure saying what is left where."""
    libvirt = remote.binding()
    try:
        conn = remote.connect(record.host, record.uri)
    except HostError as exc:
        raise RuntimeFailure(f"{record.describe()}: left there: {exc.message}") from None
    try:
        try:
            found = getattr(conn, lookup)(record.name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() in (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_ERR_NO_NETWORK,
                                        libvirt.VIR_ERR_NO_STORAGE_POOL):
                return
            raise
        if found.UUIDString() == record.uuid:
            undo(libvirt, found)
    except libvirt.libvirtError as exc:
        why = remote.failed(record.uri, conn, exc)
        raise RuntimeFailure(f"host {record.host}: {what} is left there: {why}") from None


def _pool(libvirt: Any, pool: Any) -> None:
    if not pool.isActive():
        try:
            pool.create(0)
        except libvirt.libvirtError:  # never built (an up killed right after defining it)
            pool.undefine()
            return
    pool.refresh(0)
    for volume in pool.listAllVolumes(0):
        volume.delete(0)
    pool.destroy()
    pool.delete(0)  # the folder
    pool.undefine()


def _network(libvirt: Any, net: Any) -> None:
    if net.isActive():
        net.destroy()
    net.undefine()


def _domain(libvirt: Any, dom: Any) -> None:
    if dom.isActive():
        dom.destroy()
    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM | libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                      | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)


@attrs.frozen
class _ObjectRecord:
    """A libvirt object of the lab's on a host (a pool, a network, a domain): undone by its name while
    it still has the record's UUID (`_undo_object`)."""

    lookup: ClassVar[str]  # the connection's call that finds it by name
    host: str
    uri: str
    name: str
    uuid: str

    def what(self) -> str:
        raise NotImplementedError

    def remove(self, libvirt: Any, found: Any) -> None:
        raise NotImplementedError

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        _undo_object(self, self.lookup, self.what(), self.remove)

    def describe(self) -> str:
        return f"host {self.host}: {self.what()}"


@attrs.frozen
class RemotePoolRecord(_ObjectRecord):
    """The lab's directory pool on a host, and every volume in it."""

    kind: ClassVar[str] = "remote-pool"
    lookup: ClassVar[str] = "storagePoolLookupByName"
    path: str

    def what(self) -> str:
        return f"storage pool {self.name} ({self.path}) and its volumes"

    def remove(self, libvirt: Any, found: Any) -> None:
        _pool(libvirt, found)


@attrs.frozen
class RemoteNetworkRecord(_ObjectRecord):
    """A lab network's bridge on a host, as a libvirt network (it makes and removes the bridge)."""

    kind: ClassVar[str] = "remote-network"
    lookup: ClassVar[str] = "networkLookupByName"
    bridge: str

    def what(self) -> str:
        return f"network {self.name} (bridge {self.bridge})"

    def remove(self, libvirt: Any, found: Any) -> None:
        _network(libvirt, found)


@attrs.frozen
class RemoteLinkRecord:
    """A VXLAN link joining a lab network's bridge on a host to the other hosts' (made over SSH)."""

    kind: ClassVar[str] = "remote-link"
    host: str
    uri: str
    name: str
    vni: int

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        name = shlex.quote(self.name)
        # only a VXLAN of this VNI: a link of this name someone made since is left
        script = (f"if ip -d link show dev {name} 2>/dev/null | grep -q 'vxlan id {self.vni} '; then "
                  f"ip link del dev {name}; fi\n")
        try:
            remote.shell(self.host, self.uri, script)
        except VmlaunchError as exc:
            raise RuntimeFailure(f"host {self.host}: VXLAN link {self.name} is left there: {exc}") from None

    def describe(self) -> str:
        return f"host {self.host}: VXLAN link {self.name} (VNI {self.vni})"


@attrs.frozen
class RemoteDomainRecord(_ObjectRecord):
    """A VM of the lab, a libvirt domain on its host, and the serial console log it writes there."""

    kind: ClassVar[str] = "remote-domain"
    lookup: ClassVar[str] = "lookupByName"
    vm: str
    log: str  # its serial console log on the host

    def what(self) -> str:
        return f"domain {self.name} (VM {self.vm})"

    def remove(self, libvirt: Any, found: Any) -> None:
        _domain(libvirt, found)

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        super().undo(ctx, rollback=rollback)
        if parse_uri(self.uri).shell:  # its log goes too, where vmlaunch can run commands
            with contextlib.suppress(VmlaunchError):
                remote.shell(self.host, self.uri, f"rm -f {shlex.quote(self.log)}\n")
