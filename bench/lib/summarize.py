#!/usr/bin/env python3
"""Prints the figures of the `strata bench` reproductions from their report.json files.

usage: summarize.py tier OUT   (bench/tier-vs-capacity.sh)
       summarize.py nand OUT   (bench/nand-vs-optane.sh)
"""
import json
import statistics
import sys


def load(out, name):
    with open(f"{out}/{name}/report.json") as f:
        return json.load(f)


def side(report):
    return report["targets"][0]


def prep_s(report):
    return side(report)["steps"][0]["measured_s"]


def pct(share):
    """A service-level share as a percentage; a dash for a step that measured no I/O."""
    return f"{'-':>7}" if share is None else f"{share * 100:>6.1f}%"


def steps_table(label, report):
    t = side(report)
    print(f"  {label}: step, target IOPS, delivered IOPS, MB/s, mean ms, p99 ms, write p99 ms, <=2 ms, <=10 ms")
    for s in t["steps"]:
        lat = s["latency_us"] or {}
        w = s["write_latency_us"] or {}
        sl = {x["within_ms"]: x["share"] for x in s["service_levels"] if x["share"] is not None}
        target = f"{s['target_iops']:.0f}" if s["target_iops"] else "-"
        print(f"    {s['name']:>5} {target:>8} {s['iops']:>9.0f} {s['bytes_per_s'] / 1e6:>7.1f}"
              f" {lat.get('mean', 0) / 1e3:>7.2f} {lat.get('p99', 0) / 1e3:>8.2f} {w.get('p99', 0) / 1e3:>8.2f}"
              f" {pct(sl.get(2))} {pct(sl.get(10))}")
    c = t.get("curve_check")
    if c:
        print(f"    curve goal: {'holds' if c['holds'] else 'does not hold'}")
        for f in c["findings"]:
            print(f"      {f}")
    if t.get("stopped_early"):
        print(f"    stopped early: {t['stopped_early']}")


def max_iops(report):
    return side(report)["steps"][0]["iops"]


def destage(report):
    """Destage figures over the curve's samples where the log was above its low mark."""
    st = side(report).get("strata")
    if not st or not st["samples"]:
        return None
    busy = [s for s in st["samples"] if s["log_fill_ratio"] >= s["fill_ratio_low"]]
    rates = [s["destage_rate_bytes_per_s"] / 1e6 for s in busy] or [0.0]
    return {
        "samples": len(st["samples"]),
        "above_low": len(busy),
        "destage_median": statistics.median(rates),
        "destage_p90": sorted(rates)[int(0.9 * (len(rates) - 1))],
        "fill_max": max(s["log_fill_ratio"] for s in st["samples"]),
        "throttled_share": sum(s["admission_throttled"] for s in st["samples"]) / len(st["samples"]),
        "capacity_write_median": statistics.median([s["capacity_write_bytes_per_s"] / 1e6 for s in busy] or [0.0]),
        "emulated": st["emulated_devices"],
    }


def print_destage(label, d):
    if not d:
        print(f"  {label}: no daemon time series")
        return
    print(f"  {label}: {d['samples']} samples, {d['above_low']} above the low mark; capacity writes (destage"
          f" rate) median {d['capacity_write_median']:.1f} MB/s; destager speed while busy median"
          f" {d['destage_median']:.1f} MB/s, p90 {d['destage_p90']:.1f} MB/s; max fill {d['fill_max']:.2f};"
          f" admission throttled in {d['throttled_share'] * 100:.0f}% of samples")
    for e in d["emulated"]:
        print(f"    device {e}")


def tier(out):
    sp, rp = load(out, "strata-prep"), load(out, "raw-prep")
    sc, rc = load(out, "strata-curve"), load(out, "raw-curve")
    print("== prep (write the volume end to end once, 256 KiB)")
    print(f"  strata: {prep_s(sp):.1f} s; capacity alone: {prep_s(rp):.1f} s;"
          f" ratio capacity-alone / strata: {prep_s(rp) / prep_s(sp):.2f}")
    print("== 70/30 32 KiB curve")
    print(f"  max IOPS strata {max_iops(sc):.0f}, capacity alone {max_iops(rc):.0f},"
          f" ratio strata / capacity-alone: {max_iops(sc) / max(max_iops(rc), 1e-9):.2f}")
    steps_table("strata", sc)
    steps_table("capacity alone", rc)
    print_destage("strata", destage(sc))


def nand(out):
    ap, bp = load(out, "nand-prep"), load(out, "optane-prep")
    ac, bc = load(out, "nand-curve"), load(out, "optane-curve")
    print("== prep (write the volume end to end once, 256 KiB)")
    print(f"  nand-a: {prep_s(ap):.1f} s; optane-b: {prep_s(bp):.1f} s; ratio nand / optane: {prep_s(ap) / prep_s(bp):.2f}")
    print("== 70/30 32 KiB curve")
    print(f"  max IOPS nand-a {max_iops(ac):.0f}, optane-b {max_iops(bc):.0f},"
          f" ratio optane / nand: {max_iops(bc) / max(max_iops(ac), 1e-9):.2f}")
    steps_table("nand-a", ac)
    steps_table("optane-b", bc)
    da, db = destage(ac), destage(bc)
    print_destage("nand-a", da)
    print_destage("optane-b", db)
    if da and db and da["capacity_write_median"] > 0:
        print(f"  destage rate (capacity writes above the low mark) median ratio optane / nand:"
              f" {db['capacity_write_median'] / da['capacity_write_median']:.2f}")


if __name__ == "__main__":
    {"tier": tier, "nand": nand}[sys.argv[1]](sys.argv[2])
