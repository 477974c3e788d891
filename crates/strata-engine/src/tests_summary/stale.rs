//! Stale summary copies: a copy that passes every check of its own but holds an earlier use of
//! its segment, left in place by a write of that copy the device lost (or never made). Data
//! reads, GC, recovery at open and scrub must all take the segment's current summary, whichever
//! copy holds it; scrub finds the copies differ and mends the stale one from the current one, and
//! reports what it cannot tell apart instead of copying it.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::capacity::{copy_name, read_summary};
use crate::format::{RecordKind, SegmentSummary, SummaryEntry};
use crate::layout::Layout;

/// One summary copy of `seg` as the device holds it.
pub(super) fn area(rig: &Rig, layout: &Layout, seg: u32, copy: u32) -> Vec<u8> {
    let (dev, off) = layout.seg_summary_byte(seg, copy);
    let mut b = AlignedBuf::new_zeroed(layout.geo.summary_blocks as usize * BLOCK);
    rig.caps[dev].read_at(&mut b, off).unwrap();
    b.to_vec()
}

/// Writes `bytes` as summary copy `copy` of `seg`, durably: the device kept them, as when it
/// lost the write that was to replace them.
pub(super) fn put_back(rig: &Rig, layout: &Layout, seg: u32, copy: u32, bytes: &[u8]) {
    let (dev, off) = layout.seg_summary_byte(seg, copy);
    let mut b = AlignedBuf::new_zeroed(bytes.len());
    b.copy_from_slice(bytes);
    rig.caps[dev].write_at(&b, off).unwrap();
    rig.caps[dev].flush().unwrap();
}

/// The used data blocks of sealed segment `seg` as the device holds them.
pub(super) fn data_of(rig: &Rig, dg: &DiskGroup, seg: u32) -> Vec<u8> {
    let used = dg.sh.segs.lock().segs[seg as usize].used_blocks;
    let (dev, off) = dg.sh.layout.seg_data_byte(seg, 0);
    let mut b = AlignedBuf::new_zeroed(used as usize * BLOCK);
    rig.caps[dev].read_at(&mut b, off).unwrap();
    b.to_vec()
}

/// Writes `bytes` over data blocks of `seg` from `block`, durably: the device kept them, as
/// when it lost the write that was to replace them.
pub(super) fn put_back_data(rig: &Rig, layout: &Layout, seg: u32, block: u32, bytes: &[u8]) {
    let (dev, off) = layout.seg_data_byte(seg, block);
    let mut b = AlignedBuf::new_zeroed(bytes.len());
    b.copy_from_slice(bytes);
    rig.caps[dev].write_at(&b, off).unwrap();
    rig.caps[dev].flush().unwrap();
}

/// The header and entries region of a copy's bytes.
pub(super) fn head_of<'a>(layout: &Layout, bytes: &'a [u8]) -> &'a [u8] {
    &bytes[layout.geo.crc_blocks as usize * BLOCK..]
}

