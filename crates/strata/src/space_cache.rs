//! Space reports for the pages that show every view at once: `/metrics` and the volume list
//! (which the dashboard asks for every two seconds).
//!
//! A space report walks the view's map where it holds data (strata-engine's `space.rs`), so
//! its cost grows with the data written: 10-13 ms for 512 MiB written at random
//! (docs/BENCHMARKS.md, thirteenth session; an empty 1 TiB volume took 55 ms then, before the
//! walk skipped what no layer holds, and an empty 256 TiB one 20 s). Asked for on every
//! scrape, by every scraper, that work has no bound. So a report whose walk took long is
//! reused for a while: for `REUSE_FACTOR` times as long as the walk took, which keeps the
//! walks of a view to about 1/`REUSE_FACTOR` of one CPU however often the pages are read.
//! A walk that took less than `REUSE_FROM` of CPU is never reused: small views (and every
//! test's) always show figures as fresh as the request. The walk's CPU time is what counts,
//! not its wall time, which a busy machine stretches. The views that share layers (a volume,
//! its snapshots and their clones) are counted in one walk (`DiskGroup::space_of_views`),
//! whose time counts for each of them. `volume info` and the other single-view answers walk
//! the map themselves.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use strata_engine::{DiskGroup, SpaceReport, VolumeId};

/// Walks that took less CPU time than this are done again for every request.
const REUSE_FROM: Duration = Duration::from_millis(20);
/// A longer walk's report is reused for this many times the walk's duration.
const REUSE_FACTOR: u32 = 50;

#[derive(Default)]
pub struct SpaceCache {
    entries: Mutex<HashMap<VolumeId, Entry>>,
}

#[derive(Clone, Copy)]
struct Entry {
    report: SpaceReport,
    /// When the walk began: the report is at least this old.
    began: Instant,
    /// The walk's CPU time.
    took: Duration,
}

impl Entry {
    fn fresh_enough(&self, now: Instant) -> bool {
        self.took >= REUSE_FROM
            && now.saturating_duration_since(self.began) < self.took * REUSE_FACTOR
    }
}

impl SpaceCache {
    /// The space reports of `views`, in their order: for each, the last one when its walk was
    /// long and recent enough, else a new walk (blocking). The views that share layers are
    /// walked together, and that walk's CPU time decides how long each of their reports is
    /// reused. A view that cannot be walked (deleted meanwhile, or an index page unreadable)
    /// reports nothing, and nothing is kept for it.
    pub fn get_many(&self, group: &DiskGroup, views: &[VolumeId]) -> Vec<SpaceReport> {
        let now = Instant::now();
        let mut found: HashMap<VolumeId, SpaceReport> = HashMap::new();
        let mut stale = Vec::new();
        {
            let entries = self.entries.lock();
            for &v in views {
                match entries.get(&v).filter(|e| e.fresh_enough(now)) {
                    Some(e) => {
                        found.insert(v, e.report);
                    }
                    None => stale.push(v),
                }
            }
        }
        for family in group.view_families(&stale) {
            let reports = self.walk_with(&family, now, |views| {
                group
                    .space_of_views(views)
                    .into_iter()
                    .map(Result::ok)
                    .collect()
            });
            found.extend(family.into_iter().zip(reports));
        }
        views
            .iter()
            .map(|v| found.get(v).copied().unwrap_or_default())
            .collect()
    }

    /// One view, walked by `walk` unless its last report may be reused (for the tests of the
    /// reuse rules).
    #[cfg(test)]
    fn get_with(
        &self,
        view: VolumeId,
        now: Instant,
        walk: impl FnOnce() -> Option<SpaceReport>,
    ) -> SpaceReport {
        if let Some(e) = self.entries.lock().get(&view) {
            if e.fresh_enough(now) {
                return e.report;
            }
        }
        self.walk_with(&[view], now, |_| vec![walk()])[0]
    }

