//! Log replay at open: every complete batch from the checkpoint's tail, in sequence order,
//! applied to the fast maps.
//!
//! A batch is missing, torn or stale when its header does not decode for the expected
//! sequence number (and an epoch no older than the batch before it): replay ends there. A
//! batch whose header is intact but whose data fails a record's checksum is either torn (one
//! of the last batches in flight, not acknowledged: dropped with everything after it) or damage
//! of the medium under acknowledged data. It is the latter when a later batch records that it
//! was acknowledged (`committed_seq` past it; batches are acknowledged in order), or when a
//! clean shutdown recorded that the log goes on past it; then it is replayed, and the damaged
//! records' blocks read as I/O errors instead of silently as older data. Likewise, a batch
//! that cannot be read at all while a later one records it as acknowledged makes open fail.
//!
//! A batch header that fails its own crc is not given up at once: each record header has a
//! crc of its own, and each record's data its crc, so when every part checks and agrees with
//! the rest (`salvage`) the batch is replayed as written. Only what no check covers cannot be
//! recovered: a batch that cannot be read, with later batches recording it as acknowledged,
//! makes open fail, unless the operator asked to skip such batches
//! (`EngineConfig::skip_damaged_log_batches`): their writes are then lost, and said so.
//!
//! A run of lone writes (FORMAT.md §3.3.1) has two header copies, written in turn; replay
//! takes the newer valid one. Every record of a copy but its last was acknowledged before that
//! copy was written, so only the last can be a torn write in flight: when its data fails and
//! nothing proves it acknowledged, the run is replayed without it, and open clears the copy
//! that names it before anything new is written.

use strata_device::AlignedBuf;

use crate::error::EngineError;
use crate::format::*;
use crate::log::{apply_records, BatchMeta, LogState, RecMeta};
use crate::open_control::{OpenControl, OpenStep};
use crate::shared::Shared;

/// What log replay found.
pub struct Replay {
    pub state: LogState,
    pub batches: usize,
    pub records: usize,
    /// Records whose data failed its checksum but were replayed (their blocks are marked bad).
    pub damaged_records: usize,
    /// The crc of every data block replayed (a damaged record's blocks get one that never matches).
    pub crcs: Vec<(u64, u32)>,
    /// Header copies of runs that name a torn last write, to clear before anything new is
    /// written (`clear_end`): the next write takes that write's place.
    pub stale_copies: Vec<u64>,
    /// First sequence numbers of batches whose header failed its crc but whose parts all
    /// checked (`salvage`): replayed whole. The damaged block stays until the log is destaged
    /// past it (each start reads it the same way until then).
    pub salvaged: Vec<u64>,
    /// Records that could not be read and were skipped at the operator's request.
    pub skipped: Vec<SkippedRecords>,
}

/// Write-log records a start skipped (`EngineConfig::skip_damaged_log_batches`): the writes
/// they held are lost, and the blocks they wrote read as whatever was there before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkippedRecords {
    pub first_seq: u64,
    /// The first sequence number after them.
    pub end_seq: u64,
    /// Log blocks they took (0: at the end of the log, not known).
    pub blocks: u64,
}

/// A batch as found on the device.
struct Found {
    header: BatchHeader,
    data: AlignedBuf,
    /// Records whose data does not match its crc.
    bad_records: Vec<usize>,
    start: u64,
    /// Blocks skipped at the end of the log area (the batch wrapped to the start).
    skip: u64,
}

