"""Catalog images (`[image.NAME] catalog = "debian-12"`): resolved, checked and pinned.

Resolving an entry (`resolve`) reads the distribution's checksum file for the build asked for, checks
its OpenPGP signature where the distribution signs it (`gpgv` with the distribution's keyring, when
both are on this host; said plainly when not), and takes the image's line from it: the image's URL
and digest. `pin` keeps them in the lock file beside the spec (SPEC.lock, TOML), so every later pull,
on any machine, fetches those bytes; `image pull --update` resolves anew and moves the pins.

URLs in the lock are the distribution's own; VMLAUNCH_IMAGE_MIRROR (scheme, host and an optional
path) replaces their scheme and host when fetching, so a lock made against a mirror is good without
it, and the other way round.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.core.fsutil import Unfit, read_bounded, write_new
from vmlaunch.errors import (
    EXIT_HOST,
    Location,
    OutputRefused,
    Problem,
    RuntimeFailure,
    SpecError,
    UsageError,
    VmlaunchError,
)
from vmlaunch.layout.labdir import spec_of_lock
from vmlaunch.spec import catalog
from vmlaunch.spec.catalog import MIRROR_SETTING, mirror
from vmlaunch.spec.model import Image

log = logging.getLogger(__name__)

KEYRING_SETTING = "VMLAUNCH_IMAGE_KEYRING"  # a keyring used for every signed entry (a mirror's own key)
REQUIRE_SETTING = "VMLAUNCH_REQUIRE_SIGNATURE"  # 1: a signed entry whose signature is not checked is refused
LOCK_FORMAT = 1
MAX_LOCK_BYTES = 1 << 20  # a lock file: a few hundred bytes a pinned image
KEYRING_LIMIT = 4 << 20  # a keyring file (Debian's archive keyring: some 100 KiB)
CHECKSUM_LIMIT = 4 << 20  # bytes of a checksum file (Debian's SHA512SUMS: a few KiB)
SIGNATURE_LIMIT = 64 << 10
GPGV_TIMEOUT = 60.0
_HEX = {64: "sha256", 128: "sha512"}
_PIN_KEYS = ("catalog", "version", "url", "checksum_url", "signature", "pinned")
_GNU_LINE = re.compile(r"([0-9A-Fa-f]{64}|[0-9A-Fa-f]{128}) [ *]?(.+)")
_BSD_LINE = re.compile(r"(SHA256|SHA512) ?\((.+)\) ?= ?([0-9A-Fa-f]+)")
_CLEARSIGN_START = "-----BEGIN PGP SIGNED MESSAGE-----"
_SIGNATURE_START = "-----BEGIN PGP SIGNATURE-----"


class BadSignature(VmlaunchError):
    """A checksum file whose signature does not verify with its distribution's key: the image it names
    is not used."""

    exit_code = EXIT_HOST


@attrs.frozen
class Pin:
    """What a catalog image resolved to: the distribution's URLs (no mirror) and the image's digest."""

    catalog: str
    version: str
    url: str
    checksum_url: str
    algo: str  # sha256 or sha512, the strongest the checksum file gives
    digest: str
    signature: str  # "verified ...", "skipped: why", or "none: ..." for an unsigned distribution
    pinned: str  # when, UTC ISO 8601

    def to_toml(self, name: str) -> str:
        lines = [f"[image.{name}]"]
        for key in ("catalog", "version", "url", "checksum_url"):
            lines.append(f"{key} = {json.dumps(getattr(self, key))}")
        lines.append(f"{self.algo} = {json.dumps(self.digest)}")
        lines.append(f"signature = {json.dumps(self.signature)}")
        lines.append(f"pinned = {json.dumps(self.pinned)}")
        return "\n".join(lines) + "\n"


# --- where ------------------------------------------------------------------------------------------


def fetched(url: str) -> str:
    """Where `url` is fetched from now: the mirror's, when one is set."""
    return catalog.apply_mirror(url, mirror())


def entry_of(image: Image) -> catalog.Entry:
    assert image.catalog is not None
    entry = catalog.entries().get(image.catalog)
    if entry is None:  # load_lab refused it already; a spec built by hand may not have been loaded
        raise UsageError(f"image {image.name}: {image.catalog!r} is not in the image catalog")
    return entry


