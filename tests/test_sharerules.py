"""What a share may be (vmlaunch/guests/sharerules.py): the rule on resolved paths, and the spec problems it
gives where a spec's files are checked (`load_lab(files=True)`: validate, cmdline, up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_spec
from vmlaunch.compile.preflight import load_checked
from vmlaunch.errors import SpecError
from vmlaunch.guests.sharerules import Held, refusal

HOMES = [("root", "/root"), ("alice", "/home/alice")]
STATE = Held("/run/vmlaunch", "vmlaunch's run folder", "a guest could read it", inside_too=True)
SPEC = Held("/srv/lab/lab.toml", "the lab's spec", "a guest could rewrite the lab", writable_only=True)


def refused(folder: str, *, readonly: bool = False) -> str | None:
    found = refusal(folder, readonly=readonly, held=[STATE, SPEC], homes=HOMES)
    return None if found is None else f"{found[0]} ({found[1]})"


@pytest.mark.parametrize("folder", ["/srv/lab/src", "/var/tmp/build", "/tmp/lab/out", "/home/alice/src",
                                    "/root/labs/src", "/opt/data", "/data", "/mnt/disk/x"])
def test_a_folder_of_ones_own_may_be_shared_writable(folder: str) -> None:
    assert refused(folder) is None


@pytest.mark.parametrize("folder", ["/usr/share/doc", "/usr/local", "/var/lib/data", "/boot", "/srv/lab",
                                    "/tmp", "/var/tmp", "/run/media/alice/stick"])
def test_a_system_or_everybodys_folder_may_be_shared_read_only(folder: str) -> None:
    assert refused(folder, readonly=True) is None


@pytest.mark.parametrize(("folder", "readonly", "expected"), [
    ("/", True, "is the host's whole file system: a guest could read any file of the host (share another "
     "folder)"),
    ("/", False, "is the host's whole file system: a guest could read and change any file of the host "
     "(share another folder)"),
    ("/etc", True, "is /etc, the host's configuration (its password hashes, its SSH host keys): a guest "
     "could read it (share another folder)"),
    ("/etc/nginx", False, "is in /etc, the host's configuration (its password hashes, its SSH host keys): "
     "a guest could read and change it (share another folder)"),
    ("/dev/shm", True, "is in /dev, the host's devices: a guest could read it (share another folder)"),
    ("/proc", True, "is /proc, the kernel's view of every process: a guest could read it (share another "
     "folder)"),
    ("/sys/fs", True, "is in /sys, the kernel's devices and settings: a guest could read it (share another "
     "folder)"),
    ("/run", True, "holds /run/vmlaunch, vmlaunch's run folder: a guest could read it (share a subfolder "
     "that does not hold it)"),
    ("/run/vmlaunch/lab", True, "is in /run/vmlaunch, vmlaunch's run folder: a guest could read it (share "
     "another folder)"),
    ("/home", True, "holds /home/alice, the home folder of user alice: a guest could read its SSH keys, or "
     "plant what the user runs at login (share a subfolder that does not hold it)"),
    ("/home/alice", True, "is /home/alice, the home folder of user alice: a guest could read its SSH keys, "
     "or plant what the user runs at login (share a subfolder of it, not a hidden one)"),
    ("/root", False, "is /root, the home folder of user root: a guest could read its SSH keys, or plant "
     "what the user runs at login (share a subfolder of it, not a hidden one)"),
    ("/home/alice/.ssh", True, "is /home/alice/.ssh, a hidden folder of user alice's home: a guest could "
     "read the keys kept there, or plant what the user runs (share another folder)"),
    ("/home/alice/.config/autostart", False, "is in /home/alice/.config, a hidden folder of user alice's "
     "home: a guest could read the keys kept there, or plant what the user runs (share another folder)"),
    ("/usr/local", False, "is in /usr, the host's programs: a guest could change how the host runs "
     "(readonly = true, or share a folder of your own outside /usr)"),
    ("/boot", False, "is /boot, the host's kernels and boot loader: a guest could change how the host runs "
     "(readonly = true, or share a folder of your own outside /boot)"),
    ("/var/lib/data", False, "is in /var, the host's services' data (crontabs, databases, logs): a guest "
     "could change how the host runs (readonly = true, or share a folder of your own outside /var)"),
    ("/var/tmp", False, "is /var/tmp, where every user may keep files: a guest could change theirs "
     "(readonly = true, or share a subfolder of your own)"),
    ("/tmp", False, "is /tmp, where every user may keep files: a guest could change theirs (readonly = "
     "true, or share a subfolder of your own)"),
    ("/srv", False, "is /srv, where every user may keep files: a guest could change theirs (readonly = "
     "true, or share a subfolder of your own)"),
    ("/srv/lab", False, "holds /srv/lab/lab.toml, the lab's spec: a guest could rewrite the lab (readonly = "
     "true, or share a subfolder that does not hold it)"),
])
def test_refused(folder: str, readonly: bool, expected: str) -> None:
    assert refused(folder, readonly=readonly) == expected


def test_within_compares_whole_names() -> None:
    assert refused("/etcetera") is None and refused("/home/alicex") is None and refused("/usrdata") is None
    assert refused("/var/tmpfiles") is not None  # in /var, and not in /var/tmp


# --- as a spec says it -------------------------------------------------------------------------------

HEAD = '[lab]\nname = "g"\n'


def problems(spec: Path) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_checked(spec)
    return [str(problem).replace(str(spec.parent), "DIR") for problem in caught.value.problems]


@pytest.fixture
def lab_dir(tmp_path: Path) -> Path:
    for name in ("k", "a.img", "b.img", "shared/b2.img", "ud.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * 512)
    for name in ("src", "mine", "empty"):
        (tmp_path / name).mkdir()
    return tmp_path


def vm(name: str, *extra: str) -> str:
    return f'[vm.{name}]\nmemory = 64\nkernel = "k"\n' + "".join(extra)


def share(source: str, target: str, readonly: bool = False) -> str:
    text = f'[[vm.a.share]]\nsource = "{source}"\ntarget = "{target}"\n'
    return text + ("readonly = true\n" if readonly else "")


def test_a_share_of_the_spec_folder_of_a_lab_with_a_lab_folder(lab_dir: Path) -> None:
    """`source = "."` holds `.vmlaunch`, where the lab keeps its SSH key: refused, read-only too."""
    image = '[image.deb]\nurl = "https://example.org/d.qcow2"\nsha512 = "' + "ab" * 64 + '"\n'
    spec = write_spec(lab_dir, HEAD + image + '[vm.a]\nmemory = 64\nimage = "deb"\n'
                      + share(".", "/srv", readonly=True))
    assert problems(spec) == [
        "DIR/lab.toml:10: vm.a.share[0].source: a share of DIR is refused: it holds DIR/.vmlaunch, "
        "vmlaunch's lab folder (the lab's SSH key, its VMs' disks): a guest could read what vmlaunch keeps "
        "there (share a subfolder that does not hold it)"]


def test_a_kernel_lab_may_share_its_folder_read_only_but_not_writable(lab_dir: Path) -> None:
    """No lab folder there (a lab of kernels has none): its own kernel and the spec may be read."""
    spec = write_spec(lab_dir, HEAD + vm("a") + share(".", "/srv", readonly=True))
    assert load_checked(spec).vm("a").shares[0].source == lab_dir
    spec.write_text(HEAD + vm("a") + share(".", "/srv"))
    assert problems(spec) == [
        "DIR/lab.toml:7: vm.a.share[0].source: a writable share of DIR is refused: it holds "
        "DIR/lab.toml, the lab's spec: a guest could rewrite the lab (readonly = true, or share a "
        "subfolder that does not hold it)"]


def test_a_symlink_is_the_folder_it_names(lab_dir: Path) -> None:
    (lab_dir / "etc").symlink_to("/etc")
    spec = write_spec(lab_dir, HEAD + vm("a") + share("etc", "/srv", readonly=True))
    assert problems(spec) == [
        "DIR/lab.toml:7: vm.a.share[0].source: a share of DIR/etc (which is /etc) is refused: it is "
        "/etc, the host's configuration (its password hashes, its SSH host keys): a guest could read it "
        "(share another folder)"]


def test_another_vms_disk_is_never_in_a_share(lab_dir: Path) -> None:
    """Read-only or not, through a symlink or not: a guest never reads or writes another VM's disk."""
    (lab_dir / "src" / "disks").symlink_to(lab_dir / "shared")
    text = (HEAD + vm("a", '[[vm.a.disk]]\nfile = "a.img"\n') + share("shared", "/srv/x", readonly=True)
            + share("src", "/srv/y") + vm("b", '[[vm.b.disk]]\nfile = "b.img"\n[[vm.b.disk]]\n'
                                          'file = "src/disks/b2.img"\nreadonly = true\n'))
    spec = write_spec(lab_dir, text)
    assert problems(spec) == [
        "DIR/lab.toml:9: vm.a.share[0].source: a share of DIR/shared is refused: it holds "
        "DIR/shared/b2.img, vm.b's disk[1]: a guest could read another VM's files (share a subfolder "
        "that does not hold it)"]
    (lab_dir / "b.img").rename(lab_dir / "mine" / "b.img")
    spec.write_text(text.replace('source = "shared"', 'source = "mine"').replace('file = "b.img"',
                                                                              'file = "mine/b.img"'))
    assert problems(spec) == [
        "DIR/lab.toml:9: vm.a.share[0].source: a share of DIR/mine is refused: it holds "
        "DIR/mine/b.img, vm.b's disk[0]: a guest could read and write another VM's disk (share a "
        "subfolder that does not hold it)"]


