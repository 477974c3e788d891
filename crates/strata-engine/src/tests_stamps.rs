//! Device stamps: a capacity or fast device put back from an older image is refused at open
//! (its segments and index no longer match the rest of the group, so it would serve old data
//! as current), and a power cut at any write of an open or a shutdown loses nothing.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use strata_device::{AlignedBuf, Device, MemDevice};

use crate::format::Superblock;
use crate::layout::{layout_from, read_checkpoint, read_superblock, write_checkpoint, write_stamp};
use crate::tests::{check_volume, seed_for, small_cfg, Rig, MIB};

const VOL_BYTES: usize = 2 * MIB as usize;

/// A group of a fast device and two capacity devices, with one volume.
fn new_rig(test: &str) -> (Rig, u32) {
    let rig = Rig::new(32 * MIB, &[24 * MIB, 24 * MIB], small_cfg(), seed_for(test));
    let vol = rig.dg().create_volume("v", VOL_BYTES as u64).unwrap().id;
    (rig, vol)
}

/// Writes the whole volume with `byte` and moves it to the capacity tier.
fn fill(rig: &Rig, vol: u32, byte: u8) -> Vec<u8> {
    let model = vec![byte; VOL_BYTES];
    rig.dg().write(vol, 0, &model).unwrap();
    assert!(rig.dg().destage_all(Duration::from_secs(30)), "destage");
    model
}

fn shutdown(rig: &mut Rig) {
    rig.dg.take().expect("running").shutdown().unwrap();
}

/// Every byte the device holds.
fn contents(dev: &MemDevice) -> Vec<u8> {
    let mut b = AlignedBuf::new_zeroed(dev.size_bytes() as usize);
    dev.read_at(&mut b, 0).unwrap();
    b.to_vec()
}

/// Opening fails with a message holding every one of `words`, and writes nothing.
fn refused(rig: &mut Rig, words: &[&str]) {
    let before: Vec<_> = std::iter::once(&rig.fast)
        .chain(&rig.caps)
        .map(|d| contents(d))
        .collect();
    let err = rig.start().expect_err("the older device was accepted");
    for w in words {
        assert!(err.to_string().contains(w), "{w:?} missing from: {err}");
    }
    for (dev, b) in std::iter::once(&rig.fast).chain(&rig.caps).zip(before) {
        assert!(
            contents(dev) == b,
            "the refused open wrote to {}",
            dev.name()
        );
    }
}

#[test]
fn a_capacity_device_put_back_from_an_older_image_is_refused() {
    let (mut rig, vol) = new_rig("a_capacity_device_put_back_from_an_older_image_is_refused");
    fill(&rig, vol, 1);
    shutdown(&mut rig);
    let old = Arc::new(rig.caps[1].snapshot_durable());
    rig.start().unwrap();
    let model = fill(&rig, vol, 2);
    shutdown(&mut rig);
    let current = std::mem::replace(&mut rig.caps[1], old);
    refused(
        &mut rig,
        &[
            "capacity device cap1 is older than the rest of disk group",
            "restored from an older image",
        ],
    );
    // With the device the group last used, everything is there.
    rig.caps[1] = current;
    rig.start().unwrap();
    check_volume(rig.dg(), vol, &model, "with the current device back");
}

#[test]
fn a_fast_device_put_back_from_an_older_image_is_refused() {
    let (mut rig, vol) = new_rig("a_fast_device_put_back_from_an_older_image_is_refused");
    fill(&rig, vol, 1);
    shutdown(&mut rig);
    let old = Arc::new(rig.fast.snapshot_durable());
    rig.start().unwrap();
    let model = fill(&rig, vol, 2);
    shutdown(&mut rig);
    let current = std::mem::replace(&mut rig.fast, old);
    refused(
        &mut rig,
        &[
            "fast device fast is older than the rest of disk group",
            "cap0",
        ],
    );
    rig.fast = current;
    rig.start().unwrap();
    check_volume(rig.dg(), vol, &model, "with the current device back");
}

