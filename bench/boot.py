#!/usr/bin/env python3
"""A real Debian guest from command to SSH: `vmlaunch up` against virt-install and a plain QEMU line.

Three ways to boot the same image (tools/build_debian.py's bookworm, built if missing) with the
same settings (1 vCPU, 1 GiB, UEFI, a fresh qcow2 overlay, a user with an SSH key given by
cloud-init, SSH forwarded from a 127.0.0.1 port), interleaved, `--runs` times each:

- `qemu`: the line a user types from a distro's cloud-image instructions (q35, TCG, OVMF and a
  copy of its variables, the overlay and a NoCloud seed on virtio, `-nic user,hostfwd=...`; no
  `-cpu`: QEMU's default model), after `qemu-img create` of the overlay and the seed;
- `libvirt`: `virt-install --import --cloud-init user-data=...` (libvirt 9.0 from Debian's packages,
  installed by this script; plain OVMF, user networking; the port forward added over HMP once the
  domain runs, as libvirt 9.0 has none for user networking);
- `vmlaunch`: `vmlaunch up --fresh` of the equivalent one-VM spec (`firmware = "uefi"`, its
  defaults for everything else).

Two instants of each boot, measured the same way for all three (the clock starts before the first
command; SSH is polled every 0.5 s with the arm's key):
- *ssh*: the first `ssh ... true` that succeeds;
- *ready*: `cloud-init status --wait` has returned (what `vmlaunch up --wait ssh` waits for: a
  guest whose runcmd and packages are done).
From the guest, after each boot: its uptime at *ready* (what is left is QEMU, the firmware and the
boot loader) and cloud-init's time for its SSH module (host keys: generated in the guest unless
given, as vmlaunch gives them).

Then the warm start: a snapshot of the last vmlaunch VM (RAM included) is saved, the lab goes down,
and `vmlaunch up --from-snapshot NAME --wait ssh` is timed `--runs` times (target: at least 20x faster
than the cold `vmlaunch` *ready*).

Everything runs in a private network and mount namespace (`unshare`): libvirtd and virtlogd run
there with their files in a temporary folder (tools/private_libvirt.py), so the host's network and
libvirt files are not touched; every VM and daemon is stopped before the script ends.

    python bench/boot.py [--runs N] [--arms qemu,libvirt,vmlaunch] [--no-warm] [--timeout S]

An arm `vmlaunch@MODEL` boots the same spec with `cpu_model = "MODEL"`, and `qemu@CPU` the plain line
with `-cpu CPU` (features included), to weigh CPU models under TCG:
`--arms qemu,vmlaunch,vmlaunch@max,qemu@qemu64,+popcnt`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.private_libvirt import ensure_libvirt, private_libvirt  # noqa: E402

IMAGE = ROOT / "examples" / "debian" / "bookworm.qcow2"
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
USER = "dev"
MEMORY_MIB = 1024
INSIDE = "--inside-namespace"


def say(text: str) -> None:
    print(f"boot: {text}", file=sys.stderr, flush=True)


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


# --------------------------------------------------------------------------- setup


def ensure_image() -> None:
    say("the Debian image (tools/build_debian.py: built once, then cached)")
    run(sys.executable, str(ROOT / "tools" / "build_debian.py"), timeout=1800)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Keys:
    def __init__(self, folder: Path) -> None:
        self.private = folder / "id_ed25519"
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bench", "-f", str(self.private))
        self.public = (folder / "id_ed25519.pub").read_text().strip()

    def user_data(self) -> str:
        """What a user writes for a cloud image: a user with the key and sudo."""
        config = {"users": [{"name": USER, "sudo": "ALL=(ALL) NOPASSWD:ALL", "shell": "/bin/bash",
                             "ssh_authorized_keys": [self.public]}]}
        return "#cloud-config\n" + json.dumps(config, indent=1) + "\n"


# --------------------------------------------------------------------------- one boot


class Sample:
    def __init__(self, ssh: float, ready: float, uptime: float, ssh_module: float | None) -> None:
        self.ssh, self.ready, self.uptime, self.ssh_module = ssh, ready, uptime, ssh_module


def ssh_argv(key: Path, user: str, port: int, *command: str) -> list[str]:
    return ["ssh", "-F", "/dev/null", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
            "-o", "ConnectTimeout=5", f"{user}@127.0.0.1", *command]


def watch(start: float, key: Path, user: str, port: int, timeout: float) -> Sample:
    """Poll SSH until it answers, then wait for cloud-init; the two instants since `start`."""
    while True:
        done = subprocess.run(ssh_argv(key, user, port, "true"), capture_output=True, timeout=60, check=False)
        if done.returncode == 0:
            break
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"no SSH answer on port {port} in {timeout:.0f} s")
        time.sleep(0.5)
    ssh_at = time.monotonic() - start
    run(*ssh_argv(key, user, port, "cloud-init", "status", "--wait"), timeout=timeout)
    ready_at = time.monotonic() - start
    uptime = float(run(*ssh_argv(key, user, port, "cat", "/proc/uptime")).split()[0])
    blame = run(*ssh_argv(key, user, port, "sudo", "cloud-init", "analyze", "blame"), timeout=120)
    return Sample(ssh_at, ready_at, uptime, _module_time(blame, "config-ssh"))


def _module_time(blame: str, module: str) -> float | None:
    for line in blame.splitlines():
        words = line.split()
        if len(words) == 2 and words[1].strip("()").endswith(module) and words[0].endswith("s"):
            return float(words[0].rstrip("s"))
    return None


def overlay(path: Path) -> None:
    run("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(IMAGE), str(path))


def boot_qemu(work: Path, keys: Keys, timeout: float, cpu_model: str | None = None) -> Sample:
    from vmlaunch.guests.cloudinit import write_seed

    folder = Path(tempfile.mkdtemp(dir=work, prefix="qemu-"))
    port = free_port()
    start = time.monotonic()
    overlay(folder / "disk.qcow2")
    write_seed(folder / "seed.iso", keys.user_data(), "instance-id: bench\nlocal-hostname: bench\n", None)
    shutil.copyfile(OVMF_VARS, folder / "vars.fd")
    pidfile = folder / "qemu.pid"
    cpu = ["-cpu", cpu_model] if cpu_model else []
    run("qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", *cpu, "-m", f"{MEMORY_MIB}M", "-smp", "1",
        "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
        "-drive", f"if=pflash,format=raw,file={folder / 'vars.fd'}",
        "-drive", f"file={folder / 'disk.qcow2'},if=virtio",
        "-drive", f"file={folder / 'seed.iso'},if=virtio,format=raw",
        "-nic", f"user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:{port}-:22",
        "-display", "none", "-serial", f"file:{folder / 'serial.log'}",
        "-daemonize", "-pidfile", str(pidfile))
    try:
        return watch(start, keys.private, USER, port, timeout)
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def boot_libvirt(work: Path, keys: Keys, timeout: float) -> Sample:
    folder = Path(tempfile.mkdtemp(dir=work, prefix="libvirt-"))
    (folder / "user-data").write_text(keys.user_data())
    name = folder.name
    port = free_port()
    start = time.monotonic()
    overlay(folder / "disk.qcow2")
    virsh = ("virsh", "--connect", "qemu:///system")
    try:
        run("virt-install", "--connect", "qemu:///system", "--name", name, "--virt-type", "qemu",
            "--memory", str(MEMORY_MIB), "--vcpus", "1", "--import", "--osinfo", "debian11",
            "--disk", f"path={folder / 'disk.qcow2'},format=qcow2,bus=virtio",
            "--cloud-init", f"user-data={folder / 'user-data'}",
            "--network", "user,model=virtio", "--graphics", "none", "--noautoconsole",
            "--boot", "uefi,firmware.feature0.name=secure-boot,firmware.feature0.enabled=no")
        run(*virsh, "qemu-monitor-command", "--hmp", name, f"hostfwd_add hostnet0 tcp:127.0.0.1:{port}-:22")
        return watch(start, keys.private, USER, port, timeout)
    finally:
        subprocess.run([*virsh, "destroy", name], capture_output=True, check=False)
        subprocess.run([*virsh, "undefine", "--nvram", name], capture_output=True, check=False)


class Vmlaunch:
    """The vmlaunch arm: one spec, run dir and cache of its own."""

    def __init__(self, work: Path, index: int, cpu_model: str | None) -> None:
        lab = f"bench{index}"
        self.folder = work / lab
        self.folder.mkdir()
        self.spec = self.folder / "bench.toml"
        cpu = f'cpu_model = "{cpu_model}"\n' if cpu_model else ""
        self.spec.write_text(f'[lab]\nname = "{lab}"\n\n[image.debian]\nfile = "{IMAGE}"\n\n'
                             f'[vm.bench]\nmemory = {MEMORY_MIB}\ncpus = 1\nimage = "debian"\n{cpu}'
                             f'firmware = "uefi"\n[vm.bench.cloud_init]\nuser = "{USER}"\n')
        self.env = {**os.environ, "VMLAUNCH_RUN_DIR": str(work / "run"),
                    "VMLAUNCH_CACHE_DIR": str(work / "cache")}
        self.key = self.folder / ".vmlaunch" / lab / "ssh" / "id_ed25519"

    def cli(self, *args: str, timeout: float = 600) -> str:
        return run(sys.executable, "-m", "vmlaunch", *args, env=self.env, timeout=timeout)

    def boot(self, timeout: float) -> Sample:
        start = time.monotonic()
        self.cli("up", str(self.spec), "--fresh")
        port = int(json.loads(self.cli("status", str(self.spec), "--json"))["bench"]["ssh_port"])
        return watch(start, self.key, USER, port, timeout)

    def down(self) -> None:
        subprocess.run([sys.executable, "-m", "vmlaunch", "down", str(self.spec)], env=self.env,
                       capture_output=True, check=False, timeout=300)

    def warm(self, runs: int, timeout: float) -> list[float]:
        self.cli("snapshot", str(self.spec), "save", "warm", timeout=timeout)
        self.down()
        times = []
        for _ in range(runs):
            start = time.monotonic()
            self.cli("up", str(self.spec), "--from-snapshot", "warm", "--wait", "ssh", "--timeout",
                     str(int(timeout)), timeout=timeout)
            times.append(time.monotonic() - start)
            self.down()
        return times


# --------------------------------------------------------------------------- the report


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):6.1f} [{min(values):.1f}-{max(values):.1f}]"


def report(samples: dict[str, list[Sample]], warm: list[float]) -> None:
    print(f"\n{'arm':16} {'SSH answers (s)':>20} {'ready (s)':>20} {'before the kernel':>18} "
          f"{'cloud-init ssh step':>20}")
    for arm, found in samples.items():
        before = [s.ready - s.uptime for s in found]
        module = [s.ssh_module for s in found if s.ssh_module is not None]
        print(f"{arm:16} {spread([s.ssh for s in found]):>20} {spread([s.ready for s in found]):>20} "
              f"{spread(before):>18} {spread(module):>20}")
    if samples.get("vmlaunch"):
        ours = samples["vmlaunch"]
        for arm, found in samples.items():
            if arm != "vmlaunch" and found:
                ssh, ready = (median(ours, f) / median(found, f) for f in ("ssh", "ready"))
                print(f"vmlaunch / {arm}: SSH {ssh:.2f}x, ready {ready:.2f}x (below 1: vmlaunch faster)")
        if warm:
            ratio = median(ours, "ready") / statistics.median(warm)
            print(f"warm start: up --from-snapshot --wait ssh {spread(warm)} s; cold ready / warm = "
                  f"{ratio:.1f}x (target >= 20x)")


def median(found: list[Sample], field: str) -> float:
    return float(statistics.median(float(getattr(s, field)) for s in found))


def measure(args: argparse.Namespace) -> int:
    run("ip", "link", "set", "lo", "up")
    # commas separate arms, and may also be in a CPU model's features: a new arm starts at a name
    arms = [a for a in re.split(r"[\s,]+(?=(?:qemu|libvirt|vmlaunch)(?:@|$|[\s,]))", args.arms.strip()) if a]
    with tempfile.TemporaryDirectory(prefix="vmlaunch-boot-") as tmp:
        work = Path(tmp)
        keys = Keys(work)
        samples: dict[str, list[Sample]] = {arm: [] for arm in arms}
        labs = {arm: Vmlaunch(work, index, arm.partition("@")[2] or None)
                for index, arm in enumerate(arms) if arm.partition("@")[0] == "vmlaunch"}
        boots: dict[str, Callable[[], Sample]] = {
            "qemu": lambda: boot_qemu(work, keys, args.timeout),
            "libvirt": lambda: boot_libvirt(work, keys, args.timeout),
            **{arm: functools.partial(lab.boot, args.timeout) for arm, lab in labs.items()},
            **{arm: functools.partial(boot_qemu, work, keys, args.timeout, arm.partition("@")[2])
               for arm in arms if arm.startswith("qemu@")},
        }
        unknown = set(arms) - set(boots)
        if unknown:
            print(f"boot: unknown arm {', '.join(sorted(unknown))}: qemu[@CPU], libvirt, "
                  "vmlaunch[@CPU_MODEL]", file=sys.stderr)
            return 2
        ours = labs.get("vmlaunch")
        warm: list[float] = []
        with private_libvirt(work) if "libvirt" in arms else contextlib.nullcontext():
            try:
                for index in range(args.runs):
                    order = arms[index % len(arms):] + arms[:index % len(arms)]
                    last = index == args.runs - 1
                    if last and "vmlaunch" in order:  # its last boot stays up for the warm start
                        order.remove("vmlaunch")
                        order.append("vmlaunch")
                    for arm in order:
                        sample = boots[arm]()
                        samples[arm].append(sample)
                        say(f"run {index + 1}/{args.runs} {arm}: "
                            f"SSH {sample.ssh:.1f} s, ready {sample.ready:.1f} s")
                        if arm in labs and not (last and args.warm and arm == "vmlaunch"):
                            labs[arm].down()
                if ours is not None and args.warm:
                    warm = ours.warm(args.runs, args.timeout)
            finally:
                for lab in labs.values():
                    lab.down()
        report(samples, warm)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="boots of each arm, interleaved (default: 3)")
    parser.add_argument("--arms", default="qemu,libvirt,vmlaunch",
                        help="comma-separated: qemu, libvirt, vmlaunch, vmlaunch@CPU_MODEL")
    parser.add_argument("--no-warm", dest="warm", action="store_false", help="skip the warm start")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per boot (default: 600)")
    parser.add_argument(INSIDE, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("boot: run as root (libvirtd, namespaces)", file=sys.stderr)
        return 2
    if args.inside_namespace:
        try:
            return measure(args)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"boot: error: {exc}", file=sys.stderr)
            return 1
    ensure_image()
    if "libvirt" in args.arms:
        ensure_libvirt(extra=("virtinst",))
    return subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "--",
                           sys.executable, *sys.argv, INSIDE], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