/// Every block of "v" written with `fill`, then destaged.
pub(super) fn rewrite(dg: &DiskGroup, v: VolumeId, fill: u8) {
    for lba in 0..VOL_BLOCKS {
        dg.write(v, lba * BLOCK_U64, &block_of(lba, fill)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
}

/// "v" written three times: `fill`, `fill + 1`, a clean restart (whose index flush frees the
/// segments of the first writing; they are the lowest numbered free ones), then `fill + 2`,
/// which goes into those segments again.
pub(super) struct Reused {
    pub v: VolumeId,
    /// Segments holding `fill + 2` that held `fill` before.
    pub segs: Vec<u32>,
    /// Both summary copies of each of them as their first use left them.
    pub first: Vec<[Vec<u8>; 2]>,
    /// Each one's data blocks as its first use left them (its used blocks).
    pub first_data: Vec<Vec<u8>>,
    /// What "v" holds now.
    pub fill: u8,
}

/// A segment's summary copies and used data blocks, as the device holds them.
type Contents = ([Vec<u8>; 2], Vec<u8>);

pub(super) fn reused(rig: &mut Rig, fill: u8) -> Reused {
    let dg = rig.group().clone();
    let v = written(&dg, fill);
    let before = sealed(&dg);
    let first: Vec<Contents> = before
        .iter()
        .map(|&s| {
            let copies = [
                area(rig, &dg.sh.layout, s, 0),
                area(rig, &dg.sh.layout, s, 1),
            ];
            (copies, data_of(rig, &dg, s))
        })
        .collect();
    rewrite(&dg, v, fill + 1);
    drop(dg);
    rig.clean_restart();
    let dg = rig.group().clone();
    rewrite(&dg, v, fill + 2);
    let now = sealed(&dg);
    let (segs, first): (Vec<u32>, Vec<Contents>) = before
        .into_iter()
        .zip(first)
        .filter(|(s, _)| now.contains(s))
        .unzip();
    let (first, first_data): (Vec<[Vec<u8>; 2]>, Vec<Vec<u8>>) = first.into_iter().unzip();
    assert!(segs.len() >= 2, "segments used again: {segs:?}");
    for (&seg, f) in segs.iter().zip(&first) {
        let a = area(rig, &dg.sh.layout, seg, 0);
        assert_eq!(
            a,
            area(rig, &dg.sh.layout, seg, 1),
            "segment {seg}: the copies differ"
        );
        assert!(
            head_of(&dg.sh.layout, &a) != head_of(&dg.sh.layout, &f[0]),
            "segment {seg}: same header"
        );
    }
    Reused {
        v,
        segs,
        first,
        first_data,
        fill: fill + 2,
    }
}

/// The copy whose write the device lost in segment `i` of a test: copy A of even ones, copy B
/// of odd ones.
pub(super) fn lost_copy(i: usize) -> u32 {
    (i % 2) as u32
}

/// The repair scrub reports for a copy that held an earlier use of its segment.
fn stale_mended(seg: u32, copy: u32) -> String {
    format!(
        "summary copy {} of capacity segment {seg}: header differed from copy {}'s",
        copy_name(copy),
        copy_name(1 - copy)
    )
}

/// A sealed segment read after a restart (nothing cached, nothing known of its use but the
/// segment table's count of blocks written): every block reads right whichever copy is stale,
/// scrub mends the stale copy (the copies are the same again) and then finds nothing, and a
/// power cut after loses nothing.
#[test]
fn a_stale_summary_copy_of_a_sealed_segment_is_not_read_and_scrub_mends_it() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 71);
    let r = reused(&mut rig, 0x70);
    rig.clean_restart();
    let dg = rig.group().clone();
    for (i, (&seg, first)) in r.segs.iter().zip(&r.first).enumerate() {
        put_back(
            &rig,
            &dg.sh.layout,
            seg,
            lost_copy(i),
            &first[lost_copy(i) as usize],
        );
    }
    assert!(check_v(&dg, r.v, |_| Some(r.fill)).is_empty());
    // GC and recovery read summaries whole: the current one, entries and all.
    for (i, &seg) in r.segs.iter().enumerate() {
        let s = read_summary(&dg.sh, seg).unwrap().expect("a summary");
        let current = area(&rig, &dg.sh.layout, seg, 1 - lost_copy(i));
        let (group, geo) = (&dg.sh.layout.group, &dg.sh.layout.geo);
        let current = SegmentSummary::decode_head(&current, group, geo, seg).unwrap();
        assert_eq!(s.segment_seq, current.segment_seq, "segment {seg}");
        assert_eq!(s.entries, current.entries, "segment {seg}");
    }
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(report.clean(), "{report:#?}");
    for (i, &seg) in r.segs.iter().enumerate() {
        let want = stale_mended(seg, lost_copy(i));
        assert!(
            report
                .metadata_repaired
                .iter()
                .any(|m| m.starts_with(&want)),
            "{want}: {report:#?}"
        );
        assert!(
            area(&rig, &dg.sh.layout, seg, 0) == area(&rig, &dg.sh.layout, seg, 1),
            "segment {seg}: the copies still differ"
        );
    }
    let again = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(
        again.clean() && again.metadata_repaired.is_empty(),
        "{again:#?}"
    );
    drop(dg);
    rig.power_cut_and_restart();
    assert!(check_v(rig.dg(), r.v, |_| Some(r.fill)).is_empty());
}

