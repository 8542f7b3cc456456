"""The command channel to a guest: run a command, copy files, without the network or SSH.

(Interface first; the implementation lands with the channel.)
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from vmlaunch.errors import AgentError
from vmlaunch.layout.rundir import RunDir

DEFAULT_TIMEOUT = 60.0


@attrs.frozen
class Result:
    """What a command run in a guest did: its exit status (128+N when killed by signal N) and its
    output, bytes as the guest wrote them; `truncated` when either stream passed the bound."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool = False


def run(run_dir: RunDir, vm: str, cmd: str | Sequence[str], *, timeout: float | None = DEFAULT_TIMEOUT,
        input: bytes | None = None) -> Result:
    """Run `cmd` in VM `vm` (a string through the guest's shell, a sequence as argv).

    Raises AgentError when the VM has no channel, no agent answers, or the channel closes or hangs;
    CommandTimedOut when the command outlives `timeout` (it is killed in the guest)."""
    raise AgentError(f"{vm}: the command channel is not built yet")
