#!/usr/bin/env bash
# Benchmark harness entry: installs what is missing from Debian's packages, builds the release
# binaries when they are missing or older than the sources, then runs scripts/bench/bench.py:
# plain folder, passthrough_hp (with PASSTHROUGH_HP), gocryptfs and keybagfs side by side,
# rounds interleaved, canonical and application workloads. docs/BENCHMARKS.md explains it.
#
#   scripts/bench.sh                                        # 5 rounds, medium tree, everything
#   PASSTHROUGH_HP=/opt/libfuse-3.14/build/example/passthrough_hp scripts/bench.sh --csv /tmp/b.csv
#   scripts/bench.sh --tree quick --rounds 1 --workloads canonical        # smoke run
#   scripts/bench.sh --rounds 1 --workloads apps --quick-apps            # smoke run of the apps
#   scripts/bench.sh --help                                              # every option
#
# BUILD=0 uses .build/release as it is. Lock latency and daemon RSS with many open files: scripts/bench/lock-latency.sh.
# Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $(id -u) == 0 ]] || { echo "scripts/bench.sh needs root (FUSE mounts, dropping caches, PostgreSQL)" >&2; exit 1; }

# Debian package -> a file it provides (checked before anything is installed)
declare -A PROBE=(
  [gocryptfs]=/usr/bin/gocryptfs [fio]=/usr/bin/fio [linux-source-6.1]=/usr/src/linux-source-6.1.tar.xz
  [postgresql-15]=/usr/lib/postgresql/15/bin/postgres
  [sqlite3]=/usr/bin/sqlite3 [git]=/usr/bin/git [make]=/usr/bin/make [gcc]=/usr/bin/gcc [bc]=/usr/bin/bc
  [flex]=/usr/bin/flex [bison]=/usr/bin/bison [libelf-dev]=/usr/include/libelf.h
  [libssl-dev]=/usr/include/openssl/ssl.h [fuse3]=/usr/bin/fusermount3 [xz-utils]=/usr/bin/xz
  [python3]=/usr/bin/python3 [binutils]=/usr/bin/objcopy [libc6-dev]=/usr/include/stdio.h
)
missing=()
for pkg in "${!PROBE[@]}"; do [[ -e ${PROBE[$pkg]} ]] || missing+=("$pkg"); done
if ((${#missing[@]})); then
  echo "# installing from Debian: ${missing[*]}" >&2
  apt-get update -qq >/dev/null
  # (postgresql-15 creates Debian's "main" cluster; the harness leaves it alone and runs its own
  # on a private socket)
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# keybagfs from this checkout unless --keybagfs DIR names other binaries (BUILD=0: never build)
if [[ " $* " != *" --keybagfs "* && ${BUILD:-1} != 0 ]]; then
  bin=.build/release
  if [[ ! -x $bin/keybagfs || ! -x $bin/keybagctl ]] ||
    [[ -n $(find Sources Package.swift -newer "$bin/keybagfs" -print -quit) ]]; then
    echo "# building keybagfs and keybagctl (release)" >&2
    swift build -c release --product keybagfs
    swift build -c release --product keybagctl
  fi
fi

exec python3 scripts/bench/bench.py "$@"
