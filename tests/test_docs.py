"""The manual (docs/, mkdocs.yml) holds together: every page is in the nav and every nav entry is a
page, every relative link of the README and of the manual leads to a file, and, where MkDocs is
installed (the `docs` extra), `mkdocs build --strict` passes (no broken link or anchor, no absolute
link, no page left out of the nav)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"
# [text](target) outside code: the target up to a space or the closing parenthesis
HAVE_MKDOCS = all(importlib.util.find_spec(name) is not None for name in ("mkdocs", "material"))
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def nav_pages(entries: Any) -> Iterator[str]:
    """The page paths of mkdocs.yml's nav, however deep the sections nest."""
    if isinstance(entries, str):
        yield entries
    elif isinstance(entries, list):
        for entry in entries:
            yield from nav_pages(entry)
    elif isinstance(entries, dict):
        for value in entries.values():
            yield from nav_pages(value)


def config() -> dict[str, Any]:
    loaded = yaml.safe_load(CONFIG.read_text())
    assert isinstance(loaded, dict)
    return loaded


def prose(text: str) -> str:
    """The text without its fenced code blocks and inline code, where a link is no link."""
    text = re.sub(r"^( *)```.*?^\1```$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    """The targets of the links and images in the text, outside code."""
    return [match.group(1) or match.group(2) for match in LINK.finditer(prose(text))]


def slug(title: str) -> str:
    """A heading's anchor as MkDocs makes it (and a forge, for the plain titles the README has):
    punctuation dropped, lowercase, each run of spaces and hyphens one hyphen."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def anchors(text: str) -> set[str]:
    """The anchors of the headings outside fenced code; a heading's inline code counts as its text."""
    unfenced = re.sub(r"^( *)```.*?^\1```$", "", text, flags=re.M | re.S)
    return {slug(title.replace("`", "")) for title in re.findall(r"^#+ (.+)$", unfenced, re.M)}


def test_the_manual_is_built_with_mkdocs_material_into_site() -> None:
    settings = config()
    assert settings["theme"]["name"] == "material"
    assert settings["site_dir"] == "site"
    assert settings["validation"] == {"omitted_files": "warn", "absolute_links": "warn",
                                      "unrecognized_links": "warn", "anchors": "warn"}


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    nav = list(nav_pages(config()["nav"]))
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, "mkdocs.yml's nav and the pages under docs/ differ"
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    # the tutorials first, in the order a new user follows them; the generated reference pages
    assert nav[:4] == ["index.md", "getting-started/install.md", "getting-started/first-lab.md",
                       "getting-started/first-real-guest.md"]
    assert {"reference/spec-keys.md", "reference/commands.md"} <= set(nav)


def test_every_relative_link_of_the_readme_leads_to_a_file() -> None:
    """On a forge the README's links must work as they are: relative paths to files of the checkout
    (the manual's pages), and anchors of its own headings."""
    readme = (ROOT / "README.md").read_text()
    targets = [target for target in links(readme) if "://" not in target]
    assert any(target.startswith("docs/") for target in targets)
    for target in targets:
        path, _, anchor = target.partition("#")
        if path:
            assert not path.startswith("/"), f"README.md: {target} is an absolute link"
            assert (ROOT / path).is_file(), f"README.md: {target} leads to no file"
        elif anchor:
            assert anchor in anchors(readme), f"README.md: no heading for #{anchor}"


def test_every_relative_link_of_the_manual_leads_to_a_file() -> None:
    """Links between pages are relative links to the .md files, with an anchor the page has."""
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for target in links(text):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            where = f"{page.relative_to(ROOT)}: {target}"
            assert not path.startswith("/"), f"{where} is an absolute link"
            file = (page.parent / path).resolve() if path else page
            assert file.is_file(), f"{where} leads to no file"
            assert DOCS in file.parents, f"{where} leads out of docs/ (the site would not have it)"
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file.read_text()), f"{where}: no such heading"


def test_the_manual_names_its_sources_not_the_projects_seed_files() -> None:
    """"seed 001" or "seeds/003" means nothing to a reader: the manual names the document (its title)."""
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md", *(ROOT / "examples").glob("*.toml")]
    cited = [f"{page.relative_to(ROOT)}: {line.strip()}" for page in pages
             for line in page.read_text().splitlines() if re.search(r"\bseeds?[ /-]?0\d\d", line, re.I)]
    assert cited == []


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
SIGNATURE = re.compile(r"^([\w.]+)(\(.*\))$")


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a page."""
    return PYTHON_BLOCK.findall(page.read_text())


def test_every_python_example_of_the_manual_is_python() -> None:
    """Each ```python block parses: code, or a signature (`vmlaunch.Lab(spec, vms=(), *, ...)`), which
    must then be a valid parameter list. The examples of the test-rigs page that a lab runs are run
    too: tests/test_docs_examples_real.py."""
    import ast

    blocks = [(page, block) for page in sorted(DOCS.rglob("*.md")) for block in python_blocks(page)]
    assert blocks
    for page, block in blocks:
        signature = SIGNATURE.match(block.strip())
        name = signature.group(1).replace(".", "_") if signature else ""
        code = f"def {name}{signature.group(2)}: ...\n" if signature else block
        try:
            ast.parse(code)
        except SyntaxError as error:
            pytest.fail(f"{page.relative_to(ROOT)}: a python example does not parse: {error}\n{block}")


@pytest.mark.skipif(not HAVE_MKDOCS, reason="MkDocs and its Material theme (the docs extra): make docs")
def test_mkdocs_builds_the_manual_strictly(tmp_path: Path) -> None:
    """What `make docs` runs, into a temporary folder (about a second)."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--config-file", str(CONFIG), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "getting-started" / "first-lab" / "index.html").is_file()
