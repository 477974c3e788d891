//! Opening a disk group: identify the devices, format blank ones, and recover: the durable
//! index and segment table, the summaries of segments sealed after them, then the log.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};
use strata_device::Device;

use crate::capacity::{copy_name, summary_or_missing, Missing, SegTable};
use crate::ctree::page::PageBody;
use crate::ctree::CTree;
use crate::destage::{apply_tree_sets, TreeSet};
use crate::error::EngineError;
use crate::format::*;
use crate::layout::*;
use crate::log::LogState;
use crate::map::{ExtentMap, Loc};
use crate::meta;
use crate::open_control::{OpenControl, OpenStep};
use crate::replay::replay;
use crate::shared::*;
use crate::EngineConfig;

/// What `open` found, for the startup log line.
#[derive(Debug, Clone, Default)]
pub struct OpenReport {
    pub formatted: bool,
    pub replayed_batches: usize,
    pub replayed_records: usize,
    /// Segments sealed after the last index flush whose summaries were applied.
    pub recent_segments: usize,
    /// Log records whose data failed its checksum (their blocks read as I/O errors).
    pub damaged_log_records: usize,
    /// Runs of lone writes whose last write was torn in flight (never acknowledged), so
    /// replayed without it.
    pub torn_run_writes: usize,
    /// Batches (by first sequence number) whose header failed its checksum but whose records
    /// all checked, so replayed whole (`replay::salvage`).
    pub salvaged_log_headers: Vec<u64>,
    /// Records that could not be read, skipped because the config asked
    /// (`EngineConfig::skip_damaged_log_batches`): their writes are lost.
    pub skipped_log_records: Vec<crate::replay::SkippedRecords>,
    /// The group's segment size, as formatted: a group keeps the size it was made with,
    /// whatever `EngineConfig::segment_size_bytes` asks at later opens.
    pub segment_size_bytes: u64,
    /// The largest write batch this opening uses (`EngineConfig::max_batch_bytes`, lowered to
    /// what the group allows with `auto_max_batch`).
    pub max_batch_bytes: usize,
    /// The group's format (docs/FORMAT.md §3.1): 3, or 2 for a group with one summary copy per
    /// segment, which keeps its format.
    pub format_version: u32,
}

