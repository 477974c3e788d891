//! Reads that go wrong in passing (a bit flipped on the way from the medium, which holds the
//! block right) are read again before the block counts as damaged (reread.rs): host reads of
//! both tiers, blocking and asynchronous, return the data, and destage carries the good copy
//! to the capacity tier, not the bad one; rotation of a full log goes on past such a block.
//! The devices' faults are seeded from the test's seed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_device::FaultConfig;

use crate::tests::{read_either, retry_while_no_space, seed_for, small_cfg, Rig, MIB};
use crate::tests_full_gaps::{
    check_blocks, full_group, hold_destager_while_full, log_only_blocks, trim_until_no_room,
};
use crate::*;

const BLOCK_BYTES: usize = 4096;
// A block is damaged for good only if `REREADS` reads of it in a row flip a bit: at a share
// `r` of reads flipping, `r^8` a mismatch. The host test makes about 8,000 reads at 5% (400
// mismatches, 1.6e-8 that one stays), the destage test about 130 at 15% (20 mismatches,
// 5e-6; 1e-9 that none flips).
/// Share of host reads that flip a bit.
const HOST_FLIP_RATE: f64 = 0.05;
/// Share of destage's reads of the log that flip a bit.
const DESTAGE_FLIP_RATE: f64 = 0.15;
/// Share of rotation's reads of the log that flip a bit, and the reads it must make: 1e-6
/// that none of 20 flips; a block whose 8 rereads all flip (0.4%) stops the rotation for a
/// second, as damage does, and it goes on then.
const ROTATION_FLIP_RATE: f64 = 0.5;
const ROTATION_READS: u64 = 20;

/// MiB `i` of the volume: each block tagged with its number, so a misplaced one shows.
fn mib(i: u64) -> Vec<u8> {
    let mut b = vec![(i as u8).wrapping_mul(37) ^ 0x5a; MIB as usize];
    for (k, block) in b.chunks_mut(BLOCK_BYTES).enumerate() {
        block[..8].copy_from_slice(&(i * 256 + k as u64).to_le_bytes());
    }
    b
}

fn flipping(seed: u64, rate: f64) -> FaultConfig {
    FaultConfig {
        bit_flip_on_read_rate: rate,
        ..FaultConfig::seeded(seed)
    }
}

/// Reads MiB `0..n` back `rounds` times, checking every byte: each MiB whole (blocking), then
/// block by block through the asynchronous path where it takes the read. Returns the reads it
/// took.
fn read_back(
    dg: &std::sync::Arc<DiskGroup>,
    v: VolumeId,
    n: u64,
    rounds: usize,
    what: &str,
) -> u64 {
    let mut buf = vec![0u8; MIB as usize];
    let mut taken = 0;
    for round in 0..rounds {
        for i in 0..n {
            dg.read(v, i * MIB, &mut buf)
                .unwrap_or_else(|e| panic!("{what}: round {round}, a read of MiB {i}: {e}"));
            assert!(buf == mib(i), "{what}: round {round}, MiB {i} read wrong");
            let want = mib(i);
            for (k, block) in want.chunks(BLOCK_BYTES).enumerate() {
                let at = i * MIB + (k * BLOCK_BYTES) as u64;
                let got = read_either(dg, v, at, BLOCK_BYTES, true, &mut taken)
                    .unwrap_or_else(|e| panic!("{what}: round {round}, a read of {at}: {e}"));
                assert!(
                    got == block,
                    "{what}: round {round}, block at {at} read wrong"
                );
            }
        }
    }
    taken
}

/// Host reads of data in the log and on the capacity tier, with a share of the reads of each
/// device flipping a bit: every read returns the data, and the mismatches are counted.
/// (A mismatch was an I/O error at once.)
#[test]
fn host_reads_that_go_wrong_in_passing_are_read_again() {
    let seed = seed_for("host_reads_that_go_wrong_in_passing_are_read_again");
    let cfg = EngineConfig {
        read_cache_ratio: 0.0,
        ..small_cfg()
    };
    let rig = Rig::new(16 * MIB, &[32 * MIB], cfg, seed);
    let dg = rig.group().clone();
    let v = dg.create_volume("v", 8 * MIB).unwrap().id;
    let n = 4;
    dg.sh.hold_destager();
    for i in 0..n {
        dg.write(v, i * MIB, &mib(i)).unwrap();
    }
    rig.fast.set_faults(flipping(seed, HOST_FLIP_RATE));
    let taken = read_back(&dg, v, n, 4, "in the log");
    assert!(taken > 0, "no read of the log was taken asynchronously");
    rig.fast.set_faults(FaultConfig::seeded(seed));
    let in_log = dg.stats().checksum_errors_total;
    assert!(in_log > 0, "no read of the log flipped a bit");
    dg.sh
        .destager_held
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(
        dg.destage_all(Duration::from_secs(30)),
        "the log did not empty"
    );
    // The index pages and the segments' crc blocks the reads need, read once without faults:
    // only the data reads meet them (a flipped metadata read has its own second copy).
    read_back(&dg, v, n, 1, "on the capacity tier, before the faults");
    rig.caps[0].set_faults(flipping(seed + 1, HOST_FLIP_RATE));
    let taken = read_back(&dg, v, n, 4, "on the capacity tier");
    assert!(
        taken > 0,
        "no read of the capacity tier was taken asynchronously"
    );
    rig.caps[0].set_faults(FaultConfig::seeded(seed + 1));
    assert!(
        dg.stats().checksum_errors_total > in_log,
        "no read of the capacity tier flipped a bit"
    );
}

