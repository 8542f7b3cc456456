"""The README as a user meets it: set-up first, commands that work as shown, transcripts that are the
real output (tools/readme_transcripts.py)."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tools import build_debian, readme_transcripts
from tools.readme_transcripts import difference, normalise, transcripts

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

README = (ROOT / "README.md").read_text()


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


def section(title: str, text: str = README) -> str:
    """The text under the heading `title` (any level), up to the next heading of that level or above."""
    every = headings(text)
    index = next((i for i, (_, name, _) in enumerate(every) if name == title), None)
    assert index is not None, f"the README has no section {title!r}"
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
    # the demo lab by hand after them, still before the command reference
    assert first_block.start() < README.index("<!-- transcript: demo -->") < README.index("## Commands")


def test_running_part_of_the_tests_is_shown() -> None:
    """`make test PYTEST_ARGS=...` as the README shows it hands those words to pytest (make -n: what
    make would run, nothing run)."""
    import subprocess

    for where in ("Two commands", "Development"):
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
    (its own argument parser takes them), the file they write is the one the spec names."""
    images = section("Images")
    assert "tools/build_debian.py" in section("Real guests")
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
    assert '"sha512": sha512,' in inspect.getsource(build_debian.manifest_for)  # what the README says


def test_normalise_keeps_what_a_run_cannot_change() -> None:
    one = ("$ vmlaunch up x.toml\n"
           "vmlaunch: a, b: tcg (KVM not usable: no /dev/kvm; TCG emulates (slower))\n"
           "vmlaunch: a: waiting for 'READY', 5 s: [ 1.0] booting\n"
           "vmlaunch: b: ready ('READY' on the console)\n"
           "vmlaunch: a: ready ('READY' on the console)\n"
           "a: running (pid 24163, tcg)\n"
           "VM               STATE         PID ACCEL  BALLOON   UPTIME    MAX  TARGET   FREE\n"
           "a                running     24163 tcg       256M       8s   256M  manual   177M\n"
           "memory: the guests hold 512M, 14M of it merged, of a budget of 18.8G; lab manager: none\n"
           "ksm: on while the lab runs: 263 pages every 20 ms; KSM saves the host 7M (1817 pages sharing)\n")
    other = ("$ vmlaunch up x.toml\n"
             "vmlaunch: a, b: kvm (KVM ran a test guest to 64-bit mode in 0.05 s)\n"
             "vmlaunch: a: ready ('READY' on the console)\n"
             "vmlaunch: b: ready ('READY' on the console)\n"
             "a: running (pid 7, kvm)\n"
             "VM               STATE         PID ACCEL  BALLOON   UPTIME    MAX  TARGET   FREE\n"
             "a                running         7 kvm       256M     112s   256M  manual    12M\n"
             "memory: the guests hold 512M of a budget of 3.1G; lab manager: none\n"
             "ksm: on while the lab runs: 263 pages every 20 ms; KSM off on the host\n")
    assert difference(one, other) == ""
    assert normalise(one)[1] == "vmlaunch: a, b: ACCEL (WHY)"
    # what a run does not change is compared: the balloon, a column, a line, the reason being told
    assert difference(one, other.replace("256M     112s", "128M     112s"))
    assert difference(one, other.replace("  TARGET   FREE", ""))
    assert difference(one, other.replace("lab manager: none", "lab manager: running"))
    assert difference(one, other.replace(" (KVM ran a test guest to 64-bit mode in 0.05 s)", ""))
    assert difference(one, "".join(other.splitlines(keepends=True)[:-1]))


def test_transcripts_are_marked() -> None:
    assert set(transcripts(README)) == set(readme_transcripts.RECIPES)
    demo = transcripts(README)["demo"]
    assert demo.startswith("$ vmlaunch up examples/lab.toml --wait-for VMLAUNCH-GUEST-READY\n")
    assert readme_transcripts.replaced(README, "demo", demo) == README


@pytest.mark.qemu
@pytest.mark.guest
@pytest.mark.skipif(os.geteuid() != 0, reason="the demo lab's bridge needs root, in a network namespace")
def test_the_demo_transcript_is_the_real_output(test_guest: Path) -> None:
    """The demo lab up, its status and down, as the README shows them (~10 s under TCG)."""
    real = readme_transcripts.real_output("demo")
    diff = difference(transcripts(README)["demo"], real)
    assert not diff, ("the README's demo transcript is not what the commands print; "
                      f"tools/readme_transcripts.py --write writes it anew:\n{diff}\n\nreal output:\n{real}")
