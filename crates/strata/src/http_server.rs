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
//! freed; a request's body has its own limit (api_body.rs). A client that stops reading its
//! answers is the same: a write that makes no progress for [`HttpLimits::write_stall_timeout`]
//! ends the connection. A command of the CLI that comes while every place is held is answered
//! once one is freed, at worst a header timeout (or a write stall) later.
//!
//! Shutdown: the listener stops accepting, each connection finishes the request it is serving
//! and is then closed; serve.rs bounds how long that may take.
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Sleep;

/// Admin connections open at once. Each CLI command uses one for a moment; a dashboard or a
/// Prometheus scraper keeps one or two. Bounded so that, with the NBD server's own cap, the
/// daemon stays well inside the usual limit of 1024 descriptors.
pub const MAX_HTTP_CONNECTIONS: usize = 256;
/// How long a connection may take to send a request's headers, counted from its accept or its
/// previous answer; the same as a body's limit (`api_body::BODY_READ_TIMEOUT`).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a write of an answer may make no progress (the client reads none of it) before
/// the connection is closed. Generous: an answer is small, and a client that reads slowly
/// still makes progress.
pub const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the accept loop waits after an accept error that is not the client's (such as
/// running out of descriptors), so the error is not retried in a busy loop.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(500);

/// The bounds of the admin port (tests use small ones).
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub write_stall_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            max_connections: MAX_HTTP_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
            write_stall_timeout: WRITE_STALL_TIMEOUT,
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
        let io = WriteStallBound::new(stream, limits.write_stall_timeout);
        let conn = http.serve_connection(TokioIo::new(io), service);
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

/// A connection's socket whose writes fail with `TimedOut` once one has waited `limit` for the
/// client to take any of it. hyper has a timeout for reading a request's headers but none for
/// writing an answer, and a client that sends requests and reads nothing would otherwise hold
/// its place for good.
struct WriteStallBound<T> {
    io: T,
    limit: Duration,
    /// Armed when a write (or flush, or shutdown) first finds the socket full; disarmed by any
    /// progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteStallBound<T> {
    fn new(io: T, limit: Duration) -> Self {
        WriteStallBound {
            io,
            limit,
            stalled: None,
        }
    }

    /// `polled` as it is, unless it has been pending for `limit` since its last progress.
    fn bounded<R>(
        &mut self,
        polled: Poll<io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<R>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read none of its answer for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteStallBound<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteStallBound<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.bounded(polled, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.bounded(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.bounded(polled, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.bounded(polled, cx)
    }
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
