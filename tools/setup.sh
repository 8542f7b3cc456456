#!/usr/bin/env bash
# Set up what vmlaunch needs on a Debian machine, idempotently: Debian's packages, the package in
# .venv, the test guest in examples/guest.
#
#   tools/setup.sh [--for test]   everything the tests need (make setup, make test, make lint, make docs)
#   tools/setup.sh --for demo     what the demo lab needs alone: QEMU (make demo)
#   tools/setup.sh --leftovers    what `make uninstall` leaves (packages, caches, logs, run files), and
#                                 how to remove each
#   tools/setup.sh --packages demo|test   the Debian packages and the package's extras it would install
#
# The Debian packages it installs are recorded in .setup-installed (those already there are not), so
# that --leftovers names exactly those.
set -euo pipefail
cd "$(dirname "$0")/.."
RECORD=.setup-installed

# As root the venv is for every user (`make install` links it into /usr/local/bin), so it is made
# from the system's Python, not from the first python3 on root's PATH, which may live under /root (a
# pyenv) where other users cannot run it. PYTHON=... names another.
if [ -z "${PYTHON:-}" ] && [ "$(id -u)" -eq 0 ] && [ -x /usr/bin/python3 ]; then
    PYTHON=/usr/bin/python3
fi
PYTHON=${PYTHON:-python3}
# For the demo: qemu-system-x86 + qemu-utils: QEMU and qemu-img; iproute2 (`ip`) and util-linux
# (`unshare`): the demo lab runs in a network namespace of its own, as the tests' labs do.
DEMO_PACKAGES=(qemu-system-x86 qemu-utils iproute2 util-linux)
# For the tests, also: ovmf: UEFI firmware (firmware = "uefi"); openssh-client: `ssh`
# and `ssh-keygen` (the lab's keys, `vmlaunch ssh`); zsh: the tests run the zsh completion script;
# ethtool: `vmlaunch doctor` reads a bridge uplink's offloads with it; fdisk (sfdisk) and e2fsprogs
# (mkfs.ext3): the doctor's tests partition images and make an ext3 file system in one;
# libvirt's daemon, QEMU driver and clients (virsh, virt-xml-validate), xmllint and iptables (which
# libvirt's networks run): the tests check `vmlaunch export --to libvirt` with them, in a private
# libvirtd (tools/private_libvirt.py). Installing them starts no daemon. zstd and lz4: the programs
# that decompress a kernel of those compressions for a fast boot under TCG (guests/kernels.py).
# nftables: `nft`, which `vmlaunch partition` cuts bridge networks with (the lab's own table).
# gpgv and debian-keyring: `image pull` checks the signature of Debian's checksum files with Debian's
# role keys (guests/catalog_images.py); gpg and gpg-agent: the tests sign a mirror's checksum files
# with a key of their own. graphviz: `dot`, which draws `vmlaunch graph --format svg|png` (and the
# manual's picture of the demo lab). libvirt-dev, pkg-config, gcc and python3-dev: pip builds
# libvirt's Python binding (libvirt-python, the `hosts` extra) against them, for labs on libvirt hosts;
# openssh-server: `sshd`, which each host of the tests' rig of libvirt hosts runs in its namespace
# (tools/libvirt_hosts.py; installing it starts no daemon where policy-rc.d forbids it, and the rig
# never uses the host's own). busybox-static: the static /bin/busybox that vmlaunch's own initramfs
# (`vmlaunch run --kernel` without --initrd, guests/initramfs.py) is made of.
TEST_PACKAGES=("${DEMO_PACKAGES[@]}" ovmf openssh-client zsh ethtool fdisk e2fsprogs
               libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients libxml2-utils iptables zstd lz4
               nftables gpgv gpg gpg-agent debian-keyring graphviz libvirt-dev pkg-config gcc python3-dev
               openssh-server busybox-static)
# the package's extras: the demo needs none; the tests need test (pytest, ...) and hosts (libvirt's
# Python binding, built with gcc and libvirt-dev)
DEMO_EXTRAS=
TEST_EXTRAS='[test,hosts]'

