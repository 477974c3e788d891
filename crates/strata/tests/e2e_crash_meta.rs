//! Crash safety of metadata operations: SIGKILL the daemon again and again while qemu-io
//! clients write to one volume (`main`) and, at the same time, the CLI takes and deletes
//! snapshots, clones them, creates, writes, grows, rolls back and deletes other volumes and
//! changes policies. After each restart everything acknowledged must hold, and a scrub must
//! find nothing wrong.
//!
//! What is expected is derived only from acknowledged operations:
//! - `main` is written as in e2e_crash: workers rewrite regions, one qemu-io process per
//!   region write; a region reads back as its last acknowledged write, or, where a write was in
//!   flight at the kill, byte by byte as either that or the in-flight pattern, except that
//!   every chunk of it the daemon replied to (qemu-io printed `wrote`) must hold the pattern.
//! - A snapshot of `main` holds a region's content as known when the create call started,
//!   but only for regions on which no write was in flight then and none started before the
//!   call returned (their content is certain); other regions are not checked the first time.
//!   Bytes outside the regions are zero. Once read after a restart, a snapshot must read
//!   exactly the same ever after (it is read-only).
//! - Every other volume (created, or a clone) is written only by the admin thread, one
//!   acknowledged write at a time, so its image, and its snapshots', are known exactly. A
//!   clone starts as its snapshot's image; while it is unchanged it must read exactly like
//!   that snapshot. A rollback makes the volume its snapshot's image and size.
//! - The one operation in flight at the kill may or may not have happened: both outcomes are
//!   accepted (a rollback or a resize is whole or not at all), and the model takes the one
//!   seen. Every operation that returned success must hold: created things exist, deleted
//!   things are gone (names are never reused), sizes and policies are as last set.
use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const MAIN: &str = "main";
const MAIN_START_BYTES: u64 = 8 * MIB;
const MAIN_MAX_BYTES: u64 = 11 * MIB;
const WORKERS: usize = 3;
const REGIONS_PER_WORKER: usize = 4;
const REGION_STRIDE_BYTES: u64 = 512 * 1024;
const REGION_BYTES: usize = 256 * 1024;
const CHUNK_SIZES_BYTES: [usize; 5] = [512, 4096, 8192, 32768, 65536];
const BLOCK_BYTES: usize = 4096;
const OTHER_START_BYTES: u64 = 4 * MIB;
const OTHER_MAX_BYTES: u64 = 6 * MIB;
const OTHER_WRITE_MAX_BLOCKS: usize = 64;
const MAX_MAIN_SNAPSHOTS: usize = 3;
const MAX_OTHER_VOLUMES: usize = 3;
const MAX_SNAPSHOTS_PER_OTHER: usize = 2;
const ROUNDS: u64 = 10;
const LOAD_MS: std::ops::Range<u64> = 300..1500;
const FIRST_ACK_TIMEOUT: Duration = Duration::from_secs(20);
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
const TEST_BUDGET: Duration = Duration::from_secs(150);

/// What a block of an expected image may hold.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Block {
    /// Exactly the image's bytes.
    Exact,
    /// Byte by byte, the image's bytes or this pattern (a write in flight at the kill).
    OrPattern(u8),
    /// Unknown (not checked).
    Any,
}

/// An expected image: bytes, and how sure each 4 KiB block is.
#[derive(Clone, Debug)]
struct Image {
    bytes: Vec<u8>,
    blocks: Vec<Block>,
}

impl Image {
    fn zeros(size_bytes: u64) -> Image {
        Image::exact(vec![0; size_bytes as usize])
    }

    fn exact(bytes: Vec<u8>) -> Image {
        let blocks = vec![Block::Exact; bytes.len() / BLOCK_BYTES];
        Image { bytes, blocks }
    }

