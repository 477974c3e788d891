//! The log writer's queues and the doorbell that wakes its idle committer.
//!
//! The committer holding the log's front sleeps when no request is queued. It used to sleep in
//! the channels' own wait, a futex. On this project's 2-vCPU VMs a futex wake usually starts
//! the sleeper on the other, idle vCPU: 16-25 µs from wake to run (measured with two threads
//! passing a message back and forth), against 2-5 µs when the sleeper runs where the waker
//! was. At queue depth one that wake is on every write's path: the NBD thread queues the write
//! and goes idle, and the committer must start to write it.
//!
//! So the committer sleeps reading a Unix socket, and a sender that finds it asleep writes a
//! byte there. A socket's wake is a synchronous one: it tells the scheduler the waker is about
//! to wait, and the scheduler then runs the sleeper on the waker's CPU when nothing else is
//! running there. Senders that find the committer awake (it is gathering or about to check the
//! queues) make no system call.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, SendError, Sender, TrySendError};

use crate::error::EngineError;
use crate::log::WriteReq;

/// Wakes the committer that sleeps waiting for a request.
///
/// The sleeper arms the doorbell, then checks the queues, then waits; a sender queues, then
/// rings. With a full fence between each side's two steps, either the sleeper's check sees
/// the request or the sender sees the doorbell armed and rings it: no wake is lost.
pub(crate) struct Doorbell {
    armed: AtomicBool,
    /// The committer reads this end (with a timeout), senders write the other.
    bell: UnixStream,
    ringer: UnixStream,
}

impl Doorbell {
    /// A doorbell whose wait ends by itself after `timeout` at the latest.
    pub(crate) fn new(timeout: Duration) -> Result<Doorbell, EngineError> {
        let fail = |e: std::io::Error| {
            EngineError::Failed(format!("cannot set up the log writer's doorbell: {e}"))
        };
        let (bell, ringer) = UnixStream::pair().map_err(fail)?;
        bell.set_read_timeout(Some(timeout)).map_err(fail)?;
        ringer.set_nonblocking(true).map_err(fail)?;
        Ok(Doorbell {
            armed: AtomicBool::new(false),
            bell,
            ringer,
        })
    }

    /// Wakes the sleeper if it is armed. Call after queueing.
    pub(crate) fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.armed.load(Ordering::Relaxed) && self.armed.swap(false, Ordering::AcqRel) {
            // A full socket already holds a wake; so does any byte not yet read.
            let _ = (&self.ringer).write(&[1]);
        }
    }

    /// Arms the doorbell: from here on a sender rings it. Check the queues next.
    pub(crate) fn arm(&self) {
        self.armed.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// The check after `arm` found a request: no wake is needed.
    pub(crate) fn disarm(&self) {
        self.armed.store(false, Ordering::Relaxed);
    }

    /// Waits for a ring (or the timeout), then disarms. A ring that came after the check found
    /// a request anyway ends the next wait at once; the caller checks again and waits again.
    /// False when the timeout ended the wait, not a ring.
    pub(crate) fn wait(&self) -> bool {
        let mut buf = [0u8; 64];
        let read = (&self.bell).read(&mut buf);
        self.armed.store(false, Ordering::Relaxed);
        let timed_out = |e: &std::io::Error| {
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )
        };
        !read.as_ref().is_err_and(timed_out)
    }
}

/// The sending side of one of the log writer's queues: a queued request rings the doorbell.
#[derive(Clone)]
pub struct LogQueue {
    /// Taken in `drop`, so the ring there comes after the channel may have closed.
    tx: Option<Sender<WriteReq>>,
    bell: Arc<Doorbell>,
}

impl LogQueue {
    pub(crate) fn new(tx: Sender<WriteReq>, bell: Arc<Doorbell>) -> LogQueue {
        LogQueue { tx: Some(tx), bell }
    }

    fn sender(&self) -> &Sender<WriteReq> {
        self.tx.as_ref().expect("taken only when dropped")
    }

    /// Queues a request, waiting while the queue is full.
    pub fn send(&self, req: WriteReq) -> Result<(), SendError<WriteReq>> {
        self.sender().send(req)?;
        self.bell.ring();
        Ok(())
    }

    /// Queues a request if the queue has room.
    pub fn try_send(&self, req: WriteReq) -> Result<(), TrySendError<WriteReq>> {
        self.sender().try_send(req)?;
        self.bell.ring();
        Ok(())
    }
}

