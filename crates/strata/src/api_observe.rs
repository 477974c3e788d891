//! What the admin port shows about a running node: the read-only JSON resources (node, disk
//! groups with their scrub state, devices, history, and the whole-node status), the OpenAPI document, `/metrics`
//! (rendered in `metrics_page.rs`) and the dashboard at `/`.
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use strata_device::DeviceStats;
use strata_engine::EngineStats;

use crate::api::{all_volumes, blocking, export_base, ApiError, AppState, VolumeJson};
use crate::api_scrub::ScrubSummaryJson;
use crate::history::Sample;
use crate::metrics::IoTotalsJson;
use crate::routes::Routes;
use crate::wear::{self, WearJson};

const DASHBOARD_HTML: &str = include_str!("dashboard.html");
pub const OPENAPI_JSON: &str = include_str!("../../../docs/openapi.json");
/// Window of the "recent" host write rate.
const RECENT_WORKLOAD_WINDOW: Duration = Duration::from_secs(60);
/// The one disk group a node has so far.
pub const DISK_GROUP_ID: &str = "dg0";
/// Capacity-tier use above which `warnings` speaks up.
const CAPACITY_WARN_RATIO: f64 = 0.9;

pub fn routes() -> Routes<Arc<AppState>> {
    Routes::new()
        .get("/", dashboard)
        .get("/metrics", crate::metrics_page::metrics)
        .get("/api/v1/status", status)
        .get("/api/v1/node", node)
        .get("/api/v1/diskgroups", disk_groups)
        .get("/api/v1/devices", devices)
        .get("/api/v1/history", history)
        .get("/api/v1/openapi.json", openapi)
}

async fn dashboard() -> Response {
    (
        [(header::CACHE_CONTROL, "no-cache")],
        Html(DASHBOARD_HTML),
    )
        .into_response()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON).into_response()
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadJson {
    pub read_ops_per_s_avg: f64,
    pub write_ops_per_s_avg: f64,
    pub read_bytes_per_s_avg: f64,
    /// Host writes per second averaged since the daemon started (what `strata size
    /// --from-metrics` uses).
    pub write_bytes_per_s_avg: f64,
    /// Over the last minute; None before the first sample.
    pub write_bytes_per_s_recent: Option<f64>,
}

pub fn workload(state: &AppState) -> WorkloadJson {
    let secs = state.started.elapsed().as_secs_f64().max(1e-3);
    let io = state.registry.node_io().snapshot();
    WorkloadJson {
        read_ops_per_s_avg: io.read_ops as f64 / secs,
        write_ops_per_s_avg: io.write_ops as f64 / secs,
        read_bytes_per_s_avg: io.read_bytes as f64 / secs,
        write_bytes_per_s_avg: io.write_bytes as f64 / secs,
        write_bytes_per_s_recent: state
            .history
            .recent_write_bytes_per_s(RECENT_WORKLOAD_WINDOW),
    }
}

#[derive(Debug, Serialize)]
pub struct NodeJson {
    pub version: &'static str,
    pub uptime_s: u64,
    pub state: String,
    pub io_backend: String,
    pub nbd_listen: String,
    pub http_listen: String,
    pub volume_count: usize,
    /// NBD connections open now, over every export (a total over the exports, not a running
    /// count since the start).
    pub nbd_connections_total: usize,
    pub disk_group_count: usize,
    pub workload: WorkloadJson,
    pub io: IoTotalsJson,
    /// The read cache's share of the write log, and why (`--read-cache`).
    pub read_cache: crate::read_cache::ReadCacheDecision,
    pub warnings: Vec<String>,
}

/// The node summary from a consistent set of readings (blocking).
fn node_json(
    state: &AppState,
    stats: &EngineStats,
    devices: &[DeviceJson],
    scrub: &ScrubSummaryJson,
) -> NodeJson {
    let volumes = state.registry.group().volumes();
    NodeJson {
        version: env!("CARGO_PKG_VERSION"),
        uptime_s: state.started.elapsed().as_secs(),
        state: stats.state.clone(),
        io_backend: state.io_backend.clone(),
        nbd_listen: state.nbd_addr.to_string(),
        http_listen: state.http_addr.to_string(),
        volume_count: volumes.len(),
        // Volumes' and snapshots' exports alike.
        nbd_connections_total: state.registry.connections_total(),
        disk_group_count: 1,
        workload: workload(state),
        io: (&state.registry.node_io().snapshot()).into(),
        read_cache: state.read_cache.clone(),
        warnings: warnings(stats, devices, scrub),
    }
}

