"""End to end: the real `vmlaunch up` / `down` with real QEMU (TCG) and the test guest.

Each test runs the CLI inside its own network namespace (`ip netns add`, then `ip netns exec`), so
bridges, taps and forwarded ports never touch the host's network; the namespace is deleted after.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"

if os.geteuid() != 0:  # pragma: no cover - CI and the README's machines run as root
    pytest.skip("network namespaces with `ip netns` need root", allow_module_level=True)


class Netns:
    def __init__(self, name: str, run_root: Path) -> None:
        self.name = name
        self.run_root = run_root
        self.env: dict[str, str] = {}  # more environment for every vmlaunch run in it

    def _command(self, args: tuple[str, ...], as_user: tuple[int, int] | None,
                 env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
        drop = ["setpriv", f"--reuid={as_user[0]}", f"--regid={as_user[1]}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all"] if as_user else []
        argv = ["ip", "netns", "exec", self.name, *drop, sys.executable, "-m", "vmlaunch", *args]
        return argv, {**os.environ, "VMLAUNCH_RUN_DIR": str(self.run_root), **self.env, **(env or {})}

    def vmlaunch(self, *args: str, timeout: float = 180, as_user: tuple[int, int] | None = None,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run the CLI in the namespace; `as_user` (uid, gid) drops root and every capability."""
        argv, full_env = self._command(args, as_user, env)
        return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout,
                              check=False)

    def spawn(self, *args: str, **popen: Any) -> subprocess.Popen[Any]:
        """The CLI in the background (`ip netns exec` execs: signals reach vmlaunch itself)."""
        argv, env = self._command(args, None, None)
        return subprocess.Popen(argv, env=env, **popen)

    def ip(self, *args: str) -> str:
        return subprocess.run(["ip", "netns", "exec", self.name, "ip", *args], capture_output=True,
                              text=True, check=True).stdout

    def links(self) -> set[str]:
        return {link["ifname"] for link in json.loads(self.ip("-j", "link", "show"))}


def qemu_pids(run_root: Path) -> list[int]:
    """QEMU processes whose command line names this test's run dir."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmdline and str(run_root).encode() in cmdline:
                pids.append(int(proc.name))
    return pids


@pytest.fixture
def netns(tmp_path: Path) -> Iterator[Netns]:
    with netns_named() as made:
        yield made


@contextlib.contextmanager
def netns_named() -> Iterator[Netns]:
    """A private network namespace (and run root) for one test or module; gone afterwards."""
    import tempfile

    name = f"vltest-{uuid.uuid4().hex[:8]}"
    run_root = Path(tempfile.mkdtemp(prefix="vl-"))  # short: unix socket paths are limited
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    try:
        yield Netns(name, run_root)
    finally:
        for pid in qemu_pids(run_root):  # whatever a failing test left behind
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], check=False)
        subprocess.run(["rm", "-rf", str(run_root)], check=False)


def lab(tmp_path: Path, guest: Path, text: str) -> Path:
    spec = tmp_path / "lab.toml"
    spec.write_text(text.replace("GUEST", str(guest)))
    return spec


def one_vm(name: str = "solo", append: str = "console=ttyS0", kernel: str = "GUEST/vmlinuz") -> str:
    return f"""
