//! A deleted snapshot that clones were made from: the blocks of its layer that every volume
//! and clone reading through it has overwritten or trimmed come back (hidden.rs), with the
//! capacity tier full or not, and what some reader still sees stays. Then a model of volumes,
//! snapshots, clones of clones, rollbacks and deletes with power cuts while the destager
//! releases such blocks. Seeds are printed; `STRATA_TEST_SEED=<n>` replays one.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::ctree::page::{key_of, split_key};
use crate::map::Loc;
use crate::tests::{live_count_drift, seed_for, small_cfg, write_when_space, Rig, MIB};
use crate::tests_full_gaps::full_group;
use crate::tests_snap::{check_all, pick, Model};
use crate::*;

/// How long released blocks may take to come back.
const SPACE_BACK_WAIT: Duration = Duration::from_secs(10);

fn id(dg: &DiskGroup, view: &str) -> VolumeId {
    dg.view(view)
        .unwrap_or_else(|| panic!("view {view} is missing"))
        .id
}

/// Quarters of a volume of `4 * q` bytes.
struct Quarters {
    q: usize,
}

impl Quarters {
    /// Writes `byte` over quarter `i` of volume `name`, and into the model.
    fn write(&self, dg: &DiskGroup, m: &mut Model, name: &str, i: usize, byte: u8) {
        let data = vec![byte; self.q];
        dg.write(id(dg, name), (i * self.q) as u64, &data)
            .unwrap_or_else(|e| panic!("a write of {name}: {e}"));
        m.volumes.get_mut(name).expect("model")[i * self.q..(i + 1) * self.q]
            .copy_from_slice(&data);
    }

    /// Trims (or zeroes) quarter `i` of volume `name`.
    fn zero(&self, dg: &DiskGroup, m: &mut Model, name: &str, i: usize, trim: bool) {
        let (v, at, len) = (id(dg, name), (i * self.q) as u64, self.q as u64);
        let r = match trim {
            true => dg.discard(v, at, len),
            false => dg.write_zeroes(v, at, len),
        };
        r.unwrap_or_else(|e| panic!("a trim of {name}: {e}"));
        m.volumes.get_mut(name).expect("model")[i * self.q..(i + 1) * self.q].fill(0);
    }
}

/// Waits until the capacity tier holds `want` bytes of data, the log destaged.
fn wait_for_capacity_live(dg: &DiskGroup, want: u64, what: &str) {
    let deadline = Instant::now() + SPACE_BACK_WAIT;
    loop {
        assert!(
            dg.destage_all(SPACE_BACK_WAIT),
            "{what}: the log did not drain"
        );
        let live = dg.stats().capacity_live_bytes;
        if live == want {
            return;
        }
        assert!(
            live > want && Instant::now() < deadline,
            "{what}: the capacity tier holds {live} bytes of data, not {want}: {:?}",
            dg.stats()
        );
        dg.sh.wake_destager();
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Exclusive and shared bytes of a view, both tiers together.
fn space_of(dg: &DiskGroup, view: &str) -> (u64, u64) {
    let s = dg.space(id(dg, view)).unwrap();
    (
        s.exclusive_fast_bytes + s.exclusive_capacity_bytes,
        s.shared_fast_bytes + s.shared_capacity_bytes,
    )
}

/// A volume of four quarters, a snapshot, two clones of it; the volume and the clones
/// overwrite or trim quarters so that quarters 0 and 2 are hidden by all three, 1 by two of
/// them and 3 by none; then the snapshot is deleted. With `destaged`, the snapshot's data is
/// on the capacity tier when it is deleted, else (the destager held meanwhile) in the log.
fn clones_over_a_deleted_snapshot(seed: u64, destaged: bool) {
    let what = format!("seed {seed}, destaged {destaged}");
    let mut rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), seed);
    let qs = Quarters {
        q: match destaged {
            true => 2 * MIB as usize,
            false => MIB as usize,
        },
    };
    let q = qs.q as u64;
    let mut m = Model::default();
    let dg = rig.group().clone();
    dg.create_volume("v", 4 * q).unwrap();
    m.volumes.insert("v".into(), vec![0; 4 * qs.q]);
    if !destaged {
        dg.sh.hold_destager();
    }
    for i in 0..4 {
        qs.write(&dg, &mut m, "v", i, 0x11 + i as u8);
    }
    if destaged {
        assert!(dg.destage_all(SPACE_BACK_WAIT), "{what}: destage");
    }
    dg.create_snapshot("v", "s").unwrap();
    for c in ["c1", "c2"] {
        dg.clone_snapshot("v", "s", c).unwrap();
        m.volumes.insert(c.into(), m.volumes["v"].clone());
    }
    qs.write(&dg, &mut m, "v", 0, 0x21);
    qs.write(&dg, &mut m, "v", 1, 0x22);
    qs.zero(&dg, &mut m, "v", 2, true);
    qs.write(&dg, &mut m, "c1", 0, 0x31);
    qs.zero(&dg, &mut m, "c1", 1, true);
    qs.zero(&dg, &mut m, "c1", 2, false);
    qs.write(&dg, &mut m, "c2", 0, 0x41);
    qs.write(&dg, &mut m, "c2", 2, 0x43);
    // The volume's data: quarters 0 and 1; c1's: 0; c2's: 0 and 2; the snapshot's: all four.
    if destaged {
        wait_for_capacity_live(&dg, 9 * q, &format!("{what}: before the delete"));
    }
    let views = ["v", "c1", "c2"];
    let space_before: Vec<_> = views.iter().map(|v| space_of(&dg, v)).collect();
    assert_eq!(space_before[2], (2 * q, 2 * q), "{what}: c2's space");
    dg.delete_snapshot("v", "s").unwrap();
    dg.sh.destager_held.store(false, Ordering::Relaxed);
    // The snapshot's quarters 0 and 2 come back; 1 (c2 reads it) and 3 (all do) stay.
    wait_for_capacity_live(&dg, 7 * q, &format!("{what}: after the delete"));
    check_all(&dg, &m, &what);
    let space_after: Vec<_> = views.iter().map(|v| space_of(&dg, v)).collect();
    assert_eq!(space_after, space_before, "{what}: space reported");
    assert_eq!(
        live_count_drift(&dg, 0..u32::MAX),
        vec![],
        "{what}: live counts"
    );
    drop(dg);
    rig.power_cut_and_restart();
    check_all(rig.dg(), &m, &format!("{what}: after a power cut"));
    wait_for_capacity_live(rig.dg(), 7 * q, &format!("{what}: after a power cut"));
    check_all(
        rig.dg(),
        &m,
        &format!("{what}: after a power cut, released again"),
    );
}