async fn node(State(state): State<Arc<AppState>>) -> Result<Json<NodeJson>, ApiError> {
    let node = blocking(move || {
        let stats = state.registry.group().stats();
        let devices = device_list(&state);
        let scrub = scrub_summary(&state);
        Ok::<_, ApiError>(node_json(&state, &stats, &devices, &scrub))
    })
    .await?;
    Ok(Json(node))
}

/// What an administrator should act on, one sentence each.
/// A group not running: offline with the reason it went offline, or stopping.
fn state_warning(stats: &EngineStats) -> Option<String> {
    match &stats.failure {
        Some(why) => Some(format!("the disk group is offline: {why}")),
        None if stats.state != "running" => Some(format!("the disk group is {}", stats.state)),
        None => None,
    }
}

/// Write-log damage this start met: writes it was asked to give up, and a damaged header the
/// log still holds.
fn log_damage_warnings(stats: &EngineStats) -> Vec<String> {
    let mut out = Vec::new();
    let lost = stats.log_records_lost_at_start;
    if lost > 0 {
        out.push(format!(
            "this start skipped {lost} write-log record(s) it could not read \
             (--skip-damaged-log-batches): the writes they held are lost and their blocks read \
             as older data; check the file systems on the volumes"
        ));
    }
    if stats.log_damage_pending {
        let again = match lost {
            0 => "",
            _ => ", and needs --skip-damaged-log-batches again",
        };
        out.push(format!(
            "the write log still holds a batch header this start found damaged; the log is \
             being destaged past it (until then a restart reads it again{again})"
        ));
    }
    out
}

/// What admission control does to host writes now, when it holds them back.
fn admission_warning(stats: &EngineStats) -> Option<&'static str> {
    match stats.admission.as_str() {
        "throttled" => Some("host writes are paced to the destage rate"),
        "measuring" => Some(
            "host writes will be paced to the destage rate once it is measured (the destager's \
             first steps since the start); until then they wait whenever the log has no room",
        ),
        "waiting_for_room" => Some("host writes wait for the destager to free log space"),
        _ => None,
    }
}

pub fn warnings(
    stats: &EngineStats,
    devices: &[DeviceJson],
    scrub: &ScrubSummaryJson,
) -> Vec<String> {
    let mut out = Vec::new();
    out.extend(state_warning(stats));
    out.extend(log_damage_warnings(stats));
    if stats.gc_segments_passed_over > 0 {
        out.push(format!(
            "garbage collection cannot clean {} capacity segment(s) whose summary it could not \
             read: their blocks still read, but their space stays used until the data in them \
             is overwritten or deleted (`strata scrub` names them)",
            stats.gc_segments_passed_over
        ));
    }
    if let Some(how) = admission_warning(stats) {
        out.push(format!(
            "the write log is {:.0}% full ({:.0}% is the high mark): {how}",
            stats.log_fill_ratio * 100.0,
            stats.fill_ratio_high * 100.0
        ));
    }
    if let Some(o) = &stats.capacity_out_of_room {
        out.push(format!(
            "the capacity tier is out of room for {:.0} s, its file system full ({}): destaging \
             pauses and writes fail with ENOSPC once the log fills; make room on that file \
             system and destaging goes on by itself",
            o.since_s, o.error
        ));
    } else if stats.capacity_full {
        out.push("the capacity tier is full: writes fail with ENOSPC once the log fills".into());
    } else if let Some(used) = capacity_used_share(stats) {
        let usable = stats
            .capacity_total_bytes
            .saturating_sub(stats.capacity_reserved_bytes);
        if used > CAPACITY_WARN_RATIO {
            // Used segments hold dead data too (overwritten, trimmed, deleted), which garbage
            // collection gives back as free segments run short: the live share says how much
            // is really taken.
            let live = stats.capacity_live_bytes as f64 / usable as f64;
            out.push(format!(
                "the capacity tier is {:.0}% used ({:.0}% by live data) of the space data may \
                 take (the rest, {} MiB, is kept free for garbage collection and the index)",
                used * 100.0,
                live.min(1.0) * 100.0,
                stats.capacity_reserved_bytes >> 20
            ));
        } else if stats.capacity_live_bytes + stats.log_capacity_bytes > usable {
            // Overwritten data stays live on the capacity tier until its new copy is destaged:
            // a log full of overwrites needs room beside what the tier holds (docs/FORMAT.md
            // §9, "Overwrites of a capacity tier near full"). Past this point overwrites may
            // fail with ENOSPC well before the tier counts as full.
            out.push(format!(
                "the capacity tier's live data ({} MiB) and a full write log ({} MiB) come to \
                 more than the space data may take ({} MiB): overwrites may fail with ENOSPC \
                 once the log fills; trim or delete data, or add capacity",
                stats.capacity_live_bytes >> 20,
                stats.log_capacity_bytes >> 20,
                usable >> 20
            ));
        }
    }
    // What came before the last scrub of everything, it repaired or reported (its own
    // warning): once it ran, these count only what came after.
    let since = match stats.checksum_errors_since_scrub < stats.checksum_errors_total
        || stats.metadata_copy_fallbacks_since_scrub < stats.metadata_copy_fallbacks_total
    {
        true => " since the last scrub",
        false => "",
    };
    if stats.checksum_errors_since_scrub > 0 {
        out.push(format!(
            "{} checksum error(s) seen{since} (on reads, log replay or scrubs): run a scrub and check the devices",
            stats.checksum_errors_since_scrub
        ));
    }
    if stats.metadata_copy_fallbacks_since_scrub > 0 {
        out.push(format!(
            "{} metadata read(s){since} found the first copy damaged and used the second: run a scrub to mend it, and check the devices",
            stats.metadata_copy_fallbacks_since_scrub
        ));
    }
    out.extend(crate::api_scrub::warning(scrub.last_result.as_ref()));
    for d in devices {
        if d.stats.errors > 0 {
            out.push(format!("device {} reported {} I/O error(s)", d.stats.name, d.stats.errors));
        }
        if d.wear.wears_out_before_warranty {
            out.push(format!(
                "device {} ({}) would wear out before its warranty ends at its average write rate",
                d.stats.name,
                d.wear.model.as_deref().unwrap_or("?")
            ));
        }
    }
    out
}

