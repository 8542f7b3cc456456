"""The spec of real guests: images, cloud-init, shares, firmware, SSH, subnets and static addresses."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from tests.conftest import fake_host, write_spec
from vmlaunch.compile.compiler import compile_lab
from vmlaunch.errors import HostError, SpecError
from vmlaunch.host.facts import Ovmf
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import DiskFormat, Firmware

SHA512 = "ab" * 64
HEAD = '[lab]\nname = "g"\n'
VM = '[vm.a]\nmemory = 64\nkernel = "k"\n'
IMAGE = f'[image.deb]\nurl = "https://example.org/debian.qcow2"\nsha512 = "{SHA512}"\n'


def problems(tmp_path: Path, text: str) -> list[str]:
    spec = write_spec(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        load_lab(spec)
    return [str(p).replace(f"{spec}", "lab.toml") for p in caught.value.problems]


def test_a_full_guest(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + IMAGE + """
[network.lan]
subnet = "10.10.0.0/24"
[network.out]
type = "user"
[vm.web]
memory = "1G"
image = "deb"
disk_size = "8G"
firmware = "uefi"
[vm.web.cloud_init]
user = "dev"
packages = ["curl"]
runcmd = ["touch /var/tmp/hello"]
[[vm.web.nic]]
network = "lan"
ip = "10.10.0.11"
gateway = "10.10.0.1"
dns = ["10.10.0.1"]
[[vm.web.share]]
source = "./src"
target = "/srv/src/"
readonly = true
[vm.db]
memory = "1G"
image = "deb"
[[vm.db.nic]]
network = "lan"
[[vm.db.nic]]
network = "out"
[vm.plain]
memory = 64
kernel = "k"
""")
    lab = load_lab(spec)
    image = lab.image("deb")
    assert image.sha512 == SHA512 and image.format is DiskFormat.QCOW2 and image.file is None
    web, db, plain = lab.vms
    assert web.image == "deb" and web.disk_size == 8 << 30 and web.firmware is Firmware.UEFI
    assert web.cloud_init is not None and web.cloud_init.user == "dev"
    assert web.cloud_init.packages == ("curl",) and web.cloud_init.runcmd == ("touch /var/tmp/hello",)
    assert web.nics[0].ip == "10.10.0.11/24" and web.nics[0].gateway == "10.10.0.1"
    assert web.nics[0].dns == ("10.10.0.1",)
    assert web.shares[0].source == tmp_path / "src" and web.shares[0].target == "/srv/src"
    assert web.shares[0].tag == "share0" and web.shares[0].readonly
    assert web.ssh and db.ssh and not plain.ssh  # SSH by default where there is an image
    assert db.cloud_init is not None and db.cloud_init.user == "vmlaunch" and plain.cloud_init is None
    derived = db.nics[0].ip
    assert derived is not None and derived.startswith("10.10.0.") and derived.endswith("/24")
    assert derived not in ("10.10.0.11/24", "10.10.0.0/24", "10.10.0.1/24", "10.10.0.255/24")
    assert db.nics[1].ip is None  # QEMU's user network: DHCP
    assert load_lab(spec).vm("db").nics[0].ip == derived  # stable


def test_a_derived_address_never_takes_one_a_nic_names(tmp_path: Path) -> None:
    """Whatever the order of the VMs: explicit addresses are placed first."""
    first = load_lab(write_spec(tmp_path, HEAD + '[network.n]\ntype = "socket"\nsubnet = "10.9.0.0/29"\n'
                                + "".join(f'[vm.v{i}]\nmemory = 64\nkernel = "k"\n[[vm.v{i}.nic]]\n'
                                          'network = "n"\n' for i in range(5))))
    taken = sorted(vm.nics[0].ip or "" for vm in first.vms)
    assert len(set(taken)) == 5 and all(ip.startswith("10.9.0.") for ip in taken)
    pinned = taken[0].split("/")[0]
    second = load_lab(write_spec(tmp_path, HEAD + '[network.n]\ntype = "socket"\nsubnet = "10.9.0.0/29"\n'
                                 + "".join(f'[vm.v{i}]\nmemory = 64\nkernel = "k"\n[[vm.v{i}.nic]]\n'
                                           'network = "n"\n' for i in range(4))
                                 + f'[vm.w]\nmemory = 64\nkernel = "k"\n[[vm.w.nic]]\nnetwork = "n"\n'
                                 f'ip = "{pinned}"\n'))
    addresses = [vm.nics[0].ip for vm in second.vms]
    assert len(set(addresses)) == 5 and f"{pinned}/29" in addresses


@pytest.mark.parametrize(("text", "expected"), [
    (HEAD + '[vm.a]\nmemory = 64\nimage = "nope"\n',
     "lab.toml:5: vm.a.image: no image named 'nope' (images: none defined)"),
    (HEAD + '[image.x]\nurl = "https://example.org/x.qcow2"\n[vm.a]\nmemory = 64\nimage = "x"\n',
     "lab.toml:4: image.x.url: a downloaded image needs a checksum (add sha512 = \"...\" or sha256 = "
     "\"...\" (the distro publishes them beside the image, e.g. SHA512SUMS))"),
    (HEAD + '[image.x]\nsha256 = "' + "a" * 64 + '"\n[vm.a]\nmemory = 64\nimage = "x"\n',
     "lab.toml:3: image.x: an image needs url = \"...\", file = \"...\" or catalog = \"...\" "
     "(`vmlaunch image catalog` lists the images catalog can name)"),
    (HEAD + '[image.x]\nurl = "ftp://example.org/x"\nsha256 = "' + "a" * 64 + '"\n' + VM,
     "lab.toml:4: image.x.url: 'ftp://example.org/x' must be an http://, https:// or file:// URL "
     "(a path on this host: use file = \"...\")"),
    (HEAD + '[image.x]\nurl = "file://server/x.qcow2"\nsha256 = "' + "a" * 64 + '"\n'
     '[vm.a]\nmemory = 64\nimage = "x"\n',
     "lab.toml:4: image.x.url: 'file://server/x.qcow2': a file:// URL names a path on this host, like "
     "file:///srv/images/debian.qcow2"),
    (HEAD + '[image.x]\nfile = "x.qcow2"\nsha512 = "abc"\n' + VM,
     "lab.toml:5: image.x.sha512: 'abc' must be 128 hex digits"),
    (HEAD + '[network.n]\nsubnet = "10.10.0.5/24"\n[vm.a]\nmemory = 64\nkernel = "k"\n',
     "lab.toml:4: network.n.subnet: '10.10.0.5/24' has host bits set: the network is 10.10.0.0/24"),
    (HEAD + '[network.n]\nsubnet = "10.10.0.0/31"\n[vm.a]\nmemory = 64\nkernel = "k"\n',
     "lab.toml:4: network.n.subnet: '10.10.0.0/31' has no room for guests (at most /30)"),
    (HEAD + '[network.n]\nsubnet = "10.10.0.0/24"\n[vm.a]\nmemory = 64\nkernel = "k"\n'
     '[[vm.a.nic]]\nnetwork = "n"\nip = "10.11.0.5"\n',
     "lab.toml:10: vm.a.nic[0].ip: 10.11.0.5 is outside network 'n''s subnet 10.10.0.0/24"),
    (HEAD + '[network.n]\nsubnet = "10.10.0.0/24"\n[vm.a]\nmemory = 64\nkernel = "k"\n'
     '[[vm.a.nic]]\nnetwork = "n"\nip = "10.10.0.255"\n',
     "lab.toml:10: vm.a.nic[0].ip: 10.10.0.255 is the broadcast address of 10.10.0.0/24"),
    (HEAD + '[network.n]\n[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "n"\n'
     'ip = "10.10.0.5"\n',
     "lab.toml:9: vm.a.nic[0].ip: '10.10.0.5' has no prefix, and network 'n' no subnet (write "
     "\"10.10.0.5/24\", or give the network subnet = \"...\")"),
    (HEAD + '[network.n]\ntype = "socket"\nsubnet = "10.10.0.0/24"\n'
     '[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "n"\nip = "10.10.0.7"\n'
     '[vm.b]\nmemory = 64\nkernel = "k"\n[[vm.b.nic]]\nnetwork = "n"\nip = "10.10.0.7"\n',
     "lab.toml:17: vm.b.nic[0].ip: 10.10.0.7 is also the address of vm.a.nic[0] (every NIC on a "
     "network needs its own address)"),
    (HEAD + '[network.u]\ntype = "user"\n[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\n'
     'network = "u"\nip = "10.0.2.20/24"\n',
     "lab.toml:10: vm.a.nic[0].ip: network 'u' is QEMU's user network, which gives its NICs addresses "
     "by DHCP (10.0.2.15) (remove ip)"),
    (HEAD + '[network.n]\n[vm.a]\nmemory = 64\nkernel = "k"\n[[vm.a.nic]]\nnetwork = "n"\n'
     'gateway = "10.0.0.300"\n',
     "lab.toml:9: vm.a.nic[0].gateway: '10.0.0.300' is not an IPv4 address"),
    (HEAD + '[vm.a]\nmemory = 64\nkernel = "k"\ndisk_size = "8G"\n',
     "lab.toml:6: vm.a.disk_size: disk_size sizes the overlay of an image (add image = \"...\", or "
     "give a [[disk]] its size)"),
    (HEAD + IMAGE + '[vm.a]\nmemory = 64\nimage = "deb"\ndisk_size = "1000B"\n',
     "lab.toml:9: vm.a.disk_size: '1000B' is not a whole number of 512-byte sectors (e.g. 64M or 20G)"),
    (HEAD + IMAGE + '[vm.a]\nmemory = 64\nimage = "deb"\nfirmware = "efi"\n',
     "lab.toml:9: vm.a.firmware: 'efi' is not one of bios, uefi"),
    (HEAD + IMAGE + '[vm.a]\nmemory = 64\nimage = "deb"\n[vm.a.cloud_init]\nuser = "root"\n',
     "lab.toml:10: vm.a.cloud_init.user: the SSH user is made with passwordless sudo; root is not "
     "such a user (name another user)"),
    (HEAD + IMAGE + '[vm.a]\nmemory = 64\nimage = "deb"\n[vm.a.cloud_init]\nuser = "Dev User"\n',
     "lab.toml:10: vm.a.cloud_init.user: 'Dev User' must be a user name: lowercase letters, digits, "
     "'_' or '-', at most 32"),
    (HEAD + IMAGE + '[vm.a]\nmemory = 64\nimage = "deb"\n[[vm.a.share]]\nsource = "."\n'
     'target = "srv"\n',
     "lab.toml:11: vm.a.share[0].target: 'srv' must be an absolute path in the guest (no commas)"),
    (HEAD + IMAGE + '[vm.a]\nmemory = 64\nimage = "deb"\n[[vm.a.share]]\nsource = "."\n'
     'target = "/srv"\n[[vm.a.share]]\nsource = "."\ntarget = "/srv/"\n',
     "lab.toml:14: vm.a.share[1].target: /srv is also the target of vm.a.share[0]"),
    (HEAD + IMAGE + '[vm.a]\nmemory = 64\nimage = "deb"\n[[vm.a.share]]\nsource = "."\n'
     'target = "/"\n',
     "lab.toml:11: vm.a.share[0].target: a share cannot be mounted over /"),
])
def test_mistakes(tmp_path: Path, text: str, expected: str) -> None:
    assert problems(tmp_path, text) == [expected]


def guest_lab(tmp_path: Path, extra: str = "") -> Path:
    return write_spec(tmp_path, HEAD + IMAGE + '[vm.web]\nmemory = "1G"\nimage = "deb"\n' + extra)


def test_the_compiled_guest(tmp_path: Path) -> None:
    """Overlay first (it boots), the seed as a read-only disk, 9p shares, UEFI pflash, the SSH NIC."""
    (tmp_path / "src").mkdir()
    spec = guest_lab(tmp_path, 'firmware = "uefi"\n[[vm.web.share]]\nsource = "src"\ntarget = "/srv"\n')
    ovmf = Ovmf(Path("/fw/OVMF_CODE_4M.fd"), Path("/fw/OVMF_VARS_4M.fd"))
    host = attrs.evolve(fake_host(), ovmf=ovmf)
    host = attrs.evolve(host, qemu=attrs.evolve(host.qemu, devices=host.qemu.devices | {"virtio-9p-pci"}))
    plan = compile_lab(load_lab(spec), host)
    argv = " ".join(plan.vm("web").argv)
    vm_dir = tmp_path / ".vmlaunch" / "g" / "web"
    assert "-machine q35,pflash0=fw-code,pflash1=fw-vars" in argv
    assert '"filename":"/fw/OVMF_CODE_4M.fd","node-name":"fw-code-file","read-only":true' in argv
    assert f'"filename":"{vm_dir}/nvram.fd"' in argv
    assert argv.index(f"{vm_dir}/disk.qcow2") < argv.index(f"{vm_dir}/seed.iso")
    assert '"driver":"qcow2","node-name":"disk0"' in argv and '"bootindex":0' in argv
    assert (f"-fsdev local,id=fsdev0,path={tmp_path}/src,security_model=mapped-xattr,fmode=0660,"
            "dmode=0770") in argv
    assert '"mount_tag":"share0"' in argv
    assert '"hostfwd":[{"str":"tcp:127.0.0.1:0-:22"}]' in argv
    assert plan.vm("web").ssh_user == "vmlaunch"
    kinds = [type(r).__name__ for r in plan.resources]
    assert kinds == ["LabDirResource", "Nvram", "Overlay", "Seed", "LabManager"]  # (every lab's event log)


def test_uefi_without_ovmf_names_the_package(tmp_path: Path) -> None:
    spec = guest_lab(tmp_path, 'firmware = "uefi"\n')
    with pytest.raises(HostError, match=r"lab.toml:9: vm.web.firmware: firmware = \"uefi\" needs OVMF") \
            as caught:
        compile_lab(load_lab(spec), fake_host())
    assert caught.value.hint == "apt-get install ovmf" and caught.value.exit_code == 3


@pytest.mark.parametrize(("text", "said"), [
    ('[[vm.a.disk]]\nfile = "d.img"\nreadonly = true\non_error = { write = "stop" }\n',
     "lab.toml:9: vm.a.disk[0].on_error.write: a read-only disk has no writes to fail"),
    ('[[vm.a.disk]]\nfile = "d.img"\non_error = { read = "enospc" }\n',
     "lab.toml:8: vm.a.disk[0].on_error.read: 'enospc' is not one of report, stop, ignore"),
    ('[[vm.a.disk]]\nfile = "d.img"\non_error = { writes = "stop" }\n',
     "vm.a.disk[0].on_error.writes: unknown key 'writes'"),
])
def test_on_error_mistakes(tmp_path: Path, text: str, said: str) -> None:
    from vmlaunch.errors import SpecError
    from vmlaunch.spec.load import load_lab

    spec = tmp_path / "lab.toml"
    spec.write_text('[lab]\nname = "t"\n[vm.a]\nmemory = 64\nkernel = "k"\n' + text)
    with pytest.raises(SpecError) as raised:
        load_lab(spec)
    assert said in str(raised.value)
