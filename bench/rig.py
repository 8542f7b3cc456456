#!/usr/bin/env python3
"""The command channel against SSH: `vmlaunch exec SPEC a -- true` and `vmlaunch ssh SPEC a -- true`
on the same running Debian guest (tools/build_debian.py's image, under TCG), side by side: interleaved
rounds, the order swapped every round, both measured in one run, each the whole command as a user
runs it (Python start-up and the spec's checks included). Target: exec in at most a fifth of the time
of ssh (ratio <= 0.20).

The lab (one VM with SSH) runs in a private network namespace and is taken down at the end; its boot
is not timed. Needs root (bridges and namespaces are not used, but the lab's run dir is /run's).
    python bench/rig.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "examples" / "debian" / "bookworm.qcow2"
NETNS = "vlbench-rig"


def spec_text() -> str:
    return (f'[lab]\nname = "benchrig"\n[lab.memory]\nksm = false\n[image.debian]\nfile = "{IMAGE}"\n'
            '[vm.a]\nmemory = "768M"\nimage = "debian"\nssh = true\n')


def vmlaunch_argv() -> list[str]:
    tool = Path(sys.executable).parent / "vmlaunch"
    return [str(tool)] if tool.exists() else [sys.executable, "-m", "vmlaunch"]


def in_netns(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", NETNS, *vmlaunch_argv(), *args], capture_output=True,
                          text=True, check=check, timeout=timeout)


def timed(*args: str) -> float:
    start = time.perf_counter()
    done = in_netns(*args, check=False, timeout=120)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"bench/rig.py: {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    args = parser.parse_args()
    if not IMAGE.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "build_debian.py")], check=True)
    with tempfile.TemporaryDirectory(prefix="vl-bench-rig-") as work:
        spec = Path(work) / "lab.toml"
        spec.write_text(spec_text())
        subprocess.run(["ip", "netns", "add", NETNS], check=True)
        try:
            subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"], check=True)
            print("booting the Debian guest (not timed) ...", flush=True)
            in_netns("up", str(spec), "--wait", "ssh", "--timeout", "600", timeout=700)
            ways = {name: (name, str(spec), "a", "--", "true") for name in ("exec", "ssh")}
            for argv in ways.values():
                timed(*argv)  # warm: the page cache, the guest's sshd and agent
            samples: dict[str, list[float]] = {name: [] for name in ways}
            for round_ in range(args.rounds):
                order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
                for name in order:
                    samples[name].append(timed(*ways[name]))
        finally:
            in_netns("down", str(spec), "--timeout", "30", check=False)
            subprocess.run(["ip", "netns", "delete", NETNS], check=False)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in samples.items():
        print(f"{name:5} median {medians[name] * 1000:7.0f} ms  (min {min(values) * 1000:.0f}, "
              f"max {max(values) * 1000:.0f}; {len(values)} runs)")
    ratio = medians["exec"] / medians["ssh"]
    print(f"ratio exec/ssh: {ratio:.2f} (target <= 0.20: {'met' if ratio <= 0.20 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
