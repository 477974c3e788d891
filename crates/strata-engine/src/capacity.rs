//! The capacity store: log-structured segments, written whole (data, flush, summary, flush),
//! spread across the capacity devices, cleaned by cost-benefit garbage collection; and the
//! segment table that says what each segment holds.
//!
//! A segment that stops being referenced is not reusable at once: the durable index (the last
//! flushed tree) may still point into it, and recovery applies the summaries of recently
//! sealed segments over that index. So it waits as `PendingFree` until the next index flush
//! makes a tree without references to it durable.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use strata_device::AlignedBuf;

use crate::ctree::page::{SegRecord, SEGTAB_PER_PAGE};
use crate::ctree::PagePtr;
use crate::error::EngineError;
use crate::format::*;
use crate::map::Loc;
use crate::shared::{Shared, TwoGen};

mod summary;
pub use summary::{assess, read_summary, summary_or_missing, Holds, Missing, Part};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegState {
    Free,
    /// Being written (data), or set aside after a failed write until the next open.
    Open,
    /// Holds data blocks the index may reference.
    Sealed,
    /// Holds index pages (a page stream writes into it, or did).
    Meta,
    /// Unreferenced; reusable once the next index flush is durable.
    PendingFree,
}

#[derive(Debug, Clone, Copy)]
pub struct SegInfo {
    pub state: SegState,
    /// Data: blocks the index references. Meta: pages the index references.
    pub live_blocks: u32,
    /// Data: blocks written. Meta: blocks handed out to pages.
    pub used_blocks: u32,
    pub sealed_unix_s: u32,
    /// Data: the segment sequence number of its current use (what its summary says), when
    /// this opening knows it (it wrote the segment, or read the summary and could tell);
    /// 0: not known. Not stored in the segment table.
    pub segment_seq: u64,
}

const FREE_INFO: SegInfo = SegInfo {
    state: SegState::Free,
    live_blocks: 0,
    used_blocks: 0,
    sealed_unix_s: 0,
    segment_seq: 0,
};

/// Segment bookkeeping. Protected by `Shared::segs`.
pub struct SegTable {
    pub segs: Vec<SegInfo>,
    dev_of: Vec<usize>,
    free: Vec<BTreeSet<u32>>,
    next_dev: usize,
    pub next_seq: u64,
    /// Set at open: the lowest segment sequence number a segment the checkpoint names as
    /// recent can carry (0: not known), a summary header below it there being an earlier
    /// use's (`summary::assess`). Those segments are the only free ones whose summaries are
    /// ever read.
    pub recent_seq_floor: u64,
    /// Data segments sealed since the last index flush (their summaries are replayed over
    /// the durable index at recovery).
    pub recent: Vec<u32>,
    /// Segment-table pages whose content changed since the last index flush.
    pub dirty_pages: BTreeSet<usize>,
    /// Where each segment-table page lives as of the last index flush.
    pub page_ptrs: Vec<Option<PagePtr>>,
    /// Index page streams A and B as they are now (a flush in progress advances them) ...
    pub streams: [StreamPos; 2],
    /// ... and as of the last completed index flush (what checkpoints record).
    pub durable_streams: [StreamPos; 2],
    segment_blocks: u32,
    /// Bumped each time a segment is allocated: cached copies of its old content are stale.
    pub gen: Arc<Vec<AtomicU32>>,
}

impl SegTable {
    pub fn new(layout_segments: &[(usize, u64)], devices: usize, segment_blocks: u32) -> SegTable {
        let mut free = vec![BTreeSet::new(); devices];
        for (i, &(dev, _)) in layout_segments.iter().enumerate() {
            free[dev].insert(i as u32);
        }
        SegTable {
            segs: vec![FREE_INFO; layout_segments.len()],
            dev_of: layout_segments.iter().map(|s| s.0).collect(),
            free,
            next_dev: 0,
            next_seq: 1,
            recent_seq_floor: 0,
            recent: Vec::new(),
            dirty_pages: BTreeSet::new(),
            page_ptrs: vec![None; layout_segments.len().div_ceil(SEGTAB_PER_PAGE)],
            streams: [StreamPos::NONE; 2],
            durable_streams: [StreamPos::NONE; 2],
            segment_blocks,
            gen: Arc::new(
                (0..layout_segments.len())
                    .map(|_| AtomicU32::new(0))
                    .collect(),
            ),
        }
    }

