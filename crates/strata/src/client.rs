//! The CLI side of the admin API: `strata volume ...` and `strata status`.
use std::io::Read;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::api::{VolumeJson, VolumeListJson};
use crate::config::format_size;
use crate::VolumeCommand;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A delete waits for the volume's in-flight I/O, so allow the daemon some time.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
const MAX_RESPONSE_BYTES: u64 = 16 << 20;

pub struct Client {
    base: String,
    json: bool,
    agent: ureq::Agent,
}

impl Client {
    pub fn new(server: &str, json: bool) -> Result<Client> {
        let base = server.trim().trim_end_matches('/').to_string();
        if base.starts_with("https://") {
            bail!("{base}: https is not supported; the admin API is plain HTTP (use http://)");
        }
        if !base.starts_with("http://") || base.len() == "http://".len() {
            bail!("invalid server URL {server:?}: expected http://HOST:PORT");
        }
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .build();
        Ok(Client { base, json, agent })
    }

    pub fn volume(&self, cmd: VolumeCommand) -> Result<()> {
        match cmd {
            VolumeCommand::Create { name, size } => {
                let v = self.call(
                    "POST",
                    "/api/v1/volumes",
                    Some(json!({ "name": name, "size_bytes": size })),
                )?;
                self.print(&v, |v| {
                    let v: VolumeJson = serde_json::from_value(v.clone())?;
                    println!(
                        "created volume {:?} ({}): {}",
                        v.name,
                        format_size(v.size_bytes),
                        v.export_uri
                    );
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
                    &format!("/api/v1/volumes/{}", path_segment(&name)),
                    None,
                )?;
                self.print(&v, |v| {
                    let v: VolumeJson = serde_json::from_value(v.clone())?;
                    print!("{}", volume_info(&v));
                    Ok(())
                })
            }
            VolumeCommand::Resize { name, size } => {
                let path = format!("/api/v1/volumes/{}/resize", path_segment(&name));
                let v = self.call("POST", &path, Some(json!({ "size_bytes": size })))?;
                self.print(&v, |v| {
                    let v: VolumeJson = serde_json::from_value(v.clone())?;
                    println!(
                        "resized volume {:?} to {}",
                        v.name,
                        format_size(v.size_bytes)
                    );
                    Ok(())
                })
            }
            VolumeCommand::Delete { name, force } => {
                let path = format!("/api/v1/volumes/{}?force={force}", path_segment(&name));
                let v = self.call("DELETE", &path, None)?;
                self.print(&v, |_| {
                    println!("deleted volume {name:?}");
                    Ok(())
                })
            }
        }
    }

    pub fn status(&self) -> Result<()> {
        let v = self.call("GET", "/api/v1/status", None)?;
        self.print(&v, |v| {
            print!("{}", status_text(v));
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
        let req = self.agent.request(method, &format!("{}{path}", self.base));
        let result = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match result {
            Ok(resp) => read_json(resp),
            Err(ureq::Error::Status(code, resp)) => {
                let reason = read_json(resp)
                    .ok()
                    .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
                    .unwrap_or_else(|| format!("the daemon answered HTTP {code}"));
                Err(anyhow!("{}", crate::one_line(&reason)))
            }
            Err(ureq::Error::Transport(t)) => Err(anyhow!(
                "cannot reach the daemon at {}: {}",
                self.base,
                transport_reason(&t)
            )),
        }
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
/// percent-encoded so that it reaches the daemon (and is refused there) unchanged.
fn path_segment(name: &str) -> String {
    let mut out = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub fn volume_table(volumes: &[VolumeJson]) -> String {
    if volumes.is_empty() {
        return "no volumes\n".to_string();
    }
    let header = ["NAME", "ID", "SIZE", "CONNECTIONS", "EXPORT"].map(String::from);
    let rows: Vec<[String; 5]> = volumes
        .iter()
        .map(|v| {
            [
                v.name.clone(),
                v.id.to_string(),
                format_size(v.size_bytes),
                v.connections.to_string(),
                v.export_uri.clone(),
            ]
        })
        .collect();
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

pub fn volume_info(v: &VolumeJson) -> String {
    format!(
        "name:        {}\nid:          {}\nsize:        {} ({} bytes)\nconnections: {}\nexport:      {}\n",
        v.name,
        v.id,
        format_size(v.size_bytes),
        v.size_bytes,
        v.connections,
        v.export_uri
    )
}

fn status_text(v: &Value) -> String {
    let s = |k: &str| {
        v.get(k)
            .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string))
            .unwrap_or_default()
    };
    let e = &v["engine"];
    let num = |x: &Value| x.as_f64().unwrap_or(0.0);
    let bytes = |x: &Value| format_size(x.as_u64().unwrap_or(0));
    format!(
        "version:          {}\nuptime:           {} s\nio backend:       {}\nnbd:              {}\nhttp:             {}\nvolumes:          {}\nnbd connections:  {}\nlog fill:         {:.1}% (destage between {:.0}% and {:.0}%)\nlog used:         {} of {}\ndestage rate:     {}/s\ncapacity used:    {} of {}\nchecksum errors:  {}\n",
        s("version"),
        s("uptime_s"),
        s("io_backend"),
        s("nbd_listen"),
        s("http_listen"),
        s("volume_count"),
        s("nbd_connections_total"),
        num(&e["log_fill_ratio"]) * 100.0,
        num(&e["fill_ratio_low"]) * 100.0,
        num(&e["fill_ratio_high"]) * 100.0,
        bytes(&e["log_used_bytes"]),
        bytes(&e["log_capacity_bytes"]),
        format_size(num(&e["destage_rate_bytes_per_s"]) as u64),
        bytes(&e["capacity_used_bytes"]),
        bytes(&e["capacity_total_bytes"]),
        e["checksum_errors_total"].as_u64().unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(name: &str, size_bytes: u64, connections: usize) -> VolumeJson {
        VolumeJson {
            name: name.into(),
            id: 1,
            size_bytes,
            connections,
            export_uri: format!("nbd://127.0.0.1:10809/{name}"),
            policy: "write-buffer".into(),
            fast_tier_bytes: 0,
            capacity_tier_bytes: 0,
            io: None,
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

    #[test]
    fn info_is_key_value_lines() {
        let t = volume_info(&vol("vol0", 8 << 30, 2));
        assert!(t.contains("name:        vol0\n"));
        assert!(t.contains("size:        8 GiB (8589934592 bytes)\n"));
        assert!(t.contains("connections: 2\n"));
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

    #[test]
    fn odd_names_are_percent_encoded() {
        assert_eq!(path_segment("vol0"), "vol0");
        assert_eq!(path_segment("a b/c"), "a%20b%2Fc");
    }
}
