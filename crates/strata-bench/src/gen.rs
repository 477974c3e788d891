//! The load generator of one connection: a reader task turns replies into timestamped
//! completions; the step loop sends requests (closed loop, Poisson open loop, or one pass over a
//! region) and records each completion's latency.
//!
//! Latency is measured from the *intended* submission time. In a closed loop that is the moment
//! the request is sent. In an open loop (curve steps) every arrival has an intended time from the
//! Poisson schedule; when all of the connection's queue slots are busy at that time, the request
//! waits for a slot and its latency still counts from the intended time, so a stalled server
//! shows up as latency, never as a quietly lower offered rate (no coordinated omission). When a
//! slot was free but the generator's own timer woke late, the request counts from when it was
//! sent, and that lateness is reported apart (`schedule_lag`) as the generator's own error.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::arrivals::PoissonArrivals;
use crate::interrupt::{Stop, DRAIN_LIMIT};
use crate::nbd::{self, Connection, CMD_READ, CMD_WRITE};
use crate::stats::StepCounters;
use crate::workload::Workload;
use crate::BenchError;

/// Nanoseconds since the run started; every timestamp of a run uses one clock.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        Clock {
            epoch: Instant::now(),
        }
    }
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }
    pub fn at(&self, ns: u64) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.epoch + Duration::from_nanos(ns))
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// A byte range of an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub start_bytes: u64,
    pub len_bytes: u64,
}

/// How requests are offered during a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pacing {
    /// Every free slot is refilled at once.
    Closed,
    /// Poisson arrivals at this connection's share of the step's rate.
    Open { rate_per_s: f64 },
    /// One sequential pass over the connection's slice, closed loop (prep).
    OnePass,
}

#[derive(Debug, Clone, Copy)]
pub struct StepPlan {
    pub pacing: Pacing,
    /// Requests intended at or after this are recorded (before it: warm-up).
    pub record_from_ns: u64,
    /// No request is sent at or after this (u64::MAX: until the pass is done).
    pub stop_at_ns: u64,
    pub seed: u64,
    /// A connection with requests in flight and no reply for this long fails the run.
    pub io_timeout: Duration,
}

/// A reply as the reader task saw it.
struct Completion {
    cookie: u64,
    error: u32,
    done_ns: u64,
}

/// One connection and the part of the export it works on.
pub struct Worker {
    writer: OwnedWriteHalf,
    completions: mpsc::Receiver<Result<Completion, String>>,
    reader: JoinHandle<()>,
    /// The VM's working set: random offsets fall in it.
    working_set: Region,
    /// This connection's share of the working set: sequential offsets walk through it.
    slice: Region,
    seq_cursor_bytes: u64,
    queue_depth: u32,
    workload: Workload,
    payload: Arc<Vec<u8>>,
    /// Completions of the whole run, for the progress display.
    pub completed: Arc<AtomicU64>,
    send_buf: Vec<u8>,
    /// A step was abandoned with this connection mid-request: nothing more may be sent on it.
    poisoned: bool,
}

/// How long after a step's end an open loop may still send arrivals that were due before it
/// (the timer's resolution is about a millisecond).
const TIMER_GRACE_NS: u64 = 5_000_000;
/// How long closing a connection may take; past it the socket is dropped.
const CLOSE_LIMIT: Duration = Duration::from_secs(1);

// Cookie layout: slot (bits 0..16), write flag (bit 16). The start time stays with the slot
// (`StepState::started_ns`): in the cookie's other 47 bits it wrapped 39 hours into a run.
const SLOT_BITS: u32 = 16;
const WRITE_BIT: u64 = 1 << SLOT_BITS;

fn cookie(slot: u16, write: bool) -> u64 {
    u64::from(slot) | if write { WRITE_BIT } else { 0 }
}

fn decode(cookie: u64) -> (u16, bool) {
    (cookie as u16, cookie & WRITE_BIT != 0)
}

