//! The sizing model: a workload on a cluster design, checked for performance at peak, endurance
//! at the average write rate, capacity and protection; and the smallest cluster passing all.
//! Load spreads evenly over hosts and over the devices of a host.
use serde::Serialize;

use crate::catalog::Device;
use crate::formulas::{self, random_bytes_per_s};
use crate::protection::Protection;

/// The largest cluster the search for the smallest one considers.
pub const MAX_HOSTS: u32 = 100_000;

/// Where the VM write rate came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RateSource {
    /// VMs x IOPS per VM x write share x block size.
    Estimate { iops_per_vm: f64 },
    /// A running daemon's average host write rate.
    Measured { url: String },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Workload {
    pub vms: u32,
    /// Reads and writes per second of all VMs together, on average.
    pub iops_avg: f64,
    pub read_ratio: f64,
    pub block_size_bytes: u64,
    pub capacity_per_vm_bytes: u64,
    pub peak_to_average: f64,
    /// What the VMs write per second on average, before protection.
    pub vm_write_bytes_per_s_avg: f64,
    pub source: RateSource,
}

impl Workload {
    pub fn estimated(
        vms: u32,
        iops_per_vm: f64,
        read_ratio: f64,
        block_size_bytes: u64,
        capacity_per_vm_bytes: u64,
        peak_to_average: f64,
    ) -> Workload {
        let iops_avg = f64::from(vms) * iops_per_vm;
        Workload {
            vms,
            iops_avg,
            read_ratio,
            block_size_bytes,
            capacity_per_vm_bytes,
            peak_to_average,
            vm_write_bytes_per_s_avg: formulas::write_bytes_per_s(
                iops_avg,
                read_ratio,
                block_size_bytes,
            ),
            source: RateSource::Estimate { iops_per_vm },
        }
    }

    /// A measured write rate; the IOPS follow from the read share and block size.
    pub fn measured(
        url: &str,
        vm_write_bytes_per_s_avg: f64,
        vms: u32,
        read_ratio: f64,
        block_size_bytes: u64,
        capacity_per_vm_bytes: u64,
        peak_to_average: f64,
    ) -> Workload {
        Workload {
            vms,
            iops_avg: formulas::iops_for_write_rate(
                vm_write_bytes_per_s_avg,
                read_ratio,
                block_size_bytes,
            ),
            read_ratio,
            block_size_bytes,
            capacity_per_vm_bytes,
            peak_to_average,
            vm_write_bytes_per_s_avg,
            source: RateSource::Measured {
                url: url.to_string(),
            },
        }
    }

    pub fn vm_write_bytes_per_s_peak(&self) -> f64 {
        self.vm_write_bytes_per_s_avg * self.peak_to_average
    }

    pub fn read_iops_peak(&self) -> f64 {
        self.iops_avg * self.read_ratio * self.peak_to_average
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Design {
    pub hosts: u32,
    pub protection: Protection,
    pub cache_device: Device,
    pub cache_per_host: u32,
    pub capacity_device: Device,
    pub capacity_per_host: u32,
    /// Share of the capacity tier that may hold data (the rest is room for cleaning).
    pub capacity_fill_max: f64,
}

/// What one device of a tier carries, and what it can take.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceLoad {
    pub id: String,
    pub count: u32,
    /// Protected writes the device receives on average and at peak.
    pub write_bytes_per_s_avg: f64,
    pub write_bytes_per_s_peak: f64,
    pub drive_writes_per_day: f64,
    /// The endurance rating used (None: the device has no write-endurance rating).
    pub rated_drive_writes_per_day: Option<f64>,
    /// The steady write rate that spends the rating exactly when the warranty ends.
    pub endurance_write_bytes_per_s: Option<f64>,
    /// The VM write rate (before protection) that rate corresponds to.
    pub endurance_vm_write_bytes_per_s: Option<f64>,
    /// The IOPS, in the workload's read/write mix and block size, of that VM write rate. A mix
    /// that writes nothing has no such ceiling: JSON has no infinity, and null means "not
    /// rated", so it prints the largest number (1.7976931348623157e308).
    #[serde(serialize_with = "unlimited_as_largest")]
    pub endurance_vm_iops: Option<f64>,
    /// Average writes over the endurance rate: above 1 wears out before the warranty ends.
    pub endurance_load_ratio: Option<f64>,
    /// Share of the device's time busy at peak (1.0 = saturated).
    pub utilization_peak: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Checks {
    pub performance_ok: bool,
    pub endurance_ok: bool,
    pub capacity_ok: bool,
    pub protection_ok: bool,
}

impl Checks {
    pub fn all_ok(&self) -> bool {
        self.performance_ok && self.endurance_ok && self.capacity_ok && self.protection_ok
    }
}

/// A design evaluated at one host count.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Evaluation {
    pub hosts: u32,
    pub write_amplification: f64,
    pub vm_write_bytes_per_s_avg: f64,
    pub vm_write_bytes_per_s_peak: f64,
    pub cache: DeviceLoad,
    pub capacity: DeviceLoad,
    pub capacity_needed_bytes: f64,
    pub capacity_usable_bytes: f64,
    pub checks: Checks,
}

fn unlimited_as_largest<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    v.map(|v| v.min(f64::MAX)).serialize(s)
}

