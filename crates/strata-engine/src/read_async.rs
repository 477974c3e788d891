//! Host reads answered from the fast device's completion instead of from a blocked thread
//! (see [`DiskGroup::read_async`]).
//!
//! The read is resolved and submitted on the caller's thread and finished on the device's
//! completion thread, which checks the blocks' checksums, counts the read as `read` would and
//! hands the bytes to the caller. Its locations stay valid until then because it holds the
//! `reclaim` lock shared from resolve to completion, as a blocking read does for its whole
//! call.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};
use strata_device::{AlignedBuf, DeviceError};

use crate::capacity;
use crate::format::{BLOCK, BLOCK_U64};
use crate::map::Loc;
use crate::resolve::{self, Piece};
use crate::runtime::VolRuntime;
use crate::shared::Shared;
use crate::tiering;
use crate::{block_span, DiskGroup, EngineError, VolumeId};

/// Called once with the bytes of a read started by [`DiskGroup::read_async`], or its error.
pub type ReadDone = Box<dyn FnOnce(Result<Vec<u8>, EngineError>) + Send + 'static>;

/// The largest read taken asynchronously; larger reads take the blocking path.
pub const MAX_ASYNC_READ_BYTES: usize = 1 << 20;

/// The shared hold on `Shared::reclaim`, released on whichever thread finishes the read.
type ReclaimPin = parking_lot::ArcRwLockReadGuard<parking_lot::RawRwLock, ()>;

/// Where the one stored run of an asynchronous read lives.
enum Source {
    /// In the write log, from log block `first`.
    Log { first: u64 },
    /// Clean copies of capacity blocks `(seg, block..)`, from log block `first`.
    Cached { seg: u32, block: u32, first: u64 },
    /// Capacity blocks `(seg, block..)`, none of them cached: checked against `crcs`, and
    /// perhaps promoted (through `promote`) as a blocking read would.
    Capacity {
        seg: u32,
        block: u32,
        crcs: Vec<u32>,
        gen: u32,
        sequential_bytes: u64,
        promote: Option<crate::queue::LogQueue>,
    },
}

/// What the completion needs to finish a read as `read` would have.
struct Finish {
    sh: Arc<Shared>,
    /// For the rare read that must go again the blocking way (a damaged cached copy).
    group: Weak<DiskGroup>,
    pin: Option<ReclaimPin>,
    view: VolumeId,
    rt: Option<Arc<VolRuntime>>,
    head: u32,
    /// The run read from the fast tier, and where it lives.
    run: Piece,
    source: Source,
    /// Blocks of the read that are unwritten or zero.
    zero_blocks: u64,
    offset: u64,
    len: usize,
    /// The first block of the read's block span.
    b0: u64,
    /// How long a sequential stream the read continued (noted when it started).
    sequential: u64,
    done: Arc<Mutex<Option<ReadDone>>>,
}