/// Identifies (or formats) the devices and recovers the group, stopping with
/// `EngineError::Cancelled` at `ctl`'s request while nothing it wrote matters (module
/// open_control.rs; docs/FORMAT.md §5.1).
pub fn open_shared(
    fast: Arc<dyn Device>,
    caps: Vec<Arc<dyn Device>>,
    mut cfg: EngineConfig,
    create_if_blank: bool,
    ctl: &OpenControl,
) -> Result<(Arc<Shared>, OpenReport), EngineError> {
    ctl.progress.enter(OpenStep::Reading);
    ctl.progress.set_log_replayed_bytes(0);
    ctl.check()?;
    if caps.is_empty() {
        return Err(EngineError::InvalidArgument(
            "a disk group needs at least one capacity device".into(),
        ));
    }
    validate_config(&cfg)?;
    let mut report = OpenReport::default();
    // With the layout and checkpoint, the stamps the capacity devices carry (`Superblock::stamp`)
    // and the fast superblock the group was identified by (None for a group formatted now).
    let (layout, checkpoint, stamps, fast_sb) = match superblock_or_foreign(fast.as_ref(), "fast")?
    {
        None => {
            if !create_if_blank {
                return Err(EngineError::Format(format!(
                    "fast device {} is not formatted",
                    fast.name()
                )));
            }
            for c in &caps {
                if superblock_or_foreign(c.as_ref(), "capacity")?.is_some() {
                    return Err(EngineError::Format(format!(
                        "capacity device {} already belongs to a disk group but the fast device {} is blank; refusing to format over it (if a first start was cut short before the group existed, wipe the capacity device's first 8 KiB to start over; if the fast device was replaced or wiped, that group's data cannot be read without it)",
                        c.name(),
                        fast.name()
                    )));
                }
            }
            for dev in std::iter::once(&fast).chain(&caps) {
                check_blank(dev.as_ref())?;
            }
            let segment_size = match cfg.auto_segment_size {
                true => auto_segment_size(&cfg, &caps),
                false => cfg.segment_size_bytes,
            };
            let fits = |layout: &Layout| batch_fits(&fitted_batch(&cfg, layout), layout);
            let (layout, cp) =
                format(fast.as_ref(), &caps, segment_size, cfg.format_version, fits)?;
            report.formatted = true;
            report.format_version = cfg.format_version;
            let stamps = cp.device_stamps.map_or(0, |s| s.0);
            (layout, cp, vec![stamps; caps.len()], None)
        }
        Some(sb) => {
            let (layout, sbs) = identify(&sb, fast.as_ref(), &caps)?;
            report.format_version = sb.version;
            batch_fits(&fitted_batch(&cfg, &layout), &layout)?;
            let cp = read_checkpoint(fast.as_ref(), &layout)?;
            check_stamps(&cp, &sbs[1..], fast.as_ref(), &caps)?;
            let stamps = sbs[1..].iter().map(|sb| sb.stamp).collect();
            (layout, cp, stamps, Some(sb))
        }
    };
    report.segment_size_bytes = layout.segment_size_bytes;
    cfg = fitted_batch(&cfg, &layout);
    report.max_batch_bytes = cfg.max_batch_bytes;
    ctl.progress
        .set_log_area_bytes(layout.log_blocks * BLOCK_U64);
    let sh = Arc::new(new_shared(fast, caps, cfg, layout, &checkpoint));
    #[cfg(test)]
    sh.destager_held.store(ctl.hold_destager, Ordering::Relaxed);
    // Up to the end of the replay, open writes nothing but what is done already: a format
    // (whole, the fast superblock last: §5.1 step 1) or a checkpoint repair (both copies the
    // same winner: step 2). Steps 3 to 7 only read and build state in memory, so an open
    // stopped anywhere in them leaves the devices as the next open found them, and that open
    // recovers every acknowledged write as this one would have. From step 8 on it writes, and
    // runs to its end: nothing later checks `ctl`.
    load_segment_table(&sh, &checkpoint, ctl)?;
    recount_index_pages(&sh, &checkpoint, ctl)?;
    report.recent_segments = apply_recent(&sh, &checkpoint.recent, ctl)?;
    let r = replay(
        &sh,
        checkpoint.log_tail_offset / BLOCK_U64,
        checkpoint.log_tail_seq,
        checkpoint.log_end_seq,
        checkpoint.tail_destaged,
        checkpoint.epoch,
        ctl,
    )?;
    ctl.progress.enter(OpenStep::Writing);
    let tail_skipped = r
        .skipped
        .first()
        .is_some_and(|s| s.first_seq == checkpoint.log_tail_seq);
    if r.batches == 0 || tail_skipped {
        // The tail batch the checkpoint's destaged part belongs to is not there (its header
        // damaged, or a run whose one write was torn): the next batch written takes its
        // sequence number, and must not lose its first part to the old batch's record.
        sh.durable.lock().tail_part = None;
    }
    for &(b, c) in &r.crcs {
        sh.fast_crcs[b as usize].store(c, Ordering::Relaxed);
    }
    report.replayed_batches = r.batches;
    report.replayed_records = r.records;
    report.damaged_log_records = r.damaged_records;
    report.torn_run_writes = r.stale_copies.len();
    report.salvaged_log_headers = r.salvaged.clone();
    report.skipped_log_records = r.skipped.clone();
    crate::replay::clear_end(&sh, &r)?;
    let mut state = r.state;
    state.cache_budget_blocks = (sh.cfg.read_cache_ratio * sh.layout.log_blocks as f64) as u64;
    let max_batch_blocks = crate::log::max_batch_blocks(sh.cfg.max_batch_bytes);
    state.rotation_reserve_blocks =
        crate::log::rotation_reserve_blocks(max_batch_blocks, sh.layout.log_blocks);
    sh.retired_seq.store(state.next_seq, Ordering::Release);
    *sh.log.lock() = state;
    count_fast_live(&sh);
    sh.rebuild_runtimes();
    // A new epoch before anything new reaches the log, and an index without recent segments:
    // the next open starts from here. The capacity devices then carry the new epoch as their
    // stamp: a copy of one taken before now is older than the group from here on.
    let epoch = checkpoint.epoch + 1;
    let oldest = stamps.iter().copied().min().unwrap_or(0);
    {
        let mut d = sh.durable.lock();
        d.epoch = epoch;
        d.device_stamps = (oldest, epoch);
    }
    meta::flush_index(&sh)?;
    // A fast superblock copy damaged while the group was closed is mended here, as a capacity
    // device's is by its stamp: from the copy the group was identified by, once the open writes.
    if let Some(sb) = &fast_sb {
        let _sb = sh.superblocks.lock();
        mend_superblock(sh.fast.as_ref(), sb)?;
    }
    stamp_capacity_devices(&sh, epoch)?;
    // Free segments hold nothing any checkpoint from here on reads.
    crate::capacity::discard_free_segments(&sh);
    Ok((sh, report))
}

