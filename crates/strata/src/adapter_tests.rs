//! Unit tests of the NBD adapter: errno mapping, BLOCK_STATUS runs, handle counting and the
//! fenced changes (deleting volumes and snapshots, rollback) against open handles.
use super::*;
use crate::testutil::test_group;
use ExtentKind::{Data, Zero};

fn backend() -> (Arc<Registry>, NbdBackend) {
    let reg = Registry::new(test_group());
    (reg.clone(), NbdBackend(reg))
}

#[test]
fn errors_map_to_nbd_errnos() {
    let oor = EngineError::OutOfRange {
        offset: 1,
        len: 2,
        size_bytes: 1,
    };
    assert_eq!(errno_for(Op::Read, &oor), Errno::Inval);
    assert_eq!(errno_for(Op::Write, &oor), Errno::NoSpc);
    assert_eq!(errno_for(Op::Write, &EngineError::NoSpace), Errno::NoSpc);
    assert_eq!(
        errno_for(Op::Read, &EngineError::Corrupt("x".into())),
        Errno::Io
    );
    let dev = strata_device::DeviceError::Open("x".into());
    assert_eq!(errno_for(Op::Read, &EngineError::Device(dev)), Errno::Io);
    assert_eq!(
        errno_for(Op::Write, &EngineError::ShuttingDown),
        Errno::Shutdown
    );
    assert_eq!(
        errno_for(Op::Read, &EngineError::NotFound("v".into())),
        Errno::Shutdown
    );
    assert_eq!(
        errno_for(Op::Write, &EngineError::InvalidArgument("x".into())),
        Errno::Inval
    );
}

#[test]
fn block_status_maps_kinds_and_merges() {
    let runs = to_block_status(
        0,
        16384,
        [(0, 4096, Zero), (4096, 4096, Zero), (8192, 8192, Data)].into_iter(),
    );
    assert_eq!(
        runs,
        vec![
            BlockStatus {
                len: 8192,
                flags: 3
            },
            BlockStatus {
                len: 8192,
                flags: 0
            }
        ]
    );
}

#[test]
fn block_status_clips_to_the_request() {
    let runs = to_block_status(4096, 4096, [(0, 1 << 20, Zero)].into_iter());
    assert_eq!(
        runs,
        vec![BlockStatus {
            len: 4096,
            flags: 3
        }]
    );
}

#[test]
fn block_status_stops_at_a_gap_and_is_never_empty() {
    let runs = to_block_status(0, 16384, [(0, 4096, Data), (8192, 4096, Zero)].into_iter());
    assert_eq!(
        runs,
        vec![BlockStatus {
            len: 4096,
            flags: 0
        }]
    );
    let runs = to_block_status(0, 8192, std::iter::empty());
    assert_eq!(
        runs,
        vec![BlockStatus {
            len: 8192,
            flags: 0
        }]
    );
}

#[test]
fn block_status_caps_the_number_of_extents() {
    let n = MAX_BLOCK_STATUS_EXTENTS as u64 + 10;
    let extents = (0..n).map(|i| (i * 4096, 4096, if i % 2 == 0 { Data } else { Zero }));
    let runs = to_block_status(0, n * 4096, extents);
    assert_eq!(runs.len(), MAX_BLOCK_STATUS_EXTENTS);
}

#[test]
fn block_status_splits_runs_longer_than_u32() {
    let len = 6u64 << 30;
    let runs = to_block_status(0, len, [(0, len, Zero)].into_iter());
    assert!(runs.len() >= 2);
    assert_eq!(runs.iter().map(|r| u64::from(r.len)).sum::<u64>(), len);
    assert!(runs.iter().all(|r| r.len % 4096 == 0));
}

#[test]
fn open_counts_handles_and_drop_releases_them() {
    let (reg, backend) = backend();
    let info = reg.group().create_volume("v", 1 << 20).unwrap();
    assert!(backend.open("nope").is_none());
    let a = backend.open("v").unwrap();
    let b = backend.open("v").unwrap();
    assert_eq!(reg.connections(info.id), 2);
    assert_eq!(a.size_bytes(), 1 << 20);
    drop(a);
    assert_eq!(reg.connections(info.id), 1);
    drop(b);
    assert_eq!(reg.connections(info.id), 0);
    assert_eq!(backend.list().len(), 1);
}

