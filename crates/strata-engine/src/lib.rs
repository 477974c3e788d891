//! Strata's tier engine: one disk group = one fast device holding a durable write log, plus
//! capacity devices holding log-structured segments and the paged index that finds them.
//!
//! Guarantees (see docs/FORMAT.md for how they are kept):
//! - `write`, `write_zeroes` and `discard` return only once the change is durable on the fast
//!   device and visible to every reader;
//! - reads return the newest completed copy from either tier, zeros where nothing was written,
//!   and an error, never wrong data, when a checksum does not match;
//! - a snapshot holds exactly the writes completed before it was taken;
//! - after a crash or power loss, `open` restores every completed write.

mod bypass;
mod cache;
mod capacity;
mod ctree;
mod destage;
mod error;
pub mod format;
pub mod heat;
mod hidden;
mod layout;
mod log;
mod maint;
mod map;
mod meta;
mod open;
mod open_control;
mod policy;
mod queue;
mod rangelock;
mod read_async;
mod replay;
mod reread;
mod resolve;
mod room;
mod runtime;
mod scrub;
mod shared;
mod space;
mod streams;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_bypass;
#[cfg(test)]
mod tests_cache_races;
#[cfg(test)]
mod tests_clone_space;
#[cfg(test)]
mod tests_damage;
#[cfg(test)]
mod tests_figures;
#[cfg(test)]
mod tests_full_gaps;
#[cfg(test)]
mod tests_log_full;
#[cfg(test)]
mod tests_model_full;
#[cfg(test)]
mod tests_model_policy;
#[cfg(test)]
mod tests_log_headers;
#[cfg(test)]
mod tests_open;
#[cfg(test)]
mod tests_panics;
#[cfg(test)]
mod tests_read_async;
#[cfg(test)]
mod tests_reread;
#[cfg(test)]
mod tests_room;
#[cfg(test)]
mod tests_rotate;
#[cfg(test)]
mod tests_runs;
#[cfg(test)]
mod tests_scrub;
#[cfg(test)]
mod tests_scrub_memory;
#[cfg(test)]
mod tests_snap;
#[cfg(test)]
mod tests_space;
#[cfg(test)]
mod tests_stamps;
#[cfg(test)]
mod tests_stripes;
#[cfg(test)]
mod tests_summary;
#[cfg(test)]
mod tests_superblocks;
#[cfg(test)]
mod tests_tables;
#[cfg(test)]
mod tests_tiering;
mod tiering;
mod volumes;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use serde::Serialize;
use strata_device::{AlignedBuf, Device, DeviceStats};

pub use error::EngineError;
pub use format::DeviceWear;
/// What open decides from a device alone: its superblock, and whether it is blank.
pub use layout::{check_blank, read_superblock, MIN_FAST_BYTES};
pub use maint::MIN_INDEX_CACHE_BYTES;
pub use map::{ExtentMap, Loc};
pub use open::{BatchLimits, OpenReport};
pub use open_control::{OpenControl, OpenProgress, OpenStep};
pub use policy::{Clock, ManualClock, Mode, Policy, SystemClock};
pub use read_async::{ReadDone, MAX_ASYNC_READ_BYTES};
pub use replay::SkippedRecords;
pub use runtime::VolumeFigures;
pub use scrub::{BadBlock, ScrubOptions, ScrubReport, ScrubStatus};
pub use space::SpaceReport;
pub use volumes::{SnapshotInfo, ViewInfo};

use format::{RecordKind, BLOCK, BLOCK_U64};
use log::WriteReq;
use runtime::VolRuntime;
use shared::{Shared, STATE_RUNNING, STATE_STOPPING};

/// A volume or snapshot id (ids are never reused).
pub type VolumeId = u32;

/// Called once an asynchronous write completes (see `DiskGroup::write_async`).
pub type WriteDone = Box<dyn FnOnce(Result<(), EngineError>) + Send + 'static>;

/// Largest volume Strata creates (256 TiB).
pub const MAX_VOLUME_BYTES: u64 = 256 << 40;

/// What a request cut off while it waited for its volume's limits was (`cut_limit_waits`).
const LIMIT_WAIT: &str = "a request waiting for its volume's limits";
pub const MAX_VOLUMES: usize = 4096;
pub const MAX_SNAPSHOTS: usize = 16384;
pub const MAX_VOLUME_NAME: usize = 64;
/// Largest data record the log takes; bigger writes are split.
const MAX_RECORD_BLOCKS: u64 = 256;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Size of a capacity segment (the unit of destage and of garbage collection); with
    /// `auto_segment_size`, the largest size a format may choose.
    pub segment_size_bytes: u64,
    /// A format halves `segment_size_bytes` (down to 1 MiB) while the capacity devices would
    /// hold fewer than `AUTO_MIN_SEGMENTS` segments of it. A small tier of large segments
    /// keeps too many of its bytes back (the index's reserve is counted in segments) and
    /// its GC finds no victim empty enough: a 248 MiB tier of 8 MiB segments refused random
    /// overwrites of 160 MiB of data for good, one of 1 MiB segments took them.
    pub auto_segment_size: bool,
    /// Below this log fill the destager idles.
    pub fill_ratio_low: f64,
    /// Above this log fill the destager runs flat out and new writes are paced.
    pub fill_ratio_high: f64,
    /// Largest group-commit batch, header block included; with `auto_max_batch`, the largest
    /// an open may choose.
    pub max_batch_bytes: usize,
    /// An open lowers `max_batch_bytes` to what the group allows (half a segment's data area,
    /// a quarter of the log) instead of refusing it.
    pub auto_max_batch: bool,
    /// Clean index leaves kept in memory (bytes of 4 KiB pages; the bound on the capacity
    /// index's RAM besides its inner nodes).
    pub index_cache_bytes: u64,
    /// A background scrub of everything starts this long after the last scrub of everything
    /// ended (one through the API too; before a restart too, with `scrub_record`, which also
    /// keeps when a group not yet scrubbed whole was first opened, to count from), and at
    /// most this long after opening; None: no background scrub.
    pub scrub_interval: Option<Duration>,
    /// Read rate of the background scrub, bytes per second (0: unlimited).
    pub scrub_rate_bytes_per_s: u64,
    /// Where the last scrub's report is kept across restarts (the daemon's data directory),
    /// so that `scrub_interval` counts from the last scrub of everything, not from the last
    /// start, and the last result survives a restart; None: memory only. The file is this
    /// path with the group's id in its name (`scrub-last.json`: `scrub-last-<id>.json`), so
    /// that groups whose daemons share a data directory keep a record each; a record at the
    /// path itself, as builds before wrote it, is taken over when it is this group's.
    pub scrub_record: Option<std::path::PathBuf>,
    /// After the host has neither read nor written for this long, the destager frees the log
    /// down to the low mark, hot data or not; None: only the fill level and the load decide.
    pub idle_destage_after: Option<Duration>,
    /// Share of the write log's area the read cache may hold (0: no read cache). Hybrid
    /// setups (rotational capacity devices) use 0.7 by default; all-flash, none.
    pub read_cache_ratio: f64,
    /// Writes made one at a time on an idle log (queue depth one) extend a run of the log:
    /// each writes its data block and a whole header copy over the run's older copy, so n
    /// such writes take n + 2 log blocks instead of 2n (FORMAT.md §3.3.1). It halves the log
    /// such a load takes, and with it the destager's cleaning; each write then makes two
    /// device writes at once instead of one, which on a fast tier that is a file on ext4 cost
    /// ~20 µs more at the median (docs/BENCHMARKS.md). Off by default.
    pub log_runs: bool,
    /// Time as policies see it (ages, promotion windows, I/O limits); tests inject their own.
    pub clock: Arc<dyn Clock>,
    /// The format blank devices are given (docs/FORMAT.md §3.1): `format::GROUP_VERSION` (3,
    /// every segment summary written twice), or 2 (one copy, which builds older than format 3
    /// also open). A group already formatted keeps its own.
    pub format_version: u32,
    /// Open a group whose write log holds batches that cannot be read although later batches
    /// record them as acknowledged (or that a clean shutdown recorded), by skipping them: the
    /// writes they held are lost and their blocks read as older data. Off, such an open fails
    /// and writes nothing. An operator's choice for one start, not a standing setting.
    pub skip_damaged_log_batches: bool,
}

