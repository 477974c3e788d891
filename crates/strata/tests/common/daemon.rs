//! A live `strata serve` on a private data directory with kernel-chosen ports.
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::process::{
    describe, die_with_parent, output_report, run_timeout, send_signal, SIGKILL, SIGTERM,
};
use super::STRATA_BIN;

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const TERMINATE_TIMEOUT: Duration = Duration::from_secs(30);
const CLI_TIMEOUT: Duration = Duration::from_secs(30);
/// A SIGKILLed daemon that takes longer than this to exit is reported (see `kill9`).
const SLOW_EXIT: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct DaemonOpts {
    pub fast_size: String,
    pub capacity_size: String,
    pub extra_args: Vec<String>,
    /// Where the admin API listens (port 0: the kernel picks).
    pub http_listen: String,
    /// Where NBD listens (port 0: the kernel picks, a new port at each start).
    pub nbd_listen: String,
    /// Extra environment of the daemon (e.g. RUST_LOG).
    pub env: Vec<(String, String)>,
    /// The (soft, hard) limit of open files the daemon starts with, if not this process's.
    pub open_files_limit: Option<(u64, u64)>,
}

impl Default for DaemonOpts {
    fn default() -> Self {
        DaemonOpts {
            // A new fast-tier file is written with zeros before the first start (about a
            // second for 256 MiB here, several under a busy suite): small keeps starts quick.
            fast_size: "64M".into(),
            capacity_size: "2G".into(),
            extra_args: Vec::new(),
            http_listen: "127.0.0.1:0".into(),
            nbd_listen: "127.0.0.1:0".into(),
            env: Vec::new(),
            open_files_limit: None,
        }
    }
}

/// A live `strata serve` on a private data directory with kernel-chosen ports.
pub struct Daemon {
    child: Option<Child>,
    root: tempfile::TempDir,
    opts: DaemonOpts,
    starts: u32,
    pub nbd_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub io_backend: String,
}

struct Announced {
    nbd_addr: Option<SocketAddr>,
    http_addr: Option<SocketAddr>,
    io_backend: String,
}

fn after<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    let start = line.find(marker)? + marker.len();
    line[start..].split_whitespace().next()
}

fn parse_addr(line: &str, text: &str) -> SocketAddr {
    let text = text.trim_start_matches("http://").trim_end_matches('/');
    text.parse()
        .unwrap_or_else(|e| panic!("cannot parse address {text:?} in line {line:?}: {e}"))
}

impl Daemon {
    pub fn start(opts: DaemonOpts) -> Daemon {
        let root = tempfile::Builder::new()
            .prefix("strata-e2e-")
            .tempdir()
            .expect("tempdir");
        let unset: SocketAddr = "0.0.0.0:0".parse().expect("addr");
        let mut daemon = Daemon {
            child: None,
            root,
            opts,
            starts: 0,
            nbd_addr: unset,
            http_addr: unset,
            io_backend: String::new(),
        };
        daemon.spawn();
        daemon
    }

    pub fn start_default() -> Daemon {
        Daemon::start(DaemonOpts::default())
    }

    pub fn data_dir(&self) -> PathBuf {
        self.root.path().join("data")
    }

    /// A scratch directory that lives as long as the daemon, outside its data directory.
    pub fn scratch_dir(&self) -> PathBuf {
        let dir = self.root.path().join("scratch");
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    fn stderr_path(&self, start: u32) -> PathBuf {
        self.root.path().join(format!("daemon-{start}.stderr"))
    }

    pub fn stderr_log(&self) -> String {
        let mut log = String::new();
        for start in 1..=self.starts {
            let text = std::fs::read_to_string(self.stderr_path(start)).unwrap_or_default();
            log.push_str(&format!("--- daemon stderr, start #{start} ---\n{text}"));
        }
        log
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "daemon already running");
        self.starts += 1;
        let stderr = File::create(self.stderr_path(self.starts)).expect("stderr log");
        let mut cmd = Command::new(STRATA_BIN);
        cmd.arg("serve")
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--fast-size", &self.opts.fast_size])
            .args(["--capacity-size", &self.opts.capacity_size])
            .args(["--nbd-listen", &self.opts.nbd_listen])
            .args(["--http-listen", &self.opts.http_listen])
            .args(&self.opts.extra_args)
            .envs(self.opts.env.iter().map(|(k, v)| (k, v)))
            .current_dir(self.root.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        if let Some((soft, hard)) = self.opts.open_files_limit {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: setrlimit is async-signal-safe and reads only the copied `limit`.
            unsafe {
                cmd.pre_exec(move || match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                });
            }
        }
        let line = describe(&cmd);
        let mut child = die_with_parent(&mut cmd)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {line}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        self.child = Some(child);
        let announced = self.wait_ready(stdout);
        let log = self.stderr_log();
        let missing = |what: &str| -> ! {
            panic!("daemon said ready without announcing its {what} address\n{log}")
        };
        self.nbd_addr = announced.nbd_addr.unwrap_or_else(|| missing("NBD"));
        self.http_addr = announced.http_addr.unwrap_or_else(|| missing("HTTP"));
        self.io_backend = announced.io_backend;
    }

