use std::sync::Arc;

use super::*;
use crate::test_util::{self, pattern};
use crate::AlignedBuf;

const MIB: u64 = 1 << 20;

fn read_block(dev: &MemDevice, offset: u64) -> AlignedBuf {
    let mut buf = AlignedBuf::new_zeroed(BLOCK_SIZE);
    dev.read_at(&mut buf, offset).unwrap();
    buf
}

fn no_tearing(seed: u64, crash_keep_rate: f64) -> FaultConfig {
    FaultConfig {
        seed,
        crash_keep_rate,
        torn_write_on_crash: false,
        ..FaultConfig::default()
    }
}

#[test]
fn contract_checks() {
    let dev = MemDevice::new("mem", 8 * MIB);
    test_util::check_rejects_bad_io(&dev);
    test_util::check_read_after_write(&dev);
    test_util::check_discard_counted(&dev);
    test_util::check_concurrent_writers(Arc::new(MemDevice::new("mem", 8 * MIB)));
    assert!(dev.stats().errors >= 10);
    assert_eq!(dev.io_backend_name(), "memory");
}

#[test]
fn size_rounds_down_and_storage_is_sparse() {
    let dev = MemDevice::new("big", (16 << 30) + 100);
    assert_eq!(dev.size_bytes(), 16 << 30);
    dev.write_at(&pattern(1, 3), (16 << 30) - BLOCK).unwrap();
    assert_eq!(dev.stored_bytes(), BLOCK);
    dev.discard(0, 16 << 30).unwrap();
    assert_eq!(dev.unflushed_blocks(), 1);
}

#[test]
fn flushed_data_survives_every_crash() {
    for seed in 0..20 {
        let dev = MemDevice::with_faults("mem", MIB, FaultConfig::seeded(seed));
        dev.write_at(&pattern(8, 1), 0).unwrap();
        dev.flush().unwrap();
        dev.write_at(&pattern(8, 2), 8 * BLOCK).unwrap();
        dev.crash();
        let mut back = AlignedBuf::new_zeroed(8 * BLOCK_SIZE);
        dev.read_at(&mut back, 0).unwrap();
        assert_eq!(back, pattern(8, 1), "seed {seed}");
    }
}

#[test]
fn unflushed_data_all_lost_or_all_kept_at_extreme_rates() {
    let lose = MemDevice::with_faults("mem", MIB, no_tearing(1, 0.0));
    lose.write_at(&pattern(4, 5), 0).unwrap();
    let report = lose.crash();
    assert_eq!(report.lost_offsets, vec![0, BLOCK, 2 * BLOCK, 3 * BLOCK]);
    assert!(read_block(&lose, 0).iter().all(|&b| b == 0));

    let keep = MemDevice::with_faults("mem", MIB, no_tearing(1, 1.0));
    keep.write_at(&pattern(4, 5), 0).unwrap();
    assert_eq!(keep.crash().kept_offsets.len(), 4);
    let mut back = AlignedBuf::new_zeroed(4 * BLOCK_SIZE);
    keep.read_at(&mut back, 0).unwrap();
    assert_eq!(back, pattern(4, 5));
}

/// Runs a fixed workload and crash on a device seeded with `seed`; returns what survived.
fn crash_outcome(seed: u64) -> (CrashReport, Vec<u8>) {
    let dev = MemDevice::with_faults("mem", MIB, FaultConfig::seeded(seed));
    dev.write_at(&pattern(16, 1), 0).unwrap();
    dev.flush().unwrap();
    dev.write_at(&pattern(64, 2), 0).unwrap();
    dev.discard(8 * BLOCK, 4 * BLOCK).unwrap();
    let report = dev.crash();
    let mut back = AlignedBuf::new_zeroed(64 * BLOCK_SIZE);
    dev.read_at(&mut back, 0).unwrap();
    (report, back.to_vec())
}

#[test]
fn same_seed_replays_same_crash() {
    let (report_a, data_a) = crash_outcome(7);
    let (report_b, data_b) = crash_outcome(7);
    assert_eq!(report_a, report_b);
    assert_eq!(data_a, data_b);
    let (report_c, _) = crash_outcome(8);
    assert_ne!(
        report_a, report_c,
        "64 independent coin flips should differ between seeds"
    );
    assert_eq!(
        report_a.kept_offsets.len() + report_a.lost_offsets.len(),
        63
    );
    assert!(report_a.torn.is_some());
}