#[test]
fn delete_is_refused_while_open_and_forced_delete_fences_io() {
    let (reg, backend) = backend();
    reg.group().create_volume("v", 1 << 20).unwrap();
    let export = backend.open("v").unwrap();
    export.write(0, &[7u8; 4096], false).unwrap();
    assert!(matches!(
        reg.delete("v", false, false),
        Err(ChangeError::Busy { connections: 1, .. })
    ));
    let mut buf = vec![0u8; 4096];
    export.read(0, &mut buf).unwrap();
    assert_eq!(buf[0], 7);
    reg.delete("v", true, false).unwrap();
    assert_eq!(export.read(0, &mut buf), Err(Errno::Shutdown));
    assert_eq!(export.write(0, &buf, true), Err(Errno::Shutdown));
    assert_eq!(export.flush(), Err(Errno::Shutdown));
    // A new volume of the same name is not reachable through the old handle.
    reg.group().create_volume("v", 1 << 20).unwrap();
    assert_eq!(export.read(0, &mut buf), Err(Errno::Shutdown));
    drop(export);
    assert!(matches!(
        reg.delete("missing", false, false),
        Err(ChangeError::Engine(EngineError::NotFound(_)))
    ));
}

#[test]
fn closed_handles_do_not_block_delete() {
    let (reg, backend) = backend();
    reg.group().create_volume("v", 1 << 20).unwrap();
    drop(backend.open("v").unwrap());
    reg.delete("v", false, false).unwrap();
    assert!(reg.group().volume("v").is_none());
}

#[test]
fn snapshots_are_read_only_exports_listed_after_their_volume() {
    let (reg, backend) = backend();
    reg.group().create_volume("v", 1 << 20).unwrap();
    let vol = backend.open("v").unwrap();
    vol.write(0, &[1u8; 4096], false).unwrap();
    reg.group().create_snapshot("v", "s").unwrap();
    vol.write(0, &[2u8; 4096], false).unwrap();

    let names: Vec<String> = backend.list().into_iter().map(|e| e.name).collect();
    assert_eq!(names, ["v", "v@s"]);
    assert!(backend.list()[1].description.contains("read-only"));
    assert!(backend.open("v@nope").is_none());
    assert!(backend.open("nope@s").is_none());

    let snap = backend.open("v@s").unwrap();
    assert!(snap.read_only());
    assert!(!vol.read_only());
    let mut buf = vec![0u8; 4096];
    snap.read(0, &mut buf).unwrap();
    assert_eq!(buf[0], 1, "the snapshot keeps the image it was taken with");
    // The server refuses these before they reach the export; the engine refuses them too.
    assert_eq!(snap.write(0, &buf, false), Err(Errno::Perm));
    assert_eq!(snap.trim(0, 4096), Err(Errno::Perm));
    assert_eq!(snap.write_zeroes(0, 4096, true), Err(Errno::Perm));
    let id = reg.group().view("v@s").unwrap().id;
    assert_eq!(reg.connections(id), 1);
    assert_eq!(reg.connections_total(), 2);
}

/// A request the NBD server refused without calling the export counts in the view's figures
/// (a snapshot's own) and the node's as a failure of its kind: no bytes, no latency.
#[test]
fn requests_the_server_refused_count_as_errors_of_their_view() {
    let (reg, backend) = backend();
    let v = reg.group().create_volume("v", 1 << 20).unwrap();
    let vol = backend.open("v").unwrap();
    reg.group().create_snapshot("v", "s").unwrap();
    let snap = backend.open("v@s").unwrap();
    vol.refused(cmd::WRITE, Errno::NoSpc);
    vol.refused(cmd::READ, Errno::Inval);
    vol.refused(cmd::BLOCK_STATUS, Errno::Inval);
    snap.refused(cmd::WRITE_ZEROES, Errno::Perm);
    let io = reg.volume_io(v.id).snapshot();
    assert_eq!((io.write_ops, io.write_bytes, io.read_ops, io.read_bytes), (1, 0, 1, 0));
    assert_eq!((io.unmap_ops, io.errors), (0, 3));
    assert_eq!((io.read_latency.count(), io.write_latency.count()), (0, 0));
    let s = reg.volume_io(reg.group().view("v@s").unwrap().id).snapshot();
    assert_eq!((s.unmap_ops, s.errors), (1, 1));
    assert_eq!(reg.node_io().snapshot().errors, 4);
}

