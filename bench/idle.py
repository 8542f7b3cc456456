#!/usr/bin/env python3
"""What an idle lab costs the host, and how close a big lab boots to its CPU floor (issue 49), side by
side in one run, medians.

- Idle: N test guests booted by `vmlaunch up --wait-for VMLAUNCH-GUEST-READY` (128M, TCG, the lab
  manager running as `up` starts it) against N raw QEMUs of the same kernel (the PVH ELF vmlaunch boots)
  and initramfs (`-machine q35 -accel tcg -m 128 -nodefaults -display none`); the CPU time (utime +
  stime, /proc/PID/stat) of the QEMUs (and of the manager, counted on vmlaunch's side) over WINDOW
  seconds, SETTLE seconds after the last guest was ready. N = 1 and 20. Target: <= 1.5x raw.
- Boot: `up --wait-for` of 10 and 40 test guests against the CPU floor measured in the same run:
  N x one guest's `up --wait-for` alone / the host's cores. Targets: 40 within 1.3x, 10 within 1.2x,
  no panic.
- Both again for labs whose VMs have `balloon = { policy = "auto" }` (the manager has work each round).

Labs have no network (nothing of the host's is touched; no root needed). Rounds are interleaved.

    python bench/idle.py [--rounds N] [--idle 1,20] [--boot 10,40] [--window S] [--no-balloon]
                         [--guest DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
sys.path.insert(0, str(ROOT))
GUEST = ROOT / "examples" / "guest"
READY = "VMLAUNCH-GUEST-READY"
PANIC = "Kernel panic - not syncing"
SETTLE = 5.0
HZ = os.sysconf("SC_CLK_TCK")


def spec_text(name: str, count: int, guest: Path, *, auto: bool) -> str:
    balloon = 'balloon = { policy = "auto" }\n' if auto else ""
    text = f'[lab]\nname = "{name}"\n'
    for i in range(count):
        text += (f'[vm.v{i:02}]\nmemory = "128M"\naccel = "tcg"\nkernel = "{guest}/vmlinuz"\n'
                 f'initrd = "{guest}/initrd.gz"\nappend = "console=ttyS0"\n{balloon}')
    return text


def vmlaunch(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], env=env, capture_output=True,
                          text=True, check=check)


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def cpu_share(pids: list[int], window: float) -> float:
    """The CPU the processes take over `window` seconds, in % of one core."""
    before = sum(cpu_ticks(pid) for pid in pids)
    start = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - start
    return 100 * (sum(cpu_ticks(pid) for pid in pids) - before) / HZ / elapsed


class Bench:
    def __init__(self, work: Path, window: float, guest: Path) -> None:
        self.work = work
        self.guest = guest
        self.window = window
        self.run_root = work / "run"
        self.env = {**os.environ, "VMLAUNCH_RUN_DIR": str(self.run_root), "PYTHONPATH": str(ROOT)}

    def spec(self, count: int, auto: bool) -> Path:
        name = f"idle{count}{'a' if auto else ''}"
        path = self.work / f"{name}.toml"
        if not path.exists():
            path.write_text(spec_text(name, count, self.guest, auto=auto))
        return path

    def up(self, count: int, auto: bool) -> tuple[Path, float, int]:
        """`up --wait-for` of the lab: its spec, its wall time, the VMs whose console shows a panic."""
        spec = self.spec(count, auto)
        start = time.monotonic()
        done = vmlaunch(self.env, "up", str(spec), "--wait-for", READY, "--timeout", "900", check=False)
        elapsed = time.monotonic() - start
        run = self.run_root / spec.stem
        panics = sum(PANIC in _text(path) for path in run.glob("*.serial.log"))
        if done.returncode != 0:
            print(f"up of {spec.stem} failed: {done.stderr.strip()[-400:]}", file=sys.stderr)
        return spec, elapsed, panics

    def down(self, spec: Path) -> None:
        vmlaunch(self.env, "down", str(spec), "--timeout", "0", check=False)

    def idle_vmlaunch(self, count: int, auto: bool) -> tuple[float, float]:
        """% of a core: the lab's QEMUs, and its manager."""
        spec, _, _ = self.up(count, auto)
        run = self.run_root / spec.stem
        try:
            time.sleep(SETTLE)
            qemus = [int(path.read_text()) for path in run.glob("*.pid")]
            manager = json.loads(_text(run / "manager.state.json") or "{}").get("pid")
            ticks = {pid: cpu_ticks(pid) for pid in [*qemus, *([manager] if manager else [])]}
            start = time.monotonic()
            time.sleep(self.window)
            elapsed = time.monotonic() - start
            share = {pid: 100 * (cpu_ticks(pid) - before) / HZ / elapsed for pid, before in ticks.items()}
            return sum(share[pid] for pid in qemus), share.get(manager, 0.0) if manager else 0.0
        finally:
            self.down(spec)

    def idle_raw(self, count: int, elf: str) -> float:
        folder = self.work / f"raw{count}"
        folder.mkdir(exist_ok=True)
        procs = []
        try:
            for i in range(count):
                log = folder / f"{i}.serial.log"
                log.unlink(missing_ok=True)
                argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", "128", "-kernel", elf,
                        "-initrd", str(self.guest / "initrd.gz"), "-append", "console=ttyS0", "-nodefaults",
                        "-display", "none", "-serial", f"file:{log}"]
                procs.append((subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True), log))
            deadline = time.monotonic() + 900
            while not all(READY in _text(log) for _, log in procs):
                if time.monotonic() > deadline or any(proc.poll() is not None for proc, _ in procs):
                    raise RuntimeError("a raw QEMU did not boot")
                time.sleep(0.2)
            time.sleep(SETTLE)
            return cpu_share([proc.pid for proc, _ in procs], self.window)
        finally:
            for proc, _ in procs:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

    def elf(self) -> str:
        argv = json.loads(vmlaunch(self.env, "cmdline", str(self.spec(1, False)), "--json").stdout)
        args = next(iter(argv.values()))
        return str(args[args.index("-kernel") + 1])


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", default="1,20", help="lab sizes for the idle figures")
    parser.add_argument("--boot", default="10,40", help="lab sizes for the boot figures")
    parser.add_argument("--window", type=float, default=20.0, help="seconds the idle CPU is sampled over")
    parser.add_argument("--no-balloon", action="store_true", help="without the balloon-auto labs")
    parser.add_argument("--guest", type=Path, default=GUEST,
                        help="the test guest's folder (vmlinuz, initrd.gz): another build to compare")
    args = parser.parse_args()
    if not (args.guest / "vmlinuz").exists():
        print("bench/idle.py: no test guest: run `python3 tools/build_guest.py` first", file=sys.stderr)
        return 1
    idle_sizes = [int(n) for n in args.idle.split(",") if n]
    boot_sizes = [int(n) for n in args.boot.split(",") if n]
    autos = [False] if args.no_balloon else [False, True]
    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="vl-idle-"))
    bench = Bench(work, args.window, args.guest.resolve())
    samples: dict[str, list[float]] = {}

    def sample(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    try:
        elf = bench.elf()
        bench.down(bench.up(1, False)[0])  # warm: the host probe, the kernel's ELF, bytecode
        for _ in range(args.rounds):
            for count in idle_sizes:
                sample(f"idle raw x{count}", bench.idle_raw(count, elf))
                for auto in autos:
                    qemus, manager = bench.idle_vmlaunch(count, auto)
                    tag = " auto" if auto else ""
                    sample(f"idle vmlaunch{tag} x{count}", qemus + manager)
                    sample(f"  its manager{tag} x{count}", manager)
            for auto in autos if boot_sizes else []:
                tag = " auto" if auto else ""
                spec, one, _ = bench.up(1, auto)
                bench.down(spec)
                sample(f"boot one{tag}", one)
                for count in boot_sizes:
                    spec, took, panics = bench.up(count, auto)
                    bench.down(spec)
                    sample(f"boot x{count}{tag}", took)
                    sample(f"  panics x{count}{tag}", panics)
        median = {name: statistics.median(values) for name, values in samples.items()}
        print(f"host: {cores} cores; medians of {args.rounds} round(s); idle CPU over {args.window:g} s, "
              f"{SETTLE:g} s after the guests were ready (% of one core)")
        for name, value in median.items():
            unit = "%" if name.lstrip().startswith(("idle", "its")) else ("" if "panics" in name else "s")
            print(f"{name:<28} {value:8.2f} {unit}")
        for count in idle_sizes:
            raw = max(median[f"idle raw x{count}"], 100 / HZ / args.window)  # one tick: the resolution
            for auto in autos:
                tag = " auto" if auto else ""
                ratio = median[f"idle vmlaunch{tag} x{count}"] / raw
                print(f"idle{tag} x{count}: {ratio:.2f}x raw (target <= 1.5x)")
        for auto in autos:
            tag = " auto" if auto else ""
            for count in boot_sizes:
                floor = count * median[f"boot one{tag}"] / cores
                target = 1.3 if count >= 40 else 1.2
                print(f"boot{tag} x{count}: {median[f'boot x{count}{tag}']:.1f} s, floor {floor:.1f} s: "
                      f"{median[f'boot x{count}{tag}'] / floor:.2f}x (target <= {target}x)")
    finally:
        for spec in work.glob("*.toml"):
            if (bench.run_root / spec.stem).exists():
                bench.down(spec)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
