"""tools/setup.sh and the make targets around it: the demo installs what the demo needs, the tests what
the tests need, the README and the Install page say which, and `make uninstall` says what it leaves."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import ROOT

SETUP = ROOT / "tools" / "setup.sh"


def setup(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SETUP), *args], capture_output=True, text=True, check=False, timeout=60,
                          env={**os.environ, **(env or {})})


def packages(purpose: str) -> tuple[list[str], str]:
    done = setup("--packages", purpose)
    assert done.returncode == 0, done.stderr
    debian, extras = done.stdout.splitlines()
    assert debian.startswith("debian: ") and extras.startswith("extras: ")
    return debian.removeprefix("debian: ").split(), extras.removeprefix("extras: ")


def make_n(target: str) -> list[str]:
    return subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60).stdout.splitlines()


def test_the_demo_installs_what_the_demo_needs() -> None:
    demo, demo_extras = packages("demo")
    test, test_extras = packages("test")
    assert demo == ["qemu-system-x86", "qemu-utils", "iproute2", "util-linux"]
    assert demo_extras == ""  # the package alone: no pytest, no libvirt binding to build
    assert set(demo) < set(test)
    for tests_only in ("gcc", "libvirt-dev", "libvirt-daemon", "openssh-server", "python3-dev"):
        assert tests_only in test and tests_only not in demo
    assert test_extras == "[test,hosts]"
    assert "tools/setup.sh --for demo" in make_n("demo")
    assert "tools/setup.sh" in make_n("setup")  # make test, lint, docs (CI): the tests' set-up


def test_the_readme_and_the_install_page_say_which() -> None:
    demo, _ = packages("demo")
    test, _ = packages("test")
    readme = (ROOT / "README.md").read_text()
    two_commands = readme[readme.index("## Two commands"):readme.index("<!-- transcript: demo -->")]
    said = " ".join(two_commands.split())
    for package in demo:
        assert package in said, package
    assert f"{len(test) - len(demo)} more packages" in said
    install = " ".join((ROOT / "docs" / "getting-started" / "install.md").read_text().split())
    for package in ("qemu-system-x86", "ovmf", "nftables", "openssh-server", "gcc", "libvirt-dev",
                    "pkg-config", "python3-dev", "graphviz"):
        assert f"`{package}`" in install, package
    assert "tools/setup.sh --leftovers" in install and "tools/setup.sh --packages demo" in " ".join(
        readme.split()) + install


def test_uninstall_says_what_it_leaves(tmp_path: Path) -> None:
    assert make_n("uninstall") == ["tools/install.sh --uninstall", "tools/setup.sh --leftovers"]
    env = {"VMLAUNCH_CACHE_DIR": str(tmp_path / "cache"), "VMLAUNCH_LOG_DIR": str(tmp_path / "logs"),
           "VMLAUNCH_RUN_DIR": str(tmp_path / "run")}
    done = setup("--leftovers", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "uninstall: left in place:"
    text = "\n".join(lines)
    assert "Debian packages" in text and "apt-get remove" in text
    assert "make clean" in text
    assert f"caches (images, kernels, downloads): {tmp_path}/cache: rm -rf {tmp_path}/cache" in text
    assert f"the logs of each VM's last run: {tmp_path}/logs: rm -rf {tmp_path}/logs" in text
    assert f"run files of labs still up: {tmp_path}/run: `vmlaunch ls`, then `vmlaunch down SPEC`" in text


def test_a_wrong_purpose_is_a_usage_error() -> None:
    for args in (("--for", "everything"), ("--packages", "x"), ("--bogus",)):
        done = setup(*args)
        assert done.returncode == 64 and done.stderr.startswith("usage: "), args
