//! An open stopped partway (`DiskGroup::open_with`, `OpenControl::abandon`): stopped during
//! the replay of a long log after a power cut, it writes nothing, and the next open recovers
//! every acknowledged write, however many opens were stopped before it. Stopped before it
//! begins, it does not format blank devices.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_device::{Device, MemDevice};

use crate::format::BLOCK;
use crate::tests::{check_volume, seed_for, small_cfg, Rig, MIB};
use crate::*;

const VOL_BYTES: usize = 8 << 20;

/// Bytes written to each device of the rig so far, the fast device first.
fn bytes_written(rig: &Rig) -> Vec<u64> {
    std::iter::once(&rig.fast)
        .chain(&rig.caps)
        .map(|d| d.stats().write_bytes)
        .collect()
}

/// A block-aligned range of the volume to write or zero.
fn some_range(rng: &mut StdRng) -> std::ops::Range<usize> {
    let n = rng.gen_range(1..=48usize);
    let at = rng.gen_range(0..=VOL_BYTES / BLOCK - n);
    at * BLOCK..(at + n) * BLOCK
}

/// Writes (and now and then zeroes) `range`; returns what the volume holds there if it succeeds.
fn change(
    dg: &DiskGroup,
    v: VolumeId,
    range: &std::ops::Range<usize>,
    rng: &mut StdRng,
) -> (Vec<u8>, Result<(), EngineError>) {
    if rng.gen_ratio(1, 10) {
        let done = dg.write_zeroes(v, range.start as u64, range.len() as u64);
        return (vec![0; range.len()], done);
    }
    let fill: u8 = rng.gen();
    let data: Vec<u8> = range
        .clone()
        .map(|i| fill.wrapping_add((i / BLOCK) as u8))
        .collect();
    let done = dg.write(v, range.start as u64, &data);
    (data, done)
}

/// Acknowledged changes, one after the other, into the volume and the model.
fn churn(dg: &DiskGroup, v: VolumeId, model: &mut [u8], rng: &mut StdRng, ops: usize) {
    for _ in 0..ops {
        let range = some_range(rng);
        let (data, done) = change(dg, v, &range, rng);
        done.expect("a change before the power cut");
        model[range].copy_from_slice(&data);
    }
}

/// A log of a few hundred batches (the destager kept idle by its marks) over data already on
/// the capacity tier, and a power cut in the middle of a write. Each open but the last is
/// stopped after a random number of batches replayed, in the probe past the log's end, or
/// before it begins; none writes a byte, and the last open then recovers every acknowledged
/// write. Seeded (`STRATA_TEST_SEED`).
#[test]
fn an_open_stopped_during_replay_writes_nothing_and_the_next_loses_nothing() {
    let seed = seed_for("an_open_stopped_during_replay_writes_nothing_and_the_next_loses_nothing");
    let mut rng = StdRng::seed_from_u64(seed);
    let cfg = EngineConfig {
        fill_ratio_low: 0.9,
        fill_ratio_high: 0.95,
        ..small_cfg()
    };
    let mut rig = Rig::new(64 * MIB, &[32 * MIB], cfg, seed);
    let dg = rig.group().clone();
    let v = dg.create_volume("v", VOL_BYTES as u64).unwrap().id;
    let mut model = vec![0u8; VOL_BYTES];
    churn(&dg, v, &mut model, &mut rng, 100);
    assert!(
        dg.destage_all(Duration::from_secs(30)),
        "seed {seed}: destage"
    );
    let ops = 300;
    churn(&dg, v, &mut model, &mut rng, ops);
    // The power goes off a few device writes into the next changes: the one that fails was
    // never acknowledged, and each of its blocks may read as before or as written.
    rig.writes_left.store(rng.gen_range(0..4), Ordering::SeqCst);
    let mut torn = None;
    for _ in 0..1000 {
        let range = some_range(&mut rng);
        let (data, done) = change(&dg, v, &range, &mut rng);
        if done.is_err() {
            torn = Some((range, data));
            break;
        }
        model[range].copy_from_slice(&data);
    }
    let (torn_range, torn_data) = torn.expect("the power went off");
    drop(dg);
    rig.power_cut();

    let mut stops = Vec::new();
    for round in 0..rng.gen_range(2..6) {
        let mut ctl = OpenControl::default();
        let stop = match rng.gen_range(0..10) {
            0..=1 => Stop::Before,
            2..=3 => Stop::AtProbe,
            _ => Stop::AfterBatches(rng.gen_range(1..=ops * 9 / 10)),
        };
        if stop == Stop::Before {
            ctl.abandon.store(true, Ordering::Relaxed);
        }
        let seen = watch(&mut ctl, stop);
        let before = bytes_written(&rig);
        let what = format!("seed {seed} round {round} (stopped {stop:?})");
        match rig.start_with(&ctl) {
            Err(EngineError::Cancelled(_)) => {}
            Err(e) => panic!("{what}: {e}"),
            Ok(()) => panic!("{what}: the open was not stopped"),
        }
        assert_eq!(
            bytes_written(&rig),
            before,
            "{what}: the stopped open wrote"
        );
        let seen = *seen.lock();
        let progress = &ctl.progress;
        assert_eq!(progress.log_replayed_bytes(), seen.bytes, "{what}");
        let (step, batches) = match stop {
            Stop::Before => (OpenStep::Reading, 0),
            Stop::AfterBatches(n) => (OpenStep::Replaying, n),
            _ => (OpenStep::CheckingEnd, seen.batches),
        };
        assert_eq!((progress.step(), seen.batches), (step, batches), "{what}");
        assert_eq!(seen.probed, stop == Stop::AtProbe, "{what}");
        assert!(seen.bytes <= progress.log_area_bytes(), "{what}: {seen:?}");
        stops.push((stop, seen.batches));
    }

    let mut ctl = OpenControl::default();
    let seen = watch(&mut ctl, Stop::Never);
    rig.start_with(&ctl)
        .unwrap_or_else(|e| panic!("seed {seed}: the open after the stopped ones: {e}"));
    let dg = rig.group().clone();
    let replayed = dg.open_report().replayed_batches;
    let seen = *seen.lock();
    assert_eq!(seen.batches, replayed, "seed {seed}");
    for &(stop, batches) in &stops {
        let partway = match stop {
            Stop::AtProbe => batches == replayed,
            _ => batches < replayed,
        };
        assert!(
            partway,
            "seed {seed}: {stop:?} at {batches} of {replayed} batches"
        );
    }
    assert_eq!(ctl.progress.step(), OpenStep::Writing, "seed {seed}");
    assert_eq!(ctl.progress.log_replayed_bytes(), seen.bytes, "seed {seed}");

    let mut got = vec![0u8; torn_range.len()];
    dg.read(v, torn_range.start as u64, &mut got).expect("read");
    for (k, block) in got.chunks(BLOCK).enumerate() {
        let at = torn_range.start + k * BLOCK;
        let (old, new) = (
            &model[at..at + BLOCK],
            &torn_data[k * BLOCK..(k + 1) * BLOCK],
        );
        assert!(
            block == old || block == new,
            "seed {seed}: block {} of the write in flight is neither before nor after",
            at / BLOCK
        );
    }
    model[torn_range].copy_from_slice(&got);
    check_volume(
        &dg,
        v,
        &model,
        &format!("seed {seed}: after the stopped opens"),
    );
    drop(dg);
    rig.power_cut_and_restart();
    check_volume(
        rig.dg(),
        v,
        &model,
        &format!("seed {seed}: after another power cut"),
    );
}

