//! The on-disk form of index pages (docs/FORMAT.md §3.6): one 4 KiB block per page, a
//! 64-byte header with the page's own address and a crc, then fixed-size entries.
//!
//! Every page is written twice (copies A and B, usually on different devices); each copy
//! names its own address, so a copy found anywhere else is recognised as misplaced.

use crate::format::{check_crc, seal_crc, Reader, Uuid, Writer, BLOCK, FORMAT_VERSION};
use crate::map::Loc;

use super::{Entry, Key, PagePtr};

pub const PAGE_MAGIC: &[u8; 8] = b"STRATAIX";
pub const PAGE_HEADER_BYTES: usize = 64;
/// layer u32, lba u64, len u64, value u64.
pub const LEAF_ENTRY_BYTES: usize = 28;
/// layer u32, lba u64, copy A u64, copy B u64.
pub const INNER_ENTRY_BYTES: usize = 28;
/// state u8, reserved u8 + u16, live u32, used u32, sealed_unix_s u32.
pub const SEGTAB_ENTRY_BYTES: usize = 16;
pub const LEAF_MAX: usize = (BLOCK - PAGE_HEADER_BYTES) / LEAF_ENTRY_BYTES;
pub const INNER_MAX: usize = (BLOCK - PAGE_HEADER_BYTES) / INNER_ENTRY_BYTES;
pub const SEGTAB_PER_PAGE: usize = (BLOCK - PAGE_HEADER_BYTES) / SEGTAB_ENTRY_BYTES;

/// The value a leaf stores for a zero run (no segment can have this index).
const ZERO_VALUE: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PageKind {
    Leaf = 1,
    Inner = 2,
    SegTable = 3,
}

/// A decoded page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageBody {
    Leaf(Vec<Entry>),
    Inner(Vec<(Key, PagePtr)>),
    SegTable(Vec<SegRecord>),
}

/// One segment's usage as the segment table pages store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegRecord {
    /// 0 free, 1 sealed data, 2 sealed or open index pages.
    pub state: u8,
    pub live: u32,
    pub used: u32,
    pub sealed_unix_s: u32,
}

pub fn key_of(layer: u32, lba: u64) -> Key {
    (u128::from(layer) << 64) | u128::from(lba)
}

pub fn split_key(k: Key) -> (u32, u64) {
    ((k >> 64) as u32, k as u64)
}

fn encode_loc(loc: Loc) -> u64 {
    match loc {
        Loc::Cap { seg, block } => (u64::from(seg) << 32) | u64::from(block),
        // Fast locations never reach the capacity tree; a zero is a zero whatever its record.
        Loc::Zero(_) | Loc::Fast(_) => ZERO_VALUE,
    }
}

fn decode_loc(v: u64) -> Loc {
    if v == ZERO_VALUE {
        Loc::Zero(0)
    } else {
        Loc::Cap {
            seg: (v >> 32) as u32,
            block: v as u32,
        }
    }
}

/// Encodes one copy of a page, sealed with its crc, naming `self_addr` as its place.
pub fn encode(body: &PageBody, group: &Uuid, generation: u64, self_addr: u64) -> Vec<u8> {
    let (kind, count) = match body {
        PageBody::Leaf(e) => (PageKind::Leaf, e.len()),
        PageBody::Inner(c) => (PageKind::Inner, c.len()),
        PageBody::SegTable(s) => (PageKind::SegTable, s.len()),
    };
    let mut w = Writer::default();
    w.bytes(PAGE_MAGIC)
        .u32(FORMAT_VERSION)
        .bytes(group)
        .u8(kind as u8)
        .bytes(&[0; 3]);
    w.u32(count as u32).u64(generation).u64(self_addr);
    w.pad_to(PAGE_HEADER_BYTES);
    match body {
        PageBody::Leaf(entries) => {
            for e in entries {
                let (layer, lba) = split_key(e.key);
                w.u32(layer).u64(lba).u64(e.len).u64(encode_loc(e.loc));
            }
        }
        PageBody::Inner(children) => {
            for (k, p) in children {
                let (layer, lba) = split_key(*k);
                w.u32(layer).u64(lba).u64(p.a).u64(p.b);
            }
        }
        PageBody::SegTable(segs) => {
            for s in segs {
                w.u8(s.state)
                    .u8(0)
                    .u16(0)
                    .u32(s.live)
                    .u32(s.used)
                    .u32(s.sealed_unix_s);
            }
        }
    }
    let mut b = w.pad_to(BLOCK).buf.clone();
    seal_crc(&mut b, 60);
    b
}

