"""vmlaunch on a shared host: directories it uses are the user's alone, files in them are never opened
through a planted link, it removes only what it made, one lab name answers to one spec, guest output
is defused in its messages, and a `down` in a full or read-only run dir still stops everything."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmlaunch.cli import main
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.compile.plan import Plan
from vmlaunch.core.textsafe import printable
from vmlaunch.errors import EXIT_HOST, EXIT_RUNTIME, RuntimeFailure
from vmlaunch.host.facts import detect_host
from vmlaunch.lab import process as qemu
from vmlaunch.lab.journal import Journal, JournalError, LabTaken, VmEntry, locked
from vmlaunch.layout.dirs import UnsafeDirectory, secure_dir
from vmlaunch.layout.rundir import RunDir, open_in_run_dir
from vmlaunch.runtime import executor
from vmlaunch.spec.load import load_lab

NOBODY = pwd.getpwnam("nobody").pw_uid
# Valid, and never started by the tests that use it: the kernel only has to exist.
MINIMAL = f'[lab]\nname = "sh"\n[vm.a]\nmemory = "64M"\nkernel = "{sys.executable}"\n'
SPEC = """
[lab]
name = "sh"
[vm.a]
memory = "64M"
accel = "tcg"
kernel = "GUEST/vmlinuz"
initrd = "GUEST/initrd.gz"
[vm.b]
memory = "64M"
accel = "tcg"
kernel = "GUEST/vmlinuz"
initrd = "GUEST/initrd.gz"
"""


def kill_qemus_under(root: str) -> None:
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmdline and root.encode() in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), 9)


@pytest.fixture(autouse=True)
def _no_qemu_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever a failing test leaves running under its run root is killed (passing ones leave none)."""
    yield
    if os.environ.get("VMLAUNCH_RUN_DIR"):
        kill_qemus_under(os.environ["VMLAUNCH_RUN_DIR"])


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vl-"))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def spec_file(tmp_path: Path, name: str = "lab.toml", text: str = MINIMAL) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- directories: owned by the user (or root), writable by nobody else -------------------------------


