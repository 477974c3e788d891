//! Destage stripes filled to the last block: a log batch that does not fit what is left of a
//! stripe goes in part, the rest with the next stripe (`Destager::plan`, `first_part`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_device::{AlignedBuf, Device};

use crate::capacity::SegState;
use crate::format::RecordKind;
use crate::map::Loc;
use crate::open_control::OpenControl;
use crate::shared::Shared;
use crate::tests::{durable_checkpoint, seed_for, small_cfg, Rig, MIB};
use crate::*;

/// The content of MiB `i` of the test volume: each 4 KiB block its own byte pattern.
fn mib_of(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; MIB as usize];
    for (k, block) in v.chunks_mut(4096).enumerate() {
        let tag = (i * 256 + k as u64) as u32;
        for (j, b) in block.iter_mut().enumerate() {
            *b = (tag.wrapping_mul(2_654_435_761) >> (j % 4 * 8)) as u8 ^ j as u8;
        }
    }
    v
}

fn check_volume(dg: &DiskGroup, v: VolumeId, mibs: u64, when: &str) {
    let mut got = vec![0u8; MIB as usize];
    for i in 0..mibs {
        dg.read(v, i * MIB, &mut got)
            .unwrap_or_else(|e| panic!("{when}: read of MiB {i}: {e}"));
        assert!(got == mib_of(i), "{when}: MiB {i} does not read back");
    }
}

/// Destages until a checkpoint moves the log tail where `when` (the group, the new tail's
/// seq) says, cuts the power right after that checkpoint, and opens the group again with its
/// destager held (it would take the rest of a split batch at once); returns the control it
/// opened with. `what` is the failure if no such checkpoint comes.
fn cut_after_a_tail_checkpoint(
    rig: &mut Rig,
    when: impl Fn(&Shared, u64) -> bool + Send + Sync + 'static,
    what: &str,
) -> OpenControl {
    let power = rig.power_switch();
    let weak = Arc::downgrade(&rig.group().sh);
    *rig.dg().sh.after_tail_checkpoint.lock() = Some(Box::new(move |tail| {
        if weak.upgrade().is_some_and(|sh| when(&sh, tail.1)) {
            power.store(true, Ordering::SeqCst);
        }
    }));
    rig.dg().sh.drain.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !rig.power_is_off() {
        assert!(Instant::now() < deadline, "{what}");
        rig.dg().sh.wake_destager();
        std::thread::sleep(Duration::from_millis(2));
    }
    let held = OpenControl {
        hold_destager: true,
        ..OpenControl::default()
    };
    rig.power_cut();
    rig.start_with(&held).expect("reopen after the power cut");
    held
}

/// (sealed data segments, those with room left, blocks written to them)
fn sealed(dg: &DiskGroup) -> (usize, usize, u64) {
    let data_blocks = dg.sh.layout.geo.data_blocks;
    let segs = dg.sh.segs.lock();
    let sealed: Vec<_> = segs
        .segs
        .iter()
        .filter(|s| s.state == SegState::Sealed)
        .collect();
    let part = sealed
        .iter()
        .filter(|s| s.used_blocks < data_blocks)
        .count();
    let used = sealed.iter().map(|s| u64::from(s.used_blocks)).sum();
    (sealed.len(), part, used)
}

/// Sequential writes make batches of the largest size; with one capacity device a stripe is
/// one segment, which took whole batches only: three 256 KiB batches (189 data blocks) of a
/// 1 MiB segment's 250, and the segment was sealed with the rest unused for good. Every
/// segment but the last is now full, and the data reads back, before and after a power cut.
#[test]
fn sequential_writes_fill_every_segment_they_are_destaged_to() {
    let seed = seed_for("sequential_writes_fill_every_segment_they_are_destaged_to");
    let mut rig = Rig::new(16 * MIB, &[48 * MIB], small_cfg(), seed);
    let v = rig.dg().create_volume("seq", 64 * MIB).unwrap().id;
    let mibs = 24;
    for i in 0..mibs {
        rig.dg().write(v, i * MIB, &mib_of(i)).unwrap();
    }
    assert!(
        rig.dg().destage_all(Duration::from_secs(60)),
        "the log did not drain"
    );
    let data_blocks = u64::from(rig.dg().sh.layout.geo.data_blocks);
    let (count, part, used) = sealed(rig.dg());
    let blocks = mibs * MIB / 4096;
    assert_eq!(used, blocks, "blocks written to segments");
    assert_eq!(
        count as u64,
        blocks.div_ceil(data_blocks),
        "{count} segments sealed for {blocks} blocks of {data_blocks} per segment ({part} part full)"
    );
    assert!(part <= 1, "{part} segments sealed with room left");
    check_volume(rig.dg(), v, mibs, "after the destage");
    rig.power_cut_and_restart();
    check_volume(rig.dg(), v, mibs, "after a power cut");
}

