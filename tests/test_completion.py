"""Shell completion as the shells run it, and tools/install.sh into temporary folders.

The bash script is sourced in a real bash and its function driven the way bash drives it
(COMP_WORDS, COMP_CWORD); VM names come from the real `vmlaunch completion --vms`. Where zsh is
installed, the zsh script is loaded in an interactive zsh on a pseudo-terminal and a Tab typed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_spec
from vmlaunch.cli import build_parser
from vmlaunch.cli.completion import GENERATED_BY, script

VENV_BIN = Path(sys.executable).parent
INSTALL = ROOT / "tools" / "install.sh"
TWO_VMS = '[lab]\nname="t"\n[vm.alpha]\nmemory=64\nkernel="k"\n[vm.beta]\nmemory=64\nkernel="k"\n'
# Sources the script ($1), sets the words being completed ($2...; the last is the one under the
# cursor), calls the function bash would call and prints what it offers, one a line.
DRIVER = """
source "$1"; shift
COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 ))
COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}
_vmlaunch
status=$?
printf '%s\\n' "${COMPREPLY[@]}"
exit $status
"""
# zsh -f -c ZSH_DRIVER driver SCRIPT LINE: what zsh's own completion offers at the end of LINE, one a
# line. An interactive zsh on a pseudo-terminal (zpty) loads compinit and SCRIPT, compadd is wrapped
# to print what it adds, and after the Tab the completion system's last hook prints DONE and exits.
ZSH_DRIVER = r"""
zmodload zsh/zpty || exit 3
zpty z zsh -f -i
zpty -w z 'PROMPT= RPROMPT= PS2='
zpty -w z 'autoload -U compinit && compinit -u -D'
zpty -w z "source ${(q)1}"
zpty -w z 'compadd() {
  if [[ ${@[1,(i)(-|--)]} == *-(O|A|D)\ * ]]; then builtin compadd "$@"; return; fi
  local -a hits; local hit; builtin compadd -A hits "$@"
  for hit in $hits; do print -r -- "<<$hit>>"; done
}'
zpty -w z "bindkey '^I' complete-word"
zpty -w z "comppostfuncs=(_driver_done); _driver_done() { print -r -- '<<DONE>>'; exit }"
zpty -w z "print -r -- '<<REA''DY>>'"
zpty -r z line '*<<READY>>*'  # run (its echo, <<REA''DY>>, never matches: a slow echo cannot fool it)
zpty -w -n z "$2"$'\t'
while zpty -r z line; do
  [[ $line == *'<<DONE>>'* ]] && break
  [[ $line == *'<<'*'>>'* ]] && print -r -- "${${line#*<<}%%>>*}"
