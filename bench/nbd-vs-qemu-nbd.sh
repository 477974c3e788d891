#!/usr/bin/env bash
# Strata against qemu-nbd, both driven by fio's nbd engine in one interleaved run.
#
# qemu-nbd serves a preallocated raw file (O_DIRECT, io_uring) in the same directory as
# Strata's fast-tier file, so both sit on the same medium. For each round and workload,
# Strata runs first and qemu-nbd right after, so drift of the machine hits both alike.
# Workloads: 4 KiB random read at queue depth 32, 4 KiB random write at queue depth 32,
# 4 KiB random write at queue depth 1 (latency p50/p99 from fio's clat_ns percentiles).
# Both servers use the same disk, and Strata goes on destaging after a run ends: before each
# qemu-nbd run the script waits until Strata's devices have been quiet for three seconds, so
# qemu-nbd never runs against Strata's background I/O (qemu-nbd has none to leave behind).
# The table shows the median over rounds and the ratio strata/qemu-nbd.
#
# Settings (environment):
#   RUNTIME=10      seconds per fio run          ROUNDS=3       interleaved rounds
#   RAMP=2          fio ramp_time in seconds     SIZE=512M      region fio works on
#   BENCH_DIR=/var/tmp   where the temporary data directory goes (pick the medium to test)
#   STRATA_ARGS=""  extra flags for `strata serve`   KEEP=1   keep the directory and results
#   STRATA_BIN=     a strata binary to run instead of building this checkout's
#   DURABLE=1       follow every write with an NBD FLUSH (fio --fsync=1) on both servers. Strata
#                   replies to a write once it is durable; qemu-nbd --cache=none only once it
#                   reached the device, durable at the next FLUSH. DURABLE=1 compares equal promises.
#   QEMU_CACHE=none qemu-nbd's --cache mode. `directsync` (O_DIRECT, each write durable before
#                   its reply) gives qemu-nbd Strata's promise without extra FLUSH requests, so
#                   the latency columns compare equal promises too.
set -euo pipefail

RUNTIME=${RUNTIME:-10}
ROUNDS=${ROUNDS:-3}
RAMP=${RAMP:-2}
SIZE=${SIZE:-512M}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
STRATA_ARGS=${STRATA_ARGS:-}
KEEP=${KEEP:-}
DURABLE=${DURABLE:-}
QEMU_CACHE=${QEMU_CACHE:-none}
WRITE_EXTRA=""
[[ -n "$DURABLE" ]] && WRITE_EXTRA="--fsync=1"

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() {
    echo "bench: $*" >&2
    exit 1
}

for tool in cargo fio qemu-nbd python3 fallocate; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is required (./scripts/test installs fio and qemu-utils)"
done
engines=$(fio --enghelp 2>/dev/null) || true
grep -qw nbd <<<"$engines" || die "this fio has no nbd ioengine"

