#!/usr/bin/env python3
"""Boot the Debian cloud image of tools/build_debian.py under QEMU (TCG) and log in over SSH.

For each firmware asked for (UEFI: OVMF with a private copy of its NVRAM; BIOS: SeaBIOS) this
starts ``qemu-system-x86_64 -accel tcg -machine q35 -cpu max -m 1G`` on a throw-away qcow2
overlay of the image, with a NoCloud seed (an ISO 9660 volume labelled ``cidata``, made with
pycdlib) that creates a user with a freshly generated SSH key and gives the VM a pre-generated
ed25519 host key, and a user-mode NIC forwarding ``127.0.0.1:PORT`` to the guest's port 22. It
waits until the guest's sshd sends its banner, then runs ``ssh ... true`` with that host key
pinned (``StrictHostKeyChecking=yes``, a known_hosts file of its own).

It prints a timeline measured from QEMU's start, from the serial console's lines as they
arrive (kernel started, systemd in the real root, each cloud-init stage, sshd started) and the
two SSH checks; ``--analyze`` adds what the guest says about its boot (systemd-analyze,
cloud-init analyze). Exit status: 0 when every boot reached SSH, 1 when one did not (the end of
its serial console is printed; ``--keep DIR`` keeps the work files and logs), 2 on bad usage.

Usage: ``tools/try_debian.py [--image examples/debian/bookworm.qcow2] [--firmware uefi|bios|both]
[--smp N] [--disk-size SIZE] [--timeout SECONDS] [--analyze] [--keep DIR]``. With ``--disk-size``
the VM's disk is larger than the image and cloud-init grows the root file system to fill it.

Needs qemu-system-x86, qemu-utils, openssh-client, ovmf (for UEFI) and the pycdlib Python
package; never touches the host's network (QEMU user networking only). Python 3.9+, standard
library and pycdlib.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, NamedTuple, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_IMAGE = REPO_ROOT / "examples" / "debian" / "bookworm.qcow2"
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
QEMU = "qemu-system-x86_64"
USER = "vmlaunch"
MAC = "52:54:00:de:b1:01"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")
KERNEL_TIMESTAMP = re.compile(r"^\[\s*(\d+\.\d+)\]")

# Console lines that mark where boot time goes, in boot order: (label, pattern).
MILESTONES = (
    ("firmware: first console output", re.compile(r".")),
    ("kernel: first console line", re.compile(r"^\[\s*\d+\.\d+\]")),
    ("initramfs: /init started", re.compile(r"Run /init as init process")),
    ("systemd: started in the root", re.compile(r"Welcome to .*Debian|systemd\[1\]: systemd \d+")),
    ("cloud-init: init-local", re.compile(r"Cloud-init v\. \S+ running 'init-local'")),
    ("cloud-init: init (network)", re.compile(r"Cloud-init v\. \S+ running 'init'")),
    ("sshd: started", re.compile(r"Started .*(ssh\.service|OpenBSD Secure Shell)")),
    ("cloud-init: modules:config", re.compile(r"running 'modules:config'")),
    ("cloud-init: modules:final", re.compile(r"running 'modules:final'")),
    ("cloud-init: finished", re.compile(r"Cloud-init v\. \S+ finished")),
    ("getty: login prompt", re.compile(r"login: ?$")),
)
ANALYZE_COMMANDS = (
    "cloud-init status --wait --long || true",
    "systemctl is-system-running --wait || true",
    "systemd-analyze",
    "systemd-analyze blame --no-pager | head -n 25",
    "systemd-analyze critical-chain --no-pager ssh.service",
    "cloud-init analyze blame | head -n 30",
    # CPU time per service (cgroup accounting), the noise-free view of where boot work goes
    "systemctl show --type=service --all -p Id -p CPUUsageNSec '*' | paste - - - "
    "| awk -F'[= \\t]+' '$2 ~ /^[0-9]+$/ {printf \"%7.2f s %s\\n\", $2/1e9, $4}' | sort -rn | head -n 20",
    "cat /proc/uptime; head -n 1 /proc/stat",
    "systemctl list-units --failed --no-pager --plain",
    "journalctl -b -p warning --no-pager -q | tail -n 20",
    "uname -r; df -h /; cat /proc/cmdline",
)

T = TypeVar("T")


class TryError(Exception):
    """A boot that did not reach SSH, or a missing prerequisite: reported, exit status 1."""


class Keys(NamedTuple):
    user_private: Path
    user_public: str
    host_private: str
    host_public: str


class Console:
    """The guest's serial console, read from QEMU's stdout: lines with their arrival times."""

    def __init__(self, stream: IO[bytes], log_path: Path, t0: float) -> None:
        self.t0 = t0
        self.lines: list[tuple[float, str]] = []
        self.milestones: dict[str, tuple[float, str]] = {}
        self.lock = threading.Lock()
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the thread
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                now = time.monotonic() - self.t0
                line = ANSI_ESCAPE.sub("", raw.decode("utf-8", "replace")).rstrip("\n")
                if not line.strip():
                    continue
                with self.lock:
                    self.lines.append((now, line))
                    for label, pattern in MILESTONES:
                        if label not in self.milestones and pattern.search(line):
                            self.milestones[label] = (now, line)
                self.log.write(f"[{now:8.3f}] {line}\n")
                self.log.flush()
        finally:
            self.log.close()

    def tail(self, count: int = 25) -> list[str]:
        with self.lock:
            return [line for _t, line in self.lines[-count:]]

    def last_line(self) -> str:
        tail = self.tail(1)
        return tail[0][:100] if tail else "(nothing yet)"

    def kernel_start(self) -> float | None:
        """When the kernel started, from a line printed live: its arrival minus its timestamp."""
        with self.lock:
            found = self.milestones.get("initramfs: /init started")
        if found is None:
            return None
        match = KERNEL_TIMESTAMP.search(found[1])
        return found[0] - float(match.group(1)) if match else None


# --------------------------------------------------------------------------- helpers


def say(message: str) -> None:
    print(f"try_debian: {message}", flush=True)


def run(cmd: Sequence[str], what: str) -> str:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    except OSError as exc:
        raise TryError(f"{what}: cannot run {cmd[0]}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        raise TryError(f"{what}: {shlex.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def retry(
    attempt: Callable[[], T | None],
    deadline: float,
    what: str,
    progress: Callable[[], str],
    interval: float = 0.5,
) -> T:
    """Call attempt until it returns a value; TryError at the deadline. Progress every 10 s."""
    next_report = time.monotonic() + 10
    while True:
        result = attempt()
        if result is not None:
            return result
        now = time.monotonic()
        if now >= deadline:
            raise TryError(f"timed out waiting for {what}")
        if now >= next_report:
            say(f"  still waiting for {what}: {progress()}")
            next_report = now + 10
        time.sleep(min(interval, max(0.0, deadline - now)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --------------------------------------------------------------------------- guest inputs


def make_keys(work: Path) -> Keys:
    user_key, host_key = work / "user_ed25519", work / "host_ed25519"
    for path, comment in ((user_key, "vmlaunch-try-user"), (host_key, "vmlaunch-try-host")):
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], "ssh-keygen")
    return Keys(
        user_private=user_key,
        user_public=Path(f"{user_key}.pub").read_text().strip(),
        host_private=host_key.read_text(),
        host_public=Path(f"{host_key}.pub").read_text().strip(),
    )


def user_data(keys: Keys) -> str:
    host_private = "".join(f"    {line}\n" for line in keys.host_private.splitlines())
    return (
        "#cloud-config\n"
        "users:\n"
        f"  - name: {USER}\n"
        "    shell: /bin/bash\n"
        "    sudo: 'ALL=(ALL) NOPASSWD:ALL'\n"
        "    lock_passwd: true\n"
        f"    ssh_authorized_keys: ['{keys.user_public}']\n"
        "# the host key is made here, so the VM need not generate any (RSA takes seconds under TCG)\n"
        "ssh_keys:\n"
        "  ed25519_private: |\n"
        f"{host_private}"
        f"  ed25519_public: '{keys.host_public}'\n"
    )


def meta_data(instance: str) -> str:
    return f"instance-id: {instance}\nlocal-hostname: try-debian\n"


def make_seed(path: Path, files: dict[str, str]) -> None:
    """A NoCloud seed: ISO 9660 labelled cidata, with Rock Ridge and Joliet names."""
    try:
        import pycdlib
    except ImportError:
        raise TryError("the pycdlib package is missing: .venv/bin/pip install pycdlib") from None
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident="cidata")
    for name, text in files.items():
        data = text.encode()
        short = name.replace("-", "").upper()[:8]
        iso.add_fp(io.BytesIO(data), len(data), f"/{short}.;1", rr_name=name, joliet_path=f"/{name}")
    iso.write(str(path))
    iso.close()


# --------------------------------------------------------------------------- QEMU


def qemu_argv(firmware: str, work: Path, overlay: Path, seed: Path, port: int, smp: int) -> list[str]:
    machine = "q35"
    argv = [QEMU, "-accel", "tcg", "-cpu", "max", "-m", "1G", "-smp", str(smp)]
    argv += ["-nodefaults", "-no-user-config", "-display", "none"]
    if firmware == "uefi":
        vars_copy = work / "OVMF_VARS.fd"
        shutil.copyfile(OVMF_VARS, vars_copy)
        machine += ",pflash0=fw-code,pflash1=fw-vars"
        code = json_arg(driver="file", node_name="fw-code", filename=str(OVMF_CODE), read_only=True)
        argv += ["-blockdev", code]
        argv += ["-blockdev", json_arg(driver="file", node_name="fw-vars", filename=str(vars_copy))]
    argv += ["-machine", machine]
    argv += [
        "-blockdev",
        '{"driver": "qcow2", "node-name": "disk0", "file": '
        + json_arg(driver="file", filename=str(overlay))
        + "}",
        "-device",
        '{"driver": "virtio-blk-pci", "drive": "disk0", "bootindex": 0}',
        "-blockdev",
        '{"driver": "raw", "node-name": "seed", "read-only": true, "file": '
        + json_arg(driver="file", filename=str(seed), read_only=True)
        + "}",
        "-device",
        '{"driver": "virtio-blk-pci", "drive": "seed"}',
        "-netdev",
        f"user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:22",
        "-device",
        f'{{"driver": "virtio-net-pci", "netdev": "net0", "mac": "{MAC}", "romfile": ""}}',
        "-device",
        '{"driver": "virtio-rng-pci"}',
        "-chardev",
        "stdio,id=serial0,signal=off",
        "-serial",
        "chardev:serial0",
        "-D",
        str(work / "qemu.log"),  # a plain file name: not parsed as options
    ]
    return argv


def json_arg(**fields: object) -> str:
    """A JSON-form option argument (no escaping needed); node_name becomes node-name."""
    return json.dumps({key.replace("_", "-"): value for key, value in fields.items()})


@contextlib.contextmanager
def qemu_process(argv: list[str], work: Path) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    stderr = open(work / "qemu.stderr", "wb")  # noqa: SIM115 - closed below
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr)
    except OSError as exc:
        stderr.close()
        raise TryError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    try:
        yield proc, t0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stderr.close()


def ssh_banner(port: int) -> bytes | None:
    """The server's identification line, or None while nothing in the guest answers.

    With user networking QEMU accepts the connection itself and closes it when the guest
    refuses, so a connection alone proves nothing: the banner does.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.settimeout(3)
            data = sock.recv(256)
    except OSError:
        return None
    return data if data.startswith(b"SSH-") else None


