"""`vmlaunch run` of a Debian VM (the image tools/build_debian.py makes, booted by cloud-init) from its
warm template: made once (its boot to its ready point, with cloud-init's runcmd done), then each run
wakes a copy with what the boot left (the runcmd's file), its own clock, and leaves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.qemu, pytest.mark.guest, pytest.mark.debian]
ROOT = Path(__file__).resolve().parent.parent
VMLAUNCH = [sys.executable, "-m", "vmlaunch"]


def test_a_debian_vm_from_its_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "build_debian.py")], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"building the Debian image failed:\n{done.stdout}\n{done.stderr}")
    manifest = json.loads((ROOT / "examples" / "debian" / "bookworm.json").read_text())
    root = Path(tempfile.mkdtemp(prefix="vl-"))
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(root))
    spec = tmp_path / "lab.toml"
    spec.write_text(f"""[lab]
name = "debrun"
[image.debian]
file = "{ROOT / 'examples' / 'debian' / 'bookworm.qcow2'}"
sha512 = "{manifest['sha512']}"
[network.out]
type = "user"
[vm.d]
memory = "512M"
image = "debian"
template = true
[vm.d.cloud_init]
user = "dev"
runcmd = ["touch /var/tmp/made-at-boot"]
[[vm.d.nic]]
network = "out"
""")
    try:
        first = subprocess.run([*VMLAUNCH, "run", str(spec), "d", "--", "true"], capture_output=True,
                               text=True, timeout=600, check=False)
        assert first.returncode == 0 and "making the template of d" in first.stderr, first.stderr
        for _ in range(2):
            done = subprocess.run([*VMLAUNCH, "run", str(spec), "d", "--", "sh", "-c",
                                   "cat /etc/debian_version; ls /var/tmp/made-at-boot; date +%s; "
                                   "touch /var/tmp/made-by-a-run; exit 3"],
                                  capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 3, done.stderr
            assert "making the template" not in done.stderr
            version, made, now = done.stdout.split("\n")[:3]
            assert version.startswith("12.") and made == "/var/tmp/made-at-boot"
            assert abs(int(now) - time.time()) < 10
        check = subprocess.run([*VMLAUNCH, "run", str(spec), "d", "--", "test ! -e /var/tmp/made-by-a-run"],
                               capture_output=True, text=True, timeout=120, check=False)
        assert check.returncode == 0, check.stderr  # what a run did is gone with it
        assert not [entry for entry in os.listdir(root) if not entry.startswith(".")]
        assert not os.listdir(root / ".throwaway")
    finally:
        subprocess.run(["pkill", "-9", "-f", str(root)], check=False)
