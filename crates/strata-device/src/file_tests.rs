use std::os::unix::fs::MetadataExt;

use super::*;
use crate::test_util::{self, pattern};
use crate::AlignedBuf;

const MIB: u64 = 1 << 20;
const BLOCK: u64 = BLOCK_SIZE as u64;

fn open_error_text(result: Result<FileDevice, DeviceError>) -> String {
    match result {
        Err(DeviceError::Open(text)) => text,
        Err(other) => panic!("expected an Open error, got {other}"),
        Ok(_) => panic!("expected an Open error, the open succeeded"),
    }
}

fn options(create_size_bytes: u64, backend: IoBackend) -> OpenOptions {
    OpenOptions {
        create_size_bytes: Some(create_size_bytes),
        backend,
        ..OpenOptions::default()
    }
}

/// io_uring may be disabled on a machine (sysctl, seccomp); the io_uring tests then say so
/// and pass, while the threads backend still runs everything.
fn io_uring_available() -> bool {
    let available = io_uring::IoUring::new(8).is_ok();
    if !available {
        eprintln!("io_uring is not available here: skipping the io_uring backend");
    }
    available
}

fn backends() -> Vec<IoBackend> {
    let mut backends = vec![IoBackend::ThreadPool];
    if io_uring_available() {
        backends.push(IoBackend::IoUring);
    }
    backends
}

#[test]
fn refuses_bad_paths_and_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let text = open_error_text(FileDevice::open(&missing, &OpenOptions::default()));
    assert!(text.contains("does not exist"), "{text}");
    let text = open_error_text(FileDevice::open(
        &missing,
        &options(MIB - BLOCK, IoBackend::Auto),
    ));
    assert!(text.contains("1 MiB"), "{text}");
    assert!(!missing.exists());
    let text = open_error_text(FileDevice::open(dir.path(), &options(MIB, IoBackend::Auto)));
    assert!(text.contains("directory"), "{text}");
    let small = dir.path().join("small");
    std::fs::write(&small, vec![0u8; 8192]).unwrap();
    let text = open_error_text(FileDevice::open(&small, &OpenOptions::default()));
    assert!(text.contains("below the 1 MiB minimum"), "{text}");
    // Nothing at all: what a loop device with no file attached also shows.
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").unwrap();
    let text = open_error_text(FileDevice::open(&empty, &OpenOptions::default()));
    assert!(
        text.contains("size 0 bytes: an empty file, or a block device with nothing"),
        "{text}"
    );
    assert!(open_path(&missing, None).is_err());
}

#[test]
fn creates_sparse_file_of_requested_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev");
    let dev = open_path(&path, Some(64 * MIB + 100)).unwrap();
    assert_eq!(dev.size_bytes(), 64 * MIB);
    let metadata = std::fs::metadata(&path).unwrap();
    assert_eq!(metadata.len(), 64 * MIB);
    assert!(
        metadata.blocks() * 512 < MIB,
        "sparse file allocated {} blocks",
        metadata.blocks()
    );
    drop(dev);
    let reopened = open_path(&path, Some(128 * MIB)).unwrap();
    assert_eq!(
        reopened.size_bytes(),
        64 * MIB,
        "an existing file is never resized"
    );
}

#[test]
fn contract_checks_on_both_backends() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(
            FileDevice::open(&dir.path().join("dev"), &options(16 * MIB, backend)).unwrap(),
        );
        let expected = if backend == IoBackend::IoUring {
            "io_uring"
        } else {
            "threads"
        };
        assert_eq!(Device::io_backend_name(&*dev), expected);
        test_util::check_rejects_bad_io(&*dev);
        test_util::check_read_after_write(&*dev);
        test_util::check_discard_counted(&*dev);
        test_util::check_concurrent_writers(dev.clone());
        assert!(dev.stats().errors >= 10, "rejected calls are counted");
    }
}

#[test]
fn data_survives_reopen_after_flush() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        let dev = FileDevice::open(&path, &options(4 * MIB, backend)).unwrap();
        dev.write_at(&pattern(16, 3), MIB).unwrap();
        dev.flush().unwrap();
        drop(dev);
        let dev = FileDevice::open(
            &path,
            &OpenOptions {
                backend,
                ..OpenOptions::default()
            },
        )
        .unwrap();
        let mut back = AlignedBuf::new_zeroed(16 * BLOCK_SIZE);
        dev.read_at(&mut back, MIB).unwrap();
        assert_eq!(back, pattern(16, 3));
    }
}

