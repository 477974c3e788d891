//! Scrub: reads every stored block on both tiers and checks it against its checksum, checks the
//! two copies of every piece of metadata against each other and repairs a bad copy from the
//! good one, and reports every bad data block by volume (or snapshot) and offset.
//!
//! It runs beside normal I/O: each location is looked up and read under the same `reclaim`
//! guard a host read uses, so space cannot be reused under it; index flushes wait while the
//! index pages are checked, so the pages it reads are the ones the durable index names.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use strata_device::AlignedBuf;

use crate::capacity::{assess, block_crcs, copy_name, read_seg_blocks, Holds, Part, SegState};
use crate::ctree::page::{encode, key_of, split_key, PageBody};
use crate::ctree::PagePtr;
use crate::error::EngineError;
use crate::format::*;
use crate::map::Loc;
use crate::meta::{self, read_copy};
use crate::shared::Shared;
use crate::DiskGroup;

/// Bad blocks listed in one report at most (the total is always counted).
pub const MAX_REPORTED_BAD_BLOCKS: usize = 10_000;
/// Blocks verified per read.
const CHUNK_BLOCKS: u64 = 256;

#[derive(Debug, Clone, Default)]
pub struct ScrubOptions {
    /// Only this volume (its layers and its snapshots'); None: everything.
    pub volume: Option<String>,
    /// Bytes read per second at most (data and metadata); 0: unlimited.
    pub rate_bytes_per_s: u64,
    /// Set by the caller to stop the scrub (whoever asked for it went away); it then ends
    /// with [`EngineError::Cancelled`] and leaves the last result as it was.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// A data block whose checksum does not match (or could not be read).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BadBlock {
    /// The volume, `volume@snapshot`, or `layer #N` for blocks only a deleted snapshot holds.
    pub volume: String,
    pub offset: u64,
    /// `fast` or `capacity`.
    pub tier: String,
    pub problem: String,
}

/// (Kept in `EngineConfig::scrub_record`: a field a later build adds takes its default when
/// an earlier build's record is read.)
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ScrubReport {
    pub scope: String,
    pub started_unix_s: u64,
    pub finished_unix_s: u64,
    pub data_bytes_verified: u64,
    pub metadata_copies_checked: u64,
    pub bad_blocks_total: u64,
    pub bad_blocks: Vec<BadBlock>,
    /// Metadata copies found bad and rewritten from the good copy.
    pub metadata_repaired: Vec<String>,
    /// Metadata that could not be repaired (both copies bad, or a single-copy structure).
    pub metadata_damaged: Vec<String>,
}

impl ScrubReport {
    pub fn clean(&self) -> bool {
        self.bad_blocks_total == 0 && self.metadata_damaged.is_empty()
    }
}

/// The next entries (1,024 at most) of `layer` in the capacity index from key `*at`, which
/// moves past them; None once there are no more. Read under the reclaim guard, as reads are:
/// a page loaded here cannot have been freed (and its segment discarded) by a flush since the
/// tree named it.
fn next_layer_entries(
    sh: &Shared,
    layer: u32,
    at: &mut u128,
) -> Result<Option<Vec<crate::ctree::Entry>>, EngineError> {
    let end = key_of(layer, 0) + (1u128 << 64);
    let ents = {
        let _guard = sh.reclaim.read();
        meta::with_tree_read(sh, |t| {
            let mut v = Vec::new();
            t.first_entries(*at, end, 1024, &mut v).map(|()| v)
        })?
    };
    let Some(last) = ents.last() else {
        return Ok(None);
    };
    *at = last.end();
    Ok(Some(ents))
}

/// What the status API shows about scrubbing.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScrubStatus {
    pub running: bool,
    pub progress_bytes: u64,
    pub total_bytes: u64,
    pub last: Option<ScrubReport>,
}

/// Scrub state shared with the status API.
#[derive(Default)]
pub struct ScrubState {
    pub running: Mutex<()>,
    /// Set by [`DiskGroup::cancel_scrub`]: the running scrub, whoever started it, stops.
    pub cancel_requested: AtomicBool,
    pub progress_bytes: AtomicU64,
    pub total_bytes: AtomicU64,
    pub last: Mutex<Option<ScrubReport>>,
    /// The group's checksum errors and metadata copy fallbacks when a scrub of everything
    /// last ended in this run: what came before, it repaired or reported.
    pub seen_at_last_all: Mutex<(u64, u64)>,
    /// When the last scrub of everything ended (Unix seconds; 0: none known), this run's or
    /// one before a restart (the record): the background scrub's schedule follows it.
    pub all_finished_unix_s: AtomicU64,
    /// When the record was begun (the first open that kept one; Unix seconds, 0: no record):
    /// until a scrub of everything ends, the background schedule counts from it, so a group
    /// restarted more often than the interval is still scrubbed.
    pub kept_since_unix_s: AtomicU64,
    /// The record could not be written (said once).
    pub record_failed: AtomicBool,
}

/// What a scrub of everything is called in its report's `scope`.
const ALL: &str = "all";

/// The last report as kept in `EngineConfig::scrub_record`, with the disk group it is of.
#[derive(Serialize, Deserialize)]
struct Record {
    group: String,
    /// None until a scrub ends.
    #[serde(default)]
    report: Option<ScrubReport>,
    /// `ScrubState::kept_since_unix_s` (0 or missing, in a record from before it was kept:
    /// begun again at the next open).
    #[serde(default)]
    kept_since_unix_s: u64,
    /// When the last scrub of everything ended (`ScrubState::all_finished_unix_s`), kept
    /// apart from the report: a later scrub of one volume replaces the report, not this, and
    /// a volume named `all` has the scope a scrub of everything has. 0 (or missing, in a
    /// record from before it was kept): none known.
    #[serde(default)]
    all_finished_unix_s: u64,
}

/// This group's record: `EngineConfig::scrub_record` with the group's id in its name.
pub(crate) fn record_path(sh: &Shared) -> Option<PathBuf> {
    let base = sh.cfg.scrub_record.as_ref()?;
    let stem = base.file_stem().unwrap_or_default().to_string_lossy();
    let mut name = format!("{stem}-{}", uuid_hex(&sh.layout.group));
    if let Some(ext) = base.extension() {
        name = format!("{name}.{}", ext.to_string_lossy());
    }
    Some(base.with_file_name(name))
}

