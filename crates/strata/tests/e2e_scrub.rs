//! Scrub end to end, with the real daemon on files: data blocks damaged on each tier while the
//! daemon is stopped and one metadata copy damaged while it runs; `strata scrub` finds every
//! one by volume and offset, repairs the metadata copy, and reads of the damaged blocks fail
//! with an I/O error. A fast superblock copy damaged while it is stopped is rewritten at start. Also: the CLI's refusals (an unknown volume, a second scrub while one runs), a
//! capacity device put back from an older copy, refused at start rather than read as current,
//! and a write-log batch that cannot be read, skipped at start only when asked.
use crate::common;

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::http::get_json;
use common::*;
use serde_json::Value;

const BLOCK: usize = 4096;
/// What `strata scrub` exits with when it found damage.
const EXIT_DAMAGE_FOUND: i32 = 3;

/// A 64 MiB fast device: the log holds far less than the test writes, so the first blocks
/// written are destaged and their log space is reused.
fn small_fast_tier() -> Daemon {
    Daemon::start(DaemonOpts {
        fast_size: "64M".into(),
        capacity_size: "512M".into(),
        extra_args: vec!["--scrub-interval".into(), "off".into()],
        ..Default::default()
    })
}

/// File offsets of the 4 KiB blocks of `path` filled with `byte`.
fn blocks_of(path: &Path, byte: u8) -> Vec<u64> {
    let mut f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; 1 << 20];
    let (mut at, mut found) = (0u64, Vec::new());
    loop {
        let n = read_full(&mut f, &mut buf);
        for (i, block) in buf[..n].chunks_exact(BLOCK).enumerate() {
            if block.iter().all(|&b| b == byte) {
                found.push(at + (i * BLOCK) as u64);
            }
        }
        if n < buf.len() {
            return found;
        }
        at += n as u64;
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]).expect("read") {
            0 => break,
            k => n += k,
        }
    }
    n
}

/// Inverts one byte of a file, as a bit rot would.
fn flip_byte(path: &Path, offset: u64) {
    let mut f = OpenOptions::new().read(true).write(true).open(path).expect("open for damage");
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.read_exact(&mut b).expect("read");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(&[!b[0]]).expect("write");
    f.sync_all().expect("sync");
}

fn read_bytes(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = File::open(path).expect("open");
    let mut buf = vec![0u8; len];
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.read_exact(&mut buf).expect("read");
    buf
}

/// Checksum failures per device tier from /api/v1/devices: (fast, capacity).
fn checksum_failures(daemon: &Daemon) -> (u64, u64) {
    let v = get_json(&format!("{}/api/v1/devices", daemon.http_url()));
    let count = |tier: &str| {
        v["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .filter(|d| d["tier"] == tier)
            .map(|d| d["checksum_errors_total"].as_u64().unwrap_or_else(|| panic!("no count: {d}")))
            .sum()
    };
    (count("fast"), count("capacity"))
}

/// One sample of /metrics, found by name and a label (`""`: the family's one unlabelled sample).
fn metric(daemon: &Daemon, name: &str, label: &str) -> f64 {
    let text = common::http::get(&format!("{}/metrics", daemon.http_url())).body;
    let line = text
        .lines()
        .find(|l| {
            (l.starts_with(&format!("{name}{{")) && l.contains(label))
                || (label.is_empty() && l.starts_with(&format!("{name} ")))
        })
        .unwrap_or_else(|| panic!("no {name} {label} in /metrics:\n{text}"));
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("bad sample {line}"))
}

/// `strata --json scrub ARGS`: its exit status and report.
fn scrub_json(daemon: &Daemon, args: &[&str]) -> (Option<i32>, Value, Output) {
    let mut all = vec!["--json", "scrub"];
    all.extend_from_slice(args);
    let out = daemon.cli(&all);
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("`strata {all:?}` printed no report ({e}): {out:?}\n{}", daemon.stderr_log())
    });
    (out.status.code(), report, out)
}

