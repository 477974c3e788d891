//! The read cache: clean copies of capacity-tier blocks kept in the write log's area.
//!
//! A promoted copy is a log record of kind `Cache` (its layer field holds the segment, its
//! offset the first block) holding the data of capacity blocks, keyed by where they live on the capacity tier (segment, block). Snapshots and clones that
//! share a block share its cached copy. The copy is clean: nothing is destaged from it, replay
//! ignores it (the cache starts empty after a restart), and losing it costs a miss.
//!
//! Space: cache records take log space like any record and give it back when the log tail
//! passes them. Their share of the log is bounded by `EngineConfig::read_cache_ratio`; the
//! write buffer's fill marks apply to the rest. Eviction is a clock over the log: each copy counts
//! its reads; when the tail reaches a copy read since it was written (recency), it is written
//! again at the head (one fast-tier write, no capacity-tier write) with its count halved, so
//! a copy read often (heat) survives several passes without reads; while the cache is below
//! its share, an unread copy also survives a few passes; otherwise it is dropped.
//!
//! A segment's blocks are cached under the segment's generation, which changes each time the
//! segment is allocated: a copy of a segment reused since is never served.
//!
//! Promotion needs evidence: `promote_after_reads` reads of a 64 KiB region within
//! `promote_window_s`, not counting reads that continue a sequential stream longer than
//! `promote_sequential_cutoff_bytes`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::policy::{Policy, PROMOTE_REGION_BLOCKS};

#[derive(Debug, Clone, Copy)]
pub struct CacheEntry {
    /// Log block holding the copy.
    pub fast: u64,
    /// The segment's generation when the block was read.
    pub gen: u32,
    /// Reads since it was last written (halved at each pass of the tail): heat and recency.
    pub hits: u8,
    /// Passes of the log tail since its last read.
    pub idle_passes: u8,
    /// The volume whose figures counted the copy when the cache took it: its eviction is
    /// counted there too, whichever volume's copy holds the entry by then (a clone and its
    /// origin read the same capacity blocks).
    pub vol: u32,
}

/// Where a copy the log has made durable lies, and what it is: `fast..` holds blocks read
/// under segment generation `gen`, counted for volume `vol`; `again`: written again at the head.
#[derive(Debug, Clone, Copy)]
pub struct NewCopy {
    pub fast: u64,
    pub gen: u32,
    pub vol: u32,
    pub again: bool,
}

/// Cached blocks that left the cache, by the volume that counted them in: (volume, blocks).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Owners(pub Vec<(u32, u64)>);

impl Owners {
    fn add(&mut self, vol: u32) {
        match self.0.last_mut() {
            Some((v, n)) if *v == vol => *n += 1,
            _ => self.0.push((vol, 1)),
        }
    }

    pub fn total(&self) -> u64 {
        self.0.iter().map(|&(_, n)| n).sum()
    }
}

/// The most passes of the log tail an unread copy survives (when the cache has room). More
/// lets the cache fill more of its share, but every pass writes each kept copy again and a
/// fuller log makes host writes wait: 64 gave higher hit ratios for a minute or two, then
/// host write latency ~100x worse (docs/BENCHMARKS.md, tiering).
pub const MAX_IDLE_PASSES: u8 = 16;
/// Passes an unread copy survives when a cache starts.
const START_IDLE_PASSES: f64 = 4.0;

pub struct ReadCache {
    entries: HashMap<(u32, u32), CacheEntry>,
    /// Generation of every segment (shared with the segment table, which bumps it).
    pub seg_gen: Arc<Vec<AtomicU32>>,
    /// Read counts of recently read regions: (layer, region) -> (reads, window start ms).
    candidates: HashMap<(u32, u64), (u32, u64)>,
    max_candidates: usize,
    /// Passes of the log tail an unread copy survives now: raised while the cache is below its
    /// share, lowered when it is at it (see `adapt`).
    idle_limit: f64,
}

impl ReadCache {
    pub fn new(seg_gen: Arc<Vec<AtomicU32>>, log_blocks: u64) -> ReadCache {
        ReadCache {
            entries: HashMap::new(),
            seg_gen,
            candidates: HashMap::new(),
            // One candidate per log block: the misses of several minutes fit, so the window
            // holds (a smaller table would expire counts long before the window ends).
            max_candidates: (log_blocks as usize).clamp(4096, 1 << 20),
            idle_limit: START_IDLE_PASSES,
        }
    }

