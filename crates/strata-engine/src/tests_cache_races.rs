//! The read cache against what reuses the blocks its copies live in: a cached copy is served
//! only while the log still holds it, whatever the log writer puts in its place afterwards.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::format::RecordKind;
use crate::map::Loc;
use crate::tests::{promotions_retired, read_either, seed_for, small_cfg, Rig, MIB};
use crate::*;

/// Block `lba` of a volume, tagged.
fn block_of(lba: u64, tag: u8) -> Vec<u8> {
    let mut b = vec![tag; 4096];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b
}

/// A group with a read cache (half the log) whose volume `c` has blocks 0..64 on the
/// capacity tier (`block_of(lba, 4)`), every read of it promoting what it reads, and a
/// scratch volume `w`. Segments of 2 MiB: a stripe takes some 500 blocks of the log.
fn cached_group(seed: u64) -> (Rig, VolumeId, VolumeId) {
    let cfg = EngineConfig {
        read_cache_ratio: 0.5,
        fill_ratio_low: 0.9,
        fill_ratio_high: 0.95,
        segment_size_bytes: 2 * MIB,
        ..small_cfg()
    };
    let rig = Rig::new(16 * MIB, &[64 * MIB], cfg, seed);
    let dg = rig.dg();
    let promote = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let c = dg
        .create_volume_with_policy("c", 4 * MIB, &promote)
        .unwrap()
        .id;
    let w = dg.create_volume("w", 16 * MIB).unwrap().id;
    let data: Vec<u8> = (0..64).flat_map(|l| block_of(l, 4)).collect();
    dg.write(c, 0, &data).unwrap();
    assert!(dg.destage_all(Duration::from_secs(20)));
    (rig, c, w)
}

/// Where block `lba` of `view` lives on the capacity tier.
fn capacity_block(dg: &DiskGroup, view: VolumeId, lba: u64) -> (u32, u32) {
    let piece = crate::resolve::resolve_view(&dg.sh, view, lba, 1).unwrap()[0];
    let Some(Loc::Cap { seg, block }) = piece.loc else {
        panic!("block {lba} is on the capacity tier: {piece:?}");
    };
    (seg, block)
}

/// Writes blocks of `w` (tag 0xee) until a Write record's data takes log block `fast`, which
/// no batch may hold when it starts. Never waits for log space: a write that would not fit
/// beside the log's reserves ends it with an error instead.
fn write_over(dg: &DiskGroup, w: VolumeId, fast: u64) -> Result<(), String> {
    let mut lba = 0;
    for _ in 0..10_000 {
        let n = {
            let log = dg.sh.log.lock();
            let data_there = log.batches.iter().any(|b| {
                b.records.iter().any(|r| {
                    r.kind == RecordKind::Write
                        && (r.data_start..r.data_start + r.nblocks).contains(&fast)
                })
            });
            if data_there {
                return Ok(());
            }
            if log
                .batches
                .iter()
                .any(|b| (b.start..b.start + b.blocks).contains(&fast))
            {
                return Err(format!("a batch took log block {fast} with no data there"));
            }
            // The next batch's header goes at the head: land its data on `fast`, never
            // its header.
            let n = match fast.checked_sub(log.head) {
                Some(0) => return Err("the head reached the block with no batch there".into()),
                Some(d) if d <= 32 => d,
                Some(d) => (d - 2).min(32),
                None => 32,
            };
            let fits = log
                .place(n + 1)
                .is_some_and(|(_, skip)| log.leaves_reserve(n + 1, skip, true, false));
            if !fits {
                return Err(format!("no room for {n} blocks (head {})", log.head));
            }
            n
        };
        let data: Vec<u8> = (lba..lba + n).flat_map(|l| block_of(l, 0xee)).collect();
        dg.write(w, lba * 4096, &data).map_err(|e| e.to_string())?;
        lba = (lba + n) % 2048;
    }
    Err("the log never reached the block".into())
}

