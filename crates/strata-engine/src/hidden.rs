//! Releasing the blocks of a deleted snapshot's layer that no reader can see any more.
//!
//! A deleted snapshot's layer stays while something reads through it: merged into its child
//! when it has one live child (`maint::merge_layers`), kept as it is while it has two or more
//! (a *fork*: the volume and clones made from the snapshot, or several clones). Every reader's
//! chain reaches such a layer through one of its live children, so a block of it is read by
//! no one when every live child *hides* it: holds it itself (data or zeros), or, for a child
//! no volume or snapshot names (itself a deleted snapshot's layer, which no reader starts
//! from), when every live child of that child hides it in turn (`hidden_below`). Such blocks
//! are released here, from the layer's fast map (log data) and from the capacity index, by
//! the destager, a bounded number of entries per round.
//!
//! Why a block once hidden stays hidden (so a released block is never read again):
//! - host writes, trims and write-zeroes only put new entries over old ones (a trim in a layer
//!   with a parent is a zero run, and a layer with a parent never loses it); destage, GC, the
//!   write bypass, compaction and rotation move an entry without a moment where neither its
//!   old nor its new place holds it, and they run on the destager thread, as this does;
//! - a layer drops an entry of its own only here (or in `maint`'s release for a merging
//!   layer), where its live children hide it, so it still hides it; or when it merges into
//!   its only child, where the blocks it held move down wherever that child has none, and
//!   the child takes its place under its parent;
//! - a child deleted (its volume deleted or rolled back) is never read again; only layers a
//!   volume or snapshot names get new children, and a layer no volume or snapshot names is
//!   never named again, so the chains a block is hidden on only lose readers.
//!
//! And after a power cut: what hides a block is durable before the block is released (log
//! records are applied to the fast maps only once durable, in log order; index entries are in
//! the durable index, a recent segment's summary, or unfinished work (a merge) redone at
//! open, which leaves every block held by the merging layer or its child). An index flushed
//! after the release no longer names the block; one not flushed still does, the segment
//! still counts it (it is not reused before the next flush), and it is released again. Log
//! data dropped from the layer's fast map comes back at replay and is dropped again.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::ctree::page::{key_of, split_key};
use crate::ctree::{CTree, Miss};
use crate::destage::{apply_tree_sets, Destager, TreeSet};
use crate::error::EngineError;
use crate::format::{LAYER_DELETED, LAYER_MERGING};
use crate::map::Loc;
use crate::meta;
use crate::resolve::layer_own;
use crate::shared::{Index, Shared};

/// Fast-map runs or index entries one chunk looks at.
const CHUNK_ENTRIES: usize = 1024;
/// Chunks per housekeeping round, over every fork (so destage is not starved).
const CHUNKS_PER_ROUND: usize = 8;
/// A fork is looked at again at most this often once a pass over it has ended, and only
/// when a layer has changed since the pass began.
const RESCAN_MIN: Duration = Duration::from_secs(1);
/// ... and no sooner than this many times the time the last pass took (so passes take about
/// 5% of the destager's time at most while writes keep coming).
const RESCAN_COST_FACTOR: u32 = 20;

/// The parts of `[lba, lba+len)` that every layer of `children` holds itself (data or
/// zeros), as (lba, len).
pub fn hidden_by_all(
    idx: &Index,
    t: &CTree,
    children: &[u32],
    lba: u64,
    len: u64,
) -> Result<Vec<(u64, u64)>, Miss> {
    let mut covered = vec![(lba, len)];
    for &c in children {
        if covered.is_empty() {
            break;
        }
        let own = layer_own(idx, t, c, lba, len)?;
        covered = intersect(&covered, &own);
    }
    Ok(covered)
}

