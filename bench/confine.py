#!/usr/bin/env python3
"""`vmlaunch up` of a lab run as root with every QEMU confined (a uid of its own, a seccomp sandbox)
against the same `up` with confinement off (VMLAUNCH_CONFINE=off), measured side by side: rounds
interleaved, the order within a round alternating. Target: confined <= 1.1x unconfined.

The lab: two test guests (TCG, 128 MiB) on a bridge, in a private network namespace (its bridge and
taps never touch the host's network). `up` returns once both QEMUs run and answer QMP; `down` (not
timed) after each sample. Needs root.
    python bench/confine.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUEST = ROOT / "examples" / "guest"
TARGET = 1.1


def spec_text() -> str:
    text = '[lab]\nname = "bench-confine"\n[network.lan]\nbridge = "vlbr-bconf"\n'
    for vm in ("a", "b"):
        text += (f'[vm.{vm}]\nmemory = "128M"\naccel = "tcg"\nkernel = "{GUEST}/vmlinuz"\n'
                 f'initrd = "{GUEST}/initrd.gz"\n[[vm.{vm}.nic]]\nnetwork = "lan"\n')
    return text


def vmlaunch(netns: str, *args: str, env: dict[str, str]) -> None:
    subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-m", "vmlaunch", *args], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def timed_up(netns: str, spec: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    vmlaunch(netns, "up", str(spec), env=env)
    elapsed = time.perf_counter() - start
    vmlaunch(netns, "down", str(spec), "--timeout", "1", env=env)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/confine.py: needs root (a lab run as root is what it measures)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vl-bconf-"))
    netns = f"vlbench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(work / "run"), "VMLAUNCH_CACHE_DIR": str(work / "cache"),
           "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    ways = {"confined": {**env, "VMLAUNCH_CONFINE": "on"}, "unconfined": {**env, "VMLAUNCH_CONFINE": "off"}}
    spec = work / "lab.toml"
    spec.write_text(spec_text())
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"], check=True)
        for way_env in ways.values():
            timed_up(netns, spec, way_env)  # warm the host probe, the caches, the page cache
        samples: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(args.rounds):
            order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
            for way in order:
                samples[way].append(timed_up(netns, spec, ways[way]))
        median = {way: statistics.median(values) for way, values in samples.items()}
        for way, value in median.items():
            print(f"up, {way:<10} {value * 1000:8.1f} ms  (median of {len(samples[way])})")
        ratio = median["confined"] / median["unconfined"]
        print(f"confined / unconfined: {ratio:.2f}x (target <= {TARGET}x)")
    finally:
        subprocess.run(["pkill", "-9", "-f", str(work)], check=False)
        subprocess.run(["ip", "netns", "del", netns], check=False)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