done
zpty -d z
"""


def vmlaunch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          check=False, timeout=60)


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("bash") / "vmlaunch"
    file.write_text(script("bash", build_parser()))
    return file


def complete(script_file: Path, *words: str, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> list[str]:
    """What bash offers for the last of `words` (`vmlaunch` first)."""
    result = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", DRIVER, "driver", str(script_file), *words],
        capture_output=True, text=True, check=False, timeout=60, cwd=cwd,
        env={**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return [line for line in result.stdout.splitlines() if line]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def with_image_commands() -> argparse.ArgumentParser:
    """vmlaunch's parser with one more command that has sub-commands of its own (as `image` has),
    whose options and arguments the test chooses."""
    parser = build_parser()
    commands = next(action for action in parser._actions
                    if isinstance(action, argparse._SubParsersAction))
    image = commands.add_parser("pictures", help="manage the images the labs boot from")
    image.add_argument("--store", metavar="DIR", help="where the images are")
    images = image.add_subparsers(dest="image_command", metavar="IMAGE-COMMAND", required=True)
    pull = images.add_parser("pull", help="download the images of a spec")
    pull.add_argument("spec", metavar="SPEC")
    pull.add_argument("vms", metavar="VM", nargs="*")
    pull.add_argument("--level", choices=["low", "high"])
    pull.add_argument("--force", action="store_true")
    listing = images.add_parser("list", help="list the images")
    listing.add_argument("--json", action="store_true")
    remove = images.add_parser("rm", help="remove an image")
    remove.add_argument("id", metavar="ID")
    return parser


# --- bash -----------------------------------------------------------------------------------------


def test_bash_completes_commands(bash_script: Path) -> None:
    offered = complete(bash_script, "vmlaunch", "")
    assert {"validate", "cmdline", "up", "down", "status", "logs", "completion"} <= set(offered)
    assert offered == list(subcommands(build_parser()))  # every command, in the parser's order
    assert complete(bash_script, "vmlaunch", "comp") == ["completion"]
    assert complete(bash_script, "vmlaunch", "--verb") == ["--verbose"]


def test_bash_completes_the_options_of_a_command(bash_script: Path) -> None:
    offered = complete(bash_script, "vmlaunch", "up", "--")
    assert {"--dry-run", "--wait-for", "--timeout", "--force", "--help"} <= set(offered)
    up = subcommands(build_parser())["up"]
    assert offered == [name for action in up._actions for name in action.option_strings
                       if name.startswith("--")]
    assert complete(bash_script, "vmlaunch", "up", "--d") == ["--dry-run"]
    assert "--dry-run" not in complete(bash_script, "vmlaunch", "down", "--")


def test_bash_completes_spec_files_and_folders(bash_script: Path, tmp_path: Path) -> None:
    for name in ("a.toml", "b.toml", "notes.txt", "sub/c.toml", "sub/d.json"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert sorted(complete(bash_script, "vmlaunch", "validate", "", cwd=tmp_path)) == [
        "a.toml", "b.toml", "sub"]
    assert complete(bash_script, "vmlaunch", "up", "sub/", cwd=tmp_path) == ["sub/c.toml"]
    # the value of an option whose metavar is SPEC too
    assert complete(bash_script, "vmlaunch", "completion", "--vms", "a", cwd=tmp_path) == ["a.toml"]


def test_bash_completes_folders_for_a_dir(bash_script: Path, tmp_path: Path) -> None:
    for name in ("lab.toml", "out/x.xml", "other/y"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    offered = complete(bash_script, "vmlaunch", "export", "lab.toml", "--out", "", cwd=tmp_path)
    assert sorted(offered) == ["other", "out"]
    offered = complete(bash_script, "vmlaunch", "export", "lab.toml", "--to", "", cwd=tmp_path)
    assert offered == ["libvirt", "kubevirt"]


def test_bash_completes_any_file_for_a_file(bash_script: Path, tmp_path: Path) -> None:
    for name in ("lab.toml", "lab.svg", "pics/old.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    offered = complete(bash_script, "vmlaunch", "graph", "lab.toml", "--out", "", cwd=tmp_path)
    assert sorted(offered) == ["lab.svg", "lab.toml", "pics"]
    assert complete(bash_script, "vmlaunch", "graph", "lab.toml", "--out", "pics/", cwd=tmp_path) == [
        "pics/old.png"]
    offered = complete(bash_script, "vmlaunch", "graph", "lab.toml", "--format", "", cwd=tmp_path)
    assert offered == ["svg", "png", "dot", "mermaid"]


def test_bash_completes_the_vms_of_the_spec_on_the_line(bash_script: Path, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, TWO_VMS)  # its kernel "k" need not exist for this
    assert complete(bash_script, "vmlaunch", "up", str(spec), "") == ["alpha", "beta"]
    assert complete(bash_script, "vmlaunch", "cmdline", str(spec), "alpha", "b") == ["beta"]
    assert complete(bash_script, "vmlaunch", "console", str(spec), "a") == ["alpha"]
    # options before the command and option values before the spec are not taken for it
    assert complete(bash_script, "vmlaunch", "-q", "up", "--timeout", "5", str(spec), "") == [
        "alpha", "beta"]
    # relative to where the shell is, and under ~
    assert complete(bash_script, "vmlaunch", "up", "lab.toml", "", cwd=tmp_path) == ["alpha", "beta"]
    assert complete(bash_script, "vmlaunch", "up", "~/lab.toml", "", env={"HOME": str(tmp_path)}) == [
        "alpha", "beta"]
    # nothing past a command's last argument, nothing for a spec that is not one
    assert complete(bash_script, "vmlaunch", "console", str(spec), "alpha", "") == []
    assert complete(bash_script, "vmlaunch", "up", str(tmp_path / "missing.toml"), "") == []


def test_bash_does_not_offer_a_vm_already_on_the_line(bash_script: Path, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, TWO_VMS)
    assert complete(bash_script, "vmlaunch", "up", str(spec), "alpha", "") == ["beta"]
    assert complete(bash_script, "vmlaunch", "reset", str(spec), "beta", "") == ["alpha"]
    assert complete(bash_script, "vmlaunch", "down", str(spec), "alpha", "beta", "") == []
    assert complete(bash_script, "vmlaunch", "cmdline", str(spec), "'alpha'", "") == ["beta"]  # quoted
    assert complete(bash_script, "vmlaunch", "up", str(spec), "--dry-run", "beta", "--force", "") == [
        "alpha"]
    # the word under the cursor is not one given: `alpha` can still be completed to itself
    assert complete(bash_script, "vmlaunch", "up", str(spec), "alpha") == ["alpha"]
    # an option's value is not a VM given, even when it is a VM's name
    assert complete(bash_script, "vmlaunch", "up", "--wait-for", "alpha", str(spec), "") == [
        "alpha", "beta"]


def test_bash_help_completes_the_command_names(bash_script: Path, tmp_path: Path) -> None:
    assert complete(bash_script, "vmlaunch", "help", "") == list(subcommands(build_parser()))
    assert complete(bash_script, "vmlaunch", "help", "co") == ["console", "completion"]
    assert complete(bash_script, "vmlaunch", "-v", "help", "u") == ["up"]
    assert complete(bash_script, "vmlaunch", "help", "up", "") == []  # one COMMAND only
    # qmp's COMMAND is a QMP command, not one of vmlaunch's
    spec = write_spec(tmp_path, TWO_VMS)
    assert complete(bash_script, "vmlaunch", "qmp", str(spec), "alpha", "") == []


def test_bash_completes_the_shell_of_completion(bash_script: Path) -> None:
    assert complete(bash_script, "vmlaunch", "completion", "") == ["bash", "zsh"]
    assert complete(bash_script, "vmlaunch", "completion", "z") == ["zsh"]
    assert complete(bash_script, "vmlaunch", "completion", "--") == ["--help", "--vms"]


def test_bash_offers_no_shell_after_completion_vms(bash_script: Path, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, TWO_VMS)
    # `completion --vms SPEC SHELL` is refused: nothing to offer after the spec
    assert complete(bash_script, "vmlaunch", "completion", "--vms", str(spec), "") == []
    assert complete(bash_script, "vmlaunch", "completion", "--vms", "=", str(spec), "") == []
    assert complete(bash_script, "vmlaunch", "completion", "--vms", str(spec), "b") == []
    # nor --vms after a shell
    assert complete(bash_script, "vmlaunch", "completion", "bash", "--") == ["--help"]


def test_bash_offers_nothing_for_the_command_ssh_runs(bash_script: Path, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, TWO_VMS)
    assert complete(bash_script, "vmlaunch", "ssh", str(spec), "") == ["alpha", "beta"]
    assert complete(bash_script, "vmlaunch", "ssh", str(spec), "alpha", "") == []
    assert complete(bash_script, "vmlaunch", "ssh", str(spec), "alpha", "--", "") == []
    assert complete(bash_script, "vmlaunch", "ssh", str(spec), "alpha", "--", "ls", "") == []
    # what follows the VM is the guest's command, options and all, as argparse.REMAINDER takes it
    assert complete(bash_script, "vmlaunch", "ssh", str(spec), "alpha", "--", "-") == []
    assert complete(bash_script, "vmlaunch", "ssh", str(spec), "alpha", "ls", "--") == []
    assert complete(bash_script, "vmlaunch", "ssh", str(spec), "alpha", "-") == []
    assert complete(bash_script, "vmlaunch", "ssh", "--", str(spec), "a") == ["alpha"]
    assert complete(bash_script, "vmlaunch", "ssh", "--") == ["--help"]


def test_a_new_command_is_completed_without_editing_anything(tmp_path: Path) -> None:
    parser = build_parser()
    commands = next(action for action in parser._actions
                    if isinstance(action, argparse._SubParsersAction))
    new = commands.add_parser("frobnicate", help="a command added later")
    new.add_argument("spec", metavar="SPEC")
    new.add_argument("vm", metavar="VM")
    new.add_argument("--level", choices=["low", "high"])
    new.add_argument("--zap", action="store_true")
    file = tmp_path / "vmlaunch.bash"
    file.write_text(script("bash", parser))
    spec = write_spec(tmp_path, TWO_VMS)
    assert complete(file, "vmlaunch", "frob") == ["frobnicate"]
    assert complete(file, "vmlaunch", "frobnicate", "--") == ["--help", "--level", "--zap"]
    assert complete(file, "vmlaunch", "frobnicate", "--level", "h") == ["high"]
    assert complete(file, "vmlaunch", "frobnicate", "--level", "low", str(spec), "b") == ["beta"]


def test_bash_completes_sub_commands_of_a_command(tmp_path: Path) -> None:
    file = tmp_path / "vmlaunch.bash"
    file.write_text(script("bash", with_image_commands()))
    spec = write_spec(tmp_path, TWO_VMS)
    (tmp_path / "notes.txt").write_text("")
    assert "pictures" in complete(file, "vmlaunch", "")
    assert complete(file, "vmlaunch", "help", "pic") == ["pictures"]
    assert complete(file, "vmlaunch", "pictures", "") == ["pull", "list", "rm"]
    assert complete(file, "vmlaunch", "pictures", "l") == ["list"]
    assert complete(file, "vmlaunch", "pictures", "--") == ["--help", "--store"]
    assert complete(file, "vmlaunch", "-q", "pictures", "--store", "/x", "p") == ["pull"]
    # each sub-command with its own options and arguments
    assert complete(file, "vmlaunch", "pictures", "pull", "--") == ["--help", "--level", "--force"]
    assert complete(file, "vmlaunch", "pictures", "pull", "--level", "l") == ["low"]
    assert complete(file, "vmlaunch", "pictures", "pull", "", cwd=tmp_path) == ["lab.toml"]
    assert complete(file, "vmlaunch", "pictures", "--store", "/x", "pull", "--force", "lab.toml", "",
                    cwd=tmp_path) == ["alpha", "beta"]
    assert complete(file, "vmlaunch", "pictures", "pull", str(spec), "beta", "") == ["alpha"]
    assert complete(file, "vmlaunch", "pictures", "list", "--") == ["--help", "--json"]
    assert complete(file, "vmlaunch", "pictures", "list", "") == []
    assert complete(file, "vmlaunch", "pictures", "rm", "") == []
    assert complete(file, "vmlaunch", "pictures", "rm", "x", "") == []
    # an option of `image` is not one of `image pull`, nor the other way round
    assert complete(file, "vmlaunch", "pictures", "pull", "--st") == []
    assert complete(file, "vmlaunch", "pictures", "--le") == []
    # and the rest of the command line is as it was
    assert complete(file, "vmlaunch", "up", str(spec), "") == ["alpha", "beta"]
    subprocess.run(["bash", "-n", str(file)], check=True, timeout=60)


def test_the_bash_script_is_what_the_command_prints(bash_script: Path) -> None:
    result = vmlaunch("completion", "bash")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == bash_script.read_text()
    assert GENERATED_BY in result.stdout.splitlines()[0]
    subprocess.run(["bash", "-n", str(bash_script)], check=True, timeout=60)


# --- zsh ------------------------------------------------------------------------------------------


def test_the_zsh_script_parses(tmp_path: Path) -> None:
    text = script("zsh", build_parser())
    assert text.startswith("#compdef vmlaunch\n")
    assert GENERATED_BY in text.splitlines()[1]
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh is not installed here: its script is only checked with `zsh -n` where it is")
    file = tmp_path / "_vmlaunch"
    file.write_text(text)
    result = subprocess.run([zsh, "-n", str(file)], capture_output=True, text=True, check=False,
                            timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def zsh_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed here")
    file = tmp_path_factory.mktemp("zsh") / "_vmlaunch"
    file.write_text(script("zsh", with_image_commands()))
    return file


def zsh_complete(script_file: Path, line: str, cwd: Path) -> list[str]:
    """What zsh offers at the end of `line` (`vmlaunch ...`), in the order it was added."""
    result = subprocess.run(
        ["zsh", "-f", "-c", ZSH_DRIVER, "driver", str(script_file), line],
        capture_output=True, text=True, check=False, timeout=60, cwd=cwd,
        env={**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    return [word for word in result.stdout.splitlines() if word]


@pytest.mark.parametrize(("line", "offered"), [
    ("vmlaunch comp", ["completion"]),
    ("vmlaunch up lab.toml ", ["alpha", "beta"]),
    ("vmlaunch up lab.toml alpha ", ["beta"]),
    ("vmlaunch down lab.toml beta alpha ", []),
    ("vmlaunch cmdline lab.toml 'alpha' b", ["beta"]),
    ("vmlaunch up --wait-for alpha lab.toml a", ["alpha"]),
    ("vmlaunch help co", ["console", "completion"]),
    ("vmlaunch completion z", ["zsh"]),
    ("vmlaunch completion --vms lab.toml b", []),
    ("vmlaunch completion bash --", ["--help"]),
    ("vmlaunch ssh lab.toml a", ["alpha"]),
    ("vmlaunch export lab.toml --to ", ["libvirt", "kubevirt"]),
    ("vmlaunch export lab.toml ", ["alpha", "beta"]),
    ("vmlaunch graph lab.toml --format ", ["svg", "png", "dot", "mermaid"]),
    ("vmlaunch graph lab.toml --out l", ["lab.toml"]),
    ("vmlaunch ssh lab.toml alpha -- ", []),
    ("vmlaunch ssh lab.toml alpha -- -", []),
    ("vmlaunch pictures ", ["pull", "list", "rm"]),
    ("vmlaunch pictures pull --l", ["--level"]),
    ("vmlaunch pictures pull --level=", ["low", "high"]),
    ("vmlaunch pictures --store /x pull lab.toml beta ", ["alpha"]),
    ("vmlaunch pictures list --", ["--help", "--json"]),
    ("vmlaunch pictures rm ", []),
])
def test_zsh_completes(zsh_script: Path, tmp_path: Path, line: str, offered: list[str]) -> None:
    write_spec(tmp_path, TWO_VMS)
    assert sorted(zsh_complete(zsh_script, line, tmp_path)) == sorted(offered)


def test_zsh_completes_folders_for_a_dir(zsh_script: Path, tmp_path: Path) -> None:
    (tmp_path / "outdir").mkdir()
    (tmp_path / "notes.txt").write_text("")
    assert zsh_complete(zsh_script, "vmlaunch export lab.toml --out ", tmp_path) == ["outdir"]


# --- the completion command -----------------------------------------------------------------------


def test_vms_prints_one_name_a_line(tmp_path: Path) -> None:
    result = vmlaunch("completion", "--vms", str(write_spec(tmp_path, TWO_VMS)))
    assert (result.returncode, result.stdout, result.stderr) == (0, "alpha\nbeta\n", "")


@pytest.mark.parametrize("text", [
    "[lab\nname=",  # not TOML
    '[lab]\nname="t"\n[vm.alpha]\nmemory="lots"\nkernel="k"\n',  # does not validate
])
def test_vms_of_a_broken_spec_is_nothing(tmp_path: Path, text: str) -> None:
    result = vmlaunch("completion", "--vms", str(write_spec(tmp_path, text)))
    assert (result.returncode, result.stdout) == (0, "")


@pytest.mark.parametrize("where", ["missing.toml", ".", "/dev/null"])
def test_vms_of_no_spec_is_nothing(tmp_path: Path, where: str) -> None:
    result = vmlaunch("completion", "--vms", str(tmp_path / where) if where != "/dev/null" else where)
    assert (result.returncode, result.stdout) == (0, "")


def test_vms_of_a_spec_whose_files_are_missing_are_listed(tmp_path: Path) -> None:
    """Completion helps while the lab is being written: its kernel "k" is not there yet."""
    spec = write_spec(tmp_path, TWO_VMS)
    refused = vmlaunch("validate", str(spec))
    assert refused.returncode == 2
    assert "vm.alpha.kernel" in refused.stderr and "does not exist" in refused.stderr
    result = vmlaunch("completion", "--vms", str(spec))
    assert (result.returncode, result.stdout, result.stderr) == (0, "alpha\nbeta\n", "")


@pytest.mark.parametrize(("args", "message"), [
    (["completion", "fish"], "invalid choice: 'fish'"),
    (["completion"], "give either SHELL (bash or zsh) or --vms SPEC"),
    (["completion", "bash", "--vms", "lab.toml"], "give either SHELL (bash or zsh) or --vms SPEC"),
])
def test_completion_usage_errors(args: list[str], message: str) -> None:
    result = vmlaunch(*args)
    assert (result.returncode, result.stdout) == (64, "")
    assert message in result.stderr


def test_cli_start_up_does_not_import_completion() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys, vmlaunch.cli; vmlaunch.cli.build_parser(); "
         "print('vmlaunch.cli.completion' in sys.modules)"],
        capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout == "False\n"


# --- tools/install.sh -----------------------------------------------------------------------------


class Installer:
    """tools/install.sh pointed at temporary folders (never /usr/local or the real home)."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.bash = root / "share" / "bash-completion" / "completions"
        self.zsh = root / "share" / "zsh" / "site-functions"
        # VMLAUNCH_ROOT_ONLY: as root, this checkout's venv may be root's alone (a Python under
        # /root); whether other users can run it is tested below, with fake checkouts
        self.env = {**os.environ, "HOME": str(root / "home"), "VMLAUNCH_BIN_DIR": str(self.bin),
                    "VMLAUNCH_BASH_COMPLETION_DIR": str(self.bash),
                    "VMLAUNCH_ZSH_COMPLETION_DIR": str(self.zsh), "PATH": "/usr/bin:/bin",
                    "VMLAUNCH_ROOT_ONLY": "1"}
        self.link = self.bin / "vmlaunch"
        self.bash_file = self.bash / "vmlaunch"
        self.zsh_file = self.zsh / "_vmlaunch"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(INSTALL), *args], capture_output=True, text=True, check=False,
                                env=self.env, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        return result


