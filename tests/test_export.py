"""`vmlaunch export`: the exporters as pure functions (golden files per example) and the command.

The engines' own tools check the output in tests/test_export_libvirt_real.py (virt-xml-validate,
libvirtd) and tests/test_export_kubevirt.py (KubeVirt's published OpenAPI schema).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, ROOT, write_spec
from vmlaunch.cli import main
from vmlaunch.export import Export
from vmlaunch.export.kubevirt import KubevirtOptions, claim_name, export_kubevirt
from vmlaunch.export.libvirt import export_libvirt
from vmlaunch.spec.load import load_lab

GOLDEN = Path(__file__).parent / "golden" / "export"
FULL = Path(__file__).parent / "data" / "export" / "full.toml"
SPECS = [*sorted(EXAMPLES.glob("*.toml")), FULL]
LAB_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGoldenGoldenGoldenGoldenGoldenGoldenGolden vmlaunch-golden"
TWO = """
[lab]
name = "two"
[network.lan]
bridge = "vlbr-two"
[vm.a]
memory = 128
kernel = "k"
[[vm.a.nic]]
network = "lan"
[vm.b]
memory = 128
kernel = "k"
[[vm.b.nic]]
network = "lan"
"""


def two(tmp_path: Path, extra: str = "") -> Path:
    """The lab TWO (and `extra`) in `tmp_path`, with the kernel file it names."""
    (tmp_path / "k").write_bytes(b"kernel")
    return write_spec(tmp_path, TWO + extra)


def full_lab(folder: Path) -> Path:
    """tests/data/export/full.toml in `folder`, with the files it names (the command checks them)."""
    spec = folder / "full.toml"
    shutil.copy(FULL, spec)
    for name in ("guest/vmlinuz", "guest/initrd.gz", "data.img", "install.img"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x" * 512)
    (folder / "images").mkdir()
    (folder / "src").mkdir()
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(folder / "images" / "base.qcow2"), "1M"],
                   check=True)
    return spec


def export(spec: Path, target: str) -> Export:
    lab = load_lab(spec)
    if target == "libvirt":
        return export_libvirt(lab)
    return export_kubevirt(lab, options=KubevirtOptions(authorized_key=LAB_KEY))


def rendered(result: Export) -> dict[str, str]:
    """The files, and the warnings and to-dos as `problems.txt`, with this checkout's path as {ROOT}."""
    files = {file.path: file.text for file in result.files}
    files["problems.txt"] = ("".join(f"{problem}\n" for problem in result.problems)
                             + "".join(f"to do: {line}\n" for line in result.todo))
    return {name: text.replace(str(ROOT), "{ROOT}") for name, text in files.items()}


@pytest.mark.parametrize("target", ["libvirt", "kubevirt"])
@pytest.mark.parametrize("spec", SPECS, ids=[spec.stem for spec in SPECS])
def test_golden_export(spec: Path, target: str) -> None:
    """Set UPDATE_GOLDEN=1 to rewrite tests/golden/export/ after an intended change."""
    got = rendered(export(spec, target))
    folder = GOLDEN / spec.stem / target
    if os.environ.get("UPDATE_GOLDEN"):
        shutil.rmtree(folder, ignore_errors=True)
        for name, text in got.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
    golden = {str(path.relative_to(folder)): path.read_text() for path in folder.rglob("*") if path.is_file()}
    assert got == golden


@pytest.mark.parametrize("target", ["libvirt", "kubevirt"])
def test_same_spec_same_bytes(target: str, tmp_path: Path) -> None:
    first = rendered(export(FULL, target))
    assert rendered(export(FULL, target)) == first
    # The spec's own folder is the only thing of the host in the output: a copy elsewhere differs there alone
    copy = tmp_path / "full.toml"
    shutil.copy(FULL, copy)
    moved = {name: text.replace(str(tmp_path), str(FULL.parent).replace(str(ROOT), "{ROOT}"))
             for name, text in rendered(export(copy, target)).items()}
    assert moved == first


