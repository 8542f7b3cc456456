#!/usr/bin/env python3
"""`vmlaunch up` against raw QEMU, measured side by side (interleaved) in one run on the same guest.

- one VM: `vmlaunch up` of a one-VM user-network lab until the VM runs and answers QMP, against
  `qemu-system-x86_64` of the same argv started in the background, then a QMP query-status (not
  -daemonize: vmlaunch's argv has a seccomp sandbox that forbids its fork). Target: <= 2.0x.
- ten VMs: `vmlaunch up` of a ten-VM lab against ten raw QEMUs started the smartest way a script can:
  all paused (-S) in parallel, then `cont` to each once all answer. Target: <= 1.5x.
- fifty VMs (96M guests: the test guest's kernel needs 81 MiB to unpack): the same, printed; `down`
  must leave nothing (checked).

Guests run under TCG with 96 MiB and are torn down after each sample (not timed). The CPU time of
`up`'s own process is printed beside its wall time ("its CPU"): steadier when others share the host.
    python bench/up.py [--rounds N] [--big-rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
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
sys.path.insert(0, str(ROOT))
GUEST = ROOT / "examples" / "guest"

from vmlaunch.layout.rundir import RunDir  # noqa: E402


def spec_text(name: str, count: int) -> str:
    text = f'[lab]\nname = "{name}"\n[network.out]\ntype = "user"\n'
    for i in range(count):
        text += (f'[vm.vm{i}]\nmemory = 96\naccel = "tcg"\nkernel = "{GUEST}/vmlinuz"\n'
                 f'initrd = "{GUEST}/initrd.gz"\n[[vm.vm{i}.nic]]\nnetwork = "out"\n')
    return text


def vmlaunch(*args: str, env: dict[str, str]) -> None:
    tool = Path(sys.executable).parent / "vmlaunch"
    argv = [str(tool)] if tool.exists() else [sys.executable, "-m", "vmlaunch"]
    subprocess.run([*argv, *args], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


class Qmp:
    """A bare QMP exchange: the least a caller of raw QEMU must do."""

    def __init__(self, path: str) -> None:
        while True:
            self.conn = socket.socket(socket.AF_UNIX)
            try:
                self.conn.connect(path)
                break
            except OSError:
                self.conn.close()
                time.sleep(0.002)
        self.stream = self.conn.makefile("rw")
        self.stream.readline()
        self.cmd("qmp_capabilities")

    def cmd(self, command: str) -> object:
        self.stream.write(json.dumps({"execute": command}) + "\n")
        self.stream.flush()
        while "return" not in (reply := json.loads(self.stream.readline())):
            pass
        return reply["return"]

    def close(self) -> None:
        self.stream.close()
        self.conn.close()


def raw_qemus(argvs: list[list[str]], run_dir: RunDir, names: list[str]) -> float:
    """Start QEMUs the way a careful script would; the time until every one runs."""
    run_dir.path.mkdir(parents=True, exist_ok=True)
    paused = len(argvs) > 1
    start = time.perf_counter()
    for argv in argvs:
        subprocess.Popen([*argv, *(["-S"] if paused else [])], stdout=subprocess.DEVNULL,
                         start_new_session=True)
    clients = [Qmp(str(run_dir.vm(name).qmp)) for name in names]  # answered once it has started
    if paused:
        for qmp in clients:
            qmp.cmd("cont")
    for qmp in clients:
        assert qmp.cmd("query-status") == {"status": "running", "singlestep": False, "running": True}
        qmp.close()
    elapsed = time.perf_counter() - start
    for name in names:
        os.kill(int(run_dir.vm(name).pidfile.read_text()), signal.SIGKILL)
    shutil.rmtree(run_dir.path)
    return elapsed


def timed_up(spec: Path, env: dict[str, str]) -> tuple[float, float]:
    """The wall time of `up`, and the CPU time its own process took (steadier on a busy host)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    vmlaunch("up", str(spec), env=env)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    vmlaunch("down", str(spec), "--timeout", "0", env=env)
    return elapsed, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def leftovers(work: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(work).encode() in (proc / "cmdline").read_bytes():
                    found.append(proc.name)
            except OSError:
                pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--big-rounds", type=int, default=2, help="rounds of the 50-VM lab")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vl-bench-"))
    run_root = work / "run"
    env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_root), "VMLAUNCH_CACHE_DIR": str(work / "cache")}
    # Measure what a user gets: Python writing and reusing its bytecode cache (some shells turn it off).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        labs = {count: work / f"lab{count}.toml" for count in (1, 10, 50)}
        argvs = {}
        for count, spec in labs.items():
            if count == 50 and not args.big_rounds:
                continue
            spec.write_text(spec_text(f"bench-{count}", count))
            done = subprocess.run([sys.executable, "-m", "vmlaunch", "cmdline", str(spec), "--json"],
                                  env=env, capture_output=True, text=True, check=True)
            argvs[count] = json.loads(done.stdout)
            timed_up(spec, env)  # warm the host probe and the caches
        samples: dict[str, list[float]] = {}

        def sample(name: str, value: float) -> None:
            samples.setdefault(name, []).append(value)

        for round_ in range(args.rounds):
            for count in (1, 10):
                names = list(argvs[count])
                run_dir = RunDir.of(run_root, f"bench-{count}")
                sample(f"raw QEMU x{count}", raw_qemus(list(argvs[count].values()), run_dir, names))
                wall, cpu = timed_up(labs[count], env)
                sample(f"vmlaunch up x{count}", wall)
                sample(f"  its CPU x{count}", cpu)
            if round_ < args.big_rounds:
                names = list(argvs[50])
                sample("raw QEMU x50", raw_qemus(list(argvs[50].values()), RunDir.of(run_root, "bench-50"),
                                                 names))
                sample("vmlaunch up x50", timed_up(labs[50], env)[0])
                assert not leftovers(work), "a QEMU of the 50-VM lab survived its down"
                assert not (run_root / "bench-50").exists()
        median = {name: statistics.median(values) for name, values in samples.items()}
        for name, value in median.items():
            print(f"{name:<20} {value * 1000:8.1f} ms  (median of {len(samples[name])})")
        for count, target in ((1, 2.0), (10, 1.5), (50, None)):
            if f"raw QEMU x{count}" not in median:
                continue
            ratio = median[f"vmlaunch up x{count}"] / median[f"raw QEMU x{count}"]
            goal = f" (target <= {target}x)" if target else ""
            print(f"up / raw, {count:>2} VM{'s' if count > 1 else ' '}: {ratio:.2f}x{goal}")
    finally:
        for pid in leftovers(work):  # what an interrupted run left: each by its pid
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
