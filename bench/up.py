#!/usr/bin/env python3
"""`vmlaunch up` against raw QEMU, measured interleaved in one run on the same guest.

- one VM: `vmlaunch up` of a one-VM user-network lab until the VM runs and answers QMP, against
  `qemu-system-x86_64 -daemonize` of the same argv followed by a QMP query-status. Target: <= 2x.
- ten VMs: `vmlaunch up` of a ten-VM lab against the one-VM lab. Target: <= 3x.

Needs the test guest (`make setup`). Guests run under TCG with 64 MiB and are torn down after each
sample (not timed).   python bench/up.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUEST = ROOT / "examples" / "guest"


def spec_text(name: str, count: int) -> str:
    text = f'[lab]\nname = "{name}"\n[network.out]\ntype = "user"\n'
    for i in range(count):
        text += (f'[vm.vm{i}]\nmemory = 64\naccel = "tcg"\nkernel = "{GUEST}/vmlinuz"\n'
                 f'initrd = "{GUEST}/initrd.gz"\n[[vm.vm{i}.nic]]\nnetwork = "out"\n')
    return text


def vmlaunch(*args: str, env: dict[str, str]) -> None:
    tool = Path(sys.executable).parent / "vmlaunch"
    argv = [str(tool)] if tool.exists() else [sys.executable, "-m", "vmlaunch"]
    subprocess.run([*argv, *args], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def qmp_status(path: str) -> str:
    """A bare QMP exchange: the least a caller of raw QEMU must do to know the VM runs."""
    while True:
        try:
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(path)
            break
        except OSError:
            conn.close()
            time.sleep(0.002)
    with conn, conn.makefile("rw") as stream:
        stream.readline()
        for command in ("qmp_capabilities", "query-status"):
            stream.write(json.dumps({"execute": command}) + "\n")
            stream.flush()
            while "return" not in (reply := json.loads(stream.readline())):
                pass
        return str(reply["return"]["status"])


def raw_qemu(argv: list[str], qmp: str, pidfile: Path) -> float:
    start = time.perf_counter()
    subprocess.run([*argv, "-daemonize"], check=True, stdout=subprocess.DEVNULL)
    assert qmp_status(qmp) == "running"
    elapsed = time.perf_counter() - start
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    return elapsed


def timed_up(spec: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    vmlaunch("up", str(spec), env=env)
    elapsed = time.perf_counter() - start
    vmlaunch("down", str(spec), "--timeout", "0", env=env)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    rounds = parser.parse_args().rounds
    work = Path(tempfile.mkdtemp(prefix="vl-bench-"))
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(work / "run"),
           "VMLAUNCH_CACHE_DIR": str(work / "cache")}
    try:
        one, ten = work / "one.toml", work / "ten.toml"
        one.write_text(spec_text("bench-one", 1))
        ten.write_text(spec_text("bench-ten", 10))
        done = subprocess.run([sys.executable, "-m", "vmlaunch", "cmdline", str(one), "--json"],
                              env=env, capture_output=True, text=True, check=True)
        argv = json.loads(done.stdout)["vm0"]
        raw_dir = work / "run" / "bench-one"  # the raw runs use the paths the argv names
        qmp, pidfile = str(raw_dir / "vm0.qmp"), raw_dir / "vm0.pid"
        samples: dict[str, list[float]] = {"raw qemu -daemonize": [], "vmlaunch up (1 VM)": [],
                                           "vmlaunch up (10 VMs)": []}
        timed_up(one, env)  # warm the host probe and the validation cache
        for _ in range(rounds):
            raw_dir.mkdir(parents=True, exist_ok=True)
            samples["raw qemu -daemonize"].append(raw_qemu(argv, qmp, pidfile))
            shutil.rmtree(raw_dir)
            samples["vmlaunch up (1 VM)"].append(timed_up(one, env))
            samples["vmlaunch up (10 VMs)"].append(timed_up(ten, env))
        median = {name: statistics.median(values) for name, values in samples.items()}
        for name, value in median.items():
            print(f"{name:<22} {value * 1000:8.1f} ms")
        print(f"up / raw QEMU: {median['vmlaunch up (1 VM)'] / median['raw qemu -daemonize']:.2f}x "
              "(target <= 2x)")
        print(f"10 VMs / 1 VM: {median['vmlaunch up (10 VMs)'] / median['vmlaunch up (1 VM)']:.2f}x "
              "(target <= 3x)")
    finally:
        subprocess.run(["pkill", "-9", "-f", str(work)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