#[derive(Debug, Serialize)]
pub struct DiskGroupJson {
    pub id: &'static str,
    pub state: String,
    pub devices: Vec<String>,
    pub log_capacity_bytes: u64,
    pub log_used_bytes: u64,
    pub log_fill_ratio: f64,
    pub fill_ratio_low: f64,
    pub fill_ratio_high: f64,
    pub destage_rate_bytes_per_s: f64,
    pub destage_bandwidth_bytes_per_s: f64,
    /// Live log data not destaged yet (`EngineStats::destage_backlog_bytes`).
    pub destage_backlog_bytes: u64,
    /// Log space held by dead data (`EngineStats::log_dead_bytes`).
    pub log_dead_bytes: u64,
    pub destaged_bytes_total: u64,
    pub admission_throttled: bool,
    /// "open", "throttled", "measuring" or "waiting_for_room" (`EngineStats::admission`).
    pub admission: String,
    pub fast_resident_bytes: u64,
    pub capacity_total_bytes: u64,
    pub capacity_used_bytes: u64,
    pub capacity_live_bytes: u64,
    /// Capacity-tier space kept free for garbage collection and index flushes: the tier
    /// counts as full with this much still free.
    pub capacity_reserved_bytes: u64,
    pub capacity_full: bool,
    pub capacity_out_of_room: Option<strata_engine::OutOfRoomStats>,
    pub segments_total: u64,
    pub segments_free: u64,
    pub gc_segments_cleaned_total: u64,
    pub gc_relocated_bytes_total: u64,
    pub hot_kept_bytes_total: u64,
    pub log_run_writes_total: u64,
    pub log_rotated_batches_total: u64,
    pub log_rotating: bool,
    pub metadata_copy_fallbacks_total: u64,
    pub checksum_errors_total: u64,
        /// Share of stored-data reads served by the fast tier (the log or the read cache's
    /// copies) since start (None before any).
    pub fast_read_hit_ratio: Option<f64>,
    pub scrub: ScrubSummaryJson,
}

/// The share of the capacity tier's usable space (all but what is kept free for garbage
/// collection and the index) in used segments, at most 1 (index pages may take kept
/// segments); None for a group without capacity segments.
pub fn capacity_used_share(e: &EngineStats) -> Option<f64> {
    let usable = e
        .capacity_total_bytes
        .saturating_sub(e.capacity_reserved_bytes);
    (usable > 0).then(|| (e.capacity_used_bytes as f64 / usable as f64).min(1.0))
}

