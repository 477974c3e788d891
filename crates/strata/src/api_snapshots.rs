//! Snapshots, clones and rollback in the admin API. A snapshot is a frozen, read-only image of
//! a volume (copy-on-write: taking one copies no data), exported over NBD as `VOLUME@SNAPSHOT`;
//! a clone is a new writable volume starting as a snapshot's image; a rollback returns a volume
//! to a snapshot's image. Deleting or rolling back under connected NBD clients is refused (409)
//! unless forced, which cuts those clients off (see `adapter.rs`).
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use strata_engine::{EngineError, SnapshotInfo, SpaceReport};

use crate::api::{
    blocking, export_base, parse_body, validate_name, validate_name_of, volume_json, ApiError,
    ApiPath, AppState, SpaceJson, VolumeJson,
};
use crate::metrics::IoTotalsJson;
use crate::routes::Routes;

pub fn routes() -> Routes<Arc<AppState>> {
    Routes::new()
        .get("/api/v1/snapshots", list_all)
        .get("/api/v1/volumes/{name}/snapshots", list_of_volume)
        .post("/api/v1/volumes/{name}/snapshots", create)
        .get("/api/v1/volumes/{name}/snapshots/{snapshot}", get_one)
        .delete("/api/v1/volumes/{name}/snapshots/{snapshot}", delete)
        .post("/api/v1/volumes/{name}/clone", clone_volume)
        .post("/api/v1/volumes/{name}/rollback", rollback)
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SnapshotJson {
    /// The snapshot's own name (unique per volume).
    pub name: String,
    pub volume: String,
    pub id: u32,
    /// The volume's size when the snapshot was taken.
    pub size_bytes: u64,
    pub created_unix_s: u64,
    /// `VOLUME@SNAPSHOT`, the read-only NBD export.
    pub export_name: String,
    pub export_uri: String,
    /// Open NBD handles on the snapshot's export.
    pub connections: usize,
    /// Absent in the answer to a create: counting it walks the snapshot's whole map, which
    /// would make taking a snapshot as slow as the volume is large.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub space: Option<SpaceJson>,
    /// Requests served on the snapshot's export since the daemon started.
    pub io: IoTotalsJson,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotListJson {
    pub snapshots: Vec<SnapshotJson>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    pub name: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloneRequest {
    /// The snapshot of the path's volume to clone.
    pub snapshot: String,
    /// The new volume's name.
    pub name: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    pub snapshot: String,
    /// Roll back even while NBD clients have the volume open; they are cut off.
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForceParams {
    #[serde(default)]
    pub force: bool,
}

/// A snapshot as the API shows it; `with_space` walks the snapshot's map for its space per tier.
pub fn snapshot_json(
    state: &AppState,
    base: &str,
    s: SnapshotInfo,
    with_space: bool,
) -> SnapshotJson {
    let space = with_space.then(|| state.registry.group().space(s.id).unwrap_or_default());
    snapshot_json_with(state, base, s, space)
}

/// A snapshot as the API shows it, with its space report when there is one.
fn snapshot_json_with(
    state: &AppState,
    base: &str,
    s: SnapshotInfo,
    space: Option<SpaceReport>,
) -> SnapshotJson {
    let space = space.map(SpaceJson::from);
    let export_name = format!("{}@{}", s.volume, s.name);
    SnapshotJson {
        export_uri: format!("{base}/{export_name}"),
        connections: state.registry.connections(s.id),
        io: IoTotalsJson::from(&state.registry.volume_io(s.id).snapshot()),
        space,
        export_name,
        name: s.name,
        volume: s.volume,
        id: s.id,
        size_bytes: s.size_bytes,
        created_unix_s: s.created_unix_s,
    }
}

/// Snapshots of one volume (or all), by volume name then oldest first (blocking).
fn snapshot_list(
    state: &AppState,
    base: &str,
    volume: Option<&str>,
) -> Result<Vec<SnapshotJson>, ApiError> {
    let group = state.registry.group();
    let mut snaps = group.snapshots(volume)?;
    // Stable: the engine's oldest-first order stays within each volume.
    snaps.sort_by(|a, b| a.volume.cmp(&b.volume));
    // In one walk per volume's tree of layers: one walk per snapshot went through the
    // volume's whole history once per snapshot.
    let ids: Vec<_> = snaps.iter().map(|s| s.id).collect();
    let spaces = group.space_of_views(&ids);
    Ok(snaps
        .into_iter()
        .zip(spaces)
        .map(|(s, space)| snapshot_json_with(state, base, s, Some(space.unwrap_or_default())))
        .collect())
}

async fn list_all(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<SnapshotListJson>, ApiError> {
    let base = export_base(state.nbd_addr, &headers);
    let snapshots = blocking(move || snapshot_list(&state, &base, None)).await?;
    Ok(Json(SnapshotListJson { snapshots }))
}

async fn list_of_volume(
    State(state): State<Arc<AppState>>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<SnapshotListJson>, ApiError> {
    let name = crate::api::volume_in_path(name)?;
    let base = export_base(state.nbd_addr, &headers);
    let snapshots = blocking(move || snapshot_list(&state, &base, Some(&name))).await?;
    Ok(Json(SnapshotListJson { snapshots }))
}

fn find_snapshot(state: &AppState, volume: &str, name: &str) -> Result<SnapshotInfo, EngineError> {
    state
        .registry
        .group()
        .snapshots(Some(volume))?
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| EngineError::NotFound(format!("{volume}@{name}")))
}

async fn get_one(
    State(state): State<Arc<AppState>>,
    ApiPath((volume, name)): ApiPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<SnapshotJson>, ApiError> {
    let volume = crate::api::volume_in_path(volume)?;
    let base = export_base(state.nbd_addr, &headers);
    let snapshot = blocking(move || {
        let info = find_snapshot(&state, &volume, &name)?;
        Ok::<_, ApiError>(snapshot_json(&state, &base, info, true))
    })
    .await?;
    Ok(Json(snapshot))
}

async fn create(
    State(state): State<Arc<AppState>>,
    ApiPath(volume): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let volume = crate::api::volume_in_path(volume)?;
    let req: CreateSnapshotRequest = parse_body(body)?;
    validate_name_of("snapshot", &req.name)?;
    let base = export_base(state.nbd_addr, &headers);
    let snapshot = blocking(move || {
        let started = Instant::now();
        let info = state.registry.group().create_snapshot(&volume, &req.name)?;
        let latency_us = started.elapsed().as_micros() as u64;
        tracing::info!(volume = %info.volume, snapshot = %info.name, id = info.id, latency_us, "snapshot created");
        Ok::<_, ApiError>(snapshot_json(&state, &base, info, false))
    })
    .await?;
    let location = format!(
        "/api/v1/volumes/{}/snapshots/{}",
        snapshot.volume, snapshot.name
    );
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(snapshot),
    )
        .into_response())
}

async fn delete(
    State(state): State<Arc<AppState>>,
    ApiPath((volume, name)): ApiPath<(String, String)>,
    params: Result<Query<ForceParams>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let volume = crate::api::volume_in_path(volume)?;
    let Query(params) =
        params.map_err(|e| ApiError::bad_request(crate::one_line(&e.body_text())))?;
    let export = format!("{volume}@{name}");
    blocking(move || {
        state.registry.delete_snapshot(&volume, &name, params.force)?;
        tracing::info!(volume = %volume, snapshot = %name, force = params.force, "snapshot deleted");
        Ok::<_, ApiError>(())
    })
    .await?;
    Ok(Json(serde_json::json!({ "deleted": export })))
}

async fn clone_volume(
    State(state): State<Arc<AppState>>,
    ApiPath(volume): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let volume = crate::api::volume_in_path(volume)?;
    let req: CloneRequest = parse_body(body)?;
    validate_name(&req.name)?;
    let base = export_base(state.nbd_addr, &headers);
    let cloned = blocking(move || {
        let info = state.registry.group().clone_snapshot(&volume, &req.snapshot, &req.name)?;
        tracing::info!(volume = %info.name, id = info.id, origin = %format!("{volume}@{}", req.snapshot), "volume cloned");
        Ok::<_, ApiError>(volume_json(&state, &base, info))
    })
    .await?;
    let location = format!("/api/v1/volumes/{}", cloned.name);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(cloned),
    )
        .into_response())
}

async fn rollback(
    State(state): State<Arc<AppState>>,
    ApiPath(volume): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<VolumeJson>, ApiError> {
    let volume = crate::api::volume_in_path(volume)?;
    let req: RollbackRequest = parse_body(body)?;
    let base = export_base(state.nbd_addr, &headers);
    let rolled = blocking(move || {
        let info = state.registry.rollback(&volume, &req.snapshot, req.force)?;
        tracing::info!(volume = %volume, snapshot = %req.snapshot, force = req.force, "volume rolled back");
        Ok::<_, ApiError>(volume_json(&state, &base, info))
    })
    .await?;
    Ok(Json(rolled))
}
