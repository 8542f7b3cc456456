"""A real Debian guest end to end, as a user runs it: the image pulled over HTTP from 127.0.0.1,
two VMs with static addresses on a bridge in a private network namespace, cloud-init, SSH, a
read-only share, a writable share that keeps a guest's root from planting setuid files or devices
on the host, down/up keeping the machine. (That `reset` makes a VM anew from its image is
tests/test_guest_resources.py's, on the test guest: a Debian boot costs a hundred times more.)

The image is built once by tools/build_debian.py (mmdebstrap; cached in examples/debian/). A Debian
boot under TCG is a minute or two of CPU, so the module boots one lab (`lab`) and shares it: three cold
boots in all, the lab's two and a's in the one down/edit/up cycle. The tests run in any
order (`-p random_order`), each leaving the lab as it found it, both VMs up:
- a test that damages a guest works on clones of b (`vmlaunch fork`: a save of b loaded into new
  QEMUs, no boot), downed before it ends;
- a test that changes a guest's settings or disks undoes it (links, netem, partitions, disk faults);
- the snapshot test rolls the lab back to the snapshot it saved first (`snapshot restore`, then
  `up --from-snapshot`: warm starts, no boot);
- the edit test's cycle (of a alone) removes a's shares from the spec (a lab with a 9p share cannot be
  snapshotted, and its snapshots come after the cycle). The tests that need the shares take
  `shared_lab`, which puts them back when they are gone: `down` of a, the spec as it was, `up` of a
  (one cold boot of a; none in file order, where those tests come first).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shlex
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_e2e import Netns, netns_named
from vmlaunch.core.wait import TimedOut, wait_until

pytestmark = [pytest.mark.qemu, pytest.mark.guest, pytest.mark.debian]
BOOT_TIMEOUT = "420"


@pytest.fixture(scope="module")
def debian() -> dict[str, object]:
    """The Debian image and its manifest (built, or found built, by tools/build_debian.py)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "build_debian.py")],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"building the Debian image failed:\n{done.stdout}\n{done.stderr}")
    folder = ROOT / "examples" / "debian"
    manifest: dict[str, object] = json.loads((folder / "bookworm.json").read_text())
    return {**manifest, "path": folder / "bookworm.qcow2"}


class Served:
    """Files served over HTTP on 127.0.0.1 (the host's namespace), as a distro's mirror would."""

    def __init__(self, folder: Path) -> None:
        handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder))  # noqa: E731
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def lab_text(url: str, sha512: str) -> str:
    return f"""
[lab]
name = "deb"

[image.debian]
url = "{url}"
sha512 = "{sha512}"

[network.lan]
bridge = "vlbr-deb"
subnet = "10.10.0.0/24"

[vm.a]
memory = "768M"
image = "debian"
disk_size = "3G"
firmware = "uefi"
[vm.a.cloud_init]
user = "dev"
runcmd = ["touch /var/tmp/hello"]
[[vm.a.nic]]
network = "lan"
ip = "10.10.0.11"
[[vm.a.share]]
source = "src"
target = "/srv/src"
readonly = true
[[vm.a.share]]
source = "out"
target = "/srv/out"

[vm.b]
memory = "768M"
image = "debian"
[[vm.b.disk]]   # disk1: the disk faults' (disk0 is the image's overlay)
file = "data.qcow2"
size = "64M"
on_error = {{ write = "stop" }}
[[vm.b.nic]]
network = "lan"
ip = "10.10.0.12"
netem = {{ duplicate = "0.1%" }}   # set in the guest at `up` (this host's kernel has no netem)
"""


@pytest.fixture(scope="module")
def lab(debian: dict[str, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Netns, Path]]:
    """The lab, pulled and brought up once for the module; down (and checked clean) at the end."""
    folder = tmp_path_factory.mktemp("deb")
    (folder / "src").mkdir()
    (folder / "src" / "from-the-host.txt").write_text("shared\n")
    (folder / "out").mkdir()
    os.chown(folder / "out", *FOLDER_OWNER)  # a user's folder: what the guest makes is handed to it
    image = Path(str(debian["path"]))
    served = Served(image.parent)
    cache = folder / "cache"
    env = {"VMLAUNCH_CACHE_DIR": str(cache)}
    spec = folder / "lab.toml"
    spec.write_text(lab_text(served.url(image.name), str(debian["sha512"])))
    # a pull as for a real download: from the host's 127.0.0.1, before the lab goes in its namespace
    try:
        pulled = subprocess.run([sys.executable, "-m", "vmlaunch", "image", "pull", str(spec)],
                                capture_output=True, text=True, env={**_environ(), **env}, timeout=300,
                                check=False)
    finally:
        served.close()
    assert pulled.returncode == 0, pulled.stderr
    with netns_named() as netns:
        up = netns.vmlaunch("up", str(spec), "--wait", "ssh", "--timeout", BOOT_TIMEOUT, env=env,
                            timeout=float(BOOT_TIMEOUT) + 60)
        try:
            assert up.returncode == 0, up.stderr
            netns.env = env
            yield netns, spec
        finally:
            down = netns.vmlaunch("down", str(spec), env=env, timeout=120)
            assert down.returncode == 0, down.stderr
            assert netns.links() == {"lo"}


