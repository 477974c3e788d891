//! `FileDevice`: a regular file or a block device opened with O_DIRECT, driven by io_uring (or,
//! where io_uring is unavailable or not wanted, by blocking system calls on the caller's thread).

use std::fs::{File, Metadata};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::check::{check_io, check_range, io_error};
use crate::stats::Counters;
use crate::uring::{execute_on_caller_ring, execute_together_on_caller_ring, probe, Op};
use crate::uring_async::{AsyncReads, MAX_ASYNC_READ_BYTES};
use crate::{os, AlignedBuf, Device, DeviceError, DeviceStats, ReadDone, BLOCK_SIZE};

/// The smallest device Strata accepts: anything smaller is almost certainly a wrong path or a
/// size given in the wrong unit.
pub const MIN_DEVICE_SIZE_BYTES: u64 = 1 << 20;

/// Which engine carries a [`FileDevice`]'s I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoBackend {
    /// io_uring if the kernel allows it, else threads (with a warning in the log).
    #[default]
    Auto,
    /// io_uring or fail to open.
    IoUring,
    /// Blocking pread/pwrite/fdatasync on the calling thread.
    ThreadPool,
}

/// How [`Device::write_durable_at`] makes a write durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DurableWrite {
    /// The write, then `fdatasync` on the calling thread. On a device without FUA (such as
    /// the virtio disk this was measured on) the kernel finishes an O_DSYNC direct write on a
    /// per-CPU kernel worker, which issues the cache flush; with that CPU busy (the destager
    /// building a stripe), the write's completion waited 3-4 ms while the write itself took
    /// 40-80 µs. Here the flush is issued by the writing thread, which can run on any CPU;
    /// the write is a blocking one on that thread too, on both backends.
    #[default]
    WriteThenSync,
    /// One write with O_DSYNC semantics (`RWF_DSYNC` on the io_uring backend): a single FUA
    /// write on devices that support FUA.
    Dsync,
}

impl DurableWrite {
    /// The name used in configuration: "write-then-sync" or "dsync".
    pub fn name(self) -> &'static str {
        match self {
            DurableWrite::WriteThenSync => "write-then-sync",
            DurableWrite::Dsync => "dsync",
        }
    }
}

/// How to open a device; `OpenOptions::default()` opens an existing path with `Auto`.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// If the path does not exist, create a sparse regular file of this size (rounded down to
    /// 4 KiB). Ignored when the path exists: an existing file is never resized.
    pub create_size_bytes: Option<u64>,
    /// For regular files: allocate every block at open (fallocate) and never punch holes, so
    /// O_DIRECT writes on the hot path (the fast-tier log) do not wait for block allocation.
    /// A file this open creates is also written with zeros once, before it appears under its
    /// name: fallocate leaves unwritten extents, and a synchronous write into one also commits
    /// the file system's journal to record the conversion, which doubles its latency.
    pub preallocate: bool,
    pub backend: IoBackend,
    pub durable_write: DurableWrite,
    /// Set (from any thread) to abandon the creation of a file this open writes with zeros
    /// (`preallocate`), which takes a while for a large file: looked at between 8 MiB
    /// writes; the temporary file is removed and the open fails with
    /// [`DeviceError::Abandoned`].
    pub abandon_creation: Option<Arc<AtomicBool>>,
}

/// Opens (or creates, if `create_size_bytes` is given and the path is missing) a file or block
/// device with O_DIRECT and the default backend.
pub fn open_path(
    path: &Path,
    create_size_bytes: Option<u64>,
) -> Result<Arc<dyn Device>, DeviceError> {
    open_with(
        path,
        &OpenOptions {
            create_size_bytes,
            ..OpenOptions::default()
        },
    )
}

/// Opens a file or block device with O_DIRECT as `options` say.
pub fn open_with(path: &Path, options: &OpenOptions) -> Result<Arc<dyn Device>, DeviceError> {
    Ok(Arc::new(FileDevice::open(path, options)?))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Regular,
    Block,
}

enum Engine {
    Uring,
    Threads,
}