# What `make uninstall` (tools/install.sh --uninstall) leaves, and how to remove each.
leftovers() {
    local say="uninstall: left in place:"
    echo "$say"
    if [ -s "$RECORD" ]; then
        echo "uninstall:   Debian packages make setup installed: $(tr '\n' ' ' <"$RECORD")"
        echo "uninstall:     apt-get remove $(tr '\n' ' ' <"$RECORD")&& apt-get autoremove"
    else
        echo "uninstall:   Debian packages: no record of any that make setup installed ($RECORD); it" \
             "installs these when missing: ${TEST_PACKAGES[*]}; apt-get remove those nothing else uses"
    fi
    echo "uninstall:   the package's venv and the test guest, in this checkout: make clean"
    if [ -x .venv/bin/python ]; then
        .venv/bin/python - <<'PY'
from vmlaunch.layout.dirs import cache_dir, log_root, run_root

print(f"uninstall:   caches (images, kernels, downloads): {cache_dir()}: rm -rf {cache_dir()}")
print(f"uninstall:   the logs of each VM's last run: {log_root()}: rm -rf {log_root()}")
print(f"uninstall:   run files of labs still up: {run_root()}: `vmlaunch ls`, then `vmlaunch down SPEC` "
      "for each (never rm: down also takes back bridges, taps and host settings)")
PY
    else
        echo "uninstall:   caches: ~/.cache/vmlaunch (VMLAUNCH_CACHE_DIR): rm -rf it"
        echo "uninstall:   logs: /var/log/vmlaunch as root, else ~/.local/state/vmlaunch/logs: rm -rf it"
        echo "uninstall:   run files of labs still up: /run/vmlaunch as root: vmlaunch down SPEC for each"
    fi
    if [ -e examples/debian ]; then
        echo "uninstall:   the Debian image tools/build_debian.py built: rm -rf examples/debian"
    fi
}

purpose=test
case ${1-} in
    --for)
        purpose=${2-}
        case $purpose in demo|test) ;; *) echo "usage: $0 [--for demo|test | --leftovers | --packages demo|test]" >&2; exit 64 ;; esac
        ;;
    --leftovers)
        leftovers
        exit 0
        ;;
    --packages)
        case ${2-} in
            demo) echo "debian: ${DEMO_PACKAGES[*]}"; echo "extras: $DEMO_EXTRAS" ;;
            test) echo "debian: ${TEST_PACKAGES[*]}"; echo "extras: $TEST_EXTRAS" ;;
            *) echo "usage: $0 --packages demo|test" >&2; exit 64 ;;
        esac
        exit 0
        ;;
    '') ;;
    *)
        echo "usage: $0 [--for demo|test | --leftovers | --packages demo|test]" >&2
        exit 64
        ;;
esac
if [ "$purpose" = demo ]; then
    DEB_PACKAGES=("${DEMO_PACKAGES[@]}")
    extras=$DEMO_EXTRAS
else
    DEB_PACKAGES=("${TEST_PACKAGES[@]}")
    extras=$TEST_EXTRAS
fi
# Debian's own Python makes a venv only with python3-venv (ensurepip).
if [ ! -x .venv/bin/python ]; then
    case $(readlink -f "$(command -v "$PYTHON" || echo "$PYTHON")") in
        /usr/bin/*) DEB_PACKAGES+=(python3-venv) ;;
    esac
fi

missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: these Debian packages are missing: ${missing[*]}" >&2
        echo "setup: install them as root: apt-get update && apt-get install ${missing[*]}" >&2
        exit 3
    fi
    echo "setup: installing (for the $purpose) ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    printf '%s\n' "${missing[@]}" >>"$RECORD"
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# .installed: the package with the tests' extras (all the demo needs too); .installed-demo: alone
stamp=.venv/.installed
if [ "$purpose" = demo ] && { [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; }; then
    stamp=.venv/.installed-demo
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # compat: a plain path in a .pth, not an import hook that costs ~20 ms at every start-up
    .venv/bin/python -m pip install -q -e ".$extras" --config-settings editable_mode=compat
    touch "$stamp"
fi

.venv/bin/python tools/build_guest.py
tools/install.sh || echo "setup: vmlaunch is not on PATH (see above); .venv/bin/vmlaunch works all the same" >&2
