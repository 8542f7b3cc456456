"""Read a TOML lab spec into a `model.Lab`, or raise `SpecError` listing every problem found.

Three passes: TOML syntax, structure (the JSON schema in schemas/, the single source of structure),
then meaning (references, sizes, clashes), which only looks at the parts the schema accepted so that
one typo does not hide the other problems nor drown them in follow-on errors.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from vmlaunch import __version__
from vmlaunch.dirs import cache_dir
from vmlaunch.errors import KeyPath, Location, Problem, SpecError, format_key_path
from vmlaunch.model import (
    MACHINE_SATA_PORTS,
    Accel,
    Aio,
    Balloon,
    BridgeNetwork,
    CacheMode,
    Disk,
    DiskBus,
    DiskFormat,
    LabSpec,
    Network,
    Nic,
    NicModel,
    PciDevice,
    PciDriver,
    SocketNetwork,
    UserNetwork,
    VmSpec,
    default_of,
)
from vmlaunch.naming import (
    DEFAULT_MAC_PREFIX,
    default_bridge_name,
    derive_mac,
    derive_mcast,
    interface_name_problem,
    is_multicast_mac,
    normalise_pci_address,
)
from vmlaunch.sourcemap import SourceMap
from vmlaunch.units import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9/3.10 only
    import tomli as tomllib

SCHEMA_FILE = Path(__file__).resolve().parent / "vmlaunch.schema.json"

Doc = dict[str, Any]


class _Problems:
    """Collects problems for one spec file, resolving key paths to lines."""

    def __init__(self, file: Path, source: SourceMap) -> None:
        self.file = file
        self.source = source
        self.items: list[Problem] = []

    def add(self, path: KeyPath, message: str, hint: str | None = None) -> None:
        location = Location(self.file, self.source.line_of(path), path)
        self.items.append(Problem(location, message, hint))


def load_lab(path: str | Path) -> LabSpec:
    """Parse, check and build the lab of the spec at `path`."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise SpecError([Problem(Location(file, 1), f"cannot read the spec: {reason}")]) from None
    return parse_lab(data, file)


