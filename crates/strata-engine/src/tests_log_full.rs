//! Host writes waiting for room in a full log are answered when the group fails or shuts down
//! (they used to wait for ever: nothing frees the log then).

use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::tests::{seed_for, small_cfg, Rig, MIB};
use crate::*;

/// Holds the destager and writes until the log is full and a write waits for room; returns
/// the channel the writing thread reports each write's result on.
fn fill_until_a_write_waits(dg: &Arc<DiskGroup>) -> mpsc::Receiver<Result<(), EngineError>> {
    let v = dg.create_volume("v", MIB).unwrap().id;
    dg.sh.hold_destager();
    let (tx, rx) = mpsc::channel();
    let writer = dg.clone();
    std::thread::spawn(move || {
        let chunk = vec![7u8; 63 * 4096];
        loop {
            let r = writer.write(v, 0, &chunk);
            let failed = r.is_err();
            let _ = tx.send(r);
            if failed {
                return;
            }
        }
    });
    loop {
        match rx.recv_timeout(Duration::from_millis(1000)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("a write failed before the log filled: {e}"),
            Err(_) => break,
        }
    }
    let log = dg.sh.log.lock();
    // Full for host writes: no room for a whole batch besides the blocks kept for trims and
    // for rotation.
    let batch = crate::log::max_batch_blocks(dg.sh.cfg.max_batch_bytes);
    assert!(
        log.log_blocks - log.used_blocks <= batch + 1 + log.kept_free(true, false),
        "a write waits, but the log is not full: {} of {} blocks used",
        log.used_blocks,
        log.log_blocks
    );
    drop(log);
    rx
}

#[test]
fn a_failed_group_answers_the_host_writes_waiting_for_log_room() {
    let rig = Rig::new(
        32 * MIB,
        &[64 * MIB],
        small_cfg(),
        seed_for("a_failed_group_answers_the_host_writes_waiting_for_log_room"),
    );
    let dg = rig.group().clone();
    let rx = fill_until_a_write_waits(&dg);
    dg.sh.fail("the test fails the group".into());
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Err(_)) => {}
        other => panic!("the waiting write was not answered 10 s after the failure: {other:?}"),
    }
}

#[test]
fn a_shutdown_with_host_writes_waiting_for_log_room_returns() {
    let rig = Rig::new(
        32 * MIB,
        &[64 * MIB],
        small_cfg(),
        seed_for("a_shutdown_with_host_writes_waiting_for_log_room_returns"),
    );
    let dg = rig.group().clone();
    let rx = fill_until_a_write_waits(&dg);
    let (done_tx, done_rx) = mpsc::channel();
    let stopping = dg.clone();
    std::thread::spawn(move || {
        let _ = done_tx.send(stopping.shutdown());
    });
    let shut = done_rx.recv_timeout(Duration::from_secs(15));
    assert!(shut.is_ok(), "shutdown had not returned after 15 s");
    // Answered: written if it fit once host writes stopped leaving room for the destager's,
    // refused otherwise (never acknowledged, so nothing is lost).
    match rx.recv_timeout(Duration::from_secs(1)) {
        Ok(Ok(())) | Ok(Err(EngineError::ShuttingDown)) => {}
        other => panic!("the waiting write: {other:?}"),
    }
}
