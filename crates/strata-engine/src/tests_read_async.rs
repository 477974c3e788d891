//! Asynchronous reads racing writes, destage, garbage collection and the read cache: every
//! block a read returns is the block it asked for, at a version no older than the last one
//! acknowledged before the read began.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use strata_device::{Device, DeviceError, DeviceStats, MemDevice};

use crate::tests::{read_async_wait, read_either, seed_for, small_cfg, Rig, MIB};
use crate::*;

const BLOCKS: u64 = 1024;

/// Block `lba` at `version`: both in its first 16 bytes, the rest derived from them.
fn block(lba: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&version.to_le_bytes());
    for (i, x) in b[16..].iter_mut().enumerate() {
        *x = (lba as u8).wrapping_mul(31) ^ (version as u8).wrapping_add(i as u8);
    }
    b
}

/// The version a block read holds, checking it is a whole block of `lba` (zeros: version 0).
fn version_of(lba: u64, b: &[u8]) -> u64 {
    if b.iter().all(|&x| x == 0) {
        return 0;
    }
    let version = u64::from_le_bytes(b[8..16].try_into().unwrap());
    assert_eq!(
        b,
        &block(lba, version)[..],
        "block {lba}: not a block written to it"
    );
    version
}

#[test]
fn async_reads_racing_writes_destage_and_gc_see_acknowledged_data() {
    let seed = seed_for("async_reads_racing_writes_destage_and_gc_see_acknowledged_data");
    let cfg = EngineConfig {
        fill_ratio_low: 0.05,
        fill_ratio_high: 0.3,
        read_cache_ratio: 0.3,
        ..small_cfg()
    };
    // A capacity tier five times the volume: with 32 MiB the free segments sometimes never
    // ran low enough for GC (most rewrites were kept on the fast tier); with 20 MiB GC cleaned
    // 154-254 segments in seven runs, with and without two CPU hogs running.
    let rig = Rig::new(16 * MIB, &[20 * MIB], cfg, seed);
    let dg = rig.group().clone();
    let v = dg.create_volume("race", BLOCKS * 4096).unwrap().id;
    // acked[lba]: the newest version acknowledged; issued[lba]: the newest started.
    let acked: Vec<AtomicU64> = (0..BLOCKS).map(|_| AtomicU64::new(0)).collect();
    let issued: Vec<AtomicU64> = (0..BLOCKS).map(|_| AtomicU64::new(0)).collect();
    let stop = AtomicBool::new(false);
    let taken = AtomicU64::new(0);
    std::thread::scope(|s| {
        // Two writers, each owning half the blocks, so each block's versions only grow.
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let (dg, acked, issued) = (&dg, &acked, &issued);
                s.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(seed ^ t);
                    for _ in 0..20000 {
                        let lba = rng.gen_range(0..BLOCKS / 2) * 2 + t;
                        let version = issued[lba as usize].fetch_add(1, Ordering::SeqCst) + 1;
                        dg.write(v, lba * 4096, &block(lba, version))
                            .expect("write");
                        acked[lba as usize].store(version, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for r in 0..3u64 {
            let (dg, acked, issued, stop, taken) = (&dg, &acked, &issued, &stop, &taken);
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed ^ (r + 100));
                while !stop.load(Ordering::SeqCst) {
                    // Reads of the hot first quarter repeat, so some get promoted and cached.
                    let lba = match rng.gen_bool(0.5) {
                        true => rng.gen_range(0..BLOCKS / 4),
                        false => rng.gen_range(0..BLOCKS),
                    };
                    let floor = acked[lba as usize].load(Ordering::SeqCst);
                    let Some(read) = read_async_wait(dg, v, lba * 4096, 4096) else {
                        continue;
                    };
                    let b = read.unwrap_or_else(|e| panic!("seed {seed}: read of {lba}: {e}"));
                    let version = version_of(lba, &b);
                    let ceiling = issued[lba as usize].load(Ordering::SeqCst);
                    assert!(
                        floor <= version && version <= ceiling,
                        "seed {seed}: block {lba} read version {version}, acknowledged {floor}, issued {ceiling}"
                    );
                    taken.fetch_add(1, Ordering::Relaxed);
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
        "destaged {} MiB, kept {} MiB, GC cleaned {} segments, {} reads",
        st.destaged_bytes_total / MIB,
        st.hot_kept_bytes_total / MIB,
        st.gc_segments_cleaned_total,
        taken.load(Ordering::Relaxed)
    );
    assert!(st.destaged_bytes_total > 0, "destager never ran: {st:?}");
    assert!(st.gc_segments_cleaned_total > 0, "GC never ran: {st:?}");
    assert!(
        st.read_capacity_bytes_total > 0 && st.read_fast_bytes_total > 0,
        "{st:?}"
    );
    assert!(
        taken.load(Ordering::Relaxed) > 1000,
        "few reads taken: {}",
        taken.load(Ordering::Relaxed)
    );
    assert_eq!(st.checksum_errors_total, 0);
    for lba in 0..BLOCKS {
        let mut b = vec![0u8; 4096];
        dg.read(v, lba * 4096, &mut b).unwrap();
        assert_eq!(
            version_of(lba, &b),
            acked[lba as usize].load(Ordering::SeqCst),
            "block {lba} at the end"
        );
    }
}

/// A device without an asynchronous read path (as with the `threads` backend): every
/// `read_async` is refused and the caller falls back to the blocking read.
struct NoAsyncReads(Arc<MemDevice>);

impl Device for NoAsyncReads {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.0.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.0.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.0.discard(offset, len)
    }
    fn stats(&self) -> DeviceStats {
        self.0.stats()
    }
    fn name(&self) -> &str {
        self.0.name()
    }
}

/// Blocks a sequential scan of 64 destaged blocks promotes, read as the NBD server reads
/// (`read_async` first, the blocking read when it is refused).
fn promoted_by_a_sequential_scan(async_reads: bool) -> u64 {
    let device = |d: MemDevice| -> Arc<dyn Device> {
        match async_reads {
            true => Arc::new(d),
            false => Arc::new(NoAsyncReads(Arc::new(d))),
        }
    };
    let cfg = EngineConfig {
        read_cache_ratio: 0.3,
        ..small_cfg()
    };
    let dg = DiskGroup::open(
        device(MemDevice::new("fast", 32 * MIB)),
        vec![device(MemDevice::new("cap0", 48 * MIB))],
        cfg,
        true,
    )
    .unwrap();
    let p = Policy {
        promote_after_reads: 1,
        promote_sequential_cutoff_bytes: 16 * 1024,
        ..Policy::default()
    };
    let v = dg.create_volume_with_policy("s", 8 * MIB, &p).unwrap().id;
    for lba in 0..64u64 {
        dg.write(v, lba * 4096, &block(lba, 1)).unwrap();
    }
    assert!(dg.destage_all(std::time::Duration::from_secs(30)));
    let mut taken_async = 0;
    for lba in 0..64u64 {
        let b = read_either(&dg, v, lba * 4096, 4096, true, &mut taken_async).unwrap();
        assert_eq!(b, block(lba, 1), "block {lba}");
    }
    assert_eq!(taken_async > 0, async_reads, "reads taken asynchronously");
    crate::tests::promotions_retired(&dg);
    let promoted = dg.volume_figures("s").unwrap().promoted_bytes / 4096;
    dg.shutdown().unwrap();
    promoted
}

/// A refused asynchronous read leaves the volume's stream detector (and its I/O limits) as
/// they were: the blocking read that follows counts the same read again, and counted twice
/// every read looked like the start of a new stream, so a sequential scan was promoted whole.
#[test]
fn a_refused_async_read_does_not_break_sequential_detection() {
    let with_async = promoted_by_a_sequential_scan(true);
    let without = promoted_by_a_sequential_scan(false);
    assert!(
        with_async <= 8,
        "a sequential scan promoted {with_async} blocks"
    );
    assert_eq!(
        without, with_async,
        "without asynchronous reads the same scan promoted {without} blocks"
    );
}

/// An asynchronous read that finds its cached copy damaged is done again the blocking way,
/// without being noted a second time in the volume's stream detector (nor admitted twice).
#[test]
fn a_read_done_again_after_a_damaged_cached_copy_is_noted_once() {
    use crate::ctree::page::key_of;
    let cfg = EngineConfig {
        read_cache_ratio: 0.3,
        ..small_cfg()
    };
    let rig = Rig::new(
        32 * MIB,
        &[48 * MIB],
        cfg,
        seed_for("a_read_done_again_after_a_damaged_cached_copy_is_noted_once"),
    );
    let dg = rig.group().clone();
    let p = Policy {
        promote_after_reads: 1,
        ..Policy::default()
    };
    let v = dg.create_volume_with_policy("s", 8 * MIB, &p).unwrap().id;
    for lba in 0..4u64 {
        dg.write(v, lba * 4096, &block(lba, 1)).unwrap();
    }
    assert!(dg.destage_all(std::time::Duration::from_secs(30)));
    // Block 2 is promoted into the read cache, then its cached copy is damaged.
    let mut b = vec![0u8; 4096];
    dg.read(v, 2 * 4096, &mut b).unwrap();
    let head = dg.sh.index.read().volumes[&v].head;
    let found = crate::meta::with_tree_read(&dg.sh, |t| {
        let mut e = Vec::new();
        t.lookup(key_of(head, 2), key_of(head, 3), &mut e)
            .map(|()| e)
    })
    .unwrap();
    let Some(Loc::Cap { seg, block: at }) = found.first().map(|e| e.loc) else {
        panic!("block 2 is not on the capacity tier: {found:?}")
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let copy = loop {
        if let Some(copy) = dg.sh.cache.lock().lookup(seg, at) {
            break copy;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "block 2 was never promoted"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    rig.fast
        .flip_bit(dg.sh.layout.log_byte(copy) + 100, 3)
        .unwrap();
    // A sequential run of four reads, the third from the damaged copy.
    let read_cached_before = dg.stats().read_cached_bytes_total;
    for lba in 0..4u64 {
        let got = read_async_wait(&dg, v, lba * 4096, 4096).expect("taken asynchronously");
        assert_eq!(got.unwrap(), block(lba, 1), "block {lba}");
    }
    assert_eq!(
        dg.stats().read_cached_bytes_total,
        read_cached_before,
        "the damaged copy was served"
    );
    let rt = dg.sh.runtime(v).unwrap();
    assert_eq!(
        rt.reads.lock().peek(4 * 4096),
        4 * 4096,
        "the four reads are one sequential run"
    );
}
