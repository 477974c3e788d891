//! What the engine keeps per volume while running (not stored): its policy as decoded, its I/O
//! limiter, the sequential-stream detectors, and its figures.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::policy::{Clock, Policy};
use crate::streams::WriteStreams;

/// Residency histogram buckets: bucket i counts data that stayed less than 2^i seconds on the
/// fast tier (the last one: longer).
pub const RESIDENCY_BUCKETS: usize = 24;

#[derive(Default)]
pub struct VolStats {
    /// Blocks read from the fast tier (the log), from promoted copies there, and from the
    /// capacity tier.
    pub read_fast_blocks: AtomicU64,
    pub read_cached_blocks: AtomicU64,
    pub read_capacity_blocks: AtomicU64,
    pub promoted_blocks: AtomicU64,
    pub evicted_blocks: AtomicU64,
    /// Blocks read while in the write log and kept as clean copies when they were destaged.
    pub kept_blocks: AtomicU64,
    /// Blocks of sequential writes that went straight to the capacity tier.
    pub bypassed_blocks: AtomicU64,
    /// Data destaged after staying on the fast tier for a while (see RESIDENCY_BUCKETS).
    pub residency: [AtomicU64; RESIDENCY_BUCKETS],
    /// Sum over those blocks of their time on the fast tier, block-milliseconds.
    pub residency_block_ms: AtomicU64,
    /// Time spent waiting for the volume's I/O limits.
    pub limited_wait_ms: AtomicU64,
}

/// The figures of one volume since the disk group opened, as the API shows them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct VolumeFigures {
    /// Reads of stored data served by the write log, by promoted (cached) copies on the fast
    /// tier, and by the capacity tier.
    pub read_fast_bytes: u64,
    pub read_cached_bytes: u64,
    pub read_capacity_bytes: u64,
    /// (fast + cached) / all three; None before any read of stored data.
    pub fast_read_hit_ratio: Option<f64>,
    pub promoted_bytes: u64,
    pub evicted_bytes: u64,
    /// Data read while in the write log whose clean copy stayed on the fast tier when it was
    /// destaged (a copy in the read cache, like a promoted one).
    #[serde(default)]
    pub kept_bytes: u64,
    /// Sequential writes past the volume's write cutoff that went straight to the capacity
    /// tier.
    #[serde(default)]
    pub bypassed_bytes: u64,
    /// Time the volume's requests waited for its IOPS and bandwidth limits.
    pub limited_wait_ms: u64,
    /// Bucket i counts 4 KiB blocks destaged after less than 2^i seconds on the fast tier; the
    /// last bucket, longer.
    pub residency_seconds_log2: Vec<u64>,
    /// Sum over the blocks counted there of their seconds on the fast tier (a histogram's sum).
    pub residency_seconds_sum: f64,
}

impl VolStats {
    pub fn figures(&self) -> VolumeFigures {
        let b = |a: &AtomicU64| a.load(Ordering::Relaxed) * crate::format::BLOCK_U64;
        let (fast, cached, cap) = (
            b(&self.read_fast_blocks),
            b(&self.read_cached_blocks),
            b(&self.read_capacity_blocks),
        );
        let total = fast + cached + cap;
        VolumeFigures {
            read_fast_bytes: fast,
            read_cached_bytes: cached,
            read_capacity_bytes: cap,
            fast_read_hit_ratio: (total > 0).then(|| (fast + cached) as f64 / total as f64),
            promoted_bytes: b(&self.promoted_blocks),
            evicted_bytes: b(&self.evicted_blocks),
            kept_bytes: b(&self.kept_blocks),
            bypassed_bytes: b(&self.bypassed_blocks),
            limited_wait_ms: self.limited_wait_ms.load(Ordering::Relaxed),
            residency_seconds_log2: self
                .residency
                .iter()
                .map(|a| a.load(Ordering::Relaxed))
                .collect(),
            residency_seconds_sum: self.residency_block_ms.load(Ordering::Relaxed) as f64 / 1000.0,
        }
    }