/// The last batch a start found with a damaged header that the log still holds (salvaged, or
/// skipped in place of the batches it could not read).
fn log_repair_seq(report: &OpenReport) -> Option<u64> {
    let skipped = report
        .skipped_log_records
        .iter()
        .filter(|s| s.blocks > 0)
        .map(|s| s.first_seq);
    report
        .salvaged_log_headers
        .iter()
        .copied()
        .chain(skipped)
        .max()
}

/// Destages the write log past the batch at `seq` (see `log_repair_seq`), however long that
/// takes (the capacity tier may be full for a while), or until the group stops.
fn repair_log(sh: &Shared, seq: u64) {
    const FOR_GOOD: Duration = Duration::from_secs(365 * 24 * 3600);
    if destage::destage_past(sh, seq, FOR_GOOD) {
        tracing::info!(
            seq,
            "the write log was destaged past the batch headers its start found damaged; a start no longer reads them"
        );
    }
}

impl EngineConfig {
    /// Checks the settings that do not depend on the devices, so that a caller can refuse
    /// them before it creates or formats any (opening checks them again).
    pub fn validate(&self) -> Result<(), EngineError> {
        open::validate_config(self)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            segment_size_bytes: 8 << 20,
            auto_segment_size: false,
            fill_ratio_low: 0.30,
            fill_ratio_high: 0.70,
            max_batch_bytes: 2 << 20,
            auto_max_batch: false,
            index_cache_bytes: 64 << 20,
            scrub_interval: None,
            scrub_rate_bytes_per_s: 64 << 20,
            scrub_record: None,
            idle_destage_after: Some(Duration::from_secs(1)),
            read_cache_ratio: 0.0,
            log_runs: false,
            clock: Arc::new(SystemClock::default()),
            format_version: format::GROUP_VERSION,
            skip_damaged_log_batches: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct VolumeInfo {
    pub id: VolumeId,
    pub name: String,
    pub size_bytes: u64,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum ExtentKind {
    Data,
    Zero,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub kind: ExtentKind,
}

/// A capacity device out of room, as `EngineStats` reports it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OutOfRoomStats {
    /// The last failed write's error (device, offset, the system's message).
    pub error: String,
    pub since_s: f64,
    /// Writes that failed for want of room since it began.
    pub failed_writes: u64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStats {
    pub io_backend: String,
    pub fast_device: DeviceStats,
    pub capacity_devices: Vec<DeviceStats>,
    pub log_capacity_bytes: u64,
    pub log_used_bytes: u64,
    pub log_fill_ratio: f64,
    pub fill_ratio_low: f64,
    pub fill_ratio_high: f64,
    pub destage_rate_bytes_per_s: f64,
    pub destage_bandwidth_bytes_per_s: f64,
    /// Live host data in the log not destaged yet: what the destager still has to write to
    /// the capacity tier (hot data it keeps on the fast tier included). Data overwritten,
    /// trimmed or deleted is not counted, though it holds log space until the tail passes it
    /// (`log_dead_bytes`).
    pub destage_backlog_bytes: u64,
    /// Log space held by what no reader needs: data overwritten, trimmed or deleted, batch
    /// headers and zero records, and the blocks skipped at the log area's end when a batch
    /// wrapped. It counts in the fill (the log reuses it only once the tail passes it), but
    /// nothing of it is written to the capacity tier. With `destage_backlog_bytes` and
    /// `read_cache_log_bytes` it makes `log_used_bytes`.
    pub log_dead_bytes: u64,
    pub destaged_bytes_total: u64,
    pub host_write_bytes_total: u64,
    pub host_read_bytes_total: u64,
    /// Admission control holds host writes back (`admission` is not "open"): the fill is
    /// above the high mark, so they are paced to the rate the destager frees the log (or,
    /// before one is measured after a start, wait once the log has no room), or the log has
    /// no room for a batch now.
    pub admission_throttled: bool,
    /// How the next host write is admitted, from the log as it stands: "open", "throttled"
    /// (paced), "measuring" (above the high mark, no rate to pace at measured yet since the
    /// start: writes go while the log has room, then wait) or "waiting_for_room" (the log
    /// has no room for a batch: writes wait for the destager).
    pub admission: String,
    pub capacity_full: bool,
    /// A capacity device had no room for a write (its file system is full): capacity writes
    /// pause and the tier counts as full until one succeeds again (room.rs). None otherwise.
    pub capacity_out_of_room: Option<OutOfRoomStats>,
    /// The destager thread's nice value: 19 while it works ahead of need (when the daemon may
    /// raise it again), its starting value while the log needs room.
    pub destager_nice: i64,
    /// What reads find on the fast tier: the live host data in the log
    /// (`destage_backlog_bytes`) and the read cache's copies (`read_cache_bytes`).
    pub fast_resident_bytes: u64,
    pub capacity_total_bytes: u64,
    pub capacity_used_bytes: u64,
    pub capacity_live_bytes: u64,
    /// Capacity-tier space destage leaves free for garbage collection and index flushes
    /// (`destage::gc_reserve` segments): the tier counts as full with this much still free.
    pub capacity_reserved_bytes: u64,
    pub segments_total: u64,
    pub segments_free: u64,
    pub gc_segments_cleaned_total: u64,
    pub gc_relocated_bytes_total: u64,
    /// Sealed segments garbage collection cannot clean now: their summary could not be read
    /// (damaged in both copies, or an I/O error; scrub names them). Their space stays used.
    pub gc_segments_passed_over: u64,
    /// Hot data written again at the log head instead of being destaged.
    pub hot_kept_bytes_total: u64,
    /// Lone host writes that extended a run of the log instead of taking a header block.
    pub log_run_writes_total: u64,
    /// Tail batches of a full log freed by rotation (docs/FORMAT.md §4.7): their live data
    /// written again at the head so that trims and overwrites give their blocks back.
    pub log_rotated_batches_total: u64,
    /// The destager is rotating a full log now (both tiers full, a plan shows room coming back).
    pub log_rotating: bool,
    /// Reads of metadata (index pages, segment summaries) whose first copy was damaged or
    /// unreadable and whose other copy served them: the first copy needs a scrub to mend it.
    pub metadata_copy_fallbacks_total: u64,
    pub checksum_errors_total: u64,
    /// Of `checksum_errors_total`, those since the last scrub of everything in this run ended
    /// (all of them before one): the earlier ones it repaired or reported.
    pub checksum_errors_since_scrub: u64,
    /// Of `metadata_copy_fallbacks_total`, those since the last scrub of everything ended.
    pub metadata_copy_fallbacks_since_scrub: u64,
    /// Checksum failures by device: the fast device first, then the capacity devices.
    pub checksum_errors_by_device: Vec<u64>,
    /// Write-log records this start could not read and skipped, as asked
    /// (`EngineConfig::skip_damaged_log_batches`): writes lost. 0 normally.
    pub log_records_lost_at_start: u64,
    /// The write log still holds a batch whose header this start found damaged (salvaged, or
    /// skipped): the log is being destaged past it; until then a restart reads it again (and
    /// one skipped needs skipping again).
    pub log_damage_pending: bool,
    /// Host reads served from the fast tier, the capacity tier, and from never-written space.
    pub read_fast_bytes_total: u64,
    pub read_capacity_bytes_total: u64,
    pub read_unwritten_bytes_total: u64,
    /// The read cache: host reads its copies served, what it holds and may hold, copies it
    /// took (promoted, or kept when data read in the write log was destaged) and copies dropped
    /// from it (promoted + kept - evicted = held), and promotions refused for want of room.
    pub read_cached_bytes_total: u64,
    pub read_cache_bytes: u64,
    /// Log space the cache's records hold: its copies, and copies the tail has not passed yet
    /// whose block was written again at the head (a copy read since the last pass) or
    /// forgotten; `read_cache_log_bytes - read_cache_bytes` is that overhead.
    pub read_cache_log_bytes: u64,
    pub read_cache_budget_bytes: u64,
    pub promoted_bytes_total: u64,
    pub kept_bytes_total: u64,
    pub evicted_bytes_total: u64,
    pub promotions_refused_total: u64,
    /// Promotions skipped because the log writer's queue was full (the log was busy).
    pub promotions_skipped_total: u64,
    /// Entries of the fast-tier maps.
    pub index_runs: u64,
    /// The capacity index: pages on the devices, leaves and inner nodes in memory, flushes.
    pub index_pages_bytes: u64,
    pub index_resident_leaves: u64,
    pub index_resident_inner: u64,
    /// Heap bytes of the index nodes in memory (the capacity index's RAM).
    pub index_resident_bytes: u64,
    pub index_dirty_nodes: u64,
    pub index_flushes_total: u64,
    pub index_page_reads_total: u64,
    pub index_pages_written_total: u64,
    pub state: String,
    /// Why the group went offline (`state` "failed"): the device error or the internal error.
    pub failure: Option<String>,
}

pub struct DiskGroup {
    sh: Arc<Shared>,
    tx: Mutex<Option<queue::LogQueue>>,
    /// The log writer, for host writes its sender's thread may write itself while the log is
    /// idle (`LogWriter::try_inline`); the committer threads own it.
    writer: std::sync::Weak<log::LogWriter>,
    /// Sequential writes for the destager to put straight into segments (see bypass.rs).
    bypass_tx: Sender<bypass::BypassJob>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    report: OpenReport,
}

impl DiskGroup {
    /// Opens the disk group on these devices, recovering it; formats blank devices when
    /// `create_if_blank`. Refuses devices of another group or another format.
    pub fn open(
        fast: Arc<dyn Device>,
        capacity: Vec<Arc<dyn Device>>,
        cfg: EngineConfig,
        create_if_blank: bool,
    ) -> Result<Arc<DiskGroup>, EngineError> {
        Self::open_with(
            fast,
            capacity,
            cfg,
            create_if_blank,
            &OpenControl::default(),
        )
    }

    /// [`DiskGroup::open`], watched through `ctl.progress` and stopped by setting
    /// `ctl.abandon`: until the log's replay has ended, the open then fails with
    /// `EngineError::Cancelled` at its next safe point, the devices left as the next open
    /// recovers them with nothing acknowledged lost; after it, the open runs to its end.
    pub fn open_with(
        fast: Arc<dyn Device>,
        capacity: Vec<Arc<dyn Device>>,
        cfg: EngineConfig,
        create_if_blank: bool,
        ctl: &OpenControl,
    ) -> Result<Arc<DiskGroup>, EngineError> {
        let (sh, report) = open::open_shared(fast, capacity, cfg, create_if_blank, ctl)?;
        let queue::Queues {
            host: tx,
            hot: tx_hot,
            host_rx: rx,
            hot_rx: rx_hot,
            bell,
        } = queue::Queues::new(log::QUEUE_DEPTH, log::IDLE_RECHECK)?;
        let writer = Arc::new(log::LogWriter::new(sh.clone(), rx, rx_hot, bell)?);
        let (bypass_tx, bypass_rx) = crossbeam_channel::bounded(bypass::BYPASS_QUEUE);
        let destager = destage::Destager::new(sh.clone(), tx_hot, bypass_rx);
        let mut threads = writer.start()?;
        let writer = Arc::downgrade(&writer);
        let sh_destage = sh.clone();
        let t2 = std::thread::Builder::new()
            .name("strata-destage".into())
            .spawn(move || sh_destage.run_guarded("strata-destage", || destager.run()));
        let mut spawned = vec![t2];
        scrub::restore(&sh);
        if let Some(every) = sh.cfg.scrub_interval {
            let sh2 = sh.clone();
            spawned.push(
                std::thread::Builder::new()
                    .name("strata-scrub".into())
                    .spawn(move || scrub::background(sh2, every)),
            );
        }
        if let Some(seq) = log_repair_seq(&report) {
            let sh2 = sh.clone();
            spawned.push(
                std::thread::Builder::new()
                    .name("strata-log-repair".into())
                    .spawn(move || repair_log(&sh2, seq)),
            );
        }
        for t in spawned {
            threads.push(
                t.map_err(|e| EngineError::Failed(format!("cannot start engine threads: {e}")))?,
            );
        }
        tracing::info!(
            formatted = report.formatted,
            replayed_batches = report.replayed_batches,
            replayed_records = report.replayed_records,
            recent_segments = report.recent_segments,
            "disk group open"
        );
        Ok(Arc::new(DiskGroup {
            sh,
            tx: Mutex::new(Some(tx)),
            writer,
            bypass_tx,
            threads: Mutex::new(threads),
            report,
        }))
    }

    /// Whether the write log still holds a batch whose header a start found damaged (salvaged
    /// or skipped): until the log is destaged past it, each start reads it again, and a
    /// skipped one needs `skip_damaged_log_batches` again.
    pub fn log_damage_pending(&self) -> bool {
        log_repair_seq(&self.report).is_some_and(|seq| {
            self.sh
                .log
                .lock()
                .batches
                .front()
                .is_some_and(|b| b.first_seq <= seq)
        })
    }

    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// Lifetime bytes written to each device as the device saw them (fast first, then the
    /// capacity devices in `stats().capacity_devices` order), persisted in the checkpoint.
    pub fn device_wear(&self) -> Vec<DeviceWear> {
        self.sh.device_wear()
    }

    /// Each device's size when the group was formatted on it, the fast device first, in the
    /// order of `device_wear`: what the group writes to. A device grown since is larger
    /// (`Device::size_bytes`), and the rest of it is never written.
    pub fn formatted_device_sizes(&self) -> Vec<u64> {
        self.sh.layout.device_sizes_bytes.clone()
    }

    /// Checks a view's range; returns (top layer, read_only).
    fn view_range(
        &self,
        view: VolumeId,
        offset: u64,
        len: u64,
    ) -> Result<(u32, bool), EngineError> {
        let idx = self.sh.index.read();
        let v = idx.view(view)?;
        if offset.checked_add(len).is_none_or(|e| e > v.size_bytes) {
            return Err(EngineError::OutOfRange {
                offset,
                len,
                size_bytes: v.size_bytes,
            });
        }
        Ok((v.chain.first().copied().unwrap_or(0), v.read_only))
    }

    /// The head layer of a volume for a write of `[offset, offset+len)`.
    fn writable_head(&self, vol: VolumeId, offset: u64, len: u64) -> Result<u32, EngineError> {
        let (head, read_only) = self.view_range(vol, offset, len)?;
        if read_only {
            return Err(EngineError::ReadOnly(format!("snapshot #{vol}")));
        }
        Ok(head)
    }

    /// Fills `buf` from the view (volume or snapshot) at byte `offset`. A volume's reads wait
    /// for its I/O limits, count in its figures and may promote what they read.
    pub fn read(&self, view: VolumeId, offset: u64, buf: &mut [u8]) -> Result<(), EngineError> {
        self.read_as(view, offset, buf, None)
    }

    /// [`DiskGroup::read`]; with `admitted`, the read was already admitted against the
    /// volume's limits and noted in its stream detector (an asynchronous read done again the
    /// blocking way), and this is how long a sequential stream it continued.
    pub(crate) fn read_as(
        &self,
        view: VolumeId,
        offset: u64,
        buf: &mut [u8],
        admitted: Option<u64>,
    ) -> Result<(), EngineError> {
        let (top, _) = self.view_range(view, offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let rt = self.sh.runtime(view);
        if rt.is_none() && admitted.is_none() {
            // A snapshot's reads wait for its volume's limits (they are not the volume's
            // reads otherwise: no heat, hit ratio or promotion of its own).
            if let Some(limits) = self.sh.snapshot_limits(view) {
                let running = || self.sh.limits_hold();
                let (clock, bytes) = (&*self.sh.cfg.clock, buf.len() as u64);
                if !limits.admit_snapshot_read(view, clock, bytes, &running) {
                    return Err(EngineError::Cancelled(LIMIT_WAIT));
                }
            }
        }
        let mut host = None;
        if let Some(rt) = rt.as_ref() {
            let sequential_bytes = match admitted {
                Some(bytes) => bytes,
                None => {
                    let running = || self.sh.limits_hold();
                    if !rt.admit(&*self.sh.cfg.clock, buf.len() as u64, &running) {
                        return Err(EngineError::Cancelled(LIMIT_WAIT));
                    }
                    rt.reads.lock().note(offset, buf.len() as u64)
                }
            };
            host = Some(HostRead {
                rt: rt.as_ref(),
                head: top,
                sequential_bytes,
                counted: std::cell::Cell::new(None),
            });
        }
        let (b0, b1) = block_span(offset, buf.len() as u64);
        let mut tmp = AlignedBuf::new_zeroed(((b1 - b0) * BLOCK_U64) as usize);
        self.read_view(view, b0, b1 - b0, &mut tmp, host.as_ref(), true)?;
        let at = (offset - b0 * BLOCK_U64) as usize;
        buf.copy_from_slice(&tmp[at..at + buf.len()]);
        self.sh
            .counters
            .host_read_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn read_blocks(
        &self,
        view: VolumeId,
        lba: u64,
        n: u64,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        self.read_view(view, lba, n, out, None, false)
    }

    /// Reads blocks of `view`. `host`: a volume's read, which its runtime notes (heat,
    /// promotion); `counted`: a client's read (a volume's or a snapshot's), which the node's
    /// read figures count by where it was served from. Reads the engine makes for itself
    /// (the edges of a partial-block write) are neither.
    fn read_view(
        &self,
        view: VolumeId,
        lba: u64,
        n: u64,
        out: &mut [u8],
        host: Option<&HostRead<'_>>,
        counted: bool,
    ) -> Result<(), EngineError> {
        let sh = &self.sh;
        let _shared = sh.reclaim.read();
        let pieces = resolve::resolve_view(sh, view, lba, n)?;
        let count = |counter: &AtomicU64, bytes: u64| {
            if counted {
                counter.fetch_add(bytes, Ordering::Relaxed);
            }
        };
        for p in pieces {
            let at = ((p.lba - lba) * BLOCK_U64) as usize;
            let dst = &mut out[at..at + (p.len * BLOCK_U64) as usize];
            let piece_bytes = p.len * BLOCK_U64;
            match p.loc {
                None | Some(Loc::Zero(_)) => {
                    dst.fill(0);
                    count(&sh.counters.read_unwritten_bytes, piece_bytes);
                }
                Some(Loc::Fast(b)) => {
                    count(&sh.counters.read_fast_bytes, piece_bytes);
                    sh.fast.read_at(dst, sh.layout.log_byte(b))?;
                    if let Some(&k) = reread::mend_log(sh, b, dst).first() {
                        return Err(self.corrupt(view, p.lba + k as u64, "fast", 0));
                    }
                    if let Some(h) = host {
                        h.rt.stats
                            .read_fast_blocks
                            .fetch_add(p.len, Ordering::Relaxed);
                        sh.note_read_heat(h.rt, p.layer, p.lba, p.len);
                        if sh.cfg.read_cache_ratio > 0.0 {
                            sh.fast_read.mark(b, p.len);
                        }
                    }
                }
                Some(Loc::Cap { seg, block }) => {
                    self.read_capacity(view, host, counted, p.lba, seg, block, p.len as u32, dst)?
                }
            }
        }
        Ok(())
    }

    /// Reads blocks stored on the capacity tier: from their cached copies where the read
    /// cache has valid ones, else from the segment (then perhaps promoting them).
    #[allow(clippy::too_many_arguments)]
    fn read_capacity(
        &self,
        view: VolumeId,
        host: Option<&HostRead<'_>>,
        counted: bool,
        lba: u64,
        seg: u32,
        block: u32,
        n: u32,
        dst: &mut [u8],
    ) -> Result<(), EngineError> {
        let sh = &self.sh;
        let (cached, gen) = {
            let mut c = sh.cache.lock();
            let cached: Vec<Option<u64>> = if c.entries() == 0 {
                Vec::new()
            } else {
                (0..n).map(|i| c.lookup(seg, block + i)).collect()
            };
            (cached, c.gen_of(seg))
        };
        let at = |i: u32| cached.get(i as usize).copied().flatten();
        let mut i = 0;
        while i < n {
            // The longest part that is all uncached, or all cached in consecutive log blocks.
            let first = at(i);
            let mut j = i + 1;
            while j < n && at(j) == first.map(|f| f + u64::from(j - i)) {
                j += 1;
            }
            let part = &mut dst[i as usize * BLOCK..j as usize * BLOCK];
            let blocks = u64::from(j - i);
            if first.is_some_and(|f| self.read_cached(seg, block + i, f, part)) {
                if counted {
                    sh.counters
                        .read_cached_bytes
                        .fetch_add(blocks * BLOCK_U64, Ordering::Relaxed);
                }
                if let Some(h) = host {
                    h.rt.stats
                        .read_cached_blocks
                        .fetch_add(blocks, Ordering::Relaxed);
                }
            } else {
                if counted {
                    sh.counters
                        .read_capacity_bytes
                        .fetch_add(blocks * BLOCK_U64, Ordering::Relaxed);
                }
                let crcs = capacity::block_crcs(sh, seg, block + i, j - i)?;
                if let Some(bad) =
                    capacity::read_seg_blocks(sh, seg, block + i, j - i, part, &crcs)?
                {
                    return Err(self.corrupt(
                        view,
                        lba + u64::from(bad - block),
                        "capacity",
                        sh.seg_device(seg),
                    ));
                }
                if let Some(h) = host {
                    h.rt.stats
                        .read_capacity_blocks
                        .fetch_add(blocks, Ordering::Relaxed);
                    if sh.cfg.read_cache_ratio > 0.0 {
                        let p = h.rt.policy();
                        let now = sh.cfg.clock.now_ms();
                        let first = lba + u64::from(i);
                        let mut counted = h.counted.get();
                        let wanted = sh.cache.lock().note_miss(
                            &p,
                            h.head,
                            first,
                            blocks,
                            h.sequential_bytes,
                            now,
                            &mut counted,
                        );
                        h.counted.set(counted);
                        for (from, n) in wanted {
                            let k = (from - first) as usize;
                            let copy = &part[k * BLOCK..(k + n as usize) * BLOCK];
                            self.promote(Some(h.rt), seg, block + i + k as u32, gen, copy);
                        }
                    }
                }
            }
            i = j;
        }
        Ok(())
    }

    /// Reads a cached copy; false (and the copy forgotten) when it cannot be read or fails
    /// its checksum: the caller then reads the capacity tier, so a damaged clean copy costs
    /// a miss, never wrong data.
    fn read_cached(&self, seg: u32, block: u32, fast: u64, part: &mut [u8]) -> bool {
        let sh = &self.sh;
        let read = sh.fast.read_at(part, sh.layout.log_byte(fast)).is_ok();
        let ok = read
            && part.chunks(BLOCK).enumerate().all(|(k, c)| {
                crc32c::crc32c(c) == sh.fast_crcs[fast as usize + k].load(Ordering::Relaxed)
            });
        if !ok {
            unusable_copy(sh, seg, block, (part.len() / BLOCK) as u32, fast, read);
        }
        ok
    }

    fn corrupt(&self, view: VolumeId, lba: u64, tier: &str, dev: usize) -> EngineError {
        corrupt_error(&self.sh, view, lba, tier, dev)
    }

    /// Writes `data` at byte `offset` of a volume; returns once it is durable on the fast tier.
    pub fn write(&self, vol: VolumeId, offset: u64, data: &[u8]) -> Result<(), EngineError> {
        self.sh.check_running()?;
        self.admit(vol, data.len() as u64)?;
        let (b0, b1) = block_span(offset, data.len() as u64);
        let blocks = (b1 - b0).min(self.max_record_blocks());
        let placed = Placed::default();
        self.with_rotation(blocks, || self.write_admitted(vol, offset, data, &placed))
    }

    /// Runs a host request (idempotent, holding no lock), first waiting for rotation if the
    /// tiers are full (`Shared::wait_for_rotation`). Refused with NoSpace when the wait did
    /// not give up (the tiers filled while it went, or the room the wait saw was taken before
    /// the request was placed, by the destager's own rewrites), it waits and tries again, a
    /// few times at most.
    fn with_rotation(
        &self,
        data_blocks: u64,
        request: impl Fn() -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        const TRIES: usize = 4;
        let mut waited = self.sh.wait_for_rotation(data_blocks);
        for _ in 1..TRIES {
            match request() {
                Err(EngineError::NoSpace) if waited != shared::RotationWait::GaveUp => {
                    waited = self.sh.wait_for_rotation(data_blocks);
                }
                r => return r,
            }
        }
        request()
    }

    fn write_admitted(
        &self,
        vol: VolumeId,
        offset: u64,
        data: &[u8],
        placed: &Placed,
    ) -> Result<(), EngineError> {
        let (b0, b1) = block_span(offset, data.len() as u64);
        let gate = self.sh.gate(vol);
        let _g = gate.read();
        let head = self.writable_head(vol, offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let _r = self.sh.ranges.lock(head, b0, b1);
        let whole =
            offset.is_multiple_of(BLOCK_U64) && (data.len() as u64).is_multiple_of(BLOCK_U64);
        if let Some(rt) = self.sh.runtime(vol) {
            let stream = rt.writes.lock().note(offset, data.len() as u64);
            let len = data.len() as u64;
            if whole && bypass::wanted(&self.sh, &rt.policy(), stream, len, false) {
                return self.write_bypass(&rt, head, b0, data);
            }
        }
        self.write_locked(vol, head, offset, data, placed)
    }

    /// Writes whole blocks straight to the capacity tier (see bypass.rs); a part the destager
    /// could not place goes through the log instead. Durable when it returns.
    fn write_bypass(
        &self,
        rt: &VolRuntime,
        head: u32,
        lba: u64,
        data: &[u8],
    ) -> Result<(), EngineError> {
        let geo = self.sh.layout.geo;
        // One job per segment at most, leaving the summary entry room to spare.
        let job_blocks = u64::from(geo.data_blocks).min(MAX_RECORD_BLOCKS);
        let mut jobs = Vec::new();
        for (k, chunk) in data.chunks((job_blocks * BLOCK_U64) as usize).enumerate() {
            let at = lba + k as u64 * job_blocks;
            let (done, wait) = crossbeam_channel::bounded(1);
            let mut d = AlignedBuf::new_zeroed(chunk.len());
            d.copy_from_slice(chunk);
            let job = bypass::BypassJob {
                layer: head,
                lba: at,
                data: d,
                done,
            };
            let queued = self.bypass_tx.send(job).is_ok();
            jobs.push((at, chunk, queued.then_some(wait)));
        }
        self.sh.wake_destager();
        let mut waits = Vec::new();
        for (at, chunk, wait) in jobs {
            let nb = chunk.len() as u64 / BLOCK_U64;
            let bypassed = wait.is_some_and(|w| matches!(w.recv(), Ok(Ok(()))));
            if bypassed {
                waits.push(self.submit(RecordKind::Forget, head, at, nb, None)?);
                rt.stats.bypassed_blocks.fetch_add(nb, Ordering::Relaxed);
            } else {
                // A job may span a segment's data area; a record must fit a batch.
                let mut records = Vec::new();
                self.submit_records(head, at, chunk, &Placed::default(), &mut records)?;
                waits.extend(records.into_iter().map(|(_, w)| w));
            }
        }
        // (The log counts the Forget records' ranges as host writes.)
        wait_all(waits)
    }

    /// Read-modify-write of the partial blocks at either end, then the whole blocks.
    fn write_locked(
        &self,
        vol: VolumeId,
        head: u32,
        offset: u64,
        data: &[u8],
        placed: &Placed,
    ) -> Result<(), EngineError> {
        let (b0, b1) = block_span(offset, data.len() as u64);
        let n = b1 - b0;
        let record_blocks = self.max_record_blocks();
        if offset.is_multiple_of(BLOCK_U64)
            && data.len() as u64 == n * BLOCK_U64
            && n <= record_blocks
        {
            // Whole blocks in one record: one copy, straight into the request.
            let d = AlignedBuf::from_slice(data);
            return self.submit(RecordKind::Write, head, b0, n, Some(d))?.wait();
        }
        let mut buf = AlignedBuf::new_zeroed((n * BLOCK_U64) as usize);
        let head_gap = (offset - b0 * BLOCK_U64) as usize;
        let end = head_gap + data.len();
        if head_gap != 0 {
            self.read_blocks(vol, b0, 1, &mut buf[..BLOCK])?;
        }
        if !end.is_multiple_of(BLOCK) && (n > 1 || head_gap == 0) {
            let at = ((n - 1) * BLOCK_U64) as usize;
            self.read_blocks(vol, b1 - 1, 1, &mut buf[at..])?;
        }
        buf[head_gap..end].copy_from_slice(data);
        let mut waits = Vec::new();
        let submitted = self.submit_records(head, b0, &buf, placed, &mut waits);
        // Every record submitted is waited for (and noted if placed), even after an error.
        let mut result = submitted;
        for (k, w) in waits {
            match w.wait() {
                Ok(()) => placed.note(k),
                Err(e) if result.is_ok() => result = Err(e),
                Err(_) => {}
            }
        }
        result
    }

    /// Submits whole blocks at `lba` as Write records of at most `max_record_blocks` each,
    /// but for those `placed` holds already; each wait comes with its record's index.
    fn submit_records(
        &self,
        head: u32,
        lba: u64,
        data: &[u8],
        placed: &Placed,
        waits: &mut Vec<(usize, log::ReplyRx)>,
    ) -> Result<(), EngineError> {
        let per_record = self.max_record_blocks() as usize * BLOCK;
        placed.begin(head);
        for (k, chunk) in data.chunks(per_record).enumerate() {
            if placed.holds(k) {
                continue;
            }
            let mut d = AlignedBuf::new_zeroed(chunk.len());
            d.copy_from_slice(chunk);
            let nb = chunk.len() as u64 / BLOCK_U64;
            let at = lba + (k * per_record / BLOCK) as u64;
            waits.push((k, self.submit(RecordKind::Write, head, at, nb, Some(d))?));
        }
        Ok(())
    }

    /// The most blocks one Write record takes: with its batch header it must fit one batch,
    /// and so one segment.
    fn max_record_blocks(&self) -> u64 {
        (self.sh.cfg.max_batch_bytes as u64 / BLOCK_U64 - 1).min(MAX_RECORD_BLOCKS)
    }

    /// Waits until the volume's I/O limits admit a request (no wait without limits); an
    /// error when the group stopped running meanwhile, or the wait was cut off
    /// (`cut_limit_waits`).
    fn admit(&self, vol: VolumeId, bytes: u64) -> Result<(), EngineError> {
        if let Some(rt) = self.sh.runtime(vol) {
            let running = || self.sh.limits_hold();
            if !rt.admit(&*self.sh.cfg.clock, bytes, &running) {
                return Err(EngineError::Cancelled(LIMIT_WAIT));
            }
        }
        self.sh.check_running()
    }

    /// From now on no request waits for a volume's IOPS or bandwidth limits: those waiting go
    /// on at once (within 20 ms), as do later ones. For a clean stop, which answers every
    /// request it has taken in and should not wait for each one's turn under a limit (at 1
    /// IOPS, a queue of 64 would hold the stop for a minute). Not undone; the group runs on.
    pub fn lift_limits(&self) {
        self.sh.limits_lifted.store(true, Ordering::Release);
    }

    /// Requests of volume `vol` now waiting for its IOPS or bandwidth limit give up at once
    /// (`EngineError::Cancelled`) instead of when the limit admits them; later ones wait as
    /// usual. For a change that must wait for the volume's requests in flight (a forced
    /// delete or rollback), which would otherwise wait for every queued request's turn. No
    /// effect on a volume without limits, or an unknown id.
    pub fn cut_limit_waits(&self, vol: VolumeId) {
        if let Some(rt) = self.sh.runtime(vol) {
            rt.cut_waits();
        } else if let Some(limits) = self.sh.snapshot_limits(vol) {
            // A snapshot's reads waiting for its volume's limits; the volume's own wait on.
            limits.cut_view_waits(vol);
        }
    }

    fn submit(
        &self,
        kind: RecordKind,
        layer: u32,
        lba: u64,
        nblocks: u64,
        data: Option<AlignedBuf>,
    ) -> Result<log::ReplyRx, EngineError> {
        let (done, wait) = log::reply_pair();
        let tx = self.tx.lock().clone().ok_or(EngineError::ShuttingDown)?;
        tx.send(WriteReq {
            kind,
            layer,
            lba,
            nblocks,
            data,
            done: log::Done::Chan(done),
            no_wait: false,
            relocation: false,
            rotation: false,
            born_ms: None,
            cache_gen: 0,
            vol: 0,
            cache_copy: crate::log::CacheCopy::Again,
        })
        .map_err(|_| EngineError::ShuttingDown)?;
        Ok(wait)
    }

    /// Starts a write of whole blocks and returns at once; `done` runs on an engine thread
    /// (it must not block) once the write is durable and visible, exactly when `write` would
    /// have returned. A write that cannot start without waiting (not whole blocks, larger than
    /// one log record, its blocks or its volume busy, the queue full) is refused with
    /// `Err(done)`, untouched: the caller then calls `write` on a thread that may block.
    pub fn write_async(
        self: &Arc<Self>,
        vol: VolumeId,
        offset: u64,
        data: &[u8],
        done: WriteDone,
    ) -> Result<(), WriteDone> {
        self.start_write(vol, offset, data, done, false)
    }

    /// `write_async` for a caller whose write is the only one it has in flight (a client at
    /// queue depth one): when the log is idle the write is made on the calling thread, which
    /// then blocks for the device's write and flush, and `done` runs before this returns.
    /// Saves the hand-off to a committer thread: 73 µs against 90 µs at the median for a
    /// queue-depth-one NBD write with the fast tier in RAM (docs/BENCHMARKS.md). A caller
    /// with more writes in flight must not use it: it would wait for each write before
    /// starting the next, instead of their sharing a batch.
    pub fn write_async_alone(
        self: &Arc<Self>,
        vol: VolumeId,
        offset: u64,
        data: &[u8],
        done: WriteDone,
    ) -> Result<(), WriteDone> {
        self.start_write(vol, offset, data, done, true)
    }

    fn start_write(
        self: &Arc<Self>,
        vol: VolumeId,
        offset: u64,
        data: &[u8],
        done: WriteDone,
        alone: bool,
    ) -> Result<(), WriteDone> {
        let max_bytes = self.max_record_blocks() * BLOCK_U64;
        let whole = offset.is_multiple_of(BLOCK_U64)
            && (data.len() as u64).is_multiple_of(BLOCK_U64)
            && !data.is_empty();
        // With the capacity tier full, a write may have to wait for rotation to free the log
        // (`Shared::wait_for_rotation`): the blocking path does.
        if !whole
            || data.len() as u64 > max_bytes
            || self.sh.check_running().is_err()
            || self.sh.counters.capacity_full.load(Ordering::Relaxed)
        {
            return Err(done);
        }
        let rt = self.sh.runtime(vol);
        if let Some(rt) = &rt {
            // Straight to the capacity tier: the write waits, so it goes on the caller's
            // blocking path.
            let stream = rt.writes.lock().peek(offset, data.len() as u64);
            if bypass::wanted(&self.sh, &rt.policy(), stream, data.len() as u64, alone) {
                return Err(done);
            }
        }
        let gate = self.sh.gate(vol);
        let Some(quiet) = gate.try_read_arc() else {
            return Err(done);
        };
        let head = match self.writable_head(vol, offset, data.len() as u64) {
            Ok(h) => h,
            Err(_) => return Err(done),
        };
        let (b0, n) = (offset / BLOCK_U64, data.len() as u64 / BLOCK_U64);
        let Some(claim) = shared::RangeClaim::try_new(&self.sh, head, b0, b0 + n) else {
            return Err(done);
        };
        // Over its limits the write waits, on the blocking path, which admits it again: the
        // limits are taken last, and given back if the request is refused after all.
        let limited = rt.as_deref();
        if limited.is_some_and(|rt| !rt.try_admit(&*self.sh.cfg.clock, data.len() as u64)) {
            return Err(done);
        }
        let give_back = || {
            if let Some(rt) = limited {
                rt.give_back(data.len() as u64);
            }
        };
        let d = AlignedBuf::from_slice(data);
        // The callback stays reachable until the request is queued, so a refusal can hand it back.
        let slot = Arc::new(Mutex::new(Some(done)));
        let slot_in = slot.clone();
        let finish: WriteDone = Box::new(move |r| {
            drop(claim);
            drop(quiet);
            if let Some(done) = slot_in.lock().take() {
                done(r);
            }
        });
        let tx = self.tx.lock().clone();
        let req = WriteReq {
            kind: RecordKind::Write,
            layer: head,
            lba: b0,
            nblocks: n,
            data: Some(d),
            done: log::Done::Call(finish),
            no_wait: false,
            relocation: false,
            rotation: false,
            born_ms: None,
            cache_gen: 0,
            vol: 0,
            cache_copy: crate::log::CacheCopy::Again,
        };
        let Some(tx) = tx else {
            // Shutting down: dropping the request drops its claim and guard.
            drop(req);
            give_back();
            let done = slot.lock().take();
            return Err(done.unwrap_or_else(|| Box::new(|_| {})));
        };
        // Noted before it may be answered (a client's next request can come at once). Refused
        // after all, the request is noted again on the blocking path, which changes nothing.
        if let Some(rt) = &rt {
            rt.writes.lock().note(offset, data.len() as u64);
        }
        // An idle log: written here and now, `done` called before this returns.
        let writer = alone.then(|| self.writer.upgrade()).flatten();
        let req = match writer {
            Some(w) => match w.try_inline(req) {
                Ok(()) => {
                    // Answered, unless the write panicked and was dropped unanswered (the
                    // group is offline then): `done` is still here, and answered with why.
                    if let Some(done) = slot.lock().take() {
                        done(self.sh.check_running().and(Err(EngineError::Failed(
                            "the write was lost to an internal error".into(),
                        ))));
                    }
                    return Ok(());
                }
                Err(req) => req,
            },
            None => req,
        };
        // Not queued, the request is dropped here, and with it its claim and guard.
        if tx.try_send(req).is_err() {
            give_back();
            let done = slot.lock().take();
            return Err(done.unwrap_or_else(|| Box::new(|_| {})));
        }
        Ok(())
    }

    /// Makes the range of a volume read as zeros. Whole blocks are a metadata record, not data.
    pub fn write_zeroes(&self, vol: VolumeId, offset: u64, len: u64) -> Result<(), EngineError> {
        self.sh.check_running()?;
        // A metadata operation: it counts against the volume's IOPS, not its bandwidth.
        self.admit(vol, 0)?;
        self.with_rotation(0, || self.write_zeroes_admitted(vol, offset, len))
    }

    fn write_zeroes_admitted(
        &self,
        vol: VolumeId,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        let gate = self.sh.gate(vol);
        let _g = gate.read();
        let head = self.writable_head(vol, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let (b0, b1) = block_span(offset, len);
        let _r = self.sh.ranges.lock(head, b0, b1);
        let full0 = offset.div_ceil(BLOCK_U64);
        let full1 = end / BLOCK_U64;
        // A partial block that holds nothing (never written, or trimmed) reads as zeros
        // already: writing it would take a block of log and capacity space, and could fail
        // with ENOSPC on a full tier, for nothing.
        if full0 >= full1 {
            if !self.holds_data(vol, b0, b1 - b0)? {
                return Ok(());
            }
            let zeros = vec![0u8; len as usize];
            return self.write_locked(vol, head, offset, &zeros, &Placed::default());
        }
        if offset < full0 * BLOCK_U64 && self.holds_data(vol, b0, 1)? {
            self.write_locked(
                vol,
                head,
                offset,
                &vec![0u8; (full0 * BLOCK_U64 - offset) as usize],
                &Placed::default(),
            )?;
        }
        if end > full1 * BLOCK_U64 && self.holds_data(vol, full1, 1)? {
            self.write_locked(
                vol,
                head,
                full1 * BLOCK_U64,
                &vec![0u8; (end - full1 * BLOCK_U64) as usize],
                &Placed::default(),
            )?;
        }
        // Only the span that holds something needs a record: zeros already read as zeros.
        // (The reclaim hold ends before the records wait for log space.)
        let pieces = {
            let _shared = self.sh.reclaim.read();
            resolve::resolve_view(&self.sh, vol, full0, full1 - full0)?
        };
        let mut data = pieces.iter().filter(|p| p.loc.is_some());
        let present = data.next().map(|first| {
            let last = pieces
                .iter()
                .rev()
                .find(|p| p.loc.is_some())
                .unwrap_or(first);
            (first.lba, last.lba + last.len)
        });
        if let Some((s, e)) = present {
            let mut waits = Vec::new();
            let mut at = s;
            while at < e {
                let n = (e - at).min(u64::from(u32::MAX));
                waits.push(self.submit(RecordKind::Zero, head, at, n, None)?);
                at += n;
            }
            wait_all(waits)?;
        }
        Ok(())
    }

    /// Whether any of `n` blocks of `view` from `lba` holds data (in its own layer or one it
    /// reads through); blocks that hold none read as zeros.
    fn holds_data(&self, view: VolumeId, lba: u64, n: u64) -> Result<bool, EngineError> {
        let _shared = self.sh.reclaim.read();
        let pieces = resolve::resolve_view(&self.sh, view, lba, n)?;
        Ok(pieces.iter().any(|p| p.loc.is_some()))
    }

    /// TRIM: in Strata a discarded range reads as zeros afterwards.
    pub fn discard(&self, vol: VolumeId, offset: u64, len: u64) -> Result<(), EngineError> {
        self.write_zeroes(vol, offset, len)
    }

    /// Everything completed before the call is durable when it returns (writes already are).
    pub fn flush(&self) -> Result<(), EngineError> {
        match self.sh.state.load(Ordering::Acquire) {
            shared::STATE_FAILED => self.sh.check_running(),
            _ => Ok(()),
        }
    }

    /// Allocation map of a byte range of a view: data or zero, adjacent extents of one kind merged.
    pub fn extents(
        &self,
        view: VolumeId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<Extent>, EngineError> {
        self.view_range(view, offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let (b0, b1) = block_span(offset, len);
        // As for a read: a flush may not free an index page this lookup is loading.
        let pieces = {
            let _shared = self.sh.reclaim.read();
            resolve::resolve_view(&self.sh, view, b0, b1 - b0)?
        };
        let end = offset + len;
        let mut out: Vec<Extent> = Vec::new();
        for p in pieces {
            let s = (p.lba * BLOCK_U64).max(offset);
            let e = ((p.lba + p.len) * BLOCK_U64).min(end);
            let kind = if p.loc.is_some() {
                ExtentKind::Data
            } else {
                ExtentKind::Zero
            };
            match out.last_mut() {
                Some(last) if last.kind == kind => last.len += e - s,
                _ => out.push(Extent {
                    offset: s,
                    len: e - s,
                    kind,
                }),
            }
        }
        Ok(out)
    }

    pub fn stats(&self) -> EngineStats {
        let sh = &self.sh;
        let c = &sh.counters;
        // The mark first: the counts only grow.
        let seen_by_scrub = *sh.scrub.seen_at_last_all.lock();
        let seen = sh.damage_seen();
        // The read cache's copies (one entry each), taken before the log's lock: a copy is
        // entered once its record is in the log, so the entries are at most its cache blocks.
        let cached = sh.cache.lock().entries();
        // Live log data is counted as batches are applied, after they took their log space:
        // read under the log lock, it is at most what the batches hold besides cached copies.
        let (used, live, dead, cache_log, cache_budget, fill, admission) = {
            let log = sh.log.lock();
            let live = c.fast_live_blocks.load(Ordering::Relaxed);
            let held = log.used_blocks.saturating_sub(log.cache_blocks);
            (
                log.used_blocks * BLOCK_U64,
                live.min(held) * BLOCK_U64,
                held.saturating_sub(live) * BLOCK_U64,
                log.cache_blocks * BLOCK_U64,
                log.cache_budget_blocks * BLOCK_U64,
                log.fill_ratio(),
                log::admission_now(sh, &log),
            )
        };
        let (seg_total, seg_free, live_blocks, data_segs, meta_blocks) = {
            let s = sh.segs.lock();
            let data = s.count(capacity::SegState::Sealed)
                + s.count(capacity::SegState::Open)
                + s.count(capacity::SegState::PendingFree);
            let (meta_live, _) = s.meta_pages();
            (
                s.segs.len() as u64,
                s.free_count() as u64,
                s.live_blocks_total(),
                data as u64,
                meta_live,
            )
        };
        let runs = sh
            .index
            .read()
            .layers
            .values()
            .map(|l| l.fast.run_count() as u64)
            .sum();
        let (tc, tree_bytes) = {
            let t = sh.tree.read();
            (t.counts(), t.resident_bytes() as u64)
        };
        let log_cap = sh.layout.log_blocks * BLOCK_U64;
        EngineStats {
            io_backend: String::new(),
            fast_device: sh.fast.stats(),
            capacity_devices: sh.caps.iter().map(|d| d.stats()).collect(),
            log_capacity_bytes: log_cap,
            log_used_bytes: used,
            log_fill_ratio: fill,
            fill_ratio_low: sh.cfg.fill_ratio_low,
            fill_ratio_high: sh.cfg.fill_ratio_high,
            destage_rate_bytes_per_s: c.destage_rate.lock().per_second(Instant::now()),
            destage_bandwidth_bytes_per_s: shared::Counters::get_f64(&c.destage_bw_bytes_per_s),
            destage_backlog_bytes: live,
            log_dead_bytes: dead,
            destaged_bytes_total: c.destaged_bytes.load(Ordering::Relaxed),
            host_write_bytes_total: c.host_write_bytes.load(Ordering::Relaxed),
            host_read_bytes_total: c.host_read_bytes.load(Ordering::Relaxed),
            admission_throttled: admission != log::Admission::Open,
            admission: admission.as_str().into(),
            capacity_full: c.capacity_full.load(Ordering::Relaxed),
            capacity_out_of_room: c.out_of_room.lock().as_ref().map(|o| OutOfRoomStats {
                error: o.error.clone(),
                since_s: o.since.elapsed().as_secs_f64(),
                failed_writes: o.failed_writes,
            }),
            destager_nice: c.destager_nice.load(Ordering::Relaxed),
            fast_resident_bytes: live + cached.min(cache_log / BLOCK_U64) * BLOCK_U64,
            capacity_total_bytes: seg_total * sh.layout.segment_size_bytes,
            capacity_used_bytes: data_segs * sh.layout.segment_size_bytes + meta_blocks * BLOCK_U64,
            capacity_live_bytes: live_blocks * BLOCK_U64,
            capacity_reserved_bytes: (destage::gc_reserve(sh) as u64).min(seg_total)
                * sh.layout.segment_size_bytes,
            segments_total: seg_total,
            segments_free: seg_free,
            gc_segments_cleaned_total: c.gc_segments_cleaned.load(Ordering::Relaxed),
            gc_relocated_bytes_total: c.gc_relocated_bytes.load(Ordering::Relaxed),
            gc_segments_passed_over: self.sh.gc_passed_over.lock().len() as u64,
            hot_kept_bytes_total: c.hot_kept_bytes.load(Ordering::Relaxed),
            log_run_writes_total: c.log_run_writes.load(Ordering::Relaxed),
            log_rotated_batches_total: c.rotated_batches.load(Ordering::Relaxed),
            log_rotating: c.rotation_goal_blocks.load(Ordering::Relaxed) > 0,
            metadata_copy_fallbacks_total: seen.1,
            checksum_errors_total: seen.0,
            checksum_errors_since_scrub: seen.0.saturating_sub(seen_by_scrub.0),
            metadata_copy_fallbacks_since_scrub: seen.1.saturating_sub(seen_by_scrub.1),
            log_records_lost_at_start: self
                .report
                .skipped_log_records
                .iter()
                .map(|s| s.end_seq - s.first_seq)
                .sum(),
            log_damage_pending: self.log_damage_pending(),
            checksum_errors_by_device: c
                .checksum_errors_by_device
                .iter()
                .map(|x| x.load(Ordering::Relaxed))
                .collect(),
            read_fast_bytes_total: c.read_fast_bytes.load(Ordering::Relaxed),
            read_capacity_bytes_total: c.read_capacity_bytes.load(Ordering::Relaxed),
            read_unwritten_bytes_total: c.read_unwritten_bytes.load(Ordering::Relaxed),
            read_cached_bytes_total: c.read_cached_bytes.load(Ordering::Relaxed),
            read_cache_bytes: cached * BLOCK_U64,
            read_cache_log_bytes: cache_log,
            read_cache_budget_bytes: cache_budget,
            promoted_bytes_total: c.promoted_blocks.load(Ordering::Relaxed) * BLOCK_U64,
            kept_bytes_total: c.kept_blocks.load(Ordering::Relaxed) * BLOCK_U64,
            evicted_bytes_total: c.evicted_blocks.load(Ordering::Relaxed) * BLOCK_U64,
            promotions_refused_total: c.promotions_refused.load(Ordering::Relaxed),
            promotions_skipped_total: c.promotions_skipped.load(Ordering::Relaxed),
            index_runs: runs,
            index_pages_bytes: meta_blocks * BLOCK_U64,
            index_resident_leaves: tc.resident_leaves as u64,
            index_resident_inner: tc.resident_inner as u64,
            index_resident_bytes: tree_bytes,
            index_dirty_nodes: tc.dirty_nodes as u64,
            index_flushes_total: c.index_flushes.load(Ordering::Relaxed),
            index_page_reads_total: c.index_page_reads.load(Ordering::Relaxed),
            index_pages_written_total: c.index_pages_written.load(Ordering::Relaxed),
            state: match sh.state.load(Ordering::Acquire) {
                STATE_RUNNING => "running",
                STATE_STOPPING => "stopping",
                _ => "failed",
            }
            .into(),
            failure: sh.failure.lock().clone(),
        }
    }

    /// Destages everything in the log now, whatever the fill level (tests, benchmarks, and
    /// before maintenance). Waits at most `timeout`; returns whether the log emptied.
    pub fn destage_all(&self, timeout: Duration) -> bool {
        destage::drain_until(&self.sh, timeout, |log| log.batches.is_empty())
    }

    /// Waits until background work owed to deleted volumes and snapshots (releasing their
    /// blocks, folding deleted snapshots into their successors) is done; returns whether it
    /// finished within `timeout`.
    pub fn settle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let pending = {
                let idx = self.sh.index.read();
                idx.layers
                    .values()
                    .any(|l| l.rec.flags & (format::LAYER_DELETED | format::LAYER_MERGING) != 0)
            };
            if !pending {
                return true;
            }
            self.sh.wake_destager();
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    /// Stops background work and makes everything durable: completed writes stay in the log
    /// and are replayed on the next open; the index is written so the next open is quick.
    /// An offline group (see `Shared::fail`) only flushes its devices, and returns why it went
    /// offline.
    pub fn shutdown(&self) -> Result<(), EngineError> {
        let _ = self.sh.state.compare_exchange(
            STATE_RUNNING,
            STATE_STOPPING,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.stop_threads();
        if self.sh.state.load(Ordering::Acquire) != shared::STATE_FAILED {
            // Nothing more reaches the log: the last checkpoint says where it ends. The
            // capacity devices get a new stamp (the next opening's epoch), so a copy of one
            // taken while the group was open is older than the group once it is closed.
            let end = self.sh.log.lock().next_seq;
            let stamp = {
                let mut d = self.sh.durable.lock();
                d.clean_log_end_seq = end;
                d.device_stamps.1 = d.epoch + 1;
                d.epoch + 1
            };
            meta::flush_index(&self.sh)?;
            open::stamp_capacity_devices(&self.sh, stamp)?;
        }
        for d in &self.sh.caps {
            d.flush()?;
        }
        self.sh.fast.flush()?;
        // An offline group stopped without its index flush: say why, rather than report a
        // clean stop.
        match self.sh.state.load(Ordering::Acquire) {
            shared::STATE_FAILED => self.sh.check_running(),
            _ => Ok(()),
        }
    }

    /// Simulates the process dying: background threads stop at once, nothing more is written.
    /// Pair with a device-level crash (MemDevice) to simulate power loss. For tests.
    pub fn halt_for_test(&self) {
        self.sh.abandon.store(true, Ordering::Relaxed);
        let _ = self.sh.state.compare_exchange(
            STATE_RUNNING,
            STATE_STOPPING,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.stop_threads();
    }

    /// Stops the destager first (it holds a sender to the log writer), then lets the log
    /// writer finish its queue and exit.
    fn stop_threads(&self) {
        self.tx.lock().take();
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        self.sh.destager_stop.store(true, Ordering::Relaxed);
        self.sh.wake_destager();
        for t in threads.into_iter().rev() {
            let _ = t.join();
        }
    }
}

impl Drop for DiskGroup {
    fn drop(&mut self) {
        if !self.threads.lock().is_empty() {
            let _ = self.shutdown();
        }
    }
}

/// Which records of a host write of several records the log has placed, kept across the
/// tries `DiskGroup::with_rotation` makes: a try after a refusal submits only the others. (A
/// write refused part way that wrote all its records again on the next try left the first
/// copies of those it had placed dead in the log: log room taken for nothing in a full group,
/// and work for rotation, which frees such blocks by writing the live ones again.) The
/// records count as placed only in the layer they went to: a try that finds the volume on
/// another head (a rollback, or a snapshot, between tries) sends them all again.
#[derive(Default)]
struct Placed {
    head: std::cell::Cell<Option<u32>>,
    records: std::cell::RefCell<Vec<bool>>,
}

impl Placed {
    /// A try writing to layer `head`: what was placed in another layer is forgotten. (A
    /// rollback between two tries drops the old head with the records placed in it.)
    fn begin(&self, head: u32) {
        if self.head.replace(Some(head)) != Some(head) {
            self.records.borrow_mut().clear();
        }
    }

    fn holds(&self, record: usize) -> bool {
        self.records.borrow().get(record).copied().unwrap_or(false)
    }

    fn note(&self, record: usize) {
        let mut p = self.records.borrow_mut();
        if p.len() <= record {
            p.resize(record + 1, false);
        }
        p[record] = true;
    }
}

fn wait_all(waits: Vec<log::ReplyRx>) -> Result<(), EngineError> {
    let mut result = Ok(());
    for w in waits {
        let r = w.wait();
        if result.is_ok() {
            result = r;
        }
    }
    result
}

/// A host's read of a volume: whose figures it counts in, and whether it may promote.
struct HostRead<'a> {
    rt: &'a runtime::VolRuntime,
    /// The volume's head layer (promotion evidence is kept per view; heat is noted under the
    /// layer that holds the data, which the destager looks up).
    head: u32,
    /// How long the sequential stream this read continues already is.
    sequential_bytes: u64,
    /// The last 64 KiB region this read counted as evidence for promotion
    /// (`ReadCache::note_miss`): a region two of its parts share counts once.
    counted: std::cell::Cell<Option<u64>>,
}

/// Forgets cached copies (of capacity blocks `block..block+n` of `seg`, at log block `fast`)
/// a read could not use, counting a checksum failure when the read itself succeeded: the
/// caller reads the capacity tier instead.
fn unusable_copy(sh: &Shared, seg: u32, block: u32, n: u32, fast: u64, checksum_failed: bool) {
    if checksum_failed {
        sh.checksum_error(0, 1);
    }
    tracing::error!(
        segment = seg,
        block,
        "a cached copy on the fast tier cannot be used: reading the capacity tier instead"
    );
    let gone = sh.cache.lock().forget(seg, block, n, fast);
    tiering::count_evicted(sh, &gone);
}

/// Counts a checksum mismatch found by a host read and makes the error it returns.
fn corrupt_error(sh: &Shared, view: VolumeId, lba: u64, tier: &str, dev: usize) -> EngineError {
    sh.checksum_error(dev, 1);
    let offset = lba * BLOCK_U64;
    tracing::error!(
        volume = view,
        offset,
        tier,
        "checksum mismatch: returning an I/O error"
    );
    EngineError::Corrupt(format!("volume #{view} offset {offset} ({tier} tier)"))
}

/// Blocks `[b0, b1)` touched by a byte range.
fn block_span(offset: u64, len: u64) -> (u64, u64) {
    (offset / BLOCK_U64, (offset + len).div_ceil(BLOCK_U64))
}

fn validate_name(name: &str, what: &str) -> Result<(), EngineError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_VOLUME_NAME
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(EngineError::InvalidArgument(format!(
            "{what} name {name:?} must be 1-{MAX_VOLUME_NAME} characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
        )))
    }
}

fn validate_size(size_bytes: u64) -> Result<(), EngineError> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(512) || size_bytes > MAX_VOLUME_BYTES {
        return Err(EngineError::InvalidArgument(format!(
            "volume size {size_bytes} must be a non-zero multiple of 512 bytes, at most {MAX_VOLUME_BYTES}"
        )));
    }
    Ok(())
}
