//! Rotation of a full log (docs/FORMAT.md §4.7). With the capacity tier taking nothing and a
//! tail too live to compact, the blocks trims and overwrites make dead may lie anywhere behind
//! the tail, which only moves once everything live in a batch has moved. Rotation writes the
//! tail's live data (and its zero records still in effect) again at the head, as compaction
//! does, whatever share of it is live, so the tail walks round the log to the dead blocks and
//! frees them. It uses the log's last blocks, which nothing else may take
//! (`log::rotation_reserve_blocks`), and runs only where a plan over one lap of the log shows
//! room coming back: a log with nothing dead is never rewritten.

use super::*;
use crate::log::NO_DATA_RESERVE_BLOCKS;

/// Room a rotation for trims must give back, at least, unless trims have no block left at all
/// (then any room is worth it): each such rotation may rewrite a lap of the log.
const MIN_GAIN_BLOCKS: u64 = 8;
/// Data writes get room back only where rotation rewrites at most this many blocks for each
/// block it frees. Trims, the way space comes back, get room at any cost within one lap.
const MAX_COST_PER_DATA_BLOCK: u64 = 16;
/// Groups of batches one call rotates at most (each ends with a checkpoint), so the
/// destager's other work comes round.
const GROUPS_PER_CALL: usize = 16;
/// Rewrite requests of one group at most: all are queued before the log writer batches them,
/// and its queue holds 1024.
const MAX_GROUP_PIECES: usize = 256;
/// After a tail block could not be read or failed its crc, rotation tries again this much
/// later even if the log has not changed: a read may fail for a while (a loose cable) and
/// then succeed, and meanwhile nothing else may change the log (trims get no room).
const DAMAGED_RETRY: Duration = Duration::from_secs(1);

/// What a batch's live content is, as rotation would write it again: the data blocks of each
/// live run, and the number of zero-record pieces still in effect.
struct Pieces {
    data: Vec<u64>,
    zeros: usize,
}

/// How many tail batches to rotate, and the free log blocks that is planned to leave.
pub(super) struct Plan {
    batches: usize,
    goal_free: u64,
}

/// Log blocks the records of `sizes` (data blocks each, in order) take when the log writer
/// batches them as it gathers (`LogWriter::gather_from`): up to `max_batch_blocks` blocks and
/// `MAX_RECORDS_PER_BATCH` records a batch, a header block each.
fn batched_blocks(sizes: impl Iterator<Item = u64>, max_batch_blocks: u64) -> u64 {
    let (mut total, mut blocks, mut records) = (0, 0, 0);
    for n in sizes {
        if records == 0 || records == MAX_RECORDS_PER_BATCH || blocks + n > max_batch_blocks {
            total += 1;
            blocks = 1;
            records = 0;
        }
        total += n;
        blocks += n;
        records += 1;
    }
    total
}

/// Blocks a rewrite of `cost` blocks (`max_batch` a batch at most) may leave unused at the end
/// of the log area, `to_end` blocks from the head, when hosts' batches, `before` blocks at
/// most, come between its own. A batch skips to the start only when it does not fit before
/// the end (`LogState::place`): none does when the rewrite and those batches all fit; else
/// it skips fewer blocks than it takes: one of rotation's batches is at most `max_batch`
/// blocks and at most the whole rewrite. (A small rewrite, such as what is left of a group
/// a power cut stopped, is not refused for a skip only a whole batch could make. Nor is a
/// rewrite that fits before the end: counting a skip there left a log whose free blocks,
/// under the reserve after an earlier wrap, lay before the end, stopped for good.)
fn wrap_skip(to_end: u64, cost: u64, max_batch: u64, before: u64) -> u64 {
    if cost + before <= to_end {
        return 0;
    }
    to_end.min(cost.min(max_batch).saturating_sub(1))
}

impl Pieces {
    fn of(sh: &Shared, b: &BatchMeta) -> Pieces {
        Pieces {
            data: live_runs(sh, b).iter().map(|r| r.2).collect(),
            zeros: live_zero_records(sh, b).len(),
        }
    }

    fn count(&self) -> usize {
        self.data.len() + self.zeros
    }

    /// Log blocks rotation writes for these pieces (data first, then zero records, as
    /// `rotate_group` sends them; counted in batches of their own, an upper bound).
    fn cost(&self, max_batch_blocks: u64) -> u64 {
        batched_blocks(self.data.iter().copied(), max_batch_blocks)
            + batched_blocks(std::iter::repeat_n(0, self.zeros), max_batch_blocks)
    }