/// Destage with a share of its reads of the log flipping a bit: what reaches the capacity
/// tier is the data, which reads back right once the faults are gone. (The block was moved as
/// read, with the crc it was written with: a lasting checksum error, the log's good copy
/// freed.)
#[test]
fn destage_carries_the_good_copy_of_a_block_read_wrong_in_passing() {
    let seed = seed_for("destage_carries_the_good_copy_of_a_block_read_wrong_in_passing");
    // Batches of 64 KiB: destage reads each with one read, so 8 MiB make about 130.
    let cfg = EngineConfig {
        max_batch_bytes: 64 * 1024,
        ..small_cfg()
    };
    let rig = Rig::new(16 * MIB, &[32 * MIB], cfg, seed);
    let dg = rig.group().clone();
    // Half the log: written with the destager held, it stays there until the faults are on.
    let n = 8;
    let v = dg.create_volume("v", n * MIB).unwrap().id;
    dg.sh.hold_destager();
    for i in 0..n {
        dg.write(v, i * MIB, &mib(i)).unwrap();
    }
    rig.fast.set_faults(flipping(seed, DESTAGE_FLIP_RATE));
    dg.sh
        .destager_held
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(
        dg.destage_all(Duration::from_secs(60)),
        "the log did not empty"
    );
    rig.fast.set_faults(FaultConfig::seeded(seed));
    let flips = dg.stats().checksum_errors_total;
    assert!(flips > 0, "no read of the log flipped a bit");
    read_back(&dg, v, n, 1, "destaged");
    assert_eq!(
        dg.stats().checksum_errors_total,
        flips,
        "a block read wrong in passing was destaged as read"
    );
}

/// Rotation of a full log (trims of data only in the log get their room through it) with half
/// its reads of the log flipping a bit: a block read wrong is read again and rotation goes on,
/// and what it wrote again at the head is the data, after a power cut too. (Rotation stopped at
/// such a block, as at damage, and tried the group again a second later; nothing counted it.)
#[test]
fn rotation_reads_again_a_block_read_wrong_in_passing() {
    let seed = seed_for("rotation_reads_again_a_block_read_wrong_in_passing");
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut rig, v, mut model, _) = full_group(seed, 64);
    let sh = rig.group().sh.clone();
    hold_destager_while_full(rig.dg());
    trim_until_no_room(rig.dg(), v, &mut rng, &mut model);
    let reads = Arc::new(AtomicU64::new(0));
    let counted = reads.clone();
    *sh.after_rotation_read.lock() = Some(Arc::new(move |_: &[(u32, u64, u64)]| {
        counted.fetch_add(1, Ordering::SeqCst);
    }));
    let before = rig.dg().stats().checksum_errors_total;
    rig.fast.set_faults(flipping(seed, ROTATION_FLIP_RATE));
    sh.destager_held.store(false, Ordering::SeqCst);
    sh.wake_destager();
    // Trims of single blocks of log-only data, each needing room rotation makes.
    let mut blocks = log_only_blocks(rig.dg(), v);
    let deadline = Instant::now() + Duration::from_secs(60);
    while reads.load(Ordering::SeqCst) < ROTATION_READS {
        assert!(
            Instant::now() < deadline && !blocks.is_empty(),
            "rotation read {} batches",
            reads.load(Ordering::SeqCst)
        );
        let b = blocks.swap_remove(rng.gen_range(0..blocks.len()));
        let trim = || {
            rig.dg()
                .discard(v, b * BLOCK_BYTES as u64, BLOCK_BYTES as u64)
        };
        retry_while_no_space(Duration::from_secs(10), trim)
            .unwrap_or_else(|e| panic!("a trim of block {b}: {e}"));
        model[b as usize] = 0;
    }
    *sh.after_rotation_read.lock() = None;
    rig.fast.set_faults(FaultConfig::seeded(seed));
    let mismatches = rig.dg().stats().checksum_errors_total - before;
    assert!(mismatches > 0, "no read of rotation's flipped a bit");
    drop(sh);
    rig.power_cut_and_restart();
    check_blocks(rig.dg(), v, &model);
}
