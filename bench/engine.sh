#!/usr/bin/env bash
# In-process tier-engine benchmarks; every figure comes with a baseline measured in the same
# run. Usage: bench/engine.sh [qd32|saturate|hotset|index-ram|all]
#   DIR=path      where the device files go (default target/bench-engine, the repo's filesystem)
#   ROUNDS=n      rounds of the interleaved QD32 comparison (default 3)
#   SECS=n        seconds measured once the log is saturated (default 20)
#   CAP_MB_S=n    capacity device bandwidth limit for `saturate` (default 50; 0 = unthrottled)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
what=${1:-all}
DIR=${DIR:-target/bench-engine}
cargo build --release --example engine_bench >&2
bin=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/examples/engine_bench
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/{print $2}') GiB"
mkdir -p "$DIR"
# The device files go on any exit (a failure or Ctrl-C too).
trap 'rm -f "$DIR"/fast.img "$DIR"/capacity.img' EXIT
echo "devices: files in $DIR on $(df -T "$DIR" | awk 'NR==2{print $1" ("$2")"}'), O_DIRECT"
run() { echo "== $1"; "$bin" "$@"; }
case $what in
    qd32) run qd32 "$DIR" "${ROUNDS:-3}" ;;
    saturate) run saturate "$DIR" "${SECS:-20}" "${CAP_MB_S:-50}" ;;
    hotset) run hotset "$DIR" ;;
    index-ram) run index-ram "$DIR" ;;
    all)
        run qd32 "$DIR" "${ROUNDS:-3}"
        run saturate "$DIR" "${SECS:-20}" "${CAP_MB_S:-50}"
        run hotset "$DIR"
        run index-ram "$DIR"
        ;;
    *) echo "usage: bench/engine.sh [qd32|saturate|hotset|index-ram|all]" >&2; exit 2 ;;
esac
