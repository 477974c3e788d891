//! Tiering policies end to end: volumes created and changed through the CLI (and the API),
//! policies surviving a restart, bad values refused without changing anything; data pushed to
//! the capacity tier and read again until the read cache promotes it, seen in the volume's
//! figures and on /metrics; an IOPS-limited volume paced while the daemon keeps serving.
use crate::common;

use std::time::{Duration, Instant};

use common::http::{get, get_json, request};
use common::*;
use serde_json::{json, Value};

fn info(daemon: &Daemon, name: &str) -> Value {
    daemon.cli_json(&["volume", "info", name])
}

fn policy(daemon: &Daemon, name: &str) -> Value {
    info(daemon, name)["policy"].clone()
}

/// A CLI call that must fail with one line and leave `name`'s policy as it was.
fn refused(daemon: &Daemon, name: &str, args: &[&str], reason: &str) {
    let before = policy(daemon, name);
    let out = daemon.cli(args);
    assert_one_line_reason(&format!("{args:?}"), &out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(reason), "{args:?}: expected {reason:?} in {stderr}");
    assert_eq!(policy(daemon, name), before, "{args:?} changed the policy");
}

#[test]
fn policies_are_set_changed_checked_and_kept_across_a_restart() {
    let mut daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--default-volume-size".into(), "0".into()],
        ..DaemonOpts::default()
    });
    daemon.cli_ok(&["volume", "create", "plain", "--size", "64M"]);
    daemon.cli_ok(&["volume", "create", "buffer", "--size", "64M", "--policy", "cache"]);
    let out = daemon.cli_ok(&[
        "volume", "create", "tiered", "--size", "64M", "--policy", "tier", "--tier-min-age", "30m",
        "--tier-max-cold-heat", "2", "--promote-after-reads", "3", "--promote-window", "10m",
        "--promote-sequential-cutoff", "8M", "--iops-limit", "500", "--bandwidth-limit", "64M",
    ]);
    assert!(out.contains("tier, 500 IOPS, 64 MiB/s"), "{out}");

    let defaults = policy(&daemon, "plain");
    assert_eq!(defaults["mode"], "cache");
    assert_eq!(defaults["promote_after_reads"], 2);
    assert_eq!(defaults["iops_limit"], 0);
    assert_eq!(policy(&daemon, "buffer"), defaults);
    let want = json!({
        "mode": "tier", "tier_min_age_s": 1800, "tier_max_cold_heat": 2,
        "promote_after_reads": 3, "promote_window_s": 600,
        "promote_sequential_cutoff_bytes": 8 << 20, "iops_limit": 500,
        "bandwidth_limit_bytes_per_s": 64 << 20, "sequential_write_cutoff_bytes": 0,
    });
    assert_eq!(policy(&daemon, "tiered"), want);
    let v = info(&daemon, "tiered");
    assert!(v["figures"]["fast_read_hit_ratio"].is_null(), "{v:#}");
    assert_eq!(v["figures"]["residency_seconds_log2"].as_array().map(Vec::len), Some(24));

    // set-policy changes what it names and keeps the rest.
    daemon.cli_ok(&["volume", "set-policy", "tiered", "--iops-limit", "0", "--policy", "cache"]);
    let mut changed = want.clone();
    changed["iops_limit"] = json!(0);
    changed["mode"] = json!("cache");
    assert_eq!(policy(&daemon, "tiered"), changed);
    let text = daemon.cli_ok(&["volume", "info", "tiered"]);
    assert!(text.contains("policy:      cache\n") && text.contains("IOPS unlimited, 64 MiB/s bandwidth"), "{text}");
    let list = daemon.cli_ok(&["volume", "list"]);
    assert!(list.contains("cache, 64 MiB/s"), "{list}");

    // Bad values: one line, nothing changed.
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--tier-min-age", "5"], "invalid duration");
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--policy", "fast"], "invalid value 'fast'");
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--iops-limit", "-1"], "'-1'");
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--bandwidth-limit", "9Q"], "unknown unit");
    // 100 meant as 100 MB/s: every 4 KiB request would wait 40 s.
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--bandwidth-limit", "100"], "at least 65536");
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--tier-max-cold-heat", "256"], "256");
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--promote-window", "0"], "promote_window_s");
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered", "--promote-after-reads", "5000"], "at most 1000");
    refused(&daemon, "tiered", &["volume", "set-policy", "tiered"], "nothing to change");
    // A sequential write cutoff works only in cache mode: asked for with tier mode, refused.
    refused(
        &daemon,
        "tiered",
        &[
            "volume",
            "set-policy",
            "tiered",
            "--policy",
            "tier",
            "--sequential-write-cutoff",
            "8M",
        ],
        "only in cache mode",
    );
    let out = daemon.cli(&["volume", "set-policy", "nosuch", "--iops-limit", "5"]);
    assert_one_line_reason("unknown volume", &out);
    let out = daemon.cli(&["volume", "create", "bad", "--size", "64M", "--tier-min-age", "1y"]);
    assert_one_line_reason("create with a bad duration", &out);
    let out = daemon.cli(&[
        "volume",
        "create",
        "badcutoff",
        "--size",
        "64M",
        "--policy",
        "tier",
        "--sequential-write-cutoff",
        "8M",
    ]);
    assert_one_line_reason("create with a write cutoff in tier mode", &out);
    assert!(!daemon.cli_ok(&["volume", "list"]).contains("bad"), "a refused create made a volume");

    // set-policy echoes the settings it changed, as text and as JSON.
    let out = daemon.cli_ok(&[
        "volume",
        "set-policy",
        "tiered",
        "--promote-after-reads",
        "4",
        "--promote-window",
        "2m",
        "--sequential-write-cutoff",
        "16M",
    ]);
    assert!(
        out.contains("after 4 read(s) within 2m") && out.contains("past 16 MiB sequential"),
        "{out}"
    );
    let out = daemon.cli_ok(&[
        "--json",
        "volume",
        "set-policy",
        "tiered",
        "--promote-sequential-cutoff",
        "2M",
    ]);
    let v: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        v["policy"]["promote_sequential_cutoff_bytes"],
        2 << 20,
        "{out}"
    );
    assert_eq!(
        v["policy"]["sequential_write_cutoff_bytes"],
        16 << 20,
        "{out}"
    );

    // The API: partial PUT, 400 for bad values, 404 for an unknown volume.
    let base = daemon.http_url();
    let url = format!("{base}/api/v1/volumes/tiered/policy");
    let r = request("PUT", &url, Some(&json!({"iops_limit": 250})), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["policy"]["iops_limit"], 250);
    assert_eq!(r.json()["policy"]["bandwidth_limit_bytes_per_s"], 64 << 20);
    for bad in [json!({"mode": "fast"}), json!({"iops": 1}), json!({"promote_window_s": 0})] {
        let r = request("PUT", &url, Some(&bad), None);
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    let r = request("PUT", &format!("{base}/api/v1/volumes/nosuch/policy"), Some(&json!({})), None);
    assert_eq!(r.status, 404, "{}", r.body);
    let body = json!({"name": "viaapi", "size_bytes": 1 << 20, "policy": {"mode": "tier"}});
    let r = request("POST", &format!("{base}/api/v1/volumes"), Some(&body), None);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["policy"]["mode"], "tier");
    assert_eq!(r.json()["policy"]["tier_min_age_s"], defaults["tier_min_age_s"]);

    let kept = policy(&daemon, "tiered");
    daemon.restart();
    assert_eq!(policy(&daemon, "tiered"), kept, "the policy did not survive a restart");
    assert_eq!(policy(&daemon, "viaapi")["mode"], "tier");
    assert_eq!(policy(&daemon, "plain"), defaults);
}

