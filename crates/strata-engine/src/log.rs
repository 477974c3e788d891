//! The write log on the fast device: a circular area of batches written with group commit.
//!
//! One committer thread at a time owns the log head. It gathers the requests waiting in the
//! bounded queues into a batch (one header block with up to 62 record headers, then the
//! records' data) and places it; then it writes the batch in one durable device write while
//! the next committer gathers. Batches are applied to the index and their requests completed
//! in log order, each only after it is durable. So a completed write is durable and visible
//! to every reader, and so is every write completed before it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{select, Receiver, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex, MutexGuard};
use strata_device::AlignedBuf;

use crate::error::EngineError;
use crate::format::*;
use crate::map::Loc;
use crate::queue::Doorbell;
use crate::shared::{Counters, Shared};

/// A record as the log keeps it in memory until the destager has moved it.
#[derive(Debug, Clone, Copy)]
pub struct RecMeta {
    pub kind: RecordKind,
    pub layer: u32,
    pub lba: u64,
    pub nblocks: u64,
    pub seq: u64,
    /// Log block of the record's first data block (Write records).
    pub data_start: u64,
    /// Written by the destager to keep hot data on the fast tier (not persisted).
    pub relocation: bool,
    /// When the data first reached the fast tier (engine clock, ms; not persisted: replayed
    /// records count from the opening).
    pub born_ms: u64,
    /// Where tier mode's minimum age counts from: when the data was written, or last kept
    /// on the fast tier because it was hot.
    pub aged_from_ms: u64,
    /// Cache records: the generation of the segment the copy was read from.
    pub cache_gen: u32,
    /// Cache records: the volume that promoted the copy (its figures count the eviction).
    pub vol: u32,
    /// Cache records: which figure counts the copy once the read cache holds it.
    pub cache_copy: CacheCopy,
}

/// Where a cache record's copy comes from. Its volume's figures count a new copy when the
/// read cache takes it (when its batch is applied), not when it is queued: a copy the log
/// refuses, or whose segment is reused before the log has written it, never becomes an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheCopy {
    /// Not a cache record, or a copy written again at the head (counted when first taken).
    Again,
    /// Promoted by reads served by the capacity tier (`promoted_bytes`).
    Promoted,
    /// Read while in the write log and kept when destaged (`kept_bytes`).
    Kept,
}

#[derive(Debug, Clone)]
pub struct BatchMeta {
    pub start: u64,
    /// Blocks occupied, header included.
    pub blocks: u64,
    /// Blocks left unused at the end of the log area because this batch wrapped to the start.
    pub skip: u64,
    pub first_seq: u64,
    /// Shared, so the destager's copy of the tail's batches (taken under the log lock) costs
    /// a reference count per batch, not an allocation.
    pub records: Arc<[RecMeta]>,
    /// Written, flushed and applied to the index.
    pub durable: bool,
    /// In the destager's copy of a batch that one stripe took only part of: where the rest
    /// begins, as (record index, block in that record). The live data before it is in that
    /// stripe, not committed yet, and the next stripe leaves it out. (0, 0) everywhere else.
    pub rest_from: (usize, u64),
}

/// The in-memory picture of the log area. Protected by `Shared::log`.
pub struct LogState {
    pub log_blocks: u64,
    pub head: u64,
    pub next_seq: u64,
    pub batches: VecDeque<BatchMeta>,
    pub used_blocks: u64,
    /// Of `used_blocks`, those skipped at the end of the area when a batch wrapped (kept so
    /// the backlog is known without walking every batch under this lock).
    pub skipped_blocks: u64,
    /// Blocks of the log held by read-cache records (valid copies or not).
    pub cache_blocks: u64,
    /// The share of the log the read cache may hold, in blocks.
    pub cache_budget_blocks: u64,
    /// The last batch, while it is a run of lone writes the next lone write may extend.
    pub open_run: Option<OpenRun>,
    /// Blocks only the destager's rotation may take (`rotation_reserve_blocks`; 0 in states
    /// that place nothing, such as replay's).
    pub rotation_reserve_blocks: u64,
    /// Blocks rotation's batches have taken since its current group began (the tail it
    /// frees for them has not moved yet). Other batches do not count them: they come out of
    /// rotation's reserve, and a trim finding the log full only because a rotation is half
    /// done would be refused for nothing.
    pub rotation_outstanding_blocks: u64,
}

/// A run of lone writes still open (FORMAT.md §3.3.1): the last batch of the log, durable,
/// and taken by no destager step yet.
#[derive(Debug, Clone)]
pub struct OpenRun {
    pub first_seq: u64,
    /// Its records as its newer header copy holds them; the next write's copy holds them all
    /// again, and its own.
    pub headers: Vec<RecordHeader>,
}

impl LogState {
    pub fn new(log_blocks: u64, head: u64, next_seq: u64) -> LogState {
        LogState {
            log_blocks,
            head,
            next_seq,
            batches: VecDeque::new(),
            used_blocks: 0,
            skipped_blocks: 0,
            cache_blocks: 0,
            cache_budget_blocks: 0,
            open_run: None,
            rotation_reserve_blocks: 0,
            rotation_outstanding_blocks: 0,
        }
    }

    /// Fill of the write buffer: the data the log holds besides cached copies, against the
    /// log less what the read cache holds (work-conserving: the write buffer has whatever the
    /// cache does not use, and at least the log less the cache's share). The destage marks
    /// apply to it.
    pub fn fill_ratio(&self) -> f64 {
        let cache = self.cache_blocks.min(self.cache_budget_blocks);
        let room = self.log_blocks.saturating_sub(cache).max(1);
        self.used_blocks.saturating_sub(self.cache_blocks) as f64 / room as f64
    }

    /// Fill of the whole log area, cached copies included.
    pub fn physical_fill_ratio(&self) -> f64 {
        self.used_blocks as f64 / self.log_blocks as f64
    }

    /// Whether the read cache may take `n` more blocks of the log.
    pub fn cache_has_room(&self, n: u64) -> bool {
        self.cache_blocks + n <= self.cache_budget_blocks
    }

    /// Where replay must start: the oldest batch still needed, or the head if none.
    pub fn tail(&self) -> (u64, u64) {
        match self.batches.front() {
            Some(b) => (b.start, b.first_seq),
            None => (self.head, self.next_seq),
        }
    }

    /// Finds room for `n` contiguous blocks at the head: (start, blocks skipped at the end).
    pub fn place(&self, n: u64) -> Option<(u64, u64)> {
        let l = self.log_blocks;
        let Some(front) = self.batches.front() else {
            return Some(if self.head + n <= l {
                (self.head, 0)
            } else {
                (0, l - self.head)
            });
        };
        let tail = front.start;
        if self.head > tail {
            if self.head + n <= l {
                Some((self.head, 0))
            } else if n <= tail {
                Some((0, l - self.head))
            } else {
                None
            }
        } else if self.head < tail && self.head + n <= tail {
            Some((self.head, 0))
        } else {
            None
        }
    }

    /// Free blocks a batch must leave: rotation's reserve, and for one carrying data also
    /// `NO_DATA_RESERVE_BLOCKS` (see both); the destager's rotation may take every block.
    pub fn kept_free(&self, has_data: bool, rotation: bool) -> u64 {
        match (rotation, has_data) {
            (true, _) => 0,
            (false, false) => self.rotation_reserve_blocks,
            (false, true) => self.rotation_reserve_blocks + NO_DATA_RESERVE_BLOCKS,
        }
    }

    /// Whether a batch of `blocks` placed with `skip` blocks skipped may take them
    /// (`kept_free`; only rotation counts the blocks its unfinished group took).
    pub fn leaves_reserve(&self, blocks: u64, skip: u64, has_data: bool, rotation: bool) -> bool {
        let free = match rotation {
            true => self.free_blocks(),
            false => self.host_free_blocks(),
        };
        blocks + skip + self.kept_free(has_data, rotation) <= free
    }

    /// Free blocks of the log, reserves included.
    pub fn free_blocks(&self) -> u64 {
        self.log_blocks.saturating_sub(self.used_blocks)
    }

    /// Free blocks as batches other than rotation's count them (less what rotation's
    /// unfinished group took, see `rotation_outstanding_blocks`).
    pub fn host_free_blocks(&self) -> u64 {
        self.free_blocks() + self.rotation_outstanding_blocks
    }

