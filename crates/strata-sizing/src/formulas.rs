//! The endurance and workload formulas, in bytes and seconds (docs/SIZING.md explains each).
//!
//! Makers state capacities and rates in decimal units (GB = 10^9 bytes); Strata prints rates
//! in binary units (MiB/s = 2^20 bytes/s). Every function here takes and returns plain bytes, so
//! the only place units meet is where a number is read or printed.

pub const SECONDS_PER_DAY: f64 = 86_400.0;
pub const DAYS_PER_YEAR: f64 = 365.0;
pub const SECONDS_PER_YEAR: f64 = DAYS_PER_YEAR * SECONDS_PER_DAY;
pub const BYTES_PER_MB: f64 = 1e6;
pub const BYTES_PER_GB: f64 = 1e9;
pub const BYTES_PER_TB: f64 = 1e12;
pub const BYTES_PER_MIB: f64 = 1_048_576.0;

/// Rated endurance: capacity x DWPD x 365 x warranty years (TBW, in bytes).
pub fn endurance_bytes_from_dwpd(capacity_bytes: u64, dwpd: f64, warranty_years: f64) -> f64 {
    capacity_bytes as f64 * dwpd * DAYS_PER_YEAR * warranty_years
}

/// The steady write rate that spends `endurance_bytes` exactly when the warranty ends.
/// For a DWPD rating this is DWPD x capacity / 86,400.
pub fn sustained_write_bytes_per_s(endurance_bytes: f64, warranty_years: f64) -> f64 {
    if warranty_years <= 0.0 {
        return 0.0;
    }
    endurance_bytes / (warranty_years * SECONDS_PER_YEAR)
}

/// Full-device writes per day at a steady write rate.
pub fn drive_writes_per_day(write_bytes_per_s: f64, capacity_bytes: u64) -> f64 {
    if capacity_bytes == 0 {
        return 0.0;
    }
    write_bytes_per_s * SECONDS_PER_DAY / capacity_bytes as f64
}

/// Bytes written per second by `iops` operations of `block_bytes`, `read_ratio` of them reads.
pub fn write_bytes_per_s(iops: f64, read_ratio: f64, block_bytes: u64) -> f64 {
    iops * (1.0 - read_ratio) * block_bytes as f64
}

/// The total IOPS (reads and writes in the given mix) whose writes add up to
/// `write_bytes_per_s`: the inverse of [`write_bytes_per_s`]. Infinite for a read-only mix.
pub fn iops_for_write_rate(write_bytes_per_s: f64, read_ratio: f64, block_bytes: u64) -> f64 {
    let write_bytes_per_op = (1.0 - read_ratio) * block_bytes as f64;
    if write_bytes_per_op <= 0.0 {
        return f64::INFINITY;
    }
    write_bytes_per_s / write_bytes_per_op
}

/// Strata reads and writes its devices in whole 4 KiB blocks.
pub const DEVICE_BLOCK_BYTES: u64 = 4096;

/// What one I/O of `block_bytes` costs a device: whole 4 KiB blocks (a 512-byte write is a
/// 4 KiB read-modify-write).
pub fn device_bytes_per_io(block_bytes: u64) -> u64 {
    block_bytes.div_ceil(DEVICE_BLOCK_BYTES).max(1) * DEVICE_BLOCK_BYTES
}

/// Bytes per second a device moves doing random operations of `block_bytes`: its rated 4 KiB
/// IOPS until the block size makes the sequential rate the limit.
pub fn random_bytes_per_s(iops_4k: f64, seq_bytes_per_s: f64, block_bytes: u64) -> f64 {
    (iops_4k * block_bytes as f64).min(seq_bytes_per_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const GB: u64 = 1_000_000_000;

    fn close(a: f64, b: f64, tolerance: f64) -> bool {
        (a - b).abs() <= tolerance
    }

    /// CONTEXT.md section 3: MB/s = DWPD x capacity_GB x 1024 / 86,400; 3 DWPD x 800 GB gives
    /// 28.44 MB/s. The x1024 makes its GB and MB binary: 800 GiB and MiB/s.
    #[test]
    fn worked_example_3_dwpd_800_gb_is_28_44_mib_per_s() {
        let endurance = endurance_bytes_from_dwpd(800 * GIB, 3.0, 5.0);
        let rate = sustained_write_bytes_per_s(endurance, 5.0) / BYTES_PER_MIB;
        assert!(close(rate, 3.0 * 800.0 * 1024.0 / 86_400.0, 1e-9), "{rate}");
        assert_eq!(format!("{rate:.2}"), "28.44");
        // RAID-1 writes every VM byte twice: half of it is left for VM writes.
        assert_eq!(format!("{:.1}", rate / 2.0), "14.2");
    }

    #[test]
    fn the_same_drive_in_decimal_units_sustains_less() {
        // A real "800 GB" drive holds 800 x 10^9 bytes: 27.78 MB/s, or 26.49 MiB/s.
        let endurance = endurance_bytes_from_dwpd(800 * GB, 3.0, 5.0);
        let rate = sustained_write_bytes_per_s(endurance, 5.0);
        assert_eq!(format!("{:.2}", rate / BYTES_PER_MB), "27.78");
        assert_eq!(format!("{:.2}", rate / BYTES_PER_MIB), "26.49");
        // TBW = capacity x DWPD x 365 x 5 = 4,380 TB.
        assert!(close(endurance / BYTES_PER_TB, 4380.0, 1e-9));
    }

    #[test]
    fn a_70_30_workload_of_32k_at_1500_iops_writes_about_14_mib_per_s() {
        let rate = write_bytes_per_s(1500.0, 0.7, 32 * 1024);
        // 1500 x 0.3 x 32768 = 14,745,600 bytes/s = 14.06 MiB/s.
        assert!(close(rate, 14_745_600.0, 1e-6));
        assert_eq!(format!("{:.2}", rate / BYTES_PER_MIB), "14.06");
        let back = iops_for_write_rate(rate, 0.7, 32 * 1024);
        assert!(close(back, 1500.0, 1e-9));
        // 14.22 MiB/s of VM writes (the RAID-1 figure above) is 1,517 IOPS at 70/30 32K.
        let iops = iops_for_write_rate(28.444_444 / 2.0 * BYTES_PER_MIB, 0.7, 32 * 1024);
        assert_eq!(iops.round(), 1517.0);
    }

    #[test]
    fn drive_writes_per_day_of_a_rate() {
        // 800 GB a day is one drive write per day of an 800 GB drive.
        let rate = 800.0 * BYTES_PER_GB / SECONDS_PER_DAY;
        assert!(close(drive_writes_per_day(rate, 800 * GB), 1.0, 1e-12));
        assert_eq!(drive_writes_per_day(rate, 0), 0.0);
        assert_eq!(sustained_write_bytes_per_s(1e12, 0.0), 0.0);
        assert!(iops_for_write_rate(1.0, 1.0, 4096).is_infinite());
    }

    #[test]
    fn random_rate_is_iops_bound_until_bandwidth_bound() {
        // 500K IOPS x 4 KiB = 2.05 GB/s, under a 3 GB/s sequential rate.
        assert!(close(
            random_bytes_per_s(500_000.0, 3e9, 4096),
            2_048_000_000.0,
            1e-3
        ));
        // At 32 KiB the same IOPS would be 16 GB/s: the 3 GB/s rate binds.
        assert_eq!(random_bytes_per_s(500_000.0, 3e9, 32768), 3e9);
    }
}
