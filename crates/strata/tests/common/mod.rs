//! Shared helpers for the end-to-end tests: a live `strata serve` in a fresh data directory,
//! external commands run with a timeout, and checks for the client tools.
//!
//! Every child process is killed when its owner is dropped (also while unwinding from a
//! failed assertion) and, as a second line of defence, when the thread that spawned it dies
//! (PR_SET_PDEATHSIG), so a test never leaves a daemon or a client behind.
#![allow(dead_code)]

pub mod nbd;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};

pub const STRATA_BIN: &str = env!("CARGO_BIN_EXE_strata");
pub const VOL0: &str = "vol0";
pub const VOL0_SIZE_BYTES: u64 = 8 << 30;
pub const MIB: u64 = 1 << 20;

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const TERMINATE_TIMEOUT: Duration = Duration::from_secs(30);
const CLI_TIMEOUT: Duration = Duration::from_secs(30);
/// Default bound for one client command (qemu-io, nbdinfo, ...) in these tests.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(60);

mod sys {
    use std::os::raw::{c_int, c_ulong};
    extern "C" {
        pub fn kill(pid: c_int, sig: c_int) -> c_int;
        pub fn prctl(option: c_int, arg2: c_ulong, ...) -> c_int;
        pub fn geteuid() -> u32;
    }
    pub const SIGKILL: c_int = 9;
    pub const SIGTERM: c_int = 15;
    pub const PR_SET_PDEATHSIG: c_int = 1;
}

/// Makes the kernel SIGKILL the child if the spawning thread dies before it, so even a test
/// process killed by the harness leaves nothing running. Spawn from the thread that owns
/// the child for its whole life.
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            sys::prctl(sys::PR_SET_PDEATHSIG, sys::SIGKILL as std::os::raw::c_ulong);
            Ok(())
        })
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { sys::geteuid() == 0 }
}

/// SIGKILL to every process in the group led by `pid` (spawned with process_group(0)).
pub fn kill_group(pid: u32) {
    // SAFETY: plain syscall; a negative pid addresses the process group.
    unsafe { sys::kill(-(pid as i32), sys::SIGKILL) };
}

pub fn send_signal(pid: u32, sig: i32) {
    // SAFETY: plain syscall on a pid we own.
    let rc = unsafe { sys::kill(pid as i32, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}) failed: {}", std::io::Error::last_os_error());
}

/// True when missing tools must fail the run rather than skip: in CI and under
/// ./scripts/test, which installs them first.
pub fn tools_are_mandatory() -> bool {
    std::env::var_os("CI").is_some() || std::env::var_os("STRATA_REQUIRE_TOOLS").is_some()
}

pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Returns false (after a loud message) when a tool is missing and the caller should skip;
/// panics instead in CI or under ./scripts/test.
pub fn require_tool(name: &str) -> bool {
    if find_tool(name).is_some() {
        return true;
    }
    let msg = format!(
        "required tool `{name}` is not installed; ./scripts/test installs it \
         (Debian packages qemu-utils libnbd-bin nbdfuse fio fuse3 e2fsprogs)"
    );
    if tools_are_mandatory() {
        panic!("{msg}");
    }
    eprintln!("\n!!!!!!!! SKIPPING TEST: {msg} !!!!!!!!\n");
    false
}

pub fn require_tools(names: &[&str]) -> bool {
    names.iter().all(|name| require_tool(name))
}

pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

pub fn output_report(cmd: &str, out: &Output) -> String {
    format!(
        "command: {cmd}\nstatus: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn drain<R: Read + Send + 'static>(reader: Option<R>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut r) = reader {
            let _ = r.read_to_end(&mut buf);
        }
        buf
    })
}

/// Runs `cmd` to completion with stdin closed, killing it and panicking (with its output)
/// if it takes longer than `timeout`.
pub fn run_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    run_with_stdin(cmd, None, timeout)
}

