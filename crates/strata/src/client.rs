//! The CLI side of the admin API: `strata volume ...`, `strata snapshot ...` (in
//! `client_snapshot.rs`), `strata scrub` (in `client_scrub.rs`) and `strata status`. Requests carry the admin token (`--token-file` or
//! `STRATA_TOKEN`) when one is given; the daemon checks it on every mutating request.
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::api::{SpaceJson, VolumeJson, VolumeListJson};
use crate::config::format_size;
use crate::VolumeCommand;

#[path = "client_snapshot.rs"]
mod snapshot;
#[path = "client_scrub.rs"]
mod scrub;

pub use scrub::{DamageFound, EXIT_DAMAGE_FOUND};

/// The daemon refused a request: its HTTP status and its reason (`--json` prints both).
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub reason: String,
    /// What a daemon still starting is doing (its 503 answers say; startup.rs).
    pub starting: Option<String>,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for Refused {}
pub use snapshot::utc_time;
#[path = "client_policy.rs"]
pub mod policy;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A delete waits for the volume's in-flight I/O, so allow the daemon some time.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
const MAX_RESPONSE_BYTES: u64 = 16 << 20;
/// How long a command waits for a daemon that answers it is starting (replaying its log).
const START_WAIT: Duration = Duration::from_secs(120);
/// A command that has waited this long for a starting daemon says so, once, on stderr.
const START_NOTE_AFTER: Duration = Duration::from_secs(2);
/// Between two requests to a starting daemon.
const START_POLL: Duration = Duration::from_millis(200);

pub struct Client {
    base: String,
    json: bool,
    /// How long to wait for a daemon that is starting ([`START_WAIT`]).
    start_wait: Duration,
    /// The request deadline of `agent` ([`REQUEST_TIMEOUT`]), for the reason given past it.
    request_timeout: Duration,
    agent: ureq::Agent,
    /// For requests that last as long as the work they ask for (a scrub): no deadline once
    /// connected. A daemon that dies closes the connection, which ends the wait.
    patient_agent: ureq::Agent,
    /// `Bearer TOKEN`, sent with every request.
    authorization: Option<String>,
}

/// Largest token file read; a token is one short line.
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// The admin token: the first line of `token_file`, else `env_token` (STRATA_TOKEN). Errors
/// name the file, never the token.
pub fn load_token(token_file: Option<&Path>, env_token: Option<&str>) -> Result<Option<String>> {
    let (secret, origin) = match token_file {
        Some(path) => {
            let mut text = String::new();
            std::fs::File::open(path)
                .and_then(|f| f.take(MAX_TOKEN_FILE_BYTES).read_to_string(&mut text))
                .map_err(|e| {
                    anyhow!("cannot read the token file {}: {}", path.display(), crate::io_reason(&e))
                })?;
            let first = text.lines().next().unwrap_or("").trim().to_string();
            (first, format!("the token file {}", path.display()))
        }
        None => match env_token {
            Some(t) => (t.trim().to_string(), "STRATA_TOKEN".to_string()),
            None => return Ok(None),
        },
    };
    if secret.is_empty() {
        bail!("{origin} holds no token");
    }
    if !secret.chars().all(|c| c.is_ascii_graphic()) {
        bail!("the token in {origin} must be printable ASCII without spaces");
    }
    Ok(Some(secret))
}

/// The admin API's base URL from `--server`: `http://HOST[:PORT]` (the scheme in any case, as
/// URLs allow), without a trailing slash; a port must be 1 to 65535.
fn server_base(server: &str) -> Result<String> {
    let trimmed = server.trim().trim_end_matches('/');
    let scheme_end = trimmed.find("://").map_or(0, |i| i + 3);
    let (scheme, rest) = trimmed.split_at(scheme_end);
    if scheme.eq_ignore_ascii_case("https://") {
        bail!("{trimmed}: https is not supported; the admin API is plain HTTP (use http://)");
    }
    if !scheme.eq_ignore_ascii_case("http://") || rest.is_empty() {
        bail!("invalid server URL {server:?}: expected http://HOST:PORT");
    }
    let authority = rest.split('/').next().unwrap_or(rest);
    // The port follows the last colon, unless that colon is inside a bracketed IPv6 address.
    if let Some((_, port)) = authority.rsplit_once(':').filter(|(_, p)| !p.contains(']')) {
        if !matches!(port.parse::<u16>(), Ok(p) if p > 0) {
            bail!("invalid server URL {server:?}: port {port:?} is not a number from 1 to 65535");
        }
    }
    Ok(format!("http://{rest}"))
}

