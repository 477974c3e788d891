//! In-memory Backend for the server tests: a Vec<u8> per export, an allocation map for
//! block status, a log of calls, a gate that holds reads at one offset (to control
//! completion order), an offset whose reads fail with EIO (a checksum failure), one whose
//! reads panic, and the requests the server said it refused on its own. With
//! `elsewhere` set, reads and writes take the non-blocking path and complete on a thread of
//! their own, as the engine's do.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::proto::state;
use crate::{Backend, BlockStatus, Errno, Export, ExportInfo, ReadDone, WriteDone};

pub const DISK_SIZE: u64 = 4 << 20;
pub const RO_SIZE: u64 = 1 << 20;
/// Reads at this offset wait for the gate.
pub const GATE_OFFSET: u64 = 1 << 20;
/// Reads at this offset fail with EIO.
pub const EIO_OFFSET: u64 = 2 << 20;
/// Reads at this offset panic (a bug in the export).
pub const PANIC_OFFSET: u64 = EIO_OFFSET + 8192;
/// Granularity of the allocation map.
pub const BLOCK: u64 = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Write {
        offset: u64,
        len: usize,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
        may_trim: bool,
    },
    Cache {
        offset: u64,
        len: u64,
    },
}

#[derive(Default)]
pub struct Gate {
    state: Mutex<(bool, usize)>,
    cv: Condvar,
}

impl Gate {
    fn pass(&self) {
        let mut s = self.state.lock().unwrap();
        s.1 += 1;
        while !s.0 {
            s = self.cv.wait(s).unwrap();
        }
        s.1 -= 1;
    }

    pub fn open(&self) {
        self.state.lock().unwrap().0 = true;
        self.cv.notify_all();
    }

    /// Requests currently held at the gate.
    pub fn waiting(&self) -> usize {
        self.state.lock().unwrap().1
    }
}

pub struct MemExport {
    data: Mutex<Vec<u8>>,
    allocated: Mutex<Vec<bool>>,
    read_only: bool,
    pub gate: Gate,
    pub log: Mutex<Vec<Op>>,
    /// Reads and writes complete on another thread (`read_nowait`, `write_nowait`), and
    /// lone writes on the reader's (`write_nowait_alone`).
    pub elsewhere: AtomicBool,
    /// Writes the server offered as the only request in flight on their connection.
    pub alone_writes: AtomicUsize,
    /// Trims and write-zeroes are durable once done (`Export::replies_are_durable`).
    pub durable_replies: AtomicBool,
    /// (command, errno) of each request the server answered without the export
    /// (`Export::refused`), in the order it said so.
    pub refusals: Mutex<Vec<(u16, Errno)>>,
}

impl MemExport {
    fn new(size: u64, read_only: bool, fill: u8) -> Self {
        MemExport {
            data: Mutex::new(vec![fill; size as usize]),
            allocated: Mutex::new(vec![fill != 0; (size / BLOCK) as usize]),
            read_only,
            gate: Gate::default(),
            log: Mutex::new(Vec::new()),
            elsewhere: AtomicBool::new(false),
            alone_writes: AtomicUsize::new(0),
            durable_replies: AtomicBool::new(false),
            refusals: Mutex::new(Vec::new()),
        }
    }

    pub fn ops(&self) -> Vec<Op> {
        self.log.lock().unwrap().clone()
    }

    pub fn refusals(&self) -> Vec<(u16, Errno)> {
        self.refusals.lock().unwrap().clone()
    }

    pub fn bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        self.data.lock().unwrap()[offset as usize..offset as usize + len].to_vec()
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, Errno> {
        let end = offset.checked_add(len).ok_or(Errno::Inval)?;
        if end > self.size_bytes() {
            return Err(Errno::Inval);
        }
        Ok(offset as usize..end as usize)
    }

    fn mark(&self, offset: u64, len: u64, allocated: bool) {
        let mut map = self.allocated.lock().unwrap();
        for block in offset / BLOCK..(offset + len).div_ceil(BLOCK) {
            map[block as usize] = allocated;
        }
    }

    fn zero(&self, offset: u64, len: u64) -> Result<(), Errno> {
        let range = self.range(offset, len)?;
        self.data.lock().unwrap()[range].fill(0);
        Ok(())
    }
}

impl Export for MemExport {
    fn size_bytes(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        if offset == GATE_OFFSET {
            self.gate.pass();
        }
        if offset == EIO_OFFSET {
            return Err(Errno::Io);
        }
        if offset == PANIC_OFFSET {
            panic!("a read at PANIC_OFFSET (test)");
        }
        let range = self.range(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.data.lock().unwrap()[range]);
        Ok(())
    }

    fn read_nowait(&self, offset: u64, len: u32, done: ReadDone) -> Result<(), ReadDone> {
        if !self.elsewhere.load(Ordering::Relaxed) || offset == GATE_OFFSET {
            return Err(done);
        }
        let mut buf = vec![0u8; len as usize];
        let result = self.read(offset, &mut buf).map(|()| buf);
        std::thread::spawn(move || done(result));
        Ok(())
    }