#[test]
fn durable_write_reads_back_and_counts_a_write_and_a_flush() {
    let modes = [DurableWrite::WriteThenSync, DurableWrite::Dsync];
    for (backend, mode) in backends().into_iter().flat_map(|b| modes.map(|m| (b, m))) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        let opts = OpenOptions {
            durable_write: mode,
            ..options(4 * MIB, backend)
        };
        let dev = FileDevice::open(&path, &opts).unwrap();
        dev.write_durable_at(&pattern(8, 5), 2 * MIB).unwrap();
        let stats = dev.stats();
        assert_eq!((stats.write_ops, stats.flush_ops), (1, 1), "{backend:?} {mode:?}");
        assert_eq!(stats.write_bytes, 8 * BLOCK_SIZE as u64);
        assert!(dev.write_durable_at(&pattern(1, 1)[..100], 0).is_err(), "misaligned length accepted");
        drop(dev);
        let dev = FileDevice::open(&path, &OpenOptions { backend, ..OpenOptions::default() }).unwrap();
        let mut back = AlignedBuf::new_zeroed(8 * BLOCK_SIZE);
        dev.read_at(&mut back, 2 * MIB).unwrap();
        assert_eq!(back, pattern(8, 5));
    }
}

/// Parts far apart, submitted together: each lands where it was sent, the call counts every
/// write and one flush, and a bad part is an error.
#[test]
fn parts_written_together_read_back_and_count_their_writes_and_one_flush() {
    let modes = [DurableWrite::WriteThenSync, DurableWrite::Dsync];
    // A file in memory takes the other path (blocking writes one after the other).
    let shm = std::path::Path::new("/dev/shm");
    let dirs = [Some(std::env::temp_dir()), shm.is_dir().then(|| shm.to_path_buf())];
    let cases = backends()
        .into_iter()
        .flat_map(|b| modes.map(|m| (b, m)))
        .flat_map(|c| dirs.iter().flatten().map(move |d| (c, d)));
    for ((backend, mode), dir) in cases {
        let dir = tempfile::tempdir_in(dir).unwrap();
        let path = dir.path().join("dev");
        let opts = OpenOptions {
            durable_write: mode,
            ..options(4 * MIB, backend)
        };
        let dev = FileDevice::open(&path, &opts).unwrap();
        let (a, b) = (pattern(1, 7), pattern(3, 9));
        dev.write_all_durable(&[(&a, 3 * MIB), (&b, BLOCK)]).unwrap();
        let stats = dev.stats();
        assert_eq!((stats.write_ops, stats.flush_ops), (2, 1), "{backend:?} {mode:?}");
        assert_eq!(stats.write_bytes, 4 * BLOCK_SIZE as u64);
        let past_end = dev.write_all_durable(&[(&a, 0), (&b, 4 * MIB)]);
        assert!(past_end.is_err(), "{backend:?} {mode:?}: a part past the end accepted");
        drop(dev);
        let dev = FileDevice::open(&path, &OpenOptions { backend, ..OpenOptions::default() }).unwrap();
        let mut back = AlignedBuf::new_zeroed(BLOCK_SIZE);
        dev.read_at(&mut back, 3 * MIB).unwrap();
        assert_eq!(back, a, "{backend:?} {mode:?}");
        let mut back = AlignedBuf::new_zeroed(3 * BLOCK_SIZE);
        dev.read_at(&mut back, BLOCK).unwrap();
        assert_eq!(back, b, "{backend:?} {mode:?}");
    }
}

