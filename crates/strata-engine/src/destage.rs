//! The destager: moves data from the log to capacity segments under a fill-level controller,
//! runs garbage collection when free segments run low, and does the index's housekeeping
//! (see `maint.rs`). It is the only thread that changes the capacity index.
//!
//! Controller: below the low mark it idles. Between the marks it runs a duty cycle that rises
//! with fill (so the rate is a share of the bandwidth the devices really deliver), moving cold
//! data in the band's lower half and, in its upper half, freeing the log whether the tail's
//! data is hot or not: the fill settles inside the band under paced steps instead of at the
//! high mark. Above the high mark it runs flat out; the log writer then admits new writes at
//! the measured destage bandwidth (see `log.rs`). When the host has done no I/O for a while
//! (`EngineConfig::idle_destage_after`), it frees the log down to the low mark, one stripe at a
//! time, as it would under pressure.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_device::AlignedBuf;

use crate::capacity::*;
use crate::ctree::page::key_of;
use crate::ctree::Entry;
use crate::error::EngineError;
use crate::format::*;
use crate::log::{BatchMeta, RecMeta, WriteReq};
use crate::map::Loc;
use crate::meta;
use crate::policy::Mode;
use crate::shared::{Counters, Shared, STATE_FAILED};
use crossbeam_channel::Receiver;

mod rotate;

/// Log fill (cached copies included) at which the destager runs flat out whatever else holds.
const PHYSICAL_FULL: f64 = 0.95;
/// Batches handed to one destage step at most (bounds the memory of a step).
const MAX_BATCHES_PER_STEP: usize = 4096;
/// Stripes one destage step pipelines at most.
const MAX_STRIPES_PER_STEP: usize = 16;
/// Segments one GC step writes at most.
const GC_OUTPUTS: usize = 4;
/// A GC step run only so sequential writes may bypass the log again (`Destager::gc_needed`)
/// must free this many segments per segment it writes: cleaning early costs capacity-tier
/// writes, so only segments that are mostly empty (as small bypassed bursts leave them) are
/// cleaned before space runs short.
const THRIFTY_GC_GAIN: usize = 3;
/// Log blocks read at once to keep hot data (4 MiB).
const KEEP_READ_BLOCKS: u64 = 1024;
/// Log blocks one stripe reads at most (64 MiB).
const MAX_STEP_READ_BLOCKS: u64 = 16384;
/// Where in the band between the marks (0 at the low mark, 1 at the high) the tail starts to
/// be freed whether its data is hot or not. Waiting for the high mark instead left the fill
/// there under steady writes: flat-out steps and throttled admission every second or so,
/// each burst taking queue-depth-1 writes from 0.2 ms to 2-4 ms.
const SOFT_PRESSURE: f64 = 0.5;
/// ... but only while host batches hold fewer records than this on average (host writes
/// waiting on the device one or two at a time, so the devices have time to spare).
const SOFT_MAX_RECORDS_PER_BATCH: f64 = 2.0;
/// Bounds of the destager's pause after a step that found nothing worth moving.
const REST_MIN: Duration = Duration::from_millis(20);
const REST_MAX: Duration = Duration::from_millis(500);

pub struct Destager {
    pub(crate) sh: Arc<Shared>,
    tx: crate::queue::LogQueue,
    /// The rate host writes take the log at (bytes/s, smoothed over about a second) and the
    /// counter reading it was last updated from. (Counting the destager's own rewrites too fed
    /// back: compaction's rewrites raised the rate that set how much to compact.)
    append_rate: f64,
    appended_seen: (Instant, u64),
    /// Records per host batch (smoothed like `append_rate`) and the counters' readings
    /// (batches, records) it was last updated from.
    records_per_batch: f64,
    batches_seen: (u64, u64),
    gc_backoff_until: Instant,
    pub(crate) maint: crate::maint::Maint,
    /// Promotions refused for want of cache room, as last seen.
    refused_seen: u64,
    /// The last duty cycle ran flat out so the read cache gets room.
    cache_wants_room: bool,
    /// Sequential writes to put straight into segments (see bypass.rs).
    pub(crate) bypass_rx: Receiver<crate::bypass::BypassJob>,
    /// The host's reads, writes and log batches summed, and when that sum last changed.
    host_io_seen: (u64, Instant),
    /// The last duty cycle found the host idle with the fill above the low mark: steps free
    /// the log as under pressure, one stripe at a time.
    idle_drain: bool,
    /// This step moves the tail to reach tier-mode data old and cold enough to move behind it
    /// (`cold_tier_behind`), and when a look found none, when to look again.
    tier_behind: bool,
    tier_look_after: Instant,
    /// The last duty cycle was paced without pressure: a step moves only a stripe of cold
    /// data, if the tail has one.
    cold_only: bool,
    /// Host bytes appended to the log when a step last found no stripe of cold data (see
    /// `duty_cycle`).
    fruitless_at: Option<u64>,
    /// The last acknowledged seq seen (`Shared::retired_seq`) and since when (`mark_log_end`).
    end_seen: (u64, Instant),
    /// The destager thread's CPU priority (set in `run`, on that thread): background while
    /// the log does not need room, so on a busy CPU the host's I/O threads run first.
    priority: Option<strata_device::priority::ThreadPriority>,
    /// The log as it was when rotation last found nothing it could do (see rotate.rs).
    rotation_fruitless: Option<rotate::Fruitless>,
}

/// A live run of a log record to write again at the head: the layer's blocks, the log block
/// holding the first, and when the data first reached the fast tier.
#[derive(Debug, Clone, Copy)]
struct Rewrite {
    layer: u32,
    lba: u64,
    len: u64,
    from: u64,
    born_ms: u64,
}

/// What `Destager::keep_hot` writes again at the log head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// The hot blocks only.
    Hot,
    /// Every live block, but only the hot ones of tier-mode volumes (their cold data is due
    /// to move).
    LiveExceptTier,
    /// Every live block.
    Live,
}

/// The oldest batches as `Destager::survey` counts them.
#[derive(Debug, Default, Clone, Copy)]
struct Survey {
    batches: usize,
    log_blocks: u64,
    live: u64,
    cold: u64,
    /// The read cache's current copies.
    cached: u64,
}

/// What the oldest log data says about tier-mode volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TierTail {
    /// Nothing of a tier-mode volume at the tail.
    None,
    /// Tier-mode data at the tail is younger than its volume's minimum age: it stays.
    Young,
    /// Tier-mode data at the tail is old enough to move (unless hot).
    Cold,
}

impl Destager {
    pub fn new(
        sh: Arc<Shared>,
        tx: crate::queue::LogQueue,
        bypass_rx: Receiver<crate::bypass::BypassJob>,
    ) -> Destager {
        let maint = crate::maint::Maint::new(&sh);
        Destager {
            sh,
            tx,
            append_rate: 0.0,
            appended_seen: (Instant::now(), 0),
            records_per_batch: 0.0,
            batches_seen: (0, 0),
            gc_backoff_until: Instant::now(),
            maint,
            refused_seen: 0,
            host_io_seen: (0, Instant::now()),
            idle_drain: false,
            tier_behind: false,
            tier_look_after: Instant::now(),
            cold_only: false,
            fruitless_at: None,
            end_seen: (0, Instant::now()),
            priority: None,
            rotation_fruitless: None,
            cache_wants_room: false,
            bypass_rx,
        }
    }

    pub fn run(mut self) {
        let priority = strata_device::priority::ThreadPriority::of_current_thread();
        if !priority.can_return() {
            tracing::info!(
                "the destager stays at normal CPU priority: it could not raise it again when \
                 the log needs room (that needs CAP_SYS_NICE or an RLIMIT_NICE of 20)"
            );
        }
        self.priority = Some(priority);
        loop {
            let stop = self.sh.abandon.load(Ordering::Relaxed)
                || self.sh.destager_stop.load(Ordering::Relaxed);
            if stop || self.sh.state.load(Ordering::Acquire) == STATE_FAILED {
                #[cfg(test)]
                self.sh.destager_parked.store(true, Ordering::SeqCst);
                return;
            }
            // Not parked before held is looked at (`Shared::hold_destager` relies on it).
            #[cfg(test)]
            self.sh.destager_parked.store(false, Ordering::SeqCst);
            #[cfg(test)]
            if self.sh.destager_held.load(Ordering::SeqCst) {
                // Held, it still sees whether hosts are idle (as it would between steps).
                self.host_idle();
                self.sh.destager_parked.store(true, Ordering::SeqCst);
                self.idle(Duration::from_millis(10));
                continue;
            }
            self.run_bypass();
            // A capacity device out of room: its writes wait (room.rs), and the log gets room
            // only as a full capacity tier gives it, from its own dead blocks. Trims give their
            // blocks on the capacity tier back meanwhile: the room that gives the file system
            // may be what ends the spell.
            if let Some(wait) = crate::room::paused_for(&self.sh) {
                self.release_trimmed_while_out_of_room();
                if !self.make_log_room() {
                    self.idle(wait.min(Duration::from_millis(100)));
                }
                continue;
            }
            if let Err(e) = self.housekeeping() {
                if crate::room::note_failure(&self.sh, &e, crate::room::Write::Other, None) {
                    continue;
                }
                tracing::error!("index housekeeping: {e}");
                self.idle(Duration::from_millis(200));
            }
            let duty = self.duty_cycle();
            self.set_priority();
            if duty <= 0.0 {
                self.mark_log_end();
                crate::room::probe_when_idle(&self.sh);
                self.idle(Duration::from_millis(50));
                continue;
            }
            let started = Instant::now();
            // Flat out, a step pipelines several stripes; paced or using idle time, one at a
            // time (so a host coming back waits for one stripe at most).
            let stripes = if duty >= 1.0 && !self.idle_drain {
                MAX_STRIPES_PER_STEP
            } else {
                1
            };
            match self.step(stripes) {
                // Nothing worth moving yet. Looking again costs a survey of the tail, so the
                // next look waits at least 20 times as long as this one took.
                Ok(0) => {
                    crate::room::probe_when_idle(&self.sh);
                    if self.cold_only {
                        self.fruitless_at = Some(append_total(&self.sh));
                    }
                    self.rest((started.elapsed() * 20).clamp(REST_MIN, REST_MAX))
                }
                Ok(_) if duty < 1.0 => {
                    let busy = started.elapsed().as_secs_f64();
                    let pause = busy * (1.0 - duty) / duty;
                    self.rest(Duration::from_secs_f64(pause.min(1.0)));
                }
                Ok(_) => {}
                Err(EngineError::NoSpace) => match self.make_room() {
                    Ok(true) => {}
                    Ok(false) => {
                        self.sh
                            .counters
                            .capacity_full
                            .store(true, Ordering::Relaxed);
                        self.sh.log_space_freed();
                        self.idle(Duration::from_millis(100));
                    }
                    Err(e) => {
                        if !crate::room::note_failure(&self.sh, &e, crate::room::Write::Other, None)
                        {
                            tracing::error!("making room on the capacity tier: {e}");
                        }
                        self.idle(Duration::from_millis(200));
                    }
                },
                Err(e) => {
                    if !crate::room::note_failure(&self.sh, &e, crate::room::Write::Other, None) {
                        tracing::error!("destage: {e}");
                    }
                    self.idle(Duration::from_millis(200));
                }
            }
        }
    }

    /// Background CPU priority unless the log needs room now. Paced work ahead of need then
    /// waits while host I/O threads want the CPU: on two vCPUs, QD1 writes behind a destager
    /// at normal priority waited up to a scheduler slice (the thirteenth and fifteenth
    /// sessions in docs/BENCHMARKS.md). When the log needs room (the high mark, a drain), host
    /// writes wait for the destager, so it runs at the priority it started with. Stripe
    /// writer threads started by a step inherit the priority in effect.
    fn set_priority(&mut self) {
        let background = !self.forced() && !self.under_pressure();
        let Some(p) = self.priority.as_mut() else {
            return;
        };
        match p.set_background(background) {
            Ok(nice) => self
                .sh
                .counters
                .destager_nice
                .store(i64::from(nice), Ordering::Relaxed),
            Err(e) => {
                tracing::warn!("setting the destager's CPU priority: {e}; it stays as it is");
                self.priority = None;
            }
        }
    }

    /// GC when free segments run low (or cheap cleaning when bypassing writes wait for free
    /// segments, `gc_needed`), then the index's own upkeep.
    fn housekeeping(&mut self) -> Result<(), EngineError> {
        if let Some(min_gain) = self.gc_needed() {
            if let Err(e) = self.gc_step_for(min_gain) {
                if !crate::room::note_failure(&self.sh, &e, crate::room::Write::Other, None) {
                    tracing::error!("garbage collection: {e}");
                }
            }
        }
        crate::maint::run(self)
    }

    /// A pause the log writer's per-batch nudges do not cut short until the log has grown by
    /// `REST_FILL_STEP` (see `Shared::nudge_destager`); explicit wakes and a log past its high
    /// mark do.
    fn rest(&self, d: Duration) {
        let fill = self.sh.log.lock().fill_ratio();
        let rest = &self.sh.destager_rest_fill;
        rest.store(fill.to_bits(), Ordering::Relaxed);
        self.idle(d);
        rest.store(crate::shared::NOT_RESTING, Ordering::Relaxed);
    }

    pub(crate) fn idle(&self, d: Duration) {
        let mut w = self.sh.destage_wake_lock.lock();
        if !*w {
            self.sh.destage_wake.wait_for(&mut w, d);
        }
        *w = false;
    }

