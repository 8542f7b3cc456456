"""A picture of the lab (`vmlaunch graph`): `lab_graph(lab, live) -> Graph`, then `to_dot` or `to_mermaid`.

The graph is a small frozen model made from the spec (and, with `--live`, from what runs): a node per
VM, per network, per host folder shared into VMs and per PCI device passed through; an edge per NIC
(VM to network, labelled with its MAC, address, netem and link state), per share (host folder to VM,
labelled with the guest's path, ro or rw) and per PCI device. Ids in the output are ours (`vm0`,
`net1`, ...); text from the spec only ever appears inside a label, escaped for the format it is in,
so that a spec cannot break the output or add to it (`dot_html`, `mermaid_text`).

`to_dot` and `to_mermaid` are pure, like the exporters: the same lab gives the same bytes. `render`
hands dot text to Graphviz for SVG or PNG; `observe` reads what a lab that is up does now (its VMs'
states as `vmlaunch status` has them, and the faults wire.json records).
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from vmlaunch.core.textsafe import last_line, printable
from vmlaunch.core.units import format_size
from vmlaunch.errors import HostError, RuntimeFailure
from vmlaunch.spec.model import (
    DEFAULT_APPEND,
    BridgeNetwork,
    LabSpec,
    Netem,
    Network,
    NicModel,
    SocketNetwork,
    TapNetwork,
    UserNetwork,
    VmSpec,
)
from vmlaunch.spec.netem import figures

if TYPE_CHECKING:
    from vmlaunch.layout.rundir import RunDir

FORMATS = ("svg", "png", "dot", "mermaid")
RENDERED = ("svg", "png")  # the formats Graphviz draws; dot and mermaid are text of our own
WHY_WIDTH = 48  # characters of why a VM is not running shown under its state
APPEND_WIDTH = 48  # characters of a kernel command line shown


class Kind(enum.Enum):
    VM = "vm"
    NETWORK = "network"
    SHARE = "share"  # a host folder shared into VMs
    PCI = "pci"  # a host PCI device passed through to a VM


class Mark(enum.Enum):
    """What a VM's colour says. SPEC: drawn as the spec describes it (no --live)."""

    SPEC = "spec"
    RUNNING = "running"
    PAUSED = "paused"  # its QEMU runs, its guest does not: paused, starting, migrating, suspended
    STOPPED = "stopped"  # not up, or its guest powered itself off
    FAILED = "failed"  # crashed, panicked, unresponsive, QEMU's internal or I/O error


class EdgeMark(enum.Enum):
    PLAIN = "plain"
    NETEM = "netem"  # impaired traffic (netem set)
    DOWN = "down"  # the NIC's link is down (`vmlaunch link ... down`)


# `vmlaunch status` states (runtime/control.py: VmStatus.state) by what they mean for the picture; a
# state not named here is one of QEMU's run states in which its guest does not run: PAUSED.
_STATE_MARKS = {"running": Mark.RUNNING, "stopped": Mark.STOPPED, "off": Mark.STOPPED,
                "shutdown": Mark.STOPPED, "crashed": Mark.FAILED, "guest-panicked": Mark.FAILED,
                "internal-error": Mark.FAILED, "io-error": Mark.FAILED, "watchdog": Mark.FAILED,
                "unresponsive": Mark.FAILED}


def mark_of(state: str) -> Mark:
    return _STATE_MARKS.get(state, Mark.PAUSED)


@attrs.frozen
class Node:
    id: str  # ours, never text from the spec
    kind: Kind
    title: str
    lines: tuple[str, ...] = ()
    mark: Mark = Mark.SPEC


@attrs.frozen
class Edge:
    tail: str
    head: str
    lines: tuple[str, ...] = ()
    mark: EdgeMark = EdgeMark.PLAIN
    arrow: bool = False  # drawn with an arrow head: from the host into the guest (shares)


@attrs.frozen
class Graph:
    title: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    notes: tuple[str, ...] = ()  # said under the title: the lab is not up, a partition


# --- what runs --------------------------------------------------------------------------------------


@attrs.frozen
class LiveNic:
    link: str = "up"  # "up" or "down"
    netem: Netem | None = None
    where: str | None = None  # where the netem runs: "host" or "guest"


@attrs.frozen
class LiveVm:
    state: str  # as `vmlaunch status` says it
    why: str | None = None  # why it is not plainly running
    ssh_port: int | None = None
    nics: tuple[LiveNic, ...] = ()  # by NIC index


@attrs.frozen
class LiveLab:
    up: bool  # any VM of the lab is up (its run dir has it)
    vms: Mapping[str, LiveVm] = attrs.field(factory=dict, hash=False)
    partition: tuple[tuple[str, ...], ...] = ()  # the groups `vmlaunch partition` cut the lab into


