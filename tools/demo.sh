#!/usr/bin/env bash
# The demo lab for real: validate, show the plan, bring it up, look at it, balloon a VM, take it down.
# The lab's bridge network needs root (it creates vlbr-demo and two taps, and removes them again).
set -euo pipefail
cd "$(dirname "$0")/.."
VMLAUNCH=.venv/bin/vmlaunch
SPEC=examples/lab.toml

step() { printf '\n$ vmlaunch %s\n' "$*"; "$VMLAUNCH" "$@"; }

step validate "$SPEC"
step up "$SPEC" --dry-run
if [ "$(id -u)" -ne 0 ]; then
    echo "demo: the demo lab's bridge network needs root; run make demo as root to go on" >&2
    exit 3
fi
trap 'step down "$SPEC"' EXIT
step up "$SPEC" --wait-for VMLAUNCH-GUEST-READY --timeout 120
step status "$SPEC"
step balloon "$SPEC" alpha 128M
printf '\n$ vmlaunch logs %s beta | tail -n 4\n' "$SPEC"
"$VMLAUNCH" logs "$SPEC" beta | tail -n 4
