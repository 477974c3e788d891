//! Tiering policies with an injected clock: tier mode's age and heat, promotion on evidence,
//! the read cache's eviction, policy changes at run time, and per-volume I/O limits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::map::Loc;
use crate::tests::{log_barrier, promotions_retired, read_either, small_cfg, Rig, MIB};
use crate::*;

fn block_of(lba: u64, tag: u8) -> Vec<u8> {
    let mut b = vec![tag; 4096];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b
}

fn read_block(dg: &DiskGroup, v: VolumeId, lba: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    dg.read(v, lba * 4096, &mut b)
        .unwrap_or_else(|e| panic!("read of block {lba}: {e}"));
    b
}

/// Waits (real time) until `f` holds; false after `secs`.
fn eventually(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

fn clocked(cfg: EngineConfig) -> (EngineConfig, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::default());
    (
        EngineConfig {
            clock: clock.clone(),
            ..cfg
        },
        clock,
    )
}

fn tier(min_age_s: u64) -> Policy {
    Policy {
        mode: Mode::Tier,
        tier_min_age_s: min_age_s,
        ..Policy::default()
    }
}

/// A 4 MiB tier-mode volume "t" on a clocked group whose low mark is 0 (a cache-mode
/// volume's data would move at once), with blocks 0..64 written (`block_of(lba, 1)`).
fn written_tier_volume(
    cfg: EngineConfig,
    seed: u64,
    min_age_s: u64,
) -> (Rig, Arc<ManualClock>, VolumeId) {
    let (cfg, clock) = clocked(EngineConfig {
        fill_ratio_low: 0.0,
        ..cfg
    });
    let rig = Rig::new(32 * MIB, &[24 * MIB], cfg, seed);
    let dg = rig.dg();
    let v = dg
        .create_volume_with_policy("t", 4 * MIB, &tier(min_age_s))
        .unwrap()
        .id;
    for lba in 0..64 {
        dg.write(v, lba * 4096, &block_of(lba, 1)).unwrap();
    }
    (rig, clock, v)
}

#[test]
fn tier_mode_keeps_data_until_it_is_old_and_cold() {
    let (rig, clock, v) = written_tier_volume(small_cfg(), 61, 60);
    let dg = rig.dg();
    // Blocks 0..8 are read again and again: heat.
    for _ in 0..3 {
        for lba in 0..8 {
            assert_eq!(read_block(dg, v, lba), block_of(lba, 1));
        }
    }
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(dg.stats().destaged_bytes_total, 0, "young tier data moved");
    clock.advance_ms(61_000);
    assert!(
        eventually(10, || dg.stats().destaged_bytes_total >= 56 * 4096),
        "old, cold data did not move"
    );
    let before = dg.volume_figures("t").unwrap();
    for lba in 0..64 {
        assert_eq!(read_block(dg, v, lba), block_of(lba, 1));
    }
    let after = dg.volume_figures("t").unwrap();
    assert_eq!(
        after.read_capacity_bytes - before.read_capacity_bytes,
        56 * 4096,
        "the cold blocks moved"
    );
    assert_eq!(
        after.read_fast_bytes - before.read_fast_bytes,
        8 * 4096,
        "the hot blocks stayed"
    );
    // The residency histogram saw 56 blocks leave after 61 s (bucket 6: 32..64 s).
    assert_eq!(
        after.residency_seconds_log2[6], 56,
        "{:?}",
        after.residency_seconds_log2
    );
    // Kept hot, they wait another minimum age; once they stop being read, their heat halves
    // at each such pass until they are cold and move too.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        dg.stats().destaged_bytes_total,
        56 * 4096,
        "kept data moved before its new minimum age"
    );
    for _ in 0..4 {
        clock.advance_ms(61_000);
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(
        eventually(10, || dg.stats().destaged_bytes_total >= 64 * 4096),
        "cooled data did not move"
    );
}

/// A restart does not make tier-mode data young again: replay gives each batch the age its
/// time stamp says, after a clean stop and after a power cut. (Ages started again at every
/// open: with a minimum age of a day and a restart each night, data moved only when the fast
/// tier needed room.)
#[test]
fn tier_mode_ages_survive_a_restart() {
    for power_cut in [false, true] {
        let (mut rig, clock, v) = written_tier_volume(small_cfg(), 71, 60);
        clock.advance_ms(40_000);
        match power_cut {
            true => rig.power_cut_and_restart(),
            false => rig.clean_restart(),
        }
        let dg = rig.group().clone();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            dg.stats().destaged_bytes_total,
            0,
            "young tier data moved (power cut: {power_cut})"
        );
        // 61 s since it was written, 21 s since the restart.
        clock.advance_ms(21_000);
        assert!(
            eventually(10, || dg.stats().destaged_bytes_total >= 64 * 4096),
            "data old enough before the restart did not move (power cut: {power_cut}): {:?}",
            dg.stats()
        );
        for lba in 0..64 {
            assert_eq!(read_block(&dg, v, lba), block_of(lba, 1));
        }
    }
}

#[test]
fn tier_mode_moves_young_data_when_the_fast_tier_needs_room() {
    let (cfg, _clock) = clocked(small_cfg());
    let rig = Rig::new(32 * MIB, &[96 * MIB], cfg, 62);
    let dg = rig.dg();
    let v = dg
        .create_volume_with_policy("t", 32 * MIB, &tier(3600))
        .unwrap()
        .id;
    let log = dg.stats().log_capacity_bytes;
    // Twice the log: the destager must move data long before it is an hour old.
    let blocks = 2 * log / 4096;
    let chunk = 64u64;
    for at in (0..blocks).step_by(chunk as usize) {
        let data: Vec<u8> = (at..at + chunk)
            .flat_map(|l| block_of(l % 8192, 2))
            .collect();
        dg.write(v, (at % 8192) * 4096, &data).unwrap();
    }
    assert!(dg.stats().destaged_bytes_total > 0);
    for lba in (0..8192).step_by(97) {
        assert_eq!(read_block(dg, v, lba), block_of(lba, 2));
    }
}