    pub fn record_residency(&self, blocks: u64, age_ms: u64) {
        let secs = age_ms / 1000;
        let bucket = (64 - secs.leading_zeros() as usize).min(RESIDENCY_BUCKETS - 1);
        self.residency[bucket].fetch_add(blocks, Ordering::Relaxed);
        self.residency_block_ms
            .fetch_add(blocks.saturating_mul(age_ms), Ordering::Relaxed);
    }
}

/// The read-stream detector: how long the current run of back-to-back reads is (writes have
/// their own, which follows several streams: streams.rs).
#[derive(Default, Clone, Copy)]
pub struct SeqRun {
    next_offset: u64,
    run_bytes: u64,
}

impl SeqRun {
    /// Notes a request and returns the length of the run it continues (0 if it starts one).
    pub fn note(&mut self, offset: u64, len: u64) -> u64 {
        let before = if offset == self.next_offset {
            self.run_bytes
        } else {
            0
        };
        self.run_bytes = before + len;
        self.next_offset = offset + len;
        before
    }

    /// The length of the run a request at `offset` would continue, without noting it (for
    /// tests: reads are always noted).
    #[cfg(test)]
    pub fn peek(&self, offset: u64) -> u64 {
        if offset == self.next_offset {
            self.run_bytes
        } else {
            0
        }
    }
}

/// How often a request behind others in the limits' queue looks whether its turn has come
/// (it is woken when it does; this bounds a wake-up lost to a race).
const NOT_FIRST_LOOK_MS: u64 = 20;

/// Token buckets for a volume's IOPS and bandwidth limits (one second of burst).
#[derive(Default)]
pub struct Limiter {
    ops: f64,
    bytes: f64,
    at_ms: u64,
    /// The limits of the last request seen (0: off). A bucket whose limit was off starts with
    /// a full second of burst when the limit is set, as a new volume's does, not empty or with
    /// what a limit set before left in it.
    iops_limit_seen: u64,
    bandwidth_limit_seen_bytes_per_s: u64,
    /// The requests waiting for the limits, in the order they came, with the thread each
    /// waits on: they are admitted in that order (what the buckets gain is kept for the
    /// first, so a request larger than the others, which needs more of the bucket at once,
    /// is not kept waiting for good by small ones taking each few KiB as it comes; and no
    /// request waits much longer than those that came after it). A request that does not
    /// wait (`try_take`) passes only when none waits.
    waiting: std::collections::BTreeMap<u64, std::thread::Thread>,
    waiters_seen: u64,
}

impl Limiter {
    /// Takes one operation of `bytes` if the limits allow it now, and no waiter comes first;
    /// otherwise how many milliseconds until they may.
    pub fn try_take(&mut self, p: &Policy, bytes: u64, now_ms: u64) -> Result<(), u64> {
        self.take(p, bytes, now_ms, None)
    }

    /// A place in the queue for a request about to wait for the limits on this thread
    /// (`try_take_waiting`), after every request already waiting.
    pub fn new_waiter(&mut self) -> u64 {
        self.waiters_seen += 1;
        self.waiting
            .insert(self.waiters_seen, std::thread::current());
        self.waiters_seen
    }

    /// As `try_take`, for a waiter that goes on trying until it is admitted: the first one
    /// refused is admitted before anyone else, as soon as the buckets hold its request.
    pub fn try_take_waiting(
        &mut self,
        p: &Policy,
        bytes: u64,
        now_ms: u64,
        waiter: u64,
    ) -> Result<(), u64> {
        self.take(p, bytes, now_ms, Some(waiter))
    }

    /// A waiter admitted, or no longer waiting (shutdown): the others need not wait for it.
    /// Returns the thread of the request now first in the queue, to be woken: it need not
    /// wait for its next look to find its turn has come.
    pub fn stop_waiting(&mut self, waiter: u64) -> Option<std::thread::Thread> {
        self.waiting.remove(&waiter);
        self.waiting.values().next().cloned()
    }

