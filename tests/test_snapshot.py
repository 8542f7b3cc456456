"""Snapshots of a whole lab (`vmlaunch/saved/snapshot.py`, `vmlaunch snapshot`, `up --from-snapshot`).

What a snapshot may hold and the refusals are checked on specs alone; the rest on one booted lab of
two test guests under TCG (a socket network: nothing is created on the host), shared by the tests
below: save, restore, list, delete, a failing save, then down and a warm start. Each names the state
it starts from by its fixture (`rig`: up with the one snapshot "first"; `unsaved`, `down`,
`down_saved_twice`), which brings the lab there, so they pass in any order."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import EXAMPLES, fake_host
from vmlaunch.cli import main
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.errors import RuntimeFailure, UsageError
from vmlaunch.host.facts import Ovmf
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.dirs import run_root
from vmlaunch.layout.rundir import RunDir
from vmlaunch.runtime import executor
from vmlaunch.saved import snapshot
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import LabSpec

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"
VM = """
[vm.NAME]
memory = "128M"
accel = "tcg"
kernel = "GUEST/vmlinuz"
initrd = "GUEST/initrd.gz"
[[vm.NAME.disk]]
file = "NAME.qcow2"
size = "16M"
format = "qcow2"
[[vm.NAME.nic]]
network = "lan"
"""
SPEC = '[lab]\nname = "snap"\n[network.lan]\ntype = "socket"\n' + VM.replace("NAME", "a") + \
    VM.replace("NAME", "b")


def lab_of(tmp_path: Path, text: str, name: str = "lab.toml") -> LabSpec:
    spec = tmp_path / name
    spec.write_text(text)
    return load_lab(spec)


# --- what a snapshot holds, and what it refuses (specs only) --------------------------------------------


REFUSED = """[lab]
name = "refused"
[vm.a]
memory = "64M"
[[vm.a.disk]]
file = "a.img"
[[vm.a.disk]]
file = "base.img"
readonly = true
[[vm.a.share]]
source = "src"
target = "/srv"
[vm.b]
memory = "64M"
[[vm.b.pci]]
host = "01:00.0"
[[vm.b.disk]]
file = "b.qcow2"
[vm.c]
memory = "64M"
kernel = "vmlinuz"
"""


def test_every_reason_is_given_at_once_with_its_line(tmp_path: Path) -> None:
    lab = lab_of(tmp_path, REFUSED)
    with pytest.raises(snapshot.SnapshotRefused) as caught:
        snapshot.check(lab, ["a", "b", "c"], running={"a": 1})
    lines = caught.value.message.splitlines()
    spec = tmp_path / "lab.toml"
    assert lines[0] == "cannot snapshot lab refused:"
    assert lines[1].startswith(f"{spec}:5: vm.a.disk[0]: the raw disk {tmp_path / 'a.img'} cannot hold a "
                               "snapshot: only qcow2 keeps internal snapshots")
    assert lines[2].startswith(f"{spec}:10: vm.a.share[0]: the 9p share of {tmp_path / 'src'} cannot be "
                               "snapshotted: QEMU blocks migration, and so the saving of RAM, while the "
                               "guest has it mounted")
    assert lines[3].startswith(f"{spec}:15: vm.b.pci[0]: the passed-through PCI device 0000:01:00.0 cannot "
                               "be snapshotted")
    assert lines[4] == f"{spec}:13: vm.b: VM b is not running"
    assert lines[5].startswith(f"{spec}:19: vm.c: VM c has no writable qcow2 disk to hold its RAM")
    assert lines[6] == f"{spec}:19: vm.c: VM c is not running"
    assert len(lines) == 7  # the read-only raw disk is not a reason: it is not in the snapshot
    assert "bring the lab up first" in str(caught.value.hint)
    with pytest.raises(snapshot.SnapshotRefused, match="cannot snapshot lab refused: it has no VM"):
        snapshot.check(lab, [])


GUEST = """[lab]
name = "real"
[image.base]
file = "base.qcow2"
[vm.web]
memory = "256M"
image = "base"
firmware = "uefi"
[[vm.web.disk]]
file = "data.qcow2"
[[vm.web.disk]]
file = "iso.img"
readonly = true
[[vm.web.disk]]
file = "more.qcow2"
"""


def test_the_snapshot_holds_the_writable_qcow2_nodes_the_compiler_made(tmp_path: Path) -> None:
    """The overlay is disk0 and holds the RAM; the seed, the UEFI pflash and a read-only disk are left
    out, so neither stops a snapshot. The node names are those of the compiled argv."""
    lab = lab_of(tmp_path, GUEST)
    disks = snapshot.check(lab, ["web"])["web"]
    overlay = tmp_path / ".vmlaunch" / "real" / "web" / "disk.qcow2"
    assert [(d.node, d.file) for d in disks.disks] == [
        ("disk0", overlay), ("disk1", tmp_path / "data.qcow2"), ("disk3", tmp_path / "more.qcow2")]
    assert disks.vmstate == "disk0" and disks.devices == ["disk0", "disk1", "disk3"]
    host = fake_host(ovmf=Ovmf(Path("/usr/share/OVMF/OVMF_CODE_4M.fd"), Path("/usr/share/OVMF/VARS.fd")))
    argv = compile_lab(lab, host).vm("web").argv
    nodes = [json.loads(value) for option, value in zip(argv, argv[1:]) if option == "-blockdev"]
    files = {node["node-name"]: node.get("filename") for node in nodes if node["driver"] == "file"}
    writable_qcow2 = [(node["node-name"], Path(files[node["file"]])) for node in nodes
                      if node["driver"] == "qcow2" and not node["read-only"]]
    assert writable_qcow2 == [(d.node, d.file) for d in disks.disks]
    assert {"seed", "fw-vars"} <= {node["node-name"] for node in nodes}  # there, and not in it


def test_names_of_any_script_but_not_numbers() -> None:
    """A number would be taken for a snapshot's ID by a load; delete goes by name, so it takes one."""
    for good in ("before-upgrade.2", "2026-11-22", "vor-Änderung_ü", "v1", "x" * 64, "快照"):
        assert snapshot.check_name(good) == good
    for bad in ("1", "", "a b", "x" * 65, "-a", "a/b", ".a", "a\nb", "a\u202eb", "a\U0001f600"):
        with pytest.raises(UsageError, match="is not a snapshot name"):
            snapshot.check_name(bad)
    with pytest.raises(UsageError, match="QEMU takes a number for the ID of a snapshot"):
        snapshot.check_name("12")
    assert snapshot.check_name("12", number_ok=True) == "12"
    with pytest.raises(UsageError, match="is not a snapshot name"):
        snapshot.check_name("1 2", number_ok=True)
    assert snapshot.check_name("\U0001d400" * 63) == "\U0001d400" * 63  # a letter of 4 bytes in UTF-8
    with pytest.raises(UsageError, match="at most 255 bytes"):
        snapshot.check_name("\U0001d400" * 64)  # 256 bytes: QEMU would cut it short