    /// Once no record has been acknowledged for `END_MARK_AFTER`, writes a checkpoint whose
    /// `log_end_seq` is the seq after the last acknowledged record, as a clean shutdown does.
    /// A batch is otherwise shown acknowledged only by a later batch's `committed_seq`, so
    /// damage to the last batches written before a crash could not be told from a torn write
    /// in flight, and replay dropped them without a word; with the mark, their damaged records
    /// read as I/O errors, and a header that cannot be read stops the start (docs/FORMAT.md
    /// §5.2). One checkpoint write per pause of the host's writes.
    fn mark_log_end(&mut self) {
        let retired = self.sh.retired_seq.load(Ordering::Acquire);
        let now = Instant::now();
        if retired != self.end_seen.0 {
            self.end_seen = (retired, now);
            return;
        }
        if now.duration_since(self.end_seen.1) < END_MARK_AFTER {
            return;
        }
        let mut d = self.sh.durable.lock();
        if d.clean_log_end_seq >= retired {
            return;
        }
        d.clean_log_end_seq = retired;
        let tail = d.log_tail;
        if let Err(e) = self.sh.write_checkpoint_locked(&mut d, tail) {
            tracing::warn!("cannot write the checkpoint that marks where the write log ends: {e}");
        }
    }

    /// Destage regardless of fill: draining, or a deleted snapshot waits for its log data.
    fn forced(&self) -> bool {
        self.sh.drain.load(Ordering::Relaxed) || self.maint.merge_waits_for_log
    }

    /// The share of time to spend destaging, 0..=1.
    fn duty_cycle(&mut self) -> f64 {
        let (fill, physical, cache_full, log_bytes) = {
            let log = self.sh.log.lock();
            (
                log.fill_ratio(),
                log.physical_fill_ratio(),
                !log.cache_has_room(log.cache_budget_blocks / 10 + 1),
                log.log_blocks * BLOCK_U64,
            )
        };
        let high = self.sh.cfg.fill_ratio_high;
        self.cache_wants_room = false;
        self.idle_drain = false;
        self.tier_behind = false;
        self.cold_only = false;
        let idle = self.host_idle();
        if self.forced() || fill >= high || physical >= PHYSICAL_FULL {
            return 1.0;
        }
        match self.tier_tail() {
            TierTail::Young => return 0.0,
            TierTail::Cold => return 1.0,
            TierTail::None => {}
        }
        // The read cache wants room: pass the tail over its oldest copies.
        let refused = self.sh.counters.promotions_refused.load(Ordering::Relaxed);
        if cache_full && refused > self.refused_seen {
            self.refused_seen = refused;
            self.cache_wants_room = true;
            return 1.0;
        }
        let append = self.update_host_load();
        let Some(e) = self.band_position(fill) else {
            // Below the low mark nothing moves, except to reach tier data due to move.
            if self.cold_tier_behind() {
                self.tier_behind = true;
                return 1.0;
            }
            return 0.0;
        };
        // The idle drain moves host data. With none of it left in the log, passing the tail
        // gains nothing but dead space and costs the read cache its copies (each written anew
        // at the head, or evicted): with a low mark near 0 it did so again and again, until
        // the cache was gone.
        let host_data = self.sh.counters.fast_live_blocks.load(Ordering::Relaxed) > 0;
        if idle && host_data {
            self.idle_drain = true;
            self.fruitless_at = None;
            return 1.0;
        }
        if self.soft_pressure() {
            self.fruitless_at = None;
        } else {
            // Without pressure a step moves only a stripe of cold data, and what the tail holds
            // changes only as hosts write (heat fades by epochs of host writes). After a step
            // found none, look again once the host has written a twentieth of the log: each
            // look surveyed thousands of blocks (~10 ms of CPU at queue depth 1, several times
            // a second), and host writes met it as 1 ms outliers.
            self.cold_only = true;
            if let Some(at) = self.fruitless_at {
                let again = at + (log_bytes as f64 * crate::shared::REST_FILL_STEP) as u64;
                if append_total(&self.sh) < again {
                    return 0.0;
                }
                self.fruitless_at = None;
            }
        }
        // The share of time that frees the log as fast as it is taken (at the bandwidth steps
        // measured), scaled by where the fill is: matched at mid-band, twice that near the
        // high mark; with few writes, a floor rising to a quarter near the high mark. No
        // integral term: one on the fill's height above the low mark wound up to flat out
        // within seconds of steady writes, and one on its distance from mid-band (0.05/s)
        // wound up during a burst of writes and then drained the log hard under the next,
        // lighter load; both took queue-depth-1 writes from 0.2 ms to 1-3 ms at the 99th
        // percentile. The high mark and admission control bound the fill instead.
        let bw = Counters::get_f64(&self.sh.counters.destage_bw_bytes_per_s);
        let matched = if bw > 0.0 { append / bw } else { 0.0 };
        (2.0 * e * matched).max(0.05 + 0.2 * e * e).min(1.0)
    }

    /// Updates the smoothed host load: the rate host writes take the log at, returned
    /// (bytes/s), and the records per host batch (read by `soft_pressure`).
    fn update_host_load(&mut self) -> f64 {
        let now = Instant::now();
        let appended = self
            .sh
            .counters
            .log_host_appended_bytes
            .load(Ordering::Relaxed);
        let (then, seen) = self.appended_seen;
        let dt = now.duration_since(then).as_secs_f64();
        if dt >= 0.05 {
            let sample = appended.saturating_sub(seen) as f64 / dt;
            // Time-weighted: about a second of history whatever the loop's period.
            let w = 1.0 - (-dt).exp();
            self.append_rate += w * (sample - self.append_rate);
            self.appended_seen = (now, appended);
            let c = &self.sh.counters;
            let (batches, records) = (
                c.log_host_batches.load(Ordering::Relaxed),
                c.log_host_records.load(Ordering::Relaxed),
            );
            let (b0, r0) = self.batches_seen;
            // No host batch at all counts as none waiting: idle is light load.
            let sample =
                records.saturating_sub(r0) as f64 / batches.saturating_sub(b0).max(1) as f64;
            self.records_per_batch += w * (sample - self.records_per_batch);
            self.batches_seen = (batches, records);
        }
        self.append_rate
    }

    /// Whether the host has neither read nor written for `EngineConfig::idle_destage_after`
    /// (never, when that is None). The destager then frees the log down to its low mark as it
    /// would under pressure (compacting tails at most 75% live, destaging fuller ones), so the
    /// next burst of writes, or a stretch of light ones, finds room without the destager's
    /// work competing with it. Hot data pays: a hot set the log could keep is partly moved to
    /// the capacity tier when the host pauses.
    fn host_idle(&mut self) -> bool {
        let c = &self.sh.counters;
        let io = c
            .host_read_bytes
            .load(Ordering::Relaxed)
            .wrapping_add(c.host_write_bytes.load(Ordering::Relaxed))
            .wrapping_add(c.log_host_batches.load(Ordering::Relaxed));
        let now = Instant::now();
        if io != self.host_io_seen.0 {
            self.host_io_seen = (io, now);
        }
        self.sh
            .cfg
            .idle_destage_after
            .is_some_and(|after| now.duration_since(self.host_io_seen.1) >= after)
    }

    /// Where `fill` lies between the marks: None below the low mark, 0..1 up to the high.
    fn band_position(&self, fill: f64) -> Option<f64> {
        let (low, high) = (self.sh.cfg.fill_ratio_low, self.sh.cfg.fill_ratio_high);
        (fill >= low).then(|| ((fill - low) / (high - low).max(1e-9)).min(1.0))
    }

    /// The fill is in the band's upper half and host writes come one or two at a time: paced
    /// steps free the log whether the tail's data is hot or not. Under many concurrent writes
    /// the data stays until the high mark, where more of the tail has been overwritten and
    /// freeing it costs least: freeing from mid-band cost queue-depth-32 random writes a tenth
    /// of their rate.
    fn soft_pressure(&self) -> bool {
        let fill = self.sh.log.lock().fill_ratio();
        self.records_per_batch < SOFT_MAX_RECORDS_PER_BATCH
            && self.band_position(fill).is_some_and(|e| e >= SOFT_PRESSURE)
    }

    /// Looks at the oldest durable batch's live data of tier-mode volumes.
    fn tier_tail(&self) -> TierTail {
        let front = {
            let mut log = self.sh.log.lock();
            let front = log.batches.front().filter(|b| b.durable).cloned();
            if let Some(b) = &front {
                log.close_run_if_taken(b.first_seq);
            }
            front
        };
        let Some(front) = front else {
            return TierTail::None;
        };
        let now = self.sh.cfg.clock.now_ms();
        let mut out = TierTail::None;
        for (i, _, _) in live_runs(&self.sh, &front) {
            match self.tier_young(&front.records[i], now) {
                Some(true) => return TierTail::Young,
                Some(false) => out = TierTail::Cold,
                None => {}
            }
        }
        out
    }

    /// For a record of a tier-mode volume, whether it is younger than the volume's minimum
    /// age at `now_ms`; None for other volumes' records.
    fn tier_young(&self, r: &RecMeta, now_ms: u64) -> Option<bool> {
        let p = self.sh.layer_runtime(r.layer)?.policy();
        let min_age_ms = p.tier_min_age_s.saturating_mul(1000);
        (p.mode == Mode::Tier).then(|| now_ms.saturating_sub(r.aged_from_ms) < min_age_ms)
    }

    /// Whether a batch behind the oldest holds live data of a tier-mode volume old and cold
    /// enough to move, with no younger tier data before it: the tail must move to reach it.
    /// Below the low mark the destager moved nothing, so a tier volume's cold data written
    /// after a cache volume's stayed on the fast tier for as long as the cache volume's data
    /// did (an admin's trial: 8 MiB, 90 s past a minimum age of 10 s). A look that finds
    /// none waits a second before the next (it reads the whole log's records).
    fn cold_tier_behind(&mut self) -> bool {
        let now = Instant::now();
        if now < self.tier_look_after {
            return false;
        }
        let any_tier = any_tier_volume(&self.sh);
        let batches: Vec<BatchMeta> = match any_tier {
            true => {
                let log = self.sh.log.lock();
                let durable = log.batches.iter().take_while(|b| b.durable);
                durable.skip(1).cloned().collect()
            }
            false => Vec::new(),
        };
        let now_ms = self.sh.cfg.clock.now_ms();
        for b in &batches {
            for (i, off, n) in live_runs(&self.sh, b) {
                let r = &b.records[i];
                match self.tier_young(r, now_ms) {
                    None => continue,
                    Some(true) => {
                        // The tail cannot pass it.
                        self.tier_look_after = now + Duration::from_secs(1);
                        return false;
                    }
                    Some(false) => {}
                }
                let hot = self.hot_parts(r.layer, r.lba + off, n);
                if hot.iter().map(|p| p.1).sum::<u64>() < n {
                    return true;
                }
            }
        }
        self.tier_look_after = now + Duration::from_secs(1);
        false
    }

    /// How many of `batches` (oldest first) come before the first one holding live data of a
    /// tier-mode volume younger than its minimum age.
    fn before_young_tier(&self, batches: &[BatchMeta]) -> usize {
        let any_tier = any_tier_volume(&self.sh);
        if !any_tier {
            return batches.len();
        }
        let now = self.sh.cfg.clock.now_ms();
        let young = |r: &RecMeta| self.tier_young(r, now) == Some(true);
        let holds_young = |b: &BatchMeta| {
            live_runs(&self.sh, b)
                .iter()
                .any(|&(i, _, _)| young(&b.records[i]))
        };
        batches
            .iter()
            .position(holds_young)
            .unwrap_or(batches.len())
    }

    /// Whether GC should run, and how many segments it must free per segment it writes: when
    /// free segments run low, any gain will do; when sequential writes would bypass the log
    /// but for the free segments that keeps to spare (`bypass::wanted`), only cheap cleaning
    /// (`THRIFTY_GC_GAIN`). Without it, the segments small bypassed bursts had left mostly
    /// empty stayed as they were until space ran short, and the streams went through the log.
    fn gc_needed(&self) -> Option<usize> {
        let free = self.sh.segs.lock().free_count();
        let trigger = gc_trigger(&self.sh);
        if free < trigger {
            return Some(1);
        }
        let held = &self.sh.counters.bypass_held_for_room;
        if free > 2 * trigger {
            held.store(false, Ordering::Relaxed);
            return None;
        }
        held.load(Ordering::Relaxed).then_some(THRIFTY_GC_GAIN)
    }

    /// After destage found no free segment: makes pending segments reusable (an index flush)
    /// or cleans some, or else frees log space without the capacity tier. Only when none of
    /// that helps is the capacity tier full (then host writes that need log space fail with
    /// ENOSPC).
    fn make_room(&mut self) -> Result<bool, EngineError> {
        if self.sh.segs.lock().pending_count() > 0 {
            crate::maint::flush(self)?;
            return Ok(true);
        }
        if self.apply_zeros_early()? {
            return Ok(true);
        }
        self.gc_backoff_until = Instant::now();
        if self.gc_step()? {
            return Ok(true);
        }
        if self.compact_tail()? {
            return Ok(true);
        }
        self.rotate_tail()
    }