SHARES = ('[[vm.a.share]]\nsource = "src"\ntarget = "/srv/src"\nreadonly = true\n'
          '[[vm.a.share]]\nsource = "out"\ntarget = "/srv/out"\n')
BEFORE_SHARES = 'ip = "10.10.0.11"\n'  # the line of lab_text that a's shares follow


def up(netns: Netns, spec: Path, *vms: str) -> None:
    """A cold `up` (of `vms`, or every VM that is down) that waits for SSH."""
    done = netns.vmlaunch("up", str(spec), *vms, "--wait", "ssh", "--timeout", BOOT_TIMEOUT, env=netns.env,
                          timeout=float(BOOT_TIMEOUT) + 60)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def shared_lab(lab: tuple[Netns, Path]) -> tuple[Netns, Path]:
    """The lab with a's two shares mounted, as the module booted it. The edit test takes them out of
    the spec; after it they come back here: `down` of a, the spec as it was, a cold `up` of a (b runs
    on, untouched)."""
    netns, spec = lab
    text = spec.read_text()
    if SHARES not in text:
        down = netns.vmlaunch("down", str(spec), "a", "--timeout", "60", env=netns.env, timeout=180)
        assert down.returncode == 0, down.stderr
        assert text.count(BEFORE_SHARES) == 1
        spec.write_text(text.replace(BEFORE_SHARES, BEFORE_SHARES + SHARES))
        up(netns, spec, "a")
    return lab


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def ssh(netns: Netns, spec: Path, vm: str, *command: str) -> subprocess.CompletedProcess[str]:
    """`command`'s words, each arriving as a word: `vmlaunch ssh` gives the guest's shell its words
    joined by spaces, as OpenSSH does, so they are quoted for it here."""
    return netns.vmlaunch("ssh", str(spec), vm, "--", shlex.join(command), env=netns.env, timeout=120)


def test_ssh_runs_words_and_passes_the_exit_status(lab: tuple[Netns, Path]) -> None:
    netns, spec = lab
    assert ssh(netns, spec, "a", "sh", "-c", "exit 7").returncode == 7
    said = ssh(netns, spec, "b", "printf", "%s|", "two words", "it's", "$HOME")
    assert said.returncode == 0 and said.stdout == "two words|it's|$HOME|"
    piped = netns.vmlaunch("ssh", str(spec), "a", "--", "ls / | wc -l", env=netns.env, timeout=120)
    assert piped.returncode == 0 and int(piped.stdout) > 5, piped.stderr  # a pipe in the guest's shell
    joined = netns.vmlaunch("ssh", str(spec), "a", "--", "echo", "'two  spaces'", "two  spaces",
                            env=netns.env, timeout=120)
    assert joined.stdout == "two  spaces two spaces\n"  # the words joined, as OpenSSH joins them
    assert ssh(netns, spec, "a", "cat", "/etc/hostname").stdout.strip() == "a"
    assert ssh(netns, spec, "a", "id", "-un").stdout.strip() == "dev"
    assert ssh(netns, spec, "a", "sudo", "-n", "true").returncode == 0  # passwordless sudo


def reach(netns: Netns, spec: Path, vm: str, address: str) -> bool:
    """`vm` pings `address` over the lab's bridge."""
    return ssh(netns, spec, vm, "ping", "-c", "1", "-W", "10", address).returncode == 0


def test_static_addresses_reach_each_other(lab: tuple[Netns, Path]) -> None:
    netns, spec = lab
    assert reach(netns, spec, "a", "10.10.0.12") and reach(netns, spec, "b", "10.10.0.11")
    addresses = ssh(netns, spec, "a", "ip", "-4", "-o", "addr", "show").stdout
    assert "10.10.0.11/24" in addresses


def test_cloud_init_ran_the_spec(lab: tuple[Netns, Path]) -> None:
    netns, spec = lab
    assert ssh(netns, spec, "a", "test", "-e", "/var/tmp/hello").returncode == 0
    assert ssh(netns, spec, "b", "test", "-e", "/var/tmp/hello").returncode == 1  # not b's runcmd
    status = json.loads(netns.vmlaunch("status", str(spec), "--json", env=netns.env).stdout)
    assert status["a"]["nics"][0]["address"] == "10.10.0.11/24"
    assert isinstance(status["a"]["ssh_port"], int)


def test_the_share_is_mounted_read_only(shared_lab: tuple[Netns, Path]) -> None:
    netns, spec = shared_lab
    assert ssh(netns, spec, "a", "cat", "/srv/src/from-the-host.txt").stdout == "shared\n"
    written = ssh(netns, spec, "a", "sudo", "touch", "/srv/src/from-the-guest")
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    assert not (spec.parent / "src" / "from-the-guest").exists()