WORK=$(mktemp -d "$BENCH_DIR/strata-bench.XXXXXX")
STRATA_PID=""
QEMU_PID=""
cleanup() {
    [[ -n "$STRATA_PID" ]] && kill "$STRATA_PID" 2>/dev/null && wait "$STRATA_PID" 2>/dev/null || true
    [[ -n "$QEMU_PID" ]] && kill "$QEMU_PID" 2>/dev/null && wait "$QEMU_PID" 2>/dev/null || true
    if [[ -n "$KEEP" ]]; then
        echo "bench: kept $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [[ -n "${STRATA_BIN:-}" ]]; then
    STRATA=$STRATA_BIN
    [[ -x "$STRATA" ]] || die "STRATA_BIN=$STRATA is not an executable"
else
    echo "== building strata (release)"
    (cd "$REPO" && cargo build --release --quiet -p strata)
    STRATA="$REPO/target/release/strata"
    [[ -x "$STRATA" ]] || STRATA="$(cd "$REPO" && cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/strata"
    [[ -x "$STRATA" ]] || die "no release binary found"
fi

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

echo "== starting strata in $WORK/strata"
# shellcheck disable=SC2086
"$STRATA" serve --data-dir "$WORK/strata" --nbd-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 $STRATA_ARGS \
    >"$WORK/strata.out" 2>"$WORK/strata.log" &
STRATA_PID=$!
for _ in $(seq 600); do
    grep -qx 'strata: ready' "$WORK/strata.out" 2>/dev/null && break
    kill -0 "$STRATA_PID" 2>/dev/null || { tail -5 "$WORK/strata.log" >&2; die "strata exited during start"; }
    sleep 0.1
done
grep -qx 'strata: ready' "$WORK/strata.out" || die "strata not ready after 60 s"
STRATA_NBD=$(sed -n 's/^strata: NBD listening on //p' "$WORK/strata.out")
STRATA_HTTP=$(sed -n 's/^strata: HTTP API listening on //p' "$WORK/strata.out")
STRATA_BACKEND=$(sed -n 's/^strata: I\/O backend //p' "$WORK/strata.out")
STRATA_URI="nbd://$STRATA_NBD/vol0"

echo "== starting qemu-nbd on a preallocated $SIZE raw file in $WORK"
QEMU_FILE="$WORK/qemu-nbd.raw"
fallocate -l "$SIZE" "$QEMU_FILE"
QEMU_PORT=$(free_port)
qemu-nbd -f raw --cache="$QEMU_CACHE" --aio=io_uring -t -e 8 -p "$QEMU_PORT" -b 127.0.0.1 "$QEMU_FILE" \
    2>"$WORK/qemu-nbd.log" &
QEMU_PID=$!
QEMU_URI="nbd://127.0.0.1:$QEMU_PORT"
for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$QEMU_PORT") 2>/dev/null && break
    kill -0 "$QEMU_PID" 2>/dev/null || { cat "$WORK/qemu-nbd.log" >&2; die "qemu-nbd exited during start"; }
    sleep 0.1
done

fs_type=$(df --output=fstype "$WORK" | tail -1)
fs_source=$(df --output=source "$WORK" | tail -1)
echo
echo "machine:  $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "kernel:   $(uname -r)"
echo "medium:   $WORK on $fs_source ($fs_type)"
echo "strata:   $STRATA_URI, I/O backend $STRATA_BACKEND, flags: ${STRATA_ARGS:-defaults}"
echo "qemu-nbd: $QEMU_URI, --cache=$QEMU_CACHE, $(qemu-nbd --version | head -1)"
echo "fio:      $(fio --version), runtime ${RUNTIME}s (+${RAMP}s ramp) per run, $ROUNDS rounds, region $SIZE"
if [[ -n "$DURABLE" ]]; then
    echo "writes:   each followed by an NBD FLUSH (DURABLE=1)"
else
    echo "writes:   no FLUSH (with --cache=none qemu-nbd acknowledges before durability; DURABLE=1 flushes each write)"
fi
echo

FIO_COMMON=(--ioengine=nbd --size="$SIZE" --bs=4k --norandommap --randrepeat=0 --group_reporting
    --output-format=json)

echo "== preconditioning: writing the $SIZE region once on both"
for uri in "$STRATA_URI" "$QEMU_URI"; do
    fio --name=fill --ioengine=nbd --uri="$uri" --size="$SIZE" --rw=write --bs=1M --iodepth=8 \
        --output="$WORK/fill.json" --output-format=json >/dev/null ||
        die "preconditioning $uri failed"
done

# workload name -> fio arguments (engine options such as --uri must follow --ioengine)
declare -A WORKLOAD=(
    [randread-qd32]="--rw=randread --iodepth=32"
    [randwrite-qd32]="--rw=randwrite --iodepth=32 $WRITE_EXTRA"
    [write-qd1]="--rw=randwrite --iodepth=1 $WRITE_EXTRA"
)
ORDER=(randread-qd32 randwrite-qd32 write-qd1)

RESULTS="$WORK/results.csv"
echo "round,target,workload,iops,clat_p50_us,clat_p99_us" >"$RESULTS"

# Waits (60 s at most) until Strata's devices have neither read nor written for three seconds
# in a row (longer than the one second of host silence after which Strata starts destaging
# down to its low mark); prints the seconds waited.
strata_quiet() {
    python3 - "$STRATA_HTTP/metrics" <<'EOF'
import sys, time, urllib.request
url = sys.argv[1]
def io():
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines()
               if l.startswith(("strata_device_written_bytes_total", "strata_device_read_bytes_total")))
start = time.monotonic()
last, quiet = io(), 0
while quiet < 3 and time.monotonic() - start < 60:
    time.sleep(1)
    now = io()
    quiet = quiet + 1 if now == last else 0
    last = now
print(f"{time.monotonic() - start:.0f}")
EOF
}