    fn extend(&mut self, other: Pieces) {
        self.data.extend(other.data);
        self.zeros += other.zeros;
    }
}

/// The shortest rotation after which data writes have room (`data_room` free blocks), within
/// `MAX_COST_PER_DATA_BLOCK`. `lap` is each batch's (blocks freed, blocks written), tail first.
fn plan_for_data(lap: &[(u64, u64)], free: u64, data_room: u64) -> Option<Plan> {
    let (mut gain, mut spent) = (0i64, 0u64);
    for (i, &(freed, cost)) in lap.iter().enumerate() {
        gain += freed as i64 - cost as i64;
        spent += cost;
        if gain > 0
            && free + gain as u64 >= data_room
            && spent <= MAX_COST_PER_DATA_BLOCK * gain as u64
        {
            return Some(Plan {
                batches: i + 1,
                goal_free: data_room,
            });
        }
    }
    None
}

/// The shortest rotation within the lap after which trims have their whole reserve again
/// (`trims_room` free blocks), or else the one that gives back most, if that is worth a lap
/// (`MIN_GAIN_BLOCKS`, or any block when trims have none left: `free <= reserve`).
fn plan_for_trims(lap: &[(u64, u64)], free: u64, trims_room: u64, reserve: u64) -> Option<Plan> {
    if free >= trims_room {
        return None;
    }
    let need = (trims_room - free) as i64;
    let (mut gain, mut best) = (0i64, (0i64, 0usize));
    for (i, &(freed, cost)) in lap.iter().enumerate() {
        gain += freed as i64 - cost as i64;
        if gain >= need {
            return Some(Plan {
                batches: i + 1,
                goal_free: trims_room,
            });
        }
        if gain > best.0 {
            best = (gain, i + 1);
        }
    }
    let enough = if free <= reserve {
        1
    } else {
        MIN_GAIN_BLOCKS as i64
    };
    (best.0 >= enough).then(|| Plan {
        batches: best.1,
        goal_free: free + best.0 as u64,
    })
}

/// How a group's rotation went.
enum Rotated {
    /// Its first batches are freed (how many).
    Freed(usize),
    /// A host holds some of its blocks, or they changed under it: nothing was written.
    Busy,
    /// A block of it could not be read, or failed its crc: only destage may move it.
    Damaged,
    /// It cannot be rotated as the log is (no room for it, or the tail still live after its
    /// rewrites).
    Stuck,
}

/// The log as it was when rotation found nothing it could do (`rotation_fingerprint`): it
/// is not tried again until the log changes, or, after a damaged block, until `retry_at`.
pub(super) struct Fruitless {
    print: (u64, u64, u64, u64),
    retry_at: Option<Instant>,
}

impl Destager {
    /// Frees log room by rotation when a plan shows room coming back (see the module's
    /// comment). Returns whether any was freed.
    pub(super) fn rotate_tail(&mut self) -> Result<bool, EngineError> {
        let plan = match self.under_pressure() {
            true => self.rotation_plan(),
            false => None,
        };
        let Some(plan) = plan else {
            self.set_rotation_goal(0);
            return Ok(false);
        };
        // The capacity tier takes nothing: hosts are told so (`Shared::wait_for_rotation`).
        self.sh
            .counters
            .capacity_full
            .store(true, Ordering::Relaxed);
        self.set_rotation_goal(plan.goal_free);
        let mut rotated = 0;
        for _ in 0..GROUPS_PER_CALL {
            if rotated >= plan.batches || self.sh.log.lock().free_blocks() >= plan.goal_free {
                break;
            }
            let outcome = self.rotate_group(plan.batches - rotated)?;
            match outcome {
                Rotated::Freed(n) => rotated += n,
                // Tried again at the next call (the goal stays: hosts go on waiting).
                Rotated::Busy => break,
                Rotated::Stuck | Rotated::Damaged => {
                    let damaged = matches!(outcome, Rotated::Damaged);
                    self.rotation_fruitless = Some(Fruitless {
                        print: self.rotation_fingerprint(),
                        retry_at: damaged.then(|| Instant::now() + DAMAGED_RETRY),
                    });
                    self.set_rotation_goal(0);
                    break;
                }
            }
        }
        Ok(rotated > 0)
    }