/// Replays the log from `tail_block`/`tail_seq`. `end_seq` (0: unknown) is where a clean
/// shutdown said the log ends; finding less is an error, not a silent loss. `tail_destaged`
/// is the part of the tail batch already on the capacity tier, which stays out of the fast
/// maps. Replay only reads (and fills the fast maps in memory), so `ctl` may stop it between
/// any two reads.
pub fn replay(
    sh: &Shared,
    tail_block: u64,
    tail_seq: u64,
    end_seq: u64,
    tail_destaged: Option<TailPart>,
    max_epoch: u32,
    ctl: &OpenControl,
) -> Result<Replay, EngineError> {
    let l = sh.layout.log_blocks;
    let skip = sh.cfg.skip_damaged_log_batches;
    let mut state = LogState::new(l, tail_block % l, tail_seq);
    let mut out = Replay {
        state: LogState::new(l, 0, 0),
        batches: 0,
        records: 0,
        damaged_records: 0,
        crcs: Vec::new(),
        stale_copies: Vec::new(),
        salvaged: Vec::new(),
        skipped: Vec::new(),
    };
    let mut epoch = 0;
    loop {
        ctl.progress.enter(OpenStep::Replaying);
        replay_batches(
            sh,
            &mut state,
            &mut out,
            &mut epoch,
            end_seq,
            tail_destaged,
            max_epoch,
            ctl,
        )?;
        ctl.progress.enter(OpenStep::CheckingEnd);
        ctl.reached(OpenStep::CheckingEnd, out.batches);
        let Some((later, at)) = probe_beyond(sh, state.head, state.next_seq, epoch, ctl)? else {
            break;
        };
        if !skip {
            return Err(EngineError::Corrupt(format!(
                "the write log is damaged: the batch expected at sequence {} cannot be read, but a batch with sequence {later} follows it; refusing to open rather than lose acknowledged writes. To open anyway, losing {} (their blocks would read as older data), start once with --skip-damaged-log-batches and check the file systems on the volumes",
                state.next_seq,
                writes_of(state.next_seq, later)
            )));
        }
        out.skipped.push(skip_to(&mut state, later, at)?);
        let lost = out.skipped.last().expect("just pushed");
        tracing::error!(
            first_seq = lost.first_seq,
            end_seq = lost.end_seq,
            blocks = lost.blocks,
            "write log batches that cannot be read were skipped (--skip-damaged-log-batches): the writes they held are lost"
        );
    }
    if end_seq != 0 && state.next_seq < end_seq {
        if !skip {
            return Err(EngineError::Corrupt(format!(
                "the write log is damaged: records {} to {} were acknowledged before the last checkpoint (a clean shutdown, or a pause in writes recorded where the log ended) but cannot be read. To open anyway, losing {} (their blocks would read as older data), start once with --skip-damaged-log-batches and check the file systems on the volumes",
                state.next_seq,
                end_seq - 1,
                writes_of(state.next_seq, end_seq)
            )));
        }
        tracing::error!(
            first_seq = state.next_seq,
            end_seq,
            "write log records acknowledged before the last checkpoint cannot be read and were skipped (--skip-damaged-log-batches): the writes they held are lost"
        );
        out.skipped.push(SkippedRecords {
            first_seq: state.next_seq,
            end_seq,
            blocks: 0,
        });
    }
    out.state = state;
    Ok(out)
}

/// Says that replay drops records `which` of batch `f`, whose data fails its crc and which
/// nothing shows acknowledged: the writes in flight at a crash (never acknowledged), or, if
/// the medium damaged the last acknowledged batch, writes lost; replay cannot tell which.
fn dropped_as_torn(f: &Found, which: std::ops::Range<usize>) {
    let records = &f.header.records[which.clone()];
    let bytes: u64 = records.iter().map(|r| r.data_blocks() * BLOCK_U64).sum();
    tracing::warn!(
        first_seq = f.header.first_seq + which.start as u64,
        records = records.len(),
        bytes,
        "the write log ends with records whose data fails its checksum and that no later batch records as acknowledged: taken as writes in flight at a crash, and dropped"
    );
}

/// The writes of the records from `first` up to `end` (not included), in words.
fn writes_of(first: u64, end: u64) -> String {
    match end - first {
        1 => format!("the write of sequence {first}"),
        _ => format!("the writes of sequences {first} to {}", end - 1),
    }
}