/// The parts of `ranges` (sorted, apart) that `own` (sorted) covers.
fn intersect(ranges: &[(u64, u64)], own: &[(u64, u64, Loc)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(a, alen) in ranges {
        for &(olba, olen, _) in own {
            let (s, e) = (a.max(olba), (a + alen).min(olba + olen));
            if s < e {
                out.push((s, e - s));
            }
        }
    }
    out
}

/// `ranges` less `minus` (both sorted, apart; `minus` within `ranges`).
fn subtract(ranges: &[(u64, u64)], minus: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut cut = minus.iter().peekable();
    for &(a, alen) in ranges {
        let (mut at, end) = (a, a + alen);
        while let Some(&&(m, mlen)) = cut.peek() {
            if m >= end {
                break;
            }
            if m > at {
                out.push((at, m - at));
            }
            at = at.max(m + mlen);
            cut.next();
        }
        if at < end {
            out.push((at, end - at));
        }
    }
    out
}

/// Who reads through whom: the layers volumes and snapshots name, and each layer's live
/// (not deleted) children. Taken once per round on the destager thread, it stays safe to use
/// for the round while other threads change the volume table: a layer no volume or snapshot
/// names is never named again and gets no new child (only a merge, on this thread, puts a
/// layer under it); a child deleted meanwhile, or a layer no longer named, only makes the
/// answers below more cautious.
#[derive(Debug, Default)]
pub struct Family {
    referenced: HashSet<u32>,
    kids: HashMap<u32, Vec<u32>>,
}

impl Family {
    pub fn of(idx: &Index) -> Family {
        let referenced = idx
            .volumes
            .values()
            .map(|v| v.head)
            .chain(idx.snapshots.values().map(|s| s.layer))
            .collect();
        let mut kids: HashMap<u32, Vec<u32>> = HashMap::new();
        for l in idx.layers.values() {
            if l.rec.parent != 0 && l.rec.flags & LAYER_DELETED == 0 {
                kids.entry(l.rec.parent).or_default().push(l.rec.id);
            }
        }
        Family { referenced, kids }
    }

    fn kids(&self, layer: u32) -> &[u32] {
        self.kids.get(&layer).map_or(&[], |k| k.as_slice())
    }
}

/// The parts of `[lba, lba+len)` of `layer` that no reader reaches: every live child of the
/// layer hides them. A child hides a block when it holds it itself (data or zeros), or, when
/// no volume or snapshot names the child (so every reader of it reads through a child of
/// its own), when every live child of it hides the block. Empty for a layer with no live
/// child.
pub fn hidden_below(
    idx: &Index,
    t: &CTree,
    fam: &Family,
    layer: u32,
    lba: u64,
    len: u64,
) -> Result<Vec<(u64, u64)>, Miss> {
    let kids = fam.kids(layer);
    if kids.is_empty() {
        return Ok(Vec::new());
    }
    hidden_by_kids(idx, t, fam, kids, vec![(lba, len)])
}

/// The parts of `ranges` every layer of `kids` hides (see `hidden_below`).
fn hidden_by_kids(
    idx: &Index,
    t: &CTree,
    fam: &Family,
    kids: &[u32],
    mut ranges: Vec<(u64, u64)>,
) -> Result<Vec<(u64, u64)>, Miss> {
    for &k in kids {
        if ranges.is_empty() {
            break;
        }
        ranges = hides(idx, t, fam, k, ranges)?;
    }
    Ok(ranges)
}

/// The parts of `ranges` (sorted, apart) that `layer` hides from what is below it.
fn hides(
    idx: &Index,
    t: &CTree,
    fam: &Family,
    layer: u32,
    ranges: Vec<(u64, u64)>,
) -> Result<Vec<(u64, u64)>, Miss> {
    let (Some(&(first, _)), Some(&(last, last_len))) = (ranges.first(), ranges.last()) else {
        return Ok(ranges);
    };
    let own = layer_own(idx, t, layer, first, last + last_len - first)?;
    let mut out = intersect(&ranges, &own);
    let kids = fam.kids(layer);
    if fam.referenced.contains(&layer) || kids.is_empty() {
        return Ok(out);
    }
    let rest = subtract(&ranges, &out);
    if !rest.is_empty() {
        out.extend(hidden_by_kids(idx, t, fam, kids, rest)?);
        out.sort_unstable();
    }
    Ok(out)
}

/// Drops from `layer`'s fast map the runs of `runs` (lba, len, loc) that no reader reaches
/// (where the map still points at them).
fn drop_log_runs(
    sh: &Shared,
    fam: &Family,
    layer: u32,
    runs: &[(u64, u64, Loc)],
) -> Result<(), EngineError> {
    let mut hidden = Vec::new();
    for &(lba, len, loc) in runs {
        let parts = meta::with_index_tree(sh, |idx, t| hidden_below(idx, t, fam, layer, lba, len))?;
        hidden.extend(parts.into_iter().map(|(a, n)| (a, n, loc.advance(a - lba))));
    }
    let mut fast_blocks = 0;
    if let Some(l) = sh.index.write().layers.get_mut(&layer) {
        for (lba, len, at) in hidden {
            let removed = l.fast.remove_if_at(lba, len, at);
            if matches!(at, Loc::Fast(_)) {
                fast_blocks += removed;
            }
        }
    }
    sh.counters
        .fast_live_blocks
        .fetch_sub(fast_blocks, Ordering::Relaxed);
    Ok(())
}

/// Drops from a layer's fast map what no reader reaches (`hidden_below`), one chunk of runs
/// from `from_lba`; returns where the next chunk starts (None: the map's end). The log
/// records stay: replay puts them back while the layer is live or merging, and they are
/// dropped again.
pub fn drop_hidden_log_data(
    sh: &Shared,
    fam: &Family,
    layer: u32,
    from_lba: u64,
) -> Result<Option<u64>, EngineError> {
    let runs: Vec<(u64, u64, Loc)> = match sh.index.read().layers.get(&layer) {
        Some(l) => l.fast.runs_from(from_lba).take(CHUNK_ENTRIES).collect(),
        None => return Ok(None),
    };
    let Some(&(last, last_len, _)) = runs.last() else {
        return Ok(None);
    };
    drop_log_runs(sh, fam, layer, &runs)?;
    Ok(Some(last + last_len))
}

/// Releases a layer's blocks on the capacity tier that no reader reaches (`hidden_below`),
/// one chunk of the layer's index entries from `from_lba`; returns where the next chunk
/// starts (None: the layer's end), and whether it released anything (the segments emptied
/// then wait for the next index flush to be reused).
pub fn drop_hidden_capacity_data(
    sh: &Shared,
    fam: &Family,
    layer: u32,
    from_lba: u64,
) -> Result<(Option<u64>, bool), EngineError> {
    let end = key_of(layer, 0) + (1u128 << 64);
    let ents = meta::with_tree_read(sh, |t| {
        let mut v = Vec::new();
        t.first_entries(key_of(layer, from_lba), end, CHUNK_ENTRIES, &mut v)
            .map(|()| v)
    })?;
    let Some(last) = ents.last() else {
        return Ok((None, false));
    };
    let next_lba = split_key(last.key).1 + last.len;
    let mut clear = Vec::new();
    for e in ents.iter().filter(|e| matches!(e.loc, Loc::Cap { .. })) {
        let (_, lba) = split_key(e.key);
        let parts =
            meta::with_index_tree(sh, |idx, t| hidden_below(idx, t, fam, layer, lba, e.len))?;
        clear.extend(parts.into_iter().map(|(a, n)| TreeSet {
            layer,
            lba: a,
            len: n,
            loc: None,
        }));
    }
    apply_tree_sets(sh, &clear, false)?;
    Ok((Some(next_lba), !clear.is_empty()))
}

/// What a pass over a fork started from: when any of it changes, a block may have become
/// hidden by every child.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Basis {
    /// `Counters::own_changes` (records applied to fast maps, bypass writes, table changes).
    own_changes: u64,
    parent: u32,
    children: Vec<u32>,
}