# What a guest's root tries through a writable share: a setuid root shell, setgid, a device, a FIFO,
# a symlink to the host's /etc/shadow, a hard link, file capabilities, owners; and a script it runs.
PLANT = """
set -e
cd /srv/out
cp /bin/dash rootsh && chmod 4755 rootsh
cp /bin/dash groupsh && chmod 2755 groupsh
mknod dev c 1 1
mknod disk b 8 0
mkfifo fifo
ln -s /etc/shadow link
ln rootsh hardlink
printf '#!/bin/sh\\necho ran\\n' > script && chmod 755 script
mkdir -m 3777 sub && touch sub/inner && chown 1234:5678 sub/inner
cp /bin/dash capsh
setcap cap_setuid+ep capsh 2>/dev/null && echo capability-set || echo capability-refused
"""


FOLDER_OWNER = (65534, 65534)  # nobody: the writable share's folder belongs to a user, not root


def vm_uids_in(out: Path) -> set[int]:
    """The owners of the share's files that are VMs' uids (host/confine.py)."""
    from vmlaunch.host import confine

    return {info.st_uid for path in [out, *out.rglob("*")] if (info := os.lstat(path)).st_uid in
            confine.uid_range()}


def test_a_writable_share_keeps_what_the_guest_sets_off_the_host(shared_lab: tuple[Netns, Path]) -> None:
    """security_model=mapped-xattr: the guest sees the owners, modes and file types it set; the host
    has regular files and folders only, none setuid or setgid, without file capabilities, owned by
    the VM's own uid while it runs, and the folder's owner can read them."""
    netns, spec = shared_lab
    planted = ssh(netns, spec, "a", "sudo", "sh", "-c", PLANT)
    assert planted.returncode == 0, planted.stderr
    assert planted.stdout.strip() == "capability-refused"
    seen = ssh(netns, spec, "a", "sh", "-c", "cd /srv/out && stat -c '%n %a %F %u:%g' rootsh groupsh dev "
               "disk fifo link script sub sub/inner")
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.splitlines() == [
        "rootsh 4755 regular file 0:0", "groupsh 2755 regular file 0:0",
        "dev 644 character special file 0:0", "disk 644 block special file 0:0", "fifo 644 fifo 0:0",
        "link 777 symbolic link 0:0", "script 755 regular file 0:0", "sub 3777 directory 0:0",
        "sub/inner 644 regular empty file 1234:5678"]
    assert ssh(netns, spec, "a", "readlink", "/srv/out/link").stdout == "/etc/shadow\n"
    assert ssh(netns, spec, "a", "/srv/out/script").stdout == "ran\n"  # executable for the guest
    out = spec.parent / "out"
    for path in [out, *out.rglob("*")]:
        info = os.lstat(path)
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file" if stat.S_ISREG(info.st_mode) else "other"
        assert kind == ("folder" if path.name in ("out", "sub") else "file"), path
        assert stat.S_IMODE(info.st_mode) & 0o7000 == 0, (path, oct(info.st_mode))
        assert stat.S_IMODE(info.st_mode) & 0o007 == 0 or path == out, (path, oct(info.st_mode))
        assert "security.capability" not in os.listxattr(path, follow_symlinks=False), path
    assert (out / "link").read_text() == "/etc/shadow"  # a file holding the target, not a link
    assert os.stat(out / "rootsh").st_ino == os.stat(out / "hardlink").st_ino  # inside the share: kept
    assert len(vm_uids_in(out)) == 1  # made by QEMU as the VM's uid, never root
    # the folder's owner reads what the guest made (from a descriptor of the folder: the folders above
    # it are pytest's, root's alone)
    folder_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        read = ("import os, sys; fd = os.open('script', os.O_RDONLY, dir_fd=int(sys.argv[1])); "
                "print(os.read(fd, 100).decode())")
        as_owner = subprocess.run(["setpriv", f"--reuid={FOLDER_OWNER[0]}", f"--regid={FOLDER_OWNER[1]}",
                                   "--clear-groups", "/usr/bin/python3", "-c", read, str(folder_fd)],
                                  capture_output=True, text=True, check=False, pass_fds=[folder_fd])
    finally:
        os.close(folder_fd)
    assert as_owner.returncode == 0 and "echo ran" in as_owner.stdout, as_owner.stderr


API_SCRIPT = """
import sys
import vmlaunch

lab = vmlaunch.Lab(sys.argv[1])
b = lab.vm("b")
b.wait_ssh(timeout=120)
print(repr(b.ssh(["printf", "%s|", "two words", "it's"]).stdout))
print(b.ssh("exit 3").returncode)
print(b.ssh("cat /etc/hostname", check=True).stdout.strip())
"""