impl DiskGroup {
    /// Starts a host read of `len` bytes of a view at byte `offset` and returns at once.
    /// `done` gets the bytes, with the read counted, limited and checked exactly as [`read`]
    /// would have; it runs on the fast device's completion thread (or at once, for a read
    /// of nothing but unwritten blocks) and must not block.
    ///
    /// Taken are reads whose blocks are unwritten or zero except for at most one stored run
    /// (in the write log, cached copies of capacity blocks, or capacity blocks none of which
    /// is cached) whose index entries and checksums are in memory, of a volume within its
    /// limits, on a device with an asynchronous path. Any other read is refused with `Err(done)`, untouched: the caller then calls
    /// [`read`] on a thread that may block.
    ///
    /// [`read`]: DiskGroup::read
    pub fn read_async(
        self: &Arc<Self>,
        view: VolumeId,
        offset: u64,
        len: usize,
        done: ReadDone,
    ) -> Result<(), ReadDone> {
        let sh = &self.sh;
        if len == 0 || len > MAX_ASYNC_READ_BYTES {
            return Err(done);
        }
        let Ok((head, _)) = self.view_range(view, offset, len as u64) else {
            return Err(done);
        };
        let Some(pin) = RwLock::try_read_arc(&sh.reclaim) else {
            return Err(done);
        };
        let (b0, b1) = block_span(offset, len as u64);
        let Ok(Some(pieces)) = resolve::resolve_in_memory(sh, view, b0, b1 - b0) else {
            return Err(done);
        };
        let Some((run, zero_blocks)) = one_fast_run(&pieces) else {
            return Err(done);
        };
        let source = match run.map(|p| (p, p.loc)) {
            None => None,
            Some((p, Some(Loc::Fast(first)))) => Some((p, Source::Log { first })),
            Some((p, Some(Loc::Cap { seg, block }))) => {
                match self.capacity_source(seg, block, p.len) {
                    Some(source) => Some((p, source)),
                    None => return Err(done),
                }
            }
            Some(_) => return Err(done),
        };
        let rt = sh.runtime(view);
        // A snapshot of a limited volume: its reads wait for the volume's limits, which the
        // blocking read does.
        if rt.is_none() && sh.snapshot_limits(view).is_some_and(|l| l.limited()) {
            return Err(done);
        }
        let mut sequential = 0;
        // Taken before the device may refuse the read: then put back as it was, since the
        // blocking read the caller falls back to admits and notes the same read again.
        let mut reads_before = None;
        if let Some(rt) = &rt {
            if !rt.try_admit(&*sh.cfg.clock, len as u64) {
                return Err(done);
            }
            let mut reads = rt.reads.lock();
            reads_before = Some(*reads);
            sequential = reads.note(offset, len as u64);
        }
        let undo = (rt.clone(), reads_before);
        let Some((run, mut source)) = source else {
            drop(pin);
            count_zeros(sh, zero_blocks, len);
            done(Ok(vec![0; len]));
            return Ok(());
        };
        if let Source::Capacity {
            sequential_bytes, ..
        } = &mut source
        {
            *sequential_bytes = sequential;
        }
        let (device, at) = match &source {
            Source::Log { first } | Source::Cached { first, .. } => {
                (sh.fast.clone(), sh.layout.log_byte(*first))
            }
            Source::Capacity { seg, block, .. } => {
                let (dev, at) = sh.layout.seg_data_byte(*seg, *block);
                (sh.caps[dev].clone(), at)
            }
        };
        // The callback stays reachable until the device takes the read, so a refusal can
        // hand it back.
        let slot = Arc::new(Mutex::new(Some(done)));
        let finish = Finish {
            sh: sh.clone(),
            group: Arc::downgrade(self),
            pin: Some(pin),
            view,
            rt,
            head,
            run,
            source,
            zero_blocks,
            offset,
            len,
            b0,
            sequential,
            done: slot.clone(),
        };
        let buf = AlignedBuf::new_zeroed((run.len * BLOCK_U64) as usize);
        match device.read_async(
            buf,
            at,
            Box::new(move |buf, result| finish.finish(buf, result)),
        ) {
            Ok(()) => Ok(()),
            Err((_, refused)) => {
                drop(refused);
                if let (Some(rt), Some(before)) = undo {
                    *rt.reads.lock() = before;
                    rt.give_back(len as u64);
                }
                let done = slot.lock().take();
                Err(done.unwrap_or_else(|| Box::new(|_| {})))
            }
        }
    }