/// Where and how a worker loads its connection.
pub struct WorkerSpec {
    /// The VM's working set: random offsets fall in it.
    pub working_set: Region,
    /// This connection's share of it (inside it, block-aligned): sequential offsets walk it.
    pub slice: Region,
    pub queue_depth: u32,
    pub workload: Workload,
    /// The bytes every write sends.
    pub payload: Arc<Vec<u8>>,
}

impl Worker {
    /// Starts the connection's reader task.
    pub fn new(
        conn: Connection,
        spec: WorkerSpec,
        clock: Clock,
        completed: Arc<AtomicU64>,
    ) -> Worker {
        let WorkerSpec {
            working_set,
            slice,
            queue_depth,
            workload,
            payload,
        } = spec;
        let (tx, rx) = mpsc::channel(queue_depth as usize + 1);
        let block = workload.block_size_bytes as usize;
        let mut reader = conn.reader;
        let task = tokio::spawn(async move {
            let mut sink = vec![0u8; block];
            loop {
                let r = match nbd::read_reply(&mut reader).await {
                    Ok(reply) => {
                        let (_, write) = decode(reply.cookie);
                        let data = if !write && reply.error == 0 {
                            reader.read_exact(&mut sink).await.map(|_| ())
                        } else {
                            Ok(())
                        };
                        data.map(|_| Completion {
                            cookie: reply.cookie,
                            error: reply.error,
                            done_ns: clock.now_ns(),
                        })
                    }
                    Err(e) => Err(e),
                };
                let failed = r.is_err();
                if tx.send(r.map_err(|e| nbd::short_io(&e))).await.is_err() || failed {
                    return;
                }
            }
        });
        Worker {
            writer: conn.writer,
            completions: rx,
            reader: task,
            working_set,
            slice,
            seq_cursor_bytes: slice.start_bytes,
            queue_depth,
            workload,
            payload,
            completed,
            send_buf: Vec::with_capacity(nbd::REQUEST_HEADER_LEN + block),
            poisoned: false,
        }
    }

    /// Sends NBD_CMD_DISC (not after an abandoned step, which may have left a request half
    /// sent) and stops the reader; within [`CLOSE_LIMIT`] even if the server reads nothing.
    pub async fn close(self) {
        let Worker {
            writer,
            reader,
            poisoned,
            ..
        } = self;
        let mut w = writer;
        let goodbye = async {
            if !poisoned {
                let mut msg = Vec::new();
                nbd::encode_request(&mut msg, nbd::CMD_DISC, 0, 0, 0);
                let _ = w.write_all(&msg).await;
            }
            let _ = w.shutdown().await;
        };
        let _ = tokio::time::timeout(CLOSE_LIMIT, goodbye).await;
        reader.abort();
    }

    /// The next offset and direction.
    fn next_op(&mut self, rng: &mut SmallRng, pacing: Pacing) -> (u64, bool) {
        let bs = u64::from(self.workload.block_size_bytes);
        let write = pacing == Pacing::OnePass || rng.gen_range(0..100u8) >= self.workload.read_pct;
        let random =
            pacing != Pacing::OnePass && rng.gen_range(0..100u8) < self.workload.random_pct;
        if random {
            let blocks = (self.working_set.len_bytes / bs).max(1);
            return (
                self.working_set.start_bytes + rng.gen_range(0..blocks) * bs,
                write,
            );
        }
        let end = self.slice.start_bytes + self.slice.len_bytes;
        if self.seq_cursor_bytes + bs > end {
            self.seq_cursor_bytes = self.slice.start_bytes;
        }
        let offset = self.seq_cursor_bytes;
        self.seq_cursor_bytes += bs;
        (offset, write)
    }

    /// Requests one pass over the slice takes.
    pub fn pass_ops(&self) -> u64 {
        self.slice.len_bytes / u64::from(self.workload.block_size_bytes)
    }

    /// True once a one-pass step has sent its whole slice.
    fn pass_done(&self) -> bool {
        let bs = u64::from(self.workload.block_size_bytes);
        self.seq_cursor_bytes + bs > self.slice.start_bytes + self.slice.len_bytes
    }