#[test]
fn discard_punches_a_hole_that_reads_zero() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let dev = FileDevice::open(&dir.path().join("dev"), &options(4 * MIB, backend)).unwrap();
        assert!(dev.discard_is_cheap(), "a sparse file's discard punches a hole");
        dev.write_at(&pattern(8, 1), 0).unwrap();
        dev.discard(BLOCK, 2 * BLOCK).unwrap();
        let stats = dev.stats();
        if stats.discard_unsupported_ops > 0 {
            eprintln!("the temp file system cannot punch holes: skipping the zero check");
            continue;
        }
        assert_eq!((stats.discard_ops, stats.discard_bytes), (1, 2 * BLOCK));
        let mut back = AlignedBuf::new_zeroed(4 * BLOCK_SIZE);
        dev.read_at(&mut back, 0).unwrap();
        assert_eq!(back[..BLOCK_SIZE], pattern(1, 1)[..]);
        assert!(back[BLOCK_SIZE..3 * BLOCK_SIZE].iter().all(|&b| b == 0));
        assert_eq!(
            back[3 * BLOCK_SIZE..],
            pattern(8, 1)[3 * BLOCK_SIZE..4 * BLOCK_SIZE]
        );
    }
}

#[test]
fn preallocated_file_is_fully_allocated_and_keeps_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let opts = OpenOptions {
        preallocate: true,
        ..options(8 * MIB, IoBackend::Auto)
    };
    let dev = FileDevice::open(&path, &opts).unwrap();
    let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
    assert!(allocated >= 8 * MIB, "only {allocated} bytes allocated");
    assert!(!dev.discard_is_cheap(), "a preallocated file's discard does nothing");
    dev.discard(0, MIB).unwrap();
    assert_eq!(dev.stats().discard_unsupported_ops, 1);
    assert!(std::fs::metadata(&path).unwrap().blocks() * 512 >= 8 * MIB);
}

/// The extents of a file as FIEMAP reports them: (logical offset, length, flags).
fn extents(file: &File) -> std::io::Result<Vec<(u64, u64, u32)>> {
    const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
    const MAX: usize = 256;
    // struct fiemap (32 bytes) followed by MAX struct fiemap_extent (56 bytes each).
    let mut buf = vec![0u64; (32 + 56 * MAX) / 8];
    buf[1] = u64::MAX; // fm_length
    let words = buf.as_mut_ptr() as *mut u32;
    // SAFETY: fm_flags is the u32 at byte 16 and fm_extent_count the one at byte 24, within buf.
    unsafe {
        *words.add(4) = 1; // FIEMAP_FLAG_SYNC
        *words.add(6) = MAX as u32;
    }
    // SAFETY: the ioctl writes at most MAX extents into buf, which has room for them.
    if unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, buf.as_mut_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fm_mapped_extents is the u32 at byte 20.
    let n = unsafe { *words.add(5) } as usize;
    Ok((0..n.min(MAX))
        .map(|i| {
            // Extent i starts at u64 index 4 + 7i; its fe_flags is the u32 at byte 40 of it.
            let e = 4 + i * 7;
            // SAFETY: within buf, as above.
            let flags = unsafe { *words.add(e * 2 + 10) };
            (buf[e], buf[e + 2], flags)
        })
        .collect())
}

#[test]
fn preallocated_file_created_here_is_written_not_just_allocated() {
    const UNWRITTEN: u32 = 0x800;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    // A leftover of a start interrupted while creating the file is built over.
    std::fs::write(dir.path().join("log.creating"), b"stale").unwrap();
    let opts = OpenOptions {
        preallocate: true,
        ..options(8 * MIB, IoBackend::Auto)
    };
    let dev = FileDevice::open(&path, &opts).unwrap();
    assert_eq!(dev.size_bytes(), 8 * MIB);
    assert!(!dir.path().join("log.creating").exists());
    let file = File::open(&path).unwrap();
    match extents(&file) {
        Ok(extents) => {
            let covered: u64 = extents.iter().map(|e| e.1).sum();
            assert!(
                covered >= 8 * MIB,
                "extents cover {covered} bytes: {extents:?}"
            );
            assert!(
                extents.iter().all(|e| e.2 & UNWRITTEN == 0),
                "unwritten extents left: {extents:?}"
            );
        }
        Err(err) => eprintln!("FIEMAP unsupported here ({err}): extent flags not checked"),
    }
    let mut back = AlignedBuf::new_zeroed(MIB as usize);
    dev.read_at(&mut back, 7 * MIB).unwrap();
    assert!(back.iter().all(|&b| b == 0));
    // A sparse file (the capacity tier's) is still created sparse, and an existing file is
    // not written over.
    let sparse = FileDevice::open(&dir.path().join("cap"), &options(8 * MIB, IoBackend::Auto));
    drop(sparse.unwrap());
    assert_eq!(
        std::fs::metadata(dir.path().join("cap")).unwrap().blocks(),
        0
    );
    dev.write_at(&pattern(1, 9), 0).unwrap();
    drop(dev);
    let dev = FileDevice::open(&path, &opts).unwrap();
    let mut first = AlignedBuf::new_zeroed(BLOCK as usize);
    dev.read_at(&mut first, 0).unwrap();
    assert_eq!(first, pattern(1, 9));
}

