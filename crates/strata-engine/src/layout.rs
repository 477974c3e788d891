//! Where things live on each device, and reading/writing the superblocks and checkpoints.

use std::sync::Arc;

use strata_device::{AlignedBuf, Device};

use crate::error::EngineError;
use crate::format::*;

const MIB: u64 = 1 << 20;
/// Each checkpoint copy gets this much room (the volume table lives in it).
pub const CHECKPOINT_AREA_BYTES: u64 = MIB;
const FAST_LOG_OFFSET: u64 = 4 * MIB;
const SEGMENTS_OFFSET: u64 = MIB;
pub const MIN_FAST_BYTES: u64 = 16 * MIB;

/// The disk group's geometry, fixed at format time.
#[derive(Debug, Clone)]
pub struct Layout {
    pub group: Uuid,
    pub log_offset: u64,
    pub log_blocks: u64,
    pub checkpoint_offsets: [u64; 2],
    pub geo: SegmentGeometry,
    pub segment_size_bytes: u64,
    /// Global segment index -> (capacity device, byte offset). Interleaved across devices so
    /// consecutive segments land on different devices.
    pub segments: Vec<(usize, u64)>,
    /// Each device's size when the group was formatted on it (its superblock's), the fast
    /// device first: the part of it the group uses, whatever the device has grown to since.
    pub device_sizes_bytes: Vec<u64>,
}

impl Layout {
    pub fn segment_count(&self) -> u32 {
        self.segments.len() as u32
    }

    /// Byte offset on the fast device of log block `b`.
    pub fn log_byte(&self, b: u64) -> u64 {
        self.log_offset + b * BLOCK_U64
    }

    /// (device, byte offset) of data block `block` of segment `seg`.
    pub fn seg_data_byte(&self, seg: u32, block: u32) -> (usize, u64) {
        let (dev, off) = self.segments[seg as usize];
        (
            dev,
            off + u64::from(self.geo.data_start() + block) * BLOCK_U64,
        )
    }

    /// (device, byte offset) of summary copy `copy` (0: A, at the segment's tail; 1: B, at
    /// its head) of segment `seg`.
    pub fn seg_summary_byte(&self, seg: u32, copy: u32) -> (usize, u64) {
        let (dev, off) = self.segments[seg as usize];
        (
            dev,
            off + u64::from(self.geo.summary_start(copy)) * BLOCK_U64,
        )
    }
}

fn read_block(dev: &dyn Device, offset: u64) -> Result<AlignedBuf, EngineError> {
    let mut b = AlignedBuf::new_zeroed(BLOCK);
    dev.read_at(&mut b, offset)?;
    Ok(b)
}

/// How much of each end of a device must read as zeros for it to count as blank.
pub const BLANK_EDGE_BYTES: u64 = 1 << 20;

/// Refuses a device with data near either end, where file systems, volume managers and RAID
/// keep their labels (btrfs at 64 KiB and ZFS past its first 8 KiB, which the superblock
/// check alone reads as blank; md 0.90 and 1.0 at the end). Strata formats only blank devices.
pub fn check_blank(dev: &dyn Device) -> Result<(), EngineError> {
    let size = dev.size_bytes() / BLOCK_U64 * BLOCK_U64;
    let edge = BLANK_EDGE_BYTES.min(size);
    let mut b = AlignedBuf::new_zeroed(edge as usize);
    for at in [0, size - edge] {
        dev.read_at(&mut b, at)?;
        if b.iter().any(|&x| x != 0) {
            return Err(EngineError::Format(format!(
                "device {} is not blank: it holds data within 1 MiB of its {} (a file system, \
                 partition table or volume label?); Strata formats only blank devices: wipe it \
                 first (wipefs -a, blkdiscard) if nothing on it is needed",
                dev.name(),
                if at == 0 { "start" } else { "end" }
            )));
        }
    }
    Ok(())
}

fn write_padded(dev: &dyn Device, bytes: &[u8], offset: u64) -> Result<(), EngineError> {
    let mut b = AlignedBuf::new_zeroed(bytes.len().div_ceil(BLOCK) * BLOCK);
    b[..bytes.len()].copy_from_slice(bytes);
    dev.write_at(&b, offset)?;
    Ok(())
}

