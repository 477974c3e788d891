//! The charts of a report and the one self-contained HTML page that shows them.
use std::fmt::Write;

use crate::report::{Report, TargetReport};
use crate::svg::{escape, Chart, Series, COLORS};
use crate::workload::Mode;

/// Named SVG charts: `curve`, `service-levels`, and `fill-destage` when a daemon was read.
pub fn charts(report: &Report) -> Vec<(&'static str, String)> {
    let mut out = vec![
        ("curve", curve_chart(report)),
        ("service-levels", service_chart(report)),
    ];
    if report
        .targets
        .iter()
        .any(|t| t.strata.as_ref().is_some_and(|s| !s.samples.is_empty()))
    {
        out.push(("fill-destage", fill_chart(report)));
        out.push(("destage-rate", destage_chart(report)));
    }
    out
}

fn measured_steps(t: &TargetReport) -> impl Iterator<Item = &crate::report::StepReport> {
    t.steps.iter().filter(|s| s.latency_us.is_some())
}

fn curve_chart(report: &Report) -> String {
    let mut series = Vec::new();
    for (i, t) in report.targets.iter().enumerate() {
        let pts = |f: fn(&crate::stats::LatencySummary) -> f64| -> Vec<(f64, f64)> {
            let mut v: Vec<(f64, f64)> = measured_steps(t)
                .filter(|s| s.kind != "max" || report.mode != crate::workload::Mode::Curve)
                .filter_map(|s| s.latency_us.map(|l| (s.iops, f(&l) / 1000.0)))
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v
        };
        series.push(Series {
            name: format!("{} p99", t.label),
            points: pts(|l| l.p99),
            color: COLORS[2 * i % 6],
            dashed: false,
        });
        series.push(Series {
            name: format!("{} mean", t.label),
            points: pts(|l| l.mean),
            color: COLORS[(2 * i + 1) % 6],
            dashed: true,
        });
    }
    Chart {
        title: "IOPS and latency per step",
        x_label: "delivered IOPS",
        y_label: "latency (ms)",
        series,
        y_max: None,
    }
    .render()
}

fn service_chart(report: &Report) -> String {
    let mut series = Vec::new();
    for (i, t) in report.targets.iter().enumerate() {
        for (j, ms) in crate::stats::SERVICE_LEVELS_MS.iter().enumerate() {
            let points = measured_steps(t)
                .enumerate()
                .filter_map(|(k, s)| Some(((k + 1) as f64, s.service_levels[j].share? * 100.0)))
                .collect();
            series.push(Series {
                name: format!("{} <= {ms} ms", t.label),
                points,
                color: COLORS[j % 6],
                dashed: i == 1,
            });
        }
    }
    Chart {
        title: "Service levels: share of I/Os within 1, 2, 5, 10, 30 ms",
        x_label: "step (in order run)",
        y_label: "share of I/Os (%)",
        series,
        y_max: Some(100.0),
    }
    .render()
}

fn fill_chart(report: &Report) -> String {
    let mut series = Vec::new();
    for (i, t) in report.targets.iter().enumerate() {
        let Some(s) = &t.strata else { continue };
        let pts = |f: fn(&crate::report::SeriesSample) -> f64| {
            s.samples.iter().map(|x| (x.t_s.max(0.0), f(x))).collect()
        };
        series.push(Series {
            name: format!("{} log fill", t.label),
            points: pts(|x| x.log_fill_ratio * 100.0),
            color: COLORS[2 * i % 6],
            dashed: false,
        });
        series.push(Series {
            name: format!("{} throttled (100 = yes)", t.label),
            points: pts(|x| if x.admission_throttled { 100.0 } else { 0.0 }),
            color: COLORS[(2 * i + 1) % 6],
            dashed: true,
        });
    }
    Chart {
        title: "Write-log fill over time",
        x_label: "seconds since the run started",
        y_label: "fill (%)",
        series,
        y_max: Some(100.0),
    }
    .render()
}

fn destage_chart(report: &Report) -> String {
    let mut series = Vec::new();
    for (i, t) in report.targets.iter().enumerate() {
        let Some(s) = &t.strata else { continue };
        let pts = |f: fn(&crate::report::SeriesSample) -> f64| {
            s.samples
                .iter()
                .map(|x| (x.t_s.max(0.0), f(x) / 1e6))
                .collect()
        };
        series.push(Series {
            name: format!("{} destage rate (5 s average)", t.label),
            points: pts(|x| x.destage_rate_bytes_per_s),
            color: COLORS[3 * i % 6],
            dashed: false,
        });
        series.push(Series {
            name: format!("{} capacity writes", t.label),
            points: pts(|x| x.capacity_write_bytes_per_s),
            color: COLORS[(3 * i + 1) % 6],
            dashed: true,
        });
        series.push(Series {
            name: format!("{} host writes", t.label),
            points: pts(|x| x.host_write_bytes_per_s),
            color: COLORS[(3 * i + 2) % 6],
            dashed: true,
        });
    }
    Chart {
        title: "Destage rate (5 s average) and capacity writes",
        x_label: "seconds since the run started",
        y_label: "MB/s",
        series,
        y_max: None,
    }
    .render()
}

fn f1(v: Option<f64>, scale: f64) -> String {
    v.map_or("-".into(), |x| format!("{:.2}", x / scale))
}

