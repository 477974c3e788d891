//! What `strata serve` tells a service manager that started it with `Type=notify` (systemd:
//! `sd_notify(3)`): its start-up phase as it goes (`STATUS=`), `READY=1` once both ports serve,
//! `STOPPING=1` when it stops. A start or a stop can take long (a large write log to replay,
//! an index to flush), so while either goes on the manager's timeout is pushed back a little at
//! a time (`EXTEND_TIMEOUT_USEC=`): a daemon that is making progress is not killed half-way,
//! and one that hangs still is, once the last extension runs out. Nothing is sent without
//! `NOTIFY_SOCKET`; a failed send is logged once and changes nothing else.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio::task::JoinHandle;

/// How often a long start or stop reports, and pushes the manager's timeout back.
const REPORT_EVERY: Duration = Duration::from_secs(5);
/// How far each report pushes the timeout back: a few reports may be late.
const EXTEND_BY: Duration = Duration::from_secs(30);

/// Whether a send already failed (said once).
static FAILED: AtomicBool = AtomicBool::new(false);

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        if !FAILED.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, "cannot notify the service manager ($NOTIFY_SOCKET)");
        }
    }
}

/// Whether a service manager listens.
fn wanted() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Both ports serve.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// The daemon stops (before it drains its connections and flushes).
pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// Until aborted, says `status()` every [`REPORT_EVERY`] (at once first) and pushes the
/// manager's start or stop timeout back by [`EXTEND_BY`]. None without a manager.
pub fn report_while(status: impl Fn() -> String + Send + 'static) -> Option<JoinHandle<()>> {
    if !wanted() {
        return None;
    }
    let extend = u32::try_from(EXTEND_BY.as_micros()).unwrap_or(u32::MAX);
    let report = move || {
        let line = status();
        send(&[
            NotifyState::Status(&line),
            NotifyState::ExtendTimeoutUsec(extend),
        ]);
    };
    // The first report before this returns: it comes before anything the caller sends next.
    report();
    Some(tokio::spawn(async move {
        loop {
            tokio::time::sleep(REPORT_EVERY).await;
            report();
        }
    }))
}

/// Stops a reporter of [`report_while`].
pub fn stop_reporting(reporter: Option<JoinHandle<()>>) {
    if let Some(r) = reporter {
        r.abort();
    }
}

/// The status line while a started daemon's start goes on.
pub fn start_status(startup: Arc<crate::startup::Startup>) -> impl Fn() -> String + Send {
    move || format!("starting: {}", startup.phase())
}
