"""SSH into a lab's VMs without ever trusting a host key on first use.

A lab has one ed25519 key pair (its login into every VM) and each VM an ed25519 host key pair, all
made here with OpenSSH's ssh-keygen and kept in the lab dir (`labdir.LabDir`). The host key goes into
the VM through cloud-init (`cloudinit.user_data`) and its public half into the lab's known_hosts under
the alias `vmlaunch-LAB-VM`, so the first connection is already checked (`StrictHostKeyChecking=yes`):
the forwarded 127.0.0.1 port changes with every start, the alias does not.

Files are never written through a symlink: ssh-keygen writes into a fresh private folder and the
finished pair is renamed into place; every file is opened with O_NOFOLLOW. A pair is whole when both
files are there and the public key is the private key's (read from the private key file itself); a
half-made pair, as a run killed between the two renames leaves, is made anew. Writers of one lab's
ssh dir take an flock on that dir, so two VMs started at once cannot lose each other's known_hosts
line.

Needs `ssh-keygen` and `ssh` (Debian package openssh-client).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import ipaddress
import os
import re
import shlex
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from vmlaunch.core.fsutil import write_atomic
from vmlaunch.errors import HostError
from vmlaunch.layout.labdir import LabDir

KEY_TYPE = "ssh-ed25519"
CONNECT_TIMEOUT = 10  # seconds; the port is local: a slow answer means a guest still booting
PACKAGE = "openssh-client"

# The names the spec allows (vmlaunch.schema.json): checked again, as they become paths and options.
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_PUBLIC_LINE = re.compile(r"ssh-ed25519 ([A-Za-z0-9+/]+={0,2})(?: [!-~][ -~]*)?")
_PRIVATE_PEM = re.compile(
    r"-----BEGIN OPENSSH PRIVATE KEY-----\n([A-Za-z0-9+/=\n]+)-----END OPENSSH PRIVATE KEY-----\n?")


def ensure_lab_key(lab_dir: LabDir) -> str:
    """The lab's key pair (`lab_key`, `lab_pub`), made when missing or half made; its public line."""
    check_name(lab_dir.lab, "lab")
    lab_dir.secure(create=True)
    ssh_dir = make_private_dir(lab_dir.ssh_dir)
    with _locked(ssh_dir):
        return _ensure_pair(lab_dir.lab_key, lab_dir.lab_pub, f"vmlaunch-{lab_dir.lab}")


def ensure_host_key(lab_dir: LabDir, vm: str) -> tuple[str, str]:
    """The VM's host key pair (`VM/ssh_host_ed25519_key{,.pub}`), made when missing or half made:
    (the private key file's text, the public line)."""
    check_name(lab_dir.lab, "lab")
    check_name(vm, "VM")
    lab_dir.secure(create=True)
    files = lab_dir.vm(vm)
    folder = make_private_dir(files.path)
    with _locked(folder):
        public = _ensure_pair(files.host_key, files.host_pub, lab_dir.host_alias(vm))
        return read_own_file(files.host_key), public


def pin(lab_dir: LabDir, vm: str, public_line: str) -> None:
    """Write (or replace) the VM's line in the lab's known_hosts, `vmlaunch-LAB-VM ssh-ed25519 AAAA...`,
    keeping every other line; atomically (temp file and rename)."""
    check_name(lab_dir.lab, "lab")
    check_name(vm, "VM")
    blob = public_blob(public_line)
    alias = lab_dir.host_alias(vm)
    ssh_dir = make_private_dir(lab_dir.ssh_dir)
    with _locked(ssh_dir):
        try:
            old = read_own_file(lab_dir.known_hosts).splitlines()
        except FileNotFoundError:
            old = []
        kept = [line for line in old if line.split(" ", 1)[0] != alias]
        line = f"{alias} {KEY_TYPE} {base64.b64encode(blob).decode()}"
        write_atomic(lab_dir.known_hosts, "".join(f"{each}\n" for each in [*kept, line]), 0o600)


def unpin(lab_dir: LabDir, vm: str) -> None:
    """Drop the VM's line from the lab's known_hosts (a clone that went down), keeping every other."""
    check_name(lab_dir.lab, "lab")
    check_name(vm, "VM")
    if not os.path.lexists(lab_dir.ssh_dir):
        return
    ssh_dir = make_private_dir(lab_dir.ssh_dir)  # the user's own, never a link
    alias = lab_dir.host_alias(vm)
    with _locked(ssh_dir):
        try:
            old = read_own_file(lab_dir.known_hosts).splitlines()
        except FileNotFoundError:
            return
        kept = [line for line in old if line.split(" ", 1)[0] != alias]
        if len(kept) != len(old):
            write_atomic(lab_dir.known_hosts, "".join(f"{each}\n" for each in kept), 0o600)


