//! `--from-metrics URL`: the measured average host write rate of a running daemon.
use std::time::Duration;

use crate::SizingError;

/// The daemon's status resource and the field read from it.
pub const STATUS_PATH: &str = "/api/v1/status";
pub const WRITE_RATE_POINTER: &str = "/workload/write_bytes_per_s_avg";
const TIMEOUT: Duration = Duration::from_secs(10);
/// A status document larger than this is not a Strata daemon's.
const MAX_STATUS_BYTES: u64 = 16 << 20;

/// The daemon's admin address in a URL given to `--from-metrics`: the address itself, or the
/// URL of its Prometheus page or of its status resource (the flag's name invites the URL a
/// Prometheus scrape uses, `http://host:9090/metrics`).
fn daemon_base(url: &str) -> &str {
    let base = url.trim().trim_end_matches('/');
    for page in ["/metrics", STATUS_PATH] {
        if let Some(daemon) = base.strip_suffix(page) {
            return daemon;
        }
    }
    base
}

/// `GET URL/api/v1/status` and its `workload.write_bytes_per_s_avg`.
pub fn measured_write_bytes_per_s(url: &str) -> Result<f64, SizingError> {
    let base = daemon_base(url);
    let err = |reason: String| SizingError::Metrics {
        url: url.trim().to_string(),
        reason,
    };
    if !base.starts_with("http://") {
        // The flag's value is wrong, nothing failed: a usage error, as `Invalid` is.
        return Err(SizingError::Invalid(format!(
            "--from-metrics {}: the URL must start with http:// (the daemon's admin API)",
            url.trim()
        )));
    }
    let agent = ureq::AgentBuilder::new().timeout(TIMEOUT).build();
    let response = agent
        .get(&format!("{base}{STATUS_PATH}"))
        .call()
        .map_err(|e| match e {
            ureq::Error::Status(code, _) => {
                err(format!("{base}{STATUS_PATH} answered HTTP {code}"))
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};

    /// A one-request daemon on a free port: the status document at STATUS_PATH, 404 elsewhere.
    /// Returns its address and the path it was asked for.
    fn one_status_request() -> (String, std::thread::JoinHandle<String>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let served = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request_line = String::new();
            BufReader::new(&conn).read_line(&mut request_line).unwrap();
            let path = request_line.split(' ').nth(1).unwrap_or("").to_string();
            let body = r#"{"workload": {"write_bytes_per_s_avg": 1048576.0}}"#;
            let status = if path == STATUS_PATH {
                "200 OK"
            } else {
                "404 Not Found"
            };
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            conn.write_all(reply.as_bytes()).unwrap();
            path
        });
        (addr, served)
    }

    #[test]
    fn the_prometheus_pages_url_names_the_daemon_too() {
        for page in ["", "/", "/metrics", "/metrics/", "/api/v1/status"] {
            let (addr, served) = one_status_request();
            let url = format!("http://{addr}{page}");
            let rate = measured_write_bytes_per_s(&url);
            let path = served.join().unwrap();
            assert_eq!(path, STATUS_PATH, "{url}");
            assert_eq!(rate.unwrap(), 1_048_576.0, "{url}");
        }
    }

    #[test]
    fn an_http_error_names_the_url_asked() {
        let (addr, served) = one_status_request();
        let url = format!("http://{addr}/prefix");
        let e = measured_write_bytes_per_s(&url).unwrap_err().to_string();
        served.join().unwrap();
        assert!(
            e.contains(&format!(
                "http://{addr}/prefix{STATUS_PATH} answered HTTP 404"
            )),
            "{e}"
        );
    }
}
