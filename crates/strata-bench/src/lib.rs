//! `strata bench`: an HCIBench-style benchmark of NBD exports (Strata's or any other server's).
//!
//! Modes (CONTEXT.md §5): `max` (uncontrolled), `curve` (the maximum, then 10%..100% of it with
//! Poisson arrivals), `scale` (one worker at queue depth 1 per VM, doubling the VMs), `prep` (write
//! every volume once, timed). Per step: IOPS, MB/s, latency from the intended submission time
//! (HDR histogram) and service levels; from a Strata daemon also log fill, destage rate and
//! capacity-device throughput. Output: `report.json` (docs/bench-report.schema.json),
//! `report.html` (self-contained) and SVG charts. docs/BENCH.md is the user's guide.
//!
//! Layout: `args` (flags and their check), `workload` (profiles, URIs), `nbd` (the client), `arrivals` (Poisson),
//! `gen` (one connection's load), `stats` (histograms, service levels), `run` (steps and sides),
//! `strata_api` (the daemon's history), `report`, `svg` and `html` (output), `progress`,
//! `interrupt` (SIGINT, SIGTERM, SIGHUP: the run stops and reports the steps that finished).
use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

mod args;
mod arrivals;
mod gen;
mod html;
mod interrupt;
mod nbd;
mod progress;
pub mod report;
mod run;
pub mod stats;
mod strata_api;
mod svg;
pub mod workload;

pub use args::{plan_of, BenchArgs, BenchFlags, CurveSteps};
pub use arrivals::PoissonArrivals;
pub use report::{Report, SCHEMA_ID};

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Bad flags: nothing was connected or written.
    #[error("{0}")]
    Invalid(String),
    /// A target misbehaved or went away during the run.
    #[error("{0}")]
    Target(String),
    #[error("{0}")]
    Output(String),
    /// A signal stopped the run; the report of the finished steps was written.
    #[error("{reason}")]
    Interrupted { reason: String, exit_status: u8 },
}

