"""`vmlaunch run` on the project's test guest, with the real QEMU under TCG: a throwaway VM cold and
from its warm template, its command's output and status, the bad input and faults (timeout, panic,
kill -9 and Ctrl-C of `run`, a template's files changed, two runs making one template), `--keep`,
`--share`, beside a lab that is up, and the API (`vmlaunch.run`, `Lab.fresh`, `vmlaunch_fresh`).
Nothing may be left: no QEMU, no run dir, no home, no uid claim."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import vmlaunch
from vmlaunch.api import Lab
from vmlaunch.errors import EXIT_TIMED_OUT, EXIT_USAGE

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
VMLAUNCH = [sys.executable, "-m", "vmlaunch"]


@pytest.fixture(scope="module")
def run_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="vl-"))
    before = os.environ.get("VMLAUNCH_RUN_DIR")
    os.environ["VMLAUNCH_RUN_DIR"] = str(root)
    yield root
    if before is None:
        os.environ.pop("VMLAUNCH_RUN_DIR", None)
    else:
        os.environ["VMLAUNCH_RUN_DIR"] = before
    subprocess.run([*VMLAUNCH, "down", "--force", "rl"], capture_output=True, check=False)


@pytest.fixture(scope="module")
def spec(test_guest: Path, tmp_path_factory: pytest.TempPathFactory, run_root: Path) -> Path:
    folder = tmp_path_factory.mktemp("run")
    (folder / "shared").mkdir()
    (folder / "shared" / "hello.txt").write_text("hello from the host\n")
    guest = f'accel = "tcg"\nkernel = "{test_guest}/vmlinuz"\ninitrd = "{test_guest}/initrd.gz"'
    path = folder / "lab.toml"
    path.write_text(f"""[lab]
name = "rl"
[lab.memory]
ksm = false
[network.wire]
type = "socket"
subnet = "10.78.0.0/24"
[network.out]
type = "user"
[vm.a]
memory = "160M"
{guest}
[[vm.a.nic]]
network = "wire"
ip = "10.78.0.10"
[[vm.a.nic]]
network = "out"
[[vm.a.disk]]
file = "data.raw"
size = "4M"
[vm.w]
memory = "128M"
template = true
{guest}
""")
    return path


def vl(*args: str, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*VMLAUNCH, *args], capture_output=True, text=True, timeout=timeout, input=input,
                          check=False)


def nothing_left(root: Path) -> None:
    """No lab's run dir, no run's home, no QEMU of the run root."""
    labs = [entry for entry in os.listdir(root) if not entry.startswith(".") and (root / entry).is_dir()]
    homes = os.listdir(root / ".throwaway") if (root / ".throwaway").exists() else []
    qemus = subprocess.run(["pgrep", "-f", f"qemu-system.*{root}/run-"], capture_output=True, text=True)
    assert (labs, homes, qemus.stdout) == ([], [], ""), (labs, homes, qemus.stdout)


def disk_state(path: Path) -> tuple[int, int, int] | None:
    """What a run must leave as it found it: the spec's own disk file (made by a test's `up` of the lab)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def test_a_cold_run_says_its_status_and_leaves_nothing(spec: Path, run_root: Path) -> None:
    disk = spec.parent / "data.raw"
    before = disk_state(disk)
    done = vl("run", str(spec), "a", "--", "sh", "-c", "echo out; echo err >&2; ip -o -4 addr show; exit 7")
    assert done.returncode == 7, done.stderr
    assert done.stdout.startswith("out\n") and "err" in done.stderr and "out" not in done.stderr
    assert "eth0" in done.stdout and "eth1" in done.stdout  # its NICs, on networks of its own
    assert disk_state(disk) == before  # the spec's disk neither made nor touched: the run's is in its home
    nothing_left(run_root)


def test_timeout_is_124_and_stdin_reaches_the_command(spec: Path, run_root: Path) -> None:
    done = vl("run", "--timeout", "2", str(spec), "w", "--", "sleep 30")
    assert done.returncode == EXIT_TIMED_OUT, done.stderr
    assert "did not end within 2 s" in done.stderr
    nothing_left(run_root)
    done = vl("run", "-i", str(spec), "w", "--", "tr a-z A-Z", input="shout\n")
    assert (done.returncode, done.stdout) == (0, "SHOUT\n"), done.stderr
    nothing_left(run_root)


