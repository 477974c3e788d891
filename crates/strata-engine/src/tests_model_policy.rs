//! Tiering policies changed at random while data moves, against a reference image of every
//! view: writes of every size and alignment, checked reads (many of them over a few hot
//! regions, so reads served by the capacity tier promote), write-zeroes and discards on two
//! volumes and a clone; between steps each volume's policy changes (mode, tier age and heat,
//! promotion evidence, cutoffs, limits), some changes refused, and the injected clock moves
//! so tier-mode data ages. Drains, power cuts and clean restarts are each followed by a check
//! of every byte of every view and of every volume's policy. Seeds are printed;
//! `STRATA_TEST_SEED=<n>` replays one.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::tests::{check_volume, read_either, seed_for, small_cfg, Rig, MIB};
use crate::*;

const RUNS: u64 = 5;
const STEPS_PER_RUN: usize = 200;
/// The smallest fast tier the engine takes, and a capacity tier small enough that the runs'
/// overwrites make garbage collection clean segments.
const FAST_BYTES: u64 = 16 * MIB;
const CAPACITY_BYTES: u64 = 24 * MIB;
const VOL_BYTES: usize = 4 * MIB as usize;
/// One promotion region (`policy::PROMOTE_REGION_BLOCKS` blocks).
const REGION_BYTES: usize = 64 * 1024;
const HOT_REGIONS_PER_VOLUME: usize = 6;
/// Far above what a run does in a second of its injected clock, so a request never waits for
/// a limit (the clock stands still between steps): the limits are there to be stored.
const IOPS_LIMIT_HIGH: u64 = 1_000_000;
const BANDWIDTH_LIMIT_HIGH_BYTES_PER_S: u64 = 64 << 30;
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// A volume as the model has it.
struct ModelVolume {
    name: String,
    id: VolumeId,
    image: Vec<u8>,
    policy: Policy,
    /// Offsets of the 64 KiB regions this volume reads again and again.
    hot: Vec<usize>,
}

/// One field of a policy change, as an admin would name it in a partial update.
#[derive(Debug, Clone, Copy)]
enum Edit {
    Mode(Mode),
    TierMinAge(u64),
    TierMaxColdHeat(u8),
    PromoteAfterReads(u32),
    PromoteWindow(u64),
    PromoteSequentialCutoff(u64),
    Limits(u64, u64),
    WriteCutoff(u64),
}

impl Edit {
    fn apply(self, p: &mut Policy) {
        match self {
            Edit::Mode(m) => p.mode = m,
            Edit::TierMinAge(s) => p.tier_min_age_s = s,
            Edit::TierMaxColdHeat(h) => p.tier_max_cold_heat = h,
            Edit::PromoteAfterReads(n) => p.promote_after_reads = n,
            Edit::PromoteWindow(s) => p.promote_window_s = s,
            Edit::PromoteSequentialCutoff(b) => p.promote_sequential_cutoff_bytes = b,
            Edit::Limits(iops, bw) => (p.iops_limit, p.bandwidth_limit_bytes_per_s) = (iops, bw),
            Edit::WriteCutoff(b) => p.sequential_write_cutoff_bytes = b,
        }
    }

    fn random(rng: &mut StdRng) -> Edit {
        let pick = |rng: &mut StdRng, xs: &[u64]| xs[rng.gen_range(0..xs.len())];
        match rng.gen_range(0..9) {
            0 | 1 => Edit::Mode(if rng.gen_bool(0.5) {
                Mode::Cache
            } else {
                Mode::Tier
            }),
            2 => Edit::TierMinAge(pick(rng, &[0, 10, 60, 600])),
            3 => Edit::TierMaxColdHeat(rng.gen_range(0..4)),
            4 => Edit::PromoteAfterReads(rng.gen_range(1..=3)),
            // Sometimes 0, which `Policy::validate` refuses while promotion is on.
            5 => Edit::PromoteWindow(pick(rng, &[0, 30, 300, 3600])),
            6 => Edit::PromoteSequentialCutoff(pick(rng, &[256 * 1024, 4 << 20])),
            7 => Edit::Limits(
                pick(rng, &[0, IOPS_LIMIT_HIGH]),
                pick(rng, &[0, BANDWIDTH_LIMIT_HIGH_BYTES_PER_S]),
            ),
            _ => Edit::WriteCutoff(pick(rng, &[0, 256 * 1024, 1 << 20])),
        }
    }
}

