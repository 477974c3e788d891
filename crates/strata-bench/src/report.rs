//! The report: what `report.json` holds (schema: docs/bench-report.schema.json), the curve
//! goal check, baseline ratios, and the text summary printed at the end.
use serde::Serialize;

use crate::stats::{LatencySummary, ServiceLevel, StepCounters};
use crate::workload::{Mode, Topology, Workload};

pub const SCHEMA_ID: &str = "strata-bench/1";
const MIB: f64 = (1u64 << 20) as f64;

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub tool_version: &'static str,
    pub started_unix_ms: u64,
    pub finished_unix_ms: u64,
    pub command_line: Vec<String>,
    pub machine: Machine,
    pub mode: Mode,
    pub profile: String,
    pub workload: Workload,
    pub topology: Topology,
    pub timing: Timing,
    pub notes: Vec<String>,
    /// The target first, then the baseline if there is one.
    pub targets: Vec<TargetReport>,
    /// Target / baseline per step; empty without a baseline.
    pub ratios: Vec<StepRatio>,
    /// Set when a signal stopped the run: `targets` then hold only the steps that finished.
    pub interrupted: Option<Interrupted>,
}

/// A run a signal (SIGINT, SIGTERM, SIGHUP) stopped before its end.
#[derive(Debug, Clone, Serialize)]
pub struct Interrupted {
    pub signal: &'static str,
    pub at_unix_ms: u64,
    /// The command's exit status: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP).
    pub exit_status: u8,
    /// Steps that finished, on every side; they are in `targets` with their figures.
    pub finished_steps: usize,
    /// The step under way, left out of `targets`; None when the signal came between steps.
    pub cut_step: Option<CutStep>,
}

/// What a step the signal cut short had done: no figures, since its window is incomplete.
#[derive(Debug, Clone, Serialize)]
pub struct CutStep {
    pub role: &'static str,
    pub label: String,
    pub step: String,
    /// How long it ran, warm-up included.
    pub ran_s: f64,
    /// Requests answered inside its measured window before it stopped (prep: all of them).
    pub requests_done: u64,
    /// Bytes of the writes among them: for prep, what the pass had written (acknowledged),
    /// each connection's slice from its start.
    pub written_bytes: u64,
    /// Prep: the bytes a whole pass writes.
    pub pass_bytes: Option<u64>,
}

impl Interrupted {
    /// One line: what stopped the run and what the report holds.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "interrupted by {}: the report holds the {} step{} that finished",
            self.signal,
            self.finished_steps,
            if self.finished_steps == 1 { "" } else { "s" }
        );
        match &self.cut_step {
            Some(c) if c.pass_bytes.is_some() => text.push_str(&format!(
                "; {} {} was cut after {:.1} s, having written {:.1} of {:.1} MiB (run prep again to fill the targets)",
                c.label,
                c.step,
                c.ran_s,
                c.written_bytes as f64 / MIB,
                c.pass_bytes.unwrap_or(0) as f64 / MIB
            )),
            Some(c) => text.push_str(&format!(
                "; {} step {} was cut after {:.1} s and is left out",
                c.label, c.step, c.ran_s
            )),
            None => {}
        }
        text
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub cpu_model: String,
    pub memory_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    pub step_duration_s: f64,
    pub warmup_s: f64,
    pub max_step_duration_s: f64,
    pub curve_steps_pct: Vec<u8>,
    pub stop_p99_ms: f64,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TargetReport {
    /// "target" or "baseline".
    pub role: &'static str,
    pub label: String,
    pub uris: Vec<String>,
    pub export_size_bytes: Vec<u64>,
    pub steps: Vec<StepReport>,
    /// Curve mode: Strata's goal for a ramp-up curve, checked on the rate steps.
    pub curve_check: Option<CurveCheck>,
    /// Why the curve stopped before its last step, if it did.
    pub stopped_early: Option<String>,
    /// Time series from the Strata daemon behind the target, when there is one.
    pub strata: Option<StrataSeries>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    pub name: String,
    /// "max", "rate", "scale" or "prep".
    pub kind: &'static str,
    pub target_pct: Option<u8>,
    pub target_iops: Option<f64>,
    pub vms: u32,
    pub connections: u32,
    pub queue_depth: u32,
    pub started_unix_ms: u64,
    /// Length of the measured window (prep: the whole pass).
    pub measured_s: f64,
    /// Requests that completed inside the window (the rates below are these over `measured_s`).
    pub ios: u64,
    pub reads: u64,
    pub writes: u64,
    pub errors: u64,
    pub late_arrivals: u64,
    pub iops: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub bytes_per_s: f64,
    /// Delivered (completed in the window) over target rate (rate steps).
    pub achieved_ratio: Option<f64>,
    pub latency_us: Option<LatencySummary>,
    pub read_latency_us: Option<LatencySummary>,
    pub write_latency_us: Option<LatencySummary>,
    pub service_levels: Vec<ServiceLevel>,
    pub schedule_lag_us_p99: Option<f64>,
}

