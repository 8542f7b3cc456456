"""The image catalog against a local mirror (never the internet): every entry resolves against a
tree shaped like its distribution's, the lock pins and `--update` moves it, tampered images and
checksum files are refused, signatures are checked with a key of the tests' own."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.catalog_mirror import Mirror, Signer, algo_of, catalog_json, checksum_text, environ, tiny_qcow2
from tests.conftest import ROOT, netns_argv
from vmlaunch.guests import catalog_images
from vmlaunch.spec import catalog

pytestmark = pytest.mark.skipif(subprocess.run(["which", "qemu-img"], capture_output=True).returncode != 0,
                                reason="qemu-img (make setup) makes the images")


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mirror]:
    served = Mirror(tmp_path_factory.mktemp("mirror"))
    yield served
    served.close()


@pytest.fixture(scope="module")
def signer() -> Iterator[Signer]:
    made = Signer()
    yield made
    made.close()


@pytest.fixture
def env(mirror: Mirror, tmp_path: Path) -> dict[str, str]:
    base = environ()
    base.pop("VMLAUNCH_IMAGE_KEYRING", None)
    return {**base, "VMLAUNCH_IMAGE_MIRROR": mirror.base, "VMLAUNCH_CACHE_DIR": str(tmp_path / "cache"),
            "PYTHONPATH": str(ROOT)}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], env=env, capture_output=True, text=True,
                          check=False, cwd=ROOT)


def spec(folder: Path, images: dict[str, str], extra: str = "") -> Path:
    text = '[lab]\nname = "cat"\n'
    for name, entry in images.items():
        text += f'\n[image.{name}]\ncatalog = "{entry}"\n{extra}'
    text += f'\n[vm.a]\nmemory = 256\nimage = "{next(iter(images))}"\n'
    path = folder / "lab.toml"
    path.write_text(text)
    return path


def publish(mirror: Mirror, entry: dict[str, Any], name: str, image: bytes, *, signer: Signer | None = None,
            others: dict[str, bytes] | None = None) -> None:
    """Lay `image` at the entry's URL and a checksum file (with the image's line among others) at its
    checksum URL, in its distribution's style; signed with `signer` where the entry is signed."""
    url, checksum_url = str(entry["url"]), str(entry["checksum_url"])
    mirror.put(url, image)
    files = {"unrelated-image.qcow2": b"other", **(others or {}), url.rsplit("/", 1)[-1]: image}
    text = checksum_text(name, files, algo_of(checksum_url))
    signature_url = entry.get("signature_url")
    if signer is not None and signature_url == checksum_url:
        mirror.put(checksum_url, signer.clearsigned(text))
        return
    mirror.put(checksum_url, text.encode())
    if signature_url and signature_url != checksum_url:
        if signer is not None:
            mirror.put(str(signature_url), signer.detached(text.encode()))
        else:
            mirror.remove(str(signature_url))


def lock_of(path: Path) -> dict[str, catalog_images.Pin]:
    return catalog_images.read_lock(path.with_name(path.name + ".lock"))


def test_every_entry_resolves_against_a_tree_shaped_like_its_distribution(
        mirror: Mirror, env: dict[str, str], tmp_path: Path) -> None:
    entries = catalog_json(env)
    wanted = {"debian-12", "debian-13", "ubuntu-22.04", "ubuntu-24.04", "almalinux-9", "rocky-9", "arch"}
    assert wanted <= set(entries)
    assert any(name.startswith("fedora-") for name in entries)
    assert any(name.startswith("opensuse-leap") for name in entries)
    assert any(name.startswith("alpine-") for name in entries)
    names = {}
    for index, (name, entry) in enumerate(entries.items()):
        assert str(entry["url"]).startswith(mirror.base + "/")
        image = tiny_qcow2(tmp_path, name)
        publish(mirror, entry, name, image)
        names[f"i{index}"] = (name, hashlib.sha256(image).hexdigest())
    lab = spec(tmp_path, {key: name for key, (name, _) in names.items()})
    done = run(env, "image", "pull", str(lab))
    assert done.returncode == 0, done.stderr
    pins = lock_of(lab)
    for key, (name, sha256) in names.items():
        pin = pins[key]
        assert pin.catalog == name
        assert not pin.url.startswith(mirror.base)  # the distribution's own URL is pinned
        if pin.algo == "sha256":
            assert pin.digest == sha256
    assert "NOT checked" in done.stderr or "none:" in Path(str(lab) + ".lock").read_text()