def ssh_argv(lab_dir: LabDir, vm: str, user: str, port: int, command: str | Sequence[str] | None, *,
             address: str = "127.0.0.1", jump: Sequence[str] | None = None) -> list[str]:
    """The OpenSSH command line that logs `user` into the VM through its forwarded 127.0.0.1 `port`,
    with the lab's key, checking the host key pinned under the VM's alias. A VM on a libvirt host is
    reached at its `address` on a lab network, through `jump`: the ssh command line (its options, the
    host last) to its host, which forwards the connection (`ssh -W`, as the ProxyCommand).

    `command`, a string, is text for the guest's shell, as OpenSSH's own command line gives it (the
    words of `vmlaunch ssh SPEC VM -- ...` joined by spaces: `ls / | wc -l` is a pipe there). A
    sequence of words (like an argv) runs in the guest exactly as given: ssh joins its arguments into
    one string for the remote shell, so each word is quoted for a POSIX shell here. ssh's exit status
    is the command's. None opens a login shell (with a TTY when ours is one).

    - `-F /dev/null`: no ssh_config is read, so a `Host *` ProxyCommand, ControlMaster or
      RemoteCommand in the user's config cannot redirect or alter the connection.
    - `BatchMode=yes` always, for a shell too: it only stops ssh from asking (for a password, a
      passphrase, a new host key), which with a passphrase-less key and a pinned host key is never
      right; a key the guest refuses fails at once instead of prompting. A TTY is still allocated.
    - `StrictHostKeyChecking=yes`, `GlobalKnownHostsFile=/dev/null`, `UpdateHostKeys=no`,
      `CheckHostIP=no`, `HostKeyAlgorithms=ssh-ed25519`: the pinned key is the only one accepted
      and ssh never writes to the lab's known_hosts.
    - Paths: ssh expands `%` tokens and `${VAR}` in IdentityFile and UserKnownHostsFile; `%` is
      doubled and a path holding `${` is refused (ssh has no escape for it). The option value is
      quoted for ssh's option parser (spaces, quotes). The key is an `-o IdentityFile`, not `-i`:
      ssh checks an `-i` path exists before expanding it, so a `%` in it could not be escaped.
    """
    check_name(lab_dir.lab, "lab")
    check_name(vm, "VM")
    if _USER.fullmatch(user) is None:
        raise ValueError(f"{user!r} is not a user name vmlaunch makes")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"{port!r} is not a TCP port")
    if command is not None and (not command or isinstance(command, str) and not command.strip()):
        raise ValueError("the command is shell text or a non-empty sequence of words (None: a login shell)")
    if command is not None and "\0" in (command if isinstance(command, str) else "".join(command)):
        raise ValueError("a command holds a NUL byte, which no argv can carry")
    ipaddress.ip_address(address)  # ValueError for anything else
    proxy = []
    if jump is not None:  # ssh expands % tokens in a ProxyCommand: the jump's own words keep theirs
        *options, host = (shlex.quote(word).replace("%", "%%") for word in jump)
        proxy = ["-o", f"ProxyCommand={' '.join(options)} -W %h:%p {host}"]
    argv = [
        _binary("ssh"),
        "-F", "/dev/null",
        *proxy,
        "-p", str(port),
        "-o", f"IdentityFile={_option_value(_ssh_path(lab_dir.lab_key))}",
        "-o", f"HostKeyAlias={lab_dir.host_alias(vm)}",
        "-o", f"UserKnownHostsFile={_option_value(_ssh_path(lab_dir.known_hosts))}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"HostKeyAlgorithms={KEY_TYPE}",
        "-o", "UpdateHostKeys=no",
        "-o", "CheckHostIP=no",
        "-o", "IdentitiesOnly=yes",
        "-o", "BatchMode=yes",
        "-o", "LogLevel=ERROR",
        "-o", f"ConnectTimeout={CONNECT_TIMEOUT}",
        f"{user}@{address}",
    ]
    if isinstance(command, str):
        argv += ["--", command]
    elif command is not None:
        argv += ["--", *(shlex.quote(word) for word in command)]
    return argv