/// Power cuts while batches are split between stripes (one stripe written and committed, the
/// batch it took part of still in the log) lose nothing, and the destage after the restart
/// takes the rest.
#[test]
fn power_cuts_while_batches_are_split_between_stripes_lose_nothing() {
    let seed = seed_for("power_cuts_while_batches_are_split_between_stripes_lose_nothing");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rig = Rig::new(16 * MIB, &[48 * MIB], small_cfg(), seed);
    let v = rig.dg().create_volume("seq", 64 * MIB).unwrap().id;
    let mibs = 8;
    for round in 0..4 {
        for i in 0..mibs {
            rig.dg().write(v, i * MIB, &mib_of(i)).unwrap();
        }
        // The power goes off after some of the destage's device writes.
        rig.writes_left
            .store(rng.gen_range(0..40), std::sync::atomic::Ordering::SeqCst);
        let drained = rig.dg().destage_all(Duration::from_secs(2));
        let cut = rig.power_is_off();
        rig.power_cut_and_restart();
        check_volume(
            rig.dg(),
            v,
            mibs,
            &format!("round {round}, after a power cut (drained {drained}, cut early {cut})"),
        );
    }
    assert!(
        rig.dg().destage_all(Duration::from_secs(60)),
        "the log did not drain"
    );
    check_volume(rig.dg(), v, mibs, "after the last destage");
}

/// A power cut with the log's tail batch split (a committed stripe holds its first part, the
/// rest is only in the log): after the restart the first part is read from the capacity tier
/// and only the rest is in the fast maps. Replayed whole, the batch held live data again that
/// a rotation going on at the cut had not rewritten, and a full group's log could be left
/// with no room to move it: every trim was refused (`tests_model_full`, one run in 30).
#[test]
fn a_power_cut_with_a_split_batch_at_the_tail_keeps_its_first_part_destaged() {
    let seed = seed_for("a_power_cut_with_a_split_batch_at_the_tail_keeps_its_first_part_destaged");
    let mut rig = Rig::new(16 * MIB, &[48 * MIB], small_cfg(), seed);
    let v = rig.dg().create_volume("seq", 64 * MIB).unwrap().id;
    let mibs = 8;
    for i in 0..mibs {
        rig.dg().write(v, i * MIB, &mib_of(i)).unwrap();
    }
    // The power goes off right after the first stripe's checkpoint (1 MiB segments of 250
    // data blocks, and sequential writes make records of 63: the stripe ends inside one).
    let held = cut_after_a_tail_checkpoint(&mut rig, |_, _| true, "no stripe was committed");
    let part = durable_checkpoint(&rig)
        .tail_destaged
        .expect("the checkpoint names the tail batch's destaged part");
    // Every block of the tail batch before the part's end is the capacity tier's; every one
    // after it the log's.
    let dg = rig.dg();
    let tail = dg
        .sh
        .log
        .lock()
        .batches
        .front()
        .cloned()
        .expect("a tail batch");
    let idx = dg.sh.index.read();
    let (mut destaged, mut in_log) = (0, 0);
    for r in tail.records.iter().filter(|r| r.kind == RecordKind::Write) {
        let rest = part
            .rest_of(r.seq, r.nblocks)
            .map_or(r.nblocks, |(from, _)| from);
        let fast = &idx.layers[&r.layer].fast;
        for p in fast.lookup(r.lba, r.nblocks) {
            let off = p.lba - r.lba;
            let in_the_log = p.loc == Some(Loc::Fast(r.data_start + off));
            match off < rest {
                true => destaged += p.len,
                false => in_log += p.len,
            }
            assert_eq!(
                in_the_log,
                off >= rest,
                "record {} blocks {off}+{}: in the log {in_the_log}, the destaged part ends at \
                 block {rest}",
                r.seq,
                p.len
            );
        }
    }
    drop(idx);
    assert!(
        destaged > 0 && in_log > 0,
        "the tail batch is not split: {destaged} blocks destaged, {in_log} in the log"
    );
    check_volume(rig.dg(), v, mibs, "after the power cut");
    // Carried by the checkpoints written since (the open's, a clean shutdown's).
    let dg = rig.dg.take().expect("running");
    dg.shutdown().expect("a clean shutdown");
    drop(dg);
    rig.start_with(&held)
        .expect("reopen after a clean shutdown");
    assert_eq!(durable_checkpoint(&rig).tail_destaged, Some(part));
    check_volume(rig.dg(), v, mibs, "after a clean restart");
    rig.dg().sh.destager_held.store(false, Ordering::SeqCst);
    assert!(
        rig.dg().destage_all(Duration::from_secs(60)),
        "the log did not drain"
    );
    assert_eq!(durable_checkpoint(&rig).tail_destaged, None);
    check_volume(rig.dg(), v, mibs, "after the last destage");
}