pub fn run_with_stdin(cmd: &mut Command, stdin: Option<Vec<u8>>, timeout: Duration) -> Output {
    let line = describe(cmd);
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    // Own process group, so a timeout kills helpers it forked too (fio runs jobs as processes).
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let mut child = die_with_parent(cmd).spawn().unwrap_or_else(|e| panic!("spawn `{line}`: {e}"));
    if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
        thread::spawn(move || {
            let _ = pipe.write_all(&data);
        });
    }
    let out_reader = drain(child.stdout.take());
    let err_reader = drain(child.stderr.take());
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            kill_group(child.id());
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(5));
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    match status {
        Some(status) => Output { status, stdout, stderr },
        None => panic!(
            "timed out after {timeout:?}: {line}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// Runs `cmd` and asserts it exits 0, printing its output otherwise.
pub fn run_ok(cmd: &mut Command, timeout: Duration) -> Output {
    let line = describe(cmd);
    let out = run_timeout(cmd, timeout);
    assert!(out.status.success(), "command failed\n{}", output_report(&line, &out));
    out
}

/// Runs `cmd` and asserts it exits non-zero.
pub fn run_fails(cmd: &mut Command, timeout: Duration) -> Output {
    let line = describe(cmd);
    let out = run_timeout(cmd, timeout);
    assert!(!out.status.success(), "command unexpectedly succeeded\n{}", output_report(&line, &out));
    out
}

pub fn cmd(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

/// `qemu-io -f raw -c CMD... URI` as a fresh client connection.
pub fn qemu_io_cmd(uri: &str, commands: &[&str]) -> Command {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for command in commands {
        c.args(["-c", command]);
    }
    c.arg(uri);
    c
}

pub fn qemu_io(uri: &str, commands: &[&str]) -> Output {
    run_timeout(&mut qemu_io_cmd(uri, commands), CMD_TIMEOUT)
}

/// Runs qemu-io and asserts every command succeeded: qemu-io exits 1 when a command fails,
/// including a `read -P` whose data does not match the pattern.
pub fn qemu_io_ok(uri: &str, commands: &[&str]) -> Output {
    let out = run_ok(&mut qemu_io_cmd(uri, commands), CMD_TIMEOUT);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("Pattern verification failed") && !stdout.contains("failed:"),
        "qemu-io reported a failure\n{}",
        output_report(&describe(&qemu_io_cmd(uri, commands)), &out)
    );
    out
}

/// A fresh client writes and reads back a pattern: the daemon is alive and serving.
pub fn assert_fresh_client_works(daemon: &Daemon) {
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(&uri, &["write -P 0xc3 7340032 4096", "read -P 0xc3 7340032 4096"]);
}

/// The seed of a randomized test: STRATA_TEST_SEED if set, else fresh; printed for replay.
pub fn test_seed(test: &str) -> u64 {
    let seed = match std::env::var("STRATA_TEST_SEED") {
        Ok(s) => s.parse().expect("STRATA_TEST_SEED must be a u64"),
        Err(_) => rand::random(),
    };
    eprintln!("{test}: seed = {seed} (replay with STRATA_TEST_SEED={seed})");
    seed
}

pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut buf = vec![0u8; len];
    rng.fill_bytes(&mut buf);
    buf
}

pub fn write_random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let data = random_bytes(len, seed);
    std::fs::write(path, &data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    data
}

/// Asserts two byte slices are equal, reporting the first differing offset instead of
/// dumping megabytes.
pub fn assert_same_bytes(what: &str, expected: &[u8], actual: &[u8]) {
    assert_eq!(expected.len(), actual.len(), "{what}: length differs");
    if let Some(pos) = expected.iter().zip(actual).position(|(a, b)| a != b) {
        let end = (pos + 16).min(expected.len());
        panic!(
            "{what}: first difference at byte {pos}: expected {:02x?}, got {:02x?}",
            &expected[pos..end],
            &actual[pos..end]
        );
    }
}

/// Asserts stderr is a single line `strata: <reason>`, the CLI's failure contract.
pub fn assert_one_line_reason(what: &str, out: &Output) {
    assert!(!out.status.success(), "{what}: expected failure, got {}", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        lines.len() == 1 && lines[0].starts_with("strata: ") && lines[0].len() > "strata: ".len(),
        "{what}: stderr must be exactly one line `strata: <reason>`, got:\n{stderr}"
    );
}

#[derive(Debug, Clone)]
pub struct DaemonOpts {
    pub fast_size: String,
    pub capacity_size: String,
    pub extra_args: Vec<String>,
}

impl Default for DaemonOpts {
    fn default() -> Self {
        DaemonOpts { fast_size: "256M".into(), capacity_size: "2G".into(), extra_args: Vec::new() }
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
    text.parse().unwrap_or_else(|e| panic!("cannot parse address {text:?} in line {line:?}: {e}"))
}

impl Daemon {
    pub fn start(opts: DaemonOpts) -> Daemon {
        let root = tempfile::Builder::new().prefix("strata-e2e-").tempdir().expect("tempdir");
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
            .args(["--nbd-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
            .args(&self.opts.extra_args)
            .current_dir(self.root.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let line = describe(&cmd);
        let mut child = die_with_parent(&mut cmd).spawn().unwrap_or_else(|e| panic!("spawn {line}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        self.child = Some(child);
        let announced = self.wait_ready(stdout);
        let log = self.stderr_log();
        let missing = |what: &str| -> ! { panic!("daemon said ready without announcing its {what} address\n{log}") };
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
        let mut announced = Announced { nbd_addr: None, http_addr: None, io_backend: String::new() };
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

    pub fn http_url(&self) -> String {
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
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("`strata {all:?}` printed invalid JSON ({e}):\n{stdout}"))
    }

    pub fn create_volume(&self, name: &str, size: &str) {
        self.cli_ok(&["volume", "create", name, "--size", size]);
    }

    /// SIGKILL, as a power cut would: nothing gets a chance to flush.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("daemon not running");
        send_signal(child.id(), sys::SIGKILL);
        let _ = child.wait();
    }

    /// SIGTERM and wait: the daemon must finish in-flight work and exit 0.
    pub fn terminate(&mut self) {
        let mut child = self.child.take().expect("daemon not running");
        send_signal(child.id(), sys::SIGTERM);
        let deadline = Instant::now() + TERMINATE_TIMEOUT;
        let status: ExitStatus = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("daemon did not exit within {TERMINATE_TIMEOUT:?} of SIGTERM\n{}", self.stderr_log());
            }
            thread::sleep(Duration::from_millis(10));
        };
        assert!(status.success(), "daemon exited with {status} after SIGTERM\n{}", self.stderr_log());
    }

    /// Starts the daemon again on the same data directory (after kill9 or terminate).
    pub fn restart(&mut self) {
        if self.child.is_some() {
            self.terminate();
        }
        self.spawn();
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
            eprintln!("daemon data dir: {}\nlast lines of the daemon's stderr:\n{}", self.data_dir().display(), tail.join("\n"));
        }
    }
}

/// A background child process killed (SIGKILL) and reaped on drop.
pub struct ChildGuard {
    pub child: Option<Child>,
    pub what: String,
}

impl ChildGuard {
    pub fn spawn(cmd: &mut Command) -> ChildGuard {
        let what = describe(cmd);
        let child = die_with_parent(cmd.process_group(0)).spawn().unwrap_or_else(|e| panic!("spawn `{what}`: {e}"));
        ChildGuard { child: Some(child), what }
    }

    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("child already reaped")
    }

    /// Waits up to `timeout` for the child to exit on its own.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child().try_wait().expect("try_wait") {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(child.id());
            let _ = child.wait();
        }
    }
}

/// Polls `cond` every 20 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}
