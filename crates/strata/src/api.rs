//! The admin HTTP API under `/api/v1/`: volumes and the node status, JSON in and out.
//! Errors are `{"error": "..."}` with 400 (bad input), 404 (unknown), 409 (exists or busy),
//! 507 (no space), 503 (shutting down) or 500.
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use strata_engine::{EngineError, EngineStats, VolumeInfo};
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::adapter::{DeleteError, Registry};
use crate::config::format_size;

/// Largest request body accepted; every request of this API is a few dozen bytes.
pub const MAX_BODY_BYTES: usize = 64 << 10;
/// Most API requests handled at once (each may hold a blocking engine call).
pub const MAX_CONCURRENT_REQUESTS: usize = 64;
pub const MAX_VOLUME_NAME_LEN: usize = 64;
/// Volumes are thin; this bounds what a typo can ask of the index.
pub const MAX_VOLUME_SIZE_BYTES: u64 = 1 << 50;
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
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeJson {
    pub name: String,
    pub id: u32,
    pub size_bytes: u64,
    /// Open NBD handles on the volume.
    pub connections: usize,
    pub export_uri: String,
    /// The only policy so far: the fast tier is a write buffer destaged by fill level.
    #[serde(default)]
    pub policy: String,
    /// Bytes the volume holds on each tier (0 when the API did not say).
    #[serde(default)]
    pub fast_tier_bytes: u64,
    #[serde(default)]
    pub capacity_tier_bytes: u64,
    /// Requests served since the daemon started.
    #[serde(default)]
    pub io: Option<serde_json::Value>,
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
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    pub size_bytes: u64,
}

#[derive(Debug, Deserialize)]
pub struct DeleteParams {
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Serialize)]
pub struct VolumeConnectionsJson {
    pub name: String,
    pub connections: usize,
}