    pub fn page_count(&self) -> usize {
        self.page_ptrs.len()
    }

    fn touch(&mut self, seg: u32) {
        self.dirty_pages.insert(seg as usize / SEGTAB_PER_PAGE);
    }

    pub fn free_count(&self) -> usize {
        self.free.iter().map(|f| f.len()).sum()
    }

    pub fn pending_count(&self) -> usize {
        self.segs
            .iter()
            .filter(|s| s.state == SegState::PendingFree)
            .count()
    }

    /// Takes a free data segment, rotating across devices; `reserve` segments are kept back
    /// (for GC and index pages).
    pub fn alloc(&mut self, reserve: usize) -> Option<u32> {
        if self.free_count() <= reserve {
            return None;
        }
        let n = self.free.len();
        for k in 0..n {
            let dev = (self.next_dev + k) % n;
            if let Some(seg) = self.take_free(dev) {
                self.next_dev = (dev + 1) % n;
                self.segs[seg as usize].state = SegState::Open;
                return Some(seg);
            }
        }
        None
    }

    /// Takes a free segment of device `dev`, keeping `reserve` free segments in all.
    pub fn alloc_on(&mut self, dev: usize, reserve: usize) -> Option<u32> {
        if self.free_count() <= reserve {
            return None;
        }
        let seg = self.take_free(dev)?;
        self.segs[seg as usize].state = SegState::Open;
        Some(seg)
    }

    fn take_free(&mut self, dev: usize) -> Option<u32> {
        let seg = *self.free[dev].iter().next()?;
        self.free[dev].remove(&seg);
        self.gen[seg as usize].fetch_add(1, Ordering::AcqRel);
        Some(seg)
    }

    /// Takes a free segment for index pages, on another device than `avoid` when possible.
    fn alloc_meta(&mut self, avoid: Option<usize>) -> Option<u32> {
        let n = self.free.len();
        let order = (0..n).map(|k| (self.next_dev + k) % n);
        let dev = order
            .clone()
            .find(|&d| Some(d) != avoid && !self.free[d].is_empty())
            .or_else(|| order.clone().find(|&d| !self.free[d].is_empty()))?;
        let seg = self.take_free(dev)?;
        self.segs[seg as usize] = SegInfo {
            state: SegState::Meta,
            live_blocks: 0,
            used_blocks: 0,
            sealed_unix_s: unix_now_s() as u32,
            segment_seq: 0,
        };
        self.touch(seg);
        Some(seg)
    }

    /// Hands out the next page address of stream `s` (0 = A, 1 = B), opening a new segment
    /// when the current one is full.
    pub fn alloc_page(&mut self, s: usize) -> Result<u64, EngineError> {
        let pos = self.streams[s];
        if pos.seg == u32::MAX || pos.next_block >= self.segment_blocks {
            let other = self.streams[1 - s].seg;
            let avoid = (other != u32::MAX).then(|| self.dev_of[other as usize]);
            let seg = self.alloc_meta(avoid).ok_or(EngineError::NoSpace)?;
            self.streams[s] = StreamPos { seg, next_block: 0 };
        }
        let pos = &mut self.streams[s];
        let addr = (u64::from(pos.seg) << 32) | u64::from(pos.next_block);
        pos.next_block += 1;
        let seg = pos.seg;
        let info = &mut self.segs[seg as usize];
        info.live_blocks += 1;
        info.used_blocks = info.used_blocks.max((addr as u32) + 1);
        Ok(addr)
    }

    /// A page copy stopped being referenced.
    pub fn page_freed(&mut self, addr: u64) {
        let seg = (addr >> 32) as u32;
        let Some(info) = self.segs.get_mut(seg as usize) else {
            return;
        };
        debug_assert!(
            info.state == SegState::Meta && info.live_blocks > 0,
            "page {addr:#x} freed twice"
        );
        info.live_blocks = info.live_blocks.saturating_sub(1);
        let streaming = self.streams.iter().any(|s| s.seg == seg);
        if info.live_blocks == 0 && info.state == SegState::Meta && !streaming {
            info.state = SegState::PendingFree;
            self.touch(seg);
        }
    }