    /// While the capacity tier is out of room (room.rs): applies the log's trims and
    /// write-zeroes to the capacity index now (`apply_zeros_early`, as a full tier does), and
    /// asks for an index flush, which at the spell's next try frees the segments they emptied
    /// and discards them, giving the file system its room back. (Nothing did: trims changed
    /// nothing on the capacity tier until destaged, which the spell stops, so a host that
    /// trimmed to make room kept failing its writes; only deleting a volume helped.)
    fn release_trimmed_while_out_of_room(&mut self) {
        match self.apply_zeros_early() {
            Ok(true) => self.maint.want_flush = true,
            Ok(false) => {}
            Err(e) => {
                if !crate::room::note_failure(&self.sh, &e, crate::room::Write::Other, None) {
                    tracing::error!("releasing trimmed blocks while out of room: {e}");
                }
            }
        }
    }

    /// While the capacity tier is out of room (room.rs): frees log space when the log needs it
    /// by what writes no capacity device, compaction then rotation of its tail. Returns
    /// whether any was freed.
    fn make_log_room(&mut self) -> bool {
        let fill = self.sh.log.lock().fill_ratio();
        if fill < self.sh.cfg.fill_ratio_high {
            return false;
        }
        let freed = self.compact_tail().and_then(|c| match c {
            true => Ok(true),
            false => self.rotate_tail(),
        });
        match freed {
            Ok(f) => f,
            Err(e) => {
                tracing::error!("making room in the write log: {e}");
                false
            }
        }
    }

    /// Applies the log's zero records (trims, write-zeroes) still in effect to the capacity
    /// index now, ahead of their batches' destage, where it points into segments: those
    /// segments lose the blocks, so an index flush or GC can free them and destage goes on.
    /// Without this a trim of a full volume freed nothing: the log before its record was live
    /// data that could not move. The records stay in the log (replay applies them again
    /// after a crash) and are destaged as usual. Returns whether any block was released.
    fn apply_zeros_early(&mut self) -> Result<bool, EngineError> {
        let batches: Vec<BatchMeta> = {
            let log = self.sh.log.lock();
            log.batches
                .iter()
                .filter(|b| b.durable && b.records.iter().any(|r| r.kind == RecordKind::Zero))
                .cloned()
                .collect()
        };
        let zeros: Vec<LiveZero> = batches
            .iter()
            .flat_map(|b| live_zero_records(&self.sh, b))
            .collect();
        let sets = zeroed_capacity_sets(&self.sh, &zeros)?;
        if sets.is_empty() {
            return Ok(false);
        }
        apply_tree_sets(&self.sh, &sets, false)?;
        Ok(true)
    }

    /// The capacity tier has no room and the log needs some: when the oldest batches are at
    /// most 75% live, their live data is written again at the log head (as much as fits in
    /// half the free log) and the tail moves past the batches left with nothing live, so a
    /// log full of overwritten copies takes host writes again. (A tail that is mostly live
    /// would cost more fast-tier writes than it frees, and compacting it again and again
    /// would wear the device for nothing.) Returns whether log space was freed.
    fn compact_tail(&mut self) -> Result<bool, EngineError> {
        if !self.under_pressure() {
            return Ok(false);
        }
        let batches = self.durable_batches(0);
        let s = self.survey(&batches, u64::MAX, self.free_log_blocks() / 2);
        if s.batches == 0 || s.live * 4 > s.log_blocks * 3 {
            return Ok(false);
        }
        let refs: Vec<&BatchMeta> = batches[..s.batches].iter().collect();
        self.keep_hot(&refs, Keep::Live);
        // Only the batches left with no live data: a zero record rewritten ahead of a batch
        // that stays would take a log block and free none.
        let no_data = refs
            .iter()
            .take_while(|b| live_runs(&self.sh, b).is_empty())
            .count();
        self.keep_zeros(&refs[..no_data]);
        let empty = batches[..s.batches]
            .iter()
            .take_while(|b| {
                live_runs(&self.sh, b).is_empty() && live_zero_records(&self.sh, b).is_empty()
            })
            .count();
        if empty == 0 {
            return Ok(false);
        }
        self.second_chance(empty);
        let freed = self.advance_tail(empty, None)? > 0;
        if freed {
            // Host writes waiting for log space may go on: this is room, if not capacity.
            self.sh
                .counters
                .capacity_full
                .store(false, Ordering::Relaxed);
        }
        Ok(freed)
    }

    /// Moves the oldest durable batches' live data into stripes of segments and frees their
    /// log space. Returns the log bytes freed. Up to `max_stripes` stripes are
    /// pipelined: the next stripe is planned, read and built while the previous one is being
    /// written, so the capacity devices are kept busy.
    pub fn step(&mut self, max_stripes: usize) -> Result<u64, EngineError> {
        let started = Instant::now();
        let mut freed = 0;
        let result = std::thread::scope(|scope| -> Result<(), EngineError> {
            let mut inflight: Option<Inflight<'_>> = None;
            // The batches the stripe in flight takes whole, and the one it takes part of.
            let mut skip = 0;
            let mut split = None;
            for i in 0..max_stripes.clamp(1, MAX_STRIPES_PER_STEP) {
                // Past the first stripe, go on only while the log is still above its high mark
                // (or draining): destaging more than needed moves data that may still be hot.
                if i > 0 && !self.flat_out() {
                    break;
                }
                let next = self.next_stripe(skip, split);
                if let Some(prev) = inflight.take() {
                    // Commit what is already written before acting on an error.
                    freed += self.finish(prev)?;
                }
                let Some(NextStripe {
                    stripe,
                    taken,
                    moved,
                    split: part,
                }) = next?
                else {
                    break;
                };
                if stripe.iter().all(Builder::is_empty) {
                    // Nothing live left in these batches (kept or overwritten): no segment
                    // to write, the tail just moves past them.
                    self.second_chance(taken);
                    freed += self.advance_tail(taken, None)?;
                    skip = 0;
                    split = None;
                    continue;
                }
                skip = taken;
                split = part;
                let placed = self.place(stripe)?;
                let segs = placed.iter().map(|p| p.0).collect();
                let sh = &*self.sh;
                let handle = scope.spawn(move || write_stripe(sh, &placed).map(|()| placed));
                inflight = Some(Inflight {
                    handle,
                    segs,
                    taken,
                    moved,
                    split: part,
                });
            }
            if let Some(prev) = inflight.take() {
                freed += self.finish(prev)?;
            }
            Ok(())
        });
        if freed > 0 {
            self.measure(started, freed);
        }
        result.map(|()| freed)
    }

    /// The oldest durable batches after the first `skip`: at most one step's worth, which is
    /// also all a survey or a plan looks at (what one stripe reads, or the first batch).
    /// Copying more only cost time: at queue depth 32 a step copied ~4,000 batches of ~32
    /// records each to look at ~500 of them.
    fn durable_batches(&self, skip: usize) -> Vec<BatchMeta> {
        let mut log = self.sh.log.lock();
        let (mut taken, mut blocks) = (0, 0);
        let copy: Vec<BatchMeta> = log
            .batches
            .iter()
            .skip(skip)
            .take(MAX_BATCHES_PER_STEP)
            .take_while(|b| b.durable)
            .take_while(|b| {
                taken += 1;
                blocks += b.blocks;
                taken == 1 || blocks <= MAX_STEP_READ_BLOCKS
            })
            .cloned()
            .collect();
        // An open run is the last batch: copied, it must not grow any more.
        if let Some(last) = copy.last() {
            log.close_run_if_taken(last.first_seq);
        }
        copy
    }

    /// Free log blocks the destager's rewrites may take (not the reserves kept for trims and
    /// for rotation).
    fn free_log_blocks(&self) -> u64 {
        let log = self.sh.log.lock();
        log.free_blocks().saturating_sub(log.kept_free(true, false))
    }

    fn flat_out(&self) -> bool {
        self.forced() || self.sh.log.lock().fill_ratio() >= self.sh.cfg.fill_ratio_high
    }

    /// Plans and builds the next stripe from the durable batches after the first `skip`, and,
    /// when the stripe before took the first part of the batch after those (`split`), from
    /// the rest of it.
    fn next_stripe(
        &self,
        skip: usize,
        split: Option<Split>,
    ) -> Result<Option<NextStripe>, EngineError> {
        let mut batches = self.durable_batches(skip);
        if let (Some(sp), Some(first)) = (split, batches.first_mut()) {
            // Only this thread takes batches from the tail, so the batch is still there.
            debug_assert_eq!(first.first_seq, sp.first_seq, "the split batch moved");
            if first.first_seq == sp.first_seq {
                first.rest_from = sp.rest_from;
            }
        }
        // The duty cycle saw young tier-mode data at the tail only if the tail's first batch
        // was durable when it looked; it may have become durable since (and with no hot
        // data recorded the plan below takes the whole tail). Young tier data stays unless
        // the log needs room, and so does everything after it: old data ahead of it moving
        // must not take it along (a stripe of cold data reaches far past the first batch).
        if !self.forced() && !self.under_pressure() {
            batches.truncate(self.before_young_tier(&batches));
        }
        if batches.is_empty() {
            return Ok(None);
        }
        // A stripe as wide as the segments destage may still take: when the capacity tier is
        // nearly full, one segment of the log's data still moves (and leaves garbage behind
        // for GC) where a full-width stripe would not fit.
        let width = {
            let spare = self
                .sh
                .segs
                .lock()
                .free_count()
                .saturating_sub(gc_reserve(&self.sh));
            self.sh.caps.len().min(spare.max(1))
        };
        let mut scope = batches.len();
        if self.keep_hot_allowed() {
            // What this stripe would take: the batches whose cold live data fills one stripe
            // (hot data stays in the log), within what one stripe reads.
            let room = width as u64 * u64::from(self.sh.layout.geo.data_blocks);
            // What is kept is written at the head before the tail moves: it must fit in half
            // the free log, the other half left to host writes meanwhile.
            let hard = self.under_pressure() || self.cache_wants_room;
            // Soft pressure is about hosts writing one or two at a time; an idle drain is
            // about hosts not writing at all.
            let needs_room = hard || (!self.idle_drain && self.soft_pressure());
            let pressure = needs_room || self.idle_drain;
            // Without pressure the question is only whether cold data near the tail fills a
            // stripe: looking past four stripes of live data costs more than it finds. Under
            // soft pressure a step stays as small, so paced steps stay short.
            let max_live = if hard {
                self.free_log_blocks() / 2
            } else {
                (self.free_log_blocks() / 2).min(4 * room)
            };
            let s = self.survey(&batches, room, max_live);
            let all_seen = s.batches == batches.len();
            // What writing the tail again at the head would write: its live data, and the
            // read cache's copies, most of which the pass writes again too (`second_chance`)
            // unless the cache wants room. (Counted as garbage, the copies made a tail with
            // nothing overwritten look worth writing again: at a standstill the destager
            // went round the log writing the same data, freeing nothing, until the cache
            // had been evicted.)
            let kept = match self.cache_wants_room {
                true => s.live,
                false => s.live + s.cached,
            };
            let keep = if self.tier_behind && !hard {
                // Cold data moves up to the tier data due to move, hot data stays.
                Some(false)
            } else if self.idle_drain && !hard {
                // An idle drain moves the tail as it is, hot data too: written again at the
                // head, it held the drain up at every pass while the passes evicted the read
                // cache's copies the tail went over.
                None
            } else if s.cold >= room
                || (!pressure && all_seen && s.cold > 0)
                || self.tier_tail() == TierTail::Cold
            {
                // A stripe of cold data, all there is, or tier data old enough to move: cold
                // data moves, hot data stays.
                Some(false)
            } else if needs_room && kept * 4 <= s.log_blocks * 3 {
                // The log needs room but holds too little cold data to fill a stripe: the
                // tail's live data, mostly hot, is written again at the head, which frees
                // the overwritten copies around it without writing the capacity tier. (Not
                // for an idle drain, which has the time to move it: writing it again freed
                // nothing but the read cache's copies the tail passed, so the drain went
                // round the log rewriting the same data until the cache was gone.)
                Some(true)
            } else if pressure {
                // The tail is mostly live: keeping it would free little. It moves.
                None
            } else {
                // No room needed and no stripe of cold data yet: hot data stays put.
                return Ok(None);
            };
            if let Some(all) = keep {
                scope = s.batches;
                let refs: Vec<&BatchMeta> = batches[..scope].iter().collect();
                let keep = if all { Keep::LiveExceptTier } else { Keep::Hot };
                self.keep_hot(&refs, keep);
            }
        }
        let (plan, split) = self.plan(&batches[..scope], width);
        if plan.is_empty() {
            return Err(EngineError::Failed(
                "a log batch does not fit a segment".into(),
            ));
        }
        let taken = plan.len() - usize::from(split.is_some());
        let (stripe, moved) = build_stripe(&self.sh, &plan, width)?;
        Ok(Some(NextStripe {
            stripe,
            taken,
            moved,
            split,
        }))
    }

    /// Waits for an in-flight stripe, points the index at it and frees its log space.
    fn finish(&self, f: Inflight<'_>) -> Result<u64, EngineError> {
        let placed = match f.handle.join() {
            Ok(Ok(placed)) => placed,
            Ok(Err(e)) => {
                // A summary may have reached the device: unless the write failed for want of
                // room, such a segment is never reused before the next open (it is not in any
                // checkpoint's recent list, so recovery ignores it).
                crate::room::failed_segment_write(&self.sh, &f.segs, &e, "a destage write");
                return Err(e);
            }
            Err(_) => return Err(EngineError::Failed("segment writer panicked".into())),
        };
        let mut written = 0;
        for (seg, b, _) in &placed {
            let committed = commit_destage(&self.sh, *seg, b)?;
            self.keep_read_copies(*seg, b, &committed);
            written += u64::from(b.used) * BLOCK_U64;
        }
        record_residency(&self.sh, &f.moved);
        let c = &self.sh.counters;
        c.destaged_bytes.fetch_add(written, Ordering::Relaxed);
        c.destage_rate.lock().add(written, Instant::now());
        self.second_chance(f.taken);
        let freed = self.advance_tail(f.taken, f.split)?;
        // What one flush writes stays within the reserve: at most one stripe over the limit.
        if self.sh.tree.read().counts().dirty_nodes >= self.sh.index_dirty_limit {
            meta::flush_index(&self.sh)?;
        }
        Ok(freed)
    }

