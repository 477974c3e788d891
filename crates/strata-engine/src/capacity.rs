//! The capacity store: log-structured segments, written whole (data, flush, summary, flush),
//! spread across the capacity devices, cleaned by cost-benefit garbage collection.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use strata_device::AlignedBuf;

use crate::error::EngineError;
use crate::format::*;
use crate::map::Loc;
use crate::shared::{bounded_insert, Shared};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegState {
    Free,
    /// Allocated to a writer, not yet sealed.
    Open,
    Sealed,
}

#[derive(Debug, Clone, Copy)]
pub struct SegInfo {
    pub state: SegState,
    pub live_blocks: u32,
    pub used_blocks: u32,
    pub has_tombstones: bool,
    pub sealed_at: Instant,
}

/// Segment bookkeeping. Protected by `Shared::segs`.
pub struct SegTable {
    pub segs: Vec<SegInfo>,
    free: Vec<BTreeSet<u32>>,
    next_dev: usize,
    pub next_seq: u64,
}

impl SegTable {
    pub fn new(layout_segments: &[(usize, u64)], devices: usize) -> SegTable {
        let now = Instant::now();
        let info = SegInfo { state: SegState::Free, live_blocks: 0, used_blocks: 0, has_tombstones: false, sealed_at: now };
        let mut free = vec![BTreeSet::new(); devices];
        for (i, &(dev, _)) in layout_segments.iter().enumerate() {
            free[dev].insert(i as u32);
        }
        SegTable { segs: vec![info; layout_segments.len()], free, next_dev: 0, next_seq: 1 }
    }

    pub fn free_count(&self) -> usize {
        self.free.iter().map(|f| f.len()).sum()
    }

    /// Takes a free segment, rotating across devices; `reserve` segments are kept back for GC.
    pub fn alloc(&mut self, reserve: usize) -> Option<u32> {
        if self.free_count() <= reserve {
            return None;
        }
        let n = self.free.len();
        for k in 0..n {
            let dev = (self.next_dev + k) % n;
            if let Some(&seg) = self.free[dev].iter().next() {
                self.free[dev].remove(&seg);
                self.next_dev = (dev + 1) % n;
                self.segs[seg as usize].state = SegState::Open;
                return Some(seg);
            }
        }
        None
    }

    pub fn seal(&mut self, seg: u32, used: u32, live: u32, tombstones: bool) {
        let s = &mut self.segs[seg as usize];
        *s = SegInfo { state: SegState::Sealed, live_blocks: live, used_blocks: used, has_tombstones: tombstones, sealed_at: Instant::now() };
    }

    pub fn mark_sealed_recovered(&mut self, seg: u32, dev: usize, used: u32, tombstones: bool, seq: u64) {
        self.free[dev].remove(&seg);
        self.seal(seg, used, 0, tombstones);
        self.next_seq = self.next_seq.max(seq + 1);
    }

    pub fn free_segment(&mut self, seg: u32, dev: usize) {
        let s = &mut self.segs[seg as usize];
        s.state = SegState::Free;
        s.live_blocks = 0;
        s.used_blocks = 0;
        s.has_tombstones = false;
        self.free[dev].insert(seg);
    }

    pub fn release(&mut self, seg: u32, blocks: u32) {
        let s = &mut self.segs[seg as usize];
        debug_assert!(s.live_blocks >= blocks, "segment {seg} live count underflow");
        s.live_blocks = s.live_blocks.saturating_sub(blocks);
    }

    pub fn live_blocks_total(&self) -> u64 {
        self.segs.iter().map(|s| u64::from(s.live_blocks)).sum()
    }
}

pub type SummaryCache = HashMap<u32, Arc<SegmentSummary>>;
const SUMMARY_CACHE_MAX: usize = 128;

/// The summary of a sealed segment, from the cache or the device.
pub fn load_summary(sh: &Shared, seg: u32) -> Result<Arc<SegmentSummary>, EngineError> {
    if let Some(s) = sh.summaries.lock().get(&seg) {
        return Ok(s.clone());
    }
    let s = Arc::new(read_summary(sh, seg)?.ok_or_else(|| {
        sh.counters.checksum_errors.fetch_add(1, Ordering::Relaxed);
        tracing::error!(segment = seg, "segment summary unreadable (checksum mismatch)");
        EngineError::Corrupt(format!("summary of capacity segment {seg} is damaged"))
    })?);
    bounded_insert(&mut sh.summaries.lock(), seg, s.clone(), SUMMARY_CACHE_MAX);
    Ok(s)
}