    /// Counts a live page copy found at open (meta live counts are recomputed, not stored).
    pub fn page_in_use(&mut self, addr: u64) {
        let seg = (addr >> 32) as u32;
        if let Some(&dev) = self.dev_of.get(seg as usize) {
            self.free[dev].remove(&seg);
        }
        if let Some(info) = self.segs.get_mut(seg as usize) {
            info.state = SegState::Meta;
            info.live_blocks += 1;
            info.used_blocks = info.used_blocks.max((addr as u32) + 1);
        }
    }

    /// The segment a page stream writes into, as a checkpoint names it.
    pub fn page_in_use_stream(&mut self, seg: u32, next_block: u32) {
        if let Some(&dev) = self.dev_of.get(seg as usize) {
            self.free[dev].remove(&seg);
        }
        if let Some(info) = self.segs.get_mut(seg as usize) {
            info.state = SegState::Meta;
            info.used_blocks = info.used_blocks.max(next_block);
        }
        self.touch(seg);
    }

    /// Seals a data segment just written with `live` blocks the index now references.
    pub fn seal(&mut self, seg: u32, used: u32, live: u32) {
        let state = if live == 0 {
            SegState::PendingFree
        } else {
            SegState::Sealed
        };
        self.segs[seg as usize] = SegInfo {
            state,
            live_blocks: live,
            used_blocks: used,
            sealed_unix_s: unix_now_s() as u32,
            // Noted by `write_segment`.
            segment_seq: self.segs[seg as usize].segment_seq,
        };
        self.recent.push(seg);
        self.touch(seg);
    }

    /// A segment whose write failed: never reused before the next open.
    pub fn set_aside(&mut self, seg: u32) {
        self.segs[seg as usize].state = SegState::Open;
    }

    /// Gives back an allocated segment that was never written.
    pub fn unallocate(&mut self, seg: u32) {
        self.segs[seg as usize] = FREE_INFO;
        self.free[self.dev_of[seg as usize]].insert(seg);
    }

    /// `blocks` of the segment stopped being referenced.
    pub fn release(&mut self, seg: u32, blocks: u32) {
        let s = &mut self.segs[seg as usize];
        debug_assert!(
            s.live_blocks >= blocks,
            "segment {seg} live count underflow"
        );
        s.live_blocks = s.live_blocks.saturating_sub(blocks);
        if s.live_blocks == 0 && s.state == SegState::Sealed {
            s.state = SegState::PendingFree;
        }
        self.touch(seg);
    }

    /// `blocks` of the segment became referenced (recovery applying summaries).
    pub fn add_live(&mut self, seg: u32, blocks: u32) {
        let s = &mut self.segs[seg as usize];
        s.live_blocks += blocks;
        if s.state == SegState::PendingFree {
            s.state = SegState::Sealed;
        }
        self.touch(seg);
    }

