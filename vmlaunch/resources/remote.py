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
from typing import Any, ClassVar

import attrs

from vmlaunch.errors import HostError, RuntimeFailure, VmlaunchError
from vmlaunch.host import remote
from vmlaunch.resources.base import Context
from vmlaunch.spec.hosts import parse_uri


def _conn(record: Any) -> Any:
    """The record's host, or a RuntimeFailure saying what is left where."""
    try:
        return remote.connect(record.host, record.uri)
    except HostError as exc:
        raise RuntimeFailure(f"{record.describe()}: left there: {exc.message}") from None


def _gone(exc: Exception) -> bool:
    libvirt = remote.binding()
    code = exc.get_error_code() if isinstance(exc, libvirt.libvirtError) else None
    return code in (
        libvirt.VIR_ERR_NO_DOMAIN,
        libvirt.VIR_ERR_NO_NETWORK,
        libvirt.VIR_ERR_NO_STORAGE_POOL,
        libvirt.VIR_ERR_NO_STORAGE_VOL,
    )


def _left(host: str, what: str, exc: Exception) -> RuntimeFailure:
    return RuntimeFailure(f"host {host}: {what} is left there: {remote.libvirt_error(exc)}")


@attrs.frozen
class RemotePoolRecord:
    """The lab's directory pool on a host, and every volume in it."""

    kind: ClassVar[str] = "remote-pool"
    host: str
    uri: str
    name: str
    uuid: str
    path: str

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        libvirt = remote.binding()
        try:
            conn = _conn(self)
            try:
                pool = conn.storagePoolLookupByName(self.name)
            except libvirt.libvirtError as exc:
                if _gone(exc):
                    return
                raise
            if pool.UUIDString() != self.uuid:
                return  # not the pool this lab made
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
        except libvirt.libvirtError as exc:
            if _dead(exc):
                remote.forget(self.uri, remote.libvirt_error(exc))
            raise _left(self.host, f"storage pool {self.name} ({self.path})", exc) from None

    def describe(self) -> str:
        return f"host {self.host}: storage pool {self.name} ({self.path}) and its volumes"


def _dead(exc: Exception) -> bool:
    """The connection itself failed (its libvirtd died), not the call."""
    libvirt = remote.binding()
    code = exc.get_error_code() if isinstance(exc, libvirt.libvirtError) else None
    return (
        code
        in (
            libvirt.VIR_ERR_SYSTEM_ERROR,
            libvirt.VIR_ERR_RPC,
            libvirt.VIR_ERR_NO_CONNECT,
            libvirt.VIR_ERR_INTERNAL_ERROR,
        )
        and "connection" in remote.libvirt_error(exc).lower()
        or "end of file" in remote.libvirt_error(exc).lower()
    )


@attrs.frozen
class RemoteNetworkRecord:
    """A lab network's bridge on a host, as a libvirt network (it makes and removes the bridge)."""

    kind: ClassVar[str] = "remote-network"
    host: str
    uri: str
    name: str
    uuid: str
    bridge: str

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        libvirt = remote.binding()
        try:
            conn = _conn(self)
            try:
                net = conn.networkLookupByName(self.name)
            except libvirt.libvirtError as exc:
                if _gone(exc):
                    return
                raise
            if net.UUIDString() != self.uuid:
                return
            if net.isActive():
                net.destroy()
            net.undefine()
        except libvirt.libvirtError as exc:
            if _dead(exc):
                remote.forget(self.uri, remote.libvirt_error(exc))
            raise _left(self.host, f"network {self.name} (bridge {self.bridge})", exc) from None

    def describe(self) -> str:
        return f"host {self.host}: network {self.name} (bridge {self.bridge})"


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
        script = (
            f"if ip -d link show dev {name} 2>/dev/null | grep -q 'vxlan id {self.vni} '; then "
            f"ip link del dev {name}; fi\n"
        )
        try:
            remote.shell(self.host, self.uri, script)
        except Exception as exc:
            raise RuntimeFailure(f"host {self.host}: VXLAN link {self.name} is left there: {exc}") from None

    def describe(self) -> str:
        return f"host {self.host}: VXLAN link {self.name} (VNI {self.vni})"


@attrs.frozen
class RemoteDomainRecord:
    """A VM of the lab, a libvirt domain on its host."""

    kind: ClassVar[str] = "remote-domain"
    host: str
    uri: str
    name: str  # the domain's: LAB-VM
    uuid: str
    vm: str

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        libvirt = remote.binding()
        try:
            conn = _conn(self)
            try:
                dom = conn.lookupByName(self.name)
            except libvirt.libvirtError as exc:
                if _gone(exc):
                    return
                raise
            if dom.UUIDString() != self.uuid:
                return
            if dom.isActive():
                dom.destroy()
            dom.undefineFlags(
                libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
                | libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
            )
        except libvirt.libvirtError as exc:
            if _dead(exc):
                remote.forget(self.uri, remote.libvirt_error(exc))
            raise _left(self.host, f"domain {self.name}", exc) from None

    def _remove_log(self) -> None:
        """The serial console log the domain wrote on its host (where vmlaunch can run commands)."""
        if not parse_uri(self.uri).shell:
            return
        log = shlex.quote(f"/var/log/libvirt/qemu/{self.name}-serial.log")
        with contextlib.suppress(VmlaunchError):
            remote.shell(self.host, self.uri, f"rm -f {log}\n")

    def describe(self) -> str:
        return f"host {self.host}: domain {self.name} (VM {self.vm})"
