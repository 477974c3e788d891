//! The destager: moves data from the log to capacity segments under a fill-level controller,
//! and runs garbage collection when free segments run low.
//!
//! Controller: below the low mark it idles. Between the marks it runs a duty cycle set by a PI
//! term on fill (so the rate is a share of the bandwidth the devices really deliver, and rises
//! smoothly with fill). Above the high mark it runs flat out; the log writer then admits new
//! writes at the measured destage bandwidth (see `log.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_device::AlignedBuf;

use crate::capacity::*;
use crate::error::EngineError;
use crate::format::*;
use crate::log::{BatchMeta, RecMeta, WriteReq};
use crossbeam_channel::Sender;
use crate::map::Loc;
use crate::shared::{Counters, Shared, STATE_FAILED};

/// Batches handed to one destage step at most (bounds the memory of a step).
const MAX_BATCHES_PER_STEP: usize = 4096;
/// Stripes one destage step pipelines at most.
const MAX_STRIPES_PER_STEP: usize = 16;
/// Log blocks one stripe reads at most (64 MiB).
const MAX_STEP_READ_BLOCKS: u64 = 16384;

pub struct Destager {
    sh: Arc<Shared>,
    tx: Sender<WriteReq>,
    integral: f64,
    last: Instant,
    gc_backoff_until: Instant,
}

impl Destager {
    pub fn new(sh: Arc<Shared>, tx: Sender<WriteReq>) -> Destager {
        Destager { sh, tx, integral: 0.0, last: Instant::now(), gc_backoff_until: Instant::now() }
    }

    pub fn run(mut self) {
        loop {
            let stop = self.sh.abandon.load(Ordering::Relaxed) || self.sh.destager_stop.load(Ordering::Relaxed);
            if stop || self.sh.state.load(Ordering::Acquire) == STATE_FAILED {
                return;
            }
            let duty = self.duty_cycle();
            if self.gc_needed() {
                if let Err(e) = self.gc_step() {
                    tracing::error!("garbage collection: {e}");
                }
            }
            if duty <= 0.0 {
                self.idle(Duration::from_millis(50));
                continue;
            }
            let started = Instant::now();
            // Flat out, a step pipelines several stripes; paced, one at a time.
            let stripes = if duty >= 1.0 { MAX_STRIPES_PER_STEP } else { 1 };
            match self.step(stripes) {
                Ok(0) => self.idle(Duration::from_millis(20)),
                Ok(_) if duty < 1.0 => {
                    let busy = started.elapsed().as_secs_f64();
                    let pause = busy * (1.0 - duty) / duty;
                    self.idle(Duration::from_secs_f64(pause.min(1.0)));
                }
                Ok(_) => {}
                Err(EngineError::NoSpace) => self.idle(Duration::from_millis(100)),
                Err(e) => {
                    tracing::error!("destage: {e}");
                    self.idle(Duration::from_millis(200));
                }
            }
        }
    }

    fn idle(&self, d: Duration) {
        let mut w = self.sh.destage_wake_lock.lock();
        if !*w {
            self.sh.destage_wake.wait_for(&mut w, d);
        }
        *w = false;
    }

    /// The share of time to spend destaging, 0..=1.
    fn duty_cycle(&mut self) -> f64 {
        let fill = self.sh.log.lock().fill_ratio();
        let (low, high) = (self.sh.cfg.fill_ratio_low, self.sh.cfg.fill_ratio_high);
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64().min(1.0);
        self.last = now;
        if self.sh.drain.load(Ordering::Relaxed) || fill >= high {
            return 1.0;
        }
        if fill < low {
            self.integral = 0.0;
            return 0.0;
        }
        let e = (fill - low) / (high - low);
        self.integral = (self.integral + 0.5 * e * dt).clamp(0.0, 1.0);
        (0.05 + e + self.integral).clamp(0.05, 1.0)
    }

    fn gc_needed(&self) -> bool {
        let segs = self.sh.segs.lock();
        segs.free_count() < gc_trigger(self.sh.caps.len())
    }