    /// Publishes a plan's goal (0: none) to hosts waiting for rotation, and counts the plan.
    fn set_rotation_goal(&self, free_blocks: u64) {
        let c = &self.sh.counters;
        c.rotation_goal_blocks.store(free_blocks, Ordering::Relaxed);
        c.rotation_plans.fetch_add(1, Ordering::Release);
        // Hosts waiting for rotation look again (and go on if it aims lower).
        self.sh.log_space_freed();
    }

    /// What the log looks like to a plan: a plan that found nothing to gain is not made again
    /// until this changes (new records, the tail moved, live data dropped).
    fn rotation_fingerprint(&self) -> (u64, u64, u64, u64) {
        let log = self.sh.log.lock();
        let live = self.sh.counters.fast_live_blocks.load(Ordering::Relaxed);
        (log.next_seq, log.tail().1, log.used_blocks, live)
    }

    /// A rotation worth making now, if any: room for a data batch within
    /// `MAX_COST_PER_DATA_BLOCK`, else room for trims (`plan_for_trims`). Looks at every
    /// durable batch (one lap), so it is made again only when the log has changed (or, after
    /// a damaged block stopped rotation, once `DAMAGED_RETRY` has passed).
    fn rotation_plan(&mut self) -> Option<Plan> {
        let print = self.rotation_fingerprint();
        let again = |f: &Fruitless| f.retry_at.is_some_and(|t| Instant::now() >= t);
        if self
            .rotation_fruitless
            .as_ref()
            .is_some_and(|f| f.print == print && !again(f))
        {
            return None;
        }
        let (free, reserve) = {
            let log = self.sh.log.lock();
            (log.free_blocks(), log.rotation_reserve_blocks)
        };
        let max_batch = crate::log::max_batch_blocks(self.sh.cfg.max_batch_bytes);
        let trims_room = reserve + NO_DATA_RESERVE_BLOCKS;
        let data_room = trims_room + max_batch + 1;
        if free >= data_room {
            return None;
        }
        let batches: Vec<BatchMeta> = {
            let log = self.sh.log.lock();
            log.batches
                .iter()
                .take_while(|b| b.durable)
                .cloned()
                .collect()
        };
        let lap: Vec<(u64, u64)> = batches
            .iter()
            .map(|b| (b.blocks + b.skip, Pieces::of(&self.sh, b).cost(max_batch)))
            .collect();
        let plan = plan_for_data(&lap, free, data_room)
            .or_else(|| plan_for_trims(&lap, free, trims_room, reserve));
        if plan.is_none() {
            self.rotation_fruitless = Some(Fruitless {
                print,
                retry_at: None,
            });
        }
        plan
    }

    /// Rotates the oldest batches, at most `max_batches`, as many as the room rotation may
    /// count on takes: every live run and zero piece of theirs is claimed (all or none) and
    /// written again at the head as rotation's requests, batched whole; then the tail moves
    /// past them.
    fn rotate_group(&mut self, max_batches: usize) -> Result<Rotated, EngineError> {
        let mut batches = self.durable_batches(0);
        batches.truncate(max_batches);
        let n = self.group_size(&batches);
        if n == 0 {
            return Ok(Rotated::Stuck);
        }
        let group = &batches[..n];
        let reqs = match self.claim_group(group) {
            Ok(reqs) => reqs,
            Err(why) => return Ok(why),
        };
        let c = &self.sh.counters;
        // The log writer gathers them whole: a batch cut short costs a header more.
        c.rotation_queueing.store(true, Ordering::Release);
        let queued = reqs.len();
        let mut waits = Vec::with_capacity(reqs.len());
        for (req, wait) in reqs {
            // A refusal (the queue full) drops the request and its claim; the tail then stays.
            if self.tx.try_send(req).is_ok() {
                waits.push(wait);
            }
            #[cfg(test)]
            if waits.len() == 1 {
                if let Some(pause) = *self.sh.rotation_queue_pause.lock() {
                    std::thread::sleep(pause);
                }
            }
        }
        c.rotation_queueing.store(false, Ordering::Release);
        let mut refused = waits.len() < queued;
        for wait in waits {
            // A refused rewrite leaves the old copy live: the tail stays where it is.
            refused |= wait.wait().is_err();
        }
        let empty = group
            .iter()
            .take_while(|b| {
                live_runs(&self.sh, b).is_empty() && live_zero_records(&self.sh, b).is_empty()
            })
            .count();
        if empty == 0 {
            // The group ends unfinished: what it wrote counts for every batch. When a request
            // of it was refused (the log writer's queue full, or its batch without room), the
            // rotation is planned afresh at the next call: marked fruitless, it would not be
            // looked at again until the log changed, which with trims refused it may not.
            self.sh.log.lock().rotation_outstanding_blocks = 0;
            return Ok(if refused {
                Rotated::Busy
            } else {
                Rotated::Stuck
            });
        }
        // Cached copies in these batches are dropped (`advance_tail` forgets them): the data
        // is on the capacity tier, and writing copies again would take rotation's room.
        self.advance_tail(empty, None)?;
        c.rotated_batches.fetch_add(empty as u64, Ordering::Relaxed);
        Ok(Rotated::Freed(empty))
    }