/// `base` with `edits` applied, refused as the admin API refuses it (`PolicyPatch::
/// apply_checked`): a write cutoff above 0 named for a volume that would be in tier mode.
fn apply_edits(edits: &[Edit], base: &Policy) -> Result<Policy, EngineError> {
    let mut p = *base;
    for e in edits {
        e.apply(&mut p);
    }
    let cutoff_named = edits
        .iter()
        .any(|e| matches!(e, Edit::WriteCutoff(b) if *b > 0));
    if cutoff_named && p.mode == Mode::Tier {
        return Err(EngineError::InvalidArgument(
            "policy: a write cutoff in tier mode".into(),
        ));
    }
    Ok(p)
}

/// What a run did, over all its openings of the group.
#[derive(Debug, Default, Clone, Copy)]
struct RunFigures {
    promoted_bytes: u64,
    destaged_bytes: u64,
    gc_segments_cleaned: u64,
}

/// What a change of `edits` to `base` must do: the policy it sets, or a refusal.
fn expected_change(edits: &[Edit], base: &Policy) -> Result<Policy, EngineError> {
    apply_edits(edits, base).and_then(|p| p.validate().map(|()| p))
}

struct PolicyRun {
    seed: u64,
    rng: StdRng,
    rig: Rig,
    clock: Arc<ManualClock>,
    vols: Vec<ModelVolume>,
    /// The snapshot's view name ("vol@snap") and image, once taken.
    snapshot: Option<(String, Vec<u8>)>,
    /// Counts of the group's earlier openings (its stats start again at each).
    before: RunFigures,
    refused_changes: u64,
    /// Changes that failed for the power cut made during them.
    cut_changes: u64,
    restarts: u64,
}

impl PolicyRun {
    fn new(seed: u64) -> PolicyRun {
        let clock = Arc::new(ManualClock::default());
        let cfg = EngineConfig {
            read_cache_ratio: 0.25,
            clock: clock.clone(),
            ..small_cfg()
        };
        let rig = Rig::new(FAST_BYTES, &[CAPACITY_BYTES], cfg, seed);
        let mut run = PolicyRun {
            seed,
            rng: StdRng::seed_from_u64(seed),
            rig,
            clock,
            vols: Vec::new(),
            snapshot: None,
            before: RunFigures::default(),
            refused_changes: 0,
            cut_changes: 0,
            restarts: 0,
        };
        for (name, mode) in [("a", Mode::Cache), ("b", Mode::Tier)] {
            let policy = Policy {
                mode,
                tier_min_age_s: 60,
                ..Policy::default()
            };
            let info = run
                .rig
                .dg()
                .create_volume_with_policy(name, VOL_BYTES as u64, &policy)
                .unwrap_or_else(|e| panic!("seed {seed}: create {name}: {e}"));
            let hot = run.hot_regions();
            run.vols.push(ModelVolume {
                name: name.into(),
                id: info.id,
                image: vec![0; VOL_BYTES],
                policy,
                hot,
            });
        }
        run
    }

    fn hot_regions(&mut self) -> Vec<usize> {
        let regions = VOL_BYTES / REGION_BYTES;
        (0..HOT_REGIONS_PER_VOLUME)
            .map(|_| self.rng.gen_range(0..regions) * REGION_BYTES)
            .collect()
    }

    fn dg(&self) -> &DiskGroup {
        self.rig.dg()
    }

    fn step(&mut self, what: &str) {
        match self.rng.gen_range(0..100) {
            0..=33 => self.write(what),
            34..=37 => self.stream(what),
            38..=55 => self.read_hot(what),
            56..=60 => self.read_anywhere(what),
            61..=66 => self.zero_or_discard(what),
            67..=76 => self.change_policy(what),
            77..=78 => self.change_policy_under_a_power_cut(what),
            79..=86 => self.advance_clock(),
            87..=90 => self.drain(what),
            91..=94 => self.power_cut(what),
            95..=97 => self.clean_restart(what),
            _ => self.snapshot_and_clone(what),
        }
    }

    fn pick_volume(&mut self) -> usize {
        self.rng.gen_range(0..self.vols.len())
    }