    /// Moves the oldest durable batches' live data into stripes of segments and frees their
    /// log space. Returns the log bytes freed. Up to `max_stripes` stripes are
    /// pipelined: the next stripe is planned, read and built while the previous one is being
    /// written, so the capacity devices are kept busy.
    pub fn step(&mut self, max_stripes: usize) -> Result<u64, EngineError> {
        let started = Instant::now();
        let (mut freed, mut written) = (0, 0);
        let result = std::thread::scope(|scope| -> Result<(), EngineError> {
            let mut inflight: Option<Inflight<'_>> = None;
            let mut skip = 0;
            for i in 0..max_stripes.clamp(1, MAX_STRIPES_PER_STEP) {
                // Past the first stripe, go on only while the log is still above its high mark
                // (or draining): destaging more than needed moves data that may still be hot.
                if i > 0 && !self.flat_out() {
                    break;
                }
                let next = self.next_stripe(skip);
                if let Some(prev) = inflight.take() {
                    // Commit what is already written before acting on an error.
                    let (f, w) = self.finish(prev)?;
                    freed += f;
                    written += w;
                }
                let Some((stripe, taken)) = next? else { break };
                skip = taken;
                let placed = self.place(stripe)?;
                let sh = &*self.sh;
                let handle = scope.spawn(move || write_stripe(sh, &placed).map(|()| placed));
                inflight = Some(Inflight { handle, taken });
            }
            if let Some(prev) = inflight.take() {
                let (f, w) = self.finish(prev)?;
                freed += f;
                written += w;
            }
            Ok(())
        });
        if freed > 0 {
            self.measure(started, freed, written);
        }
        result.map(|()| freed)
    }

    fn flat_out(&self) -> bool {
        self.sh.drain.load(Ordering::Relaxed) || self.sh.log.lock().fill_ratio() >= self.sh.cfg.fill_ratio_high
    }

    /// Plans and builds the next stripe from the durable batches after the first `skip`.
    fn next_stripe(&self, skip: usize) -> Result<Option<(Vec<Builder>, usize)>, EngineError> {
        let batches: Vec<BatchMeta> = {
            let log = self.sh.log.lock();
            log.batches.iter().skip(skip).take(MAX_BATCHES_PER_STEP).take_while(|b| b.durable).cloned().collect()
        };
        if batches.is_empty() {
            return Ok(None);
        }
        let width = self.sh.caps.len();
        if self.keep_hot_allowed() {
            // The batches this stripe is likely to take: one stripe's worth of log.
            let room = width as u64 * u64::from(self.sh.layout.geo.data_blocks);
            let mut seen = 0;
            let scope: Vec<&BatchMeta> = batches
                .iter()
                .take_while(|b| {
                    seen += b.blocks;
                    seen <= room
                })
                .collect();
            self.keep_hot(&scope);
        }
        let plan = self.plan(&batches, width);
        if plan.is_empty() {
            return Err(EngineError::Failed("a log batch does not fit a segment".into()));
        }
        let taken = plan.len();
        Ok(Some((build_stripe(&self.sh, &plan, width)?, taken)))
    }

    /// Waits for an in-flight stripe, points the index at it and frees its log space.
    fn finish(&self, f: Inflight<'_>) -> Result<(u64, u64), EngineError> {
        let placed = match f.handle.join() {
            Ok(Ok(placed)) => placed,
            Ok(Err(e)) => {
                // A summary may have reached the device. Such a segment stays allocated (never
                // reused) until the next open, which sorts it out from its summary.
                tracing::error!("segment write failed; its segments are set aside until restart: {e}");
                return Err(e);
            }
            Err(_) => return Err(EngineError::Failed("segment writer panicked".into())),
        };
        let mut written = 0;
        for (seg, b, _) in &placed {
            commit_segment(&self.sh, *seg, b);
            written += u64::from(b.used) * BLOCK_U64;
        }
        self.sh.counters.destaged_bytes.fetch_add(written, Ordering::Relaxed);
        let freed = self.advance_tail(f.taken)?;
        Ok((freed, written))
    }