/// What the two superblock copies of a device hold, taken together.
pub(crate) enum Superblocks {
    /// Both copies are blank: the device was never formatted.
    Blank,
    /// The first valid copy, copy A tried first.
    Valid(Superblock),
    /// No copy is valid, and one at least is a superblock of a format this build reads that
    /// fails its checksum (or a check after it): a device of a disk group whose copies are
    /// both damaged. What is wrong with each copy ("copy A: ...; copy B: ...").
    Damaged(String),
    /// No copy is valid, and none is damaged as above (not a Strata device, or another
    /// format): the problem of the last copy that is not blank.
    Invalid(String),
}

/// Reads and decodes both superblock copies of `dev`.
pub(crate) fn read_superblocks(dev: &dyn Device) -> Result<Superblocks, EngineError> {
    let mut problems = Vec::with_capacity(2);
    let mut damaged = false;
    for copy in 0..2u64 {
        let b = read_block(dev, copy * BLOCK_U64)?;
        match Superblock::decode(&b) {
            SuperblockRead::Valid(sb) => return Ok(Superblocks::Valid(sb)),
            SuperblockRead::Blank => problems.push(None),
            SuperblockRead::Invalid(why) => {
                damaged |= is_damaged_superblock(&b);
                problems.push(Some(why));
            }
        }
    }
    if damaged {
        let copies = problems
            .iter()
            .zip(["A", "B"])
            .map(|(why, copy)| format!("copy {copy}: {}", why.as_deref().unwrap_or("blank")))
            .collect::<Vec<_>>();
        return Ok(Superblocks::Damaged(copies.join("; ")));
    }
    Ok(match problems.into_iter().flatten().next_back() {
        Some(problem) => Superblocks::Invalid(problem),
        None => Superblocks::Blank,
    })
}

/// Whether a superblock copy that does not decode is a superblock of a format this build
/// reads, so its failure is damage: a copy of another format, or of something else, is not.
fn is_damaged_superblock(b: &[u8]) -> bool {
    let version = b
        .get(8..12)
        .map(|v| u32::from_le_bytes([v[0], v[1], v[2], v[3]]));
    b.starts_with(SUPERBLOCK_MAGIC)
        && version.is_some_and(|v| (GROUP_VERSION_MIN..=GROUP_VERSION).contains(&v))
}

/// Reads both superblock copies (identical but for a capacity device's stamp, §3.1): Ok(None)
/// if the device is blank, the first valid copy otherwise, and an error naming the device when
/// neither copy is usable.
pub fn read_superblock(dev: &dyn Device) -> Result<Option<Superblock>, EngineError> {
    read_superblocks(dev)?.into_result(dev)
}

impl Superblocks {
    /// The superblock of `dev`, as [`read_superblock`] returns it.
    pub(crate) fn into_result(self, dev: &dyn Device) -> Result<Option<Superblock>, EngineError> {
        match self {
            Superblocks::Blank => Ok(None),
            Superblocks::Valid(sb) => Ok(Some(sb)),
            Superblocks::Damaged(copies) => Err(EngineError::Format(format!(
                "device {}: both superblock copies are damaged ({copies})",
                dev.name()
            ))),
            Superblocks::Invalid(problem) => Err(EngineError::Format(format!(
                "device {}: {problem}",
                dev.name()
            ))),
        }
    }
}

/// Whether `dev` holds data where its superblocks go but neither copy is a Strata superblock
/// (a superblock merely damaged still starts with the magic): data of something else.
pub fn holds_foreign_data(dev: &dyn Device) -> Result<bool, EngineError> {
    let mut data = false;
    for copy in 0..2u64 {
        let b = read_block(dev, copy * BLOCK_U64)?;
        if b.starts_with(SUPERBLOCK_MAGIC) {
            return Ok(false);
        }
        data |= b.iter().any(|&x| x != 0);
    }
    Ok(data)
}

/// Writes both superblock copies and flushes.
pub fn write_superblock(dev: &dyn Device, sb: &Superblock) -> Result<(), EngineError> {
    let b = sb.encode();
    write_padded(dev, &b, 0)?;
    write_padded(dev, &b, BLOCK_U64)?;
    dev.flush()?;
    Ok(())
}