def test_a_writable_share_never_holds_a_writable_disk_even_its_own(lab_dir: Path) -> None:
    (lab_dir / "a.img").rename(lab_dir / "mine" / "a.img")
    text = HEAD + vm("a", '[[vm.a.disk]]\nfile = "mine/a.img"\n') + share("mine", "/srv")
    spec = write_spec(lab_dir, text)
    assert problems(spec) == [
        "DIR/lab.toml:9: vm.a.share[0].source: a writable share of DIR/mine is refused: it holds "
        "DIR/mine/a.img, its own disk[0]: written behind QEMU's back, the disk is corrupted "
        "(readonly = true, or share a subfolder that does not hold it)"]
    spec.write_text(text + "readonly = true\n")
    load_checked(spec)  # its own disk, read: nothing another VM has


def test_vmlaunchs_own_folders_are_never_shared(lab_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(lab_dir / "src" / "run"))
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(lab_dir / "mine" / "cache"))
    os.mkdir(lab_dir / "mine" / "cache")
    spec = write_spec(lab_dir, HEAD + vm("a") + share("src", "/srv/x") + share("mine/cache", "/srv/y", True))
    assert problems(spec) == [
        "DIR/lab.toml:7: vm.a.share[0].source: a writable share of DIR/src is refused: it holds "
        "DIR/src/run, vmlaunch's run folder (every lab's sockets and journal): a guest could read what "
        "vmlaunch keeps there (share a subfolder that does not hold it)",
        "DIR/lab.toml:10: vm.a.share[1].source: a share of DIR/mine/cache is refused: it is "
        "DIR/mine/cache, vmlaunch's cache (its images): a guest could read what vmlaunch keeps there "
        "(share another folder)"]