    fn take(&mut self, p: &Policy, bytes: u64, now_ms: u64, who: Option<u64>) -> Result<(), u64> {
        self.fill_buckets_of_new_limits(p);
        if p.iops_limit == 0 && p.bandwidth_limit_bytes_per_s == 0 {
            return Ok(());
        }
        let dt = now_ms.saturating_sub(self.at_ms) as f64 / 1000.0;
        self.at_ms = self.at_ms.max(now_ms);
        let refill = |level: f64, rate: u64| (level + dt * rate as f64).min(rate as f64);
        if p.iops_limit > 0 {
            self.ops = refill(self.ops, p.iops_limit);
        }
        if p.bandwidth_limit_bytes_per_s > 0 {
            self.bytes = refill(self.bytes, p.bandwidth_limit_bytes_per_s);
        }
        let ops_ok = p.iops_limit == 0 || self.ops >= 1.0;
        // A request larger than a second's worth passes once the bucket is full, and leaves
        // it in debt for the rest: the requests after it wait that much longer.
        let want = (bytes as f64).min(p.bandwidth_limit_bytes_per_s as f64);
        let bytes_ok = p.bandwidth_limit_bytes_per_s == 0 || self.bytes >= want;
        let first = match who {
            None => self.waiting.is_empty(),
            Some(w) => self.waiting.keys().next() == Some(&w),
        };
        if ops_ok && bytes_ok && first {
            if let Some(w) = who {
                self.stop_waiting(w);
            }
            if p.iops_limit > 0 {
                self.ops -= 1.0;
            }
            if p.bandwidth_limit_bytes_per_s > 0 {
                self.bytes -= bytes as f64;
            }
            return Ok(());
        }
        let wait_ops = if ops_ok {
            0.0
        } else {
            (1.0 - self.ops) / p.iops_limit as f64
        };
        let wait_bytes = if bytes_ok {
            0.0
        } else {
            (want - self.bytes) / p.bandwidth_limit_bytes_per_s as f64
        };
        let wait_ms = ((wait_ops.max(wait_bytes) * 1000.0).ceil() as u64).max(1);
        // One behind another waits for its turn, which comes with a wake-up.
        Err(if first {
            wait_ms
        } else {
            wait_ms.max(NOT_FIRST_LOOK_MS)
        })
    }

    /// A limit set since the last request (off until now) starts with a full bucket.
    fn fill_buckets_of_new_limits(&mut self, p: &Policy) {
        if p.iops_limit > 0 && self.iops_limit_seen == 0 {
            self.ops = p.iops_limit as f64;
        }
        if p.bandwidth_limit_bytes_per_s > 0 && self.bandwidth_limit_seen_bytes_per_s == 0 {
            self.bytes = p.bandwidth_limit_bytes_per_s as f64;
        }
        self.iops_limit_seen = p.iops_limit;
        self.bandwidth_limit_seen_bytes_per_s = p.bandwidth_limit_bytes_per_s;
    }

    /// Returns what a `try_take` of `bytes` took, for a request that was not carried out
    /// after all (it is taken again by the path that carries it out).
    pub fn give_back(&mut self, p: &Policy, bytes: u64) {
        if p.iops_limit > 0 {
            self.ops = (self.ops + 1.0).min(p.iops_limit as f64);
        }
        if p.bandwidth_limit_bytes_per_s > 0 {
            let rate = p.bandwidth_limit_bytes_per_s as f64;
            self.bytes = (self.bytes + bytes as f64).min(rate);
        }
    }
}

pub struct VolRuntime {
    pub id: u32,
    pub policy: Mutex<Policy>,
    pub stats: VolStats,
    pub limiter: Mutex<Limiter>,
    pub reads: Mutex<SeqRun>,
    pub writes: Mutex<WriteStreams>,
    /// Bumped by `cut_waits`: a request waiting for the limits that sees it change gives up.
    waits_cut: AtomicU64,
    /// The same, for the reads of one snapshot of the volume (by view id: `cut_view_waits`).
    view_waits_cut: Mutex<HashMap<u32, u64>>,
}

impl VolRuntime {
    pub fn new(id: u32, policy: Policy) -> VolRuntime {
        VolRuntime {
            id,
            policy: Mutex::new(policy),
            stats: VolStats::default(),
            limiter: Mutex::new(Limiter::default()),
            reads: Mutex::new(SeqRun::default()),
            writes: Mutex::new(WriteStreams::default()),
            waits_cut: AtomicU64::new(0),
            view_waits_cut: Mutex::new(HashMap::new()),
        }
    }

    pub fn policy(&self) -> Policy {
        *self.policy.lock()
    }