    /// Appends a batch at the head. The caller checked `place`.
    pub fn push(&mut self, meta: BatchMeta) {
        debug_assert!(meta.start + meta.blocks <= self.log_blocks);
        // Anything appended after a run ends it: a run's blocks are contiguous.
        self.open_run = None;
        self.head = (meta.start + meta.blocks) % self.log_blocks;
        self.used_blocks += meta.blocks + meta.skip;
        self.skipped_blocks += meta.skip;
        self.cache_blocks += meta.cache_blocks();
        self.next_seq = meta.first_seq + meta.records.len() as u64;
        self.batches.push_back(meta);
    }

    pub fn pop(&mut self) -> Option<BatchMeta> {
        let b = self.batches.pop_front()?;
        self.close_run_if_taken(b.first_seq);
        self.used_blocks -= b.blocks + b.skip;
        self.skipped_blocks -= b.skip;
        self.cache_blocks -= b.cache_blocks();
        Some(b)
    }
}

impl LogState {
    /// The destager has taken a copy of the batch that starts at `first_seq` to move or
    /// survey it: if that is the open run, it is closed, so no write extends it behind the
    /// destager's back (the copy would then miss the new record, and freeing the batch would
    /// lose it).
    pub fn close_run_if_taken(&mut self, first_seq: u64) {
        if self
            .open_run
            .as_ref()
            .is_some_and(|r| r.first_seq == first_seq)
        {
            self.open_run = None;
        }
    }

    /// Places a lone write of `nblocks` data blocks as the next record of the open run, if
    /// the run can take it: the run is the last batch, durable, ends at the head, has room
    /// for a record and stays within `max_blocks`, and the blocks after it are free. `make`
    /// describes the record from its seq and data block. Returns the run as it now is and
    /// what it held before; the run stays closed until the write is retired (`apply` reopens
    /// it if it is still the last batch).
    pub fn extend_run(
        &mut self,
        nblocks: u64,
        max_blocks: u64,
        make: impl FnOnce(u64, u64) -> RecMeta,
    ) -> Option<(BatchMeta, OpenRun)> {
        let first_seq = self.open_run.as_ref()?.first_seq;
        let last = self.batches.back()?;
        let n = last.records.len();
        if last.first_seq != first_seq
            || !last.durable
            || n >= MAX_RECORDS_PER_BATCH
            || last.start + last.blocks != self.head
        {
            return None;
        }
        // The second write of a run also writes the run's second header copy.
        let extra = nblocks + u64::from(n == 1);
        if last.blocks + extra > max_blocks
            || self.place(extra) != Some((self.head, 0))
            || !self.leaves_reserve(extra, 0, true, false)
        {
            return None;
        }
        let before = self.open_run.take()?;
        let rec = make(self.next_seq, self.head + u64::from(n == 1));
        let last = self.batches.back_mut()?;
        let mut records = last.records.to_vec();
        records.push(rec);
        last.records = records.into();
        last.blocks += extra;
        last.durable = false;
        let run = last.clone();
        self.head = (run.start + run.blocks) % self.log_blocks;
        self.used_blocks += extra;
        self.next_seq += 1;
        Some((run, before))
    }
}

impl BatchMeta {
    pub fn cache_blocks(&self) -> u64 {
        self.records
            .iter()
            .filter(|r| r.kind == RecordKind::Cache)
            .map(|r| r.nblocks)
            .sum()
    }
}

/// A request to the log writer.
pub struct WriteReq {
    pub kind: RecordKind,
    pub layer: u32,
    pub lba: u64,
    pub nblocks: u64,
    /// `nblocks` blocks of data for Write records.
    pub data: Option<AlignedBuf>,
    pub done: Done,
    /// Fail with NoSpace instead of waiting for log space. The destager's own requests (hot
    /// data kept on the fast tier) use it: it must never wait for space only it can free.
    pub no_wait: bool,
    /// The destager keeping hot data on the fast tier: not a rewrite, so it adds no heat.
    pub relocation: bool,
    /// The destager rotating a full log (docs/FORMAT.md §4.7): may take the log's last
    /// blocks, and goes in batches of rotation requests only, gathered whole.
    pub rotation: bool,
    /// Relocations: when the data first reached the fast tier.
    pub born_ms: Option<u64>,
    /// Cache records: the generation of the segment the copy was read from.
    pub cache_gen: u32,
    /// Cache records: the volume that promoted the copy (its figures count the eviction).
    pub vol: u32,
    pub cache_copy: CacheCopy,
}

/// How a request is answered: a slot a thread waits on, or a callback run by the engine
/// thread that retires the batch (it must not block).
pub enum Done {
    Chan(ReplyTx),
    Call(Box<dyn FnOnce(Result<(), EngineError>) + Send>),
}

impl Done {
    pub fn send(self, r: Result<(), EngineError>) {
        match self {
            Done::Chan(tx) => tx.send(r),
            Done::Call(f) => f(r),
        }
    }
}

/// One answer for one waiting thread. Unlike a channel it never spins: with dozens of
/// writers waiting on two cores, spinning and yielding waiters took CPU from the log writer.
struct ReplySlot {
    answer: std::sync::Mutex<Option<Result<(), EngineError>>>,
    ready: std::sync::Condvar,
}

/// The answering half of [`reply_pair`]; dropped unanswered, it answers `ShuttingDown`, or
/// `Failed` when a panic drops it (the panic guard takes the group offline with its reason).
pub struct ReplyTx(Option<Arc<ReplySlot>>);

/// The waiting half of [`reply_pair`].
pub struct ReplyRx(Arc<ReplySlot>);

pub fn reply_pair() -> (ReplyTx, ReplyRx) {
    let slot = Arc::new(ReplySlot {
        answer: std::sync::Mutex::new(None),
        ready: std::sync::Condvar::new(),
    });
    (ReplyTx(Some(slot.clone())), ReplyRx(slot))
}

impl ReplyTx {
    pub fn send(mut self, r: Result<(), EngineError>) {
        if let Some(slot) = self.0.take() {
            Self::answer(&slot, r);
        }
    }

    fn answer(slot: &ReplySlot, r: Result<(), EngineError>) {
        let mut a = slot.answer.lock().unwrap_or_else(|p| p.into_inner());
        *a = Some(r);
        drop(a);
        slot.ready.notify_one();
    }
}

impl Drop for ReplyTx {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            let error = match std::thread::panicking() {
                true => EngineError::Failed(PANICKED_IN_HAND.into()),
                false => EngineError::ShuttingDown,
            };
            Self::answer(&slot, Err(error));
        }
    }
}

/// The answer of a request whose thread panicked while it held it (`Shared::guarded` takes
/// the group offline with the panic's message, which `strata status` shows).
const PANICKED_IN_HAND: &str =
    "internal error: the thread handling this request panicked (the disk group's reason names the panic)";