/// The log tail passing a cached copy hands its blocks to the log writer. A read that finds
/// the copy in the cache after that would read whatever batch took the blocks, under that
/// batch's checksums: data of another volume, served as this one's without an error. Here the
/// destager, once it has freed the copy's batch, lets a host write land on the copy's block
/// and then reads the block (blocking and asynchronously): the volume's own data must come
/// back.
#[test]
fn a_copy_the_tail_passed_is_not_served_from_blocks_a_new_batch_took() {
    let seed = seed_for("a_copy_the_tail_passed_is_not_served_from_blocks_a_new_batch_took");
    let (rig, c, w) = cached_group(seed);
    let dg = rig.group().clone();
    dg.sh.hold_destager();
    assert_eq!(
        read_either(&dg, c, 10 * 4096, 4096, false, &mut 0).unwrap(),
        block_of(10, 4)
    );
    promotions_retired(&dg);
    let (seg, block) = capacity_block(&dg, c, 10);
    let fast = dg
        .sh
        .cache
        .lock()
        .lookup(seg, block)
        .expect("the read promoted the block");
    // Host data behind the copy: the stripe that takes the copy's batch frees far more than
    // the log's reserves, so a write can reach the copy's block after it.
    for at in (0..1024u64).step_by(32) {
        let data: Vec<u8> = (at..at + 32).flat_map(|l| block_of(l, 1)).collect();
        dg.write(w, at * 4096, &data).unwrap();
    }
    let fired = Arc::new(AtomicBool::new(false));
    // What the hook's reads returned (blocking, then asynchronous), or why it could not read.
    type Seen = Option<Result<Vec<Vec<u8>>, String>>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let group = Arc::downgrade(&dg);
    let (fired2, seen2) = (fired.clone(), seen.clone());
    *dg.sh.after_tail_freed.lock() = Some(Arc::new(move || {
        let Some(dg) = group.upgrade() else {
            return;
        };
        let passed = !dg
            .sh
            .log
            .lock()
            .batches
            .iter()
            .any(|b| (b.start..b.start + b.blocks).contains(&fast));
        if !passed || fired2.swap(true, Ordering::SeqCst) {
            return;
        }
        let reads: Result<Vec<Vec<u8>>, String> = write_over(&dg, w, fast).and_then(|()| {
            let mut taken = 0;
            [false, true]
                .iter()
                .map(|&try_async| {
                    read_either(&dg, c, 10 * 4096, 4096, try_async, &mut taken)
                        .map_err(|e| e.to_string())
                })
                .collect()
        });
        *seen2.lock() = Some(reads);
    }));
    dg.sh.destager_held.store(false, Ordering::SeqCst);
    assert!(dg.destage_all(Duration::from_secs(20)));
    *dg.sh.after_tail_freed.lock() = None;
    assert!(
        fired.load(Ordering::SeqCst),
        "the tail never passed the copy"
    );
    let reads = seen.lock().take().expect("the hook finished");
    let reads = reads.unwrap_or_else(|e| panic!("setup: {e}"));
    for (read, how) in reads.iter().zip(["blocking", "asynchronous"]) {
        assert!(
            read == &block_of(10, 4),
            "{how} read of block 10 after the tail passed its cached copy: tag {:#x}, not 0x4",
            read[4095]
        );
    }
}

const RACE_BLOCKS: u64 = 1024;

/// Block `lba` at `version` (never 0): both in its first 16 bytes, the rest derived from them.
fn versioned(lba: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&version.to_le_bytes());
    for (i, x) in b[16..].iter_mut().enumerate() {
        *x = (lba as u8).wrapping_mul(31) ^ (version as u8).wrapping_add(i as u8);
    }
    b
}

/// Sets the flag when the thread holding it panics: the threads that wait for it stop too,
/// and the test fails instead of hanging.
struct StopOnPanic<'a>(&'a AtomicBool);

impl Drop for StopOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::SeqCst);
        }
    }
}

/// The versions of one block: the newest acknowledged, the newest started, and those that
/// zeroed it (a trim or write-zeroes; version 0, never written, reads as zeros too).
#[derive(Default)]
struct Versions {
    acked: AtomicU64,
    issued: AtomicU64,
    zeroed: Mutex<Vec<u64>>,
}