    fn size_bytes(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn grown(&self, size_bytes: u64) -> Image {
        let mut img = self.clone();
        img.bytes.resize(size_bytes as usize, 0);
        img.blocks
            .resize(size_bytes as usize / BLOCK_BYTES, Block::Exact);
        img
    }

    fn write(&mut self, offset: usize, len: usize, pattern: u8) {
        self.bytes[offset..offset + len].fill(pattern);
        self.blocks[offset / BLOCK_BYTES..(offset + len) / BLOCK_BYTES].fill(Block::Exact);
    }

    fn write_in_flight(&mut self, offset: usize, len: usize, pattern: u8) {
        for b in &mut self.blocks[offset / BLOCK_BYTES..(offset + len) / BLOCK_BYTES] {
            *b = match *b {
                Block::Exact => Block::OrPattern(pattern),
                _ => Block::Any,
            };
        }
    }

    /// Why `actual` cannot be this image, or None when it can.
    fn mismatch(&self, actual: &[u8]) -> Option<String> {
        if actual.len() != self.bytes.len() {
            return Some(format!(
                "{} bytes, expected {}",
                actual.len(),
                self.bytes.len()
            ));
        }
        for (b, kind) in self.blocks.iter().enumerate() {
            let at = b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES;
            let (got, want) = (&actual[at.clone()], &self.bytes[at]);
            let bad = match *kind {
                Block::Any => None,
                Block::Exact => got.iter().zip(want).position(|(g, w)| g != w),
                Block::OrPattern(p) => got.iter().zip(want).position(|(g, w)| g != w && *g != p),
            };
            if let Some(i) = bad {
                let offset = b * BLOCK_BYTES + i;
                return Some(format!(
                    "byte {offset} reads {:#04x}, expected {:#04x} ({kind:?}); block {b} starts {:02x?}",
                    actual[offset],
                    self.bytes[offset],
                    &got[..8]
                ));
            }
        }
        None
    }
}

/// A region of `main` as its worker last saw it.
#[derive(Clone)]
struct Region {
    offset: u64,
    /// Content after the last acknowledged write (or as read after the last restart).
    known: Vec<u8>,
    /// Pattern of the write in flight, if any.
    in_flight: Option<u8>,
    /// Chunks of that write the daemon replied to (offset in the region, length): a reply
    /// means durable, so they must read as the pattern whatever became of the rest.
    in_flight_acked: Vec<(usize, usize)>,
    /// Writes started on the region so far.
    starts: u64,
}

type Regions = Arc<Mutex<Vec<Region>>>;

fn lock(regions: &Regions) -> std::sync::MutexGuard<'_, Vec<Region>> {
    regions.lock().unwrap_or_else(|e| e.into_inner())
}

/// `main` as expected: its regions, zeros elsewhere.
fn main_image(regions: &[Region], size_bytes: u64) -> Image {
    let mut img = Image::zeros(size_bytes);
    for r in regions {
        let at = r.offset as usize;
        img.bytes[at..at + REGION_BYTES].copy_from_slice(&r.known);
        if let Some(p) = r.in_flight {
            img.write_in_flight(at, REGION_BYTES, p);
            for &(start, len) in &r.in_flight_acked {
                img.bytes[at + start..at + start + len].fill(p);
            }
        }
    }
    img
}

/// A snapshot of `main` as expected: regions seen with no write in flight at `before`, on
/// which no write started since (`starts_after`), hold what was known at `before`; the other
/// regions are unknown.
fn main_snapshot_image(before: &[Region], starts_after: &[u64], size_bytes: u64) -> Image {
    let mut img = Image::zeros(size_bytes);
    for (r, after) in before.iter().zip(starts_after) {
        let at = r.offset as usize;
        let range = at / BLOCK_BYTES..(at + REGION_BYTES) / BLOCK_BYTES;
        if r.in_flight.is_none() && r.starts == *after {
            img.bytes[at..at + REGION_BYTES].copy_from_slice(&r.known);
        } else {
            img.blocks[range].fill(Block::Any);
        }
    }
    img
}

fn starts(regions: &Regions) -> Vec<u64> {
    lock(regions).iter().map(|r| r.starts).collect()
}

/// One qemu-io process rewriting the region at `offset` with `pattern`, as concurrent chunks.
fn region_write(
    uri: &str,
    offset: u64,
    pattern: u8,
    rng: &mut SmallRng,
) -> (std::process::Command, usize) {
    chunked_write(uri, offset, REGION_BYTES, &CHUNK_SIZES_BYTES, pattern, rng)
}

struct Load {
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicUsize>,
}

