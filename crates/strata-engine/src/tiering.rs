//! Volume policies at work: setting them, the per-volume runtime state they drive, the read
//! cache's promotions, and the figures that show what they do.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use strata_device::AlignedBuf;

use crate::cache::Owners;
use crate::error::EngineError;
use crate::format::{RecordKind, BLOCK_U64};
use crate::log::{CacheCopy, Done, WriteReq};
use crate::policy::{Mode, Policy};
use crate::runtime::{Runtimes, VolRuntime, VolumeFigures};
use crate::shared::Shared;
use crate::{validate_name, validate_size, DiskGroup, VolumeId, VolumeInfo};

impl Shared {
    /// Rebuilds the per-volume runtime state from the volume table, keeping the figures and
    /// limiters of volumes that stay.
    pub fn rebuild_runtimes(&self) {
        let idx = self.index.read();
        let mut vols = self.vols.write();
        let mut next = Runtimes::default();
        for v in idx.volumes.values() {
            let policy = Policy::decode(&v.policy).unwrap_or_else(|e| {
                tracing::error!(volume = %v.name, "unreadable volume policy, using the defaults: {e}");
                Policy::default()
            });
            let rt = match vols.by_volume.get(&v.id) {
                Some(rt) => {
                    *rt.policy.lock() = policy;
                    rt.clone()
                }
                None => Arc::new(VolRuntime::new(v.id, policy)),
            };
            next.by_layer.insert(v.head, rt.clone());
            next.by_volume.insert(v.id, rt);
        }
        // A snapshot's layer holds what its volume wrote before it, and the volume still reads
        // through it: that data keeps the volume's policy (a tier-mode volume's young data
        // stays on the fast tier after a snapshot). A layer under several volumes (clones of
        // one snapshot) follows the volume of lowest id, the origin unless it was deleted.
        for v in idx.volumes.values() {
            let rt = next.by_volume[&v.id].clone();
            let mut layer = idx.layers.get(&v.head).map_or(0, |l| l.rec.parent);
            for _ in 0..crate::shared::MAX_CHAIN {
                let Some(state) = idx.layers.get(&layer) else {
                    break;
                };
                next.by_layer.entry(layer).or_insert_with(|| rt.clone());
                layer = state.rec.parent;
            }
        }
        *vols = next;
    }

    pub fn runtime(&self, vol: VolumeId) -> Option<Arc<VolRuntime>> {
        self.vols.read().by_volume.get(&vol).cloned()
    }

    /// For a snapshot view, its volume's runtime: the snapshot's reads count against the
    /// volume's limits (None for a volume or an unknown view).
    pub fn snapshot_limits(&self, view: VolumeId) -> Option<Arc<VolRuntime>> {
        let volume = self.index.read().snapshots.get(&view)?.volume;
        self.runtime(volume)
    }

    /// The runtime of the volume whose data this layer holds: its head layer, or a snapshot
    /// layer the volume reads through (None for a layer no volume reads).
    pub fn layer_runtime(&self, layer: u32) -> Option<Arc<VolRuntime>> {
        self.vols.read().by_layer.get(&layer).cloned()
    }

    /// Heat from reads of a tier-mode volume's data on the fast tier.
    pub fn note_read_heat(&self, rt: &VolRuntime, layer: u32, lba: u64, n: u64) {
        if rt.policy().mode == Mode::Tier {
            self.heat.lock().note_read(layer, lba, n);
        }
    }
}

impl DiskGroup {
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo, EngineError> {
        self.create_volume_with_policy(name, size_bytes, &Policy::default())
    }

    pub fn create_volume_with_policy(
        &self,
        name: &str,
        size_bytes: u64,
        policy: &Policy,
    ) -> Result<VolumeInfo, EngineError> {
        validate_name(name, "volume")?;
        validate_size(size_bytes)?;
        policy.validate()?;
        self.insert_volume(name, size_bytes, policy.encode())
    }

    /// Changes a volume's policy; it takes effect at once (the destager and the read path
    /// read it on every decision) and is durable when this returns.
    pub fn set_policy(&self, volume: &str, policy: &Policy) -> Result<(), EngineError> {
        self.update_policy(volume, |_| Ok(*policy)).map(drop)
    }

    /// Changes a volume's policy from the one it has: `f` is given the policy as it stands
    /// under the volume table's lock, so two changes made at once (each naming a few fields)
    /// both take effect; an error from `f` changes nothing. Returns the policy set.
    pub fn update_policy(
        &self,
        volume: &str,
        f: impl FnOnce(&Policy) -> Result<Policy, EngineError>,
    ) -> Result<Policy, EngineError> {
        let mut set = None;
        self.change_volume(volume, |v| {
            let policy = f(&Policy::decode(&v.policy)?)?;
            policy.validate()?;
            v.policy = policy.encode();
            set = Some(policy);
            Ok(())
        })?;
        self.sh.wake_destager();
        set.ok_or_else(|| EngineError::Failed("the policy was not set".into()))
    }

    pub fn policy(&self, volume: &str) -> Result<Policy, EngineError> {
        self.runtime_named(volume).map(|rt| rt.policy())
    }

