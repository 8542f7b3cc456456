"""Shared fixtures: a fake Host for pure tests, the real host and test guest for QEMU tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vmlaunch.host.facts import Host, KvmStatus, QemuInfo
from vmlaunch.host.memory import KsmSupport

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GUEST_DIR = EXAMPLES / "guest"

FAKE_DEVICES = frozenset({
    "virtio-blk-pci", "virtio-scsi-pci", "scsi-hd", "ide-hd", "ide-cd", "virtio-net-pci", "e1000",
    "e1000e", "rtl8139", "virtio-balloon-pci", "vfio-pci", "pvpanic", "virtio-serial-pci", "virtserialport",
    "VGA", "virtio-vga", "vmgenid",
})


def fake_host(**changes: Any) -> Host:
    """A host with QEMU 7.2 at /usr/bin, io_uring, no usable KVM, no vhost-net, KSM with its advisor
    (as root): like this machine."""
    qemu = QemuInfo(binary="/usr/bin/qemu-system-x86_64", version=(7, 2, 0), devices=FAKE_DEVICES,
                    io_uring=True, img="/usr/bin/qemu-img")
    host = Host(qemu=qemu, kvm=KvmStatus(False, "fake: no KVM"), vhost_net=False, cpus=2,
                memory_mib=24000, run_root=Path("/run/vmlaunch"),
                ksm=KsmSupport(writable=True, advisor=True))
    return host if not changes else _evolve(host, changes)


def _evolve(host: Host, changes: dict[str, Any]) -> Host:
    import attrs

    qemu_changes = {k: v for k, v in changes.items() if k in attrs.fields_dict(QemuInfo)}
    host_changes = {k: v for k, v in changes.items() if k not in qemu_changes}
    return attrs.evolve(host, qemu=attrs.evolve(host.qemu, **qemu_changes), **host_changes)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never read or write the user's cache or logs; the host probe is shared by the session."""
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("VMLAUNCH_LOG_DIR", str(tmp_path_factory.getbasetemp() / "logs"))


# The host-wide settings vmlaunch may change (KSM, the 2 MiB hugepage pool), in the order they are put
# back: KSM's advisor first (it resets pages_to_scan), `run` last.
HOST_SETTINGS = tuple(Path("/sys/kernel/mm/ksm") / name
                      for name in ("advisor_mode", "pages_to_scan", "sleep_millisecs", "run")) + (
    Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),)


def _host_settings() -> dict[Path, str]:
    values = {}
    for path in HOST_SETTINGS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        values[path] = text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text
    return values


def _nft_tables() -> set[str]:
    """vmlaunch's nftables tables (a lab's partition, `vmlaunch-LAB`) in the host's network namespace."""
    if shutil.which("nft") is None:
        return set()
    done = subprocess.run(["nft", "list", "tables", "bridge"], capture_output=True, text=True, check=False)
    return {words[2] for line in done.stdout.splitlines()
            if len(words := line.split()) == 3 and words[2].startswith("vmlaunch-")}


def _put_back(before: dict[Path, str], tables: set[str]) -> str:
    """The host's settings put back as `before` had them, and the nftables tables made since removed:
    what was so, in words ("" when nothing)."""
    changed = {path: (value, now) for path, value in before.items()
               if (now := _host_settings().get(path)) != value}
    for path, (value, _) in changed.items():
        with contextlib.suppress(OSError):
            path.write_text(value + "\n")
    left = sorted(_nft_tables() - tables)
    for table in left:
        subprocess.run(["nft", "delete", "table", "bridge", table], capture_output=True, check=False)
    return ", ".join([f"{path} {value} -> {now}" for path, (value, now) in changed.items()]
                     + [f"nftables table bridge {table} left" for table in left])


