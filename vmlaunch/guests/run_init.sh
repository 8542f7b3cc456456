#!/bin/busybox sh
# /init of vmlaunch's own initramfs (guests/initramfs.py builds it for `vmlaunch run --kernel`): a static
# busybox, vmlaunch's agent (/bin/vmlaunch-agent), the kernel's modules the boot needs (/lib/modules,
# loaded in the order /etc/vl-modules lists) and this script.
#
# Kernel command line keys (values hold no spaces):
#   vl.share=TAG:PATH[:ro]   mount the virtio-9p share TAG at PATH (made if missing); several allowed
#   vl.hostname=NAME         the guest's hostname (default: vmlaunch)
# Console lines: "vl: insmod NAME failed", "vl: share TAG at PATH" | "vl: share TAG: cannot mount at
# PATH", "vl: IF dhcp ADDR" | "vl: IF no dhcp lease", "vl: agent started", then "VMLAUNCH-GUEST-READY".
# Each ethN is configured by DHCP (QEMU's user network answers at once); a NIC no server answers on
# holds the boot for at most about 2 s, and its client keeps trying in the background.

/bin/busybox --install -s /bin
export PATH=/bin HOME=/root

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run

# --- kernel command line
SHARES=''
HOST=vmlaunch
set -f
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        vl.share=*) SHARES="$SHARES ${arg#vl.share=}" ;;
        vl.hostname=?*) HOST=${arg#vl.hostname=} ;;
    esac
done
hostname "$HOST"

# --- modules, in the order the builder wrote (dependencies first)
while read -r mod; do
    [ -n "$mod" ] || continue
    insmod "/lib/modules/$mod.ko" || echo "vl: insmod $mod failed"
done </etc/vl-modules

# --- shares: 9p over virtio; cache=mmap reads through to the host as cache=none does (a file the host
# changes is seen at once) and lets programs map files shared
for share in $SHARES; do
    tag=${share%%:*}
    rest=${share#*:}
    where=${rest%%:*}
    opts=trans=virtio,version=9p2000.L,msize=512000,cache=mmap
    [ "${rest#*:}" = ro ] && [ "$rest" != "$where" ] && opts=$opts,ro
    if [ -z "$tag" ] || [ -z "$where" ] || [ "$share" = "$tag" ]; then
        echo "vl: share $share: not TAG:PATH[:ro]"
    elif mkdir -p "$where" && mount -t 9p -o "$opts" "$tag" "$where"; then
        echo "vl: share $tag at $where"
    else
        echo "vl: share $tag: cannot mount at $where"
    fi
done
set +f

# --- network: lo, and DHCP on each ethN (all at once)
mkdir -p /etc/udhcpc
cat >/etc/udhcpc/script <<'EOF'
#!/bin/sh
case "$1" in
    deconfig) ip addr flush dev "$interface"; ip link set "$interface" up ;;
    bound|renew)
        ip addr flush dev "$interface"
        ip addr add "$ip/${mask:-24}" dev "$interface"
        for gw in $router; do ip route add default via "$gw" dev "$interface" && break; done
        : >/etc/resolv.conf
        for server in $dns; do echo "nameserver $server" >>/etc/resolv.conf; done
        echo "vl: $interface dhcp $ip/${mask:-24}" >/dev/console ;;
esac
EOF
chmod 755 /etc/udhcpc/script
ip link set lo up
for dev in /sys/class/net/eth*; do
    [ -e "$dev" ] || continue
    ifc=${dev##*/}
    ip link set "$ifc" up
    (udhcpc -i "$ifc" -s /etc/udhcpc/script -t 2 -T 1 -b -S >/dev/null 2>&1 \
        || echo "vl: $ifc no dhcp lease") &
done
wait

# --- the command channel: vmlaunch's agent, restarted if it ever ends
for port in /sys/class/virtio-ports/*; do
    if [ "$(cat "$port/name" 2>/dev/null)" = org.vmlaunch.agent.0 ]; then
        setsid sh -c 'while :; do sh /bin/vmlaunch-agent; sleep 1; done' </dev/null >/dev/null 2>&1 &
        echo "vl: agent started"
        break
    fi
done

# --- ready; then a console shell forever (init must never exit)
printf '\nVMLAUNCH-GUEST-READY\n'
while :; do
    setsid cttyhack sh
    sleep 1
done