    pub fn gen_of(&self, seg: u32) -> u32 {
        self.seg_gen
            .get(seg as usize)
            .map_or(u32::MAX, |g| g.load(Ordering::Acquire))
    }

    /// The log block holding a valid copy of capacity block (seg, block), marking it read.
    pub fn lookup(&mut self, seg: u32, block: u32) -> Option<u64> {
        let gen = self.gen_of(seg);
        let e = self.entries.get_mut(&(seg, block))?;
        if e.gen != gen {
            return None;
        }
        e.hits = e.hits.saturating_add(1);
        Some(e.fast)
    }

    /// How many of the log blocks `fast..fast+n` hold the current, valid copies of blocks
    /// `block..` of `seg` (a look that marks nothing read).
    pub fn current(&self, seg: u32, block: u32, n: u32, fast: u64) -> u64 {
        let gen = self.gen_of(seg);
        (0..n)
            .filter(|&i| {
                self.entries
                    .get(&(seg, block + i))
                    .is_some_and(|e| e.fast == fast + u64::from(i) && e.gen == gen)
            })
            .count() as u64
    }

    /// Records copies now durable at `at.fast..` of blocks `block..` of `seg` read under
    /// `at.gen`, new entries counted for volume `at.vol`. Returns how many became new entries, and the
    /// stale entries (copies of the segment before it was reused) some of them replaced, by
    /// the volume that counted them; nothing when the segment was reused meanwhile. A copy of
    /// a block already cached (another volume read it too, or the copy was written again at
    /// the head) only moves that entry: it keeps its history and its volume. A copy written
    /// again (`at.again`) never brings back an entry forgotten meanwhile.
    pub fn insert(&mut self, seg: u32, block: u32, n: u32, at: NewCopy) -> (u64, Owners) {
        let NewCopy {
            fast,
            gen,
            vol,
            again,
        } = at;
        let mut replaced = Owners::default();
        if self.gen_of(seg) != gen {
            return (0, replaced);
        }
        let mut fresh = 0;
        for i in 0..n {
            let copy = CacheEntry {
                fast: fast + u64::from(i),
                gen,
                hits: 0,
                idle_passes: 0,
                vol,
            };
            match self.entries.get_mut(&(seg, block + i)) {
                Some(e) if e.gen == gen => e.fast = copy.fast,
                Some(_) | None if again => {}
                Some(e) => {
                    replaced.add(e.vol);
                    *e = copy;
                    fresh += 1;
                }
                None => {
                    self.entries.insert((seg, block + i), copy);
                    fresh += 1;
                }
            }
        }
        (fresh, replaced)
    }

    /// The log blocks `fast..fast+n` holding copies of (seg, block..) are being reused:
    /// forgets the copies that still live there. Returns them by the volume that counted them.
    pub fn forget(&mut self, seg: u32, block: u32, n: u32, fast: u64) -> Owners {
        let mut gone = Owners::default();
        for i in 0..n {
            let key = (seg, block + i);
            if let Some(e) = self.entries.get(&key).copied() {
                if e.fast == fast + u64::from(i) {
                    self.entries.remove(&key);
                    gone.add(e.vol);
                }
            }
        }
        gone
    }

    /// Whether the copy at `fast` of (seg, block), which the log tail is about to pass, is
    /// worth writing again at the head: it is the current, valid copy, and it was read since
    /// the last pass (its hits are halved: a copy read often survives several passes without
    /// reads), or it has gone unread for fewer passes than the cache keeps such copies now
    /// (never when `keep_idle` is false: the write buffer needs the room).
    pub fn take_second_chance(&mut self, seg: u32, block: u32, fast: u64, keep_idle: bool) -> bool {
        let gen = self.gen_of(seg);
        let limit = if keep_idle { self.idle_limit as u8 } else { 0 };
        match self.entries.get_mut(&(seg, block)) {
            Some(e) if e.fast == fast && e.gen == gen && e.hits > 0 => {
                e.hits /= 2;
                e.idle_passes = 0;
                true
            }
            Some(e) if e.fast == fast && e.gen == gen && e.idle_passes < limit => {
                e.idle_passes += 1;
                true
            }
            _ => false,
        }
    }

    /// Adapts how many passes an unread copy survives to how full the cache is (`fill`: the
    /// blocks it holds over its share): more while it has room, fewer once it is at its share.
    /// The copies dropped are then the ones unread longest, so the cache behaves like
    /// least-recently-used over its whole share rather than over one pass of the log.
    pub fn adapt(&mut self, fill: f64) {
        if fill > 0.95 {
            self.idle_limit = (self.idle_limit - 0.25).max(0.0);
        } else if fill < 0.85 {
            self.idle_limit = (self.idle_limit + 0.25).min(f64::from(MAX_IDLE_PASSES));
        }
    }