    /// After an index flush is durable: pending segments become free. Returns them (to discard).
    pub fn release_pending(&mut self) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, s) in self.segs.iter_mut().enumerate() {
            if s.state == SegState::PendingFree {
                *s = FREE_INFO;
                out.push(i as u32);
            }
        }
        for &seg in &out {
            self.free[self.dev_of[seg as usize]].insert(seg);
        }
        out
    }

    /// What the segment-table page `page` stores now (pending and open segments as free).
    pub fn page_records(&self, page: usize) -> Vec<SegRecord> {
        let from = page * SEGTAB_PER_PAGE;
        let to = (from + SEGTAB_PER_PAGE).min(self.segs.len());
        self.segs[from..to]
            .iter()
            .map(|s| match s.state {
                SegState::Sealed => SegRecord {
                    state: 1,
                    live: s.live_blocks,
                    used: s.used_blocks,
                    sealed_unix_s: s.sealed_unix_s,
                },
                // Meta live counts are recounted from the index at open.
                SegState::Meta => SegRecord {
                    state: 2,
                    live: 0,
                    used: s.used_blocks,
                    sealed_unix_s: s.sealed_unix_s,
                },
                _ => SegRecord::default(),
            })
            .collect()
    }

    /// Loads one page of records read at open.
    pub fn load_page(&mut self, page: usize, records: &[SegRecord]) {
        for (i, r) in records.iter().enumerate() {
            let seg = page * SEGTAB_PER_PAGE + i;
            if seg >= self.segs.len() {
                break;
            }
            let state = match r.state {
                1 => SegState::Sealed,
                2 => SegState::Meta,
                _ => continue,
            };
            self.free[self.dev_of[seg]].remove(&(seg as u32));
            let live = if state == SegState::Meta { 0 } else { r.live };
            self.segs[seg] = SegInfo {
                state,
                live_blocks: live,
                used_blocks: r.used,
                sealed_unix_s: r.sealed_unix_s,
                segment_seq: 0,
            };
        }
    }

    /// Index segments nothing references any more (after the open-time recount) become free.
    pub fn free_unused_meta(&mut self) {
        for i in 0..self.segs.len() {
            let s = self.segs[i];
            let streaming = self.streams.iter().any(|p| p.seg == i as u32);
            if s.state == SegState::Meta && s.live_blocks == 0 && !streaming {
                self.segs[i] = FREE_INFO;
                self.free[self.dev_of[i]].insert(i as u32);
                self.touch(i as u32);
            }
        }
    }

    /// Marks a segment sealed for recovery (a recent segment whose summary is being applied).
    pub fn mark_recovered(&mut self, seg: u32, used: u32, seq: u64) {
        self.free[self.dev_of[seg as usize]].remove(&seg);
        self.segs[seg as usize] = SegInfo {
            state: SegState::PendingFree,
            live_blocks: 0,
            used_blocks: used,
            sealed_unix_s: unix_now_s() as u32,
            segment_seq: seq,
        };
        self.next_seq = self.next_seq.max(seq + 1);
        self.touch(seg);
    }

    pub fn live_blocks_total(&self) -> u64 {
        self.segs
            .iter()
            .filter(|s| s.state == SegState::Sealed)
            .map(|s| u64::from(s.live_blocks))
            .sum()
    }

    pub fn count(&self, state: SegState) -> usize {
        self.segs.iter().filter(|s| s.state == state).count()
    }

    /// Index pages referenced, and blocks handed out in index segments.
    pub fn meta_pages(&self) -> (u64, u64) {
        self.segs
            .iter()
            .filter(|s| s.state == SegState::Meta)
            .fold((0, 0), |(l, u), s| {
                (l + u64::from(s.live_blocks), u + u64::from(s.used_blocks))
            })
    }
}

pub type SummaryCache = TwoGen<u32, Arc<SegmentSummary>>;
/// Whole summaries cached (GC and scrub read them; host reads only need crc blocks).
pub const SUMMARY_CACHE_MAX: usize = 64;
pub type CrcCache = TwoGen<(u32, u32), Arc<Vec<u32>>>;
/// Crc blocks cached per generation: 4096 blocks of 4 KiB, for 16 GiB of data each.
pub const CRC_CACHE_MAX: usize = 4096;

/// The summary of a sealed segment, from the cache or the device.
pub fn load_summary(sh: &Shared, seg: u32) -> Result<Arc<SegmentSummary>, EngineError> {
    if let Some(s) = sh.summaries.lock().get(&seg) {
        return Ok(s);
    }
    let s = Arc::new(read_summary(sh, seg)?.ok_or_else(|| {
        sh.checksum_error(sh.seg_device(seg), 1);
        tracing::error!(
            segment = seg,
            "segment summary unreadable (checksum mismatch)"
        );
        EngineError::Corrupt(format!("summary of capacity segment {seg} is damaged"))
    })?);
    sh.summaries.lock().insert(seg, s.clone());
    Ok(s)
}

/// The crcs of data blocks `[block, block+n)` of a sealed segment: the few crc blocks that
/// hold them, from the cache or the device (one 4 KiB read each), each checked on its own.
pub fn block_crcs(sh: &Shared, seg: u32, block: u32, n: u32) -> Result<Vec<u32>, EngineError> {
    gather_crcs(block, n, |idx| crc_block(sh, seg, idx))
}

/// Like [`block_crcs`] from the cache only: None when a crc block it needs is not in memory.
pub fn cached_block_crcs(sh: &Shared, seg: u32, block: u32, n: u32) -> Option<Vec<u32>> {
    let mut cache = sh.crc_blocks.lock();
    gather_crcs(block, n, |idx| cache.get(&(seg, idx)).ok_or(())).ok()
}

