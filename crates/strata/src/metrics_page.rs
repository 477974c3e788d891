//! The `/metrics` page: every figure of the node in the Prometheus text format, rendered
//! fresh from a snapshot on each scrape. Names follow Prometheus conventions: base units
//! (bytes, seconds), `_total` on counters, latency histograms in seconds.
use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use strata_device::{DeviceStats, IO_SIZE_BUCKETS};
use strata_engine::{EngineStats, SpaceReport};

use crate::api::{blocking, ApiError, AppState};
use crate::api_scrub::{ScrubReportJson, ScrubStatusJson};
use crate::api_observe::{device_list, fast_read_hit_ratio, DeviceJson};
use crate::metrics::{IoSnapshot, LATENCY_BOUNDS_US};
use crate::prom::{Exposition, Type};
use crate::wear::WearJson;

/// A metric family rendered from each item: name, help, and how to read its value.
type Family<T, V> = (&'static str, &'static str, fn(&T) -> V);

pub async fn metrics(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let text = blocking(move || Ok::<_, ApiError>(render_metrics(&state))).await?;
    Ok(([(header::CONTENT_TYPE, crate::prom::CONTENT_TYPE)], text).into_response())
}

/// The whole `/metrics` page (blocking: reads engine state).
pub fn render_metrics(state: &AppState) -> String {
    let g = state.registry.group();
    let stats = g.stats();
    let mut volumes = g.volumes();
    volumes.sort_by(|a, b| a.name.cmp(&b.name));
    let snapshots = g.snapshots(None).unwrap_or_default();
    let live: Vec<_> = volumes
        .iter()
        .map(|v| v.id)
        .chain(snapshots.iter().map(|s| s.id))
        .collect();
    state.space.retain(&live);
    // Every view at once: a volume and its snapshots are counted in one walk.
    let mut spaces = state.space.get_many(g, &live).into_iter();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for s in &snapshots {
        *counts.entry(s.volume.as_str()).or_default() += 1;
    }
    let vols: Vec<VolumeRow> = volumes
        .iter()
        .map(|v| VolumeRow {
            name: v.name.clone(),
            size_bytes: v.size_bytes,
            connections: state.registry.connections(v.id),
            io: state.registry.volume_io(v.id).snapshot(),
            space: spaces.next().unwrap_or_default(),
            snapshots: counts.get(v.name.as_str()).copied().unwrap_or(0),
        })
        .collect();
    let snaps: Vec<SnapshotRow> = snapshots
        .iter()
        .map(|s| SnapshotRow {
            connections: state.registry.connections(s.id),
            space: spaces.next().unwrap_or_default(),
            volume: s.volume.clone(),
            name: s.name.clone(),
        })
        .collect();
    let devices = device_list(state);
    let names: Vec<String> = volumes.iter().map(|v| v.name.clone()).collect();
    let tiering = crate::metrics_tiering::rows(g, &names);
    let mut e = Exposition::default();
    e.family("strata_build_info", Type::Gauge, "Strata version (always 1).")
        .sample(
            "strata_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))],
            1.0,
        );
    e.single(
        "strata_uptime_seconds",
        Type::Gauge,
        "Seconds since the daemon started.",
        state.started.elapsed().as_secs_f64(),
    );
    e.single(
        "strata_disk_group_up",
        Type::Gauge,
        "1 while the disk group is running, 0 when stopping or failed.",
        if stats.state == "running" { 1.0 } else { 0.0 },
    );
    render_volumes(&mut e, &vols, &tiering);
    crate::metrics_tiering::render_volumes(&mut e, &tiering);
    render_snapshots(&mut e, &snaps);
    render_devices(&mut e, &devices);
    render_engine(&mut e, &stats);
    render_scrub(&mut e, &crate::api_scrub::status_json(g.scrub_status(), &state.scrub));
    crate::metrics_tiering::render_group(&mut e, &stats);
    e.finish()
}

struct VolumeRow {
    name: String,
    size_bytes: u64,
    connections: usize,
    io: IoSnapshot,
    space: SpaceReport,
    snapshots: usize,
}

struct SnapshotRow {
    volume: String,
    name: String,
    connections: usize,
    space: SpaceReport,
}