    /// What the policy did for a volume since the group opened.
    pub fn volume_figures(&self, volume: &str) -> Result<VolumeFigures, EngineError> {
        self.runtime_named(volume).map(|rt| rt.stats.figures())
    }

    fn runtime_named(&self, volume: &str) -> Result<Arc<VolRuntime>, EngineError> {
        let not_found = || EngineError::NotFound(volume.into());
        let id = self.volume(volume).ok_or_else(not_found)?.id;
        self.sh.runtime(id).ok_or_else(not_found)
    }

    /// Writes a clean copy of capacity blocks `block..block+n` of `seg` (read under `gen`)
    /// into the log, without waiting: a promotion the log has no room or time for is skipped.
    pub(crate) fn promote(
        &self,
        rt: Option<&VolRuntime>,
        seg: u32,
        block: u32,
        gen: u32,
        data: &[u8],
    ) {
        let tx = self.tx.lock().clone();
        promote_with(&self.sh, tx.as_ref(), rt, seg, block, gen, data);
    }
}

/// Queues a clean copy of capacity blocks just read (`data`, blocks `block..` of `seg` as of
/// generation `gen`) for the write log, if the read cache has room; never waits. A copy the
/// read cache or the log has no room for is counted as refused (`promotions_refused_total`),
/// and the destager told: it makes room for the cache when promotions are refused. A copy the
/// log writer's queue has no room for (the log is busy) is counted as skipped
/// (`promotions_skipped_total`); the destager can do nothing about that.
pub(crate) fn promote_with(
    sh: &Arc<Shared>,
    tx: Option<&crate::queue::LogQueue>,
    rt: Option<&VolRuntime>,
    seg: u32,
    block: u32,
    gen: u32,
    data: &[u8],
) {
    let n = data.len() as u64 / BLOCK_U64;
    if !sh.log.lock().cache_has_room(n) {
        return promotion_refused(sh);
    }
    let Some(tx) = tx else {
        return;
    };
    let vol = rt.map_or(0, |rt| rt.id);
    let told = sh.clone();
    let done = Done::Call(Box::new(move |r| {
        if matches!(r, Err(EngineError::NoSpace)) {
            promotion_refused(&told);
        }
    }));
    if !send_cache_copy(tx, CacheCopy::Promoted, vol, seg, block, gen, data, done) {
        sh.counters
            .promotions_skipped
            .fetch_add(1, Ordering::Relaxed);
    }
}

fn promotion_refused(sh: &Shared) {
    sh.counters
        .promotions_refused
        .fetch_add(1, Ordering::Relaxed);
    sh.wake_destager();
}

/// Queues a clean copy of capacity blocks `block..` of `seg` (as of generation `gen`) for the
/// log, never waiting for the queue or for log space; false when it was not queued. The
/// copy is counted (as `copy` says) when the read cache takes it (`count_cache_copies`);
/// `done` hears whether the log wrote it (`NoSpace`: the log had no room for it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn send_cache_copy(
    tx: &crate::queue::LogQueue,
    copy: CacheCopy,
    vol: u32,
    seg: u32,
    block: u32,
    gen: u32,
    data: &[u8],
    done: Done,
) -> bool {
    let mut d = AlignedBuf::new_zeroed(data.len());
    d.copy_from_slice(data);
    let req = WriteReq {
        kind: RecordKind::Cache,
        layer: seg,
        lba: u64::from(block),
        nblocks: data.len() as u64 / BLOCK_U64,
        data: Some(d),
        done,
        no_wait: true,
        relocation: true,
        rotation: false,
        born_ms: None,
        cache_gen: gen,
        vol,
        cache_copy: copy,
    };
    tx.try_send(req).is_ok()
}

/// Counts `fresh` copies of a cache record the read cache has just taken under the figure its
/// origin names, and the stale copies (of a segment since reused) they took the place of as
/// evicted, for the volumes that counted those in.
pub(crate) fn count_cache_copies(
    sh: &Shared,
    vol: u32,
    copy: CacheCopy,
    fresh: u64,
    replaced: &Owners,
) {
    let rt = sh.runtime(vol);
    let (group, own) = match copy {
        CacheCopy::Promoted => (
            &sh.counters.promoted_blocks,
            rt.as_ref().map(|rt| &rt.stats.promoted_blocks),
        ),
        CacheCopy::Kept => (
            &sh.counters.kept_blocks,
            rt.as_ref().map(|rt| &rt.stats.kept_blocks),
        ),
        CacheCopy::Again => return,
    };
    group.fetch_add(fresh, Ordering::Relaxed);
    if let Some(own) = own {
        own.fetch_add(fresh, Ordering::Relaxed);
    }
    count_evicted(sh, replaced);
}

/// Counts cached copies that left the read cache, for the group and for the volumes that
/// counted them in (a volume deleted since counts only for the group).
pub(crate) fn count_evicted(sh: &Shared, gone: &Owners) {
    sh.counters
        .evicted_blocks
        .fetch_add(gone.total(), Ordering::Relaxed);
    for &(vol, n) in &gone.0 {
        if let Some(rt) = sh.runtime(vol) {
            rt.stats.evicted_blocks.fetch_add(n, Ordering::Relaxed);
        }
    }
}
