"""The command as a user runs it: output, exit codes, never a traceback, a light start-up."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, write_spec
from vmlaunch.cli import main
from vmlaunch.core.version import __version__


def vmlaunch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          check=False, env={**os.environ, **(env or {})}, timeout=60)


def test_validate_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLES / "lab.toml")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "valid: lab demo: 2 VMs (alpha, beta), 2 networks" in out


def test_validate_counts_the_overlay_of_an_image_as_a_disk(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "1M"], check=True)
    (tmp_path / "data.img").write_bytes(bytes(512))
    spec = write_spec(tmp_path, '[lab]\nname = "img"\n[image.base]\nfile = "base.qcow2"\n'
                      '[vm.web]\nmemory = 256\nimage = "base"\n[vm.db]\nmemory = 256\nimage = "base"\n'
                      '[[vm.db.disk]]\nfile = "data.img"\n')
    assert main(["validate", str(spec)]) == 0
    assert capsys.readouterr().out == f"{spec}: valid: lab img: 2 VMs (web, db), 0 networks, 3 disks\n"


def test_ssh_to_a_vm_without_ssh_names_the_line_of_its_table(tmp_path: Path, run_dir: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "k").write_bytes(b"kernel")
    spec = write_spec(tmp_path, '[lab]\nname = "nossh"\n# the VMs\n[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[vm.b]\nmemory = 64\nkernel = "k"\n')
    assert main(["ssh", str(spec), "b"]) == 64
    assert capsys.readouterr().err.splitlines() == [
        "vmlaunch: error: VM b has no SSH port",
        f"  hint: give it ssh = true in [vm.b], {spec}:7 (and an image or [vm.b.cloud_init])"]


def test_validate_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, '[lab]\nname = "x"\n[vm.a]\nmemory = "1X"\nkernel = "k"\n'
                      '[[vm.a.nic]]\nnetwork = "nowhere"\n')
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{spec}:4: vm.a.memory: '1X' is not a size (examples: 256M, 2G, 1.5G)",
        f"{spec}:5: vm.a.kernel: {tmp_path}/k does not exist (relative paths are relative to the spec "
        "file)",  # the files too, with the rest: every problem at once
        f"{spec}:7: vm.a.nic[0].network: no network named 'nowhere' (networks: none defined)",
        "vmlaunch: 3 problems in the spec",
    ]


def without_notes(err: str) -> str:
    """Standard error without the notes (which kernel boots, and why)."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("vmlaunch: note: "))


