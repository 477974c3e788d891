//! Per-device accounting. Every implementation owns one [`Counters`] and bumps it once per call
//! (not per internal retry or resubmission), so wear and traffic figures agree across file and
//! memory devices. Failed calls, including those rejected for bad arguments, count in `errors`
//! only; writes refused for want of room on the file system under a device file count in
//! `no_room_errors` instead.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Number of buckets in an [`IoSizeHistogram`]: buckets 0..=26 cover sizes up to 64 MiB,
/// bucket 27 holds everything larger.
pub const IO_SIZE_BUCKETS: usize = 28;

/// I/O sizes in power-of-two buckets: bucket i counts I/Os of size in (2^(i-1), 2^i] bytes,
/// bucket 12 is 4 KiB, the last bucket holds everything larger.
///
/// Bucket 0 counts sizes 0 and 1. A snapshot always has [`IO_SIZE_BUCKETS`] buckets.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct IoSizeHistogram {
    pub buckets: Vec<u64>,
}

impl IoSizeHistogram {
    /// The bucket an I/O of `size_bytes` falls in: ceil(log2(size)), clamped to the last one.
    pub fn bucket_of(size_bytes: u64) -> usize {
        if size_bytes <= 1 {
            return 0;
        }
        let ceil_log2 = (u64::BITS - (size_bytes - 1).leading_zeros()) as usize;
        ceil_log2.min(IO_SIZE_BUCKETS - 1)
    }