#[test]
fn torn_block_mixes_new_prefix_over_old() {
    let faults = FaultConfig {
        crash_keep_rate: 0.0,
        ..FaultConfig::seeded(3)
    };
    let dev = MemDevice::with_faults("mem", MIB, faults);
    let mut old = AlignedBuf::new_zeroed(BLOCK_SIZE);
    old.fill(0x55);
    dev.write_at(&old, 4 * BLOCK).unwrap();
    dev.flush().unwrap();
    let mut new = AlignedBuf::new_zeroed(BLOCK_SIZE);
    new.fill(0xAA);
    dev.write_at(&new, 4 * BLOCK).unwrap();
    let report = dev.crash();
    let Some((offset, sectors)) = report.torn else {
        panic!("no torn block: {report:?}")
    };
    assert_eq!(offset, 4 * BLOCK);
    assert!((1..8).contains(&sectors));
    let split = sectors as usize * SECTOR_SIZE;
    let back = read_block(&dev, offset);
    assert!(back[..split].iter().all(|&b| b == 0xAA));
    assert!(back[split..].iter().all(|&b| b == 0x55));
}

#[test]
fn discard_reads_zero_and_is_volatile_until_flush() {
    let dev = MemDevice::with_faults("mem", MIB, no_tearing(1, 0.0));
    dev.write_at(&pattern(2, 4), 0).unwrap();
    dev.flush().unwrap();
    dev.discard(0, 2 * BLOCK).unwrap();
    assert!(read_block(&dev, 0).iter().all(|&b| b == 0));
    dev.crash();
    assert_eq!(
        read_block(&dev, 0),
        pattern(1, 4),
        "an unflushed discard may be undone"
    );
    dev.discard(0, 2 * BLOCK).unwrap();
    dev.flush().unwrap();
    dev.crash();
    assert!(read_block(&dev, BLOCK).iter().all(|&b| b == 0));
    assert_eq!(dev.stored_bytes(), 0);
}

#[test]
fn one_shot_faults_fail_exactly_n_calls() {
    let dev = MemDevice::new("mem", MIB);
    let data = pattern(1, 1);
    dev.fail_next_writes(2);
    assert!(matches!(
        dev.write_at(&data, 0),
        Err(DeviceError::Io { .. })
    ));
    assert!(dev.write_at(&data, 0).is_err());
    assert!(dev.write_at(&data, 0).is_ok());
    dev.fail_next_reads(1);
    let mut buf = AlignedBuf::new_zeroed(BLOCK_SIZE);
    assert!(dev.read_at(&mut buf, 0).is_err());
    assert!(dev.read_at(&mut buf, 0).is_ok());
    dev.fail_next_flushes(1);
    assert!(dev.flush().is_err());
    assert_eq!(
        dev.unflushed_blocks(),
        1,
        "a failed one-shot flush persists nothing"
    );
    assert!(dev.flush().is_ok());
    let stats = dev.stats();
    assert_eq!(
        (
            stats.errors,
            stats.write_ops,
            stats.read_ops,
            stats.flush_ops
        ),
        (4, 1, 1, 1)
    );
}

#[test]
fn rate_faults_return_errors_until_cleared() {
    let faults = FaultConfig {
        read_error_rate: 1.0,
        write_error_rate: 1.0,
        flush_error_rate: 1.0,
        ..FaultConfig::seeded(9)
    };
    let dev = MemDevice::with_faults("mem", MIB, faults);
    let mut buf = pattern(8, 1);
    assert!(dev.write_at(&buf, 0).is_err());
    assert!(dev.read_at(&mut buf, 0).is_err());
    assert!(dev.flush().is_err());
    assert_eq!(dev.stats().errors, 3);
    dev.clear_faults();
    assert!(dev.write_at(&buf, 0).is_ok());
    assert!(dev.read_at(&mut buf, 0).is_ok());
    assert!(dev.flush().is_ok());
}

#[test]
fn partial_error_rates_are_replayable() {
    let run = |seed| {
        let faults = FaultConfig {
            write_error_rate: 0.3,
            ..FaultConfig::seeded(seed)
        };
        let dev = MemDevice::with_faults("mem", MIB, faults);
        let data = pattern(1, 1);
        (0..64)
            .map(|i| dev.write_at(&data, i * BLOCK).is_ok())
            .collect::<Vec<bool>>()
    };
    let first = run(11);
    assert_eq!(first, run(11));
    let failures = first.iter().filter(|ok| !**ok).count();
    assert!(
        (1..64).contains(&failures),
        "{failures} failures of 64 at rate 0.3"
    );
}

