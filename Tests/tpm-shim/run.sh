#!/usr/bin/env bash
# Builds Tests/tpm-shim/shim_test.c with Sources/CTPM and runs it against two swtpm instances
# of its own (loopback, fresh state dirs), RUNS times in a row (default 1).
# Needs: gcc, libtss2-dev, libssl-dev (the test's by-hand policy digest), swtpm, libtss2-tcti-swtpm0, tpm2-tools.
# usage: Tests/tpm-shim/run.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${1:-1}
BIN=${SHIM_TEST_BIN:-/tmp/shim_test}

gcc -Wall -Wextra -I Sources/CTPM/include Sources/CTPM/tpm.c Tests/tpm-shim/shim_test.c \
    -ltss2-esys -ltss2-tctildr -ltss2-mu -ltss2-rc -ltss2-sys -lcrypto -o "$BIN"

WORK=$(mktemp -d /tmp/tpm-shim.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

# Whether something accepts TCP connections on 127.0.0.1:$1.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Picks a base port with base..base+4 all free (two swtpm data+control pairs, one closed port),
# below the kernel's ephemeral range: the test's own client connections (and their TIME_WAIT
# leftovers) take ephemeral ports, which swtpm's bind would then find in use.
pick_ports() {
    local tries p i busy low span
    low=$(awk '{print $1}' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
    span=$(( (low - 10000) / 10 - 1 ))
    [ "$span" -ge 10 ] || span=1000
    for tries in $(seq 50); do
        p=$(( 10000 + (RANDOM % span) * 10 ))
        busy=0
        for i in 0 1 2 3 4; do listening $((p + i)) && { busy=1; break; }; done
        [ $busy = 0 ] && { echo "$p"; return 0; }
    done
    echo "no free ports" >&2
    return 1
}

# Starts swtpm with state dir $1 on data port $2 (control $2+1) in the background; sets LAST_PID.
start_swtpm() {
    mkdir -p "$1"
    swtpm socket --tpm2 --tpmstate dir="$1" \
        --server type=tcp,port="$2",bindaddr=127.0.0.1 \
        --ctrl type=tcp,port=$(($2 + 1)),bindaddr=127.0.0.1 \
        --flags startup-clear >"$1.log" 2>&1 &
    LAST_PID=$!
}

# Waits up to 5 s for port $1 to accept connections.
wait_port() {
    local i
    for i in $(seq 100); do listening "$1" && return 0; sleep 0.05; done
    echo "swtpm did not come up on port $1" >&2
    cat "$WORK"/*.log >&2 || true
    return 1
}

status=0
for run in $(seq "$RUNS"); do
    echo "=== run $run/$RUNS"
    start=$(date +%s%N)
    P=$(pick_ports)
    rm -rf "$WORK"/*
    start_swtpm "$WORK/tpm1" "$P"
    PIDS=("$LAST_PID")
    start_swtpm "$WORK/tpm2" $((P + 2))
    PIDS+=("$LAST_PID")
    PID2=$LAST_PID
    wait_port "$P"
    wait_port $((P + 2))
    if ! "$BIN" "$P" $((P + 2)) $((P + 4)) "$PID2"; then
        status=1
        echo "--- swtpm logs"; cat "$WORK"/*.log || true
    fi
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
    echo "=== run $run took $(( ($(date +%s%N) - start) / 1000000 )) ms"
    [ $status = 0 ] || break
done
exit $status
