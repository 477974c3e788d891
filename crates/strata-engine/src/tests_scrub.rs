//! Scrub against injected damage: data blocks on each tier and one copy of each kind of
//! metadata. Every bad block must be reported by volume and offset, reads of it must fail,
//! and every damaged metadata copy must be repaired from the good one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata_device::{AlignedBuf, Device, FaultConfig, MemDevice};

use crate::tests::{small_cfg, Rig, MIB};
use crate::*;

/// Block `lba` of the test volume: its number in the first 8 bytes, then a fill byte.
pub(crate) fn block_of(lba: u64, fill: u8) -> Vec<u8> {
    let mut b = vec![fill; 4096];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b
}

/// Byte offset on `dev` of the block holding exactly `content`.
pub(crate) fn find_block(dev: &MemDevice, content: &[u8]) -> u64 {
    try_find_block(dev, content).unwrap_or_else(|| panic!("block not found on {}", dev.name()))
}

fn try_find_block(dev: &MemDevice, content: &[u8]) -> Option<u64> {
    let mut b = AlignedBuf::new_zeroed(4096);
    (0..dev.size_bytes() / 4096)
        .map(|blk| blk * 4096)
        .find(|&off| {
            dev.read_at(&mut b, off).unwrap();
            b[..] == content[..]
        })
}

/// Byte offset (on its capacity device) of copy A of the durable index's root page.
fn root_page_copy_a(dg: &DiskGroup) -> u64 {
    let root = dg
        .sh
        .durable
        .lock()
        .index_root
        .expect("an index was written");
    let (seg, block) = ((root.a >> 32) as usize, root.a as u32 as u64);
    let (dev, off) = dg.sh.layout.segments[seg];
    assert_eq!(dev, 0, "one capacity device");
    off + block * 4096
}

pub(crate) fn read_fails(dg: &DiskGroup, view: u32, offset: u64) -> bool {
    let mut b = vec![0u8; 4096];
    matches!(dg.read(view, offset, &mut b), Err(EngineError::Corrupt(_)))
}

#[test]
fn scrub_reports_every_bad_block_and_repairs_every_metadata_copy() {
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 41);
    let v = rig.dg().create_volume("v", 4 * MIB).unwrap().id;
    // Blocks 0..512 go to the capacity tier, then a snapshot; blocks 512..1024 stay in the log.
    for lba in 0..512u64 {
        rig.dg().write(v, lba * 4096, &block_of(lba, 0x11)).unwrap();
    }
    assert!(rig.dg().destage_all(Duration::from_secs(10)));
    rig.dg().create_snapshot("v", "s").unwrap();
    for lba in 512..1024u64 {
        rig.dg().write(v, lba * 4096, &block_of(lba, 0x22)).unwrap();
    }
    // A clean restart writes the index, so there are index pages on the capacity device.
    rig.clean_restart();
    let clean = rig.dg().scrub(&ScrubOptions::default()).unwrap();
    assert!(
        clean.clean() && clean.metadata_repaired.is_empty(),
        "{clean:?}"
    );
    assert!(clean.data_bytes_verified >= 4 * MIB, "{clean:?}");

    // Two capacity blocks (held by the snapshot's layer), two log blocks (the volume's).
    for lba in [7u64, 300] {
        rig.caps[0]
            .flip_bit(find_block(&rig.caps[0], &block_of(lba, 0x11)) + 99, 2)
            .unwrap();
    }
    for lba in [600u64, 1000] {
        rig.fast
            .flip_bit(find_block(&rig.fast, &block_of(lba, 0x22)) + 17, 5)
            .unwrap();
    }
    // One copy of each kind of metadata.
    rig.caps[0].flip_bit(4096 + 300, 1).unwrap(); // superblock copy B of the capacity device
    rig.fast.flip_bit(MIB + 80, 3).unwrap(); // checkpoint copy A
    let root = root_page_copy_a(rig.dg());
    rig.caps[0].flip_bit(root + 200, 4).unwrap();

    let dg = rig.dg();
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    let mut bad: Vec<(String, u64, &str)> = report
        .bad_blocks
        .iter()
        .map(|b| (b.volume.clone(), b.offset, b.tier.as_str()))
        .collect();
    bad.sort();
    assert_eq!(
        bad,
        vec![
            ("v".to_string(), 600 * 4096, "fast"),
            ("v".to_string(), 1000 * 4096, "fast"),
            ("v@s".to_string(), 7 * 4096, "capacity"),
            ("v@s".to_string(), 300 * 4096, "capacity"),
        ],
        "{report:#?}"
    );
    let repaired = report.metadata_repaired.join("\n");
    assert!(repaired.contains("superblock copy B"), "{repaired}");
    assert!(repaired.contains("checkpoint: copy A"), "{repaired}");
    assert!(repaired.contains("index page copy"), "{repaired}");
    assert!(report.metadata_damaged.is_empty(), "{report:#?}");

    // Damaged data is an error to readers, never data; everything else reads back.
    let snap = dg.view("v@s").unwrap().id;
    for lba in [7u64, 300, 600, 1000] {
        assert!(read_fails(dg, v, lba * 4096), "block {lba} read as data");
    }
    assert!(read_fails(dg, snap, 7 * 4096));
    let mut b = vec![0u8; 4096];
    dg.read(v, 8 * 4096, &mut b).unwrap();
    assert_eq!(b, block_of(8, 0x11));

    // A second scrub finds the same data damage and no metadata left to repair.
    let again = dg.scrub(&ScrubOptions::default()).unwrap();
    assert_eq!(again.bad_blocks_total, 4);
    assert!(again.metadata_repaired.is_empty(), "{again:#?}");
    // And the repaired metadata holds across a restart.
    rig.clean_restart();
    let after = rig
        .dg()
        .scrub(&ScrubOptions {
            volume: Some("v".into()),
            rate_bytes_per_s: 0,
            cancel: None,
        })
        .unwrap();
    assert_eq!(after.bad_blocks_total, 4, "{after:#?}");
    assert!(
        after.metadata_repaired.is_empty() && after.metadata_damaged.is_empty(),
        "{after:#?}"
    );
}