    fn write(&mut self, what: &str) {
        let i = self.pick_volume();
        let len = match self.rng.gen_range(0..4) {
            0 => self.rng.gen_range(1..600),
            1 => 4096 * self.rng.gen_range(1..4),
            2 => self.rng.gen_range(1..70_000),
            _ => self.rng.gen_range(1..600_000),
        };
        // A third of the writes land on a hot region: its data is rewritten (heat) as well
        // as read.
        let off = if self.rng.gen_bool(0.33) {
            let hot = &self.vols[i].hot;
            let at = hot[self.rng.gen_range(0..hot.len())];
            at.min(VOL_BYTES - len)
        } else if self.rng.gen_bool(0.5) {
            self.rng.gen_range(0..VOL_BYTES - len)
        } else {
            self.rng.gen_range(0..(VOL_BYTES - len) / 512) * 512
        };
        let byte: u8 = self.rng.gen();
        let data: Vec<u8> = (0..len)
            .map(|k| byte.wrapping_add((k / 512) as u8))
            .collect();
        self.write_at(i, off, &data, what);
    }

    fn write_at(&mut self, i: usize, off: usize, data: &[u8], what: &str) {
        let v = &mut self.vols[i];
        if let Err(e) = self.rig.dg().write(v.id, off as u64, data) {
            panic!(
                "{what}: write {}+{} to {}: {e}: {:?}",
                off,
                data.len(),
                v.name,
                self.rig.dg().stats()
            );
        }
        v.image[off..off + data.len()].copy_from_slice(data);
    }

    /// Large sequential block-aligned writes: past a cache-mode volume's write cutoff they
    /// go straight to the capacity tier.
    fn stream(&mut self, what: &str) {
        let i = self.pick_volume();
        let chunk = 4096 * self.rng.gen_range(32..96usize);
        let n = self.rng.gen_range(2..6usize);
        let start = self.rng.gen_range(0..(VOL_BYTES - chunk * n) / 4096) * 4096;
        let byte: u8 = self.rng.gen();
        for k in 0..n {
            let data: Vec<u8> = (0..chunk)
                .map(|b| byte.wrapping_add(((k * chunk + b) / 4096) as u8))
                .collect();
            self.write_at(i, start + k * chunk, &data, what);
        }
    }

    /// Reads of one hot region, once to three times in a row, each checked.
    fn read_hot(&mut self, what: &str) {
        let i = self.pick_volume();
        let region = self.vols[i].hot[self.rng.gen_range(0..HOT_REGIONS_PER_VOLUME)];
        let len = self.rng.gen_range(1..=REGION_BYTES);
        let off = region + self.rng.gen_range(0..=REGION_BYTES - len);
        for _ in 0..self.rng.gen_range(1..=3) {
            self.read_checked(i, off, len, what);
        }
    }

    fn read_anywhere(&mut self, what: &str) {
        let i = self.pick_volume();
        let len = self.rng.gen_range(1..300_000);
        let off = self.rng.gen_range(0..VOL_BYTES - len);
        self.read_checked(i, off, len, what);
    }

    /// A read through `read_async` when it takes it (small reads), else the blocking way.
    fn read_checked(&mut self, i: usize, off: usize, len: usize, what: &str) {
        let v = &self.vols[i];
        let try_async = len < 9_000 && self.rng.gen_bool(0.5);
        let mut taken = 0;
        let got = read_either(
            self.rig.group(),
            v.id,
            off as u64,
            len,
            try_async,
            &mut taken,
        )
        .unwrap_or_else(|e| panic!("{what}: read {}+{len} of {}: {e}", off, v.name));
        if let Some(k) = (0..len).find(|&k| got[k] != v.image[off + k]) {
            panic!(
                "{what}: read {off}+{len} of {}: byte {} is {:#x}, expected {:#x}",
                v.name,
                off + k,
                got[k],
                v.image[off + k]
            );
        }
    }

    fn zero_or_discard(&mut self, what: &str) {
        let i = self.pick_volume();
        let len = self.rng.gen_range(1..1_000_000);
        let off = self.rng.gen_range(0..VOL_BYTES - len);
        let v = &mut self.vols[i];
        let dg = self.rig.dg();
        let r = if self.rng.gen_bool(0.5) {
            dg.write_zeroes(v.id, off as u64, len as u64)
        } else {
            dg.discard(v.id, off as u64, len as u64)
        };
        r.unwrap_or_else(|e| panic!("{what}: zero/discard {off}+{len} of {}: {e}", v.name));
        v.image[off..off + len].fill(0);
    }

