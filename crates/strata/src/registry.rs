//! Open NBD handles per view (volume or snapshot), and the changes that take a view away from
//! its clients: deleting a volume or snapshot, rolling a volume back.
//!
//! Every export operation holds its view's gate for reading. Such a change takes the gates of
//! every view it affects for writing, marks them dead and only then calls the engine. So once a
//! forced change starts, no operation of an open connection is in flight and every later one
//! fails with ESHUTDOWN instead of touching freed (or reused, or rolled back) space.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock, RwLockWriteGuard};
use strata_engine::{DiskGroup, EngineError, SnapshotInfo, ViewInfo, VolumeId, VolumeInfo};

use crate::metrics::IoMetrics;

/// How often a change waiting for a view's requests cuts off those waiting for its limits.
const CUT_LIMIT_WAITS_EVERY: Duration = Duration::from_millis(20);

/// Per-view state shared by its open exports and the admin API.
pub struct Gate {
    pub open_handles: AtomicUsize,
    /// false once the view is being or has been deleted or rolled back under its clients.
    /// Shared so a write in flight can hold it until it completes.
    pub alive: Arc<RwLock<bool>>,
}

/// A change refused because clients have a view open, or refused by the engine.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    #[error("{what} has {connections} open NBD connection(s); {hint} to cut them off")]
    Busy {
        what: String,
        connections: usize,
        hint: &'static str,
    },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// What a fenced change does to the views it affects, and how to tell the user to force it.
struct Fence<'a> {
    /// The views (id, export name) whose clients lose them.
    views: Vec<(VolumeId, String)>,
    /// Names the change in a Busy error, e.g. `volume "db"`.
    what: String,
    hint: &'static str,
    force: bool,
    /// The views cease to exist (their request figures go too); false for a rollback.
    gone: bool,
    /// Past tense for the log line, e.g. "deleted a volume".
    done: &'a str,
}

pub struct Registry {
    group: Arc<DiskGroup>,
    /// Held across open and every fenced change, so that a handle is never opened on a view
    /// being changed.
    gates: Mutex<HashMap<VolumeId, Arc<Gate>>>,
    /// Request figures per view (dropped with the view) and for the whole node.
    volume_io: Mutex<HashMap<VolumeId, Arc<IoMetrics>>>,
    node_io: Arc<IoMetrics>,
}

impl Registry {
    pub fn new(group: Arc<DiskGroup>) -> Arc<Registry> {
        Arc::new(Registry {
            group,
            gates: Mutex::new(HashMap::new()),
            volume_io: Mutex::new(HashMap::new()),
            node_io: Arc::new(IoMetrics::default()),
        })
    }

    /// Request figures of every request served since the daemon started.
    pub fn node_io(&self) -> &Arc<IoMetrics> {
        &self.node_io
    }

    /// Request figures of a volume or snapshot (zeros until it is first opened). Only
    /// `open_view` adds a view's figures, under the gates' lock: a caller that read the id
    /// before the view was deleted must not bring them back for good.
    pub fn volume_io(&self, id: VolumeId) -> Arc<IoMetrics> {
        self.volume_io.lock().get(&id).cloned().unwrap_or_default()
    }

    pub fn group(&self) -> &Arc<DiskGroup> {
        &self.group
    }

    /// Finds a view by export name and counts a new handle on it (the caller's export gives it
    /// back on drop).
    pub fn open_view(&self, name: &str) -> Option<(ViewInfo, Arc<Gate>)> {
        let mut gates = self.gates.lock();
        let view = self.group.view(name)?;
        let gate = gates
            .entry(view.id)
            .or_insert_with(|| {
                Arc::new(Gate {
                    open_handles: AtomicUsize::new(0),
                    alive: Arc::new(RwLock::new(true)),
                })
            })
            .clone();
        gate.open_handles.fetch_add(1, Ordering::Relaxed);
        self.volume_io.lock().entry(view.id).or_default();
        Some((view, gate))
    }

