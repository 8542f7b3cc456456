"""Host KSM on while a lab runs (`[lab.memory] ksm`), at a rate that merges idle guests in a minute or
two, and the host's own settings put back exactly when the last lab that wanted it goes.

KSM is one setting for the whole host, so whether it is changed, and put back, is decided host-wide in
one `ksm.json` (kept as `hostwide.py` keeps such files): in /run/vmlaunch for the host's own KSM,
whatever run root each lab uses (`VMLAUNCH_RUN_DIR`), so that labs under different run roots see each
other; in the run root for a fake sysfs (`VMLAUNCH_SYSFS`: tests) and when not root.

    {"version": 2, "saved": {"run": "0", "pages_to_scan": "100", ...}, "foreign": false,
     "labs": [{"root": "/run/vmlaunch", "lab": "a", "settings": {"run": "1", ...}, "explicit": false}]}

- `labs`: each lab that wants KSM (by its run root and name), with the settings it asks for
  (`explicit`: the spec gave a rate). Several labs: the explicit rates win over vmlaunch's default,
  and of those the fastest. (Version 1 kept `labs` by name alone, all of the file's own run root.)
- `saved`: each setting as it was before vmlaunch first changed it. The last lab to leave writes them
  back, in an order the kernel accepts, and removes the file.
- `foreign`: KSM already ran when the first lab came (an administrator's choice): vmlaunch then leaves
  its rate alone, unless a spec gives one.

A claim is written before any setting changes, so a vmlaunch killed half-way leaves a claim that its
lab's `down` finds (`release_unjournaled_ksm`); a lab that is gone (`hostwide.lab_in_use`) never keeps
KSM on. The settings live under the one sysfs root (`VMLAUNCH_SYSFS`, else /sys).

The rate: a full pass over the lab's memory every PASS_SECONDS at one wake-up per SLEEP_MS, which is
pages_to_scan = the lab's pages * SLEEP_MS / (PASS_SECONDS * 1000), at least the kernel's default (100)
and at most MAX_PAGES. Measured here (`bench/ksm_rate.py`, two idle 256M test guests): the guide's 440
pages every 5 s merged nothing in 2 minutes; the kernel's 100 pages every 20 ms merged 90 % of what
could be in 40 s with ksmd at 1.3 % of a CPU; 1000 every 20 ms in 5 s at 5 %. The kernel's advisor
(`advisor_mode = scan-time`, Linux 6.7+), which adapts the rate after each full pass, started this
kernel (6.18) at 15 pages per wake-up and took 95 s to get there: a rate sized for the lab does
better from the first pass, so vmlaunch turns the advisor off while its labs run (and back on after).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.errors import HostError, needs_root
from vmlaunch.host import hostwide
from vmlaunch.host.hostwide import LAB_NAME, RegistryError
from vmlaunch.host.memory import ksm_dir
from vmlaunch.layout.dirs import run_root
from vmlaunch.resources.base import Context, LabWide

log = logging.getLogger(__name__)

CLAIMS_FILE = "ksm.json"
CLAIMS_LOCK = "ksm.lock"
CLAIMS_VERSION = 2
HOST_CLAIMS_DIR = Path("/run/vmlaunch")  # the host's KSM: one file whatever a lab's run root
HOST_KSM = Path("/sys/kernel/mm/ksm")
LabKey = tuple[str, str]  # (the lab's run root, its name)

PASS_SECONDS = 10  # a full pass over the lab's memory: idle guests merged in two or three
SLEEP_MS = 20  # the kernel's default wake-up period
MIN_PAGES, MAX_PAGES = 100, 5000  # the kernel's default rate; a cap (250k pages/s: ksmd would take a
# large share of a CPU beyond)
# Each setting vmlaunch may change; the order in which they are written. The advisor's mode first:
# setting it resets pages_to_scan, which the kernel refuses while the advisor runs. `run` last.
SETTINGS = ("advisor_mode", "pages_to_scan", "sleep_millisecs", "run")


def default_settings(advisor: bool, lab_mib: int) -> dict[str, str]:
    """vmlaunch's rate for a lab holding `lab_mib` of guest RAM (see the module docstring)."""
    pages = (lab_mib << 20) // os.sysconf("SC_PAGE_SIZE")
    per_wake = math.ceil(pages * SLEEP_MS / (PASS_SECONDS * 1000))
    return explicit_settings(advisor, min(MAX_PAGES, max(MIN_PAGES, per_wake)), SLEEP_MS)