#[test]
fn a_policy_change_takes_effect_at_once_and_is_kept() {
    let (cfg, _clock) = clocked(EngineConfig {
        fill_ratio_low: 0.0,
        ..small_cfg()
    });
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 63);
    let v = rig
        .dg()
        .create_volume_with_policy("p", 4 * MIB, &tier(3600))
        .unwrap()
        .id;
    for lba in 0..32 {
        rig.dg().write(v, lba * 4096, &block_of(lba, 3)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rig.dg().stats().destaged_bytes_total, 0);
    let cache = Policy {
        iops_limit: 5000,
        ..Policy::default()
    };
    rig.dg().set_policy("p", &cache).unwrap();
    assert!(
        eventually(10, || rig.dg().stats().destaged_bytes_total >= 32 * 4096),
        "cache mode did not destage"
    );
    rig.clean_restart();
    assert_eq!(rig.dg().policy("p").unwrap(), cache);
    assert!(matches!(
        rig.dg().set_policy("nope", &cache),
        Err(EngineError::NotFound(_))
    ));
    let bad = Policy {
        promote_after_reads: 5,
        promote_window_s: 0,
        ..Policy::default()
    };
    assert!(matches!(
        rig.dg().set_policy("p", &bad),
        Err(EngineError::InvalidArgument(_))
    ));
    assert_eq!(
        rig.dg().policy("p").unwrap(),
        cache,
        "a refused change changed something"
    );
}

/// A group whose volume `c` (8 MiB of known data) sits on the capacity tier, with a read cache
/// of this share of the log (0.5 holds the whole volume; 0.04 about a seventh of it).
fn cached_rig(
    seed: u64,
    policy: &Policy,
    read_cache_ratio: f64,
) -> (Rig, VolumeId, Arc<ManualClock>) {
    let (cfg, clock) = clocked(EngineConfig {
        read_cache_ratio,
        fill_ratio_low: 0.9,
        fill_ratio_high: 0.95,
        ..small_cfg()
    });
    let rig = Rig::new(32 * MIB, &[48 * MIB], cfg, seed);
    let v = rig
        .dg()
        .create_volume_with_policy("c", 8 * MIB, policy)
        .unwrap()
        .id;
    for at in (0..2048u64).step_by(64) {
        let data: Vec<u8> = (at..at + 64).flat_map(|l| block_of(l, 4)).collect();
        rig.dg().write(v, at * 4096, &data).unwrap();
    }
    assert!(rig.dg().destage_all(Duration::from_secs(20)));
    (rig, v, clock)
}

fn cached_bytes(dg: &DiskGroup) -> u64 {
    dg.volume_figures("c").unwrap().read_cached_bytes
}

#[test]
fn promotion_needs_n_reads_within_the_window() {
    let p = Policy {
        promote_after_reads: 3,
        promote_window_s: 10,
        ..Policy::default()
    };
    let (rig, v, clock) = cached_rig(64, &p, 0.5);
    let dg = rig.dg();
    assert_eq!(read_block(dg, v, 100), block_of(100, 4));
    assert_eq!(read_block(dg, v, 101), block_of(101, 4));
    assert_eq!(
        dg.volume_figures("c").unwrap().promoted_bytes,
        0,
        "promoted on two reads"
    );
    assert_eq!(read_block(dg, v, 100), block_of(100, 4));
    promotions_retired(dg);
    assert_eq!(
        dg.volume_figures("c").unwrap().promoted_bytes,
        4096,
        "not promoted on the third read"
    );
    assert!(eventually(5, || {
        let before = cached_bytes(dg);
        read_block(dg, v, 100) == block_of(100, 4) && cached_bytes(dg) == before + 4096
    }));
    // Reads spread wider than the window are no evidence.
    for _ in 0..5 {
        assert_eq!(read_block(dg, v, 500), block_of(500, 4));
        clock.advance_ms(11_000);
    }
    promotions_retired(dg);
    assert_eq!(dg.volume_figures("c").unwrap().promoted_bytes, 4096);
}

/// Where block `lba` of volume `v` is on the capacity tier: its segment, block and the
/// segment's generation, as a promotion of it would name them.
fn capacity_block(dg: &DiskGroup, v: VolumeId, lba: u64) -> (u32, u32, u32) {
    let piece = crate::resolve::resolve_view(&dg.sh, v, lba, 1).unwrap()[0];
    let Some(Loc::Cap { seg, block }) = piece.loc else {
        panic!("block {lba} is on the capacity tier: {piece:?}");
    };
    (seg, block, dg.sh.cache.lock().gen_of(seg))
}

/// The read cache's figures count a copy when the cache takes it, not when it is queued: a
/// promotion whose segment is reused before the log writes the copy (or that the log refuses)
/// never becomes an entry, so promoted + kept - evicted is what the cache holds.
#[test]
fn promoted_bytes_count_only_copies_the_cache_took() {
    let p = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let (rig, v, _clock) = cached_rig(67, &p, 0.5);
    let dg = rig.dg();
    let held = |what: &str| {
        let f = dg.volume_figures("c").unwrap();
        let s = dg.stats();
        assert_eq!(
            (f.promoted_bytes, f.kept_bytes, f.evicted_bytes),
            (s.promoted_bytes_total, 0, s.evicted_bytes_total),
            "{what}: one volume, nothing kept"
        );
        assert_eq!(
            f.promoted_bytes + f.kept_bytes - f.evicted_bytes,
            s.read_cache_bytes,
            "{what}: the figures against what the cache holds"
        );
        // What reads find on the fast tier: the data in the log and the cache's copies.
        assert_eq!(
            s.fast_resident_bytes,
            s.destage_backlog_bytes + s.read_cache_bytes,
            "{what}: {s:?}"
        );
        s.read_cache_bytes
    };
    let (seg, block, gen) = capacity_block(dg, v, 300);
    let rt = dg.sh.runtime(v).unwrap();
    // A copy read under the segment's previous generation: the segment was reused after the
    // read and before the log wrote the copy. The log writes it; the cache refuses it.
    dg.promote(
        Some(&rt),
        seg,
        block,
        gen.wrapping_sub(1),
        &block_of(300, 4),
    );
    promotions_retired(dg);
    assert_eq!(held("a copy of a reused segment"), 0);
    assert_eq!(dg.volume_figures("c").unwrap().promoted_bytes, 0);
    // A read promotes for real: counted once the cache holds the copy.
    assert_eq!(read_block(dg, v, 300), block_of(300, 4));
    promotions_retired(dg);
    assert_eq!(held("a promoted copy"), 4096);
    assert_eq!(read_block(dg, v, 300), block_of(300, 4));
    assert_eq!(cached_bytes(dg), 4096, "the copy was not served");
}

