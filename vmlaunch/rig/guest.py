"""What a test rig does in its guests through the command channel (rig/agent.py): commands that
must succeed or fail, waits for a command, a systemd unit or a listening port, and copies of files and
folders both ways. `api.Vm` and the `exec`/`cp` commands are thin over these.

Copies travel as tar streams (the guest's `tar`: busybox's and GNU's read and write the same format):
modes are kept, the guest's copies belong to root. What comes from the guest is hostile: it is
unpacked beneath a descriptor of a staging folder, never through a link, and merged into the target
without following what stands there (core/beneath.py: no absolute names, nothing outside the target,
no device nodes or FIFOs, no setuid or setgid bits, links only inside the copy).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import attrs

from vmlaunch.core.wait import TimedOut, wait_until
from vmlaunch.errors import AgentError, CommandTimedOut, RuntimeFailure, UsageError
from vmlaunch.layout.rundir import RunDir
from vmlaunch.rig.agent import (
    DEFAULT_LIMIT,
    DEFAULT_TIMEOUT,
    DEFAULT_WAIT,
    Command,
    Result,
    command_line,
    describe,
    run,
)
from vmlaunch.spec.model import LabSpec

COPY_LIMIT = 1 << 40  # bytes a copy from the guest may bring (a guest could send without end)
POLL = 0.5  # seconds between tries of a wait


class CommandFailed(RuntimeFailure):
    """A command that had to succeed (or fail) did not; `.result` holds its exit status and output."""

    def __init__(self, message: str, result: Result) -> None:
        super().__init__(message, _outputs(result))
        self.result = result


def _outputs(result: Result, width: int = 2000) -> str | None:
    parts = []
    for name, data in (("stdout", result.stdout), ("stderr", result.stderr)):
        text = data.decode("utf-8", "replace").strip()
        if text:
            text = text if len(text) <= width else "..." + text[-width:]
            parts.append(f"{name}: {text}")
    return "\n  ".join(parts) or None


def text_of(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _poll(attempt: Callable[[float], str | None], timeout: float) -> str | None:
    """`attempt(seconds left)` every POLL seconds (the project's one wait loop) until it returns
    something other than None; None when `timeout` passes first."""
    deadline = time.monotonic() + timeout

    def check() -> str | None:
        left = deadline - time.monotonic()
        return attempt(left) if left > 0 else None

    try:
        return wait_until(check, timeout, interval=POLL)
    except TimedOut:
        return None


UNIT_STATE = """command -v systemctl >/dev/null 2>&1 || { echo no-systemd; exit 0; }
systemctl show -p LoadState -p ActiveState -p SubState -- "$1" 2>&1 | tr '\\n' ' '"""


PORT_LISTENING = """p=$(printf '%04X' "$1")
for f in /proc/net/tcp /proc/net/tcp6; do
    [ -r "$f" ] && grep -Eq "^ *[0-9]+: [0-9A-F]+:$p [0-9A-F]+:[0-9A-F]+ 0A " "$f" && exit 0
done
exit 1"""


# ---------------------------------------------------------------------------------------- copies

PLACE = """d=$1
if [ -d "$d" ]; then echo dir; elif [ -e "$d" ] || [ -L "$d" ]; then echo other; else echo none; fi
parent=$(dirname -- "$d"); [ -d "$parent" ] && echo parent-ok || echo parent-missing"""

UNPACK = """set -e
mkdir -p -- "$1"
tar -x -f - -C "$1"
"""

PACK = """set -e
[ -e "$1/$2" ] || [ -L "$1/$2" ] || { echo "no such file or folder: ${1%/}/$2" >&2; exit 2; }
tar -c -f - -C "$1" -- "$2"
"""


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


@attrs.frozen
class Guest:
    """A running VM's guest as a test rig drives it: through the command channel, or through SSH when
    `via` is "ssh" (then `lab` is needed: the SSH key, user and port come from it). `via` "agent" or
    "qga" uses only that agent of the channel; None takes whichever answers."""

    run_dir: RunDir
    vm: str
    lab: LabSpec | None = None
    via: str | None = None

    def run(self, cmd: Command, *, timeout: float | None = DEFAULT_TIMEOUT, input: bytes | None = None,
            wait: float = DEFAULT_WAIT, limit: int = DEFAULT_LIMIT,
            stdout: IO[bytes] | None = None) -> Result:
        """`agent.run` through the channel, or the same over SSH."""
        if self.via != "ssh":
            return run(self.run_dir, self.vm, cmd, timeout=timeout, input=input, wait=wait, limit=limit,
                       via=self.via, stdout=stdout)
        return self._ssh(cmd, timeout, input, stdout)

    def _ssh(self, cmd: Command, timeout: float | None, input: bytes | None,
             stdout: IO[bytes] | None) -> Result:
        from vmlaunch.lab.running import ssh_argv_of

        if self.lab is None:
            raise UsageError("via=\"ssh\" needs the lab's spec")
        text = command_line(cmd).decode("utf-8", "surrogateescape")
        argv = ssh_argv_of(self.run_dir, self.lab, self.vm, ["sh", "-c", text])
        try:
            done = subprocess.run(argv, input=input or b"", capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as expired:
            result = Result(-1, expired.stdout or b"", expired.stderr or b"", timed_out=True, via="ssh")
            error = CommandTimedOut(f"{self.vm}: {describe(cmd)!r} did not end within {timeout:g} s "
                                    "(SSH was stopped; the command may still run in the guest)")
            error.result = result  # type: ignore[attr-defined]
            raise error from None
        if done.returncode == 255:
            why = done.stderr.decode("utf-8", "replace").strip()[-300:]
            raise AgentError(f"{self.vm}: SSH failed: {why}")
        out = done.stdout
        if stdout is not None:
            stdout.write(out)
            out = b""
        return Result(done.returncode, out, done.stderr, via="ssh")

    def succeed(self, cmd: Command, timeout: float | None = DEFAULT_TIMEOUT) -> str:
        """Run `cmd`; its standard output, or CommandFailed naming its exit status with both outputs."""
        result = self.run(cmd, timeout=timeout)
        if result.exit_code != 0:
            raise CommandFailed(f"{self.vm}: {describe(cmd)!r} exited with status {result.exit_code}", result)
        return text_of(result.stdout)

    def fail(self, cmd: Command, timeout: float | None = DEFAULT_TIMEOUT) -> str:
        """Run `cmd`, which must fail; its standard output, or CommandFailed when it exits 0."""
        result = self.run(cmd, timeout=timeout)
        if result.exit_code == 0:
            raise CommandFailed(f"{self.vm}: {describe(cmd)!r} succeeded, and was expected to fail", result)
        return text_of(result.stdout)

    def wait_until_succeeds(self, cmd: Command, timeout: float = 900.0) -> str:
        """Run `cmd` until it exits 0 (each try within what is left of `timeout`); its standard output.
        RuntimeFailure with the last try's status and output when `timeout` seconds pass first."""
        last: list[Result] = []

        def attempt(left: float) -> str | None:
            try:
                result = self.run(cmd, timeout=max(1.0, left), wait=max(1.0, left))
            except CommandTimedOut as timed_out:
                last[:] = [timed_out.result]  # type: ignore[attr-defined]
                return None
            last[:] = [result]
            return text_of(result.stdout) if result.exit_code == 0 else None

        found = _poll(attempt, timeout)
        if found is None:
            message = f"{self.vm}: {describe(cmd)!r} did not succeed within {timeout:g} s"
            if last:
                raise CommandFailed(f"{message}; its last try exited with status {last[0].exit_code}",
                                    last[0])
            raise RuntimeFailure(message)
        return found


    def wait_for_unit(self, unit: str, timeout: float = 900.0) -> None:
        """Wait until systemd's `unit` is active in the guest. A unit that failed ends the wait at once
        (CommandFailed with its journal's tail); RuntimeFailure when `timeout` passes first."""
        if not unit or unit.startswith("-") or any(c.isspace() for c in unit):
            raise UsageError(f"{unit!r} is not a systemd unit name")
        seen = [""]

        def attempt(left: float) -> str | None:
            state = self.succeed(["sh", "-c", UNIT_STATE, "unit-state", unit], timeout=max(5.0, left))
            seen[0] = state.strip()
            if state.strip() == "no-systemd":
                raise RuntimeFailure(f"{self.vm}: the guest has no systemd (no systemctl): wait_for_unit "
                                     "needs one",
                                     "wait for a command instead: wait_until_succeeds")
            fields = dict(word.split("=", 1) for word in state.split() if "=" in word)
            if fields.get("ActiveState") == "active":
                return state
            if fields.get("ActiveState") == "failed":
                journal = self.run(["journalctl", "--no-pager", "-n", "30", "-u", unit], timeout=30)
                raise CommandFailed(f"{self.vm}: unit {unit} failed ({fields.get('SubState', '?')})", journal)
            return None

        if _poll(attempt, timeout) is None:
            raise RuntimeFailure(f"{self.vm}: unit {unit} was not active within {timeout:g} s (last seen: "
                                 f"{seen[0] or 'nothing'})")


    def wait_for_port(self, port: int, timeout: float = 900.0) -> None:
        """Wait until something listens on TCP `port` in the guest (any address, IPv4 or IPv6)."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise UsageError(f"port {port!r} is not 1-65535")

        def attempt(left: float) -> str | None:
            result = self.run(["sh", "-c", PORT_LISTENING, "port", str(port)], timeout=max(5.0, left))
            return "" if result.exit_code == 0 else None

        if _poll(attempt, timeout) is None:
            raise RuntimeFailure(f"{self.vm}: nothing listened on TCP port {port} within {timeout:g} s")


    def copy_to(self, source: str | os.PathLike[str], target: str, timeout: float | None = 600.0) -> str:
        """Copy the host's file or folder `source` to `target` in the guest, as `cp -r` would: into
        `target` when it is a folder there, else as `target` (its folder is made). Modes are kept; the
        copies belong to root. Returns the guest path written."""
        src = Path(source)
        if not os.path.lexists(src):
            raise UsageError(f"{src}: no such file or folder on the host")
        _check_guest_path(target)
        place = self.succeed(["sh", "-c", PLACE, "place", target], timeout=30).split()
        if place[:1] != ["dir"] and place[1:2] == ["parent-missing"]:
            raise UsageError(f"{self.vm}:{os.path.dirname(target.rstrip('/')) or '/'}: no such folder in the "
                             "guest", "make it first, e.g. vmlaunch exec SPEC VM -- mkdir -p FOLDER")
        if place and place[0] == "dir":
            parent, name = target.rstrip("/") or "/", src.name
        else:
            parent, name = os.path.dirname(target.rstrip("/")) or "/", os.path.basename(target.rstrip("/"))
        if not name or name in (".", ".."):
            raise UsageError(f"{target!r}: name the file or folder to write in the guest")
        with tempfile.TemporaryFile() as stream:
            with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
                try:
                    tar.add(str(src), arcname=name, filter=_as_root)
                except OSError as exc:
                    raise RuntimeFailure(f"cannot read {exc.filename or src}: {exc.strerror or exc}") \
                        from None
            stream.seek(0)
            data = stream.read()
        result = self.run(["sh", "-c", UNPACK, "unpack", parent], input=data, timeout=timeout)
        if result.exit_code != 0:
            raise CommandFailed(f"{self.vm}: cannot write {target} in the guest (tar exited with status "
                                f"{result.exit_code})", result)
        return f"{parent.rstrip('/')}/{name}"


    def copy_from(self, source: str, target: str | os.PathLike[str], timeout: float | None = 600.0,
                  limit: int = COPY_LIMIT) -> Path:
        """Copy the guest's file or folder `source` to the host's `target`, as `cp -r` would (into
        `target` when it is a folder). Modes are kept, less setuid and setgid bits; the copies belong to
        whoever runs vmlaunch; links may only point inside the copy, device nodes are refused. Returns
        the host path written.

        The guest's stream is hostile input: it is unpacked beneath a descriptor of a staging folder
        that vmlaunch made, never through a link (core/beneath.py says how and why), then merged into
        the target without following anything that already stands there."""
        from vmlaunch.core import beneath

        _check_guest_path(source)
        stripped = source.rstrip("/") or "/"
        if stripped == "/":
            raise UsageError("copying the guest's whole root folder is not supported: name a folder in it")
        parent, name = os.path.dirname(stripped) or "/", os.path.basename(stripped)
        dest = Path(target)
        final = dest / name if dest.is_dir() else dest  # the user's own name is followed, nothing below it
        if final.name in ("", ".", ".."):
            raise UsageError(f"{target}: name the file or folder to write on the host")
        try:
            where = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            raise UsageError(f"{final.parent}: no such folder on the host") from None
        staging = f".vmlaunch-cp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.mkdir(staging, 0o700, dir_fd=where)
            with beneath.opened_dir(where, [staging]) as staged:
                self._unpack(source, parent, name, staged, final.parent, timeout, limit)
                beneath.merge(staged, name, where, final.name, str(final))
        except beneath.Refused as refused:
            raise RuntimeFailure(f"{self.vm}: the copy of {source} was refused: {refused}",
                                 "what the guest sent would reach outside the destination or is not "
                                 "a plain file, folder or link; nothing of it was kept") from None
        except OSError as exc:
            raise RuntimeFailure(f"cannot write {final}: {exc.strerror or exc}") from None
        finally:
            shutil.rmtree(final.parent / staging, ignore_errors=True)  # fd-based: follows no link
            os.close(where)
        return final

    def _unpack(self, source: str, parent: str, name: str, staged: int, spool: Path,
                timeout: float | None, limit: int) -> None:
        """The guest's tar stream of `parent/name` (spooled in a nameless file in `spool`), unpacked
        beneath the folder open as `staged` (core/beneath.py)."""
        from vmlaunch.core import beneath

        with tempfile.TemporaryFile(dir=spool) as stream:
            result = self.run(["sh", "-c", PACK, "pack", parent, name], timeout=timeout, limit=limit,
                              stdout=stream)
            if result.exit_code != 0:
                raise CommandFailed(f"{self.vm}: cannot read {source} in the guest", result)
            if result.truncated:
                raise RuntimeFailure(f"{self.vm}: {source} is larger than the {limit} bytes a copy may "
                                     "bring")
            stream.seek(0)
            beneath.extract(stream, staged, name)


def _check_guest_path(path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/"):
        raise UsageError(f"{path!r}: a guest path must be absolute (start with /)")
    if "\0" in path or "\n" in path:
        raise UsageError(f"{path!r}: a guest path cannot hold a NUL or a newline")


def split_vm_path(text: str) -> tuple[str | None, str]:
    """`VM:PATH` -> (VM, PATH); a host path -> (None, path). A host path holding a colon is written
    with a folder (`./a:b`)."""
    if ":" in text and not text.startswith(("/", ".", "~")):
        vm, _, path = text.partition(":")
        if vm and "/" not in vm:
            return vm, path
    return None, text
