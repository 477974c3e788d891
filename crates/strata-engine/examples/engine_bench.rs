//! In-process benchmarks of the tier engine (run through bench/engine.sh).
//!
//!   engine_bench qd32      DIR [rounds]        4 KiB random write/read at QD32 vs raw io_uring
//!                                              (writes from one thread keeping 32 in flight,
//!                                              and from 32 threads), log below the low mark
//!   engine_bench saturate  DIR [secs] [MB/s]   sustained random write once the log is full,
//!                                              vs the capacity device's sequential bandwidth
//!   engine_bench hotset    DIR                 hot set of half the fast tier written 10 times
//!   engine_bench index-ram DIR                 bytes of RAM the index needs, measured on a
//!                                              running disk group as capacity data grows
//!
//! Every figure is printed with the baseline measured in the same run and their ratio.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_device::{
    open_with, raw_random_io, Device, IoBackend, OpenOptions, ThrottleConfig, Throttled,
};
use strata_engine::{DiskGroup, EngineConfig, ExtentMap, Loc, WriteDone};

/// Counts live heap bytes so the index's memory can be measured, not estimated.
struct Counting;
static HEAP: AtomicUsize = AtomicUsize::new(0);
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        HEAP.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HEAP.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
}
#[global_allocator]
static GLOBAL: Counting = Counting;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cmd = args.get(1).map(String::as_str).unwrap_or("");
    let dir = args
        .get(2)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/bench-engine"));
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let result = match cmd {
        "qd32" => qd32(&dir, arg(3, 3)),
        "saturate" => saturate(&dir, arg(3, 20), arg(4, 200)),
        "hotset" => hotset(&dir),
        "index-ram" => index_ram(&dir),
        _ => Err("usage: engine_bench qd32|saturate|hotset|index-ram [DIR] [args]".to_string()),
    };
    if let Err(e) = result {
        eprintln!("engine_bench: {e}");
        std::process::exit(1);
    }
}

struct Rig {
    dg: Arc<DiskGroup>,
    cap: Arc<dyn Device>,
    fast_path: PathBuf,
}

fn fresh_group(
    dir: &Path,
    fast: u64,
    cap: u64,
    cap_mb_s: u64,
    cfg: EngineConfig,
) -> Result<Rig, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let fast_path = dir.join("fast.img");
    let cap_path = dir.join("capacity.img");
    for p in [&fast_path, &cap_path] {
        let _ = std::fs::remove_file(p);
    }
    let f = open_with(
        &fast_path,
        &OpenOptions {
            create_size_bytes: Some(fast),
            preallocate: true,
            backend: backend(),
            ..OpenOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let c = open_with(
        &cap_path,
        &OpenOptions {
            create_size_bytes: Some(cap),
            preallocate: false,
            backend: backend(),
            ..OpenOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let cap: Arc<dyn Device> = if cap_mb_s > 0 {
        Arc::new(Throttled::new(
            c,
            ThrottleConfig {
                bandwidth_bytes_per_s: cap_mb_s * 1_000_000,
                ..Default::default()
            },
        ))
    } else {
        c
    };
    let dg = DiskGroup::open(f, vec![cap.clone()], cfg, true).map_err(|e| e.to_string())?;
    Ok(Rig { dg, cap, fast_path })
}

/// Runs `threads` workers, each doing `per_thread` operations from `op(thread, rng)`.
fn parallel(threads: u64, per_thread: u64, op: impl Fn(&mut SmallRng) + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let op = &op;
            s.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t * 7919 + 1);
                for _ in 0..per_thread {
                    op(&mut rng);
                }
            });
        }
    });
    start.elapsed()
}

/// A fresh group with a 128 MiB volume written end to end (so reads find data), its log
/// well below the destage low mark: what follows measures the write path, not destage (the
/// sustained figure with destage running is `saturate`).
fn qd32_group(dir: &Path) -> Result<(Rig, u32, u64), String> {
    let vol_bytes = 128 * MIB;
    let rig = fresh_group(dir, GIB, 8 * GIB, 0, EngineConfig::default())?;
    let v = rig
        .dg
        .create_volume("bench", vol_bytes)
        .map_err(|e| e.to_string())?
        .id;
    let chunk = vec![0x5au8; MIB as usize];
    for i in 0..vol_bytes / MIB {
        rig.dg
            .write(v, i * MIB, &chunk)
            .map_err(|e| e.to_string())?;
    }
    Ok((rig, v, vol_bytes / 4096))
}

