//! The io_uring backend: one thread per device owns one ring.
//!
//! Callers (any number of threads, blocking) send a [`Request`] through a bounded channel and
//! wait on their own completion slot. The ring thread drains the channel, submits everything
//! queued with one `io_uring_enter`, reaps completions and wakes the callers. Concurrent callers
//! therefore share system calls, which is what makes group commit cheap.
//!
//! The ring thread sleeps in exactly one place, waiting for a completion. New requests wake it
//! through an eventfd that the ring itself keeps a read armed on, so a long fsync in flight
//! never delays the submission of the writes queued behind it. Callers only write the eventfd
//! when the ring thread announced it is about to sleep, so under load a request costs no
//! system call of its own.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use io_uring::{opcode, squeue, types, IoUring};

use crate::completion::{Completer, Slot};

/// Submission queue entries in the ring, and so the bound on I/Os in the kernel at once.
pub(crate) const RING_ENTRIES: u32 = 256;
/// Caller I/Os in flight at once: the ring's entries minus the one kept for the eventfd read.
const MAX_IN_FLIGHT: usize = RING_ENTRIES as usize - 1;
/// Requests waiting for a free in-flight slot; beyond this, callers block in `send`.
const MAX_QUEUED: usize = 1024;
/// Retries of one I/O after EINTR or EAGAIN before its caller gets the error.
const MAX_RETRIES: u32 = 16;
/// One SQE moves at most this much (the SQE length field is 32 bits); larger I/Os continue
/// like short ones. Block aligned so the remainder stays valid for O_DIRECT.
const MAX_SQE_BYTES: usize = 1 << 30;
/// user_data of the eventfd read; caller I/Os use their slot index.
const WAKE_TOKEN: u64 = u64::MAX;

/// One I/O as the ring thread sees it. The pointers are the caller's buffer, valid until the
/// caller is completed because the caller blocks until then.
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
    Fsync,
}

struct Request {
    op: Op,
    done: Completer,
}

// SAFETY: the raw pointers in `Op` point to a buffer the sending caller keeps borrowed (and does
// not touch) until `done` completes, so moving them to the ring thread is sound.
unsafe impl Send for Request {}

/// What the callers and the ring thread share besides the channel.
struct Wake {
    eventfd: OwnedFd,
    /// Set by the ring thread just before it waits; a caller that clears it writes the eventfd.
    sleeping: AtomicBool,
    shutdown: AtomicBool,
}

