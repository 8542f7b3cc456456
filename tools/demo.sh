#!/usr/bin/env bash
# The demo lab for real: validate, show the plan, bring it up, look at it, balloon a VM, take it down.
#
# The host's own network is never touched: the lab runs in a private network namespace (`unshare -n`),
# so its bridge vlbr-demo and its two taps exist only there and vanish with it. Creating them needs
# root. `vmlaunch up examples/lab.toml` typed by hand, outside a namespace, creates them on the host.
set -euo pipefail
cd "$(dirname "$0")/.."
VMLAUNCH=.venv/bin/vmlaunch
SPEC=examples/lab.toml

step() { printf '\n$ vmlaunch %s\n' "$*"; "$VMLAUNCH" "$@"; }

if [ -z "${VMLAUNCH_DEMO_NETNS:-}" ]; then
    step validate "$SPEC"
    step up "$SPEC" --dry-run
    if [ "$(id -u)" -ne 0 ]; then
        echo "demo: the demo lab's bridge network needs root (in a private network namespace);" \
             "run make demo as root to go on" >&2
        exit 3
    fi
    printf '\n# the rest runs in a private network namespace: the host network is not touched\n'
    exec env VMLAUNCH_DEMO_NETNS=1 unshare --net -- "$0"
fi

ip link set lo up  # the user network's port forward listens on 127.0.0.1 of the namespace
trap 'step down "$SPEC"' EXIT
step up "$SPEC" --wait-for VMLAUNCH-GUEST-READY --timeout 120
step ls
step status "$SPEC"
step balloon "$SPEC" alpha 128M
printf '\n$ vmlaunch logs %s beta | tail -n 4\n' "$SPEC"
"$VMLAUNCH" logs "$SPEC" beta | tail -n 4
