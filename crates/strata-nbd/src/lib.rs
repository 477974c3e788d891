//! NBD server for Strata. It knows nothing of the engine: the daemon hands it a [`Backend`].
//!
//! Contract with the daemon (keep these signatures):
//! - `Backend::open` is called once per connection after option negotiation picked an export;
//!   the returned handle is dropped when the connection ends (the daemon counts open handles).
//!   NBD_OPT_INFO also opens the export to learn its size; that handle is kept for a following
//!   NBD_OPT_GO of the same name, or dropped when the client picks another export.
//! - `Export` methods block; the server calls them off the async runtime (spawn_blocking).
//! - A write that returned Ok is durable and visible to every connection (the daemon
//!   guarantees this), so the server may advertise NBD_FLAG_CAN_MULTI_CONN.
//!
//! Layout: [`proto`] is the wire format (pure, fuzzed); `server` runs connections over tokio.
//! The protocol as Strata speaks it is described in docs/NBD.md.
use std::sync::Arc;

pub mod proto;
mod server;

pub use server::{serve, ServerConfig};

/// NBD error numbers (values as the protocol defines them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Errno {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

impl Errno {
    /// The value sent in a reply's error field.
    pub fn code(self) -> u32 {
        self as u32
    }
}

#[derive(Debug, Clone)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
}

/// One contiguous run reported by BLOCK_STATUS for `base:allocation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatus {
    pub len: u32,
    /// NBD_STATE_HOLE (1) | NBD_STATE_ZERO (2)
    pub flags: u32,
}

pub trait Backend: Send + Sync + 'static {
    fn list(&self) -> Vec<ExportInfo>;
    /// None: no export of that name (refused with NBD_REP_ERR_UNKNOWN).
    fn open(&self, name: &str) -> Option<Arc<dyn Export>>;
}

/// Called once with the outcome of a write started by [`Export::write_nowait`]; it may run on
/// any thread and must not block.
pub type WriteDone = Box<dyn FnOnce(Result<(), Errno>) + Send + 'static>;

/// Called once with the bytes of a read started by [`Export::read_nowait`] (exactly the
/// length asked for) or its error; it may run on any thread and must not block.
pub type ReadDone = Box<dyn FnOnce(Result<Vec<u8>, Errno>) + Send + 'static>;

pub trait Export: Send + Sync + 'static {
    fn size_bytes(&self) -> u64;
    fn read_only(&self) -> bool;
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno>;
    /// Starts a read without blocking; `done` gets the bytes later. `Err` hands `done` back
    /// untouched when the read cannot start that way, and the server then calls `read` on its
    /// blocking pool. Exports without such a path keep this default.
    fn read_nowait(&self, offset: u64, len: u32, done: ReadDone) -> Result<(), ReadDone> {
        let _ = (offset, len);
        Err(done)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno>;
    /// Starts a write without blocking; `done` gets its outcome later. `Err` hands `done`
    /// back untouched when the write cannot start that way, and the server then calls `write`
    /// on its blocking pool. Exports without such a path keep this default.
    fn write_nowait(&self, offset: u64, data: &[u8], fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        let _ = (offset, data, fua);
        Err(done)
    }
    /// `write_nowait` for a write that is the only request in flight on its connection (a
    /// client at queue depth one): the export may make it on the calling thread, blocking it
    /// for as long as the write takes, and call `done` before returning. The server's reader
    /// reads nothing more from that connection meanwhile, which costs nothing when the client
    /// waits for this reply anyway.
    fn write_nowait_alone(&self, offset: u64, data: &[u8], fua: bool, done: WriteDone) -> Result<(), WriteDone> {
        self.write_nowait(offset, data, fua, done)
    }
    fn flush(&self) -> Result<(), Errno>;
    /// Answers a flush at once when that needs no waiting (an export whose replied writes are
    /// already durable); None sends it to the blocking pool as `flush`.
    fn flush_nowait(&self) -> Option<Result<(), Errno>> {
        None
    }
    /// Whether every trim and write-zeroes is durable once it returns, as every write is
    /// where `write` ignores its FUA: then FUA on them needs nothing more. Otherwise (the
    /// default) the server follows one carrying FUA with a `flush`.
    fn replies_are_durable(&self) -> bool {
        false
    }
    fn trim(&self, offset: u64, len: u64) -> Result<(), Errno>;
    /// `may_trim` is false when the client sent NBD_CMD_FLAG_NO_HOLE.
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), Errno>;
    fn cache(&self, offset: u64, len: u64) -> Result<(), Errno>;
    /// Covers at least the first byte of the range, at most `len` bytes.
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<BlockStatus>, Errno>;
    /// Tells the export of a request the server answered with `errno` without the export's
    /// answer: one the server's own checks refused (out of range, a write to a read-only
    /// export, a flag not valid for the command, an unknown command, a read longer than the
    /// maximum block size), or one whose call panicked. `command` is the request's
    /// [`proto::cmd`] value as sent, unknown ones included. Called before the reply is queued,
    /// on the connection's reader task (on the blocking pool after a panic): it must not
    /// block. An export that counts the requests it answers counts these here; the default
    /// does nothing.
    fn refused(&self, command: u16, errno: Errno) {
        let _ = (command, errno);
    }
}
