"""The NoCloud seed: cloud-config, meta-data and network-config as cloud-init's YAML reader sees them,
the user's file merged over ours, the instance-id, and the ISO volume read back with pycdlib."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from vmlaunch.errors import HostError, RuntimeFailure, SpecError
from vmlaunch.guests import cloudinit
from vmlaunch.guests.channel import install_command
from vmlaunch.layout.labdir import LabDir
from vmlaunch.spec.load import load_lab, parse_lab
from vmlaunch.spec.model import LabSpec, VmSpec

LAB_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKCg43hHtm1AqSJq4/c9XRzwFTq6pkMz6rYUD5m+UgEx vmlaunch-demo"
HOST_KEY = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ==\n"
            "-----END OPENSSH PRIVATE KEY-----\n",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMiUS33NBwkW4zHULhEiotlZDOyQyiNboXbV9DfmYgA6 "
            "vmlaunch-demo-web")
MGMT_MAC = "52:54:00:e3:12:0b"

SPEC = """\
[lab]
name = "demo"
[image.deb]
file = "deb.qcow2"
[network.lan]
bridge = "br-test"
subnet = "10.10.0.0/24"
[network.out]
type = "user"
[network.mc]
type = "socket"
[vm.web]
memory = 512
image = "deb"
[vm.web.cloud_init]
user = "dev"
packages = ["curl"]
runcmd = ["touch /var/tmp/hello", "echo 'it''s' > /tmp/x"]
{user_data}
[[vm.web.nic]]
network = "lan"
ip = "10.10.0.11"
gateway = "10.10.0.1"
dns = ["10.10.0.1", "1.1.1.1"]
[[vm.web.nic]]
network = "out"
[[vm.web.nic]]
network = "mc"
[[vm.web.share]]
source = "./src"
target = "/srv/my src"
readonly = true
[[vm.web.share]]
source = "./out"
target = "/srv/out"
[vm.bare]
memory = 256
image = "deb"
ssh = false
[[vm.bare.nic]]
network = "mc"
"""


def make_lab(tmp_path: Path, user_data: str | None = None) -> LabSpec:
    tmp_path.mkdir(exist_ok=True)
    spec = tmp_path / "lab.toml"
    key = "" if user_data is None else 'user_data = "extra.yaml"'
    spec.write_text(SPEC.format(user_data=key))
    if user_data is not None:
        (tmp_path / "extra.yaml").write_text(user_data)
    return parse_lab(spec.read_bytes(), spec)


@pytest.fixture
def lab(tmp_path: Path) -> LabSpec:
    return make_lab(tmp_path)


def cloud_config(lab: LabSpec, vm: str = "web") -> dict[str, Any]:
    text = cloudinit.user_data(lab, lab.vm(vm), LAB_KEY, HOST_KEY)
    assert text.startswith("#cloud-config\n")
    config = read_back(text)
    assert isinstance(config, dict)
    return config


def read_back(text: str) -> Any:
    """As cloud-init 22.4 reads each seed file: PyYAML's SafeLoader (the pure-Python one); and as
    JSON, which every file also is (after the #cloud-config line), but for a key too long for YAML to
    take plainly (written as an explicit key)."""
    as_yaml = yaml.load(text, Loader=yaml.SafeLoader)  # noqa: S506 (SafeLoader)
    body = text.split("\n", 1)[1] if text.startswith("#") else text
    if not re.search(r'^ *\? "', body, re.M):
        assert json.loads(body) == as_yaml
    return as_yaml


# --------------------------------------------------------------------------- the generated cloud-config


def test_generated_cloud_config(lab: LabSpec) -> None:
    mount = ["sh", "-c", cloudinit._MOUNT_SCRIPT, "vmlaunch-share"]
    assert cloud_config(lab) == {
        "hostname": "web",
        "fqdn": "web",
        "preserve_hostname": False,
        "manage_etc_hosts": True,
        "users": [{
            "name": "dev",
            "sudo": "ALL=(ALL) NOPASSWD:ALL",
            "shell": "/bin/bash",
            "lock_passwd": True,
            "ssh_authorized_keys": [LAB_KEY],
        }],
        "disable_root": True,
        "ssh_pwauth": False,
        "ssh_deletekeys": True,
        "ssh_keys": {"ed25519_private": HOST_KEY[0], "ed25519_public": HOST_KEY[1]},
        "updates": {"network": {"when": ["boot-new-instance", "boot"]}},
        "bootcmd": [
            install_command(),  # the command channel's agent, first
            [*mount, "share0", "/srv/my src", "trans=virtio,version=9p2000.L,msize=512000,ro"],
            [*mount, "share1", "/srv/out", "trans=virtio,version=9p2000.L,msize=512000,rw"],
        ],
        "package_update": True,
        "packages": ["curl"],
        "runcmd": ["touch /var/tmp/hello", "echo 'it''s' > /tmp/x"],
    }


def test_defaults_without_packages_runcmd_or_shares(lab: LabSpec) -> None:
    config = cloud_config(lab, "bare")
    assert config["users"][0]["name"] == "vmlaunch"
    for key in ("packages", "package_update", "runcmd", "mounts"):
        assert key not in config
    assert config["bootcmd"] == [install_command()]  # the agent of the command channel only


def test_the_seed_installs_the_agent_unless_agent_is_off(tmp_path: Path) -> None:
    for value, installed in (("", True), ("agent = true\n", True), ("agent = false\n", False)):
        spec = tmp_path / "lab.toml"
        spec.write_text('[lab]\nname = "ci"\n[image.deb]\nfile = "deb.qcow2"\n'
                        f'[vm.a]\nmemory = 256\nimage = "deb"\n{value}')
        (tmp_path / "deb.qcow2").write_bytes(b"")
        lab = load_lab(spec)
        config = yaml.safe_load(cloudinit.user_data(lab, lab.vm("a"), None, None))
        assert (install_command() in config.get("bootcmd", [])) is installed
        exported = yaml.safe_load(cloudinit.user_data(lab, lab.vm("a"), None, None, agent=False))
        assert "bootcmd" not in exported  # an export's engine has no port for it


def test_no_seed_without_cloud_init(lab: LabSpec) -> None:
    import attrs

    with pytest.raises(ValueError, match="no cloud_init"):
        cloudinit.user_data(lab, attrs.evolve(lab.vm("web"), cloud_init=None), LAB_KEY, HOST_KEY)


@pytest.fixture
def fake_tools(tmp_path: Path) -> Path:
    """mountpoint, modprobe and mount that log their words (this host has no 9p guest to mount in)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, status in (("mountpoint", 1), ("modprobe", 0), ("mount", 0)):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nprintf "%s|" {tool} "$@" >> "{tmp_path}/calls"; echo >> '
                          f'"{tmp_path}/calls"\nexit ${{FAIL_{tool.upper()}:-{status}}}\n')
        script.chmod(0o755)
    return bin_dir