    /// How many of the oldest `batches` one group rotates: as many as fit the room rotation
    /// may count on (every other batch leaves its reserve free, so that much stays whatever
    /// hosts write meanwhile) and `MAX_GROUP_PIECES`.
    fn group_size(&self, batches: &[BatchMeta]) -> usize {
        let max_batch = crate::log::max_batch_blocks(self.sh.cfg.max_batch_bytes);
        let (room, to_end, before) = {
            let log = self.sh.log.lock();
            // While the head is past the tail, a rewrite that does not fit before the end of
            // the log area skips to its start, leaving the blocks before the end unused (for
            // a lap); below the tail, the free blocks are all in one piece.
            let to_end = match log.batches.front() {
                Some(f) if log.head > f.start => log.log_blocks - log.head,
                _ => 0,
            };
            let free = log.free_blocks();
            let reserve = log.rotation_reserve_blocks;
            // Hosts may take what is free beyond the reserve while the group is written.
            (free.min(reserve), to_end, free.saturating_sub(reserve))
        };
        let mut group = Pieces {
            data: Vec::new(),
            zeros: 0,
        };
        let mut n = 0;
        for b in batches {
            group.extend(Pieces::of(&self.sh, b));
            let cost = group.cost(max_batch);
            let skip = wrap_skip(to_end, cost, max_batch, before);
            if cost + skip > room || group.count() > MAX_GROUP_PIECES {
                break;
            }
            n += 1;
        }
        n
    }