fn worker(uri: String, regions: Regions, mine: std::ops::Range<usize>, seed: u64, load: Load) {
    let mut rng = SmallRng::seed_from_u64(seed);
    while !load.stop.load(Ordering::SeqCst) {
        let i = rng.gen_range(mine.clone());
        let (offset, old) = {
            let g = lock(&regions);
            (g[i].offset, g[i].known[0])
        };
        let pattern = loop {
            let p: u8 = rng.gen_range(1..=255);
            if p != old {
                break p;
            }
        };
        let (mut command, chunks) = region_write(&uri, offset, pattern, &mut rng);
        {
            let mut g = lock(&regions);
            g[i].in_flight = Some(pattern);
            g[i].starts += 1;
        }
        let out = run_timeout(&mut command, CMD_TIMEOUT);
        let acked = wrote_ranges(&out)
            .into_iter()
            .map(|(at, len)| ((at - offset) as usize, len))
            .collect();
        lock(&regions)[i].in_flight_acked = acked;
        if acknowledged(&out, chunks) {
            let mut g = lock(&regions);
            g[i].known = vec![pattern; REGION_BYTES];
            g[i].in_flight = None;
            g[i].in_flight_acked.clear();
            load.acks.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        assert!(
            load.stop.load(Ordering::SeqCst),
            "a write to {MAIN} failed while the daemon was up\n{}",
            output_report(&describe(&command), &out)
        );
        break;
    }
}

/// A snapshot as expected; `maybe` while its create or delete was in flight at a kill.
#[derive(Clone)]
struct Snap {
    image: Image,
    maybe: bool,
}

/// A tiering policy as expected: the values each field may have.
type Policy = BTreeMap<String, Vec<Value>>;

/// A volume other than `main`, written only by the admin thread.
#[derive(Clone)]
struct Other {
    /// What it may read as: one image, or two when a rollback or resize was in flight.
    images: Vec<Image>,
    maybe: bool,
    snaps: BTreeMap<String, Snap>,
    /// The snapshot it was cloned from, while it still reads exactly like it.
    origin: Option<(String, String)>,
    policy: Policy,
}

struct Model {
    main_sizes_bytes: Vec<u64>,
    main_snaps: BTreeMap<String, Snap>,
    main_policy: Policy,
    others: BTreeMap<String, Other>,
    default_policy: Policy,
    /// Volumes and snapshots (`volume@snapshot`) whose deletion returned success.
    deleted: BTreeSet<String>,
    next_name: u64,
}

impl Model {
    fn snaps_of(&self, volume: &str) -> &BTreeMap<String, Snap> {
        if volume == MAIN {
            return &self.main_snaps;
        }
        &self.others[volume].snaps
    }

    fn policy_of(&mut self, volume: &str) -> &mut Policy {
        if volume == MAIN {
            return &mut self.main_policy;
        }
        &mut self.others.get_mut(volume).expect("volume in model").policy
    }
}

fn policy_from(json: &Value) -> Policy {
    json.as_object()
        .expect("policy object")
        .iter()
        .map(|(k, v)| (k.clone(), vec![v.clone()]))
        .collect()
}

/// `strata volume set-policy` options, and the policy fields they set with their values.
type PolicyChange = (&'static [&'static str], &'static [(&'static str, i64)]);

const POLICY_CHANGES: &[PolicyChange] = &[
    (
        &["--policy", "tier", "--tier-min-age", "1s"],
        &[("tier_min_age_s", 1)],
    ),
    (&["--policy", "cache"], &[]),
    (
        &["--promote-after-reads", "0"],
        &[("promote_after_reads", 0)],
    ),
    (
        &["--promote-after-reads", "3"],
        &[("promote_after_reads", 3)],
    ),
    (
        &["--bandwidth-limit", "1G"],
        &[("bandwidth_limit_bytes_per_s", 1 << 30)],
    ),
    (
        &["--bandwidth-limit", "0"],
        &[("bandwidth_limit_bytes_per_s", 0)],
    ),
    (&["--iops-limit", "1000000"], &[("iops_limit", 1_000_000)]),
    (&["--iops-limit", "0"], &[("iops_limit", 0)]),
    (&["--tier-max-cold-heat", "2"], &[("tier_max_cold_heat", 2)]),
];

fn policy_fields(args: &[&str], numbers: &[(&str, i64)]) -> Vec<(String, Value)> {
    let mut fields: Vec<(String, Value)> = numbers
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(*v)))
        .collect();
    if let Some(i) = args.iter().position(|a| *a == "--policy") {
        fields.push(("mode".into(), Value::from(args[i + 1])));
    }
    fields
}

#[derive(Clone, Copy, Debug)]
enum Op {
    MainSnapshot,
    MainSnapshotDelete,
    Clone,
    Create,
    Write,
    Snapshot,
    SnapshotDelete,
    Rollback,
    Resize,
    SetPolicy,
    Delete,
}

/// The answer to an admin call: done (with the CLI's JSON), or lost with the daemon.
enum Outcome {
    Done,
    Lost,
}

/// The admin side of a round: one metadata operation (or write to another volume) at a time,
/// back to back, until one is lost with the daemon.
struct Admin {
    http_url: String,
    nbd_addr: String,
    stop: Arc<AtomicBool>,
    regions: Regions,
    rng: SmallRng,
    model: Model,
    done: Vec<String>,
    lost: Option<String>,
    /// A snapshot of `main` whose create was lost: its name, the regions before it, its size.
    lost_main_snapshot: Option<(String, Vec<Region>, u64)>,
}

impl Admin {
    fn fresh(&mut self, prefix: &str) -> String {
        self.model.next_name += 1;
        format!("{prefix}{}", self.model.next_name)
    }

    fn call(&self, args: &[&str]) -> Outcome {
        let mut command = std::process::Command::new(STRATA_BIN);
        command
            .args(["--server", &self.http_url, "--json"])
            .args(args);
        let out = run_timeout(&mut command, ADMIN_TIMEOUT);
        self.outcome(out.status.success(), "an admin call", &command, &out)
    }

    /// Done, or Lost when it failed once the daemon was being killed (a failure before that
    /// fails the test).
    fn outcome(
        &self,
        ok: bool,
        what: &str,
        command: &std::process::Command,
        out: &std::process::Output,
    ) -> Outcome {
        if ok {
            return Outcome::Done;
        }
        assert!(
            self.stop.load(Ordering::SeqCst),
            "{what} failed while the daemon was up\n{}",
            output_report(&describe(command), out)
        );
        Outcome::Lost
    }