    /// Where to read capacity blocks `block..block+n` of `seg` from: their cached copies
    /// when all are cached in consecutive log blocks, the segment when none is and their
    /// checksums are in memory; None otherwise (the blocking path sorts that out).
    fn capacity_source(&self, seg: u32, block: u32, n: u64) -> Option<Source> {
        let sh = &self.sh;
        let n = u32::try_from(n).ok()?;
        let gen = {
            let mut cache = sh.cache.lock();
            let lookups: Vec<Option<u64>> = match cache.entries() {
                0 => Vec::new(),
                _ => (0..n).map(|i| cache.lookup(seg, block + i)).collect(),
            };
            match lookups.first().copied().flatten() {
                Some(first) => {
                    let consecutive =
                        (1..n).all(|i| lookups[i as usize] == Some(first + u64::from(i)));
                    return consecutive.then_some(Source::Cached { seg, block, first });
                }
                None if lookups.iter().any(Option::is_some) => return None,
                None => cache.gen_of(seg),
            }
        };
        let crcs = capacity::cached_block_crcs(sh, seg, block, n)?;
        let promote = match sh.cfg.read_cache_ratio > 0.0 {
            true => self.tx.lock().clone(),
            false => None,
        };
        Some(Source::Capacity {
            seg,
            block,
            crcs,
            gen,
            sequential_bytes: 0,
            promote,
        })
    }
}

/// The read's one run of stored blocks (None when all of it reads as zeros) and how many
/// blocks read as zeros; None when it has more than one run.
fn one_fast_run(pieces: &[Piece]) -> Option<(Option<Piece>, u64)> {
    let mut run = None;
    let mut zeros = 0;
    for p in pieces {
        match p.loc {
            None | Some(Loc::Zero(_)) => zeros += p.len,
            Some(_) if run.is_some() => return None,
            Some(_) => run = Some(*p),
        }
    }
    Some((run, zeros))
}

fn count_zeros(sh: &Shared, zero_blocks: u64, len: usize) {
    let c = &sh.counters;
    c.read_unwritten_bytes
        .fetch_add(zero_blocks * BLOCK_U64, Ordering::Relaxed);
    c.host_read_bytes.fetch_add(len as u64, Ordering::Relaxed);
}

impl Finish {
    fn finish(mut self, buf: AlignedBuf, result: Result<(), DeviceError>) {
        let checked = match self.check(&buf, result) {
            Ok(checked) => checked,
            Err(Retry) => return self.read_again(),
        };
        self.pin = None;
        if checked.is_ok() {
            self.maybe_promote(&buf);
        }
        let result = checked.map(|()| self.assemble(&buf));
        if let Some(done) = self.done.lock().take() {
            done(result);
        }
    }

    /// Checks what the device returned and counts it, under the reclaim pin (the checksums
    /// describe the log blocks only while they cannot be reused). `Err(Retry)`: a cached copy
    /// could not be used and was forgotten, or a block failed its crc.
    fn check(
        &self,
        buf: &AlignedBuf,
        result: Result<(), DeviceError>,
    ) -> Result<Result<(), EngineError>, Retry> {
        let sh = &self.sh;
        let first_bad = |expected: &dyn Fn(usize) -> Option<u32>| {
            let mut blocks = buf.chunks(BLOCK).enumerate();
            blocks.position(|(k, c)| Some(crc32c::crc32c(c)) != expected(k))
        };
        let in_log = |first: u64| {
            move |k: usize| Some(sh.fast_crcs[(first + k as u64) as usize].load(Ordering::Relaxed))
        };
        let n = self.run.len;
        match &self.source {
            Source::Log { first } => {
                if let Err(e) = result {
                    return Ok(Err(e.into()));
                }
                // Read again the blocking way, which reads a block that fails its crc again
                // before it calls it damaged (reread.rs).
                if first_bad(&in_log(*first)).is_some() {
                    return Err(Retry);
                }
                sh.counters
                    .read_fast_bytes
                    .fetch_add(n * BLOCK_U64, Ordering::Relaxed);
                if let Some(rt) = &self.rt {
                    rt.stats.read_fast_blocks.fetch_add(n, Ordering::Relaxed);
                    sh.note_read_heat(rt, self.run.layer, self.run.lba, n);
                    if sh.cfg.read_cache_ratio > 0.0 {
                        sh.fast_read.mark(*first, n);
                    }
                }
            }
            Source::Cached { seg, block, first } => {
                let damaged = result.is_ok() && first_bad(&in_log(*first)).is_some();
                if result.is_err() || damaged {
                    crate::unusable_copy(sh, *seg, *block, n as u32, *first, damaged);
                    return Err(Retry);
                }
                sh.counters
                    .read_cached_bytes
                    .fetch_add(n * BLOCK_U64, Ordering::Relaxed);
                if let Some(rt) = &self.rt {
                    rt.stats.read_cached_blocks.fetch_add(n, Ordering::Relaxed);
                }
            }
            Source::Capacity { crcs, .. } => {
                if let Err(e) = result {
                    return Ok(Err(e.into()));
                }
                if first_bad(&|k| crcs.get(k).copied()).is_some() {
                    // The cached crc block may be an earlier use's, from a summary copy whose
                    // last write was lost, or the read went wrong in passing: the blocking read
                    // holds the block against the segment's whole summary, and reads it
                    // again, before it calls it damaged.
                    return Err(Retry);
                }
                sh.counters
                    .read_capacity_bytes
                    .fetch_add(n * BLOCK_U64, Ordering::Relaxed);
                if let Some(rt) = &self.rt {
                    rt.stats
                        .read_capacity_blocks
                        .fetch_add(n, Ordering::Relaxed);
                }
            }
        }
        count_zeros(sh, self.zero_blocks, self.len);
        Ok(Ok(()))
    }

