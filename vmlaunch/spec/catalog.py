"""The image catalog (`catalog.toml` beside this file): cloud images of distributions by name, as
`[image.NAME] catalog = "debian-12"` names them.

Pure: the entries, where each build of an entry is (its image and its checksum file, before any
mirror), the mirror rule, and the closest names for a name that is not there. Fetching, checking and
pinning what an entry points to is `guests/catalog_images.py`'s work, at `image pull` and `up`.
"""

from __future__ import annotations

import difflib
import functools
import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from vmlaunch.errors import UsageError

DATA = Path(__file__).with_name("catalog.toml")
ARCHES = ("x86_64", "aarch64")
_ENTRY_KEYS = {"title", "version", "url", "checksum", "dated_url", "dated_checksum", "format", "signature",
               "keyring", "keyring_package", "firmware", "cpu_model", "cpu_level", "example_version", *ARCHES}
# A build's name as a spec or the command line gives it: it becomes part of a URL's path, so no '/'.
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,63}")
SIGNATURE_INLINE = "inline"
# CPU models too old for an image that needs x86-64-v2 or later (QEMU's base models)
BASE_CPU_MODELS = frozenset({"qemu64", "qemu32", "kvm64", "kvm32", "base", "486", "pentium", "pentium2",
                             "pentium3", "coreduo", "core2duo", "athlon", "phenom", "n270"})


class CatalogDataError(Exception):
    """catalog.toml itself is wrong: a bug in vmlaunch, caught by its tests."""


@attrs.frozen
class Build:
    """Where one architecture's image of an entry is, and its checksum file; `{version}` in each."""

    url: str
    checksum: str
    dated_url: str | None = None  # a named build (`version`), when its place differs from the default's
    dated_checksum: str | None = None


@attrs.frozen
class Entry:
    name: str
    title: str
    version: str  # the build taken when the spec names none
    builds: Mapping[str, Build]  # architecture -> where
    format: str | None = None  # "qcow2" when the image's name does not say it
    signature: str | None = None  # ".sign" (a suffix of the checksum file's URL) or "inline"
    keyring: tuple[str, ...] = ()
    keyring_package: str | None = None
    firmware: str | None = None  # "uefi": the image boots only with UEFI
    cpu_model: str | None = None  # "max": the image needs more than QEMU's base CPU models
    cpu_level: str | None = None  # "x86-64-v3", said with cpu_model
    example_version: str | None = None

    def locations(self, version: str | None = None, arch: str | None = None) -> tuple[str, str]:
        """(image URL, checksum file URL) of a build, before any mirror; KeyError for an architecture
        the entry has no build of."""
        build = self.builds[arch or host_arch()]
        if version is None or version == self.version:
            version = self.version
            url, checksum = build.url, build.checksum
        else:
            url, checksum = build.dated_url or build.url, build.dated_checksum or build.checksum
        minor = version.split("-", 1)[0]
        return (url.replace("{version}", version).replace("{minor}", minor),
                checksum.replace("{version}", version).replace("{minor}", minor))

    def signature_url(self, checksum_url: str) -> str | None:
        """Where the detached signature of the checksum file is; None when the distribution publishes
        none, or signs the checksum file itself (`signed_inline`)."""
        if self.signature is None or self.signed_inline:
            return None
        return checksum_url + self.signature

    @property
    def signed_inline(self) -> bool:
        return self.signature == SIGNATURE_INLINE

    @property
    def needs(self) -> str:
        """What the image needs of the VM, in words ("" when nothing)."""
        said = []
        if self.firmware:
            said.append(f'firmware = "{self.firmware}"')
        if self.cpu_model:
            level = f" ({self.cpu_level})" if self.cpu_level else ""
            said.append(f'cpu_model = "{self.cpu_model}"{level}')
        elif self.cpu_level:
            said.append(f"{self.cpu_level} (the default CPU)")
        return ", ".join(said)

    def to_json(self, url: str, checksum_url: str) -> dict[str, Any]:
        signature_url = checksum_url if self.signed_inline else self.signature_url(checksum_url)
        return {"title": self.title, "version": self.version, "arch": host_arch(), "url": url,
                "checksum_url": checksum_url, "signature_url": signature_url,
                "format": self.format or _suffix_format(url), "signed": self.signature is not None,
                "firmware": self.firmware or "bios", "cpu_model": self.cpu_model, "cpu_level": self.cpu_level,
                "arches": sorted(self.builds),
                "dated_builds": any(build.dated_url for build in self.builds.values())}


def host_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


