//! The io_uring backend: every I/O is submitted and completed through io_uring, on a small ring
//! owned by the calling thread.
//!
//! An earlier design had one ring thread per device that callers handed their I/O to. On this
//! project's 2-core machines the two thread wake-ups per I/O cost more than sharing system
//! calls saved (engine 4 KiB reads at queue depth 32 went from 0.66 to 1.03 of raw io_uring when
//! the hand-off went away; docs/BENCHMARKS.md). The caller's threads are already the
//! concurrency: the kernel sees one I/O in flight per blocked caller.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types, IoUring};

/// Retries of one I/O after EINTR or EAGAIN before its caller gets the error.
const MAX_RETRIES: u32 = 16;
/// One SQE moves at most this much (the SQE length field is 32 bits); larger I/Os continue
/// like short ones. Block aligned so the remainder stays valid for O_DIRECT.
const MAX_SQE_BYTES: usize = 1 << 30;

/// One I/O. The pointers are the caller's buffer, valid until the call returns because the
/// caller blocks until then.
#[derive(Clone, Copy)]
pub(crate) enum Op {
    Read {
        buf: *mut u8,
        len: usize,
        offset: u64,
    },
    Write {
        buf: *const u8,
        len: usize,
        offset: u64,
    },
    /// A write that completes only once durable (RWF_DSYNC).
    WriteDsync {
        buf: *const u8,
        len: usize,
        offset: u64,
    },
    Fsync,
}

/// Checks that io_uring works here and has the opcodes we use. Fails where io_uring is
/// unavailable (old kernel, seccomp, `kernel.io_uring_disabled`).
pub(crate) fn probe() -> io::Result<()> {
    let ring = IoUring::new(CALLER_RING_ENTRIES)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for (code, name) in [(opcode::Read::CODE, "read"), (opcode::Write::CODE, "write"), (opcode::Fsync::CODE, "fsync")] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, format!("io_uring lacks the {name} opcode")));
        }
    }
    Ok(())
}

thread_local! {
    /// Each calling thread's own small ring (see [`execute_on_caller_ring`]).
    static CALLER_RING: std::cell::RefCell<Option<IoUring>> = const { std::cell::RefCell::new(None) };
}

/// Entries of a caller thread's ring: it only ever has one I/O in flight.
const CALLER_RING_ENTRIES: u32 = 4;

/// Runs `op` through an io_uring owned by the calling thread and waits for it there.
///
/// Handing each I/O to a device's ring thread costs two thread wake-ups per I/O; on a machine
/// with few cores and many blocking callers that costs more than the ring saves. With one small
/// ring per caller thread the I/O is still submitted and completed through io_uring, with no
/// hand-off, and the kernel sees as many I/Os in flight as there are callers.
///
/// Never returns while an entry it queued is in the kernel's hands (see [`Pending`]); if it
/// fails with one still queued, the ring is dropped, so the next call starts clean.
///
/// # Safety
/// The buffer named in `op` must stay valid, and untouched by
/// anyone else, until this returns.
pub(crate) unsafe fn execute_on_caller_ring(fd: RawFd, op: Op) -> io::Result<()> {
    with_caller_ring(|ring| run_on_ring(ring, fd, op))
}

/// Runs `f` on the calling thread's ring (made on first use). If `f` fails and left entries
/// queued that the kernel never took, the ring goes: a later call would submit them.
fn with_caller_ring<T>(f: impl FnOnce(&mut IoUring) -> io::Result<T>) -> io::Result<T> {
    CALLER_RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(IoUring::new(CALLER_RING_ENTRIES)?);
        }
        let ring = slot.as_mut().ok_or_else(|| io::Error::other("caller ring missing"))?;
        let result = f(ring);
        if result.is_err() && !ring.submission().is_empty() {
            *slot = None;
        }
        result
    })
}

fn run_on_ring(ring: &mut IoUring, fd: RawFd, op: Op) -> io::Result<()> {
    let mut progress = Progress { op, progress_bytes: 0 };
    let mut retries = 0;
    loop {
        let sqe = build_sqe_at(fd, op, progress.progress_bytes).user_data(ONE);
        // SAFETY: the SQE names the caller's buffer, which outlives this call (see above).
        unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("caller ring full"))?;
        let mut pending = Pending::new(1);
        let result = pending.next(ring)?.1;
        if step(&mut progress, result, &mut retries)?.is_some() {
            return Ok(());
        }
    }
}