/// Reads a record: None when there is none (not found, or not one: logged).
fn read_record(path: &Path) -> Result<Option<Record>, ()> {
    match std::fs::read(path) {
        Ok(text) => match serde_json::from_slice::<Record>(&text) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                tracing::warn!(path = %path.display(), "the last scrub's record is not one, begun again: {e}");
                Ok(None)
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => {
            tracing::warn!(path = %path.display(), "cannot read the last scrub's record: {e}");
            Err(())
        }
    }
}

/// At open, before the background scrub starts: the last report and the schedule from
/// before the restart, from the group's own record (or from one at `scrub_record` itself,
/// written by a build before records were kept per group, if it is this group's: taken over,
/// and removed once the group's own is written). Otherwise (none yet; one that cannot be
/// read, logged) the record is begun now, so the background schedule counts from this open
/// across restarts.
pub(crate) fn restore(sh: &Shared) {
    let (Some(base), Some(path)) = (&sh.cfg.scrub_record, record_path(sh)) else {
        return;
    };
    let group = uuid_hex(&sh.layout.group);
    let Ok(mut record) = read_record(&path) else {
        return;
    };
    let mut legacy = false;
    if record.is_none() {
        record = match read_record(base) {
            Ok(Some(r)) if r.group == group => {
                legacy = true;
                Some(r)
            }
            _ => None,
        };
    }
    let record = record.filter(|r| {
        let ours = r.group == group;
        if !ours {
            tracing::info!(path = %path.display(), group = r.group, "the last scrub's record is of another disk group: begun again for this one");
        }
        ours
    });
    let kept_since = match record {
        Some(r) => {
            sh.scrub
                .all_finished_unix_s
                .fetch_max(r.all_finished_unix_s, Ordering::Relaxed);
            *sh.scrub.last.lock() = r.report;
            r.kept_since_unix_s
        }
        None => 0,
    };
    if kept_since > 0 {
        sh.scrub
            .kept_since_unix_s
            .store(kept_since, Ordering::Relaxed);
    } else {
        sh.scrub
            .kept_since_unix_s
            .store(unix_now_s().max(1), Ordering::Relaxed);
    }
    if kept_since == 0 || legacy {
        write_state(sh, &path);
    }
    if legacy && path.exists() {
        if let Err(e) = std::fs::remove_file(base) {
            tracing::warn!(path = %base.display(), "cannot remove the last scrub's record, now kept per group: {e}");
        }
    }
}

/// A finished scrub's report becomes the last: in memory, and in the record. `everything`:
/// the scrub was of everything (not of one volume, whatever its name).
fn keep(sh: &Shared, report: &ScrubReport, everything: bool) {
    *sh.scrub.last.lock() = Some(report.clone());
    if everything {
        *sh.scrub.seen_at_last_all.lock() = sh.damage_seen();
        let at = report.finished_unix_s.max(1);
        sh.scrub
            .all_finished_unix_s
            .fetch_max(at, Ordering::Relaxed);
    }
    if let Some(path) = record_path(sh) {
        write_state(sh, &path);
    }
}

/// Writes the record from the state in memory.
fn write_state(sh: &Shared, path: &std::path::Path) {
    let record = Record {
        group: uuid_hex(&sh.layout.group),
        report: sh.scrub.last.lock().clone(),
        kept_since_unix_s: sh.scrub.kept_since_unix_s.load(Ordering::Relaxed),
        all_finished_unix_s: sh.scrub.all_finished_unix_s.load(Ordering::Relaxed),
    };
    if let Err(e) = write_record(path, &record) {
        if !sh.scrub.record_failed.swap(true, Ordering::Relaxed) {
            tracing::warn!(path = %path.display(), "cannot keep the last scrub's report and schedule across a restart: {e}");
        }
    }
}

/// Replaces the record whole (a new file, synced, renamed over the old one): a crash leaves
/// the old record or the new one.
fn write_record(path: &std::path::Path, record: &Record) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".new");
    let new = dir.join(name);
    let mut f = std::fs::File::create(&new)?;
    f.write_all(&serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?)?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    std::fs::rename(&new, path)?;
    std::fs::File::open(dir)?.sync_all()
}

impl DiskGroup {
    /// Runs a scrub to the end (one at a time).
    pub fn scrub(&self, opts: &ScrubOptions) -> Result<ScrubReport, EngineError> {
        run(&self.sh, opts)
    }

    /// Starts a scrub on a thread of its own and returns once it holds the scrub slot
    /// ([`EngineError::InUse`] when another scrub runs). Nobody waits for it: it runs to its
    /// end, until [`DiskGroup::cancel_scrub`], or until the group stops (which waits for it,
    /// as for the background scrub), and its report becomes the last result, as a finished
    /// scrub's always does. `opts.cancel` is the caller's, as for [`DiskGroup::scrub`].
    pub fn start_scrub(&self, opts: ScrubOptions) -> Result<(), EngineError> {
        let sh = self.sh.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("strata-scrub-api".into())
            .spawn(move || {
                let began = std::cell::Cell::new(false);
                let result = run_then(&sh, &opts, || {
                    began.set(true);
                    let _ = tx.send(Ok(()));
                });
                match result {
                    // Refused before it began: the caller says why.
                    Err(e) if !began.get() => {
                        let _ = tx.send(Err(e));
                    }
                    result => log_unattended("scrub started through the API", result),
                }
            })
            .map_err(|e| EngineError::Failed(format!("cannot start a scrub thread: {e}")))?;
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
        drop(threads);
        rx.recv().unwrap_or_else(|_| {
            Err(EngineError::Failed(
                "the scrub thread ended before it began".into(),
            ))
        })
    }

    /// Asks the running scrub, the background one included, to stop; it ends with
    /// [`EngineError::Cancelled`] within a chunk's read and leaves the last result as it was.
    /// False when no scrub is running.
    pub fn cancel_scrub(&self) -> bool {
        let sc = &self.sh.scrub;
        if !sc.running.is_locked() {
            return false;
        }
        sc.cancel_requested.store(true, Ordering::Relaxed);
        tracing::info!("scrub cancel requested");
        true
    }

