//! The admin HTTP API under `/api/v1/`: volumes, the router with its token check, JSON in and
//! out. Snapshots, clones and rollback live in `api_snapshots.rs`; scrub in `api_scrub.rs`; what
//! the node shows about itself in `api_observe.rs`. Errors are `{"error": "..."}` with 400 (bad
//! input, including a write to a read-only snapshot), 401 (token), 403 (a change sent by a web
//! page of another origin, without a token), 404 (unknown), 421 (a request naming a host that
//! is not loopback, to a loopback listener, without the token), 409 (exists,
//! busy, a volume that still has snapshots, or a scrub already running), 507 (no space), 503
//! (shutting down) or 500.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use strata_engine::{EngineError, SpaceReport, VolumeInfo};
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::adapter::{ChangeError, Registry};
use crate::config::format_size;
use crate::metrics::IoTotalsJson;
use crate::routes::Routes;

/// Largest request body accepted; every request of this API is a few dozen bytes.
pub const MAX_BODY_BYTES: usize = 64 << 10;
/// Most API requests handled at once (each may hold a blocking engine call).
pub const MAX_CONCURRENT_REQUESTS: usize = 64;
pub const MAX_VOLUME_NAME_LEN: usize = 64;
/// Volumes are thin; the engine's bound (256 TiB), checked here so the refusal names it.
pub const MAX_VOLUME_SIZE_BYTES: u64 = strata_engine::MAX_VOLUME_BYTES;
const VOLUME_SIZE_ALIGN_BYTES: u64 = 4096;

pub struct AppState {
    pub registry: Arc<Registry>,
    pub started: Instant,
    pub nbd_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub io_backend: String,
    pub history: Arc<crate::history::History>,
    /// Checked on every mutating request when set.
    pub token: Option<crate::config::Token>,
    pub devices: Vec<crate::wear::DeviceIdentity>,
    /// The background scrub's settings; an API scrub without a rate uses its rate.
    pub scrub: crate::api_scrub::ScrubConfig,
    /// Turns true when the daemon begins to shut down (a closed channel means never).
    pub stopping: tokio::sync::watch::Receiver<bool>,
    /// The read cache's share of the write log and why (`--read-cache`).
    pub read_cache: crate::read_cache::ReadCacheDecision,
    /// Space reports for `/metrics` and the volume list (see space_cache.rs).
    pub space: crate::space_cache::SpaceCache,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct VolumeJson {
    pub name: String,
    pub id: u32,
    pub size_bytes: u64,
    /// Open NBD handles on the volume.
    pub connections: usize,
    pub export_uri: String,
    /// Tiering policy: mode, promotion and I/O limits (see api_policy.rs).
    pub policy: strata_engine::Policy,
    /// What the policy did since the daemon started: hit ratio, promotions, residency.
    pub figures: crate::api_policy::FiguresJson,
    /// Bytes of the volume's data held on each tier (exclusive and shared together).
    pub fast_tier_bytes: u64,
    pub capacity_tier_bytes: u64,
    /// The same bytes split into what only this volume holds and what it shares with its
    /// snapshots (or, for a clone, with its origin).
    pub space: SpaceJson,
    pub snapshot_count: usize,
    /// Requests served since the daemon started.
    pub io: IoTotalsJson,
}

/// What a volume or snapshot holds on each tier. Exclusive bytes are read by no other volume or
/// snapshot, so deleting this one gives them back; shared bytes are also read by another.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SpaceJson {
    pub exclusive_fast_bytes: u64,
    pub exclusive_capacity_bytes: u64,
    pub shared_fast_bytes: u64,
    pub shared_capacity_bytes: u64,
}

impl From<SpaceReport> for SpaceJson {
    fn from(r: SpaceReport) -> SpaceJson {
        SpaceJson {
            exclusive_fast_bytes: r.exclusive_fast_bytes,
            exclusive_capacity_bytes: r.exclusive_capacity_bytes,
            shared_fast_bytes: r.shared_fast_bytes,
            shared_capacity_bytes: r.shared_capacity_bytes,
        }
    }
}