/// Sets a capacity device's stamp (`Superblock::stamp`) in both superblock copies. The copy
/// not read from is written first, each write made durable before the next, so a valid copy
/// exists at every instant (a damaged copy is mended on the way).
pub fn write_stamp(dev: &dyn Device, stamp: u32) -> Result<(), EngineError> {
    let mut found = None;
    for copy in 0..2u64 {
        let b = read_block(dev, copy * BLOCK_U64)?;
        match Superblock::decode(&b) {
            SuperblockRead::Valid(sb) if found.is_none() => found = Some((copy, sb)),
            SuperblockRead::Valid(_) => {}
            _ => tracing::warn!(
                device = dev.name(),
                "superblock copy {} is damaged; rewriting it",
                if copy == 0 { "A" } else { "B" }
            ),
        }
    }
    let Some((read_from, mut sb)) = found else {
        return Err(EngineError::Format(format!(
            "device {}: no valid superblock to stamp",
            dev.name()
        )));
    };
    sb.stamp = stamp;
    let b = sb.encode();
    for copy in [1 - read_from, read_from] {
        write_padded(dev, &b, copy * BLOCK_U64)?;
        dev.flush()?;
    }
    Ok(())
}

/// Rewrites the superblock copy of `dev` that differs from `used`, the copy an open identified
/// the group by (valid, and agreeing with the other devices' superblocks): one damaged, blank,
/// unreadable, or valid with other contents. The copy equal to `used` is the only source, and
/// is never written; if neither copy is equal to it, nothing is written and the open fails.
pub fn mend_superblock(dev: &dyn Device, used: &Superblock) -> Result<(), EngineError> {
    let mut copies = Vec::with_capacity(2);
    for copy in 0..2u64 {
        let mut b = AlignedBuf::new_zeroed(BLOCK);
        let state = match dev.read_at(&mut b, copy * BLOCK_U64) {
            Err(e) => Err(format!("cannot be read ({e})")),
            Ok(()) => match Superblock::decode(&b) {
                SuperblockRead::Valid(sb) if sb == *used => Ok(()),
                SuperblockRead::Valid(_) => Err("differs from the copy this open used".into()),
                SuperblockRead::Blank => Err("is blank".into()),
                SuperblockRead::Invalid(why) => Err(format!("is damaged ({why})")),
            },
        };
        copies.push((b, state));
    }
    let Some(good) = copies.iter().position(|(_, state)| state.is_ok()) else {
        return Err(EngineError::Format(format!(
            "device {}: neither superblock copy is the one this open read at its start: \
             something else wrote to the device meanwhile; its superblocks were left as they are",
            dev.name()
        )));
    };
    let bad = 1 - good;
    let (good_block, (bad_block, bad_state)) = (&copies[good].0, &copies[bad]);
    let Err(state) = bad_state else {
        // Both copies are `used` (the common case): nothing to rewrite.
        return Ok(());
    };
    debug_assert!(good_block[..] != bad_block[..]);
    let copy_name = |copy: usize| if copy == 0 { "A" } else { "B" };
    tracing::warn!(
        device = dev.name(),
        "superblock copy {} {state}; rewriting it from copy {}",
        copy_name(bad),
        copy_name(good)
    );
    dev.write_at(good_block, bad as u64 * BLOCK_U64)?;
    dev.flush()?;
    Ok(())
}

/// The log area a fast device of `fast_size_bytes` gets when a group is formatted on it.
pub fn new_log_size_bytes(fast_size_bytes: u64) -> u64 {
    (fast_size_bytes / BLOCK_U64 * BLOCK_U64).saturating_sub(FAST_LOG_OFFSET)
}