[lab]
name = "{name}"
[network.out]
type = "user"
forward = ["tcp:127.0.0.1:2222-:22"]
[vm.solo]
memory = "256M"
accel = "tcg"
kernel = "{kernel}"
initrd = "GUEST/initrd.gz"
append = "{append}"
[[vm.solo.disk]]
file = "solo.img"
size = "16M"
[[vm.solo.nic]]
network = "out"
"""


def pair(name: str, network: str, ping: str | None = None, memory: str = "128M") -> str:
    """A lab of VMs a (10.N.0.1) and b (10.N.0.2) on `network`; b pings a at boot when `ping` is set."""
    import base64

    script = ""
    if ping:
        script = f" vl.run={base64.b64encode(f'sleep 1; ping -c 3 -W 3 {ping}'.encode()).decode()}"
    net = (ping or "10.6.0.1").rsplit(".", 1)[0]
    text = f'[lab]\nname = "{name}"\n{network}\n'
    for vm, host, extra in (("a", 1, ""), ("b", 2, script)):
        text += (f'[vm.{vm}]\nmemory = "{memory}"\naccel = "tcg"\nkernel = "GUEST/vmlinuz"\n'
                 f'initrd = "GUEST/initrd.gz"\nappend = "console=ttyS0 vl.ip=eth0:{net}.{host}/24{extra}"\n'
                 f'[[vm.{vm}.nic]]\nnetwork = "lan"\n')
    return text


def assert_clean(netns: Netns, name: str) -> None:
    assert qemu_pids(netns.run_root) == []
    assert not (netns.run_root / name).exists()
    assert list(netns.run_root.iterdir()) == []  # no run dir, no lock file


def test_up_write_down_keeps_the_image(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, one_vm(append="console=ttyS0 vl.mark=fsynced"))
    done = netns.vmlaunch("up", str(spec), "--wait-for", READY)
    assert done.returncode == 0, done.stderr
    assert "solo: running (pid" in done.stdout
    run_dir = netns.run_root / "solo"
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((run_dir / "solo.qmp").stat().st_mode & 0o777) == "0o600"
    assert READY in (run_dir / "solo.serial.log").read_text()
    again = netns.vmlaunch("up", str(spec))
    assert again.returncode == 0 and "every VM already runs" in again.stderr
    done = netns.vmlaunch("down", str(spec))
    assert done.returncode == 0, done.stderr
    assert "solo: powered off" in done.stderr  # the guest handled the ACPI power button
    assert (tmp_path / "solo.img").read_bytes().startswith(b"VMLAUNCH-MARK:fsynced\n")
    assert_clean(netns, "solo")
    second = netns.vmlaunch("down", str(spec))
    assert (second.returncode, second.stdout.strip()) == (0, "lab solo is not up")


def test_a_disk_root_made_says_whose_it_is_to_another_user(netns: Netns, test_guest: Path) -> None:
    """Root's `up` makes a missing disk as its user's umask says (0644 under 022), not under the run
    dir's 077; another user's `validate` of the lab says whose the disk is and how to have it."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="vl-shared-"))  # a shared checkout: every user may enter
    folder.chmod(0o755)
    nobody = (65534, 65534)
    umask = os.umask(0o022)
    try:
        spec = lab(folder, test_guest, one_vm())
        done = netns.vmlaunch("up", str(spec))
        assert done.returncode == 0, done.stderr
        disk = folder / "solo.img"
        assert (disk.stat().st_uid, oct(disk.stat().st_mode & 0o777)) == (0, "0o644")
        mistake = netns.vmlaunch("validate", str(spec), as_user=nobody)
        assert mistake.returncode == 2 and "Traceback" not in mistake.stderr
        assert (f"vm.solo.disk[0].file: {disk} is not writable by you (the VM writes to this disk): it is "
                f"root's, mode 0644 (a lab brought up by root made it or used it: `sudo chown nobody: "
                f"{disk}` gives it to you (or remove it, if its data may go: `up` makes it anew); or add "
                "readonly = true to the disk if the VM only reads it)") in mistake.stderr
        disk.chmod(0o600)  # as an `up` as root made its disks before
        mistake = netns.vmlaunch("validate", str(spec), as_user=nobody)
        assert f"{disk} is not readable by you: it is root's, mode 0600 (a lab brought up by root" \
            in mistake.stderr
        os.chown(disk, *nobody)  # what the hint says to do
        given = netns.vmlaunch("validate", str(spec), as_user=nobody)
        assert given.returncode == 0, given.stderr
        # up did not wait for the guest: it may not hear the ACPI button yet (no clean power-off is
        # tested here; the default 10 s would be waited out for nothing)
        assert netns.vmlaunch("down", str(spec), "--timeout", "1").returncode == 0
    finally:
        os.umask(umask)
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_status_from_another_spec_file_of_the_lab_name_says_which_is_up(tmp_path: Path, netns: Netns,
                                                                        test_guest: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, two = (lab(tmp_path / folder, test_guest, one_vm("twin")) for folder in ("one", "two"))
    done = netns.vmlaunch("up", str(one))
    assert done.returncode == 0, done.stderr
    try:
        mine = netns.vmlaunch("status", str(one))
        assert mine.returncode == 0 and "warning" not in mine.stderr, mine.stderr
        other = netns.vmlaunch("status", str(two))
        assert other.returncode == 0, other.stderr
        assert (f"vmlaunch: warning: lab twin is up from another spec file, {one}, not {two}: what follows "
                "is that lab's VMs, as this file names them") in other.stderr.splitlines()
        assert "solo" in other.stdout and "running" in other.stdout
        as_json = netns.vmlaunch("status", str(two), "--json")
        assert json.loads(as_json.stdout)["solo"] and f"from another spec file, {one}," in as_json.stderr
    finally:  # up did not wait for the guest: see test_a_disk_root_made_says_whose_it_is_to_another_user
        assert netns.vmlaunch("down", str(one), "--timeout", "1").returncode == 0


def test_failed_start_leaves_nothing(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    (tmp_path / "not-a-kernel").write_bytes(b"\x7fELF" + bytes(4092))  # a file, but no kernel
    spec = lab(tmp_path, test_guest, one_vm(kernel=str(tmp_path / "not-a-kernel")))
    done = netns.vmlaunch("up", str(spec))
    assert done.returncode == 4
    assert "Error while loading elf kernel" in done.stderr  # QEMU's own words
    assert "command: " in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "solo.img").exists()  # the image this up created is gone again
    assert_clean(netns, "solo")
    logs = netns.vmlaunch("logs", "--qemu", str(spec), "solo")  # why, still there after the rollback
    assert logs.returncode == 0 and "Error while loading elf kernel" in logs.stdout


def test_a_missing_kernel_is_a_spec_error_before_anything_starts(tmp_path: Path, netns: Netns,
                                                                test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, one_vm(kernel="GUEST/no-such-kernel"))
    done = netns.vmlaunch("up", str(spec))
    assert done.returncode == 2, done.stderr
    assert f"{spec}:10: vm.solo.kernel: {test_guest}/no-such-kernel does not exist" in done.stderr
    assert "command: " not in done.stderr
    assert not (tmp_path / "solo.img").exists()
    assert_clean(netns, "solo")


def test_down_after_qemu_was_killed(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, one_vm())
    assert netns.vmlaunch("up", str(spec)).returncode == 0
    (pid,) = qemu_pids(netns.run_root)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    status = json.loads(netns.vmlaunch("status", str(spec), "--json").stdout)
    assert status["solo"]["state"] == "crashed"
    done = netns.vmlaunch("down", str(spec))
    assert done.returncode == 0, done.stderr
    assert "solo: not running" in done.stderr
    assert_clean(netns, "solo")


def test_down_after_up_was_killed(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    """A vmlaunch killed while waiting: the state file already knows the VM, so down cleans up."""
    spec = lab(tmp_path, test_guest, one_vm())
    proc = netns.spawn("up", str(spec), "--wait-for", "never printed", "--timeout", "120",
                       stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not qemu_pids(netns.run_root):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    # The guest is still booting: its init has not started acpid, so an ACPI press is lost; the
    # default 10 s would be waited out for nothing (what is tested is that down finds the VM).
    done = netns.vmlaunch("down", str(spec), "--timeout", "1")
    assert done.returncode == 0, done.stderr
    assert_clean(netns, "solo")


def test_concurrent_up_waits_for_the_lock(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, one_vm())
    first = netns.spawn("up", str(spec), "--wait-for", READY, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    second = netns.vmlaunch("up", str(spec), "--timeout", "0.5")
    assert second.returncode == 4
    assert "lab solo is busy" in second.stderr
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert json.loads((netns.run_root / "solo" / "state.json").read_text())["vms"]["solo"]["pid"]
    assert netns.vmlaunch("down", str(spec)).returncode == 0
    assert_clean(netns, "solo")


def test_two_vms_on_a_bridge_ping_each_other(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, pair("pair", '[network.lan]\nbridge = "vlbr-pair"\nmtu = 9000',
                                          ping="10.7.0.1", memory="192M"))
    done = netns.vmlaunch("up", str(spec), "--wait-for", READY, "--timeout", "150")
    assert done.returncode == 0, done.stderr
    links = netns.links()
    assert "vlbr-pair" in links
    taps = {name for name in links if name.startswith("vl-")}
    assert len(taps) == 2
    mtu = json.loads(netns.ip("-j", "link", "show", "vlbr-pair"))[0]["mtu"]
    assert mtu == 9000
    log = (netns.run_root / "pair" / "b.serial.log").read_text()
    assert "3 packets transmitted, 3 packets received, 0% packet loss" in log, log[-2000:]
    done = netns.vmlaunch("down", str(spec))
    assert done.returncode == 0, done.stderr
    assert netns.links() == {"lo"}  # no tap, no bridge
    assert_clean(netns, "pair")


def test_down_keeps_a_bridge_it_did_not_create(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    netns.ip("link", "add", "br-mine", "type", "bridge")
    spec = lab(tmp_path, test_guest, """
[lab]
name = "guest-of-mine"
[network.lan]
bridge = "br-mine"
[vm.a]
memory = "128M"
accel = "tcg"
kernel = "GUEST/vmlinuz"
initrd = "GUEST/initrd.gz"
[[vm.a.nic]]
network = "lan"
""")
    assert netns.vmlaunch("up", str(spec)).returncode == 0
    assert netns.vmlaunch("down", str(spec), "--timeout", "1").returncode == 0
    assert netns.links() == {"lo", "br-mine"}


@pytest.fixture
def request_cleanup() -> Iterator[list[Path]]:
    paths: list[Path] = []
    yield paths
    for path in paths:
        subprocess.run(["rm", "-rf", str(path)], check=False)


def test_socket_network_needs_no_root(netns: Netns, test_guest: Path,
                                      request_cleanup: list[Path]) -> None:
    """Two VMs on a `type = "socket"` network ping each other, with vmlaunch run as an ordinary user."""
    import pwd
    import shutil
    import tempfile

    nobody = pwd.getpwnam("nobody")
    user = (nobody.pw_uid, nobody.pw_gid)
    probe = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", sys.executable,
             "-c", "import vmlaunch"]
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        pytest.skip("this Python cannot be run by user nobody")
    work = Path(tempfile.mkdtemp(prefix="vl-nobody-"))  # pytest's own tmp dirs are root's alone
    request_cleanup.append(work)
    guest = work / "guest"
    shutil.copytree(test_guest, guest)
    spec = lab(work, guest, pair("plain", '[network.lan]\ntype = "socket"', ping="10.8.0.1"))
    for path in (work, *work.rglob("*"), netns.run_root):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    os.chmod(work, 0o755)
    env = {"VMLAUNCH_CACHE_DIR": str(work / "cache"), "HOME": str(work)}
    done = netns.vmlaunch("up", str(spec), "--wait-for", READY, "--timeout", "150", as_user=user,
                          env=env)
    assert done.returncode == 0, done.stderr
    log = (netns.run_root / "plain" / "b.serial.log").read_text()
    assert "3 packets transmitted, 3 packets received, 0% packet loss" in log, log[-2000:]
    assert all(Path(f"/proc/{pid}").stat().st_uid == nobody.pw_uid for pid in qemu_pids(netns.run_root))
    done = netns.vmlaunch("down", str(spec), as_user=user, env=env)
    assert done.returncode == 0, done.stderr
    assert_clean(netns, "plain")


def console_run(netns: Netns, spec: Path, command: str, expect: str, timeout: float = 30) -> str:
    """Type `command` on the VM's serial console, read until `expect` shows, detach with Ctrl-]."""
    import select

    proc = netns.spawn("console", str(spec), "solo", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"\n{command}\n".encode())
    proc.stdin.flush()
    seen = b""
    deadline = time.monotonic() + timeout
    while expect.encode() not in seen and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            seen += os.read(proc.stdout.fileno(), 4096)
    proc.stdin.write(b"\x1d")
    proc.stdin.flush()
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert b"[detached from solo]" in err
    return seen.decode(errors="replace")


def test_balloon_lowers_memtotal_and_console(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    import re

    spec = lab(tmp_path, test_guest, one_vm())
    assert netns.vmlaunch("up", str(spec), "--wait-for", READY).returncode == 0
    mem = r"MemTotal: +(\d+) kB"
    before = int(re.findall(mem, console_run(netns, spec, "grep MemTotal /proc/meminfo", "kB"))[-1])
    done = netns.vmlaunch("balloon", str(spec), "solo", "128M")
    assert (done.returncode, done.stdout.strip()) == (0, "solo: 128M"), done.stderr
    assert netns.vmlaunch("balloon", str(spec), "solo").stdout.strip() == "solo: 128M"
    holder = netns.spawn("console", str(spec), "solo", stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    time.sleep(1)
    second = netns.vmlaunch("console", str(spec), "solo")
    assert second.returncode == 4 and "another console is attached to solo" in second.stderr
    holder.communicate(b"\x1d", timeout=10)
    after_text = console_run(netns, spec, "sleep 1; grep MemTotal /proc/meminfo", "kB\r\n/ #")
    after = int(re.findall(mem, after_text)[-1])
    assert after < before - 100 * 1024  # the guest lost (at least) most of the 128 MiB
    status = json.loads(netns.vmlaunch("status", str(spec), "--json").stdout)
    assert status["solo"]["state"] == "running" and status["solo"]["balloon_bytes"] == 128 << 20
    reply = netns.vmlaunch("qmp", str(spec), "solo", "query-status")
    assert json.loads(reply.stdout)["status"] == "running"
    bad = netns.vmlaunch("qmp", str(spec), "solo", "no-such-command")
    assert bad.returncode == 4 and "has not been found" in bad.stderr
    assert netns.vmlaunch("balloon", str(spec), "nobody").returncode == 64
    assert netns.vmlaunch("down", str(spec)).returncode == 0
    stopped = netns.vmlaunch("balloon", str(spec), "solo")
    assert stopped.returncode == 4 and "VM solo is not running" in stopped.stderr
    assert_clean(netns, "solo")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_up_rolls_back(tmp_path: Path, netns: Netns, test_guest: Path, sig: int) -> None:
    spec = lab(tmp_path, test_guest, one_vm().replace('type = "user"\nforward = ["tcp:127.0.0.1:2222-:22"]',
                                                      'bridge = "vlbr-int"'))
    proc = netns.spawn("up", str(spec), "--wait-for", "never printed", "--timeout", "120",
                       stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not qemu_pids(netns.run_root):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    assert "vlbr-int" in netns.links()
    proc.send_signal(sig)  # `ip netns exec` execs, so this is vmlaunch itself
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (130, 143), err
    assert "Traceback" not in err
    assert netns.links() == {"lo"}  # tap and bridge rolled back
    assert not (tmp_path / "solo.img").exists()
    assert_clean(netns, "solo")


def test_down_of_one_vm_keeps_what_the_others_use(tmp_path: Path, netns: Netns,
                                                  test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, pair("part", '[network.lan]\nbridge = "vlbr-part"'))
    assert netns.vmlaunch("up", str(spec), "a").returncode == 0
    assert netns.vmlaunch("up", str(spec)).returncode == 0  # starts only b
    assert len([link for link in netns.links() if link.startswith("vl-")]) == 2
    done = netns.vmlaunch("down", str(spec), "a", "--timeout", "1")
    assert done.returncode == 0, done.stderr
    states = {name: row["state"] for name, row in
              json.loads(netns.vmlaunch("status", str(spec), "--json").stdout).items()}
    assert states == {"a": "stopped", "b": "running"}
    assert "vlbr-part" in netns.links()
    assert len([link for link in netns.links() if link.startswith("vl-")]) == 1
    assert netns.vmlaunch("down", str(spec), "--timeout", "1").returncode == 0
    assert netns.links() == {"lo"}
    assert_clean(netns, "part")


def test_balloon_without_a_guest_driver_fails_clearly(tmp_path: Path, netns: Netns) -> None:
    """A VM with a blank disk: the firmware finds nothing to boot, so no balloon driver answers."""
    spec = tmp_path / "lab.toml"
    spec.write_text('[lab]\nname = "blank"\n[vm.solo]\nmemory = "128M"\naccel = "tcg"\n'
                    '[[vm.solo.disk]]\nfile = "blank.img"\nsize = "1M"\n')
    assert netns.vmlaunch("up", str(spec)).returncode == 0
    done = netns.vmlaunch("balloon", str(spec), "solo", "64M", "--timeout", "2")
    assert done.returncode == 4
    assert "did not move its memory towards 64M within 2 s (it stays at 128M)" in done.stderr
    assert "virtio_balloon" in done.stderr and "Traceback" not in done.stderr
    follow = netns.spawn("logs", "--follow", str(spec), "solo", stdout=subprocess.PIPE, text=True)
    assert netns.vmlaunch("down", str(spec), "--timeout", "1").returncode == 0
    out, _ = follow.communicate(timeout=20)  # --follow ends when the VM stops
    assert follow.returncode == 0
    assert_clean(netns, "blank")


def slow_qemu(tmp_path: Path) -> Path:
    """A QEMU that takes 3 s to start (a wrapper that waits, then becomes QEMU): a window to interrupt
    `up` while QEMU starts. Its probes (-version, -help) are answered at once."""
    import shutil

    wrapper = tmp_path / "qemu-system-x86_64"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -S "*) sleep 3;; esac\n'
                       f'exec {shutil.which("qemu-system-x86_64")} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
def test_interrupt_while_qemu_starts(tmp_path: Path, netns: Netns, test_guest: Path,
                                     signals: int) -> None:
    """SIGTERM while QEMU daemonizes, and a second one during the rollback: no QEMU survives."""
    spec = lab(tmp_path, test_guest, one_vm())
    argv, env = netns._command(("up", str(spec)), None,
                               {"VMLAUNCH_QEMU": str(slow_qemu(tmp_path)),
                                "VMLAUNCH_CACHE_DIR": str(tmp_path / "cache")})
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not qemu_pids(netns.run_root):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(signals):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=60)
    # A second signal can land after the rollback, while vmlaunch exits: it then dies of it.
    assert proc.returncode in (143, -signal.SIGTERM), err
    assert "Traceback" not in err
    assert_clean(netns, "solo")


def test_an_up_killed_before_its_guests_ran_is_finished_by_the_next_up(
        tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    """Killed once its QEMU started (paused) but before it let it run, the instant a SIGKILL leaves
    for good (made exact here: vmlaunch dies where it would `cont`). `status` says so, and the next
    `up` starts it anew (its tap, journaled, is kept)."""
    spec = lab(tmp_path, test_guest, one_vm().replace('type = "user"\nforward = ["tcp:127.0.0.1:2222-:22"]',
                                                      'bridge = "vlbr-kill"'))
    killed_at_cont = ("import os, sys; import vmlaunch.runtime.executor as e; "
                      "e._waves = lambda *a, **k: os._exit(9); "
                      "from vmlaunch.cli import main; sys.exit(main(sys.argv[1:]))")
    argv, env = netns._command(("up", str(spec)), None, None)
    argv[argv.index("-m"):argv.index("vmlaunch") + 1] = ["-c", killed_at_cont]
    assert subprocess.run(argv, env=env, capture_output=True, timeout=120, check=False).returncode == 9
    row = json.loads(netns.vmlaunch("status", str(spec), "--json").stdout)["solo"]
    assert (row["state"], row["run_state"]) == ("starting", "prelaunch"), row
    assert "`vmlaunch up SPEC` starts it again" in row["why"]
    again = netns.vmlaunch("up", str(spec), "--wait-for", READY)
    assert again.returncode == 0, again.stderr
    assert "solo: its guest never ran (an earlier up was interrupted" in again.stderr
    row = json.loads(netns.vmlaunch("status", str(spec), "--json").stdout)["solo"]
    assert row["state"] == "running" and len(qemu_pids(netns.run_root)) == 1
    assert netns.vmlaunch("down", str(spec)).returncode == 0
    assert netns.links() == {"lo"}
    assert_clean(netns, "solo")


def test_a_stopped_qemu_cannot_hang_status_or_down(tmp_path: Path, netns: Netns,
                                                   test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, one_vm())
    assert netns.vmlaunch("up", str(spec)).returncode == 0
    (pid,) = qemu_pids(netns.run_root)
    os.kill(pid, signal.SIGSTOP)  # QMP never answers now
    status = netns.vmlaunch("status", str(spec), "--json", timeout=30)
    row = json.loads(status.stdout)["solo"]
    assert (row["state"], row["run_state"]) == ("unresponsive", None)  # not "running": it does not answer
    assert row["why"] == "its QMP did not answer within 2 s"
    balloon = netns.vmlaunch("balloon", str(spec), "solo", timeout=30)
    assert balloon.returncode == 4 and "Traceback" not in balloon.stderr
    done = netns.vmlaunch("down", str(spec), "--timeout", "1", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "solo: killed" in done.stderr
    assert_clean(netns, "solo")


def test_restart_waits_for_the_new_boot(tmp_path: Path, netns: Netns, test_guest: Path) -> None:
    """A fresh serial log per boot: --wait-for cannot match what the previous boot printed."""
    spec = lab(tmp_path, test_guest, one_vm())
    assert netns.vmlaunch("up", str(spec), "--wait-for", READY).returncode == 0
    os.kill(qemu_pids(netns.run_root)[0], signal.SIGKILL)
    time.sleep(0.2)
    done = netns.vmlaunch("up", str(spec), "--wait-for", READY)
    assert done.returncode == 0, done.stderr
    log = (netns.run_root / "solo" / "solo.serial.log").read_text()
    assert log.count(READY) == 1
    assert netns.vmlaunch("down", str(spec)).returncode == 0
    assert_clean(netns, "solo")


def qemu_argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_a_tcg_guest_boots_through_pvh_from_its_kernel_decompressed_once(tmp_path: Path, netns: Netns,
                                                                         test_guest: Path) -> None:
    """The test guest's XZ bzImage, decompressed by the first up into a cache of this test's own, boots
    through its PVH entry to READY (QEMU running confined, as root's ups do); cmdline and --dry-run
    say which kernel boots and why, and write nothing."""
    cache = tmp_path / "cache"
    netns.env["VMLAUNCH_CACHE_DIR"] = str(cache)
    spec = lab(tmp_path, test_guest, one_vm())
    dry = netns.vmlaunch("up", str(spec), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "note: solo: kernel " in dry.stderr
    assert "vmlinuz boots as a bzImage for now: `up` decompresses its xz payload once" in dry.stderr
    assert f"-kernel {test_guest}/vmlinuz " in dry.stdout
    assert not list((cache / "kernels").glob("sha256-*"))
    done = netns.vmlaunch("up", str(spec), "--wait-for", READY)
    assert done.returncode == 0, done.stderr
    assert "vmlinuz boots through its PVH entry from the ELF its xz payload decompresses to" in done.stderr
    (pid,) = qemu_pids(netns.run_root)
    argv = qemu_argv(pid)
    elf = Path(argv[argv.index("-kernel") + 1])
    assert elf.parent == cache / "kernels" and elf.suffix == ".elf"
    assert elf.read_bytes()[:4] == b"\x7fELF"
    assert READY in (netns.run_root / "solo" / "solo.serial.log").read_text()
    shown = netns.vmlaunch("cmdline", str(spec))  # the note was said by up: once per kernel
    assert f"-kernel {elf} " in shown.stdout and "boots through its PVH entry" not in shown.stderr
    assert "boots through its PVH entry" in netns.vmlaunch("-v", "cmdline", str(spec)).stderr
    assert netns.vmlaunch("down", str(spec), "--timeout", "0").returncode == 0
    assert_clean(netns, "solo")


def test_bad_inputs_and_host_problems_are_messages(tmp_path: Path, netns: Netns,
                                                   test_guest: Path) -> None:
    spec = lab(tmp_path, test_guest, one_vm())
    for args in (("down", str(spec), "typo"), ("balloon", str(spec), "solo", "0"),
                 ("balloon", str(spec), "solo", "1G")):
        done = netns.vmlaunch(*args)
        assert done.returncode == 64, (args, done.stderr)
        assert "Traceback" not in done.stderr
    run_dir = netns.run_root / "solo"
    run_dir.mkdir()
    (run_dir / "state.json").write_text('{"vms": {"solo": {"pid": null}}, "resources": [{"kind": 1}]}')
    for command in ("status", "down", "up"):
        done = netns.vmlaunch(command, str(spec))
        assert done.returncode == 4, (command, done.stderr)
        assert "is not one vmlaunch wrote" in done.stderr and "Traceback" not in done.stderr
    run_dir.joinpath("state.json").unlink()
    run_dir.rmdir()
    done = netns.vmlaunch("up", str(spec), env={"VMLAUNCH_RUN_DIR": "/proc/no-such-place"})
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_down_force_after_an_unreadable_journal_takes_everything_down(
        tmp_path: Path, netns: Netns, test_guest: Path, damage: str) -> None:
    """What does not depend on the journal: the QEMUs by their pidfiles, the taps by their mark, the
    bridge by the registry; the lab is gone and the run root clean afterwards."""
    spec = lab(tmp_path, test_guest, pair("lost", '[network.lan]\nbridge = "vlbr-lost"'))
    assert netns.vmlaunch("up", str(spec)).returncode == 0
    assert {"vlbr-lost"} < netns.links() and len([n for n in netns.links() if n.startswith("vl-")]) == 2
    state = netns.run_root / "lost" / "state.json"
    state.write_text(state.read_text()[:40] if damage == "truncated" else "")
    refused = netns.vmlaunch("status", str(spec))
    assert refused.returncode == 4 and "--force" in refused.stderr and "Traceback" not in refused.stderr
    done = netns.vmlaunch("down", str(spec), "--force", "--timeout", "5")
    assert done.returncode == 0, done.stderr
    assert "a: " in done.stderr and "b: " in done.stderr and "found by its pidfile" in done.stderr
    assert netns.links() == {"lo"}
    assert_clean(netns, "lost")