    /// The oldest batches whose live data fits one stripe (less a margin of one entry per
    /// segment, for runs split across segments), with their live runs.
    fn plan<'b>(&self, batches: &'b [BatchMeta], width: usize) -> Vec<Planned<'b>> {
        let geo = self.sh.layout.geo;
        let cap_blocks = width as u64 * u64::from(geo.data_blocks);
        let cap_entries = width * (geo.max_entries as usize - 1);
        let (mut blocks, mut entries, mut log_blocks) = (0u64, 0usize, 0u64);
        let mut plan = Vec::new();
        for b in batches {
            let runs = live_runs(&self.sh, b);
            let nb: u64 = runs.iter().map(|r| r.2).sum();
            let ne = runs.len() + tombstone_count(&self.sh, b);
            // The batch regions are read whole; bound what one step reads.
            let over_read = !plan.is_empty() && log_blocks + b.blocks > MAX_STEP_READ_BLOCKS;
            if blocks + nb > cap_blocks || entries + ne > cap_entries || over_read {
                break;
            }
            blocks += nb;
            entries += ne;
            log_blocks += b.blocks;
            plan.push((b, runs));
        }
        plan
    }

    /// Hot data stays on the fast tier only while there is room for it: not when draining,
    /// and not above the high mark (then everything moves, oldest first).
    fn keep_hot_allowed(&self) -> bool {
        let fill = self.sh.log.lock().fill_ratio();
        !self.sh.drain.load(Ordering::Relaxed) && fill < self.sh.cfg.fill_ratio_high && !self.sh.heat.lock().is_empty()
    }

    /// Writes the hot live blocks of tail batches again at the log head instead of moving them
    /// to the capacity tier: data still being rewritten stays where rewrites are cheap. Each
    /// move halves the block's heat, so data that stops being rewritten soon goes cold. All
    /// moves of a step go to the log writer together, so they share its group commits.
    fn keep_hot(&self, batches: &[&BatchMeta]) {
        let mut pending = Vec::new();
        for b in batches {
            for (i, off, n) in live_runs(&self.sh, b) {
                let r = &b.records[i];
                for (lba, len) in self.hot_parts(r.volume, r.lba + off, n) {
                    let from = r.data_start + (lba - r.lba);
                    match self.submit_rewrite(r.volume, lba, len, from) {
                        Ok(Some(p)) => pending.push(p),
                        Ok(None) => {}
                        Err(_) => break,
                    }
                }
            }
        }
        for (guard, wait, volume, lba, len) in pending {
            let ok = matches!(wait.recv(), Ok(Ok(())));
            drop(guard);
            if ok {
                self.cool(volume, lba, len);
            }
        }
    }

    /// Sub-runs of `[lba, lba+n)` whose blocks were overwritten recently (have heat).
    fn hot_parts(&self, volume: u32, lba: u64, n: u64) -> Vec<(u64, u64)> {
        let heat = self.sh.heat.lock();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for b in lba..lba + n {
            if heat.get(&(volume, b)).copied().unwrap_or(0) == 0 {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.0 + last.1 == b => last.1 += 1,
                _ => out.push((b, 1)),
            }
        }
        out
    }

    /// Like a host writing the same data again, under the same range lock (held until the
    /// write completes), so no host write can slip in between. Skipped when a host holds the
    /// range or the data moved meanwhile.
    fn submit_rewrite(&self, volume: u32, lba: u64, len: u64, from: u64) -> Result<Option<Pending<'_>>, EngineError> {
        let Some(guard) = self.sh.ranges.try_lock(volume, lba, lba + len) else { return Ok(None) };
        let still_here = {
            let idx = self.sh.index.read();
            let Some(v) = idx.vols.get(&volume) else { return Ok(None) };
            v.map.lookup(lba, len) == vec![crate::map::Piece { lba, len, loc: Some(Loc::Fast(from)) }]
        };
        if !still_here {
            return Ok(None);
        }
        let mut data = AlignedBuf::new_zeroed((len * BLOCK_U64) as usize);
        self.sh.fast.read_at(&mut data, self.sh.layout.log_byte(from))?;
        for (k, chunk) in data.chunks(BLOCK).enumerate() {
            if crc32c::crc32c(chunk) != self.sh.fast_crcs[(from + k as u64) as usize].load(Ordering::Relaxed) {
                // A damaged block is left for the destager, which keeps its original crc so the
                // damage stays detectable; rewriting it here would give it a fresh, valid crc.
                return Ok(None);
            }
        }
        let (done, wait) = crossbeam_channel::bounded(1);
        let req = WriteReq { kind: RecordKind::Write, volume, lba, nblocks: len, data: Some(data), done, no_wait: true, relocation: true };
        // Never block on a full queue: the log writer may be waiting for space only this
        // thread can free.
        self.tx.try_send(req).map_err(|_| EngineError::NoSpace)?;
        Ok(Some((guard, wait, volume, lba, len)))
    }

    fn cool(&self, volume: u32, lba: u64, len: u64) {
        let mut heat = self.sh.heat.lock();
        for b in lba..lba + len {
            if let Some(h) = heat.get_mut(&(volume, b)) {
                *h /= 2;
                if *h == 0 {
                    heat.remove(&(volume, b));
                }
            }
        }
        self.sh.counters.hot_kept_bytes.fetch_add(len * BLOCK_U64, Ordering::Relaxed);
    }

    /// Allocates a segment for each builder of the stripe (one per device).
    fn place(&self, stripe: Vec<Builder>) -> Result<Vec<(u32, Builder, u64)>, EngineError> {
        let mut placed = Vec::with_capacity(stripe.len());
        let mut segs = self.sh.segs.lock();
        for b in stripe {
            let Some(seg) = segs.alloc(gc_reserve(self.sh.caps.len())) else {
                for (s, _, _) in &placed {
                    segs.free_segment(*s, self.sh.layout.segments[*s as usize].0);
                }
                self.sh.counters.capacity_full.store(true, Ordering::Relaxed);
                return Err(EngineError::NoSpace);
            };
            let seq = segs.next_seq;
            segs.next_seq += 1;
            placed.push((seg, b, seq));
        }
        self.sh.counters.capacity_full.store(false, Ordering::Relaxed);
        Ok(placed)
    }

    /// Records the new log tail durably, then frees the log space before it.
    fn advance_tail(&self, batches: usize) -> Result<u64, EngineError> {
        let mut generation = self.sh.meta.lock();
        let tail = {
            let log = self.sh.log.lock();
            match log.batches.get(batches) {
                Some(b) => (b.start, b.first_seq),
                None => (log.head, log.next_seq),
            }
        };
        self.sh.write_checkpoint_locked(&mut generation, tail)?;
        let _excl = self.sh.reclaim.write();
        let mut log = self.sh.log.lock();
        let mut freed = 0;
        for _ in 0..batches {
            if let Some(b) = log.pop() {
                freed += (b.blocks + b.skip) * BLOCK_U64;
            }
        }
        drop(log);
        self.sh.log_freed.notify_all();
        self.sh.counters.log_freed_bytes.fetch_add(freed, Ordering::Relaxed);
        Ok(freed)
    }

    fn measure(&self, started: Instant, freed: u64, written: u64) {
        let busy = started.elapsed().as_secs_f64().max(1e-6);
        let c = &self.sh.counters;
        let bw = Counters::get_f64(&c.destage_bw_bytes_per_s);
        let sample = freed as f64 / busy;
        Counters::set_f64(&c.destage_bw_bytes_per_s, if bw == 0.0 { sample } else { 0.8 * bw + 0.2 * sample });
        let rate = Counters::get_f64(&c.destage_rate_bytes_per_s);
        Counters::set_f64(&c.destage_rate_bytes_per_s, 0.8 * rate + 0.2 * (written as f64 / busy));
    }

    /// One round of cost-benefit cleaning: packs the live data of the best victims into one
    /// new segment, then frees the victims. Returns whether it freed anything.
    pub fn gc_step(&mut self) -> Result<bool, EngineError> {
        if Instant::now() < self.gc_backoff_until {
            return Ok(false);
        }
        let plan = self.gc_plan()?;
        let worthwhile = plan.len() >= 2 || plan.first().is_some_and(|p| p.runs.is_empty() && p.tombs.is_empty());
        if !worthwhile {
            // Nothing to gain now; look again after the index has had time to change.
            self.gc_backoff_until = Instant::now() + Duration::from_millis(200);
            return Ok(false);
        }
        let mut builder = Builder::new(self.sh.layout.geo);
        for p in &plan {
            add_seg_runs(&self.sh, &mut builder, p.seg, &p.summary, &p.runs)?;
            for &(v, lba, n, seq) in &p.tombs {
                builder.add_tombstone(v, lba, n, seq);
            }
        }
        if !builder.is_empty() {
            let (seg, seq) = {
                let mut segs = self.sh.segs.lock();
                let Some(seg) = segs.alloc(0) else { return Ok(false) };
                let seq = segs.next_seq;
                segs.next_seq += 1;
                (seg, seq)
            };
            if let Err(e) = write_segment(&self.sh, seg, &builder, seq) {
                // Set aside until the next open, as in destage (see `finish`).
                tracing::error!("GC segment write failed; segment {seg} is set aside until restart: {e}");
                return Err(e);
            }
            commit_segment(&self.sh, seg, &builder);
            self.sh.counters.gc_relocated_bytes.fetch_add(u64::from(builder.used) * BLOCK_U64, Ordering::Relaxed);
        }
        let victims: Vec<u32> = plan.iter().map(|p| p.seg).collect();
        free_segments(&self.sh, &victims);
        self.sh.counters.capacity_full.store(false, Ordering::Relaxed);
        Ok(true)
    }

    /// Chooses victims, best first, while their live content fits one segment.
    fn gc_plan(&self) -> Result<Vec<GcVictim>, EngineError> {
        let geo = self.sh.layout.geo;
        let (mut blocks, mut entries) = (0u64, 0usize);
        let mut plan = Vec::new();
        for seg in gc_candidates(&self.sh).into_iter().take(64) {
            let summary = load_summary(&self.sh, seg)?;
            let runs = live_seg_runs(&self.sh, seg, &summary);
            let tombs = live_tombstones(&self.sh, &summary);
            let b: u64 = runs.iter().map(|r| r.2).sum();
            let e = runs.len() + tombs.len();
            if blocks + b > u64::from(geo.data_blocks) || entries + e > geo.max_entries as usize {
                break;
            }
            blocks += b;
            entries += e;
            plan.push(GcVictim { seg, summary, runs, tombs });
        }
        Ok(plan)
    }
}