/// Two starts creating the same fast-tier file at once: the second finds the first's
/// temporary file locked and refuses, without truncating or writing it, and without
/// creating a device of its own.
#[test]
fn a_file_being_created_by_another_start_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let tmp = dir.path().join("log.creating");
    std::fs::write(&tmp, vec![7u8; 8192]).unwrap();
    let other = File::open(&tmp).unwrap();
    os::lock_exclusive(other.as_raw_fd()).unwrap();
    let opts = OpenOptions {
        preallocate: true,
        ..options(8 * MIB, IoBackend::Auto)
    };
    let text = open_error_text(FileDevice::open(&path, &opts));
    assert!(text.contains("being created by another"), "{text}");
    assert_eq!(
        std::fs::read(&tmp).unwrap(),
        vec![7u8; 8192],
        "the other start's file was touched"
    );
    assert!(
        !path.exists(),
        "a device was created beside the other start's"
    );
    // Once the other start is gone (its lock with it), a leftover is built over.
    drop(other);
    let dev = FileDevice::open(&path, &opts).unwrap();
    assert_eq!(dev.size_bytes(), 8 * MIB);
    assert!(!tmp.exists());
}

/// A creation abandoned (the daemon asked to stop while it wrote zeros) leaves neither the
/// device nor its temporary file.
#[test]
fn an_abandoned_creation_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let opts = OpenOptions {
        preallocate: true,
        abandon_creation: Some(Arc::new(AtomicBool::new(true))),
        ..options(64 * MIB, IoBackend::Auto)
    };
    let e = FileDevice::open(&path, &opts).err().expect("abandoned");
    assert!(matches!(e, DeviceError::Abandoned(_)), "{e}");
    assert!(!path.exists());
    assert!(!dir.path().join("log.creating").exists());
}

/// A device file that appears while this start builds its own is not replaced: the rename
/// refuses to overwrite it.
#[test]
fn a_device_file_created_meanwhile_is_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    std::fs::write(&path, vec![9u8; 8192]).unwrap();
    let e = create_written(&path, 8 * MIB, None).unwrap_err().to_string();
    assert!(e.contains("exists"), "{e}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        vec![9u8; 8192],
        "the file was replaced"
    );
    assert!(!dir.path().join("log.creating").exists());
}

#[test]
fn large_io_and_histogram() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let dev = FileDevice::open(&dir.path().join("dev"), &options(16 * MIB, backend)).unwrap();
        let big = pattern(2048, 5);
        dev.write_at(&big, 4 * MIB).unwrap();
        let mut back = AlignedBuf::new_zeroed(2048 * BLOCK_SIZE);
        dev.read_at(&mut back, 4 * MIB).unwrap();
        assert_eq!(back, big);
        let stats = dev.stats();
        assert_eq!(stats.write_sizes.buckets[23], 1, "8 MiB lands in bucket 23");
        assert_eq!(stats.read_sizes.buckets[23], 1);
        assert_eq!(stats.write_bytes, 8 * MIB);
    }
}