/// qemu-io commands reading `regions` 64 KiB regions 1 MiB apart, in an order that never
/// continues a sequential stream, each checked against the pattern written there.
fn scattered_reads(regions: u64) -> Vec<String> {
    (0..regions)
        .map(|i| (i * 7) % regions)
        .map(|r| format!("read -P 0x5a {} 65536", r * MIB))
        .collect()
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {prefix} in /metrics"))
}

#[test]
fn reads_of_capacity_data_are_promoted_and_served_from_the_read_cache() {
    if !require_tools(&["qemu-io", "promtool"]) {
        return;
    }
    let daemon = Daemon::start(DaemonOpts {
        fast_size: "64M".into(),
        extra_args: ["--read-cache", "0.5", "--default-volume-size", "256M"]
            .map(String::from)
            .to_vec(),
        ..DaemonOpts::default()
    });
    let status = get_json(&format!("{}/api/v1/status", daemon.http_url()));
    assert_eq!(status["read_cache"]["ratio"], 0.5, "{:#}", status["read_cache"]);
    assert_eq!(status["read_cache"]["setting"], "configured");
    assert!(daemon.cli_ok(&["status"]).contains("read cache 50.0% of the write log"));

    // The regions first, then enough behind them to push the write buffer (half of the ~60 MiB
    // log) past its low mark: the destager moves the oldest data, the regions, out.
    let regions = 16;
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(&uri, &[&format!("write -P 0x5a 0 {}", regions * MIB)]);
    qemu_io_ok(&uri, &[&format!("write -P 0x11 {} {}", 64 * MIB, 48 * MIB)]);
    let on_capacity = wait_until(Duration::from_secs(60), || {
        info(&daemon, VOL0)["capacity_tier_bytes"].as_u64() >= Some(regions * MIB)
    });
    assert!(on_capacity, "the data never reached the capacity tier: {:#}\n{}", info(&daemon, VOL0), daemon.stderr_log());

    let reads = scattered_reads(regions);
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    // Two reads promote (the default); later passes find the copies (promotion is asynchronous).
    for _ in 0..5 {
        qemu_io_ok(&uri, &reads);
    }
    let f = info(&daemon, VOL0)["figures"].clone();
    assert!(f["promoted_bytes"].as_u64() > Some(0), "nothing promoted: {f:#}");
    assert!(f["read_cached_bytes"].as_u64() > Some(0), "no read served by a cached copy: {f:#}");
    assert!(f["read_capacity_bytes"].as_u64() > Some(0), "{f:#}");
    let hit = f["fast_read_hit_ratio"].as_f64().expect("a hit ratio after reads");
    assert!(hit > 0.0 && hit < 1.0, "{f:#}");

    let text = get(&format!("{}/metrics", daemon.http_url())).body;
    let promoted = metric(&text, "strata_volume_promoted_bytes_total{volume=\"vol0\"}");
    assert!(promoted >= f["promoted_bytes"].as_f64().unwrap_or(f64::MAX), "{promoted}");
    let cached = metric(&text, "strata_volume_read_source_bytes_total{volume=\"vol0\",source=\"cache\"}");
    assert!(cached > 0.0);
    assert!(metric(&text, "strata_read_cache_budget_bytes") > 0.0);
    assert!(metric(&text, "strata_volume_fast_read_hit_ratio{volume=\"vol0\"}") > 0.0);
    let residency = metric(&text, "strata_volume_fast_residency_seconds_count{volume=\"vol0\"}");
    assert!(residency >= (regions * MIB / 4096) as f64, "every destaged block is counted: {residency}");
    let out = run_with_stdin(&mut cmd("promtool", &["check", "metrics"]), Some(text.into_bytes()), CMD_TIMEOUT);
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && report.trim().is_empty(), "promtool: {report}");
}