/// A promotion the log writer's queue is too full to take is skipped and counted as such,
/// not as refused for room (the destager cannot help a busy log) and not silently.
#[test]
fn a_promotion_a_full_log_queue_cannot_take_is_counted_as_skipped() {
    let p = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let (rig, v, _clock) = cached_rig(68, &p, 0.5);
    let dg = rig.dg();
    let (seg, block, gen) = capacity_block(dg, v, 300);
    let rt = dg.sh.runtime(v).unwrap();
    // A queue of one place, already taken: the log writer is busy.
    let (tx, _rx) = crossbeam_channel::bounded(1);
    let bell = Arc::new(crate::queue::Doorbell::new(Duration::from_secs(1)).unwrap());
    let busy = crate::queue::LogQueue::new(tx, bell);
    let data = block_of(300, 4);
    assert!(crate::tiering::send_cache_copy(
        &busy,
        crate::log::CacheCopy::Promoted,
        v,
        seg,
        block,
        gen,
        &data,
        crate::log::Done::Call(Box::new(|_| {})),
    ));
    let before = dg.stats();
    crate::tiering::promote_with(&dg.sh, Some(&busy), Some(&rt), seg, block, gen, &data);
    let after = dg.stats();
    let counts = |s: &EngineStats| (s.promotions_skipped_total, s.promotions_refused_total);
    let (skipped, refused) = counts(&before);
    assert_eq!(
        counts(&after),
        (skipped + 1, refused),
        "a promotion the queue could not take"
    );
}

#[test]
fn a_sequential_scan_does_not_evict_the_hot_set() {
    let p = Policy {
        promote_after_reads: 2,
        promote_sequential_cutoff_bytes: 256 * 1024,
        ..Policy::default()
    };
    let (rig, v, _clock) = cached_rig(65, &p, 0.5);
    let dg = rig.dg();
    let hot: Vec<u64> = (0..64).map(|i| 1000 + i * 16).collect();
    for _ in 0..2 {
        for &lba in &hot {
            assert_eq!(read_block(dg, v, lba), block_of(lba, 4));
        }
    }
    assert!(eventually(5, || {
        let before = cached_bytes(dg);
        hot.iter().all(|&l| read_block(dg, v, l) == block_of(l, 4))
            && cached_bytes(dg) == before + 64 * 4096
    }));
    let promoted = dg.volume_figures("c").unwrap().promoted_bytes;
    // Three full scans in 128 KiB reads: only the first 256 KiB of each is not yet a stream.
    let mut buf = vec![0u8; 128 * 1024];
    for _ in 0..3 {
        for at in (0..8 * MIB).step_by(buf.len()) {
            dg.read(v, at, &mut buf).unwrap();
            assert_eq!(&buf[..4096], &block_of(at / 4096, 4)[..]);
        }
    }
    let scanned = dg.volume_figures("c").unwrap().promoted_bytes - promoted;
    assert!(scanned <= 256 * 1024, "the scans promoted {scanned} bytes");
    let before = cached_bytes(dg);
    for &lba in &hot {
        assert_eq!(read_block(dg, v, lba), block_of(lba, 4));
    }
    assert_eq!(
        cached_bytes(dg) - before,
        64 * 4096,
        "the hot set was evicted"
    );
}

#[test]
fn eviction_and_damaged_copies_never_lose_or_falsify_data() {
    let p = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let (mut rig, v, _clock) = cached_rig(66, &p, 0.04);
    let mut model: Vec<u8> = (0..2048u64).map(|_| 4).collect();
    let mut taken = 0;
    let mut rng_state = 0x1234_5678u64;
    let mut next = || {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        rng_state
    };
    // Reads promote everything they touch; writes push the log tail over the copies. The
    // destager makes room for the cache at background CPU priority (nice 19 when it may
    // come back), so on a busy machine its first eviction can come late: go on until it has
    // come and 1500 more rounds have read and written around it.
    let evicted = |rig: &Rig| rig.dg().volume_figures("c").unwrap().evicted_bytes;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut first_eviction = None;
    let mut round = 0u64;
    while round < 6000 || first_eviction.is_none_or(|at| round < at + 1500) {
        if first_eviction.is_none() && evicted(&rig) > 0 {
            first_eviction = Some(round);
        }
        assert!(
            first_eviction.is_some() || Instant::now() < deadline,
            "nothing was evicted in {round} rounds and 60 s"
        );
        let lba = next() % 2048;
        if round.is_multiple_of(3) {
            let tag = (round % 250) as u8 + 5;
            rig.dg().write(v, lba * 4096, &block_of(lba, tag)).unwrap();
            model[lba as usize] = tag;
        } else {
            // Every other read asynchronously: both paths evict, promote and count alike.
            let async_read = round.is_multiple_of(2);
            let read = read_either(rig.group(), v, lba * 4096, 4096, async_read, &mut taken);
            let read = read.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(read, block_of(lba, model[lba as usize]), "round {round}");
        }
        round += 1;
    }
    assert!(taken > 1000, "only {taken} reads went through read_async");
    let s = rig.dg().stats();
    assert!(s.read_cached_bytes_total > 0);
    // Damage two cached copies on the fast device: a blocking and an asynchronous read
    // each fall back to the capacity tier.
    let dg = rig.dg();
    let cached = (0..2048u64).filter_map(|lba| {
        let piece = crate::resolve::resolve_view(&dg.sh, v, lba, 1)
            .ok()?
            .into_iter()
            .next()?;
        let Some(Loc::Cap { seg, block }) = piece.loc else {
            return None;
        };
        dg.sh
            .cache
            .lock()
            .lookup(seg, block)
            .map(|fast| (lba, fast))
    });
    let found: Vec<(u64, u64)> = cached.take(2).collect();
    assert_eq!(found.len(), 2, "two blocks are cached");
    for &(_, fast) in &found {
        rig.fast
            .flip_bit(dg.sh.layout.log_byte(fast) + 100, 3)
            .unwrap();
    }
    let errors = dg.stats().checksum_errors_by_device[0];
    let (sync_lba, async_lba) = (found[0].0, found[1].0);
    assert_eq!(
        read_block(dg, v, sync_lba),
        block_of(sync_lba, model[sync_lba as usize])
    );
    let mut async_taken = 0;
    let read = read_either(
        rig.group(),
        v,
        async_lba * 4096,
        4096,
        true,
        &mut async_taken,
    );
    assert_eq!(async_taken, 1, "the asynchronous read was taken");
    assert_eq!(
        read.unwrap(),
        block_of(async_lba, model[async_lba as usize])
    );
    assert_eq!(dg.stats().checksum_errors_by_device[0], errors + 2);
    rig.power_cut_and_restart();
    for lba in 0..2048u64 {
        assert_eq!(
            read_block(rig.dg(), v, lba),
            block_of(lba, model[lba as usize]),
            "after power cut"
        );
    }
}