# On several workers (pytest-xdist: `-n 2`), a module's labs may run while another worker's module
# starts and ends, so each module holds this lock: shared, or alone for a module marked `host_wide`
# (one that asserts the host's KSM or hugepage settings, which any lab may change while it runs). Only
# a module that holds it alone can say that it left the host as it found it; the rest is checked for
# the whole run, at its end (pytest_sessionfinish). Separate runs of the suite on one host share it too.
HOST_LOCK = Path(tempfile.gettempdir()) / f"vmlaunch-tests-{os.getuid()}.lock"
HOST_GATE = HOST_LOCK.with_suffix(".gate")
WORKER = os.environ.get("PYTEST_XDIST_WORKER")


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """A lock file of the shared temporary folder, never opened through a symlink planted at its name."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "r+") as file:
        yield file


@pytest.fixture(scope="module", autouse=True)
def _host_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test module leaves the real host's KSM and hugepage settings, and its nftables, as it found
    them ("never a leftover"); one that does not fails, naming what it changed, and the settings are
    put back (a table left is removed)."""
    import fcntl

    alone = request.node.get_closest_marker("host_wide") is not None
    with _opened(HOST_LOCK) as lock, _opened(HOST_GATE) as gate:
        # the gate: a module that waits to be alone holds it, so that no module starts beside the ones
        # that run until it had its turn (flock has no queue: a worker going from one module to the next
        # could otherwise take the shared lock again before the waiting one is woken)
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        before = _host_settings()
        tables = _nft_tables()
        yield
        if WORKER and not alone:
            return
        if changed := _put_back(before, tables):
            pytest.fail(f"{request.module.__name__} left host settings changed: {changed}")


