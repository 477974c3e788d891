//! A capacity device out of room: the file system under a sparse capacity file is full (or
//! its quota used up). Nothing is wrong with the device, and writes succeed again as soon as
//! the administrator makes room, so this is not handled like a media error:
//!
//! - the segments a failed write took are given back (and their blocks discarded, which gives
//!   the file system what the write did take), not set aside until the next open: a full file
//!   system would otherwise use up every free segment in a few seconds, one failed write each,
//!   and leave the tier looking full until a restart;
//! - the destager pauses its capacity writes (destage, GC, index flushes), trying again after
//!   1 s, then after twice as long each time, up to `RETRY_MAX`: no error logged ten times a
//!   second, no index-page places used up by flushes that fail; meanwhile it still makes room
//!   in a full log as for a full capacity tier, by compaction and rotation, which write no
//!   capacity device (`Destager::make_log_room`);
//! - the tier counts as full meanwhile (`capacity_full`): host writes go on into the write log,
//!   and once it fills they fail with ENOSPC instead of waiting (a VM pauses on it by default,
//!   and resumes once room is back);
//! - the first write that succeeds again ends it, but for a device whose segment writes found
//!   no room only a segment write to that device (a stripe spans every device, and a
//!   neighbour with room must not end the spell at each try); `strata status` and `/metrics`
//!   show it while it lasts;
//! - with nothing to write to the capacity tier (the log emptied, the volumes deleted), the
//!   idle destager probes for room at the same pace (`probe_when_idle`), so the spell ends
//!   once there is room, not once new writes fill the log again.
//!
//! Everything acknowledged is in the write log meanwhile (it was durable there before it was
//! acknowledged), so nothing is lost, whatever stops first.
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::EngineError;
use crate::shared::Shared;

/// The first pause after a write found no room.
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest pause: room made is used within this long.
const RETRY_MAX: Duration = Duration::from_secs(8);

/// What the engine knows of the capacity tier being out of room.
#[derive(Debug, Clone)]
pub struct OutOfRoom {
    /// The device and the error, as the last failed write gave them.
    pub error: String,
    pub since: Instant,
    /// Capacity writes wait until then.
    pub retry_at: Instant,
    /// The pause after the next failure.
    backoff: Duration,
    /// Writes that failed for want of room since it began.
    pub failed_writes: u64,
    /// A segment write failed (not only index pages): only a segment write that succeeds
    /// ends it then, as a few index pages may fit where a segment does not.
    segments: bool,
    /// The capacity devices (by index) whose segment writes found no room, not since written
    /// to: the spell lasts until each has taken a segment again.
    devices: std::collections::BTreeSet<usize>,
}

/// What a capacity write was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// A data segment (destage, GC, bypass).
    Segment,
    /// Index pages, or anything else.
    Other,
}

/// Whether `e` says a capacity device had no room for a write.
pub fn is_out_of_room(e: &EngineError) -> bool {
    matches!(e, EngineError::Device(d) if d.is_out_of_room())
}

/// A capacity write failed with `e`; returns whether for want of room (then noted: the
/// destager pauses, the tier counts as full). `device`: the capacity device written, when
/// known. The first such failure is logged as an error, the others only counted.
pub fn note_failure(sh: &Shared, e: &EngineError, what: Write, device: Option<usize>) -> bool {
    if !is_out_of_room(e) {
        return false;
    }
    let now = Instant::now();
    let mut state = sh.counters.out_of_room.lock();
    match state.as_mut() {
        // The same failure seen again up the stack (a write's error is noted where it
        // failed, and again where the destager's step returns it).
        Some(o) if now < o.retry_at => {
            o.segments |= what == Write::Segment;
            o.devices.extend(device);
        }
        Some(o) => {
            o.segments |= what == Write::Segment;
            o.devices.extend(device);
            o.error = e.to_string();
            o.retry_at = now + o.backoff;
            o.backoff = (o.backoff * 2).min(RETRY_MAX);
            o.failed_writes += 1;
        }
        None => {
            tracing::error!(
                "the capacity tier is out of room: {e}. Its file system is full: destaging \
                 pauses (it tries again every few seconds) and host writes fail with ENOSPC \
                 once the write log fills. Make room on that file system; nothing else is \
                 needed, and everything acknowledged is safe in the write log meanwhile"
            );
            *state = Some(OutOfRoom {
                error: e.to_string(),
                since: now,
                retry_at: now + RETRY_FIRST,
                backoff: RETRY_FIRST * 2,
                failed_writes: 1,
                segments: what == Write::Segment,
                devices: device.into_iter().collect(),
            });
        }
    }
    drop(state);
    let c = &sh.counters;
    c.capacity_out_of_room.store(true, Ordering::Relaxed);
    c.capacity_full.store(true, Ordering::Relaxed);
    // Host writes waiting for log space look again: with the tier full they may be refused.
    sh.log_space_freed();
    true
}