    pub fn scrub_status(&self) -> ScrubStatus {
        let sc = &self.sh.scrub;
        ScrubStatus {
            running: sc.running.is_locked(),
            progress_bytes: sc.progress_bytes.load(Ordering::Relaxed),
            total_bytes: sc.total_bytes.load(Ordering::Relaxed),
            last: sc.last.lock().clone(),
        }
    }
}

/// The background scrubber: everything, at the configured rate, every `every`.
pub fn background(sh: std::sync::Arc<Shared>, every: Duration) {
    let opts = ScrubOptions {
        volume: None,
        rate_bytes_per_s: sh.cfg.scrub_rate_bytes_per_s,
        cancel: None,
    };
    let mut next = Instant::now() + every;
    let mut seen = 0;
    loop {
        if sh.destager_stop.load(Ordering::Relaxed) || sh.abandon.load(Ordering::Relaxed) {
            return;
        }
        // A scrub of everything ended (here, through the API too, or before a restart, as
        // the record says; with none yet, the record was begun): the next is due `every`
        // after it, and never later than `every` from now (a clock that was ahead does not
        // put it off).
        let finished = match sh.scrub.all_finished_unix_s.load(Ordering::Relaxed) {
            0 => sh.scrub.kept_since_unix_s.load(Ordering::Relaxed),
            at => at,
        };
        if finished != seen {
            seen = finished;
            let ago = Duration::from_secs(unix_now_s().saturating_sub(finished));
            next = Instant::now() + every.saturating_sub(ago);
        }
        if Instant::now() < next {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        log_unattended("background scrub", run(&sh, &opts));
        next = Instant::now() + every;
    }
}

/// Logs how a scrub nobody waits for ended (`what`: which one).
fn log_unattended(what: &str, result: Result<ScrubReport, EngineError>) {
    match result {
        Ok(r) if !r.clean() => tracing::error!(
            bad_blocks = r.bad_blocks_total,
            damaged_metadata = r.metadata_damaged.len(),
            "{what} found damage"
        ),
        Err(EngineError::Cancelled(_)) => tracing::info!("{what} cancelled"),
        Ok(_) | Err(EngineError::InUse(_)) | Err(EngineError::ShuttingDown) => {}
        Err(e) => tracing::error!("{what}: {e}"),
    }
}

fn run(sh: &Shared, opts: &ScrubOptions) -> Result<ScrubReport, EngineError> {
    run_then(sh, opts, || {})
}

/// Runs a scrub; `began` is called once it holds the scrub slot.
fn run_then(
    sh: &Shared,
    opts: &ScrubOptions,
    began: impl FnOnce(),
) -> Result<ScrubReport, EngineError> {
    {
        let _one = sh
            .scrub
            .running
            .try_lock()
            .ok_or_else(|| EngineError::InUse("a scrub is already running".into()))?;
        // A cancel asked for before this scrub began was for an earlier one.
        sh.scrub.cancel_requested.store(false, Ordering::Relaxed);
        // (Not before: a cancel the caller asks for once told is for this one.)
        began();
        let mut s = Scrubber::new(sh, opts);
        s.report.started_unix_s = unix_now_s();
        let layers = s.layers_in_scope()?;
        sh.scrub.progress_bytes.store(0, Ordering::Relaxed);
        let data_bytes = s.estimate(&layers);
        sh.scrub.total_bytes.store(data_bytes, Ordering::Relaxed);
        // An error that stops one part (an index page unreadable in both copies, a read that
        // fails) is damage to report; the scrub goes on with the next part, so the report
        // keeps what it found and later data is still checked. Only a stopping group ends it.
        let ends = |e: &EngineError| {
            matches!(
                e,
                EngineError::ShuttingDown
                    | EngineError::InUse(_)
                    | EngineError::Failed(_)
                    | EngineError::Cancelled(_)
            )
        };
        if let Err(e) = s.check_metadata() {
            if ends(&e) {
                return Err(e);
            }
            let why = format!("metadata check stopped early at an error: {e}");
            s.report.metadata_damaged.push(why);
        }
        // The metadata read (all of the group's, whatever the scope) counts too.
        let metadata_bytes = sh.scrub.progress_bytes.load(Ordering::Relaxed);
        sh.scrub
            .total_bytes
            .store(metadata_bytes + data_bytes, Ordering::Relaxed);
        for (layer, name) in &layers {
            if let Err(e) = s.check_layer(*layer, name) {
                if ends(&e) {
                    return Err(e);
                }
                let why = format!("{name}: check stopped at an error, the rest is unchecked: {e}");
                s.report.metadata_damaged.push(why);
            }
        }
        s.report.finished_unix_s = unix_now_s();
        let report = s.report;
        tracing::info!(
            scope = report.scope,
            bytes = report.data_bytes_verified,
            bad_blocks = report.bad_blocks_total,
            repaired = report.metadata_repaired.len(),
            damaged = report.metadata_damaged.len(),
            "scrub finished"
        );
        keep(sh, &report, opts.volume.is_none());
        Ok(report)
    }
}

struct Scrubber<'a> {
    sh: &'a Shared,
    opts: &'a ScrubOptions,
    report: ScrubReport,
    started: Instant,
    read_bytes: u64,
    /// Recent segments whose summary header no copy holds (`check_summary`).
    unmendable_recent: Vec<u32>,
}

