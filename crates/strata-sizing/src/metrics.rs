//! `--from-metrics URL`: the measured average host write rate of a running daemon.
use std::time::Duration;

use crate::SizingError;

/// The daemon's status resource and the field read from it.
pub const STATUS_PATH: &str = "/api/v1/status";
pub const WRITE_RATE_POINTER: &str = "/workload/write_bytes_per_s_avg";
const TIMEOUT: Duration = Duration::from_secs(10);
/// A status document larger than this is not a Strata daemon's.
const MAX_STATUS_BYTES: u64 = 16 << 20;

/// `GET URL/api/v1/status` and its `workload.write_bytes_per_s_avg`.
pub fn measured_write_bytes_per_s(url: &str) -> Result<f64, SizingError> {
    let base = url.trim().trim_end_matches('/');
    let err = |reason: String| SizingError::Metrics {
        url: base.to_string(),
        reason,
    };
    if !base.starts_with("http://") {
        return Err(err(
            "the URL must start with http:// (the daemon's admin API)".into(),
        ));
    }
    let agent = ureq::AgentBuilder::new().timeout(TIMEOUT).build();
    let response = agent
        .get(&format!("{base}{STATUS_PATH}"))
        .call()
        .map_err(|e| match e {
            ureq::Error::Status(code, _) => err(format!("{STATUS_PATH} answered HTTP {code}")),
            ureq::Error::Transport(t) => {
                err(format!("cannot reach the daemon: {}", transport_reason(&t)))
            }
        })?;
    let mut body = String::new();
    std::io::Read::read_to_string(
        &mut std::io::Read::take(response.into_reader(), MAX_STATUS_BYTES),
        &mut body,
    )
    .map_err(|e| err(format!("reading {STATUS_PATH}: {}", crate::io_reason(&e))))?;
    let doc: serde_json::Value = serde_json::from_str(&body).map_err(|_| {
        err(format!(
            "{STATUS_PATH} is not JSON: is this a Strata daemon?"
        ))
    })?;
    let rate = doc
        .pointer(WRITE_RATE_POINTER)
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| {
            err(format!(
                "{STATUS_PATH} has no numeric workload.write_bytes_per_s_avg: is this a Strata daemon of this version?"
            ))
        })?;
    if !rate.is_finite() || rate < 0.0 {
        return Err(err(format!("workload.write_bytes_per_s_avg is {rate}")));
    }
    Ok(rate)
}

fn transport_reason(t: &ureq::Transport) -> String {
    use std::error::Error;
    let mut source = t.source();
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return crate::io_reason(io);
        }
        source = e.source();
    }
    crate::one_line(&t.to_string())
}
