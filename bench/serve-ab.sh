#!/usr/bin/env bash
# Two configurations of `strata serve` against each other, on Strata alone: for a change that
# a flag switches, the flag's two values in one run. Each run starts a fresh daemon, fills
# SIZE sequentially (1 MiB writes), then ROUNDS rounds of 4 KiB random writes at QD32 and at
# QD1 (fio's nbd engine, RUNTIME s after RAMP s each). Runs alternate A, B, A, B, ... PAIRS
# times, so drift of the machine hits both alike. Printed: QD32 IOPS / QD1 p99 per round and
# run; then per round, the mean QD32 IOPS and median QD1 p99 of A and of B, and B/A.
# Later rounds meet a fuller log, with more for the destager to do.
#
# Settings (environment):
#   A_ARGS=""   B_ARGS="--durable-write dsync"   flags for `strata serve` in runs A and B
#   A_BIN=  B_BIN=   another `strata` binary for run A or B (default: this tree's build), to
#                    compare two builds
#   PAIRS=3  ROUNDS=3  RUNTIME=6  RAMP=2  SIZE=512M
#   DIR=target/bench-serve-ab   scratch directory (pick the medium to test)
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
A_ARGS=${A_ARGS:-}
B_ARGS=${B_ARGS:---durable-write dsync}
A_BIN=${A_BIN:-}
B_BIN=${B_BIN:-}
PAIRS=${PAIRS:-3}
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-6}
RAMP=${RAMP:-2}
SIZE=${SIZE:-512M}
DIR=${DIR:-target/bench-serve-ab}

command -v fio >/dev/null || { echo "serve-ab: fio is needed (apt-get install fio)" >&2; exit 1; }
fio --enghelp=nbd >/dev/null 2>&1 || { echo "serve-ab: this fio has no nbd engine" >&2; exit 1; }
build
mkdir -p "$DIR"
machine "$DIR"
echo "A: ${A_BIN:-$STRATA} serve ${A_ARGS:-(defaults)}"
echo "B: ${B_BIN:-$STRATA} serve ${B_ARGS:-(defaults)}"
echo "$PAIRS pairs of runs; each: fill $SIZE, then $ROUNDS rounds of QD32 and QD1 4 KiB random writes, ${RUNTIME}s (+${RAMP}s ramp)"

# fio_run NAME IODEPTH: one timed random-write run on $NBD; prints "IOPS P99_US".
fio_run() {
    fio --name="$1" --ioengine=nbd --uri="$NBD/vol0" --size="$SIZE" --bs=4k --rw=randwrite \
        --norandommap --randrepeat=0 --iodepth="$2" --time_based --runtime="$RUNTIME" \
        --ramp_time="$RAMP" --output-format=json --output="$DIR/$1.json" >/dev/null
    python3 - "$DIR/$1.json" <<'EOF'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
if job["error"]:
    sys.exit(f"fio error {job['error']} in {sys.argv[1]}")
w = job["write"]
print("%.0f %.0f" % (w["iops"], w["clat_ns"]["percentile"]["99.000000"] / 1000))
EOF
}

RESULTS="$DIR/results.txt"
: >"$RESULTS"
for pair in $(seq "$PAIRS"); do
    for side in A B; do
        args=$A_ARGS bin=${A_BIN:-$STRATA}
        [[ $side == B ]] && args=$B_ARGS bin=${B_BIN:-$STRATA}
        # shellcheck disable=SC2086 # the flags are a word list on purpose
        STRATA=$bin start_strata "$DIR/run" $args
        fio --name=fill --ioengine=nbd --uri="$NBD/vol0" --size="$SIZE" --rw=write --bs=1M \
            --iodepth=8 --output-format=terse >/dev/null
        line="$side run $pair:"
        for round in $(seq "$ROUNDS"); do
            # Substitutions, not `< <(...)`: under set -e a failed fio or parse stops the run.
            qd32=$(fio_run qd32 32)
            qd1=$(fio_run qd1 1)
            read -r iops32 _ <<<"$qd32"
            read -r _ p99 <<<"$qd1"
            echo "$side $round $iops32 $p99" >>"$RESULTS"
            line="$line  $iops32 / ${p99} us"
        done
        stop_pid "$STRATA_PID"
        echo "$line"
    done
done
rm -rf "$DIR/run"

python3 - "$RESULTS" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print("\nround  QD32 IOPS A / B (B/A)        QD1 p99 us A / B (B/A)")
for r in sorted({row[1] for row in rows}, key=int):
    get = lambda side, i: [float(x[i]) for x in rows if x[0] == side and x[1] == r]
    a32, b32 = statistics.mean(get("A", 2)), statistics.mean(get("B", 2))
    a99, b99 = statistics.median(get("A", 3)), statistics.median(get("B", 3))
    print("%5s  %8.0f / %8.0f (%.2f)   %8.0f / %8.0f (%.2f)" % (r, a32, b32, b32 / a32, a99, b99, b99 / a99))
print("QD32: mean over runs; QD1 p99: median over runs. B/A > 1 favours B for IOPS, A for p99.")
EOF