#[derive(Debug, Serialize)]
pub struct StatusJson {
    pub version: &'static str,
    /// Host request rates: averages since start and over the last minute.
    pub workload: crate::api_observe::WorkloadJson,
    pub uptime_s: u64,
    pub io_backend: String,
    pub nbd_listen: String,
    pub http_listen: String,
    pub volume_count: usize,
    pub nbd_connections_total: usize,
    pub volumes: Vec<VolumeConnectionsJson>,
    pub engine: EngineStats,
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
    fn bad_request(message: impl Into<String>) -> ApiError {
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
            EngineError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
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

impl From<DeleteError> for ApiError {
    fn from(e: DeleteError) -> ApiError {
        match e {
            DeleteError::Busy { .. } => ApiError::new(StatusCode::CONFLICT, e.to_string()),
            DeleteError::Engine(e) => e.into(),
        }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/api/v1/volumes", get(list_volumes).post(create_volume))
        .route(
            "/api/v1/volumes/{name}",
            get(get_volume).delete(delete_volume),
        )
        .route("/api/v1/volumes/{name}/resize", post(resize_volume))
        .route("/api/v1/status", get(status))
        .merge(crate::api_observe::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(GlobalConcurrencyLimitLayer::new(MAX_CONCURRENT_REQUESTS))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ))
        .with_state(state)
}

/// Mutating requests need `Authorization: Bearer TOKEN` when a token is configured; reads
/// are open (the API listens on loopback unless a token is set). The token is never logged.
async fn require_token(
    State(state): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        Some(p) if token.matches(p.trim()) => next.run(request).await,
        other => {
            let why = if other.is_some() {
                "the access token is wrong"
            } else {
                "this request needs the admin access token (Authorization: Bearer ...; strata --token or STRATA_TOKEN)"
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

/// Runs a blocking engine call off the async runtime.
pub(crate) async fn blocking<T, E>(f: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, ApiError>
where
    T: Send + 'static,
    E: Into<ApiError> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
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

fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| ApiError::new(e.status(), crate::one_line(&e.body_text())))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

pub fn validate_name(name: &str) -> Result<(), ApiError> {
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
        "invalid volume name {name:?}: use 1 to {MAX_VOLUME_NAME_LEN} letters, digits, '-', '_' or '.', starting with a letter or digit"
    )))
}

pub fn validate_size(size_bytes: u64) -> Result<(), ApiError> {
    if size_bytes == 0 || size_bytes % VOLUME_SIZE_ALIGN_BYTES != 0 {
        return Err(ApiError::bad_request(format!(
            "size_bytes ({size_bytes}) must be a positive multiple of 4096"
        )));
    }
    if size_bytes > MAX_VOLUME_SIZE_BYTES {
        return Err(ApiError::bad_request(format!(
            "size_bytes ({size_bytes}) is larger than the limit of 1 PiB"
        )));
    }
    Ok(())
}

/// `nbd://HOST:PORT`: the bound NBD address, or the host the client used to reach this API
/// when NBD listens on a wildcard address.
fn export_base(nbd_addr: SocketAddr, headers: &HeaderMap) -> String {
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

fn volume_json(state: &AppState, base: &str, v: VolumeInfo) -> VolumeJson {
    let space = state.registry.group().space(v.id).unwrap_or_default();
    let io = crate::metrics::IoTotalsJson::from(&state.registry.volume_io(v.id).snapshot());
    VolumeJson {
        connections: state.registry.connections(v.id),
        export_uri: format!("{base}/{}", v.name),
        name: v.name,
        id: v.id,
        size_bytes: v.size_bytes,
        policy: "write-buffer".into(),
        fast_tier_bytes: space.exclusive_fast_bytes + space.shared_fast_bytes,
        capacity_tier_bytes: space.exclusive_capacity_bytes + space.shared_capacity_bytes,
        io: serde_json::to_value(io).ok(),
    }
}

async fn list_volumes(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<VolumeListJson>, ApiError> {
    let base = export_base(state.nbd_addr, &headers);
    let s = state.clone();
    let volumes = blocking(move || {
        let mut vols = s.registry.group().volumes();
        vols.sort_by(|a, b| a.name.cmp(&b.name));
        Ok::<_, ApiError>(
            vols.into_iter()
                .map(|v| volume_json(&s, &base, v))
                .collect(),
        )
    })
    .await?;
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
    let base = export_base(state.nbd_addr, &headers);
    let s = state.clone();
    let volume = blocking(move || {
        let info = s.registry.group().create_volume(&req.name, req.size_bytes)?;
        tracing::info!(volume = %info.name, id = info.id, size_bytes = info.size_bytes, "volume created");
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
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<VolumeJson>, ApiError> {
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
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<VolumeJson>, ApiError> {
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
    Path(name): Path<String>,
    params: Result<Query<DeleteParams>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Query(params) =
        params.map_err(|e| ApiError::bad_request(crate::one_line(&e.body_text())))?;
    let s = state.clone();
    let deleted = name.clone();
    blocking(move || {
        s.registry.delete(&name, params.force)?;
        tracing::info!(volume = %name, force = params.force, "volume deleted");
        Ok::<_, ApiError>(())
    })
    .await?;
    Ok(Json(serde_json::json!({ "deleted": deleted })))
}

async fn status(State(state): State<Arc<AppState>>) -> Result<Json<StatusJson>, ApiError> {
    let s = state.clone();
    let (engine, volumes) = blocking(move || {
        let mut vols = s.registry.group().volumes();
        vols.sort_by(|a, b| a.name.cmp(&b.name));
        let volumes: Vec<VolumeConnectionsJson> = vols
            .into_iter()
            .map(|v| VolumeConnectionsJson {
                connections: s.registry.connections(v.id),
                name: v.name,
            })
            .collect();
        Ok::<_, ApiError>((s.registry.group().stats(), volumes))
    })
    .await?;
    Ok(Json(StatusJson {
        workload: crate::api_observe::workload(&state),
        version: env!("CARGO_PKG_VERSION"),
        uptime_s: state.started.elapsed().as_secs(),
        io_backend: state.io_backend.clone(),
        nbd_listen: state.nbd_addr.to_string(),
        http_listen: state.http_addr.to_string(),
        volume_count: volumes.len(),
        nbd_connections_total: volumes.iter().map(|v| v.connections).sum(),
        volumes,
        engine,
    }))
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
mod tests;
