"""Where vmlaunch keeps things: the cache (probed host facts, specs known valid) and run dirs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """VMLAUNCH_CACHE_DIR, else $XDG_CACHE_HOME/vmlaunch, else ~/.cache/vmlaunch."""
    if os.environ.get("VMLAUNCH_CACHE_DIR"):
        return Path(os.environ["VMLAUNCH_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vmlaunch"


def run_root() -> Path:
    """Where labs keep their run dirs: VMLAUNCH_RUN_DIR, /run/vmlaunch as root, else XDG_RUNTIME_DIR."""
    if os.environ.get("VMLAUNCH_RUN_DIR"):
        return Path(os.environ["VMLAUNCH_RUN_DIR"])
    if os.geteuid() == 0:
        return Path("/run/vmlaunch")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/vmlaunch-{os.geteuid()}"
    return Path(runtime) / "vmlaunch"