    fn write_other(&self, volume: &str, offset: usize, len: usize, pattern: u8) -> Outcome {
        let uri = format!("nbd://{}/{volume}", self.nbd_addr);
        let write = format!("write -P {pattern} {offset} {len}");
        let mut command = qemu_io_cmd(&uri, &[&write, "flush"]);
        let out = run_timeout(&mut command, CMD_TIMEOUT);
        let what = format!("a write to {volume}");
        self.outcome(acknowledged(&out, 1), &what, &command, &out)
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.rng.gen_range(0..items.len())].clone()
    }

    fn ops(&self) -> Vec<(Op, u32)> {
        let m = &self.model;
        let others = m.others.len();
        let all_snaps =
            m.main_snaps.len() + m.others.values().map(|o| o.snaps.len()).sum::<usize>();
        let with_snaps = m.others.values().filter(|o| !o.snaps.is_empty()).count();
        let snap_room = m
            .others
            .values()
            .any(|o| o.snaps.len() < MAX_SNAPSHOTS_PER_OTHER);
        let main_full = m.main_snaps.len() >= MAX_MAIN_SNAPSHOTS;
        let mut ops = vec![(Op::SetPolicy, 1), (Op::Resize, 1)];
        if !main_full {
            ops.push((Op::MainSnapshot, 3));
        }
        if !m.main_snaps.is_empty() {
            ops.push((Op::MainSnapshotDelete, if main_full { 3 } else { 1 }));
        }
        if others < MAX_OTHER_VOLUMES {
            ops.push((Op::Create, 1));
            if all_snaps > 0 {
                ops.push((Op::Clone, 2));
            }
        }
        if others > 0 {
            ops.push((Op::Write, 3));
            ops.push((Op::Delete, if others >= MAX_OTHER_VOLUMES { 2 } else { 1 }));
        }
        if snap_room {
            ops.push((Op::Snapshot, 2));
        }
        if with_snaps > 0 {
            ops.push((Op::Rollback, 2));
            ops.push((Op::SnapshotDelete, 1));
        }
        ops
    }

    fn choose(&mut self) -> Op {
        let ops = self.ops();
        let total: u32 = ops.iter().map(|(_, w)| w).sum();
        let mut at = self.rng.gen_range(0..total);
        for (op, w) in ops {
            if at < w {
                return op;
            }
            at -= w;
        }
        unreachable!("weights add up")
    }

    /// Runs operations until one is lost with the daemon.
    fn run(mut self) -> Admin {
        while self.lost.is_none() && !self.stop.load(Ordering::SeqCst) {
            let op = self.choose();
            let (what, outcome) = self.step(op);
            match outcome {
                Outcome::Done => self.done.push(what),
                Outcome::Lost => self.lost = Some(what),
            }
        }
        self
    }

    fn step(&mut self, op: Op) -> (String, Outcome) {
        match op {
            Op::MainSnapshot => self.main_snapshot(),
            Op::MainSnapshotDelete => self.snapshot_delete(MAIN.to_string()),
            Op::Clone => self.clone_volume(),
            Op::Create => self.create(),
            Op::Write => self.write(),
            Op::Snapshot => self.snapshot(),
            Op::SnapshotDelete => {
                let vols = self.others_with_snapshots();
                let vol = self.pick(&vols);
                self.snapshot_delete(vol)
            }
            Op::Rollback => self.rollback(),
            Op::Resize => self.resize(),
            Op::SetPolicy => self.set_policy(),
            Op::Delete => self.delete(),
        }
    }

    fn main_snapshot(&mut self) -> (String, Outcome) {
        let name = self.fresh("s");
        let size = self.model.main_sizes_bytes[0];
        let before = lock(&self.regions).clone();
        let what = format!("snapshot create {MAIN}@{name}");
        let outcome = self.call(&["snapshot", "create", MAIN, &name]);
        match outcome {
            Outcome::Done => {
                let image = main_snapshot_image(&before, &starts(&self.regions), size);
                let snap = Snap {
                    image,
                    maybe: false,
                };
                self.model.main_snaps.insert(name, snap);
            }
            Outcome::Lost => self.lost_main_snapshot = Some((name, before, size)),
        }
        (what, outcome)
    }

    fn snapshot_delete(&mut self, vol: String) -> (String, Outcome) {
        let names: Vec<String> = self.model.snaps_of(&vol).keys().cloned().collect();
        let name = self.pick(&names);
        let what = format!("snapshot delete {vol}@{name}");
        let outcome = self.call(&["snapshot", "delete", &vol, &name, "--force"]);
        let snaps = if vol == MAIN {
            &mut self.model.main_snaps
        } else {
            &mut self.model.others.get_mut(&vol).expect("volume").snaps
        };
        match outcome {
            Outcome::Done => {
                snaps.remove(&name);
                self.model.deleted.insert(format!("{vol}@{name}"));
            }
            Outcome::Lost => snaps.get_mut(&name).expect("snapshot").maybe = true,
        }
        (what, outcome)
    }

    fn clone_volume(&mut self) -> (String, Outcome) {
        let mut sources: Vec<(String, String)> = self
            .model
            .main_snaps
            .keys()
            .map(|s| (MAIN.to_string(), s.clone()))
            .collect();
        for (v, o) in &self.model.others {
            sources.extend(o.snaps.keys().map(|s| (v.clone(), s.clone())));
        }
        let (vol, snap) = self.pick(&sources);
        let name = self.fresh("c");
        let what = format!("volume clone {vol}@{snap} {name}");
        let outcome = self.call(&["volume", "clone", &format!("{vol}@{snap}"), &name]);
        let image = self.model.snaps_of(&vol)[&snap].image.clone();
        let policy = self.model.policy_of(&vol).clone();
        let clone = Other {
            images: vec![image],
            maybe: matches!(outcome, Outcome::Lost),
            snaps: BTreeMap::new(),
            origin: Some((vol, snap)),
            policy,
        };
        self.model.others.insert(name, clone);
        (what, outcome)
    }

    fn create(&mut self) -> (String, Outcome) {
        let name = self.fresh("v");
        let what = format!("volume create {name}");
        let size = OTHER_START_BYTES.to_string();
        let outcome = self.call(&["volume", "create", &name, "--size", &size]);
        let vol = Other {
            images: vec![Image::zeros(OTHER_START_BYTES)],
            maybe: matches!(outcome, Outcome::Lost),
            snaps: BTreeMap::new(),
            origin: None,
            policy: self.model.default_policy.clone(),
        };
        self.model.others.insert(name, vol);
        (what, outcome)
    }

    fn write(&mut self) -> (String, Outcome) {
        let names: Vec<String> = self.model.others.keys().cloned().collect();
        let vol = self.pick(&names);
        let size = self.model.others[&vol].images[0].bytes.len();
        let blocks = size / BLOCK_BYTES;
        let first = self.rng.gen_range(0..blocks);
        let count = self
            .rng
            .gen_range(1..=OTHER_WRITE_MAX_BLOCKS)
            .min(blocks - first);
        let (offset, len) = (first * BLOCK_BYTES, count * BLOCK_BYTES);
        let pattern: u8 = self.rng.gen_range(1..=255);
        let what = format!("write -P {pattern} {offset} {len} to {vol}");
        let outcome = self.write_other(&vol, offset, len, pattern);
        let o = self.model.others.get_mut(&vol).expect("volume");
        o.origin = None;
        match outcome {
            Outcome::Done => o.images[0].write(offset, len, pattern),
            Outcome::Lost => o.images[0].write_in_flight(offset, len, pattern),
        }
        (what, outcome)
    }

    fn snapshot(&mut self) -> (String, Outcome) {
        let names: Vec<String> = self
            .model
            .others
            .iter()
            .filter(|(_, o)| o.snaps.len() < MAX_SNAPSHOTS_PER_OTHER)
            .map(|(n, _)| n.clone())
            .collect();
        let vol = self.pick(&names);
        let name = self.fresh("s");
        let what = format!("snapshot create {vol}@{name}");
        let outcome = self.call(&["snapshot", "create", &vol, &name]);
        let o = self.model.others.get_mut(&vol).expect("volume");
        let snap = Snap {
            image: o.images[0].clone(),
            maybe: matches!(outcome, Outcome::Lost),
        };
        o.snaps.insert(name, snap);
        (what, outcome)
    }

    /// The volumes other than `main` that have snapshots.
    fn others_with_snapshots(&self) -> Vec<String> {
        let others = self.model.others.iter();
        others
            .filter(|(_, o)| !o.snaps.is_empty())
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn rollback(&mut self) -> (String, Outcome) {
        let vols = self.others_with_snapshots();
        let vol = self.pick(&vols);
        let snaps: Vec<String> = self.model.others[&vol].snaps.keys().cloned().collect();
        let snap = self.pick(&snaps);
        let what = format!("volume rollback {vol} {snap}");
        let outcome = self.call(&["volume", "rollback", &vol, &snap, "--force"]);
        let o = self.model.others.get_mut(&vol).expect("volume");
        let image = o.snaps[&snap].image.clone();
        o.origin = None;
        match outcome {
            Outcome::Done => o.images = vec![image],
            Outcome::Lost => o.images.push(image),
        }
        (what, outcome)
    }

    fn resize(&mut self) -> (String, Outcome) {
        let mut vols: Vec<String> = self
            .model
            .others
            .iter()
            .filter(|(_, o)| o.images[0].size_bytes() < OTHER_MAX_BYTES)
            .map(|(n, _)| n.clone())
            .collect();
        if self.model.main_sizes_bytes[0] < MAIN_MAX_BYTES {
            vols.push(MAIN.to_string());
        }
        if vols.is_empty() {
            return self.set_policy();
        }
        let vol = self.pick(&vols);
        let old = if vol == MAIN {
            self.model.main_sizes_bytes[0]
        } else {
            self.model.others[&vol].images[0].size_bytes()
        };
        let new = old + MIB;
        let what = format!("volume resize {vol} --size {new}");
        let outcome = self.call(&["volume", "resize", &vol, "--size", &new.to_string()]);
        let lost = matches!(outcome, Outcome::Lost);
        if vol == MAIN {
            let sizes = &mut self.model.main_sizes_bytes;
            if !lost {
                sizes.clear();
            }
            sizes.push(new);
        } else {
            let o = self.model.others.get_mut(&vol).expect("volume");
            let grown = o.images[0].grown(new);
            o.origin = None;
            if !lost {
                o.images.clear();
            }
            o.images.push(grown);
        }
        (what, outcome)
    }

    fn set_policy(&mut self) -> (String, Outcome) {
        let mut vols: Vec<String> = self.model.others.keys().cloned().collect();
        vols.push(MAIN.to_string());
        let vol = self.pick(&vols);
        let (args, numbers) = POLICY_CHANGES[self.rng.gen_range(0..POLICY_CHANGES.len())];
        let mut call = vec!["volume", "set-policy", vol.as_str()];
        call.extend_from_slice(args);
        let what = format!("volume set-policy {vol} {}", args.join(" "));
        let outcome = self.call(&call);
        let lost = matches!(outcome, Outcome::Lost);
        let policy = self.model.policy_of(&vol);
        for (field, value) in policy_fields(args, numbers) {
            let values = policy.get_mut(&field).expect("policy field");
            if !lost {
                values.clear();
            }
            if !values.contains(&value) {
                values.push(value);
            }
        }
        (what, outcome)
    }

    fn delete(&mut self) -> (String, Outcome) {
        let names: Vec<String> = self.model.others.keys().cloned().collect();
        let vol = self.pick(&names);
        let what = format!("volume delete {vol} --with-snapshots");
        let outcome = self.call(&["volume", "delete", &vol, "--force", "--with-snapshots"]);
        match outcome {
            Outcome::Done => {
                let o = self.model.others.remove(&vol).expect("volume");
                for snap in o.snaps.keys() {
                    self.model.deleted.insert(format!("{vol}@{snap}"));
                }
                self.model.deleted.insert(vol);
            }
            Outcome::Lost => self.model.others.get_mut(&vol).expect("volume").maybe = true,
        }
        (what, outcome)
    }
}

