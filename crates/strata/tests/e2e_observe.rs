//! Observability of a live daemon under load: `/metrics` checked by promtool with counters that
//! match what fio did, the history the dashboard draws, and `strata status` in both forms;
//! and requests the NBD server refuses counted as errors.
use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::http::{get, get_json};
use common::*;
use serde_json::Value;

const FIO_TIMEOUT: Duration = Duration::from_secs(120);

/// One sample line of the Prometheus text format.
#[derive(Debug, Clone)]
struct PromSample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A scrape, parsed: enough of the text format for the samples the daemon writes.
struct Scrape {
    text: String,
    samples: Vec<PromSample>,
}

fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 2..];
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(key, value);
        rest = &after[end..];
    }
    out
}

impl Scrape {
    fn fetch(base: &str) -> Scrape {
        let r = get(&format!("{base}/metrics"));
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.content_type.starts_with("text/plain"), "{}", r.content_type);
        let samples = r
            .body
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| {
                let (series, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {l:?}"));
                let (name, labels) = match series.split_once('{') {
                    Some((n, rest)) => (n, parse_labels(rest.trim_end_matches('}'))),
                    None => (series, BTreeMap::new()),
                };
                let value = match value {
                    "+Inf" => f64::INFINITY,
                    "-Inf" => f64::NEG_INFINITY,
                    v => v.parse().unwrap_or_else(|_| panic!("bad value in {l:?}")),
                };
                PromSample { name: name.to_string(), labels, value }
            })
            .collect();
        Scrape { text: r.body, samples }
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .find(|s| {
                s.name == name
                    && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?} in\n{}", self.text))
    }

    fn has_family(&self, name: &str) -> bool {
        self.text.contains(&format!("# TYPE {name} "))
    }
}

/// fio's nbd engine: a finite mixed random job; returns (read bytes, read ops, write bytes,
/// write ops) from its JSON report.
fn fio_mixed(uri: &str, dir: &std::path::Path) -> (f64, f64, f64, f64) {
    let out_json = dir.join("mixed.json");
    let mut c = cmd(
        "fio",
        &[
            "--name=mixed",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--rwmixread=40",
            "--bssplit=4k/60:64k/40",
            "--size=24m",
            "--iodepth=8",
            "--randseed=11",
            // One process: a timeout's kill of the process group then ends the job too.
            "--thread",
            "--output-format=json",
            &format!("--output={}", out_json.display()),
        ],
    );
    c.current_dir(dir);
    run_ok(&mut c, FIO_TIMEOUT);
    let text = std::fs::read_to_string(&out_json).expect("fio json");
    // As a thread, the nbd engine's "connected" note lands in the report file before the JSON.
    let json_start = if text.starts_with('{') {
        0
    } else {
        text.find("\n{").map_or(0, |i| i + 1)
    };
    let report: Value = serde_json::from_str(&text[json_start..])
        .unwrap_or_else(|e| panic!("fio JSON ({e}):\n{text}"));
    let job = &report["jobs"][0];
    let f = |v: &Value| v.as_f64().expect("fio number");
    (
        f(&job["read"]["io_bytes"]),
        f(&job["read"]["total_ios"]),
        f(&job["write"]["io_bytes"]),
        f(&job["write"]["total_ios"]),
    )
}

fn promtool_check(text: &str) {
    let out = run_with_stdin(
        &mut cmd("promtool", &["check", "metrics"]),
        Some(text.as_bytes().to_vec()),
        Duration::from_secs(60),
    );
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && report.trim().is_empty(),
        "promtool check metrics failed ({}):\n{report}",
        out.status
    );
}

