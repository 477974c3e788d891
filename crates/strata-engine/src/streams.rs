//! The write-stream detector behind a cache-mode volume's sequential write cutoff (bypass.rs):
//! how long a sequential stream a write continues.
//!
//! A stream's requests reach the detector somewhat out of order when its client keeps several
//! in flight: the NBD server starts some writes on its reader thread, where they are noted at
//! once, and hands others (every write that bypasses the log) to its blocking threads, which
//! note them in whatever order they run, while the reader goes on deciding about the requests
//! behind them. And one client may write several streams at once (nbdcopy's connections each
//! copy their own part of a disk). So the detector keeps several runs per volume (`MAX_RUNS`),
//! each a range written without a gap: a write that reaches a run's end extends it, any other
//! starts a run of its own. A run started past the end of another, within that one's window
//! (`WINDOW_REQUESTS` of its requests), holds writes that overtook others of the same stream:
//! it joins that run once the gap between them is written. A write continues a stream as long
//! as the run whose end it reaches, or, starting past the end of a run of two requests or
//! more within its window, as long as that run (the writes in the gap are on their way).
//!
//! A random write starts a run of its own, which grows only with writes that reach its end:
//! random writes make no long run, and lend nothing to the writes after them. A write that
//! starts before a run, or ends before its end (written backwards, or again from a run's
//! start), continues nothing of it; nor does a stream that runs into an older run's start
//! take that run's length.
//!
//! A request noted twice (handed back by the non-blocking path, or done again after waiting
//! for room, and noted again on the way) changes nothing the second time, as long as no write
//! after it reached the run's end in between.

/// Runs kept per volume at most; a new one takes the place of the one least recently
/// extended, one shorter than two of its requests first (each random write starts a run: they
/// take each other's places). A stream's first write is forgotten when this many others start
/// runs before its second.
pub const MAX_RUNS: usize = 32;
/// How far past the end of a run a write may start and still be taken for the same stream's,
/// in requests of the run's size: the NBD server keeps up to 64 requests of a connection in
/// flight.
const WINDOW_REQUESTS: u64 = 64;
/// ... and in bytes at most.
const WINDOW_BYTES_MAX: u64 = 32 << 20;
/// A run of two requests or more keeps its place ahead of shorter ones until this many writes
/// to the volume went by without one extending it.
const IDLE_NOTES_MAX: u64 = 1024;

/// A range of a volume written without a gap.
#[derive(Clone, Copy, Debug)]
struct Run {
    start: u64,
    end: u64,
    /// The note that started it (unique), and the run whose window it started in (0: none).
    id: u64,
    after: u64,
    /// The size of the last request that extended it (its window is counted in those).
    request_bytes: u64,
    /// The note that last extended it.
    last_note: u64,
}

impl Run {
    fn bytes(&self) -> u64 {
        self.end - self.start
    }

    /// Whether a write at `offset` of `len` bytes reaches the run's end from within it.
    fn reached(&self, offset: u64, len: u64) -> bool {
        (self.start..=self.end).contains(&offset) && offset.saturating_add(len) >= self.end
    }

    /// Whether `offset` lies past the run's end, within its window.
    fn windows(&self, offset: u64) -> bool {
        let window = self
            .request_bytes
            .saturating_mul(WINDOW_REQUESTS)
            .min(WINDOW_BYTES_MAX);
        offset > self.end && offset - self.end <= window
    }

    /// Whether the run is a stream's: two of its requests or more.
    fn streaming(&self) -> bool {
        self.bytes() >= 2 * self.request_bytes
    }

    /// Whether the run keeps its place when a new one starts: a stream's, lately extended.
    fn under_way(&self, now: u64) -> bool {
        self.streaming() && now - self.last_note <= IDLE_NOTES_MAX
    }
}

/// The runs of one volume's writes.
#[derive(Default)]
pub struct WriteStreams {
    runs: Vec<Run>,
    notes: u64,
}

