"""Every QEMU confined: a seccomp sandbox for each, and for a lab run as root a uid (and gid) of its own
per VM, which no account of the host and no other VM uses.

Why: test rigs run code nobody reviewed inside their guests, and a guest that escapes into its QEMU
(a device emulation bug) must find neither root nor another VM's files there.

How, and why this way (QEMU 7.2, checked on these machines):
- `-runas UID:GID` (numeric: no account is needed) makes QEMU drop root once it has opened what it
  needs at start-up: /dev/kvm, the taps (vmlaunch creates them; QEMU opens them by name), the disks,
  hugepage memory, its sockets and logs. From then on it runs as the VM's uid with no capability and
  touches nothing else of the host: its disks and sockets stay open, snapshots go into its open qcow2
  files, and a 9p share is reached through what vmlaunch grants that uid (guests/shareaccess.py). The
  one reopen a disk needs after the drop (a warm start's return to cache = none) goes through a
  descriptor vmlaunch opened and passed in (`-add-fd`, `/dev/fdset/N`: saved/snapshot.py).
- `-sandbox on,obsolete=deny,spawn=deny,resourcecontrol=deny`: QEMU's seccomp filter. It cannot keep
  `elevateprivileges=deny` (or `children`) with -runas: the setuid -runas makes comes after the filter
  is installed and is killed as a "Bad system call". libvirt gets that one too by starting QEMU as its
  user with every privileged thing passed in as a descriptor; vmlaunch keeps QEMU's own -runas, which
  needs no descriptor passing for taps, disks, /dev/kvm and hugepages, and accepts the one missing
  rule: after the drop, a uid without capabilities gains nothing from a setuid.
- `spawn=deny` forbids fork: QEMU is therefore started without -daemonize (which forks after the filter
  is on) and detached by vmlaunch (its own session), qemu.start.

The uids come from a range vmlaunch owns: `VMLAUNCH_UID_RANGE` (`FIRST-LAST`), by default 65,536 ids
from 1879048192 (0x70000000), which systemd documents as unused. `up` checks it against the host's
accounts and groups (`/etc/passwd`, `/etc/group`, through NSS) and subordinate id ranges (`/etc/subuid`,
`/etc/subgid`): a collision is exit 3 naming the setting. The gid of a VM is its uid. Which VM holds
which uid is recorded host-wide in /run/vmlaunch/uids.json (with its lock), claimed at `up` and
released at `down`; a claim of a lab that is gone, whose uid no process runs as, is stale and reused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.errors import HostError
from vmlaunch.host.facts import CONFINE_ENV, Host

log = logging.getLogger(__name__)

SANDBOX = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
RANGE_ENV = "VMLAUNCH_UID_RANGE"
DEFAULT_FIRST = 0x70000000  # 1879048192
DEFAULT_COUNT = 1 << 16
UIDS_FILE = "uids.json"
UIDS_LOCK = "uids.lock"
UIDS_VERSION = 1
HOST_ROOT = Path("/run/vmlaunch")  # the host has one set of uids, whatever each lab's run root


@attrs.frozen
class UidRange:
    first: int
    last: int

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def overlaps(self, first: int, last: int) -> bool:
        return first <= self.last and self.first <= last

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def uid_range() -> UidRange:
    """The range VMLAUNCH_UID_RANGE names (`FIRST-LAST`), else the default; HostError for one that is
    not a range of ids other than root's and nobody's."""
    text = os.environ.get(RANGE_ENV, "").strip()
    if not text:
        return UidRange(DEFAULT_FIRST, DEFAULT_FIRST + DEFAULT_COUNT - 1)
    first_text, _, last_text = text.partition("-")
    try:
        first, last = int(first_text), int(last_text)
    except ValueError:
        raise HostError(f"{RANGE_ENV}={text!r} is not a range of uids",
                        f"e.g. {RANGE_ENV}={DEFAULT_FIRST}-{DEFAULT_FIRST + DEFAULT_COUNT - 1}") from None
    if not 0 < first <= last < 0xFFFFFFFF or first <= 65534 <= last:
        raise HostError(f"{RANGE_ENV}={text!r} must be uids above 0, below 4294967295, without nobody's "
                        "65534", f"e.g. {RANGE_ENV}={DEFAULT_FIRST}-{DEFAULT_FIRST + DEFAULT_COUNT - 1}")
    return UidRange(first, last)


def collisions(ids: UidRange, etc: Path = Path("/etc")) -> list[str]:
    """What of the host already uses ids of the range: accounts and groups (through NSS), and the
    subordinate id ranges of /etc/subuid and /etc/subgid; one line each."""
    import grp
    import pwd

    found = [f"user {user.pw_name} has uid {user.pw_uid}" for user in pwd.getpwall() if user.pw_uid in ids]
    found += [f"group {group.gr_name} has gid {group.gr_gid}" for group in grp.getgrall()
              if group.gr_gid in ids]
    for name in ("subuid", "subgid"):
        with contextlib.suppress(OSError):
            for line in (etc / name).read_text().splitlines():
                owner, _, rest = line.strip().partition(":")
                start, _, count = rest.partition(":")
                if start.isdigit() and count.isdigit() and int(count) and ids.overlaps(
                        int(start), int(start) + int(count) - 1):
                    found.append(f"{owner}'s subordinate ids {start}-{int(start) + int(count) - 1} "
                                 f"({etc / name})")
    return found


def check_range(ids: UidRange) -> None:
    found = collisions(ids)
    if found:
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        raise HostError(f"{RANGE_ENV} ({ids}) holds ids the host uses: {shown}",
                        f"set {RANGE_ENV}=FIRST-LAST to a range no account, group or subordinate range "
                        "of this host uses (each VM of a lab run as root gets one)")


def warn_if_off(host: Host) -> None:
    """Say it loudly when confinement is off (VMLAUNCH_CONFINE=off): for measuring and debugging only."""
    if not host.confine:
        log.warning("confinement is OFF (%s=%s): every QEMU runs %swithout a seccomp sandbox, and a "
                    "guest that escapes into its QEMU owns this host; unset %s", CONFINE_ENV,
                    os.environ.get(CONFINE_ENV, ""), "as root and " if host.as_root else "", CONFINE_ENV)


# --- the host-wide claims ---------------------------------------------------------------------------


@attrs.frozen
class Claim:
    uid: int
    root: str  # the run root of the lab
    lab: str
    vm: str


@contextlib.contextmanager
def _claims() -> Iterator[tuple[Path, dict[int, Claim]]]:
    from vmlaunch.host import hostwide

    with hostwide.locked(UIDS_FILE, UIDS_LOCK, "VM uid registry", HOST_ROOT) as root:
        path = root / UIDS_FILE
        doc = hostwide.read_document(path, UIDS_VERSION, lambda problem: hostwide.RegistryError(
            f"the VM uid registry {path} cannot be read: {problem}",
            "remove it once no lab runs: each VM's uid is claimed anew at its next up"))
        claims: dict[int, Claim] = {}
        for raw in (doc or {}).get("claims", []):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                claim = Claim(int(raw["uid"]), str(raw["root"]), str(raw["lab"]), str(raw["vm"]))
                claims[claim.uid] = claim
        before = dict(claims)
        yield path, claims
        if claims != before:
            _save(path, claims)


def _save(path: Path, claims: dict[int, Claim]) -> None:
    from vmlaunch.core.fsutil import write_atomic

    if not claims:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    doc: dict[str, Any] = {"version": UIDS_VERSION,
                           "claims": [attrs.asdict(claim) for _, claim in sorted(claims.items())]}
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def claim(root: Path, lab: str, vm: str, ids: UidRange) -> int:
    """A uid of the range for the VM: the one it holds already, else the first free one (no live claim,
    no process running as it). HostError when every one is taken."""
    from vmlaunch.host.hostwide import lab_in_use

    with _claims() as (_, claims):
        mine = next((c.uid for c in claims.values() if (c.root, c.lab, c.vm) == (str(root), lab, vm)), None)
        if mine is not None and mine in ids:
            return mine
        running = _process_uids()
        for uid, held in list(claims.items()):  # a lab that is gone: its claims are stale
            if uid not in running and not lab_in_use(Path(held.root), held.lab):
                del claims[uid]
        for uid in range(ids.first, ids.last + 1):
            if uid not in claims and uid not in running:
                claims[uid] = Claim(uid, str(root), lab, vm)
                return uid
    raise HostError(f"every uid of {RANGE_ENV} ({ids}) is taken by a running VM",
                    f"widen {RANGE_ENV}, or take labs down")


def release(uid: int, root: Path, lab: str, vm: str) -> None:
    """Drop the VM's claim on `uid` (nothing when another VM holds it now)."""
    with _claims() as (_, claims):
        held = claims.get(uid)
        if held is not None and (held.root, held.lab, held.vm) == (str(root), lab, vm):
            del claims[uid]


