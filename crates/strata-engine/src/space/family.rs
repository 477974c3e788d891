//! Space reports of many views in one walk: the views that read through the same layers (a
//! volume, its snapshots, their clones) are counted together, each block looked up once per
//! layer that holds it rather than once per view that reads it.
//!
//! Counted one by one, the N snapshots of a volume cost N walks of up to N layers each: 1,000
//! snapshots took seconds to list. Here a round looks at each layer of the family once; the
//! layers form a tree (each points at its parent), laid out in preorder so that a layer's
//! subtree is a range of positions. A block a layer holds shows in the views whose top is in
//! that layer's subtree, less the subtrees of the layers below it that hold the block too;
//! each is a range, added to a difference array per tier, and one prefix sum per round gives
//! every view's count of the blocks it sees holding data. What only the view's top layer
//! holds is then split into exclusive and shared as the walk of one view does it.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::ctree::{CTree, Miss};
use crate::error::EngineError;
use crate::format::BLOCK_U64;
use crate::map::Loc;
use crate::meta;
use crate::resolve::layer_own;
use crate::shared::{Index, MAX_CHAIN};
use crate::{DiskGroup, VolumeId};

use super::{add, SpaceReport, CHUNK_BLOCKS};

impl DiskGroup {
    /// What each of `views` holds on each tier: the figures `space` reports, counted in one
    /// walk for all the views that share layers. In the order of `views`.
    pub fn space_of_views(&self, views: &[VolumeId]) -> Vec<Result<SpaceReport, EngineError>> {
        let mut found: HashMap<VolumeId, Result<SpaceReport, EngineError>> = HashMap::new();
        for family in self.view_families(views) {
            found.extend(family.iter().copied().zip(self.space_family(&family)));
        }
        // A view asked for twice is counted once; its second answer is a copy.
        let mut out: Vec<Result<SpaceReport, EngineError>> = Vec::with_capacity(views.len());
        for v in views {
            out.push(match found.remove(v) {
                Some(r) => r,
                None => out[views.iter().position(|x| x == v).unwrap_or(0)]
                    .as_ref()
                    .map(|r| *r)
                    .map_err(|e| EngineError::Failed(e.to_string())),
            });
        }
        out
    }

    /// `views` (duplicates dropped) in groups that read through the same tree of layers, each
    /// group best counted in one walk. A view not found is a group of its own.
    pub fn view_families(&self, views: &[VolumeId]) -> Vec<Vec<VolumeId>> {
        let idx = self.sh.index.read();
        let mut root_of: HashMap<u32, u32> = HashMap::new();
        let mut groups: BTreeMap<u32, Vec<VolumeId>> = BTreeMap::new();
        let mut alone = Vec::new();
        let mut seen = HashSet::new();
        for &v in views {
            if !seen.insert(v) {
                continue;
            }
            match view_top(&idx, v) {
                Some((_, top)) => {
                    let root = root_layer(&idx, &mut root_of, top);
                    groups.entry(root).or_default().push(v);
                }
                None => alone.push(vec![v]),
            }
        }
        groups.into_values().chain(alone).collect()
    }

    /// One walk over `views` (no duplicates), whatever layers they read through.
    fn space_family(&self, views: &[VolumeId]) -> Vec<Result<SpaceReport, EngineError>> {
        let mut out: Vec<Result<SpaceReport, EngineError>> =
            views.iter().map(|_| Ok(SpaceReport::default())).collect();
        // Sizes as the walk begins, as for one view; a view whose chain is too deep for the
        // tree below is walked alone, which reports why.
        let mut size_blocks = vec![0u64; views.len()];
        let mut alone = Vec::new();
        {
            let idx = self.sh.index.read();
            let tops: Vec<Option<u32>> = views
                .iter()
                .map(|&v| view_top(&idx, v).map(|t| t.1))
                .collect();
            let forest = Forest::of(&idx, &tops);
            for (i, &v) in views.iter().enumerate() {
                match view_top(&idx, v) {
                    None => out[i] = Err(EngineError::NotFound(format!("#{v}"))),
                    Some(_) if forest.too_deep[i] => alone.push(i),
                    Some((size, _)) => size_blocks[i] = size.div_ceil(BLOCK_U64),
                }
            }
        }
        for i in alone {
            out[i] = self.space(views[i]);
        }
        let mut bounds: Vec<u64> = size_blocks.iter().copied().filter(|&s| s > 0).collect();
        bounds.sort_unstable();
        bounds.dedup();
        let Some(&last) = bounds.last() else {
            return out;
        };
        let mut at = 0;
        while at < last {
            // A round never spans a view's end, so every view counts all of it or none.
            let bound = bounds.iter().copied().find(|&b| b > at).unwrap_or(last);
            let n = CHUNK_BLOCKS.min(bound - at);
            let active: Vec<bool> = size_blocks.iter().map(|&s| s >= at + n).collect();
            // As for a read: a flush may not free an index page this count is loading.
            let _shared = self.sh.reclaim.read();
            let round = meta::with_index_tree(&self.sh, |idx, t| {
                count_round(idx, t, views, &active, at, n, last)
            });
            let (parts, next) = match round {
                Ok(r) => r,
                Err(e) => {
                    // As the walk of one view: a failure is the answer for every view.
                    let why = e.to_string();
                    for (i, r) in out.iter_mut().enumerate() {
                        if r.is_ok() && size_blocks[i] > 0 {
                            *r = Err(EngineError::Failed(why.clone()));
                        }
                    }
                    return out;
                }
            };
            for (i, part) in parts.iter().enumerate() {
                if let (Some(p), Ok(r)) = (part, &mut out[i]) {
                    add(r, p);
                }
            }
            at = next;
        }
        out
    }
}

