//! `Throttled<D>`: a device wrapper that limits bandwidth and IOPS with token buckets, so tests
//! and benchmarks can stand a fast file in for a slow capacity device (QLC SSD, HDD). Reports
//! that use it must say so (see DESIGN.md: "say which in every report").
//!
//! Callers that exceed the rate sleep on their own thread; nothing is queued, so the only bound
//! needed is the number of callers. Each call reserves its tokens at once and sleeps until the
//! bucket would have refilled, so concurrent callers are paced in arrival order and the long-run
//! rate is exact no matter how many threads push.
//!
//! The mixed-load penalty models NAND flash, whose sustained bandwidth falls when reads and
//! writes mix (program and erase cycles stall reads queued behind them on the same die), while
//! Optane-class media keep theirs. With `w` the write share of the bytes moved over the last
//! `mix_window_ms` and `m = 4·w·(1−w)` the degree of mixing (0 for one-way traffic, 1 at 50/50),
//! each byte costs `(1−m) + m·bandwidth/mixed_bandwidth` tokens of the bandwidth bucket: the time
//! per byte moves linearly from the one-way cost to the 50/50 cost. docs/BENCH.md lists the
//! parameters and where the presets' numbers come from.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::{AlignedBuf, Device, DeviceError, DeviceStats, ReadDone};

/// Rate limits for [`Throttled`]. Zero means "unlimited" for every field.
///
/// Rough figures to emulate: a QLC SSD past its SLC cache writes 80-200 MB/s; a 7200 rpm HDD
/// streams 150-250 MB/s but manages only 100-200 random IOPS, with 4-8 ms per random access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThrottleConfig {
    /// Sustained read + write bandwidth, bytes per second (one shared bucket, as on a device).
    pub bandwidth_bytes_per_s: u64,
    /// Sustained reads + writes + flushes per second.
    pub iops: u64,
    /// Bytes that may pass without waiting after an idle period (the bucket size).
    /// 0 picks 10 ms worth of bandwidth.
    pub burst_bytes: u64,
    /// Operations that may pass without waiting after an idle period; 0 picks 10 ms worth
    /// (at least 1).
    pub burst_ops: u64,
    /// Latency added to every read, write and flush, in microseconds (an HDD's seek). It is
    /// slept without holding any lock, so it does not cap throughput by itself: concurrent
    /// callers overlap their latencies as queued commands on a real device do.
    pub latency_us: u64,
    /// Total read + write bandwidth at a 50/50 mix, bytes per second; 0 means no mixed-load
    /// penalty. Only meaningful with `bandwidth_bytes_per_s` set and not above it.
    pub mixed_bandwidth_bytes_per_s: u64,
    /// Window over which the read/write mix is measured (an exponential moving average with this
    /// time constant); 0 picks [`DEFAULT_MIX_WINDOW_MS`].
    pub mix_window_ms: u64,
}

/// Default time constant of the read/write mix average.
pub const DEFAULT_MIX_WINDOW_MS: u64 = 100;

impl ThrottleConfig {
    /// True when every limit is off (the wrapper then only forwards).
    pub fn is_unlimited(&self) -> bool {
        self.bandwidth_bytes_per_s == 0 && self.iops == 0 && self.latency_us == 0
    }
}

/// Bytes read and written recently, decayed exponentially: the mix the penalty looks at.
struct MixTracker {
    window_s: f64,
    read_bytes: f64,
    write_bytes: f64,
    updated_at: Instant,
}

impl MixTracker {
    fn new(window_ms: u64, now: Instant) -> MixTracker {
        let window_ms = if window_ms == 0 {
            DEFAULT_MIX_WINDOW_MS
        } else {
            window_ms
        };
        MixTracker {
            window_s: window_ms as f64 / 1000.0,
            read_bytes: 0.0,
            write_bytes: 0.0,
            updated_at: now,
        }
    }