impl Client {
    pub fn new(server: &str, json: bool) -> Result<Client> {
        Client::with_waits(server, json, REQUEST_TIMEOUT, START_WAIT)
    }

    /// A client with other deadlines than the commands' (tests).
    fn with_waits(
        server: &str,
        json: bool,
        request_timeout: Duration,
        start_wait: Duration,
    ) -> Result<Client> {
        let base = server_base(server)?;
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT)
            .timeout(request_timeout)
            .build();
        let patient_agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT)
            .build();
        Ok(Client {
            base,
            json,
            start_wait,
            request_timeout,
            agent,
            patient_agent,
            authorization: None,
        })
    }

    pub fn with_token(mut self, token: Option<String>) -> Client {
        self.authorization = token.map(|t| format!("Bearer {t}"));
        self
    }

    pub fn volume(&self, cmd: VolumeCommand) -> Result<()> {
        match cmd {
            VolumeCommand::Create { name, size, policy } => {
                let mut body = json!({ "name": name, "size_bytes": size });
                let patch = policy.patch();
                if !patch.is_empty() {
                    body["policy"] = serde_json::to_value(&patch)?;
                }
                let v = self.call("POST", "/api/v1/volumes", Some(body))?;
                self.print(&v, |v| {
                    let v: VolumeJson = serde_json::from_value(v.clone())?;
                    println!("{}", created_line(&v, None));
                    Ok(())
                })
            }
            VolumeCommand::List => {
                let v = self.call("GET", "/api/v1/volumes", None)?;
                self.print(&v, |v| {
                    let list: VolumeListJson = serde_json::from_value(v.clone())?;
                    print!("{}", volume_table(&list.volumes));
                    Ok(())
                })
            }
            VolumeCommand::Info { name } => {
                let v = self.call(
                    "GET",
                    &format!("/api/v1/volumes/{}", path_segment("volume", &name)?),
                    None,
                )?;
                self.print(&v, |v| {
                    let v: VolumeJson = serde_json::from_value(v.clone())?;
                    print!("{}", volume_info(&v, self.node_without_read_cache()));
                    Ok(())
                })
            }
            VolumeCommand::Resize { name, size } => {
                let volume = path_segment("volume", &name)?;
                let path = format!("/api/v1/volumes/{volume}/resize");
                let before = self.call("GET", &format!("/api/v1/volumes/{volume}"), None)?;
                let was = before["size_bytes"].as_u64();
                let v = self.call("POST", &path, Some(json!({ "size_bytes": size })))?;
                self.print(&v, |v| {
                    let v: VolumeJson = serde_json::from_value(v.clone())?;
                    // A size the short form rounds (10241M shows as 10.0 GiB) gets its bytes.
                    let mut size = format_size(v.size_bytes);
                    if size.contains('.') {
                        size = format!("{size} ({} bytes)", v.size_bytes);
                    }
                    match was == Some(v.size_bytes) {
                        true => println!("volume {:?} is already {size}: unchanged", v.name),
                        false => println!("resized volume {:?} to {size}", v.name),
                    }
                    Ok(())
                })
            }
            VolumeCommand::Delete {
                name,
                force,
                with_snapshots,
            } => {
                let path = format!(
                    "/api/v1/volumes/{}?force={force}&with_snapshots={with_snapshots}",
                    path_segment("volume", &name)?
                );
                let v = self.call("DELETE", &path, None)?;
                self.print(&v, |_| {
                    println!("deleted volume {name:?}");
                    Ok(())
                })
            }
            VolumeCommand::SetPolicy { name, policy } => self.set_policy(&name, &policy),
            VolumeCommand::Clone { source, name } => self.clone_volume(&source, &name),
            VolumeCommand::Rollback {
                name,
                snapshot,
                force,
            } => self.rollback_volume(&name, &snapshot, force),
        }
    }

    /// `strata volume rollback VOLUME SNAPSHOT [--force]`.
    fn rollback_volume(&self, name: &str, snapshot: &str, force: bool) -> Result<()> {
        let path = format!("/api/v1/volumes/{}/rollback", path_segment("volume", name)?);
        let body = json!({ "snapshot": snapshot, "force": force });
        let v = self.call("POST", &path, Some(body))?;
        self.print(&v, |v| {
            let v: VolumeJson = serde_json::from_value(v.clone())?;
            println!(
                "rolled volume {:?} back to snapshot {snapshot:?} ({})",
                v.name,
                format_size(v.size_bytes)
            );
            Ok(())
        })
    }

    /// `strata volume clone VOLUME@SNAPSHOT NEWVOLUME`.
    fn clone_volume(&self, source: &str, name: &str) -> Result<()> {
        // Checked by `parse_snapshot_source` as the command line was read; kept for callers
        // that did not go through it.
        let Some((volume, snapshot)) = source.split_once('@') else {
            bail!("{source:?} names no snapshot: give the source as VOLUME@SNAPSHOT");
        };
        let path = format!("/api/v1/volumes/{}/clone", path_segment("volume", volume)?);
        let v = self.call("POST", &path, Some(json!({ "snapshot": snapshot, "name": name })))?;
        self.print(&v, |v| {
            let v: VolumeJson = serde_json::from_value(v.clone())?;
            println!("{}", created_line(&v, Some(source)));
            Ok(())
        })
    }

    pub fn status(&self) -> Result<()> {
        let v = self.call("GET", "/api/v1/status", None)?;
        self.print(&v, |v| {
            print!("{}", crate::status_text::render(v));
            Ok(())
        })
    }

    fn print(&self, v: &Value, human: impl FnOnce(&Value) -> Result<()>) -> Result<()> {
        if self.json {
            println!("{}", serde_json::to_string_pretty(v)?);
            return Ok(());
        }
        human(v).map_err(|e| anyhow!("unexpected answer from the daemon: {e}"))
    }

    /// One request; any failure becomes a one-line reason.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        self.call_on(&self.agent, method, path, body)
    }

    /// One request, asked again while the daemon answers that it is starting (it did nothing
    /// with it), for up to [`START_WAIT`]: after [`START_NOTE_AFTER`] the wait is named once on
    /// stderr (stdout stays the command's output, JSON included).
    fn call_on(
        &self,
        agent: &ureq::Agent,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value> {
        let began = Instant::now();
        let mut noted = false;
        loop {
            let error = match self.call_once(agent, method, path, body.clone()) {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let starting = error
                .downcast_ref::<Refused>()
                .and_then(|r| r.starting.clone());
            let Some(phase) = starting else {
                return Err(error);
            };
            let waited = began.elapsed();
            if waited >= self.start_wait {
                return Err(Refused {
                    status: 503,
                    reason: format!(
                        "gave up after {} s: the daemon at {} is still starting ({phase}); try again once it is ready",
                        waited.as_secs(),
                        self.base
                    ),
                    starting: None,
                }
                .into());
            }
            if !noted && waited >= START_NOTE_AFTER {
                noted = true;
                // A closed stderr must not end the wait.
                let _ = writeln!(
                    std::io::stderr(),
                    "strata: waiting for the daemon at {}: it is starting ({phase})",
                    self.base
                );
            }
            std::thread::sleep(START_POLL.min(self.start_wait - waited));
        }
    }

    /// One request, answered or refused as it is.
    fn call_once(
        &self,
        agent: &ureq::Agent,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value> {
        let mut req = agent.request(method, &format!("{}{path}", self.base));
        if let Some(auth) = &self.authorization {
            req = req.set("Authorization", auth);
        }
        let result = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match result {
            Ok(resp) => read_json(resp),
            Err(ureq::Error::Status(code, resp)) => {
                let answer = read_json(resp).ok();
                let field = |name: &str| {
                    let v = answer.as_ref()?.get(name)?;
                    v.as_str().map(crate::one_line)
                };
                let reason =
                    field("error").unwrap_or_else(|| format!("the daemon answered HTTP {code}"));
                let starting = answer
                    .as_ref()
                    .and_then(|v| v.pointer("/starting/phase")?.as_str().map(crate::one_line));
                Err(Refused {
                    status: code,
                    reason,
                    starting: starting.filter(|_| code == 503),
                }
                .into())
            }
            Err(ureq::Error::Transport(t)) => Err(self.transport_error(method, &t)),
        }
    }

    /// A request that got no answer: the daemon was not reached, or it took the connection
    /// and did not answer in time (busy, or stuck).
    fn transport_error(&self, method: &str, t: &ureq::Transport) -> anyhow::Error {
        let reason = transport_reason(t);
        let connected = !matches!(
            t.kind(),
            ureq::ErrorKind::ConnectionFailed | ureq::ErrorKind::Dns
        );
        if connected && reason == "timed out" {
            return anyhow!(
                "the daemon at {} took the request but gave no answer within {} s",
                self.base,
                self.request_timeout.as_secs()
            );
        }
        // The connection was made and closed before an answer (a daemon killed or crashed
        // mid-request, or a port that is not the admin API's): a change may have been carried
        // out, which "cannot reach" denied, and an admin who asks again for a create or a
        // delete meets a confusing 409 or 404.
        if t.kind() == ureq::ErrorKind::Io {
            let change = if matches!(method, "GET" | "HEAD") {
                ""
            } else {
                "; the change asked for may or may not have been made, so look (strata volume list) before asking again"
            };
            return anyhow!(
                "the daemon at {} closed the connection without answering ({reason}): it may have stopped, or this is not its admin port{change}",
                self.base
            );
        }
        anyhow!("cannot reach the daemon at {}: {reason}", self.base)
    }
}

fn read_json(resp: ureq::Response) -> Result<Value> {
    let mut text = String::new();
    resp.into_reader()
        .take(MAX_RESPONSE_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| anyhow!("reading the daemon's answer: {}", crate::io_reason(&e)))?;
    serde_json::from_str(&text).map_err(|e| anyhow!("the daemon's answer is not JSON: {e}"))
}

fn transport_reason(t: &ureq::Transport) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(t);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return crate::io_reason(io);
        }
        source = e.source();
    }
    match t.kind() {
        ureq::ErrorKind::Dns => "cannot resolve the host name".to_string(),
        _ => crate::one_line(&t.to_string()),
    }
}