impl StepReport {
    /// Figures of one step from its merged counters.
    pub fn from_counters(head: StepHead, c: &StepCounters, measured_s: f64) -> StepReport {
        let secs = measured_s.max(1e-9);
        let (reads, writes) = (c.reads_done, c.writes_done);
        let ios = reads + writes;
        let iops = ios as f64 / secs;
        let all = c.all();
        StepReport {
            name: head.name,
            kind: head.kind,
            target_pct: head.target_pct,
            target_iops: head.target_iops,
            vms: head.vms,
            connections: head.connections,
            queue_depth: head.queue_depth,
            started_unix_ms: head.started_unix_ms,
            measured_s,
            ios,
            reads,
            writes,
            errors: c.errors,
            late_arrivals: c.late_arrivals,
            iops,
            read_iops: reads as f64 / secs,
            write_iops: writes as f64 / secs,
            bytes_per_s: (c.read_bytes + c.write_bytes) as f64 / secs,
            achieved_ratio: head.target_iops.map(|t| iops / t.max(1e-9)),
            latency_us: all.summary(),
            read_latency_us: c.reads.summary(),
            write_latency_us: c.writes.summary(),
            service_levels: all.service_levels(),
            schedule_lag_us_p99: c.schedule_lag.summary().map(|s| s.p99),
        }
    }
}

/// What a step was meant to be, before it ran.
#[derive(Debug, Clone)]
pub struct StepHead {
    pub name: String,
    pub kind: &'static str,
    pub target_pct: Option<u8>,
    pub target_iops: Option<f64>,
    pub vms: u32,
    pub connections: u32,
    pub queue_depth: u32,
    pub started_unix_ms: u64,
}

/// Strata's goal for a curve: every rate step before the last delivers at least 95% of its
/// target, and no step's p99 is more than 3x the previous step's.
#[derive(Debug, Clone, Serialize)]
pub struct CurveCheck {
    pub holds: bool,
    pub rate_ok: bool,
    pub p99_ok: bool,
    pub findings: Vec<String>,
}

pub const GOAL_MIN_ACHIEVED: f64 = 0.95;
pub const GOAL_MAX_P99_GROWTH: f64 = 3.0;

