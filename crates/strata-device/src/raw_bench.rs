//! The baseline for benchmarks: random I/O driven straight through one io_uring at a fixed queue
//! depth on an O_DIRECT file or device, with none of Strata's machinery in the way. Engine
//! throughput is reported as a ratio against this figure measured in the same run.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};
use serde::Serialize;

use crate::check::is_block_aligned;
use crate::file::{open_raw, OpenMode};
use crate::rng::SplitMix64;
use crate::{AlignedBuf, DeviceError};

/// Deepest queue the helper drives; deeper than any NVMe device needs to saturate.
pub const MAX_QUEUE_DEPTH: u32 = 1024;
/// Most operations in one run (latencies are kept, 4 bytes each).
pub const MAX_OPS: u64 = 16 << 20;
/// Largest I/O size (one SQE's length field is 32 bits; 64 MiB is plenty for a benchmark).
pub const MAX_BLOCK_SIZE: usize = 64 << 20;

/// What one [`raw_random_io`] run measured.
#[derive(Debug, Clone, Serialize)]
pub struct RawIoResult {
    pub write: bool,
    pub block_size: usize,
    pub queue_depth: u32,
    pub ops: u64,
    pub bytes: u64,
    pub elapsed_s: f64,
    pub ops_per_s: f64,
    pub bytes_per_s: f64,
    pub latency_us_mean: f64,
    pub latency_us_p50: u32,
    pub latency_us_p99: u32,
    pub latency_us_max: u32,
}

/// Runs `ops` random, `block_size`-aligned reads (or writes) over the whole of `path` with
/// `queue_depth` I/Os always in flight, offsets drawn from a PRNG seeded with `seed`.
///
/// Writes destroy the content of `path`; the data written is a fixed non-zero pattern.
pub fn raw_random_io(
    path: &Path,
    block_size: usize,
    queue_depth: u32,
    ops: u64,
    write: bool,
    seed: u64,
) -> Result<RawIoResult, DeviceError> {
    check_params(block_size, queue_depth, ops)?;
    let mode = if write {
        OpenMode::ReadWrite
    } else {
        OpenMode::ReadOnly
    };
    let (file, size_bytes) = open_raw(path, mode)?;
    let blocks = size_bytes / block_size as u64;
    if blocks == 0 {
        return Err(invalid(format!(
            "{} is smaller than one {block_size}-byte block",
            path.display()
        )));
    }
    let ring = IoUring::new(queue_depth).map_err(|e| setup_error(path, e))?;
    let mut run = Run::new(
        ring,
        file.as_raw_fd(),
        block_size,
        queue_depth,
        write,
        seed,
        blocks,
    );
    let start = Instant::now();
    run.drive(ops).map_err(|e| DeviceError::Io {
        device: path.display().to_string(),
        offset: 0,
        source: e,
    })?;
    Ok(run.result(start.elapsed().as_secs_f64()))
}

fn invalid(text: String) -> DeviceError {
    DeviceError::Open(format!("raw_random_io: {text}"))
}

fn setup_error(path: &Path, err: io::Error) -> DeviceError {
    DeviceError::Open(format!("{}: io_uring setup failed: {err}", path.display()))
}

fn check_params(block_size: usize, queue_depth: u32, ops: u64) -> Result<(), DeviceError> {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE || !is_block_aligned(block_size as u64) {
        return Err(invalid(format!(
            "block size {block_size} is not a multiple of 4096 up to 64 MiB"
        )));
    }
    if queue_depth == 0 || queue_depth > MAX_QUEUE_DEPTH {
        return Err(invalid(format!(
            "queue depth {queue_depth} is outside 1..={MAX_QUEUE_DEPTH}"
        )));
    }
    if ops == 0 || ops > MAX_OPS {
        return Err(invalid(format!(
            "{ops} operations is outside 1..={MAX_OPS}"
        )));
    }
    Ok(())
}

/// The state of one run: a buffer and a start time per queue slot.
struct Run {
    ring: IoUring,
    fd: i32,
    block_size: usize,
    write: bool,
    rng: SplitMix64,
    blocks: u64,
    buffers: Vec<AlignedBuf>,
    started: Vec<Instant>,
    latencies_us: Vec<u32>,
    submitted: u64,
    in_flight: usize,
}

impl Run {
    fn new(
        ring: IoUring,
        fd: i32,
        block_size: usize,
        queue_depth: u32,
        write: bool,
        seed: u64,
        blocks: u64,
    ) -> Run {
        let buffers = (0..queue_depth)
            .map(|slot| {
                let mut buf = AlignedBuf::new_zeroed(block_size);
                buf.fill(0x5A ^ slot as u8);
                buf
            })
            .collect();
        let now = Instant::now();
        Run {
            ring,
            fd,
            block_size,
            write,
            rng: SplitMix64::new(seed),
            blocks,
            buffers,
            started: vec![now; queue_depth as usize],
            latencies_us: Vec::new(),
            submitted: 0,
            in_flight: 0,
        }
    }