def _process_uids() -> set[int]:
    """The real, effective and saved uids of every process. Only the Uid line of each status is read
    into fields: `up` asks this once per VM, and a host runs hundreds of processes."""
    uids: set[int] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/status", "rb") as file:
                    text = file.read()
                at = text.index(b"\nUid:") + 5
                uids.update(map(int, text[at:text.index(b"\n", at)].split()[:3]))
    return uids


# --- what a running QEMU is ---------------------------------------------------------------------------


def process_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict of its fields; {} when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


@attrs.frozen
class Confinement:
    """What `status` and `doctor` show of a running QEMU."""

    uid: int | None  # its effective uid (None: unreadable)
    gid: int | None
    seccomp: bool | None  # a seccomp filter is on (Seccomp: 2)

    @classmethod
    def of(cls, pid: int) -> Confinement:
        fields = process_status(pid)
        uids, gids = fields.get("Uid", "").split(), fields.get("Gid", "").split()
        return cls(int(uids[1]) if len(uids) > 1 else None, int(gids[1]) if len(gids) > 1 else None,
                   fields["Seccomp"] == "2" if "Seccomp" in fields else None)

    def problems(self, *, as_root: bool) -> list[str]:
        """Why this QEMU is not confined as it should be (none: it is)."""
        found = []
        if self.seccomp is False:
            found.append("it runs without a seccomp sandbox (Seccomp is not 2)")
        if as_root and self.uid == 0:
            found.append("it runs as root")
        return found
