//! The volume table: volumes, snapshots and clones, and the layers under them.
//!
//! A volume writes into its head layer. Taking a snapshot freezes the head (the snapshot now
//! names it) and gives the volume a new, empty head on top: no data is copied. A clone is a
//! new volume whose head sits on a snapshot's layer; a rollback gives the volume a new empty
//! head on the snapshot's layer. Layers nothing needs any more are deleted (their blocks are
//! released in the background); a deleted snapshot's layer with a single child is merged
//! into that child.
//!
//! Every change is made durable (a checkpoint) before anyone can see it.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::error::EngineError;
use crate::format::*;
use crate::map::ExtentMap;
use crate::shared::{Durable, LayerState, Shared};
use crate::{
    validate_name, validate_size, DiskGroup, VolumeId, VolumeInfo, MAX_SNAPSHOTS, MAX_VOLUMES,
};

/// The records of the volume table (what a checkpoint stores), apart from the fast maps.
#[derive(Debug, Clone, Default)]
pub struct Tables {
    pub layers: BTreeMap<u32, LayerRecord>,
    pub volumes: BTreeMap<u32, VolumeRecord>,
    pub snapshots: BTreeMap<u32, SnapshotRecord>,
    pub next_id: u32,
}

impl Tables {
    fn volume_named(&self, name: &str) -> Result<&VolumeRecord, EngineError> {
        self.volumes
            .values()
            .find(|v| v.name == name)
            .ok_or_else(|| EngineError::NotFound(name.into()))
    }

    fn snapshot_named(
        &self,
        vol: u32,
        vol_name: &str,
        name: &str,
    ) -> Result<&SnapshotRecord, EngineError> {
        self.snapshots
            .values()
            .find(|s| s.volume == vol && s.name == name)
            .ok_or_else(|| EngineError::NotFound(format!("{vol_name}@{name}")))
    }

    fn take_id(&mut self) -> Result<u32, EngineError> {
        if self.next_id >= u32::MAX - 1 {
            return Err(EngineError::InvalidArgument(
                "volume and layer ids are exhausted".into(),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        Ok(id)
    }

    /// Layers a read of `top` goes through.
    fn depth(&self, top: u32) -> usize {
        let mut n = 0;
        let mut at = top;
        while at != 0 && n <= crate::shared::MAX_CHAIN {
            n += 1;
            at = self.layers.get(&at).map_or(0, |l| l.parent);
        }
        n
    }

    /// Why no layer can go over `parent`. A deleted snapshot's layer stays on the chain until
    /// the destager has merged it, so "delete some snapshots" alone would send someone who
    /// just did back to do it again.
    fn too_deep(&self, parent: u32) -> String {
        let max = crate::shared::MAX_CHAIN;
        let mut merging = 0;
        let mut at = parent;
        for _ in 0..max {
            let Some(l) = self.layers.get(&at) else { break };
            if l.flags & LAYER_MERGING != 0 {
                merging += 1;
            }
            at = l.parent;
        }
        if merging == 0 {
            format!("at most {max} layers of history per volume: delete some snapshots first")
        } else {
            format!(
                "at most {max} layers of history per volume: {merging} of them are of deleted \
                 snapshots, being merged in the background; try again in a moment"
            )
        }
    }

    /// A new layer over `parent`, refused when reads would go through too many layers.
    pub(crate) fn new_layer(&mut self, parent: u32) -> Result<u32, EngineError> {
        if self.depth(parent) + 1 > crate::shared::MAX_CHAIN {
            // The volume's state, not the request, is at fault: a conflict (HTTP 409), said
            // in plain words.
            return Err(EngineError::InUse(self.too_deep(parent)));
        }
        let id = self.take_id()?;
        self.layers.insert(
            id,
            LayerRecord {
                id,
                parent,
                flags: 0,
            },
        );
        Ok(id)
    }

    /// Marks layers nothing needs as deleted, and hidden layers with a single child as
    /// merging into it.
    pub fn settle_layers(&mut self) {
        let mut needed = HashSet::new();
        let tops = self
            .volumes
            .values()
            .map(|v| v.head)
            .chain(self.snapshots.values().map(|s| s.layer));
        for top in tops.collect::<Vec<_>>() {
            let mut at = top;
            while at != 0 && needed.insert(at) {
                at = self.layers.get(&at).map_or(0, |l| l.parent);
            }
        }
        let referenced: HashSet<u32> = self
            .volumes
            .values()
            .map(|v| v.head)
            .chain(self.snapshots.values().map(|s| s.layer))
            .collect();
        // Counted in one pass: asking every layer for its children walked the whole table
        // once per layer, and a volume-table change at the limits (20,480 layers) took seconds.
        let mut needed_kids: HashMap<u32, usize> = HashMap::new();
        for l in self.layers.values().filter(|l| needed.contains(&l.id)) {
            *needed_kids.entry(l.parent).or_default() += 1;
        }
        for (&id, l) in self.layers.iter_mut() {
            let kids = needed_kids.get(&id).copied().unwrap_or(0);
            if !needed.contains(&id) {
                l.flags = (l.flags | LAYER_DELETED) & !LAYER_MERGING;
            } else if !referenced.contains(&id) && kids == 1 {
                l.flags |= LAYER_MERGING;
            } else {
                l.flags &= !LAYER_MERGING;
            }
        }
    }
}

/// A snapshot as the API shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: VolumeId,
    pub volume: String,
    pub name: String,
    pub size_bytes: u64,
    pub created_unix_s: u64,
}

/// Something that can be read: a volume, or a snapshot (`volume@snapshot`, read-only).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ViewInfo {
    pub id: VolumeId,
    pub name: String,
    pub size_bytes: u64,
    pub read_only: bool,
}

impl Shared {
    pub fn tables(&self) -> Tables {
        let idx = self.index.read();
        Tables {
            layers: idx.layers.iter().map(|(k, l)| (*k, l.rec)).collect(),
            volumes: idx.volumes.clone(),
            snapshots: idx.snapshots.clone(),
            next_id: idx.next_id,
        }
    }