#[test]
fn a_volume_at_its_iops_limit_does_not_slow_its_neighbour() {
    let (cfg, clock) = clocked(small_cfg());
    let rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 67);
    let dg = rig.dg.clone().expect("running");
    let slow = dg
        .create_volume_with_policy(
            "slow",
            4 * MIB,
            &Policy {
                iops_limit: 5,
                ..Policy::default()
            },
        )
        .unwrap()
        .id;
    let quick = dg.create_volume("quick", 4 * MIB).unwrap().id;
    let done = Arc::new(AtomicU64::new(0));
    let (dg2, done2) = (dg.clone(), done.clone());
    let limited = std::thread::spawn(move || {
        for lba in 0..10u64 {
            dg2.write(slow, lba * 4096, &block_of(lba, 6)).unwrap();
            done2.fetch_add(1, Ordering::SeqCst);
        }
    });
    // A second of burst, then the limited writer waits: the clock does not move.
    assert!(eventually(10, || done.load(Ordering::SeqCst) == 5));
    for lba in 0..500u64 {
        dg.write(quick, (lba % 1024) * 4096, &block_of(lba, 7))
            .unwrap();
    }
    assert_eq!(
        done.load(Ordering::SeqCst),
        5,
        "the limited volume went over its limit"
    );
    clock.advance_ms(1000);
    limited.join().unwrap();
    assert_eq!(done.load(Ordering::SeqCst), 10);
    assert!(dg.volume_figures("slow").unwrap().limited_wait_ms >= 1000);
    assert_eq!(dg.volume_figures("quick").unwrap().limited_wait_ms, 0);
}

/// Two policy changes made at once, each naming its own field, both take effect: each is
/// applied to the policy as it stands under the volume table's lock, not to a copy read before.
#[test]
fn concurrent_policy_changes_to_different_fields_are_both_kept() {
    let rig = Rig::new(16 * MIB, &[32 * MIB], small_cfg(), 41);
    rig.dg().create_volume("p", MIB).unwrap();
    let rounds = 200u64;
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 1..=rounds {
                rig.dg()
                    .update_policy("p", |p| {
                        Ok(Policy {
                            iops_limit: i,
                            ..*p
                        })
                    })
                    .unwrap();
            }
        });
        s.spawn(|| {
            for i in 1..=rounds {
                let bandwidth_limit_bytes_per_s = i << 20;
                rig.dg()
                    .update_policy("p", |p| {
                        Ok(Policy {
                            bandwidth_limit_bytes_per_s,
                            ..*p
                        })
                    })
                    .unwrap();
            }
        });
    });
    let p = rig.dg().policy("p").unwrap();
    assert_eq!(p.iops_limit, rounds, "{p:?}");
    assert_eq!(p.bandwidth_limit_bytes_per_s, rounds << 20, "{p:?}");
}

/// A block read while in the log keeps a clean copy in the read cache when it is destaged. If
/// its log block was damaged meanwhile, that copy must not be made from the damaged bytes with
/// a fresh crc: reads would then return the damage as data. They fail with a checksum error.
#[test]
fn a_damaged_log_block_read_before_destage_is_never_served_as_data() {
    let p = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let rig = Rig::new(
        32 * MIB,
        &[48 * MIB],
        EngineConfig {
            read_cache_ratio: 0.2,
            ..small_cfg()
        },
        68,
    );
    let dg = rig.dg();
    let v = dg.create_volume_with_policy("c", 8 * MIB, &p).unwrap().id;
    let lba = 7;
    dg.write(v, lba * 4096, &block_of(lba, 9)).unwrap();
    assert_eq!(
        read_block(dg, v, lba),
        block_of(lba, 9),
        "read while in the log"
    );
    let loc = |dg: &DiskGroup| crate::resolve::resolve_view(&dg.sh, v, lba, 1).unwrap()[0].loc;
    let Some(Loc::Fast(b)) = loc(dg) else {
        panic!("block {lba} is not in the log: {:?}", loc(dg));
    };
    rig.fast
        .flip_bit(dg.sh.layout.log_byte(b) + 100, 3)
        .unwrap();
    // Other writes push the log past its marks: the destager moves the block as it would
    // under load (not a forced drain, which keeps no copies).
    let filler: Vec<u8> = vec![1; 64 * 4096];
    let mut at = 64u64;
    assert!(
        eventually(60, || {
            dg.write(v, at * 4096, &filler).unwrap();
            at = if at + 128 >= 2048 { 64 } else { at + 64 };
            matches!(loc(dg), Some(Loc::Cap { .. }))
        }),
        "block {lba} was not destaged"
    );
    for async_read in [false, true] {
        let mut taken = 0;
        let read = read_either(rig.group(), v, lba * 4096, 4096, async_read, &mut taken);
        assert!(
            matches!(read, Err(EngineError::Corrupt(_))),
            "async {async_read}: the damaged block read as {:?}",
            read.map(|d| d[..16].to_vec())
        );
    }
}