#[test]
fn blocks_every_clone_hides_come_back_after_the_snapshot_is_deleted() {
    let seed = seed_for("blocks_every_clone_hides_come_back_after_the_snapshot_is_deleted");
    clones_over_a_deleted_snapshot(seed, true);
    clones_over_a_deleted_snapshot(seed.wrapping_add(1), false);
}

/// Clones of a clone: `c1` and `c3` (a clone of a snapshot of `c1`, since deleted) both
/// overwrite quarter 0, which `c1` did not hold when that snapshot was taken; so do the
/// volume and `c2`, and the volume's snapshot is deleted. Quarter 1, which `c1` wrote before
/// its snapshot and `c1` and `c3` both overwrite, comes back. The volume's snapshot's
/// quarter 0 stays while a snapshot of `c2` taken before `c2` overwrote it reads it, and comes
/// back once that snapshot is deleted: no reader reaches it any more, as the deleted
/// snapshot of `c1` hides it through its own children. A power cut loses nothing.
#[test]
fn what_the_clones_of_a_clone_hide_comes_back() {
    let seed = seed_for("what_the_clones_of_a_clone_hide_comes_back");
    let mut rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), seed);
    let qs = Quarters { q: MIB as usize };
    let q = qs.q as u64;
    let mut m = Model::default();
    let dg = rig.group().clone();
    dg.create_volume("v", 4 * q).unwrap();
    m.volumes.insert("v".into(), vec![0; 4 * qs.q]);
    for i in 0..4 {
        qs.write(&dg, &mut m, "v", i, 0x11 + i as u8);
    }
    dg.create_snapshot("v", "s").unwrap();
    for c in ["c1", "c2"] {
        dg.clone_snapshot("v", "s", c).unwrap();
        m.volumes.insert(c.into(), m.volumes["v"].clone());
    }
    qs.write(&dg, &mut m, "c1", 1, 0x31);
    dg.create_snapshot("c1", "t").unwrap();
    dg.clone_snapshot("c1", "t", "c3").unwrap();
    m.volumes.insert("c3".into(), m.volumes["c1"].clone());
    dg.create_snapshot("c2", "u").unwrap();
    m.snapshots.insert("c2@u".into(), m.volumes["c2"].clone());
    qs.write(&dg, &mut m, "c1", 0, 0x32);
    qs.write(&dg, &mut m, "c1", 1, 0x33);
    qs.write(&dg, &mut m, "c3", 0, 0x34);
    qs.write(&dg, &mut m, "c3", 1, 0x35);
    qs.write(&dg, &mut m, "v", 0, 0x21);
    qs.write(&dg, &mut m, "c2", 0, 0x41);
    // The snapshots' 4 + 1 quarters, c1's and c3's 2 each, the volume's and c2's 1 each.
    let what = format!("seed {seed}");
    wait_for_capacity_live(&dg, 11 * q, &format!("{what}: before the deletes"));
    dg.delete_snapshot("c1", "t").unwrap();
    dg.delete_snapshot("v", "s").unwrap();
    wait_for_capacity_live(&dg, 10 * q, &format!("{what}: c2@u still reads quarter 0"));
    check_all(&dg, &m, &what);
    dg.delete_snapshot("c2", "u").unwrap();
    m.snapshots.remove("c2@u");
    wait_for_capacity_live(&dg, 9 * q, &format!("{what}: c2@u deleted"));
    check_all(&dg, &m, &what);
    drop(dg);
    rig.power_cut_and_restart();
    check_all(rig.dg(), &m, &format!("{what}: after a power cut"));
    wait_for_capacity_live(rig.dg(), 9 * q, &format!("{what}: after a power cut"));
    check_all(
        rig.dg(),
        &m,
        &format!("{what}: after a power cut, released again"),
    );
}

