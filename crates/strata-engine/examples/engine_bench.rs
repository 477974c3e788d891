//! In-process benchmarks of the tier engine (run through bench/engine.sh).
//!
//!   engine_bench qd32      DIR [rounds]        4 KiB random write/read at QD32 vs raw io_uring
//!   engine_bench saturate  DIR [secs] [MB/s]   sustained random write once the log is full,
//!                                              vs the capacity device's sequential bandwidth
//!   engine_bench hotset    DIR                 hot set of half the fast tier written 10 times
//!   engine_bench index-ram                     bytes of RAM the index needs
//!
//! Every figure is printed with the baseline measured in the same run and their ratio.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_device::{open_with, raw_random_io, Device, IoBackend, OpenOptions, ThrottleConfig, Throttled};
use strata_engine::{DiskGroup, EngineConfig, ExtentMap, Loc};

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
    let dir = args.get(2).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-engine"));
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let result = match cmd {
        "qd32" => qd32(&dir, arg(3, 3)),
        "saturate" => saturate(&dir, arg(3, 20), arg(4, 200)),
        "hotset" => hotset(&dir),
        "index-ram" => {
            index_ram();
            Ok(())
        }
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

fn fresh_group(dir: &Path, fast: u64, cap: u64, cap_mb_s: u64, cfg: EngineConfig) -> Result<Rig, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let fast_path = dir.join("fast.img");
    let cap_path = dir.join("capacity.img");
    for p in [&fast_path, &cap_path] {
        let _ = std::fs::remove_file(p);
    }
    let f = open_with(&fast_path, &OpenOptions { create_size_bytes: Some(fast), preallocate: true, backend: backend() }).map_err(|e| e.to_string())?;
    let c = open_with(&cap_path, &OpenOptions { create_size_bytes: Some(cap), preallocate: false, backend: backend() }).map_err(|e| e.to_string())?;
    let cap: Arc<dyn Device> = if cap_mb_s > 0 {
        Arc::new(Throttled::new(c, ThrottleConfig { bandwidth_bytes_per_s: cap_mb_s * 1_000_000, ..Default::default() }))
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

fn qd32(dir: &Path, rounds: u64) -> Result<(), String> {
    let ops = 32_768u64;
    let vol_bytes = 128 * MIB;
    let mut rows = Vec::new();
    for round in 0..rounds {
        let rig = fresh_group(dir, GIB, 8 * GIB, 0, EngineConfig::default())?;
        let dg = rig.dg.clone();
        let v = dg.create_volume("bench", vol_bytes).map_err(|e| e.to_string())?.id;
        let chunk = vec![0x5au8; MIB as usize];
        for i in 0..vol_bytes / MIB {
            dg.write(v, i * MIB, &chunk).map_err(|e| e.to_string())?;
        }
        let blocks = vol_bytes / 4096;
        let w = parallel(32, ops / 32, |rng| {
            let b = rng.gen_range(0..blocks);
            dg.write(v, b * 4096, &[0xa5; 4096]).expect("engine write");
        });
        let r = parallel(32, ops / 32, |rng| {
            let b = rng.gen_range(0..blocks);
            let mut buf = [0u8; 4096];
            dg.read(v, b * 4096, &mut buf).expect("engine read");
        });
        let st = dg.stats();
        dg.shutdown().map_err(|e| e.to_string())?;
        drop(dg);
        drop(rig.dg);
        let raw_w = raw_random_io(&rig.fast_path, 4096, 32, ops, true, round).map_err(|e| e.to_string())?;
        let raw_r = raw_random_io(&rig.fast_path, 4096, 32, ops, false, round).map_err(|e| e.to_string())?;
        let ew = ops as f64 / w.as_secs_f64();
        let er = ops as f64 / r.as_secs_f64();
        println!(
            "round {round}: write engine {ew:.0} IOPS raw {:.0} IOPS ratio {:.2} | read engine {er:.0} IOPS raw {:.0} IOPS ratio {:.2} | destaged {} MiB",
            raw_w.ops_per_s,
            ew / raw_w.ops_per_s,
            raw_r.ops_per_s,
            er / raw_r.ops_per_s,
            st.destaged_bytes_total / MIB
        );
        rows.push((ew / raw_w.ops_per_s, er / raw_r.ops_per_s));
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "RESULT qd32 write_ratio_median {:.2} read_ratio_median {:.2} (target >= 0.85 each)",
        med(rows.iter().map(|r| r.0).collect()),
        med(rows.iter().map(|r| r.1).collect())
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
        rig.cap.write_at(&buf, base + i * 8 * MIB).map_err(|e| e.to_string())?;
    }
    rig.cap.flush().map_err(|e| e.to_string())?;
    let seq_bw = probe as f64 / t.elapsed().as_secs_f64();
    let dg = rig.dg.clone();
    let vol_bytes = 4 * GIB;
    let v = dg.create_volume("sat", vol_bytes).map_err(|e| e.to_string())?.id;
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
            let now = (start.elapsed().as_secs_f64(), written.load(Ordering::Relaxed), st.log_fill_ratio);
            samples.push(now);
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
    let fmin = fills.iter().cloned().fold(1.0, f64::min);
    let fmax = fills.iter().cloned().fold(0.0, f64::max);
    println!(
        "capacity device: file on the same filesystem, throttled to {cap_mb_s} MB/s (token bucket in the device layer); sequential write {:.1} MB/s",
        seq_bw / 1e6
    );
    println!(
        "saturated for {:.0} s: host 4 KiB random write {:.1} MB/s ({:.0} IOPS), log fill {:.2}..{:.2}, destaged {} MiB",
        t1 - t0,
        host / 1e6,
        host / 4096.0,
        fmin,
        fmax,
        st.destaged_bytes_total / MIB
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

/// Builds index maps of known shape and measures their heap bytes.
fn index_ram() {
    let measure = |f: &dyn Fn() -> ExtentMap| {
        let before = HEAP.load(Ordering::Relaxed);
        let m = f();
        let bytes = HEAP.load(Ordering::Relaxed) - before;
        (bytes as f64, m.run_count())
    };
    // Fast tier: 1 GiB of the log holding random 4 KiB writes, one entry each (worst case).
    let blocks = GIB / 4096;
    let (fast, runs) = measure(&|| {
        let mut m = ExtentMap::default();
        let mut rng = SmallRng::seed_from_u64(1);
        for i in 0..blocks {
            m.set(rng.gen_range(0..1u64 << 40) * 2, 1, Some(Loc::Fast(i)));
        }
        m
    });
    let crcs = blocks as f64 * 4.0;
    println!(
        "fast tier, 1 GiB of random 4 KiB writes: {runs} runs, {:.1} MiB index + {:.1} MiB block crcs = {:.1} MiB per GiB",
        fast / MIB as f64,
        crcs / MIB as f64,
        (fast + crcs) / MIB as f64
    );
    // Capacity tier written sequentially: one run per 8 MiB segment. Measured on 64 GiB.
    let segs = 64 * GIB / (8 * MIB);
    let (seq, runs) = measure(&|| {
        let mut m = ExtentMap::default();
        for s in 0..segs {
            m.set(s * 2044, 2044, Some(Loc::Cap { seg: s as u32, block: 0 }));
        }
        m
    });
    println!(
        "capacity tier, sequentially written: {runs} runs for 64 GiB -> {:.1} MiB per TiB",
        seq * 16.0 / MIB as f64
    );
    // Capacity tier holding random 4 KiB writes destaged in address order per segment: the
    // worst case, one run per block. Measured on 4 GiB, scaled to 1 TiB.
    let (rnd, runs) = measure(&|| {
        let mut m = ExtentMap::default();
        for i in 0..4 * GIB / 4096 {
            m.set(i * 2, 1, Some(Loc::Cap { seg: (i / 2044) as u32, block: (i % 2044) as u32 }));
        }
        m
    });
    println!(
        "capacity tier, random 4 KiB writes (no two adjacent): {runs} runs for 4 GiB -> {:.1} GiB per TiB (NOT bounded: see docs/BENCHMARKS.md)",
        rnd * 256.0 / GIB as f64
    );
    println!(
        "RESULT index_ram fast_mib_per_gib {:.1} capacity_seq_mib_per_tib {:.1} capacity_random4k_gib_per_tib {:.1}",
        (fast + crcs) / MIB as f64,
        seq * 16.0 / MIB as f64,
        rnd * 256.0 / GIB as f64
    );
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
        std::thread::sleep(Duration::from_secs(1));
        let st = dg.stats();
        eprintln!(
            "fill {:.2} host {} MiB destaged {} MiB kept {} MiB throttled {}",
            st.log_fill_ratio,
            st.host_write_bytes_total / MIB,
            st.destaged_bytes_total / MIB,
            st.hot_kept_bytes_total / MIB,
            st.admission_throttled
        );
    }
}