fn bad_blocks(report: &Value) -> Vec<(String, u64, String)> {
    let mut list: Vec<_> = report["bad_blocks"]
        .as_array()
        .expect("bad_blocks")
        .iter()
        .map(|b| (b["volume"].as_str().unwrap_or("?").to_string(), b["offset"].as_u64().unwrap_or(u64::MAX), b["tier"].as_str().unwrap_or("?").to_string()))
        .collect();
    list.sort();
    list
}

/// Asserts a qemu-io read failed with an I/O error and returned no data, and that the
/// daemon's reply was an error chunk carrying EIO.
fn assert_read_fails(daemon: &Daemon, export: &str, offset: u64) {
    let out = qemu_io(&daemon.nbd_uri(export), &[&format!("read {offset} 4096")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("Input/output error") && !stdout.contains("read 4096/4096 bytes"),
        "reading the damaged block {export}:{offset} must fail with EIO: {out:?}"
    );
    let mut client = common::nbd::go_structured(daemon.nbd_addr, export).expect("NBD_OPT_GO");
    let read = client.read_structured(offset, 4096).expect("io");
    assert!(
        matches!(read, Err((common::nbd::EIO, _))),
        "the damaged block {export}:{offset} read over structured replies: {:?}",
        read.map(|data| data.len())
    );
    client.disconnect();
}

#[test]
fn scrub_finds_damage_on_both_tiers_and_repairs_a_metadata_copy() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    let mut daemon = small_fast_tier();
    daemon.create_volume("db", "256M");
    daemon.create_volume("web", "16M");
    // db's blocks go first, then far more than the log holds: they end up on the capacity tier
    // only. web's are written last and stay in the log.
    let db = daemon.nbd_uri("db");
    qemu_io_ok(&db, &["write -P 0xa0 0 64k", "write -P 0xa1 12k 4k"]);
    let filler: Vec<String> = (0..20).map(|i| format!("write -P 0x5c {}M 8M", 16 + 8 * i)).collect();
    qemu_io_ok(&db, &filler.iter().map(String::as_str).collect::<Vec<_>>());
    qemu_io_ok(&daemon.nbd_uri("web"), &["write -P 0xb0 0 64k", "write -P 0xb1 40k 4k"]);
    daemon.terminate();

    let fast = daemon.data_dir().join("fast.img");
    let capacity = daemon.data_dir().join("capacity-0.img");
    let on_capacity = blocks_of(&capacity, 0xa1);
    assert_eq!(on_capacity.len(), 1, "db's block 12k is not on the capacity device once: {on_capacity:?}");
    assert!(blocks_of(&fast, 0xa1).is_empty(), "the log still holds db's block 12k");
    let in_log = blocks_of(&fast, 0xb1);
    assert_eq!(in_log.len(), 1, "web's block 40k is not in the log once: {in_log:?}");
    assert!(blocks_of(&capacity, 0xb1).is_empty(), "web's block 40k was destaged");
    flip_byte(&capacity, on_capacity[0] + 100);
    flip_byte(&fast, in_log[0] + 2000);
    daemon.restart();
    // Superblock copy B of the fast device, damaged while the daemon runs: a start rewrites a
    // damaged superblock copy of any device, so only a scrub finds one damaged since.
    flip_byte(&fast, BLOCK as u64 + 64);

    let before = checksum_failures(&daemon);
    let (code, report, out) = scrub_json(&daemon, &[]);
    assert_eq!(code, Some(EXIT_DAMAGE_FOUND), "{out:?}");
    assert_one_line_reason("a scrub that found damage", &out);
    assert_eq!(report["clean"], false, "{report:#}");
    assert_eq!(report["bad_blocks_total"], 2, "{report:#}");
    let want = vec![("db".to_string(), 12288, "capacity".to_string()), ("web".to_string(), 40960, "fast".to_string())];
    assert_eq!(bad_blocks(&report), want, "{report:#}");
    let repaired: Vec<&str> = report["metadata_repaired"].as_array().expect("list").iter().filter_map(Value::as_str).collect();
    assert!(
        repaired.len() == 1 && repaired[0].contains("fast.img") && repaired[0].contains("superblock copy B"),
        "{report:#}"
    );
    assert_eq!(report["metadata_damaged"], Value::Array(vec![]), "{report:#}");
    assert!(report["data_bytes_verified"].as_u64() >= Some(160 << 20), "{report:#}");
    let after = checksum_failures(&daemon);
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 1), "one bad block on each device");
    assert_eq!(metric(&daemon, "strata_device_checksum_errors_total", "tier=\"fast\"") as u64, after.0);
    assert_eq!(metric(&daemon, "strata_device_checksum_errors_total", "tier=\"capacity\"") as u64, after.1);
    assert_eq!(metric(&daemon, "strata_scrub_last_bad_blocks", ""), 2.0);
    assert_eq!(metric(&daemon, "strata_scrub_last_metadata_repaired", ""), 1.0);
    // The copy on the device was rewritten from the good one.
    assert_eq!(read_bytes(&fast, 0, BLOCK), read_bytes(&fast, BLOCK as u64, BLOCK), "superblock copy B not repaired");

    // Damaged blocks fail, never return data; their neighbours read as written.
    assert_read_fails(&daemon, "db", 12288);
    assert_read_fails(&daemon, "web", 40960);
    // (A restarted daemon listens on new ports.)
    let db = daemon.nbd_uri("db");
    qemu_io_ok(&db, &["read -P 0xa0 8k 4k", "read -P 0xa0 16k 4k", "read -P 0x5c 16M 1M"]);
    qemu_io_ok(&daemon.nbd_uri("web"), &["read -P 0xb0 36k 4k", "read -P 0xb0 44k 4k"]);

    // The status shows the damage until a scrub finds none.
    let status = daemon.cli_json(&["status"]);
    let warned = status["warnings"].as_array().expect("warnings").iter().filter_map(Value::as_str).any(|w| w.contains("2 bad data block(s)"));
    assert!(warned, "{:#}", status["warnings"]);
    assert_eq!(status["disk_groups"][0]["scrub"]["last_result"]["bad_blocks_total"], 2);
    let page = daemon.cli_ok(&["status"]);
    assert!(page.contains("scrub        DAMAGE FOUND: 2 bad block(s), 1 metadata copy(ies) repaired"), "{page}");

    // A second scrub: the same bad blocks, nothing left to repair.
    let before = checksum_failures(&daemon);
    let (code, again, out) = scrub_json(&daemon, &[]);
    assert_eq!(code, Some(EXIT_DAMAGE_FOUND), "{out:?}");
    assert_eq!(bad_blocks(&again), want, "{again:#}");
    assert_eq!(again["metadata_repaired"], Value::Array(vec![]), "{again:#}");
    let after = checksum_failures(&daemon);
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 1));
    // The last report again, with the same exit status.
    let out = daemon.cli(&["scrub", "--last"]);
    assert_eq!(out.status.code(), Some(EXIT_DAMAGE_FOUND), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("bad blocks   2"), "{out:?}");

    // One volume: only its blocks; the human report lists them as a table.
    let out = daemon.cli(&["scrub", "db", "--rate", "0"]);
    assert_eq!(out.status.code(), Some(EXIT_DAMAGE_FOUND), "{out:?}");
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(page.starts_with("scrub of volume db and its snapshots:"), "{page}");
    let row = page.lines().find(|l| l.trim_start().starts_with("db ")).unwrap_or_else(|| panic!("no row: {page}"));
    assert_eq!(row.split_whitespace().take(3).collect::<Vec<_>>(), ["db", "12288", "capacity"], "{page}");
    assert!(!page.contains("web"), "{page}");

    // The last report outlives the daemon (kept in its data directory): after a restart the
    // damage still shows, and `--last` prints the same report with the same exit status.
    daemon.restart();
    let out = daemon.cli(&["scrub", "--last"]);
    assert_eq!(out.status.code(), Some(EXIT_DAMAGE_FOUND), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        page,
        "not the same last report after a restart"
    );
    let status = daemon.cli_json(&["status"]);
    assert_eq!(
        status["disk_groups"][0]["scrub"]["last_result"]["scope"], "db",
        "{status:#}"
    );
}