/// A damaged capacity block the volume has overwritten or trimmed since (the new copy, or the
/// trim, still in the write log) is not reported: no read meets it, and the new copy's destage
/// releases it. A damaged block the volume still reads is. (Both were listed, "restore them
/// from a backup", until the log was destaged: for a `tier` volume or a quiet log, long.)
#[test]
fn a_damaged_block_overwritten_since_is_not_reported() {
    let rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 44);
    let dg = rig.dg();
    let v = dg.create_volume("v", 4 * MIB).unwrap().id;
    for lba in 0..64u64 {
        dg.write(v, lba * 4096, &block_of(lba, 0x11)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(10)));
    for lba in [5u64, 9, 20] {
        rig.caps[0]
            .flip_bit(find_block(&rig.caps[0], &block_of(lba, 0x11)) + 99, 2)
            .unwrap();
    }
    dg.sh.hold_destager();
    dg.write(v, 5 * 4096, &block_of(5, 0x33)).unwrap();
    dg.discard(v, 9 * 4096, 4096).unwrap();
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    let bad: Vec<u64> = report.bad_blocks.iter().map(|b| b.offset).collect();
    assert_eq!(bad, vec![20 * 4096], "{report:#?}");
    assert!(read_fails(dg, v, 20 * 4096));
    let mut b = vec![0u8; 4096];
    dg.read(v, 5 * 4096, &mut b).unwrap();
    assert_eq!(b, block_of(5, 0x33));
    dg.read(v, 9 * 4096, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0));
    dg.sh
        .destager_held
        .store(false, std::sync::atomic::Ordering::SeqCst);
}

#[test]
fn scrub_of_one_volume_checks_only_its_blocks_and_keeps_to_its_rate() {
    let rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 42);
    let dg = rig.dg();
    let a = dg.create_volume("a", 2 * MIB).unwrap().id;
    let b = dg.create_volume("b", 2 * MIB).unwrap().id;
    dg.write(a, 0, &vec![1u8; 2 * MIB as usize]).unwrap();
    dg.write(b, 0, &vec![2u8; MIB as usize]).unwrap();
    let started = std::time::Instant::now();
    let r = dg
        .scrub(&ScrubOptions {
            volume: Some("b".into()),
            rate_bytes_per_s: 4 * MIB,
            cancel: None,
        })
        .unwrap();
    assert_eq!(r.data_bytes_verified, MIB, "{r:?}");
    // 1 MiB of data plus metadata at 4 MiB/s takes at least a quarter of a second.
    assert!(
        started.elapsed() >= Duration::from_millis(240),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(
        dg.scrub(&ScrubOptions {
            volume: Some("nope".into()),
            rate_bytes_per_s: 0,
            cancel: None,
        }),
        Err(EngineError::NotFound(_))
    ));
    let status = dg.scrub_status();
    assert!(!status.running && status.last.is_some_and(|l| l.scope == "b"));
}

/// A scrub's total is what it reads: the group's metadata, then the data of its scope, here
/// one volume's 3 MiB (2 of them destaged) beside another's 12 MiB. (A volume's total was half
/// of all data, so a scrub of a volume holding most of it read past its total.)
#[test]
fn a_volume_scrubs_total_is_what_it_reads() {
    let rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 43);
    let dg = rig.dg();
    let a = dg.create_volume("a", 16 * MIB).unwrap().id;
    let b = dg.create_volume("b", 16 * MIB).unwrap().id;
    dg.write(a, 0, &vec![1u8; 2 * MIB as usize]).unwrap();
    dg.write(b, 0, &vec![2u8; 12 * MIB as usize]).unwrap();
    assert!(dg.destage_all(Duration::from_secs(10)));
    // Nothing moves between the tiers while the scrubs count and read.
    dg.sh.destager_held.store(true, Ordering::SeqCst);
    dg.write(a, 4 * MIB, &vec![3u8; MIB as usize]).unwrap();
    for volume in ["a", "b"] {
        let r = dg
            .scrub(&ScrubOptions {
                volume: Some(volume.into()),
                rate_bytes_per_s: 0,
                cancel: None,
            })
            .unwrap();
        let status = dg.scrub_status();
        let (read, total) = (status.progress_bytes, status.total_bytes);
        assert_eq!(read, total, "{volume}: {status:?} {r:?}");
        let want = if volume == "a" { 3 * MIB } else { 12 * MIB };
        assert_eq!(r.data_bytes_verified, want, "{volume}");
    }
}