def observe(run_dir: RunDir, lab: LabSpec) -> LiveLab:
    """What the lab does now: each VM's state (as `status` reads it: the journal, the process, QMP),
    each NIC's link, and the netem and partition wire.json records. Reads only."""
    from vmlaunch.lab import wire
    from vmlaunch.runtime.control import status
    from vmlaunch.spec.netem import from_json

    faults = wire.load(run_dir)
    vms: dict[str, LiveVm] = {}
    for row in status(run_dir, [vm.name for vm in lab.vms], lab):
        nics = []
        for nic in row.nics:
            record = faults["nics"].get(wire.nic_key(row.name, nic.index), {})
            data = record.get("netem") if isinstance(record, dict) else None
            # a record outlives nothing: only a VM that is up has the netem its record says
            netem = from_json(data) if isinstance(data, dict) and row.pid is not None else None
            where = data.get("where") if netem is not None and isinstance(data, dict) else None
            nics.append(LiveNic(nic.link, netem, where if isinstance(where, str) else None))
        vms[row.name] = LiveVm(row.state, row.why, row.ssh_port, tuple(nics))
    groups = faults["partition"].get("groups")
    partition = tuple(tuple(str(vm) for vm in group) for group in groups
                      if isinstance(group, list)) if isinstance(groups, list) else ()
    up = any(vm.state != "stopped" for vm in vms.values())
    return LiveLab(up=up, vms=vms, partition=partition if up else ())


# --- the model --------------------------------------------------------------------------------------


def lab_graph(lab: LabSpec, live: LiveLab | None = None) -> Graph:
    """The picture of `lab`: as the spec describes it, or with `live`, as it runs."""
    nodes: list[Node] = []
    edges: list[Edge] = []
    net_ids = {net.name: f"net{index}" for index, net in enumerate(lab.networks)}
    share_ids: dict[Path, str] = {}
    pci_count = 0
    for index, vm in enumerate(lab.vms):
        vm_id = f"vm{index}"
        state = live.vms.get(vm.name, LiveVm("stopped")) if live is not None else None
        nodes.append(_vm_node(lab, vm, vm_id, state))
        for nic_index, nic in enumerate(vm.nics):
            lines = [f"nic{nic_index} {nic.mac}"]
            if nic.ip:
                lines.append(nic.ip)
            if nic.model is not NicModel.VIRTIO:
                lines.append(nic.model.value)
            mark = EdgeMark.PLAIN
            live_nic = state.nics[nic_index] if state is not None and nic_index < len(state.nics) else None
            if state is None and nic.netem is not None:
                lines.append(f"netem {_netem_text(nic.netem)}")
                mark = EdgeMark.NETEM
            elif live_nic is not None and live_nic.netem is not None:
                where = f" ({live_nic.where})" if live_nic.where else ""
                lines.append(f"netem {_netem_text(live_nic.netem)}{where}")
                mark = EdgeMark.NETEM
            if live_nic is not None and live_nic.link == "down":
                lines.append("link down")
                mark = EdgeMark.DOWN
            edges.append(Edge(vm_id, net_ids[nic.network], tuple(lines), mark))
        for share in vm.shares:
            if share.source not in share_ids:
                share_ids[share.source] = f"share{len(share_ids)}"
                nodes.append(Node(share_ids[share.source], Kind.SHARE, _shown_path(lab, share.source),
                                  ("host folder",)))
            edges.append(Edge(share_ids[share.source], vm_id,
                              (f"{share.target} ({'ro' if share.readonly else 'rw'})",), arrow=True))
        for device in vm.pci:
            pci_id = f"pci{pci_count}"
            pci_count += 1
            nodes.append(Node(pci_id, Kind.PCI, f"PCI {device.host}", (device.driver.value,)))
            edges.append(Edge(pci_id, vm_id, ("passed through",), arrow=True))
    for net in lab.networks:
        nodes.append(Node(net_ids[net.name], Kind.NETWORK, net.name, _network_lines(lab, net)))
    notes: list[str] = []
    if live is not None and not live.up:
        notes.append("the lab is not up: every VM is drawn stopped")
    if live is not None and live.partition:
        notes.append("partition: " + " | ".join(", ".join(group) for group in live.partition))
    return Graph(f"lab {lab.name}", tuple(nodes), tuple(edges), tuple(notes))