/// Segments sealed since the last index flush, then a power cut: open reads their summaries
/// and must apply the current ones, not the stale copies (an earlier use's entries point the
/// index at blocks that now hold other data, and lose what the current use holds).
#[test]
fn a_stale_summary_copy_of_a_recent_segment_is_not_applied_at_open() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 72);
    let r = reused(&mut rig, 0x80);
    let layout = rig.dg().sh.layout.clone();
    rig.power_cut();
    let recent = durable_recent(&rig);
    let mut staled = 0;
    for (i, (&seg, first)) in r.segs.iter().zip(&r.first).enumerate() {
        assert!(
            recent.contains(&seg),
            "segment {seg} is not recent: {recent:?}"
        );
        put_back(
            &rig,
            &layout,
            seg,
            lost_copy(i),
            &first[lost_copy(i) as usize],
        );
        staled += 1;
    }
    rig.start()
        .expect("open with one stale copy of each recent segment");
    let dg = rig.group().clone();
    assert!(check_v(&dg, r.v, |_| Some(r.fill)).is_empty());
    assert!(
        copy_repairs(&dg) >= staled,
        "the stale copies went unnoticed"
    );
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(report.clean(), "{report:#?}");
    for (i, &seg) in r.segs.iter().enumerate() {
        let want = stale_mended(seg, lost_copy(i));
        assert!(
            report
                .metadata_repaired
                .iter()
                .any(|m| m.starts_with(&want)),
            "{want}: {report:#?}"
        );
    }
    drop(dg);
    rig.power_cut_and_restart();
    assert!(check_v(rig.dg(), r.v, |_| Some(r.fill)).is_empty());
}

/// GC reads its victims' summaries whole: with a stale copy (A in some, B in others), it moves
/// the live blocks with the crcs of the current use, so they read back, and frees the victims.
#[test]
fn gc_cleans_from_the_current_copy_when_the_other_is_stale() {
    let mut rig = Rig::new(16 * MIB, &[24 * MIB], small_cfg(), 73);
    let r = reused(&mut rig, 0x90);
    let dg = rig.group().clone();
    // Every other block overwritten: the reused segments are half dead, the best victims.
    for lba in (0..VOL_BLOCKS).step_by(2) {
        dg.write(r.v, lba * BLOCK_U64, &block_of(lba, 0x9f))
            .unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
    let fill = |lba: u64| Some(if lba.is_multiple_of(2) { 0x9f } else { r.fill });
    for (i, (&seg, first)) in r.segs.iter().zip(&r.first).enumerate() {
        put_back(
            &rig,
            &dg.sh.layout,
            seg,
            lost_copy(i),
            &first[lost_copy(i) as usize],
        );
    }
    drop(dg);
    rig.clean_restart();
    let dg = rig.group().clone();
    assert_eq!(dg.stats().gc_segments_cleaned_total, 0);
    let w = dg.create_volume("w", 16 * MIB).unwrap().id;
    let mut lba = 0;
    let cleaned = |dg: &DiskGroup| {
        let segs = dg.sh.segs.lock();
        r.segs
            .iter()
            .filter(|&&s| segs.segs[s as usize].state != SegState::Sealed)
            .count()
    };
    while cleaned(&dg) == 0 && lba < 4096 {
        for _ in 0..125 {
            dg.write(w, lba * BLOCK_U64, &block_of(lba, 0x9e)).unwrap();
            lba += 1;
        }
        assert!(
            dg.destage_all(Duration::from_secs(20)),
            "at block {lba} of w"
        );
    }
    let st = dg.stats();
    assert!(cleaned(&dg) > 0, "GC cleaned none of {:?}: {st:?}", r.segs);
    assert_eq!(st.checksum_errors_total, 0, "{st:?}");
    assert!(check_v(&dg, r.v, fill).is_empty());
    drop(dg);
    rig.power_cut_and_restart();
    assert!(check_v(rig.dg(), r.v, fill).is_empty());
}

/// A read through `read_async` checks the crcs the crc-block cache holds. The cache may hold a
/// stale copy's crc block: a blocking read takes copy A's crc block when it checks, and keeps
/// it when the blocks it read have the same content in both uses. A mismatch there goes again
/// the blocking way, which holds it against the whole summary, rather than failing the read.
#[test]
fn an_asynchronous_read_past_a_stale_cached_crc_block_reads_right() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 76);
    let r = reused(&mut rig, 0xb0);
    rig.clean_restart();
    let dg = rig.group().clone();
    let seg = r.segs[0];
    put_back(&rig, &dg.sh.layout, seg, 0, &r.first[0][0]);
    let stale = crate::format::decode_crc_block(&r.first[0][0][..BLOCK], seg, 0).unwrap();
    dg.sh.crc_blocks.lock().insert((seg, 0), Arc::new(stale));
    let e = read_summary(&dg.sh, seg).unwrap().unwrap().entries[0];
    let got = crate::tests::read_async_wait(&dg, r.v, e.lba * BLOCK_U64, BLOCK)
        .expect("the read went the asynchronous way");
    assert_eq!(got.unwrap(), block_of(e.lba, r.fill));
}

