//! The flags of `strata bench` and their check: everything is validated here, while the
//! command line is parsed and before anything connects, so a refused run touches nothing and
//! exits as clap's other usage errors do (status 2).
use std::path::PathBuf;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{ArgMatches, Args, FromArgMatches};

use crate::run::Plan;
use crate::workload::{
    self, parse_duration, parse_pct, parse_size, parse_steps, Mode, TargetUri, Topology,
};
use crate::BenchError;

/// Flags of `strata bench` that passed `plan_of`: parsing them checks every combination, so
/// a refused combination is a usage error like an unknown flag.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    pub flags: BenchFlags,
}

impl BenchArgs {
    /// The flags, checked.
    pub fn new(flags: BenchFlags) -> Result<BenchArgs, BenchError> {
        plan_of(&flags)?;
        Ok(BenchArgs { flags })
    }
}

fn usage_error(e: BenchError) -> clap::Error {
    clap::Error::raw(ErrorKind::ValueValidation, e.to_string())
}

impl FromArgMatches for BenchArgs {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        BenchArgs::new(BenchFlags::from_arg_matches(matches)?).map_err(usage_error)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        let mut flags = self.flags.clone();
        flags.update_from_arg_matches(matches)?;
        *self = BenchArgs::new(flags).map_err(usage_error)?;
        Ok(())
    }
}

impl Args for BenchArgs {
    fn group_id() -> Option<clap::Id> {
        BenchFlags::group_id()
    }
    fn augment_args(cmd: clap::Command) -> clap::Command {
        BenchFlags::augment_args(cmd)
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        BenchFlags::augment_args_for_update(cmd)
    }
}

/// The flags of `strata bench` as typed, before their combinations are checked.
#[derive(Debug, Clone, Args)]
pub struct BenchFlags {
    /// NBD export to drive, nbd://HOST[:PORT]/EXPORT; repeat for several exports (VM i uses export i mod N).
    #[arg(long = "target", value_name = "URI", required = true)]
    pub targets: Vec<String>,
    /// Second export(s) to run the same workload against, interleaved step by step; ratios are printed.
    #[arg(long = "baseline", value_name = "URI")]
    pub baselines: Vec<String>,
    /// max, curve, scale or prep [default: max; prep with --profile prep].
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// Workload profile: 70r-32k, 70r-4k, rr-4k, rw-4k, 50r-8k, sw-256k, prep.
    #[arg(long, default_value = "70r-32k")]
    pub profile: String,
    /// Block size, overriding the profile's (4k, 32K, 256K, ...).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub block_size: Option<u32>,
    /// Share of reads in percent, overriding the profile's.
    #[arg(long, value_name = "PCT", value_parser = parse_pct)]
    pub read_pct: Option<u8>,
    /// Share of random offsets in percent, overriding the profile's.
    #[arg(long, value_name = "PCT", value_parser = parse_pct)]
    pub random_pct: Option<u8>,
    /// Share of each VM's region that I/O touches, in percent.
    #[arg(long, value_name = "PCT", default_value_t = 100, value_parser = parse_pct)]
    pub working_set_pct: u8,
    /// Number of VMs (volumes); VMs sharing one export split it into equal regions [default: number of targets].
    #[arg(long, value_name = "N")]
    pub vms: Option<u32>,
    /// NBD connections per VM (scale mode: always 1).
    #[arg(long = "conns", value_name = "N", default_value_t = 1)]
    pub connections_per_vm: u32,
    /// Requests in flight per connection (scale mode: always 1).
    #[arg(long = "qd", value_name = "N", default_value_t = 8)]
    pub queue_depth: u32,
    /// Measured length of each step (30s, 2m, ...).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Unmeasured lead-in of each step.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Measured length of the curve's max step [default: --duration].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub max_duration: Option<Duration>,
    /// Curve steps in percent of the maximum.
    #[arg(long, value_name = "PCTS", default_value = "10,20,30,40,50,60,70,80,90,100", value_parser = parse_curve_steps)]
    pub curve_steps: CurveSteps,
    /// Max mode: offer this many IOPS with Poisson arrivals instead of the uncontrolled maximum
    /// (a fixed-rate run, like fio's rate_iops).
    #[arg(long, value_name = "IOPS")]
    pub rate_iops: Option<f64>,
    /// The curve stops after a step whose p99 latency exceeds this many ms.
    #[arg(long, value_name = "MS", default_value_t = 1000.0)]
    pub stop_p99_ms: f64,
    /// Seed of offsets, read/write choices, arrivals and data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A request without a reply for this long fails the run.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub io_timeout: Duration,
    /// Admin API of the Strata daemon behind the target [default: detected on HOST:9090].
    #[arg(long, value_name = "URL")]
    pub strata_api: Option<String>,
    /// Admin API of the Strata daemon behind the baseline [default: detected on HOST:9090].
    #[arg(long, value_name = "URL")]
    pub baseline_strata_api: Option<String>,
    /// Do not look for a Strata daemon behind the targets.
    #[arg(long)]
    pub no_strata_api: bool,
    /// Names of the two sides in the report.
    #[arg(long, default_value = "target")]
    pub label: String,
    #[arg(long, default_value = "baseline")]
    pub baseline_label: String,
    /// Free text recorded in the report (e.g. how the devices were slowed down); repeatable.
    #[arg(long = "note", value_name = "TEXT")]
    pub notes: Vec<String>,
    /// Directory for report.json, report.html and the SVG charts (created if missing).
    #[arg(long, value_name = "DIR", default_value = "strata-bench-report")]
    pub output: PathBuf,
    /// No progress bar, no step lines and no summary (errors still go to stderr).
    #[arg(long)]
    pub quiet: bool,
}

