//! Blocks that came back from a device not matching their crc are read again before they
//! count as damaged. A copy can go wrong on its way from the medium (a flipped bit in a cable,
//! a controller or memory) while the medium holds it right: read again, it matches. Host reads
//! then return the data instead of an I/O error, and the movers (destage, garbage collection)
//! carry the good copy to the block's new home instead of the bad one; with the crc it was
//! written with the bad one stayed detectable, but the good copy was freed: a passing fault
//! became lasting damage. Each mismatch these reads see, mended or not, counts as a checksum
//! error of the device (a link that flips bits needs looking at). An asynchronous host read
//! hands a block that fails its crc to the blocking path, which reads it again and counts
//! what it sees there: a mismatch only the asynchronous read met is not counted.

use std::sync::atomic::Ordering;

use strata_device::{AlignedBuf, Device};

use crate::format::BLOCK;
use crate::shared::Shared;

/// Reads of a mismatching block after the first, at most, before it counts as damaged.
pub const REREADS: usize = 8;

/// Reads again, one at a time and up to `REREADS` times each, the blocks of `buf` (read from
/// `dev`, device `dev_index` as `Shared::checksum_error` numbers them, at byte `at`) whose
/// crc is not `want(k)`; a copy that matches replaces the bad one in `buf`. Returns the
/// blocks (indexes into `buf`) still not matching. Mended blocks are counted as checksum
/// errors here, and logged; those left are the caller's to report.
pub fn mend(
    sh: &Shared,
    dev: &dyn Device,
    dev_index: usize,
    at: u64,
    buf: &mut [u8],
    want: impl Fn(usize) -> u32,
) -> Vec<usize> {
    let mut bad = Vec::new();
    let mut one: Option<AlignedBuf> = None;
    for k in 0..buf.len() / BLOCK {
        let block = &mut buf[k * BLOCK..(k + 1) * BLOCK];
        let crc = want(k);
        if crc32c::crc32c(block) == crc {
            continue;
        }
        let copy = one.get_or_insert_with(|| AlignedBuf::new_zeroed(BLOCK));
        let byte = at + (k * BLOCK) as u64;
        let mended =
            (0..REREADS).any(|_| dev.read_at(copy, byte).is_ok() && crc32c::crc32c(copy) == crc);
        if !mended {
            bad.push(k);
            continue;
        }
        block.copy_from_slice(copy);
        sh.checksum_error(dev_index, 1);
        tracing::warn!(
            device = dev_index,
            byte,
            "checksum mismatch on read, right when read again: the device or its link may be failing"
        );
    }
    bad
}

/// `mend` for blocks read from the write log, from log block `first`: their crcs are the ones
/// recorded when they were written.
pub fn mend_log(sh: &Shared, first: u64, buf: &mut [u8]) -> Vec<usize> {
    let at = sh.layout.log_byte(first);
    mend(sh, &*sh.fast, 0, at, buf, |k| {
        sh.fast_crcs[first as usize + k].load(Ordering::Relaxed)
    })
}