    /// A partial policy change of one to three fields; one the engine (or the admin API's
    /// check) refuses must leave the policy as it was.
    fn change_policy(&mut self, what: &str) {
        let i = self.pick_volume();
        let edits = self.random_edits();
        let v = &mut self.vols[i];
        let expected = expected_change(&edits, &v.policy);
        let model = v.policy;
        let r = self.rig.dg().update_policy(&v.name, |current| {
            assert_eq!(
                *current, model,
                "{what}: the policy {} had before {edits:?}",
                v.name
            );
            apply_edits(&edits, current)
        });
        match (r, expected) {
            (Ok(set), Ok(want)) => {
                assert_eq!(set, want, "{what}: {edits:?} on {}", v.name);
                v.policy = want;
            }
            (Err(EngineError::InvalidArgument(_)), Err(_)) => self.refused_changes += 1,
            (r, want) => panic!("{what}: {edits:?} on {}: {r:?}, expected {want:?}", v.name),
        }
        self.check_policies(what);
    }

    fn random_edits(&mut self) -> Vec<Edit> {
        (0..self.rng.gen_range(1..=3))
            .map(|_| Edit::random(&mut self.rng))
            .collect()
    }

    /// A policy change with the power going off at one of the next few device writes (the
    /// change's checkpoint, or the destager's writes meanwhile), then a restart: a change
    /// acknowledged is kept, one that failed left the old policy or the new one, never
    /// anything else.
    fn change_policy_under_a_power_cut(&mut self, what: &str) {
        let i = self.pick_volume();
        let edits = self.random_edits();
        let (name, old) = (self.vols[i].name.clone(), self.vols[i].policy);
        let expected = expected_change(&edits, &old);
        self.note_openings_figures();
        let writes_left = self.rng.gen_range(0..4);
        self.rig.writes_left.store(writes_left, Ordering::SeqCst);
        let r = self
            .rig
            .dg()
            .update_policy(&name, |current| apply_edits(&edits, current));
        self.rig.power_cut();
        self.rig
            .start()
            .unwrap_or_else(|e| panic!("{what}: open after a power cut: {e}"));
        self.restarts += 1;
        let after = self
            .dg()
            .policy(&name)
            .unwrap_or_else(|e| panic!("{what}: policy of {name}: {e}"));
        let what = format!("{what}: {edits:?} on {name}, power off after {writes_left} writes");
        match (r, expected) {
            (Ok(set), Ok(want)) => {
                assert_eq!(set, want, "{what}");
                assert_eq!(after, want, "{what}: an acknowledged change was lost");
            }
            (Err(_), Ok(want)) => {
                assert!(
                    after == old || after == want,
                    "{what}: failed, and the policy became {after:?}"
                );
                self.cut_changes += 1;
            }
            (Err(_), Err(_)) => assert_eq!(after, old, "{what}: refused, yet changed"),
            (Ok(set), Err(e)) => panic!("{what}: set {set:?}, expected {e}"),
        }
        self.vols[i].policy = after;
        self.check_all(&format!("{what}: after the power cut"));
    }

    fn advance_clock(&mut self) {
        let ms = match self.rng.gen_range(0..4) {
            0 => self.rng.gen_range(1..5_000),
            1 | 2 => self.rng.gen_range(5_000..90_000),
            _ => self.rng.gen_range(90_000..700_000),
        };
        self.clock.advance_ms(ms);
    }

    fn drain(&mut self, what: &str) {
        assert!(
            self.dg().destage_all(DRAIN_TIMEOUT),
            "{what}: the log did not empty: {:?}",
            self.dg().stats()
        );
        self.check_all(&format!("{what}: after a drain"));
    }

    fn power_cut(&mut self, what: &str) {
        self.note_openings_figures();
        self.rig.power_cut_and_restart();
        self.restarts += 1;
        self.check_all(&format!("{what}: after a power cut"));
    }

    fn clean_restart(&mut self, what: &str) {
        self.note_openings_figures();
        self.rig.clean_restart();
        self.restarts += 1;
        self.check_all(&format!("{what}: after a clean restart"));
    }

    fn note_openings_figures(&mut self) {
        let st = self.dg().stats();
        self.before.promoted_bytes += st.promoted_bytes_total;
        self.before.destaged_bytes += st.destaged_bytes_total;
        self.before.gc_segments_cleaned += st.gc_segments_cleaned_total;
    }

