//! `strata serve` as a new user meets it: stopped by any of the usual signals, at any time
//! (during start-up too, and by `timeout`, which signals twice), and the connection limit
//! telling a client why it was turned away.
mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const CLEAN: &str = "shut down cleanly";
/// How long a daemon may take to print a log line it is about to print.
const LOG_TIMEOUT: Duration = Duration::from_secs(10);

/// The daemon's NBD connection stopped halfway through a WRITE's payload: shutdown waits up
/// to 5 s for the rest (docs/NBD.md, Shutdown), or until the connection closes.
fn hold_shutdown(daemon: &Daemon) -> nbd::Client {
    let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("NBD_OPT_GO");
    let header = nbd::request_bytes(0, nbd::CMD_WRITE, 1, 0, 65536);
    client.stream.write_all(&header).expect("send");
    client.stream.write_all(&[0x5a; 4096]).expect("send");
    client
}

fn wait_for_log(daemon: &Daemon, text: &str) {
    let seen = wait_until(LOG_TIMEOUT, || daemon.last_stderr().contains(text));
    assert!(seen, "no `{text}` in the log\n{}", daemon.stderr_log());
}

/// SIGHUP (the terminal that started the daemon closed) stops it as SIGTERM does.
#[test]
fn sighup_stops_the_daemon_cleanly() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(&uri, &["write -P 0x48 0 65536"]);
    daemon.signal(SIGHUP);
    let status = daemon.wait_exit();
    let log = daemon.stderr_log();
    assert!(status.success(), "exit {status} after SIGHUP\n{log}");
    assert!(log.contains(CLEAN), "{log}");
    daemon.restart();
    qemu_io_ok(&daemon.nbd_uri(VOL0), &["read -P 0x48 0 65536"]);
}

/// A second signal within a second of the first (GNU `timeout` signals the daemon and its
/// process group) is the same request, and the stop stays clean; one a second or more after
/// the first is a request to exit at once.
#[test]
fn only_a_signal_a_second_after_the_first_forces_an_exit() {
    let mut daemon = Daemon::start_default();

    let holder = hold_shutdown(&daemon);
    daemon.signal(SIGTERM);
    let first = Instant::now();
    wait_for_log(&daemon, "shutting down");
    daemon.signal(SIGTERM);
    let gap = first.elapsed();
    assert!(gap < Duration::from_secs(1), "the repeat took {gap:?}");
    // The held request keeps the daemon up until the holder goes: it must not exit before.
    let ignored = "signal ignored";
    wait_until(LOG_TIMEOUT, || {
        daemon.last_stderr().contains(ignored) || !daemon.is_alive()
    });
    assert!(
        daemon.is_alive() && daemon.last_stderr().contains(ignored),
        "the repeated SIGTERM was not ignored\n{}",
        daemon.stderr_log()
    );
    drop(holder);
    let status = daemon.wait_exit();
    let log = daemon.stderr_log();
    let repeated = "after a repeated SIGTERM";
    assert!(status.success(), "exit {status} {repeated}\n{log}");
    assert!(log.contains(CLEAN), "{log}");

    daemon.restart();
    let _holder = hold_shutdown(&daemon);
    daemon.signal(SIGTERM);
    let first = Instant::now();
    wait_for_log(&daemon, "shutting down");
    // Well past the repeat window and well before the held request's 5 s are up.
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(first.elapsed()));
    daemon.signal(SIGTERM);
    let status = daemon.wait_exit();
    let log = daemon.last_stderr();
    assert_eq!(status.code(), Some(130), "{log}");
    assert!(
        log.contains("SIGTERM during shutdown, exiting at once") && !log.contains(CLEAN),
        "{log}"
    );
}

/// Under `timeout --preserve-status`, whose expiry signals the daemon twice, the daemon
/// stops cleanly and exits 0.
#[test]
fn under_timeout_the_daemon_stops_cleanly() {
    if !require_tool("timeout") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let args = [
        "--preserve-status",
        "2",
        STRATA_BIN,
        "serve",
        "--data-dir",
        "data",
        "--fast-size",
        "64M",
        "--capacity-size",
        "256M",
        "--nbd-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    let mut c = cmd("timeout", &args);
    c.current_dir(dir.path());
    let out = run_timeout(&mut c, Duration::from_secs(60));
    let report = output_report(&describe(&c), &out);
    assert!(out.status.success(), "{report}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Start-up takes well under 2 s; should it not, the stop is as clean, but says so.
    let served = String::from_utf8_lossy(&out.stdout).contains("strata: ready");
    let before = "stopped before serving";
    let stopped = if served { CLEAN } else { before };
    assert!(stderr.contains(stopped), "{report}");
}

/// A signal while the fast-tier file is being written with zeros stops the creation: the
/// daemon exits 0 and leaves no file (nor the data directory it made) behind.
#[test]
fn a_signal_during_start_up_stops_it_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let stderr_path = dir.path().join("stderr");
    let mut c = Command::new(STRATA_BIN);
    c.args(["serve", "--data-dir", "data", "--fast-size", "2G"])
        .args(["--nbd-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).expect("stderr file"));
    let mut daemon = ChildGuard::spawn(&mut c);
    let creating = data.join("fast.img.creating");
    let started = wait_until(Duration::from_secs(30), || creating.exists());
    let log = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(started, "no {} appeared\n{}", creating.display(), log());
    send_signal(daemon.child().id(), SIGTERM);
    let status = daemon
        .wait_timeout(Duration::from_secs(30))
        .expect("the daemon exits");
    assert!(status.success(), "exit {status}\n{}", log());
    assert!(
        log().contains("the files this start created were removed"),
        "{}",
        log()
    );
    let left = std::fs::read_dir(&data).map(|d| d.count());
    assert!(!data.exists(), "left behind: {left:?}");
}

/// Over `--max-connections`, a client is told why instead of finding the connection closed.
#[test]
fn a_client_over_the_connection_limit_is_told_why() {
    if !require_tool("qemu-img") {
        return;
    }
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--max-connections".into(), "1".into()],
        ..DaemonOpts::default()
    });
    let uri = daemon.nbd_uri(VOL0);
    let holder = nbd::go(daemon.nbd_addr, VOL0).expect("the first client");
    let out = run_fails(&mut cmd("qemu-img", &["info", &uri]), CMD_TIMEOUT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("too many connections (limit 1); try again later"),
        "{stderr}"
    );
    drop(holder);
    let admitted = wait_until(Duration::from_secs(10), || {
        run_timeout(&mut cmd("qemu-img", &["info", &uri]), CMD_TIMEOUT)
            .status
            .success()
    });
    assert!(admitted, "not admitted once the first client left");
}