/// Stamps every capacity device with `stamp`, between two checkpoints: the one before (which
/// the caller wrote) must accept both the old stamps and `stamp`, since a crash can leave any
/// mix of them; the one after accepts `stamp` alone.
pub(crate) fn stamp_capacity_devices(sh: &Shared, stamp: u32) -> Result<(), EngineError> {
    debug_assert!(sh.durable.lock().device_stamps.1 == stamp);
    for dev in &sh.caps {
        let _sb = sh.superblocks.lock();
        write_stamp(dev.as_ref(), stamp)?;
    }
    let mut d = sh.durable.lock();
    d.device_stamps = (stamp, stamp);
    let tail = d.log_tail;
    sh.write_checkpoint_locked(&mut d, tail)
}

/// Refuses a capacity device whose stamp the checkpoint does not accept: one restored from an
/// image older than the fast device's metadata, or a fast device older than its capacity
/// devices. Either way its index and segments no longer describe each other, and reads would
/// return old data as if it were current.
fn check_stamps(
    cp: &Checkpoint,
    cap_sbs: &[Superblock],
    fast: &dyn Device,
    caps: &[Arc<dyn Device>],
) -> Result<(), EngineError> {
    let Some((low, high)) = cp.device_stamps else {
        return Ok(());
    };
    let expected = match low == high {
        true => format!("{low}"),
        false => format!("{low} to {high}"),
    };
    let group = uuid_hex(&cp.group);
    for (sb, dev) in cap_sbs.iter().zip(caps) {
        if sb.stamp < low {
            let last = match sb.stamp {
                0 => "it carries no opening stamp (it was last used by a build without them)"
                    .to_string(),
                n => format!("it was last used by opening {n} of the group"),
            };
            return Err(EngineError::Format(format!(
                "capacity device {} is older than the rest of disk group {group}: {last}, and \
                 the metadata on fast device {} expects opening {expected}. It looks restored \
                 from an older image or copy, and would return old data as current: put back \
                 the device the group last used, or restore every device of the group from \
                 the same point in time",
                dev.name(),
                fast.name(),
            )));
        }
        if sb.stamp > high {
            return Err(EngineError::Format(format!(
                "fast device {} is older than the rest of disk group {group}: capacity device {} \
                 was last used by opening {} of the group, and the fast device's metadata knows \
                 openings up to {high} only. The fast device looks restored from an older image \
                 or copy, and would return old data as current: put back the fast device the \
                 group last used, or restore every device of the group from the same point in \
                 time",
                fast.name(),
                dev.name(),
                sb.stamp,
            )));
        }
    }
    Ok(())
}

/// [`read_superblock_of`], but a device holding something else's data where the superblocks go
/// is refused in words that say so, and that nothing was written to it.
fn superblock_or_foreign(dev: &dyn Device, tier: &str) -> Result<Option<Superblock>, EngineError> {
    match read_superblock_of(dev, tier) {
        Err(EngineError::Format(_)) if crate::layout::holds_foreign_data(dev)? => {
            Err(EngineError::Format(format!(
                "{tier} device {} holds data that is not a Strata device (its first 8 KiB are \
                 neither blank nor a Strata superblock); it was left untouched. A new disk group \
                 is made only on blank devices: name a blank device, or a file that does not \
                 exist yet (it is created), or, if nothing on this one is needed, wipe it first \
                 (wipefs -a, blkdiscard; or remove the file)",
                dev.name()
            )))
        }
        other => other,
    }
}