impl BenchError {
    /// The exit status this error asks for, when it is not the usual 1.
    pub fn exit_status(&self) -> Option<u8> {
        match self {
            BenchError::Interrupted { exit_status, .. } => Some(*exit_status),
            _ => None,
        }
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn one_line(text: &str) -> String {
    text.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `strata bench` to completion, or until SIGINT or SIGTERM; writes its report files
/// and prints its summary. A run a signal stopped still writes the report of the steps that
/// finished, then returns [`BenchError::Interrupted`].
pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    let flags = &args.flags;
    // Kept until the report is written: its task answers a second signal meanwhile.
    let runtime = runtime()?;
    let report = runtime.block_on(async {
        let stop = interrupt::listen(flags.quiet)?;
        run_async(flags, stop).await
    })?;
    let paths = write_outputs(&report, &flags.output)?;
    if !flags.quiet {
        // Not print!: after a SIGHUP the terminal is gone and the write fails; the report is
        // in its files and the exit status must still say what stopped the run.
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{}", report::summary_text(&report));
        let _ = writeln!(out, "report: {}", paths.join(", "));
    }
    match &report.interrupted {
        Some(i) => Err(BenchError::Interrupted {
            reason: format!("{}; report in {}", i.describe(), flags.output.display()),
            exit_status: i.exit_status,
        }),
        None => Ok(()),
    }
}

/// Runs the benchmark and returns the report without writing anything (signals are left
/// alone: this is for callers in a process of their own, such as tests).
pub fn run_report(args: &BenchArgs) -> Result<Report, BenchError> {
    let (_never, stop) = interrupt::Stop::manual();
    runtime()?.block_on(run_async(&args.flags, stop))
}

fn runtime() -> Result<tokio::runtime::Runtime, BenchError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("strata-bench")
        .build()
        .map_err(|e| BenchError::Invalid(format!("cannot start the async runtime: {e}")))
}

fn find_api(
    given: Option<&str>,
    target: &workload::TargetUri,
    skip: bool,
) -> Result<Option<strata_api::StrataApi>, BenchError> {
    match (given, skip) {
        (Some(url), _) => strata_api::StrataApi::given(url).map(Some),
        (None, true) => Ok(None),
        (None, false) => Ok(strata_api::StrataApi::detect(target)),
    }
}

async fn run_async(args: &BenchFlags, stop: interrupt::Stop) -> Result<Report, BenchError> {
    let (plan, targets, baselines, profile) = plan_of(args)?;
    let started_unix_ms = unix_ms();
    let clock = gen::Clock::new();
    let progress = progress::Progress::new(args.quiet);
    // A signal while the connections are made (each handshake may take its whole timeout
    // against a target that does not answer) ends the run at once: nothing was measured.
    let mut stopped = stop.clone();
    let sides = tokio::select! {
        sides = connect_sides(args, &plan, &targets, &baselines, clock, started_unix_ms) => sides?,
        () = stopped.wait() => {
            let cause = stop.cause().expect("a stop has a cause");
            return Err(BenchError::Interrupted {
                reason: format!(
                    "interrupted by {} while connecting to the targets: nothing was measured, no report written",
                    cause.signal
                ),
                exit_status: cause.exit_code,
            });
        }
    };
    let outcome = run::run_all(sides, &plan, clock, &progress, started_unix_ms, &stop).await?;
    let interrupted = stop.cause().map(|cause| report::Interrupted {
        signal: cause.signal,
        at_unix_ms: cause.at_unix_ms,
        exit_status: cause.exit_code,
        finished_steps: outcome.targets.iter().map(|t| t.steps.len()).sum(),
        cut_step: outcome.cut_step,
    });
    let targets_out = outcome.targets;
    let ratios = match targets_out.as_slice() {
        [t, b] => report::ratios(t, b),
        _ => Vec::new(),
    };
    Ok(Report {
        schema: SCHEMA_ID,
        tool_version: env!("CARGO_PKG_VERSION"),
        started_unix_ms,
        finished_unix_ms: unix_ms(),
        command_line: std::env::args().collect(),
        machine: machine(),
        mode: plan.mode,
        profile,
        workload: plan.workload,
        topology: plan.topology,
        timing: report::Timing {
            step_duration_s: plan.step_duration.as_secs_f64(),
            warmup_s: plan.warmup.as_secs_f64(),
            max_step_duration_s: plan.max_duration.as_secs_f64(),
            curve_steps_pct: plan.curve_steps_pct.clone(),
            stop_p99_ms: plan.stop_p99_ms,
            seed: plan.seed,
        },
        notes: args.notes.clone(),
        targets: targets_out,
        ratios,
        interrupted,
    })
}

/// Connects every side's connections (the target's, then the baseline's, if any), after
/// looking for each one's Strata API.
async fn connect_sides(
    args: &BenchFlags,
    plan: &run::Plan,
    targets: &[workload::TargetUri],
    baselines: &[workload::TargetUri],
    clock: gen::Clock,
    started_unix_ms: u64,
) -> Result<Vec<run::Side>, BenchError> {
    let mut sides = Vec::new();
    let (a, b, skip) = (
        args.strata_api.clone(),
        args.baseline_strata_api.clone(),
        args.no_strata_api,
    );
    let (t0, b0) = (targets[0].clone(), baselines.first().cloned());
    let (api_t, api_b) = tokio::task::spawn_blocking(move || -> Result<_, BenchError> {
        let t = find_api(a.as_deref(), &t0, skip)?;
        let b = match b0 {
            Some(b0) => find_api(b.as_deref(), &b0, skip)?,
            None => None,
        };
        Ok((t, b))
    })
    .await
    .map_err(|e| BenchError::Invalid(format!("looking for the Strata API failed: {e}")))??;
    sides.push(
        run::connect_side(
            "target",
            args.label.clone(),
            targets,
            plan,
            clock,
            api_t,
            started_unix_ms,
        )
        .await?,
    );
    if !baselines.is_empty() {
        sides.push(
            run::connect_side(
                "baseline",
                args.baseline_label.clone(),
                baselines,
                plan,
                clock,
                api_b,
                started_unix_ms,
            )
            .await?,
        );
    }
    Ok(sides)
}

fn machine() -> report::Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    report::Machine {
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        cpu_model,
        memory_bytes: memory_kib * 1024,
    }
}

/// Writes report.json, report.html and one SVG per chart; returns their paths.
pub fn write_outputs(report: &Report, dir: &std::path::Path) -> Result<Vec<String>, BenchError> {
    let fail = |what: &str, e: std::io::Error| {
        BenchError::Output(format!(
            "cannot write {what} in {}: {}",
            dir.display(),
            nbd::short_io(&e)
        ))
    };
    std::fs::create_dir_all(dir).map_err(|e| fail("the report", e))?;
    let json = serde_json::to_string_pretty(report)
        .map_err(|e| BenchError::Output(format!("cannot encode the report: {e}")))?;
    let charts = html::charts(report);
    let mut files = vec![
        ("report.json".to_string(), json),
        ("report.html".to_string(), html::page(report, &charts)),
    ];
    files.extend(
        charts
            .into_iter()
            .map(|(name, svg)| (format!("{name}.svg"), svg)),
    );
    let mut paths = Vec::new();
    for (name, text) in files {
        let path = dir.join(&name);
        std::fs::write(&path, text).map_err(|e| fail(&name, e))?;
        paths.push(path.display().to_string());
    }
    Ok(paths)
}