def ssh_argv(keys: Keys, known_hosts: Path, port: int, command: str) -> list[str]:
    return [
        "ssh",
        "-F",
        "/dev/null",
        "-i",
        str(keys.user_private),
        "-p",
        str(port),
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "HostKeyAlgorithms=ssh-ed25519",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=ERROR",
        f"{USER}@127.0.0.1",
        command,
    ]


# --------------------------------------------------------------------------- one boot


class BootResult(NamedTuple):
    firmware: str
    banner: float
    ssh_true: float
    qemu_cpu: float  # seconds of host CPU QEMU had used when the banner came
    host_other: float  # seconds of host CPU other processes used meanwhile
    host_steal: float  # seconds the hypervisor gave the host's CPUs to someone else meanwhile
    timeline: list[tuple[float, str]]
    analysis: str


class Options(NamedTuple):
    image: Path
    smp: int
    timeout: float
    analyze: bool
    disk_size: str | None  # the overlay's virtual size (cloud-init grows the root to it)


def boot(firmware: str, work: Path, options: Options) -> BootResult:
    image, smp, timeout, analyze = options.image, options.smp, options.timeout, options.analyze
    keys = make_keys(work)
    port = free_port()
    known_hosts = work / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {keys.host_public}\n")
    seed = work / "seed.iso"
    instance = f"try-{uuid.uuid4().hex[:12]}"
    make_seed(seed, {"meta-data": meta_data(instance), "user-data": user_data(keys)})
    overlay = work / "disk.qcow2"
    size = [options.disk_size] if options.disk_size else []
    run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(image), str(overlay), *size],
        "qemu-img create",
    )
    argv = qemu_argv(firmware, work, overlay, seed, port, smp)
    busy_before, steal_before = host_cpu_seconds()
    (work / "qemu.argv").write_text(shlex.join(argv) + "\n")
    with qemu_process(argv, work) as (proc, t0):
        assert proc.stdout is not None
        console = Console(proc.stdout, work / "serial.log", t0)
        deadline = t0 + timeout

        def alive_then(check: Callable[[], T | None]) -> Callable[[], T | None]:
            def attempt() -> T | None:
                if proc.poll() is not None:
                    stderr = (work / "qemu.stderr").read_text(errors="replace").strip()
                    raise TryError(f"QEMU exited with status {proc.returncode}: {stderr or 'no message'}")
                return check()

            return attempt

        try:
            retry(alive_then(lambda: ssh_banner(port)), deadline, "the SSH banner", console.last_line)
            banner = time.monotonic() - t0
            qemu_cpu = process_cpu_seconds(proc.pid)
            busy, steal = host_cpu_seconds()

            def ssh_true() -> bool | None:
                result = subprocess.run(
                    ssh_argv(keys, known_hosts, port, "true"), capture_output=True, text=True, check=False
                )
                if result.returncode != 0:
                    (work / "ssh.err").write_text(result.stderr)
                return True if result.returncode == 0 else None

            retry(alive_then(ssh_true), deadline, "ssh ... true", console.last_line, interval=1.0)
            logged_in = time.monotonic() - t0
            analysis = run_analysis(keys, known_hosts, port) if analyze else ""
        except TryError as exc:
            tail = "\n".join(f"    {line}" for line in console.tail())
            ssh_err = work / "ssh.err"
            extra = f"\n  last ssh error: {ssh_err.read_text().strip()}" if ssh_err.exists() else ""
            raise TryError(f"{firmware}: {exc}{extra}\n  serial console (last lines):\n{tail}") from None
        with console.lock:
            timeline = [(t, label) for label, (t, _line) in console.milestones.items()]
        start = console.kernel_start()
        if start is not None:
            timeline.append((start, "kernel: started (estimated from its own timestamps)"))
    timeline += [(banner, "SSH: banner"), (logged_in, "SSH: 'ssh ... true' succeeded")]
    other, stolen = busy - busy_before - qemu_cpu, steal - steal_before
    return BootResult(firmware, banner, logged_in, qemu_cpu, other, stolen, sorted(timeline), analysis)


