#!/usr/bin/env python3
"""`vmlaunch fork`: how fast running copies of a booted guest run and answer, what the source's pause
is, and what host memory `--shared-memory` saves; each measured side by side in one run.

The test guest (examples/guest: the project's busybox guest with vmlaunch's agent, 160M, TCG, on a
bridge with a static address given on its kernel command line, `vl.ip=`) is booted once to its ready
line (not timed). Then, with the source running all along:

- memory (first: it also warms the caches for the timed forks): `fork SPEC a --count 8`, and
  `--count 8 --shared-memory`; after `--settle` seconds the memory the host spends on the clones is
  read the density benchmark's way: the sum of each clone QEMU's PSS (`/proc/PID/smaps_rollup`; PSS
  divides a page that k processes map by k, so the sum counts each page once). Reported beside it:
  TCG's translation caches (a cost per QEMU a KVM host does not have), and for `--shared-memory` the
  total with the RAM file whole: PSS counts the file's pages a clone maps, and the file (on a tmpfs,
  unlinked) holds the others too. Goal: the shared clones' PSS well below the plain ones'.
- time: `fork SPEC a --count 4 --json` and `--count 4 --shared-memory --json`, alternated, the order
  swapped every repetition (`--repeat`), the clones taken down between them (`down SPEC a-1 ... a-4`,
  not timed). Per fork: the max and the median of the 4 clones' `ready` (seconds from the fork's start
  until the clone runs with its identity, as `vmlaunch fork` reports it), the wall time of the whole
  command as a user runs it (Python's start-up, the spec's checks and the JSON printed included), and
  the fork's phase line (prepared, saved with the source paused, loaded, identities given). After each
  fork, each clone is asked through its command channel (`vmlaunch exec`, not timed) for its hostname
  and address: a fork whose clones did not take their identity is counted and printed. Targets (the
  issue): each clone running and answering within 1.0 s of the command's start; with
  `--shared-memory` within 0.3 s. The figures are the medians over the repetitions; the table also
  says how far apart the `ready` of one fork's clones are.
- the source's pause: the phase line's "saved (a paused) in", for every fork of the run (8 and 4
  clones); and the same pause as QEMU saw it, from the STOP and RESUME events the lab manager logs.

`--debian` adds an arm of minutes (off by default): a Debian guest (tools/build_debian.py's image,
768M, `ssh = true`, TCG) is booted (not timed), then, side by side: `fork SPEC d --count 4` until each
clone answers `vmlaunch ssh SPEC CLONE -- true` (tried again until it does), against
`up SPEC n1 n2 n3 n4 --wait ssh` of 4 fresh guests of the same spec, the source running for both.
Target: the fork in at most 0.2 of the time of the fresh `up`.

Everything runs in a private network namespace (the script starts itself again under `unshare --net`:
the bridge and the taps never touch the host's network), with `ksm = false` (so that KSM's merging
does not move the PSS figures) and the lab's run dir on a tmpfs (/dev/shm, as /run/vmlaunch is on a
Debian host; `--shared-memory`'s RAM file lives there). vmlaunch runs as `python -m vmlaunch` from
this checkout. The table is printed; bench/results/fork.json keeps every sample. Needs root.

    sudo python bench/fork.py [--repeat N] [--clones N] [--memory-clones N] [--settle S]
                              [--arms fork,memory] [--debian]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GUEST = ROOT / "examples" / "guest"
IMAGE = ROOT / "examples" / "debian" / "bookworm.qcow2"
RESULTS = ROOT / "bench" / "results"
READY = "VMLAUNCH-GUEST-READY"
INSIDE = "VLBENCH_FORK_NETNS"  # set once the script runs in its own network namespace
LAB, SOURCE = "benchfork", "a"
DEBIAN_LAB, DEBIAN_SOURCE = "benchforkdeb", "d"
SUBNET, SOURCE_IP = "10.77.0.0/24", "10.77.0.10/24"
TARGETS = {"plain": 1.0, "shared": 0.3}  # seconds: each clone ready within, from the command's start
DEBIAN_TARGET = 0.2  # fork to SSH over fresh up to SSH
MIB = 1 << 20
NAN = float("nan")
PHASES = re.compile(r"fork of (?P<vm>\S+): prepared in (?P<prepared>[0-9.]+) s, saved \(\S+ paused\) in "
                    r"(?P<saved>[0-9.]+) s, (?P<clones>\d+) clones? loaded in (?P<loaded>[0-9.]+) s "
                    r"and given their identities in (?P<identities>[0-9.]+) s more")
MODES = {"plain": (), "shared": ("--shared-memory",)}
LABELS = {"plain": "plain", "shared": "--shared-memory"}


def log(message: str) -> None:
    print(message, flush=True)


# ------------------------------------------------------------------------------------------ the labs

def guest_spec(folder: Path) -> Path:
    spec = folder / "fork.toml"
    spec.write_text(
        f'[lab]\nname = "{LAB}"\n[lab.memory]\nksm = false\n'
        f'[network.lan]\nbridge = "vlbr-benchfork"\nsubnet = "{SUBNET}"\n'
        f'[vm.{SOURCE}]\nmemory = "160M"\naccel = "tcg"\nkernel = "{GUEST}/vmlinuz"\n'
        f'initrd = "{GUEST}/initrd.gz"\nappend = "console=ttyS0 vl.ip=eth0:{SOURCE_IP}"\n'
        f'[[vm.{SOURCE}.nic]]\nnetwork = "lan"\nip = "{SOURCE_IP}"\n')
    return spec


def debian_spec(folder: Path, fresh: int) -> Path:
    spec = folder / "fork-debian.toml"
    text = f'[lab]\nname = "{DEBIAN_LAB}"\n[lab.memory]\nksm = false\n[image.debian]\nfile = "{IMAGE}"\n'
    for name in [DEBIAN_SOURCE, *fresh_names(fresh)]:
        text += f'[vm.{name}]\nmemory = "768M"\naccel = "tcg"\nimage = "debian"\nssh = true\n'
    spec.write_text(text)
    return spec


def fresh_names(count: int) -> list[str]:
    return [f"n{i}" for i in range(1, count + 1)]


class Vmlaunch:
    """`python -m vmlaunch` of this checkout, with the bench's run dir."""

    def __init__(self, run_root: Path) -> None:
        self.run_root = run_root
        self.env = {**os.environ, "VMLAUNCH_RUN_DIR": str(run_root), "PYTHONPATH": str(ROOT)}
        # Measure what a user gets: Python writing and reusing its bytecode cache.
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)

    def run(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "vmlaunch", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise SystemExit(f"bench/fork.py: `vmlaunch {' '.join(args)}` failed ({done.returncode}):\n"
                             f"{done.stderr.strip()}")
        return done

    def pid(self, lab: str, vm: str) -> int:
        return int((self.run_root / lab / f"{vm}.pid").read_text().strip())

    def events(self, lab: str) -> list[dict[str, Any]]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for line in (self.run_root / lab / "events.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return found


@contextlib.contextmanager
def lab_up(tool: Vmlaunch, spec: Path, *args: str) -> Iterator[float]:
    """The lab's source VM booted (the seconds it took); the whole lab taken down on the way out."""
    started = time.monotonic()
    try:
        tool.run("up", str(spec), *args)
        yield time.monotonic() - started
    finally:
        tool.run("down", str(spec), "--timeout", "0", check=False)


# ---------------------------------------------------------------------------------------- one fork

def fork(tool: Vmlaunch, spec: Path, source: str, count: int, mode: str) -> dict[str, Any]:
    """`vmlaunch fork SPEC SOURCE --count COUNT --json` (with --shared-memory in the shared mode), as a
    user runs it: its wall time, each clone's figures, its phase line, the source's pause seen by QEMU."""
    since = time.time()
    started = time.perf_counter()
    done = tool.run("fork", str(spec), source, "--count", str(count), "--json", *MODES[mode])
    wall = time.perf_counter() - started
    clones = json.loads(done.stdout)
    phases = PHASES.search(done.stderr)
    ready = [float(clone["ready"]) for clone in clones.values()]
    return {"mode": mode, "count": count, "wall": wall, "names": list(clones),
            "pids": {name: clone["pid"] for name, clone in clones.items()},
            "addresses": {name: clone["addresses"] for name, clone in clones.items()},
            "identity": {name: clone["identity"] for name, clone in clones.items()},
            "ready": ready, "ready_max": max(ready), "ready_median": statistics.median(ready),
            "phases": ({key: float(value) for key, value in phases.groupdict().items() if key != "vm"}
                       if phases else None),
            "qemu_pause": qemu_pause(tool.events(LAB if source == SOURCE else DEBIAN_LAB), source, since)}


def qemu_pause(events: Sequence[dict[str, Any]], vm: str, since: float) -> float | None:
    """Seconds between the source's STOP and its RESUME after `since`, by QEMU's timestamps (the lab
    manager logs both); None when the log does not have the pair."""
    stop = next((e["time"] for e in events if e.get("vm") == vm and e.get("event") == "STOP"
                 and e.get("time", 0) >= since), None)
    if stop is None:
        return None
    resume = next((e["time"] for e in events if e.get("vm") == vm and e.get("event") == "RESUME"
                   and e.get("time", 0) >= stop), None)
    return None if resume is None else float(resume - stop)


def wait_for_pause(tool: Vmlaunch, sample: dict[str, Any], lab: str, vm: str, since: float) -> None:
    """The manager logs the events as they come, maybe a moment after the fork returned."""
    for _ in range(20):
        if sample["qemu_pause"] is not None:
            return
        time.sleep(0.1)
        sample["qemu_pause"] = qemu_pause(tool.events(lab), vm, since)


def check_identities(tool: Vmlaunch, spec: Path, sample: dict[str, Any]) -> list[str]:
    """Ask each clone its hostname and addresses through its command channel; what is wrong."""
    def ask(name: str) -> str | None:
        done = tool.run("exec", str(spec), name, "--", "sh", "-c",
                        "cat /proc/sys/kernel/hostname; ip -o -4 addr show", check=False, timeout=120)
        if done.returncode != 0:
            return f"{name} does not answer its command channel: {done.stderr.strip()[-200:]}"
        lines = done.stdout.splitlines()
        if not lines or lines[0].strip() != name:
            return f"{name}'s hostname is {lines[0].strip() if lines else ''!r}"
        missing = [address for address in sample["addresses"][name] if f" {address} " not in done.stdout]
        if missing or f" {SOURCE_IP} " in done.stdout:
            return f"{name}'s addresses: {' '.join(lines[1:])!r} (expected {sample['addresses'][name]})"
        return None

    with ThreadPoolExecutor(len(sample["names"])) as pool:
        return [why for why in pool.map(ask, sample["names"]) if why]


def take_down(tool: Vmlaunch, spec: Path, names: Sequence[str]) -> float:
    started = time.perf_counter()
    tool.run("down", str(spec), *names)
    return time.perf_counter() - started


def describe(sample: dict[str, Any]) -> str:
    phases = sample["phases"] or {}
    pause = sample["qemu_pause"]
    return (f"  {LABELS[sample['mode']]:<16} x{sample['count']}: ready max {sample['ready_max']:5.2f} s, "
            f"median {sample['ready_median']:5.2f} s; command {sample['wall']:5.2f} s; prepared "
            f"{phases.get('prepared', NAN):.2f}, saved {phases.get('saved', NAN):.2f} (QEMU: paused "
            f"{pause if pause is not None else NAN:.3f}), loaded {phases.get('loaded', NAN):.2f}, "
            f"identities {phases.get('identities', NAN):.2f}"
            + (f"; {len(sample['wrong'])} wrong identities" if sample.get("wrong") else ""))


# ------------------------------------------------------------------------------------------- memory

def smaps(pid: int) -> dict[str, int]:
    """Fields of /proc/PID/smaps_rollup in bytes (Rss, Pss, Pss_Anon, ...)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1]) << 10
    return fields


def mappings(pid: int) -> Iterator[tuple[list[str], dict[str, int]]]:
    """Each mapping of /proc/PID/smaps: its first line's fields and its counters in bytes."""
    head: list[str] | None = None
    counters: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
            if head is not None:
                yield head, counters
            head, counters = parts, {}
        elif len(parts) == 3 and parts[2] == "kB":
            counters[parts[0].rstrip(":")] = int(parts[1]) << 10
    if head is not None:
        yield head, counters


def tcg_cache(pid: int) -> int:
    """PSS of TCG's translation cache: the process's one anonymous rwx mapping (as bench/density.py)."""
    return sum(counters.get("Pss", 0) for head, counters in mappings(pid)
               if head[1] == "rwxp" and len(head) == 5)


def ram_file(pid: int) -> tuple[int, int, int] | None:
    """For a clone of `fork --shared-memory`: (the RAM file's inode, the bytes it holds, the PSS of its
    pages in this process's mapping: the mapping's PSS less its private copies); None for a clone
    whose RAM is its own."""
    found, mapped = None, 0
    for head, counters in mappings(pid):
        if len(head) >= 6 and Path(head[5]).name == "fork.mem":
            found = os.stat(f"/proc/{pid}/map_files/{head[0]}")
            mapped += counters.get("Pss", 0) - counters.get("Anonymous", 0)
    return None if found is None else (found.st_ino, found.st_blocks * 512, mapped)


def memory(pids: dict[str, int]) -> dict[str, Any]:
    """What the host spends on the clones: PSS summed, and with a shared RAM file counted whole."""
    per_clone = {name: smaps(pid) for name, pid in pids.items()}
    pss = sum(fields["Pss"] for fields in per_clone.values())
    files: dict[int, int] = {}
    mapped = 0
    for pid in pids.values():
        found = ram_file(pid)
        if found is not None:
            files[found[0]] = found[1]
            mapped += found[2]
    return {"pss": pss, "rss": sum(fields["Rss"] for fields in per_clone.values()),
            "tcg_cache": sum(tcg_cache(pid) for pid in pids.values()),
            "pss_per_clone": {name: fields["Pss"] for name, fields in per_clone.items()},
            "ram_file": sum(files.values()), "ram_file_mapped_pss": mapped,
            # the clones' PSS with the RAM file's pages counted whole, mapped or not
            "with_file": pss - mapped + sum(files.values())}


def memory_arm(tool: Vmlaunch, spec: Path, count: int, settle: float,
               forks: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {"source_pss": smaps(tool.pid(LAB, SOURCE))["Pss"]}
    for mode in MODES:
        log(f"memory: {count} clones, {LABELS[mode]}; reading their PSS after {settle:g} s")
        since = time.time()
        sample = fork(tool, spec, SOURCE, count, mode)
        wait_for_pause(tool, sample, LAB, SOURCE, since)
        forks.append(sample)
        log(describe(sample))
        time.sleep(settle)
        result[mode] = memory(sample["pids"])
        pss = result[mode]["pss"]
        log(f"  PSS {pss / MIB:.0f} MiB ({pss / count / MIB:.1f} MiB a clone)")
        take_down(tool, spec, sample["names"])
    return result


# ------------------------------------------------------------------------------------------- Debian

def debian_arm(tool: Vmlaunch, folder: Path, count: int) -> dict[str, Any]:
    spec = debian_spec(folder, count)
    log(f"\nDebian: booting {DEBIAN_SOURCE} to SSH (not timed)")
    with lab_up(tool, spec, DEBIAN_SOURCE, "--wait", "ssh", "--timeout", "900") as booted:
        log(f"Debian: {DEBIAN_SOURCE} answers SSH after {booted:.0f} s")
        deadline = time.monotonic() + 300
        while tool.run("exec", str(spec), DEBIAN_SOURCE, "--", "true", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench/fork.py: {DEBIAN_SOURCE}'s command channel did not answer")
            time.sleep(1)
        log(f"Debian: fork {DEBIAN_SOURCE} into {count}, until each answers `vmlaunch ssh`")
        since, started = time.time(), time.perf_counter()
        sample = fork(tool, spec, DEBIAN_SOURCE, count, "plain")
        forked = time.perf_counter() - started

        def ssh(name: str) -> float:
            limit = time.monotonic() + 600
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    done = tool.run("ssh", str(spec), name, "--", "true", check=False, timeout=120)
                    if done.returncode == 0:
                        return time.perf_counter() - started
                if time.monotonic() > limit:
                    raise SystemExit(f"bench/fork.py: {name} did not answer `vmlaunch ssh` in 600 s")
                time.sleep(0.2)

        with ThreadPoolExecutor(count) as pool:
            reachable = dict(zip(sample["names"], pool.map(ssh, sample["names"])))
        wait_for_pause(tool, sample, DEBIAN_LAB, DEBIAN_SOURCE, since)
        log(describe(sample))
        log(f"Debian: the fork took {forked:.1f} s; every clone answered `vmlaunch ssh` after "
            f"{max(reachable.values()):.1f} s")
        take_down(tool, spec, sample["names"])
        log(f"Debian: up {' '.join(fresh_names(count))} --wait ssh")
        started = time.perf_counter()
        tool.run("up", str(spec), *fresh_names(count), "--wait", "ssh", "--timeout", "900")
        fresh = time.perf_counter() - started
        log(f"Debian: {count} fresh guests answered SSH after {fresh:.1f} s")
    ratio = max(reachable.values()) / fresh
    return {"count": count, "booted_s": booted, "fork": sample, "fork_command_s": forked,
            "fork_to_ssh": reachable, "fork_to_ssh_max": max(reachable.values()), "up_wait_ssh": fresh,
            "ratio": ratio}


# ------------------------------------------------------------------------------------------- output

def med(samples: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(float(sample[key]) for sample in samples)


def phase_median(samples: Sequence[dict[str, Any]], key: str) -> float:
    values = [sample["phases"][key] for sample in samples if sample["phases"]]
    return statistics.median(values) if values else float("nan")


def table(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines: list[str] = []
    forks: list[dict[str, Any]] = results["forks"]
    timed = [sample for sample in forks if sample["count"] == args.clones and sample.get("timed")]
    if timed:
        lines += [f"fork of the booted test guest (160M, TCG) into {args.clones}, {args.repeat} repetitions "
                  "alternated; medians over them (seconds):",
                  f"{'':<17}{'ready max':>10}{'median':>8}{'command':>9}{'prepared':>10}{'saved':>7}"
                  f"{'loaded':>8}{'identity':>10}{'target':>8}"]
        for mode in MODES:
            group = [sample for sample in timed if sample["mode"] == mode]
            lines.append(f"{LABELS[mode]:<17}{med(group, 'ready_max'):>10.2f}"
                         f"{med(group, 'ready_median'):>8.2f}{med(group, 'wall'):>9.2f}"
                         f"{phase_median(group, 'prepared'):>10.2f}"
                         f"{phase_median(group, 'saved'):>7.2f}{phase_median(group, 'loaded'):>8.2f}"
                         f"{phase_median(group, 'identities'):>10.2f}{TARGETS[mode]:>8.1f}")
        for mode in MODES:
            group = [sample for sample in timed if sample["mode"] == mode]
            worst = med(group, "ready_max")
            spread = max(max(sample["ready"]) - min(sample["ready"]) for sample in group)
            lines.append(f"{LABELS[mode]}: each clone ready within {TARGETS[mode]:g} s: "
                         f"{'met' if worst <= TARGETS[mode] else 'NOT met'} ({worst:.2f} s by `ready`, "
                         f"{med(group, 'wall'):.2f} s by the command's wall time; ready from min to max "
                         f"of a fork's clones: at most {spread * 1000:.1f} ms apart)")
        plain = [sample for sample in timed if sample["mode"] == "plain"]
        shared = [sample for sample in timed if sample["mode"] == "shared"]
        gap = statistics.median(sample["wall"] - sample["ready_max"] for sample in timed)
        lines.append(f"--shared-memory / plain: ready max "
                     f"{med(shared, 'ready_max') / med(plain, 'ready_max'):.2f}, command "
                     f"{med(shared, 'wall') / med(plain, 'wall'):.2f}; the command's wall time less the "
                     f"last `ready`: {gap:.2f} s (start-up before the fork's clock, and the exit)")
        wrong = sum(len(sample.get("wrong", [])) for sample in timed)
        lines.append(f"identities checked through `vmlaunch exec`: {len(timed) * args.clones - wrong} of "
                     f"{len(timed) * args.clones} clones had their own hostname and address")
    paused = [sample["phases"]["saved"] for sample in forks if sample["phases"]]
    seen = [sample["qemu_pause"] for sample in forks if sample["qemu_pause"] is not None]
    if paused:
        lines.append(f"the source's pause (\"saved (a paused) in\"), {len(paused)} forks of {SOURCE}: "
                     f"median {statistics.median(paused) * 1000:.0f} ms, max {max(paused) * 1000:.0f} ms"
                     + (f"; by QEMU's STOP and RESUME events: median {statistics.median(seen) * 1000:.0f} "
                        f"ms, max {max(seen) * 1000:.0f} ms" if seen else ""))
    mem = results.get("memory")
    if mem:
        count = args.memory_clones
        lines += ["", f"host memory of {count} clones of the test guest, {args.settle:g} s after the fork "
                  "(sum of the QEMUs' PSS):",
                  f"{'':<17}{'PSS':>9}{'a clone':>10}{'RSS':>9}{'TCG caches':>12}{'with RAM file':>15}"]
        for mode in MODES:
            arm = mem[mode]
            whole = (f"{arm['with_file'] / MIB:>11.0f} MiB" if arm["ram_file"] else f"{'-':>15}")
            lines.append(f"{LABELS[mode]:<17}{arm['pss'] / MIB:>5.0f} MiB{arm['pss'] / count / MIB:>6.1f} MiB"
                         f"{arm['rss'] / MIB:>5.0f} MiB{arm['tcg_cache'] / MIB:>8.0f} MiB{whole}")
        plain_mem, shared_mem = mem["plain"], mem["shared"]
        emulated = [arm["pss"] - arm["tcg_cache"] for arm in (plain_mem, shared_mem)]
        lines.append(f"--shared-memory / plain: PSS {shared_mem['pss'] / plain_mem['pss']:.2f}; without "
                     f"TCG's caches {emulated[1] / emulated[0]:.2f}"
                     + (f"; with the RAM file whole {shared_mem['with_file'] / plain_mem['pss']:.2f} (the "
                        f"file holds {shared_mem['ram_file'] / MIB:.0f} MiB, of it "
                        f"{shared_mem['ram_file_mapped_pss'] / MIB:.0f} MiB mapped by the clones)"
                        if shared_mem["ram_file"] else "")
                     + f"; the source alone: {mem['source_pss'] / MIB:.0f} MiB")
        big = {sample["mode"]: sample for sample in forks
               if sample["count"] == count and not sample.get("timed")}
        if len(big) == len(MODES):
            lines.append(f"these forks into {count} (once each, not timed for the targets): ready max "
                         + ", ".join(f"{LABELS[mode]} {big[mode]['ready_max']:.2f} s (command "
                                     f"{big[mode]['wall']:.2f} s)" for mode in MODES))
    deb = results.get("debian")
    if deb:
        lines += ["", f"Debian (768M, TCG): fork into {deb['count']} until each answers `vmlaunch ssh`: "
                  f"{deb['fork_to_ssh_max']:.1f} s (the fork command {deb['fork_command_s']:.1f} s); "
                  f"`up --wait ssh` of {deb['count']} fresh guests: {deb['up_wait_ssh']:.1f} s",
                  f"fork / fresh up: {deb['ratio']:.3f} (target <= {DEBIAN_TARGET}: "
                  f"{'met' if deb['ratio'] <= DEBIAN_TARGET else 'NOT met'})"]
    return lines


# --------------------------------------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="timed forks of each mode (default 3)")
    parser.add_argument("--clones", type=int, default=4, help="clones of each timed fork (default 4)")
    parser.add_argument("--memory-clones", type=int, default=8, help="clones of each memory fork (default 8)")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds the clones run before their memory is read (default 10)")
    parser.add_argument("--arms", default="fork,memory",
                        help="comma-separated, of fork, memory, debian (default fork,memory)")
    parser.add_argument("--debian", action="store_true", help="add the Debian arm (minutes)")
    parser.add_argument("--debian-clones", type=int, default=4, help="clones and fresh guests (default 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.arms = {arm.strip() for arm in args.arms.split(",") if arm.strip()}
    if args.debian:
        args.arms.add("debian")
    unknown = args.arms - {"fork", "memory", "debian"}
    if unknown:
        parser.error(f"--arms: no arm {', '.join(sorted(unknown))}")
    if min(args.repeat, args.clones, args.memory_clones, args.debian_clones) < 1:
        parser.error("--repeat and the counts of clones must be at least 1")
    return args


def private_network() -> None:
    """Run on in a network namespace of our own: start this script again under `unshare --net`."""
    if os.environ.get(INSIDE) != "1":
        os.environ[INSIDE] = "1"
        os.execvp("unshare", ["unshare", "--net", "--", sys.executable, str(Path(__file__).resolve()),
                              *sys.argv[1:]])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def run_root_parent() -> str | None:
    """A tmpfs for the run dir, as /run is on a host: /dev/shm when it is one, else the temp folder."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if fields[1] == "/dev/shm" and fields[2] == "tmpfs":
                return "/dev/shm"
    return None


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0:
        print("bench/fork.py needs root (a network namespace, a bridge and taps)", file=sys.stderr)
        return 3
    private_network()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks clean up
    if not (GUEST / "vmlinuz").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "build_guest.py")], check=True,
                       stdout=subprocess.DEVNULL)
    if "debian" in args.arms and not IMAGE.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "build_debian.py")], check=True)
    results: dict[str, Any] = {"forks": [], "load_before": os.getloadavg(), "cpus": os.cpu_count()}
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="vl-bench-fork-"))
    run_root = Path(tempfile.mkdtemp(prefix="vl-bench-fork-run-", dir=run_root_parent()))
    tool = Vmlaunch(run_root)
    try:
        if args.arms & {"fork", "memory"}:
            spec = guest_spec(folder)
            log(f"booting the test guest {SOURCE} (not timed); the lab's run dir: {run_root}")
            with lab_up(tool, spec, "--wait-for", READY, "--timeout", "300") as booted:
                log(f"{SOURCE} ready after {booted:.1f} s")
                if "memory" in args.arms:
                    results["memory"] = memory_arm(tool, spec, args.memory_clones, args.settle,
                                                   results["forks"])
                if "fork" in args.arms:
                    log(f"\ntime: {args.repeat} x fork into {args.clones}, plain and --shared-memory "
                        "alternated")
                    for index in range(args.repeat):
                        order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
                        for mode in order:
                            since = time.time()
                            sample = fork(tool, spec, SOURCE, args.clones, mode)
                            sample["timed"] = True
                            wait_for_pause(tool, sample, LAB, SOURCE, since)
                            sample["wrong"] = check_identities(tool, spec, sample)
                            sample["down"] = take_down(tool, spec, sample["names"])
                            results["forks"].append(sample)
                            log(describe(sample))
                            for why in sample["wrong"]:
                                log(f"    identity: {why}")
        if "debian" in args.arms:
            results["debian"] = debian_arm(tool, folder, args.debian_clones)
    finally:
        with contextlib.suppress(Exception):
            tool.run("down", str(folder / "fork.toml"), "--timeout", "0", check=False)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(run_root, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    results["seconds"] = time.monotonic() - started
    lines = table(results, args)
    lines.append(f"(the run took {results['seconds']:.0f} s; load average before "
                 f"{results['load_before'][0]:.1f}, after {results['load_after'][0]:.1f}, on "
                 f"{results['cpus']} CPUs)")
    print("\n" + "\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"repeat": args.repeat, "clones": args.clones, "memory_clones": args.memory_clones,
           "settle_s": args.settle, "arms": sorted(args.arms), "results": results, "table": lines}
    (args.out / "fork.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