/// Replays batches from `state`'s head until one is missing, torn or stale (see the module
/// comment).
#[allow(clippy::too_many_arguments)]
fn replay_batches(
    sh: &Shared,
    state: &mut LogState,
    out: &mut Replay,
    epoch: &mut u32,
    end_seq: u64,
    tail_destaged: Option<TailPart>,
    max_epoch: u32,
    ctl: &OpenControl,
) -> Result<(), EngineError> {
    loop {
        ctl.check()?;
        let found = match find(sh, state.head, state.next_seq, *epoch)? {
            Some(f) => Some((f, false)),
            None => salvage(sh, state.head, state.next_seq, *epoch, max_epoch)?.map(|f| (f, true)),
        };
        let Some((mut f, salvaged)) = found else {
            break;
        };
        let blocks = u64::from(f.header.total_blocks);
        if state.used_blocks + blocks + f.skip > state.log_blocks {
            break;
        }
        let n = f.header.records.len();
        if f.header.run_copy.is_some() && f.bad_records.contains(&(n - 1)) {
            // Only a run's last write can have been in flight (see the module comment).
            let known = end_seq != 0 && f.header.first_seq + n as u64 - 1 < end_seq;
            if !known && !acknowledged_later(sh, &f)? {
                dropped_as_torn(&f, n - 1..n);
                if n == 1 {
                    break;
                }
                out.stale_copies.push(f.start + copy_offset(&f.header));
                f = without_last(f);
            }
        }
        if !f.bad_records.is_empty() {
            // In a run, every record but the last was acknowledged before its copy was
            // written; the last one is known here to have been (above).
            let known =
                f.header.run_copy.is_some() || (end_seq != 0 && f.header.first_seq < end_seq);
            if !known && !acknowledged_later(sh, &f)? {
                dropped_as_torn(&f, 0..f.header.records.len());
                break;
            }
            tracing::error!(
                first_seq = f.header.first_seq,
                damaged_records = f.bad_records.len(),
                "write log batch with damaged data (the medium, not a torn write): its damaged records' blocks will read as I/O errors"
            );
            sh.checksum_error(0, f.bad_records.len() as u64);
            out.damaged_records += f.bad_records.len();
        }
        if salvaged {
            tracing::error!(
                first_seq = f.header.first_seq,
                records = f.header.records.len(),
                "write log batch header damaged (it fails its checksum); every record header and every record's data checked, so the batch is replayed whole: nothing lost"
            );
            sh.checksum_error(0, 1);
            out.salvaged.push(f.header.first_seq);
        } else {
            // A salvaged header's epoch has no crc of its own: it may not raise the bar for
            // the batches after it.
            *epoch = f.header.epoch;
        }
        let meta = describe(&f, sh.cfg.clock.now_ms(), sh.cfg.clock.unix_s());
        collect_crcs(&f, &meta, &mut out.crcs);
        out.records += meta.records.len();
        out.batches += 1;
        // Live counts are recomputed after replay, so what this displaced needs no accounting.
        match tail_destaged.filter(|_| out.batches == 1) {
            Some(part) => {
                let _ = apply_records(sh, &not_destaged(&meta.records, part));
            }
            None => {
                let _ = apply_records(sh, &meta.records);
            }
        }
        state.push(meta);
        ctl.progress
            .set_log_replayed_bytes(state.used_blocks * BLOCK_U64);
        ctl.reached(OpenStep::Replaying, out.batches);
    }
    Ok(())
}