def test_a_writable_share_never_holds_what_vmlaunch_runs_or_another_vms_user_data(lab_dir: Path) -> None:
    (lab_dir / "src" / "up.sh").write_text("#!/bin/sh\n")
    os.chmod(lab_dir / "src" / "up.sh", 0o755)
    (lab_dir / "ud.yaml").rename(lab_dir / "mine" / "ud.yaml")
    net = '[network.lan]\ntype = "tap"\nup_script = "src/up.sh"\n'
    spec = write_spec(lab_dir, HEAD + net + vm("a") + share("src", "/srv/x") + share("mine", "/srv/y")
                      + vm("b", '[vm.b.cloud_init]\nuser_data = "mine/ud.yaml"\n'))
    assert [problem.split(": a ", 1)[0] for problem in problems(spec)] == [
        "DIR/lab.toml:10: vm.a.share[0].source", "DIR/lab.toml:13: vm.a.share[1].source"]
    assert problems(spec)[0].endswith("holds DIR/src/up.sh, network lan's up_script: vmlaunch runs "
                                      "it: a guest could change what (readonly = true, or share a subfolder "
                                      "that does not hold it)")
    assert problems(spec)[1].endswith("holds DIR/mine/ud.yaml, vm.b's cloud-init user_data: a guest "
                                      "could read another VM's files (share a subfolder that does not "
                                      "hold it)")


def test_the_commands_that_check_files_refuse_it_with_exit_2(lab_dir: Path) -> None:
    """Not a traceback: the line, the share and the fix, for `validate`, `cmdline` and `up`."""
    (lab_dir / "src" / "b.img").write_bytes(b"x" * 512)
    spec = write_spec(lab_dir, HEAD + vm("a") + share("src", "/srv") + vm("b", '[[vm.b.disk]]\nfile = '
                                                                         '"src/b.img"\n'))
    for command in (["validate"], ["cmdline"], ["up", "--dry-run"]):
        done = subprocess.run([sys.executable, "-m", "vmlaunch", *command, str(spec)], capture_output=True,
                              text=True, check=False, timeout=60)
        assert done.returncode == 2, (command, done.stderr)
        assert done.stderr.startswith(f"{spec}:7: vm.a.share[0].source: a writable share of {lab_dir}/src "
                                      f"is refused: it holds {lab_dir}/src/b.img, vm.b's disk[0]: a guest "
                                      "could read and write another VM's disk (share a subfolder that does "
                                      "not hold it)\n"), done.stderr
        assert "Traceback" not in done.stderr