    /// Makes `t` durable, then current. A failed checkpoint takes the group offline: the fast
    /// device can no longer record what is acknowledged. The caller holds `durable`.
    pub fn commit_tables(&self, d: &mut Durable, t: &Tables) -> Result<(), EngineError> {
        let tail = self.log.lock().tail();
        let parts = self.durable_parts(d);
        match self.write_checkpoint_full(d, tail, &parts, t) {
            Ok(()) => {}
            // Nothing was written: the change is refused, the group is fine.
            Err(e @ EngineError::InvalidArgument(_)) => return Err(e),
            Err(e) => {
                self.fail(format!("cannot write the volume table: {e}"));
                return Err(e);
            }
        }
        self.install_tables(t);
        Ok(())
    }

    /// Puts the records in place; layers deleted or gone lose their fast maps.
    pub fn install_tables(&self, t: &Tables) {
        let mut dropped = Vec::new();
        {
            let mut idx = self.index.write();
            idx.layers.retain(|id, l| {
                let keep = t.layers.contains_key(id);
                if !keep {
                    dropped.extend(l.fast.iter());
                }
                keep
            });
            for (id, rec) in &t.layers {
                match idx.layers.get_mut(id) {
                    Some(l) => {
                        if rec.flags & LAYER_DELETED != 0 && l.rec.flags & LAYER_DELETED == 0 {
                            dropped.extend(l.fast.iter());
                            l.fast = ExtentMap::default();
                        }
                        l.rec = *rec;
                    }
                    None => {
                        idx.layers.insert(
                            *id,
                            LayerState {
                                rec: *rec,
                                fast: ExtentMap::default(),
                            },
                        );
                    }
                }
            }
            idx.volumes = t.volumes.clone();
            idx.snapshots = t.snapshots.clone();
            idx.next_id = t.next_id;
            idx.refresh_lookups();
        }
        self.release(&dropped);
        self.counters
            .own_changes
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        self.rebuild_runtimes();
        if t.layers
            .values()
            .any(|l| l.flags & (LAYER_DELETED | LAYER_MERGING) != 0)
        {
            self.wake_destager();
        }
    }
}

impl DiskGroup {
    /// Runs a change of the volume table: `f` edits a copy, which is made durable and current.
    pub(crate) fn change<T>(
        &self,
        f: impl FnOnce(&mut Tables) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        self.sh.check_running()?;
        let mut d = self.sh.durable.lock();
        let before = self.sh.tables();
        let mut t = before.clone();
        let out = f(&mut t)?;
        t.settle_layers();
        self.sh.check_table_room(&d, &before, &t)?;
        self.sh.commit_tables(&mut d, &t)?;
        Ok(out)
    }

    /// Adds a volume (name, size and policy already checked).
    pub(crate) fn insert_volume(
        &self,
        name: &str,
        size_bytes: u64,
        policy: Vec<u8>,
    ) -> Result<VolumeInfo, EngineError> {
        self.change(|t| {
            if t.volumes.values().any(|v| v.name == name) {
                return Err(EngineError::AlreadyExists(name.into()));
            }
            if t.volumes.len() >= MAX_VOLUMES {
                return Err(EngineError::InvalidArgument(format!(
                    "at most {MAX_VOLUMES} volumes"
                )));
            }
            let id = t.take_id()?;
            let head = t.new_layer(0)?;
            let rec = VolumeRecord {
                id,
                head,
                size_bytes,
                created_unix_s: unix_now_s(),
                name: name.into(),
                policy,
            };
            t.volumes.insert(id, rec);
            Ok(VolumeInfo {
                id,
                name: name.into(),
                size_bytes,
            })
        })
    }