#[test]
fn scrub_keeps_to_a_rate_below_one_chunk_per_200_ms() {
    // Batches large enough that the data is read in 1 MiB chunks.
    let cfg = EngineConfig {
        segment_size_bytes: 8 * MIB,
        max_batch_bytes: 2 << 20,
        ..small_cfg()
    };
    let rig = Rig::new(32 * MIB, &[48 * MIB], cfg, 43);
    let dg = rig.dg();
    let b = dg.create_volume("b", 4 * MIB).unwrap().id;
    dg.write(b, 0, &vec![2u8; 4 * MIB as usize]).unwrap();
    let started = std::time::Instant::now();
    let r = dg
        .scrub(&ScrubOptions {
            volume: Some("b".into()),
            rate_bytes_per_s: 2 * MIB,
            cancel: None,
        })
        .unwrap();
    assert_eq!(r.data_bytes_verified, 4 * MIB, "{r:?}");
    // Read 1 MiB at a time, each chunk half a second's worth: 4 MiB at 2 MiB/s takes two
    // seconds, not one 200 ms nap a chunk.
    assert!(
        started.elapsed() >= Duration::from_millis(1990),
        "{:?}",
        started.elapsed()
    );
}

/// A group with volume `b`, 4 MiB written: a scrub of it at 64 KiB/s lasts about 64 s.
fn rig_with_b(seed: u64) -> Rig {
    let rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), seed);
    let dg = rig.dg();
    let b = dg.create_volume("b", 4 * MIB).unwrap().id;
    dg.write(b, 0, &vec![2u8; 4 * MIB as usize]).unwrap();
    rig
}

/// Runs `opts`'s scrub, calls `stop` once it shows as running, and returns how it ended.
fn scrub_stopped_by(
    dg: &DiskGroup,
    opts: &ScrubOptions,
    stop: impl FnOnce(),
) -> Result<ScrubReport, EngineError> {
    std::thread::scope(|s| {
        let run = s.spawn(|| dg.scrub(opts));
        while !dg.scrub_status().running {
            std::thread::sleep(Duration::from_millis(10));
        }
        stop();
        run.join().unwrap()
    })
}

/// A cancelled scrub left no result, and the next scrub of `b` runs to its end.
fn assert_cancelled_then_free(dg: &DiskGroup, scrub: Result<ScrubReport, EngineError>) {
    assert!(matches!(scrub, Err(EngineError::Cancelled(_))), "{scrub:?}");
    let status = dg.scrub_status();
    assert!(!status.running && status.last.is_none(), "{status:?}");
    let again = ScrubOptions {
        volume: Some("b".into()),
        ..ScrubOptions::default()
    };
    assert!(dg.scrub(&again).unwrap().clean());
}

#[test]
fn a_cancelled_scrub_stops_and_leaves_the_last_result_alone() {
    let rig = rig_with_b(44);
    let dg = rig.dg();
    let cancel = Arc::new(AtomicBool::new(false));
    let slow = ScrubOptions {
        volume: Some("b".into()),
        // About 64 s for this volume: only a cancel ends it within the test.
        rate_bytes_per_s: 64 << 10,
        cancel: Some(cancel.clone()),
    };
    let started = std::time::Instant::now();
    let scrub = scrub_stopped_by(dg, &slow, || cancel.store(true, Ordering::Relaxed));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert_cancelled_then_free(dg, scrub);
}

#[test]
fn a_scrub_anyone_started_stops_when_the_group_is_asked_to_cancel_it() {
    let rig = rig_with_b(45);
    let dg = rig.dg();
    assert!(!dg.cancel_scrub(), "no scrub runs yet");
    // No cancel flag of its own, as the background scrub has none.
    let slow = ScrubOptions {
        volume: Some("b".into()),
        rate_bytes_per_s: 64 << 10,
        cancel: None,
    };
    let scrub = scrub_stopped_by(dg, &slow, || assert!(dg.cancel_scrub()));
    assert!(!dg.cancel_scrub(), "nothing left to cancel");
    // The request was for that scrub: the next one runs to its end.
    assert_cancelled_then_free(dg, scrub);
}

/// A scrub started with nobody waiting for it holds the slot from the moment `start_scrub`
/// returns, runs to its end with its report as the last result, can be cancelled, and a
/// clean stop of the group waits for it to end rather than leave it reading.
#[test]
fn a_started_scrub_runs_on_its_own_and_stops_with_the_group() {
    let mut rig = rig_with_b(46);
    let dg = rig.dg();
    let slow = ScrubOptions {
        volume: Some("b".into()),
        rate_bytes_per_s: 64 << 10,
        cancel: None,
    };
    dg.start_scrub(slow.clone()).unwrap();
    assert!(dg.scrub_status().running, "not running once started");
    let again = dg.start_scrub(ScrubOptions::default());
    assert!(matches!(again, Err(EngineError::InUse(_))), "{again:?}");
    assert!(matches!(dg.scrub(&slow), Err(EngineError::InUse(_))));
    // Cancelled: no result.
    assert!(dg.cancel_scrub());
    let began = std::time::Instant::now();
    while dg.scrub_status().running {
        assert!(began.elapsed() < Duration::from_secs(10), "not cancelled");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(dg.scrub_status().last.is_none());
    // Unlimited, it ends by itself with its report.
    dg.start_scrub(ScrubOptions {
        volume: Some("b".into()),
        ..ScrubOptions::default()
    })
    .unwrap();
    let began = std::time::Instant::now();
    let last = loop {
        let status = dg.scrub_status();
        if let (false, Some(last)) = (status.running, status.last) {
            break last;
        }
        assert!(began.elapsed() < Duration::from_secs(30), "never ended");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        last.clean() && last.data_bytes_verified >= 4 * MIB,
        "{last:?}"
    );
    // A slow one again, then a clean stop: it ends with the group, promptly.
    dg.start_scrub(slow).unwrap();
    let dg = rig.dg.take().expect("running");
    let began = std::time::Instant::now();
    dg.shutdown().unwrap();
    assert!(!dg.scrub_status().running, "still running after the stop");
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "the stop took {:?}",
        began.elapsed()
    );
}