    fn write_nowait(&self, offset: u64, data: &[u8], fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        if !self.elsewhere.load(Ordering::Relaxed) {
            return Err(done);
        }
        let result = self.write(offset, data, fua);
        std::thread::spawn(move || done(result));
        Ok(())
    }

    fn write_nowait_alone(&self, offset: u64, data: &[u8], fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        if !self.elsewhere.load(Ordering::Relaxed) {
            return Err(done);
        }
        self.alone_writes.fetch_add(1, Ordering::Relaxed);
        done(self.write(offset, data, fua));
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        let range = self.range(offset, data.len() as u64)?;
        self.data.lock().unwrap()[range].copy_from_slice(data);
        self.mark(offset, data.len() as u64, true);
        self.log.lock().unwrap().push(Op::Write {
            offset,
            len: data.len(),
            fua,
        });
        Ok(())
    }

    fn flush(&self) -> Result<(), Errno> {
        self.log.lock().unwrap().push(Op::Flush);
        Ok(())
    }

    fn replies_are_durable(&self) -> bool {
        self.durable_replies.load(Ordering::Relaxed)
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.zero(offset, len)?;
        self.mark(offset, len, false);
        self.log.lock().unwrap().push(Op::Trim { offset, len });
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), Errno> {
        self.zero(offset, len)?;
        self.mark(offset, len, !may_trim);
        self.log.lock().unwrap().push(Op::WriteZeroes {
            offset,
            len,
            may_trim,
        });
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.log.lock().unwrap().push(Op::Cache { offset, len });
        Ok(())
    }

    /// Reports whole runs of the allocation map, deliberately running past `len` so the
    /// server's clipping is exercised.
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<BlockStatus>, Errno> {
        self.range(offset, len)?;
        let map = self.allocated.lock().unwrap();
        let mut out: Vec<BlockStatus> = Vec::new();
        let mut pos = offset;
        while pos < offset + len {
            let block = (pos / BLOCK) as usize;
            let mut end = (block as u64 + 1) * BLOCK;
            while end < self.size_bytes() && map[(end / BLOCK) as usize] == map[block] {
                end += BLOCK;
            }
            let flags = if map[block] {
                0
            } else {
                state::HOLE | state::ZERO
            };
            out.push(BlockStatus {
                len: (end - pos) as u32,
                flags,
            });
            pos = end;
        }
        Ok(out)
    }

    fn refused(&self, command: u16, errno: Errno) {
        self.refusals.lock().unwrap().push((command, errno));
    }
}

/// Counts open handles the way the daemon does: +1 on open, -1 on drop.
struct Handle {
    inner: Arc<MemExport>,
    open: Arc<AtomicUsize>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Export for Handle {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.inner.read(offset, buf)
    }
    fn read_nowait(&self, offset: u64, len: u32, done: ReadDone) -> Result<(), ReadDone> {
        self.inner.read_nowait(offset, len, done)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        self.inner.write(offset, data, fua)
    }
    fn write_nowait(&self, offset: u64, data: &[u8], fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        self.inner.write_nowait(offset, data, fua, done)
    }
    fn write_nowait_alone(&self, offset: u64, data: &[u8], fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        self.inner.write_nowait_alone(offset, data, fua, done)
    }
    fn flush(&self) -> Result<(), Errno> {
        self.inner.flush()
    }
    fn replies_are_durable(&self) -> bool {
        self.inner.replies_are_durable()
    }
    fn trim(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.inner.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), Errno> {
        self.inner.write_zeroes(offset, len, may_trim)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.inner.cache(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<BlockStatus>, Errno> {
        self.inner.block_status(offset, len)
    }
    fn refused(&self, command: u16, errno: Errno) {
        self.inner.refused(command, errno)
    }
}

/// Two exports: "disk" (read-write, zero-filled) and "ro" (read-only, filled with 0xa5).
pub struct MemBackend {
    pub disk: Arc<MemExport>,
    pub ro: Arc<MemExport>,
    pub open_handles: Arc<AtomicUsize>,
}

impl MemBackend {
    pub fn new() -> Self {
        MemBackend {
            disk: Arc::new(MemExport::new(DISK_SIZE, false, 0)),
            ro: Arc::new(MemExport::new(RO_SIZE, true, 0xa5)),
            open_handles: Arc::new(AtomicUsize::new(0)),
        }
    }

    pub fn open_count(&self) -> usize {
        self.open_handles.load(Ordering::SeqCst)
    }
}

impl Backend for MemBackend {
    fn list(&self) -> Vec<ExportInfo> {
        vec![
            ExportInfo {
                name: "disk".into(),
                description: "test disk".into(),
            },
            ExportInfo {
                name: "ro".into(),
                description: "read-only disk".into(),
            },
        ]
    }

    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        let inner = match name {
            "disk" => self.disk.clone(),
            "ro" => self.ro.clone(),
            _ => return None,
        };
        self.open_handles.fetch_add(1, Ordering::SeqCst);
        Some(Arc::new(Handle {
            inner,
            open: self.open_handles.clone(),
        }))
    }
}
