//! The NBD server: accept loop, per-connection handshake and transmission.
//!
//! Each connection runs as one tokio task. After the handshake it splits the socket: the
//! connection task reads requests, each request runs on the blocking pool against the
//! [`Export`](crate::Export), and a writer task serializes replies. Three limits bound
//! what one client can make us hold: requests in flight, buffered bytes per connection and
//! buffered bytes over all connections (see [`ServerConfig`]). A connection over
//! `max_connections` is told why before it is closed ([`refuse`]).

mod command;
mod connection;
mod handshake;
mod refuse;
mod replies;
mod transmission;

#[cfg(test)]
mod tests;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::{JoinError, JoinSet};
use tracing::{error, info, info_span, warn, Instrument};

use crate::Backend;

/// Limits and timeouts of [`serve`]. Every field bounds something a client controls.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Connections served at once. A connection accepted beyond this gets the greeting and
    /// an `NBD_REP_ERR_POLICY` error saying so to each option, then is closed (bounded: a
    /// few seconds, a few options, a few such connections at once; beyond those it is
    /// closed at once).
    pub max_connections: usize,
    /// Option haggling must finish within this, or the connection is closed.
    pub handshake_timeout: Duration,
    /// A connection in the transmission phase with no request in flight that sends nothing
    /// for this long is closed. Zero (the default) disables it: the spec lets a server hang
    /// up only on a protocol violation or at shutdown, and a VM whose disk sits idle must
    /// keep it. Peers that vanished are found by TCP keepalive instead.
    pub idle_timeout: Duration,
    /// A client that stops in the middle of a request (header or payload), or stops reading
    /// while a reply is being written, is dropped after this long, so it cannot pin buffers
    /// forever. Zero disables it (and then such a client can hold shutdown).
    pub stall_timeout: Duration,
    /// Largest READ or WRITE, advertised as the maximum block size. A READ beyond it gets
    /// EINVAL (EOVERFLOW with DF); a WRITE header claiming more closes the connection,
    /// because its payload is already on the wire and skipping it would mean reading it.
    pub max_payload_bytes: u32,
    /// Requests read but not yet answered, per connection; at the limit the server stops
    /// reading from that client until a reply has been written.
    pub max_in_flight_per_connection: usize,
    /// READ and WRITE buffers one connection may hold at once (at least `max_payload_bytes`).
    pub max_buffered_bytes_per_connection: usize,
    /// READ and WRITE buffers all connections together may hold: the server's memory bound
    /// for data, whatever `max_connections` says.
    pub max_buffered_bytes_total: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_connections: 256,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::ZERO,
            stall_timeout: Duration::from_secs(2 * 60),
            max_payload_bytes: 32 << 20,
            max_in_flight_per_connection: 64,
            max_buffered_bytes_per_connection: 64 << 20,
            max_buffered_bytes_total: 1 << 30,
        }
    }
}

/// Preferred block size we advertise; the spec wants the maximum at least this large.
pub(crate) const PREFERRED_BLOCK_BYTES: u32 = 4096;
/// Bound on in-flight requests, so a slot count always fits the semaphore's u32 API.
const MAX_IN_FLIGHT_LIMIT: usize = 1 << 16;
/// Pause after a failed accept (e.g. out of file descriptors) so we do not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

impl ServerConfig {
    fn validate(&self) -> io::Result<()> {
        let invalid = |why: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, why.to_string()));
        let payload = self.max_payload_bytes as usize;
        if self.max_connections == 0 {
            return invalid("max_connections must be at least 1");
        }
        if !(1..=MAX_IN_FLIGHT_LIMIT).contains(&self.max_in_flight_per_connection) {
            return invalid("max_in_flight_per_connection must be in 1..=65536");
        }
        if self.max_payload_bytes < PREFERRED_BLOCK_BYTES {
            return invalid("max_payload_bytes must be at least 4096");
        }
        if self.max_buffered_bytes_per_connection < payload {
            return invalid(
                "max_buffered_bytes_per_connection must hold one max_payload_bytes request",
            );
        }
        if self.max_buffered_bytes_total < self.max_buffered_bytes_per_connection
            || self.max_buffered_bytes_total > Semaphore::MAX_PERMITS
        {
            return invalid(
                "max_buffered_bytes_total must be at least max_buffered_bytes_per_connection",
            );
        }
        Ok(())
    }
}

/// What every connection shares.
pub(crate) struct Shared {
    pub backend: Arc<dyn Backend>,
    pub cfg: ServerConfig,
    /// Bytes of READ/WRITE buffers left for all connections together.
    pub buffered_bytes_total: Arc<Semaphore>,
}

/// Serves NBD on `listener` until `shutdown` resolves. Then it stops accepting and reading,
/// lets each connection finish the requests it has taken in (started, or with their headers
/// already in its read buffer), writes the replies, closes the connections and returns: a
/// client sees unanswered requests, never failed ones, and one that reconnects sends them
/// again.
/// Fails only on an invalid `cfg`; a misbehaving client costs only its own connection.
pub async fn serve(
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    cfg.validate()?;
    let buffered_bytes_total = Arc::new(Semaphore::new(cfg.max_buffered_bytes_total));
    let shared = Arc::new(Shared {
        backend,
        cfg,
        buffered_bytes_total,
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut refusals = JoinSet::new();
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "NBD server listening");
    }
    let tasks = (&mut connections, &mut refusals);
    accept_until(&listener, &shared, &stop_rx, tasks, shutdown).await;
    drop(listener);
    // Refused clients are owed nothing more.
    refusals.shutdown().await;
    info!(
        connections = connections.len(),
        "NBD server stopping: draining connections"
    );
    // Cannot fail: stop_rx is still alive.
    let _ = stop_tx.send(true);
    while let Some(joined) = connections.join_next().await {
        log_join(joined);
    }
    info!("NBD server stopped");
    Ok(())
}

async fn accept_until(
    listener: &TcpListener,
    shared: &Arc<Shared>,
    stop: &watch::Receiver<bool>,
    // The tasks of the connections served, and of those over the limit being refused.
    (connections, refusals): (&mut JoinSet<()>, &mut JoinSet<()>),
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        // Reap finished connections so len() counts live ones only.
        while let Some(joined) = connections.try_join_next() {
            log_join(joined);
        }
        tokio::select! {
            biased;
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if connections.len() >= shared.cfg.max_connections {
                        refuse_over_limit(stream, peer, shared.cfg.max_connections, refusals);
                        continue;
                    }
                    connections.spawn(connection::run(stream, peer, shared.clone(), stop.clone()));
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
            Some(joined) = connections.join_next(), if !connections.is_empty() => log_join(joined),
        }
    }
}

/// A connection over the limit: told why by a refusal task, or closed at once when
/// [`refuse::MAX_REFUSALS_IN_PROGRESS`] refusals are already running.
fn refuse_over_limit(stream: TcpStream, peer: SocketAddr, max: usize, refusals: &mut JoinSet<()>) {
    while let Some(joined) = refusals.try_join_next() {
        log_join(joined);
    }
    if refusals.len() >= refuse::MAX_REFUSALS_IN_PROGRESS {
        warn!(%peer, max, refusals = refusals.len(), "closing NBD connection at once: too many connections, and too many being refused");
        return;
    }
    warn!(%peer, max, "refusing NBD connection: too many connections");
    refusals.spawn(refuse::run(stream, max).instrument(info_span!("nbd", %peer)));
}

fn log_join(joined: Result<(), JoinError>) {
    if let Err(e) = joined {
        error!(error = %e, "NBD connection task failed");
    }
}
