//! State shared by the caller threads, the log writer and the destager.
//!
//! Lock order (never take an earlier one while holding a later one):
//! `meta` -> `reclaim` -> `log` -> `index` -> `segs` -> `summaries`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};
use strata_device::Device;

use crate::capacity::{SegTable, SummaryCache};
use crate::error::EngineError;
use crate::format::{Checkpoint, DeviceWear, VolumeRecord};
use crate::layout::{write_checkpoint, Layout};
use crate::log::LogState;
use crate::map::{ExtentMap, Loc};
use crate::rangelock::RangeLocks;
use crate::EngineConfig;

pub struct VolState {
    pub rec: VolumeRecord,
    pub map: ExtentMap,
}

#[derive(Default)]
pub struct Index {
    pub vols: BTreeMap<u32, VolState>,
    pub next_volume_id: u32,
}

impl Index {
    pub fn by_name(&self, name: &str) -> Option<&VolState> {
        self.vols.values().find(|v| v.rec.name == name)
    }
}

/// Monotonic counters; read by `stats()`.
#[derive(Default)]
pub struct Counters {
    pub host_write_bytes: AtomicU64,
    pub host_read_bytes: AtomicU64,
    pub destaged_bytes: AtomicU64,
    pub log_freed_bytes: AtomicU64,
    pub gc_segments_cleaned: AtomicU64,
    pub hot_kept_bytes: AtomicU64,
    pub gc_relocated_bytes: AtomicU64,
    pub checksum_errors: AtomicU64,
    /// Host read bytes by where they were served from (4 KiB granular, before trimming to the
    /// request): the fast tier, the capacity tier, or never written (zeros, no I/O).
    pub read_fast_bytes: AtomicU64,
    pub read_capacity_bytes: AtomicU64,
    pub read_unwritten_bytes: AtomicU64,
    pub fast_live_blocks: AtomicU64,
    /// f64 bits: log space the destager frees per busy second, smoothed.
    pub destage_bw_bytes_per_s: AtomicU64,
    /// f64 bits: capacity bytes written per wall second, smoothed.
    pub destage_rate_bytes_per_s: AtomicU64,
    pub throttled: AtomicBool,
    pub capacity_full: AtomicBool,
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

pub struct Shared {
    pub cfg: EngineConfig,
    pub fast: Arc<dyn Device>,
    pub caps: Vec<Arc<dyn Device>>,
    pub layout: Layout,
    /// Serialises checkpoint writes and the log-tail moves they record.
    pub meta: Mutex<u64>,
    /// Readers hold it shared while they read from a location; space is freed under it
    /// exclusively, so a location found in the index stays valid for the whole read.
    pub reclaim: RwLock<()>,
    pub log: Mutex<LogState>,
    pub log_freed: Condvar,
    pub index: RwLock<Index>,
    pub segs: Mutex<SegTable>,
    pub summaries: Mutex<SummaryCache>,
    /// crc32c of every block in the log area, as written.
    pub fast_crcs: Vec<AtomicU32>,
    pub ranges: RangeLocks,
    pub counters: Counters,
    pub state: AtomicU8,
    pub failure: Mutex<Option<String>>,
    /// Set by shutdown: the destager may stop at once.
    pub abandon: AtomicBool,
    /// Set when the disk group stops: the destager finishes its step and exits.
    pub destager_stop: AtomicBool,
    /// Set by `destage_all`: destage regardless of fill.
    pub drain: AtomicBool,
    /// Blocks overwritten recently (wherever their previous copy was), with a saturating
    /// count halved each time the destager keeps the block on the fast tier: the evidence that
    /// data is hot. Bounded by the
    /// log's block count.
    pub heat: Mutex<HashMap<(u32, u64), u8>>,
    pub destage_wake: Condvar,
    pub destage_wake_lock: Mutex<bool>,
    /// Each device's lifetime writes as of opening (fast first); the device's own counters
    /// add what was written since.
    pub wear_at_open: Vec<DeviceWear>,
    /// Each device's own write counter when the group opened it (a device object may outlive
    /// one opening, as in tests).
    pub write_counter_at_open: Vec<u64>,
}

impl Shared {
    pub fn check_running(&self) -> Result<(), EngineError> {
        match self.state.load(Ordering::Acquire) {
            STATE_RUNNING => Ok(()),
            STATE_STOPPING => Err(EngineError::ShuttingDown),
            _ => Err(EngineError::Failed(self.failure.lock().clone().unwrap_or_default())),
        }
    }

    /// Takes the disk group offline: the fast device failed in a way that leaves the log's
    /// state unknown, so no further write may be acknowledged.
    pub fn fail(&self, why: String) {
        tracing::error!("disk group offline: {why}");
        *self.failure.lock() = Some(why);
        self.state.store(STATE_FAILED, Ordering::Release);
        self.log_freed.notify_all();
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
            }
        }
        if fast > 0 {
            self.counters.fast_live_blocks.fetch_sub(fast, Ordering::Relaxed);
        }
    }

    /// Writes the checkpoint: the volume table and where log replay must start.
    /// The caller holds `meta` (passed in as its generation counter).
    pub fn write_checkpoint_locked(&self, generation: &mut u64, tail: (u64, u64)) -> Result<(), EngineError> {
        let (volumes, next_volume_id) = {
            let idx = self.index.read();
            (idx.vols.values().map(|v| v.rec.clone()).collect::<Vec<_>>(), idx.next_volume_id)
        };
        self.write_checkpoint_with(generation, tail, volumes, next_volume_id)
    }

    pub fn write_checkpoint_with(
        &self,
        generation: &mut u64,
        tail: (u64, u64),
        volumes: Vec<VolumeRecord>,
        next_volume_id: u32,
    ) -> Result<(), EngineError> {
        *generation += 1;
        let cp = Checkpoint {
            group: self.layout.group,
            generation: *generation,
            log_tail_offset: tail.0 * crate::format::BLOCK_U64,
            log_tail_seq: tail.1,
            next_volume_id,
            volumes,
            wear: self.device_wear(),
        };
        write_checkpoint(self.fast.as_ref(), &self.layout, &cp)
    }

    /// Records that these (volume, first block, blocks) were overwritten.
    pub fn note_rewrites(&self, runs: &[(u32, u64, u64)]) {
        let mut heat = self.heat.lock();
        let cap = self.layout.log_blocks as usize;
        for &(vol, lba, n) in runs {
            for b in lba..lba + n {
                if heat.len() >= cap && !heat.contains_key(&(vol, b)) {
                    return;
                }
                let h = heat.entry((vol, b)).or_insert(0);
                *h = h.saturating_add(1);
            }
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

    pub fn wake_destager(&self) {
        let mut w = self.destage_wake_lock.lock();
        *w = true;
        self.destage_wake.notify_all();
    }
}

/// A bounded cache helper used for summaries: drops everything when it grows too large
/// (summaries are cheap to reread, and a bound matters more than the hit ratio).
pub fn bounded_insert<K: std::hash::Hash + Eq, V>(m: &mut HashMap<K, V>, k: K, v: V, max: usize) {
    if m.len() >= max {
        m.clear();
    }
    m.insert(k, v);
}