    /// Open NBD handles on a volume or snapshot.
    pub fn connections(&self, id: VolumeId) -> usize {
        self.gates
            .lock()
            .get(&id)
            .map_or(0, |g| g.open_handles.load(Ordering::Relaxed))
    }

    /// Open NBD handles on every volume and snapshot that is still alive.
    pub fn connections_total(&self) -> usize {
        self.gates
            .lock()
            .values()
            .map(|g| g.open_handles.load(Ordering::Relaxed))
            .sum()
    }

    /// Deletes a volume (and with `with_snapshots` its snapshots), refusing while handles are
    /// open on any of them unless `force`. Blocks until their operations in flight finish.
    pub fn delete(&self, name: &str, force: bool, with_snapshots: bool) -> Result<(), ChangeError> {
        let mut gates = self.gates.lock();
        let info = self.volume(name)?;
        let mut views = vec![(info.id, info.name.clone())];
        if with_snapshots {
            views.extend(self.snapshot_views(name)?);
        }
        let fence = Fence {
            views,
            what: format!(
                "volume {name:?}{}",
                if with_snapshots {
                    " or one of its snapshots"
                } else {
                    ""
                }
            ),
            hint: "delete with force=true (strata volume delete --force)",
            force,
            gone: true,
            done: "deleted a volume",
        };
        let deleted = self.fenced(&mut gates, fence, || {
            self.group.delete_volume(name, with_snapshots)
        });
        match deleted {
            // Name the switch that deletes the snapshots too.
            Err(ChangeError::Engine(EngineError::InUse(why))) if !with_snapshots => {
                Err(EngineError::InUse(format!(
                    "{why} (with_snapshots=true; strata volume delete --with-snapshots)"
                ))
                .into())
            }
            other => other,
        }
    }

