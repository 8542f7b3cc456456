"""`vmlaunch logs` of a guest that prints terminal escapes on its console (the real test guest under
TCG, writing through the command channel): a terminal gets the text without them, a pipe gets it as
the guest printed it."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from vmlaunch.api import Lab

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
# a cursor-position request (the terminal would answer it as typed input), a window title, a bell
ESCAPES = r"\033[6n\033]0;owned\007\033[2J"


def read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end closed
            return out
        if not chunk:
            return out
        out += chunk


def test_logs_leaves_a_guests_escapes_off_a_terminal(tmp_path: Path, run_dir: Path, test_guest: Path) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_text(f"""[lab]
name = "logs{uuid.uuid4().hex[:6]}"
[lab.memory]
ksm = false
[vm.a]
memory = "128M"
accel = "tcg"
kernel = "{test_guest}/vmlinuz"
initrd = "{test_guest}/initrd.gz"
""")
    with Lab(spec, wait_for="VMLAUNCH-GUEST-READY", timeout=300) as lab:
        lab.vm("a").succeed(f"printf '{ESCAPES}before-%s-after\\r\\n' marked >/dev/console")
        lab.vm("a").wait_for_console("before-marked-after", timeout=30)
        argv = [sys.executable, "-m", "vmlaunch", "logs", str(spec), "a"]
        piped = subprocess.run(argv, capture_output=True, timeout=60, check=True).stdout
        assert b"\x1b[6n\x1b]0;owned\x07\x1b[2Jbefore-marked-after\r" in piped  # as it is, into a pipe
        assert b"/ # \x1b[6n" in piped  # busybox's shell asks the terminal where its cursor is, too
        main, other = pty.openpty()
        try:
            done = subprocess.Popen(argv, stdout=other, stderr=subprocess.DEVNULL)
            os.close(other)
            shown = read_all(main)  # as it writes: a pty holds only a few KiB
        finally:
            os.close(main)
        assert done.wait(timeout=60) == 0
        assert b"before-marked-after\r\n" in shown and b"\r\r" not in shown  # the pty makes \n \r\n
        assert b"\x1b" not in shown and b"\x07" not in shown and b"owned" not in shown