    /// Adds one operation and returns the write share of the recent bytes (0 when idle).
    fn record(&mut self, dir: Direction, bytes: u64, now: Instant) -> f64 {
        let dt_s = now.saturating_duration_since(self.updated_at).as_secs_f64();
        let decay = (-dt_s / self.window_s).exp();
        self.read_bytes *= decay;
        self.write_bytes *= decay;
        self.updated_at = now;
        match dir {
            Direction::Read => self.read_bytes += bytes as f64,
            Direction::Write => self.write_bytes += bytes as f64,
            Direction::None => {}
        }
        let total = self.read_bytes + self.write_bytes;
        if total > 0.0 {
            self.write_bytes / total
        } else {
            0.0
        }
    }
}

/// What an admitted operation does, for the mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Read,
    Write,
    None,
}

/// Tokens per byte at write share `write_share`: 1 for one-way traffic, `bandwidth /
/// mixed_bandwidth` at 50/50, linear in `4·w·(1−w)` between.
pub fn mixed_cost_per_byte(config: &ThrottleConfig, write_share: f64) -> f64 {
    let (bw, mixed) = (
        config.bandwidth_bytes_per_s,
        config.mixed_bandwidth_bytes_per_s,
    );
    if bw == 0 || mixed == 0 || mixed >= bw {
        return 1.0;
    }
    let w = write_share.clamp(0.0, 1.0);
    let mixing = 4.0 * w * (1.0 - w);
    (1.0 - mixing) + mixing * bw as f64 / mixed as f64
}

/// A token bucket; tokens may go negative, which is a reservation the caller sleeps off.
struct TokenBucket {
    rate_per_s: f64,
    capacity: f64,
    tokens: f64,
    refilled_at: Instant,
}

impl TokenBucket {
    /// None for an unlimited rate.
    fn new(rate_per_s: u64, burst: u64, now: Instant) -> Option<TokenBucket> {
        if rate_per_s == 0 {
            return None;
        }
        let rate_per_s = rate_per_s as f64;
        let capacity = if burst == 0 {
            (rate_per_s / 100.0).max(1.0)
        } else {
            burst as f64
        };
        Some(TokenBucket {
            rate_per_s,
            capacity,
            tokens: capacity,
            refilled_at: now,
        })
    }

    /// Takes `cost` tokens and returns how long the caller must wait before proceeding.
    fn reserve(&mut self, cost: f64, now: Instant) -> Duration {
        let elapsed_s = now
            .saturating_duration_since(self.refilled_at)
            .as_secs_f64();
        self.tokens = (self.tokens + elapsed_s * self.rate_per_s).min(self.capacity);
        self.refilled_at = now;
        self.tokens -= cost;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate_per_s)
        }
    }
}

struct Buckets {
    config: ThrottleConfig,
    bytes: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    mix: MixTracker,
}

impl Buckets {
    fn new(config: ThrottleConfig) -> Buckets {
        let now = Instant::now();
        Buckets {
            config,
            bytes: TokenBucket::new(config.bandwidth_bytes_per_s, config.burst_bytes, now),
            ops: TokenBucket::new(config.iops, config.burst_ops, now),
            mix: MixTracker::new(config.mix_window_ms, now),
        }
    }
}

/// A [`Device`] that forwards to `inner` no faster than its [`ThrottleConfig`] allows. Its
/// stats and size are the inner device's; its name too, unless [`Throttled::with_label`] added
/// a label (so that reports built from device names say the device is emulated).
pub struct Throttled<D> {
    inner: D,
    buckets: Mutex<Buckets>,
    name: Option<String>,
}

impl<D: Device> Throttled<D> {
    pub fn new(inner: D, config: ThrottleConfig) -> Throttled<D> {
        Throttled {
            inner,
            buckets: Mutex::new(Buckets::new(config)),
            name: None,
        }
    }

    /// Names the device `"<inner name> [<label>]"` in `name()` and `stats()`.
    pub fn with_label(mut self, label: &str) -> Throttled<D> {
        self.name = Some(format!("{} [{label}]", self.inner.name()));
        self
    }

    /// Replaces the limits (the buckets start full again).
    pub fn set_config(&self, config: ThrottleConfig) {
        *self.buckets.lock() = Buckets::new(config);
    }

