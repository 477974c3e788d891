//! Strata's device catalog, endurance formulas and cluster sizing (`strata size`).
//!
//! - `catalog`: built-in devices (catalog.toml) plus user catalog files;
//! - `formulas`: endurance and workload arithmetic in bytes and seconds;
//! - `protection`: RAID-1 / FTT=N / erasure coding and what they cost;
//! - `plan`: a workload on a design, the checks and the smallest cluster;
//! - `render`: the table and the JSON of `strata size`.
use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

pub mod catalog;
pub mod formulas;
mod metrics;
pub mod plan;
pub mod protection;
mod render;
mod units;

pub use catalog::{Catalog, Device, Endurance, MediaKind};
pub use plan::{Design, Evaluation, SmallestCluster, Workload};
pub use protection::Protection;

#[derive(Debug, thiserror::Error)]
pub enum SizingError {
    #[error("{0}")]
    Invalid(String),
    #[error("device catalog {path}: {reason}")]
    Catalog { path: String, reason: String },
    #[error("unknown device {id:?}{hint}")]
    UnknownDevice { id: String, hint: String },
    #[error("--from-metrics {url}: {reason}")]
    Metrics { url: String, reason: String },
}

impl SizingError {
    /// Whether the question was wrong, a usage error (exit 2), rather than something failing
    /// (exit 1): an id on the command line that the catalog lacks, flags that do not go
    /// together. A bad catalog file is an error of its own, found before any id is looked up.
    pub fn is_usage_error(&self) -> bool {
        match self {
            SizingError::Invalid(_) | SizingError::UnknownDevice { .. } => true,
            SizingError::Catalog { .. } | SizingError::Metrics { .. } => false,
        }
    }
}

/// Flags of `strata size`.
#[derive(Debug, Clone, Args)]
pub struct SizeArgs {
    /// List the device catalog (built-in entries and --catalog files) and exit.
    #[arg(long)]
    pub list_devices: bool,
    /// Extra device catalog file (TOML, same shape as the built-in one); repeatable. An entry
    /// with a built-in id replaces that entry.
    #[arg(long = "catalog", value_name = "FILE")]
    pub catalog_files: Vec<PathBuf>,
    /// Number of VMs.
    #[arg(long, value_name = "N", required_unless_present = "list_devices",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub vms: Option<u32>,
    /// Average IOPS of one VM, reads and writes together.
    #[arg(long, value_name = "IOPS", value_parser = units::parse_iops,
          required_unless_present_any = ["list_devices", "from_metrics"])]
    pub iops_per_vm: Option<f64>,
    /// Share of reads, in percent.
    #[arg(long, value_name = "PCT", default_value = "70", value_parser = units::parse_read_pct)]
    pub read_pct: f64,
    /// Size of one I/O, e.g. 4K, 32K (binary units).
    #[arg(long, value_name = "SIZE", default_value = "32K", value_parser = units::parse_block_size)]
    pub block_size: u64,
    /// Provisioned capacity of one VM, e.g. 300G (binary units).
    #[arg(long, value_name = "SIZE", required_unless_present = "list_devices",
          value_parser = units::parse_capacity)]
    pub capacity_per_vm: Option<u64>,
    /// Peak IOPS over average IOPS: performance is checked at peak, endurance at the average.
    #[arg(long, value_name = "FACTOR", default_value = "1", value_parser = units::parse_peak)]
    pub peak_to_average: f64,
    /// raid1, ftt=N (N+1 copies) or ec=K+M (K data + M parity fragments).
    #[arg(long, value_name = "POLICY", default_value = "raid1", value_parser = Protection::parse)]
    pub protection: Protection,
    /// Hosts in the cluster.
    #[arg(long, value_name = "N", required_unless_present = "list_devices",
          value_parser = clap::value_parser!(u32).range(1..=plan::MAX_HOSTS as i64))]
    pub hosts: Option<u32>,
    /// Catalog id of the cache (fast-tier) device; see --list-devices.
    #[arg(long, value_name = "ID", required_unless_present = "list_devices")]
    pub cache_device: Option<String>,
    /// Cache devices per host.
    #[arg(long, value_name = "N", default_value = "1",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub cache_per_host: u32,
    /// Catalog id of the capacity device.
    #[arg(long, value_name = "ID", required_unless_present = "list_devices")]
    pub capacity_device: Option<String>,
    /// Capacity devices per host.
    #[arg(long, value_name = "N", default_value = "1",
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub capacity_per_host: u32,
    /// Most of the capacity tier that data may fill, a ratio or a percentage (the rest is room
    /// for cleaning).
    #[arg(long, value_name = "RATIO", default_value = "80%", value_parser = units::parse_fill)]
    pub capacity_fill_max: f64,
    /// Take the VM write rate from a running daemon's admin API (its average host write rate
    /// since start) instead of VMs x IOPS x write share x block size. URL: the admin address
    /// (http://HOST:PORT), or its /metrics page's.
    #[arg(long, value_name = "URL", conflicts_with = "iops_per_vm")]
    pub from_metrics: Option<String>,
}