/// Volume names are restricted to URL-safe characters by the daemon; anything else is
/// percent-encoded so that it reaches the daemon (and is refused there) unchanged. An empty
/// name and the names `.` and `..` cannot reach it: the URL is resolved first, so they would
/// name another endpoint (`snapshot list ..` would list every volume's snapshots). The daemon
/// refuses them anyway (a name starts with a letter or a digit), so they are refused here
/// with its reason. `kind` says what is named ("volume" or "snapshot").
fn path_segment(kind: &str, name: &str) -> Result<String> {
    if matches!(name, "" | "." | "..") {
        if let Err(e) = crate::api::validate_name_of(kind, name) {
            bail!("{}", e.message);
        }
    }
    let mut out = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Ok(out)
}

/// Clap value parser for `volume clone`'s source: VOLUME@SNAPSHOT, both parts named, so that
/// a source without a snapshot is a usage error (exit 2) before the daemon is asked.
pub fn parse_snapshot_source(text: &str) -> std::result::Result<String, String> {
    match text.split_once('@') {
        Some((volume, snapshot)) if !volume.is_empty() && !snapshot.is_empty() => {
            Ok(text.to_string())
        }
        _ => Err("give the snapshot to clone as VOLUME@SNAPSHOT".into()),
    }
}

pub fn volume_table(volumes: &[VolumeJson]) -> String {
    if volumes.is_empty() {
        return "no volumes\n".to_string();
    }
    let header = ["NAME", "ID", "SIZE", "POLICY", "HIT", "SNAPSHOTS", "CONNECTIONS", "EXPORT"];
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .map(|v| {
            vec![
                v.name.clone(),
                v.id.to_string(),
                format_size(v.size_bytes),
                policy::policy_summary(&v.policy),
                v.figures
                    .fast_read_hit_ratio
                    .map_or_else(|| "-".into(), |r| format!("{:.1}%", r * 100.0)),
                v.snapshot_count.to_string(),
                v.connections.to_string(),
                v.export_uri.clone(),
            ]
        })
        .collect();
    crate::status_text::table(&header, &rows)
}

