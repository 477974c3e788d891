//! The index of one volume: which tier holds the newest copy of each 4 KiB block.
//!
//! Runs of blocks that are contiguous both in the volume and on the device are one entry, so a
//! sequentially written volume costs a handful of entries however large it is. Absent blocks
//! read as zeros (never written, trimmed or zeroed).

use std::collections::BTreeMap;

/// Where a block's newest copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Loc {
    /// Block index inside the fast device's log area.
    Fast(u64),
    /// Block `block` of the data area of capacity segment `seg`.
    Cap { seg: u32, block: u32 },
    /// Reads as zeros, hiding whatever older layers hold. In a fast map it carries the
    /// sequence number of the Zero record that made it (so destage can tell whose it is); in
    /// the capacity tree the number is 0.
    Zero(u64),
}

impl Loc {
    /// The location `n` blocks further on.
    pub fn advance(self, n: u64) -> Loc {
        match self {
            Loc::Fast(b) => Loc::Fast(b + n),
            Loc::Cap { seg, block } => Loc::Cap {
                seg,
                block: block + n as u32,
            },
            Loc::Zero(s) => Loc::Zero(s),
        }
    }

    /// Whether blocks at this location hold data (rather than zeros).
    pub fn is_data(self) -> bool {
        !matches!(self, Loc::Zero(_))
    }
}

/// A piece of a lookup: `len` blocks from `lba`, at `loc` (None: zeros).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub lba: u64,
    pub len: u64,
    pub loc: Option<Loc>,
}

#[derive(Debug, Default, Clone)]
pub struct ExtentMap {
    /// start lba -> (length in blocks, location of the first block)
    runs: BTreeMap<u64, (u64, Loc)>,
}

impl ExtentMap {
    pub fn run_count(&self) -> usize {
        self.runs.len()
    }

    pub fn get(&self, lba: u64) -> Option<Loc> {
        let (&k, &(len, loc)) = self.runs.range(..=lba).next_back()?;
        (lba < k + len).then(|| loc.advance(lba - k))
    }

    /// Covers `[lba, lba+len)` exactly, in order, holes included.
    pub fn lookup(&self, lba: u64, len: u64) -> Vec<Piece> {
        let end = lba + len;
        let mut out = Vec::new();
        let mut pos = lba;
        let first = self
            .runs
            .range(..=lba)
            .next_back()
            .map(|(&k, _)| k)
            .unwrap_or(lba);
        for (&k, &(rlen, loc)) in self.runs.range(first..end) {
            let rend = k + rlen;
            if rend <= pos {
                continue;
            }
            if k > pos {
                out.push(Piece {
                    lba: pos,
                    len: k - pos,
                    loc: None,
                });
                pos = k;
            }
            let take = rend.min(end) - pos;
            out.push(Piece {
                lba: pos,
                len: take,
                loc: Some(loc.advance(pos - k)),
            });
            pos += take;
        }
        if pos < end {
            out.push(Piece {
                lba: pos,
                len: end - pos,
                loc: None,
            });
        }
        out
    }

