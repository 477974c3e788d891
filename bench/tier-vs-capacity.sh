#!/usr/bin/env bash
# Issue 6a: a fast tier in front of a slowed-down capacity device versus that capacity device
# alone: prep time and the 70/30 32 KiB ramp-up curve, measured in one run, ratios printed.
#
# Strata: fast tier = a plain file (this machine's disk), capacity tier = a file slowed down by
# the device layer's model (`--capacity-emulate $CAP_EMU`). Capacity alone: the same file model
# behind the same NBD server code (crates/strata-bench/examples/raw_nbd.rs), no tier.
# The two sides run one after the other, not interleaved: an idle daemon destages between steps,
# which would change the fill dynamics the curve is about.
#   DIR=path        device files (default target/bench-tier)
#   OUT=path        reports (default target/bench-out/tier-vs-capacity)
#   CAP_EMU=spec    capacity device model (default bw=50MB,iops=500)
#   VOL_MIB=n       volume / device size in MiB (default 2048); FAST=size fast tier (default 1G)
#   STEP=dur WARMUP=dur QD=n CONNS=n   curve step length, warm-up, queue depth, connections
#   WS=pct          working set of the curve, percent of the volume (default 100)
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
DIR=${DIR:-target/bench-tier}
OUT=${OUT:-target/bench-out/tier-vs-capacity}
CAP_EMU=${CAP_EMU:-bw=50MB,iops=500}
VOL_MIB=${VOL_MIB:-2048}
FAST=${FAST:-1G}
STEP=${STEP:-15s}
WARMUP=${WARMUP:-3s}
QD=${QD:-8}
CONNS=${CONNS:-4}
WS=${WS:-100}
build
mkdir -p "$DIR" "$OUT"
machine "$DIR"
echo "capacity device model: $CAP_EMU (device layer token bucket, strata-device Throttled)"
load=(--conns "$CONNS" --qd "$QD" --quiet)
curve=(--mode curve --profile 70r-32k --duration "$STEP" --warmup "$WARMUP" --working-set-pct "$WS")

start_strata "$DIR/tier" --fast-size "$FAST" --capacity-size 8G --default-volume-size "${VOL_MIB}M" \
    --capacity-emulate "$CAP_EMU"
"$STRATA" bench --target "$NBD/vol0" --profile prep "${load[@]}" --strata-api "$API" \
    --label strata --note "capacity device emulated: $CAP_EMU" --output "$OUT/strata-prep"
"$STRATA" bench --target "$NBD/vol0" "${curve[@]}" "${load[@]}" --strata-api "$API" \
    --label strata --note "capacity device emulated: $CAP_EMU" --output "$OUT/strata-curve"
stop_pid "$STRATA_PID"

start_raw "$DIR/raw" "$VOL_MIB" "$CAP_EMU"
"$STRATA" bench --target "$RAW_URI" --profile prep "${load[@]}" --no-strata-api --label capacity-alone \
    --note "capacity device emulated: $CAP_EMU, no tier (raw_nbd)" --output "$OUT/raw-prep"
"$STRATA" bench --target "$RAW_URI" "${curve[@]}" "${load[@]}" --no-strata-api --label capacity-alone \
    --note "capacity device emulated: $CAP_EMU, no tier (raw_nbd)" --output "$OUT/raw-curve"
stop_pid "$RAW_PID"

python3 bench/lib/summarize.py tier "$OUT"
rm -rf "$DIR"