impl<'a> Scrubber<'a> {
    fn new(sh: &'a Shared, opts: &'a ScrubOptions) -> Scrubber<'a> {
        let scope = opts.volume.clone().unwrap_or_else(|| ALL.into());
        Scrubber {
            sh,
            opts,
            report: ScrubReport {
                scope,
                ..Default::default()
            },
            started: Instant::now(),
            read_bytes: 0,
            unmendable_recent: Vec::new(),
        }
    }

    /// Sleeps as needed to keep to the rate limit after reading `bytes`; stops the scrub when
    /// the disk group stops.
    /// The sleep is taken in slices of at most 200 ms, so a stop is noticed soon even when
    /// one chunk is worth seconds at a low rate.
    fn pace(&mut self, bytes: u64) -> Result<(), EngineError> {
        self.read_bytes += bytes;
        self.sh
            .scrub
            .progress_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        let rate = self.opts.rate_bytes_per_s;
        let due = if rate == 0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(self.read_bytes as f64 / rate as f64)
        };
        loop {
            if self.sh.destager_stop.load(Ordering::Relaxed)
                || self.sh.abandon.load(Ordering::Relaxed)
            {
                return Err(EngineError::ShuttingDown);
            }
            let asked = self
                .opts
                .cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::Relaxed));
            if asked || self.sh.scrub.cancel_requested.load(Ordering::Relaxed) {
                return Err(EngineError::Cancelled("the scrub"));
            }
            let spent = self.started.elapsed();
            if due <= spent {
                return Ok(());
            }
            std::thread::sleep((due - spent).min(Duration::from_millis(200)));
        }
    }

    /// The live layers to check, each with the name its bad blocks are reported under.
    fn layers_in_scope(&self) -> Result<Vec<(u32, String)>, EngineError> {
        let idx = self.sh.index.read();
        let mut names: std::collections::BTreeMap<u32, String> = std::collections::BTreeMap::new();
        for v in idx.volumes.values() {
            names.insert(v.head, v.name.clone());
        }
        for s in idx.snapshots.values() {
            let vol = idx.volumes.get(&s.volume).map_or("?", |v| v.name.as_str());
            names.insert(s.layer, format!("{vol}@{}", s.name));
        }
        let wanted: Option<std::collections::HashSet<u32>> = match &self.opts.volume {
            None => None,
            Some(v) => {
                let rec = idx
                    .volume_by_name(v)
                    .ok_or_else(|| EngineError::NotFound(v.clone()))?;
                let mut set: std::collections::HashSet<u32> =
                    idx.chain(rec.head).into_iter().collect();
                for s in idx.snapshots.values().filter(|s| s.volume == rec.id) {
                    set.extend(idx.chain(s.layer));
                }
                Some(set)
            }
        };
        Ok(idx
            .layers
            .values()
            .filter(|l| idx.layer_live(l.rec.id))
            .filter(|l| wanted.as_ref().is_none_or(|w| w.contains(&l.rec.id)))
            .map(|l| {
                (
                    l.rec.id,
                    names
                        .get(&l.rec.id)
                        .cloned()
                        .unwrap_or_else(|| format!("layer #{}", l.rec.id)),
                )
            })
            .collect())
    }

    /// The bytes this scrub will read: every live block for a scrub of everything; for one
    /// volume, what its layers hold by themselves (their fast maps, and their entries in the
    /// capacity index, listed as `check_layer` will list them). (It was half of everything,
    /// so a volume holding most of the data showed "12.3 MiB of about 10 MiB".)
    fn estimate(&self, layers: &[(u32, String)]) -> u64 {
        let c = &self.sh.counters;
        let fast = c.fast_live_blocks.load(Ordering::Relaxed);
        let cap = self.sh.segs.lock().live_blocks_total();
        let everything = (fast + cap) * BLOCK_U64;
        if self.opts.volume.is_none() || layers.is_empty() {
            return everything;
        }
        let mut blocks = 0;
        for &(layer, _) in layers {
            match self.layer_blocks(layer) {
                Ok(n) => blocks += n,
                Err(_) => return everything,
            }
        }
        blocks * BLOCK_U64
    }

    /// Blocks `layer` holds by itself on either tier.
    fn layer_blocks(&self, layer: u32) -> Result<u64, EngineError> {
        let fast: u64 = {
            let idx = self.sh.index.read();
            idx.layers.get(&layer).map_or(0, |l| {
                l.fast
                    .iter()
                    .filter(|(_, _, loc)| matches!(loc, Loc::Fast(_)))
                    .map(|(_, len, _)| len)
                    .sum()
            })
        };
        let mut cap = 0;
        let mut at = key_of(layer, 0);
        while let Some(ents) = next_layer_entries(self.sh, layer, &mut at)? {
            cap += ents
                .iter()
                .filter(|e| matches!(e.loc, Loc::Cap { .. }))
                .map(|e| e.len)
                .sum::<u64>();
        }
        Ok(fast + cap)
    }

    fn bad(&mut self, volume: &str, lba: u64, tier: &str, dev: usize, problem: String) {
        self.report.bad_blocks_total += 1;
        self.sh.checksum_error(dev, 1);
        tracing::error!(
            volume,
            offset = lba * BLOCK_U64,
            tier,
            problem = problem.as_str(),
            "scrub: bad block"
        );
        if self.report.bad_blocks.len() < MAX_REPORTED_BAD_BLOCKS {
            self.report.bad_blocks.push(BadBlock {
                volume: volume.into(),
                offset: lba * BLOCK_U64,
                tier: tier.into(),
                problem,
            });
        }
    }

    /// Every block a layer holds by itself: its log blocks, then its capacity blocks.
    fn check_layer(&mut self, layer: u32, name: &str) -> Result<(), EngineError> {
        let runs: Vec<(u64, u64, Loc)> = {
            let idx = self.sh.index.read();
            idx.layers
                .get(&layer)
                .map(|l| l.fast.iter().collect())
                .unwrap_or_default()
        };
        for (lba, len, loc) in runs {
            if let Loc::Fast(_) = loc {
                self.check_fast_run(layer, name, lba, len)?;
            }
        }
        let mut at = key_of(layer, 0);
        while let Some(ents) = next_layer_entries(self.sh, layer, &mut at)? {
            for e in ents {
                if let Loc::Cap { .. } = e.loc {
                    self.check_cap_run(layer, name, split_key(e.key).1, e.len)?;
                }
            }
        }
        Ok(())
    }

    /// Checks log blocks of `[lba, lba+len)` that the layer's fast map still points at (looked
    /// up again under the guard: the run may have moved since it was listed).
    fn check_fast_run(
        &mut self,
        layer: u32,
        name: &str,
        lba: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        let mut at = lba;
        while at < lba + len {
            let n = CHUNK_BLOCKS.min(lba + len - at);
            let mut buf = AlignedBuf::new_zeroed((n * BLOCK_U64) as usize);
            let mut bad = Vec::new();
            {
                let _guard = self.sh.reclaim.read();
                let pieces = {
                    let idx = self.sh.index.read();
                    idx.layers
                        .get(&layer)
                        .map(|l| l.fast.lookup(at, n))
                        .unwrap_or_default()
                };
                for p in pieces {
                    let Some(Loc::Fast(b)) = p.loc else { continue };
                    let dst = &mut buf[..(p.len * BLOCK_U64) as usize];
                    if let Err(e) = self.sh.fast.read_at(dst, self.sh.layout.log_byte(b)) {
                        bad.extend((0..p.len).map(|i| (p.lba + i, format!("unreadable: {e}"))));
                        continue;
                    }
                    for i in crate::reread::mend_log(self.sh, b, dst) {
                        bad.push((p.lba + i as u64, "checksum mismatch".into()));
                    }
                    self.report.data_bytes_verified += p.len * BLOCK_U64;
                }
            }
            for (l, why) in bad {
                self.bad(name, l, "fast", 0, why);
            }
            self.pace(n * BLOCK_U64)?;
            at += n;
        }
        Ok(())
    }

    /// Checks capacity blocks of `[lba, lba+len)` that the layer's tree entry still points at.
    fn check_cap_run(
        &mut self,
        layer: u32,
        name: &str,
        lba: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        let mut at = lba;
        while at < lba + len {
            let n = CHUNK_BLOCKS.min(lba + len - at);
            let mut bad = Vec::new();
            {
                let _guard = self.sh.reclaim.read();
                let ents = meta::with_tree_read(self.sh, |t| {
                    let mut v = Vec::new();
                    t.lookup(key_of(layer, at), key_of(layer, at + n), &mut v)
                        .map(|()| v)
                })?;
                for e in ents {
                    let Loc::Cap { seg, block } = e.loc else {
                        continue;
                    };
                    let elba = split_key(e.key).1;
                    let dev = self.sh.seg_device(seg);
                    // Blocks the layer holds newer copies of in the write log (data, or a
                    // trim's zeros): reads never reach these copies, which destage releases.
                    // Reported as bad, they were damage no read meets, "restore from a
                    // backup" for data already replaced.
                    let superseded: Vec<(u64, u64)> = {
                        let idx = self.sh.index.read();
                        idx.layers
                            .get(&layer)
                            .map(|l| l.fast.lookup(elba, e.len))
                            .unwrap_or_default()
                            .into_iter()
                            .filter(|p| p.loc.is_some())
                            .map(|p| (p.lba, p.lba + p.len))
                            .collect()
                    };
                    let current = |l: u64| !superseded.iter().any(|&(a, z)| (a..z).contains(&l));
                    // The crcs host reads check against (the summary's crc blocks; its header
                    // is checked with the metadata).
                    let crcs = match block_crcs(self.sh, seg, block, e.len as u32) {
                        Ok(c) => c,
                        Err(err) => {
                            bad.extend(
                                (0..e.len)
                                    .filter(|&i| current(elba + i))
                                    .map(|i| (elba + i, dev, format!("segment {seg}: {err}"))),
                            );
                            continue;
                        }
                    };
                    let mut buf = AlignedBuf::new_zeroed((e.len * BLOCK_U64) as usize);
                    match read_seg_blocks(self.sh, seg, block, e.len as u32, &mut buf, &crcs) {
                        Err(err) => bad.extend(
                            (0..e.len)
                                .filter(|&i| current(elba + i))
                                .map(|i| (elba + i, dev, format!("unreadable: {err}"))),
                        ),
                        Ok(_) => {
                            for i in 0..e.len as usize {
                                let expect = crcs.get(i).copied();
                                if expect != Some(crc32c::crc32c(&buf[i * BLOCK..(i + 1) * BLOCK]))
                                    && current(elba + i as u64)
                                {
                                    bad.push((
                                        elba + i as u64,
                                        dev,
                                        format!(
                                            "checksum mismatch (segment {seg} block {})",
                                            block as usize + i
                                        ),
                                    ));
                                }
                            }
                        }
                    }
                    self.report.data_bytes_verified += e.len * BLOCK_U64;
                }
            }
            for (l, dev, why) in bad {
                self.bad(name, l, "capacity", dev, why);
            }
            self.pace(n * BLOCK_U64)?;
            at += n;
        }
        Ok(())
    }

    /// Superblocks of every device, both checkpoint copies, every index and segment-table page
    /// (both copies), and the summary of every sealed segment.
    fn check_metadata(&mut self) -> Result<(), EngineError> {
        let devices: Vec<_> = std::iter::once(self.sh.fast.clone())
            .chain(self.sh.caps.iter().cloned())
            .collect();
        for dev in devices {
            self.check_superblocks(dev.as_ref())?;
        }
        self.check_checkpoints()?;
        self.check_log_headers()?;
        self.check_index_pages()?;
        self.check_summaries()
    }

    /// The header of every durable batch in the write log. A start replays the log from its
    /// tail and refuses to open at a damaged header that later batches follow (it cannot tell
    /// which writes the batch held), so such damage, harmless while the group runs, keeps every
    /// volume offline after the next stop. The running group still holds the batch's records
    /// in memory: the log is destaged past it (repaired), or, when that cannot be done within
    /// `HEADER_DRAIN_WAIT` (the capacity tier full), the damage is reported with what to do.
    fn check_log_headers(&mut self) -> Result<(), EngineError> {
        let sh = self.sh;
        let mut damaged = Vec::new();
        let mut checked = 0u64;
        {
            // The log's blocks are reused only under the reclaim lock's write side.
            let _guard = sh.reclaim.read();
            let batches: Vec<(u64, u64)> = sh
                .log
                .lock()
                .batches
                .iter()
                .filter(|b| b.durable)
                .map(|b| (b.start, b.first_seq))
                .collect();
            let mut b = AlignedBuf::new_zeroed(BLOCK);
            let mut header_at = |block: u64, copy: Option<u32>, seq: u64| {
                // Read twice at most: a read that went wrong in passing is not damage.
                (0..2).any(|_| {
                    sh.fast.read_at(&mut b, sh.layout.log_byte(block)).is_ok()
                        && BatchHeader::decode(&b, &sh.layout.group).is_some_and(|h| {
                            h.first_seq == seq && (copy.is_none() || h.run_copy == copy)
                        })
                })
            };
            for (start, seq) in batches {
                checked += 1;
                // A run of lone writes has a second header copy; either one serves replay.
                let ok =
                    header_at(start, None, seq) || header_at(start + RUN_SECOND_COPY, Some(1), seq);
                if !ok {
                    damaged.push(seq);
                }
            }
        }
        self.report.metadata_copies_checked += checked;
        self.pace(checked * BLOCK_U64)?;
        let Some(&last) = damaged.iter().max() else {
            return Ok(());
        };
        let passed = crate::destage::destage_past(sh, last, HEADER_DRAIN_WAIT);
        for seq in damaged {
            match passed {
                true => self.repaired(format!(
                    "write log: the header of the batch at sequence {seq} was damaged; the log \
                     was destaged past it, so a start no longer reads it"
                )),
                false => self.report.metadata_damaged.push(format!(
                    "write log: the header of the batch at sequence {seq} is damaged: a start \
                     refuses to open while the log holds it, and the log could not be destaged \
                     past it (the capacity tier full?); keep the daemon running, make room \
                     (trim or delete data) and scrub again"
                )),
            }
        }
        Ok(())
    }

    fn check_superblocks(&mut self, dev: &dyn strata_device::Device) -> Result<(), EngineError> {
        let sh = self.sh;
        let _sb = sh.superblocks.lock();
        let mut copies = Vec::new();
        for copy in 0..2u64 {
            let mut b = AlignedBuf::new_zeroed(BLOCK);
            let ok = dev.read_at(&mut b, copy * BLOCK_U64).is_ok()
                && matches!(Superblock::decode(&b), SuperblockRead::Valid(_));
            copies.push((b, ok));
        }
        self.report.metadata_copies_checked += 2;
        self.pace(2 * BLOCK_U64)?;
        match (copies[0].1, copies[1].1) {
            (true, true) if copies[0].0[..] != copies[1].0[..] => {
                self.report.metadata_damaged.push(format!(
                    "device {}: the superblock copies differ",
                    dev.name()
                ))
            }
            (true, true) => {}
            (false, false) => self.report.metadata_damaged.push(format!(
                "device {}: both superblock copies are damaged",
                dev.name()
            )),
            (a_ok, _) => {
                let (good, bad_copy) = if a_ok { (0, 1u64) } else { (1, 0u64) };
                dev.write_at(&copies[good].0, bad_copy * BLOCK_U64)?;
                dev.flush()?;
                self.repaired(format!(
                    "device {}: superblock copy {} rewritten from the other",
                    dev.name(),
                    if bad_copy == 0 { "A" } else { "B" }
                ));
            }
        }
        Ok(())
    }

    fn repaired(&mut self, what: String) {
        tracing::warn!("scrub: {what}");
        self.report.metadata_repaired.push(what);
    }

    /// Both checkpoint copies must decode with the same generation; otherwise both are
    /// rewritten (a checkpoint write rewrites both copies).
    fn check_checkpoints(&mut self) -> Result<(), EngineError> {
        let mut d = self.sh.durable.lock();
        let mut gens = Vec::new();
        for off in self.sh.layout.checkpoint_offsets {
            let mut b = AlignedBuf::new_zeroed(crate::layout::CHECKPOINT_AREA_BYTES as usize);
            self.sh.fast.read_at(&mut b, off)?;
            gens.push(
                Checkpoint::decode(&b, &self.sh.layout.group)
                    .map(|c| c.generation)
                    .ok(),
            );
        }
        self.report.metadata_copies_checked += 2;
        if gens[0].is_some() && gens[0] == gens[1] {
            return Ok(());
        }
        // The copy to lose is written first: the damaged one, or the older. Overwriting the
        // only whole copy first would leave none if the power failed during that write.
        d.first_copy = match (gens[0], gens[1]) {
            (None, Some(_)) => 0,
            (Some(_), None) => 1,
            (Some(a), Some(b)) => usize::from(b < a),
            (None, None) => d.first_copy,
        };
        let tail = self.sh.log.lock().tail();
        self.sh.write_checkpoint_locked(&mut d, tail)?;
        drop(d);
        let which = match (gens[0], gens[1]) {
            (None, _) => "copy A was damaged",
            (_, None) => "copy B was damaged",
            _ => "the copies had different generations",
        };
        self.repaired(format!("checkpoint: {which}; both copies rewritten"));
        Ok(())
    }

    /// Walks the durable index from its root on disk, with index flushes held off.
    fn check_index_pages(&mut self) -> Result<(), EngineError> {
        let mut lost = Vec::new();
        {
            let _no_flush = self.sh.flush_guard.lock();
            let (root, generation) = {
                let d = self.sh.durable.lock();
                (d.index_root, d.index_generation)
            };
            let segtab: Vec<(usize, PagePtr)> = self
                .sh
                .segs
                .lock()
                .page_ptrs
                .iter()
                .enumerate()
                .filter_map(|(i, p)| Some((i, (*p)?)))
                .collect();
            let mut stack: Vec<PagePtr> = root.into_iter().collect();
            let mut seen = 0usize;
            while let Some(ptr) = stack.pop() {
                seen += 1;
                match self.check_page(ptr, generation, "index")? {
                    Some(PageBody::Inner(children)) => {
                        stack.extend(children.into_iter().map(|c| c.1))
                    }
                    Some(_) => {}
                    None => lost.push(LostPage { ptr, segtab: None }),
                }
            }
            for (i, ptr) in segtab {
                if self.check_page(ptr, generation, "segment table")?.is_none() {
                    lost.push(LostPage {
                        ptr,
                        segtab: Some(i),
                    });
                }
            }
            tracing::debug!(pages = seen, "scrub: index pages checked");
        }
        self.rewrite_lost_pages(lost);
        Ok(())
    }

    /// Pages damaged in both copies whose contents memory still holds (every segment-table
    /// page; an index node while it is resident) are marked for rewriting and the index is
    /// written: the flush puts them elsewhere, and nothing refers to the damaged copies any
    /// more (a start would refuse to open at such a page). A page memory does not hold is
    /// reported as damaged, with what it costs.
    fn rewrite_lost_pages(&mut self, lost: Vec<LostPage>) {
        let sh = self.sh;
        let mut marked = Vec::new();
        // No flush between its plan and its commit may see the marks change.
        let no_flush = sh.flush_guard.lock();
        for page in lost {
            let what = match page.segtab {
                Some(_) => "segment table",
                None => "index",
            };
            let held = match page.segtab {
                Some(i) => {
                    let mut segs = sh.segs.lock();
                    segs.dirty_pages.insert(i);
                    true
                }
                None => crate::meta::with_tree(sh, |t| t.redirty(&|p| p == page.ptr)).is_ok(),
            };
            match held {
                true => marked.push((page.ptr, what)),
                false => self.report.metadata_damaged.push(format!(
                    "{what} page {:#x}/{:#x}: both copies are damaged, and memory does not hold \
                     it: reads of the data it maps fail, and a start refuses to open the group \
                     while the index refers to it; keep the daemon running and restore the \
                     affected volumes from a backup",
                    page.ptr.a, page.ptr.b
                )),
            }
        }
        drop(no_flush);
        if marked.is_empty() {
            return;
        }
        let written = flush_index_now(sh, HEADER_DRAIN_WAIT);
        for (ptr, what) in marked {
            match written {
                true => self.repaired(format!(
                    "{what} page {:#x}/{:#x}: both copies were damaged; rewritten elsewhere \
                     from the copy in memory",
                    ptr.a, ptr.b
                )),
                false => self.report.metadata_damaged.push(format!(
                    "{what} page {:#x}/{:#x}: both copies are damaged; memory holds it and it \
                     is marked for rewriting, but the index was not written within {} s: keep \
                     the daemon running (a start refuses to open while the index refers to it) \
                     and scrub again",
                    ptr.a,
                    ptr.b,
                    HEADER_DRAIN_WAIT.as_secs()
                )),
            }
        }
    }

    /// Reads both copies of a page; a bad copy is rewritten from the good one.
    fn check_page(
        &mut self,
        ptr: PagePtr,
        generation: u64,
        what: &str,
    ) -> Result<Option<PageBody>, EngineError> {
        let a = read_copy(self.sh, ptr.a).ok().flatten();
        let b = read_copy(self.sh, ptr.b).ok().flatten();
        self.report.metadata_copies_checked += 2;
        self.pace(2 * BLOCK_U64)?;
        let body = match (a, b) {
            (Some(a), Some(b)) if a == b => return Ok(Some(a)),
            (Some(a), Some(_)) => {
                self.report.metadata_damaged.push(format!(
                    "{what} page {:#x}/{:#x}: the two copies differ",
                    ptr.a, ptr.b
                ));
                return Ok(Some(a));
            }
            (None, None) => {
                // Reported by `rewrite_lost_pages`, as repaired or not.
                self.sh
                    .checksum_error(self.sh.seg_device((ptr.a >> 32) as u32), 1);
                self.sh
                    .checksum_error(self.sh.seg_device((ptr.b >> 32) as u32), 1);
                return Ok(None);
            }
            (Some(good), None) => {
                self.rewrite_copy(ptr.b, &good, generation)?;
                self.repaired(format!(
                    "{what} page copy B at {:#x} rewritten from copy A",
                    ptr.b
                ));
                good
            }
            (None, Some(good)) => {
                self.rewrite_copy(ptr.a, &good, generation)?;
                self.repaired(format!(
                    "{what} page copy A at {:#x} rewritten from copy B",
                    ptr.a
                ));
                good
            }
        };
        Ok(Some(body))
    }

    fn rewrite_copy(&self, addr: u64, body: &PageBody, generation: u64) -> Result<(), EngineError> {
        let bytes = encode(body, &self.sh.layout.group, generation, addr);
        let seg = (addr >> 32) as usize;
        let (dev, off) = self.sh.layout.segments[seg];
        let mut buf = AlignedBuf::new_zeroed(BLOCK);
        buf.copy_from_slice(&bytes);
        self.sh.caps[dev].write_at(&buf, off + u64::from(addr as u32) * BLOCK_U64)?;
        self.sh.caps[dev].flush()?;
        Ok(())
    }

    /// The summary of every sealed data segment, each copy part by part (the header and
    /// entries region, each crc block in use). A part damaged in one copy is rewritten from
    /// the other; one damaged in every copy (a group of format 2 has one) is reported: a crc
    /// block's data blocks cannot be read (the data pass reports them under their volumes); a
    /// header's segment can still be read but not cleaned, and, recent, would stop a start
    /// after a crash, so the index is written at once (`stop_recovery_needing_lost_summaries`).
    fn check_summaries(&mut self) -> Result<(), EngineError> {
        let sealed: Vec<u32> = {
            let segs = self.sh.segs.lock();
            segs.segs
                .iter()
                .enumerate()
                .filter(|(_, s)| s.state == SegState::Sealed)
                .map(|(i, _)| i as u32)
                .collect()
        };
        let geo = self.sh.layout.geo;
        for seg in sealed {
            {
                // As a read: the segment cannot be freed, and so rewritten by a new owner,
                // while this holds the guard (docs/FORMAT.md §5.4).
                let sh = self.sh;
                let _guard = sh.reclaim.read();
                if sh.segs.lock().segs[seg as usize].state != SegState::Sealed {
                    continue;
                }
                self.check_summary(seg);
            }
            self.report.metadata_copies_checked += u64::from(geo.summary_copies);
            self.pace(u64::from(geo.summary_copies * geo.summary_blocks) * BLOCK_U64)?;
        }
        self.stop_recovery_needing_lost_summaries();
        Ok(())
    }

    /// A segment sealed since the last index write whose summary entries no copy holds
    /// (`unmendable_recent`): a start after a crash replays such summaries over the index,
    /// and refuses to open at this one. Writing the index now takes the segment off the
    /// recent list, so no start reads it.
    fn stop_recovery_needing_lost_summaries(&mut self) {
        let segs = std::mem::take(&mut self.unmendable_recent);
        if segs.is_empty() {
            return;
        }
        let written = flush_index_now(self.sh, HEADER_DRAIN_WAIT);
        for seg in segs {
            match written {
                true => self.repaired(format!(
                    "capacity segment {seg}: its summary was needed by a start after a crash; \
                     the index was written, so no start reads it"
                )),
                false => self.report.metadata_damaged.push(format!(
                    "capacity segment {seg}: a start after a crash would refuse to open at its \
                     summary, and the index was not written within {} s: stop the daemon \
                     cleanly (a clean stop writes the index) or scrub again",
                    HEADER_DRAIN_WAIT.as_secs()
                )),
            }
        }
    }

    /// One sealed segment's summary copies, weighed part by part (`capacity::assess`): a
    /// part a copy holds damaged, or of another use of the segment (a write of that copy the
    /// device lost: it checks, but differs from the current one), is rewritten from the copy
    /// holding the current one; a part no copy can be told to hold right is reported and left
    /// as it is. The caller holds the reclaim guard.
    fn check_summary(&mut self, seg: u32) {
        let sh = self.sh;
        let copies = if sh.layout.geo.summary_copies == 1 {
            "it has one copy"
        } else {
            "both copies"
        };
        let a = match assess(sh, seg) {
            Ok(a) => a,
            Err(e) => {
                sh.checksum_error(sh.seg_device(seg), 1);
                self.report.metadata_damaged.push(format!(
                    "summary of capacity segment {seg} is damaged ({copies}: {e}); its blocks \
                     cannot be read"
                ));
                return;
            }
        };
        for part in &a.parts {
            let lost = self.lost(seg, part);
            let Some(good) = part.current else {
                sh.checksum_error(sh.seg_device(seg), 1);
                let why = unmendable(seg, part, copies, &lost);
                self.report.metadata_damaged.push(why);
                if part.what == "header" && sh.segs.lock().recent.contains(&seg) {
                    self.unmendable_recent.push(seg);
                }
                continue;
            };
            let bytes = &a.copies[good].bytes
                [part.blocks.start as usize * BLOCK..part.blocks.end as usize * BLOCK];
            let good = good as u32;
            for (bad, holds) in part.holds.iter().enumerate() {
                let bad = bad as u32;
                let what = match holds {
                    Holds::Current => continue,
                    Holds::Damaged => format!("{} rewritten", part.what),
                    Holds::Other(why) => format!(
                        "{} differed from copy {}'s (copy {}'s {why}); rewritten",
                        part.what,
                        copy_name(good),
                        copy_name(bad)
                    ),
                };
                match rewrite_summary_blocks(sh, seg, bad, part.blocks.start, bytes) {
                    Ok(()) => self.repaired(format!(
                        "summary copy {} of capacity segment {seg}: {what} from copy {}",
                        copy_name(bad),
                        copy_name(good)
                    )),
                    Err(e) => self.report.metadata_damaged.push(format!(
                        "summary copy {} of capacity segment {seg}: {} is damaged or stale and \
                         could not be rewritten: {e}",
                        copy_name(bad),
                        part.what
                    )),
                }
            }
        }
    }

    /// What a summary part no copy holds right costs.
    fn lost(&self, seg: u32, part: &Part) -> String {
        if part.what == "header" {
            // Reads check the crc blocks alone; garbage collection and recovery read the
            // entries the header's region holds.
            return "its blocks still read (their checksums are in the crc blocks), but \
                    garbage collection cannot clean the segment"
                .into();
        }
        let used = self.sh.segs.lock().segs[seg as usize].used_blocks as usize;
        let first = part.blocks.start as usize * CRCS_PER_BLOCK;
        let last = (first + CRCS_PER_BLOCK).min(used.max(first + 1)) - 1;
        format!("its data blocks {first}..={last} cannot be read")
    }
}

