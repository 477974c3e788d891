//! Write-log batch headers damaged on the medium, met by a start: a header whose records all
//! check is replayed whole (`replay::salvage`); one that cannot be read refuses the open,
//! unless the operator asks to skip it (`EngineConfig::skip_damaged_log_batches`), and then
//! only its own writes are lost. Either way the log is destaged past it, so the next start no
//! longer meets it.

use std::time::{Duration, Instant};

use strata_device::{AlignedBuf, Device};

use crate::format::BatchHeader;
use crate::tests::Rig;
use crate::tests_scrub::{block_of, damage_header_of, find_block, log_rig, read_fails};
use crate::*;

/// The byte offset on the fast device of the header of the batch holding block `lba` of
/// `log_rig`'s volume (just before its one data block), and the batch's sequence number.
fn header_of(rig: &Rig, lba: u64) -> (u64, u64) {
    let at = find_block(&rig.fast, &block_of(lba, 0x33)) - 4096;
    let mut b = AlignedBuf::new_zeroed(4096);
    rig.fast.read_at(&mut b, at).unwrap();
    let h = BatchHeader::decode(&b, &rig.dg().sh.layout.group).expect("a valid header");
    (at, h.first_seq)
}

/// Blocks `0..n` of the volume read back as written, but for `lost`, which reads as zeros
/// (what the volume held before).
fn check_blocks(dg: &DiskGroup, v: u32, n: u64, lost: Option<u64>) {
    let mut b = vec![0u8; 4096];
    for lba in 0..n {
        dg.read(v, lba * 4096, &mut b).unwrap();
        let want = match Some(lba) == lost {
            true => vec![0u8; 4096],
            false => block_of(lba, 0x33),
        };
        assert!(b == want, "block {lba} reads wrong");
    }
}

/// A start refused over a damaged log, its reason holding `what` and naming the way out.
fn refused_naming(rig: &mut Rig, what: &str) {
    let err = rig.start().expect_err("opened over a damaged log");
    let err = err.to_string();
    assert!(
        err.contains(what) && err.contains("--skip-damaged-log-batches"),
        "{err}"
    );
}