/// One export read whole with nbdcopy.
fn read_export(daemon: &Daemon, export: &str) -> Vec<u8> {
    let image = daemon.scratch_dir().join("readback.raw");
    let _ = std::fs::remove_file(&image);
    let path = image.to_str().expect("utf-8");
    run_ok(
        &mut cmd("nbdcopy", &[&daemon.nbd_uri(export), path]),
        CMD_TIMEOUT,
    );
    std::fs::read(&image).expect("read back")
}

/// Checks `actual` against the candidate images; returns the one that fits, or panics.
fn check_image(what: &str, candidates: &[Image], actual: &[u8]) {
    let reasons: Vec<String> = candidates
        .iter()
        .filter_map(|img| img.mismatch(actual))
        .collect();
    assert!(
        reasons.len() < candidates.len(),
        "{what} reads as none of its {} possible image(s): {reasons:?}",
        candidates.len()
    );
}

fn check_policy(what: &str, model: &mut Policy, actual: &Value) {
    for (field, allowed) in model.iter_mut() {
        let got = &actual[field.as_str()];
        assert!(
            allowed.contains(got),
            "{what}: policy field {field} is {got}; acknowledged: one of {allowed:?}"
        );
        *allowed = vec![got.clone()];
    }
}

/// Resolves the snapshots of one volume against the daemon's list; checks and reads them.
fn verify_snaps(
    daemon: &Daemon,
    what: &str,
    vol: &str,
    snaps: &mut BTreeMap<String, Snap>,
    listed: &mut BTreeMap<String, u64>,
) {
    snaps.retain(|name, snap| {
        let present = listed.remove(&format!("{vol}@{name}"));
        assert!(
            present.is_some() || snap.maybe,
            "{what}: snapshot {vol}@{name}, whose create returned success, is missing"
        );
        snap.maybe = false;
        present.is_some()
    });
    for (name, snap) in snaps.iter_mut() {
        let export = format!("{vol}@{name}");
        let actual = read_export(daemon, &export);
        check_image(
            &format!("{what}: snapshot {export}"),
            std::slice::from_ref(&snap.image),
            &actual,
        );
        snap.image = Image::exact(actual);
    }
}

