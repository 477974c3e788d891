//! More than one summary copy's write lost, or other damage beside it: what weighing the copies
//! (`capacity::assess`) must still not be fooled by. An earlier use of a segment left whole
//! (data and both copies) must not be applied at open; a crc block cached from a stale copy
//! must not outlive the weighing that found it stale; scrub must not copy a header nothing
//! backs over the other copy's. And what reading the second copy costs when nothing is wrong.

use super::stale::*;
use super::*;
use crate::capacity::read_summary;

/// The lba of volume "v" that data block `block` of `seg` holds, by the segment's summary.
fn lba_at(dg: &DiskGroup, seg: u32, block: u32) -> u64 {
    let s = read_summary(&dg.sh, seg).unwrap().expect("a summary");
    let e = s
        .entries
        .iter()
        .find(|e| e.data_block <= block && block < e.data_block + e.nblocks)
        .expect("an entry for the block");
    e.lba + u64::from(block - e.data_block)
}

/// Segments sealed since the last index flush, each used before by an earlier opening, then a
/// power cut, and the device lost every write of their new use (data and both summary copies:
/// a device that acknowledged a flush it never made). Each holds its earlier use whole, which
/// checks everywhere; applying it would point the index at old versions of the blocks (wrong
/// data, no error). Open must refuse instead, as for a recent summary damaged in both copies.
#[test]
fn a_recent_segment_whose_every_write_was_lost_is_not_applied_at_open() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 82);
    let r = reused(&mut rig, 0x50);
    let layout = rig.dg().sh.layout.clone();
    rig.power_cut();
    for (i, &seg) in r.segs.iter().enumerate() {
        put_back(&rig, &layout, seg, 0, &r.first[i][0]);
        put_back(&rig, &layout, seg, 1, &r.first[i][1]);
        put_back_data(&rig, &layout, seg, 0, &r.first_data[i]);
    }
    let refused = match rig.start() {
        Ok(()) => {
            let dg = rig.group().clone();
            for lba in 0..VOL_BLOCKS {
                let mut got = vec![0u8; BLOCK];
                if dg.read(r.v, lba * BLOCK_U64, &mut got).is_ok() {
                    assert!(
                        got == block_of(lba, r.fill),
                        "block {lba} reads an earlier version (fill {:#x})",
                        got[8]
                    );
                }
            }
            panic!("open applied the earlier use, and nothing read wrong");
        }
        Err(e) => e.to_string(),
    };
    assert!(
        refused.contains("refusing to open")
            && r.segs
                .iter()
                .any(|s| refused.contains(&format!("capacity segment {s},"))),
        "{refused}"
    );
    // Not damage: both copies check, and hold what the device had before the lost writes.
    assert!(
        refused.contains(
            "sealed after the last index write, holds an earlier use of the segment (both \
             copies): the device lost the writes of its current use, which it had acknowledged"
        ),
        "{refused}"
    );
}

/// A recent segment's copy A left by an earlier opening's use (its write lost) and copy B's
/// header damaged: no copy holds the current use's header. Open refuses, and says what each
/// copy holds: an earlier use in one, damage in the other.
#[test]
fn a_recent_segment_with_one_copy_lost_and_the_other_damaged_is_refused_saying_so() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 86);
    let r = reused(&mut rig, 0x60);
    let dg = rig.group().clone();
    let layout = dg.sh.layout.clone();
    rig.power_cut();
    let recent = durable_recent(&rig);
    let seg = r.segs[0];
    assert!(
        recent.contains(&seg),
        "segment {seg} is not recent: {recent:?}"
    );
    put_back(&rig, &layout, seg, 0, &r.first[0][0]);
    flip(&rig, &dg, seg, 1, header(&dg));
    drop(dg);
    let refused = rig.start().expect_err("open refuses").to_string();
    assert!(
        refused.contains(&format!(
            "the summary of capacity segment {seg}, sealed after the last index write, holds an \
             earlier use of the segment (copy A; copy B damaged): the device lost the writes of \
             its current use, which it had acknowledged: data written since may be lost; \
             refusing to open"
        )),
        "{refused}"
    );
}

