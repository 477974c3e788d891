//! Helpers shared by the snapshot end-to-end tests.
#![allow(dead_code)]
use std::time::Duration;

use serde_json::Value;

use crate::common::http::get_json;
use crate::common::*;

pub fn snapshots(daemon: &Daemon, volume: Option<&str>) -> Vec<Value> {
    let mut args = vec!["snapshot", "list"];
    args.extend(volume);
    let listing = daemon.cli_json(&args);
    listing["snapshots"]
        .as_array()
        .unwrap_or_else(|| panic!("snapshot list --json: {listing:#}"))
        .clone()
}

pub fn export_names(list: &[Value]) -> Vec<String> {
    list.iter()
        .map(|s| s["export_name"].as_str().expect("export_name").to_string())
        .collect()
}

/// qemu-io opening the export read-only (a snapshot export requires it); every command must pass.
pub fn read_ok(daemon: &Daemon, export: &str, commands: &[&str]) {
    // -r: a read-only open, which a snapshot export requires.
    let uri = daemon.nbd_uri(export);
    let mut c = cmd("qemu-io", &["-r", "-f", "raw"]);
    for command in commands {
        c.args(["-c", command]);
    }
    c.arg(&uri);
    let out = run_ok(&mut c, CMD_TIMEOUT);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("Pattern verification failed") && !stdout.contains("failed:"),
        "{export}: {commands:?}\n{stdout}"
    );
}

/// Waits until no NBD connection is open: a client process that exited has closed its socket,
/// but the daemon notices a moment later, and until then a plain delete or rollback is refused.
pub fn wait_no_clients(daemon: &Daemon) {
    let url = format!("{}/api/v1/node", daemon.http_url());
    let idle = wait_until(Duration::from_secs(20), || {
        get_json(&url)["nbd_connections_total"] == 0
    });
    assert!(idle, "NBD connections still open: {}", get_json(&url));
}