def test_the_command_line_checks_what_goes_with_which_subcommand(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_text(REFUSED)
    for argv, message in ((["save"], "snapshot save needs a NAME"),
                          (["list", "x"], "snapshot list takes no NAME"),
                          (["restore", "x", "--force"], "--force goes with save only"),
                          (["save", "x", "--json"], "--json goes with list only"),
                          (["save", "1"], "'1' is not a snapshot name"),
                          (["restore", "2"], "'2' is not a snapshot name: QEMU takes a number"),
                          (["delete", "a b"], "'a b' is not a snapshot name"),
                          (["keep"], "invalid choice: 'keep'")):
        assert main(["snapshot", str(spec), *argv]) == 64
        assert message in capsys.readouterr().err


def test_a_lab_that_cannot_be_snapshotted_is_refused_and_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "src").mkdir()
    spec = tmp_path / "lab.toml"
    spec.write_text(REFUSED)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "b.qcow2"), "16M"], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "raw", str(tmp_path / "a.img"), "1M"], check=True)
    (tmp_path / "base.img").write_bytes(b"\0" * 512)
    (tmp_path / "vmlinuz").write_bytes(b"not booted")
    before = (tmp_path / "b.qcow2").read_bytes()
    assert main(["snapshot", str(spec), "save", "first"]) == 2  # the spec's problems: exit 2
    err = capsys.readouterr().err
    assert "vm.a.disk[0]: the raw disk" in err and "vm.a.share[0]: the 9p share" in err
    assert "vm.b: VM b is not running" in err
    assert (tmp_path / "b.qcow2").read_bytes() == before
    assert main(["up", str(spec), "--from-snapshot", "first"]) == 2
    assert "cannot start lab refused from snapshot 'first':" in capsys.readouterr().err
    assert main(["snapshot", str(spec), "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {}


def test_the_demo_lab_is_refused_as_a_problem_of_its_spec(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/lab.toml cannot be snapshotted (a raw disk, a VM without a disk): exit 2, as every
    problem of a spec, each with its line; examples/snapshots.toml is the lab that can."""
    monkeypatch.setenv("VMLAUNCH_RUN_DIR", str(tmp_path / "run"))
    demo = EXAMPLES / "lab.toml"
    assert main(["snapshot", str(demo), "save", "first"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"\n{re.escape(str(demo))}:\d+: vm.alpha.disk\[0\]: the raw disk "
                     rf"{re.escape(str(EXAMPLES / 'alpha.img'))} cannot hold a snapshot", err), err
    assert re.search(rf"\n{re.escape(str(demo))}:\d+: vm.beta: VM beta has no writable qcow2 disk", err), err
    assert "hint: change the spec as each line says; bring the lab up first" in err
    assert snapshot.check(load_lab(EXAMPLES / "snapshots.toml"), ["gamma", "delta"])  # none refused
    with pytest.raises(snapshot.SnapshotRefused) as caught:  # the lab's state, not its spec: exit 4
        snapshot.check(load_lab(EXAMPLES / "snapshots.toml"), ["gamma"], running={})
    assert caught.value.exit_code == 4 and "VM gamma is not running" in caught.value.message


# A qemu-img whose `snapshot -d X` deletes the snapshot with the ID X first, as old releases did: the real
# one, given the name of the snapshot with that ID instead.
ID_FIRST = """#!PYTHON
import json, os, subprocess, sys
args = sys.argv[1:]
if args[:1] == ["snapshot"] and "-d" in args:
    image = args[-1]
    path = image.split("file.filename=", 1)[1].replace(",,", ",") if "--image-opts" in args else image
    info = subprocess.run(["qemu-img", "info", "-U", "--output=json", path], capture_output=True, text=True)
    ids = {snap["id"]: snap["name"] for snap in json.loads(info.stdout).get("snapshots", [])}
    at = args.index("-d") + 1
    args[at] = ids.get(args[at], args[at])
os.execvp("qemu-img", ["qemu-img", *args])
"""


def test_delete_leaves_a_disk_alone_where_qemu_img_would_take_the_name_for_an_id(tmp_path: Path) -> None:
    """This machine's qemu-img deletes by name; one that took a number for an ID first is found out on
    a scratch image, and a disk where the name is another snapshot's ID is then left as it is."""
    fake = tmp_path / "qemu-img"
    fake.write_text(ID_FIRST.replace("PYTHON", sys.executable))
    fake.chmod(0o755)
    assert snapshot._deletes_by_name("qemu-img") and not snapshot._deletes_by_name(str(fake))
    disk = tmp_path / "a,b.qcow2"  # a comma: the file goes to qemu-img in --image-opts
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "1M"], check=True)
    for name in ("first", "1", "other"):
        subprocess.run(["qemu-img", "snapshot", "-c", name, str(disk)], check=True)
    before = disk.read_bytes()
    assert snapshot._delete_down(str(fake), disk, "1") == (
        f"{disk}: not deleted: its snapshot 'first' has the ID 1, and {fake} could take '1' for that ID")
    assert disk.read_bytes() == before
    assert snapshot._delete_down(str(fake), disk, "other") is None  # no snapshot has the ID "other"
    assert table(disk) == [("1", "first"), ("2", "1")]
    assert snapshot._delete_down("qemu-img", disk, "1") is None  # by name: "first" stays
    assert table(disk) == [("1", "first")]


@pytest.mark.parametrize("by_id_first", [False, True])
def test_a_clone_s_copy_loses_every_snapshot(tmp_path: Path, by_id_first: bool) -> None:
    """What a fork runs on a clone's qcow2 copy: every snapshot goes, with a qemu-img that takes a
    number for an ID first too (then "1" deletes "first", whose ID is 1, and a second round the rest)."""
    qemu_img = "qemu-img"
    if by_id_first:
        fake = tmp_path / "qemu-img"
        fake.write_text(ID_FIRST.replace("PYTHON", sys.executable))
        fake.chmod(0o755)
        qemu_img = str(fake)
    disk = tmp_path / "a,b.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "1M"], check=True)
    for name in ("first", "1", "other"):
        subprocess.run(["qemu-img", "snapshot", "-c", name, str(disk)], check=True)
    snapshot.drop_all(qemu_img, disk)
    assert table(disk) == []
    snapshot.drop_all(qemu_img, disk)  # none: nothing to do


def test_a_clock_is_set_to_the_time_sent_once_the_command_runs(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The SSH command is stood in for by a local shell (nothing here sets this host's clock)."""
    sent, given = tmp_path / "sent", []

    def fake_ssh(words: list[str]) -> list[str]:
        given.append(words)
        return ["sh", "-c", f'echo 100.25; read t; echo "$t" > {sent}']

    behind = snapshot._step_clock(fake_ssh)
    assert given == [["sh", "-c", f"sudo -n sh -c '{snapshot._SET_CLOCK}' || exit {snapshot.CLOCK_REFUSED}"]]
    assert isinstance(behind, float) and abs(behind - (time.time() - 100.25)) < 5
    assert abs(float(sent.read_text()) - time.time()) < 5
    refused = ["sh", "-c", "echo 'sudo: a password is required' >&2; exit 1"]
    assert snapshot._step_clock(lambda words: refused) == "sudo: a password is required"
    assert snapshot._step_clock(lambda words: ["sleep", "5"], timeout=1) == "SSH did not answer within 1 s"

    refused_by_sshd = "ssh: connect to host 127.0.0.1 port 2: Connection refused"
    session = snapshot.clock_session(lambda words: ["sh", "-c", f"echo '{refused_by_sshd}' >&2; exit 255"])
    assert session.status == 255 and session.error == refused_by_sshd

    caplog.set_level(logging.INFO, logger="vmlaunch")
    snapshot.step_clocks({"a": time.time() - 60, "b": time.time() - 60}, {"a": fake_ssh})
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("a: clock set to the host's (it was ") for m in messages), messages
    assert "b: its clock may be up to 60 s behind (the snapshot's age): it has no SSH to set it with " \
           "(NTP or `hwclock -s` in the guest does)" in messages


# --- one lab, up ---------------------------------------------------------------------------------------


@attrs.frozen
class Rig:
    spec: Path
    lab: LabSpec
    run_dir: RunDir

    def cli(self, *words: str) -> int:
        return main([words[0], str(self.spec), *words[1:]])


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, test_guest: Path) -> Iterator[Rig]:
    """The module's lab, booted once; its run root is the module's (VMLAUNCH_RUN_DIR) until the end."""
    folder = tmp_path_factory.mktemp("snap")
    runs = tempfile.mkdtemp(prefix="vl-")  # short: unix socket paths
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VMLAUNCH_RUN_DIR", runs)
        env.setenv("VMLAUNCH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
        env.setenv("VMLAUNCH_LOG_DIR", str(tmp_path_factory.getbasetemp() / "logs"))
        spec = folder / "lab.toml"
        spec.write_text(SPEC.replace("GUEST", str(test_guest)))
        lab = load_lab(spec)
        run_dir = RunDir.of(run_root(), lab.name)
        try:
            assert main(["up", str(spec), "--wait-for", READY, "--timeout", "120"]) == 0
            yield Rig(spec, lab, run_dir)
        finally:
            executor.down(run_dir, timeout=1, force=True)
            shutil.rmtree(runs, ignore_errors=True)


def on_console(rig: Rig, vm: str, command: str, timeout: float = 30) -> str:
    """Type `command` on the VM's serial console (the test guest's root shell); what it printed.

    What the guest prints is read as it comes, as a console does: QEMU's serial port waits for a
    client that does not read. The end is marked by output the typed line itself does not contain
    (`$((6*7))` is 42 once run)."""
    text = ""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(rig.run_dir.vm(vm).console))
        conn.settimeout(0.2)
        conn.sendall(f"echo BEGIN$((6*7)); {command}; echo END$((6*7))\n".encode())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(socket.timeout):
                text += conn.recv(65536).decode(errors="replace")
            # Kernel messages (the socket network's ICMPv6 notes) come at any point, mid-line too.
            shell = re.sub(r"\[ *\d+\.\d+\] [^\n]*\n", "", text.replace("\r", ""))
            found = re.search(r"BEGIN42\n(.*?)END42", shell, re.S)
            if found:
                return found.group(1)
    raise AssertionError(f"{vm}: no answer to {command!r} within {timeout} s: {text[-3000:]!r}")


def listed(rig: Rig, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert rig.cli("snapshot", "list", "--json") == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def running(rig: Rig) -> list[str]:
    from vmlaunch.runtime.control import qmp_command

    return [qmp_command(rig.run_dir, vm, "query-status")["status"] for vm in ("a", "b")]


# --- the states a test starts from ---------------------------------------------------------------------


def saved_on_disks(rig: Rig) -> dict[str, set[str]]:
    return {vm: {name for _, name in table(disk_of(rig, vm))} for vm in ("a", "b")}


def bring(rig: Rig, *, up: bool, first: bool = True) -> Rig:
    """The module's lab brought to the state a test starts from: up (a and b running, no clone, no
    intent) or down; on both disks the one snapshot "first" (its ID 1, each /tmp/x `VM-first` in it),
    or with `first=False` none. A lab so already costs a look (qemu-img info, QMP query-status); one
    that is down comes up warm from "first" where it has it."""
    if rig.run_dir.path.exists() and (set(Journal.load(rig.run_dir).vms) != {"a", "b"}
                                      or rig.run_dir.intent.exists() or running(rig) != ["running"] * 2):
        executor.down(rig.run_dir, timeout=1, force=True)  # what a test that failed half-way left
    have = saved_on_disks(rig)
    whole = all("first" in names for names in have.values())
    if (up or (first and not whole)) and not rig.run_dir.path.exists():
        assert rig.cli("up", *(["--from-snapshot", "first"] if whole
                               else ["--wait-for", READY, "--timeout", "120"])) == 0
    keep = {"first"} if first and whole else set()
    for name in sorted(set().union(*have.values()) - keep):  # any other first too: "first" takes ID 1
        assert rig.cli("snapshot", "delete", name) == 0
    if first and not whole:
        for vm in ("a", "b"):
            on_console(rig, vm, f"echo {vm}-first > /tmp/x")
        assert rig.cli("snapshot", "save", "first") == 0
    if not up and rig.run_dir.path.exists():
        assert rig.cli("down", "--timeout", "5") == 0
    return rig


@pytest.fixture
def rig(shared: Rig) -> Rig:
    """The module's lab up, as its tests leave it: a and b running, "first" their one snapshot."""
    return bring(shared, up=True)


@pytest.fixture
def unsaved(shared: Rig) -> Rig:
    """The module's lab up, with no snapshot."""
    return bring(shared, up=True, first=False)


@pytest.fixture
def down(shared: Rig) -> Rig:
    """The module's lab down, "first" its one snapshot."""
    return bring(shared, up=False)


@pytest.fixture
def down_saved_twice(shared: Rig) -> Rig:
    """The module's lab down, with "first" and DOWN_NAME, each saved while it was up (what
    test_from_snapshot_is_refused_while_up leaves)."""
    if shared.run_dir.path.exists() or saved_on_disks(shared) != {vm: {"first", DOWN_NAME} for vm in "ab"}:
        bring(shared, up=True)
        assert shared.cli("snapshot", "save", DOWN_NAME) == 0
        assert shared.cli("down", "--timeout", "5") == 0
    return shared


def test_save_then_restore_brings_both_vms_back(unsaved: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    rig = unsaved
    for vm in ("a", "b"):
        on_console(rig, vm, f"echo {vm}-first > /tmp/x")
    assert rig.cli("snapshot", "save", "first") == 0
    assert capsys.readouterr().out == "first: saved (a, b)\n"
    assert running(rig) == ["running", "running"]
    for vm in ("a", "b"):
        on_console(rig, vm, f"echo {vm}-later > /tmp/x")
        assert on_console(rig, vm, "cat /tmp/x") == f"{vm}-later\n"

    assert rig.cli("snapshot", "restore", "first") == 0
    assert capsys.readouterr().out == "first: restored (a, b)\n"
    assert running(rig) == ["running", "running"]
    assert on_console(rig, "a", "cat /tmp/x") == "a-first\n"
    assert on_console(rig, "b", "cat /tmp/x") == "b-first\n"


def test_list_shows_the_snapshot_of_each_vm(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    doc = listed(rig, capsys)
    assert set(doc) == {"first"} and set(doc["first"]) == {"a", "b"}
    for entry in doc["first"].values():
        assert entry["complete"] and entry["missing"] == []
        assert entry["vm_state_size"] > 1 << 20 and entry["vm_clock"] > 1
        assert abs(entry["taken"] - time.time()) < 300
    assert rig.cli("snapshot", "list") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["SNAPSHOT", "VM", "TAKEN", "VM", "STATE", "VM", "CLOCK"]
    assert [line.split()[:2] for line in out[1:]] == [["first", "a"], ["first", "b"]]


def test_a_name_taken_is_refused_unless_forced(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    taken = listed(rig, capsys)["first"]["a"]["taken"]
    assert rig.cli("snapshot", "save", "first") == 4
    assert "snapshot 'first' exists already in a, b" in capsys.readouterr().err
    assert listed(rig, capsys)["first"]["a"]["taken"] == taken
    assert rig.cli("snapshot", "save", "first", "--force") == 0
    assert listed(rig, capsys)["first"]["a"]["taken"] > taken


def test_restoring_what_is_not_there_changes_nothing(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    on_console(rig, "a", "echo still > /tmp/y")
    assert rig.cli("snapshot", "restore", "nope") == 4
    assert "the lab has no snapshot 'nope'" in capsys.readouterr().err
    assert running(rig) == ["running", "running"]
    assert on_console(rig, "a", "cat /tmp/y") == "still\n"


def test_delete(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    gone = "vor-Änderung_2.ü"
    assert rig.cli("snapshot", "save", gone) == 0
    assert set(listed(rig, capsys)) == {"first", gone}
    assert rig.cli("snapshot", "delete", gone) == 0
    assert capsys.readouterr().out == f"{gone}: deleted (a, b)\n"
    assert set(listed(rig, capsys)) == {"first"}
    assert rig.cli("snapshot", "delete", gone) == 4
    assert f"no VM of lab snap has a snapshot {gone!r}" in capsys.readouterr().err


def test_a_failed_save_resumes_every_vm_and_leaves_no_part(rig: Rig, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = snapshot._job

    async def failing_in_b(qmp: Any, vm: str, command: str, deadline: float, **args: Any) -> None:
        if vm == "b" and command == "snapshot-save":
            raise RuntimeFailure("b: the disk is full (made up by the test)")
        await real(qmp, vm, command, deadline, **args)

    monkeypatch.setattr(snapshot, "_job", failing_in_b)
    with pytest.raises(RuntimeFailure, match="snapshot 'half' failed") as caught:
        snapshot.save(rig.run_dir, rig.lab, "half")
    assert "b: the disk is full" in caught.value.message and caught.value.hint == "every VM was resumed"
    assert running(rig) == ["running", "running"]
    assert set(listed(rig, capsys)) == {"first"}  # a's part was deleted


def status_rows(rig: Rig, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert rig.cli("status", "--json") == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_pause_and_resume_are_the_users_own(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    from vmlaunch.api import Lab

    capsys.readouterr()
    assert rig.cli("pause", "a") == 0
    assert capsys.readouterr().out == "a: paused\n"
    rows = status_rows(rig, capsys)
    assert (rows["a"]["state"], rows["b"]["state"]) == ("paused", "running")
    assert "by its user" in rows["a"]["why"]
    assert rig.cli("snapshot", "save", "while-paused") == 0
    assert running(rig) == ["paused", "running"]  # a snapshot resumes only what it paused
    assert rig.cli("pause") == 0
    assert capsys.readouterr().out == "while-paused: saved (a, b)\na: already paused\nb: paused\n"
    lab = Lab(rig.spec)
    assert lab.vm("b").resume() == "resumed"
    assert lab.resume() == {"a": "resumed", "b": "already running"}
    assert running(rig) == ["running", "running"]
    assert rig.cli("snapshot", "delete", "while-paused") == 0


def spawn(rig: Rig, *words: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "vmlaunch", words[0], str(rig.spec), *words[1:]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_once_it_intends(rig: Rig, proc: subprocess.Popen[bytes], after: float) -> None:
    """SIGKILL the vmlaunch `after` seconds once it wrote its intent (or once it ended)."""
    deadline = time.monotonic() + 60
    while not rig.run_dir.intent.exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(after)
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("after", [0.0, 0.02, 0.1, 0.4])
def test_a_killed_save_is_finished_by_the_next_command(
        rig: Rig, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, after: float) -> None:
    """Killed at any instant: `status` resumes what it paused, and the snapshot is whole on every VM
    or on none."""
    kill_once_it_intends(rig, spawn(rig, "snapshot", "save", "killed"), after)
    with caplog.at_level(logging.WARNING):
        rows = status_rows(rig, capsys)
    assert (rows["a"]["state"], rows["b"]["state"]) == ("running", "running"), rows
    assert running(rig) == ["running", "running"]
    assert not rig.run_dir.intent.exists()
    doc = listed(rig, capsys)
    if "killed" in doc:
        assert set(doc["killed"]) == {"a", "b"} and all(vm["complete"] for vm in doc["killed"].values())
        assert rig.cli("snapshot", "delete", "killed") == 0
    said = " ".join(record.getMessage() for record in caplog.records)
    if rig.run_dir.intent.exists() or "interrupted" in said:
        assert "snapshot save 'killed' was interrupted" in said


@pytest.mark.parametrize("after", [0.0, 0.1])
def test_a_killed_restore_keeps_what_it_paused_until_restored_again(
        rig: Rig, capsys: pytest.CaptureFixture[str], after: float) -> None:
    assert rig.cli("snapshot", "save", "back") == 0
    kill_once_it_intends(rig, spawn(rig, "snapshot", "restore", "back"), after)
    rows = status_rows(rig, capsys)
    held = [vm for vm in ("a", "b") if rows[vm]["state"] == "paused"]
    for vm in held:
        assert "by an interrupted snapshot restore of 'back'" in rows[vm]["why"]
        assert "snapshot SPEC restore back" in rows[vm]["why"]
    if held:
        assert rig.cli("resume") == 4
        assert "kept paused by an interrupted snapshot restore" in capsys.readouterr().err
        assert rig.run_dir.intent.exists()
    assert rig.cli("snapshot", "restore", "back") == 0
    assert running(rig) == ["running", "running"]
    assert not rig.run_dir.intent.exists()
    assert rig.cli("snapshot", "delete", "back") == 0


def test_an_interrupted_restore_holds_its_vms_and_a_save_resumes_its_own(
        rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    """The state a restore killed half-way through its loads leaves (written here, so it is exactly
    that): both VMs paused, its intent there. Then what a killed save leaves: resumed."""
    from vmlaunch.runtime.control import qmp_command
    from vmlaunch.saved import intent

    disks: dict[str, tuple[tuple[str, str], ...]] = {vm: (("disk0", str(disk_of(rig, vm))),)
                                                      for vm in ("a", "b")}
    assert rig.cli("snapshot", "save", "first", "--force") == 0
    intent.begin(rig.run_dir, intent.Operation.RESTORE, "first", ("a", "b"), ("a", "b"), disks)
    for vm in ("a", "b"):
        qmp_command(rig.run_dir, vm, "stop")
    for _ in range(2):  # every command says it again, and keeps them paused
        rows = status_rows(rig, capsys)
        assert [rows[vm]["state"] for vm in ("a", "b")] == ["paused", "paused"]
    capsys.readouterr()
    assert rig.cli("snapshot", "save", "meanwhile") == 4  # no snapshot of a half-loaded memory
    assert "cannot snapshot lab snap: a, b are kept paused by an interrupted" in capsys.readouterr().err
    assert rig.cli("resume", "a") == 4
    assert running(rig) == ["paused", "paused"]
    assert rig.cli("snapshot", "restore", "first") == 0
    assert running(rig) == ["running", "running"] and not rig.run_dir.intent.exists()

    intent.begin(rig.run_dir, intent.Operation.SAVE, "gone", ("a", "b"), ("b",), disks)
    qmp_command(rig.run_dir, "b", "stop")
    assert rig.cli("snapshot", "list") == 0
    assert running(rig) == ["running", "running"] and not rig.run_dir.intent.exists()


def test_a_clone_has_no_part_in_the_snapshots_of_its_source(
        rig: Rig, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A clone's disk is a copy of its source's. The fork deletes the snapshots the copy holds; and a
    snapshot taken before a fork is neither listed for the clone nor restored into it, even on a copy
    that kept it (as a clone an older vmlaunch made did): the restore is refused, nothing changes."""
    from vmlaunch.layout.labdir import LabDir

    assert rig.cli("snapshot", "save", "first", "--force") == 0
    assert rig.cli("fork", "b") == 0  # b-1
    copy = LabDir.of(rig.spec, "snap").vm("b-1").disk_copy(0, "qcow2")
    assert table(copy) == [] and [name for _, name in table(disk_of(rig, "b"))] == ["first"]
    monkeypatch.setattr(snapshot, "drop_all", lambda qemu_img, file: None)
    assert rig.cli("fork", "b") == 0  # b-2, whose copy keeps "first"
    kept = LabDir.of(rig.spec, "snap").vm("b-2").disk_copy(0, "qcow2")
    assert [name for _, name in table(kept)] == ["first"]
    capsys.readouterr()
    doc = listed(rig, capsys)
    assert set(doc) == {"first"} and set(doc["first"]) == {"a", "b"}, doc
    for clone in ("b-1", "b-2"):
        on_console(rig, clone, "echo mine > /tmp/x")
    assert rig.cli("snapshot", "restore", "first") == 4
    err = capsys.readouterr().err
    assert "cannot restore 'first': b-1, b-2 were forked after it was taken, so have no part in it: " \
           "nothing was changed" in err and "`vmlaunch down SPEC b-1 b-2` removes those clones" in err
    for clone in ("b-1", "b-2"):  # still themselves: neither turned back into b
        assert on_console(rig, clone, "hostname; cat /tmp/x") == f"{clone}\nmine\n"
    assert rig.cli("down", "b-1", "b-2", "--timeout", "5") == 0
    assert rig.cli("snapshot", "restore", "first") == 0


DOWN_NAME = "2026-11-22.prä"  # saved while up, deleted while down


def disk_of(rig: Rig, vm: str) -> Path:
    return rig.spec.parent / f"{vm}.qcow2"


def table(file: Path) -> list[tuple[str, str]]:
    """(ID, name) of each snapshot of a qcow2 file, from this machine's qemu-img."""
    done = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(file)], capture_output=True,
                          text=True, check=True)
    return [(snap["id"], snap["name"]) for snap in json.loads(done.stdout).get("snapshots", [])]


def test_from_snapshot_is_refused_while_up(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    assert rig.cli("up", "--from-snapshot", "first") == 4  # up: restore is for that
    assert "a, b run already: --from-snapshot starts VMs that are down" in capsys.readouterr().err
    assert rig.cli("snapshot", "save", DOWN_NAME) == 0
    assert rig.cli("down", "--timeout", "5") == 0


def test_every_verb_while_the_lab_is_down(down_saved_twice: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    """save and restore are refused with the lines of the VMs; list and delete read and write the
    disks with qemu-img."""
    rig = down_saved_twice
    capsys.readouterr()
    spec = rig.spec
    for verb, doing in (("save", "snapshot"), ("restore", "restore")):
        assert rig.cli("snapshot", verb, "first") == 4
        err = capsys.readouterr().err
        assert err.startswith(f"vmlaunch: error: cannot {doing} lab snap:\n"
                              f"{spec}:6: vm.a: VM a is not running\n"
                              f"{spec}:18: vm.b: VM b is not running\n"), err
        assert "hint: bring the lab up first; a lab that is down starts from a snapshot with `vmlaunch " \
               "up SPEC --from-snapshot NAME`" in err
    doc = listed(rig, capsys)
    assert set(doc) == {"first", DOWN_NAME} and all(set(doc[name]) == {"a", "b"} for name in doc)
    assert all(entry["complete"] for per_vm in doc.values() for entry in per_vm.values())
    assert rig.cli("snapshot", "list") == 0
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:]] == [
        ["2026-11-22.prä", "a"], ["2026-11-22.prä", "b"], ["first", "a"], ["first", "b"]]

    assert rig.cli("snapshot", "delete", DOWN_NAME) == 0
    assert capsys.readouterr().out == f"{DOWN_NAME}: deleted (a, b)\n"
    assert set(listed(rig, capsys)) == {"first"}
    assert rig.cli("snapshot", "delete", DOWN_NAME) == 4
    assert f"no VM of lab snap has a snapshot {DOWN_NAME!r}" in capsys.readouterr().err

    # A snapshot named "1" beside "first", whose ID is 1: delete goes by the name.
    subprocess.run(["qemu-img", "snapshot", "-c", "1", str(disk_of(rig, "a"))], check=True)
    before = table(disk_of(rig, "a"))
    assert ("1", "first") in before and any(name == "1" and id != "1" for id, name in before), before
    first = listed(rig, capsys)["first"]
    assert rig.cli("snapshot", "delete", "1") == 0
    assert capsys.readouterr().out == "1: deleted (a)\n"
    assert table(disk_of(rig, "a")) == [entry for entry in before if entry[1] != "1"]
    assert listed(rig, capsys) == {"first": first}
    assert rig.cli("snapshot", "delete", "1") == 4  # nothing named "1": the ID 1 is not taken for it
    assert "no VM of lab snap has a snapshot '1'" in capsys.readouterr().err
    assert table(disk_of(rig, "a")) == [entry for entry in before if entry[1] != "1"]


def test_up_from_snapshot_starts_without_booting(down: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    rig = down
    assert set(listed(rig, capsys)["first"]) == {"a", "b"}  # read from the disks
    assert rig.cli("up", "--from-snapshot", "first", "--fresh") == 64
    assert "--fresh and --from-snapshot do not go together" in capsys.readouterr().err

    started = time.time()
    assert rig.cli("up", "--from-snapshot", "first") == 0
    assert running(rig) == ["running", "running"]
    said = capsys.readouterr().err
    for vm in ("a", "b"):  # no SSH: through the command channel (not "it has no SSH to set it with")
        assert f"{vm}: clock set to the host's through its command channel (it was " in said, said
        assert abs(int(on_console(rig, vm, "date +%s")) - time.time()) < 5
    assert on_console(rig, "a", "cat /tmp/x") == "a-first\n"
    assert on_console(rig, "b", "cat /tmp/x") == "b-first\n"
    for vm in ("a", "b"):
        console = rig.run_dir.vm(vm).serial_log.read_text(errors="replace")
        assert "Linux version" not in console and READY not in console  # it did not boot
        uptime = float(on_console(rig, vm, "cut -d' ' -f1 /proc/uptime"))
        assert uptime > time.time() - started  # up longer than its QEMU: it ran before, and runs on
    assert set(Journal.load(rig.run_dir).vms) == {"a", "b"}


def test_delete_by_a_number_while_up(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    """QEMU's snapshot-delete job goes by the name too: the snapshot whose ID is 1 stays."""
    from vmlaunch.runtime.control import qmp_command

    def ids() -> dict[str, str]:
        nodes = qmp_command(rig.run_dir, "a", "query-named-block-nodes", {"flat": True})
        node = next(node for node in nodes if node["node-name"] == "disk0")
        return {snap["name"]: snap["id"] for snap in node["image"].get("snapshots", [])}

    # A snapshot named "1" beside "first", whose ID is 1; of a's disk alone, without RAM (QEMU takes the
    # device's root node, the disk's fault slot, and makes it on the qcow2 node below).
    qmp_command(rig.run_dir, "a", "blockdev-snapshot-internal-sync", {"device": "disk0-slot", "name": "1"})
    assert ids()["first"] == "1" and "1" in ids()
    doc = listed(rig, capsys)
    assert set(doc) == {"first", "1"} and doc["1"]["a"]["missing"] == [str(disk_of(rig, "a"))]  # no RAM
    assert rig.cli("snapshot", "delete", "1") == 0
    assert capsys.readouterr().out == "1: deleted (a)\n"
    assert ids() == {"first": "1"}
    assert listed(rig, capsys) == {"first": doc["first"]}
    assert rig.cli("snapshot", "restore", "first") == 0  # still whole
    assert running(rig) == ["running", "running"]


def test_a_clock_session_runs_more_after_the_clock(tmp_path: Path) -> None:
    """`--wait ssh` after a snapshot sets the clock and asks about cloud-init in one SSH session."""
    given: list[list[str]] = []

    def fake_ssh(words: list[str]) -> list[str]:
        given.append(words)
        return ["sh", "-c", 'echo 100.25; read t; echo "after $t"; exit 3']

    session = snapshot.clock_session(fake_ssh, then="echo cloud-init:0")
    assert given[0][-1].endswith(f"|| exit {snapshot.CLOCK_REFUSED}; echo cloud-init:0")
    assert session.error is None and session.status == 3 and session.output.startswith("after ")
    assert abs(session.behind - (time.time() - 100.25)) < 5


def test_a_warm_start_reads_the_saved_ram_through_the_page_cache() -> None:
    """The snapshot disks' file nodes start without O_DIRECT; their compiled options are kept for the
    reopen after the load. Other nodes, and aio=native (which needs O_DIRECT), stay as compiled."""
    def blockdev(name: str, direct: bool, aio: str = "io_uring") -> str:
        return json.dumps({"driver": "file", "filename": f"/x/{name}", "node-name": name, "aio": aio,
                           "cache": {"direct": direct, "no-flush": False}, "read-only": False})

    argv = ("qemu", "-blockdev", blockdev("disk0-file", True),
            "-blockdev", blockdev("disk1-file", True, "native"),
            "-blockdev", blockdev("disk2-file", True), "-blockdev", blockdev("disk3-file", False), "-S")
    started, reopen = snapshot._page_cached(argv, ["disk0", "disk1", "disk3"])
    assert json.loads(started[2])["cache"] == {"direct": False, "no-flush": False}
    assert started[3:] == argv[3:]
    assert reopen == [json.loads(argv[2])]


def test_the_example_lab_snapshots(shared: Rig, tmp_path: Path, test_guest: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """examples/snapshots.toml, which the snapshots guide names: up, save, restore, list, down. In
    the run root of the module's lab, up beside it (a host setting such as KSM has one record)."""
    folder = tmp_path / "lab"
    folder.mkdir()
    shutil.copy(EXAMPLES / "snapshots.toml", folder / "snapshots.toml")
    (folder / "guest").symlink_to(test_guest)
    spec = str(folder / "snapshots.toml")
    rig = Rig(folder / "snapshots.toml", load_lab(folder / "snapshots.toml"),
              RunDir.of(run_root(), "snapshots"))
    try:
        assert main(["up", spec, "--wait-for", READY, "--timeout", "120"]) == 0
        on_console(rig, "gamma", "echo saved > /tmp/x")
        capsys.readouterr()
        assert main(["snapshot", spec, "save", "first"]) == 0
        assert capsys.readouterr().out == "first: saved (gamma, delta)\n"
        on_console(rig, "gamma", "echo later > /tmp/x")
        assert main(["snapshot", spec, "restore", "first"]) == 0
        assert capsys.readouterr().out == "first: restored (gamma, delta)\n"
        assert on_console(rig, "gamma", "cat /tmp/x") == "saved\n"
        assert set(listed(rig, capsys)["first"]) == {"gamma", "delta"}
    finally:
        executor.down(rig.run_dir, timeout=1, force=True)


def test_a_warm_start_hands_qemu_its_disks_as_descriptors(tmp_path: Path) -> None:
    """The file nodes to reopen are opened by vmlaunch and named `/dev/fdset/N` (a confined QEMU cannot
    open root's 0600 file again for the reopen), in the argv and in the reopen's options alike; a
    qcow2 whose backing file is named relative to it keeps its path (QEMU would look beside
    /dev/fdset/N)."""
    for name, backing in (("own.qcow2", None), ("relative.qcow2", "own.qcow2")):
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / name), "1M"]
        if backing is not None:
            argv[5:5] = ["-b", backing, "-F", "qcow2"]
        subprocess.run(argv, check=True)
        (tmp_path / name).chmod(0o600)

    def blockdev(node: str, file: str) -> dict[str, Any]:
        return {"driver": "file", "filename": str(tmp_path / file), "node-name": node,
                "cache": {"direct": True, "no-flush": False}, "read-only": False}

    compiled = [blockdev("disk0-file", "own.qcow2"), blockdev("disk1-file", "relative.qcow2")]
    line = ("qemu", "-blockdev", json.dumps(compiled[0]), "-blockdev", json.dumps(compiled[1]), "-S")
    started, reopen, fds = snapshot._through_descriptors("a", line, compiled)
    try:
        assert len(fds) == 1 and os.fstat(fds[0]).st_ino == os.stat(tmp_path / "own.qcow2").st_ino
        assert os.get_blocking(fds[0]) and not os.get_inheritable(fds[0])  # passed by Popen's pass_fds
        assert json.loads(started[2]) == {**compiled[0], "filename": "/dev/fdset/1"}
        assert started[3:6] == line[3:6]
        assert started[6:] == ("-add-fd", f"fd={fds[0]},set=1,opaque=disk0-file")
        assert reopen == [{**compiled[0], "filename": "/dev/fdset/1"}, compiled[1]]
    finally:
        for fd in fds:
            os.close(fd)
    missing = [blockdev("disk0-file", "gone.qcow2")]
    with pytest.raises(RuntimeFailure, match=r"a: cannot open .*gone\.qcow2 for its warm start: No such"):
        snapshot._through_descriptors("a", ("qemu",), missing)