/// Fill marks that keep the destager idle while a test's batches stay in the log.
fn idle_log_cfg() -> EngineConfig {
    EngineConfig {
        fill_ratio_low: 0.9,
        fill_ratio_high: 0.95,
        ..small_cfg()
    }
}

/// A group (`idle_log_cfg`) whose 1 MiB volume "v" has `n` single-block batches in the log,
/// block `lba` holding `block_of(lba, 0x33)`.
pub(crate) fn log_rig(seed: u64, n: u64) -> (Rig, u32) {
    let rig = Rig::new(32 * MIB, &[24 * MIB], idle_log_cfg(), seed);
    let v = rig.dg().create_volume("v", MIB).unwrap().id;
    one_batch_per_block(rig.dg(), v, n);
    (rig, v)
}

/// Flips a bit in the header of the batch holding block `lba` of `log_rig`'s volume: the
/// header block sits just before its single data block.
pub(crate) fn damage_header_of(rig: &Rig, lba: u64) {
    let data_at = find_block(&rig.fast, &block_of(lba, 0x33));
    rig.fast.flip_bit(data_at - 4096 + 100, 6).unwrap();
}

/// Writes `n` single-block records, each in its own batch (one writer, one at a time).
fn one_batch_per_block(dg: &DiskGroup, v: u32, n: u64) {
    for lba in 0..n {
        dg.write(v, lba * 4096, &block_of(lba, 0x33)).unwrap();
    }
}

#[test]
fn damaged_log_data_of_an_acknowledged_batch_is_an_error_not_the_end_of_the_log() {
    let (mut rig, v) = log_rig(43, 100);
    rig.fast
        .flip_bit(find_block(&rig.fast, &block_of(10, 0x33)) + 5, 0)
        .unwrap();
    rig.power_cut_and_restart();
    let dg = rig.dg();
    assert_eq!(dg.open_report().damaged_log_records, 1);
    assert!(
        read_fails(dg, v, 10 * 4096),
        "the damaged block read as data"
    );
    for lba in (0..100).filter(|&l| l != 10) {
        let mut b = vec![0u8; 4096];
        dg.read(v, lba * 4096, &mut b).unwrap();
        assert_eq!(
            b,
            block_of(lba, 0x33),
            "block {lba} after the damaged one was lost"
        );
    }
    let r = dg.scrub(&ScrubOptions::default()).unwrap();
    assert_eq!(
        r.bad_blocks.iter().map(|b| b.offset).collect::<Vec<_>>(),
        vec![10 * 4096]
    );
}

/// A committer held up after moving the turn on records its batch as acknowledged after the
/// next batch's committer has recorded that one: `committed_seq` must not go back. Gone back,
/// the header of the batch written next says the batch before it was never acknowledged, and
/// replay takes damage in that batch for a torn write and drops it and everything after it.
#[test]
fn a_late_committer_does_not_take_back_a_later_batchs_acknowledgement() {
    let cfg = EngineConfig {
        log_runs: false,
        ..idle_log_cfg()
    };
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 45);
    let v = rig.dg().create_volume("v", MIB).unwrap().id;
    one_batch_per_block(rig.dg(), v, 4);
    let (entered, entered_rx) = crossbeam_channel::bounded(1);
    let (release, release_rx) = crossbeam_channel::bounded::<()>(1);
    let first = AtomicBool::new(true);
    *rig.dg().sh.after_turn_moved.lock() = Some(Arc::new(move |_end| {
        if first.swap(false, Ordering::SeqCst) {
            let _ = entered.send(());
            let _ = release_rx.recv_timeout(Duration::from_secs(30));
        }
    }));
    // Batch A's committer stops after the turn moved on; batch B is written and acknowledged
    // meanwhile; then A's committer goes on.
    let dg = rig.group().clone();
    let a = std::thread::spawn(move || dg.write(v, 10 * 4096, &block_of(10, 0x44)));
    entered_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("batch A retired");
    rig.dg().write(v, 11 * 4096, &block_of(11, 0x44)).unwrap();
    release.send(()).unwrap();
    a.join().unwrap().unwrap();
    *rig.dg().sh.after_turn_moved.lock() = None;
    // Batch C's header names the batches acknowledged before it: B among them.
    rig.dg().write(v, 12 * 4096, &block_of(12, 0x44)).unwrap();
    rig.fast
        .flip_bit(find_block(&rig.fast, &block_of(11, 0x44)) + 5, 0)
        .unwrap();
    rig.power_cut_and_restart();
    let dg = rig.dg();
    assert_eq!(dg.open_report().damaged_log_records, 1, "B kept as damaged");
    assert!(
        read_fails(dg, v, 11 * 4096),
        "B's damaged block read as data"
    );
    for lba in [10, 12] {
        let mut b = vec![0u8; 4096];
        dg.read(v, lba * 4096, &mut b).unwrap();
        assert_eq!(b, block_of(lba, 0x44), "acknowledged block {lba} was lost");
    }
}