/// A regular file or block device opened with O_DIRECT. See the crate documentation for the
/// contract; discards punch holes in files and issue BLKDISCARD on block devices.
pub struct FileDevice {
    /// The asynchronous read path, started by the first `read_async` (io_uring only).
    reads: OnceLock<Option<AsyncReads>>,
    /// How I/O is issued (io_uring on the caller's thread, or plain system calls).
    engine: Engine,
    /// This process's claim on the file (regular files), given up on drop.
    _here: Option<OpenHere>,
    file: File,
    name: String,
    kind: Kind,
    size_bytes: u64,
    preallocated: bool,
    durable_write: DurableWrite,
    /// The file is in memory (`os::in_memory_fs`): parts of `write_all_durable` are written
    /// one after the other with blocking writes, not through the ring.
    in_memory: bool,
    counters: Arc<Counters>,
}

fn open_error(path: &Path, what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Open(format!("{}: {what}", path.display()))
}

impl FileDevice {
    /// Opens a device; see [`open_with`].
    pub fn open(path: &Path, options: &OpenOptions) -> Result<FileDevice, DeviceError> {
        let metadata = metadata_or_create(path, options)?;
        let kind = kind_of(path, &metadata)?;
        let file = open_direct(path, OpenMode::ReadWrite, kind)?;
        let here = match kind {
            Kind::Regular => {
                let here = OpenHere::claim(path, &file)?;
                lock_file(path, &file)?;
                Some(here)
            }
            Kind::Block => None,
        };
        let size_bytes = usable_size(path, &file, kind, &metadata)?;
        let preallocated = options.preallocate && kind == Kind::Regular;
        let preallocated = preallocated && preallocate(path, &file, size_bytes)?;
        let name = path.display().to_string();
        let engine = start_engine(path, &name, options.backend)?;
        let in_memory = kind == Kind::Regular && os::in_memory_fs(file.as_raw_fd());
        Ok(FileDevice {
            reads: OnceLock::new(),
            engine,
            _here: here,
            file,
            name,
            kind,
            size_bytes,
            preallocated,
            durable_write: options.durable_write,
            in_memory,
            counters: Arc::new(Counters::new()),
        })
    }

    /// "io_uring" or "threads": which engine carries this device's I/O.
    pub fn io_backend_name(&self) -> &'static str {
        match self.engine {
            Engine::Uring => "io_uring",
            Engine::Threads => "threads",
        }
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Counts the outcome of a call and attaches the device name and offset to an error.
    fn finish(
        &self,
        result: io::Result<()>,
        offset: u64,
        on_success: impl FnOnce(&Counters),
    ) -> Result<(), DeviceError> {
        match result {
            Ok(()) => {
                on_success(&self.counters);
                Ok(())
            }
            Err(err) => {
                self.counters.record_failure(&err);
                Err(io_error(&self.name, offset, err))
            }
        }
    }

    fn validate(&self, addr: usize, len: usize, offset: u64) -> Result<(), DeviceError> {
        check_io(&self.name, self.size_bytes, addr, len, offset)
            .inspect_err(|_| self.counters.record_error())
    }

    /// A write that blocks the calling thread (pwrite), whatever the backend.
    fn write_blocking(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.validate(buf.as_ptr() as usize, buf.len(), offset)?;
        let result = os::pwrite_full(self.fd(), buf, offset);
        self.finish(result, offset, |c| c.record_write(buf.len() as u64))
    }

    fn discard_range(&self, offset: u64, len: u64) -> io::Result<bool> {
        if self.preallocated {
            return Ok(false);
        }
        let result = match self.kind {
            Kind::Regular => os::punch_hole(self.fd(), offset, len),
            Kind::Block => os::blk_discard(self.fd(), offset, len),
        };
        match result {
            Ok(()) => Ok(true),
            Err(err) if os::is_unsupported(&err) => Ok(false),
            Err(err) => Err(err),
        }
    }
}

/// Allocates the whole file; false where the file system cannot (the device still works, its
/// first writes just allocate).
fn preallocate(path: &Path, file: &File, size_bytes: u64) -> Result<bool, DeviceError> {
    match os::preallocate(file.as_raw_fd(), size_bytes) {
        Ok(()) => Ok(true),
        Err(err) if os::is_unsupported(&err) => {
            tracing::warn!(path = %path.display(), "file system cannot preallocate; continuing without");
            Ok(false)
        }
        Err(err) => Err(open_error(path, format_args!("cannot preallocate: {err}"))),
    }
}