/// Where a pass over a fork is.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Dropping hidden log data, from this lba of the layer's fast map.
    Log(u64),
    /// Releasing hidden capacity blocks, from this lba of the layer's index entries.
    Capacity(u64),
}

#[derive(Debug)]
struct ForkScan {
    /// The pass under way; None between passes.
    phase: Option<Phase>,
    basis: Basis,
    /// Time the pass under way (or the last one) has taken.
    busy: Duration,
    /// When the last pass ended (None: no pass has).
    ended: Option<Instant>,
}

/// The destager's passes over forks, by layer.
#[derive(Debug, Default)]
pub struct ForkScans {
    scans: HashMap<u32, ForkScan>,
}

/// Deleted snapshots' layers with two or more live children, each with (parent, children).
pub fn forks(idx: &Index, fam: &Family) -> Vec<(u32, u32, Vec<u32>)> {
    idx.layers
        .values()
        .filter(|l| l.rec.flags & (LAYER_DELETED | LAYER_MERGING) == 0)
        .filter(|l| !fam.referenced.contains(&l.rec.id))
        .map(|l| (l.rec.id, l.rec.parent, fam.kids(l.rec.id).to_vec()))
        .filter(|(_, _, kids)| kids.len() >= 2)
        .collect()
}

/// One round of passes over the forks: a pass starts when a layer becomes a fork, and again
/// once something changed since the last one began (no sooner than `RESCAN_MIN`, nor than
/// `RESCAN_COST_FACTOR` times what it took); each round handles at most `CHUNKS_PER_ROUND`
/// chunks over all forks.
pub fn release_in_forks(d: &mut Destager) -> Result<(), EngineError> {
    let (fam, forks) = {
        let idx = d.sh.index.read();
        // Every layer named by a volume or a snapshot: no fork, and nothing to build (this
        // runs between every two destager steps).
        if idx.layers.len() <= idx.volumes.len() + idx.snapshots.len() {
            d.maint.forks.scans.clear();
            return Ok(());
        }
        let fam = Family::of(&idx);
        let forks = forks(&idx, &fam);
        (fam, forks)
    };
    let scans = &mut d.maint.forks.scans;
    scans.retain(|l, _| forks.iter().any(|f| f.0 == *l));
    let own_changes = d.sh.counters.own_changes.load(Ordering::Acquire);
    let mut budget = CHUNKS_PER_ROUND;
    for (layer, parent, children) in forks {
        let basis = Basis {
            own_changes,
            parent,
            children,
        };
        let scan = scans.entry(layer).or_insert_with(|| ForkScan {
            phase: None,
            basis: basis.clone(),
            busy: Duration::ZERO,
            ended: None,
        });
        if scan.phase.is_none() {
            let wait = RESCAN_MIN.max(scan.busy * RESCAN_COST_FACTOR);
            let due = match scan.ended {
                None => true,
                Some(at) => scan.basis != basis && at.elapsed() >= wait,
            };
            if !due {
                continue;
            }
            scan.phase = Some(Phase::Log(0));
            scan.basis = basis;
            scan.busy = Duration::ZERO;
        }
        while budget > 0 {
            let Some(phase) = scan.phase else { break };
            budget -= 1;
            let started = Instant::now();
            scan.phase = match phase {
                Phase::Log(from) => match drop_hidden_log_data(&d.sh, &fam, layer, from)? {
                    Some(next) => Some(Phase::Log(next)),
                    None => Some(Phase::Capacity(0)),
                },
                Phase::Capacity(from) => {
                    let (next, released) = drop_hidden_capacity_data(&d.sh, &fam, layer, from)?;
                    // Space given back is free once an index without those blocks is durable:
                    // flush soon, as after a snapshot delete, not at the next periodic flush.
                    d.maint.want_flush |= released;
                    next.map(Phase::Capacity)
                }
            };
            scan.busy += started.elapsed();
            if scan.phase.is_none() {
                scan.ended = Some(Instant::now());
            }
        }
        if budget == 0 {
            break;
        }
    }
    Ok(())
}
