//! Scrub in the admin API. `POST /api/v1/scrub` runs a scrub (all volumes, or one volume with its
//! snapshots) to the end and answers its report: every stored block read and checked against its
//! checksum, both copies of every piece of metadata compared, a bad copy rewritten from the good
//! one. It is mutating (it may repair metadata), so it needs the token when one is set. One scrub
//! runs at a time, the background one included: a second gets 409. `GET /api/v1/scrub` answers
//! the progress of a running scrub and the last report.
//!
//! A scrub can take hours on a large disk group: it runs on the blocking pool and the request
//! stays open until it ends (the CLI waits without a deadline for this one request). A client that
//! goes away stops it, as nobody is left to read its report; `last` stays the previous one.
//! With `"wait": false` the answer comes at once (202, the progress): the scrub runs on the
//! daemon with nobody waiting, as the background one does, and its report becomes `last`.
//! `DELETE /api/v1/scrub` stops the running scrub, whoever started it (the background one
//! included). Shutdown of the daemon answers 503 at once and the scrub stops with the disk group.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use strata_engine::{ScrubOptions, ScrubReport, ScrubStatus};

use crate::api::{parse_body, validate_name, ApiError, AppState};
use crate::routes::Routes;

pub fn routes() -> Routes<Arc<AppState>> {
    Routes::new()
        .get("/api/v1/scrub", status)
        .post("/api/v1/scrub", run)
        .delete("/api/v1/scrub", cancel)
}

/// How long `DELETE /api/v1/scrub` waits for the scrub to stop before it answers anyway.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// How the daemon scrubs by itself (`--scrub-interval`, `--scrub-rate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrubConfig {
    /// Time between background scrubs; None: no background scrub.
    pub interval: Option<Duration>,
    /// Read rate of the background scrub, and of an API scrub that names none (0: unlimited).
    pub rate_bytes_per_s: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrubRequest {
    /// Only this volume and its snapshots; absent: every volume and snapshot.
    #[serde(default)]
    pub volume: Option<String>,
    /// Read rate limit (0: unlimited); absent: the daemon's `--scrub-rate`.
    #[serde(default)]
    pub rate_bytes_per_s: Option<u64>,
    /// False: answer once the scrub has begun, not when it ends; absent: true.
    #[serde(default)]
    pub wait: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadBlockJson {
    /// The volume, `VOLUME@SNAPSHOT`, or `layer #N` for blocks only a deleted snapshot held.
    pub volume: String,
    /// Byte offset of the 4 KiB block in that volume or snapshot.
    pub offset: u64,
    /// `fast` or `capacity`: where the bad copy is.
    pub tier: String,
    pub problem: String,
}

/// What a scrub checked and found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubReportJson {
    /// `all`, or the volume scrubbed.
    pub scope: String,
    pub started_unix_s: u64,
    pub finished_unix_s: u64,
    pub data_bytes_verified: u64,
    pub metadata_copies_checked: u64,
    /// Every bad block found; `bad_blocks` lists at most the first 10,000.
    pub bad_blocks_total: u64,
    pub bad_blocks: Vec<BadBlockJson>,
    /// Metadata copies found bad and rewritten from the good copy.
    pub metadata_repaired: Vec<String>,
    /// Metadata that could not be repaired (both copies bad, or a structure kept once).
    pub metadata_damaged: Vec<String>,
    /// Nothing was wrong: no bad block, no metadata repaired or damaged.
    pub clean: bool,
}

impl From<ScrubReport> for ScrubReportJson {
    fn from(r: ScrubReport) -> ScrubReportJson {
        ScrubReportJson {
            clean: r.clean() && r.metadata_repaired.is_empty(),
            scope: r.scope,
            started_unix_s: r.started_unix_s,
            finished_unix_s: r.finished_unix_s,
            data_bytes_verified: r.data_bytes_verified,
            metadata_copies_checked: r.metadata_copies_checked,
            bad_blocks_total: r.bad_blocks_total,
            bad_blocks: r
                .bad_blocks
                .into_iter()
                .map(|b| BadBlockJson {
                    volume: b.volume,
                    offset: b.offset,
                    tier: b.tier.to_string(),
                    problem: b.problem,
                })
                .collect(),
            metadata_repaired: r.metadata_repaired,
            metadata_damaged: r.metadata_damaged,
        }
    }
}

