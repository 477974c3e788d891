#!/usr/bin/env python3
"""The best fast-tier read hit ratio any online cache could reach on bench/tiering.sh's workload.

bench/tiering.sh compares run A (read cache and promotion on) with run B (off) on a zipfian
70/30 random read/write load. Both runs are bound by the slowed capacity device, so their IOPS
scale with 1 / (read miss ratio), and A/B >= 3 needs A to miss at most a third as often as B.
This script asks how far any cache can go on the very access sequence fio generates: it has fio
write that sequence (ioengine=null, write_iolog: fio's zipf picks the same offsets for every
seed, so this is what the benchmark's runs issue), then replays it through caches of the fast
tier's size:

  static ideal   the hottest blocks by their true frequency (what the tiering bench calls ideal)
  LRU (all)      every block read or written enters; least recently used leaves
  W-TinyLFU      a 1% LRU window in front of a main LRU that admits a block only when it was
                 accessed more often than the block it would evict (counts halve every 10
                 cache sizes of accesses): the frequency-aware policy the literature favours
  LRU (writes)   only written blocks enter: a write buffer kept as an LRU, B's best case

Hit ratios count reads after a warm-up of WARM accesses. With B's measured hit ratio (--b-hit)
it prints the A/B ceiling: B's miss ratio over the best online policy's.

Usage: bench/tiering-bound.py [--theta 1.2] [--volume-mib 1024] [--fast-blocks 64512]
                              [--accesses 1800000] [--warm 600000] [--b-hit 0.887]
"""
import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter, OrderedDict


def trace(theta, volume_mib, accesses):
    """(is_read, block) pairs of fio's randrw 70/30 zipf sequence over the volume."""
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "iolog")
        io_mib = accesses * 4 // 1024 + 1
        subprocess.run(
            ["fio", "--name=trace", "--ioengine=null", f"--size={volume_mib}M",
             f"--io_size={io_mib}M", "--filename=/dev/null", "--rw=randrw", "--rwmixread=70",
             "--bs=4k", f"--random_distribution=zipf:{theta}", f"--write_iolog={log}",
             "--output=/dev/null"],
            check=True)
        ops = []
        with open(log) as f:
            for line in f:
                p = line.split()
                if len(p) == 5 and p[2] in ("read", "write"):
                    ops.append((p[2] == "read", int(p[3]) // 4096))
        return ops[:accesses]


class Hits:
    def __init__(self, warm):
        self.warm, self.hit, self.miss = warm, 0, 0

    def count(self, i, is_read, hit):
        if is_read and i >= self.warm:
            if hit:
                self.hit += 1
            else:
                self.miss += 1

    def ratio(self):
        return self.hit / max(1, self.hit + self.miss)


def lru(ops, size, warm, admit_reads=True):
    cache, h = OrderedDict(), Hits(warm)
    for i, (is_read, b) in enumerate(ops):
        hit = b in cache
        h.count(i, is_read, hit)
        if hit:
            cache.move_to_end(b)
        elif admit_reads or not is_read:
            cache[b] = None
            if len(cache) > size:
                cache.popitem(last=False)
    return h.ratio()


def tinylfu(ops, size, warm):
    window_size = max(1, size // 100)
    main_size = size - window_size
    window, main, freq, h = OrderedDict(), OrderedDict(), Counter(), Hits(warm)
    decay = 10 * size
    for i, (is_read, b) in enumerate(ops):
        freq[b] += 1
        if i % decay == decay - 1:
            freq = Counter({k: v // 2 for k, v in freq.items() if v > 1})
        if b in window:
            h.count(i, is_read, True)
            window.move_to_end(b)
            continue
        if b in main:
            h.count(i, is_read, True)
            main.move_to_end(b)
            continue
        h.count(i, is_read, False)
        window[b] = None
        if len(window) > window_size:
            cand, _ = window.popitem(last=False)
            if len(main) < main_size:
                main[cand] = None
            else:
                victim = next(iter(main))
                if freq[cand] > freq[victim]:
                    main.popitem(last=False)
                    main[cand] = None
    return h.ratio()


def static_ideal(ops, size, warm):
    top = {b for b, _ in Counter(b for _, b in ops).most_common(size)}
    h = Hits(warm)
    for i, (is_read, b) in enumerate(ops):
        h.count(i, is_read, b in top)
    return h.ratio()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--theta", type=float, default=1.2)
    ap.add_argument("--volume-mib", type=int, default=1024)
    ap.add_argument("--fast-blocks", type=int, default=64512,
                    help="blocks of the fast tier's log area (tiering.sh: 252 MiB)")
    ap.add_argument("--accesses", type=int, default=1_800_000)
    ap.add_argument("--warm", type=int, default=600_000)
    ap.add_argument("--b-hit", type=float, help="run B's measured fast-tier read hit ratio")
    a = ap.parse_args()
    ops = trace(a.theta, a.volume_mib, a.accesses)
    if len(ops) <= a.warm:
        sys.exit(f"fio gave only {len(ops)} accesses")
    k, w = a.fast_blocks, a.warm
    print(f"zipf {a.theta}, volume {a.volume_mib} MiB, fast tier {k} blocks, "
          f"{len(ops)} accesses (70% reads), hit ratios over reads after the first {w}")
    results = [
        ("static ideal (hottest blocks, known in advance)", static_ideal(ops, k, w)),
        ("LRU, every block read or written enters", lru(ops, k, w)),
        ("W-TinyLFU, frequency-gated admission", tinylfu(ops, k, w)),
        ("LRU, written blocks only (write buffer)", lru(ops, k, w, admit_reads=False)),
    ]
    for name, r in results:
        print(f"  {name:<50} {r:.3f}")
    best = max(r for _, r in results[1:3])
    print(f"best online policy: {best:.3f}")
    if a.b_hit is not None:
        print(f"A/B ceiling with B at {a.b_hit:.3f}: (1 - {a.b_hit:.3f}) / (1 - {best:.3f}) = "
              f"{(1 - a.b_hit) / (1 - best):.2f}; A/B >= 3 needs A at "
              f"{1 - (1 - a.b_hit) / 3:.3f}")


if __name__ == "__main__":
    main()
