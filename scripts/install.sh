#!/usr/bin/env bash
# Installs keybagfs: release binaries in $PREFIX/bin (default /usr/local), the mount helper
# for `mount -t fuse.keybagfs` and fstab, systemd units, man pages, shell completions and a
# pam-auth-update profile (off until `pam-auth-update --enable keybagfs`).
# With --demo it also creates and starts a demo mount under /srv/keybagfs (the passcode is
# asked on the terminal, or read as one line from stdin), with the logind follower when
# logind runs. Stores are never touched by install or uninstall.
#   bash scripts/install.sh [--demo] [--no-build]
# DESTDIR stages the files elsewhere (packaging, tests); KEYBAGFS_BIN names a folder of
# already built binaries (then nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
demo=0 build=1
for a in "$@"; do
  case $a in
    --demo) demo=1 ;;
    --no-build) build=0 ;;
    *) echo "usage: install.sh [--demo] [--no-build]" >&2; exit 2 ;;
  esac
done
[[ -n $DESTDIR || $(id -u) -eq 0 ]] || { echo "install.sh: run as root (or set DESTDIR)" >&2; exit 1; }

bin=${KEYBAGFS_BIN:-}
man=${KEYBAGFS_MAN:-}
if [[ -z $bin ]]; then
  bash scripts/install-deps.sh
  bin=$(swift build -c release --show-bin-path)
  if ((build)); then
    # Man pages from the argument parser's own help, one per command and subcommand. The
    # plugin builds the tools itself (with a shared Swift runtime), so it goes first.
    man=$(mktemp -d)
    swift package plugin --allow-writing-to-package-directory generate-manual --multi-page --output-directory "$man" >/dev/null 2>&1 ||
      echo "install.sh: man pages not generated" >&2
    # A static Swift runtime: the binaries need only libc, libfuse3, libsodium and libsystemd.
    rm -f "$bin/keybagfs" "$bin/keybagctl"
    swift build -c release --static-swift-stdlib --product keybagfs >&2
    swift build -c release --static-swift-stdlib --product keybagctl >&2
  fi
fi
for b in keybagfs keybagctl; do [[ -x $bin/$b ]] || { echo "install.sh: $bin/$b is missing (build first)" >&2; exit 1; }; done

root=$DESTDIR
install -d "$root$PREFIX/bin" "$root$PREFIX/share/man/man1" "$root/etc/systemd/system" "$root/etc/keybagfs" \
  "$root/var/lib/keybagfs" "$root/sbin" "$root$PREFIX/share/bash-completion/completions" \
  "$root$PREFIX/share/zsh/site-functions" "$root$PREFIX/share/fish/vendor_completions.d" "$root/usr/share/pam-configs"
