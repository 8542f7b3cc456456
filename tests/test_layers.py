"""The package's layers (vmlaunch/__init__.py's docstring and ARCHITECTURE.md write them down): a module
imports only from its own room and the rooms below it, and no two modules import each other, even
through others. Read from the source with `ast`, every import counted: at the top, inside a function,
under `TYPE_CHECKING`."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vmlaunch"

# Lowest first. A module may import from its own room and any room above it in this list, never
# from one below. Rooms on one line are side by side: neither imports the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core", "errors"),
    ("layout",),
    ("qemu",),
    ("spec",),
    ("policy",),
    ("host",),
    ("guests",),
    ("resources",),
    ("compile",),
    ("lab",),
    ("rig", "manager"),
    ("saved",),
    ("runtime",),
    ("doctor", "export"),
    ("multihost",),
    ("api",),
    ("cli", "pytest_plugin"),
    ("__init__", "__main__"),
)


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name (without the leading `vmlaunch.`; the package itself is `__init__`) -> its file."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: Mapping[str, Path]) -> Iterator[tuple[str, int]]:
    """The package's modules that `name` imports, with the line of each import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "vmlaunch" or (node.module or "").startswith("vmlaunch."):
                target = node.module.removeprefix("vmlaunch").lstrip(".") if node.module else ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                yield (sub if sub in known else target or "__init__"), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vmlaunch" or alias.name.startswith("vmlaunch."):
                    yield alias.name.removeprefix("vmlaunch").lstrip(".") or "__init__", node.lineno


def room_of(module: str) -> str:
    return module.split(".")[0]


def rank(layers: tuple[tuple[str, ...], ...] = LAYERS) -> dict[str, int]:
    return {room: index for index, rooms in enumerate(layers) for room in rooms}


def upward_imports(package: Path = PACKAGE, layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Each import from a room into one above it or beside it, as `file:line: a imports b`."""
    known, ranks, found = module_names(package), rank(layers), []
    for name, path in sorted(known.items()):
        here = room_of(name)
        for target, line in imports_of(name, path, known):
            there = room_of(target)
            if there != here and ranks[there] >= ranks[here]:
                found.append(f"{path.relative_to(package.parent)}:{line}: {here} imports {target} "
                             f"({there} is {'beside' if ranks[there] == ranks[here] else 'above'} it)")
    return found


def cycles(package: Path = PACKAGE) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    known = module_names(package)
    graph = {name: sorted({target for target, _ in imports_of(name, path, known) if target != name})
             for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(groups)


def test_every_room_has_its_layer() -> None:
    rooms = {room_of(name) for name in module_names()}
    assert rooms == set(rank()), "a room of the package is missing from LAYERS, or LAYERS names a gone one"


def test_no_room_imports_from_above() -> None:
    assert upward_imports() == []


def test_no_import_cycle() -> None:
    assert cycles() == []


def test_the_layers_are_written_down_where_a_reader_looks() -> None:
    """ARCHITECTURE.md lists the rooms in the same order, lowest first."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    positions = [text.find(f"`{room}/`") if room not in ("errors", "api", "pytest_plugin", "__init__",
                                                         "__main__") else text.find(f"`{room}")
                 for rooms in LAYERS for room in rooms]
    assert -1 not in positions, "ARCHITECTURE.md does not name every room"


def plant(tmp_path: Path, files: Mapping[str, str]) -> Path:
    package = tmp_path / "vmlaunch"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


@pytest.mark.parametrize("where", ["from vmlaunch.cli import main\n",
                                   "def f() -> None:\n    from vmlaunch import cli\n",
                                   "import vmlaunch.cli\n"])
def test_a_planted_upward_import_is_caught(tmp_path: Path, where: str) -> None:
    package = plant(tmp_path, {"__init__.py": "", "errors.py": "", "cli/__init__.py": "",
                               "resources/__init__.py": "", "resources/bridge.py": where})
    assert [line.split(": ", 1)[1] for line in upward_imports(package)] == [
        "resources imports cli (cli is above it)"]


def test_a_planted_cycle_is_caught(tmp_path: Path) -> None:
    package = plant(tmp_path, {"__init__.py": "", "host/__init__.py": "",
                               "host/a.py": "from vmlaunch.host import b\n",
                               "host/b.py": "def f() -> None:\n    from vmlaunch.host.a import x\n"})
    assert cycles(package) == [["host.a", "host.b"]]
