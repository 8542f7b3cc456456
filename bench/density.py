#!/usr/bin/env python3
"""How many idle guests a host holds: vmlaunch's memory defaults against the plain QEMU line, side by
side in one run on the same guests.

N identical test guests (`--guests`, 8; `--memory`, 512M each; TCG) are started twice, one arm after
the other:

- plain: `qemu-system-x86_64 -m 512 -accel tcg -kernel ... -initrd ... -append console=ttyS0
  -display none` and a serial socket for the bench to read the console: the line a user would type.
  The host's KSM is off (its default) for this arm.
- vmlaunch: a lab of the same guests with vmlaunch's memory defaults: KSM on (its default as root for
  several VMs, at vmlaunch's scan rate), free page reporting (on by default), and
  `balloon.policy = "auto"` with the default budget (80 % of the host) and minimum (a quarter of
  each guest): the manager gives back what an idle guest does not use.

Each arm: every guest boots to its ready line, then the guests idle for `--settle` seconds (long
enough for KSM to merge what they share: the progress lines show it level off), and the memory the
host spends on them is read: the sum of each QEMU's PSS (`/proc/PID/smaps_rollup`; PSS divides a page
shared by k processes, KSM's merged pages too, by k, so the sum counts each page once), plus, for
vmlaunch, the lab manager's PSS. The KSM counters give the memory merged pages save (pages_sharing).
Then throughput: in every guest at once, a loop that reads a 64 MiB file of random bytes held in the
guest's RAM (its root is a RAM file system) for `--loop` seconds, counting passes; the ratio of the
mean passes per second says whether KSM's scanning and the balloon cost the guests anything.

Goals (issue 10): vmlaunch's memory at most 0.5 of the plain arm's; its throughput no more than 10 %
below. The table also gives both arms' TCG translation caches (QEMU's code buffer, a fixed cost per
guest under TCG that a KVM host does not have) and the ratio without them.
The table is printed; `bench/results/density.json` keeps the numbers and `bench/results/density.png`
(matplotlib, `pip install '.[bench]'`) draws them for the manual. Needs root (KSM). The host's KSM
settings are put back as they were whatever happens.

    python bench/density.py [--guests N] [--memory MiB] [--settle S] [--loop S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GUEST = ROOT / "examples" / "guest"
RESULTS = ROOT / "bench" / "results"
KSM = Path("/sys/kernel/mm/ksm")
READY = "VMLAUNCH-GUEST-READY"
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20

# Typed into each guest's console shell. The count is printed as BENCH-LOOPS=N: the echo of the
# command line itself shows "=$n", never a number.
LOOP = ("head -c 67108864 /dev/urandom > /tmp/blob; n=0; end=$(( $(date +%s) + {seconds} )); "
        "while [ $(date +%s) -lt $end ]; do cat /tmp/blob > /dev/null; n=$((n+1)); done; "
        "rm -f /tmp/blob; echo BENCH-LOOPS=$n")
COUNT = re.compile(r"BENCH-LOOPS=(\d+)")


def log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------- the host

@contextlib.contextmanager
def ksm_kept() -> Iterator[dict[str, str]]:
    """The host's KSM settings, put back as they were on the way out."""
    saved = {}
    for path in sorted(KSM.iterdir()):
        if path.stat().st_mode & 0o200:
            text = path.read_text().strip()
            if "[" in text:  # a choice: "[none] scan-time"
                text = text.split("[")[1].split("]")[0]
            saved[path.name] = text
    try:
        yield saved
    finally:
        # run first to 0 so the others can be written, run last back to what it was
        for name, value in sorted(saved.items(), key=lambda item: item[0] == "run"):
            with contextlib.suppress(OSError):
                (KSM / name).write_text(value)


def ksmd_seconds() -> float:
    """CPU time ksmd (KSM's kernel thread) has used."""
    from vmlaunch.host.memory import ksmd_cpu_seconds

    return ksmd_cpu_seconds() or 0.0


def ksm() -> dict[str, int]:
    return {name: int((KSM / name).read_text()) for name in ("run", "pages_shared", "pages_sharing")}