impl ReplyRx {
    /// Blocks until the request is answered.
    pub fn wait(self) -> Result<(), EngineError> {
        let mut a = self.0.answer.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = a.take() {
                return r;
            }
            a = self.0.ready.wait(a).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl WriteReq {
    fn data_blocks(&self) -> u64 {
        if matches!(self.kind, RecordKind::Write | RecordKind::Cache) {
            self.nblocks
        } else {
            0
        }
    }
}

/// The log writer: `PIPELINE_DEPTH` committer threads take turns. A committer holding the
/// front gathers the waiting requests into a batch, places it at the log head and takes the
/// next ticket; it then writes its batch durably on its own ring while the next committer
/// gathers the next batch; batches are retired (applied to the index, answered) strictly in
/// ticket order, so a reply means every earlier batch is durable too.
pub struct LogWriter {
    sh: Arc<Shared>,
    rx: Receiver<WriteReq>,
    /// The destager's hot-data rewrites, on their own queue so they can always be answered
    /// (refused) while host writes wait for space.
    rx_hot: Receiver<WriteReq>,
    max_batch_blocks: u64,
    /// This opening's epoch, written into every batch header.
    epoch: u32,
    front: Mutex<Front>,
    /// Held by the committer that watches the queues (for the whole of `take_batch`); the
    /// other committers wait here, not on `front`, which the watcher lets go of while it
    /// sleeps so that a host write reaching an idle log can be written by its sender's thread
    /// (`try_inline`).
    watch: Mutex<()>,
    /// The next ticket to retire.
    turn: Mutex<u64>,
    turn_moved: Condvar,
    /// Every record with a lower sequence number is durable and acknowledged.
    committed_seq: AtomicU64,
    /// Batches taken but not yet retired.
    inflight: AtomicU64,
    /// Batches of the destager's own requests only, taken and not yet written.
    own_inflight: AtomicUsize,
    /// Signalled when such a batch is written, so a committer holding the front may take
    /// the next one.
    own_written: (Sender<()>, Receiver<()>),
    /// Wakes the committer waiting for a request (see queue.rs).
    bell: Arc<Doorbell>,
}

/// What the committer holding the front owns.
struct Front {
    /// Requests taken off the queue but not yet batched, in arrival order (bounded by the
    /// queue depth).
    held: VecDeque<WriteReq>,
    /// Admission control: the earliest time the next batch may be written.
    next_admit: Instant,
    /// Log bytes taken by the destager's own rewrites (hot data kept, copies promoted).
    own_bytes: u64,
    /// While throttled: (when, log bytes freed net of `own_bytes`) samples over the last
    /// `ADMIT_SPAN`.
    freed_samples: VecDeque<(Instant, i64)>,
    /// The net rate the log was last measured to be freed at while throttled (wall time:
    /// destage, GC and index upkeep together).
    freed_rate: Option<f64>,
    next_ticket: u64,
    host_open: bool,
    hot_open: bool,
}

/// A batch placed in the log, with its requests, waiting to be written and retired.
struct Taken {
    ticket: u64,
    meta: BatchMeta,
    reqs: Vec<WriteReq>,
    /// Only the destager's own requests (counted in `own_inflight` until written).
    own: bool,
    /// A lone write that starts or extends a run (FORMAT.md §3.3.1); `meta` then holds only
    /// the write's own record.
    run: Option<RunWrite>,
}

/// What a write into a run writes besides its data: a whole header copy of the run.
struct RunWrite {
    first_seq: u64,
    start: u64,
    /// The run's blocks once this write is in it.
    blocks: u64,
    /// Every record of the run, this write's last.
    headers: Vec<RecordHeader>,
}

/// Batches of the destager's own requests (hot data kept, copies promoted) in flight at once
/// while host writes may go. Batches retire in order, so a host batch taken after one waits
/// for its write: with all committers writing 256 KiB rewrite batches, queue-depth-1 host
/// writes took 2-4 ms instead of 0.2 ms.
const OWN_INFLIGHT_MAX: usize = 1;
/// Blocks of such a batch at most while host writes may go (header included).
const OWN_BATCH_BLOCKS: u64 = 17;

/// Log blocks only batches without data may take (trims, write-zeroes and the write bypass's
/// Forget records: a header block each). With both tiers full, a client trimming or zeroing a
/// range is how space comes back, and its record must find room in the log: a log filled to
/// the last block by writes refused it with ENOSPC.
pub const NO_DATA_RESERVE_BLOCKS: u64 = 16;

/// How long a committer gathering a batch of the destager's rotation waits for the rest of
/// its requests, at most: they are queued one after another, and a batch taken before they
/// are all there costs a header block more, which rotation may have no room for (after a
/// power cut between such batches, rotation could then find too little room to finish).
/// The destager queues them without blocking, so the wait is this long only when the
/// machine does not run it (on a busy machine, 20 ms is not long); the bound is for a
/// destager that stopped.
const ROTATION_GATHER_WAIT: Duration = Duration::from_secs(1);

/// The most blocks a batch takes, header included.
pub fn max_batch_blocks(max_batch_bytes: usize) -> u64 {
    (max_batch_bytes as u64 / BLOCK_U64).max(2)
}

/// Log blocks kept back from every batch but the destager's rotation (docs/FORMAT.md §4.7):
/// room to write one whole tail batch again at the head wherever the head is. Twice the
/// largest batch, as a batch that does not fit before the end of the log area skips to its
/// start; plus a header block per 32 blocks, for a tail batch whose live data is split into
/// more records than one header holds. At most an eighth of the log.
pub fn rotation_reserve_blocks(max_batch_blocks: u64, log_blocks: u64) -> u64 {
    (2 * max_batch_blocks + max_batch_blocks / 32 + 1).min(log_blocks / 8)
}

/// Whether host writes wait for the log to have room for a whole batch (`host_wait`). While
/// the capacity tier takes nothing, only compaction frees the log, and it needs room for the
/// live data it keeps: host writes leave it an eighth of the log. (Once nothing can free the
/// log, `capacity_full` is set and host writes take what is left, then fail with ENOSPC.)
pub fn host_writes_wait_for_room(sh: &Shared, log: &LogState) -> bool {
    let c = &sh.counters;
    if c.capacity_full.load(Ordering::Relaxed) {
        return false;
    }
    let free = log.log_blocks.saturating_sub(log.used_blocks);
    let keep = if c.capacity_blocked.load(Ordering::Relaxed) {
        log.log_blocks / 8
    } else {
        0
    };
    free < keep + max_batch_blocks(sh.cfg.max_batch_bytes) + 1 + log.kept_free(true, false)
}

/// How host writes are admitted now, as `EngineStats::admission` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// They go as they come.
    Open,
    /// Above the high mark: paced to the rate the log is freed at.
    Throttled,
    /// Above the high mark with no rate measured yet to pace them at (after a start, until
    /// the destager's first step): they go as they come while the log has room, then wait.
    Measuring,
    /// The log has no room for a whole batch: they wait for the destager to free some.
    WaitingForRoom,
}

impl Admission {
    pub fn as_str(self) -> &'static str {
        match self {
            Admission::Open => "open",
            Admission::Throttled => "throttled",
            Admission::Measuring => "measuring",
            Admission::WaitingForRoom => "waiting_for_room",
        }
    }
}

/// What the next host batch meets, from the log as it stands: not from the last host batch
/// placed, which after a start (or after a spell with no writes) says nothing of the log's
/// fill now. The same rules as `host_wait` and `admit`.
pub fn admission_now(sh: &Shared, log: &LogState) -> Admission {
    let c = &sh.counters;
    // Out of room on the capacity tier, a write fits the log now or is refused (room.rs).
    // With both tiers full nothing is paced either (`admit_paced`).
    if c.capacity_out_of_room.load(Ordering::Relaxed) || c.capacity_full.load(Ordering::Relaxed) {
        return Admission::Open;
    }
    if host_writes_wait_for_room(sh, log) {
        return Admission::WaitingForRoom;
    }
    if log.fill_ratio() <= sh.cfg.fill_ratio_high {
        return Admission::Open;
    }
    let measured = c.admit_rate_measured.load(Ordering::Relaxed)
        || Counters::get_f64(&c.destage_bw_bytes_per_s) > 0.0;
    match measured {
        true => Admission::Throttled,
        false => Admission::Measuring,
    }
}

/// Data blocks of a host write `try_inline` may write on its sender's thread (larger ones go
/// to the committers, which keep their buffers).
const INLINE_MAX_BLOCKS: u64 = 16;

thread_local! {
    /// `try_inline`'s batch buffer, one per sending thread (at most `INLINE_MAX_BLOCKS` + 1
    /// blocks).
    static INLINE_SCRATCH: std::cell::RefCell<AlignedBuf> =
        std::cell::RefCell::new(AlignedBuf::new_zeroed(0));
}

/// Committer threads, so batches in flight at once. Replay tells a torn in-flight batch from
/// damage by the `committed_seq` later batches carry (replay.rs).
pub const PIPELINE_DEPTH: usize = 4;

impl LogWriter {
    pub fn new(
        sh: Arc<Shared>,
        rx: Receiver<WriteReq>,
        rx_hot: Receiver<WriteReq>,
        bell: Arc<Doorbell>,
    ) -> Result<LogWriter, EngineError> {
        let max_batch_blocks = max_batch_blocks(sh.cfg.max_batch_bytes);
        let epoch = sh.durable.lock().epoch;
        let committed_seq = AtomicU64::new(sh.log.lock().next_seq);
        let front = Front {
            held: VecDeque::new(),
            next_admit: Instant::now(),
            own_bytes: 0,
            freed_samples: VecDeque::new(),
            freed_rate: None,
            next_ticket: 0,
            host_open: true,
            hot_open: true,
        };
        Ok(LogWriter {
            sh,
            rx,
            rx_hot,
            max_batch_blocks,
            epoch,
            front: Mutex::new(front),
            watch: Mutex::new(()),
            turn: Mutex::new(0),
            turn_moved: Condvar::new(),
            committed_seq,
            inflight: AtomicU64::new(0),
            own_inflight: AtomicUsize::new(0),
            own_written: crossbeam_channel::bounded(1),
            bell,
        })
    }

