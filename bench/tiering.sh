#!/usr/bin/env bash
# Issue 5: the read cache and evidence-based promotion under a skewed workload. A 4 KiB random
# 70/30 read/write load with a zipfian distribution (fio random_distribution=zipf:$THETA) over a
# volume four times the fast tier, the capacity device slowed down by the device layer's model
# (`--capacity-emulate $CAP_EMU`, strata-device Throttled: a token bucket on bandwidth and IOPS).
#   A: --read-cache $CACHE_RATIO (promotion at the policy default: 2 reads in 5 minutes)
#   B: --read-cache 0 (no read cache, so no promotion)
# Each run: fill the volume sequentially, let the destager settle, warm up with the workload,
# then measure. Printed: IOPS of A and B and A/B (target >= 3); A's fast-tier read hit ratio
# over the measured interval (the volume's figures) against the ideal, and hit/ideal (>= 0.8).
#
# Ideal: fio's zipf gives the block of popularity rank i a probability i^-theta / H(N, theta)
# with H(N, theta) = sum_{j=1..N} j^-theta over the volume's N 4 KiB blocks. The hottest data
# that fits in the fast tier is its K = fast_log_bytes / 4096 most popular blocks, which serve
# ideal = H(K, theta) / H(N, theta) of the reads (fast_log_bytes: the write log's area, the part
# of the fast tier that holds data; read from /api/v1/diskgroups).
#   DIR=path OUT=path     scratch files and reports (default target/bench-tiering, target/bench-out/tiering)
#   FAST=size             fast tier (default 256M); the volume is 4x it
#   CAP_EMU=spec          capacity device model (default iops=400,bw=40MB)
#   THETA=x               zipf parameter (default 1.2)
#   WARMUP=s MEASURE=s    warm-up and measured seconds (default 90, 60)
#   QD=n                  fio iodepth (default 16)
#   CACHE_RATIO=x         read cache of run A (default 0.7)
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
DIR=${DIR:-target/bench-tiering}
OUT=${OUT:-target/bench-out/tiering}
FAST=${FAST:-256M}
CAP_EMU=${CAP_EMU:-iops=400,bw=40MB}
THETA=${THETA:-1.2}
WARMUP=${WARMUP:-90}
MEASURE=${MEASURE:-60}
QD=${QD:-16}
CACHE_RATIO=${CACHE_RATIO:-0.7}
command -v fio >/dev/null || { echo "tiering.sh needs fio (apt-get install fio)" >&2; exit 1; }
cargo build --release -p strata --bin strata >&2
STRATA=$(target_dir)/release/strata
mkdir -p "$DIR" "$OUT"
machine "$DIR"
fast_bytes=$(python3 -c "import sys; u={'K':10,'M':20,'G':30}; s=sys.argv[1]; print(int(s[:-1]) << u[s[-1]])" "$FAST")
vol_bytes=$((4 * fast_bytes))
echo "fast tier $FAST, volume $((vol_bytes >> 20)) MiB (4x), capacity device model: $CAP_EMU"
echo "workload: fio ioengine=nbd, 4 KiB randrw 70/30, random_distribution=zipf:$THETA, iodepth $QD, warm-up ${WARMUP}s, measured ${MEASURE}s"

api_get() { python3 -c "import json,sys,urllib.request; print(json.dumps(json.load(urllib.request.urlopen(sys.argv[1]))))" "$API$1"; }

fio_run() { # NAME RW SEED RUNTIME_S [extra fio args...]
    local name=$1 rw=$2 seed=$3 runtime=$4
    shift 4
    fio --name="$name" --ioengine=nbd --uri="$NBD/vol0" --rw="$rw" --bs=4k --iodepth="$QD" \
        --direct=1 --randseed="$seed" --output-format=json --output="$OUT/$name.json" \
        ${runtime:+--time_based --runtime="$runtime"} "$@" >/dev/null
}

# run LABEL READ_CACHE: one side, leaving $OUT/LABEL-{before,after}.json and LABEL-measure.json.
run() {
    local label=$1 ratio=$2
    start_strata "$DIR/$label" --fast-size "$FAST" --capacity-size 4G --default-volume-size "$vol_bytes" \
        --capacity-emulate "$CAP_EMU" --read-cache "$ratio"
    fio_run "$label-fill" write 1 "" --bs=1M --iodepth=4
    sleep 10 # let the destager bring the log down to its low mark
    fio_run "$label-warmup" randrw 2 "$WARMUP" --rwmixread=70 --random_distribution=zipf:"$THETA"
    api_get /api/v1/volumes/vol0 >"$OUT/$label-before.json"
    fio_run "$label-measure" randrw 3 "$MEASURE" --rwmixread=70 --random_distribution=zipf:"$THETA"
    api_get /api/v1/volumes/vol0 >"$OUT/$label-after.json"
    api_get /api/v1/diskgroups >"$OUT/$label-diskgroups.json"
    api_get /api/v1/status >"$OUT/$label-status.json"
    stop_pid "$STRATA_PID"
}

run A "$CACHE_RATIO"
run B 0

python3 - "$OUT" "$THETA" "$vol_bytes" <<'EOF'
import json, sys
out, theta, vol_bytes = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
load = lambda n: json.load(open(f"{out}/{n}.json"))

def iops(label):
    j = load(f"{label}-measure")["jobs"][0]
    return j["read"]["iops"] + j["write"]["iops"], j["read"]["lat_ns"]["mean"] / 1e3

def hit(label):
    b, a = load(f"{label}-before")["figures"], load(f"{label}-after")["figures"]
    d = {k: a[k] - b[k] for k in ("read_fast_bytes", "read_cached_bytes", "read_capacity_bytes")}
    total = sum(d.values())
    return (d["read_fast_bytes"] + d["read_cached_bytes"]) / total if total else float("nan"), d

def harmonic(n, s):
    return sum(i ** -s for i in range(1, n + 1))

log_bytes = load("A-diskgroups")["disk_groups"][0]["log_capacity_bytes"]
n_blocks, k_blocks = vol_bytes // 4096, log_bytes // 4096
ideal = harmonic(k_blocks, theta) / harmonic(n_blocks, theta)
(ia, la), (ib, lb) = iops("A"), iops("B")
ha, da = hit("A")
hb, _ = hit("B")
fa = load("A-after")["figures"]
print(f"fast tier write-log area {log_bytes / 2**20:.0f} MiB = {k_blocks} blocks; volume {n_blocks} blocks")
print(f"A (read cache on):  {ia:9.0f} IOPS  read latency mean {la:8.0f} us  fast-tier read hit {ha:.3f}")
print(f"B (read cache off): {ib:9.0f} IOPS  read latency mean {lb:8.0f} us  fast-tier read hit {hb:.3f}")
print(f"A measured reads: {da}; A promoted {fa['promoted_bytes']} B, evicted {fa['evicted_bytes']} B since start")
print(f"IOPS ratio A/B = {ia / ib:.2f} (target >= 3)")
print(f"ideal hit ratio (zipf {theta}, hottest {k_blocks} of {n_blocks} blocks) = {ideal:.3f}")
print(f"hit/ideal = {ha / ideal:.2f} (target >= 0.8)")
EOF
rm -rf "$DIR"
