#!/usr/bin/env python3
"""`vmlaunch up` of a lab across two libvirt hosts against the same lab on one host, side by side.

The rig is the tests' (tools/libvirt_hosts.py): private libvirtds with an sshd each, reached over
`qemu+ssh://`, vmlaunch in the rig's client namespace. The lab: two test guests (examples/guest,
128M, TCG, direct kernel boot: their kernel and initrd uploaded to each host's pool) on one bridge
network with a subnet. Arms, alternated, the order swapped every repetition (`--repeat`):

- two hosts: a on h1, b on h2 (the network spans them: a VXLAN link on each);
- one host: a and b on h1.

Each `up` is timed as a user runs it (`python -m vmlaunch up SPEC`, wall time, Python's start-up
included) until it returns with both domains running; `down` between runs is not timed. Target (the
issue): the two-host `up` at most 1.5 times the one-host one: the hosts are worked on at once. The
table is printed; bench/results/hosts.json keeps every sample. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.libvirt_hosts import LibvirtHosts  # noqa: E402

GUEST = ROOT / "examples" / "guest"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/hosts.py needs root (the rig's namespaces)", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="vlbh-"))
    run_dir = Path(tempfile.mkdtemp(prefix="vlbr-", dir="/dev/shm"))
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_dir)}
    samples: dict[str, list[float]] = {"two hosts": [], "one host": []}
    try:
        with LibvirtHosts(work / "rig", count=2) as rig:
            placements: dict[str, dict[str, str | None]] = {"two hosts": {"a": "h1", "b": "h2"},
                                                             "one host": {"a": "h1", "b": "h1"}}
            specs = {arm: rig.guest_lab(work / f"lab{index}.toml", GUEST, vms, name=f"bh{index}")
                     for index, (arm, vms) in enumerate(placements.items())}

            def up_down(arm: str) -> float:
                start = time.monotonic()
                done = rig.run_client([sys.executable, "-m", "vmlaunch", "up", str(specs[arm])], env=env)
                took = time.monotonic() - start
                if done.returncode != 0:
                    raise SystemExit(f"{arm}: up failed: {done.stderr}")
                down = rig.run_client([sys.executable, "-m", "vmlaunch", "down", "--timeout", "0",
                                       str(specs[arm])], env=env)
                if down.returncode != 0:
                    raise SystemExit(f"{arm}: down failed: {down.stderr}")
                return took

            up_down("one host")  # warm-up (not counted): caches, the hosts' first QEMU probes
            for index in range(args.repeat):
                order = list(samples) if index % 2 == 0 else list(reversed(samples))
                for arm in order:
                    samples[arm].append(up_down(arm))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    two, one = (statistics.median(samples[arm]) for arm in ("two hosts", "one host"))
    lines = [f"`vmlaunch up` of two test guests (TCG, 128M, kernel and initrd uploaded), {args.repeat} "
             "runs each",
             f"{'arm':<10} {'median':>8} {'min':>8} {'max':>8}"]
    for arm, values in samples.items():
        median = statistics.median(values)
        lines.append(f"{arm:<10} {median:>7.2f}s {min(values):>7.2f}s {max(values):>7.2f}s")
    lines.append(f"two hosts / one host: {two / one:.2f} (target: at most 1.5)")
    print("\n".join(lines))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "hosts.json").write_text(json.dumps({"samples": samples, "ratio": two / one}, indent=1) + "\n")
    (results / "hosts.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