/// Curve steps in percent (a newtype, so clap takes the list as one value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurveSteps(pub Vec<u8>);

fn parse_curve_steps(text: &str) -> Result<CurveSteps, String> {
    parse_steps(text).map(CurveSteps)
}

/// Checks the flags and turns them into a plan and the parsed targets.
pub fn plan_of(
    args: &BenchFlags,
) -> Result<(Plan, Vec<TargetUri>, Vec<TargetUri>, String), BenchError> {
    let profile = workload::profile(&args.profile)?;
    let mut w = profile.workload;
    w.block_size_bytes = args.block_size.unwrap_or(w.block_size_bytes);
    w.read_pct = args.read_pct.unwrap_or(w.read_pct);
    w.random_pct = args.random_pct.unwrap_or(w.random_pct);
    w.working_set_pct = args.working_set_pct;
    let mode = args.mode.unwrap_or(if profile.name == "prep" {
        Mode::Prep
    } else {
        Mode::Max
    });
    if mode == Mode::Prep {
        w.read_pct = 0;
        w.random_pct = 0;
        w.working_set_pct = 100;
    }
    w.validate()?;
    let targets = args
        .targets
        .iter()
        .map(|t| workload::parse_uri(t))
        .collect::<Result<Vec<_>, _>>()?;
    let baselines = args
        .baselines
        .iter()
        .map(|t| workload::parse_uri(t))
        .collect::<Result<Vec<_>, _>>()?;
    let scale = mode == Mode::Scale;
    let topology = Topology {
        vms: args.vms.unwrap_or(targets.len() as u32),
        connections_per_vm: if scale { 1 } else { args.connections_per_vm },
        queue_depth: if scale { 1 } else { args.queue_depth },
    };
    topology.validate()?;
    // VM i uses export i mod N: with fewer VMs than exports some would get no I/O while the
    // report lists them as driven.
    let exports = targets.len().max(baselines.len());
    if (topology.vms as usize) < exports {
        return Err(BenchError::Invalid(format!(
            "--vms {} is fewer than the {exports} exports given: each export needs a VM",
            topology.vms
        )));
    }
    if mode != Mode::Prep && args.duration.is_zero() {
        return Err(BenchError::Invalid("--duration must be above zero".into()));
    }
    if args.max_duration.is_some_and(|d| d.is_zero()) {
        return Err(BenchError::Invalid(
            "--max-duration must be above zero".into(),
        ));
    }
    // Only a curve has a max step of its own; elsewhere --duration sets every step's length,
    // which the report states.
    if args.max_duration.is_some() && mode != Mode::Curve {
        return Err(BenchError::Invalid(
            "--max-duration sets the max step of --mode curve; use --duration".into(),
        ));
    }
    if let Some(r) = args.rate_iops {
        if mode != Mode::Max || r.is_nan() || r <= 0.0 || r > 1e8 {
            return Err(BenchError::Invalid(
                "--rate-iops needs --mode max and a rate above 0 and at most 1e8".into(),
            ));
        }
    }
    // Finite: the report states it, and JSON has no infinity (it would be written as null).
    if !args.stop_p99_ms.is_finite() || args.stop_p99_ms <= 0.0 {
        return Err(BenchError::Invalid(
            "--stop-p99-ms must be a number of ms above zero".into(),
        ));
    }
    if args.io_timeout < Duration::from_millis(100) {
        return Err(BenchError::Invalid(
            "--io-timeout must be at least 100ms".into(),
        ));
    }
    let plan = Plan {
        mode,
        workload: w,
        topology,
        step_duration: args.duration,
        warmup: args.warmup,
        max_duration: args.max_duration.unwrap_or(args.duration),
        curve_steps_pct: args.curve_steps.0.clone(),
        stop_p99_ms: args.stop_p99_ms,
        seed: args.seed,
        io_timeout: args.io_timeout,
        rate_iops: args.rate_iops,
    };
    Ok((plan, targets, baselines, profile.name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, String> {
        parse_err(args).map_err(|e| e.to_string())
    }

    fn parse_err(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        let mut all = vec!["bench"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).map(|c| c.bench)
    }

    #[test]
    fn flags_become_a_plan() {
        let a = parse(&[
            "--target",
            "nbd://h:1/a",
            "--mode",
            "curve",
            "--profile",
            "rr-4k",
            "--curve-steps",
            "25,50,100",
            "--qd",
            "4",
            "--conns",
            "2",
            "--vms",
            "3",
            "--duration",
            "2s",
            "--block-size",
            "8k",
            "--max-duration",
            "5s",
        ])
        .unwrap();
        let (plan, targets, baselines, profile) = plan_of(&a.flags).unwrap();
        assert_eq!(plan.mode, Mode::Curve);
        assert_eq!(plan.max_duration, Duration::from_secs(5));
        assert_eq!(plan.curve_steps_pct, vec![25, 50, 100]);
        assert_eq!(plan.workload.block_size_bytes, 8192);
        assert_eq!(plan.workload.read_pct, 100);
        assert_eq!(
            plan.topology,
            Topology {
                vms: 3,
                connections_per_vm: 2,
                queue_depth: 4
            }
        );
        assert_eq!(
            (targets.len(), baselines.len(), profile.as_str()),
            (1, 0, "rr-4k")
        );
    }

    #[test]
    fn prep_and_scale_fix_what_they_must() {
        let a = parse(&["--target", "nbd://h/a", "--profile", "prep", "--qd", "4"]).unwrap();
        let (plan, ..) = plan_of(&a.flags).unwrap();
        assert_eq!(plan.mode, Mode::Prep);
        assert_eq!((plan.workload.read_pct, plan.workload.random_pct), (0, 0));
        let a = parse(&[
            "--target",
            "nbd://h/a",
            "--mode",
            "scale",
            "--vms",
            "8",
            "--qd",
            "4",
            "--conns",
            "3",
        ])
        .unwrap();
        let (plan, ..) = plan_of(&a.flags).unwrap();
        assert_eq!(
            plan.topology,
            Topology {
                vms: 8,
                connections_per_vm: 1,
                queue_depth: 1
            }
        );
    }

    #[test]
    fn bad_flags_are_one_line_errors() {
        assert!(parse(&["--mode", "max"]).is_err(), "a target is required");
        assert!(parse(&["--target", "x", "--curve-steps", "50,10"])
            .unwrap_err()
            .contains("rise"));
        for args in [
            &["--target", "http://h/a"][..],
            &["--target", "nbd://h/a", "--profile", "nope"],
            &["--target", "nbd://h/a", "--read-pct", "120"],
            &["--target", "nbd://h/a", "--qd", "0"],
            &["--target", "nbd://h/a", "--duration", "0s"],
            &["--target", "nbd://h/a", "--max-duration", "0s"],
            &["--target", "nbd://h/a", "--stop-p99-ms", "inf"],
            &["--target", "nbd://h/a", "--stop-p99-ms", "NaN"],
            &[
                "--target",
                "nbd://h/a",
                "--mode",
                "max",
                "--max-duration",
                "9s",
            ],
            &[
                "--target",
                "nbd://h/a",
                "--target",
                "nbd://h/b",
                "--vms",
                "1",
            ],
        ] {
            let Err(e) = parse_err(args) else {
                panic!("{args:?} was accepted");
            };
            // Like an unknown flag: a usage error (exit status 2), its reason on the first line.
            assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
            let text = e.to_string();
            let reason = text.lines().next().and_then(|l| l.strip_prefix("error: "));
            assert!(reason.is_some_and(|r| r.len() > 10), "{args:?}: {text}");
        }
    }
}
