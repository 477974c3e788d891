//! Segment summaries written twice (docs/FORMAT.md §3.5): one damaged or unreadable copy of a
//! crc block or of the header region costs nothing (data reads, GC, recovery after a power
//! cut), scrub mends it from the other; both copies damaged is what one was before: read
//! errors, never other data, and an open that refuses for a recent segment, naming it. A group
//! of format 2 (one copy) still opens and works as it did.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use strata_device::{AlignedBuf, Device, DeviceError, DeviceStats, MemDevice};

use crate::capacity::SegState;
use crate::format::{Superblock, SuperblockRead, BLOCK, BLOCK_U64};
use crate::layout::{layout_from, read_checkpoint, read_superblock};
use crate::tests::{seed_for, small_cfg, Rig, MIB};
use crate::*;

mod lost;
mod uncleanable;
mod stale;

const VOL_BLOCKS: u64 = 512;

/// Block `lba` of the test volume: its number in the first 8 bytes, then a fill byte.
fn block_of(lba: u64, fill: u8) -> Vec<u8> {
    let mut b = vec![fill; BLOCK];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b
}

/// A volume "v" written whole with `fill`, then destaged: sealed segments on the capacity tier.
fn written(dg: &DiskGroup, fill: u8) -> VolumeId {
    let v = dg.create_volume("v", VOL_BLOCKS * BLOCK_U64).unwrap().id;
    for lba in 0..VOL_BLOCKS {
        dg.write(v, lba * BLOCK_U64, &block_of(lba, fill)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
    v
}

/// Sealed data segments holding data.
fn sealed(dg: &DiskGroup) -> Vec<u32> {
    let segs = dg.sh.segs.lock();
    let out: Vec<u32> = (0..segs.segs.len() as u32)
        .filter(|&s| {
            let i = segs.segs[s as usize];
            i.state == SegState::Sealed && i.used_blocks > 0
        })
        .collect();
    assert!(!out.is_empty(), "nothing was destaged");
    out
}

/// (capacity device, byte offset) of block `block` of summary copy `copy` of `seg`.
fn summary_block(dg: &DiskGroup, seg: u32, copy: u32, block: u32) -> (usize, u64) {
    let (dev, off) = dg.sh.layout.seg_summary_byte(seg, copy);
    (dev, off + u64::from(block) * BLOCK_U64)
}

/// The first block of the header and entries region of a copy (after its crc blocks).
fn header(dg: &DiskGroup) -> u32 {
    dg.sh.layout.geo.crc_blocks
}

/// Flips a bit of a summary block on the device's durable content.
fn flip(rig: &Rig, dg: &DiskGroup, seg: u32, copy: u32, block: u32) {
    let (dev, off) = summary_block(dg, seg, copy, block);
    rig.caps[dev].flip_bit(off + 40, 3).unwrap();
}

/// Every block of "v" reads as `want(lba)` says: Some(fill) that data, None an I/O error.
/// Returns the error messages.
fn check_v(dg: &DiskGroup, v: VolumeId, want: impl Fn(u64) -> Option<u8>) -> Vec<String> {
    let mut errors = Vec::new();
    for lba in 0..VOL_BLOCKS {
        let mut got = vec![0u8; BLOCK];
        match (dg.read(v, lba * BLOCK_U64, &mut got), want(lba)) {
            (Ok(()), Some(fill)) => assert!(got == block_of(lba, fill), "block {lba} reads wrong"),
            (Err(e), None) => errors.push(e.to_string()),
            (Ok(()), None) => {
                panic!("block {lba} read as data despite both summary copies damaged")
            }
            (Err(e), Some(_)) => panic!("block {lba}: {e}"),
        }
    }
    errors
}

/// Reads the other copy served, as an administrator sees them (no index page is damaged
/// here, so these are summary reads).
fn copy_repairs(dg: &DiskGroup) -> u64 {
    dg.stats().metadata_copy_fallbacks_total
}

/// The checkpoint at rest on the fast device (read from a copy, so nothing is written).
fn durable_recent(rig: &Rig) -> Vec<u32> {
    let images: Vec<MemDevice> = std::iter::once(&rig.fast)
        .chain(&rig.caps)
        .map(|d| d.snapshot_durable())
        .collect();
    let sbs: Vec<_> = images
        .iter()
        .map(|d| read_superblock(d).unwrap().expect("formatted"))
        .collect();
    let layout = layout_from(&sbs).unwrap();
    read_checkpoint(&images[0], &layout).unwrap().recent
}

#[test]
fn a_damaged_crc_block_copy_is_read_from_the_other_then_mended_by_scrub() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 61);
    let v = written(rig.dg(), 0x11);
    // At rest, with nothing cached: every read of a crc block goes to the device.
    rig.clean_restart();
    let dg = rig.group().clone();
    assert_eq!(dg.sh.layout.geo.summary_copies, 2);
    let segs = sealed(&dg);
    for &seg in &segs {
        flip(&rig, &dg, seg, 0, 0);
    }
    assert!(check_v(&dg, v, |_| Some(0x11)).is_empty());
    assert!(
        copy_repairs(&dg) >= segs.len() as u64,
        "copy A was not read"
    );
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(report.clean(), "{report:#?}");
    for seg in &segs {
        let want =
            format!("summary copy A of capacity segment {seg}: crc block 0 rewritten from copy B");
        assert!(
            report.metadata_repaired.contains(&want),
            "{want}: {report:#?}"
        );
    }
    let again = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(
        again.clean() && again.metadata_repaired.is_empty(),
        "{again:#?}"
    );
    // Mended: copy B may go now, and copy A serves every read.
    for &seg in &segs {
        flip(&rig, &dg, seg, 1, 0);
    }
    drop(dg);
    rig.clean_restart();
    let dg = rig.group().clone();
    let before = copy_repairs(&dg);
    assert!(check_v(&dg, v, |_| Some(0x11)).is_empty());
    assert_eq!(copy_repairs(&dg), before, "copy A is whole again");
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert_eq!(report.metadata_repaired.len(), segs.len(), "{report:#?}");
    assert!(report
        .metadata_repaired
        .iter()
        .all(|r| r.contains("summary copy B")));
}