def _vm_node(lab: LabSpec, vm: VmSpec, vm_id: str, state: LiveVm | None) -> Node:
    lines = [f"{vm.cpus} vCPU{'s' if vm.cpus != 1 else ''}, {format_size(vm.memory_mib << 20)} memory"]
    if vm.image is not None:
        image = lab.image(vm.image)
        built = f"{image.catalog}{f' {image.version}' if image.version else ''}" if image.catalog else None
        lines.append(f"image {vm.image}" + (f" ({built})" if built else ""))
    elif vm.kernel is not None:
        lines.append(f"kernel {_shown_path(lab, vm.kernel)}")
    elif vm.disks:
        lines.append(f"disk {_shown_path(lab, vm.disks[0].file)}")
    if vm.append and vm.append != DEFAULT_APPEND:
        lines.append(f"append {_cut(clean(vm.append), APPEND_WIDTH)}")
    if vm.ssh:
        port = state.ssh_port if state is not None and state.ssh_port else None
        lines.append(f"ssh 127.0.0.1:{port} \u2192 :22" if port else "ssh: a free 127.0.0.1 port \u2192 :22")
    mark = Mark.SPEC
    if state is not None:
        mark = mark_of(state.state)
        lines.append(state.state)
        if state.why and mark is not Mark.RUNNING:
            why = last_line(state.why, WHY_WIDTH)
            if why:
                lines.append(why)
    return Node(vm_id, Kind.VM, vm.name, tuple(lines), mark)


def _network_lines(lab: LabSpec, net: Network) -> tuple[str, ...]:
    if isinstance(net, BridgeNetwork):
        lines = [f"bridge {net.bridge}"]
        if net.uplink is not None:
            lines.append(f"uplink {net.uplink}" + (f", VLAN {net.vlan}" if net.vlan is not None else ""))
        elif net.vlan is not None:
            lines.append(f"VLAN {net.vlan}")
        if net.subnet:
            lines.append(f"subnet {net.subnet}")
        if net.mtu:
            lines.append(f"MTU {net.mtu}")
        return tuple(lines)
    if isinstance(net, UserNetwork):
        return ("user (NAT to the host)", *(f"forward {rule}" for rule in net.forward))
    if isinstance(net, SocketNetwork):
        return (f"socket {net.group}:{net.port}", *((f"subnet {net.subnet}",) if net.subnet else ()))
    assert isinstance(net, TapNetwork)
    lines = [f"taps, wired by {_shown_path(lab, net.up_script)}"]
    if net.subnet:
        lines.append(f"subnet {net.subnet}")
    if net.mtu:
        lines.append(f"MTU {net.mtu}")
    return tuple(lines)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _netem_text(netem: Netem) -> str:
    return " ".join(f"{key} {value}" for key, value in figures(netem).items()) or "(nothing set)"


def _shown_path(lab: LabSpec, path: Path) -> str:
    """A file of the lab as the spec would name it: relative to the spec's folder when inside it (the
    picture of a lab is the same in every checkout), else absolute."""
    try:
        return str(path.relative_to(lab.file.parent))
    except ValueError:
        return str(path)


# --- escaping ---------------------------------------------------------------------------------------

# newlines, tabs and every other control or reordering character: a label is one line of text
_BLANKS = re.compile(r"\s+")


def clean(text: str) -> str:
    """`text` as one line of plain characters: no controls, no bidirectional overrides, no newlines."""
    return _BLANKS.sub(" ", printable(text.replace("\r", " "))).strip()


