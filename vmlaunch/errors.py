"""Typed errors. Raised deep, turned into a message and an exit code only in `cli.main`.

Exit codes (the manual's Errors page, docs/reference/errors.md):
  2   the spec is wrong (every problem is listed, `FILE:LINE: key.path: message`), or asks for what
      it cannot have (a snapshot of a raw disk: saved/snapshot.py's SnapshotUnsupported)
  3   the host cannot do what the spec asks (no QEMU, KVM unusable, a missing QEMU feature), or
      the engine a lab is exported to has no equivalent for a setting (`export --strict`)
  4   a run-time failure (QEMU refused to start, a host resource is busy)
  5   the command channel failed (no agent answers, it closed, it hangs)
  6   a throwaway VM's guest panicked (`vmlaunch run`)
  64  the command line itself is wrong (usage)
  73  a file the user named for vmlaunch to write cannot be made: a FIFO, device, folder or symlink
      stands at its name, or nothing could be saved in the folder named (as sysexits' EX_CANTCREAT)
  130 interrupted
  141 the reader of standard output went away (`vmlaunch cmdline lab.toml | head -1`), as SIGPIPE
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Union

import attrs

KeyPath = tuple[Union[str, int], ...]

EXIT_SPEC = 2
EXIT_HOST = 3
EXIT_RUNTIME = 4
EXIT_AGENT = 5  # the guest's command channel: no agent answers, it closed, it hangs
EXIT_GUEST_PANIC = 6  # the guest of a throwaway VM (`vmlaunch run`) panicked
EXIT_TIMED_OUT = 124  # a command run in a guest did not end in time (as timeout(1))
EXIT_USAGE = 64
EXIT_CANT_CREATE = 73  # sysexits' EX_CANTCREAT: a file the user named cannot be made
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE: what a shell shows for `yes | head -1`


def format_key_path(path: Sequence[str | int]) -> str:
    """`("vm", "web", "disk", 0, "cache")` -> `vm.web.disk[0].cache`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


@attrs.frozen
class Location:
    """Where in a spec file a problem is: the file, the 1-based line and the key path."""

    file: Path
    line: int
    key_path: KeyPath = ()

    def __str__(self) -> str:
        prefix = f"{self.file}:{self.line}:"
        key = format_key_path(self.key_path)
        return f"{prefix} {key}:" if key else prefix


@attrs.frozen
class Problem:
    """One thing wrong with a spec."""

    location: Location
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        text = f"{self.location} {self.message}"
        return f"{text} ({self.hint})" if self.hint else text


class VmlaunchError(Exception):
    """Base of every error a user may see; `exit_code` is what `main` returns."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class SpecError(VmlaunchError):
    """The spec is wrong; carries every problem found, sorted by line."""

    exit_code = EXIT_SPEC

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(sorted(problems, key=lambda p: (str(p.location.file), p.location.line)))
        super().__init__("\n".join(str(p) for p in self.problems))

    def __str__(self) -> str:
        return self.message


class HostError(VmlaunchError):
    """The host (QEMU, KVM, sysfs, the kernel) cannot do what was asked.

    `location` names the spec key that asked for it, when there is one.
    """

    exit_code = EXIT_HOST

    def __init__(
        self, message: str, hint: str | None = None, location: Location | None = None
    ) -> None:
        super().__init__(f"{location} {message}" if location else message, hint)
        self.location = location


class RuntimeFailure(VmlaunchError):
    """Something failed while running: a command, QEMU start-up, a busy resource."""

    exit_code = EXIT_RUNTIME


def needs_root(doing: str, capability: str | None = None) -> str:
    """The one hint for every "needs root": what needed it and how to get it."""
    also = f" (or {capability})" if capability else ""
    return f"{doing} needs root{also}: run vmlaunch as root"


class SpecUnfit(RuntimeFailure):
    """What the spec gives a VM rules out the command asked (a snapshot of a raw disk, a fork of a VM
    with a PCI device): a problem of the spec, so exit 2 as every other; nothing was changed."""

    exit_code = EXIT_SPEC


class GuestPanicked(RuntimeFailure):
    """The guest of a throwaway VM (`vmlaunch run`) panicked while it booted or ran the command."""

    exit_code = EXIT_GUEST_PANIC


class AgentError(RuntimeFailure):
    """The command channel to a guest failed: the VM has none, no agent answers on it, the guest
    closed it or it stopped answering."""

    exit_code = EXIT_AGENT


class GuestPaused(AgentError):
    """The VM was paused by a failed disk request (its disk's on_error "stop") while its command
    channel waited for the guest, which answers nothing until the VM is resumed."""


class CommandTimedOut(RuntimeFailure):
    """A command run in a guest through its channel did not end within its timeout; the agent killed
    it (and what it started in its process group) in the guest."""

    exit_code = EXIT_TIMED_OUT


class UsageError(VmlaunchError):
    """The command line is wrong (an unknown VM name, a bad option value)."""

    exit_code = EXIT_USAGE


class OutputRefused(UsageError):
    """A file the user named for vmlaunch to write (a screenshot, `graph --out`, evidence) cannot be
    made: what stands at its name is not a regular file (a FIFO, a device, a folder, a symlink), which
    vmlaunch never writes through nor replaces, or nothing could be saved in the folder named."""

    exit_code = EXIT_CANT_CREATE

    @classmethod
    def of(cls, refused: OSError) -> OutputRefused:
        """The one line for a name where something other than a regular file stands (`str(refused)`
        is `PATH: it is a FIFO, not a regular file`, core/fsutil.py's Unfit)."""
        return cls(f"will not write {refused} (name a new file, or a regular file to replace)")


class ExportError(VmlaunchError):
    """`export --strict`: spec keys the target engine has no equivalent for, each with its line. The
    target cannot do what the spec asks, as a host cannot (exit 3)."""

    exit_code = EXIT_HOST

    def __init__(self, target: str, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        super().__init__(f"{target} has no equivalent for {count} setting{'s' if count != 1 else ''} "
                         "of the spec (--strict):\n" + "\n".join(str(p) for p in self.problems),
                         "export without --strict to get the files anyway, with these as warnings")