/// The summary of a segment sealed since the last index flush is read at open: with copy A's
/// header damaged, copy B's serves, and nothing acknowledged is lost.
#[test]
fn a_damaged_header_copy_of_a_recent_segment_does_not_stop_open_after_a_power_cut() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 62);
    let dg = rig.group().clone();
    let v = written(&dg, 0x21);
    // More in the log, acknowledged, not destaged.
    for lba in 0..8 {
        dg.write(v, lba * BLOCK_U64, &block_of(lba, 0x22)).unwrap();
    }
    rig.power_cut();
    let recent = durable_recent(&rig);
    assert!(
        !recent.is_empty(),
        "no segment sealed since the last index flush"
    );
    for &seg in &recent {
        flip(&rig, &dg, seg, 0, header(&dg));
    }
    drop(dg);
    rig.start()
        .expect("open with one header copy of each recent segment damaged");
    let dg = rig.group().clone();
    assert!(copy_repairs(&dg) >= recent.len() as u64);
    let want = |lba| Some(if lba < 8 { 0x22 } else { 0x21 });
    assert!(check_v(&dg, v, want).is_empty());
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(report.clean(), "{report:#?}");
    for seg in recent.iter().filter(|&&s| sealed(&dg).contains(&s)) {
        let want =
            format!("summary copy A of capacity segment {seg}: header rewritten from copy B");
        assert!(
            report.metadata_repaired.contains(&want),
            "{want}: {report:#?}"
        );
    }
    rig.power_cut_and_restart();
    assert!(check_v(rig.dg(), v, want).is_empty());
}