def parse_lab(data: bytes, file: Path) -> LabSpec:
    """Like `load_lab` for spec text already read; relative paths resolve against `file`'s folder."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError([Problem(Location(file, line), "the spec is not UTF-8 text")]) from None
    doc = _parse_toml(text, file)
    source = SourceMap.from_text(text)
    problems = _Problems(file, source)
    invalid = _check_structure(doc, data, problems)
    lab = _Builder(doc, file.resolve(), source, problems, invalid).build()
    if problems.items:
        raise SpecError(problems.items)
    return lab


def lab_name(path: str | Path) -> str:
    """The lab's name, for `down`: from the checked spec, or, when the spec no longer validates
    (edited since `up`), from its `[lab] name` alone, so a broken spec never strands a running lab."""
    try:
        return load_lab(path).name
    except SpecError as exc:
        try:
            name = tomllib.loads(Path(path).read_text()).get("lab", {}).get("name")
        except (OSError, ValueError):
            name = None
        if isinstance(name, str) and name and "/" not in name and not name.startswith("."):
            return name
        raise exc from None


def _parse_toml(text: str, file: Path) -> Doc:
    import re

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        line = getattr(exc, "lineno", None)
        found = re.search(r"\(at line (\d+), column (\d+)\)", message)
        if found:
            line = line or int(found.group(1))
            message = f"{message[: found.start()].strip()} (column {found.group(2)})"
        elif "end of document" in message:
            line = line or text.count("\n") + 1
        problem = Problem(Location(file, line or 1), f"TOML syntax error: {message}")
        raise SpecError([problem]) from None


# --- structure ------------------------------------------------------------------------------------


def _check_structure(doc: Doc, data: bytes, problems: _Problems) -> list[KeyPath]:
    """Validate against the JSON schema; return the key paths of the parts it rejected.

    A spec that validated clean before (same bytes, same schema, same vmlaunch) is remembered by
    hash, so the common case skips importing jsonschema (~70 ms, more than Python's own start-up).
    """
    schema_bytes = SCHEMA_FILE.read_bytes()
    digest = hashlib.sha256(b"\0".join([__version__.encode(), schema_bytes, data])).hexdigest()
    stamp = cache_dir() / "valid" / digest
    if stamp.exists():
        return []
    import json

    invalid = []
    for path, message, hint in _schema_errors(doc, json.loads(schema_bytes)):
        problems.add(path, message, hint)
        invalid.append(path)
    if not invalid:
        _touch(stamp)
    return invalid


def _touch(stamp: Path) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:
        pass  # a read-only cache only costs speed


def _schema_errors(doc: Doc, schema: Doc) -> Iterator[tuple[KeyPath, str, str | None]]:
    import jsonschema  # heavy: only when a spec is not known to be valid

    validator = jsonschema.Draft202012Validator(schema)
    for error in validator.iter_errors(doc):
        yield _describe(error)


def _describe(error: Any) -> tuple[KeyPath, str, str | None]:
    """Turn a jsonschema error into (key path, message, hint) a user can act on."""
    path: KeyPath = tuple(error.absolute_path)
    kind = error.validator
    value = error.instance
    schema = error.schema
    if "propertyNames" in error.absolute_schema_path:
        return (*path, value), f"the name {value!r} {_schema_message(error)}", None
    if kind == "required":
        missing = [key for key in error.validator_value if key not in value]
        return path, f"missing required key {', '.join(map(repr, missing))}", None
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = [key for key in value if key not in allowed]
        key = extra[0] if extra else "?"
        import difflib

        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(allowed)}"
        return (*path, key), f"unknown key {key!r}", hint
    if kind in ("enum", "const"):
        options = error.validator_value if kind == "enum" else [error.validator_value]
        return path, f"{value!r} is not one of {', '.join(map(str, options))}", None
    if kind == "type":
        return path, f"expected {_type_words(error.validator_value)}, got {_toml_type(value)}", None
    if kind == "minProperties":
        return path, _schema_message(error), None
    if kind == "minimum":
        return path, f"{value} is less than the minimum {error.validator_value}", None
    if kind == "maximum":
        return path, f"{value} is more than the maximum {error.validator_value}", None
    if kind == "minLength":
        return path, "must not be empty", None
    if kind == "uniqueItems":
        return path, "has duplicate entries", None
    if kind == "pattern":
        return path, f"{value!r} {_schema_message(error)}", None
    return path, str(error.message), None


def _schema_message(error: Any) -> str:
    message = error.schema.get("x-message")
    return str(message) if message else str(error.message)


def _type_words(types: str | list[str]) -> str:
    words = {
        "string": "a string",
        "integer": "an integer",
        "boolean": "true or false",
        "object": "a table",
        "array": "an array",
        "number": "a number",
    }
    names = [types] if isinstance(types, str) else types
    return " or ".join(words.get(name, name) for name in names)


_TOML_TYPES = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
               (dict, "a table"), (list, "an array"))  # bool first: it is an int to Python


def _toml_type(value: object) -> str:
    for kind, words in _TOML_TYPES:
        if isinstance(value, kind):
            return words
    return type(value).__name__  # dates and times


# --- meaning --------------------------------------------------------------------------------------


def _format_from_name(file: str) -> DiskFormat:
    return DiskFormat.QCOW2 if file.lower().endswith(".qcow2") else DiskFormat.RAW


class _Builder:
    """Builds the typed lab from a schema-checked document, adding semantic problems."""

    def __init__(
        self, doc: Doc, file: Path, source: SourceMap, problems: _Problems, invalid: list[KeyPath]
    ) -> None:
        self.doc = doc
        self.file = file
        self.base = file.parent
        self.source = source
        self.problems = problems
        self.invalid = invalid
        self.macs: dict[str, KeyPath] = {}
        self.writable_images: dict[Path, KeyPath] = {}
        self.pci_hosts: dict[str, KeyPath] = {}

    def is_valid(self, path: KeyPath) -> bool:
        """True when the schema found nothing wrong at or below `path`."""
        return not any(bad[: len(path)] == path for bad in self.invalid)

    def table(self, path: KeyPath) -> Doc:
        node: Any = self.doc
        for key in path:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        return node if isinstance(node, dict) else {}

    def build(self) -> LabSpec:
        lab = self.table(("lab",))
        lab_ok = self.is_valid(("lab",))
        name = str(lab.get("name", "lab")) if lab_ok else "lab"
        prefix = str(lab.get("mac_prefix", DEFAULT_MAC_PREFIX)) if lab_ok else DEFAULT_MAC_PREFIX
        if is_multicast_mac(prefix):
            self.problems.add(("lab", "mac_prefix"), f"{prefix!r} is a multicast prefix",
                              "the first octet must be even, e.g. 52:54:00")
        self.lab_name, self.mac_prefix = name, prefix
        networks = tuple(self.networks())
        known = {net.name for net in networks}
        self.forwarding: dict[str, KeyPath] = {
            net.name: () for net in networks if isinstance(net, UserNetwork) and net.forward}
        broken = {key for key in self.table(("network",)) if key not in known}
        vms = tuple(self.vms(known, broken))
        return LabSpec(name=name, file=self.file, source=self.source, networks=networks, vms=vms,
                   mac_prefix=prefix.lower())

    def networks(self) -> Iterator[Network]:
        bridges: dict[str, KeyPath] = {}
        for net_name, raw in self.table(("network",)).items():
            path: KeyPath = ("network", net_name)
            if not self.is_valid(path):
                continue
            if raw.get("type") == "user":
                yield UserNetwork(name=net_name, forward=tuple(raw.get("forward", ())))
                continue
            if raw.get("type") == "socket":
                group, port = raw.get("mcast", derive_mcast(self.lab_name, net_name)).split(":")
                if not 1 <= int(port) <= 65535 or any(int(o) > 255 for o in group.split(".")):
                    self.problems.add((*path, "mcast"), f"{raw['mcast']!r} is not a valid group:port")
                    continue
                yield SocketNetwork(name=net_name, group=group, port=int(port))
                continue
            bridge_path = (*path, "bridge") if "bridge" in raw else path
            bridge = raw.get("bridge") or default_bridge_name(self.lab_name, net_name)
            problem = interface_name_problem(bridge)
            if problem:
                hint = None if "bridge" in raw else 'name it with bridge = "..."'
                self.problems.add(bridge_path, f"bridge {problem}", hint)
            elif bridge in bridges:
                first = bridges[bridge][1]
                self.problems.add(bridge_path, f"bridge {bridge!r} is also network {first!r}'s",
                                  "two networks of one lab cannot share a bridge")
            bridges.setdefault(bridge, path)
            uplink = raw.get("uplink")
            if uplink is not None and interface_name_problem(uplink):
                self.problems.add((*path, "uplink"), f"uplink {interface_name_problem(uplink)}")
            yield BridgeNetwork(name=net_name, bridge=bridge, mtu=raw.get("mtu"), uplink=uplink)

    def vms(self, networks: set[str], broken: set[str]) -> Iterator[VmSpec]:
        for vm_name in self.table(("vm",)):
            path: KeyPath = ("vm", vm_name)
            vm = self.vm(path, vm_name, networks, broken)
            if vm is not None:
                yield vm

    def vm(self, path: KeyPath, name: str, networks: set[str], broken: set[str]) -> VmSpec | None:
        raw = self.table(path)
        disks = tuple(self.disks(path, raw.get("disk", [])))
        nics = tuple(self.nics(path, name, raw.get("nic", []), networks, broken))
        pci = tuple(self.pci(path, raw.get("pci", [])))
        if not self.is_valid(path):
            return None  # the schema already reported it; its parts were checked above
        memory = self.memory_mib((*path, "memory"), raw["memory"])
        kernel = self.path_of(raw.get("kernel"))
        for key in ("initrd", "append"):
            if key in raw and kernel is None:
                self.problems.add((*path, key), f"{key} needs kernel", "add kernel = \"...\"")
        if kernel is None and not raw.get("disk"):
            self.problems.add(path, "nothing to boot", "add kernel = \"...\" or a [[disk]]")
        if not self.sata_fits(path, raw, disks):
            return None
        given: dict[str, Any] = {key: raw[key] for key in ("cpus", "cpu_model", "machine", "append")
                                 if key in raw}
        if "accel" in raw:
            given["accel"] = Accel(raw["accel"])
        if "initrd" in raw:
            given["initrd"] = self.path_of(raw["initrd"])
        return VmSpec(name=name, memory_mib=memory or 1, kernel=kernel, disks=disks, nics=nics, pci=pci,
                      balloon=Balloon(**raw.get("balloon", {})), **given)

    def sata_fits(self, path: KeyPath, raw: Doc, disks: tuple[Disk, ...]) -> bool:
        """SATA disks need a machine with a built-in AHCI controller, one disk per port."""
        sata = sum(disk.bus is DiskBus.SATA for disk in disks)
        if not sata:
            return True
        machine = raw.get("machine", default_of(VmSpec, "machine"))
        ports = next((n for prefix, n in MACHINE_SATA_PORTS.items() if machine.startswith(prefix)), None)
        if ports is None:
            self.problems.add((*path, "machine"), "bus = \"sata\" disks need machine = \"q35\" "
                              "(its built-in AHCI controller)")
            return False
        if sata > ports:
            self.problems.add((*path, "disk"), f"at most {ports} sata disks (AHCI ports)")
            return False
        return True

    def path_of(self, value: str | None) -> Path | None:
        if value is None:
            return None
        # Absolute, so no spec value can look like an option ("-x", "help") or a protocol ("a:b").
        return self.base / os.path.expanduser(value)

    def memory_mib(self, path: KeyPath, value: str | int) -> int | None:
        try:
            size = parse_size(value, default_unit="M")
        except ValueError as exc:
            self.problems.add(path, str(exc))
            return None
        if size % (1 << 20):
            self.problems.add(path, f"{value!r} is not a whole number of MiB")
            return None
        if size < 16 << 20:
            self.problems.add(path, f"{value!r} is too little memory", "at least 16M")
            return None
        return size >> 20

    def disks(self, vm_path: KeyPath, items: Iterable[Doc]) -> Iterator[Disk]:
        for index, raw in enumerate(items):
            path = (*vm_path, "disk", index)
            if self.is_valid(path):
                disk = self.disk(path, raw)
                if disk is not None:
                    yield disk

    def disk(self, path: KeyPath, raw: Doc) -> Disk | None:
        ok = True
        size = None
        if "size" in raw:
            try:
                size = parse_size(raw["size"])
            except ValueError as exc:
                self.problems.add((*path, "size"), str(exc))
                ok = False
        cache = CacheMode(raw["cache"]) if "cache" in raw else default_of(Disk, "cache")
        if cache is CacheMode.UNSAFE and not raw.get("accept_data_loss", False):
            self.problems.add((*path, "cache"), "cache = \"unsafe\" ignores flushes: a host crash "
                              "corrupts the image", "add accept_data_loss = true if that is fine")
            ok = False
        aio = Aio(raw["aio"]) if "aio" in raw else None
        if aio is Aio.NATIVE and not cache.direct:
            self.problems.add((*path, "aio"), f"aio = \"native\" needs O_DIRECT, which cache = "
                              f"\"{cache.value}\" does not use", "use cache = \"none\" or "
                              "\"directsync\", or aio = \"io_uring\" or \"threads\"")
            ok = False
        file = self.path_of(raw["file"])
        assert file is not None
        readonly = bool(raw.get("readonly", default_of(Disk, "readonly")))
        if not readonly:
            key = Path(os.path.normpath(file))
            first = self.writable_images.get(key)
            if first is not None:
                self.problems.add((*path, "file"), f"{raw['file']!r} is already a writable disk "
                                  f"at {format_key_path(first)}", "two writers corrupt an image; use "
                                  "readonly = true or a qcow2 overlay per VM")
                ok = False
            self.writable_images.setdefault(key, path)
        if not ok:
            return None
        given: dict[str, Any] = {key: raw[key] for key in ("discard", "block_device", "accept_other_owner")
                                 if key in raw}
        if "bus" in raw:
            given["bus"] = DiskBus(raw["bus"])
        return Disk(
            file=file,
            format=DiskFormat(raw["format"]) if "format" in raw else _format_from_name(raw["file"]),
            size=size,
            cache=cache,
            aio=aio,
            readonly=readonly,
            **given,
        )

    def nics(
        self, vm_path: KeyPath, vm: str, items: Iterable[Doc], networks: set[str], broken: set[str]
    ) -> Iterator[Nic]:
        for index, raw in enumerate(items):
            path = (*vm_path, "nic", index)
            if not self.is_valid(path):
                continue
            network = raw["network"]
            if network not in networks:
                if network not in broken:
                    known = ", ".join(sorted(networks)) or "none defined"
                    self.problems.add((*path, "network"), f"no network named {network!r}",
                                      f"networks: {known}")
                continue
            forwarded = self.forwarding.get(network)
            if forwarded is not None:
                if forwarded:
                    self.problems.add((*path, "network"), f"network {network!r} forwards host ports "
                                      f"and is already used at {format_key_path(forwarded)}",
                                      "a forwarded host port reaches one NIC: give each VM its own "
                                      "user network")
                self.forwarding[network] = path
            mac = self.mac(path, raw.get("mac"), vm, index)
            nic = Nic(network=network, mac=mac or "", model=NicModel(raw["model"]) if "model" in raw
                      else default_of(Nic, "model"), **{k: raw[k] for k in ("queues",) if k in raw})
            if nic.queues > 1 and nic.model is not NicModel.VIRTIO:
                self.problems.add((*path, "queues"), "multi-queue needs model = \"virtio\"")
            if mac is not None:
                yield nic

    def mac(self, path: KeyPath, explicit: str | None, vm: str, index: int) -> str | None:
        if explicit is not None:
            mac = explicit.lower()
            if is_multicast_mac(mac):
                self.problems.add((*path, "mac"), f"{explicit!r} is a multicast address",
                                  "the first octet must be even")
                return None
        else:
            mac = derive_mac(self.mac_prefix, self.lab_name, vm, index)
        first = self.macs.get(mac)
        if first is not None:
            where = (*path, "mac") if explicit else path
            self.problems.add(where, f"MAC {mac} is also used at {format_key_path(first)}",
                              "every NIC in a lab needs its own MAC; set mac = \"...\"")
            return None
        self.macs[mac] = path
        return mac

    def pci(self, vm_path: KeyPath, items: Iterable[Doc]) -> Iterator[PciDevice]:
        for index, raw in enumerate(items):
            path = (*vm_path, "pci", index)
            if not self.is_valid(path):
                continue
            host = normalise_pci_address(raw["host"])
            first = self.pci_hosts.get(host)
            if first is not None:
                self.problems.add((*path, "host"), f"PCI device {host} is already passed "
                                  f"through at {format_key_path(first)}")
                continue
            self.pci_hosts[host] = path
            yield PciDevice(host=host, **({"driver": PciDriver(raw["driver"])} if "driver" in raw else {}))
