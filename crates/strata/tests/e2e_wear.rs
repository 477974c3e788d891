//! Endurance end to end: the bytes a device received as the daemon counts them against what
//! the kernel counted on loop devices, the device catalog and the wear warning of a running
//! daemon, and `strata size` (its flags, errors, JSON, and `--from-metrics` against a live daemon).
mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const FAST_FILE_BYTES: u64 = 64 * MIB;
const CAPACITY_FILE_BYTES: u64 = 512 * MIB;
/// Four times the fast tier: most of it must be destaged to the capacity device.
const WRITTEN_BYTES: u64 = 256 * MIB;
const SETTLE_TIMEOUT: Duration = Duration::from_secs(90);

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

/// Lifetime bytes written per device as the daemon reports them, fast first.
fn daemon_bytes_written(daemon: &Daemon) -> Vec<u64> {
    let doc = get_json(daemon, "/api/v1/devices");
    doc["devices"]
        .as_array()
        .expect("devices array")
        .iter()
        .map(|d| {
            d["wear"]["bytes_written_total"]
                .as_u64()
                .unwrap_or_else(|| panic!("no wear.bytes_written_total in {d}"))
        })
        .collect()
}

fn environment_allows_loop_devices() -> bool {
    let missing = if !is_root() {
        Some("not running as root")
    } else if !Path::new("/dev/loop-control").exists() {
        Some("/dev/loop-control is missing (no loop devices)")
    } else {
        None
    };
    if let Some(why) = missing {
        eprintln!("\n!!!!!!!! SKIPPING the wear accuracy test: {why}; it needs root and loop devices !!!!!!!!\n");
        return false;
    }
    require_tools(&["losetup", "qemu-io"])
}

/// A loop device over a file; detached on drop, also while unwinding from a failed assertion.
struct Loop {
    device: String,
}

impl Loop {
    fn attach(file: &Path) -> Loop {
        let out = run_ok(
            &mut cmd("losetup", &["--find", "--show", file.to_str().expect("utf-8")]),
            CMD_TIMEOUT,
        );
        let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(device.starts_with("/dev/loop"), "losetup printed {device:?}");
        Loop { device }
    }

    /// Sectors of 512 bytes the kernel completed as writes on this device
    /// (/sys/block/loopN/stat, field 7), in bytes.
    fn kernel_bytes_written(&self) -> u64 {
        let name = self.device.trim_start_matches("/dev/");
        let path = format!("/sys/block/{name}/stat");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
        let fields: Vec<u64> = text
            .split_whitespace()
            .map(|f| f.parse().unwrap_or_else(|_| panic!("{path}: bad field {f:?}")))
            .collect();
        assert!(fields.len() >= 7, "{path}: {text:?}");
        fields[6] * 512
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = cmd("losetup", &["-d", &self.device]).status();
    }
}

fn sparse_file(path: &Path, len: u64) -> PathBuf {
    let f = std::fs::File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(len).expect("set_len");
    path.to_path_buf()
}

/// Waits until the daemon's counters stop moving (destaging and checkpoints done), then reads
/// the daemon's and the kernel's counts at a moment the kernel's did not change around.
fn settled_counts(daemon: &Daemon, loops: &[&Loop]) -> (Vec<u64>, Vec<u64>) {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let mut last = daemon_bytes_written(daemon);
    let mut stable_since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let kernel_before: Vec<u64> = loops.iter().map(|l| l.kernel_bytes_written()).collect();
        let now = daemon_bytes_written(daemon);
        let kernel_after: Vec<u64> = loops.iter().map(|l| l.kernel_bytes_written()).collect();
        if now != last || kernel_before != kernel_after {
            last = now;
            stable_since = Instant::now();
        } else if stable_since.elapsed() >= Duration::from_secs(2) {
            return (now, kernel_after);
        }
        assert!(
            Instant::now() < deadline,
            "device counters still moving after {SETTLE_TIMEOUT:?}\n{}",
            daemon.stderr_log()
        );
    }
}

fn assert_within_5_percent(what: &str, daemon_bytes: u64, kernel_bytes: u64) {
    let diff = daemon_bytes.abs_diff(kernel_bytes) as f64;
    assert!(
        kernel_bytes > 0 && diff <= 0.05 * kernel_bytes as f64,
        "{what}: the daemon counted {daemon_bytes} bytes written, the kernel {kernel_bytes} \
         ({:.2}% apart)",
        100.0 * diff / kernel_bytes.max(1) as f64
    );
}