    /// Starts the committer threads; they run until every sender of both queues is gone and
    /// everything queued is written and answered.
    pub fn start(self: &Arc<Self>) -> Result<Vec<std::thread::JoinHandle<()>>, EngineError> {
        let w = self;
        (0..PIPELINE_DEPTH)
            .map(|i| {
                let w = w.clone();
                let name = format!("strata-log{i}");
                std::thread::Builder::new()
                    .name(name.clone())
                    .spawn(move || w.sh.run_guarded(&name, || w.committer()))
                    .map_err(|e| EngineError::Failed(format!("cannot start the log writer: {e}")))
            })
            .collect()
    }

    fn committer(&self) {
        // The batch buffer, reused: a fresh allocation of a large batch is a fresh mapping
        // whose pages the kernel faults in and clears on every batch.
        let mut scratch = AlignedBuf::new_zeroed(0);
        while let Some(t) = self.take_batch() {
            let (crcs, result) = self.write_batch(&mut scratch, &t);
            if t.own {
                self.own_inflight.fetch_sub(1, Ordering::Relaxed);
                let _ = self.own_written.0.try_send(());
                self.bell.ring();
            }
            self.retire(t, &crcs, result);
        }
    }

    /// Gathers the next batch and places it in the log (None once the queues are closed and
    /// drained). Only one committer at a time does this, so batches take the log in order.
    fn take_batch(&self) -> Option<Taken> {
        let _watching = self.watch.lock();
        let mut f = self.front.lock();
        loop {
            if f.held.is_empty() && !f.host_open && !f.hot_open {
                return None;
            }
            if let Some(wait) = self.host_wait(&mut f) {
                // Host writes wait for admission; the destager's own rewrites go on meanwhile
                // (they are what frees the log, and hold range locks host writes may wait on).
                let Some(first) = self.next_hot(&mut f, wait) else {
                    continue;
                };
                let batch = self.gather_hot(&mut f, first, self.max_batch_blocks);
                if let Some(t) = self.place(&mut f, batch) {
                    return Some(t);
                }
                continue;
            }
            // Host writes first, in their own batches; the destager's requests in batches of
            // their own, one such batch in flight at a time.
            let first = match self.next_request(&mut f) {
                Some(r) => r,
                None => match self.wait_request(&mut f) {
                    Some(r) if r.no_wait && !self.own_allowed() => {
                        f.held.push_back(r);
                        continue;
                    }
                    Some(r) => r,
                    None if !f.host_open && !f.hot_open && f.held.is_empty() => return None,
                    None => continue,
                },
            };
            let batch = if first.rotation {
                // The log is full: no host write is waiting on a small batch's latency, and
                // rotation's own batches are as large as the tail's.
                self.gather_hot(&mut f, first, self.max_batch_blocks)
            } else if first.no_wait {
                self.gather_hot(&mut f, first, OWN_BATCH_BLOCKS.min(self.max_batch_blocks))
            } else {
                self.gather_host(&mut f, first)
            };
            if let Some(t) = self.place(&mut f, batch) {
                return Some(t);
            }
        }
    }

    /// Whether a batch of the destager's own requests may be taken now.
    fn own_allowed(&self) -> bool {
        self.own_inflight.load(Ordering::Relaxed) < OWN_INFLIGHT_MAX
    }

    /// Waits for a request on either queue, or for an own batch to be written (a bounded wait,
    /// so a closed queue is noticed even without a ring). The destager's queue is not watched
    /// while its batch is in flight. Sleeps on the doorbell (queue.rs): armed before the
    /// queues are checked, so a request queued after the check rings it.
    /// It sleeps without the front, which a sender may take meanwhile (`try_inline`).
    fn wait_request(&self, f: &mut MutexGuard<'_, Front>) -> Option<WriteReq> {
        self.bell.arm();
        let got = self.poll_request(f);
        if got.is_some() || (!f.host_open && !f.hot_open) {
            self.bell.disarm();
            return got.flatten();
        }
        MutexGuard::unlocked(f, || self.bell.wait());
        self.poll_request(f).flatten()
    }

    /// Writes a host write on the calling thread when the log is idle: no batch in flight,
    /// nothing queued or held before it, no admission wait, and the committer watching the
    /// queues asleep (so the front is free). It is then placed, written, applied and answered
    /// exactly as a committer would, in ticket order; `Err(req)` hands it back otherwise, to be
    /// queued. At queue depth one this saves the hand-off to a committer: the doorbell's ring,
    /// the committer's wake-up, and its wake of the next committer as it lets go of the front.
    pub(crate) fn try_inline(&self, req: WriteReq) -> Result<(), WriteReq> {
        if req.no_wait
            || req.data_blocks() > INLINE_MAX_BLOCKS
            || self.inflight.load(Ordering::Acquire) != 0
            || !self.rx.is_empty()
            || self.sh.counters.capacity_full.load(Ordering::Relaxed)
        {
            return Err(req);
        }
        let Some(mut f) = self.front.try_lock() else {
            return Err(req);
        };
        if !f.host_open
            || self.inflight.load(Ordering::Acquire) != 0
            || f.held.iter().any(|r| !r.no_wait)
            || !self.rx.is_empty()
            || self.host_wait(&mut f).is_some()
        {
            return Err(req);
        }
        // A panic here would leave the batch's turn never taken, with every later write
        // waiting on it: the group goes offline instead, and the request, dropped unanswered,
        // is the caller's to answer (`DiskGroup::start_write`).
        self.sh
            .guarded("a write made on its sender's thread", move || {
                let taken = match self.extend_run(&mut f, req) {
                    Ok(t) => Some(t),
                    Err(req) => self.place(&mut f, vec![req]).map(|t| self.start_run(t)),
                };
                drop(f);
                // Not placed: `place` has answered it (a failed group, or no room that can come).
                let Some(t) = taken else { return };
                let (crcs, result) = INLINE_SCRATCH.with(|s| {
                    let s = &mut s.borrow_mut();
                    match &t.run {
                        Some(run) => self.write_run(s, &t, run),
                        None => self.write_batch(s, &t),
                    }
                });
                self.retire(t, &crcs, result);
            });
        Ok(())
    }

    /// With runs on (`EngineConfig::log_runs`), a lone write of one block placed as a batch of
    /// its own starts a run: its header is the run's first copy, and the next lone write may
    /// extend it.
    fn start_run(&self, mut t: Taken) -> Taken {
        if !self.sh.cfg.log_runs {
            return t;
        }
        let [r] = &t.reqs[..] else { return t };
        let Some(data) = r.data.as_ref().filter(|_| r.kind == RecordKind::Write) else {
            return t;
        };
        if r.nblocks != 1 || r.no_wait || t.meta.records.len() != 1 {
            return t;
        }
        t.run = Some(RunWrite {
            first_seq: t.meta.first_seq,
            start: t.meta.start,
            blocks: t.meta.blocks,
            headers: vec![record_header(r, t.meta.first_seq, &data[..BLOCK])],
        });
        t
    }

