"""guests/kernels.py: a bzImage's payload decompressed once into the kernel cache, booted through PVH
under TCG; everything else a one-line note, and the bzImage boots.

The kernels here are small real ones in shape: a setup header as the kernel's build writes it, and a
payload compressed by the real compressors (Python's, and the zstd and lz4 programs) holding a tiny
x86-64 ELF with or without the Xen PHYS32_ENTRY note.
"""

from __future__ import annotations

import bz2
import gzip
import logging
import lzma
import os
import shutil
import struct
import subprocess
import threading
from pathlib import Path
from typing import IO

import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.guests import kernels
from vmlaunch.guests.kernels import KernelBoot, boot_of, read_setup_header

ENTRY = 0x1000A50
SETUP_SECTS = 1


def elf(*, pvh: bool = True, filler: int = 200_000) -> bytes:
    """An x86-64 ELF of one PT_NOTE segment: a GNU build-id note, then (with `pvh`) the Xen note."""
    notes = struct.pack("<III", 4, 20, 3) + b"GNU\0" + bytes(range(20))
    if pvh:
        notes += struct.pack("<III", 4, 4, 18) + b"Xen\0" + struct.pack("<I", ENTRY)
    else:  # a Xen note of another type: the note searched for is type 18 alone
        notes += struct.pack("<III", 4, 4, 6) + b"Xen\0" + struct.pack("<I", ENTRY)
    phoff, note_at = 64, 64 + 56
    header = (b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
              + struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0x1000000, phoff, 0, 0, 64, 56, 1, 0, 0, 0))
    phdr = struct.pack("<IIQQQQQQ", 4, 4, note_at, 0, 0, len(notes), len(notes), 4)
    body = bytes((i * 7919) % 251 for i in range(filler // 2)) + bytes(filler // 2)  # some of it compresses
    return header + phdr + notes + body


def compressed(data: bytes, kind: str) -> bytes:
    """`data` as the kernel's build compresses a payload: every compressor's stream but gzip's is
    followed by the decompressed size (gzip's trailer has it already)."""
    size = struct.pack("<I", len(data))
    if kind == "gzip":
        return gzip.compress(data, mtime=0)
    if kind == "xz":  # the kernel's xz_wrap.sh: the x86 BCJ filter, then LZMA2, CRC32
        filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2}]
        return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, filters=filters) + size
    if kind == "lzma":
        return lzma.compress(data, format=lzma.FORMAT_ALONE) + size
    if kind == "bzip2":
        return bz2.compress(data) + size
    program = {"zstd": ["zstd", "-q", "-c", "-19"], "lz4": ["lz4", "-q", "-l", "-c"]}[kind]
    if shutil.which(program[0]) is None:
        pytest.skip(f"the {program[0]} program is not installed (tools/setup.sh installs it)")
    return subprocess.run(program, input=data, capture_output=True, check=True).stdout + size