@pytest.fixture
def installer(tmp_path: Path) -> Installer:
    return Installer(tmp_path)


TARGET = ROOT / ".venv" / "bin" / "vmlaunch"


def test_install_puts_vmlaunch_on_path_and_completion_in_place(installer: Installer) -> None:
    out = installer.run().stdout
    assert os.readlink(installer.link) == str(TARGET)  # absolute
    assert installer.bash_file.read_text() == vmlaunch("completion", "bash").stdout
    assert installer.zsh_file.read_text() == vmlaunch("completion", "zsh").stdout
    assert f"{installer.link} -> " in out
    assert f"{installer.bin} is not on your PATH" in out
    # a new shell with that folder on its PATH finds it, and completes with the installed file
    shell = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", f"source {installer.bash_file}; vmlaunch --version; "
         "complete -p vmlaunch"],
        capture_output=True, text=True, check=True, timeout=60,
        env={**installer.env, "PATH": f"{installer.bin}:/usr/bin:/bin"})
    assert shell.stdout.startswith("vmlaunch ")
    assert "complete -F _vmlaunch vmlaunch" in shell.stdout


def test_install_again_changes_nothing_and_says_nothing(installer: Installer) -> None:
    installer.run()
    before = {path: path.lstat().st_mtime_ns
              for path in (installer.link, installer.bash_file, installer.zsh_file)}
    again = installer.run()
    assert (again.stdout, again.stderr) == ("", "")
    assert {path: path.lstat().st_mtime_ns for path in before} == before