/// `volume info`'s text; `node_without_read_cache` as for [`policy::policy_lines`].
pub fn volume_info(v: &VolumeJson, node_without_read_cache: bool) -> String {
    format!(
        "name:        {}\nid:          {}\nsize:        {} ({} bytes)\n{}on fast:     {}\non capacity: {}\n{}{}snapshots:   {}\nconnections: {}\nexport:      {}\n",
        v.name,
        v.id,
        format_size(v.size_bytes),
        v.size_bytes,
        policy::policy_lines(&v.policy, node_without_read_cache),
        format_size(v.fast_tier_bytes),
        format_size(v.capacity_tier_bytes),
        space_lines(&v.space),
        policy::figures_lines(&v.figures),
        v.snapshot_count,
        v.connections,
        v.export_uri
    )
}

/// `exclusive:` and `shared:` lines, each with both tiers.
pub fn space_lines(s: &SpaceJson) -> String {
    format!(
        "exclusive:   {} fast, {} capacity\nshared:      {} fast, {} capacity\n",
        format_size(s.exclusive_fast_bytes),
        format_size(s.exclusive_capacity_bytes),
        format_size(s.shared_fast_bytes),
        format_size(s.shared_capacity_bytes)
    )
}

/// What `volume create` and `volume clone` print: the new volume with its policy (a clone
/// takes its origin's, limits included), and the snapshot a clone was made from.
fn created_line(v: &VolumeJson, from: Option<&str>) -> String {
    let from = from.map_or(String::new(), |s| format!(" from snapshot {s}"));
    format!(
        "created volume {:?} ({}, {}){from}: {}",
        v.name,
        format_size(v.size_bytes),
        policy::policy_summary(&v.policy),
        v.export_uri
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn vol(name: &str, size_bytes: u64, connections: usize) -> VolumeJson {
        VolumeJson {
            name: name.into(),
            id: 1,
            size_bytes,
            connections,
            export_uri: format!("nbd://127.0.0.1:10809/{name}"),
            policy: Default::default(),
            figures: Default::default(),
            fast_tier_bytes: 0,
            capacity_tier_bytes: 0,
            space: SpaceJson {
                exclusive_fast_bytes: 4096,
                ..Default::default()
            },
            snapshot_count: 3,
            io: Default::default(),
        }
    }

    #[test]
    fn table_aligns_columns() {
        let t = volume_table(&[vol("vol0", 8 << 30, 0), vol("a-much-longer-name", 4096, 12)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("NAME "));
        let col = lines[0].find("SIZE").unwrap();
        assert_eq!(&lines[1][col..col + 5], "8 GiB");
        assert_eq!(&lines[2][col..col + 5], "4 KiB");
        assert_eq!(volume_table(&[]), "no volumes\n");
    }

    /// A clone takes the policy of its origin, limits included: the line that announces it
    /// says so, as the one of `volume create` does (it said only the size, and a test copy
    /// of a volume limited to 300 IOPS was limited without a word).
    #[test]
    fn a_clone_is_announced_with_the_policy_it_took() {
        let mut v = vol("copy", 16 << 20, 0);
        v.policy.mode = strata_engine::Mode::Tier;
        v.policy.iops_limit = 300;
        assert_eq!(
            created_line(&v, Some("db@nightly")),
            "created volume \"copy\" (16 MiB, tier, 300 IOPS) from snapshot db@nightly: \
             nbd://127.0.0.1:10809/copy"
        );
        assert_eq!(
            created_line(&vol("db", 8 << 30, 0), None),
            "created volume \"db\" (8 GiB, cache): nbd://127.0.0.1:10809/db"
        );
    }

    #[test]
    fn info_is_key_value_lines() {
        let t = volume_info(&vol("vol0", 8 << 30, 2), false);
        assert!(t.contains("name:        vol0\n"));
        assert!(t.contains("size:        8 GiB (8589934592 bytes)\n"));
        assert!(t.contains("connections: 2\n"));
        assert!(t.contains("snapshots:   3\n"), "{t}");
        assert!(t.contains("exclusive:   4 KiB fast, 0 B capacity\n"), "{t}");
    }

    #[test]
    fn server_urls_are_checked() {
        assert!(Client::new("http://127.0.0.1:9090/", false).is_ok());
        assert!(Client::new("https://x", false)
            .err()
            .unwrap()
            .to_string()
            .contains("https"));
        assert!(Client::new("127.0.0.1:9090", false).is_err());
        // The scheme in any case, as URLs allow; the base keeps the host and port as given.
        assert_eq!(
            server_base("HTTP://Host:9090/").unwrap(),
            "http://Host:9090"
        );
        assert_eq!(
            server_base("http://[::1]:9090").unwrap(),
            "http://[::1]:9090"
        );
        assert_eq!(server_base("http://[::1]").unwrap(), "http://[::1]");
        assert_eq!(server_base("http://localhost").unwrap(), "http://localhost");
        assert!(server_base("HTTPS://x")
            .unwrap_err()
            .to_string()
            .contains("https"));
        for bad in [
            "http://h:99999",
            "http://h:0",
            "http://h:",
            "http://h:x/",
            "http://",
        ] {
            let e = server_base(bad).unwrap_err().to_string();
            assert!(e.starts_with("invalid server URL"), "{bad}: {e}");
        }
        assert!(server_base("http://h:99999")
            .unwrap_err()
            .to_string()
            .contains("1 to 65535"));
    }

    #[test]
    fn unreachable_daemon_is_one_line() {
        // Port 1 on loopback: nothing listens there in a test environment.
        let c = Client::new("http://127.0.0.1:1", false).unwrap();
        let e = c
            .call("GET", "/api/v1/volumes", None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "cannot reach the daemon at http://127.0.0.1:1: connection refused"
        );
    }

    /// A daemon on a port of its own that answers each request with the next of `answers`
    /// (status, JSON body), the last one for good; returns its URL and the request count.
    fn answering(answers: Vec<(u16, &'static str)>) -> (String, Arc<AtomicUsize>) {
        use std::io::{BufRead, BufReader};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let count = Arc::new(AtomicUsize::new(0));
        let counted = count.clone();
        // Ends with the test process; a request past the test's end finds nobody listening.
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                    line.clear();
                }
                let n = counted.fetch_add(1, Ordering::SeqCst);
                let (status, body) = answers[n.min(answers.len() - 1)];
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (url, count)
    }

    const STARTING: &str = r#"{"error": "the daemon is starting (3 s so far): opening its disk group", "starting": {"phase": "opening its disk group", "elapsed_s": 3}}"#;

    #[test]
    fn a_starting_daemon_is_waited_for() {
        let (url, count) = answering(vec![
            (503, STARTING),
            (503, STARTING),
            (200, r#"{"volumes": []}"#),
        ]);
        let c = Client::new(&url, false).unwrap();
        let v = c.call("GET", "/api/v1/volumes", None).unwrap();
        assert_eq!(v["volumes"], json!([]));
        assert_eq!(count.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_daemon_that_stays_starting_is_given_up_with_the_reason() {
        let (url, count) = answering(vec![(503, STARTING)]);
        let c = Client::with_waits(&url, false, REQUEST_TIMEOUT, Duration::from_secs(1)).unwrap();
        let began = Instant::now();
        let e = c
            .call("POST", "/api/v1/volumes", Some(json!({})))
            .unwrap_err();
        let waited = began.elapsed();
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("gave up after 1 s: the daemon at {url} is still starting (opening its disk group); try again once it is ready")
        );
        assert_eq!(e.downcast_ref::<Refused>().map(|r| r.status), Some(503));
        assert!(count.load(Ordering::SeqCst) > 2, "asked again meanwhile");
    }

    #[test]
    fn other_refusals_are_not_waited_for() {
        let (url, count) = answering(vec![(503, r#"{"error": "the daemon is shutting down"}"#)]);
        let c = Client::new(&url, false).unwrap();
        let e = c.call("GET", "/api/v1/volumes", None).unwrap_err();
        assert_eq!(e.to_string(), "the daemon is shutting down");
        assert_eq!(count.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_daemon_that_takes_the_request_and_never_answers_is_named_so() {
        // Listening, never accepting: the kernel completes the connection, nothing answers.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let c = Client::with_waits(&url, false, Duration::from_secs(1), START_WAIT).unwrap();
        let e = c
            .call("GET", "/api/v1/volumes", None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!("the daemon at {url} took the request but gave no answer within 1 s")
        );
    }

    #[test]
    fn a_daemon_that_closes_the_connection_unanswered_is_not_called_unreachable() {
        use std::io::{BufRead, BufReader};
        // Takes each request whole, then closes without an answer, as a daemon killed while
        // it carried the request out.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let mut reader = BufReader::new(stream);
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                    line.clear();
                }
            }
        });
        let c = Client::new(&url, false).unwrap();
        let e = c
            .call(
                "POST",
                "/api/v1/volumes",
                Some(json!({"name": "db", "size_bytes": 4096})),
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "the daemon at {url} closed the connection without answering"
            )),
            "{e}"
        );
        assert!(e.contains("may or may not have been made"), "{e}");
        let e = c
            .call("GET", "/api/v1/volumes", None)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("or this is not its admin port"), "{e}");
    }

    #[test]
    fn tokens_come_from_a_file_or_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "file-token-0123456789\nignored\n").unwrap();
        let t = load_token(Some(&file), Some("env-token")).unwrap();
        assert_eq!(t.as_deref(), Some("file-token-0123456789"), "the file wins");
        assert_eq!(load_token(None, Some(" env-token \n")).unwrap().as_deref(), Some("env-token"));
        assert_eq!(load_token(None, None).unwrap(), None);
        std::fs::write(&file, "\n").unwrap();
        let e = load_token(Some(&file), None).unwrap_err().to_string();
        assert!(e.contains("holds no token"), "{e}");
        std::fs::write(&file, "secret with spaces-123\n").unwrap();
        let e = load_token(Some(&file), None).unwrap_err().to_string();
        assert!(!e.contains("secret"), "the error must not echo the token: {e}");
        let e = load_token(Some(&dir.path().join("none")), None).unwrap_err().to_string();
        assert!(e.contains("no such file"), "{e}");
    }

    #[test]
    fn odd_names_are_percent_encoded() {
        assert_eq!(path_segment("volume", "vol0").unwrap(), "vol0");
        assert_eq!(path_segment("volume", "a b/c").unwrap(), "a%20b%2Fc");
        assert_eq!(path_segment("volume", "...").unwrap(), "...");
    }

    #[test]
    fn names_the_url_would_resolve_away_are_refused() {
        for (kind, name) in [("volume", ""), ("volume", "."), ("snapshot", "..")] {
            let e = path_segment(kind, name).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("invalid {kind} name {name:?}")),
                "{e}"
            );
        }
    }
}