    /// Walks `views` together (`walk` answers for each, in order), and keeps the reports that
    /// will be reused.
    fn walk_with(
        &self,
        views: &[VolumeId],
        now: Instant,
        walk: impl FnOnce(&[VolumeId]) -> Vec<Option<SpaceReport>>,
    ) -> Vec<SpaceReport> {
        // Walked without the cache's lock: another page may walk the same view meanwhile,
        // which costs time but no correctness.
        let began = Instant::now();
        let cpu = thread_cpu_time();
        let reports = walk(views);
        let took = thread_cpu_time().saturating_sub(cpu);
        let mut entries = self.entries.lock();
        // Only a report that will be reused is kept, and keeping one drops those that never
        // will be again: the volume list never calls `retain`, so without this the entries of
        // deleted views would pile up while only the list (the dashboard) is read.
        if took >= REUSE_FROM {
            entries.retain(|_, e| e.fresh_enough(now));
        }
        let mut out = Vec::with_capacity(views.len());
        for (i, &view) in views.iter().enumerate() {
            match reports.get(i).copied().flatten() {
                Some(report) if took >= REUSE_FROM => {
                    entries.insert(
                        view,
                        Entry {
                            report,
                            began,
                            took,
                        },
                    );
                    out.push(report);
                }
                Some(report) => {
                    entries.remove(&view);
                    out.push(report);
                }
                // A view that cannot be walked reports nothing, and nothing is kept for it.
                None => {
                    entries.remove(&view);
                    out.push(SpaceReport::default());
                }
            }
        }
        out
    }

    /// Forgets the views not in `live` (deleted volumes and snapshots).
    pub fn retain(&self, live: &[VolumeId]) {
        let live: HashSet<VolumeId> = live.iter().copied().collect();
        self.entries.lock().retain(|id, _| live.contains(id));
    }
}

