//! Sequential writes that go straight to the capacity tier (a cache-mode volume's
//! `sequential_write_cutoff_bytes`): a long stream of large writes gains nothing from the write
//! buffer, and bypassing it keeps the buffer (and the read cache) for the data that does.
//!
//! A bypassed write is still durable before it completes, in three steps:
//! 1. the host thread hands the data (whole blocks, at most one segment's worth per job) to the
//!    destager, the only thread that changes the capacity index;
//! 2. the destager packs the queued jobs into a stripe of new segments, writes them like a
//!    destage (data, flush, summary, flush), points the index at them, drops the range's older
//!    log copies from the fast maps, and writes the checkpoint, whose list of recent segments
//!    now names them (so recovery re-applies them over the last flushed index);
//! 3. the host thread appends a `Forget` record for the range to the log and waits for it.
//!
//! Recovery replays the log over the index: older log copies of the range come back into the
//! fast maps, and the `Forget` record, durable only after step 2, drops them again. A crash
//! between steps 2 and 3 (the write was not acknowledged) leaves each block old or new: the
//! older copies still in the log come back, but step 2 dropped them from the fast maps, so
//! the destager may have freed some from the log meanwhile, and where it did the new data
//! stands. Readers see the new data from step 2 on, before the write is acknowledged.
//! The summary entries carry the log's next sequence number as of step 2, so recovery orders
//! them after every older copy that reached a segment, and before every newer one.
//!
//! The trade-off (see README): such writes complete at the capacity tier's speed, and a stripe
//! smaller than a segment leaves the rest of its segment to garbage collection, so a client
//! with one write in flight at a time bypasses the log only with writes that fill a good
//! share of a segment by themselves (`packs_enough`).

use std::sync::atomic::Ordering;

use crossbeam_channel::Sender;
use strata_device::AlignedBuf;

use crate::capacity::{write_stripe, Builder};
use crate::destage::{apply_tree_sets, gc_trigger, Destager, TreeSet};
use crate::error::EngineError;
use crate::format::{BLOCK, BLOCK_U64};
use crate::map::Loc;
use crate::meta;
use crate::policy::{Mode, Policy};
use crate::shared::Shared;

/// Writes smaller than this never bypass the log (each job takes a segment of its own when
/// nothing else is queued with it).
pub const BYPASS_MIN_BYTES: u64 = 128 << 10;
/// Jobs waiting for the destager at most (hosts wait to queue more).
pub const BYPASS_QUEUE: usize = 64;

/// A range of whole blocks to write straight to the capacity tier.
pub struct BypassJob {
    pub layer: u32,
    pub lba: u64,
    pub data: AlignedBuf,
    /// Ok once the data is durable in a segment and the index points at it. On an error (no
    /// free segment, a failed segment write) the caller writes through the log instead, whose
    /// newer copy then wins over anything this job left behind.
    pub done: Sender<Result<(), EngineError>>,
}

/// Whether a whole-block write of `len` bytes, continuing a sequential stream of
/// `stream_bytes`, goes straight to the capacity tier under this policy: only while the
/// capacity tier has free segments to spare (a bypassed burst may leave part of a segment to
/// garbage collection; when space runs short, the log packs segments full instead). A write
/// its client made `alone` (the only one it has in flight, as the NBD server tells a client at
/// queue depth one) bypasses only if it fills a good share of a segment by itself
/// (`packs_enough`). When only free segments are missing, says so to the destager, whose GC
/// then cleans the segments that are cheap to clean (`Destager::gc_needed`).
pub fn wanted(sh: &Shared, p: &Policy, stream_bytes: u64, len: u64, alone: bool) -> bool {
    let asked = p.mode == Mode::Cache
        && p.sequential_write_cutoff_bytes > 0
        && stream_bytes >= p.sequential_write_cutoff_bytes
        && len >= BYPASS_MIN_BYTES
        && (!alone || packs_enough(sh, len))
        && !sh.counters.capacity_out_of_room.load(Ordering::Relaxed);
    if !asked {
        return false;
    }
    let room = sh.segs.lock().free_count() > 2 * gc_trigger(sh);
    if !room {
        let held = &sh.counters.bypass_held_for_room;
        held.store(true, Ordering::Relaxed);
    }
    room
}

/// Whether `bytes` fill at least a quarter of a segment's data area. The destager packs the
/// jobs queued when it looks into one stripe and seals it, so a client with one write in
/// flight at a time sealed a segment per write: a stream of 128 KiB writes at queue depth one
/// filled 8 MiB segments to 1.6% (with their summaries written twice each), until no free
/// segment was left to spare. Such writes go through the log, whose destager packs segments
/// full.
pub fn packs_enough(sh: &Shared, bytes: u64) -> bool {
    bytes.saturating_mul(4) >= u64::from(sh.layout.geo.data_blocks) * BLOCK_U64
}