/// Two faults: copy A's header damaged, and copy B wholly stale (its write lost). Copy B's
/// header is then the only one that checks, but its crc blocks disagree with the data where
/// copy A's agree: it is not taken as the segment's summary, scrub does not copy it over copy
/// A's header (it reports the header instead), and copy B's stale crc block is mended from
/// copy A's. Data reads go on (copy A's crc blocks).
#[test]
fn a_stale_copy_is_not_mended_over_the_damaged_current_one() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 74);
    let r = reused(&mut rig, 0xa0);
    rig.clean_restart();
    let dg = rig.group().clone();
    let seg = r.segs[0];
    put_back(&rig, &dg.sh.layout, seg, 1, &r.first[0][1]);
    flip(&rig, &dg, seg, 0, header(&dg));
    let damaged_head = head_of(&dg.sh.layout, &area(&rig, &dg.sh.layout, seg, 0)).to_vec();
    assert!(
        read_summary(&dg.sh, seg).unwrap().is_none(),
        "the stale copy was taken as the summary"
    );
    assert!(check_v(&dg, r.v, |_| Some(r.fill)).is_empty());
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    let header_mend = format!("summary copy A of capacity segment {seg}: header");
    assert!(
        !report
            .metadata_repaired
            .iter()
            .any(|m| m.starts_with(&header_mend)),
        "the stale header was copied over the current one: {report:#?}"
    );
    assert_eq!(
        head_of(&dg.sh.layout, &area(&rig, &dg.sh.layout, seg, 0)),
        &damaged_head[..],
        "copy A's header was written"
    );
    assert!(
        report
            .metadata_damaged
            .iter()
            .any(|m| m.contains(&format!("capacity segment {seg}")) && m.contains("header")),
        "{report:#?}"
    );
    let crc_mend = format!("summary copy B of capacity segment {seg}: crc block 0 differed");
    assert!(
        report
            .metadata_repaired
            .iter()
            .any(|m| m.starts_with(&crc_mend)),
        "{crc_mend}: {report:#?}"
    );
    assert_eq!(report.bad_blocks_total, 0, "{report:#?}");
    assert!(check_v(&dg, r.v, |_| Some(r.fill)).is_empty());
}

/// A segment written and sealed by an opening that lost power before any checkpoint named it
/// is free at the next opening, which may hand out the same segment sequence numbers again.
/// Its summary is still on the device, and stays there in a copy whose next write is lost: it
/// must not pass for the newer use (it would, by a higher or equal sequence number).
#[test]
fn a_stale_copy_left_by_a_use_no_checkpoint_named_does_not_outrank_the_current_one() {
    a_use_no_checkpoint_named_then_a_lost_copy_write(75, false);
}

/// As above, after an opening whose counter went past the next opening's epoch · 2³² (it
/// handed out 2³² numbers or more: 4 PiB of segments of 1 MiB, a long-lived busy daemon):
/// the next opening must still start above every number it handed out, not at the
/// checkpoint's counter, which lags behind the segments written after it.
#[test]
fn a_use_no_checkpoint_named_does_not_outrank_after_an_opening_past_the_next_floor() {
    a_use_no_checkpoint_named_then_a_lost_copy_write(77, true);
}

/// A group last opened by a build that numbered segments from 1 on (before the rule that each
/// opening numbers above all before it): the segments its checkpoint names as recent carry
/// numbers far below that opening's epoch · 2³², and open applies them, as it did.
#[test]
fn recent_segments_numbered_by_an_earlier_build_are_applied_at_open() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 78);
    let dg = rig.group().clone();
    dg.sh.segs.lock().next_seq = 3;
    let v = written(&dg, 0xe0);
    let epoch = u64::from(dg.sh.durable.lock().epoch);
    drop(dg);
    rig.power_cut();
    assert!(durable_next_segment_seq(&rig) < epoch << 32);
    assert!(!durable_recent(&rig).is_empty());
    rig.start().expect("open");
    assert!(check_v(rig.dg(), v, |_| Some(0xe0)).is_empty());
}