/// The shutdown stamps too: an image taken while the group was open is older once it closed,
/// even with nothing written after the image.
#[test]
fn an_image_taken_while_the_group_was_open_is_refused_after_a_clean_shutdown() {
    let (mut rig, vol) =
        new_rig("an_image_taken_while_the_group_was_open_is_refused_after_a_clean_shutdown");
    fill(&rig, vol, 1);
    let old = Arc::new(rig.caps[0].snapshot_durable());
    shutdown(&mut rig);
    rig.caps[0] = old;
    refused(&mut rig, &["capacity device cap0 is older"]);
}

/// A group from before stamps (a checkpoint without them, superblocks with stamp 0) opens as
/// before; from then on it is stamped, and its own older images are refused.
#[test]
fn a_group_from_before_stamps_opens_and_is_stamped_from_then_on() {
    let (mut rig, vol) = new_rig("a_group_from_before_stamps_opens_and_is_stamped_from_then_on");
    let model = fill(&rig, vol, 3);
    shutdown(&mut rig);
    let (fast, caps) = rig.devices();
    let sbs: Vec<Superblock> = std::iter::once(&fast)
        .chain(&caps)
        .map(|d| read_superblock(d.as_ref()).unwrap().unwrap())
        .collect();
    let layout = layout_from(&sbs).unwrap();
    let mut cp = read_checkpoint(fast.as_ref(), &layout).unwrap();
    cp.device_stamps = None;
    cp.generation += 1;
    write_checkpoint(fast.as_ref(), &layout, &cp).unwrap();
    for c in &caps {
        write_stamp(c.as_ref(), 0).unwrap();
    }
    let unstamped = Arc::new(rig.caps[0].snapshot_durable());
    rig.start().unwrap();
    check_volume(rig.dg(), vol, &model, "a group from before stamps");
    shutdown(&mut rig);
    let stamp = read_superblock(&*rig.caps[0]).unwrap().unwrap().stamp;
    assert!(stamp > 1, "not stamped: {stamp}");
    rig.caps[0] = unstamped;
    refused(
        &mut rig,
        &["capacity device cap0 is older", "no opening stamp"],
    );
}

/// A power cut at each write of a shutdown, then at each write of the open after it: the
/// group opens every time with everything acknowledged, the stamps being half written or not.
#[test]
fn a_power_cut_at_any_write_of_a_shutdown_or_an_open_loses_nothing() {
    let (mut rig, vol) = new_rig("a_power_cut_at_any_write_of_a_shutdown_or_an_open_loses_nothing");
    let mut model = fill(&rig, vol, 4);
    // Some of it only in the log.
    model[..VOL_BYTES / 4].fill(5);
    rig.dg().write(vol, 0, &model[..VOL_BYTES / 4]).unwrap();
    let mut cuts = 0;
    for n in 0.. {
        assert!(n < 1000, "shutdown and open never finished");
        rig.writes_left.store(n, Ordering::SeqCst);
        let result = rig.dg.take().expect("running").shutdown();
        let cut_in_shutdown = rig.power_is_off();
        if cut_in_shutdown {
            rig.power_cut();
        } else {
            result.unwrap();
        }
        rig.writes_left.store(n, Ordering::SeqCst);
        let opened = rig.start();
        let cut_in_open = rig.power_is_off();
        if cut_in_open {
            assert!(opened.is_err(), "an open without power succeeded");
            rig.power_cut();
            rig.start()
                .unwrap_or_else(|e| panic!("open after a cut at write {n}: {e}"));
        } else {
            opened.unwrap();
        }
        check_volume(rig.dg(), vol, &model, &format!("cut at write {n}"));
        cuts += usize::from(cut_in_shutdown) + usize::from(cut_in_open);
        if !cut_in_shutdown && !cut_in_open {
            break;
        }
    }
    // Each shutdown and open stamps both capacity devices (two writes each) between two
    // checkpoints (two writes each): at least that many cuts.
    assert!(cuts >= 16, "only {cuts} cuts");
}