def bzimage(payload: bytes, *, version: int = 0x20F, stub: int = 100, length: int | None = None) -> bytes:
    """A bzImage: SETUP_SECTS sectors of setup with its header, then `stub` bytes of the decompressor,
    the payload, and some bytes after it (as the real one has)."""
    setup = bytearray((SETUP_SECTS + 1) * 512)
    setup[0x1F1] = SETUP_SECTS
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, version)
    struct.pack_into("<II", setup, 0x248, stub, len(payload) if length is None else length)
    struct.pack_into("<Q", setup, 0x258, 0x1000000)
    struct.pack_into("<I", setup, 0x260, 0x2000000)
    return bytes(setup) + b"\x90" * stub + payload + b"\xcc" * 333


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own; its kernels folder."""
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def kernel_file(tmp_path: Path, data: bytes, name: str = "vmlinuz") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def decompressions(caplog: pytest.LogCaptureFixture) -> int:
    return sum("decompressing its" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("kind", ["gzip", "xz", "lzma", "bzip2", "zstd", "lz4"])
def test_each_compression_is_decompressed_once_and_boots_through_pvh(
        kind: str, tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    image = elf()
    kernel = kernel_file(tmp_path, bzimage(compressed(image, kind)))
    boot = boot_of(kernel, build=True)
    assert boot.elf is not None and boot.elf.parent == cache, boot.why
    assert boot.elf.read_bytes() == image
    assert oct(boot.elf.stat().st_mode & 0o777) == "0o444"
    assert f"boots through its PVH entry from the ELF its {kind} payload decompresses to" in boot.why
    assert boot_of(kernel, build=True) == boot == boot_of(kernel, build=False)  # from the cache now
    assert decompressions(caplog) == 1
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [
        boot.elf.name, boot.elf.with_suffix(".json").name]


def test_cmdline_writes_nothing_and_says_what_up_will_do(tmp_path: Path, cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "SETTLED", 0.0)  # a digest that could stand is not kept either
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "xz")))
    boot = boot_of(kernel, build=False)
    assert boot.elf is None
    assert boot.why == (f"kernel {kernel} boots as a bzImage for now: `up` decompresses its xz payload once "
                        f"(195 KiB) into {cache} and then boots it through its PVH entry, if the ELF has one")
    assert [p.name for p in cache.iterdir()] == []


def test_an_elf_without_the_pvh_note_boots_the_bzimage_and_is_remembered(
        tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(pvh=False), "gzip")))
    boot = boot_of(kernel, build=True)
    assert boot == KernelBoot(kernel, None, f"kernel {kernel} boots as a bzImage: its gzip payload "
                              "decompresses to an ELF without a PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY; a "
                              "kernel built without CONFIG_PVH)")
    assert not list(cache.glob("*.elf"))  # no 200K kept for nothing
    assert boot_of(kernel, build=True) == boot == boot_of(kernel, build=False)
    assert decompressions(caplog) == 1  # the same bytes give the same answer: not decompressed again


@pytest.mark.parametrize("damage", ["truncated", "a byte changed", "not an ELF", "missing", "record lost"])
def test_a_damaged_cache_file_is_made_again_never_booted(
        damage: str, tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    image = elf()
    kernel = kernel_file(tmp_path, bzimage(compressed(image, "xz")))
    made = boot_of(kernel, build=True).elf
    assert made is not None
    made.chmod(0o644)
    if damage == "truncated":
        with open(made, "r+b") as file:
            file.truncate(len(image) // 2)
    elif damage == "a byte changed":
        data = bytearray(made.read_bytes())
        data[-1000] ^= 0xFF
        made.write_bytes(bytes(data))
    elif damage == "not an ELF":
        made.write_bytes(b"\0" * len(image))
    elif damage == "missing":
        made.unlink()
    else:
        made.with_suffix(".json").unlink()
    before = decompressions(caplog)
    later = boot_of(kernel, build=False)  # cmdline: never the damaged file; nothing written
    assert later.elf is None and "boots as a bzImage for now" in later.why
    again = boot_of(kernel, build=True)  # up: made again
    assert again.elf == made and made.read_bytes() == image
    assert decompressions(caplog) == before + 1



def _clock_ticked_past(path: Path, scratch: Path) -> None:
    """Wait until a change made now gets a later ctime than `path` has (the file system's clock moves
    in ticks of a few ms): a test that changes a file right after it was recorded changes it so."""
    since = path.stat().st_ctime_ns
    while True:
        scratch.write_bytes(b"tick")
        if scratch.stat().st_ctime_ns > since:
            return


def test_a_file_is_hashed_once_while_unchanged_and_again_when_changed(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The ELF and the kernel are hashed until they have settled, once then; after that their identity
    stands for their digest (no 65 MB hash at every up), and any change is seen: a changed byte of the
    ELF is made again, a kernel rewritten in place boots what it now holds."""
    caplog.set_level(logging.INFO)
    hashed: list[int] = []  # the inodes of the files hashed
    real = kernels._sha256

    def counted(file: IO[bytes]) -> str:
        hashed.append(os.fstat(file.fileno()).st_ino)
        return real(file)

    monkeypatch.setattr(kernels, "_sha256", counted)
    image = elf()
    kernel = kernel_file(tmp_path, bzimage(compressed(image, "gzip")))
    made = boot_of(kernel, build=True).elf
    assert made is not None
    assert boot_of(kernel, build=True).elf == made
    assert len(hashed) == 3  # fresh files: nothing stands for their digest yet (the kernel twice, the ELF)
    monkeypatch.setattr(kernels, "SETTLED", 0.0)  # as if minutes had passed
    hashed.clear()
    assert boot_of(kernel, build=True).elf == made  # hashed once more, and their identities recorded
    assert sorted(hashed) == sorted([kernel.stat().st_ino, made.stat().st_ino])
    assert (cache / kernels.DIGESTS).exists() and "identity" in made.with_suffix(".json").read_text()
    hashed.clear()
    assert boot_of(kernel, build=True).elf == made == boot_of(kernel, build=False).elf
    assert hashed == []  # neither file hashed again

    _clock_ticked_past(made, tmp_path / "tick")
    made.chmod(0o644)  # a byte of the ELF changed in place, its size kept
    data = bytearray(made.read_bytes())
    data[-1000] ^= 0xFF
    made.write_bytes(bytes(data))
    assert boot_of(kernel, build=False).elf is None  # never the changed file
    assert boot_of(kernel, build=True).elf == made and made.read_bytes() == image  # made again
    assert decompressions(caplog) == 2

    _clock_ticked_past(kernel, tmp_path / "tick")
    other = elf(filler=200_002)
    with open(kernel, "r+b") as file:  # the kernel rewritten in place: same file, new bytes
        file.write(bzimage(compressed(other, "gzip")))
        file.truncate()
    rebuilt = boot_of(kernel, build=True).elf
    assert rebuilt is not None and rebuilt != made and rebuilt.read_bytes() == other

