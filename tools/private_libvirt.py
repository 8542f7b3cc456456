#!/usr/bin/env python3
"""libvirt's own daemons (Debian's libvirtd 9.0 and virtlogd), run privately, for tests and benchmarks.

The daemons run in a mount and network namespace of their own: their configuration, state, logs and
sockets live in a folder of the caller's (bind-mounted over /etc/libvirt, /var/lib/libvirt,
/var/log/libvirt and /var/cache/libvirt; /run is a tmpfs), the bridges and taps they make live in
the namespace's own network, and the host's files get nothing: a mount point folder that had to be
made on the host is removed again, every domain and network is destroyed and undefined, and the
daemons (and anything else left in the namespace) are stopped before the namespace goes.

What libvirtd 9.0 needs to run QEMU as root here (QEMU-FACTS.md): `user = "root"`, `group = "root"`,
`dynamic_ownership = 0` and `security_driver = "none"` in qemu.conf, a `libvirt-qemu` user (its
build-time QEMU user, looked up even when qemu.conf says root: given in a private /etc/passwd and
/etc/group, the host gets no user), and virtlogd running. Domains need `type='qemu'` (TCG) here.

Two ways to use it:
- `private_libvirt(work)`: a context manager for a process that is already in namespaces of its own
  (`unshare --mount --net --propagation private`), as bench/boot.py is.
- `PrivateLibvirt(work)`: for a process that stays in the host's namespaces (a test): it starts
  `python tools/private_libvirt.py --serve WORK` under `unshare`, and `argv(...)` runs a command in
  there through `nsenter`. Closing it (the helper's standard input) tears everything down.

Standard library only. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

# The least that runs domains and networks (no daemon is started by installing them): iptables for
# libvirt's networks (it writes their rules, in the private network namespace), xmllint for
# virt-xml-validate. tools/setup.sh installs the same.
LIBVIRT_PACKAGES = ("libvirt-daemon", "libvirt-daemon-driver-qemu", "libvirt-clients", "libxml2-utils",
                    "iptables")
LIBVIRT_DIRS = ("/etc/libvirt", "/var/lib/libvirt", "/var/log/libvirt", "/var/cache/libvirt")
HUGETLBFS = "/run/hugepages"  # inside the private /run: hugepage domains can be converted and checked
QEMU_CONF = ('user = "root"\ngroup = "root"\ndynamic_ownership = 0\nsecurity_driver = "none"\n'
             f'hugetlbfs_mount = "{HUGETLBFS}"\n')
QEMU_USER = ("libvirt-qemu:x:64055:64055::/var/lib/libvirt:/usr/sbin/nologin\n", "libvirt-qemu:x:64055:\n")
CONNECT = ("--connect", "qemu:///system")
SERVE = "--serve"
READY = "private libvirt ready"


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def missing_packages(packages: Sequence[str]) -> list[str]:
    missing = []
    for package in packages:
        done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True,
                              text=True, check=False)
        if "ok installed" not in done.stdout:
            missing.append(package)
    return missing


def ensure_libvirt(extra: Sequence[str] = ()) -> None:
    """Install libvirt's Debian packages that are missing (tools/setup.sh installs the same)."""
    missing = missing_packages((*LIBVIRT_PACKAGES, *extra))
    if not missing:
        return
    print(f"private_libvirt: installing {', '.join(missing)} (Debian packages; they start no daemon)",
          file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", env=env, timeout=600)
    run("apt-get", "install", "-y", "--no-install-recommends", *missing, env=env, timeout=1200)


@contextlib.contextmanager
def private_libvirt(work: Path) -> Iterator[None]:
    """libvirtd and virtlogd with their files in `work`; this process must be in a mount (and network)
    namespace of its own, with private propagation. Everything is stopped and undone on exit."""
    made: list[Path] = []  # mount points made on the host: removed again at the end
    mounted: list[str] = []
    try:
        run("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run")  # pidfiles, sockets: private
        mounted.append("/run")
        for path in LIBVIRT_DIRS:
            private = work / "libvirt" / path.strip("/").replace("/", "_")
            private.mkdir(parents=True)
            if Path(path).is_dir():
                shutil.copytree(path, private, dirs_exist_ok=True)
            made += _make_dirs(Path(path))
            run("mount", "--bind", str(private), path)
            mounted.append(path)
        Path("/etc/libvirt/qemu.conf").write_text(QEMU_CONF)
        # virt-install keeps its cloud-init seed in boot; a network with an address keeps its MACs in dnsmasq
        for sub in ("boot", "images", "dnsmasq"):
            Path("/var/lib/libvirt", sub).mkdir(exist_ok=True)
        # domains' logs, as Debian's libvirt-daemon-system makes it (serial console logs go there)
        Path("/var/log/libvirt/qemu").mkdir(mode=0o750, exist_ok=True)
        Path(HUGETLBFS).mkdir()
        run("mount", "-t", "hugetlbfs", "hugetlbfs", HUGETLBFS)
        mounted.append(HUGETLBFS)
        for table, line in zip(("passwd", "group"), QEMU_USER):
            private = work / "libvirt" / table
            text = Path("/etc", table).read_text()
            private.write_text(text if "\nlibvirt-qemu:" in f"\n{text}" else text + line)
            run("mount", "--bind", str(private), f"/etc/{table}")
            mounted.append(f"/etc/{table}")
        run("ip", "link", "set", "lo", "up")
        run("virtlogd", "-d")
        run("libvirtd", "-d")
        _wait_for_libvirtd()
        yield
    finally:
        with contextlib.suppress(Exception):
            clear_domains()
        for daemon in ("libvirtd", "virtlogd"):
            stop(Path(f"/run/{daemon}.pid"))
        kill_namespace_mates()
        for point in reversed(mounted):
            subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _make_dirs(path: Path) -> list[Path]:
    """mkdir -p, returning the folders it made (outermost first)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir()
    return list(reversed(missing))


def _wait_for_libvirtd() -> None:
    for _ in range(300):
        if subprocess.run(["virsh", *CONNECT, "version"], capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.1)
    log = Path("/var/log/libvirt/libvirtd.log")
    said = log.read_text()[-2000:] if log.exists() else ""
    raise RuntimeError(f"libvirtd did not answer: {said}")


def clear_domains() -> None:
    """Destroy and undefine every domain, network and storage pool the private libvirtd has."""
    def names(*listing: str) -> list[str]:
        done = subprocess.run(["virsh", *CONNECT, *listing], capture_output=True, text=True, check=False)
        return [name for name in done.stdout.split() if name]

    for name in names("list", "--all", "--name"):
        for action in (("destroy", name), ("undefine", "--nvram", name)):
            subprocess.run(["virsh", *CONNECT, *action], capture_output=True, check=False, timeout=60)
    for name in names("net-list", "--all", "--name"):
        for action in (("net-destroy", name), ("net-undefine", name)):
            subprocess.run(["virsh", *CONNECT, *action], capture_output=True, check=False, timeout=60)
    for name in names("pool-list", "--all", "--name"):
        for action in (("pool-destroy", name), ("pool-delete", name), ("pool-undefine", name)):
            subprocess.run(["virsh", *CONNECT, *action], capture_output=True, check=False, timeout=60)


def stop(pidfile: Path) -> None:
    """SIGTERM to the daemon of `pidfile`, SIGKILL if it is still there after 10 s."""
    try:
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def kill_namespace_mates() -> None:
    """SIGKILL every other process in this mount or network namespace: a QEMU a failed test left
    running. libvirt runs each QEMU in a mount namespace of its own, but in libvirtd's network
    namespace, which is private here: so a QEMU is found even when its libvirtd is dead."""
    own = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("mnt", "net")}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(proc / "ns" / ns) == found for ns, found in own.items()):
                os.kill(int(proc.name), signal.SIGKILL)


def serve(work: Path) -> int:
    """Inside `unshare`: start the daemons, say so, wait until standard input closes, tear down."""
    with private_libvirt(work):
        print(READY, flush=True)
        sys.stdin.read()
    return 0


class PrivateLibvirt:
    """A private libvirtd for a process that stays in the host's namespaces (see the module)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.process: subprocess.Popen[str] | None = None
        self.log: IO[Any] | None = None

    def __enter__(self) -> PrivateLibvirt:
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = open(self.work / "helper.log", "w")  # noqa: SIM115 - closed by close()
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--net", "--propagation", "private", "--",
             sys.executable, str(Path(__file__).resolve()), SERVE, str(self.work)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != READY:
            self.close()
            raise RuntimeError(f"the private libvirtd did not start: {self.helper_log()}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def helper_log(self) -> str:
        path = self.work / "helper.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def argv(self, *argv: str) -> list[str]:
        """`argv`, run inside the private namespaces."""
        assert self.process is not None
        return ["nsenter", "--target", str(self.process.pid), "--mount", "--net", "--", *argv]

    def run(self, *argv: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.argv(*argv), capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        return done

    def virsh(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("virsh", *CONNECT, *args, timeout=timeout, check=check)

    def close(self) -> None:
        """Tear down: the helper destroys the domains and networks and stops the daemons."""
        if self.process is not None:
            assert self.process.stdin is not None
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None
        if self.log is not None:
            self.log.close()
            self.log = None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == SERVE:
        sys.exit(serve(Path(sys.argv[2])))
    print(f"usage: {sys.argv[0]} {SERVE} WORK (as root, inside unshare --mount --net)", file=sys.stderr)
    sys.exit(64)
