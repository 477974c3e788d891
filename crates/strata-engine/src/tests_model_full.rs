//! A disk group that runs out of space. Seeds are printed; `STRATA_TEST_SEED=<n>` replays one.

use std::time::{Duration, Instant};

use crate::tests::{seed_for, small_cfg, Rig, MIB};
use crate::*;

const FAST_BYTES: u64 = 16 * MIB;
/// How long space freed by a trim or a delete may take to come back.
const SPACE_BACK_WAIT: Duration = Duration::from_secs(30);

/// Writes 1 MiB pieces (MiB `i` holds `i + 1`) until NoSpace; returns how many were taken.
fn fill_until_no_space(dg: &DiskGroup, v: VolumeId, max_mib: u64) -> u64 {
    for i in 0..max_mib {
        match dg.write(v, i * MIB, &vec![(i + 1) as u8; MIB as usize]) {
            Ok(()) => {}
            Err(EngineError::NoSpace) => return i,
            Err(e) => panic!("a write while filling: {e}"),
        }
    }
    panic!("a thin volume larger than the tiers never hit NoSpace");
}

/// A full group whose volume had a snapshot: the snapshot deleted and the volume trimmed
/// whole, writes succeed again. (The deleted snapshot's layer waited to be merged into the
/// volume until its data in the log was destaged, which needed a free segment: with the
/// capacity tier full of that layer's older blocks, nothing was ever freed, although the
/// volume's trim hid every block of it.)
#[test]
fn a_trim_after_deleting_a_snapshot_of_a_full_group_gives_space_back() {
    let seed = seed_for("a_trim_after_deleting_a_snapshot_of_a_full_group_gives_space_back");
    let mut rig = Rig::new(FAST_BYTES, &[24 * MIB], small_cfg(), seed);
    let v = rig.dg().create_volume("v", 64 * MIB).unwrap().id;
    let written = fill_until_no_space(rig.dg(), v, 64);
    rig.dg().create_snapshot("v", "s").unwrap();
    rig.dg().delete_snapshot("v", "s").unwrap();
    rig.dg()
        .discard(v, 0, 64 * MIB)
        .expect("a trim of a full volume");
    let deadline = Instant::now() + SPACE_BACK_WAIT;
    let data = vec![0x5b; MIB as usize];
    loop {
        match rig.dg().write(v, 0, &data) {
            Ok(()) => break,
            Err(EngineError::NoSpace) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!(
                "a write after the trim ({written} MiB were written): {e}: {:?}",
                rig.dg().stats()
            ),
        }
    }
    rig.power_cut_and_restart();
    let mut b = vec![0u8; MIB as usize];
    for i in 0..written {
        rig.dg().read(v, i * MIB, &mut b).unwrap();
        let want = if i == 0 { 0x5b } else { 0 };
        assert!(b.iter().all(|&x| x == want), "MiB {i} is not {want:#x}");
    }
}
