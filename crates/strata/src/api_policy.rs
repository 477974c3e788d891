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

    /// `apply`, refusing a patch that sets a sequential write cutoff for a volume that would
    /// be in tier mode, where it has no effect: an admin who asks for it should not believe
    /// it works. A cutoff already stored stays when a volume changes to tier mode (it applies
    /// again if the volume goes back to cache mode).
    pub fn apply_checked(&self, base: &Policy) -> Result<Policy, EngineError> {
        let policy = self.apply(base);
        let cutoff_set = self.sequential_write_cutoff_bytes.is_some_and(|b| b > 0);
        if cutoff_set && policy.mode == Mode::Tier {
            return Err(EngineError::InvalidArgument(
                "policy: the sequential write cutoff (sequential_write_cutoff_bytes, \
                 --sequential-write-cutoff) applies only in cache mode, and the volume would be \
                 in tier mode: leave it out, set it to 0, or set the mode to cache"
                    .into(),
            ));
        }
        Ok(policy)
    }
}

/// The policy applied to `base`, validated: a bad value is a 400 and changes nothing.
pub fn resolve_policy(patch: Option<&PolicyPatch>, base: &Policy) -> Result<Policy, ApiError> {
    let policy = match patch {
        Some(p) => p.apply_checked(base)?,
        None => *base,
    };
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
    let name = crate::api::volume_in_path(name)?;
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
        let policy = group.update_policy(&name, |current| patch.apply_checked(current))?;
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

    /// The write cutoff only works in cache mode: asking for one on a volume that is or
    /// becomes a tier-mode volume is refused; turning it off, or a mode change that leaves a
    /// stored cutoff dormant, is not.
    #[test]
    fn a_write_cutoff_for_a_tier_mode_volume_is_refused() {
        let cutoff = |mode: Option<Mode>, bytes: u64| PolicyPatch {
            mode,
            sequential_write_cutoff_bytes: Some(bytes),
            ..PolicyPatch::default()
        };
        let tier = Policy {
            mode: Mode::Tier,
            ..Policy::default()
        };
        let e = resolve_policy(Some(&cutoff(Some(Mode::Tier), 8 << 20)), &Policy::default())
            .unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert!(e.message.contains("only in cache mode"), "{}", e.message);
        assert!(
            cutoff(None, 8 << 20).apply_checked(&tier).is_err(),
            "a tier-mode volume"
        );
        assert!(cutoff(None, 0).apply_checked(&tier).is_ok(), "turned off");
        let back = cutoff(Some(Mode::Cache), 8 << 20)
            .apply_checked(&tier)
            .unwrap();
        assert_eq!(
            (back.mode, back.sequential_write_cutoff_bytes),
            (Mode::Cache, 8 << 20)
        );
        let dormant = PolicyPatch {
            mode: Some(Mode::Tier),
            ..PolicyPatch::default()
        };
        let p = dormant.apply_checked(&back).unwrap();
        assert_eq!(
            (p.mode, p.sequential_write_cutoff_bytes),
            (Mode::Tier, 8 << 20)
        );
    }
}