/// A view's size in bytes and the layer its reads begin at.
fn view_top(idx: &Index, view: VolumeId) -> Option<(u64, u32)> {
    if let Some(v) = idx.volumes.get(&view) {
        Some((v.size_bytes, v.head))
    } else {
        idx.snapshots.get(&view).map(|s| (s.size_bytes, s.layer))
    }
}

/// The last layer up from `top` (remembered for every layer passed, so a family costs one
/// walk up in all, not one per view).
fn root_layer(idx: &Index, root_of: &mut HashMap<u32, u32>, top: u32) -> u32 {
    let mut path = Vec::new();
    let mut at = top;
    let root = loop {
        if let Some(&r) = root_of.get(&at) {
            break r;
        }
        path.push(at);
        match idx.layers.get(&at).map(|l| l.rec.parent) {
            Some(p) if p != 0 && path.len() < MAX_CHAIN => at = p,
            _ => break at,
        }
    };
    for l in path {
        root_of.insert(l, root);
    }
    root
}

/// The layers the views read through, each after its parent (preorder), so that a layer's
/// subtree is the positions from its own up to `end`.
struct Forest {
    ids: Vec<u32>,
    end: Vec<usize>,
    /// Per view: its top's position, None when it has none (no layer, or too deep).
    top_pos: Vec<Option<usize>>,
    /// Per view: reads through `MAX_CHAIN` layers or more (or a loop), left to the walk of
    /// one view, whose checks report it.
    too_deep: Vec<bool>,
}

impl Forest {
    fn of(idx: &Index, tops: &[Option<u32>]) -> Forest {
        // Each layer's parent within the family (0 for a root: no parent, or one not there)
        // and its depth, set only once its whole way up is known.
        let mut depth: HashMap<u32, usize> = HashMap::new();
        let mut parent: HashMap<u32, u32> = HashMap::new();
        let mut too_deep = vec![false; tops.len()];
        for (i, top) in tops.iter().enumerate() {
            let Some(top) = *top else { continue };
            let mut path = Vec::new();
            let mut at = top;
            // The known layer the path stops at, and its depth.
            let (stop, base) = loop {
                if let Some(&d) = depth.get(&at) {
                    break (at, d);
                }
                let Some(l) = idx.layers.get(&at) else {
                    break (0, 0);
                };
                path.push(at);
                if path.len() >= MAX_CHAIN || l.rec.parent == 0 {
                    break (0, 0);
                }
                at = l.rec.parent;
            };
            if base + path.len() >= MAX_CHAIN {
                too_deep[i] = true;
                continue;
            }
            let mut up = stop;
            for (k, &l) in path.iter().enumerate().rev() {
                depth.insert(l, base + path.len() - k);
                parent.insert(l, up);
                up = l;
            }
        }
        let mut kids: HashMap<u32, Vec<u32>> = HashMap::new();
        for (&l, &p) in &parent {
            kids.entry(p).or_default().push(l);
        }
        for k in kids.values_mut() {
            k.sort_unstable();
        }
        let mut ids = Vec::with_capacity(parent.len());
        let mut end = Vec::with_capacity(parent.len());
        let mut pos: HashMap<u32, usize> = HashMap::new();
        // Depth-first from the roots: (layer, whether its subtree is done).
        let mut stack: Vec<(u32, bool)> = kids
            .get(&0)
            .map(|r| r.iter().rev().map(|&l| (l, false)).collect())
            .unwrap_or_default();
        while let Some((l, done)) = stack.pop() {
            if done {
                end[pos[&l]] = ids.len();
                continue;
            }
            pos.insert(l, ids.len());
            ids.push(l);
            end.push(0);
            stack.push((l, true));
            if let Some(k) = kids.get(&l) {
                stack.extend(k.iter().rev().map(|&c| (c, false)));
            }
        }
        let top_pos = tops
            .iter()
            .zip(&too_deep)
            .map(|(t, &deep)| t.filter(|_| !deep).and_then(|t| pos.get(&t).copied()))
            .collect();
        Forest {
            ids,
            end,
            top_pos,
            too_deep,
        }
    }
}

/// Where a block a layer holds counts: nowhere (zeros), or on one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Zeros,
    Fast,
    Capacity,
}

