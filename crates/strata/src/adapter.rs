//! Serves engine volumes through the NBD server: a [`Backend`] whose exports are volumes.
//!
//! The [`Registry`] counts open NBD handles per volume and makes deletion safe against them:
//! every export operation holds its volume's gate for reading, and deletion takes the gate for
//! writing, marks it dead and only then frees the volume. So once a forced delete starts, no
//! operation of an open connection is in flight and every later one fails with ESHUTDOWN
//! instead of touching freed (or reused) space.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use std::time::Instant;

use crate::metrics::{IoMetrics, Kind};
use strata_engine::{DiskGroup, EngineError, ExtentKind, VolumeId};
use strata_nbd::{Backend, BlockStatus, Errno, Export, ExportInfo};

/// Most extents in one BLOCK_STATUS reply; the client asks again for the rest.
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 1024;
/// Most bytes one BLOCK_STATUS asks the engine about, bounding the work of a single request.
pub const MAX_BLOCK_STATUS_QUERY_BYTES: u64 = 128 << 20;
const NBD_STATE_HOLE: u32 = 1;
const NBD_STATE_ZERO: u32 = 2;

/// Per-volume state shared by its open exports and the admin API.
struct Gate {
    open_handles: AtomicUsize,
    /// false once the volume is being or has been deleted.
    alive: RwLock<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    #[error("volume {name:?} has {connections} open NBD connection(s); delete with force=true (strata volume delete --force) to cut them off")]
    Busy { name: String, connections: usize },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

pub struct Registry {
    group: Arc<DiskGroup>,
    /// Held across open and delete so that a handle is never opened on a volume being deleted.
    gates: Mutex<HashMap<VolumeId, Arc<Gate>>>,
    /// Request figures per volume (dropped with the volume) and for the whole node.
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

    /// Request figures of a volume (zeros until its first request).
    pub fn volume_io(&self, id: VolumeId) -> Arc<IoMetrics> {
        self.volume_io.lock().entry(id).or_default().clone()
    }

    pub fn group(&self) -> &Arc<DiskGroup> {
        &self.group
    }

    /// Open NBD handles on a volume.
    pub fn connections(&self, id: VolumeId) -> usize {
        self.gates
            .lock()
            .get(&id)
            .map_or(0, |g| g.open_handles.load(Ordering::Relaxed))
    }

    /// Deletes a volume, refusing while handles are open unless `force`. Blocks until the
    /// operations in flight on the volume have finished.
    pub fn delete(&self, name: &str, force: bool) -> Result<(), DeleteError> {
        let mut gates = self.gates.lock();
        let info = self
            .group
            .volume(name)
            .ok_or_else(|| EngineError::NotFound(name.to_string()))?;
        let Some(gate) = gates.get(&info.id).cloned() else {
            self.group.delete_volume(name, false)?;
            self.volume_io.lock().remove(&info.id);
            return Ok(());
        };
        let connections = gate.open_handles.load(Ordering::Relaxed);
        if connections > 0 && !force {
            return Err(DeleteError::Busy {
                name: name.to_string(),
                connections,
            });
        }
        let mut alive = gate.alive.write();
        *alive = false;
        match self.group.delete_volume(name, false) {
            Ok(()) => {
                gates.remove(&info.id);
                self.volume_io.lock().remove(&info.id);
                if connections > 0 {
                    tracing::warn!(
                        volume = name,
                        connections,
                        "deleted a volume with open NBD connections"
                    );
                }
                Ok(())
            }
            Err(e) => {
                *alive = true;
                Err(e.into())
            }
        }
    }
}

/// The NBD server's view of the registry.
pub struct NbdBackend(pub Arc<Registry>);

impl Backend for NbdBackend {
    fn list(&self) -> Vec<ExportInfo> {
        self.0
            .group
            .volumes()
            .into_iter()
            .map(|v| ExportInfo {
                description: format!(
                    "Strata volume, {}",
                    crate::config::format_size(v.size_bytes)
                ),
                name: v.name,
            })
            .collect()
    }

    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        let reg = &self.0;
        let mut gates = reg.gates.lock();
        let info = reg.group.volume(name)?;
        let gate = gates
            .entry(info.id)
            .or_insert_with(|| {
                Arc::new(Gate {
                    open_handles: AtomicUsize::new(0),
                    alive: RwLock::new(true),
                })
            })
            .clone();
        gate.open_handles.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(volume = name, "NBD handle opened");
        Some(Arc::new(VolumeExport {
            group: reg.group.clone(),
            io: reg.volume_io(info.id),
            node_io: reg.node_io.clone(),
            gate,
            id: info.id,
            size_bytes: info.size_bytes,
        }))
    }
}