/// Formats blank devices into a new disk group of format `version` (`GROUP_VERSION`, or
/// `GROUP_VERSION_MIN` for a group older builds open). `check` sees the layout before
/// anything is written (the caller's limits that depend on it).
pub fn format(
    fast: &dyn Device,
    caps: &[Arc<dyn Device>],
    segment_size_bytes: u64,
    version: u32,
    check: impl FnOnce(&Layout) -> Result<(), EngineError>,
) -> Result<(Layout, Checkpoint), EngineError> {
    let group = new_uuid();
    let fast_size = fast.size_bytes() / BLOCK_U64 * BLOCK_U64;
    if fast_size < MIN_FAST_BYTES {
        return Err(EngineError::InvalidArgument(format!(
            "fast device {} is {fast_size} bytes; at least {MIN_FAST_BYTES} are needed",
            fast.name()
        )));
    }
    if !(GROUP_VERSION_MIN..=GROUP_VERSION).contains(&version) {
        return Err(EngineError::InvalidArgument(format!(
            "cannot format version {version}; this build formats {GROUP_VERSION_MIN} and {GROUP_VERSION}"
        )));
    }
    let fast_sb = Superblock {
        version,
        role: Role::Fast,
        group,
        device_index: 0,
        capacity_devices: caps.len() as u32,
        device_size_bytes: fast_size,
        segment_size_bytes,
        checkpoint_offsets: [MIB, 2 * MIB],
        checkpoint_size_bytes: CHECKPOINT_AREA_BYTES,
        log_offset: FAST_LOG_OFFSET,
        log_size_bytes: new_log_size_bytes(fast_size),
        segments_offset: 0,
        segment_count: 0,
        stamp: 0,
    };
    let mut sbs = vec![fast_sb];
    for (i, dev) in caps.iter().enumerate() {
        let size = dev.size_bytes() / BLOCK_U64 * BLOCK_U64;
        let count = size.saturating_sub(SEGMENTS_OFFSET) / segment_size_bytes;
        if count < 2 {
            // The superblocks come first, so a device of exactly two segments holds one.
            let min_bytes = SEGMENTS_OFFSET + 2 * segment_size_bytes;
            return Err(EngineError::InvalidArgument(format!(
                "capacity device {} is {size} bytes; at least {min_bytes} are needed \
                 (1 MiB of superblocks, then 2 segments of {segment_size_bytes} bytes)",
                dev.name()
            )));
        }
        sbs.push(Superblock {
            role: Role::Capacity,
            device_index: i as u32,
            device_size_bytes: size,
            checkpoint_offsets: [0, 0],
            checkpoint_size_bytes: 0,
            log_offset: 0,
            log_size_bytes: 0,
            segments_offset: SEGMENTS_OFFSET,
            segment_count: count,
            // The format's epoch (its checkpoint's).
            stamp: 1,
            ..sbs[0].clone()
        });
    }
    // Capacity first, then the empty checkpoint, the fast superblock last: the group exists
    // only once everything it needs is durable. A crash before that leaves a blank fast
    // device; open then refuses to format over the capacity devices it finds labelled (they
    // could be a real group whose fast device was replaced) and says so.
    // Every check comes before the first write: a refused format leaves the devices blank,
    // so the same devices can be formatted once the settings are right.
    let layout = layout_from(&sbs)?;
    check(&layout)?;
    for (dev, sb) in caps.iter().zip(&sbs[1..]) {
        write_superblock(dev.as_ref(), sb)?;
    }
    // Two paths to one storage (a disk seen twice, a file and a loop device over it) pass
    // every check above, and the second label overwrites the first: each device must read
    // back as itself. If one does not, the labels go again (those places held zeros), so the
    // devices stay blank.
    for (i, dev) in caps.iter().enumerate() {
        let back = read_superblock(dev.as_ref()).ok().flatten();
        if back.is_none_or(|sb| sb.device_index != i as u32) {
            for dev in caps {
                let zeros = AlignedBuf::new_zeroed(2 * BLOCK);
                dev.write_at(&zeros, 0)?;
                dev.flush()?;
            }
            return Err(EngineError::InvalidArgument(format!(
                "capacity device {} did not read back as itself after formatting: two of the \
                 devices given are the same storage",
                dev.name()
            )));
        }
    }
    let now = crate::format::unix_now_s();
    let wear = vec![
        DeviceWear {
            bytes_written_total: 0,
            first_use_unix_s: now
        };
        1 + caps.len()
    ];
    let cp = Checkpoint {
        group,
        generation: 1,
        log_tail_offset: 0,
        log_tail_seq: 1,
        epoch: 1,
        log_end_seq: 0,
        next_id: 1,
        index_generation: 0,
        next_segment_seq: 1,
        index_root: None,
        segtab: Vec::new(),
        streams: [StreamPos::NONE; 2],
        recent: Vec::new(),
        layers: Vec::new(),
        volumes: Vec::new(),
        snapshots: Vec::new(),
        wear,
        device_stamps: Some((1, 1)),
        tail_destaged: None,
    };
    write_checkpoint(fast, &layout, &cp)?;
    write_superblock(fast, &sbs[0])?;
    Ok((layout, cp))
}