chmod 0700 "$root/var/lib/keybagfs"
install -m 0755 "$bin/keybagfs" "$bin/keybagctl" "$root$PREFIX/bin/"
# mount(8) runs /sbin/mount.fuse.keybagfs for `-t fuse.keybagfs` (fstab); fuse3's
# mount.fuse3 then runs `keybagfs STORE DIR -o OPTIONS`.
ln -sf "$(command -v mount.fuse3 || echo /sbin/mount.fuse3)" "$root/sbin/mount.fuse.keybagfs"
for unit in systemd/*.service; do
  sed "s|/usr/local/bin/|$PREFIX/bin/|g" "$unit" > "$root/etc/systemd/system/$(basename "$unit")"
  chmod 0644 "$root/etc/systemd/system/$(basename "$unit")"
done
if [[ -n $man && -d $man ]]; then cp "$man"/*.1 "$root$PREFIX/share/man/man1/"; fi
# Unlock at login: a profile for Debian's pam-auth-update (pam-auth-update only reads
# /usr/share/pam-configs), so common-auth stays generated and other profiles keep working.
sed "s|/usr/local/bin/|$PREFIX/bin/|g" pam/keybagfs.pam-config > "$root/usr/share/pam-configs/keybagfs"
chmod 0644 "$root/usr/share/pam-configs/keybagfs"
for t in keybagfs keybagctl; do
  "$bin/$t" --generate-completion-script bash > "$root$PREFIX/share/bash-completion/completions/$t"
  "$bin/$t" --generate-completion-script zsh > "$root$PREFIX/share/zsh/site-functions/_$t"
  "$bin/$t" --generate-completion-script fish > "$root$PREFIX/share/fish/vendor_completions.d/$t.fish"
done
echo "installed keybagfs and keybagctl in $root$PREFIX/bin, units in $root/etc/systemd/system" >&2
[[ -z $DESTDIR ]] || exit 0

if [[ -d /run/systemd/system ]]; then systemctl daemon-reload; fi
((demo)) || exit 0

# The demo: a store and a mount under /srv/keybagfs, run by systemd when it is PID 1.
mnt=/srv/keybagfs/demo store=/srv/keybagfs/demo.store
inst=$(systemd-escape --path "$mnt")
key=/var/lib/keybagfs/$inst.key
mkdir -p "$mnt"
# Under systemd (250 or newer) a new demo's device key is made on tmpfs, encrypted with
# `systemd-creds` (TPM2-bound where a TPM2 exists, else with the host's credential key) and
# handed to the unit as a credential; the plain key never touches the disk. Elsewhere it is
# the file /var/lib/keybagfs/<instance>.key. `systemd-creds decrypt --name=device-key
# FILE.cred -` gives it back for offline tools (keybagfs fsck, recover).
cred=/var/lib/keybagfs/$inst.cred
keytmp=""
if [[ ! -f $store/keybag ]]; then
  if [[ -d /run/systemd/system ]] && command -v systemd-creds >/dev/null; then
    keytmp=$(mktemp -d /run/keybagfs-key.XXXXXX)
    trap 'rm -rf "$keytmp"' EXIT
    key=$keytmp/device.key
  fi
  if [[ -t 0 ]]; then
    echo "Creating the demo store $store; choose a passcode:" >&2
    "$PREFIX/bin/keybagfs" init "$store" --device-key "$key" --kdf interactive
  else
    "$PREFIX/bin/keybagfs" init "$store" --device-key "$key" --kdf interactive --passcode-stdin
  fi
fi
if [[ -n $keytmp ]]; then
  if systemd-creds encrypt --name=device-key "$key" "$cred.new"; then
    mv "$cred.new" "$cred"
    mkdir -p "/etc/systemd/system/keybagfs@$inst.service.d"
    printf '[Service]\n# The device key, encrypted by systemd-creds (install.sh).\nLoadCredential=\nLoadCredentialEncrypted=device-key:%s\n' "$cred" \
      > "/etc/systemd/system/keybagfs@$inst.service.d/device-key.conf"
    systemctl daemon-reload
    if systemd-creds has-tpm2 -q 2>/dev/null; then
      echo "device key encrypted with systemd-creds, bound to this machine's TPM2: $cred" >&2
    else
      echo "device key encrypted with systemd-creds using the host key /var/lib/systemd/credential.secret (no TPM2 here: it lives on the same disk): $cred" >&2
    fi
  else
    echo "install.sh: systemd-creds could not encrypt the device key; keeping it as the plain file /var/lib/keybagfs/$inst.key" >&2
    install -m 0600 "$key" "/var/lib/keybagfs/$inst.key"
  fi
  rm -rf "$keytmp"
fi
[[ -f /etc/keybagfs/$inst.conf ]] || printf 'STORE=%s\nKEYBAGFS_OPTIONS=--grace 5 --inactivity-relock 72\n' "$store" > "/etc/keybagfs/$inst.conf"
if [[ -d /run/systemd/system ]]; then
  systemctl enable --now "keybagfs@$inst.service"
  if systemctl is-active -q systemd-logind.service; then systemctl enable --now "keybagfs-follow@$inst.service"; fi
else
  mountpoint -q "$mnt" || "$PREFIX/bin/keybagfs" mount "$store" "$mnt" --device-key "$key" --grace 5
  echo "no systemd here: mounted without a unit and without the logind follower" >&2
fi
cat <<TXT
keybagfs is mounted on $mnt (state: beforeFirstUnlock).
  keybagctl status                  # state and open files
  keybagctl unlock                  # asks for the passcode
  echo hi > $mnt/note.txt; setfattr -n user.protection -v complete $mnt/note.txt
  keybagctl lock --grace 0          # now: cat $mnt/note.txt -> Permission denied
  loginctl lock-session             # with the follower: locks the mount too
TXT