/// Both copies of a crc block: its data blocks fail to read (never other data), the rest of
/// the volume reads, and scrub reports the damage. Both copies of a recent segment's header:
/// open refuses, naming the segment, as it did with one copy.
#[test]
fn both_copies_damaged_fail_reads_and_refuse_an_open_that_needs_them() {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 63);
    let v = written(rig.dg(), 0x31);
    rig.clean_restart();
    let dg = rig.group().clone();
    let seg = sealed(&dg)[0];
    for copy in [0, 1] {
        flip(&rig, &dg, seg, copy, 0);
    }
    // The blocks of "v" that segment holds, as the index says.
    let layer = dg.sh.index.read().volumes[&v].head;
    let in_seg: Vec<u64> = (0..VOL_BLOCKS)
        .filter(|&lba| {
            let mut ents = Vec::new();
            crate::meta::with_tree_read(&dg.sh, |t| {
                ents.clear();
                t.lookup(
                    crate::ctree::page::key_of(layer, lba),
                    crate::ctree::page::key_of(layer, lba + 1),
                    &mut ents,
                )
            })
            .unwrap();
            ents.iter()
                .any(|e| matches!(e.loc, crate::map::Loc::Cap { seg: s, .. } if s == seg))
        })
        .collect();
    assert!(!in_seg.is_empty());
    let errors = check_v(&dg, v, |lba| (!in_seg.contains(&lba)).then_some(0x31));
    assert_eq!(errors.len(), in_seg.len());
    let why = format!("summary of capacity segment {seg} is damaged (crc block 0, both copies)");
    assert!(errors.iter().all(|e| e.contains(&why)), "{errors:?}");
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert_eq!(report.bad_blocks_total, in_seg.len() as u64, "{report:#?}");
    let damaged = report.metadata_damaged.join("\n");
    assert!(
        damaged.contains(&format!(
            "summary of capacity segment {seg} is damaged (crc block 0, both copies)"
        )),
        "{damaged}"
    );
    assert!(report.metadata_repaired.is_empty(), "{report:#?}");
    drop(dg);

    // A recent segment's header, both copies, then a power cut.
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 64);
    let dg = rig.group().clone();
    written(&dg, 0x32);
    rig.power_cut();
    let recent = durable_recent(&rig);
    let seg = recent[0];
    for copy in [0, 1] {
        flip(&rig, &dg, seg, copy, header(&dg));
    }
    drop(dg);
    let e = rig.start().expect_err("open refuses");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("the summary of capacity segment {seg}, sealed after the last index write, is damaged (both copies)"))
            && msg.contains("refusing to open"),
        "{msg}"
    );
}

