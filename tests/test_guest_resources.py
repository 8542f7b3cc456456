"""What a real guest keeps beside its spec, on the fast test guest: the busybox kernel boots directly
with an image's overlay as its disk and a NoCloud seed it does not read, which is all these tests need
(the Debian guest in tests/test_guests.py shows cloud-init and SSH for real). User networking only."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import write_spec
from vmlaunch.cli import main

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"


def spec_of(tmp_path: Path, guest: Path, kernel: str = "vmlinuz") -> Path:
    base = tmp_path / "base.qcow2"
    if not base.exists():
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "16M"], check=True)
    return write_spec(tmp_path, f"""
[lab]
name = "gr"
[image.base]
file = "base.qcow2"
[vm.a]
memory = 128
accel = "tcg"
image = "base"
disk_size = "32M"
kernel = "{guest / kernel}"
initrd = "{guest / 'initrd.gz'}"
[vm.a.cloud_init]
user = "dev"
runcmd = ["true"]
""")


def files(tmp_path: Path) -> dict[str, int]:
    """Each file of VM a in the lab dir, by name, with its inode. Each is also hard-linked into
    tmp_path/held, so that its inode stays taken: a file made anew then has another (a freed inode
    number is soon used again)."""
    folder = tmp_path / ".vmlaunch" / "gr" / "a"
    held = tmp_path / "held"
    held.mkdir(exist_ok=True)
    found = {}
    for entry in os.scandir(folder):
        found[entry.name] = entry.stat().st_ino
        if entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileExistsError):
                os.link(entry.path, held / f"{entry.name}-{found[entry.name]}")
    return found


def test_the_lab_dir_lives_across_down_and_fresh(tmp_path: Path, run_dir: Path, test_guest: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from vmlaunch.guests import cloudinit
    from vmlaunch.resources.image import virtual_size
    from vmlaunch.spec.model import DiskFormat

    spec = spec_of(tmp_path, test_guest)
    try:
        assert main(["-q", "up", str(spec), "--wait-for", READY, "--timeout", "120"]) == 0
        first = files(tmp_path)
        assert set(first) == {"disk.qcow2", "seed.iso", "instance-id", "ssh_host_ed25519_key",
                              "ssh_host_ed25519_key.pub"}
        overlay = tmp_path / ".vmlaunch" / "gr" / "a" / "disk.qcow2"
        assert virtual_size(overlay, DiskFormat.QCOW2, overlay.stat()) == 32 << 20  # disk_size
        assert oct(overlay.stat().st_mode & 0o777) == "0o600"
        seed = cloudinit.read_seed(tmp_path / ".vmlaunch" / "gr" / "a" / "seed.iso")
        assert "instance-id" in seed["meta-data"] and "dev" in seed["user-data"]
        assert (tmp_path / ".vmlaunch" / "gr" / "ssh" / "known_hosts").read_text().startswith(
            "vmlaunch-gr-a ssh-ed25519 ")
        capsys.readouterr()
        assert main(["status", str(spec), "--json"]) == 0
        port = json.loads(capsys.readouterr().out)["a"]["ssh_port"]
        assert isinstance(port, int) and port > 0  # the kernel's pick, read back over QMP
        assert main(["reset", str(spec)]) == 4  # a running VM cannot be reset
        assert "a is up" in capsys.readouterr().err
        assert main(["-q", "down", str(spec), "--timeout", "1"]) == 0
        assert files(tmp_path) == first  # down keeps the machine
        assert main(["-q", "up", str(spec), "--wait-for", READY, "--timeout", "120"]) == 0
        again = files(tmp_path)
        assert again["disk.qcow2"] == first["disk.qcow2"]  # the same overlay: the same machine
        assert again["instance-id"] == first["instance-id"]
        assert main(["-q", "down", str(spec), "--timeout", "1"]) == 0
        instance = (tmp_path / ".vmlaunch" / "gr" / "a" / "instance-id").read_text()
        assert main(["-q", "up", str(spec), "--fresh", "--wait-for", READY, "--timeout", "120"]) == 0
        fresh = files(tmp_path)
        assert fresh["disk.qcow2"] != first["disk.qcow2"]  # made anew from the image
        assert (tmp_path / ".vmlaunch" / "gr" / "a" / "instance-id").read_text() != instance
        assert fresh["ssh_host_ed25519_key"] == first["ssh_host_ed25519_key"]  # its identity stays
        assert main(["-q", "down", str(spec), "--timeout", "1"]) == 0
        assert main(["reset", str(spec), "a"]) == 0
        assert set(files(tmp_path)) == {"ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"}
    finally:
        main(["-q", "down", str(spec), "--timeout", "1"])


def test_a_first_up_that_fails_leaves_no_lab_dir(tmp_path: Path, run_dir: Path, test_guest: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    not_a_kernel = tmp_path / "not-a-kernel"
    not_a_kernel.write_bytes(b"\x7fELF" + bytes(4092))
    spec = spec_of(tmp_path, tmp_path, kernel="not-a-kernel")
    (tmp_path / "initrd.gz").write_bytes(b"x")
    assert main(["-q", "up", str(spec), "--timeout", "30"]) == 4
    assert "Error while loading elf kernel" in capsys.readouterr().err
    assert not (tmp_path / ".vmlaunch").exists()
    assert not (run_dir / "gr").exists()


@pytest.mark.parametrize(("files", "said"), [
    ({"enabled": "", "result.json": '{\n "v1": {\n  "datasource": "x",\n  "errors": []\n }\n}\n'},
     "cloud-init:0"),
    ({"enabled": "", "result.json": '{\n "v1": {\n  "errors": [\n   "boom"\n  ]\n }\n}\n'}, "cloud-init:1"),
    ({}, "cloud-init:0"),  # the directory without `enabled`: disabled by its generator
    (None, "cloud-init:5"),  # no directory: `cloud-init status --wait` is asked
])
def test_wait_ssh_reads_cloud_inits_result(tmp_path: Path, files: dict[str, str] | None, said: str) -> None:
    """The shell `--wait ssh` runs in the guest, here with a stand-in /run/cloud-init and cloud-init."""
    from vmlaunch.runtime.executor import _CLOUD_INIT_DONE

    run_dir = tmp_path / "run-cloud-init"
    if files is not None:
        run_dir.mkdir()
        for name, text in files.items():
            (run_dir / name).write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cloud-init").write_text("#!/bin/sh\nexit 5\n")
    (bin_dir / "cloud-init").chmod(0o755)
    script = _CLOUD_INIT_DONE.replace("r=/run/cloud-init", f"r={run_dir}")
    assert script != _CLOUD_INIT_DONE
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10, check=False,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert done.stdout.strip() == said


def test_wait_ssh_without_cloud_init_is_done_at_once() -> None:
    from vmlaunch.runtime.executor import _CLOUD_INIT_DONE

    done = subprocess.run(["/bin/sh", "-c", _CLOUD_INIT_DONE], capture_output=True, text=True, timeout=10,
                          check=False, env={"PATH": "/nonexistent"})
    assert (done.returncode, done.stdout) == (0, "")


def test_a_guest_refusing_its_cpu_ends_the_wait_with_the_fix() -> None:
    """RHEL 9 under QEMU's default CPU: glibc's message on the console, then nothing ever answers."""
    from types import SimpleNamespace
    from typing import cast

    from vmlaunch.compile.plan import VmPlan
    from vmlaunch.errors import RuntimeFailure
    from vmlaunch.runtime.executor import check_cpu_level

    vm = cast(VmPlan, SimpleNamespace(name="rhel", argv=("qemu", "-cpu", "qemu64", "-m", "1G")))
    check_cpu_level(vm, "Booting\nWelcome to Rocky Linux 9\n")
    with pytest.raises(RuntimeFailure) as raised:
        check_cpu_level(vm, "[    2.1] Run /init\nFatal glibc error: CPU does not support x86-64-v2\n"
                            "[    2.2] Kernel panic")
    assert raised.value.message == ('rhel: its OS needs an x86-64-v2 CPU (its console says "CPU does not '
                                    'support x86-64-v2"), and -cpu qemu64 is not one')
    assert raised.value.hint == 'set cpu_model = "max" in vm.rhel: every x86-64 level'


def vmlaunch_in_new_netns(*args: str, lo_up: bool, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The CLI in a network namespace of its own (the host's network is never touched), whose
    loopback is left down as `unshare -n` makes it, or brought up first."""
    import sys

    command = " ".join(["exec", sys.executable, "-m", "vmlaunch", *(f"'{arg}'" for arg in args)])
    script = f"{'ip link set lo up; ' if lo_up else ''}{command}"
    return subprocess.run(["unshare", "-n", "--", "sh", "-c", script], capture_output=True, text=True,
                          timeout=240, check=False, env={**os.environ, **env})


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of its own needs root here")
def test_wait_ssh_says_why_ssh_fails_and_ends_at_once_when_waiting_cannot_help(
        tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    """The loopback of the namespace down: no probe can reach the forwarded port, so `up --wait ssh`
    ends at once, with the fix, and rolls back. With it up, the test guest (no sshd) never answers:
    every progress line and the timeout say what SSH said last."""
    spec = spec_of(tmp_path, test_guest)
    env = {"VMLAUNCH_RUN_DIR": str(run_dir)}
    down = vmlaunch_in_new_netns("up", str(spec), "--wait", "ssh", "--timeout", "300", lo_up=False, env=env)
    assert down.returncode == 4, down.stderr
    assert "a: SSH cannot reach 127.0.0.1:" in down.stderr
    assert "Network is unreachable; waiting would not help" in down.stderr
    assert "`ip link set lo up`" in down.stderr and "Traceback" not in down.stderr
    assert not (run_dir / "gr").exists()  # rolled back: no QEMU, no run dir

    up = vmlaunch_in_new_netns("up", str(spec), "--wait", "ssh", "--timeout", "12", lo_up=True, env=env)
    assert up.returncode == 4, up.stderr
    progress = [line for line in up.stderr.splitlines() if "a: waiting for SSH" in line]
    assert progress and all("; SSH: " in line for line in progress), up.stderr
    assert "timed out after 12 s waiting for SSH on a" in up.stderr
    assert "a: SSH said last: " in up.stderr
    assert not (run_dir / "gr").exists()
