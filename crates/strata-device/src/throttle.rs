//! `Throttled<D>`: a device wrapper that limits bandwidth and IOPS with token buckets, so tests
//! and benchmarks can stand a fast file in for a slow capacity device (QLC SSD, HDD). Reports
//! that use it must say so (see DESIGN.md: "say which in every report").
//!
//! Callers that exceed the rate sleep on their own thread; nothing is queued, so the only bound
//! needed is the number of callers. Each call reserves its tokens at once and sleeps until the
//! bucket would have refilled, so concurrent callers are paced in arrival order and the long-run
//! rate is exact no matter how many threads push.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::{Device, DeviceError, DeviceStats};

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
}

impl Buckets {
    fn new(config: ThrottleConfig) -> Buckets {
        let now = Instant::now();
        Buckets {
            config,
            bytes: TokenBucket::new(config.bandwidth_bytes_per_s, config.burst_bytes, now),
            ops: TokenBucket::new(config.iops, config.burst_ops, now),
        }
    }
}

/// A [`Device`] that forwards to `inner` no faster than its [`ThrottleConfig`] allows. Its
/// stats, name and size are the inner device's.
pub struct Throttled<D> {
    inner: D,
    buckets: Mutex<Buckets>,
}

impl<D: Device> Throttled<D> {
    pub fn new(inner: D, config: ThrottleConfig) -> Throttled<D> {
        Throttled {
            inner,
            buckets: Mutex::new(Buckets::new(config)),
        }
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
    fn admit(&self, bytes: u64) {
        let now = Instant::now();
        let wait = {
            let mut buckets = self.buckets.lock();
            let bytes_wait = buckets
                .bytes
                .as_mut()
                .map_or(Duration::ZERO, |b| b.reserve(bytes as f64, now));
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
        self.admit(buf.len() as u64);
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.admit(buf.len() as u64);
        self.inner.write_at(buf, offset)
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.admit(0);
        self.inner.flush()
    }

    /// Not throttled: a discard moves no data, and a hint should not hold up the caller.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.inner.discard(offset, len)
    }

    fn stats(&self) -> DeviceStats {
        self.inner.stats()
    }

    fn name(&self) -> &str {
        self.inner.name()
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
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        (**self).write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        (**self).flush()
    }
    fn write_durable_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        (**self).write_durable_at(buf, offset)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        (**self).discard(offset, len)
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
