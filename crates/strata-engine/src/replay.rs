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

use strata_device::AlignedBuf;

use crate::error::EngineError;
use crate::format::*;
use crate::log::{apply_records, BatchMeta, LogState, RecMeta};
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
/// shutdown said the log ends; finding less is an error, not a silent loss.
pub fn replay(
    sh: &Shared,
    tail_block: u64,
    tail_seq: u64,
    end_seq: u64,
) -> Result<Replay, EngineError> {
    let l = sh.layout.log_blocks;
    let mut state = LogState::new(l, tail_block % l, tail_seq);
    let mut out = Replay {
        state: LogState::new(l, 0, 0),
        batches: 0,
        records: 0,
        damaged_records: 0,
        crcs: Vec::new(),
    };
    let mut epoch = 0;
    while let Some(f) = find(sh, state.head, state.next_seq, epoch)? {
        let blocks = u64::from(f.header.total_blocks);
        if state.used_blocks + blocks + f.skip > l {
            break;
        }
        if !f.bad_records.is_empty() {
            let known = end_seq != 0 && f.header.first_seq < end_seq;
            if !known && !acknowledged_later(sh, &f)? {
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
        epoch = f.header.epoch;
        let meta = describe(&f, sh.cfg.clock.now_ms());
        collect_crcs(&f, &meta, &mut out.crcs);
        out.records += meta.records.len();
        out.batches += 1;
        // Live counts are recomputed after replay, so what this displaced needs no accounting.
        let _ = apply_records(sh, &meta.records);
        state.push(meta);
    }
    if let Some(later) = probe_beyond(sh, state.head, state.next_seq, epoch)? {
        return Err(EngineError::Corrupt(format!(
            "the write log is damaged: the batch expected at sequence {} cannot be read, but a batch with sequence {later} follows it; refusing to open rather than lose acknowledged writes",
            state.next_seq
        )));
    }
    if end_seq != 0 && state.next_seq < end_seq {
        return Err(EngineError::Corrupt(format!(
            "the write log is damaged: records {} to {} were written before the last clean shutdown but cannot be read",
            state.next_seq,
            end_seq - 1
        )));
    }
    out.state = state;
    Ok(out)
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
/// then the oldest batch's first block.
pub fn clear_end(sh: &Shared, state: &LogState) -> Result<(), EngineError> {
    let head = state.head;
    let full = state.batches.front().is_some_and(|b| b.start == head);
    if head < sh.layout.log_blocks && !full {
        let zero = AlignedBuf::new_zeroed(BLOCK);
        sh.fast.write_durable_at(&zero, sh.layout.log_byte(head))?;
    }
    Ok(())
}

/// After replay stopped at `head`: a valid batch a little further on that records the missing
/// batch as acknowledged means it was damaged, not torn.
fn probe_beyond(
    sh: &Shared,
    head: u64,
    seq: u64,
    min_epoch: u32,
) -> Result<Option<u64>, EngineError> {
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
    for p in starts {
        sh.fast.read_at(&mut hb, sh.layout.log_byte(p))?;
        if let Some(h) = BatchHeader::decode(&hb, &sh.layout.group) {
            if h.first_seq > seq
                && h.first_seq <= max_seq
                && h.epoch >= min_epoch
                && h.committed_seq > seq
            {
                return Ok(Some(h.first_seq));
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
            sh.fast.read_at(&mut hb, sh.layout.log_byte(p))?;
            if let Some(h) = BatchHeader::decode(&hb, &sh.layout.group)
                .filter(|h| h.first_seq == seq && h.epoch >= f.header.epoch)
            {
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

/// Reads the batch at `pos` if its header is valid, of this group, starts with `seq` and is
/// of epoch `min_epoch` or later; notes which records' data fails its crc.
fn read_batch(
    sh: &Shared,
    pos: u64,
    seq: u64,
    min_epoch: u32,
) -> Result<Option<Found>, EngineError> {
    let l = sh.layout.log_blocks;
    if pos >= l {
        return Ok(None);
    }
    let mut hb = AlignedBuf::new_zeroed(BLOCK);
    sh.fast.read_at(&mut hb, sh.layout.log_byte(pos))?;
    let Some(header) = BatchHeader::decode(&hb, &sh.layout.group) else {
        return Ok(None);
    };
    if header.first_seq != seq
        || header.epoch < min_epoch
        || pos + u64::from(header.total_blocks) > l
    {
        return Ok(None);
    }
    let data_blocks = u64::from(header.total_blocks) - 1;
    let mut data = AlignedBuf::new_zeroed((data_blocks * BLOCK_U64) as usize);
    if data_blocks > 0 {
        sh.fast.read_at(&mut data, sh.layout.log_byte(pos + 1))?;
    }
    let mut bad_records = Vec::new();
    let mut at = 0usize;
    for (i, r) in header.records.iter().enumerate() {
        let len = (r.data_blocks() * BLOCK_U64) as usize;
        if r.kind == RecordKind::Write && crc32c::crc32c(&data[at..at + len]) != r.data_crc {
            bad_records.push(i);
        }
        at += len;
    }
    Ok(Some(Found {
        header,
        data,
        bad_records,
        start: pos,
        skip: 0,
    }))
}

fn describe(f: &Found, now_ms: u64) -> BatchMeta {
    let mut data_at = f.start + 1;
    let mut records = Vec::with_capacity(f.header.records.len());
    for (i, r) in f.header.records.iter().enumerate() {
        records.push(RecMeta {
            kind: r.kind,
            layer: r.layer,
            lba: r.offset_bytes / BLOCK_U64,
            nblocks: r.len_bytes / BLOCK_U64,
            seq: f.header.first_seq + i as u64,
            data_start: data_at,
            relocation: false,
            born_ms: now_ms,
            aged_from_ms: now_ms,
            cache_gen: 0,
            vol: 0,
        });
        data_at += r.data_blocks();
    }
    BatchMeta {
        start: f.start,
        blocks: u64::from(f.header.total_blocks),
        skip: f.skip,
        first_seq: f.header.first_seq,
        records: records.into(),
        durable: true,
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
    for (i, chunk) in f.data.chunks(BLOCK).enumerate() {
        let b = f.start + 1 + i as u64;
        let crc = crc32c::crc32c(chunk);
        let damaged = bad_blocks.iter().any(|r| r.contains(&b));
        out.push((b, if damaged { !crc } else { crc }));
    }
}