def dot_html(text: str) -> str:
    """`text` for inside a Graphviz HTML-like label (`label=<...>`): markup characters as entities, and
    each backslash doubled: Graphviz reads `\\N`, `\\G`, ... in a label as its own escapes (the node's
    name, the graph's), in an HTML-like label too, and `\\\\` as one backslash.

    Every text of the spec goes into such a label, never into a quoted dot string: there Graphviz
    2.43 reads the escapes of some attributes (tooltips) twice, so no one escaping is right."""
    return (clean(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;").replace("\\", "\\\\"))


# what a mermaid label may hold as it is; any other character becomes an entity code (`#35;`): quotes,
# brackets, pipes, `#` and `;` (entities), `<`, `>` and `&` (HTML), backticks (markdown), `%` (comments)
_MERMAID_PLAIN = re.compile(r"[\w .,:/+=@~!?*^$-]")


def mermaid_text(text: str) -> str:
    """`text` for inside a quoted mermaid label."""
    return "".join(char if _MERMAID_PLAIN.fullmatch(char) else f"#{ord(char)};" for char in clean(text))


# --- dot --------------------------------------------------------------------------------------------

FONT = "Helvetica,Arial,sans-serif"
# (fill, border) of each mark: green running, amber paused, grey stopped, red failed
MARK_COLOURS = {Mark.SPEC: ("#ffffff", "#1f2937"), Mark.RUNNING: ("#d1fae5", "#047857"),
                Mark.PAUSED: ("#fef3c7", "#b45309"), Mark.STOPPED: ("#e5e7eb", "#6b7280"),
                Mark.FAILED: ("#fee2e2", "#b91c1c")}
KIND_STYLES = {Kind.NETWORK: ("box", "rounded,filled", "#dbeafe", "#1d4ed8"),
               Kind.SHARE: ("folder", "filled", "#f3f4f6", "#4b5563"),
               Kind.PCI: ("component", "filled", "#ede9fe", "#6d28d9")}
# Each network's border and NIC edges in a colour of its own, so that a label is seen to be an edge's
# (none of them the red of a link that is down, or the orange of netem)
NETWORK_COLOURS = ("#1d4ed8", "#0f766e", "#7c3aed", "#be185d", "#0369a1", "#4d7c0f", "#a16207")
PLAIN_COLOUR = "#374151"  # shares and PCI devices
NETEM_COLOUR = "#c2410c"
DOWN_COLOUR = "#b91c1c"
EDGE_STYLES = {EdgeMark.PLAIN: "solid", EdgeMark.NETEM: "bold", EdgeMark.DOWN: "dashed"}


def _colours(graph: Graph) -> dict[str, str]:
    """The colour of each network node, by id."""
    networks = [node.id for node in graph.nodes if node.kind is Kind.NETWORK]
    return {node: NETWORK_COLOURS[index % len(NETWORK_COLOURS)] for index, node in enumerate(networks)}


def _edge_colours(edge: Edge, colours: Mapping[str, str]) -> tuple[str, str]:
    """(line, label) colours of an edge."""
    line = DOWN_COLOUR if edge.mark is EdgeMark.DOWN else colours.get(edge.head, PLAIN_COLOUR)
    label = {EdgeMark.NETEM: NETEM_COLOUR, EdgeMark.DOWN: DOWN_COLOUR}.get(edge.mark, line)
    return line, label


def to_dot(graph: Graph) -> str:
    """The graph as Graphviz's dot language: left to right, host folders and devices, VMs, networks."""
    title = f"<B>{dot_html(graph.title)}</B>" + "".join(f"<BR/>{dot_html(note)}" for note in graph.notes)
    out = [
        "digraph lab {",
        f'  graph [rankdir=LR, nodesep=0.35, ranksep=1.1, fontname="{FONT}", fontsize=14, labelloc=t, '
        f"label=<{title}>];",
        f'  node [fontname="{FONT}", fontsize=11, margin="0.15,0.08"];',
        f'  edge [fontname="{FONT}", fontsize=9, dir=none];',
    ]
    colours = _colours(graph)
    for node in graph.nodes:
        out.append(f"  {node.id} [{_dot_node_attrs(node, colours.get(node.id))}];")
    for edge in graph.edges:
        colour, text_colour = _edge_colours(edge, colours)
        label = "<BR/>".join(dot_html(line) for line in edge.lines)
        found = [f"label=<{label}>", f'color="{colour}"', f'fontcolor="{text_colour}"',
                 f"style={EDGE_STYLES[edge.mark]}", *(["dir=forward"] if edge.arrow else [])]
        out.append(f"  {edge.tail} -> {edge.head} [{', '.join(found)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _dot_node_attrs(node: Node, colour: str | None) -> str:
    label = f"<B>{dot_html(node.title)}</B>" + "".join(f"<BR/>{dot_html(line)}" for line in node.lines)
    if node.kind is Kind.VM:
        shape, style = "box", "filled"
        fill, border = MARK_COLOURS[node.mark]
        penwidth = "2" if node.mark is not Mark.SPEC else "1.2"
    else:
        shape, style, fill, border = KIND_STYLES[node.kind]
        border, penwidth = colour or border, "1.5" if colour else "1"
    found = [f"shape={shape}", f'style="{style}"', f'fillcolor="{fill}"', f'color="{border}"',
             f"penwidth={penwidth}", f"label=<{label}>"]
    return ", ".join(found)


# --- mermaid ----------------------------------------------------------------------------------------

_MERMAID_SHAPES = {Kind.VM: ('["', '"]'), Kind.NETWORK: ('(["', '"])'), Kind.SHARE: ('[/"', '"/]'),
                   Kind.PCI: ('{{"', '"}}')}


def to_mermaid(graph: Graph) -> str:
    """The graph as a mermaid flowchart (for a Markdown page, a forge's preview, mermaid-cli)."""
    out = ["---", f"title: {json.dumps(clean(graph.title))}", "---", "flowchart LR"]
    for node in graph.nodes:
        opening, closing = _MERMAID_SHAPES[node.kind]
        label = f"<b>{mermaid_text(node.title)}</b>" + "".join(f"<br>{mermaid_text(line)}"
                                                               for line in node.lines)
        out.append(f"  {node.id}{opening}{label}{closing}")
    if graph.notes:
        out.append(f'  notes["{"<br>".join(mermaid_text(note) for note in graph.notes)}"]')
    link_styles = []
    colours = _colours(graph)
    for index, edge in enumerate(graph.edges):
        label = "<br>".join(mermaid_text(line) for line in edge.lines)
        link = "-->" if edge.arrow else "---"
        out.append(f'  {edge.tail} {link}|"{label}"| {edge.head}')
        colour, text_colour = _edge_colours(edge, colours)
        width = "3px" if edge.mark is EdgeMark.NETEM else "1.5px"
        dashes = ",stroke-dasharray:5 5" if edge.mark is EdgeMark.DOWN else ""
        link_styles.append(f"  linkStyle {index} stroke:{colour},stroke-width:{width},"
                           f"color:{text_colour}{dashes}")
    out += link_styles
    used = {node.mark for node in graph.nodes if node.kind is Kind.VM}
    for mark in Mark:
        if mark in used:
            fill, border = MARK_COLOURS[mark]
            out.append(f"  classDef {mark.value} fill:{fill},stroke:{border},stroke-width:2px")
    for kind, (_, _, fill, border) in KIND_STYLES.items():
        out.append(f"  classDef {kind.value} fill:{fill},stroke:{border}")
    if graph.notes:
        out.append("  classDef note fill:#fff,stroke:#9ca3af,stroke-dasharray:3 3")
        out.append("  class notes note")
    for node in graph.nodes:
        out.append(f"  class {node.id} {node.mark.value if node.kind is Kind.VM else node.kind.value}")
    for node_id, colour in colours.items():
        out.append(f"  style {node_id} stroke:{colour},stroke-width:1.5px")
    return "\n".join(out) + "\n"


# --- drawing ----------------------------------------------------------------------------------------


def render(dot: str, format: str) -> bytes:
    """`dot` drawn by Graphviz as `format` (svg or png). HostError (exit 3) naming what to install when
    the graphviz Python package or Graphviz's `dot` program is missing."""
    try:
        import graphviz
    except ImportError:
        raise HostError(f"drawing {format.upper()} needs the graphviz Python package, which is missing",
                        "install it: pip install graphviz (or make setup); --format dot and --format "
                        "mermaid need nothing") from None
    try:
        # quiet: dot's own warnings (a font without a glyph) are not the user's to act on
        drawn: bytes = graphviz.pipe("dot", format, dot.encode(), quiet=True)
    except graphviz.ExecutableNotFound:
        raise HostError(f"drawing {format.upper()} needs Graphviz's `dot` program, which is not on PATH",
                        "install the Debian package graphviz: apt-get install graphviz; --format dot and "
                        "--format mermaid need nothing") from None
    except graphviz.CalledProcessError as exc:
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
        raise RuntimeFailure(f"Graphviz's dot failed (exit {exc.returncode}): {printable(said).strip()}",
                             "this is a bug in vmlaunch: --format dot shows what it was given") from None
    return stamp_svg(drawn, dot) if format == "svg" else drawn


# An SVG names the dot text it was drawn from by its digest, so that a picture of the same lab is seen
# to be one (`vmlaunch graph --out` leaves it as it is): Graphviz measures text with the fonts of the
# host, so another host draws the same lab a few points wider.
_DRAWN_FROM = re.compile(rb"^<!-- vmlaunch graph: drawn from dot text sha256:([0-9a-f]{64}) -->$", re.M)
_GRAPHVIZ_VERSION = re.compile(rb"^<!-- Generated by graphviz version [^\n]*\n(?: -->\n)?", re.M)


def stamp_svg(svg: bytes, dot: str) -> bytes:
    """`svg` without Graphviz's version comment (the host's, not the picture's), with a comment naming
    the dot text it was drawn from."""
    stamp = f"<!-- vmlaunch graph: drawn from dot text sha256:{hashlib.sha256(dot.encode()).hexdigest()} -->"
    return _GRAPHVIZ_VERSION.sub(b"", svg, count=1).replace(b"<svg ", stamp.encode() + b"\n<svg ", 1)


def drawn_from(svg: bytes) -> str | None:
    """The digest of the dot text `svg` was drawn from (`stamp_svg`), None for another SVG."""
    found = _DRAWN_FROM.search(svg)
    return found.group(1).decode() if found else None