def test_the_python_api_runs_commands_over_ssh(lab: tuple[Netns, Path]) -> None:
    """Vm.ssh and Vm.wait_ssh, in the lab's namespace (its SSH ports are 127.0.0.1 there)."""
    netns, spec = lab
    done = subprocess.run(["ip", "netns", "exec", netns.name, sys.executable, "-c", API_SCRIPT, str(spec)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**_environ(), "VMLAUNCH_RUN_DIR": str(netns.run_root), **netns.env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ['"two words|it\'s|"', "3", "b"]


def test_a_mounted_share_refuses_a_snapshot(shared_lab: tuple[Netns, Path]) -> None:
    """QEMU 7.2 blocks RAM snapshots while a 9p share is in use: refused up front, nothing changed.
    (Save, restore and the warm start themselves: tests/test_snapshot.py, on the test guests.)"""
    netns, spec = shared_lab
    refused = netns.vmlaunch("snapshot", str(spec), "save", "before", env=netns.env)
    assert refused.returncode == 2 and "vm.a.share[0]" in refused.stderr, refused.stderr
    assert ssh(netns, spec, "a", "true").returncode == 0  # still running, untouched


def leave_qemu_ga_a_reply(netns: Netns, vm: str) -> None:
    """What a client that went away leaves QEMU's guest agent: a request it answers with nobody
    connected (qemu-ga then retries that write without end, and cannot take the SIGTERM of the
    guest's shutdown: systemd waits 90 s for it, `Job qemu-guest-agent.service/stop running`)."""
    import socket

    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(netns.run_root / "deb" / f"{vm}.qga"))
        conn.sendall(b'{"execute": "guest-sync-delimited", "arguments": {"id": 7}}\n')
        time.sleep(0.2)  # QEMU passes it on before it hears the client went away


def down_powers_both_off(netns: Netns, spec: Path, after: str) -> None:
    """A command through the channel (which greets one agent and closes the other) and a qemu-ga left
    a reply, then `down`: each guest powers off on the power button, well within its 60 s."""
    assert run_in(netns, spec, "a", "true").returncode == 0
    for vm in ("a", "b"):
        leave_qemu_ga_a_reply(netns, vm)
    started = time.monotonic()
    down = netns.vmlaunch("down", str(spec), "--timeout", "60", env=netns.env, timeout=180)
    assert down.returncode == 0, down.stderr
    assert "a: powered off" in down.stderr and "b: powered off" in down.stderr, (after, down.stderr)
    assert time.monotonic() - started < 45, (after, down.stderr)  # systemd's 90 s wait was not it


def warm_start(netns: Netns, spec: Path, snapshot: str) -> None:
    warm = netns.vmlaunch("up", str(spec), "--from-snapshot", snapshot, "--wait", "ssh", "--timeout", "120",
                          env=netns.env, timeout=180)
    assert warm.returncode == 0, warm.stderr
    assert "page cache" not in warm.stderr, warm.stderr  # disks reopened as compiled (item 7)


def test_an_edited_lab_comes_back_and_snapshots_take_it_back_in_time(shared_lab: tuple[Netns, Path]) -> None:
    """The module's one cold down/up cycle, then the snapshots, which need it (a lab with a 9p share
    cannot be snapshotted).

    The cycle, of a (b runs on): `down` (what a's guest made in its writable share is handed back to
    the folder's owner), the shares taken out of the spec (the NICs move to other PCI slots, so other
    interface names in the guest: its network config must follow), `up`: a is the same machine, its
    boot timeline has its phases, and a and b reach each other.

    The snapshots: a whole-lab snapshot saved, a file written, `down` after the save (each guest
    powers off cleanly); the lab started from the snapshot (RAM included: the file is gone, the clock
    is set, the kernel reseeds), `down` as clean after the warm start; started from it again, a file
    written and the snapshot restored (the file is gone, SSH answers at once). The lab is left up,
    as the cycle made it."""
    netns, spec = shared_lab
    for vm in ("a", "b"):
        assert ssh(netns, spec, vm, "sh", "-c", "echo kept > /var/tmp/kept && sync").returncode == 0
    made = ssh(netns, spec, "a", "sudo", "sh", "-c", "echo made > /srv/out/before-down && sync")
    assert made.returncode == 0, made.stderr
    assert netns.vmlaunch("down", str(spec), "a", env=netns.env, timeout=120).returncode == 0
    out = spec.parent / "out"  # handed back: the folder's owner has what the guest made, no VM uid
    assert vm_uids_in(out) == set() and {os.lstat(path).st_uid for path in out.rglob("*")} == {
        FOLDER_OWNER[0]}
    (out / "before-down").unlink()  # the share as the writable share's test expects it
    text = spec.read_text()
    assert SHARES in text
    spec.write_text(text.replace(SHARES, ""))
    up(netns, spec)
    assert ssh(netns, spec, "a", "cat", "/var/tmp/kept").stdout == "kept\n"  # the same machine
    status = netns.vmlaunch("status", str(spec), "--json", env=netns.env)
    boot = json.loads(status.stdout)["a"]["boot"]  # where its boot went (lab/timeline.py)
    assert {"qemu", "loader", "kernel", "userspace", "cloud-init"} <= set(boot), boot  # UEFI: no firmware log
    assert reach(netns, spec, "a", "10.10.0.12") and reach(netns, spec, "b", "10.10.0.11")

    def write_later() -> None:
        for vm in ("a", "b"):
            assert ssh(netns, spec, vm, "sh", "-c", "echo later > /var/tmp/later && sync").returncode == 0

    def later_gone() -> None:
        for vm in ("a", "b"):
            assert ssh(netns, spec, vm, "test", "-e", "/var/tmp/later").returncode == 1, vm

    saved = netns.vmlaunch("snapshot", str(spec), "save", "clean", env=netns.env, timeout=300)
    assert saved.returncode == 0, saved.stderr
    write_later()
    down_powers_both_off(netns, spec, "after a save")
    warm_start(netns, spec, "clean")
    later_gone()
    assert ssh(netns, spec, "b", "cat", "/var/tmp/kept").stdout == "kept\n"  # on b's disk at the save
    clock = ssh(netns, spec, "a", "date", "+%s")
    assert clock.returncode == 0 and abs(int(clock.stdout) - int(time.time())) < 60
    # a new QEMU, a new generation id (vmgenid): the restored kernel knows it is a copy, and reseeds
    reseeded = ssh(netns, spec, "a", "sudo", "-n", "dmesg")
    assert "crng reseeded due to virtual machine fork" in reseeded.stdout, reseeded.stdout[-2000:]
    down_powers_both_off(netns, spec, "after a warm start")

    warm_start(netns, spec, "clean")
    write_later()
    restored = netns.vmlaunch("snapshot", str(spec), "restore", "clean", env=netns.env, timeout=300)
    assert restored.returncode == 0, restored.stderr
    later_gone()
    assert reach(netns, spec, "a", "10.10.0.12")
    listed = netns.vmlaunch("snapshot", str(spec), "list", env=netns.env)
    assert listed.returncode == 0 and "clean" in listed.stdout


# ---------------------------------------------------------------- test rigs: the command channel


def run_in(netns: Netns, spec: Path, vm: str, *command: str,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return netns.vmlaunch("exec", "--timeout", str(timeout), str(spec), vm, "--", *command, env=netns.env,
                          timeout=timeout + 60)


def round_trip_ms(netns: Netns, spec: Path, source: str, address: str, count: int = 10) -> float:
    """The least round trip of `count` pings: the delay added shows there without the noise of TCG."""
    done = run_in(netns, spec, source, "ping", "-c", str(count), "-i", "0.2", "-q", address)
    assert done.returncode == 0, done.stdout + done.stderr
    return float(done.stdout.strip().splitlines()[-1].split("=")[1].split("/")[0])  # rtt MIN/avg/max


def pings(netns: Netns, spec: Path, source: str, address: str) -> bool:
    return run_in(netns, spec, source, "ping", "-c", "2", "-W", "2", address).returncode == 0


def lab_state(netns: Netns, spec: Path) -> str:
    """What `status` says, and the tail of each console: for the message of a wait that failed."""
    said = netns.vmlaunch("status", str(spec), env=netns.env).stdout
    for vm in ("a", "b"):
        console = netns.vmlaunch("logs", str(spec), vm, env=netns.env).stdout
        said += f"\n--- {vm}'s console:\n{console[-1500:]}"
    return said


def test_exec_works_with_every_nic_down_and_through_either_agent(lab: tuple[Netns, Path]) -> None:
    """Every NIC of a loses its carrier (the lab's with `vmlaunch link`, the SSH one through QMP):
    the channel still runs commands, through either agent."""
    netns, spec = lab
    mgmt_down = netns.vmlaunch("qmp", str(spec), "a", "set_link", '{"name": "mgmt", "up": false}',
                               env=netns.env)
    assert mgmt_down.returncode == 0, mgmt_down.stderr
    try:
        assert netns.vmlaunch("link", str(spec), "a", "lan", "down", env=netns.env).returncode == 0
        carriers = "for i in /sys/class/net/*; do [ ${i##*/} = lo ] || cat $i/carrier; done; hostname; exit 5"
        said = run_in(netns, spec, "a", "sh", "-c", carriers)
        assert (said.returncode, said.stdout) == (5, "0\n0\na\n"), said.stderr  # both NICs without carrier
        status = json.loads(netns.vmlaunch("status", str(spec), "--json", env=netns.env).stdout)
        assert status["a"]["nics"][0]["link"] == "down"
        via_qga = netns.vmlaunch("exec", "--via", "qga", str(spec), "a", "--", "id", "-un", env=netns.env)
        assert (via_qga.returncode, via_qga.stdout) == (0, "root\n")  # QEMU's guest agent, in the image
    finally:
        netns.vmlaunch("qmp", str(spec), "a", "set_link", '{"name": "mgmt", "up": true}', env=netns.env)
        netns.vmlaunch("link", str(spec), "a", "lan", "up", env=netns.env)
    try:
        wait_until(lambda: pings(netns, spec, "a", "10.10.0.12"), 120, interval=2)
        wait_until(lambda: ssh(netns, spec, "a", "true").returncode == 0, 120, interval=2)
    except TimedOut:
        pytest.fail(f"a does not reach b again after its links came back:\n{lab_state(netns, spec)}")


def test_netem_delays_and_loses_in_the_guest_and_clears(lab: tuple[Netns, Path]) -> None:
    netns, spec = lab
    before = round_trip_ms(netns, spec, "a", "10.10.0.12")
    host = netns.vmlaunch("netem", str(spec), "a", "lan", "--where", "host", "--delay", "100", env=netns.env)
    assert host.returncode == 3 and "CONFIG_NET_SCH_NETEM" in host.stderr, host.stderr  # no netem here
    assert netns.vmlaunch("netem", str(spec), "a", "lan", "--delay", "100", env=netns.env).returncode == 0
    listed = json.loads(netns.vmlaunch("netem", str(spec), "--json", env=netns.env).stdout)
    assert [(row["vm"], row["where"], row.get("delay"), row.get("duplicate")) for row in listed] == [
        ("a", "guest", "100ms", None), ("b", "guest", None, "0.1%")]  # b's from the spec, set at `up`
    assert "duplicate 0.1%" in run_in(netns, spec, "b", "tc", "qdisc", "show").stdout
    delayed = round_trip_ms(netns, spec, "a", "10.10.0.12")
    assert delayed >= 100 and 98 <= delayed - before <= 130, (before, delayed)
    assert netns.vmlaunch("netem", str(spec), "a", "lan", "--clear", env=netns.env).returncode == 0
    assert round_trip_ms(netns, spec, "a", "10.10.0.12") < before + 30
    assert netns.vmlaunch("netem", str(spec), "a", "lan", "--loss", "30", env=netns.env).returncode == 0
    lossy = run_in(netns, spec, "a", "ping", "-c", "200", "-i", "0.05", "-W", "1", "-q", "10.10.0.12")
    received = int(lossy.stdout.split(" received")[0].rsplit(",", 1)[1])
    assert 15 <= 100 - received / 2 <= 45, lossy.stdout
    assert netns.vmlaunch("netem", str(spec), "a", "lan", "--clear", env=netns.env).returncode == 0


def test_link_and_partition_cut_and_heal(lab: tuple[Netns, Path]) -> None:
    netns, spec = lab
    assert pings(netns, spec, "a", "10.10.0.12")
    assert netns.vmlaunch("link", str(spec), "b", "0", "down", env=netns.env).returncode == 0
    assert not pings(netns, spec, "a", "10.10.0.12")
    assert netns.vmlaunch("link", str(spec), "b", "0", "up", env=netns.env).returncode == 0
    assert wait_until(lambda: pings(netns, spec, "a", "10.10.0.12"), 60, interval=1)
    assert netns.vmlaunch("partition", str(spec), "b", env=netns.env).returncode == 0
    assert not pings(netns, spec, "a", "10.10.0.12") and not pings(netns, spec, "b", "10.10.0.11")
    assert netns.vmlaunch("partition", str(spec), "--heal", env=netns.env).returncode == 0
    assert wait_until(lambda: pings(netns, spec, "a", "10.10.0.12"), 60, interval=1)


def test_cp_round_trips_ten_mib_and_a_screenshot_and_evidence(lab: tuple[Netns, Path],
                                                             tmp_path: Path) -> None:
    netns, spec = lab
    data = os.urandom(10 << 20)
    (tmp_path / "blob").write_bytes(data)
    put = netns.vmlaunch("cp", str(spec), str(tmp_path / "blob"), "b:/var/tmp/blob", env=netns.env)
    assert put.returncode == 0, put.stderr
    summed = run_in(netns, spec, "b", "sha256sum", "/var/tmp/blob").stdout.split()[0]
    assert summed == hashlib.sha256(data).hexdigest()
    back = netns.vmlaunch("cp", str(spec), "b:/var/tmp/blob", str(tmp_path / "back"), env=netns.env)
    assert back.returncode == 0, back.stderr
    assert (tmp_path / "back").read_bytes() == data
    shot = netns.vmlaunch("screenshot", str(spec), "b", str(tmp_path / "b.png"), env=netns.env)
    assert shot.returncode == 0, shot.stderr
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = netns.vmlaunch("evidence", str(spec), str(tmp_path / "evidence"), env=netns.env)
    assert saved.returncode == 0, saved.stderr
    for name in ("status.json", "wire.json", "a/serial.log", "a/qemu.log", "a/screen.png", "b/serial.log"):
        assert (tmp_path / "evidence" / name).stat().st_size > 0, name


RIG_SCRIPT = """
import sys
import vmlaunch

lab = vmlaunch.Lab(sys.argv[1])
b = lab.vm("b")
b.wait_for_unit("ssh.service", timeout=60)
b.succeed("systemd-run --unit=vl-broken --property=Type=oneshot sh -c 'echo broken-unit-says-so; exit 3' "
          "|| true")
try:
    b.wait_for_unit("vl-broken.service", timeout=60)
except vmlaunch.CommandFailed as failed:
    print("failed:", "broken-unit-says-so" in failed.result.stdout.decode())
b.wait_for_port(22, timeout=30)
print(b.run(["printf", "%s|", "two words", "it's"]).stdout.decode())
print(b.succeed("echo ok", via="ssh").strip())
"""


def test_the_python_api_drives_the_guest_through_the_channel(lab: tuple[Netns, Path]) -> None:
    netns, spec = lab
    done = subprocess.run(["ip", "netns", "exec", netns.name, sys.executable, "-c", RIG_SCRIPT, str(spec)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**_environ(), "VMLAUNCH_RUN_DIR": str(netns.run_root), **netns.env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["failed: True", "two words|it's|", "ok"]


DATA = "/dev/disk/by-id/virtio-disk1"  # the name `status` and `fault` give it, as its serial


def test_disk_faults_break_the_data_disk_and_heal(lab: tuple[Netns, Path]) -> None:
    """On b's data disk (qcow2: the fault sees the guest's offsets): an error at a sector fails the
    guest's read of that block (EIO) and no other, `clear` heals it; a failed write with on_error.write
    = "stop" pauses the VM, `status` says why, `resume` completes the write; a held write waits for
    `release`; at 1 MiB/s an 8 MiB read takes 6 s or more."""
    netns, spec = lab

    def fault(*args: str) -> subprocess.CompletedProcess[str]:
        done = netns.vmlaunch("fault", str(spec), "b", "disk1", *args, env=netns.env)
        assert done.returncode == 0, done.stderr
        return done

    def guest(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return netns.vmlaunch("exec", "--timeout", str(timeout), str(spec), "b", "--", "sh", "-c", script,
                              env=netns.env, timeout=timeout + 30)

    def read(block: int) -> subprocess.CompletedProcess[str]:
        return guest(f"dd if={DATA} of=/dev/null bs=4096 skip={block} count=1 iflag=direct")

    fault("error", "--read", "--sector", "5001")  # in block 625
    failed = read(625)
    assert failed.returncode != 0 and "Input/output error" in failed.stderr, failed
    assert read(624).returncode == 0 and read(626).returncode == 0 and read(0).returncode == 0
    fault("clear")
    assert read(625).returncode == 0

    fault("error", "--write", "--sector", "4096", "--once")  # block 512
    assert guest(f"(sleep 1; printf kept | dd of={DATA} bs=4096 seek=512 conv=sync oflag=direct; "
                 "echo $? > /var/tmp/wr) </dev/null >/dev/null 2>&1 &").returncode == 0

    def paused() -> dict[str, object] | None:
        rows = json.loads(netns.vmlaunch("status", str(spec), "--json", env=netns.env).stdout)
        return rows["b"] if rows["b"]["run_state"] == "io-error" else None

    row = wait_until(paused, 60)
    assert row["state"] == "paused" and "disk1" in str(row["why"]) and "write" in str(row["why"]), row
    assert "BLOCK_IO_ERROR" in netns.vmlaunch("logs", str(spec), "--events", env=netns.env).stdout
    resumed = netns.vmlaunch("resume", str(spec), "b", env=netns.env)
    assert resumed.returncode == 0, resumed.stderr
    assert guest("sleep 1; cat /var/tmp/wr").stdout.strip() == "0"
    written = guest(f"dd if={DATA} bs=4096 skip=512 count=1 iflag=direct 2>/dev/null | head -c 4")
    assert written.stdout == "kept", written
    fault("clear")

    fault("hang", "--write")
    assert guest(f"(dd if=/dev/zero of={DATA} bs=4096 seek=700 count=1 oflag=direct && touch /var/tmp/w)"
                 " </dev/null >/dev/null 2>&1 &").returncode == 0
    time.sleep(3)
    assert guest("test -e /var/tmp/w").returncode != 0  # held
    fault("release")
    wait_until(lambda: guest("test -e /var/tmp/w").returncode == 0, 60)

    fault("slow", "--bps", "1M")
    started = time.monotonic()
    assert guest(f"dd if={DATA} of=/dev/null bs=1M count=8 iflag=direct").returncode == 0
    assert time.monotonic() - started >= 6.0
    fault("clear")
    assert netns.vmlaunch("fault", str(spec), env=netns.env).stdout.strip() == "no disk faults set"


@pytest.fixture
def clones_of_b(lab: tuple[Netns, Path]) -> list[str]:
    """b-1 and b-2, running clones of b (`vmlaunch fork`: no boot), made by the first test that needs
    them and kept for the next; the test that harms them (the panic's) takes them down."""
    netns, spec = lab
    rows = json.loads(netns.vmlaunch("status", str(spec), "--json", env=netns.env).stdout)
    clones = sorted(vm for vm in rows if vm.startswith("b-"))
    if clones == ["b-1", "b-2"] and all(rows[vm]["run_state"] == "running" for vm in clones):
        return clones
    if clones:
        down_clones(netns, spec, clones)
    done = netns.vmlaunch("fork", str(spec), "b", "--count", "2", "--json", env=netns.env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert list(json.loads(done.stdout)) == ["b-1", "b-2"]
    return ["b-1", "b-2"]


def test_clones_of_b_are_each_a_machine_of_its_own(lab: tuple[Netns, Path], clones_of_b: list[str]) -> None:
    """`fork`: running copies of b, each with a MAC, machine-id, SSH host key (pinned: `ssh` checks
    it) and VM generation id of its own, the kernel's fork reseed in its log, the next free addresses
    on the bridge, every one reaching every other. (`down` of them leaves nothing: the panic's test.)"""
    netns, spec = lab
    made = clones_of_b
    rows = json.loads(netns.vmlaunch("status", str(spec), "--json", env=netns.env).stdout)

    def facts(vm: str) -> tuple[str, ...]:
        said = ssh(netns, spec, vm, "sh", "-c", "hostname; cat /etc/machine-id; "
                   "sudo ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub | cut -d' ' -f2; "
                   "cat /sys/class/net/*/address")
        assert said.returncode == 0, said.stderr
        generation = netns.vmlaunch("qmp", str(spec), vm, "query-vm-generation-id", env=netns.env)
        return (*said.stdout.split()[:3], json.loads(generation.stdout)["guid"], rows[vm]["nics"][0]["mac"],
                said.stdout)

    seen = {vm: facts(vm) for vm in ["b", *made]}
    for vm in made:
        hostname, _, _, _, mac, macs = seen[vm]
        assert hostname == vm and mac in macs.split()  # the guest sees the MAC status gives
        reseed = ssh(netns, spec, vm, "sudo", "dmesg")
        assert "crng reseeded due to virtual machine fork" in reseed.stdout
    for part in range(1, 5):  # machine-id, host key, generation id, MAC
        assert len({facts_[part] for facts_ in seen.values()}) == 3, seen
    addresses = {vm: rows[vm]["nics"][0]["address"].split("/")[0] for vm in ["b", *made]}
    assert sorted(addresses.values()) == ["10.10.0.12", "10.10.0.13", "10.10.0.14"]
    for vm in made:
        for other, address in addresses.items():
            if other != vm:
                assert reach(netns, spec, vm, address), (vm, other)


def down_clones(netns: Netns, spec: Path, clones: list[str]) -> None:
    """`down` of the clones leaves nothing of them, and the lab's own a and b running."""
    down = netns.vmlaunch("down", str(spec), *clones, env=netns.env, timeout=120)
    assert down.returncode == 0, down.stderr
    rows = json.loads(netns.vmlaunch("status", str(spec), "--json", env=netns.env).stdout)
    assert {vm: row["run_state"] for vm, row in rows.items()} == {"a": "running", "b": "running"}
    assert not [p for p in (spec.parent / ".vmlaunch" / "deb").iterdir() if p.name.startswith("b-")]
    assert not [name for name in os.listdir(netns.run_root / "deb") if name.startswith("b-")]
    assert subprocess.run(["pgrep", "-f", "guest=b-"], capture_output=True, check=False).returncode == 1


def test_a_panic_reaches_qemu_through_pvpanic(lab: tuple[Netns, Path], clones_of_b: list[str]) -> None:
    """Debian's kernel loads the pvpanic driver for QEMU's device: a panic pauses the VM in QEMU's
    run state guest-panicked (-action panic=pause), which `status` shows with the panic line. On two
    clones of b, so the lab's b runs on: b-1 panics; b-2 has a write held on its root disk; `down`
    powers both off all the same, and leaves nothing of them."""
    netns, spec = lab
    clones = clones_of_b
    try:
        # in the background, every stream let go: ssh returns before the guest stops answering
        ssh(netns, spec, "b-1", "sudo", "sh", "-c",
            "(sleep 1; echo c > /proc/sysrq-trigger) </dev/null >/dev/null 2>&1 &")

        def panicked() -> dict[str, object] | None:
            rows = json.loads(netns.vmlaunch("status", str(spec), "--json", env=netns.env).stdout)
            return rows["b-1"] if rows["b-1"]["run_state"] == "guest-panicked" else None

        row = wait_until(panicked, 120)
        assert row["state"] == "guest-panicked" and "Kernel panic - not syncing" in str(row["why"]), row
        held = netns.vmlaunch("fault", str(spec), "b-2", "disk0", "hang", "--write", env=netns.env)
        assert held.returncode == 0, held.stderr
        assert ssh(netns, spec, "b-2", "sh", "-c",
                   "(echo x > /var/tmp/held; sync) </dev/null >/dev/null 2>&1 &").returncode == 0
    finally:
        down_clones(netns, spec, clones)