/// What a read of `lba` returned (`b`) must be: a version within `[floor, ceiling]`.
fn check_version(what: &str, lba: u64, b: &[u8], v: &Versions, floor: u64, ceiling: u64) {
    if b.iter().all(|&x| x == 0) {
        let zeroed = v.zeroed.lock();
        assert!(
            std::iter::once(&0)
                .chain(zeroed.iter())
                .any(|&z| floor <= z && z <= ceiling),
            "{what}: block {lba} read zeros, but no version in {floor}..={ceiling} zeroed it ({zeroed:?})"
        );
        return;
    }
    let version = u64::from_le_bytes(b[8..16].try_into().unwrap());
    assert!(
        b == &versioned(lba, version)[..],
        "{what}: block {lba} holds no block written to it (lba {}, version {version})",
        u64::from_le_bytes(b[..8].try_into().unwrap())
    );
    assert!(
        floor <= version && version <= ceiling,
        "{what}: block {lba} read version {version}, acknowledged {floor}, issued {ceiling}"
    );
}

/// Reads racing every change the read cache's copies must not outlive: two writers (each
/// owning half the volume, so a block's versions only grow) write, trim and write-zeroes runs
/// of blocks while readers (blocking and asynchronous) read a hot quarter of it through a
/// read cache a twentieth of the log, so the log tail keeps passing copies and promotions keep
/// coming; snapshots are taken and deleted (their layers merged) meanwhile, some cloned (the
/// clone kept until the next), and both read against what was acknowledged around the
/// snapshot's creation; the volume's policy changes (promotion, cache or tier mode). The
/// destager destages, keeps hot data and cleans segments all along. Every read returns a version of its own block no older than the
/// newest acknowledged when it began. Then a power cut: every block is its last version.
#[test]
fn reads_racing_overwrites_trims_snapshots_and_eviction_see_acknowledged_data() {
    let seed =
        seed_for("reads_racing_overwrites_trims_snapshots_and_eviction_see_acknowledged_data");
    let cfg = EngineConfig {
        fill_ratio_low: 0.05,
        fill_ratio_high: 0.3,
        read_cache_ratio: 0.05,
        ..small_cfg()
    };
    // A capacity tier seven times the volume: snapshots and a clone pin older versions (with
    // 20 MiB a run was refused NoSpace), and GC still cleans segments, which it then reuses.
    let mut rig = Rig::new(16 * MIB, &[28 * MIB], cfg, seed);
    let dg = rig.group().clone();
    let promote = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let v = dg
        .create_volume_with_policy("race", RACE_BLOCKS * 4096, &promote)
        .unwrap()
        .id;
    let blocks: Vec<Versions> = (0..RACE_BLOCKS).map(|_| Versions::default()).collect();
    let stop = AtomicBool::new(false);
    let deadline = std::time::Instant::now() + Duration::from_millis(2000);
    let reads = AtomicU64::new(0);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let (dg, blocks, stop) = (&dg, &blocks, &stop);
                s.spawn(move || {
                    let _stop = StopOnPanic(stop);
                    let mut rng = StdRng::seed_from_u64(seed ^ t);
                    let half = RACE_BLOCKS / 2;
                    while std::time::Instant::now() < deadline && !stop.load(Ordering::SeqCst) {
                        let n = rng.gen_range(1..=8u64);
                        let lba = t * half + rng.gen_range(0..half - n);
                        let range = lba as usize..(lba + n) as usize;
                        let versions: Vec<u64> = blocks[range.clone()]
                            .iter()
                            .map(|b| b.issued.fetch_add(1, Ordering::SeqCst) + 1)
                            .collect();
                        let zeroing = rng.gen_bool(0.2);
                        if zeroing {
                            for (b, &ver) in blocks[range.clone()].iter().zip(&versions) {
                                b.zeroed.lock().push(ver);
                            }
                            let (off, len) = (lba * 4096, n * 4096);
                            match rng.gen_bool(0.5) {
                                true => dg.discard(v, off, len),
                                false => dg.write_zeroes(v, off, len),
                            }
                            .expect("zeroing");
                        } else {
                            let data: Vec<u8> = (lba..lba + n)
                                .zip(&versions)
                                .flat_map(|(l, &ver)| versioned(l, ver))
                                .collect();
                            dg.write(v, lba * 4096, &data).expect("write");
                        }
                        for (b, &ver) in blocks[range].iter().zip(&versions) {
                            b.acked.store(ver, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for r in 0..2u64 {
            let (dg, blocks, stop, reads) = (&dg, &blocks, &stop, &reads);
            s.spawn(move || {
                let _stop = StopOnPanic(stop);
                let mut rng = StdRng::seed_from_u64(seed ^ (r + 100));
                while !stop.load(Ordering::SeqCst) {
                    let n = rng.gen_range(1..=4u64);
                    let lba = match rng.gen_bool(0.7) {
                        true => rng.gen_range(0..RACE_BLOCKS / 4),
                        false => rng.gen_range(0..RACE_BLOCKS - n),
                    };
                    let range = lba as usize..(lba + n) as usize;
                    let floors: Vec<u64> = blocks[range.clone()]
                        .iter()
                        .map(|b| b.acked.load(Ordering::SeqCst))
                        .collect();
                    let mut taken = 0;
                    let got =
                        read_either(dg, v, lba * 4096, (n * 4096) as usize, r == 0, &mut taken)
                            .unwrap_or_else(|e| panic!("read of {lba}+{n}: {e}"));
                    for (k, b) in blocks[range].iter().enumerate() {
                        let ceiling = b.issued.load(Ordering::SeqCst);
                        let block = &got[k * 4096..(k + 1) * 4096];
                        check_version("read", lba + k as u64, block, b, floors[k], ceiling);
                    }
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        {
            let (dg, blocks, stop) = (&dg, &blocks, &stop);
            s.spawn(move || {
                let _stop = StopOnPanic(stop);
                let mut rng = StdRng::seed_from_u64(seed ^ 200);
                let mut older: Option<String> = None;
                // The clone of an earlier snapshot, and the bounds of what it holds.
                let mut clone: Option<(String, VolumeId, Vec<u64>, Vec<u64>)> = None;
                for i in 0u64.. {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(40));
                    let floors: Vec<u64> = blocks
                        .iter()
                        .map(|b| b.acked.load(Ordering::SeqCst))
                        .collect();
                    let name = format!("s{i}");
                    let snap = dg.create_snapshot("race", &name).expect("snapshot");
                    let ceilings: Vec<u64> = blocks
                        .iter()
                        .map(|b| b.issued.load(Ordering::SeqCst))
                        .collect();
                    if i % 4 == 0 {
                        let k = format!("k{i}");
                        let id = dg.clone_snapshot("race", &name, &k).expect("clone").id;
                        let made = (k, id, floors.clone(), ceilings.clone());
                        if let Some((old, ..)) = clone.replace(made) {
                            dg.delete_volume(&old, false).expect("delete clone");
                        }
                    }
                    if let Some(old) = older.replace(name) {
                        dg.delete_snapshot("race", &old).expect("delete snapshot");
                    }
                    for _ in 0..32 {
                        let lba = rng.gen_range(0..RACE_BLOCKS / 4);
                        let mut b = vec![0u8; 4096];
                        dg.read(snap.id, lba * 4096, &mut b)
                            .unwrap_or_else(|e| panic!("snapshot read of {lba}: {e}"));
                        let (fl, ce) = (floors[lba as usize], ceilings[lba as usize]);
                        check_version("snapshot", lba, &b, &blocks[lba as usize], fl, ce);
                        let Some((_, id, fl, ce)) = &clone else {
                            continue;
                        };
                        dg.read(*id, lba * 4096, &mut b)
                            .unwrap_or_else(|e| panic!("clone read of {lba}: {e}"));
                        let (fl, ce) = (fl[lba as usize], ce[lba as usize]);
                        check_version("clone", lba, &b, &blocks[lba as usize], fl, ce);
                    }
                }
            });
        }
        {
            // The volume's policy changes all along: promotion on and off, cache and tier
            // mode (young tier data stays in the log until the log needs room).
            let (dg, stop) = (&dg, &stop);
            s.spawn(move || {
                let _stop = StopOnPanic(stop);
                let mut rng = StdRng::seed_from_u64(seed ^ 300);
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(25));
                    let p = Policy {
                        mode: match rng.gen_bool(0.3) {
                            true => Mode::Tier,
                            false => Mode::Cache,
                        },
                        promote_after_reads: rng.gen_range(0..=2),
                        ..Policy::default()
                    };
                    dg.set_policy("race", &p).expect("set policy");
                }
            });
        }
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
    });
    let st = dg.stats();
    eprintln!(
        "destaged {} MiB, kept {} MiB, GC cleaned {} segments, {} reads, {} KiB read from the cache, {} KiB promoted, {} KiB evicted",
        st.destaged_bytes_total / MIB,
        st.hot_kept_bytes_total / MIB,
        st.gc_segments_cleaned_total,
        reads.load(Ordering::Relaxed),
        st.read_cached_bytes_total / 1024,
        st.promoted_bytes_total / 1024,
        st.evicted_bytes_total / 1024,
    );
    assert!(
        st.read_cached_bytes_total > 0,
        "no read was served from the cache: {st:?}"
    );
    assert!(st.evicted_bytes_total > 0, "nothing was evicted: {st:?}");
    assert_eq!(st.checksum_errors_total, 0);
    drop(dg);
    rig.power_cut_and_restart();
    let mut b = vec![0u8; 4096];
    for (lba, ver) in (0..RACE_BLOCKS).zip(&blocks) {
        rig.dg().read(v, lba * 4096, &mut b).unwrap();
        let last = ver.acked.load(Ordering::SeqCst);
        check_version("after the power cut", lba, &b, ver, last, last);
    }
}

/// A Cache record's layer field names a capacity segment and its offset a block of it, and
/// segment numbers and layer ids are counted apart: the same number can name both. Neither
/// the log writer nor replay may map such a record into a layer. Here volume c's head layer
/// and the segment its data lives in are both number 2, and the cached copy of its block 110
/// (segment block 10) is written after a host write of its block 10: mapped, the copy would
/// hide that write, at once or after a power cut.
#[test]
fn a_cached_copy_never_stands_for_the_block_its_segment_address_names() {
    let seed = seed_for("a_cached_copy_never_stands_for_the_block_its_segment_address_names");
    let cfg = EngineConfig {
        read_cache_ratio: 0.5,
        fill_ratio_low: 0.9,
        fill_ratio_high: 0.95,
        ..small_cfg()
    };
    let mut rig = Rig::new(16 * MIB, &[48 * MIB], cfg, seed);
    let promote = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let dg = rig.dg();
    let c = dg
        .create_volume_with_policy("c", 4 * MIB, &promote)
        .unwrap()
        .id;
    let data: Vec<u8> = (100..164).flat_map(|l| block_of(l, 4)).collect();
    dg.write(c, 100 * 4096, &data).unwrap();
    assert!(dg.destage_all(Duration::from_secs(20)));
    let (seg, block) = capacity_block(dg, c, 110);
    let head = dg.sh.index.read().volumes[&c].head;
    assert_eq!(
        (seg, block),
        (head, 10),
        "setup: block 110 of c is block 10 of the segment numbered as c's head layer"
    );
    // A promotion by a read, then a host write of block 10, then a copy of block 110 queued
    // after it (as a promotion whose read raced the write would be).
    let mut b = vec![0u8; 4096];
    dg.read(c, 110 * 4096, &mut b).unwrap();
    promotions_retired(dg);
    assert!(dg.sh.cache.lock().lookup(seg, block).is_some(), "promoted");
    dg.write(c, 10 * 4096, &block_of(10, 9)).unwrap();
    let gen = dg.sh.cache.lock().gen_of(seg);
    let rt = dg.sh.runtime(c).unwrap();
    dg.promote(Some(&rt), seg, block, gen, &block_of(110, 4));
    promotions_retired(dg);
    let check = |dg: &DiskGroup, when: &str| {
        let mut b = vec![0u8; 4096];
        for (lba, want) in [(10, block_of(10, 9)), (110, block_of(110, 4))] {
            dg.read(c, lba * 4096, &mut b).unwrap();
            assert!(
                b == want,
                "{when}: block {lba} of c holds lba {} tag {:#x}",
                u64::from_le_bytes(b[..8].try_into().unwrap()),
                b[4095]
            );
        }
    };
    check(dg, "before the power cut");
    rig.power_cut_and_restart();
    check(rig.dg(), "after the power cut");
}