fn step_table(t: &TargetReport) -> String {
    let mut o = String::from("<table><tr><th>step</th><th>target IOPS</th><th>IOPS</th><th>MB/s</th><th>mean ms</th><th>p50</th><th>p95</th><th>p99</th><th>p99.9</th><th>max</th><th>&le;1 ms</th><th>&le;2 ms</th><th>&le;5 ms</th><th>&le;10 ms</th><th>&le;30 ms</th><th>late</th><th>errors</th></tr>");
    for s in &t.steps {
        let l = s.latency_us;
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{}</td><td>{:.0}</td><td>{:.1}</td>",
            escape(&s.name),
            s.target_iops.map_or("-".into(), |x| format!("{x:.0}")),
            s.iops,
            s.bytes_per_s / 1e6
        );
        for v in [
            l.map(|l| l.mean),
            l.map(|l| l.p50),
            l.map(|l| l.p95),
            l.map(|l| l.p99),
            l.map(|l| l.p999),
            l.map(|l| l.max),
        ] {
            let _ = write!(o, "<td>{}</td>", f1(v, 1000.0));
        }
        for sl in &s.service_levels {
            match sl.share {
                Some(share) => {
                    let _ = write!(o, "<td>{:.1}%</td>", share * 100.0);
                }
                None => o.push_str("<td>-</td>"),
            }
        }
        let _ = write!(o, "<td>{}</td><td>{}</td></tr>", s.late_arrivals, s.errors);
    }
    o.push_str("</table>");
    o
}

fn target_section(t: &TargetReport) -> String {
    let mut o = format!(
        "<h2>{} ({})</h2><p>{}</p>",
        escape(&t.label),
        t.role,
        escape(&t.uris.join(" "))
    );
    if let Some(s) = &t.strata {
        let _ = write!(
            o,
            "<p>Strata daemon: {} &mdash; devices: {}</p>",
            escape(&s.api_url),
            escape(&s.devices.join("; "))
        );
        if !s.emulated_devices.is_empty() {
            let _ = write!(
                o,
                "<p class=warn>Emulated devices (a benchmarking aid): {}</p>",
                escape(&s.emulated_devices.join("; "))
            );
        }
    }
    o.push_str(&step_table(t));
    if let Some(r) = &t.stopped_early {
        let _ = write!(o, "<p>Stopped early: {}</p>", escape(r));
    }
    if let Some(c) = &t.curve_check {
        let verdict = if c.holds { "holds" } else { "does not hold" };
        let _ = write!(o, "<p>Curve goal (every step below the last at &ge;95% of its target rate, p99 at most 3&times; the previous step's): <b>{verdict}</b></p><ul>");
        for f in &c.findings {
            let _ = write!(o, "<li>{}</li>", escape(f));
        }
        o.push_str("</ul>");
    }
    o
}

/// "32 KiB", or "1536 B" for a size that is not a whole KiB (not rounded down to "1 KiB").
fn block_size_text(bytes: u32) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{} KiB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

/// How long the steps ran, as this mode runs them.
fn timing_text(report: &Report) -> String {
    let t = &report.timing;
    match report.mode {
        Mode::Prep => "one timed pass writing every VM's region".into(),
        Mode::Curve => format!(
            "a max step of {} s, then steps of {} s, each after {} s warm-up",
            t.max_step_duration_s, t.step_duration_s, t.warmup_s
        ),
        Mode::Max | Mode::Scale => format!(
            "steps of {} s after {} s warm-up",
            t.step_duration_s, t.warmup_s
        ),
    }
}

/// The whole page.
pub fn page(report: &Report, charts: &[(&'static str, String)]) -> String {
    let mut o = String::from("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>strata bench report</title><style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}.warn{color:#a40}</style></head><body>");
    let w = &report.workload;
    let _ = write!(
        o,
        "<h1>strata bench: {:?} mode, profile {}</h1><p>{} blocks, {}% reads, {}% random, working set {}%; {} VMs x {} connections, queue depth {}; {}; seed {}.</p><p>Machine: {} cores, {}, {:.0} GiB. Command: <code>{}</code></p>",
        report.mode,
        escape(&report.profile),
        block_size_text(w.block_size_bytes),
        w.read_pct,
        w.random_pct,
        w.working_set_pct,
        report.topology.vms,
        report.topology.connections_per_vm,
        report.topology.queue_depth,
        timing_text(report),
        report.timing.seed,
        report.machine.cores,
        escape(&report.machine.cpu_model),
        report.machine.memory_bytes as f64 / (1u64 << 30) as f64,
        escape(&report.command_line.join(" "))
    );
    if let Some(i) = &report.interrupted {
        let _ = write!(
            o,
            "<p class=warn><b>Interrupted</b>: {}.</p>",
            escape(&i.describe())
        );
    }
    for n in &report.notes {
        let _ = write!(o, "<p class=warn>Note: {}</p>", escape(n));
    }
    for t in &report.targets {
        o.push_str(&target_section(t));
    }
    if !report.ratios.is_empty() {
        o.push_str("<h2>Target / baseline</h2><table><tr><th>step</th><th>IOPS</th><th>MB/s</th><th>mean latency</th><th>p99 latency</th></tr>");
        for r in &report.ratios {
            let _ = write!(
                o,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&r.step),
                f1(r.iops_ratio, 1.0),
                f1(r.bytes_per_s_ratio, 1.0),
                f1(r.latency_mean_ratio, 1.0),
                f1(r.latency_p99_ratio, 1.0)
            );
        }
        o.push_str("</table>");
    }
    o.push_str("<h2>Charts</h2>");
    for (_, svg) in charts {
        let _ = write!(o, "<div>{svg}</div>");
    }
    o.push_str("</body></html>\n");
    o
}