/// Volume "v" written whole (`0x40`), then every other block again (`0x41`), destaged, and a
/// clean restart: the first segments are half dead, GC's best victims (returned), and no
/// summary is cached.
fn half_dead(rig: &mut Rig) -> (Arc<DiskGroup>, VolumeId, Vec<u32>) {
    let dg = rig.group().clone();
    let v = written(&dg, 0x40);
    for lba in (0..VOL_BLOCKS).step_by(2) {
        dg.write(v, lba * BLOCK_U64, &block_of(lba, 0x41)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
    drop(dg);
    rig.clean_restart();
    let dg = rig.group().clone();
    let victims: Vec<u32> = sealed(&dg)
        .into_iter()
        .filter(|&s| {
            dg.sh.segs.lock().segs[s as usize].live_blocks * 2 <= dg.sh.layout.geo.data_blocks
        })
        .collect();
    (dg, v, victims)
}

/// What `half_dead` wrote: block `lba`'s fill.
fn half_dead_fill(lba: u64) -> Option<u8> {
    Some(if lba.is_multiple_of(2) { 0x41 } else { 0x40 })
}

/// GC reads its victims' summaries whole: with copy A of every summary damaged (a crc block
/// of some, the header of others), it cleans from copy B, and everything reads back.
#[test]
fn gc_cleans_segments_whose_summary_copy_a_is_damaged() {
    let mut rig = Rig::new(16 * MIB, &[24 * MIB], small_cfg(), 65);
    let (dg, v, victims) = half_dead(&mut rig);
    let fill = half_dead_fill;
    assert!(!victims.is_empty());
    // The tier has room yet: GC has not looked at a summary, none is cached.
    assert_eq!(dg.stats().gc_segments_cleaned_total, 0);
    for (i, &seg) in victims.iter().enumerate() {
        let block = if i % 2 == 0 { 0 } else { header(&dg) };
        flip(&rig, &dg, seg, 0, block);
    }
    dg.sh.summaries.lock().forget(|_| true);
    dg.sh.crc_blocks.lock().forget(|_| true);
    // Another volume fills the tier until GC must clean.
    let w = dg.create_volume("w", 16 * MIB).unwrap().id;
    let mut lba = 0;
    while dg.stats().gc_segments_cleaned_total == 0 && lba < 4096 {
        for _ in 0..125 {
            dg.write(w, lba * BLOCK_U64, &block_of(lba, 0x42)).unwrap();
            lba += 1;
        }
        assert!(
            dg.destage_all(Duration::from_secs(20)),
            "at block {lba} of w"
        );
    }
    let st = dg.stats();
    assert!(st.gc_segments_cleaned_total > 0, "GC never ran: {st:?}");
    // A victim's live count falls only by GC here (nothing overwrites "v" any more).
    let cleaned = victims
        .iter()
        .filter(|&&s| dg.sh.segs.lock().segs[s as usize].state != SegState::Sealed)
        .count();
    assert!(
        cleaned > 0,
        "GC cleaned none of the damaged segments {victims:?}"
    );
    assert!(
        copy_repairs(&dg) >= cleaned as u64,
        "GC never read a damaged copy"
    );
    assert_eq!(st.checksum_errors_total, 0, "{st:?}");
    assert!(check_v(&dg, v, fill).is_empty());
    drop(dg);
    rig.power_cut_and_restart();
    assert!(check_v(rig.dg(), v, fill).is_empty());
}

/// A capacity device with bad sectors: reads of them fail (EIO) until they are written again,
/// as a disk remaps a sector on write.
struct BadSectors {
    inner: Arc<MemDevice>,
    bad: Mutex<Vec<Range<u64>>>,
}

impl BadSectors {
    fn hits(&self, offset: u64, len: usize) -> bool {
        let end = offset + len as u64;
        self.bad
            .lock()
            .iter()
            .any(|r| r.start < end && offset < r.end)
    }
}

impl Device for BadSectors {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        if self.hits(offset, buf.len()) {
            return Err(DeviceError::Io {
                device: self.inner.name().into(),
                offset,
                source: std::io::Error::other("unrecovered read error (test)"),
            });
        }
        self.inner.read_at(buf, offset)
    }
    fn read_async(
        &self,
        buf: AlignedBuf,
        _offset: u64,
        done: strata_device::ReadDone,
    ) -> Result<(), (AlignedBuf, strata_device::ReadDone)> {
        // Handed back: the caller reads blocking, through read_at.
        Err((buf, done))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        let end = offset + buf.len() as u64;
        self.bad
            .lock()
            .retain(|r| !(offset <= r.start && r.end <= end));
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.inner.discard(offset, len)
    }
    fn stats(&self) -> DeviceStats {
        self.inner.stats()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
}

/// Read errors from the device, not damage: copy A's crc block and copy B's header on bad
/// sectors at once. Reads take the crc block from B; scrub and GC piece the summary together
/// from the readable parts, and scrub rewrites each bad sector from the other copy.
#[test]
fn summary_blocks_on_bad_sectors_are_read_from_the_other_copy_and_rewritten() {
    let fast = Arc::new(MemDevice::new("fast", 32 * MIB));
    let cap = Arc::new(BadSectors {
        inner: Arc::new(MemDevice::new("cap0", 24 * MIB)),
        bad: Mutex::new(Vec::new()),
    });
    let open = || {
        let caps = vec![cap.clone() as Arc<dyn Device>];
        DiskGroup::open(fast.clone(), caps, small_cfg(), true).unwrap()
    };
    let dg = open();
    let v = written(&dg, 0x51);
    dg.shutdown().unwrap();
    drop(dg);
    let dg = open();
    let segs = sealed(&dg);
    let sector = |seg, copy, block| {
        let (_, off) = summary_block(&dg, seg, copy, block);
        off + 512..off + 1024
    };
    for &seg in &segs {
        let mut bad = cap.bad.lock();
        bad.push(sector(seg, 0, 0));
        bad.push(sector(seg, 1, header(&dg)));
    }
    assert!(check_v(&dg, v, |_| Some(0x51)).is_empty());
    // Whole summaries (what GC and recovery read) from the parts each copy still gives.
    for &seg in &segs {
        let s = crate::capacity::read_summary(&dg.sh, seg).unwrap();
        assert!(s.is_some_and(|s| s.block_crcs.len() as u32 == s.data_blocks_used));
    }
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(report.clean(), "{report:#?}");
    for seg in &segs {
        for want in [
            format!("summary copy A of capacity segment {seg}: crc block 0 rewritten from copy B"),
            format!("summary copy B of capacity segment {seg}: header rewritten from copy A"),
        ] {
            assert!(
                report.metadata_repaired.contains(&want),
                "{want}: {report:#?}"
            );
        }
    }
    assert!(
        cap.bad.lock().is_empty(),
        "every bad sector was written again"
    );
    let again = dg.scrub(&ScrubOptions::default()).unwrap();
    assert!(
        again.clean() && again.metadata_repaired.is_empty(),
        "{again:#?}"
    );
    dg.shutdown().unwrap();
}

fn superblock_version(dev: &MemDevice) -> u32 {
    let mut b = AlignedBuf::new_zeroed(BLOCK);
    dev.read_at(&mut b, 0).unwrap();
    match Superblock::decode(&b) {
        SuperblockRead::Valid(sb) => sb.version,
        _ => panic!("no superblock on {}", dev.name()),
    }
}

/// A group formatted with one summary copy (format 2, as builds before format 3 wrote it)
/// opens with this build, keeps its format and layout, and works: writes, destage, GC
/// pressure, power cuts and reads, in the model test. A new group is format 3, which a build
/// that reads only format 2 refuses ("formatted by a newer Strata").
#[test]
fn a_group_of_format_2_opens_keeps_one_summary_copy_and_works() {
    let old = EngineConfig {
        format_version: 2,
        ..small_cfg()
    };
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], old, 66);
    let dg = rig.group().clone();
    assert_eq!(dg.sh.layout.geo.summary_copies, 1);
    let v = written(&dg, 0x61);
    // The layout of format 2: data from the segment's first block, one summary at its tail.
    let seg = sealed(&dg)[0];
    let (_, data_at) = dg.sh.layout.seg_data_byte(seg, 0);
    assert_eq!(data_at, dg.sh.layout.segments[seg as usize].1);
    let (_, summary_at) = dg.sh.layout.seg_summary_byte(seg, 0);
    assert_eq!(summary_at, data_at + 253 * BLOCK_U64);
    drop(dg);
    rig.power_cut();
    // Opened by this build's defaults (which format 3): the group stays format 2.
    let cfg_new = small_cfg();
    assert_eq!(cfg_new.format_version, 3);
    let open_new = |rig: &Rig| {
        let (fast, caps) = rig.devices();
        DiskGroup::open(fast, caps, cfg_new.clone(), true).unwrap()
    };
    let dg = open_new(&rig);
    assert_eq!(dg.sh.layout.geo.summary_copies, 1);
    assert_eq!(dg.open_report().format_version, 2);
    assert!(check_v(&dg, v, |_| Some(0x61)).is_empty());
    for lba in 0..VOL_BLOCKS / 2 {
        dg.write(v, lba * BLOCK_U64, &block_of(lba, 0x62)).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
    dg.shutdown().unwrap();
    drop(dg);
    for d in std::iter::once(&rig.fast).chain(&rig.caps) {
        assert_eq!(superblock_version(d), 2, "{} changed format", d.name());
    }
    let dg = open_new(&rig);
    let want = |lba| Some(if lba < VOL_BLOCKS / 2 { 0x62 } else { 0x61 });
    assert!(check_v(&dg, v, want).is_empty());
    // One copy: a damaged crc block is an error for its blocks, and scrub says why.
    let seg = sealed(&dg)[0];
    let (dev, off) = dg.sh.layout.seg_summary_byte(seg, 0);
    rig.caps[dev].flip_bit(off + 40, 3).unwrap();
    dg.sh.crc_blocks.lock().forget(|_| true);
    dg.sh.summaries.lock().forget(|_| true);
    let report = dg.scrub(&ScrubOptions::default()).unwrap();
    let damaged = report.metadata_damaged.join("\n");
    assert!(
        damaged.contains(&format!(
            "summary of capacity segment {seg} is damaged (crc block 0, it has one copy)"
        )),
        "{damaged}"
    );
    dg.shutdown().unwrap();

    // A new group: format 3 on every device, at offset 8 where every build reads it.
    let rig3 = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 67);
    for d in std::iter::once(&rig3.fast).chain(&rig3.caps) {
        assert_eq!(superblock_version(d), 3);
        let mut b = AlignedBuf::new_zeroed(BLOCK);
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b[8..12], 3u32.to_le_bytes());
    }
}

/// The model test (random writes, zeroing, destage, GC pressure, power cuts, against a
/// reference disk) on a group of format 2.
#[test]
fn model_random_ops_with_power_cuts_on_a_group_of_format_2() {
    let seed = seed_for("model_random_ops_with_power_cuts_on_a_group_of_format_2");
    let cfg = EngineConfig {
        format_version: 2,
        ..small_cfg()
    };
    for i in 0..2 {
        crate::tests::model_run(seed.wrapping_add(i), 150, cfg.clone(), &[40 * MIB], true);
    }
}
