//! What the admin port shows about a running node: `/metrics` for Prometheus, the read-only
//! JSON resources (node, disk groups, devices, history), the OpenAPI document, and the
//! dashboard at `/`.
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use strata_device::{DeviceStats, IO_SIZE_BUCKETS};
use strata_engine::EngineStats;

use crate::api::{blocking, ApiError, AppState};
use crate::history::Sample;
use crate::metrics::{IoSnapshot, LATENCY_BOUNDS_US};
use crate::prom::{Exposition, Type};
use crate::wear::{self, WearJson};

const DASHBOARD_HTML: &str = include_str!("dashboard.html");
const OPENAPI_JSON: &str = include_str!("../../../docs/openapi.json");
/// Window of the "recent" host write rate.
const RECENT_WORKLOAD_WINDOW: Duration = Duration::from_secs(60);

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(dashboard))
        .route("/metrics", get(metrics))
        .route("/api/v1/node", get(node))
        .route("/api/v1/diskgroups", get(disk_groups))
        .route("/api/v1/devices", get(devices))
        .route("/api/v1/history", get(history))
        .route("/api/v1/openapi.json", get(openapi))
}

async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD_HTML)
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
    pub disk_group_count: usize,
    pub workload: WorkloadJson,
    pub io: crate::metrics::IoTotalsJson,
    pub warnings: Vec<String>,
}

async fn node(State(state): State<Arc<AppState>>) -> Result<Json<NodeJson>, ApiError> {
    let s = state.clone();
    let (stats, volume_count, devices) = blocking(move || {
        let g = s.registry.group();
        Ok::<_, ApiError>((g.stats(), g.volumes().len(), device_list(&s)))
    })
    .await?;
    Ok(Json(NodeJson {
        version: env!("CARGO_PKG_VERSION"),
        uptime_s: state.started.elapsed().as_secs(),
        state: stats.state.clone(),
        io_backend: state.io_backend.clone(),
        nbd_listen: state.nbd_addr.to_string(),
        http_listen: state.http_addr.to_string(),
        volume_count,
        disk_group_count: 1,
        workload: workload(&state),
        io: (&state.registry.node_io().snapshot()).into(),
        warnings: warnings(&stats, &devices),
    }))
}