/// Waits (20 s at most) until `done`; `what` names it when it does not come.
fn wait_until(what: &str, done: impl Fn() -> bool) {
    let began = Instant::now();
    while !done() {
        assert!(began.elapsed() < Duration::from_secs(20), "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the log has been destaged past the damaged header the start met.
fn wait_repaired(dg: &DiskGroup) {
    wait_until("the log was not destaged past the damaged header", || {
        !dg.log_damage_pending()
    });
}

/// A flipped bit in parts of a header no crc of their own covers but the block's: past the
/// records, in the block's crc, in the acknowledged-up-to field. Before, each of them kept the
/// group from opening at all.
#[test]
fn a_batch_header_damaged_outside_its_records_is_replayed_whole() {
    for (i, byte) in [2000u64, 4094, 50].into_iter().enumerate() {
        let (mut rig, v) = log_rig(70 + i as u64, 50);
        let (at, seq) = header_of(&rig, 20);
        rig.fast.flip_bit(at + byte, 3).unwrap();
        rig.power_cut_and_restart();
        let dg = rig.dg();
        assert_eq!(
            dg.open_report().salvaged_log_headers,
            vec![seq],
            "byte {byte}"
        );
        assert!(dg.open_report().skipped_log_records.is_empty());
        assert!(dg.stats().checksum_errors_by_device[0] >= 1, "not counted");
        check_blocks(dg, v, 50, None);
        wait_repaired(dg);
        rig.power_cut_and_restart();
        assert!(rig.dg().open_report().salvaged_log_headers.is_empty());
        check_blocks(rig.dg(), v, 50, None);
    }
}

/// A flipped bit where it changes what the header says (a record header; the epoch, which is
/// checked against the batches around it) cannot be salvaged: the open is refused and names
/// the way out; asked to, the start skips the batch and loses its write alone. The log is then
/// destaged past it, and the next start needs no asking.
#[test]
fn a_batch_that_cannot_be_read_is_skipped_only_when_asked() {
    for (i, clean) in [false, true].into_iter().enumerate() {
        let (mut rig, v) = log_rig(80 + i as u64, 50);
        let (at, seq) = header_of(&rig, 20);
        match clean {
            true => rig.fast.flip_bit(at + 45, 6).unwrap(),
            false => damage_header_of(&rig, 20),
        }
        if let Some(dg) = rig.dg.take() {
            match clean {
                true => dg.shutdown().unwrap(),
                false => dg.halt_for_test(),
            }
        }
        refused_naming(&mut rig, &format!("losing the write of sequence {seq} ("));
        rig.cfg.skip_damaged_log_batches = true;
        rig.start().expect("skipped");
        let dg = rig.dg();
        assert_eq!(
            dg.open_report().skipped_log_records,
            vec![SkippedRecords {
                first_seq: seq,
                end_seq: seq + 1,
                blocks: 2
            }]
        );
        check_blocks(dg, v, 50, Some(20));
        dg.write(v, 60 * 4096, &block_of(60, 0x33)).unwrap();
        wait_repaired(dg);
        rig.cfg.skip_damaged_log_batches = false;
        rig.power_cut_and_restart();
        check_blocks(rig.dg(), v, 50, Some(20));
        let mut b = vec![0u8; 4096];
        rig.dg().read(v, 60 * 4096, &mut b).unwrap();
        assert!(
            b == block_of(60, 0x33),
            "a write after the skipping start was lost"
        );
    }
}

/// The last batch before a clean stop, unreadable: nothing follows it to say it was
/// acknowledged, but the stop recorded where the log ends.
#[test]
fn a_clean_stops_last_batch_that_cannot_be_read_is_skipped_only_when_asked() {
    let (mut rig, v) = log_rig(82, 50);
    let (_, seq) = header_of(&rig, 49);
    damage_header_of(&rig, 49);
    rig.dg.take().unwrap().shutdown().unwrap();
    refused_naming(&mut rig, "acknowledged before the last checkpoint");
    rig.cfg.skip_damaged_log_batches = true;
    rig.start().expect("skipped");
    assert_eq!(
        rig.dg().open_report().skipped_log_records,
        vec![SkippedRecords {
            first_seq: seq,
            end_seq: seq + 1,
            blocks: 0
        }]
    );
    check_blocks(rig.dg(), v, 49, None);
    assert!(!read_fails(rig.dg(), v, 49 * 4096));
    rig.cfg.skip_damaged_log_batches = false;
    rig.power_cut_and_restart();
    check_blocks(rig.dg(), v, 49, None);
}

/// Writes 2- and 3-block batches (one and two data blocks) until the log's head is at
/// `head`, destaging as the log fills; the log is then empty up to there.
fn move_head_to(rig: &Rig, v: u32, head: u64) {
    let dg = rig.dg();
    let l = dg.sh.layout.log_blocks;
    let mut lba = 100;
    loop {
        let now = dg.sh.log.lock().head;
        if now == head {
            break;
        }
        let left = (head + l - now) % l;
        let blocks = match left {
            3 | 5 => 2,
            _ => 1,
        };
        let data: Vec<u8> = (0..blocks).flat_map(|k| block_of(lba + k, 0x66)).collect();
        dg.write(v, lba * 4096, &data).unwrap();
        lba = 100 + (lba + blocks - 100) % 100;
        if dg.sh.log.lock().used_blocks > l / 2 {
            assert!(dg.destage_all(Duration::from_secs(10)));
        }
    }
    assert!(dg.destage_all(Duration::from_secs(10)));
}

/// The skipped batch at the very end of the log area, and the one after it wrapped to its
/// start; then the skipped batch itself wrapped.
#[test]
fn a_skipped_batch_at_the_end_of_the_log_area_leaves_the_log_whole() {
    for (i, from_end) in [2u64, 1].into_iter().enumerate() {
        let cfg = EngineConfig {
            fill_ratio_low: 0.9,
            fill_ratio_high: 0.95,
            ..crate::tests::small_cfg()
        };
        let mut rig = Rig::new(
            32 * crate::tests::MIB,
            &[24 * crate::tests::MIB],
            cfg,
            90 + i as u64,
        );
        let v = rig.dg().create_volume("v", crate::tests::MIB).unwrap().id;
        let l = rig.dg().sh.layout.log_blocks;
        move_head_to(&rig, v, l - from_end);
        for lba in 0..10 {
            rig.dg().write(v, lba * 4096, &block_of(lba, 0x33)).unwrap();
        }
        let (at, seq) = header_of(&rig, 0);
        assert_eq!(
            at / 4096 - rig.dg().sh.layout.log_byte(0) / 4096,
            match from_end {
                2 => l - 2,
                _ => 0,
            }
        );
        damage_header_of(&rig, 0);
        rig.cfg.skip_damaged_log_batches = true;
        rig.power_cut_and_restart();
        let dg = rig.dg();
        assert_eq!(
            dg.open_report().skipped_log_records,
            vec![SkippedRecords {
                first_seq: seq,
                end_seq: seq + 1,
                blocks: 2 + (from_end % 2)
            }],
            "{from_end} from the end"
        );
        check_blocks(dg, v, 10, Some(0));
        let log = dg.sh.log.lock();
        assert_eq!(log.used_blocks, 2 + (from_end % 2) + 9 * 2);
        drop(log);
        wait_repaired(dg);
        rig.cfg.skip_damaged_log_batches = false;
        rig.power_cut_and_restart();
        check_blocks(rig.dg(), v, 10, Some(0));
    }
}

/// Waits until the destager has marked where the log ends (`Destager::mark_log_end`): every
/// acknowledged record.
fn wait_end_marked(dg: &DiskGroup) {
    wait_until("the log's end was not marked", || {
        let retired = dg.sh.retired_seq.load(std::sync::atomic::Ordering::Acquire);
        dg.sh.durable.lock().clean_log_end_seq >= retired
    });
}

/// After a pause in writes the destager records where the log ends, so damage to the last
/// batch before a crash is known for damage, not taken for a write torn in flight: its
/// record reads as an I/O error (before, the block silently read as its older data, zeros
/// here), and a header that cannot be read stops the start.
#[test]
fn after_a_pause_damage_to_the_last_batch_is_not_taken_for_a_torn_write() {
    for header in [false, true] {
        let (mut rig, v) = log_rig(96 + u64::from(header), 10);
        wait_end_marked(rig.dg());
        match header {
            true => damage_header_of(&rig, 9),
            false => rig
                .fast
                .flip_bit(find_block(&rig.fast, &block_of(9, 0x33)) + 5, 0)
                .unwrap(),
        }
        rig.power_cut();
        if header {
            refused_naming(&mut rig, "acknowledged before the last checkpoint");
            continue;
        }
        rig.start().expect("open");
        let dg = rig.dg();
        assert_eq!(dg.open_report().damaged_log_records, 1);
        assert!(
            read_fails(dg, v, 9 * 4096),
            "the damaged block read as data"
        );
        check_blocks(dg, v, 9, None);
    }
}
