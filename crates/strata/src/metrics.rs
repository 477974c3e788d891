//! Live I/O figures of the daemon: per-volume request counters and latency histograms, kept
//! with relaxed atomics on the NBD path and read by `/metrics`, the JSON API and the sampler.
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Upper bounds (inclusive, microseconds) of the latency buckets; one more bucket holds the
/// rest. 1, 2, 5, 10 and 30 ms are bounds so that service levels come out exact.
pub const LATENCY_BOUNDS_US: [u64; 14] = [
    50, 100, 250, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 100_000, 250_000, 1_000_000,
    5_000_000, 30_000_000,
];
const BUCKETS: usize = LATENCY_BOUNDS_US.len() + 1;

/// The service-level thresholds the source material reports, in milliseconds.
pub const SERVICE_LEVELS_MS: [u64; 5] = [1, 2, 5, 10, 30];

#[derive(Debug, Default)]
pub struct LatencyHistogram {
    counts: [AtomicU64; BUCKETS],
    sum_us: AtomicU64,
}

impl LatencyHistogram {
    pub fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = LATENCY_BOUNDS_US.partition_point(|&b| b < us);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            counts: std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed)),
            sum_us: self.sum_us.load(Ordering::Relaxed),
        }
    }
}

/// Per-bucket (not cumulative) counts at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    pub counts: [u64; BUCKETS],
    pub sum_us: u64,
}

impl LatencySnapshot {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub fn merge(&mut self, other: &LatencySnapshot) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        self.sum_us += other.sum_us;
    }

    /// What was recorded between `earlier` and this snapshot.
    pub fn since(&self, earlier: &LatencySnapshot) -> LatencySnapshot {
        LatencySnapshot {
            counts: std::array::from_fn(|i| self.counts[i].saturating_sub(earlier.counts[i])),
            sum_us: self.sum_us.saturating_sub(earlier.sum_us),
        }
    }

    pub fn mean_us(&self) -> Option<f64> {
        let n = self.count();
        (n > 0).then(|| self.sum_us as f64 / n as f64)
    }

    /// The `q` quantile (0..=1), interpolated linearly inside its bucket; the open last bucket
    /// reports its lower bound. None without samples.
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = (q.clamp(0.0, 1.0) * n as f64).ceil().max(1.0);
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            if (seen + c) as f64 >= rank {
                let lo = if i == 0 { 0 } else { LATENCY_BOUNDS_US[i - 1] } as f64;
                let Some(&hi) = LATENCY_BOUNDS_US.get(i) else {
                    return Some(lo);
                };
                let within = (rank - seen as f64) / c as f64;
                return Some(lo + (hi as f64 - lo) * within);
            }
            seen += c;
        }
        None
    }

    /// Share (0..=1) of requests that finished within `ms` milliseconds; `ms` must be one of
    /// the bucket bounds for the answer to be exact. None without samples.
    pub fn share_within_ms(&self, ms: u64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let bound_us = ms * 1000;
        let buckets = LATENCY_BOUNDS_US.partition_point(|&b| b <= bound_us);
        let within: u64 = self.counts[..buckets].iter().sum();
        Some(within as f64 / n as f64)
    }

    /// Cumulative counts per bound, as Prometheus wants them (the last is `+Inf`).
    pub fn cumulative(&self) -> [u64; BUCKETS] {
        let mut acc = 0;
        std::array::from_fn(|i| {
            acc += self.counts[i];
            acc
        })
    }
}

/// Request counters of one volume (or of the whole node).
#[derive(Debug, Default)]
pub struct IoMetrics {
    pub read_ops: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_ops: AtomicU64,
    pub write_bytes: AtomicU64,
    /// TRIM and WRITE_ZEROES requests (their bytes are not data written).
    pub unmap_ops: AtomicU64,
    pub flush_ops: AtomicU64,
    /// Requests that failed with any error.
    pub errors: AtomicU64,
    pub read_latency: LatencyHistogram,
    pub write_latency: LatencyHistogram,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
    Unmap,
    Flush,
}