    pub fn config(&self) -> ThrottleConfig {
        self.buckets.lock().config
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Blocks until an operation moving `bytes` may proceed.
    fn admit(&self, dir: Direction, bytes: u64) {
        let now = Instant::now();
        let wait = {
            let mut buckets = self.buckets.lock();
            let write_share = buckets.mix.record(dir, bytes, now);
            let cost = bytes as f64 * mixed_cost_per_byte(&buckets.config, write_share);
            let bytes_wait = buckets
                .bytes
                .as_mut()
                .map_or(Duration::ZERO, |b| b.reserve(cost, now));
            let ops_wait = buckets
                .ops
                .as_mut()
                .map_or(Duration::ZERO, |b| b.reserve(1.0, now));
            bytes_wait.max(ops_wait) + Duration::from_micros(buckets.config.latency_us)
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

impl<D: Device> Device for Throttled<D> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.admit(Direction::Read, buf.len() as u64);
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.admit(Direction::Write, buf.len() as u64);
        self.inner.write_at(buf, offset)
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.admit(Direction::None, 0);
        self.inner.flush()
    }

    /// One admission for the write: the flush rides on it, as with FUA on a real device.
    fn write_durable_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.admit(Direction::Write, buf.len() as u64);
        self.inner.write_durable_at(buf, offset)
    }

    /// One admission for all the parts, as for `write_durable_at`.
    fn write_all_durable(&self, parts: &[(&[u8], u64)]) -> Result<(), DeviceError> {
        let bytes = parts.iter().map(|(b, _)| b.len() as u64).sum();
        self.admit(Direction::Write, bytes);
        self.inner.write_all_durable(parts)
    }

    /// Not throttled: a discard moves no data, and a hint should not hold up the caller.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.inner.discard(offset, len)
    }

    fn discard_is_cheap(&self) -> bool {
        self.inner.discard_is_cheap()
    }

    fn stats(&self) -> DeviceStats {
        let mut stats = self.inner.stats();
        if let Some(name) = &self.name {
            stats.name.clone_from(name);
        }
        stats
    }

    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or_else(|| self.inner.name())
    }

    fn io_backend_name(&self) -> &'static str {
        self.inner.io_backend_name()
    }
}

