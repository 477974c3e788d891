//! `strata bench` against a live daemon: a short ramp-up curve produces a report.json that
//! validates against docs/bench-report.schema.json, with the daemon's time series and the
//! emulation stated, and a self-contained report.html; a run interrupted by SIGINT still
//! writes the report of the steps that finished; one while it connects ends it at once.
use crate::common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const BENCH_TIMEOUT: Duration = Duration::from_secs(60);

fn schema_check(report: &Value) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/bench-report.schema.json"
    );
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("schema file"))
        .expect("schema JSON");
    let mut schemas = boon::Schemas::new();
    let mut compiler = boon::Compiler::new();
    compiler
        .add_resource("file:///bench-report.schema.json", schema)
        .expect("schema resource");
    let index = compiler
        .compile("file:///bench-report.schema.json", &mut schemas)
        .unwrap_or_else(|e| panic!("schema: {e:#}"));
    if let Err(e) = schemas.validate(report, index) {
        panic!("report.json does not match the schema: {e:#}");
    }
}

/// `strata bench` arguments for a curve of two rate steps (50% and 100% of the maximum) of
/// the 70r-4k profile against `daemon`'s vol0, from 2 connections at queue depth 4 over 1% of
/// the volume, its report in `out`; `more` adds the step durations and other options.
fn curve_args(daemon: &Daemon, out: &Path, more: &[&str]) -> Vec<String> {
    let out = out.to_str().expect("utf-8 path");
    let (target, api) = (daemon.nbd_uri(VOL0), daemon.http_url());
    let mut args: Vec<String> = [
        "bench",
        "--target",
        target.as_str(),
        "--strata-api",
        api.as_str(),
        "--mode",
        "curve",
        "--profile",
        "70r-4k",
        "--curve-steps",
        "50,100",
        "--conns",
        "2",
        "--qd",
        "4",
        "--working-set-pct",
        "1",
        "--output",
        out,
    ]
    .map(String::from)
    .to_vec();
    args.extend(more.iter().map(|a| a.to_string()));
    args
}

#[test]
fn a_short_curve_against_a_live_daemon_writes_valid_json_and_html() {
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--fast-emulate".into(), "bw=400MB,mixed_bw=200MB".into()],
        ..DaemonOpts::default()
    });
    let out_dir = daemon.scratch_dir().join("report");
    // Both steps must run: a busy machine (tests beside this one, the destager) may well
    // take the 50% step's p99 past the default stop of the curve, which is not this test's.
    let more = [
        "--duration",
        "1500ms",
        "--warmup",
        "500ms",
        "--stop-p99-ms",
        "60000",
        "--quiet",
    ];
    let args = curve_args(&daemon, &out_dir, &more);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_ok(&mut daemon.cli_cmd(&args), BENCH_TIMEOUT);
    assert!(
        out.stdout.is_empty(),
        "--quiet prints nothing: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("report.json")).expect("report.json"),
    )
    .expect("JSON");
    schema_check(&report);

    let target = &report["targets"][0];
    let steps = target["steps"].as_array().expect("steps");
    let names: Vec<&str> = steps
        .iter()
        .map(|s| s["name"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, vec!["max", "50%", "100%"]);
    for s in steps {
        assert!(
            s["ios"].as_u64().unwrap_or(0) > 0,
            "step without I/O: {s:#}"
        );
        assert_eq!(s["errors"], 0);
    }
    let half = &steps[1];
    let expected = steps[0]["iops"].as_f64().unwrap() / 2.0;
    assert!((half["target_iops"].as_f64().unwrap() - expected).abs() < 1e-6 * expected);
    assert!(target["curve_check"]["holds"].is_boolean());

    let strata = &target["strata"];
    let samples = strata["samples"]
        .as_array()
        .expect("the daemon's time series");
    assert!(
        samples.len() >= 3,
        "a run of ~6 s has several 1 s samples: {}",
        samples.len()
    );
    assert!(
        samples
            .iter()
            .any(|s| s["host_write_bytes_per_s"].as_f64().unwrap_or(0.0) > 0.0),
        "the daemon saw the writes"
    );
    let emulated = strata["emulated_devices"]
        .as_array()
        .expect("emulated_devices");
    assert_eq!(emulated.len(), 1, "{strata:#}");
    assert!(
        emulated[0]
            .as_str()
            .unwrap()
            .contains("fast.img [emulated: bw 400.0 MB/s, 50/50 200.0 MB/s]"),
        "{emulated:?}"
    );

    let html = std::fs::read_to_string(out_dir.join("report.html")).expect("report.html");
    assert!(html.contains("<svg") && html.contains("Write-log fill over time"));
    assert!(
        html.contains("Emulated devices"),
        "the HTML states the emulation"
    );
    assert!(!html.contains("<script") && !html.contains("src=\"") && !html.contains("href=\"http"));
    for svg in [
        "curve.svg",
        "service-levels.svg",
        "fill-destage.svg",
        "destage-rate.svg",
    ] {
        let text =
            std::fs::read_to_string(out_dir.join(svg)).unwrap_or_else(|e| panic!("{svg}: {e}"));
        assert!(
            text.starts_with("<svg") && text.ends_with("</svg>"),
            "{svg}"
        );
    }
    daemon.cli_ok(&["status"]);
}

