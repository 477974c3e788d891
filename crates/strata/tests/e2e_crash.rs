//! Crash consistency: SIGKILL the daemon again and again while real clients (qemu-io) write,
//! restart it, and check that every write a client saw complete reads back intact.
//!
//! Each worker thread owns a few regions and rewrites one region per qemu-io process, as a
//! burst of concurrent aio_writes of mixed sizes followed by a flush. A region's write is
//! acknowledged when that process reports every chunk written and the flush succeeded. At a
//! seeded random moment the daemon is killed. After the restart each region must read back as
//! what was last acknowledged; a region whose write was in flight may hold, byte by byte,
//! either that or the in-flight pattern, and nothing else, except that every chunk of it the
//! daemon replied to (qemu-io printed `wrote`) must hold the new pattern: a reply means
//! durable, flush or not. Bytes outside regions stay zero.
use crate::common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const VOLUME: &str = "crash";
const VOLUME_BYTES: u64 = 16 * MIB;
const WORKERS: usize = 4;
const REGIONS_PER_WORKER: usize = 4;
const REGION_STRIDE_BYTES: u64 = MIB;
const REGION_BYTES: usize = 256 * 1024;
const ROUNDS: u64 = 10;
const CHUNK_SIZES_BYTES: [usize; 6] = [512, 1024, 3584, 4096, 8192, 65536];
const FIRST_ACK_TIMEOUT: Duration = Duration::from_secs(20);
const TEST_BUDGET: Duration = Duration::from_secs(120);

#[derive(Clone)]
struct Region {
    offset: u64,
    /// Exact content while nothing is in flight.
    known: Vec<u8>,
    /// Pattern of a write that was in flight when the daemon died: it may have landed in part.
    in_flight: Option<u8>,
    /// Chunks of that write the daemon replied to (offset in the region, length): they must
    /// have landed, since a reply means durable.
    in_flight_acked: Vec<(usize, usize)>,
}

impl Region {
    /// The bytes of the in-flight write that a reply made durable.
    fn acked_in_flight(&self) -> Vec<bool> {
        let mut acked = vec![false; REGION_BYTES];
        for &(start, len) in &self.in_flight_acked {
            acked[start..start + len].fill(true);
        }
        acked
    }

    /// The first byte that is neither acknowledged content nor, where no reply said it
    /// landed, the in-flight pattern.
    fn first_bad_byte(&self, actual: &[u8]) -> Option<usize> {
        let acked = self.acked_in_flight();
        (0..REGION_BYTES).find(|&i| match self.in_flight {
            Some(p) if acked[i] => actual[i] != p,
            Some(p) => actual[i] != self.known[i] && actual[i] != p,
            None => actual[i] != self.known[i],
        })
    }
}

/// One qemu-io process rewriting `region` with `pattern`, as concurrent chunks.
fn region_write(uri: &str, region: &Region, pattern: u8, rng: &mut SmallRng) -> (Command, usize) {
    chunked_write(
        uri,
        region.offset,
        REGION_BYTES,
        &CHUNK_SIZES_BYTES,
        pattern,
        rng,
    )
}

struct Load {
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicUsize>,
}