@pytest.mark.parametrize(("data", "said"), [
    (b"MZ" + bytes(4000), "is neither a bzImage nor an ELF: booted as given"),
    (elf(), "is an ELF already: booted as given"),
    (elf(pvh=False), "is an ELF already: booted as given (it has no PVH entry note: QEMU may refuse it)"),
    (bzimage(b"\x00\x01\x02\x03\x04\x05junk" * 10),
     "has a payload in a compression vmlaunch does not know (it starts with 00 01 02 03 04 05): booted as a "
     "bzImage"),
    (bzimage(b"\x89LZO\x00\r\n\x1a\n" + bytes(100)),
     "has an LZO payload, which vmlaunch does not decompress (gzip, xz, lzma and bzip2 (and zstd and lz4 "
     "with their programs installed) it does): booted as a bzImage"),
    (bzimage(compressed(elf(), "gzip"), version=0x207),
     "is a bzImage of boot protocol 2.07, which does not say where its payload is (2.08 does): booted as "
     "a bzImage"),
    (bzimage(compressed(elf(), "gzip"), length=1 << 30),
     "has a setup header whose payload lies outside the file: booted as a bzImage"),
    (bzimage(b"\xfd7zXZ\x00" + bytes(100) + struct.pack("<I", 600 << 20)),
     "says its payload decompresses to 600.0 MiB, more than the 512.0 MiB a kernel may be: booted as a "
     "bzImage"),
])
def test_what_cannot_boot_through_pvh_is_a_one_line_note(data: bytes, said: str, tmp_path: Path,
                                                          cache: Path) -> None:
    kernel = kernel_file(tmp_path, data)
    boot = boot_of(kernel, build=True)
    assert boot == KernelBoot(kernel, None, f"kernel {kernel} {said}")
    assert "\n" not in boot.why


@pytest.mark.parametrize("kind", ["gzip", "xz", "lzma", "bzip2", "zstd", "lz4"])
def test_a_corrupt_payload_is_a_note_and_the_bzimage_boots(kind: str, tmp_path: Path, cache: Path) -> None:
    payload = bytearray(compressed(elf(), kind))
    for at in range(40, len(payload) - 40, 97):  # past the magic and the stream header
        payload[at] ^= 0x5A
    kernel = kernel_file(tmp_path, bzimage(bytes(payload)))
    boot = boot_of(kernel, build=True)
    assert boot.elf is None
    assert f"kernel {kernel} boots as a bzImage: its {kind} payload " in boot.why, boot.why
    assert not [p for p in cache.iterdir() if p.suffix == ".elf" or p.name.endswith(".tmp")]