/// Lets wrappers such as [`Throttled`] take the `Arc<dyn Device>` that `open_path` returns.
impl<D: Device + ?Sized> Device for Arc<D> {
    fn size_bytes(&self) -> u64 {
        (**self).size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        (**self).read_at(buf, offset)
    }
    fn read_async(&self, buf: AlignedBuf, offset: u64, done: ReadDone) -> Result<(), (AlignedBuf, ReadDone)> {
        (**self).read_async(buf, offset, done)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        (**self).write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        (**self).flush()
    }
    fn write_durable_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        (**self).write_durable_at(buf, offset)
    }
    fn write_all_durable(&self, parts: &[(&[u8], u64)]) -> Result<(), DeviceError> {
        (**self).write_all_durable(parts)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        (**self).discard(offset, len)
    }
    fn discard_is_cheap(&self) -> bool {
        (**self).discard_is_cheap()
    }
    fn stats(&self) -> DeviceStats {
        (**self).stats()
    }
    fn name(&self) -> &str {
        (**self).name()
    }
    fn io_backend_name(&self) -> &'static str {
        (**self).io_backend_name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{self, pattern};
    use crate::{MemDevice, BLOCK_SIZE};

    const MIB: u64 = 1 << 20;

    #[test]
    fn unlimited_passes_the_contract_checks() {
        let dev = Throttled::new(MemDevice::new("slow", 8 * MIB), ThrottleConfig::default());
        test_util::check_rejects_bad_io(&dev);
        test_util::check_read_after_write(&dev);
        test_util::check_discard_counted(&dev);
        assert_eq!(dev.name(), "slow");
        assert_eq!(dev.stats().write_ops, dev.inner().stats().write_ops);
    }

    #[test]
    fn bandwidth_is_limited() {
        let config = ThrottleConfig {
            bandwidth_bytes_per_s: 8 * MIB,
            burst_bytes: 64 << 10,
            ..ThrottleConfig::default()
        };
        let dev = Throttled::new(MemDevice::new("slow", 8 * MIB), config);
        let block = pattern(1, 1);
        let start = Instant::now();
        for i in 0..1024 {
            dev.write_at(&block, i * BLOCK_SIZE as u64).unwrap();
        }
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_millis(400),
            "4 MiB at 8 MiB/s took {elapsed:?}"
        );
        assert_eq!(dev.stats().write_bytes, 4 * MIB);
    }

    #[test]
    fn iops_are_limited_across_threads() {
        let config = ThrottleConfig {
            iops: 200,
            burst_ops: 1,
            ..ThrottleConfig::default()
        };
        let dev = Arc::new(Throttled::new(MemDevice::new("hdd", 8 * MIB), config));
        let start = Instant::now();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let dev = Arc::clone(&dev);
                std::thread::spawn(move || {
                    for i in 0..15 {
                        dev.write_at(&pattern(1, 2), (t * 15 + i) * BLOCK_SIZE as u64)
                            .unwrap();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_millis(250),
            "60 ops at 200 IOPS took {elapsed:?}"
        );
    }

    #[test]
    fn mixed_cost_follows_the_write_share() {
        let config = ThrottleConfig {
            bandwidth_bytes_per_s: 1000,
            mixed_bandwidth_bytes_per_s: 400,
            ..ThrottleConfig::default()
        };
        assert_eq!(mixed_cost_per_byte(&config, 0.0), 1.0);
        assert_eq!(mixed_cost_per_byte(&config, 1.0), 1.0);
        assert!((mixed_cost_per_byte(&config, 0.5) - 2.5).abs() < 1e-12);
        // w = 0.25: mixing 0.75, cost 0.25 + 0.75 * 2.5.
        assert!((mixed_cost_per_byte(&config, 0.25) - 2.125).abs() < 1e-12);
        let no_penalty = ThrottleConfig {
            mixed_bandwidth_bytes_per_s: 0,
            ..config
        };
        assert_eq!(mixed_cost_per_byte(&no_penalty, 0.5), 1.0);
    }

    /// Alternating reads and writes move fewer bytes per second than writes alone.
    #[test]
    fn mixed_traffic_is_slower_than_one_way_traffic() {
        let config = ThrottleConfig {
            bandwidth_bytes_per_s: 16 * MIB,
            mixed_bandwidth_bytes_per_s: 4 * MIB,
            burst_bytes: 64 << 10,
            ..ThrottleConfig::default()
        };
        let dev = Throttled::new(MemDevice::new("nand", 8 * MIB), config).with_label("emulated");
        let mut block = pattern(1, 3);
        let start = Instant::now();
        for i in 0..256u64 {
            dev.write_at(&block, i * BLOCK_SIZE as u64).unwrap();
        }
        let one_way = start.elapsed();
        let start = Instant::now();
        for i in 0..256u64 {
            if i % 2 == 0 {
                dev.write_at(&block, i * BLOCK_SIZE as u64).unwrap();
            } else {
                dev.read_at(&mut block, i * BLOCK_SIZE as u64).unwrap();
            }
        }
        let mixed = start.elapsed();
        // 1 MiB one way at 16 MiB/s is ~62 ms; mixed at 4 MiB/s ~250 ms.
        assert!(
            mixed >= Duration::from_millis(180),
            "mixed 1 MiB took {mixed:?}"
        );
        assert!(mixed > one_way * 2, "one-way {one_way:?}, mixed {mixed:?}");
        assert_eq!(dev.name(), "nand [emulated]");
        assert_eq!(dev.stats().name, "nand [emulated]");
    }

    #[test]
    fn latency_is_added_and_arc_devices_wrap() {
        let inner: Arc<dyn Device> = Arc::new(MemDevice::new("hdd", 8 * MIB));
        let dev = Throttled::new(
            inner,
            ThrottleConfig {
                latency_us: 5_000,
                ..ThrottleConfig::default()
            },
        );
        let start = Instant::now();
        for _ in 0..10 {
            dev.flush().unwrap();
        }
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert_eq!(dev.stats().flush_ops, 10);
        dev.set_config(ThrottleConfig::default());
        assert_eq!(dev.config(), ThrottleConfig::default());
    }
}
