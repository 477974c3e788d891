//! A disk group that runs out of space, against a reference model of every volume, snapshot and
//! clone: over-committed volumes on small devices written until NoSpace, trims and
//! write-zeroes of the full group (which the log's reserve must take, and which the destager
//! applies to the capacity index ahead of destage, or gives room back for by rotating the
//! log), snapshots, clones, rollbacks, deletes, the write bypass, and power cuts at any
//! moment, the destager's early zeros and the log's rotation included.
//! Seeds are printed; `STRATA_TEST_SEED=<n>` replays one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::map::Loc;
use crate::tests::{
    fill_until_no_space, live_count_drift, seed_for, small_cfg, write_when_space, Rig, MIB,
};
use crate::tests_snap::{check_all, pick, Model};
use crate::*;

const FAST_BYTES: u64 = 16 * MIB;
const VOL_BYTES: usize = 8 * MIB as usize;
const MAX_VOLUMES: usize = 5;
/// How long space freed by a trim or a delete may take to come back.
const SPACE_BACK_WAIT: Duration = Duration::from_secs(30);

/// Free log blocks trims may still take (beyond rotation's reserve).
fn trim_room(dg: &DiskGroup) -> u64 {
    let log = dg.sh.log.lock();
    log.host_free_blocks()
        .saturating_sub(log.rotation_reserve_blocks)
}

/// Pieces of a request the engine applies each as a whole or not at all, as byte ranges of
/// the volume: a request refused with NoSpace leaves each piece old or new (one log record
/// each; a batch is refused whole).
type Pieces = Vec<(usize, usize)>;

struct FullRun {
    seed: u64,
    rng: StdRng,
    rig: Rig,
    m: Model,
    names: u32,
    /// Volumes whose policy sends long sequential writes past the log.
    bypass: BTreeMap<String, bool>,
    no_space: u64,
    full_trims: u64,
    /// Power cuts while the destager had a trim of a full group to apply.
    cuts_after_full_trim: u64,
    /// Whether the last data write was refused (the group is full).
    full: bool,
    /// Tail batches the log's rotation freed, over every opening of the group.
    rotated_batches: u64,
    /// Power cuts armed while a rotation group was under way.
    cuts_during_rotation: u64,
}

/// Byte ranges of the log records a write of `len` bytes at `off` becomes: one per
/// `record_blocks` blocks from its first block (partial blocks at either end included).
fn record_pieces(off: usize, len: usize, record_blocks: usize) -> Pieces {
    let (b0, b1) = (off / 4096, (off + len).div_ceil(4096));
    (b0..b1)
        .step_by(record_blocks)
        .map(|b| {
            let s = (b * 4096).max(off);
            let e = ((b + record_blocks) * 4096).min(off + len);
            (s, e)
        })
        .collect()
}

impl FullRun {
    fn new(seed: u64) -> FullRun {
        let caps: &[u64] = if seed.is_multiple_of(2) {
            &[24 * MIB]
        } else {
            &[12 * MIB, 12 * MIB]
        };
        let rig = Rig::new(FAST_BYTES, caps, small_cfg(), seed);
        let mut run = FullRun {
            seed,
            rng: StdRng::seed_from_u64(seed),
            rig,
            m: Model::default(),
            names: 0,
            bypass: BTreeMap::new(),
            no_space: 0,
            full_trims: 0,
            cuts_after_full_trim: 0,
            full: false,
            rotated_batches: 0,
            cuts_during_rotation: 0,
        };
        for _ in 0..3 {
            run.create_volume("setup");
        }
        run
    }

    fn dg(&self) -> &DiskGroup {
        self.rig.dg()
    }

    /// Adds what this opening of the group rotated to the run's count (before it ends: the
    /// counters are the opening's).
    fn count_rotation(&mut self) {
        let c = &self.dg().sh.counters;
        self.rotated_batches += c.rotated_batches.load(Ordering::Relaxed);
    }

    fn id(&self, view: &str) -> VolumeId {
        self.dg()
            .view(view)
            .unwrap_or_else(|| panic!("seed {}: view {view} is missing", self.seed))
            .id
    }

    fn record_blocks(&self) -> usize {
        self.dg().max_record_blocks() as usize
    }