fn worker(uri: String, mut regions: Vec<Region>, seed: u64, load: Load) -> Vec<Region> {
    let mut rng = SmallRng::seed_from_u64(seed);
    while !load.stop.load(Ordering::SeqCst) {
        let i = rng.gen_range(0..regions.len());
        let old = regions[i].known[0];
        let pattern = loop {
            let p: u8 = rng.gen_range(1..=255);
            if p != old {
                break p;
            }
        };
        let (mut command, chunks) = region_write(&uri, &regions[i], pattern, &mut rng);
        regions[i].in_flight = Some(pattern);
        let out = run_timeout(&mut command, CMD_TIMEOUT);
        let region_offset = regions[i].offset;
        regions[i].in_flight_acked = wrote_ranges(&out)
            .into_iter()
            .map(|(offset, len)| ((offset - region_offset) as usize, len))
            .collect();
        if acknowledged(&out, chunks) {
            regions[i].known = vec![pattern; REGION_BYTES];
            regions[i].in_flight = None;
            regions[i].in_flight_acked.clear();
            load.acks.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        assert!(
            load.stop.load(Ordering::SeqCst),
            "a client failed while the daemon was up\n{}",
            output_report(&describe(&command), &out)
        );
        break;
    }
    regions
}

/// Runs the load until a random moment after the first acknowledged write, then kills the
/// daemon under it. Returns the regions' state as the clients saw it.
fn round_under_load(
    daemon: &mut Daemon,
    regions: Vec<Region>,
    rng: &mut SmallRng,
) -> (Vec<Region>, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let acks = Arc::new(AtomicUsize::new(0));
    let uri = daemon.nbd_uri(VOLUME);
    let workers: Vec<_> = regions
        .chunks(REGIONS_PER_WORKER)
        .map(|mine| {
            let load = Load {
                stop: stop.clone(),
                acks: acks.clone(),
            };
            let (uri, mine, seed) = (uri.clone(), mine.to_vec(), rng.gen());
            thread::spawn(move || worker(uri, mine, seed, load))
        })
        .collect();
    let first_ack = wait_until(FIRST_ACK_TIMEOUT, || acks.load(Ordering::SeqCst) > 0);
    thread::sleep(Duration::from_millis(rng.gen_range(50..1200)));
    stop.store(true, Ordering::SeqCst);
    daemon.kill9();
    let mut after = Vec::new();
    for w in workers {
        match w.join() {
            Ok(regions) => after.extend(regions),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    assert!(first_ack, "no write completed within {FIRST_ACK_TIMEOUT:?}");
    (after, acks.load(Ordering::SeqCst))
}

/// The whole test volume, read with nbdcopy.
fn read_volume(daemon: &Daemon) -> Vec<u8> {
    let image = daemon.scratch_dir().join("readback.raw");
    let _ = std::fs::remove_file(&image);
    run_ok(
        &mut cmd(
            "nbdcopy",
            &[&daemon.nbd_uri(VOLUME), image.to_str().expect("utf-8")],
        ),
        CMD_TIMEOUT,
    );
    std::fs::read(&image).expect("read back")
}

/// Reads the whole volume with nbdcopy and checks every region and the gaps between them.
fn verify(daemon: &Daemon, regions: &mut [Region], round: u64) {
    let listing = daemon.cli_ok(&["volume", "list"]);
    assert!(
        listing.contains(VOLUME),
        "round {round}: volume {VOLUME:?} is gone after the restart:\n{listing}"
    );
    let data = read_volume(daemon);
    assert_eq!(
        data.len() as u64,
        VOLUME_BYTES,
        "round {round}: volume size changed"
    );

    let mut expected_zero = vec![true; data.len()];
    for (r, region) in regions.iter_mut().enumerate() {
        let start = region.offset as usize;
        let actual = &data[start..start + REGION_BYTES];
        expected_zero[start..start + REGION_BYTES].fill(false);
        if let Some(i) = region.first_bad_byte(actual) {
            let sector = i / 512;
            panic!(
                "round {round}: region {r} (offset {}) byte {i} (sector {sector}) reads {:#04x}; acknowledged content \
                 there is {:#04x}, write in flight at the kill: {:?}, its chunk there replied: {}",
                region.offset, actual[i], region.known[i], region.in_flight, region.acked_in_flight()[i]
            );
        }
        region.known.copy_from_slice(actual);
        region.in_flight = None;
        region.in_flight_acked.clear();
    }
    if let Some(i) = data
        .iter()
        .zip(&expected_zero)
        .position(|(&b, &z)| z && b != 0)
    {
        panic!(
            "round {round}: byte {i}, outside every region, reads {:#04x} instead of 0",
            data[i]
        );
    }
}

#[test]
fn acknowledged_writes_survive_sigkill_under_load() {
    if !require_tools(&["qemu-io", "nbdcopy"]) {
        return;
    }
    let started = Instant::now();
    let seed = test_seed("acknowledged_writes_survive_sigkill_under_load");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut daemon = Daemon::start_default();
    daemon.create_volume(VOLUME, "16M");
    let mut regions: Vec<Region> = (0..WORKERS * REGIONS_PER_WORKER)
        .map(|r| Region {
            offset: r as u64 * REGION_STRIDE_BYTES,
            known: vec![0; REGION_BYTES],
            in_flight: None,
            in_flight_acked: Vec::new(),
        })
        .collect();

    let mut total_acks = 0;
    for round in 1..=ROUNDS {
        let (after, acks) = round_under_load(&mut daemon, regions, &mut rng);
        regions = after;
        total_acks += acks;
        let in_flight = regions.iter().filter(|r| r.in_flight.is_some()).count();
        eprintln!(
            "round {round}: {acks} region writes acknowledged, {in_flight} in flight at SIGKILL"
        );
        daemon.restart();
        verify(&daemon, &mut regions, round);
        assert!(
            started.elapsed() < TEST_BUDGET,
            "crash test over budget after round {round}"
        );
    }
    // A clean shutdown keeps everything too.
    daemon.terminate();
    daemon.restart();
    verify(&daemon, &mut regions, ROUNDS + 1);
    eprintln!(
        "{ROUNDS} crashes, {total_acks} acknowledged region writes verified in {:?}",
        started.elapsed()
    );
}

const LONE_VOLUME_BYTES: u64 = 4 * MIB;
const LONE_WRITES_PER_ROUND: usize = 5000;
const LONE_ROUNDS: u64 = 5;

/// The run counter on the daemon's metrics page (0 when it cannot be read).
fn run_writes(daemon: &Daemon) -> u64 {
    let page = common::http::get(&format!("{}/metrics", daemon.http_url())).body;
    page.lines()
        .find_map(|l| l.strip_prefix("strata_log_run_writes_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Client writes the daemon has served on the test volume (0 when the counter cannot be read).
fn writes_served(daemon: &Daemon) -> u64 {
    let page = common::http::get(&format!("{}/metrics", daemon.http_url())).body;
    let series = format!("strata_volume_write_operations_total{{volume=\"{VOLUME}\"}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// With `--log-runs`, one client writing one 4 KiB block at a time (qemu-io's synchronous
/// `write`, so queue depth one) extends runs of the log. SIGKILL after a random number of them
/// were served, while qemu-io still writes: after the restart every write qemu-io reported
/// done reads back, and the write in flight at the kill reads back whole or not at all.
#[test]
fn acknowledged_lone_writes_in_runs_of_the_log_survive_sigkill() {
    if !require_tools(&["qemu-io", "nbdcopy"]) {
        return;
    }
    let seed = test_seed("acknowledged_lone_writes_in_runs_of_the_log_survive_sigkill");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--log-runs".into()],
        ..DaemonOpts::default()
    });
    daemon.create_volume(VOLUME, "4M");
    let blocks = (LONE_VOLUME_BYTES / 4096) as usize;
    let mut model = vec![0u8; LONE_VOLUME_BYTES as usize];
    let (mut runs, mut acked) = (0, 0);
    for round in 1..=LONE_ROUNDS {
        let writes: Vec<(usize, u8)> = (0..LONE_WRITES_PER_ROUND)
            .map(|_| (rng.gen_range(0..blocks), rng.gen_range(1..=255)))
            .collect();
        let commands: Vec<String> = writes
            .iter()
            .map(|(b, p)| format!("write -P {p} {} 4096", b * 4096))
            .collect();
        let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
        let mut command = qemu_io_cmd(&daemon.nbd_uri(VOLUME), &commands);
        let client = thread::spawn(move || run_timeout(&mut command, CMD_TIMEOUT));
        // Kill once the daemon has served a random number of the writes, not after a random
        // time: on a fast machine qemu-io could be done by then, and the round would test no
        // crash at all.
        let kill_after = rng.gen_range(1..=LONE_WRITES_PER_ROUND as u64 * 3 / 4);
        wait_until(CMD_TIMEOUT, || {
            client.is_finished() || writes_served(&daemon) >= kill_after
        });
        runs += run_writes(&daemon);
        daemon.kill9();
        let out = client.join().expect("client thread");
        let stdout = String::from_utf8_lossy(&out.stdout);
        // Synchronous writes complete in order: the first `done` were acknowledged.
        let done = stdout.lines().filter(|l| l.starts_with("wrote ")).count();
        assert!(
            done < writes.len(),
            "seed {seed} round {round}: the kill came after qemu-io wrote all {done} blocks (waiting for {kill_after} served writes), so no write was in flight\n{}",
            output_report("qemu-io", &out)
        );
        for &(b, p) in &writes[..done] {
            model[b * 4096..(b + 1) * 4096].fill(p);
        }
        acked += done;
        daemon.restart();
        let data = read_volume(&daemon);
        let in_flight = writes.get(done).copied();
        for b in 0..blocks {
            let at = b * 4096..(b + 1) * 4096;
            let (got, want) = (&data[at.clone()], &model[at]);
            if got == want {
                continue;
            }
            let whole_in_flight =
                in_flight.is_some_and(|(fb, p)| fb == b && got.iter().all(|&x| x == p));
            assert!(
                whole_in_flight,
                "seed {seed} round {round}: block {b} reads {:#04x}.., acknowledged {:#04x}.. (in flight at the kill: {in_flight:?}; {done} writes done)",
                got[0], want[0]
            );
            model[b * 4096..(b + 1) * 4096].copy_from_slice(got);
        }
    }
    eprintln!("seed {seed}: {acked} acknowledged writes verified over {LONE_ROUNDS} kills; {runs} writes extended a run");
    assert!(acked > 0, "seed {seed}: no write was acknowledged");
    assert!(runs > 0, "seed {seed}: no write extended a run of the log");
}
