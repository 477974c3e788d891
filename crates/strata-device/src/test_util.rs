//! Checks every `Device` implementation must pass, shared by their test modules.

use std::sync::Arc;
use std::thread;

use crate::{AlignedBuf, Device, DeviceError, BLOCK_SIZE};

const BLOCK: u64 = BLOCK_SIZE as u64;

/// A buffer of `blocks` blocks, each filled with a byte derived from `seed` and its index.
pub(crate) fn pattern(blocks: usize, seed: u8) -> AlignedBuf {
    let mut buf = AlignedBuf::new_zeroed(blocks * BLOCK_SIZE);
    for (i, chunk) in buf.chunks_exact_mut(BLOCK_SIZE).enumerate() {
        chunk.fill(seed.wrapping_add(i as u8).wrapping_mul(31).wrapping_add(1));
        chunk[0] = seed;
        chunk[1] = i as u8;
    }
    buf
}

/// Misaligned offset, length, buffer address and out-of-range I/O are typed errors.
pub(crate) fn check_rejects_bad_io(dev: &dyn Device) {
    let size = dev.size_bytes();
    let mut buf = AlignedBuf::new_zeroed(2 * BLOCK_SIZE);
    let misaligned = |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::Misaligned { .. }));
    let out_of_range =
        |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::OutOfRange { .. }));
    assert!(misaligned(dev.read_at(&mut buf[..BLOCK_SIZE], 512)));
    assert!(misaligned(dev.write_at(&buf[..BLOCK_SIZE], 100)));
    assert!(misaligned(dev.write_at(&buf[..512], 0)));
    assert!(misaligned(dev.read_at(&mut buf[512..512 + BLOCK_SIZE], 0)));
    assert!(misaligned(dev.write_at(&buf[1..1 + BLOCK_SIZE], 0)));
    assert!(misaligned(dev.discard(0, 1000)));
    assert!(out_of_range(dev.read_at(&mut buf[..BLOCK_SIZE], size)));
    assert!(out_of_range(dev.write_at(&buf, size - BLOCK)));
    assert!(out_of_range(dev.discard(size - BLOCK, 2 * BLOCK)));
    assert!(out_of_range(
        dev.write_at(&buf[..BLOCK_SIZE], u64::MAX - BLOCK + 1)
    ));
}

/// Writes of several sizes read back identically, unwritten space reads as zeros, and the
/// counters and size histograms see every call.
pub(crate) fn check_read_after_write(dev: &dyn Device) {
    let before = dev.stats();
    let one = pattern(1, 1);
    let many = pattern(64, 2);
    dev.write_at(&one, 0).unwrap();
    dev.write_at(&many, 16 * BLOCK).unwrap();
    dev.flush().unwrap();
    let mut back = AlignedBuf::new_zeroed(BLOCK_SIZE);
    dev.read_at(&mut back, 0).unwrap();
    assert_eq!(back, one);
    let mut back = AlignedBuf::new_zeroed(64 * BLOCK_SIZE);
    dev.read_at(&mut back, 16 * BLOCK).unwrap();
    assert_eq!(back, many);
    let mut zeros = AlignedBuf::new_zeroed(BLOCK_SIZE);
    dev.read_at(&mut zeros, dev.size_bytes() - BLOCK).unwrap();
    assert!(zeros.iter().all(|&b| b == 0));
    let after = dev.stats();
    assert_eq!(after.write_ops - before.write_ops, 2);
    assert_eq!(after.write_bytes - before.write_bytes, 65 * BLOCK);
    assert_eq!(after.read_ops - before.read_ops, 3);
    assert_eq!(after.read_bytes - before.read_bytes, 66 * BLOCK);
    assert_eq!(after.flush_ops - before.flush_ops, 1);
    assert_eq!(
        after.write_sizes.buckets[12] - before.write_sizes.buckets[12],
        1
    );
    assert_eq!(
        after.write_sizes.buckets[18] - before.write_sizes.buckets[18],
        1
    );
    assert_eq!(
        after.read_sizes.buckets[12] - before.read_sizes.buckets[12],
        2
    );
    assert_eq!(after.name, dev.name());
}

/// Eight threads write distinct blocks concurrently; every block reads back intact.
pub(crate) fn check_concurrent_writers(dev: Arc<dyn Device>) {
    const THREADS: u64 = 8;
    const BLOCKS_PER_THREAD: u64 = 32;
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let dev = Arc::clone(&dev);
            thread::spawn(move || {
                for i in 0..BLOCKS_PER_THREAD {
                    let block = i * THREADS + t;
                    let data = pattern(1, (block % 251) as u8);
                    dev.write_at(&data, block * BLOCK).unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    dev.flush().unwrap();
    let mut back = AlignedBuf::new_zeroed(BLOCK_SIZE);
    for block in 0..THREADS * BLOCKS_PER_THREAD {
        dev.read_at(&mut back, block * BLOCK).unwrap();
        assert_eq!(back, pattern(1, (block % 251) as u8), "block {block}");
    }
}

/// A discarded range is counted; where the device reports it supported, it reads as zeros.
pub(crate) fn check_discard_counted(dev: &dyn Device) {
    let before = dev.stats();
    dev.write_at(&pattern(4, 9), 0).unwrap();
    dev.discard(0, 4 * BLOCK).unwrap();
    let after = dev.stats();
    let handled = (after.discard_ops - before.discard_ops)
        + (after.discard_unsupported_ops - before.discard_unsupported_ops);
    assert_eq!(handled, 1);
    assert_eq!(after.errors, before.errors);
}
