#!/usr/bin/env bash
# Issue 6b: two fast tiers, one that keeps its bandwidth under mixed reads and writes
# (Optane-like, `optane-b`) and one that loses it (NAND-like, `nand-a`), each in front of the
# same capacity file: prep time, the 70/30 32 KiB ramp-up curve, its shape near the maximum,
# and the destage rate; ratios printed. Both fast devices are files slowed down by the device
# layer's model (`--fast-emulate`, see docs/BENCH.md): the same one-way bandwidth, and for
# nand-a the 50/50 penalty of CONTEXT.md §2 (772 vs 1,984 MB/s), scaled by SCALE.
# The two sides run one after the other (an idle daemon would destage between the other's steps).
#   DIR=path OUT=path   device files (default target/bench-nand) and reports
#   SCALE=x             scale of the device models (default 0.05: 99 MB/s one-way)
#   VOL_MIB=n FAST=size volume size in MiB (default 2048) and fast tier size (default 512M)
#   STEP=dur WARMUP=dur QD=n CONNS=n
#   MAX_STEP=dur        measured length of the max step (default 60s): long enough that what
#                       the log absorbs (it starts the step as full as prep left it) does not
#                       inflate the maximum the rate steps are percentages of
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
DIR=${DIR:-target/bench-nand}
OUT=${OUT:-target/bench-out/nand-vs-optane}
SCALE=${SCALE:-0.05}
VOL_MIB=${VOL_MIB:-2048}
FAST=${FAST:-512M}
STEP=${STEP:-15s}
MAX_STEP=${MAX_STEP:-60s}
WARMUP=${WARMUP:-3s}
QD=${QD:-8}
CONNS=${CONNS:-4}
build
mkdir -p "$DIR" "$OUT"
machine "$DIR"
load=(--conns "$CONNS" --qd "$QD" --quiet)
for model in nand-a optane-b; do
    name=${model%-*}
    emu="$model,scale=$SCALE"
    echo "fast device model: $emu (device layer token bucket with the mixed-load penalty)"
    # All-flash, as in the source's comparison: the whole fast tier is write buffer. (`auto`
    # would give 70% of it to a read cache here, because this machine's one disk, which holds
    # the capacity file, says it is rotational.)
    start_strata "$DIR/$name" --fast-size "$FAST" --capacity-size 8G --default-volume-size "${VOL_MIB}M" \
        --fast-emulate "$emu" --read-cache 0
    "$STRATA" bench --target "$NBD/vol0" --profile prep "${load[@]}" --strata-api "$API" --label "$model" \
        --note "fast device emulated: $emu" --output "$OUT/$name-prep"
    "$STRATA" bench --target "$NBD/vol0" --mode curve --profile 70r-32k --duration "$STEP" --max-duration "$MAX_STEP" \
        --warmup "$WARMUP" "${load[@]}" --strata-api "$API" --label "$model" --note "fast device emulated: $emu" \
        --output "$OUT/$name-curve"
    stop_pid "$STRATA_PID"
done
python3 bench/lib/summarize.py nand "$OUT"
rm -rf "$DIR"
