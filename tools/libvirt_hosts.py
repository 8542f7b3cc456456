#!/usr/bin/env python3
"""Several libvirt hosts on this machine, reached over SSH: the test rig of multi-host labs.

Each host is a private libvirtd (tools/private_libvirt.py: a mount and network namespace of its own)
with an `sshd` of its own, listening on the host's address on an underlay network. The underlay is
a bridge in a namespace of its own, the *switch*, where each host's network namespace has a veth
pair's end. The switch namespace is also the *client*: vmlaunch runs there (`client_argv`), with
an SSH client configuration of the rig's (a private /etc/ssh/ssh_config: the rig's key, its own
known_hosts), so it reaches `qemu+ssh://root@10.77.0.11/system` as it would a real host.

Nothing of it is on the host's own network or files: every link lives in the rig's namespaces, and
closing the rig stops the daemons and lets the namespaces go.

    with LibvirtHosts(work, count=2) as rig:
        rig.run_client("vmlaunch", "up", "lab.toml")
        rig.hosts[0].virsh("list", "--all")

Standard library only. Needs root.
"""

from __future__ import annotations

import base64
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # run as a script (the switch's namespace): the repository's root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.private_libvirt import LIBVIRT_DIRS, PrivateLibvirt, _make_dirs, ensure_libvirt, run  # noqa: E402

SWITCH = "--switch"
READY = "switch ready"
UNDERLAY = "10.77.0"  # the switch is .1 (and the client), host i (from 1) is .1i
BRIDGE = "under0"


def host_address(index: int) -> str:
    return f"{UNDERLAY}.{10 + index}"