/// [`read_superblock`] of a `tier` ("fast" or "capacity") device, refusing one whose superblock
/// copies are both damaged with what that means for such a device.
fn read_superblock_of(dev: &dyn Device, tier: &str) -> Result<Option<Superblock>, EngineError> {
    let copies = match read_superblocks(dev)? {
        Superblocks::Damaged(copies) => copies,
        other => return other.into_result(dev),
    };
    let meaning = match tier {
        "fast" => {
            "the disk group cannot be opened without one, as the superblock says where the \
             group's metadata and write log are on this device"
        }
        _ => {
            "the device cannot be identified (which disk group it belongs to, and which of the \
             group's capacity devices it is), so the group cannot be opened with it"
        }
    };
    Err(EngineError::Format(format!(
        "{tier} device {}: both superblock copies are damaged ({copies}); {meaning}. Check that \
         the path names the right device; if it does, something overwrote the device's first \
         8 KiB, or the device is failing",
        dev.name()
    )))
}

/// The largest write batch a group takes, by each of its two bounds: a batch must fit half a
/// segment's data area (the destager moves whole records) and a quarter of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Half the data area of one segment, in whole blocks.
    pub segment_bytes: u64,
    /// A quarter of the log, in whole blocks.
    pub log_bytes: u64,
}

impl BatchLimits {
    fn of(geo: &SegmentGeometry, log_blocks: u64) -> BatchLimits {
        BatchLimits {
            segment_bytes: u64::from(geo.data_blocks) / 2 * BLOCK_U64,
            log_bytes: log_blocks / 4 * BLOCK_U64,
        }
    }

    /// The limits of a group that formatting a fast device of `fast_size_bytes` with
    /// `segment_size_bytes` segments in format `version` would make (callers check the
    /// settings of a first start with it before they create any device).
    pub fn for_new_group(
        segment_size_bytes: u64,
        version: u32,
        fast_size_bytes: u64,
    ) -> BatchLimits {
        let geo = SegmentGeometry::for_version(segment_size_bytes, version);
        let log_blocks = crate::layout::new_log_size_bytes(fast_size_bytes) / BLOCK_U64;
        BatchLimits::of(&geo, log_blocks)
    }
}

/// Formats choosing the segment size (`EngineConfig::auto_segment_size`) give the capacity
/// devices at least this many segments, unless that would take them under 1 MiB.
pub const AUTO_MIN_SEGMENTS: u64 = 1024;

/// The segment size a format with `auto_segment_size` gives `caps`: `segment_size_bytes`,
/// halved while the devices would hold fewer than `AUTO_MIN_SEGMENTS` (and, with the batch
/// size fixed, while a batch still fits half a segment's data area), 1 MiB at least.
fn auto_segment_size(cfg: &EngineConfig, caps: &[Arc<dyn Device>]) -> u64 {
    let total: u64 = caps.iter().map(|c| c.size_bytes()).sum();
    let mut seg = cfg.segment_size_bytes;
    while total / seg < AUTO_MIN_SEGMENTS {
        let half = seg / 2;
        if half < 1 << 20 || !half.is_multiple_of(BLOCK_U64) {
            break;
        }
        let geo = SegmentGeometry::for_version(half, cfg.format_version);
        let batch_fits = u64::from(geo.data_blocks) / 2 * BLOCK_U64 >= cfg.max_batch_bytes as u64;
        if !cfg.auto_max_batch && !batch_fits {
            break;
        }
        seg = half;
    }
    seg
}

/// `cfg` with `max_batch_bytes` lowered to what `layout` allows, when `auto_max_batch`.
fn fitted_batch(cfg: &EngineConfig, layout: &Layout) -> EngineConfig {
    let mut cfg = cfg.clone();
    if cfg.auto_max_batch {
        let limits = BatchLimits::of(&layout.geo, layout.log_blocks);
        let most = limits.segment_bytes.min(limits.log_bytes) as usize;
        cfg.max_batch_bytes = cfg.max_batch_bytes.min(most).max(64 * 1024);
    }
    cfg
}

fn batch_fits(cfg: &EngineConfig, layout: &Layout) -> Result<(), EngineError> {
    let limits = BatchLimits::of(&layout.geo, layout.log_blocks);
    let batch = cfg.max_batch_bytes as u64;
    if batch > limits.segment_bytes || batch > limits.log_bytes {
        return Err(EngineError::InvalidArgument(format!(
            "max batch size ({batch} bytes) must be at most half a segment's data area ({} bytes \
             with segments of {} bytes) and a quarter of the log ({} bytes)",
            limits.segment_bytes, layout.segment_size_bytes, limits.log_bytes
        )));
    }
    Ok(())
}