def shellify(command: list[str]) -> str:
    """What cloud-init 22.4's util.shellify writes for a list command: each word in single quotes."""
    return " ".join("'" + word.replace("'", "'\\''") + "'" for word in command)


@pytest.mark.parametrize("fail", [False, True])
def test_the_mount_command_as_cloud_init_runs_it(lab: LabSpec, tmp_path: Path, fake_tools: Path,
                                                  fail: bool) -> None:
    share = lab.vm("web").shares[0]
    target = tmp_path / "guest" / "it's a \"dir\""
    command = cloudinit.mount_command(share)
    command[-2] = str(target)  # the guest's path, here under tmp_path
    env = {**os.environ, "PATH": f"{fake_tools}:{os.environ['PATH']}"}
    if fail:
        env["FAIL_MOUNT"] = "32"
    result = subprocess.run(["/bin/sh", "-c", shellify(command)], env=env, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0  # like fstab's nofail: the boot goes on
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [f"mountpoint|-q|{target}|", "modprobe|-q|9pnet_virtio|",
                     f"mount|-t|9p|-o|trans=virtio,version=9p2000.L,msize=512000,ro|share0|{target}|"]
    assert target.is_dir()
    assert result.stderr == (f"vmlaunch: share share0 not mounted on {target}\n" if fail else "")


# --------------------------------------------------------------------------- JSON that YAML reads back


@given(st.text())
def test_any_text_reads_back_through_pyyaml(text: str) -> None:
    doc = {"runcmd": [text], text: {"k": text}}
    assert read_back(f"#cloud-config\n{cloudinit.dump(doc)}\n") == doc


@pytest.mark.parametrize("text", ["emoji \U0001f600", "nel \x85", "ls \u2028 ps \u2029", "del \x7f",
                                  "c1 \x9b", "bom \ufeff", "\ufffe", "tab\t", "\\ud83d\\ude00",
                                  "\\\U0001f600", "\\\\ud83d"])
def test_text_plain_json_would_break(text: str) -> None:
    """Text PyYAML misreads or refuses in json.dumps' own output (with ensure_ascii on or off), and
    backslashes before what looks like the escapes `dump` rewrites."""
    assert read_back(cloudinit.dump([text])) == [text]


@pytest.mark.parametrize("key", ["k" * 1100, "\u0315" * 300, 'a"b: c' * 200, "\U0001f600" * 1100])
def test_keys_yaml_would_not_take_plainly(key: str) -> None:
    """PyYAML takes a plain key of up to 1024 characters (as written: escapes count): a longer one is
    written as an explicit key (found by the property above, with 1100 characters of combining marks)."""
    doc = {"runcmd": [key], key: {"k": key}, "short": 1}
    text = cloudinit.dump(doc)
    assert read_back(f"#cloud-config\n{text}\n") == doc
    assert '\n  ? "' in text and '"short": 1' in text


# --------------------------------------------------------------------------- the user's file


def test_the_users_file_is_merged_over_ours(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, """#cloud-config
hostname: other          # a scalar: theirs wins
runcmd:
  - echo theirs
  - [ls, -l]
bootcmd: [echo early]
users:
  - name: dev             # the lab's user: merged into ours
    groups: [adm]
    ssh_authorized_keys: [ssh-ed25519 AAAAextra them]
  - default
  - name: ops
ssh_keys:
  rsa_private: x          # another key type: added
write_files:
  - path: /etc/motd
    content: hi
created: 2024-01-02       # a YAML timestamp: kept as written
""")
    config = cloud_config(lab)
    assert config["hostname"] == "other"
    assert config["fqdn"] == "web"
    assert config["runcmd"] == ["touch /var/tmp/hello", "echo 'it''s' > /tmp/x", "echo theirs", ["ls", "-l"]]
    assert config["bootcmd"][-1] == "echo early" and len(config["bootcmd"]) == 4
    assert config["users"] == [
        {"name": "dev", "sudo": "ALL=(ALL) NOPASSWD:ALL", "shell": "/bin/bash", "lock_passwd": True,
         "ssh_authorized_keys": [LAB_KEY, "ssh-ed25519 AAAAextra them"], "groups": ["adm"]},
        "default",
        {"name": "ops"},
    ]
    assert config["ssh_keys"] == {"ed25519_private": HOST_KEY[0], "ed25519_public": HOST_KEY[1],
                                  "rsa_private": "x"}
    assert config["write_files"] == [{"path": "/etc/motd", "content": "hi"}]
    assert config["created"] == "2024-01-02"
    assert config["packages"] == ["curl"]


def test_a_file_with_the_header_only_changes_nothing(tmp_path: Path) -> None:
    assert cloud_config(make_lab(tmp_path, "#cloud-config\n")) == cloud_config(make_lab(tmp_path / "b"))


def test_yaml_is_imported_only_for_a_users_file(lab: LabSpec) -> None:
    code = ("import sys; from pathlib import Path; from vmlaunch.spec.load import load_lab; "
            "from vmlaunch.guests import cloudinit; lab = load_lab(sys.argv[1]); "
            "cloudinit.user_data(lab, lab.vm('web'), 'k', ('a', 'b')); print('yaml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(lab.file)], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("text", "message"), [
    ("runcmd: [ls]\n", "extra.yaml:1: a cloud-config file begins with the line #cloud-config"),
    ("#cloud-config-archive\n- x\n", "extra.yaml:1: a cloud-config file begins"),
    ("#cloud-config\nruncmd:\n  - ls\n bad: [\n", "extra.yaml:4: not valid YAML"),
    ("#cloud-config\nruncmd: [ls\npackages: x\n", "extra.yaml:3: not valid YAML"),
    ("#cloud-config\n- a list\n", "extra.yaml:2: a cloud-config file is a mapping"),
    ("#cloud-config\n---\na: 1\n---\nb: 2\n", "extra.yaml:4: not valid YAML: expected a single document"),
    ("#cloud-config\nusers: default\n", "extra.yaml:2: users: must be a list"),
    ("#cloud-config\nssh_keys: [a]\n", "extra.yaml:2: ssh_keys: must be a mapping"),
    ("#cloud-config\nusers:\n  - name: dev\n    ssh_authorized_keys: k\n",
     "extra.yaml:4: users[0].ssh_authorized_keys: must be a list"),
    ("#cloud-config\nssh_keys:\n  ed25519_private: |\n    other\n",
     "extra.yaml:3: ssh_keys.ed25519_private: vmlaunch gives each VM its SSH host key"),
    ("#cloud-config\nwrite_files:\n  - content: !!binary aGk=\n", "extra.yaml:3: !!binary is not supported"),
    ("#cloud-config\nx: !!set {a: null}\n", "extra.yaml:2: the tag tag:yaml.org,2002:set"),
    ("#cloud-config\nx: !custom 1\n", "extra.yaml:2: the tag !custom"),
    ("#cloud-config\n1: a\n", "extra.yaml:2: a key must be text"),
    ("#cloud-config\nx: .inf\n", "extra.yaml:2: .inf is not a finite number"),
    ("#cloud-config\nx: &a [*a]\n", "extra.yaml:2: a recursive alias"),
])
def test_a_bad_users_file_names_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    lab = make_lab(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        cloudinit.user_data(lab, lab.vm("web"), LAB_KEY, HOST_KEY)
    assert str(caught.value).startswith(f"{tmp_path}/{message}"), str(caught.value)


def test_a_users_file_that_is_not_utf8(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, "")
    (tmp_path / "extra.yaml").write_bytes(b"#cloud-config\nruncmd: [caf\xe9]\n")
    with pytest.raises(SpecError, match=r"extra.yaml:2: not UTF-8"):
        cloudinit.user_data(lab, lab.vm("web"), LAB_KEY, HOST_KEY)


def test_a_missing_users_file_names_the_spec_line(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, "")
    (tmp_path / "extra.yaml").unlink()
    with pytest.raises(SpecError) as caught:
        cloudinit.user_data(lab, lab.vm("web"), LAB_KEY, HOST_KEY)
    assert str(caught.value).startswith(f"{tmp_path}/lab.toml:19: vm.web.cloud_init.user_data: cannot read")


def test_merge_anchors_and_merge_keys(tmp_path: Path) -> None:
    lab = make_lab(tmp_path, "#cloud-config\nbase: &b {a: 1}\nmore:\n  <<: *b\n  c: 2\n")
    config = cloud_config(lab)
    assert config["more"] == {"a": 1, "c": 2}


# --------------------------------------------------------------------------- meta-data, network-config


def test_meta_data(lab: LabSpec) -> None:
    assert read_back(cloudinit.meta_data(lab, lab.vm("web"), "vmlaunch-demo-web-0123")) == {
        "instance-id": "vmlaunch-demo-web-0123", "local-hostname": "web"}


def test_network_config(lab: LabSpec) -> None:
    vm = lab.vm("web")
    text = cloudinit.network_config(lab, vm, MGMT_MAC)
    assert text is not None
    assert read_back(text) == {"version": 2, "ethernets": {
        "nic0": {"match": {"macaddress": vm.nics[0].mac}, "addresses": ["10.10.0.11/24"], "dhcp4": False,
                 "routes": [{"to": "0.0.0.0/0", "via": "10.10.0.1"}],
                 "nameservers": {"addresses": ["10.10.0.1", "1.1.1.1"]}, "optional": True},
        "nic1": {"match": {"macaddress": vm.nics[1].mac}, "dhcp4": True, "optional": True},
        # nic2 (socket network, no ip) is left out
        "mgmt": {"match": {"macaddress": MGMT_MAC}, "dhcp4": True, "optional": True},
    }}


def test_network_config_of_a_derived_address_without_gateway(tmp_path: Path) -> None:
    spec = tmp_path / "lab.toml"
    spec.write_text('[lab]\nname = "n"\n[network.lan]\ntype = "socket"\nsubnet = "10.9.0.0/24"\n'
                    '[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "lan"\n')
    lab = parse_lab(spec.read_bytes(), spec)
    text = cloudinit.network_config(lab, lab.vm("a"), None)
    assert text is not None
    (entry,) = read_back(text)["ethernets"].values()
    assert set(entry) == {"match", "addresses", "dhcp4", "optional"}
    assert entry["addresses"][0].startswith("10.9.0.") and entry["addresses"][0].endswith("/24")


def test_nothing_to_say_is_no_network_config(lab: LabSpec) -> None:
    assert cloudinit.network_config(lab, lab.vm("bare"), None) is None
    assert cloudinit.network_config(lab, lab.vm("bare"), MGMT_MAC) is not None


# --------------------------------------------------------------------------- instance-id


@pytest.fixture
def lab_dir(tmp_path: Path) -> LabDir:
    return LabDir.of(tmp_path / "lab.toml", "demo")


def test_instance_id_lives_as_long_as_the_overlay(lab_dir: LabDir) -> None:
    first = cloudinit.instance_id(lab_dir, "web")
    assert first.startswith("vmlaunch-demo-web-")
    assert cloudinit.instance_id(lab_dir, "web") == first  # down, up
    assert stat.S_IMODE(os.stat(lab_dir.vm("web").instance_id).st_mode) == 0o600
    assert cloudinit.instance_id(lab_dir, "db") != first
    for path in lab_dir.vm("web").fresh:  # up --fresh, reset
        if path.exists():
            path.unlink()
    assert cloudinit.instance_id(lab_dir, "web") != first


def test_a_damaged_instance_id_is_replaced(lab_dir: LabDir) -> None:
    cloudinit.instance_id(lab_dir, "web")
    lab_dir.vm("web").instance_id.write_text("../../etc\n")
    assert cloudinit.instance_id(lab_dir, "web").startswith("vmlaunch-demo-web-")


def test_an_instance_id_link_is_refused(lab_dir: LabDir, tmp_path: Path) -> None:
    cloudinit.instance_id(lab_dir, "web")
    lab_dir.vm("web").instance_id.unlink()
    (tmp_path / "elsewhere").write_text("vmlaunch-planted\n")
    lab_dir.vm("web").instance_id.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(HostError, match="symlink"):
        cloudinit.instance_id(lab_dir, "web")


# --------------------------------------------------------------------------- the seed volume


def test_seed_reads_back(tmp_path: Path) -> None:
    import pycdlib

    seed = tmp_path / "seed.iso"
    files = {"user-data": "#cloud-config\n{\"x\": \"caf\u00e9 \U0001f600\"}\n", "meta-data": "{}\n",
             "network-config": "{\"version\": 2}\n"}
    cloudinit.write_seed(seed, files["user-data"], files["meta-data"], files["network-config"])
    assert stat.S_IMODE(os.stat(seed).st_mode) == 0o600
    assert cloudinit.read_seed(seed) == files
    assert [p.name for p in tmp_path.iterdir()] == ["seed.iso"]  # no temp file left
    iso = pycdlib.PyCdlib()
    iso.open(str(seed))
    try:
        assert iso.pvd.volume_identifier.decode().rstrip() == "cidata"
        assert iso.joliet_vd is not None and iso.rock_ridge is not None
        joliet = sorted(c.file_identifier().decode("utf-16-be") for c in iso.list_children(joliet_path="/")
                        if c.is_file())
        assert joliet == sorted(files)
    finally:
        iso.close()


def test_seed_without_network_config_is_replaced_whole(tmp_path: Path) -> None:
    seed = tmp_path / "seed.iso"
    cloudinit.write_seed(seed, "#cloud-config\n{}\n", "{}\n", "{\"version\": 2}\n")
    cloudinit.write_seed(seed, "#cloud-config\n{\"a\": 1}\n", "{}\n", None)
    assert cloudinit.read_seed(seed) == {"user-data": "#cloud-config\n{\"a\": 1}\n", "meta-data": "{}\n"}


@pytest.mark.skipif(shutil.which("blkid") is None, reason="blkid (util-linux) is not installed")
def test_blkid_sees_the_label_cloud_init_looks_for(tmp_path: Path) -> None:
    seed = tmp_path / "seed.iso"
    cloudinit.write_seed(seed, "#cloud-config\n{}\n", "{}\n", None)
    out = subprocess.run(["blkid", "-p", "-o", "value", "-s", "LABEL", "-s", "TYPE", str(seed)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cidata", "iso9660"]


def test_read_seed_refuses_what_is_not_a_seed(tmp_path: Path) -> None:
    import io

    import pycdlib

    other = pycdlib.PyCdlib()
    other.new(vol_ident="OTHER")
    other.add_fp(io.BytesIO(b"x"), 1, "/A.;1")
    other.write(str(tmp_path / "other.iso"))
    other.close()
    with pytest.raises(RuntimeFailure, match="its label is 'OTHER'"):
        cloudinit.read_seed(tmp_path / "other.iso")
    (tmp_path / "junk").write_bytes(b"\0" * 4096)
    with pytest.raises(RuntimeFailure, match="cannot read the seed"):
        cloudinit.read_seed(tmp_path / "junk")


def test_a_whole_seed(lab: LabSpec, tmp_path: Path) -> None:
    """The three documents of one VM, in a seed, read back as cloud-init would parse them."""
    vm: VmSpec = lab.vm("web")
    seed = tmp_path / "seed.iso"
    cloudinit.write_seed(seed, cloudinit.user_data(lab, vm, LAB_KEY, HOST_KEY),
                         cloudinit.meta_data(lab, vm, "iid-1"), cloudinit.network_config(lab, vm, MGMT_MAC))
    files = {name: read_back(text) for name, text in cloudinit.read_seed(seed).items()}
    assert sorted(files) == ["meta-data", "network-config", "user-data"]
    assert files["user-data"]["users"][0]["ssh_authorized_keys"] == [LAB_KEY]
    assert files["meta-data"]["instance-id"] == "iid-1"
    assert "mgmt" in files["network-config"]["ethernets"]