    /// Once a run: a snapshot of a volume and a clone of it, which starts with its origin's
    /// policy.
    fn snapshot_and_clone(&mut self, what: &str) {
        if self.snapshot.is_some() {
            return;
        }
        let i = self.pick_volume();
        let origin = &self.vols[i];
        let dg = self.rig.dg();
        dg.create_snapshot(&origin.name, "s")
            .unwrap_or_else(|e| panic!("{what}: snapshot of {}: {e}", origin.name));
        let info = dg
            .clone_snapshot(&origin.name, "s", "k")
            .unwrap_or_else(|e| panic!("{what}: clone of {}@s: {e}", origin.name));
        self.snapshot = Some((format!("{}@s", origin.name), origin.image.clone()));
        let clone = ModelVolume {
            name: "k".into(),
            id: info.id,
            image: origin.image.clone(),
            policy: origin.policy,
            hot: origin.hot.clone(),
        };
        self.vols.push(clone);
        self.check_policies(what);
    }

    /// Every volume's policy as the engine applies it and as its volume record stores it.
    fn check_policies(&self, what: &str) {
        let dg = self.dg();
        for v in &self.vols {
            let applied = dg
                .policy(&v.name)
                .unwrap_or_else(|e| panic!("{what}: policy of {}: {e}", v.name));
            assert_eq!(
                applied, v.policy,
                "{what}: the policy {} works under",
                v.name
            );
            let stored = dg.sh.index.read().volumes[&v.id].policy.clone();
            let stored = Policy::decode(&stored)
                .unwrap_or_else(|e| panic!("{what}: stored policy of {}: {e}", v.name));
            assert_eq!(stored, v.policy, "{what}: the policy {} stores", v.name);
        }
    }

    fn check_all(&self, what: &str) {
        let dg = self.dg();
        for v in &self.vols {
            check_volume(dg, v.id, &v.image, &format!("{what}: volume {}", v.name));
        }
        if let Some((name, image)) = &self.snapshot {
            let view = dg
                .view(name)
                .unwrap_or_else(|| panic!("{what}: snapshot {name} is missing"));
            check_volume(dg, view.id, image, &format!("{what}: snapshot {name}"));
        }
        self.check_policies(what);
    }

    /// Ends the run: everything checked, no checksum error; returns what the run's openings
    /// did.
    fn finish(mut self) -> RunFigures {
        let what = format!("seed {}: final", self.seed);
        self.check_all(&what);
        self.drain(&what);
        self.clean_restart(&what);
        let st = self.dg().stats();
        assert_eq!(
            st.checksum_errors_total, 0,
            "{what}: checksum errors without faults"
        );
        if std::env::var("STRATA_TEST_TRACE").is_ok() {
            eprintln!(
                "{what}: {:?}, {} changes refused, {} cut, {} restarts",
                self.before, self.refused_changes, self.cut_changes, self.restarts
            );
        }
        self.before
    }
}

fn policy_run(seed: u64, steps: usize) -> RunFigures {
    let mut run = PolicyRun::new(seed);
    let mut max_fill = 0.0f64;
    for step in 0..steps {
        let what = format!("seed {seed} step {step}");
        if std::env::var("STRATA_TEST_TRACE").is_ok() {
            let st = run.dg().stats();
            max_fill = max_fill.max(st.log_fill_ratio);
            eprintln!(
                "{what}: fill {:.2} destaged {} gc {}",
                st.log_fill_ratio, st.destaged_bytes_total, st.gc_segments_cleaned_total
            );
        }
        run.step(&what);
    }
    if std::env::var("STRATA_TEST_TRACE").is_ok() {
        eprintln!("seed {seed}: highest log fill seen {max_fill:.2}");
    }
    run.finish()
}

#[test]
fn model_policy_changes_with_promotions_and_power_cuts() {
    let seed = seed_for("model_policy_changes_with_promotions_and_power_cuts");
    let mut gc_segments_cleaned = 0;
    for i in 0..RUNS {
        let run_seed = seed.wrapping_add(i);
        let did = policy_run(run_seed, STEPS_PER_RUN);
        assert!(
            did.promoted_bytes > 0 && did.destaged_bytes > 0,
            "seed {run_seed}: nothing was promoted or nothing destaged: {did:?}"
        );
        gc_segments_cleaned += did.gc_segments_cleaned;
    }
    assert!(
        gc_segments_cleaned > 0,
        "seed {seed}: no run cleaned a segment"
    );
}
