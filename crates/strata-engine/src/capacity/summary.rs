//! A data segment's summary from its copies (docs/FORMAT.md §3.5): each part (the header and
//! entries region, each crc block in use) from a copy that holds it as the segment's current
//! use wrote it.
//!
//! A part that passes its own checks is not enough. The checks tie a part to its segment and
//! its place, not to the segment's use: a copy whose last write the device lost (or a write
//! that never reached it) still holds an earlier use's summary, and that checks. So a header
//! is held against what this opening knows of the segment's use (the segment sequence number
//! of a segment it wrote, or whose copies it has told apart since; the blocks written that the
//! segment table records), then against the other copy's (a later use of a segment has a
//! higher segment sequence number, `open.rs`); a crc block is taken only from a copy whose
//! header is not another use's, and two that both check but differ are held against the data
//! blocks they describe.

use std::ops::Range;

use super::*;

/// What one copy holds of one part of a summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holds {
    /// The part as the segment's current use wrote it.
    Current,
    /// Unreadable, or fails its own checks.
    Damaged,
    /// Passes its own checks, but is not the current use's part, or may not be: why.
    Other(String),
}

/// One part of a summary in every copy.
#[derive(Debug, Clone)]
pub struct Part {
    /// "header", or "crc block k".
    pub what: String,
    /// Its blocks within a copy.
    pub blocks: Range<u32>,
    /// What each copy holds.
    pub holds: Vec<Holds>,
    /// The copy to take the part from; None when none holds it as the current use wrote it,
    /// or which one does cannot be told.
    pub current: Option<usize>,
}

/// A segment's summary copies, weighed part by part.
pub struct Assessed {
    pub copies: Vec<SummaryCopy>,
    /// The header first, then each crc block in use (none when how many blocks the segment
    /// holds is known neither from a header nor from the segment table).
    pub parts: Vec<Part>,
    /// The summary, when every part has a current copy.
    pub summary: Option<SegmentSummary>,
    /// Why there is no summary (None when there is one).
    pub missing: Option<Missing>,
}

/// Why no summary can be had from a segment's copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// Some part is damaged or unreadable in every copy.
    Damaged,
    /// Every copy whose header checks holds an earlier use of the segment: numbered below the
    /// floor of the opening that sealed the segment (what open knows of a recent segment), so
    /// every write of the current use to those copies was lost. The copies so found, by
    /// number; the others are damaged.
    EarlierUse { copies: Vec<usize> },
    /// Copies that check differ, and nothing tells which holds the current use.
    Undecided,
}

impl Assessed {
    /// Whether some copy holds some part other than the current use wrote it (a scrub would
    /// mend it, or report it).
    pub fn imperfect(&self) -> bool {
        self.parts
            .iter()
            .any(|p| p.holds.iter().any(|h| *h != Holds::Current))
    }

    /// What is wrong with each copy's parts, for a log line.
    fn why(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in &self.parts {
            for (c, h) in p.holds.iter().enumerate() {
                let copy = copy_name(c as u32);
                match h {
                    Holds::Current => {}
                    Holds::Damaged => out.push(format!("copy {copy}: {} damaged", p.what)),
                    Holds::Other(why) => out.push(format!("copy {copy}: {} {why}", p.what)),
                }
            }
        }
        out
    }
}

/// What this opening knows of a segment's current use.
#[derive(Debug, Clone, Copy, Default)]
struct Known {
    segment_seq: Option<u64>,
    used: Option<u32>,
    /// Its segment sequence number is this or higher (0: nothing known).
    seq_floor: u64,
}

fn known_use(sh: &Shared, seg: u32) -> Known {
    let segs = sh.segs.lock();
    let s = segs.segs[seg as usize];
    match s.state {
        SegState::Sealed => Known {
            segment_seq: (s.segment_seq != 0).then_some(s.segment_seq),
            used: Some(s.used_blocks),
            seq_floor: 0,
        },
        // Only recovery reads the summary of a free segment: one the checkpoint names as
        // recent, sealed by the opening that wrote the checkpoint.
        SegState::Free => Known {
            seq_floor: segs.recent_seq_floor,
            ..Known::default()
        },
        _ => Known::default(),
    }
}