    /// Points `[lba, lba+len)` at `loc` (consecutive blocks) or at nothing; returns what it
    /// displaced as (lba, len, loc) so the caller can account for freed space.
    pub fn set(&mut self, lba: u64, len: u64, loc: Option<Loc>) -> Vec<(u64, u64, Loc)> {
        if len == 0 {
            return Vec::new();
        }
        let end = lba + len;
        self.split_at(lba);
        self.split_at(end);
        let keys: Vec<u64> = self.runs.range(lba..end).map(|(&k, _)| k).collect();
        let mut displaced = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some((l, old)) = self.runs.remove(&k) {
                displaced.push((k, l, old));
            }
        }
        if let Some(loc) = loc {
            self.insert_merged(lba, len, loc);
        }
        displaced
    }

    /// Moves the blocks of `[lba, lba+len)` that are still at `from..` to `to..`, leaving
    /// blocks that were rewritten meanwhile alone. Returns the blocks moved.
    pub fn relocate(&mut self, lba: u64, len: u64, from: Loc, to: Loc) -> u64 {
        let mut moved = 0;
        for p in self.lookup(lba, len) {
            let off = p.lba - lba;
            if p.loc == Some(from.advance(off)) {
                self.set(p.lba, p.len, Some(to.advance(off)));
                moved += p.len;
            }
        }
        moved
    }

    /// Removes the blocks of `[lba, lba+len)` that are still at `at..` (consecutive from
    /// `lba`); returns how many it removed.
    pub fn remove_if_at(&mut self, lba: u64, len: u64, at: Loc) -> u64 {
        let mut removed = 0;
        for p in self.lookup(lba, len) {
            let off = p.lba - lba;
            if p.loc == Some(at.advance(off)) {
                self.set(p.lba, p.len, None);
                removed += p.len;
            }
        }
        removed
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The first block at or after `lba` that the map holds (data or zeros), if any.
    pub fn first_held_from(&self, lba: u64) -> Option<u64> {
        if let Some((&k, &(len, _))) = self.runs.range(..=lba).next_back() {
            if lba < k + len {
                return Some(lba);
            }
        }
        self.runs.range(lba..).next().map(|(&k, _)| k)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, Loc)> + '_ {
        self.runs.iter().map(|(&k, &(l, loc))| (k, l, loc))
    }

    /// The runs that start at `lba` or later, in order.
    pub fn runs_from(&self, lba: u64) -> impl Iterator<Item = (u64, u64, Loc)> + '_ {
        self.runs.range(lba..).map(|(&k, &(l, loc))| (k, l, loc))
    }

    fn split_at(&mut self, at: u64) {
        let Some((&k, &(len, loc))) = self.runs.range(..at).next_back() else {
            return;
        };
        if at < k + len {
            self.runs.insert(k, (at - k, loc));
            self.runs.insert(at, (k + len - at, loc.advance(at - k)));
        }
    }

    fn insert_merged(&mut self, mut lba: u64, mut len: u64, mut loc: Loc) {
        if let Some((&pk, &(plen, ploc))) = self.runs.range(..lba).next_back() {
            if pk + plen == lba && ploc.advance(plen) == loc && same_area(ploc, loc) {
                self.runs.remove(&pk);
                lba = pk;
                len += plen;
                loc = ploc;
            }
        }
        if let Some(&(nlen, nloc)) = self.runs.get(&(lba + len)) {
            if loc.advance(len) == nloc && same_area(loc, nloc) {
                self.runs.remove(&(lba + len));
                len += nlen;
            }
        }
        self.runs.insert(lba, (len, loc));
    }
}

/// Whether two runs may merge into one entry: same device area (one segment, or the log),
/// or the same zero record.
pub fn same_area(a: Loc, b: Loc) -> bool {
    match (a, b) {
        (Loc::Fast(_), Loc::Fast(_)) => true,
        (Loc::Cap { seg: s1, .. }, Loc::Cap { seg: s2, .. }) => s1 == s2,
        (Loc::Zero(s1), Loc::Zero(s2)) => s1 == s2,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn arb_loc() -> impl Strategy<Value = Option<Loc>> {
        prop_oneof![
            Just(None),
            (0u64..64).prop_map(|b| Some(Loc::Fast(b))),
            (0u32..3, 0u32..64).prop_map(|(seg, block)| Some(Loc::Cap { seg, block })),
        ]
    }

    proptest! {
        #[test]
        fn matches_a_block_by_block_model(ops in prop::collection::vec((0u64..96, 1u64..24, arb_loc()), 1..60)) {
            let mut m = ExtentMap::default();
            let mut model: HashMap<u64, Loc> = HashMap::new();
            for (lba, len, loc) in ops {
                let displaced = m.set(lba, len, loc);
                let mut expect_displaced = 0;
                for i in 0..len {
                    if model.remove(&(lba + i)).is_some() {
                        expect_displaced += 1;
                    }
                    if let Some(l) = loc {
                        model.insert(lba + i, l.advance(i));
                    }
                }
                prop_assert_eq!(displaced.iter().map(|d| d.1).sum::<u64>(), expect_displaced);
                for b in 0..130 {
                    prop_assert_eq!(m.get(b), model.get(&b).copied(), "block {}", b);
                }
                let pieces = m.lookup(0, 130);
                prop_assert_eq!(pieces.iter().map(|p| p.len).sum::<u64>(), 130);
                for p in pieces {
                    for i in 0..p.len {
                        prop_assert_eq!(p.loc.map(|l| l.advance(i)), model.get(&(p.lba + i)).copied());
                    }
                }
            }
        }
    }

    #[test]
    fn sequential_writes_merge_into_one_run() {
        let mut m = ExtentMap::default();
        for i in 0..1000 {
            m.set(
                i,
                1,
                Some(Loc::Cap {
                    seg: 1,
                    block: i as u32,
                }),
            );
        }
        assert_eq!(m.run_count(), 1);
        m.set(500, 1, None);
        assert_eq!(m.run_count(), 2);
    }

    #[test]
    fn relocate_moves_only_unchanged_blocks() {
        let mut m = ExtentMap::default();
        m.set(0, 10, Some(Loc::Fast(100)));
        m.set(3, 1, Some(Loc::Fast(7)));
        let moved = m.relocate(0, 10, Loc::Fast(100), Loc::Cap { seg: 2, block: 0 });
        assert_eq!(moved, 9);
        assert_eq!(m.get(3), Some(Loc::Fast(7)));
        assert_eq!(m.get(4), Some(Loc::Cap { seg: 2, block: 4 }));
    }
}