/// The whole answer of `strata size`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub workload: Workload,
    pub design: Design,
    pub evaluation: Evaluation,
    pub smallest_cluster: SmallestCluster,
}

impl Report {
    pub fn new(workload: Workload, design: Design) -> Report {
        let evaluation = plan::evaluate(&workload, &design, design.hosts);
        let smallest_cluster = plan::smallest_cluster(&workload, &design);
        Report {
            workload,
            design,
            evaluation,
            smallest_cluster,
        }
    }
}

fn required<T: Clone>(value: &Option<T>, flag: &str) -> Result<T, SizingError> {
    value
        .clone()
        .ok_or_else(|| SizingError::Invalid(format!("{flag} is required")))
}

fn workload(args: &SizeArgs) -> Result<Workload, SizingError> {
    let vms = required(&args.vms, "--vms")?;
    let capacity_per_vm = required(&args.capacity_per_vm, "--capacity-per-vm")?;
    let read_ratio = args.read_pct / 100.0;
    if let Some(url) = &args.from_metrics {
        if read_ratio >= 1.0 {
            return Err(SizingError::Invalid(
                "--from-metrics needs --read-pct below 100: IOPS are derived from the write rate"
                    .into(),
            ));
        }
        let rate = metrics::measured_write_bytes_per_s(url)?;
        return Ok(Workload::measured(
            url.trim().trim_end_matches('/'),
            rate,
            vms,
            read_ratio,
            args.block_size,
            capacity_per_vm,
            args.peak_to_average,
        ));
    }
    let iops_per_vm = required(&args.iops_per_vm, "--iops-per-vm (or --from-metrics URL)")?;
    Ok(Workload::estimated(
        vms,
        iops_per_vm,
        read_ratio,
        args.block_size,
        capacity_per_vm,
        args.peak_to_average,
    ))
}

fn design(args: &SizeArgs, catalog: &Catalog) -> Result<Design, SizingError> {
    Ok(Design {
        hosts: required(&args.hosts, "--hosts")?,
        protection: args.protection,
        cache_device: catalog
            .get(&required(&args.cache_device, "--cache-device")?)?
            .clone(),
        cache_per_host: args.cache_per_host.max(1),
        capacity_device: catalog
            .get(&required(&args.capacity_device, "--capacity-device")?)?
            .clone(),
        capacity_per_host: args.capacity_per_host.max(1),
        capacity_fill_max: args.capacity_fill_max,
    })
}

/// The exit status of `strata size` when the design fails a check: the report is printed, as
/// for a design that passes, and a script tells the two apart without parsing it (as
/// `strata scrub` exits 3 when it found damage). 1 is an error, 2 a usage error.
pub const EXIT_CHECK_FAILED: u8 = 3;

/// What `strata size` prints, and whether the design passed every check.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// A table, or JSON.
    pub text: String,
    /// Every check passed at `--hosts` (always true for `--list-devices`).
    pub checks_passed: bool,
}

/// Runs `strata size`: the text to print (a table, or JSON when `json`) and the verdict.
pub fn run(args: &SizeArgs, json: bool) -> Result<Outcome, SizingError> {
    let catalog = Catalog::load(&args.catalog_files)?;
    if args.list_devices {
        return Ok(Outcome {
            text: render::device_list(&catalog, json),
            checks_passed: true,
        });
    }
    // Devices first: a typo in an id is reported before the daemon is asked anything.
    let design = design(args, &catalog)?;
    let report = Report::new(workload(args)?, design);
    let text = if json {
        render::json(&report)
    } else {
        render::table(&report)
    };
    Ok(Outcome {
        text,
        checks_passed: report.evaluation.checks.all_ok(),
    })
}

/// Joins a possibly multi-line message into one line.
pub(crate) fn one_line(text: &str) -> String {
    text.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// An OS error as a short reason ("connection refused", "no such file or directory").
pub(crate) fn io_reason(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::ConnectionRefused => "connection refused".into(),
        K::NotFound => "no such file or directory".into(),
        K::PermissionDenied => "permission denied".into(),
        K::TimedOut => "timed out".into(),
        _ => {
            let text = e.to_string();
            match text.find(" (os error") {
                Some(i) => text[..i].to_string(),
                None => text,
            }
        }
    }
}

#[cfg(test)]
#[path = "lib_tests.rs"]
mod tests;