/// More concurrent callers than the ring has in-flight slots: the queue and slot bounds hold
/// callers back instead of failing them.
#[test]
fn more_callers_than_ring_slots() {
    if !io_uring_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dev = Arc::new(
        FileDevice::open(
            &dir.path().join("dev"),
            &options(16 * MIB, IoBackend::IoUring),
        )
        .unwrap(),
    );
    let threads: Vec<_> = (0..300u64)
        .map(|t| {
            let dev = Arc::clone(&dev);
            std::thread::spawn(move || {
                let data = pattern(1, t as u8);
                for round in 0..4 {
                    dev.write_at(&data, (t * 4 + round) * BLOCK).unwrap();
                }
                let mut back = AlignedBuf::new_zeroed(BLOCK_SIZE);
                dev.read_at(&mut back, t * 4 * BLOCK).unwrap();
                assert_eq!(back, data);
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    dev.flush().unwrap();
    assert_eq!(dev.stats().write_ops, 1200);
}

/// Asynchronous reads: many started at once from one thread, more than may be in flight;
/// each taken read completes once with its own block, refused ones come back untouched, the
/// threads backend and misaligned reads are refused, and dropping the device waits for reads
/// still in flight.
#[test]
fn async_reads_complete_once_with_their_data() {
    let dir = tempfile::tempdir().unwrap();
    let threads = FileDevice::open(&dir.path().join("t"), &options(MIB, IoBackend::ThreadPool)).unwrap();
    let refused = threads.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), 0, Box::new(|_, _| panic!("ran")));
    assert!(refused.is_err(), "the threads backend has no asynchronous path");
    if !io_uring_available() {
        return;
    }
    let dev = FileDevice::open(&dir.path().join("dev"), &options(MIB, IoBackend::IoUring)).unwrap();
    let blocks = MIB / BLOCK; // 256: every block's pattern seed differs
    for b in 0..blocks {
        dev.write_at(&pattern(1, b as u8), b * BLOCK).unwrap();
    }
    let misaligned = dev.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), 512, Box::new(|_, _| panic!("ran")));
    let (back, _) = misaligned.expect_err("a misaligned read is handed back");
    assert_eq!(back.len(), BLOCK_SIZE);
    let reads_before = dev.stats().read_ops;
    let (tx, rx) = std::sync::mpsc::channel();
    let mut started = 0u64;
    let mut handed_back = 0;
    for round in 0..3 {
        for b in 0..blocks {
            let tx = tx.clone();
            let done: ReadDone = Box::new(move |buf, result| tx.send((b, round, buf, result.is_ok())).unwrap());
            match dev.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), b * BLOCK, done) {
                Ok(()) => started += 1,
                Err((buf, _)) => {
                    assert!(buf.iter().all(|&x| x == 0), "a refused read's buffer is untouched");
                    handed_back += 1;
                }
            }
        }
    }
    drop(tx);
    let mut seen = std::collections::HashSet::new();
    for (b, round, buf, ok) in rx.iter().take(started as usize) {
        assert!(ok, "read of block {b} failed");
        assert_eq!(buf, pattern(1, b as u8), "block {b}");
        assert!(seen.insert((b, round)), "block {b} round {round} completed twice");
    }
    assert_eq!(seen.len() as u64, started);
    assert!(started > 0 && started + handed_back == 3 * blocks);
    assert_eq!(dev.stats().read_ops - reads_before, started);
    // Reads still in flight when the device is dropped finish before the file closes.
    let (tx, rx) = std::sync::mpsc::channel();
    for b in 0..64 {
        let tx = tx.clone();
        let done: ReadDone = Box::new(move |buf, result| tx.send((b, buf, result.is_ok())).unwrap());
        dev.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), b * BLOCK, done).ok().expect("room for 64 reads");
    }
    drop(tx);
    drop(dev);
    let done: Vec<_> = rx.iter().collect();
    assert_eq!(done.len(), 64);
    assert!(done.iter().all(|(b, buf, ok)| *ok && *buf == pattern(1, *b as u8)));
}

