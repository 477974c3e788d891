#!/usr/bin/env bash
# How much of the capacity tier a sequential write can fill: one node with a 64 MiB fast tier
# and one 1 GiB capacity file (127 segments of 8 MiB, 9 of them kept back for GC and the
# index), a 2 GiB volume written from its start in 2 MiB requests (one connection, one
# request in flight, random data) until a write is refused with ENOSPC.
# Printed: the bytes accepted (those in the write log included), and the capacity tier's live
# data against the bytes of its segments in use (the fill of the segments destage wrote); with
# STRATA_BASE, the same for a second binary first, and the ratio of the bytes accepted (until
# the fortieth session a stripe took whole batches only: 866 MiB accepted, segments 0.87 full;
# since, 966 MiB, 0.98, which is every data block of a segment: docs/BENCHMARKS.md). Then the
# volume is read back after a SIGKILL restart and compared with what was written.
#   DIR=path            scratch files (default target/bench-capacity-fill)
#   STRATA_BIN=path     a strata binary to run instead of building this checkout's
#   STRATA_BASE=path    a second binary measured the same way, before this one
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
DIR=${DIR:-target/bench-capacity-fill}
command -v nbdcopy >/dev/null || { echo "capacity-fill.sh needs nbdcopy (apt-get install libnbd-bin)" >&2; exit 1; }
strata_binary
NEW=$STRATA
if [[ -n "${STRATA_BASE:-}" ]]; then
    [[ -x "$STRATA_BASE" ]] || { echo "STRATA_BASE=$STRATA_BASE is not an executable" >&2; exit 1; }
fi
mkdir -p "$DIR"
SCRATCH+=("$DIR/source.bin")
machine "$DIR"
head -c 1400M /dev/urandom >"$DIR/source.bin"

# fill NAME BIN: prints NAME's figures; leaves the accepted byte count in ACCEPTED.
fill() {
    local name=$1 bin=$2 err
    STRATA=$bin
    start_strata "$DIR/$name" --fast-size 64M --capacity-size 1G --segment-size 8M \
        --default-volume-size 2G --scrub-interval off
    if err=$(nbdcopy --connections=1 --requests=1 --request-size=2097152 "$DIR/source.bin" \
        "$NBD/vol0" 2>&1); then
        echo "$name: the whole source was accepted: nothing measured" >&2
        exit 1
    fi
    ACCEPTED=$(sed -n 's/.*write at offset \([0-9]*\) failed: No space left on device.*/\1/p' <<<"$err")
    [[ -n "$ACCEPTED" ]] || { echo "$name: nbdcopy failed otherwise: $err" >&2; exit 1; }
    curl -sf "$API/metrics" >"$DIR/$name/metrics.txt"
    python3 - "$name" "$ACCEPTED" "$DIR/$name/metrics.txt" <<'EOF'
import re, sys
name, accepted, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
m = {}
for line in open(path):
    f = re.match(r"^(strata_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
    if f and f.group(1) not in m:
        m[f.group(1)] = float(f.group(3))
mib = lambda b: b / 2**20
used, live = m["strata_capacity_used_bytes"], m["strata_capacity_live_bytes"]
print(f"{name}: accepted {mib(accepted):.0f} MiB before ENOSPC; capacity tier: {mib(live):.1f} "
      f"MiB of live data in {mib(used):.1f} MiB of segments in use ({live / used:.2f}), "
      f"{m['strata_capacity_segments_free']:.0f} segments free")
EOF
    kill -KILL "$STRATA_PID"
    wait "$STRATA_PID" 2>/dev/null || true
    "$STRATA" serve --data-dir "$DIR/$name/data" --nbd-listen 127.0.0.1:0 \
        --http-listen 127.0.0.1:0 --scrub-interval off >"$DIR/$name/stdout" 2>"$DIR/$name/stderr" &
    STARTED_PIDS+=($!)
    STRATA_PID=$!
    wait_line "$DIR/$name/stdout" "strata: ready" "$STRATA_PID"
    NBD=nbd://$(sed -n 's/^strata: NBD listening on //p' "$DIR/$name/stdout")
    # cmp stops reading at the count, which fails nbdcopy's write to the pipe: only cmp says.
    if cmp -n "$ACCEPTED" <(nbdcopy "$NBD/vol0" - 2>/dev/null) "$DIR/source.bin"; then
        echo "$name: the $ACCEPTED bytes accepted read back after a SIGKILL restart"
    else
        echo "$name: what was accepted does not read back" >&2
        exit 1
    fi
    kill -TERM "$STRATA_PID"
    wait "$STRATA_PID" 2>/dev/null || true
}

if [[ -n "${STRATA_BASE:-}" ]]; then
    fill base "$STRATA_BASE"
    BASE=$ACCEPTED
fi
fill new "$NEW"
if [[ -n "${BASE:-}" ]]; then
    python3 -c "import sys; print(f'accepted new / base: {int(sys.argv[1]) / int(sys.argv[2]):.2f}')" "$ACCEPTED" "$BASE"
fi
