//! Volume lifecycle under live I/O: a seeded random run against a live `strata serve`.
//!
//! Client threads each hold an NBD connection to one volume at a time, with simple or
//! structured replies, and keep several writes, write-zeroes (plain, NO_HOLE, FAST_ZERO),
//! trims, reads, BLOCK_STATUS queries and flushes in flight, of whole blocks, 512-byte
//! sectors or any bytes (partial blocks are read, patched and written again by the daemon);
//! every reply is checked against the connection's model of the volume: a read's bytes, a
//! trimmed or zeroed range reading as zeros, BLOCK_STATUS never calling data zero and
//! calling a block stored as a hole HOLE|ZERO, FAST_ZERO over no whole block refused with
//! ENOTSUP and changing nothing. Meanwhile the driver (the test's own thread), through
//! the admin API and the `strata` CLI at random, creates volumes (names are reused after a
//! delete), grows volumes clients are connected to, takes and deletes snapshots, clones
//! them, rolls volumes back, deletes them with and without force, and changes policies.
//!
//! Every block written carries its volume, write and block number, so a read shows where
//! its data came from; a block several writes left parts of is modelled as their byte
//! ranges (lifecycle/content.rs). The model records when each write was sent and
//! acknowledged on one clock with the admin calls, so a snapshot taken under writes is
//! checked for what it may hold: every write acknowledged before the request, nothing sent
//! after the reply, either for writes in between; what it does hold is then its model for
//! good. After a forced delete or rollback, a request sent after the reply must fail with
//! ESHUTDOWN. At the end every volume and snapshot is read whole, then again after a clean
//! restart, then after a SIGKILL that follows a replied FLUSH of writes, trims and zeroes
//! of any byte range.
//!
//! Replay a run with STRATA_TEST_SEED=<seed printed by the test>.
use crate::common;
use crate::lifecycle;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use common::*;
use lifecycle::client::{client_loop, write_payload, MAX_WRITE_BLOCKS};
use lifecycle::*;

/// How long the driver changes volumes under the clients.
const CHAOS_DURATION: Duration = Duration::from_secs(16);
const CLIENT_THREADS: usize = 3;
/// Names of the volumes the driver creates, reused after a delete.
const VOLUME_NAMES: [&str; 6] = ["lv0", "lv1", "lv2", "lv3", "lv4", "lv5"];
const MAX_LIVE_VOLUMES: usize = 7;
const MAX_SNAPSHOTS_PER_VOLUME: usize = 3;
const MAX_VOLUME_BYTES: u64 = 48 * MIB;
/// A handle closed by its client leaves the daemon's count within this.
const HANDLE_CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// The driver: admin changes through the API and the CLI

/// One admin call, as the CLI's arguments and as the API's request.
struct Call {
    cli: Vec<String>,
    method: &'static str,
    path: String,
    body: Option<Value>,
}

fn call(cli: &[&str], method: &'static str, path: String, body: Option<Value>) -> Call {
    Call {
        cli: cli.iter().map(|s| s.to_string()).collect(),
        method,
        path,
        body,
    }
}

struct Driver<'a> {
    world: &'a Shared,
    rng: SmallRng,
    nbd_addr: SocketAddr,
    http_url: String,
    next_snapshot: u64,
    next_clone: u64,
    done: HashMap<&'static str, u32>,
}

