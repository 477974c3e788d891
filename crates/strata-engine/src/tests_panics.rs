//! An engine thread that panics takes the group offline: requests fail with the reason
//! instead of hanging or being acknowledged with no thread left to do its part, and what was
//! acknowledged before is still there after a restart.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tests::{check_volume, seed_for, small_cfg, Rig, MIB};
use crate::*;

/// How long a test waits for the group to go offline before it calls that a failure.
const OFFLINE_WAIT: Duration = Duration::from_secs(30);

/// A write that failed: its error, and its block and byte (a write refused while in flight
/// may be durable, and may read back after a restart: `take_either`).
struct Refused {
    error: EngineError,
    lba: usize,
    byte: u8,
}

/// Writes one block at a time to `blocks` (on another thread, so a hung write cannot hang the
/// test) until one fails, which it returns; `model` records the acknowledged writes.
fn write_until_refused(
    dg: &Arc<DiskGroup>,
    vol: VolumeId,
    model: &mut [u8],
    blocks: Range<usize>,
) -> Refused {
    let deadline = Instant::now() + OFFLINE_WAIT;
    for i in 0.. {
        let lba = blocks.start + i % blocks.len();
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
            Ok(Err(error)) => {
                let byte = data[0];
                return Refused { error, lba, byte };
            }
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

/// Four threads that wait for `go`, then each write their own 16 blocks (from block 320)
/// until refused, as `write_until_refused`. `join_writers` takes their results.
fn start_writers(
    dg: &Arc<DiskGroup>,
    vol: VolumeId,
    model: &[u8],
    go: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<(Refused, Vec<u8>)>> {
    (0..4)
        .map(|k| {
            let (dg, go, mut model) = (dg.clone(), go.clone(), model.to_vec());
            std::thread::spawn(move || {
                while !go.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let e = write_until_refused(&dg, vol, &mut model, 320 + 16 * k..336 + 16 * k);
                (e, model)
            })
        })
        .collect()
}

/// Checks that every writer of `start_writers` was refused because of the panic, puts the
/// blocks each had acknowledged in `model`, and returns the refused writes.
fn join_writers(
    writers: Vec<std::thread::JoinHandle<(Refused, Vec<u8>)>>,
    model: &mut [u8],
) -> Vec<Refused> {
    let mut refused = Vec::new();
    for (k, w) in writers.into_iter().enumerate() {
        let (r, theirs) = w.join().expect("a writer failed");
        assert_offline_for_the_panic(&r.error);
        let own = (320 + 16 * k) * 4096..(336 + 16 * k) * 4096;
        model[own.clone()].copy_from_slice(&theirs[own]);
        refused.push(r);
    }
    refused
}

/// After a panic while block 300 (0x77) was being written, with `writers` writing behind
/// it: each writer and a new write are refused for the panic; after a power cut every block
/// holds what was acknowledged, or what a refused write in flight wrote (`take_either`).
fn offline_then_checked_after_a_power_cut(
    rig: &mut Rig,
    vol: VolumeId,
    mut model: Vec<u8>,
    writers: Vec<std::thread::JoinHandle<(Refused, Vec<u8>)>>,
    after: &str,
) {
    let in_flight = join_writers(writers, &mut model);
    let e = write_until_refused(rig.group(), vol, &mut model, 0..256);
    assert_offline_for_the_panic(&e.error);
    rig.power_cut_and_restart();
    take_either(rig, vol, &mut model, 300, 0x77);
    for r in in_flight {
        take_either(rig, vol, &mut model, r.lba, r.byte);
    }
    check_volume(
        rig.dg(),
        vol,
        &model,
        &format!("v after {after} and a power cut"),
    );
}

/// The answer of the write whose batch a thread panicked with: offline, for a panic (its
/// message is the group's reason; the thread that had the write only knows it panicked).
fn assert_answered_for_the_panic(r: Result<(), EngineError>) {
    match r {
        Ok(()) => panic!("the panicked batch's write was acknowledged"),
        Err(EngineError::Failed(why)) => assert!(
            why.contains("panicked"),
            "the panicked batch's write does not say a thread panicked: {why}"
        ),
        Err(other) => panic!("the panicked batch's write failed, but not as offline: {other}"),
    }
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
    let e = write_until_refused(rig.group(), vol, &mut model, 0..256);
    assert_offline_for_the_panic(&e.error);
    let stopped = rig.dg().shutdown();
    assert_offline_for_the_panic(&stopped.expect_err("the offline group's shutdown said Ok"));
    rig.power_cut_and_restart();
    // The refused write may have been in flight when the group went offline: durable, not
    // acknowledged (seen once in a full run: its block read back written after the restart).
    take_either(&rig, vol, &mut model, e.lba, e.byte);
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
    // The first write's batch is durable when its committer panics (`take_either`).
    let first = rig.dg().write(vol, 300 * 4096, &[0x77; 4096]);
    assert_answered_for_the_panic(first);
    let e = write_until_refused(rig.group(), vol, &mut model, 0..256);
    assert_offline_for_the_panic(&e.error);
    rig.power_cut_and_restart();
    take_either(&rig, vol, &mut model, 300, 0x77);
    // As the first write, the refused one may have reached a batch that was durable before
    // the group went offline (seen once in a full run: block 0 read back written).
    take_either(&rig, vol, &mut model, e.lba, e.byte);
    check_volume(
        rig.dg(),
        vol,
        &model,
        "v after a committer's panic and a power cut",
    );
}

/// After the restart, block `lba` must read as `model` says or as the failed write of `byte`
/// that was in flight when a thread panicked (not acknowledged, but perhaps durable); `model`
/// takes what it reads.
fn take_either(rig: &Rig, vol: VolumeId, model: &mut [u8], lba: usize, byte: u8) {
    let mut block = vec![0; 4096];
    rig.dg().read(vol, lba as u64 * 4096, &mut block).unwrap();
    let was = &mut model[lba * 4096..][..4096];
    assert!(
        block == [byte; 4096] || block == *was,
        "block {lba} reads as other data"
    );
    was.copy_from_slice(&block);
}

#[test]
fn a_panic_while_a_batch_is_applied_takes_the_group_offline_and_loses_nothing() {
    let test = "a_panic_while_a_batch_is_applied_takes_the_group_offline_and_loses_nothing";
    let (mut rig, vol, model) = group_with_a_written_volume(test);
    // The panic comes before the committer moves the turn on, while other writers' batches
    // are written behind it: they must not wait for that turn for ever.
    let go = Arc::new(AtomicBool::new(false));
    let writers = start_writers(rig.group(), vol, &model, &go);
    let fired = AtomicBool::new(false);
    let start = go.clone();
    *rig.dg().sh.before_apply.lock() = Some(Arc::new(move |_first| {
        if !fired.swap(true, Ordering::SeqCst) {
            start.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            panic!("test panic while applying a batch");
        }
    }));
    let first = rig.dg().write(vol, 300 * 4096, &[0x77; 4096]);
    assert_answered_for_the_panic(first);
    offline_then_checked_after_a_power_cut(&mut rig, vol, model, writers, "a panic in apply");
}

#[test]
fn a_write_made_on_its_senders_thread_that_panics_takes_the_group_offline() {
    let test = "a_write_made_on_its_senders_thread_that_panics_takes_the_group_offline";
    let (mut rig, vol, model) = group_with_a_written_volume(test);
    // Only a batch retired on this thread panics: the write made inline, not by a committer;
    // other writers' batches are written behind it meanwhile.
    let go = Arc::new(AtomicBool::new(false));
    let writers = start_writers(rig.group(), vol, &model, &go);
    let me = std::thread::current().id();
    let start = go.clone();
    *rig.dg().sh.before_apply.lock() = Some(Arc::new(move |_first| {
        if std::thread::current().id() == me {
            start.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            panic!("test panic in an inline write");
        }
    }));
    let deadline = Instant::now() + OFFLINE_WAIT;
    let answer = loop {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let done: WriteDone = Box::new(move |r| {
            let _ = tx.send(r);
        });
        // Refused (the log was busy): the caller would write it on its blocking path; here
        // it is tried again until the log is idle and it is written inline.
        if rig
            .group()
            .write_async_alone(vol, 300 * 4096, &[0x77; 4096], done)
            .is_ok()
        {
            break rx.try_recv().expect("an inline write returned unanswered");
        }
        assert!(Instant::now() < deadline, "the write was never made inline");
        std::thread::sleep(Duration::from_millis(10));
    };
    match &answer {
        Err(EngineError::Failed(why)) => assert!(
            why.contains("sender's thread panicked") && why.contains("test panic"),
            "the inline write's answer does not name the panic: {why}"
        ),
        other => panic!("the inline write that panicked was answered {other:?}"),
    }
    offline_then_checked_after_a_power_cut(
        &mut rig,
        vol,
        model,
        writers,
        "an inline write's panic",
    );
}