pub(crate) fn validate_config(cfg: &EngineConfig) -> Result<(), EngineError> {
    let ok_marks = 0.0 <= cfg.fill_ratio_low
        && cfg.fill_ratio_low < cfg.fill_ratio_high
        && cfg.fill_ratio_high <= 1.0;
    if !ok_marks {
        return Err(EngineError::InvalidArgument(format!(
            "destage marks must satisfy 0 <= low < high <= 1 (got low {} high {})",
            cfg.fill_ratio_low, cfg.fill_ratio_high
        )));
    }
    let seg = cfg.segment_size_bytes;
    if !(1 << 20..=1 << 30).contains(&seg) || !seg.is_multiple_of(BLOCK_U64) {
        return Err(EngineError::InvalidArgument(
            "segment size must be a multiple of 4 KiB between 1 MiB and 1 GiB".into(),
        ));
    }
    if !(GROUP_VERSION_MIN..=GROUP_VERSION).contains(&cfg.format_version) {
        return Err(EngineError::InvalidArgument(format!(
            "format version {} is not one this build writes ({GROUP_VERSION_MIN} or {GROUP_VERSION})",
            cfg.format_version
        )));
    }
    if !(0.0..=0.9).contains(&cfg.read_cache_ratio) {
        return Err(EngineError::InvalidArgument(format!(
            "the read cache's share of the fast tier must be between 0 and 0.9 (got {})",
            cfg.read_cache_ratio
        )));
    }
    if cfg.max_batch_bytes < 64 * 1024 || !cfg.max_batch_bytes.is_multiple_of(BLOCK) {
        return Err(EngineError::InvalidArgument(
            "max batch size must be a multiple of 4 KiB, at least 64 KiB".into(),
        ));
    }
    Ok(())
}

/// Checks that every capacity device belongs to this fast device's group, in this order.
/// Returns the layout and the superblocks, the fast device's first.
fn identify(
    fast_sb: &Superblock,
    fast: &dyn Device,
    caps: &[Arc<dyn Device>],
) -> Result<(Layout, Vec<Superblock>), EngineError> {
    if fast_sb.role != Role::Fast {
        return Err(EngineError::Format(format!(
            "device {} is a capacity device, not a fast device",
            fast.name()
        )));
    }
    if fast_sb.capacity_devices as usize != caps.len() {
        let (has, given) = (fast_sb.capacity_devices, caps.len());
        return Err(EngineError::Format(format!(
            "disk group {} has {has} capacity device{}, but {given} {} given",
            uuid_hex(&fast_sb.group),
            if has == 1 { "" } else { "s" },
            if given == 1 { "was" } else { "were" },
        )));
    }
    let mut sbs = vec![fast_sb.clone()];
    for (i, c) in caps.iter().enumerate() {
        let sb = read_superblock_of(c.as_ref(), "capacity")?.ok_or_else(|| {
            EngineError::Format(format!(
                "capacity device {} is blank, but disk group {} expects it formatted",
                c.name(),
                uuid_hex(&fast_sb.group)
            ))
        })?;
        if sb.group != fast_sb.group {
            return Err(EngineError::Format(format!(
                "device {} belongs to disk group {}, not {}",
                c.name(),
                uuid_hex(&sb.group),
                uuid_hex(&fast_sb.group)
            )));
        }
        if sb.role != Role::Capacity || sb.device_index as usize != i {
            return Err(EngineError::Format(format!(
                "device {} is capacity device #{} of its group, but was given as #{}",
                c.name(),
                sb.device_index,
                i
            )));
        }
        // The version says where each segment's data and summaries are (docs/FORMAT.md §3.7).
        if sb.version != fast_sb.version {
            return Err(EngineError::Format(format!(
                "device {} has format version {}, the fast device says {}",
                c.name(),
                sb.version,
                fast_sb.version
            )));
        }
        if sb.segment_size_bytes != fast_sb.segment_size_bytes {
            return Err(EngineError::Format(format!(
                "device {} has segments of {} bytes, the fast device says {}",
                c.name(),
                sb.segment_size_bytes,
                fast_sb.segment_size_bytes
            )));
        }
        if c.size_bytes() < sb.device_size_bytes {
            return Err(shrunk(c.as_ref(), &sb));
        }
        sbs.push(sb);
    }
    if fast.size_bytes() < fast_sb.device_size_bytes {
        return Err(shrunk(fast, fast_sb));
    }
    Ok((layout_from(&sbs)?, sbs))
}

