#!/usr/bin/env python3
"""The transcripts of command output in the README and the manual, made from the real output.

A transcript is the ```console block right after a line `<!-- transcript: NAME -->` in README.md or
in a page of the manual (docs/**/*.md); one transcript may be shown on several pages, and each copy
is checked. Each NAME has a recipe here: the commands it runs. Today there is one, `demo`: `up`,
`status` and `down` of the demo lab (examples/lab.toml) with the test guest, run as a user types
them, in a private network namespace (`unshare --net`: its bridge and taps never touch the host's
network) and with a cache of its own (so `up` tells why the accelerator was chosen, as it does the
first time each day).

    tools/readme_transcripts.py            compare each transcript with the real output (exit 1
                                           when one drifted, with the difference)
    tools/readme_transcripts.py --write    write the real output into every page that shows it

What changes from run to run is compared as a placeholder (`normalise`): pids, uptimes, a guest's
free memory, this host's memory budget and KSM counters, the accelerator and its reason, the lines
that report progress while waiting, which kernel boots (said under TCG only: guests/kernels.py), and
the order in which VMs report being ready or off. Everything
else must be the same: a column, a line or a word that the commands print and a page does not show
(or the other way round) is drift. tests/test_readme.py runs the comparison.

The lab's KSM settings are a private copy of the host's (`VMLAUNCH_SYSFS`), so the host's KSM is
left alone (KSM is one setting for the whole host: turning it on and off under tests that run at the
same time, and check it, would fail them); its counters then stay at 0. `--host-ksm` uses the host's
own KSM, as `make demo` does, on a host where nothing else minds. Root only (the bridge and taps, even
in a namespace). Needs `make setup` first.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GUEST = ROOT / "examples" / "guest"
MARKER = re.compile(r"^<!-- transcript: ([a-z0-9-]+) -->\n```console\n(.*?)^```\n", re.M | re.S)
READY = "VMLAUNCH-GUEST-READY"
# The commands of each transcript, as typed on the page (after `vmlaunch`), run in a folder holding
# examples/lab.toml and examples/guest.
RECIPES: dict[str, tuple[tuple[str, ...], ...]] = {
    "demo": (("up", "examples/lab.toml", "--wait-for", READY),
             ("status", "examples/lab.toml"),
             ("down", "examples/lab.toml")),
}
KSM_FILES = ("run", "pages_to_scan", "sleep_millisecs", "advisor_mode", "pages_shared", "pages_sharing",
             "pages_unshared", "pages_volatile", "full_scans", "max_page_sharing", "merge_across_nodes")


class Drift(Exception):
    """A page's transcript and the real output differ."""


def pages() -> list[Path]:
    """The pages that may show transcripts: README.md, then the manual's pages (docs/**/*.md) in
    order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def shown() -> dict[Path, dict[str, str]]:
    """Each page's transcripts by name, for the pages that show any."""
    found = {page: transcripts(page.read_text()) for page in pages()}
    return {page: named for page, named in found.items() if named}


def transcripts(text: str) -> dict[str, str]:
    """A page's transcripts by name: the text of each one's console block."""
    return {match.group(1): match.group(2) for match in MARKER.finditer(text)}


def replaced(text: str, name: str, block: str) -> str:
    """The page's text with transcript `name`'s block replaced by `block`."""
    def swap(match: re.Match[str]) -> str:
        if match.group(1) != name:
            return match.group(0)
        return f"<!-- transcript: {name} -->\n```console\n{block}```\n"

    return MARKER.sub(swap, text)


# --- what may differ between two runs -----------------------------------------------------------------

_STATUS_ROW = re.compile(r"^(\S+) +(running|stopped|off|crashed) +(\d+|-) +(tcg|kvm|-) +(\S+) +(\S+) +"
                         r"(\S+) +(\S+) +(\S+)(.*)$")
_ACCEL_LINE = re.compile(r"^vmlaunch: ([a-z0-9-]+(?:, [a-z0-9-]+)*): (tcg|kvm)( \(.*\))?$")
_MEMORY_LINE = re.compile(r"^memory: the guests hold (\S+)(?:, \S+ of it merged,)? of a budget of \S+;(.*)$")
_EACH_VM = re.compile(r"^vmlaunch: [a-z0-9-]+: (ready \(|powered off$)")
_PROGRESS = re.compile(r"^vmlaunch: [a-z0-9-]+: (waiting for .*, \d+ s: |still shutting down, )")
# Which kernel boots under TCG, and its decompression the first time: not said under KVM
_KERNEL = re.compile(r"^vmlaunch: (kernel .*: decompressing .*|note: [a-z0-9, -]+: kernel .* boots .*)$")


