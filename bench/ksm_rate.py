#!/usr/bin/env python3
"""How fast KSM merges idle guests, and what ksmd costs, at several scan rates side by side in one run.

For each rate (`--rates`), two identical idle test guests (`--memory`, 256M each; TCG) boot with KSM
off; once both are ready, KSM is turned on at that rate and, every 5 s for `--watch` seconds, the bench
reads pages_sharing (the memory merging saves) and the CPU time ksmd has used. It prints, per rate:
the time until 50 % and 90 % of the final saving was reached, the saving after `--watch` seconds, and
ksmd's mean CPU use (% of one CPU) over that time.

The rates: the KVM guide's `ksmctl start 440 5000` (guide), the kernel's default rate (100 pages every
20 ms), a fixed 1000 pages every 20 ms, the kernel's advisor (Linux 6.7+) with its own defaults
(advisor-default: a pass in 200 s, ksmd at most 70 % of a CPU) or a 20 s pass at most 25 % (advisor-20s),
and vmlaunch's rate for the two guests (resources/ksm.py: a pass over their memory every 10 s). The
host's KSM settings are put back as they were whatever happens. Needs root.

    python bench/ksm_rate.py [--rates guide,vmlaunch,...] [--memory MiB] [--watch S]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vmlaunch.host.memory import ksmd_cpu_seconds  # noqa: E402
from vmlaunch.resources.ksm import SETTINGS, default_settings, read  # noqa: E402

ADVISOR = ("advisor_mode", "advisor_target_scan_time", "advisor_max_cpu")  # beside SETTINGS

GUEST = ROOT / "examples" / "guest"
KSM = Path("/sys/kernel/mm/ksm")
READY = "VMLAUNCH-GUEST-READY"
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20

RATES: dict[str, dict[str, str]] = {
    "guide": {"advisor_mode": "none", "pages_to_scan": "440", "sleep_millisecs": "5000"},
    "kernel-default": {"advisor_mode": "none", "pages_to_scan": "100", "sleep_millisecs": "20"},
    "fixed-1000": {"advisor_mode": "none", "pages_to_scan": "1000", "sleep_millisecs": "20"},
    "advisor-default": {"advisor_mode": "scan-time", "advisor_target_scan_time": "200",
                        "advisor_max_cpu": "70", "sleep_millisecs": "20"},
    "advisor-20s": {"advisor_mode": "scan-time", "advisor_target_scan_time": "20",
                    "advisor_max_cpu": "25", "sleep_millisecs": "20"},
    # "vmlaunch": vmlaunch's rate for the two guests, set in main()
}


@contextlib.contextmanager
def ksm_kept() -> Iterator[None]:
    saved = {name: read(KSM, name) for name in (*ADVISOR, *SETTINGS) if (KSM / name).exists()}
    try:
        yield
    finally:
        write_settings({**saved, "run": "0"})
        write_settings(saved)


def write_settings(settings: dict[str, str]) -> None:
    """In the order the kernel accepts (the advisor's mode first, `run` last)."""
    for name in (*ADVISOR, *SETTINGS):
        if name in settings and (KSM / name).exists():
            with contextlib.suppress(OSError):  # pages_to_scan while the advisor runs: EINVAL
                (KSM / name).write_text(settings[name] + "\n")


def sharing() -> int:
    return int((KSM / "pages_sharing").read_text()) * PAGE


def boot(count: int, memory_mib: int, work: Path) -> list[subprocess.Popen[bytes]]:
    qemu = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
    procs = []
    for index in range(count):
        log = work / f"g{index}.log"
        argv = [qemu, "-m", str(memory_mib), "-accel", "tcg", "-kernel", str(GUEST / "vmlinuz"),
                "-initrd", str(GUEST / "initrd.gz"), "-append", "console=ttyS0", "-display", "none",
                "-nodefaults", "-serial", f"file:{log}"]
        procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    def ready(index: int) -> bool:
        log = work / f"g{index}.log"
        return log.exists() and READY in log.read_text(errors="replace")

    deadline = time.monotonic() + 180
    while not all(ready(index) for index in range(count)):
        if time.monotonic() > deadline:
            raise SystemExit("the guests did not boot within 180 s")
        time.sleep(0.5)
    return procs


def measure(name: str, memory_mib: int, watch: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="vl-ksm-") as work:
        write_settings({"run": "2"})  # unmerge what an earlier rate merged
        write_settings({"run": "0", "advisor_mode": "none", "pages_to_scan": "100",
                        "sleep_millisecs": "20"})
        procs = boot(2, memory_mib, Path(work))
        try:
            time.sleep(5)  # past the boot's last writes
            base, cpu_before = sharing(), ksmd_cpu_seconds() or 0.0
            write_settings({**RATES[name], "run": "1"})
            started = time.monotonic()
            trace = []
            while time.monotonic() - started < watch:
                time.sleep(5)
                trace.append((time.monotonic() - started, sharing() - base))
                print(f"  {name:<16} {trace[-1][0]:5.0f} s: {trace[-1][1] / MIB:6.1f} MiB merged", flush=True)
            cpu = ((ksmd_cpu_seconds() or 0.0) - cpu_before) / (time.monotonic() - started) * 100
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            write_settings({"run": "0"})
    final = trace[-1][1]

    def reached(share: float) -> float:
        return next((t for t, saved in trace if final > 0 and saved >= share * final), float("nan"))

    return {"t50": reached(0.5), "t90": reached(0.9), "saved_mib": final / MIB, "cpu": cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="guide,kernel-default,fixed-1000,advisor-default,advisor-20s,"
                        "vmlaunch")
    parser.add_argument("--memory", type=int, default=256, help="MiB per guest")
    parser.add_argument("--watch", type=float, default=120.0, help="seconds to watch each rate")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (KSM / "run").exists():
        print("ksm_rate.py needs root and a kernel with KSM", file=sys.stderr)
        return 3
    RATES["vmlaunch"] = default_settings(False, 2 * args.memory)
    names = args.rates.split(",")
    advisor = (KSM / "advisor_mode").exists()
    unknown = [name for name in names
               if name not in RATES or (RATES[name].get("advisor_mode") == "scan-time" and not advisor)]
    if unknown:
        print(f"unknown rates, or no advisor in this kernel: {', '.join(unknown)}", file=sys.stderr)
        return 64
    subprocess.run([sys.executable, str(ROOT / "tools" / "build_guest.py")], check=True,
                   stdout=subprocess.DEVNULL)
    results = {}
    with ksm_kept():
        for name in names:
            print(f"{name}: {RATES[name]}", flush=True)
            results[name] = measure(name, args.memory, args.watch)
    print(f"\ntwo idle test guests of {args.memory} MiB (TCG), KSM watched for {args.watch:g} s:")
    print(f"{'rate':<16}{'50 % merged':>12}{'90 % merged':>12}{'saved':>10}{'ksmd CPU':>10}")
    for name, result in results.items():
        print(f"{name:<16}{result['t50']:>10.0f} s{result['t90']:>10.0f} s{result['saved_mib']:>6.0f} MiB"
              f"{result['cpu']:>9.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