/// Sets the stop flag when dropped, also while a failed assertion unwinds, so the client
/// threads end and the scope that runs them can return.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl<'a> Driver<'a> {
    fn new(daemon: &Daemon, world: &'a Shared, seed: u64) -> Driver<'a> {
        Driver {
            world,
            rng: SmallRng::seed_from_u64(seed),
            nbd_addr: daemon.nbd_addr,
            http_url: daemon.http_url(),
            next_snapshot: 0,
            next_clone: 0,
            done: HashMap::new(),
        }
    }

    /// After a restart the daemon listens on new ports.
    fn retarget(&mut self, daemon: &Daemon) {
        self.nbd_addr = daemon.nbd_addr;
        self.http_url = daemon.http_url();
    }

    fn lock(&self) -> std::sync::MutexGuard<'a, World> {
        self.world.lock().expect("model")
    }

    /// Runs `c` through the CLI or the API at random; asserts it succeeded, or (`ok` false)
    /// that it was refused: a 409, or the CLI's one-line reason.
    fn run(&mut self, c: &Call, ok: bool) {
        if self.rng.gen_bool(0.5) {
            let mut cmd = std::process::Command::new(STRATA_BIN);
            cmd.args(["--server", &self.http_url]).args(&c.cli);
            let out = run_timeout(&mut cmd, CMD_TIMEOUT);
            if ok {
                assert!(
                    out.status.success(),
                    "{}",
                    output_report(&describe(&cmd), &out)
                );
            } else {
                assert_one_line_reason(&describe(&cmd), &out);
            }
            return;
        }
        let url = format!("{}{}", self.http_url, c.path);
        let reply = http::request(c.method, &url, c.body.as_ref(), None);
        let want = if ok { "a 2xx" } else { "409" };
        let good = if ok {
            (200..300).contains(&reply.status)
        } else {
            reply.status == 409
        };
        assert!(
            good,
            "{} {url}: expected {want}, got {}: {}",
            c.method, reply.status, reply.body
        );
    }

    fn count(&mut self, what: &'static str) {
        *self.done.entry(what).or_default() += 1;
    }

    /// Waits until the daemon counts no open handle on a volume (`path` its API path).
    fn wait_no_handles(&self, path: &str) {
        let url = format!("{}{path}", self.http_url);
        let closed = wait_until(HANDLE_CLOSE_TIMEOUT, || {
            http::get_json(&url)["connections"] == 0
        });
        assert!(
            closed,
            "{path}: handles still open {HANDLE_CLOSE_TIMEOUT:?} after their clients left"
        );
    }

    /// Marks a volume busy (no new client connections) and waits for one being opened.
    fn begin_change(&self, uid: u64) {
        vol_mut(&mut self.lock(), uid).busy = true;
        let opened = wait_until(HANDLE_CLOSE_TIMEOUT, || !self.lock().vols[&uid].connecting);
        assert!(opened, "a client is still opening volume #{uid}");
    }

    fn end_change(&self, uid: u64) {
        vol_mut(&mut self.lock(), uid).busy = false;
    }

    /// A live volume no one is changing; those clients hold are picked more often.
    fn pick_volume(&mut self, with_snapshot: bool) -> Option<u64> {
        let w = self.lock();
        let fits =
            |v: &&Vol| !v.dead && !v.busy && (!with_snapshot || v.snaps.iter().any(|s| s.alive));
        let all: Vec<u64> = w.vols.values().filter(fits).map(|v| v.uid).collect();
        let held: Vec<u64> = w
            .vols
            .values()
            .filter(fits)
            .filter(|v| v.claimed)
            .map(|v| v.uid)
            .collect();
        drop(w);
        let from = if !held.is_empty() && self.rng.gen_bool(0.7) {
            held
        } else {
            all
        };
        (!from.is_empty()).then(|| from[self.rng.gen_range(0..from.len())])
    }

    fn pick_snapshot(&mut self, uid: u64) -> (String, String, u64, Vec<u64>) {
        let w = self.lock();
        let v = &w.vols[&uid];
        let alive: Vec<&Snap> = v.snaps.iter().filter(|s| s.alive).collect();
        let s = alive[self.rng.gen_range(0..alive.len())];
        (
            v.name.clone(),
            s.name.clone(),
            s.size_bytes,
            s.tokens.clone(),
        )
    }

    fn live_count(&self) -> usize {
        self.lock().vols.values().filter(|v| !v.dead).count()
    }

    /// Creates a volume (the name may be one deleted before): a new connection reads zeros.
    fn create(&mut self, name: &str) {
        let size_bytes = self.rng.gen_range(2..=6) * 4 * MIB;
        let uid = self.lock().new_vol(name, size_bytes, Vec::new());
        let size = size_bytes.to_string();
        let c = call(
            &["volume", "create", name, "--size", &size],
            "POST",
            "/api/v1/volumes".into(),
            Some(json!({"name": name, "size_bytes": size_bytes})),
        );
        self.run(&c, true);
        let zeros = vec![0; (size_bytes / BLOCK_BYTES) as usize];
        assert_view(
            self.nbd_addr,
            name,
            size_bytes,
            &zeros,
            "a volume just created",
        );
        self.end_change(uid);
        self.count("create");
    }

    fn create_some(&mut self) {
        let free: Vec<&str> = VOLUME_NAMES
            .iter()
            .copied()
            .filter(|n| self.lock().live(n).is_none())
            .collect();
        if free.is_empty() || self.live_count() >= MAX_LIVE_VOLUMES {
            return;
        }
        let name = free[self.rng.gen_range(0..free.len())];
        self.create(name);
    }
}

