"""`vmlaunch fork` on the project's test guest (busybox, vmlaunch's agent), with the real QEMU under
TCG: clones that are members of the lab with identities of their own, on copies of the source's disk,
forwarded ports of their own; down of one clone and of the lab; --shared-memory through the API; the
refusals; a fork killed at any instant undone by the next command. One lab for the module; a test
that needs clones there, or none, says so by its fixture (`unforked`, `three_clones`, `a_clone`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vmlaunch.api import Lab
from vmlaunch.errors import EXIT_RUNTIME, EXIT_SPEC, EXIT_USAGE
from vmlaunch.lab.journal import Journal
from vmlaunch.layout.labdir import LabDir

pytestmark = [pytest.mark.qemu, pytest.mark.guest]
READY = "VMLAUNCH-GUEST-READY"


@pytest.fixture(scope="module")
def lab(test_guest: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    import tempfile

    folder = tmp_path_factory.mktemp("fork")
    run_root = Path(tempfile.mkdtemp(prefix="vl-"))
    os.environ["VMLAUNCH_RUN_DIR"] = str(run_root)
    spec = folder / "lab.toml"
    guest = f'accel = "tcg"\nkernel = "{test_guest}/vmlinuz"\ninitrd = "{test_guest}/initrd.gz"'
    spec.write_text(f"""[lab]
name = "fk"
[lab.memory]
ksm = false
[network.wire]
type = "socket"
subnet = "10.77.0.0/24"
[network.out]
type = "user"
forward = ["tcp:127.0.0.1:{free_port()}-:8000"]
[vm.a]
memory = "160M"
{guest}
[[vm.a.nic]]
network = "wire"
ip = "10.77.0.10"
[[vm.a.nic]]
network = "out"
[[vm.a.disk]]
file = "data.raw"
size = "4M"
[vm.off]
memory = "128M"
agent = false
{guest}
""")
    lab = Lab(spec, wait_for=READY, timeout=300)
    try:
        lab.up()
        lab.vm("a").succeed("ip addr add 10.77.0.10/24 dev eth0")  # the test guest sets no spec address
        yield lab
    finally:
        lab.down(timeout=0)
        del os.environ["VMLAUNCH_RUN_DIR"]
        left = sorted(os.listdir(run_root))
        os.rmdir(run_root)
        assert not left
        lab_dir = LabDir.of(spec, "fk").path
        if lab_dir.exists():
            assert sorted(p.name for p in lab_dir.iterdir() if p.is_dir()) in ([], ["ssh"])  # no clone's


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def vmlaunch(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmlaunch", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env=os.environ.copy())


def status(lab: Lab) -> dict[str, Any]:
    done = vmlaunch("status", str(lab.spec), "--json")
    assert done.returncode == 0, done.stderr
    rows: dict[str, Any] = json.loads(done.stdout)
    return rows


def clones(lab: Lab) -> list[str]:
    """The clones in the lab now (its journal's VMs past the spec's)."""
    return sorted(set(Journal.load(lab.run_dir).vms) - {"a", "off"})


def down_clones(lab: Lab) -> Lab:
    if made := clones(lab):
        assert vmlaunch("down", str(lab.spec), *made, "--timeout", "0").returncode == 0
    return lab


@pytest.fixture
def unforked(lab: Lab) -> Lab:
    """The module's lab with no clone: a and off alone."""
    return down_clones(lab)


@pytest.fixture
def three_clones(lab: Lab) -> Lab:
    """The module's lab with a's clones a-1, a-2 and a-3 and no other (what the first test leaves)."""
    if clones(lab) != ["a-1", "a-2", "a-3"]:
        down_clones(lab)
        done = vmlaunch("fork", str(lab.spec), "a", "--count", "3")
        assert done.returncode == 0, done.stderr
    return lab


@pytest.fixture
def a_clone(lab: Lab) -> Lab:
    """The module's lab with a's clone a-1 (others may be there too)."""
    if "a-1" not in clones(lab):
        done = vmlaunch("fork", str(lab.spec), "a", "--name", "a-{i}")
        assert done.returncode == 0, done.stderr
    return lab