    /// The oldest batches whose live data fits one stripe (less a margin of one entry per
    /// segment, for runs split across segments), with their live runs; then, when a batch does
    /// not fit whole, the first part of it that does, and where its rest begins. A stripe
    /// that left the room of a part batch unused would be sealed part full for good: GC
    /// cleans only what frees more segments than it writes, and with one capacity device
    /// and 2 MiB batches a segment took three batches, 76% of it.
    fn plan<'b>(
        &self,
        batches: &'b [BatchMeta],
        width: usize,
    ) -> (Vec<Planned<'b>>, Option<Split>) {
        let geo = self.sh.layout.geo;
        let cap_blocks = width as u64 * u64::from(geo.data_blocks);
        let cap_entries = width * (geo.max_entries as usize - 1);
        let (mut blocks, mut entries, mut log_blocks) = (0u64, 0usize, 0u64);
        let mut plan = Vec::new();
        for b in batches {
            // Bound what one step reads from the log.
            if !plan.is_empty() && log_blocks + b.blocks > MAX_STEP_READ_BLOCKS {
                break;
            }
            let runs = live_runs(&self.sh, b);
            let zeros = live_zero_records(&self.sh, b);
            let nb: u64 = runs.iter().map(|r| r.2).sum();
            let ne = runs.len() + zeros.len();
            if blocks + nb > cap_blocks || entries + ne > cap_entries {
                let part = first_part(b, runs, zeros, cap_blocks - blocks, cap_entries - entries);
                if let Some((runs, zeros, rest_from)) = part {
                    plan.push(Planned {
                        batch: b,
                        runs,
                        zeros,
                    });
                    let split = Split {
                        first_seq: b.first_seq,
                        rest_from,
                        part: TailPart {
                            seq: b.records[rest_from.0].seq,
                            block: rest_from.1,
                        },
                    };
                    return (plan, Some(split));
                }
                break;
            }
            blocks += nb;
            entries += ne;
            log_blocks += b.blocks;
            plan.push(Planned {
                batch: b,
                runs,
                zeros,
            });
        }
        (plan, None)
    }

    /// Hot data stays on the fast tier only while there is room for it: not when draining,
    /// and not above the high mark (then everything moves, oldest first).
    fn keep_hot_allowed(&self) -> bool {
        let live = self.live_fill();
        !self.forced() && live < self.sh.cfg.fill_ratio_high && !self.sh.heat.lock().is_empty()
    }

    /// The log needs room now (the write buffer or the whole log above its mark).
    fn under_pressure(&self) -> bool {
        let log = self.sh.log.lock();
        log.fill_ratio() >= self.sh.cfg.fill_ratio_high
            || log.physical_fill_ratio() >= PHYSICAL_FULL
    }

    /// Counts the oldest batches' live and cold live blocks, until the cold ones fill `room`,
    /// the live ones `max_live`, or one step's read limit is reached.
    fn survey(&self, batches: &[BatchMeta], room: u64, max_live: u64) -> Survey {
        self.sh
            .counters
            .destage_surveys
            .fetch_add(1, Ordering::Relaxed);
        let mut s = Survey::default();
        for b in batches {
            if s.cold >= room
                || (s.batches > 0
                    && (s.log_blocks + b.blocks > MAX_STEP_READ_BLOCKS || s.live >= max_live))
            {
                break;
            }
            s.batches += 1;
            s.log_blocks += b.blocks;
            let copies = b.records.iter().filter(|r| r.kind == RecordKind::Cache);
            for r in copies {
                let (seg, block) = (r.layer, r.lba as u32);
                let cache = self.sh.cache.lock();
                s.cached += cache.current(seg, block, r.nblocks as u32, r.data_start);
            }
            for (i, off, n) in live_runs(&self.sh, b) {
                let r = &b.records[i];
                let hot: u64 = self
                    .hot_parts(r.layer, r.lba + off, n)
                    .iter()
                    .map(|p| p.1)
                    .sum();
                s.live += n;
                s.cold += n - hot;
            }
        }
        s
    }

    /// Live volume data on the fast tier against the room the write buffer has (the log less
    /// what the read cache holds): what the log would hold if it had no overwritten copies.
    fn live_fill(&self) -> f64 {
        let live = self.sh.counters.fast_live_blocks.load(Ordering::Relaxed);
        let log = self.sh.log.lock();
        let cache = log.cache_blocks.min(log.cache_budget_blocks);
        live as f64 / log.log_blocks.saturating_sub(cache).max(1) as f64
    }

    /// Writes the hot live blocks of tail batches again at the log head instead of moving them
    /// to the capacity tier: data still being rewritten stays where rewrites are cheap. Each
    /// move halves the block's heat, so data that stops being rewritten soon goes cold. All
    /// moves of a step go to the log writer together, so they share its group commits.
    fn keep_hot(&self, batches: &[&BatchMeta], keep: Keep) {
        // Batches adjacent in the log are read together, up to KEEP_READ_BLOCKS at a time.
        let mut pending = Vec::new();
        let mut i = 0;
        while i < batches.len() {
            let first = batches[i].start;
            let mut end = first + batches[i].blocks;
            let mut j = i + 1;
            while j < batches.len()
                && batches[j].start == end
                && end + batches[j].blocks - first <= KEEP_READ_BLOCKS
            {
                end += batches[j].blocks;
                j += 1;
            }
            let mut parts = Vec::new();
            for b in &batches[i..j] {
                for (k, off, n) in live_runs(&self.sh, b) {
                    let r = &b.records[k];
                    let all = match keep {
                        Keep::Hot => false,
                        Keep::LiveExceptTier => !self.is_tier(r.layer),
                        Keep::Live => true,
                    };
                    let runs = if all {
                        vec![(r.lba + off, n)]
                    } else {
                        self.hot_parts(r.layer, r.lba + off, n)
                    };
                    for (lba, len) in runs {
                        parts.push((r.layer, lba, len, r.data_start + (lba - r.lba), r.born_ms));
                    }
                }
            }
            i = j;
            if parts.is_empty() {
                continue;
            }
            let mut buf = AlignedBuf::new_zeroed(((end - first) * BLOCK_U64) as usize);
            if self
                .sh
                .fast
                .read_at(&mut buf, self.sh.layout.log_byte(first))
                .is_err()
            {
                // Left to the destager, whose read reports the error.
                continue;
            }
            // Sent in rounds no larger than the writer's queue: a round is answered before
            // the next is sent, since the writer may be waiting for room only this thread
            // can free.
            let mut parts = parts.into_iter().peekable();
            while let Some(&(layer, lba, len, from, born)) = parts.peek() {
                let at = ((from - first) * BLOCK_U64) as usize;
                let data = &buf[at..at + (len * BLOCK_U64) as usize];
                match self.submit_rewrite(layer, lba, len, from, born, data) {
                    Ok(Some(p)) => {
                        pending.push(p);
                        parts.next();
                    }
                    Ok(None) => {
                        parts.next();
                    }
                    Err(_) if !pending.is_empty() => self.settle(&mut pending),
                    Err(_) => break,
                }
            }
        }
        self.settle(&mut pending);
    }

    /// Writes the pieces of the batches' zero records still in effect again at the log head,
    /// so a live trim at the tail no longer holds the tail where it is: compaction (the only
    /// way the log is freed while the capacity tier takes nothing) then moves past it. The
    /// new record has a later sequence number than the old, and nothing between the two
    /// touched its blocks (the pieces are those the fast maps still point at the old record,
    /// checked under the range lock that is held until the new record is applied), so replay
    /// of either, or of both in order, leaves the same blocks zeroed.
    fn keep_zeros(&self, batches: &[&BatchMeta]) {
        let mut pending = Vec::new();
        let zeros = batches.iter().flat_map(|b| live_zero_records(&self.sh, b));
        for z in zeros {
            let mut sent = self.submit_zero_rewrite(&z);
            if sent.is_err() && !pending.is_empty() {
                // The writer's queue is full: let it drain, then try once more.
                self.settle_zeros(&mut pending);
                sent = self.submit_zero_rewrite(&z);
            }
            match sent {
                Ok(Some(wait)) => pending.push(wait),
                Ok(None) => {}
                Err(_) => break,
            }
        }
        self.settle_zeros(&mut pending);
    }

    fn settle_zeros(&self, pending: &mut Vec<crate::log::ReplyRx>) {
        for wait in pending.drain(..) {
            // A refused rewrite leaves the old record in effect, where it was.
            let _ = wait.wait();
        }
    }

    /// Like a host trimming the piece again, under the same range lock; skipped when a host
    /// holds the range or the piece is no longer the old record's.
    fn submit_zero_rewrite(
        &self,
        z: &LiveZero,
    ) -> Result<Option<crate::log::ReplyRx>, EngineError> {
        let Some((req, wait)) = self.zero_rewrite(z, false) else {
            return Ok(None);
        };
        // Never block on a full queue: the log writer may be waiting for space only this
        // thread can free.
        self.tx.try_send(req).map_err(|_| EngineError::NoSpace)?;
        Ok(Some(wait))
    }

    /// The request `submit_zero_rewrite` sends (holding the range until it is answered, or
    /// dropped), or None when it would be skipped.
    fn zero_rewrite(
        &self,
        z: &LiveZero,
        rotation: bool,
    ) -> Option<(WriteReq, crate::log::ReplyRx)> {
        let (done, wait) = answer_releasing(&self.sh, z.layer, z.lba, z.lba + z.nblocks)?;
        let still_live = {
            let idx = self.sh.index.read();
            idx.layers.get(&z.layer).is_some_and(|l| {
                l.fast.lookup(z.lba, z.nblocks)
                    == vec![crate::map::Piece {
                        lba: z.lba,
                        len: z.nblocks,
                        loc: Some(Loc::Zero(z.seq)),
                    }]
            })
        };
        if !still_live {
            return None;
        }
        let req = WriteReq {
            kind: RecordKind::Zero,
            layer: z.layer,
            lba: z.lba,
            nblocks: z.nblocks,
            data: None,
            done,
            no_wait: true,
            relocation: true,
            rotation,
            born_ms: None,
            cache_gen: 0,
            vol: 0,
            cache_copy: crate::log::CacheCopy::Again,
        };
        Some((req, wait))
    }

    /// Waits for the rewrites sent; those that completed cool their blocks.
    fn settle(&self, pending: &mut Vec<Pending>) {
        for (wait, layer, lba, len) in pending.drain(..) {
            if wait.wait().is_ok() {
                self.cool(layer, lba, len);
            }
        }
    }

    /// Sub-runs of `[lba, lba+n)` hot enough to stay: with any heat (overwritten recently),
    /// or for a tier-mode volume, heat (rewrites and reads) above its policy's cold mark.
    fn hot_parts(&self, layer: u32, lba: u64, n: u64) -> Vec<(u64, u64)> {
        let cold_mark = self
            .sh
            .layer_runtime(layer)
            .map(|rt| rt.policy())
            .filter(|p| p.mode == Mode::Tier)
            .map_or(0, |p| p.tier_max_cold_heat);
        let heat = self.sh.heat.lock();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for b in lba..lba + n {
            if heat.get(layer, b) <= cold_mark {
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
    /// range or the data moved meanwhile. The lock goes with the request and is released as
    /// its batch is answered: a host write to the range waits for that batch only, not for
    /// the whole survey's rewrites (up to ~200 ms at queue depth 32).
    fn submit_rewrite(
        &self,
        layer: u32,
        lba: u64,
        len: u64,
        from: u64,
        born_ms: u64,
        bytes: &[u8],
    ) -> Result<Option<Pending>, EngineError> {
        let run = Rewrite {
            layer,
            lba,
            len,
            from,
            born_ms,
        };
        let Some((req, wait)) = self.rewrite(&run, bytes, false) else {
            return Ok(None);
        };
        // Never block on a full queue: the log writer may be waiting for space only this
        // thread can free.
        self.tx.try_send(req).map_err(|_| EngineError::NoSpace)?;
        Ok(Some((wait, layer, lba, len)))
    }

    /// The request `submit_rewrite` sends (holding the range until it is answered, or
    /// dropped), or None when it would be skipped.
    fn rewrite(
        &self,
        run: &Rewrite,
        bytes: &[u8],
        rotation: bool,
    ) -> Option<(WriteReq, crate::log::ReplyRx)> {
        let Rewrite {
            layer,
            lba,
            len,
            from,
            born_ms,
        } = *run;
        let (done, wait) = answer_releasing(&self.sh, layer, lba, lba + len)?;
        let still_here = {
            let idx = self.sh.index.read();
            let l = idx.layers.get(&layer)?;
            l.fast.lookup(lba, len)
                == vec![crate::map::Piece {
                    lba,
                    len,
                    loc: Some(Loc::Fast(from)),
                }]
        };
        if !still_here {
            return None;
        }
        let mut data = AlignedBuf::new_zeroed(bytes.len());
        data.copy_from_slice(bytes);
        for (k, chunk) in data.chunks(BLOCK).enumerate() {
            if crc32c::crc32c(chunk)
                != self.sh.fast_crcs[(from + k as u64) as usize].load(Ordering::Relaxed)
            {
                // A damaged block is left for the destager, which keeps its original crc so the
                // damage stays detectable; rewriting it here would give it a fresh, valid crc.
                return None;
            }
        }
        let req = WriteReq {
            kind: RecordKind::Write,
            layer,
            lba,
            nblocks: len,
            data: Some(data),
            done,
            no_wait: true,
            relocation: true,
            rotation,
            born_ms: Some(born_ms),
            cache_gen: 0,
            vol: 0,
            cache_copy: crate::log::CacheCopy::Again,
        };
        Some((req, wait))
    }

    fn is_tier(&self, layer: u32) -> bool {
        self.sh
            .layer_runtime(layer)
            .is_some_and(|rt| rt.policy().mode == Mode::Tier)
    }

    fn cool(&self, layer: u32, lba: u64, len: u64) {
        // Tier mode counts heat since the data last moved (a kept block waits for more
        // evidence); in cache mode heat fades with the writes elsewhere only.
        if self.is_tier(layer) {
            let mut heat = self.sh.heat.lock();
            for b in lba..lba + len {
                heat.halve(layer, b);
            }
        }
        self.sh
            .counters
            .hot_kept_bytes
            .fetch_add(len * BLOCK_U64, Ordering::Relaxed);
    }

    /// Allocates a segment for each builder of the stripe (one per device).
    pub(crate) fn place(
        &self,
        stripe: Vec<Builder>,
    ) -> Result<Vec<(u32, Builder, u64)>, EngineError> {
        let mut placed = Vec::with_capacity(stripe.len());
        let mut segs = self.sh.segs.lock();
        for b in stripe {
            let Some(seg) = segs.alloc(gc_reserve(&self.sh)) else {
                for (s, _, _) in &placed {
                    segs.unallocate(*s);
                }
                self.sh
                    .counters
                    .capacity_blocked
                    .store(true, Ordering::Relaxed);
                return Err(EngineError::NoSpace);
            };
            let seq = segs.next_seq;
            segs.next_seq += 1;
            placed.push((seg, b, seq));
        }
        self.sh
            .counters
            .capacity_full
            .store(false, Ordering::Relaxed);
        self.sh
            .counters
            .capacity_blocked
            .store(false, Ordering::Relaxed);
        Ok(placed)
    }

    /// Records the new log tail durably, then frees the log space before it.
    ///
    /// `durable` is held until the batches are gone from the log: every other checkpoint
    /// takes its tail from the log under that lock, and one written in between would name
    /// the old tail again while the space behind the new one is handed out to new batches.
    /// After a power cut, replay would then start at a block that holds a newer batch and
    /// lose every acknowledged write from there on.
    ///
    /// `split`: the batch after those freed, when a stripe just committed took the first part
    /// of it. That batch is the new tail, and the checkpoint says which part of it is on the
    /// capacity tier (`Checkpoint::tail_destaged`), so that a replay does not bring that part
    /// back into the log.
    fn advance_tail(&self, batches: usize, split: Option<Split>) -> Result<u64, EngineError> {
        let mut d = self.sh.durable.lock();
        let tail = {
            let log = self.sh.log.lock();
            match log.batches.get(batches) {
                Some(b) => (b.start, b.first_seq),
                None => (log.head, log.next_seq),
            }
        };
        if let Some(sp) = split {
            debug_assert_eq!(sp.first_seq, tail.1, "the split batch is not the new tail");
        }
        // A part of another batch is dropped: only the tail batch's may be named.
        d.tail_part = match split.filter(|sp| sp.first_seq == tail.1) {
            Some(sp) => Some((sp.first_seq, sp.part)),
            None => d.tail_part.filter(|&(first_seq, _)| first_seq == tail.1),
        };
        self.sh.write_checkpoint_locked(&mut d, tail)?;
        #[cfg(test)]
        if let Some(hook) = self.sh.after_tail_checkpoint.lock().as_ref() {
            hook(tail);
        }
        let excl = self.sh.reclaim.write();
        let mut log = self.sh.log.lock();
        // A rotation's group ends here: the blocks it took count for every batch again, as
        // the tail's it frees do (see `LogState::rotation_outstanding_blocks`).
        log.rotation_outstanding_blocks = 0;
        let mut freed = 0;
        let mut cached = Vec::new();
        for _ in 0..batches {
            if let Some(b) = log.pop() {
                freed += (b.blocks + b.skip) * BLOCK_U64;
                cached.extend(
                    b.records
                        .iter()
                        .filter(|r| r.kind == RecordKind::Cache),
                );
            }
        }
        drop(log);
        drop(d);
        // Still shut out of the log's blocks, readers must not find these copies afterwards:
        // one would read whatever batch takes their blocks next, checksums and all.
        self.forget_cached(&cached);
        drop(excl);
        #[cfg(test)]
        {
            let hook = self.sh.after_tail_freed.lock().clone();
            if let Some(hook) = hook {
                hook();
            }
        }
        self.sh.log_space_freed();
        self.sh
            .counters
            .log_freed_bytes
            .fetch_add(freed, Ordering::Relaxed);
        Ok(freed)
    }

    /// Blocks a host read while they were in the write log stay readable from the fast tier
    /// after they move: a clean copy of each (from the segment just written, still in memory)
    /// goes into the read cache, for volumes whose policy promotes at all. Never waits; a copy
    /// with no room or no queue slot is skipped (the data is safe on the capacity tier).
    fn keep_read_copies(&self, seg: u32, b: &Builder, committed: &[Committed]) {
        if self.sh.cfg.read_cache_ratio <= 0.0 || self.forced() {
            return;
        }
        let gen = self.sh.cache.lock().gen_of(seg);
        for c in committed {
            let Some(rt) = self.sh.layer_runtime(c.layer) else {
                continue;
            };
            if rt.policy().promote_after_reads == 0 {
                continue;
            }
            // A block whose bytes no longer match the crc the segment keeps for it was damaged
            // in the log: a copy of it would get a fresh, valid crc and be read as data.
            let intact = |k: u64| {
                let block = (c.to_block as u64 + k) as usize;
                let at = block * BLOCK;
                crc32c::crc32c(&b.data[at..at + BLOCK]) == b.crcs[block]
            };
            let marked = |k: u64| self.sh.fast_read.is_marked(c.from + k) && intact(k);
            let mut k = 0;
            while k < c.len {
                if !marked(k) {
                    k += 1;
                    continue;
                }
                let mut end = k + 1;
                while end < c.len && marked(end) {
                    end += 1;
                }
                let block = c.to_block + k as u32;
                let n = end - k;
                let at = block as usize * BLOCK;
                let data = &b.data[at..at + (n * BLOCK_U64) as usize];
                if self.sh.log.lock().cache_has_room(n) {
                    let kept = crate::log::CacheCopy::Kept;
                    let done = crate::log::Done::Call(Box::new(|_| {}));
                    crate::tiering::send_cache_copy(
                        &self.tx, kept, rt.id, seg, block, gen, data, done,
                    );
                }
                k = end;
            }
        }
    }

    /// Cached copies the tail is about to pass that were read since they were written get
    /// written again at the head (a fast-tier write; nothing moves to the capacity tier).
    fn second_chance(&self, batches: usize) {
        let (records, fill): (Vec<RecMeta>, f64) = {
            let log = self.sh.log.lock();
            let fill = log.cache_blocks as f64 / log.cache_budget_blocks.max(1) as f64;
            let records = log
                .batches
                .iter()
                .take(batches)
                .flat_map(|b| {
                    b.records
                        .iter()
                        .filter(|r| r.kind == RecordKind::Cache)
                        .copied()
                })
                .collect();
            (records, fill)
        };
        if records.is_empty() {
            return;
        }
        // Draining empties the log: every copy the tail passes is dropped.
        if self.forced() {
            return;
        }
        self.sh.cache.lock().adapt(fill);
        // Past the high mark host writes wait for room: copies nobody read since the last
        // pass are dropped, not written again (each such pass cost host writes its share of
        // the log bandwidth, and the log filled while the tail went round the cache).
        let keep_idle = !self.under_pressure();
        let mut pending = Vec::new();
        for r in records {
            let (seg, block0) = (r.layer, r.lba as u32);
            let mut i = 0;
            while i < r.nblocks as u32 {
                let keep = |k: u32| {
                    self.sh.cache.lock().take_second_chance(
                        seg,
                        block0 + k,
                        r.data_start + u64::from(k),
                        keep_idle,
                    )
                };
                if !keep(i) {
                    i += 1;
                    continue;
                }
                let mut j = i + 1;
                while j < r.nblocks as u32 && keep(j) {
                    j += 1;
                }
                self.recache(&r, i, j, &mut pending);
                i = j;
            }
        }
        // The new copies are in the index before the tail passes the old ones, so the cache
        // keeps them (and their history) without a gap.
        for done in pending {
            let _ = done.wait();
        }
    }

    /// Writes blocks `i..j` of a cache record again at the log head, if they read back intact;
    /// never waits for log space (a copy with no room is dropped at the tail).
    fn recache(&self, r: &RecMeta, i: u32, j: u32, pending: &mut Vec<crate::log::ReplyRx>) {
        let from = r.data_start + u64::from(i);
        let mut data = AlignedBuf::new_zeroed((j - i) as usize * BLOCK);
        if self
            .sh
            .fast
            .read_at(&mut data, self.sh.layout.log_byte(from))
            .is_err()
        {
            return;
        }
        let intact = data.chunks(BLOCK).enumerate().all(|(k, c)| {
            crc32c::crc32c(c) == self.sh.fast_crcs[from as usize + k].load(Ordering::Relaxed)
        });
        if !intact {
            return;
        }
        let (done, wait) = crate::log::reply_pair();
        let req = WriteReq {
            kind: RecordKind::Cache,
            layer: r.layer,
            lba: r.lba + u64::from(i),
            nblocks: u64::from(j - i),
            data: Some(data),
            done: crate::log::Done::Chan(done),
            no_wait: true,
            relocation: true,
            rotation: false,
            born_ms: Some(r.born_ms),
            cache_gen: r.cache_gen,
            vol: r.vol,
            cache_copy: crate::log::CacheCopy::Again,
        };
        let mut req = req;
        loop {
            match self.tx.try_send(req) {
                Ok(()) => {
                    pending.push(wait);
                    return;
                }
                // A full queue: let the writes already queued finish, then try once more.
                Err(crossbeam_channel::TrySendError::Full(back)) if !pending.is_empty() => {
                    for p in pending.drain(..) {
                        let _ = p.wait();
                    }
                    req = back;
                }
                Err(_) => return,
            }
        }
    }

    /// The log space of these cache records is being reused: their copies are gone.
    fn forget_cached(&self, records: &[RecMeta]) {
        if records.is_empty() {
            return;
        }
        let mut evicted = Vec::new();
        {
            let mut cache = self.sh.cache.lock();
            for r in records {
                evicted.push(cache.forget(r.layer, r.lba as u32, r.nblocks as u32, r.data_start));
            }
        }
        for gone in &evicted {
            crate::tiering::count_evicted(&self.sh, gone);
        }
    }

    fn measure(&self, started: Instant, freed: u64) {
        let busy = started.elapsed().as_secs_f64().max(1e-6);
        let c = &self.sh.counters;
        let bw = Counters::get_f64(&c.destage_bw_bytes_per_s);
        let sample = freed as f64 / busy;
        Counters::set_f64(
            &c.destage_bw_bytes_per_s,
            if bw == 0.0 {
                sample
            } else {
                0.8 * bw + 0.2 * sample
            },
        );
    }

    /// One round of cost-benefit cleaning: packs the live data of the best victims into one
    /// new segment; the victims become free once the index no longer needs them. Returns
    /// whether it cleaned anything.
    pub fn gc_step(&mut self) -> Result<bool, EngineError> {
        self.gc_step_for(1)
    }

    /// `gc_step`, cleaning only if it frees at least `min_gain` segments per segment it
    /// writes (and always more than it writes); with a `min_gain` above 1 the emptiest
    /// segments are taken first.
    fn gc_step_for(&mut self, min_gain: usize) -> Result<bool, EngineError> {
        if Instant::now() < self.gc_backoff_until {
            return Ok(false);
        }
        let plan = self.gc_plan(min_gain > 1)?;
        // The victims' live runs, in order, split across output segments as they fill.
        let geo = self.sh.layout.geo;
        let mut parts = vec![vec![Vec::new(); GC_OUTPUTS]; plan.len()];
        let mut fill = [(0u64, 0usize); GC_OUTPUTS];
        let mut k = 0;
        for (v, p) in plan.iter().enumerate() {
            for &(i, mut off, mut n) in &p.runs {
                while n > 0 {
                    let room = u64::from(geo.data_blocks) - fill[k].0;
                    if room == 0 || fill[k].1 + 1 > geo.max_entries as usize {
                        k += 1;
                        if k == GC_OUTPUTS {
                            return Ok(false);
                        }
                        continue;
                    }
                    let take = room.min(n);
                    parts[v][k].push((i, off, take));
                    fill[k].0 += take;
                    fill[k].1 += 1;
                    off += take;
                    n -= take;
                }
            }
        }
        // Worth it when it frees more segments than it writes.
        let used = fill.iter().filter(|f| f.1 > 0).count();
        if plan.len() <= used || plan.len() < min_gain * used {
            // Nothing to gain now; look again after the index has had time to change (cheap
            // cleaning, which reads the candidates' summaries to find out, less often).
            let wait = if min_gain > 1 { 1000 } else { 200 };
            self.gc_backoff_until = Instant::now() + Duration::from_millis(wait);
            return Ok(false);
        }
        let mut builders: Vec<Builder> = (0..used).map(|_| Builder::new(geo)).collect();
        for (p, runs) in plan.iter().zip(&parts) {
            for (b, r) in builders.iter_mut().zip(runs) {
                add_seg_runs(&self.sh, b, p.seg, &p.summary, r)?;
            }
        }
        for builder in builders.iter().filter(|b| !b.is_empty()) {
            let (seg, seq) = {
                let mut segs = self.sh.segs.lock();
                // GC may dip into the index's reserve: the flush after it frees more than it used.
                let Some(seg) = segs.alloc(self.sh.meta_reserve / 2) else {
                    return Ok(false);
                };
                let seq = segs.next_seq;
                segs.next_seq += 1;
                (seg, seq)
            };
            if let Err(e) = write_segment(&self.sh, seg, builder, seq) {
                crate::room::failed_segment_write(&self.sh, &[seg], &e, "a GC write");
                return Err(e);
            }
            commit_relocation(&self.sh, seg, builder)?;
            self.sh
                .counters
                .gc_relocated_bytes
                .fetch_add(u64::from(builder.used) * BLOCK_U64, Ordering::Relaxed);
        }
        let mut segs = self.sh.segs.lock();
        for p in &plan {
            let s = &segs.segs[p.seg as usize];
            debug_assert!(
                s.live_blocks == 0,
                "GC victim {} still has {} live blocks",
                p.seg,
                s.live_blocks
            );
            if s.state == SegState::Sealed && s.live_blocks == 0 {
                segs.release(p.seg, 0);
            }
        }
        drop(segs);
        self.sh
            .counters
            .gc_segments_cleaned
            .fetch_add(plan.len() as u64, Ordering::Relaxed);
        // The victims are reusable once an index without references to them is durable.
        self.maint.want_flush = true;
        Ok(true)
    }

    /// Chooses victims, best first, whose live data fits `GC_OUTPUTS` segments (with an entry to spare per
    /// segment for a run split between two). Several outputs let GC free a segment when the
    /// garbage is spread thin (five victims 75% live fill four segments).
    fn gc_plan(&self, emptiest_first: bool) -> Result<Vec<GcVictim>, EngineError> {
        let geo = self.sh.layout.geo;
        let max_blocks = GC_OUTPUTS as u64 * u64::from(geo.data_blocks);
        let max_entries = GC_OUTPUTS * (geo.max_entries as usize - 1);
        let (mut blocks, mut entries) = (0u64, 0usize);
        let mut plan = Vec::new();
        let candidates = gc_candidates(&self.sh, emptiest_first)
            .into_iter()
            .filter(|&seg| !passed_over(&self.sh, seg));
        for seg in candidates.take(64) {
            let live = u64::from(self.sh.segs.lock().segs[seg as usize].live_blocks);
            if blocks + live > max_blocks {
                continue;
            }
            let summary = match load_summary(&self.sh, seg) {
                Ok(s) => s,
                Err(e) => {
                    pass_over(&self.sh, seg, &e);
                    continue;
                }
            };
            let (summary, runs) = live_seg_runs(&self.sh, seg, summary)?;
            let b: u64 = runs.iter().map(|r| r.2).sum();
            if blocks + b > max_blocks || entries + runs.len() > max_entries {
                // Another candidate may still fit.
                continue;
            }
            blocks += b;
            entries += runs.len();
            plan.push(GcVictim { seg, summary, runs });
        }
        Ok(plan)
    }
}

/// A segment GC passes over because its summary could not be read (`Shared::gc_passed_over`):
/// GC needs the summary's entries to know what the segment's blocks are. Its blocks still
/// read (their crcs are in the crc blocks, apart from the header). Before, GC's plan stopped at
/// the first such candidate: with it among the best, GC cleaned nothing, ever, and read the
/// summary again at every look.
#[derive(Debug, Clone, Copy)]
pub struct PassedOver {
    /// The segment's use when it was passed over: a segment used again is looked at again.
    sealed_unix_s: u32,
    used_blocks: u32,
    /// For a read that failed rather than a summary found damaged, when to try it again.
    retry_at: Option<Instant>,
}

/// How long GC leaves a segment whose summary could not be read (an I/O error, perhaps
/// passing) before it tries again.
const PASS_OVER_RETRY: Duration = Duration::from_secs(60);

/// Whether GC passes over `seg` (see `PassedOver`).
fn passed_over(sh: &Shared, seg: u32) -> bool {
    let mut map = sh.gc_passed_over.lock();
    let Some(p) = map.get(&seg).copied() else {
        return false;
    };
    let info = sh.segs.lock().segs[seg as usize];
    let same_use = info.state == SegState::Sealed
        && info.sealed_unix_s == p.sealed_unix_s
        && info.used_blocks == p.used_blocks;
    if same_use && p.retry_at.is_none_or(|at| Instant::now() < at) {
        return true;
    }
    map.remove(&seg);
    false
}

/// Notes that GC cannot read `seg`'s summary (`load_summary` logged why), and says what it
/// means once.
fn pass_over(sh: &Shared, seg: u32, e: &EngineError) {
    let info = sh.segs.lock().segs[seg as usize];
    let damaged = matches!(e, EngineError::Corrupt(_));
    let p = PassedOver {
        sealed_unix_s: info.sealed_unix_s,
        used_blocks: info.used_blocks,
        retry_at: (!damaged).then(|| Instant::now() + PASS_OVER_RETRY),
    };
    let again = match damaged {
        true => "",
        false => " (tried again in a minute)",
    };
    if sh.gc_passed_over.lock().insert(seg, p).is_none() {
        tracing::warn!(
            segment = seg,
            live_blocks = info.live_blocks,
            "garbage collection cannot clean capacity segment {seg}: {e}. Its live blocks still \
             read (`strata scrub` checks them); its space stays used until they are overwritten, \
             trimmed or deleted{again}"
        );
    }
}

/// Whether any volume is in tier mode.
fn any_tier_volume(sh: &Shared) -> bool {
    let vols = sh.vols.read();
    vols.by_volume
        .values()
        .any(|rt| rt.policy().mode == Mode::Tier)
}

/// Live data of a log batch or segment: (record or entry index, first block in it, blocks).
type LiveRuns = Vec<(usize, u64, u64)>;
/// A batch chosen for a stripe, or the first part of one: its live runs and the pieces of
/// its zero records still in effect.
struct Planned<'b> {
    batch: &'b BatchMeta,
    runs: LiveRuns,
    zeros: Vec<LiveZero>,
}

/// A batch a stripe took only the first part of: its first sequence number, and where the
/// rest begins (record index, block in that record; see `BatchMeta::rest_from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Split {
    first_seq: u64,
    rest_from: (usize, u64),
    /// The same place as the checkpoint names it (record seq, block in that record).
    part: TailPart,
}
/// A segment of a stripe: (segment, content, segment sequence number).
type Placed = (u32, Builder, u64);