/// Takes the log from its head up to `at`, where the batch with sequence number `later`
/// starts, as read and holding nothing: the batches there cannot be read. The log then goes
/// on from that batch.
fn skip_to(state: &mut LogState, later: u64, at: u64) -> Result<SkippedRecords, EngineError> {
    let (l, head) = (state.log_blocks, state.head);
    let (start, blocks, skip) = match at {
        at if at > head => (head, at - head, 0),
        0 => (head, l - head, 0),
        at => (0, at, l - head),
    };
    if state.used_blocks + blocks + skip > l {
        return Err(EngineError::Corrupt(format!(
            "the write log is damaged: the batch with sequence {later} at block {at} lies where the log cannot reach from block {head}"
        )));
    }
    let lost = SkippedRecords {
        first_seq: state.next_seq,
        end_seq: later,
        blocks: blocks + skip,
    };
    state.push(BatchMeta {
        start,
        blocks,
        skip,
        first_seq: state.next_seq,
        records: Vec::new().into(),
        durable: true,
        rest_from: (0, 0),
    });
    state.next_seq = later;
    Ok(lost)
}

/// The records of the tail batch less the first part a committed destage stripe took
/// (`Checkpoint::tail_destaged`): the capacity tier holds that part, and its log copy, the
/// same data, must not take its place in the fast maps again (after a crash during a
/// rotation, the tail batch would hold live data again that the rotation did not rewrite, and
/// the log might have no room left to move it). A part that names no record of the batch is
/// ignored: replaying the whole batch is always safe, it only keeps the part in the log.
fn not_destaged(records: &[RecMeta], part: TailPart) -> Vec<RecMeta> {
    let (first, last) = match (records.first(), records.last()) {
        (Some(f), Some(l)) => (f.seq, l.seq),
        _ => return Vec::new(),
    };
    if !(first..=last).contains(&part.seq) {
        tracing::warn!(
            part_seq = part.seq,
            first,
            last,
            "the checkpoint's destaged part of the tail batch names no record of it; replaying the batch whole"
        );
        return records.to_vec();
    }
    records
        .iter()
        .filter_map(|r| {
            let (from, n) = part.rest_of(r.seq, r.nblocks)?;
            let mut r = *r;
            r.lba += from;
            r.nblocks = n;
            r.data_start += from;
            Some(r)
        })
        .collect()
}

/// The batch at `pos`, or at the start of the log area if it wrapped there.
///
/// Both places can hold a batch with the expected sequence number: a torn batch of an earlier
/// opening can stay at `pos` while a later opening, reusing its sequence numbers, wrapped its
/// first batch to block 0 (open clears the block where replay ended, but a crash may come
/// first). The newer epoch wins; within an epoch only one of them can have been written.
fn find(sh: &Shared, pos: u64, seq: u64, min_epoch: u32) -> Result<Option<Found>, EngineError> {
    let l = sh.layout.log_blocks;
    let here = read_batch(sh, pos, seq, min_epoch)?.map(|f| Found {
        start: pos,
        skip: 0,
        ..f
    });
    let wrapped = if pos != 0 {
        read_batch(sh, 0, seq, min_epoch)?.map(|f| Found {
            start: 0,
            skip: l - pos,
            ..f
        })
    } else {
        None
    };
    Ok(match (here, wrapped) {
        (Some(h), Some(w)) if w.header.epoch > h.header.epoch => Some(w),
        (Some(h), _) => Some(h),
        (None, w) => w,
    })
}

/// Clears the block where replay ended, so a torn header of this or an earlier opening is
/// gone before anything new is written (see `find`). Not when the log is full: the head is
/// then the oldest batch's first block. Also clears the header copies that name a torn last
/// write of a run (`Replay::stale_copies`), and a run's second copy left two blocks past the
/// head or past block 0 with the next sequence number: a run the next write may start there
/// must not find an older one's copy in its place.
pub fn clear_end(sh: &Shared, r: &Replay) -> Result<(), EngineError> {
    let state = &r.state;
    let head = state.head;
    let full = state.batches.front().is_some_and(|b| b.start == head);
    let zero = AlignedBuf::new_zeroed(BLOCK);
    if head < sh.layout.log_blocks && !full {
        sh.fast.write_durable_at(&zero, sh.layout.log_byte(head))?;
    }
    let mut hb = AlignedBuf::new_zeroed(BLOCK);
    for p in [head + RUN_SECOND_COPY, RUN_SECOND_COPY] {
        if p >= sh.layout.log_blocks {
            continue;
        }
        sh.fast.read_at(&mut hb, sh.layout.log_byte(p))?;
        if BatchHeader::decode(&hb, &sh.layout.group)
            .is_some_and(|h| h.run_copy == Some(1) && h.first_seq == state.next_seq)
        {
            sh.fast.write_durable_at(&zero, sh.layout.log_byte(p))?;
        }
    }
    for &p in &r.stale_copies {
        sh.fast.write_durable_at(&zero, sh.layout.log_byte(p))?;
    }
    Ok(())
}

