//! The figures `stats` gives an administrator, held to what their names promise: the destage
//! backlog counts live data only, and admission is not reported open while the log above its
//! high mark holds writes back (after a power cut too, before any rate is measured).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tests::{seed_for, small_cfg, Rig, MIB};
use crate::*;

/// The log's use splits into live data, dead data and cached copies, whatever is in it.
fn check_split(st: &EngineStats) {
    assert_eq!(
        st.destage_backlog_bytes + st.log_dead_bytes + st.read_cache_log_bytes,
        st.log_used_bytes,
        "{st:?}"
    );
}

/// Writes 64 KiB at a time from `off` until the fill is above the high mark; returns where it
/// stopped. The destager must be held.
fn fill_past_high_mark(dg: &DiskGroup, v: VolumeId, mut off: u64) -> u64 {
    let high = dg.stats().fill_ratio_high;
    while dg.stats().log_fill_ratio <= high {
        dg.write(v, off, &[0x5a; 64 * 1024]).unwrap();
        off += 64 * 1024;
    }
    off
}

/// A group of a 16 MiB fast device and a 64 MiB capacity device, seeded for `test`, with
/// its destager held (nothing leaves the log unless the test lets it), and the group.
fn held_rig(test: &str) -> (Rig, Arc<DiskGroup>) {
    let rig = Rig::new(16 * MIB, &[64 * MIB], small_cfg(), seed_for(test));
    let dg = rig.group().clone();
    dg.sh.hold_destager();
    (rig, dg)
}

/// The backlog is what the destager still has to write to the capacity tier: data overwritten,
/// trimmed or deleted leaves it, though it stays in the log (and in its fill) until the tail
/// passes it. (The backlog counted every block the log's batches held: after the only volume
/// was deleted it stayed at what the log held, 64.9 MiB in one report, until new writes came.)
#[test]
fn the_backlog_counts_live_data_not_data_overwritten_trimmed_or_deleted() {
    let (mut rig, dg) =
        held_rig("the_backlog_counts_live_data_not_data_overwritten_trimmed_or_deleted");
    let v = dg.create_volume("v", 8 * MIB).unwrap().id;
    let keep = dg.create_volume("keep", 8 * MIB).unwrap().id;
    dg.write(v, 0, &vec![0x11; 2 * MIB as usize]).unwrap();
    dg.write(keep, 0, &vec![0x22; MIB as usize]).unwrap();
    let st = dg.stats();
    check_split(&st);
    assert_eq!(st.destage_backlog_bytes, 3 * MIB, "{st:?}");
    // Overwritten: the old copy is dead, the backlog the same, the log fuller.
    dg.write(v, 0, &vec![0x33; 2 * MIB as usize]).unwrap();
    let st = dg.stats();
    check_split(&st);
    assert_eq!(st.destage_backlog_bytes, 3 * MIB, "{st:?}");
    assert!(st.log_dead_bytes >= 2 * MIB, "{st:?}");
    // Half of it trimmed.
    dg.discard(v, 0, MIB).unwrap();
    let st = dg.stats();
    check_split(&st);
    assert_eq!(st.destage_backlog_bytes, 2 * MIB, "{st:?}");
    let used = st.log_used_bytes;
    // The volume deleted: only the other volume's data is left to destage, while the log
    // holds as much as before.
    dg.delete_volume("v", false).unwrap();
    let st = dg.stats();
    check_split(&st);
    assert_eq!(st.destage_backlog_bytes, MIB, "{st:?}");
    assert!(st.log_used_bytes >= used, "{st:?}");
    assert!(st.log_dead_bytes >= 4 * MIB, "{st:?}");
    // The same after a power cut: replay skips the deleted volume's records.
    drop(dg);
    rig.power_cut();
    rig.start_with(&OpenControl {
        hold_destager: true,
        ..OpenControl::default()
    })
    .expect("reopen after the power cut");
    let dg = rig.group().clone();
    let st = dg.stats();
    check_split(&st);
    assert_eq!(st.destage_backlog_bytes, MIB, "{st:?}");
    assert!(st.log_dead_bytes >= 4 * MIB, "{st:?}");
    // Every volume deleted: nothing left to destage.
    dg.delete_volume("keep", false).unwrap();
    let st = dg.stats();
    check_split(&st);
    assert_eq!(st.destage_backlog_bytes, 0, "{st:?}");
    assert!(st.log_fill_ratio > 0.0, "{st:?}");
    let mut buf = vec![0; MIB as usize];
    assert!(dg.read(keep, 0, &mut buf).is_err(), "a deleted volume read");
}