def test_cmdline_json_and_shell(capsys: pytest.CaptureFixture[str], qemu_binary: str) -> None:
    assert main(["cmdline", str(EXAMPLES / "lab.toml"), "--json"]) == 0
    out, err = capsys.readouterr()
    argvs = json.loads(out)
    assert list(argvs) == ["alpha", "beta"]
    assert argvs["alpha"][0].endswith("qemu-system-x86_64")
    # the choice (and its reason, when first told today), once for every VM that has it
    assert re.fullmatch(r"vmlaunch: alpha, beta: (tcg|kvm)( \(.+\))?\n", without_notes(err)), err
    if "tcg" in err:  # which kernel boots under TCG, and why: once for the VMs that share it, and only
        # the first time this host is told of that kernel (an earlier test may have been told already)
        assert [line.split(" kernel ")[0] for line in err.splitlines() if "note:" in line] in (
            [], ["vmlaunch: note: alpha, beta:"])
    assert main(["cmdline", str(EXAMPLES / "lab.toml"), "beta"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert shlex.split(line) == argvs["beta"]  # pasteable: the shell gives back the same argv


def test_the_accelerator_reason_is_told_once_a_day(capsys: pytest.CaptureFixture[str],
                                                   qemu_binary: str) -> None:
    from vmlaunch.host.facts import ACCEL_TOLD
    from vmlaunch.layout.dirs import cache_dir

    stamp = cache_dir() / ACCEL_TOLD
    stamp.unlink(missing_ok=True)
    spec = str(EXAMPLES / "lab.toml")

    def stderr_of(*args: str) -> str:
        assert main([*args]) == 0
        return without_notes(capsys.readouterr().err)

    first = stderr_of("cmdline", spec)  # the first today on this host: the reason in full
    assert re.fullmatch(r"vmlaunch: alpha, beta: (tcg|kvm) \(.{20,}\)\n", first), first
    short = first.split(" (", 1)[0] + "\n"
    assert stderr_of("cmdline", spec) == short  # the same day: the accelerator alone
    assert stderr_of("cmdline", spec, "beta") == short.replace("alpha, ", "")
    assert first in stderr_of("-v", "cmdline", spec)  # -v: in full, every time
    assert stderr_of("-q", "cmdline", spec) == ""
    saved = json.loads(stamp.read_text())
    assert saved["host"] == os.uname().nodename
    stamp.write_text(json.dumps({**saved, "day": "2000-01-01"}))  # another day: in full again
    assert stderr_of("cmdline", spec) == first
    assert stderr_of("cmdline", spec) == short
    stamp.write_text("{not json")  # a stamp that cannot be read is as none
    assert stderr_of("cmdline", spec) == first


@pytest.mark.parametrize(("args", "code", "message"), [
    (["validate", "/nonexistent/lab.toml"], 2, "cannot read the spec"),
    (["cmdline", str(EXAMPLES / "lab.toml"), "gamma"], 64, "no VM named 'gamma'"),
    (["frobnicate"], 64, "invalid choice: 'frobnicate'"),
    (["help", "frobnicate"], 64, "no command 'frobnicate'"),
])
def test_errors_have_exit_codes_and_no_traceback(args: list[str], code: int, message: str) -> None:
    done = vmlaunch(*args)
    assert done.returncode == code
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("args", "hint"), [
    (["snapshot", "save", "lab.toml", "s2"],  # the sub-command before the spec
     "  hint: SPEC comes first, then SUBCOMMAND: `vmlaunch snapshot lab.toml save s2` "
     "(see `vmlaunch snapshot --help`)"),
    (["link", "up", "lab.toml", "a", "eth0"],
     "  hint: SPEC VM NIC comes first, then up|down: `vmlaunch link lab.toml a eth0 up` "
     "(see `vmlaunch link --help`)"),
    (["stauts", "lab.toml"], "  hint: did you mean 'status'? see `vmlaunch --help`"),
    (["snapshot", "lab.toml", "sve", "s2"], "  hint: did you mean 'save'? see `vmlaunch snapshot --help`"),
    (["snapshot", "lab.toml", "keep"], "  hint: see `vmlaunch snapshot --help`"),
    (["up", "--bogus", "lab.toml"], "  hint: see `vmlaunch up --help`"),  # a wrong argument: its command's
    (["help", "stat"], "  hint: did you mean 'status'? commands: init, "),
])
def test_a_usage_mistake_says_what_was_meant(args: list[str], hint: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 64
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("vmlaunch: error: ")
    assert err[1].startswith(hint)


def test_the_errors_page_shows_what_a_usage_mistake_prints(capsys: pytest.CaptureFixture[str]) -> None:
    page = (Path(__file__).parent.parent / "docs" / "reference" / "errors.md").read_text()
    block = page.split("## Mistakes on the command line", 1)[1].split("```\n", 2)[1]
    shown = re.split(r"^\$ vmlaunch ", block, flags=re.M)[1:]
    assert len(shown) == 3
    for each in shown:
        command, error, hint = each.splitlines()
        assert main(shlex.split(command)) == 64
        printed = capsys.readouterr().err.splitlines()
        assert printed[0].startswith(error.removesuffix("...)").removesuffix(", ")), command
        assert printed[1] == hint, command


def test_missing_qemu_is_a_host_error(tmp_path: Path) -> None:
    done = vmlaunch("cmdline", str(EXAMPLES / "lab.toml"),
                    env={"VMLAUNCH_QEMU": str(tmp_path / "no-qemu"),
                         "VMLAUNCH_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 3
    assert "no-qemu not found" in done.stderr and "Traceback" not in done.stderr


def test_toml_syntax_error(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, '[lab]\nname = "x"\n[vm.a\n')
    done = vmlaunch("validate", str(spec))
    assert done.returncode == 2
    assert done.stderr.startswith(f"{spec}:3: TOML syntax error:")


def test_help_and_version() -> None:
    assert vmlaunch("--version").stdout.strip() == f"vmlaunch {__version__}"
    for command in ("validate", "cmdline", "up", "down", "status", "logs", "console", "balloon", "qmp"):
        done = vmlaunch(command, "--help")
        assert done.returncode == 0 and "SPEC" in done.stdout
        assert vmlaunch("help", command).stdout == done.stdout


@pytest.mark.parametrize("args", [[], ["help"], ["-q"], ["-v", "help"]])
def test_vmlaunch_alone_prints_the_help(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vmlaunch")
    for command in ("validate", "up", "down", "status", "logs", "help"):
        assert f"    {command} " in out


def test_start_up_stays_light(tmp_path: Path) -> None:
    """validate and cmdline of a known-valid spec import no heavy library (see bench/startup.py)."""
    env = {"VMLAUNCH_CACHE_DIR": str(tmp_path)}
    for args in (["validate"], ["cmdline"]):
        vmlaunch(*args, str(EXAMPLES / "lab.toml"), env=env)  # warm the caches
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "vmlaunch", *args, str(EXAMPLES / "lab.toml")],
            capture_output=True, text=True, check=True, env={**os.environ, **env})
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()}
        assert not imported & {"pyroute2", "qemu.qmp", "jsonschema", "asyncio"}, args


@pytest.mark.parametrize(("command", "value"), [
    ("up", "nan"), ("up", "inf"), ("up", "-inf"), ("up", "-1"), ("up", "0"), ("up", "1e300"),
    ("up", "soon"), ("down", "-0.5"), ("down", "nan"), ("balloon", "0"), ("balloon", "inf"),
])
def test_timeout_must_be_a_sane_number_of_seconds(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["alpha"] if command == "balloon" else []
    assert main([command, str(EXAMPLES / "lab.toml"), *extra, "--timeout", value]) == 64
    assert "argument --timeout:" in capsys.readouterr().err


@pytest.mark.parametrize(("size", "message"), [
    ("128MB", "SIZE: '128MB': MB is ambiguous (10^6 or 2^20 bytes?); vmlaunch sizes are binary: write 128M "
              "(= 128 MiB = 134217728 bytes)"),
    ("1 gb", "SIZE: '1 gb': GB is ambiguous (10^9 or 2^30 bytes?); vmlaunch sizes are binary: write 1G "
             "(= 1 GiB = 1073741824 bytes)"),
    ("268435456", "SIZE: 268435456 MiB (a bare number is MiB) is not between 4K (a page) and the memory of "
                  "alpha, 256M (256 MiB)"),
    ("100B", "SIZE: '100B' is not between 4K (a page) and the memory of alpha, 256M (256 MiB)"),
])
def test_balloon_size_is_read_like_every_size(size: str, message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A bare SIZE is MiB, MB and GB are refused: before the lab is asked, so it need not run."""
    assert main(["balloon", str(EXAMPLES / "lab.toml"), "alpha", size]) == 64
    assert capsys.readouterr().err == f"vmlaunch: error: {message}\n"


def test_down_timeout_zero_stops_at_once() -> None:
    from vmlaunch.cli import build_parser

    args = build_parser().parse_args(["down", "lab.toml", "--timeout", "0"])
    assert args.timeout == 0.0


@pytest.mark.parametrize("command", ["validate", "cmdline"])
def test_closed_stdout_exits_quietly(command: str, tmp_path: Path, qemu_binary: str) -> None:
    """`vmlaunch cmdline lab.toml | head -1`: no traceback, no "Exception ignored", exit 141."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        done = subprocess.run([sys.executable, "-m", "vmlaunch", "-q", command, str(EXAMPLES / "lab.toml")],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, check=False,
                              env={**os.environ, "VMLAUNCH_CACHE_DIR": str(tmp_path)}, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert done.stderr == ""


# --- main's own paths, in process (the end-to-end tests run them in a subprocess) -------------------


def _failing_validate(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    from vmlaunch.cli import lab

    def fail(args: object) -> int:
        raise exc

    monkeypatch.setattr(lab, "cmd_validate", fail)


@pytest.mark.parametrize(("exc", "code", "said"), [
    (KeyboardInterrupt(), 130, "vmlaunch: interrupted"),
    (ValueError("oops"), 1, "internal error: ValueError: oops"),
    (OSError(28, "No space left on device"), 4, "error: [Errno 28] No space left on device"),
])
def test_main_turns_exceptions_into_exit_codes(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str],
                                               exc: BaseException, code: int, said: str) -> None:
    _failing_validate(monkeypatch, exc)
    assert main(["validate", "x.toml"]) == code
    assert said in capsys.readouterr().err


def test_a_reader_that_went_away_is_exit_141(monkeypatch: pytest.MonkeyPatch) -> None:
    from vmlaunch import cli

    _failing_validate(monkeypatch, BrokenPipeError(32, "Broken pipe"))
    monkeypatch.setattr(cli, "_reader_gone", lambda: True)
    assert main(["validate", "x.toml"]) == 141
    monkeypatch.setattr(cli, "_reader_gone", lambda: False)  # a QMP socket, not our output
    assert main(["validate", "x.toml"]) == 4


def test_a_signal_unwinds_once_then_is_ignored() -> None:
    import signal

    from vmlaunch.cli import _stop_on_signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(KeyboardInterrupt):
            _stop_on_signal(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        with pytest.raises(SystemExit) as stopped:
            _stop_on_signal(signal.SIGTERM, None)
        assert stopped.value.code == 128 + signal.SIGTERM
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(("args", "options", "command"), [
    (["--timeout", "2", "--", "sleep", "8"], {"timeout": 2.0}, ["sleep", "8"]),
    (["--via", "qga", "-i", "--wait", "5", "--", "sh", "-c", "x", "--", "y"],
     {"via": "qga", "stdin": True, "wait": 5.0}, ["sh", "-c", "x", "--", "y"]),
    (["--no-timeout", "--", "--timeout"], {"no_timeout": True, "timeout": 60.0}, ["--timeout"]),
    (["sh", "-c", "x", "--", "--timeout"], {"timeout": 60.0}, ["sh", "-c", "x", "--", "--timeout"]),
    (["ls", "--timeout", "2"], {"timeout": 60.0}, ["ls", "--timeout", "2"]),
])
def test_options_after_vm_are_the_commands_own_before_dashes(args: list[str], options: dict[str, object],
                                                             command: list[str]) -> None:
    """`exec SPEC VM --timeout 2 -- sleep 8`: the options stand where the help shows them, after VM;
    after `--` (or from the first word that is not an option) every word is the command's."""
    from vmlaunch.cli import build_parser

    parsed = build_parser().parse_args(["exec", "lab.toml", "vm1", *args])
    assert (parsed.spec, parsed.vm, parsed.command) == ("lab.toml", "vm1", command)
    assert {name: getattr(parsed, name) for name in options} == options
    ssh = build_parser().parse_args(["ssh", "lab.toml", "vm1", "--", "ls / | wc -l"])
    assert (ssh.vm, ssh.command) == ("vm1", ["ls / | wc -l"])


def test_an_option_where_the_command_begins_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["exec", "lab.toml", "vm1", "--timeout", "2", "sleep", "8"]) == 64
    err = capsys.readouterr().err
    assert "--timeout stands where the command begins: options come before --" in err
    assert "`vmlaunch exec SPEC VM --timeout ... -- CMD...`" in err
    assert main(["exec", "lab.toml", "vm1", "--bogus", "--", "true"]) == 64
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(("words", "text"), [
    (["ls / | wc -l"], "ls / | wc -l"),
    (["echo", "'two  spaces'", "$HOME"], "echo 'two  spaces' $HOME"),
])
def test_ssh_gives_the_guests_shell_the_words_joined_as_openssh_does(
        words: list[str], text: str, tmp_path: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vmlaunch.lab import running

    spec = write_spec(tmp_path, '[lab]\nname = "sshwords"\n[vm.a]\nmemory = 64\nkernel = "k"\nssh = true\n'
                      '[vm.a.cloud_init]\n')
    (tmp_path / "k").write_bytes(b"kernel")
    asked: list[object] = []

    def ssh_argv_of(run_dir: object, lab: object, vm: str, command: object) -> list[str]:
        asked.append(command)
        return ["ssh"]

    monkeypatch.setattr(running, "ssh_argv_of", ssh_argv_of)
    monkeypatch.setattr(subprocess, "run", lambda argv, check: subprocess.CompletedProcess(argv, 3))
    assert main(["ssh", str(spec), "a", "--", *words]) == 3
    assert asked == [text]
    assert main(["ssh", str(spec), "a", "--", " "]) == 64