    /// Edits one volume's record durably.
    pub(crate) fn change_volume(
        &self,
        name: &str,
        f: impl FnOnce(&mut VolumeRecord) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        self.change(|t| {
            let id = t.volume_named(name)?.id;
            let v = t
                .volumes
                .get_mut(&id)
                .ok_or_else(|| EngineError::NotFound(name.into()))?;
            f(v)
        })
    }

    /// Deletes a volume; its blocks are released on both tiers (in the background). A volume
    /// with snapshots is refused unless `with_snapshots`, which deletes them too. Clones made
    /// from its snapshots keep what they need.
    pub fn delete_volume(&self, name: &str, with_snapshots: bool) -> Result<(), EngineError> {
        self.change(|t| {
            let id = t.volume_named(name)?.id;
            let snaps: Vec<u32> = t.snapshots.values().filter(|s| s.volume == id).map(|s| s.id).collect();
            if !snaps.is_empty() && !with_snapshots {
                return Err(EngineError::InUse(format!(
                    "volume {name:?} has {} snapshot(s): delete them first, or delete the volume with its snapshots",
                    snaps.len()
                )));
            }
            for s in snaps {
                t.snapshots.remove(&s);
            }
            t.volumes.remove(&id);
            Ok(())
        })
    }

    /// Grows a volume; shrinking is refused.
    pub fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo, EngineError> {
        validate_size(size_bytes)?;
        self.change(|t| {
            let id = t.volume_named(name)?.id;
            let v = t
                .volumes
                .get_mut(&id)
                .ok_or_else(|| EngineError::NotFound(name.into()))?;
            if size_bytes < v.size_bytes {
                return Err(EngineError::InvalidArgument(format!(
                    "volume {name:?} is {} bytes; shrinking to {size_bytes} is not supported",
                    v.size_bytes
                )));
            }
            v.size_bytes = size_bytes;
            Ok(VolumeInfo {
                id,
                name: name.into(),
                size_bytes,
            })
        })
    }

    /// Takes a snapshot: waits for the volume's writes in flight, then freezes its contents.
    pub fn create_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotInfo, EngineError> {
        validate_name(name, "snapshot")?;
        let vid = self
            .volume(volume)
            .ok_or_else(|| EngineError::NotFound(volume.into()))?
            .id;
        let gate = self.sh.gate(vid);
        let _quiet = gate.write();
        self.change(|t| {
            let v = t
                .volumes
                .get(&vid)
                .cloned()
                .ok_or_else(|| EngineError::NotFound(volume.into()))?;
            if t.snapshots
                .values()
                .any(|s| s.volume == vid && s.name == name)
            {
                return Err(EngineError::AlreadyExists(format!("{volume}@{name}")));
            }
            if t.snapshots.len() >= MAX_SNAPSHOTS {
                return Err(EngineError::InvalidArgument(format!(
                    "at most {MAX_SNAPSHOTS} snapshots"
                )));
            }
            let id = t.take_id()?;
            let head = t.new_layer(v.head)?;
            let created_unix_s = unix_now_s();
            t.snapshots.insert(
                id,
                SnapshotRecord {
                    id,
                    volume: vid,
                    layer: v.head,
                    size_bytes: v.size_bytes,
                    created_unix_s,
                    name: name.into(),
                },
            );
            if let Some(v) = t.volumes.get_mut(&vid) {
                v.head = head;
            }
            Ok(SnapshotInfo {
                id,
                volume: volume.into(),
                name: name.into(),
                size_bytes: v.size_bytes,
                created_unix_s,
            })
        })
    }

    pub fn delete_snapshot(&self, volume: &str, name: &str) -> Result<(), EngineError> {
        self.change(|t| {
            let vid = t.volume_named(volume)?.id;
            let id = t.snapshot_named(vid, volume, name)?.id;
            t.snapshots.remove(&id);
            Ok(())
        })
    }

    /// A new writable volume that starts as the snapshot's image and shares its blocks.
    pub fn clone_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
        new_name: &str,
    ) -> Result<VolumeInfo, EngineError> {
        validate_name(new_name, "volume")?;
        self.change(|t| {
            let vid = t.volume_named(volume)?.id;
            let s = t.snapshot_named(vid, volume, snapshot)?.clone();
            if t.volumes.values().any(|v| v.name == new_name) {
                return Err(EngineError::AlreadyExists(new_name.into()));
            }
            if t.volumes.len() >= MAX_VOLUMES {
                return Err(EngineError::InvalidArgument(format!(
                    "at most {MAX_VOLUMES} volumes"
                )));
            }
            let id = t.take_id()?;
            let head = t.new_layer(s.layer)?;
            // A clone serves like the volume it came from.
            let policy = t
                .volumes
                .get(&vid)
                .map(|v| v.policy.clone())
                .unwrap_or_default();
            let rec = VolumeRecord {
                id,
                head,
                size_bytes: s.size_bytes,
                created_unix_s: unix_now_s(),
                name: new_name.into(),
                policy,
            };
            t.volumes.insert(id, rec);
            Ok(VolumeInfo {
                id,
                name: new_name.into(),
                size_bytes: s.size_bytes,
            })
        })
    }

