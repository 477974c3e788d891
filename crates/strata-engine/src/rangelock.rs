//! Excludes concurrent writes to overlapping block ranges of a volume, so that a partial-block
//! write's read-modify-write cannot interleave with another write to the same block.
//!
//! Held ranges never overlap, so they are kept in a map ordered by (volume, first block): the
//! only held range that can overlap `[start, end)` is the one starting last before `end`. The
//! destager may hold a thousand ranges at once while its rewrites are in flight; every host
//! write checks against them, so a check costs a lookup, not a scan.

use std::collections::BTreeMap;

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
struct Held {
    /// (volume, first block) -> end block (exclusive).
    ranges: BTreeMap<(u32, u64), u64>,
    /// Threads blocked in `lock` (a release wakes them only if there are any).
    waiters: usize,
}

impl Held {
    /// An empty range overlaps nothing and is never stored.
    fn overlaps(&self, volume: u32, start: u64, end: u64) -> bool {
        start < end
            && self
                .ranges
                .range(..(volume, end))
                .next_back()
                .is_some_and(|(&(v, _), &e)| v == volume && e > start)
    }
}

#[derive(Default)]
pub struct RangeLocks {
    held: Mutex<Held>,
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
        while held.overlaps(volume, start, end) {
            held.waiters += 1;
            self.released.wait(&mut held);
            held.waiters -= 1;
        }
        if start < end {
            held.ranges.insert((volume, start), end);
        }
        RangeGuard {
            locks: self,
            key: (volume, start, end),
        }
    }

    /// Holds `[start, end)` of `volume` if nobody holds an overlapping range; never waits.
    #[cfg(test)]
    pub fn try_lock(&self, volume: u32, start: u64, end: u64) -> Option<RangeGuard<'_>> {
        // Built only once claimed: a guard's drop releases its key.
        self.try_claim(volume, start, end).then(|| RangeGuard {
            locks: self,
            key: (volume, start, end),
        })
    }

    /// Holds `[start, end)` of `volume` if free, for a guard that outlives a borrow (the
    /// holder calls `release` with the same key); never waits.
    pub fn try_claim(&self, volume: u32, start: u64, end: u64) -> bool {
        let mut held = self.held.lock();
        if held.overlaps(volume, start, end) {
            return false;
        }
        if start < end {
            held.ranges.insert((volume, start), end);
        }
        true
    }

    pub fn release(&self, key: (u32, u64, u64)) {
        let (volume, start, end) = key;
        let mut held = self.held.lock();
        if held.ranges.get(&(volume, start)) == Some(&end) {
            held.ranges.remove(&(volume, start));
        }
        if held.waiters > 0 {
            self.released.notify_all();
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks.release(self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn overlapping_ranges_exclude_each_other_and_disjoint_ones_do_not() {
        let l = RangeLocks::default();
        let a = l.try_lock(1, 10, 20).expect("free");
        for (s, e) in [(10, 20), (0, 11), (19, 30), (12, 13), (0, 100)] {
            assert!(l.try_lock(1, s, e).is_none(), "[{s},{e}) overlaps [10,20)");
        }
        // Touching ranges, other volumes.
        let b = l.try_lock(1, 20, 25).expect("[20,25) touches only");
        let c = l.try_lock(1, 5, 10).expect("[5,10) touches only");
        let d = l.try_lock(2, 0, 100).expect("another volume");
        assert!(!l.try_claim(1, 9, 21));
        drop(a);
        assert!(
            l.try_lock(1, 10, 20).is_some(),
            "free again after the guard is dropped"
        );
        assert!(l.try_lock(1, 24, 26).is_none(), "[20,25) still held");
        // An empty range is always free and holds nothing.
        assert!(l.try_claim(1, 12, 12));
        l.release((1, 12, 12));
        assert!(
            l.try_lock(1, 22, 23).is_none(),
            "an empty release freed nothing"
        );
        drop((b, c, d));
        assert!(l.try_claim(1, 0, 1000));
        l.release((1, 0, 1000));
        assert!(l.held.lock().ranges.is_empty());
    }

    #[test]
    fn lock_waits_for_an_overlapping_holder() {
        let l = Arc::new(RangeLocks::default());
        assert!(l.try_claim(3, 100, 200));
        let (l2, (tx, rx)) = (l.clone(), std::sync::mpsc::channel());
        let t = std::thread::spawn(move || {
            let _g = l2.lock(3, 150, 151);
            tx.send(()).unwrap();
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(100))
                .is_err(),
            "got the lock while held"
        );
        l.release((3, 100, 200));
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("woken by the release");
        t.join().unwrap();
    }
}
