//! Runs of lone writes (FORMAT.md §3.3.1): writes made one at a time on an idle log share a
//! run's two header copies, and a power cut at any device write loses only the write not yet
//! acknowledged.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::tests::{check_volume, seed_for, small_cfg, Rig, MIB};
use crate::*;

fn runs_cfg() -> EngineConfig {
    EngineConfig {
        log_runs: true,
        ..small_cfg()
    }
}

/// A write as a client at queue depth one makes it: on the caller's thread when the log is
/// idle, else through the log writer.
fn lone_write(dg: &Arc<DiskGroup>, v: u32, offset: u64, data: &[u8]) -> Result<(), EngineError> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let done: WriteDone = Box::new(move |r| {
        let _ = tx.send(r);
    });
    if let Err(done) = dg.write_async_alone(v, offset, data, done) {
        done(dg.write(v, offset, data));
    }
    rx.recv_timeout(Duration::from_secs(20))
        .expect("every write is answered")
}

/// After a power cut, the one write that was not answered reads back whole or not at all;
/// the model takes what the volume holds there.
fn settle_unanswered(dg: &DiskGroup, v: u32, model: &mut [u8], w: &(usize, Vec<u8>), what: &str) {
    let (off, data) = w;
    let mut back = vec![0u8; data.len()];
    dg.read(v, *off as u64, &mut back)
        .unwrap_or_else(|e| panic!("{what}: read: {e}"));
    let old = &model[*off..off + data.len()];
    assert!(
        back == *old || back == *data,
        "{what}: the unanswered write at {off}+{} is neither whole nor absent",
        data.len()
    );
    model[*off..off + data.len()].copy_from_slice(&back);
}

/// Power cuts after a random number of device writes, while a client writes one block (or a
/// few) at a time: the writes extend runs, and after every cut each answered write reads
/// back, the unanswered one whole or not at all. Between cuts, clean restarts and destages.
/// The cuts land often enough between a run's header copy and its data (or within either)
/// that replay drops a run's torn last write.
#[test]
fn power_cuts_amid_runs_of_lone_writes_lose_only_the_unanswered_write() {
    let seed = seed_for("power_cuts_amid_runs_of_lone_writes_lose_only_the_unanswered_write");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rig = Rig::new(16 * MIB, &[24 * MIB], runs_cfg(), seed);
    let size = 2 * MIB as usize;
    let v = rig.dg().create_volume("r", size as u64).unwrap().id;
    let mut model = vec![0u8; size];
    let (mut run_writes, mut torn_runs, mut cuts) = (0, 0, 0);
    let mut round = 0;
    // Until a cut has torn a run's last write, and at least 80 rounds.
    while round < 80 || (torn_runs == 0 && round < 1500) {
        let what = format!("seed {seed} round {round}");
        let dg = rig.group().clone();
        if rng.gen_bool(0.3) {
            // Runs then start at the log's tail (and the checkpoint's).
            assert!(dg.destage_all(Duration::from_secs(20)), "{what}: no drain");
        }
        let cut = round % 5 != 4;
        if cut {
            rig.writes_left
                .store(rng.gen_range(0..24), Ordering::SeqCst);
        }
        let mut unanswered = None;
        for _ in 0..rng.gen_range(1..60) {
            let blocks = if rng.gen_bool(0.75) {
                1
            } else {
                rng.gen_range(2..=6)
            };
            let off = rng.gen_range(0..size / 4096 - blocks) * 4096;
            let byte: u8 = rng.gen();
            let data: Vec<u8> = (0..blocks * 4096)
                .map(|i| byte.wrapping_add((i / 512) as u8))
                .collect();
            match lone_write(&dg, v, off as u64, &data) {
                Ok(()) => model[off..off + data.len()].copy_from_slice(&data),
                Err(_) => {
                    unanswered = Some((off, data));
                    break;
                }
            }
        }
        run_writes += dg.stats().log_run_writes_total;
        drop(dg);
        if cut {
            rig.power_cut_and_restart();
            cuts += 1;
        } else {
            assert!(
                unanswered.is_none(),
                "{what}: a write failed without a power cut"
            );
            rig.clean_restart();
        }
        torn_runs += rig.dg().open_report().torn_run_writes;
        if let Some(w) = &unanswered {
            settle_unanswered(rig.dg(), v, &mut model, w, &what);
        }
        check_volume(rig.dg(), v, &model, &format!("{what}: after restart"));
        round += 1;
    }
    eprintln!("seed {seed}: {round} rounds, {cuts} power cuts, {run_writes} writes extended a run, {torn_runs} runs lost a torn last write");
    assert!(
        run_writes > 100,
        "seed {seed}: only {run_writes} writes extended a run"
    );
    assert!(
        torn_runs > 0,
        "seed {seed}: no power cut tore a run's last write"
    );
    assert_eq!(rig.dg().stats().checksum_errors_total, 0, "seed {seed}");
}

/// Lone writes go on while the destager drains the log from another thread, over and over:
/// a run it takes to move is closed first, so no write joins a run the destager has copied
/// (freeing that run would drop the write). Every answered write reads back at once, the
/// whole volume at the end, and again after a power cut.
#[test]
fn lone_writes_racing_a_draining_destager_are_never_lost() {
    let seed = seed_for("lone_writes_racing_a_draining_destager_are_never_lost");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rig = Rig::new(16 * MIB, &[24 * MIB], runs_cfg(), seed);
    let size = MIB as usize;
    let v = rig.dg().create_volume("d", size as u64).unwrap().id;
    let mut model = vec![0u8; size];
    let dg = rig.group().clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let drainer = {
        let (dg, stop) = (dg.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut drains = 0u64;
            while !stop.load(Ordering::Relaxed) {
                dg.destage_all(Duration::from_millis(50));
                drains += 1;
            }
            drains
        })
    };
    let mut back = vec![0u8; 4096];
    for i in 0..6000 {
        let off = rng.gen_range(0..size / 4096) * 4096;
        let data = vec![(i % 251) as u8 + 1; 4096];
        lone_write(&dg, v, off as u64, &data)
            .unwrap_or_else(|e| panic!("seed {seed} write {i}: {e}"));
        model[off..off + 4096].copy_from_slice(&data);
        dg.read(v, off as u64, &mut back).unwrap();
        assert!(
            back == data,
            "seed {seed} write {i} at {off} does not read back"
        );
        if i % 1000 == 999 {
            check_volume(&dg, v, &model, &format!("seed {seed} after write {i}"));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let drains = drainer.join().expect("drainer");
    let st = dg.stats();
    eprintln!(
        "seed {seed}: {drains} drains, {} writes extended a run, {} bytes destaged",
        st.log_run_writes_total, st.destaged_bytes_total
    );
    assert!(
        st.log_run_writes_total > 500,
        "seed {seed}: runs hardly formed: {st:?}"
    );
    assert!(st.destaged_bytes_total > 0, "seed {seed}: nothing destaged");
    drop(dg);
    rig.power_cut_and_restart();
    check_volume(
        rig.dg(),
        v,
        &model,
        &format!("seed {seed}: after power cut"),
    );
}