impl Driver<'_> {
    /// Grows a volume, most often one a client is connected to: that client keeps its size
    /// (its reads past it stay EINVAL), a new connection sees the new size and zeros past the
    /// old end.
    fn resize(&mut self, uid: u64) {
        self.begin_change(uid);
        let (name, old) = {
            let w = self.lock();
            (w.vols[&uid].name.clone(), w.vols[&uid].size_bytes)
        };
        let new = (old + self.rng.gen_range(1..=4) * 4 * MIB).min(MAX_VOLUME_BYTES);
        if new > old {
            let size = new.to_string();
            let c = call(
                &["volume", "resize", &name, "--size", &size],
                "POST",
                format!("/api/v1/volumes/{name}/resize"),
                Some(json!({"size_bytes": new})),
            );
            self.run(&c, true);
            vol_mut(&mut self.lock(), uid).size_bytes = new;
            let (size, tail) = read_view_from(self.nbd_addr, &name, old);
            assert_eq!(size, new, "{name}: a connection made after growing it");
            if let Some(i) = tail.iter().position(|&b| b != 0) {
                panic!(
                    "{name} grown from {old} bytes: byte {} is not zero",
                    old + i as u64
                );
            }
            self.count("resize");
        }
        self.end_change(uid);
    }

    /// Takes a snapshot under the clients' writes and reads it: each block must hold what
    /// was acknowledged before the request, or a write in flight across it; it holds that
    /// ever after.
    fn snapshot(&mut self, uid: u64) {
        let name = {
            let w = self.lock();
            let v = &w.vols[&uid];
            if v.snaps.iter().filter(|s| s.alive).count() >= MAX_SNAPSHOTS_PER_VOLUME {
                return;
            }
            v.name.clone()
        };
        self.next_snapshot += 1;
        let snap = format!("s{}", self.next_snapshot);
        let c = call(
            &["snapshot", "create", &name, &snap],
            "POST",
            format!("/api/v1/volumes/{name}/snapshots"),
            Some(json!({"name": snap})),
        );
        let req = tick();
        self.run(&c, true);
        let rep = tick();
        let export = format!("{name}@{snap}");
        let (size, data) = read_view(self.nbd_addr, &export);
        let mut w = self.lock();
        let v = vol_mut(&mut w, uid);
        assert_eq!(size, v.size_bytes, "{export}: size");
        let states = v.snapshot_states(req, rep);
        let mut tokens = Vec::with_capacity(states.len());
        for (lba, block) in data.chunks_exact(BLOCK_BYTES as usize).enumerate() {
            let allowed = &states[lba];
            let Some(got) = match_block(lba as u64, block, allowed) else {
                panic!(
                    "{export} (taken between ticks {req} and {rep}): {}; allowed: {:?}",
                    content::explain_mismatch(lba as u64, block, allowed[0]),
                    allowed
                        .iter()
                        .map(|t| describe_token(*t))
                        .collect::<Vec<_>>()
                );
            };
            tokens.push(got);
        }
        v.snaps.push(Snap {
            name: snap,
            size_bytes: size,
            tokens,
            alive: true,
        });
        drop(w);
        self.count("snapshot");
    }

    /// Deletes a snapshot: while a connection has it open, refused unless forced, and then
    /// that connection's next read fails with ESHUTDOWN; its export is gone.
    fn delete_snapshot(&mut self, uid: u64) {
        let (volume, snap, _, _) = self.pick_snapshot(uid);
        let export = format!("{volume}@{snap}");
        let path = format!("/api/v1/volumes/{volume}/snapshots/{snap}");
        let delete = |force: bool| {
            let mut cli = vec!["snapshot", "delete", &volume, &snap];
            if force {
                cli.push("--force");
            }
            call(&cli, "DELETE", format!("{path}?force={force}"), None)
        };
        let holder = self.rng.gen_bool(0.5).then(|| {
            nbd::go(self.nbd_addr, &export).unwrap_or_else(|e| panic!("opening {export}: {e:?}"))
        });
        if holder.is_some() {
            self.run(&delete(false), false);
            self.run(&delete(true), true);
        } else {
            self.wait_no_handles(&path);
            self.run(&delete(false), true);
        }
        let mut w = self.lock();
        let v = vol_mut(&mut w, uid);
        v.snaps
            .iter_mut()
            .filter(|s| s.name == snap)
            .for_each(|s| s.alive = false);
        drop(w);
        if let Some(mut h) = holder {
            assert_cut(&mut h, &export, "its snapshot deleted by force");
        }
        assert!(
            nbd::go(self.nbd_addr, &export).is_err(),
            "{export} still opens after its delete"
        );
        self.count("delete snapshot");
    }

    /// Clones a snapshot: the clone reads as the snapshot, and clients then write to it.
    fn clone_snapshot(&mut self, uid: u64) {
        if self.live_count() >= MAX_LIVE_VOLUMES {
            return;
        }
        let (volume, snap, size_bytes, tokens) = self.pick_snapshot(uid);
        self.next_clone += 1;
        let clone = format!("lc{}", self.next_clone);
        let new_uid = self.lock().new_vol(&clone, size_bytes, tokens.clone());
        let c = call(
            &["volume", "clone", &format!("{volume}@{snap}"), &clone],
            "POST",
            format!("/api/v1/volumes/{volume}/clone"),
            Some(json!({"snapshot": snap, "name": clone})),
        );
        self.run(&c, true);
        assert_view(
            self.nbd_addr,
            &clone,
            size_bytes,
            &tokens,
            "a clone just made",
        );
        self.end_change(new_uid);
        self.count("clone");
    }
}