#[test]
fn a_damaged_batch_header_mid_log_refuses_to_open_instead_of_losing_later_writes() {
    for clean in [false, true] {
        let (mut rig, _) = log_rig(44, 50);
        damage_header_of(&rig, 20);
        if let Some(dg) = rig.dg.take() {
            if clean {
                dg.shutdown().unwrap();
            } else {
                dg.halt_for_test();
            }
        }
        let err = rig.start().expect_err("opened over a damaged log");
        assert!(
            err.to_string().contains("write log is damaged"),
            "clean {clean}: {err}"
        );
    }
}

/// A damaged header of a batch in the write log, at which a start would refuse to open (above),
/// is found by a scrub of the running group and repaired by destaging the log past it: the
/// next start, after a power cut too, opens, and every block reads back. (Scrub did not look
/// at headers: it said the group was clean, and the next start refused to open.)
#[test]
fn scrub_destages_the_log_past_a_damaged_batch_header() {
    let (mut rig, v) = log_rig(46, 50);
    damage_header_of(&rig, 20);
    let report = rig.dg().scrub(&ScrubOptions::default()).unwrap();
    assert!(
        report
            .metadata_repaired
            .iter()
            .any(|r| r.contains("write log: the header of the batch at sequence")),
        "{report:#?}"
    );
    assert!(
        report.bad_blocks.is_empty() && report.metadata_damaged.is_empty(),
        "{report:#?}"
    );
    rig.power_cut_and_restart();
    let mut b = vec![0u8; 4096];
    for lba in 0..50u64 {
        rig.dg().read(v, lba * 4096, &mut b).unwrap();
        assert_eq!(b, block_of(lba, 0x33), "block {lba}");
    }
}

#[test]
fn checksum_failures_are_counted_on_the_device_that_holds_the_bad_copy() {
    let rig = Rig::new(32 * MIB, &[24 * MIB, 24 * MIB], small_cfg(), 45);
    let dg = rig.dg();
    let v = dg.create_volume("v", 4 * MIB).unwrap().id;
    for lba in 0..64u64 {
        dg.write(v, lba * 4096, &block_of(lba, 0x44)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(10)));
    dg.write(v, 100 * 4096, &block_of(100, 0x55)).unwrap();
    rig.fast
        .flip_bit(find_block(&rig.fast, &block_of(100, 0x55)) + 9, 1)
        .unwrap();
    let on = (0..2)
        .find(|&i| try_find_block(&rig.caps[i], &block_of(5, 0x44)).is_some())
        .expect("destaged");
    rig.caps[on]
        .flip_bit(find_block(&rig.caps[on], &block_of(5, 0x44)) + 9, 1)
        .unwrap();
    assert!(read_fails(dg, v, 100 * 4096) && read_fails(dg, v, 5 * 4096));
    let by_dev = dg.stats().checksum_errors_by_device;
    let mut want = vec![1, 0, 0];
    want[1 + on] = 1;
    assert_eq!(by_dev, want);
}

/// A metadata read that fails (here the fast device's first reads: both superblock copies and
/// then a checkpoint copy) stops that part of the scrub, not the scrub: the report says so and
/// keeps what else it found, and the data after it is still checked.
#[test]
fn a_failed_metadata_read_is_reported_not_the_end_of_the_scrub() {
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 43);
    let v = rig.dg().create_volume("v", 4 * MIB).unwrap().id;
    for lba in 0..512u64 {
        rig.dg().write(v, lba * 4096, &block_of(lba, 0x11)).unwrap();
    }
    assert!(rig.dg().destage_all(Duration::from_secs(10)));
    let w = rig.dg().create_volume("w", MIB).unwrap().id;
    rig.dg().write(w, 0, &block_of(0, 0x33)).unwrap();
    rig.clean_restart();
    // w's block is in the log: damaged, to see that the scrub gets that far.
    rig.fast
        .flip_bit(find_block(&rig.fast, &block_of(0, 0x33)) + 17, 5)
        .unwrap();
    rig.fast.fail_next_reads(3);
    let dg = rig.dg();
    let report = dg
        .scrub(&ScrubOptions::default())
        .expect("a report, not an error");
    assert!(!report.clean(), "{report:#?}");
    let damaged = report.metadata_damaged.join("\n");
    assert!(damaged.contains("both superblock copies"), "{damaged}");
    assert!(damaged.contains("stopped early"), "{damaged}");
    assert!(
        report.bad_blocks.iter().any(|b| b.volume == "w"),
        "the scrub stopped before w: {report:#?}"
    );
    let last = dg.scrub_status().last.expect("the report is kept");
    assert_eq!(last.metadata_damaged, report.metadata_damaged);
}

