#!/usr/bin/env python3
"""Fast direct boot under TCG: `vmlaunch up --wait-for VMLAUNCH-GUEST-READY` of one test guest booted
from its decompressed ELF (through PVH) against the same guest with `fast_boot = false` (its XZ bzImage,
decompressed by the guest at every boot), side by side (interleaved, the order swapped every round) in
one run. Target: the fast one in at most 0.5x the time.

The first `up` of the fast lab decompresses the kernel into the bench's own cache (printed, not counted
in the medians; an `up` of the other lab before it makes the host probe); every VM runs under TCG with
256 MiB and is taken down after each sample (not timed).
    python bench/fastboot.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUEST = ROOT / "examples" / "guest"
READY = "VMLAUNCH-GUEST-READY"


def spec_text(name: str, fast: bool) -> str:
    return (f'[lab]\nname = "{name}"\n[vm.solo]\nmemory = "256M"\naccel = "tcg"\n'
            f'kernel = "{GUEST}/vmlinuz"\ninitrd = "{GUEST}/initrd.gz"\nfast_boot = {str(fast).lower()}\n')


def vmlaunch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    tool = Path(sys.executable).parent / "vmlaunch"
    argv = [str(tool)] if tool.exists() else [sys.executable, "-m", "vmlaunch"]
    return subprocess.run([*argv, *args], env=env, check=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def timed_up(spec: Path, env: dict[str, str]) -> tuple[float, str]:
    """Seconds of `up --wait-for READY`, and what it said; the lab is taken down after (not timed)."""
    start = time.perf_counter()
    done = vmlaunch("up", str(spec), "--wait-for", READY, "--timeout", "120", env=env)
    elapsed = time.perf_counter() - start
    vmlaunch("down", str(spec), "--timeout", "0", env=env)
    return elapsed, done.stderr


def leftovers(work: Path) -> list[int]:
    """Processes whose command line names the bench's folder (a QEMU a failed down left)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if str(work).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (GUEST / "vmlinuz").is_file():
        raise SystemExit(f"{GUEST} has no test guest: make setup")
    work = Path(tempfile.mkdtemp(prefix="vl-fastboot-"))
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(work / "run"), "VMLAUNCH_CACHE_DIR": str(work / "cache"),
           "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # what a user gets: Python reusing its bytecode cache
    labs = {"ELF through PVH": work / "fast.toml", "bzImage": work / "slow.toml"}
    try:
        for (label, spec), name in zip(labs.items(), ("bench-fast", "bench-slow")):
            spec.write_text(spec_text(name, label != "bzImage"))
        timed_up(labs["bzImage"], env)  # the host probe, Python's bytecode: made before anything is timed
        first, said = timed_up(labs["ELF through PVH"], env)
        if "boots through its PVH entry" not in said:
            raise SystemExit(f"the fast lab does not boot through PVH:\n{said}")
        print(f"first up of the fast lab (decompressing the kernel once): {first:.2f} s")
        samples: dict[str, list[float]] = {label: [] for label in labs}
        for round_ in range(args.rounds):
            order = list(labs) if round_ % 2 == 0 else list(reversed(labs))
            for label in order:
                samples[label].append(timed_up(labs[label], env)[0])
        median = {label: statistics.median(values) for label, values in samples.items()}
        for label, values in samples.items():
            shown = ", ".join(f"{value:.2f}" for value in values)
            print(f"up --wait-for {READY}, {label:<15} {median[label]:6.2f} s  (median of {len(values)}: "
                  f"{shown})")
        ratio = median["ELF through PVH"] / median["bzImage"]
        print(f"ELF / bzImage: {ratio:.2f}x (target <= 0.5x)")
    finally:
        for pid in leftovers(work):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