/// Cached copies on the fast tier count as fast-tier hits.
pub fn fast_read_hit_ratio(e: &EngineStats) -> Option<f64> {
    let fast = e.read_fast_bytes_total + e.read_cached_bytes_total;
    let total = fast + e.read_capacity_bytes_total;
    (total > 0).then(|| fast as f64 / total as f64)
}

fn disk_group_json(e: &EngineStats, scrub: ScrubSummaryJson) -> DiskGroupJson {
    let devices = std::iter::once(&e.fast_device)
        .chain(&e.capacity_devices)
        .map(|d| d.name.clone())
        .collect();
    DiskGroupJson {
        id: DISK_GROUP_ID,
        state: e.state.clone(),
        devices,
        log_capacity_bytes: e.log_capacity_bytes,
        log_used_bytes: e.log_used_bytes,
        log_fill_ratio: e.log_fill_ratio,
        fill_ratio_low: e.fill_ratio_low,
        fill_ratio_high: e.fill_ratio_high,
        destage_rate_bytes_per_s: e.destage_rate_bytes_per_s,
        destage_bandwidth_bytes_per_s: e.destage_bandwidth_bytes_per_s,
        destage_backlog_bytes: e.destage_backlog_bytes,
        log_dead_bytes: e.log_dead_bytes,
        destaged_bytes_total: e.destaged_bytes_total,
        admission_throttled: e.admission_throttled,
        admission: e.admission.clone(),
        fast_resident_bytes: e.fast_resident_bytes,
        capacity_total_bytes: e.capacity_total_bytes,
        capacity_used_bytes: e.capacity_used_bytes,
        capacity_live_bytes: e.capacity_live_bytes,
        capacity_reserved_bytes: e.capacity_reserved_bytes,
        capacity_full: e.capacity_full,
        capacity_out_of_room: e.capacity_out_of_room.clone(),
        segments_total: e.segments_total,
        segments_free: e.segments_free,
        gc_segments_cleaned_total: e.gc_segments_cleaned_total,
        gc_relocated_bytes_total: e.gc_relocated_bytes_total,
        hot_kept_bytes_total: e.hot_kept_bytes_total,
        log_run_writes_total: e.log_run_writes_total,
        log_rotated_batches_total: e.log_rotated_batches_total,
        log_rotating: e.log_rotating,
        metadata_copy_fallbacks_total: e.metadata_copy_fallbacks_total,
        checksum_errors_total: e.checksum_errors_total,
        fast_read_hit_ratio: fast_read_hit_ratio(e),
        scrub,
    }
}

/// The disk group's scrub state and the result of its last scrub.
pub fn scrub_summary(state: &AppState) -> ScrubSummaryJson {
    crate::api_scrub::summary_json(state.registry.group().scrub_status(), &state.scrub)
}

#[derive(Debug, Serialize)]
pub struct DiskGroupListJson {
    pub disk_groups: Vec<DiskGroupJson>,
}

async fn disk_groups(
    State(state): State<Arc<AppState>>,
) -> Result<Json<DiskGroupListJson>, ApiError> {
    let group = blocking(move || {
        let stats = state.registry.group().stats();
        Ok::<_, ApiError>(disk_group_json(&stats, scrub_summary(&state)))
    })
    .await?;
    Ok(Json(DiskGroupListJson {
        disk_groups: vec![group],
    }))
}

/// A device: its counters (with its `name`) flattened in, plus tier and wear.
#[derive(Debug, Serialize)]
pub struct DeviceJson {
    pub tier: &'static str,
    pub disk_group: &'static str,
    #[serde(flatten)]
    pub stats: DeviceStats,
    pub wear: WearJson,
    /// Blocks on this device whose checksum failed, on reads and in scrubs, since the daemon
    /// started (data and metadata copies alike).
    pub checksum_errors_total: u64,
}

#[derive(Debug, Serialize)]
pub struct DeviceListJson {
    pub devices: Vec<DeviceJson>,
}

fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Every device with its counters and wear (blocking: reads engine state).
pub fn device_list(state: &AppState) -> Vec<DeviceJson> {
    let g = state.registry.group();
    let stats = g.stats();
    let checksum_errors = stats.checksum_errors_by_device;
    let all_stats = std::iter::once(stats.fast_device).chain(stats.capacity_devices);
    let now = unix_now_s();
    // Wear is a share of what the group writes to: a device grown since the group was
    // formatted on it is larger (`size_bytes`), and the rest is never written.
    let formatted = g.formatted_device_sizes();
    all_stats
        .zip(g.device_wear())
        .zip(&state.devices)
        .enumerate()
        .map(|(i, ((st, w), id))| DeviceJson {
            tier: id.tier,
            disk_group: DISK_GROUP_ID,
            wear: wear::wear(
                id,
                formatted_size(&formatted, i, &st),
                w,
                now,
                &state.history,
            ),
            checksum_errors_total: checksum_errors.get(i).copied().unwrap_or(0),
            stats: st,
        })
        .collect()
}

/// Device `i`'s formatted size, or its own size where the group does not say (never the case
/// for a group's own devices).
fn formatted_size(formatted: &[u64], i: usize, st: &DeviceStats) -> u64 {
    formatted.get(i).copied().unwrap_or(st.size_bytes)
}

