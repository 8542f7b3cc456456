"""The README and the manual (docs/) as a user meets them: set-up first, commands that work as shown,
specs that parse, transcripts that are the real output (tools/readme_transcripts.py)."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tools import build_debian, readme_transcripts
from tools.readme_transcripts import difference, normalise, transcripts

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Every page a user reads: the README, then the manual's pages, by their path in the checkout.
PAGES = {page.relative_to(ROOT).as_posix(): page.read_text() for page in readme_transcripts.pages()}
README = PAGES["README.md"]


def headings(text: str = README) -> list[tuple[int, str, int]]:
    """Each heading outside code blocks: its level, title and the offset where its section starts."""
    found, fenced, offset = [], False, 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#+) (.+)\n", line)):
            found.append((len(match.group(1)), match.group(2), offset))
        offset += len(line)
    return found


def section(title: str, text: str | None = None) -> str:
    """The text under the heading `title` (any level), up to the next heading of that level or above;
    in `text`, or else in the one page (the README or a page of the manual) that has that heading."""
    if text is None:
        having = [page for page, words in PAGES.items()
                  if any(name == title for _, name, _ in headings(words))]
        assert len(having) == 1, f"{len(having)} pages have a section {title!r}: {having}"
        text = PAGES[having[0]]
    every = headings(text)
    index = next((i for i, (_, name, _) in enumerate(every) if name == title), None)
    assert index is not None, f"no section {title!r}"
    level, _, start = every[index]
    end = next((offset for depth, _, offset in every[index + 1:] if depth <= level), len(text))
    return text[start:end]


def blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of `language` in `text` (indented ones too), without their fences."""
    found = re.finditer(rf"^( *)```{language}\n(.*?)^\1```$", text, re.M | re.S)
    return ["\n".join(line[len(match.group(1)):] for line in match.group(2).splitlines())
            for match in found]


def test_the_two_commands_come_first() -> None:
    """A fresh clone has no test guest: the first thing to run is the set-up, not `vmlaunch up`."""
    assert [title for level, title, _ in headings() if level == 2][0] == "Two commands"
    first_block = re.search(r"^```(\w*)\n(.*?)^```$", README, re.M | re.S)
    assert first_block and first_block.group(1) == "sh"
    assert [line.split()[:2] for line in first_block.group(2).splitlines() if line.startswith("make")] == [
        ["make", "demo"], ["make", "test"]]
    # the demo lab by hand after them, still before the list of what it does
    assert first_block.start() < README.index("<!-- transcript: demo -->") < README.index("## What it does")


def test_running_part_of_the_tests_is_shown() -> None:
    """`make test PYTEST_ARGS=...` as the README and the manual's development page show it hands those
    words to pytest (make -n: what make would run, nothing run)."""
    import subprocess

    for where in ("Two commands", "Running part of the tests"):
        shown = re.findall(r"make test (PYTEST_ARGS=(?:\"[^\"]*\"|[^\s`]+))", section(where))
        assert shown, f"{where} shows no `make test PYTEST_ARGS=...`"
        for setting in shown:
            words = shlex.split(shlex.split(setting)[0].split("=", 1)[1])
            for word in words:
                assert not word.startswith("tests/") or (ROOT / word).exists(), word
            # --no-print-directory: under `make test` itself, the inner make says where it is
            recipe = subprocess.run(["make", "--no-print-directory", "-n", "test", *shlex.split(setting)],
                                    cwd=ROOT, check=True, capture_output=True, text=True,
                                    timeout=60).stdout.splitlines()[-1]
            pytest_words = shlex.split(recipe)
            assert pytest_words[:3] == [".venv/bin/python", "-m", "pytest"], recipe
            assert pytest_words[-len(words):] == words, recipe


