//! `strata size` end to end: its table and JSON, its one-line errors, and `--from-metrics`
//! against a live daemon (and against servers that are not one).
use crate::common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn get_json(daemon: &Daemon, path: &str) -> Value {
    let url = format!("{}{path}", daemon.http_url());
    let response = ureq::get(&url)
        .timeout(Duration::from_secs(10))
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}\n{}", daemon.stderr_log()));
    response
        .into_json()
        .unwrap_or_else(|e| panic!("GET {url}: not JSON: {e}"))
}

fn size_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(STRATA_BIN);
    c.arg("size").args(args);
    c
}

const DESIGN: &[&str] = &[
    "--vms",
    "32",
    "--iops-per-vm",
    "1500",
    "--read-pct",
    "70",
    "--block-size",
    "32K",
    "--capacity-per-vm",
    "300G",
    "--protection",
    "raid1",
    "--hosts",
    "4",
    "--cache-device",
    "sas-800g-mu-3dwpd",
    "--cache-per-host",
    "1",
    "--capacity-device",
    "d5-p4320-7.68t",
    "--capacity-per-host",
    "2",
    "--peak-to-average",
    "2",
];

/// The exit status of a report whose design fails a check (docs/SIZING.md).
const EXIT_CHECK_FAILED: i32 = 3;