def host_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole host so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process: shows when the host, not the guest, was slow."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_analysis(keys: Keys, known_hosts: Path, port: int) -> str:
    parts = []
    for command in ANALYZE_COMMANDS:
        result = subprocess.run(
            ssh_argv(keys, known_hosts, port, f"sudo sh -c {shlex.quote(command)}"),
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        parts.append(f"$ {command}\n{result.stdout}{result.stderr}")
    return "\n".join(parts)


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def work_dir(keep: Path | None, firmware: str) -> Iterator[Path]:
    """A fresh directory for one boot: KEEP/FIRMWARE, kept, or a temporary one."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=f"try-debian-{firmware}-") as tmp:
            yield Path(tmp)
        return
    work = keep.resolve() / firmware
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    yield work


def check_prerequisites(image: Path, firmwares: list[str]) -> None:
    if not image.is_file():
        raise TryError(f"no image at {image}: build it with tools/build_debian.py (as root)")
    needed = ((QEMU, "qemu-system-x86"), ("qemu-img", "qemu-utils"), ("ssh", "openssh-client"))
    for command, package in needed:
        if shutil.which(command) is None:
            raise TryError(f"{command} is missing: apt-get install {package}")
    if "uefi" in firmwares and not (OVMF_CODE.is_file() and OVMF_VARS.is_file()):
        raise TryError(f"OVMF is missing ({OVMF_CODE}): apt-get install ovmf")


def report(result: BootResult) -> None:
    times = f"SSH banner after {result.banner:.1f} s, 'ssh true' after {result.ssh_true:.1f} s"
    say(f"{result.firmware}: {times}")
    say(
        f"  host CPU until the banner: QEMU {result.qemu_cpu:.1f} s, other processes "
        f"{result.host_other:.1f} s, steal {result.host_steal:.1f} s ({os.cpu_count()} CPUs)"
    )
    previous = 0.0
    for at, label in result.timeline:
        say(f"  {at:7.1f} s  (+{at - previous:5.1f})  {label}")
        previous = at
    if result.analysis:
        print(result.analysis)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--image", type=Path, default=DEFAULT_IMAGE, help=f"default: {DEFAULT_IMAGE}")
    parser.add_argument("--firmware", choices=("uefi", "bios", "both"), default="both")
    parser.add_argument("--smp", type=int, default=1, help="vCPUs (default: 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per boot (default: 300)")
    parser.add_argument("--disk-size", help="virtual size of the VM's disk, e.g. 4G (default: the image's)")
    parser.add_argument("--analyze", action="store_true", help="print systemd-analyze and cloud-init analyze")
    parser.add_argument("--keep", type=Path, help="keep the work files (serial.log, keys, seed) in DIR")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    firmwares = ["uefi", "bios"] if args.firmware == "both" else [args.firmware]
    image: Path = args.image.resolve()
    failed = False
    options = Options(image, args.smp, args.timeout, args.analyze, args.disk_size)
    try:
        check_prerequisites(image, firmwares)
    except TryError as exc:
        print(f"try_debian: error: {exc}", file=sys.stderr)
        return 1
    for firmware in firmwares:
        with work_dir(args.keep, firmware) as work:
            say(f"{firmware}: booting {image.name} (TCG, q35, -cpu max, 1G, {args.smp} vCPU)")
            try:
                result = boot(firmware, work, options)
            except TryError as exc:
                print(f"try_debian: error: {exc}", file=sys.stderr)
                failed = True
                continue
            except KeyboardInterrupt:
                print("try_debian: interrupted", file=sys.stderr)
                return 130
            report(result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