/// Tier mode's minimum age holds for every block, not only for the log's oldest batch: when
/// old data at the tail moves, data written since, still younger than the minimum age, stays.
#[test]
fn tier_mode_moves_old_data_without_the_young_data_behind_it() {
    let (rig, clock, v) = written_tier_volume(small_cfg(), 69, 60);
    let dg = rig.dg();
    clock.advance_ms(61_000);
    for lba in 64..128 {
        dg.write(v, lba * 4096, &block_of(lba, 2)).unwrap();
    }
    assert!(
        eventually(10, || dg.stats().destaged_bytes_total >= 64 * 4096),
        "old, cold data did not move"
    );
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        dg.stats().destaged_bytes_total,
        64 * 4096,
        "data younger than the minimum age moved with the old"
    );
    let young_in_log = (64..128).all(|lba| {
        matches!(
            crate::resolve::resolve_view(&dg.sh, v, lba, 1).unwrap()[0].loc,
            Some(Loc::Fast(_))
        )
    });
    assert!(young_in_log, "a young block left the fast tier");
    for lba in 0..128 {
        assert_eq!(read_block(dg, v, lba), block_of(lba, 1 + (lba >= 64) as u8));
    }
}

/// An asynchronous write handed back to the caller (its range busy here) is written the
/// blocking way, which waits for the volume's limits itself: the refused attempt must not
/// have taken from them too, or the volume gets less than its limit.
#[test]
fn a_write_handed_back_is_charged_to_the_limits_once() {
    let (cfg, _clock) = clocked(small_cfg());
    let rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 70);
    let dg = rig.group();
    let p = Policy {
        iops_limit: 2,
        ..Policy::default()
    };
    let v = dg.create_volume_with_policy("l", 4 * MIB, &p).unwrap().id;
    let head = dg.sh.index.read().volumes[&v].head;
    let data = block_of(0, 8);
    {
        let _busy = dg.sh.ranges.lock(head, 0, 1);
        let never: WriteDone = Box::new(|_| panic!("a refused write must not complete"));
        let back = dg.write_async(v, 0, &data, never);
        assert!(back.is_err(), "the write was not handed back");
    }
    // The clock stands still: the second of burst holds two requests, the write and one more.
    dg.write(v, 0, &data).unwrap();
    let rt = dg.sh.runtime(v).unwrap();
    assert!(
        rt.try_admit(&*dg.sh.cfg.clock, 4096),
        "the refused write took a request from the limits"
    );
}

/// Requests waiting for a volume's limits go on at once when `set_policy` lifts them: they
/// must not keep waiting under the limits they started with.
#[test]
fn lifting_a_limit_releases_the_requests_waiting_for_it() {
    let (cfg, _clock) = clocked(small_cfg());
    let rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 71);
    let dg = rig.group().clone();
    let p = Policy {
        iops_limit: 1,
        ..Policy::default()
    };
    let v = dg.create_volume_with_policy("l", 4 * MIB, &p).unwrap().id;
    let done = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..3u64)
        .map(|lba| {
            let (dg, done) = (dg.clone(), done.clone());
            std::thread::spawn(move || {
                dg.write(v, lba * 4096, &block_of(lba, 9)).unwrap();
                done.fetch_add(1, Ordering::SeqCst);
            })
        })
        .collect();
    // The clock stands still: one request of burst, the other two wait.
    assert!(eventually(10, || done.load(Ordering::SeqCst) == 1));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(done.load(Ordering::SeqCst), 1);
    dg.set_policy("l", &Policy::default()).unwrap();
    assert!(
        eventually(10, || done.load(Ordering::SeqCst) == 3),
        "requests still wait for a limit that was lifted"
    );
    for w in writers {
        w.join().unwrap();
    }
}

/// A clean stop lifts every limit (`lift_limits`): the requests waiting go on at once and
/// succeed, later ones do not wait, and the group runs on until it is shut down.
#[test]
fn lifted_limits_let_every_waiting_request_go_on() {
    let (cfg, _clock) = clocked(small_cfg());
    let rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 73);
    let dg = rig.group().clone();
    let p = Policy {
        iops_limit: 1,
        ..Policy::default()
    };
    let v = dg.create_volume_with_policy("l", 4 * MIB, &p).unwrap().id;
    let (tx, rx) = crossbeam_channel::unbounded();
    for lba in 0..4u64 {
        let (dg, tx) = (dg.clone(), tx.clone());
        std::thread::spawn(move || {
            let r = match lba % 2 {
                0 => dg.write(v, lba * 4096, &block_of(lba, 3)),
                _ => dg.read(v, 0, &mut [0u8; 4096]),
            };
            let _ = tx.send((lba, r));
        });
    }
    // The clock stands still: one request of burst, the other three wait for ever.
    let first = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the burst's request");
    assert!(first.1.is_ok(), "{first:?}");
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
    dg.lift_limits();
    for _ in 0..3 {
        let (lba, r) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a request still waits for a limit that was lifted");
        assert!(r.is_ok(), "request {lba} after the lift: {r:?}");
    }
    dg.write(v, 8 * 4096, &block_of(8, 3)).unwrap();
    for lba in (0..4).step_by(2).chain([8]) {
        let mut back = vec![0u8; 4096];
        dg.read(v, lba * 4096, &mut back).unwrap();
        assert!(back == block_of(lba, 3), "block {lba}");
    }
}