#[test]
fn device_bytes_written_match_the_kernels_loop_device_counters() {
    if !environment_allows_loop_devices() {
        return;
    }
    let dir = tempfile::Builder::new().prefix("strata-wear-").tempdir().expect("tempdir");
    // Declared before the daemon: on a panic the daemon is killed first, then the loops go.
    let fast = Loop::attach(&sparse_file(&dir.path().join("fast.img"), FAST_FILE_BYTES));
    let capacity = Loop::attach(&sparse_file(&dir.path().join("capacity.img"), CAPACITY_FILE_BYTES));
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec![
            "--fast-device".into(),
            fast.device.clone(),
            "--capacity-device".into(),
            capacity.device.clone(),
            "--default-volume-size".into(),
            "1G".into(),
        ],
        ..DaemonOpts::default()
    });
    let (daemon_start, kernel_start) = settled_counts(&daemon, &[&fast, &capacity]);
    assert_eq!(daemon_start.len(), 2, "one fast and one capacity device");

    let uri = daemon.nbd_uri(VOL0);
    let chunk = 32 * MIB;
    for i in 0..WRITTEN_BYTES / chunk {
        let command = format!("write -P 0x{:02x} {} {chunk}", 0x40 + i, i * chunk);
        qemu_io_ok(&uri, &[&command]);
    }
    let (daemon_end, kernel_end) = settled_counts(&daemon, &[&fast, &capacity]);

    let daemon_fast = daemon_end[0] - daemon_start[0];
    let daemon_cap = daemon_end[1] - daemon_start[1];
    let kernel_fast = kernel_end[0] - kernel_start[0];
    let kernel_cap = kernel_end[1] - kernel_start[1];
    eprintln!(
        "wrote {WRITTEN_BYTES} bytes: fast daemon {daemon_fast} kernel {kernel_fast}; \
         capacity daemon {daemon_cap} kernel {kernel_cap}"
    );
    // Every host byte goes through the log; what the fast tier cannot hold was destaged.
    assert!(daemon_fast >= WRITTEN_BYTES, "fast device got {daemon_fast} < {WRITTEN_BYTES}");
    assert!(
        kernel_cap >= WRITTEN_BYTES - FAST_FILE_BYTES,
        "capacity device got only {kernel_cap} bytes: no destage?"
    );
    assert_within_5_percent("fast device", daemon_fast, kernel_fast);
    assert_within_5_percent("capacity device", daemon_cap, kernel_cap);
    // Compared from the moment the daemon is ready: the writes of formatting the devices
    // happen before the engine starts counting, so lifetime totals differ by those.
    // The same bytes drive the drive-writes-per-day figure.
    let devices = get_json(&daemon, "/api/v1/devices");
    let dwpd = devices["devices"][0]["wear"]["drive_writes_per_day"].as_f64().expect("dwpd");
    assert!(dwpd > 0.0, "{devices:#}");
}

const TINY_CATALOG: &str = r#"
[[device]]
id = "tiny-test"
name = "a device rated for almost nothing"
media = "tlc"
capacity_gb = 1
dwpd = 0.001
warranty_years = 5
seq_read_mb_per_s = 100
seq_write_mb_per_s = 100
random_read_iops = 1000
random_write_iops = 1000
preferred_write_bytes = 4096
"#;