def test_every_problem_names_its_key_and_line() -> None:
    result = export(FULL, "libvirt")
    lines = FULL.read_text().splitlines()
    assert result.problems
    for problem in result.problems:
        written = lines[problem.location.line - 1]
        key = problem.location.key_path
        assert str(key[-1]) in written or written.startswith(("[", "[[")), (problem, written)


def test_the_lab_memory_budget_and_a_balloon_policy_have_no_libvirt_equivalent() -> None:
    keys = [problem.location.key_path for problem in export(FULL, "libvirt").problems]
    assert ("lab", "memory", "budget") in keys
    assert ("vm", "web", "balloon", "policy") in keys
    assert ("vm", "db", "reserve_hugepages") in keys
    assert ("lab", "memory", "ksm") not in keys  # ksm = false is <nosharepages/>


def test_libvirt_automatic_placement_asks_numad(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, TWO + '[lab.placement]\npolicy = "auto"\nbalance = true\n'
                      '[vm.c]\nmemory = 64\nkernel = "k"\nnuma_node = 1\n')
    result = export_libvirt(load_lab(spec))
    files = {file.path: file.text for file in result.files}
    assert '<vcpu placement="auto">1</vcpu>' in files["domains/a.xml"]
    assert '<memory mode="strict" placement="auto" />' in files["domains/a.xml"]
    assert '<memory mode="strict" nodeset="1" />' in files["domains/c.xml"]
    assert '<vcpu placement="static">1</vcpu>' in files["domains/c.xml"]
    assert [p.location.key_path for p in result.problems] == [("lab", "placement", "balance")]
    assert any("numad" in line for line in result.todo)


def test_libvirt_bridge_mode_for_an_existing_bridge(tmp_path: Path) -> None:
    lab = load_lab(write_spec(tmp_path, TWO))
    managed = {f.path: f.text for f in export_libvirt(lab).files}["networks/lan.xml"]
    assert "<forward" not in managed and '<bridge name="vlbr-two" stp="off" delay="0" />' in managed
    existing = export_libvirt(lab, existing_bridges={"lan"})
    text = {f.path: f.text for f in existing.files}["networks/lan.xml"]
    assert '<forward mode="bridge" />' in text and '<bridge name="vlbr-two" />' in text
    assert existing.todo == ("network lan: the libvirt host needs the bridge vlbr-two",)


def test_libvirt_a_pci_stub_device_is_exported_for_vfio(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, '[lab]\nname = "p"\n[vm.a]\nmemory = 64\nkernel = "k"\n'
                      '[[vm.a.pci]]\nhost = "15:00.0"\ndriver = "pci-stub"\n')
    result = export_libvirt(load_lab(spec))
    assert '<driver name="vfio" />' in result.files[0].text
    assert '<address domain="0x0000" bus="0x15" slot="0x00" function="0x0" />' in result.files[0].text
    assert [str(p) for p in result.problems] == [
        f"{spec}:8: vm.a.pci[0].driver: libvirt assigns devices with vfio-pci only (legacy pci-stub "
        "assignment is gone from QEMU): exported as vfio-pci"]


def test_libvirt_only_the_vms_named_and_their_networks(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, TWO + '[network.other]\nbridge = "vlbr-other"\n'
                      '[vm.c]\nmemory = 64\nkernel = "k"\n[[vm.c.nic]]\nnetwork = "other"\n')
    result = export_libvirt(load_lab(spec), ["c"])
    assert [file.path for file in result.files] == ["networks/other.xml", "domains/c.xml"]


def test_kubevirt_refs_name_what_the_cluster_has(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, TWO + '[[vm.a.disk]]\nfile = "a.img"\n[[vm.a.pci]]\nhost = "15:00.0"\n')
    refs = {"vm.a.kernel": "registry.example/kernels/guest:1",
            "vm.a.disk[0]": "containerdisk:registry.example/a:1", "vm.a.pci[0]": "example.com/NIC"}
    result = export_kubevirt(load_lab(spec), ["a"], KubevirtOptions(refs=refs, namespace="lab"))
    vm = {f.path: f.text for f in result.files}["vms/a.yaml"]
    assert "image: registry.example/kernels/guest:1" in vm
    assert "containerDisk:\n          image: registry.example/a:1" in vm
    assert "deviceName: example.com/NIC" in vm
    assert "namespace: lab" in vm
    assert result.problems == ()


