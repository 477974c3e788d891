//! Shared helpers for the end-to-end tests: a live `strata serve` in a fresh data directory,
//! external commands run with a timeout, and checks for the client tools.
//!
//! Every child process is killed when its owner is dropped (also while unwinding from a
//! failed assertion) and, as a second line of defence, when the thread that spawned it dies
//! (PR_SET_PDEATHSIG), so a test never leaves a daemon or a client behind.
#![allow(dead_code, unused_imports)]

mod daemon;
pub mod http;
pub mod nbd;
mod process;
pub mod webdriver;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use rand::{RngCore, SeedableRng};

pub use daemon::{Daemon, DaemonOpts};
pub use process::*;

pub const STRATA_BIN: &str = env!("CARGO_BIN_EXE_strata");
pub const VOL0: &str = "vol0";
pub const VOL0_SIZE_BYTES: u64 = 8 << 30;
pub const MIB: u64 = 1 << 20;

/// Default bound for one client command (qemu-io, nbdinfo, ...) in these tests.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(60);

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
         (Debian packages qemu-utils libnbd-bin nbdfuse fio fuse3 e2fsprogs prometheus chromium chromium-driver systemd)"
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

/// One qemu-io process writing `len_bytes` at `offset` with `pattern`, as concurrent chunks
/// of sizes drawn from `chunk_sizes`, then flushing; with the number of chunks, which
/// [`acknowledged`] counts.
pub fn chunked_write(
    uri: &str,
    offset: u64,
    len_bytes: usize,
    chunk_sizes: &[usize],
    pattern: u8,
    rng: &mut impl rand::Rng,
) -> (Command, usize) {
    let mut commands = Vec::new();
    let mut done = 0;
    while done < len_bytes {
        let len = chunk_sizes[rng.gen_range(0..chunk_sizes.len())].min(len_bytes - done);
        commands.push(format!(
            "aio_write -P {pattern} {} {len}",
            offset + done as u64
        ));
        done += len;
    }
    let chunks = commands.len();
    commands.push("aio_flush".into());
    commands.push("flush".into());
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    (qemu_io_cmd(uri, &commands), chunks)
}

/// Whether qemu-io completed all `chunks` writes: it exits 0 even when an aio_write failed,
/// so the completions it printed are counted.
pub fn acknowledged(out: &Output, chunks: usize) -> bool {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let wrote = stdout.lines().filter(|l| l.starts_with("wrote ")).count();
    out.status.success() && wrote == chunks && !stdout.contains("failed")
}

/// The (offset, length) of every write qemu-io reported done (`wrote 4096/4096 bytes at
/// offset 8192`): each one the daemon replied to, so durable even when a later one failed.
pub fn wrote_ranges(out: &Output) -> Vec<(u64, usize)> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("wrote ")?;
            let (counts, offset) = rest.split_once(" bytes at offset ")?;
            let (done, _asked) = counts.split_once('/')?;
            Some((offset.trim().parse().ok()?, done.parse().ok()?))
        })
        .collect()
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
    qemu_io_ok(
        &uri,
        &["write -P 0xc3 7340032 4096", "read -P 0xc3 7340032 4096"],
    );
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
    assert!(
        !out.status.success(),
        "{what}: expected failure, got {}",
        out.status
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        lines.len() == 1 && lines[0].starts_with("strata: ") && lines[0].len() > "strata: ".len(),
        "{what}: stderr must be exactly one line `strata: <reason>`, got:\n{stderr}"
    );
}
