"""The guest's side of the command channel: the virtio-serial port names, vmlaunch's agent (two
implementations of one protocol, VLA1: `guest_agent.py` for guests with python3 — every cloud-init
guest — and `guest_agent.sh` for the others, such as the project's test guest) and how the cloud-init
seed installs it: from the seed itself, with no network.

The seed's `bootcmd` (cloud-init's first stage that runs commands, at every boot) writes both files
under /usr/local/lib/vmlaunch-agent and starts the Python one (the sh one without python3): as a
transient systemd service that restarts it (`systemd-run`, not waiting for the start: cloud-init runs
before the units a default service is ordered after), or detached in a loop where systemd is not PID 1.
"""

from __future__ import annotations

import base64
from pathlib import Path

AGENT_PORT = "org.vmlaunch.agent.0"
QGA_PORT = "org.qemu.guest_agent.0"
HERE = Path(__file__).resolve().parent
AGENT_PY = HERE / "guest_agent.py"
AGENT_SH = HERE / "guest_agent.sh"
GUEST_DIR = "/usr/local/lib/vmlaunch-agent"
UNIT = "vmlaunch-agent"

# $1, $2: the two agents, base64. POSIX sh; base64 is in coreutils and busybox.
INSTALL = f"""set -e
d={GUEST_DIR}
mkdir -p "$d"
printf %s "$1" | base64 -d >"$d/agent.py.new" && mv "$d/agent.py.new" "$d/agent.py"
printf %s "$2" | base64 -d >"$d/agent.sh.new" && mv "$d/agent.sh.new" "$d/agent.sh"
chmod 0700 "$d/agent.py" "$d/agent.sh"
set -- /bin/sh "$d/agent.sh"
if command -v python3 >/dev/null 2>&1; then set -- python3 "$d/agent.py"; fi
if [ -d /run/systemd/system ] && command -v systemd-run >/dev/null 2>&1; then
    systemctl stop {UNIT}.service >/dev/null 2>&1 || true
    systemctl reset-failed {UNIT}.service >/dev/null 2>&1 || true
    exec systemd-run --no-block --unit={UNIT} --description="vmlaunch command channel agent" \\
        -p DefaultDependencies=no -p Restart=always -p RestartSec=1 "$@"
fi
setsid /bin/sh -c 'while :; do "$@"; sleep 1; done' {UNIT} "$@" </dev/null >/dev/null 2>&1 &
"""


def install_command() -> list[str]:
    """The `bootcmd` entry that installs and starts vmlaunch's agent (a list: cloud-init quotes each
    word for the shell)."""
    agents = (base64.b64encode(agent.read_bytes()).decode() for agent in (AGENT_PY, AGENT_SH))
    return ["sh", "-c", INSTALL, UNIT, *agents]