/// A daemon with no background scrub and a volume `web` with 16 blocks written 4 MiB apart:
/// each is checked and paced on its own, so a slow scrub sleeps after every one and runs for
/// seconds. None without qemu-io.
fn daemon_with_web() -> Option<Daemon> {
    if !require_tools(&["qemu-io"]) {
        return None;
    }
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--scrub-interval".into(), "off".into()],
        ..Default::default()
    });
    daemon.create_volume("web", "64M");
    let writes: Vec<String> = (0..16).map(|i| format!("write -P 0x3c {}M 4k", i * 4)).collect();
    qemu_io_ok(&daemon.nbd_uri("web"), &writes.iter().map(String::as_str).collect::<Vec<_>>());
    Some(daemon)
}

#[test]
fn scrub_refuses_an_unknown_volume_and_a_second_scrub() {
    let Some(daemon) = daemon_with_web() else {
        return;
    };

    let out = daemon.cli(&["scrub", "nope"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_one_line_reason("scrub of an unknown volume", &out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"nope\" not found"), "{out:?}");
    let out = daemon.cli(&["scrub", "--rate", "fast"]);
    assert_one_line_reason("scrub with a bad rate", &out);

    // 64 KiB of data and the metadata at 128 KiB/s: a scrub of a second or so.
    let mut slow = daemon.cli_cmd(&["--json", "scrub", "web", "--rate", "128K"]);
    let slow = std::thread::spawn(move || run_timeout(&mut slow, Duration::from_secs(120)));
    let status_url = format!("{}/api/v1/scrub", daemon.http_url());
    let running = wait_until(Duration::from_secs(20), || get_json(&status_url)["running"] == true);
    assert!(running, "the slow scrub never showed as running");
    let out = daemon.cli(&["scrub"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_one_line_reason("a second scrub", &out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("already running"), "{out:?}");

    let out = slow.join().expect("the slow scrub's thread");
    assert!(out.status.success(), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    assert_eq!(report["scope"], "web");
    assert_eq!(report["clean"], true, "{report:#}");
    assert!(report["data_bytes_verified"].as_u64() >= Some(16 * 4096), "{report:#}");
    let page = daemon.cli_ok(&["status"]);
    assert!(page.contains("scrub        clean: "), "{page}");
}

/// `strata scrub --detach` returns at once; the scrub runs on with nobody waiting, and
/// `strata scrub --last` prints its report once it ended.
#[test]
fn a_detached_scrub_runs_on_and_its_report_is_the_last() {
    let Some(daemon) = daemon_with_web() else {
        return;
    };
    let out = daemon.cli(&["scrub", "--last"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_one_line_reason("--last before any scrub", &out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no scrub has ended"), "{out:?}");

    // 64 KiB of data and the metadata at 32 KiB/s: a scrub of a few seconds.
    let out = daemon.cli(&["scrub", "web", "--rate", "32K", "--detach"]);
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("scrub of volume web and its snapshots started"), "{said}");
    // The command has ended; the scrub has not.
    let status_url = format!("{}/api/v1/scrub", daemon.http_url());
    let status = get_json(&status_url);
    assert_eq!(status["running"], true, "{status}");
    let out = daemon.cli(&["scrub", "--detach"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("already running"), "{out:?}");
    let out = daemon.cli(&["scrub", "--last"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("(one runs: scrubbing"), "{out:?}");

    let ended = wait_until(Duration::from_secs(60), || get_json(&status_url)["running"] == false);
    assert!(ended, "the detached scrub never ended");
    let report = daemon.cli_json(&["scrub", "--last"]);
    assert_eq!(report["scope"], "web", "{report:#}");
    assert_eq!(report["clean"], true, "{report:#}");
    assert!(report["data_bytes_verified"].as_u64() >= Some(16 * 4096), "{report:#}");
    let page = daemon.cli_ok(&["scrub", "--last"]);
    assert!(page.starts_with("scrub of volume web and its snapshots:"), "{page}");
}

#[test]
fn scrub_cancel_stops_the_background_scrub() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    // A background scrub 5 s after start, at 4 KiB/s: it would run for minutes.
    let daemon = Daemon::start(DaemonOpts {
        extra_args: ["--scrub-interval", "5s", "--scrub-rate", "4K"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    });
    daemon.create_volume("web", "64M");
    let writes: Vec<String> = (0..16)
        .map(|i| format!("write -P 0x3c {}M 4k", i * 4))
        .collect();
    qemu_io_ok(
        &daemon.nbd_uri("web"),
        &writes.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let status_url = format!("{}/api/v1/scrub", daemon.http_url());
    let running = wait_until(Duration::from_secs(30), || {
        get_json(&status_url)["running"] == true
    });
    assert!(running, "the background scrub never showed as running");

    let out = daemon.cli(&["scrub", "--cancel"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("the scrub stopped"),
        "{out:?}"
    );
    let status = get_json(&status_url);
    assert_eq!(status["running"], false, "{status}");
    assert!(
        status["last"].is_null(),
        "a cancelled scrub is no result: {status}"
    );
    // Nothing runs now (the next background scrub is 5 s away): nothing to cancel.
    let out = daemon.cli(&["scrub", "--cancel"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_one_line_reason("a cancel with no scrub running", &out);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no scrub is running"),
        "{out:?}"
    );
    let out = daemon.cli(&["scrub", "web", "--cancel"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a cancel naming a volume is a usage error: {out:?}"
    );
}

/// The fast superblock's copy A damaged while the daemon is stopped: the next start says so
/// and rewrites it from copy B, as it does a capacity device's. It was silent until a scrub.
#[test]
fn a_damaged_fast_superblock_copy_is_rewritten_at_start() {
    let mut daemon = small_fast_tier();
    daemon.terminate();
    let fast = daemon.data_dir().join("fast.img");
    let good = read_bytes(&fast, 0, BLOCK);
    assert_eq!(read_bytes(&fast, BLOCK as u64, BLOCK), good, "copy B");
    flip_byte(&fast, 200);

    daemon.restart();
    let log = daemon.last_stderr();
    let warned = log.lines().any(|l| {
        l.contains("WARN")
            && l.contains(
                "superblock copy A is damaged (superblock checksum mismatch); rewriting it from \
                 copy B",
            )
            && l.contains("fast.img")
    });
    assert!(warned, "no warning for the damaged copy:\n{log}");
    daemon.terminate();
    assert!(
        read_bytes(&fast, 0, BLOCK) == good,
        "copy A was not rewritten"
    );
    assert!(
        read_bytes(&fast, BLOCK as u64, BLOCK) == good,
        "copy B changed"
    );
}

/// Copies a (sparse) device file.
fn copy_device(from: &Path, to: &Path) {
    let out = run_timeout(
        &mut cmd("cp", &["--sparse=always", path_str(from), path_str(to)]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "cp: {out:?}");
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A capacity device put back from a copy taken before the last run (one device restored from
/// a backup) no longer matches the fast device's metadata: the daemon refuses to start on it,
/// with the reason, and starts again once the device it last used is back.
#[test]
fn a_capacity_device_put_back_from_an_older_copy_is_refused() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    let mut daemon = small_fast_tier();
    daemon.create_volume("db", "64M");
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x11 0 8M"]);
    daemon.terminate();
    let capacity = daemon.data_dir().join("capacity-0.img");
    let older = daemon.scratch_dir().join("capacity-0.older");
    copy_device(&capacity, &older);

    daemon.restart();
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x22 0 8M"]);
    daemon.terminate();
    let current = daemon.scratch_dir().join("capacity-0.current");
    std::fs::rename(&capacity, &current).expect("set the current device aside");
    copy_device(&older, &capacity);

    let data = daemon.data_dir();
    let args = ["serve", "--data-dir", path_str(&data), "--nbd-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    let out = run_timeout(&mut cmd(STRATA_BIN, &args), Duration::from_secs(60));
    assert!(!out.status.success(), "started on the older copy: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(
        last.starts_with("strata: ") && last.contains("capacity-0.img is older than the rest of disk group"),
        "the last line must give the reason:\n{stderr}"
    );
    assert_eq!(read_bytes(&capacity, 0, 2 * BLOCK), read_bytes(&older, 0, 2 * BLOCK), "the refused start wrote the superblocks");

    std::fs::rename(&current, &capacity).expect("put the current device back");
    daemon.restart();
    qemu_io_ok(&daemon.nbd_uri("db"), &["read -P 0x22 0 8M"]);
}

/// A write-log batch header damaged while the daemon was down, in its record (so it cannot be
/// salvaged; later batches record the batch as written): the start refuses and says how to
/// open anyway; `--skip-damaged-log-batches` opens the group, losing that batch's write alone,
/// and status warns. Once the log is destaged past the damage, a start without the flag opens.
#[test]
fn a_start_skips_an_unreadable_write_log_batch_only_when_asked() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    let mut daemon = small_fast_tier();
    daemon.create_volume("db", "16M");
    for (i, byte) in [0x5au8, 0x6b, 0x7c].into_iter().enumerate() {
        qemu_io_ok(&daemon.nbd_uri("db"), &[&format!("write -P {byte:#04x} {} 4k", i * BLOCK)]);
    }
    daemon.kill9();
    let fast = daemon.data_dir().join("fast.img");
    let at = blocks_of(&fast, 0x6b);
    assert_eq!(at.len(), 1, "the second write's block in the log: {at:?}");
    // Byte 100 of the batch's header block lies in its one record's header.
    flip_byte(&fast, at[0] - BLOCK as u64 + 100);

    let data = daemon.data_dir();
    let args = ["serve", "--data-dir", path_str(&data), "--nbd-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    let out = run_timeout(&mut cmd(STRATA_BIN, &args), Duration::from_secs(60));
    assert!(!out.status.success(), "started over the damaged log: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(
        last.contains("the write log is damaged") && last.contains("--skip-damaged-log-batches"),
        "the last line must say what to do:\n{stderr}"
    );

    daemon.restart_with(&["--skip-damaged-log-batches"]);
    let status = get_json(&format!("{}/api/v1/status", daemon.http_url()));
    assert_eq!(status["engine"]["log_records_lost_at_start"], 1, "{status:#}");
    let warnings = status["warnings"].to_string();
    assert!(warnings.contains("this start skipped 1 write-log record(s)"), "{warnings}");
    qemu_io_ok(&daemon.nbd_uri("db"), &["read -P 0x5a 0 4k", "read -P 0 4k 4k", "read -P 0x7c 8k 4k"]);
    let began = std::time::Instant::now();
    while get_json(&format!("{}/api/v1/status", daemon.http_url()))["engine"]["log_damage_pending"] != false {
        assert!(began.elapsed() < Duration::from_secs(60), "the log was not destaged past the damage");
        std::thread::sleep(Duration::from_millis(100));
    }

    daemon.kill9();
    daemon.restart();
    qemu_io_ok(&daemon.nbd_uri("db"), &["read -P 0x5a 0 4k", "read -P 0 4k 4k", "read -P 0x7c 8k 4k"]);
    let status = get_json(&format!("{}/api/v1/status", daemon.http_url()));
    assert_eq!(status["engine"]["log_records_lost_at_start"], 0, "{status:#}");
}