pub fn read_summary(sh: &Shared, seg: u32) -> Result<Option<SegmentSummary>, EngineError> {
    let geo = &sh.layout.geo;
    let (dev, off) = sh.layout.seg_summary_byte(seg);
    let mut b = AlignedBuf::new_zeroed(geo.summary_blocks as usize * BLOCK);
    sh.caps[dev].read_at(&mut b, off)?;
    Ok(SegmentSummary::decode(&b, &sh.layout.group, geo).filter(|s| s.segment_index == seg))
}

/// A block range moving into a segment being built, from wherever it is now.
#[derive(Debug, Clone, Copy)]
pub struct Move {
    pub volume: u32,
    pub lba: u64,
    pub nblocks: u64,
    pub from: Loc,
    pub to_block: u32,
}

/// Accumulates one segment's content in memory (bounded by the segment size).
pub struct Builder {
    pub data: AlignedBuf,
    pub used: u32,
    pub entries: Vec<SummaryEntry>,
    pub crcs: Vec<u32>,
    pub moves: Vec<Move>,
    geo: SegmentGeometry,
}

impl Builder {
    pub fn new(geo: SegmentGeometry) -> Builder {
        Builder {
            data: AlignedBuf::new_zeroed(geo.data_blocks as usize * BLOCK),
            used: 0,
            entries: Vec::new(),
            crcs: Vec::new(),
            moves: Vec::new(),
            geo,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Data blocks still free in the segment.
    pub fn room_blocks(&self) -> u64 {
        u64::from(self.geo.data_blocks - self.used)
    }

    pub fn fits(&self, blocks: u64, entries: usize) -> bool {
        u64::from(self.used) + blocks <= u64::from(self.geo.data_blocks)
            && self.entries.len() + entries <= self.geo.max_entries as usize
    }

    /// Adds `data` (whole blocks, with their crcs) as the newest copy of `lba..` at `seq`.
    pub fn add_data(&mut self, volume: u32, lba: u64, seq: u64, data: &[u8], crcs: &[u32], from: Loc) {
        let n = crcs.len() as u32;
        let at = self.used as usize * BLOCK;
        self.data[at..at + data.len()].copy_from_slice(data);
        self.crcs.extend_from_slice(crcs);
        let extend = matches!(self.entries.last(), Some(e) if e.kind == RecordKind::Write
            && e.volume == volume && e.seq == seq && e.lba + u64::from(e.nblocks) == lba
            && e.data_block + e.nblocks == self.used);
        if extend {
            if let Some(e) = self.entries.last_mut() {
                e.nblocks += n;
            }
        } else {
            self.entries.push(SummaryEntry { kind: RecordKind::Write, volume, lba, nblocks: n, seq, data_block: self.used });
        }
        self.moves.push(Move { volume, lba, nblocks: u64::from(n), from, to_block: self.used });
        self.used += n;
    }

    pub fn add_tombstone(&mut self, volume: u32, lba: u64, nblocks: u32, seq: u64) {
        self.entries.push(SummaryEntry { kind: RecordKind::Zero, volume, lba, nblocks, seq, data_block: 0 });
    }

    pub fn has_tombstones(&self) -> bool {
        self.entries.iter().any(|e| e.kind == RecordKind::Zero)
    }
}

/// Writes a built segment: data, flush, then the summary, flush. Only once the summary is
/// durable does the segment exist for recovery, so a torn data write is never trusted.
pub fn write_segment(sh: &Shared, seg: u32, b: &Builder, seq: u64) -> Result<(), EngineError> {
    let (dev, off) = sh.layout.seg_data_byte(seg, 0);
    let device = &sh.caps[dev];
    if b.used > 0 {
        device.write_at(&b.data[..b.used as usize * BLOCK], off)?;
        device.flush()?;
    }
    let summary = SegmentSummary {
        group: sh.layout.group,
        segment_seq: seq,
        segment_index: seg,
        data_blocks_used: b.used,
        entries: b.entries.clone(),
        block_crcs: b.crcs.clone(),
    };
    let bytes = summary.encode(&sh.layout.geo);
    let mut sb = AlignedBuf::new_zeroed(bytes.len());
    sb.copy_from_slice(&bytes);
    let (_, soff) = sh.layout.seg_summary_byte(seg);
    device.write_at(&sb, soff)?;
    device.flush()?;
    bounded_insert(&mut sh.summaries.lock(), seg, Arc::new(summary), SUMMARY_CACHE_MAX);
    Ok(())
}

/// Writes several segments at once, one thread per segment: segments of one stripe sit on
/// different devices, so the devices work in parallel.
pub fn write_stripe(sh: &Shared, stripe: &[(u32, Builder, u64)]) -> Result<(), EngineError> {
    if stripe.len() == 1 {
        let (seg, b, seq) = &stripe[0];
        return write_segment(sh, *seg, b, *seq);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = stripe.iter().map(|(seg, b, seq)| s.spawn(move || write_segment(sh, *seg, b, *seq))).collect();
        let mut result = Ok(());
        for h in handles {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => result = Err(e),
                Err(_) => result = Err(EngineError::Failed("segment writer panicked".into())),
            }
        }
        result
    })
}