def tcg_cache(pid: int) -> int:
    """PSS of TCG's translation cache in bytes: the process's one anonymous rwx mapping."""
    found, pss = False, 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's first line
            found = fields[1] == "rwxp" and len(fields) == 5
        elif found and line.startswith("Pss:"):
            pss += int(fields[1]) << 10
    return pss


def smaps(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of a process in bytes."""
    pss = rss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            pss = int(line.split()[1]) << 10
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) << 10
    return pss, rss


# ------------------------------------------------------------------------------------------ guests

class Arm:
    """N guests started one way; `pids`, `serial_logs` and `consoles` once `start` returns."""

    name = ""

    def __init__(self, count: int, memory_mib: int, work: Path) -> None:
        self.count, self.memory_mib, self.work = count, memory_mib, work
        self.pids: dict[str, int] = {}
        self.serial_logs: dict[str, Path] = {}
        self.consoles: dict[str, Path] = {}
        self.extra_pids: list[int] = []  # what else the arm runs for the guests (the lab manager)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def vms(self) -> list[str]:
        return [f"g{i}" for i in range(self.count)]


class Plain(Arm):
    name = "plain QEMU"

    def __init__(self, count: int, memory_mib: int, work: Path) -> None:
        super().__init__(count, memory_mib, work)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        qemu = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
        for vm in self.vms():
            sock, serial = self.work / f"{vm}.sock", self.work / f"{vm}.log"
            argv = [qemu, "-m", str(self.memory_mib), "-accel", "tcg", "-kernel", str(GUEST / "vmlinuz"),
                    "-initrd", str(GUEST / "initrd.gz"), "-append", "console=ttyS0", "-display", "none",
                    "-chardev", f"socket,id=s,path={sock},server=on,wait=off,logfile={serial}",
                    "-serial", "chardev:s"]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            self.procs.append(proc)
            self.pids[vm], self.serial_logs[vm], self.consoles[vm] = proc.pid, serial, sock

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


class Vmlaunch(Arm):
    name = "vmlaunch"

    def __init__(self, count: int, memory_mib: int, work: Path) -> None:
        super().__init__(count, memory_mib, work)
        self.spec = work / "density.toml"
        self.env = {**os.environ, "VMLAUNCH_RUN_DIR": str(work / "run")}
        self.up = False

    def cli(self, *args: str) -> None:
        tool = Path(sys.executable).parent / "vmlaunch"
        argv = [str(tool)] if tool.exists() else [sys.executable, "-m", "vmlaunch"]
        subprocess.run([*argv, *args], env=self.env, check=True, stdout=subprocess.DEVNULL)

    def start(self) -> None:
        from vmlaunch.lab.journal import Journal
        from vmlaunch.layout.rundir import RunDir

        text = '[lab]\nname = "density"\n'  # KSM: on by default (root, several VMs)
        for vm in self.vms():
            text += (f'[vm.{vm}]\nmemory = {self.memory_mib}\naccel = "tcg"\nkernel = "{GUEST}/vmlinuz"\n'
                     f'initrd = "{GUEST}/initrd.gz"\n[vm.{vm}.balloon]\npolicy = "auto"\n')
        self.spec.write_text(text)
        self.up = True
        self.cli("up", str(self.spec))
        run_dir = RunDir(self.work / "run" / "density")
        journal = Journal.load(run_dir)
        for vm in self.vms():
            pid = journal.vms[vm].pid
            assert pid is not None
            files = run_dir.vm(vm)
            self.pids[vm], self.serial_logs[vm], self.consoles[vm] = pid, files.serial_log, files.console
        manager = journal.entry("manager", "lab")
        if manager is not None:
            self.extra_pids.append(manager.record.pid)  # type: ignore[attr-defined]

    def stop(self) -> None:
        if self.up:
            self.cli("down", str(self.spec))
            self.up = False


def console_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def wait_for(arm: Arm, pattern: re.Pattern[str] | str, timeout: float) -> dict[str, str]:
    """Each guest's console once it shows `pattern`; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    found: dict[str, str] = {}
    while len(found) < len(arm.serial_logs):
        for vm, path in arm.serial_logs.items():
            text = console_text(path)
            if vm not in found and (re.search(pattern, text) if isinstance(pattern, re.Pattern)
                                    else pattern in text):
                found[vm] = text
        if time.monotonic() > deadline:
            missing = sorted(set(arm.serial_logs) - set(found))
            raise SystemExit(f"{arm.name}: {', '.join(missing)} did not show {pattern!r} "
                             f"within {timeout:g} s")
        time.sleep(0.5)
    return found


def type_in(console: Path, line: str) -> None:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(console))
        conn.sendall(f"\n{line}\n".encode())
        time.sleep(0.2)