    /// Deletes a snapshot, refusing while handles are open on it unless `force`.
    pub fn delete_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
        force: bool,
    ) -> Result<(), ChangeError> {
        let mut gates = self.gates.lock();
        let view = self.snapshot_view(volume, snapshot)?;
        let fence = Fence {
            what: format!("snapshot {:?}", view.1),
            views: vec![view],
            hint: "delete with force=true (strata snapshot delete --force)",
            force,
            gone: true,
            done: "deleted a snapshot",
        };
        self.fenced(&mut gates, fence, || {
            self.group.delete_snapshot(volume, snapshot)
        })?;
        Ok(())
    }

    /// Returns a volume to a snapshot, refusing while handles are open on the volume unless
    /// `force`, which cuts them off: their picture of the volume (caches, a mounted file
    /// system) no longer matches it. Clients that connect afterwards see the snapshot's image.
    pub fn rollback(
        &self,
        volume: &str,
        snapshot: &str,
        force: bool,
    ) -> Result<VolumeInfo, ChangeError> {
        let mut gates = self.gates.lock();
        let info = self.volume(volume)?;
        // Refuse an unknown snapshot before fencing anyone off.
        self.snapshot_view(volume, snapshot)?;
        let fence = Fence {
            views: vec![(info.id, info.name)],
            what: format!("volume {volume:?}"),
            hint: "roll back with force=true (strata volume rollback --force)",
            force,
            gone: false,
            done: "rolled back a volume",
        };
        self.fenced(&mut gates, fence, || {
            self.group.rollback_volume(volume, snapshot)
        })
    }

    fn volume(&self, name: &str) -> Result<VolumeInfo, EngineError> {
        self.group
            .volume(name)
            .ok_or_else(|| EngineError::NotFound(name.to_string()))
    }

    /// (id, export name) of one snapshot.
    fn snapshot_view(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> Result<(VolumeId, String), EngineError> {
        self.volume(volume)?;
        let export = format!("{volume}@{snapshot}");
        let view = self
            .group
            .view(&export)
            .ok_or_else(|| EngineError::NotFound(export.clone()))?;
        Ok((view.id, export))
    }

    /// (id, export name) of every snapshot of a volume.
    fn snapshot_views(&self, volume: &str) -> Result<Vec<(VolumeId, String)>, EngineError> {
        let snaps: Vec<SnapshotInfo> = self.group.snapshots(Some(volume))?;
        Ok(snaps
            .into_iter()
            .map(|s| (s.id, format!("{}@{}", s.volume, s.name)))
            .collect())
    }

    /// Takes the gate of view `id` for a change, once the view's requests in flight are done.
    /// Those waiting for the volume's IOPS or bandwidth limit are cut off (they fail with
    /// ESHUTDOWN, as they would after the change), again every 20 ms for any that began
    /// waiting meanwhile: a forced change must not wait for each queued request's turn under
    /// the limit (32 requests at 1 IOPS held it, and with it every page that counts
    /// connections, for half a minute). A forced change the engine then refuses has still
    /// failed those requests.
    fn close<'g>(&self, id: VolumeId, gate: &'g Gate) -> RwLockWriteGuard<'g, bool> {
        loop {
            self.group.cut_limit_waits(id);
            if let Some(guard) = gate.alive.try_write_for(CUT_LIMIT_WAITS_EVERY) {
                return guard;
            }
        }
    }

    /// Runs `change` with the gates of the fence's views closed. Refused (and nothing changed)
    /// while any of them has open handles, unless forced; then those handles fail from now on.
    /// On success the views' gates are dropped, so clients that connect later get fresh ones.
    fn fenced<T>(
        &self,
        gates: &mut HashMap<VolumeId, Arc<Gate>>,
        fence: Fence<'_>,
        change: impl FnOnce() -> Result<T, EngineError>,
    ) -> Result<T, ChangeError> {
        let held: Vec<(VolumeId, Arc<Gate>)> = fence
            .views
            .iter()
            .filter_map(|(id, _)| gates.get(id).map(|g| (*id, g.clone())))
            .collect();
        let connections: usize = held
            .iter()
            .map(|(_, g)| g.open_handles.load(Ordering::Relaxed))
            .sum();
        if connections > 0 && !fence.force {
            return Err(ChangeError::Busy {
                what: fence.what,
                connections,
                hint: fence.hint,
            });
        }
        let mut alive: Vec<_> = held.iter().map(|(id, g)| self.close(*id, g)).collect();
        for a in alive.iter_mut() {
            **a = false;
        }
        match change() {
            Ok(out) => {
                let mut io = self.volume_io.lock();
                for (id, _) in &fence.views {
                    gates.remove(id);
                    if fence.gone {
                        io.remove(id);
                    }
                }
                if connections > 0 {
                    let names: Vec<&str> = fence.views.iter().map(|(_, n)| n.as_str()).collect();
                    tracing::warn!(views = ?names, connections, "{} with open NBD connections", fence.done);
                }
                Ok(out)
            }
            Err(e) => {
                for a in alive.iter_mut() {
                    **a = true;
                }
                Err(e.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::test_group;

    #[test]
    fn figures_read_after_a_delete_are_not_kept() {
        let reg = Registry::new(test_group());
        let info = reg.group().create_volume("db", 1 << 20).unwrap();
        let (_, gate) = reg.open_view("db").unwrap();
        gate.open_handles.fetch_sub(1, Ordering::Relaxed);
        reg.volume_io(info.id)
            .write_ops
            .fetch_add(1, Ordering::Relaxed);
        assert_eq!(reg.volume_io(info.id).snapshot().write_ops, 1);
        reg.delete("db", false, false).unwrap();
        // A page that listed the volume before the delete reads its figures after it.
        assert_eq!(reg.volume_io(info.id).snapshot().write_ops, 0);
        assert!(
            reg.volume_io.lock().is_empty(),
            "a deleted volume's figures were kept"
        );
    }
}