#[test]
fn a_device_wearing_out_early_is_logged_flagged_and_warned_about() {
    let catalog_dir = tempfile::tempdir().expect("tempdir");
    let catalog = catalog_dir.path().join("tiny.toml");
    std::fs::write(&catalog, TINY_CATALOG).expect("write catalog");
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec![
            "--catalog".into(),
            catalog.display().to_string(),
            "--fast-device-model".into(),
            "tiny-test".into(),
            "--capacity-device-model".into(),
            "optane-p5800x-400g".into(),
        ],
        ..DaemonOpts::default()
    });
    qemu_io_ok(&daemon.nbd_uri(VOL0), &["write -P 0x11 0 4M"]);

    let devices = get_json(&daemon, "/api/v1/devices");
    let fast = &devices["devices"][0]["wear"];
    let cap = &devices["devices"][1]["wear"];
    assert_eq!(fast["model"], "tiny-test", "{devices:#}");
    // 1 GB x 0.001 DWPD x 365 x 5 years.
    let rated = fast["rated_endurance_bytes"].as_f64().expect("rated");
    assert!((rated - 1e9 * 0.001 * 365.0 * 5.0).abs() < 1.0, "{rated}");
    assert_eq!(fast["wears_out_before_warranty"], true, "{devices:#}");
    assert!(fast["projected_wear_out_unix_s"].as_u64() < fast["warranty_end_unix_s"].as_u64());
    // The built-in Optane entry: 100 DWPD x 400 GB x 365 x 5 = 73 PB, far from worn.
    assert_eq!(cap["model"], "optane-p5800x-400g");
    assert_eq!(cap["rated_endurance_bytes"].as_f64(), Some(7.3e16));
    assert_eq!(cap["wears_out_before_warranty"], false);

    let node = get_json(&daemon, "/api/v1/node");
    let warnings = node["warnings"].to_string();
    assert!(warnings.contains("would wear out before its warranty"), "{node:#}");
    let metrics = ureq::get(&format!("{}/metrics", daemon.http_url()))
        .call()
        .expect("GET /metrics")
        .into_string()
        .expect("metrics text");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("strata_device_wear_out_before_warranty{") && l.contains("tier=\"fast\"") && l.ends_with(" 1")),
        "{metrics}"
    );
    // The log says so once (not every check), within a couple of check intervals.
    let logged = wait_until(Duration::from_secs(20), || {
        daemon.stderr_log().contains("device would wear out before its warranty ends")
    });
    assert!(logged, "no wear warning in the log\n{}", daemon.stderr_log());
    std::thread::sleep(Duration::from_secs(6));
    let log = daemon.stderr_log();
    let count = log.matches("device would wear out before its warranty ends").count();
    assert_eq!(count, 1, "the warning must be rate-limited\n{log}");
}

#[test]
fn unknown_model_or_bad_catalog_stops_start_up_and_touches_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[[device]]\nid = \"x\"\n").expect("write");
    let cases: [(&str, Vec<String>, &str); 2] = [
        (
            "unknown model",
            vec!["--fast-device-model".into(), "optane-p5800x-40g".into()],
            "did you mean optane-p5800x-400g",
        ),
        (
            "broken catalog",
            vec!["--catalog".into(), broken.display().to_string()],
            "broken.toml",
        ),
    ];
    for (what, args, needle) in cases {
        let data = dir.path().join(what.replace(' ', "-"));
        let mut c = Command::new(STRATA_BIN);
        c.args(["serve", "--data-dir", data.to_str().expect("utf-8")])
            .args(["--nbd-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
            .args(&args);
        let out = run_timeout(&mut c, CMD_TIMEOUT);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: started\n{stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("strata: ") && last.contains(needle), "{what}: {stderr}");
        assert!(!data.exists(), "{what}: created {} before failing", data.display());
    }
}

fn size_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(STRATA_BIN);
    c.arg("size").args(args);
    c
}

const DESIGN: &[&str] = &[
    "--vms", "32", "--iops-per-vm", "1500", "--read-pct", "70", "--block-size", "32K",
    "--capacity-per-vm", "300G", "--protection", "raid1", "--hosts", "4",
    "--cache-device", "sas-800g-mu-3dwpd", "--cache-per-host", "1",
    "--capacity-device", "d5-p4320-7.68t", "--capacity-per-host", "2", "--peak-to-average", "2",
];

