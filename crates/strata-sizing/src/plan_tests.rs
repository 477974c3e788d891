use super::*;
use crate::catalog::{Endurance, MediaKind};
use crate::formulas::BYTES_PER_MIB;

const GIB: u64 = 1 << 30;

fn device(id: &str, capacity_bytes: u64, dwpd: Option<f64>) -> Device {
    Device {
        id: id.into(),
        name: id.into(),
        media: MediaKind::Tlc,
        capacity_bytes,
        endurance: dwpd.map(|dwpd| Endurance {
            endurance_bytes: crate::formulas::endurance_bytes_from_dwpd(capacity_bytes, dwpd, 5.0),
            sequential_endurance_bytes: None,
            warranty_years: 5.0,
        }),
        seq_read_bytes_per_s: 4e9,
        seq_write_bytes_per_s: 2e9,
        random_read_iops: 500_000.0,
        random_write_iops: 100_000.0,
        read_latency_us: None,
        write_latency_us: None,
        preferred_write_bytes: 4096,
        source: None,
        origin: "test".into(),
    }
}

fn capacity_device() -> Device {
    Device {
        seq_read_bytes_per_s: 1e9,
        seq_write_bytes_per_s: 1e9,
        random_read_iops: 10_000.0,
        ..device("cap", 10_000_000_000_000, None)
    }
}

fn design(hosts: u32, protection: Protection) -> Design {
    Design {
        hosts,
        protection,
        cache_device: device("cache", 1_000_000_000_000, Some(10.0)),
        cache_per_host: 2,
        capacity_device: capacity_device(),
        capacity_per_host: 4,
        capacity_fill_max: 0.8,
    }
}