/// The two tests above: `past_floor` sets the opening's counter past the next opening's
/// epoch · 2³² (a checkpoint records it) before the segments no checkpoint names are written.
fn a_use_no_checkpoint_named_then_a_lost_copy_write(seed: u64, past_floor: bool) {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), seed);
    let dg = rig.group().clone();
    let v = written(&dg, 0xc0);
    drop(dg);
    rig.clean_restart();
    let dg = rig.group().clone();
    if past_floor {
        let epoch = u64::from(dg.sh.durable.lock().epoch);
        dg.sh.segs.lock().next_seq = ((epoch + 1) << 32) + 5;
        // A change of the volume table writes a checkpoint, with the counter.
        dg.create_volume("w", MIB).unwrap();
        assert_eq!(durable_next_segment_seq(&rig), ((epoch + 1) << 32) + 5);
    }
    let (next_seq, free): (u64, Vec<u32>) = {
        let segs = dg.sh.segs.lock();
        let free = (0..segs.segs.len() as u32)
            .filter(|&s| segs.segs[s as usize].state == SegState::Free)
            .collect();
        (segs.next_seq, free)
    };
    let layer = dg.sh.index.read().volumes[&v].head;
    let layout = dg.sh.layout.clone();
    rig.power_cut();
    // What the lost opening left in every free segment: a whole summary, its segment sequence
    // number the next one the checkpoint expects, its entries "v" shifted by 7 blocks.
    let (geo, group) = (dg.sh.layout.geo, dg.sh.layout.group);
    let lost_use = |seg: u32| {
        let used = geo.data_blocks;
        let s = SegmentSummary {
            group,
            segment_seq: next_seq + 1,
            segment_index: seg,
            data_blocks_used: used,
            entries: (0..used)
                .map(|i| SummaryEntry {
                    kind: RecordKind::Write,
                    layer,
                    lba: (u64::from(i) + 7) % VOL_BLOCKS,
                    nblocks: 1,
                    seq: 1,
                    data_block: i,
                })
                .collect(),
            block_crcs: (0..used)
                .map(|i| crc32c::crc32c(&block_of(u64::from(i), 0xcf)))
                .collect(),
        };
        s.encode(&geo)
    };
    for &seg in &free {
        for copy in [0, 1] {
            put_back(&rig, &layout, seg, copy, &lost_use(seg));
        }
    }
    drop(dg);
    rig.start().unwrap();
    let dg = rig.group().clone();
    rewrite(&dg, v, 0xc1);
    let taken: Vec<u32> = sealed(&dg)
        .into_iter()
        .filter(|s| free.contains(s))
        .collect();
    assert!(!taken.is_empty());
    for &seg in &taken {
        put_back(&rig, &dg.sh.layout, seg, 0, &lost_use(seg));
    }
    drop(dg);
    rig.power_cut();
    let recent = durable_recent(&rig);
    assert!(
        taken.iter().all(|s| recent.contains(s)),
        "{taken:?} {recent:?}"
    );
    rig.start().expect("open");
    assert!(check_v(rig.dg(), v, |_| Some(0xc1)).is_empty());
}

/// The durable checkpoint's `next_segment_seq`.
fn durable_next_segment_seq(rig: &Rig) -> u64 {
    let images: Vec<MemDevice> = std::iter::once(&rig.fast)
        .chain(&rig.caps)
        .map(|d| d.snapshot_durable())
        .collect();
    let sbs: Vec<_> = images
        .iter()
        .map(|d| read_superblock(d).unwrap().expect("formatted"))
        .collect();
    let layout = layout_from(&sbs).unwrap();
    read_checkpoint(&images[0], &layout)
        .unwrap()
        .next_segment_seq
}

/// Each segment's summary copies as a device whose discard does not zero blocks (many do
/// not) would hold them: the last ones written there, sealed or not.
type Kept = std::collections::BTreeMap<u32, [Vec<u8>; 2]>;

/// Notes in `kept` the summary copies now on the device that are whole summaries (of sealed
/// segments, or left by a destage the power cut).
fn keep(rig: &Rig, dg: &DiskGroup, kept: &mut Kept) {
    let l = &dg.sh.layout;
    for seg in 0..l.segment_count() {
        for copy in [0, 1] {
            let a = area(rig, l, seg, copy);
            if SegmentSummary::decode(&[&a], &l.group, &l.geo, seg).is_some() {
                let both = kept.entry(seg).or_insert_with(|| [a.clone(), a.clone()]);
                both[copy as usize] = a;
            }
        }
    }
}

