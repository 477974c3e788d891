//! The index's upkeep, run by the destager between steps:
//! - flushing the index when enough changed, when recovery would have too many recent
//!   segments to replay, or when segments wait for a durable index to become free;
//! - keeping the resident leaves within the cache budget;
//! - releasing the blocks of deleted layers, and merging a deleted snapshot's layer into its
//!   only child; a layer record goes only after an index without its blocks is durable;
//! - releasing the blocks of a deleted snapshot's layer that no reader sees (`hidden.rs`);
//! - moving the live pages out of index segments that are mostly garbage.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::capacity::SegState;
use crate::ctree::page::{key_of, split_key};
use crate::ctree::Entry;
use crate::destage::{apply_tree_sets, Destager, TreeSet};
use crate::error::EngineError;
use crate::format::{LAYER_DELETED, LAYER_MERGING};
use crate::hidden;
use crate::map::Loc;
use crate::meta;
use crate::resolve::layer_own;
use crate::shared::Shared;

/// Recent segments after which the index is flushed (bounds recovery's replay).
const RECENT_FLUSH: usize = 64;
/// An index with unwritten changes is flushed at least this often.
const FLUSH_INTERVAL: Duration = Duration::from_secs(30);
/// Memory a resident index node takes: about one full leaf's worth.
const NODE_RAM: usize = std::mem::size_of::<Entry>() * crate::ctree::page::LEAF_MAX + 128;
/// Index nodes the cache holds at least, whatever its budget.
const MIN_CACHE_NODES: usize = 16;
/// The least index cache budget that is not raised (`EngineConfig::index_cache_bytes`).
pub const MIN_INDEX_CACHE_BYTES: u64 = (NODE_RAM * MIN_CACHE_NODES) as u64;

/// Index nodes the cache holds.
pub fn cache_nodes(cfg: &crate::EngineConfig) -> usize {
    (cfg.index_cache_bytes as usize / NODE_RAM).max(MIN_CACHE_NODES)
}

/// The index's limits for a group: (dirty nodes that trigger a flush, free segments kept for
/// flushes). A flush writes at most the dirty limit plus what one destage stripe dirties (every
/// block of it in a different leaf, at worst), plus the segment table, twice (two streams);
/// each stream may also be partway through a segment.
pub fn index_limits(
    cfg: &crate::EngineConfig,
    layout: &crate::layout::Layout,
    devices: usize,
) -> (usize, usize) {
    let cache_leaves = cache_nodes(cfg);
    let seg_blocks = (layout.segment_size_bytes / crate::format::BLOCK_U64) as usize;
    // The more changes a flush gathers, the more of them share a page: random writes over a
    // large volume touch a different leaf each, so a small limit writes a page or more per
    // block destaged. Up to 3/4 of the cache may wait, as long as the segments kept free
    // for a flush stay within about 1/32 of the capacity tier.
    let share = layout.segments.len() * seg_blocks / 64;
    let dirty_limit = (cache_leaves * 3 / 4).min(share.max(seg_blocks / 2)).max(8);
    let stripe_blocks = devices * layout.geo.data_blocks as usize;
    let segtab_pages = layout
        .segments
        .len()
        .div_ceil(crate::ctree::page::SEGTAB_PER_PAGE);
    let per_flush = dirty_limit + stripe_blocks + stripe_blocks / 64 + segtab_pages + 8;
    let per_stream = per_flush.div_ceil(seg_blocks) + 1;
    (dirty_limit, 2 * per_stream)
}
/// Tree entries one round of reaping or merging handles per layer.
const CHUNK_ENTRIES: usize = 1024;
/// Rounds of reaping or merging per housekeeping call (so destage is not starved).
const CHUNKS_PER_ROUND: usize = 8;

pub struct Maint {
    /// Set when something waits for the next flush (GC victims to become reusable).
    pub want_flush: bool,
    /// A deleted snapshot's layer still has data in the log: destage runs until it has none.
    pub merge_waits_for_log: bool,
    last_flush: Instant,
    /// The index segment last cleaned, and when (so a segment that does not empty is not
    /// retried in a loop).
    last_cleaned: Option<(u32, Instant)>,
    /// Where `drop_hidden_capacity_data` goes on in each merging layer (the next lba).
    hidden_scan_from: std::collections::HashMap<u32, u64>,
    /// Passes over deleted snapshots' layers that several layers read through.
    pub(crate) forks: hidden::ForkScans,
    /// Index nodes (leaves and inner nodes) kept in memory.
    cache_nodes: usize,
    pub dirty_limit: usize,
}

impl Maint {
    pub fn new(sh: &Shared) -> Maint {
        let cache_nodes = cache_nodes(&sh.cfg);
        let dirty_limit = sh.index_dirty_limit;
        Maint {
            want_flush: false,
            merge_waits_for_log: false,
            last_flush: Instant::now(),
            last_cleaned: None,
            hidden_scan_from: std::collections::HashMap::new(),
            forks: hidden::ForkScans::default(),
            cache_nodes,
            dirty_limit,
        }
    }
}