/// The crcs of blocks `[block, block+n)` from the crc blocks that hold them.
fn gather_crcs<E>(
    block: u32,
    n: u32,
    mut crc_block: impl FnMut(u32) -> Result<Arc<Vec<u32>>, E>,
) -> Result<Vec<u32>, E> {
    let mut out = Vec::with_capacity(n as usize);
    let (first, last) = (
        block as usize / CRCS_PER_BLOCK,
        (block + n - 1) as usize / CRCS_PER_BLOCK,
    );
    for idx in first..=last {
        let crcs = crc_block(idx as u32)?;
        let lo = (block as usize).max(idx * CRCS_PER_BLOCK) - idx * CRCS_PER_BLOCK;
        let hi = ((block + n) as usize).min((idx + 1) * CRCS_PER_BLOCK) - idx * CRCS_PER_BLOCK;
        out.extend_from_slice(&crcs[lo..hi]);
    }
    Ok(out)
}

/// The name of summary copy `copy`, as messages give it.
pub fn copy_name(copy: u32) -> &'static str {
    if copy == 0 {
        "A"
    } else {
        "B"
    }
}

/// A read that the other summary copy served (a copy was damaged, or held an earlier use's
/// part): counted and logged (a scrub mends the copy).
fn other_copy_served(sh: &Shared, seg: u32, why: &[String]) {
    sh.counters
        .summary_copy_repairs_needed
        .fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        segment = seg,
        "segment summary copy damaged or stale ({}); read the other copy",
        why.join("; ")
    );
}

/// Crc block `idx` of segment `seg`: copy A, or copy B when A is unreadable or damaged.
fn crc_block(sh: &Shared, seg: u32, idx: u32) -> Result<Arc<Vec<u32>>, EngineError> {
    if let Some(c) = sh.crc_blocks.lock().get(&(seg, idx)) {
        return Ok(c);
    }
    let mut why = Vec::new();
    let mut io_error = None;
    let mut damaged = false;
    let mut b = AlignedBuf::new_zeroed(BLOCK);
    for copy in 0..sh.layout.geo.summary_copies {
        let (dev, off) = sh.layout.seg_summary_byte(seg, copy);
        if let Err(e) = sh.caps[dev].read_at(&mut b, off + u64::from(idx) * BLOCK_U64) {
            why.push(format!("copy {}: {e}", copy_name(copy)));
            io_error.get_or_insert(e);
            continue;
        }
        let Some(crcs) = decode_crc_block(&b, seg, idx) else {
            why.push(format!("copy {} fails its checks", copy_name(copy)));
            damaged = true;
            continue;
        };
        if !why.is_empty() {
            other_copy_served(sh, seg, &why);
        }
        let crcs = Arc::new(crcs);
        sh.crc_blocks.lock().insert((seg, idx), crcs.clone());
        return Ok(crcs);
    }
    match io_error {
        Some(e) if !damaged => Err(e.into()),
        _ => {
            sh.checksum_error(sh.seg_device(seg), 1);
            tracing::error!(
                segment = seg,
                crc_block = idx,
                "segment summary crc block unreadable: {}",
                why.join("; ")
            );
            Err(EngineError::Corrupt(format!(
                "summary of capacity segment {seg} is damaged (crc block {idx}{})",
                if why.len() > 1 { ", both copies" } else { "" }
            )))
        }
    }
}

/// One copy of a segment's summary area as the device gave it: blocks it could not read are
/// zeros in `bytes`, and listed.
pub struct SummaryCopy {
    pub bytes: AlignedBuf,
    pub unreadable: Vec<u32>,
    /// The first read error (None: every block was read).
    pub error: Option<strata_device::DeviceError>,
}

/// Reads summary copy `copy` of segment `seg`: in one read, or, when that fails, block by
/// block, so one bad sector costs only its own block.
pub fn read_summary_copy(sh: &Shared, seg: u32, copy: u32) -> SummaryCopy {
    let blocks = sh.layout.geo.summary_blocks;
    let (dev, off) = sh.layout.seg_summary_byte(seg, copy);
    let mut bytes = AlignedBuf::new_zeroed(blocks as usize * BLOCK);
    let Err(first) = sh.caps[dev].read_at(&mut bytes, off) else {
        return SummaryCopy {
            bytes,
            unreadable: Vec::new(),
            error: None,
        };
    };
    let mut unreadable = Vec::new();
    for k in 0..blocks {
        let b = &mut bytes[k as usize * BLOCK..(k as usize + 1) * BLOCK];
        if sh.caps[dev]
            .read_at(b, off + u64::from(k) * BLOCK_U64)
            .is_err()
        {
            b.fill(0);
            unreadable.push(k);
        }
    }
    SummaryCopy {
        bytes,
        unreadable,
        error: Some(first),
    }
}

