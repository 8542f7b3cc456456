"""`vmlaunch init`: the starter lab.toml validates as written, for every catalog image, network type, with
and without SSH; it refuses to replace what is there (never through a symlink); names from the user
cannot inject TOML (spec/starter.py and cli/init.py)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from vmlaunch.cli import build_parser, main
from vmlaunch.cli import init as init_cli
from vmlaunch.core.naming import interface_name_problem
from vmlaunch.spec import catalog, starter
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import Firmware, LabSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENTRIES = [name for name, entry in catalog.entries().items() if catalog.host_arch() in entry.builds]
NETWORKS = [kind.value for kind in starter.NetworkKind]


def init(*args: str) -> int:
    return main(["init", *args])


def loaded(folder: Path) -> LabSpec:
    return load_lab(folder / "lab.toml")


@pytest.mark.parametrize("vms", [1, 3])
@pytest.mark.parametrize("ssh", [False, True], ids=["no-ssh", "ssh"])
@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("image", ENTRIES)
def test_every_catalog_image_validates_on_every_network(tmp_path: Path, image: str, network: str, ssh: bool,
                                                        vms: int, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "my-lab"
    assert init(str(folder), "--image", image, "--network", network, "--vms", str(vms),
                *(["--ssh"] if ssh else [])) == 0
    assert capsys.readouterr().out == f"{folder / 'lab.toml'}\n"
    assert main(["validate", str(folder / "lab.toml")]) == 0  # the files checked too, as a user runs it
    lab = loaded(folder)
    entry = catalog.entries()[image]
    assert lab.name == "my-lab"
    assert [vm.name for vm in lab.vms] == [f"vm{i}" for i in range(1, vms + 1)]
    assert [image.catalog for image in lab.images] == [image]
    (net,) = lab.networks
    assert net.type.value == network
    written = tomllib.loads((folder / "lab.toml").read_text())
    for index, vm in enumerate(lab.vms):
        assert vm.image == starter.image_name(entry)
        assert vm.ssh  # an image's VMs always have SSH; --ssh says it (the tour)
        assert vm.cloud_init is not None
        assert [nic.network for nic in vm.nics] == [net.name]
        if network != "user":
            assert vm.nics[0].ip is not None and vm.nics[0].ip.split("/")[0] == f"10.10.0.{11 + index}"
        # what the image needs: UEFI written out, a CPU model newer than the TCG default where it needs one
        assert (vm.firmware is Firmware.UEFI) is (entry.firmware == "uefi")
        assert ("firmware" in written["vm"][vm.name]) is (entry.firmware == "uefi")
        assert vm.cpu_model == ("max" if entry.cpu_level == "x86-64-v3" else None)
        assert vm.memory_mib >= 1024 and vm.cpus == 2
    if entry.cpu_level == "x86-64-v2":
        assert "the default gives" in (folder / "lab.toml").read_text()


@pytest.mark.guest_files
@pytest.mark.parametrize("vms", [1, 3])
@pytest.mark.parametrize("network", NETWORKS)
def test_the_tiny_test_guest_validates_on_every_network(tmp_path: Path, network: str, vms: int,
                                                        test_guest: Path) -> None:
    folder = tmp_path / "tiny"
    assert init(str(folder), "--network", network, "--vms", str(vms)) == 0
    assert main(["validate", str(folder / "lab.toml")]) == 0
    lab = loaded(folder)
    assert len(lab.vms) == vms
    for vm in lab.vms:
        assert vm.kernel is not None and vm.kernel.samefile(test_guest / "vmlinuz")
        assert vm.initrd is not None and vm.initrd.samefile(test_guest / "initrd.gz")
        assert vm.image is None and not vm.ssh
        assert vm.append is not None and ("vl.ip=eth0:10.0.2.15/24" in vm.append) is (network == "user")


def test_defaults_one_vm_on_a_socket_network_in_the_current_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "Web Lab"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert init("--image", "debian-12") == 0
    out, err = capsys.readouterr()
    assert out == "lab.toml\n"
    assert os.listdir(folder) == ["lab.toml"]  # and nothing else
    assert stat.S_IMODE(os.stat(folder / "lab.toml").st_mode) == 0o644
    lab = loaded(folder)
    assert lab.name == "web-lab"
    assert [vm.name for vm in lab.vms] == ["vm1"]
    assert lab.networks[0].type.value == "socket"
    assert lab.vms[0].ssh  # with cloud-init, SSH and a network between them
    assert "vmlaunch: next: vmlaunch up lab.toml --wait ssh\n" in err
    assert "vmlaunch ssh lab.toml vm1" in err


@pytest.mark.guest_files
def test_next_commands_are_told_on_standard_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  test_guest: Path) -> None:
    folder = tmp_path / "web"
    assert init(str(folder), "--image", "debian-12", "--vms", "2", "--ssh", "--network", "bridge") == 0
    assert capsys.readouterr().err.splitlines() == [
        "vmlaunch: lab web: vm1, vm2 (Debian 12 (bookworm), generic cloud image) on a bridge network",
        f"vmlaunch: next: vmlaunch up {folder}/lab.toml --wait ssh (as root: the bridge needs it)",
        f"vmlaunch: then: vmlaunch ssh {folder}/lab.toml vm1"]
    tiny = tmp_path / "tiny"
    assert init(str(tiny)) == 0
    err = capsys.readouterr().err
    assert f"next: vmlaunch up {tiny}/lab.toml --wait-for VMLAUNCH-GUEST-READY\n" in err
    assert f"then: vmlaunch console {tiny}/lab.toml vm1" in err
    assert main(["-q", "init", str(tmp_path / "quiet")]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.guest_files
def test_init_then_cmdline(tmp_path: Path, capsys: pytest.CaptureFixture[str], qemu_binary: str,
                           test_guest: Path) -> None:
    """What init writes compiles: a QEMU command line per VM (nothing boots, nothing is downloaded)."""
    for args in (["--image", "debian-12", "--vms", "2", "--ssh"], ["--image", "alpine-3.22-uefi"],
                 ["--image", "almalinux-10", "--network", "user"], ["--vms", "2"]):
        folder = tmp_path / f"lab{len(os.listdir(tmp_path))}"
        assert init(str(folder), *args) == 0
        capsys.readouterr()
        assert main(["cmdline", str(folder / "lab.toml"), "--json"]) == 0
        import json

        argvs = json.loads(capsys.readouterr().out)
        assert list(argvs) == [vm.name for vm in loaded(folder).vms]
        if "almalinux-10" in args:
            assert argvs["vm1"][argvs["vm1"].index("-cpu") + 1] == "max"
        assert sorted(os.listdir(folder)) == ["lab.toml"]  # cmdline writes nothing either


def test_an_existing_lab_toml_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lab.toml").write_text("# mine\n")
    assert init(str(tmp_path), "--image", "debian-12") == 64
    err = capsys.readouterr().err
    assert (f"vmlaunch: error: {tmp_path}/lab.toml exists (a file): init writes a new lab and replaces "
            "nothing") in err
    assert "hint: --force overwrites it" in err
    assert (tmp_path / "lab.toml").read_text() == "# mine\n"


def test_force_overwrites_lab_toml(tmp_path: Path) -> None:
    (tmp_path / "lab.toml").write_text("# mine\n")
    os.chmod(tmp_path / "lab.toml", 0o600)
    assert init(str(tmp_path), "--image", "debian-12", "--force") == 0
    assert loaded(tmp_path).vms[0].image == "debian-12"
    assert stat.S_IMODE(os.stat(tmp_path / "lab.toml").st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["lab.toml"]  # no temp file left


def test_a_symlinked_lab_toml_is_not_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path / "precious.txt"
    elsewhere.write_text("keep me\n")
    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / "lab.toml").symlink_to(elsewhere)
    assert init(str(folder), "--image", "debian-12") == 64
    assert "exists (a symlink)" in capsys.readouterr().err
    assert init(str(folder), "--image", "debian-12", "--force") == 0
    assert elsewhere.read_text() == "keep me\n"
    assert not (folder / "lab.toml").is_symlink()
    assert loaded(folder).name == "lab"
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "lab.toml").symlink_to(tmp_path / "nowhere.toml")
    assert init(str(dangling), "--image", "debian-12") == 64
    assert not (tmp_path / "nowhere.toml").exists()


def test_another_spec_in_the_folder_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "web.toml").write_text('[lab]\nname = "web"\n[vm.a]\nmemory = 256\n')
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')  # not a spec: no matter
    assert init(str(tmp_path), "--image", "debian-12") == 64
    err = capsys.readouterr().err
    assert f"{tmp_path} already holds a vmlaunch spec, web.toml" in err
    assert not (tmp_path / "lab.toml").exists()
    assert init(str(tmp_path), "--image", "debian-12", "--force") == 0
    assert (tmp_path / "web.toml").read_text().startswith("[lab]")
    assert loaded(tmp_path).vms[0].image == "debian-12"


def test_a_dir_that_cannot_be_a_lab_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    odd = tmp_path / "two\nlines"
    odd.write_text("")
    assert init(str(odd), "--image", "debian-12") == 64
    first = capsys.readouterr().err.splitlines()[0]
    assert first == f'vmlaunch: error: "{tmp_path}/two\\nlines" is not a folder'
    afile = tmp_path / "a-file"
    afile.write_text("")
    assert init(str(afile), "--image", "debian-12") == 64
    assert f"vmlaunch: error: {afile} is not a folder" in capsys.readouterr().err
    assert init(str(afile / "below"), "--image", "debian-12") == 64
    assert f"cannot make the folder {afile}/below" in capsys.readouterr().err
    assert init("/proc/vmlaunch-init-test", "--image", "debian-12") == 64  # even root cannot make it
    assert "cannot make the folder /proc/vmlaunch-init-test" in capsys.readouterr().err
    (tmp_path / "lab" / "lab.toml").mkdir(parents=True)
    assert init(str(tmp_path / "lab"), "--image", "debian-12", "--force") == 64
    assert "lab.toml is a folder" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder")
def test_a_folder_that_is_not_writable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path.chmod(0o500)
    try:
        assert init(str(tmp_path), "--image", "debian-12") == 64
        assert f"cannot write in {tmp_path}: permission denied" in capsys.readouterr().err
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize("count", ["0", "65", "-1", "two", "1.5", ""])
def test_bad_vms(tmp_path: Path, count: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert init(str(tmp_path / "x"), "--vms", count) == 64
    assert f"argument --vms: {count!r} is not a number of VMs from 1 to 64" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bad_network(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert init(str(tmp_path), "--network", "tap") == 64
    assert "argument --network: invalid choice: 'tap'" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "near"), [("debain-12", "did you mean debian-12 or debian-13"),
                                            ("ubuntu", "did you mean ubuntu-24.04 or ubuntu-22.04?"),
                                            ("zzz", "`vmlaunch init --list` shows the images")])
def test_an_unknown_image_names_the_closest(tmp_path: Path, name: str, near: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert init(str(tmp_path / "x"), "--image", name) == 64
    err = capsys.readouterr().err
    assert f"vmlaunch: error: {name!r} is not in the image catalog" in err
    assert near in err
    assert not (tmp_path / "x").exists()


def test_ssh_needs_an_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert init(str(tmp_path / "x"), "--ssh") == 64
    err = capsys.readouterr().err
    assert "--ssh needs --image NAME: the tiny test guest has no SSH server" in err
    assert "vmlaunch exec SPEC VM -- CMD" in err
    assert not (tmp_path / "x").exists()


def test_the_test_guest_not_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "tools").mkdir(parents=True)
    (checkout / "tools" / "build_guest.py").write_text("")
    monkeypatch.setattr(init_cli, "_checkout", lambda: checkout)
    assert init(str(tmp_path / "x")) == 3
    err = capsys.readouterr().err
    assert f"the tiny test guest is not built: {checkout}/examples/guest has no vmlinuz or initrd.gz" in err
    assert "`make setup`" in err and "tools/build_guest.py" in err
    assert not (tmp_path / "x").exists()
    (checkout / "tools" / "build_guest.py").unlink()
    assert init(str(tmp_path / "x")) == 3
    assert "comes with a checkout of vmlaunch's repository" in capsys.readouterr().err


def test_list_shows_the_choices_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert init("--list") == 0
    out = capsys.readouterr().out
    assert os.listdir(tmp_path) == []
    lines = out.splitlines()
    for name in ENTRIES:
        entry = catalog.entries()[name]
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert entry.version in line and entry.title in line and (entry.needs or "-") in line
    assert any(line.split()[:2] == ["(no", "--image)"] and "tiny test guest" in line for line in lines)
    for kind in starter.NetworkKind:
        assert any(line.split()[:1] == [kind.value] and kind.summary in line for line in lines)
    assert "socket (default)" in out


@pytest.mark.parametrize(("folder", "name"), [
    ("web", "web"), ("My Lab", "my-lab"), ("Café Lab ☃", "cafe-lab"), ("日本", "lab"), ("---", "lab"),
    ("", "lab"), ("a" * 40, "a" * 20), ("abcdefghijklmnopqrs-tuvw", "abcdefghijklmnopqrs"),
    ('x"\n[vm.evil]\nmemory = 1', "x-vm-evil-memory-1"), ("lab_2024.v1", "lab-2024-v1"),
])
def test_the_lab_name_follows_the_spec_rule(folder: str, name: str) -> None:
    assert starter.lab_name(folder) == name
    assert starter.LAB_NAME.fullmatch(name)


@pytest.mark.parametrize("folder", ['q"uote', 'new\nline [vm.evil]\nmemory = "1G"', "tab\there",
                                    'back\\slash', "ünï cödé ✓", '"""', "#comment", "]]", "\x7f\x01"])
