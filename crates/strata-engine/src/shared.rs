//! State shared by the caller threads, the log writer and the destager.
//!
//! Lock order (never take an earlier one while holding a later one):
//! `durable` -> `reclaim` -> `log` -> `index` -> `tree` -> `segs` -> `summaries` -> `crc_blocks`.
//! Gates (per volume) come before all of them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex, RwLock};
use strata_device::Device;

use crate::capacity::{CrcCache, SegTable, SummaryCache};
use crate::ctree::{CTree, PagePtr};
use crate::error::EngineError;
use crate::format::*;
use crate::layout::{write_checkpoint_from, Layout, CHECKPOINT_AREA_BYTES};
use crate::log::LogState;
use crate::map::{ExtentMap, Loc};
use crate::rangelock::RangeLocks;
use crate::volumes::Tables;
use crate::EngineConfig;

/// A layer and the part of it that lives on the fast tier.
pub struct LayerState {
    pub rec: LayerRecord,
    /// Blocks whose newest copy of this layer is in the log (`Loc::Fast`) or a zero record
    /// still there (`Loc::Zero(seq)`). Rebuilt by log replay; bounded by the log's blocks.
    pub fast: ExtentMap,
}

/// The volume table and the fast-tier maps. Protected by `Shared::index`.
#[derive(Default)]
pub struct Index {
    pub layers: BTreeMap<u32, LayerState>,
    pub volumes: BTreeMap<u32, VolumeRecord>,
    pub snapshots: BTreeMap<u32, SnapshotRecord>,
    pub next_id: u32,
    /// Made from the records above by `refresh_lookups`, which whoever replaces them calls.
    lookups: Lookups,
}

/// What the API and the space counts ask of the volume table by name or by parent, kept
/// apart from the records so a question is one map lookup: scans of the tables made every
/// request naming a volume grow with the number of volumes, and listings with its square.
#[derive(Default)]
struct Lookups {
    volume_ids: HashMap<String, u32>,
    snapshot_ids: HashMap<(u32, String), u32>,
    /// Every layer under its parent (0 for none), deleted layers too.
    children: HashMap<u32, Vec<u32>>,
}

/// Most layers a view reads through (snapshot and clone creation keep within it).
pub const MAX_CHAIN: usize = 1024;

/// What a view (a volume or a snapshot) reads through.
#[derive(Debug, Clone)]
pub struct ViewLayers {
    pub size_bytes: u64,
    pub read_only: bool,
    /// Top layer first.
    pub chain: Vec<u32>,
}

impl Index {
    /// Makes the lookups again from the records: called wherever layers, volumes or
    /// snapshots are replaced (`Shared::install_tables`, and the open).
    pub fn refresh_lookups(&mut self) {
        let mut l = Lookups::default();
        for v in self.volumes.values() {
            l.volume_ids.insert(v.name.clone(), v.id);
        }
        for s in self.snapshots.values() {
            l.snapshot_ids.insert((s.volume, s.name.clone()), s.id);
        }
        for layer in self.layers.values() {
            let kids = l.children.entry(layer.rec.parent).or_default();
            kids.push(layer.rec.id);
        }
        self.lookups = l;
    }

    pub fn volume_by_name(&self, name: &str) -> Option<&VolumeRecord> {
        // Held to its name: lookups out of step then find nothing rather than another volume.
        let found = (self.lookups.volume_ids.get(name))
            .and_then(|id| self.volumes.get(id))
            .filter(|v| v.name == name);
        #[cfg(test)]
        assert_eq!(
            found.map(|v| v.id),
            self.volumes.values().find(|v| v.name == name).map(|v| v.id),
            "the lookup of volume {name:?} is out of step with the table"
        );
        found
    }

    pub fn snapshot_by_name(&self, volume: u32, name: &str) -> Option<&SnapshotRecord> {
        let found = (self.lookups.snapshot_ids.get(&(volume, name.to_string())))
            .and_then(|id| self.snapshots.get(id))
            .filter(|s| s.volume == volume && s.name == name);
        #[cfg(test)]
        assert_eq!(
            found.map(|s| s.id),
            (self.snapshots.values())
                .find(|s| s.volume == volume && s.name == name)
                .map(|s| s.id),
            "the lookup of snapshot {name:?} of volume #{volume} is out of step with the table"
        );
        found
    }

    /// The layers whose parent is `id`, deleted ones included, as one lookup (`children`
    /// scans every layer).
    pub fn children_of(&self, id: u32) -> &[u32] {
        let found = self
            .lookups
            .children
            .get(&id)
            .map_or(&[][..], Vec::as_slice);
        #[cfg(test)]
        {
            let mut found = found.to_vec();
            found.sort_unstable();
            assert_eq!(
                found,
                self.children(id),
                "the children of layer {id} are out of step"
            );
        }
        found
    }

    /// The layers a read of `top` goes through, top first.
    pub fn chain(&self, top: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = top;
        while at != 0 && out.len() < MAX_CHAIN {
            let Some(l) = self.layers.get(&at) else { break };
            out.push(at);
            at = l.rec.parent;
        }
        out
    }