/// Notes the segment sequence number of a sealed segment's current use, once told.
fn note_use(sh: &Shared, seg: u32, head: &SegmentSummary) {
    let mut segs = sh.segs.lock();
    let s = &mut segs.segs[seg as usize];
    if s.state == SegState::Sealed && s.segment_seq == 0 && s.used_blocks == head.data_blocks_used {
        s.segment_seq = head.segment_seq;
    }
}

/// The bytes of `blocks` in a copy.
fn bytes_of<'a>(c: &'a SummaryCopy, blocks: &Range<u32>) -> &'a [u8] {
    &c.bytes[blocks.start as usize * BLOCK..blocks.end as usize * BLOCK]
}

fn readable(c: &SummaryCopy, blocks: &Range<u32>) -> bool {
    !c.unreadable.iter().any(|k| blocks.contains(k))
}

/// Reads every summary copy of segment `seg` and weighs them part by part. An error only when
/// no block of any copy could be read (a device error, not damage).
pub fn assess(sh: &Shared, seg: u32) -> Result<Assessed, EngineError> {
    let (group, geo) = (&sh.layout.group, &sh.layout.geo);
    let mut copies: Vec<SummaryCopy> = (0..geo.summary_copies)
        .map(|c| read_summary_copy(sh, seg, c))
        .collect();
    let all_blocks = geo.summary_blocks as usize;
    if copies.iter().all(|c| c.unreadable.len() == all_blocks) {
        if let Some(e) = copies.iter_mut().find_map(|c| c.error.take()) {
            return Err(e.into());
        }
    }
    let head_blocks = geo.crc_blocks..geo.summary_blocks;
    let heads: Vec<Option<SegmentSummary>> = copies
        .iter()
        .map(|c| {
            readable(c, &head_blocks)
                .then(|| SegmentSummary::decode_head(&c.bytes, group, geo, seg))
                .flatten()
        })
        .collect();
    let known = known_use(sh, seg);
    let (mut head, confirmed) = head_part(&copies, &heads, known, head_blocks);
    let used = head
        .current
        .and_then(|c| heads[c].as_ref())
        .map(|h| h.data_blocks_used)
        .or(known.used);
    let mut parts = Vec::new();
    let mut crcs = Vec::new();
    for k in 0..used.map_or(0, crc_blocks_used) {
        let (part, value) = crc_part(sh, seg, k, used.unwrap_or(0), &copies, &head);
        // A header that only one copy holds, which nothing else backs, is not taken when its
        // own copy's crc blocks lose to the other copy's on the data, or differ from them
        // where the data cannot tell: that copy may be wholly an earlier use's, with the
        // current use's header damaged in the other.
        if let (false, Some(h)) = (confirmed, head.current) {
            if let Holds::Other(why) = &part.holds[h] {
                head.holds[h] = Holds::Other(format!(
                    "is the only one that checks, and its copy's {} {why}: it may be of an \
                     earlier use of the segment",
                    part.what
                ));
                head.current = None;
            }
        }
        crcs.push(value);
        parts.push(part);
    }
    let summary = head.current.and_then(|h| {
        let mut s = heads[h].clone()?;
        let used = s.data_blocks_used as usize;
        for c in &crcs {
            let c = c.as_ref()?;
            let take = (used - s.block_crcs.len()).min(CRCS_PER_BLOCK);
            s.block_crcs.extend_from_slice(&c[..take]);
        }
        Some(s)
    });
    if let (true, Some(s)) = (confirmed, &summary) {
        note_use(sh, seg, s);
    }
    if let Some(s) = &summary {
        refresh_crc_cache(sh, seg, s, &parts);
    }
    parts.insert(0, head);
    let missing = summary
        .is_none()
        .then(|| why_missing(&heads, known.seq_floor, &parts));
    Ok(Assessed {
        copies,
        parts,
        summary,
        missing,
    })
}