    /// Cached blocks (valid or not yet found stale).
    pub fn entries(&self) -> u64 {
        self.entries.len() as u64
    }

    /// Counts a read of `layer`'s blocks `lba..lba+n` that missed the fast tier; returns the
    /// parts of it (first block, blocks) whose 64 KiB regions the evidence now says to promote:
    /// a region is promoted once it has been read `promote_after_reads` times, not because a
    /// read that reached it also reached another region that qualifies. `sequential_bytes` is
    /// how long the sequential stream this read continues already is. `counted`: the last
    /// region a host read counted (one read's parts come in block order, and a region split
    /// between two parts counts once; a read of several parts passes the same cell).
    #[allow(clippy::too_many_arguments)]
    pub fn note_miss(
        &mut self,
        p: &Policy,
        layer: u32,
        lba: u64,
        n: u64,
        sequential_bytes: u64,
        now_ms: u64,
        counted: &mut Option<u64>,
    ) -> Vec<(u64, u64)> {
        if p.promote_after_reads == 0 || n == 0 {
            return Vec::new();
        }
        if p.promote_sequential_cutoff_bytes > 0
            && sequential_bytes >= p.promote_sequential_cutoff_bytes
        {
            return Vec::new();
        }
        if p.promote_after_reads == 1 {
            return vec![(lba, n)];
        }
        let window_ms = p.promote_window_s.saturating_mul(1000);
        let mut promote: Vec<(u64, u64)> = Vec::new();
        for region in lba / PROMOTE_REGION_BLOCKS..=(lba + n - 1) / PROMOTE_REGION_BLOCKS {
            if *counted == Some(region) {
                continue;
            }
            *counted = Some(region);
            if self.candidates.len() >= self.max_candidates
                && !self.candidates.contains_key(&(layer, region))
            {
                self.expire(now_ms, window_ms);
                if self.candidates.len() >= self.max_candidates {
                    continue;
                }
            }
            let c = self
                .candidates
                .entry((layer, region))
                .or_insert((0, now_ms));
            if now_ms.saturating_sub(c.1) > window_ms {
                *c = (0, now_ms);
            }
            c.0 += 1;
            if c.0 >= p.promote_after_reads {
                self.candidates.remove(&(layer, region));
                // The region's part of this read, joined to the part before when adjacent.
                let from = (region * PROMOTE_REGION_BLOCKS).max(lba);
                let to = ((region + 1) * PROMOTE_REGION_BLOCKS).min(lba + n);
                match promote.last_mut() {
                    Some((s, len)) if *s + *len == from => *len += to - from,
                    _ => promote.push((from, to - from)),
                }
            }
        }
        promote
    }

    /// Drops the read counts whose window has passed (the oldest half when none has).
    fn expire(&mut self, now_ms: u64, window_ms: u64) {
        self.candidates
            .retain(|_, c| now_ms.saturating_sub(c.1) <= window_ms);
        if self.candidates.len() >= self.max_candidates {
            let mut starts: Vec<u64> = self.candidates.values().map(|c| c.1).collect();
            starts.sort_unstable();
            let cut = starts[starts.len() / 2];
            self.candidates.retain(|_, c| c.1 > cut);
        }
    }
}

/// One bit per log block: read by a host since it was written. When the destager moves such
/// a block to the capacity tier, it keeps a clean copy of it in the read cache (the read is
/// the evidence; the copy costs a fast-tier write and spares the misses that would otherwise
/// promote it again).
pub struct ReadMarks {
    words: Vec<AtomicU64>,
    blocks: u64,
}