/// Runs `strata size` on DESIGN, which fails its endurance check: the report is printed all
/// the same, nothing on stderr, and the exit status says the design failed.
fn run_failing_design(args: &[&str]) -> std::process::Output {
    let out = run_timeout(&mut size_cmd(args), CMD_TIMEOUT);
    assert_eq!(
        out.status.code(),
        Some(EXIT_CHECK_FAILED),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn size_prints_a_table_and_json() {
    let out = run_failing_design(DESIGN);
    let table = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "VM writes, average",
        "drive writes per day",
        "Checks at 4 hosts",
        "Smallest cluster meeting all:",
    ] {
        assert!(table.contains(needle), "missing {needle:?}:\n{table}");
    }
    let mut json_args = vec!["--json"];
    json_args.extend_from_slice(DESIGN);
    let out = run_failing_design(&json_args);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    // 32 x 1500 x 30% x 32 KiB = 450 MiB/s of VM writes, 900 at peak, twice that with RAID-1.
    let avg = v["evaluation"]["vm_write_bytes_per_s_avg"]
        .as_f64()
        .expect("avg");
    assert!((avg - 450.0 * 1_048_576.0).abs() < 1.0, "{avg}");
    let peak = v["evaluation"]["vm_write_bytes_per_s_peak"]
        .as_f64()
        .expect("peak");
    assert!((peak - 2.0 * avg).abs() < 1.0);
    let per_cache = v["evaluation"]["cache"]["write_bytes_per_s_avg"]
        .as_f64()
        .expect("cache");
    assert!((per_cache - avg * 2.0 / 4.0).abs() < 1.0);
    for key in [
        "performance_ok",
        "endurance_ok",
        "capacity_ok",
        "protection_ok",
    ] {
        assert!(v["evaluation"]["checks"][key].is_boolean(), "{key}: {v:#}");
    }
    let hosts = v["smallest_cluster"]["hosts"].as_u64().expect("hosts");
    assert!(hosts >= 3, "{v:#}");
    assert!(v["smallest_cluster"]["binding"]
        .as_array()
        .is_some_and(|b| !b.is_empty()));
    let list = run_ok(&mut size_cmd(&["--list-devices"]), CMD_TIMEOUT);
    let list = String::from_utf8_lossy(&list.stdout);
    for id in [
        "optane-p5800x-400g",
        "optane-p4800x-375g",
        "optane-p4800x-750g",
        "d5-p4320-7.68t",
        "hdd-1.2t-10k-sas",
    ] {
        assert!(list.contains(id), "{id} not listed:\n{list}");
    }
}

#[test]
fn size_rejects_bad_input_with_one_line() {
    let with = |flag: &str, value: &str| -> Vec<String> {
        let mut v: Vec<String> = DESIGN.iter().map(|s| s.to_string()).collect();
        let i = v.iter().position(|a| a == flag).expect("flag in DESIGN");
        v[i + 1] = value.to_string();
        v
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let broken = dir.path().join("bad.toml");
    std::fs::write(&broken, "[[device]]\nid = 3\n").expect("write");
    let mut with_catalog: Vec<String> = DESIGN.iter().map(|s| s.to_string()).collect();
    with_catalog.extend(["--catalog".into(), broken.display().to_string()]);
    // A good catalog file that lacks the id asked for: the id is wrong, not the file.
    let good = dir.path().join("good.toml");
    std::fs::write(&good, "").expect("write");
    let mut unknown_with_catalog = with("--capacity-device", "my-qlc");
    unknown_with_catalog.extend(["--catalog".into(), good.display().to_string()]);
    // Exit 2 for a usage error (a bad flag value, an id the catalog lacks), 1 for an error
    // (docs/SIZING.md): an unknown --cache-device exited 1.
    let cases: Vec<(&str, Vec<String>, &str, i32)> = vec![
        ("read share", with("--read-pct", "120"), "out of range", 2),
        (
            "protection",
            with("--protection", "ec=4"),
            "invalid protection",
            2,
        ),
        ("block size", with("--block-size", "12Q"), "unknown unit", 2),
        (
            "block size in part bytes",
            with("--block-size", "4.1K"),
            "not a whole number of bytes",
            2,
        ),
        (
            "capacity",
            with("--capacity-per-vm", ".5T"),
            "invalid size",
            2,
        ),
        ("hosts", with("--hosts", "0"), "--hosts", 2),
        (
            "unknown device",
            with("--cache-device", "sas-800"),
            "did you mean sas-800g-mu-3dwpd",
            2,
        ),
        (
            "unknown device beside a catalog file",
            unknown_with_catalog,
            "unknown device \"my-qlc\"",
            2,
        ),
        ("broken catalog", with_catalog, "bad.toml", 1),
        (
            "missing flag",
            vec!["--vms".into(), "3".into()],
            "required",
            2,
        ),
    ];
    for (what, args, needle, code) in cases {
        let out = run_timeout(
            &mut size_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>()),
            CMD_TIMEOUT,
        );
        assert_one_line_reason(what, &out);
        assert_eq!(out.status.code(), Some(code), "{what}");
        // An error is not a verdict on the design: scripts must tell the two apart.
        assert_ne!(out.status.code(), Some(EXIT_CHECK_FAILED), "{what}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{what}: {stderr}");
        assert!(
            out.stdout.is_empty(),
            "{what}: printed {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

#[test]
fn size_exits_3_when_a_check_fails_and_0_when_all_pass() {
    // DESIGN's SAS cache devices wear out: endurance FAILs, the table says so, exit 3.
    let out = run_failing_design(DESIGN);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("endurance (average)   FAIL"), "{table}");
    let mut json_args = vec!["--json"];
    json_args.extend_from_slice(DESIGN);
    let out = run_failing_design(&json_args);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["evaluation"]["checks"]["endurance_ok"], false, "{v:#}");
    // With Optane cache devices and four QLC drives per host every check passes: exit 0.
    let mut passing: Vec<&str> = DESIGN.to_vec();
    let set = |args: &mut Vec<&str>, flag: &str, value: &'static str| {
        let i = args
            .iter()
            .position(|a| *a == flag)
            .expect("flag in DESIGN");
        args[i + 1] = value;
    };
    set(&mut passing, "--cache-device", "optane-p5800x-400g");
    set(&mut passing, "--capacity-per-host", "4");
    let out = run_ok(&mut size_cmd(&passing), CMD_TIMEOUT);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(!table.contains("FAIL"), "{table}");
}

/// Serves one HTTP request with `body` on a kernel-chosen port; returns the base URL.
fn one_shot_http(body: &'static str) -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let handle = std::thread::spawn(move || {
        if let Ok((mut stream, _)) = listener.accept() {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(reply.as_bytes());
        }
    });
    (url, handle)
}

