//! Transmission phase: a reader loop (this task), requests on the engine's completions or
//! the blocking pool, and the reply writer (`replies.rs`) that keeps replies from
//! interleaving.
//!
//! A request is "in flight" from the moment the reader takes a slot for it until its reply
//! has been handed to the socket; slots are what bounds the reply queue, the blocking pool
//! work and the wait at shutdown. READ/WRITE buffers additionally hold byte budget.

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, error, info, trace, Instrument};

use super::command::{self, Command, Wire};
use super::connection::{stopped, within, ConnError, Ending};
use super::handshake::Session;
use super::replies::{Budget, Replies, Reply};
use super::{ServerConfig, Shared};
use crate::proto::{self, cmd, RequestHeader, REQUEST_HEADER_LEN};
use crate::Errno;

/// Requests are read through a buffer of this size: at queue depth 32 one system call picks
/// up many request headers instead of one each.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// How long shutdown waits for the rest of a request whose header already arrived.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The socket's read half, buffered.
type Reader = BufReader<OwnedReadHalf>;

struct Conn {
    session: Arc<Session>,
    slots: Arc<Semaphore>,
    max_in_flight: usize,
    buffered_bytes: Arc<Semaphore>,
    buffered_bytes_total: Arc<Semaphore>,
    /// The last request dispatched was the only one in flight, with nothing read after it.
    was_alone: AtomicBool,
    /// Requests started and not yet completed (shared with `Replies`, which counts a
    /// completion before writing its reply: a client at queue depth one can have the reply
    /// and send its next request before the completing thread lets go of the reply's slot).
    unanswered: Arc<AtomicUsize>,
}

impl Conn {
    /// Whether the request just read, which holds its slot, may be made on the reader's
    /// thread (`Export::write_nowait_alone`): it is the only request in flight, no other has
    /// been read behind it, and the one before it was alone too. A client at queue depth one
    /// passes every time. One that keeps more in flight may find its requests all answered
    /// and none read yet, but not twice in a row: blocking the reader there, while the next
    /// requests pile up unread, turned 26,000 queue-depth-32 writes a second into 6,000.
    fn alone_after(&self, reader: &Reader) -> bool {
        let now = self.idle() && reader.buffer().is_empty();
        self.was_alone.swap(now, Ordering::Relaxed) && now
    }

    /// True when every request started so far has completed (its reply may still be on its
    /// way to the socket).
    fn idle(&self) -> bool {
        self.unanswered.load(Ordering::Acquire) == 0
    }

    /// Waits for `bytes` of buffer from this connection's budget, then the server's. The
    /// order is fixed and only the reader takes from the first, so this cannot deadlock.
    async fn reserve(&self, bytes: u32) -> Result<Option<Budget>, ConnError> {
        if bytes == 0 {
            return Ok(None);
        }
        let closed = |_| ConnError::Internal("budget semaphore closed");
        let connection = self
            .buffered_bytes
            .clone()
            .acquire_many_owned(bytes)
            .await
            .map_err(closed)?;
        let total = self
            .buffered_bytes_total
            .clone()
            .acquire_many_owned(bytes)
            .await
            .map_err(closed)?;
        Ok(Some(Budget {
            _connection: connection,
            _total: total,
        }))
    }

    /// Waits until every request read so far has been answered and its reply written
    /// (or dropped because the writer failed).
    async fn drain(&self) {
        let _ = self.slots.acquire_many(self.max_in_flight as u32).await;
    }
}

pub(super) async fn run(
    stream: TcpStream,
    session: Session,
    shared: &Arc<Shared>,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ending, ConnError> {
    let cfg = &shared.cfg;
    info!(export = %session.name, structured = session.structured, "NBD transmission phase");
    let (reader, writer) = stream.into_split();
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, reader);
    let slots = Arc::new(Semaphore::new(cfg.max_in_flight_per_connection));
    let unanswered = Arc::new(AtomicUsize::new(0));
    let (tx, write_replies) = Replies::new(
        writer,
        slots.clone(),
        cfg.max_in_flight_per_connection,
        cfg.stall_timeout,
        unanswered.clone(),
    );
    let writer = tokio::spawn(write_replies.in_current_span());
    let conn = Conn {
        session: Arc::new(session),
        slots,
        max_in_flight: cfg.max_in_flight_per_connection,
        buffered_bytes: Arc::new(Semaphore::new(cfg.max_buffered_bytes_per_connection)),
        buffered_bytes_total: shared.buffered_bytes_total.clone(),
        was_alone: AtomicBool::new(false),
        unanswered,
    };
    let ending = read_requests(&mut reader, &conn, &tx, cfg, stop).await;
    conn.drain().await;
    drop(tx);
    match writer.await {
        Ok(Ok(())) => ending,
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ConnError::Internal("reply writer panicked")),
    }
}