/// Right after a power cut with the log above its high mark, before the destager has measured
/// any rate, admission is not reported open: host writes wait once the log has no room, and
/// are paced once a rate is measured. (It was reported open until a host batch was placed
/// above the high mark, as the flag was set only then.) Once a rate is measured, it is
/// "throttled" while the fill is above the high mark.
#[test]
fn admission_after_a_power_cut_above_the_high_mark_is_not_reported_open() {
    let (mut rig, dg) =
        held_rig("admission_after_a_power_cut_above_the_high_mark_is_not_reported_open");
    let v = dg.create_volume("v", 12 * MIB).unwrap().id;
    let off = fill_past_high_mark(&dg, v, 0);
    // Nothing destaged, so nothing measured: above the high mark, it says so.
    let st = dg.stats();
    assert_eq!(st.admission, "measuring", "{st:?}");
    drop(dg);
    rig.power_cut();
    rig.start_with(&OpenControl {
        hold_destager: true,
        ..OpenControl::default()
    })
    .expect("reopen after the power cut");
    let dg = rig.group().clone();
    let st = dg.stats();
    assert!(st.log_fill_ratio > st.fill_ratio_high, "{st:?}");
    assert_eq!(st.destage_bandwidth_bytes_per_s, 0.0, "{st:?}");
    assert!(
        st.admission_throttled,
        "reported open above the high mark: {st:?}"
    );
    assert_eq!(st.admission, "measuring", "{st:?}");
    // A write taken meanwhile goes (nothing to pace it to), and changes nothing.
    dg.write(v, off, &[0x77; 4096]).unwrap();
    assert_eq!(dg.stats().admission, "measuring", "{:?}", dg.stats());
    // Once the destager has measured its bandwidth, writes are paced while above the mark.
    dg.sh.destager_held.store(false, Ordering::Relaxed);
    dg.sh.wake_destager();
    let deadline = Instant::now() + Duration::from_secs(20);
    while dg.stats().destage_bandwidth_bytes_per_s == 0.0 {
        assert!(
            Instant::now() < deadline,
            "no bandwidth measured: {:?}",
            dg.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = dg.stats();
    let want = match st.log_fill_ratio > st.fill_ratio_high {
        true => "throttled",
        false => "open",
    };
    assert_eq!(st.admission, want, "{st:?}");
    assert_eq!(st.admission_throttled, want != "open", "{st:?}");
}

/// A log with no room for a batch makes host writes wait, and says so: while it is full, and
/// right after a power cut that left it full (nothing measured yet).
#[test]
fn a_log_with_no_room_for_a_batch_reports_writes_waiting() {
    let (mut rig, dg) = held_rig("a_log_with_no_room_for_a_batch_reports_writes_waiting");
    let v = dg.create_volume("v", 64 * MIB).unwrap().id;
    // A writer that keeps writing until a write waits for room (the destager is held).
    let writer = {
        let dg = dg.clone();
        std::thread::spawn(move || {
            let mut off = 0;
            while off + 64 * 1024 <= 64 * MIB {
                if dg.write(v, off, &[0x5a; 64 * 1024]).is_err() {
                    return;
                }
                off += 64 * 1024;
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while dg.stats().admission != "waiting_for_room" {
        assert!(Instant::now() < deadline, "never waiting: {:?}", dg.stats());
        assert!(
            !writer.is_finished(),
            "the log took 64 MiB: {:?}",
            dg.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(dg.stats().admission_throttled);
    drop(dg);
    rig.power_cut();
    writer.join().unwrap();
    rig.start_with(&OpenControl {
        hold_destager: true,
        ..OpenControl::default()
    })
    .expect("reopen after the power cut");
    let st = rig.dg().stats();
    // The write waiting was never placed; the last batches may have been torn.
    assert!(st.log_fill_ratio > st.fill_ratio_high, "{st:?}");
    assert!(
        st.admission_throttled,
        "reported open with a full log: {st:?}"
    );
    assert!(
        st.admission == "waiting_for_room" || st.admission == "measuring",
        "{st:?}"
    );
}

/// With both tiers full, a restart above the high mark (nothing measured yet) does not report
/// admission "measuring", which says writes wait for room: nothing will make room, so a write
/// that fits the log goes and the others are refused with ENOSPC at once. (Found by a review:
/// the status said writes would wait while they failed.)
#[test]
fn a_full_group_restarted_above_the_high_mark_does_not_say_writes_wait() {
    let cfg = EngineConfig {
        fill_ratio_low: 0.0,
        fill_ratio_high: 0.2,
        ..small_cfg()
    };
    let seed = seed_for("a_full_group_restarted_above_the_high_mark_does_not_say_writes_wait");
    let mut rig = Rig::new(20 * MIB, &[12 * MIB], cfg, seed);
    let v = rig.dg().create_volume("big", 64 * MIB).unwrap().id;
    let written = crate::tests::fill_until_no_space(rig.dg(), v, 200);
    assert!(written > 8, "only {written} MiB fit");
    rig.clean_restart();
    let dg = rig.group().clone();
    // The destager's first look finds no segment and nothing to clean: the tier is full.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dg.stats().capacity_full {
        assert!(Instant::now() < deadline, "never full: {:?}", dg.stats());
        dg.sh.wake_destager();
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = dg.stats();
    assert!(st.log_fill_ratio > st.fill_ratio_high, "{st:?}");
    assert_eq!(st.destage_bandwidth_bytes_per_s, 0.0, "{st:?}");
    assert_eq!(st.admission, "open", "{st:?}");
    // And that is what a write meets: refused now, not after a wait.
    let started = Instant::now();
    let got = dg.write(v, written * MIB, &vec![0x3c; MIB as usize]);
    assert!(matches!(got, Err(EngineError::NoSpace)), "{got:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the write waited {:?} before its ENOSPC",
        started.elapsed()
    );
    let mut b = vec![0u8; MIB as usize];
    dg.read(v, (written - 1) * MIB, &mut b).unwrap();
    assert!(
        b.iter().all(|&x| x == written as u8),
        "the last MiB written"
    );
}