    /// Waits until the volume's limits admit a request of `bytes` (limited requests wait;
    /// they are not failed). Returns at once without limits. The policy is read again at
    /// each look, so a change (a limit lifted) applies to the requests already waiting. Stops
    /// waiting once `running` says the group is no longer running (the caller then refuses
    /// the request), so a slow limit does not hold a shutdown. False when the wait was cut
    /// off (`cut_waits`): the caller refuses the request.
    pub fn admit(&self, clock: &dyn Clock, bytes: u64, running: &dyn Fn() -> bool) -> bool {
        self.admit_as(None, clock, bytes, running)
    }

    /// As `admit`, for a read of snapshot `view` of this volume: its reads count against
    /// the volume's limits, and a forced delete of the snapshot cuts off those waiting
    /// (`cut_view_waits`) without the volume's own.
    pub fn admit_snapshot_read(
        &self,
        view: u32,
        clock: &dyn Clock,
        bytes: u64,
        running: &dyn Fn() -> bool,
    ) -> bool {
        self.admit_as(Some(view), clock, bytes, running)
    }

    fn admit_as(
        &self,
        view: Option<u32>,
        clock: &dyn Clock,
        bytes: u64,
        running: &dyn Fn() -> bool,
    ) -> bool {
        // Without limits nothing waits, and the request takes no place in the queue (this is
        // every blocking request of an unlimited volume); the buckets note the limits are off.
        let p = self.policy();
        if p.iops_limit == 0 && p.bandwidth_limit_bytes_per_s == 0 {
            let _ = self.limiter.lock().try_take(&p, bytes, clock.now_ms());
            return true;
        }
        let started = clock.now_ms();
        let view_cut = || view.map(|v| self.view_waits_cut.lock().get(&v).copied());
        let cut_at = (self.waits_cut.load(Ordering::Acquire), view_cut());
        let not_cut = || (self.waits_cut.load(Ordering::Acquire), view_cut()) == cut_at;
        let me = self.limiter.lock().new_waiter();
        let mut admitted = false;
        while running() && not_cut() {
            let p = self.policy();
            let now = clock.now_ms();
            // The lock is let go before the wait: held across it (a `match` keeps its
            // scrutinee's temporaries to its end), every other request of the volume, and
            // the NBD reader threads asking `try_admit`, waited on it, which stalled every
            // connection of the node, not only the limited volume's.
            let taken = self.limiter.lock().try_take_waiting(&p, bytes, now, me);
            match taken {
                Ok(()) => {
                    admitted = true;
                    break;
                }
                // Until the buckets hold this request (the first in the queue), or until
                // woken as the new first; every 20 ms at most, to see a policy change.
                Err(wait_ms) => std::thread::park_timeout(Duration::from_millis(wait_ms.min(20))),
            }
        }
        // Admitted, let through by a lifted limit, or given up at shutdown or when cut off:
        // the request now first is told its turn has come.
        let next = self.limiter.lock().stop_waiting(me);
        if let Some(next) = next {
            next.unpark();
        }
        let waited = clock.now_ms().saturating_sub(started);
        if waited > 0 {
            self.stats
                .limited_wait_ms
                .fetch_add(waited, Ordering::Relaxed);
        }
        admitted || not_cut()
    }

    /// Every request now waiting in `admit` gives up within its next look (20 ms at most);
    /// those that come later wait as usual.
    pub fn cut_waits(&self) {
        self.waits_cut.fetch_add(1, Ordering::AcqRel);
    }

    /// As `cut_waits`, for the reads of snapshot `view` only.
    pub fn cut_view_waits(&self, view: u32) {
        *self.view_waits_cut.lock().entry(view).or_insert(0) += 1;
    }

    /// Whether the volume has an IOPS or bandwidth limit.
    pub fn limited(&self) -> bool {
        let p = self.policy();
        p.iops_limit > 0 || p.bandwidth_limit_bytes_per_s > 0
    }

    /// Admits a request only if that needs no waiting.
    pub fn try_admit(&self, clock: &dyn Clock, bytes: u64) -> bool {
        let p = self.policy();
        self.limiter
            .lock()
            .try_take(&p, bytes, clock.now_ms())
            .is_ok()
    }

