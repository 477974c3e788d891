#!/usr/bin/env bash
# Queue-depth-1 writes held long enough for Strata's log to reach its steady state, against
# qemu-nbd on the same disk. bench/nbd-vs-qemu-nbd.sh runs QD1 for 10 s from a log drained to
# its low mark, which ends about when cleaning (compaction of a hot set that fits the log)
# begins; this script keeps writing until cleaning runs, and shows the p99 window by window.
#
# For each round, Strata then qemu-nbd, each fresh (the other one stopped):
#   fill SIZE sequentially (1 MiB writes), 4 KiB random writes at QD32 for QD32_S seconds,
#   IDLE_S seconds with no I/O (Strata's idle drain takes its log to the low mark), then
#   4 KiB random writes at QD1 for SUSTAIN_S seconds with fio's per-I/O latency log.
# Printed: p99 per WINDOW_S window for both and the ratio, Strata's log fill at the end of
# each window (from /metrics, sampled every second), the writes per second slower than
# SLOW_US per window (what sets the p99: at ~4,000 writes a second, 40 slow ones are 1%),
# and the whole run's IOPS, p50 and p99.
#
# Settings (environment):
#   ROUNDS=2  SIZE=512M  QD32_S=10  IDLE_S=8  SUSTAIN_S=40  WINDOW_S=10  SLOW_US=500
#   QEMU_CACHE=directsync   qemu-nbd's --cache (directsync makes Strata's promise: a write is
#                           durable before its reply)
#   STRATA_ARGS=""   flags for `strata serve`      STRATA_BIN=   a strata binary to run
#   DIR=target/bench-qd1-sustained   scratch directory (pick the medium to test)
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
ROUNDS=${ROUNDS:-2}
SIZE=${SIZE:-512M}
QD32_S=${QD32_S:-10}
IDLE_S=${IDLE_S:-8}
SUSTAIN_S=${SUSTAIN_S:-40}
WINDOW_S=${WINDOW_S:-10}
SLOW_US=${SLOW_US:-500}
QEMU_CACHE=${QEMU_CACHE:-directsync}
STRATA_ARGS=${STRATA_ARGS:-}
DIR=${DIR:-target/bench-qd1-sustained}

for tool in fio qemu-nbd python3 fallocate curl; do
    command -v "$tool" >/dev/null || { echo "qd1-sustained: $tool is needed (./scripts/test installs fio and qemu-utils)" >&2; exit 1; }
done
fio --enghelp=nbd >/dev/null 2>&1 || { echo "qd1-sustained: this fio has no nbd engine" >&2; exit 1; }
strata_binary
mkdir -p "$DIR"
SCRATCH+=("$DIR/qemu.raw")
machine "$DIR"
echo "strata:   $STRATA serve ${STRATA_ARGS:-(defaults)}"
echo "qemu-nbd: --cache=$QEMU_CACHE --aio=io_uring on a preallocated raw file; $(qemu-nbd --version | head -1)"
echo "$ROUNDS rounds; each target: fill $SIZE, QD32 ${QD32_S}s, idle ${IDLE_S}s, QD1 ${SUSTAIN_S}s (4 KiB random writes)"

# load URI NAME [API]: fill, QD32, idle, then the sustained QD1 run with its latency log in
# $DIR/NAME; with API, Strata's log fill is sampled every second of the QD1 run.
load() {
    local uri=$1 name=$2 api=${3:-} sampler=""
    fio --name=fill --ioengine=nbd --uri="$uri" --size="$SIZE" --rw=write --bs=1M --iodepth=8 \
        --output-format=terse >/dev/null
    fio --name=qd32 --ioengine=nbd --uri="$uri" --size="$SIZE" --bs=4k --rw=randwrite \
        --norandommap --randrepeat=0 --iodepth=32 --time_based --runtime="$QD32_S" \
        --output-format=terse >/dev/null
    sleep "$IDLE_S"
    : >"$DIR/$name.fill"
    if [[ -n "$api" ]]; then
        (
            while :; do
                curl -s "$api/metrics" | awk '/^strata_log_fill_ratio /{print $2}'
                sleep 1
            done
        ) >>"$DIR/$name.fill" 2>/dev/null &
        sampler=$!
        STARTED_PIDS+=("$sampler")
    fi
    rm -f "$DIR/${name}"_clat.*.log "$DIR/${name}"_lat.*.log "$DIR/${name}"_slat.*.log
    fio --name=qd1 --ioengine=nbd --uri="$uri" --size="$SIZE" --bs=4k --rw=randwrite \
        --norandommap --randrepeat=0 --iodepth=1 --time_based --runtime="$SUSTAIN_S" \
        --write_lat_log="$DIR/$name" --log_avg_msec=0 --output-format=json \
        --output="$DIR/$name.json" >/dev/null
    [[ -z "$sampler" ]] || stop_pid "$sampler"
}

