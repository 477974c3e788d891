//! SIGINT, SIGTERM and SIGHUP (the terminal that started the run closed) during a run. The
//! first one stops the run in order: the step under way stops sending, its requests in flight
//! get [`DRAIN_LIMIT`] to be answered (then they are abandoned), the connections are closed,
//! and the report of the steps that finished is written, marked as interrupted; the command
//! then exits with 128 + the signal's number. A later signal exits at once with that status,
//! unless it comes within [`REPEAT_WINDOW`] of the first: that is the same request delivered
//! twice (GNU `timeout` signals the process and its process group), as `strata serve` takes it.
use std::io::Write;
use std::time::{Duration, Instant};

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use crate::BenchError;

/// How long the requests in flight when the stop came may take to be answered.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(1);
/// A signal this soon after the first repeats it; only a later one exits at once.
const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// The signal that stopped the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopCause {
    pub signal: &'static str,
    /// 128 + the signal's number, as a shell reports a process the signal ended.
    pub exit_code: u8,
    pub at_unix_ms: u64,
}

/// Whether the run was asked to stop; every worker holds a clone.
#[derive(Debug, Clone)]
pub struct Stop {
    rx: watch::Receiver<Option<StopCause>>,
}

impl Stop {
    /// A flag nothing will set, and its setter (for tests and runs without signals).
    pub fn manual() -> (watch::Sender<Option<StopCause>>, Stop) {
        let (tx, rx) = watch::channel(None);
        (tx, Stop { rx })
    }

    pub fn cause(&self) -> Option<StopCause> {
        *self.rx.borrow()
    }

    /// Resolves once a stop is asked for (never, if the setter is gone without one).
    pub async fn wait(&mut self) {
        if self.rx.wait_for(Option::is_some).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Installs the handlers for SIGINT, SIGTERM and SIGHUP; the returned flag is set by the first signal.
/// Must run inside the runtime, which must outlive the report's writing so that a second
/// signal still exits at once meanwhile.
pub fn listen(quiet: bool) -> Result<Stop, BenchError> {
    let err = |e: std::io::Error| {
        BenchError::Invalid(format!(
            "cannot install signal handlers: {}",
            crate::nbd::short_io(&e)
        ))
    };
    let mut int = signal(SignalKind::interrupt()).map_err(err)?;
    let mut term = signal(SignalKind::terminate()).map_err(err)?;
    let mut hup = signal(SignalKind::hangup()).map_err(err)?;
    let (tx, stop) = Stop::manual();
    tokio::spawn(async move {
        let mut first: Option<Instant> = None;
        loop {
            let (signal, number) = tokio::select! {
                _ = int.recv() => ("SIGINT", 2),
                _ = term.recv() => ("SIGTERM", 15),
                _ = hup.recv() => ("SIGHUP", 1),
            };
            let cause = StopCause {
                signal,
                exit_code: 128 + number,
                at_unix_ms: crate::unix_ms(),
            };
            let Some(at) = first else {
                first = Some(Instant::now());
                if !quiet {
                    // Not eprintln!: a closed stderr must not stop the run's orderly end.
                    let _ = writeln!(
                        std::io::stderr(),
                        "strata bench: {}: stopping the step under way; the report of the finished steps follows (another signal exits at once)",
                        cause.signal
                    );
                }
                let _ = tx.send(Some(cause));
                continue;
            };
            if at.elapsed() < REPEAT_WINDOW {
                continue;
            }
            let _ = writeln!(
                std::io::stderr(),
                "strata bench: {} again, exiting at once without a report",
                cause.signal
            );
            std::process::exit(i32::from(cause.exit_code));
        }
    });
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A closed terminal (SIGHUP) stops the run as Ctrl-C does, instead of ending the process
    /// without a report. (No other test of this crate listens for signals.)
    #[tokio::test]
    async fn a_hangup_stops_the_run_with_its_own_status() {
        let mut stop = listen(true).unwrap();
        assert_eq!(stop.cause(), None);
        let sent = std::process::Command::new("kill")
            .args(["-HUP", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        tokio::time::timeout(Duration::from_secs(10), stop.wait())
            .await
            .expect("the hangup stops the run");
        let cause = stop.cause().unwrap();
        assert_eq!((cause.signal, cause.exit_code), ("SIGHUP", 129));
    }
}
