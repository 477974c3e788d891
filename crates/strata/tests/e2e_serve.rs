//! `strata serve` as a new user meets it: stopped by any of the usual signals, at any time
//! (during start-up too, and by `timeout`, which signals twice), and the connection limit
//! telling a client why it was turned away.
use crate::common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const CLEAN: &str = "shut down cleanly";
/// How long a daemon may take to print a log line it is about to print.
const LOG_TIMEOUT: Duration = Duration::from_secs(10);

/// The daemon's NBD connection stopped halfway through a WRITE's payload: shutdown waits up
/// to 5 s for the rest (docs/NBD.md, Shutdown), or until the connection closes.
/// The daemon must run with `HOLD_LOG`: the wait ends when its reader has taken the WRITE's
/// header. A signal before that finds no request begun and closes the connection at once
/// (a CI run lost that race: the GO reply was out, the reader not yet started).
fn hold_shutdown(daemon: &Daemon) -> nbd::Client {
    let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("NBD_OPT_GO");
    let header = nbd::request_bytes(0, nbd::CMD_WRITE, 1, 0, 65536);
    client.stream.write_all(&header).expect("send");
    client.stream.write_all(&[0x5a; 4096]).expect("send");
    let taken = "request command=1 flags=0 cookie=1 offset=0 len=65536";
    wait_for_log(daemon, taken);
    client
}