/// After a restart: everything acknowledged holds, the in-flight operation is resolved into
/// the model, and a scrub finds nothing wrong.
fn verify(daemon: &Daemon, model: &mut Model, regions: &Regions, what: &str) {
    let volumes = daemon.cli_json(&["volume", "list"]);
    let mut listed: BTreeMap<String, Value> = volumes["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| (v["name"].as_str().expect("name").to_string(), v.clone()))
        .collect();
    let snapshots = daemon.cli_json(&["snapshot", "list"]);
    let mut listed_snaps: BTreeMap<String, u64> = snapshots["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .map(|s| {
            let name = s["export_name"].as_str().expect("export name").to_string();
            (name, s["size_bytes"].as_u64().expect("size"))
        })
        .collect();
    let sizes: BTreeMap<String, u64> = listed
        .iter()
        .map(|(n, v)| (n.clone(), v["size_bytes"].as_u64().expect("size")))
        .collect();

    // Snapshots first: a clone still unchanged must read exactly like its snapshot.
    let main_json = listed
        .remove(MAIN)
        .unwrap_or_else(|| panic!("{what}: {MAIN} is gone"));
    verify_snaps(daemon, what, MAIN, &mut model.main_snaps, &mut listed_snaps);
    model.others.retain(|name, o| {
        let present = listed.contains_key(name);
        assert!(
            present || o.maybe,
            "{what}: volume {name}, whose creation returned success, is missing"
        );
        o.maybe = false;
        present
    });
    for (name, o) in model.others.iter_mut() {
        verify_snaps(daemon, what, name, &mut o.snaps, &mut listed_snaps);
    }
    let leftover: Vec<&String> = listed
        .keys()
        .filter(|n| !model.others.contains_key(*n))
        .chain(listed_snaps.keys())
        .collect();
    let undead: Vec<&&String> = leftover
        .iter()
        .filter(|n| model.deleted.contains(**n))
        .collect();
    assert!(
        leftover.is_empty(),
        "{what}: unexpected volumes or snapshots {leftover:?} (of which deleted with success: {undead:?})"
    );

    // `main`: its size, its regions, zeros elsewhere.
    let main_size = sizes[MAIN];
    assert!(
        model.main_sizes_bytes.contains(&main_size),
        "{what}: {MAIN} is {main_size} bytes; acknowledged: one of {:?}",
        model.main_sizes_bytes
    );
    let actual = read_export(daemon, MAIN);
    {
        let mut g = lock(regions);
        let candidates: Vec<Image> = model
            .main_sizes_bytes
            .iter()
            .map(|s| main_image(&g, *s))
            .collect();
        check_image(&format!("{what}: volume {MAIN}"), &candidates, &actual);
        for r in g.iter_mut() {
            let at = r.offset as usize;
            r.known.copy_from_slice(&actual[at..at + REGION_BYTES]);
            r.in_flight = None;
            r.in_flight_acked.clear();
        }
    }
    model.main_sizes_bytes = vec![main_size];
    eprintln!(
        "{what}: {MAIN} holds {} bytes on the fast tier, {} on the capacity tier",
        main_json["fast_tier_bytes"], main_json["capacity_tier_bytes"]
    );
    check_policy(
        &format!("{what}: {MAIN}"),
        &mut model.main_policy,
        &main_json["policy"],
    );

    let mut exact_snaps: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (name, snap) in &model.main_snaps {
        exact_snaps.insert(format!("{MAIN}@{name}"), snap.image.bytes.clone());
    }
    for (vol, o) in &model.others {
        for (name, snap) in &o.snaps {
            exact_snaps.insert(format!("{vol}@{name}"), snap.image.bytes.clone());
        }
    }
    for (name, o) in model.others.iter_mut() {
        let size = sizes[name];
        let actual = read_export(daemon, name);
        assert_eq!(
            actual.len() as u64,
            size,
            "{what}: {name}: size listed and read"
        );
        check_image(&format!("{what}: volume {name}"), &o.images, &actual);
        if let Some((vol, snap)) = &o.origin {
            if let Some(want) = exact_snaps.get(&format!("{vol}@{snap}")) {
                assert_same_bytes(
                    &format!("{what}: clone {name}, unchanged, against {vol}@{snap}"),
                    want,
                    &actual,
                );
            }
        }
        o.images = vec![Image::exact(actual)];
        check_policy(
            &format!("{what}: {name}"),
            &mut o.policy,
            &listed[name]["policy"],
        );
    }

    let mut scrub = daemon.cli_cmd(&["--json", "scrub", "--rate", "0"]);
    let out = run_timeout(&mut scrub, CMD_TIMEOUT);
    assert!(
        out.status.success(),
        "{what}: scrub found damage or failed\n{}",
        output_report(&describe(&scrub), &out)
    );
}

