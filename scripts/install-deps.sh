#!/usr/bin/env bash
# Installs the system packages keybagfs builds and tests with (Debian 12), when missing.
set -euo pipefail
pkgs=(libfuse3-dev fuse3 acl btrfs-progs libsodium-dev libssl-dev gdb dpkg-dev lintian libsystemd-dev pkg-config attr python3 util-linux git rsync sqlite3 gcc libc6-dev stress-ng debootstrap systemd-container syncthing iproute2 libtss2-dev swtpm swtpm-tools libtss2-tcti-swtpm0 tpm2-tools qemu-system-x86 linux-image-amd64 busybox-static dmsetup e2fsprogs cpio)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "# installing: ${missing[*]}" >&2
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