/// A request waiting for its volume's limits stops waiting when the group shuts down (it is
/// then refused), so a slow limit cannot hold a shutdown for as long as its queue needs.
#[test]
fn a_shutdown_ends_the_wait_for_a_limit() {
    let (cfg, _clock) = clocked(small_cfg());
    let rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 72);
    let dg = rig.group().clone();
    let p = Policy {
        iops_limit: 1,
        ..Policy::default()
    };
    let v = dg.create_volume_with_policy("l", 4 * MIB, &p).unwrap().id;
    dg.write(v, 0, &block_of(0, 1)).unwrap();
    let (tx, rx) = crossbeam_channel::bounded(2);
    for kind in ["write", "read"] {
        let (dg, tx) = (dg.clone(), tx.clone());
        std::thread::spawn(move || {
            let r = match kind {
                "write" => dg.write(v, 4096, &block_of(1, 2)),
                _ => dg.read(v, 0, &mut [0u8; 4096]),
            };
            let _ = tx.send((kind, r.is_ok()));
        });
    }
    // The clock stands still: the second of burst is spent, both requests wait.
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
    dg.shutdown().unwrap();
    for _ in 0..2 {
        let (kind, ok) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a request still waits for its limit after the shutdown");
        if kind == "write" {
            assert!(!ok, "a write after the shutdown was accepted");
        }
    }
}

/// A snapshot does not take a tier-mode volume's data out of its policy: the blocks written
/// before it now belong to the snapshot's layer, which the volume still reads through. They
/// stay on the fast tier until they are as old as the policy says (an idle drain, which takes
/// a cache-mode volume's data, left them alone), and those the volume keeps reading stay
/// longer.
#[test]
fn a_snapshot_keeps_a_tier_mode_volumes_data_under_its_policy() {
    let cfg = EngineConfig {
        idle_destage_after: Some(Duration::from_millis(50)),
        ..small_cfg()
    };
    let (rig, clock, v) = written_tier_volume(cfg, 73, 600);
    let dg = rig.dg();
    dg.create_snapshot("t", "s").unwrap();
    // Blocks 0..8 are read again and again through the volume: heat.
    for _ in 0..3 {
        for lba in 0..8 {
            assert_eq!(read_block(dg, v, lba), block_of(lba, 1));
        }
    }
    clock.advance_ms(61_000);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        dg.stats().destaged_bytes_total,
        0,
        "young data moved once a snapshot held it"
    );
    clock.advance_ms(540_000);
    assert!(
        eventually(10, || dg.stats().destaged_bytes_total >= 56 * 4096),
        "the snapshot's old, cold data did not move"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        dg.stats().destaged_bytes_total,
        56 * 4096,
        "the blocks read through the volume moved although hot"
    );
    for lba in 0..64 {
        assert_eq!(read_block(dg, v, lba), block_of(lba, 1));
    }
}

/// Where volume `v`'s block `lba` lives on the capacity tier: (segment, block, generation).
fn capacity_place(dg: &DiskGroup, v: VolumeId, lba: u64) -> (u32, u32, u32) {
    let piece = crate::resolve::resolve_view(&dg.sh, v, lba, 1).unwrap()[0];
    let Some(Loc::Cap { seg, block }) = piece.loc else {
        panic!("block {lba} is on the capacity tier: {piece:?}");
    };
    (seg, block, dg.sh.cache.lock().gen_of(seg))
}

/// A volume's copies in the read cache by its own figures: promoted + kept - evicted.
fn held_by(dg: &DiskGroup, volume: &str) -> i128 {
    let f = dg.volume_figures(volume).unwrap();
    i128::from(f.promoted_bytes) + i128::from(f.kept_bytes) - i128::from(f.evicted_bytes)
}

/// A clone and its origin read the same capacity blocks. A block both promote is one copy,
/// counted for the volume whose copy the cache took first, and its eviction counts for that
/// volume too, whichever volume's copy the log tail passes or reads as damaged: each
/// volume's promoted + kept - evicted is what it holds in the cache.
#[test]
fn a_block_a_clone_and_its_origin_both_promote_is_counted_once() {
    let p = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let (rig, v, _clock) = cached_rig(76, &p, 0.5);
    let dg = rig.dg();
    dg.create_snapshot("c", "s").unwrap();
    let k = dg.clone_snapshot("c", "s", "k").unwrap().id;
    let (rt_c, rt_k) = (dg.sh.runtime(v).unwrap(), dg.sh.runtime(k).unwrap());
    // Both promote block 300 before the log has written either copy.
    let (seg, block, gen) = capacity_place(dg, v, 300);
    dg.promote(Some(&rt_c), seg, block, gen, &block_of(300, 4));
    dg.promote(Some(&rt_k), seg, block, gen, &block_of(300, 4));
    // The origin promotes block 400, whose copy the clone then reads damaged.
    let (seg4, block4, gen4) = capacity_place(dg, v, 400);
    dg.promote(Some(&rt_c), seg4, block4, gen4, &block_of(400, 4));
    promotions_retired(dg);
    assert_eq!(dg.stats().read_cache_bytes, 2 * 4096);
    assert_eq!(held_by(dg, "c") + held_by(dg, "k"), 2 * 4096);
    let fast = dg
        .sh
        .cache
        .lock()
        .lookup(seg4, block4)
        .expect("block 400 is cached");
    rig.fast
        .flip_bit(dg.sh.layout.log_byte(fast) + 100, 3)
        .unwrap();
    assert_eq!(read_block(dg, k, 400), block_of(400, 4));
    promotions_retired(dg);
    // The log tail passes every copy.
    assert!(dg.destage_all(Duration::from_secs(20)));
    assert_eq!(dg.stats().read_cache_bytes, 0, "copies left after a drain");
    for volume in ["c", "k"] {
        let f = dg.volume_figures(volume).unwrap();
        assert_eq!(
            held_by(dg, volume),
            0,
            "volume {volume}: promoted {} kept {} evicted {} with nothing cached",
            f.promoted_bytes,
            f.kept_bytes,
            f.evicted_bytes
        );
    }
}

