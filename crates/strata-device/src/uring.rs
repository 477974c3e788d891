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
/// # Safety
/// The buffer named in `op` must stay valid, and untouched by
/// anyone else, until this returns.
pub(crate) unsafe fn execute_on_caller_ring(fd: RawFd, op: Op) -> io::Result<()> {
    CALLER_RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(IoUring::new(CALLER_RING_ENTRIES)?);
        }
        let ring = slot.as_mut().ok_or_else(|| io::Error::other("caller ring missing"))?;
        run_on_ring(ring, fd, op)
    })
}

fn run_on_ring(ring: &mut IoUring, fd: RawFd, op: Op) -> io::Result<()> {
    let mut progress = Progress { op, progress_bytes: 0 };
    let mut retries = 0;
    loop {
        let sqe = build_sqe_at(fd, op, progress.progress_bytes).user_data(1);
        // SAFETY: the SQE names the caller's buffer, which outlives this call (see above).
        unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("caller ring full"))?;
        let result = wait_completion(ring)?;
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
    CALLER_RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(IoUring::new(CALLER_RING_ENTRIES)?);
        }
        let ring = slot.as_mut().ok_or_else(|| io::Error::other("caller ring missing"))?;
        for (i, op) in ops.iter().enumerate() {
            let sqe = build_sqe_at(fd, *op, 0).user_data(i as u64);
            // SAFETY: the SQE names the caller's buffer, which outlives this call (see above).
            unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("caller ring full"))?;
        }
        let mut results: Vec<Option<i32>> = vec![None; ops.len()];
        let mut pending = ops.len();
        let submitted = loop {
            match ring.submit() {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                other => break other,
            }
        };
        let mut first_err = submitted.and_then(|_| meanwhile()).err();
        while pending > 0 {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                if let Some(r) = results.get_mut(i).filter(|r| r.is_none()) {
                    *r = Some(cqe.result());
                    pending -= 1;
                }
            }
        }
        for (op, result) in ops.iter().zip(results) {
            let mut progress = Progress { op: *op, progress_bytes: 0 };
            let mut retries = 0;
            let mut outcome = step(&mut progress, result.unwrap_or(-libc::EIO), &mut retries);
            // Whatever is left of this op (a short transfer, a transient error) runs alone.
            while let Ok(None) = outcome {
                let sqe = build_sqe_at(fd, *op, progress.progress_bytes).user_data(u64::MAX);
                // SAFETY: as above.
                unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("caller ring full"))?;
                outcome = wait_completion(ring).and_then(|r| step(&mut progress, r, &mut retries));
            }
            if let Err(e) = outcome {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    })
}

/// Submits what is queued and waits for the one completion, through interruptions (a
/// retried wait submits nothing twice: the queue is already empty).
fn wait_completion(ring: &mut IoUring) -> io::Result<i32> {
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if let Some(cqe) = ring.completion().next() {
            return Ok(cqe.result());
        }
    }
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