    /// Capacity blocks read by a host: evidence for promotion, and perhaps promoted, as a
    /// blocking read would.
    fn maybe_promote(&self, data: &[u8]) {
        let Source::Capacity {
            seg,
            block,
            gen,
            sequential_bytes,
            promote: Some(tx),
            ..
        } = &self.source
        else {
            return;
        };
        let Some(rt) = &self.rt else {
            return;
        };
        let sh = &self.sh;
        let (policy, now) = (rt.policy(), sh.cfg.clock.now_ms());
        let wanted = sh.cache.lock().note_miss(
            &policy,
            self.head,
            self.run.lba,
            self.run.len,
            *sequential_bytes,
            now,
            &mut None,
        );
        for (from, n) in wanted {
            let k = (from - self.run.lba) as usize;
            let copy = &data[k * BLOCK..(k + n as usize) * BLOCK];
            tiering::promote_with(sh, Some(tx), Some(rt), *seg, *block + k as u32, *gen, copy);
        }
    }

    /// The host's bytes: zeros, with the run's blocks where they fall in the read.
    fn assemble(&self, buf: &AlignedBuf) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        let span_start = self.b0 * BLOCK_U64;
        let (read_start, read_end) = (self.offset, self.offset + self.len as u64);
        let run_start = self.run.lba * BLOCK_U64;
        let run_end = run_start + buf.len() as u64;
        let (from, to) = (read_start.max(run_start), read_end.min(run_end));
        debug_assert!(span_start <= read_start);
        if from < to {
            let src = &buf[(from - run_start) as usize..(to - run_start) as usize];
            out[(from - read_start) as usize..(to - read_start) as usize].copy_from_slice(src);
        }
        out
    }

    /// Reads once more the blocking way, on a thread of its own: the completion thread must
    /// not block on the reclaim lock (readers it has yet to finish hold it).
    fn read_again(mut self) {
        self.pin = None;
        let slot = self.done.clone();
        // Admitted and noted when it started: not a second time.
        let sequential = self.sequential;
        let spawned = std::thread::Builder::new()
            .name("strata-read-retry".into())
            .spawn(move || {
                let result = match self.group.upgrade() {
                    Some(group) => {
                        let mut out = vec![0u8; self.len];
                        group
                            .read_as(self.view, self.offset, &mut out, Some(sequential))
                            .map(|()| out)
                    }
                    None => Err(EngineError::ShuttingDown),
                };
                if let Some(done) = self.done.lock().take() {
                    done(result);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a thread to read again");
            if let Some(done) = slot.lock().take() {
                done(Err(EngineError::Failed(format!(
                    "cannot start a thread to read again: {e}"
                ))));
            }
        }
    }
}

/// A read that must go again the blocking way: its cached copy could not be used (the capacity
/// tier is read instead), or a block failed its crc (the blocking read reads it again).
struct Retry;