    /// The view with this id: a volume (writable) or a snapshot (read-only).
    pub fn view(&self, id: u32) -> Result<ViewLayers, EngineError> {
        let (size_bytes, read_only, top) = if let Some(v) = self.volumes.get(&id) {
            (v.size_bytes, false, v.head)
        } else if let Some(s) = self.snapshots.get(&id) {
            (s.size_bytes, true, s.layer)
        } else {
            return Err(EngineError::NotFound(format!("#{id}")));
        };
        let chain = self.chain(top);
        let deeper = chain
            .last()
            .and_then(|l| self.layers.get(l))
            .is_some_and(|l| l.rec.parent != 0 && chain.len() >= MAX_CHAIN);
        if deeper {
            return Err(EngineError::Corrupt(format!(
                "view #{id} reads through more than {MAX_CHAIN} layers"
            )));
        }
        Ok(ViewLayers {
            size_bytes,
            read_only,
            chain,
        })
    }

    /// Whether records of this layer still matter (it exists and is not being removed).
    pub fn layer_live(&self, id: u32) -> bool {
        self.layers
            .get(&id)
            .is_some_and(|l| l.rec.flags & LAYER_DELETED == 0)
    }

    pub fn has_parent(&self, id: u32) -> bool {
        self.layers.get(&id).is_some_and(|l| l.rec.parent != 0)
    }

    /// Layers whose parent is `id`.
    pub fn children(&self, id: u32) -> Vec<u32> {
        self.layers
            .values()
            .filter(|l| l.rec.parent == id)
            .map(|l| l.rec.id)
            .collect()
    }

    /// The layer's child when it has exactly one that is not deleted (a merge's target).
    pub fn only_live_child(&self, id: u32) -> Option<u32> {
        let mut live = self
            .children(id)
            .into_iter()
            .filter(|c| self.layer_live(*c));
        let first = live.next();
        first.filter(|_| live.next().is_none())
    }
}

/// A rate per wall second, averaged exponentially over the last `TAU_S` seconds: an amount
/// counts in full when it happens and fades with time (a steady `r` per second reads as
/// `r`), and once nothing has happened for `REST_S` the rate is 0, not what is left of the
/// fading (which read as a rate for a minute after the destager had stopped).
#[derive(Debug, Default)]
pub struct DecayingRate {
    /// The rate as of `at`.
    value: f64,
    at: Option<Instant>,
}

impl DecayingRate {
    const TAU_S: f64 = 5.0;
    const REST_S: f64 = 5.0;

    pub fn add(&mut self, amount: u64, now: Instant) {
        self.value = self.per_second(now) + amount as f64 / Self::TAU_S;
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
    }

    pub fn per_second(&self, now: Instant) -> f64 {
        match self.at {
            None => 0.0,
            Some(at) => {
                let dt = now.saturating_duration_since(at).as_secs_f64();
                match dt < Self::REST_S {
                    true => self.value * (-dt / Self::TAU_S).exp(),
                    false => 0.0,
                }
            }
        }
    }
}