    /// Undoes a `try_admit` of `bytes` whose request was refused after all.
    pub fn give_back(&self, bytes: u64) {
        let p = self.policy();
        self.limiter.lock().give_back(&p, bytes);
    }
}

/// The runtime state of every volume, and which volume's data each layer holds.
#[derive(Default)]
pub struct Runtimes {
    pub by_volume: HashMap<u32, Arc<VolRuntime>>,
    /// Head layers and the snapshot layers under them (`Shared::layer_runtime`).
    pub by_layer: HashMap<u32, Arc<VolRuntime>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiter_admits_at_the_configured_rate() {
        let p = Policy {
            iops_limit: 10,
            ..Policy::default()
        };
        let mut l = Limiter::default();
        // A full second of burst, then one per 100 ms.
        let admitted = (0..20)
            .filter(|_| l.try_take(&p, 4096, 1000).is_ok())
            .count();
        assert_eq!(admitted, 10);
        assert_eq!(l.try_take(&p, 4096, 1000), Err(100));
        assert!(l.try_take(&p, 4096, 1100).is_ok());
        let p = Policy {
            bandwidth_limit_bytes_per_s: 1 << 20,
            ..Policy::default()
        };
        let mut l = Limiter::default();
        assert!(l.try_take(&p, 1 << 20, 1000).is_ok());
        assert_eq!(l.try_take(&p, 512 << 10, 1000), Err(500));
    }

    /// Requests larger than a second's worth of bandwidth still average the limit: each
    /// waits for a full bucket, then leaves it in debt for the rest of its size.
    #[test]
    fn large_requests_keep_to_the_bandwidth_limit() {
        let p = Policy {
            bandwidth_limit_bytes_per_s: 1 << 20,
            ..Policy::default()
        };
        let mut l = Limiter::default();
        let mut admitted = 0u64;
        for now_ms in (1000..=11_000).step_by(10) {
            if l.try_take(&p, 4 << 20, now_ms).is_ok() {
                admitted += 4 << 20;
            }
        }
        // A second of burst and ten seconds at 1 MiB/s, one request over at most.
        assert!(
            admitted <= 15 << 20,
            "{} MiB admitted in 10 s at 1 MiB/s",
            admitted >> 20
        );
        // A request given back leaves the bucket as it was.
        let mut l = Limiter::default();
        assert!(l.try_take(&p, 4 << 20, 1000).is_ok());
        l.give_back(&p, 4 << 20);
        assert!(l.try_take(&p, 4 << 20, 1000).is_ok());
        assert!(l.try_take(&p, 4096, 1000).is_err());
    }

    /// One 4 MiB request waits at 1 MiB/s while a 4 KiB request comes every millisecond
    /// (4 MiB/s of them): the buckets' gain is kept for the large one, refused first.
    #[test]
    fn a_large_request_is_not_starved_by_small_ones() {
        let p = Policy {
            bandwidth_limit_bytes_per_s: 1 << 20,
            ..Policy::default()
        };
        let mut l = Limiter::default();
        let big = l.new_waiter();
        let (mut big_in_ms, mut small_after) = (None, 0);
        for now_ms in 1000..61_000 {
            let small = l.try_take(&p, 4096, now_ms).is_ok();
            if big_in_ms.is_none() {
                if l.try_take_waiting(&p, 4 << 20, now_ms, big).is_ok() {
                    big_in_ms = Some(now_ms);
                }
            } else if small {
                small_after += 1;
            }
        }
        let big_in_ms = big_in_ms.expect("the 4 MiB request was never admitted in 60 s");
        assert!(big_in_ms <= 2000, "admitted at {big_in_ms} ms");
        assert!(
            small_after > 0,
            "no small request admitted after the large one"
        );
        // A waiter that gives up (shutdown) holds nobody back.
        let mut l = Limiter::default();
        assert!(l.try_take(&p, 1 << 20, 1000).is_ok());
        let gone = l.new_waiter();
        assert!(l.try_take_waiting(&p, 4096, 1000, gone).is_err());
        assert!(
            l.try_take(&p, 4096, 1010).is_err(),
            "the waiter comes first"
        );
        l.stop_waiting(gone);
        assert!(l.try_take(&p, 4096, 1010).is_ok());
    }