    async fn send(&mut self, offset: u64, write: bool, cookie: u64) -> Result<(), BenchError> {
        let len = self.workload.block_size_bytes;
        self.send_buf.clear();
        let command = if write { CMD_WRITE } else { CMD_READ };
        nbd::encode_request(&mut self.send_buf, command, cookie, offset, len);
        if write {
            self.send_buf.extend_from_slice(&self.payload);
        }
        self.writer
            .write_all(&self.send_buf)
            .await
            .map_err(|e| BenchError::Target(format!("sending a request: {}", nbd::short_io(&e))))
    }
}

/// Per-step state of the send loop.
struct StepState {
    free: VecDeque<(u16, u64)>,
    /// When the request in each slot was meant to start (latency counts from it); `None`
    /// while the slot has no request in flight, so a stray or repeated reply is caught.
    started_ns: Vec<Option<u64>>,
    in_flight: u32,
    arrivals: Option<PoissonArrivals>,
    counters: StepCounters,
    /// The last reply, or the last send to an idle connection: the I/O timeout runs from it.
    last_reply_ns: u64,
    /// When the open loop's grace after the step's end ran out (nothing is sent after it), and
    /// whether a slot freed before the end was idle then: whose the arrivals left unsent are.
    send_stop: Option<SendStop>,
    /// The run was asked to stop before this step ended: it sent no more.
    stopped: bool,
}

/// The moment an open loop stopped sending.
#[derive(Debug, Clone, Copy, PartialEq)]
struct SendStop {
    at_ns: u64,
    /// A slot had been free since before the step's end: the server had room for the arrivals
    /// left unsent, so they are the generator's misses (it woke too late), not late arrivals.
    slot_free_before_end: bool,
}

/// Runs one step on one connection; returns what it measured (only requests intended at or
/// after `record_from_ns`). Once `stop` is set the step sends nothing more and its requests in
/// flight get [`DRAIN_LIMIT`] to be answered; it then ends with `cut_short` set.
pub async fn run_step(
    w: &mut Worker,
    plan: &StepPlan,
    clock: &Clock,
    stop: &mut Stop,
) -> Result<StepCounters, BenchError> {
    if plan.pacing == Pacing::OnePass {
        w.seq_cursor_bytes = w.slice.start_bytes;
    }
    let now = clock.now_ns();
    let mut rng = SmallRng::seed_from_u64(plan.seed);
    let mut st = StepState {
        free: (0..w.queue_depth as u16).map(|s| (s, 0)).collect(),
        started_ns: vec![None; w.queue_depth as usize],
        in_flight: 0,
        arrivals: match plan.pacing {
            Pacing::Open { rate_per_s } => {
                Some(PoissonArrivals::new(rate_per_s, now, plan.seed ^ 0x5eed))
            }
            _ => None,
        },
        counters: StepCounters::default(),
        last_reply_ns: now,
        send_stop: None,
        stopped: false,
    };
    let mut watch = stop.clone();
    let abandon = async {
        stop.wait().await;
        tokio::time::sleep(DRAIN_LIMIT).await;
    };
    let ended = tokio::select! {
        r = step_loop(w, plan, clock, &mut rng, &mut st, &mut watch) => Some(r),
        _ = abandon => None,
    };
    match ended {
        Some(r) => r?,
        None => {
            // Replies may still come, and a send may have stopped halfway.
            w.poisoned = true;
            st.stopped = true;
        }
    }
    st.counters.cut_short = st.stopped;
    if let (Some(arrivals), false) = (st.arrivals.as_mut(), st.stopped) {
        count_unsent_arrivals(arrivals, plan, st.send_stop, &mut st.counters);
    }
    Ok(st.counters)
}

/// Sends and waits until the step has sent everything and every reply is in.
async fn step_loop(
    w: &mut Worker,
    plan: &StepPlan,
    clock: &Clock,
    rng: &mut SmallRng,
    st: &mut StepState,
    stop: &mut Stop,
) -> Result<(), BenchError> {
    loop {
        let sending = issue_ready(w, plan, clock, rng, st, stop).await?;
        if !sending && st.in_flight == 0 {
            return Ok(());
        }
        wait_for_event(w, plan, clock, sending, st, stop).await?;
    }
}

