//! Tiering policies on the admin API: the partial policy objects `POST /api/v1/volumes` and
//! `PUT /api/v1/volumes/{name}/policy` accept, and the per-volume figures every volume shows.
//! A partial object fills its missing fields from a base: the defaults when a volume is
//! created, the volume's current policy when it is changed.
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde::{Deserialize, Serialize};
use strata_engine::{EngineError, Mode, Policy, VolumeFigures};

use crate::api::{
    blocking, export_base, parse_body, volume_json, ApiError, ApiPath, AppState, VolumeJson,
};
use crate::routes::Routes;

pub fn routes() -> Routes<Arc<AppState>> {
    Routes::new().put("/api/v1/volumes/{name}/policy", put_policy)
}

/// A policy with any field left out: what the API accepts.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicyPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_min_age_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_max_cold_heat: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote_after_reads: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote_window_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote_sequential_cutoff_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_limit_bytes_per_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequential_write_cutoff_bytes: Option<u64>,
}

impl PolicyPatch {
    /// `base` with every field this patch names replaced.
    pub fn apply(&self, base: &Policy) -> Policy {
        Policy {
            mode: self.mode.unwrap_or(base.mode),
            tier_min_age_s: self.tier_min_age_s.unwrap_or(base.tier_min_age_s),
            tier_max_cold_heat: self.tier_max_cold_heat.unwrap_or(base.tier_max_cold_heat),
            promote_after_reads: self.promote_after_reads.unwrap_or(base.promote_after_reads),
            promote_window_s: self.promote_window_s.unwrap_or(base.promote_window_s),
            promote_sequential_cutoff_bytes: self
                .promote_sequential_cutoff_bytes
                .unwrap_or(base.promote_sequential_cutoff_bytes),
            iops_limit: self.iops_limit.unwrap_or(base.iops_limit),
            bandwidth_limit_bytes_per_s: self
                .bandwidth_limit_bytes_per_s
                .unwrap_or(base.bandwidth_limit_bytes_per_s),
            sequential_write_cutoff_bytes: self
                .sequential_write_cutoff_bytes
                .unwrap_or(base.sequential_write_cutoff_bytes),
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == PolicyPatch::default()
    }
}

/// The policy applied to `base`, validated: a bad value is a 400 and changes nothing.
pub fn resolve_policy(patch: Option<&PolicyPatch>, base: &Policy) -> Result<Policy, ApiError> {
    let policy = patch.map_or(*base, |p| p.apply(base));
    policy.validate().map_err(ApiError::from)?;
    Ok(policy)
}

/// What a volume's policy did since the daemon started: the engine's figures as they are.
pub type FiguresJson = VolumeFigures;

async fn put_policy(
    State(state): State<Arc<AppState>>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<VolumeJson>, ApiError> {
    let patch: PolicyPatch = parse_body(body)?;
    let base = export_base(state.nbd_addr, &headers);
    let s = state.clone();
    let volume = blocking(move || {
        let group = s.registry.group();
        let info = group
            .volume(&name)
            .ok_or_else(|| EngineError::NotFound(name.clone()))?;
        // The patch applies to the policy as it stands when the change is made, so two
        // patches at once both take effect.
        let policy = group.update_policy(&name, |current| patch.apply(current))?;
        tracing::info!(volume = %name, policy = ?policy, "volume policy changed");
        Ok::<_, ApiError>(volume_json(&s, &base, info))
    })
    .await?;
    Ok(Json(volume))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_keep_what_they_do_not_name() {
        let base = Policy {
            mode: Mode::Tier,
            iops_limit: 100,
            ..Policy::default()
        };
        let patch: PolicyPatch = serde_json::from_str(r#"{"bandwidth_limit_bytes_per_s": 4096}"#).unwrap();
        let p = patch.apply(&base);
        assert_eq!(p.mode, Mode::Tier);
        assert_eq!(p.iops_limit, 100);
        assert_eq!(p.bandwidth_limit_bytes_per_s, 4096);
        assert!(PolicyPatch::default().is_empty());
        assert!(!patch.is_empty());
    }

    #[test]
    fn bad_patches_are_refused() {
        assert!(serde_json::from_str::<PolicyPatch>(r#"{"mode": "fast"}"#).is_err());
        assert!(serde_json::from_str::<PolicyPatch>(r#"{"iops": 5}"#).is_err());
        assert!(serde_json::from_str::<PolicyPatch>(r#"{"tier_max_cold_heat": 300}"#).is_err());
        let zero_window = PolicyPatch {
            promote_window_s: Some(0),
            ..PolicyPatch::default()
        };
        let e = resolve_policy(Some(&zero_window), &Policy::default()).unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert!(e.message.contains("promote_window_s"), "{}", e.message);
    }
}