impl Drop for LogQueue {
    /// The last sender gone closes the queue, which the committers must notice to end.
    fn drop(&mut self) {
        drop(self.tx.take());
        self.bell.ring();
    }
}

/// The log writer's two queues (host writes and promoted copies; the destager's rewrites)
/// and their receivers, sharing one doorbell.
pub(crate) struct Queues {
    pub host: LogQueue,
    pub hot: LogQueue,
    pub host_rx: Receiver<WriteReq>,
    pub hot_rx: Receiver<WriteReq>,
    pub bell: Arc<Doorbell>,
}

impl Queues {
    pub(crate) fn new(depth: usize, timeout: Duration) -> Result<Queues, EngineError> {
        let bell = Arc::new(Doorbell::new(timeout)?);
        let (tx, host_rx) = crossbeam_channel::bounded(depth);
        let (tx_hot, hot_rx) = crossbeam_channel::bounded(depth);
        Ok(Queues {
            host: LogQueue::new(tx, bell.clone()),
            hot: LogQueue::new(tx_hot, bell.clone()),
            host_rx,
            hot_rx,
            bell,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::TryRecvError;
    use std::time::Instant;

    /// The doorbell's own timeout in these tests: a wait that lasts this long was a lost wake.
    const NEVER: Duration = Duration::from_secs(10);
    /// Well under `NEVER`, and far more than the work takes even on a loaded machine.
    const BOUND: Duration = Duration::from_secs(5);

    fn req(lba: u64) -> WriteReq {
        WriteReq {
            kind: crate::format::RecordKind::Zero,
            layer: 1,
            lba,
            nblocks: 1,
            data: None,
            done: crate::log::Done::Call(Box::new(|_| {})),
            no_wait: false,
            relocation: false,
            rotation: false,
            born_ms: None,
            cache_gen: 0,
            vol: 0,
            cache_copy: crate::log::CacheCopy::Again,
        }
    }

    /// The committer's loop in miniature: arm, check, wait. Fails when a wait ran to its
    /// timeout: the sender only sends, so a wait no ring ended was a lost wake. (How long the
    /// whole run takes says nothing about that: on a loaded machine thousands of hand-offs
    /// between two threads can take seconds.)
    fn next(q: &Queues) -> Result<WriteReq, TryRecvError> {
        loop {
            q.bell.arm();
            match q.host_rx.try_recv() {
                Err(TryRecvError::Empty) => assert!(q.bell.wait(), "a wake was lost"),
                got => {
                    q.bell.disarm();
                    return got;
                }
            }
        }
    }

    #[test]
    fn every_request_wakes_the_sleeper_and_none_is_lost() {
        let q = Queues::new(4, NEVER).unwrap();
        let host = q.host.clone();
        let n = 5_000u64;
        let sender = std::thread::spawn(move || {
            for i in 0..n {
                // Some requests find the sleeper asleep, some awake, some arming.
                if i % 3 == 0 {
                    std::thread::yield_now();
                }
                host.send(req(i)).unwrap();
            }
        });
        for i in 0..n {
            assert_eq!(next(&q).unwrap().lba, i);
        }
        sender.join().unwrap();
    }

    #[test]
    fn dropping_the_last_sender_wakes_the_sleeper() {
        let q = Queues::new(4, NEVER).unwrap();
        let Queues {
            host,
            hot,
            host_rx,
            hot_rx,
            bell,
        } = q;
        drop(hot);
        drop(hot_rx);
        let started = Instant::now();
        let sleeper = std::thread::spawn(move || loop {
            bell.arm();
            match host_rx.try_recv() {
                Err(TryRecvError::Empty) => assert!(bell.wait(), "a wake was lost"),
                Err(TryRecvError::Disconnected) => return started.elapsed(),
                Ok(_) => panic!("nothing was sent"),
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        let copy = host.clone();
        drop(host);
        // One sender is left: the queue is open, and the sleeper sleeps on.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!sleeper.is_finished());
        drop(copy);
        let took = sleeper.join().unwrap();
        assert!(took < BOUND, "noticed only after {took:?}");
    }

    #[test]
    fn a_send_to_an_awake_committer_makes_no_wake() {
        let q = Queues::new(4, NEVER).unwrap();
        q.host.send(req(7)).unwrap();
        // Not armed: nothing was written to the doorbell, so a wait now would block. Arm,
        // find the request, disarm: the same.
        q.bell.arm();
        assert_eq!(q.host_rx.try_recv().unwrap().lba, 7);
        q.bell.disarm();
        q.bell.bell.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 8];
        let e = (&q.bell.bell).read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    }
}