/// The checkpoint names the destaged part of a tail batch that the next open cannot find (its
/// header damaged): replay finds no batch, and the next batch written takes that batch's
/// sequence number. The part must not be carried over to it: a power cut then would leave the
/// new batch's first blocks out of the fast maps, and acknowledged writes would read as what
/// was there before.
#[test]
fn a_destaged_part_of_a_lost_tail_batch_is_not_applied_to_the_next_one() {
    let seed = seed_for("a_destaged_part_of_a_lost_tail_batch_is_not_applied_to_the_next_one");
    let mut rig = Rig::new(16 * MIB, &[48 * MIB], small_cfg(), seed);
    let v = rig.dg().create_volume("seq", 64 * MIB).unwrap().id;
    // Four records of 63 blocks: a segment's 250 data blocks take three and 61 blocks of the
    // fourth, which stays in the log alone.
    rig.dg().write(v, 0, &mib_of(0)[..252 * 4096]).unwrap();
    let last_is_tail =
        |sh: &Shared, tail_seq| sh.log.lock().batches.back().map(|b| b.first_seq) == Some(tail_seq);
    let held = cut_after_a_tail_checkpoint(&mut rig, last_is_tail, "the last batch was not split");
    assert!(durable_checkpoint(&rig).tail_destaged.is_some());
    let header = {
        let log = rig.dg().sh.log.lock();
        assert_eq!(log.batches.len(), 1, "the split batch alone is in the log");
        rig.dg().sh.layout.log_byte(log.batches[0].start)
    };
    // Its header damaged while the power is off.
    rig.power_cut();
    let mut block = AlignedBuf::new_zeroed(4096);
    rig.fast.read_at(&mut block, header).unwrap();
    block[..64].iter_mut().for_each(|b| *b ^= 0xff);
    rig.fast.write_at(&block, header).unwrap();
    rig.start_with(&held)
        .expect("reopen with the tail batch lost");
    assert_eq!(rig.dg().sh.log.lock().batches.len(), 0);
    assert_eq!(
        durable_checkpoint(&rig).tail_destaged,
        None,
        "the open's checkpoint names a part of a batch that is not there"
    );
    let data = mib_of(9)[..256 * 1024].to_vec();
    rig.dg().write(v, 4 * MIB, &data).unwrap();
    rig.power_cut();
    rig.start_with(&held).expect("reopen after the new write");
    let mut got = vec![0u8; data.len()];
    rig.dg().read(v, 4 * MIB, &mut got).unwrap();
    let lost = got
        .chunks(4096)
        .zip(data.chunks(4096))
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(
        lost, 0,
        "{lost} blocks of an acknowledged write read otherwise"
    );
}