/// A finished scrub in a few numbers (the disk group's summary; the lists are in
/// `GET /api/v1/scrub`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubResultJson {
    pub scope: String,
    pub started_unix_s: u64,
    pub finished_unix_s: u64,
    pub data_bytes_verified: u64,
    pub bad_blocks_total: u64,
    pub metadata_repaired_total: u64,
    pub metadata_damaged_total: u64,
    pub clean: bool,
}

impl From<&ScrubReportJson> for ScrubResultJson {
    fn from(r: &ScrubReportJson) -> ScrubResultJson {
        ScrubResultJson {
            scope: r.scope.clone(),
            started_unix_s: r.started_unix_s,
            finished_unix_s: r.finished_unix_s,
            data_bytes_verified: r.data_bytes_verified,
            bad_blocks_total: r.bad_blocks_total,
            metadata_repaired_total: r.metadata_repaired.len() as u64,
            metadata_damaged_total: r.metadata_damaged.len() as u64,
            clean: r.clean,
        }
    }
}

/// Whether a scrub is running, how far it got, and how the daemon scrubs by itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubProgressJson {
    pub running: bool,
    /// Bytes read by the running scrub (or by the last one, once it ended).
    pub progress_bytes: u64,
    /// The engine's estimate of what that scrub reads in all.
    pub total_bytes: u64,
    /// Seconds between background scrubs; null when they are off.
    pub background_interval_s: Option<u64>,
    pub background_rate_bytes_per_s: u64,
}

/// `GET /api/v1/scrub`: progress and the whole last report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScrubStatusJson {
    #[serde(flatten)]
    pub progress: ScrubProgressJson,
    pub last: Option<ScrubReportJson>,
}

/// The scrub part of a disk group in `/api/v1/status` and `/api/v1/diskgroups`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubSummaryJson {
    #[serde(flatten)]
    pub progress: ScrubProgressJson,
    pub last_result: Option<ScrubResultJson>,
}

fn progress(s: &ScrubStatus, cfg: &ScrubConfig) -> ScrubProgressJson {
    ScrubProgressJson {
        running: s.running,
        progress_bytes: s.progress_bytes,
        total_bytes: s.total_bytes,
        background_interval_s: cfg.interval.map(|d| d.as_secs()),
        background_rate_bytes_per_s: cfg.rate_bytes_per_s,
    }
}

pub fn status_json(s: ScrubStatus, cfg: &ScrubConfig) -> ScrubStatusJson {
    ScrubStatusJson {
        progress: progress(&s, cfg),
        last: s.last.map(ScrubReportJson::from),
    }
}

pub fn summary_json(s: ScrubStatus, cfg: &ScrubConfig) -> ScrubSummaryJson {
    let status = status_json(s, cfg);
    ScrubSummaryJson {
        last_result: status.last.as_ref().map(ScrubResultJson::from),
        progress: status.progress,
    }
}

/// The warning `/api/v1/node` gives when the last scrub found something.
pub fn warning(last: Option<&ScrubResultJson>) -> Option<String> {
    let r = last.filter(|r| !r.clean)?;
    let when = crate::client::utc_time(r.finished_unix_s);
    // A scrub of one volume replaces the last result: say what it covered, as damage a scrub
    // of everything found elsewhere is no longer counted here.
    let (which, only) = match r.scope.as_str() {
        "all" | "" => ("the scrub".to_string(), String::new()),
        one => (
            format!("the scrub of {one}"),
            format!(" (it checked {one} and its snapshots only; `strata scrub` checks everything)"),
        ),
    };
    if r.bad_blocks_total > 0 || r.metadata_damaged_total > 0 {
        return Some(format!(
            "{which} finished {when} found {} bad data block(s) and {} damaged metadata structure(s): reads of them fail; `strata scrub` lists them{only}",
            r.bad_blocks_total, r.metadata_damaged_total
        ));
    }
    Some(format!(
        "{which} finished {when} repaired {} metadata copy(ies) from the good copy: check the devices{only}",
        r.metadata_repaired_total
    ))
}