fn measured_args(url: &str) -> Vec<String> {
    let mut v: Vec<String> = DESIGN.iter().map(|s| s.to_string()).collect();
    let i = v.iter().position(|a| a == "--iops-per-vm").expect("flag");
    v.drain(i..i + 2);
    v.extend(["--from-metrics".into(), url.to_string()]);
    v
}

fn status_write_rate(daemon: &Daemon) -> f64 {
    get_json(daemon, "/api/v1/status")["workload"]["write_bytes_per_s_avg"]
        .as_f64()
        .expect("workload.write_bytes_per_s_avg")
}

/// `strata size` with `args`, which may pass every check or not (exit 0 or 3): with a measured
/// rate, DESIGN's cache devices wear out or not depending on how fast the daemon took its
/// writes since it started, which the machine decides (it failed once under a loaded suite).
fn run_to_a_verdict(args: &[String]) -> std::process::Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_timeout(&mut size_cmd(&args), CMD_TIMEOUT);
    assert!(
        matches!(out.status.code(), Some(0 | EXIT_CHECK_FAILED)),
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn size_from_metrics_uses_the_daemons_measured_write_rate() {
    let daemon = Daemon::start_default();
    qemu_io_ok(&daemon.nbd_uri(VOL0), &["write -P 0x22 0 16M"]);
    // The daemon's average is bytes since start over time since start: it only falls while
    // nothing is written, so the value `strata size` used lies between two readings around it.
    let before = status_write_rate(&daemon);
    let mut args = vec!["--json".to_string()];
    args.extend(measured_args(&daemon.http_url()));
    let out = run_to_a_verdict(&args);
    let after = status_write_rate(&daemon);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let used = v["workload"]["vm_write_bytes_per_s_avg"]
        .as_f64()
        .expect("rate");
    assert!(
        before > 0.0 && after <= used && used <= before,
        "{after} <= {used} <= {before}"
    );
    assert_eq!(v["workload"]["source"]["kind"], "measured", "{v:#}");
    assert_eq!(v["workload"]["source"]["url"], daemon.http_url());
    // IOPS follow from the rate: rate / (30% x 32 KiB).
    let iops = v["workload"]["iops_avg"].as_f64().expect("iops");
    assert!((iops - used / (0.3 * 32768.0)).abs() < 1e-6 * iops.max(1.0));
    // The table says where the rate came from.
    let out = run_to_a_verdict(&measured_args(&daemon.http_url()));
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(page.contains("MEASURED by the daemon at"), "{page}");
    // The IOPS are all the VMs': said so, with each VM's share beside them.
    assert!(
        page.contains(" IOPS in all (") && page.contains(" per VM) derived at "),
        "{page}"
    );

    // An unreachable daemon, a server without the field, a URL that is not the API.
    let gone = TcpListener::bind("127.0.0.1:0").expect("bind");
    let gone_url = format!("http://{}", gone.local_addr().expect("addr"));
    drop(gone);
    let (no_field_url, server) = one_shot_http(r#"{"workload": {}}"#);
    let not_found = format!("{}/nope", daemon.http_url());
    for (what, url, needle) in [
        (
            "unreachable",
            gone_url.as_str(),
            "cannot reach the daemon: connection refused",
        ),
        (
            "field missing",
            no_field_url.as_str(),
            "no numeric workload.write_bytes_per_s_avg",
        ),
        ("not the API", not_found.as_str(), "HTTP 404"),
    ] {
        let out = run_timeout(
            &mut size_cmd(
                &measured_args(url)
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>(),
            ),
            CMD_TIMEOUT,
        );
        assert_one_line_reason(what, &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(needle) && stderr.contains("--from-metrics"),
            "{what}: {stderr}"
        );
    }
    server.join().expect("server thread");
}