#[test]
fn snapshot_delete_is_refused_while_open_unless_forced() {
    let (reg, backend) = backend();
    reg.group().create_volume("v", 1 << 20).unwrap();
    reg.group().create_snapshot("v", "s").unwrap();
    let snap = backend.open("v@s").unwrap();
    let err = reg.delete_snapshot("v", "s", false).unwrap_err();
    assert!(
        matches!(err, ChangeError::Busy { connections: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("strata snapshot delete --force"),
        "{err}"
    );
    assert!(
        reg.group().view("v@s").is_some(),
        "a refused delete changes nothing"
    );
    // The volume's own handles do not hold its snapshots.
    let _vol = backend.open("v").unwrap();
    reg.delete_snapshot("v", "s", true).unwrap();
    let mut buf = vec![0u8; 4096];
    assert_eq!(snap.read(0, &mut buf), Err(Errno::Shutdown));
    assert!(reg.group().view("v@s").is_none());
    assert!(matches!(
        reg.delete_snapshot("v", "s", false),
        Err(ChangeError::Engine(EngineError::NotFound(_)))
    ));
}

#[test]
fn volume_with_snapshots_is_deleted_only_with_them_and_fences_their_clients() {
    let (reg, backend) = backend();
    reg.group().create_volume("v", 1 << 20).unwrap();
    reg.group().create_snapshot("v", "s").unwrap();
    assert!(matches!(
        reg.delete("v", false, false),
        Err(ChangeError::Engine(EngineError::InUse(_)))
    ));
    let snap = backend.open("v@s").unwrap();
    assert!(matches!(
        reg.delete("v", false, true),
        Err(ChangeError::Busy { connections: 1, .. })
    ));
    reg.delete("v", true, true).unwrap();
    let mut buf = vec![0u8; 4096];
    assert_eq!(snap.read(0, &mut buf), Err(Errno::Shutdown));
    assert!(reg.group().view("v").is_none() && reg.group().view("v@s").is_none());
}

#[test]
fn rollback_is_refused_while_open_and_forced_rollback_cuts_clients_off() {
    let (reg, backend) = backend();
    reg.group().create_volume("v", 1 << 20).unwrap();
    let old = backend.open("v").unwrap();
    old.write(0, &[1u8; 4096], false).unwrap();
    reg.group().create_snapshot("v", "s").unwrap();
    old.write(0, &[2u8; 4096], false).unwrap();
    assert!(matches!(
        reg.rollback("v", "s", false),
        Err(ChangeError::Busy { connections: 1, .. })
    ));
    assert!(matches!(
        reg.rollback("v", "nope", true),
        Err(ChangeError::Engine(EngineError::NotFound(_)))
    ));
    let mut buf = vec![0u8; 4096];
    old.read(0, &mut buf).unwrap();
    assert_eq!(buf[0], 2, "a refused rollback changes nothing");

    reg.rollback("v", "s", true).unwrap();
    assert_eq!(old.read(0, &mut buf), Err(Errno::Shutdown));
    assert_eq!(old.write(0, &buf, false), Err(Errno::Shutdown));
    let id = reg.group().volume("v").unwrap().id;
    assert_eq!(reg.connections(id), 0, "cut-off handles no longer count");
    let fresh = backend.open("v").unwrap();
    fresh.read(0, &mut buf).unwrap();
    assert_eq!(buf[0], 1, "the volume reads as the snapshot");
    fresh.write(0, &[3u8; 4096], false).unwrap();
    assert_eq!(reg.connections(id), 1);
    drop(old);
    assert_eq!(
        reg.connections(id),
        1,
        "a cut-off handle closing does not touch the new count"
    );
    drop(fresh);
    reg.rollback("v", "s", false).unwrap();
}

/// A forced delete or rollback waits for the view's requests in flight, but not for those
/// queued behind the volume's IOPS limit, reads or writes: they are cut off (ESHUTDOWN).
/// Without that, 12 requests at 1 IOPS held each change (and the registry, so every page that counts
/// connections) for 11 seconds.
#[test]
fn forced_changes_do_not_wait_for_requests_queued_behind_a_limit() {
    const QUEUED: usize = 12;
    let (reg, backend) = backend();
    let policy = strata_engine::Policy {
        iops_limit: 1,
        ..Default::default()
    };
    for change in ["delete", "rollback"] {
        reg.group()
            .create_volume_with_policy("v", 1 << 20, &policy)
            .unwrap();
        reg.group().create_snapshot("v", "s").unwrap();
        let export = backend.open("v").unwrap();
        let writers: Vec<_> = (0..QUEUED)
            .map(|i| {
                let export = export.clone();
                std::thread::spawn(move || match i % 2 {
                    0 => export.write(i as u64 * 4096, &[1u8; 4096], false),
                    _ => export.read(i as u64 * 4096, &mut [0u8; 4096]),
                })
            })
            .collect();
        // One request goes on the second of burst; the others queue at one a second.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let started = Instant::now();
        match change {
            "delete" => reg.delete("v", true, true).unwrap(),
            _ => drop(reg.rollback("v", "s", true).unwrap()),
        }
        let took = started.elapsed();
        let results: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
        assert!(
            took < std::time::Duration::from_secs(3),
            "a forced {change} took {took:?} with {QUEUED} requests queued at 1 IOPS"
        );
        let cut = results
            .iter()
            .filter(|r| **r == Err(Errno::Shutdown))
            .count();
        assert!(cut >= QUEUED - 2, "{change}: {results:?}");
        assert!(results
            .iter()
            .all(|r| r.is_ok() || *r == Err(Errno::Shutdown)));
        if change == "rollback" {
            reg.delete("v", false, true).unwrap();
        }
    }
}

/// A snapshot's reads count against its volume's IOPS limit (a backup reading a snapshot of
/// a limited volume cannot starve the others either), and a forced delete of the snapshot
/// cuts off its reads queued behind the limit without cutting the volume's own.
#[test]
fn snapshot_reads_wait_for_their_volumes_limit() {
    const IOPS: u64 = 4;
    let (reg, backend) = backend();
    let policy = strata_engine::Policy {
        iops_limit: IOPS,
        ..Default::default()
    };
    let group = reg.group().clone();
    group
        .create_volume_with_policy("v", 1 << 20, &policy)
        .unwrap();
    group.create_snapshot("v", "s").unwrap();
    let reads = |name: &str, n: u64| -> Vec<_> {
        let export = backend.open(name).unwrap();
        (0..n)
            .map(|i| {
                let export = export.clone();
                std::thread::spawn(move || export.read(i * 4096, &mut [0u8; 4096]))
            })
            .collect()
    };
    // A second's worth goes at once; the rest of the snapshot's reads wait for the limit,
    // which shows in the volume's figures.
    let snap_reads = reads("v@s", 4 * IOPS);
    let began = Instant::now();
    while group.volume_figures("v").unwrap().limited_wait_ms == 0 {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(10),
            "no read of the snapshot waited for its volume's limit"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let vol_reads = reads("v", IOPS);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let started = Instant::now();
    reg.delete_snapshot("v", "s", true).unwrap();
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(2),
        "a forced snapshot delete took {took:?} with its reads queued at {IOPS} IOPS"
    );
    let snap_results: Vec<_> = snap_reads.into_iter().map(|r| r.join().unwrap()).collect();
    let cut = snap_results
        .iter()
        .filter(|r| **r == Err(Errno::Shutdown))
        .count();
    assert!(cut >= 1, "{snap_results:?}");
    // The volume's own reads were not cut: the limit lets them through.
    for r in vol_reads {
        assert_eq!(r.join().unwrap(), Ok(()));
    }
}