/// Monotonic counters; read by `stats()`.
#[derive(Default)]
pub struct Counters {
    pub host_write_bytes: AtomicU64,
    pub host_read_bytes: AtomicU64,
    pub destaged_bytes: AtomicU64,
    pub log_freed_bytes: AtomicU64,
    /// Log bytes taken by batches of host writes (headers included), those batches, and the
    /// records in them.
    pub log_host_appended_bytes: AtomicU64,
    pub log_host_batches: AtomicU64,
    pub log_host_records: AtomicU64,
    /// Lone host writes that extended a run (FORMAT.md §3.3.1) instead of taking a header
    /// block of their own.
    pub log_run_writes: AtomicU64,
    pub gc_segments_cleaned: AtomicU64,
    pub hot_kept_bytes: AtomicU64,
    pub gc_relocated_bytes: AtomicU64,
    pub checksum_errors: AtomicU64,
    /// Checksum failures by device where the bad copy lives: the fast device first, then the
    /// capacity devices in order (see `Shared::checksum_error`).
    pub checksum_errors_by_device: Vec<AtomicU64>,
    /// Host read bytes by where they were served from (4 KiB granular, before trimming to the
    /// request): the fast tier, the capacity tier, or never written (zeros, no I/O).
    pub read_fast_bytes: AtomicU64,
    pub read_capacity_bytes: AtomicU64,
    pub read_unwritten_bytes: AtomicU64,
    /// Host reads served by cached copies; blocks promoted, and cached copies dropped.
    pub read_cached_bytes: AtomicU64,
    pub promoted_blocks: AtomicU64,
    pub evicted_blocks: AtomicU64,
    /// Blocks read while in the write log whose clean copy was kept when they were destaged.
    pub kept_blocks: AtomicU64,
    /// Bytes of sequential writes written straight to the capacity tier.
    pub bypassed_bytes: AtomicU64,
    /// Promotions the evidence asked for but the cache's share of the log had no room for.
    pub promotions_refused: AtomicU64,
    /// Promotions the log writer's queue was too full to take (the log was busy).
    pub promotions_skipped: AtomicU64,
    pub fast_live_blocks: AtomicU64,
    /// f64 bits: log space the destager frees per busy second, smoothed.
    pub destage_bw_bytes_per_s: AtomicU64,
    /// Capacity bytes the destager wrote, per wall second over the last seconds.
    pub destage_rate: Mutex<DecayingRate>,
    /// Admission control has measured the rate the log is freed at while throttled
    /// (`LogWriter::admit`; the destage bandwidth stands in without it).
    pub admit_rate_measured: AtomicBool,
    pub capacity_full: AtomicBool,
    /// The last destage found no segment to write: the log is freed only by compaction
    /// (`Destager::compact_tail`) until it does, so host writes leave it room.
    pub capacity_blocked: AtomicBool,
    /// A capacity device had no room for a write (its file system is full): `out_of_room`
    /// says since when and why (room.rs).
    pub capacity_out_of_room: AtomicBool,
    /// A write would have bypassed the log but for the free segments it keeps to spare
    /// (`bypass::wanted`): GC cleans what is cheap to clean until there are (`gc_needed`).
    pub bypass_held_for_room: AtomicBool,
    pub out_of_room: Mutex<Option<crate::room::OutOfRoom>>,
    pub index_flushes: AtomicU64,
    pub index_pages_written: AtomicU64,
    pub index_page_reads: AtomicU64,
    /// Index pages whose copy A was damaged (copy B served the read).
    pub index_copy_repairs_needed: AtomicU64,
    /// Reads of a segment summary (or one of its crc blocks) whose first copy was damaged,
    /// unreadable or an earlier use's (a lost write), and whose other copy served it.
    pub summary_copy_repairs_needed: AtomicU64,
    /// Surveys of the log's tail by the destager (tests watch how often it looks).
    pub destage_surveys: AtomicU64,
    /// While the destager rotates a full log (docs/FORMAT.md §4.7): the free log blocks it
    /// aims at; 0 when it is not rotating. Hosts needing less wait for it (`wait_for_rotation`).
    pub rotation_goal_blocks: AtomicU64,
    /// Rotation plans made (each after `rotation_goal_blocks` is set from it).
    pub rotation_plans: AtomicU64,
    /// The destager is queueing a rotation's requests: a committer gathering them waits.
    pub rotation_queueing: AtomicBool,
    /// Tail batches rotation has freed (tests watch it).
    pub rotated_batches: AtomicU64,
    /// The destager thread's nice value (19 while it works ahead of need, when it may).
    pub destager_nice: AtomicI64,
    /// Changes to what layers hold themselves (records applied to the fast maps, bypass
    /// writes, volume-table changes), counted once made: the destager looks again for blocks
    /// of a deleted snapshot's layer that every child now hides only after one (hidden.rs).
    pub own_changes: AtomicU64,
}

impl Counters {
    pub fn get_f64(a: &AtomicU64) -> f64 {
        f64::from_bits(a.load(Ordering::Relaxed))
    }
    pub fn set_f64(a: &AtomicU64, v: f64) {
        a.store(v.to_bits(), Ordering::Relaxed)
    }
}

pub const STATE_RUNNING: u8 = 0;
pub const STATE_STOPPING: u8 = 1;
pub const STATE_FAILED: u8 = 2;

/// What the last checkpoint made durable (and the counter of checkpoints). Protected by
/// `Shared::durable`, which also serialises checkpoint writes.
pub struct Durable {
    pub generation: u64,
    pub epoch: u32,
    /// Set by a clean shutdown just before its last checkpoint, and by the destager once no
    /// record has been acknowledged for a second (`Destager::mark_log_end`; see
    /// `Checkpoint::log_end_seq`): every record before it was acknowledged.
    pub clean_log_end_seq: u64,
    pub index_root: Option<PagePtr>,
    pub index_generation: u64,
    /// The log tail (block, seq) of the last checkpoint this opening wrote; (0, 0) before the
    /// first.
    pub log_tail: (u64, u64),
    /// The checkpoint copy written first (0: A, 1: B). After a failed checkpoint, the copy
    /// that failed, which may be torn: it is mended before the whole one is overwritten.
    pub first_copy: usize,
    /// The capacity devices' stamps the next checkpoint accepts (`Checkpoint::device_stamps`).
    pub device_stamps: (u32, u32),
    /// The batch whose first part a committed destage stripe took (its first sequence number)
    /// and where that part ends: a checkpoint whose tail is that batch says so
    /// (`Checkpoint::tail_destaged`), and replay leaves the part out of the fast maps.
    pub tail_part: Option<(u64, TailPart)>,
}

/// The index part of a checkpoint.
pub struct IndexParts {
    pub root: Option<PagePtr>,
    pub generation: u64,
    pub segtab: Vec<Option<PagePtr>>,
    pub streams: [StreamPos; 2],
    pub recent: Vec<u32>,
}