def explicit_settings(advisor: bool, pages_to_scan: int | None, sleep_ms: int | None) -> dict[str, str]:
    """A fixed rate (the spec's `ksm_pages_to_scan`, `ksm_sleep_ms`), with the kernel's advisor off:
    it would set pages_to_scan itself."""
    settings = {"pages_to_scan": str(pages_to_scan or MIN_PAGES),
                "sleep_millisecs": str(SLEEP_MS if sleep_ms is None else sleep_ms), "run": "1"}
    return {"advisor_mode": "none", **settings} if advisor else settings


def speed(settings: Mapping[str, str]) -> float:
    """How fast a set of settings scans, to pick the fastest: pages per millisecond."""
    return int(settings.get("pages_to_scan", MIN_PAGES)) / max(1, int(settings.get("sleep_millisecs", 1)))


@attrs.define
class Claim:
    settings: dict[str, str]
    explicit: bool = False


def combine(claims: Mapping[Any, Claim], foreign: bool) -> dict[str, str]:
    """The settings that serve every lab that wants KSM (pure): an explicit rate wins over vmlaunch's
    default, and the fastest of either; a KSM an administrator runs is left alone but for explicit
    rates."""
    if not claims:
        return {}
    explicit = [claim for claim in claims.values() if claim.explicit]
    if foreign and not explicit:
        return {}
    chosen = max(explicit or list(claims.values()), key=lambda claim: speed(claim.settings)).settings
    return {name: value for name, value in chosen.items() if not (foreign and name == "run")}


def lab_key(lab: str) -> LabKey:
    """How a lab is named in the claims: its run root (this process's, absolute) and its name."""
    return (os.path.abspath(run_root()), lab)


def claims_root(sysfs: Path | None) -> Path | None:
    """Where the claims of the KSM under `sysfs` are: /run/vmlaunch for the host's own (as root);
    None, the run root, for a fake sysfs or a user's."""
    try:
        real = ksm_dir(sysfs).resolve() == HOST_KSM.resolve()
    except OSError:
        real = False
    return HOST_CLAIMS_DIR if real and os.geteuid() == 0 else None


@attrs.define
class KsmClaims:
    """`ksm.json` as read under its lock; `save` writes it back (or removes it when nothing is left)."""

    root: Path
    labs: dict[LabKey, Claim] = attrs.Factory(dict)
    saved: dict[str, str] = attrs.Factory(dict)
    foreign: bool = False

    @property
    def path(self) -> Path:
        return self.root / CLAIMS_FILE

    @classmethod
    def load(cls, root: Path) -> KsmClaims:
        claims = cls(root)
        doc = hostwide.read_document(claims.path, (1, CLAIMS_VERSION), claims._damaged)
        if doc is None:
            return claims
        try:
            claims.saved = _settings(doc.get("saved"), "saved")
            claims.foreign = doc.get("foreign") is True
            labs = doc.get("labs")
            if doc["version"] == 1:  # {name: claim}, every lab of this run root
                if not isinstance(labs, dict):
                    raise ValueError("no table of labs")
                labs = [{**claim, "root": str(root), "lab": lab} if isinstance(claim, dict) else claim
                        for lab, claim in labs.items()]
            if not isinstance(labs, list):
                raise ValueError("no list of labs")
            for claim in labs:
                lab = claim.get("lab") if isinstance(claim, dict) else None
                where = claim.get("root") if isinstance(claim, dict) else None
                if not isinstance(lab, str) or not LAB_NAME.fullmatch(lab) or not isinstance(where, str) \
                        or not where.startswith("/") or not where.isprintable() \
                        or not isinstance(claim.get("explicit", False), bool):
                    raise ValueError(f"{claim!r:.80}: not a lab's run root and name with its settings")
                claims.labs[(where, lab)] = Claim(_settings(claim.get("settings"), lab),
                                                  claim.get("explicit", False))
        except ValueError as exc:
            raise claims._damaged(str(exc)) from exc
        return claims

    def _damaged(self, problem: str) -> RegistryError:
        return RegistryError(f"the KSM claims {self.path} cannot be read: {problem}",
                             f"check /sys/kernel/mm/ksm by hand, then remove {self.path}")

    def save(self) -> None:
        if not self.labs and not self.saved:
            self.path.unlink(missing_ok=True)
            return
        doc = {"version": CLAIMS_VERSION, "saved": self.saved, "foreign": self.foreign,
               "labs": [{"root": root, "lab": lab, **attrs.asdict(claim)}
                        for (root, lab), claim in sorted(self.labs.items())]}
        write_atomic(self.path, json.dumps(doc, indent=1) + "\n")

    def drop_stale(self, but: LabKey | None = None) -> None:
        self.labs = {key: claim for key, claim in self.labs.items()
                     if key == but or hostwide.lab_in_use(Path(key[0]), key[1])}