def memory(arm: Arm) -> dict[str, Any]:
    per_guest = {vm: smaps(pid) for vm, pid in arm.pids.items()}
    extra = sum(smaps(pid)[0] for pid in arm.extra_pids)
    counters = ksm()
    return {"pss": sum(pss for pss, _ in per_guest.values()) + extra,
            "tcg_cache": sum(tcg_cache(pid) for pid in arm.pids.values()),
            "rss": sum(rss for _, rss in per_guest.values()),
            "pss_per_guest": {vm: pss for vm, (pss, _) in per_guest.items()},
            "manager_pss": extra, "ksm_saved": counters["pages_sharing"] * PAGE,
            "ksm_shared": counters["pages_shared"] * PAGE, "ksm_run": counters["run"]}


def run_arm(arm: Arm, settle: float, loop: float) -> dict[str, Any]:
    log(f"\n{arm.name}: starting {arm.count} guests of {arm.memory_mib} MiB")
    started = time.monotonic()
    try:
        arm.start()
        wait_for(arm, READY, 300)
        booted = time.monotonic() - started
        log(f"{arm.name}: all ready in {booted:.0f} s; idling {settle:g} s")
        settle_start, ksmd_start = time.monotonic(), ksmd_seconds()
        settle_end = settle_start + settle
        trace = []
        while time.monotonic() < settle_end:
            time.sleep(min(10.0, max(0.0, settle_end - time.monotonic())))
            now = memory(arm)
            trace.append({"t": round(time.monotonic() - started), "pss": now["pss"],
                          "ksm_saved": now["ksm_saved"]})
            log(f"  {trace[-1]['t']:4d} s: PSS {now['pss'] / MIB:7.0f} MiB, KSM saves "
                f"{now['ksm_saved'] / MIB:6.0f} MiB")
        result = memory(arm)
        result["booted_s"], result["trace"] = round(booted, 1), trace
        result["ksmd_cpu"] = (ksmd_seconds() - ksmd_start) / (time.monotonic() - settle_start) * 100
        log(f"{arm.name}: loop for {loop:g} s in every guest")
        for console in arm.consoles.values():
            type_in(console, LOOP.format(seconds=int(loop)))
        texts = wait_for(arm, COUNT, loop + 240)
        counts = {vm: int(COUNT.findall(text)[-1]) for vm, text in texts.items()}
        result["loops"] = counts
        result["throughput"] = statistics.mean(counts.values()) / loop
        return result
    finally:
        arm.stop()


# ------------------------------------------------------------------------------------------ output

def table(results: dict[str, dict[str, Any]], count: int, memory_mib: int) -> list[str]:
    plain, ours = results["plain"], results["vmlaunch"]
    lines = [f"{count} idle test guests of {memory_mib} MiB each (TCG), side by side:",
             f"{'':<12}{'PSS total':>12}{'per guest':>12}{'RSS total':>12}{'KSM saves':>12}"
             f"{'passes/s':>10}{'booted':>8}{'ksmd CPU':>10}"]
    for name, result in (("plain QEMU", plain), ("vmlaunch", ours)):
        lines.append(f"{name:<12}{result['pss'] / MIB:>9.0f} MiB{result['pss'] / count / MIB:>8.0f} MiB"
                     f"{result['rss'] / MIB:>8.0f} MiB{result['ksm_saved'] / MIB:>8.0f} MiB"
                     f"{result['throughput']:>10.2f}{result['booted_s']:>7.0f}s{result['ksmd_cpu']:>8.1f} %")
    memory_ratio = ours["pss"] / plain["pss"]
    speed_ratio = ours["throughput"] / plain["throughput"]
    lines.append(f"memory: vmlaunch / plain = {memory_ratio:.2f} (goal <= 0.50: "
                 f"{'met' if memory_ratio <= 0.5 else 'NOT met'})")
    # What a host that runs the guests with KVM would not spend: TCG's translation caches.
    emulated = [(arm["pss"] - arm["tcg_cache"]) for arm in (plain, ours)]
    lines.append(f"  of which TCG's translation caches: plain {plain['tcg_cache'] / MIB:.0f} MiB, vmlaunch "
                 f"{ours['tcg_cache'] / MIB:.0f} MiB; without them: vmlaunch / plain = "
                 f"{emulated[1] / emulated[0]:.2f}")
    lines.append(f"throughput: vmlaunch / plain = {speed_ratio:.2f} (goal: no more than 10 % slower: "
                 f"{'met' if speed_ratio >= 0.9 else 'NOT met'})")
    return lines