    /// Makes a lone host write the next record of the open run, if there is one that can take
    /// it (`LogState::extend_run`); `Err(req)` otherwise. Called with the log idle.
    fn extend_run(&self, f: &mut Front, req: WriteReq) -> Result<Taken, WriteReq> {
        if !self.sh.cfg.log_runs
            || req.kind != RecordKind::Write
            || req.no_wait
            || self.sh.check_running().is_err()
        {
            return Err(req);
        }
        let Some(data) = req.data.as_ref() else {
            return Err(req);
        };
        let now_ms = self.sh.cfg.clock.now_ms();
        let placed =
            self.sh
                .log
                .lock()
                .extend_run(req.nblocks, self.max_batch_blocks, |seq, data_start| {
                    RecMeta {
                        kind: req.kind,
                        layer: req.layer,
                        lba: req.lba,
                        nblocks: req.nblocks,
                        seq,
                        data_start,
                        relocation: false,
                        born_ms: now_ms,
                        aged_from_ms: now_ms,
                        cache_gen: 0,
                        vol: req.vol,
                        cache_copy: CacheCopy::Again,
                    }
                });
        let Some((run, before)) = placed else {
            return Err(req);
        };
        let rec = run.records[run.records.len() - 1];
        let mut headers = before.headers;
        headers.push(record_header(
            &req,
            rec.seq,
            &data[..(req.nblocks * BLOCK_U64) as usize],
        ));
        self.admit(f, req.nblocks);
        let ticket = f.next_ticket;
        f.next_ticket += 1;
        self.inflight.fetch_add(1, Ordering::Relaxed);
        let c = &self.sh.counters;
        let added = req.nblocks + u64::from(headers.len() == 2);
        c.log_host_appended_bytes
            .fetch_add(added * BLOCK_U64, Ordering::Relaxed);
        c.log_host_batches.fetch_add(1, Ordering::Relaxed);
        c.log_host_records.fetch_add(1, Ordering::Relaxed);
        c.log_run_writes.fetch_add(1, Ordering::Relaxed);
        Ok(Taken {
            ticket,
            meta: BatchMeta {
                start: run.start,
                blocks: run.blocks,
                skip: run.skip,
                first_seq: rec.seq,
                records: Arc::from([rec]),
                durable: false,
                rest_from: (0, 0),
            },
            reqs: vec![req],
            own: false,
            run: Some(RunWrite {
                first_seq: run.first_seq,
                start: run.start,
                blocks: run.blocks,
                headers,
            }),
        })
    }

    /// Writes a run's newest record and, over the older of the run's two header copies, a
    /// copy holding every record: one write when they are adjacent (a run's first two
    /// writes), else two submitted together, then one flush. The copy not written holds every
    /// record written before, all acknowledged, so a torn write loses only this one.
    fn write_run(
        &self,
        scratch: &mut AlignedBuf,
        t: &Taken,
        run: &RunWrite,
    ) -> (Vec<u32>, Result<(), EngineError>) {
        let rec = &t.meta.records[0];
        let len = (rec.nblocks * BLOCK_U64) as usize;
        let copy = run_copy_for(run.headers.len());
        let h = BatchHeader {
            group: self.sh.layout.group,
            epoch: self.epoch,
            committed_seq: self.committed_seq.load(Ordering::Acquire),
            first_seq: run.first_seq,
            total_blocks: run.blocks as u32,
            records: run.headers.clone(),
            run_copy: Some(copy),
            written_unix_s: self.sh.cfg.clock.unix_s() as u32,
        };
        if scratch.len() < BLOCK + len {
            *scratch = AlignedBuf::new_zeroed(BLOCK + len);
        }
        let buf = &mut scratch[..BLOCK + len];
        buf[..BLOCK].copy_from_slice(&h.encode());
        if let Some(d) = &t.reqs[0].data {
            buf[BLOCK..].copy_from_slice(&d[..len]);
        }
        let crcs = buf[BLOCK..].chunks(BLOCK).map(crc32c::crc32c).collect();
        let at = run.start + if copy == 0 { 0 } else { RUN_SECOND_COPY };
        let layout = &self.sh.layout;
        let result = if at + 1 == rec.data_start {
            write_durably(&self.sh, &[(buf, layout.log_byte(at))])
        } else {
            let (header, data) = buf.split_at(BLOCK);
            write_durably(
                &self.sh,
                &[
                    (data, layout.log_byte(rec.data_start)),
                    (header, layout.log_byte(at)),
                ],
            )
        };
        (crcs, result)
    }

    /// Builds a taken batch in `scratch` and writes it durably; returns its blocks' crcs and
    /// the write's outcome.
    fn write_batch(
        &self,
        scratch: &mut AlignedBuf,
        t: &Taken,
    ) -> (Vec<u32>, Result<(), EngineError>) {
        let (buf, crcs) = build_batch(
            scratch,
            &self.sh.layout.group,
            self.epoch,
            self.committed_seq.load(Ordering::Acquire),
            self.sh.cfg.clock.unix_s() as u32,
            &t.meta,
            &t.reqs,
        );
        let result = write_durably(&self.sh, &[(buf, self.sh.layout.log_byte(t.meta.start))]);
        (crcs, result)
    }

    /// What `wait_request` waits for, if it is there now: Some(Some(request)), Some(None) when
    /// an own batch was written or a queue found closed, None when there is nothing yet.
    fn poll_request(&self, f: &mut Front) -> Option<Option<WriteReq>> {
        if f.host_open {
            match self.rx.try_recv() {
                Ok(r) => return Some(Some(r)),
                Err(TryRecvError::Disconnected) => {
                    f.host_open = false;
                    return Some(None);
                }
                Err(TryRecvError::Empty) => {}
            }
        }
        if !f.hot_open {
            return None;
        }
        if self.own_allowed() {
            match self.rx_hot.try_recv() {
                Ok(r) => Some(Some(r)),
                Err(TryRecvError::Disconnected) => {
                    f.hot_open = false;
                    Some(None)
                }
                Err(TryRecvError::Empty) => None,
            }
        } else {
            self.own_written.1.try_recv().ok().map(|()| None)
        }
    }

    /// The next host write: held ones first (in order), then the queue. The destager's
    /// requests met on the way (copies promoted come on the host queue) are held.
    fn next_host(&self, f: &mut Front) -> Option<WriteReq> {
        if let Some(i) = f.held.iter().position(|r| !r.no_wait) {
            return f.held.remove(i);
        }
        while f.held.len() < QUEUE_DEPTH {
            match self.rx.try_recv() {
                Ok(r) if r.no_wait => f.held.push_back(r),
                Ok(r) => return Some(r),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return None,
            }
        }
        None
    }

    /// The next request to start a batch with: a host write, else one of the destager's
    /// when its batch may go.
    fn next_request(&self, f: &mut Front) -> Option<WriteReq> {
        if let Some(r) = self.next_host(f) {
            return Some(r);
        }
        if !self.own_allowed() {
            return None;
        }
        match f.held.iter().position(|r| r.no_wait) {
            Some(i) => f.held.remove(i),
            None => self.rx_hot.try_recv().ok(),
        }
    }

    /// How long host writes must still wait for admission (None: they may go now).
    fn host_wait(&self, f: &mut Front) -> Option<Duration> {
        // A failed group, or one whose destager has stopped (shutdown), frees no more log
        // space: waiting host writes go on to `reserve`, which answers them.
        if self.sh.state.load(Ordering::Acquire) == crate::shared::STATE_FAILED
            || self.sh.destager_stop.load(Ordering::Relaxed)
        {
            return None;
        }
        let c = &self.sh.counters;
        // Host writes wait here, not in `reserve`, while the log has no room for a whole
        // batch: the destager's own rewrites, which free the log, still go meanwhile.
        if host_writes_wait_for_room(&self.sh, &self.sh.log.lock()) {
            self.sh.wake_destager();
            return Some(Duration::from_millis(50));
        }
        let now = Instant::now();
        // Out of room on the capacity tier, the destager is paused and frees nothing: a write
        // fits the log now or is refused now, with no pace to keep (room.rs). The same with
        // both tiers full (`admit_paced`).
        if f.next_admit <= now
            || c.capacity_out_of_room.load(Ordering::Relaxed)
            || c.capacity_full.load(Ordering::Relaxed)
        {
            return None;
        }
        if self.sh.log.lock().fill_ratio() <= self.sh.cfg.fill_ratio_high {
            // The destager caught up: no more waiting.
            f.next_admit = now;
            return None;
        }
        Some(f.next_admit - now)
    }

    /// The next rewrite of the destager's, waiting at most `wait` (and at most 50 ms, so a
    /// falling fill is noticed); None also as soon as the destager frees log space.
    fn next_hot(&self, f: &mut Front, wait: Duration) -> Option<WriteReq> {
        if let Some(i) = f.held.iter().position(|r| r.no_wait) {
            return f.held.remove(i);
        }
        let wait = wait.min(Duration::from_millis(50));
        let never = crossbeam_channel::never();
        let hot = if f.hot_open { &self.rx_hot } else { &never };
        // Freed log space ends the wait at once: host writes waiting for room go on.
        select! {
            recv(hot) -> r => match r {
                Ok(r) => Some(r),
                Err(_) => { f.hot_open = false; None }
            },
            recv(self.sh.log_freed_signal.1) -> _ => None,
            default(wait) => None,
        }
    }