pub fn run(d: &mut Destager) -> Result<(), EngineError> {
    reap_deleted(d)?;
    merge_layers(d)?;
    hidden::release_in_forks(d)?;
    clean_index_segments(d)?;
    maybe_flush(d)?;
    let c = d.sh.tree.read().counts();
    if c.resident_leaves + c.resident_inner > d.maint.cache_nodes + d.maint.cache_nodes / 8 {
        d.sh.tree.write().evict(d.maint.cache_nodes);
    }
    Ok(())
}

fn maybe_flush(d: &mut Destager) -> Result<(), EngineError> {
    let sh = &d.sh;
    let dirty = sh.tree.read().counts().dirty_nodes;
    let (recent, pending, free) = {
        let s = sh.segs.lock();
        (s.recent.len(), s.pending_count(), s.free_count())
    };
    let low_space = pending > 0 && free < crate::destage::gc_trigger(sh) + sh.meta_reserve;
    let asked = sh.flush_asked.swap(false, Ordering::Relaxed);
    let stale =
        d.maint.last_flush.elapsed() >= FLUSH_INTERVAL && (dirty > 0 || recent > 0 || pending > 0);
    let due = asked
        || dirty >= d.maint.dirty_limit
        || recent >= RECENT_FLUSH
        || low_space
        || stale
        || (d.maint.want_flush && pending > 0);
    if due {
        flush(d)?;
    }
    Ok(())
}

pub fn flush(d: &mut Destager) -> Result<(), EngineError> {
    meta::flush_index(&d.sh)?;
    d.maint.want_flush = false;
    d.maint.last_flush = Instant::now();
    Ok(())
}

/// The key range of one layer.
fn layer_range(layer: u32) -> (u128, u128) {
    (key_of(layer, 0), key_of(layer, 0) + (1u128 << 64))
}

fn first_entries(sh: &Shared, layer: u32, limit: usize) -> Result<Vec<Entry>, EngineError> {
    let (a, b) = layer_range(layer);
    meta::with_tree_read(sh, |t| {
        let mut v = Vec::new();
        t.first_entries(a, b, limit, &mut v).map(|()| v)
    })
}

/// Releases the blocks of deleted layers; drops their records once that is durable.
fn reap_deleted(d: &mut Destager) -> Result<(), EngineError> {
    let deleted: Vec<u32> = {
        let idx = d.sh.index.read();
        idx.layers
            .values()
            .filter(|l| l.rec.flags & LAYER_DELETED != 0)
            .map(|l| l.rec.id)
            .collect()
    };
    let mut done = Vec::new();
    let mut budget = CHUNKS_PER_ROUND;
    for layer in deleted {
        loop {
            let ents = first_entries(&d.sh, layer, CHUNK_ENTRIES)?;
            let (Some(first), Some(last)) = (ents.first(), ents.last()) else {
                done.push(layer);
                break;
            };
            if budget == 0 {
                break;
            }
            budget -= 1;
            let (_, lba) = split_key(first.key);
            let len = (last.end() - first.key) as u64;
            apply_tree_sets(
                &d.sh,
                &[TreeSet {
                    layer,
                    lba,
                    len,
                    loc: None,
                }],
                false,
            )?;
        }
    }
    if !done.is_empty() {
        // The records may go only once no durable index holds blocks of these layers.
        flush(d)?;
        drop_layers(&d.sh, &done, &[])?;
    }
    Ok(())
}

/// Removes layer records: `gone` outright, and `merged` (layer, child) after pointing the
/// child at the layer's parent.
fn drop_layers(sh: &Shared, gone: &[u32], merged: &[(u32, u32)]) -> Result<(), EngineError> {
    let mut dur = sh.durable.lock();
    let mut t = sh.tables();
    for (layer, child) in merged {
        let parent = t.layers.get(layer).map_or(0, |l| l.parent);
        if let Some(c) = t.layers.get_mut(child) {
            c.parent = parent;
        }
        t.layers.remove(layer);
    }
    for l in gone {
        t.layers.remove(l);
    }
    t.settle_layers();
    sh.commit_tables(&mut dur, &t)
}

