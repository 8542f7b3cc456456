"""Start compiled VMs for real and ask each over QMP how it is; run under `unshare -n`.

Usage: python qemu_driver.py JOB.json  ->  prints a JSON result per VM.
JOB: {"taps": [[ifname, multi_queue], ...], "vms": {name: {"argv": [...], "qmp": path}},
      "wait_for": null | text, "serial": {name: path}, "timeout": seconds, "qmp": [[cmd, args], ...]}
The taps stand in for what `vmlaunch up` creates; QEMU starts with -S unless wait_for is given.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while not path.exists():
        if proc.poll() is not None:
            stderr = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"QEMU exited with {proc.returncode}: {stderr}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear")
        time.sleep(0.02)


def connect(path: str, deadline: float) -> Any:
    """The socket file appears a moment before QEMU listens on it."""
    from qemu.qmp.legacy import QEMUMonitorProtocol

    while True:
        qmp = QEMUMonitorProtocol(path)
        try:
            qmp.connect()
            return qmp
        except Exception:
            qmp.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run(job: dict[str, Any]) -> dict[str, Any]:
    for ifname, multi_queue in job["taps"]:
        extra = ["multi_queue"] if multi_queue else []
        subprocess.run(["ip", "tuntap", "add", ifname, "mode", "tap", *extra], check=True)
    results: dict[str, Any] = {}
    procs = {}
    deadline = time.monotonic() + job.get("timeout", 60)
    for name, vm in job["vms"].items():
        argv = vm["argv"] + ([] if job.get("wait_for") else ["-S"])
        procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE)
    try:
        for name, vm in job["vms"].items():
            proc = procs[name]
            try:
                wait_for_file(Path(vm["qmp"]), proc, deadline)
                if job.get("wait_for"):
                    serial = Path(vm["serial"])
                    while job["wait_for"] not in (serial.read_text(errors="replace")
                                                  if serial.exists() else ""):
                        if proc.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError("no ready marker:\n" + serial.read_text())
                        time.sleep(0.1)
                qmp = connect(vm["qmp"], deadline)
                replies = {"query-status": qmp.cmd("query-status")}
                for command, args in job.get("qmp", []):
                    replies[command] = qmp.cmd(command, **args)
                # QEMU may close the socket before its reply to quit arrives, or before close().
                with contextlib.suppress(EOFError):
                    qmp.cmd("quit")
                with contextlib.suppress(EOFError):
                    qmp.close()
                proc.wait(timeout=10)
                results[name] = {"ok": True, "replies": replies, "exit": proc.returncode}
            except Exception:  # reported to the test, which fails with it
                if proc.poll() is None:
                    proc.kill()
                stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                results[name] = {"ok": False, "error": traceback.format_exc(),
                                 "qemu_stderr": stderr, "exit": proc.wait()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


if __name__ == "__main__":
    print(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))