def test_images_without_the_internet_are_shown() -> None:
    """An offline host builds its image with tools/build_debian.py: the commands shown are the tool's
    (its own argument parser takes them), the file they write is the one the spec names. The manual
    shows it in its guide to images, and points to it from the first real guest's tutorial."""
    images = section("Images")
    assert "tools/build_debian.py" in section("A first real guest")
    commands = [line.split("#")[0].split() for block in blocks(images, "sh") for line in block.splitlines()
                if line.startswith("tools/build_debian.py")]
    assert len(commands) >= 2
    for words in commands:
        build_debian.parse_args(words[1:])  # exits on an option it does not have
    default = build_debian.parse_args([]).out / f"{build_debian.NAME}.qcow2"
    written = default.relative_to(ROOT)
    assert f"writes {written} and {build_debian.NAME}.json" in images
    specs = [tomllib.loads(block) for block in blocks(images, "toml")]
    files = [image["file"] for spec in specs for image in spec.get("image", {}).values() if "file" in image]
    assert str(written) in files
    assert '"sha512": sha512,' in inspect.getsource(build_debian.manifest_for)  # what the page says


def test_normalise_keeps_what_a_run_cannot_change() -> None:
    one = ("$ vmlaunch up x.toml\n"
           "vmlaunch: a, b: tcg (KVM not usable: no /dev/kvm; TCG emulates (slower))\n"
           "vmlaunch: a: waiting for 'READY', 5 s: [ 1.0] booting\n"
           "vmlaunch: b: ready ('READY' on the console)\n"
           "vmlaunch: a: ready ('READY' on the console)\n"
           "a: running (pid 24163, tcg)\n"
           "VM               STATE         PID ACCEL  BALLOON   UPTIME    MAX  TARGET   FREE\n"
           "a                running     24163 tcg       256M       8s   256M  manual   177M\n"
           "memory: the guests hold 512M, 14M of it merged, of a budget of 18.8G; lab manager: running "
           "(pid 24160)\n"
           "ksm: on while the lab runs: 263 pages every 20 ms; KSM saves the host 7M (1817 pages sharing)\n")
    other = ("$ vmlaunch up x.toml\n"
             "vmlaunch: a, b: kvm (KVM ran a test guest to 64-bit mode in 0.05 s)\n"
             "vmlaunch: a: ready ('READY' on the console)\n"
             "vmlaunch: b: ready ('READY' on the console)\n"
             "a: running (pid 7, kvm)\n"
             "VM               STATE         PID ACCEL  BALLOON   UPTIME    MAX  TARGET   FREE\n"
             "a                running         7 kvm       256M     112s   256M  manual    12M\n"
             "memory: the guests hold 512M of a budget of 3.1G; lab manager: running (pid 5)\n"
             "ksm: on while the lab runs: 263 pages every 20 ms; KSM off on the host\n")
    assert difference(one, other) == ""
    assert normalise(one)[1] == "vmlaunch: a, b: ACCEL (WHY)"
    # what a run does not change is compared: the balloon, a column, a line, the reason being told
    assert difference(one, other.replace("256M     112s", "128M     112s"))
    assert difference(one, other.replace("  TARGET   FREE", ""))
    assert difference(one, other.replace("lab manager: running (pid 5)", "lab manager: gone"))
    assert difference(one, other.replace(" (KVM ran a test guest to 64-bit mode in 0.05 s)", ""))
    assert difference(one, "".join(other.splitlines(keepends=True)[:-1]))


def test_transcripts_are_marked() -> None:
    """Each transcript a page shows has a recipe, each recipe is shown, and every copy of one
    transcript is the same text (tools/readme_transcripts.py --write writes them all)."""
    shown = {page: named for page, text in PAGES.items() if (named := transcripts(text))}
    assert set(shown) == {page.relative_to(ROOT).as_posix() for page in readme_transcripts.shown()}
    assert {name for named in shown.values() for name in named} == set(readme_transcripts.RECIPES)
    demo = transcripts(README)["demo"]
    assert demo.startswith("$ vmlaunch up examples/lab.toml --wait-for VMLAUNCH-GUEST-READY\n")
    assert "demo" in shown["docs/getting-started/first-lab.md"]
    for page, named in shown.items():
        for name, block in named.items():
            assert readme_transcripts.replaced(PAGES[page], name, block) == PAGES[page]
            same = transcripts(README).get(name, block)
            assert block == same, f"{page}: transcript {name} differs from the README's"


