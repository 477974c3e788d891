#!/usr/bin/env bash
# Random overwrites of data that fills most of a small capacity tier: a node with a 64 MiB
# fast tier and a 256 MiB capacity file, a 1 GiB volume written sequentially to FILL_MIB (1 MiB
# requests, fio's nbd engine), then overwritten at random for RUNTIME seconds (4-64 KiB
# requests, queue depth 8). Twice, alternated: with the segment size the format chooses (1 MiB
# for this tier since the forty-first session) and with `--segment-size 8M` (what every tier
# had before). Printed for each: the MiB overwritten, whether fio got ENOSPC, the capacity
# tier's segments free and GC's count; then the ratio of MiB overwritten, default / 8M.
#   DIR=path            scratch files (default target/bench-overwrite-fill)
#   STRATA_BIN=path     a strata binary to run instead of building this checkout's
#   FILL_MIB=N          data written before the overwrites (default 160)
#   RUNTIME=S           seconds of overwrites (default 30)
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
DIR=${DIR:-target/bench-overwrite-fill}
FILL_MIB=${FILL_MIB:-160}
RUNTIME=${RUNTIME:-30}
command -v fio >/dev/null || { echo "overwrite-fill.sh needs fio (apt-get install fio)" >&2; exit 1; }
strata_binary
mkdir -p "$DIR"
machine "$DIR"

# run NAME FLAGS...: prints NAME's figures; leaves the MiB overwritten in WRITTEN.
run() {
    local name=$1
    shift
    rm -rf "${DIR:?}/$name"
    start_strata "$DIR/$name" --fast-size 64M --capacity-size 256M --default-volume-size 1G \
        --scrub-interval off "$@"
    fio --name=fill --ioengine=nbd --uri="$NBD/vol0" --rw=write --bs=1M --iodepth=4 \
        --size="${FILL_MIB}M" --output="$DIR/$name/fill.txt" >/dev/null 2>&1 ||
        { echo "$name: the fill failed" >&2; cat "$DIR/$name/fill.txt" >&2; exit 1; }
    fio --name=over --ioengine=nbd --uri="$NBD/vol0" --rw=randwrite --bsrange=4k-64k \
        --iodepth=8 --size="${FILL_MIB}M" --time_based --runtime="$RUNTIME" \
        --output-format=json --output="$DIR/$name/over.json" >/dev/null 2>&1 || true
    curl -sf "$API/metrics" >"$DIR/$name/metrics.txt"
    WRITTEN=$(python3 - "$name" "$DIR/$name/over.json" "$DIR/$name/metrics.txt" "$(
        sed -n 's/^.*capacity segments of \([^,]*\),.*/\1/p' "$DIR/$name/stderr" | head -1)" <<'EOF'
import json, re, sys
name, report, metrics, segment = sys.argv[1:5]
text = open(report).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
mib = job["write"]["io_bytes"] / 2**20
m = {}
for line in open(metrics):
    f = re.match(r"^(strata_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
    if f and f.group(1) not in m:
        m[f.group(1)] = float(f.group(3))
error = "ENOSPC" if job["error"] == 28 else ("no error" if job["error"] == 0 else f"error {job['error']}")
print(f"{name}: segments of {segment}; {mib:.0f} MiB overwritten in {job['write']['runtime'] / 1000:.1f} s, "
      f"{error}; capacity segments free {m['strata_capacity_segments_free']:.0f}, "
      f"GC cleaned {m.get('strata_gc_segments_cleaned_total', -1):.0f}", file=sys.stderr)
print(f"{mib:.1f}")
EOF
)
    stop_pid "$STRATA_PID"
}

run auto
AUTO=$WRITTEN
run seg8M --segment-size 8M
EIGHT=$WRITTEN
python3 -c "import sys; a, e = map(float, sys.argv[1:]); print(f'MiB overwritten, default / 8M segments: {a:.0f} / {e:.0f} = {a / max(e, 1):.1f}x')" "$AUTO" "$EIGHT"