/// How long a host request waits for rotation (`Shared::wait_for_rotation`) while no log
/// space is freed, and at most.
pub const ROTATION_STALL: std::time::Duration = std::time::Duration::from_secs(5);
pub const ROTATION_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// How a wait for rotation (`Shared::wait_for_rotation`) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotationWait {
    /// The capacity tier was not full: nothing was waited for.
    NotFull,
    /// The log had room for the request.
    Room,
    /// Rotation will not give it room (a plan aims lower, it stalled, or the wait ran out),
    /// or the group stopped.
    GaveUp,
}

/// `Shared::destager_rest_fill` when the destager is not resting.
pub const NOT_RESTING: u64 = u64::MAX;
/// How much the log's fill must grow during a destager's rest before the log writer's nudges
/// end it (a twentieth of the write buffer: new data may make a stripe of cold data).
pub const REST_FILL_STEP: f64 = 0.05;

pub struct Shared {
    pub cfg: EngineConfig,
    pub fast: Arc<dyn Device>,
    pub caps: Vec<Arc<dyn Device>>,
    pub layout: Layout,
    pub durable: Mutex<Durable>,
    /// One past the highest record seq answered (durable, applied, acknowledged) in this
    /// opening; at open, the seq replay stopped at. Every later opening hands out seqs from at
    /// least this, so it is the seq for entries written outside the log (bypass.rs).
    pub retired_seq: AtomicU64,
    /// Readers hold it shared while they read from a location; space is freed under it
    /// exclusively, so a location found in the index stays valid for the whole read. In an
    /// `Arc` so an asynchronous read can hold it from submission to completion, which runs
    /// on another thread.
    pub reclaim: Arc<RwLock<()>>,
    pub log: Mutex<LogState>,
    pub log_freed: Condvar,
    /// Also tells the log writer's front, which waits on its queues rather than on
    /// `log_freed`, that log space was freed (one pending signal at most).
    pub log_freed_signal: (
        crossbeam_channel::Sender<()>,
        crossbeam_channel::Receiver<()>,
    ),
    pub index: RwLock<Index>,
    pub tree: RwLock<CTree>,
    pub segs: Mutex<SegTable>,
    pub summaries: Mutex<SummaryCache>,
    /// Segments GC passes over: their summary could not be read (`destage::PassedOver`).
    pub gc_passed_over: Mutex<HashMap<u32, crate::destage::PassedOver>>,
    /// Crc blocks of segment summaries, for reads (one 4 KiB block per 1023 data blocks).
    pub crc_blocks: Mutex<CrcCache>,
    /// crc32c of every block in the log area, as written.
    pub fast_crcs: Vec<AtomicU32>,
    pub ranges: RangeLocks,
    /// Per volume: writes hold it shared from choosing the head layer until they complete;
    /// snapshot and rollback hold it exclusively while they switch layers.
    pub gates: Mutex<HashMap<u32, Arc<RwLock<()>>>>,
    pub counters: Counters,
    pub state: AtomicU8,
    pub failure: Mutex<Option<String>>,
    /// Set by shutdown: the destager may stop at once.
    pub abandon: AtomicBool,
    /// Set by `DiskGroup::lift_limits` (a clean stop under way): no request waits for a
    /// volume's IOPS or bandwidth limits any more.
    pub limits_lifted: AtomicBool,
    /// Set when the disk group stops: the destager finishes its step and exits.
    pub destager_stop: AtomicBool,
    /// Tests only: while set, the destager does nothing (so a test can set up a fill level
    /// without racing it).
    #[cfg(test)]
    pub destager_held: AtomicBool,
    /// Tests only: the destager saw `destager_held` and does nothing until it is cleared (or
    /// it has stopped). See `hold_destager`.
    #[cfg(test)]
    pub destager_parked: AtomicBool,
    /// Tests only: called by the destager with the tail it has just made durable, before it
    /// frees the log space behind it.
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    pub after_tail_checkpoint: Mutex<Option<Box<dyn Fn((u64, u64)) + Send + Sync>>>,
    /// Tests only: called by a committer with the end (sequence) of the batch it retires,
    /// after the turn has moved on and before it records the batch as acknowledged.
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    pub after_turn_moved: Mutex<Option<Arc<dyn Fn(u64) + Send + Sync>>>,
    /// Tests only: called by the thread that retires a batch (a committer, or a writer on its
    /// own thread) with the batch's first sequence, while it holds the turn, before it
    /// applies the batch to the index.
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    pub before_apply: Mutex<Option<Arc<dyn Fn(u64) + Send + Sync>>>,
    /// Tests only: called by the destager's rotation with the live runs (layer, first block,
    /// blocks) of a tail batch it has just read, before it claims their ranges.
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    pub after_rotation_read: Mutex<Option<Arc<dyn Fn(&[(u32, u64, u64)]) + Send + Sync>>>,
    /// Tests only: how long the destager's rotation stops after queueing a group's first
    /// rewrite, as a thread the machine does not run for a while would.
    #[cfg(test)]
    pub rotation_queue_pause: Mutex<Option<std::time::Duration>>,
    /// Tests only: called by the destager once it has freed log space at the tail (the
    /// batches are gone from the log, and new batches may take their blocks), with no lock
    /// held.
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    pub after_tail_freed: Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
    /// Tests only: called before an index page missing from memory is read from its device.
    #[cfg(test)]
    #[allow(clippy::type_complexity)]
    pub before_page_load: Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
    /// Set by `destage_all`: destage regardless of fill.
    pub drain: AtomicBool,
    /// Set by a scrub that needs the index written now (`scrub::flush_index_now`): the
    /// destager's next maintenance flushes it.
    pub flush_asked: AtomicBool,
    /// Blocks being rewritten (see heat.rs): the evidence that data is hot. Bounded by the
    /// log's block count.
    pub heat: Mutex<crate::heat::Heat>,
    pub destage_wake: Condvar,
    pub destage_wake_lock: Mutex<bool>,
    /// While the destager pauses on purpose (pacing, or nothing worth moving yet): the log's
    /// fill when the pause began, as f64 bits; `NOT_RESTING` otherwise. The log writer's
    /// per-batch nudges do not end the pause until the fill has grown by `REST_FILL_STEP`;
    /// explicit wakes and a log past its high mark do.
    pub destager_rest_fill: AtomicU64,
    /// Each device's lifetime writes as of opening (fast first); the device's own counters
    /// add what was written since.
    pub wear_at_open: Vec<DeviceWear>,
    /// Held by index flushes; scrub holds it while it checks the durable index's pages.
    pub flush_guard: Mutex<()>,
    /// Held while a device's superblock copies are read and rewritten (stamps, scrub's
    /// repairs): a repair made from a copy read before a stamp changed would undo it.
    pub superblocks: Mutex<()>,
    pub scrub: crate::scrub::ScrubState,
    /// Free segments kept for index flushes (two streams of pages; see `maint::meta_reserve`).
    pub meta_reserve: usize,
    /// Dirty index nodes that trigger a flush (what one flush may write is bounded by it).
    pub index_dirty_limit: usize,
    /// Each device's own write counter when the group opened it (a device object may outlive
    /// one opening, as in tests).
    pub write_counter_at_open: Vec<u64>,
    /// Clean copies of capacity blocks in the log area (see cache.rs).
    pub cache: Mutex<crate::cache::ReadCache>,
    /// Log blocks read by a host since they were written (see `cache::ReadMarks`).
    pub fast_read: crate::cache::ReadMarks,
    /// Per volume: policy, limits, figures (rebuilt from the volume table on every change).
    pub vols: RwLock<crate::runtime::Runtimes>,
}