impl WriteStreams {
    /// Notes a write and returns the length of the sequential stream it continues (0 if it
    /// starts one), not counting itself.
    pub fn note(&mut self, offset: u64, len: u64) -> u64 {
        let stream_bytes = self.peek(offset, len);
        self.notes += 1;
        // The run the write follows exactly first (a stream's next write), then the longest.
        let reached = self
            .runs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.reached(offset, len))
            .max_by_key(|(_, r)| (r.end == offset, r.bytes()))
            .map(|(i, _)| i);
        match reached {
            Some(i) => {
                let r = &mut self.runs[i];
                r.end = r.end.max(offset + len);
                r.request_bytes = len;
                r.last_note = self.notes;
                self.join_runs_after(i);
            }
            None => self.start_run(offset, len),
        }
        stream_bytes
    }

    /// What `note` would return for a write of `len` bytes at `offset`, without noting it.
    pub fn peek(&self, offset: u64, len: u64) -> u64 {
        self.runs
            .iter()
            .filter(|r| r.reached(offset, len) || (r.streaming() && r.windows(offset)))
            .map(Run::bytes)
            .max()
            .unwrap_or(0)
    }

    /// Starts a run with a write, in a free place or another run's.
    fn start_run(&mut self, offset: u64, len: u64) {
        let after = self
            .runs
            .iter()
            .filter(|r| r.windows(offset))
            .max_by_key(|r| r.end)
            .map_or(0, |r| r.id);
        let new = Run {
            start: offset,
            end: offset + len,
            id: self.notes,
            after,
            request_bytes: len,
            last_note: self.notes,
        };
        if self.runs.len() < MAX_RUNS {
            return self.runs.push(new);
        }
        let now = self.notes;
        let victim = self
            .runs
            .iter()
            .enumerate()
            .min_by_key(|(_, r)| (r.under_way(now), r.last_note))
            .map_or(0, |(i, _)| i);
        self.runs[victim] = new;
    }

    /// Joins to run `i` the runs started in its window that it now reaches (the writes that
    /// overtook the ones filling the gap).
    fn join_runs_after(&mut self, mut i: usize) {
        loop {
            let (id, end) = (self.runs[i].id, self.runs[i].end);
            let Some(j) = self
                .runs
                .iter()
                .position(|r| r.after == id && r.start <= end)
            else {
                return;
            };
            let joined = self.runs.swap_remove(j);
            if i == self.runs.len() {
                i = j;
            }
            let r = &mut self.runs[i];
            r.end = r.end.max(joined.end);
            r.last_note = r.last_note.max(joined.last_note);
            for r in &mut self.runs {
                if r.after == joined.id {
                    r.after = id;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    const KIB256: u64 = 256 << 10;

    #[test]
    fn a_run_continued_back_to_back_is_measured() {
        let mut s = WriteStreams::default();
        assert_eq!(s.note(0, 100), 0);
        assert_eq!(s.note(100, 100), 100);
        assert_eq!(s.note(200, 50), 200);
        assert_eq!(s.peek(250, 50), 250);
        // Past the run's window (64 requests of 50 bytes), or back at its start: new streams.
        assert_eq!(s.note(250 + 64 * 50 + 1, 1), 0);
        assert_eq!(s.note(0, 100), 0);
    }

    /// One stream with eight writes in flight: noted, after its first eight, in each eight's
    /// reverse order, every write past the first eight continues a stream at most eight
    /// writes shorter than all those noted before it, and a write a few ahead of what was
    /// noted continues it too. Before, a write that did not start where the last one noted
    /// ended started a new stream.
    #[test]
    fn a_stream_noted_out_of_order_is_one_stream() {
        let mut s = WriteStreams::default();
        let order: Vec<u64> = (0..256u64)
            .map(|i| if i < 8 { i } else { (i / 8) * 8 + 7 - i % 8 })
            .collect();
        for (k, &i) in order.iter().enumerate() {
            let stream_bytes = s.note(i * KIB256, KIB256);
            if k >= 8 {
                assert!(
                    stream_bytes >= (k as u64 - 8) * KIB256,
                    "write {i}, noted {k}th: a stream of {stream_bytes} bytes"
                );
            }
            if k >= 8 && k % 8 == 3 {
                let ahead = (i + 5) * KIB256;
                assert_eq!(s.peek(ahead, KIB256), stream_bytes, "ahead of write {i}");
            }
        }
        assert_eq!(
            s.peek(256 * KIB256, KIB256),
            64 << 20,
            "the whole stream, one run"
        );
    }

    /// Four streams written at once, one write of each in turn: each is measured on its own.
    #[test]
    fn interleaved_streams_are_followed_each_on_its_own() {
        let mut s = WriteStreams::default();
        for k in 0..64u64 {
            for stream in 0..4u64 {
                let at = stream * (1 << 30) + k * KIB256;
                assert_eq!(s.note(at, KIB256), k * KIB256, "stream {stream}, write {k}");
            }
        }
    }

    /// Writes at random places, more of them between two writes of a stream under way than
    /// the detector keeps runs: none continues a stream longer than one write, and the stream
    /// still grows with every write of its own. A stream that begins just past a random write
    /// is measured from its own first write.
    #[test]
    fn random_writes_between_a_streams_writes_neither_count_nor_break_it() {
        let mut s = WriteStreams::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for k in 0..64u64 {
            assert_eq!(s.note(k * KIB256, KIB256), k * KIB256, "write {k}");
            // A stream not yet under way gives its place to a new one like any random
            // write's: fewer of them before its second write than the table holds.
            let random = if k == 0 { MAX_RUNS - 1 } else { 2 * MAX_RUNS };
            for _ in 0..random {
                let at = rng.gen_range(1u64 << 18..1 << 28) * 4096;
                let stream_bytes = s.note(at, KIB256);
                assert!(
                    stream_bytes <= KIB256,
                    "a random write at {at}: {stream_bytes}"
                );
            }
        }
        let random = 1u64 << 40;
        s.note(random, 4 * KIB256);
        let stream = random + 5 * KIB256;
        for k in 0..4 {
            assert_eq!(s.note(stream + k * KIB256, KIB256), k * KIB256);
        }
    }

    /// A write noted twice (handed back by the non-blocking path, noted again on the blocking
    /// one) neither shortens the run nor counts twice.
    #[test]
    fn a_write_noted_twice_changes_nothing() {
        let mut s = WriteStreams::default();
        for k in 0..4u64 {
            assert_eq!(s.note(k * KIB256, KIB256), k * KIB256);
            s.note(k * KIB256, KIB256);
        }
        // Noted ahead of the run, then again: one gap, filled once.
        s.note(5 * KIB256, KIB256);
        s.note(5 * KIB256, KIB256);
        assert_eq!(s.note(4 * KIB256, KIB256), 4 * KIB256);
        assert_eq!(s.peek(6 * KIB256, KIB256), 6 * KIB256);
    }
}