/// Stats the path, creating the file first if it is missing and a size was given: sparse, or
/// with `preallocate` every block written with zeros.
fn metadata_or_create(path: &Path, options: &OpenOptions) -> Result<Metadata, DeviceError> {
    match std::fs::metadata(path) {
        Ok(metadata) => Ok(metadata),
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            let Some(size) = options.create_size_bytes else {
                return Err(open_error(
                    path,
                    "does not exist, and no size was given to create it",
                ));
            };
            if options.preallocate {
                create_written(path, size, options.abandon_creation.as_deref())?;
            } else {
                create_sparse(path, size)?;
            }
            std::fs::metadata(path).map_err(|e| open_error(path, e))
        }
        Err(err) => Err(open_error(path, err)),
    }
}

fn create_sparse(path: &Path, size_bytes: u64) -> Result<(), DeviceError> {
    let size_bytes = block_rounded_size(path, size_bytes)?;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| open_error(path, format_args!("cannot create: {e}")))?;
    mark_in_place(&file, path);
    file.set_len(size_bytes).map_err(|e| {
        let _ = std::fs::remove_file(path);
        open_error(path, format_args!("cannot size to {size_bytes} bytes: {e}"))
    })
}

/// `raw` bytes rounded down to whole blocks, if that is at least the minimum device size.
fn block_rounded_size(path: &Path, raw: u64) -> Result<u64, DeviceError> {
    let size_bytes = raw - raw % BLOCK_SIZE as u64;
    if raw == 0 {
        return Err(open_error(
            path,
            format_args!(
                "size 0 bytes: an empty file, or a block device with nothing behind it (a loop \
                 device with no file attached, a drive with no medium)"
            ),
        ));
    }
    if size_bytes < MIN_DEVICE_SIZE_BYTES {
        return Err(open_error(
            path,
            format_args!("size {raw} bytes is below the 1 MiB minimum"),
        ));
    }
    Ok(size_bytes)
}

/// Creates a file whose every block is allocated and written with zeros. It is built under a
/// temporary name and renamed into place once durable, so a start interrupted half way leaves
/// no half-written device behind (the next start builds it again). The temporary file is
/// locked while it is built, so a second start at the same moment refuses instead of
/// truncating the first one's file, and the rename never replaces a file already there.
/// Setting `abandon` stops the build and removes the temporary file.
fn create_written(
    path: &Path,
    size_bytes: u64,
    abandon: Option<&AtomicBool>,
) -> Result<(), DeviceError> {
    let size_bytes = block_rounded_size(path, size_bytes)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".creating");
    let tmp = Path::new(&tmp);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(tmp)
        .map_err(|e| creating_error(path, &e))?;
    let another = || {
        open_error(
            path,
            format_args!(
                "is being created by another start of Strata ({} is locked)",
                tmp.display()
            ),
        )
    };
    if os::lock_exclusive(file.as_raw_fd()).is_err() {
        return Err(another());
    }
    // The lock is ours, but the file may be one another start finished and renamed into place
    // between our open and our lock: build only under the temporary name.
    if !same_file(&file, tmp) {
        return Err(another());
    }
    let built = build_written(&file, tmp, path, size_bytes, abandon);
    if let Ok(Built::Done) = built {
        return Ok(());
    }
    let _ = std::fs::remove_file(tmp);
    Err(match built {
        Err(e) => creating_error(path, &e),
        Ok(_) => DeviceError::Abandoned(path.display().to_string()),
    })
}