/// A connection whose view was deleted or rolled back by force: its next read fails with
/// ESHUTDOWN and returns no data.
fn assert_cut(client: &mut nbd::Client, export: &str, why: &str) {
    let got = client
        .read(0, BLOCK_BYTES as u32)
        .unwrap_or_else(|e| panic!("{export}: {e}"));
    match got {
        Err(errno) => assert_eq!(errno, nbd::ESHUTDOWN, "{export} after {why}: errno"),
        Ok(data) => panic!(
            "{export} after {why}: a read succeeded and returned {}",
            decode_block(0, &data).map_or_else(|e| e, describe_token)
        ),
    }
}

impl Driver<'_> {
    /// Opens a connection of the driver's own to a volume (so it is surely open) when a
    /// client holds it, and at times when none does.
    fn hold_if_claimed(&mut self, uid: u64) -> Option<(String, nbd::Client)> {
        let (name, claimed) = {
            let w = self.lock();
            (w.vols[&uid].name.clone(), w.vols[&uid].claimed)
        };
        (claimed || self.rng.gen_bool(0.3)).then(|| {
            let c =
                nbd::go(self.nbd_addr, &name).unwrap_or_else(|e| panic!("opening {name}: {e:?}"));
            (name, c)
        })
    }

    /// Records a forced change's reply: the generation's connections are cut off from here.
    fn fenced(&self, uid: u64, rep: u64) {
        let mut w = self.lock();
        let v = vol_mut(&mut w, uid);
        v.fenced.push((v.gen, rep));
        v.fencing = None;
    }

    fn start_fencing(&self, uid: u64) {
        let mut w = self.lock();
        let v = vol_mut(&mut w, uid);
        v.fencing = Some(v.gen);
    }

    /// Rolls a volume back to a snapshot: refused while it is open unless forced; connections
    /// then fail with ESHUTDOWN; a new connection sees the snapshot's image and size.
    fn rollback(&mut self, uid: u64) {
        self.begin_change(uid);
        let (volume, snap, size_bytes, tokens) = self.pick_snapshot(uid);
        let rollback = |force: bool| {
            let mut cli = vec!["volume", "rollback", &volume, &snap];
            if force {
                cli.push("--force");
            }
            let path = format!("/api/v1/volumes/{volume}/rollback");
            call(
                &cli,
                "POST",
                path,
                Some(json!({"snapshot": snap, "force": force})),
            )
        };
        let holder = self.hold_if_claimed(uid);
        if holder.is_some() {
            self.run(&rollback(false), false);
            self.start_fencing(uid);
            self.run(&rollback(true), true);
        } else {
            self.wait_no_handles(&format!("/api/v1/volumes/{volume}"));
            self.run(&rollback(false), true);
        }
        self.fenced(uid, tick());
        {
            let mut w = self.lock();
            let v = vol_mut(&mut w, uid);
            v.gen += 1;
            v.base = tokens.clone();
            v.writes.clear();
            v.size_bytes = size_bytes;
        }
        if let Some((name, mut h)) = holder {
            assert_cut(&mut h, &name, "a forced rollback");
        }
        assert_view(
            self.nbd_addr,
            &volume,
            size_bytes,
            &tokens,
            "a volume just rolled back",
        );
        self.end_change(uid);
        self.count("rollback");
    }

    /// Deletes a volume: with snapshots, refused without `with_snapshots`; while open,
    /// refused unless forced, and then its connections fail with ESHUTDOWN, also once a
    /// volume of the same name exists again, which reads zeros.
    fn delete(&mut self, uid: u64) {
        self.begin_change(uid);
        let (volume, snaps) = {
            let w = self.lock();
            let v = &w.vols[&uid];
            (v.name.clone(), v.snaps.iter().any(|s| s.alive))
        };
        let path = format!("/api/v1/volumes/{volume}");
        let delete = |force: bool, with_snapshots: bool| {
            let mut cli = vec!["volume", "delete", &volume];
            if force {
                cli.push("--force");
            }
            if with_snapshots {
                cli.push("--with-snapshots");
            }
            let query = format!("{path}?force={force}&with_snapshots={with_snapshots}");
            call(&cli, "DELETE", query, None)
        };
        if snaps {
            self.run(&delete(true, false), false);
        }
        let holder = self.hold_if_claimed(uid);
        if holder.is_some() {
            self.run(&delete(false, snaps), false);
            self.start_fencing(uid);
            self.run(&delete(true, snaps), true);
        } else {
            self.wait_no_handles(&path);
            self.run(&delete(false, snaps), true);
        }
        self.fenced(uid, tick());
        {
            let mut w = self.lock();
            let v = vol_mut(&mut w, uid);
            v.dead = true;
            v.snaps.iter_mut().for_each(|s| s.alive = false);
        }
        assert!(
            nbd::go(self.nbd_addr, &volume).is_err(),
            "{volume} still opens after its delete"
        );
        if VOLUME_NAMES.contains(&volume.as_str()) && self.rng.gen_bool(0.5) {
            self.create(&volume);
        }
        if let Some((name, mut h)) = holder {
            assert_cut(&mut h, &name, "a forced delete");
        }
        self.count("delete");
    }

    /// Changes a volume's policy (mode and limits) under its clients' I/O.
    fn set_policy(&mut self, uid: u64) {
        let name = self.lock().vols[&uid].name.clone();
        let mode = ["cache", "tier"][self.rng.gen_range(0..2)];
        let iops: u64 = [0, 0, 5000][self.rng.gen_range(0..3)];
        let bandwidth: u64 = [0, 0, 64 * MIB][self.rng.gen_range(0..3)];
        let (iops_s, bandwidth_s) = (iops.to_string(), bandwidth.to_string());
        let c = call(
            &[
                "volume",
                "set-policy",
                &name,
                "--policy",
                mode,
                "--iops-limit",
                &iops_s,
                "--bandwidth-limit",
                &bandwidth_s,
            ],
            "PUT",
            format!("/api/v1/volumes/{name}/policy"),
            Some(
                json!({"mode": mode, "iops_limit": iops, "bandwidth_limit_bytes_per_s": bandwidth}),
            ),
        );
        self.run(&c, true);
        let policy = &http::get_json(&format!("{}/api/v1/volumes/{name}", self.http_url))["policy"];
        assert_eq!(
            policy["mode"], mode,
            "{name}: policy after set-policy: {policy}"
        );
        assert_eq!(
            policy["iops_limit"], iops,
            "{name}: policy after set-policy: {policy}"
        );
        self.count("set-policy");
    }

    /// Random changes until `duration` has passed (or a client failed).
    fn chaos(&mut self, duration: Duration, stop: &AtomicBool) {
        let started = Instant::now();
        while started.elapsed() < duration && !stop.load(Ordering::SeqCst) {
            let roll = self.rng.gen_range(0..100);
            if roll < 10 {
                self.create_some();
            } else if let Some(uid) = self.pick_volume((60..85).contains(&roll)) {
                match roll {
                    10..=24 => self.resize(uid),
                    25..=44 => self.snapshot(uid),
                    45..=54 => self.set_policy(uid),
                    55..=59 => self.delete(uid),
                    60..=69 => self.delete_snapshot(uid),
                    70..=77 => self.clone_snapshot(uid),
                    _ if roll < 85 => self.rollback(uid),
                    _ => self.snapshot(uid),
                }
            }
            thread::sleep(Duration::from_millis(self.rng.gen_range(0..60)));
        }
    }

    /// One WRITE, TRIM or WRITE_ZEROES of a random range (whole blocks, sectors or bytes)
    /// on `client`, recorded in the model once it succeeded.
    fn write_one(&mut self, client: &mut nbd::Client, uid: u64, name: &str) {
        let unit = [BLOCK_BYTES, 512, 1][self.rng.gen_range(0..3)];
        let max_units = (MAX_WRITE_BLOCKS * BLOCK_BYTES).min(client.size_bytes) / unit;
        let len = self.rng.gen_range(1..=max_units) * unit;
        let offset = self.rng.gen_range(0..=(client.size_bytes - len) / unit) * unit;
        let command = [
            nbd::CMD_WRITE,
            nbd::CMD_WRITE,
            nbd::CMD_TRIM,
            nbd::CMD_WRITE_ZEROES,
        ][self.rng.gen_range(0..4)];
        let token = match command {
            nbd::CMD_WRITE => self.lock().next_token(uid),
            _ => 0,
        };
        let payload = match token {
            0 => Vec::new(),
            t => write_payload(t, offset, len),
        };
        let sent = tick();
        let done = client.outcome(command, offset, len as u32, &payload);
        assert_eq!(
            done.expect("reply"),
            Ok(()),
            "{name}: {command} {len} bytes at {offset}"
        );
        let rec = WriteRec {
            offset_bytes: offset,
            len_bytes: len,
            token,
            sent,
            acked: Some(tick()),
            failed: false,
        };
        vol_mut(&mut self.lock(), uid).writes.push(rec);
    }

    /// Writes, trims and zeroes a few ranges of every volume and FLUSHes each connection;
    /// returns the connections, still open, for the caller to kill the daemon under.
    fn write_and_flush(&mut self) -> Vec<nbd::Client> {
        let uids: Vec<u64> = self
            .lock()
            .vols
            .values()
            .filter(|v| !v.dead)
            .map(|v| v.uid)
            .collect();
        let mut open = Vec::new();
        for uid in uids {
            let name = self.lock().vols[&uid].name.clone();
            let mut client =
                nbd::go(self.nbd_addr, &name).unwrap_or_else(|e| panic!("opening {name}: {e:?}"));
            for _ in 0..6 {
                self.write_one(&mut client, uid, &name);
            }
            let cookie = client.send(nbd::CMD_FLUSH, 0, 0, &[]).expect("FLUSH");
            assert_eq!(
                client.read_reply_header().expect("FLUSH reply"),
                (0, cookie),
                "{name}: FLUSH"
            );
            open.push(client);
        }
        open
    }
}