def test_the_lock_pins_and_update_moves_it(mirror: Mirror, env: dict[str, str], tmp_path: Path) -> None:
    entry = catalog_json(env)["arch"]
    first, second = tiny_qcow2(tmp_path, "arch-1"), tiny_qcow2(tmp_path, "arch-2")
    publish(mirror, entry, "arch", first)
    lab = spec(tmp_path, {"arch": "arch"})
    assert run(env, "image", "pull", str(lab)).returncode == 0
    pinned = lock_of(lab)["arch"].digest
    assert pinned == hashlib.sha256(first).hexdigest()

    publish(mirror, entry, "arch", second)  # the distribution's "latest" moves on
    again = run(env, "image", "pull", str(lab))
    assert again.returncode == 0, again.stderr  # in the cache: the pinned bytes, no download
    assert lock_of(lab)["arch"].digest == pinned

    other_cache = {**env, "VMLAUNCH_CACHE_DIR": str(tmp_path / "cache2")}  # another machine, same lock
    moved = run(other_cache, "image", "pull", str(lab))
    assert moved.returncode == 4
    assert "pull --update" in moved.stderr and "not the image" in moved.stderr

    updated = run(other_cache, "image", "pull", "--update", str(lab))
    assert updated.returncode == 0, updated.stderr
    assert lock_of(lab)["arch"].digest == hashlib.sha256(second).hexdigest()

    mirror.remove(str(entry["url"]))  # the mirror no longer has the pinned build
    gone = run({**env, "VMLAUNCH_CACHE_DIR": str(tmp_path / "cache3")}, "image", "pull", str(lab))
    assert gone.returncode == 4
    assert "no longer has" in gone.stderr and "--update" in gone.stderr


def test_a_dated_build_and_one_the_mirror_lacks(mirror: Mirror, env: dict[str, str], tmp_path: Path) -> None:
    entry = catalog.entries()["debian-12"]
    url, checksum_url = (catalog.apply_mirror(u, mirror.base) for u in entry.locations("20990101-0001"))
    assert "/20990101-0001/" in url and url.endswith("-20990101-0001.qcow2")
    image = tiny_qcow2(tmp_path, "dated")
    publish(mirror, {"url": url, "checksum_url": checksum_url}, "debian-12", image)
    lab = spec(tmp_path, {"deb": "debian-12"}, 'version = "20990101-0001"\n')
    done = run(env, "image", "pull", str(lab))
    assert done.returncode == 0, done.stderr
    assert lock_of(lab)["deb"].version == "20990101-0001"

    lab = spec(tmp_path, {"deb": "debian-12"}, 'version = "19990101-0000"\n')
    missing = run(env, "image", "pull", str(lab))
    assert missing.returncode == 4
    assert "no build '19990101-0000' of debian-12" in missing.stderr


def test_a_checksum_file_without_the_image_and_a_tampered_image(
        mirror: Mirror, env: dict[str, str], tmp_path: Path) -> None:
    entry = catalog_json(env)["ubuntu-24.04"]
    image = tiny_qcow2(tmp_path, "noble")
    mirror.put(str(entry["url"]), image)
    text = checksum_text("ubuntu-24.04", {"other.img": image}, "sha256")
    mirror.put(str(entry["checksum_url"]), text.encode())
    lab = spec(tmp_path, {"noble": "ubuntu-24.04"})
    done = run(env, "image", "pull", str(lab))
    assert done.returncode == 4
    assert "has no line for" in done.stderr

    publish(mirror, entry, "ubuntu-24.04", image)
    mirror.put(str(entry["url"]), image + b"tampered")
    tampered = run(env, "image", "pull", str(lab))
    assert tampered.returncode == 4
    assert "does not match" in tampered.stderr or "not the image" in tampered.stderr
    assert not list((tmp_path / "cache" / "images").glob("*.img"))


