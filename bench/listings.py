#!/usr/bin/env python3
"""Pages that show many views at once, timed against a real daemon as the views pile up.

  snaps: one 1 GiB volume, 2,560 random 4 KiB blocks written (10 MiB) through qemu-io, then
         snapshots taken up to each mark (MARKS, default 250,500,1000); at each mark, timed:
         GET /api/v1/volumes/v/snapshots, GET /api/v1/snapshots, GET /metrics (first scrape,
         then the best of three: later scrapes may reuse space counts, see space_cache.rs),
         GET /api/v1/volumes/v.
  vols:  1 MiB volumes created up to each mark (MARKS, default 1024,4096); at each mark,
         timed: GET /api/v1/volumes (first, then best of three), GET /metrics, and
         GET /api/v1/volumes/NAME of the last volume (best of twenty).

Each binary given runs the same sequence on a daemon of its own, one after the other; the
table shows each one's seconds and, from the second binary on, the ratio against the first
(the baseline, measured in the same run). Also printed: the sum of the snapshots' shared
bytes, which must be the same for every binary.

  bench/listings.py snaps BASELINE_STRATA [OTHER_STRATA...]
  bench/listings.py vols BASELINE_STRATA [OTHER_STRATA...]

Settings (environment): MARKS, HTTP_PORT (21010), NBD_PORT (21011), BENCH_DIR (/var/tmp).
"""
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

HTTP_PORT = int(os.environ.get("HTTP_PORT", "21010"))
NBD_PORT = int(os.environ.get("NBD_PORT", "21011"))
BASE = f"http://127.0.0.1:{HTTP_PORT}"


def req(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(BASE + path, data=data, method=method,
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=600) as resp:
        return resp.read()


def timed(path, reps=3):
    best, body = None, None
    for _ in range(reps):
        t0 = time.perf_counter()
        body = req("GET", path)
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    return best, body


def snaps(marks):
    rows = []
    req("POST", "/api/v1/volumes", {"name": "v", "size_bytes": 1 << 30})
    rng = random.Random(7)
    cmds = []
    for b in rng.sample(range((1 << 30) // 4096), 2560):
        cmds += ["-c", f"write -P {b % 251} {b * 4096} 4k"]
    subprocess.run(["qemu-io", "-f", "raw", *cmds, f"nbd://127.0.0.1:{NBD_PORT}/v"],
                   check=True, stdout=subprocess.DEVNULL)
    made = 0
    for m in marks:
        while made < m:
            made += 1
            req("POST", "/api/v1/volumes/v/snapshots", {"name": f"s{made}"})
        t_list, body = timed("/api/v1/volumes/v/snapshots")
        t_all, _ = timed("/api/v1/snapshots")
        t_met1, _ = timed("/metrics", reps=1)
        t_met, _ = timed("/metrics")
        t_vol, _ = timed("/api/v1/volumes/v")
        shared = sum(s["space"]["shared_fast_bytes"] + s["space"]["shared_capacity_bytes"]
                     for s in json.loads(body)["snapshots"])
        rows.append((f"{made} snapshots", {
            "snapshot list (volume)": t_list, "snapshot list (all)": t_all,
            "/metrics, first": t_met1, "/metrics, best": t_met, "volume info": t_vol,
        }, shared))
    return rows


def vols(marks):
    rows = []
    made = 0
    for m in marks:
        while made < m:
            req("POST", "/api/v1/volumes", {"name": f"v{made:05}", "size_bytes": 1 << 20})
            made += 1
        t_list1, _ = timed("/api/v1/volumes", reps=1)
        t_list, _ = timed("/api/v1/volumes")
        t_met, _ = timed("/metrics")
        t_one, _ = timed(f"/api/v1/volumes/v{made - 1:05}", reps=20)
        rows.append((f"{made} volumes", {
            "volume list, first": t_list1, "volume list, best": t_list,
            "/metrics, best": t_met, "volume info": t_one,
        }, None))
    return rows


def run(binary, mode, marks):
    work = tempfile.mkdtemp(prefix="strata-listings-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
    out = open(f"{work}/out", "w")
    err = open(f"{work}/err", "w")
    p = subprocess.Popen([binary, "serve", "--data-dir", f"{work}/data", "--fast-size", "512M",
                          "--capacity-size", "4G", "--nbd-listen", f"127.0.0.1:{NBD_PORT}",
                          "--http-listen", f"127.0.0.1:{HTTP_PORT}",
                          "--default-volume-size", "0"], stdout=out, stderr=err)
    try:
        for _ in range(600):
            if "strata: ready" in open(f"{work}/out").read():
                break
            if p.poll() is not None:
                sys.exit(f"{binary} exited: see {work}/err")
            time.sleep(0.1)
        else:
            sys.exit(f"{binary} not ready after 60 s")
        return snaps(marks) if mode == "snaps" else vols(marks)
    finally:
        p.terminate()
        p.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("snaps", "vols"):
        sys.exit(__doc__)
    mode, binaries = sys.argv[1], sys.argv[2:]
    default = "250,500,1000" if mode == "snaps" else "1024,4096"
    marks = [int(x) for x in os.environ.get("MARKS", default).split(",")]
    print(f"machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"kernel {platform.release()}")
    results = []
    for b in binaries:
        print(f"== {b}", flush=True)
        results.append(run(b, mode, marks))
    for i, (mark, _, _) in enumerate(results[0]):
        print(f"\n{mark}")
        for what in results[0][i][1]:
            base = results[0][i][1][what]
            cells = [f"{r[i][1][what]:8.3f} s" for r in results]
            ratios = [f"x{r[i][1][what] / base:.3f}" for r in results[1:] if base > 0]
            print(f"  {what:<24}" + "  ".join(cells) + ("   " + " ".join(ratios) if ratios else ""))
        if results[0][i][2] is not None:
            print("  sum of snapshots' shared bytes: " + " ".join(str(r[i][2]) for r in results))


if __name__ == "__main__":
    main()