@pytest.mark.guest_files
def test_a_folder_name_cannot_inject_toml(tmp_path: Path, folder: str, test_guest: Path) -> None:
    target = tmp_path / folder
    assert init(str(target), "--image", "debian-12", "--vms", "2", "--ssh") == 0
    doc = tomllib.loads((target / "lab.toml").read_text())
    assert sorted(doc) == ["image", "lab", "network", "vm"]
    assert sorted(doc["vm"]) == ["vm1", "vm2"]
    assert starter.LAB_NAME.fullmatch(doc["lab"]["name"])
    assert init(str(target / "tiny")) == 0
    assert sorted(tomllib.loads((target / "tiny" / "lab.toml").read_text())["vm"]) == ["vm1"]


@pytest.mark.parametrize("path", ['/srv/x"\n[vm.evil]\nmemory = 1\n', "/srv/back\\slash/\ttab",
                                  "/srv/\x7f\x00\x1b", "/srv/ünï cödé ✓", "/srv/'''"])
def test_a_guest_path_is_written_as_a_toml_string(path: str) -> None:
    text = starter.lab_text(starter.Starter(lab="lab", vms=2, guest=Path(path)))
    doc = tomllib.loads(text)
    assert sorted(doc["vm"]) == ["vm1", "vm2"]
    assert doc["vm"]["vm1"]["kernel"] == str(Path(path) / "vmlinuz")
    with pytest.raises(ValueError, match="not UTF-8"):
        starter.toml_string("/srv/\udcff")


