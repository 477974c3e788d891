#!/usr/bin/env bash
# Snapshots under load, against baselines measured in the same run.
#
# 1. 4 KiB random write IOPS (fio's nbd engine, queue depth 32) on a volume with 0, 1 and 10
#    snapshots. Every variant gets a fresh volume with the same write history: the region is
#    written once, then BURSTS bursts of BURST_IOS random 4 KiB writes; variant N takes a
#    snapshot before each of the first N bursts, so its snapshots share the region and each holds
#    a burst of its own. Then RUNTIME seconds of random writes are measured. Variants are
#    interleaved within each round; the table shows medians over rounds and the ratio against
#    0 snapshots (target >= 0.9).
# 2. Snapshot create latency: CREATES snapshots of an idle volume, then CREATES more while fio
#    writes at random to it (queue depth 32), each timed by the client from request to answer
#    (POST /api/v1/volumes/NAME/snapshots: the engine waits for the volume's writes in flight,
#    freezes it and makes the change durable; the answer carries the snapshot's space per tier,
#    which walks its map). After each create, a GET of the snapshot (the same walk, nothing
#    else) and a GET /api/v1/node (no walk) are timed too, and the daemon's log gives the
#    engine's own time for each create. p50/p99/max, and the ratio loaded / idle.
#
# Settings (environment):
#   RUNTIME=10   seconds per measured fio run     RAMP=2        fio ramp_time in seconds
#   ROUNDS=3     interleaved rounds               SIZE=256M     volume size and fio region
#   BURSTS=10    write bursts before measuring    BURST_IOS=2000  random writes per burst
#   CREATES=50   snapshots per latency series     IODEPTH=32
#   PARTS="iops latency"  which parts to run
#   BENCH_DIR=/var/tmp   where the temporary data directory goes (pick the medium to test)
#   STRATA_ARGS=""  extra flags for `strata serve`   KEEP=1   keep the directory and results
set -euo pipefail

RUNTIME=${RUNTIME:-10}
RAMP=${RAMP:-2}
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-256M}
BURSTS=${BURSTS:-10}
BURST_IOS=${BURST_IOS:-2000}
CREATES=${CREATES:-50}
IODEPTH=${IODEPTH:-32}
PARTS=${PARTS:-iops latency}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
STRATA_ARGS=${STRATA_ARGS:-}
KEEP=${KEEP:-}
VARIANTS=(0 1 10)

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() {
    echo "bench: $*" >&2
    exit 1
}

for tool in cargo fio python3; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is required (./scripts/test installs fio)"
done
engines=$(fio --enghelp 2>/dev/null) || true
grep -qw nbd <<<"$engines" || die "this fio has no nbd ioengine"
((BURSTS >= 10)) || die "BURSTS must be at least 10 (the largest variant takes 10 snapshots)"