/// With both tiers full, a snapshot and two clones of it; the volume and both clones trim
/// the first quarter of what was written, the volume and one clone the second; the snapshot
/// is deleted. Writes of half the first quarter must then succeed (the snapshot's blocks
/// under it come back), the other clone still reads the second quarter, and a power cut
/// loses nothing. (The layer kept every block while two or more layers read through it.)
#[test]
fn a_full_group_gets_back_what_every_clone_trimmed() {
    let seed = seed_for("a_full_group_gets_back_what_every_clone_trimmed");
    let (mut rig, _, blocks, written) = full_group(seed, 64);
    let dg = rig.group().clone();
    let mut m = Model::default();
    let image = blocks.iter().flat_map(|&b| [b; 4096]).collect();
    m.volumes.insert("v".into(), image);
    dg.create_snapshot("v", "s").unwrap();
    for c in ["c1", "c2"] {
        dg.clone_snapshot("v", "s", c).unwrap();
        m.volumes.insert(c.into(), m.volumes["v"].clone());
    }
    let quarter = (written / 4) as usize * MIB as usize;
    for (name, upto) in [("v", 2), ("c1", 2), ("c2", 1)] {
        dg.discard(id(&dg, name), 0, (upto * quarter) as u64)
            .unwrap_or_else(|e| panic!("a trim of {name} of a full group: {e}"));
        m.volumes.get_mut(name).expect("model")[..upto * quarter].fill(0);
    }
    dg.delete_snapshot("v", "s").unwrap();
    let v = id(&dg, "v");
    for i in 0..quarter / 2 / MIB as usize {
        let data = vec![0x5b; MIB as usize];
        let at = i * MIB as usize;
        write_when_space(&dg, v, at as u64, &data, SPACE_BACK_WAIT).unwrap_or_else(|e| {
            panic!(
                "seed {seed}: a write of MiB {i} after trimming {} of {written} MiB: {e}: {:?}",
                quarter / MIB as usize,
                dg.stats()
            )
        });
        m.volumes.get_mut("v").expect("model")[at..at + MIB as usize].copy_from_slice(&data);
    }
    check_all(&dg, &m, &format!("seed {seed}"));
    drop(dg);
    rig.power_cut_and_restart();
    check_all(rig.dg(), &m, &format!("seed {seed}: after a power cut"));
}

const VOL_BYTES: usize = 2 * MIB as usize;
const MAX_VOLUMES: usize = 6;
const MAX_SNAPSHOTS: usize = 10;