/// How the wait for the next request ended.
enum Begun {
    /// Its first bytes are in the read buffer; the slot it will hold is taken.
    Request(OwnedSemaphorePermit),
    Eof,
    Idle,
}

async fn read_requests(
    reader: &mut Reader,
    conn: &Conn,
    tx: &Replies,
    cfg: &ServerConfig,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ending, ConnError> {
    loop {
        // At shutdown nothing more is read from the socket, but a request whose header is
        // already whole in the read buffer (a client that pipelines sends several in one
        // segment, and one system call took them all) is run like one in flight: the client
        // sent it before the server stopped, and a client that reconnects after the restart
        // (qemu's `reconnect-delay`) sends again only what got no reply, while an error
        // reply would reach its guest. What is still in the kernel's socket buffer gets no
        // reply; the connection closes under it.
        let stopping = *stop.borrow();
        if stopping && reader.buffer().len() < REQUEST_HEADER_LEN {
            return Ok(Ending::Shutdown);
        }
        // Shutdown and a dead writer interrupt the wait for the next request only: once a
        // request has begun to arrive, it is read to its end and answered.
        let begun = tokio::select! {
            biased;
            () = stopped(stop), if !stopping => continue,
            () = tx.closed() => return Err(ConnError::WriterGone),
            begun = request_begins(reader, conn, cfg) => begun?,
        };
        let slot = match begun {
            Begun::Request(slot) => slot,
            Begun::Eof => return Ok(Ending::Eof),
            Begun::Idle => return Ok(Ending::Idle),
        };
        // A request that has begun gets to finish arriving even during shutdown, but only
        // for a grace period: a client stalling mid-request must not hold shutdown.
        let taken = tokio::select! {
            biased;
            taken = take_request(reader, conn, tx, cfg, slot) => taken?,
            () = grace_after_stop(stop) => return Err(ConnError::Stalled(SHUTDOWN_GRACE)),
        };
        if let Taken::Disconnect = taken {
            return Ok(Ending::Disconnect);
        }
    }
}

async fn grace_after_stop(stop: &mut watch::Receiver<bool>) {
    stopped(stop).await;
    tokio::time::sleep(SHUTDOWN_GRACE).await;
}

/// Takes a slot (waiting while `max_in_flight` requests are out), then waits for the next
/// request's first bytes. Cancel-safe: what arrives stays in the read buffer.
async fn request_begins(
    reader: &mut Reader,
    conn: &Conn,
    cfg: &ServerConfig,
) -> Result<Begun, ConnError> {
    let slot = conn.slots.clone().acquire_owned().await;
    let slot = slot.map_err(|_| ConnError::Internal("slot semaphore closed"))?;
    loop {
        // Between requests the client owes us nothing: only the opt-in idle timeout bounds
        // this wait.
        let Some(filled) = within(cfg.idle_timeout, reader.fill_buf()).await else {
            if conn.idle() {
                return Ok(Begun::Idle);
            }
            continue; // the client is waiting on us, not idle
        };
        return Ok(match filled?.is_empty() {
            true => Begun::Eof,
            false => Begun::Request(slot),
        });
    }
}

/// What became of a request taken in.
enum Taken {
    Dispatched,
    Disconnect,
}

/// Reads the header of a request that has begun (the rest of it is a stall if it does not
/// come), then its payload, and starts it (`dispatch`); NBD_CMD_DISC ends the connection.
async fn take_request(
    reader: &mut Reader,
    conn: &Conn,
    tx: &Replies,
    cfg: &ServerConfig,
    slot: OwnedSemaphorePermit,
) -> Result<Taken, ConnError> {
    let mut header = [0u8; REQUEST_HEADER_LEN];
    let limit = cfg.stall_timeout;
    within(limit, reader.read_exact(&mut header))
        .await
        .ok_or(ConnError::Stalled(limit))??;
    let req = proto::parse_request_header(&header, cfg.max_payload_bytes)?;
    trace!(
        command = req.command,
        flags = req.flags,
        cookie = req.cookie,
        offset = req.offset,
        len = req.len_bytes,
        "request"
    );
    if req.command == cmd::DISC {
        return Ok(Taken::Disconnect);
    }
    dispatch(reader, conn, tx, cfg, slot, req).await?;
    Ok(Taken::Dispatched)
}

/// Validates a request and either answers it at once (refused) or starts it on the
/// blocking pool. Either way its payload is consumed, keeping the stream in step.
async fn dispatch(
    reader: &mut Reader,
    conn: &Conn,
    tx: &Replies,
    cfg: &ServerConfig,
    slot: OwnedSemaphorePermit,
    req: RequestHeader,
) -> Result<(), ConnError> {
    let limit = cfg.stall_timeout;
    match command::validate(&req, &conn.session, cfg.max_payload_bytes) {
        Err(refusal) => {
            debug!(command = req.command, cookie = req.cookie, errno = ?refusal.errno, why = refusal.why, "request refused");
            skip_payload(reader, req.payload_len(), limit).await?;
            // Told before the reply is queued, as the export counts what it answers before
            // replying: a client that looks at the figures after its reply finds it there.
            conn.session.export.refused(req.command, refusal.errno);
            let wire = command::error_reply(&conn.session, req.cookie, refusal.errno, refusal.why);
            let reply = Reply {
                wire,
                _slot: slot,
                _budget: None,
            };
            tx.send(reply).await
        }
        Ok(command) => {
            let budget = conn.reserve(command.buffer_bytes()).await?;
            let payload = read_payload(reader, req.payload_len(), limit).await?;
            let alone = conn.alone_after(reader);
            // Counted down when it completes (`Replies::complete`, `blocking_send`).
            conn.unanswered.fetch_add(1, Ordering::AcqRel);
            spawn_request(
                &conn.session,
                req.cookie,
                command,
                payload,
                slot,
                budget,
                tx.clone(),
                alone,
            );
            Ok(())
        }
    }
}

async fn read_payload(
    reader: &mut Reader,
    len: u32,
    limit: Duration,
) -> Result<Vec<u8>, ConnError> {
    let mut payload = vec![0u8; len as usize];
    if len > 0 {
        within(limit, reader.read_exact(&mut payload))
            .await
            .ok_or(ConnError::Stalled(limit))??;
    }
    Ok(payload)
}

/// Reads and drops the payload of a refused WRITE without buffering it whole.
async fn skip_payload(
    reader: &mut Reader,
    len: u32,
    limit: Duration,
) -> Result<(), ConnError> {
    if len == 0 {
        return Ok(());
    }
    let mut payload = (&mut *reader).take(len.into());
    let copied = within(limit, tokio::io::copy(&mut payload, &mut tokio::io::sink())).await;
    if copied.ok_or(ConnError::Stalled(limit))?? < u64::from(len) {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok(())
}

/// Runs the command on the blocking pool and queues its reply. A panic in the export is
/// answered with EIO rather than leaving the client waiting for a reply that never comes.
#[allow(clippy::too_many_arguments)]
fn spawn_request(
    session: &Arc<Session>,
    cookie: u64,
    command: Command,
    payload: Vec<u8>,
    slot: OwnedSemaphorePermit,
    budget: Option<Budget>,
    tx: Replies,
    alone: bool,
) {
    let session = session.clone();
    let (slot, budget, tx) = match command {
        Command::Write { offset, len, fua } if len > 0 => match start_write(&session, cookie, offset, fua, &payload, (slot, budget, tx), alone) {
            None => return,
            Some(back) => back,
        },
        Command::Read { offset, len } if len > 0 => match start_read(&session, cookie, offset, len, (slot, budget, tx)) {
            None => return,
            Some(back) => back,
        },
        Command::Flush => match session.export.flush_nowait() {
            Some(result) => {
                let wire = match result {
                    Ok(()) => command::ok_reply(&session, cookie),
                    Err(errno) => command::error_reply(&session, cookie, errno, "export failed the request"),
                };
                tx.complete(Reply { wire, _slot: slot, _budget: budget });
                return;
            }
            None => (slot, budget, tx),
        },
        _ => (slot, budget, tx),
    };
    tokio::task::spawn_blocking(move || {
        let run = || command::execute(&session, cookie, command, payload);
        let wire = catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|_| {
            error!(?command, "export panicked; answering EIO");
            // The export never answered, so it has not counted the request either.
            let tell = || session.export.refused(command.code(), Errno::Io);
            if catch_unwind(AssertUnwindSafe(tell)).is_err() {
                error!(?command, "export panicked again when told of its panic");
            }
            command::error_reply(&session, cookie, Errno::Io, "internal error")
        });
        // Never waits: the queue holds max_in_flight replies and each holds a slot.
        tx.blocking_send(Reply {
            wire,
            _slot: slot,
            _budget: budget,
        });
    });
}

/// What a reply needs besides its wire: the slot and budget it holds, and the queue it goes to.
type ReplyParts = (OwnedSemaphorePermit, Option<Budget>, Replies);

/// A reply's parts while an export's completion (on any thread) may still take them.
type HeldParts = Arc<std::sync::Mutex<Option<ReplyParts>>>;

fn hold(parts: ReplyParts) -> HeldParts {
    Arc::new(std::sync::Mutex::new(Some(parts)))
}

/// Takes the parts back: for the completion's reply, or after the export refused to start.
fn take(held: &HeldParts) -> Option<ReplyParts> {
    held.lock().ok().and_then(|mut h| h.take())
}

/// Queues a completion's reply (once; a second call finds the parts gone).
fn send_held(held: &HeldParts, wire: Wire) {
    if let Some((slot, budget, tx)) = take(held) {
        tx.complete(Reply { wire, _slot: slot, _budget: budget });
    }
}

/// Starts a write on the export's non-blocking path, its reply sent from the completion.
/// Returns the reply's parts when the export cannot start it that way (then it runs on the
/// blocking pool like any other request).
fn start_write(
    session: &Arc<Session>,
    cookie: u64,
    offset: u64,
    fua: bool,
    payload: &[u8],
    parts: ReplyParts,
    alone: bool,
) -> Option<ReplyParts> {
    let held = hold(parts);
    let (held_in, s) = (held.clone(), session.clone());
    let done: crate::WriteDone = Box::new(move |result| {
        let wire = match result {
            Ok(()) => command::ok_reply(&s, cookie),
            Err(errno) => command::error_reply(&s, cookie, errno, "export failed the request"),
        };
        send_held(&held_in, wire);
    });
    let export = &session.export;
    let start = || match alone {
        true => export.write_nowait_alone(offset, payload, fua, done),
        false => export.write_nowait(offset, payload, fua, done),
    };
    match catch_unwind(AssertUnwindSafe(start)) {
        Ok(Ok(())) => None,
        Ok(Err(_)) | Err(_) => take(&held),
    }
}

/// Starts a read on the export's non-blocking path, its reply sent from the completion;
/// like [`start_write`], returns the parts when the export cannot start it that way.
fn start_read(
    session: &Arc<Session>,
    cookie: u64,
    offset: u64,
    len: u32,
    parts: ReplyParts,
) -> Option<ReplyParts> {
    let held = hold(parts);
    let (held_in, s) = (held.clone(), session.clone());
    let done: crate::ReadDone = Box::new(move |result| {
        // The reply's header promises `len` bytes: an export returning another length
        // would desynchronize the stream, so that is an error, never a short chunk.
        let result = result.and_then(|data| match data.len() == len as usize {
            true => Ok(data),
            false => {
                error!(expected = len, got = data.len(), "export returned a read of the wrong length");
                Err(Errno::Io)
            }
        });
        send_held(&held_in, command::read_reply(&s, cookie, offset, result));
    });
    match catch_unwind(AssertUnwindSafe(|| session.export.read_nowait(offset, len, done))) {
        Ok(Ok(())) => None,
        Ok(Err(_)) | Err(_) => take(&held),
    }
}