fn daemon_opts() -> DaemonOpts {
    // A small fast tier with low marks: the destager runs all the time, so data, snapshots'
    // included, lies on both tiers and layers are merged and released under the kills.
    DaemonOpts {
        fast_size: "64M".into(),
        capacity_size: "1G".into(),
        extra_args: [
            "--fill-low",
            "0.05",
            "--fill-high",
            "0.2",
            "--default-volume-size",
            "0",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    }
}

/// One round: the workers and the admin thread run until a random moment, then the daemon
/// is killed under them. Returns the admin's model and what it did.
fn round_under_load(
    daemon: &mut Daemon,
    admin: Admin,
    regions: &Regions,
    rng: &mut SmallRng,
) -> (Admin, usize) {
    let stop = admin.stop.clone();
    let acks = Arc::new(AtomicUsize::new(0));
    let uri = daemon.nbd_uri(MAIN);
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let load = Load {
                stop: stop.clone(),
                acks: acks.clone(),
            };
            let (uri, regions, seed) = (uri.clone(), regions.clone(), rng.gen());
            let mine = w * REGIONS_PER_WORKER..(w + 1) * REGIONS_PER_WORKER;
            thread::spawn(move || worker(uri, regions, mine, seed, load))
        })
        .collect();
    let admin = thread::spawn(move || admin.run());
    let first_ack = wait_until(FIRST_ACK_TIMEOUT, || acks.load(Ordering::SeqCst) > 0);
    thread::sleep(Duration::from_millis(rng.gen_range(LOAD_MS)));
    stop.store(true, Ordering::SeqCst);
    daemon.kill9();
    for w in workers {
        if let Err(panic) = w.join() {
            std::panic::resume_unwind(panic);
        }
    }
    let mut admin = match admin.join() {
        Ok(admin) => admin,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    assert!(first_ack, "no write completed within {FIRST_ACK_TIMEOUT:?}");
    // A snapshot of `main` lost with the daemon: regions on which no write started since it
    // was asked for hold what they held then (the workers have stopped: `starts` is final).
    if let Some((name, before, size)) = admin.lost_main_snapshot.take() {
        let image = main_snapshot_image(&before, &starts(regions), size);
        admin
            .model
            .main_snaps
            .insert(name, Snap { image, maybe: true });
    }
    (admin, acks.load(Ordering::SeqCst))
}