    /// Waiters are admitted in the order they came, whichever looks first when a token comes:
    /// before, the first to look after a refill took it, and behind a limited volume's queue
    /// some requests waited seconds while the mean wait was a fifth of one.
    #[test]
    fn waiters_are_admitted_in_the_order_they_came() {
        let p = Policy {
            iops_limit: 1,
            ..Policy::default()
        };
        let mut l = Limiter::default();
        assert!(l.try_take(&p, 4096, 0).is_ok(), "the second of burst");
        let [a, b, c] = [l.new_waiter(), l.new_waiter(), l.new_waiter()];
        let mut order = Vec::new();
        for now_ms in (1000..=4000).step_by(500) {
            // The last to come looks first each time.
            for w in [c, b, a] {
                if !order.contains(&w) && l.try_take_waiting(&p, 4096, now_ms, w).is_ok() {
                    order.push(w);
                }
            }
        }
        assert_eq!(order, [a, b, c]);
        assert!(l.try_take(&p, 4096, 5000).is_ok(), "none waits any more");
    }

    /// A request waiting for its volume's limits does not hold the limiter's lock while it
    /// waits: the NBD server's reader threads ask `try_admit` of the same volume, and with
    /// the lock held across each wait they blocked on it, which stalled every connection of
    /// the node (the other volumes' too).
    #[test]
    fn a_waiting_request_leaves_the_limiter_free() {
        let rt = Arc::new(VolRuntime::new(
            1,
            Policy {
                iops_limit: 1,
                ..Policy::default()
            },
        ));
        let clock = Arc::new(crate::policy::ManualClock::default());
        assert!(rt.admit(&*clock, 4096, &|| true), "the second of burst");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waiter = {
            let (rt, clock, stop) = (rt.clone(), clock.clone(), stop.clone());
            std::thread::spawn(move || rt.admit(&*clock, 4096, &|| !stop.load(Ordering::SeqCst)))
        };
        // The clock stands still: the request waits for good.
        while rt.limiter.lock().waiting.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut free = 0;
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(3));
            if let Some(l) = rt.limiter.try_lock() {
                free += 1;
                assert_eq!(l.waiting.len(), 1, "the request still waits");
            }
        }
        assert!(free >= 15, "the limiter was free {free} times of 20");
        assert!(
            !rt.try_admit(&*clock, 4096),
            "a request that does not wait went ahead of the one waiting"
        );
        stop.store(true, Ordering::SeqCst);
        waiter.join().unwrap();
        assert!(rt.limiter.lock().waiting.is_empty(), "it left the queue");
    }

    /// A limit set on a volume that already has the other one starts with a second of burst,
    /// as a new volume's does: not empty (with an injected clock that stands still, such a
    /// request waited for good; with the system clock, for up to a second), and not in the
    /// debt a large request left under a limit lifted since.
    #[test]
    fn a_limit_set_later_starts_with_a_full_second_of_burst() {
        let iops_only = Policy {
            iops_limit: 1000,
            ..Policy::default()
        };
        let both = Policy {
            bandwidth_limit_bytes_per_s: 1 << 20,
            ..iops_only
        };
        let mut l = Limiter::default();
        assert_eq!(l.try_take(&iops_only, 4096, 1000), Ok(()));
        assert_eq!(
            l.try_take(&both, 1 << 20, 1000),
            Ok(()),
            "a bandwidth limit set after the IOPS limit"
        );
        // 8 MiB at 1 MiB/s leaves the bucket 7 MiB in debt; the limit is lifted, then set again.
        assert_eq!(l.try_take(&both, 8 << 20, 2000), Ok(()));
        assert_eq!(l.try_take(&iops_only, 4096, 2000), Ok(()));
        assert_eq!(
            l.try_take(&both, 4096, 2000),
            Ok(()),
            "a bandwidth limit set again after it was lifted"
        );
    }

    #[test]
    fn sequential_runs_are_measured() {
        let mut s = SeqRun::default();
        assert_eq!(s.note(0, 100), 0);
        assert_eq!(s.note(100, 100), 100);
        assert_eq!(s.note(200, 50), 200);
        assert_eq!(s.note(7, 1), 0);
    }
}