    fn step(&mut self, what: &str) {
        let op = self.rng.gen_range(0..100);
        if std::env::var("STRATA_TEST_TRACE").is_ok() {
            eprintln!("{what}: op {op}");
        }
        match op {
            0..=27 => self.write(what),
            28..=33 => self.fill(what),
            34..=45 => self.zero(what),
            46..=48 => self.stream(what),
            49..=51 => self.set_bypass(what),
            52..=57 => self.snapshot(what),
            58..=61 => self.clone_snapshot(what),
            62..=65 => self.delete_snapshot(what),
            66..=68 => self.delete_volume(what),
            69..=70 => self.create_volume(what),
            71..=73 => self.rollback(what),
            74..=78 => self.wait_for_destager(),
            79..=82 => self.power_cut(what),
            83..=84 => self.cut_after_full_trim(what),
            85..=86 => self.cut_during_rotation(what),
            87..=88 => self.clean_restart(what),
            89..=91 => self.space_back(what),
            _ => self.check_all(what),
        }
    }

    fn random_len(&mut self) -> usize {
        match self.rng.gen_range(0..4) {
            0 => self.rng.gen_range(1..700),
            1 => 4096 * self.rng.gen_range(1..8),
            2 => self.rng.gen_range(1..100_000),
            _ => self.rng.gen_range(1..1_200_000),
        }
    }

    fn random_off(&mut self, len: usize) -> usize {
        match self.rng.gen_range(0..3) {
            0 => self.rng.gen_range(0..=VOL_BYTES - len),
            1 => self.rng.gen_range(0..=(VOL_BYTES - len) / 512) * 512,
            _ => self.rng.gen_range(0..=(VOL_BYTES - len) / 4096) * 4096,
        }
    }

    /// A write of any size and alignment to a random volume.
    fn write(&mut self, what: &str) {
        let Some(name) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        let len = self.random_len();
        let off = self.random_off(len);
        let byte: u8 = self.rng.gen();
        let data: Vec<u8> = (0..len)
            .map(|i| byte.wrapping_add((i / 512) as u8) | 1)
            .collect();
        self.write_at(&name, off, &data, what);
    }

    /// Writes and updates the model; returns whether the write was taken.
    fn write_at(&mut self, name: &str, off: usize, data: &[u8], what: &str) -> bool {
        let id = self.id(name);
        match self.dg().write(id, off as u64, data) {
            Ok(()) => {
                self.full = false;
                let image = self.m.volumes.get_mut(name).expect("model");
                image[off..off + data.len()].copy_from_slice(data);
                self.check_range(name, off, data.len(), what);
                true
            }
            Err(EngineError::NoSpace) => {
                self.no_space += 1;
                self.full = true;
                let pieces = self.write_pieces(name, off, data.len());
                self.refused(name, off, data, &pieces, &format!("{what}: refused write"));
                false
            }
            Err(e) => panic!("{what}: write {name} {off}+{}: {e}", data.len()),
        }
    }

    /// The pieces a write may be applied in: its log records (`record_blocks` each from its
    /// first block), or, where it may go past the log, the write bypass's jobs (a segment's
    /// worth each, and a job the destager could not place is one log record): each piece
    /// lies within one of either.
    fn write_pieces(&self, name: &str, off: usize, len: usize) -> Pieces {
        let whole = off.is_multiple_of(4096) && len.is_multiple_of(4096);
        let records = self.record_blocks();
        if whole && len / 4096 <= records {
            return vec![(off, off + len)];
        }
        let mut ends: Vec<usize> = record_pieces(off, len, records)
            .into_iter()
            .map(|p| p.1)
            .collect();
        if whole && self.bypass.get(name).copied().unwrap_or(false) {
            let data_blocks = self.dg().sh.layout.geo.data_blocks as usize;
            let job = data_blocks.min(crate::MAX_RECORD_BLOCKS as usize);
            ends.extend(record_pieces(off, len, job).into_iter().map(|p| p.1));
        }
        ends.sort_unstable();
        ends.dedup();
        let starts = std::iter::once(off).chain(ends.iter().copied());
        starts.zip(ends.iter().copied()).collect()
    }

