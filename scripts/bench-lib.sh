# Shared by the benchmark scripts (sourced): kernel-tree tarballs and a scratch mount.

# kb_tree_tar OUT [PART...]: a tar of linux-source-6.1 (only the named top folders if given),
# decompressed once so that xz does not count in extract timings.
kb_tree_tar() {
  local out=$1 tmp; shift
  tmp=$(mktemp -d "$(dirname "$out")/tree.XXXXXX")
  xz -dc /usr/src/linux-source-6.1.tar.xz | tar -C "$tmp" -xf - "${@/#/linux-source-6.1/}"
  tar -C "$tmp" -cf "$out" linux-source-6.1 && rm -rf "$tmp"
}

# kb_scratch_mount DIR BIN: a new store DIR/s mounted on DIR/m (socket DIR/sock, grace 0,
# interactive KDF), unlocked; sets KB_PID to the daemon's pid. The caller unmounts DIR/m.
kb_scratch_mount() {
  local w=$1 bin=$2
  mkdir -p "$w/s" "$w/m"
  echo pw | "$bin/keybagfs" init "$w/s" --passcode-stdin --device-key "$w/dk" --kdf interactive >/dev/null
  "$bin/keybagfs" mount "$w/s" "$w/m" --device-key "$w/dk" --socket "$w/sock" --grace 0 >/dev/null
  echo pw | "$bin/keybagctl" --socket "$w/sock" unlock --passcode-stdin >/dev/null
  KB_PID=$("$bin/keybagctl" --socket "$w/sock" status --json | sed -E 's/.*"pid":([0-9]+).*/\1/')
}
