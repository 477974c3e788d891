//! One run: connect every VM's connections to the target (and the baseline), then the steps of
//! the mode, the two sides interleaved step by step.
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use crate::gen::{self, Clock, Pacing, Region, StepPlan, Worker, WorkerSpec};
use crate::interrupt::Stop;
use crate::progress::Progress;
use crate::report::{check_curve, CutStep, StepHead, StepReport, TargetReport};
use crate::stats::StepCounters;
use crate::strata_api::{SeriesCollector, StrataApi};
use crate::workload::{Mode, TargetUri, Topology, Workload};
use crate::{unix_ms, BenchError};

/// Everything about the run but the targets.
#[derive(Debug, Clone)]
pub struct Plan {
    pub mode: Mode,
    pub workload: Workload,
    pub topology: Topology,
    pub step_duration: Duration,
    pub warmup: Duration,
    pub max_duration: Duration,
    pub curve_steps_pct: Vec<u8>,
    pub stop_p99_ms: f64,
    pub seed: u64,
    pub io_timeout: Duration,
    /// Max mode: offer this rate (Poisson) instead of the uncontrolled maximum.
    pub rate_iops: Option<f64>,
}

/// One side of the comparison: its exports, its connections and what it measured.
pub struct Side {
    pub report: TargetReport,
    /// Workers per VM.
    vms: Vec<Vec<Worker>>,
    collector: Option<SeriesCollector>,
    done: bool,
    max_iops: Option<f64>,
    rate_steps_run: usize,
}

/// What each step is, before it runs.
#[derive(Debug, Clone, Copy)]
enum StepKind {
    Max,
    Fixed(f64),
    Rate(u8),
    Scale(u32),
    Prep,
}

fn steps_of(plan: &Plan) -> Vec<StepKind> {
    match plan.mode {
        Mode::Max => vec![plan.rate_iops.map_or(StepKind::Max, StepKind::Fixed)],
        Mode::Prep => vec![StepKind::Prep],
        Mode::Curve => std::iter::once(StepKind::Max)
            .chain(plan.curve_steps_pct.iter().map(|&p| StepKind::Rate(p)))
            .collect(),
        Mode::Scale => {
            let n = plan.topology.vms;
            let mut v: Vec<u32> = std::iter::successors(Some(1u32), |x| x.checked_mul(2))
                .take_while(|&x| x < n)
                .collect();
            v.push(n);
            v.into_iter().map(StepKind::Scale).collect()
        }
    }
}

/// Connects one side: VM `i` uses export `i % exports`; VMs sharing an export split it into
/// equal regions; each VM's connections split its working set for sequential access.
pub async fn connect_side(
    role: &'static str,
    label: String,
    uris: &[TargetUri],
    plan: &Plan,
    clock: Clock,
    api: Option<StrataApi>,
    run_start_unix_ms: u64,
) -> Result<Side, BenchError> {
    let bs = u64::from(plan.workload.block_size_bytes);
    let topo = plan.topology;
    let mut payload = vec![0u8; bs as usize];
    SmallRng::seed_from_u64(plan.seed).fill_bytes(&mut payload);
    let payload = Arc::new(payload);
    let mut sizes = Vec::new();
    let mut vms = Vec::new();
    for vm in 0..topo.vms {
        let n_exports = uris.len() as u32;
        let uri = &uris[(vm % n_exports) as usize];
        let sharing = topo.vms / n_exports + u32::from(vm % n_exports < topo.vms % n_exports);
        let share_index = vm / n_exports;
        let mut workers = Vec::new();
        for c in 0..topo.connections_per_vm {
            let conn = crate::nbd::connect(uri).await?;
            if conn.read_only && (plan.workload.read_pct < 100 || plan.mode == Mode::Prep) {
                return Err(BenchError::Target(format!(
                    "{}: the export is read-only",
                    uri.uri
                )));
            }
            if vm < n_exports && c == 0 {
                sizes.push(conn.size_bytes);
            }
            let region_len = conn.size_bytes / u64::from(sharing) / bs * bs;
            // In u128: an export of more than 2^64 / 100 bytes wrapped (NBD sizes reach 2^63).
            let ws_u128 = u128::from(region_len) * u128::from(plan.workload.working_set_pct) / 100;
            let ws_len = ws_u128 as u64 / bs * bs;
            if ws_len < bs * u64::from(topo.connections_per_vm) {
                return Err(BenchError::Target(format!(
                    "{}: {} bytes is too small for {} VMs x {} connections of {} byte blocks",
                    uri.uri, conn.size_bytes, sharing, topo.connections_per_vm, bs
                )));
            }
            let working_set = Region {
                start_bytes: u64::from(share_index) * region_len,
                len_bytes: ws_len,
            };
            // Whole blocks, the first `extra` slices one longer, so that together they cover
            // the working set (a prep pass writes all of it).
            let (c64, conns) = (u64::from(c), u64::from(topo.connections_per_vm));
            let (base, extra) = (ws_len / bs / conns, ws_len / bs % conns);
            let slice = Region {
                start_bytes: working_set.start_bytes + (c64 * base + c64.min(extra)) * bs,
                len_bytes: (base + u64::from(c64 < extra)) * bs,
            };
            let qd = if plan.mode == Mode::Scale {
                1
            } else {
                topo.queue_depth
            };
            let spec = WorkerSpec {
                working_set,
                slice,
                queue_depth: qd,
                workload: plan.workload,
                payload: payload.clone(),
            };
            workers.push(Worker::new(conn, spec, clock, Arc::new(AtomicU64::new(0))));
        }
        vms.push(workers);
    }
    let collector = match api {
        Some(api) => Some(tokio::task::block_in_place(|| {
            SeriesCollector::new(api, run_start_unix_ms)
        })?),
        None => None,
    };
    Ok(Side {
        report: TargetReport {
            role,
            label,
            uris: uris.iter().map(|u| u.uri.clone()).collect(),
            export_size_bytes: sizes,
            steps: Vec::new(),
            curve_check: None,
            stopped_early: None,
            strata: None,
        },
        vms,
        collector,
        done: false,
        max_iops: None,
        rate_steps_run: 0,
    })
}