/// Sends every request that is due and has a slot. Returns false once the step sends no more.
async fn issue_ready(
    w: &mut Worker,
    plan: &StepPlan,
    clock: &Clock,
    rng: &mut SmallRng,
    st: &mut StepState,
    stop: &Stop,
) -> Result<bool, BenchError> {
    loop {
        let now = clock.now_ns();
        if plan.pacing == Pacing::OnePass && w.pass_done() {
            return Ok(false);
        }
        let ended = match st.arrivals.as_ref() {
            None => now >= plan.stop_at_ns,
            Some(a) => open_loop_stopped(a.peek_ns(), plan, now, st),
        };
        if ended {
            return Ok(false);
        }
        // After the step's own end, so that a step that had sent everything is not cut.
        if stop.cause().is_some() {
            st.stopped = true;
            return Ok(false);
        }
        let Some(&(slot, freed_ns)) = st.free.front() else {
            return Ok(true);
        };
        let start_ns = match st.arrivals.as_mut() {
            None => now,
            Some(a) if a.peek_ns() > now => return Ok(true),
            Some(a) => {
                let intended = a.take_ns();
                if freed_ns <= intended {
                    // A slot was free in time: any delay is the generator's own.
                    if intended >= plan.record_from_ns {
                        st.counters.schedule_lag.record_us((now - intended) / 1000);
                    }
                    now
                } else {
                    intended
                }
            }
        };
        st.free.pop_front();
        let (offset, write) = w.next_op(rng, plan.pacing);
        st.started_ns[usize::from(slot)] = Some(start_ns);
        w.send(offset, write, cookie(slot, write)).await?;
        if st.in_flight == 0 {
            // An open loop may idle longer than the timeout between arrivals; that is not a
            // server failing to answer.
            st.last_reply_ns = now;
        }
        st.in_flight += 1;
    }
}

/// Whether an open loop sends nothing more for now. It still sends the arrivals due before the
/// end if a slot is free when the generator wakes (its timer may wake just after the end);
/// nothing is sent later than TIMER_GRACE_NS after the end, and that moment is recorded in
/// `send_stop` for `count_unsent_arrivals`.
fn open_loop_stopped(next_arrival_ns: u64, plan: &StepPlan, now: u64, st: &mut StepState) -> bool {
    if next_arrival_ns >= plan.stop_at_ns {
        return true;
    }
    if now >= plan.stop_at_ns.saturating_add(TIMER_GRACE_NS) {
        // A free slot was free ever since it was freed: one freed before the end means the
        // server had room while the generator slept.
        let slot_free_before_end = st.free.iter().any(|&(_, f)| f < plan.stop_at_ns);
        st.send_stop.get_or_insert(SendStop {
            at_ns: now,
            slot_free_before_end,
        });
        return true;
    }
    now >= plan.stop_at_ns && st.free.is_empty()
}

/// Waits for a completion, the next arrival, the end of sending, or (while sending) a stop.
async fn wait_for_event(
    w: &mut Worker,
    plan: &StepPlan,
    clock: &Clock,
    sending: bool,
    st: &mut StepState,
    stop: &mut Stop,
) -> Result<(), BenchError> {
    let mut wake_ns = u64::MAX;
    if sending {
        wake_ns = plan.stop_at_ns;
        if let (Some(a), false) = (st.arrivals.as_ref(), st.free.is_empty()) {
            wake_ns = wake_ns.min(a.peek_ns());
        }
    }
    let timeout_ns = st.last_reply_ns + plan.io_timeout.as_nanos() as u64;
    let deadline_ns = if st.in_flight > 0 {
        wake_ns.min(timeout_ns)
    } else {
        wake_ns
    };
    if deadline_ns == u64::MAX {
        return Err(BenchError::Target(
            "the generator has nothing to wait for".into(),
        ));
    }
    tokio::select! {
        c = w.completions.recv() => complete(w, plan, c, st),
        // Only while sending: once set it stays set, and a drain must not spin on it.
        _ = stop.wait(), if sending => Ok(()),
        _ = tokio::time::sleep_until(clock.at(deadline_ns)) => {
            if st.in_flight > 0 && clock.now_ns() >= timeout_ns {
                return Err(BenchError::Target(format!(
                    "no reply for {:?} with {} requests in flight",
                    plan.io_timeout, st.in_flight
                )));
            }
            Ok(())
        }
    }
}