impl SpaceJson {
    pub fn fast_bytes(&self) -> u64 {
        self.exclusive_fast_bytes + self.shared_fast_bytes
    }
    pub fn capacity_bytes(&self) -> u64 {
        self.exclusive_capacity_bytes + self.shared_capacity_bytes
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct VolumeListJson {
    pub volumes: Vec<VolumeJson>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    pub name: String,
    pub size_bytes: u64,
    /// Partial: missing fields take the defaults.
    #[serde(default)]
    pub policy: Option<crate::api_policy::PolicyPatch>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    pub size_bytes: u64,
}

/// Unknown parameters are refused, as in every body and in a snapshot's delete: a typo such as
/// `?with_snapshot=true` must not be taken for a plain delete.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteParams {
    #[serde(default)]
    pub force: bool,
    /// Delete the volume's snapshots too; without it a volume with snapshots is refused.
    #[serde(default)]
    pub with_snapshots: bool,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
    pub(crate) fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(serde_json::json!({ "error": self.message })),
        )
            .into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        let status = match &e {
            EngineError::NotFound(_) => StatusCode::NOT_FOUND,
            EngineError::AlreadyExists(_) | EngineError::InUse(_) => StatusCode::CONFLICT,
            EngineError::ReadOnly(_) => StatusCode::BAD_REQUEST,
            EngineError::InvalidArgument(_) | EngineError::OutOfRange { .. } => {
                StatusCode::BAD_REQUEST
            }
            EngineError::NoSpace => StatusCode::INSUFFICIENT_STORAGE,
            EngineError::ShuttingDown | EngineError::Cancelled(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            EngineError::Corrupt(_)
            | EngineError::Failed(_)
            | EngineError::Device(_)
            | EngineError::Format(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(error = %e, "admin API request failed");
        }
        ApiError::new(status, e.to_string())
    }
}

impl From<ChangeError> for ApiError {
    fn from(e: ChangeError) -> ApiError {
        match e {
            ChangeError::Busy { .. } => ApiError::new(StatusCode::CONFLICT, e.to_string()),
            ChangeError::Engine(e) => e.into(),
        }
    }
}

/// Every route of the admin port, recorded as it is added.
fn routes() -> Routes<Arc<AppState>> {
    Routes::new()
        .get("/api/v1/volumes", list_volumes)
        .post("/api/v1/volumes", create_volume)
        .get("/api/v1/volumes/{name}", get_volume)
        .delete("/api/v1/volumes/{name}", delete_volume)
        .post("/api/v1/volumes/{name}/resize", resize_volume)
        .merge(crate::api_policy::routes())
        .merge(crate::api_snapshots::routes())
        .merge(crate::api_scrub::routes())
        .merge(crate::api_observe::routes())
}

/// The (method, path) pairs the admin port serves, sorted.
#[cfg(test)]
pub fn served_routes() -> Vec<crate::routes::Route> {
    routes().served()
}

pub fn router(state: Arc<AppState>) -> Router {
    router_with_body_deadline(state, crate::api_body::BODY_READ_TIMEOUT)
}

/// The router, its clients given `body_deadline` to send a request's body (the tests' is short).
pub(crate) fn router_with_body_deadline(state: Arc<AppState>, body_deadline: Duration) -> Router {
    routes()
        .into_router()
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(GlobalConcurrencyLimitLayer::new(MAX_CONCURRENT_REQUESTS))
        // Outside the limit: a request takes a place only once its body is here.
        .layer(axum::middleware::from_fn_with_state(
            body_deadline,
            crate::api_body::read_body_in_time,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ))
        .with_state(state)
}

/// Mutating requests need `Authorization: Bearer TOKEN` when a token is configured; reads
/// are open (the API listens on loopback unless a token is set). The token is never logged.
/// Without a token, a mutating request from a web page of another origin is refused; on a
/// loopback listener, a request naming a host that is not a loopback name is refused unless it
/// carries the token (DNS rebinding; both in `api_origin.rs`).
/// The credentials of an `Authorization: Bearer ...` value; the scheme's name is matched
/// without regard to case (RFC 9110 §11.1), so `bearer` and `BEARER` do too.
fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(rest)
}