/// Where a run's header copy lives, from the run's first block.
fn copy_offset(h: &BatchHeader) -> u64 {
    match h.run_copy {
        Some(1) => RUN_SECOND_COPY,
        _ => 0,
    }
}

/// The run without its last record (a torn write in flight): the header its other copy holds.
fn without_last(mut f: Found) -> Found {
    let h = &mut f.header;
    h.records.pop();
    let n = h.records.len();
    let data: u64 = h.records.iter().map(|r| r.data_blocks()).sum();
    h.total_blocks = batch_total_blocks(true, n, data) as u32;
    h.run_copy = Some(run_copy_for(n));
    f.bad_records.retain(|&i| i < n);
    f
}

/// How many blocks `probe_beyond` reads between two looks at whether the open was stopped.
const PROBE_BLOCKS_PER_CHECK: usize = 64;

/// After replay stopped at `head`: a valid batch a little further on that records the missing
/// batch as acknowledged means it was damaged, not torn. Its sequence number and first block.
fn probe_beyond(
    sh: &Shared,
    head: u64,
    seq: u64,
    min_epoch: u32,
    ctl: &OpenControl,
) -> Result<Option<(u64, u64)>, EngineError> {
    let l = sh.layout.log_blocks;
    // Up to the pipeline's depth of whole batches lie between a batch and the first one that
    // records it as acknowledged; a batch is at most half a segment's data area (whatever
    // batch size the group was last run with).
    let depth = crate::log::PIPELINE_DEPTH as u64 + 1;
    let span = depth * (u64::from(sh.layout.geo.data_blocks) / 2 + 1);
    let max_seq = seq + depth * MAX_RECORDS_PER_BATCH as u64;
    let mut hb = AlignedBuf::new_zeroed(BLOCK);
    let starts = (1..=span)
        .map(|k| head + k)
        .filter(|&p| p < l)
        .chain(0..span.min(head));
    for (i, p) in starts.enumerate() {
        // Thousands of blocks, read one by one.
        if i % PROBE_BLOCKS_PER_CHECK == 0 {
            ctl.check()?;
        }
        sh.fast.read_at(&mut hb, sh.layout.log_byte(p))?;
        if let Some(h) = BatchHeader::decode(&hb, &sh.layout.group) {
            if h.first_seq > seq
                && h.first_seq <= max_seq
                && h.epoch >= min_epoch
                && h.committed_seq > seq
            {
                return Ok(Some((h.first_seq, p)));
            }
        }
    }
    Ok(None)
}

/// Whether one of the batches that follow `f` (each a valid header continuing the sequence)
/// records `f` as acknowledged.
fn acknowledged_later(sh: &Shared, f: &Found) -> Result<bool, EngineError> {
    let l = sh.layout.log_blocks;
    let f_end = f.header.first_seq + f.header.records.len() as u64;
    let (mut pos, mut seq) = ((f.start + u64::from(f.header.total_blocks)) % l, f_end);
    let mut hb = AlignedBuf::new_zeroed(BLOCK);
    for _ in 0..=crate::log::PIPELINE_DEPTH {
        let mut next = None;
        for p in [pos, 0] {
            if let Some(h) = header_at(sh, &mut hb, p, seq, f.header.epoch)? {
                next = Some((p, h));
                break;
            }
        }
        let Some((p, h)) = next else { return Ok(false) };
        if h.committed_seq >= f_end {
            return Ok(true);
        }
        pos = (p + u64::from(h.total_blocks)) % l;
        seq = h.first_seq + h.records.len() as u64;
    }
    Ok(false)
}

