//! Opening a disk group: identify the devices, format blank ones, and rebuild the index from
//! the capacity segments' summaries and the log.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};
use strata_device::Device;

use crate::capacity::{read_summary, SegTable};
use crate::error::EngineError;
use crate::format::*;
use crate::layout::*;
use crate::log::{replay, LogState};
use crate::map::{ExtentMap, Loc};
use crate::shared::*;
use crate::EngineConfig;

/// What `open` found, for the startup log line.
#[derive(Debug, Clone, Default)]
pub struct OpenReport {
    pub formatted: bool,
    pub replayed_batches: usize,
    pub replayed_records: usize,
    pub segments_in_use: usize,
}

pub fn open_shared(
    fast: Arc<dyn Device>,
    caps: Vec<Arc<dyn Device>>,
    cfg: EngineConfig,
    create_if_blank: bool,
) -> Result<(Arc<Shared>, OpenReport), EngineError> {
    if caps.is_empty() {
        return Err(EngineError::InvalidArgument("a disk group needs at least one capacity device".into()));
    }
    validate_config(&cfg)?;
    let mut report = OpenReport::default();
    let (layout, checkpoint) = match read_superblock(fast.as_ref())? {
        None => {
            if !create_if_blank {
                return Err(EngineError::Format(format!("fast device {} is not formatted", fast.name())));
            }
            for c in &caps {
                if read_superblock(c.as_ref())?.is_some() {
                    return Err(EngineError::Format(format!(
                        "capacity device {} already belongs to a disk group but the fast device {} is blank; refusing to format over it",
                        c.name(),
                        fast.name()
                    )));
                }
            }
            let (layout, cp) = format(fast.as_ref(), &caps, cfg.segment_size_bytes)?;
            report.formatted = true;
            (layout, cp)
        }
        Some(sb) => {
            let layout = identify(&sb, fast.as_ref(), &caps)?;
            let cp = read_checkpoint(fast.as_ref(), &layout)?;
            (layout, cp)
        }
    };
    if cfg.max_batch_bytes as u64 > u64::from(layout.geo.data_blocks) * BLOCK_U64 / 2
        || cfg.max_batch_bytes as u64 > layout.log_blocks * BLOCK_U64 / 4
    {
        return Err(EngineError::InvalidArgument(
            "max batch size must be at most half a segment and a quarter of the log".into(),
        ));
    }
    let sh = Arc::new(new_shared(fast, caps, cfg, layout, &checkpoint));
    *sh.meta.lock() = checkpoint.generation;
    report.segments_in_use = rebuild_capacity(&sh)?;
    let r = replay(&sh, checkpoint.log_tail_offset / BLOCK_U64, checkpoint.log_tail_seq)?;
    for &(b, c) in &r.crcs {
        sh.fast_crcs[b as usize].store(c, Ordering::Relaxed);
    }
    report.replayed_batches = r.batches;
    report.replayed_records = r.records;
    *sh.log.lock() = r.state;
    count_live(&sh);
    Ok((sh, report))
}

fn validate_config(cfg: &EngineConfig) -> Result<(), EngineError> {
    let ok_marks = 0.0 <= cfg.fill_ratio_low && cfg.fill_ratio_low < cfg.fill_ratio_high && cfg.fill_ratio_high <= 1.0;
    if !ok_marks {
        return Err(EngineError::InvalidArgument(format!(
            "destage marks must satisfy 0 <= low < high <= 1 (got low {} high {})",
            cfg.fill_ratio_low, cfg.fill_ratio_high
        )));
    }
    let seg = cfg.segment_size_bytes;
    if !(1 << 20..=1 << 30).contains(&seg) || !seg.is_multiple_of(BLOCK_U64) {
        return Err(EngineError::InvalidArgument("segment size must be a multiple of 4 KiB between 1 MiB and 1 GiB".into()));
    }
    if cfg.max_batch_bytes < 64 * 1024 || !cfg.max_batch_bytes.is_multiple_of(BLOCK) {
        return Err(EngineError::InvalidArgument("max batch size must be a multiple of 4 KiB, at least 64 KiB".into()));
    }
    Ok(())
}

/// Checks that every capacity device belongs to this fast device's group, in this order.
fn identify(fast_sb: &Superblock, fast: &dyn Device, caps: &[Arc<dyn Device>]) -> Result<Layout, EngineError> {
    if fast_sb.role != Role::Fast {
        return Err(EngineError::Format(format!("device {} is a capacity device, not a fast device", fast.name())));
    }
    if fast_sb.capacity_devices as usize != caps.len() {
        return Err(EngineError::Format(format!(
            "disk group {} has {} capacity devices; {} were given",
            uuid_hex(&fast_sb.group),
            fast_sb.capacity_devices,
            caps.len()
        )));
    }
    let mut sbs = vec![fast_sb.clone()];
    for (i, c) in caps.iter().enumerate() {
        let sb = read_superblock(c.as_ref())?
            .ok_or_else(|| EngineError::Format(format!("capacity device {} is blank, but disk group {} expects it formatted", c.name(), uuid_hex(&fast_sb.group))))?;
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
        if sb.segment_size_bytes != fast_sb.segment_size_bytes {
            return Err(EngineError::Format(format!("device {} has segments of {} bytes, the fast device says {}", c.name(), sb.segment_size_bytes, fast_sb.segment_size_bytes)));
        }
        if c.size_bytes() < sb.device_size_bytes {
            return Err(EngineError::Format(format!("device {} is smaller than when it was formatted", c.name())));
        }
        sbs.push(sb);
    }
    if fast.size_bytes() < fast_sb.device_size_bytes {
        return Err(EngineError::Format(format!("device {} is smaller than when it was formatted", fast.name())));
    }
    layout_from(&sbs)
}