fn complete(
    w: &mut Worker,
    plan: &StepPlan,
    c: Option<Result<Completion, String>>,
    st: &mut StepState,
) -> Result<(), BenchError> {
    let c = match c {
        Some(Ok(c)) => c,
        Some(Err(e)) => return Err(BenchError::Target(format!("reading a reply: {e}"))),
        None => {
            return Err(BenchError::Target(
                "the server closed the connection".into(),
            ))
        }
    };
    let (slot, write) = decode(c.cookie);
    let in_flight = st.started_ns.get_mut(usize::from(slot));
    let Some(start_ns) = in_flight.and_then(Option::take) else {
        return Err(BenchError::Target(format!(
            "reply with a cookie {:#x} that no request in flight has",
            c.cookie
        )));
    };
    st.in_flight -= 1;
    st.free.push_back((slot, c.done_ns));
    st.last_reply_ns = c.done_ns;
    w.completed.fetch_add(1, Ordering::Relaxed);
    // Throughput counts what completed inside the window; latency what was meant to start in it.
    let bs = u64::from(w.workload.block_size_bytes);
    let done_in_window = c.done_ns >= plan.record_from_ns && c.done_ns < plan.stop_at_ns;
    if c.error != 0 {
        st.counters.errors += u64::from(done_in_window);
        return Ok(());
    }
    if done_in_window {
        let (count, bytes) = if write {
            (&mut st.counters.writes_done, &mut st.counters.write_bytes)
        } else {
            (&mut st.counters.reads_done, &mut st.counters.read_bytes)
        };
        *count += 1;
        *bytes += bs;
    }
    if start_ns < plan.record_from_ns {
        return Ok(());
    }
    let latency_us = c.done_ns.saturating_sub(start_ns) / 1000;
    if write {
        st.counters.writes.record_us(latency_us);
    } else {
        st.counters.reads.record_us(latency_us);
    }
    Ok(())
}