/// Asynchronous reads started from threads that exit at once, while another thread writes
/// other blocks, and from inside a read's own callback (the completion thread): every one
/// completes with its block, and one that never does fails the test at its timeout. (The
/// defect that made the completion thread the only submitter, see `uring_async`, did not show
/// in this test with the old code; `e2e_fio`'s two-job verify is what found it.)
#[test]
fn async_reads_from_any_thread_complete() {
    if !io_uring_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dev = std::sync::Arc::new(FileDevice::open(&dir.path().join("dev"), &options(MIB, IoBackend::IoUring)).unwrap());
    let blocks = MIB / BLOCK;
    for b in 0..blocks {
        dev.write_at(&pattern(1, b as u8), b * BLOCK).unwrap();
    }
    let (tx, rx) = std::sync::mpsc::channel::<(u64, AlignedBuf, bool)>();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Writes to the upper half keep the file busy while the lower half is read.
    let writer = {
        let (dev, stop) = (dev.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let b = blocks / 2 + n % (blocks / 2);
                dev.write_at(&pattern(1, !(b as u8)), b * BLOCK).unwrap();
                n += 1;
            }
        })
    };
    let mut expected = 0u64;
    for round in 0..20u64 {
        let submitters: Vec<_> = (0..4u64)
            .map(|t| {
                let (dev, tx) = (dev.clone(), tx.clone());
                std::thread::spawn(move || {
                    let mut taken = 0u64;
                    for i in 0..16u64 {
                        let b = (round * 64 + t * 16 + i) % (blocks / 2);
                        let tx = tx.clone();
                        let done: ReadDone = Box::new(move |buf, result| tx.send((b, buf, result.is_ok())).unwrap());
                        if dev.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), b * BLOCK, done).is_ok() {
                            taken += 1;
                        }
                    }
                    taken
                })
            })
            .collect();
        expected += submitters.into_iter().map(|h| h.join().unwrap()).sum::<u64>();
    }
    let collect = |count: u64| {
        for n in 0..count {
            let (b, buf, ok) = rx
                .recv_timeout(std::time::Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("read {n} of {count} never completed: {e}"));
            assert!(ok, "read of block {b} failed");
            assert_eq!(buf, pattern(1, b as u8), "block {b}");
        }
    };
    collect(expected);
    // A read whose callback starts the next one, eight deep, all on the completion thread.
    fn chain(dev: std::sync::Arc<FileDevice>, b: u64, left: u32, tx: std::sync::mpsc::Sender<(u64, AlignedBuf, bool)>) {
        let next = dev.clone();
        let done: ReadDone = Box::new(move |buf, result| {
            tx.send((b, buf, result.is_ok())).unwrap();
            if left > 1 {
                chain(next, b + 1, left - 1, tx);
            }
        });
        dev.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), b * BLOCK, done).ok().expect("room for a chained read");
    }
    chain(dev.clone(), 3, 8, tx);
    collect(8);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert!(expected > 0, "some reads were taken from the submitting threads");
}

#[test]
fn auto_backend_reports_a_name() {
    let dir = tempfile::tempdir().unwrap();
    let dev = open_path(&dir.path().join("dev"), Some(MIB)).unwrap();
    assert!(["io_uring", "threads"].contains(&dev.io_backend_name()));
}

/// A loop device over a temp file, detached on drop; None where loop devices cannot be made
/// (not root, no losetup, no /dev/loop-control).
struct LoopDevice {
    path: std::path::PathBuf,
}

impl LoopDevice {
    fn attach(backing: &Path) -> Option<LoopDevice> {
        let output = std::process::Command::new("losetup")
            .args(["--find", "--show"])
            .arg(backing)
            .output()
            .ok()?;
        if !output.status.success() {
            return None;
        }
        let path = String::from_utf8(output.stdout).ok()?.trim().to_string();
        Some(LoopDevice { path: path.into() })
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .arg("-d")
            .arg(&self.path)
            .status();
    }
}

#[test]
fn block_device_size_io_discard_and_exclusive_open() {
    let dir = tempfile::tempdir().unwrap();
    let backing = dir.path().join("backing");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    let Some(loop_dev) = LoopDevice::attach(&backing) else {
        eprintln!("cannot attach a loop device here: skipping the block device test");
        return;
    };
    for backend in backends() {
        let opts = OpenOptions {
            backend,
            ..OpenOptions::default()
        };
        let dev = FileDevice::open(&loop_dev.path, &opts).unwrap();
        assert_eq!(dev.size_bytes(), 8 * MIB, "BLKGETSIZE64");
        test_util::check_read_after_write(&dev);
        test_util::check_discard_counted(&dev);
        let text = open_error_text(FileDevice::open(&loop_dev.path, &opts));
        assert!(text.contains("in use"), "{text}");
        // The likeliest holder named too: a daemon already serving from the device.
        assert!(text.contains("a strata serve already running on it"), "{text}");
    }
}

#[test]
fn an_open_file_device_is_refused_to_a_second_opener_until_closed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev");
    let first = open_path(&path, Some(4 * MIB)).unwrap();
    let text = open_error_text(FileDevice::open(&path, &OpenOptions::default()));
    assert!(text.contains("is in use"), "{text}");
    // The same file under another name is the same file.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let text = open_error_text(FileDevice::open(&link, &OpenOptions::default()));
    assert!(text.contains("is in use"), "{text}");
    drop(first);
    let again = open_path(&link, None).unwrap();
    assert_eq!(again.size_bytes(), 4 * MIB);
}

