//! The tiering part of `/metrics`: per volume, where its reads were served, promotions,
//! evictions, time waited for its limits, its limits, and how long its data stayed on the fast
//! tier before moving (a histogram); for the group, the read cache's size and budget.
use strata_engine::{DiskGroup, EngineStats, Mode, Policy, VolumeFigures};

use crate::prom::{Exposition, Type};

pub struct TieringRow {
    pub name: String,
    pub policy: Policy,
    pub figures: VolumeFigures,
}

/// The policy and figures of every named volume (a volume deleted meanwhile is left out).
pub fn rows(group: &DiskGroup, names: &[String]) -> Vec<TieringRow> {
    names
        .iter()
        .filter_map(|name| {
            Some(TieringRow {
                policy: group.policy(name).ok()?,
                figures: group.volume_figures(name).ok()?,
                name: name.clone(),
            })
        })
        .collect()
}

pub fn mode_label(mode: Mode) -> &'static str {
    match mode {
        Mode::Cache => "cache",
        Mode::Tier => "tier",
    }
}

type Counter = (&'static str, &'static str, fn(&TieringRow) -> f64);

pub fn render_volumes(e: &mut Exposition, rows: &[TieringRow]) {
    let name = "strata_volume_fast_read_hit_ratio";
    e.family(name, Type::Gauge, "Share of the volume's reads of stored data served by the fast tier (the log or cached copies) since start; absent before any.");
    for r in rows {
        if let Some(ratio) = r.figures.fast_read_hit_ratio {
            e.sample(name, &[("volume", &r.name)], ratio);
        }
    }
    let name = "strata_volume_read_source_bytes_total";
    e.family(name, Type::Counter, "The volume's reads of stored data by where they were served: the write log (fast), a cached copy on the fast tier (cache), or the capacity tier.");
    for r in rows {
        let f = &r.figures;
        for (source, bytes) in [("fast", f.read_fast_bytes), ("cache", f.read_cached_bytes), ("capacity", f.read_capacity_bytes)] {
            e.sample(name, &[("volume", &r.name), ("source", source)], bytes as f64);
        }
    }
    let counters: [Counter; 5] = [
        ("strata_volume_promoted_bytes_total", "Bytes of the volume copied from the capacity tier into the read cache.", |r| r.figures.promoted_bytes as f64),
        ("strata_volume_kept_bytes_total", "Bytes of the volume read while in the write log whose clean copy stayed in the read cache when they were destaged.", |r| r.figures.kept_bytes as f64),
        ("strata_volume_bypassed_bytes_total", "Bytes of the volume's sequential writes that went straight to the capacity tier (policy sequential_write_cutoff_bytes).", |r| r.figures.bypassed_bytes as f64),
        ("strata_volume_evicted_bytes_total", "Bytes of the volume's cached copies dropped from the read cache.", |r| r.figures.evicted_bytes as f64),
        ("strata_volume_limited_wait_seconds_total", "Time the volume's requests waited for its IOPS and bandwidth limits.", |r| r.figures.limited_wait_ms as f64 / 1e3),
    ];
    let gauges: [Counter; 2] = [
        ("strata_volume_iops_limit", "Requests per second the volume's policy allows (0: no limit).", |r| r.policy.iops_limit as f64),
        ("strata_volume_bandwidth_limit_bytes_per_second", "Bytes per second the volume's policy allows (0: no limit).", |r| r.policy.bandwidth_limit_bytes_per_s as f64),
    ];
    for (kind, families) in [(Type::Counter, &counters[..]), (Type::Gauge, &gauges[..])] {
        for (name, help, get) in families {
            e.family(name, kind, help);
            for r in rows {
                e.sample(name, &[("volume", &r.name)], get(r));
            }
        }
    }
    render_residency(e, rows);
}

/// Bucket i of the engine's residency counts blocks that moved after less than 2^i seconds;
/// the last counts the rest, so it is the +Inf bucket.
fn render_residency(e: &mut Exposition, rows: &[TieringRow]) {
    let name = "strata_volume_fast_residency_seconds";
    e.family(name, Type::Histogram, "How long the volume's 4 KiB blocks stayed on the fast tier before they moved to the capacity tier.");
    for r in rows {
        let buckets = &r.figures.residency_seconds_log2;
        let bounds: Vec<f64> = (0..buckets.len().saturating_sub(1))
            .map(|i| (1u64 << i) as f64)
            .collect();
        let mut acc = 0;
        let cumulative: Vec<u64> = buckets
            .iter()
            .map(|n| {
                acc += n;
                acc
            })
            .collect();
        e.histogram(name, &[("volume", &r.name)], &bounds, &cumulative, r.figures.residency_seconds_sum);
    }
}

pub fn render_group(e: &mut Exposition, s: &EngineStats) {
    let gauges: [(&str, &str, u64); 3] = [
        ("strata_read_cache_bytes", "Bytes of clean copies the read cache holds on the fast tier.", s.read_cache_bytes),
        ("strata_read_cache_log_bytes", "Write-log space the read cache's records hold: its copies, and old places of copies written again or dropped until the log tail passes them.", s.read_cache_log_bytes),
        ("strata_read_cache_budget_bytes", "Write-log space the read cache may use (--read-cache).", s.read_cache_budget_bytes),
    ];
    for (name, help, v) in gauges {
        e.single(name, Type::Gauge, help, v as f64);
    }
    let counters: [(&str, &str, u64); 5] = [
        ("strata_promoted_bytes_total", "Bytes copied from the capacity tier into the read cache.", s.promoted_bytes_total),
        ("strata_kept_bytes_total", "Bytes read while in the write log whose clean copy stayed in the read cache when they were destaged.", s.kept_bytes_total),
        ("strata_evicted_bytes_total", "Bytes of cached copies dropped from the read cache.", s.evicted_bytes_total),
        ("strata_promotions_refused_total", "Promotions skipped because the read cache (or the log) had no room at the time.", s.promotions_refused_total),
        ("strata_promotions_skipped_total", "Promotions skipped because the write log's queue was full (the log was busy).", s.promotions_skipped_total),
    ];
    for (name, help, v) in counters {
        e.single(name, Type::Counter, help, v as f64);
    }
}
