//! Reads that do not block their caller: one io_uring per device, shared by every submitter
//! and reaped by a completion thread of its own, which runs each read's callback.
//!
//! For callers that must not block (the NBD server's request loop): the read is submitted
//! from the caller's thread and answered from its completion, with no thread handed the
//! request in between. At queue depth 32 the completion thread wakes once for a whole batch
//! of completions, where blocking reads wake one thread per read.
//!
//! Reads in flight are bounded (below the ring's size, so the completion queue never
//! overflows); past the bound the caller is refused and takes the blocking path.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, ThreadId};

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

use crate::check::io_error;
use crate::stats::Counters;
use crate::uring::{execute_on_caller_ring, Op};
use crate::{AlignedBuf, ReadDone};

/// Submission queue entries; the completion queue has twice as many.
const RING_ENTRIES: u32 = 128;
/// Reads in flight at most (one entry stays free for the stop request).
const MAX_IN_FLIGHT: usize = RING_ENTRIES as usize - 1;
/// The largest read taken (the whole read must fit one submission).
pub(crate) const MAX_ASYNC_READ_BYTES: usize = 1 << 20;
/// The completion that tells the completion thread to stop once nothing is in flight.
const STOP: u64 = 0;

/// The ring and what its completions need, shared by submitters and the completion thread.
struct Ring {
    ring: IoUring,
    /// Serializes the submission queue's producers (the kernel is its only consumer).
    submit: Mutex<()>,
    in_flight: AtomicUsize,
    /// Its own handle on the device, closed only after the last completion.
    file: File,
    name: String,
    counters: Arc<Counters>,
}

/// A read the kernel owns until its completion: the buffer it fills and who to tell.
struct Pending {
    buf: AlignedBuf,
    offset: u64,
    done: ReadDone,
}

/// A device's asynchronous read path. Dropping it waits for every read in flight (unless
/// it is dropped by a read's own callback; the completion thread then ends by itself).
pub(crate) struct AsyncReads {
    ring: Arc<Ring>,
    thread: Option<JoinHandle<()>>,
    reaper: ThreadId,
}

impl AsyncReads {
    pub(crate) fn start(
        file: &File,
        name: &str,
        counters: Arc<Counters>,
    ) -> io::Result<AsyncReads> {
        let ring = Arc::new(Ring {
            ring: IoUring::new(RING_ENTRIES)?,
            submit: Mutex::new(()),
            in_flight: AtomicUsize::new(0),
            file: file.try_clone()?,
            name: name.to_string(),
            counters,
        });
        let reaper = ring.clone();
        let thread = std::thread::Builder::new()
            .name("strata-reads".into())
            .spawn(move || reaper.reap())?;
        Ok(AsyncReads {
            ring,
            reaper: thread.thread().id(),
            thread: Some(thread),
        })
    }

    /// Starts a read of `buf.len()` bytes at `offset` (already checked against the device's
    /// size and alignment). Refused, untouched, when too many reads are in flight.
    pub(crate) fn read(
        &self,
        buf: AlignedBuf,
        offset: u64,
        done: ReadDone,
    ) -> Result<(), (AlignedBuf, ReadDone)> {
        let r = &self.ring;
        if buf.is_empty() || buf.len() > MAX_ASYNC_READ_BYTES {
            return Err((buf, done));
        }
        if r.in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
            r.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err((buf, done));
        }
        let (len, ptr) = (buf.len() as u32, buf.as_ptr() as *mut u8);
        let pending = Box::into_raw(Box::new(Pending { buf, offset, done }));
        let sqe = opcode::Read::new(types::Fd(r.file.as_raw_fd()), ptr, len)
            .offset(offset)
            .build()
            .user_data(pending as u64);
        let pushed = {
            let _producer = r.submit.lock();
            // SAFETY: producers are serialized by `submit`; the entry names a buffer owned by
            // `pending`, which only the completion of this entry frees.
            unsafe { r.ring.submission_shared().push(&sqe).is_ok() }
        };
        if !pushed {
            // SAFETY: the entry never reached the queue, so `pending` is still ours alone.
            let p = unsafe { Box::from_raw(pending) };
            r.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err((p.buf, p.done));
        }
        r.submit_queued();
        Ok(())
    }
}

impl Drop for AsyncReads {
    fn drop(&mut self) {
        let stop = opcode::Nop::new().build().user_data(STOP);
        loop {
            let pushed = {
                let _producer = self.ring.submit.lock();
                // SAFETY: a NOP names no memory; producers are serialized by `submit`.
                unsafe { self.ring.ring.submission_shared().push(&stop).is_ok() }
            };
            if pushed {
                break;
            }
            std::thread::yield_now();
        }
        self.ring.submit_queued();
        if std::thread::current().id() == self.reaper {
            return;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Ring {
    /// Hands what is queued to the kernel. Concurrent submitters are serialized by the kernel,
    /// and an entry another call already took is not submitted twice.
    fn submit_queued(&self) {
        for _ in 0..64 {
            match self.ring.submit() {
                Ok(_) => return,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) =>
                {
                    std::thread::yield_now()
                }
                Err(e) => {
                    // The entry stays queued; the completion thread submits it with its next wait.
                    tracing::error!(device = %self.name, error = %e, "io_uring submit failed");
                    return;
                }
            }
        }
    }

    /// The completion thread: waits for completions and finishes their reads, until told to
    /// stop and nothing is in flight.
    fn reap(&self) {
        let mut stopping = false;
        let mut batch = Vec::with_capacity(RING_ENTRIES as usize);
        while !(stopping && self.in_flight.load(Ordering::Acquire) == 0) {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() != Some(libc::EINTR) {
                    tracing::error!(device = %self.name, error = %e, "io_uring wait failed");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            // SAFETY: this thread is the completion queue's only consumer.
            batch.extend(
                unsafe { self.ring.completion_shared() }.map(|c| (c.user_data(), c.result())),
            );
            for (user_data, result) in batch.drain(..) {
                if user_data == STOP {
                    stopping = true;
                    continue;
                }
                // SAFETY: every other entry was made from a leaked `Pending`, and the kernel
                // completes each entry once.
                let pending = unsafe { Box::from_raw(user_data as *mut Pending) };
                self.finish(*pending, result);
            }
        }
    }

    fn finish(&self, mut p: Pending, result: i32) {
        let len = p.buf.len();
        let outcome = if usize::try_from(result).is_ok_and(|n| n == len) {
            Ok(())
        } else {
            // Short, interrupted or failed: the whole read once more, blocking, on this thread
            // (rare; an error that persists is reported as the blocking path would).
            let op = Op::Read {
                buf: p.buf.as_mut_ptr(),
                len,
                offset: p.offset,
            };
            // SAFETY: the buffer is owned by `p` and used by nobody else until this returns.
            unsafe { execute_on_caller_ring(self.file.as_raw_fd(), op) }
        };
        let outcome = match outcome {
            Ok(()) => {
                self.counters.record_read(len as u64);
                Ok(())
            }
            Err(e) => {
                self.counters.record_error();
                Err(io_error(&self.name, p.offset, e))
            }
        };
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        (p.done)(p.buf, outcome);
    }
}
