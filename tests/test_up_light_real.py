"""`up` within its launch budget (issue 43, bench/up.py), for real (TCG, the test guest): what `up` of a
plain lab loads and waits for. It loads no event loop, no schema and none of the resource kinds the
lab does not use; it does not wait for the lab manager's Python to start (the manager still runs, and
is nobody's child); it hashes neither the kernel nor its decompressed ELF once their digests stand
(tests/test_kernels.py has the rules)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vmlaunch.cli import main
from vmlaunch.lab.journal import Journal
from vmlaunch.lab.process import alive
from vmlaunch.layout.rundir import RunDir
from vmlaunch.resources.manager import ManagerRecord

pytestmark = [pytest.mark.qemu, pytest.mark.guest]

# Loaded by `up` only for a lab that uses them: an event loop (a VM whose guest never ran, stopped),
# the schema (a spec not validated before), and the classes of resources and features this lab lacks.
NOT_LOADED = {"asyncio", "jsonschema", "qemu.qmp", "vmlaunch.policy.placement", "vmlaunch.resources.bridge",
              "vmlaunch.resources.tap", "vmlaunch.resources.pci", "vmlaunch.resources.hugepages",
              "vmlaunch.resources.netem", "vmlaunch.resources.script", "vmlaunch.saved.snapshot",
              "vmlaunch.guests.shareaccess", "vmlaunch.guests.images"}


def test_up_of_a_plain_lab_loads_only_what_it_uses(tmp_path: Path, run_dir: Path, test_guest: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "light.toml"
    spec.write_text(f'[lab]\nname = "light"\n[network.out]\ntype = "user"\n'
                    f'[vm.a]\nmemory = 96\naccel = "tcg"\nkernel = "{test_guest}/vmlinuz"\n'
                    f'initrd = "{test_guest}/initrd.gz"\n[[vm.a.nic]]\nnetwork = "out"\n')
    assert main(["up", str(spec)]) == 0  # the caches warm: the spec validated, the kernel decompressed
    assert main(["down", str(spec), "--timeout", "0"]) == 0
    try:
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "vmlaunch", "up", str(spec)],
                              capture_output=True, text=True, check=False, env=dict(os.environ))
        assert done.returncode == 0, done.stderr
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
        assert not imported & NOT_LOADED
        entry = Journal.load(RunDir.of(run_dir, "light")).entry("manager", "lab")
        assert entry is not None and isinstance(entry.record, ManagerRecord) and entry.record.running()
        pid = entry.record.pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"vmlaunch.manager.managerd" in cmdline and b"--detached" in cmdline
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent != os.getpid()  # nobody's child: no caller of `up` is left with a zombie
    finally:
        assert main(["down", str(spec), "--timeout", "0"]) == 0
    assert not alive(pid)