/// One NBD connection's handle on a volume. Its size is fixed when opened: a resize is seen by
/// connections made afterwards, as NBD has no way to tell a client the size changed.
struct VolumeExport {
    group: Arc<DiskGroup>,
    io: Arc<IoMetrics>,
    node_io: Arc<IoMetrics>,
    gate: Arc<Gate>,
    id: VolumeId,
    size_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// How an engine failure reaches an NBD client. Out-of-range is EINVAL for reads and ENOSPC
/// for writes, as the NBD spec asks (and as the server's own range pre-check answers).
pub fn errno_for(op: Op, e: &EngineError) -> Errno {
    match e {
        EngineError::OutOfRange { .. } if op == Op::Read => Errno::Inval,
        EngineError::OutOfRange { .. } => Errno::NoSpc,
        EngineError::NoSpace => Errno::NoSpc,
        EngineError::InvalidArgument(_) | EngineError::InUse(_) => Errno::Inval,
        EngineError::ReadOnly(_) => Errno::Perm,
        EngineError::ShuttingDown => Errno::Shutdown,
        // The volume went away under the client (deleted).
        EngineError::NotFound(_) => Errno::Shutdown,
        EngineError::Corrupt(_)
        | EngineError::Failed(_)
        | EngineError::Device(_)
        | EngineError::Format(_)
        | EngineError::AlreadyExists(_) => Errno::Io,
    }
}

impl VolumeExport {
    /// Runs `f` while the volume is known alive; maps its error for `op`.
    fn guarded<T>(
        &self,
        op: Op,
        what: &str,
        f: impl FnOnce() -> Result<T, EngineError>,
    ) -> Result<T, Errno> {
        let alive = self.gate.alive.read();
        if !*alive {
            return Err(Errno::Shutdown);
        }
        f().map_err(|e| {
            let errno = errno_for(op, &e);
            if errno == Errno::Io {
                tracing::warn!(volume = self.id, op = what, error = %e, "I/O error returned to an NBD client");
            } else {
                tracing::debug!(volume = self.id, op = what, error = %e, "NBD request failed");
            }
            errno
        })
    }
}

impl VolumeExport {
    /// Times `f` and counts it in the volume's and the node's figures.
    fn timed<T>(&self, kind: Kind, bytes: u64, f: impl FnOnce() -> Result<T, Errno>) -> Result<T, Errno> {
        let started = Instant::now();
        let result = f();
        let latency = started.elapsed();
        let ok = result.is_ok();
        self.io.record(kind, bytes, latency, ok);
        self.node_io.record(kind, bytes, latency, ok);
        result
    }
}

impl Drop for VolumeExport {
    fn drop(&mut self) {
        self.gate.open_handles.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Export for VolumeExport {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_only(&self) -> bool {
        false
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let bytes = buf.len() as u64;
        self.timed(Kind::Read, bytes, || {
            self.guarded(Op::Read, "read", || self.group.read(self.id, offset, buf))
        })
    }

    /// The engine acknowledges a write only once it is durable, so FUA needs nothing more.
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        self.timed(Kind::Write, data.len() as u64, || {
            self.guarded(Op::Write, "write", || {
                self.group.write(self.id, offset, data)
            })
        })
    }

    fn flush(&self) -> Result<(), Errno> {
        self.timed(Kind::Flush, 0, || {
            self.guarded(Op::Write, "flush", || self.group.flush())
        })
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.timed(Kind::Unmap, 0, || {
            self.guarded(Op::Write, "trim", || {
                self.group.discard(self.id, offset, len)
            })
        })
    }

    /// The volume is thin and log-structured: no range stays "provisioned" across overwrites,
    /// so NO_HOLE (`may_trim == false`) cannot promise more than plain zeroes and is served the same.
    fn write_zeroes(&self, offset: u64, len: u64, _may_trim: bool) -> Result<(), Errno> {
        self.timed(Kind::Unmap, 0, || {
            self.guarded(Op::Write, "write_zeroes", || {
                self.group.write_zeroes(self.id, offset, len)
            })
        })
    }

    fn cache(&self, _offset: u64, _len: u64) -> Result<(), Errno> {
        self.guarded(Op::Read, "cache", || Ok(()))
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<BlockStatus>, Errno> {
        let len = len.min(MAX_BLOCK_STATUS_QUERY_BYTES);
        let extents = self.guarded(Op::Read, "block_status", || {
            self.group.extents(self.id, offset, len)
        })?;
        let runs = extents.into_iter().map(|x| (x.offset, x.len, x.kind));
        Ok(to_block_status(offset, len, runs))
    }
}

/// Turns engine extents into BLOCK_STATUS runs: clipped to the request, contiguous from
/// `offset`, neighbours of one kind merged, at most [`MAX_BLOCK_STATUS_EXTENTS`], never empty.
pub fn to_block_status(
    offset: u64,
    len: u64,
    extents: impl Iterator<Item = (u64, u64, ExtentKind)>,
) -> Vec<BlockStatus> {
    let end = offset + len;
    let max_run = u64::from(u32::MAX) / 4096 * 4096;
    let mut out: Vec<BlockStatus> = Vec::new();
    let mut cursor = offset;
    for (x_offset, x_len, kind) in extents {
        let x_end = x_offset.saturating_add(x_len).min(end);
        if x_offset > cursor || x_end <= cursor {
            // A gap or an overlap: report what is known to be contiguous and stop.
            if x_end <= cursor {
                continue;
            }
            break;
        }
        let flags = match kind {
            ExtentKind::Zero => NBD_STATE_HOLE | NBD_STATE_ZERO,
            ExtentKind::Data => 0,
        };
        let mut remaining = x_end - cursor;
        while remaining > 0 {
            match out.last_mut() {
                Some(last) if last.flags == flags && u64::from(last.len) < max_run => {
                    let add = remaining.min(max_run - u64::from(last.len));
                    last.len += add as u32;
                    remaining -= add;
                }
                _ => {
                    if out.len() == MAX_BLOCK_STATUS_EXTENTS {
                        return out;
                    }
                    let add = remaining.min(max_run);
                    out.push(BlockStatus {
                        len: add as u32,
                        flags,
                    });
                    remaining -= add;
                }
            }
            cursor = x_end - remaining;
        }
        if cursor >= end {
            break;
        }
    }
    if out.is_empty() {
        // Nothing usable from the engine: "allocated data" is always a truthful answer.
        out.push(BlockStatus {
            len: len.min(max_run) as u32,
            flags: 0,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::test_group;
    use ExtentKind::{Data, Zero};

    fn backend() -> (Arc<Registry>, NbdBackend) {
        let reg = Registry::new(test_group());
        (reg.clone(), NbdBackend(reg))
    }

    #[test]
    fn errors_map_to_nbd_errnos() {
        let oor = EngineError::OutOfRange {
            offset: 1,
            len: 2,
            size_bytes: 1,
        };
        assert_eq!(errno_for(Op::Read, &oor), Errno::Inval);
        assert_eq!(errno_for(Op::Write, &oor), Errno::NoSpc);
        assert_eq!(errno_for(Op::Write, &EngineError::NoSpace), Errno::NoSpc);
        assert_eq!(
            errno_for(Op::Read, &EngineError::Corrupt("x".into())),
            Errno::Io
        );
        let dev = strata_device::DeviceError::Open("x".into());
        assert_eq!(errno_for(Op::Read, &EngineError::Device(dev)), Errno::Io);
        assert_eq!(
            errno_for(Op::Write, &EngineError::ShuttingDown),
            Errno::Shutdown
        );
        assert_eq!(
            errno_for(Op::Read, &EngineError::NotFound("v".into())),
            Errno::Shutdown
        );
        assert_eq!(
            errno_for(Op::Write, &EngineError::InvalidArgument("x".into())),
            Errno::Inval
        );
    }

    #[test]
    fn block_status_maps_kinds_and_merges() {
        let runs = to_block_status(
            0,
            16384,
            [(0, 4096, Zero), (4096, 4096, Zero), (8192, 8192, Data)].into_iter(),
        );
        assert_eq!(
            runs,
            vec![
                BlockStatus {
                    len: 8192,
                    flags: 3
                },
                BlockStatus {
                    len: 8192,
                    flags: 0
                }
            ]
        );
    }

    #[test]
    fn block_status_clips_to_the_request() {
        let runs = to_block_status(4096, 4096, [(0, 1 << 20, Zero)].into_iter());
        assert_eq!(
            runs,
            vec![BlockStatus {
                len: 4096,
                flags: 3
            }]
        );
    }

    #[test]
    fn block_status_stops_at_a_gap_and_is_never_empty() {
        let runs = to_block_status(0, 16384, [(0, 4096, Data), (8192, 4096, Zero)].into_iter());
        assert_eq!(
            runs,
            vec![BlockStatus {
                len: 4096,
                flags: 0
            }]
        );
        let runs = to_block_status(0, 8192, std::iter::empty());
        assert_eq!(
            runs,
            vec![BlockStatus {
                len: 8192,
                flags: 0
            }]
        );
    }

    #[test]
    fn block_status_caps_the_number_of_extents() {
        let n = MAX_BLOCK_STATUS_EXTENTS as u64 + 10;
        let extents = (0..n).map(|i| (i * 4096, 4096, if i % 2 == 0 { Data } else { Zero }));
        let runs = to_block_status(0, n * 4096, extents);
        assert_eq!(runs.len(), MAX_BLOCK_STATUS_EXTENTS);
    }

    #[test]
    fn block_status_splits_runs_longer_than_u32() {
        let len = 6u64 << 30;
        let runs = to_block_status(0, len, [(0, len, Zero)].into_iter());
        assert!(runs.len() >= 2);
        assert_eq!(runs.iter().map(|r| u64::from(r.len)).sum::<u64>(), len);
        assert!(runs.iter().all(|r| r.len % 4096 == 0));
    }

    #[test]
    fn open_counts_handles_and_drop_releases_them() {
        let (reg, backend) = backend();
        let info = reg.group().create_volume("v", 1 << 20).unwrap();
        assert!(backend.open("nope").is_none());
        let a = backend.open("v").unwrap();
        let b = backend.open("v").unwrap();
        assert_eq!(reg.connections(info.id), 2);
        assert_eq!(a.size_bytes(), 1 << 20);
        drop(a);
        assert_eq!(reg.connections(info.id), 1);
        drop(b);
        assert_eq!(reg.connections(info.id), 0);
        assert_eq!(backend.list().len(), 1);
    }

    #[test]
    fn delete_is_refused_while_open_and_forced_delete_fences_io() {
        let (reg, backend) = backend();
        reg.group().create_volume("v", 1 << 20).unwrap();
        let export = backend.open("v").unwrap();
        export.write(0, &[7u8; 4096], false).unwrap();
        assert!(matches!(
            reg.delete("v", false),
            Err(DeleteError::Busy { connections: 1, .. })
        ));
        let mut buf = vec![0u8; 4096];
        export.read(0, &mut buf).unwrap();
        assert_eq!(buf[0], 7);
        reg.delete("v", true).unwrap();
        assert_eq!(export.read(0, &mut buf), Err(Errno::Shutdown));
        assert_eq!(export.write(0, &buf, true), Err(Errno::Shutdown));
        assert_eq!(export.flush(), Err(Errno::Shutdown));
        // A new volume of the same name is not reachable through the old handle.
        reg.group().create_volume("v", 1 << 20).unwrap();
        assert_eq!(export.read(0, &mut buf), Err(Errno::Shutdown));
        drop(export);
        assert!(matches!(
            reg.delete("missing", false),
            Err(DeleteError::Engine(EngineError::NotFound(_)))
        ));
    }

    #[test]
    fn closed_handles_do_not_block_delete() {
        let (reg, backend) = backend();
        reg.group().create_volume("v", 1 << 20).unwrap();
        drop(backend.open("v").unwrap());
        reg.delete("v", false).unwrap();
        assert!(reg.group().volume("v").is_none());
    }
}
