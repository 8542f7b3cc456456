"""`vmlaunch graph`: the picture of a lab as a pure model (dot and mermaid text), read back by Graphviz,
drawn as SVG and PNG, escaped against a spec written to break it, and the command (formats, --out,
errors, --live on a lab that is not up). tests/test_graph_real.py draws a lab that runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EXAMPLES, write_spec
from vmlaunch.cli import main
from vmlaunch.export.graph import (
    DOWN_COLOUR,
    MARK_COLOURS,
    EdgeMark,
    Graph,
    Kind,
    LiveLab,
    LiveNic,
    LiveVm,
    Mark,
    dot_html,
    drawn_from,
    lab_graph,
    mark_of,
    mermaid_text,
    render,
    to_dot,
    to_mermaid,
)
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import Netem

DEMO = EXAMPLES / "lab.toml"
TEN = Path(__file__).parent / "data" / "graph" / "ten.toml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Text a spec may hold that would break dot or mermaid, or add to them, were it not escaped: quotes
# and backslashes (dot strings, escStrings), HTML markup and entities (HTML-like labels, mermaid),
# brackets, pipes and `#...;` (mermaid shapes, edge labels, entity codes), a `%%` comment, a newline.
NASTY = """
[lab]
name = "nasty"
[network.lan]
bridge = 'b"]|<i>\\N;#x'
[network.wire]
type = "tap"
up_script = '/x/"];evil[y]<b>|.sh'
[vm.a]
memory = 128
kernel = 'k"\\"];\\G<B>x</B>&amp;#quot;'
append = 'console=ttyS0 "q" \\N \\" <x> ]] |pipe| %% end'
[[vm.a.nic]]
network = "lan"
[[vm.a.nic]]
network = "wire"
[[vm.a.share]]
source = "src\\"]\\n}; evil -> x; { a[\\"b"
target = '/t"] --> evil["x</b><script>|y|#35;%%'
"""
NASTY_TEXT = ('b"]|<i>\\N;#x', 'append console=ttyS0 "q" \\N \\" <x> ]] |pipe| %% end',
              '/x/"];evil[y]<b>|.sh', 'k"\\"];\\G<B>x</B>&amp;#quot;',
              '/t"] --> evil["x</b><script>|y|#35;%%')


def graphviz_json(dot: str) -> dict[str, Any]:
    """What Graphviz itself reads from `dot` (its JSON output); the test fails when it cannot read it."""
    if shutil.which("dot") is None:
        pytest.fail("Graphviz's dot is missing: run `make setup` (the Debian package graphviz)")
    done = subprocess.run(["dot", "-Tjson"], input=dot, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and not done.stderr, done.stderr
    read = json.loads(done.stdout)
    assert isinstance(read, dict)
    return read


def graphviz_reads(graph: Graph) -> dict[str, Any]:
    """Graphviz reads the dot text of `graph` back as exactly its nodes and edges, with the labels."""
    read = graphviz_json(to_dot(graph))
    nodes = {node["name"]: node for node in read.get("objects", [])}
    assert sorted(nodes) == sorted(node.id for node in graph.nodes)
    ids = {node["_gvid"]: node["name"] for node in read.get("objects", [])}
    edges = [(ids[edge["tail"]], ids[edge["head"]]) for edge in read.get("edges", [])]
    assert sorted(edges) == sorted((edge.tail, edge.head) for edge in graph.edges)
    return nodes


# One statement of our mermaid a line: anything else on a line means the text broke out of its label.
_LABEL = r'(?:<b>|</b>|<br>|[\w .,:/+=@~!?*^$-]|#\d+;)*'
MERMAID_LINE = re.compile("|".join([
    r"---", r'title: "[\w -]*"', r"flowchart LR",
    rf'  (?:vm|net|share|pci)\d+'
    rf'(?:\["{_LABEL}"\]|\(\["{_LABEL}"\]\)|\[/"{_LABEL}"/\]|\{{\{{"{_LABEL}"\}}\}})',
    rf'  notes\["{_LABEL}"\]',
    rf'  (?:vm|net|share|pci)\d+ (?:---|-->)\|"{_LABEL}"\| (?:vm|net)\d+',
    r"  linkStyle \d+ [\w:#.,\- ]+", r"  classDef \w+ [\w:#.,\- ]+", r"  class \w+ \w+",
    r"  style net\d+ [\w:#.,\- ]+",
]))


def mermaid_reads(graph: Graph) -> list[str]:
    """Each line of the mermaid text of `graph` is one of our statements; as many nodes and edges."""
    lines = to_mermaid(graph).splitlines()
    for line in lines:
        assert MERMAID_LINE.fullmatch(line), line
    nodes = [line for line in lines if re.match(r"  (vm|net|share|pci)\d+[\[({]", line)]
    edges = [line for line in lines if re.match(r"  \w+ (---|-->)\|", line)]
    assert len(nodes) == len(graph.nodes) and len(edges) == len(graph.edges)
    return lines


# --- the model ----------------------------------------------------------------------------------------


def test_the_demo_lab() -> None:
    lab = load_lab(DEMO)
    graph = lab_graph(lab)
    assert graph.title == "lab demo" and graph.notes == ()
    assert [(node.kind, node.title) for node in graph.nodes] == [
        (Kind.VM, "alpha"), (Kind.VM, "beta"), (Kind.NETWORK, "lan"), (Kind.NETWORK, "out")]
    alpha = graph.nodes[0]
    assert alpha.lines == ("1 vCPU, 256M memory", "kernel guest/vmlinuz")  # relative: same in any checkout
    assert graph.nodes[2].lines == ("bridge vlbr-demo",)
    assert graph.nodes[3].lines == ("user (NAT to the host)", "forward tcp:127.0.0.1:2222-:22")
    macs = {(vm.name, index): nic.mac for vm in lab.vms for index, nic in enumerate(vm.nics)}
    assert [(edge.tail, edge.head, edge.lines) for edge in graph.edges] == [
        ("vm0", "net0", (f"nic0 {macs['alpha', 0]}",)), ("vm0", "net1", (f"nic1 {macs['alpha', 1]}",)),
        ("vm1", "net0", ("nic0 00:16:3e:00:01:02",))]
    nodes = graphviz_reads(graph)
    assert nodes["vm0"]["label"] == "<B>alpha</B><BR/>1 vCPU, 256M memory<BR/>kernel guest/vmlinuz"
    mermaid = mermaid_reads(graph)
    assert '  vm1 ---|"nic0 00:16:3e:00:01:02"| net0' in mermaid
    assert to_dot(lab_graph(load_lab(DEMO))) == to_dot(graph)  # the same lab, the same bytes


def test_ten_vms_on_three_networks() -> None:
    lab = load_lab(TEN)
    graph = lab_graph(lab)
    by_title = {node.title: node for node in graph.nodes}
    assert len([node for node in graph.nodes if node.kind is Kind.VM]) == 10
    assert by_title["lan"].lines == ("bridge vlbr-ten", "uplink eth1, VLAN 42", "subnet 10.20.0.0/24",
                                     "MTU 9000")
    assert by_title["out"].lines == ("user (NAT to the host)", "forward tcp:127.0.0.1:8080-:80",
                                     "forward udp::5353-:53")
    assert by_title["mesh"].lines[0].startswith("socket 239.") and by_title["mesh"].lines[1] == \
        "subnet 10.30.0.0/24"
    assert by_title["gw"].lines == ("2 vCPUs, 1G memory", "image debian",
                                    "ssh: a free 127.0.0.1 port \u2192 :22")
    # one node per host folder, shared into two VMs
    assert by_title["src"].kind is Kind.SHARE and by_title["data"].kind is Kind.SHARE
    shares = {(edge.tail, edge.head): edge.lines for edge in graph.edges if edge.tail.startswith("share")}
    ids = {node.title: node.id for node in graph.nodes}
    assert shares == {(ids["src"], ids["gw"]): ("/srv/src (ro)",), (ids["src"], ids["w1"]): ("/src (ro)",),
                      (ids["data"], ids["db"]): ("/var/lib/data (rw)",)}
    assert by_title["PCI 0000:15:00.0"].lines == ("vfio-pci",)
    assert (ids["PCI 0000:15:00.0"], ids["gpu"]) in [(edge.tail, edge.head) for edge in graph.edges]
    db = next(edge for edge in graph.edges if edge.tail == ids["db"])
    assert db.mark is EdgeMark.NETEM and db.lines[-1] == "netem delay 20ms jitter 5ms loss 1%"
    gpu = next(edge for edge in graph.edges if edge.tail == ids["gpu"] and edge.head == ids["lan"])
    assert gpu.lines[1:] == ("10.20.0.19/24", "e1000")
    graphviz_reads(graph)
    mermaid_reads(graph)


def live_ten() -> LiveLab:
    """The ten-VM lab up, by hand: one VM in each state, a link down, netem set at run time."""
    lab = load_lab(TEN)
    vms = {vm.name: LiveVm("running", nics=tuple(LiveNic() for _ in vm.nics)) for vm in lab.vms}
    vms["gw"] = LiveVm("running", ssh_port=40022, nics=(LiveNic(), LiveNic("down"), LiveNic()))
    vms["db"] = LiveVm("running", nics=(LiveNic(netem=Netem(delay_ms=100, loss=5.0), where="host"),))
    vms["w1"] = LiveVm("paused", why="by its user (`vmlaunch pause`, or QMP stop)", nics=(LiveNic(),))
    vms["w2"] = LiveVm("guest-panicked", why="Kernel panic - not syncing: VFS: Unable to mount root fs",
                       nics=(LiveNic(),))
    vms["w3"] = LiveVm("crashed", nics=(LiveNic(),))
    vms["w4"] = LiveVm("stopped")
    return LiveLab(up=True, vms=vms, partition=(("w5", "w6"),))


def test_live_marks_states_links_and_netem() -> None:
    lab = load_lab(TEN)
    graph = lab_graph(lab, live_ten())
    vms = {node.title: node for node in graph.nodes if node.kind is Kind.VM}
    assert {name: node.mark for name, node in vms.items() if node.mark is not Mark.RUNNING} == {
        "w1": Mark.PAUSED, "w2": Mark.FAILED, "w3": Mark.FAILED, "w4": Mark.STOPPED}
    assert vms["gw"].lines[2:] == ("ssh 127.0.0.1:40022 \u2192 :22", "running")
    assert vms["w2"].lines[-2:] == ("guest-panicked", "Kernel panic - not syncing: VFS: Unable to...")  # cut
    gw_out = next(edge for edge in graph.edges if edge.tail == "vm0" and edge.lines[0].startswith("nic1"))
    assert gw_out.mark is EdgeMark.DOWN and gw_out.lines[-1] == "link down"
    db = next(edge for edge in graph.edges if edge.tail == "vm1")
    # what runs now, not what the spec set at up
    assert db.mark is EdgeMark.NETEM and db.lines[-1] == "netem delay 100ms loss 5% (host)"
    assert graph.notes == ("partition: w5, w6",)
    nodes = graphviz_reads(graph)
    assert nodes["vm0"]["fillcolor"] == MARK_COLOURS[Mark.RUNNING][0]
    assert nodes["vm4"]["fillcolor"] == MARK_COLOURS[Mark.FAILED][0]  # w2
    dot = to_dot(graph)
    assert f'color="{DOWN_COLOUR}", fontcolor="{DOWN_COLOUR}", style=dashed' in dot
    mermaid = mermaid_reads(graph)
    assert {"  class vm3 paused", "  class vm4 failed", "  class vm6 stopped"} <= set(mermaid)
    assert any(line.startswith("  linkStyle 1 ") and "stroke-dasharray" in line for line in mermaid)


def test_live_on_a_lab_not_up_draws_every_vm_stopped() -> None:
    graph = lab_graph(load_lab(DEMO), LiveLab(up=False))
    assert {node.mark for node in graph.nodes if node.kind is Kind.VM} == {Mark.STOPPED}
    assert graph.notes == ("the lab is not up: every VM is drawn stopped",)
    graphviz_reads(graph)
    assert '  notes["the lab is not up: every VM is drawn stopped"]' in mermaid_reads(graph)


@pytest.mark.parametrize(("state", "mark"), [
    ("running", Mark.RUNNING), ("paused", Mark.PAUSED), ("starting", Mark.PAUSED), ("suspended", Mark.PAUSED),
    ("stopped", Mark.STOPPED), ("off", Mark.STOPPED), ("shutdown", Mark.STOPPED), ("crashed", Mark.FAILED),
    ("guest-panicked", Mark.FAILED), ("unresponsive", Mark.FAILED), ("internal-error", Mark.FAILED)])
def test_each_state_of_status_has_a_mark(state: str, mark: Mark) -> None:
    assert mark_of(state) is mark


# --- escaping -----------------------------------------------------------------------------------------


def test_escapers() -> None:
    assert dot_html('a"<b>&amp;\'\n\x1b[31m') == "a&quot;&lt;b&gt;&amp;amp;&#39;"
    assert dot_html("\\N \\G\\") == "\\\\N \\\\G\\\\"  # never Graphviz's escapes
    assert mermaid_text('x"] --> y[|#35;%%`<b>') == \
        "x#34;#93; --#62; y#91;#124;#35;35#59;#37;#37;#96;#60;b#62;"


def test_a_spec_written_to_break_the_output_stays_in_its_labels(tmp_path: Path) -> None:
    lab = load_lab(write_spec(tmp_path, NASTY))
    graph = lab_graph(lab)
    assert len(graph.nodes) == 4 and len(graph.edges) == 3  # a; lan, wire; the share
    nodes = graphviz_reads(graph)  # Graphviz reads exactly our nodes and edges, and these labels:
    assert nodes["net0"]["label"] == "<B>lan</B><BR/>bridge b&quot;]|&lt;i&gt;\\\\N;#x"  # \\ shows \
    assert lab.vms[0].append == 'console=ttyS0 "q" \\N \\" <x> ]] |pipe| %% end'
    assert graph.nodes[0].lines[-1] == 'append console=ttyS0 "q" \\N \\" <x> ]] |pipe| %% end'
    assert "\n" not in nodes["share0"]["label"]
    svg = render(to_dot(graph), "svg").decode()
    text = "".join(ET.fromstring(svg).itertext())  # the SVG is well-formed XML, the text shown as given
    for nasty in NASTY_TEXT:
        assert nasty in text or nasty.removeprefix(str(tmp_path) + "/") in text, nasty
    assert "<script" not in svg and "<b>" not in svg and "<B>" not in svg
    mermaid_reads(graph)  # every line one of our statements: no text broke out of its label


# --- drawing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [DEMO, TEN], ids=["demo", "ten"])
def test_svg_and_png_of_both_labs(spec: Path, tmp_path: Path) -> None:
    graph = lab_graph(load_lab(spec))
    svg = render(to_dot(graph), "svg")
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    shown = "".join(root.itertext())
    for node in graph.nodes:
        assert node.title in shown
    png = render(to_dot(graph), "png")
    assert png.startswith(PNG_MAGIC)
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert 300 < width < 3000 and 100 < height < 3000
    # kept for a look: VMLAUNCH_GRAPH_KEEP=DIR
    keep = os.environ.get("VMLAUNCH_GRAPH_KEEP")
    if keep:
        (Path(keep) / f"{spec.stem}.png").write_bytes(png)
        live = live_ten() if spec == TEN else LiveLab(up=False)
        live_png = render(to_dot(lab_graph(load_lab(spec), live)), "png")
        (Path(keep) / f"{spec.stem}-live.png").write_bytes(live_png)


def test_a_picture_of_the_same_lab_is_the_same_bytes() -> None:
    """Drawn twice, the same; no Graphviz version (the host's); the dot text it shows named by digest."""
    dot = to_dot(lab_graph(load_lab(DEMO)))
    first, second = render(dot, "svg"), render(dot, "svg")
    assert first == second and b"Generated by graphviz" not in first
    assert drawn_from(first) == hashlib.sha256(dot.encode()).hexdigest()
    assert drawn_from(render(to_dot(lab_graph(load_lab(TEN))), "svg")) != drawn_from(first)
    ET.fromstring(first)  # still one SVG document


def test_the_manuals_picture_of_the_demo_lab_is_current() -> None:
    """`make docs` draws docs/assets/demo-lab.svg: it is of today's demo lab, so the build leaves it."""
    shown = (Path(__file__).parent.parent / "docs" / "assets" / "demo-lab.svg").read_bytes()
    assert drawn_from(shown) == hashlib.sha256(to_dot(lab_graph(load_lab(DEMO))).encode()).hexdigest(), \
        "the demo lab changed: make docs draws its picture anew"


# --- the command --------------------------------------------------------------------------------------


def run(capfdbinary: pytest.CaptureFixture[bytes], *args: str) -> tuple[int, bytes, str]:
    code = main(["graph", *args])
    out, err = capfdbinary.readouterr()
    return code, out, err.decode()


@pytest.mark.parametrize(("format", "starts"), [
    ("svg", b"<?xml"), ("png", PNG_MAGIC), ("dot", b"digraph lab {\n"),
    ("mermaid", b"---\ntitle: \"lab demo\"")])
def test_each_format_to_standard_output(capfdbinary: pytest.CaptureFixture[bytes], format: str,
                                        starts: bytes) -> None:
    code, out, err = run(capfdbinary, str(DEMO), "--format", format)
    assert code == 0 and out.startswith(starts) and err == ""


def test_svg_is_the_default(capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    code, out, _ = run(capfdbinary, str(DEMO))
    assert code == 0 and b"<svg" in out and b"alpha" in out


def test_png_is_not_written_to_a_terminal(capfdbinary: pytest.CaptureFixture[bytes],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, err = run(capfdbinary, str(DEMO), "--format", "png")
    assert code == 64 and out == b""
    assert "a PNG is not for a terminal" in err and "--out lab.png" in err


@pytest.mark.parametrize(("name", "starts"), [
    ("lab.svg", b"<?xml"), ("lab.PNG", PNG_MAGIC), ("lab.dot", b"digraph"), ("lab.gv", b"digraph"),
    ("lab.mmd", b"---"), ("lab.mermaid", b"---")])
def test_the_format_follows_the_suffix_of_out(capfdbinary: pytest.CaptureFixture[bytes], tmp_path: Path,
                                              name: str, starts: bytes) -> None:
    out = tmp_path / name
    out.write_text("an older picture")
    code, printed, err = run(capfdbinary, str(DEMO), "--out", str(out))
    assert code == 0 and printed == b"" and f"wrote {out}" in err
    assert out.read_bytes().startswith(starts)
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]  # replaced whole, no temp file left


def test_out_leaves_a_picture_of_the_same_lab_as_it_is(capfdbinary: pytest.CaptureFixture[bytes],
                                                       tmp_path: Path) -> None:
    out = tmp_path / "lab.svg"
    assert run(capfdbinary, str(DEMO), "--out", str(out))[0] == 0
    # as another host's fonts draw it: a few points wider, the same lab
    wider = re.sub(rb'<svg width="\d+pt"', b'<svg width="999pt"', out.read_bytes())
    out.write_bytes(wider)
    code, _, err = run(capfdbinary, str(DEMO), "--out", str(out))
    assert code == 0 and f"{out} already shows this lab: left as it is" in err
    assert out.read_bytes() == wider
    code, _, err = run(capfdbinary, str(TEN), "--out", str(out))  # another lab: drawn anew
    assert code == 0 and f"wrote {out}" in err and drawn_from(out.read_bytes()) != drawn_from(wider)


@pytest.mark.parametrize(("args", "said"), [
    (("--out", "lab.txt"), "cannot tell the format from .txt"),
    (("--out", "lab"), "cannot tell the format from a name without a suffix"),
    (("--format", "png", "--out", "lab.svg"), "--out lab.svg is named as svg, not png"),
    (("--format", "jpeg"), "invalid choice: 'jpeg'"),
])
def test_formats_it_cannot_tell(capfdbinary: pytest.CaptureFixture[bytes], tmp_path: Path,
                                args: tuple[str, ...], said: str) -> None:
    os.chdir(tmp_path)
    code, _, err = run(capfdbinary, str(DEMO), *args)
    assert code == 64 and said in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_out_in_a_folder_it_cannot_write(capfdbinary: pytest.CaptureFixture[bytes], tmp_path: Path) -> None:
    code, _, err = run(capfdbinary, str(DEMO), "--out", str(tmp_path / "no" / "lab.dot"))
    assert code == 4 and f"cannot write {tmp_path}/no/lab.dot" in err


def test_a_spec_with_errors_is_exit_2_with_its_lines(capfdbinary: pytest.CaptureFixture[bytes],
                                                     tmp_path: Path) -> None:
    spec = write_spec(tmp_path, '[lab]\nname = "bad"\n[vm.a]\nmemory = 128\nkernel = "k"\n'
                      '[[vm.a.nic]]\nnetwork = "nowhere"\n')
    code, out, err = run(capfdbinary, str(spec), "--format", "dot")
    assert code == 2 and out == b""
    assert f"{spec}:7: vm.a.nic[0].network:" in err and "nowhere" in err and "Traceback" not in err


def test_without_graphvizs_dot_program(capfdbinary: pytest.CaptureFixture[bytes], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on it
    for format in ("svg", "png"):
        code, out, err = run(capfdbinary, str(DEMO), "--format", format, "--out", str(tmp_path / "x"))
        assert code == 3 and out == b"", err
        assert "Graphviz's `dot` program" in err and "the Debian package graphviz" in err
    assert not (tmp_path / "x").exists()
    for format in ("dot", "mermaid"):  # our own text: nothing needed
        assert run(capfdbinary, str(DEMO), "--format", format)[0] == 0


def test_without_the_graphviz_python_package(capfdbinary: pytest.CaptureFixture[bytes],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "graphviz", None)  # import graphviz: ImportError
    code, _, err = run(capfdbinary, str(DEMO), "--format", "svg")
    assert code == 3 and "the graphviz Python package" in err and "pip install graphviz" in err
    for format in ("dot", "mermaid"):
        assert run(capfdbinary, str(DEMO), "--format", format)[0] == 0


def test_the_command_escapes_what_the_spec_says(capfdbinary: pytest.CaptureFixture[bytes],
                                                tmp_path: Path) -> None:
    spec = write_spec(tmp_path, NASTY)
    code, dot, err = run(capfdbinary, str(spec), "--format", "dot")
    assert code == 0, err
    read = graphviz_json(dot.decode())
    assert sorted(node["name"] for node in read["objects"]) == ["net0", "net1", "share0", "vm0"]
    assert len(read["edges"]) == 3
    code, mermaid, _ = run(capfdbinary, str(spec), "--format", "mermaid")
    assert code == 0 and mermaid.decode() == to_mermaid(lab_graph(load_lab(spec)))
    for line in mermaid.decode().splitlines():
        assert MERMAID_LINE.fullmatch(line), line


def test_live_on_a_lab_that_is_not_up(capfdbinary: pytest.CaptureFixture[bytes], run_dir: Path) -> None:
    code, out, err = run(capfdbinary, str(DEMO), "--live", "--format", "mermaid")
    assert code == 0
    assert "vmlaunch: warning: lab demo is not up: every VM is drawn stopped" in err
    assert b"  class vm0 stopped\n  class vm1 stopped\n" in out and b"notes[" in out
    assert list(run_dir.iterdir()) == []  # looked, made nothing