/// Live data of a log batch or segment: (record or entry index, first block in it, blocks).
type LiveRuns = Vec<(usize, u64, u64)>;
/// A batch chosen for a stripe, with its live runs.
type Planned<'b> = (&'b BatchMeta, LiveRuns);
/// A segment of a stripe: (segment, content, segment sequence number).
type Placed = (u32, Builder, u64);

/// A stripe being written by a scoped thread, and the log batches it empties.
struct Inflight<'s> {
    handle: std::thread::ScopedJoinHandle<'s, Result<Vec<Placed>, EngineError>>,
    taken: usize,
}

type Pending<'a> = (
    crate::rangelock::RangeGuard<'a>,
    crossbeam_channel::Receiver<Result<(), EngineError>>,
    u32,
    u64,
    u64,
);

struct GcVictim {
    seg: u32,
    summary: Arc<SegmentSummary>,
    runs: Vec<(usize, u64, u64)>,
    tombs: Vec<(u32, u64, u32, u64)>,
}

/// Free segments below which GC runs.
pub fn gc_trigger(devices: usize) -> usize {
    4 + 2 * devices
}

/// Free segments kept back from destage so GC always has somewhere to write.
pub fn gc_reserve(devices: usize) -> usize {
    1 + devices
}

/// Sealed segments worth cleaning, best first: LFS's benefit/cost = (1-u) * age / (1+u).
fn gc_candidates(sh: &Shared) -> Vec<u32> {
    let segs = sh.segs.lock();
    let now = Instant::now();
    let mut scored: Vec<(f64, u32)> = segs
        .segs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.state == SegState::Sealed)
        .filter(|(_, s)| s.live_blocks < sh.layout.geo.data_blocks || s.has_tombstones)
        .map(|(i, s)| {
            let u = f64::from(s.live_blocks) / f64::from(sh.layout.geo.data_blocks.max(1));
            let age = now.duration_since(s.sealed_at).as_secs_f64() + 1.0;
            ((1.0 - u) * age / (1.0 + u), i as u32)
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    scored.into_iter().map(|(_, s)| s).collect()
}

/// Live data of a log batch as (record index, first block offset in record, blocks).
fn live_runs(sh: &Shared, b: &BatchMeta) -> Vec<(usize, u64, u64)> {
    let idx = sh.index.read();
    let mut out = Vec::new();
    for (i, r) in b.records.iter().enumerate() {
        if r.kind != RecordKind::Write {
            continue;
        }
        let Some(v) = idx.vols.get(&r.volume) else { continue };
        for p in v.map.lookup(r.lba, r.nblocks) {
            let off = p.lba - r.lba;
            if p.loc == Some(Loc::Fast(r.data_start + off)) {
                out.push((i, off, p.len));
            }
        }
    }
    out
}

/// Zero records still worth keeping: those whose range still reads as zeros somewhere.
fn tombstone_count(sh: &Shared, b: &BatchMeta) -> usize {
    b.records.iter().filter(|r| r.kind == RecordKind::Zero && tombstone_live(sh, r.volume, r.lba, r.nblocks)).count()
}

/// A tombstone matters while some block of its range still reads as zeros. It is kept whole:
/// blocks of the range written since carry a newer sequence number, so replaying the whole
/// tombstone first and the newer data after gives the right answer.
fn tombstone_live(sh: &Shared, volume: u32, lba: u64, n: u64) -> bool {
    let idx = sh.index.read();
    let Some(v) = idx.vols.get(&volume) else { return false };
    v.map.lookup(lba, n).iter().any(|p| p.loc.is_none())
}

/// One live run read from the log, ready to go into a segment.
struct LiveRun<'a> {
    volume: u32,
    lba: u64,
    seq: u64,
    first: u64,
    data: &'a [u8],
}