/// A promotion the read cache's share has room for but the log does not (the capacity tier
/// takes nothing, so the log is not freed) is refused by the log: it is counted as refused
/// like one the cache's share had no room for, so every promotion is taken or counted.
#[test]
fn promotions_the_log_has_no_room_for_are_counted_as_refused() {
    let (cfg, _clock) = clocked(EngineConfig {
        read_cache_ratio: 0.9,
        ..small_cfg()
    });
    let rig = Rig::new(32 * MIB, &[48 * MIB], cfg, 77);
    let dg = rig.dg();
    dg.sh.hold_destager();
    // A quarter of the log holds host writes that stay: the copies below fill the rest of
    // the log before the read cache's share (90% of it).
    let v = dg.create_volume("v", 16 * MIB).unwrap().id;
    let log_blocks = dg.sh.layout.log_blocks;
    for at in (0..log_blocks / 4).step_by(256) {
        dg.write(v, at * 4096, &vec![3u8; 256 * 4096]).unwrap();
    }
    // As when the capacity tier is full: nothing frees the log, and the log writer answers
    // what it has no room for instead of waiting for room.
    dg.sh.counters.capacity_full.store(true, Ordering::Relaxed);
    let segs = dg.sh.cache.lock().seg_gen.len() as u32;
    let data = vec![9u8; 16 * 4096];
    // Each promotion takes a batch of its own: 16 blocks and a header.
    let mut sent = 0u64;
    'fill: for seg in 0..segs {
        let gen = dg.sh.cache.lock().gen_of(seg);
        for block in (0..2048u32).step_by(16) {
            dg.promote(None, seg, block, gen, &data);
            sent += 1;
            if sent.is_multiple_of(32) {
                // Refused once the log is full, which is what this test is after.
                let _ = log_barrier(dg);
            }
            if sent * 17 > log_blocks {
                break 'fill;
            }
        }
    }
    assert!(sent * 17 > log_blocks, "only {sent} promotions sent");
    let counted = || {
        let s = dg.stats();
        (
            s.promoted_bytes_total / (16 * 4096),
            s.promotions_refused_total,
        )
    };
    let all_counted = eventually(20, || {
        let (taken, refused) = counted();
        taken + refused == sent
    });
    let (taken, refused) = counted();
    dg.sh.counters.capacity_full.store(false, Ordering::Relaxed);
    dg.sh.destager_held.store(false, Ordering::Relaxed);
    assert!(
        all_counted,
        "{sent} promotions: {taken} taken, {refused} refused, the rest not counted"
    );
    assert!(refused > 0 && taken > 0, "{taken} taken, {refused} refused");
}

/// A client's read of a snapshot counts in the node's read figures by where it was served
/// from, as a read of a volume does (it is no read of the volume's, which keeps its own
/// figures). (Blocking reads of snapshots counted nowhere: `strata_read_bytes_total` missed
/// them, so a backup read from a snapshot did not show, and the source split no longer added
/// up to the bytes clients read.)
#[test]
fn reads_of_a_snapshot_count_by_where_they_were_served_from() {
    let rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 91);
    let dg = rig.dg();
    let v = dg.create_volume("v", 8 * MIB).unwrap().id;
    dg.write(v, 0, &vec![0x41; 2 * MIB as usize]).unwrap();
    assert!(dg.destage_all(Duration::from_secs(20)));
    dg.write(v, 2 * MIB, &vec![0x42; MIB as usize]).unwrap();
    let s = dg.create_snapshot("v", "s").unwrap().id;
    let volume_before = dg.volume_figures("v").unwrap();
    let before = dg.stats();
    // 2 MiB on the capacity tier, 1 MiB in the log, 1 MiB never written.
    let mut buf = vec![0u8; 4 * MIB as usize];
    dg.read(s, 0, &mut buf).unwrap();
    assert!(buf[..2 * MIB as usize].iter().all(|&b| b == 0x41));
    assert!(buf[2 * MIB as usize..3 * MIB as usize]
        .iter()
        .all(|&b| b == 0x42));
    let after = dg.stats();
    let grew = |a: u64, b: u64| a - b;
    assert_eq!(
        grew(
            after.read_capacity_bytes_total,
            before.read_capacity_bytes_total
        ) + grew(
            after.read_cached_bytes_total,
            before.read_cached_bytes_total
        ),
        2 * MIB,
        "from the capacity tier"
    );
    assert_eq!(
        grew(after.read_fast_bytes_total, before.read_fast_bytes_total),
        MIB,
        "from the log"
    );
    assert_eq!(
        grew(
            after.read_unwritten_bytes_total,
            before.read_unwritten_bytes_total
        ),
        MIB,
        "never written"
    );
    let volume_after = dg.volume_figures("v").unwrap();
    assert_eq!(
        (
            volume_after.read_capacity_bytes,
            volume_after.read_fast_bytes
        ),
        (
            volume_before.read_capacity_bytes,
            volume_before.read_fast_bytes
        ),
        "the volume's own figures took the snapshot's read"
    );
}

/// With the low mark at 0 (or 1%), an idle host had the destager pass the log's tail over the
/// read cache's copies again and again (each one kept written anew at the head) until the
/// cache was gone: in an admin's trial a 3.75 MiB hot set cost 54 MB of fast-tier writes and
/// then its copies. The idle drain moves host data to the capacity tier; with none left in the
/// log, it leaves the read cache alone.
#[test]
fn an_idle_host_keeps_its_read_cache_with_a_low_mark_of_zero() {
    for low in [0.0, 0.01] {
        let cfg = EngineConfig {
            read_cache_ratio: 0.5,
            fill_ratio_low: low,
            fill_ratio_high: 0.7,
            idle_destage_after: Some(Duration::from_millis(50)),
            ..small_cfg()
        };
        let rig = Rig::new(16 * MIB, &[64 * MIB], cfg, 141);
        let dg = rig.dg();
        let promote = Policy {
            promote_after_reads: 1,
            ..Policy::default()
        };
        let v = dg
            .create_volume_with_policy("v", 4 * MIB, &promote)
            .unwrap()
            .id;
        let data: Vec<u8> = (0..256).flat_map(|l| block_of(l, 9)).collect();
        dg.write(v, 0, &data).unwrap();
        assert!(dg.destage_all(Duration::from_secs(20)));
        for lba in 0..256 {
            assert_eq!(read_block(dg, v, lba), block_of(lba, 9));
        }
        assert!(
            eventually(10, || dg.stats().read_cache_bytes >= 256 * 4096),
            "low {low}: not promoted: {}",
            dg.stats().read_cache_bytes
        );
        let written = rig.fast.stats().write_bytes;
        std::thread::sleep(Duration::from_millis(1500));
        let s = dg.stats();
        assert_eq!(s.evicted_bytes_total, 0, "low {low}: the cache was evicted");
        assert!(s.read_cache_bytes >= 256 * 4096, "low {low}");
        let rewritten = rig.fast.stats().write_bytes - written;
        assert!(
            rewritten < 256 * 4096,
            "low {low}: {rewritten} bytes written to the fast tier while idle"
        );
    }
}