/// Why no summary was had from copies whose headers decode as `heads` (None where damaged),
/// weighed into `parts` (the header first), the opening that sealed the segment numbering
/// from `floor` (0: not known).
fn why_missing(heads: &[Option<SegmentSummary>], floor: u64, parts: &[Part]) -> Missing {
    let checking: Vec<usize> = (0..heads.len()).filter(|&c| heads[c].is_some()).collect();
    let earlier = |c: &usize| heads[*c].as_ref().is_some_and(|h| h.segment_seq < floor);
    let no_header = parts.first().is_none_or(|p| p.current.is_none());
    if no_header && !checking.is_empty() && checking.iter().all(earlier) {
        return Missing::EarlierUse { copies: checking };
    }
    match parts.iter().find(|p| p.current.is_none()) {
        Some(p) if p.holds.iter().all(|h| *h == Holds::Damaged) => Missing::Damaged,
        _ => Missing::Undecided,
    }
}

/// Crc blocks some copy holds other than the segment's current use wrote them (`parts`,
/// crc block k at k): the crc-block cache may hold that copy's (a data read takes copy A's
/// when it checks, and keeps it when the blocks it reads match it: the same content in both
/// uses, or a data write lost too), so it takes the current ones.
fn refresh_crc_cache(sh: &Shared, seg: u32, s: &SegmentSummary, parts: &[Part]) {
    let mut cache = sh.crc_blocks.lock();
    for (k, part) in parts.iter().enumerate() {
        if part.holds.iter().all(|h| *h == Holds::Current) {
            continue;
        }
        let from = k * CRCS_PER_BLOCK;
        let to = (from + CRCS_PER_BLOCK).min(s.block_crcs.len());
        cache.insert((seg, k as u32), Arc::new(s.block_crcs[from..to].to_vec()));
    }
}

/// The header part: among the headers that check and fit what is known of the segment's use,
/// the latest use's. Also whether anything backs the choice (what this opening knows of the
/// use, another copy's header the same, or one of an earlier use beside it).
fn head_part(
    copies: &[SummaryCopy],
    heads: &[Option<SegmentSummary>],
    known: Known,
    blocks: Range<u32>,
) -> (Part, bool) {
    let unfit = |h: &SegmentSummary| -> Option<String> {
        if h.segment_seq < known.seq_floor {
            return Some(format!(
                "is of an earlier use of the segment (segment sequence number {}, below {}, \
                 where the opening that sealed the segment numbered from)",
                h.segment_seq, known.seq_floor
            ));
        }
        if let Some(q) = known.segment_seq.filter(|&q| q != h.segment_seq) {
            return Some(format!(
                "is of another use of the segment (segment sequence number {}, the segment's \
                 is {q})",
                h.segment_seq
            ));
        }
        let u = known.used.filter(|&u| u != h.data_blocks_used)?;
        Some(format!(
            "is of another use of the segment ({} blocks written, the segment table says {u})",
            h.data_blocks_used
        ))
    };
    let seq_of = |c: usize| heads[c].as_ref().map_or(0, |h| h.segment_seq);
    let fitting: Vec<usize> = (0..heads.len())
        .filter(|&c| heads[c].as_ref().is_some_and(|h| unfit(h).is_none()))
        .collect();
    // The first copy of the highest segment sequence number.
    let best = fitting
        .iter()
        .copied()
        .max_by_key(|&c| (seq_of(c), std::cmp::Reverse(c)));
    let same = |a: usize, b: usize| bytes_of(&copies[a], &blocks) == bytes_of(&copies[b], &blocks);
    let mut current = best;
    let mut holds = Vec::with_capacity(heads.len());
    for (c, h) in heads.iter().enumerate() {
        let Some(h) = h else {
            holds.push(Holds::Damaged);
            continue;
        };
        if let Some(why) = unfit(h) {
            holds.push(Holds::Other(why));
            continue;
        }
        // It fits: `best` is a copy.
        let b = best.unwrap_or(c);
        holds.push(if same(c, b) {
            Holds::Current
        } else if h.segment_seq == seq_of(b) {
            // Two uses never share a number (open.rs): nothing tells these apart.
            current = None;
            Holds::Other(format!(
                "differs from copy {}'s of the same segment sequence number {}",
                copy_name(b as u32),
                h.segment_seq
            ))
        } else {
            Holds::Other(format!(
                "is of an earlier use of the segment (segment sequence number {}, copy {}'s is \
                 {})",
                h.segment_seq,
                copy_name(b as u32),
                seq_of(b)
            ))
        });
    }
    if current.is_none() {
        if let Some(b) = best {
            if holds[b] == Holds::Current {
                holds[b] = Holds::Other("has a rival of the same segment sequence number".into());
            }
        }
    }
    let backed = known.segment_seq.is_some()
        || holds.iter().filter(|h| **h == Holds::Current).count() > 1
        || holds.iter().any(|h| matches!(h, Holds::Other(_)));
    let part = Part {
        what: "header".into(),
        blocks,
        holds,
        current,
    };
    (part, backed && current.is_some())
}