def test_a_decompressing_program_killed_is_not_remembered(tmp_path: Path, cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A program killed (a timeout, the OOM killer) says nothing of the kernel: the next up tries again."""
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "zstd")))
    real = kernels.PROGRAMS
    killed = ("sh", "-c", "kill -KILL $$")  # a real program, killed as a timeout would
    monkeypatch.setattr(kernels, "PROGRAMS", {**real, kernels.Compression.ZSTD: killed})
    boot = boot_of(kernel, build=True)
    assert boot.elf is None
    assert "its zstd payload does not decompress (sh was killed by SIGKILL)" in boot.why
    assert not list(cache.glob("sha256-*"))
    monkeypatch.setattr(kernels, "PROGRAMS", real)
    assert boot_of(kernel, build=True).elf is not None


def test_a_truncated_payload_is_corrupt(tmp_path: Path, cache: Path) -> None:
    payload = compressed(elf(), "xz")
    cut = payload[:len(payload) // 2] + payload[-4:]  # the size the build appends is still last
    boot = boot_of(kernel_file(tmp_path, bzimage(cut)), build=True)
    assert boot.elf is None and "its xz payload does not decompress (it ends before its compressed stream " \
        "does (truncated))" in boot.why


def test_a_payload_larger_than_it_says_is_corrupt(tmp_path: Path, cache: Path) -> None:
    image = elf()
    payload = compressed(image, "bzip2")[:-4] + struct.pack("<I", len(image) - 1)
    boot = boot_of(kernel_file(tmp_path, bzimage(payload)), build=True)
    assert boot.elf is None
    said = f"does not decompress (it decompresses to more than the {len(image) - 1} bytes it says)"
    assert said in boot.why


def test_a_cache_that_cannot_be_used_boots_the_bzimage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    top = tmp_path / "shared-cache"
    top.mkdir(mode=0o777)
    top.chmod(0o777)  # others may write in it: refused (layout/dirs.py)
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(top))
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "gzip")))
    boot = boot_of(kernel, build=True)
    assert boot.why == (f"kernel {kernel} boots as a bzImage: the cache ({top}/kernels) cannot be used (see "
                        "the warning above)")
    assert "others may write in it" in caplog.text
    assert list(top.iterdir()) == []


def test_a_full_file_system_boots_the_bzimage(tmp_path: Path, cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from vmlaunch.guests import images

    # A file system this full cannot be made here for a test: its free space and reserve are given
    monkeypatch.setattr(images, "disk_room", lambda folder: (2 << 30, (2 << 30) - 1000))
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "gzip")))
    boot = boot_of(kernel, build=True)
    assert boot.why == (f"kernel {kernel} boots as a bzImage: {cache} has too little room for its 195 KiB "
                        "decompressed (a file system's reserve is kept free)")
    assert not list(cache.glob("sha256-*"))


def test_a_cache_folder_that_cannot_be_written_boots_the_bzimage(tmp_path: Path, cache: Path) -> None:
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "gzip")))
    cache.mkdir(parents=True)
    # Root writes through modes: a file system mounted read-only would do; an immutable folder is one
    if subprocess.run(["chattr", "+i", str(cache)], capture_output=True, check=False).returncode != 0:
        pytest.skip("chattr +i does not work on this file system")
    try:
        boot = boot_of(kernel, build=True)
    finally:
        subprocess.run(["chattr", "-i", str(cache)], check=True)
    assert boot.elf is None
    assert boot.why.startswith(f"kernel {kernel} boots as a bzImage: "), boot.why
    assert "Operation not permitted" in boot.why


def test_the_cache_keeps_the_most_recently_used(tmp_path: Path, cache: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "CACHE_ENTRIES", 2)
    monkeypatch.setattr(kernels, "GRACE", 0.0)
    made = []
    for index in range(3):
        kernel = kernel_file(tmp_path, bzimage(compressed(elf(filler=1000 + 2 * index), "gzip")), f"k{index}")
        boot = boot_of(kernel, build=True)
        assert boot.elf is not None
        made.append(boot.elf)
        os.utime(boot.elf, (1000.0 + index, 1000.0 + index))  # used in this order, long ago
        os.utime(boot.elf.with_suffix(".json"), (1000.0 + index, 1000.0 + index))
    assert [elf.exists() for elf in made] == [False, True, True]  # the least recently used went
    assert not made[0].with_suffix(".json").exists()
    boot_of(tmp_path / "k1", build=True)  # k1 used now: k2 is the oldest when k0 comes back
    again = boot_of(tmp_path / "k0", build=True)
    assert again.elf == made[0] and [elf.exists() for elf in made] == [True, True, False]


def test_a_recently_used_entry_is_kept_past_the_bound(tmp_path: Path, cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "CACHE_ENTRIES", 1)
    first = boot_of(kernel_file(tmp_path, bzimage(compressed(elf(filler=1000), "gzip")), "a"), build=True)
    second = boot_of(kernel_file(tmp_path, bzimage(compressed(elf(filler=1002), "gzip")), "b"), build=True)
    assert first.elf is not None and first.elf.exists()  # an up may be about to start QEMU on it
    assert second.elf is not None and second.elf.exists()


def test_a_temp_file_of_a_killed_process_is_cleaned(tmp_path: Path, cache: Path) -> None:
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "gzip")))
    cache.mkdir(parents=True)
    left = cache / f".sha256-{'ab' * 32}.elf.999999.tmp"
    left.write_bytes(b"half")
    assert boot_of(kernel, build=True).elf is not None
    assert not left.exists()


def test_two_ups_at_once_decompress_once(tmp_path: Path, cache: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    kernel = kernel_file(tmp_path, bzimage(compressed(elf(filler=3_000_000), "xz")))
    results: list[KernelBoot] = []
    threads = [threading.Thread(target=lambda: results.append(boot_of(kernel, build=True))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({boot.elf for boot in results}) == 1 and results[0].elf is not None
    assert decompressions(caplog) == 1


def test_the_setup_header() -> None:
    header = read_setup_header(bzimage(b"x" * 50, stub=7)[:kernels.HEADER_BYTES])
    assert header == kernels.SetupHeader(version=0x20F, setup_bytes=1024, payload_offset=7, payload_length=50,
                                         pref_address=0x1000000, init_size=0x2000000)
    assert read_setup_header(b"\0" * 1024) is None


# --- the compiler ------------------------------------------------------------------------------------


def test_the_compiler_boots_the_elf_only_under_tcg_with_bios_firmware(tmp_path: Path) -> None:
    from vmlaunch.compile.compiler import compile_lab
    from vmlaunch.host.facts import KvmStatus, Ovmf
    from vmlaunch.spec.load import load_lab

    kernel = kernel_file(tmp_path, b"any")
    spec = write_spec(tmp_path, "".join(
        f'[vm.{name}]\nmemory = 128\nkernel = "vmlinuz"\n{extra}\n'
        for name, extra in (("a", ""), ("b", ""), ("off", "fast_boot = false"), ("uefi", 'firmware = "uefi"'),
                            ("kvm", 'accel = "kvm"'))) + '[lab]\nname = "k"\n')
    lab = load_lab(spec)
    elf_path = tmp_path / "cache" / "sha256-x.elf"
    booted = {kernel: KernelBoot(kernel, elf_path, "kernel vmlinuz boots through its PVH entry (...)")}
    host = fake_host(kvm=KvmStatus(True, "fake: KVM runs"), ovmf=None)

    def kernel_of(name: str, plan_host: object = host, kernels: object = booted) -> str:
        plan = compile_lab(lab, plan_host, [name], kernels=kernels)  # type: ignore[arg-type]
        argv = plan.vm(name).argv
        return argv[argv.index("-kernel") + 1]

    ovmf = Ovmf(Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/usr/share/OVMF/OVMF_VARS_4M.fd"))
    tcg = fake_host(ovmf=ovmf)  # KVM not usable: accel = "auto" is TCG
    assert kernel_of("a", tcg) == str(elf_path)
    assert kernel_of("a") == str(kernel)  # KVM: the bzImage, as before
    assert kernel_of("kvm") == str(kernel)
    assert kernel_of("uefi", tcg) == str(kernel)  # OVMF boots a bzImage's EFI stub, not an ELF
    assert kernel_of("off", tcg) == str(kernel)
    assert kernel_of("a", tcg, {}) == str(kernel)  # no facts gathered: as given
    plan = compile_lab(lab, tcg, ["a", "b", "off"], kernels=booted)
    assert [note for note in plan.notes if "kernel" in note] == [
        "a, b: kernel vmlinuz boots through its PVH entry (...)"]  # once for the VMs that share it


def test_prepare_looks_only_at_the_kernels_that_may_boot_fast(tmp_path: Path, cache: Path) -> None:
    from vmlaunch.spec.load import load_lab

    kernel_file(tmp_path, bzimage(compressed(elf(), "gzip")))
    kernel_file(tmp_path, b"never read", "other")
    spec = write_spec(tmp_path, '[lab]\nname = "k"\n[vm.a]\nmemory = 128\nkernel = "vmlinuz"\n'
                      '[vm.b]\nmemory = 128\nkernel = "other"\nfast_boot = false\n')
    found = kernels.prepare(load_lab(spec), fake_host(), build=True)
    assert list(found) == [tmp_path / "vmlinuz"]
    assert found[tmp_path / "vmlinuz"].elf is not None
    assert kernels.prepare(load_lab(spec), fake_host(), ["b"], build=True) == {}


def test_image_list_counts_the_kernels_and_image_rm_kernels_removes_them(
        tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vmlaunch.cli import main

    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "gzip")))
    made = boot_of(kernel, build=True).elf
    assert made is not None
    assert main(["image", "list"]) == 0
    err = capsys.readouterr().err
    assert "vmlaunch: 1 kernel decompressed for a fast boot under TCG, 19" in err
    assert f" KiB, in {cache}; `vmlaunch image rm --kernels` removes them" in err
    assert main(["image", "rm", "--kernels"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"removed {made.with_suffix('.json')}", f"removed {made}"]
    assert not list(cache.glob("sha256-*"))
    assert main(["image", "list"]) == 0
    assert "kernel" not in capsys.readouterr().err


def test_fast_boot_is_a_switch_of_a_direct_boot_kernel(tmp_path: Path) -> None:
    from vmlaunch.errors import SpecError
    from vmlaunch.spec.load import load_lab

    kernel_file(tmp_path, b"any")
    spec = write_spec(tmp_path, '[lab]\nname = "k"\n[vm.a]\nmemory = 128\nkernel = "vmlinuz"\n')
    assert load_lab(spec).vm("a").fast_boot is True
    spec.write_text(spec.read_text() + "fast_boot = false\n")
    assert load_lab(spec).vm("a").fast_boot is False
    spec.write_text(spec.read_text().replace("false", '"yes"'))
    with pytest.raises(SpecError) as caught:
        load_lab(spec)
    assert [str(problem).replace(str(spec), "lab.toml") for problem in caught.value.problems] == [
        "lab.toml:6: vm.a.fast_boot: expected true or false, got a string"]
    spec.write_text('[lab]\nname = "k"\n[vm.a]\nmemory = 128\nfast_boot = true\n[[vm.a.disk]]\nfile = "d"\n'
                    'size = "1M"\n')
    with pytest.raises(SpecError) as caught:
        load_lab(spec)
    assert [str(problem).replace(str(spec), "lab.toml") for problem in caught.value.problems] == [
        'lab.toml:5: vm.a.fast_boot: fast_boot needs kernel (add kernel = "...")']


def test_an_elf_whose_headers_point_past_any_file_boots_as_given(tmp_path: Path, cache: Path) -> None:
    """e_phoff of 2**64-1: not a traceback, a note."""
    bad = bytearray(elf())
    struct.pack_into("<Q", bad, 32, 2**64 - 1)  # e_phoff
    kernel = kernel_file(tmp_path, bytes(bad))
    boot = boot_of(kernel, build=True)
    assert boot.elf is None and boot.why.startswith(f"kernel {kernel} ") and "\n" not in boot.why


def test_the_pvh_note_is_said_once_per_kernel_and_again_with_v(tmp_path: Path, cache: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """It says the same at every run: `up`, `cmdline` and `--dry-run` say it the first time only."""
    from vmlaunch.cli import main

    kernel = kernel_file(tmp_path, bzimage(compressed(elf(), "gzip")))
    spec = str(write_spec(tmp_path, '[lab]\nname = "k"\n[vm.a]\nmemory = 128\naccel = "tcg"\n'
                          'kernel = "vmlinuz"\n'))
    assert boot_of(kernel, build=True).elf is not None  # as `up` leaves it: the ELF in the cache

    def notes(*args: str) -> int:
        assert main(list(args)) == 0
        return capfd.readouterr().err.count("boots through its PVH entry")

    assert notes("-q", "cmdline", spec) == 0  # nothing shown: not told yet
    assert notes("cmdline", spec) == 1
    assert notes("cmdline", spec) == 0
    assert notes("up", spec, "--dry-run") == 0
    assert notes("-v", "cmdline", spec) == 1
    other = kernel_file(tmp_path, bzimage(compressed(elf(filler=100_000), "gzip")), "vmlinuz2")
    boot_of(other, build=True)
    spec2 = str(write_spec(tmp_path, '[lab]\nname = "k2"\n[vm.a]\nmemory = 128\naccel = "tcg"\n'
                           'kernel = "vmlinuz2"\n', "other.toml"))
    assert notes("cmdline", spec2) == 1  # another kernel: its own note, once
    assert notes("cmdline", spec) == 0
    (cache / kernels.TOLD).write_text("{not json")  # a damaged record: told again, never a failure
    assert notes("cmdline", spec) == 1
    assert notes("cmdline", spec) == 0
