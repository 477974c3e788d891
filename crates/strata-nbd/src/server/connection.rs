//! One client connection from accept to close.

use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::{info, info_span, warn, Instrument};

use super::{handshake, transmission, Shared};
use crate::proto::ProtoError;

/// Why a connection ended although nothing went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// NBD_OPT_ABORT during the handshake.
    Abort,
    /// NBD_CMD_DISC.
    Disconnect,
    /// The client closed the socket between messages.
    Eof,
    /// The server is shutting down.
    Shutdown,
    /// Nothing in flight and nothing received for `idle_timeout` (only when enabled).
    Idle,
}

impl fmt::Display for Ending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ending::Abort => "client aborted the handshake",
            Ending::Disconnect => "client sent NBD_CMD_DISC",
            Ending::Eof => "client closed the connection",
            Ending::Shutdown => "server shutdown",
            Ending::Idle => "idle timeout",
        })
    }
}

/// Why a connection was dropped: the client broke the protocol, the network failed,
/// or (never expected) the backend panicked.
#[derive(Debug, thiserror::Error)]
pub(super) enum ConnError {
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error("protocol violation: {0}")]
    Proto(#[from] ProtoError),
    #[error("handshake not finished within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("client stalled for {0:?} in the middle of a message")]
    Stalled(Duration),
    #[error("NBD_OPT_EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    #[error("backend panicked while {0}")]
    BackendPanic(&'static str),
    #[error("reply writer failed")]
    WriterGone,
    #[error("internal error: {0}")]
    Internal(&'static str),
}

/// TCP keepalive on every accepted connection. The server never hangs up on a client for
/// being quiet (unless `idle_timeout` is set), so a peer that vanished without a FIN (power
/// loss, a pulled cable, a dropped NAT entry) is found by probes: the first after 60 s of
/// silence, then one every 10 s; after 6 unanswered the kernel fails the socket, about two
/// minutes in, and the connection ends with an I/O error like any other.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 6;

pub(super) async fn run(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
) {
    let span = info_span!("nbd", %peer);
    run_logged(stream, shared, stop).instrument(span).await;
}

async fn run_logged(stream: TcpStream, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    // Replies are small and latency-bound; Nagle would hold them back (the spec agrees).
    if let Err(e) = stream.set_nodelay(true) {
        warn!(error = %e, "cannot set TCP_NODELAY");
    }
    if let Err(e) = set_keepalive(&stream) {
        warn!(error = %e, "cannot enable TCP keepalive");
    }
    info!("NBD connection opened");
    match serve_connection(stream, &shared, &mut stop).await {
        Ok(ending) => info!(%ending, "NBD connection closed"),
        Err(e) => warn!(error = %e, "NBD connection dropped"),
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    shared: &Arc<Shared>,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ending, ConnError> {
    let limit = shared.cfg.handshake_timeout;
    let negotiated = tokio::select! {
        biased;
        () = stopped(stop) => return Ok(Ending::Shutdown),
        done = tokio::time::timeout(limit, handshake::negotiate(&mut stream, shared)) => {
            done.map_err(|_| ConnError::HandshakeTimeout(limit))??
        }
    };
    match negotiated {
        Some(session) => transmission::run(stream, session, shared, stop).await,
        None => Ok(Ending::Abort),
    }
}

fn set_keepalive(stream: &TcpStream) -> io::Result<()> {
    let keepalive = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// Resolves once the server is shutting down (or the server is gone, which means the same).
pub(super) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stopping| *stopping).await;
}

/// `fut` bounded by `limit`; a zero limit means no bound. None when the time ran out.
pub(super) async fn within<F: Future>(limit: Duration, fut: F) -> Option<F::Output> {
    if limit.is_zero() {
        Some(fut.await)
    } else {
        tokio::time::timeout(limit, fut).await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_sockets_get_the_keepalive_settings() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        set_keepalive(&stream).unwrap();
        let sock = SockRef::from(&stream);
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(sock.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(sock.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
    }
}
