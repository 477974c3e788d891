//! Where each block of a view lives: for each layer of the view's chain (top first), the
//! layer's fast map, then its part of the capacity tree; what neither holds falls through to
//! the parent layer, and what no layer holds reads as zeros.

use crate::ctree::page::{key_of, split_key};
use crate::ctree::{CTree, Entry, Miss};
use crate::error::EngineError;
use crate::map::Loc;
use crate::meta;
use crate::shared::{Index, Shared};

/// `len` blocks from `lba`: at `loc` (`Loc::Fast` or `Loc::Cap`), or zeros when None.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub lba: u64,
    pub len: u64,
    pub loc: Option<Loc>,
    /// The layer that holds it (0 for blocks no layer holds).
    pub layer: u32,
}

/// Resolves `[lba, lba+n)` of view `view` (a volume or snapshot id).
pub fn resolve_view(sh: &Shared, view: u32, lba: u64, n: u64) -> Result<Vec<Piece>, EngineError> {
    for _ in 0..meta::MAX_TREE_RETRIES {
        let miss = {
            let idx = sh.index.read();
            let v = idx.view(view)?;
            let tree = sh.tree.read();
            match resolve_locked(&idx, &tree, &v.chain, lba, n) {
                Ok(p) => return Ok(p),
                Err(m) => m,
            }
        };
        meta::load(sh, miss)?;
    }
    Err(EngineError::Failed("the index kept missing pages".into()))
}

/// Like [`resolve_view`], but never reads index pages from the device: None when a page it
/// needs is not in memory (for callers that must not block on I/O).
pub fn resolve_in_memory(
    sh: &Shared,
    view: u32,
    lba: u64,
    n: u64,
) -> Result<Option<Vec<Piece>>, EngineError> {
    let idx = sh.index.read();
    let v = idx.view(view)?;
    let tree = sh.tree.read();
    Ok(resolve_locked(&idx, &tree, &v.chain, lba, n).ok())
}

/// Resolves through `chain` with the index and tree locks held.
pub fn resolve_locked(
    idx: &Index,
    tree: &CTree,
    chain: &[u32],
    lba: u64,
    n: u64,
) -> Result<Vec<Piece>, Miss> {
    let mut out = Vec::new();
    let mut pending = vec![(lba, n)];
    let mut hits = Vec::new();
    for &layer in chain {
        if pending.is_empty() {
            break;
        }
        let Some(l) = idx.layers.get(&layer) else {
            continue;
        };
        let mut next = Vec::new();
        for &(s, len) in &pending {
            for p in l.fast.lookup(s, len) {
                match p.loc {
                    Some(Loc::Zero(_)) => out.push(Piece {
                        lba: p.lba,
                        len: p.len,
                        loc: None,
                        layer,
                    }),
                    Some(loc) => out.push(Piece {
                        lba: p.lba,
                        len: p.len,
                        loc: Some(loc),
                        layer,
                    }),
                    None => {
                        hits.clear();
                        tree.lookup(
                            key_of(layer, p.lba),
                            key_of(layer, p.lba + p.len),
                            &mut hits,
                        )?;
                        fill_from_tree(&hits, layer, p.lba, p.len, &mut out, &mut next);
                    }
                }
            }
        }
        pending = next;
    }
    out.extend(pending.into_iter().map(|(lba, len)| Piece {
        lba,
        len,
        loc: None,
        layer: 0,
    }));
    out.sort_unstable_by_key(|p| p.lba);
    Ok(out)
}

/// Adds what the tree holds of `[lba, lba+len)` to `out`, and the rest to `holes`.
fn fill_from_tree(
    hits: &[Entry],
    layer: u32,
    lba: u64,
    len: u64,
    out: &mut Vec<Piece>,
    holes: &mut Vec<(u64, u64)>,
) {
    let mut at = lba;
    for e in hits {
        let (_, elba) = split_key(e.key);
        if elba > at {
            holes.push((at, elba - at));
        }
        let loc = if e.loc.is_data() { Some(e.loc) } else { None };
        out.push(Piece {
            lba: elba,
            len: e.len,
            loc,
            layer,
        });
        at = elba + e.len;
    }
    if at < lba + len {
        holes.push((at, lba + len - at));
    }
}

/// What one layer holds of `[lba, lba+n)` by itself (its fast map over its tree), without
/// its parents: (lba, len, loc) with `Loc::Zero` for zero runs. Holes are absent.
pub fn layer_own(
    idx: &Index,
    tree: &CTree,
    layer: u32,
    lba: u64,
    n: u64,
) -> Result<Vec<(u64, u64, Loc)>, Miss> {
    let mut out = Vec::new();
    let Some(l) = idx.layers.get(&layer) else {
        return Ok(out);
    };
    let mut hits = Vec::new();
    for p in l.fast.lookup(lba, n) {
        match p.loc {
            Some(loc) => out.push((p.lba, p.len, loc)),
            None => {
                hits.clear();
                tree.lookup(
                    key_of(layer, p.lba),
                    key_of(layer, p.lba + p.len),
                    &mut hits,
                )?;
                out.extend(hits.iter().map(|e| (split_key(e.key).1, e.len, e.loc)));
            }
        }
    }
    Ok(out)
}