    /// Returns a volume to a snapshot's image (and size); what was written since is dropped.
    /// Snapshots taken after it stay. Waits for the volume's writes in flight.
    pub fn rollback_volume(&self, volume: &str, snapshot: &str) -> Result<VolumeInfo, EngineError> {
        let vid = self
            .volume(volume)
            .ok_or_else(|| EngineError::NotFound(volume.into()))?
            .id;
        let gate = self.sh.gate(vid);
        let _quiet = gate.write();
        self.change(|t| {
            let s = t.snapshot_named(vid, volume, snapshot)?.clone();
            let head = t.new_layer(s.layer)?;
            let v = t
                .volumes
                .get_mut(&vid)
                .ok_or_else(|| EngineError::NotFound(volume.into()))?;
            v.head = head;
            v.size_bytes = s.size_bytes;
            Ok(VolumeInfo {
                id: vid,
                name: volume.into(),
                size_bytes: s.size_bytes,
            })
        })
    }

    /// Whether no volume, snapshot or clone was ever created in this group (ids are never
    /// reused, so deleting them all does not make the table new again).
    pub fn volume_table_is_new(&self) -> bool {
        self.sh.index.read().next_id == 1
    }

    pub fn volumes(&self) -> Vec<VolumeInfo> {
        let idx = self.sh.index.read();
        idx.volumes
            .values()
            .map(|v| VolumeInfo {
                id: v.id,
                name: v.name.clone(),
                size_bytes: v.size_bytes,
            })
            .collect()
    }

    pub fn volume(&self, name: &str) -> Option<VolumeInfo> {
        let idx = self.sh.index.read();
        idx.volume_by_name(name).map(|v| VolumeInfo {
            id: v.id,
            name: v.name.clone(),
            size_bytes: v.size_bytes,
        })
    }

    /// Snapshots of one volume (or all), oldest first.
    pub fn snapshots(&self, volume: Option<&str>) -> Result<Vec<SnapshotInfo>, EngineError> {
        let idx = self.sh.index.read();
        let only = match volume {
            Some(n) => Some(
                idx.volume_by_name(n)
                    .ok_or_else(|| EngineError::NotFound(n.into()))?
                    .id,
            ),
            None => None,
        };
        let mut out: Vec<SnapshotInfo> = idx
            .snapshots
            .values()
            .filter(|s| only.is_none_or(|v| s.volume == v))
            .filter_map(|s| {
                let vol = idx.volumes.get(&s.volume)?;
                Some(SnapshotInfo {
                    id: s.id,
                    volume: vol.name.clone(),
                    name: s.name.clone(),
                    size_bytes: s.size_bytes,
                    created_unix_s: s.created_unix_s,
                })
            })
            .collect();
        out.sort_by_key(|s| (s.created_unix_s, s.id));
        Ok(out)
    }

    /// A volume (`name`) or a snapshot (`volume@snapshot`) by name.
    pub fn view(&self, name: &str) -> Option<ViewInfo> {
        let idx = self.sh.index.read();
        match name.split_once('@') {
            None => idx.volume_by_name(name).map(|v| ViewInfo {
                id: v.id,
                name: v.name.clone(),
                size_bytes: v.size_bytes,
                read_only: false,
            }),
            Some((vol, snap)) => {
                let v = idx.volume_by_name(vol)?;
                let s = idx.snapshot_by_name(v.id, snap)?;
                Some(ViewInfo {
                    id: s.id,
                    name: name.into(),
                    size_bytes: s.size_bytes,
                    read_only: true,
                })
            }
        }
    }

    /// Every volume and snapshot, as NBD exports them.
    pub fn views(&self) -> Vec<ViewInfo> {
        let idx = self.sh.index.read();
        let mut out: Vec<ViewInfo> = idx
            .volumes
            .values()
            .map(|v| ViewInfo {
                id: v.id,
                name: v.name.clone(),
                size_bytes: v.size_bytes,
                read_only: false,
            })
            .collect();
        for s in idx.snapshots.values() {
            if let Some(v) = idx.volumes.get(&s.volume) {
                out.push(ViewInfo {
                    id: s.id,
                    name: format!("{}@{}", v.name, s.name),
                    size_bytes: s.size_bytes,
                    read_only: true,
                });
            }
        }
        out
    }
}
