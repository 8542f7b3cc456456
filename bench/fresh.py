#!/usr/bin/env python3
"""Throwaway VMs (`vmlaunch run`, `Lab.fresh`, `vmlaunch_fresh`) measured side by side in one run,
interleaved, medians, on the project's test guest under TCG:

- cold: `vmlaunch run --cold SPEC w -- true` against a raw QEMU command line booting the same kernel
  (the PVH ELF vmlaunch boots) and initramfs straight to the same command (`rdinit=/bin/busybox -- sh
  -c 'true; busybox poweroff -f'`), from start to exit. Target: <= 1.2x.
- warm: `vmlaunch run SPEC w -- true` from the VM's template. Target: <= 0.3x of cold, under 0.5 s.
- 20 tests: 20 fresh VMs one after the other through the API (`Lab.fresh`, what `vmlaunch_fresh`
  does per test), each running `true`, against 20 cold ones. Target: <= 0.2x.
- memory: 8 fresh VMs at once from one template against 8 cold ones; the sum of their QEMUs' PSS
  (a page of the template's RAM file mapped by 8 counts an eighth in each). Target: <= 0.5x.
- Debian (--debian, the image tools/build_debian.py makes): a command in a Debian VM from its template
  against its cold boot to SSH (`up --wait ssh`). Target: <= 0.1x, under 1 s.

    python bench/fresh.py [--rounds N] [--batch-rounds N] [--debian]
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
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GUEST = ROOT / "examples" / "guest"
DEBIAN = ROOT / "examples" / "debian"


def vmlaunch_argv() -> list[str]:
    tool = Path(sys.executable).parent / "vmlaunch"
    return [str(tool)] if tool.exists() else [sys.executable, "-m", "vmlaunch"]


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed


def raw_boot(kernel: Path, initrd: Path, memory: int, console: Path) -> float:
    """A raw QEMU booting straight to `true`, then powering off: from start to its exit."""
    # the kernel arguments the VM boots with (the spec's default, console=ttyS0), its console a file
    argv = ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-m", str(memory), "-nodefaults",
            "-display", "none", "-no-reboot", "-serial", f"file:{console}",
            "-kernel", str(kernel), "-initrd", str(initrd), "-append",
            'console=ttyS0 rdinit=/bin/busybox -- sh -c "true; /bin/busybox poweroff -f"']
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the raw QEMU failed: {done.stderr[-1000:]}")
    return elapsed


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def qemu_pids(root: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if b"qemu-system" in (proc / "cmdline").read_bytes() and str(root).encode() in \
                        (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of cold/warm/raw (default 5)")
    parser.add_argument("--batch-rounds", type=int, default=1,
                        help="rounds of the 20-test and the 8-at-once comparisons (default 1)")
    parser.add_argument("--debian", action="store_true", help="also the Debian image's comparison")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vl-fresh-"))
    run_root = work / "run"
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_root), "VMLAUNCH_CACHE_DIR": str(work / "cache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.update(VMLAUNCH_RUN_DIR=env["VMLAUNCH_RUN_DIR"], VMLAUNCH_CACHE_DIR=env["VMLAUNCH_CACHE_DIR"])
    spec = work / "lab.toml"
    spec.write_text(f'[lab]\nname = "fresh"\n[vm.w]\nmemory = 128\naccel = "tcg"\ntemplate = true\n'
                    f'kernel = "{GUEST}/vmlinuz"\ninitrd = "{GUEST}/initrd.gz"\n')
    tool = vmlaunch_argv()
    samples: dict[str, list[float]] = {}

    def sample(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    try:
        from vmlaunch.guests.kernels import boot_of

        timed([*tool, "run", str(spec), "w", "--", "true"], env)  # the template and the PVH ELF, once
        elf = boot_of(GUEST / "vmlinuz", build=True).elf or GUEST / "vmlinuz"
        print(f"the template is made; the raw QEMU boots {elf}")
        for _ in range(args.rounds):
            sample("raw QEMU to true", raw_boot(elf, GUEST / "initrd.gz", 128, work / "raw-console.log"))
            sample("run --cold", timed([*tool, "run", "--cold", str(spec), "w", "--", "true"], env))
            sample("run (template)", timed([*tool, "run", str(spec), "w", "--", "true"], env))
        median = {name: statistics.median(values) for name, values in samples.items()}
        for name, value in median.items():
            print(f"{name:<22} {value:7.3f} s  (median of {len(samples[name])})")
        cold, warm, raw = median["run --cold"], median["run (template)"], median["raw QEMU to true"]
        print(f"run --cold / raw QEMU: {cold / raw:.2f}x (target <= 1.2x)")
        print(f"run from template / run --cold: {warm / cold:.2f}x (target <= 0.3x), {warm:.3f} s "
              "(target < 0.5 s)")

        from vmlaunch.api import Lab

        lab = Lab(spec, ["w"])
        batch: dict[str, list[float]] = {}
        memory: dict[str, list[int]] = {}
        for _ in range(args.batch_rounds):
            for how, cold_ in (("fresh", False), ("cold", True)):
                start = time.perf_counter()
                for _test in range(20):
                    with lab.fresh("w", cold=cold_) as vm:
                        vm.succeed("true")
                batch.setdefault(how, []).append(time.perf_counter() - start)
                with ExitStack() as stack:
                    for _vm in range(8):
                        stack.enter_context(lab.fresh("w", cold=cold_)).succeed("true")
                    time.sleep(3)
                    memory.setdefault(how, []).append(sum(pss_kib(pid) for pid in qemu_pids(run_root)))
        fresh20, cold20 = statistics.median(batch["fresh"]), statistics.median(batch["cold"])
        print(f"20 tests, a fresh VM each: {fresh20:.1f} s from the template, {cold20:.1f} s cold: "
              f"{fresh20 / cold20:.2f}x (target <= 0.2x)")
        pss_fresh, pss_cold = statistics.median(memory["fresh"]), statistics.median(memory["cold"])
        print(f"8 at once, PSS of their QEMUs: {pss_fresh / 1024:.0f} MiB from one template, "
              f"{pss_cold / 1024:.0f} MiB cold: {pss_fresh / pss_cold:.2f}x (target <= 0.5x)")
        if args.debian:
            debian(work, env, tool)
    finally:
        subprocess.run(["pkill", "-9", "-f", str(work)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def debian(work: Path, env: dict[str, str], tool: list[str]) -> None:
    manifest = json.loads((DEBIAN / "bookworm.json").read_text())
    spec = work / "debian.toml"
    spec.write_text(f'[lab]\nname = "debfresh"\n[image.debian]\nfile = "{DEBIAN / "bookworm.qcow2"}"\n'
                    f'sha512 = "{manifest["sha512"]}"\n[network.out]\ntype = "user"\n[vm.d]\n'
                    'memory = "512M"\nimage = "debian"\ntemplate = true\n[vm.d.cloud_init]\nuser = "dev"\n'
                    '[[vm.d.nic]]\nnetwork = "out"\n')
    start = time.perf_counter()
    timed([*tool, "run", str(spec), "d", "--", "true"], env)
    print(f"Debian: the template made in {time.perf_counter() - start:.0f} s (once)")
    warm = [timed([*tool, "run", str(spec), "d", "--", "cat /etc/debian_version"], env) for _ in range(5)]
    boot = timed([*tool, "up", str(spec), "--wait", "ssh"], env)
    timed([*tool, "down", str(spec), "--timeout", "0"], env)
    print(f"Debian: a command from the template {statistics.median(warm):.2f} s (median of 5); its cold "
          f"boot to SSH {boot:.0f} s: {statistics.median(warm) / boot:.3f}x (target <= 0.1x, under 1 s)")


if __name__ == "__main__":
    sys.exit(main())
