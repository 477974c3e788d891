//! Excludes concurrent writes to overlapping block ranges of a volume, so that a partial-block
//! write's read-modify-write cannot interleave with another write to the same block.

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
pub struct RangeLocks {
    held: Mutex<Vec<(u32, u64, u64)>>,
    released: Condvar,
}

pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    key: (u32, u64, u64),
}

impl RangeLocks {
    /// Blocks until no held range of `volume` overlaps `[start, end)`, then holds it.
    pub fn lock(&self, volume: u32, start: u64, end: u64) -> RangeGuard<'_> {
        let mut held = self.held.lock();
        while held
            .iter()
            .any(|&(v, s, e)| v == volume && s < end && start < e)
        {
            self.released.wait(&mut held);
        }
        held.push((volume, start, end));
        RangeGuard {
            locks: self,
            key: (volume, start, end),
        }
    }
}

impl RangeLocks {
    /// Holds `[start, end)` of `volume` if nobody holds an overlapping range; never waits.
    pub fn try_lock(&self, volume: u32, start: u64, end: u64) -> Option<RangeGuard<'_>> {
        let mut held = self.held.lock();
        if held
            .iter()
            .any(|&(v, s, e)| v == volume && s < end && start < e)
        {
            return None;
        }
        held.push((volume, start, end));
        Some(RangeGuard {
            locks: self,
            key: (volume, start, end),
        })
    }
}

impl RangeLocks {
    /// Holds `[start, end)` of `volume` if free, for a guard that outlives a borrow (the
    /// holder calls `release` with the same key); never waits.
    pub fn try_claim(&self, volume: u32, start: u64, end: u64) -> bool {
        let mut held = self.held.lock();
        if held
            .iter()
            .any(|&(v, s, e)| v == volume && s < end && start < e)
        {
            return false;
        }
        held.push((volume, start, end));
        true
    }

    pub fn release(&self, key: (u32, u64, u64)) {
        let mut held = self.held.lock();
        if let Some(i) = held.iter().position(|k| *k == key) {
            held.swap_remove(i);
        }
        self.released.notify_all();
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks.release(self.key);
    }
}
