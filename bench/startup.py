#!/usr/bin/env python3
"""Start-up cost of `vmlaunch validate` and `vmlaunch cmdline` on a one-VM spec, against the bare
interpreter (`python -c pass`), measured interleaved in one run. Target: within 2.5x.

"floor" imports only the dependencies the model and parser need (attrs, tomllib, argparse).
"warm" is the common case: the host facts are cached and the spec validated clean before (so the
JSON schema check is skipped). "cold validate" gives every run a fresh cache dir: jsonschema is
imported and the whole schema checked.

    python bench/startup.py [--rounds N]
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
from collections.abc import Callable
from pathlib import Path

SPEC = """\
[lab]
name = "bench"

[network.out]
type = "user"

[vm.solo]
memory = "256M"
kernel = "vmlinuz"

[[vm.solo.disk]]
file = "solo.img"
size = "1G"

[[vm.solo.nic]]
network = "out"
"""


def vmlaunch_argv() -> list[str]:
    script = Path(sys.executable).parent / "vmlaunch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vmlaunch"]


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    rounds = parser.parse_args().rounds
    work = Path(tempfile.mkdtemp(prefix="vmlaunch-bench-"))
    try:
        spec = work / "lab.toml"
        spec.write_text(SPEC)
        (work / "vmlinuz").write_bytes(b"a kernel")  # validate checks the files a spec names
        env = {**os.environ, "VMLAUNCH_CACHE_DIR": str(work / "cache")}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # what a user gets: the bytecode cache in use
        tool = vmlaunch_argv()
        cases: dict[str, tuple[list[str], Callable[[int], dict[str, str]]]] = {
            "python -c pass": ([sys.executable, "-c", "pass"], lambda i: env),
            # What the issue's own dependencies cost before vmlaunch runs a line (attrs alone is
            # most of it): the floor under the two cases below.
            "floor: import deps": ([sys.executable, "-c", "import attrs, tomllib, argparse, enum"],
                                   lambda i: env),
            "validate (warm)": ([*tool, "validate", str(spec)], lambda i: env),
            "cmdline (warm)": ([*tool, "cmdline", str(spec)], lambda i: env),
            "validate (cold)": ([*tool, "validate", str(spec)],
                                lambda i: {**env, "VMLAUNCH_CACHE_DIR": str(work / f"cold{i}")}),
        }
        for argv, env_of in cases.values():  # warm the caches and the OS's file cache
            timed(argv, env_of(-1))
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for i in range(rounds):  # interleaved, so drift in machine load hits every case alike
            for name, (argv, env_of) in cases.items():
                samples[name].append(timed(argv, env_of(i)))
        base = statistics.median(samples["python -c pass"])
        print(f"{'case':<18} {'median ms':>10} {'ratio':>7}   (target: warm <= 2.5x)")
        for name, values in samples.items():
            median = statistics.median(values)
            print(f"{name:<18} {median * 1000:>10.1f} {median / base:>6.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