/// Lines of the daemon's log that say it panicked.
fn panics_in(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("panicked")).collect()
}

#[test]
fn admin_changes_under_live_io_keep_every_volume_and_snapshot_true() {
    let seed = test_seed("lifecycle");
    let mut daemon = Daemon::start_default();
    let world: Shared = Mutex::new(World::default());
    let stop = AtomicBool::new(false);
    let mut driver = Driver::new(&daemon, &world, seed);
    for name in &VOLUME_NAMES[..4] {
        driver.create(name);
    }
    let addr = daemon.nbd_addr;
    let answered: Vec<Result<lifecycle::client::Tally, String>> = thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENT_THREADS as u64)
            .map(|i| {
                let (world, stop) = (&world, &stop);
                s.spawn(move || {
                    let result =
                        client_loop(world, addr, stop, seed ^ (i + 1).wrapping_mul(0x9e37_79b9));
                    if result.is_err() {
                        stop.store(true, Ordering::SeqCst);
                    }
                    result
                })
            })
            .collect();
        let _stop = StopOnDrop(&stop);
        driver.chaos(CHAOS_DURATION, &stop);
        stop.store(true, Ordering::SeqCst);
        clients
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a client thread panicked".into()))
            })
            .collect()
    });
    eprintln!("lifecycle: admin changes {:?}", driver.done);
    let mut tally = lifecycle::client::Tally::new();
    for result in answered {
        let counts = result.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        for (k, n) in counts {
            *tally.entry(k).or_default() += n;
        }
    }
    eprintln!("lifecycle: client replies checked {tally:?}");
    daemon.assert_alive();
    verify_all(&daemon, &world, "after the run");
    daemon.terminate();
    daemon.restart();
    driver.retarget(&daemon);
    verify_all(&daemon, &world, "after a clean restart");
    let open = driver.write_and_flush();
    daemon.kill9();
    drop(open);
    daemon.restart();
    driver.retarget(&daemon);
    verify_all(&daemon, &world, "after SIGKILL following a FLUSH");
    let log = daemon.stderr_log();
    assert!(
        panics_in(&log).is_empty(),
        "the daemon panicked:\n{}",
        panics_in(&log).join("\n")
    );
}