impl IoMetrics {
    /// Counts a request answered: every one in the operations (and a failed one in the
    /// errors), its bytes only when it succeeded (a write refused with ENOSPC wrote nothing).
    pub fn record(&self, kind: Kind, bytes: u64, latency: Duration, ok: bool) {
        let r = Ordering::Relaxed;
        let bytes = if ok { bytes } else { 0 };
        match kind {
            Kind::Read => {
                self.read_ops.fetch_add(1, r);
                self.read_bytes.fetch_add(bytes, r);
                self.read_latency.record(latency);
            }
            Kind::Write => {
                self.write_ops.fetch_add(1, r);
                self.write_bytes.fetch_add(bytes, r);
                self.write_latency.record(latency);
            }
            Kind::Unmap => {
                self.unmap_ops.fetch_add(1, r);
            }
            Kind::Flush => {
                self.flush_ops.fetch_add(1, r);
            }
        }
        if !ok {
            self.errors.fetch_add(1, r);
        }
    }

    /// Counts a request the NBD server refused on its own (out of range, a write to a
    /// snapshot, a bad flag, ...): `record`'s rules for a failure, an operation of its kind
    /// (`None` for cache, block status and unknown commands, which have no count of their
    /// own) with no bytes, and an error. Failed reads and writes are in the latency
    /// histograms, but they reached the volume and took its time; a refusal never reached it
    /// (the histogram is the time "from a request reaching the volume"), has no time of its
    /// own to measure, and a client sending bad requests in a loop would fill the lowest
    /// bucket and make the volume's service levels look better than it serves. So it is not
    /// in them, and a histogram's count can be below its operations.
    pub fn record_refused(&self, kind: Option<Kind>) {
        let r = Ordering::Relaxed;
        match kind {
            Some(Kind::Read) => self.read_ops.fetch_add(1, r),
            Some(Kind::Write) => self.write_ops.fetch_add(1, r),
            Some(Kind::Unmap) => self.unmap_ops.fetch_add(1, r),
            Some(Kind::Flush) => self.flush_ops.fetch_add(1, r),
            None => 0,
        };
        self.errors.fetch_add(1, r);
    }