/// The daemon's log filter for `hold_shutdown`: the NBD reader traces each request header.
fn holding_daemon() -> Daemon {
    let filter = "info,strata_nbd::server::transmission=trace";
    Daemon::start(DaemonOpts {
        env: vec![("RUST_LOG".into(), filter.into())],
        ..DaemonOpts::default()
    })
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

/// A log line the daemon cannot write (its stderr a pipe whose reader has gone, as when a log
/// collector or the terminal closes) is dropped: the daemon serves on and stops cleanly.
/// (tracing reported the failed write with eprintln!, which panicked on the same stderr: the
/// serving thread died with exit 101, and clients' writes failed.)
#[test]
fn a_closed_stderr_does_not_stop_the_daemon() {
    use std::io::BufRead;
    if !require_tool("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = Command::new(STRATA_BIN);
    c.args(["serve", "--data-dir", "data", "--fast-size", "64M"])
        .args(["--capacity-size", "256M"])
        .args(["--nbd-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0"])
        // A line for each request, so that each client's writes meet the closed pipe.
        .env("RUST_LOG", "debug")
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut daemon = ChildGuard::spawn(&mut c);
    let stdout = daemon.child().stdout.take().expect("stdout");
    let mut nbd = None;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.expect("a line of stdout");
        if let Some(addr) = line.strip_prefix("strata: NBD listening on ") {
            nbd = Some(addr.to_string());
        }
        if line == "strata: ready" {
            break;
        }
    }
    let uri = format!("nbd://{}/{VOL0}", nbd.expect("the NBD address"));
    drop(daemon.child().stderr.take());
    for k in 0..4u64 {
        let write = format!("write -P {} {}M 1M", 0x61 + k, k);
        qemu_io_ok(&uri, &[write.as_str()]);
    }
    qemu_io_ok(&uri, &["read -P 0x61 0 1M", "read -P 0x64 3M 1M"]);
    let alive = daemon.child().try_wait().expect("try_wait").is_none();
    assert!(alive, "the daemon exited with its stderr closed");
    send_signal(daemon.child().id(), SIGTERM);
    let status = daemon
        .wait_timeout(Duration::from_secs(30))
        .expect("the daemon exits");
    assert!(status.success(), "exit {status} with its stderr closed");
}

/// A second signal within a second of the first (GNU `timeout` signals the daemon and its
/// process group) is the same request, and the stop stays clean; one a second or more after
/// the first is a request to exit at once.
#[test]
fn only_a_signal_a_second_after_the_first_forces_an_exit() {
    let mut daemon = holding_daemon();

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

/// What the slowed starts below replay: 48 MiB written in three patterns, then SIGKILL.
const REPLAYED: [(&str, &str); 3] = [("0x31", "0"), ("0x32", "16M"), ("0x33", "32M")];

/// A daemon killed with 48 MiB of acknowledged writes in its log (the fill marks keep the
/// destager idle: 48 MiB is well under 80% of a 256 MiB fast tier's log, not of the harness's
/// usual 64 MiB), so that its next start replays them.
fn killed_with_a_log_to_replay() -> Daemon {
    let mut daemon = Daemon::start(DaemonOpts {
        fast_size: "256M".into(),
        extra_args: ["--fill-low", "0.8", "--fill-high", "0.9"]
            .map(String::from)
            .into(),
        ..DaemonOpts::default()
    });
    let uri = daemon.nbd_uri(VOL0);
    let writes: Vec<String> = REPLAYED
        .iter()
        .map(|(p, at)| format!("write -P {p} {at} 16M"))
        .collect();
    qemu_io_ok(&uri, &writes.iter().map(String::as_str).collect::<Vec<_>>());
    daemon.kill9();
    daemon
}

/// Every write of [`REPLAYED`] reads back.
fn assert_replayed_writes_read_back(daemon: &Daemon) {
    let reads: Vec<String> = REPLAYED
        .iter()
        .map(|(p, at)| format!("read -P {p} {at} 16M"))
        .collect();
    qemu_io_ok(
        &daemon.nbd_uri(VOL0),
        &reads.iter().map(String::as_str).collect::<Vec<_>>(),
    );
}

/// `strata serve` on the data directory of a killed daemon, its fast device read at 8 MB/s
/// (`--fast-emulate`) so that the replay of the log lasts seconds; returned once it logged
/// that it opens the disk group.
struct SlowStart {
    guard: ChildGuard,
    stdout: std::path::PathBuf,
    stderr: std::path::PathBuf,
    /// The admin API's URL, from the daemon's `starting` log line.
    url: String,
}

impl SlowStart {
    fn begin(daemon: &Daemon, name: &str) -> SlowStart {
        let dir = daemon.scratch_dir();
        let (stdout, stderr) = (
            dir.join(format!("{name}.stdout")),
            dir.join(format!("{name}.stderr")),
        );
        let mut c = Command::new(STRATA_BIN);
        c.args(["serve", "--data-dir"])
            .arg(daemon.data_dir())
            .args(["--fast-emulate", "bw=8MB"])
            .args([
                "--nbd-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .stdout(std::fs::File::create(&stdout).expect("stdout file"))
            .stderr(std::fs::File::create(&stderr).expect("stderr file"));
        let guard = ChildGuard::spawn(&mut c);
        let mut start = SlowStart {
            guard,
            stdout,
            stderr,
            url: String::new(),
        };
        let opening = wait_until(LOG_TIMEOUT, || {
            start.log().contains("opening the disk group")
        });
        assert!(
            opening,
            "the daemon did not begin to open its disk group\n{}",
            start.log()
        );
        let log = start.log();
        let addr = log
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http_addr="))
            .unwrap_or_else(|| panic!("no http_addr in the log\n{log}"));
        start.url = format!("http://{addr}");
        start
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits (up to `timeout`) until the admin port's `starting` phase is one `wanted` takes;
    /// returns it.
    fn wait_for_phase(&self, timeout: Duration, wanted: impl Fn(&str) -> bool) -> String {
        let mut phase = String::new();
        let seen = wait_until(timeout, || {
            let answer = common::http::get(&format!("{}/api/v1/status", self.url));
            phase = serde_json::from_str::<serde_json::Value>(&answer.body)
                .ok()
                .and_then(|v| v["starting"]["phase"].as_str().map(String::from))
                .unwrap_or_default();
            wanted(&phase)
        });
        assert!(seen, "last phase `{phase}`\n{}", self.log());
        phase
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn signal(&mut self, sig: i32) {
        send_signal(self.guard.child().id(), sig);
    }

    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let status = self.guard.wait_timeout(Duration::from_secs(60));
        status.unwrap_or_else(|| panic!("the daemon did not exit\n{}", self.log()))
    }
}

/// While the daemon replays its log, a command waits for it instead of hanging silently:
/// the admin port answers 503 with how far the start is, and after 2 s the command says once,
/// on stderr, what it waits for; stdout holds only the command's JSON.
#[test]
fn a_command_waits_for_a_starting_daemon_and_says_so() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = killed_with_a_log_to_replay();
    let mut start = SlowStart::begin(&daemon, "slow");
    let answer = common::http::get(&format!("{}/api/v1/volumes", start.url));
    assert_eq!(answer.status, 503, "{}", answer.body);
    let phase = answer.json()["starting"]["phase"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        phase.starts_with("opening its disk group"),
        "{}",
        answer.body
    );

    let began = Instant::now();
    let mut list = cmd(
        STRATA_BIN,
        &["--server", &start.url, "--json", "volume", "list"],
    );
    let out = run_timeout(&mut list, Duration::from_secs(120));
    let took = began.elapsed();
    let report = format!("{}\n{}", output_report(&describe(&list), &out), start.log());
    assert!(out.status.success(), "{report}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not the JSON alone ({e})\n{report}"));
    assert_eq!(json["volumes"][0]["name"], VOL0, "{report}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    let wanted = format!(
        "strata: waiting for the daemon at {}: it is starting (",
        start.url
    );
    assert!(
        lines.len() == 1
            && lines[0].starts_with(&wanted)
            && lines[0].contains("replaying its write log"),
        "one line naming the wait, got:\n{report}"
    );
    assert!(
        took >= Duration::from_secs(2),
        "the start took {took:?}: too short to show the wait"
    );
    assert!(start.stdout().contains("strata: ready"), "{report}");

    start.signal(SIGTERM);
    assert!(start.wait_exit().success(), "{}", start.log());
    daemon.restart();
    assert_replayed_writes_read_back(&daemon);
}

/// How soon after the signal a daemon stopped while its disk group opens must have exited:
/// the open stops before its next batch (one of at most 2 MiB, a quarter of a second at
/// 8 MB/s) or within 64 blocks of its probe past the log's end, with room for a loaded
/// machine. What the open has left at the signal lasts twice as long or more: the replay's
/// rest is held to it, the probe alone reads about 40 MiB (5 s).
const STOP_DURING_OPEN_BOUND: Duration = Duration::from_secs(2);

/// MiB of the log read, as a `starting` phase says it ("replaying its write log: 13.1 MiB
/// read, ..."); 0 when it does not.
fn log_read_mib(phase: &str) -> f64 {
    let read = phase
        .split_once("replaying its write log: ")
        .and_then(|(_, rest)| rest.split_once(" read"))
        .and_then(|(size, _)| size.split_once(' '));
    match read {
        Some((n, "KiB")) => n.parse::<f64>().unwrap_or(0.0) / 1024.0,
        Some((n, "MiB")) => n.parse().unwrap_or(0.0),
        _ => 0.0,
    }
}

/// SIGTERM while the disk group opens, its fast device slowed down so that the open lasts
/// about 12 s (the replay of 48 MiB of log, then the probe past its end): during the replay
/// (once, then twice at once, as `timeout` signals the process and its group) and during the
/// probe, the open stops and the daemon exits 0 within [`STOP_DURING_OPEN_BOUND`], without
/// serving. The open wrote nothing, so each start replays the whole log again, and the last
/// one serves every acknowledged write.
#[test]
fn a_signal_while_the_disk_group_opens_stops_it_at_once() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = killed_with_a_log_to_replay();
    for (name, signals) in [("term", 1), ("twice", 2), ("probe", 1)] {
        let mut start = SlowStart::begin(&daemon, name);
        let phase = match name {
            "probe" => start.wait_for_phase(Duration::from_secs(60), |p| {
                p.contains("looking past its end")
            }),
            _ => {
                let phase = start.wait_for_phase(LOG_TIMEOUT, |p| log_read_mib(p) > 0.0);
                // The replay left at the signal: 48 MiB of log, less what is read, at 8 MB/s.
                let left = (48.0 - log_read_mib(&phase)) * 1.048_576 / 8.0;
                let left = Duration::from_secs_f64(left);
                assert!(left >= 2 * STOP_DURING_OPEN_BOUND, "{phase}");
                phase
            }
        };
        let signalled = Instant::now();
        for _ in 0..signals {
            start.signal(SIGTERM);
        }
        let status = start.wait_exit();
        let took = signalled.elapsed();
        let log = start.log();
        assert!(status.success(), "exit {status}\n{log}");
        assert!(
            took < STOP_DURING_OPEN_BOUND,
            "exited {took:?} after the signal, at `{phase}`\n{log}"
        );
        assert!(
            log.contains("stopped during start-up: the disk group's open was stopped"),
            "{log}"
        );
        assert!(!log.contains("disk group open"), "the open ended\n{log}");
        assert!(
            !start.stdout().contains("strata: ready"),
            "it served\n{}",
            start.stdout()
        );
        eprintln!("{name}: exited {took:?} after the signal, at `{phase}`");
    }
    daemon.restart();
    assert_replayed_writes_read_back(&daemon);
    daemon.cli_ok(&["volume", "info", VOL0]);
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

/// The (soft, hard) limit of open files of process `pid`, from /proc.
fn open_files_limit(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("its limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a line for open files");
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[3].to_string(), words[4].to_string())
}

/// Started with the usual soft limit of open files (here 200) under a higher hard one, the
/// daemon raises the soft limit to the hard one: with the soft limit, its connection caps
/// (64 NBD, 256 admin) could take more descriptors than it had, and accepts then failed. With
/// a hard limit under what the caps need, it says so at start.
#[test]
fn the_daemon_raises_its_open_files_limit_and_says_when_it_cannot() {
    let hard: u64 = 4096;
    let daemon = Daemon::start(DaemonOpts {
        open_files_limit: Some((200, hard)),
        ..DaemonOpts::default()
    });
    let (soft, max) = open_files_limit(daemon.pid());
    assert_eq!((soft, max), (hard.to_string(), hard.to_string()));
    assert!(!daemon.stderr_log().contains("open files limit"));
    drop(daemon);

    let daemon = Daemon::start(DaemonOpts {
        open_files_limit: Some((200, 200)),
        ..DaemonOpts::default()
    });
    assert_eq!(open_files_limit(daemon.pid()), ("200".into(), "200".into()));
    let log = daemon.stderr_log();
    assert!(
        log.contains("open files limit") && log.contains("--max-connections"),
        "no word of the low limit:\n{log}"
    );
}

/// The datagrams a daemon sent to `sock` until one holds `until` (each as text), or panics
/// after 10 s.
fn notifications_until(sock: &std::os::unix::net::UnixDatagram, until: &str) -> Vec<String> {
    let deadline = Instant::now() + LOG_TIMEOUT;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !got.iter().any(|m: &String| m.lines().any(|l| l == until)) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no {until} within {LOG_TIMEOUT:?}: {got:?}"
        );
        sock.set_read_timeout(Some(left)).expect("timeout");
        match sock.recv(&mut buf) {
            Ok(n) => got.push(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(e) => panic!("no {until} within {LOG_TIMEOUT:?} ({e}): {got:?}"),
        }
    }
    got
}

/// Started by a service manager with `Type=notify` (systemd sets NOTIFY_SOCKET), the daemon
/// says its start-up phase and pushes the start timeout back while it starts, READY=1 once
/// it serves, and STOPPING=1 when told to stop. With a watchdog (`WatchdogSec=`: systemd sets
/// WATCHDOG_USEC), it says WATCHDOG=1 while it serves, every half period, and not before
/// READY=1 (systemd arms the watchdog then).
#[test]
fn a_service_manager_is_told_the_start_ready_and_stopping() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notify");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
    let path = path.to_str().expect("utf-8").to_string();
    let mut daemon = Daemon::start(DaemonOpts {
        env: vec![
            ("NOTIFY_SOCKET".into(), path),
            ("WATCHDOG_USEC".into(), "200000".into()),
        ],
        ..Default::default()
    });
    let got = notifications_until(&sock, "READY=1");
    let first = got.first().expect("a message");
    assert!(
        first.contains("STATUS=starting: ") && first.contains("EXTEND_TIMEOUT_USEC=30000000"),
        "{got:?}"
    );
    let ready = got.last().expect("READY=1");
    let serving = format!("STATUS=serving 1 volume(s): NBD on {}", daemon.nbd_addr);
    assert!(ready.contains(&serving), "{ready:?}");
    assert!(
        !got.iter().any(|m| m.lines().any(|l| l == "WATCHDOG=1")),
        "a watchdog ping before READY=1: {got:?}"
    );
    // Pings go on (each waits for `notifications_until`'s 10 s at most).
    for _ in 0..4 {
        notifications_until(&sock, "WATCHDOG=1");
    }
    daemon.terminate();
    let got = notifications_until(&sock, "STOPPING=1");
    let stopping = got.last().expect("STOPPING=1");
    assert!(stopping.contains("STATUS=stopping"), "{got:?}");
}

/// The unit file in contrib/ is one systemd takes: `systemd-analyze verify` finds nothing
/// wrong in it, run with the binary under test in its `ExecStart`.
#[test]
fn the_systemd_unit_file_verifies() {
    if !require_tool("systemd-analyze") {
        return;
    }
    let unit = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/systemd/strata.service"
    );
    let text = std::fs::read_to_string(unit).expect("the unit file");
    let exec = "ExecStart=/usr/local/bin/strata ";
    assert!(text.contains(exec), "no `{exec}` in {unit}");
    let dir = tempfile::tempdir().expect("tempdir");
    let copy = dir.path().join("strata.service");
    let bin = std::fs::canonicalize(STRATA_BIN).expect("the binary under test");
    let here = format!("ExecStart={} ", bin.display());
    std::fs::write(&copy, text.replace(exec, &here)).expect("write the copy");
    let out = run_timeout(
        Command::new("systemd-analyze").arg("verify").arg(&copy),
        Duration::from_secs(60),
    );
    let report = output_report("systemd-analyze verify", &out);
    assert!(out.status.success() && out.stderr.is_empty(), "{report}");
}
