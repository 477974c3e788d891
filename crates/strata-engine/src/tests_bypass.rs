//! Sequential writes past a cache-mode volume's write cutoff go straight to the capacity tier:
//! they are durable, read back, win over older log copies across a power cut, and lose to
//! newer writes.

use std::time::Duration;

use strata_device::Device;

use crate::tests::{small_cfg, Rig, MIB};
use crate::*;

const KIB: u64 = 1024;

fn tagged(at: u64, len: usize, tag: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((at as usize + i) / 4096) as u8 ^ tag)
        .collect()
}

fn check(dg: &DiskGroup, v: VolumeId, at: u64, want: &[u8], what: &str) {
    let mut got = vec![0u8; want.len()];
    dg.read(v, at, &mut got)
        .unwrap_or_else(|e| panic!("{what}: read at {at}: {e}"));
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: byte {} (block {}) is {:#x}, expected {:#x}",
            at as usize + i,
            (at as usize + i) / 4096,
            got[i],
            want[i]
        );
    }
}

fn bypassing(cutoff: u64) -> Policy {
    Policy {
        sequential_write_cutoff_bytes: cutoff,
        ..Policy::default()
    }
}

/// A group whose destager leaves the log alone (high marks), so older copies stay there.
fn rig(seed: u64) -> Rig {
    let cfg = EngineConfig {
        fill_ratio_low: 0.9,
        fill_ratio_high: 0.95,
        ..small_cfg()
    };
    Rig::new(32 * MIB, &[48 * MIB], cfg, seed)
}

