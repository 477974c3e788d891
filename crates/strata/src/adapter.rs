//! Serves engine volumes and snapshots through the NBD server: a [`Backend`] whose exports are
//! views of the engine, volumes (`NAME`, writable) and snapshots (`VOLUME@SNAPSHOT`, read-only).
//! Every export operation runs under its view's gate (see `registry.rs`), so a view deleted or
//! rolled back under its clients fails their later requests with ESHUTDOWN.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::{ArcRwLockReadGuard, Mutex, RawRwLock, RwLock};

use std::time::Instant;

use crate::metrics::{IoMetrics, Kind};
use crate::registry::Gate;
pub use crate::registry::{ChangeError, Registry};
use strata_engine::{DiskGroup, EngineError, ExtentKind, VolumeId};
use strata_nbd::proto::cmd;
use strata_nbd::{Backend, BlockStatus, Errno, Export, ExportInfo, ReadDone, WriteDone};

/// Most extents in one BLOCK_STATUS reply; the client asks again for the rest.
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 1024;
/// Most bytes one BLOCK_STATUS asks the engine about, bounding the work of a single request.
pub const MAX_BLOCK_STATUS_QUERY_BYTES: u64 = 128 << 20;
const NBD_STATE_HOLE: u32 = 1;
const NBD_STATE_ZERO: u32 = 2;

/// The NBD server's view of the registry.
pub struct NbdBackend(pub Arc<Registry>);

impl Backend for NbdBackend {
    fn list(&self) -> Vec<ExportInfo> {
        let mut views = self.0.group().views();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        views
            .into_iter()
            .map(|v| {
                let size = crate::config::format_size(v.size_bytes);
                let description = match v.name.split_once('@') {
                    Some((volume, _)) => format!("Strata snapshot of {volume}, {size}, read-only"),
                    None => format!("Strata volume, {size}"),
                };
                ExportInfo {
                    description,
                    name: v.name,
                }
            })
            .collect()
    }

    /// `NAME` opens a volume, `VOLUME@SNAPSHOT` a snapshot (read-only).
    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        let reg = &self.0;
        let (view, gate) = reg.open_view(name)?;
        tracing::debug!(export = name, read_only = view.read_only, "NBD handle opened");
        Some(Arc::new(VolumeExport {
            group: reg.group().clone(),
            io: reg.volume_io(view.id),
            node_io: reg.node_io().clone(),
            gate,
            id: view.id,
            size_bytes: view.size_bytes,
            read_only: view.read_only,
        }))
    }
}

/// One NBD connection's handle on a volume or snapshot. Its size is fixed when opened: a
/// resize is seen by connections made afterwards, as NBD has no way to tell a client the size
/// changed.
struct VolumeExport {
    group: Arc<DiskGroup>,
    io: Arc<IoMetrics>,
    node_io: Arc<IoMetrics>,
    gate: Arc<Gate>,
    id: VolumeId,
    size_bytes: u64,
    /// A snapshot: the server refuses writes, trims and write-zeroes with EPERM (and the
    /// engine would too).
    read_only: bool,
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
        EngineError::ShuttingDown | EngineError::Cancelled(_) => Errno::Shutdown,
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

/// What the completion of a request started without a blocking thread does before the
/// client hears of it: the view stays alive (forced changes wait) until then, the error is
/// mapped as `guarded` maps it, and the request is counted as `timed` counts it.
struct Finish {
    _alive: ArcRwLockReadGuard<RawRwLock, bool>,
    io: Arc<IoMetrics>,
    node_io: Arc<IoMetrics>,
    id: VolumeId,
    kind: Kind,
    op: Op,
    what: &'static str,
    bytes: u64,
    started: Instant,
}

impl Finish {
    fn finish<T>(self, result: Result<T, EngineError>) -> Result<T, Errno> {
        let result = result.map_err(|e| {
            let errno = errno_for(self.op, &e);
            if errno == Errno::Io {
                tracing::warn!(volume = self.id, op = self.what, error = %e, "I/O error returned to an NBD client");
            }
            errno
        });
        let latency = self.started.elapsed();
        self.io.record(self.kind, self.bytes, latency, result.is_ok());
        self.node_io.record(self.kind, self.bytes, latency, result.is_ok());
        result
    }
}

/// A completion callback: the NBD server's (errors as errnos) or the engine's.
type Done<T, E> = Box<dyn FnOnce(Result<T, E>) + Send + 'static>;

impl VolumeExport {
    /// Starts a request without a blocking thread: `start` hands the engine a completion that
    /// finishes the request (see [`Finish`]) and then calls `done`. `done` comes back
    /// untouched when the view is being changed (the blocking path waits for that) or the
    /// engine refuses; a view already gone answers ESHUTDOWN at once.
    fn nowait<T: 'static, R>(
        &self,
        kind: Kind,
        op: Op,
        what: &'static str,
        bytes: u64,
        done: Done<T, Errno>,
        start: impl FnOnce(Done<T, EngineError>) -> Result<(), R>,
    ) -> Result<(), Done<T, Errno>> {
        let Some(alive) = RwLock::try_read_arc(&self.gate.alive) else { return Err(done) };
        if !*alive {
            drop(alive);
            done(Err(Errno::Shutdown));
            return Ok(());
        }
        let finish = Finish {
            _alive: alive,
            io: self.io.clone(),
            node_io: self.node_io.clone(),
            id: self.id,
            kind,
            op,
            what,
            bytes,
            started: Instant::now(),
        };
        // The callback is reachable until the engine takes the request, so a refusal hands it back.
        let slot = Arc::new(Mutex::new(Some(done)));
        let slot_in = slot.clone();
        let complete: Done<T, EngineError> = Box::new(move |result| {
            let result = finish.finish(result);
            if let Some(done) = slot_in.lock().take() {
                done(result);
            }
        });
        match start(complete) {
            Ok(()) => Ok(()),
            Err(refused) => {
                drop(refused);
                Err(slot.lock().take().unwrap_or_else(|| Box::new(|_| {})))
            }
        }
    }

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
        self.read_only
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