#[test]
fn acknowledged_metadata_operations_survive_sigkill_under_load() {
    if !require_tools(&["qemu-io", "nbdcopy"]) {
        return;
    }
    let started = Instant::now();
    let seed = test_seed("acknowledged_metadata_operations_survive_sigkill_under_load");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut daemon = Daemon::start(daemon_opts());
    daemon.create_volume(MAIN, &MAIN_START_BYTES.to_string());
    let listed = daemon.cli_json(&["volume", "list"]);
    let default_policy = policy_from(&listed["volumes"][0]["policy"]);
    let regions: Regions = Arc::new(Mutex::new(
        (0..WORKERS * REGIONS_PER_WORKER)
            .map(|r| Region {
                offset: r as u64 * REGION_STRIDE_BYTES,
                known: vec![0; REGION_BYTES],
                in_flight: None,
                in_flight_acked: Vec::new(),
                starts: 0,
            })
            .collect(),
    ));
    let mut model = Model {
        main_sizes_bytes: vec![MAIN_START_BYTES],
        main_snaps: BTreeMap::new(),
        main_policy: default_policy.clone(),
        others: BTreeMap::new(),
        default_policy,
        deleted: BTreeSet::new(),
        next_name: 0,
    };
    let (mut total_ops, mut total_acks) = (0, 0);
    for round in 1..=ROUNDS {
        let admin = Admin {
            http_url: daemon.http_url(),
            nbd_addr: daemon.nbd_addr.to_string(),
            stop: Arc::new(AtomicBool::new(false)),
            regions: regions.clone(),
            rng: SmallRng::seed_from_u64(rng.gen()),
            model,
            done: Vec::new(),
            lost: None,
            lost_main_snapshot: None,
        };
        let (admin, acks) = round_under_load(&mut daemon, admin, &regions, &mut rng);
        model = admin.model;
        total_ops += admin.done.len();
        total_acks += acks;
        eprintln!(
            "seed {seed} round {round}: {acks} region writes and {} admin operations acknowledged \
             (last: {:?}); in flight at SIGKILL: {:?}",
            admin.done.len(),
            admin.done.last(),
            admin.lost
        );
        daemon.restart();
        verify(
            &daemon,
            &mut model,
            &regions,
            &format!("seed {seed} round {round}"),
        );
        eprintln!(
            "seed {seed} round {round}: verified {MAIN} ({} snapshot(s)) and {} other volume(s) \
             ({} snapshot(s)), scrub clean",
            model.main_snaps.len(),
            model.others.len(),
            model.others.values().map(|o| o.snaps.len()).sum::<usize>()
        );
        assert!(
            started.elapsed() < TEST_BUDGET,
            "seed {seed}: crash test over budget after round {round}"
        );
    }
    // A clean shutdown keeps everything too.
    daemon.terminate();
    daemon.restart();
    verify(
        &daemon,
        &mut model,
        &regions,
        &format!("seed {seed} after a clean restart"),
    );
    eprintln!(
        "seed {seed}: {ROUNDS} crashes, {total_acks} region writes and {total_ops} admin operations \
         verified in {:?}",
        started.elapsed()
    );
}