/// The batch at `pos` (or at the start of the log area if it wrapped there) whose header
/// block fails its crc but whose parts all check (`BatchHeader::decode_parts`): the batch
/// starts with `seq`, its epoch lies between the previous batch's and the newest any batch
/// can have, it ends inside the log area, and every record's data matches its crc. A run of
/// lone writes is not salvaged: it has a second header copy of its own.
fn salvage(
    sh: &Shared,
    pos: u64,
    seq: u64,
    min_epoch: u32,
    max_epoch: u32,
) -> Result<Option<Found>, EngineError> {
    let l = sh.layout.log_blocks;
    let mut hb = AlignedBuf::new_zeroed(BLOCK);
    let starts = std::iter::once((pos, 0)).chain((pos != 0).then_some((0, l - pos)));
    for (start, skip) in starts {
        sh.fast.read_at(&mut hb, sh.layout.log_byte(start))?;
        let Some(header) = BatchHeader::decode_parts(&hb, &sh.layout.group) else {
            continue;
        };
        if header.first_seq != seq
            || header.run_copy.is_some()
            || !(min_epoch..=max_epoch).contains(&header.epoch)
            || start + u64::from(header.total_blocks) > l
        {
            continue;
        }
        let data = read_data(sh, start, &header)?;
        if !bad_records(&header, &data, true).is_empty() {
            continue;
        }
        return Ok(Some(Found {
            header,
            data,
            bad_records: Vec::new(),
            start,
            skip,
        }));
    }
    Ok(None)
}

/// The data blocks of the batch at `pos` whose header is `header`.
fn read_data(sh: &Shared, pos: u64, header: &BatchHeader) -> Result<AlignedBuf, EngineError> {
    let data_blocks = u64::from(header.total_blocks) - 1;
    let mut data = AlignedBuf::new_zeroed((data_blocks * BLOCK_U64) as usize);
    if data_blocks > 0 {
        sh.fast.read_at(&mut data, sh.layout.log_byte(pos + 1))?;
    }
    Ok(data)
}

/// The records whose data fails its crc: host writes', or with `all` read-cache copies' too.
fn bad_records(header: &BatchHeader, data: &[u8], all: bool) -> Vec<usize> {
    let mut bad = Vec::new();
    for (i, (r, at)) in header.records.iter().zip(data_offsets(header)).enumerate() {
        let at = ((at - 1) * BLOCK_U64) as usize;
        let len = (r.data_blocks() * BLOCK_U64) as usize;
        let checked = r.kind == RecordKind::Write || (all && len > 0);
        if checked && crc32c::crc32c(&data[at..at + len]) != r.data_crc {
            bad.push(i);
        }
    }
    bad
}

/// Reads the batch at `pos` if its header is valid, of this group, starts with `seq` and is
/// of epoch `min_epoch` or later; notes which records' data fails its crc.
fn read_batch(
    sh: &Shared,
    pos: u64,
    seq: u64,
    min_epoch: u32,
) -> Result<Option<Found>, EngineError> {
    let mut hb = AlignedBuf::new_zeroed(BLOCK);
    let Some(header) = header_at(sh, &mut hb, pos, seq, min_epoch)? else {
        return Ok(None);
    };
    let data = read_data(sh, pos, &header)?;
    Ok(Some(Found {
        bad_records: bad_records(&header, &data, false),
        header,
        data,
        start: pos,
        skip: 0,
    }))
}