/// A stripe being written by a scoped thread, and the log batches it empties.
struct Inflight<'s> {
    handle: std::thread::ScopedJoinHandle<'s, Result<Vec<Placed>, EngineError>>,
    /// The segments it writes.
    segs: Vec<u32>,
    taken: usize,
    moved: Vec<Moved>,
    /// The batch after those it takes whole, when it takes the first part of that one.
    split: Option<Split>,
}

/// A stripe to write, the log batches it takes whole, what it moves, and the batch after
/// them when the stripe takes only the first part of it.
struct NextStripe {
    stripe: Vec<Builder>,
    taken: usize,
    moved: Vec<Moved>,
    split: Option<Split>,
}

/// A rewrite sent to the log writer: its answer, layer, lba and length.
type Pending = (crate::log::ReplyRx, u32, u64, u64);

/// Holds `[start, end)` of a layer for a request (None if a host holds part of it) and
/// returns the request's answer and the wait for it. The range is free again as soon as the
/// request is answered, or dropped unanswered.
fn answer_releasing(
    sh: &Arc<Shared>,
    layer: u32,
    start: u64,
    end: u64,
) -> Option<(crate::log::Done, crate::log::ReplyRx)> {
    let claim = crate::shared::RangeClaim::try_new(sh, layer, start, end)?;
    let (done, wait) = crate::log::reply_pair();
    let answer = move |r| {
        drop(claim);
        done.send(r);
    };
    Some((crate::log::Done::Call(Box::new(answer)), wait))
}

