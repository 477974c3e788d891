//! Reads that do not block their caller: one io_uring per device, owned by a completion
//! thread of its own, which submits every read, reaps its completion and runs its callback.
//!
//! For callers that must not block (the NBD server's request loop): the caller queues the
//! read and returns; the completion thread hands the queue to the kernel and answers each
//! read from its completion. At queue depth 32 the completion thread wakes once for a whole
//! batch of submissions and completions, where blocking reads wake one thread per read.
//!
//! Why only the completion thread submits: the kernel finishes a request in the context of
//! the task that submitted it (task work, and the io-wq workers a request is punted to belong
//! to that task). Submitted from the callers' threads (tokio's workers), a read sometimes never
//! completed: the ring showed it in flight with nothing queued and nothing completed, for good.
//! With one submitter, the task that submits is the task that waits, and a task waiting in
//! `io_uring_enter` runs its task work.
//!
//! The caller wakes the completion thread through an eventfd the ring polls, and only when it
//! queues into an empty queue: a burst of reads costs one wake.
//!
//! Reads in flight are bounded (below the ring's size, so neither queue overflows); past the
//! bound the caller is refused and takes the blocking path.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, ThreadId};

use io_uring::{opcode, squeue, types, IoUring};
use parking_lot::Mutex;

use crate::check::io_error;
use crate::stats::Counters;
use crate::uring::{execute_on_caller_ring, Op};
use crate::{AlignedBuf, ReadDone};

/// Submission queue entries; the completion queue has twice as many.
const RING_ENTRIES: u32 = 128;
/// Reads in flight at most. With the wake poll, every read in flight has a submission entry
/// when it is queued and a completion entry when it is done.
const MAX_IN_FLIGHT: usize = RING_ENTRIES as usize - 8;
/// The largest read taken (the whole read must fit one submission).
pub(crate) const MAX_ASYNC_READ_BYTES: usize = 1 << 20;
/// The completion of the poll on the wake eventfd (reads carry a pointer, never 1).
const WAKE: u64 = 1;

/// A read the kernel owns from its submission to its completion: the buffer it fills and who
/// to tell.
struct Pending {
    buf: AlignedBuf,
    offset: u64,
    done: ReadDone,
}

/// What the callers and the completion thread share.
struct Shared {
    /// Reads queued by callers, not yet handed to the kernel.
    queue: Mutex<Vec<Pending>>,
    /// Reads accepted and not yet finished (queued, in the kernel, or in their callback).
    in_flight: AtomicUsize,
    /// Set when the device's read path is dropped; the completion thread ends once nothing
    /// is in flight.
    stop: AtomicBool,
    /// Written to wake the completion thread.
    wake: OwnedFd,
}

impl Shared {
    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. A full counter
        // (EAGAIN) means a wake is already pending, which is all we need.
        let n = unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EAGAIN) {
                tracing::error!(error = %e, "waking the read completion thread failed");
            }
        }
    }
}

/// A device's asynchronous read path. Dropping it waits for every read in flight (unless
/// it is dropped by a read's own callback; the completion thread then ends by itself).
pub(crate) struct AsyncReads {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    reaper: ThreadId,
}

impl AsyncReads {
    pub(crate) fn start(
        file: &File,
        name: &str,
        counters: Arc<Counters>,
    ) -> io::Result<AsyncReads> {
        // SAFETY: plain syscall; the result is checked before it is used as a descriptor.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::with_capacity(MAX_IN_FLIGHT)),
            in_flight: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            wake,
        });
        let mut reaper = Reaper {
            ring: IoUring::new(RING_ENTRIES)?,
            shared: shared.clone(),
            file: file.try_clone()?,
            name: name.to_string(),
            counters,
        };
        let thread = std::thread::Builder::new()
            .name("strata-reads".into())
            .spawn(move || reaper.run())?;
        Ok(AsyncReads {
            shared,
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
        let s = &self.shared;
        if buf.is_empty() || buf.len() > MAX_ASYNC_READ_BYTES {
            return Err((buf, done));
        }
        if s.in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
            s.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err((buf, done));
        }
        let first = {
            let mut queue = s.queue.lock();
            queue.push(Pending { buf, offset, done });
            queue.len() == 1
        };
        // Whoever finds the queue empty wakes the completion thread; the others ride along.
        if first {
            s.wake();
        }
        Ok(())
    }
}

impl Drop for AsyncReads {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake();
        if std::thread::current().id() == self.reaper {
            return;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The completion thread's own state: the ring and the device handle it reads through
/// (closed only after the last completion).
struct Reaper {
    ring: IoUring,
    shared: Arc<Shared>,
    file: File,
    name: String,
    counters: Arc<Counters>,
}

impl Reaper {
    /// Submits what callers queued, waits for completions and finishes their reads, until
    /// told to stop and nothing is in flight.
    fn run(&mut self) {
        let mut arm = true;
        let mut taken = Vec::with_capacity(MAX_IN_FLIGHT);
        let mut done = Vec::with_capacity(2 * RING_ENTRIES as usize);
        loop {
            if arm {
                // Empty the counter first: a wake written after this fires the new poll.
                self.drain_wake();
                let poll = opcode::PollAdd::new(
                    types::Fd(self.shared.wake.as_raw_fd()),
                    libc::POLLIN as u32,
                )
                .build()
                .user_data(WAKE);
                self.push(&poll);
                arm = false;
            }
            std::mem::swap(&mut *self.shared.queue.lock(), &mut taken);
            for pending in taken.drain(..) {
                let (len, ptr) = (pending.buf.len() as u32, pending.buf.as_ptr() as *mut u8);
                let offset = pending.offset;
                let pending = Box::into_raw(Box::new(pending));
                let sqe = opcode::Read::new(types::Fd(self.file.as_raw_fd()), ptr, len)
                    .offset(offset)
                    .build()
                    .user_data(pending as u64);
                self.push(&sqe);
            }
            if self.shared.stop.load(Ordering::Acquire)
                && self.shared.in_flight.load(Ordering::Acquire) == 0
            {
                // Nothing is in the kernel but the poll, which closing the ring cancels.
                return;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) {
                    tracing::error!(device = %self.name, error = %e, "io_uring wait failed");
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            done.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            for (user_data, result) in done.drain(..) {
                if user_data == WAKE {
                    arm = true;
                    continue;
                }
                // SAFETY: every other entry was made from a leaked `Pending`, and the kernel
                // completes each entry once.
                let pending = unsafe { Box::from_raw(user_data as *mut Pending) };
                self.finish(*pending, result);
            }
        }
    }

    /// Queues one entry for the next submission, submitting what is queued first if the
    /// queue is full (it is not, by the in-flight bound, but a full queue must not lose one).
    fn push(&mut self, sqe: &squeue::Entry) {
        loop {
            // SAFETY: the entry names either nothing (the poll) or a buffer owned by a leaked
            // `Pending` that only this entry's completion frees.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return;
            }
            if let Err(e) = self.ring.submit() {
                tracing::error!(device = %self.name, error = %e, "io_uring submit failed");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    /// Empties the wake eventfd's counter (non-blocking: nothing to read is fine).
    fn drain_wake(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd we own.
        unsafe {
            libc::read(
                self.shared.wake.as_raw_fd(),
                (&mut value as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
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
        self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
        // A callback that panics must not end this thread: it is the only one that completes
        // the device's reads, and every read taken after it would wait for ever.
        let done = p.done;
        let buf = p.buf;
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || done(buf, outcome)))
            .is_err()
        {
            tracing::error!(device = %self.name, "a read's completion panicked");
        }
    }
}