/// A capacity write to `device` (when known) succeeded: ends an out-of-room spell, unless
/// segment writes failed and this was not one, or a device whose segment write failed has
/// not taken one since. One load when there is none.
pub fn note_success(sh: &Shared, what: Write, device: Option<usize>) {
    if !sh.counters.capacity_out_of_room.load(Ordering::Relaxed) {
        return;
    }
    let mut state = sh.counters.out_of_room.lock();
    if let (Some(o), Some(d), Write::Segment) = (state.as_mut(), device, what) {
        o.devices.remove(&d);
    }
    if state
        .as_ref()
        .is_some_and(|o| (o.segments && what != Write::Segment) || !o.devices.is_empty())
    {
        return;
    }
    let Some(o) = state.take() else {
        return;
    };
    drop(state);
    sh.counters
        .capacity_out_of_room
        .store(false, Ordering::Relaxed);
    tracing::info!(
        "the capacity tier has room again after {:.0} s ({} write(s) failed for want of room): \
         destaging goes on",
        o.since.elapsed().as_secs_f64(),
        o.failed_writes
    );
}

/// Out of room with nothing to write: the pause is over, but the log holds nothing for the
/// capacity tier (it was emptied, or a deletion gave the room back), so no write would find
/// out whether the file system has room again, and the tier would count as full, and the
/// status say so, until enough new writes came. A probe finds out: for each device whose
/// segment writes found no room (each device, when only smaller writes failed), it takes a
/// free segment, writes a segment's worth of zeros into it, gives it back and discards it.
/// Success ends the spell as a real segment write does; failure is noted like one (the next
/// pause is longer). Called by the destager (the only allocator) when it has nothing to do;
/// one load when there is no spell.
pub fn probe_when_idle(sh: &Shared) {
    if !sh.counters.capacity_out_of_room.load(Ordering::Relaxed) {
        return;
    }
    let devices: Vec<usize> = {
        let state = sh.counters.out_of_room.lock();
        let Some(o) = state.as_ref() else {
            return;
        };
        if Instant::now() < o.retry_at {
            return;
        }
        match o.devices.is_empty() {
            true => (0..sh.caps.len()).collect(),
            false => o.devices.iter().copied().collect(),
        }
    };
    let size = sh.layout.segment_size_bytes as usize;
    let zeros = strata_device::AlignedBuf::new_zeroed(size);
    for dev in devices {
        let reserve = crate::destage::gc_reserve(sh);
        // No free segment: the tier is full by its own count, which a probe cannot change.
        let Some(seg) = sh.segs.lock().alloc_on(dev, reserve) else {
            continue;
        };
        let (_, off) = sh.layout.segments[seg as usize];
        let written = sh.caps[dev].write_at(&zeros, off);
        // Not reusable while discarded; this thread is the only allocator.
        crate::capacity::discard_segments(sh, &[seg]);
        sh.segs.lock().unallocate(seg);
        match written {
            Ok(()) => note_success(sh, Write::Segment, Some(dev)),
            Err(e) => {
                let e = EngineError::from(e);
                if !note_failure(sh, &e, Write::Segment, Some(dev)) {
                    tracing::warn!("probing capacity device {dev} for room: {e}");
                }
                return;
            }
        }
    }
}

/// How long capacity writes still wait; None when they may go.
pub fn paused_for(sh: &Shared) -> Option<Duration> {
    if !sh.counters.capacity_out_of_room.load(Ordering::Relaxed) {
        return None;
    }
    let state = sh.counters.out_of_room.lock();
    let left = state
        .as_ref()?
        .retry_at
        .checked_duration_since(Instant::now())?;
    (!left.is_zero()).then_some(left)
}

/// Segments a failed write took. Out of room, they are given back, their blocks discarded
/// (the write may have taken some of the file system's room: a discard punches it out of a
/// file), and the failure noted. Otherwise the place may be bad: they stay set aside until
/// the next open, as `Open` segments, which no one allocates or reads.
pub fn failed_segment_write(sh: &Shared, segs: &[u32], e: &EngineError, what: &str) {
    if note_failure(sh, e, Write::Segment, None) {
        // Not reusable while discarded; the destager is the only allocator and waits here.
        crate::capacity::discard_segments(sh, segs);
        let mut table = sh.segs.lock();
        for &s in segs {
            table.unallocate(s);
        }
        drop(table);
        tracing::debug!("{what} failed for want of room; segments {segs:?} given back: {e}");
    } else {
        let mut table = sh.segs.lock();
        for &s in segs {
            table.set_aside(s);
        }
        drop(table);
        tracing::error!("{what} failed; segments {segs:?} are set aside until restart: {e}");
    }
}