async fn require_token(
    State(state): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_credentials)
        .map(str::trim);
    let token_ok = match (&state.token, presented) {
        (Some(token), Some(p)) => token.matches(p),
        _ => false,
    };
    if state.token.is_none() {
        if let Some(why) = crate::api_origin::browser_refusal(request.method(), request.headers()) {
            tracing::warn!(method = %request.method(), path = request.uri().path(), "admin request refused: sent by a web page of another origin");
            return ApiError::new(StatusCode::FORBIDDEN, why).into_response();
        }
    }
    if !token_ok {
        if let Some(why) = crate::api_origin::rebinding_refusal(state.http_addr, request.headers())
        {
            tracing::warn!(method = %request.method(), path = request.uri().path(), "admin request refused: it names a host that is not loopback");
            return ApiError::new(StatusCode::MISDIRECTED_REQUEST, why).into_response();
        }
    }
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    match presented {
        Some(p) if token.matches(p) => next.run(request).await,
        other => {
            let why = if other.is_some() {
                "the access token is wrong"
            } else {
                "this request needs the admin access token (Authorization: Bearer ...; strata --token-file FILE or STRATA_TOKEN)"
            };
            tracing::warn!(method = %request.method(), path = request.uri().path(), "admin request refused: bad or missing token");
            let mut resp = ApiError::new(StatusCode::UNAUTHORIZED, why).into_response();
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
            resp
        }
    }
}

/// Engine calls of admin requests running now. Shutdown waits for these, not for connections:
/// a client that sent half a request holds a connection open but has started nothing.
static ENGINE_CALLS_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// One engine call counted in [`ENGINE_CALLS_IN_FLIGHT`] until dropped.
struct EngineCall;

impl EngineCall {
    fn start() -> EngineCall {
        ENGINE_CALLS_IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
        EngineCall
    }
}

impl Drop for EngineCall {
    fn drop(&mut self) {
        ENGINE_CALLS_IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Engine calls of admin requests still running (they go on when their client goes away).
pub fn engine_calls_in_flight() -> usize {
    ENGINE_CALLS_IN_FLIGHT.load(Ordering::Acquire)
}

/// Runs a blocking engine call off the async runtime.
pub(crate) async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, ApiError>
where
    T: Send + 'static,
    E: Into<ApiError> + Send + 'static,
{
    let call = EngineCall::start();
    let counted = move || {
        let _call = call;
        f()
    };
    match tokio::task::spawn_blocking(counted).await {
        Ok(r) => r.map_err(Into::into),
        Err(e) => {
            tracing::error!(error = %e, "admin API task failed");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal error",
            ))
        }
    }
}

/// `Path`, whose rejection (a parameter that does not decode, e.g. `%FF`) is a JSON error
/// like every other answer of the API, not axum's plain text.
pub(crate) struct ApiPath<T>(pub T);

impl<S, T> axum::extract::FromRequestParts<S> for ApiPath<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(ApiPath(value)),
            Err(e) => Err(ApiError::new(e.status(), crate::one_line(&e.body_text()))),
        }
    }
}

pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| ApiError::new(e.status(), crate::one_line(&e.body_text())))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// A volume named in a path. A name with `@` is how a snapshot is named, never a volume: it is
/// not found as a volume, and the answer says where that snapshot is (the engine's error
/// would call it a snapshot not found, which is wrong when the snapshot exists).
pub fn volume_in_path(name: String) -> Result<String, ApiError> {
    let Some((volume, snapshot)) = name.split_once('@') else {
        return Ok(name);
    };
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "volume {name:?} not found: volume names hold no '@'; the snapshot {name} is at /api/v1/volumes/{volume}/snapshots/{snapshot}"
        ),
    ))
}

