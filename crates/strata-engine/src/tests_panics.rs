//! An engine thread that panics takes the group offline: requests fail with the reason
//! instead of hanging or being acknowledged with no thread left to do its part, and what was
//! acknowledged before is still there after a restart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tests::{check_volume, seed_for, small_cfg, Rig, MIB};
use crate::*;

/// How long a test waits for the group to go offline before it calls that a failure.
const OFFLINE_WAIT: Duration = Duration::from_secs(30);

/// Writes one block at a time (on another thread, so a hung write cannot hang the test) until
/// one fails; returns its error and how many were acknowledged, which `model` records.
fn write_until_refused(dg: &Arc<DiskGroup>, vol: VolumeId, model: &mut [u8]) -> EngineError {
    let deadline = Instant::now() + OFFLINE_WAIT;
    for i in 0.. {
        let lba = (i % 256) as usize;
        let data = vec![(i % 251) as u8 + 1; 4096];
        let (tx, rx) = crossbeam_channel::bounded(1);
        let group = dg.clone();
        let block = data.clone();
        std::thread::spawn(move || {
            let _ = tx.send(group.write(vol, lba as u64 * 4096, &block));
        });
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(())) => model[lba * 4096..][..4096].copy_from_slice(&data),
            Ok(Err(e)) => return e,
            Err(_) => panic!("a write had no answer {OFFLINE_WAIT:?} after the thread panicked"),
        }
        assert!(
            Instant::now() < deadline,
            "writes still acknowledged {OFFLINE_WAIT:?} after the thread panicked ({i} of them)"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    unreachable!()
}

fn assert_offline_for_the_panic(e: &EngineError) {
    match e {
        EngineError::Failed(why) => assert!(
            why.contains("panicked") && why.contains("test panic"),
            "the reason does not name the panic: {why}"
        ),
        other => panic!("a write after the panic failed, but not as offline: {other}"),
    }
}

/// A group with a 2 MiB volume written whole (0x5a), and that content.
fn group_with_a_written_volume(test: &str) -> (Rig, VolumeId, Vec<u8>) {
    let rig = Rig::new(32 * MIB, &[64 * MIB], small_cfg(), seed_for(test));
    let vol = rig.dg().create_volume("v", 2 * MIB).unwrap().id;
    let model = vec![0x5a; 2 * MIB as usize];
    rig.dg().write(vol, 0, &model).unwrap();
    (rig, vol, model)
}

#[test]
fn a_destager_that_panics_takes_the_group_offline_and_loses_nothing() {
    let test = "a_destager_that_panics_takes_the_group_offline_and_loses_nothing";
    let (mut rig, vol, mut model) = group_with_a_written_volume(test);
    let fired = AtomicBool::new(false);
    *rig.dg().sh.after_tail_checkpoint.lock() = Some(Box::new(move |_tail| {
        if !fired.swap(true, Ordering::SeqCst) {
            panic!("test panic in the destager");
        }
    }));
    let dg = rig.group().clone();
    std::thread::spawn(move || dg.destage_all(Duration::from_secs(5)));
    let e = write_until_refused(rig.group(), vol, &mut model);
    assert_offline_for_the_panic(&e);
    let stopped = rig.dg().shutdown();
    assert_offline_for_the_panic(&stopped.expect_err("the offline group's shutdown said Ok"));
    rig.power_cut_and_restart();
    check_volume(
        rig.dg(),
        vol,
        &model,
        "v after the destager's panic and a power cut",
    );
}

#[test]
fn a_log_committer_that_panics_takes_the_group_offline_and_loses_nothing() {
    let test = "a_log_committer_that_panics_takes_the_group_offline_and_loses_nothing";
    let (mut rig, vol, mut model) = group_with_a_written_volume(test);
    let fired = AtomicBool::new(false);
    *rig.dg().sh.after_turn_moved.lock() = Some(Arc::new(move |_end| {
        if !fired.swap(true, Ordering::SeqCst) {
            panic!("test panic in a log committer");
        }
    }));
    // The first write's batch is durable when its committer panics: acknowledged or not, it
    // may read back either way, so the model takes the block the restart shows.
    let first = rig.dg().write(vol, 300 * 4096, &[0x77; 4096]);
    assert!(
        first.is_err(),
        "the panicked batch's write was acknowledged"
    );
    let e = write_until_refused(rig.group(), vol, &mut model);
    assert_offline_for_the_panic(&e);
    rig.power_cut_and_restart();
    let mut block = vec![0; 4096];
    rig.dg().read(vol, 300 * 4096, &mut block).unwrap();
    assert!(
        block == [0x77; 4096] || block == [0x5a; 4096],
        "block 300 reads as other data"
    );
    model[300 * 4096..][..4096].copy_from_slice(&block);
    check_volume(
        rig.dg(),
        vol,
        &model,
        "v after a committer's panic and a power cut",
    );
}