/// What a run measured: each side's report and, if a stop cut a step short, that step.
pub struct RunOutcome {
    pub targets: Vec<TargetReport>,
    pub cut_step: Option<CutStep>,
}

/// How a step ended.
enum StepEnd {
    Done(Box<StepReport>),
    /// The run was stopped before the step's end: no figures, only what it had done.
    Cut(CutStep),
}

/// Runs every step, interleaving the sides, until the last or until `stop` is set; returns
/// their reports (with the steps that finished) and closes every connection.
pub async fn run_all(
    mut sides: Vec<Side>,
    plan: &Plan,
    clock: Clock,
    progress: &Progress,
    run_start_unix_ms: u64,
    stop: &Stop,
) -> Result<RunOutcome, BenchError> {
    let steps = steps_of(plan);
    let total = steps.len() * sides.len();
    let mut position = 0;
    let mut cut_step = None;
    'steps: for (i, kind) in steps.iter().enumerate() {
        for side in sides.iter_mut() {
            position += 1;
            if stop.cause().is_some() {
                break 'steps;
            }
            if side.done {
                continue;
            }
            // The same seed on both sides: the baseline gets the target's offsets and choices.
            let seed = plan.seed ^ ((i as u64) << 32);
            let at = (position, total);
            let end = run_side_step(side, *kind, plan, clock, progress, seed, at, stop).await?;
            match end {
                StepEnd::Done(report) => {
                    after_step(side, &report, *kind, plan);
                    side.report.steps.push(*report);
                }
                StepEnd::Cut(cut) => cut_step = Some(cut),
            }
            if let Some(c) = side.collector.as_mut() {
                // Blocking HTTP between steps: tell the runtime so its other tasks move on.
                let collector_error = tokio::task::block_in_place(|| c.collect(run_start_unix_ms));
                if let Some(e) = collector_error {
                    progress.note(&format!(
                        "{}: could not read the daemon's history: {e}",
                        side.report.label
                    ));
                }
            }
        }
    }
    let planned_rates = plan.curve_steps_pct.len();
    let mut targets = Vec::new();
    let mut closing = Vec::new();
    for mut side in sides {
        if plan.mode == Mode::Curve {
            side.report.curve_check = Some(check_curve(&side.report.steps, planned_rates));
        }
        side.report.strata = side.collector.take().map(|c| c.series);
        closing.extend(
            side.vms
                .into_iter()
                .flatten()
                .map(|w| tokio::spawn(w.close())),
        );
        targets.push(side.report);
    }
    // All at once: each close is bounded, and a stopped run must end promptly.
    for c in closing {
        let _ = c.await;
    }
    Ok(RunOutcome { targets, cut_step })
}

