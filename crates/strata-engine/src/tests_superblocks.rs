//! Superblock copies damaged while the group was closed: a start rewrites a damaged copy of
//! the fast superblock from the good one (as it does a capacity device's), only once the open
//! writes, and never the good copy; both copies damaged is refused, saying so and what that
//! means for the device.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use strata_device::{AlignedBuf, Device, MemDevice};

use crate::format::{Superblock, SuperblockRead, BLOCK, BLOCK_U64};
use crate::tests::{seed_for, small_cfg, Rig, MIB};
use crate::*;

/// A byte of a superblock's padding: flipped, it fails the copy's checksum alone.
const PADDING_BYTE: u64 = 200;

/// A group with a volume and data, closed cleanly.
fn closed_group(test: &str) -> Rig {
    let mut rig = Rig::new(32 * MIB, &[24 * MIB], small_cfg(), seed_for(test));
    let dg = rig.group().clone();
    let v = dg.create_volume("v", MIB).unwrap().id;
    dg.write(v, 0, &[0x5a; BLOCK]).unwrap();
    drop(dg);
    rig.dg.take().unwrap().shutdown().unwrap();
    rig
}

fn superblock_copy(dev: &MemDevice, copy: u64) -> Vec<u8> {
    let mut b = AlignedBuf::new_zeroed(BLOCK);
    dev.read_at(&mut b, copy * BLOCK_U64).unwrap();
    b.to_vec()
}

fn write_copy(dev: &MemDevice, copy: u64, bytes: &[u8]) {
    let mut b = AlignedBuf::new_zeroed(BLOCK);
    b.copy_from_slice(bytes);
    dev.write_at(&b, copy * BLOCK_U64).unwrap();
}

fn damage_copy(dev: &MemDevice, copy: u64) {
    dev.flip_bit(copy * BLOCK_U64 + PADDING_BYTE, 3).unwrap();
}

fn name(copy: u64) -> &'static str {
    ["A", "B"][copy as usize]
}

/// Either copy of the fast superblock damaged: the start rewrites it from the other, which it
/// leaves as it was, and the group opens with its data.
#[test]
fn a_damaged_fast_superblock_copy_is_rewritten_at_start_from_the_other() {
    for copy in [0, 1] {
        let mut rig = closed_group("a_damaged_fast_superblock_copy_is_rewritten_at_start");
        let good = superblock_copy(&rig.fast, 0);
        assert_eq!(
            superblock_copy(&rig.fast, 1),
            good,
            "format writes two equal copies"
        );
        damage_copy(&rig.fast, copy);
        assert_ne!(superblock_copy(&rig.fast, copy), good);
        rig.start()
            .expect("a start with one fast superblock copy damaged");
        for c in [0, 1] {
            assert!(
                superblock_copy(&rig.fast, c) == good,
                "copy {} damaged: copy {} is not the good superblock after the start",
                name(copy),
                name(c)
            );
        }
        let mut b = AlignedBuf::new_zeroed(BLOCK);
        let v = rig.dg().volume("v").unwrap().id;
        rig.dg().read(v, 0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a), "copy {}", name(copy));
    }
}

/// A copy B that decodes but differs from copy A, which the group was identified by (here it
/// names another device size): rewritten from copy A, as a capacity device's is at its stamp.
#[test]
fn a_fast_superblock_copy_that_differs_is_rewritten_from_the_one_the_start_used() {
    let mut rig = closed_group("a_fast_superblock_copy_that_differs_is_rewritten");
    let good = superblock_copy(&rig.fast, 0);
    let SuperblockRead::Valid(mut other) = Superblock::decode(&good) else {
        panic!("copy A does not decode");
    };
    other.device_size_bytes += MIB;
    write_copy(&rig.fast, 1, &other.encode());
    assert_ne!(superblock_copy(&rig.fast, 1), good);
    rig.start()
        .expect("a start with the fast superblock copies different");
    assert!(superblock_copy(&rig.fast, 0) == good, "copy A was written");
    assert!(
        superblock_copy(&rig.fast, 1) == good,
        "copy B was not rewritten"
    );
}