    /// A batch of the destager's rewrites only (host writes are waiting for admission).
    fn gather_hot(&self, f: &mut Front, first: WriteReq, max_blocks: u64) -> Vec<WriteReq> {
        self.gather_from(f, first, max_blocks, |w, f| {
            match f.held.iter().position(|r| r.no_wait) {
                Some(i) => f.held.remove(i),
                None => w.rx_hot.try_recv().ok(),
            }
        })
    }

    /// A batch of host writes only.
    fn gather_host(&self, f: &mut Front, first: WriteReq) -> Vec<WriteReq> {
        self.gather_from(f, first, self.max_batch_blocks, |w, f| w.next_host(f))
    }

    /// A batch of `first` and what `next` gives, within the batch limits.
    fn gather_from(
        &self,
        f: &mut Front,
        first: WriteReq,
        max_blocks: u64,
        mut next: impl FnMut(&Self, &mut Front) -> Option<WriteReq>,
    ) -> Vec<WriteReq> {
        // With the tiers full a batch carrying data is refused: requests without data
        // (trims, write-zeroes), which the log's reserve still takes, go in batches of their own.
        let apart = self.sh.counters.capacity_full.load(Ordering::Relaxed);
        let first_has_data = first.data_blocks() > 0;
        let rotation = first.rotation;
        let mut blocks = 1 + first.data_blocks();
        let mut batch = vec![first];
        let started = Instant::now();
        while batch.len() < MAX_RECORDS_PER_BATCH {
            let r = match next(self, f) {
                Some(r) => r,
                None if rotation && self.rotation_still_queueing(started) => continue,
                None => break,
            };
            // Rotation's batches hold its requests only: they alone may take its reserve.
            let mixed =
                (apart && (r.data_blocks() > 0) != first_has_data) || r.rotation != rotation;
            if mixed || blocks + r.data_blocks() > max_blocks {
                f.held.push_front(r);
                break;
            }
            blocks += r.data_blocks();
            batch.push(r);
        }
        batch
    }

    /// Whether the destager is still queueing requests of a rotation batch being gathered
    /// (waits a moment first, within `ROTATION_GATHER_WAIT` of `started`).
    fn rotation_still_queueing(&self, started: Instant) -> bool {
        let queueing = &self.sh.counters.rotation_queueing;
        if !queueing.load(Ordering::Acquire) || started.elapsed() >= ROTATION_GATHER_WAIT {
            return false;
        }
        std::thread::sleep(Duration::from_micros(50));
        true
    }

    /// Admits and places a batch; answers it at once (None) when the group is failed or there
    /// is no room that can ever come.
    fn place(&self, f: &mut Front, batch: Vec<WriteReq>) -> Option<Taken> {
        if let Err(e) = self.sh.check_running().or_else(|e| match e {
            // Requests already queued when shutdown began are still completed.
            EngineError::ShuttingDown => Ok(()),
            e => Err(e),
        }) {
            reply_all(batch, || clone_err(&e));
            return None;
        }
        let batch = self.drop_no_wait_if_full(batch);
        if batch.is_empty() {
            return None;
        }
        let blocks = 1 + batch.iter().map(|r| r.data_blocks()).sum::<u64>();
        // Only host writes are admitted at the measured rate: the destager's own rewrites
        // (hot data kept, copies promoted) are how the log is freed, and throttling them at
        // that rate would feed back into it.
        let host: u64 = batch
            .iter()
            .filter(|r| !r.no_wait)
            .map(|r| r.data_blocks())
            .sum();
        let own = if host > 0 { blocks - 1 - host } else { blocks };
        f.own_bytes += own * BLOCK_U64;
        if host > 0 {
            self.admit(f, 1 + host);
        }
        match self.reserve(f, &batch, blocks) {
            Ok(meta) => {
                let ticket = f.next_ticket;
                f.next_ticket += 1;
                self.inflight.fetch_add(1, Ordering::Relaxed);
                let own = batch.iter().all(|r| r.no_wait);
                if own {
                    self.own_inflight.fetch_add(1, Ordering::Relaxed);
                } else {
                    let c = &self.sh.counters;
                    c.log_host_appended_bytes
                        .fetch_add(blocks * BLOCK_U64, Ordering::Relaxed);
                    c.log_host_batches.fetch_add(1, Ordering::Relaxed);
                    c.log_host_records
                        .fetch_add(batch.len() as u64, Ordering::Relaxed);
                }
                Some(Taken {
                    ticket,
                    meta,
                    reqs: batch,
                    own,
                    run: None,
                })
            }
            Err(e) => {
                reply_all(batch, || clone_err(&e));
                None
            }
        }
    }

    /// Waits for this batch's turn, then applies and answers it. After a failed write the
    /// group goes offline, and this batch and every later one are answered with the failure
    /// (nothing after a failed batch may be acknowledged).
    fn retire(&self, mut t: Taken, crcs: &[u32], result: Result<(), EngineError>) {
        let failed = || self.sh.state.load(Ordering::Acquire) == crate::shared::STATE_FAILED;
        let mut turn = self.turn.lock();
        // An earlier batch's thread that panicked (the group is then offline) never moves the
        // turn on: once offline, nothing more is applied, so the wait ends without the turn.
        while *turn != t.ticket && !failed() {
            self.turn_moved
                .wait_for(&mut turn, Duration::from_millis(50));
        }
        let result = match result {
            Err(e) => {
                // The fast device's file is written in full before use, so only a file system
                // that writes overwrites to new space (copy-on-write) can be out of room here.
                let hint = match crate::room::is_out_of_room(&e) {
                    true => {
                        " (the file system under the fast device's file is full, and it writes \
                         overwrites to new space: make room there and start Strata again; \
                         nothing acknowledged is lost)"
                    }
                    false => "",
                };
                self.sh
                    .fail(format!("the fast device failed writing the log: {e}{hint}"));
                Err(e)
            }
            Ok(()) if failed() => self.sh.check_running(),
            Ok(()) => {
                #[cfg(test)]
                {
                    let hook = self.sh.before_apply.lock().clone();
                    if let Some(hook) = hook {
                        hook(t.meta.first_seq);
                    }
                }
                self.apply(&t.meta, crcs, t.run.take());
                Ok(())
            }
        };
        if *turn == t.ticket {
            *turn += 1;
        }
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        drop(turn);
        self.turn_moved.notify_all();
        match result {
            Ok(()) => {
                let end = t.meta.first_seq + t.meta.records.len() as u64;
                #[cfg(test)]
                {
                    let hook = self.sh.after_turn_moved.lock().clone();
                    if let Some(hook) = hook {
                        hook(end);
                    }
                }
                // After the turn moved on: a later batch may have stored its end already.
                self.committed_seq.fetch_max(end, Ordering::AcqRel);
                self.sh.retired_seq.fetch_max(end, Ordering::AcqRel);
                let bytes: u64 = t
                    .reqs
                    .iter()
                    .filter(|r| !r.relocation)
                    .map(|r| r.nblocks * BLOCK_U64)
                    .sum();
                self.sh
                    .counters
                    .host_write_bytes
                    .fetch_add(bytes, Ordering::Relaxed);
                reply_all(t.reqs, || Ok(()));
                let fill = self.sh.log.lock().fill_ratio();
                self.sh.nudge_destager(fill);
            }
            Err(e) => {
                let why = e.to_string();
                reply_all(t.reqs, || Err(EngineError::Failed(why.clone())));
            }
        }
    }

    /// While waiting for space, answers the destager's queued rewrites at once: it may be
    /// waiting for them, and only it can free space.
    fn refuse_queued_no_wait(&self, f: &mut Front) {
        // Rotation's requests are kept (held, in order): they are what frees a full log, and
        // are sized to the reserve only they may take. (Refused here while a host batch
        // waited for room, they left a rotation group half written and the log's tail where
        // it was, with the blocks they took gone: rotation stopped, every trim refused.)
        while let Ok(r) = self.rx_hot.try_recv() {
            match r.rotation {
                true => f.held.push_back(r),
                false => r.done.send(Err(EngineError::NoSpace)),
            }
        }
        if f.held.iter().any(|r| r.no_wait && !r.rotation) {
            let held = std::mem::take(&mut f.held);
            let (refused, kept): (VecDeque<_>, VecDeque<_>) =
                held.into_iter().partition(|r| r.no_wait && !r.rotation);
            f.held = kept;
            reply_all(refused.into_iter().collect(), || Err(EngineError::NoSpace));
        }
    }