@pytest.mark.qemu
@pytest.mark.guest
@pytest.mark.skipif(os.geteuid() != 0, reason="the demo lab's bridge needs root, in a network namespace")
def test_the_demo_transcript_is_the_real_output(test_guest: Path) -> None:
    """The demo lab up, its status and down, as the README and the manual show them (~10 s under
    TCG): each copy is compared with one real run."""
    real = readme_transcripts.real_output("demo")
    for page, named in readme_transcripts.shown().items():
        if "demo" not in named:
            continue
        where = page.relative_to(ROOT).as_posix()
        diff = difference(named["demo"], real, where)
        assert not diff, (f"{where}'s demo transcript is not what the commands print; "
                          "tools/readme_transcripts.py --write writes it anew:\n"
                          f"{diff}\n\nreal output:\n{real}")


def test_every_spec_shown_parses() -> None:
    """A TOML block on any page is TOML a user can paste: tomllib reads it."""
    count = 0
    for page, text in PAGES.items():
        for number, block in enumerate(blocks(text, "toml")):
            try:
                tomllib.loads(block)
            except tomllib.TOMLDecodeError as exc:
                pytest.fail(f"{page}: TOML block {number + 1} does not parse: {exc}\n{block}")
            count += 1
    assert count >= 10


def _part_of(shown: Any, example: Any) -> bool:
    """`shown` is `example`, or a part of it: tables may leave keys out, every value given is the same."""
    if isinstance(shown, dict) and isinstance(example, dict):
        return all(key in example and _part_of(value, example[key]) for key, value in shown.items())
    return bool(shown == example)


def test_the_examples_shown_are_the_files() -> None:
    """A spec shown with the lab name of a file in examples/ is that file, or a part of it left as it
    is there; the demo lab of the README and of the first lab's tutorial is examples/lab.toml whole."""
    examples = {}
    for path in sorted((ROOT / "examples").glob("*.toml")):
        spec = tomllib.loads(path.read_text())
        examples[spec["lab"]["name"]] = (path, spec)
    matched = set()
    for page, text in PAGES.items():
        for block in blocks(text, "toml"):
            shown = tomllib.loads(block)
            name = shown.get("lab", {}).get("name")
            if name in examples:
                path, spec = examples[name]
                assert _part_of(shown, spec), f"{page}: the spec shown is not {path.relative_to(ROOT)}"
                matched.add(page)
    demo = tomllib.loads((ROOT / "examples" / "lab.toml").read_text())
    for page in ("README.md", "docs/getting-started/first-lab.md"):
        assert page in matched
        assert demo in [tomllib.loads(block) for block in blocks(PAGES[page], "toml")], page


def _commands(text: str) -> list[list[str]]:
    """The `vmlaunch` commands a page shows, as words after `vmlaunch`: from the lines of its sh blocks
    and the `$ ` lines of its console blocks, each command of a pipeline or list on its own, up to a
    redirection; comments left out."""
    lines = [line for block in blocks(text, "sh") for line in block.splitlines()]
    lines += [line[2:] for block in blocks(text, "console") for line in block.splitlines()
              if line.startswith("$ ")]
    found: list[list[str]] = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word and set(word) <= set("|&;<>()"):  # an operator: the command so far ends
                if command[:1] == ["vmlaunch"]:
                    found.append(command[1:])
                command = [] if word in ("|", "||", "&&", ";", "&") else ["-"]  # after > or <: a file
            elif command != ["-"]:
                command.append(word)
    return found


def test_the_vmlaunch_commands_shown_exist() -> None:
    """Each `vmlaunch ...` line shown is a command line vmlaunch's own parser takes: the command, its
    options and their values (a `...` in a line stands for more words, and is left out)."""
    from vmlaunch.cli import build_parser
    from vmlaunch.errors import UsageError

    count = 0
    for page, text in PAGES.items():
        for command in _commands(text):
            words = [word for word in command if word != "..."]
            try:
                build_parser().parse_args(words)
            except UsageError as exc:
                pytest.fail(f"{page}: `vmlaunch {shlex.join(command)}`: {exc}")
            except SystemExit as exc:  # --help, --version
                assert exc.code == 0, f"{page}: `vmlaunch {shlex.join(command)}`"
            count += 1
    assert count >= 30