def _settings(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            name in SETTINGS and isinstance(text, str) and text.isascii()
            and (text in ("none", "scan-time") if name == "advisor_mode" else text.isdigit())
            for name, text in value.items()):
        raise ValueError(f"{what}: settings must be KSM settings with their values")
    return dict(value)


@contextlib.contextmanager
def locked_claims(root: Path | None = None) -> Iterator[KsmClaims]:
    """The claims in `root` (None: the run root), read under their lock, held for the block."""
    with hostwide.locked(CLAIMS_FILE, CLAIMS_LOCK, "KSM claims", root) as where:
        yield KsmClaims.load(where)


def read(folder: Path, name: str) -> str:
    """A KSM setting as text; a choice ("[none] scan-time") as the one chosen."""
    path = folder / name
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from None
    if "[" in text:
        text = text.split("[", 1)[1].split("]", 1)[0]
    return text


def write(folder: Path, name: str, value: str) -> None:
    path = folder / name
    try:
        path.write_text(f"{value}\n")
    except PermissionError:
        raise HostError(f"cannot write {path}: permission denied",
                        needs_root("turning KSM on") + ", or set ksm = false in [lab.memory]") from None
    except OSError as exc:
        raise HostError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from None


def _advised(folder: Path) -> bool:
    return (folder / "advisor_mode").exists() and read(folder, "advisor_mode") != "none"


def apply_settings(claims: KsmClaims, folder: Path, wanted: Mapping[str, str]) -> None:
    """Make the settings `wanted` (those this kernel has), saving each one's value before the first
    change, and the file before the kernel: a crash after a change still knows the old value."""
    for name in SETTINGS:
        if name not in wanted or not (folder / name).exists():
            continue
        current = read(folder, name)
        if current == wanted[name] or (name == "pages_to_scan" and _advised(folder)):
            continue  # (the advisor sets pages_to_scan itself, and refuses a write)
        if name not in claims.saved:
            claims.saved[name] = current
            claims.save()
        write(folder, name, wanted[name])


def restore_settings(claims: KsmClaims, folder: Path) -> list[str]:
    """Write back every saved setting; what could not be, one line each."""
    problems = []
    for name in SETTINGS:
        value = claims.saved.get(name)
        if value is None or not (folder / name).exists():
            continue
        try:
            if read(folder, name) != value and not (name == "pages_to_scan" and _advised(folder)):
                write(folder, name, value)
        except HostError as exc:
            problems.append(exc.message)
    claims.saved, claims.foreign = {}, False
    return problems