/// The header of the batch at `pos` if it is valid, of this group, starts with `seq`, is of
/// epoch `min_epoch` or later and ends inside the log area. A run's two copies are both read
/// (either may be torn): the newer epoch wins, then the copy with more records.
fn header_at(
    sh: &Shared,
    hb: &mut AlignedBuf,
    pos: u64,
    seq: u64,
    min_epoch: u32,
) -> Result<Option<BatchHeader>, EngineError> {
    let l = sh.layout.log_blocks;
    let mut read = |p: u64, copy: Option<u32>| -> Result<Option<BatchHeader>, EngineError> {
        if p >= l {
            return Ok(None);
        }
        sh.fast.read_at(hb, sh.layout.log_byte(p))?;
        Ok(BatchHeader::decode(hb, &sh.layout.group).filter(|h| {
            h.first_seq == seq
                && h.epoch >= min_epoch
                && pos + u64::from(h.total_blocks) <= l
                && h.run_copy.is_none_or(|c| Some(c) == copy)
        }))
    };
    let first = read(pos, Some(0))?;
    if first.as_ref().is_some_and(|h| h.run_copy.is_none()) {
        return Ok(first);
    }
    let second = read(pos + RUN_SECOND_COPY, Some(1))?.filter(|h| h.run_copy.is_some());
    Ok(match (first, second) {
        (Some(a), Some(b)) => Some(if (b.epoch, b.records.len()) > (a.epoch, a.records.len()) {
            b
        } else {
            a
        }),
        (a, b) => a.or(b),
    })
}

/// Where each record's data starts, in blocks from the batch's first block.
fn data_offsets(h: &BatchHeader) -> Vec<u64> {
    let run = h.run_copy.is_some();
    let mut before = 0;
    h.records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let at = record_data_offset(run, i, before);
            before += r.data_blocks();
            at
        })
        .collect()
}

/// The replayed batch as the log state holds it. Its data is as old as the batch's time
/// stamp says (so a tier-mode volume's data does not start its minimum age again at every
/// start), or new when the batch has none, or one later than now (the clock was set back).
fn describe(f: &Found, now_ms: u64, unix_now_s: u64) -> BatchMeta {
    let offsets = data_offsets(&f.header);
    let written = u64::from(f.header.written_unix_s);
    let born_ms = match written {
        0 => now_ms,
        s if s >= unix_now_s => now_ms,
        s => now_ms.saturating_sub((unix_now_s - s).saturating_mul(1000)),
    };
    let mut records = Vec::with_capacity(f.header.records.len());
    for (i, r) in f.header.records.iter().enumerate() {
        records.push(RecMeta {
            kind: r.kind,
            layer: r.layer,
            lba: r.offset_bytes / BLOCK_U64,
            nblocks: r.len_bytes / BLOCK_U64,
            seq: f.header.first_seq + i as u64,
            data_start: f.start + offsets[i],
            relocation: false,
            born_ms,
            aged_from_ms: born_ms,
            cache_gen: 0,
            vol: 0,
            cache_copy: crate::log::CacheCopy::Again,
        });
    }
    BatchMeta {
        start: f.start,
        blocks: u64::from(f.header.total_blocks),
        skip: f.skip,
        first_seq: f.header.first_seq,
        records: records.into(),
        durable: true,
        rest_from: (0, 0),
    }
}

/// The crc of each data block; blocks of damaged records get the complement of their crc,
/// which never matches, so reading them is an error.
fn collect_crcs(f: &Found, meta: &BatchMeta, out: &mut Vec<(u64, u32)>) {
    let mut bad_blocks = Vec::new();
    for &i in &f.bad_records {
        let r = &meta.records[i];
        bad_blocks.push(r.data_start..r.data_start + r.nblocks);
    }
    for r in meta
        .records
        .iter()
        .filter(|r| matches!(r.kind, RecordKind::Write | RecordKind::Cache))
    {
        for b in r.data_start..r.data_start + r.nblocks {
            let at = ((b - f.start - 1) * BLOCK_U64) as usize;
            let crc = crc32c::crc32c(&f.data[at..at + BLOCK]);
            let damaged = bad_blocks.iter().any(|r| r.contains(&b));
            out.push((b, if damaged { !crc } else { crc }));
        }
    }
}
