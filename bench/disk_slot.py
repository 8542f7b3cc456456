#!/usr/bin/env python3
"""What a disk's fault slot costs when no fault is in it: sequential read and write throughput of QEMU's
block layer for a disk as vmlaunch compiles it (device -> `raw` slot -> format node -> `file` node) and
for the same disk without the slot (device -> format node -> `file` node), raw and qcow2, side by side
in one run. Target: with the slot at most 2 % slower, reads and writes alike.

The nodes are the compiler's own: a one-disk lab is compiled for this host (`compile_lab`, so the file
node has the aio and cache the compiler gives here: io_uring where it works, O_DIRECT), and its three
`-blockdev`s are nested into one `json:` filename for `qemu-img bench`, with the slot on top or the
format node. qemu-img's own BlockBackend writes back and never flushes (as the device with
write-cache=on between a guest's flushes); writes carry a non-zero pattern, since the nodes detect
zeroes. The two image files (`--size`, fully preallocated: every extent written and, for qcow2, every
cluster allocated, so reads reach the disk) go in a temporary folder in `--dir`, by default examples/,
where the demo lab keeps its disks: use a folder on the file system your labs are on.

Each case (format, read or write, request size) runs once per variant first, to warm up and to size
its runs to about `--run-seconds`; then `--rounds` rounds, each case's two variants alternated, the
order swapped every round, so drift of the machine does not favour one side. Printed per case: the
medians in MiB/s and the median of the rounds' ratios (slot / without) with its confidence interval
(95 % for all the cases together); the slot's cost is the worst case of each direction (negative: the
slot measured faster).

The slot adds CPU work only: no I/O, no system call, no coroutine of its own (the same requests reach
the file either way). The same rounds measure that work alone, as CPU time (user and system, which
another busy process on the host does not inflate as it does the clock): the compiled raw disk with a
`null-co` node (no I/O at all) in place of its file node, at the smallest request size. The most CPU
the slot adds to a request there (the top of the 95 % interval of the rounds' differences), over the
CPU QEMU spends on a request of a case on the disk, bounds what the slot can cost that case (all of it
where QEMU's CPU is the bottleneck, less where the disk is): the answer where the machine's noise is
wider than the target.

    python bench/disk_slot.py [--rounds N] [--size MiB] [--requests 64k,4k] [--depth N]
                              [--run-seconds S] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vmlaunch.compile.compiler import compile_lab, slot_name  # noqa: E402
from vmlaunch.errors import VmlaunchError  # noqa: E402
from vmlaunch.host.facts import Host, detect_host  # noqa: E402
from vmlaunch.qemu.opts import json_arg  # noqa: E402
from vmlaunch.spec.load import parse_lab  # noqa: E402

MIB = 1 << 20
TARGET = 2.0  # % the slot may cost
FORMATS = ("raw", "qcow2")
VARIANTS = ("without", "slot")
PATTERN = "165"  # 0xa5: written data that is not zeroes (detect-zeroes would turn zeroes into unmaps)
NODE = "disk0"  # the lab's one disk
NO_IO = "null"  # the raw disk's nodes over null-co, in `filenames`

Nodes = dict[str, dict[str, object]]


class Case(NamedTuple):
    format: str  # raw, qcow2 or NO_IO
    write: bool
    request: int  # bytes, also the step: sequential

    @property
    def direction(self) -> str:
        return "write" if self.write else "read"

    @property
    def name(self) -> str:
        return f"{self.format:<6} {self.direction:<6} {self.request // 1024:>3} KiB"


class Run(NamedTuple):
    mib_s: float  # throughput, by qemu-img's own clock (without its start-up and open)
    cpu: float  # CPU seconds qemu-img spent on a request (all its threads; its start-up taken off)


Samples = dict[Case, dict[str, list[Run]]]


def compiled_nodes(image: Path, fmt: str, host: Host, work: Path) -> Nodes:
    """The block nodes vmlaunch gives a disk of `image` in format `fmt` on this host, by node name."""
    spec = (f'[lab]\nname = "diskslot"\n[vm.bench]\nmemory = "128M"\n'
            f'[[vm.bench.disk]]\nfile = {json.dumps(str(image))}\nformat = "{fmt}"\n')
    argv = compile_lab(parse_lab(spec.encode(), work / "bench.toml"), host).vms[0].argv
    nodes = [json.loads(argv[i + 1]) for i, arg in enumerate(argv) if arg == "-blockdev"]
    found = {node["node-name"]: node for node in nodes}
    slot = slot_name(NODE)
    if slot not in found or found[slot].get("file") != NODE or not isinstance(found[NODE].get("file"), str):
        raise SystemExit(f"bench/disk_slot.py: the compiled disk is not a slot {slot} over {NODE} over a "
                         f"file node: {sorted(found)}")
    return found


def without_io(nodes: Nodes, size: int) -> Nodes:
    """The same nodes with a null-co node, which does no I/O, in place of the file node."""
    file = str(nodes[NODE]["file"])
    return {**nodes, file: {"driver": "null-co", "node-name": file, "size": size}}


def nested(nodes: Nodes, top: str) -> dict[str, object]:
    """The graph under node `top` as one tree: each child named by `file` put in place."""
    node = dict(nodes[top])
    child = node.get("file")
    if isinstance(child, str) and child in nodes:
        node["file"] = nested(nodes, child)
    return node


def variants(nodes: Nodes) -> dict[str, str]:
    """The `json:` filename of each variant: the device's drive is the slot, or the format node."""
    return {"without": "json:" + json_arg(nested(nodes, NODE)),
            "slot": "json:" + json_arg(nested(nodes, slot_name(NODE)))}