/// On btrfs, marks a new device file, still empty, to be overwritten in place (`chattr +C`,
/// as qemu-img's `nocow` option does for disk images). A copy-on-write file takes new space for
/// every overwrite: once its file system is full, a write to the fast tier's log fails and the
/// disk group goes offline, though the file has all its blocks. (No_COW also turns off btrfs's
/// own checksums and compression for the file; Strata checksums its blocks itself.)
fn mark_in_place(file: &File, path: &Path) {
    let fd = file.as_raw_fd();
    if !matches!(os::copy_on_write_fs(fd), Ok(Some("btrfs"))) {
        return;
    }
    if let Err(e) = os::set_no_cow(fd) {
        tracing::warn!(path = %path.display(), "could not mark the new device file No_COW (chattr +C): {e}");
    }
}

/// The copy-on-write file system (by name) under the regular file at `path` when its
/// overwrites take new space: btrfs unless the file is marked No_COW (`chattr +C`), ZFS and
/// bcachefs always. None for a block device, any other file system, or what cannot be told.
pub fn copy_on_write_file(path: &Path) -> Option<&'static str> {
    let file = open_regular(path)?;
    let fd = file.as_raw_fd();
    match os::copy_on_write_fs(fd).ok()?? {
        "btrfs" if os::is_no_cow(fd).unwrap_or(false) => None,
        fs => Some(fs),
    }
}

/// The regular file at `path`, opened to be looked at; None for anything else.
fn open_regular(path: &Path) -> Option<File> {
    File::open(path)
        .ok()
        .filter(|f| f.metadata().is_ok_and(|m| m.is_file()))
}

/// Bytes of the regular file at `path` whose blocks it shares with another file or a file
/// system snapshot (a reflinked copy, `cp --reflink`; a btrfs snapshot): the first overwrite of
/// each takes new space, as on a copy-on-write file. None for a block device, or when the file
/// system cannot tell (no FIEMAP).
pub fn shared_bytes_of(path: &Path) -> Option<u64> {
    let file = open_regular(path)?;
    let len = file.metadata().ok()?.len();
    os::shared_bytes(file.as_raw_fd(), len).ok()
}

enum Built {
    Done,
    Abandoned,
}

fn creating_error(path: &Path, e: &io::Error) -> DeviceError {
    match e.raw_os_error() {
        Some(libc::EINVAL) => open_error(
            path,
            "the file system does not support O_DIRECT, which Strata requires",
        ),
        Some(libc::EEXIST) => open_error(
            path,
            "cannot create: it exists now (another program created it meanwhile)",
        ),
        _ => open_error(path, format_args!("cannot create: {e}")),
    }
}

/// Whether `path` names the open `file` (same device and inode).
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Writes zeros over the whole locked temporary file, makes it durable and renames it to
/// `path`, refusing to replace a file there; or stops once `abandon` is set.
fn build_written(
    file: &File,
    tmp: &Path,
    path: &Path,
    size_bytes: u64,
    abandon: Option<&AtomicBool>,
) -> io::Result<Built> {
    const CHUNK: u64 = 8 << 20;
    // A leftover of an interrupted start is built over from scratch.
    file.set_len(0)?;
    mark_in_place(file, path);
    file.set_len(size_bytes)?;
    if let Err(err) = os::preallocate(file.as_raw_fd(), size_bytes) {
        if !os::is_unsupported(&err) {
            return Err(err);
        }
    }
    let zeros = AlignedBuf::new_zeroed(CHUNK.min(size_bytes) as usize);
    let mut at = 0;
    while at < size_bytes {
        if abandon.is_some_and(|a| a.load(Ordering::Relaxed)) {
            return Ok(Built::Abandoned);
        }
        let n = (size_bytes - at).min(CHUNK) as usize;
        std::os::unix::fs::FileExt::write_all_at(file, &zeros[..n], at)?;
        at += n as u64;
    }
    file.sync_all()?;
    os::rename_no_replace(tmp, path)?;
    // The new name is durable once the directory is.
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    File::open(dir.unwrap_or(Path::new(".")))?.sync_all()?;
    Ok(Built::Done)
}