async fn devices(State(state): State<Arc<AppState>>) -> Result<Json<DeviceListJson>, ApiError> {
    let devices = blocking(move || Ok::<_, ApiError>(device_list(&state))).await?;
    Ok(Json(DeviceListJson { devices }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryParams {
    /// Only samples taken after this time (Unix milliseconds).
    #[serde(default)]
    pub since_unix_ms: u64,
}

#[derive(Debug, Serialize)]
pub struct HistoryJson {
    pub interval_s: f64,
    pub samples: Vec<Sample>,
}

async fn history(
    State(state): State<Arc<AppState>>,
    params: Result<Query<HistoryParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<HistoryJson>, ApiError> {
    let Query(params) = params.map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, crate::one_line(&e.body_text()))
    })?;
    Ok(Json(HistoryJson {
        interval_s: crate::history::SAMPLE_INTERVAL.as_secs_f64(),
        samples: state.history.since(params.since_unix_ms),
    }))
}

/// Everything about the node in one document: what `strata status --json` prints.
#[derive(Debug, Serialize)]
pub struct StatusJson {
    #[serde(flatten)]
    pub node: NodeJson,
    /// The sampler's last interval (rates, latency percentiles, service levels); None in the
    /// first second.
    pub latest: Option<Sample>,
    pub disk_groups: Vec<DiskGroupJson>,
    pub devices: Vec<DeviceJson>,
    pub volumes: Vec<VolumeJson>,
    /// The engine's raw statistics.
    pub engine: EngineStats,
}

async fn status(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<StatusJson>, ApiError> {
    let base = export_base(state.nbd_addr, &headers);
    let status = blocking(move || {
        let stats = state.registry.group().stats();
        let devices = device_list(&state);
        let scrub = scrub_summary(&state);
        Ok::<_, ApiError>(StatusJson {
            node: node_json(&state, &stats, &devices, &scrub),
            latest: state.history.latest(),
            disk_groups: vec![disk_group_json(&stats, scrub)],
            volumes: all_volumes(&state, &base),
            devices,
            engine: stats,
        })
    })
    .await?;
    Ok(Json(status))
}

#[cfg(test)]
#[path = "dashboard_tests.rs"]
mod dashboard_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// A device file grown after its group was formatted on it: its wear is a share of the
    /// size the group writes to, which the figures name, not of the file's new size. (Drive
    /// writes per day were a share of the device's whole size, half of the true figure on a
    /// device grown to twice its formatted size.)
    #[test]
    fn wear_of_a_device_grown_since_format_uses_the_formatted_size() {
        let dir = tempfile::tempdir().unwrap();
        let args = crate::ServeArgs {
            data_dir: Some(dir.path().to_path_buf()),
            fast_size: Some(16 << 20),
            capacity_size: Some(64 << 20),
            ..crate::ServeArgs::default()
        };
        let cfg = crate::config::merge(&args, Default::default()).unwrap();
        let open = || {
            let devs = crate::devices::open_devices(&cfg, &Default::default()).unwrap();
            let engine = strata_engine::EngineConfig::default();
            strata_engine::DiskGroup::open(devs.fast, devs.capacity, engine, true).unwrap()
        };
        let group = open();
        let v = group.create_volume("v", 4 << 20).unwrap().id;
        group.write(v, 0, &vec![0x5a; 1 << 20]).unwrap();
        group.shutdown().unwrap();
        drop(group);
        for (file, grown) in [("fast.img", 32 << 20), ("capacity-0.img", 96 << 20)] {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.path().join(file));
            f.unwrap().set_len(grown).unwrap();
        }
        let identity = |name: &str, tier| crate::wear::DeviceIdentity {
            name: name.into(),
            tier,
            model: None,
            rating: None,
            projection_after_s: Some(0),
        };
        let state = AppState {
            registry: crate::registry::Registry::new(open()),
            started: std::time::Instant::now(),
            nbd_addr: "127.0.0.1:10809".parse().unwrap(),
            http_addr: "127.0.0.1:9090".parse().unwrap(),
            io_backend: "threads".into(),
            history: crate::history::History::new(),
            token: None,
            devices: vec![identity("fast", "fast"), identity("capacity-0", "capacity")],
            scrub: crate::api_scrub::ScrubConfig {
                interval: None,
                rate_bytes_per_s: 0,
            },
            stopping: tokio::sync::watch::channel(false).1,
            read_cache: crate::read_cache::decide_with(
                crate::read_cache::ReadCacheSetting::Ratio(0.0),
                &crate::read_cache::Devices {
                    fast: std::path::Path::new("/fast"),
                    capacity: &[],
                    capacity_emulated: false,
                },
                |p| crate::read_cache::Probe {
                    disk: Some(p.to_path_buf()),
                    rotational: Ok(false),
                },
            ),
            space: Default::default(),
        };
        let devices = device_list(&state);
        for (d, grown, formatted) in [
            (&devices[0], 32u64 << 20, 16u64 << 20),
            (&devices[1], 96 << 20, 64 << 20),
        ] {
            assert_eq!(d.stats.size_bytes, grown, "{d:?}");
            assert_eq!(d.wear.formatted_size_bytes, formatted, "{d:?}");
            let w = &d.wear;
            assert!(w.write_bytes_per_s_avg > 0.0, "{d:?}");
            let dwpd = w.write_bytes_per_s_avg * 86_400.0 / formatted as f64;
            assert!(
                (w.drive_writes_per_day - dwpd).abs() <= dwpd * 1e-9,
                "{w:?}, want {dwpd}"
            );
        }
        state.registry.group().shutdown().unwrap();
    }

    /// The warnings a group with `stats` and no scrub behind it gives.
    fn group_warnings(stats: &EngineStats) -> Vec<String> {
        let config = crate::api_scrub::ScrubConfig {
            interval: None,
            rate_bytes_per_s: 0,
        };
        let scrub = crate::api_scrub::summary_json(Default::default(), &config);
        warnings(stats, &[], &scrub)
    }

    /// A capacity tier nearly all in used segments is warned about with the share live data
    /// takes: segments also hold dead data that garbage collection gives back. The shares
    /// are of the space data may take: a tier whose used segments leave only what is kept
    /// free for garbage collection and the index is full (88% of it all, here), and was not
    /// warned about when the share counted the kept space.
    #[test]
    fn a_capacity_warning_says_how_much_is_live() {
        let stats = EngineStats {
            state: "running".into(),
            capacity_total_bytes: 100 << 30,
            capacity_reserved_bytes: 10 << 30,
            capacity_used_bytes: 88 << 30,
            capacity_live_bytes: 36 << 30,
            ..EngineStats::default()
        };
        let list = group_warnings(&stats);
        let want = "the capacity tier is 98% used (40% by live data) of the space data may take \
                    (the rest, 10240 MiB, is kept free for garbage collection and the index)";
        assert!(list.iter().any(|w| w == want), "{list:?}");
        let roomy = EngineStats {
            capacity_used_bytes: 80 << 30,
            ..stats
        };
        let list = group_warnings(&roomy);
        assert!(!list.iter().any(|w| w.contains("capacity")), "{list:?}");
    }

    /// Writes a start gave up are warned about for as long as the daemon runs; a damaged
    /// header the log still holds until it is destaged past, saying whether a restart would
    /// need the flag again.
    #[test]
    fn write_log_damage_met_at_start_is_warned_about() {
        let running = EngineStats {
            state: "running".into(),
            ..EngineStats::default()
        };
        assert!(group_warnings(&running).is_empty());
        let skipped = EngineStats {
            log_records_lost_at_start: 3,
            log_damage_pending: true,
            ..running.clone()
        };
        let list = group_warnings(&skipped);
        let skipped_lines = |start: &str, end: &str| {
            list.iter()
                .filter(|w| w.starts_with(start) && w.ends_with(end))
                .count()
        };
        assert_eq!(
            skipped_lines("this start skipped 3 write-log record(s)", "on the volumes"),
            1,
            "{list:?}"
        );
        assert_eq!(
            skipped_lines("the write log still holds", "-batches again)"),
            1,
            "{list:?}"
        );
        let salvaged = EngineStats {
            log_damage_pending: true,
            ..running
        };
        let list = group_warnings(&salvaged);
        assert_eq!(list.len(), 1, "{list:?}");
        assert!(list[0].ends_with("a restart reads it again)"), "{list:?}");
    }

    /// Segments garbage collection cannot clean are warned about while there are any.
    #[test]
    fn segments_gc_cannot_clean_are_warned_about() {
        let running = EngineStats {
            state: "running".into(),
            ..EngineStats::default()
        };
        let stuck = EngineStats {
            gc_segments_passed_over: 2,
            ..running.clone()
        };
        let list = group_warnings(&stuck);
        assert_eq!(list.len(), 1, "{list:?}");
        assert!(
            list[0].starts_with("garbage collection cannot clean 2 capacity segment(s)"),
            "{list:?}"
        );
        assert!(group_warnings(&running).is_empty());
    }

    /// Checksum errors and metadata fallbacks a scrub of everything has seen since are not
    /// warned about again: it repaired them or reported them (its own warning). Before, the
    /// warnings stayed after a scrub that came back clean.
    #[test]
    fn damage_seen_before_the_last_scrub_is_not_warned_about_again() {
        let seen = EngineStats {
            state: "running".into(),
            checksum_errors_total: 5,
            checksum_errors_since_scrub: 5,
            metadata_copy_fallbacks_total: 1,
            metadata_copy_fallbacks_since_scrub: 1,
            ..EngineStats::default()
        };
        let list = group_warnings(&seen);
        let has = |start: &str| list.iter().any(|w| w.starts_with(start));
        assert!(has("5 checksum error(s) seen ("), "{list:?}");
        assert!(has("1 metadata read(s) found"), "{list:?}");
        let scrubbed = EngineStats {
            checksum_errors_since_scrub: 0,
            metadata_copy_fallbacks_since_scrub: 0,
            ..seen.clone()
        };
        assert!(group_warnings(&scrubbed).is_empty());
        let again = EngineStats {
            checksum_errors_since_scrub: 2,
            ..scrubbed
        };
        let list = group_warnings(&again);
        let want = "2 checksum error(s) seen since the last scrub (";
        assert!(list.iter().any(|w| w.starts_with(want)), "{list:?}");
    }

    /// A small tier whose live data and a full write log together exceed what data may take
    /// is warned about before it counts as full: overwrites fail there (a 256 MiB tier under
    /// a 64 MiB fast tier refused them at 216 MiB written, 84%, with no warning shown).
    #[test]
    fn a_tier_too_full_for_a_log_of_overwrites_is_warned_about() {
        let stats = EngineStats {
            state: "running".into(),
            capacity_total_bytes: 255 << 20,
            capacity_reserved_bytes: 15 << 20,
            capacity_used_bytes: 200 << 20,
            capacity_live_bytes: 190 << 20,
            log_capacity_bytes: 60 << 20,
            ..EngineStats::default()
        };
        let list = group_warnings(&stats);
        let want = "the capacity tier's live data (190 MiB) and a full write log (60 MiB) come to \
                    more than the space data may take (240 MiB): overwrites may fail with ENOSPC \
                    once the log fills; trim or delete data, or add capacity";
        assert!(list.iter().any(|w| w == want), "{list:?}");
        let room = EngineStats {
            capacity_used_bytes: 150 << 20,
            capacity_live_bytes: 150 << 20,
            ..stats
        };
        let list = group_warnings(&room);
        assert!(!list.iter().any(|w| w.contains("capacity")), "{list:?}");
    }

    #[test]
    fn an_offline_group_is_warned_about_with_its_reason() {
        let why = "internal error: the strata-destage thread panicked: boom";
        let failed = EngineStats {
            state: "failed".into(),
            failure: Some(why.into()),
            ..EngineStats::default()
        };
        assert_eq!(
            state_warning(&failed).as_deref(),
            Some(format!("the disk group is offline: {why}").as_str())
        );
        let running = EngineStats {
            state: "running".into(),
            ..EngineStats::default()
        };
        assert_eq!(state_warning(&running), None);
    }
}
