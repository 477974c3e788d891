# Helpers shared by the `strata bench` reproduction scripts (sourced, not run).
# Every process started here is recorded and stopped by its PID on exit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
STARTED_PIDS=()
SCRATCH=() # the daemons' directories (and other device files), removed on exit
cleanup() {
    local pid
    for pid in "${STARTED_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${STARTED_PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "${SCRATCH[@]}"
}
trap cleanup EXIT

# target_dir: where cargo puts its builds (target/, or CARGO_TARGET_DIR when that is set).
target_dir() {
    cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])'
}

# strata_binary: sets STRATA to $STRATA_BIN when that is set (refused unless executable), or
# builds this checkout's release binary and sets STRATA to it.
strata_binary() {
    if [[ -n "${STRATA_BIN:-}" ]]; then
        [[ -x "$STRATA_BIN" ]] || { echo "STRATA_BIN=$STRATA_BIN is not an executable" >&2; exit 1; }
        STRATA=$STRATA_BIN
    else
        cargo build --release -p strata --bin strata >&2
        STRATA=$(target_dir)/release/strata
    fi
}

build() {
    cargo build --release -p strata --bin strata >&2
    cargo build --release -p strata-bench --example raw_nbd >&2
    STRATA=$(target_dir)/release/strata
    RAW_NBD=$(target_dir)/release/examples/raw_nbd
}

machine() {
    echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/{print $2}') GiB"
    echo "devices: files in $1 on $(df -T "$1" | awk 'NR==2{print $1" ("$2")"}'), O_DIRECT"
}

# wait_line FILE PATTERN [PID]: waits up to 60 s for a line matching PATTERN in FILE; with PID,
# fails at once when that process has exited, showing the end of its stderr (FILE's directory).
wait_line() {
    local i
    for i in $(seq 600); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        if [[ -n "${3:-}" ]] && ! kill -0 "$3" 2>/dev/null; then
            tail -5 "$(dirname "$1")/stderr" >&2
            echo "exited before '$2' appeared in $1" >&2
            return 1
        fi
        sleep 0.1
    done
    echo "timed out waiting for '$2' in $1" >&2
    return 1
}

# start_strata DIR ARGS...: starts a daemon on kernel-chosen loopback ports; sets NBD and API.
start_strata() {
    local dir=$1
    shift
    rm -rf "$dir"
    mkdir -p "$dir"
    SCRATCH+=("$dir")
    "$STRATA" serve --data-dir "$dir/data" --nbd-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 "$@" \
        >"$dir/stdout" 2>"$dir/stderr" &
    STARTED_PIDS+=($!)
    STRATA_PID=$!
    wait_line "$dir/stdout" "strata: ready" "$STRATA_PID"
    NBD=nbd://$(sed -n 's/^strata: NBD listening on //p' "$dir/stdout")
    API=$(sed -n 's/^strata: HTTP API listening on //p' "$dir/stdout")
}

# start_raw DIR SIZE_MIB EMULATE: serves one emulated device file with no tier; sets RAW_URI.
start_raw() {
    local dir=$1
    rm -rf "$dir"
    mkdir -p "$dir"
    SCRATCH+=("$dir")
    "$RAW_NBD" --device "$dir/capacity.img" --size "$2" --listen 127.0.0.1:0 --emulate "$3" \
        >"$dir/stdout" 2>"$dir/stderr" &
    STARTED_PIDS+=($!)
    RAW_PID=$!
    wait_line "$dir/stdout" "raw_nbd: ready" "$RAW_PID"
    RAW_URI=$(sed -n 's/^raw_nbd: ready //p' "$dir/stdout")
}

stop_pid() {
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}
