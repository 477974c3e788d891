//! Thin, retrying wrappers over the Linux system calls the file device needs. They are also the
//! "threads" backend: callers are already threads, so a blocking pread on the caller's thread is
//! the thread pool.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// `_IOR(0x12, 114, size_t)`: size of a block device in bytes. Generic Linux ioctl encoding
/// (x86_64, aarch64, riscv64); libc does not export it.
const BLKGETSIZE64: libc::Ioctl = 0x8008_1272;
/// `_IO(0x12, 119)`: discard a byte range `[start, len]` of a block device.
const BLKDISCARD: libc::Ioctl = 0x1277;

/// Retries for one system call. EINTR and EAGAIN are transient, but a call that keeps failing
/// with them is a stuck device, and the caller should hear about it rather than spin forever.
const MAX_RETRIES: u32 = 64;
/// Back-off before retrying EAGAIN, so a congested device is not hammered in a tight loop.
const EAGAIN_BACKOFF: Duration = Duration::from_micros(100);

/// True for the errors a caller should retry: interrupted or temporarily out of resources.
pub(crate) fn is_transient(errno: i32) -> bool {
    errno == libc::EINTR || errno == libc::EAGAIN
}

/// Runs `call` (a system call returning -1 and setting errno on failure) until it succeeds or
/// fails with a non-transient error, at most [`MAX_RETRIES`] times.
fn retrying(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    let mut attempts = 0;
    loop {
        let result = call();
        if result >= 0 {
            return Ok(result as usize);
        }
        let err = io::Error::last_os_error();
        let errno = err.raw_os_error().unwrap_or(0);
        attempts += 1;
        if !is_transient(errno) || attempts >= MAX_RETRIES {
            return Err(err);
        }
        if errno == libc::EAGAIN {
            std::thread::sleep(EAGAIN_BACKOFF);
        }
    }
}

fn to_off_t(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset beyond off_t"))
}

/// Reads exactly `buf.len()` bytes at `offset`, resuming after short reads.
pub(crate) fn pread_full(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        let at = to_off_t(offset + done as u64)?;
        // SAFETY: `rest` is a valid, writable region of `rest.len()` bytes.
        let n = retrying(|| unsafe { libc::pread(fd, rest.as_mut_ptr().cast(), rest.len(), at) })?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read beyond end of file",
            ));
        }
        done += n;
    }
    Ok(())
}

/// Writes all of `buf` at `offset`, resuming after short writes.
pub(crate) fn pwrite_full(fd: RawFd, buf: &[u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &buf[done..];
        let at = to_off_t(offset + done as u64)?;
        // SAFETY: `rest` is a valid, readable region of `rest.len()` bytes.
        let n = retrying(|| unsafe { libc::pwrite(fd, rest.as_ptr().cast(), rest.len(), at) })?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "device accepted no bytes",
            ));
        }
        done += n;
    }
    Ok(())
}

/// Makes completed writes durable; data only, since the file's size never changes.
pub(crate) fn fdatasync(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain system call on a descriptor we own.
    retrying(|| unsafe { libc::fdatasync(fd) as isize }).map(drop)
}

/// Takes an exclusive advisory lock on the whole file without waiting. Err(WouldBlock) when
/// another open file description holds it: another process, or this one opening the same
/// file again under another name. Released when the descriptor closes (also on SIGKILL).
pub(crate) fn lock_exclusive(fd: RawFd) -> io::Result<()> {
    loop {
        // SAFETY: plain system call on a descriptor we own.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        // Not `retrying`: EWOULDBLOCK is EAGAIN, which is an answer here, not a hiccup.
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Renames `from` to `to`, failing with EEXIST instead of replacing a file at `to`. Where the
/// file system cannot rename that way, a hard link and an unlink do the same.
pub(crate) fn rename_no_replace(from: &std::path::Path, to: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &std::path::Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let (from_c, to_c) = (c(from)?, c(to)?);
    // SAFETY: two NUL-terminated paths that live across the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from_c.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if !matches!(err.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
        return Err(err);
    }
    std::fs::hard_link(from, to)?;
    std::fs::remove_file(from)
}

/// Frees the blocks of a byte range in a regular file, keeping its size.
pub(crate) fn punch_hole(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fallocate(fd, mode, offset, len)
}

/// Allocates every block of a regular file's first `len` bytes (unwritten extents: reads still
/// return zeros), so later O_DIRECT writes do not allocate on the hot path.
pub(crate) fn preallocate(fd: RawFd, len: u64) -> io::Result<()> {
    fallocate(fd, 0, 0, len)
}

fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let (at, len) = (to_off_t(offset)?, to_off_t(len)?);
    // SAFETY: plain system call on a descriptor we own.
    retrying(|| unsafe { libc::fallocate(fd, mode, at, len) as isize }).map(drop)
}

/// Discards a byte range of a block device.
pub(crate) fn blk_discard(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64 from the pointer, which points to `range`.
    retrying(|| unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) as isize }).map(drop)
}

/// The size of a block device in bytes.
pub(crate) fn blk_size_bytes(fd: RawFd) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to `size`.
    retrying(|| unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut size as *mut u64) as isize })?;
    Ok(size)
}