/// A device smaller now than its superblock says it was formatted: the group's structures
/// past its end are gone (a LUN or file shrunk, or another device of the same name).
fn shrunk(dev: &dyn Device, sb: &Superblock) -> EngineError {
    EngineError::Format(format!(
        "device {} is smaller than when it was formatted: {} bytes, where its disk group \
         was formatted on {} bytes of it",
        dev.name(),
        dev.size_bytes(),
        sb.device_size_bytes
    ))
}

fn new_shared(
    fast: Arc<dyn Device>,
    caps: Vec<Arc<dyn Device>>,
    cfg: EngineConfig,
    layout: Layout,
    cp: &Checkpoint,
) -> Shared {
    let mut index = Index::default();
    index.next_id = cp.next_id;
    for l in &cp.layers {
        index.layers.insert(
            l.id,
            LayerState {
                rec: *l,
                fast: ExtentMap::default(),
            },
        );
    }
    index.volumes = cp.volumes.iter().map(|v| (v.id, v.clone())).collect();
    index.snapshots = cp.snapshots.iter().map(|s| (s.id, s.clone())).collect();
    index.refresh_lookups();
    let seg_blocks = (layout.segment_size_bytes / BLOCK_U64) as u32;
    let mut segs = SegTable::new(&layout.segments, caps.len(), seg_blocks);
    // Every segment this opening writes has a higher sequence number than any written before
    // (docs/FORMAT.md §3.5): the checkpoint's counter may lag behind segments written after
    // it, and a summary copy of such a segment, left where its next write was lost, must not
    // pass for a later use of the segment. Far fewer than 2^32 segments are written between
    // two checkpoints, so this opening starts 2^32 past the checkpoint's counter; and at its
    // epoch (the checkpoint's + 1) in the high half at least, which bounds from below the
    // numbers of the segments its checkpoints name as recent (`recent_seq_floor`).
    let floor = (u64::from(cp.epoch) + 1) << 32;
    segs.next_seq = cp.next_segment_seq.saturating_add(1 << 32).max(floor);
    // The segments the checkpoint names as recent were sealed by the opening that wrote it,
    // so numbered from its epoch · 2^32 on, if that opening numbered by this rule (then its
    // counter is that high; builds before it counted from 1).
    let recent_floor = u64::from(cp.epoch) << 32;
    if cp.next_segment_seq >= recent_floor {
        segs.recent_seq_floor = recent_floor;
    }
    let fast_crcs = (0..layout.log_blocks).map(|_| AtomicU32::new(0)).collect();
    let seg_gen = segs.gen.clone();
    let layout_log_blocks = layout.log_blocks;
    // A checkpoint with a device count that no longer matches starts the count afresh.
    let devices = 1 + caps.len();
    let wear_at_open = if cp.wear.len() == devices {
        cp.wear.clone()
    } else {
        vec![
            DeviceWear {
                bytes_written_total: 0,
                first_use_unix_s: unix_now_s()
            };
            devices
        ]
    };
    let write_counter_at_open = std::iter::once(&fast)
        .chain(caps.iter())
        .map(|d| d.stats().write_bytes)
        .collect();
    let (index_dirty_limit, meta_reserve) = crate::maint::index_limits(&cfg, &layout, caps.len());
    let caps_len = caps.len();
    let durable = Durable {
        generation: cp.generation,
        epoch: cp.epoch,
        clean_log_end_seq: 0,
        index_root: cp.index_root,
        index_generation: cp.index_generation,
        log_tail: (0, 0),
        first_copy: 0,
        device_stamps: cp.device_stamps.unwrap_or((0, 0)),
        tail_part: cp.tail_destaged.map(|part| (cp.log_tail_seq, part)),
    };
    Shared {
        cfg,
        fast,
        caps,
        log: Mutex::new(LogState::new(layout.log_blocks, 0, 1)),
        layout,
        durable: Mutex::new(durable),
        retired_seq: AtomicU64::new(1),
        reclaim: Arc::new(RwLock::new(())),
        log_freed: Condvar::new(),
        log_freed_signal: crossbeam_channel::bounded(1),
        index: RwLock::new(index),
        tree: RwLock::new(CTree::open(cp.index_root)),
        segs: Mutex::new(segs),
        summaries: Mutex::new(crate::shared::TwoGen::new(
            crate::capacity::SUMMARY_CACHE_MAX,
        )),
        crc_blocks: Mutex::new(crate::shared::TwoGen::new(crate::capacity::CRC_CACHE_MAX)),
        gc_passed_over: Mutex::new(Default::default()),
        fast_crcs,
        ranges: Default::default(),
        gates: Mutex::new(Default::default()),
        counters: Counters {
            checksum_errors_by_device: (0..1 + caps_len).map(|_| Default::default()).collect(),
            ..Default::default()
        },
        state: AtomicU8::new(STATE_RUNNING),
        failure: Mutex::new(None),
        abandon: AtomicBool::new(false),
        limits_lifted: AtomicBool::new(false),
        drain: AtomicBool::new(false),
        flush_asked: AtomicBool::new(false),
        destager_stop: AtomicBool::new(false),
        #[cfg(test)]
        destager_held: AtomicBool::new(false),
        #[cfg(test)]
        destager_parked: AtomicBool::new(false),
        #[cfg(test)]
        after_tail_checkpoint: Mutex::new(None),
        #[cfg(test)]
        after_turn_moved: Mutex::new(None),
        #[cfg(test)]
        before_apply: Mutex::new(None),
        #[cfg(test)]
        after_rotation_read: Mutex::new(None),
        #[cfg(test)]
        rotation_queue_pause: Mutex::new(None),
        #[cfg(test)]
        after_tail_freed: Mutex::new(None),
        #[cfg(test)]
        before_page_load: Mutex::new(None),
        heat: Mutex::new(crate::heat::Heat::new(layout_log_blocks)),
        cache: Mutex::new(crate::cache::ReadCache::new(seg_gen, layout_log_blocks)),
        fast_read: crate::cache::ReadMarks::new(layout_log_blocks),
        vols: RwLock::new(Default::default()),
        destage_wake: Condvar::new(),
        destage_wake_lock: Mutex::new(false),
        destager_rest_fill: AtomicU64::new(crate::shared::NOT_RESTING),
        wear_at_open,
        write_counter_at_open,
        meta_reserve,
        index_dirty_limit,
        flush_guard: Mutex::new(()),
        superblocks: Mutex::new(()),
        scrub: Default::default(),
    }
}