/// io_uring_enter can fail without the I/O having failed: EAGAIN or EBUSY when the kernel is
/// short of memory for requests or of completion slots, or anything at all once the I/O is in
/// flight. The buffer belongs to the kernel until the I/O completes, so the call waits for it;
/// and an entry the kernel never took must not be submitted with a later I/O.
#[test]
fn a_failed_io_uring_enter_never_leaves_an_io_behind() {
    use crate::uring::injected::fail_enters;
    if !io_uring_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dev = FileDevice::open(&dir.path().join("dev"), &options(MIB, IoBackend::IoUring)).unwrap();
    dev.write_at(&pattern(4, 7), 0).unwrap();
    dev.write_at(&pattern(4, 9), 64 * BLOCK).unwrap();
    let read = |offset: u64| {
        let mut back = AlignedBuf::new_zeroed(4 * BLOCK_SIZE);
        dev.read_at(&mut back, offset).map(|()| back)
    };
    // Transient: waited out.
    fail_enters(3, libc::EAGAIN, false);
    assert_eq!(read(0).unwrap(), pattern(4, 7));
    fail_enters(2, libc::EBUSY, false);
    assert_eq!(read(64 * BLOCK).unwrap(), pattern(4, 9));
    // Any failure with the read in flight: the read is waited for, and its data is right.
    fail_enters(2, libc::EINVAL, true);
    assert_eq!(read(0).unwrap(), pattern(4, 7));
    // A failure before the kernel took the read: an error, and nothing left queued that a
    // later read would submit and take the completion of.
    fail_enters(1, libc::EINVAL, false);
    let mut stale = AlignedBuf::new_zeroed(4 * BLOCK_SIZE);
    assert!(dev.read_at(&mut stale, 0).is_err());
    assert_eq!(read(64 * BLOCK).unwrap(), pattern(4, 9));
    assert!(stale.iter().all(|&b| b == 0), "the refused read ran later");
    // Writes and the durable path go the same way.
    fail_enters(2, libc::EAGAIN, false);
    dev.write_durable_at(&pattern(4, 11), 128 * BLOCK).unwrap();
    assert_eq!(read(128 * BLOCK).unwrap(), pattern(4, 11));
}

/// A file still locked by another opener for a moment (a process just killed with I/O in
/// flight holds its files until the kernel has finished that I/O) is waited for; one held
/// longer than the wait is refused.
#[test]
fn a_locked_file_is_waited_for_a_moment_then_refused() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev");
    drop(open_path(&path, Some(4 * MIB)).unwrap());
    let holder = std::fs::File::open(&path).unwrap();
    os::lock_exclusive(holder.as_raw_fd()).unwrap();
    let released = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(holder);
    });
    let dev = open_path(&path, None).expect("opened once the other opener let go");
    released.join().unwrap();
    drop(dev);
    let holder = std::fs::File::open(&path).unwrap();
    os::lock_exclusive(holder.as_raw_fd()).unwrap();
    let started = std::time::Instant::now();
    let text = open_error_text(FileDevice::open(&path, &OpenOptions::default()));
    assert!(text.contains("is in use"), "{text}");
    assert!(
        started.elapsed() >= LOCK_WAIT,
        "refused before the wait was over"
    );
}

/// A read whose completion panics does not end the completion thread: reads after it still
/// complete.
#[test]
fn a_panicking_read_completion_leaves_later_reads_completing() {
    if !io_uring_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dev = FileDevice::open(&dir.path().join("dev"), &options(MIB, IoBackend::IoUring)).unwrap();
    dev.write_at(&pattern(1, 3), BLOCK).unwrap();
    let panicking: ReadDone = Box::new(|_, _| panic!("a completion panics (on purpose)"));
    dev.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), 0, panicking).ok().expect("taken");
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..2 {
        let tx = tx.clone();
        let done: ReadDone = Box::new(move |buf, result| tx.send((buf, result.is_ok())).unwrap());
        dev.read_async(AlignedBuf::new_zeroed(BLOCK_SIZE), BLOCK, done).ok().expect("taken");
        let (buf, ok) = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the read after a panicking one completes");
        assert!(ok && buf == pattern(1, 3));
    }
}