def switch_serve(work: Path) -> int:
    """Inside `unshare --mount --net`: the underlay bridge, the client's SSH configuration; wait until
    standard input closes."""
    run("ip", "link", "set", "lo", "up")
    run("ip", "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
    run("ip", "addr", "add", f"{UNDERLAY}.1/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    config = work / "ssh_config"
    config.write_text(
        "Host *\n"
        f"    IdentityFile {work / 'id_ed25519'}\n"
        f"    UserKnownHostsFile {work / 'known_hosts'}\n"
        "    StrictHostKeyChecking accept-new\n"
        "    BatchMode yes\n"
        "    ConnectTimeout 5\n"
    )
    run("mount", "--bind", str(config), "/etc/ssh/ssh_config")
    print(READY, flush=True)
    sys.stdin.read()
    return 0


class Host:
    """One libvirt host of the rig."""

    def __init__(self, rig: LibvirtHosts, index: int) -> None:
        self.rig = rig
        self.index = index
        self.name = f"h{index}"
        self.address = host_address(index)
        self.libvirt = PrivateLibvirt(rig.work / self.name)

    @property
    def uri(self) -> str:
        return f"qemu+ssh://root@{self.address}/system?keyfile={self.rig.key}"

    def run(self, *argv: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        done: subprocess.CompletedProcess[str] = self.libvirt.run(*argv, timeout=timeout, check=check)
        return done

    def virsh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done: subprocess.CompletedProcess[str] = self.libvirt.virsh(*args, check=check)
        return done

    def names(self, *listing: str) -> list[str]:
        """`virsh list --all --name` and the like, as a list."""
        return [name for name in self.virsh(*listing).stdout.split() if name]

    def links(self) -> list[str]:
        return [line.split()[0].split("@")[0] for line in self.run("ip", "-br", "link").stdout.splitlines()]

    def stop_libvirtd(self) -> None:
        self.run(
            "sh",
            "-c",
            "kill $(cat /run/libvirtd.pid); for i in $(seq 100); do "
            "[ -e /proc/$(cat /run/libvirtd.pid 2>/dev/null || echo 0) ] || exit 0; sleep 0.1; done",
        )

    def start_libvirtd(self) -> None:
        self.run("libvirtd", "-d")
        for _ in range(300):
            if self.virsh("version", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: libvirtd did not answer")

    def start(self) -> None:
        """Once its libvirtd runs and its veth end is in: its address and its sshd."""
        work = self.rig.work / self.name
        self.run("ip", "addr", "add", f"{self.address}/24", "dev", "eth0")
        self.run("ip", "link", "set", "eth0", "up")
        key = work / "ssh_host_ed25519_key"
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        config = work / "sshd_config"
        config.write_text(
            f"ListenAddress {self.address}\n"
            f"HostKey {key}\n"
            f"AuthorizedKeysFile {self.rig.key}.pub\n"
            f"PidFile /run/sshd-rig.pid\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
        )
        self.run("mkdir", "-p", "/run/sshd")
        self.run("/usr/sbin/sshd", "-f", str(config), "-E", str(work / "sshd.log"))


class LibvirtHosts:
    """The rig: `count` libvirt hosts over SSH on an underlay, and the client namespace."""

    def __init__(self, work: Path, count: int = 2) -> None:
        self.work = work
        self.key = work / "id_ed25519"
        self.count = count
        self.hosts: list[Host] = []
        self.switch: subprocess.Popen[str] | None = None
        self.log: IO[Any] | None = None
        self.made: list[Path] = []  # mount points made on the machine, removed once every host is gone

    def __enter__(self) -> LibvirtHosts:
        ensure_libvirt(("openssh-server", "openssh-client"))
        self.work.mkdir(parents=True, exist_ok=True)
        try:
            # made once, here: hosts started at once would race for them, and one host's teardown
            # must not remove a mount point the others still use
            for path in LIBVIRT_DIRS:
                self.made += _make_dirs(Path(path))
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
            self.log = open(self.work / "switch.log", "w")  # noqa: SIM115 - closed by close()
            self.switch = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--net",
                    "--propagation",
                    "private",
                    "--",
                    sys.executable,
                    str(Path(__file__).resolve()),
                    SWITCH,
                    str(self.work),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                text=True,
            )
            assert self.switch.stdout is not None
            if self.switch.stdout.readline().strip() != READY:
                raise RuntimeError(
                    f"the rig's switch did not start: {(self.work / 'switch.log').read_text()}"
                )
            self.hosts = [Host(self, index) for index in range(1, self.count + 1)]
            failures: list[BaseException] = []

            def start(host: Host) -> None:
                try:
                    host.libvirt.__enter__()
                except BaseException as exc:  # said below, in this thread
                    failures.append(exc)

            threads = [threading.Thread(target=start, args=(host,)) for host in self.hosts]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if failures:
                raise failures[0]
            for host in self.hosts:
                assert host.libvirt.process is not None
                self.run_switch(
                    "ip",
                    "link",
                    "add",
                    f"up{host.index}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    str(host.libvirt.process.pid),
                )
                self.run_switch("ip", "link", "set", f"up{host.index}", "master", BRIDGE, "up")
                host.start()
            for host in self.hosts:
                self._wait_for_ssh(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_for_ssh(self, host: Host) -> None:
        done = None
        for _ in range(100):
            done = subprocess.run(
                self.client_argv("ssh", f"root@{host.address}", "true"),
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
            if done.returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{host.name}: sshd does not answer: {done.stderr if done else ''}")

    def client_argv(self, *argv: str) -> list[str]:
        """`argv`, run in the client (the switch's namespaces)."""
        assert self.switch is not None
        return ["nsenter", "--target", str(self.switch.pid), "--mount", "--net", "--", *argv]

    def run_switch(self, *argv: str) -> str:
        out: str = run(*self.client_argv(*argv))
        return out

    def run_client(
        self, argv: Sequence[str], *, timeout: float = 600, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.client_argv(*argv), capture_output=True, text=True, timeout=timeout, env=env, check=False
        )

    def guest_lab(self, path: Path, guest: Path, vms: dict[str, str | None], *, name: str = "mh",
                  extra: str = "", scripts: dict[str, str] | None = None) -> Path:
        """Write a lab spec of the rig's hosts and of test guests (`guest`: examples/guest), each VM
        (name -> its host, None: placed) on network lan (10.9.0.0/24) at 10.9.0.11, .12, ...; `scripts`:
        a shell script a VM runs once up (the guest's `vl.run`); `extra`: more of the [lab] table."""
        text = f'[lab]\nname = "{name}"\n{extra}'
        for host in self.hosts:
            text += f'[host.{host.name}]\nuri = "{host.uri}"\n'
        text += '[network.lan]\nsubnet = "10.9.0.0/24"\n'
        for index, (vm, where) in enumerate(vms.items()):
            address = f"10.9.0.{11 + index}"
            run = ""
            if scripts and vm in scripts:
                run = " vl.run=" + base64.b64encode(scripts[vm].encode()).decode()
            text += (f'[vm.{vm}]\nmemory = "128M"\naccel = "tcg"\n' + (f'host = "{where}"\n' if where else "")
                     + f'kernel = "{guest}/vmlinuz"\ninitrd = "{guest}/initrd.gz"\n'
                     f'append = "console=ttyS0 vl.ip=eth0:{address}/24{run}"\n'
                     f'[[vm.{vm}.nic]]\nnetwork = "lan"\nip = "{address}/24"\n')
        path.write_text(text)
        return path

    def close(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.libvirt.close()
        if self.switch is not None:
            assert self.switch.stdin is not None
            with contextlib.suppress(OSError):
                self.switch.stdin.close()
            try:
                self.switch.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.switch.kill()
                self.switch.wait()
            if self.switch.stdout is not None:
                self.switch.stdout.close()
            self.switch = None
        if self.log is not None:
            self.log.close()
            self.log = None
        for folder in reversed(self.made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.made = []


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == SWITCH:
        sys.exit(switch_serve(Path(sys.argv[2])))
    print(f"usage: {sys.argv[0]} {SWITCH} WORK (as root, inside unshare --mount --net)", file=sys.stderr)
    sys.exit(64)