def test_a_run_root_another_user_made_first_is_refused(root: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The fallback under /tmp is predictable: another user creating it first gains nothing."""
    planted = root / "vmlaunch"
    planted.mkdir(mode=0o755)
    os.chown(planted, NOBODY, -1)
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(planted))
    spec = spec_file(tmp_path)
    for command in (["status", str(spec)], ["down", str(spec)], ["up", str(spec)]):
        assert main(command) == EXIT_HOST
        err = capsys.readouterr().err
        assert f"refusing to use {planted}" in err and "owned by nobody" in err and "hint:" in err
    assert list(planted.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_a_run_root_others_may_write_is_refused(root: Path, mode: int) -> None:
    shared = root / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(UnsafeDirectory, match=f"others may write in it \\(mode {mode:04o}\\)"):
        RunDir.of(shared, "lab").secure(create=True)


def test_above_the_run_root_only_sticky_dirs_may_be_shared(root: Path) -> None:
    sticky, open_dir = root / "sticky", root / "open"
    for path, mode in ((sticky, 0o1777), (open_dir, 0o777)):
        path.mkdir()
        os.chmod(path, mode)
    assert secure_dir(sticky / "mine" / "vmlaunch", top=sticky / "mine", create=True)
    assert stat.S_IMODE(os.stat(sticky / "mine").st_mode) == 0o700
    with pytest.raises(UnsafeDirectory, match="not sticky"):
        secure_dir(open_dir / "mine", top=open_dir / "mine", create=True)


def test_a_link_chain_is_checked_link_by_link(root: Path) -> None:
    """A link of the user's that names a link of another user's is refused like that one."""
    shared, real = root / "shared", root / "real"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    real.mkdir()
    os.symlink(real, shared / "theirs")
    os.lchown(shared / "theirs", NOBODY, -1)
    (root / "mine").symlink_to(shared / "theirs")
    with pytest.raises(UnsafeDirectory, match="a symlink is owned by nobody"):
        secure_dir(root / "mine" / "run", top=root / "mine" / "run", create=True)
    assert not (real / "run").exists()


def test_links_on_the_way(root: Path) -> None:
    """A link the user made above the run root is followed and its target checked; a link owned by
    another user is refused (the kernel's protected_symlinks rule), and so is a link as a run dir."""
    real = root / "real"
    real.mkdir()
    (root / "mine").symlink_to(real)
    assert secure_dir(root / "mine" / "run", top=root / "mine" / "run", create=True)
    assert (real / "run").is_dir()
    os.symlink(real, root / "theirs")
    os.lchown(root / "theirs", NOBODY, -1)
    with pytest.raises(UnsafeDirectory, match="a symlink is owned by nobody"):
        secure_dir(root / "theirs" / "run", top=root / "theirs" / "run", create=True)
    (real / "run" / "lab").symlink_to(real)
    with pytest.raises(UnsafeDirectory, match="it is a symlink"):
        RunDir.of(real / "run", "lab").secure()


def test_a_link_planted_in_the_run_dir_is_never_written_through(root: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run_dir = RunDir.of(root, "lab")
    run_dir.create()
    for planted in (run_dir.lock, run_dir.state, run_dir.vm("a").stderr_log):
        planted.symlink_to(victim)
    with pytest.raises(RuntimeFailure, match="it is a symlink"), locked(run_dir, 1):
        pass
    with pytest.raises(JournalError, match="it is a symlink"):
        Journal.load(run_dir)
    with pytest.raises(RuntimeFailure, match="it is a symlink"):
        open_in_run_dir(run_dir.vm("a").stderr_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert victim.read_text() == "precious"


# --- removing only what vmlaunch made ----------------------------------------------------------------


def test_down_keeps_a_directory_vmlaunch_did_not_make(root: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(root))
    theirs = root / "sh"
    theirs.mkdir(mode=0o700)
    (theirs / "notes.txt").write_text("mine")
    spec = spec_file(tmp_path)
    assert main(["down", str(spec)]) == 0
    assert (theirs / "notes.txt").read_text() == "mine"
    with pytest.raises(RuntimeFailure, match="was not made by vmlaunch"):
        RunDir.of(root, "sh").create()
    assert (theirs / "notes.txt").read_text() == "mine"


def test_a_marked_run_dir_with_strangers_is_kept(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir = RunDir.of(root, "lab")
    run_dir.create()
    (run_dir.path / "a.serial.log").write_text("boot")
    (run_dir.path / "keep.me").write_text("x")
    (run_dir.path / "sub").mkdir()
    (run_dir.path / "notes.pid").write_text("a VM this lab does not have")
    assert run_dir.remove(["a"]) == "it holds what vmlaunch did not put there: keep.me, notes.pid, sub"
    for name in ("keep.me", "notes.pid"):
        (run_dir.path / name).unlink()
    (run_dir.path / "sub").rmdir()
    assert run_dir.remove(["a"]) is None and not run_dir.path.exists()
    run_dir.path.mkdir()
    assert "no .vmlaunch-run-dir mark" in (run_dir.remove() or "")


def test_an_unmarked_directory_is_never_adopted_nor_emptied(root: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(root))
    theirs = root / "sh"
    theirs.mkdir(mode=0o700)
    with pytest.raises(RuntimeFailure, match="was not made by vmlaunch"):
        RunDir.of(root, "sh").create()  # empty, still not vmlaunch's
    (theirs / "state.json").write_text('{"mine": true}')
    assert main(["down", str(spec_file(tmp_path)), "--force"]) == 0
    assert (theirs / "state.json").read_text() == '{"mine": true}'


def test_a_link_planted_for_a_vm_file_is_removed_before_qemu_opens_it(root: Path, tmp_path: Path) -> None:
    """QEMU opens its serial log itself, following links: none may be there when it starts."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run_dir = RunDir.of(root, "lab")
    run_dir.create()
    files = run_dir.vm("a")
    for path in files.every:
        path.symlink_to(victim)
    executor.clear_stale(files)
    assert not any(path.is_symlink() for path in files.every) and victim.read_text() == "precious"
    files.serial_log.symlink_to(victim)
    journal = Journal.load(run_dir)  # the VM is up: its log is read from the run dir
    journal.vms["a"] = VmEntry(pid=None, started=0.0, accel="tcg")
    journal.save()
    with pytest.raises(RuntimeFailure, match="it is a symlink"):
        from vmlaunch.runtime.control import read_log

        read_log(run_dir, "a")


# --- one lab name, one spec ---------------------------------------------------------------------------


def test_another_spec_with_the_lab_name_is_refused(root: Path, tmp_path: Path) -> None:
    run_dir = RunDir.of(root, "sh")
    first, second = spec_file(tmp_path, "one.toml"), spec_file(tmp_path, "two.toml")
    journal = Journal.load(run_dir)
    journal.spec = str(first)
    journal.vms["a"] = VmEntry(pid=None, started=0.0, accel="tcg")
    journal.save()
    journal = Journal.load(run_dir)
    journal.check_spec(first, force=False)
    os.symlink(first, tmp_path / "link.toml")
    journal.check_spec(tmp_path / "link.toml", force=False)  # the same file by another path
    with pytest.raises(LabTaken, match=f"up from another spec, {first}, not {second}"):
        journal.check_spec(second, force=False)
    journal.check_spec(second, force=True)


def test_down_from_another_spec_is_refused(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(root))
    first, second = spec_file(tmp_path, "one.toml"), spec_file(tmp_path, "two.toml")
    journal = Journal.load(RunDir.of(root, "sh"))
    journal.spec = str(first)
    journal.vms["a"] = VmEntry(pid=None, started=0.0, accel="tcg")
    journal.save()
    assert main(["down", str(second)]) == EXIT_RUNTIME
    assert "up from another spec" in capsys.readouterr().err and (root / "sh" / "state.json").exists()
    assert main(["down", str(second), "--force"]) == 0
    assert not (root / "sh").exists()


# --- journals that are not what vmlaunch wrote ---------------------------------------------------------


@pytest.mark.parametrize("content", ["", "[]", "null", '{"version": 2, "vms": []}',
                                     '{"version": 2, "resources": {}}', "[" * 100000, "\xff\xfe"])
def test_a_wrong_journal_is_a_clear_error(root: Path, tmp_path: Path, content: str,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(root))
    run_dir = RunDir.of(root, "sh")
    run_dir.create()
    run_dir.state.write_bytes(content.encode("latin-1"))
    spec = spec_file(tmp_path)
    for command in (["status", str(spec)], ["down", str(spec)]):
        assert main(command) == EXIT_RUNTIME
        err = capsys.readouterr().err
        assert "state.json" in err and "internal error" not in err
    assert main(["down", str(spec), "--force"]) == 0
    assert not run_dir.path.exists()


def stand_in_qemu(run_dir: RunDir, vm: str) -> subprocess.Popen[bytes]:
    """A process whose command line is that of the VM's QEMU (its QMP socket path): what `down
    --force` looks for when the journal cannot say which QEMUs the lab runs."""
    qmp = run_dir.vm(vm).qmp
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "qemu-system-x86_64",
                             "-chardev", f"socket,id=qmp,path={qmp},server=on,wait=off"])


@pytest.mark.parametrize("content", ["", '{"version": 1, "spec": "/x.toml", "resources": [{"ki'])
def test_down_force_stops_the_qemus_an_unreadable_journal_does_not_list(
        root: Path, tmp_path: Path, content: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found by their pidfile or their command line, stopped, and the run dir removed; exit 0."""
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(root))
    run_dir = RunDir.of(root, "sh")
    run_dir.create()
    run_dir.state.write_text(content)
    by_pidfile, by_cmdline = stand_in_qemu(run_dir, "a"), stand_in_qemu(run_dir, "b")
    try:
        run_dir.vm("a").pidfile.write_text(f"{by_pidfile.pid}\n")
        spec = spec_file(tmp_path)
        assert main(["status", str(spec)]) == EXIT_RUNTIME
        assert "down SPEC --force" in capsys.readouterr().err
        assert main(["down", str(spec), "--force", "--timeout", "1"]) == 0
        err = capsys.readouterr().err
        assert "a: killed (found by its pidfile or command line)" in err
        assert "b: killed (found by its pidfile or command line)" in err
        assert by_pidfile.wait(10) and by_cmdline.wait(10)
        assert not run_dir.path.exists()
    finally:
        for proc in (by_pidfile, by_cmdline):
            proc.kill()
            proc.wait()


def test_down_force_that_cannot_stop_a_qemu_says_so_and_fails(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(root))
    run_dir = RunDir.of(root, "sh")
    run_dir.create()
    run_dir.state.write_text('{"vers')
    proc = stand_in_qemu(run_dir, "a")
    monkeypatch.setattr(qemu, "stop_all", lambda vms, timeout: {name: "not stopped" for name in vms})
    try:
        assert main(["down", str(spec_file(tmp_path)), "--force"]) == EXIT_RUNTIME
        err = capsys.readouterr().err
        assert f"still there:\nQEMU of VM a (pid {proc.pid}) still runs" in err
        assert run_dir.state.exists()  # kept for the next down --force
    finally:
        proc.kill()
        proc.wait()


def test_a_fifo_journal_does_not_hang(root: Path) -> None:
    run_dir = RunDir.of(root, "sh")
    run_dir.create()
    os.mkfifo(run_dir.state)
    with pytest.raises(JournalError, match="not a regular file"):
        Journal.load(run_dir)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4),
                    max_leaves=20)
KEYS = st.sampled_from(["version", "spec", "resources", "vms", "kind", "key", "vm", "record", "pid"])
JOURNALS = st.fixed_dictionaries({}, optional={
    "version": st.just(2) | JSON, "spec": JSON,
    "resources": st.lists(st.fixed_dictionaries({}, optional={
        "kind": st.sampled_from(["image", "bridge", "tap", "pci"]) | JSON, "key": JSON, "vm": JSON,
        "record": st.dictionaries(KEYS | st.text(max_size=8), JSON, max_size=5)}), max_size=3) | JSON,
    "vms": st.dictionaries(st.text(max_size=5), st.fixed_dictionaries({}, optional={
        "pid": JSON, "started": JSON, "accel": JSON}), max_size=3) | JSON,
})


@settings(max_examples=150, deadline=None)
@given(doc=JOURNALS | JSON)
def test_any_journal_loads_or_fails_clearly(doc: object) -> None:
    with tempfile.TemporaryDirectory(prefix="vl-") as tmp:
        run_dir = RunDir.of(Path(tmp), "lab")
        run_dir.create()
        run_dir.state.write_text(json.dumps(doc))
        try:
            Journal.load(run_dir)
        except JournalError as exc:
            assert str(run_dir.state) in str(exc)
        journal = Journal.load(run_dir, force=True)  # whatever is readable, never an exception
        assert all(isinstance(line, str) for line in journal.unreadable)


# --- guest output in vmlaunch's own messages -----------------------------------------------------------


def test_terminal_escapes_are_taken_out_of_messages() -> None:
    hostile = ("boot\x1b]0;owned\x07 ok\x1b[2J\x1b[1;1Hdone\r\x9b31mred\x1bPq#0\x1b\\ \x1bc"
               "\x00\x08\x7f\x90dcs\x9c end\n\tnext")
    assert printable(hostile) == "boot okdonered  end\n\tnext"
    assert printable("txt.\u202eexe\u2066x\u2069") == "txt.exex"  # no reordering what is read


def test_the_tail_in_an_error_is_printable(tmp_path: Path) -> None:
    log = tmp_path / "a.serial.log"
    log.write_bytes(b"line\x1b]52;c;ZWNobyBwd25lZA==\x07 one\r\nmore \x1b[31mred\x1b[0m\n")
    assert executor._tail(log) == "\n  | line one\n  | more red"


# --- QEMU started, not yet recorded; a full or read-only run dir during down ------------------------


def plan_of(tmp_path: Path, guest: Path) -> Plan:
    spec = spec_file(tmp_path, text=SPEC.replace("GUEST", str(guest)))
    return compile_lab(load_lab(spec), detect_host())


@pytest.mark.qemu
@pytest.mark.guest
def test_a_qemu_without_pidfile_or_pid_is_still_found(tmp_path: Path, run_dir: Path,
                                                      test_guest: Path) -> None:
    """A vmlaunch killed while QEMU daemonized recorded no pid, and the pidfile may not exist yet."""
    plan = plan_of(tmp_path, test_guest)
    executor.up(plan, spec=tmp_path / "lab.toml", timeout=60)
    journal = Journal.load(plan.run_dir)
    pids = {name: vm.pid for name, vm in journal.vms.items()}
    for name in journal.vms:
        journal.vms[name] = VmEntry(pid=None, started=0.0, accel="tcg")
        plan.run_dir.vm(name).pidfile.unlink()
    journal.save()
    assert executor.down(plan.run_dir, timeout=1)
    assert not any(qemu.alive(pid) for pid in pids.values() if pid is not None)
    assert not plan.run_dir.path.exists()


@pytest.mark.qemu
@pytest.mark.guest
def test_an_interrupt_while_qemus_daemonize_leaves_none(tmp_path: Path, run_dir: Path,
                                                        test_guest: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_of(tmp_path, test_guest)
    plan.run_dir.create()
    real_popen = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen_then_interrupt(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        if started:
            raise KeyboardInterrupt
        started.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        return started[0]

    monkeypatch.setattr(subprocess, "Popen", popen_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        qemu.start(plan.vms)
    assert started and started[0].poll() is not None
    assert qemu.scan(plan.run_dir.vm("a")) == [] and qemu.scan(plan.run_dir.vm("b")) == []


@pytest.fixture
def small_run_root() -> Iterator[Path]:
    """A 2 MiB tmpfs as the run root, to fill up or make read-only."""
    path = Path(tempfile.mkdtemp(prefix="vl-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(path)], check=True)
    yield path
    kill_qemus_under(str(path))
    while subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True).returncode == 0:
        pass
    path.rmdir()


@pytest.mark.qemu
@pytest.mark.guest
@pytest.mark.parametrize("trouble", ["full", "read-only"])
def test_down_in_a_full_or_read_only_run_dir_stops_every_vm(
        tmp_path: Path, small_run_root: Path, test_guest: Path, monkeypatch: pytest.MonkeyPatch,
        trouble: str, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(small_run_root))
    plan = plan_of(tmp_path, test_guest)
    pids = executor.up(plan, spec=tmp_path / "lab.toml", timeout=60)
    if trouble == "full":
        with open(small_run_root / "filler", "wb", buffering=0) as filler:
            for size in (65536, 4096, 1):  # to the last byte
                with contextlib.suppress(OSError):
                    while True:
                        filler.write(b"\0" * size)
    else:
        # QEMU holds its logs open for writing, so a remount refuses: a read-only bind mount on top
        subprocess.run(["mount", "--bind", str(small_run_root), str(small_run_root)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(small_run_root)], check=True)
    if trouble == "full":
        # Whether the journal can be rewritten depends on the page a stopped QEMU's pidfile frees
        with contextlib.suppress(RuntimeFailure):
            executor.down(plan.run_dir, ["a"], timeout=1)
        assert not qemu.alive(pids["a"]) and qemu.alive(pids["b"])
        assert executor.down(plan.run_dir, timeout=1)  # removing files needs no space
        assert not qemu.alive(pids["b"]) and not plan.run_dir.path.exists()
        return
    with pytest.raises(RuntimeFailure) as failed:
        executor.down(plan.run_dir, ["a"], timeout=1)  # the journal must be rewritten: it cannot be
    assert not qemu.alive(pids["a"]) and qemu.alive(pids["b"]), failed.value
    assert str(failed.value).count("could not be updated") == 1
    with pytest.raises(RuntimeFailure, match="could not be removed"):
        executor.down(plan.run_dir, timeout=1)  # it cannot remove the run dir either
    assert not qemu.alive(pids["b"])
    subprocess.run(["umount", str(small_run_root)], check=True)  # the read-only bind mount
    executor.down(plan.run_dir, timeout=1)  # the journal still reads, and finishes the job
    assert not any(qemu.alive(pid) for pid in pids.values())
    assert not plan.run_dir.path.exists()


def test_cli_runs_without_traceback_as_a_module() -> None:
    done = subprocess.run([sys.executable, "-m", "vmlaunch", "status", "/nonexistent.toml"],
                          capture_output=True, text=True, check=False)
    assert "Traceback" not in done.stderr and done.returncode != 0


def test_a_cache_others_may_write_is_not_used(root: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """The cached host facts name the QEMU binary vmlaunch runs: a planted cache must not count."""
    from vmlaunch.layout import dirs

    shared = root / "cache"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "host.json").write_text('{"key": "planted"}')
    monkeypatch.setenv("VMLAUNCH_CACHE_DIR", str(shared))
    dirs._usable.cache_clear()
    assert dirs.usable_cache_dir() is None
    assert "not using the cache: refusing to use" in caplog.text and "VMLAUNCH_CACHE_DIR" in caplog.text
    os.chmod(shared, 0o700)
    dirs._usable.cache_clear()  # checked once per process
    assert dirs.usable_cache_dir() == shared
    (shared / "valid").mkdir()
    os.chown(shared / "valid", NOBODY, -1)  # where the stamps of specs known valid go
    assert dirs.usable_cache_dir("valid") is None