pub fn validate_name(name: &str) -> Result<(), ApiError> {
    validate_name_of("volume", name)
}

/// Volume and snapshot names: 1 to 64 URL-safe characters (`@` separates them in exports).
pub fn validate_name_of(kind: &str, name: &str) -> Result<(), ApiError> {
    let ok_len = !name.is_empty() && name.len() <= MAX_VOLUME_NAME_LEN;
    let ok_first = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    let ok_chars = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok_len && ok_first && ok_chars {
        return Ok(());
    }
    Err(ApiError::bad_request(format!(
        "invalid {kind} name {name:?}: use 1 to {MAX_VOLUME_NAME_LEN} letters, digits, '-', '_' or '.', starting with a letter or digit"
    )))
}

pub fn validate_size(size_bytes: u64) -> Result<(), ApiError> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(VOLUME_SIZE_ALIGN_BYTES) {
        return Err(ApiError::bad_request(format!(
            "size ({size_bytes} bytes) must be a positive multiple of 4 KiB (4096 bytes)"
        )));
    }
    if size_bytes > MAX_VOLUME_SIZE_BYTES {
        return Err(ApiError::bad_request(format!(
            "size ({size_bytes} bytes, {}) is larger than the limit of {}",
            crate::config::format_size(size_bytes),
            crate::config::format_size(MAX_VOLUME_SIZE_BYTES)
        )));
    }
    Ok(())
}

/// `nbd://HOST:PORT`: the bound NBD address, or the host the client used to reach this API
/// when NBD listens on a wildcard address.
pub fn export_base(nbd_addr: SocketAddr, headers: &HeaderMap) -> String {
    let port = nbd_addr.port();
    if !nbd_addr.ip().is_unspecified() {
        return format!("nbd://{nbd_addr}");
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.parse::<Uri>().ok())
        .and_then(|u| u.host().map(str::to_string))
        .unwrap_or_else(|| "127.0.0.1".to_string());
    format!("nbd://{host}:{port}")
}

/// A volume as the API shows it (blocking: walks the volume's index for its space per tier).
pub fn volume_json(state: &AppState, base: &str, v: VolumeInfo) -> VolumeJson {
    let group = state.registry.group();
    let space = group.space(v.id).unwrap_or_default();
    let snapshot_count = group.snapshots(Some(&v.name)).map_or(0, |s| s.len());
    volume_json_with(state, base, v, space, snapshot_count)
}

fn volume_json_with(
    state: &AppState,
    base: &str,
    v: VolumeInfo,
    space: SpaceReport,
    snapshot_count: usize,
) -> VolumeJson {
    let group = state.registry.group();
    let space = SpaceJson::from(space);
    let io = IoTotalsJson::from(&state.registry.volume_io(v.id).snapshot());
    let policy = group.policy(&v.name).unwrap_or_default();
    let figures = group.volume_figures(&v.name).unwrap_or_default();
    VolumeJson {
        connections: state.registry.connections(v.id),
        export_uri: format!("{base}/{}", v.name),
        name: v.name,
        id: v.id,
        size_bytes: v.size_bytes,
        policy,
        figures,
        fast_tier_bytes: space.fast_bytes(),
        capacity_tier_bytes: space.capacity_bytes(),
        space,
        snapshot_count,
        io,
    }
}

/// Every volume, sorted by name (blocking). Space figures come from `state.space`: a large
/// volume's may be a little old (space_cache.rs).
pub fn all_volumes(state: &AppState, base: &str) -> Vec<VolumeJson> {
    let group = state.registry.group();
    let mut vols = group.volumes();
    vols.sort_by(|a, b| a.name.cmp(&b.name));
    let ids: Vec<_> = vols.iter().map(|v| v.id).collect();
    let spaces = state.space.get_many(group, &ids);
    // Counted from one list: asking for each volume's snapshots went through them all once
    // per volume.
    let mut counts: HashMap<String, usize> = HashMap::new();
    for s in group.snapshots(None).unwrap_or_default() {
        *counts.entry(s.volume).or_default() += 1;
    }
    vols.into_iter()
        .zip(spaces)
        .map(|(v, space)| {
            let count = counts.get(&v.name).copied().unwrap_or(0);
            volume_json_with(state, base, v, space, count)
        })
        .collect()
}

