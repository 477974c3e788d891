//! Once a second the sampler turns the node's counters into rates and interval percentiles and
//! keeps the last [`HISTORY_LEN`] samples: what the dashboard draws, what `strata status` and
//! `strata bench` read, and where the recent write rate for wear projections comes from.
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::Serialize;
use strata_engine::EngineStats;

use crate::adapter::Registry;
use crate::metrics::{IoSnapshot, LatencySnapshot, SERVICE_LEVELS_MS};

/// Samples kept: 15 minutes at one per second (a few hundred bytes each).
pub const HISTORY_LEN: usize = 900;
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeviceRate {
    pub name: String,
    /// "fast" or "capacity".
    pub tier: &'static str,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
}

/// One interval's figures. Latencies are over the requests that finished in the interval
/// (None when there were none), measured in the daemon from request to engine completion.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Sample {
    pub t_unix_ms: u64,
    pub interval_s: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    pub latency_us_mean: Option<f64>,
    pub latency_us_p50: Option<f64>,
    pub latency_us_p99: Option<f64>,
    pub latency_us_p999: Option<f64>,
    pub read_latency_us_p99: Option<f64>,
    pub write_latency_us_p99: Option<f64>,
    /// Share of reads and writes done within 1, 2, 5, 10 and 30 ms, in that order.
    pub service_level_shares: Option<[f64; SERVICE_LEVELS_MS.len()]>,
    pub log_fill_ratio: f64,
    pub fill_ratio_low: f64,
    pub fill_ratio_high: f64,
    pub destage_rate_bytes_per_s: f64,
    pub destage_backlog_bytes: u64,
    pub log_dead_bytes: u64,
    pub admission_throttled: bool,
    /// `EngineStats::admission`: "open", "throttled", "measuring" or "waiting_for_room".
    pub admission: String,
    /// Share of bytes read from stored data that came from the fast tier in the interval.
    pub fast_read_hit_ratio: Option<f64>,
    pub devices: Vec<DeviceRate>,
}

/// The counters a sample is the difference of.
#[derive(Clone)]
struct Reading {
    at: Instant,
    io: IoSnapshot,
    engine: EngineStats,
}

pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    pub fn new() -> Arc<History> {
        Arc::new(History {
            samples: Mutex::new(VecDeque::with_capacity(HISTORY_LEN)),
        })
    }

    /// Keeps the samples' times increasing: a client asks for the samples after the last one
    /// it has (the dashboard does, every second), so after the wall clock steps back it would
    /// get none until the clock caught up. Until then a sample is dated half its interval
    /// after the one before, so that the dates rejoin the clock (in twice the step) rather
    /// than stay ahead of it for good.
    pub fn push(&self, mut s: Sample) {
        let mut q = self.samples.lock();
        if let Some(last) = q.back().filter(|last| s.t_unix_ms <= last.t_unix_ms) {
            let half_interval_ms = (s.interval_s * 500.0).round().max(1.0) as u64;
            s.t_unix_ms = last.t_unix_ms + half_interval_ms;
        }
        if q.len() == HISTORY_LEN {
            q.pop_front();
        }
        q.push_back(s);
    }

    /// Samples taken after `since_unix_ms` (all with 0), oldest first.
    pub fn since(&self, since_unix_ms: u64) -> Vec<Sample> {
        self.samples
            .lock()
            .iter()
            .filter(|s| s.t_unix_ms > since_unix_ms)
            .cloned()
            .collect()
    }

    pub fn latest(&self) -> Option<Sample> {
        self.samples.lock().back().cloned()
    }

    /// Mean rate of host writes over the last `window`, from the samples (None when empty).
    pub fn recent_write_bytes_per_s(&self, window: Duration) -> Option<f64> {
        self.recent_mean(window, |s| Some(s.write_bytes_per_s))
    }

    /// Mean write rate a device saw over the last `window` (None when no sample has it).
    pub fn recent_device_write_bytes_per_s(&self, device: &str, window: Duration) -> Option<f64> {
        self.recent_mean(window, |s| {
            let d = s.devices.iter().find(|d| d.name == device)?;
            Some(d.write_bytes_per_s)
        })
    }

    /// The rate over the newest samples that cover `window`, each weighted by its interval:
    /// a sampler that fell behind leaves one long sample, which stands for all of its time.
    fn recent_mean(&self, window: Duration, rate: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        let q = self.samples.lock();
        let (mut bytes, mut secs) = (0.0, 0.0);
        for s in q.iter().rev() {
            if secs >= window.as_secs_f64() {
                break;
            }
            if let Some(r) = rate(s) {
                bytes += r * s.interval_s;
                secs += s.interval_s;
            }
        }
        (secs > 0.0).then(|| bytes / secs)
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn read_now(registry: &Registry) -> Reading {
    Reading {
        at: Instant::now(),
        io: registry.node_io().snapshot(),
        engine: registry.group().stats(),
    }
}

fn rate(now: u64, before: u64, secs: f64) -> f64 {
    now.saturating_sub(before) as f64 / secs
}

/// The sample for the interval between two readings.
fn sample(prev: &Reading, now: &Reading) -> Sample {
    let secs = now.at.duration_since(prev.at).as_secs_f64().max(1e-3);
    let (a, b) = (&prev.io, &now.io);
    let mut lat: LatencySnapshot = b.read_latency.since(&a.read_latency);
    let reads = lat;
    let writes = b.write_latency.since(&a.write_latency);
    lat.merge(&writes);
    let service_level_shares = (lat.count() > 0).then(|| {
        SERVICE_LEVELS_MS.map(|ms| lat.share_within_ms(ms).unwrap_or(0.0))
    });
    let (e0, e1) = (&prev.engine, &now.engine);
    // Reads of the read cache's copies are fast-tier hits too.
    let fast = (e1.read_fast_bytes_total + e1.read_cached_bytes_total)
        .saturating_sub(e0.read_fast_bytes_total + e0.read_cached_bytes_total);
    let cap = e1
        .read_capacity_bytes_total
        .saturating_sub(e0.read_capacity_bytes_total);
    let fast_read_hit_ratio = (fast + cap > 0).then(|| fast as f64 / (fast + cap) as f64);
    let pairs = std::iter::once((&e0.fast_device, &e1.fast_device, "fast")).chain(
        e0.capacity_devices
            .iter()
            .zip(&e1.capacity_devices)
            .map(|(x, y)| (x, y, "capacity")),
    );
    let devices = pairs
        .map(|(x, y, tier)| DeviceRate {
            name: y.name.clone(),
            tier,
            read_bytes_per_s: rate(y.read_bytes, x.read_bytes, secs),
            write_bytes_per_s: rate(y.write_bytes, x.write_bytes, secs),
        })
        .collect();
    Sample {
        t_unix_ms: unix_ms(),
        interval_s: secs,
        read_iops: rate(b.read_ops, a.read_ops, secs),
        write_iops: rate(b.write_ops, a.write_ops, secs),
        read_bytes_per_s: rate(b.read_bytes, a.read_bytes, secs),
        write_bytes_per_s: rate(b.write_bytes, a.write_bytes, secs),
        latency_us_mean: lat.mean_us(),
        latency_us_p50: lat.quantile_us(0.5),
        latency_us_p99: lat.quantile_us(0.99),
        latency_us_p999: lat.quantile_us(0.999),
        read_latency_us_p99: reads.quantile_us(0.99),
        write_latency_us_p99: writes.quantile_us(0.99),
        service_level_shares,
        log_fill_ratio: e1.log_fill_ratio,
        fill_ratio_low: e1.fill_ratio_low,
        fill_ratio_high: e1.fill_ratio_high,
        destage_rate_bytes_per_s: e1.destage_rate_bytes_per_s,
        destage_backlog_bytes: e1.destage_backlog_bytes,
        log_dead_bytes: e1.log_dead_bytes,
        admission_throttled: e1.admission_throttled,
        admission: e1.admission.clone(),
        fast_read_hit_ratio,
        devices,
    }
}

/// Samples once a second until `stop` is set; runs on its own thread (the engine's stats
/// take locks that are not for the async runtime's threads).
pub fn spawn_sampler(
    registry: Arc<Registry>,
    history: Arc<History>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("strata-sampler".into())
        .spawn(move || {
            use std::sync::atomic::Ordering;
            let mut prev = read_now(&registry);
            let mut next = prev.at + SAMPLE_INTERVAL;
            while !stop.load(Ordering::Relaxed) {
                let now = Instant::now();
                if now < next {
                    std::thread::sleep((next - now).min(Duration::from_millis(100)));
                    continue;
                }
                next += SAMPLE_INTERVAL;
                if next < now {
                    next = now + SAMPLE_INTERVAL;
                }
                let cur = read_now(&registry);
                history.push(sample(&prev, &cur));
                prev = cur;
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{IoMetrics, Kind};
    use crate::testutil::test_group;

    #[test]
    fn a_sample_is_the_rate_over_its_interval() {
        let registry = Registry::new(test_group());
        let before = read_now(&registry);
        let io: &IoMetrics = registry.node_io();
        for _ in 0..10 {
            io.record(Kind::Write, 4096, Duration::from_micros(1_500), true);
        }
        io.record(Kind::Read, 8192, Duration::from_millis(20), true);
        let mut after = read_now(&registry);
        after.at = before.at + Duration::from_secs(2);
        let s = sample(&before, &after);
        assert_eq!(s.interval_s, 2.0);
        assert_eq!(s.write_iops, 5.0);
        assert_eq!(s.write_bytes_per_s, 20480.0);
        assert_eq!(s.read_iops, 0.5);
        let shares = s.service_level_shares.unwrap();
        assert_eq!(shares[0], 0.0, "none within 1 ms");
        assert!((shares[1] - 10.0 / 11.0).abs() < 1e-9, "{shares:?}");
        assert_eq!(shares[4], 1.0, "all within 30 ms");
        assert_eq!(s.devices.len(), 2, "fast + one capacity device");
        assert_eq!(s.devices[0].tier, "fast");
    }

    #[test]
    fn sample_times_keep_increasing_when_the_wall_clock_steps_back() {
        let registry = Registry::new(test_group());
        let r = read_now(&registry);
        let h = History::new();
        let mut s = sample(&r, &r);
        s.interval_s = 1.0;
        s.t_unix_ms = 10_000_000;
        h.push(s.clone());
        // The clock steps back an hour; the client has the first sample and asks for the rest.
        s.t_unix_ms = 10_000_000 - 3_600_000;
        h.push(s.clone());
        let after = h.since(10_000_000);
        assert_eq!(
            after.len(),
            1,
            "the sample taken after the step never reaches the client"
        );
        assert_eq!(
            after[0].t_unix_ms, 10_000_500,
            "dated half an interval after the one before"
        );
        // Two hours on, the dates are the clock's again.
        for i in 1..=7_201 {
            s.t_unix_ms = 10_000_000 - 3_600_000 + i * 1_000;
            h.push(s.clone());
        }
        let last = h.latest().unwrap();
        assert_eq!(
            last.t_unix_ms,
            10_000_000 + 3_601_000,
            "the dates stayed ahead of the clock"
        );
    }

    #[test]
    fn history_keeps_a_bounded_window() {
        let registry = Registry::new(test_group());
        let r = read_now(&registry);
        let h = History::new();
        for i in 0..HISTORY_LEN + 10 {
            let mut s = sample(&r, &r);
            s.t_unix_ms = i as u64 + 1;
            s.interval_s = 1.0;
            s.write_bytes_per_s = i as f64;
            h.push(s);
        }
        assert_eq!(h.since(0).len(), HISTORY_LEN);
        assert_eq!(h.since(0)[0].t_unix_ms, 11);
        assert_eq!(h.since(HISTORY_LEN as u64 + 8).len(), 2);
        let last = (HISTORY_LEN + 9) as f64;
        assert_eq!(h.recent_write_bytes_per_s(Duration::from_secs(2)), Some(last - 0.5));
    }

    #[test]
    fn recent_rates_weigh_each_sample_by_its_interval() {
        let registry = Registry::new(test_group());
        let r = read_now(&registry);
        let h = History::new();
        let mut s = sample(&r, &r);
        let fast = s.devices[0].name.clone();
        // Nine seconds at 100 B/s in one late sample, then one second at 1,000 B/s.
        for (interval_s, rate) in [(9.0, 100.0), (1.0, 1_000.0)] {
            s.interval_s = interval_s;
            s.write_bytes_per_s = rate;
            s.devices[0].write_bytes_per_s = rate;
            s.t_unix_ms += 1_000;
            h.push(s.clone());
        }
        let ten_s = Duration::from_secs(10);
        assert_eq!(h.recent_write_bytes_per_s(ten_s), Some(190.0));
        assert_eq!(h.recent_device_write_bytes_per_s(&fast, ten_s), Some(190.0));
        // The newest second alone is the newest sample alone.
        let one_s = Duration::from_secs(1);
        assert_eq!(h.recent_write_bytes_per_s(one_s), Some(1_000.0));
        assert_eq!(h.recent_device_write_bytes_per_s("no-such-device", ten_s), None);
    }
}
