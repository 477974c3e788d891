//! The Strata daemon behind a target, if there is one: found from `--strata-api URL` or by
//! asking the default admin port on the target's host whether it serves that NBD port; then
//! read after every step through `GET /api/v1/history` (one sample a second, kept 15 minutes).
use std::time::Duration;

use serde::Deserialize;

use crate::report::{SeriesSample, StrataSeries};
use crate::workload::TargetUri;
use crate::BenchError;

const DEFAULT_ADMIN_PORT: u16 = 9090;
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Deserialize)]
struct Status {
    nbd_listen: String,
}

#[derive(Deserialize)]
struct History {
    samples: Vec<Sample>,
}

#[derive(Deserialize)]
struct Device {
    tier: String,
    read_bytes_per_s: f64,
    write_bytes_per_s: f64,
}

/// The fields of the daemon's history sample that the report uses.
#[derive(Deserialize)]
struct Sample {
    t_unix_ms: u64,
    read_bytes_per_s: f64,
    write_bytes_per_s: f64,
    log_fill_ratio: f64,
    fill_ratio_low: f64,
    fill_ratio_high: f64,
    destage_rate_bytes_per_s: f64,
    admission_throttled: bool,
    devices: Vec<Device>,
}

pub struct StrataApi {
    base: String,
    agent: ureq::Agent,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(timeout).build()
}

impl StrataApi {
    /// `--strata-api URL`: must answer, or the run stops before it starts.
    pub fn given(url: &str) -> Result<StrataApi, BenchError> {
        let api = StrataApi {
            base: url.trim_end_matches('/').to_string(),
            agent: agent(REQUEST_TIMEOUT),
        };
        api.status()
            .map_err(|e| BenchError::Invalid(format!("--strata-api {url}: {e}")))?;
        Ok(api)
    }

    /// A daemon on the target's host at the default admin port that serves the target's port.
    pub fn detect(target: &TargetUri) -> Option<StrataApi> {
        let host = if target.host.contains(':') {
            format!("[{}]", target.host)
        } else {
            target.host.clone()
        };
        let api = StrataApi {
            base: format!("http://{host}:{DEFAULT_ADMIN_PORT}"),
            agent: agent(PROBE_TIMEOUT),
        };
        let status = api.status().ok()?;
        let port = status.nbd_listen.rsplit(':').next()?.parse::<u16>().ok()?;
        (port == target.port).then(|| StrataApi {
            agent: agent(REQUEST_TIMEOUT),
            ..api
        })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    fn status(&self) -> Result<Status, String> {
        self.get_json("/api/v1/status")
    }

    fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let url = format!("{}{path}", self.base);
        let resp = self.agent.get(&url).call().map_err(|e| short_http(&e))?;
        resp.into_json::<T>()
            .map_err(|e| format!("{url}: unexpected answer: {e}"))
    }

    /// Samples after `since_unix_ms`, as report rows relative to `run_start_unix_ms`.
    pub fn samples_since(
        &self,
        since_unix_ms: u64,
        run_start_unix_ms: u64,
    ) -> Result<Vec<SeriesSample>, String> {
        let h: History =
            self.get_json(&format!("/api/v1/history?since_unix_ms={since_unix_ms}"))?;
        Ok(h.samples
            .into_iter()
            .map(|s| convert(s, run_start_unix_ms))
            .collect())
    }

    /// Device names, fast first (emulated ones say so in their names).
    pub fn device_names(&self) -> Result<Vec<String>, String> {
        // Read loosely: the daemon's device entries carry many more fields (and may repeat one).
        let list: serde_json::Value = self.get_json("/api/v1/devices")?;
        let devices = list["devices"]
            .as_array()
            .ok_or("/api/v1/devices: no device list")?;
        Ok(devices
            .iter()
            .filter_map(|d| d["name"].as_str().map(str::to_string))
            .collect())
    }
}

fn short_http(e: &ureq::Error) -> String {
    match e {
        ureq::Error::Status(code, r) => format!("{} answered HTTP {code}", r.get_url()),
        ureq::Error::Transport(t) => crate::one_line(&t.to_string()),
    }
}

fn convert(s: Sample, run_start_unix_ms: u64) -> SeriesSample {
    let sum = |tier: &str, f: fn(&Device) -> f64| {
        s.devices
            .iter()
            .filter(|d| d.tier == tier)
            .map(f)
            .sum::<f64>()
    };
    SeriesSample {
        t_unix_ms: s.t_unix_ms,
        t_s: (s.t_unix_ms as f64 - run_start_unix_ms as f64) / 1000.0,
        log_fill_ratio: s.log_fill_ratio,
        fill_ratio_low: s.fill_ratio_low,
        fill_ratio_high: s.fill_ratio_high,
        destage_rate_bytes_per_s: s.destage_rate_bytes_per_s,
        admission_throttled: s.admission_throttled,
        host_read_bytes_per_s: s.read_bytes_per_s,
        host_write_bytes_per_s: s.write_bytes_per_s,
        fast_read_bytes_per_s: sum("fast", |d| d.read_bytes_per_s),
        fast_write_bytes_per_s: sum("fast", |d| d.write_bytes_per_s),
        capacity_read_bytes_per_s: sum("capacity", |d| d.read_bytes_per_s),
        capacity_write_bytes_per_s: sum("capacity", |d| d.write_bytes_per_s),
    }
}

/// Collects a side's series step by step.
pub struct SeriesCollector {
    pub api: StrataApi,
    pub series: StrataSeries,
    last_unix_ms: u64,
}

impl SeriesCollector {
    /// Fails when the daemon does not list its devices: the report must say which are emulated.
    pub fn new(api: StrataApi, run_start_unix_ms: u64) -> Result<SeriesCollector, BenchError> {
        let devices = api
            .device_names()
            .map_err(|e| BenchError::Target(format!("Strata API {}: {e}", api.url())))?;
        let emulated_devices = devices
            .iter()
            .filter(|d| d.contains("emulated"))
            .cloned()
            .collect();
        Ok(SeriesCollector {
            series: StrataSeries {
                api_url: api.url().to_string(),
                devices,
                emulated_devices,
                samples: Vec::new(),
            },
            api,
            last_unix_ms: run_start_unix_ms.saturating_sub(1000),
        })
    }

    /// Appends the samples taken since the last call; a failed request costs only those.
    pub fn collect(&mut self, run_start_unix_ms: u64) -> Option<String> {
        match self.api.samples_since(self.last_unix_ms, run_start_unix_ms) {
            Ok(samples) => {
                if let Some(last) = samples.last() {
                    self.last_unix_ms = last.t_unix_ms;
                }
                self.series.samples.extend(samples);
                None
            }
            Err(e) => Some(e),
        }
    }
}
