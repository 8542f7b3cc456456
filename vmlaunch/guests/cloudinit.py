"""A VM's NoCloud seed: what cloud-init in the guest reads from a volume labelled `cidata`.

Three documents, each a function of the lab and the VM (plus the keys, the instance-id and the
user's cloud-config file), with no other input:

- `user_data`: a `#cloud-config` document: the hostname, the lab's user (the lab's SSH key,
  passwordless sudo), the VM's SSH host key, packages, runcmd, the 9p shares mounted, and the user's
  own cloud-config file merged over it (`merge_config` has the rules).
- `meta_data`: the instance-id and the local hostname.
- `network_config`: network-config version 2 for the NICs vmlaunch knows how to configure.

They are written as JSON (after the `#cloud-config` line for user-data): YAML reads JSON, so
cloud-init (PyYAML's SafeLoader in 22.4, Debian 12) parses it, and emitting it needs no YAML library.
PyYAML is YAML 1.1, though, and not every JSON string reads back the same: characters outside the
Basic Multilingual Plane written as JSON's surrogate-pair escapes come back as two lone surrogates,
and raw NEL, U+2028/U+2029 (line breaks to YAML 1.1) or C1 controls are folded or refused. So
`dump` escapes every non-ASCII BMP character (`\\uXXXX`, which PyYAML decodes) and writes the others
as raw UTF-8 (which it reads as they are). And YAML takes a key written plainly (`"key": value`) only
up to 1024 characters: a longer key is written as YAML's explicit key (`? "key"` then `: value` on the
next line), the one place the output is YAML and not JSON. Tests check the round trip through PyYAML.

What cloud-init 22.4.2's source says about the choices below (read for this module):
- network-config v2: an `ethernets` entry without `set-name` takes the name of the interface with
  its `match: macaddress` (network_state.handle_ethernets, LP: #1855945), so nothing is renamed;
  the rendered networkd file matches that name *and* the MAC. By default that happens on an
  instance's first boot only, and the kernel's name follows the PCI slot: a spec edited between
  `down` and `up` (a share or disk removed) moves the NICs to other slots, and the files rendered
  for the old names match nothing (no address, no SSH; systemd-networkd-wait-online then holds the
  boot for two minutes). `updates: network: when: [boot]` (stages.apply_network_config: every
  datasource supports the BOOT event, NoCloud included) renders the config again at every boot,
  for the names and addresses of that boot: a spec's changed `ip` applies at the next `up` too.
  A route `to: default` is refused (not an IP network: ValueError) before 23.x; `to: 0.0.0.0/0`
  works in every version and renderer. `optional` reaches netplan only (the networkd and ENI
  renderers drop it); it is still given, for distros that render with netplan.
- mounts: cc_mounts keeps an entry only when its first field is a block device or holds a ':'
  (sanitize_devname), so a 9p tag like `share0` is dropped ("Ignoring nonexistent named mount").
  Shares are mounted by `bootcmd` instead: it runs at every boot in cloud-init's init stage, which
  systemd orders before sshd, so a VM that answers SSH has its shares mounted.

Checked on a Debian 12 guest (cloud-init 22.4.2, systemd-networkd) booted with such a seed: the JSON
user-data is read and passes the guest's `cloud-init schema`, the user logs in with the lab's key
against the pinned host key (the only one in /etc/ssh), static address, default route and DNS and
DHCP by MAC are rendered for the kernel's interface names, a reboot keeps the instance (runcmd does
not run again). Debian's *cloud* kernel (linux-image-cloud-amd64) has no 9p (CONFIG_NET_9P is not
set): there the mount fails with "unknown filesystem type '9p'", is reported, and the boot goes on;
shares need an image with a kernel that has 9p (linux-image-amd64 has it as modules).
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from vmlaunch.core.fsutil import read_bounded
from vmlaunch.errors import KeyPath, Location, Problem, RuntimeFailure, SpecError
from vmlaunch.guests.channel import install_command
from vmlaunch.layout.labdir import LabDir
from vmlaunch.spec.model import CloudInit, LabSpec, Share, UserNetwork, VmSpec, agent_on

if TYPE_CHECKING:
    import yaml

HEADER = "#cloud-config"
USER_DATA_LIMIT = 4 << 20  # a user's cloud-config file (write_files may carry a few files)
SEED_LABEL = "cidata"
_ISO_NAMES = {"user-data": "/USERDATA.;1", "meta-data": "/METADATA.;1", "network-config": "/NETWORKC.;1"}

# 9p over virtio as QEMU 7.2 serves it: the Linux protocol variant; msize under the 512 KiB a virtio
# transport takes before Linux 6.2 (a larger one is cut down, with a warning).
NINEP_OPTIONS = "trans=virtio,version=9p2000.L,msize=512000"
# bootcmd runs this for each share with TAG TARGET OPTIONS; a share that cannot be mounted (no 9p in
# the guest's kernel) is reported on the console and the boot goes on, like fstab's nofail.
_MOUNT_SCRIPT = ('mountpoint -q "$2" || { modprobe -q 9pnet_virtio; mkdir -p "$2" && '
                 'mount -t 9p -o "$3" "$1" "$2"; } || echo "vmlaunch: share $1 not mounted on $2" >&2')
SUDO_ALL = "ALL=(ALL) NOPASSWD:ALL"

_INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")

# --------------------------------------------------------------------------- user-data


def user_data(lab: LabSpec, vm: VmSpec, authorized_key: str | None, host_key: tuple[str, str] | None,
              *, agent: bool = True) -> str:
    """The VM's `#cloud-config`: `generated_config`, with the user's cloud-config file (if the spec
    names one) merged over it by `merge_config`. Without `authorized_key` the user gets no key; without
    `host_key` the guest makes its own (a VM exported to a cluster: `export/kubevirt.py`). Without
    `agent`, no agent for the command channel (an export: its engine gives the VM no such port)."""
    config = generated_config(vm, authorized_key, host_key, agent=agent)
    seed = _seed_of(vm)
    if seed.user_data is not None:
        theirs, locate = load_user_config(seed.user_data, _spec_location(lab, vm))
        config = merge_config(config, theirs, locate)
    return f"{HEADER}\n{dump(config)}\n"


def generated_config(vm: VmSpec, authorized_key: str | None,
                     host_key: tuple[str, str] | None, *, agent: bool = True) -> dict[str, Any]:
    """What vmlaunch asks of cloud-init, as a dict.

    - One user, the lab's (no distro default user: one known account per VM), with the lab's key,
      passwordless sudo and a locked password; no root login, no password logins.
    - The VM's host key, and no other: `ssh_deletekeys` removes any the image carries, and with
      `ssh_keys` given cloud-init generates none (cc_ssh; `ssh_genkeytypes: []` would say so too,
      but 22.4's schema wants at least one item and warns), so the key pinned in known_hosts is
      the one sshd offers.
    - `manage_etc_hosts`: the hostname resolves (sudo warns on every call otherwise).
    - `updates`: the network config is rendered at every boot, not just the first (module doc).
    - `bootcmd`: vmlaunch's agent for the command channel (`agent`, guests/channel.py), then the shares.
    """
    seed = _seed_of(vm)
    user: dict[str, Any] = {"name": seed.user, "sudo": SUDO_ALL, "shell": "/bin/bash", "lock_passwd": True}
    if authorized_key is not None:
        user["ssh_authorized_keys"] = [authorized_key.strip()]
    config: dict[str, Any] = {
        "hostname": vm.name,
        "fqdn": vm.name,
        "preserve_hostname": False,
        "manage_etc_hosts": True,
        "users": [user],
        "disable_root": True,
        "ssh_pwauth": False,
        "ssh_deletekeys": True,
    }
    if host_key is not None:
        private, public = host_key
        config["ssh_keys"] = {"ed25519_private": private, "ed25519_public": public.strip()}
    config["updates"] = {"network": {"when": ["boot-new-instance", "boot"]}}
    bootcmd = [install_command()] if agent and agent_on(vm) else []  # the command channel's agent: first
    bootcmd += [mount_command(share) for share in vm.shares]
    if bootcmd:
        config["bootcmd"] = bootcmd
    if seed.packages:
        config["package_update"] = True
        config["packages"] = list(seed.packages)
    if seed.runcmd:
        config["runcmd"] = list(seed.runcmd)
    return config


def mount_command(share: Share) -> list[str]:
    """The bootcmd entry that mounts a share (a list: cloud-init quotes each word for the shell)."""
    options = f"{NINEP_OPTIONS},{'ro' if share.readonly else 'rw'}"
    return ["sh", "-c", _MOUNT_SCRIPT, "vmlaunch-share", share.tag, share.target, options]


# --------------------------------------------------------------------------- the user's file

Locate = Callable[[KeyPath], Location]

# Keys of the generated config the user's file may not change: vmlaunch pins this host key in
# known_hosts, so any other would make every `vmlaunch ssh` fail as a changed host key.
PROTECTED = (("ssh_keys", "ed25519_private"), ("ssh_keys", "ed25519_public"))


def merge_config(ours: dict[str, Any], theirs: dict[str, Any], locate: Locate) -> dict[str, Any]:
    """The user's cloud-config merged over vmlaunch's.

    - Mappings merge key by key, at any depth; for a scalar, the user's value wins (`hostname`,
      `ssh_pwauth`, `package_update`...).
    - Lists are concatenated, ours first: the user's `runcmd`, `packages`, `bootcmd`, `write_files`
      come after vmlaunch's and can rely on them (a share is mounted before their bootcmd runs).
    - `users`: an entry named like the lab's user is merged into it by these same rules (their
      `groups`, `passwd`, extra `ssh_authorized_keys` after the lab's key); other entries, and
      strings such as "default", are appended. The lab's user always keeps the lab's key: it is how
      vmlaunch itself reaches the VM (`vmlaunch ssh`, waiting for SSH), so it cannot be merged
      away; to log in as someone else, add that user.
    - A list or mapping of ours met by another kind of value (`users: default`) is an error naming
      the line, rather than silently dropping what vmlaunch needs; so is a different host key in
      `ssh_keys` (`PROTECTED`); other `ssh_keys` entries are added.
    """
    merged = _merge(ours, theirs, (), locate)
    assert isinstance(merged, dict)
    return merged


def _merge(ours: Any, theirs: Any, path: KeyPath, locate: Locate) -> Any:
    if path in PROTECTED and theirs != ours:
        raise SpecError([Problem(locate(path), "vmlaunch gives each VM its SSH host key and pins it in "
                                 "known_hosts; another one would be refused as a changed host key",
                                 f"remove {path[-1]}: vmlaunch keeps the VM's key in its lab dir")])
    if isinstance(ours, dict) and isinstance(theirs, dict):
        merged = dict(ours)
        for key, value in theirs.items():
            merged[key] = _merge(ours[key], value, (*path, key), locate) if key in ours else value
        return merged
    if isinstance(ours, list) and isinstance(theirs, list):
        return _merge_users(ours, theirs, locate) if path == ("users",) else ours + theirs
    if isinstance(ours, (dict, list)):
        kind = "a mapping" if isinstance(ours, dict) else "a list"
        raise SpecError([Problem(locate(path), f"must be {kind}: vmlaunch's cloud-config has {kind} "
                                 "here and merges the file's into it", None)])
    return theirs


def _merge_users(ours: list[Any], theirs: list[Any], locate: Locate) -> list[Any]:
    merged = list(ours)
    for index, entry in enumerate(theirs):
        same = next((i for i, mine in enumerate(merged) if isinstance(mine, dict) and isinstance(entry, dict)
                     and mine.get("name") == entry.get("name")), None)
        if same is None:
            merged.append(entry)
        else:
            merged[same] = _merge(merged[same], entry, ("users", index), locate)
    return merged


def load_user_config(file: Path, where: Location) -> tuple[dict[str, Any], Locate]:
    """The user's cloud-config file as a dict, and a function giving the Location of a key path in
    it (for merge errors). SpecError names the file and line when it is not a `#cloud-config` YAML
    mapping; `where` (the spec's `user_data` key) when it cannot be read.

    Values JSON cannot carry are refused with their line (`!!binary`, `!!set`, non-string keys,
    .inf/.nan); a YAML timestamp stays the text written.
    """
    import yaml

    def problem(line: int, message: str, hint: str | None = None) -> SpecError:
        return SpecError([Problem(Location(file, line), message, hint)])

    try:
        data = read_bounded(file, USER_DATA_LIMIT)  # a FIFO, a device, /dev/zero behind a link: refused
    except OSError as exc:
        raise SpecError([Problem(where, f"cannot read {file}: {exc.strerror or exc}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise problem(data[:exc.start].count(b"\n") + 1, "not UTF-8 text") from None
    if text.split("\n", 1)[0].rstrip() != HEADER:
        raise problem(1, f"a cloud-config file begins with the line {HEADER}",
                      "cloud-init reads the file as cloud-config only then")
    loader = _user_loader()(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_node(node, problem, set())
        value = {} if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise problem(mark.line + 1 if mark else 1, f"not valid YAML: {message}") from None
    except yaml.YAMLError as exc:
        raise problem(1, f"not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    if not isinstance(value, dict):
        raise problem(node.start_mark.line + 1 if node is not None else 1,
                      "a cloud-config file is a mapping (key: value lines)")
    return value, lambda path: Location(file, _line_of(node, path), path)


@functools.lru_cache(maxsize=1)
def _user_loader() -> type[yaml.SafeLoader]:
    import yaml

    class UserLoader(yaml.SafeLoader):
        """cloud-init's loader (SafeLoader), with timestamps kept as the text written."""

    def as_written(loader: UserLoader, node: yaml.Node) -> str:
        assert isinstance(node, yaml.ScalarNode)
        return str(loader.construct_scalar(node))

    UserLoader.add_constructor("tag:yaml.org,2002:timestamp", as_written)
    return UserLoader


_PLAIN = "tag:yaml.org,2002:"
_NOT_FINITE = re.compile(r"[-+]?\.(?:inf|Inf|INF|nan|NaN|NAN)")
_SCALAR_TAGS = {f"{_PLAIN}{tag}" for tag in ("str", "int", "float", "bool", "null", "timestamp")}


def _check_node(node: yaml.Node, problem: Callable[..., SpecError], stack: set[int]) -> None:
    """Refuse what would not survive as JSON, with its line."""
    import yaml

    line = node.start_mark.line + 1
    if id(node) in stack:
        raise problem(line, "a recursive alias (an anchor used inside itself)")
    if isinstance(node, yaml.ScalarNode):
        if node.tag == f"{_PLAIN}binary":
            raise problem(line, "!!binary is not supported here",
                          "give write_files content base64 text with encoding: b64")
        if node.tag not in _SCALAR_TAGS:
            raise problem(line, f"the tag {node.tag} is not supported here")
        if node.tag == f"{_PLAIN}float" and _NOT_FINITE.fullmatch(node.value):
            raise problem(line, f"{node.value} is not a finite number")
        return
    stack.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        if node.tag != f"{_PLAIN}seq":
            raise problem(line, f"the tag {node.tag} is not supported here")
        for item in node.value:
            _check_node(item, problem, stack)
    elif isinstance(node, yaml.MappingNode):
        if node.tag != f"{_PLAIN}map":
            raise problem(line, f"the tag {node.tag} is not supported here")
        for key, value in node.value:
            if key.tag == f"{_PLAIN}merge":
                _check_node(value, problem, stack)
                continue
            if not isinstance(key, yaml.ScalarNode) or key.tag != f"{_PLAIN}str":
                raise problem(key.start_mark.line + 1, "a key must be text (quote it)")
            _check_node(value, problem, stack)
    stack.discard(id(node))


def _line_of(node: yaml.Node | None, path: KeyPath) -> int:
    """The line of the deepest part of `path` found under `node` (1 when none is)."""
    import yaml

    line = 1 if node is None else node.start_mark.line + 1
    for part in path:
        found = None
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            found = next((key for key, _ in reversed(node.value) if key.value == part), None)
            if found is not None:
                line = found.start_mark.line + 1
                node = next(value for key, value in node.value if key is found)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = found = node.value[part]
            line = node.start_mark.line + 1
        if found is None:
            break
    return line


def _spec_location(lab: LabSpec, vm: VmSpec) -> Location:
    path: KeyPath = ("vm", vm.name, "cloud_init", "user_data")
    return Location(lab.file, lab.source.line_of(path), path)


# --------------------------------------------------------------------------- meta-data, network-config


def meta_data(lab: LabSpec, vm: VmSpec, instance_id: str) -> str:
    """The instance-id (cloud-init runs its once-per-instance steps again when it changes) and the
    local hostname."""
    return dump({"instance-id": instance_id, "local-hostname": vm.name}) + "\n"


def network_config(lab: LabSpec, vm: VmSpec, management_mac: str | None) -> str | None:
    """network-config version 2, one `ethernets` entry per NIC vmlaunch can configure, matched by MAC:

    - a NIC with an `ip`: that address, its gateway as the default route, its DNS servers, no DHCP;
    - a NIC on a `type = "user"` network, and the management NIC (`management_mac`, QEMU's user
      network too): DHCP from QEMU (10.0.2.15, with a default route and DNS through the host);
    - a NIC on a bridge or socket network without an `ip` is left out: nobody is known to answer
      DHCP there, and a link waiting for a lease would hold systemd-networkd-wait-online, and so
      cloud-init and the boot, for two minutes.

    Every entry is `optional: true`, for the same reason. None when no NIC is listed: cloud-init then
    does what it does without a network-config (DHCP on the first NIC).
    """
    ethernets: dict[str, Any] = {}
    for index, nic in enumerate(vm.nics):
        if nic.ip is not None:
            entry: dict[str, Any] = {"match": {"macaddress": nic.mac}, "addresses": [nic.ip],
                                     "dhcp4": False}
            if nic.gateway:
                entry["routes"] = [{"to": "0.0.0.0/0", "via": nic.gateway}]
            if nic.dns:
                entry["nameservers"] = {"addresses": list(nic.dns)}
            ethernets[f"nic{index}"] = {**entry, "optional": True}
        elif isinstance(lab.network(nic.network), UserNetwork):
            ethernets[f"nic{index}"] = _dhcp(nic.mac)
    if management_mac is not None:
        ethernets["mgmt"] = _dhcp(management_mac)
    if not ethernets:
        return None
    return dump({"version": 2, "ethernets": ethernets}) + "\n"


def _dhcp(mac: str) -> dict[str, Any]:
    return {"match": {"macaddress": mac}, "dhcp4": True, "optional": True}


# --------------------------------------------------------------------------- instance-id


def instance_id(lab_dir: LabDir, vm: str) -> str:
    """The VM's cloud-init instance-id: read from `VM/instance-id`, made (random) when missing.

    It must stay the same while the VM's disk lives (`down`/`up`: cloud-init must not redo its
    once-per-instance steps on a guest it already set up) and change with a new overlay (`up
    --fresh`, `reset`). A random id kept beside the overlay, and removed with it (it is in
    `VmDir.fresh`), does both. The overlay's inode and ctime would not: every write to the disk
    changes its ctime, and a recreated file may get the old inode number back.

    Should a crash leave one without the other, either way is safe: a new id on the old disk makes
    cloud-init apply the same seed again (same user, same host key); an old id on a new disk does not
    matter, since a new disk has no cloud-init state to compare it with.
    """
    from vmlaunch.core.fsutil import write_atomic
    from vmlaunch.guests.sshkeys import check_name, make_private_dir, read_own_file

    check_name(lab_dir.lab, "lab")
    check_name(vm, "VM")
    lab_dir.secure(create=True)
    files = lab_dir.vm(vm)
    make_private_dir(files.path)
    try:
        found = read_own_file(files.instance_id).strip()
        if _INSTANCE_ID.fullmatch(found):
            return found
    except (FileNotFoundError, ValueError):
        pass  # missing or damaged: a new one (cloud-init then sets the guest up again)
    made = f"vmlaunch-{lab_dir.lab}-{vm}-{secrets.token_hex(8)}"
    write_atomic(files.instance_id, f"{made}\n", 0o600)
    return made


# --------------------------------------------------------------------------- the seed volume


def write_seed(path: Path, user_data: str, meta_data: str, network_config: str | None) -> None:
    """The NoCloud seed at `path`: an ISO 9660 volume labelled `cidata` holding `user-data`,
    `meta-data` and (when given) `network-config`, with Rock Ridge and Joliet names so the guest
    reads those names exactly. Written whole to a temp file and renamed over `path` (0600: QEMU runs
    as the same user)."""
    import pycdlib

    from vmlaunch.core.fsutil import write_atomic

    files = {"user-data": user_data, "meta-data": meta_data}
    if network_config is not None:
        files["network-config"] = network_config
    iso = pycdlib.PyCdlib()
    iso.new(joliet=3, rock_ridge="1.09", vol_ident=SEED_LABEL)
    for name, text in files.items():
        data = text.encode()
        iso.add_fp(io.BytesIO(data), len(data), _ISO_NAMES[name], rr_name=name, joliet_path=f"/{name}")
    out = io.BytesIO()
    iso.write_fp(out)
    iso.close()
    write_atomic(path, out.getvalue(), 0o600)


def read_seed(path: Path) -> dict[str, str]:
    """The files of a seed `write_seed` made, by name (its Rock Ridge names); RuntimeFailure when
    `path` is not a readable `cidata` volume."""
    import pycdlib
    from pycdlib.pycdlibexception import PyCdlibException

    iso = pycdlib.PyCdlib()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            iso.open_fp(file)
            try:
                label = iso.pvd.volume_identifier.decode("ascii", "replace").rstrip()
                if label != SEED_LABEL:
                    raise RuntimeFailure(f"{path} is not a NoCloud seed: its label is {label!r}, "
                                         f"not {SEED_LABEL!r}")
                found: dict[str, str] = {}
                for child in iso.list_children(rr_path="/"):
                    if child.is_dot() or child.is_dotdot() or not child.is_file():
                        continue
                    name = child.rock_ridge.name().decode()
                    content = io.BytesIO()
                    iso.get_file_from_iso_fp(content, rr_path=f"/{name}")
                    found[name] = content.getvalue().decode()
                return found
            finally:
                iso.close()
    except (OSError, PyCdlibException, UnicodeDecodeError) as exc:
        raise RuntimeFailure(f"cannot read the seed {path}: {exc}") from None


# --------------------------------------------------------------------------- helpers


def dump(value: Any) -> str:
    """`value` as JSON that PyYAML (cloud-init's YAML reader) reads back exactly (module docstring)."""
    text = json.dumps(value, indent=2, ensure_ascii=True, allow_nan=False)
    return _LONG_KEY.sub(_explicit_key, _SURROGATE_PAIR.sub(_join_pair, text))


# A mapping key at the start of its line (json.dumps' indent=2 puts each on its own), with its ": ".
_LONG_KEY = re.compile(r'^( *)("(?:[^"\\\n]|\\.)*"): ', re.M)
SIMPLE_KEY_MAX = 1000  # PyYAML refuses a plain key of 1024 characters or more


def _explicit_key(found: re.Match[str]) -> str:
    indent, key = found[1], found[2]
    return found[0] if len(key) < SIMPLE_KEY_MAX else f"{indent}? {key}\n{indent}: "


def _join_pair(found: re.Match[str]) -> str:
    pair = chr(int(found[2], 16)) + chr(int(found[3], 16))
    return found[1] + pair.encode("utf-16", "surrogatepass").decode("utf-16")


def _seed_of(vm: VmSpec) -> CloudInit:
    if vm.cloud_init is None:
        raise ValueError(f"VM {vm.name} has no cloud_init: it gets no seed")
    return vm.cloud_init