impl Shared {
    /// Whether a request still waits for its volume's limits: the group runs and
    /// `limits_lifted` is not set. (A request that stops waiting goes on; it is refused after
    /// if the group no longer runs.)
    pub fn limits_hold(&self) -> bool {
        self.check_running().is_ok() && !self.limits_lifted.load(Ordering::Acquire)
    }

    pub fn check_running(&self) -> Result<(), EngineError> {
        match self.state.load(Ordering::Acquire) {
            STATE_RUNNING => Ok(()),
            STATE_STOPPING => Err(EngineError::ShuttingDown),
            _ => Err(EngineError::Failed(
                self.failure.lock().clone().unwrap_or_default(),
            )),
        }
    }

    /// Takes the disk group offline: the fast device failed in a way that leaves the log's
    /// state unknown, so no further write may be acknowledged.
    pub fn fail(&self, why: String) {
        tracing::error!("disk group offline: {why}");
        *self.failure.lock() = Some(why);
        self.state.store(STATE_FAILED, Ordering::Release);
        self.log_space_freed();
    }

    /// Runs the body of an engine thread (a log committer, the destager). A panic there is a
    /// bug that leaves the thread's work half done and the thread gone: writes would hang on a
    /// turn that never comes, or the log would fill with nothing to free it. So the group goes
    /// offline instead, with the reason, and every request after it fails.
    pub fn run_guarded(&self, thread: &str, body: impl FnOnce()) {
        self.guarded(&format!("the {thread} thread"), body);
    }