/// A scrub, or an open, that finds one checkpoint copy damaged rewrites that copy first: a
/// power cut at any of its writes, tearing the block being written, leaves a whole copy to
/// open from. (Both used to start with copy A whatever was damaged, so with B rotten a cut
/// there could lose the group: "both metadata copies are unreadable".)
#[test]
fn a_power_cut_while_a_checkpoint_copy_is_repaired_leaves_the_good_one() {
    for damaged in [0, 1] {
        // Crash seeds: which block of the checkpoint is torn, and where.
        for seed in 0..8 {
            for by_scrub in [true, false] {
                for n in 0.. {
                    assert!(n < 100, "the repair never finished");
                    if !repair_cut_at_write(damaged, seed, by_scrub, n) {
                        break;
                    }
                }
            }
        }
    }
}

/// Damages checkpoint copy `damaged` and repairs it (by a scrub, or by an open after a clean
/// shutdown) with the power going off at write `n` (the block being written torn, the rest
/// of what is unflushed lost); then the group must open with its data. False when the repair
/// finished before write `n`.
fn repair_cut_at_write(damaged: usize, seed: u64, by_scrub: bool, n: i64) -> bool {
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 51);
    let v = rig.dg().create_volume("v", 4 * MIB).unwrap().id;
    rig.dg().write(v, 0, &block_of(0, 0x5a)).unwrap();
    // A checkpoint of more than one block: a torn write of it mixes the two.
    for i in 0..64 {
        let name = format!("{i:02}-{}", "x".repeat(60));
        rig.dg().create_volume(&name, MIB).unwrap();
    }
    let copy_at = rig.dg().sh.layout.checkpoint_offsets[damaged];
    if !by_scrub {
        rig.dg.take().unwrap().shutdown().unwrap();
    }
    rig.fast.flip_bit(copy_at + 100, 3).unwrap();
    rig.fast.set_faults(FaultConfig {
        crash_keep_rate: 0.0,
        torn_write_on_crash: true,
        ..FaultConfig::seeded(seed)
    });
    rig.writes_left
        .store(n, std::sync::atomic::Ordering::SeqCst);
    let repaired = if by_scrub {
        rig.dg().scrub(&ScrubOptions::default()).map(drop)
    } else {
        rig.start()
    };
    if !rig.power_is_off() {
        repaired.unwrap();
        return false;
    }
    rig.power_cut();
    let what =
        format!("copy {damaged} damaged, scrub {by_scrub}, crash seed {seed}, cut at write {n}");
    rig.start()
        .unwrap_or_else(|e| panic!("{what}: no open: {e}"));
    let mut b = vec![0u8; 4096];
    rig.dg().read(v, 0, &mut b).unwrap();
    assert_eq!(b, block_of(0, 0x5a), "{what}");
    true
}

/// The scrub's walk of a layer's index loads the pages it names under the reclaim guard, as
/// reads do: an index flush that would free those pages (and discard their segment, so the
/// scrub would read garbage, count checksum errors and stop) cannot commit while one is being
/// loaded. Here a flush is started just as the walk is about to load a page.
#[test]
fn an_index_flush_waits_for_a_scrub_loading_an_index_page() {
    let rig = Rig::new(32 * MIB, &[48 * MIB], idle_log_cfg(), 46);
    let dg = rig.dg();
    // Blocks far enough apart to be one index entry each: several leaves.
    let v = dg.create_volume("v", 16 * MIB).unwrap().id;
    for i in 0..1500u64 {
        dg.write(v, 2 * i * 4096, &block_of(2 * i, 0x66)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(30)));
    crate::meta::flush_index(&dg.sh).unwrap();
    // Something for a flush to write: another volume's entries.
    let w = dg.create_volume("w", MIB).unwrap().id;
    dg.write(w, 0, &block_of(0, 0x67)).unwrap();
    assert!(dg.destage_all(Duration::from_secs(30)));
    dg.sh.hold_destager();
    assert!(
        dg.sh.tree.read().counts().dirty_nodes > 0,
        "nothing to flush"
    );
    dg.sh.tree.write().evict(0);
    let scrubber = std::thread::current().id();
    let (sh, first) = (dg.sh.clone(), AtomicBool::new(true));
    let committed_meanwhile = Arc::new(AtomicBool::new(false));
    let (flushed_tx, flushed) = crossbeam_channel::bounded(1);
    let meanwhile = committed_meanwhile.clone();
    *dg.sh.before_page_load.lock() = Some(Arc::new(move || {
        if std::thread::current().id() != scrubber || !first.swap(false, Ordering::SeqCst) {
            return;
        }
        let (sh, done) = (sh.clone(), flushed_tx.clone());
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let r = crate::meta::flush_index(&sh);
            let _ = tx.send(());
            let _ = done.send(r);
        });
        if rx.recv_timeout(Duration::from_secs(3)).is_ok() {
            meanwhile.store(true, Ordering::SeqCst);
        }
    }));
    let report = dg.scrub(&ScrubOptions {
        volume: Some("v".into()),
        ..ScrubOptions::default()
    });
    *dg.sh.before_page_load.lock() = None;
    let flush = flushed.recv_timeout(Duration::from_secs(30));
    dg.sh.destager_held.store(false, Ordering::SeqCst);
    let report = report.unwrap();
    assert!(report.clean(), "{report:?}");
    flush.expect("the flush was started").unwrap();
    assert!(
        !committed_meanwhile.load(Ordering::SeqCst),
        "an index flush committed while the scrub was loading a page it had named"
    );
    assert_eq!(report.data_bytes_verified, 1500 * 4096);
}