@pytest.mark.parametrize("name", ["debian-12", "ubuntu-24.04", "fedora-43"])
def test_signed_checksum_files(mirror: Mirror, env: dict[str, str], signer: Signer, tmp_path: Path,
                               name: str) -> None:
    entry = catalog_json(env)[name]
    keyed = {**env, "VMLAUNCH_IMAGE_KEYRING": str(signer.keyring)}
    image = tiny_qcow2(tmp_path, f"signed-{name}")
    publish(mirror, entry, name, image, signer=signer)
    lab = spec(tmp_path, {"img": name})
    done = run(keyed, "image", "pull", str(lab))
    assert done.returncode == 0, done.stderr
    assert lock_of(lab)["img"].signature.startswith("verified")

    # the checksum file changed after it was signed (another image's digest put in): refused, exit 3
    other = tiny_qcow2(tmp_path, f"evil-{name}")
    filename = str(entry["url"]).rsplit("/", 1)[-1]
    text = checksum_text(name, {filename: other}, algo_of(str(entry["checksum_url"])))
    signed = mirror.path_of(str(entry["checksum_url"])).read_bytes()
    if entry["signature_url"] == entry["checksum_url"]:  # clearsigned: change the signed text itself
        body = signed.decode()
        head, _, rest = body.partition("\n\n")
        _, _, tail = rest.partition("-----BEGIN PGP SIGNATURE-----")
        changed = f"{head}\n\n{text}-----BEGIN PGP SIGNATURE-----{tail}"
        mirror.put(str(entry["checksum_url"]), changed.encode())
    else:
        mirror.put(str(entry["checksum_url"]), text.encode())
    mirror.put(str(entry["url"]), other)
    bad = run(keyed, "image", "pull", "--update", str(lab))
    assert bad.returncode == 3, bad.stderr
    assert "does not verify" in bad.stderr and "not used" in bad.stderr
    assert lock_of(lab)["img"].digest != hashlib.new(lock_of(lab)["img"].algo, other).hexdigest()


def test_a_signature_by_another_key_is_refused(mirror: Mirror, env: dict[str, str], signer: Signer,
                                               tmp_path: Path) -> None:
    entry = catalog_json(env)["ubuntu-22.04"]
    publish(mirror, entry, "ubuntu-22.04", tiny_qcow2(tmp_path, "u22"), signer=signer)
    stranger = Signer()
    try:
        keyed = {**env, "VMLAUNCH_IMAGE_KEYRING": str(stranger.keyring)}
        done = run(keyed, "image", "pull", str(spec(tmp_path, {"u": "ubuntu-22.04"})))
    finally:
        stranger.close()
    assert done.returncode == 3
    assert "not in the keyring" in done.stderr


def test_a_skipped_check_is_said_plainly(mirror: Mirror, env: dict[str, str], tmp_path: Path) -> None:
    entry = catalog_json(env)["ubuntu-22.04"]
    publish(mirror, entry, "ubuntu-22.04", tiny_qcow2(tmp_path, "u22-plain"))
    done = run(env, "image", "pull", str(spec(tmp_path, {"u": "ubuntu-22.04"})))
    assert done.returncode == 0, done.stderr
    assert "signature was NOT checked" in done.stderr