def test_bridge_names_fit_an_interface_name() -> None:
    assert starter.bridge_name("web") == "vlbr-web"
    assert starter.bridge_name("abcdefghij") == "vlbr-abcdefghij"
    long_names = ["abcdefghijk", "abcdefghijkl", "a" * 20, "abcd-fghijklmnopqrst"]
    bridges = [starter.bridge_name(name) for name in long_names]
    assert len(set(bridges)) == len(bridges)
    for bridge in bridges:
        assert interface_name_problem(bridge) is None and len(bridge) <= 15 and "--" not in bridge


def test_the_starter_refuses_what_cannot_be_written() -> None:
    entry = catalog.entries()["debian-12"]
    with pytest.raises(ValueError):
        starter.Starter(lab="lab", vms=0, image=entry)
    with pytest.raises(ValueError):
        starter.Starter(lab="lab", vms=starter.MAX_VMS + 1, image=entry)
    with pytest.raises(ValueError):
        starter.Starter(lab="lab", ssh=True, guest=Path("/g"))
    with pytest.raises(ValueError):
        starter.Starter(lab="lab")
    with pytest.raises(ValueError):
        starter.Starter(lab="Not A Name", image=entry)
    assert len(starter.Starter(lab="lab", vms=starter.MAX_VMS, image=entry).vm_names) == 64