    /// Total I/Os counted.
    pub fn total(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

/// Counters as the device sees the I/O.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DeviceStats {
    pub name: String,
    pub size_bytes: u64,
    pub read_bytes: u64,
    pub read_ops: u64,
    pub write_bytes: u64,
    pub write_ops: u64,
    pub flush_ops: u64,
    pub discard_ops: u64,
    pub discard_bytes: u64,
    /// Discards the device or file system refused as unsupported (EOPNOTSUPP); not errors,
    /// because a discard is only a hint.
    pub discard_unsupported_ops: u64,
    /// Failed calls of any kind (read, write, flush, discard), counted once per call, but for
    /// those in `no_room_errors`.
    pub errors: u64,
    /// Calls refused for want of room on the file system under a device file (ENOSPC, EDQUOT):
    /// nothing is wrong with the device, and the same write succeeds once there is room.
    pub no_room_errors: u64,
    pub read_sizes: IoSizeHistogram,
    pub write_sizes: IoSizeHistogram,
}

/// The live, lock-free counters behind [`DeviceStats`]; shared by every device implementation.
///
/// Relaxed atomics: each counter is exact, but a snapshot taken during I/O may mix counters from
/// slightly different instants (e.g. `read_ops` bumped, `read_bytes` not yet), which is fine for
/// monitoring.
#[derive(Debug)]
pub struct Counters {
    read_bytes: AtomicU64,
    read_ops: AtomicU64,
    write_bytes: AtomicU64,
    write_ops: AtomicU64,
    flush_ops: AtomicU64,
    discard_ops: AtomicU64,
    discard_bytes: AtomicU64,
    discard_unsupported_ops: AtomicU64,
    errors: AtomicU64,
    no_room_errors: AtomicU64,
    read_sizes: [AtomicU64; IO_SIZE_BUCKETS],
    write_sizes: [AtomicU64; IO_SIZE_BUCKETS],
}

impl Default for Counters {
    fn default() -> Self {
        Counters::new()
    }
}

impl Counters {
    pub fn new() -> Counters {
        Counters {
            read_bytes: AtomicU64::new(0),
            read_ops: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
            write_ops: AtomicU64::new(0),
            flush_ops: AtomicU64::new(0),
            discard_ops: AtomicU64::new(0),
            discard_bytes: AtomicU64::new(0),
            discard_unsupported_ops: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            no_room_errors: AtomicU64::new(0),
            read_sizes: std::array::from_fn(|_| AtomicU64::new(0)),
            write_sizes: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// A completed read of `len` bytes.
    pub fn record_read(&self, len: u64) {
        self.read_ops.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(len, Ordering::Relaxed);
        self.read_sizes[IoSizeHistogram::bucket_of(len)].fetch_add(1, Ordering::Relaxed);
    }

    /// A completed write of `len` bytes.
    pub fn record_write(&self, len: u64) {
        self.write_ops.fetch_add(1, Ordering::Relaxed);
        self.write_bytes.fetch_add(len, Ordering::Relaxed);
        self.write_sizes[IoSizeHistogram::bucket_of(len)].fetch_add(1, Ordering::Relaxed);
    }

    /// A completed flush.
    pub fn record_flush(&self) {
        self.flush_ops.fetch_add(1, Ordering::Relaxed);
    }

    /// A completed discard of `len` bytes.
    pub fn record_discard(&self, len: u64) {
        self.discard_ops.fetch_add(1, Ordering::Relaxed);
        self.discard_bytes.fetch_add(len, Ordering::Relaxed);
    }

    /// A discard the device refused as unsupported.
    pub fn record_discard_unsupported(&self) {
        self.discard_unsupported_ops.fetch_add(1, Ordering::Relaxed);
    }

    /// A failed call.
    pub fn record_error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// A call that failed with `err`: in `no_room_errors` when its file system had no room,
    /// in `errors` otherwise.
    pub fn record_failure(&self, err: &std::io::Error) {
        match err.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => {
                self.no_room_errors.fetch_add(1, Ordering::Relaxed);
            }
            _ => self.record_error(),
        }
    }

    /// A copy of the counters, labelled with the device's name and size.
    pub fn snapshot(&self, name: &str, size_bytes: u64) -> DeviceStats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let histogram = |b: &[AtomicU64; IO_SIZE_BUCKETS]| IoSizeHistogram {
            buckets: b.iter().map(load).collect(),
        };
        DeviceStats {
            name: name.to_string(),
            size_bytes,
            read_bytes: load(&self.read_bytes),
            read_ops: load(&self.read_ops),
            write_bytes: load(&self.write_bytes),
            write_ops: load(&self.write_ops),
            flush_ops: load(&self.flush_ops),
            discard_ops: load(&self.discard_ops),
            discard_bytes: load(&self.discard_bytes),
            discard_unsupported_ops: load(&self.discard_unsupported_ops),
            errors: load(&self.errors),
            no_room_errors: load(&self.no_room_errors),
            read_sizes: histogram(&self.read_sizes),
            write_sizes: histogram(&self.write_sizes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_ceil_log2() {
        assert_eq!(IoSizeHistogram::bucket_of(0), 0);
        assert_eq!(IoSizeHistogram::bucket_of(1), 0);
        assert_eq!(IoSizeHistogram::bucket_of(2), 1);
        assert_eq!(IoSizeHistogram::bucket_of(3), 2);
        assert_eq!(IoSizeHistogram::bucket_of(4096), 12);
        assert_eq!(IoSizeHistogram::bucket_of(4097), 13);
        assert_eq!(IoSizeHistogram::bucket_of(8192), 13);
        assert_eq!(IoSizeHistogram::bucket_of(1 << 20), 20);
        assert_eq!(IoSizeHistogram::bucket_of(64 << 20), 26);
        assert_eq!(IoSizeHistogram::bucket_of((64 << 20) + 1), 27);
        assert_eq!(IoSizeHistogram::bucket_of(u64::MAX), 27);
    }

    /// A write the file system had no room for is counted apart from device errors.
    #[test]
    fn a_full_file_system_is_not_a_device_error() {
        let counters = Counters::new();
        for errno in [libc::ENOSPC, libc::EDQUOT, libc::EIO] {
            counters.record_failure(&std::io::Error::from_raw_os_error(errno));
        }
        counters.record_failure(&std::io::Error::other("no errno"));
        let stats = counters.snapshot("dev", 1 << 30);
        assert_eq!((stats.errors, stats.no_room_errors), (2, 2));
    }

    #[test]
    fn snapshot_reflects_records() {
        let counters = Counters::new();
        counters.record_read(4096);
        counters.record_read(4096);
        counters.record_write(1 << 20);
        counters.record_flush();
        counters.record_discard(8192);
        counters.record_discard_unsupported();
        counters.record_error();
        let stats = counters.snapshot("dev", 1 << 30);
        assert_eq!(stats.name, "dev");
        assert_eq!(stats.size_bytes, 1 << 30);
        assert_eq!((stats.read_ops, stats.read_bytes), (2, 8192));
        assert_eq!((stats.write_ops, stats.write_bytes), (1, 1 << 20));
        assert_eq!(
            (stats.flush_ops, stats.discard_ops, stats.discard_bytes),
            (1, 1, 8192)
        );
        assert_eq!((stats.discard_unsupported_ops, stats.errors), (1, 1));
        assert_eq!(stats.read_sizes.buckets.len(), IO_SIZE_BUCKETS);
        assert_eq!(stats.read_sizes.buckets[12], 2);
        assert_eq!(stats.write_sizes.buckets[20], 1);
        assert_eq!(stats.write_sizes.total(), 1);
    }
}