#[test]
fn bench_refuses_bad_input_with_one_line() {
    let daemon = Daemon::start_default();
    let dir = daemon.scratch_dir().join("never");
    let dir_s = dir.to_str().expect("utf-8 path");
    let unknown = daemon.nbd_uri("missing");
    // Targets that fail to answer: the run fails (status 1).
    for target in [unknown.as_str(), "nbd://127.0.0.1:1/x"] {
        let args = [
            "bench",
            "--target",
            target,
            "--no-strata-api",
            "--output",
            dir_s,
        ];
        let out = run_fails(&mut daemon.cli_cmd(&args), BENCH_TIMEOUT);
        assert_one_line_reason(&format!("{args:?}"), &out);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
    }
    // Flags clap takes one by one but that do not fit together, or a value checked later (a
    // profile): usage errors, status 2, as for any other command's bad flags.
    let usage: [&[&str]; 5] = [
        &["--profile", "nope"],
        &["--curve-steps", "90,10"],
        &["--mode", "max", "--max-duration", "9s"],
        &["--mode", "curve", "--rate-iops", "100"],
        &["--target", "nbd://h/y", "--vms", "1"],
    ];
    for extra in usage {
        let mut args = vec!["bench", "--target", "nbd://h/x", "--output", dir_s];
        args.extend_from_slice(extra);
        let out = run_fails(&mut daemon.cli_cmd(&args), BENCH_TIMEOUT);
        assert_one_line_reason(&format!("{args:?}"), &out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: a usage error");
    }
    assert!(!dir.exists(), "a refused run writes nothing");
}

/// Lines of a child's pipe, as they come, on a channel (read on a thread of their own).
fn lines_of(pipe: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Ctrl-C during a curve's second step: that step stops at once and is left out, the report of
/// the finished step is written and says it was interrupted (and which step was cut), the
/// command exits 130, and the daemon is left with no NBD connection.
#[test]
fn an_interrupted_curve_writes_the_report_of_its_finished_steps() {
    let daemon = Daemon::start_default();
    let out_dir = daemon.scratch_dir().join("report");
    // The max step takes 1.3 s; the two rate steps would take 2 x 5.3 s more.
    let args = curve_args(
        &daemon,
        &out_dir,
        &[
            "--max-duration",
            "1s",
            "--duration",
            "5s",
            "--warmup",
            "300ms",
        ],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = daemon.cli_cmd(&args);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut bench = ChildGuard::spawn(&mut cmd);
    let stdout = lines_of(bench.child().stdout.take().expect("stdout"));
    let stderr = lines_of(bench.child().stderr.take().expect("stderr"));
    let mut seen = Vec::new();
    let first_step_done = |line: &str| line.starts_with("strata bench: target max:");
    let deadline = Instant::now() + BENCH_TIMEOUT;
    while !seen.last().is_some_and(|l: &String| first_step_done(l)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match stderr.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(e) => panic!(
                "no line for the max step ({e}); stderr so far:\n{}",
                seen.join("\n")
            ),
        }
    }
    assert!(!out_dir.exists(), "a report before the run ended");
    // The max step's requests were all answered before its line: once the daemon counts more,
    // the 50% step is under way.
    let node = format!("{}/api/v1/node", daemon.http_url());
    let ops = || {
        let io = &common::http::get_json(&node)["io"];
        io["read_ops_total"].as_u64().unwrap_or(0) + io["write_ops_total"].as_u64().unwrap_or(0)
    };
    let after_max = ops();
    assert!(
        wait_until(BENCH_TIMEOUT, || ops() > after_max),
        "the 50% step sent nothing"
    );
    send_signal(bench.child().id(), SIGINT);
    let signalled = Instant::now();
    let status = bench
        .wait_timeout(BENCH_TIMEOUT)
        .expect("bench exits after SIGINT");
    let took = signalled.elapsed();
    seen.extend(stderr.iter());
    let stderr_text = seen.join("\n");
    let stdout_text: Vec<String> = stdout.iter().collect();
    let stdout_text = stdout_text.join("\n");
    assert_eq!(
        status.code(),
        Some(130),
        "exit status after SIGINT: {status}\nstdout:\n{stdout_text}\nstderr:\n{stderr_text}"
    );
    assert!(
        took < Duration::from_secs(4),
        "bench took {took:?} to stop after SIGINT\n{stderr_text}"
    );
    assert!(
        stderr_text.contains("strata: interrupted by SIGINT"),
        "the reason line: {stderr_text}"
    );
    assert!(
        stdout_text.contains("INTERRUPTED"),
        "the summary says so: {stdout_text}"
    );

    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("report.json")).expect("report.json"),
    )
    .expect("JSON");
    schema_check(&report);
    let interrupted = &report["interrupted"];
    eprintln!(
        "stopped {took:?} after SIGINT; stderr:\n{stderr_text}\ninterrupted: {interrupted:#}"
    );
    assert_eq!(interrupted["signal"], "SIGINT", "{interrupted:#}");
    assert_eq!(interrupted["exit_status"], 130);
    assert_eq!(interrupted["finished_steps"], 1);
    let cut = &interrupted["cut_step"];
    assert_eq!(cut["step"], "50%", "the step under way is named: {cut:#}");
    let ran_s = cut["ran_s"].as_f64().unwrap_or(-1.0);
    assert!(
        ran_s > 0.0 && ran_s < 5.3,
        "the 50% step ran {ran_s} s of 5.3"
    );
    let steps = report["targets"][0]["steps"].as_array().expect("steps");
    let names: Vec<&str> = steps.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, vec!["max"], "only the finished step has figures");
    assert!(steps[0]["ios"].as_u64().unwrap_or(0) > 0, "{:#}", steps[0]);
    assert!(steps[0]["latency_us"]["p99"].as_f64().is_some());
    let html = std::fs::read_to_string(out_dir.join("report.html")).expect("report.html");
    assert!(html.contains("<b>Interrupted</b>"), "the HTML says so");

    let closed = wait_until(Duration::from_secs(5), || {
        common::http::get_json(&node)["nbd_connections_total"] == 0
    });
    assert!(
        closed,
        "NBD connections left: {}",
        common::http::get_json(&node)
    );
}