#[test]
fn sequential_writes_past_the_cutoff_go_straight_to_the_capacity_tier() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    let mut daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--default-volume-size".into(), "0".into()],
        ..DaemonOpts::default()
    });
    daemon.cli_ok(&["volume", "create", "seq", "--size", "64M", "--sequential-write-cutoff", "4M"]);
    assert_eq!(policy(&daemon, "seq")["sequential_write_cutoff_bytes"], 4 << 20);
    let text = daemon.cli_ok(&["volume", "info", "seq"]);
    assert!(text.contains("bypass log:  writes of 128K+ past 4 MiB sequential"), "{text}");
    // Older copies in the write log first (scattered 4 KiB writes), then one sequential stream
    // of 1 MiB writes over them: past its first 4 MiB it bypasses the log.
    let uri = daemon.nbd_uri("seq");
    let old: Vec<String> = (0..24u64).map(|i| format!("write -P 0x11 {} 4096", ((i * 5) % 24) * MIB + 8192)).collect();
    qemu_io_ok(&uri, &old.iter().map(String::as_str).collect::<Vec<_>>());
    let stream: Vec<String> = (0..24u64).map(|i| format!("write -P 0x33 {} 1M", i * MIB)).collect();
    qemu_io_ok(&uri, &stream.iter().map(String::as_str).collect::<Vec<_>>());
    let f = info(&daemon, "seq")["figures"].clone();
    let bypassed = f["bypassed_bytes"].as_u64().unwrap_or(0);
    assert!((16 * MIB..=20 * MIB).contains(&bypassed), "bypassed {bypassed} of the 24 MiB stream: {f:#}");
    let text = get(&format!("{}/metrics", daemon.http_url())).body;
    assert_eq!(metric(&text, "strata_volume_bypassed_bytes_total{volume=\"seq\"}"), bypassed as f64);
    qemu_io_ok(&uri, &["read -P 0x33 0 24M"]);
    // A power cut: the older log copies are replayed, and must not shadow the stream.
    daemon.kill9();
    daemon.restart();
    qemu_io_ok(&daemon.nbd_uri("seq"), &["read -P 0x33 0 24M"]);
}