    /// After a request refused with NoSpace: each piece reads as before or as requested (then
    /// the model takes it).
    fn refused(&mut self, name: &str, off: usize, data: &[u8], pieces: &Pieces, what: &str) {
        let id = self.id(name);
        let mut buf = vec![0u8; data.len()];
        self.dg()
            .read(id, off as u64, &mut buf)
            .unwrap_or_else(|e| panic!("{what}: read back: {e}"));
        let image = self.m.volumes.get_mut(name).expect("model");
        for &(s, e) in pieces {
            let got = &buf[s - off..e - off];
            let (old, new) = (&image[s..e], &data[s - off..e - off]);
            if got != old && got != new {
                let kinds: Vec<char> = (0..got.len().div_ceil(4096))
                    .map(|b| {
                        let r = b * 4096..((b + 1) * 4096).min(got.len());
                        match (got[r.clone()] == old[r.clone()], got[r.clone()] == new[r]) {
                            (true, true) => '=',
                            (true, false) => 'o',
                            (false, true) => 'n',
                            _ => 'x',
                        }
                    })
                    .collect();
                panic!(
                    "{what}: {name} bytes {s}..{e} are neither as before nor as written \
                     (per block: {})",
                    kinds.iter().collect::<String>()
                );
            }
            image[s..e].copy_from_slice(got);
        }
    }

    /// Sequential 1 MiB writes to the volumes, one after the other, until NoSpace (or their
    /// ends: the volumes and snapshots may hold less than the tiers).
    fn fill(&mut self, what: &str) {
        let names: Vec<String> = self.m.volumes.keys().cloned().collect();
        let byte: u8 = self.rng.gen::<u8>() | 1;
        let chunk = MIB as usize;
        for name in names {
            for k in 0..VOL_BYTES / chunk {
                let data = vec![byte.wrapping_add(2 * k as u8); chunk];
                if !self.write_at(&name, k * chunk, &data, what) {
                    return;
                }
            }
        }
    }

    /// A long sequential stream of large whole-block writes: past a volume's cutoff, they
    /// go straight to the capacity tier.
    fn stream(&mut self, what: &str) {
        let Some(name) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        let chunk = 4096 * self.rng.gen_range(32..128usize);
        let n = self.rng.gen_range(3..8usize).min(VOL_BYTES / chunk);
        let start = self.rng.gen_range(0..=(VOL_BYTES - chunk * n) / 4096) * 4096;
        let byte: u8 = self.rng.gen::<u8>() | 1;
        for k in 0..n {
            let data = vec![byte.wrapping_add(k as u8); chunk];
            if !self.write_at(&name, start + k * chunk, &data, what) {
                return;
            }
        }
    }

    /// A trim or write-zeroes: of whole blocks it must be taken even when the group is full.
    fn zero(&mut self, what: &str) {
        let Some(name) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        let aligned = self.rng.gen_bool(0.7);
        let len = if aligned {
            4096 * self.rng.gen_range(1..=VOL_BYTES / 4096)
        } else {
            self.random_len()
        };
        let off = if aligned {
            self.rng.gen_range(0..=(VOL_BYTES - len) / 4096) * 4096
        } else {
            self.random_off(len)
        };
        self.zero_at(&name, off, len, what);
    }

    fn zero_at(&mut self, name: &str, off: usize, len: usize, what: &str) {
        let id = self.id(name);
        let was_full = self.full;
        let r = if self.rng.gen_bool(0.5) {
            self.dg().discard(id, off as u64, len as u64)
        } else {
            self.dg().write_zeroes(id, off as u64, len as u64)
        };
        let whole = off.is_multiple_of(4096) && len.is_multiple_of(4096);
        match r {
            Ok(()) => {
                self.m.volumes.get_mut(name).expect("model")[off..off + len].fill(0);
                self.full_trims += u64::from(was_full && whole);
                self.check_range(name, off, len, what);
            }
            Err(EngineError::NoSpace) if !whole => {
                self.no_space += 1;
                let pieces = self.zero_pieces(off, len);
                self.refused(name, off, &vec![0; len], &pieces, what);
            }
            Err(e) => panic!(
                "{what}: zero {name} {off}+{len} (whole blocks: {whole}, full: {was_full}): \
                 {e}: {}: {:?}",
                self.rotation_state(),
                self.dg().stats()
            ),
        }
    }

    /// A zeroing request is its partial edge blocks (data writes) and the zero record of the
    /// whole blocks between.
    fn zero_pieces(&self, off: usize, len: usize) -> Pieces {
        let (end, full0, full1) = (
            off + len,
            off.div_ceil(4096) * 4096,
            (off + len) / 4096 * 4096,
        );
        if full0 >= full1 {
            return record_pieces(off, len, self.record_blocks());
        }
        let mut out = vec![(full0, full1)];
        out.extend((off < full0).then_some((off, full0)));
        out.extend((end > full1).then_some((full1, end)));
        out
    }

