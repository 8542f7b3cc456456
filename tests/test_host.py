"""Host probing that can run here without the real KVM: what a probe leaves behind."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from vmlaunch.host import facts as host


def test_a_hung_probe_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KVM that hangs guests hangs the probe: it is killed at the timeout, with whatever a wrapper
    script started (seen: wrapped probes spinning a host CPU for an hour)."""
    marker = uuid.uuid4().hex
    wrapper = tmp_path / "qemu-wrapper"
    sleeper = f"python3 -c 'import time; time.sleep(1000)' {marker}"
    wrapper.write_text(f"#!/bin/sh\n{sleeper} &\n{sleeper} &\nwait\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(host, "KVM_PROBE_TIMEOUT", 0.5)
    monkeypatch.setattr(os.path, "exists", lambda path: True)
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    status = host.probe_kvm(str(wrapper))
    assert not status.usable and "did not reach 64-bit mode" in status.reason
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker.encode() in _cmdline(p)]
    assert left == []


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_without_a_usable_cache_the_host_is_probed_and_nothing_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    qemu = host.QemuInfo(binary="/q", version=(7, 2, 0), devices=frozenset(), io_uring=False, img="/i")
    monkeypatch.setattr(host, "usable_cache_dir", lambda: None)
    monkeypatch.setattr(host, "_probe_key", lambda binary: {"binary": binary})

    def probe_qemu(binary: str) -> host.QemuInfo:
        calls.append("qemu")
        return qemu

    def probe_kvm(binary: str) -> host.KvmStatus:
        calls.append("kvm")
        return host.KvmStatus(False, "x")

    monkeypatch.setattr(host, "probe_qemu", probe_qemu)
    monkeypatch.setattr(host, "probe_kvm", probe_kvm)
    assert host._cached_probe("/q") == (qemu, host.KvmStatus(False, "x"))
    assert host._cached_probe("/q")[0] == qemu
    assert calls == ["qemu", "kvm", "qemu", "kvm"]  # probed each time: there is nowhere to keep it


def test_no_dev_kvm_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if p == "/dev/kvm" else real_exists(p))
    status = host.probe_kvm("/usr/bin/qemu-system-x86_64")
    assert not status.usable and "no /dev/kvm" in status.reason