def public_blob(public_line: str) -> bytes:
    """The key blob of an ed25519 public key line (`ssh-ed25519 AAAA... comment`); ValueError when
    the line is anything else."""
    found = _PUBLIC_LINE.fullmatch(public_line.strip())
    if found is None:
        raise ValueError(f"not an {KEY_TYPE} public key line: {public_line[:60]!r}")
    try:
        blob = base64.b64decode(found[1], validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not an {KEY_TYPE} public key line: {exc}") from None
    key_type, rest = _ssh_string(blob, 0)
    key, end = _ssh_string(blob, rest)
    if key_type != KEY_TYPE.encode() or len(key) != 32 or end != len(blob):
        raise ValueError(f"not an {KEY_TYPE} public key: {found[1][:20]}...")
    return blob


def make_private_dir(path: Path) -> Path:
    """`path` as a directory of the user's own, 0700, made if missing (its parent must exist); never a
    symlink. Also the VM's folder in the lab dir (`cloudinit.instance_id`)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory of yours"
        raise HostError(f"refusing to use {path}: it is {kind}",
                        "it is in vmlaunch's lab dir: remove it, and the next run makes it anew")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def _ensure_pair(private: Path, public: Path, comment: str) -> str:
    for path in (private, public):
        if os.path.islink(path):  # not ours: someone planted it; refused rather than replaced
            raise HostError(f"refusing to use {path}: it is a symlink",
                            "it is in vmlaunch's lab dir: remove it, and the next run makes the key anew")
    try:
        line = read_own_file(public).strip()
        if _private_blob(read_own_file(private)) == public_blob(line):
            _check_private_mode(private)
            return line
    except (FileNotFoundError, ValueError):
        pass  # missing, half made or damaged: made anew
    return _generate(private, public, comment)


def _generate(private: Path, public: Path, comment: str) -> str:
    keygen = _binary("ssh-keygen")
    work = Path(tempfile.mkdtemp(prefix=".keygen-", dir=private.parent))  # 0700, ours alone
    try:
        made = work / "key"
        result = subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(made)],
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise HostError(f"ssh-keygen could not make a key pair for {private}: "
                            f"{result.stderr.strip() or f'exit status {result.returncode}'}")
        os.chmod(made, 0o600)
        os.chmod(work / "key.pub", 0o644)
        os.replace(made, private)  # a rename replaces a planted link, never follows it
        os.replace(work / "key.pub", public)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return read_own_file(public).strip()


def _private_blob(text: str) -> bytes:
    """The public key blob an unencrypted OpenSSH private key file holds (its header has it in the
    clear): what the .pub beside it must be."""
    found = _PRIVATE_PEM.fullmatch(text)
    if found is None:
        raise ValueError("not an OpenSSH private key file")
    try:
        data = base64.b64decode(found[1].replace("\n", ""), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not an OpenSSH private key file: {exc}") from None
    magic = b"openssh-key-v1\0"
    if not data.startswith(magic):
        raise ValueError("not an OpenSSH private key file")
    cipher, pos = _ssh_string(data, len(magic))
    _kdf, pos = _ssh_string(data, pos)
    _kdf_options, pos = _ssh_string(data, pos)
    if cipher != b"none" or data[pos:pos + 4] != b"\0\0\0\1":
        raise ValueError("an encrypted key, or more than one")
    blob, _ = _ssh_string(data, pos + 4)
    return blob


def _ssh_string(data: bytes, pos: int) -> tuple[bytes, int]:
    """One SSH wire-format string (a 32-bit length, then the bytes) at `pos`, and where it ends."""
    if pos + 4 > len(data):
        raise ValueError("a truncated key")
    (length,) = struct.unpack_from(">I", data, pos)
    end = pos + 4 + length
    if end > len(data):
        raise ValueError("a truncated key")
    return data[pos + 4:end], end


def _check_private_mode(path: Path) -> None:
    """ssh refuses a private key others may read ("UNPROTECTED PRIVATE KEY FILE"): put it back to 0600."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def read_own_file(path: Path) -> str:
    """A small regular file of ours, never through a symlink (one is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise HostError(f"refusing to read {path}: it is a symlink",
                            "it is in vmlaunch's lab dir: remove it") from None
        raise
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise HostError(f"refusing to read {path}: not a regular file of yours",
                            "it is in vmlaunch's lab dir: remove it")
        data = file.read(1 << 20)
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text") from None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive flock on `folder` itself (no lock file: the layout stays labdir's)."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise HostError(f"{name} is not installed (vmlaunch uses OpenSSH for the VMs' keys and logins)",
                        f"install the {PACKAGE} package (apt-get install {PACKAGE})")
    return found


def check_name(name: str, what: str) -> None:
    if _NAME.fullmatch(name) is None:
        raise ValueError(f"{name!r} is not a {what} name vmlaunch accepts")


def _ssh_path(path: Path) -> str:
    """A path as ssh reads IdentityFile and UserKnownHostsFile: `%` tokens doubled; `${` refused."""
    text = str(path)
    if "${" in text or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise HostError(f"ssh cannot be given the path {text!r}: it would expand ${{...}} in it, or "
                        "it holds a control character", "move the spec to a folder without them")
    return text.replace("%", "%%")


def _option_value(text: str) -> str:
    """`text` as one word for ssh's option parser (argv_split): double quotes, with `\\`, `"` and `'`
    escaped by a backslash."""
    return '"' + re.sub(r"""(["'\\])""", r"\\\1", text) + '"'