/// Crc block `k` of a segment holding `used` blocks: from the copies whose header is not
/// another use's; when two of them check but differ, from the one whose crcs the data blocks
/// agree with more (none, on a tie). Also the crcs of the copy chosen. Crc blocks are
/// compared on the crcs of used blocks only: no reader looks past them.
fn crc_part(
    sh: &Shared,
    seg: u32,
    k: u32,
    used: u32,
    copies: &[SummaryCopy],
    head: &Part,
) -> (Part, Option<Vec<u32>>) {
    let blocks = k..k + 1;
    let in_use = (used as usize)
        .saturating_sub(k as usize * CRCS_PER_BLOCK)
        .min(CRCS_PER_BLOCK);
    let decoded: Vec<Option<Vec<u32>>> = copies
        .iter()
        .map(|c| {
            readable(c, &blocks)
                .then(|| decode_crc_block(bytes_of(c, &blocks), seg, k))
                .flatten()
        })
        .collect();
    let other_use = |c: usize| matches!(head.holds[c], Holds::Other(_));
    // The header's copy first.
    let mut eligible: Vec<usize> = (0..copies.len())
        .filter(|&c| decoded[c].is_some() && !other_use(c))
        .collect();
    eligible.sort_by_key(|&c| Some(c) != head.current);
    let same = |a: usize, b: usize| match (&decoded[a], &decoded[b]) {
        (Some(x), Some(y)) => x[..in_use] == y[..in_use],
        _ => false,
    };
    let mut voted = false;
    let current = match eligible.first() {
        None => None,
        Some(&first) if eligible.iter().all(|&c| same(c, first)) => Some(first),
        Some(_) => {
            voted = true;
            vote(sh, seg, k, used, &eligible, &decoded)
        }
    };
    let holds = (0..copies.len())
        .map(|c| match (&decoded[c], current) {
            (None, _) => Holds::Damaged,
            (Some(_), Some(r)) if same(c, r) => Holds::Current,
            (Some(_), _) if other_use(c) => {
                Holds::Other("is of another use of the segment, as its copy's header".into())
            }
            (Some(_), Some(_)) if voted => {
                Holds::Other("disagrees with the data blocks, where the other copy's agrees".into())
            }
            (Some(_), _) => Holds::Other(
                "differs from the other copy's, and the data blocks do not tell which is right"
                    .into(),
            ),
        })
        .collect();
    let value = current.and_then(|r| decoded[r].clone());
    let part = Part {
        what: format!("crc block {k}"),
        blocks,
        holds,
        current,
    };
    (part, value)
}