/// Which tier a load is for: the capacity tier is written in large sequential segments, so a
/// separate sequential endurance rating applies to it.
#[derive(Clone, Copy)]
enum Tier {
    Cache,
    Capacity,
}

fn endurance_fields(load: &mut DeviceLoad, dev: &Device, tier: Tier, w: &Workload, amp: f64) {
    let Some(e) = dev.endurance else { return };
    let sequential = matches!(tier, Tier::Capacity);
    let rate = formulas::sustained_write_bytes_per_s(e.budget_bytes(sequential), e.warranty_years);
    // VM bytes: a write smaller than 4 KiB costs the device a whole block.
    let scale =
        formulas::device_bytes_per_io(w.block_size_bytes) as f64 / w.block_size_bytes as f64;
    let vm_rate = rate / amp / scale;
    load.rated_drive_writes_per_day = dev.rated_dwpd(sequential);
    load.endurance_write_bytes_per_s = Some(rate);
    load.endurance_vm_write_bytes_per_s = Some(vm_rate);
    load.endurance_vm_iops = Some(formulas::iops_for_write_rate(
        vm_rate,
        w.read_ratio,
        w.block_size_bytes,
    ));
    load.endurance_load_ratio = Some(if rate > 0.0 {
        load.write_bytes_per_s_avg / rate
    } else {
        f64::INFINITY
    });
}

fn device_load(
    dev: &Device,
    count: u32,
    tier: Tier,
    w: &Workload,
    amp: f64,
    share: f64,
) -> DeviceLoad {
    // Each VM write costs the devices whole 4 KiB blocks.
    let bs = formulas::device_bytes_per_io(w.block_size_bytes);
    let scale = bs as f64 / w.block_size_bytes as f64;
    let avg = w.vm_write_bytes_per_s_avg * amp * share * scale;
    let peak = w.vm_write_bytes_per_s_peak() * amp * share * scale;
    let utilization_peak = match tier {
        // Writes land in the buffer at the workload's block size, and are read back once,
        // sequentially, to be destaged.
        Tier::Cache => {
            peak / random_bytes_per_s(dev.random_write_iops, dev.seq_write_bytes_per_s, bs)
                + peak / dev.seq_read_bytes_per_s
        }
        // Destaged writes arrive as sequential segments; VM reads are served here (the
        // worst case: nothing is still in the cache tier).
        Tier::Capacity => {
            let read_bytes_per_s = w.read_iops_peak() * share * bs as f64;
            peak / dev.seq_write_bytes_per_s
                + read_bytes_per_s
                    / random_bytes_per_s(dev.random_read_iops, dev.seq_read_bytes_per_s, bs)
        }
    };
    let mut load = DeviceLoad {
        id: dev.id.clone(),
        count,
        write_bytes_per_s_avg: avg,
        write_bytes_per_s_peak: peak,
        drive_writes_per_day: formulas::drive_writes_per_day(avg, dev.capacity_bytes),
        rated_drive_writes_per_day: None,
        endurance_write_bytes_per_s: None,
        endurance_vm_write_bytes_per_s: None,
        endurance_vm_iops: None,
        endurance_load_ratio: None,
        utilization_peak,
    };
    endurance_fields(&mut load, dev, tier, w, amp);
    load
}