#[test]
fn sequential_writes_past_the_cutoff_bypass_the_log_and_survive_a_power_cut() {
    let mut rig = rig(91);
    let v = rig
        .dg()
        .create_volume_with_policy("s", 8 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    let span = 4 * MIB as usize;
    let kib256 = 256 * KIB as usize;
    // Older copies of the whole range in the log: 4 KiB writes, backwards (no stream).
    for b in (0..span / 4096).rev() {
        let at = (b * 4096) as u64;
        rig.dg().write(v, at, &tagged(at, 4096, 1)).unwrap();
    }
    // The same range again as one sequential stream of 256 KiB writes: the first MiB goes
    // through the log (the stream is not yet longer than the cutoff), the rest bypasses it.
    let fast_before = rig.fast.stats().write_bytes;
    for at in (0..span).step_by(kib256) {
        let at = at as u64;
        rig.dg().write(v, at, &tagged(at, kib256, 2)).unwrap();
    }
    let fast_written = rig.fast.stats().write_bytes - fast_before;
    let f = rig.dg().volume_figures("s").unwrap();
    assert_eq!(f.bypassed_bytes, 3 * MIB, "the stream past its first MiB");
    assert!(
        fast_written < 2 * MIB,
        "the fast tier took {fast_written} bytes: more than the log's first MiB and records"
    );
    check(rig.dg(), v, 0, &tagged(0, span, 2), "after the stream");
    // A newer small write inside the bypassed part wins over it.
    let newer = 2 * MIB + 8192;
    rig.dg().write(v, newer, &tagged(newer, 4096, 3)).unwrap();
    let mut model = tagged(0, span, 2);
    model[newer as usize..newer as usize + 4096].copy_from_slice(&tagged(newer, 4096, 3));
    check(rig.dg(), v, 0, &model, "after a newer write");

    // Recovery replays the older log copies, and the forget records drop them again.
    rig.power_cut_and_restart();
    check(rig.dg(), v, 0, &model, "after a power cut");
    assert!(rig.dg().destage_all(Duration::from_secs(20)));
    rig.power_cut_and_restart();
    check(
        rig.dg(),
        v,
        0,
        &model,
        "after destage and another power cut",
    );
    rig.clean_restart();
    check(rig.dg(), v, 0, &model, "after a clean restart");
}

#[test]
fn short_small_or_tier_mode_writes_use_the_log() {
    let rig = rig(92);
    let dg = rig.dg();
    let off = dg.create_volume("off", 8 * MIB).unwrap().id;
    let small = dg
        .create_volume_with_policy("small", 8 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    let tier = Policy {
        mode: Mode::Tier,
        ..bypassing(MIB)
    };
    let t = dg
        .create_volume_with_policy("tier", 8 * MIB, &tier)
        .unwrap()
        .id;
    for at in (0..4 * MIB).step_by(256 * KIB as usize) {
        dg.write(off, at, &tagged(at, 256 * KIB as usize, 5))
            .unwrap();
        dg.write(t, at, &tagged(at, 256 * KIB as usize, 6)).unwrap();
    }
    // 64 KiB writes: a long stream, but each write below the bypass minimum.
    for at in (0..4 * MIB).step_by(64 * KIB as usize) {
        dg.write(small, at, &tagged(at, 64 * KIB as usize, 7))
            .unwrap();
    }
    for name in ["off", "small", "tier"] {
        assert_eq!(dg.volume_figures(name).unwrap().bypassed_bytes, 0, "{name}");
    }
    check(dg, off, 0, &tagged(0, 4 * MIB as usize, 5), "off");
    check(dg, t, 0, &tagged(0, 4 * MIB as usize, 6), "tier");
    check(dg, small, 0, &tagged(0, 4 * MIB as usize, 7), "small");
    // Turned on later, the cutoff applies at once.
    dg.set_policy("off", &bypassing(MIB)).unwrap();
    for at in (0..4 * MIB).step_by(512 * KIB as usize) {
        dg.write(off, at, &tagged(at, 512 * KIB as usize, 8))
            .unwrap();
    }
    assert_eq!(dg.volume_figures("off").unwrap().bypassed_bytes, 3 * MIB);
    check(dg, off, 0, &tagged(0, 4 * MIB as usize, 8), "off, then on");
}

/// The seqs a bypass stamps on its segment entries are never ahead of what the log has
/// answered: a batch placed but not yet durable when the power fails has its seqs handed out
/// again by the next opening, and a segment entry carrying one of them would sort after a
/// newer write at recovery (an acknowledged write lost to older data).
#[test]
fn a_bypass_carries_no_seq_the_next_opening_hands_out_again() {
    let mut rig = rig(93);
    let v = rig
        .dg()
        .create_volume_with_policy("s", 8 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    // Another volume, so its write does not break the stream.
    let o = rig.dg().create_volume("o", MIB).unwrap().id;
    let kib256 = 256 * KIB as usize;
    // The stream's first MiB, through the log: the stream is established.
    for at in (0..MIB as usize).step_by(kib256) {
        let at = at as u64;
        rig.dg().write(v, at, &tagged(at, kib256, 1)).unwrap();
    }
    let sh = rig.dg().sh.clone();
    let log_start = sh.layout.log_byte(0);
    assert!(sh.layout.checkpoint_offsets.iter().all(|&o| o < log_start));
    // From here the log's writes stall (the checkpoints' do not): a write elsewhere is placed
    // in the log and waits there, never to become durable.
    rig.stall_fast_from.store(log_start, Ordering::SeqCst);
    let dg = rig.group().clone();
    let elsewhere = std::thread::spawn(move || dg.write(o, 0, &[7; 4096]));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sh.log.lock().next_seq <= sh.retired_seq.load(Ordering::SeqCst) {
        assert!(
            std::time::Instant::now() < deadline,
            "the write was not placed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The stream goes on past the cutoff: its next write bypasses the log (segment and
    // checkpoint durable); the record that would acknowledge it waits behind the stall.
    let dg = rig.group().clone();
    let stream = std::thread::spawn(move || {
        let at = MIB;
        dg.write(v, at, &tagged(at, kib256, 2))
    });
    while rig.dg().volume_figures("s").unwrap().bypassed_bytes == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stream did not bypass"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    rig.power_cut_and_restart();
    assert!(elsewhere.join().unwrap().is_err(), "never acknowledged");
    assert!(stream.join().unwrap().is_err(), "never acknowledged");
    let sh = rig.dg().sh.clone();
    let next_seq = sh.log.lock().next_seq;
    let sealed: Vec<u32> = {
        let segs = sh.segs.lock();
        (0..segs.segs.len() as u32)
            .filter(|&s| segs.segs[s as usize].state == crate::capacity::SegState::Sealed)
            .collect()
    };
    let mut entries = 0;
    for seg in sealed {
        let Some(summary) = crate::capacity::read_summary(&sh, seg).unwrap() else {
            continue;
        };
        for e in summary.entries {
            entries += 1;
            assert!(
                e.seq <= next_seq,
                "segment {seg} holds an entry of seq {} (lba {}), but this opening hands out \
                 seqs from {next_seq}",
                e.seq,
                e.lba
            );
        }
    }
    assert!(entries > 0, "the bypass segment was found");
}

/// A bypass whose segment write fails goes through the log instead, in records that fit a
/// batch (`--max-batch-size`): it read back and survives a power cut. (The fallback sent each
/// job as one record of up to a segment's data area, 250 blocks here against a batch limit of
/// 64, past what replay's probe and the destager assume of a batch.)
#[test]
fn a_bypass_that_fails_goes_through_the_log_in_batches_that_fit() {
    let mut rig = rig(94);
    let v = rig
        .dg()
        .create_volume_with_policy("s", 8 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    let kib256 = 256 * KIB as usize;
    for at in (0..MIB as usize).step_by(kib256) {
        let at = at as u64;
        rig.dg().write(v, at, &tagged(at, kib256, 1)).unwrap();
    }
    let span = 2 * MIB as usize;
    let data = tagged(MIB, span, 2);
    rig.caps[0].fail_next_writes(1);
    rig.dg().write(v, MIB, &data).unwrap();
    let max_blocks = rig.dg().sh.cfg.max_batch_bytes as u64 / 4096;
    let sh = rig.dg().sh.clone();
    let largest = sh.log.lock().batches.iter().map(|b| b.blocks).max();
    assert!(
        largest.is_some_and(|n| n <= max_blocks),
        "a batch of {largest:?} blocks; batches hold at most {max_blocks}"
    );
    assert!(
        rig.dg().volume_figures("s").unwrap().bypassed_bytes < span as u64,
        "the failed write did not go through the log"
    );
    check(rig.dg(), v, MIB, &data, "after the fallback");
    rig.power_cut_and_restart();
    check(rig.dg(), v, MIB, &data, "after a power cut");
}

/// A group with room for many bypass jobs (one written alone seals a 1 MiB segment).
fn roomy_rig(seed: u64) -> Rig {
    Rig::new(32 * MIB, &[256 * MIB], small_cfg(), seed)
}

/// A client keeping several writes of one stream in flight, as the NBD server hands them on:
/// each request is offered to the non-blocking path as it arrives (`write_async`), and one
/// handed back (a bypass waits, so it takes the blocking path) runs later on one of the
/// server's threads, after requests behind it have arrived: here in fours, the last first.
/// Before, the detector knew only where the last write noted ended, so a request behind one
/// not yet noted seemed to start a new stream, and this one bypassed 384 KiB of 15 MiB.
#[test]
fn a_stream_with_several_writes_in_flight_bypasses_the_log() {
    let rig = roomy_rig(95);
    let dg = rig.group().clone();
    let v = dg
        .create_volume_with_policy("s", 32 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    let (kib128, span) = (128 * KIB as usize, 16 * MIB as usize);
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut handed_back = Vec::new();
    for at in (0..span).step_by(kib128) {
        let at = at as u64;
        let data = tagged(at, kib128, 1);
        let tx = tx.clone();
        let done: WriteDone = Box::new(move |r| tx.send((at, r.is_ok())).expect("test alive"));
        if let Err(done) = dg.write_async(v, at, &data, done) {
            handed_back.push((at, data, done));
        }
        if handed_back.len() == 4 || at as usize + kib128 == span {
            for (at, data, done) in handed_back.drain(..).rev() {
                done(dg.write(v, at, &data));
            }
        }
    }
    for _ in 0..span / kib128 {
        let (at, ok) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("every write completes");
        assert!(ok, "the write at {at} failed");
    }
    let bypassed = dg.volume_figures("s").unwrap().bypassed_bytes;
    assert!(
        bypassed >= 14 * MIB,
        "bypassed {bypassed} bytes of the stream's 15 MiB past its first"
    );
    check(&dg, v, 0, &tagged(0, span, 1), "after the stream");
}

/// Two streams written at once (two connections, each copying its own part of a disk), with
/// writes at random places between their requests, more of them each time than the detector
/// follows streams: each stream bypasses the log past its first MiB, and the random writes,
/// though as large, never do. Before, a write that did not continue the last one noted
/// started a new stream, and nothing bypassed.
#[test]
fn interleaved_streams_bypass_the_log_and_random_writes_between_them_do_not() {
    use rand::{Rng, SeedableRng};
    let rig = roomy_rig(96);
    let dg = rig.dg();
    let v = dg
        .create_volume_with_policy("s", 1024 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    let (kib256, kib128) = (256 * KIB as usize, 128 * KIB as usize);
    let mut rng = rand::rngs::StdRng::seed_from_u64(96);
    let starts = [0, 512 * MIB];
    for k in 0..32 {
        for (s, start) in starts.into_iter().enumerate() {
            let at = start + k * kib256 as u64;
            dg.write(v, at, &tagged(at, kib256, s as u8)).unwrap();
            // Well away from both streams (farther than a stream's reordering window).
            for _ in 0..10 {
                let at = rng.gen_range(40 * MIB..480 * MIB) / 4096 * 4096;
                dg.write(v, at, &tagged(at, kib128, 9)).unwrap();
            }
        }
    }
    let bypassed = dg.volume_figures("s").unwrap().bypassed_bytes;
    assert_eq!(
        bypassed,
        14 * MIB,
        "each stream's 7 MiB past its first, and none of the random writes"
    );
    for (s, start) in starts.into_iter().enumerate() {
        check(
            dg,
            v,
            start,
            &tagged(start, 8 * MIB as usize, s as u8),
            "a stream",
        );
    }
}

/// A client with one write in flight at a time (the NBD server then starts its writes with
/// `write_async_alone`): each bypassed write would be a stripe of its own, sealed with the
/// rest of its segment empty (128 KiB of a 1 MiB segment here, 1.6% of an 8 MiB one). Such
/// writes under a quarter of a segment go through the log, whose destager packs segments
/// full; from a quarter up they still bypass it (`bypass::packs_enough`), as do small writes
/// of a client with more in flight. Before, every 128 KiB write past the cutoff sealed a
/// segment.
#[test]
fn one_small_write_at_a_time_goes_through_the_log() {
    let rig = roomy_rig(97);
    let dg = rig.group().clone();
    let v = dg
        .create_volume_with_policy("s", 32 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    // As the NBD server does: the non-blocking path, or the blocking one when handed back.
    let alone = |at: u64, len: usize| {
        let data = tagged(at, len, 1);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let done: WriteDone = Box::new(move |r| tx.send(r.is_ok()).expect("test alive"));
        match dg.write_async_alone(v, at, &data, done) {
            Ok(()) => {
                let ok = rx.recv_timeout(Duration::from_secs(20));
                assert_eq!(ok, Ok(true), "the write at {at}");
            }
            Err(done) => done(dg.write(v, at, &data)),
        }
    };
    let free = || dg.sh.segs.lock().free_count();
    let free_before = free();
    let kib128 = 128 * KIB as usize;
    for at in (0..8 * MIB as usize).step_by(kib128) {
        alone(at as u64, kib128);
    }
    assert_eq!(dg.volume_figures("s").unwrap().bypassed_bytes, 0);
    assert!(
        free() + 1 >= free_before,
        "{} segments sealed for a stream that went through the log",
        free_before - free()
    );
    // The same stream goes on in 256 KiB writes, a quarter of a segment: they bypass.
    let kib256 = 256 * KIB as usize;
    for at in (8 * MIB as usize..12 * MIB as usize).step_by(kib256) {
        alone(at as u64, kib256);
    }
    assert_eq!(dg.volume_figures("s").unwrap().bypassed_bytes, 4 * MIB);
    let want = tagged(0, 12 * MIB as usize, 1);
    check(&dg, v, 0, &want, "after the stream");
}

/// A stream that bypasses the log in quarter-segment writes leaves segments three quarters
/// empty; once free segments are down to what bypassing keeps to spare, its writes go
/// through the log, and GC, which would wait for space to run short, cleans those segments
/// now since they are cheap to clean: the stream bypasses the log again. Before, it went
/// through the log until space ran short. The data survives the cleaning and a power cut.
#[test]
fn cheap_cleaning_lets_a_stream_bypass_the_log_again() {
    let mut rig = rig(98);
    let v = rig
        .dg()
        .create_volume_with_policy("s", 40 * MIB, &bypassing(MIB))
        .unwrap()
        .id;
    let kib256 = 256 * KIB as usize;
    let sh = rig.dg().sh.clone();
    let held = || sh.counters.bypass_held_for_room.load(Ordering::Relaxed);
    let mut at = 0u64;
    let write = |dg: &DiskGroup, at: &mut u64| {
        dg.write(v, *at, &tagged(*at, kib256, 1)).unwrap();
        *at += kib256 as u64;
    };
    while !held() {
        assert!(at < 36 * MIB, "bypassing never waited for free segments");
        write(rig.dg(), &mut at);
    }
    let bypassed = || rig.dg().volume_figures("s").unwrap().bypassed_bytes;
    let waited_at = bypassed();
    // GC cleans some of the stream's segments, the index flush frees them.
    let t0 = std::time::Instant::now();
    while held() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no cheap cleaning: {:?}",
            rig.dg().stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(rig.dg().stats().gc_segments_cleaned_total > 0);
    let before = bypassed();
    for _ in 0..4 {
        write(rig.dg(), &mut at);
    }
    assert!(
        bypassed() >= before + 4 * kib256 as u64,
        "the stream did not bypass the log again: {} then {} bypassed",
        waited_at,
        bypassed()
    );
    let end = at as usize;
    check(rig.dg(), v, 0, &tagged(0, end, 1), "after cleaning");
    rig.power_cut_and_restart();
    check(rig.dg(), v, 0, &tagged(0, end, 1), "after a power cut");
}