@pytest.mark.parametrize(("refs", "message"), [
    ({"vm.a.disk[3]": "pvc:x"}, "--ref vm.a.disk[3]: no such key in what is exported"),
    ({"vm.a.kernel": "x", "vm.zz.kernel": "y"}, "--ref vm.zz.kernel: no such key"),
])
def test_kubevirt_a_ref_to_nothing_is_a_usage_error(tmp_path: Path, refs: dict[str, str],
                                                    message: str) -> None:
    from vmlaunch.errors import UsageError

    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")) as caught:
        export_kubevirt(load_lab(write_spec(tmp_path, TWO)), options=KubevirtOptions(refs=refs))
    assert caught.value.hint is not None and "vm.a.kernel" in caught.value.hint


def test_kubevirt_ovn_layer2_spans_nodes(tmp_path: Path) -> None:
    lab = load_lab(write_spec(tmp_path, TWO))
    result = export_kubevirt(lab, options=KubevirtOptions(ovn_layer2=frozenset({"lan"}), namespace="team"))
    nad = {f.path: f.text for f in result.files}["networks/lan.yaml"]
    assert '"type": "ovn-k8s-cni-overlay"' in nad and '"topology": "layer2"' in nad
    assert '"netAttachDefName": "team/two-lan"' in nad
    bridged = {f.path: f.text for f in export_kubevirt(lab).files}["networks/lan.yaml"]
    assert '"type": "bridge"' in bridged and '"bridge": "vlbr-two"' in bridged


def test_kubevirt_claims_are_dns_labels() -> None:
    assert claim_name("Lenny64_orig.IMG") == "lenny64-orig-img"
    assert claim_name("...") == "disk"


# --------------------------------------------------------------------------- the command


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, check=False)


def test_export_writes_the_files_and_says_what_next(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "lab.toml", tmp_path / "lab.toml")
    (tmp_path / "guest").symlink_to(EXAMPLES / "guest")
    done = run("export", "lab.toml", "--to", "libvirt", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "export-demo-libvirt"  # the default: beside where the user is
    assert done.stdout.split() == [f"export-demo-libvirt/{name}" for name in
                                   ("networks/lan.xml", "domains/alpha.xml", "domains/beta.xml")]
    assert "warning: " in done.stderr and "network.out.forward" in done.stderr
    assert "virsh net-define" in done.stderr and "Traceback" not in done.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        ".vmlaunch-export", "domains", "domains/alpha.xml", "domains/beta.xml", "networks",
        "networks/lan.xml"]
    assert oct((out / "domains" / "alpha.xml").stat().st_mode & 0o777) == "0o644"


def test_export_again_replaces_what_the_lab_no_longer_has(tmp_path: Path) -> None:
    spec = two(tmp_path)
    out = tmp_path / "out"
    assert run("export", str(spec), "--to", "libvirt", "--out", str(out)).returncode == 0
    (out / "mine.txt").write_text("a user's file")
    assert run("export", str(spec), "b", "--to", "libvirt", "--out", str(out)).returncode == 0
    assert (out / "domains" / "a.xml").exists()  # only b exported: a's file stays
    spec.write_text(TWO.replace("[vm.b]", "[vm.c]").replace("vm.b.nic", "vm.c.nic"))
    assert run("export", str(spec), "--to", "libvirt", "--out", str(out)).returncode == 0
    assert sorted(p.name for p in (out / "domains").iterdir()) == ["a.xml", "c.xml"]
    assert (out / "mine.txt").read_text() == "a user's file"  # never what vmlaunch did not write