/// The design with `hosts` hosts.
pub fn evaluate(w: &Workload, d: &Design, hosts: u32) -> Evaluation {
    let amp = d.protection.write_amplification();
    let hosts_f = f64::from(hosts.max(1));
    let cache_count = hosts * d.cache_per_host;
    let capacity_count = hosts * d.capacity_per_host;
    let cache_share = 1.0 / (hosts_f * f64::from(d.cache_per_host));
    let capacity_share = 1.0 / (hosts_f * f64::from(d.capacity_per_host));
    let cache = device_load(
        &d.cache_device,
        cache_count,
        Tier::Cache,
        w,
        amp,
        cache_share,
    );
    let capacity = device_load(
        &d.capacity_device,
        capacity_count,
        Tier::Capacity,
        w,
        amp,
        capacity_share,
    );
    let capacity_needed_bytes = f64::from(w.vms) * w.capacity_per_vm_bytes as f64 * amp;
    let capacity_usable_bytes =
        f64::from(capacity_count) * d.capacity_device.capacity_bytes as f64 * d.capacity_fill_max;
    let within = |ratio: Option<f64>| ratio.is_none_or(|r| r <= 1.0);
    let checks = Checks {
        performance_ok: cache.utilization_peak <= 1.0 && capacity.utilization_peak <= 1.0,
        endurance_ok: within(cache.endurance_load_ratio) && within(capacity.endurance_load_ratio),
        capacity_ok: capacity_needed_bytes <= capacity_usable_bytes,
        protection_ok: hosts >= d.protection.min_hosts(),
    };
    Evaluation {
        hosts,
        write_amplification: amp,
        vm_write_bytes_per_s_avg: w.vm_write_bytes_per_s_avg,
        vm_write_bytes_per_s_peak: w.vm_write_bytes_per_s_peak(),
        cache,
        capacity,
        capacity_needed_bytes,
        capacity_usable_bytes,
        checks,
    }
}

/// The smallest host count meeting each constraint on its own (None: not even at
/// [`MAX_HOSTS`]), the smallest meeting all, and which constraints decide it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SmallestCluster {
    pub performance_hosts: Option<u32>,
    pub endurance_hosts: Option<u32>,
    pub capacity_hosts: Option<u32>,
    pub protection_hosts: u32,
    pub hosts: Option<u32>,
    /// The constraints needing exactly `hosts` hosts ("performance", "endurance", "capacity",
    /// "protection").
    pub binding: Vec<&'static str>,
}

/// Smallest `h` in 1..=MAX_HOSTS with `ok(h)`, for an `ok` that stays true once true.
fn smallest(ok: impl Fn(u32) -> bool) -> Option<u32> {
    if !ok(MAX_HOSTS) {
        return None;
    }
    let (mut lo, mut hi) = (1u32, MAX_HOSTS);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if ok(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

pub fn smallest_cluster(w: &Workload, d: &Design) -> SmallestCluster {
    let check = |f: fn(&Checks) -> bool| smallest(|h| f(&evaluate(w, d, h).checks));
    let performance_hosts = check(|c| c.performance_ok);
    let endurance_hosts = check(|c| c.endurance_ok);
    let capacity_hosts = check(|c| c.capacity_ok);
    let protection_hosts = d.protection.min_hosts();
    let each = [
        ("performance", performance_hosts),
        ("endurance", endurance_hosts),
        ("capacity", capacity_hosts),
        ("protection", Some(protection_hosts)),
    ];
    let hosts = each
        .iter()
        .try_fold(0u32, |acc, (_, h)| h.map(|h| acc.max(h)));
    let binding = match hosts {
        Some(n) => each
            .iter()
            .filter(|(_, h)| *h == Some(n))
            .map(|(name, _)| *name)
            .collect(),
        None => each
            .iter()
            .filter(|(_, h)| h.is_none())
            .map(|(name, _)| *name)
            .collect(),
    };
    SmallestCluster {
        performance_hosts,
        endurance_hosts,
        capacity_hosts,
        protection_hosts,
        hosts,
        binding,
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