/// With the power off: the device loses the write of one summary copy of one segment that
/// `before` holds and the durable checkpoint names as recent (it keeps what `before` says the
/// copy held). Then the group opens, "v" must read `fill` everywhere, a scrub must find no
/// damage (and mend the stale copy), and so again after a power cut. What was lost.
fn lose_a_copy_write_then_check(
    rig: &mut Rig,
    rng: &mut StdRng,
    layout: &Layout,
    before: &Kept,
    v: VolumeId,
    fill: u8,
) -> Option<(u32, u32)> {
    let recent = durable_recent(rig);
    let in_use: Vec<(&u32, &[Vec<u8>; 2])> =
        before.iter().filter(|(s, _)| recent.contains(s)).collect();
    let lost = (!in_use.is_empty()).then(|| {
        let (seg, bytes) = in_use[rng.gen_range(0..in_use.len())];
        let copy = rng.gen_range(0..2u32);
        let left = &bytes[copy as usize];
        let what = match SegmentSummary::decode_head(left, &layout.group, &layout.geo, *seg) {
            Some(h) => format!(
                "a whole summary of segment sequence number {}",
                h.segment_seq
            ),
            None => "a summary that fails its checks".into(),
        };
        eprintln!(
            "the write of copy {} of segment {seg} is lost: it holds {what}",
            copy_name(copy)
        );
        put_back(rig, layout, *seg, copy, left);
        (*seg, copy)
    });
    rig.start().expect("open");
    let dg = rig.group().clone();
    assert!(check_v(&dg, v, |_| Some(fill)).is_empty());
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(report.clean(), "{report:#?}");
    if let Some((seg, copy)) = lost {
        let stale = before.get(&seg).map(|x| &x[copy as usize]);
        let current = area(rig, layout, seg, 1 - copy);
        // Lost only if it held something else: the same bytes, or a use of another segment
        // sequence number, or damage (a write the power cut tore).
        if sealed(&dg).contains(&seg) && stale.is_some_and(|b| *b != current) {
            let mended = format!(
                "summary copy {} of capacity segment {seg}: ",
                copy_name(copy)
            );
            assert!(
                report
                    .metadata_repaired
                    .iter()
                    .any(|m| m.starts_with(&mended)),
                "{mended}: {report:#?}"
            );
        }
        assert!(area(rig, layout, seg, 0) == area(rig, layout, seg, 1));
    }
    drop(dg);
    rig.power_cut_and_restart();
    assert!(check_v(rig.dg(), v, |_| Some(fill)).is_empty());
    lost
}

/// Randomised: the segments of an earlier writing used again by a destage that the power cuts
/// after a random number of device writes (between any two: data and copy B, copy B's flush
/// and copy A's write, copy A's write and its flush, a checkpoint's copies), then the device
/// loses the write of one summary copy of one of them. Then the segments that destage left
/// (torn, or with copy B and an older copy A) are used again, and again one copy's write is
/// lost. Every acknowledged write reads back after each restart, after a scrub (which finds
/// nothing it cannot mend), and after another power cut.
#[test]
fn power_cuts_while_segments_are_used_again_and_a_lost_copy_write_lose_nothing() {
    let seed =
        seed_for("power_cuts_while_segments_are_used_again_and_a_lost_copy_write_lose_nothing");
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..3u64 {
        let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), seed.wrapping_add(round));
        let dg = rig.group().clone();
        let layout = dg.sh.layout.clone();
        let mut kept = Kept::new();
        let v = written(&dg, 0xd0);
        keep(&rig, &dg, &mut kept);
        rewrite(&dg, v, 0xd1);
        keep(&rig, &dg, &mut kept);
        drop(dg);
        rig.clean_restart();
        let dg = rig.group().clone();
        dg.sh.hold_destager();
        for lba in 0..VOL_BLOCKS {
            dg.write(v, lba * BLOCK_U64, &block_of(lba, 0xd2)).unwrap();
        }
        let cut = rng.gen_range(0..24);
        rig.writes_left.store(cut, Ordering::SeqCst);
        dg.sh.drain.store(true, Ordering::SeqCst);
        dg.sh.destager_held.store(false, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !rig.power_is_off() && !dg.sh.log.lock().batches.is_empty() {
            assert!(std::time::Instant::now() < deadline, "destage stalled");
            dg.sh.wake_destager();
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(dg);
        rig.power_cut();
        let lost = lose_a_copy_write_then_check(&mut rig, &mut rng, &layout, &kept, v, 0xd2);
        eprintln!("round {round}: power cut after {cut} device writes; lost write: {lost:?}");
        let dg = rig.group().clone();
        keep(&rig, &dg, &mut kept);
        rewrite(&dg, v, 0xd3);
        drop(dg);
        rig.power_cut();
        let lost = lose_a_copy_write_then_check(&mut rig, &mut rng, &layout, &kept, v, 0xd3);
        eprintln!("round {round}: segments used again; lost write: {lost:?}");
    }
}