WORK=$(mktemp -d "$BENCH_DIR/strata-bench-snap.XXXXXX")
STRATA_PID=""
LOAD_PID=""
cleanup() {
    [[ -n "$LOAD_PID" ]] && kill "$LOAD_PID" 2>/dev/null && wait "$LOAD_PID" 2>/dev/null || true
    [[ -n "$STRATA_PID" ]] && kill "$STRATA_PID" 2>/dev/null && wait "$STRATA_PID" 2>/dev/null || true
    if [[ -n "$KEEP" ]]; then
        echo "bench: kept $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== building strata (release)"
(cd "$REPO" && cargo build --release --quiet -p strata)
STRATA="$(cd "$REPO" && cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/strata"
[[ -x "$STRATA" ]] || die "no release binary at $STRATA"

echo "== starting strata in $WORK"
# shellcheck disable=SC2086
"$STRATA" serve --data-dir "$WORK/data" --nbd-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    --default-volume-size 0 $STRATA_ARGS >"$WORK/strata.out" 2>"$WORK/strata.log" &
STRATA_PID=$!
for _ in $(seq 600); do
    grep -qx 'strata: ready' "$WORK/strata.out" 2>/dev/null && break
    kill -0 "$STRATA_PID" 2>/dev/null || { tail -5 "$WORK/strata.log" >&2; die "strata exited during start"; }
    sleep 0.1
done
grep -qx 'strata: ready' "$WORK/strata.out" || die "strata not ready after 60 s"
NBD=$(sed -n 's/^strata: NBD listening on //p' "$WORK/strata.out")
HTTP=$(sed -n 's/^strata: HTTP API listening on //p' "$WORK/strata.out")
BACKEND=$(sed -n 's/^strata: I\/O backend //p' "$WORK/strata.out")
cli() { "$STRATA" --server "$HTTP" "$@"; }

fs_type=$(df --output=fstype "$WORK" | tail -1)
fs_source=$(df --output=source "$WORK" | tail -1)
echo
echo "machine:  $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "kernel:   $(uname -r)"
echo "medium:   $WORK on $fs_source ($fs_type)"
echo "strata:   nbd://$NBD, I/O backend $BACKEND, flags: ${STRATA_ARGS:-defaults}"
echo "fio:      $(fio --version), 4 KiB random write, iodepth $IODEPTH, ${RUNTIME}s (+${RAMP}s ramp)"
echo "          per run, $ROUNDS rounds, region $SIZE, $BURSTS bursts of $BURST_IOS writes first"
echo

FIO_COMMON=(--ioengine=nbd --size="$SIZE" --bs=4k --norandommap --randrepeat=0 --output-format=json)

fill() { # volume
    fio --name=fill --ioengine=nbd --uri="nbd://$NBD/$1" --size="$SIZE" --rw=write --bs=1M \
        --iodepth=8 --output="$WORK/fill.json" --output-format=json >/dev/null || die "filling $1 failed"
}

burst() { # volume
    fio --name=burst "${FIO_COMMON[@]}" --uri="nbd://$NBD/$1" --rw=randwrite --iodepth="$IODEPTH" \
        --number_ios="$BURST_IOS" --output="$WORK/burst.json" >/dev/null || die "burst on $1 failed"
}

# Waits until the engine has released what deleted volumes held and the log is below its low
# mark, so every variant starts from the same state.
quiesce() {
    python3 - "$HTTP" <<'EOF' || die "the engine did not settle within 120 s"
import json, sys, time, urllib.request
base = sys.argv[1]
deadline = time.time() + 120
while time.time() < deadline:
    dg = json.load(urllib.request.urlopen(base + "/api/v1/diskgroups"))["disk_groups"][0]
    live = dg["fast_resident_bytes"] + dg["capacity_live_bytes"]
    if live == 0 and dg["log_fill_ratio"] <= dg["fill_ratio_low"]:
        sys.exit(0)
    time.sleep(0.2)
sys.exit(1)
EOF
}

RESULTS="$WORK/iops.csv"
echo "round,snapshots,iops,clat_p99_us" >"$RESULTS"

measure() { # round snapshots volume
    local out="$WORK/$1-$2.json"
    fio --name="snap$2" "${FIO_COMMON[@]}" --uri="nbd://$NBD/$3" --rw=randwrite --iodepth="$IODEPTH" \
        --time_based --runtime="$RUNTIME" --ramp_time="$RAMP" --output="$out" >/dev/null ||
        die "fio on $3 failed (see $out)"
    python3 - "$out" "$1" "$2" >>"$RESULTS" <<'EOF'
import json, sys
path, rnd, snaps = sys.argv[1:]
job = json.load(open(path))["jobs"][0]
if job["error"]:
    sys.exit(f"fio error {job['error']} in {path}")
w = job["write"]
p99 = w["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000
print(f"{rnd},{snaps},{w['iops']:.0f},{p99:.0f}")
EOF
    tail -1 "$RESULTS" | awk -F, '{printf "   round %s  %2s snapshot(s)  %8s IOPS  p99 %7s us\n", $1, $2, $3, $4}'
}

run_iops() {
echo "== 4 KiB random write with 0, 1 and 10 snapshots"
for round in $(seq "$ROUNDS"); do
    # Each round starts with a different variant, so a drift of the machine hits them alike.
    shift_by=$(((round - 1) % ${#VARIANTS[@]}))
    order=("${VARIANTS[@]:shift_by}" "${VARIANTS[@]:0:shift_by}")
    for n in "${order[@]}"; do
        vol="r$round-s$n"
        quiesce
        cli volume create "$vol" --size "$SIZE" >/dev/null
        fill "$vol"
        for b in $(seq "$BURSTS"); do
            ((b <= n)) && cli snapshot create "$vol" "b$b" >/dev/null
            burst "$vol"
        done
        measure "$round" "$n" "$vol"
        # --force: fio has exited, but the daemon may not have seen its connection close yet.
        cli volume delete "$vol" --with-snapshots --force >/dev/null
    done
done
}

create_series() { # label first-index
    python3 - "$HTTP" lat "$CREATES" "$1" "$2" >>"$WORK/latency.csv" <<'EOF'
import http.client, json, sys, time
base, vol, count, label, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
host = base.removeprefix("http://").rstrip("/")
conn = http.client.HTTPConnection(host, timeout=60)
for i in range(first, first + count):
    body = json.dumps({"name": f"l{i}"})
    t0 = time.perf_counter()
    conn.request("POST", f"/api/v1/volumes/{vol}/snapshots", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    ms = (time.perf_counter() - t0) * 1000
    if resp.status != 201:
        sys.exit(f"snapshot create answered {resp.status}")
    print(f"{label},{ms:.3f}")
    for what, path in (("get", f"/api/v1/volumes/{vol}/snapshots/l{i}"), ("node", "/api/v1/node")):
        time.sleep(0.02)
        t0 = time.perf_counter()
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            sys.exit(f"GET {path} answered {resp.status}")
        print(f"{label}-{what},{(time.perf_counter() - t0) * 1000:.3f}")
    time.sleep(0.1)
EOF
}

run_latency() {
echo
echo "== snapshot create latency: $CREATES idle, then $CREATES under 4 KiB random writes (QD$IODEPTH)"
quiesce
cli volume create lat --size "$SIZE" >/dev/null
fill lat
create_series idle 1
fio --name=load "${FIO_COMMON[@]}" --uri="nbd://$NBD/lat" --rw=randwrite --iodepth="$IODEPTH" \
    --time_based --runtime=600 --output="$WORK/load.json" >/dev/null 2>&1 &
LOAD_PID=$!
sleep "$RAMP"
create_series load $((CREATES + 1))
kill "$LOAD_PID" 2>/dev/null || true
wait "$LOAD_PID" 2>/dev/null || true
LOAD_PID=""
}

echo "series,latency_ms" >"$WORK/latency.csv"
[[ " $PARTS " == *" iops "* ]] && run_iops
[[ " $PARTS " == *" latency "* ]] && run_latency
kill -0 "$STRATA_PID" 2>/dev/null || die "strata died during the run (see $WORK/strata.log)"

echo
python3 - "$RESULTS" "$WORK/latency.csv" "$WORK/strata.log" "$CREATES" <<'EOF'
import csv, math, re, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
def value(rnd, n, field):
    return next(float(r[field]) for r in rows if r["round"] == rnd and r["snapshots"] == str(n))
rounds = sorted({r["round"] for r in rows}, key=int)
def med(n, field):
    return statistics.median(value(rnd, n, field) for rnd in rounds)
if rounds:
    print(f"{'snapshots':<11}{'IOPS':>9}{'p99 us':>9}  {'IOPS / 0 snapshots, per round':<32}{'median':>7}")
    for n in (0, 1, 10):
        ratios = [value(rnd, n, "iops") / value(rnd, 0, "iops") for rnd in rounds]
        per_round = " ".join(f"{x:.2f}" for x in ratios)
        print(f"{n:<11}{med(n, 'iops'):>9.0f}{med(n, 'clat_p99_us'):>9.0f}  {per_round:<32}{statistics.median(ratios):>7.2f}")
    print("IOPS and p99: medians over rounds; ratio: within each round, then the median; target >= 0.9")

def pct(values, p):
    values = sorted(values)
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]
lat = list(csv.DictReader(open(sys.argv[2])))
def series(name):
    return {s: [float(r["latency_ms"]) for r in lat if r["series"] == s + name] for s in ("idle", "load")}
# The daemon logs the engine's share of each create (the API call minus HTTP and the answer).
engine_us = [int(m.group(1)) for line in open(sys.argv[3])
             if "snapshot created" in line and "volume=lat " in line
             for m in [re.search(r"latency_us=(\d+)", line)] if m]
creates = int(sys.argv[4])
engine = {"idle": [us / 1000 for us in engine_us[:creates]], "load": [us / 1000 for us in engine_us[creates:]]}
print()
print(f"{'latency':<28}{'n':>4}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
table = (("create, client", series("")), ("create, engine", engine),
         ("GET snapshot", series("-get")), ("GET node", series("-node")))
for what, t in table:
    for s in ("idle", "load"):
        v = t[s]
        if v:
            print(f"{what + ', ' + s:<28}{len(v):>4}{pct(v, 50):>9.2f}{pct(v, 99):>9.2f}{max(v):>9.2f}")
    if t["idle"] and t["load"]:
        r50 = pct(t["load"], 50) / pct(t["idle"], 50)
        r99 = pct(t["load"], 99) / pct(t["idle"], 99)
        print(f"{what + ', load / idle':<28}{'':>4}{r50:>9.2f}{r99:>9.2f}")
print("create, client: request to answer (the snapshot is durable; the answer has no space figures)")
print("create, engine: DiskGroup::create_snapshot as the daemon logs it; nearest-rank percentiles")
EOF
[[ -n "$KEEP" ]] && echo "per-run results: $RESULTS $WORK/latency.csv"
exit 0