    /// The rewrite of every live run, then every zero piece, of `group`, each holding its
    /// range; or why not (nothing claimed then).
    fn claim_group(
        &self,
        group: &[BatchMeta],
    ) -> Result<Vec<(WriteReq, crate::log::ReplyRx)>, Rotated> {
        let mut reqs = Vec::new();
        for b in group {
            let runs = live_runs(&self.sh, b);
            if runs.is_empty() {
                continue;
            }
            let mut buf = AlignedBuf::new_zeroed((b.blocks * BLOCK_U64) as usize);
            let at = self.sh.layout.log_byte(b.start);
            if self.sh.fast.read_at(&mut buf, at).is_err() {
                return Err(Rotated::Damaged);
            }
            #[cfg(test)]
            if let Some(hook) = self.sh.after_rotation_read.lock().clone() {
                let read: Vec<(u32, u64, u64)> = runs
                    .iter()
                    .map(|&(i, off, len)| (b.records[i].layer, b.records[i].lba + off, len))
                    .collect();
                hook(&read);
            }
            for (i, off, len) in runs {
                let r = &b.records[i];
                let run = Rewrite {
                    layer: r.layer,
                    lba: r.lba + off,
                    len,
                    from: r.data_start + off,
                    born_ms: r.born_ms,
                };
                let first = ((run.from - b.start) * BLOCK_U64) as usize;
                let bytes = &mut buf[first..first + (len * BLOCK_U64) as usize];
                // A block read wrong in passing is read again (reread.rs); one that stays
                // wrong stops the rotation, which tries again later (`DAMAGED_RETRY`).
                let intact = crate::reread::mend_log(&self.sh, run.from, bytes).is_empty();
                if !intact {
                    // Only destage may move it (keeping its crc): rotation cannot pass it.
                    return Err(Rotated::Damaged);
                }
                reqs.push(self.rewrite(&run, bytes, true).ok_or(Rotated::Busy)?);
            }
        }
        for b in group {
            for z in live_zero_records(&self.sh, b) {
                reqs.push(self.zero_rewrite(&z, true).ok_or(Rotated::Busy)?);
            }
        }
        Ok(reqs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_blocks_counts_a_header_per_batch_as_the_log_writer_gathers() {
        assert_eq!(batched_blocks([].into_iter(), 64), 0);
        assert_eq!(batched_blocks([63].into_iter(), 64), 64);
        assert_eq!(batched_blocks([40, 23].into_iter(), 64), 64);
        assert_eq!(batched_blocks([40, 24].into_iter(), 64), 66);
        assert_eq!(batched_blocks(std::iter::repeat_n(0, 62), 64), 1);
        assert_eq!(batched_blocks(std::iter::repeat_n(0, 63), 64), 2);
    }

    /// Rotation's skips when a rewrite of `cost` blocks goes in batches of `max_batch` at
    /// most, `to_end` blocks before the end of a 1000-block log area whose only batch starts
    /// at 500, and a host batch of `before` blocks comes ahead of its `host_at`-th batch.
    fn rewrite_skips(to_end: u64, cost: u64, max_batch: u64, before: u64, host_at: u64) -> u64 {
        let log_blocks = 1000;
        let mut log = crate::log::LogState::new(log_blocks, 500, 1);
        let push = |log: &mut crate::log::LogState, blocks: u64| {
            let (start, skip) = log.place(blocks).expect("room before the tail");
            let first_seq = log.next_seq;
            log.push(BatchMeta {
                start,
                blocks,
                skip,
                first_seq,
                records: Vec::new().into(),
                durable: true,
                rest_from: (0, 0),
            });
            skip
        };
        push(&mut log, log_blocks - 500 - to_end);
        assert_eq!(log.head, (log_blocks - to_end) % log_blocks);
        let (mut left, mut skipped, mut k) = (cost, 0, 0);
        while left > 0 || (k <= host_at && before > 0) {
            if k == host_at && before > 0 {
                push(&mut log, before);
            }
            if left > 0 {
                let n = left.min(max_batch);
                skipped += push(&mut log, n);
                left -= n;
            }
            k += 1;
        }
        skipped
    }

    /// Whatever the head's distance from the end of the log area and wherever hosts' batches
    /// (up to `before` blocks) come, a rewrite in batches of rotation's (at most `max_batch`
    /// blocks) skips no more than `wrap_skip` counts, and nothing when all fit before the end.
    #[test]
    fn a_rewrite_skips_no_more_than_counted() {
        let max_batch = 64;
        for to_end in 0..=160 {
            for cost in 0..=2 * max_batch {
                for before in [0, 1, 20, 70] {
                    let counted = wrap_skip(to_end, cost, max_batch, before);
                    for host_at in 0..3 {
                        let skip = rewrite_skips(to_end, cost, max_batch, before, host_at);
                        assert!(
                            skip <= counted,
                            "{to_end} blocks to the end, a rewrite of {cost}, hosts {before} \
                             before batch {host_at}: skips {skip}, counted {counted}"
                        );
                    }
                }
            }
        }
        // Fewer than a whole batch, for a small rewrite near the end.
        assert_eq!(wrap_skip(50, 60, max_batch, 0), 50);
        assert_eq!(wrap_skip(5, 10, max_batch, 0), 5);
        assert_eq!(wrap_skip(200, 1000, max_batch, 0), 63);
        // Nothing when the rewrite and what hosts may take fit before the end.
        assert_eq!(wrap_skip(171, 64, max_batch, 0), 0);
        assert_eq!(wrap_skip(171, 64, max_batch, 108), 63);
    }

    #[test]
    fn an_all_live_lap_gives_no_plan() {
        // Batches of 64 blocks, all live: each costs what it frees.
        let lap = vec![(64, 64); 40];
        assert!(plan_for_data(&lap, 150, 211).is_none());
        assert!(plan_for_trims(&lap, 130, 147, 131).is_none());
    }

    #[test]
    fn trims_get_room_back_from_dead_blocks_behind_the_tail() {
        let mut lap = vec![(64, 64); 30];
        lap.extend(vec![(64, 60); 5]);
        // Trims have no block left: the 20 dead blocks come back, a lap away.
        let p = plan_for_trims(&lap, 131, 147, 131).expect("a plan");
        assert_eq!((p.batches, p.goal_free), (34, 147));
        // Far too costly for data writes (1,900 blocks written for 20).
        assert!(plan_for_data(&lap, 131, 211).is_none());
    }
}