    pub fn snapshot(&self) -> IoSnapshot {
        let r = Ordering::Relaxed;
        IoSnapshot {
            read_ops: self.read_ops.load(r),
            read_bytes: self.read_bytes.load(r),
            write_ops: self.write_ops.load(r),
            write_bytes: self.write_bytes.load(r),
            unmap_ops: self.unmap_ops.load(r),
            flush_ops: self.flush_ops.load(r),
            errors: self.errors.load(r),
            read_latency: self.read_latency.snapshot(),
            write_latency: self.write_latency.snapshot(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoSnapshot {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    pub unmap_ops: u64,
    pub flush_ops: u64,
    pub errors: u64,
    pub read_latency: LatencySnapshot,
    pub write_latency: LatencySnapshot,
}

/// The JSON form of a volume's or the node's counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct IoTotalsJson {
    pub read_ops_total: u64,
    pub read_bytes_total: u64,
    pub write_ops_total: u64,
    pub write_bytes_total: u64,
    pub unmap_ops_total: u64,
    pub flush_ops_total: u64,
    pub errors_total: u64,
    pub read_latency_us_mean: Option<f64>,
    pub write_latency_us_mean: Option<f64>,
}

impl From<&IoSnapshot> for IoTotalsJson {
    fn from(s: &IoSnapshot) -> Self {
        IoTotalsJson {
            read_ops_total: s.read_ops,
            read_bytes_total: s.read_bytes,
            write_ops_total: s.write_ops,
            write_bytes_total: s.write_bytes,
            unmap_ops_total: s.unmap_ops,
            flush_ops_total: s.flush_ops,
            errors_total: s.errors,
            read_latency_us_mean: s.read_latency.mean_us(),
            write_latency_us_mean: s.write_latency.mean_us(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(samples_us: &[u64]) -> LatencySnapshot {
        let h = LatencyHistogram::default();
        for &us in samples_us {
            h.record(Duration::from_micros(us));
        }
        h.snapshot()
    }

    #[test]
    fn buckets_include_their_upper_bound() {
        let s = hist(&[50, 51, 1_000, 1_001, 40_000_000]);
        assert_eq!(s.counts[0], 1, "50 us is in the <=50 bucket");
        assert_eq!(s.counts[1], 1, "51 us is in the <=100 bucket");
        assert_eq!(s.counts[4], 1, "1 ms is in the <=1 ms bucket");
        assert_eq!(s.counts[5], 1, "1.001 ms is in the <=2 ms bucket");
        assert_eq!(s.counts[BUCKETS - 1], 1, "40 s is in the open bucket");
        assert_eq!(s.sum_us, 50 + 51 + 1_000 + 1_001 + 40_000_000);
        assert_eq!(s.cumulative()[BUCKETS - 1], 5);
    }

    #[test]
    fn service_levels_are_exact_at_their_bounds() {
        // 10 requests: 4 within 1 ms, 3 more within 2 ms, 1 within 10 ms, 2 beyond 30 ms.
        let s = hist(&[100, 900, 1_000, 1_000, 1_500, 2_000, 1_999, 9_000, 31_000, 90_000]);
        assert_eq!(s.share_within_ms(1), Some(0.4));
        assert_eq!(s.share_within_ms(2), Some(0.7));
        assert_eq!(s.share_within_ms(5), Some(0.7));
        assert_eq!(s.share_within_ms(10), Some(0.8));
        assert_eq!(s.share_within_ms(30), Some(0.8));
        assert_eq!(LatencySnapshot::default().share_within_ms(1), None);
    }

    #[test]
    fn quantiles_interpolate_within_a_bucket() {
        // 100 samples in (1 ms, 2 ms]: p50 lands half-way through that bucket.
        let s = hist(&[1_500; 100]);
        let p50 = s.quantile_us(0.5).unwrap();
        assert!((p50 - 1_500.0).abs() < 1.0, "{p50}");
        assert_eq!(s.quantile_us(1.0), Some(2_000.0));
        let s = hist(&[10, 10, 10, 60_000]);
        assert!(s.quantile_us(0.5).unwrap() <= 50.0);
        let p99 = s.quantile_us(0.99).unwrap();
        assert!(p99 > 30_000.0 && p99 <= 100_000.0, "{p99}");
        assert_eq!(s.mean_us(), Some((30.0 + 60_000.0) / 4.0));
    }

    #[test]
    fn deltas_subtract_bucket_by_bucket() {
        let h = LatencyHistogram::default();
        h.record(Duration::from_micros(10));
        let a = h.snapshot();
        h.record(Duration::from_millis(3));
        h.record(Duration::from_millis(3));
        let d = h.snapshot().since(&a);
        assert_eq!(d.count(), 2);
        assert_eq!(d.share_within_ms(2), Some(0.0));
        assert_eq!(d.share_within_ms(5), Some(1.0));
    }

    #[test]
    fn io_metrics_count_by_kind_and_errors() {
        let m = IoMetrics::default();
        m.record(Kind::Read, 4096, Duration::from_micros(80), true);
        m.record(Kind::Write, 512, Duration::from_micros(800), true);
        m.record(Kind::Write, 512, Duration::from_micros(800), false);
        m.record(Kind::Flush, 0, Duration::from_micros(5), true);
        let s = m.snapshot();
        assert_eq!((s.read_ops, s.read_bytes), (1, 4096));
        // A failed write is an operation and an error, and wrote no bytes.
        assert_eq!((s.write_ops, s.write_bytes), (2, 512));
        assert_eq!((s.flush_ops, s.errors), (1, 1));
        assert_eq!(s.write_latency.count(), 2);
    }

    #[test]
    fn a_refused_request_is_an_operation_and_an_error_without_bytes_or_latency() {
        let m = IoMetrics::default();
        m.record_refused(Some(Kind::Write));
        m.record_refused(Some(Kind::Read));
        m.record_refused(Some(Kind::Unmap));
        m.record_refused(Some(Kind::Flush));
        m.record_refused(None);
        let s = m.snapshot();
        assert_eq!((s.read_ops, s.read_bytes, s.write_ops, s.write_bytes), (1, 0, 1, 0));
        assert_eq!((s.unmap_ops, s.flush_ops, s.errors), (1, 1, 5));
        assert_eq!((s.read_latency.count(), s.write_latency.count()), (0, 0));
    }
}