/// The CPU time the calling thread has used (zero where the clock cannot be read, which
/// only turns the reuse off).
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn report(bytes: u64) -> SpaceReport {
        SpaceReport {
            exclusive_fast_bytes: bytes,
            ..SpaceReport::default()
        }
    }

    /// A walk that takes `took` of CPU time (spun, so the cache measures it) and counts
    /// itself.
    fn walk<'a>(
        walks: &'a Cell<u32>,
        bytes: u64,
        took: Duration,
    ) -> impl FnOnce() -> Option<SpaceReport> + 'a {
        move || {
            walks.set(walks.get() + 1);
            let start = thread_cpu_time();
            while thread_cpu_time() - start < took {
                std::hint::spin_loop();
            }
            Some(report(bytes))
        }
    }

    #[test]
    fn a_quick_walk_is_done_again_for_every_request() {
        let cache = SpaceCache::default();
        let walks = Cell::new(0);
        let t = Instant::now();
        assert_eq!(
            cache.get_with(7, t, walk(&walks, 1, Duration::ZERO)),
            report(1)
        );
        // Asked again at once, after the data changed: the new figure, from a new walk.
        assert_eq!(
            cache.get_with(7, t, walk(&walks, 2, Duration::ZERO)),
            report(2)
        );
        assert_eq!(walks.get(), 2);
    }

    #[test]
    fn a_long_walk_is_reused_for_fifty_times_its_duration_then_done_again() {
        let cache = SpaceCache::default();
        let walks = Cell::new(0);
        let took = REUSE_FROM + Duration::from_millis(5);
        let first = cache.get_with(7, Instant::now(), walk(&walks, 1, took));
        assert_eq!(first, report(1));
        let began = cache.entries.lock()[&7].began;
        let measured = cache.entries.lock()[&7].took;
        assert!(
            measured >= took,
            "the walk's time is measured: {measured:?}"
        );
        // Within the allowance: the last report, no walk.
        let soon = began + measured * (REUSE_FACTOR - 1);
        assert_eq!(
            cache.get_with(7, soon, walk(&walks, 2, Duration::ZERO)),
            report(1)
        );
        assert_eq!(walks.get(), 1);
        // Another view is walked on its own.
        assert_eq!(
            cache.get_with(8, soon, walk(&walks, 3, Duration::ZERO)),
            report(3)
        );
        // Past it: a new walk and the new figure.
        let later = began + measured * REUSE_FACTOR;
        assert_eq!(
            cache.get_with(7, later, walk(&walks, 4, Duration::ZERO)),
            report(4)
        );
        assert_eq!(walks.get(), 3);
    }

    #[test]
    fn a_failed_walk_reports_nothing_and_is_not_kept() {
        let cache = SpaceCache::default();
        let walks = Cell::new(0);
        let took = REUSE_FROM + Duration::from_millis(5);
        let t = Instant::now();
        assert_eq!(cache.get_with(7, t, walk(&walks, 1, took)), report(1));
        // Past the allowance the next walk fails: nothing is reported and nothing is kept, so
        // no empty report is served in its place later.
        let later = t + took * REUSE_FACTOR + Duration::from_secs(1);
        assert_eq!(cache.get_with(7, later, || None), SpaceReport::default());
        assert!(cache.entries.lock().get(&7).is_none());
        assert_eq!(
            cache.get_with(7, later, walk(&walks, 2, Duration::ZERO)),
            report(2)
        );
    }

    #[test]
    fn views_walked_together_are_reused_for_the_walk_they_shared() {
        let cache = SpaceCache::default();
        let walks = Cell::new(0);
        let took = REUSE_FROM + Duration::from_millis(5);
        let t = Instant::now();
        let together = |views: &[VolumeId]| -> Vec<Option<SpaceReport>> {
            walk(&walks, 0, took)();
            views
                .iter()
                .map(|&v| (v != 9).then(|| report(v as u64)))
                .collect()
        };
        let got = cache.walk_with(&[7, 8, 9], t, together);
        assert_eq!(got, vec![report(7), report(8), SpaceReport::default()]);
        // Each view of the long walk is kept for what the walk took; the one it could not
        // count is not.
        let entries = cache.entries.lock();
        let mut kept: Vec<VolumeId> = entries.keys().copied().collect();
        kept.sort_unstable();
        assert_eq!(kept, vec![7, 8]);
        assert!(entries[&7].took >= took && entries[&7].took == entries[&8].took);
        drop(entries);
        let soon = t + took;
        assert_eq!(
            cache.get_with(8, soon, walk(&walks, 2, Duration::ZERO)),
            report(8)
        );
        assert_eq!(walks.get(), 1);
    }

    #[test]
    fn deleted_views_are_forgotten() {
        let cache = SpaceCache::default();
        let walks = Cell::new(0);
        let t = Instant::now();
        let took = REUSE_FROM + Duration::from_millis(1);
        for view in [1, 2, 3] {
            cache.get_with(view, t, walk(&walks, 1, took));
        }
        cache.retain(&[2]);
        let mut left: Vec<VolumeId> = cache.entries.lock().keys().copied().collect();
        left.sort_unstable();
        assert_eq!(left, vec![2]);
    }

    #[test]
    fn views_no_longer_asked_for_are_not_kept() {
        // The volume list (what the dashboard reads) walks every volume and never calls
        // `retain`: volumes created, listed and deleted must leave nothing behind.
        let cache = SpaceCache::default();
        let walks = Cell::new(0);
        let t = Instant::now();
        for view in 0..1000 {
            cache.get_with(view, t, walk(&walks, 1, Duration::ZERO));
        }
        assert_eq!(
            cache.entries.lock().len(),
            0,
            "quick walks are never reused"
        );
        // A long walk's report is kept while it may be reused, and no longer once another
        // view is walked after its allowance.
        let took = REUSE_FROM + Duration::from_millis(1);
        cache.get_with(1, t, walk(&walks, 1, took));
        let measured = cache.entries.lock()[&1].took;
        let later = Instant::now() + measured * REUSE_FACTOR;
        cache.get_with(2, later, walk(&walks, 2, took));
        let left: Vec<VolumeId> = cache.entries.lock().keys().copied().collect();
        assert_eq!(left, vec![2]);
    }
}