for round in $(seq "$ROUNDS"); do
    # shellcheck disable=SC2086 # the flags are a word list on purpose
    start_strata "$DIR/strata" $STRATA_ARGS
    load "$NBD/vol0" "strata-$round" "$API"
    stop_pid "$STRATA_PID"
    rm -rf "$DIR/strata"

    rm -f "$DIR/qemu.raw"
    fallocate -l "$SIZE" "$DIR/qemu.raw"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    qemu-nbd -f raw --cache="$QEMU_CACHE" --aio=io_uring -t -e 8 -p "$port" -b 127.0.0.1 \
        "$DIR/qemu.raw" 2>"$DIR/qemu-nbd.log" &
    QEMU_PID=$!
    STARTED_PIDS+=("$QEMU_PID")
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.1
    done
    load "nbd://127.0.0.1:$port" "qemu-$round"
    stop_pid "$QEMU_PID"
    rm -f "$DIR/qemu.raw"
done

python3 - "$DIR" "$ROUNDS" "$WINDOW_S" "$SUSTAIN_S" "$SLOW_US" <<'EOF'
import glob, json, statistics, sys

out, rounds, window, sustain = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
slow_ns = int(sys.argv[5]) * 1000

def latencies(name):
    """(ms since the run's start, completion latency in ns) of every QD1 write."""
    lat = []
    for path in glob.glob(f"{out}/{name}_clat.*.log"):
        for line in open(path):
            f = line.split(",")
            lat.append((int(f[0]), int(f[1])))
    return lat

def p99(values):
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * 0.99))] / 1000 if v else float("nan")

def whole(name):
    w = json.load(open(f"{out}/{name}.json"))["jobs"][0]["write"]
    pct = w["clat_ns"]["percentile"]
    return w["iops"], pct["50.000000"] / 1000, pct["99.000000"] / 1000

windows = range(sustain // window)
print(f"\nQD1 p99 by {window} s window, Strata / qemu-nbd in us (ratio; Strata's log fill at the window's end)")
ratios = {k: [] for k in windows}
for r in range(1, rounds + 1):
    s, q = latencies(f"strata-{r}"), latencies(f"qemu-{r}")
    fills = [float(x) for x in open(f"{out}/strata-{r}.fill").read().split()]
    cells = []
    for k in windows:
        lo, hi = k * window * 1000, (k + 1) * window * 1000
        ps = p99(l for t, l in s if lo <= t < hi)
        pq = p99(l for t, l in q if lo <= t < hi)
        ratios[k].append(ps / pq)
        fill = fills[min(len(fills) - 1, (k + 1) * window - 1)] if fills else float("nan")
        cells.append(f"{ps:.0f} / {pq:.0f} ({ps / pq:.2f}; {fill:.2f})")
    print(f"  round {r}: " + "  ".join(cells))
print("  median ratio by window: " + "  ".join(f"{statistics.median(ratios[k]):.2f}" for k in windows))

print(f"\nQD1 writes slower than {slow_ns // 1000} us, per second, by {window} s window: Strata / qemu-nbd")
for r in range(1, rounds + 1):
    s, q = latencies(f"strata-{r}"), latencies(f"qemu-{r}")
    cells = []
    for k in windows:
        lo, hi = k * window * 1000, (k + 1) * window * 1000
        ns = sum(1 for t, l in s if lo <= t < hi and l > slow_ns) / window
        nq = sum(1 for t, l in q if lo <= t < hi and l > slow_ns) / window
        cells.append(f"{ns:.0f} / {nq:.0f}")
    print(f"  round {r}: " + "  ".join(cells))

print("\nthe whole QD1 run, medians over rounds")
rows = {t: [whole(f"{t}-{r}") for r in range(1, rounds + 1)] for t in ("strata", "qemu")}
for i, label in enumerate(["IOPS", "p50 us", "p99 us"]):
    s = statistics.median(x[i] for x in rows["strata"])
    q = statistics.median(x[i] for x in rows["qemu"])
    print(f"  {label:<7} strata {s:>9.0f}   qemu-nbd {q:>9.0f}   strata/qemu-nbd {s / q:.2f}")
EOF