/// An idle host with a read cache: the idle drain moves host data out of the log, then stops.
/// Before, a tail whose live data was three quarters of it or less (the read cache's copies
/// beside it counted as garbage) was written again whole at the head, as when the log needs
/// room: the drain went round the log writing the same data again, destaging none of it, until
/// the fill was down to the low mark by evicting the read cache (an admin's trial: 2 GB of
/// fast-tier writes in a minute after 500 MB of host writes, `hot_kept_bytes_total` rising).
#[test]
fn an_idle_drain_moves_host_data_instead_of_rewriting_it() {
    use rand::SeedableRng;
    let cfg = EngineConfig {
        read_cache_ratio: 0.5,
        idle_destage_after: Some(Duration::from_millis(50)),
        ..small_cfg()
    };
    let rig = Rig::new(16 * MIB, &[64 * MIB], cfg, 142);
    let dg = rig.dg();
    let promote = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let v = dg
        .create_volume_with_policy("v", 8 * MIB, &promote)
        .unwrap()
        .id;
    let blocks = 2048;
    let mut tags = vec![1u8; blocks as usize];
    for lba in 0..blocks {
        dg.write(v, lba * 4096, &block_of(lba, 1)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
    // Reads at random places promote about 4 MiB, under the read cache's share.
    let mut rng = rand::rngs::StdRng::seed_from_u64(142);
    let mut order: Vec<u64> = (512..blocks).collect();
    rand::seq::SliceRandom::shuffle(&mut order[..], &mut rng);
    for &lba in &order[..1000] {
        assert_eq!(read_block(dg, v, lba), block_of(lba, 1));
    }
    crate::tests::promotions_retired(dg);
    // A hot part written twice while the destager waits: the log holds the cache's copies,
    // then 1 MiB of host data and as much overwritten.
    dg.sh.hold_destager();
    for tag in [2, 3] {
        for lba in 0..256 {
            dg.write(v, lba * 4096, &block_of(lba, tag)).unwrap();
            tags[lba as usize] = tag;
        }
    }
    // The host is idle from here (the destager sees it: its wait is over).
    crate::tests::promotions_retired(dg);
    std::thread::sleep(Duration::from_millis(150));
    let log_bytes = dg.stats().log_capacity_bytes;
    let s0 = dg.stats();
    let before = (rig.fast.stats().write_bytes, s0.hot_kept_bytes_total);
    dg.sh.destager_held.store(false, Ordering::SeqCst);
    dg.sh.wake_destager();
    let settled = eventually(10, || {
        let w = rig.fast.stats().write_bytes;
        std::thread::sleep(Duration::from_millis(500));
        rig.fast.stats().write_bytes == w
    });
    let s = dg.stats();
    let written = rig.fast.stats().write_bytes - before.0;
    let kept = s.hot_kept_bytes_total - before.1;
    let what = format!("{written} bytes written to the fast tier while idle, {kept} kept: {s:?}");
    assert!(settled, "still writing: {what}");
    assert_eq!(kept, 0, "host data written again while idle: {what}");
    let (at_idle, low) = (s0.log_fill_ratio, s.fill_ratio_low);
    assert!(at_idle > low, "nothing to drain: {s0:?}");
    assert!(
        s.destage_backlog_bytes * 10 < s0.destage_backlog_bytes,
        "the host data was not moved: {what}"
    );
    // The read cache's copies the tail passed, written again.
    assert!(written <= log_bytes / 2, "{what}");
    for lba in 0..blocks {
        assert_eq!(read_block(dg, v, lba), block_of(lba, tags[lba as usize]));
    }
}

/// A tier-mode volume's data written after a cache-mode volume's, with the log below its low
/// mark: once old enough, it moves, and the cache-mode data ahead of it in the log with it
/// (the tail cannot pass it otherwise). Before, below the low mark nothing moved: the tier
/// data stayed on the fast tier for as long as the cache data did (an admin's trial: 8 MiB
/// still there 90 s past a minimum age of 10 s, while a tier volume alone moved in 16 s).
#[test]
fn tier_data_behind_cache_data_below_the_low_mark_moves_when_old() {
    let (cfg, clock) = clocked(small_cfg());
    let rig = Rig::new(32 * MIB, &[48 * MIB], cfg, 143);
    let dg = rig.dg();
    let c = dg.create_volume("c", 4 * MIB).unwrap().id;
    let t = dg
        .create_volume_with_policy("t", 4 * MIB, &tier(10))
        .unwrap()
        .id;
    for lba in 0..256 {
        dg.write(c, lba * 4096, &block_of(lba, 1)).unwrap();
    }
    for lba in 0..256 {
        dg.write(t, lba * 4096, &block_of(lba, 2)).unwrap();
    }
    let s = dg.stats();
    assert!(s.log_fill_ratio < s.fill_ratio_low, "{s:?}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(dg.stats().destaged_bytes_total, 0, "something moved early");
    clock.advance_ms(11_000);
    // Blocks moved, by the residency histogram.
    let moved = || -> u64 { dg.volume_figures("t").unwrap().residency_seconds_log2.iter().sum() };
    assert!(
        eventually(10, || moved() == 256),
        "the tier volume's old data stayed: {} of 256 blocks moved, {:?}",
        moved(),
        dg.stats()
    );
    for lba in 0..256 {
        assert_eq!(read_block(dg, c, lba), block_of(lba, 1));
        assert_eq!(read_block(dg, t, lba), block_of(lba, 2));
    }
}