fn workload() -> Workload {
    // 100 VMs x 1000 IOPS, 70/30, 32 KiB, 100 GiB each, peaks at twice the average.
    Workload::estimated(100, 1000.0, 0.7, 32 * 1024, 100 * GIB, 2.0)
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn the_worked_example_through_the_model() {
    // 3 DWPD x 800 GiB behind RAID-1: 28.44 MiB/s per device, 14.22 MiB/s of VM writes,
    // 1,517 IOPS of a 70/30 32K workload.
    let w = Workload::estimated(1, 1517.0, 0.7, 32 * 1024, GIB, 1.0);
    let d = Design {
        cache_device: device("a", 800 * GIB, Some(3.0)),
        cache_per_host: 1,
        ..design(1, Protection::Mirror { ftt: 1 })
    };
    let e = evaluate(&w, &d, 1);
    let rate = e.cache.endurance_write_bytes_per_s.unwrap() / BYTES_PER_MIB;
    assert_eq!(format!("{rate:.2}"), "28.44");
    let vm = e.cache.endurance_vm_write_bytes_per_s.unwrap() / BYTES_PER_MIB;
    assert_eq!(format!("{vm:.1}"), "14.2");
    assert_eq!(e.cache.endurance_vm_iops.unwrap().round(), 1517.0);
    // 1,517 IOPS is just under the rating, 1,518 just over.
    assert!(e.cache.endurance_load_ratio.unwrap() < 1.0 && e.checks.endurance_ok);
    let over = Workload::estimated(1, 1518.0, 0.7, 32 * 1024, GIB, 1.0);
    assert!(!evaluate(&over, &d, 1).checks.endurance_ok);
}

#[test]
fn hand_computed_design() {
    let w = workload();
    // 100,000 IOPS x 30% x 32,768 B.
    assert!(near(w.vm_write_bytes_per_s_avg, 983_040_000.0));
    let e = evaluate(&w, &design(4, Protection::Mirror { ftt: 1 }), 4);
    assert_eq!(e.write_amplification, 2.0);
    assert!(near(e.vm_write_bytes_per_s_peak, 1_966_080_000.0));
    // Eight cache devices share 2 x 983.04 MB/s.
    assert_eq!(e.cache.count, 8);
    assert!(near(e.cache.write_bytes_per_s_avg, 245_760_000.0));
    assert!(near(e.cache.write_bytes_per_s_peak, 491_520_000.0));
    assert!(near(e.cache.drive_writes_per_day, 21.233_664));
    assert!(near(
        e.cache.endurance_write_bytes_per_s.unwrap(),
        1e13 / 86_400.0
    ));
    assert!(near(e.cache.endurance_load_ratio.unwrap(), 2.123_366_4));
    // Peak writes over min(100K x 32 KiB, 2 GB/s) plus destage reads over 4 GB/s.
    assert!(near(e.cache.utilization_peak, 0.24576 + 0.12288));
    // Capacity devices: destage 245.76 MB/s over 1 GB/s, and 8,750 read IOPS of 32 KiB
    // over min(10K x 32 KiB, 1 GB/s).
    assert!(near(e.capacity.utilization_peak, 0.24576 + 0.875));
    assert_eq!(e.capacity.endurance_load_ratio, None);
    assert!(near(
        e.capacity_needed_bytes,
        2.0 * 100.0 * 100.0 * GIB as f64
    ));
    assert!(near(e.capacity_usable_bytes, 16.0 * 1e13 * 0.8));
    assert_eq!(
        e.checks,
        Checks {
            performance_ok: false,
            endurance_ok: false,
            capacity_ok: true,
            protection_ok: true
        }
    );
}

#[test]
fn smallest_cluster_names_the_binding_constraint() {
    let w = workload();
    let s = smallest_cluster(&w, &design(4, Protection::Mirror { ftt: 1 }));
    // Capacity devices are 112% busy at 4 hosts: 5 hosts. Endurance: 212% at 4: 9 hosts.
    assert_eq!(s.performance_hosts, Some(5));
    assert_eq!(s.endurance_hosts, Some(9));
    assert_eq!(s.capacity_hosts, Some(1));
    assert_eq!(s.protection_hosts, 3);
    assert_eq!(s.hosts, Some(9));
    assert_eq!(s.binding, vec!["endurance"]);
    let at = evaluate(&w, &design(9, Protection::Mirror { ftt: 1 }), 9);
    assert!(at.checks.all_ok(), "{:?}", at.checks);
    assert!(!evaluate(&w, &design(8, Protection::Mirror { ftt: 1 }), 8)
        .checks
        .all_ok());
}

#[test]
fn erasure_coding_amplifies_less_but_needs_more_hosts() {
    let w = Workload::estimated(10, 100.0, 0.7, 32 * 1024, 100 * GIB, 1.0);
    let ec = Protection::Erasure { data: 4, parity: 2 };
    let e = evaluate(&w, &design(6, ec), 6);
    assert!(near(e.write_amplification, 1.5));
    assert!(near(e.capacity_needed_bytes, 1.5 * 1000.0 * GIB as f64));
    let s = smallest_cluster(&w, &design(6, ec));
    assert_eq!(s.hosts, Some(6));
    assert_eq!(s.binding, vec!["protection"]);
}

#[test]
fn capacity_can_bind_and_ties_are_all_named() {
    // 1,000 VMs x 1 TiB under RAID-1: 2,000 TiB on 40 TB per host at 80%.
    let w = Workload::estimated(1000, 1.0, 0.7, 32 * 1024, 1 << 40, 1.0);
    let s = smallest_cluster(&w, &design(3, Protection::Mirror { ftt: 1 }));
    let needed = 2000.0 * (1u64 << 40) as f64 / (4.0 * 1e13 * 0.8);
    assert_eq!(s.capacity_hosts, Some(needed.ceil() as u32));
    assert_eq!(s.binding, vec!["capacity"]);
    // A tiny workload: protection's three hosts and nothing else.
    let tiny = Workload::estimated(1, 1.0, 0.7, 4096, GIB, 1.0);
    let s = smallest_cluster(&tiny, &design(3, Protection::Mirror { ftt: 1 }));
    assert_eq!((s.hosts, s.binding.clone()), (Some(3), vec!["protection"]));
    // Endurance needing exactly three hosts too: both are named.
    let rate = 1e13 / 86_400.0;
    // Per cache device: 2.9 x rate x 2 copies / (h hosts x 2 devices), at most `rate` from h = 3.
    let three = Workload::measured("http://x", rate * 2.9, 1, 0.0, 32 * 1024, GIB, 1.0);
    let s = smallest_cluster(&three, &design(3, Protection::Mirror { ftt: 1 }));
    assert_eq!(s.endurance_hosts, Some(3));
    assert_eq!(s.binding, vec!["endurance", "protection"]);
}

#[test]
fn sequential_rating_applies_to_the_capacity_tier() {
    let mut cap = capacity_device();
    cap.endurance = Some(Endurance {
        endurance_bytes: 1e15,
        sequential_endurance_bytes: Some(4e15),
        warranty_years: 5.0,
    });
    let d = Design {
        capacity_device: cap,
        ..design(4, Protection::Mirror { ftt: 1 })
    };
    let e = evaluate(&workload(), &d, 4);
    let rate = e.capacity.endurance_write_bytes_per_s.unwrap();
    assert!(near(rate, 4e15 / (5.0 * 365.0 * 86_400.0)));
    // The cache tier keeps its general rating.
    let cache_rate = e.cache.endurance_write_bytes_per_s.unwrap();
    assert!(near(cache_rate, 1e13 / 86_400.0));
}

#[test]
fn measured_rates_derive_iops() {
    let w = Workload::measured(
        "http://127.0.0.1:9090",
        14_745_600.0,
        10,
        0.7,
        32 * 1024,
        GIB,
        2.0,
    );
    assert!(near(w.iops_avg, 1500.0));
    assert!(near(w.read_iops_peak(), 1500.0 * 0.7 * 2.0));
    assert!(near(w.vm_write_bytes_per_s_peak(), 2.0 * 14_745_600.0));
}

/// A write smaller than 4 KiB costs the devices a whole 4 KiB block (Strata reads and writes
/// whole blocks): 512-byte writes wear and load the devices as 4 KiB writes of the same count,
/// and the endurance supports as many of them.
#[test]
fn writes_under_4k_cost_whole_blocks() {
    let d = design(4, Protection::Mirror { ftt: 1 });
    let at = |bs: u64| {
        let w = Workload::estimated(100, 1000.0, 0.7, bs, 100 * GIB, 2.0);
        evaluate(&w, &d, 4)
    };
    let (small, whole) = (at(512), at(4096));
    assert!(near(
        small.cache.write_bytes_per_s_avg,
        whole.cache.write_bytes_per_s_avg
    ));
    assert!(near(
        small.capacity.write_bytes_per_s_avg,
        whole.capacity.write_bytes_per_s_avg
    ));
    assert!(near(
        small.cache.utilization_peak,
        whole.cache.utilization_peak
    ));
    let (s, w) = (
        small.cache.endurance_vm_iops.unwrap(),
        whole.cache.endurance_vm_iops.unwrap(),
    );
    assert!(near(s, w), "{s} IOPS of 512 B against {w} of 4 KiB");
    // 6 KiB writes take two blocks.
    let six = at(6 * 1024);
    assert!(near(
        six.cache.write_bytes_per_s_avg,
        2.0 * whole.cache.write_bytes_per_s_avg
    ));
}