    /// Runs engine work (`what` names it in the reason) and takes the group offline if it
    /// panics, as `run_guarded` does; None then.
    pub fn guarded<T>(&self, what: &str, body: impl FnOnce() -> T) -> Option<T> {
        let payload = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
            Ok(v) => return Some(v),
            Err(payload) => payload,
        };
        let why = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("no message");
        self.fail(format!("internal error: {what} panicked: {why}"));
        None
    }

    /// With the capacity tier taking nothing, a host request whose first batch carries
    /// `data_blocks` blocks of data (0: a trim's record) waits here, before it takes its range
    /// lock, while the log has no room for it and the destager may rotate the log toward room
    /// enough (docs/FORMAT.md §4.7); rotation skips blocks a host holds. It goes on (to be
    /// placed, or refused with NoSpace) once there is room, once a plan made since it came
    /// aims lower, or when no log space has been freed for `ROTATION_STALL` while the
    /// destager went on looking (or after `ROTATION_WAIT_MAX` in all). One load when the tier
    /// is not full.
    pub fn wait_for_rotation(&self, data_blocks: u64) -> RotationWait {
        let c = &self.counters;
        if !c.capacity_full.load(Ordering::Relaxed) {
            return RotationWait::NotFull;
        }
        // A plan counted two after this one was begun after this request came: it saw the
        // log as this request does, or emptier.
        let plans_seen = c.rotation_plans.load(Ordering::Acquire);
        let mut freed_seen = c.log_freed_bytes.load(Ordering::Relaxed);
        let mut since = std::time::Instant::now();
        // The destager's turns (plans) when log space was last freed: a rotation counts as
        // stalled only once the destager has looked since and freed nothing, not while it
        // has not run at all (at background CPU priority on a busy machine it may not run for
        // seconds; a trim refused then failed for nothing but the machine's load).
        let mut plans_at_free = plans_seen;
        let deadline = since + ROTATION_WAIT_MAX;
        let mut log = self.log.lock();
        loop {
            let need = log.kept_free(data_blocks > 0, false) + data_blocks + 1;
            let planned = c.rotation_plans.load(Ordering::Acquire) >= plans_seen + 2;
            let goal = c.rotation_goal_blocks.load(Ordering::Relaxed);
            if log.host_free_blocks() >= need {
                return RotationWait::Room;
            }
            if (planned && goal < need)
                || self.check_running().is_err()
                || self.destager_stop.load(Ordering::Relaxed)
            {
                return RotationWait::GaveUp;
            }
            let freed = c.log_freed_bytes.load(Ordering::Relaxed);
            let plans = c.rotation_plans.load(Ordering::Acquire);
            if freed != freed_seen {
                (freed_seen, since, plans_at_free) = (freed, std::time::Instant::now(), plans);
            } else if since.elapsed() >= ROTATION_STALL && plans >= plans_at_free + 2 {
                return RotationWait::GaveUp;
            }
            if std::time::Instant::now() >= deadline {
                return RotationWait::GaveUp;
            }
            parking_lot::MutexGuard::unlocked(&mut log, || self.wake_destager());
            self.log_freed
                .wait_for(&mut log, std::time::Duration::from_millis(50));
        }
    }

    /// Wakes everything waiting for log space: blocked writers and the log writer's front.
    pub fn log_space_freed(&self) {
        self.log_freed.notify_all();
        let _ = self.log_freed_signal.0.try_send(());
    }

    /// Counts a checksum failure of data or metadata on device `dev` (0: the fast device,
    /// 1 + i: capacity device i).
    /// Checksum errors, and metadata reads that fell back to a second copy, so far in this run.
    pub fn damage_seen(&self) -> (u64, u64) {
        let c = &self.counters;
        (
            c.checksum_errors.load(Ordering::Relaxed),
            c.index_copy_repairs_needed.load(Ordering::Relaxed)
                + c.summary_copy_repairs_needed.load(Ordering::Relaxed),
        )
    }

    pub fn checksum_error(&self, dev: usize, n: u64) {
        self.counters
            .checksum_errors
            .fetch_add(n, Ordering::Relaxed);
        if let Some(c) = self.counters.checksum_errors_by_device.get(dev) {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The device index (as `checksum_error` numbers them) of a capacity segment.
    pub fn seg_device(&self, seg: u32) -> usize {
        1 + self.layout.segments.get(seg as usize).map_or(0, |s| s.0)
    }

    /// The gate of a volume.
    pub fn gate(&self, volume: u32) -> Arc<RwLock<()>> {
        self.gates.lock().entry(volume).or_default().clone()
    }

    /// Accounts for index entries that stopped pointing somewhere.
    pub fn release(&self, displaced: &[(u64, u64, Loc)]) {
        let mut fast = 0;
        let mut segs = None;
        for &(_, len, loc) in displaced {
            match loc {
                Loc::Fast(_) => fast += len,
                Loc::Cap { seg, .. } => {
                    let t = segs.get_or_insert_with(|| self.segs.lock());
                    t.release(seg, len as u32);
                }
                Loc::Zero(_) => {}
            }
        }
        if fast > 0 {
            self.counters
                .fast_live_blocks
                .fetch_sub(fast, Ordering::Relaxed);
        }
    }

    /// The index part of a checkpoint as the last flush left it.
    pub fn durable_parts(&self, d: &Durable) -> IndexParts {
        let segs = self.segs.lock();
        IndexParts {
            root: d.index_root,
            generation: d.index_generation,
            segtab: segs.page_ptrs.clone(),
            streams: segs.durable_streams,
            recent: segs.recent.clone(),
        }
    }

    /// Writes the checkpoint with the durable index and volume table as they stand. The
    /// caller holds `durable`.
    pub fn write_checkpoint_locked(
        &self,
        d: &mut Durable,
        tail: (u64, u64),
    ) -> Result<(), EngineError> {
        let parts = self.durable_parts(d);
        let t = self.tables();
        self.write_checkpoint_full(d, tail, &parts, &t)
    }

    /// Writes the checkpoint with the given index and the current volume table.
    pub fn write_checkpoint_parts(
        &self,
        d: &mut Durable,
        tail: (u64, u64),
        parts: &IndexParts,
    ) -> Result<(), EngineError> {
        let t = self.tables();
        self.write_checkpoint_full(d, tail, parts, &t)
    }

    /// Writes the checkpoint: the log tail, the given index and volume table. The caller
    /// holds `durable` (every change of the volume table does too).
    pub fn write_checkpoint_full(
        &self,
        d: &mut Durable,
        tail: (u64, u64),
        parts: &IndexParts,
        t: &Tables,
    ) -> Result<(), EngineError> {
        let cp = self.checkpoint_of(d, tail, parts, t);
        write_checkpoint_from(self.fast.as_ref(), &self.layout, &cp, d.first_copy).map_err(
            |(e, suspect)| {
                d.first_copy = suspect;
                e
            },
        )?;
        d.generation += 1;
        d.log_tail = (cp.log_tail_offset / BLOCK_U64, cp.log_tail_seq);
        Ok(())
    }

    /// Refuses a volume-table change that grows the table unless the checkpoint keeps room for
    /// the longest list of recent segments (`MAX_RECENT_SEGMENTS`): the destager's checkpoints
    /// carry the same table with the segments it sealed since the last index flush, and one
    /// that does not fit leaves the log unfreed. A change that does not grow it (a deletion)
    /// always goes through.
    pub fn check_table_room(
        &self,
        d: &Durable,
        before: &Tables,
        after: &Tables,
    ) -> Result<(), EngineError> {
        let parts = IndexParts {
            recent: vec![0; MAX_RECENT_SEGMENTS as usize],
            ..self.durable_parts(d)
        };
        // With the tail batch's destaged part too, as the destager's checkpoints may carry it.
        let part = Some(TailPart { seq: 0, block: 0 });
        let cp = Checkpoint {
            tail_destaged: part,
            ..self.checkpoint_of(d, d.log_tail, &parts, after)
        };
        let now = Checkpoint {
            tail_destaged: part,
            ..self.checkpoint_of(d, d.log_tail, &parts, before)
        };
        if cp.payload_len() <= now.payload_len() {
            return Ok(());
        }
        cp.encode(CHECKPOINT_AREA_BYTES as usize).map(|_| ())
    }

    /// The checkpoint of the log tail, the given index and the volume table `t`.
    fn checkpoint_of(
        &self,
        d: &Durable,
        tail: (u64, u64),
        parts: &IndexParts,
        t: &Tables,
    ) -> Checkpoint {
        // A tail once made durable was destaged: the space behind it may hold newer batches
        // already, so no checkpoint may name an older one (replay would start there).
        let tail = if tail.1 < d.log_tail.1 {
            tracing::error!(
                given = tail.1,
                durable = d.log_tail.1,
                "a checkpoint named a log tail older than the durable one; kept the durable one"
            );
            d.log_tail
        } else {
            tail
        };
        let next_segment_seq = self.segs.lock().next_seq;
        Checkpoint {
            group: self.layout.group,
            generation: d.generation + 1,
            log_tail_offset: tail.0 * BLOCK_U64,
            log_tail_seq: tail.1,
            epoch: d.epoch,
            log_end_seq: d.clean_log_end_seq,
            next_id: t.next_id,
            index_generation: parts.generation,
            next_segment_seq,
            index_root: parts.root,
            segtab: parts.segtab.clone(),
            streams: parts.streams,
            recent: parts.recent.clone(),
            layers: t.layers.values().copied().collect(),
            volumes: t.volumes.values().cloned().collect(),
            snapshots: t.snapshots.values().cloned().collect(),
            wear: self.device_wear(),
            device_stamps: Some(d.device_stamps),
            tail_destaged: d
                .tail_part
                .filter(|&(first_seq, _)| first_seq == tail.1)
                .map(|(_, part)| part),
        }
    }

    /// Lifetime writes of every device now (fast first, then capacity in index order).
    pub fn device_wear(&self) -> Vec<DeviceWear> {
        let devices = std::iter::once(&self.fast).chain(self.caps.iter());
        devices
            .zip(self.wear_at_open.iter().zip(&self.write_counter_at_open))
            .map(|(dev, (base, counter_at_open))| DeviceWear {
                bytes_written_total: base.bytes_written_total
                    + dev.stats().write_bytes.saturating_sub(*counter_at_open),
                first_use_unix_s: base.first_use_unix_s,
            })
            .collect()
    }

    /// Tests only: holds the destager and returns once it does nothing (its step under way
    /// finished). Setting `destager_held` alone lets a step already begun go on: a rotation
    /// group, a destage or the release of room, changing the log and `capacity_full` under a
    /// test that believes them still.
    #[cfg(test)]
    pub fn hold_destager(&self) {
        // Held before parked is looked at; the destager clears parked before it looks at
        // held: one of the two sees the other's store, so parked seen here is not stale.
        self.destager_held.store(true, Ordering::SeqCst);
        self.wake_destager();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !self.destager_parked.load(Ordering::SeqCst) {
            assert!(
                std::time::Instant::now() < deadline,
                "the destager did not finish its step within 120 s of being held"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    pub fn wake_destager(&self) {
        let mut w = self.destage_wake_lock.lock();
        *w = true;
        self.destage_wake.notify_all();
    }

    /// New data in the log at `fill`: wakes the destager past the low mark if it is waiting,
    /// unless it is resting, the log is below its high mark and has grown by less than
    /// `REST_FILL_STEP` since the rest began. A nudge is not kept
    /// for later (unlike `wake_destager`): one that finds the destager busy is moot, as it
    /// looks at the log again when done, and keeping it would cut its next rest short (the
    /// log writer nudges after every batch, so no rest would ever happen).
    pub fn nudge_destager(&self, fill: f64) {
        let rest_fill = self.destager_rest_fill.load(Ordering::Relaxed);
        // Enough new data since the rest began may hold a stripe's worth of cold data.
        let look_again =
            rest_fill == NOT_RESTING || fill >= f64::from_bits(rest_fill) + REST_FILL_STEP;
        if fill >= self.cfg.fill_ratio_high || (fill >= self.cfg.fill_ratio_low && look_again) {
            let _w = self.destage_wake_lock.lock();
            self.destage_wake.notify_all();
        }
    }
}

/// A bounded cache with two generations: inserts go to the young one; when it is full, the
/// old generation is dropped and the young one becomes old. A hit in the old generation moves
/// the entry back to the young one. So it holds at most `2 * cap` entries and keeps what is
/// used, without the bookkeeping of an exact LRU.
pub struct TwoGen<K, V> {
    young: HashMap<K, V>,
    old: HashMap<K, V>,
    cap: usize,
}

impl<K: std::hash::Hash + Eq + Copy, V: Clone> TwoGen<K, V> {
    pub fn new(cap: usize) -> Self {
        TwoGen {
            young: HashMap::new(),
            old: HashMap::new(),
            cap: cap.max(1),
        }
    }

    pub fn get(&mut self, k: &K) -> Option<V> {
        if let Some(v) = self.young.get(k) {
            return Some(v.clone());
        }
        let v = self.old.remove(k)?;
        self.insert(*k, v.clone());
        Some(v)
    }

    pub fn insert(&mut self, k: K, v: V) {
        if self.young.len() >= self.cap {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(k, v);
    }

    /// Drops every entry whose key matches.
    pub fn forget(&mut self, gone: impl Fn(&K) -> bool) {
        self.young.retain(|k, _| !gone(k));
        self.old.retain(|k, _| !gone(k));
    }
}

/// A block range held for a request that outlives any borrow (a write answered on another
/// thread): released when dropped, whether the request was answered or dropped unanswered.
pub(crate) struct RangeClaim {
    sh: Arc<Shared>,
    key: (u32, u64, u64),
}

impl RangeClaim {
    /// Holds `[start, end)` of a layer if nobody holds part of it; never waits.
    pub(crate) fn try_new(
        sh: &Arc<Shared>,
        layer: u32,
        start: u64,
        end: u64,
    ) -> Option<RangeClaim> {
        sh.ranges.try_claim(layer, start, end).then(|| RangeClaim {
            sh: sh.clone(),
            key: (layer, start, end),
        })
    }
}

impl Drop for RangeClaim {
    fn drop(&mut self) {
        self.sh.ranges.release(self.key);
    }
}

#[cfg(test)]
mod decaying_rate_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_decaying_rate_follows_a_steady_rate_and_falls_to_zero_at_rest() {
        let t0 = Instant::now();
        let mut r = DecayingRate::default();
        assert_eq!(r.per_second(t0), 0.0);
        // 1 MB every 100 ms for 60 s: 10 MB/s.
        let mut t = t0;
        for _ in 0..600 {
            t += Duration::from_millis(100);
            r.add(1_000_000, t);
        }
        let steady = r.per_second(t);
        assert!((9.5e6..10.6e6).contains(&steady), "steady rate {steady}");
        // Fading while less than REST_S has passed, then 0 (it read 63 KB/s 14 s after 10
        // MB/s, and 3 KB/s 30 s after).
        let later = r.per_second(t + Duration::from_secs(4));
        assert!((steady / 3.0..steady / 2.0).contains(&later), "4 s later {later}");
        assert_eq!(r.per_second(t + Duration::from_secs(5)), 0.0);
        assert_eq!(r.per_second(t + Duration::from_secs(60)), 0.0);
        // A new amount after the rest counts from nothing.
        r.add(1_000_000, t + Duration::from_secs(60));
        let again = r.per_second(t + Duration::from_secs(60));
        assert!((199_000.0..201_000.0).contains(&again), "{again}");
    }
}