#[test]
fn metrics_under_load_pass_promtool_and_count_what_fio_did() {
    if !require_tools(&["fio", "promtool"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let base = daemon.http_url();
    let before = Scrape::fetch(&base);
    promtool_check(&before.text);

    let (read_bytes, read_ops, write_bytes, write_ops) =
        fio_mixed(&daemon.nbd_uri(VOL0), &daemon.scratch_dir());
    assert!(read_ops > 0.0 && write_ops > 0.0, "fio did no I/O");
    let after = Scrape::fetch(&base);
    promtool_check(&after.text);

    let vol = [("volume", VOL0)];
    let delta = |name: &str, labels: &[(&str, &str)]| {
        after.value(name, labels) - before.value(name, labels)
    };
    assert_eq!(delta("strata_volume_write_bytes_total", &vol), write_bytes);
    assert_eq!(delta("strata_volume_write_operations_total", &vol), write_ops);
    assert_eq!(delta("strata_volume_read_bytes_total", &vol), read_bytes);
    assert_eq!(delta("strata_volume_read_operations_total", &vol), read_ops);
    let lat = "strata_volume_request_duration_seconds";
    let write_lat = [("volume", VOL0), ("op", "write")];
    assert_eq!(delta(&format!("{lat}_count"), &write_lat), write_ops);
    assert!(delta(&format!("{lat}_sum"), &write_lat) > 0.0);
    let inf = [("volume", VOL0), ("op", "read"), ("le", "+Inf")];
    assert_eq!(delta(&format!("{lat}_bucket"), &inf), read_ops);

    // The fast device took every write (the log), at least the bytes the client wrote.
    let fast = after
        .samples
        .iter()
        .find(|s| s.name == "strata_device_written_bytes_total" && s.labels["tier"] == "fast")
        .expect("a fast device")
        .labels["device"]
        .clone();
    let dev = [("device", fast.as_str())];
    assert!(delta("strata_device_written_bytes_total", &dev) >= write_bytes);
    assert!(delta("strata_device_write_operations_total", &dev) > 0.0);
    assert!(delta("strata_device_write_size_bytes_count", &dev) > 0.0);
    assert!(delta("strata_device_lifetime_written_bytes", &dev) >= write_bytes);
    assert!(after.value("strata_log_used_bytes", &[]) > 0.0);
    // Healthy devices: every one has a checksum failure count, and it is zero.
    assert_eq!(after.value("strata_device_checksum_errors_total", &[("tier", "fast")]), 0.0);
    assert_eq!(after.value("strata_device_checksum_errors_total", &[("tier", "capacity")]), 0.0);
    assert_eq!(after.value("strata_scrub_running", &[]), 0.0);
    assert_eq!(after.value("strata_log_fill_ratio_low", &[]), 0.3);
    assert_eq!(after.value("strata_log_fill_ratio_high", &[]), 0.7);
    assert!(
        after.value("strata_volume_stored_bytes", &[("volume", VOL0), ("tier", "fast")])
            + after.value("strata_volume_stored_bytes", &[("volume", VOL0), ("tier", "capacity")])
            > 0.0
    );

    // Every family the issue names is there.
    for family in [
        "strata_volume_read_operations_total",
        "strata_volume_write_operations_total",
        "strata_volume_read_bytes_total",
        "strata_volume_write_bytes_total",
        "strata_volume_request_duration_seconds",
        "strata_device_read_bytes_total",
        "strata_device_written_bytes_total",
        "strata_device_read_operations_total",
        "strata_device_write_operations_total",
        "strata_device_read_size_bytes",
        "strata_device_write_size_bytes",
        "strata_device_errors_total",
        "strata_checksum_errors_total",
        "strata_device_lifetime_written_bytes",
        "strata_device_drive_writes_per_day",
        "strata_device_endurance_used_ratio",
        "strata_log_fill_ratio",
        "strata_log_fill_ratio_low",
        "strata_log_fill_ratio_high",
        "strata_destage_rate_bytes_per_second",
        "strata_destage_backlog_bytes",
        "strata_admission_throttled",
        "strata_gc_segments_cleaned_total",
        "strata_gc_relocated_bytes_total",
        "strata_fast_read_hit_ratio",
        "strata_device_checksum_errors_total",
        "strata_scrub_running",
        "strata_scrub_progress_bytes",
        "strata_scrub_last_bad_blocks",
        "strata_scrub_last_finished_timestamp_seconds",
    ] {
        assert!(after.has_family(family), "no family {family} in\n{}", after.text);
    }
}

#[test]
fn history_and_status_show_the_load() {
    if !require_tools(&["fio"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let base = daemon.http_url();
    let _load = common::http::background_load(&daemon.nbd_uri(VOL0), 30, &daemon.scratch_dir());
    let busy = wait_until(Duration::from_secs(30), || {
        let h = get_json(&format!("{base}/api/v1/history"));
        h["samples"]
            .as_array()
            .is_some_and(|s| s.iter().filter(|x| x["write_iops"].as_f64() > Some(0.0)).count() >= 2)
    });
    assert!(busy, "the history shows no writes after 30 s of load");
    let h = get_json(&format!("{base}/api/v1/history"));
    let last = h["samples"].as_array().unwrap().last().unwrap().clone();
    let since = last["t_unix_ms"].as_u64().unwrap();
    let newer = get_json(&format!("{base}/api/v1/history?since_unix_ms={since}"));
    assert!(
        newer["samples"].as_array().unwrap().iter().all(|s| s["t_unix_ms"].as_u64() > Some(since)),
        "since_unix_ms must filter: {newer}"
    );

    let page = daemon.cli_ok(&["status"]);
    for want in ["WORKLOAD (last", "DISK GROUP dg0", "write log    [", "DEVICES", "VOLUMES", "WARNINGS"] {
        assert!(page.contains(want), "`strata status` lacks {want:?}:\n{page}");
    }
    let vol_line = page.lines().find(|l| l.trim_start().starts_with("vol0 ")).unwrap_or_else(|| panic!("{page}"));
    assert!(vol_line.contains("8 GiB") && vol_line.contains("cache"), "{vol_line}");

    let s = daemon.cli_json(&["status"]);
    assert_eq!(s["state"], "running", "{s}");
    assert!(s["io"]["write_ops_total"].as_u64() > Some(0), "{s}");
    assert!(s["latest"]["write_iops"].is_number(), "{s}");
    assert_eq!(s["disk_groups"][0]["fill_ratio_high"], 0.7);
    assert_eq!(s["devices"].as_array().unwrap().len(), 2);
    assert_eq!(s["devices"][0]["tier"], "fast");
    assert_eq!(s["volumes"][0]["policy"]["mode"], "cache");
    assert!(s["warnings"].is_array());
    assert!(s["engine"]["log_capacity_bytes"].as_u64() > Some(0));
}

/// Requests the NBD server refuses on its own, without calling the volume, are answered with
/// an error, so they count as errors like the volume's own (before, all three below left
/// every figure at 0): an operation of their kind that moved no bytes and has no latency.
/// A snapshot's export has figures of its own, so the write to `pr@s1` is in the snapshot's
/// and the node's, not in `pr`'s. The raw client sends what libnbd and qemu check away
/// before sending (nbdsh does too, in its default strict mode).
#[test]
fn requests_the_nbd_server_refuses_count_as_errors() {
    let daemon = Daemon::start_default();
    let base = daemon.http_url();
    daemon.create_volume("pr", "64M");
    daemon.cli_ok(&["snapshot", "create", "pr", "s1"]);
    let snapshot_url = format!("{base}/api/v1/volumes/pr/snapshots/s1");
    let mut vol = nbd::go(daemon.nbd_addr, "pr").expect("NBD_OPT_GO pr");
    let mut snap = nbd::go(daemon.nbd_addr, "pr@s1").expect("NBD_OPT_GO pr@s1");
    let before = Scrape::fetch(&base);
    let status_before = get_json(&format!("{base}/api/v1/status"))["io"].clone();
    let snap_before = get_json(&snapshot_url)["io"].clone();

    let block = [0x5au8; 4096];
    assert_eq!(vol.write(64 * MIB, &block).expect("write"), Err(nbd::ENOSPC));
    assert_eq!(vol.read(64 * MIB + 4096, 4096).expect("read"), Err(nbd::EINVAL));
    assert_eq!(snap.write(0, &block).expect("write"), Err(nbd::EPERM));

    let after = Scrape::fetch(&base);
    let delta = |name: &str, labels: &[(&str, &str)]| {
        after.value(name, labels) - before.value(name, labels)
    };
    let pr = [("volume", "pr")];
    assert_eq!(delta("strata_volume_request_errors_total", &pr), 2.0);
    assert_eq!(delta("strata_volume_write_operations_total", &pr), 1.0);
    assert_eq!(delta("strata_volume_write_bytes_total", &pr), 0.0, "the refused write wrote nothing");
    assert_eq!(delta("strata_volume_read_operations_total", &pr), 1.0);
    assert_eq!(delta("strata_volume_read_bytes_total", &pr), 0.0);
    let lat = "strata_volume_request_duration_seconds_count";
    for op in ["read", "write"] {
        assert_eq!(delta(lat, &[("volume", "pr"), ("op", op)]), 0.0, "{op}s refused take no time");
    }
    let rise = |now: &Value, then: &Value, key: &str| {
        let figure = |v: &Value| v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"));
        figure(now) - figure(then)
    };
    let snap_after = get_json(&snapshot_url)["io"].clone();
    assert_eq!(rise(&snap_after, &snap_before, "errors_total"), 1, "{snap_after}");
    assert_eq!(rise(&snap_after, &snap_before, "write_ops_total"), 1, "{snap_after}");
    assert_eq!(rise(&snap_after, &snap_before, "write_bytes_total"), 0, "{snap_after}");
    let status_after = get_json(&format!("{base}/api/v1/status"))["io"].clone();
    assert_eq!(rise(&status_after, &status_before, "errors_total"), 3, "{status_after}");
    assert_eq!(rise(&status_after, &status_before, "write_ops_total"), 2, "{status_after}");
    assert_eq!(rise(&status_after, &status_before, "write_bytes_total"), 0, "{status_after}");
    assert_eq!(rise(&status_after, &status_before, "read_bytes_total"), 0, "{status_after}");

    // The refusals cost neither connection: both still serve.
    assert_eq!(vol.read(0, 4096).expect("read"), Ok(vec![0; 4096]));
    assert_eq!(snap.read(0, 4096).expect("read"), Ok(vec![0; 4096]));
}

#[test]
fn a_bad_history_query_is_a_400_with_a_reason() {
    let daemon = Daemon::start_default();
    let r = get(&format!("{}/api/v1/history?since_unix_ms=yesterday", daemon.http_url()));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"].as_str().is_some_and(|e| !e.contains('\n')), "{}", r.body);
}
