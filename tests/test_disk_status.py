"""`status --json` names each disk of a VM as the guest sees them (disk0 first: the image's overlay),
with its spec key and what it does when I/O fails: the names `vmlaunch fault` and `Vm.disk()` take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vmlaunch.cli import main


def test_status_lists_the_disks_in_the_guests_order(tmp_path: Path, run_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_text("""
[lab]
name = "dk"
[image.base]
file = "base.qcow2"
[vm.a]
memory = 256
image = "base"
[[vm.a.disk]]
file = "data.img"
size = "16M"
on_error = { write = "stop" }
[[vm.a.disk]]
file = "logs.qcow2"
size = "16M"
bus = "scsi"
[vm.b]
memory = 64
kernel = "k"
""")
    (tmp_path / "base.qcow2").write_bytes(b"")
    (tmp_path / "k").write_bytes(b"")
    assert main(["status", str(spec), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    disks = status["a"]["disks"]
    assert [disk["name"] for disk in disks] == ["disk0", "disk1", "disk2"]
    assert [disk["key"] for disk in disks] == ["vm.a.image", "vm.a.disk[0]", "vm.a.disk[1]"]
    assert disks[0]["file"] == str(tmp_path / ".vmlaunch" / "dk" / "a" / "disk.qcow2")
    assert disks[1]["on_error"] == {"read": "report", "write": "stop"}
    assert disks[2]["bus"] == "scsi" and disks[2]["format"] == "qcow2"
    assert status["b"]["disks"] == []