impl Wake {
    fn ring_the_bell(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one` to an eventfd we own. The eventfd is blocking, but a
        // write only blocks when the counter would overflow 2^64 - 2, which cannot happen.
        let _ = unsafe { libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// The caller-side handle of a device's ring thread.
pub(crate) struct UringEngine {
    tx: Option<Sender<Request>>,
    wake: Arc<Wake>,
    thread: Option<JoinHandle<()>>,
}

impl UringEngine {
    /// Sets up a ring for `fd` and starts its thread. Fails where io_uring is unavailable
    /// (old kernel, seccomp, `kernel.io_uring_disabled`) or lacks the opcodes we use.
    pub(crate) fn start(fd: RawFd, name: &str) -> io::Result<UringEngine> {
        let ring = IoUring::new(RING_ENTRIES)?;
        check_opcodes(&ring)?;
        // SAFETY: eventfd returns a new descriptor (or -1), which we then own.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh, valid descriptor nobody else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(raw) };
        let wake = Arc::new(Wake {
            eventfd,
            sleeping: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let (tx, rx) = crossbeam_channel::bounded(MAX_QUEUED);
        let thread_wake = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name(format!("uring:{}", short_name(name)))
            .spawn(move || RingThread::new(ring, fd, rx, thread_wake).run())?;
        Ok(UringEngine {
            tx: Some(tx),
            wake,
            thread: Some(thread),
        })
    }

    /// Runs `op` on the ring and blocks until it completes.
    ///
    /// # Safety
    /// The buffer named in `op` must stay valid, and untouched by anyone else, until this
    /// returns (callers pass a borrowed slice, which guarantees it).
    pub(crate) unsafe fn execute(&self, op: Op) -> io::Result<()> {
        let slot = Arc::new(Slot::new());
        let request = Request {
            op,
            done: Completer::new(Arc::clone(&slot)),
        };
        let stopped = || io::Error::other("the device's io_uring thread has stopped");
        let tx = self.tx.as_ref().ok_or_else(stopped)?;
        match tx.try_send(request) {
            Ok(()) => {}
            Err(TrySendError::Full(request)) => tx.send(request).map_err(|_| stopped())?,
            Err(TrySendError::Disconnected(_)) => return Err(stopped()),
        }
        fence(Ordering::SeqCst);
        if self.wake.sleeping.swap(false, Ordering::SeqCst) {
            self.wake.ring_the_bell();
        }
        slot.wait()
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.tx = None;
        self.wake.shutdown.store(true, Ordering::SeqCst);
        self.wake.ring_the_bell();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("io_uring thread panicked");
            }
        }
    }
}

fn check_opcodes(ring: &IoUring) -> io::Result<()> {
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    let needed = [opcode::Read::CODE, opcode::Write::CODE, opcode::Fsync::CODE];
    if needed.iter().all(|&code| probe.is_supported(code)) {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "io_uring lacks READ, WRITE or FSYNC",
        ))
    }
}

/// Thread names are limited to 15 bytes by Linux; keep the informative tail of a path
/// (9 characters after the 6 of "uring:").
fn short_name(name: &str) -> &str {
    let start = name.char_indices().rev().nth(8).map_or(0, |(i, _)| i);
    &name[start..]
}

/// A caller I/O between its first submission and its completion.
struct InFlight {
    op: Op,
    done: Completer,
    /// Bytes already transferred (short reads and writes resume from here).
    progress_bytes: usize,
    retries: u32,
}

/// The ring thread's state. Only this thread touches the ring.
struct RingThread {
    ring: IoUring,
    fd: RawFd,
    rx: Receiver<Request>,
    wake: Arc<Wake>,
    /// Slab of in-flight I/Os; the index is the SQE's user_data.
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    /// The eventfd read lands here; boxed so its address is stable while the kernel holds it.
    wake_buf: Box<u64>,
    wake_armed: bool,
    completions: Vec<(u64, i32)>,
}

impl RingThread {
    fn new(ring: IoUring, fd: RawFd, rx: Receiver<Request>, wake: Arc<Wake>) -> RingThread {
        RingThread {
            ring,
            fd,
            rx,
            wake,
            slots: (0..MAX_IN_FLIGHT).map(|_| None).collect(),
            free: (0..MAX_IN_FLIGHT).rev().collect(),
            wake_buf: Box::new(0),
            wake_armed: false,
            completions: Vec::with_capacity(2 * RING_ENTRIES as usize),
        }
    }

    fn in_flight(&self) -> usize {
        MAX_IN_FLIGHT - self.free.len()
    }

    fn run(mut self) {
        loop {
            self.accept_requests();
            let shutting_down = self.wake.shutdown.load(Ordering::SeqCst);
            if shutting_down && self.in_flight() == 0 && !self.wake_armed && self.rx.is_empty() {
                return;
            }
            if !shutting_down && !self.wake_armed {
                self.arm_wake();
            }
            let wait = if self.announce_sleep() { 1 } else { 0 };
            self.submit(wait);
            self.wake.sleeping.store(false, Ordering::SeqCst);
            self.reap();
        }
    }

    /// Tells callers we are about to sleep, unless work arrived meanwhile (checked after the
    /// announcement, so a request is either seen here or its sender rings the eventfd).
    fn announce_sleep(&self) -> bool {
        self.wake.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let work_waiting = !self.rx.is_empty() && !self.free.is_empty();
        !work_waiting
    }

    /// Moves queued requests into free slots and queues their SQEs.
    fn accept_requests(&mut self) {
        while let Some(&index) = self.free.last() {
            let Ok(request) = self.rx.try_recv() else {
                return;
            };
            self.free.pop();
            let in_flight = InFlight {
                op: request.op,
                done: request.done,
                progress_bytes: 0,
                retries: 0,
            };
            self.slots[index] = Some(in_flight);
            self.push_slot(index);
        }
    }

    fn arm_wake(&mut self) {
        let buf: *mut u64 = &mut *self.wake_buf;
        let entry = opcode::Read::new(types::Fd(self.wake.eventfd.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(WAKE_TOKEN);
        if self.push(&entry) {
            self.wake_armed = true;
        }
    }

    /// Queues the SQE for the remaining part of slot `index`'s I/O.
    fn push_slot(&mut self, index: usize) {
        let Some(in_flight) = &self.slots[index] else {
            return;
        };
        let entry = build_sqe(self.fd, in_flight).user_data(index as u64);
        if !self.push(&entry) {
            let err = io::Error::other("io_uring submission queue full");
            self.complete(index, Err(err));
        }
    }

    /// Pushes one SQE, submitting first if the queue is full (it cannot be, as in-flight I/Os
    /// are bounded by the ring size, but a full queue must not lose a request).
    fn push(&mut self, entry: &squeue::Entry) -> bool {
        for _ in 0..2 {
            // SAFETY: every buffer an SQE names stays valid until its completion is reaped:
            // caller buffers because callers block, the eventfd buffer because we own it.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return true;
            }
            self.submit(0);
        }
        false
    }

    /// Submits queued SQEs and, if `wait`, blocks for at least one completion. Errors are
    /// transient here (EINTR, EAGAIN, EBUSY): SQEs not consumed stay queued for the next round.
    fn submit(&mut self, wait: usize) {
        if let Err(err) = self.ring.submit_and_wait(wait) {
            if err.raw_os_error() != Some(libc::EINTR) {
                tracing::warn!(error = %err, "io_uring submit failed; retrying");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    fn reap(&mut self) {
        let mut completions = std::mem::take(&mut self.completions);
        completions.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result())),
        );
        for &(token, result) in &completions {
            if token == WAKE_TOKEN {
                self.wake_armed = false;
            } else {
                self.on_completion(token as usize, result);
            }
        }
        completions.clear();
        self.completions = completions;
    }

    fn on_completion(&mut self, index: usize, result: i32) {
        let Some(Some(in_flight)) = self.slots.get_mut(index) else {
            tracing::error!(index, "io_uring completion for an empty slot");
            return;
        };
        if result < 0 {
            let errno = -result;
            if crate::os::is_transient(errno) && in_flight.retries < MAX_RETRIES {
                in_flight.retries += 1;
                self.push_slot(index);
            } else {
                self.complete(index, Err(io::Error::from_raw_os_error(errno)));
            }
            return;
        }
        match advance(in_flight, result as usize) {
            Progress::Done => self.complete(index, Ok(())),
            Progress::More => self.push_slot(index),
            Progress::Stalled(err) => self.complete(index, Err(err)),
        }
    }

    fn complete(&mut self, index: usize, result: io::Result<()>) {
        if let Some(in_flight) = self.slots[index].take() {
            in_flight.done.complete(result);
            self.free.push(index);
        }
    }
}

impl Drop for RingThread {
    /// Even when unwinding, waits until the kernel has finished every I/O before the callers
    /// (whose buffers the kernel may still be filling) are released with an error.
    fn drop(&mut self) {
        if self.wake_armed {
            self.wake.ring_the_bell();
        }
        while self.in_flight() > 0 || self.wake_armed {
            if let Err(err) = self.ring.submit_and_wait(1) {
                if err.raw_os_error() != Some(libc::EINTR) {
                    tracing::error!(error = %err, "io_uring drain failed; leaking in-flight I/O");
                    std::mem::forget(std::mem::take(&mut self.slots));
                    return;
                }
            }
            let reaped: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result()))
                .collect();
            for (token, _) in reaped {
                if token == WAKE_TOKEN {
                    self.wake_armed = false;
                } else {
                    let err = io::Error::other("the device is shutting down");
                    self.complete(token as usize, Err(err));
                }
            }
        }
    }
}

enum Progress {
    Done,
    More,
    Stalled(io::Error),
}

/// Accounts `transferred` bytes of a successful completion.
fn advance(in_flight: &mut InFlight, transferred: usize) -> Progress {
    let len = match in_flight.op {
        Op::Fsync => return Progress::Done,
        Op::Read { len, .. } | Op::Write { len, .. } => len,
    };
    if transferred == 0 && len > in_flight.progress_bytes {
        let kind = match in_flight.op {
            Op::Read { .. } => io::ErrorKind::UnexpectedEof,
            _ => io::ErrorKind::WriteZero,
        };
        return Progress::Stalled(io::Error::new(kind, "I/O transferred no bytes"));
    }
    in_flight.progress_bytes += transferred;
    if in_flight.progress_bytes >= len {
        Progress::Done
    } else {
        Progress::More
    }
}

/// The SQE for what remains of an I/O.
fn build_sqe(fd: RawFd, in_flight: &InFlight) -> squeue::Entry {
    let done = in_flight.progress_bytes;
    let fd = types::Fd(fd);
    match in_flight.op {
        Op::Read { buf, len, offset } => {
            let chunk = (len - done).min(MAX_SQE_BYTES) as u32;
            opcode::Read::new(fd, buf.wrapping_add(done), chunk)
                .offset(offset + done as u64)
                .build()
        }
        Op::Write { buf, len, offset } => {
            let chunk = (len - done).min(MAX_SQE_BYTES) as u32;
            opcode::Write::new(fd, buf.wrapping_add(done), chunk)
                .offset(offset + done as u64)
                .build()
        }
        Op::Fsync => opcode::Fsync::new(fd)
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
    }
}