/// A config keeping the last scrub's report in `record`, scrubbing everything every hour.
fn recorded_cfg(record: &std::path::Path) -> EngineConfig {
    EngineConfig {
        scrub_record: Some(record.to_path_buf()),
        scrub_interval: Some(Duration::from_secs(3600)),
        ..small_cfg()
    }
}

/// The file that keeps `dg`'s record: the configured path with the group's id in its name.
fn own_record(dg: &DiskGroup) -> std::path::PathBuf {
    let path = crate::scrub::record_path(&dg.sh).expect("a record is kept");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("scrub-last-") && name.ends_with(".json") && name.len() > 30,
        "{name}"
    );
    path
}

fn scrub_all(dg: &DiskGroup) -> ScrubReport {
    dg.scrub(&ScrubOptions::default()).expect("scrub")
}

/// The last report survives a restart (a clean one, and a power cut after the scrub), is the
/// group's own (another group given the same record starts with none), and a record that is
/// not one is ignored, not an error.
#[test]
fn the_last_scrub_is_kept_across_restarts_for_its_own_group() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("state").join("scrub-last.json");
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], recorded_cfg(&record), 61);
    let b = rig.dg().create_volume("b", 4 * MIB).unwrap().id;
    rig.dg().write(b, 0, &vec![2u8; 4 * MIB as usize]).unwrap();
    let first = scrub_all(rig.dg());
    assert!(first.clean() && first.data_bytes_verified > 0, "{first:?}");
    rig.clean_restart();
    assert_eq!(rig.dg().scrub_status().last, Some(first.clone()));
    // A later scrub of one volume is the last one now, through a power cut too.
    let one = rig
        .dg()
        .scrub(&ScrubOptions {
            volume: Some("b".into()),
            ..Default::default()
        })
        .unwrap();
    rig.power_cut_and_restart();
    assert_eq!(rig.dg().scrub_status().last, Some(one.clone()));

    // Another group given the same record (a data directory shared by two daemons with
    // other devices) does not take this group's report, begins its own, and leaves this
    // group's alone.
    let other = Rig::new(32 * MIB, &[48 * MIB], recorded_cfg(&record), 62);
    assert_eq!(
        other.dg().scrub_status().last,
        None,
        "another group's report"
    );
    let others = own_record(other.dg());
    other.dg().shutdown().unwrap();
    let begun: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&others).unwrap()).unwrap();
    assert!(
        begun["report"].is_null() && begun["group"] != serde_json::json!(""),
        "{begun}"
    );
    rig.clean_restart();
    assert_eq!(
        rig.dg().scrub_status().last,
        Some(one.clone()),
        "the other group's record replaced this one's"
    );

    // A record of another build: a field it did not know is taken as zero, one this build
    // does not know is passed over.
    let own = own_record(rig.dg());
    rig.dg.take().unwrap().shutdown().unwrap();
    let mut text: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&own).unwrap()).unwrap();
    let report = text["report"].as_object_mut().unwrap();
    report.remove("metadata_copies_checked");
    report.insert("checked_by".into(), "a later build".into());
    std::fs::write(&own, serde_json::to_vec(&text).unwrap()).unwrap();
    rig.start().unwrap();
    let last = rig.dg().scrub_status().last.expect("the record read");
    assert_eq!(
        (last.scope.as_str(), last.metadata_copies_checked),
        ("b", 0)
    );

    rig.dg.take().unwrap().shutdown().unwrap();
    std::fs::write(&own, b"{\"group\": 7").unwrap();
    rig.start().expect("a bad record does not stop an open");
    assert_eq!(rig.dg().scrub_status().last, None);
}

/// A record where builds before kept it, at the configured path itself, is taken over by its
/// own group (its report and schedule kept, the file moved to the group's own name) and left
/// to its group by another.
#[test]
fn a_record_kept_before_records_were_per_group_is_taken_over_by_its_group() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("scrub-last.json");
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], recorded_cfg(&record), 66);
    let b = rig.dg().create_volume("b", MIB).unwrap().id;
    rig.dg().write(b, 0, &vec![5u8; MIB as usize]).unwrap();
    let done = scrub_all(rig.dg());
    let own = own_record(rig.dg());
    rig.dg.take().unwrap().shutdown().unwrap();
    // As an earlier build left it.
    std::fs::rename(&own, &record).unwrap();
    // Another group's open leaves it alone.
    let other = Rig::new(32 * MIB, &[48 * MIB], recorded_cfg(&record), 67);
    assert_eq!(other.dg().scrub_status().last, None);
    other.dg().shutdown().unwrap();
    assert!(record.exists(), "another group removed this group's record");
    rig.start().unwrap();
    assert_eq!(rig.dg().scrub_status().last, Some(done.clone()));
    assert_eq!(all_finished(rig.dg()), done.finished_unix_s);
    assert!(own.exists() && !record.exists(), "the record was not moved");
    rig.power_cut_and_restart();
    assert_eq!(rig.dg().scrub_status().last, Some(done));
}