fn kind_of(loc: Loc) -> Kind {
    match loc {
        Loc::Zero(_) => Kind::Zeros,
        Loc::Fast(_) => Kind::Fast,
        Loc::Cap { .. } => Kind::Capacity,
    }
}

/// One round, `[lba, lba+n)`: each active view's part of it (None for the others), and where
/// the next round begins (before `end`: the first block a layer of the family holds).
fn count_round(
    idx: &Index,
    t: &CTree,
    views: &[VolumeId],
    active: &[bool],
    lba: u64,
    n: u64,
    end: u64,
) -> Result<(Vec<Option<SpaceReport>>, u64), Miss> {
    let tops: Vec<Option<u32>> = views
        .iter()
        .map(|&v| view_top(idx, v).map(|t| t.1))
        .collect();
    let f = Forest::of(idx, &tops);
    let mut own = Vec::with_capacity(f.ids.len());
    for &l in &f.ids {
        own.push(layer_own(idx, t, l, lba, n)?);
    }
    let (fast, cap) = seen_data(&f, &own);
    let mut parts = Vec::with_capacity(views.len());
    for (i, pos) in f.top_pos.iter().enumerate() {
        let Some(p) = pos.filter(|_| active[i]) else {
            parts.push(None);
            continue;
        };
        let top = f.ids[p];
        let kids: Vec<u32> = (idx.children_of(top).iter().copied())
            .filter(|&c| idx.layer_live(c))
            .collect();
        let (mut ex_fast, mut ex_cap) = (0, 0);
        for &(at, len, loc) in &own[p] {
            let kind = kind_of(loc);
            if kind == Kind::Zeros {
                continue;
            }
            let ex = if kids.is_empty() {
                len
            } else {
                let covered = crate::hidden::hidden_by_all(idx, t, &kids, at, len)?;
                covered.iter().map(|(_, n)| n).sum()
            };
            match kind {
                Kind::Fast => ex_fast += ex,
                _ => ex_cap += ex,
            }
        }
        parts.push(Some(SpaceReport {
            exclusive_fast_bytes: ex_fast * BLOCK_U64,
            exclusive_capacity_bytes: ex_cap * BLOCK_U64,
            shared_fast_bytes: fast[p].saturating_sub(ex_fast) * BLOCK_U64,
            shared_capacity_bytes: cap[p].saturating_sub(ex_cap) * BLOCK_U64,
        }));
    }
    let next = super::next_held_of(idx, t, &f.ids, lba + n, end)?;
    Ok((parts, next))
}

/// Per position of the forest: the blocks of the round a view with its top there reads as
/// data, on the fast tier and on the capacity tier.
fn seen_data(f: &Forest, own: &[Vec<(u64, u64, Loc)>]) -> (Vec<u64>, Vec<u64>) {
    // Where each layer's runs begin and end; at one block, ends come before beginnings.
    let mut edges: Vec<(u64, bool, usize, Kind)> = Vec::new();
    for (p, runs) in own.iter().enumerate() {
        for &(at, len, loc) in runs {
            edges.push((at, true, p, kind_of(loc)));
            edges.push((at + len, false, p, kind_of(loc)));
        }
    }
    edges.sort_unstable_by_key(|&(at, begins, p, _)| (at, begins, p));
    let size = f.ids.len() + 1;
    let (mut d_fast, mut d_cap) = (vec![0i64; size], vec![0i64; size]);
    // The layers holding the blocks from `from` on, by position (so ancestors come first).
    let mut holding: BTreeMap<usize, Kind> = BTreeMap::new();
    let mut from = 0;
    let mut stack: Vec<(usize, Kind)> = Vec::new();
    for &(at, begins, p, kind) in &edges {
        if at > from && !holding.is_empty() {
            let w = (at - from) as i64;
            stack.clear();
            for (&q, &k) in &holding {
                while stack.last().is_some_and(|&(s, _)| f.end[s] <= q) {
                    stack.pop();
                }
                // The subtree sees this layer's copy, except where a layer below holds one.
                let mut range = |kind: Kind, w: i64| match kind {
                    Kind::Fast => {
                        d_fast[q] += w;
                        d_fast[f.end[q]] -= w;
                    }
                    Kind::Capacity => {
                        d_cap[q] += w;
                        d_cap[f.end[q]] -= w;
                    }
                    Kind::Zeros => {}
                };
                range(k, w);
                if let Some(&(_, above)) = stack.last() {
                    range(above, -w);
                }
                stack.push((q, k));
            }
        }
        from = at;
        if begins {
            holding.insert(p, kind);
        } else {
            holding.remove(&p);
        }
    }
    let prefix = |d: Vec<i64>| -> Vec<u64> {
        let mut sum = 0i64;
        d.iter()
            .map(|x| {
                sum += x;
                sum.max(0) as u64
            })
            .collect()
    };
    (prefix(d_fast), prefix(d_cap))
}