def test_a_lock_edited_into_nonsense(mirror: Mirror, env: dict[str, str], tmp_path: Path) -> None:
    entry = catalog_json(env)["alpine-3.22"]
    publish(mirror, entry, "alpine", tiny_qcow2(tmp_path, "alp"))
    lab = spec(tmp_path, {"alp": "alpine-3.22"})
    assert run(env, "image", "pull", str(lab)).returncode == 0
    lock = Path(str(lab) + ".lock")
    text = lock.read_text()
    lock.write_text(text.replace('sha512 = "', 'sha512 = "zz'))
    done = run(env, "image", "pull", str(lab))
    assert done.returncode == 2
    assert f"{lock}:" in done.stderr and "sha512" in done.stderr and "--update" in done.stderr
    assert run(env, "validate", str(lab)).returncode == 2
    lock.write_text("this is [not toml")
    assert run(env, "image", "pull", str(lab)).returncode == 2
    fixed = run(env, "image", "pull", "--update", str(lab))
    assert fixed.returncode == 0, fixed.stderr
    assert lock_of(lab)["alp"].catalog == "alpine-3.22"


def test_bad_names_and_settings(env: dict[str, str], tmp_path: Path) -> None:
    done = run(env, "validate", str(spec(tmp_path, {"u": "ubuntu-24.4"})))
    assert done.returncode == 2
    assert "did you mean ubuntu-24.04" in done.stderr
    done = run({**env, "VMLAUNCH_IMAGE_MIRROR": "ftp://x"}, "image", "catalog")
    assert done.returncode == 64
    assert "VMLAUNCH_IMAGE_MIRROR" in done.stderr
    done = run(env, "validate", str(spec(tmp_path, {"u": "debian-12"}, 'version = "../x"\n')))
    assert done.returncode == 2


def test_the_catalog_lists_needs(env: dict[str, str]) -> None:
    entries = catalog_json(env)
    assert entries["alpine-3.22-uefi"]["firmware"] == "uefi"
    assert entries["debian-12"]["firmware"] == "bios"
    assert entries["rocky-10"]["cpu_model"] == "max"
    plain = run({**env, "VMLAUNCH_IMAGE_MIRROR": ""}, "image", "catalog")
    assert plain.returncode == 0
    assert "firmware = \"uefi\"" in plain.stdout and "cpu_model = \"max\"" in plain.stdout
    for entry in catalog.entries().values():  # the distributions' own hosts, https, without a mirror
        for build in entry.builds.values():
            assert build.url.startswith("https://") and build.checksum.startswith("https://")


def test_checksum_lines() -> None:
    digest = "a" * 64
    assert catalog_images.digest_for(f"{digest}  x.qcow2\n", "x.qcow2") == ("sha256", digest)
    assert catalog_images.digest_for(f"{digest} *./x.qcow2\n", "x.qcow2") == ("sha256", digest)
    bsd = f"SHA256 (x.qcow2) = {digest.upper()}\n"
    assert catalog_images.digest_for(bsd, "x.qcow2") == ("sha256", digest)
    assert catalog_images.digest_for(f"{digest}  y-x.qcow2\n", "x.qcow2") is None
    both = f"{digest}  x.qcow2\n{'b' * 128}  x.qcow2\n"
    assert catalog_images.digest_for(both, "x.qcow2") == ("sha512", "b" * 128)
    from vmlaunch.errors import RuntimeFailure

    with pytest.raises(RuntimeFailure, match="2 different"):
        catalog_images.digest_for(f"{digest}  x.qcow2\n{'c' * 64}  x.qcow2\n", "x.qcow2")


def test_the_mirror_rule() -> None:
    url = "https://cloud.debian.org/images/cloud/bookworm/latest/SHA512SUMS"
    assert catalog.apply_mirror(url, "http://127.0.0.1:8080") == \
        "http://127.0.0.1:8080/images/cloud/bookworm/latest/SHA512SUMS"
    assert catalog.apply_mirror(url, "http://m:1/debian-cloud/") == \
        "http://m:1/debian-cloud/images/cloud/bookworm/latest/SHA512SUMS"
    assert catalog.check_mirror("http://h:notaport") is not None
    assert catalog.check_mirror("http:///x") is not None
    assert catalog.check_mirror("http://h:8080") is None