/// Where a test stops an open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Asked before it begins.
    Before,
    /// Once this many batches are replayed.
    AfterBatches(usize),
    /// Once the replay reaches the probe past the log's end.
    AtProbe,
    Never,
}

/// What an open's replay showed its hook.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    batches: usize,
    /// Bytes of log replayed, as of the last batch.
    bytes: u64,
    /// Whether it reached the probe past the log's end.
    probed: bool,
}

/// Watches an open's replay (each batch must make the bytes replayed grow) and asks it to stop
/// where `stop` says.
fn watch(ctl: &mut OpenControl, stop: Stop) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (abandon, progress, seen2) = (ctl.abandon.clone(), ctl.progress.clone(), seen.clone());
    ctl.hook = Some(Arc::new(move |step, batches| {
        let mut s = seen2.lock();
        if step == OpenStep::CheckingEnd {
            assert_eq!(batches, s.batches);
            s.probed = true;
            if stop == Stop::AtProbe {
                abandon.store(true, Ordering::Relaxed);
            }
            return;
        }
        let bytes = progress.log_replayed_bytes();
        assert!(
            batches == s.batches + 1 && bytes > s.bytes,
            "{batches} batches, {bytes} bytes after {s:?}"
        );
        (s.batches, s.bytes) = (batches, bytes);
        if stop == Stop::AfterBatches(batches) {
            abandon.store(true, Ordering::Relaxed);
        }
    }));
    seen
}

/// Stopped before it begins, an open of blank devices formats nothing: a daemon stopped at its
/// first start may remove the files it made, and a next start formats them from scratch.
#[test]
fn an_open_stopped_before_it_begins_leaves_blank_devices_blank() {
    let fast = Arc::new(MemDevice::new("fast", 32 * MIB));
    let cap = Arc::new(MemDevice::new("cap0", 24 * MIB));
    let devices = || {
        let (f, c): (Arc<dyn Device>, Arc<dyn Device>) = (fast.clone(), cap.clone());
        (f, vec![c])
    };
    let ctl = OpenControl::default();
    ctl.abandon.store(true, Ordering::Relaxed);
    let (f, c) = devices();
    let stopped = DiskGroup::open_with(f, c, small_cfg(), true, &ctl);
    assert!(
        matches!(stopped, Err(EngineError::Cancelled(_))),
        "the open was not stopped: {:?}",
        stopped.map(|_| ())
    );
    assert_eq!(fast.stats().write_bytes + cap.stats().write_bytes, 0);
    let (f, c) = devices();
    let dg = DiskGroup::open(f, c, small_cfg(), true).expect("a format");
    assert!(dg.open_report().formatted);
    dg.shutdown().unwrap();
}
