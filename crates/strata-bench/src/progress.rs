//! What a run shows while it runs: a progress bar on a terminal, one line per step otherwise,
//! nothing with `--quiet`.
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::task::JoinHandle;

use crate::report::StepReport;

const TICK: Duration = Duration::from_millis(250);

pub struct Progress {
    bar: bool,
    lines: bool,
}

pub struct Ticker {
    bar: ProgressBar,
    task: JoinHandle<()>,
}

impl Progress {
    pub fn new(quiet: bool) -> Progress {
        let tty = std::io::stderr().is_terminal();
        Progress {
            bar: !quiet && tty,
            lines: !quiet,
        }
    }

    /// Starts the bar of one step: by time, or by requests for a prep pass.
    pub fn start_step(
        &self,
        label: &str,
        step: &str,
        (index, total): (usize, usize),
        length: Duration,
        counters: Vec<Arc<AtomicU64>>,
        pass_ops: Option<u64>,
    ) -> Option<Ticker> {
        if !self.bar {
            return None;
        }
        let bar = ProgressBar::with_draw_target(
            Some(pass_ops.unwrap_or(length.as_millis() as u64).max(1)),
            ProgressDrawTarget::stderr(),
        );
        let template = "{prefix} [{bar:30}] {percent:>3}% {msg}";
        bar.set_style(
            ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("[{index}/{total}] {label} {step}"));
        let b = bar.clone();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let base: u64 = counters.iter().map(|c| c.load(Ordering::Relaxed)).sum();
            let (mut last_n, mut last_t) = (base, started);
            loop {
                tokio::time::sleep(TICK).await;
                let n: u64 = counters.iter().map(|c| c.load(Ordering::Relaxed)).sum();
                let now = Instant::now();
                let iops = (n - last_n) as f64 / now.duration_since(last_t).as_secs_f64().max(1e-3);
                (last_n, last_t) = (n, now);
                match pass_ops {
                    Some(_) => b.set_position(n - base),
                    None => b.set_position(started.elapsed().as_millis() as u64),
                }
                b.set_message(format!("{iops:>9.0} IOPS"));
            }
        });
        Some(Ticker { bar, task })
    }

    pub fn finish_step(&self, ticker: Option<Ticker>) {
        if let Some(t) = ticker {
            t.task.abort();
            t.bar.finish_and_clear();
        }
    }

    /// One line per finished step (stderr, so stdout keeps only the summary).
    pub fn step_line(&self, label: &str, r: &StepReport) {
        if !self.lines {
            return;
        }
        let p99 = r
            .latency_us
            .map_or("-".into(), |l| format!("{:.2} ms", l.p99 / 1000.0));
        let target = r
            .target_iops
            .map_or(String::new(), |t| format!(" (target {t:.0})"));
        eprintln!(
            "strata bench: {label} {}: {:.0} IOPS{target}, {:.1} MB/s, p99 {p99}",
            r.name,
            r.iops,
            r.bytes_per_s / 1e6
        );
    }

    pub fn note(&self, text: &str) {
        if self.lines {
            eprintln!("strata bench: {text}");
        }
    }
}