HOST_BEFORE = pytest.StashKey[tuple[dict[Path, str], set[str]]]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not WORKER:
        session.stash[HOST_BEFORE] = (_host_settings(), _nft_tables())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The whole run (on any number of workers) left the host as it found it, or fails."""
    if WORKER or HOST_BEFORE not in session.stash:
        return
    if changed := _put_back(*session.stash[HOST_BEFORE]):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the tests left host settings changed: {changed}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The fixtures that boot a guest (or need what boots one), and the marks a test using one must carry
# (any one of them), so that `-m "not guest"` and `make test-fast` select what they say. `guest_files`
# is for a test that reads the test guest's kernel or initramfs and boots nothing.
MARKS_OF_FIXTURES = {
    "test_guest": ("guest", "guest_files"),
    "vmlaunch_lab": ("guest",),
    "vmlaunch_fresh": ("guest",),
    "libvirt_hosts": ("libvirt",),
}
UNMARKED = pytest.StashKey[str]()


def unmarked(item: pytest.Item) -> list[str]:
    """What a test lacks: `FIXTURE needs the mark MARK` for each fixture of MARKS_OF_FIXTURES it uses
    (itself or through another fixture) without one of its marks."""
    used = getattr(item, "fixturenames", ())
    return [f"{fixture} needs the mark {' or '.join(marks)}" for fixture, marks in MARKS_OF_FIXTURES.items()
            if fixture in used and not any(item.get_closest_marker(mark) for mark in marks)]


# On several workers, the modules that take longest start first (each worker takes the next module when
# it is almost done with its own, so a long one started last would leave the other worker idle): the
# `host_wide` ones before all (they wait for no module to end), then these, by their wall time in a
# run on one worker (docs/development/index.md), then the rest in file order. `-p random_order`
# shuffles after this.
LONGEST_FIRST = (
    "test_guests", "test_catalog_guest", "test_e2e", "test_multihost_real", "test_run_real",
    "test_run_debian_real", "test_rig_real", "test_manager_real", "test_diskfault_real", "test_fuzz",
    "test_boot_real", "test_runtime", "test_fork_real", "test_wire_real", "test_snapshot",
    "test_guest_resources", "test_screen_real", "test_completion", "test_export_libvirt_real",
    "test_placement_real", "test_init", "test_sourcemap",
)


def start_rank(item: pytest.Item) -> int:
    """Where `item`'s module starts on several workers: 0 first."""
    if item.get_closest_marker("host_wide"):
        return 0
    name = item.path.stem
    return 1 + LONGEST_FIRST.index(name) if name in LONGEST_FIRST else 1 + len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that boots a guest without the mark that says so fails, naming what it lacks, before
    any of its fixtures runs (so the marks stay true: `-m` selects by them). On several workers, the
    longest modules go first (LONGEST_FIRST)."""
    for item in items:
        if lacks := unmarked(item):
            item.stash[UNMARKED] = ", ".join(lacks)
    if WORKER:
        items.sort(key=start_rank)  # stable: a module's tests keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if UNMARKED in item.stash:
        pytest.fail(f"{item.nodeid}: {item.stash[UNMARKED]} (pyproject.toml's markers)", pytrace=False)


# VMLAUNCH_TEST_CPU=FILE: the whole host's CPU time (user + system, every process: also a lab's
# detached QEMUs) during each test's set-up, call and tear-down, written to FILE as one tab-separated
# line per test (seconds of CPU, seconds of wall, the test), and the 25 costliest said at the end. On a
# quiet machine and one worker it is what each test costs; `make test`'s total is tools/cputime.py's.
CPU_FILE = os.environ.get("VMLAUNCH_TEST_CPU")
CPU_COSTS: list[tuple[float, float, str]] = []


def host_cpu_seconds() -> float:
    """The busy time of every CPU since boot (/proc/stat: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
    return busy / os.sysconf("SC_CLK_TCK")


if CPU_FILE:
    import time as _time

    CPU_PATH = Path(CPU_FILE)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        cpu, wall = host_cpu_seconds(), _time.monotonic()
        yield
        cost = (host_cpu_seconds() - cpu, _time.monotonic() - wall, item.nodeid)
        CPU_COSTS.append(cost)
        with CPU_PATH.open("a") as out:
            out.write(f"{cost[0]:.2f}\t{cost[1]:.2f}\t{cost[2]}\n")

    def pytest_terminal_summary(terminalreporter: Any) -> None:
        terminalreporter.write_sep("=", "the 25 tests that cost the host the most CPU (VMLAUNCH_TEST_CPU)")
        for cpu, wall, nodeid in sorted(CPU_COSTS, reverse=True)[:25]:
            terminalreporter.write_line(f"{cpu:8.2f}s cpu {wall:8.2f}s wall  {nodeid}")
        total = sum(cost[0] for cost in CPU_COSTS)
        terminalreporter.write_line(f"{total:8.2f}s cpu in all, over {len(CPU_COSTS)} tests")


def write_spec(tmp_path: Path, text: str, name: str = "lab.toml") -> Path:
    spec = tmp_path / name
    spec.write_text(text)
    return spec


@pytest.fixture(scope="session")
def qemu_binary() -> str:
    binary = shutil.which("qemu-system-x86_64")
    if binary is None:
        pytest.fail("qemu-system-x86_64 is missing: run `make setup`")
    return binary


@pytest.fixture(scope="session")
def test_guest() -> Path:
    """The test guest (kernel + busybox initramfs), built once and cached by tools/build_guest.py."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "build_guest.py")],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"building the test guest failed:\n{done.stdout}\n{done.stderr}")
    return GUEST_DIR


@pytest.fixture(scope="session")
def libvirt_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Three libvirt hosts reached over SSH, built once per session (tools/libvirt_hosts.py): private
    libvirtds with an sshd each in namespaces of their own, on an underlay whose switch namespace is
    the client vmlaunch runs in (`rig.run_client`). Torn down after the session."""
    if os.geteuid() != 0:  # pragma: no cover - CI and the README's machines run as root
        pytest.skip("the rig of libvirt hosts needs root (mount and network namespaces)")
    from tools.libvirt_hosts import LibvirtHosts

    with LibvirtHosts(Path(tempfile.mkdtemp(prefix="vlh-")), count=3) as rig:
        yield rig
    shutil.rmtree(rig.work, ignore_errors=True)


def netns_argv(argv: list[str]) -> list[str]:
    """Run argv in a private network namespace, so the host's own network is never touched."""
    return ["unshare", "-n", "--", *argv] if os.geteuid() == 0 else ["unshare", "-rn", "--", *argv]


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short run dir (unix socket paths have a 107-byte limit)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="vl-"))
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
