"""The lab's SSH keys, known_hosts pinning and the ssh command line: real ssh-keygen, and a real sshd
when one is available (see `sshd`)."""

from __future__ import annotations

import os
import pwd
import select
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from vmlaunch.errors import HostError
from vmlaunch.guests import sshkeys
from vmlaunch.layout.labdir import LabDir

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None or shutil.which("ssh") is None,
                                reason="OpenSSH's client (package openssh-client) is not installed")


def lab_dir_in(folder: Path, lab: str = "demo") -> LabDir:
    folder.mkdir(parents=True, exist_ok=True)
    return LabDir.of(folder / "lab.toml", lab)


@pytest.fixture
def lab_dir(tmp_path: Path) -> LabDir:
    return lab_dir_in(tmp_path / "spec")


def derived_public(private: Path) -> str:
    """The public key ssh-keygen itself derives from a private key file: the pair's ground truth."""
    out = subprocess.run(["ssh-keygen", "-y", "-f", str(private)], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --------------------------------------------------------------------------- keys


def test_lab_key_is_made_once(lab_dir: LabDir) -> None:
    line = sshkeys.ensure_lab_key(lab_dir)
    kind, blob, comment = line.split(" ")
    assert (kind, comment) == ("ssh-ed25519", "vmlaunch-demo")
    assert derived_public(lab_dir.lab_key) == blob
    assert mode(lab_dir.ssh_dir) == 0o700 and mode(lab_dir.lab_key) == 0o600
    assert lab_dir.lab_pub.read_text() == f"{line}\n"
    inode = os.stat(lab_dir.lab_key).st_ino
    assert sshkeys.ensure_lab_key(lab_dir) == line
    assert os.stat(lab_dir.lab_key).st_ino == inode
    assert sorted(p.name for p in lab_dir.ssh_dir.iterdir()) == ["id_ed25519", "id_ed25519.pub"]


def test_ssh_dir_is_made_private(lab_dir: LabDir) -> None:
    lab_dir.secure(create=True)
    lab_dir.ssh_dir.mkdir(mode=0o755)
    os.chmod(lab_dir.ssh_dir, 0o755)
    sshkeys.ensure_lab_key(lab_dir)
    assert mode(lab_dir.ssh_dir) == 0o700


def test_a_key_others_may_read_is_made_private_again(lab_dir: LabDir) -> None:
    line = sshkeys.ensure_lab_key(lab_dir)
    os.chmod(lab_dir.lab_key, 0o644)
    assert sshkeys.ensure_lab_key(lab_dir) == line
    assert mode(lab_dir.lab_key) == 0o600


@pytest.mark.parametrize("damage", ["no-public", "no-private", "other-public", "truncated-private", "empty"])
def test_a_half_made_pair_is_made_anew(lab_dir: LabDir, tmp_path: Path, damage: str) -> None:
    old = sshkeys.ensure_lab_key(lab_dir)
    if damage == "no-public":
        lab_dir.lab_pub.unlink()
    elif damage == "no-private":
        lab_dir.lab_key.unlink()
    elif damage == "other-public":  # killed between the two renames of a remake
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
        shutil.copy(tmp_path / "k.pub", lab_dir.lab_pub)
    elif damage == "truncated-private":
        text = lab_dir.lab_key.read_text()
        lab_dir.lab_key.write_text(text[:len(text) // 2])
    else:
        lab_dir.lab_key.write_text("")
    new = sshkeys.ensure_lab_key(lab_dir)
    assert new != old
    assert derived_public(lab_dir.lab_key) == new.split(" ")[1]
    assert lab_dir.lab_pub.read_text() == f"{new}\n"


def test_an_encrypted_key_is_not_taken(lab_dir: LabDir) -> None:
    lab_dir.secure(create=True)
    sshkeys.make_private_dir(lab_dir.ssh_dir)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(lab_dir.lab_key)],
                   check=True)
    line = sshkeys.ensure_lab_key(lab_dir)
    assert derived_public(lab_dir.lab_key) == line.split(" ")[1]  # readable without a passphrase


def test_keys_are_never_written_through_a_symlink(lab_dir: LabDir, tmp_path: Path) -> None:
    lab_dir.secure(create=True)
    sshkeys.make_private_dir(lab_dir.ssh_dir)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for planted in (lab_dir.lab_key, lab_dir.lab_pub):
        planted.symlink_to(victim)
        with pytest.raises(HostError, match="symlink"):
            sshkeys.ensure_lab_key(lab_dir)
        assert victim.read_text() == "precious\n"
        planted.unlink()
    sshkeys.ensure_lab_key(lab_dir)
    lab_dir.known_hosts.symlink_to(victim)
    with pytest.raises(HostError, match="symlink"):
        sshkeys.pin(lab_dir, "web", sshkeys.ensure_host_key(lab_dir, "web")[1])
    assert victim.read_text() == "precious\n"


def test_a_planted_ssh_dir_link_is_refused(lab_dir: LabDir, tmp_path: Path) -> None:
    lab_dir.secure(create=True)
    (tmp_path / "elsewhere").mkdir()
    lab_dir.ssh_dir.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(HostError, match="symlink"):
        sshkeys.ensure_lab_key(lab_dir)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_host_key(lab_dir: LabDir) -> None:
    private, public = sshkeys.ensure_host_key(lab_dir, "web")
    files = lab_dir.vm("web")
    assert private == files.host_key.read_text()
    assert private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    kind, blob, comment = public.split(" ")
    assert (kind, comment) == ("ssh-ed25519", lab_dir.host_alias("web"))
    assert derived_public(files.host_key) == blob
    assert mode(files.path) == 0o700 and mode(files.host_key) == 0o600
    assert sshkeys.ensure_host_key(lab_dir, "web") == (private, public)
    assert sshkeys.ensure_host_key(lab_dir, "db")[1] != public


@pytest.mark.parametrize("name", ["../x", "Web", "", "a/b", "-x", "x" * 40])
def test_names_are_checked_before_they_become_paths(lab_dir: LabDir, name: str) -> None:
    with pytest.raises(ValueError, match="not a VM name"):
        sshkeys.ensure_host_key(lab_dir, name)


def test_a_missing_openssh_names_the_package(lab_dir: LabDir, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(HostError) as caught:
        sshkeys.ensure_lab_key(lab_dir)
    assert "ssh-keygen is not installed" in caught.value.message
    assert caught.value.hint is not None and "openssh-client" in caught.value.hint
    with pytest.raises(HostError, match="ssh is not installed"):
        sshkeys.ssh_argv(lab_dir, "web", "dev", 2222, None)


# --------------------------------------------------------------------------- known_hosts


def test_pin_writes_replaces_and_keeps_others(lab_dir: LabDir) -> None:
    web = sshkeys.ensure_host_key(lab_dir, "web")[1]
    db = sshkeys.ensure_host_key(lab_dir, "db")[1]
    sshkeys.pin(lab_dir, "web", web)
    sshkeys.pin(lab_dir, "db", db)
    with lab_dir.known_hosts.open("a") as extra:
        extra.write("# a comment someone added\n")
    assert mode(lab_dir.known_hosts) == 0o600
    lab_dir.vm("web").host_key.unlink()
    web2 = sshkeys.ensure_host_key(lab_dir, "web")[1]
    sshkeys.pin(lab_dir, "web", web2)
    assert lab_dir.known_hosts.read_text().splitlines() == [
        f"vmlaunch-demo-db {' '.join(db.split()[:2])}",
        "# a comment someone added",
        f"vmlaunch-demo-web {' '.join(web2.split()[:2])}",
    ]
    assert sorted(p.name for p in lab_dir.ssh_dir.iterdir()) == ["known_hosts"]  # no temp file left


def test_pin_from_many_threads_loses_no_line(lab_dir: LabDir) -> None:
    lines = {f"vm{i}": sshkeys.ensure_host_key(lab_dir, f"vm{i}")[1] for i in range(8)}
    threads = [threading.Thread(target=sshkeys.pin, args=(lab_dir, vm, line)) for vm, line in lines.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(lab_dir.known_hosts.read_text().splitlines()) == 8


@pytest.mark.parametrize("line", [
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ== x",
    "ssh-ed25519 not-base64",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA==",  # a truncated key
    "ssh-ed25519 AAAA\nvmlaunch-demo-db ssh-ed25519 AAAA",
])
def test_pin_refuses_what_is_not_one_ed25519_key(lab_dir: LabDir, line: str) -> None:
    with pytest.raises(ValueError):
        sshkeys.pin(lab_dir, "web", line)


# --------------------------------------------------------------------------- the command line


def test_ssh_argv(lab_dir: LabDir) -> None:
    argv = sshkeys.ssh_argv(lab_dir, "web", "dev", 40022, ["sh", "-c", "exit 7"])
    assert argv[0] == shutil.which("ssh")
    options = [argv[i + 1] for i, word in enumerate(argv) if word == "-o"]
    assert options == [
        f'IdentityFile="{lab_dir.lab_key}"',
        "HostKeyAlias=vmlaunch-demo-web",
        f'UserKnownHostsFile="{lab_dir.known_hosts}"',
        "GlobalKnownHostsFile=/dev/null",
        "StrictHostKeyChecking=yes",
        "HostKeyAlgorithms=ssh-ed25519",
        "UpdateHostKeys=no",
        "CheckHostIP=no",
        "IdentitiesOnly=yes",
        "BatchMode=yes",
        "LogLevel=ERROR",
        f"ConnectTimeout={sshkeys.CONNECT_TIMEOUT}",
    ]
    assert argv[1:5] == ["-F", "/dev/null", "-p", "40022"]
    assert argv[-5:] == ["dev@127.0.0.1", "--", "sh", "-c", "'exit 7'"]
    shell = sshkeys.ssh_argv(lab_dir, "web", "dev", 40022, None)
    assert shell[-1] == "dev@127.0.0.1" and "--" not in shell


def test_shell_text_is_given_to_ssh_as_it_is(lab_dir: LabDir) -> None:
    """A string is the remote shell's text, as OpenSSH's own command line makes it: not one quoted word."""
    argv = sshkeys.ssh_argv(lab_dir, "web", "dev", 40022, "ls / | wc -l")
    assert argv[-3:] == ["dev@127.0.0.1", "--", "ls / | wc -l"]


@pytest.mark.parametrize(("user", "port", "command"), [
    ("Dev", 22, None), ("-oProxyCommand=x", 22, None), ("dev", 0, None), ("dev", 65536, None),
    ("dev", True, None), ("dev", 22, []), ("dev", 22, ""), ("dev", 22, "  "), ("dev", 22, "a\0b"),
    ("dev", 22, ["a\0b"]),
])
def test_ssh_argv_refuses_odd_values(lab_dir: LabDir, user: str, port: int,
                                     command: list[str] | None) -> None:
    with pytest.raises(ValueError):
        sshkeys.ssh_argv(lab_dir, "web", user, port, command)


def test_paths_are_escaped_for_ssh(tmp_path: Path) -> None:
    lab_dir = lab_dir_in(tmp_path / "a b'c\"d%h")
    argv = sshkeys.ssh_argv(lab_dir, "web", "dev", 2222, None)
    folder = f"{tmp_path}/a b\\'c\\\"d%%h/.vmlaunch/demo/ssh"
    assert f'IdentityFile="{folder}/id_ed25519"' in argv
    assert f'UserKnownHostsFile="{folder}/known_hosts"' in argv
    with pytest.raises(HostError, match="would expand"):
        sshkeys.ssh_argv(lab_dir_in(tmp_path / "${HOME}"), "web", "dev", 2222, None)


# --------------------------------------------------------------------------- against a real sshd


@attrs.frozen
class Server:
    lab_dir: LabDir
    vm: str
    user: str
    port: int

    def ssh(self, command: list[str] | None, **kwargs: object) -> subprocess.CompletedProcess[str]:
        argv = sshkeys.ssh_argv(self.lab_dir, self.vm, self.user, self.port, command)
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              check=False)


def _sshd_binary() -> str:
    """VMLAUNCH_TEST_SSHD, else an installed sshd. This test never installs openssh-server: its
    package starts a system service. An sshd extracted from the package (`dpkg-deb -x`) serves."""
    found = os.environ.get("VMLAUNCH_TEST_SSHD") or shutil.which("sshd") or shutil.which("/usr/sbin/sshd")
    if not found:
        pytest.skip("no sshd: openssh-server is not installed (installing it would start a system "
                    "service); set VMLAUNCH_TEST_SSHD to an sshd binary, e.g. one unpacked from the "
                    "package with dpkg-deb -x")
    return os.path.abspath(found)  # sshd re-executes itself by this path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _as_root_wrapper(work: Path) -> list[str]:
    """sshd as root separates privileges into user `sshd` and chroots to /run/sshd. When this host
    has neither, give them to sshd alone: a private mount namespace with a passwd file naming the
    user and a tmpfs on /run (the host's files and services are not touched)."""
    try:
        pwd.getpwnam("sshd")
        if os.path.isdir("/run/sshd"):
            return []
    except KeyError:
        pass
    if shutil.which("unshare") is None:
        pytest.skip("sshd as root needs user sshd and /run/sshd, or unshare(1) to provide them")
    passwd = work / "passwd"
    passwd.write_text(Path("/etc/passwd").read_text() + "sshd:x:64999:65534::/run/sshd:/usr/sbin/nologin\n")
    script = (f'mount --bind "{passwd}" /etc/passwd && mount -t tmpfs -o mode=0755 vmlaunch-test /run '
              '&& mkdir -m 0755 /run/sshd && exec "$0" "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Server]:
    """A real sshd on 127.0.0.1 with the VM's host key, letting the lab's key in."""
    binary = _sshd_binary()
    user = pwd.getpwuid(os.geteuid()).pw_name
    lab_dir = lab_dir_in(tmp_path / "spec d'i\"r %h")  # ssh expands %h, splits at spaces, unquotes
    lab_key = sshkeys.ensure_lab_key(lab_dir)
    sshkeys.pin(lab_dir, "web", sshkeys.ensure_host_key(lab_dir, "web")[1])
    work = tmp_path / "sshd"
    work.mkdir()
    shutil.copy(lab_dir.vm("web").host_key, work / "host_key")  # sshd_config paths: no spaces
    (work / "authorized_keys").write_text(f"{lab_key}\n")
    port = _free_port()
    (work / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {work}/host_key\n"
        f"AuthorizedKeysFile {work}/authorized_keys\nPidFile none\nUsePAM no\nStrictModes no\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"AllowUsers {user}\n")
    wrapper = _as_root_wrapper(work) if os.geteuid() == 0 else []
    process = subprocess.Popen([*wrapper, binary, "-D", "-e", "-f", str(work / "sshd_config")],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    assert process.stderr is not None
    try:
        log = _wait_for_listening(process, port)
        if log is not None:
            pytest.skip(f"sshd did not start: {log.strip()[-400:]}")
        yield Server(lab_dir=lab_dir, vm="web", user=user, port=port)
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stderr.close()


def _wait_for_listening(process: subprocess.Popen[str], port: int, timeout: float = 20) -> str | None:
    """None once sshd says it listens (its handshake, no sleeping); else what it said before dying."""
    assert process.stderr is not None
    said = ""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([process.stderr], [], [], left)
        if not ready:
            break
        line = process.stderr.readline()
        if not line:
            return said or f"exit status {process.wait()}"
        said += line
        if f"Server listening on 127.0.0.1 port {port}" in line:
            return None
    return said or "no answer"


def test_the_exit_status_passes_through(sshd: Server) -> None:
    result = sshd.ssh(["sh", "-c", "exit 7"])
    assert result.returncode == 7, result.stderr
    assert result.stderr == ""  # LogLevel=ERROR: no "Permanently added" or other chatter


def test_words_arrive_intact(sshd: Server) -> None:
    words = ["a b", "it's", '"quoted"', "$HOME", "`id`", "$(id)", "*", "", "back\\slash", "semi;colon",
             "new\nline", "-n", "ünïcødé"]
    result = sshd.ssh(["printf", "%s\\0", *words])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\0")[:-1] == words


def test_shell_text_runs_in_the_remote_shell(sshd: Server) -> None:
    """`vmlaunch ssh SPEC VM -- 'ls / | wc -l'`, as OpenSSH runs it: a pipe, and a word quoted inside."""
    argv = sshkeys.ssh_argv(sshd.lab_dir, sshd.vm, sshd.user, sshd.port, "printf '%s\\n' a b | wc -l; "
                            "echo 'two  spaces'")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                            check=False)
    assert (result.returncode, result.stdout.split()[0], result.stdout.splitlines()[1]) == \
        (0, "2", "two  spaces"), result.stderr


def test_the_pinned_host_key_is_the_only_one_taken(sshd: Server, tmp_path: Path) -> None:
    before = sshd.lab_dir.known_hosts.read_bytes()
    assert sshd.ssh(["true"]).returncode == 0
    assert sshd.lab_dir.known_hosts.read_bytes() == before  # ssh wrote nothing there
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    sshkeys.pin(sshd.lab_dir, "web", (tmp_path / "other.pub").read_text())
    changed = sshd.ssh(["true"])
    assert changed.returncode == 255
    assert "Host key verification failed" in changed.stderr


def test_no_host_key_is_trusted_on_first_use(sshd: Server) -> None:
    sshd.lab_dir.known_hosts.unlink()
    result = sshd.ssh(["true"])
    assert result.returncode == 255
    assert "Host key verification failed" in result.stderr
    assert not sshd.lab_dir.known_hosts.exists()


def test_another_vms_pin_does_not_open_this_one(sshd: Server) -> None:
    """The alias, not the port, picks the pinned key: db's pin says nothing about web's port."""
    sshd.lab_dir.known_hosts.write_text(sshd.lab_dir.known_hosts.read_text().replace("-web ", "-db "))
    assert sshd.ssh(["true"]).returncode == 255