/// Stops a group and returns the log fill it reached.
fn close(rig: Rig) -> Result<f64, String> {
    let fill = rig.dg.stats().log_fill_ratio;
    rig.dg.shutdown().map_err(|e| e.to_string())?;
    Ok(fill)
}

fn qd32(dir: &Path, rounds: u64) -> Result<(), String> {
    let ops = 32_768u64;
    let mut rows = Vec::new();
    for round in 0..rounds {
        // One thread keeping 32 writes in flight (the raw baseline's own shape, and how the
        // NBD server drives the engine), then reads, on one group.
        let (rig, v, blocks) = qd32_group(dir)?;
        let wa = async_writes(&rig.dg, v, blocks, ops, 32);
        let r = parallel(32, ops / 32, |rng| {
            let b = rng.gen_range(0..blocks);
            let mut buf = [0u8; 4096];
            rig.dg.read(v, b * 4096, &mut buf).expect("engine read");
        });
        let fill_a = close(rig)?;
        // 32 threads each waiting for its own write, on a second group.
        let (rig, v, blocks) = qd32_group(dir)?;
        let dg = rig.dg.clone();
        let w = parallel(32, ops / 32, |rng| {
            let b = rng.gen_range(0..blocks);
            dg.write(v, b * 4096, &[0xa5; 4096]).expect("engine write");
        });
        drop(dg);
        let fast_path = rig.fast_path.clone();
        let fill_w = close(rig)?;
        let raw_w =
            raw_random_io(&fast_path, 4096, 32, ops, true, round).map_err(|e| e.to_string())?;
        let raw_r =
            raw_random_io(&fast_path, 4096, 32, ops, false, round).map_err(|e| e.to_string())?;
        let ewa = ops as f64 / wa.as_secs_f64();
        let ew = ops as f64 / w.as_secs_f64();
        let er = ops as f64 / r.as_secs_f64();
        println!(
            "round {round}: write engine {ewa:.0} IOPS (async, one thread), {ew:.0} IOPS (32 threads) raw {:.0} IOPS ratios {:.2} {:.2} | read engine {er:.0} IOPS raw {:.0} IOPS ratio {:.2} | log fill at the end {fill_a:.2} {fill_w:.2}",
            raw_w.ops_per_s,
            ewa / raw_w.ops_per_s,
            ew / raw_w.ops_per_s,
            raw_r.ops_per_s,
            er / raw_r.ops_per_s,
        );
        rows.push((
            ewa / raw_w.ops_per_s,
            ew / raw_w.ops_per_s,
            er / raw_r.ops_per_s,
        ));
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "RESULT qd32 write_ratio_median {:.2} (async, one thread; target >= 0.85) thread_write_ratio_median {:.2} (32 threads) read_ratio_median {:.2} (target >= 0.85)",
        med(rows.iter().map(|r| r.0).collect()),
        med(rows.iter().map(|r| r.1).collect()),
        med(rows.iter().map(|r| r.2).collect())
    );
    Ok(())
}

