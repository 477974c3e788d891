//! Plain HTTP to the daemon's admin API (ureq, bounded timeouts), and the background loads
//! the observability tests put on a volume.
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::process::{cmd, ChildGuard};

const TIMEOUT: Duration = Duration::from_secs(30);

/// One answer: status, content type and body text.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub content_type: String,
    pub www_authenticate: Option<String>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}), HTTP {}:\n{}", self.status, self.body))
    }
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .timeout(TIMEOUT)
        .build()
}

/// Any request; an HTTP error status is an answer, not a failure.
pub fn request(method: &str, url: &str, body: Option<&Value>, bearer: Option<&str>) -> Reply {
    let mut req = agent().request(method, url);
    if let Some(token) = bearer {
        req = req.set("Authorization", &format!("Bearer {token}"));
    }
    let result = match body {
        Some(b) => req.send_json(b.clone()),
        None => req.call(),
    };
    let resp = match result {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {url}: {e}"),
    };
    let status = resp.status();
    let content_type = resp.header("content-type").unwrap_or("").to_string();
    let www_authenticate = resp.header("www-authenticate").map(str::to_string);
    let body = resp
        .into_string()
        .unwrap_or_else(|e| panic!("{method} {url}: reading the body: {e}"));
    Reply {
        status,
        content_type,
        www_authenticate,
        body,
    }
}

pub fn get(url: &str) -> Reply {
    request("GET", url, None, None)
}

/// GET that must answer 200 with JSON.
pub fn get_json(url: &str) -> Value {
    let r = get(url);
    assert_eq!(r.status, 200, "GET {url}: {}", r.body);
    r.json()
}

/// A bounded background write/read load on an NBD export: fio's nbd engine at a fixed rate
/// for `runtime_s` seconds. Killed (with its process group) when dropped.
pub fn background_load(uri: &str, runtime_s: u32, scratch: &std::path::Path) -> ChildGuard {
    let mut c: Command = cmd(
        "fio",
        &[
            "--name=observe-load",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            // Without fio's random map, reads also find blocks written earlier.
            "--norandommap",
            "--bs=4k",
            "--size=64m",
            "--iodepth=4",
            "--time_based",
            &format!("--runtime={runtime_s}"),
            // Reads and writes per second: enough to see, little enough for a shared 2-core VM.
            "--rate_iops=400,200",
            "--randseed=7",
            // The job runs as a thread of this one process: fio's forked job processes start
            // sessions of their own, which a kill of the process group would not reach.
            "--thread",
            "--output=/dev/null",
        ],
    );
    c.current_dir(scratch)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    ChildGuard::spawn(&mut c)
}