    /// Answers NoSpace to the requests that may not wait when the batch does not fit now.
    fn drop_no_wait_if_full(&self, batch: Vec<WriteReq>) -> Vec<WriteReq> {
        if !batch.iter().any(|r| r.no_wait) {
            return batch;
        }
        let blocks = 1 + batch.iter().map(|r| r.data_blocks()).sum::<u64>();
        let has_data = blocks > 1;
        let rotation = batch.iter().all(|r| r.rotation);
        let log = self.sh.log.lock();
        let fits = log
            .place(blocks)
            .is_some_and(|(_, skip)| log.leaves_reserve(blocks, skip, has_data, rotation));
        drop(log);
        if fits {
            return batch;
        }
        let (refused, kept): (Vec<_>, Vec<_>) = batch.into_iter().partition(|r| r.no_wait);
        reply_all(refused, || Err(EngineError::NoSpace));
        kept
    }

    /// Above the high mark, admits host writes at the rate the log is actually freed: 1.25x
    /// of it at the high mark falling smoothly to 0.75x when the log is full, so the fill
    /// settles between the two instead of hitting a wall. The rate is measured over wall time
    /// (the last `ADMIT_SPAN`, once at least `ADMIT_MIN_SPAN` of it) while throttled, when the
    /// destager runs flat out, so it counts everything that slows the destager; until then
    /// the last such measurement, or the destage bandwidth its steps measured, stands in
    /// (with neither, host writes are not paced: only a full log makes them wait).
    /// The batch just placed pays the cost: the next host batch waits for it (`host_wait`).
    fn admit(&self, f: &mut Front, blocks: u64) {
        self.admit_paced(f, blocks);
        // What `admission_now` reads: whether a rate to pace at was measured.
        let measured = f.freed_rate.is_some();
        self.sh
            .counters
            .admit_rate_measured
            .store(measured, Ordering::Relaxed);
    }

    fn admit_paced(&self, f: &mut Front, blocks: u64) {
        let fill = self.sh.log.lock().fill_ratio();
        let (low, high) = (self.sh.cfg.fill_ratio_low, self.sh.cfg.fill_ratio_high);
        let now = Instant::now();
        // With both tiers full no destage frees the log: there is no rate to keep, a write
        // that fits goes and the others are refused or wait for rotation (`reserve`). Paced
        // at the last rate measured, or the 1 MiB/s floor, each refused 1 MiB write of a full
        // volume cost about a second, one after another, and every volume's writes queued
        // behind them.
        if fill <= high || self.sh.counters.capacity_full.load(Ordering::Relaxed) {
            f.next_admit = now;
            f.freed_samples.clear();
            if fill < low {
                f.freed_rate = None;
            }
            return;
        }
        // Net of the destager's own rewrites: compacting a log region that is 70% live frees
        // only 30% of it for host writes.
        let freed =
            self.sh.counters.log_freed_bytes.load(Ordering::Relaxed) as i64 - f.own_bytes as i64;
        while f.freed_samples.len() > 1
            && f.freed_samples
                .get(1)
                .is_some_and(|s| now - s.0 >= ADMIT_SPAN)
        {
            f.freed_samples.pop_front();
        }
        if let Some(&(since, at)) = f.freed_samples.front() {
            if now - since >= ADMIT_MIN_SPAN {
                f.freed_rate = Some((freed - at).max(0) as f64 / (now - since).as_secs_f64());
            }
        }
        if f.freed_samples
            .back()
            .is_none_or(|s| now - s.0 >= SAMPLE_EVERY)
        {
            f.freed_samples.push_back((now, freed));
        }
        let x = ((fill - high) / (1.0 - high).max(1e-6)).clamp(0.0, 1.0);
        let measured = f.freed_rate.or_else(|| {
            let bw = Counters::get_f64(&self.sh.counters.destage_bw_bytes_per_s);
            (bw > 0.0).then_some(bw)
        });
        let Some(measured) = measured else {
            // Nothing measured yet (just opened): no pace to keep; a full log still waits.
            f.next_admit = now;
            return;
        };
        let rate = measured.max(1024.0 * 1024.0) * (1.25 - 0.5 * x);
        let cost = Duration::from_secs_f64((blocks * BLOCK_U64) as f64 / rate);
        f.next_admit = f.next_admit.max(now) + cost;
    }

    /// Waits for log space; fails with NoSpace when the destager cannot make room because the
    /// capacity tier is full and no batch in flight will add a durable one to destage.
    fn reserve(
        &self,
        f: &mut Front,
        batch: &[WriteReq],
        blocks: u64,
    ) -> Result<BatchMeta, EngineError> {
        loop {
            {
                let mut log = self.sh.log.lock();
                self.sh.check_running().or_else(|e| match e {
                    EngineError::ShuttingDown if !self.sh.abandon.load(Ordering::Relaxed) => Ok(()),
                    e => Err(e),
                })?;
                let has_data = batch.iter().any(|r| r.data_blocks() > 0);
                let rotation = batch.iter().all(|r| r.rotation);
                let placed = log.place(blocks);
                if let Some((start, skip)) =
                    placed.filter(|&(_, skip)| log.leaves_reserve(blocks, skip, has_data, rotation))
                {
                    if rotation {
                        log.rotation_outstanding_blocks += blocks + skip;
                    }
                    let meta = describe(
                        batch,
                        start,
                        skip,
                        blocks,
                        log.next_seq,
                        self.sh.cfg.clock.now_ms(),
                    );
                    log.push(meta.clone());
                    return Ok(meta);
                }
                // A host batch that does not fit does not wait ahead of rotation's requests
                // (held behind it, they would wait for room only they can make).
                let rotation_held = !rotation && f.held.iter().any(|r| r.rotation);
                if self.inflight.load(Ordering::Relaxed) == 0
                    && (self.sh.counters.capacity_full.load(Ordering::Relaxed) || rotation_held)
                {
                    return Err(EngineError::NoSpace);
                }
                // Shutting down with the destager stopped: nothing will free the log, and a
                // request not yet placed was not acknowledged, so it is refused.
                if self.sh.destager_stop.load(Ordering::Relaxed) {
                    return Err(EngineError::ShuttingDown);
                }
            }
            self.sh.wake_destager();
            self.refuse_queued_no_wait(f);
            let mut log = self.sh.log.lock();
            self.sh
                .log_freed
                .wait_for(&mut log, Duration::from_millis(50));
        }
    }

    /// Points the index at a durable batch; only then may the destager see it (it judges what
    /// is live by where the index points).
    /// A run's write marks the run durable again, and reopens it if nothing was appended
    /// after it meanwhile.
    fn apply(&self, meta: &BatchMeta, crcs: &[u32], run: Option<RunWrite>) {
        let mut crcs = crcs.iter();
        for r in meta.records.iter() {
            if !matches!(r.kind, RecordKind::Write | RecordKind::Cache) {
                continue;
            }
            for (b, c) in (r.data_start..r.data_start + r.nblocks).zip(crcs.by_ref()) {
                self.sh.fast_crcs[b as usize].store(*c, Ordering::Relaxed);
            }
            self.sh.fast_read.clear(r.data_start, r.nblocks);
        }
        let displaced = apply_records(&self.sh, &meta.records);
        self.sh.release(&displaced);
        let cached: Vec<&RecMeta> = meta
            .records
            .iter()
            .filter(|r| r.kind == RecordKind::Cache)
            .collect();
        if !cached.is_empty() {
            let mut taken = Vec::with_capacity(cached.len());
            {
                let mut cache = self.sh.cache.lock();
                for r in cached {
                    let again = r.cache_copy == CacheCopy::Again;
                    let at = crate::cache::NewCopy {
                        fast: r.data_start,
                        gen: r.cache_gen,
                        vol: r.vol,
                        again,
                    };
                    let (fresh, replaced) =
                        cache.insert(r.layer, r.lba as u32, r.nblocks as u32, at);
                    taken.push((r.vol, r.cache_copy, fresh, replaced));
                }
            }
            for (vol, copy, fresh, replaced) in taken {
                crate::tiering::count_cache_copies(&self.sh, vol, copy, fresh, &replaced);
            }
        }
        let key = run.as_ref().map_or(meta.first_seq, |r| r.first_seq);
        let mut log = self.sh.log.lock();
        if let Some(m) = log.batches.iter_mut().rev().find(|m| m.first_seq == key) {
            m.durable = true;
        }
        if let Some(run) = run {
            if log.batches.back().is_some_and(|m| m.first_seq == key) {
                log.open_run = Some(OpenRun {
                    first_seq: key,
                    headers: run.headers,
                });
            }
        }
    }
}