/// Builds the layout from the superblocks of all devices (fast first, then capacity in order).
pub fn layout_from(sbs: &[Superblock]) -> Result<Layout, EngineError> {
    let fast = &sbs[0];
    let geo = SegmentGeometry::for_version(fast.segment_size_bytes, fast.version);
    let max = sbs[1..].iter().map(|s| s.segment_count).max().unwrap_or(0);
    let mut segments = Vec::new();
    for local in 0..max {
        for (dev, sb) in sbs[1..].iter().enumerate() {
            if local < sb.segment_count {
                segments.push((dev, sb.segments_offset + local * sb.segment_size_bytes));
            }
        }
    }
    let max = MAX_SEGTAB_PAGES as usize * crate::ctree::page::SEGTAB_PER_PAGE;
    if segments.len() > max {
        return Err(EngineError::InvalidArgument(format!(
            "the capacity devices hold {} segments; a disk group records at most {max}: use larger segments",
            segments.len()
        )));
    }
    Ok(Layout {
        group: fast.group,
        log_offset: fast.log_offset,
        log_blocks: fast.log_size_bytes / BLOCK_U64,
        checkpoint_offsets: fast.checkpoint_offsets,
        geo,
        segment_size_bytes: fast.segment_size_bytes,
        segments,
        device_sizes_bytes: sbs.iter().map(|sb| sb.device_size_bytes).collect(),
    })
}

/// Reads both checkpoint copies and returns the newest valid one, repairing the other copy
/// when it is damaged or stale.
pub fn read_checkpoint(fast: &dyn Device, layout: &Layout) -> Result<Checkpoint, EngineError> {
    let mut copies = Vec::new();
    let mut problems = Vec::new();
    for off in layout.checkpoint_offsets {
        let mut b = AlignedBuf::new_zeroed(CHECKPOINT_AREA_BYTES as usize);
        fast.read_at(&mut b, off)?;
        match Checkpoint::decode(&b, &layout.group) {
            Ok(cp) => copies.push(Some(cp)),
            Err(why) => {
                problems.push(why);
                copies.push(None)
            }
        }
    }
    let best = copies
        .iter()
        .flatten()
        .max_by_key(|c| c.generation)
        .cloned();
    let Some(best) = best else {
        return Err(EngineError::Format(format!(
            "fast device {}: both metadata copies are unreadable ({})",
            fast.name(),
            problems.join("; ")
        )));
    };
    let stale = copies
        .iter()
        .position(|c| c.as_ref().map(|c| c.generation) != Some(best.generation));
    if let Some(stale) = stale {
        // Writes go to one copy, then the other: a stop in between (a crash, a power cut, a
        // kill) leaves one copy a write behind, or cut short, and nothing is lost.
        match &copies[stale] {
            Some(old) => tracing::info!(
                device = fast.name(),
                "checkpoint copy {} is one write behind the other (generation {} against {}), \
                 as a stop between the two copies' writes leaves it; writing it again",
                stale,
                old.generation,
                best.generation
            ),
            None => tracing::warn!(
                device = fast.name(),
                "checkpoint copy {stale} does not check ({}): a write of it cut short by a \
                 crash or a power cut leaves it so, else the device damaged it; writing it \
                 again from the other copy",
                problems.join("; ")
            ),
        }
        // The stale copy first: the whole one is not overwritten while it is the only one.
        write_checkpoint_from(fast, layout, &best, stale).map_err(|(e, _)| e)?;
    }
    Ok(best)
}

/// Writes the checkpoint to both copies, one after the other, each made durable before the
/// next: at every instant at least one copy is complete.
pub fn write_checkpoint(
    fast: &dyn Device,
    layout: &Layout,
    cp: &Checkpoint,
) -> Result<(), EngineError> {
    write_checkpoint_from(fast, layout, cp, 0).map_err(|(e, _)| e)
}

/// [`write_checkpoint`], copy `first` (0 for A, 1 for B) first. On failure, also says which
/// copy may be damaged now (the one being written): the next checkpoint must start with that
/// one, so the other, complete copy is not overwritten while no other complete copy exists.
/// Nothing written (the checkpoint does not encode) leaves `first` as it was.
pub fn write_checkpoint_from(
    fast: &dyn Device,
    layout: &Layout,
    cp: &Checkpoint,
    first: usize,
) -> Result<(), (EngineError, usize)> {
    let bytes = cp
        .encode(CHECKPOINT_AREA_BYTES as usize)
        .map_err(|e| (e, first))?;
    for copy in [first, 1 - first] {
        let off = layout.checkpoint_offsets[copy];
        write_padded(fast, &bytes, off)
            .and_then(|()| Ok(fast.flush()?))
            .map_err(|e| (e, copy))?;
    }
    Ok(())
}