    fn set_bypass(&mut self, what: &str) {
        let Some(name) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        let on = self.rng.gen_bool(0.6);
        let policy = Policy {
            sequential_write_cutoff_bytes: if on { 256 * 1024 } else { 0 },
            ..Policy::default()
        };
        self.dg()
            .set_policy(&name, &policy)
            .unwrap_or_else(|e| panic!("{what}: set policy of {name}: {e}"));
        self.bypass.insert(name, on);
    }

    fn create_volume(&mut self, what: &str) {
        if self.m.volumes.len() >= MAX_VOLUMES {
            return;
        }
        self.names += 1;
        let name = format!("v{}", self.names);
        self.dg()
            .create_volume(&name, VOL_BYTES as u64)
            .unwrap_or_else(|e| panic!("{what}: create {name}: {e}"));
        self.m.volumes.insert(name, vec![0; VOL_BYTES]);
    }

    fn snapshot(&mut self, what: &str) {
        let Some(vol) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        self.names += 1;
        let snap = format!("s{}", self.names);
        self.m.snapshot(self.rig.dg(), &vol, &snap, what);
    }

    /// A clone of a snapshot, with a write on it.
    fn clone_snapshot(&mut self, what: &str) {
        if self.m.volumes.len() >= MAX_VOLUMES {
            return;
        }
        let Some(full) = pick(&mut self.rng, self.m.snapshots.keys()) else {
            return;
        };
        self.names += 1;
        let clone = format!("c{}", self.names);
        self.m.clone_snapshot(self.rig.dg(), &full, &clone, what);
        let len = self.random_len();
        let off = self.random_off(len);
        let data = vec![self.rng.gen::<u8>() | 1; len];
        self.write_at(&clone, off, &data, what);
    }

    fn delete_snapshot(&mut self, what: &str) {
        let Some(full) = pick(&mut self.rng, self.m.snapshots.keys()) else {
            return;
        };
        self.m.delete_snapshot(self.rig.dg(), &full, what);
        self.check_all(what);
    }

    fn delete_volume(&mut self, what: &str) {
        let Some(vol) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        self.m.delete_volume(self.rig.dg(), &vol, what);
        self.bypass.remove(&vol);
        self.check_all(what);
    }

    fn rollback(&mut self, what: &str) {
        let Some(full) = pick(&mut self.rng, self.m.snapshots.keys()) else {
            return;
        };
        self.m.rollback(self.rig.dg(), &full, what);
        self.check_all(what);
    }

    /// Lets the destager work: a drain (which a full group may not finish) or the release
    /// of deleted layers, each bounded.
    fn wait_for_destager(&mut self) {
        if self.rng.gen_bool(0.5) {
            self.dg().destage_all(Duration::from_secs(1));
        } else {
            self.dg().settle(Duration::from_secs(1));
        }
    }

    fn power_cut(&mut self, what: &str) {
        self.count_rotation();
        self.rig.power_cut_and_restart();
        self.check_all(&format!("{what}: after a power cut"));
    }

    /// Trims whole blocks of a full group, then lets the power fail a few device writes later,
    /// while the destager applies the trim ahead of destage (or frees what it released).
    fn cut_after_full_trim(&mut self, what: &str) {
        if !self.full {
            self.fill(what);
        }
        let Some(name) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        let len = 4096 * self.rng.gen_range(1..=VOL_BYTES / 4096);
        let off = self.rng.gen_range(0..=(VOL_BYTES - len) / 4096) * 4096;
        self.zero_at(&name, off, len, what);
        let writes: i64 = self.rng.gen_range(0..60);
        self.rig.writes_left.store(writes, Ordering::SeqCst);
        self.dg().sh.wake_destager();
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.rig.power_is_off() && Instant::now() < deadline {
            self.dg().sh.wake_destager();
            std::thread::sleep(Duration::from_millis(2));
        }
        self.cuts_after_full_trim += 1;
        self.count_rotation();
        self.rig.power_cut_and_restart();
        self.check_all(&format!(
            "{what}: after a power cut {writes} writes after a trim"
        ));
    }

