//! Connections over `max_connections`: told why, then closed.
//!
//! A connection closed right after accept leaves its client nothing to report but "server
//! disconnected". So a connection over the limit gets the greeting, then every option it
//! sends is answered `NBD_REP_ERR_POLICY` with a message saying why, as the spec has a
//! server do with a client it does not want ("error inbound options until the client gets
//! the hint"). Answering only the first option is not enough: qemu and libnbd first send
//! options whose failure they shrug off (NBD_OPT_EXTENDED_HEADERS, NBD_OPT_STRUCTURED_REPLY)
//! and report only the error to NBD_OPT_GO. `NBD_OPT_ABORT` is acknowledged; an
//! `NBD_OPT_EXPORT_NAME`, which cannot carry an error, closes the connection. POLICY rather
//! than `NBD_REP_ERR_SHUTDOWN`: the server is not going away, and a client told SHUTDOWN
//! may take it that no later attempt can succeed.
//!
//! A refusal holds little and not for long: at most [`REFUSAL_TIMEOUT`] altogether, at most
//! [`MAX_REFUSED_OPTIONS`] options, an option's data skipped through a fixed buffer (data
//! longer than the 64 KiB the handshake keeps closes the connection), and at most
//! [`MAX_REFUSALS_IN_PROGRESS`] refusals at once (the caller closes any connection beyond
//! that at once, as it did every connection over the limit before).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::connection::ConnError;
use crate::proto::{
    self, handshake_flags, opt, rep, OptionReply, CLIENT_FLAGS_LEN, GREETING_LEN, OPTION_HEADER_LEN,
};

/// How long one refusal may take, greeting to close.
pub(super) const REFUSAL_TIMEOUT: Duration = Duration::from_secs(3);
/// Refusals in progress at once; a connection over the limit beyond these is closed at once.
pub(super) const MAX_REFUSALS_IN_PROGRESS: usize = 16;
/// Options answered before the connection is closed anyway (qemu sends four or five).
const MAX_REFUSED_OPTIONS: usize = 8;

/// What a refused client is told.
pub(super) fn message(max_connections: usize) -> String {
    format!("too many connections (limit {max_connections}); try again later")
}

/// Greets `stream`, refuses its options (bounded by [`REFUSAL_TIMEOUT`]) and closes it.
pub(super) async fn run(mut stream: TcpStream, max_connections: usize) {
    // Small writes answering small reads: Nagle would hold each one back for an ACK.
    let _ = stream.set_nodelay(true);
    let message = message(max_connections);
    match tokio::time::timeout(REFUSAL_TIMEOUT, answer(&mut stream, &message)).await {
        Ok(Ok(())) => tracing::debug!("refused NBD connection closed"),
        Ok(Err(e)) => tracing::debug!(error = %e, "refused NBD connection ended"),
        Err(_) => tracing::debug!("refused NBD connection timed out"),
    }
}

async fn answer(stream: &mut TcpStream, message: &str) -> Result<(), ConnError> {
    let mut out = Vec::with_capacity(GREETING_LEN);
    let flags = handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES;
    proto::encode_greeting(&mut out, flags);
    stream.write_all(&out).await?;
    let mut flags = [0u8; CLIENT_FLAGS_LEN];
    stream.read_exact(&mut flags).await?;
    proto::parse_client_flags(&flags)?;
    for _ in 0..MAX_REFUSED_OPTIONS {
        let mut header = [0u8; OPTION_HEADER_LEN];
        stream.read_exact(&mut header).await?;
        // Bounds the data to 64 KiB, or fails (and the connection closes).
        let header = proto::parse_option_header(&header)?;
        skip(stream, header.len_bytes).await?;
        out.clear();
        match header.option {
            opt::EXPORT_NAME => return Ok(()),
            opt::ABORT => {
                OptionReply::Ack.encode(opt::ABORT, &mut out);
                stream.write_all(&out).await?;
                return Ok(());
            }
            option => {
                let kind = rep::ERR_POLICY;
                OptionReply::Error { kind, message }.encode(option, &mut out);
                stream.write_all(&out).await?;
            }
        }
    }
    Ok(())
}

/// Reads `len` bytes and drops them, through a buffer of fixed size.
async fn skip(stream: &mut TcpStream, len: u32) -> Result<(), ConnError> {
    let mut buf = [0u8; 4096];
    let mut left = len as usize;
    while left > 0 {
        let n = left.min(buf.len());
        stream.read_exact(&mut buf[..n]).await?;
        left -= n;
    }
    Ok(())
}