/// Reads each planned batch's data with one sequential read, then lays the live runs of all
/// of them into the stripe's segments in address order (coalescing by address), followed by
/// the surviving tombstones.
fn build_stripe(sh: &Shared, plan: &[Planned<'_>], width: usize) -> Result<Vec<Builder>, EngineError> {
    let mut bufs = Vec::with_capacity(plan.len());
    for (b, runs) in plan {
        if runs.is_empty() {
            bufs.push(AlignedBuf::new_zeroed(0));
            continue;
        }
        let mut buf = AlignedBuf::new_zeroed(((b.blocks - 1) * BLOCK_U64) as usize);
        sh.fast.read_at(&mut buf, sh.layout.log_byte(b.start + 1))?;
        bufs.push(buf);
    }
    let mut live = Vec::new();
    for ((b, runs), buf) in plan.iter().zip(&bufs) {
        for &(i, off, n) in runs {
            let r: &RecMeta = &b.records[i];
            let first = r.data_start + off;
            let at = ((first - b.start - 1) * BLOCK_U64) as usize;
            let data = &buf[at..at + (n * BLOCK_U64) as usize];
            live.push(LiveRun { volume: r.volume, lba: r.lba + off, seq: r.seq, first, data });
        }
    }
    live.sort_by_key(|r| (r.volume, r.lba));
    let geo = sh.layout.geo;
    let mut stripe = vec![Builder::new(geo)];
    for run in &live {
        let n = (run.data.len() / BLOCK) as u64;
        let mut done = 0;
        while done < n {
            let room = stripe.last().map_or(0, |s| s.room_blocks());
            if room == 0 || !stripe.last().is_some_and(|s| s.fits(1, 1)) {
                if stripe.len() == width {
                    return Err(EngineError::Failed("destage plan overflowed its stripe".into()));
                }
                stripe.push(Builder::new(geo));
                continue;
            }
            let take = room.min(n - done);
            add_live(sh, stripe.last_mut().expect("non-empty"), run, done, take);
            done += take;
        }
    }
    for (b, _) in plan {
        for r in b.records.iter().filter(|r| r.kind == RecordKind::Zero) {
            if tombstone_live(sh, r.volume, r.lba, r.nblocks) {
                // Any segment of the stripe with an entry to spare takes it.
                if !stripe.iter().any(|s| s.fits(0, 1)) {
                    if stripe.len() == width {
                        return Err(EngineError::Failed("destage plan overflowed its stripe".into()));
                    }
                    stripe.push(Builder::new(geo));
                }
                if let Some(s) = stripe.iter_mut().find(|s| s.fits(0, 1)) {
                    s.add_tombstone(r.volume, r.lba, r.nblocks as u32, r.seq);
                }
            }
        }
    }
    stripe.retain(|b| !b.is_empty());
    Ok(stripe)
}

/// Adds blocks `[skip, skip+n)` of a live run to a segment.
fn add_live(sh: &Shared, builder: &mut Builder, run: &LiveRun, skip: u64, n: u64) {
    let first = run.first + skip;
    let bytes = &run.data[(skip * BLOCK_U64) as usize..((skip + n) * BLOCK_U64) as usize];
    // The crc recorded at write time goes into the summary even if the log copy has gone bad:
    // a damaged block then stays detectably damaged instead of becoming valid.
    let crcs: Vec<u32> = (0..n).map(|k| sh.fast_crcs[(first + k) as usize].load(Ordering::Relaxed)).collect();
    for (k, chunk) in bytes.chunks(BLOCK).enumerate() {
        if crc32c::crc32c(chunk) != crcs[k] {
            sh.counters.checksum_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(volume = run.volume, block = run.lba + skip + k as u64, "checksum mismatch in the write log");
        }
    }
    builder.add_data(run.volume, run.lba + skip, run.seq, bytes, &crcs, Loc::Fast(first));
    let mut heat = sh.heat.lock();
    if !heat.is_empty() {
        for k in 0..n {
            heat.remove(&(run.volume, run.lba + skip + k));
        }
    }
}

/// Live data of a segment: (entry index, block offset in entry, blocks).
fn live_seg_runs(sh: &Shared, seg: u32, s: &SegmentSummary) -> Vec<(usize, u64, u64)> {
    let idx = sh.index.read();
    let mut out = Vec::new();
    for (i, e) in s.entries.iter().enumerate() {
        if e.kind != RecordKind::Write {
            continue;
        }
        let Some(v) = idx.vols.get(&e.volume) else { continue };
        for p in v.map.lookup(e.lba, u64::from(e.nblocks)) {
            let off = p.lba - e.lba;
            if p.loc == Some(Loc::Cap { seg, block: e.data_block + off as u32 }) {
                out.push((i, off, p.len));
            }
        }
    }
    out
}

fn live_tombstones(sh: &Shared, s: &SegmentSummary) -> Vec<(u32, u64, u32, u64)> {
    let mut out = Vec::new();
    for e in s.entries.iter().filter(|e| e.kind == RecordKind::Zero) {
        if tombstone_live(sh, e.volume, e.lba, u64::from(e.nblocks)) {
            out.push((e.volume, e.lba, e.nblocks, e.seq));
        }
    }
    out
}

fn add_seg_runs(sh: &Shared, builder: &mut Builder, seg: u32, s: &SegmentSummary, runs: &[(usize, u64, u64)]) -> Result<(), EngineError> {
    if runs.is_empty() {
        return Ok(());
    }
    // One sequential read of the segment's data instead of one read per run.
    let mut buf = AlignedBuf::new_zeroed(s.data_blocks_used as usize * BLOCK);
    let (dev, off) = sh.layout.seg_data_byte(seg, 0);
    sh.caps[dev].read_at(&mut buf, off)?;
    for &(i, off, n) in runs {
        let e = &s.entries[i];
        let block = e.data_block + off as u32;
        let at = block as usize * BLOCK;
        let data = &buf[at..at + (n * BLOCK_U64) as usize];
        let crcs = &s.block_crcs[block as usize..(block as u64 + n) as usize];
        for (k, chunk) in data.chunks(BLOCK).enumerate() {
            if crc32c::crc32c(chunk) != crcs[k] {
                sh.counters.checksum_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(segment = seg, block = block + k as u32, "checksum mismatch while cleaning; the damage is carried, not hidden");
            }
        }
        builder.add_data(e.volume, e.lba + off, e.seq, data, crcs, Loc::Cap { seg, block });
    }
    Ok(())
}