/// A target that accepts connections and never says a word: the handshake would wait its
/// whole timeout (10 s), and a SIGINT meanwhile must end the run at once, with its status and
/// a reason, writing nothing (before, the signal waited for the handshake to fail: exit 1).
#[test]
fn a_signal_while_connecting_ends_the_run_at_once() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let (accepted_tx, accepted) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent.incoming().flatten() {
            held.push(stream);
            let _ = accepted_tx.send(());
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("report");
    let target = format!("nbd://127.0.0.1:{port}/vol0");
    let out = out_dir.to_str().expect("utf-8 path");
    let args = [
        "bench",
        "--target",
        &target,
        "--no-strata-api",
        "--conns",
        "2",
        "--output",
        out,
    ];
    let mut cmd = std::process::Command::new(STRATA_BIN);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut bench = ChildGuard::spawn(&mut cmd);
    let stderr = lines_of(bench.child().stderr.take().expect("stderr"));
    accepted
        .recv_timeout(BENCH_TIMEOUT)
        .expect("bench never connected");
    send_signal(bench.child().id(), SIGINT);
    let status = bench
        .wait_timeout(BENCH_TIMEOUT)
        .expect("bench exits after SIGINT");
    let stderr_text: Vec<String> = stderr.iter().collect();
    let stderr_text = stderr_text.join("\n");
    assert_eq!(status.code(), Some(130), "{status}\n{stderr_text}");
    assert!(
        stderr_text.contains("interrupted by SIGINT while connecting to the targets"),
        "{stderr_text}"
    );
    assert!(!out_dir.exists(), "a report of nothing was written");
}