/// Blocks of deleted snapshots' layers that no reader reaches, still held (in the log or on
/// the capacity tier): what the destager has yet to release.
fn hidden_blocks_left(dg: &DiskGroup) -> u64 {
    let sh = &dg.sh;
    let (fam, forks) = {
        let idx = sh.index.read();
        let fam = crate::hidden::Family::of(&idx);
        let forks = crate::hidden::forks(&idx, &fam);
        (fam, forks)
    };
    let mut left = 0;
    for (layer, _, _) in forks {
        let mut runs: Vec<(u64, u64)> = sh.index.read().layers[&layer]
            .fast
            .iter()
            .map(|(lba, len, _)| (lba, len))
            .collect();
        let ents = crate::meta::with_tree_read(sh, |t| {
            let mut v = Vec::new();
            t.lookup(key_of(layer, 0), key_of(layer + 1, 0), &mut v)
                .map(|()| v)
        })
        .unwrap();
        runs.extend(
            ents.iter()
                .filter(|e| matches!(e.loc, Loc::Cap { .. }))
                .map(|e| (split_key(e.key).1, e.len)),
        );
        for (lba, len) in runs {
            let parts = crate::meta::with_index_tree(sh, |idx, t| {
                crate::hidden::hidden_below(idx, t, &fam, layer, lba, len)
            })
            .unwrap();
            left += parts.iter().map(|p| p.1).sum::<u64>();
        }
    }
    left
}

struct CloneRun {
    seed: u64,
    rng: StdRng,
    rig: Rig,
    m: Model,
    names: u32,
    /// Snapshots clones were made from.
    cloned: BTreeSet<String>,
    /// Snapshots deleted while clones of them were left.
    forks_made: u32,
    cuts_in_background: u32,
}

