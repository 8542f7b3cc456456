#!/bin/sh
# vmlaunch's agent for guests without python3 (the project's test guest; any POSIX sh with dd,
# head, mkfifo, setsid and wc, as busybox has). It serves vmlaunch's command channel, protocol VLA1
# (vmlaunch/rig/agent.py is the host side), on the virtio-serial port org.vmlaunch.agent.0.
# Whoever can open the channel's socket on the host is root in this guest: that socket is 0600.
#
#   host:  VLA1 hello NONCE\n                       guest: VLA1 NONCE ready 1 sh\n
#   host:  VLA1 exec ID CMDLEN INLEN TIMEOUT LIMIT\n CMD INPUT VLA1 end ID\n
#   guest: VLA1 ID done STATUS TIMEDOUT OUTLEN ERRLEN TRUNCATED\n OUT ERR
#
# CMD runs as `sh -c CMD` in a session of its own (its process group is what a timeout kills, and
# what is killed when the host side closes before it ends), stdin from INPUT, in /, umask 022. Each output stream keeps its first LIMIT bytes; the rest is read and
# dropped (TRUNCATED=1). While the host side is closed the port's reads end at once, but a write
# blocks until the host side opens (the kernel's virtio_console: will_write_block): the agent waits
# for a client by writing one newline (which the host skips before the answer to its hello), in the
# kernel, without a poll: an idle guest spends nothing on its agent.

PORT_NAME=org.vmlaunch.agent.0
umask 077

find_port() {
    for dir in /sys/class/virtio-ports/*; do
        if [ "$(cat "$dir/name" 2>/dev/null)" = "$PORT_NAME" ]; then
            echo "/dev/${dir##*/}"
            return 0
        fi
    done
    return 1
}

take() {  # take N FILE: exactly N bytes of the channel into FILE; fails on a short read
    dd bs=65536 count="$1" iflag=fullblock,count_bytes of="$2" 2>/dev/null <&3 || return 1
    [ "$(wc -c <"$2")" -eq "$1" ]
}

bounded() {  # bounded LIMIT FILE < STREAM: keep LIMIT bytes in FILE; FILE.over says if there was more
    if head -c "$1" >"$2"; then
        [ "$(wc -c)" -gt 0 ] && : >"$2.over"
    else
        : >"$2.over"  # no room for it in the guest: cut too
        cat >/dev/null
    fi
}

run_exec() {  # run_exec ID CMDLEN INLEN TIMEOUT LIMIT
    id=$1
    rm -rf "$W" && mkdir -m 0700 "$W" || { printf 'VLA1 %s error cannot make %s\n' "$id" "$W" >&3; return 1; }
    take "$2" "$W/cmd" && take "$3" "$W/in" || return 1
    IFS= read -r trailer <&3 || return 1
    if [ "$trailer" != "VLA1 end $id" ]; then
        printf 'VLA1 %s error the request was cut or garbled\n' "$id" >&3
        return 1
    fi
    mkfifo "$W/o" "$W/e" || { printf 'VLA1 %s error cannot make fifos in %s\n' "$id" "$W" >&3; return 1; }
    bounded "$5" "$W/out" <"$W/o" 3>&- &
    reader_out=$!
    bounded "$5" "$W/err" <"$W/e" 3>&- &
    reader_err=$!
    # the command never holds the port (3>&-): what it leaves running in the background (a server it
    # started) would keep the port busy, and an agent started anew could not open it
    if [ "$2" -le 100000 ]; then  # as `sh -c` (a command line's arguments hold 128 KiB at most)
        (cd / && umask 022 && exec setsid sh -c "$(cat "$W/cmd")" sh <"$W/in" >"$W/o" 2>"$W/e" 3>&-) &
    else
        (cd / && umask 022 && exec setsid sh "$W/cmd" <"$W/in" >"$W/o" 2>"$W/e" 3>&-) &
    fi
    pid=$!
    # the host gone (its command interrupted): a read of the port ends; then the command is killed
    (exec setsid sh -c 'dd bs=1 count=1 of=/dev/null 2>/dev/null; : >"$2"; kill -KILL -"$1"' \
        hangup "$pid" "$W/hungup" <&3) &
    hangup=$!
    watchdog=''
    if [ "$4" -gt 0 ]; then
        (exec setsid sh -c 'sleep "$1"; : >"$3"; kill -KILL -"$2"' watchdog "$4" "$pid" "$W/timedout" 3>&-) &
        watchdog=$!
    fi
    wait "$pid"
    status=$?
    wait "$reader_out" "$reader_err"
    [ -n "$watchdog" ] && kill -KILL -"$watchdog" 2>/dev/null
    kill -KILL -"$hangup" 2>/dev/null
    timedout=0
    [ -e "$W/timedout" ] || [ -e "$W/hungup" ] && [ "$status" -ge 128 ] && timedout=1
    truncated=0
    [ -e "$W/out.over" ] || [ -e "$W/err.over" ] && truncated=1
    printf 'VLA1 %s done %s %s %s %s %s\n' "$id" "$status" "$timedout" \
        "$(wc -c <"$W/out")" "$(wc -c <"$W/err")" "$truncated" >&3
    cat "$W/out" "$W/err" >&3
}

serve() {  # until the host side closes (a read ends) or a request goes wrong
    while IFS= read -r line <&3; do
        set -f
        # shellcheck disable=SC2086
        set -- $line
        set +f
        [ "$1" = VLA1 ] || continue
        case "$2" in
            hello) printf 'VLA1 %s ready 1 sh\n' "$3" >&3 ;;
            exec) run_exec "$3" "$4" "$5" "$6" "$7" || return 0 ;;
            *) printf 'VLA1 %s error unknown request %s\n' "$3" "$2" >&3 ;;
        esac
    done
}

W=/var/lib/vmlaunch-agent/work  # root's: no other user of the guest can plant anything there
mkdir -p -m 0700 /var/lib/vmlaunch-agent || exit 1
rm -rf "$W"
port=''
while :; do
    if [ -z "$port" ]; then
        port=$(find_port) || { sleep 1; continue; }
        exec 3<>"$port" || { port=''; sleep 1; continue; }
    fi
    # until a client opens the host side (a builtin's write, no process): then serve it until it closes
    printf '\n' >&3 || { exec 3>&-; port=''; sleep 1; continue; }
    serve
done