/// Sequential streams written with several requests in flight, over two connections at once,
/// bypass the log as one written a request at a time does: fio's nbd engine, two jobs each
/// writing its own half of the volume in 256 KiB writes at queue depth 8, then reading it back
/// against its checksums. (Before, the daemon noted such writes slightly out of order and
/// interleaved, the detector followed only where the last one noted ended, and none of
/// these bypassed.) The same stream written one request at a time in 128 KiB writes goes
/// through the log: alone, each such write would seal a segment with most of it empty.
#[test]
fn streams_at_queue_depth_eight_on_two_connections_go_straight_to_the_capacity_tier() {
    if !require_tools(&["fio"]) {
        return;
    }
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--default-volume-size".into(), "0".into()],
        ..DaemonOpts::default()
    });
    daemon.cli_ok(&["volume", "create", "seq", "--size", "128M", "--sequential-write-cutoff", "4M"]);
    daemon.cli_ok(&["volume", "create", "one", "--size", "64M", "--sequential-write-cutoff", "4M"]);
    let scratch = daemon.scratch_dir();
    let segments_free = || get_json(&format!("{}/api/v1/status", daemon.http_url()))["engine"]["segments_free"].as_u64();
    let free_before = segments_free();
    let mut fio = cmd(
        "fio",
        &[
            "--name=one", "--ioengine=nbd", &format!("--uri={}", daemon.nbd_uri("one")),
            "--rw=write", "--bs=128k", "--iodepth=1", "--size=32m", "--verify=crc32c",
            "--verify_fatal=1", "--verify_state_save=0",
        ],
    );
    fio.current_dir(&scratch);
    let out = run_timeout(&mut fio, Duration::from_secs(300));
    assert!(out.status.success(), "{}", output_report("fio", &out));
    let f = info(&daemon, "one")["figures"].clone();
    assert_eq!(f["bypassed_bytes"].as_u64(), Some(0), "{f:#}");
    // What destage packs of 32 MiB into 2 MiB segments, not a segment per write (224).
    let free_after = segments_free();
    assert!(free_after.unwrap_or(0) + 20 >= free_before.unwrap_or(u64::MAX), "segments free {free_before:?} -> {free_after:?}");
    let mut fio = cmd(
        "fio",
        &[
            "--name=seq", "--ioengine=nbd", &format!("--uri={}", daemon.nbd_uri("seq")),
            "--rw=write", "--bs=256k", "--iodepth=8", "--size=64m", "--numjobs=2",
            "--offset_increment=64m", "--thread", "--verify=crc32c", "--verify_fatal=1",
            "--verify_state_save=0",
        ],
    );
    fio.current_dir(&scratch);
    let out = run_timeout(&mut fio, Duration::from_secs(300));
    assert!(out.status.success(), "{}", output_report("fio", &out));
    // Each stream past its first 4 MiB: 120 MiB of the 128.
    let f = info(&daemon, "seq")["figures"].clone();
    let bypassed = f["bypassed_bytes"].as_u64().unwrap_or(0);
    assert!(bypassed >= 96 * MIB, "bypassed {} MiB of the 120 MiB past the streams' first 4 MiB: {f:#}", bypassed / MIB);
}