/// Arrivals the schedule wanted before the step ended but that were never sent. When every slot
/// was busy until the end, the server held them up: each is a late arrival and counts with the
/// wait it had so far (a lower bound of its latency), so a stall is not hidden. When a slot sat
/// free, the generator woke too late to send them: that is its own error (`schedule_lag`, with
/// how late it stopped), not the server's.
fn count_unsent_arrivals(
    a: &mut PoissonArrivals,
    plan: &StepPlan,
    stop: Option<SendStop>,
    counters: &mut StepCounters,
) {
    while a.peek_ns() < plan.stop_at_ns {
        let intended = a.take_ns();
        if intended < plan.record_from_ns {
            continue;
        }
        if let Some(stop) = stop.filter(|s| s.slot_free_before_end) {
            let lag_ns = stop.at_ns.saturating_sub(intended);
            counters.schedule_lag.record_us(lag_ns / 1000);
        } else {
            counters.late_arrivals += 1;
            counters.late.record_us((plan.stop_at_ns - intended) / 1000);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_round_trip() {
        for (slot, write) in [(0u16, false), (1023, true), (7, true)] {
            assert_eq!(decode(cookie(slot, write)), (slot, write));
        }
    }

    /// Answers every write with success until the client disconnects (writes only: a read
    /// would need data); `replies` times each, more than once for a misbehaving server.
    async fn write_sink(mut s: tokio::net::TcpStream, replies: usize) {
        let mut head = [0u8; nbd::REQUEST_HEADER_LEN];
        while s.read_exact(&mut head).await.is_ok() {
            let command = u16::from_be_bytes([head[6], head[7]]);
            let len = u32::from_be_bytes([head[24], head[25], head[26], head[27]]);
            if command != CMD_WRITE {
                return;
            }
            let mut data = vec![0u8; len as usize];
            if s.read_exact(&mut data).await.is_err() {
                return;
            }
            let mut reply = 0x6744_6698u32.to_be_bytes().to_vec();
            reply.extend_from_slice(&0u32.to_be_bytes());
            reply.extend_from_slice(&head[8..16]);
            if s.write_all(&reply.repeat(replies)).await.is_err() {
                return;
            }
        }
    }

    /// A worker at `queue_depth` on a connection to `write_sink`, its clock `age` into the run.
    async fn worker_on_sink(replies: usize, age: Duration, queue_depth: u32) -> (Worker, Clock) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (client, server) = tokio::join!(client, listener.accept());
        let (client, server) = (client.unwrap(), server.unwrap().0);
        // As `nbd::connect` does: small replies must not wait for a delayed ACK (40 ms).
        client.set_nodelay(true).unwrap();
        server.set_nodelay(true).unwrap();
        tokio::spawn(write_sink(server, replies));
        let (r, w) = client.into_split();
        let conn = Connection {
            reader: tokio::io::BufReader::new(r),
            writer: w,
            size_bytes: 1 << 20,
            read_only: false,
        };
        let whole = Region {
            start_bytes: 0,
            len_bytes: 1 << 20,
        };
        let spec = WorkerSpec {
            working_set: whole,
            slice: whole,
            queue_depth,
            workload: crate::workload::profile("rw-4k").unwrap().workload,
            payload: Arc::new(vec![0u8; 4096]),
        };
        let clock = Clock {
            epoch: Instant::now().checked_sub(age).unwrap(),
        };
        let worker = Worker::new(conn, spec, clock, Arc::new(AtomicU64::new(0)));
        (worker, clock)
    }

    /// A stop flag nothing sets.
    fn no_stop() -> Stop {
        Stop::manual().1
    }

    /// A closed-loop step of 100 ms starting now.
    fn short_step(clock: &Clock) -> StepPlan {
        let now = clock.now_ns();
        StepPlan {
            pacing: Pacing::Closed,
            record_from_ns: now,
            stop_at_ns: now + 100_000_000,
            seed: 1,
            io_timeout: Duration::from_secs(5),
        }
    }

    /// An open-loop step whose generator cannot run from 50 ms before its end to 50 ms after
    /// (its thread blocked, as on a busy machine) while its server has idle slots: the arrivals
    /// it never sent are its own lateness, not late arrivals blamed on the server.
    #[tokio::test]
    async fn a_generator_that_wakes_late_is_not_blamed_on_the_server() {
        // 64 slots at 1,000 arrivals a second: only a stall of the whole process for 64 ms
        // could fill them all, so the sink has idle slots when the generator's thread blocks.
        let (mut worker, clock) = worker_on_sink(1, Duration::ZERO, 64).await;
        let now = clock.now_ns();
        let plan = StepPlan {
            pacing: Pacing::Open { rate_per_s: 1000.0 },
            record_from_ns: now,
            stop_at_ns: now + 300_000_000,
            seed: 1,
            io_timeout: Duration::from_secs(5),
        };
        // The test runtime has one thread: this task blocking it stalls the generator too.
        let stall_from = clock.at(plan.stop_at_ns - 50_000_000);
        let staller = tokio::spawn(async move {
            tokio::time::sleep_until(stall_from).await;
            std::thread::sleep(Duration::from_millis(100));
        });
        let c = run_step(&mut worker, &plan, &clock, &mut no_stop())
            .await
            .unwrap();
        staller.await.unwrap();
        worker.close().await;
        assert_eq!(
            c.late_arrivals, 0,
            "arrivals the generator slept through were blamed on the server"
        );
        let lag_us_max = c.schedule_lag.summary().map_or(0.0, |s| s.max);
        assert!(
            lag_us_max >= (TIMER_GRACE_NS / 1000) as f64,
            "the generator's lateness is not reported: max lag {lag_us_max} us"
        );
    }

    /// A step 40 hours into a run (a long curve) measures its requests like the first step.
    #[tokio::test]
    async fn a_step_40_hours_into_a_run_is_measured() {
        let (mut worker, clock) = worker_on_sink(1, Duration::from_secs(40 * 3600), 4).await;
        let plan = short_step(&clock);
        let c = run_step(&mut worker, &plan, &clock, &mut no_stop())
            .await
            .unwrap();
        worker.close().await;
        assert!(c.writes_done > 0);
        assert!(
            c.writes.count() >= c.writes_done,
            "{} writes done, {} latencies recorded",
            c.writes_done,
            c.writes.count()
        );
        let p99_us = c.writes.summary().unwrap().p99;
        assert!(p99_us < 1e6, "p99 {p99_us} us");
    }

    /// A closed-loop step of a minute, and a stop asked for `after` into it.
    async fn step_stopped_after(
        replies: usize,
        after: Duration,
    ) -> (Worker, StepCounters, Duration) {
        let (mut worker, clock) = worker_on_sink(replies, Duration::ZERO, 4).await;
        let mut plan = short_step(&clock);
        plan.stop_at_ns = plan.record_from_ns + 60_000_000_000;
        let (tx, mut stop) = Stop::manual();
        let started = Instant::now();
        let stopper = tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let cause = crate::interrupt::StopCause {
                signal: "SIGINT",
                exit_code: 130,
                at_unix_ms: 0,
            };
            tx.send(Some(cause)).unwrap();
            tx
        });
        let c = run_step(&mut worker, &plan, &clock, &mut stop)
            .await
            .unwrap();
        let took = started.elapsed();
        drop(stopper.await.unwrap());
        (worker, c, took)
    }

    /// A stop ends a step of a minute at once (its replies come at once) and marks it cut.
    #[tokio::test]
    async fn a_stop_ends_the_step_under_way_and_marks_it_cut() {
        let (worker, c, took) = step_stopped_after(1, Duration::from_millis(100)).await;
        assert!(!worker.poisoned, "a drained connection is closed politely");
        worker.close().await;
        assert!(c.cut_short, "a step the stop ended is not marked cut");
        assert!(c.writes_done > 0, "the step ran before the stop");
        assert!(
            took < Duration::from_secs(1),
            "the step stopped {took:?} after it began"
        );
    }

    /// Requests the server never answers are abandoned [`DRAIN_LIMIT`] after the stop, and the
    /// connection is closed without a disconnect request.
    #[tokio::test]
    async fn a_stop_abandons_requests_never_answered() {
        let (worker, c, took) = step_stopped_after(0, Duration::from_millis(50)).await;
        assert!(c.cut_short && c.writes_done == 0);
        assert!(
            worker.poisoned,
            "an abandoned connection must not be sent more"
        );
        let closing = Instant::now();
        worker.close().await;
        assert!(closing.elapsed() < CLOSE_LIMIT + Duration::from_millis(500));
        let bound = DRAIN_LIMIT + Duration::from_millis(50);
        assert!(
            took >= bound && took < bound + Duration::from_secs(2),
            "the step ended {took:?} after it began, {bound:?} expected"
        );
    }

    /// A server that answers a request twice is caught, not counted as two completions.
    #[tokio::test]
    async fn a_reply_repeated_by_the_server_fails_the_step() {
        let (mut worker, clock) = worker_on_sink(2, Duration::ZERO, 4).await;
        let plan = short_step(&clock);
        let Err(e) = run_step(&mut worker, &plan, &clock, &mut no_stop()).await else {
            panic!("a step whose server answered each request twice passed");
        };
        worker.close().await;
        assert!(e.to_string().contains("no request in flight"), "{e}");
    }
}