def chart(results: dict[str, dict[str, Any]], count: int, memory_mib: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["plain QEMU", "vmlaunch"]
    arms = [results["plain"], results["vmlaunch"]]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 4.2))
    pss = [arm["pss"] / MIB for arm in arms]
    tcg = [arm.get("tcg_cache", 0) / MIB for arm in arms]
    saved = [arm["ksm_saved"] / MIB for arm in arms]
    left.bar(names, [total - cache for total, cache in zip(pss, tcg)], bottom=tcg,
             color=["#999999", "#2a7ab0"], label="PSS of the QEMUs")
    left.bar(names, tcg, color="#dddddd", edgecolor="#777777", hatch="..",
             label="of it TCG's translation caches")
    left.bar(names, saved, bottom=pss, color="none", edgecolor="#2a7ab0", hatch="//",
             label="saved by KSM")
    left.set_ylabel("MiB")
    left.set_ylim(0, max(pss) * 1.4)
    left.set_title(f"host memory for {count} idle guests of {memory_mib} MiB")
    left.legend(loc="upper right", fontsize="small")
    for index, value in enumerate(pss):
        left.text(index, (value + tcg[index]) / 2, f"{value:.0f}", ha="center", color="white",
                  fontweight="bold")
    for arm, name, color in zip(arms, names, ["#999999", "#2a7ab0"]):
        trace = arm["trace"]
        middle.plot([point["t"] for point in trace], [point["pss"] / MIB for point in trace], color=color,
                    marker="o", label=name)
    middle.set_xlabel("seconds since start")
    middle.set_ylabel("MiB (PSS total)")
    middle.set_title("while idle")
    middle.legend()
    right.bar(names, [arm["throughput"] for arm in arms], color=["#999999", "#2a7ab0"])
    right.set_ylabel("passes over 64 MiB per second, mean of guests")
    right.set_title("memory-reading loop in every guest")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guests", type=int, default=8)
    parser.add_argument("--memory", type=int, default=512, help="MiB per guest")
    parser.add_argument("--settle", type=float, default=150.0,
                        help="seconds the guests idle before measuring")
    parser.add_argument("--loop", type=float, default=30.0, help="seconds of the loop in each guest")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if os.geteuid() != 0 or not (KSM / "run").exists():
        print("density.py needs root and a kernel with KSM (/sys/kernel/mm/ksm)", file=sys.stderr)
        return 3
    subprocess.run([sys.executable, str(ROOT / "tools" / "build_guest.py")], check=True,
                   stdout=subprocess.DEVNULL)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks clean up
    results: dict[str, dict[str, Any]] = {}
    with ksm_kept(), tempfile.TemporaryDirectory(prefix="vl-density-") as work:
        (KSM / "run").write_text("0\n")  # the plain arm: the host as it comes
        results["plain"] = run_arm(Plain(args.guests, args.memory, Path(work)), args.settle, args.loop)
        results["vmlaunch"] = run_arm(Vmlaunch(args.guests, args.memory, Path(work)), args.settle,
                                      args.loop)
    lines = table(results, args.guests, args.memory)
    print("\n" + "\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"guests": args.guests, "memory_mib": args.memory, "settle_s": args.settle, "loop_s": args.loop,
           "results": results, "table": lines}
    (args.out / "density.json").write_text(json.dumps(doc, indent=1) + "\n")
    try:
        chart(results, args.guests, args.memory, args.out / "density.png")
        print(f"chart: {args.out / 'density.png'}")
    except ImportError:
        print("no chart: matplotlib is missing (pip install '.[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