/// A block range moving into a segment being built, from wherever it is now.
#[derive(Debug, Clone, Copy)]
pub struct Move {
    pub layer: u32,
    pub lba: u64,
    pub nblocks: u64,
    pub from: Loc,
    pub to_block: u32,
}

/// A zero record moving into a segment: the blocks of its range that still read as zeros
/// because of it.
#[derive(Debug, Clone, Copy)]
pub struct ZeroMove {
    pub layer: u32,
    pub lba: u64,
    pub nblocks: u64,
    pub seq: u64,
}

/// Accumulates one segment's content in memory (bounded by the segment size).
pub struct Builder {
    pub data: AlignedBuf,
    pub used: u32,
    pub entries: Vec<SummaryEntry>,
    pub crcs: Vec<u32>,
    pub moves: Vec<Move>,
    pub zeros: Vec<ZeroMove>,
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
            zeros: Vec::new(),
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
    pub fn add_data(
        &mut self,
        layer: u32,
        lba: u64,
        seq: u64,
        data: &[u8],
        crcs: &[u32],
        from: Loc,
    ) {
        let n = crcs.len() as u32;
        let at = self.used as usize * BLOCK;
        self.data[at..at + data.len()].copy_from_slice(data);
        self.crcs.extend_from_slice(crcs);
        let extend = matches!(self.entries.last(), Some(e) if e.kind == RecordKind::Write
            && e.layer == layer && e.seq == seq && e.lba + u64::from(e.nblocks) == lba
            && e.data_block + e.nblocks == self.used);
        if extend {
            if let Some(e) = self.entries.last_mut() {
                e.nblocks += n;
            }
        } else {
            self.entries.push(SummaryEntry {
                kind: RecordKind::Write,
                layer,
                lba,
                nblocks: n,
                seq,
                data_block: self.used,
            });
        }
        self.moves.push(Move {
            layer,
            lba,
            nblocks: u64::from(n),
            from,
            to_block: self.used,
        });
        self.used += n;
    }

    pub fn add_tombstone(&mut self, layer: u32, lba: u64, nblocks: u32, seq: u64) {
        self.entries.push(SummaryEntry {
            kind: RecordKind::Zero,
            layer,
            lba,
            nblocks,
            seq,
            data_block: 0,
        });
        self.zeros.push(ZeroMove {
            layer,
            lba,
            nblocks: u64::from(nblocks),
            seq,
        });
    }
}

/// Writes a built segment: data, flush, then the summary, flush. Only once the summary is
/// durable does the segment exist for recovery, so a torn data write is never trusted. With
/// two summary copies, copy B (at the segment's head) goes with the data, in the same flush,
/// and copy A (at its tail) after it: both are durable before this returns, and so before
/// any checkpoint can name the segment.
pub fn write_segment(sh: &Shared, seg: u32, b: &Builder, seq: u64) -> Result<(), EngineError> {
    let dev = sh.layout.seg_data_byte(seg, 0).0;
    let written = write_segment_on(sh, seg, b, seq);
    match &written {
        Ok(()) => crate::room::note_success(sh, crate::room::Write::Segment, Some(dev)),
        // Noted here, where the device is known; the caller gives the segments back.
        Err(e) => {
            let _ = crate::room::note_failure(sh, e, crate::room::Write::Segment, Some(dev));
        }
    }
    written
}

