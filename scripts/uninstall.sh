#!/usr/bin/env bash
# Removes what install.sh installed: units (stopped and disabled), binaries, mount helper,
# man pages, completions, the PAM profile (disabled first). Stores, device keys (/var/lib/keybagfs), /etc/keybagfs and the
# device-key drop-ins of instances stay.
set -euo pipefail
PREFIX=${PREFIX:-/usr/local}
[[ $(id -u) -eq 0 ]] || { echo "uninstall.sh: run as root" >&2; exit 1; }
if [[ -d /run/systemd/system ]]; then
  for u in $(systemctl list-units --all --plain --no-legend 'keybagfs-follow@*' 'keybagfs@*' | awk '{print $1}'); do
    systemctl disable --now "$u" || true
  done
fi
# The PAM profile: out of common-auth first (pam-auth-update rewrites it), then removed.
if [[ -f /usr/share/pam-configs/keybagfs ]]; then
  if command -v pam-auth-update >/dev/null; then DEBIAN_FRONTEND=noninteractive pam-auth-update --disable keybagfs || true; fi
  rm -f /usr/share/pam-configs/keybagfs
fi
rm -f /etc/systemd/system/keybagfs@.service /etc/systemd/system/keybagfs-follow@.service \
  "$PREFIX/bin/keybagfs" "$PREFIX/bin/keybagctl" /sbin/mount.fuse.keybagfs \
  "$PREFIX"/share/man/man1/keybagfs*.1 "$PREFIX"/share/man/man1/keybagctl*.1 \
  "$PREFIX/share/bash-completion/completions/keybagfs" "$PREFIX/share/bash-completion/completions/keybagctl" \
  "$PREFIX/share/zsh/site-functions/_keybagfs" "$PREFIX/share/zsh/site-functions/_keybagctl" \
  "$PREFIX/share/fish/vendor_completions.d/keybagfs.fish" "$PREFIX/share/fish/vendor_completions.d/keybagctl.fish"
if [[ -d /run/systemd/system ]]; then systemctl daemon-reload; fi
echo "keybagfs removed; stores, /var/lib/keybagfs and /etc/keybagfs were kept" >&2