/// Reads the segment table pages the checkpoint names.
fn load_segment_table(sh: &Shared, cp: &Checkpoint, ctl: &OpenControl) -> Result<(), EngineError> {
    let mut segs = sh.segs.lock();
    if cp.segtab.len() > segs.page_count() {
        return Err(EngineError::Format(format!(
            "the checkpoint names {} segment table pages; the devices hold {}",
            cp.segtab.len(),
            segs.page_count()
        )));
    }
    for (page, ptr) in cp.segtab.iter().enumerate() {
        let Some(ptr) = ptr else { continue };
        ctl.check()?;
        match meta::read_page(sh, *ptr)? {
            PageBody::SegTable(records) => segs.load_page(page, &records),
            _ => {
                return Err(EngineError::Corrupt(format!(
                    "segment table page {page} holds something else"
                )))
            }
        }
        segs.page_ptrs[page] = Some(*ptr);
    }
    Ok(())
}

/// Index segments' live page counts are not stored: they are counted from the index (every
/// inner node is read, which also tells where every leaf lives) and the segment table.
fn recount_index_pages(sh: &Shared, cp: &Checkpoint, ctl: &OpenControl) -> Result<(), EngineError> {
    // Stoppable between the pages it reads (each miss is a page read, then a try again).
    meta::with_tree(sh, |t| match ctl.check() {
        Ok(()) => t.redirty(&|_| false).map(|_| Ok(())),
        Err(stop) => Ok(Err(stop)),
    })??;
    let mut pages = Vec::new();
    sh.tree.read().known_pages(&mut pages);
    pages.extend(cp.segtab.iter().flatten().copied());
    let mut segs = sh.segs.lock();
    for p in pages {
        segs.page_in_use(p.a);
        segs.page_in_use(p.b);
    }
    for s in cp.streams.iter().filter(|s| s.seg != u32::MAX) {
        segs.page_in_use_stream(s.seg, s.next_block);
    }
    segs.streams = cp.streams;
    segs.durable_streams = cp.streams;
    segs.free_unused_meta();
    Ok(())
}