# --- resolving --------------------------------------------------------------------------------------


def resolve(image: Image) -> Pin:
    """Read the checksum file of the image's build, check its signature, and return the image's URL
    and digest. NotFound-style failures name the build; BadSignature (exit 3) when the signature
    fails."""
    from vmlaunch.guests import images

    entry = entry_of(image)
    version = image.version or entry.version
    try:
        url, checksum_url = entry.locations(version)
    except KeyError:
        raise UsageError(f"image {image.name}: {entry.name} has no {catalog.host_arch()} build") from None
    source = fetched(checksum_url)
    what = f"image {image.name} ({entry.name}" + (f", version {image.version})" if image.version else ")")
    try:
        data = images.fetch_small(source, CHECKSUM_LIMIT)
    except images.NotFound:
        raise RuntimeFailure(
            f"{what}: {'the mirror' if mirror() else 'the distribution'} has no build "
            f"{version!r} of {entry.name}: no checksum file at {source}",
            (f"check version (a build such as {entry.example_version!r}, as the distribution names it), "
             "or leave it out for the entry's own build" if version != entry.version else
             f"check {MIRROR_SETTING}" if mirror() else "the distribution may have moved it: a newer "
             "vmlaunch knows where")) from None
    text, signature = _checked(entry, what, source, data)
    filename = url.rsplit("/", 1)[-1]
    found = digest_for(text, filename, source, own=checksum_url.startswith(url))
    if found is None:
        raise RuntimeFailure(f"{what}: the checksum file {source} has no line for {filename}",
                             "the build may not hold this image: check version, or the mirror's copy of "
                             "the checksum file")
    algo, digest = found
    log.info("%s: %s %s resolved: %s (%s %s…); signature %s", image.name, entry.name, version, url, algo,
             digest[:16], signature)
    return Pin(catalog=entry.name, version=version, url=url, checksum_url=checksum_url, algo=algo,
               digest=digest, signature=signature,
               pinned=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def digest_for(text: str, filename: str, where: str = "the checksum file", *,
               own: bool = False) -> tuple[str, str] | None:
    """(algo, lower-case hex) of `filename` in a checksum file: GNU (`HEX  NAME`, `HEX *NAME`) or BSD
    (`SHA256 (NAME) = HEX`) lines, the strongest algorithm given; None when it has no line for it.
    `own`: the file is the image's own (IMAGE.sha512 beside it): a digest alone on its line is the
    image's, and so is the one digest it gives under another name (a dated build's name, where the
    image's URL names the moving one). Two different digests of one algorithm for the file are
    refused: which would be right?"""
    named: dict[str, set[str]] = {}
    anyhow: dict[str, set[str]] = {}  # every digest of the file, whatever it names
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        gnu, bsd = _GNU_LINE.fullmatch(line), _BSD_LINE.fullmatch(line)
        if gnu is not None:
            hexdigest, name, algo = gnu[1], gnu[2], _HEX[len(gnu[1])]
        elif bsd is not None:
            algo, name, hexdigest = bsd[1].lower(), bsd[2], bsd[3]
            if _HEX.get(len(hexdigest)) != algo:
                continue
        elif own and len(line) in _HEX and re.fullmatch(r"[0-9A-Fa-f]+", line):
            hexdigest, name, algo = line, filename, _HEX[len(line)]
        else:
            continue
        anyhow.setdefault(algo, set()).add(hexdigest.lower())
        if _names(name.strip(), filename):
            named.setdefault(algo, set()).add(hexdigest.lower())
    found = named if named or not own else anyhow
    for algo in ("sha512", "sha256"):
        digests = found.get(algo)
        if digests is None:
            continue
        if len(digests) > 1:
            raise RuntimeFailure(f"{where} gives {filename} {len(digests)} different {algo} digests",
                                 "the file is damaged or was tampered with: the image is not used")
        return algo, digests.pop()
    return None


def _names(name: str, filename: str) -> bool:
    """Whether a checksum line's file name is the image's: the name itself, `./NAME` or `DIR/NAME`."""
    return name == filename or name.endswith("/" + filename)


# --- signatures -------------------------------------------------------------------------------------


def _checked(entry: catalog.Entry, what: str, source: str, data: bytes) -> tuple[str, str]:
    """The checksum file's text to read digests from (a clearsigned file: only what the signature
    covers) and what became of its signature. BadSignature when it does not verify."""
    text = data.decode("utf-8", "replace")
    if entry.signature is None:
        return text, f"none: {entry.title.split(',')[0]} does not sign its checksum files"
    if entry.signed_inline and _CLEARSIGN_START not in text:
        _skipped(what, f"{source} is not signed", missing=True)
        return text, "skipped: the checksum file was not signed"
    gpgv = shutil.which("gpgv")
    keyring = _keyring(entry)
    why = ("gpgv is not installed (Debian package gpgv)" if gpgv is None else
           f"no keyring ({' or '.join(entry.keyring) or 'none known'}"
           + (f"; {entry.keyring_package} brings it)" if entry.keyring_package else ")") if keyring is None
           else None)
    if entry.signed_inline:
        if why is not None:
            _skipped(what, why)
            return _clearsigned_text(text), f"skipped: {why}"
        assert gpgv is not None and keyring is not None
        return _verify(gpgv, keyring, what, source, data, None), f"verified with {keyring}"
    signature_url = entry.signature_url(source)
    assert signature_url is not None
    if why is not None:
        _skipped(what, why)
        return text, f"skipped: {why}"
    from vmlaunch.guests import images

    try:
        signature = images.fetch_small(signature_url, SIGNATURE_LIMIT)
    except images.NotFound:
        _skipped(what, f"there is no signature at {signature_url}", missing=True)
        return text, f"skipped: no {signature_url.rsplit('/', 1)[-1]} was published beside the checksum file"
    assert gpgv is not None and keyring is not None
    _verify(gpgv, keyring, what, source, data, signature)
    return text, f"verified with {keyring}"


def _skipped(what: str, why: str, *, missing: bool = False) -> None:
    """Say plainly that a signed entry's signature was not checked, or refuse the image where that is
    asked for: VMLAUNCH_REQUIRE_SIGNATURE, or (for a signature the mirror does not have) a keyring of
    the mirror's own, VMLAUNCH_IMAGE_KEYRING, which says that the mirror signs."""
    required = os.environ.get(REQUIRE_SETTING, "").strip().lower() in ("1", "yes", "true", "on")
    if required or (missing and os.environ.get(KEYRING_SETTING, "").strip()):
        because = REQUIRE_SETTING if required else f"{KEYRING_SETTING} (the mirror signs)"
        raise BadSignature(f"{what}: the checksum file's signature cannot be checked: {why}; with "
                           f"{because} the image is not used",
                           "fetch from a mirror that has the signature, or install what the check needs")
    log.warning("%s: the checksum file's signature was NOT checked: %s", what, why)


def _keyring(entry: catalog.Entry) -> str | None:
    given = os.environ.get(KEYRING_SETTING, "").strip()
    if given:
        if not os.path.isfile(given):
            raise UsageError(f"{KEYRING_SETTING}={given!r} is not a file", "name a keyring file, or unset it")
        return given
    return next((path for path in entry.keyring if os.path.isfile(path)), None)


def _verify(gpgv: str, keyring: str, what: str, source: str, data: bytes, signature: bytes | None) -> str:
    """Run gpgv on the checksum file (and its detached signature); the signed text. BadSignature
    unless gpgv says the signature is good (a bad one, an unknown key, no signature at all)."""
    with tempfile.TemporaryDirectory(prefix="vmlaunch-gpgv-") as temp:
        folder = Path(temp)
        signed = folder / "checksums"
        signed.write_bytes(data)
        ring = folder / "keyring.gpg"
        try:
            keys = read_bounded(Path(keyring), KEYRING_LIMIT)
        except OSError as exc:
            raise RuntimeFailure(f"{what}: cannot read keyring {keyring}: {exc.strerror or exc}") from None
        ring.write_bytes(_dearmored(keys))
        output = folder / "signed-text"
        argv = [gpgv, "--homedir", str(folder), "--status-fd", "1", "--keyring", str(ring)]
        if signature is not None:
            (folder / "checksums.sig").write_bytes(signature)
            argv += [str(folder / "checksums.sig"), str(signed)]
        else:
            argv += ["--output", str(output), str(signed)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=GPGV_TIMEOUT,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeFailure(f"{what}: running gpgv failed: {exc}") from None
        status = done.stdout
        if done.returncode != 0 or "[GNUPG:] GOODSIG" not in status or "[GNUPG:] BADSIG" in status:
            said = _gpgv_said(status, done.stderr)
            raise BadSignature(
                f"{what}: the signature of {source} does not verify with {keyring}: {said}; the image "
                "is not used",
                "the checksum file or its signature was changed on the way (or on the mirror): fetch from "
                "another mirror; a mirror that signs with its own key: " + KEYRING_SETTING + "=ITS-KEYRING")
        return output.read_text("utf-8", "replace") if signature is None else data.decode("utf-8", "replace")


def _gpgv_said(status: str, stderr: str) -> str:
    for word, meaning in (("BADSIG", "a bad signature"), ("NO_PUBKEY", "signed by a key not in the keyring"),
                          ("EXPKEYSIG", "signed by an expired key"), ("REVKEYSIG", "signed by a revoked key"),
                          ("NODATA", "no signature in it")):
        if f"[GNUPG:] {word}" in status:
            return meaning
    line = next((text for text in reversed(stderr.splitlines()) if text.strip()), "").strip()
    line = line.removeprefix("gpgv:").strip()
    return f"gpgv: {line}" if line else "gpgv refused it"


def _dearmored(key: bytes) -> bytes:
    """A binary keyring from an ASCII-armoured key file (the form distributions publish keys in);
    binary keyrings as they are. gpgv reads binary keyrings only."""
    import base64

    text = key.decode("ascii", "replace")
    if "-----BEGIN PGP PUBLIC KEY BLOCK-----" not in text:
        return key
    blocks = re.findall(r"-----BEGIN PGP PUBLIC KEY BLOCK-----\r?\n(.*?)-----END PGP PUBLIC KEY BLOCK-----",
                        text, re.S)
    out = bytearray()
    for block in blocks:
        body = block.split("\n\n", 1)[-1] if re.match(r"[A-Za-z]+: ", block) else block
        lines = [line.strip() for line in body.splitlines() if line.strip() and not line.startswith("=")]
        with contextlib.suppress(ValueError):
            out += base64.b64decode("".join(lines))
    return bytes(out)


def _clearsigned_text(text: str) -> str:
    """The message of a clearsigned file (its signature unchecked): between the armour header's blank
    line and the signature, dash-escaping undone; the whole text when it is not clearsigned."""
    start = text.find(_CLEARSIGN_START)
    end = text.find(_SIGNATURE_START)
    if start < 0 or end < start:
        return text
    body = text[start:end].split("\n\n", 1)[-1] if "\n\n" in text[start:end] else ""
    return "\n".join(line[2:] if line.startswith("- ") else line for line in body.splitlines())


# --- the lock file ----------------------------------------------------------------------------------


def read_lock(path: Path) -> dict[str, Pin]:
    """The pins of a lock file (none when there is none); SpecError naming its line when it is not
    what vmlaunch writes."""
    from vmlaunch.core.sourcemap import SourceMap
    from vmlaunch.spec.load import _parse_toml

    hint = ("vmlaunch writes this file: `vmlaunch image pull --update SPEC` writes it anew (or delete it, "
            "and pull)")
    try:
        data = read_bounded(path, MAX_LOCK_BYTES)  # a user's file beside the spec: a symlink may be
        text = data.decode("utf-8")
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError([Problem(Location(path, line), "is not UTF-8 text", hint)]) from None
    except Unfit as exc:
        unfit = Problem(Location(path, 1), f"cannot read the lock file: {exc.what}",
                        "vmlaunch writes it as a regular file: remove what stands there, and pull")
        raise SpecError([unfit]) from None
    except OSError as exc:
        raise RuntimeFailure(f"cannot read the lock file {path}: {exc.strerror or exc}") from None
    doc = _parse_toml(text, path)
    lines = SourceMap.from_text(text)
    problems: list[Problem] = []

    def wrong(key: tuple[str, ...], message: str) -> None:
        problems.append(Problem(Location(path, lines.line_of(key), key), message, hint))

    version = doc.get("lock_version")
    if type(version) is not int or version != LOCK_FORMAT:
        wrong(("lock_version",), f"lock_version must be {LOCK_FORMAT}")
    pins: dict[str, Pin] = {}
    extra = set(doc) - {"lock_version", "image"}
    for key in sorted(extra):
        wrong((key,), "is not a key of a lock file")
    table = doc.get("image", {})
    if not isinstance(table, dict):
        wrong(("image",), "must be a table of images")
        table = {}
    for name, raw in table.items():
        pin = _pin_of(name, raw, wrong)
        if pin is not None:
            pins[name] = pin
    if problems:
        raise SpecError(problems)
    return pins


def _pin_of(name: str, raw: Any, wrong: Any) -> Pin | None:
    where = ("image", name)
    if not isinstance(raw, dict):
        wrong(where, "must be a table")
        return None
    ok = True
    for key in _PIN_KEYS:
        if not isinstance(raw.get(key), str):
            wrong((*where, key), "is missing" if key not in raw else "must be a string")
            ok = False
    for key in ("url", "checksum_url"):
        value = raw.get(key)
        if isinstance(value, str) and (re.fullmatch(r"https?://[!-~]+", value) is None):
            wrong((*where, key), f"{value[:80]!r} is not an http(s) URL")
            ok = False
    digests = [(algo, raw[algo]) for algo in ("sha512", "sha256") if algo in raw]
    if len(digests) != 1:
        wrong(where, "must give one digest: sha512 or sha256")
        return None
    algo, digest = digests[0]
    digits = 128 if algo == "sha512" else 64
    if not isinstance(digest, str) or re.fullmatch(f"[0-9a-f]{{{digits}}}", digest) is None:
        wrong((*where, algo), f"must be {digits} lower-case hex digits")
        ok = False
    extra = set(raw) - {*_PIN_KEYS, "sha512", "sha256"}
    for key in sorted(extra):
        wrong((*where, key), "is not a key of a pinned image")
        ok = False
    if not ok:
        return None
    entry = catalog.entries().get(raw["catalog"])
    if entry is None:
        wrong((*where, "catalog"), f"{raw['catalog'][:80]!r} is not in the image catalog")
        return None
    try:
        expected = entry.locations(raw["version"])
    except KeyError:
        wrong((*where, "catalog"), f"{entry.name} has no {catalog.host_arch()} build")
        return None
    for key, want in zip(("url", "checksum_url"), expected):
        if raw[key] != want:  # a lock names the distribution's own place for the build, nothing else
            wrong((*where, key), f"is not where {entry.name} publishes build {raw['version']!r} ({want})")
            ok = False
    if not ok:
        return None
    return Pin(algo=algo, digest=digest, **{key: raw[key] for key in _PIN_KEYS})


def write_lock(path: Path, pins: Mapping[str, Pin], spec_name: str) -> None:
    text = (f"# {path.name}: the catalog images of {spec_name}, pinned by vmlaunch (`image pull`, `up`) so "
            "that every pull\n# fetches the same bytes. `vmlaunch image pull --update "
            f"{spec_name}` moves the pins on. Keep it with the spec.\n"
            f"lock_version = {LOCK_FORMAT}\n")
    for name in sorted(pins):
        text += "\n" + pins[name].to_toml(name)
    try:
        write_new(path, text, 0o644)
    except Unfit as exc:
        raise OutputRefused.of(exc) from None


@contextlib.contextmanager
def _holding_lock_of(path: Path) -> Iterator[None]:
    """One vmlaunch at a time reads and writes a lock file (the VMs of one `up` pin in parallel)."""
    from vmlaunch.guests import images

    key = hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:24]
    with images.holding(f"lockfile-{key}", path.name):
        yield


# --- pinning ----------------------------------------------------------------------------------------


def pin(image: Image, *, update: bool = False) -> tuple[Pin, bool]:
    """The image's pin and whether it is new: the lock file's when it has one for this image (the same
    catalog entry and build), else resolved now. A new pin is written to the lock file by `record`
    once the image matches it (`ensure`). `update` resolves anew whatever the lock file says (and
    does not read a lock file that cannot be read)."""
    assert image.lock is not None
    entry = entry_of(image)
    with _holding_lock_of(image.lock):
        try:
            pins = read_lock(image.lock)
        except SpecError:
            if not update:
                raise
            pins = {}
    held = pins.get(image.name)
    if held is not None and not update and held.catalog == image.catalog and \
            held.version == (image.version or entry.version):
        return held, False
    fresh = resolve(image)
    if held is not None and (held.algo, held.digest) != (fresh.algo, fresh.digest):
        log.info("%s: the pin moves from %s %s… to %s…", image.name, held.algo, held.digest[:16],
                 fresh.digest[:16])
    return fresh, True


def record(image: Image, fresh: Pin) -> None:
    """Write a new pin into the lock file (a lock file that cannot be read is written anew: only
    `--update` gets here with one)."""
    assert image.lock is not None
    with _holding_lock_of(image.lock):
        try:
            pins = read_lock(image.lock)
        except SpecError:
            log.warning("%s could not be read: writing it anew", image.lock)
            pins = {}
        pins[image.name] = fresh
        write_lock(image.lock, pins, spec_of_lock(image.lock).name)
    log.info("%s: pinned in %s", image.name, image.lock)


def concrete(image: Image, held: Pin) -> Image:
    """`image` as a URL image with the pin's digest: what `images.ensure` fetches and checks."""
    url = fetched(held.url)
    if held.algo == "sha512":
        return attrs.evolve(image, url=url, sha512=held.digest, sha256=None)
    return attrs.evolve(image, url=url, sha256=held.digest, sha512=None)


def ensure(image: Image, *, update: bool = False, progress: bool | None = None) -> Path:
    """The verified local file of any image (`images.ensure`); a catalog image is pinned first (the
    lock file's pin, or resolved now; `update`: resolved anew), then fetched and checked as a URL
    image of that digest. A new pin reaches the lock file only once the image matched it."""
    from vmlaunch.guests import images

    if image.catalog is None or image.url is not None:
        return images.ensure(image, progress=progress)
    held, fresh = pin(image, update=update)
    target = concrete(image, held)
    try:
        path = images.ensure(target, progress=progress)
    except RuntimeFailure as exc:
        raise (_disagrees(target, held, exc) if fresh else failed_pull(target, exc)) from None
    if fresh:
        record(image, held)
    return path


def prune(lock: Path, names: set[str]) -> None:
    """Drop the pins of images the spec no longer has."""
    with _holding_lock_of(lock):
        pins = read_lock(lock)
        if set(pins) - names:
            kept = {name: pin for name, pin in pins.items() if name in names}
            write_lock(lock, kept, spec_of_lock(lock).name)


def failed_pull(image: Image, exc: VmlaunchError) -> VmlaunchError:
    """What to say when the pinned image cannot be fetched or does not match: the lock names bytes
    the mirror no longer has."""
    from vmlaunch.guests import images

    assert image.lock is not None
    spec = str(spec_of_lock(image.lock))
    if isinstance(exc, images.NotFound):
        return RuntimeFailure(
            f"image {image.name} ({image.catalog}): {'the mirror' if mirror() else 'the distribution'} no "
            f"longer has the build {image.lock.name} pins ({image.url}): {exc.message}",
            f"`vmlaunch image pull --update {spec}` pins the build it has now")
    if isinstance(exc, images.ChecksumMismatch):
        return RuntimeFailure(
            f"image {image.name} ({image.catalog}): what {image.url} serves now is not the image "
            f"{image.lock.name} pins (the download was deleted): the build there has moved on, or the file "
            "was damaged or changed on the way",
            f"`vmlaunch image pull --update {spec}` pins the build there now, once you trust it")
    return exc


def _disagrees(image: Image, fresh: Pin, exc: VmlaunchError) -> VmlaunchError:
    """What to say when a build just resolved cannot be fetched or does not match its checksum file:
    nothing was pinned."""
    from vmlaunch.guests import images

    source = fetched(fresh.checksum_url)
    if isinstance(exc, images.NotFound):
        return RuntimeFailure(
            f"image {image.name} ({image.catalog}): the checksum file {source} lists "
            f"{fresh.url.rsplit('/', 1)[-1]}, but there is no such image at {image.url}: nothing was pinned",
            "the mirror is incomplete or being updated: pull again later, or from another mirror")
    if isinstance(exc, images.ChecksumMismatch):
        return RuntimeFailure(
            f"image {image.name} ({image.catalog}): {image.url} does not match the {fresh.algo} its "
            f"checksum file gives ({source}): the image or the checksum file was damaged or changed; the "
            "download was deleted and nothing was pinned",
            "pull again (from another mirror, if it happens again)")
    return exc