/// The background scrub is due `scrub_interval` after the last scrub of everything ended,
/// before the restart too: a daemon restarted more often than the interval still scrubs.
#[test]
fn the_background_scrub_counts_from_the_last_scrub_not_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("scrub-last.json");
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], recorded_cfg(&record), 63);
    let own = own_record(rig.dg());
    let b = rig.dg().create_volume("b", 4 * MIB).unwrap().id;
    rig.dg().write(b, 0, &vec![2u8; 4 * MIB as usize]).unwrap();
    let done = scrub_all(rig.dg());
    // Just scrubbed: a restart does not scrub again.
    rig.clean_restart();
    std::thread::sleep(Duration::from_millis(500));
    let status = rig.dg().scrub_status();
    assert!(
        !status.running && status.last == Some(done.clone()),
        "{status:?}"
    );

    // The record says the last scrub of everything ended two hours ago: due at once.
    rig.dg.take().unwrap().shutdown().unwrap();
    let mut text: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&own).unwrap()).unwrap();
    let long_ago = done.finished_unix_s - 7200;
    text["report"]["finished_unix_s"] = long_ago.into();
    text["all_finished_unix_s"] = long_ago.into();
    std::fs::write(&own, serde_json::to_vec(&text).unwrap()).unwrap();
    rig.start().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let last = rig.dg().scrub_status().last.expect("a last scrub");
        if last.finished_unix_s > long_ago {
            assert_eq!(last.scope, "all");
            assert_eq!(last.data_bytes_verified, done.data_bytes_verified);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no background scrub within 20 s of a start two hours after the last one"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// When the last scrub of everything ended, as the background scrub's schedule reads it.
fn all_finished(dg: &DiskGroup) -> u64 {
    dg.sh.scrub.all_finished_unix_s.load(Ordering::Relaxed)
}

fn scrub_volume(dg: &DiskGroup, name: &str) -> ScrubReport {
    let opts = ScrubOptions {
        volume: Some(name.into()),
        ..Default::default()
    };
    dg.scrub(&opts).expect("scrub of one volume")
}

/// Only a scrub of everything moves the background scrub's schedule: not a scrub of a volume
/// named `all` (the scope a scrub of everything reports), and not, across a power cut, a
/// scrub of one volume that replaced the full scrub's report in the record.
#[test]
fn a_scrub_of_one_volume_leaves_the_background_schedule_alone() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("scrub-last.json");
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], recorded_cfg(&record), 64);
    for name in ["all", "b"] {
        let v = rig.dg().create_volume(name, MIB).unwrap().id;
        rig.dg().write(v, 0, &vec![3u8; MIB as usize]).unwrap();
    }
    let named_all = scrub_volume(rig.dg(), "all");
    assert_eq!(named_all.scope, "all");
    assert_eq!(
        all_finished(rig.dg()),
        0,
        "the scrub of the volume named all counted as a scrub of everything"
    );
    let done = scrub_all(rig.dg());
    assert_eq!(all_finished(rig.dg()), done.finished_unix_s);
    let one = scrub_volume(rig.dg(), "b");
    rig.power_cut_and_restart();
    assert_eq!(rig.dg().scrub_status().last, Some(one));
    assert_eq!(
        all_finished(rig.dg()),
        done.finished_unix_s,
        "after a restart, the end of the last scrub of everything"
    );
}

/// A group no scrub of everything has ended on yet is scrubbed in the background an interval
/// after the start that began its record, not after each start: the record is begun at the
/// first open, and its date kept across restarts.
#[test]
fn a_group_never_scrubbed_whole_is_scrubbed_an_interval_after_its_record_began() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("scrub-last.json");
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], recorded_cfg(&record), 65);
    let own = own_record(rig.dg());
    let b = rig.dg().create_volume("b", 4 * MIB).unwrap().id;
    rig.dg().write(b, 0, &vec![2u8; 4 * MIB as usize]).unwrap();
    rig.dg.take().unwrap().shutdown().unwrap();
    let text = std::fs::read(&own).expect("a record begun at the first open");
    let mut text: serde_json::Value = serde_json::from_slice(&text).unwrap();
    assert!(text["report"].is_null(), "{text}");
    let began = text["kept_since_unix_s"]
        .as_u64()
        .expect("when the record began");
    // Restarts do not move it.
    rig.start().unwrap();
    rig.power_cut_and_restart();
    rig.dg.take().unwrap().shutdown().unwrap();
    let again: serde_json::Value = serde_json::from_slice(&std::fs::read(&own).unwrap()).unwrap();
    assert_eq!(again["kept_since_unix_s"], began, "{again}");
    // Begun two hours ago, with the interval an hour: due at once.
    text["kept_since_unix_s"] = (began - 7200).into();
    std::fs::write(&own, serde_json::to_vec(&text).unwrap()).unwrap();
    rig.start().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while rig.dg().scrub_status().last.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "no background scrub within 20 s of a start two hours after the record began"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let last = rig.dg().scrub_status().last.unwrap();
    assert_eq!(
        (last.scope.as_str(), last.data_bytes_verified),
        ("all", 4 * MIB)
    );
}