def test_a_forged_manifest_or_a_linked_subfolder_reaches_nothing_outside(tmp_path: Path) -> None:
    """Only names an export writes are ever removed, and never through a symbolic link."""
    spec = two(tmp_path)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (elsewhere / "keep.xml").write_text("keep")
    (out / ".vmlaunch-export").write_text(json.dumps(
        {"lab": "two", "target": "libvirt", "files": [str(victim), "domains/keep.xml", "../victim"]}))
    (out / "domains").symlink_to(elsewhere)
    done = run("export", str(spec), "--to", "libvirt", "--out", str(out))
    assert done.returncode == 4 and "is a symbolic link" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.xml"]
    (out / "domains").unlink()
    assert run("export", str(spec), "--to", "libvirt", "--out", str(out)).returncode == 0
    assert victim.read_text() == "keep" and (elsewhere / "keep.xml").read_text() == "keep"


def test_strict_is_exit_3_with_every_setting_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = full_lab(tmp_path)
    done = run("export", str(spec), "--to", "libvirt", "--strict", "--out", str(out))
    assert done.returncode == 3, done.stderr
    count = len(export(FULL, "libvirt").problems)
    assert f"libvirt has no equivalent for {count} settings of the spec (--strict)" in done.stderr
    assert f"{spec}:9: lab.memory.budget: " in done.stderr
    assert not out.exists() and done.stdout == ""