/// Points the index at the segment's new copies (where they were not rewritten meanwhile) and
/// seals the segment with its live count.
pub fn commit_segment(sh: &Shared, seg: u32, b: &Builder) {
    let mut moved_from_fast = 0;
    let mut released = Vec::new();
    let mut live = 0u64;
    {
        let mut idx = sh.index.write();
        for m in &b.moves {
            let Some(v) = idx.vols.get_mut(&m.volume) else { continue };
            let n = v.map.relocate(m.lba, m.nblocks, m.from, Loc::Cap { seg, block: m.to_block });
            live += n;
            match m.from {
                Loc::Fast(_) => moved_from_fast += n,
                Loc::Cap { .. } => released.push((m.lba, n, m.from)),
            }
        }
        let mut segs = sh.segs.lock();
        segs.seal(seg, b.used, live as u32, b.has_tombstones());
        for &(_, n, from) in &released {
            if let Loc::Cap { seg: old, .. } = from {
                segs.release(old, n as u32);
            }
        }
    }
    sh.counters.fast_live_blocks.fetch_sub(moved_from_fast, Ordering::Relaxed);
}

/// Reads `n` blocks of segment data and checks them against the summary's crcs. A mismatch
/// is counted and logged; the caller decides what it means.
pub fn read_seg_blocks(sh: &Shared, seg: u32, block: u32, n: u32, out: &mut [u8], crcs: &[u32]) -> Result<Option<u32>, EngineError> {
    let (dev, off) = sh.layout.seg_data_byte(seg, block);
    sh.caps[dev].read_at(&mut out[..n as usize * BLOCK], off)?;
    for i in 0..n as usize {
        let expect = crcs.get(block as usize + i).copied();
        if expect != Some(crc32c::crc32c(&out[i * BLOCK..(i + 1) * BLOCK])) {
            return Ok(Some(block + i as u32));
        }
    }
    Ok(None)
}

/// Frees segments whose content is gone from the index, after readers are done with them.
pub fn free_segments(sh: &Shared, victims: &[u32]) {
    if victims.is_empty() {
        return;
    }
    {
        // Past this barrier no reader holds a location in the victims, and the index has none.
        let _excl = sh.reclaim.write();
        let mut segs = sh.segs.lock();
        let mut cache = sh.summaries.lock();
        for &v in victims {
            segs.segs[v as usize].state = SegState::Open;
            cache.remove(&v);
        }
    }
    for &v in victims {
        let (dev, off) = sh.layout.segments[v as usize];
        // Discard drops the old summary too; where unsupported the stale summary is harmless
        // (everything in it is older than what the index holds, see docs/FORMAT.md). It runs
        // before the segment is free again, so it can never hit a new segment's data.
        if let Err(e) = sh.caps[dev].discard(off, sh.layout.segment_size_bytes) {
            tracing::debug!("discard of segment {v} failed: {e}");
        }
    }
    let mut segs = sh.segs.lock();
    for &v in victims {
        segs.free_segment(v, sh.layout.segments[v as usize].0);
    }
    drop(segs);
    sh.counters.gc_segments_cleaned.fetch_add(victims.len() as u64, Ordering::Relaxed);
}