/// What an administrator should act on, one sentence each.
pub fn warnings(stats: &EngineStats, devices: &[DeviceJson]) -> Vec<String> {
    let mut out = Vec::new();
    if stats.state != "running" {
        out.push(format!("the disk group is {}", stats.state));
    }
    if stats.capacity_full {
        out.push("the capacity tier is full: writes fail with ENOSPC once the log fills".into());
    }
    if stats.checksum_errors_total > 0 {
        out.push(format!(
            "{} checksum error(s) seen on reads: run a scrub and check the devices",
            stats.checksum_errors_total
        ));
    }
    for d in devices {
        if d.wear.wears_out_before_warranty {
            out.push(format!(
                "device {} ({}) would wear out before its warranty ends at its average write rate",
                d.name,
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
    pub destage_backlog_bytes: u64,
    pub destaged_bytes_total: u64,
    pub admission_throttled: bool,
    pub fast_resident_bytes: u64,
    pub capacity_total_bytes: u64,
    pub capacity_used_bytes: u64,
    pub capacity_live_bytes: u64,
    pub capacity_full: bool,
    pub segments_total: u64,
    pub segments_free: u64,
    pub gc_segments_cleaned_total: u64,
    pub gc_relocated_bytes_total: u64,
    pub checksum_errors_total: u64,
    /// Share of stored-data reads served by the fast tier since start (None before any).
    pub fast_read_hit_ratio: Option<f64>,
}

fn fast_read_hit_ratio(e: &EngineStats) -> Option<f64> {
    let total = e.read_fast_bytes_total + e.read_capacity_bytes_total;
    (total > 0).then(|| e.read_fast_bytes_total as f64 / total as f64)
}

fn disk_group_json(e: &EngineStats) -> DiskGroupJson {
    let devices = std::iter::once(&e.fast_device)
        .chain(&e.capacity_devices)
        .map(|d| d.name.clone())
        .collect();
    DiskGroupJson {
        id: "dg0",
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
        destaged_bytes_total: e.destaged_bytes_total,
        admission_throttled: e.admission_throttled,
        fast_resident_bytes: e.fast_resident_bytes,
        capacity_total_bytes: e.capacity_total_bytes,
        capacity_used_bytes: e.capacity_used_bytes,
        capacity_live_bytes: e.capacity_live_bytes,
        capacity_full: e.capacity_full,
        segments_total: e.segments_total,
        segments_free: e.segments_free,
        gc_segments_cleaned_total: e.gc_segments_cleaned_total,
        gc_relocated_bytes_total: e.gc_relocated_bytes_total,
        checksum_errors_total: e.checksum_errors_total,
        fast_read_hit_ratio: fast_read_hit_ratio(e),
    }
}

#[derive(Debug, Serialize)]
pub struct DiskGroupListJson {
    pub disk_groups: Vec<DiskGroupJson>,
}

async fn disk_groups(
    State(state): State<Arc<AppState>>,
) -> Result<Json<DiskGroupListJson>, ApiError> {
    let stats = blocking(move || Ok::<_, ApiError>(state.registry.group().stats())).await?;
    Ok(Json(DiskGroupListJson {
        disk_groups: vec![disk_group_json(&stats)],
    }))
}

#[derive(Debug, Serialize)]
pub struct DeviceJson {
    pub name: String,
    pub tier: &'static str,
    pub disk_group: &'static str,
    #[serde(flatten)]
    pub stats: DeviceStats,
    pub wear: WearJson,
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
    let all_stats = std::iter::once(stats.fast_device).chain(stats.capacity_devices);
    let now = unix_now_s();
    all_stats
        .zip(g.device_wear())
        .zip(&state.devices)
        .map(|((st, w), id)| DeviceJson {
            name: st.name.clone(),
            tier: id.tier,
            disk_group: "dg0",
            wear: wear::wear(id, st.size_bytes, w, now, &state.history),
            stats: st,
        })
        .collect()
}

async fn devices(State(state): State<Arc<AppState>>) -> Result<Json<DeviceListJson>, ApiError> {
    let devices = blocking(move || Ok::<_, ApiError>(device_list(&state))).await?;
    Ok(Json(DeviceListJson { devices }))
}

#[derive(Debug, Deserialize)]
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
        ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            crate::one_line(&e.body_text()),
        )
    })?;
    Ok(Json(HistoryJson {
        interval_s: crate::history::SAMPLE_INTERVAL.as_secs_f64(),
        samples: state.history.since(params.since_unix_ms),
    }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let text = blocking(move || Ok::<_, ApiError>(render_metrics(&state))).await?;
    Ok(([(header::CONTENT_TYPE, crate::prom::CONTENT_TYPE)], text).into_response())
}

/// The whole `/metrics` page (blocking: reads engine state).
pub fn render_metrics(state: &AppState) -> String {
    let g = state.registry.group();
    let stats = g.stats();
    let mut volumes = g.volumes();
    volumes.sort_by(|a, b| a.name.cmp(&b.name));
    let vols: Vec<(String, u64, usize, IoSnapshot)> = volumes
        .iter()
        .map(|v| {
            (
                v.name.clone(),
                v.size_bytes,
                state.registry.connections(v.id),
                state.registry.volume_io(v.id).snapshot(),
            )
        })
        .collect();
    let devices = device_list(state);
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
    render_volumes(&mut e, &vols);
    render_devices(&mut e, &devices);
    render_engine(&mut e, &stats);
    e.finish()
}

type VolumeRow = (String, u64, usize, IoSnapshot);

fn render_volumes(e: &mut Exposition, vols: &[VolumeRow]) {
    let counters: [(&str, &str, fn(&IoSnapshot) -> u64); 7] = [
        ("strata_volume_read_operations_total", "Read requests served.", |s| s.read_ops),
        ("strata_volume_read_bytes_total", "Bytes read by clients.", |s| s.read_bytes),
        ("strata_volume_write_operations_total", "Write requests served.", |s| s.write_ops),
        ("strata_volume_write_bytes_total", "Bytes written by clients.", |s| s.write_bytes),
        ("strata_volume_unmap_operations_total", "TRIM and WRITE_ZEROES requests served.", |s| s.unmap_ops),
        ("strata_volume_flush_operations_total", "FLUSH requests served.", |s| s.flush_ops),
        ("strata_volume_request_errors_total", "Requests answered with an error.", |s| s.errors),
    ];
    for (name, help, get) in counters {
        e.family(name, Type::Counter, help);
        for (v, _, _, s) in vols {
            e.sample(name, &[("volume", v)], get(s) as f64);
        }
    }
    e.family("strata_volume_size_bytes", Type::Gauge, "Volume size.");
    for (v, size, _, _) in vols {
        e.sample("strata_volume_size_bytes", &[("volume", v)], *size as f64);
    }
    e.family("strata_volume_connections", Type::Gauge, "Open NBD handles on the volume.");
    for (v, _, conns, _) in vols {
        e.sample("strata_volume_connections", &[("volume", v)], *conns as f64);
    }
    let bounds: Vec<f64> = LATENCY_BOUNDS_US.iter().map(|&us| us as f64 / 1e6).collect();
    let name = "strata_volume_request_duration_seconds";
    e.family(
        name,
        Type::Histogram,
        "Time from a request reaching the volume to its completion (durable, for writes).",
    );
    for (v, _, _, s) in vols {
        for (op, h) in [("read", &s.read_latency), ("write", &s.write_latency)] {
            e.histogram(
                name,
                &[("volume", v), ("op", op)],
                &bounds,
                &h.cumulative(),
                h.sum_us as f64 / 1e6,
            );
        }
    }
}

fn render_devices(e: &mut Exposition, devices: &[DeviceJson]) {
    let counters: [(&str, &str, fn(&DeviceStats) -> u64); 8] = [
        ("strata_device_read_bytes_total", "Bytes read, as the device saw them.", |d| d.read_bytes),
        ("strata_device_read_operations_total", "Reads issued to the device.", |d| d.read_ops),
        ("strata_device_written_bytes_total", "Bytes written since start, as the device saw them.", |d| d.write_bytes),
        ("strata_device_write_operations_total", "Writes issued to the device.", |d| d.write_ops),
        ("strata_device_flush_operations_total", "Cache flushes issued to the device.", |d| d.flush_ops),
        ("strata_device_discard_operations_total", "Discards issued to the device.", |d| d.discard_ops),
        ("strata_device_discarded_bytes_total", "Bytes discarded.", |d| d.discard_bytes),
        ("strata_device_errors_total", "Failed device calls.", |d| d.errors),
    ];
    for (name, help, get) in counters {
        e.family(name, Type::Counter, help);
        for d in devices {
            e.sample(name, &[("device", &d.name), ("tier", d.tier)], get(&d.stats) as f64);
        }
    }
    e.family("strata_device_size_bytes", Type::Gauge, "Device size.");
    for d in devices {
        let l = [("device", d.name.as_str()), ("tier", d.tier)];
        e.sample("strata_device_size_bytes", &l, d.stats.size_bytes as f64);
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
            let l = [("device", d.name.as_str()), ("tier", d.tier)];
            e.histogram(name, &l, &bounds, &cumulative, sum as f64);
        }
    }
    render_wear(e, devices);
}

fn render_wear(e: &mut Exposition, devices: &[DeviceJson]) {
    let gauges: [(&str, &str, fn(&WearJson) -> Option<f64>); 7] = [
        ("strata_device_lifetime_written_bytes", "Bytes the device received from this disk group over its life (persisted).", |w| Some(w.bytes_written_total as f64)),
        ("strata_device_write_rate_average_bytes_per_second", "Lifetime average write rate.", |w| Some(w.write_bytes_per_s_avg)),
        ("strata_device_drive_writes_per_day", "Drive writes per day at the average rate.", |w| Some(w.drive_writes_per_day)),
        ("strata_device_endurance_used_ratio", "Share of the rated endurance used (catalog devices only).", |w| w.endurance_used_ratio),
        ("strata_device_warranty_end_timestamp_seconds", "End of the warranty (catalog devices only).", |w| w.warranty_end_unix_s.map(|t| t as f64)),
        ("strata_device_projected_wear_out_timestamp_seconds", "When the rated endurance runs out at the average rate.", |w| w.projected_wear_out_unix_s.map(|t| t as f64)),
        ("strata_device_wear_out_before_warranty", "1 when the average rate wears the device out before its warranty ends.", |w| Some(if w.wears_out_before_warranty { 1.0 } else { 0.0 })),
    ];
    for (name, help, get) in gauges {
        e.family(name, Type::Gauge, help);
        for d in devices {
            if let Some(v) = get(&d.wear) {
                e.sample(name, &[("device", &d.name), ("tier", d.tier)], v);
            }
        }
    }
}

fn render_engine(e: &mut Exposition, s: &EngineStats) {
    let gauges: [(&str, &str, f64); 15] = [
        ("strata_log_fill_ratio", "Share of the fast-tier write log in use.", s.log_fill_ratio),
        ("strata_log_fill_ratio_low", "Fill below which the destager idles.", s.fill_ratio_low),
        ("strata_log_fill_ratio_high", "Fill above which the destager runs flat out and admission follows it.", s.fill_ratio_high),
        ("strata_log_capacity_bytes", "Size of the write log.", s.log_capacity_bytes as f64),
        ("strata_log_used_bytes", "Bytes of the write log in use.", s.log_used_bytes as f64),
        ("strata_destage_rate_bytes_per_second", "Capacity-tier bytes written by the destager per second, smoothed.", s.destage_rate_bytes_per_s),
        ("strata_destage_bandwidth_bytes_per_second", "Log space the destager frees per busy second, smoothed.", s.destage_bandwidth_bytes_per_s),
        ("strata_destage_backlog_bytes", "Bytes in the log waiting to be destaged.", s.destage_backlog_bytes as f64),
        ("strata_admission_throttled", "1 while host writes are paced to the destage rate.", if s.admission_throttled { 1.0 } else { 0.0 }),
        ("strata_fast_tier_resident_bytes", "Live bytes held on the fast tier.", s.fast_resident_bytes as f64),
        ("strata_capacity_total_bytes", "Capacity-tier space in segments.", s.capacity_total_bytes as f64),
        ("strata_capacity_used_bytes", "Capacity-tier space in used segments.", s.capacity_used_bytes as f64),
        ("strata_capacity_live_bytes", "Live data on the capacity tier.", s.capacity_live_bytes as f64),
        ("strata_capacity_segments_free", "Free capacity segments.", s.segments_free as f64),
        ("strata_capacity_full", "1 when the capacity tier has no free segment.", if s.capacity_full { 1.0 } else { 0.0 }),
    ];
    for (name, help, v) in gauges {
        e.single(name, Type::Gauge, help, v);
    }
    let counters: [(&str, &str, u64); 6] = [
        ("strata_destaged_bytes_total", "Bytes moved from the log to the capacity tier.", s.destaged_bytes_total),
        ("strata_gc_segments_cleaned_total", "Capacity segments reclaimed by garbage collection.", s.gc_segments_cleaned_total),
        ("strata_gc_relocated_bytes_total", "Live bytes garbage collection moved.", s.gc_relocated_bytes_total),
        ("strata_hot_kept_bytes_total", "Recently overwritten bytes kept on the fast tier instead of destaged.", s.hot_kept_bytes_total),
        ("strata_checksum_errors_total", "Blocks whose checksum failed on read (both tiers).", s.checksum_errors_total),
        ("strata_index_runs", "Extents in the in-memory index (a gauge of its size).", s.index_runs),
    ];
    for (name, help, v) in counters {
        let kind = if name.ends_with("_total") { Type::Counter } else { Type::Gauge };
        e.single(name, kind, help, v as f64);
    }
    e.family(
        "strata_read_bytes_total",
        Type::Counter,
        "Host reads by where they were served from: fast tier, capacity tier, or unwritten space.",
    );
    for (source, v) in [
        ("fast", s.read_fast_bytes_total),
        ("capacity", s.read_capacity_bytes_total),
        ("unwritten", s.read_unwritten_bytes_total),
    ] {
        e.sample("strata_read_bytes_total", &[("source", source)], v as f64);
    }
    e.single(
        "strata_fast_read_hit_ratio",
        Type::Gauge,
        "Share of stored-data reads served by the fast tier since start (0 before any read).",
        fast_read_hit_ratio(s).unwrap_or(0.0),
    );
}
