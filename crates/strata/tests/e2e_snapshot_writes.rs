//! Snapshots taken while a writer keeps running hold exactly the writes completed before them,
//! across both tiers and across a SIGKILL of the daemon right after the snapshot returned.
//!
//! How the expected image is known exactly: the writer is one qemu-io process fed one command
//! at a time on its stdin, so it has at most one write in flight (queue depth 1), and its prompt
//! coming back means the previous write was acknowledged. Write `i` fills slot `i % SLOTS` of
//! the volume with the byte `pattern(i)`, so the image after the first `k` writes, `image(k)`,
//! is known for every `k`, and every write changes it (a slot's pattern changes from one round
//! to the next), so `image(k) != image(k')` for `k != k'`.
//!
//! Let `c0` be the count of acknowledged writes read just before the snapshot request is sent,
//! and `c1` the count read just after its answer arrived. Writes `0..c0` completed before the
//! snapshot was asked for, so it holds them: `k >= c0`. When `c1` was read, write `c1` at most
//! was in flight; the engine waits for writes in flight before freezing the image, so write
//! `c1` may be in it, but write `c1 + 1` was not even sent before the snapshot returned (the
//! writer records `c1 + 1` before sending it). So the snapshot equals `image(k)` for exactly
//! one `k` in `c0..=c1 + 1`: one of the images of the last completed write or one after it.
use crate::common;

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::http::request;
use common::*;
use serde_json::{json, Value};

const SLOT_BYTES: usize = 256 << 10;
const SLOTS: usize = 64;
const VOLUME_BYTES: usize = SLOT_BYTES * SLOTS;
const PROMPT: &[u8] = b"qemu-io> ";
/// Largest output of one qemu-io command we accept (a write prints two short lines).
const MAX_REPLY_BYTES: usize = 64 << 10;
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(60);

fn pattern(i: u64) -> u8 {
    ((i / SLOTS as u64) % 255 + 1) as u8
}

/// The volume after the first `k` writes.
fn image(k: u64) -> Vec<u8> {
    let mut img = vec![0u8; VOLUME_BYTES];
    for slot in 0..SLOTS as u64 {
        if k <= slot {
            continue;
        }
        let last = slot + (k - 1 - slot) / SLOTS as u64 * SLOTS as u64;
        let at = slot as usize * SLOT_BYTES;
        img[at..at + SLOT_BYTES].fill(pattern(last));
    }
    img
}

/// qemu-io as a queue-depth-1 writer of the sequence above.
struct Writer {
    completed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<u64, String>>>,
}

impl Writer {
    fn start(uri: String) -> Writer {
        let completed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (completed.clone(), stop.clone());
        // The thread owns the child for its whole life (PR_SET_PDEATHSIG is per thread).
        let thread = thread::spawn(move || write_loop(&uri, &c, &s));
        Writer {
            completed,
            stop,
            thread: Some(thread),
        }
    }