/// Transient device errors get two more tries at the same place; the batch is not yet
/// acknowledged, so rewriting it is harmless.
fn write_durably(sh: &Shared, parts: &[(&[u8], u64)]) -> Result<(), EngineError> {
    let mut last = None;
    for _ in 0..3 {
        let result = match parts {
            [(buf, offset)] => sh.fast.write_durable_at(buf, *offset),
            _ => sh.fast.write_all_durable(parts),
        };
        match result {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(EngineError::Device(last.expect("three attempts")))
}

/// Points the fast maps at the records (in order); records of deleted layers are ignored.
/// Returns what the records displaced there.
pub fn apply_records(sh: &Shared, records: &[RecMeta]) -> Vec<(u64, u64, Loc)> {
    let mut displaced = Vec::new();
    let mut written = Vec::new();
    let mut added = 0;
    {
        let mut idx = sh.index.write();
        for r in records {
            if !idx.layer_live(r.layer) {
                continue;
            }
            let Some(l) = idx.layers.get_mut(&r.layer) else {
                continue;
            };
            let loc = match r.kind {
                RecordKind::Write => {
                    added += r.nblocks;
                    Loc::Fast(r.data_start)
                }
                RecordKind::Zero => Loc::Zero(r.seq),
                // Clean copies are not volume data (see cache.rs).
                RecordKind::Cache => continue,
                // Written to the capacity tier since: the capacity index has the data, and
                // the older log copies must not shadow it (at runtime they are gone already).
                RecordKind::Forget => {
                    displaced.extend(l.fast.set(r.lba, r.nblocks, None));
                    continue;
                }
            };
            let d = l.fast.set(r.lba, r.nblocks, Some(loc));
            if r.kind == RecordKind::Write && !r.relocation {
                // A host write; writing a block again (on either tier) is evidence of heat.
                written.push((r.layer, r.lba, r.nblocks));
            }
            displaced.extend(d);
        }
    }
    sh.counters
        .fast_live_blocks
        .fetch_add(added, Ordering::Relaxed);
    sh.counters.own_changes.fetch_add(1, Ordering::Release);
    if !written.is_empty() {
        let mut heat = sh.heat.lock();
        for (layer, lba, n) in written {
            heat.note_write(layer, lba, n);
        }
    }
    displaced
}

fn describe(
    batch: &[WriteReq],
    start: u64,
    skip: u64,
    blocks: u64,
    first_seq: u64,
    now_ms: u64,
) -> BatchMeta {
    let mut data_at = start + 1;
    let records = batch
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let m = RecMeta {
                kind: r.kind,
                layer: r.layer,
                lba: r.lba,
                nblocks: r.nblocks,
                seq: first_seq + i as u64,
                data_start: data_at,
                relocation: r.relocation,
                born_ms: r.born_ms.unwrap_or(now_ms),
                aged_from_ms: now_ms,
                cache_gen: r.cache_gen,
                vol: r.vol,
                cache_copy: r.cache_copy,
            };
            data_at += r.data_blocks();
            m
        })
        .collect();
    BatchMeta {
        start,
        blocks,
        skip,
        first_seq,
        records,
        durable: false,
        rest_from: (0, 0),
    }
}

/// The batch as it goes to the device, and the crc of each data block.
/// Lays out a batch in `scratch` (grown when too small) and returns the part to write, with
/// the crc of each data block. Every byte of that part is written here: the header block,
/// then each record's data back to back.
fn build_batch<'a>(
    scratch: &'a mut AlignedBuf,
    group: &Uuid,
    epoch: u32,
    committed_seq: u64,
    written_unix_s: u32,
    meta: &BatchMeta,
    batch: &[WriteReq],
) -> (&'a [u8], Vec<u32>) {
    let len = (meta.blocks * BLOCK_U64) as usize;
    if scratch.len() < len {
        *scratch = AlignedBuf::new_zeroed(len);
    }
    let buf = &mut scratch[..len];
    let mut crcs = Vec::with_capacity(meta.blocks as usize - 1);
    let mut headers = Vec::with_capacity(batch.len());
    let mut at = BLOCK;
    for (r, m) in batch.iter().zip(meta.records.iter()) {
        let mut data_crc = 0;
        if let Some(d) = &r.data {
            let len = (r.nblocks * BLOCK_U64) as usize;
            buf[at..at + len].copy_from_slice(&d[..len]);
            data_crc = crc32c::crc32c(&d[..len]);
            crcs.extend(d[..len].chunks(BLOCK).map(crc32c::crc32c));
            at += len;
        }
        headers.push(RecordHeader {
            kind: r.kind,
            seq: m.seq,
            layer: r.layer,
            offset_bytes: r.lba * BLOCK_U64,
            len_bytes: r.nblocks * BLOCK_U64,
            data_crc,
        });
    }
    let h = BatchHeader {
        group: *group,
        epoch,
        committed_seq,
        first_seq: meta.first_seq,
        total_blocks: meta.blocks as u32,
        records: headers,
        run_copy: None,
        written_unix_s,
    };
    buf[..BLOCK].copy_from_slice(&h.encode());
    debug_assert_eq!(at, len, "a batch's records fill it exactly");
    (buf, crcs)
}

/// The header of a host write's record with sequence number `seq` and data `data`.
fn record_header(r: &WriteReq, seq: u64, data: &[u8]) -> RecordHeader {
    RecordHeader {
        kind: r.kind,
        seq,
        layer: r.layer,
        offset_bytes: r.lba * BLOCK_U64,
        len_bytes: r.nblocks * BLOCK_U64,
        data_crc: crc32c::crc32c(data),
    }
}

fn reply_all(batch: Vec<WriteReq>, mut result: impl FnMut() -> Result<(), EngineError>) {
    for r in batch {
        r.done.send(result());
    }
}

fn clone_err(e: &EngineError) -> Result<(), EngineError> {
    Err(match e {
        EngineError::NoSpace => EngineError::NoSpace,
        EngineError::ShuttingDown => EngineError::ShuttingDown,
        EngineError::Failed(s) => EngineError::Failed(s.clone()),
        other => EngineError::Failed(other.to_string()),
    })
}

/// Queue bound between callers and the log writer.
pub const QUEUE_DEPTH: usize = 1024;
/// How long the committer waiting for a request sleeps before it looks at the queues again
/// unwoken (a closed queue wakes it too; this bounds what a lost wake could cost).
pub const IDLE_RECHECK: Duration = Duration::from_millis(200);
/// Admission control measures the rate the log is freed at over this much wall time...
const ADMIT_SPAN: Duration = Duration::from_secs(4);
/// ...once it has at least this much (the destager frees the log in steps).
const ADMIT_MIN_SPAN: Duration = Duration::from_secs(1);
/// How often admission control samples the freed counter.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever batches wrap and leave at the end of the area, the counted skip keeps the
    /// backlog (the batches' own blocks) known without walking them.
    #[test]
    fn skipped_blocks_follow_the_batches_through_wraps() {
        let mut log = LogState::new(100, 0, 0);
        let (mut seq, mut wrapped_with_skip) = (0, 0);
        let check = |log: &LogState| {
            let walked: u64 = log.batches.iter().map(|b| b.blocks).sum();
            assert_eq!(log.used_blocks - log.skipped_blocks, walked);
        };
        for (i, n) in [7u64, 30, 41, 13, 29, 3, 60, 17, 9, 45, 22, 5]
            .iter()
            .cycle()
            .take(200)
            .enumerate()
        {
            while log.place(*n).is_none() {
                log.pop().expect("an empty log has room for any batch");
                check(&log);
            }
            let (start, skip) = log.place(*n).expect("room");
            wrapped_with_skip += u32::from(skip > 0);
            log.push(BatchMeta {
                start,
                blocks: *n,
                skip,
                first_seq: seq,
                records: Arc::from([]),
                durable: true,
                rest_from: (0, 0),
            });
            seq += 1;
            check(&log);
            if i % 7 == 0 {
                log.pop();
                check(&log);
            }
        }
        assert!(
            wrapped_with_skip > 3,
            "the sizes never left blocks at the end"
        );
        while log.pop().is_some() {}
        assert_eq!((log.used_blocks, log.skipped_blocks), (0, 0));
    }
}
