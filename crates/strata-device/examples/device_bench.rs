//! Compares `FileDevice` (both backends) with the raw io_uring baseline on one file:
//! random 4 KiB reads, then writes, at the same queue depth (one caller thread per slot).
//!
//! `cargo run --release -p strata-device --example device_bench -- [PATH] [SIZE_MIB] [DEPTH] [OPS]`
//! Defaults: a 256 MiB file in the system temp dir, depth 16, 20000 operations. Writes destroy
//! the file's content. Page cache is bypassed (O_DIRECT) but the file system and device are
//! whatever PATH lives on: say which in any report.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use strata_device::{
    raw_random_io, AlignedBuf, Device, FileDevice, IoBackend, OpenOptions, BLOCK_SIZE,
};

fn arg<T: std::str::FromStr>(index: usize, default: T) -> T {
    std::env::args()
        .nth(index)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Runs `ops` random block I/Os from `depth` threads; returns operations per second.
fn device_ops_per_s(dev: Arc<dyn Device>, depth: u64, ops: u64, write: bool) -> f64 {
    let blocks = dev.size_bytes() / BLOCK_SIZE as u64;
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let threads: Vec<_> = (0..depth)
        .map(|t| {
            let (dev, next) = (Arc::clone(&dev), Arc::clone(&next));
            std::thread::spawn(move || {
                let mut buf = AlignedBuf::new_zeroed(BLOCK_SIZE);
                let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                while next.fetch_add(1, Ordering::Relaxed) < ops {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let offset = (x % blocks) * BLOCK_SIZE as u64;
                    let result = if write {
                        dev.write_at(&buf, offset)
                    } else {
                        dev.read_at(&mut buf, offset)
                    };
                    if let Err(err) = result {
                        eprintln!("I/O failed: {err}");
                        return;
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        let _ = thread.join();
    }
    ops as f64 / start.elapsed().as_secs_f64()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: PathBuf = arg(1, std::env::temp_dir().join("strata-device-bench.img"));
    let size_mib: u64 = arg(2, 256);
    let depth: u32 = arg(3, 16);
    let ops: u64 = arg(4, 20_000);
    let create = OpenOptions {
        create_size_bytes: Some(size_mib << 20),
        preallocate: true,
        ..OpenOptions::default()
    };
    drop(FileDevice::open(&path, &create)?);
    println!(
        "file {} ({size_mib} MiB), 4 KiB random I/O, depth {depth}, {ops} ops",
        path.display()
    );
    for write in [false, true] {
        let raw = raw_random_io(&path, BLOCK_SIZE, depth, ops, write, 1)?;
        let kind = if write { "write" } else { "read" };
        println!(
            "{kind:5} raw io_uring       {:>10.0} ops/s  (baseline)",
            raw.ops_per_s
        );
        for backend in [IoBackend::IoUring, IoBackend::ThreadPool] {
            let options = OpenOptions {
                backend,
                ..OpenOptions::default()
            };
            let dev: Arc<dyn Device> = Arc::new(FileDevice::open(&path, &options)?);
            let name = dev.io_backend_name();
            let ops_per_s = device_ops_per_s(dev, u64::from(depth), ops, write);
            println!(
                "{kind:5} FileDevice {name:8} {ops_per_s:>10.0} ops/s  ratio {:.2}",
                ops_per_s / raw.ops_per_s
            );
        }
    }
    Ok(())
}