def claim(lab: str, settings: Mapping[str, str], explicit: bool, sysfs: Path | None) -> None:
    """`lab` wants KSM with `settings`: the host's settings become those every claim together needs.
    On failure the lab's claim is taken back (and the settings with it) before the error goes on."""
    folder = ksm_dir(sysfs)
    key = lab_key(lab)
    with locked_claims(claims_root(sysfs)) as claims:
        claims.drop_stale(but=key)
        if not claims.labs:
            restore_settings(claims, folder)  # what labs that are gone left behind (after a crash)
            claims.foreign = read(folder, "run") != "0"
        claims.labs[key] = Claim(dict(settings), explicit)
        claims.save()  # the claim first: `down` finds it even if vmlaunch dies in the middle
        try:
            apply_settings(claims, folder, combine(claims.labs, claims.foreign))
        except BaseException:
            _leave(claims, folder, key)
            raise
        claims.save()


def release(lab: str, sysfs: Path | None) -> None:
    """`lab` no longer wants KSM: the last lab out puts the host's settings back; otherwise the
    settings become those the other labs need."""
    with locked_claims(claims_root(sysfs)) as claims:
        problems = _leave(claims, ksm_dir(sysfs), lab_key(lab))
    if problems:
        raise HostError("KSM's settings could not all be put back: " + "; ".join(problems),
                        "compare /sys/kernel/mm/ksm with what you had")


def _leave(claims: KsmClaims, folder: Path, lab: LabKey) -> list[str]:
    claims.labs.pop(lab, None)
    claims.drop_stale()
    if claims.labs:
        apply_settings(claims, folder, combine(claims.labs, claims.foreign))
    else:
        problems = restore_settings(claims, folder)
        if problems:
            return problems
    try:
        claims.save()
    except OSError as exc:  # the host is as it should be; the file keeps a claim of a lab now gone
        log.warning("%s could not be updated (%s): its claim of lab %s is dropped by the next lab or down",
                    claims.path, exc.strerror or exc, lab[1])
    return []


@attrs.frozen
class KsmRecord:
    kind: ClassVar[str] = "ksm"

    settings: dict[str, str]
    sysfs: Path | None = None

    def undo(self, ctx: Context, *, rollback: bool) -> None:
        release(ctx.lab, self.sysfs or ctx.sysfs)

    def describe(self) -> str:
        return f"host KSM on while the lab runs ({self.describe_rate()}; put back by down)"

    def describe_rate(self) -> str:
        return describe_settings(self.settings)


def describe_settings(settings: Mapping[str, str]) -> str:
    return f"{settings.get('pages_to_scan')} pages every {settings.get('sleep_millisecs')} ms"


def release_unjournaled_ksm(ctx: Context, journaled: Callable[[str, str], bool]) -> list[str]:
    """For `down`: a claim that no journaled record backs (an `up` killed in between) is released."""
    if journaled(KsmRecord.kind, "host"):
        return []
    try:
        with locked_claims(claims_root(ctx.sysfs)) as claims:
            if lab_key(ctx.lab) not in claims.labs:
                return []
        log.info("KSM: finishing what a killed `up` of lab %s left", ctx.lab)
        release(ctx.lab, ctx.sysfs)
    except HostError as exc:
        return [str(exc)]
    return []


@attrs.frozen
class Ksm(LabWide):
    """Host KSM on for the lab, at these settings."""

    kind: ClassVar[str] = "ksm"

    settings: dict[str, str] = attrs.field(hash=False)
    explicit: bool = False

    @property
    def key(self) -> str:
        return "host"

    def describe(self) -> str:
        how = "the spec's rate" if self.explicit else "vmlaunch's rate"
        return f"host KSM on while the lab runs ({how}: {describe_settings(self.settings)})"

    def found(self) -> str | None:
        try:
            return "KSM runs already" if read(ksm_dir(), "run") != "0" else None
        except HostError:
            return None

    def apply(self, ctx: Context) -> KsmRecord:
        claim(ctx.lab, self.settings, self.explicit, ctx.sysfs)
        return KsmRecord(settings=dict(self.settings), sysfs=ctx.sysfs)
