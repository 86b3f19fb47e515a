#!/usr/bin/env bash
# Builds the Debian package keybagfs_<version>_<arch>.deb with dpkg-deb, offline, from the
# release build with the static Swift runtime (no Swift toolchain needed where it installs).
#   scripts/build-deb.sh [OUTDIR]        (default dist/)
#   KEYBAGFS_BIN / KEYBAGFS_MAN: reuse release binaries / man pages (see install.sh).
# Layout: /usr/bin, units in /lib/systemd/system, /sbin/mount.fuse.keybagfs, man pages,
# completions, the pam-auth-update profile (off until enabled), README.Debian. Depends come
# from dpkg-shlibdeps on the binaries, plus fuse3 (fusermount3, mount.fuse3).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
command -v dpkg-deb >/dev/null && command -v dpkg-shlibdeps >/dev/null || { echo "build-deb.sh: needs dpkg-dev" >&2; exit 1; }
arch=$(dpkg --print-architecture)
version=${KEYBAGFS_VERSION:-0~git$(git log -1 --format=%cd --date=format:%Y%m%d 2>/dev/null || date +%Y%m%d).$(git rev-parse --short HEAD 2>/dev/null || echo local)}
work=$(mktemp -d /tmp/kbfs-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/root

# Files: install.sh into the staging root with PREFIX=/usr, then Debian's places.
DESTDIR=$root PREFIX=/usr bash scripts/install.sh >&2
install -d "$root/lib/systemd/system"
mv "$root"/etc/systemd/system/*.service "$root/lib/systemd/system/"
rmdir -p --ignore-fail-on-non-empty "$root/etc/systemd/system"
if [[ -d $root/usr/share/zsh/site-functions ]]; then
  install -d "$root/usr/share/zsh/vendor-completions"
  mv "$root"/usr/share/zsh/site-functions/* "$root/usr/share/zsh/vendor-completions/"
  rmdir "$root/usr/share/zsh/site-functions"
fi
install -d "$root/usr/share/man/man8"
cat >"$root/usr/share/man/man8/mount.fuse.keybagfs.8" <<'TXT'
.TH MOUNT.FUSE.KEYBAGFS 8 "" keybagfs "System Administration"
.SH NAME
mount.fuse.keybagfs \- mount helper for keybagfs stores
.SH SYNOPSIS
.B mount \-t fuse.keybagfs
.I STORE MOUNTPOINT
.B \-o
.I OPTIONS
.SH DESCRIPTION
A link to
.BR mount.fuse3 (8),
which runs
.B keybagfs
.I STORE MOUNTPOINT
.B \-o
.IR OPTIONS ,
so that keybagfs stores mount from
.BR fstab (5)
and
.BR mount (8).
Options are those of
.BR keybagfs\-mount (1),
for example device\-key=PATH.
TXT
gzip -9n "$root"/usr/share/man/man1/*.1 "$root"/usr/share/man/man8/*.8 2>/dev/null || true
strip --remove-section=.comment --remove-section=.note --strip-unneeded "$root/usr/bin/keybagfs" "$root/usr/bin/keybagctl"
doc=$root/usr/share/doc/keybagfs
install -d "$doc"
cat >"$doc/README.Debian" <<'TXT'
keybagfs for Debian
===================

iOS-style Data Protection for a directory: an encrypted FUSE file system whose files each
carry a protection class (user.protection), locked and unlocked with keybagctl.

First steps (as root):
  keybagfs init /srv/keybagfs/docs.store           # asks a passcode, prints a recovery key
  mkdir -p /srv/keybagfs/docs
  systemctl enable --now "keybagfs@$(systemd-escape --path /srv/keybagfs/docs)"
  keybagctl --mount /srv/keybagfs/docs unlock
  systemctl enable --now "keybagfs-follow@$(systemd-escape --path /srv/keybagfs/docs)"   # lock with the screen and suspend

The keybagfs@ unit mounts STORE = MOUNTPOINT + ".store"; its device key is
/var/lib/keybagfs/<store id>.key unless a credential or drop-in names another one.

Unlock at login: the package ships a pam-auth-update profile, off by default. Turn it on
with "pam-auth-update --enable keybagfs". It unlocks the mounts a user owns with their
login password when that is the mount's passcode.

Removing the package stops and disables the keybagfs units and takes the PAM profile out
of common-auth. It never deletes stores, device keys (/var/lib/keybagfs) or /etc/keybagfs,
not even on purge: without the device key a store cannot be opened.

The full documentation is the project's README and docs/ (COMMANDS.md: commands, classes, lock semantics;
FORMAT.md: on-disk format and key constructions).
TXT
cat >"$doc/copyright" <<'TXT'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: keybagfs
Comment: Built from the keybagfs source tree with scripts/build-deb.sh.
 The binaries link libfuse3, libsodium, OpenSSL's libcrypto and tpm2-tss dynamically and carry the
 Swift runtime statically (Apache-2.0 with Runtime Library Exception).

Files: *
Copyright: 2026 keybagfs developers
License: see the source tree
TXT
printf 'keybagfs (%s) unstable; urgency=medium\n\n  * Built from git %s.\n\n -- keybagfs developers <keybagfs@example.org>  %s\n' \
  "$version" "$(git rev-parse --short HEAD 2>/dev/null || echo local)" "$(date -R)" | gzip -9n >"$doc/changelog.gz"
# Completions are sourced, not run: no #! line.
sed -i '1{/^#!/d}' "$root"/usr/share/bash-completion/completions/*
# The device keys' folder is 0700 on purpose; units with instances are disabled in prerm.
install -d "$root/usr/share/lintian/overrides"
printf '%s\n' 'keybagfs: non-standard-dir-perm 0700 != 0755 [var/lib/keybagfs/]' \
  'keybagfs: maintainer-script-calls-systemctl [prerm:*]' >"$root/usr/share/lintian/overrides/keybagfs"

# Control files.
install -d "$root/DEBIAN"
shlibs=$(cd "$work" && mkdir -p debian && printf 'Source: keybagfs\n\nPackage: keybagfs\nArchitecture: any\n' >debian/control &&
  dpkg-shlibdeps -O -e"$root/usr/bin/keybagfs" -e"$root/usr/bin/keybagctl" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[[ -n $shlibs ]] || { echo "build-deb.sh: dpkg-shlibdeps found no dependencies" >&2; exit 1; }
cat >"$root/DEBIAN/control" <<TXT
Package: keybagfs
Version: $version
Architecture: $arch
Maintainer: keybagfs developers <keybagfs@example.org>
Depends: fuse3, libtss2-tcti-device0, $shlibs
Recommends: systemd, libpam-runtime
Section: admin
Priority: optional
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Description: iOS-style Data Protection classes for a directory (FUSE)
 keybagfs mounts an encrypted store with the four iOS protection classes:
 complete files are unreadable while the device is locked, even through
 descriptors opened before; completeUnlessOpen files keep working while open;
 the default class stays readable from the first unlock. keybagctl locks and
 unlocks; systemd units follow logind, the screen lock and suspend; a
 pam-auth-update profile unlocks at login.
TXT
cat >"$root/DEBIAN/postinst" <<'TXT'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  chmod 0700 /var/lib/keybagfs
  if command -v pam-auth-update >/dev/null 2>&1; then pam-auth-update --package || true; fi
  if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
fi
TXT
cat >"$root/DEBIAN/prerm" <<'TXT'
#!/bin/sh
set -e
if [ "$1" = remove ] || [ "$1" = deconfigure ]; then
  if [ -d /run/systemd/system ]; then
    for u in $(systemctl list-units --all --plain --no-legend 'keybagfs-follow@*' 'keybagfs@*' | awk '{print $1}'); do
      systemctl disable --now "$u" || true
    done
  fi
  if command -v pam-auth-update >/dev/null 2>&1; then pam-auth-update --package --remove keybagfs || true; fi
fi
TXT
cat >"$root/DEBIAN/postrm" <<'TXT'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
TXT
chmod 0755 "$root"/DEBIAN/postinst "$root"/DEBIAN/prerm "$root"/DEBIAN/postrm
mkdir -p "$out"
deb=$out/keybagfs_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >&2
echo "$deb"