async fn list_volumes(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<VolumeListJson>, ApiError> {
    let base = export_base(state.nbd_addr, &headers);
    let volumes = blocking(move || Ok::<_, ApiError>(all_volumes(&state, &base))).await?;
    Ok(Json(VolumeListJson { volumes }))
}

async fn create_volume(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CreateRequest = parse_body(body)?;
    validate_name(&req.name)?;
    validate_size(req.size_bytes)?;
    let policy = crate::api_policy::resolve_policy(req.policy.as_ref(), &Default::default())?;
    let base = export_base(state.nbd_addr, &headers);
    let s = state.clone();
    let volume = blocking(move || {
        let group = s.registry.group();
        let info = group.create_volume_with_policy(&req.name, req.size_bytes, &policy)?;
        tracing::info!(volume = %info.name, id = info.id, size_bytes = info.size_bytes, mode = ?policy.mode, "volume created");
        Ok::<_, ApiError>(volume_json(&s, &base, info))
    })
    .await?;
    let location = format!("/api/v1/volumes/{}", volume.name);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(volume),
    )
        .into_response())
}

async fn get_volume(
    State(state): State<Arc<AppState>>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<VolumeJson>, ApiError> {
    let name = crate::api::volume_in_path(name)?;
    let base = export_base(state.nbd_addr, &headers);
    let s = state.clone();
    let volume = blocking(move || {
        let info = s
            .registry
            .group()
            .volume(&name)
            .ok_or(EngineError::NotFound(name))?;
        Ok::<_, ApiError>(volume_json(&s, &base, info))
    })
    .await?;
    Ok(Json(volume))
}

async fn resize_volume(
    State(state): State<Arc<AppState>>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<VolumeJson>, ApiError> {
    let name = crate::api::volume_in_path(name)?;
    let req: ResizeRequest = parse_body(body)?;
    validate_size(req.size_bytes)?;
    let base = export_base(state.nbd_addr, &headers);
    let s = state.clone();
    let volume = blocking(move || {
        let group = s.registry.group();
        let current = group
            .volume(&name)
            .ok_or_else(|| EngineError::NotFound(name.clone()))?;
        if req.size_bytes < current.size_bytes {
            return Err(ApiError::bad_request(format!(
                "volume {name:?} is {}; shrinking it to {} is not supported",
                format_size(current.size_bytes),
                format_size(req.size_bytes)
            )));
        }
        let info = group.resize_volume(&name, req.size_bytes)?;
        tracing::info!(volume = %info.name, size_bytes = info.size_bytes, "volume resized");
        Ok(volume_json(&s, &base, info))
    })
    .await?;
    Ok(Json(volume))
}

async fn delete_volume(
    State(state): State<Arc<AppState>>,
    ApiPath(name): ApiPath<String>,
    params: Result<Query<DeleteParams>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let name = crate::api::volume_in_path(name)?;
    let Query(params) =
        params.map_err(|e| ApiError::bad_request(crate::one_line(&e.body_text())))?;
    let s = state.clone();
    let deleted = name.clone();
    blocking(move || {
        s.registry.delete(&name, params.force, params.with_snapshots)?;
        tracing::info!(volume = %name, force = params.force, with_snapshots = params.with_snapshots, "volume deleted");
        Ok::<_, ApiError>(())
    })
    .await?;
    Ok(Json(serde_json::json!({ "deleted": deleted })))
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {}", uri.path()),
    )
}

#[cfg(test)]
#[path = "api_tests.rs"]
pub(crate) mod tests;
