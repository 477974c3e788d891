//! The read cache against what reuses the blocks its copies live in: a cached copy is served
//! only while the log still holds it, whatever the log writer puts in its place afterwards.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

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
    dg.sh.destager_held.store(true, Ordering::SeqCst);
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
    let seen: Arc<Mutex<Option<Result<Vec<Vec<u8>>, String>>>> = Arc::default();
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