impl Destager {
    /// Writes every queued bypass job, a stripe at a time.
    pub(crate) fn run_bypass(&mut self) {
        let geo = self.sh.layout.geo;
        let width = self.sh.caps.len();
        let mut stripe: Vec<Builder> = Vec::new();
        let mut jobs: Vec<(usize, u32, BypassJob)> = Vec::new();
        // Every entry of this round sorts after the log records answered so far, which
        // include every older copy of its range (the job holds the range). Not the log's
        // next seq: batches placed but not yet durable are ahead of it, and should the power
        // fail before they are, the next opening hands their seqs out again; a segment entry
        // carrying one of them would then sort after a newer write (FORMAT.md, 5.3).
        let seq = self.sh.retired_seq.load(Ordering::Acquire);
        while let Ok(job) = self.bypass_rx.try_recv() {
            let n = job.data.len() as u64 / BLOCK_U64;
            if !stripe.last().is_some_and(|b| b.fits(n, 1)) {
                if stripe.len() == width {
                    self.bypass_stripe(std::mem::take(&mut stripe), std::mem::take(&mut jobs));
                }
                stripe.push(Builder::new(geo));
            }
            let b = stripe.last_mut().expect("a builder");
            if !b.fits(n, 1) {
                // Larger than a segment: the caller splits, so this is a bug, not input.
                let _ = job.done.send(Err(EngineError::Failed(
                    "a bypass job larger than a segment".into(),
                )));
                continue;
            }
            let crcs: Vec<u32> = job.data.chunks(BLOCK).map(crc32c::crc32c).collect();
            let block = b.used;
            b.add_data(job.layer, job.lba, seq, &job.data, &crcs, Loc::Zero(0));
            jobs.push((stripe.len() - 1, block, job));
        }
        if !jobs.is_empty() {
            self.bypass_stripe(stripe, jobs);
        }
    }

    /// Writes one stripe of bypass jobs and commits it; answers every job.
    fn bypass_stripe(&mut self, stripe: Vec<Builder>, jobs: Vec<(usize, u32, BypassJob)>) {
        let answer = |jobs: Vec<(usize, u32, BypassJob)>, r: &Result<(), EngineError>| {
            for (_, _, j) in jobs {
                let _ = j.done.send(match r {
                    Ok(()) => Ok(()),
                    Err(e) => Err(EngineError::Failed(e.to_string())),
                });
            }
        };
        let placed = match self.place(stripe) {
            Ok(p) => p,
            Err(e) => return answer(jobs, &Err(e)),
        };
        if let Err(e) = write_stripe(&self.sh, &placed) {
            // Like a failed destage (the jobs go through the log instead).
            let segs: Vec<u32> = placed.iter().map(|p| p.0).collect();
            crate::room::failed_segment_write(&self.sh, &segs, &e, "a bypass write");
            return answer(jobs, &Err(e));
        }
        let r = self.commit_bypass(&placed, &jobs);
        answer(jobs, &r);
    }

    fn commit_bypass(
        &mut self,
        placed: &[(u32, Builder, u64)],
        jobs: &[(usize, u32, BypassJob)],
    ) -> Result<(), EngineError> {
        let sh = &*self.sh;
        let live: Vec<(usize, u32, u64, u64, u64)> = {
            let idx = sh.index.read();
            jobs.iter()
                .filter(|(_, _, j)| idx.layer_live(j.layer))
                .map(|(i, block, j)| {
                    let n = j.data.len() as u64 / BLOCK_U64;
                    (*i, *block, u64::from(j.layer), j.lba, n)
                })
                .collect()
        };
        {
            let mut segs = sh.segs.lock();
            for (i, (seg, b, _)) in placed.iter().enumerate() {
                let blocks: u64 = live.iter().filter(|l| l.0 == i).map(|l| l.4).sum();
                segs.seal(*seg, b.used, blocks as u32);
            }
        }
        let sets: Vec<TreeSet> = live
            .iter()
            .map(|&(i, block, layer, lba, n)| TreeSet {
                layer: layer as u32,
                lba,
                len: n,
                loc: Some(Loc::Cap {
                    seg: placed[i].0,
                    block,
                }),
            })
            .collect();
        apply_tree_sets(sh, &sets, false)?;
        let mut displaced = Vec::new();
        {
            let mut idx = sh.index.write();
            for s in &sets {
                if let Some(l) = idx.layers.get_mut(&s.layer) {
                    displaced.extend(l.fast.set(s.lba, s.len, None));
                }
            }
        }
        sh.release(&displaced);
        sh.counters.own_changes.fetch_add(1, Ordering::Release);
        {
            let mut d = sh.durable.lock();
            let tail = sh.log.lock().tail();
            sh.write_checkpoint_locked(&mut d, tail)?;
        }
        let written: u64 = placed.iter().map(|(_, b, _)| u64::from(b.used)).sum();
        sh.counters
            .bypassed_bytes
            .fetch_add(written * BLOCK_U64, Ordering::Relaxed);
        if sh.tree.read().counts().dirty_nodes >= sh.index_dirty_limit {
            meta::flush_index(sh)?;
        }
        Ok(())
    }
}