/// A crc block cached from a stale copy A (a read keeps it when the blocks it reads match it:
/// the same content in both uses, or, as here, the block's data write lost too). Scrub finds
/// copy A of an earlier use, mends it, and reports the block whose data write was lost; a read
/// after must say so too, not serve the block's earlier content by the cached crc block.
#[test]
fn a_crc_block_cached_from_a_stale_copy_does_not_outlive_the_weighing() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 83);
    let r = reused(&mut rig, 0x40);
    let (seg, b) = (r.segs[0], 3u32);
    let lba = lba_at(rig.dg(), seg, b);
    rig.clean_restart();
    let dg = rig.group().clone();
    let layout = dg.sh.layout.clone();
    put_back(&rig, &layout, seg, 0, &r.first[0][0]);
    let at = b as usize * BLOCK;
    put_back_data(&rig, &layout, seg, b, &r.first_data[0][at..at + BLOCK]);
    let stale = crate::format::decode_crc_block(&r.first[0][0][..BLOCK], seg, 0).unwrap();
    dg.sh.crc_blocks.lock().insert((seg, 0), Arc::new(stale));
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    let mended = format!("summary copy A of capacity segment {seg}: header differed");
    assert!(
        report
            .metadata_repaired
            .iter()
            .any(|m| m.starts_with(&mended)),
        "{mended}: {report:#?}"
    );
    assert_eq!(report.bad_blocks_total, 1, "{report:#?}");
    // That block first: a read of another block of the crc block would mend the cache, its
    // content failing the stale crc.
    let mut got = vec![0u8; BLOCK];
    let first = dg.read(r.v, lba * BLOCK_U64, &mut got);
    assert!(
        first.is_err(),
        "block {lba} read as its earlier content (fill {:#x})",
        got[8]
    );
    let errors = check_v(&dg, r.v, |l| (l != lba).then_some(r.fill));
    assert_eq!(errors.len(), 1, "{errors:?}");
}

/// Copy B wholly of an earlier use (its write lost), copy A's header damaged, and the data
/// blocks damaged too, so they tell neither copy's crc blocks right: copy B's header is the
/// only one that checks, backed by nothing. Scrub must not copy it over copy A's (which may be
/// the current use's, as here); it reports the header instead.
#[test]
fn scrub_does_not_copy_an_unbacked_header_whose_crc_blocks_the_data_cannot_tell() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 84);
    let r = reused(&mut rig, 0xa8);
    rig.clean_restart();
    let dg = rig.group().clone();
    let layout = dg.sh.layout.clone();
    let seg = r.segs[0];
    put_back(&rig, &layout, seg, 1, &r.first[0][1]);
    flip(&rig, &dg, seg, 0, header(&dg));
    let used = dg.sh.segs.lock().segs[seg as usize].used_blocks;
    for block in 0..used {
        let (dev, off) = layout.seg_data_byte(seg, block);
        rig.caps[dev].flip_bit(off + 100, 1).unwrap();
    }
    let damaged_head = head_of(&layout, &area(&rig, &layout, seg, 0)).to_vec();
    assert!(read_summary(&dg.sh, seg).unwrap().is_none());
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    let header_mend = format!("summary copy A of capacity segment {seg}: header");
    assert!(
        !report
            .metadata_repaired
            .iter()
            .any(|m| m.starts_with(&header_mend)),
        "the stale header was copied over copy A's: {report:#?}"
    );
    assert_eq!(
        head_of(&layout, &area(&rig, &layout, seg, 0)),
        &damaged_head[..],
        "copy A's header was written"
    );
    assert!(
        report
            .metadata_damaged
            .iter()
            .any(|m| m.contains(&format!("capacity segment {seg}:")) && m.contains("header")),
        "{report:#?}"
    );
}

/// Device reads of the capacity device while `f` runs: (operations, bytes).
fn cap_reads(rig: &Rig, f: impl FnOnce()) -> (u64, u64) {
    let before = rig.caps[0].stats();
    f();
    let after = rig.caps[0].stats();
    (
        after.read_ops - before.read_ops,
        after.read_bytes - before.read_bytes,
    )
}

/// What the second copy costs when nothing is damaged. A host read of a capacity block with
/// nothing cached reads one crc block (copy A's) and the block: no more than with one copy. A
/// whole summary (GC's victims, open's recent segments) is both copies, one read each: one
/// read of `summary_blocks` more than copy A alone.
#[test]
fn undamaged_copies_cost_host_reads_nothing_and_whole_summaries_one_read_more() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 85);
    let v = written(rig.dg(), 0x33);
    rig.clean_restart();
    let dg = rig.group().clone();
    let mut got = vec![0u8; BLOCK];
    let host = cap_reads(&rig, || dg.read(v, 7 * BLOCK_U64, &mut got).unwrap());
    assert_eq!(got, block_of(7, 0x33));
    assert_eq!(host, (2, 2 * BLOCK_U64), "a cold host read of one block");
    let seg = sealed(&dg)[0];
    let whole = cap_reads(&rig, || {
        read_summary(&dg.sh, seg).unwrap().expect("a summary");
    });
    let area_bytes = u64::from(dg.sh.layout.geo.summary_blocks) * BLOCK_U64;
    assert_eq!(whole, (2, 2 * area_bytes), "a whole summary");
    assert_eq!(dg.stats().metadata_copy_fallbacks_total, 0);
}