impl ReadMarks {
    pub fn new(log_blocks: u64) -> ReadMarks {
        ReadMarks {
            words: (0..log_blocks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            blocks: log_blocks,
        }
    }

    fn word(&self, b: u64) -> Option<(&AtomicU64, u64)> {
        (b < self.blocks).then(|| (&self.words[(b / 64) as usize], 1 << (b % 64)))
    }

    pub fn mark(&self, first: u64, n: u64) {
        for (w, bit) in (first..first + n).filter_map(|b| self.word(b)) {
            w.fetch_or(bit, Ordering::Relaxed);
        }
    }

    pub fn clear(&self, first: u64, n: u64) {
        for (w, bit) in (first..first + n).filter_map(|b| self.word(b)) {
            w.fetch_and(!bit, Ordering::Relaxed);
        }
    }

    pub fn is_marked(&self, b: u64) -> bool {
        self.word(b)
            .is_some_and(|(w, bit)| w.load(Ordering::Relaxed) & bit != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An insertion for volume 7: (new entries, stale entries replaced).
    fn ins(
        c: &mut ReadCache,
        seg: u32,
        block: u32,
        n: u32,
        fast: u64,
        gen: u32,
        again: bool,
    ) -> (u64, u64) {
        let at = NewCopy {
            fast,
            gen,
            vol: 7,
            again,
        };
        let (fresh, replaced) = c.insert(seg, block, n, at);
        (fresh, replaced.total())
    }

    fn cache() -> ReadCache {
        ReadCache::new(
            Arc::new((0..4).map(|_| AtomicU32::new(0)).collect()),
            1 << 16,
        )
    }

    #[test]
    fn read_marks_are_per_block() {
        let m = ReadMarks::new(130);
        m.mark(62, 4);
        assert!(!m.is_marked(61) && m.is_marked(62) && m.is_marked(65) && !m.is_marked(66));
        m.clear(63, 2);
        assert!(m.is_marked(62) && !m.is_marked(63) && !m.is_marked(64) && m.is_marked(65));
        m.mark(129, 5); // past the end: ignored
        assert!(m.is_marked(129) && !m.is_marked(130));
    }

    #[test]
    fn copies_of_reused_segments_are_never_served() {
        let mut c = cache();
        assert_eq!(ins(&mut c, 1, 10, 2, 500, 0, false), (2, 0));
        assert_eq!(c.lookup(1, 11), Some(501));
        c.seg_gen[1].fetch_add(1, Ordering::AcqRel);
        assert_eq!(c.lookup(1, 11), None);
        // A copy read before the reuse is refused on insertion too.
        assert_eq!(ins(&mut c, 1, 20, 1, 600, 0, false), (0, 0));
        // A copy read since takes the stale entry's place: one new entry, one stale one gone.
        assert_eq!(ins(&mut c, 1, 11, 1, 700, 1, false), (1, 1));
        assert_eq!(c.lookup(1, 11), Some(700));
        assert_eq!(c.entries(), 2);
    }

    /// A block two volumes (a clone and its origin) promoted is one entry, and its eviction
    /// counts for the volume that counted it in, whichever copy the tail passes.
    #[test]
    fn a_copy_leaves_under_the_volume_it_came_in_under() {
        let mut c = cache();
        let at = |fast, gen, vol| NewCopy {
            fast,
            gen,
            vol,
            again: false,
        };
        assert_eq!(c.insert(1, 4, 2, at(100, 0, 3)).0, 2);
        assert_eq!(c.insert(1, 4, 1, at(200, 0, 5)).0, 0, "already cached");
        assert_eq!(c.forget(1, 4, 2, 100), Owners(vec![(3, 1)]));
        assert_eq!(c.forget(1, 4, 1, 200), Owners(vec![(3, 1)]));
        assert_eq!(c.insert(2, 0, 1, at(300, 0, 3)).0, 1);
        c.seg_gen[2].fetch_add(1, Ordering::AcqRel);
        let (fresh, replaced) = c.insert(2, 0, 1, at(400, 1, 5));
        assert_eq!(
            (fresh, replaced),
            (1, Owners(vec![(3, 1)])),
            "a stale entry replaced"
        );
        assert_eq!(c.forget(2, 0, 1, 400), Owners(vec![(5, 1)]));
    }

    #[test]
    fn the_tail_forgets_only_the_copy_it_passes() {
        let mut c = cache();
        assert_eq!(ins(&mut c, 2, 0, 1, 100, 0, false), (1, 0));
        // Written again at the head (second chance) before the tail passed the old copy: the
        // same entry, not a new one.
        assert_eq!(ins(&mut c, 2, 0, 1, 900, 0, true), (0, 0));
        assert_eq!(c.forget(2, 0, 1, 100).total(), 0);
        assert_eq!(c.lookup(2, 0), Some(900));
        c.adapt(1.0);
        c.adapt(1.0);
        c.adapt(1.0);
        c.adapt(1.0);
        c.adapt(1.0); // a full cache: the unread-pass allowance drops (4 -> 2.75)
        assert!(
            c.take_second_chance(2, 0, 900, true),
            "read once: one more pass"
        );
        assert!(
            c.take_second_chance(2, 0, 900, true),
            "unread: 1 of 2 passes"
        );
        assert!(
            c.take_second_chance(2, 0, 900, true),
            "unread: 2 of 2 passes"
        );
        assert!(
            !c.take_second_chance(2, 0, 900, true),
            "unread beyond the allowance"
        );
        // A cache with room keeps unread copies longer, and a copy's history survives being
        // written again.
        for _ in 0..1000 {
            c.adapt(0.5);
        }
        c.lookup(2, 0);
        ins(&mut c, 2, 0, 1, 950, 0, true);
        assert!(
            c.take_second_chance(2, 0, 950, true),
            "the read before the rewrite was lost"
        );
        let kept = (0..1000)
            .take_while(|_| c.take_second_chance(2, 0, 950, true))
            .count();
        assert_eq!(kept, MAX_IDLE_PASSES as usize);
        // With the write buffer under pressure an unread copy gets no pass; a read one still does.
        ins(&mut c, 2, 0, 1, 950, 0, true);
        assert!(
            !c.take_second_chance(2, 0, 950, false),
            "unread, under pressure"
        );
        c.lookup(2, 0);
        assert!(
            c.take_second_chance(2, 0, 950, false),
            "read since, under pressure"
        );
        assert_eq!(c.forget(2, 0, 1, 900).total(), 0, "moved on since");
        assert_eq!(c.forget(2, 0, 1, 950).total(), 1);
        assert_eq!(c.lookup(2, 0), None);
        // A copy written again for an entry forgotten meanwhile (a damaged read) does not
        // bring it back.
        assert_eq!(ins(&mut c, 2, 0, 1, 990, 0, true), (0, 0));
        assert_eq!(c.entries(), 0);
    }

    #[test]
    fn promotion_needs_repeated_reads_within_the_window_and_skips_streams() {
        let mut c = cache();
        let p = Policy {
            promote_after_reads: 3,
            promote_window_s: 10,
            ..Policy::default()
        };
        // Each call a read of its own (a fresh `counted`).
        let miss = |c: &mut ReadCache, p: &Policy, lba, n, seq, now| {
            c.note_miss(p, 1, lba, n, seq, now, &mut None)
        };
        assert!(miss(&mut c, &p, 0, 1, 0, 0).is_empty());
        assert!(miss(&mut c, &p, 5, 1, 0, 1000).is_empty());
        assert_eq!(
            miss(&mut c, &p, 15, 1, 0, 2000),
            vec![(15, 1)],
            "third read of the 64 KiB region"
        );
        // Reads spread beyond the window start over.
        assert!(miss(&mut c, &p, 32, 1, 0, 0).is_empty());
        assert!(miss(&mut c, &p, 32, 1, 0, 5000).is_empty());
        assert!(miss(&mut c, &p, 32, 1, 0, 20_000).is_empty());
        // A long sequential stream neither counts nor promotes.
        for i in 0..10 {
            assert!(miss(&mut c, &p, 64, 1, 8 << 20, 30_000 + i).is_empty());
        }
        let off = Policy {
            promote_after_reads: 0,
            ..Policy::default()
        };
        assert!(miss(&mut c, &off, 0, 1, 0, 0).is_empty());
    }

    /// A read promotes the regions that have had their reads, not the rest of its span; and
    /// one read split into parts (extents) counts a region the parts share once. (A single
    /// 2 MiB read promoted about 1 MiB: the region where two of its parts met counted twice,
    /// and the whole part went with it.)
    #[test]
    fn a_read_promotes_only_the_regions_read_often_enough() {
        let mut c = cache();
        let p = Policy {
            promote_after_reads: 2,
            promote_window_s: 10,
            ..Policy::default()
        };
        // One read of blocks 0..64 in two parts meeting inside region 1 (blocks 16..32).
        let mut counted = None;
        assert!(c.note_miss(&p, 1, 0, 20, 0, 0, &mut counted).is_empty());
        assert!(c.note_miss(&p, 1, 20, 44, 0, 0, &mut counted).is_empty());
        // A second read of block 40 (region 2) promotes region 2's part of it only; a read of
        // blocks 30..50 then promotes regions 1 and 3's parts (their second read), not 2's.
        assert_eq!(c.note_miss(&p, 1, 40, 1, 0, 1, &mut None), vec![(40, 1)]);
        assert_eq!(
            c.note_miss(&p, 1, 30, 20, 0, 2, &mut None),
            vec![(30, 2), (48, 2)]
        );
    }
}