/// The report of a summary part no copy holds as the segment's current use wrote it.
fn unmendable(seg: u32, part: &Part, copies: &str, lost: &str) -> String {
    let what = &part.what;
    if part.holds.iter().any(|h| *h != Holds::Damaged) {
        return format!(
            "summary of capacity segment {seg}: no copy of its {what} can be told to be the \
             segment's current one ({}); not rewritten; {lost}",
            holds_text(&part.holds)
        );
    }
    match what.as_str() {
        "header" => format!("summary of capacity segment {seg} is damaged ({copies}); {lost}"),
        _ => format!("summary of capacity segment {seg} is damaged ({what}, {copies}); {lost}"),
    }
}

/// What each copy holds of a part, for a report.
fn holds_text(holds: &[Holds]) -> String {
    holds
        .iter()
        .enumerate()
        .map(|(c, h)| {
            let copy = copy_name(c as u32);
            match h {
                Holds::Current => format!("copy {copy}'s checks"),
                Holds::Damaged => format!("copy {copy}'s is damaged"),
                Holds::Other(why) => format!("copy {copy}'s {why}"),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Writes `bytes` over summary copy `copy` of segment `seg` from its block `first`, durably.
fn rewrite_summary_blocks(
    sh: &Shared,
    seg: u32,
    copy: u32,
    first: u32,
    bytes: &[u8],
) -> Result<(), EngineError> {
    let (dev, off) = sh.layout.seg_summary_byte(seg, copy);
    let mut buf = AlignedBuf::new_zeroed(bytes.len());
    buf.copy_from_slice(bytes);
    sh.caps[dev].write_at(&buf, off + u64::from(first) * BLOCK_U64)?;
    sh.caps[dev].flush()?;
    Ok(())
}

/// How long a scrub waits for the destager to move the write log past a damaged batch header,
/// or to write the index.
const HEADER_DRAIN_WAIT: Duration = Duration::from_secs(60);

/// An index or segment-table page damaged in both copies.
struct LostPage {
    ptr: PagePtr,
    /// Its place in the segment table, for a segment-table page.
    segtab: Option<usize>,
}

/// Asks the destager to write the index (`Shared::flush_asked`) and waits until a flush has
/// committed, for `wait` at most or until the group stops; whether one did.
fn flush_index_now(sh: &Shared, wait: Duration) -> bool {
    let before = sh.durable.lock().index_generation;
    crate::destage::ask_destager_until(
        sh,
        wait,
        || sh.flush_asked.store(true, Ordering::Relaxed),
        || sh.durable.lock().index_generation > before,
    )
}