struct GcVictim {
    seg: u32,
    summary: Arc<SegmentSummary>,
    runs: Vec<(usize, u64, u64)>,
}

/// Destages the log whatever its fill (`Shared::drain`) until `done` says of it, for `wait` at
/// most or until the group stops running; whether it got there.
pub(crate) fn drain_until(
    sh: &Shared,
    wait: Duration,
    done: impl Fn(&crate::log::LogState) -> bool,
) -> bool {
    // Set again each time: another drain that ends first clears it.
    let ask = || sh.drain.store(true, Ordering::Relaxed);
    let reached = ask_destager_until(sh, wait, ask, || done(&sh.log.lock()));
    sh.drain.store(false, Ordering::Relaxed);
    reached
}

/// Asks the destager for something (`ask`) and wakes it, again every few milliseconds, until
/// `done`, for `wait` at most or until the group stops; whether `done` came.
pub(crate) fn ask_destager_until(
    sh: &Shared,
    wait: Duration,
    ask: impl Fn(),
    done: impl Fn() -> bool,
) -> bool {
    let deadline = Instant::now() + wait;
    loop {
        ask();
        sh.wake_destager();
        if done() {
            return true;
        }
        if Instant::now() >= deadline || sh.check_running().is_err() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Destages the write log until its tail is past the batch at `seq` (the tail's checkpoint then
/// names a later batch, so a start no longer reads it); whether it got there within `wait`.
pub(crate) fn destage_past(sh: &Shared, seq: u64, wait: Duration) -> bool {
    drain_until(sh, wait, |log| {
        log.batches.front().is_none_or(|b| b.first_seq > seq)
    })
}

/// How long no record is acknowledged before the destager marks where the log ends
/// (`Destager::mark_log_end`).
const END_MARK_AFTER: Duration = Duration::from_secs(1);

/// Host bytes appended to the log so far.
fn append_total(sh: &Shared) -> u64 {
    sh.counters.log_host_appended_bytes.load(Ordering::Relaxed)
}

/// Free segments below which GC runs.
pub fn gc_trigger(sh: &Shared) -> usize {
    gc_reserve(sh) + 1 + sh.caps.len()
}

/// Free segments kept back from destage so GC and the index always have somewhere to write.
pub fn gc_reserve(sh: &Shared) -> usize {
    sh.meta_reserve + 1
}

/// Sealed data segments worth cleaning, best first: LFS's benefit/cost = (1-u) * age / (1+u);
/// when space is short, or when asked, the emptiest first (what frees the most now).
fn gc_candidates(sh: &Shared, emptiest_first: bool) -> Vec<u32> {
    let short = emptiest_first || sh.segs.lock().free_count() <= gc_reserve(sh);
    let segs = sh.segs.lock();
    let now = unix_now_s() as f64;
    let mut scored: Vec<(f64, u32)> = segs
        .segs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.state == SegState::Sealed && s.live_blocks < sh.layout.geo.data_blocks)
        .map(|(i, s)| {
            let u = f64::from(s.live_blocks) / f64::from(sh.layout.geo.data_blocks.max(1));
            let age = (now - f64::from(s.sealed_unix_s)).max(0.0) + 1.0;
            let score = if short {
                1.0 - u
            } else {
                (1.0 - u) * age / (1.0 + u)
            };
            (score, i as u32)
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    scored.into_iter().map(|(_, s)| s).collect()
}

/// The part of record `i` of a batch the destager still has to move, as (first block offset
/// in the record, blocks): all of it, unless the batch's `rest_from` is past its start. The
/// rule is the checkpoint's (`TailPart::rest_of`), with record indexes for sequence numbers.
fn unmoved(b: &BatchMeta, i: usize) -> Option<(u64, u64)> {
    let (rec, off) = b.rest_from;
    let part = TailPart {
        seq: rec as u64,
        block: off,
    };
    part.rest_of(i as u64, b.records[i].nblocks)
}

/// The part of a batch's live data (`runs` and `zeros`, as `live_runs` and
/// `live_zero_records` give them) that fits `room` blocks and `entries` summary entries,
/// taken in record order: its runs, its zero pieces, and where the rest begins (record index,
/// block in that record). None when nothing fits, or everything does.
fn first_part(
    b: &BatchMeta,
    runs: LiveRuns,
    zeros: Vec<LiveZero>,
    mut room: u64,
    mut entries: usize,
) -> Option<(LiveRuns, Vec<LiveZero>, (usize, u64))> {
    let (mut runs, mut zeros) = (runs.into_iter().peekable(), zeros.into_iter().peekable());
    let (mut took_runs, mut took_zeros) = (Vec::new(), Vec::new());
    let rest_from = loop {
        // The next piece in record order (a record is a write or a zero record, never both).
        let run_at = runs.peek().map(|&(i, off, _)| (i, off));
        let zero_at = zeros.peek().map(|z| (z.rec, z.lba - b.records[z.rec].lba));
        let next_is_run = match (run_at, zero_at) {
            (None, None) => return None,
            (Some(r), Some(z)) => r < z,
            (r, _) => r.is_some(),
        };
        let at = if next_is_run { run_at } else { zero_at }.expect("a piece");
        if entries == 0 || (next_is_run && room == 0) {
            break at;
        }
        entries -= 1;
        if !next_is_run {
            took_zeros.extend(zeros.next());
            continue;
        }
        let (i, off, n) = runs.next().expect("a run");
        let take = n.min(room);
        took_runs.push((i, off, take));
        room -= take;
        if take < n {
            break (i, off + take);
        }
    };
    (!took_runs.is_empty() || !took_zeros.is_empty()).then_some((took_runs, took_zeros, rest_from))
}

/// Live data of a log batch as (record index, first block offset in record, blocks).
pub(crate) fn live_runs(sh: &Shared, b: &BatchMeta) -> Vec<(usize, u64, u64)> {
    let idx = sh.index.read();
    let mut out = Vec::new();
    for (i, r) in b.records.iter().enumerate() {
        if r.kind != RecordKind::Write || !idx.layer_live(r.layer) {
            continue;
        }
        let Some(l) = idx.layers.get(&r.layer) else {
            continue;
        };
        let Some((from, n)) = unmoved(b, i) else {
            continue;
        };
        for p in l.fast.lookup(r.lba + from, n) {
            let off = p.lba - r.lba;
            if p.loc == Some(Loc::Fast(r.data_start + off)) {
                out.push((i, off, p.len));
            }
        }
    }
    out
}

/// A piece of a zero record that still makes its blocks read as zeros.
pub(crate) struct LiveZero {
    /// The record's index in its batch.
    rec: usize,
    layer: u32,
    lba: u64,
    nblocks: u64,
    seq: u64,
}

/// The pieces of a batch's zero records still in effect. Only those pieces go into a
/// segment's summary: a whole record could, at recovery, zero blocks written since by a write
/// that reached the index before it (a bypassed write, see bypass.rs).
pub(crate) fn live_zero_records(sh: &Shared, b: &BatchMeta) -> Vec<LiveZero> {
    let idx = sh.index.read();
    let mut out = Vec::new();
    for (i, r) in b.records.iter().enumerate() {
        if r.kind != RecordKind::Zero || !idx.layer_live(r.layer) {
            continue;
        }
        let Some(l) = idx.layers.get(&r.layer) else {
            continue;
        };
        let Some((from, n)) = unmoved(b, i) else {
            continue;
        };
        for p in l.fast.lookup(r.lba + from, n) {
            if p.loc == Some(Loc::Zero(r.seq)) {
                out.push(LiveZero {
                    rec: i,
                    layer: r.layer,
                    lba: p.lba,
                    nblocks: p.len,
                    seq: r.seq,
                });
            }
        }
    }
    out
}

/// The capacity index changes that make it agree with zero records still in effect where it
/// points into a segment: those pieces read as zeros (a layer with a parent must hide the
/// parent's blocks) or as nothing.
fn zeroed_capacity_sets(sh: &Shared, zeros: &[LiveZero]) -> Result<Vec<TreeSet>, EngineError> {
    let mut sets = Vec::new();
    for z in zeros {
        let parent = sh.index.read().layers.get(&z.layer).map(|l| l.rec.parent);
        let Some(parent) = parent else { continue };
        let zero = (parent != 0).then_some(Loc::Zero(0));
        let (a, e) = (key_of(z.layer, z.lba), key_of(z.layer, z.lba + z.nblocks));
        let found = meta::with_tree_read(sh, |t| {
            let mut v = Vec::new();
            t.lookup(a, e, &mut v).map(|()| v)
        })?;
        for en in found.iter().filter(|en| matches!(en.loc, Loc::Cap { .. })) {
            sets.push(TreeSet {
                layer: z.layer,
                lba: z.lba + (en.key - a) as u64,
                len: en.len,
                loc: zero,
            });
        }
    }
    Ok(sets)
}

/// One live run read from the log, ready to go into a segment.
struct LiveRun<'a> {
    layer: u32,
    lba: u64,
    seq: u64,
    born_ms: u64,
    first: u64,
    data: &'a [u8],
}

/// Reads each planned batch's data with one sequential read, then lays the live runs of all
/// of them into the stripe's segments in address order (coalescing by address), followed by
/// the pieces of zero records still in effect.
fn build_stripe(
    sh: &Shared,
    plan: &[Planned<'_>],
    width: usize,
) -> Result<(Vec<Builder>, Vec<Moved>), EngineError> {
    // Each batch's live data is read with one read, from its first live block to its last.
    let mut bufs = Vec::with_capacity(plan.len());
    for p in plan {
        let span = p.runs.iter().map(|&(i, off, n)| {
            let first = p.batch.records[i].data_start + off;
            (first, first + n)
        });
        let (lo, hi) = span.fold((u64::MAX, 0), |(lo, hi), (a, z)| (lo.min(a), hi.max(z)));
        if lo >= hi {
            bufs.push((0, AlignedBuf::new_zeroed(0)));
            continue;
        }
        let mut buf = AlignedBuf::new_zeroed(((hi - lo) * BLOCK_U64) as usize);
        sh.fast.read_at(&mut buf, sh.layout.log_byte(lo))?;
        // A live block that does not match its crc is read again (reread.rs): moved as read,
        // a passing fault would become lasting damage once the log's copy is freed.
        for &(i, off, n) in &p.runs {
            let first = p.batch.records[i].data_start + off;
            let at = ((first - lo) * BLOCK_U64) as usize;
            crate::reread::mend_log(sh, first, &mut buf[at..at + (n * BLOCK_U64) as usize]);
        }
        bufs.push((lo, buf));
    }
    let mut live = Vec::new();
    for (p, (lo, buf)) in plan.iter().zip(&bufs) {
        for &(i, off, n) in &p.runs {
            let r: &RecMeta = &p.batch.records[i];
            let first = r.data_start + off;
            let at = ((first - lo) * BLOCK_U64) as usize;
            let data = &buf[at..at + (n * BLOCK_U64) as usize];
            live.push(LiveRun {
                layer: r.layer,
                lba: r.lba + off,
                seq: r.seq,
                born_ms: r.born_ms,
                first,
                data,
            });
        }
    }
    live.sort_by_key(|r| (r.layer, r.lba));
    let moved = residency(sh, &live);
    let geo = sh.layout.geo;
    let mut stripe = vec![Builder::new(geo)];
    for run in &live {
        let n = (run.data.len() / BLOCK) as u64;
        let mut done = 0;
        while done < n {
            let room = stripe.last().map_or(0, |s| s.room_blocks());
            if room == 0 || !stripe.last().is_some_and(|s| s.fits(1, 1)) {
                if stripe.len() == width {
                    return Err(EngineError::Failed(
                        "destage plan overflowed its stripe".into(),
                    ));
                }
                stripe.push(Builder::new(geo));
                continue;
            }
            let take = room.min(n - done);
            add_live(sh, stripe.last_mut().expect("non-empty"), run, done, take);
            done += take;
        }
    }
    for p in plan {
        for r in &p.zeros {
            // Any segment of the stripe with an entry to spare takes it.
            if !stripe.iter().any(|s| s.fits(0, 1)) {
                if stripe.len() == width {
                    return Err(EngineError::Failed(
                        "destage plan overflowed its stripe".into(),
                    ));
                }
                stripe.push(Builder::new(geo));
            }
            if let Some(s) = stripe.iter_mut().find(|s| s.fits(0, 1)) {
                s.add_tombstone(r.layer, r.lba, r.nblocks as u32, r.seq);
            }
        }
    }
    stripe.retain(|b| !b.is_empty());
    Ok((stripe, moved))
}

/// How long the data about to move stayed on the fast tier, per volume.
/// Blocks of a layer a stripe moves to the capacity tier, and how long they stayed on the
/// fast tier (milliseconds).
pub(crate) struct Moved {
    layer: u32,
    blocks: u64,
    resident_ms: u64,
}

fn residency(sh: &Shared, live: &[LiveRun<'_>]) -> Vec<Moved> {
    let now = sh.cfg.clock.now_ms();
    live.iter()
        .map(|run| Moved {
            layer: run.layer,
            blocks: (run.data.len() / BLOCK) as u64,
            resident_ms: now.saturating_sub(run.born_ms),
        })
        .collect()
}

/// Counts what a stripe moved in its volumes' residency histograms, once it is committed (a
/// stripe that could not be placed is planned again, and counted then).
fn record_residency(sh: &Shared, moved: &[Moved]) {
    for m in moved {
        if let Some(rt) = sh.layer_runtime(m.layer) {
            rt.stats.record_residency(m.blocks, m.resident_ms);
        }
    }
}

/// Adds blocks `[skip, skip+n)` of a live run to a segment.
fn add_live(sh: &Shared, builder: &mut Builder, run: &LiveRun, skip: u64, n: u64) {
    let first = run.first + skip;
    let bytes = &run.data[(skip * BLOCK_U64) as usize..((skip + n) * BLOCK_U64) as usize];
    // The crc recorded at write time goes into the summary even if the log copy has gone bad:
    // a damaged block then stays detectably damaged instead of becoming valid.
    let crcs: Vec<u32> = (0..n)
        .map(|k| sh.fast_crcs[(first + k) as usize].load(Ordering::Relaxed))
        .collect();
    for (k, chunk) in bytes.chunks(BLOCK).enumerate() {
        if crc32c::crc32c(chunk) != crcs[k] {
            sh.checksum_error(0, 1);
            tracing::error!(
                layer = run.layer,
                block = run.lba + skip + k as u64,
                "checksum mismatch in the write log"
            );
        }
    }
    builder.add_data(
        run.layer,
        run.lba + skip,
        run.seq,
        bytes,
        &crcs,
        Loc::Fast(first),
    );
    // Moving halves the heat; the block stays seen, so a rewrite after the move counts.
    let mut heat = sh.heat.lock();
    for k in 0..n {
        heat.halve(run.layer, run.lba + skip + k);
    }
}

/// A change of the capacity tree that commits a segment: `[lba, lba+len)` of `layer` to
/// `loc` (None: nothing, for a zero run in a layer without a parent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TreeSet {
    pub layer: u32,
    pub lba: u64,
    pub len: u64,
    pub loc: Option<Loc>,
}

/// Applies tree changes (loading the pages they need first) and keeps segment live counts in
/// step: what they displace is released, and, with `count_new`, what they add is counted.
/// Without it the caller counted the new blocks when it sealed their segment (destage, GC and
/// the write bypass): if the changes fail (an index page that cannot be read), the blocks they
/// did not point the tree at are released again, so no segment keeps a live count that
/// nothing references (it could never be freed).
pub(crate) fn apply_tree_sets(
    sh: &Shared,
    sets: &[TreeSet],
    count_new: bool,
) -> Result<(), EngineError> {
    let ranges: Vec<(u128, u128)> = sets
        .iter()
        .map(|s| (key_of(s.layer, s.lba), key_of(s.layer, s.lba + s.len)))
        .collect();
    let mut displaced: Vec<Entry> = Vec::new();
    let mut applied = 0;
    let result = (|| {
        meta::with_tree_read(sh, |t| {
            ranges
                .iter()
                .try_for_each(|&(a, b)| t.ensure_resident(a, b))
        })?;
        let mut tree = sh.tree.write();
        for (s, &(a, b)) in sets.iter().zip(&ranges) {
            match tree.set(a, b, s.loc) {
                Ok(d) => displaced.extend(d),
                Err(_) => {
                    // Evicted meanwhile (should not happen: only this thread evicts); redo alone.
                    drop(tree);
                    displaced.extend(meta::with_tree(sh, |t| t.set(a, b, s.loc))?);
                    tree = sh.tree.write();
                }
            }
            applied += 1;
        }
        Ok::<(), EngineError>(())
    })();
    let mut segs = sh.segs.lock();
    for (i, s) in sets.iter().enumerate() {
        if let Some(Loc::Cap { seg, .. }) = s.loc {
            match (i < applied, count_new) {
                (true, true) => segs.add_live(seg, s.len as u32),
                (false, false) => segs.release(seg, s.len as u32),
                _ => {}
            }
        }
    }
    for d in displaced {
        if let Loc::Cap { seg, .. } = d.loc {
            segs.release(seg, d.len as u32);
        }
    }
    result
}

/// A destaged run the index now points at: `len` blocks of `layer` at `to_block..` of the
/// segment, moved from log blocks `from..`.
struct Committed {
    layer: u32,
    to_block: u32,
    from: u64,
    len: u64,
}

/// Points the index at a destaged segment's copies (where the log copies are still the
/// current ones), then drops those log copies from the fast maps. Returns the data runs it
/// committed.
fn commit_destage(sh: &Shared, seg: u32, b: &Builder) -> Result<Vec<Committed>, EngineError> {
    let mut sets = Vec::new();
    let mut committed = Vec::new();
    let mut live = 0u64;
    {
        let idx = sh.index.read();
        for m in &b.moves {
            let Some(l) = idx.layers.get(&m.layer).filter(|_| idx.layer_live(m.layer)) else {
                continue;
            };
            for p in l.fast.lookup(m.lba, m.nblocks) {
                let off = p.lba - m.lba;
                if p.loc == Some(m.from.advance(off)) {
                    let loc = Loc::Cap {
                        seg,
                        block: m.to_block + off as u32,
                    };
                    if let Loc::Fast(from) = m.from {
                        committed.push(Committed {
                            layer: m.layer,
                            to_block: m.to_block + off as u32,
                            from: from + off,
                            len: p.len,
                        });
                    }
                    sets.push(TreeSet {
                        layer: m.layer,
                        lba: p.lba,
                        len: p.len,
                        loc: Some(loc),
                    });
                    live += p.len;
                }
            }
        }
        for z in &b.zeros {
            let Some(l) = idx.layers.get(&z.layer).filter(|_| idx.layer_live(z.layer)) else {
                continue;
            };
            let zero = if l.rec.parent != 0 {
                Some(Loc::Zero(0))
            } else {
                None
            };
            for p in l.fast.lookup(z.lba, z.nblocks) {
                if p.loc == Some(Loc::Zero(z.seq)) {
                    sets.push(TreeSet {
                        layer: z.layer,
                        lba: p.lba,
                        len: p.len,
                        loc: zero,
                    });
                }
            }
        }
    }
    sh.segs.lock().seal(seg, b.used, live as u32);
    apply_tree_sets(sh, &sets, false)?;
    let mut removed = 0;
    {
        let mut idx = sh.index.write();
        for m in &b.moves {
            if let Some(l) = idx.layers.get_mut(&m.layer) {
                removed += l.fast.remove_if_at(m.lba, m.nblocks, m.from);
            }
        }
        for z in &b.zeros {
            if let Some(l) = idx.layers.get_mut(&z.layer) {
                l.fast.remove_if_at(z.lba, z.nblocks, Loc::Zero(z.seq));
            }
        }
    }
    sh.counters
        .fast_live_blocks
        .fetch_sub(removed, Ordering::Relaxed);
    Ok(committed)
}

/// Points the index at relocated copies (GC) where it still points at the old ones.
fn commit_relocation(sh: &Shared, seg: u32, b: &Builder) -> Result<(), EngineError> {
    let mut sets = Vec::new();
    let mut live = 0u64;
    for m in &b.moves {
        let (a, z) = (key_of(m.layer, m.lba), key_of(m.layer, m.lba + m.nblocks));
        let found = meta::with_tree_read(sh, |t| {
            let mut v = Vec::new();
            t.lookup(a, z, &mut v).map(|()| v)
        })?;
        for e in found {
            let off = (e.key - a) as u64;
            if e.loc == m.from.advance(off) {
                let loc = Loc::Cap {
                    seg,
                    block: m.to_block + off as u32,
                };
                sets.push(TreeSet {
                    layer: m.layer,
                    lba: m.lba + off,
                    len: e.len,
                    loc: Some(loc),
                });
                live += e.len;
            }
        }
    }
    sh.segs.lock().seal(seg, b.used, live as u32);
    apply_tree_sets(sh, &sets, false)
}

/// Live data of a segment per the index: (entry index, block offset in entry, blocks), and
/// the summary to read the entries from. Blocks a merge moved (a deleted snapshot's blocks,
/// handed to its child) are indexed under another layer than the summary names: when the
/// summary names a layer gone or merging and the index holds fewer of the segment's blocks
/// under the named layers than are live, the other layers are searched, and each block found
/// gets an entry of its own in a copy of the summary, under the layer that holds it now.
fn live_seg_runs(
    sh: &Shared,
    seg: u32,
    s: Arc<SegmentSummary>,
) -> Result<(Arc<SegmentSummary>, LiveRuns), EngineError> {
    let mut out = Vec::new();
    let mut found = 0;
    for (i, e) in s.entries.iter().enumerate() {
        if e.kind != RecordKind::Write {
            continue;
        }
        for (off, len) in held_by(sh, seg, e, e.layer)? {
            out.push((i, off, len));
            found += len;
        }
    }
    let live = u64::from(sh.segs.lock().segs[seg as usize].live_blocks);
    let (layers, moved_from): (Vec<u32>, Vec<u32>) = {
        let idx = sh.index.read();
        let moved_from = s
            .entries
            .iter()
            .map(|e| e.layer)
            .filter(|l| {
                idx.layers
                    .get(l)
                    .is_none_or(|st| st.rec.flags & (LAYER_DELETED | LAYER_MERGING) != 0)
            })
            .collect();
        (idx.layers.keys().copied().collect(), moved_from)
    };
    if found >= live || moved_from.is_empty() {
        return Ok((s, out));
    }
    let mut extra = Vec::new();
    'entries: for e in s.entries.iter() {
        if e.kind != RecordKind::Write || !moved_from.contains(&e.layer) {
            continue;
        }
        for &layer in layers.iter().filter(|&&l| l != e.layer) {
            for (off, len) in held_by(sh, seg, e, layer)? {
                extra.push(SummaryEntry {
                    layer,
                    lba: e.lba + off,
                    nblocks: len as u32,
                    data_block: e.data_block + off as u32,
                    ..*e
                });
                found += len;
            }
            if found >= live {
                break 'entries;
            }
        }
    }
    if extra.is_empty() {
        return Ok((s, out));
    }
    let mut copy = (*s).clone();
    for x in extra {
        out.push((copy.entries.len(), 0, u64::from(x.nblocks)));
        copy.entries.push(x);
    }
    Ok((Arc::new(copy), out))
}

/// The parts of entry `e`'s blocks that `layer` maps to their place in segment `seg`:
/// (block offset in the entry, blocks).
fn held_by(
    sh: &Shared,
    seg: u32,
    e: &SummaryEntry,
    layer: u32,
) -> Result<Vec<(u64, u64)>, EngineError> {
    let (a, z) = (
        key_of(layer, e.lba),
        key_of(layer, e.lba + u64::from(e.nblocks)),
    );
    let found = meta::with_tree_read(sh, |t| {
        let mut v = Vec::new();
        t.lookup(a, z, &mut v).map(|()| v)
    })?;
    Ok(found
        .into_iter()
        .filter_map(|h| {
            let off = (h.key - a) as u64;
            let here = Loc::Cap {
                seg,
                block: e.data_block + off as u32,
            };
            (h.loc == here).then_some((off, h.len))
        })
        .collect())
}

fn add_seg_runs(
    sh: &Shared,
    builder: &mut Builder,
    seg: u32,
    s: &SegmentSummary,
    runs: &[(usize, u64, u64)],
) -> Result<(), EngineError> {
    if runs.is_empty() {
        return Ok(());
    }
    // One sequential read of the segment's data instead of one read per run.
    let mut buf = AlignedBuf::new_zeroed(s.data_blocks_used as usize * BLOCK);
    let (dev, seg_off) = sh.layout.seg_data_byte(seg, 0);
    sh.caps[dev].read_at(&mut buf, seg_off)?;
    for &(i, off, n) in runs {
        let e = &s.entries[i];
        let block = e.data_block + off as u32;
        let at = block as usize * BLOCK;
        // As destage does: a block read wrong in passing is read again before it is carried.
        let crcs = &s.block_crcs[block as usize..(block as u64 + n) as usize];
        let part = &mut buf[at..at + (n * BLOCK_U64) as usize];
        let byte = seg_off + at as u64;
        for k in crate::reread::mend(sh, &*sh.caps[dev], 1 + dev, byte, part, |k| crcs[k]) {
            sh.checksum_error(sh.seg_device(seg), 1);
            tracing::error!(
                segment = seg,
                block = block + k as u32,
                "checksum mismatch while cleaning; the damage is carried, not hidden"
            );
        }
        let data = &buf[at..at + (n * BLOCK_U64) as usize];
        builder.add_data(
            e.layer,
            e.lba + off,
            e.seq,
            data,
            crcs,
            Loc::Cap { seg, block },
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{small_cfg, Rig, MIB};

    /// A step whose duty cycle was decided before the tail's first batch became durable (the
    /// duty cycle then saw no tier-mode data at the tail) must not move young tier data: the
    /// step checks the tail again. (A tier-mode test once saw young data move this way.)
    #[test]
    fn a_step_leaves_young_tier_data_whatever_the_duty_cycle_saw() {
        let clock = Arc::new(crate::ManualClock::default());
        let cfg = crate::EngineConfig {
            fill_ratio_low: 0.0,
            clock: clock.clone(),
            ..small_cfg()
        };
        let rig = Rig::new(32 * MIB, &[24 * MIB], cfg, 8);
        let dg = rig.dg();
        dg.sh.hold_destager();
        let policy = crate::Policy {
            mode: Mode::Tier,
            tier_min_age_s: 60,
            ..crate::Policy::default()
        };
        let v = dg
            .create_volume_with_policy("t", 4 * MIB, &policy)
            .unwrap()
            .id;
        for lba in 0..16u64 {
            dg.write(v, lba * 4096, &[lba as u8 + 1; 4096]).unwrap();
        }
        // A destager of its own, stepped by hand: the step comes without a duty cycle.
        let q = crate::queue::Queues::new(1, Duration::from_secs(1)).unwrap();
        let (_btx, brx) = crossbeam_channel::bounded(1);
        let mut d = Destager::new(dg.sh.clone(), q.hot, brx);
        assert_eq!(d.step(1).expect("step"), 0, "young tier data moved");
        assert_eq!(dg.stats().destaged_bytes_total, 0, "young tier data moved");
        clock.advance_ms(61_000);
        assert!(d.step(1).expect("step") > 0, "old tier data did not move");
        assert_eq!(dg.stats().destaged_bytes_total, 16 * 4096);
        for lba in 0..16u64 {
            let mut b = vec![0u8; 4096];
            dg.read(v, lba * 4096, &mut b).unwrap();
            assert!(b.iter().all(|&x| x == lba as u8 + 1), "block {lba}");
        }
    }

    /// A batch of a write of blocks 0..10, a zero record of 100..105 and a write of 20..30,
    /// all live: `first_part` takes its pieces in record order within the room and entries it
    /// is given, and says where the rest begins; `unmoved` then leaves out what was taken.
    #[test]
    fn a_batch_is_split_in_record_order_where_the_stripe_is_full() {
        let rec = |kind, lba, nblocks, data_start| RecMeta {
            kind,
            layer: 1,
            lba,
            nblocks,
            seq: 7,
            data_start,
            relocation: false,
            born_ms: 0,
            aged_from_ms: 0,
            cache_gen: 0,
            vol: 0,
            cache_copy: crate::log::CacheCopy::Again,
        };
        let mut b = BatchMeta {
            start: 0,
            blocks: 21,
            skip: 0,
            first_seq: 5,
            records: vec![
                rec(RecordKind::Write, 0, 10, 1),
                rec(RecordKind::Zero, 100, 5, 11),
                rec(RecordKind::Write, 20, 10, 11),
            ]
            .into(),
            durable: true,
            rest_from: (0, 0),
        };
        let runs = || vec![(0, 0, 10), (2, 0, 10)];
        let zeros = || {
            vec![LiveZero {
                rec: 1,
                layer: 1,
                lba: 100,
                nblocks: 5,
                seq: 6,
            }]
        };
        let part = |room, entries| {
            first_part(&b, runs(), zeros(), room, entries)
                .map(|(r, z, at)| (r, z.iter().map(|z| z.rec).collect::<Vec<_>>(), at))
        };
        assert_eq!(
            part(15, 10),
            Some((vec![(0, 0, 10), (2, 0, 5)], vec![1], (2, 5))),
            "room for 15 blocks"
        );
        assert_eq!(
            part(100, 2),
            Some((vec![(0, 0, 10)], vec![1], (2, 0))),
            "room for two entries"
        );
        assert_eq!(
            part(4, 10),
            Some((vec![(0, 0, 4)], vec![], (0, 4))),
            "room for 4 blocks"
        );
        assert_eq!(part(0, 10), None, "no room");
        assert_eq!(
            part(10, 1),
            Some((vec![(0, 0, 10)], vec![], (1, 0))),
            "one entry"
        );
        assert_eq!(part(100, 10), None, "all of it fits");
        b.rest_from = (2, 5);
        assert_eq!(
            [unmoved(&b, 0), unmoved(&b, 1), unmoved(&b, 2)],
            [None, None, Some((5, 5))]
        );
        b.rest_from = (1, 0);
        assert_eq!(
            [unmoved(&b, 0), unmoved(&b, 1), unmoved(&b, 2)],
            [None, Some((0, 5)), Some((0, 10))]
        );
    }

    #[test]
    fn a_kept_range_is_free_once_its_rewrite_is_answered() {
        let rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), 7);
        let sh = &rig.dg().sh;
        let (done, wait) = answer_releasing(sh, 1, 10, 14).expect("nobody holds it");
        assert!(answer_releasing(sh, 1, 13, 20).is_none(), "overlaps a rewrite in flight");
        assert!(!sh.ranges.try_claim(1, 12, 13), "a host write waits for the rewrite");
        done.send(Ok(()));
        // Free before the destager collects the answer: a host write waits for the one
        // batch, not for the rest of the survey's rewrites.
        assert!(sh.ranges.try_claim(1, 12, 13), "still held once answered");
        sh.ranges.release((1, 12, 13));
        assert!(wait.wait().is_ok());
        // A request dropped unanswered (refused, or never queued) frees its range too.
        let (done, wait) = answer_releasing(sh, 1, 10, 14).expect("free again");
        drop(done);
        assert!(sh.ranges.try_claim(1, 10, 14), "held after the request was dropped");
        sh.ranges.release((1, 10, 14));
        assert!(wait.wait().is_err(), "a dropped request answered as if written");
    }
}