@functools.lru_cache(maxsize=1)
def entries() -> Mapping[str, Entry]:
    """Every entry by name, in the file's order."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.9/3.10 only
        import tomli as tomllib

    return parse(tomllib.loads(DATA.read_text(encoding="utf-8")))


def parse(doc: Mapping[str, Any]) -> dict[str, Entry]:
    found: dict[str, Entry] = {}
    for name, raw in doc.items():
        if not isinstance(raw, dict):
            raise CatalogDataError(f"{name}: not a table")
        builds = {"x86_64": _build(name, raw)}
        for arch in ARCHES[1:]:
            if arch in raw:
                builds[arch] = _build(f"{name}.{arch}", {**_inherited(raw), **raw[arch]})
        extra = set(raw) - _ENTRY_KEYS
        if extra:
            raise CatalogDataError(f"{name}: unknown keys {sorted(extra)}")
        if VERSION.fullmatch(str(raw.get("version", ""))) is None:
            raise CatalogDataError(f"{name}: version {raw.get('version')!r}")
        found[name] = Entry(
            name=name, title=str(raw["title"]), version=str(raw["version"]), builds=builds,
            format=raw.get("format"), signature=raw.get("signature"), keyring=tuple(raw.get("keyring", ())),
            keyring_package=raw.get("keyring_package"), firmware=raw.get("firmware"),
            cpu_model=raw.get("cpu_model"), cpu_level=raw.get("cpu_level"),
            example_version=raw.get("example_version"))
    return found


def _inherited(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What an architecture's table takes from its entry: the checksum file when only the image moves."""
    return {key: raw[key] for key in ("checksum", "dated_checksum") if key in raw}


def _build(where: str, raw: Mapping[str, Any]) -> Build:
    for key in ("url", "checksum", "dated_url", "dated_checksum"):
        value = raw.get(key)
        if value is None:
            if key in ("url", "checksum"):
                raise CatalogDataError(f"{where}: no {key}")
            continue
        placeholders = set(re.findall(r"\{[^}]*\}", value))
        if not str(value).startswith("https://") or placeholders - {"{version}", "{minor}"}:
            raise CatalogDataError(f"{where}.{key}: {value!r}")
    return Build(url=raw["url"], checksum=raw["checksum"], dated_url=raw.get("dated_url"),
                 dated_checksum=raw.get("dated_checksum"))


def closest(name: str) -> list[str]:
    """The catalog names most like `name`, best first (at most three)."""
    names = list(entries())
    found = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if not found:  # "ubuntu" -> every ubuntu-*: a prefix says more than a spelling distance
        stem = name.split("-")[0]
        found = [known for known in names if known.startswith(stem)][:3]
    return found


def apply_mirror(url: str, mirror: str | None) -> str:
    """`url` with its scheme and host replaced by the mirror's, its path kept (after the mirror's own
    path, when it has one): a mirror has the distribution's layout."""
    if not mirror:
        return url
    from urllib.parse import urlsplit, urlunsplit

    parts, base = urlsplit(url), urlsplit(mirror)
    return urlunsplit((base.scheme, base.netloc, base.path.rstrip("/") + parts.path, parts.query, ""))


def check_mirror(mirror: str) -> str | None:
    """Why `mirror` cannot be a mirror's URL (None when it can)."""
    from urllib.parse import urlsplit

    if any(ord(char) <= 32 or ord(char) == 127 for char in mirror):
        return "holds a space or a control character"
    try:
        parts = urlsplit(mirror)
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https", "file"):
        return "is not an http://, https:// or file:// URL"
    if parts.scheme != "file" and not parts.hostname:
        return "names no host"
    if parts.query or parts.fragment:
        return "has a query or fragment: a mirror is a scheme, a host and at most a path"
    if parts.username is not None or parts.password is not None:
        return "holds a user name or password: a mirror is a scheme, a host and at most a path"
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        return "has a port that is not a number from 0 to 65535"
    return None


def _suffix_format(url: str) -> str | None:
    return "qcow2" if url.endswith(".qcow2") else "raw" if url.endswith(".raw") else None


MIRROR_SETTING = "VMLAUNCH_IMAGE_MIRROR"  # a mirror of the distributions' trees, for every pull


def mirror() -> str | None:
    """VMLAUNCH_IMAGE_MIRROR, checked; None when unset."""
    value = os.environ.get(MIRROR_SETTING, "").strip()
    if not value:
        return None
    why = check_mirror(value)
    if why is not None:
        shown = "(a URL with a user name or password)" if "@" in value else repr(value)
        raise UsageError(f"{MIRROR_SETTING}={shown} {why}",
                         f"e.g. {MIRROR_SETTING}=http://127.0.0.1:8080 (a server with the distributions' "
                         "layout), or unset it")
    return value