def test_a_mirror_that_drops_the_signature(mirror: Mirror, env: dict[str, str], signer: Signer,
                                           tmp_path: Path) -> None:
    entry = catalog_json(env)["debian-13"]
    publish(mirror, entry, "debian-13", tiny_qcow2(tmp_path, "d13-unsigned"))  # no SHA512SUMS.sign
    lab = spec(tmp_path, {"d": "debian-13"})
    keyed = run({**env, "VMLAUNCH_IMAGE_KEYRING": str(signer.keyring)}, "image", "pull", str(lab))
    assert keyed.returncode == 3  # the mirror signs (its keyring was given): a missing signature is refused
    assert "cannot be checked" in keyed.stderr
    required = run({**env, "VMLAUNCH_REQUIRE_SIGNATURE": "1", "PATH": "/nonexistent"}, "image", "pull",
                   str(lab))
    assert required.returncode == 3
    assert not Path(str(lab) + ".lock").exists()
    assert run(env, "image", "pull", str(lab)).returncode == 0  # by default: a warning, said plainly


def test_a_checksum_file_that_disagrees_with_its_image_pins_nothing(
        mirror: Mirror, env: dict[str, str], tmp_path: Path) -> None:
    entry = catalog_json(env)["almalinux-10"]
    image = tiny_qcow2(tmp_path, "alma10")
    publish(mirror, entry, "almalinux-10", image)
    mirror.put(str(entry["url"]), image + b"changed on the mirror")
    lab = spec(tmp_path, {"a": "almalinux-10"})
    done = run(env, "image", "pull", str(lab))
    assert done.returncode == 4
    assert "nothing was pinned" in done.stderr
    assert not Path(str(lab) + ".lock").exists()
    mirror.put(str(entry["url"]), image)  # the mirror is put right: no --update needed
    assert run(env, "image", "pull", str(lab)).returncode == 0


def test_a_version_taken_out_of_the_spec_moves_the_pin_back(mirror: Mirror, env: dict[str, str],
                                                             tmp_path: Path) -> None:
    entry = catalog.entries()["arch"]
    for version in ("20990101.1", None):
        url, checksum_url = (catalog.apply_mirror(u, mirror.base) for u in entry.locations(version))
        image = tiny_qcow2(tmp_path, f"a{version}")
        publish(mirror, {"url": url, "checksum_url": checksum_url}, "arch", image)
    lab = spec(tmp_path, {"arch": "arch"}, 'version = "20990101.1"\n')
    assert run(env, "image", "pull", str(lab)).returncode == 0
    assert lock_of(lab)["arch"].version == "20990101.1"
    lab = spec(tmp_path, {"arch": "arch"})
    assert run(env, "image", "pull", str(lab)).returncode == 0
    assert lock_of(lab)["arch"].version == "latest"


def test_a_lock_may_name_only_the_distributions_own_place(mirror: Mirror, env: dict[str, str],
                                                           tmp_path: Path) -> None:
    entry = catalog_json(env)["alpine-3.22"]
    publish(mirror, entry, "alpine", tiny_qcow2(tmp_path, "alp-host"))
    lab = spec(tmp_path, {"alp": "alpine-3.22"})
    assert run(env, "image", "pull", str(lab)).returncode == 0
    lock = Path(str(lab) + ".lock")
    text = lock.read_text()
    lock.write_text(text.replace("https://dl-cdn.alpinelinux.org/", "https://elsewhere.example/", 1))
    done = run(env, "validate", str(lab))
    assert done.returncode == 2
    assert "is not where alpine-3.22 publishes" in done.stderr
    lock.write_bytes(b"lock_version = 1\n\xff\xfe")
    done = run(env, "image", "pull", str(lab))
    assert done.returncode == 2 and "not UTF-8" in done.stderr
    assert run(env, "image", "pull", "--update", str(lab)).returncode == 0
    lock.write_text(lock.read_text().replace("lock_version = 1", "lock_version = true"))
    assert run(env, "image", "pull", str(lab)).returncode == 2