/// Decodes a page copy read from `self_addr`; None if it is not a valid page of this group
/// written for that place (blank, torn, foreign, misplaced or malformed).
pub fn decode(b: &[u8], group: &Uuid, self_addr: u64) -> Option<(PageBody, u64)> {
    if b.len() < BLOCK || !check_crc(&b[..BLOCK], 60) {
        return None;
    }
    let mut r = Reader::new(b);
    if r.bytes(8).ok()? != PAGE_MAGIC || r.u32().ok()? != FORMAT_VERSION || &r.uuid().ok()? != group
    {
        return None;
    }
    let kind = r.u8().ok()?;
    r.bytes(3).ok()?;
    let count = r.u32().ok()? as usize;
    let generation = r.u64().ok()?;
    if r.u64().ok()? != self_addr {
        return None;
    }
    let mut r = Reader::new(&b[PAGE_HEADER_BYTES..BLOCK]);
    let body = match kind {
        1 if count <= LEAF_MAX => PageBody::Leaf(decode_leaf(&mut r, count)?),
        2 if (1..=INNER_MAX).contains(&count) => PageBody::Inner(decode_inner(&mut r, count)?),
        3 if count <= SEGTAB_PER_PAGE => PageBody::SegTable(decode_segtab(&mut r, count)?),
        _ => return None,
    };
    Some((body, generation))
}

fn decode_leaf(r: &mut Reader<'_>, count: usize) -> Option<Vec<Entry>> {
    let mut out: Vec<Entry> = Vec::with_capacity(count);
    for _ in 0..count {
        let layer = r.u32().ok()?;
        let lba = r.u64().ok()?;
        let len = r.u64().ok()?;
        let loc = decode_loc(r.u64().ok()?);
        let e = Entry {
            key: key_of(layer, lba),
            len,
            loc,
        };
        // Sorted, non-empty, non-overlapping, inside one layer: anything else is damage.
        let bad_order = out.last().is_some_and(|p| p.end() > e.key);
        if len == 0 || lba.checked_add(len).is_none() || bad_order {
            return None;
        }
        out.push(e);
    }
    Some(out)
}

fn decode_inner(r: &mut Reader<'_>, count: usize) -> Option<Vec<(Key, PagePtr)>> {
    let mut out: Vec<(Key, PagePtr)> = Vec::with_capacity(count);
    for i in 0..count {
        let layer = r.u32().ok()?;
        let lba = r.u64().ok()?;
        let p = PagePtr {
            a: r.u64().ok()?,
            b: r.u64().ok()?,
        };
        let k = key_of(layer, lba);
        if i > 0 && out.last().is_some_and(|(pk, _)| *pk >= k) {
            return None;
        }
        out.push((k, p));
    }
    Some(out)
}

fn decode_segtab(r: &mut Reader<'_>, count: usize) -> Option<Vec<SegRecord>> {
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let state = r.u8().ok()?;
        r.bytes(3).ok()?;
        let s = SegRecord {
            state,
            live: r.u32().ok()?,
            used: r.u32().ok()?,
            sealed_unix_s: r.u32().ok()?,
        };
        if state > 2 {
            return None;
        }
        out.push(s);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_and_reject_damage() {
        let g = [3u8; 16];
        let leaf = PageBody::Leaf(vec![
            Entry {
                key: key_of(2, 10),
                len: 5,
                loc: Loc::Cap { seg: 7, block: 100 },
            },
            Entry {
                key: key_of(2, 20),
                len: 1 << 40,
                loc: Loc::Zero(0),
            },
            Entry {
                key: key_of(3, 0),
                len: 1,
                loc: Loc::Cap { seg: 0, block: 0 },
            },
        ]);
        let b = encode(&leaf, &g, 9, 12345);
        assert_eq!(decode(&b, &g, 12345), Some((leaf.clone(), 9)));
        assert_eq!(decode(&b, &g, 12346), None, "a misplaced copy is refused");
        assert_eq!(
            decode(&b, &[4; 16], 12345),
            None,
            "a foreign page is refused"
        );
        let mut torn = b.clone();
        torn[200] ^= 1;
        assert_eq!(decode(&torn, &g, 12345), None);
        let inner = PageBody::Inner(vec![
            (0, PagePtr { a: 1, b: 2 }),
            (key_of(5, 9), PagePtr { a: 3, b: 4 }),
        ]);
        let b = encode(&inner, &g, 1, 7);
        assert_eq!(decode(&b, &g, 7), Some((inner, 1)));
        let st = PageBody::SegTable(vec![
            SegRecord {
                state: 1,
                live: 3,
                used: 4,
                sealed_unix_s: 5
            };
            SEGTAB_PER_PAGE
        ]);
        let b = encode(&st, &g, 1, 8);
        assert_eq!(decode(&b, &g, 8), Some((st, 1)));
    }

    #[test]
    fn capacities_fill_a_block() {
        assert_eq!(LEAF_MAX, 144);
        assert_eq!(INNER_MAX, 144);
        let full = PageBody::Leaf(
            (0..LEAF_MAX as u64)
                .map(|i| Entry {
                    key: key_of(1, i * 2),
                    len: 1,
                    loc: Loc::Zero(0),
                })
                .collect(),
        );
        assert_eq!(encode(&full, &[0; 16], 1, 1).len(), BLOCK);
    }
}