/// Runs up to `CALLER_RING_ENTRIES` ops through the calling thread's ring, all submitted in
/// one system call, runs `meanwhile` (a blocking I/O of the caller's, so the device has it and
/// the ops at once), and waits for every op. An op the kernel only partly did, or that met
/// EINTR or EAGAIN, is finished on its own afterwards. The first error is returned, once every
/// op is done (the ring's buffers are not released before).
///
/// # Safety
/// As for [`execute_on_caller_ring`], for every buffer the ops name.
pub(crate) unsafe fn execute_together_on_caller_ring(
    fd: RawFd,
    ops: &[Op],
    meanwhile: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    if ops.len() > CALLER_RING_ENTRIES as usize {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many I/Os for one submission"));
    }
    with_caller_ring(|ring| {
        for (i, op) in ops.iter().enumerate() {
            let sqe = build_sqe_at(fd, *op, 0).user_data(i as u64);
            // SAFETY: the SQE names the caller's buffer, which outlives this call (see above).
            unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("caller ring full"))?;
        }
        let mut pending = Pending::new(ops.len());
        // Nothing is in flight if this fails: `meanwhile` is skipped and the ring dropped.
        pending.submit(ring)?;
        let mut first_err = meanwhile().err();
        let mut results: Vec<Option<i32>> = vec![None; ops.len()];
        while !pending.done() {
            let (i, r) = pending.next(ring)?;
            if let Some(slot) = results.get_mut(i as usize).filter(|r| r.is_none()) {
                *slot = Some(r);
            }
        }
        for (op, result) in ops.iter().zip(results) {
            let mut progress = Progress { op: *op, progress_bytes: 0 };
            let mut retries = 0;
            let mut outcome = step(&mut progress, result.unwrap_or(-libc::EIO), &mut retries);
            // Whatever is left of this op (a short transfer, a transient error) runs alone.
            while let Ok(None) = outcome {
                let sqe = build_sqe_at(fd, *op, progress.progress_bytes).user_data(ONE);
                // SAFETY: as above.
                unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("caller ring full"))?;
                let mut one = Pending::new(1);
                outcome = one.next(ring).and_then(|(_, r)| step(&mut progress, r, &mut retries));
            }
            if let Err(e) = outcome {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    })
}

/// `user_data` of an op run alone.
const ONE: u64 = u64::MAX;

/// The entries one call queued on its ring, until each has completed. An entry the kernel
/// has taken owns its buffer until its completion is reaped, so [`Pending::next`] gives up
/// only while the kernel has taken none of them; then the caller's ring still queues them,
/// and [`with_caller_ring`] drops it.
struct Pending {
    /// Entries queued and not yet completed.
    left: usize,
}

impl Pending {
    fn new(queued: usize) -> Pending {
        Pending { left: queued }
    }

    /// Whether the kernel holds any of the entries: taken from the queue, not completed.
    fn in_flight(&self, ring: &mut IoUring) -> bool {
        self.left > ring.submission().len()
    }

    fn done(&self) -> bool {
        self.left == 0
    }

    /// Submits what is queued, without waiting for completions.
    fn submit(&mut self, ring: &mut IoUring) -> io::Result<()> {
        self.enter(ring, 0).map(drop)
    }

    /// Submits what is queued and waits for one completion: (user_data, result).
    fn next(&mut self, ring: &mut IoUring) -> io::Result<(u64, i32)> {
        loop {
            if let Some(cqe) = ring.completion().next() {
                self.left = self.left.saturating_sub(1);
                return Ok((cqe.user_data(), cqe.result()));
            }
            self.enter(ring, 1)?;
        }
    }

