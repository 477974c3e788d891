//! The admin port's accept loop, with bounds `axum::serve` has no settings for. Under it a
//! client that opened connections and sent half a request (or nothing) held a socket and a task
//! for as long as it liked, and enough of them used up the daemon's file descriptors: with the
//! common limit of 1024, 1,100 such connections left the NBD listener failing every accept
//! ("Too many open files") and the CLI unanswered, for as long as they were held.
//!
//! So a connection takes one of [`HttpLimits::max_connections`] places before it is accepted:
//! past the cap, new connections wait in the kernel's listen backlog, where they hold no
//! descriptor of ours and the NBD listener's accepts go on. And a connection must send a
//! request's headers within [`HttpLimits::header_read_timeout`] of being accepted or of its
//! last answer (an idle keep-alive connection is the same wait), else it is closed and its place
//! freed; a request's body has its own limit (api_body.rs). A command of the CLI that comes
//! while every place is held is answered once one is freed, at worst a header timeout later.
//!
//! Shutdown: the listener stops accepting, each connection finishes the request it is serving
//! and is then closed; serve.rs bounds how long that may take.
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

/// Admin connections open at once. Each CLI command uses one for a moment; a dashboard or a
/// Prometheus scraper keeps one or two. Bounded so that, with the NBD server's own cap, the
/// daemon stays well inside the usual limit of 1024 descriptors.
pub const MAX_HTTP_CONNECTIONS: usize = 256;
/// How long a connection may take to send a request's headers, counted from its accept or its
/// previous answer; the same as a body's limit (`api_body::BODY_READ_TIMEOUT`).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the accept loop waits after an accept error that is not the client's (such as
/// running out of descriptors), so the error is not retried in a busy loop.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(500);

/// The bounds of the admin port (tests use small ones).
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            max_connections: MAX_HTTP_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
        }
    }
}

/// Serves `app` on `listener` until `stop` resolves, then lets every open connection finish its
/// request. Dropping the returned future closes every connection at once.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    stop: impl Future<Output = ()>,
) {
    assert!(
        limits.max_connections > 0,
        "the admin port needs a connection place"
    );
    let places = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let (closing_tx, closing_rx) = watch::channel(false);
    // Owned here, so dropping this future (serve.rs, past its grace period) ends them all.
    let mut connections = JoinSet::new();
    tokio::pin!(stop);
    loop {
        while connections.try_join_next().is_some() {}
        let place = tokio::select! {
            place = places.clone().acquire_owned() => place.expect("the semaphore is never closed"),
            () = &mut stop => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if !is_the_clients(&e) {
                        tracing::warn!(error = %crate::io_reason(&e), "admin port: accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    }
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(stream), service);
        let mut closing = closing_rx.clone();
        connections.spawn(async move {
            let _place = place;
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => return log_end(r),
                () = async { let _ = closing.wait_for(|c| *c).await; } => {
                    conn.as_mut().graceful_shutdown();
                }
            }
            log_end(conn.await);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    while connections.join_next().await.is_some() {}
}

/// Errors of one incoming connection (it was reset before its accept): the listener is fine.
fn is_the_clients(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | ConnectionRefused
    )
}

fn log_end(r: hyper::Result<()>) {
    if let Err(e) = r {
        // A header timeout, a client gone half-way: the client's doing, not worth a warning.
        tracing::debug!(error = %e, "admin connection ended");
    }
}

#[cfg(test)]
#[path = "http_server_tests.rs"]
mod tests;