async fn status(State(state): State<Arc<AppState>>) -> Json<ScrubStatusJson> {
    Json(status_json(state.registry.group().scrub_status(), &state.scrub))
}

async fn run(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req = parse_request(body)?;
    if req.wait == Some(false) {
        return start(state, req).await;
    }
    // A client that goes away (Ctrl-C on `strata scrub`) drops this future: the guard then
    // stops the scrub, which would otherwise hold the scrub slot to its end with nobody to
    // read its report.
    let cancel = CancelOnDrop(Arc::new(AtomicBool::new(false)));
    let opts = ScrubOptions {
        volume: req.volume,
        rate_bytes_per_s: req.rate_bytes_per_s.unwrap_or(state.scrub.rate_bytes_per_s),
        cancel: Some(cancel.0.clone()),
    };
    tracing::info!(scope = opts.volume.as_deref().unwrap_or("all"), rate_bytes_per_s = opts.rate_bytes_per_s, "scrub requested");
    let group = state.registry.group().clone();
    let task = tokio::task::spawn_blocking(move || {
        let report = group.scrub(&opts);
        if let Err(strata_engine::EngineError::Cancelled(_)) = &report {
            let left = opts
                .cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::Relaxed));
            let why = if left {
                "the client that asked for it went away"
            } else {
                "cancelled"
            };
            tracing::info!("scrub stopped: {why}");
        }
        report
    });
    let mut stopping = state.stopping.clone();
    tokio::select! {
        joined = task => match joined {
            Ok(report) => Ok(Json(ScrubReportJson::from(report?)).into_response()),
            Err(e) => {
                tracing::error!(error = %e, "scrub task failed");
                Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error"))
            }
        },
        // The scrub stops with the disk group; the HTTP server's drain need not wait for it.
        Ok(_) = stopping.wait_for(|stop| *stop) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the daemon is shutting down; the scrub stops with it",
        )),
    }
}

/// A scrub nobody waits for: 202 and the progress once it holds the scrub slot (409 when
/// another scrub runs).
async fn start(state: Arc<AppState>, req: ScrubRequest) -> Result<Response, ApiError> {
    let opts = ScrubOptions {
        volume: req.volume,
        rate_bytes_per_s: req.rate_bytes_per_s.unwrap_or(state.scrub.rate_bytes_per_s),
        cancel: None,
    };
    tracing::info!(
        scope = opts.volume.as_deref().unwrap_or("all"),
        rate_bytes_per_s = opts.rate_bytes_per_s,
        "scrub requested, not waited for"
    );
    let group = state.registry.group().clone();
    // Quick (a thread starts and takes the slot), but it may wait for the slot's lock.
    let started = tokio::task::spawn_blocking(move || group.start_scrub(opts))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "scrub start task failed");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
        })?;
    started?;
    let status = status_json(state.registry.group().scrub_status(), &state.scrub);
    Ok((StatusCode::ACCEPTED, Json(status)).into_response())
}

/// `DELETE /api/v1/scrub`: stops the running scrub and answers the status once it stopped
/// (or after [`CANCEL_WAIT`], `running` still true); 409 when no scrub runs.
async fn cancel(State(state): State<Arc<AppState>>) -> Result<Json<ScrubStatusJson>, ApiError> {
    let group = state.registry.group().clone();
    if !group.cancel_scrub() {
        return Err(ApiError::new(StatusCode::CONFLICT, "no scrub is running"));
    }
    let deadline = tokio::time::Instant::now() + CANCEL_WAIT;
    while group.scrub_status().running && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Json(status_json(group.scrub_status(), &state.scrub)))
}

/// Sets its flag when dropped: a scrub request's handler ended, answered or not.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// An empty body asks for everything at the default rate.
fn parse_request(body: Result<Bytes, BytesRejection>) -> Result<ScrubRequest, ApiError> {
    if body.as_ref().is_ok_and(|b| b.iter().all(u8::is_ascii_whitespace)) {
        return Ok(ScrubRequest::default());
    }
    let req: ScrubRequest = parse_body(body)?;
    if let Some(v) = &req.volume {
        validate_name(v)?;
    }
    Ok(req)
}

#[cfg(test)]
#[path = "api_scrub_tests.rs"]
mod tests;