fn new_shared(fast: Arc<dyn Device>, caps: Vec<Arc<dyn Device>>, cfg: EngineConfig, layout: Layout, cp: &Checkpoint) -> Shared {
    let mut index = Index { vols: BTreeMap::new(), next_volume_id: cp.next_volume_id };
    for v in &cp.volumes {
        index.vols.insert(v.id, VolState { rec: v.clone(), map: ExtentMap::default() });
    }
    let segs = SegTable::new(&layout.segments, caps.len());
    let fast_crcs = (0..layout.log_blocks).map(|_| AtomicU32::new(0)).collect();
    // A checkpoint from before wear accounting (or with a device count that no longer
    // matches) starts the count afresh from now.
    let devices = 1 + caps.len();
    let wear_at_open = if cp.wear.len() == devices {
        cp.wear.clone()
    } else {
        vec![DeviceWear { bytes_written_total: 0, first_use_unix_s: crate::format::unix_now_s() }; devices]
    };
    let write_counter_at_open = std::iter::once(&fast).chain(caps.iter()).map(|d| d.stats().write_bytes).collect();
    Shared {
        cfg,
        fast,
        caps,
        log: Mutex::new(LogState::new(layout.log_blocks, 0, 1)),
        layout,
        meta: Mutex::new(0),
        reclaim: RwLock::new(()),
        log_freed: Condvar::new(),
        index: RwLock::new(index),
        segs: Mutex::new(segs),
        summaries: Mutex::new(Default::default()),
        fast_crcs,
        ranges: Default::default(),
        counters: Default::default(),
        state: AtomicU8::new(STATE_RUNNING),
        failure: Mutex::new(None),
        abandon: AtomicBool::new(false),
        drain: AtomicBool::new(false),
        destager_stop: AtomicBool::new(false),
        heat: Mutex::new(Default::default()),
        destage_wake: Condvar::new(),
        destage_wake_lock: Mutex::new(false),
        wear_at_open,
        write_counter_at_open,
    }
}

/// Reads every segment summary and applies their entries oldest first (by record sequence,
/// then segment sequence, so a relocated copy wins over the copy it was moved from).
fn rebuild_capacity(sh: &Shared) -> Result<usize, EngineError> {
    let mut all = Vec::new();
    let mut in_use = 0;
    for seg in 0..sh.layout.segment_count() {
        let Some(s) = read_summary(sh, seg)? else { continue };
        in_use += 1;
        let tombstones = s.entries.iter().any(|e| e.kind == RecordKind::Zero);
        let dev = sh.layout.segments[seg as usize].0;
        sh.segs.lock().mark_sealed_recovered(seg, dev, s.data_blocks_used, tombstones, s.segment_seq);
        for e in &s.entries {
            all.push((e.seq, s.segment_seq, seg, *e));
        }
    }
    all.sort_by_key(|&(seq, sseq, _, _)| (seq, sseq));
    let mut idx = sh.index.write();
    for (_, _, seg, e) in all {
        let Some(v) = idx.vols.get_mut(&e.volume) else { continue };
        let loc = match e.kind {
            RecordKind::Write => Some(Loc::Cap { seg, block: e.data_block }),
            RecordKind::Zero => None,
        };
        v.map.set(e.lba, u64::from(e.nblocks), loc);
    }
    Ok(in_use)
}

/// Recomputes live counts from the index; sealed segments nothing points at are freed.
fn count_live(sh: &Shared) {
    let idx = sh.index.read();
    let mut segs = sh.segs.lock();
    let mut fast = 0u64;
    let mut live = vec![0u32; segs.segs.len()];
    for v in idx.vols.values() {
        for (_, len, loc) in v.map.iter() {
            match loc {
                Loc::Fast(_) => fast += len,
                Loc::Cap { seg, .. } => live[seg as usize] += len as u32,
            }
        }
    }
    for (i, n) in live.into_iter().enumerate() {
        let s = &mut segs.segs[i];
        s.live_blocks = n;
        if s.state == crate::capacity::SegState::Sealed && n == 0 && !s.has_tombstones {
            let dev = sh.layout.segments[i].0;
            segs.free_segment(i as u32, dev);
        }
    }
    sh.counters.fast_live_blocks.store(fast, Ordering::Relaxed);
}