#[test]
fn an_iops_limited_volume_is_paced_while_the_daemon_keeps_serving() {
    if !require_tools(&["qemu-io", "fio"]) {
        return;
    }
    let daemon = Daemon::start_default();
    daemon.cli_ok(&["volume", "create", "slow", "--size", "64M", "--iops-limit", "200"]);
    let scratch = daemon.scratch_dir();
    let runtime_s = 6;
    let mut fio = cmd(
        "fio",
        &[
            "--name=limited", "--ioengine=nbd", &format!("--uri={}", daemon.nbd_uri("slow")),
            "--rw=randread", "--bs=4k", "--iodepth=16", "--size=16m", "--time_based",
            &format!("--runtime={runtime_s}"), "--thread", "--output-format=json",
            "--output=fio.json",
            // Three connections: more than the daemon has async threads on a 2-core machine.
            "--numjobs=3", "--group_reporting",
        ],
    );
    fio.current_dir(&scratch).stdout(std::process::Stdio::null());
    let started = Instant::now();
    let mut load = ChildGuard::spawn(&mut fio);
    // While the limited volume is saturated, the unlimited one and the API answer, at their
    // own pace: 300 reads one at a time take a few hundredths of a second. (Before, the
    // limited requests held the limiter's lock while they waited, the NBD threads asking it
    // blocked, and 200 such reads took 3.4 s here against 0.02 s.)
    std::thread::sleep(Duration::from_secs(1));
    let reads: Vec<String> = (0..300).map(|i| format!("read {} 4k", i * 65536)).collect();
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    let began = Instant::now();
    qemu_io_ok(&daemon.nbd_uri(VOL0), &reads);
    let took = began.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "300 reads of the unlimited volume took {took:?} beside the limited one"
    );
    let status = get(&format!("{}/api/v1/status", daemon.http_url()));
    assert_eq!(status.status, 200);
    let exit = load.wait_timeout(Duration::from_secs(60)).expect("fio finished");
    assert!(exit.success(), "fio failed: {exit}");
    let elapsed_s = started.elapsed().as_secs_f64();
    let stdout = std::fs::read_to_string(scratch.join("fio.json")).expect("fio's JSON report");
    // The nbd engine prints a line of its own before the report.
    let json_text = stdout.find('{').map_or("", |at| &stdout[at..]);
    let report: Value = serde_json::from_str(json_text).unwrap_or_else(|e| panic!("fio JSON ({e}): {stdout}"));
    let ios = report["jobs"][0]["read"]["total_ios"].as_f64().expect("total_ios");
    // The limit allows 200 per second plus at most a second's burst; a slow machine only lowers it.
    assert!(ios <= 200.0 * (elapsed_s + 2.0), "{ios} reads in {elapsed_s:.1} s passed a 200 IOPS limit");
    assert!(ios > 0.0, "limited requests must wait, not fail");
    let f = info(&daemon, "slow")["figures"].clone();
    assert!(f["limited_wait_ms"].as_u64() > Some(0), "no wait recorded: {f:#}");
    let unlimited = info(&daemon, VOL0)["figures"]["limited_wait_ms"].clone();
    assert_eq!(unlimited, 0, "the unlimited volume waited");
}

/// A clean stop (SIGTERM) answers the requests a limited volume's client has in flight at
/// once, not each in its turn: at 1 IOPS, fio's 16 reads in flight would hold it for 15 s.
#[test]
fn a_clean_stop_does_not_wait_out_a_volumes_iops_limit() {
    if !require_tools(&["fio"]) {
        return;
    }
    let mut daemon = Daemon::start_default();
    daemon.cli_ok(&["volume", "create", "slow", "--size", "16M", "--iops-limit", "1"]);
    let scratch = daemon.scratch_dir();
    let mut fio = cmd(
        "fio",
        &[
            "--name=limited", "--ioengine=nbd", &format!("--uri={}", daemon.nbd_uri("slow")),
            "--rw=randread", "--bs=4k", "--iodepth=16", "--size=16m", "--time_based",
            "--runtime=60", "--thread",
        ],
    );
    fio.current_dir(&scratch)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _load = ChildGuard::spawn(&mut fio);
    // Until the volume's requests wait for the limit: the second of burst spent, 15 queued.
    let waiting = Instant::now() + Duration::from_secs(30);
    while info(&daemon, "slow")["figures"]["limited_wait_ms"].as_u64() < Some(1000) {
        assert!(Instant::now() < waiting, "fio's reads never waited for the limit");
        std::thread::sleep(Duration::from_millis(100));
    }
    let stopped = Instant::now();
    daemon.signal(SIGTERM);
    let status = daemon.wait_exit();
    let took = stopped.elapsed();
    assert!(status.success(), "daemon exited with {status}\n{}", daemon.stderr_log());
    assert!(
        took < Duration::from_secs(8),
        "the stop took {took:?}: it waited for the limit's turns\n{}",
        daemon.stderr_log()
    );
}