/// `write_segment`'s writes.
fn write_segment_on(sh: &Shared, seg: u32, b: &Builder, seq: u64) -> Result<(), EngineError> {
    let (dev, off) = sh.layout.seg_data_byte(seg, 0);
    let device = &sh.caps[dev];
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
    let data = &b.data[..b.used as usize * BLOCK];
    if sh.layout.geo.summary_copies == 2 {
        // Copy B ends where the data starts: on a disk, one sequential run.
        let at_b = sh.layout.seg_summary_byte(seg, 1).1;
        match b.used {
            0 => device.write_all_durable(&[(&sb, at_b)])?,
            _ => device.write_all_durable(&[(data, off), (&sb, at_b)])?,
        }
    } else if b.used > 0 {
        device.write_at(data, off)?;
        device.flush()?;
    }
    device.write_at(&sb, sh.layout.seg_summary_byte(seg, 0).1)?;
    device.flush()?;
    // What the segment's current use is: a summary copy of an earlier one is told apart by it.
    sh.segs.lock().segs[seg as usize].segment_seq = seq;
    let mut crcs = sh.crc_blocks.lock();
    for (idx, chunk) in summary.block_crcs.chunks(CRCS_PER_BLOCK).enumerate() {
        crcs.insert((seg, idx as u32), Arc::new(chunk.to_vec()));
    }
    drop(crcs);
    sh.summaries.lock().insert(seg, Arc::new(summary));
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
        let handles: Vec<_> = stripe
            .iter()
            .map(|(seg, b, seq)| s.spawn(move || write_segment(sh, *seg, b, *seq)))
            .collect();
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

/// Reads `n` blocks of segment data and checks them against their crcs (`crcs[i]` is block
/// `block + i`'s). Returns the first block that does not match; the caller decides what it
/// means. A mismatch is first held against the segment's whole summary, both copies weighed
/// (`summary::current_crcs`): the crc block the read used may be an earlier use's, from a
/// copy whose last write the device lost, and still pass its checks.
pub fn read_seg_blocks(
    sh: &Shared,
    seg: u32,
    block: u32,
    n: u32,
    out: &mut [u8],
    crcs: &[u32],
) -> Result<Option<u32>, EngineError> {
    let (dev, off) = sh.layout.seg_data_byte(seg, block);
    let out = &mut out[..n as usize * BLOCK];
    sh.caps[dev].read_at(out, off)?;
    if first_mismatch(block, n, out, crcs).is_none() {
        return Ok(None);
    }
    // The crcs given may be an earlier use's (a summary copy whose last write was lost): the
    // segment's current ones decide, then a block that does not match them is read again.
    let current = match sh.layout.geo.summary_copies < 2 {
        true => None,
        false => summary::current_crcs(sh, seg, block, n, crcs),
    };
    let crcs = current.as_deref().unwrap_or(crcs);
    if crcs.len() < n as usize {
        return Ok(first_mismatch(block, n, out, crcs));
    }
    let bad = crate::reread::mend(sh, &*sh.caps[dev], 1 + dev, off, out, |k| crcs[k]);
    Ok(bad.first().map(|&k| block + k as u32))
}

/// The first of blocks `block..block + n` (in `out`) that does not match its crc in `crcs`.
fn first_mismatch(block: u32, n: u32, out: &[u8], crcs: &[u32]) -> Option<u32> {
    (0..n as usize)
        .find(|&i| crcs.get(i).copied() != Some(crc32c::crc32c(&out[i * BLOCK..(i + 1) * BLOCK])))
        .map(|i| block + i as u32)
}

/// Discards every free segment of the capacity devices where that is cheap (files), in one
/// call per run of adjacent free segments. Run by open once its checkpoint names no recent
/// segment, before anything is allocated: it returns to a capacity file's file system what a
/// stop between an index flush and its discards (a SIGKILL right after a volume delete) left
/// allocated. Returns the bytes discarded.
pub fn discard_free_segments(sh: &Shared) -> u64 {
    let seg_bytes = sh.layout.segment_size_bytes;
    // (device, first byte, bytes) of each run of adjacent free segments.
    let mut runs: Vec<(usize, u64, u64)> = Vec::new();
    {
        let segs = sh.segs.lock();
        for (i, s) in segs.segs.iter().enumerate() {
            let (dev, off) = sh.layout.segments[i];
            if s.state != SegState::Free || !sh.caps[dev].discard_is_cheap() {
                continue;
            }
            match runs.last_mut() {
                Some((d, start, len)) if *d == dev && *start + *len == off => *len += seg_bytes,
                _ => runs.push((dev, off, seg_bytes)),
            }
        }
    }
    let mut bytes = 0;
    for (dev, off, len) in runs {
        match sh.caps[dev].discard(off, len) {
            Ok(()) => bytes += len,
            Err(e) => tracing::debug!("discard of free segments at open failed: {e}"),
        }
    }
    bytes
}

/// Discards segments that just became free (their old content is of no value).
pub fn discard_segments(sh: &Shared, segs: &[u32]) {
    sh.summaries.lock().forget(|k| segs.contains(k));
    sh.crc_blocks.lock().forget(|k| segs.contains(&k.0));
    for &v in segs {
        let (dev, off) = sh.layout.segments[v as usize];
        if let Err(e) = sh.caps[dev].discard(off, sh.layout.segment_size_bytes) {
            tracing::debug!("discard of segment {v} failed: {e}");
        }
    }
}
