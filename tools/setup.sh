#!/usr/bin/env bash
# Set up everything vmlaunch and its tests need on a Debian machine, idempotently:
# QEMU and friends from Debian's packages, the package in .venv, the test guest in examples/guest.
set -euo pipefail
cd "$(dirname "$0")/.."

# As root the venv is for every user (`make install` links it into /usr/local/bin), so it is made
# from the system's Python, not from the first python3 on root's PATH, which may live under /root (a
# pyenv) where other users cannot run it. PYTHON=... names another.
if [ -z "${PYTHON:-}" ] && [ "$(id -u)" -eq 0 ] && [ -x /usr/bin/python3 ]; then
    PYTHON=/usr/bin/python3
fi
PYTHON=${PYTHON:-python3}
# qemu-system-x86 + qemu-utils: QEMU and qemu-img; iproute2: `ip`, used by the tests' network
# namespaces; util-linux: `unshare`; ovmf: UEFI firmware (firmware = "uefi"); openssh-client: `ssh`
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
# never uses the host's own).
DEB_PACKAGES=(qemu-system-x86 qemu-utils iproute2 util-linux ovmf openssh-client zsh ethtool fdisk e2fsprogs
              libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients libxml2-utils iptables zstd lz4
              nftables gpgv gpg gpg-agent debian-keyring graphviz libvirt-dev pkg-config gcc python3-dev
              openssh-server)
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
    echo "setup: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # compat: a plain path in a .pth, not an import hook that costs ~20 ms at every start-up
    .venv/bin/python -m pip install -q -e '.[test,hosts]' --config-settings editable_mode=compat
    touch "$stamp"
fi

.venv/bin/python tools/build_guest.py
tools/install.sh || echo "setup: vmlaunch is not on PATH (see above); .venv/bin/vmlaunch works all the same" >&2