/// (tier, bytes on it, bytes on it that no other volume or snapshot reads).
fn tiers(s: &SpaceReport) -> [(&'static str, u64, u64); 2] {
    [
        ("fast", s.exclusive_fast_bytes + s.shared_fast_bytes, s.exclusive_fast_bytes),
        ("capacity", s.exclusive_capacity_bytes + s.shared_capacity_bytes, s.exclusive_capacity_bytes),
    ]
}

/// Space and open handles of every snapshot, labelled by volume and snapshot.
fn render_snapshots(e: &mut Exposition, snaps: &[SnapshotRow]) {
    let stored = "strata_snapshot_stored_bytes";
    e.family(stored, Type::Gauge, "Bytes of the snapshot's image held on each tier.");
    for s in snaps {
        for (tier, bytes, _) in tiers(&s.space) {
            e.sample(stored, &[("volume", &s.volume), ("snapshot", &s.name), ("tier", tier)], bytes as f64);
        }
    }
    let exclusive = "strata_snapshot_exclusive_bytes";
    e.family(exclusive, Type::Gauge, "Bytes on each tier only the snapshot holds: deleting it gives them back.");
    for s in snaps {
        for (tier, _, bytes) in tiers(&s.space) {
            e.sample(exclusive, &[("volume", &s.volume), ("snapshot", &s.name), ("tier", tier)], bytes as f64);
        }
    }
    let connections = "strata_snapshot_connections";
    e.family(connections, Type::Gauge, "Open NBD handles on the snapshot's read-only export.");
    for s in snaps {
        e.sample(connections, &[("volume", &s.volume), ("snapshot", &s.name)], s.connections as f64);
    }
}

fn render_volumes(e: &mut Exposition, vols: &[VolumeRow], tiering: &[crate::metrics_tiering::TieringRow]) {
    let counters: [Family<IoSnapshot, u64>; 7] = [
        ("strata_volume_read_operations_total", "Read requests answered, failed ones included.", |s| s.read_ops),
        ("strata_volume_read_bytes_total", "Bytes read by clients (requests that succeeded).", |s| s.read_bytes),
        ("strata_volume_write_operations_total", "Write requests answered, failed ones included.", |s| s.write_ops),
        ("strata_volume_write_bytes_total", "Bytes written by clients (requests that succeeded).", |s| s.write_bytes),
        ("strata_volume_unmap_operations_total", "TRIM and WRITE_ZEROES requests served.", |s| s.unmap_ops),
        ("strata_volume_flush_operations_total", "FLUSH requests served.", |s| s.flush_ops),
        ("strata_volume_request_errors_total", "Requests answered with an error, those the NBD server refused before they reached the volume included.", |s| s.errors),
    ];
    for (name, help, get) in counters {
        e.family(name, Type::Counter, help);
        for v in vols {
            e.sample(name, &[("volume", &v.name)], get(&v.io) as f64);
        }
    }
    e.family("strata_volume_info", Type::Gauge, "A volume and its tiering policy mode (always 1).");
    for t in tiering {
        let mode = crate::metrics_tiering::mode_label(t.policy.mode);
        e.sample("strata_volume_info", &[("volume", &t.name), ("policy", mode)], 1.0);
    }
    e.family("strata_volume_size_bytes", Type::Gauge, "Volume size.");
    for v in vols {
        e.sample("strata_volume_size_bytes", &[("volume", &v.name)], v.size_bytes as f64);
    }
    e.family("strata_volume_stored_bytes", Type::Gauge, "Bytes of the volume's data held on each tier.");
    for v in vols {
        for (tier, bytes, _) in tiers(&v.space) {
            e.sample("strata_volume_stored_bytes", &[("volume", &v.name), ("tier", tier)], bytes as f64);
        }
    }
    let exclusive = "strata_volume_exclusive_bytes";
    e.family(exclusive, Type::Gauge, "Bytes on each tier only the volume holds (the rest it shares with its snapshots, or a clone with its origin).");
    for v in vols {
        for (tier, _, bytes) in tiers(&v.space) {
            e.sample(exclusive, &[("volume", &v.name), ("tier", tier)], bytes as f64);
        }
    }
    e.family("strata_volume_snapshots", Type::Gauge, "Snapshots of the volume.");
    for v in vols {
        e.sample("strata_volume_snapshots", &[("volume", &v.name)], v.snapshots as f64);
    }
    e.family("strata_volume_connections", Type::Gauge, "Open NBD handles on the volume.");
    for v in vols {
        e.sample("strata_volume_connections", &[("volume", &v.name)], v.connections as f64);
    }
    let bounds: Vec<f64> = LATENCY_BOUNDS_US.iter().map(|&us| us as f64 / 1e6).collect();
    let name = "strata_volume_request_duration_seconds";
    e.family(
        name,
        Type::Histogram,
        "Time from a request reaching the volume to its completion (durable, for writes).",
    );
    for v in vols {
        for (op, h) in [("read", &v.io.read_latency), ("write", &v.io.write_latency)] {
            e.histogram(
                name,
                &[("volume", &v.name), ("op", op)],
                &bounds,
                &h.cumulative(),
                h.sum_us as f64 / 1e6,
            );
        }
    }
}

fn render_devices(e: &mut Exposition, devices: &[DeviceJson]) {
    let counters: [Family<DeviceStats, u64>; 9] = [
        ("strata_device_read_bytes_total", "Bytes read, as the device saw them.", |d| d.read_bytes),
        ("strata_device_read_operations_total", "Reads issued to the device.", |d| d.read_ops),
        ("strata_device_written_bytes_total", "Bytes written since start, as the device saw them.", |d| d.write_bytes),
        ("strata_device_write_operations_total", "Writes issued to the device.", |d| d.write_ops),
        ("strata_device_flush_operations_total", "Cache flushes issued to the device.", |d| d.flush_ops),
        ("strata_device_discard_operations_total", "Discards issued to the device.", |d| d.discard_ops),
        ("strata_device_discarded_bytes_total", "Bytes discarded.", |d| d.discard_bytes),
        ("strata_device_errors_total", "Failed device calls (not those refused for want of room).", |d| d.errors),
        ("strata_device_no_room_errors_total", "Device writes refused for want of room on the file system under a device file (ENOSPC, EDQUOT); the device is not at fault.", |d| d.no_room_errors),
    ];
    for (name, help, get) in counters {
        e.family(name, Type::Counter, help);
        for d in devices {
            e.sample(name, &[("device", &d.stats.name), ("tier", d.tier)], get(&d.stats) as f64);
        }
    }
    let name = "strata_device_checksum_errors_total";
    e.family(name, Type::Counter, "Blocks on the device whose checksum failed, on reads and in scrubs (data and metadata copies).");
    for d in devices {
        e.sample(name, &[("device", &d.stats.name), ("tier", d.tier)], d.checksum_errors_total as f64);
    }
    e.family("strata_device_size_bytes", Type::Gauge, "Device size.");
    for d in devices {
        let l = [("device", d.stats.name.as_str()), ("tier", d.tier)];
        e.sample("strata_device_size_bytes", &l, d.stats.size_bytes as f64);
    }
    let name = "strata_device_formatted_size_bytes";
    e.family(name, Type::Gauge, "The part of the device its disk group was formatted on and writes to (less than strata_device_size_bytes on a device grown since); drive writes per day are a share of it.");
    for d in devices {
        let l = [("device", d.stats.name.as_str()), ("tier", d.tier)];
        e.sample(name, &l, d.wear.formatted_size_bytes as f64);
    }
    let bounds: Vec<f64> = (0..IO_SIZE_BUCKETS - 1).map(|i| (1u64 << i) as f64).collect();
    for (name, help, read) in [
        ("strata_device_read_size_bytes", "Sizes of device reads.", true),
        ("strata_device_write_size_bytes", "Sizes of device writes.", false),
    ] {
        e.family(name, Type::Histogram, help);
        for d in devices {
            let (h, sum) = if read {
                (&d.stats.read_sizes, d.stats.read_bytes)
            } else {
                (&d.stats.write_sizes, d.stats.write_bytes)
            };
            let mut acc = 0;
            let cumulative: Vec<u64> = (0..IO_SIZE_BUCKETS)
                .map(|i| {
                    acc += h.buckets.get(i).copied().unwrap_or(0);
                    acc
                })
                .collect();
            let l = [("device", d.stats.name.as_str()), ("tier", d.tier)];
            e.histogram(name, &l, &bounds, &cumulative, sum as f64);
        }
    }
    render_wear(e, devices);
}

fn render_wear(e: &mut Exposition, devices: &[DeviceJson]) {
    // A gauge: after a crash the count restarts from what the last checkpoint saved, so it can
    // go back a little (a counter must not).
    let name = "strata_device_lifetime_written_bytes";
    e.family(name, Type::Gauge, "Bytes the device received from this disk group over its life, as of the last checkpoint plus this run (persisted across restarts; after a crash, writes since the last checkpoint are missing).");
    for d in devices {
        e.sample(name, &[("device", &d.stats.name), ("tier", d.tier)], d.wear.bytes_written_total as f64);
    }
    let gauges: [Family<WearJson, Option<f64>>; 6] = [
        ("strata_device_write_rate_average_bytes_per_second", "Lifetime average write rate.", |w| Some(w.write_bytes_per_s_avg)),
        ("strata_device_drive_writes_per_day", "Drive writes per day at the average rate, of the formatted size (strata_device_formatted_size_bytes).", |w| Some(w.drive_writes_per_day)),
        ("strata_device_endurance_used_ratio", "Share of the rated endurance used (catalog devices only).", |w| w.endurance_used_ratio),
        ("strata_device_warranty_end_timestamp_seconds", "End of the warranty (catalog devices only).", |w| w.warranty_end_unix_s.map(|t| t as f64)),
        ("strata_device_projected_wear_out_timestamp_seconds", "When the rated endurance runs out at the average rate.", |w| w.projected_wear_out_unix_s.map(|t| t as f64)),
        // Absent with the projection off (--wear-projection-after off): 0 would read as "fine".
        ("strata_device_wear_out_before_warranty", "1 when the average rate wears the device out before its warranty ends (rated devices whose wear-out is projected).", |w| w.rated_endurance_bytes.filter(|_| w.projection_after_s.is_some()).map(|_| if w.wears_out_before_warranty { 1.0 } else { 0.0 })),
    ];
    for (name, help, get) in gauges {
        e.family(name, Type::Gauge, help);
        for d in devices {
            if let Some(v) = get(&d.wear) {
                e.sample(name, &[("device", &d.stats.name), ("tier", d.tier)], v);
            }
        }
    }
}

/// The values of `EngineStats::admission`.
const ADMISSION_STATES: [&str; 4] = ["open", "throttled", "measuring", "waiting_for_room"];

fn render_engine(e: &mut Exposition, s: &EngineStats) {
    let gauges: [(&str, &str, f64); 20] = [
        ("strata_log_fill_ratio", "Fill of the write buffer: log space in use besides the read cache's copies, against the log less what the read cache holds; the destage marks apply to it.", s.log_fill_ratio),
        ("strata_log_fill_ratio_low", "Fill below which the destager idles.", s.fill_ratio_low),
        ("strata_log_fill_ratio_high", "Fill above which the destager runs flat out and admission follows it.", s.fill_ratio_high),
        ("strata_log_capacity_bytes", "Size of the write log.", s.log_capacity_bytes as f64),
        ("strata_log_used_bytes", "Bytes of the write log in use: live data, dead data and the read cache's copies (reused only once the log's tail passes them).", s.log_used_bytes as f64),
        ("strata_log_dead_bytes", "Bytes of the write log held by what no reader needs (data overwritten, trimmed or deleted, batch headers): freed as the tail passes, never written to the capacity tier.", s.log_dead_bytes as f64),
        ("strata_destage_rate_bytes_per_second", "Capacity-tier bytes written by the destager per second, averaged over the last seconds (exponentially, 5 s); 0 once nothing has been destaged for 5 s.", s.destage_rate_bytes_per_s),
        ("strata_destage_bandwidth_bytes_per_second", "Log space the destager frees per busy second, smoothed.", s.destage_bandwidth_bytes_per_s),
        ("strata_destage_backlog_bytes", "Live bytes in the log not destaged yet: what the destager still has to write to the capacity tier (dead data is strata_log_dead_bytes).", s.destage_backlog_bytes as f64),
        ("strata_admission_throttled", "1 while admission control holds host writes back: paced to the destage rate, waiting for log room, or above the high mark with no rate measured yet (strata_admission_state says which).", if s.admission_throttled { 1.0 } else { 0.0 }),
        ("strata_fast_tier_resident_bytes", "Bytes reads find on the fast tier: live host data in the write log and the read cache's copies.", s.fast_resident_bytes as f64),
        ("strata_capacity_total_bytes", "Capacity-tier space in segments.", s.capacity_total_bytes as f64),
        ("strata_capacity_used_bytes", "Capacity-tier space in used segments.", s.capacity_used_bytes as f64),
        ("strata_capacity_live_bytes", "Live data on the capacity tier.", s.capacity_live_bytes as f64),
        ("strata_capacity_reserved_bytes", "Capacity-tier space kept free for garbage collection and index flushes: the tier counts as full with this much still free.", s.capacity_reserved_bytes as f64),
        ("strata_capacity_segments_free", "Free capacity segments.", s.segments_free as f64),
        ("strata_capacity_full", "1 when the capacity tier has no free segment.", if s.capacity_full { 1.0 } else { 0.0 }),
        ("strata_capacity_out_of_room", "1 while a capacity device has no room for writes (the file system under a capacity file is full): destaging pauses until one succeeds.", if s.capacity_out_of_room.is_some() { 1.0 } else { 0.0 }),
        ("strata_log_rotating", "1 while the destager rotates a full write log (both tiers full) so that trims and overwrites give space back.", if s.log_rotating { 1.0 } else { 0.0 }),
        ("strata_destager_nice", "Nice value of the destager thread: 19 while it works ahead of need, its own while the log needs room.", s.destager_nice as f64),
    ];
    for (name, help, v) in gauges {
        e.single(name, Type::Gauge, help, v);
    }
    let name = "strata_admission_state";
    e.family(name, Type::Gauge, "1 for how host writes are admitted now: open, throttled (paced to the destage rate), measuring (above the high mark, no rate measured yet since the start) or waiting_for_room (the log has no room for a batch).");
    for state in ADMISSION_STATES {
        e.sample(
            name,
            &[("state", state)],
            if s.admission == state { 1.0 } else { 0.0 },
        );
    }
    let counters: [(&str, &str, u64); 8] = [
        ("strata_destaged_bytes_total", "Bytes moved from the log to the capacity tier.", s.destaged_bytes_total),
        ("strata_gc_segments_cleaned_total", "Capacity segments reclaimed by garbage collection.", s.gc_segments_cleaned_total),
        ("strata_gc_relocated_bytes_total", "Live bytes garbage collection moved.", s.gc_relocated_bytes_total),
        ("strata_hot_kept_bytes_total", "Recently overwritten bytes kept on the fast tier instead of destaged.", s.hot_kept_bytes_total),
        ("strata_log_run_writes_total", "Lone writes that extended a run of the write log instead of taking a header block of their own.", s.log_run_writes_total),
        ("strata_log_rotated_batches_total", "Tail batches of a full write log freed by rotation (their live data written again at the head).", s.log_rotated_batches_total),
        ("strata_metadata_copy_fallbacks_total", "Metadata reads (index pages, segment summaries) served by the second copy because the first was damaged.", s.metadata_copy_fallbacks_total),
        ("strata_checksum_errors_total", "Blocks whose checksum failed on read (both tiers).", s.checksum_errors_total),
    ];
    for (name, help, v) in counters {
        e.single(name, Type::Counter, help, v as f64);
    }
    e.single(
        "strata_index_extents",
        Type::Gauge,
        "Extents in the in-memory index (its size).",
        s.index_runs as f64,
    );
    e.family(
        "strata_read_bytes_total",
        Type::Counter,
        "Host reads by where they were served from: the write log (fast), a read-cache copy on the fast tier (cache), the capacity tier, or unwritten space.",
    );
    for (source, v) in [
        ("fast", s.read_fast_bytes_total),
        ("cache", s.read_cached_bytes_total),
        ("capacity", s.read_capacity_bytes_total),
        ("unwritten", s.read_unwritten_bytes_total),
    ] {
        e.sample("strata_read_bytes_total", &[("source", source)], v as f64);
    }
    e.single(
        "strata_fast_read_hit_ratio",
        Type::Gauge,
        "Fast-tier hit ratio: share of stored-data reads served by the fast tier (the log or the read cache's copies) since start (0 before any read).",
        fast_read_hit_ratio(s).unwrap_or(0.0),
    );
}

/// The running scrub's progress and what the last one found (its gauges are absent before the
/// first scrub ends).
fn render_scrub(e: &mut Exposition, s: &ScrubStatusJson) {
    let p = &s.progress;
    e.single("strata_scrub_running", Type::Gauge, "1 while a scrub (background or asked for) runs.", if p.running { 1.0 } else { 0.0 });
    e.single("strata_scrub_progress_bytes", Type::Gauge, "Bytes the running scrub has read (the last one's, once it ended).", p.progress_bytes as f64);
    e.single("strata_scrub_total_bytes", Type::Gauge, "Estimate of the bytes that scrub reads in all.", p.total_bytes as f64);
    e.single(
        "strata_scrub_background_interval_seconds",
        Type::Gauge,
        "Time between background scrubs (0: off).",
        p.background_interval_s.unwrap_or(0) as f64,
    );
    let last: [Family<ScrubReportJson, f64>; 6] = [
        ("strata_scrub_last_finished_timestamp_seconds", "When the last scrub ended.", |r| r.finished_unix_s as f64),
        ("strata_scrub_last_duration_seconds", "How long the last scrub took.", |r| r.finished_unix_s.saturating_sub(r.started_unix_s) as f64),
        ("strata_scrub_last_verified_bytes", "Data bytes the last scrub read and checked.", |r| r.data_bytes_verified as f64),
        ("strata_scrub_last_bad_blocks", "Bad data blocks the last scrub found (reads of them fail).", |r| r.bad_blocks_total as f64),
        ("strata_scrub_last_metadata_repaired", "Metadata copies the last scrub rewrote from the good copy.", |r| r.metadata_repaired.len() as f64),
        ("strata_scrub_last_metadata_damaged", "Metadata the last scrub found damaged beyond repair.", |r| r.metadata_damaged.len() as f64),
    ];
    for (name, help, get) in last {
        e.family(name, Type::Gauge, help);
        if let Some(r) = &s.last {
            e.sample(name, &[], get(r));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str, rated_endurance_bytes: Option<f64>) -> DeviceJson {
        DeviceJson {
            tier: "capacity",
            disk_group: "dg0",
            stats: DeviceStats {
                name: name.into(),
                size_bytes: 1 << 30,
                ..Default::default()
            },
            wear: WearJson {
                formatted_size_bytes: 1 << 30,
                bytes_written_total: 1 << 20,
                first_use_unix_s: 1_700_000_000,
                write_bytes_per_s_avg: 12.0,
                write_bytes_per_s_recent: None,
                drive_writes_per_day: 0.001,
                model: rated_endurance_bytes.map(|_| "sas-800g-mu-3dwpd".into()),
                rated_endurance_bytes,
                endurance_used_ratio: rated_endurance_bytes.map(|e| (1u64 << 20) as f64 / e),
                warranty_end_unix_s: rated_endurance_bytes.map(|_| 1_857_680_000),
                projected_wear_out_unix_s: None,
                wears_out_before_warranty: false,
                projection_after_s: Some(86_400),
            },
            checksum_errors_total: 0,
        }
    }

    #[test]
    fn endurance_families_have_rated_devices_only() {
        let mut e = Exposition::default();
        render_wear(
            &mut e,
            &[device("rated", Some(4.38e15)), device("disk", None)],
        );
        let text = e.finish();
        for family in [
            "strata_device_endurance_used_ratio",
            "strata_device_warranty_end_timestamp_seconds",
            "strata_device_wear_out_before_warranty",
        ] {
            let samples: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with(&format!("{family}{{")))
                .collect();
            assert_eq!(samples.len(), 1, "{family}: {samples:?}");
            assert!(
                samples[0].contains("device=\"rated\""),
                "{family}: {samples:?}"
            );
        }
        // The rates are there for every device.
        let dwpd = text
            .lines()
            .filter(|l| l.starts_with("strata_device_drive_writes_per_day{"))
            .count();
        assert_eq!(dwpd, 2, "{text}");
    }

    /// With `--wear-projection-after off` nothing is projected: no wear-out date, and no
    /// "wears out before warranty" 0 that would read as a verdict.
    #[test]
    fn a_device_whose_projection_is_off_has_no_wear_out_verdict() {
        let mut off = device("off", Some(4.38e15));
        off.wear.projection_after_s = None;
        let mut e = Exposition::default();
        render_wear(&mut e, &[off, device("rated", Some(4.38e15))]);
        let text = e.finish();
        let verdicts: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("strata_device_wear_out_before_warranty{"))
            .collect();
        assert_eq!(verdicts.len(), 1, "{verdicts:?}");
        assert!(verdicts[0].contains("device=\"rated\""), "{verdicts:?}");
        let used = "strata_device_endurance_used_ratio{device=\"off\"";
        assert!(
            text.contains(used),
            "the endurance used is still shown:\n{text}"
        );
    }
}