def chain(nodes: Nodes) -> str:
    """`disk0-slot (raw) -> disk0 (qcow2) -> disk0-file (file: aio io_uring, cache.direct on)`."""
    parts: list[str] = []
    name: object = slot_name(NODE)
    while isinstance(name, str) and name in nodes:
        node = nodes[name]
        what = str(node["driver"])
        if node["driver"] == "file":
            cache = node.get("cache")
            direct = isinstance(cache, dict) and cache.get("direct") is True
            what += f": aio {node.get('aio', 'threads')}, cache.direct {'on' if direct else 'off'}"
        parts.append(f"{name} ({what})")
        name = node.get("file")
    return " -> ".join(parts)


def file_system(path: Path) -> str:
    """The type and source of the file system `path` is on, from /proc/self/mounts."""
    best, found = "", "an unknown file system"
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return found
    for line in mounts:
        source, point, kind = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)
                               for field in line.split()[:3])
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, found = point, f"{kind} ({source})"
    return found


def run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"bench/disk_slot.py: `{' '.join(argv)}` failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def create_image(img: str, path: Path, fmt: str, size_mib: int) -> None:
    run([img, "create", "-q", "-f", fmt, "-o", "preallocation=full", str(path), f"{size_mib}M"])


class Bench:
    """`qemu-img bench` runs of the cases' variants: sequential, `depth` requests in flight."""

    def __init__(self, img: str, depth: int, filenames: dict[str, dict[str, str]]) -> None:
        self.img, self.depth, self.filenames = img, depth, filenames
        self.counts: dict[Case, int] = {}
        self.startup: dict[tuple[str, str], float] = {}  # (format, variant): CPU seconds of a 1-request run

    def once(self, case: Case, variant: str, count: int) -> tuple[float, float]:
        """Seconds by qemu-img's clock and CPU seconds of one run of `count` requests. Past the end of
        the image the offsets wrap to its start."""
        argv = [self.img, "bench", "-c", str(count), "-d", str(self.depth), "-s", str(case.request),
                "-S", str(case.request)]
        if case.write:
            argv += ["-w", f"--pattern={PATTERN}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = run([*argv, self.filenames[case.format][variant]])
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        found = re.search(r"Run completed in ([0-9.]+) seconds", out)
        if found is None:
            raise SystemExit(f"bench/disk_slot.py: no run time in qemu-img bench's output: {out.strip()}")
        return float(found[1]), after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    def prepare(self, case: Case, run_seconds: float, size: int) -> None:
        """Warm up, measure the start-up's CPU, and size the runs to about `run_seconds`."""
        rates = []
        for variant in VARIANTS:
            if (case.format, variant) not in self.startup:
                self.startup[case.format, variant] = statistics.median(
                    self.once(case, variant, 1)[1] for _ in range(3))
            count = max(1, min(size, 64 * MIB) // case.request)
            rates.append(count / max(self.once(case, variant, count)[0], 0.001))  # printed in ms
        self.counts[case] = max(1, round(run_seconds * statistics.mean(rates)))

    def measure(self, case: Case, variant: str) -> Run:
        count = self.counts[case]
        seconds, cpu = self.once(case, variant, count)
        if seconds <= 0:
            raise SystemExit("bench/disk_slot.py: a run took less than a millisecond: raise --run-seconds")
        return Run(count * case.request / MIB / seconds,
                   max(0.0, cpu - self.startup[case.format, variant]) / count)

    def alternated(self, rounds: int, cases: Sequence[Case]) -> Samples:
        """Both variants of every case, `rounds` times, the order swapped every round."""
        samples: Samples = {case: {variant: [] for variant in VARIANTS} for case in cases}
        print("round", end="", flush=True)
        for index in range(rounds):
            print(f" {index + 1}", end="", flush=True)
            order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
            for case in cases:
                for variant in order:
                    samples[case][variant].append(self.measure(case, variant))
        print(flush=True)
        return samples


def median_interval(values: Sequence[float], error: float) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median: the k-th smallest and k-th largest
    value, for the largest k that misses the median with probability `error` at most (a binomial
    tail); None when too few values for that."""
    n, ordered = len(values), sorted(values)
    k, below = 0, 0.0  # below: the chance that fewer than k values lie under the median
    while 2 * (below + math.comb(n, k) / 2**n) <= error:
        below += math.comb(n, k) / 2**n
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


def request_size(text: str) -> int:
    found = re.fullmatch(r"(\d+)\s*([kKmM]?)", text.strip())
    if found is None or int(found[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a request size (e.g. 64k, 4k)")
    size = int(found[1]) * {"": 1, "k": 1024, "m": MIB}[found[2].lower()]
    if size % 512:
        raise argparse.ArgumentTypeError(f"{text!r}: O_DIRECT needs a multiple of 512 bytes")
    return size


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=256, help="MiB of each image file")
    parser.add_argument("--requests", default="64k,4k", help="request sizes, comma-separated")
    parser.add_argument("--depth", type=int, default=16, help="requests in flight")
    parser.add_argument("--run-seconds", type=float, default=0.3, help="about how long each run lasts")
    parser.add_argument("--dir", type=Path, default=ROOT / "examples",
                        help="a folder on the file system the labs are on (default: examples/)")
    args = parser.parse_args()
    try:
        args.requests = [request_size(text) for text in args.requests.split(",")]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.rounds < 1 or args.depth < 1:
        parser.error("--rounds and --depth must be at least 1")
    if any(args.size * MIB % request for request in args.requests) or args.size * MIB < max(args.requests):
        parser.error("each request size must divide --size (the runs wrap around at its end)")
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir}: no such folder")
    return args


def report(rounds: int, cases: list[Case], idle: list[Case], samples: Samples) -> None:
    """The table and the verdict. The confidence intervals are 95 % for each family together (the
    disk's cases; the no-I/O runs), so one case of eight out by chance does not decide."""
    def median(case: Case, variant: str, field: str) -> float:
        return statistics.median(float(getattr(run, field)) for run in samples[case][variant])

    def rounds_of(case: Case) -> list[tuple[Run, Run]]:
        """(without, slot), round by round."""
        return list(zip(samples[case]["without"], samples[case]["slot"]))

    # The CPU time the slot adds to a request without I/O: the median of the rounds' differences and
    # the top of its interval, the most it adds (infinite when too few rounds tell)
    added: dict[str, tuple[float, float]] = {}
    for case in idle:
        diffs = [slot.cpu - without.cpu for without, slot in rounds_of(case)]
        interval = median_interval(diffs, 0.05 / len(idle))
        added[case.direction] = (statistics.median(diffs), interval[1] if interval else math.inf)

    print(f"\nmedians of {rounds} rounds; ratio: the median of the rounds' slot/without, with its "
          f"confidence interval; bound: the most the CPU the slot adds can cost (the no-I/O runs below)")
    print(f"{'format op     request':<22}{'without':>13}{'with slot':>13}{'ratio':>8}  {'interval':<14}bound")
    cost: dict[str, list[tuple[float, float, float]]] = {"read": [], "write": []}  # %: median, low, high
    bound = {"read": 0.0, "write": 0.0}
    for case in cases:
        ratios = [slot.mib_s / without.mib_s for without, slot in rounds_of(case)]
        ratio, interval = statistics.median(ratios), median_interval(ratios, 0.05 / len(cases))
        low, high = interval or (-math.inf, math.inf)
        cost[case.direction].append(((1 - ratio) * 100, (1 - high) * 100, (1 - low) * 100))
        # the CPU the slot adds over the CPU QEMU spends on a request of this case
        limit = max(0.0, added[case.direction][1]) / median(case, "without", "cpu") * 100
        bound[case.direction] = max(bound[case.direction], limit)
        print(f"{case.name:<22}{median(case, 'without', 'mib_s'):>8.0f} MiB/s"
              f"{median(case, 'slot', 'mib_s'):>8.0f} MiB/s{ratio:>8.3f}  "
              f"{f'{low:.3f}-{high:.3f}' if interval else '-':<14}"
              f"{f'{limit:.2f} %' if math.isfinite(limit) else '-'}")
    for case in idle:
        typical, most = (value * 1e9 for value in added[case.direction])
        print(f"{'no I/O':<6} {case.direction:<6} {case.request // 1024:>3} KiB: "
              f"{median(case, 'without', 'cpu') * 1e9:.0f} ns of CPU a request without the slot, "
              f"{median(case, 'slot', 'cpu') * 1e9:.0f} ns with it: it adds {typical:.0f} ns"
              f"{f' (at most {most:.0f} ns)' if math.isfinite(most) else ''}")
    print(verdict(cost, bound))


def verdict(cost: dict[str, list[tuple[float, float, float]]], bound: dict[str, float]) -> str:
    """The last line: the disk's measured cost where its intervals decide, else the bound."""
    rows = [row for found in cost.values() for row in found]
    measured = ", ".join(f"{direction} {max(found)[0]:.1f} %" for direction, found in cost.items())
    target = f"(target: at most {TARGET:g} %)"
    if all(high <= TARGET for _, _, high in rows):
        return f"slot cost: {measured} {target}: met"
    if any(low > TARGET for _, low, _ in rows):
        return f"slot cost: {measured} {target}: not met"
    widest = max(high - low for _, low, high in rows)
    if not math.isfinite(widest) or not all(map(math.isfinite, bound.values())):
        return f"slot cost: {measured} {target}: not resolved: too few rounds for confidence intervals"
    noise = f"within this machine's noise (intervals up to {widest:.0f} points wide)"
    if max(bound.values()) <= TARGET:
        return (f"slot cost: read at most {bound['read']:.1f} %, write at most {bound['write']:.1f} % "
                f"{target}: met, by the CPU the slot adds; the disk's rounds ({measured}) are {noise}")
    return (f"slot cost: {measured} {target}: not resolved: {noise}, and the CPU the slot adds could "
            f"cost up to {bound['read']:.1f} % (read), {bound['write']:.1f} % (write)")


def main() -> int:
    args = parse_args()
    try:
        host = detect_host()
    except VmlaunchError as exc:
        raise SystemExit(f"bench/disk_slot.py: {exc}") from None
    img = host.qemu.img or shutil.which("qemu-img")
    if img is None:
        raise SystemExit("bench/disk_slot.py: no qemu-img (install Debian's qemu-utils)")
    cases = [Case(fmt, write, request) for fmt in FORMATS for write in (False, True)
             for request in args.requests]
    idle = [Case(NO_IO, write, min(args.requests)) for write in (False, True)]
    # absolute: the spec would take a relative path as beside it
    work = Path(tempfile.mkdtemp(prefix=".disk-slot-", dir=args.dir.resolve()))
    try:
        filenames: dict[str, dict[str, str]] = {}
        for fmt in FORMATS:
            image = work / f"disk.{fmt}"
            create_image(img, image, fmt, args.size)
            nodes = compiled_nodes(image, fmt, host, work)
            filenames[fmt] = variants(nodes)
            if fmt == "raw":
                filenames[NO_IO] = variants(without_io(nodes, args.size * MIB))
            print(f"{fmt}: {chain(nodes)}", flush=True)
        print(f"{args.size} MiB images in {work} on {file_system(work.resolve())}; {img} bench, "
              f"depth {args.depth}, sequential", flush=True)

        bench = Bench(img, args.depth, filenames)
        for case in (*cases, *idle):
            bench.prepare(case, args.run_seconds, args.size * MIB)
        samples = bench.alternated(args.rounds, [*cases, *idle])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args.rounds, cases, idle, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