    fn completed(&self) -> u64 {
        self.completed.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until at least `n` writes were acknowledged.
    fn wait_for(&self, n: u64) {
        let ok = wait_until(PROGRESS_TIMEOUT, || {
            self.completed() >= n || self.is_finished()
        });
        assert!(
            ok && self.completed() >= n,
            "the writer reached {} of {n} writes",
            self.completed()
        );
    }

    fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops after the write in flight; returns the count of acknowledged writes, or the
    /// writer's failure.
    fn finish(mut self) -> Result<u64, String> {
        self.stop.store(true, Ordering::SeqCst);
        let thread = self.thread.take().expect("writer joined twice");
        thread
            .join()
            .unwrap_or_else(|_| Err("the writer thread panicked".into()))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads qemu-io's answer up to its next prompt; None at EOF.
fn until_prompt(out: &mut ChildStdout) -> Option<String> {
    let mut acc = Vec::new();
    let mut buf = [0u8; 4096];
    while !acc.ends_with(PROMPT) {
        let n = out.read(&mut buf).ok().filter(|n| *n > 0)?;
        acc.extend_from_slice(&buf[..n]);
        assert!(
            acc.len() <= MAX_REPLY_BYTES,
            "qemu-io said too much: {}",
            String::from_utf8_lossy(&acc)
        );
    }
    Some(String::from_utf8_lossy(&acc[..acc.len() - PROMPT.len()]).into_owned())
}

fn write_loop(uri: &str, completed: &AtomicU64, stop: &AtomicBool) -> Result<u64, String> {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", uri])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child: Child = die_with_parent(&mut cmd)
        .spawn()
        .map_err(|e| format!("spawn qemu-io: {e}"))?;
    let (mut stdin, mut stdout): (ChildStdin, ChildStdout) = (
        child.stdin.take().expect("stdin"),
        child.stdout.take().expect("stdout"),
    );
    let result = (|| {
        until_prompt(&mut stdout).ok_or("qemu-io exited before its first prompt")?;
        let mut i = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let offset = (i as usize % SLOTS) * SLOT_BYTES;
            let line = format!("write -P {} {offset} {SLOT_BYTES}\n", pattern(i));
            stdin
                .write_all(line.as_bytes())
                .map_err(|e| format!("write {i}: {e}"))?;
            let answer =
                until_prompt(&mut stdout).ok_or(format!("qemu-io exited during write {i}"))?;
            if !answer.starts_with(&format!(
                "wrote {SLOT_BYTES}/{SLOT_BYTES} bytes at offset {offset}"
            )) {
                return Err(format!("write {i} failed: {answer}"));
            }
            i += 1;
            completed.store(i, Ordering::SeqCst);
        }
        Ok(i)
    })();
    let _ = stdin.write_all(b"quit\n");
    drop(stdin);
    if child.wait_timeout_ok().is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    result
}

trait WaitTimeout {
    fn wait_timeout_ok(&mut self) -> Option<()>;
}

impl WaitTimeout for Child {
    fn wait_timeout_ok(&mut self) -> Option<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.try_wait() {
                return Some(());
            }
            thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

/// A snapshot taken under the writer, with the acknowledged counts around its request.
struct Taken {
    name: String,
    c0: u64,
    c1: u64,
    /// The snapshot as the API showed it right after it was taken (with its space per tier).
    shown: Value,
}

fn take_snapshot(daemon: &Daemon, writer: &Writer, volume: &str, name: &str) -> Taken {
    let url = format!("{}/api/v1/volumes/{volume}/snapshots", daemon.http_url());
    let c0 = writer.completed();
    let reply = request("POST", &url, Some(&json!({ "name": name })), None);
    let c1 = writer.completed();
    assert_eq!(reply.status, 201, "snapshot {name}: {}", reply.body);
    assert!(c1 >= c0);
    let shown = common::http::get_json(&format!("{url}/{name}"));
    Taken {
        name: name.into(),
        c0,
        c1,
        shown,
    }
}

/// `qemu-img compare` of `export` against `image(k)` for each `k` in `candidates`: exactly
/// one must be identical (exit 0) and every other must differ (exit 1). Returns that `k`.
fn matching_image(daemon: &Daemon, export: &str, candidates: std::ops::RangeInclusive<u64>) -> u64 {
    let reference = daemon
        .scratch_dir()
        .join(format!("{}.raw", export.replace('@', "_")));
    let mut matches = Vec::new();
    for k in candidates.clone() {
        std::fs::write(&reference, image(k)).expect("write the reference image");
        let mut compare = cmd(
            "qemu-img",
            &[
                "compare",
                "-f",
                "raw",
                "-F",
                "raw",
                reference.to_str().expect("utf-8"),
                &daemon.nbd_uri(export),
            ],
        );
        let out = run_timeout(&mut compare, CMD_TIMEOUT);
        match out.status.code() {
            Some(0) => matches.push(k),
            Some(1) => {}
            _ => panic!(
                "qemu-img compare failed\n{}",
                output_report(&describe(&compare), &out)
            ),
        }
    }
    assert_eq!(
        matches.len(),
        1,
        "{export} must equal the image after exactly one of writes {candidates:?}; it matches {matches:?}"
    );
    matches[0]
}

fn space_bytes(snapshot: &Value, tier: &str) -> u64 {
    let s = &snapshot["space"];
    s[format!("exclusive_{tier}_bytes")]
        .as_u64()
        .expect("space")
        + s[format!("shared_{tier}_bytes")].as_u64().expect("space")
}

/// A 64 MiB fast tier whose high mark (20%, ~12 MiB of log) is below the 16 MiB volume the
/// writer goes round: the destager cannot keep that hot set in the log, so the oldest data
/// moves to the capacity tier while the newest is in the log, and a snapshot's data lies on
/// both tiers. (With the default marks the whole volume stayed hot in the log on some runs,
/// and no snapshot had data on the capacity tier.)
fn small_fast_tier() -> Daemon {
    Daemon::start(DaemonOpts {
        fast_size: "64M".into(),
        capacity_size: "1G".into(),
        extra_args: ["--fill-low", "0.05", "--fill-high", "0.2"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    })
}

#[test]
fn snapshots_under_a_running_writer_hold_exactly_the_completed_writes() {
    if !require_tools(&["qemu-io", "qemu-img"]) {
        return;
    }
    let daemon = small_fast_tier();
    daemon.create_volume("live", "16M");
    let writer = Writer::start(daemon.nbd_uri("live"));
    let mut taken = Vec::new();
    for (n, name) in ["s1", "s2", "s3"].into_iter().enumerate() {
        // Two rounds over the volume (32 MiB written) between snapshots.
        writer.wait_for((n as u64 + 1) * 2 * SLOTS as u64);
        taken.push(take_snapshot(&daemon, &writer, "live", name));
    }
    // Checked while the writer keeps writing to the volume.
    for t in &taken {
        let k = matching_image(&daemon, &format!("live@{}", t.name), t.c0..=t.c1 + 1);
        eprintln!(
            "live@{}: image after {k} writes (acknowledged before: {}, after: {})",
            t.name, t.c0, t.c1
        );
    }
    let on_both = taken
        .iter()
        .any(|t| space_bytes(&t.shown, "fast") > 0 && space_bytes(&t.shown, "capacity") > 0);
    let figures: Vec<&Value> = taken.iter().map(|t| &t.shown["space"]).collect();
    eprintln!("space per snapshot when taken: {figures:?}");
    assert!(
        on_both,
        "no snapshot held data on both tiers when taken: {figures:?}"
    );
    let written = writer.finish().expect("the writer failed");
    assert!(
        written > taken[2].c1,
        "the writer kept running after the last snapshot"
    );
    matching_image(&daemon, "live", written..=written);
}

#[test]
fn a_snapshot_survives_a_sigkill_right_after_it_returned() {
    if !require_tools(&["qemu-io", "qemu-img"]) {
        return;
    }
    let mut daemon = small_fast_tier();
    daemon.create_volume("live", "16M");
    let writer = Writer::start(daemon.nbd_uri("live"));
    writer.wait_for(3 * SLOTS as u64);
    let t = take_snapshot(&daemon, &writer, "live", "crash");
    daemon.kill9();
    // Writes after the kill fail; acknowledged ones must all survive it. (Replies the daemon
    // sent before it died may still be read after the kill: count once the writer stopped.)
    let counter = writer.completed.clone();
    let outcome = writer.finish();
    let acknowledged = counter.load(Ordering::SeqCst);
    assert!(
        outcome.is_err(),
        "the writer did not notice the daemon died: {outcome:?}"
    );
    daemon.restart();

    let listed = daemon.cli_json(&["snapshot", "list", "live"]);
    assert_eq!(
        listed["snapshots"][0]["export_name"], "live@crash",
        "{listed:#}"
    );
    let k = matching_image(&daemon, "live@crash", t.c0..=t.c1 + 1);
    eprintln!(
        "live@crash: image after {k} writes (acknowledged before: {}, after: {})",
        t.c0, t.c1
    );
    // The volume holds every acknowledged write, and at most the one in flight besides.
    matching_image(&daemon, "live", acknowledged..=acknowledged + 1);
}