def test_clones_are_members_with_identities_of_their_own(unforked: Lab) -> None:
    lab = unforked
    spec = str(lab.spec)
    done = vmlaunch("fork", spec, "a", "--count", "3", "--json")
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)
    assert list(made) == ["a-1", "a-2", "a-3"]
    rows = status(lab)
    assert [name for name in rows] == ["a", "off", "a-1", "a-2", "a-3"]
    source = lab.vm("a")
    seen = {"a": (source.succeed("cat /sys/class/net/eth0/address").strip(),
                  source.qmp("query-vm-generation-id")["guid"], rows["a"]["nics"][0]["address"])}
    for name in made:
        row = rows[name]
        assert row["state"] == "running" and row["pid"] == made[name]["pid"]
        assert row["forked_from"] == "a" and rows["a"]["forked_from"] is None
        clone = lab.vm(name)
        assert clone.succeed("hostname").strip() == name
        mac = clone.succeed("cat /sys/class/net/eth0/address").strip()
        assert mac == row["nics"][0]["mac"] == made[name]["macs"][0]  # the guest sees its own MAC
        address = row["nics"][0]["address"]
        assert address in clone.succeed("ip -4 -o addr show eth0") and address in made[name]["addresses"]
        seen[name] = (mac, clone.qmp("query-vm-generation-id")["guid"], address)
        assert "machine-id" in " ".join(made[name]["identity"]) and "clock" in made[name]["identity"]
        # its own host port for the forwarded one
        assert row["nics"][1]["forwards"] != rows["a"]["nics"][1]["forwards"]
        assert made[name]["forwards"] and made[name]["forwards"][0] not in rows["a"]["nics"][1]["forwards"]
        # the source's disk, copied
        copy = LabDir.of(lab.spec, "fk").vm(name).disk_copy(0, "raw")
        assert copy.exists() and copy.stat().st_mode & 0o077 == 0
        assert row["disks"][0]["file"] == str(copy)
    for part in range(3):  # MACs, generation ids, addresses: all distinct
        assert len({values[part] for values in seen.values()}) == 4, seen
    machine_ids = {lab.vm(name).succeed("cat /etc/machine-id").strip() for name in made}
    assert len(machine_ids) == 3
    # every clone reaches every other on the lab's network, with the address it was given
    for name in made:
        for other in made:
            if other != name:
                target = seen[other][2].split("/")[0]
                lab.vm(name).succeed(f"ping -c 1 -W 5 {target}")
    # and they are VMs of the lab for every command
    listed = json.loads(vmlaunch("ls", "--json").stdout)
    assert set(made) <= set(listed["fk"]["vms"])
    assert vmlaunch("exec", spec, "a-2", "--", "hostname").stdout.strip() == "a-2"
    assert vmlaunch("balloon", spec, "a-3").returncode == 0
    assert "a-1" in {row for row in lab.status()}


def test_down_of_a_clone_removes_it_and_its_files(three_clones: Lab) -> None:
    lab = three_clones
    spec = str(lab.spec)
    folder = LabDir.of(lab.spec, "fk").vm("a-2").path
    assert folder.is_dir()
    done = vmlaunch("down", spec, "a-2", "--timeout", "0")
    assert done.returncode == 0, done.stderr
    rows = status(lab)
    assert "a-2" not in rows and rows["a-1"]["state"] == rows["a-3"]["state"] == "running"
    assert not folder.exists()
    assert not [name for name in os.listdir(lab.run_dir.path) if name.startswith("a-2.")]
    known = (LabDir.of(lab.spec, "fk").known_hosts)
    assert not known.exists() or "vmlaunch-fk-a-2 " not in known.read_text()
    assert vmlaunch("exec", spec, "a-2", "--", "true").returncode == EXIT_USAGE  # no such VM any more