fn kind_of(path: &Path, metadata: &Metadata) -> Result<Kind, DeviceError> {
    let file_type = metadata.file_type();
    if file_type.is_file() {
        Ok(Kind::Regular)
    } else if file_type.is_block_device() {
        Ok(Kind::Block)
    } else if file_type.is_dir() {
        Err(open_error(
            path,
            "is a directory, not a file or block device",
        ))
    } else {
        Err(open_error(
            path,
            "is neither a regular file nor a block device",
        ))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpenMode {
    ReadOnly,
    ReadWrite,
}

/// Opens an existing file or block device with O_DIRECT and returns it with its usable size,
/// applying the same checks as [`FileDevice::open`]; for tools that drive the descriptor
/// themselves (the raw benchmark).
pub(crate) fn open_raw(path: &Path, mode: OpenMode) -> Result<(File, u64), DeviceError> {
    let metadata = std::fs::metadata(path).map_err(|e| open_error(path, e))?;
    let kind = kind_of(path, &metadata)?;
    let file = open_direct(path, mode, kind)?;
    let size_bytes = usable_size(path, &file, kind, &metadata)?;
    Ok((file, size_bytes))
}

/// Opens with O_DIRECT; block devices also with O_EXCL, which Linux turns into "fail if the
/// device is mounted or claimed by another exclusive opener", so Strata never writes over a
/// live file system.
fn open_direct(path: &Path, mode: OpenMode, kind: Kind) -> Result<File, DeviceError> {
    let exclusive = if kind == Kind::Block { libc::O_EXCL } else { 0 };
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(mode == OpenMode::ReadWrite)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC | exclusive)
        .open(path);
    opened.map_err(|err| match err.raw_os_error() {
        Some(libc::EBUSY) => open_error(
            path,
            "is in use (mounted, or opened exclusively by another program, such as a strata serve \
             already running on it)",
        ),
        Some(libc::EINVAL) => open_error(
            path,
            "the file system does not support O_DIRECT, which Strata requires",
        ),
        _ => open_error(path, format_args!("cannot open with O_DIRECT: {err}")),
    })
}

/// Regular files open as devices in this process, by (device, inode): one file named twice
/// (under two paths, through a symlink) is refused at once, without waiting for its lock.
static OPEN_HERE: std::sync::Mutex<std::collections::BTreeSet<(u64, u64)>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

struct OpenHere((u64, u64));

impl OpenHere {
    fn claim(path: &Path, file: &File) -> Result<OpenHere, DeviceError> {
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata().map_err(|e| open_error(path, e))?;
        let key = (meta.dev(), meta.ino());
        let mut open = OPEN_HERE.lock().unwrap_or_else(|e| e.into_inner());
        if !open.insert(key) {
            return Err(open_error(
                path,
                "is in use: it is already open as another device (the same file under two names?)",
            ));
        }
        Ok(OpenHere(key))
    }
}

impl Drop for OpenHere {
    fn drop(&mut self) {
        OPEN_HERE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.0);
    }
}

/// How long opening waits for a file another opener holds. A process killed with I/O in
/// flight keeps its files open a little past its death: the kernel drops an io_uring's file
/// references only once the ring's requests are done, after the process is gone.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Locks a regular file for this device alone, the way O_EXCL does for a block device: a
/// second daemon on the same files, or one file given twice (under two names), is refused
/// instead of two writers corrupting each other.
fn lock_file(path: &Path, file: &File) -> Result<(), DeviceError> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    let mut said = false;
    loop {
        match os::lock_exclusive(file.as_raw_fd()) {
            Ok(()) => return Ok(()),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() >= deadline {
                    return Err(open_error(
                        path,
                        "is in use: another Strata device (in this or another process) has it open",
                    ));
                }
                if !said {
                    tracing::info!(path = %path.display(), "device file in use; waiting up to 5 s for it to be released");
                    said = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(err) => return Err(open_error(path, format_args!("cannot lock: {err}"))),
        }
    }
}

/// The size Strata may use: the file length or device size, rounded down to 4 KiB.
fn usable_size(
    path: &Path,
    file: &File,
    kind: Kind,
    metadata: &Metadata,
) -> Result<u64, DeviceError> {
    let raw = match kind {
        Kind::Regular => metadata.len(),
        Kind::Block => os::blk_size_bytes(file.as_raw_fd())
            .map_err(|e| open_error(path, format_args!("BLKGETSIZE64: {e}")))?,
    };
    block_rounded_size(path, raw)
}

