//! The device layer: every byte Strata stores goes through a [`Device`].
//!
//! Contract shared by every implementation:
//! - I/O is in whole [`BLOCK_SIZE`] units: offsets and lengths are multiples of 4096 and buffers
//!   are 4096-byte aligned in memory (use [`AlignedBuf`]); anything else is
//!   [`DeviceError::Misaligned`], never a silent bounce.
//! - A completed `write_at` is not durable until a later `flush` completes.
//! - Methods block the calling thread; many threads may call concurrently.
//! - Every implementation keeps [`DeviceStats`] as the device sees the I/O.
//!
//! Implementations:
//! - [`FileDevice`] (via [`open_path`] / [`open_with`]): a regular file or block device opened
//!   with O_DIRECT; each I/O goes through a small io_uring owned by the calling thread, or
//!   blocking system calls where io_uring is unavailable ([`IoBackend`], reported by [`Device::io_backend_name`]).
//! - [`MemDevice`]: in memory, with a volatile write cache, seeded crash and fault simulation,
//!   for tests.
//! - [`Throttled`]: a wrapper limiting bandwidth and IOPS (with an optional NAND-like
//!   mixed-load penalty), standing in for slow or NAND media; [`parse_emulation`] reads the
//!   daemon's `--fast-emulate` / `--capacity-emulate` specs.
//!
//! [`raw_random_io`] drives one io_uring directly: the baseline benchmarks compare against.

mod aligned;
mod check;
mod emulate;
mod error;
mod file;
mod os;
pub mod priority;
pub mod raw_bench;
mod rng;
mod sim;
mod stats;
mod throttle;
mod uring;
mod uring_async;

pub use aligned::AlignedBuf;
pub use error::DeviceError;
pub use file::{
    copy_on_write_file, open_path, open_with, shared_bytes_of, DurableWrite, FileDevice,
    IoBackend, OpenOptions, MIN_DEVICE_SIZE_BYTES,
};
pub use raw_bench::{raw_random_io, RawIoResult};
pub use sim::{CrashReport, FaultConfig, MemDevice};
pub use stats::{Counters, DeviceStats, IoSizeHistogram, IO_SIZE_BUCKETS};
pub use emulate::{parse_emulation, EmulationError, EmulationSpec};
pub use throttle::{mixed_cost_per_byte, ThrottleConfig, Throttled, DEFAULT_MIX_WINDOW_MS};

/// The unit of every device I/O, in bytes.
pub const BLOCK_SIZE: usize = 4096;

/// Called once with the buffer of a read started by [`Device::read_async`] and its outcome
/// (the buffer is filled on success). It runs on the device's completion thread and must not
/// block.
pub type ReadDone = Box<dyn FnOnce(AlignedBuf, Result<(), DeviceError>) + Send + 'static>;

/// A block device or file as Strata uses it.
pub trait Device: Send + Sync {
    /// Usable size in bytes (a multiple of [`BLOCK_SIZE`]).
    fn size_bytes(&self) -> u64;
    /// Fills `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError>;
    /// Starts a read of `buf.len()` bytes at `offset` and returns at once; `done` gets the
    /// buffer and the outcome. Devices without an asynchronous path, and reads it cannot take
    /// now (too many in flight, too large, misaligned), are handed back untouched: the
    /// caller then uses [`Device::read_at`] on a thread that may block.
    #[allow(clippy::result_large_err)]
    fn read_async(&self, buf: AlignedBuf, offset: u64, done: ReadDone) -> Result<(), (AlignedBuf, ReadDone)> {
        let _ = offset;
        Err((buf, done))
    }
    /// Writes `buf` at `offset` (not durable until `flush`).
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError>;
    /// Makes every completed write durable (fdatasync / device cache flush).
    fn flush(&self) -> Result<(), DeviceError>;
    /// Writes `buf` at `offset` and returns once that write is durable. Devices that can do
    /// both in one operation (an O_DSYNC write: the write with FUA or a flush behind it) save a
    /// round trip; the default writes, then flushes.
    fn write_durable_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.write_at(buf, offset)?;
        self.flush()
    }
    /// Writes every `(buf, offset)` part and returns once all of them are durable. The parts
    /// may reach the medium in any order; until this returns, none of them is promised. Devices
    /// that can submit the writes together (io_uring) make it cost about what one write of their
    /// total size does; the default writes each, then flushes once.
    fn write_all_durable(&self, parts: &[(&[u8], u64)]) -> Result<(), DeviceError> {
        for (buf, offset) in parts {
            self.write_at(buf, *offset)?;
        }
        self.flush()
    }
    /// Tells the device the range holds nothing of value. A no-op where unsupported.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError>;
    /// True where a discard of a range that already holds nothing costs next to nothing (a
    /// hole punched in a sparse file, memory), so a caller may discard every range it knows to
    /// be free, not only what it has just freed. False for block devices (a discard of a large
    /// range can take seconds there) and where a discard does nothing.
    fn discard_is_cheap(&self) -> bool {
        false
    }
    /// A snapshot of the counters.
    fn stats(&self) -> DeviceStats;
    /// A short human name (the path, or a test label).
    fn name(&self) -> &str;
    /// How the I/O is carried out ("io_uring", "threads", "memory"), for the daemon's start-up
    /// log and benchmark reports.
    fn io_backend_name(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod test_util;