/// An open stopped before it writes (here at the probe past the log's end, docs/FORMAT.md
/// §5.1) leaves the damaged copy as it was: the next open rewrites it.
#[test]
fn an_open_stopped_before_it_writes_leaves_a_damaged_fast_superblock_copy_as_it_was() {
    let mut rig = closed_group("an_open_stopped_before_it_writes_leaves_a_damaged_copy");
    rig.start().unwrap();
    let dg = rig.group().clone();
    let v = dg.volume("v").unwrap().id;
    for lba in 1..8u64 {
        dg.write(v, lba * BLOCK_U64, &[0x6b; BLOCK]).unwrap();
    }
    drop(dg);
    rig.power_cut();
    let good = superblock_copy(&rig.fast, 1);
    damage_copy(&rig.fast, 0);
    let damaged = superblock_copy(&rig.fast, 0);

    let mut ctl = OpenControl::default();
    let abandon = ctl.abandon.clone();
    ctl.hook = Some(Arc::new(move |step, _| {
        if step == OpenStep::CheckingEnd {
            abandon.store(true, Ordering::Relaxed);
        }
    }));
    let written = |rig: &Rig| rig.fast.stats().write_bytes + rig.caps[0].stats().write_bytes;
    let before = written(&rig);
    let stopped = rig.start_with(&ctl);
    assert!(
        matches!(stopped, Err(EngineError::Cancelled(_))),
        "the open was not stopped at the probe: {stopped:?}"
    );
    assert_eq!(written(&rig), before, "the stopped open wrote");
    assert!(superblock_copy(&rig.fast, 0) == damaged);

    rig.start().expect("the open after the stopped one");
    assert!(
        superblock_copy(&rig.fast, 0) == good,
        "copy A was not rewritten"
    );
    assert!(superblock_copy(&rig.fast, 1) == good, "copy B was written");
}

/// Both copies of a device's superblock damaged: the start is refused, saying that both are
/// damaged and what that means for the device, and writes nothing. It said "device fast:
/// superblock checksum mismatch".
#[test]
fn both_superblock_copies_damaged_are_named_with_what_that_means() {
    let mut rig = closed_group("both_superblock_copies_damaged_are_named");
    let copies = "copy A: superblock checksum mismatch; copy B: superblock checksum mismatch";
    let advice = "Check that the path names the right device; if it does, something overwrote \
                  the device's first 8 KiB, or the device is failing";
    let cases = [
        (
            rig.fast.clone(),
            format!(
                "fast device fast: both superblock copies are damaged ({copies}); the disk \
                 group cannot be opened without one, as the superblock says where the group's \
                 metadata and write log are on this device. {advice}"
            ),
        ),
        (
            rig.caps[0].clone(),
            format!(
                "capacity device cap0: both superblock copies are damaged ({copies}); the \
                 device cannot be identified (which disk group it belongs to, and which of the \
                 group's capacity devices it is), so the group cannot be opened with it. \
                 {advice}"
            ),
        ),
    ];
    for (dev, expected) in cases {
        let kept = superblock_copy(&dev, 1);
        damage_copy(&dev, 0);
        damage_copy(&dev, 1);
        let written = |rig: &Rig| rig.fast.stats().write_bytes + rig.caps[0].stats().write_bytes;
        let before = written(&rig);
        let e = rig.start().expect_err("a start with both copies damaged");
        assert_eq!(e.to_string(), expected);
        assert_eq!(
            written(&rig),
            before,
            "{}: the refused start wrote",
            dev.name()
        );
        write_copy(&dev, 0, &kept);
        write_copy(&dev, 1, &kept);
    }
    rig.start().expect("the start with the copies put back");
}