#[test]
fn flip_bit_corrupts_stored_content() {
    let dev = MemDevice::new("mem", MIB);
    dev.write_at(&pattern(1, 6), BLOCK).unwrap();
    dev.flush().unwrap();
    dev.flip_bit(BLOCK + 100, 3).unwrap();
    let back = read_block(&dev, BLOCK);
    let mut expected = pattern(1, 6);
    expected[100] ^= 1 << 3;
    assert_eq!(back, expected);
    dev.flip_bit(2 * BLOCK, 0).unwrap();
    assert_eq!(
        read_block(&dev, 2 * BLOCK)[0],
        1,
        "flipping a never-written block"
    );
    assert!(matches!(
        dev.flip_bit(MIB, 0),
        Err(DeviceError::OutOfRange { .. })
    ));
}

#[test]
fn bit_flip_on_read_is_transient() {
    let faults = FaultConfig {
        bit_flip_on_read_rate: 1.0,
        ..FaultConfig::seeded(5)
    };
    let dev = MemDevice::with_faults("mem", MIB, faults);
    let data = pattern(2, 8);
    dev.write_at(&data, 0).unwrap();
    let mut back = AlignedBuf::new_zeroed(2 * BLOCK_SIZE);
    dev.read_at(&mut back, 0).unwrap();
    let differing_bits: u32 = back
        .iter()
        .zip(data.iter())
        .map(|(a, b)| (a ^ b).count_ones())
        .sum();
    assert_eq!(differing_bits, 1);
    dev.clear_faults();
    dev.read_at(&mut back, 0).unwrap();
    assert_eq!(back, data);
}

#[test]
fn snapshot_durable_holds_only_flushed_data() {
    let dev = MemDevice::new("mem", MIB);
    dev.write_at(&pattern(1, 1), 0).unwrap();
    dev.flush().unwrap();
    dev.write_at(&pattern(1, 2), BLOCK).unwrap();
    let reopened = dev.snapshot_durable();
    assert_eq!(read_block(&reopened, 0), pattern(1, 1));
    assert!(read_block(&reopened, BLOCK).iter().all(|&b| b == 0));
    assert_eq!(read_block(&dev, BLOCK), pattern(1, 2));
    assert_eq!(reopened.stats().write_ops, 0);
}

#[test]
fn set_faults_reseeds() {
    let dev = MemDevice::new("mem", MIB);
    let faults = FaultConfig {
        write_error_rate: 0.5,
        ..FaultConfig::seeded(21)
    };
    let data = pattern(1, 1);
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        dev.set_faults(faults.clone());
        outcomes.push(
            (0..32)
                .map(|i| dev.write_at(&data, i * BLOCK).is_ok())
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(outcomes[0], outcomes[1]);
    assert_eq!(dev.faults(), faults);
}

#[test]
fn a_space_limit_fails_writes_that_need_room_with_enospc_and_a_discard_gives_room_back() {
    let dev = MemDevice::new("sparse", 8 * MIB);
    dev.write_at(&pattern(2, 1), 0).unwrap();
    dev.set_space_limit(Some(4 * BLOCK));
    // Overwriting blocks that hold content needs no room.
    dev.write_at(&pattern(2, 2), 0).unwrap();
    // Three new blocks where two fit: the two land, the write fails with ENOSPC.
    let err = dev.write_at(&pattern(3, 3), 4 * BLOCK).unwrap_err();
    assert!(err.is_out_of_room(), "{err}");
    assert!(err.to_string().contains("No space left on device"), "{err}");
    assert_eq!(
        &read_block(&dev, 4 * BLOCK)[..],
        &pattern(3, 3)[..BLOCK_SIZE]
    );
    assert_eq!(&read_block(&dev, 6 * BLOCK)[..], &[0u8; BLOCK_SIZE][..]);
    assert_eq!(dev.stored_bytes(), 4 * BLOCK);
    // Room given back by a discard is taken again, flushed or not.
    dev.discard(0, BLOCK).unwrap();
    dev.write_at(&pattern(1, 4), 6 * BLOCK).unwrap();
    dev.flush().unwrap();
    assert!(dev
        .write_at(&pattern(1, 5), 7 * BLOCK)
        .unwrap_err()
        .is_out_of_room());
    dev.set_space_limit(None);
    dev.write_at(&pattern(1, 5), 7 * BLOCK).unwrap();
    // An injected EIO is not out of room.
    dev.fail_next_writes(1);
    assert!(!dev
        .write_at(&pattern(1, 6), 0)
        .unwrap_err()
        .is_out_of_room());
}
