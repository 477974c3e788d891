//! What `strata serve` tells a service manager that started it with `Type=notify` (systemd:
//! `sd_notify(3)`): its start-up phase as it goes (`STATUS=`), `READY=1` once both ports serve,
//! `STOPPING=1` when it stops. A start or a stop can take long (a large write log to replay,
//! an index to flush), so while either goes on the manager's timeout is pushed back a little at
//! a time (`EXTEND_TIMEOUT_USEC=`): a daemon that is making progress is not killed half-way,
//! and one that hangs still is, once the last extension runs out. With `WatchdogSec=` the
//! manager also wants to hear that a serving daemon still works (`WATCHDOG=1`): it is told so
//! only after the engine answered a probe that takes its locks, so a wedged engine (or an async
//! runtime whose threads are all stuck) stops the pings and gets the daemon restarted, which
//! loses nothing acknowledged. Nothing is sent without `NOTIFY_SOCKET`; a failed send is logged
//! once and changes nothing else.
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

/// The watchdog period the manager asked for (`WatchdogSec=`), if it listens and asked.
fn watchdog_period() -> Option<Duration> {
    if !wanted() {
        return None;
    }
    sd_notify::watchdog_enabled().filter(|p| !p.is_zero())
}

/// While the manager wants a watchdog, tells it `WATCHDOG=1` every half period, each time once
/// `probe` (run on a blocking thread) has answered since the last ping. None without one.
pub fn spawn_watchdog(probe: impl Fn() + Send + Sync + 'static) -> Option<JoinHandle<()>> {
    let period = watchdog_period()?;
    tracing::info!(
        period_s = period.as_secs_f64(),
        "the service manager's watchdog is told every half period that the engine answers"
    );
    Some(tokio::spawn(watchdog(period / 2, Arc::new(probe), || {
        send(&[NotifyState::Watchdog])
    })))
}

/// The watchdog's loop: every `every`, `probe` runs on a blocking thread and `ping` follows
/// once it returned. A probe that takes longer than `every` is waited for (one at a time, so a
/// stuck one does not pile up threads) with no ping meanwhile: the manager's timeout, twice
/// `every`, runs out if it never returns.
async fn watchdog(every: Duration, probe: Arc<dyn Fn() + Send + Sync>, ping: impl Fn()) {
    loop {
        let began = tokio::time::Instant::now();
        let p = probe.clone();
        let mut answer = tokio::task::spawn_blocking(move || p());
        let answered = match tokio::time::timeout(every, &mut answer).await {
            Ok(r) => r,
            Err(_) => {
                tracing::warn!(
                    waited_s = every.as_secs_f64(),
                    "the engine did not answer the watchdog's probe: the service manager is not told the daemon works until it does"
                );
                let r = answer.await;
                tracing::info!(
                    after_s = began.elapsed().as_secs_f64(),
                    "the engine answered the watchdog's probe again"
                );
                r
            }
        };
        if answered.is_err() {
            // The probe panicked: a daemon that cannot say its state is not working.
            tracing::error!("the watchdog's probe failed: the service manager is no longer told the daemon works");
            return;
        }
        ping();
        tokio::time::sleep_until(began + every).await;
    }
}

/// The status line while a started daemon's start goes on.
pub fn start_status(startup: Arc<crate::startup::Startup>) -> impl Fn() -> String + Send {
    move || format!("starting: {}", startup.phase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Condvar, Mutex};

    /// A probe that can be held: while held, it does not return.
    #[derive(Default)]
    struct Gate {
        held: Mutex<bool>,
        moved: Condvar,
        probes: AtomicUsize,
    }

    impl Gate {
        fn set(&self, held: bool) {
            *self.held.lock().unwrap() = held;
            self.moved.notify_all();
        }
        fn pass(&self) {
            self.probes.fetch_add(1, Ordering::SeqCst);
            let mut held = self.held.lock().unwrap();
            while *held {
                held = self.moved.wait(held).unwrap();
            }
        }
    }

    struct Opens(Arc<Gate>);

    impl Drop for Opens {
        fn drop(&mut self) {
            self.0.set(false);
        }
    }

    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(tokio::time::Instant::now() < deadline, "{what} within 10 s");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Pings follow answered probes only: while the engine does not answer, the manager hears
    /// nothing (its timeout then restarts the daemon); once it answers, the pings resume, and a
    /// stuck probe is not started again while it hangs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pings_stop_while_the_probe_hangs_and_resume_after() {
        let gate = Arc::new(Gate::default());
        let pings = Arc::new(AtomicUsize::new(0));
        let (g, p) = (gate.clone(), pings.clone());
        let task = tokio::spawn(watchdog(
            Duration::from_millis(10),
            Arc::new(move || g.pass()),
            move || {
                p.fetch_add(1, Ordering::SeqCst);
            },
        ));
        until("three pings", || pings.load(Ordering::SeqCst) >= 3).await;
        // A failed assertion opens the gate as it unwinds: the runtime's blocking pool (which
        // its drop waits for) is not left stuck in the probe.
        let _open = Opens(gate.clone());
        gate.set(true);
        // The probe that began after the gate closed hangs: the pings stop with it.
        let probes = gate.probes.load(Ordering::SeqCst);
        until("a probe held", || {
            gate.probes.load(Ordering::SeqCst) > probes
        })
        .await;
        let stopped_at = pings.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            pings.load(Ordering::SeqCst),
            stopped_at,
            "a ping while the probe hung"
        );
        assert_eq!(
            gate.probes.load(Ordering::SeqCst),
            probes + 1,
            "another probe started while one hung"
        );
        gate.set(false);
        until("pings again", || {
            pings.load(Ordering::SeqCst) >= stopped_at + 3
        })
        .await;
        task.abort();
    }
}