    /// Reads the engine can answer from its device's completion (blocks on the fast tier)
    /// take no blocking thread; the reply is sent from the completion.
    fn read_nowait(&self, offset: u64, len: u32, done: ReadDone) -> Result<(), ReadDone> {
        self.nowait(Kind::Read, Op::Read, "read", len.into(), done, |complete| {
            self.group.read_async(self.id, offset, len as usize, complete)
        })
    }

    /// Whole-block writes go to the engine without a blocking thread; the reply is sent from
    /// the engine's completion. The view stays alive (forced changes wait) until it completes.
    fn write_nowait(&self, offset: u64, data: &[u8], _fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        if self.read_only {
            return Err(done);
        }
        self.nowait(Kind::Write, Op::Write, "write", data.len() as u64, done, |complete| {
            self.group.write_async(self.id, offset, data, complete)
        })
    }

    fn write_nowait_alone(&self, offset: u64, data: &[u8], _fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        if self.read_only {
            return Err(done);
        }
        self.nowait(Kind::Write, Op::Write, "write", data.len() as u64, done, |complete| {
            self.group.write_async_alone(self.id, offset, data, complete)
        })
    }

    /// Every replied write is already durable, so a flush only reports a failed group: it
    /// never waits, unless the view is being changed under its clients.
    fn flush_nowait(&self) -> Option<Result<(), Errno>> {
        let alive = self.gate.alive.try_read()?;
        let started = Instant::now();
        let result = if *alive { self.group.flush().map_err(|e| errno_for(Op::Write, &e)) } else { Err(Errno::Shutdown) };
        let latency = started.elapsed();
        self.io.record(Kind::Flush, 0, latency, result.is_ok());
        self.node_io.record(Kind::Flush, 0, latency, result.is_ok());
        Some(result)
    }

    fn flush(&self) -> Result<(), Errno> {
        self.timed(Kind::Flush, 0, || {
            self.guarded(Op::Write, "flush", || self.group.flush())
        })
    }

    /// The engine replies to a trim or write-zeroes only once its record is durable.
    fn replies_are_durable(&self) -> bool {
        true
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

    /// A request the server refused (or whose call panicked) is one the client saw fail:
    /// counted like a failure of its kind, in this view's figures (a snapshot's are its own)
    /// and the node's.
    fn refused(&self, command: u16, _errno: Errno) {
        let kind = refused_kind(command);
        self.io.record_refused(kind);
        self.node_io.record_refused(kind);
    }
}

/// The figures' kind of an NBD command; None for those they have no count of (cache, block
/// status, unknown commands: only their errors are counted).
fn refused_kind(command: u16) -> Option<Kind> {
    match command {
        cmd::READ => Some(Kind::Read),
        cmd::WRITE => Some(Kind::Write),
        cmd::TRIM | cmd::WRITE_ZEROES => Some(Kind::Unmap),
        cmd::FLUSH => Some(Kind::Flush),
        _ => None,
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
#[path = "adapter_tests.rs"]
mod tests;
