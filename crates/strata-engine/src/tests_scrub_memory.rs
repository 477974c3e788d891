//! Scrub against metadata damaged in every copy while the running group still holds what it
//! says: index and segment-table pages are written again from memory, and a segment whose
//! summary a start after a crash would need is taken off that list by writing the index.
//! Before, the scrub only reported such damage, and the next start refused to open the group
//! (after a clean stop too, for an index page).

use std::time::Duration;

use crate::capacity::SegState;
use crate::ctree::PagePtr;
use crate::tests::{small_cfg, Rig, MIB};
use crate::tests_scrub::block_of;
use crate::*;

const BLOCKS: u64 = 512;

/// A group whose volume "v" has `BLOCKS` blocks destaged, after a clean restart (so the index
/// is on the capacity tier), and every block read once (the index's nodes in memory).
fn destaged_rig(seed: u64) -> (Rig, u32) {
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), seed);
    let v = rig.dg().create_volume("v", 4 * MIB).unwrap().id;
    for lba in 0..BLOCKS {
        rig.dg().write(v, lba * 4096, &block_of(lba, 0x5c)).unwrap();
    }
    assert!(rig.dg().destage_all(Duration::from_secs(10)));
    rig.clean_restart();
    check(&rig, v);
    (rig, v)
}

fn check(rig: &Rig, v: u32) {
    let mut b = vec![0u8; 4096];
    for lba in 0..BLOCKS {
        rig.dg().read(v, lba * 4096, &mut b).unwrap();
        assert!(b == block_of(lba, 0x5c), "block {lba} reads wrong");
    }
}

/// Flips a bit in both copies of the page at `ptr`.
fn damage_both(rig: &Rig, ptr: PagePtr) {
    for addr in [ptr.a, ptr.b] {
        let (seg, block) = ((addr >> 32) as usize, addr as u32 as u64);
        let (dev, off) = rig.dg().sh.layout.segments[seg];
        rig.caps[dev].flip_bit(off + block * 4096 + 300, 2).unwrap();
    }
}

#[test]
fn an_index_page_damaged_in_both_copies_is_written_again_from_memory() {
    for segtab in [false, true] {
        let (mut rig, v) = destaged_rig(120 + u64::from(segtab));
        let ptr = match segtab {
            false => rig.dg().sh.durable.lock().index_root.expect("an index"),
            true => rig.dg().sh.segs.lock().page_ptrs[0].expect("a segment table page"),
        };
        damage_both(&rig, ptr);
        let r = rig.dg().scrub(&ScrubOptions::default()).unwrap();
        let want = format!(
            "page {:#x}/{:#x}: both copies were damaged; rewritten elsewhere from the copy in memory",
            ptr.a, ptr.b
        );
        assert!(
            r.metadata_repaired.iter().any(|m| m.ends_with(&want)),
            "segment table {segtab}: {r:#?}"
        );
        assert!(
            r.metadata_damaged.is_empty() && r.bad_blocks.is_empty(),
            "{r:#?}"
        );
        // Both after a clean stop and after a power cut, the group opens and reads right.
        rig.clean_restart();
        check(&rig, v);
        rig.power_cut_and_restart();
        check(&rig, v);
    }
}

/// A segment sealed since the last index write whose summary header is damaged in both copies:
/// its blocks still read (the scrub does not call them bad), and the index is written so that
/// a start after a crash does not need the summary (it refused to open there).
#[test]
fn a_recent_segment_whose_summary_header_is_lost_no_longer_stops_a_start() {
    let mut rig = Rig::new(32 * MIB, &[48 * MIB], small_cfg(), 125);
    let v = rig.dg().create_volume("v", 4 * MIB).unwrap().id;
    for lba in 0..BLOCKS {
        rig.dg().write(v, lba * 4096, &block_of(lba, 0x5c)).unwrap();
    }
    assert!(rig.dg().destage_all(Duration::from_secs(10)));
    let seg = {
        let segs = rig.dg().sh.segs.lock();
        *segs
            .recent
            .iter()
            .find(|&&s| {
                let i = segs.segs[s as usize];
                i.state == SegState::Sealed && i.used_blocks > 0
            })
            .expect("a recent segment holding data")
    };
    let geo = rig.dg().sh.layout.geo;
    for copy in 0..geo.summary_copies {
        let (dev, off) = rig.dg().sh.layout.seg_summary_byte(seg, copy);
        let header = off + u64::from(geo.crc_blocks) * 4096;
        rig.caps[dev].flip_bit(header + 40, 3).unwrap();
    }
    let r = rig.dg().scrub(&ScrubOptions::default()).unwrap();
    assert!(
        r.bad_blocks.is_empty(),
        "blocks that read called bad: {r:#?}"
    );
    assert!(
        r.metadata_damaged
            .iter()
            .any(|m| m.contains(&format!("segment {seg} is damaged")) && m.contains("still read")),
        "{r:#?}"
    );
    assert!(!rig.dg().sh.segs.lock().recent.contains(&seg));
    check(&rig, v);
    rig.power_cut_and_restart();
    check(&rig, v);
}

/// Damage seen before a scrub of everything is what that scrub repaired or reported: the
/// counts since it (what `strata status` warns about) start again from 0; the totals stay.
#[test]
fn a_full_scrub_starts_the_damage_counts_since_it_again() {
    let (rig, v) = destaged_rig(126);
    let dg = rig.dg();
    dg.write(v, 600 * 4096, &block_of(600, 0x77)).unwrap();
    let at = crate::tests_scrub::find_block(&rig.fast, &block_of(600, 0x77));
    rig.fast.flip_bit(at + 9, 1).unwrap();
    assert!(crate::tests_scrub::read_fails(dg, v, 600 * 4096));
    let before = dg.stats();
    assert!(before.checksum_errors_total >= 1);
    assert_eq!(
        before.checksum_errors_since_scrub,
        before.checksum_errors_total
    );
    let r = dg.scrub(&ScrubOptions::default()).unwrap();
    assert_eq!(r.bad_blocks.len(), 1, "{r:#?}");
    let after = dg.stats();
    assert_eq!(after.checksum_errors_since_scrub, 0);
    assert!(after.checksum_errors_total > before.checksum_errors_total);
    // A scrub of one volume leaves the counts as they are.
    assert!(crate::tests_scrub::read_fails(dg, v, 600 * 4096));
    dg.scrub(&ScrubOptions {
        volume: Some("v".into()),
        ..ScrubOptions::default()
    })
    .unwrap();
    assert!(dg.stats().checksum_errors_since_scrub >= 1);
}
