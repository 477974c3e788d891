//! What one 4 KiB block holds, as a content id: 0 for zeros the engine stores as a hole (never
//! written, or zeroed or trimmed whole), a write's token for a block that write filled whole,
//! or an interned mix of byte ranges from several writes (unaligned writes, zeroes and trims
//! leave those: the daemon reads, patches and writes the block again).
use std::collections::HashMap;
use std::sync::Mutex;

use super::{fill_blocks, BLOCK_BYTES, TOKEN_UID_SHIFT};

const BLOCK: usize = BLOCK_BYTES as usize;
/// Marks an interned mix; tokens never reach it (their volume number is small).
pub const MIX_BIT: u64 = 1 << 63;

/// Bytes `start..end` of a block come from write `token` (0: zeros written as data).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    pub start: u16,
    pub end: u16,
    pub token: u64,
}

#[derive(Default)]
struct Mixes {
    by_id: Vec<Vec<Piece>>,
    ids: HashMap<Vec<Piece>, u64>,
}

static MIXES: Mutex<Option<Mixes>> = Mutex::new(None);

fn intern(pieces: Vec<Piece>) -> u64 {
    let mut guard = MIXES.lock().expect("mixes");
    let mixes = guard.get_or_insert_with(Mixes::default);
    if let Some(&id) = mixes.ids.get(&pieces) {
        return id;
    }
    let id = MIX_BIT | mixes.by_id.len() as u64;
    mixes.by_id.push(pieces.clone());
    mixes.ids.insert(pieces, id);
    id
}

/// The byte ranges of a block's content, in order, covering it whole.
pub fn pieces(id: u64) -> Vec<Piece> {
    if id & MIX_BIT == 0 {
        return vec![Piece {
            start: 0,
            end: BLOCK as u16,
            token: id,
        }];
    }
    let guard = MIXES.lock().expect("mixes");
    let mixes = guard.as_ref().expect("a mix id before any mix");
    mixes.by_id[(id & !MIX_BIT) as usize].clone()
}

/// The content after bytes `start..end` of a block holding `id` were written by `token`
/// (0: zeros). A whole block takes the token (a whole-block zero is a hole again).
pub fn patch(id: u64, start: usize, end: usize, token: u64) -> u64 {
    assert!(start < end && end <= BLOCK, "patch {start}..{end}");
    if start == 0 && end == BLOCK {
        return token;
    }
    let mut out: Vec<Piece> = Vec::new();
    let mut push = |p: Piece| match out.last_mut() {
        _ if p.start >= p.end => {}
        Some(last) if last.token == p.token && last.end == p.start => last.end = p.end,
        _ => out.push(p),
    };
    let (start, end) = (start as u16, end as u16);
    for p in pieces(id) {
        push(Piece {
            end: p.end.min(start),
            ..p
        });
        if p.start <= start && start < p.end {
            push(Piece { start, end, token });
        }
        push(Piece {
            start: p.start.max(end),
            ..p
        });
    }
    match out[..] {
        [Piece { token, .. }] if token != 0 => token,
        _ => intern(out),
    }
}

/// The bytes a block at `lba` holding `id` reads as.
pub fn expected(id: u64, lba: u64) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK];
    for p in pieces(id).iter().filter(|p| p.token != 0) {
        let (start, end) = (p.start as usize, p.end as usize);
        out[start..end].copy_from_slice(&fill_blocks(p.token, lba, 1)[start..end]);
    }
    out
}

/// Whether bytes `start..end` of a block holding `id` read as zeros.
pub fn zeros_in(id: u64, start: usize, end: usize) -> bool {
    pieces(id)
        .iter()
        .all(|p| p.token == 0 || p.end as usize <= start || end <= p.start as usize)
}

pub fn describe(id: u64) -> String {
    let token = |t: u64| match t {
        0 => "zeros".to_string(),
        t => format!("write {t:#x} of volume #{}", t >> TOKEN_UID_SHIFT),
    };
    if id & MIX_BIT == 0 {
        return token(id);
    }
    let parts: Vec<String> = pieces(id)
        .iter()
        .map(|p| format!("{}..{}: {}", p.start, p.end, token(p.token)))
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Says where a block read differs from the content it should hold.
pub fn explain_mismatch(lba: u64, got: &[u8], want: u64) -> String {
    let expect = expected(want, lba);
    let first = (0..BLOCK).find(|&i| got[i] != expect[i]).unwrap_or(0);
    let last = (0..BLOCK).rev().find(|&i| got[i] != expect[i]).unwrap_or(0);
    let zero_bytes = got.iter().filter(|&&b| b == 0).count();
    let holds = match super::decode_block(lba, got) {
        Ok(token) => describe(token),
        Err(_) => format!("no one write's whole block ({zero_bytes} zero bytes)"),
    };
    format!(
        "block {lba} differs from {} at bytes {first}..={last}; read whole it is {holds}",
        describe(want)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_split_merge_and_collapse() {
        let a = patch(7, 100, 200, 9);
        assert_eq!(
            pieces(a),
            vec![
                Piece {
                    start: 0,
                    end: 100,
                    token: 7
                },
                Piece {
                    start: 100,
                    end: 200,
                    token: 9
                },
                Piece {
                    start: 200,
                    end: 4096,
                    token: 7
                },
            ]
        );
        assert_eq!(patch(a, 50, 300, 7), 7);
        assert_eq!(patch(a, 0, 4096, 0), 0);
        assert_ne!(patch(0, 0, 10, 0), 0, "zeros written as data are no hole");
        assert!(zeros_in(patch(a, 0, 150, 0), 0, 150));
        assert!(!zeros_in(patch(a, 0, 150, 0), 0, 151));
        let e = expected(a, 3);
        assert_eq!(e[..100], expected(7, 3)[..100]);
        assert_eq!(e[100..200], expected(9, 3)[100..200]);
    }
}
