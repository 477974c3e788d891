//! A VM's disk across a restart of the daemon: qemu's NBD client with `reconnect-delay`
//! (here in `qemu-img bench`, writing at queue depth 16) keeps its requests while the daemon
//! is stopped (SIGTERM) and started again, then killed (SIGKILL) and started again, on the
//! same port. Every request must succeed (an error would reach the guest) and every block
//! written must read back: what was acknowledged survived, what was not was sent again.
use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::http::get_json;
use common::*;
use rand::Rng;

const VOLUME: &str = "vm";
const VOLUME_BYTES: u64 = 256 * MIB;
/// Each block of the volume is written once, so a lost write shows as zeros.
const REQUEST_BYTES: u64 = 16 * 1024;
const PATTERN: u8 = 0x6b;
/// Writes the daemon takes before it is stopped, after each start.
const WRITES_BEFORE_STOP: u64 = 1500;
/// How long the client's requests wait for the daemon to come back.
const RECONNECT_DELAY_S: u32 = 60;
const BENCH_TIMEOUT: Duration = Duration::from_secs(180);

/// A free loopback port outside the kernel's ephemeral range (below it, or above it), so
/// that no client connection made meanwhile (by this or another test) takes it as its own
/// port while the daemon is down between its two starts.
fn fixed_port() -> u16 {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .expect("ip_local_port_range");
    let bounds: Vec<u16> = range
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    let [low, high] = bounds[..] else {
        panic!("ip_local_port_range: {range:?}");
    };
    let candidates = if low > 11_024 {
        low - 10_000..low
    } else if high < 55_535 {
        high + 1..high + 10_001
    } else {
        panic!("ephemeral ports {low}-{high}: no room for a fixed port outside them");
    };
    let mut rng = rand::thread_rng();
    for _ in 0..100 {
        let port = rng.gen_range(candidates.clone());
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port found in {candidates:?}");
}

/// Writes the daemon has taken since it started.
fn writes(daemon: &Daemon) -> u64 {
    let status = get_json(&format!("{}/api/v1/status", daemon.http_url()));
    status["io"]["write_ops_total"]
        .as_u64()
        .unwrap_or_else(|| panic!("no io.write_ops_total in {status}"))
}

/// What the client printed, both streams.
fn output(log: &Path) -> String {
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    format!("{}{}", read(log), read(&log.with_extension("err")))
}

/// Waits until the daemon has taken `n` writes, while the client is still running.
fn wait_for_writes(daemon: &Daemon, bench: &mut ChildGuard, log: &Path, n: u64, what: &str) {
    let taken = wait_until(Duration::from_secs(60), || {
        if let Some(status) = bench.child().try_wait().expect("try_wait") {
            panic!("the client ended ({status}) before {what}\n{}", output(log));
        }
        writes(daemon) >= n
    });
    assert!(taken, "{what}: {} writes, want {n}", writes(daemon));
}

#[test]
fn a_client_with_reconnect_delay_rides_through_a_restart_and_a_crash() {
    if !require_tools(&["qemu-img", "qemu-io"]) {
        return;
    }
    let port = fixed_port();
    let mut daemon = Daemon::start(DaemonOpts {
        nbd_listen: format!("127.0.0.1:{port}"),
        extra_args: vec!["--default-volume-size".into(), "0".into()],
        ..DaemonOpts::default()
    });
    daemon.create_volume(VOLUME, &format!("{}M", VOLUME_BYTES / MIB));
    let log = daemon.scratch_dir().join("bench.log");
    let image = format!(
        "driver=raw,file.driver=nbd,file.host=127.0.0.1,file.port={port},\
         file.export={VOLUME},file.reconnect-delay={RECONNECT_DELAY_S}"
    );
    let count = (VOLUME_BYTES / REQUEST_BYTES).to_string();
    let size = REQUEST_BYTES.to_string();
    let pattern = format!("{PATTERN:#x}");
    let mut cmd = Command::new("qemu-img");
    cmd.args([
        "bench", "-w", "-d", "16", "-c", &count, "-s", &size, "-S", &size,
    ])
    .args(["--pattern", &pattern, "--image-opts", &image])
    .stdin(Stdio::null())
    .stdout(std::fs::File::create(&log).expect("bench log"))
    .stderr(std::fs::File::create(log.with_extension("err")).expect("bench log"));
    let mut bench = ChildGuard::spawn(&mut cmd);

    wait_for_writes(&daemon, &mut bench, &log, WRITES_BEFORE_STOP, "the stop");
    daemon.terminate();
    daemon.restart();
    wait_for_writes(&daemon, &mut bench, &log, WRITES_BEFORE_STOP, "the kill");
    daemon.kill9();
    daemon.restart();

    let status = bench.wait_timeout(BENCH_TIMEOUT);
    assert!(
        status.is_some_and(|s| s.success()),
        "qemu-img bench across a restart and a crash: {status:?}\n{}",
        output(&log)
    );
    assert!(
        writes(&daemon) > 0,
        "the client wrote nothing after the crash: the test ended too soon"
    );
    // Every block was written once, with the pattern: none may be missing.
    let read = format!("read -P {pattern} 0 {VOLUME_BYTES}");
    qemu_io_ok(&daemon.nbd_uri(VOLUME), &[&read]);
}