def test_a_clone_of_a_clone_and_the_api_with_shared_memory(a_clone: Lab) -> None:
    lab = a_clone
    again = vmlaunch("fork", str(lab.spec), "a-1", "--name", "deep-{i}")
    assert again.returncode == 0, again.stderr
    assert lab.vm("deep-1").succeed("hostname").strip() == "deep-1"
    assert status(lab)["deep-1"]["forked_from"] == "a-1"
    clones = lab.fork("a", 2, name="mem-{i}", shared_memory=True)
    assert [clone.name for clone in clones] == ["mem-1", "mem-2"]
    for clone in clones:
        assert clone.succeed("hostname").strip() == clone.name
        assert clone.status().state == "running"
    assert not lab.run_dir.fork_memory.exists()  # the clones map it; the file is gone
    done = vmlaunch("down", str(lab.spec), "deep-1", "mem-1", "mem-2", "--timeout", "0")
    assert done.returncode == 0, done.stderr


def test_a_paused_source_stays_paused_and_its_clone_runs(lab: Lab) -> None:
    spec = str(lab.spec)
    assert vmlaunch("pause", spec, "a").returncode == 0
    done = vmlaunch("fork", spec, "a", "--name", "p-{i}")
    assert done.returncode == 0, done.stderr
    rows = status(lab)
    assert rows["a"]["run_state"] == "paused" and rows["p-1"]["run_state"] == "running"
    assert vmlaunch("resume", spec, "a").returncode == 0
    assert status(lab)["a"]["run_state"] == "running"
    lab.vm("a").succeed("true")  # its disks are its own again: it runs on
    assert vmlaunch("down", spec, "p-1", "--timeout", "0").returncode == 0


