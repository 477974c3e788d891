//! A capacity device out of room (the file system under a sparse capacity file full, room.rs):
//! host writes fill the log and are then refused with ENOSPC, not left waiting; the free
//! segments are not used up by failed writes; everything acknowledged reads back, across a
//! power cut too; and once there is room again, destage and host writes go on without a
//! restart.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_device::MemDevice;

use crate::tests::{seed_for, small_cfg, write_when_space, Rig, MIB};
use crate::tests_full_gaps::check_blocks;
use crate::*;

const BLOCK: u64 = 4096;
const VOLUME_BLOCKS: u64 = 40 * MIB / BLOCK;

/// Writes 16-block chunks with new content from another thread, one after the other from
/// block `*next` (fresh data: nothing in the log is overwritten, so nothing in it is dead),
/// until one is refused; panics if a write neither completes nor fails within 30 s. Returns
/// the refusal; `*next` is then the refused chunk.
fn write_until_refused(
    dg: &Arc<DiskGroup>,
    v: VolumeId,
    next: &mut u64,
    rng: &mut StdRng,
    model: &mut [u8],
) -> EngineError {
    loop {
        let at = *next % VOLUME_BLOCKS;
        let fill = rng.gen_range(1..=255u8);
        let (tx, rx) = mpsc::channel();
        let writer = dg.clone();
        std::thread::spawn(move || {
            let _ = tx.send(writer.write(v, at * BLOCK, &vec![fill; 16 * BLOCK as usize]));
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => model[at as usize..(at + 16) as usize].fill(fill),
            Ok(Err(e)) => return e,
            Err(_) => panic!("a write at block {at} neither completed nor failed in 30 s"),
        }
        *next = at + 16;
    }
}

/// A group, one volume on it and what it must read as.
struct Setup {
    rig: Rig,
    /// The capacity device.
    cap: Arc<MemDevice>,
    v: VolumeId,
    model: Vec<u8>,
    /// The chunk `write_until_refused` writes next.
    next: u64,
    rng: StdRng,
}

/// Room the file system keeps beyond whole segments: index pages need a few blocks of room
/// (a flush while out of room, and the one at open), which a file system with no room at all
/// does not give (docs/FORMAT.md §9). Without it the room of the tests, whole segments, left
/// none: segments are written full (only destage stripes that took whole batches left some).
const INDEX_ROOM: u64 = 64 * 1024;

/// A group whose capacity device has `room` bytes of room more than it holds at first (a
/// sparse file on a file system with that much free, and `INDEX_ROOM`), its volume written
/// until a write is refused; with the refusal.
fn out_of_room(test: &str, room: u64) -> (Setup, EngineError) {
    out_of_room_on(test, &[96 * MIB], room)
}

/// As `out_of_room`, for a group over capacity devices of sizes `caps`, the last of which is
/// the one short of room.
fn out_of_room_on(test: &str, caps: &[u64], room: u64) -> (Setup, EngineError) {
    let seed = seed_for(test);
    let rig = Rig::new(16 * MIB, caps, small_cfg(), seed);
    let v = rig
        .dg()
        .create_volume("v", VOLUME_BLOCKS * BLOCK)
        .unwrap()
        .id;
    let cap = rig.caps.last().expect("a capacity device").clone();
    cap.set_space_limit(Some(cap.stored_bytes() + room + INDEX_ROOM));
    let mut f = Setup {
        rig,
        cap,
        v,
        model: vec![0u8; VOLUME_BLOCKS as usize],
        next: 0,
        rng: StdRng::seed_from_u64(seed),
    };
    let dg = f.rig.group().clone();
    let refused = write_until_refused(&dg, v, &mut f.next, &mut f.rng, &mut f.model);
    (f, refused)
}

#[test]
fn a_capacity_device_out_of_room_refuses_writes_and_resumes_once_room_is_back() {
    let test = "a_capacity_device_out_of_room_refuses_writes_and_resumes_once_room_is_back";
    let (f, refused) = out_of_room(test, 6 * MIB);
    let Setup {
        mut rig,
        cap,
        v,
        mut model,
        next,
        mut rng,
    } = f;
    let segments = rig.dg().stats().segments_total;
    let dg = rig.group().clone();
    assert!(
        matches!(refused, EngineError::NoSpace),
        "a write was refused with {refused}"
    );
    let out = dg
        .stats()
        .capacity_out_of_room
        .expect("the tier is not reported out of room");
    assert!(
        out.error.contains("No space left on device"),
        "{}",
        out.error
    );
    check_blocks(&dg, v, &model);
    // Out of room for a while: the destager tries again after 1 s, 2 s, 4 s..., and each try
    // gives its segments back.
    std::thread::sleep(Duration::from_secs(2));
    let s = dg.stats();
    let errors = s.capacity_devices[0].errors;
    assert!(
        errors <= 6,
        "{errors} capacity writes failed in about 2 s out of room"
    );
    // The device has room for 6 MiB more than it had: no more than that many segments (and
    // a few index segments) may have left the free list.
    assert!(
        s.segments_free + 12 >= segments,
        "failed writes used up the free segments: {} of {segments} free",
        s.segments_free
    );
    assert!(matches!(
        dg.write(v, 0, &vec![1u8; 16 * BLOCK as usize]),
        Err(EngineError::NoSpace)
    ));
    // Refused at once, not paced to a destage rate of nothing first.
    let began = Instant::now();
    let r = dg.write(v, 0, &vec![2u8; 8 * MIB as usize]);
    assert!(matches!(r, Err(EngineError::NoSpace)), "{r:?}");
    // (Paced, it took 9.7 s; refused at once, 15 ms.)
    let took = began.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "an 8 MiB write was refused after {took:?}"
    );

    // Trims and overwrites of data still in the log are taken as on a full capacity tier:
    // the log's tail is compacted or rotated (no capacity write) to give their room back.
    // A trim of the last 2 MiB written, then many times the log's size over half of it:
    let at = (next - 512) * BLOCK;
    dg.discard(v, at, 2 * MIB).unwrap();
    model[(at / BLOCK) as usize..(at / BLOCK + 512) as usize].fill(0);
    let mut taken = 0;
    let began = Instant::now();
    for round in 0..400u64 {
        if began.elapsed() > Duration::from_secs(20) {
            break;
        }
        let fill = 0x80 + (round % 64) as u8;
        match dg.write(v, at, &vec![fill; 64 * 1024]) {
            Ok(()) => {
                model[(at / BLOCK) as usize..(at / BLOCK + 16) as usize].fill(fill);
                taken += 1;
            }
            // As on a full capacity tier, rotation may find too little dead in a lap of the
            // log to be worth it.
            Err(EngineError::NoSpace) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("overwrite {round} of a trimmed 64 KiB out of room: {e}"),
        }
    }
    // More than the 2 MiB trimmed: the overwritten copies' room came back too. (118 to 400
    // of 400 taken in 41 runs; without compaction and rotation while out of room, each
    // refusal waited 5 s for a rotation that never came.)
    assert!(
        taken >= 64,
        "only {taken} of 400 overwrites of 64 KiB out of room were taken"
    );
    check_blocks(&dg, v, &model);

    // Room again: destage goes on, and so do host writes, with no restart.
    cap.set_space_limit(None);
    let data = vec![0x5a; 16 * BLOCK as usize];
    write_when_space(&dg, v, 0, &data, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("writes still fail 30 s after room came back: {e}"));
    model[..16].fill(0x5a);
    let began = Instant::now();
    while let Some(o) = dg.stats().capacity_out_of_room {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "still out of room: {o:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for _ in 0..200 {
        let at = rng.gen_range(0..VOLUME_BLOCKS / 16) * 16;
        let fill = rng.gen_range(1..=255u8);
        dg.write(v, at * BLOCK, &vec![fill; 16 * BLOCK as usize])
            .unwrap();
        model[at as usize..(at + 16) as usize].fill(fill);
    }
    check_blocks(&dg, v, &model);
    drop(dg);
    rig.power_cut_and_restart();
    check_blocks(rig.dg(), v, &model);
}