    /// Trims single blocks whose only copy is in the log (data written since the capacity tier
    /// filled) with the destager held, until trims have no log block left: the blocks they
    /// made dead lie behind a tail the capacity tier cannot take, and only the log's rotation
    /// gives room back (docs/FORMAT.md §4.7). The power then fails a few device writes after
    /// a batch is retired while a rotation group is under way: the group's new copies written
    /// or not, the checkpoint naming the new tail not written, or torn. (With no rotation to
    /// make, the power fails once the destager has looked.)
    fn cut_during_rotation(&mut self, what: &str) {
        let sh = self.rig.group().sh.clone();
        if !self.full || !sh.counters.capacity_full.load(Ordering::SeqCst) {
            self.fill(what);
        }
        // The volume with the most data only in the log.
        let names: Vec<String> = self.m.volumes.keys().cloned().collect();
        let Some((mut blocks, name)) = names
            .into_iter()
            .map(|n| (self.log_only_blocks(&n), n))
            .max_by_key(|(b, _)| b.len())
        else {
            return;
        };
        // Held only while the capacity tier takes nothing (else host batches would wait for
        // the destager to make room).
        sh.hold_destager();
        while sh.counters.capacity_full.load(Ordering::SeqCst)
            && trim_room(self.dg()) > 0
            && !blocks.is_empty()
        {
            let b = blocks.swap_remove(self.rng.gen_range(0..blocks.len()));
            self.zero_at(&name, b as usize * 4096, 4096, what);
        }
        let armed = Arc::new(AtomicBool::new(false));
        let (armed_in, writes_left) = (armed.clone(), self.rig.writes_left.clone());
        let weak = Arc::downgrade(&sh);
        let writes = self.rng.gen_range(0..4);
        // Half the time the destager stops for a while after queueing the group's first
        // rewrite, as on a busy machine: the log writer may take a rotation batch before the
        // rest is queued (a header more than planned).
        let pause = self.rng.gen_bool(0.5).then(|| Duration::from_millis(40));
        *sh.rotation_queue_pause.lock() = pause;
        *sh.before_apply.lock() = Some(Arc::new(move |_first| {
            let Some(sh) = weak.upgrade() else { return };
            let rotating = sh.log.lock().rotation_outstanding_blocks > 0;
            if rotating && !armed_in.swap(true, Ordering::SeqCst) {
                writes_left.store(writes, Ordering::SeqCst);
            }
        }));
        let c = &sh.counters;
        let plans = c.rotation_plans.load(Ordering::SeqCst);
        sh.destager_held.store(false, Ordering::SeqCst);
        sh.wake_destager();
        // Until the cut, or until the destager has looked twice and has no rotation to make.
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.rig.power_is_off() && Instant::now() < deadline {
            let idle = c.rotation_plans.load(Ordering::SeqCst) >= plans + 2
                && c.rotation_goal_blocks.load(Ordering::SeqCst) == 0
                && !armed.load(Ordering::SeqCst);
            if idle {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.cuts_during_rotation += u64::from(armed.load(Ordering::SeqCst));
        self.count_rotation();
        drop(sh);
        self.rig.power_cut_and_restart();
        self.check_all(&format!(
            "{what}: after a power cut {writes} writes after a batch during rotation"
        ));
    }

    /// The log's rotation as it is now, for failure messages.
    fn rotation_state(&self) -> String {
        let c = &self.dg().sh.counters;
        let log = self.dg().sh.log.lock();
        format!(
            "{} batches rotated, {} plans, goal {} blocks; {} free, {} outstanding, reserve {}",
            c.rotated_batches.load(Ordering::Relaxed),
            c.rotation_plans.load(Ordering::Relaxed),
            c.rotation_goal_blocks.load(Ordering::Relaxed),
            log.free_blocks(),
            log.rotation_outstanding_blocks,
            log.rotation_reserve_blocks
        )
    }

    /// Blocks of a volume's head whose only copy is in the log.
    fn log_only_blocks(&self, name: &str) -> Vec<u64> {
        let id = self.id(name);
        let idx = self.dg().sh.index.read();
        let head = idx.volumes[&id].head;
        let mut out = Vec::new();
        for (lba, len, loc) in idx.layers[&head].fast.iter() {
            if matches!(loc, Loc::Fast(_)) {
                out.extend(lba..lba + len);
            }
        }
        out
    }

    /// A clean shutdown, where the destager has stopped: every sealed segment's live count
    /// matches the blocks the index points at in it. Then a restart.
    fn clean_restart(&mut self, what: &str) {
        self.count_rotation();
        let dg = self.rig.dg.take().expect("running");
        dg.shutdown()
            .unwrap_or_else(|e| panic!("{what}: shutdown: {e}"));
        let drift = live_count_drift(&dg, 0..u32::MAX);
        assert!(
            drift.is_empty(),
            "{what}: live counts (segment, counted, referenced) {drift:?}"
        );
        drop(dg);
        self.rig
            .start()
            .unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
        self.check_all(&format!("{what}: after a clean restart"));
    }

    /// Deletes every snapshot and trims every volume and clone whole: a full group must take
    /// writes again within a bounded wait. (Clones used to be deleted too: a deleted snapshot
    /// that clones still read through kept its blocks, even where every layer reading through
    /// it had trimmed them.)
    fn space_back(&mut self, what: &str) {
        for full in std::mem::take(&mut self.m.snapshots).into_keys() {
            let (vol, snap) = full.split_once('@').expect("vol@snap");
            self.dg()
                .delete_snapshot(vol, snap)
                .unwrap_or_else(|e| panic!("{what}: delete {full}: {e}"));
        }
        let names: Vec<String> = self.m.volumes.keys().cloned().collect();
        for name in &names {
            self.zero_at(name, 0, VOL_BYTES, what);
        }
        let Some(name) = names.first() else {
            return;
        };
        let data = vec![0x5b; 256 * 1024];
        let id = self.id(name);
        write_when_space(self.dg(), id, 0, &data, SPACE_BACK_WAIT).unwrap_or_else(|e| {
            panic!(
                "{what}: a write with every view trimmed: {e}: {:?}",
                self.dg().stats()
            )
        });
        self.full = false;
        self.m.volumes.get_mut(name).expect("model")[..data.len()].copy_from_slice(&data);
        self.check_all(&format!("{what}: after space came back"));
    }

    fn check_range(&self, name: &str, off: usize, len: usize, what: &str) {
        let mut buf = vec![0u8; len];
        self.dg()
            .read(self.id(name), off as u64, &mut buf)
            .unwrap_or_else(|e| panic!("{what}: read {name}: {e}"));
        let image = &self.m.volumes[name][off..off + len];
        if let Some(i) = (0..len).find(|&i| buf[i] != image[i]) {
            panic!(
                "{what}: {name} byte {} is {:#x}, expected {:#x}",
                off + i,
                buf[i],
                image[i]
            );
        }
    }

    fn check_all(&self, what: &str) {
        check_all(self.dg(), &self.m, what);
    }

    /// Deletes everything; once the destager has settled, the capacity tier uses what an
    /// empty group uses.
    fn finish(mut self, empty_used_bytes: u64) {
        let what = format!("seed {}: final", self.seed);
        self.check_all(&what);
        self.clean_restart(&what);
        for vol in std::mem::take(&mut self.m.volumes).into_keys() {
            self.dg()
                .delete_volume(&vol, true)
                .unwrap_or_else(|e| panic!("{what}: delete {vol}: {e}"));
        }
        self.m.snapshots.clear();
        assert!(
            self.dg().settle(Duration::from_secs(30)),
            "{what}: deleted layers never released"
        );
        assert!(
            self.dg().destage_all(Duration::from_secs(30)),
            "{what}: the log never drained: {:?}",
            self.dg().stats()
        );
        self.clean_restart(&what);
        let st = self.dg().stats();
        assert_eq!(st.capacity_live_bytes, 0, "{what}: {st:?}");
        assert_eq!(st.fast_resident_bytes, 0, "{what}: {st:?}");
        assert_eq!(
            st.capacity_used_bytes, empty_used_bytes,
            "{what}: capacity used with everything deleted: {st:?}"
        );
        assert_eq!(
            st.checksum_errors_total, 0,
            "{what}: checksum errors without faults"
        );
    }
}

/// Tries, from a run's middle on, at a power cut during rotation while the run has had none.
const FORCED_CUTS_MAX: usize = 8;

/// What a run did, for the assertions that it covered what it is for.
#[derive(Default)]
struct Figures {
    no_space: u64,
    full_trims: u64,
    cuts_after_full_trim: u64,
    rotated_batches: u64,
    cuts_during_rotation: u64,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.no_space += o.no_space;
        self.full_trims += o.full_trims;
        self.cuts_after_full_trim += o.cuts_after_full_trim;
        self.rotated_batches += o.rotated_batches;
        self.cuts_during_rotation += o.cuts_during_rotation;
    }
}

fn full_run(seed: u64, steps: usize) -> Figures {
    let mut run = FullRun::new(seed);
    let empty_used_bytes = {
        run.clean_restart("empty");
        run.dg().stats().capacity_used_bytes
    };
    let trace = std::env::var("STRATA_TEST_TRACE").is_ok();
    let mut forced = 0;
    for step in 0..steps {
        let what = format!("seed {seed} step {step}");
        let started = Instant::now();
        if step >= steps / 2 && run.cuts_during_rotation == 0 && forced < FORCED_CUTS_MAX {
            // At least once a run, whatever the seed (the group may have no rotation to make).
            forced += 1;
            run.cut_during_rotation(&what);
        }
        run.step(&what);
        if trace {
            let st = run.dg().stats();
            eprintln!(
                "{what}: {:?}: fill {:.2} free segments {} full {}",
                started.elapsed(),
                st.log_fill_ratio,
                st.segments_free,
                run.full
            );
        }
    }
    let rotated_now = run.dg().sh.counters.rotated_batches.load(Ordering::Relaxed);
    let figures = Figures {
        no_space: run.no_space,
        full_trims: run.full_trims,
        cuts_after_full_trim: run.cuts_after_full_trim,
        rotated_batches: run.rotated_batches + rotated_now,
        cuts_during_rotation: run.cuts_during_rotation,
    };
    run.finish(empty_used_bytes);
    figures
}

#[test]
fn model_full_group_trims_snapshots_deletes_and_power_cuts() {
    let seed = seed_for("model_full_group_trims_snapshots_deletes_and_power_cuts");
    let mut all = Figures::default();
    for i in 0..3 {
        all.add(&full_run(seed.wrapping_add(i), 120));
    }
    eprintln!(
        "NoSpace {}, trims of a full group {}, cuts after one {}, batches rotated {}, cuts \
         during rotation {}",
        all.no_space,
        all.full_trims,
        all.cuts_after_full_trim,
        all.rotated_batches,
        all.cuts_during_rotation
    );
    assert!(all.no_space > 0, "seed {seed}: the group never filled");
    assert!(all.full_trims > 0, "seed {seed}: no trim of a full group");
    assert!(
        all.rotated_batches > 0,
        "seed {seed}: the log was never rotated"
    );
    assert!(
        all.cuts_during_rotation > 0,
        "seed {seed}: no power cut during a rotation"
    );
}

/// A full group whose volume had a snapshot: the snapshot deleted and the volume trimmed
/// whole, writes succeed again. (The deleted snapshot's layer waited to be merged into the
/// volume until its data in the log was destaged, which needed a free segment: with the
/// capacity tier full of that layer's older blocks, nothing was ever freed, although the
/// volume's trim hid every block of it.)
#[test]
fn a_trim_after_deleting_a_snapshot_of_a_full_group_gives_space_back() {
    let seed = seed_for("a_trim_after_deleting_a_snapshot_of_a_full_group_gives_space_back");
    let mut rig = Rig::new(FAST_BYTES, &[24 * MIB], small_cfg(), seed);
    let v = rig.dg().create_volume("v", 64 * MIB).unwrap().id;
    let written = fill_until_no_space(rig.dg(), v, 64);
    rig.dg().create_snapshot("v", "s").unwrap();
    rig.dg().delete_snapshot("v", "s").unwrap();
    rig.dg()
        .discard(v, 0, 64 * MIB)
        .expect("a trim of a full volume");
    let data = vec![0x5b; MIB as usize];
    write_when_space(rig.dg(), v, 0, &data, SPACE_BACK_WAIT).unwrap_or_else(|e| {
        panic!(
            "a write after the trim ({written} MiB were written): {e}: {:?}",
            rig.dg().stats()
        )
    });
    rig.power_cut_and_restart();
    let mut b = vec![0u8; MIB as usize];
    for i in 0..written {
        rig.dg().read(v, i * MIB, &mut b).unwrap();
        let want = if i == 0 { 0x5b } else { 0 };
        assert!(b.iter().all(|&x| x == want), "MiB {i} is not {want:#x}");
    }
}