    /// Keeps the queue full until `ops` completed. On an error it stops submitting but still
    /// reaps every I/O in flight before returning, since the kernel owns those buffers.
    fn drive(&mut self, ops: u64) -> io::Result<()> {
        self.latencies_us.reserve(ops as usize);
        let mut first_error = None;
        for slot in 0..self.buffers.len().min(ops as usize) {
            self.push(slot)?;
        }
        while self.in_flight > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
                Err(err) => return Err(err),
            }
            let reaped: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (slot, result) in reaped {
                self.in_flight -= 1;
                let slot = slot as usize;
                if let Err(err) = self.check_completion(slot, result) {
                    first_error.get_or_insert(err);
                }
                if first_error.is_none() && self.submitted < ops {
                    self.push(slot)?;
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn check_completion(&mut self, slot: usize, result: i32) -> io::Result<()> {
        if result < 0 {
            return Err(io::Error::from_raw_os_error(-result));
        }
        if result as usize != self.block_size {
            return Err(io::Error::other(format!(
                "short I/O: {result} of {} bytes",
                self.block_size
            )));
        }
        let latency_us = self.started[slot].elapsed().as_micros();
        self.latencies_us
            .push(u32::try_from(latency_us).unwrap_or(u32::MAX));
        Ok(())
    }

    /// Queues a new random I/O in `slot`'s buffer.
    fn push(&mut self, slot: usize) -> io::Result<()> {
        let offset = self.rng.below(self.blocks) * self.block_size as u64;
        let fd = types::Fd(self.fd);
        let len = self.block_size as u32;
        let buf = &mut self.buffers[slot];
        let entry = if self.write {
            opcode::Write::new(fd, buf.as_ptr(), len)
                .offset(offset)
                .build()
        } else {
            opcode::Read::new(fd, buf.as_mut_ptr(), len)
                .offset(offset)
                .build()
        };
        // SAFETY: the buffer lives in `self.buffers` until `drive` has reaped every I/O.
        unsafe { self.ring.submission().push(&entry.user_data(slot as u64)) }
            .map_err(|_| io::Error::other("submission queue full"))?;
        self.started[slot] = Instant::now();
        self.submitted += 1;
        self.in_flight += 1;
        Ok(())
    }

    fn result(&mut self, elapsed_s: f64) -> RawIoResult {
        let ops = self.latencies_us.len() as u64;
        self.latencies_us.sort_unstable();
        let percentile = |p: usize| {
            let index =
                (self.latencies_us.len() * p / 100).min(self.latencies_us.len().saturating_sub(1));
            self.latencies_us.get(index).copied().unwrap_or(0)
        };
        let sum_us: f64 = self.latencies_us.iter().map(|&l| l as f64).sum();
        let elapsed_s = elapsed_s.max(1e-9);
        RawIoResult {
            write: self.write,
            block_size: self.block_size,
            queue_depth: self.buffers.len() as u32,
            ops,
            bytes: ops * self.block_size as u64,
            elapsed_s,
            ops_per_s: ops as f64 / elapsed_s,
            bytes_per_s: (ops * self.block_size as u64) as f64 / elapsed_s,
            latency_us_mean: if ops == 0 { 0.0 } else { sum_us / ops as f64 },
            latency_us_p50: percentile(50),
            latency_us_p99: percentile(99),
            latency_us_max: self.latencies_us.last().copied().unwrap_or(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_a_file() {
        if IoUring::new(8).is_err() {
            eprintln!("io_uring is not available here: skipping");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench");
        crate::open_path(&path, Some(8 << 20)).unwrap();
        let written = raw_random_io(&path, 4096, 16, 500, true, 1).unwrap();
        assert_eq!(written.ops, 500);
        assert_eq!(written.bytes, 500 * 4096);
        assert!(written.ops_per_s > 0.0);
        assert!(written.latency_us_p50 <= written.latency_us_p99);
        assert!(written.latency_us_p99 <= written.latency_us_max);
        let read = raw_random_io(&path, 65536, 4, 100, false, 2).unwrap();
        assert_eq!(
            (read.ops, read.queue_depth, read.block_size),
            (100, 4, 65536)
        );
    }

    #[test]
    fn rejects_bad_parameters() {
        let path = Path::new("/nonexistent");
        assert!(raw_random_io(path, 1000, 1, 1, false, 0).is_err());
        assert!(raw_random_io(path, 4096, 0, 1, false, 0).is_err());
        assert!(raw_random_io(path, 4096, 1, 0, false, 0).is_err());
        assert!(raw_random_io(path, 4096, 1, 1, false, 0).is_err());
    }
}