/// Of crc blocks that differ (`decoded[c]` for each `c` in `candidates`), the one whose crcs
/// more of the data blocks it covers match; None on a tie or when the data cannot be read.
fn vote(
    sh: &Shared,
    seg: u32,
    k: u32,
    used: u32,
    candidates: &[usize],
    decoded: &[Option<Vec<u32>>],
) -> Option<usize> {
    let first = k * CRCS_PER_BLOCK as u32;
    let n = used.saturating_sub(first).min(CRCS_PER_BLOCK as u32);
    if n == 0 {
        return None;
    }
    let mut data = AlignedBuf::new_zeroed(n as usize * BLOCK);
    let (dev, off) = sh.layout.seg_data_byte(seg, first);
    if let Err(e) = sh.caps[dev].read_at(&mut data, off) {
        tracing::warn!(
            segment = seg,
            "cannot read data blocks to weigh crc block {k}: {e}"
        );
        return None;
    }
    let actual: Vec<u32> = data.chunks(BLOCK).map(crc32c::crc32c).collect();
    let agree = |c: usize| {
        decoded[c].as_ref().map_or(0, |crcs| {
            actual.iter().zip(crcs).filter(|(a, b)| a == b).count()
        })
    };
    let scores: Vec<(usize, usize)> = candidates.iter().map(|&c| (agree(c), c)).collect();
    let best = scores.iter().map(|s| s.0).max().unwrap_or(0);
    let mut top = scores.iter().filter(|s| s.0 == best);
    match (top.next(), top.next()) {
        (Some(&(_, c)), None) => Some(c),
        _ => None,
    }
}

/// The summary of segment `seg` from the device, each part from the copy that holds the
/// segment's current use's (module comment). Ok(None) when a part has no such copy; an error
/// when no copy could be read at all. A summary served despite a damaged or stale part is
/// counted and logged (a scrub mends the copy).
pub fn read_summary(sh: &Shared, seg: u32) -> Result<Option<SegmentSummary>, EngineError> {
    Ok(summary_or_missing(sh, seg)?.ok())
}

/// [`read_summary`], saying why when there is no summary.
pub fn summary_or_missing(
    sh: &Shared,
    seg: u32,
) -> Result<Result<SegmentSummary, Missing>, EngineError> {
    let a = assess(sh, seg)?;
    if a.summary.is_none() {
        tracing::warn!(
            segment = seg,
            "no copy holds every part of the segment's summary as its current use wrote it: {}",
            a.why().join("; ")
        );
    } else if a.imperfect() {
        other_copy_served(sh, seg, &a.why());
    }
    match (a.summary, a.missing) {
        (Some(s), _) => Ok(Ok(s)),
        (None, missing) => Ok(Err(missing.unwrap_or(Missing::Undecided))),
    }
}

/// After data blocks `[block, block+n)` failed their crcs (`used`, from the crc-block cache or
/// the first copy that checked): their crcs in the segment's whole summary, weighed copy
/// against copy, when they differ from `used`; the crc blocks they came from then replace
/// the cached ones. None when they do not differ or the summary cannot be had.
pub(super) fn current_crcs(
    sh: &Shared,
    seg: u32,
    block: u32,
    n: u32,
    used: &[u32],
) -> Option<Vec<u32>> {
    // As `load_summary`, but a summary that cannot be had is not counted again: the read
    // counts its mismatch.
    let cached = sh.summaries.lock().get(&seg);
    let s = match cached {
        Some(s) => s,
        None => {
            let s = Arc::new(read_summary(sh, seg).ok()??);
            sh.summaries.lock().insert(seg, s.clone());
            s
        }
    };
    let range = block as usize..(block + n) as usize;
    let current = s.block_crcs.get(range.clone())?;
    if current == used {
        return None;
    }
    let mut cache = sh.crc_blocks.lock();
    for idx in range.start / CRCS_PER_BLOCK..=(range.end - 1) / CRCS_PER_BLOCK {
        let from = idx * CRCS_PER_BLOCK;
        let to = (from + CRCS_PER_BLOCK).min(s.block_crcs.len());
        cache.insert((seg, idx as u32), Arc::new(s.block_crcs[from..to].to_vec()));
    }
    drop(cache);
    other_copy_served(
        sh,
        seg,
        &[format!(
            "crcs of blocks {}..{} differed from the segment's summary",
            range.start, range.end
        )],
    );
    Some(current.to_vec())
}