def test_the_command_line_and_the_starter_agree() -> None:
    """cli/init.py keeps its choices apart, so that building the parser imports argparse only."""
    assert tuple(kind.value for kind in starter.NetworkKind) == init_cli.NETWORKS
    assert init_cli.NETWORKS[0] == starter.DEFAULT_NETWORK.value
    assert init_cli.MAX_VMS == starter.MAX_VMS


def test_init_is_completed() -> None:
    from vmlaunch.cli.completion import Kind, describe

    (command,) = [command for command in describe(build_parser()).commands if command.name == "init"]
    assert [value.kind for value in command.arguments] == [Kind.DIR]
    options = {name: option for option in command.options for name in option.names}
    network = options["--network"].value
    assert network is not None and network.choices == ("socket", "user", "bridge")
    assert {"--image", "--vms", "--ssh", "--force", "--list"} <= set(options)


def test_every_comment_points_to_a_page_of_the_manual(tmp_path: Path) -> None:
    """The pages the comments name exist (the catalog's page is being written beside this command)."""
    root = Path(__file__).resolve().parent.parent
    for where in starter.MANUAL.values():
        page = where.split("(", 1)[1].rstrip(")").split("#")[0]
        assert (root / page).is_file() or page == "docs/guides/catalog.md", page


def test_the_first_real_guest_shows_what_init_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tutorial's spec is the file `vmlaunch init --image debian-12 --vms 2 --ssh` writes in `web`,
    and the README's tour starts from the same command."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "getting-started" / "first-real-guest.md").read_text()
    command = "vmlaunch init --image debian-12 --vms 2 --ssh"
    assert f"mkdir web && cd web\n{command}\n" in page
    folder = tmp_path / "web"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert main(command.split()[1:]) == 0
    written = (folder / "lab.toml").read_text()
    assert f"```toml\n{written}```\n" in page
    tour = (root / "README.md").read_text().split("## A 60-second tour", 1)[1]
    block = tour.split("```sh\n", 1)[1].split("```")[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == [command, "vmlaunch up lab.toml --wait ssh", "vmlaunch ssh lab.toml vm1"]
