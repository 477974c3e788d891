#!/usr/bin/env bash
# What the fast tier is written once the host goes idle, with a read cache: the idle drain
# should move host data to the capacity tier and stop, not write the log again and again (an
# admin's trial, forty-fourth session: 2 GB of fast-tier writes in the minute after 500 MB of
# host writes, with nothing destaged).
#   1. strata serve --fast-size 256M --capacity-size 2G --read-cache 0.5, volume vol0 256M;
#   2. fio: 200 MiB written in 256 KiB writes (QD4), then 30 s of 4 KiB 70/30 random
#      reads/writes (QD8) over it;
#   3. no I/O for $IDLE s: fast-tier bytes written, hot data kept, bytes destaged meanwhile.
# Printed: those figures, and the fast-tier bytes written while idle against the host bytes
# written before (the baseline from the same run; a drain that moves the backlog once writes
# a fraction of it, the churn wrote 4 times it).
#   DIR=path          scratch files (default target/bench-idle-writes)
#   IDLE=s            seconds watched after the host stops (default 60)
#   STRATA_BIN=path   a strata binary to run instead of building this checkout's
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
DIR=${DIR:-target/bench-idle-writes}
IDLE=${IDLE:-60}
command -v fio >/dev/null || { echo "idle-writes.sh needs fio (apt-get install fio)" >&2; exit 1; }
strata_binary
mkdir -p "$DIR"
machine "$DIR"
start_strata "$DIR/strata" --fast-size 256M --capacity-size 2G --read-cache 0.5 \
    --default-volume-size 256M --scrub-interval off
fio --name=fill --ioengine=nbd --uri="$NBD/vol0" --rw=write --bs=256k --iodepth=4 --size=200M >/dev/null
fio --name=mix --ioengine=nbd --uri="$NBD/vol0" --rw=randrw --rwmixread=70 --bs=4k --iodepth=8 \
    --time_based --runtime=30 --size=200M >/dev/null
curl -sf "$API/metrics" >"$DIR/before.txt"
sleep "$IDLE"
curl -sf "$API/metrics" >"$DIR/after.txt"
python3 - "$DIR" "$IDLE" <<'PY'
import re, sys
d, idle = sys.argv[1], sys.argv[2]
def read(name):
    out = {}
    for line in open(f"{d}/{name}.txt"):
        m = re.match(r'(\w+)(\{[^}]*\})? (\S+)', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out
b, a = read("before"), read("after")
fast = next(k for k in a if k.startswith("strata_device_written_bytes_total") and 'tier="fast"' in k)
delta = lambda k: a[k] - b[k]
host = b["strata_write_bytes_total"] if "strata_write_bytes_total" in b else sum(
    v for k, v in b.items() if k.startswith("strata_volume_write_bytes_total"))
mib = 1 << 20
print(f"in the {idle} s after the host stopped: fast-tier writes {delta(fast) / mib:.0f} MiB, "
      f"hot data kept {delta('strata_hot_kept_bytes_total') / mib:.0f} MiB, "
      f"destaged {delta('strata_destaged_bytes_total') / mib:.0f} MiB; "
      f"write-buffer fill then {a['strata_log_fill_ratio']:.2f}")
print(f"host writes before: {host / mib:.0f} MiB; fast-tier writes while idle against them: "
      f"{delta(fast) / host:.2f}")
PY