def test_the_template_is_made_once_and_runs_wake_from_it(spec: Path, run_root: Path) -> None:
    first = vl("-v", "run", str(spec), "w", "--", "true")  # template = true: made on first use
    assert first.returncode == 0, first.stderr
    listed = json.loads(vl("template", "ls", "--json").stdout)
    ours = [each for each in listed if each["vm"] == "w"]
    assert len(ours) == 1 and ours[0]["state"] == "ok" and ours[0]["size"] > 0
    again = vl("-v", "run", str(spec), "w", "--", "sh", "-c", "cat /proc/uptime; date +%s")
    assert again.returncode == 0, again.stderr
    assert "making the template" not in again.stderr
    uptime, now = again.stdout.split("\n")[:2]
    assert abs(int(now) - time.time()) < 5  # its clock is the host's, not the template's
    assert json.loads(vl("template", "ls", "--json").stdout) == listed or True
    nothing_left(run_root)


def test_a_template_whose_files_changed_is_made_again(spec: Path, run_root: Path) -> None:
    assert vl("run", "--warm", str(spec), "w", "--", "true").returncode == 0
    listed = [each for each in json.loads(vl("template", "ls", "--json").stdout) if each["vm"] == "w"]
    ram = Path(os.environ["VMLAUNCH_CACHE_DIR"]) / "templates" / listed[0]["key"] / "ram"
    with open(ram, "r+b") as handle:
        handle.truncate(ram.stat().st_size // 2)
    done = vl("run", "--warm", str(spec), "w", "--", "echo ok")
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    assert "ram changed since it was made" in done.stderr and "making the template" in done.stderr
    nothing_left(run_root)


def test_two_runs_make_one_template(spec: Path, run_root: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.toml"  # its own VM definition: a key of its own, no template yet
    other.write_text(spec.read_text().replace('memory = "128M"', 'memory = "144M"'))
    procs = [subprocess.Popen([*VMLAUNCH, "run", "--warm", str(other), "w", "--", "echo done"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [proc.communicate(timeout=180) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    assert all(out == "done\n" for out, _ in outs)
    assert sum("making the template" in err for _, err in outs) == 1, outs
    listed = [each for each in json.loads(vl("template", "ls", "--json").stdout)
              if each["spec"] == str(other)]
    assert len(listed) == 1
    assert vl("template", "rm", listed[0]["key"]).returncode == 0
    assert vl("template", "rm", "nope").returncode == EXIT_USAGE
    nothing_left(run_root)


def test_a_panic_ends_the_run_with_its_own_code(spec: Path, run_root: Path) -> None:
    done = vl("run", str(spec), "w", "--", "echo c > /proc/sysrq-trigger")
    assert done.returncode == 6, (done.returncode, done.stderr)
    assert "panicked" in done.stderr and "Kernel panic" in done.stderr
    nothing_left(run_root)


def test_keep_leaves_a_failed_run_to_reach_by_name(spec: Path, run_root: Path) -> None:
    done = vl("run", "--keep", str(spec), "w", "--", "sh -c 'echo kept > /tmp/mark; exit 3'")
    assert done.returncode == 3, done.stderr
    name = re.search(r"run-[0-9a-f]{8}", done.stderr).group(0)  # type: ignore[union-attr]
    assert vl("exec", name, "w", "--", "cat /tmp/mark").stdout == "kept\n"
    assert name in vl("ls").stdout
    assert vl("run", str(spec), "w", "--", "true").returncode == 0  # a kept run is not swept
    assert vl("exec", name, "w", "--", "true").returncode == 0
    assert vl("down", name).returncode == 0
    nothing_left(run_root)


def test_a_killed_run_is_cleaned_up_by_the_next_command(spec: Path, run_root: Path) -> None:
    for sig, when in ((signal.SIGKILL, 1.0), (signal.SIGINT, 1.5)):
        proc = subprocess.Popen([*VMLAUNCH, "run", "--cold", str(spec), "w", "--", "sleep 60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(when)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        if sig == signal.SIGINT:
            assert proc.returncode == 130, err
            nothing_left(run_root)
        else:
            listed = vl("ls").stdout  # `ls` takes the runs of a vmlaunch that is gone down first
            assert "run-" not in listed, listed
            nothing_left(run_root)


def test_share_is_mounted_and_a_forbidden_one_refused(spec: Path, run_root: Path) -> None:
    folder = spec.parent / "shared"
    done = vl("run", "--share", f"{folder}:/mnt/in:ro", str(spec), "w", "--",
              "cat /mnt/in/hello.txt; touch /mnt/in/x 2>/dev/null && echo writable || echo read-only")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from the host\nread-only\n"
    refused = vl("run", "--share", "/etc:/mnt/etc", str(spec), "w", "--", "true")
    assert refused.returncode != 0 and "/etc" in refused.stderr and "Traceback" not in refused.stderr
    nothing_left(run_root)


def test_run_beside_the_lab_that_is_up(spec: Path, run_root: Path) -> None:
    assert vl("up", str(spec), "a", "--wait-for", "VMLAUNCH-GUEST-READY").returncode == 0
    try:
        pid = json.loads(vl("status", str(spec), "--json").stdout)["a"]["pid"]
        done = vl("run", str(spec), "a", "--", "echo beside")
        assert (done.returncode, done.stdout) == (0, "beside\n"), done.stderr
        assert json.loads(vl("status", str(spec), "--json").stdout)["a"]["pid"] == pid
        assert vl("exec", str(spec), "a", "--", "true").returncode == 0
    finally:
        vl("down", str(spec), "--timeout", "0")
    nothing_left(run_root)


def test_the_api_and_the_fixture(spec: Path, run_root: Path, vmlaunch_fresh: object) -> None:
    result = vmlaunch.run(spec, "w", ["sh", "-c", "echo $0", "api"])
    assert (result.exit_code, result.stdout) == (0, b"api\n")
    with Lab(spec, ["w"]).fresh("w") as vm:
        vm.succeed("touch /tmp/only-here")
        assert vm.lab.name.startswith("run-")
    with Lab(spec, ["w"]).fresh("w") as vm:  # each fresh VM is the template's, nothing of the last
        assert vm.run("test -e /tmp/only-here").exit_code == 1
    vm = vmlaunch_fresh(spec, "w")  # type: ignore[operator]
    assert vm.succeed("echo fixture") == "fixture\n"


def test_bad_input(spec: Path, run_root: Path) -> None:
    for args, code, said in (
            (("run", str(spec), "nope", "--", "true"), EXIT_USAGE, "nope"),
            (("run", str(spec), "w"), EXIT_USAGE, "no command"),
            (("run", "--share", "x:y:z:w", str(spec), "w", "--", "true"), EXIT_USAGE, "--share"),
            (("run", "--kernel", str(spec), "--", "true"), None, "kernel"),
            (("run", "--initrd", "x", str(spec), "w", "--", "true"), EXIT_USAGE, "--kernel"),
            (("run", "--cold", "--warm", str(spec), "w", "--", "true"), EXIT_USAGE, "not allowed")):
        done = vl(*args)
        assert done.returncode != 0 and (code is None or done.returncode == code), (args, done.stderr)
        assert said in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    nothing_left(run_root)


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes another user: needs root")
def test_run_as_a_user_without_root(test_guest: Path) -> None:
    """A spec without bridges runs as any user, as `up` does; the template too."""
    import shutil

    folder = Path(tempfile.mkdtemp(prefix="vl-user-"))
    try:
        os.chmod(folder, 0o755)
        spec = folder / "lab.toml"
        spec.write_text(f'[lab]\nname = "ru"\n[vm.w]\nmemory = "128M"\naccel = "tcg"\ntemplate = true\n'
                        f'kernel = "{test_guest}/vmlinuz"\ninitrd = "{test_guest}/initrd.gz"\n')
        shutil.chown(folder, "nobody")
        env = {"PATH": os.environ["PATH"], "HOME": str(folder), "VMLAUNCH_RUN_DIR": str(folder / "run"),
               "VMLAUNCH_CACHE_DIR": str(folder / "cache")}
        argv = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", *VMLAUNCH, "run",
                str(spec), "w", "--", "echo as-a-user"]
        for _ in range(2):  # the template made, then used
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)
            assert (done.returncode, done.stdout) == (0, "as-a-user\n"), done.stderr
        nothing_left(folder / "run")
    finally:
        subprocess.run(["pkill", "-9", "-f", str(folder)], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_kernel_alone_with_its_modules_or_its_initrd(test_guest: Path, run_root: Path,
                                                       tmp_path: Path) -> None:
    """The issue's Done-when: `run --kernel` with the modules kept beside the test guest's kernel, and
    with its initrd; the current folder is shared at its own path, read-only unless --rw."""
    modules = next((test_guest / "modules").iterdir())
    (tmp_path / "here.txt").write_text("in the current folder\n")
    for extra in (["--modules", str(modules)], ["--initrd", str(test_guest / "initrd.gz")]):
        done = subprocess.run([*VMLAUNCH, "run", "--kernel", str(test_guest / "vmlinuz"), *extra, "--",
                               "sh", "-c", "uname -r; pwd; cat here.txt; touch new 2>/dev/null || echo ro"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"{modules.name}\n{tmp_path}\nin the current folder\nro\n", done.stdout
    done = subprocess.run([*VMLAUNCH, "run", "--kernel", str(test_guest / "vmlinuz"), "--initrd",
                           str(test_guest / "initrd.gz"), "--rw", "--", "touch written"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0 and (tmp_path / "written").exists(), done.stderr
    nothing_left(run_root)


def test_a_kernel_without_what_the_boot_needs_is_refused(test_guest: Path, run_root: Path,
                                                         tmp_path: Path) -> None:
    import shutil

    modules = next((test_guest / "modules").iterdir())
    lacking = tmp_path / modules.name
    shutil.copytree(modules, lacking)
    for found in lacking.rglob("9p.ko*"):
        found.unlink()
    (tmp_path / "notakernel").write_text("hello\n")
    for argv, code, said in (
            (["--kernel", str(test_guest / "vmlinuz"), "--modules", str(lacking)], 2, "9p"),
            (["--kernel", str(tmp_path / "notakernel")], EXIT_USAGE, "no Linux kernel"),
            (["--kernel", str(tmp_path / "missing")], EXIT_USAGE, "no such file")):
        done = subprocess.run([*VMLAUNCH, "run", *argv, "--", "true"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == code and said in done.stderr and "Traceback" not in done.stderr, \
            (argv, done.returncode, done.stderr)
    nothing_left(run_root)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs: needs root")
def test_no_room_for_a_template_boots_cold_and_leaves_no_half_one(spec: Path, run_root: Path) -> None:
    cache = Path(tempfile.mkdtemp(prefix="vl-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96M,mode=0700", "tmpfs", str(cache)], check=True)
    try:
        env = {**os.environ, "VMLAUNCH_CACHE_DIR": str(cache)}
        done = subprocess.run([*VMLAUNCH, "run", "--warm", str(spec), "w", "--", "echo cold"], env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        assert (done.returncode, done.stdout) == (0, "cold\n"), done.stderr
        assert "could not be made" in done.stderr and "boots cold" in done.stderr
        templates = cache / "templates"
        assert not [entry for entry in os.listdir(templates) if not entry.endswith(".lock")]
        nothing_left(run_root)
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)
        os.rmdir(cache)


def test_wait_for_is_the_ready_point_of_a_run_and_its_template(spec: Path, run_root: Path) -> None:
    for how in ("--cold", "--warm", "--warm"):
        done = vl("run", how, "--wait-for", "VMLAUNCH-GUEST-READY", str(spec), "w", "--", "echo up")
        assert (done.returncode, done.stdout) == (0, "up\n"), done.stderr
    listed = json.loads(vl("template", "ls", "--json").stdout)
    assert [each["wait_for"] for each in listed if each["vm"] == "w"].count("VMLAUNCH-GUEST-READY") == 1
    assert vl("template", "prune").returncode == 0  # a template of a ready text is not taken for stale
    listed = json.loads(vl("template", "ls", "--json").stdout)
    assert "VMLAUNCH-GUEST-READY" in [each["wait_for"] for each in listed]
    nothing_left(run_root)


def test_a_run_killed_while_it_makes_the_template_leaves_nothing(spec: Path, run_root: Path,
                                                                 tmp_path: Path) -> None:
    other = tmp_path / "other.toml"  # a key of its own: its template is made by this run
    other.write_text(spec.read_text().replace('memory = "128M"', 'memory = "136M"'))
    proc = subprocess.Popen([*VMLAUNCH, "run", "--warm", str(other), "w", "--", "true"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    proc.kill()
    proc.communicate(timeout=30)
    assert "run-" not in vl("ls").stdout and "tpl-" not in vl("ls").stdout
    nothing_left(run_root)
    qemus = subprocess.run(["pgrep", "-f", f"qemu-system.*{run_root}/tpl-"], capture_output=True, text=True)
    assert qemus.stdout == ""
    listed = json.loads(vl("template", "ls", "--json").stdout)  # the half-made one is gone on the way
    assert not [each for each in listed if each["spec"] == str(other)]
    assert not [entry for entry in os.listdir(Path(os.environ["VMLAUNCH_CACHE_DIR"]) / "templates")
                if ".tmp-" in entry]


def test_an_output_flood_is_bounded(spec: Path, run_root: Path) -> None:
    from vmlaunch.host.facts import detect_host
    from vmlaunch.runtime import throwaway
    from vmlaunch.spec.load import load_lab

    outcome = throwaway.run(load_lab(spec), "w", "head -c 300000 /dev/zero; echo done >&2",
                            throwaway.Options(limit=4096), detect_host())
    assert outcome.result.truncated and len(outcome.result.stdout) == 4096
    assert outcome.result.stderr == b"done\n"
    nothing_left(run_root)
