"""The Python API's face without a VM: the lazy package exports, and where a relative spec path is
taken from (the calling file's directory; the test file's for the fixture). The host is faked and
nothing is brought up."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import vmlaunch
import vmlaunch.api
from tests.conftest import fake_host
from vmlaunch.errors import SpecError

pytest_plugins = ["pytester"]

SPEC = """
[lab]
name = "{name}"
[vm.solo]
memory = "64M"
kernel = "vmlinuz"  # never read: nothing boots
"""


@pytest.fixture(autouse=True)
def _fake_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Lab()` probes the host (seconds without a cache); these tests only compile."""
    monkeypatch.setattr(vmlaunch.api, "detect_host", fake_host)


def write_lab(folder: Path, name: str, file: str = "lab.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file
    path.write_text(SPEC.format(name=name))
    (folder / "vmlinuz").write_bytes(b"a kernel")  # the files a spec names must exist
    return path


def import_helper(folder: Path) -> ModuleType:
    """A module with a real `__file__` in `folder` that calls `vmlaunch.Lab` for its caller."""
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "labhelper.py"
    file.write_text("import vmlaunch\n\n\ndef make(spec):\n    return vmlaunch.Lab(spec)\n")
    spec = importlib.util.spec_from_file_location(f"labhelper_{abs(hash(folder))}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the package's exports ---


def test_every_name_in_all_resolves_to_its_definition() -> None:
    from vmlaunch import api, errors
    from vmlaunch.qemu import qmp
    from vmlaunch.rig import agent
    from vmlaunch.rig import guest as rig
    from vmlaunch.runtime import control

    homes = {"Lab": api, "Vm": api, "run": api, "VmStatus": control, "Result": agent, "CommandFailed": rig,
             "QmpError": qmp}
    for name in vmlaunch.__all__:
        value = getattr(vmlaunch, name)
        assert name in dir(vmlaunch)
        if name != "__version__":
            assert value is getattr(homes.get(name, errors), name)
    assert issubclass(vmlaunch.SpecError, vmlaunch.VmlaunchError)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        vmlaunch.Nope  # noqa: B018


def test_importing_vmlaunch_imports_nothing_of_the_runtime() -> None:
    code = ("import sys, vmlaunch\n"
            "print(sorted(m for m in sys.modules if m.startswith(('vmlaunch', 'attrs'))))\n"
            "vmlaunch.Lab\n"
            "print('vmlaunch.api' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # the version's one home (vmlaunch/core/version.py) is all it reads
    assert done.stdout.splitlines() == ["['vmlaunch', 'vmlaunch.core', 'vmlaunch.core.version']", "True"]


# --- relative spec paths ---


def test_a_relative_spec_is_taken_from_the_calling_files_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    beside = write_lab(tmp_path / "helpers", "beside")
    write_lab(tmp_path / "cwd", "decoy")  # the same name in the working directory is not used
    monkeypatch.chdir(tmp_path / "cwd")
    lab = import_helper(tmp_path / "helpers").make("lab.toml")
    assert lab.spec == beside
    assert lab.name == "beside"
    assert lab.vms == ("solo",)


def test_a_relative_spec_from_a_subfolder_of_the_caller(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    beside = write_lab(tmp_path / "helpers" / "specs", "nested")
    monkeypatch.chdir(tmp_path)
    assert import_helper(tmp_path / "helpers").make(Path("specs/lab.toml")).spec == beside


def test_an_absolute_spec_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_lab(tmp_path / "specs", "absolute")
    monkeypatch.chdir(tmp_path)
    assert import_helper(tmp_path / "helpers").make(spec).spec == spec


def test_a_caller_without_a_file_takes_the_working_directory(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_lab(tmp_path, "repl")
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"vmlaunch": vmlaunch}
    exec(compile("lab = vmlaunch.Lab('lab.toml')", "<stdin>", "exec"), scope)  # as the REPL does
    assert isinstance(scope["lab"], vmlaunch.Lab)
    assert scope["lab"].spec == spec


def test_a_missing_spec_names_the_full_path_looked_at(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    helper = import_helper(tmp_path / "helpers")
    with pytest.raises(SpecError) as caught:
        helper.make("lab.toml")
    assert str(caught.value) == (
        f"{tmp_path}/helpers/lab.toml:1: cannot read the spec: No such file or directory "
        f"(a relative spec path is taken from the directory of the calling file, {helper.__file__})")


def test_a_missing_spec_that_the_working_directory_has_says_so(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    write_lab(tmp_path / "cwd", "decoy")
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(SpecError) as caught:
        import_helper(tmp_path / "helpers").make("lab.toml")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path}/helpers/lab.toml:1: cannot read the spec: No such file")
    assert message.endswith(f"; the working directory has {tmp_path}/cwd/lab.toml: "
                            "pass that absolute path)")


def test_a_missing_spec_from_the_repl_names_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as caught:
        exec(compile("vmlaunch.Lab('lab.toml')", "<stdin>", "exec"), {"vmlaunch": vmlaunch})
    assert str(caught.value) == (
        f"{tmp_path}/lab.toml:1: cannot read the spec: No such file or directory "
        "(a relative spec path is taken from the working directory, as the caller has no file)")


@pytest.mark.parametrize(("spec", "reason"), [
    ("afile/lab.toml", "Not a directory"),
    ("adir", "it is a folder, not a regular file"),
    ("lab\0.toml", "embedded null byte"),
])
def test_other_unreadable_specs_are_spec_errors(tmp_path: Path, spec: str, reason: str) -> None:
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    with pytest.raises(SpecError, match=reason):
        import_helper(tmp_path).make(spec)


# --- the fixture ---


INNER_TEST = """
from pathlib import Path

import pytest


def test_found_beside_this_file(vmlaunch_lab):
    lab = vmlaunch_lab("lab.toml")
    assert lab.spec == Path(__file__).parent / "lab.toml"
    assert lab.name == "fixture"


def test_missing_beside_this_file(vmlaunch_lab):
    from vmlaunch.errors import SpecError

    with pytest.raises(SpecError) as caught:
        vmlaunch_lab("other.toml")
    here = Path(__file__)
    assert str(caught.value) == (
        f"{here.parent}/other.toml:1: cannot read the spec: No such file or directory "
        f"(a relative spec path is taken from the directory of the test file, {here})")
"""


def test_the_fixture_takes_a_relative_spec_from_the_test_files_directory(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = pytester.path / "suite"
    write_lab(folder, "fixture")
    write_lab(pytester.path, "decoy")  # the working directory of the run: not used
    (folder / "test_inner.py").write_text(INNER_TEST)
    ups: list[Path] = []
    monkeypatch.setattr(vmlaunch.api.Lab, "up", lambda lab, *args, **kwargs: ups.append(lab.spec))
    monkeypatch.setattr(vmlaunch.api.Lab, "down", lambda lab, *args, **kwargs: None)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "suite")
    result.assert_outcomes(passed=2)
    assert ups == [folder / "lab.toml"]


# --- what a Lab object checks before anything starts ---


def test_a_missing_kernel_is_a_spec_error_at_lab(tmp_path: Path) -> None:
    spec = write_lab(tmp_path, "nokernel")
    (tmp_path / "vmlinuz").unlink()
    with pytest.raises(SpecError, match=r"lab.toml:6: vm.solo.kernel: .*/vmlinuz does not exist"):
        vmlaunch.Lab(spec)


def test_a_lab_of_some_vms_hands_out_only_those(tmp_path: Path, run_dir: Path) -> None:
    spec = write_lab(tmp_path, "some")
    spec.write_text(spec.read_text() + '[vm.other]\nmemory = "64M"\nkernel = "vmlinuz"\n')
    lab = vmlaunch.Lab(spec, ["solo"])
    assert lab.vms == ("solo",) and lab.vm("solo").name == "solo"
    with pytest.raises(vmlaunch.UsageError, match="VM other is not one of this Lab's VMs"):
        lab.vm("other")
    with pytest.raises(vmlaunch.UsageError, match="no VM named 'nope'"):
        lab.vm("nope")
    assert lab.down() is False  # not up: nothing to do, and it says so