fn saturate(dir: &Path, secs: u64, cap_mb_s: u64) -> Result<(), String> {
    let rig = fresh_group(dir, 256 * MIB, 16 * GIB, cap_mb_s, EngineConfig::default())?;
    // The capacity device's sequential write bandwidth, measured on the same device object
    // the engine uses (past its segments, so the engine's data is not touched).
    let probe = 256 * MIB;
    let base = rig.cap.size_bytes() - probe;
    let buf = strata_device::AlignedBuf::new_zeroed(8 * MIB as usize);
    let t = Instant::now();
    for i in 0..probe / (8 * MIB) {
        rig.cap
            .write_at(&buf, base + i * 8 * MIB)
            .map_err(|e| e.to_string())?;
    }
    rig.cap.flush().map_err(|e| e.to_string())?;
    let seq_bw = probe as f64 / t.elapsed().as_secs_f64();
    let dg = rig.dg.clone();
    let vol_bytes = 4 * GIB;
    let v = dg
        .create_volume("sat", vol_bytes)
        .map_err(|e| e.to_string())?
        .id;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let written = AtomicU64::new(0);
    let mut samples = Vec::new();
    std::thread::scope(|s| {
        for th in 0..32u64 {
            let (dg, stop, written) = (&dg, &stop, &written);
            s.spawn(move || {
                let mut rng = SmallRng::seed_from_u64(th + 99);
                while !stop.load(Ordering::Relaxed) {
                    let b = rng.gen_range(0..vol_bytes / 4096);
                    dg.write(v, b * 4096, &[0x77; 4096]).expect("write");
                    written.fetch_add(4096, Ordering::Relaxed);
                }
            });
        }
        let start = Instant::now();
        let mut saturated_at = None;
        while start.elapsed() < Duration::from_secs(secs + 120) {
            std::thread::sleep(Duration::from_millis(250));
            let st = dg.stats();
            let now = (
                start.elapsed().as_secs_f64(),
                written.load(Ordering::Relaxed),
                st.log_fill_ratio,
            );
            samples.push(now);
            if std::env::var("STRATA_BENCH_TRACE").is_ok() {
                eprintln!(
                    "t {:.1} fill {:.2} bw {:.1} MB/s destaged {} MiB capacity wrote {} MiB host {} MiB gc {:?}",
                    now.0,
                    now.2,
                    st.destage_bandwidth_bytes_per_s / 1e6,
                    st.destaged_bytes_total / MIB,
                    rig.cap.stats().write_bytes / MIB,
                    now.1 / MIB,
                    (
                        st.segments_free,
                        st.gc_segments_cleaned_total,
                        st.fast_resident_bytes / MIB
                    )
                );
            }
            if saturated_at.is_none() && st.log_fill_ratio >= st.fill_ratio_high {
                saturated_at = Some(now);
            }
            if let Some(s0) = saturated_at {
                if now.0 - s0.0 >= secs as f64 {
                    break;
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    let st = dg.stats();
    let Some(first) = samples.iter().position(|s| s.2 >= st.fill_ratio_high) else {
        return Err("the log never reached the high mark".into());
    };
    let (t0, b0, _) = samples[first];
    let (t1, b1, _) = *samples.last().ok_or("no samples")?;
    let host = (b1 - b0) as f64 / (t1 - t0);
    let fills: Vec<f64> = samples[first..].iter().map(|s| s.2).collect();
    if std::env::var("STRATA_BENCH_TRACE").is_ok() {
        eprintln!(
            "fills {:?}",
            fills.iter().map(|f| (f * 100.0) as u32).collect::<Vec<_>>()
        );
    }
    let fmin = fills.iter().cloned().fold(1.0, f64::min);
    let fmax = fills.iter().cloned().fold(0.0, f64::max);
    println!(
        "capacity device: file on the same filesystem, throttled to {cap_mb_s} MB/s (token bucket in the device layer); sequential write {:.1} MB/s",
        seq_bw / 1e6
    );
    println!(
        "saturated for {:.0} s: host 4 KiB random write {:.1} MB/s ({:.0} IOPS), log fill {:.2}..{:.2}, destaged {} MiB; the capacity device wrote {} MiB in all (probe included)",
        t1 - t0,
        host / 1e6,
        host / 4096.0,
        fmin,
        fmax,
        st.destaged_bytes_total / MIB,
        rig.cap.stats().write_bytes / MIB
    );
    println!("RESULT saturate ratio {:.2} (host random write / capacity sequential write; target >= 0.8)", host / seq_bw);
    dg.shutdown().map_err(|e| e.to_string())
}

fn hotset(dir: &Path) -> Result<(), String> {
    let rig = fresh_group(dir, 256 * MIB, 8 * GIB, 0, EngineConfig::default())?;
    let dg = rig.dg.clone();
    let log_bytes = dg.stats().log_capacity_bytes;
    let hot = log_bytes / 2 / 4096 * 4096;
    let v = dg.create_volume("hot", GIB).map_err(|e| e.to_string())?.id;
    let cap0 = rig.cap.stats().write_bytes;
    let passes = 10;
    let total_ops = passes * hot / 4096;
    let done = std::sync::atomic::AtomicBool::new(false);
    let t = std::thread::scope(|s| {
        s.spawn(|| monitor(&dg, &done));
        let t = parallel(32, total_ops / 32, |rng| {
            let b = rng.gen_range(0..hot / 4096);
            dg.write(v, b * 4096, &[0x3c; 4096]).expect("write");
        });
        done.store(true, Ordering::Relaxed);
        t
    });
    let host = total_ops * 4096;
    let st = dg.stats();
    let cap_written = rig.cap.stats().write_bytes - cap0;
    println!(
        "hot set {} MiB (half the {} MiB log), {passes} passes of uniform random 4 KiB writes in {:.1} s; kept hot on the fast tier {} MiB; destaged {} MiB",
        hot / MIB,
        log_bytes / MIB,
        t.as_secs_f64(),
        st.hot_kept_bytes_total / MIB,
        st.destaged_bytes_total / MIB
    );
    println!(
        "RESULT hotset capacity_bytes_written/host_bytes_written {:.3} ({} MiB / {} MiB; target <= 0.15)",
        cap_written as f64 / host as f64,
        cap_written / MIB,
        host / MIB
    );
    dg.shutdown().map_err(|e| e.to_string())
}

/// `ops` random 4 KiB writes from one thread keeping `depth` asynchronous writes in flight
/// (the way the raw baseline drives its ring). A write the engine cannot start at once runs
/// on a thread of its own.
fn async_writes(dg: &Arc<DiskGroup>, v: u32, blocks: u64, ops: u64, depth: usize) -> Duration {
    let mut rng = SmallRng::seed_from_u64(99);
    async_each(dg, v, ops, depth, |_| rng.gen_range(0..blocks))
}

/// `ops` 4 KiB writes at blocks `block(i)`, `depth` in flight, from this thread.
fn async_each(
    dg: &Arc<DiskGroup>,
    v: u32,
    ops: u64,
    depth: usize,
    mut block: impl FnMut(u64) -> u64,
) -> Duration {
    let state = Arc::new((Mutex::new(0usize), Condvar::new()));
    let data = [0x5cu8; 4096];
    let start = Instant::now();
    for i in 0..ops {
        {
            let mut n = state.0.lock();
            while *n >= depth {
                state.1.wait(&mut n);
            }
            *n += 1;
        }
        let b = block(i);
        let st = state.clone();
        let done: WriteDone = Box::new(move |r| {
            r.expect("engine write");
            *st.0.lock() -= 1;
            st.1.notify_one();
        });
        if let Err(done) = dg.write_async(v, b * 4096, &data, done) {
            let dg = dg.clone();
            std::thread::spawn(move || done(dg.write(v, b * 4096, &[0x5c; 4096])));
        }
    }
    let mut n = state.0.lock();
    while *n > 0 {
        state.1.wait(&mut n);
    }
    start.elapsed()
}

/// RAM of the index. Fast tier: a map holding one entry per block of a log full of random
/// 4 KiB writes (the worst case), measured directly. Capacity tier: a running disk group is
/// given capacity data whose every block is its own extent (the worst case), destaged and
/// flushed, with a small leaf cache; the heap is measured at two data sizes, so the growth per
/// GiB is what the index needs beyond its fixed cache.
fn index_ram(dir: &Path) -> Result<(), String> {
    let blocks = GIB / 4096;
    let before = HEAP.load(Ordering::Relaxed);
    let fast_map = {
        let mut m = ExtentMap::default();
        let mut rng = SmallRng::seed_from_u64(1);
        for i in 0..blocks {
            m.set(rng.gen_range(0..1u64 << 40) * 2, 1, Some(Loc::Fast(i)));
        }
        m
    };
    let fast = (HEAP.load(Ordering::Relaxed) - before) as f64 + blocks as f64 * 4.0;
    println!(
        "fast tier, 1 GiB of log holding random 4 KiB writes: {} entries, {:.1} MiB (map and block crcs)",
        fast_map.run_count(),
        fast / MIB as f64
    );
    drop(fast_map);
    // The write-heat table at its bound: one entry per log block, every block written twice.
    let heat = {
        let mut h = strata_engine::heat::Heat::new(blocks);
        let mut rng = SmallRng::seed_from_u64(2);
        let lbas: Vec<u64> = (0..blocks).map(|_| rng.gen_range(0..1u64 << 40)).collect();
        let held = HEAP.load(Ordering::Relaxed);
        for _ in 0..2 {
            for &b in &lbas {
                h.note_write(1, b, 1);
            }
        }
        (h, HEAP.load(Ordering::Relaxed) - held)
    };
    println!(
        "write heat, 1 GiB of log: at most {} entries, {:.1} MiB",
        blocks,
        heat.1 as f64 / MIB as f64
    );
    drop(heat);
    let cache = 8 * MIB;
    let cfg = EngineConfig {
        index_cache_bytes: cache,
        ..EngineConfig::default()
    };
    let rig = fresh_group(dir, GIB, 64 * GIB, 0, cfg)?;
    let dg = rig.dg.clone();
    let v = dg
        .create_volume("index", 32 * GIB)
        .map_err(|e| e.to_string())?
        .id;
    let mut points = Vec::new();
    let mut next = 0u64;
    for target_gib in [2u64, 4, 6, 8] {
        // Every other block: no two written blocks are adjacent, so each is its own extent.
        let upto = target_gib * GIB / 4096;
        while next < upto {
            let n = 65536.min(upto - next);
            let from = next;
            async_each(&dg, v, n, 64, |i| (from + i) * 2);
            next += n;
            if !dg.destage_all(Duration::from_secs(600)) {
                return Err("destage did not finish".into());
            }
        }
        if !dg.destage_all(Duration::from_secs(600)) {
            return Err("destage did not finish".into());
        }
        // Let the destager flush the index and evict down to the cache.
        std::thread::sleep(Duration::from_secs(2));
        let st = dg.stats();
        let heap = HEAP.load(Ordering::Relaxed);
        println!(
            "capacity tier, {target_gib} GiB as {} single-block extents: {} index pages on disk ({:.1} MiB), {} inner nodes, {} leaves and {} dirty nodes in memory ({:.2} MiB), heap {:.1} MiB",
            upto,
            st.index_pages_bytes / 4096,
            st.index_pages_bytes as f64 / MIB as f64,
            st.index_resident_inner,
            st.index_resident_leaves,
            st.index_dirty_nodes,
            st.index_resident_bytes as f64 / MIB as f64,
            heap as f64 / MIB as f64
        );
        points.push((
            target_gib as f64,
            heap as f64,
            st.index_resident_bytes as f64,
            st.index_pages_bytes as f64,
        ));
    }
    let (g0, h0, t0, p0) = points[0];
    let (g1, h1, t1, p1) = points[points.len() - 1];
    let tree_max = points.iter().map(|p| p.2).fold(0.0, f64::max);
    println!(
        "from {g0} to {g1} GiB: index nodes in memory {:.2} -> {:.2} MiB (cache {} MiB); index pages on disk {:.1} MiB per GiB of data (two copies); whole-process heap {:.0} KiB per GiB (other engine state, e.g. the summary cache of up to 128 segments)",
        t0 / MIB as f64,
        t1 / MIB as f64,
        cache / MIB,
        (p1 - p0) / (g1 - g0) / MIB as f64,
        (h1 - h0) / (g1 - g0) / 1024.0
    );
    println!(
        "RESULT index_ram fast_mib_per_gib {:.1} capacity_index_resident_mib_max {:.2} (cache {} MiB, any capacity) capacity_index_disk_mib_per_gib {:.1}",
        fast / MIB as f64,
        tree_max / MIB as f64,
        cache / MIB,
        (p1 - p0) / (g1 - g0) / MIB as f64
    );
    dg.shutdown().map_err(|e| e.to_string())
}

/// STRATA_IO_BACKEND=threads|io_uring picks the device backend (default: auto = io_uring).
fn backend() -> IoBackend {
    match std::env::var("STRATA_IO_BACKEND").as_deref() {
        Ok("threads") => IoBackend::ThreadPool,
        Ok("io_uring") => IoBackend::IoUring,
        _ => IoBackend::Auto,
    }
}

/// With STRATA_BENCH_TRACE set, prints fill, destage and hot-data figures every second.
fn monitor(dg: &DiskGroup, done: &std::sync::atomic::AtomicBool) {
    if std::env::var("STRATA_BENCH_TRACE").is_err() {
        return;
    }
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(500));
        let st = dg.stats();
        eprintln!(
            "fill {:.2} live {} MiB host {} MiB destaged {} MiB kept {} MiB throttled {}",
            st.log_fill_ratio,
            st.fast_resident_bytes / MIB,
            st.host_write_bytes_total / MIB,
            st.destaged_bytes_total / MIB,
            st.hot_kept_bytes_total / MIB,
            st.admission_throttled
        );
    }
}