pub fn check_curve(steps: &[StepReport], planned_rate_steps: usize) -> CurveCheck {
    let rate: Vec<&StepReport> = steps.iter().filter(|s| s.kind == "rate").collect();
    let mut findings = Vec::new();
    let mut rate_ok = true;
    if rate.len() < planned_rate_steps {
        rate_ok = false;
        findings.push(format!(
            "only {} of {planned_rate_steps} rate steps ran",
            rate.len()
        ));
    }
    for s in rate.iter().take(rate.len().saturating_sub(1)) {
        let achieved = s.achieved_ratio.unwrap_or(0.0);
        if achieved < GOAL_MIN_ACHIEVED {
            rate_ok = false;
            findings.push(format!(
                "{}: delivered {:.1}% of its target rate",
                s.name,
                achieved * 100.0
            ));
        }
    }
    let mut p99_ok = true;
    for pair in rate.windows(2) {
        let p99 = |s: &StepReport| s.latency_us.map(|l| l.p99);
        if let (Some(a), Some(b)) = (p99(pair[0]), p99(pair[1])) {
            if b > GOAL_MAX_P99_GROWTH * a {
                p99_ok = false;
                findings.push(format!(
                    "{}: p99 {:.0} us is {:.1}x the previous step's {:.0} us",
                    pair[1].name,
                    b,
                    b / a,
                    a
                ));
            }
        }
    }
    CurveCheck {
        holds: rate_ok && p99_ok,
        rate_ok,
        p99_ok,
        findings,
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct StrataSeries {
    pub api_url: String,
    pub devices: Vec<String>,
    /// Device names that say they are emulated (`strata serve --*-emulate`).
    pub emulated_devices: Vec<String>,
    pub samples: Vec<SeriesSample>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SeriesSample {
    pub t_unix_ms: u64,
    /// Seconds since the run started.
    pub t_s: f64,
    pub log_fill_ratio: f64,
    pub fill_ratio_low: f64,
    pub fill_ratio_high: f64,
    pub destage_rate_bytes_per_s: f64,
    pub admission_throttled: bool,
    pub host_read_bytes_per_s: f64,
    pub host_write_bytes_per_s: f64,
    pub fast_read_bytes_per_s: f64,
    pub fast_write_bytes_per_s: f64,
    pub capacity_read_bytes_per_s: f64,
    pub capacity_write_bytes_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepRatio {
    pub step: String,
    pub iops_ratio: Option<f64>,
    pub bytes_per_s_ratio: Option<f64>,
    pub latency_mean_ratio: Option<f64>,
    pub latency_p99_ratio: Option<f64>,
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite()).then(|| a / b)
}

/// Target / baseline for each step both ran.
pub fn ratios(target: &TargetReport, baseline: &TargetReport) -> Vec<StepRatio> {
    target
        .steps
        .iter()
        .filter_map(|a| {
            let b = baseline.steps.iter().find(|b| b.name == a.name)?;
            let lat = |s: &StepReport, f: fn(&LatencySummary) -> f64| s.latency_us.as_ref().map(f);
            let both = |f: fn(&LatencySummary) -> f64| match (lat(a, f), lat(b, f)) {
                (Some(x), Some(y)) => ratio(x, y),
                _ => None,
            };
            Some(StepRatio {
                step: a.name.clone(),
                iops_ratio: ratio(a.iops, b.iops),
                bytes_per_s_ratio: ratio(a.bytes_per_s, b.bytes_per_s),
                latency_mean_ratio: both(|l| l.mean),
                latency_p99_ratio: both(|l| l.p99),
            })
        })
        .collect()
}

fn ms(us: Option<f64>) -> String {
    us.map_or("-".into(), |v| format!("{:.2}", v / 1000.0))
}

/// The table printed at the end of a run.
pub fn summary_text(report: &Report) -> String {
    let mut out = String::new();
    if let Some(i) = &report.interrupted {
        out.push_str(&format!("== INTERRUPTED: {}\n", i.describe()));
    }
    for t in &report.targets {
        out.push_str(&format!(
            "== {} ({}): {}\n",
            t.label,
            t.role,
            t.uris.join(" ")
        ));
        if let Some(s) = &t.strata {
            for d in &s.emulated_devices {
                out.push_str(&format!("   device {d}\n"));
            }
        }
        out.push_str("step        IOPS      MB/s   mean ms  p50 ms  p95 ms  p99 ms  p99.9 ms  max ms  <=1ms  <=2ms  <=5ms  <=10ms  <=30ms\n");
        for s in &t.steps {
            let l = s.latency_us;
            let sl: Vec<String> = s
                .service_levels
                .iter()
                .map(|x| match x.share {
                    Some(share) => format!("{:5.1}%", share * 100.0),
                    None => format!("{:>6}", "-"),
                })
                .collect();
            out.push_str(&format!(
                "{:<9} {:>9.0} {:>9.1} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7} {}\n",
                s.name,
                s.iops,
                s.bytes_per_s / 1e6,
                ms(l.map(|l| l.mean)),
                ms(l.map(|l| l.p50)),
                ms(l.map(|l| l.p95)),
                ms(l.map(|l| l.p99)),
                ms(l.map(|l| l.p999)),
                ms(l.map(|l| l.max)),
                sl.join(" ")
            ));
        }
        if let Some(reason) = &t.stopped_early {
            out.push_str(&format!("   stopped early: {reason}\n"));
        }
        if let Some(c) = &t.curve_check {
            let verdict = if c.holds { "holds" } else { "does not hold" };
            out.push_str(&format!("   curve goal (>=95% of target below the last step, p99 <=3x per step): {verdict}\n"));
            for f in &c.findings {
                out.push_str(&format!("     {f}\n"));
            }
        }
    }
    if !report.ratios.is_empty() {
        out.push_str(
            "== target / baseline\nstep      IOPS ratio  MB/s ratio  mean lat ratio  p99 ratio\n",
        );
        let f = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.2}"));
        for r in &report.ratios {
            out.push_str(&format!(
                "{:<9} {:>11} {:>11} {:>15} {:>10}\n",
                r.step,
                f(r.iops_ratio),
                f(r.bytes_per_s_ratio),
                f(r.latency_mean_ratio),
                f(r.latency_p99_ratio)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::LatencyRecorder;

    fn step(name: &str, target: f64, iops: f64, p99_us: u64) -> StepReport {
        let mut c = StepCounters::default();
        for _ in 0..iops as u64 {
            c.reads.record_us(p99_us);
        }
        c.reads_done = iops as u64;
        let head = StepHead {
            name: name.into(),
            kind: "rate",
            target_pct: None,
            target_iops: Some(target),
            vms: 1,
            connections: 1,
            queue_depth: 1,
            started_unix_ms: 0,
        };
        StepReport::from_counters(head, &c, 1.0)
    }

    #[test]
    fn the_curve_goal_is_checked_step_by_step() {
        let good = [
            step("10%", 100.0, 100.0, 1000),
            step("20%", 200.0, 196.0, 2000),
            step("30%", 300.0, 250.0, 5000),
        ];
        let c = check_curve(&good, 3);
        assert!(c.holds, "{:?}", c.findings);
        let short = [
            step("10%", 100.0, 100.0, 1000),
            step("20%", 200.0, 180.0, 2000),
            step("30%", 300.0, 290.0, 7000),
        ];
        let c = check_curve(&short, 3);
        assert!(!c.rate_ok && !c.p99_ok && !c.holds);
        assert!(
            c.findings[0].contains("20%: delivered 90.0%"),
            "{:?}",
            c.findings
        );
        assert!(c.findings[1].contains("3.5x"), "{:?}", c.findings);
        assert!(!check_curve(&good[..2], 3).holds, "a curve cut short fails");
    }

    /// A prep pass SIGTERM cut before it finished: no steps, and every output says what was
    /// written.
    #[test]
    fn an_interrupted_run_without_steps_says_so_everywhere() {
        let target = TargetReport {
            role: "target",
            label: "t".into(),
            uris: vec!["nbd://h/x".into()],
            export_size_bytes: vec![8 << 20],
            steps: vec![],
            curve_check: None,
            stopped_early: None,
            strata: None,
        };
        let report = Report {
            schema: SCHEMA_ID,
            tool_version: "0",
            started_unix_ms: 0,
            finished_unix_ms: 0,
            command_line: vec![],
            machine: Machine {
                cores: 1,
                cpu_model: "x".into(),
                memory_bytes: 0,
            },
            mode: Mode::Prep,
            profile: "prep".into(),
            workload: crate::workload::profile("prep").unwrap().workload,
            topology: Topology {
                vms: 1,
                connections_per_vm: 1,
                queue_depth: 1,
            },
            timing: Timing {
                step_duration_s: 0.0,
                warmup_s: 0.0,
                max_step_duration_s: 0.0,
                curve_steps_pct: vec![],
                stop_p99_ms: 1.0,
                seed: 1,
            },
            notes: vec![],
            targets: vec![target],
            ratios: vec![],
            interrupted: Some(Interrupted {
                signal: "SIGTERM",
                at_unix_ms: 0,
                exit_status: 143,
                finished_steps: 0,
                cut_step: Some(CutStep {
                    role: "target",
                    label: "t".into(),
                    step: "prep".into(),
                    ran_s: 2.0,
                    requests_done: 12,
                    written_bytes: 3 << 20,
                    pass_bytes: Some(8 << 20),
                }),
            }),
        };
        let line = "interrupted by SIGTERM: the report holds the 0 steps that finished; t prep was cut after 2.0 s, having written 3.0 of 8.0 MiB";
        let text = summary_text(&report);
        assert!(
            text.starts_with(&format!("== INTERRUPTED: {line}")),
            "{text}"
        );
        let html = crate::html::page(&report, &crate::html::charts(&report));
        assert!(
            html.contains(&format!("<b>Interrupted</b>: {line}")),
            "{html}"
        );
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["interrupted"]["cut_step"]["pass_bytes"], 8 << 20);
    }

    #[test]
    fn step_figures_and_ratios() {
        let a = step("max", 1.0, 400.0, 800);
        assert_eq!(a.ios, 400);
        assert_eq!(a.iops, 400.0);
        assert_eq!(a.latency_us.unwrap().p99, 800.0);
        let b = step("max", 1.0, 200.0, 800);
        let mk = |s: StepReport| TargetReport {
            role: "target",
            label: "x".into(),
            uris: vec![],
            export_size_bytes: vec![],
            steps: vec![s],
            curve_check: None,
            stopped_early: None,
            strata: None,
        };
        let r = ratios(&mk(a), &mk(b));
        assert_eq!(r[0].iops_ratio, Some(2.0));
        assert_eq!(
            r[0].latency_mean_ratio.map(|x| (x * 100.0).round()),
            Some(100.0)
        );
        let _ = LatencyRecorder::default();
    }
}