/// Moves a deleted snapshot's blocks into its only child where the child has none of its own,
/// then removes the layer.
fn merge_layers(d: &mut Destager) -> Result<(), EngineError> {
    // Only a full capacity tier keeps the layer's log data from being destaged; otherwise
    // the scan would be repeated at every step until destage empties the layer anyway.
    if d.sh.counters.capacity_full.load(Ordering::Relaxed) {
        let waiting = merging_with_log_data(&d.sh);
        let fam = hidden::Family::of(&d.sh.index.read());
        for &layer in &waiting {
            let mut from = Some(0);
            while let Some(at) = from {
                from = hidden::drop_hidden_log_data(&d.sh, &fam, layer, at)?;
            }
            let from = d.maint.hidden_scan_from.get(&layer).copied().unwrap_or(0);
            let (next, released) = hidden::drop_hidden_capacity_data(&d.sh, &fam, layer, from)?;
            d.maint.want_flush |= released;
            match next {
                Some(next) => d.maint.hidden_scan_from.insert(layer, next),
                None => d.maint.hidden_scan_from.remove(&layer),
            };
        }
        d.maint.hidden_scan_from.retain(|l, _| waiting.contains(l));
    }
    let merging: Vec<(u32, Option<u32>, bool)> = {
        let idx = d.sh.index.read();
        idx.layers
            .values()
            .filter(|l| l.rec.flags & LAYER_MERGING != 0)
            .map(|l| (l.rec.id, idx.only_live_child(l.rec.id), l.fast.is_empty()))
            .collect()
    };
    d.maint.merge_waits_for_log = merging.iter().any(|m| !m.2);
    let mut finished = Vec::new();
    let mut budget = CHUNKS_PER_ROUND;
    for (layer, child, log_clear) in merging {
        let Some(child) = child else { continue };
        if !log_clear {
            continue;
        }
        loop {
            let ents = first_entries(&d.sh, layer, CHUNK_ENTRIES)?;
            if ents.is_empty() {
                finished.push((layer, child));
                break;
            }
            if budget == 0 {
                break;
            }
            budget -= 1;
            merge_chunk(&d.sh, layer, child, &ents)?;
        }
    }
    if !finished.is_empty() {
        flush(d)?;
        drop_layers(&d.sh, &[], &finished)?;
    }
    Ok(())
}

/// Merging layers with data in the log.
fn merging_with_log_data(sh: &Shared) -> Vec<u32> {
    let idx = sh.index.read();
    idx.layers
        .values()
        .filter(|l| l.rec.flags & LAYER_MERGING != 0 && !l.fast.is_empty())
        .map(|l| l.rec.id)
        .collect()
}

/// Gives `child` the parts of `ents` (blocks of `layer`) it does not hold itself, and takes
/// them all out of `layer`.
fn merge_chunk(sh: &Shared, layer: u32, child: u32, ents: &[Entry]) -> Result<(), EngineError> {
    let mut moves = Vec::new();
    for e in ents {
        let (_, lba) = split_key(e.key);
        let own = meta::with_index_tree(sh, |idx, t| layer_own(idx, t, child, lba, e.len))?;
        let mut at = lba;
        for (olba, olen, _) in
            own.iter()
                .copied()
                .chain(std::iter::once((lba + e.len, 0, Loc::Zero(0))))
        {
            if olba > at {
                moves.push(TreeSet {
                    layer: child,
                    lba: at,
                    len: olba - at,
                    loc: Some(e.loc.advance(at - lba)),
                });
            }
            at = at.max(olba + olen);
        }
    }
    apply_tree_sets(sh, &moves, true)?;
    let clear: Vec<TreeSet> = ents
        .iter()
        .map(|e| {
            let (_, lba) = split_key(e.key);
            TreeSet {
                layer,
                lba,
                len: e.len,
                loc: None,
            }
        })
        .collect();
    apply_tree_sets(sh, &clear, false)
}

/// When index segments hold much more garbage than live pages, the emptiest one's live pages
/// are marked for rewriting; the next flush moves them and the segment frees.
fn clean_index_segments(d: &mut Destager) -> Result<(), EngineError> {
    let sh = d.sh.clone();
    let seg_blocks = sh.layout.segment_size_bytes / crate::format::BLOCK_U64;
    let victim = {
        let segs = sh.segs.lock();
        let metas: Vec<(usize, u32)> = segs
            .segs
            .iter()
            .enumerate()
            .filter(|(i, s)| {
                s.state == SegState::Meta && !segs.streams.iter().any(|p| p.seg == *i as u32)
            })
            .map(|(i, s)| (i, s.live_blocks))
            .collect();
        let live: u64 = metas.iter().map(|m| u64::from(m.1)).sum();
        let wasteful = metas.len() > 2 && live * 2 < (metas.len() as u64 - 1) * seg_blocks;
        if !wasteful {
            return Ok(());
        }
        metas.into_iter().min_by_key(|m| m.1).map(|m| m.0 as u32)
    };
    let Some(victim) = victim else { return Ok(()) };
    if d.maint
        .last_cleaned
        .is_some_and(|(v, at)| v == victim && at.elapsed() < Duration::from_secs(10))
    {
        return Ok(());
    }
    d.maint.last_cleaned = Some((victim, Instant::now()));
    mark_pages_in(&sh, victim)?;
    tracing::debug!(
        segment = victim,
        "moving live index pages out of a mostly empty segment"
    );
    flush(d)
}

/// Marks for rewriting every index and segment-table page with a copy in index segment
/// `victim`: the next flush writes them elsewhere.
pub(crate) fn mark_pages_in(sh: &Shared, victim: u32) -> Result<(), EngineError> {
    let in_victim = move |p: crate::ctree::PagePtr| {
        (p.a >> 32) as u32 == victim || (p.b >> 32) as u32 == victim
    };
    meta::with_tree(sh, |t| t.redirty(&in_victim))?;
    let mut segs = sh.segs.lock();
    let pages: Vec<usize> = segs
        .page_ptrs
        .iter()
        .enumerate()
        .filter(|(_, p)| p.is_some_and(in_victim))
        .map(|(i, _)| i)
        .collect();
    segs.dirty_pages.extend(pages);
    Ok(())
}