def test_install_repoints_a_link_into_another_checkout(installer: Installer, tmp_path: Path) -> None:
    installer.bin.mkdir(parents=True)
    old = tmp_path / "old-checkout" / ".venv" / "bin" / "vmlaunch"
    installer.link.symlink_to(old)
    out = installer.run().stdout
    assert os.readlink(installer.link) == str(TARGET)
    assert f"{installer.link} pointed to {old}" in out


@pytest.mark.parametrize("foreign", ["file", "link"])
def test_install_leaves_a_vmlaunch_of_someone_else_alone(installer: Installer, foreign: str) -> None:
    installer.bin.mkdir(parents=True)
    if foreign == "file":
        installer.link.write_text("#!/bin/sh\necho mine\n")
    else:
        installer.link.symlink_to("/bin/true")
    installer.bash.mkdir(parents=True)
    installer.bash_file.write_text("complete -F _mine vmlaunch\n")
    def unchanged() -> bool:
        if foreign == "file":
            return installer.link.read_text() == "#!/bin/sh\necho mine\n"
        return os.readlink(installer.link) == "/bin/true"

    out = installer.run().stdout  # exit 0: the rest is installed all the same
    assert unchanged()
    if foreign == "file":
        assert f"{installer.link} is not a symlink of vmlaunch's: left alone" in out
    else:
        assert f"{installer.link} links to /bin/true, not to a vmlaunch checkout: left alone" in out
    assert installer.bash_file.read_text() == "complete -F _mine vmlaunch\n"
    assert f"{installer.bash_file} was not written by vmlaunch: left alone" in out
    assert installer.zsh_file.read_text() == vmlaunch("completion", "zsh").stdout
    # and uninstall does not take them either
    out = installer.run("--uninstall").stdout
    assert unchanged()
    assert installer.bash_file.read_text() == "complete -F _mine vmlaunch\n"
    assert not installer.zsh_file.exists()
    assert f"removed {installer.zsh_file}" in out