/// Whether the file lives in memory (tmpfs or ramfs). io_uring hands writes to such a file to a
/// kernel worker (their file system cannot promise not to block), which cost ~60 µs for a
/// 4 KiB write that a blocking `pwrite` makes in ~3 µs (docs/BENCHMARKS.md).
pub(crate) fn in_memory_fs(fd: RawFd) -> bool {
    // SAFETY: a zeroed statfs is a valid value for the kernel to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs through the pointer, which points to `st`.
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return false;
    }
    // ramfs's magic, which the libc crate does not name (include/uapi/linux/magic.h).
    const RAMFS_MAGIC: libc::__fsword_t = 0x8584_58f6;
    st.f_type == libc::TMPFS_MAGIC || st.f_type == RAMFS_MAGIC
}

/// True for the errors that mean "this device or file system cannot discard".
pub(crate) fn is_unsupported(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::ENOSYS)
    )
}

/// `statfs` magic numbers of the file systems that write an overwritten block to new space
/// (copy-on-write) rather than in place, so an overwrite needs free space.
const BTRFS_SUPER_MAGIC: libc::c_long = 0x9123_683e;
const ZFS_SUPER_MAGIC: libc::c_long = 0x2fc1_2fc2;
const BCACHEFS_SUPER_MAGIC: libc::c_long = 0xca45_1a4e;
/// `FS_NOCOW_FL` (linux/fs.h): btrfs overwrites the file's blocks in place. It takes effect
/// only on a file still empty.
const FS_NOCOW_FL: libc::c_int = 0x0080_0000;

/// The copy-on-write file system `fd` is on, by name; None for any other.
pub(crate) fn copy_on_write_fs(fd: RawFd) -> io::Result<Option<&'static str>> {
    // SAFETY: a zeroed statfs is a valid value for the kernel to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs through the pointer, which points to `st`.
    retrying(|| unsafe { libc::fstatfs(fd, &mut st) as isize })?;
    #[allow(clippy::unnecessary_cast)] // f_type's type differs between targets.
    Ok(match st.f_type as libc::c_long {
        BTRFS_SUPER_MAGIC => Some("btrfs"),
        ZFS_SUPER_MAGIC => Some("zfs"),
        BCACHEFS_SUPER_MAGIC => Some("bcachefs"),
        _ => None,
    })
}

/// The file's inode flags (`FS_IOC_GETFLAGS`; the kernel reads and writes an int).
fn inode_flags(fd: RawFd) -> io::Result<libc::c_int> {
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int through the pointer, which points to `flags`.
    retrying(|| unsafe { libc::ioctl(fd, libc::FS_IOC_GETFLAGS, &mut flags) as isize })?;
    Ok(flags)
}

/// Whether the file is marked to be overwritten in place (btrfs's `No_COW`, `chattr +C`).
pub(crate) fn is_no_cow(fd: RawFd) -> io::Result<bool> {
    Ok(inode_flags(fd)? & FS_NOCOW_FL != 0)
}

/// Marks an empty file to be overwritten in place (`chattr +C`).
pub(crate) fn set_no_cow(fd: RawFd) -> io::Result<()> {
    let flags = inode_flags(fd)? | FS_NOCOW_FL;
    // SAFETY: FS_IOC_SETFLAGS reads one int through the pointer, which points to `flags`.
    retrying(|| unsafe { libc::ioctl(fd, libc::FS_IOC_SETFLAGS, &flags) as isize }).map(drop)
}

/// `_IOWR('f', 11, struct fiemap)` (linux/fs.h): where a file's extents lie.
const FS_IOC_FIEMAP: libc::Ioctl = 0xC020_660B;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// The extent's blocks are shared with another file or a snapshot (reflinks): its first
/// overwrite takes new space.
const FIEMAP_EXTENT_SHARED: u32 = 0x2000;
/// Extents asked for at a time.
const FIEMAP_BATCH: usize = 64;

/// `struct fiemap_extent` (linux/fiemap.h).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

/// `struct fiemap` with room for `FIEMAP_BATCH` extents.
#[repr(C)]
struct Fiemap {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [FiemapExtent; FIEMAP_BATCH],
}

/// Bytes of the file's first `len` whose blocks it shares with another file or a snapshot.
pub(crate) fn shared_bytes(fd: RawFd, len: u64) -> io::Result<u64> {
    let mut shared = 0;
    let mut at = 0;
    while at < len {
        let mut map = Fiemap {
            start: at,
            length: len - at,
            flags: 0,
            mapped_extents: 0,
            extent_count: FIEMAP_BATCH as u32,
            reserved: 0,
            extents: [FiemapExtent::default(); FIEMAP_BATCH],
        };
        // SAFETY: FS_IOC_FIEMAP reads the header and writes at most `extent_count` extents
        // into `map`, which has room for them.
        retrying(|| unsafe { libc::ioctl(fd, FS_IOC_FIEMAP, &mut map as *mut Fiemap) as isize })?;
        let n = (map.mapped_extents as usize).min(FIEMAP_BATCH);
        let Some(last) = map.extents[..n].last().copied() else {
            break;
        };
        for e in &map.extents[..n] {
            if e.flags & FIEMAP_EXTENT_SHARED != 0 {
                let end = (e.logical + e.length).min(len);
                shared += end.saturating_sub(e.logical.max(at));
            }
        }
        let next = last.logical + last.length;
        if last.flags & FIEMAP_EXTENT_LAST != 0 || next <= at {
            break;
        }
        at = next;
    }
    Ok(shared)
}