impl CloneRun {
    fn new(seed: u64) -> CloneRun {
        let rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), seed);
        let mut run = CloneRun {
            seed,
            rng: StdRng::seed_from_u64(seed),
            rig,
            m: Model::default(),
            names: 0,
            cloned: BTreeSet::new(),
            forks_made: 0,
            cuts_in_background: 0,
        };
        run.rig.dg().create_volume("v0", VOL_BYTES as u64).unwrap();
        run.m.volumes.insert("v0".into(), vec![0; VOL_BYTES]);
        run
    }

    fn dg(&self) -> &DiskGroup {
        self.rig.dg()
    }

    fn step(&mut self, what: &str) {
        match self.rng.gen_range(0..100) {
            0..=34 => self.write(what),
            35..=44 => self.snapshot(what),
            45..=53 => self.clone_snapshot(what),
            54..=61 => self.delete_snapshot(what),
            62..=65 => self.rollback(what),
            66..=68 => self.delete_volume(what),
            69..=73 => {
                self.dg().destage_all(Duration::from_secs(20));
            }
            74..=79 => self.let_the_destager_work(),
            80..=83 => {
                self.rig.power_cut_and_restart();
                check_all(self.dg(), &self.m, &format!("{what}: after a power cut"));
            }
            84..=91 => self.cut_in_background(what),
            92..=93 => {
                self.rig.clean_restart();
                check_all(self.dg(), &self.m, &format!("{what}: after a restart"));
            }
            _ => check_all(self.dg(), &self.m, what),
        }
    }

    /// A write, write-zeroes or trim of any size and alignment to a random volume.
    fn write(&mut self, what: &str) {
        let Some(name) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        let v = id(self.rig.dg(), &name);
        let len = match self.rng.gen_range(0..3) {
            0 => self.rng.gen_range(1..700),
            1 => 4096 * self.rng.gen_range(1..64),
            _ => self.rng.gen_range(1..400_000),
        };
        let off = match self.rng.gen_bool(0.5) {
            true => self.rng.gen_range(0..=(VOL_BYTES - len) / 4096) * 4096,
            false => self.rng.gen_range(0..=VOL_BYTES - len),
        };
        let kind = self.rng.gen_range(0..10);
        let byte: u8 = self.rng.gen();
        let dg = self.rig.dg();
        let image = self.m.volumes.get_mut(&name).expect("model");
        match kind {
            0 => {
                dg.discard(v, off as u64, len as u64)
                    .unwrap_or_else(|e| panic!("{what}: trim: {e}"));
                image[off..off + len].fill(0);
            }
            1 => {
                dg.write_zeroes(v, off as u64, len as u64)
                    .unwrap_or_else(|e| panic!("{what}: zero: {e}"));
                image[off..off + len].fill(0);
            }
            _ => {
                let data: Vec<u8> = (0..len)
                    .map(|i| byte.wrapping_add((i / 512) as u8) | 1)
                    .collect();
                dg.write(v, off as u64, &data)
                    .unwrap_or_else(|e| panic!("{what}: write: {e}"));
                image[off..off + len].copy_from_slice(&data);
            }
        }
    }

    fn snapshot(&mut self, what: &str) {
        if self.m.snapshots.len() >= MAX_SNAPSHOTS {
            return;
        }
        let Some(vol) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        self.names += 1;
        let snap = format!("s{}", self.names);
        self.m.snapshot(self.rig.dg(), &vol, &snap, what);
    }

    /// A clone of any snapshot, of a clone's too.
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
        self.cloned.insert(full);
    }

    /// Mostly a snapshot clones were made from.
    fn delete_snapshot(&mut self, what: &str) {
        let cloned: Vec<String> = self
            .m
            .snapshots
            .keys()
            .filter(|s| self.cloned.contains(*s))
            .cloned()
            .collect();
        let full = match !cloned.is_empty() && self.rng.gen_bool(0.7) {
            true => cloned[self.rng.gen_range(0..cloned.len())].clone(),
            false => match pick(&mut self.rng, self.m.snapshots.keys()) {
                Some(s) => s,
                None => return,
            },
        };
        self.m.delete_snapshot(self.rig.dg(), &full, what);
        if self.cloned.remove(&full) {
            self.forks_made += 1;
        }
    }

    fn rollback(&mut self, what: &str) {
        let Some(full) = pick(&mut self.rng, self.m.snapshots.keys()) else {
            return;
        };
        self.m.rollback(self.rig.dg(), &full, what);
    }

    /// A volume with its snapshots (clones of them stay).
    fn delete_volume(&mut self, what: &str) {
        if self.m.volumes.len() < 2 {
            return;
        }
        let Some(vol) = pick(&mut self.rng, self.m.volumes.keys()) else {
            return;
        };
        self.m.delete_volume(self.rig.dg(), &vol, what);
        let prefix = format!("{vol}@");
        self.cloned.retain(|k| !k.starts_with(&prefix));
    }

    fn let_the_destager_work(&mut self) {
        let ms = self.rng.gen_range(5..60);
        let until = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < until {
            self.dg().sh.wake_destager();
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The power fails a few device writes into whatever the destager does next (releasing
    /// blocks, flushing the index, merging, destaging, GC), or after a while of nothing; half
    /// the time the log is being drained meanwhile.
    fn cut_in_background(&mut self, what: &str) {
        let writes: i64 = self.rng.gen_range(0..80);
        self.rig.writes_left.store(writes, Ordering::SeqCst);
        if self.rng.gen_bool(0.5) {
            self.dg().sh.drain.store(true, Ordering::Relaxed);
        }
        let deadline = Instant::now() + Duration::from_millis(50);
        while !self.rig.power_is_off() && Instant::now() < deadline {
            self.dg().sh.wake_destager();
            std::thread::sleep(Duration::from_millis(2));
        }
        self.cuts_in_background += 1;
        self.rig.power_cut_and_restart();
        check_all(
            self.dg(),
            &self.m,
            &format!("{what}: after a power cut {writes} writes into background work"),
        );
    }

    /// Every view as the model says, and, within a bounded wait, nothing left that every
    /// child of a deleted snapshot's layer hides.
    fn finish(&mut self) {
        let what = format!("seed {}: final", self.seed);
        check_all(self.dg(), &self.m, &what);
        let deadline = Instant::now() + SPACE_BACK_WAIT;
        loop {
            let left = hidden_blocks_left(self.dg());
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {left} blocks every reader hides were not released"
            );
            self.dg().sh.wake_destager();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            self.dg().destage_all(Duration::from_secs(20)),
            "{what}: destage"
        );
        assert!(self.dg().settle(Duration::from_secs(20)), "{what}: settle");
        assert_eq!(live_count_drift(self.dg(), 0..u32::MAX), vec![], "{what}");
        self.rig.power_cut_and_restart();
        check_all(self.dg(), &self.m, &format!("{what}: after a power cut"));
        assert_eq!(self.dg().stats().checksum_errors_total, 0, "{what}");
    }
}

fn clone_run(seed: u64, steps: usize) -> (u32, u32) {
    let mut run = CloneRun::new(seed);
    for step in 0..steps {
        run.step(&format!("seed {seed} step {step}"));
    }
    run.finish();
    (run.forks_made, run.cuts_in_background)
}

#[test]
fn model_clones_of_deleted_snapshots_with_power_cuts() {
    let seed = seed_for("model_clones_of_deleted_snapshots_with_power_cuts");
    let (mut forks, mut cuts) = (0, 0);
    for i in 0..4 {
        let (f, c) = clone_run(seed.wrapping_add(i), 150);
        forks += f;
        cuts += c;
    }
    eprintln!("{forks} snapshots deleted with clones left, {cuts} power cuts in background work");
    assert!(forks > 0, "no snapshot was deleted with clones left");
}