def test_uninstall_removes_what_install_put_there(installer: Installer) -> None:
    installer.run()
    out = installer.run("--uninstall").stdout
    assert not installer.link.is_symlink()
    assert not installer.bash_file.exists()
    assert not installer.zsh_file.exists()
    assert out.count("removed ") == 3
    again = installer.run("--uninstall")
    assert (again.stdout, again.stderr) == ("", "")


def test_uninstall_leaves_another_checkouts_link(installer: Installer, tmp_path: Path) -> None:
    other = tmp_path / "other" / ".venv" / "bin" / "vmlaunch"
    other.parent.mkdir(parents=True)
    other.write_text("")
    installer.bin.mkdir(parents=True)
    installer.link.symlink_to(other)
    out = installer.run("--uninstall").stdout
    assert os.readlink(installer.link) == str(other)
    assert "another checkout's" in out
    other.unlink()  # that checkout is gone: its dangling link is ours to remove
    installer.run("--uninstall")
    assert not installer.link.is_symlink()


# --- as root, installed for every user or not at all ------------------------------------------------

FAKE_VMLAUNCH = """#!{python}
import os, sys
{extra}
if sys.argv[1:] == ["--version"]:
    print("vmlaunch 0+fake")
elif sys.argv[1:2] == ["completion"]:
    print("# {generated} " + sys.argv[2] + "` (a fake checkout)")
"""
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def fake_checkout(where: Path, python: str, extra: str = "") -> Path:
    """A checkout with tools/install.sh and a venv whose Python is `python` (a symlink to it, as venv
    makes) and whose vmlaunch is a stand-in that needs the standard library alone."""
    checkout = where / "checkout"
    (checkout / "tools").mkdir(parents=True)
    shutil.copy(INSTALL, checkout / "tools")
    venv_bin = checkout / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(python)
    script = venv_bin / "vmlaunch"
    script.write_text(FAKE_VMLAUNCH.format(python=venv_bin / "python", generated=GENERATED_BY,
                                           extra=extra))
    script.chmod(0o755)
    return checkout


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every user may enter (pytest's tmp_path is under a 0700 folder of root's)."""
    import tempfile

    made = Path(tempfile.mkdtemp(prefix="vl-install-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made)


def install_as_root(checkout: Path, installer: Installer,
                    **env: str) -> subprocess.CompletedProcess[str]:
    full = {**{key: value for key, value in installer.env.items() if key != "VMLAUNCH_ROOT_ONLY"}, **env}
    return subprocess.run([str(checkout / "tools" / "install.sh")], capture_output=True, text=True,
                          check=False, env=full, timeout=120)


needs_root_and_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists(),
    reason="installing for every user is root's, checked as user nobody with setpriv")


@needs_root_and_setpriv
def test_root_installs_for_every_user(open_dir: Path) -> None:
    checkout = fake_checkout(open_dir, "/usr/bin/python3")
    installer = Installer(open_dir / "installed")
    done = install_as_root(checkout, installer)
    assert done.returncode == 0, done.stderr
    assert os.readlink(installer.link) == str(checkout / ".venv" / "bin" / "vmlaunch")
    assert installer.bash_file.exists() and installer.zsh_file.exists()
    ran = subprocess.run([*NOBODY, str(installer.link), "--version"], capture_output=True, text=True,
                         check=False, timeout=60, cwd="/")
    assert ran.stdout == "vmlaunch 0+fake\n", ran.stderr


@needs_root_and_setpriv
def test_root_does_not_install_a_venv_whose_python_others_cannot_run(
        open_dir: Path, installer: Installer) -> None:
    """A venv made from root's pyenv (/root/.pyenv/..., /root being 0700): every other user would get
    "bad interpreter: Permission denied" from the link, so there is no link."""
    private = open_dir / "root-home"
    (private / "bin").mkdir(parents=True)
    (private / "bin" / "python3.11").symlink_to("/usr/bin/python3")
    private.chmod(0o700)
    checkout = fake_checkout(open_dir, str(private / "bin" / "python3.11"))
    done = install_as_root(checkout, installer)
    assert done.returncode == 1
    assert done.stdout == ""
    venv_python = checkout / ".venv" / "bin" / "python"
    assert done.stderr.splitlines() == [
        f"install: not installing for every user: other users cannot run {venv_python.parent}/vmlaunch:",
        f"install:   its Python, {venv_python} (/usr/bin/python3.11): {private} is closed to other users "
        "(mode 700)",
        f"install: make the venv from a Python every user can run: cd {checkout} && rm -rf .venv && "
        "PYTHON=/usr/bin/python3 make setup",
        "install: or, where root alone runs vmlaunch: VMLAUNCH_ROOT_ONLY=1 make install (nothing was "
        "linked or written)",
    ]
    assert not installer.link.is_symlink() and not installer.bin.exists()
    assert not installer.bash_file.exists() and not installer.zsh_file.exists()
    # on purpose, for root alone
    done = install_as_root(checkout, installer, VMLAUNCH_ROOT_ONLY="1")
    assert done.returncode == 0, done.stderr
    assert os.readlink(installer.link) == str(venv_python.parent / "vmlaunch")


@needs_root_and_setpriv
def test_root_does_not_install_from_a_checkout_others_cannot_enter(open_dir: Path,
                                                                   installer: Installer) -> None:
    """A checkout under /root (0700), with a Python every user can run."""
    home = open_dir / "root-home"
    home.mkdir(mode=0o700)
    checkout = fake_checkout(home, "/usr/bin/python3")
    done = install_as_root(checkout, installer)
    assert done.returncode == 1
    assert done.stderr.splitlines()[:3] == [
        f"install: not installing for every user: other users cannot run {checkout}/.venv/bin/vmlaunch:",
        f"install:   {home} is closed to other users (mode 700)",
        "install: keep the checkout where every user can enter (e.g. under /opt or /srv), then make "
        "setup there",
    ]
    assert not installer.link.is_symlink() and not installer.bash_file.exists()
    # the manual's install page shows it so, for a checkout in /root/vmlaunch
    page = (ROOT / "docs" / "getting-started" / "install.md").read_text()
    shown = page.split("```console\n# make install\n", 1)[1].split("```", 1)[0]
    assert shown.replace("/root/vmlaunch", str(checkout)).replace("/root ", f"{home} ") == done.stderr


@needs_root_and_setpriv
def test_root_runs_it_as_nobody_before_installing(open_dir: Path, installer: Installer) -> None:
    """Every folder open, and yet it fails for others (say, site-packages root alone may read): the
    run as user nobody says so; a link of an earlier install is named, and left for uninstall."""
    checkout = fake_checkout(open_dir, "/usr/bin/python3", extra=(
        "if os.geteuid() != 0:\n"
        "    sys.exit(\"ModuleNotFoundError: No module named 'attrs'\")"))
    target = checkout / ".venv" / "bin" / "vmlaunch"
    installer.bin.mkdir(parents=True)
    installer.link.symlink_to(target)
    done = install_as_root(checkout, installer)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[1] == (f"install:   `{target} --version` fails as user nobody: ModuleNotFoundError: "
                        "No module named 'attrs'")
    assert lines[2].startswith("install: make the venv from a Python every user can run: ")
    assert lines[-1] == (f"install: {installer.link}, of an earlier install, is left as it is: make "
                         "uninstall removes it")
    assert not installer.bash_file.exists()