#[test]
fn size_prints_a_table_and_json() {
    let out = run_ok(&mut size_cmd(DESIGN), CMD_TIMEOUT);
    let table = String::from_utf8_lossy(&out.stdout);
    for needle in ["VM writes, average", "drive writes per day", "Checks at 4 hosts", "Smallest cluster meeting all:"] {
        assert!(table.contains(needle), "missing {needle:?}:\n{table}");
    }
    let mut json_args = vec!["--json"];
    json_args.extend_from_slice(DESIGN);
    let out = run_ok(&mut size_cmd(&json_args), CMD_TIMEOUT);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    // 32 x 1500 x 30% x 32 KiB = 450 MiB/s of VM writes, 900 at peak, twice that with RAID-1.
    let avg = v["evaluation"]["vm_write_bytes_per_s_avg"].as_f64().expect("avg");
    assert!((avg - 450.0 * 1_048_576.0).abs() < 1.0, "{avg}");
    let peak = v["evaluation"]["vm_write_bytes_per_s_peak"].as_f64().expect("peak");
    assert!((peak - 2.0 * avg).abs() < 1.0);
    let per_cache = v["evaluation"]["cache"]["write_bytes_per_s_avg"].as_f64().expect("cache");
    assert!((per_cache - avg * 2.0 / 4.0).abs() < 1.0);
    for key in ["performance_ok", "endurance_ok", "capacity_ok", "protection_ok"] {
        assert!(v["evaluation"]["checks"][key].is_boolean(), "{key}: {v:#}");
    }
    let hosts = v["smallest_cluster"]["hosts"].as_u64().expect("hosts");
    assert!(hosts >= 3, "{v:#}");
    assert!(v["smallest_cluster"]["binding"].as_array().is_some_and(|b| !b.is_empty()));
    let list = run_ok(&mut size_cmd(&["--list-devices"]), CMD_TIMEOUT);
    let list = String::from_utf8_lossy(&list.stdout);
    for id in ["optane-p5800x-400g", "optane-p4800x-375g", "optane-p4800x-750g", "d5-p4320-7.68t", "hdd-1.2t-10k-sas"] {
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
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        ("read share", with("--read-pct", "120"), "out of range"),
        ("protection", with("--protection", "ec=4"), "invalid protection"),
        ("block size", with("--block-size", "12Q"), "unknown unit"),
        ("hosts", with("--hosts", "0"), "--hosts"),
        ("unknown device", with("--cache-device", "sas-800"), "did you mean sas-800g-mu-3dwpd"),
        ("broken catalog", with_catalog, "bad.toml"),
        ("missing flag", vec!["--vms".into(), "3".into()], "required"),
    ];
    for (what, args, needle) in cases {
        let out = run_timeout(&mut size_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>()), CMD_TIMEOUT);
        assert_one_line_reason(what, &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{what}: {stderr}");
        assert!(out.stdout.is_empty(), "{what}: printed {:?}", String::from_utf8_lossy(&out.stdout));
    }
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

#[test]
fn size_from_metrics_uses_the_daemons_measured_write_rate() {
    let daemon = Daemon::start_default();
    qemu_io_ok(&daemon.nbd_uri(VOL0), &["write -P 0x22 0 16M"]);
    // The daemon's average is bytes since start over time since start: it only falls while
    // nothing is written, so the value `strata size` used lies between two readings around it.
    let before = status_write_rate(&daemon);
    let mut args = vec!["--json".to_string()];
    args.extend(measured_args(&daemon.http_url()));
    let out = run_ok(&mut size_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>()), CMD_TIMEOUT);
    let after = status_write_rate(&daemon);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let used = v["workload"]["vm_write_bytes_per_s_avg"].as_f64().expect("rate");
    assert!(before > 0.0 && after <= used && used <= before, "{after} <= {used} <= {before}");
    assert_eq!(v["workload"]["source"]["kind"], "measured", "{v:#}");
    assert_eq!(v["workload"]["source"]["url"], daemon.http_url());
    // IOPS follow from the rate: rate / (30% x 32 KiB).
    let iops = v["workload"]["iops_avg"].as_f64().expect("iops");
    assert!((iops - used / (0.3 * 32768.0)).abs() < 1e-6 * iops.max(1.0));
    // The table says where the rate came from.
    let out = run_ok(&mut size_cmd(&measured_args(&daemon.http_url()).iter().map(String::as_str).collect::<Vec<_>>()), CMD_TIMEOUT);
    assert!(String::from_utf8_lossy(&out.stdout).contains("MEASURED by the daemon at"));

    // An unreachable daemon, a server without the field, a URL that is not the API.
    let gone = TcpListener::bind("127.0.0.1:0").expect("bind");
    let gone_url = format!("http://{}", gone.local_addr().expect("addr"));
    drop(gone);
    let (no_field_url, server) = one_shot_http(r#"{"workload": {}}"#);
    let not_found = format!("{}/nope", daemon.http_url());
    for (what, url, needle) in [
        ("unreachable", gone_url.as_str(), "cannot reach the daemon: connection refused"),
        ("field missing", no_field_url.as_str(), "no numeric workload.write_bytes_per_s_avg"),
        ("not the API", not_found.as_str(), "HTTP 404"),
    ] {
        let out = run_timeout(&mut size_cmd(&measured_args(url).iter().map(String::as_str).collect::<Vec<_>>()), CMD_TIMEOUT);
        assert_one_line_reason(what, &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle) && stderr.contains("--from-metrics"), "{what}: {stderr}");
    }
    server.join().expect("server thread");
}