fn start_engine(path: &Path, name: &str, backend: IoBackend) -> Result<Engine, DeviceError> {
    if backend == IoBackend::ThreadPool {
        return Ok(Engine::Threads);
    }
    match probe() {
        Ok(()) => Ok(Engine::Uring),
        Err(err) if backend == IoBackend::Auto => {
            tracing::warn!(device = name, error = %err, "io_uring unavailable; using blocking threads");
            Ok(Engine::Threads)
        }
        Err(err) => Err(open_error(
            path,
            format_args!("io_uring setup failed: {err}"),
        )),
    }
}

impl Device for FileDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.validate(buf.as_ptr() as usize, buf.len(), offset)?;
        let len = buf.len();
        let result = match &self.engine {
            _ if len == 0 => Ok(()),
            // SAFETY: `buf` is borrowed mutably for the whole call, which blocks until done.
            Engine::Uring => unsafe {
                execute_on_caller_ring(
                    self.fd(),
                    Op::Read {
                        buf: buf.as_mut_ptr(),
                        len,
                        offset,
                    },
                )
            },
            Engine::Threads => os::pread_full(self.fd(), buf, offset),
        };
        self.finish(result, offset, |c| c.record_read(len as u64))
    }

    /// Through the device's shared ring and completion thread (see `uring_async`); the
    /// threads backend has no such path and hands every read back.
    fn read_async(&self, buf: AlignedBuf, offset: u64, done: ReadDone) -> Result<(), (AlignedBuf, ReadDone)> {
        if !matches!(self.engine, Engine::Uring) || buf.len() > MAX_ASYNC_READ_BYTES {
            return Err((buf, done));
        }
        if check_io(&self.name, self.size_bytes, buf.as_ptr() as usize, buf.len(), offset).is_err() {
            return Err((buf, done));
        }
        let reads = self.reads.get_or_init(|| {
            AsyncReads::start(&self.file, &self.name, self.counters.clone())
                .inspect_err(|e| tracing::warn!(device = %self.name, error = %e, "no asynchronous reads: io_uring setup failed"))
                .ok()
        });
        match reads {
            Some(reads) => reads.read(buf, offset, done),
            None => Err((buf, done)),
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        if !matches!(self.engine, Engine::Uring) {
            return self.write_blocking(buf, offset);
        }
        self.validate(buf.as_ptr() as usize, buf.len(), offset)?;
        let len = buf.len();
        let result = match len {
            0 => Ok(()),
            // SAFETY: `buf` is borrowed for the whole call, which blocks until done.
            _ => unsafe {
                execute_on_caller_ring(
                    self.fd(),
                    Op::Write {
                        buf: buf.as_ptr(),
                        len,
                        offset,
                    },
                )
            },
        };
        self.finish(result, offset, |c| c.record_write(len as u64))
    }

    /// The write, then fdatasync, both blocking on the calling thread, on both backends; or,
    /// in `dsync` mode on io_uring, one O_DSYNC write through the ring (one round trip less).
    /// Counted as a write and a flush either way.
    ///
    /// The write-then-sync write does not go through the ring: the caller waits for it anyway,
    /// and a blocking direct write is completed from the device's interrupt, while io_uring's
    /// asynchronous one (on ext4 at least) is completed through the filesystem's direct-I/O
    /// workqueue: a kernel worker's wake-up, then this thread's, which on a 2-vCPU VM added
    /// ~15 µs to a ~150 µs queue-depth-1 write (docs/BENCHMARKS.md). Nor the ring's fsync:
    /// io_uring runs a blocking fsync on a worker of its own.
    fn write_durable_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        let dsync = matches!(self.engine, Engine::Uring)
            && self.durable_write == DurableWrite::Dsync
            && !buf.is_empty();
        if !dsync {
            self.write_blocking(buf, offset)?;
            let result = os::fdatasync(self.fd());
            return self.finish(result, 0, Counters::record_flush);
        }
        self.validate(buf.as_ptr() as usize, buf.len(), offset)?;
        let len = buf.len();
        let op = Op::WriteDsync { buf: buf.as_ptr(), len, offset };
        // SAFETY: `buf` is borrowed for the whole call, which blocks until done.
        let result = unsafe { execute_on_caller_ring(self.fd(), op) };
        self.finish(result, offset, |c| {
            c.record_write(len as u64);
            c.record_flush();
        })
    }

    /// Every part but the first goes through the caller's ring in one submission, the first is
    /// a blocking write made meanwhile, so all are at the device at once; then fdatasync on
    /// the calling thread. In `dsync` mode all parts are O_DSYNC writes through the ring. On
    /// the threads backend, and for a file in memory, blocking writes one after the other, then
    /// fdatasync. Counted as the writes and a flush.
    fn write_all_durable(&self, parts: &[(&[u8], u64)]) -> Result<(), DeviceError> {
        if parts.len() < 2 || !matches!(self.engine, Engine::Uring) || self.in_memory {
            if let [(buf, offset)] = parts {
                return self.write_durable_at(buf, *offset);
            }
            for (buf, offset) in parts {
                self.write_blocking(buf, *offset)?;
            }
            let result = os::fdatasync(self.fd());
            return self.finish(result, 0, Counters::record_flush);
        }
        // Without dsync, every part but the first goes through the ring and the first is a
        // blocking write made meanwhile, which the device's interrupt completes on this thread
        // (see `write_durable_at` on why that is the cheaper completion). With dsync, every
        // part is an O_DSYNC write through the ring, durable when it completes.
        let dsync = self.durable_write == DurableWrite::Dsync;
        let mut ops = Vec::with_capacity(parts.len());
        for (buf, offset) in parts {
            self.validate(buf.as_ptr() as usize, buf.len(), *offset)?;
            let (buf, len, offset) = (buf.as_ptr(), buf.len(), *offset);
            ops.push(match dsync {
                true => Op::WriteDsync { buf, len, offset },
                false => Op::Write { buf, len, offset },
            });
        }
        let (first, first_at) = parts[0];
        // SAFETY: every buffer is borrowed for the whole call, which blocks until all are done.
        let result = unsafe {
            match dsync {
                true => execute_together_on_caller_ring(self.fd(), &ops, || Ok(())),
                false => execute_together_on_caller_ring(self.fd(), &ops[1..], || {
                    os::pwrite_full(self.fd(), first, first_at)
                }),
            }
        };
        self.finish(result, first_at, |c| {
            for (b, _) in parts {
                c.record_write(b.len() as u64);
            }
            if dsync {
                c.record_flush();
            }
        })?;
        if dsync {
            return Ok(());
        }
        let result = os::fdatasync(self.fd());
        self.finish(result, 0, Counters::record_flush)
    }

    fn flush(&self) -> Result<(), DeviceError> {
        let result = match &self.engine {
            // SAFETY: an fsync names no buffer.
            Engine::Uring => unsafe { execute_on_caller_ring(self.fd(), Op::Fsync) },
            Engine::Threads => os::fdatasync(self.fd()),
        };
        self.finish(result, 0, Counters::record_flush)
    }

    /// Runs on the caller's thread for both backends (io_uring has no BLKDISCARD); a discard is
    /// rare and off the hot path. Unsupported discards, and any discard on a preallocated file
    /// (punching holes would undo the preallocation), count as `discard_unsupported_ops`.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(&self.name, self.size_bytes, offset, len)
            .inspect_err(|_| self.counters.record_error())?;
        match self.discard_range(offset, len) {
            Ok(true) => self.finish(Ok(()), offset, |c| c.record_discard(len)),
            Ok(false) => self.finish(Ok(()), offset, Counters::record_discard_unsupported),
            Err(err) => self.finish(Err(err), offset, |_| {}),
        }
    }

    /// A regular file that was not preallocated: a discard punches a hole.
    fn discard_is_cheap(&self) -> bool {
        self.kind == Kind::Regular && !self.preallocated
    }

    fn stats(&self) -> DeviceStats {
        self.counters.snapshot(&self.name, self.size_bytes)
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn io_backend_name(&self) -> &'static str {
        FileDevice::io_backend_name(self)
    }
}

#[cfg(test)]
#[path = "file_tests.rs"]
mod tests;
