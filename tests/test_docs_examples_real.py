"""The manual's Python examples that a lab can run, run as the page shows them: the "Simpler examples"
of docs/guides/test-rigs.md (a block marked `<!-- example: demo-lab -->`), as a test file of its own,
beside the demo lab (examples/lab.toml, the test guest) and a copy of it with a mistake on line 14,
under pytest in a private network namespace. Every other ```python block of the manual is parsed by
tests/test_docs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, netns_argv

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
PAGE = ROOT / "docs" / "guides" / "test-rigs.md"
MARKED = re.compile(r"^<!-- example: ([a-z0-9-]+) -->\n```python\n(.*?)^```$", re.M | re.S)


def marked_examples(page: Path) -> dict[str, str]:
    return dict(MARKED.findall(page.read_text()))


def test_the_simpler_examples_run_on_the_demo_lab(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    example = marked_examples(PAGE)["demo-lab"]
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "guest").symlink_to(test_guest)  # the demo lab's guest/vmlinuz, guest/initrd.gz
    demo = (ROOT / "examples" / "lab.toml").read_text()
    # the demo lab under a name of its own, and with the host's KSM left alone (tests run side by side)
    lab = demo.replace('name = "demo"', f'name = "ex{uuid.uuid4().hex[:6]}"', 1)
    (folder / "lab.toml").write_text(lab + "\n[lab.memory]\nksm = false\n")
    lines = demo.splitlines()
    lines[13] = 'forward = ["tcp:127.0.0.1:2222"]'  # line 14: a forward without its guest port
    (folder / "broken.toml").write_text("\n".join(lines) + "\n")
    (folder / "test_example.py").write_text(example)
    elsewhere = tmp_path / "elsewhere"  # the examples find their specs from any working directory
    elsewhere.mkdir()
    done = subprocess.run(netns_argv([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                      str(folder)]),
                          capture_output=True, text=True, timeout=600, check=False, cwd=elsewhere,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout, done.stdout
    assert not os.listdir(run_dir)  # every lab went down
