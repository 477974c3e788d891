#!/usr/bin/env bash
# A volume at its IOPS limit beside one without: the limit must cap one volume without slowing
# the others, admit the limited volume's waiting requests in order, and the daemon's latency
# figure for the limited volume must be what its client sees.
#   1. vol "free" alone: fio 4 KiB random reads at queue depth 1 for $RUNTIME s (the baseline).
#   2. vol "limited" (--iops-limit $LIMIT) read by $JOBS fio jobs at queue depth $QD (a
#      connection each), and meanwhile the same QD1 run on "free".
# Printed: free's IOPS alone and beside the limited volume, and their ratio (target: near 1;
# 0.00 before the thirty-seventh session's fix, 0.98 after it); the limited volume's IOPS
# against its limit, its mean and max latency as fio saw them, and the mean of the daemon's
# strata_volume_request_duration_seconds for it (target: within a few percent of fio's mean).
#   DIR=path OUT=path     scratch files and reports (default target/bench-limits, target/bench-out/limits)
#   LIMIT=n JOBS=n QD=n   the limit and the load on the limited volume (default 200, 3, 16)
#   RUNTIME=s             seconds of each measured run (default 8)
#   STRATA_BIN=path       a strata binary to run instead of building this checkout's
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
DIR=${DIR:-target/bench-limits}
OUT=${OUT:-target/bench-out/limits}
LIMIT=${LIMIT:-200}
JOBS=${JOBS:-3}
QD=${QD:-16}
RUNTIME=${RUNTIME:-8}
command -v fio >/dev/null || { echo "limits.sh needs fio (apt-get install fio)" >&2; exit 1; }
strata_binary
mkdir -p "$DIR" "$OUT"
machine "$DIR"
echo "limited volume: --iops-limit $LIMIT, $JOBS fio jobs at QD $QD; free volume: QD1 random reads; ${RUNTIME}s runs"

start_strata "$DIR/strata" --fast-size 256M --capacity-size 2G --default-volume-size 0 --scrub-interval off
cli() { "$STRATA" --server "$API" "$@" >/dev/null; }
cli volume create free --size 256M
cli volume create limited --size 256M --iops-limit "$LIMIT"
fio --name=fill --ioengine=nbd --uri="$NBD/free" --rw=write --bs=1M --size=64M --iodepth=4 >/dev/null

free_run() { # NAME
    fio --name="$1" --ioengine=nbd --uri="$NBD/free" --rw=randread --bs=4k --size=64M --iodepth=1 \
        --time_based --runtime="$RUNTIME" --output-format=json --output="$OUT/$1.json" >/dev/null
}
free_run alone
fio --name=limited --ioengine=nbd --uri="$NBD/limited" --rw=randread --bs=4k --size=64M \
    --iodepth="$QD" --numjobs="$JOBS" --group_reporting --time_based --runtime=$((RUNTIME + 4)) \
    --output-format=json --output="$OUT/limited.json" >/dev/null &
LOAD=$!
sleep 2
free_run beside
wait "$LOAD"
curl -sf "$API/metrics" >"$OUT/metrics.txt"

python3 - "$OUT" "$LIMIT" <<'EOF'
import json, re, sys
out, limit = sys.argv[1], int(sys.argv[2])
def job(name):
    text = open(f"{out}/{name}.json").read()
    return json.loads(text[text.index("{"):])["jobs"][0]["read"]
alone, beside, lim = job("alone"), job("beside"), job("limited")
print(f"free volume, QD1 reads: alone {alone['iops']:,.0f} IOPS, beside the limited one {beside['iops']:,.0f} IOPS: ratio {beside['iops'] / alone['iops']:.2f}")
print(f"limited volume: {lim['iops']:,.0f} IOPS against a limit of {limit}; fio latency mean {lim['lat_ns']['mean'] / 1e6:.1f} ms, max {lim['lat_ns']['max'] / 1e6:.1f} ms")
metrics = open(f"{out}/metrics.txt").read()
def sample(name):
    m = re.search(name + r'\{volume="limited",op="read"\} (\S+)', metrics)
    return float(m.group(1))
mean = sample("strata_volume_request_duration_seconds_sum") / sample("strata_volume_request_duration_seconds_count")
print(f"limited volume: the daemon's mean read latency {mean * 1e3:.1f} ms against fio's {lim['lat_ns']['mean'] / 1e6:.1f} ms: ratio {mean * 1e9 / lim['lat_ns']['mean']:.2f}")
EOF