    /// Reads the announcement lines until `strata: ready`; afterwards a thread keeps draining
    /// stdout so the daemon never blocks on a full pipe.
    fn wait_ready(&mut self, stdout: std::process::ChildStdout) -> Announced {
        let (tx, rx) = mpsc::channel::<String>();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut announced = Announced {
            nbd_addr: None,
            http_addr: None,
            io_backend: String::new(),
        };
        let mut seen = Vec::new();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(line) => {
                    if let Some(v) = after(&line, "I/O backend ") {
                        announced.io_backend = v.to_string();
                    }
                    if let Some(v) = after(&line, "NBD listening on ") {
                        announced.nbd_addr = Some(parse_addr(&line, v));
                    }
                    if let Some(v) = after(&line, "HTTP API listening on ") {
                        announced.http_addr = Some(parse_addr(&line, v));
                    }
                    let ready = line.trim() == "strata: ready";
                    seen.push(line);
                    if ready {
                        return announced;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.kill_quietly();
                    panic!(
                        "daemon not ready after {READY_TIMEOUT:?}\nstdout so far:\n{}\n{}",
                        seen.join("\n"),
                        self.stderr_log()
                    );
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.as_mut().map(|c| c.wait());
                    self.child = None;
                    panic!(
                        "daemon exited before ready ({status:?})\nstdout:\n{}\n{}",
                        seen.join("\n"),
                        self.stderr_log()
                    );
                }
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon not running").id()
    }

    pub fn is_alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().expect("try_wait").is_none(),
            None => false,
        }
    }

    pub fn assert_alive(&mut self) {
        if !self.is_alive() {
            panic!("the daemon died\n{}", self.stderr_log());
        }
    }

    pub fn nbd_uri(&self, volume: &str) -> String {
        format!("nbd://{}/{}", self.nbd_addr, volume)
    }

    pub fn nbd_server_uri(&self) -> String {
        format!("nbd://{}", self.nbd_addr)
    }

    /// The admin API's URL; a wildcard listener is reached through loopback.
    pub fn http_url(&self) -> String {
        if self.http_addr.ip().is_unspecified() {
            return format!("http://127.0.0.1:{}", self.http_addr.port());
        }
        format!("http://{}", self.http_addr)
    }

    pub fn cli_cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(STRATA_BIN);
        c.args(["--server", &self.http_url()]).args(args);
        c
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        run_timeout(&mut self.cli_cmd(args), CLI_TIMEOUT)
    }

    /// Runs the CLI, asserts success and returns stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "CLI failed\n{}\n{}",
            output_report(&describe(&self.cli_cmd(args)), &out),
            self.stderr_log()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `strata --json ARGS`, asserted successful and parsed.
    pub fn cli_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let stdout = self.cli_ok(&all);
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("`strata {all:?}` printed invalid JSON ({e}):\n{stdout}"))
    }

    pub fn create_volume(&self, name: &str, size: &str) {
        self.cli_ok(&["volume", "create", name, "--size", size]);
    }

    /// SIGKILL, as a power cut would: nothing gets a chance to flush.
    ///
    /// The process is gone only once its threads have left the kernel: a thread in the middle
    /// of a device write or flush (or with io_uring requests in flight) finishes that first,
    /// and until then the daemon's sockets stay open, its clients connected and its listener
    /// accepting into the backlog. A slow exit is reported, since clients wait through it.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("daemon not running");
        let pid = child.id();
        let killed = Instant::now();
        send_signal(pid, SIGKILL);
        let _ = child.wait();
        let took = killed.elapsed();
        if took > SLOW_EXIT {
            eprintln!("daemon pid {pid} took {took:?} to exit after SIGKILL");
        }
    }

    /// SIGTERM and wait: the daemon must finish in-flight work and exit 0.
    pub fn terminate(&mut self) {
        self.signal(SIGTERM);
        let status = self.wait_exit();
        assert!(
            status.success(),
            "daemon exited with {status} after SIGTERM\n{}",
            self.stderr_log()
        );
    }

    /// Sends `sig` to the running daemon (it keeps running, as far as this handle knows, until
    /// [`Daemon::wait_exit`]).
    pub fn signal(&self, sig: i32) {
        let child = self.child.as_ref().expect("daemon not running");
        send_signal(child.id(), sig);
    }

    /// Waits for the daemon to exit (it was told to stop), killing it and panicking if it has
    /// not within the time a clean stop may take.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("daemon not running");
        let deadline = Instant::now() + TERMINATE_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "daemon did not exit within {TERMINATE_TIMEOUT:?} of being told to stop\n{}",
                    self.stderr_log()
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// The stderr of the daemon's current (or last) start.
    pub fn last_stderr(&self) -> String {
        std::fs::read_to_string(self.stderr_path(self.starts)).unwrap_or_default()
    }

    /// Starts the daemon again on the same data directory (after kill9 or terminate).
    pub fn restart(&mut self) {
        if self.child.is_some() {
            self.terminate();
        }
        self.spawn();
    }

    /// `restart` with `args` added to this start's command line only.
    pub fn restart_with(&mut self, args: &[&str]) {
        let kept = self.opts.extra_args.clone();
        self.opts.extra_args.extend(args.iter().map(|a| a.to_string()));
        self.restart();
        self.opts.extra_args = kept;
    }

    fn kill_quietly(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill_quietly();
        if thread::panicking() {
            let log = self.stderr_log();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            eprintln!(
                "daemon data dir: {}\nlast lines of the daemon's stderr:\n{}",
                self.data_dir().display(),
                tail.join("\n")
            );
        }
    }
}
