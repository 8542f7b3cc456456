"""Where vmlaunch keeps things, and the package's lazy public names."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import vmlaunch
from tests.conftest import ROOT
from vmlaunch.layout import dirs


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path / "c"))
    assert dirs.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("VMLAUNCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dirs.cache_dir() == tmp_path / "x" / "vmlaunch"


def test_run_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(tmp_path))
    assert dirs.run_root() == tmp_path
    monkeypatch.delenv("VMLAUNCH_RUN_DIR")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert dirs.run_root() == Path("/run/vmlaunch")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert dirs.run_root() == Path("/run/user/1000/vmlaunch")


def test_public_names_are_lazy() -> None:
    from vmlaunch.api import Lab

    assert vmlaunch.Lab is Lab
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        vmlaunch.Nope  # noqa: B018


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
def test_a_labs_files_beside_its_spec_are_not_the_checkouts() -> None:
    """`make demo` brings up examples/lab.toml in the checkout: its .vmlaunch/ is ignored, not untracked."""
    from vmlaunch.layout.labdir import TOP

    for path in (f"examples/{TOP}/demo/alpha/disk.qcow2", f"tests/{TOP}/rig/ssh/id_ed25519"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
        assert done.returncode == 0, f"{path} is not ignored by .gitignore"
