//! Latency recording: an HDR histogram per direction (microseconds, 3 significant digits) and
//! exact counters for the service levels, so "share within 1 ms" is a count, not a bucket guess.
use hdrhistogram::Histogram;
use serde::Serialize;

/// The service levels CONTEXT.md §5 reports: share of I/Os done within these many ms.
pub const SERVICE_LEVELS_MS: [u64; 5] = [1, 2, 5, 10, 30];
/// Largest latency the histograms resolve; longer ones are recorded as this.
const MAX_LATENCY_US: u64 = 600_000_000;

/// Latencies of one kind of operation.
#[derive(Clone)]
pub struct LatencyRecorder {
    hist: Histogram<u64>,
    within: [u64; SERVICE_LEVELS_MS.len()],
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        LatencyRecorder {
            // Bounds are constants that hdrhistogram accepts (1 <= low, high >= 2*low, 3 digits).
            hist: Histogram::new_with_bounds(1, MAX_LATENCY_US, 3)
                .unwrap_or_else(|_| unreachable!("constant histogram bounds are valid")),
            within: [0; SERVICE_LEVELS_MS.len()],
        }
    }
}

impl LatencyRecorder {
    pub fn record_us(&mut self, latency_us: u64) {
        self.hist.saturating_record(latency_us.max(1));
        for (count, ms) in self.within.iter_mut().zip(SERVICE_LEVELS_MS) {
            if latency_us <= ms * 1000 {
                *count += 1;
            }
        }
    }

    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    pub fn merge(&mut self, other: &LatencyRecorder) {
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.hist.add(&other.hist);
        for (a, b) in self.within.iter_mut().zip(other.within) {
            *a += b;
        }
    }

    /// None when nothing was recorded.
    pub fn summary(&self) -> Option<LatencySummary> {
        if self.hist.is_empty() {
            return None;
        }
        let q = |x: f64| self.hist.value_at_quantile(x) as f64;
        Some(LatencySummary {
            mean: self.hist.mean(),
            p50: q(0.50),
            p95: q(0.95),
            p99: q(0.99),
            p999: q(0.999),
            max: self.hist.max() as f64,
        })
    }

    pub fn service_levels(&self) -> Vec<ServiceLevel> {
        let n = self.count();
        SERVICE_LEVELS_MS
            .iter()
            .zip(self.within)
            .map(|(&ms, count)| ServiceLevel {
                within_ms: ms,
                share: (n > 0).then(|| count as f64 / n as f64),
            })
            .collect()
    }
}

/// Latency figures in microseconds (values within 0.1% of the true quantile).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ServiceLevel {
    pub within_ms: u64,
    /// Share of the step's I/Os that finished within `within_ms`, 0..1; None (null in the
    /// report) when the step measured no I/O, so that no I/O does not read as all of them late.
    pub share: Option<f64>,
}

/// Everything one connection (or, merged, one step) measured.
#[derive(Clone, Default)]
pub struct StepCounters {
    pub reads: LatencyRecorder,
    pub writes: LatencyRecorder,
    /// Reads and writes that completed inside the measured window, and their bytes.
    pub reads_done: u64,
    pub writes_done: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    /// Arrivals of the schedule that could not be sent before the step ended, every slot busy.
    pub late_arrivals: u64,
    /// Their waits until the step ended (lower bounds of their latencies).
    pub late: LatencyRecorder,
    /// How late the generator itself sent requests that had a free slot (its own timer error),
    /// and how late it stopped for those it never sent.
    pub schedule_lag: LatencyRecorder,
    /// The run was stopped (a signal) before this step ended: its figures are incomplete.
    pub cut_short: bool,
}

impl StepCounters {
    pub fn merge(&mut self, o: &StepCounters) {
        self.reads.merge(&o.reads);
        self.writes.merge(&o.writes);
        self.reads_done += o.reads_done;
        self.writes_done += o.writes_done;
        self.read_bytes += o.read_bytes;
        self.write_bytes += o.write_bytes;
        self.errors += o.errors;
        self.late_arrivals += o.late_arrivals;
        self.late.merge(&o.late);
        self.schedule_lag.merge(&o.schedule_lag);
        self.cut_short |= o.cut_short;
    }

    pub fn all(&self) -> LatencyRecorder {
        let mut all = self.reads.clone();
        all.merge(&self.writes);
        all.merge(&self.late);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed: 10 values, of which 3 are within 1 ms, 5 within 2 ms, 7 within 5 ms,
    /// 8 within 10 ms, 9 within 30 ms (the boundary values count as within).
    #[test]
    fn service_levels_count_exactly() {
        let mut r = LatencyRecorder::default();
        for us in [
            100, 999, 1000, 1001, 2000, 4999, 5000, 10_000, 30_000, 30_001,
        ] {
            r.record_us(us);
        }
        let shares: Vec<Option<f64>> = r.service_levels().iter().map(|s| s.share).collect();
        assert_eq!(shares, [0.3, 0.5, 0.7, 0.8, 0.9].map(Some));
        assert_eq!(r.count(), 10);
    }

    /// Hand-computed: 1..=1000 µs once each; mean 500.5, p50 500, p99 990, max 1000.
    #[test]
    fn quantiles_and_mean_match_a_uniform_ramp() {
        let mut r = LatencyRecorder::default();
        for us in 1..=1000 {
            r.record_us(us);
        }
        let s = r.summary().unwrap();
        assert_eq!(s.mean, 500.5);
        assert_eq!(s.p50, 500.0);
        assert_eq!(s.p95, 950.0);
        assert_eq!(s.p99, 990.0);
        assert_eq!(s.p999, 999.0);
        assert_eq!(s.max, 1000.0);
    }

    /// Large values keep 3 significant digits; merging adds counts.
    #[test]
    fn merge_and_precision() {
        let mut a = LatencyRecorder::default();
        let mut b = LatencyRecorder::default();
        a.record_us(12_345);
        b.record_us(250);
        b.record_us(250);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        let s = a.summary().unwrap();
        assert!((s.max - 12_345.0).abs() <= 12.345, "{}", s.max);
        assert_eq!(s.p50, 250.0);
        assert_eq!(a.service_levels()[0].share, Some(2.0 / 3.0));
        assert!(LatencyRecorder::default().summary().is_none());
        let empty = LatencyRecorder::default().service_levels();
        assert_eq!(empty.len(), SERVICE_LEVELS_MS.len());
        assert!(empty.iter().all(|s| s.share.is_none()), "{empty:?}");
    }
}