@pytest.mark.parametrize(("args", "code", "message"), [
    (["export", "SPEC"], 64, "the following arguments are required: --to"),
    (["export", "SPEC", "--to", "xen"], 64, "invalid choice: 'xen'"),
    (["export", "SPEC", "gamma", "--to", "libvirt"], 64, "no VM named 'gamma'"),
    (["export", "SPEC", "--to", "libvirt", "--ovn-layer2", "lan"], 64, "--ovn-layer2: not for --to libvirt"),
    (["export", "SPEC", "--to", "kubevirt", "--existing-bridge", "lan"], 64,
     "--existing-bridge: not for --to kubevirt"),
    (["export", "SPEC", "--to", "libvirt", "--existing-bridge", "wan"], 64,
     "--existing-bridge wan: no such network"),
    (["export", "SPEC", "--to", "kubevirt", "--ovn-layer2", "wan"], 64, "--ovn-layer2 wan: no such network"),
    (["export", "SPEC", "--to", "kubevirt", "--ref", "vm.a.kernel"], 64, "KEY=VALUE"),
    (["export", "SPEC", "--to", "kubevirt", "--ref", "vm.a.disk[0]=nfs:x"], 64,
     "--ref vm.a.disk[0]: no such key"),
    (["export", "SPEC", "--to", "libvirt", "--out", "FILE/out"], 4, "cannot write the export to"),
])
def test_mistakes_are_messages_with_exit_codes(tmp_path: Path, args: list[str], code: int, message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    spec = two(tmp_path)
    (tmp_path / "FILE").write_text("not a folder")
    argv = [str(spec) if arg == "SPEC" else arg.replace("FILE", str(tmp_path / "FILE")) for arg in args]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_folder_of_another_export_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = two(tmp_path)
    out = str(tmp_path / "out")
    assert main(["export", str(spec), "--to", "kubevirt", "--out", out]) == 0
    assert main(["export", str(spec), "--to", "libvirt", "--out", out]) == 64
    assert "holds the kubevirt export of lab two" in capsys.readouterr().err


def test_kubevirt_export_carries_the_labs_ssh_key(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, '[lab]\nname = "k"\n[image.i]\nfile = "base.qcow2"\n'
                      '[vm.web]\nmemory = 256\nimage = "i"\n')
    (tmp_path / "base.qcow2").write_bytes(b"QFI\xfb" + bytes(508))
    out = tmp_path / "out"
    done = run("export", str(spec), "--to", "kubevirt", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "the lab has no SSH key yet" in done.stderr
    key_dir = tmp_path / ".vmlaunch" / "k" / "ssh"
    key_dir.mkdir(parents=True)
    (key_dir / "id_ed25519.pub").write_text(LAB_KEY + "\n")
    assert run("export", str(spec), "--to", "kubevirt", "--out", str(out)).returncode == 0
    assert LAB_KEY in (out / "vms" / "web.yaml").read_text()


def test_the_help_names_the_engines() -> None:
    done = run("export", "--help")
    assert done.returncode == 0
    assert "--to ENGINE" in done.stdout and "kubectl apply" in done.stdout and "--strict" in done.stdout


def test_libvirt_export_says_which_lab_files_up_makes(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, '[lab]\nname = "k"\n[image.i]\nfile = "base.qcow2"\n'
                      '[vm.web]\nmemory = 256\nimage = "i"\nfirmware = "uefi"\n')
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "base.qcow2"), "1M"],
                   check=True)
    done = run("export", str(spec), "--to", "libvirt", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    lab_dir = tmp_path / ".vmlaunch" / "k"
    assert (f"to do: the domains use files `vmlaunch up {spec}` makes in {lab_dir} (overlays, seeds), which "
            f"are not there yet: {lab_dir}/web/disk.qcow2, {lab_dir}/web/seed.iso") in done.stderr
    domain = (tmp_path / "out" / "domains" / "web.xml").read_text()
    assert f"<nvram>{lab_dir}/web/nvram.fd</nvram>" in domain and '<os firmware="efi">' in domain
    assert not lab_dir.exists()  # export makes nothing beside the spec


@pytest.mark.parametrize(("target", "said", "absent"), [
    ("libvirt", "domains/*.xml; do virsh define", "networks/"),
    ("kubevirt", "kubectl apply -f", "networks"),
])
def test_the_next_step_names_only_what_was_written(tmp_path: Path, target: str, said: str,
                                                    absent: str) -> None:
    (tmp_path / "k").write_bytes(b"kernel")
    spec = write_spec(tmp_path, '[lab]\nname = "solo"\n[vm.a]\nmemory = 128\nkernel = "k"\n')
    done = run("export", str(spec), "--to", target, "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    step = next(line for line in done.stderr.splitlines() if said in line)
    assert absent not in step


def test_a_lab_with_only_socket_networks_is_told_no_network_step(tmp_path: Path) -> None:
    """No network XML is written for a socket network: the next step names no net-define, net-start."""
    (tmp_path / "k").write_bytes(b"kernel")
    spec = write_spec(tmp_path, '[lab]\nname = "sock"\n[network.lan]\ntype = "socket"\n'
                      '[vm.a]\nmemory = 128\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "lan"\n')
    done = run("export", str(spec), "--to", "libvirt", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "out" / "networks").exists()
    step = next(line for line in done.stderr.splitlines() if "define them:" in line)
    assert step.endswith(f'for f in {tmp_path / "out"}/domains/*.xml; do virsh define "$f"; done '
                         "(then virsh start)"), step


@pytest.mark.parametrize(("line", "model", "graphics"), [
    ("", "vga", None), ('video = "virtio"\n', "virtio", None), ('video = "none"\n', "none", False)])
def test_the_screen_is_exported(tmp_path: Path, line: str, model: str, graphics: bool | None) -> None:
    import yaml

    spec = write_spec(tmp_path, f'[lab]\nname = "s"\n[vm.a]\nmemory = 64\nkernel = "k"\n{line}')
    lab = load_lab(spec)
    domain = export_libvirt(lab).files[0].text
    assert f'<video>\n      <model type="{model}" />\n    </video>' in domain
    assert "<graphics" not in domain  # as vmlaunch: a screen to read, never a window or a VNC port
    kubevirt = export_kubevirt(lab, options=KubevirtOptions(authorized_key=LAB_KEY))
    vm = next(yaml.safe_load(f.text) for f in kubevirt.files if "VirtualMachine\n" in f.text)
    assert vm["spec"]["template"]["spec"]["domain"]["devices"].get("autoattachGraphicsDevice") == graphics
    unmapped = [p.location.key_path for p in kubevirt.problems if p.location.key_path[-1:] == ("video",)]
    assert unmapped == ([("vm", "a", "video")] if model == "virtio" else [])
