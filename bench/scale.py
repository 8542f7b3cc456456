#!/usr/bin/env python3
"""Labs bigger than the host: `up`, `status` and `down` of N test guests, with boot admission and the
fast TCG boot off (the way `up` booted before: every VM continued at once, each decompressing its
kernel itself) and on (the defaults), measured side by side in one run.

Each lab: N copies of the test guest (128M, TCG), one bridge, `up --wait-for VMLAUNCH-GUEST-READY`,
run in a private network namespace (the host's network is never touched; root). A round is
counted a success when `up` exits 0; the VMs whose console shows a kernel panic are counted.
Targets (issue 28): 40 guests on 2 cores succeed in every round with no panic, at no more than 2.0 s
per VM; one guest in at most 0.5x the old time.

    sudo python bench/scale.py [--sizes 1,5,10,20,40] [--rounds N] [--timeout S] [--ways old,new]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GUEST = ROOT / "examples" / "guest"
READY = "VMLAUNCH-GUEST-READY"
PANIC = "Kernel panic - not syncing"


def spec_text(name: str, count: int, *, new: bool) -> str:
    fast = "" if new else "fast_boot = false\n"
    text = f'[lab]\nname = "{name}"\n[network.lan]\nbridge = "vlbr-{name}"\n'
    for i in range(count):
        text += (f'[vm.v{i:02}]\nmemory = "128M"\naccel = "tcg"\nkernel = "{GUEST}/vmlinuz"\n'
                 f'initrd = "{GUEST}/initrd.gz"\nappend = "console=ttyS0"\n{fast}'
                 f'[[vm.v{i:02}.nic]]\nnetwork = "lan"\n')
    return text


def one_round(count: int, new: bool, timeout: float, folder: Path) -> dict[str, float | int]:
    """up, status and down of one lab, in one network namespace (one shell, so the bridge lives on)."""
    name = f"s{count}{'n' if new else 'o'}"
    spec = folder / f"{name}.toml"
    spec.write_text(spec_text(name, count, new=new))
    run = folder / f"run-{name}"
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run), "PYTHONPATH": str(ROOT)}
    up = ["up", str(spec), "--wait-for", READY, "--timeout", str(timeout)]
    if not new:
        up += ["--parallel", str(count)]  # every VM continued at once, as before admission
    script = (
        "import json, subprocess, sys, time\n"
        "def run(args):\n"
        "    t = time.monotonic()\n"
        "    done = subprocess.run([sys.executable, '-m', 'vmlaunch', *args], capture_output=True,\n"
        "                          text=True)\n"
        "    return done.returncode, time.monotonic() - t, done.stderr\n"
        f"up = run({up!r})\n"
        f"status = run(['status', {str(spec)!r}])\n"
        f"down = run(['down', {str(spec)!r}, '--timeout', '0'])\n"
        "print(json.dumps({'up': up, 'status': status, 'down': down}))\n"
    )
    argv = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
            sys.executable, "-c", script]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout * 3 + 300,
                          check=False)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    up_code, up_time, up_err = result["up"]
    # every VM whose console shows a panic: from the logs `down` (or the failed `up`) kept
    panicked = sum(PANIC in kept(name, f"v{i:02}") for i in range(count)) or up_err.count("panicked")
    shutil.rmtree(run, ignore_errors=True)
    return {"ok": int(up_code == 0), "up": up_time, "status": result["status"][1],
            "down": result["down"][1], "panicked": panicked}


def kept(lab: str, vm: str) -> str:
    from vmlaunch.layout.lastrun import path_of

    try:
        return path_of(lab, vm, "serial").read_text(errors="replace")
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,5,10,20,40")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--ways", default="old,new", help="old, new or both (the default)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/scale.py: needs root (a bridge, in a private network namespace)", file=sys.stderr)
        return 1
    if not (GUEST / "vmlinuz").exists():
        print("bench/scale.py: no test guest: run `make setup` first", file=sys.stderr)
        return 1
    sizes = [int(size) for size in args.sizes.split(",")]
    ways = [way == "new" for way in args.ways.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="vl-scale-"))
    print(f"{'VMs':>4} {'way':<4} {'ok':>5} {'panics':>6} {'up s':>7} {'s/VM':>6} {'status s':>8} "
          f"{'down s':>7}")
    try:
        for count in sizes:
            rows: dict[bool, list[dict[str, float | int]]] = {False: [], True: []}
            for _ in range(args.rounds):
                for new in ways:  # interleaved: the host's state drifts alike for both
                    rows[new].append(one_round(count, new, args.timeout, folder))
            for new in ways:
                got = rows[new]
                up = statistics.median(float(r["up"]) for r in got)
                print(f"{count:>4} {'new' if new else 'old':<4} {sum(int(r['ok']) for r in got):>2}/"
                      f"{len(got):<2} {sum(int(r['panicked']) for r in got):>6} {up:>7.1f} "
                      f"{up / count:>6.2f} {statistics.median(float(r['status']) for r in got):>8.2f} "
                      f"{statistics.median(float(r['down']) for r in got):>7.2f}")
            if len(ways) == 2:
                old = statistics.median(float(r["up"]) for r in rows[False])
                new_up = statistics.median(float(r["up"]) for r in rows[True])
                print(f"{count:>4} up new/old: {new_up / old:.2f}x")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