    /// One io_uring_enter, through its transient failures: EINTR, and EAGAIN or EBUSY, which
    /// the kernel returns when it is short of memory for requests or of completion slots.
    /// Another failure is returned only while the kernel holds none of this call's entries;
    /// with one in flight, returning would free its buffer under the kernel, so this waits.
    fn enter(&mut self, ring: &mut IoUring, want: usize) -> io::Result<usize> {
        let mut reported = false;
        loop {
            match submit_and_wait(ring, want) {
                Ok(n) => return Ok(n),
                Err(e) => {
                    let errno = e.raw_os_error().unwrap_or(0);
                    if errno == libc::EINTR {
                        continue;
                    }
                    let transient = matches!(errno, libc::EAGAIN | libc::EBUSY);
                    if !transient && !self.in_flight(ring) {
                        return Err(e);
                    }
                    if !transient && !reported {
                        tracing::error!(error = %e, "io_uring_enter failed with I/O in flight; waiting for it");
                        reported = true;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }
}

/// `IoUring::submit_and_wait`, or a failure injected by a test first.
fn submit_and_wait(ring: &mut IoUring, want: usize) -> io::Result<usize> {
    #[cfg(test)]
    if let Some(e) = injected::take(ring) {
        return Err(e);
    }
    ring.submit_and_wait(want)
}

struct Progress {
    op: Op,
    progress_bytes: usize,
}

/// Accounts one completion: Some(()) when the I/O is done, None to submit the rest again.
fn step(p: &mut Progress, result: i32, retries: &mut u32) -> io::Result<Option<()>> {
    if result < 0 {
        let err = io::Error::from_raw_os_error(-result);
        let transient = matches!(-result, libc::EINTR | libc::EAGAIN);
        if transient && *retries < MAX_RETRIES {
            *retries += 1;
            return Ok(None);
        }
        return Err(err);
    }
    let len = match p.op {
        Op::Fsync => return Ok(Some(())),
        Op::Read { len, .. } | Op::Write { len, .. } | Op::WriteDsync { len, .. } => len,
    };
    let transferred = result as usize;
    if transferred == 0 && len > p.progress_bytes {
        let kind = match p.op {
            Op::Read { .. } => io::ErrorKind::UnexpectedEof,
            _ => io::ErrorKind::WriteZero,
        };
        return Err(io::Error::new(kind, "I/O transferred no bytes"));
    }
    p.progress_bytes += transferred;
    Ok((p.progress_bytes >= len).then_some(()))
}

/// The SQE for what remains of `op` after `done` bytes.
fn build_sqe_at(fd: RawFd, op: Op, done: usize) -> squeue::Entry {
    let fd = types::Fd(fd);
    match op {
        Op::Read { buf, len, offset } => {
            let chunk = (len - done).min(MAX_SQE_BYTES) as u32;
            opcode::Read::new(fd, buf.wrapping_add(done), chunk).offset(offset + done as u64).build()
        }
        Op::Write { buf, len, offset } => {
            let chunk = (len - done).min(MAX_SQE_BYTES) as u32;
            opcode::Write::new(fd, buf.wrapping_add(done), chunk).offset(offset + done as u64).build()
        }
        Op::WriteDsync { buf, len, offset } => {
            let chunk = (len - done).min(MAX_SQE_BYTES) as u32;
            opcode::Write::new(fd, buf.wrapping_add(done), chunk)
                .offset(offset + done as u64)
                .rw_flags(libc::RWF_DSYNC)
                .build()
        }
        Op::Fsync => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
    }
}

/// Failures of io_uring_enter injected by tests, per thread.
#[cfg(test)]
pub(crate) mod injected {
    use std::cell::Cell;
    use std::io;

    use io_uring::IoUring;

    thread_local! {
        /// (failures left, errno, submit first): with the last set, the queued entries are
        /// submitted before the failure is returned, so they are in flight (as after a call
        /// that submitted them and a later one, waiting, that failed).
        static ENTER: Cell<(u32, i32, bool)> = const { Cell::new((0, 0, false)) };
    }

    /// The next `n` io_uring_enter calls of this thread fail with `errno`, after submitting
    /// what is queued if `submit_first`.
    pub(crate) fn fail_enters(n: u32, errno: i32, submit_first: bool) {
        ENTER.with(|c| c.set((n, errno, submit_first)));
    }

    pub(super) fn take(ring: &mut IoUring) -> Option<io::Error> {
        let (n, errno, submit_first) = ENTER.with(Cell::get);
        if n == 0 {
            return None;
        }
        ENTER.with(|c| c.set((n - 1, errno, submit_first)));
        if submit_first && ring.submit().is_err() {
            return None;
        }
        Some(io::Error::from_raw_os_error(errno))
    }
}