fn after_step(side: &mut Side, r: &StepReport, kind: StepKind, plan: &Plan) {
    match kind {
        StepKind::Max => side.max_iops = Some(r.iops),
        StepKind::Rate(_) => side.rate_steps_run += 1,
        _ => {}
    }
    let p99_ms = r.latency_us.map_or(0.0, |l| l.p99 / 1000.0);
    if plan.mode == Mode::Curve && matches!(kind, StepKind::Rate(_)) && p99_ms > plan.stop_p99_ms {
        side.done = true;
        side.report.stopped_early = Some(format!(
            "step {} had p99 {p99_ms:.1} ms, past the threshold of {} ms",
            r.name, plan.stop_p99_ms
        ));
    }
    if plan.mode == Mode::Curve && matches!(kind, StepKind::Max) && r.ios == 0 {
        side.done = true;
        side.report.stopped_early = Some("the max step completed no I/O".into());
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_side_step(
    side: &mut Side,
    kind: StepKind,
    plan: &Plan,
    clock: Clock,
    progress: &Progress,
    seed: u64,
    position: (usize, usize),
    stop: &Stop,
) -> Result<StepEnd, BenchError> {
    let topo = plan.topology;
    let (name, active_vms, duration) = match kind {
        StepKind::Max => ("max".to_string(), topo.vms, plan.max_duration),
        StepKind::Fixed(r) => (format!("{r:.0} IOPS"), topo.vms, plan.step_duration),
        StepKind::Rate(p) => (format!("{p}%"), topo.vms, plan.step_duration),
        StepKind::Scale(v) => (format!("{v} VMs"), v, plan.step_duration),
        StepKind::Prep => ("prep".to_string(), topo.vms, Duration::ZERO),
    };
    let mut workers: Vec<Worker> = side
        .vms
        .iter_mut()
        .take(active_vms as usize)
        .flat_map(|v| v.drain(..))
        .collect();
    let conns = workers.len() as u32;
    let target_iops = match kind {
        StepKind::Rate(p) => side.max_iops.map(|m| m * f64::from(p) / 100.0),
        StepKind::Fixed(r) => Some(r),
        _ => None,
    };
    let pacing = match (kind, target_iops) {
        (StepKind::Prep, _) => Pacing::OnePass,
        (_, Some(rate)) => Pacing::Open {
            rate_per_s: rate / f64::from(conns),
        },
        _ => Pacing::Closed,
    };
    let start_ns = clock.now_ns();
    let (record_from_ns, stop_at_ns) = match kind {
        StepKind::Prep => (0, u64::MAX),
        _ => {
            let from = start_ns + plan.warmup.as_nanos() as u64;
            (from, from + duration.as_nanos() as u64)
        }
    };
    let head = StepHead {
        name: name.clone(),
        kind: match kind {
            StepKind::Max => "max",
            StepKind::Rate(_) | StepKind::Fixed(_) => "rate",
            StepKind::Scale(_) => "scale",
            StepKind::Prep => "prep",
        },
        target_pct: match kind {
            StepKind::Rate(p) => Some(p),
            _ => None,
        },
        target_iops,
        vms: active_vms,
        connections: conns,
        queue_depth: if plan.mode == Mode::Scale {
            1
        } else {
            topo.queue_depth
        },
        started_unix_ms: unix_ms(),
    };
    let counters_of: Vec<Arc<AtomicU64>> = workers.iter().map(|w| w.completed.clone()).collect();
    let pass_ops = prep_total(&workers, kind);
    let ticker = progress.start_step(
        &side.report.label,
        &name,
        position,
        plan.warmup + duration,
        counters_of,
        pass_ops,
    );
    let mut handles = Vec::with_capacity(workers.len());
    for (i, mut w) in workers.drain(..).enumerate() {
        let plan_c = StepPlan {
            pacing,
            record_from_ns,
            stop_at_ns,
            seed: seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            io_timeout: plan.io_timeout,
        };
        let mut stop = stop.clone();
        handles.push(tokio::spawn(async move {
            let r = gen::run_step(&mut w, &plan_c, &clock, &mut stop).await;
            (w, r)
        }));
    }
    let mut merged = StepCounters::default();
    let mut failure = None;
    let mut returned = Vec::new();
    for h in handles {
        match h.await {
            Ok((w, r)) => {
                returned.push(w);
                match r {
                    Ok(c) => merged.merge(&c),
                    Err(e) => failure = failure.or(Some(e)),
                }
            }
            Err(e) => {
                failure = failure.or(Some(BenchError::Target(format!(
                    "a worker task failed: {e}"
                ))))
            }
        }
    }
    let ran_s = (clock.now_ns() - start_ns) as f64 / 1e9;
    let measured_s = match kind {
        StepKind::Prep => ran_s,
        _ => duration.as_secs_f64(),
    };
    progress.finish_step(ticker);
    // A stop may end a step with a failure (a connection that broke while draining): the step
    // is cut either way, and the steps before it are still reported.
    let cut = merged.cut_short || (failure.is_some() && stop.cause().is_some());
    if let (Some(e), false) = (failure, cut) {
        return Err(BenchError::Target(format!(
            "{} step {name}: {e}",
            side.report.label
        )));
    }
    // Give the workers back to their VMs, in order (also after a cut: they are closed then).
    let mut returned = returned.into_iter();
    for vm in side.vms.iter_mut().take(active_vms as usize) {
        vm.extend(returned.by_ref().take(topo.connections_per_vm as usize));
    }
    if cut {
        let bs = u64::from(plan.workload.block_size_bytes);
        let cut = CutStep {
            role: side.report.role,
            label: side.report.label.clone(),
            step: name,
            ran_s,
            requests_done: merged.reads_done + merged.writes_done,
            written_bytes: merged.write_bytes,
            pass_bytes: pass_ops.map(|ops| ops * bs),
        };
        progress.note(&format!(
            "{} {}: cut short after {:.1} s and left out of the report",
            cut.label, cut.step, cut.ran_s
        ));
        return Ok(StepEnd::Cut(cut));
    }
    let report = StepReport::from_counters(head, &merged, measured_s);
    progress.step_line(&side.report.label, &report);
    Ok(StepEnd::Done(Box::new(report)))
}

/// Requests a prep pass sends in all (for the progress bar).
fn prep_total(workers: &[Worker], kind: StepKind) -> Option<u64> {
    matches!(kind, StepKind::Prep).then(|| workers.iter().map(Worker::pass_ops).sum())
}