/// Destage stripes span every capacity device: with one out of room and the other not, each
/// try writes one segment and fails the other. That is one spell, not one ended and begun
/// again at each try by the segment that fit (an error line each time, its age reset).
#[test]
fn one_full_device_of_two_is_one_spell_out_of_room() {
    let test = "one_full_device_of_two_is_one_spell_out_of_room";
    let (f, refused) = out_of_room_on(test, &[48 * MIB, 48 * MIB], 3 * MIB);
    assert!(
        matches!(refused, EngineError::NoSpace),
        "a write was refused with {refused}"
    );
    let Setup {
        mut rig,
        cap,
        v,
        model,
        ..
    } = f;
    let dg = rig.group().clone();
    // Tries 1 and 2 s apart: one or more within 4.5 s, besides the first failure.
    let began = Instant::now();
    let mut last_since = 0.0;
    let mut spell = None;
    while began.elapsed() < Duration::from_millis(4500) {
        let Some(o) = dg.stats().capacity_out_of_room else {
            panic!(
                "the spell ended after {:?} with no room made",
                began.elapsed()
            );
        };
        assert!(
            o.since_s >= last_since,
            "a new spell began after {:?}: {o:?}, the last one {last_since:.1} s old",
            began.elapsed()
        );
        last_since = o.since_s;
        spell = Some(o);
        std::thread::sleep(Duration::from_millis(20));
    }
    let spell = spell.expect("sampled");
    assert!(spell.failed_writes >= 2, "{spell:?}");
    check_blocks(&dg, v, &model);
    cap.set_space_limit(None);
    let began = Instant::now();
    while let Some(o) = dg.stats().capacity_out_of_room {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "still out of room 30 s after room came back: {o:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(dg);
    rig.power_cut_and_restart();
    check_blocks(rig.dg(), v, &model);
}

/// Stops a group that is out of room: a clean stop (half the time), which may fail only for
/// want of room (it cannot write the index then), and a power cut, which is all the other
/// half gets.
fn stop_out_of_room(rig: &mut Rig, rng: &mut StdRng) {
    if rng.gen_bool(0.5) {
        let dg = rig.dg.take().expect("running");
        if let Err(e) = dg.shutdown() {
            assert!(
                crate::room::is_out_of_room(&e),
                "a stop while out of room failed with {e}"
            );
        }
    }
    rig.power_cut();
}

/// The group stopped while out of room, by a power cut or (half the seeds) a clean stop,
/// which cannot write the index to the capacity tier and says so; either way it opens again
/// with the file system still full and loses nothing.
#[test]
fn a_stop_while_out_of_room_loses_nothing_and_the_group_opens() {
    let test = "a_stop_while_out_of_room_loses_nothing_and_the_group_opens";
    let (f, _) = out_of_room(test, 4 * MIB);
    let Setup {
        mut rig,
        cap,
        v,
        mut model,
        mut next,
        mut rng,
    } = f;
    std::thread::sleep(Duration::from_millis(rng.gen_range(0..2500)));
    stop_out_of_room(&mut rig, &mut rng);
    // The file system is still full when the group opens again.
    rig.power_cut_and_restart();
    check_blocks(rig.dg(), v, &model);
    let dg = rig.group().clone();
    let refused = write_until_refused(&dg, v, &mut next, &mut rng, &mut model);
    assert!(
        matches!(refused, EngineError::NoSpace),
        "a write was refused with {refused}"
    );
    cap.set_space_limit(None);
    drop(dg);
    rig.clean_restart();
    check_blocks(rig.dg(), v, &model);
}

/// Out of room, then the file system's last blocks taken too (by another file): the group,
/// stopped by a power cut or a clean stop, may not open while there is no room at all, as the
/// open writes the index (docs/FORMAT.md §9). It then refuses with the device's ENOSPC and
/// writes nothing it needs, and once room is made it opens with nothing lost; or it opens
/// (the index needed no new page). Either way a write then goes on, once there is room.
#[test]
fn an_open_with_no_room_at_all_fails_for_room_and_loses_nothing() {
    let test = "an_open_with_no_room_at_all_fails_for_room_and_loses_nothing";
    let (f, _) = out_of_room(test, 4 * MIB);
    let Setup {
        mut rig,
        cap,
        v,
        mut model,
        mut rng,
        ..
    } = f;
    cap.set_space_limit(Some(cap.stored_bytes()));
    stop_out_of_room(&mut rig, &mut rng);
    match rig.start() {
        Ok(()) => eprintln!("opened with no room at all: the index needed no new page"),
        Err(e) => {
            assert!(
                crate::room::is_out_of_room(&e),
                "an open with no room failed with {e}"
            );
            cap.set_space_limit(None);
            rig.start().expect("the open once room is made");
        }
    }
    check_blocks(rig.dg(), v, &model);
    cap.set_space_limit(None);
    let data = vec![0x4b; 16 * BLOCK as usize];
    write_when_space(rig.group(), v, 0, &data, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("a write once room is made: {e}"));
    model[..16].fill(0x4b);
    rig.power_cut_and_restart();
    check_blocks(rig.dg(), v, &model);
}

/// Out of room with nothing left in the log for the capacity tier (the only volume deleted),
/// the spell ends once the file system has room again, without waiting for new writes to try a
/// capacity write: the idle destager probes for room. While there is none, the probes fail and
/// the spell goes on. (It lasted until new writes had filled the log again: `strata status`
/// kept saying "out of room", and `strata_capacity_out_of_room` stayed 1, on an idle group
/// whose file system had room.)
#[test]
fn room_back_with_nothing_to_write_ends_the_spell() {
    let test = "room_back_with_nothing_to_write_ends_the_spell";
    let (f, refused) = out_of_room(test, 4 * MIB);
    assert!(matches!(refused, EngineError::NoSpace), "{refused}");
    let dg = f.rig.group().clone();
    assert!(dg.stats().capacity_out_of_room.is_some());
    // No room at all now, and nothing to write.
    f.cap.set_space_limit(Some(f.cap.stored_bytes()));
    let written = dg.stats().host_write_bytes_total;
    dg.delete_volume("v", false).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    let st = dg.stats();
    assert_eq!(st.destage_backlog_bytes, 0, "{st:?}");
    let Some(o) = st.capacity_out_of_room else {
        panic!("the spell ended with no room: {st:?}");
    };
    assert!(o.failed_writes >= 2, "no probe failed in 4 s: {o:?}");
    // Room made on the file system.
    f.cap.set_space_limit(None);
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Some(o) = dg.stats().capacity_out_of_room {
        assert!(
            Instant::now() < deadline,
            "still out of room 30 s after room came back, nothing to write: {o:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = dg.stats();
    assert_eq!(st.host_write_bytes_total, written, "no host wrote: {st:?}");
    assert!(!st.capacity_full, "{st:?}");
    let v = dg.create_volume("w", 8 * MIB).unwrap().id;
    dg.write(v, 0, &vec![0x5c; 2 * MIB as usize]).unwrap();
    assert!(dg.destage_all(Duration::from_secs(20)));
    let mut back = vec![0u8; 2 * MIB as usize];
    dg.read(v, 0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x5c));
}

/// Out of room, a trim of the volume gives its blocks on the capacity tier back to the file
/// system (the segments it empties are freed and discarded), so the spell ends and writes go
/// on with no room made by hand, and no restart. (Trims changed nothing on the capacity tier
/// until their records were destaged, which the spell stops: a host trimming to make room
/// kept failing its writes; only deleting a volume gave room back.)
#[test]
fn a_trim_while_out_of_room_gives_the_room_back() {
    let test = "a_trim_while_out_of_room_gives_the_room_back";
    let (f, refused) = out_of_room(test, 24 * MIB);
    assert!(matches!(refused, EngineError::NoSpace), "{refused}");
    let Setup {
        mut rig,
        cap,
        v,
        mut model,
        ..
    } = f;
    let dg = rig.group().clone();
    assert!(dg.stats().capacity_out_of_room.is_some());
    let held = cap.stored_bytes();
    // The oldest quarter of the volume, written first: on the capacity tier by now.
    let quarter = VOLUME_BLOCKS / 4;
    assert!(
        dg.stats().capacity_live_bytes >= quarter * BLOCK,
        "{:?}",
        dg.stats()
    );
    dg.discard(v, 0, quarter * BLOCK)
        .unwrap_or_else(|e| panic!("a trim while out of room: {e}: {:?}", dg.stats()));
    model[..quarter as usize].fill(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Some(o) = dg.stats().capacity_out_of_room {
        assert!(
            Instant::now() < deadline,
            "still out of room 30 s after a trim of a quarter of the volume: {o:?}; the capacity \
             device holds {} of {held} bytes",
            cap.stored_bytes()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        cap.stored_bytes() < held,
        "nothing was discarded: {} of {held} bytes",
        cap.stored_bytes()
    );
    // Writes go on (the log drains into the room the trim gave back).
    let data = vec![0x3c; 2 * MIB as usize];
    write_when_space(&dg, v, 0, &data, Duration::from_secs(30)).unwrap_or_else(|e| {
        panic!(
            "a write after the trim gave room back: {e}: {:?}",
            dg.stats()
        )
    });
    model[..(2 * MIB / BLOCK) as usize].fill(0x3c);
    check_blocks(&dg, v, &model);
    drop(dg);
    rig.power_cut_and_restart();
    check_blocks(rig.dg(), v, &model);
}
