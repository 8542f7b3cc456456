"""`vmlaunch graph SPEC [--format svg|png|dot|mermaid] [--out FILE] [--live]`: a picture of the lab.

Kept light like the rest of `cli/`: argparse only at import; the picture (`export/graph.py`) and
Graphviz's Python package are imported when the command runs. This module picks the format (from
--out's suffix when not given), refuses PNG bytes on a terminal and writes --out whole (a temp file
renamed into place), or leaves an SVG --out that shows the same lab as it is.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from vmlaunch.cli.common import Commands, command, lab_vm
from vmlaunch.errors import OutputRefused, RuntimeFailure, UsageError

log = logging.getLogger("vmlaunch")

# --out's suffix -> the format it means
SUFFIXES = {".svg": "svg", ".png": "png", ".dot": "dot", ".gv": "dot", ".mmd": "mermaid",
            ".mermaid": "mermaid"}


def register(commands: Commands, root: argparse.ArgumentParser) -> None:
    """The `graph` command."""
    graph = command(
        commands, "graph", cmd_graph, help="draw the lab: VMs, networks, NICs, shares, PCI devices",
        raw=True, description="""\
Draw the lab's topology: each VM (CPUs, memory, image or kernel, SSH port), each
network (bridge, uplink and VLAN, subnet; a user network's forwarded ports), a
line per NIC (its MAC, address and netem), host folders shared into VMs (the
guest's path, ro or rw) and PCI devices passed through.

  --format svg, png  drawn by Graphviz (the Debian package graphviz, and
                     `pip install graphviz`): exit 3 naming what is missing
  --format dot       Graphviz's own language, to draw or edit elsewhere
  --format mermaid   a mermaid flowchart, for a Markdown page

The format is --out's suffix (.svg .png .dot .gv .mmd .mermaid) when not given,
else svg; without --out the picture goes to standard output (PNG only to a
file or a pipe). --live colours each VM by its state (green running, amber
paused, grey stopped, red crashed or panicked) and shows each NIC's link and
netem as they are now; a lab that is not up is drawn all stopped, with a
warning.""",
        spec=True)
    graph.add_argument("--format", metavar="FORMAT", choices=("svg", "png", "dot", "mermaid"),
                       help="svg, png, dot or mermaid (default: from --out's suffix, else svg)")
    graph.add_argument("--out", metavar="FILE",
                       help="the file to write, replaced whole (default: standard output)")
    graph.add_argument("--live", action="store_true",
                       help="the lab as it runs: VM states, link states and netem")


def format_of(format: str | None, out: str | None) -> str:
    """The format asked for, else the one --out's suffix names, else svg."""
    suffix = Path(out).suffix.lower() if out is not None else ""
    if format is not None:
        if SUFFIXES.get(suffix, format) != format:
            raise UsageError(f"--out {out} is named as {SUFFIXES[suffix]}, not {format}",
                             f"name it with a suffix for {format}, or leave out --format")
        return format
    if out is None:
        return "svg"
    if suffix not in SUFFIXES:
        raise UsageError(f"--out {out}: cannot tell the format from {suffix or 'a name without a suffix'}",
                         f"give --format, or a suffix: {', '.join(SUFFIXES)}")
    return SUFFIXES[suffix]


def cmd_graph(args: argparse.Namespace) -> int:
    from vmlaunch.export.graph import RENDERED, lab_graph, observe, render, to_dot, to_mermaid

    format = format_of(args.format, args.out)
    if format == "png" and args.out is None and sys.stdout.isatty():
        raise UsageError("a PNG is not for a terminal", "write it to a file: --out lab.png (or pipe it)")
    run_dir, lab = lab_vm(args.spec)  # the spec only: the picture needs none of the files it names
    live = None
    if args.live:
        live = observe(run_dir, lab)
        if not live.up:
            log.warning("lab %s is not up: every VM is drawn stopped (`vmlaunch up %s` starts it)",
                        lab.name, args.spec)
    graph = lab_graph(lab, live)
    if format == "mermaid":
        data: bytes = to_mermaid(graph).encode()
    elif format in RENDERED:
        data = render(to_dot(graph), format)
    else:
        data = to_dot(graph).encode()
    if args.out is None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        return 0
    if format == "svg" and _shows_already(Path(args.out), data):
        log.info("%s already shows this lab: left as it is", args.out)
        return 0
    _write(Path(args.out), data)
    log.info("wrote %s (%s)", args.out, format)
    return 0


def _shows_already(path: Path, svg: bytes) -> bool:
    """`path` holds an SVG drawn from the same dot text (on this host or another, whose fonts may draw
    it a few points wider): rewriting it would change bytes, not the picture (`make docs` would
    otherwise rewrite the manual's picture of the demo lab on every build)."""
    from vmlaunch.core.fsutil import read_bounded
    from vmlaunch.export.graph import drawn_from

    try:
        there = read_bounded(path, 16 << 20)
    except OSError:  # missing, or not a file vmlaunch would write over: _write says so
        return False
    return drawn_from(there) is not None and drawn_from(there) == drawn_from(svg)


def _write(path: Path, data: bytes) -> None:
    from vmlaunch.core.fsutil import Unfit, write_new

    try:
        write_new(path, data, 0o644)
    except Unfit as exc:
        raise OutputRefused.of(exc) from None
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {path}: {exc.strerror or exc}",
                             "choose a file you can write with --out") from None