run_fio() { # round target uri workload
    local round=$1 target=$2 uri=$3 workload=$4 out="$WORK/$1-$2-$4.json"
    # shellcheck disable=SC2086
    fio --name="$workload" "${FIO_COMMON[@]}" --uri="$uri" ${WORKLOAD[$workload]} \
        --time_based --runtime="$RUNTIME" --ramp_time="$RAMP" --output="$out" >/dev/null ||
        die "fio $workload on $target failed (see $out)"
    python3 - "$out" "$round" "$target" "$workload" >>"$RESULTS" <<'EOF'
import json, sys
path, rnd, target, workload = sys.argv[1:]
job = json.load(open(path))["jobs"][0]
if job["error"]:
    sys.exit(f"fio error {job['error']} in {path}")
side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
pct = side["clat_ns"].get("percentile", {})
p50 = pct.get("50.000000", 0) / 1000
p99 = pct.get("99.000000", 0) / 1000
print(f"{rnd},{target},{workload},{side['iops']:.0f},{p50:.1f},{p99:.1f}")
EOF
    tail -1 "$RESULTS" | awk -F, '{printf "   round %s %-9s %-15s %9s IOPS  p50 %8s us  p99 %8s us\n", $1, $2, $3, $4, $5, $6}'
}

echo "== running: ${ORDER[*]}, strata and qemu-nbd interleaved"
for round in $(seq "$ROUNDS"); do
    for workload in "${ORDER[@]}"; do
        run_fio "$round" strata "$STRATA_URI" "$workload"
        waited=$(strata_quiet) || die "could not read Strata's metrics"
        echo "   (waited ${waited} s for Strata's devices to go quiet)"
        run_fio "$round" qemu-nbd "$QEMU_URI" "$workload"
    done
done
kill -0 "$STRATA_PID" 2>/dev/null || die "strata died during the run (see $WORK/strata.log)"

echo
python3 - "$RESULTS" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
def median(target, workload, field):
    vals = [float(r[field]) for r in rows if r["target"] == target and r["workload"] == workload]
    return statistics.median(vals)
print(f"{'workload':<16}{'metric':<10}{'strata':>12}{'qemu-nbd':>12}{'strata/qemu-nbd':>18}")
for workload, metrics in [("randread-qd32", ["iops"]), ("randwrite-qd32", ["iops"]),
                          ("write-qd1", ["iops", "clat_p50_us", "clat_p99_us"])]:
    for m in metrics:
        s, q = median("strata", workload, m), median("qemu-nbd", workload, m)
        ratio = s / q if q else float("nan")
        label = {"iops": "IOPS", "clat_p50_us": "p50 us", "clat_p99_us": "p99 us"}[m]
        print(f"{workload:<16}{label:<10}{s:>12.1f}{q:>12.1f}{ratio:>18.2f}")
print("\nmedians over rounds; IOPS ratio >= 1 and latency ratio <= 1 favour strata")
EOF
[[ -n "$KEEP" ]] && echo "per-run results: $RESULTS"
exit 0