def test_a_mirror_with_a_password_is_refused_unsaid(env: dict[str, str]) -> None:
    done = run({**env, "VMLAUNCH_IMAGE_MIRROR": "http://user:s3cret@127.0.0.1:1"}, "image", "catalog")
    assert done.returncode == 64
    assert "s3cret" not in done.stderr


def test_an_offline_pull_names_the_ways_without_the_internet(env: dict[str, str], tmp_path: Path) -> None:
    lab = spec(tmp_path, {"deb": "debian-12"})
    # a mirror whose name cannot resolve: the setting is named as what to check
    done = run({**env, "VMLAUNCH_IMAGE_MIRROR": "http://nonexistent.invalid"}, "image", "pull", str(lab))
    assert done.returncode == 4 and "Traceback" not in done.stderr
    assert "VMLAUNCH_IMAGE_MIRROR=http://nonexistent.invalid names nonexistent.invalid, which this host " \
        "cannot reach" in done.stderr
    assert "tools/build_debian.py" in done.stderr
    # no mirror, in a network namespace of its own, which has no network at all: offline
    offline = subprocess.run(netns_argv([sys.executable, "-m", "vmlaunch", "image", "pull", str(lab)]),
                             env={**env, "VMLAUNCH_IMAGE_MIRROR": ""}, capture_output=True, text=True,
                             check=False, cwd=ROOT)
    assert offline.returncode == 4 and "Traceback" not in offline.stderr, offline.stderr
    hint = offline.stderr.split("\n  hint: ", 1)[1]
    assert hint.startswith("this host cannot reach ") and "(offline?)" in hint
    assert "VMLAUNCH_IMAGE_MIRROR=http://HOST:PORT" in hint and "tools/build_debian.py" in hint
    assert "\"Without the internet\"" in hint


def test_a_checksum_file_that_drips_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import threading
    import time

    from vmlaunch.errors import RuntimeFailure
    from vmlaunch.guests import images

    server = socket.create_server(("127.0.0.1", 0))

    def drip() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        with contextlib.suppress(OSError):
            for _ in range(100):
                conn.sendall(b"a")
                time.sleep(0.1)
        conn.close()

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    monkeypatch.setattr(images, "SMALL_DEADLINE", 0.5)
    with pytest.raises(RuntimeFailure, match="not done"):
        images.fetch_small(f"http://127.0.0.1:{server.getsockname()[1]}/SHA512SUMS", 1 << 20)
    server.close()


def test_a_checksum_file_of_the_image_alone() -> None:
    digest = "d" * 128
    assert catalog_images.digest_for(f"{digest}\n", "x.qcow2", own=True) == ("sha512", digest)
    assert catalog_images.digest_for(f"{digest}\n", "x.qcow2") is None  # a SUMS file names its files
    dated = f"SHA256 (x-9.8-20260525.0.qcow2) = {'e' * 64}\n"  # the moving name's file names the build
    assert catalog_images.digest_for(dated, "x.latest.qcow2", own=True) == ("sha256", "e" * 64)
    assert catalog_images.digest_for(dated, "x.latest.qcow2") is None
    from vmlaunch.errors import RuntimeFailure

    with pytest.raises(RuntimeFailure, match="2 different"):
        catalog_images.digest_for(f"{'e' * 64}  a.qcow2\n{'f' * 64}  b.qcow2\n", "x.qcow2", own=True)


def test_dated_builds_of_a_minor_release() -> None:
    url, checksum_url = catalog.entries()["rocky-9"].locations("9.8-20260525.0")
    assert url == ("https://dl.rockylinux.org/pub/rocky/9.8/images/x86_64/"
                   "Rocky-9-GenericCloud-Base-9.8-20260525.0.x86_64.qcow2")
    assert checksum_url == url + ".CHECKSUM"
    url, checksum_url = catalog.entries()["almalinux-9"].locations("9.8-20260526")
    assert "/almalinux/9.8/cloud/x86_64/images/" in url
    assert checksum_url.endswith("/9.8/cloud/x86_64/images/CHECKSUM")