def normalise(transcript: str) -> list[str]:
    """The transcript's lines with what varies between runs replaced by placeholders."""
    lines: list[str] = []
    for line in transcript.splitlines():
        if _PROGRESS.match(line) or _KERNEL.match(line):
            continue
        if match := _ACCEL_LINE.match(line):
            line = f"vmlaunch: {match.group(1)}: ACCEL" + (" (WHY)" if match.group(3) else "")
        elif match := _STATUS_ROW.match(line):
            name, state, pid, accel, balloon, uptime, most, target, free, rest = match.groups()
            line = " ".join((name, state, "PID" if pid != "-" else pid, "ACCEL" if accel != "-" else accel,
                             balloon, "UPTIME" if uptime != "-" else uptime, most, target,
                             "FREE" if free != "-" else free)) + rest
        elif match := _MEMORY_LINE.match(line):
            line = f"memory: the guests hold {match.group(1)} of a budget of BUDGET;{match.group(2)}"
        elif line.startswith("ksm: ") and "; " in line:
            line = line.split("; ", 1)[0] + "; KSM-STATE"
        line = re.sub(r"\(pid \d+, (tcg|kvm)", "(pid PID, ACCEL", line)
        line = re.sub(r"lab manager: running \(pid \d+\)", "lab manager: running (pid PID)", line)
        lines.append(re.sub(r" {2,}", " ", line))
    # VMs report ready (or off) in whatever order they get there
    start = 0
    while start < len(lines):
        end = start
        while end < len(lines) and _EACH_VM.match(lines[end]):
            end += 1
        lines[start:end] = sorted(lines[start:end])
        start = max(end, start + 1)
    return lines


def difference(page: str, real: str, where: str = "README.md") -> str:
    """A diff of the two transcripts as compared (normalised), or "" when they agree; `where` names
    the page the first one is shown on."""
    return "\n".join(difflib.unified_diff(normalise(page), normalise(real), where, "real output",
                                          lineterm=""))


# --- running the commands ---------------------------------------------------------------------------


def _private_ksm(folder: Path) -> Path:
    """A sysfs root holding a copy of the host's KSM settings (off), for the lab to change instead."""
    ksm = folder / "kernel" / "mm" / "ksm"
    ksm.mkdir(parents=True)
    for name in KSM_FILES:
        try:
            value = (Path("/sys/kernel/mm/ksm") / name).read_text()
        except OSError:
            continue
        (ksm / name).write_text("0\n" if name == "run" else value)
    return folder


def real_output(name: str, *, host_ksm: bool = False, timeout: float = 300) -> str:
    """Run transcript `name`'s commands as the pages show them; their output (stdout and stderr as
    they came), each after its `$ vmlaunch ...` line."""
    if os.geteuid() != 0:
        raise SystemExit("readme_transcripts: the demo lab's bridge needs root (in a private network "
                         "namespace)")
    if not (GUEST / "vmlinuz").is_file():
        raise SystemExit(f"readme_transcripts: {GUEST} is not built: make setup")
    work = Path(tempfile.mkdtemp(prefix="vl-readme-"))  # short: unix socket paths are limited
    try:
        (work / "examples").mkdir()
        shutil.copy(ROOT / "examples" / "lab.toml", work / "examples")
        (work / "examples" / "guest").symlink_to(GUEST.resolve())
        cache = work / "cache"
        cache.mkdir(mode=0o700)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VMLAUNCH_RUN_DIR": str(work / "run"),
               "VMLAUNCH_CACHE_DIR": str(cache), "VMLAUNCH_LOG_DIR": str(work / "logs")}
        env.pop("VMLAUNCH_SYSFS", None)
        if not host_ksm:
            env["VMLAUNCH_SYSFS"] = str(_private_ksm(work / "sys"))
        done = subprocess.run(["unshare", "--net", "--", sys.executable, str(Path(__file__).resolve()),
                               "--inside", name], cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if done.returncode != 0:
            raise Drift(f"running transcript {name} failed (exit {done.returncode}):\n{done.stdout}"
                        f"{done.stderr}")
        return done.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _inside(name: str) -> int:
    """In the private network namespace: each command of the recipe, its output after its line; the
    lab goes down whatever happened."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # the user network's port forward
    went_down = False
    try:
        for args in RECIPES[name]:
            print(f"$ vmlaunch {' '.join(args)}", flush=True)
            done = subprocess.run([sys.executable, "-m", "vmlaunch", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=240, check=False)
            sys.stdout.write(done.stdout)
            sys.stdout.flush()
            if done.returncode != 0:
                return 1
            went_down = args[0] == "down"
    finally:
        if not went_down:
            subprocess.run([sys.executable, "-m", "vmlaunch", "down", "examples/lab.toml"],
                           capture_output=True, timeout=120, check=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--write", action="store_true",
                        help="write the real output into every page that shows the transcript")
    parser.add_argument("--host-ksm", action="store_true",
                        help="the lab turns the host's own KSM on and off, as `make demo` does")
    parser.add_argument("--inside", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside is not None:
        return _inside(args.inside)
    found = shown()
    names = {name for named in found.values() for name in named}
    if missing := set(RECIPES) - names:
        print(f"readme_transcripts: no page shows transcript {', '.join(sorted(missing))} "
              "(a `<!-- transcript: NAME -->` line before its ```console block)", file=sys.stderr)
        return 1
    if unknown := names - set(RECIPES):
        print(f"readme_transcripts: no recipe for transcript {', '.join(sorted(unknown))}", file=sys.stderr)
        return 1
    texts = {page: page.read_text() for page in found}
    drifted = False
    for name in RECIPES:
        try:
            real = real_output(name, host_ksm=args.host_ksm)
        except Drift as exc:
            print(f"readme_transcripts: {exc}", file=sys.stderr)
            return 1
        for page, named in found.items():
            if name not in named:
                continue
            where = str(page.relative_to(ROOT))
            if args.write:
                texts[page] = replaced(texts[page], name, real)
                print(f"{where}: transcript {name}: {len(real.splitlines())} lines")
            elif diff := difference(named[name], real, where):
                print(f"{where}: transcript {name} drifted from the real output:\n{diff}")
                drifted = True
    if args.write:
        for page, text in texts.items():
            page.write_text(text)
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