def test_a_failing_clone_is_named_and_keep_going_keeps_the_others(lab: Lab,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from vmlaunch.errors import RuntimeFailure
    from vmlaunch.runtime import fork

    loading = fork._load

    def fails_for_the_second(run_dir: Any, plan: Any, pid: int, **kwargs: Any) -> str | None:
        return "(its QEMU said no)" if plan.name.endswith("-2") else loading(run_dir, plan, pid, **kwargs)

    monkeypatch.setattr(fork, "_load", fails_for_the_second)
    with pytest.raises(RuntimeFailure, match="kg-2 did not load"):
        lab.fork("a", 3, name="kg-{i}")
    assert not {"kg-1", "kg-2", "kg-3"} & set(status(lab))  # all of the fork rolled back
    kept = lab.fork("a", 3, name="kg-{i}", keep_going=True)
    assert [vm.name for vm in kept] == ["kg-1", "kg-3"]
    rows = status(lab)
    assert "kg-2" not in rows and rows["kg-1"]["state"] == rows["kg-3"]["state"] == "running"
    assert not LabDir.of(lab.spec, "fk").vm("kg-2").path.exists()
    assert vmlaunch("down", str(lab.spec), "kg-1", "kg-3", "--timeout", "0").returncode == 0


@pytest.mark.parametrize(("args", "code", "words"), [
    (["nope"], EXIT_USAGE, "no VM named 'nope'"),
    (["a", "--name", "a-{i}", "--count", "1"], EXIT_USAGE, "a-1 exists already"),
    (["a", "--name", "same"], EXIT_USAGE, "has no {i}"),
    (["a", "--count", "0"], EXIT_USAGE, "1 to 64"),
    (["off"], EXIT_SPEC, "--same-identity"),  # agent = false: the spec's, as every refusal of its VM
])
def test_refusals_change_nothing(a_clone: Lab, args: list[str], code: int, words: str) -> None:
    lab = a_clone
    before = status(lab)
    done = vmlaunch("fork", str(lab.spec), *args)
    assert done.returncode == code, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert status(lab).keys() == before.keys()


def test_what_cannot_be_copied_is_refused_before_anything_changes(lab: Lab) -> None:
    """A held request (the pause would never end), a disk file swapped since `up` (a link to a host
    file would be copied into the clone), a folder of the lab dir that is no clone's."""
    spec = str(lab.spec)
    before = status(lab)
    assert vmlaunch("fault", spec, "a", "disk0", "hang", "--write").returncode == 0
    try:
        assert "hang" in vmlaunch("fault", spec).stdout
        done = vmlaunch("fork", spec, "a")
        assert done.returncode == EXIT_RUNTIME and "release" in done.stderr, done.stderr
    finally:
        assert vmlaunch("fault", spec, "a", "disk0", "clear").returncode == 0
    data = lab.spec.parent / "data.raw"
    os.rename(data, data.with_name("kept.raw"))
    try:
        secret = lab.spec.parent / "host-secret"
        secret.write_text("not the guest's\n")
        os.symlink(secret, data)
        done = vmlaunch("fork", spec, "a")
        assert done.returncode == EXIT_RUNTIME and "not the file" in done.stderr, done.stderr
    finally:
        os.unlink(data)
        os.rename(data.with_name("kept.raw"), data)
    stray = LabDir.of(lab.spec, "fk").path / "st-1"
    stray.mkdir(parents=True)
    try:
        done = vmlaunch("fork", spec, "a", "--name", "st-{i}")
        assert done.returncode == EXIT_USAGE and "st-1 exists" in done.stderr, done.stderr
    finally:
        stray.rmdir()
    assert status(lab).keys() == before.keys()
    assert not (lab.run_dir.path / "forks.json").exists() or json.loads(
        (lab.run_dir.path / "forks.json").read_text())["forking"] is None


def test_a_guest_without_a_channel_forks_with_the_same_identity_said_loudly(lab: Lab) -> None:
    done = vmlaunch("fork", str(lab.spec), "off", "--same-identity")
    assert done.returncode == 0, done.stderr
    assert "--same-identity" in done.stderr and "collide" in done.stderr
    assert status(lab)["off-1"]["state"] == "running"
    assert vmlaunch("down", str(lab.spec), "off-1", "--timeout", "0").returncode == 0


@pytest.mark.parametrize("after", [0.3, 0.8, 1.3, 2.0])
def test_a_fork_killed_at_any_instant_is_finished_or_undone(lab: Lab, after: float) -> None:
    spec = str(lab.spec)
    before = set(status(lab))
    proc = subprocess.Popen([sys.executable, "-m", "vmlaunch", "fork", spec, "a", "--count", "2",
                             "--name", "k-{i}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ.copy())
    time.sleep(after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rows = status(lab)  # the next command settles what the killed one left
    clones = set(rows) - before
    assert clones in (set(), {"k-1", "k-2"}), clones
    assert all(row["state"] == "running" for row in rows.values())
    assert rows["a"]["run_state"] == "running"  # never left paused
    for name in ("fork.state", "fork.mem"):
        assert not (lab.run_dir.path / name).exists()
    book = json.loads((lab.run_dir.path / "forks.json").read_text()) if (
        lab.run_dir.path / "forks.json").exists() else {"forking": None}
    assert book["forking"] is None
    if clones:
        assert vmlaunch("down", spec, *sorted(clones), "--timeout", "0").returncode == 0
    assert not [p for p in LabDir.of(lab.spec, "fk").path.iterdir() if p.name.startswith("k-")]


def test_an_interrupted_fork_rolls_back(lab: Lab) -> None:
    spec = str(lab.spec)
    proc = subprocess.Popen([sys.executable, "-m", "vmlaunch", "fork", spec, "a", "--count", "2",
                             "--name", "int-{i}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=os.environ.copy())
    time.sleep(0.8)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    rows = status(lab)
    if proc.returncode == 0:  # it had finished
        assert {"int-1", "int-2"} <= set(rows)
        assert vmlaunch("down", spec, "int-1", "int-2", "--timeout", "0").returncode == 0
    else:
        assert proc.returncode == 130, err
        assert not {"int-1", "int-2"} & set(rows) and rows["a"]["run_state"] == "running"
