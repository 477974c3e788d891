//! Endurance end to end: the bytes a device received as the daemon counts them against what
//! the kernel counted on loop devices, and the device catalog and wear warning of a running
//! daemon. `strata size` has its own file, e2e_size.rs.
use crate::common;

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
            &mut cmd(
                "losetup",
                &["--find", "--show", file.to_str().expect("utf-8")],
            ),
            CMD_TIMEOUT,
        );
        let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(
            device.starts_with("/dev/loop"),
            "losetup printed {device:?}"
        );
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
            .map(|f| {
                f.parse()
                    .unwrap_or_else(|_| panic!("{path}: bad field {f:?}"))
            })
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
    let f =
        std::fs::File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
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
    let dir = tempfile::Builder::new()
        .prefix("strata-wear-")
        .tempdir()
        .expect("tempdir");
    // Declared before the daemon: on a panic the daemon is killed first, then the loops go.
    let fast = Loop::attach(&sparse_file(&dir.path().join("fast.img"), FAST_FILE_BYTES));
    let capacity = Loop::attach(&sparse_file(
        &dir.path().join("capacity.img"),
        CAPACITY_FILE_BYTES,
    ));
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
    assert!(
        daemon_fast >= WRITTEN_BYTES,
        "fast device got {daemon_fast} < {WRITTEN_BYTES}"
    );
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
    let dwpd = devices["devices"][0]["wear"]["drive_writes_per_day"]
        .as_f64()
        .expect("dwpd");
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

/// A daemon whose fast device is the catalog's `tiny-test` (from `TINY_CATALOG`, in the
/// returned directory), with `args` besides.
fn with_tiny_fast_device(args: &[&str]) -> (tempfile::TempDir, Daemon) {
    let catalog_dir = tempfile::tempdir().expect("tempdir");
    let catalog = catalog_dir.path().join("tiny.toml");
    std::fs::write(&catalog, TINY_CATALOG).expect("write catalog");
    let mut extra_args = vec![
        "--catalog".to_string(),
        catalog.display().to_string(),
        "--fast-device-model".into(),
        "tiny-test".into(),
    ];
    extra_args.extend(args.iter().map(|a| a.to_string()));
    let daemon = Daemon::start(DaemonOpts {
        extra_args,
        ..DaemonOpts::default()
    });
    (catalog_dir, daemon)
}

#[test]
fn a_device_wearing_out_early_is_logged_flagged_and_warned_about() {
    // Seconds of history are enough here (by default a day is needed).
    let (_catalog, daemon) = with_tiny_fast_device(&[
        "--capacity-device-model",
        "optane-p5800x-400g",
        "--wear-projection-after",
        "0",
    ]);
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
    assert!(
        warnings.contains("would wear out before its warranty"),
        "{node:#}"
    );
    let metrics = ureq::get(&format!("{}/metrics", daemon.http_url()))
        .call()
        .expect("GET /metrics")
        .into_string()
        .expect("metrics text");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("strata_device_wear_out_before_warranty{")
                && l.contains("tier=\"fast\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
    // The log says so once (not every check), within a couple of check intervals.
    let logged = wait_until(Duration::from_secs(20), || {
        daemon
            .stderr_log()
            .contains("device would wear out before its warranty ends")
    });
    assert!(
        logged,
        "no wear warning in the log\n{}",
        daemon.stderr_log()
    );
    std::thread::sleep(Duration::from_secs(6));
    let log = daemon.stderr_log();
    let count = log
        .matches("device would wear out before its warranty ends")
        .count();
    assert_eq!(count, 1, "the warning must be rate-limited\n{log}");
    // Files of 64 MiB and 2 GiB rated as drives of 1 GB and 400 GB: the start said their
    // wear figures are off.
    for mismatch in [
        "is 64 MiB, but its model tiny-test is a 953.7 MiB drive",
        "is 2 GiB, but its model optane-p5800x-400g is a 372.5 GiB drive",
    ] {
        assert!(log.contains(mismatch), "no {mismatch:?}\n{log}");
    }
}

/// `--wear-projection-after off` is never: the device that wears out within days above is not
/// projected nor warned about, and every view says the projection is off. (`off` was taken
/// as 0, at once: the device was warned about a second after its formatting writes.)
#[test]
fn a_projection_off_never_projects_nor_warns() {
    let (_catalog, daemon) = with_tiny_fast_device(&["--wear-projection-after", "off"]);
    qemu_io_ok(&daemon.nbd_uri(VOL0), &["write -P 0x11 0 4M"]);
    // A wear check (every 5 s) after the writes.
    std::thread::sleep(Duration::from_secs(6));

    let devices = get_json(&daemon, "/api/v1/devices");
    let fast = &devices["devices"][0]["wear"];
    assert_eq!(fast["model"], "tiny-test", "{devices:#}");
    assert!(
        fast["endurance_used_ratio"].as_f64() > Some(0.0),
        "{devices:#}"
    );
    assert!(fast["projected_wear_out_unix_s"].is_null(), "{devices:#}");
    assert_eq!(fast["wears_out_before_warranty"], false, "{devices:#}");
    assert!(fast["projection_after_s"].is_null(), "{devices:#}");
    let node = get_json(&daemon, "/api/v1/node");
    assert!(
        !node["warnings"].to_string().contains("wear out"),
        "{node:#}"
    );
    let status = daemon.cli_ok(&["status"]);
    let off = |l: &str| l.contains("fast.img") && l.contains("projection off");
    assert!(status.lines().any(off), "{status}");
    let metrics = ureq::get(&format!("{}/metrics", daemon.http_url()))
        .call()
        .expect("GET /metrics")
        .into_string()
        .expect("metrics text");
    let verdict = "strata_device_wear_out_before_warranty{";
    assert!(
        !metrics.lines().any(|l| l.starts_with(verdict)),
        "{metrics}"
    );
    let log = daemon.stderr_log();
    assert!(!log.contains("would wear out before its warranty"), "{log}");
}

#[test]
fn unknown_model_or_bad_catalog_stops_start_up_and_touches_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[[device]]\nid = \"x\"\n").expect("write");
    // An unknown model is a bad value, a usage error (exit 2); a bad catalog file, an error (1).
    let cases: [(&str, Vec<String>, &str, i32); 2] = [
        (
            "unknown model",
            vec!["--fast-device-model".into(), "optane-p5800x-40g".into()],
            "did you mean optane-p5800x-400g",
            2,
        ),
        (
            "broken catalog",
            vec!["--catalog".into(), broken.display().to_string()],
            "broken.toml",
            1,
        ),
    ];
    for (what, args, needle, code) in cases {
        let data = dir.path().join(what.replace(' ', "-"));
        let mut c = Command::new(STRATA_BIN);
        c.args(["serve", "--data-dir", data.to_str().expect("utf-8")])
            .args([
                "--nbd-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(&args);
        let out = run_timeout(&mut c, CMD_TIMEOUT);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{what}\n{stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("strata: ") && last.contains(needle),
            "{what}: {stderr}"
        );
        assert!(
            !data.exists(),
            "{what}: created {} before failing",
            data.display()
        );
    }
}