/// Applies the summaries of segments sealed after the durable index, oldest record first
/// (by record sequence, then segment sequence, so a relocated copy wins over the copy it was
/// moved from). Returns how many segments were applied.
fn apply_recent(sh: &Shared, recent: &[u32], ctl: &OpenControl) -> Result<usize, EngineError> {
    let mut all = Vec::new();
    for &seg in recent {
        ctl.check()?;
        if seg >= sh.layout.segment_count() {
            return Err(EngineError::Format(format!(
                "the checkpoint names segment {seg}, which does not exist"
            )));
        }
        // Unreadable in every copy (both, in a group of format 3): what the segment holds
        // cannot be told, and the index would lose data written since its last flush.
        let refuse = |why: String| {
            EngineError::Corrupt(format!(
                "the summary of capacity segment {seg}, sealed after the last index write, {why}: data written since may be lost; refusing to open"
            ))
        };
        let s = match summary_or_missing(sh, seg) {
            Ok(Ok(s)) => s,
            Ok(Err(missing)) => {
                sh.checksum_error(sh.seg_device(seg), 1);
                return Err(refuse(why_no_summary(sh, &missing)));
            }
            Err(e) => return Err(refuse(format!("cannot be read ({e})"))),
        };
        sh.segs
            .lock()
            .mark_recovered(seg, s.data_blocks_used, s.segment_seq);
        for e in &s.entries {
            all.push((e.seq, s.segment_seq, seg, *e));
        }
    }
    all.sort_by_key(|&(seq, sseq, _, _)| (seq, sseq));
    for (_, _, seg, e) in all {
        ctl.check()?;
        let (live, parent) = {
            let idx = sh.index.read();
            (idx.layer_live(e.layer), idx.has_parent(e.layer))
        };
        if !live {
            continue;
        }
        let loc = match e.kind {
            RecordKind::Write => Some(Loc::Cap {
                seg,
                block: e.data_block,
            }),
            RecordKind::Zero if parent => Some(Loc::Zero(0)),
            RecordKind::Zero => None,
            // Summaries never hold cached copies or forget records (their decoder refuses
            // those kinds).
            RecordKind::Cache | RecordKind::Forget => continue,
        };
        apply_tree_sets(
            sh,
            &[TreeSet {
                layer: e.layer,
                lba: e.lba,
                len: u64::from(e.nblocks),
                loc,
            }],
            true,
        )?;
    }
    Ok(recent.len())
}

/// Why a recent segment's summary could not be had, as open's refusal says it.
fn why_no_summary(sh: &Shared, missing: &Missing) -> String {
    match missing {
        Missing::Damaged => format!("is damaged ({})", copies_word(sh)),
        Missing::EarlierUse { copies } => {
            let all = sh.layout.geo.summary_copies as usize;
            let name = |c: usize| format!("copy {}", copy_name(c as u32));
            let which = match copies.len() == all {
                true => copies_word(sh).to_string(),
                false => {
                    let damaged = (0..all).filter(|c| !copies.contains(c)).map(name);
                    let earlier = copies.iter().map(|&c| name(c));
                    format!(
                        "{}; {} damaged",
                        earlier.collect::<Vec<_>>().join(" and "),
                        damaged.collect::<Vec<_>>().join(" and ")
                    )
                }
            };
            format!(
                "holds an earlier use of the segment ({which}): the device lost the writes of \
                 its current use, which it had acknowledged"
            )
        }
        Missing::Undecided => format!(
            "cannot be told from an earlier use of the segment ({}: copies that check differ, \
             and nothing tells which holds its current use)",
            copies_word(sh)
        ),
    }
}

/// How many summary copies a segment has, as a refusal names them.
fn copies_word(sh: &Shared) -> &'static str {
    match sh.layout.geo.summary_copies {
        1 => "its only copy",
        _ => "both copies",
    }
}

/// The fast tier's live block count, from the fast maps.
fn count_fast_live(sh: &Shared) {
    let idx = sh.index.read();
    let fast: u64 = idx
        .layers
        .values()
        .flat_map(|l| l.fast.iter())
        .filter(|r| matches!(r.2, Loc::Fast(_)))
        .map(|r| r.1)
        .sum();
    sh.counters.fast_live_blocks.store(fast, Ordering::Relaxed);
}
