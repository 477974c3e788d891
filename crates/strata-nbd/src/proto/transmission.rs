//! Transmission phase: request headers, simple replies and structured reply chunks.

use super::{chunk, cmd, magic, sent_str, ProtoError, Reader};
use crate::BlockStatus;

/// Magic, flags, type, cookie, offset, length.
pub const REQUEST_HEADER_LEN: usize = 28;
/// Magic, error, cookie.
pub const SIMPLE_REPLY_HEADER_LEN: usize = 16;
/// Magic, flags, type, cookie, payload length.
pub const CHUNK_HEADER_LEN: usize = 20;
/// Most extents one BLOCK_STATUS chunk carries. The spec lets a server return fewer extents
/// than the range needs; capping keeps a fragmented range from producing a huge reply.
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// `cmd_flags::*`.
    pub flags: u16,
    /// `cmd::*`; unknown values are kept so the server can answer EINVAL.
    pub command: u16,
    /// Opaque to the server (the spec's "handle"), echoed in the reply.
    pub cookie: u64,
    pub offset: u64,
    pub len_bytes: u32,
}

impl RequestHeader {
    /// Bytes that follow the header on the wire: only NBD_CMD_WRITE carries a payload.
    pub fn payload_len(&self) -> u32 {
        if self.command == cmd::WRITE {
            self.len_bytes
        } else {
            0
        }
    }
}

/// Parses a request header and bounds the payload it announces by `max_payload_bytes`:
/// a WRITE longer than that cannot be skipped cheaply and is treated as hostile.
pub fn parse_request_header(
    bytes: &[u8],
    max_payload_bytes: u32,
) -> Result<RequestHeader, ProtoError> {
    let mut r = Reader::new(bytes);
    let found = r.u32()?;
    if found != magic::REQUEST {
        return Err(ProtoError::BadMagic {
            expected: magic::REQUEST.into(),
            found: found.into(),
        });
    }
    let header = RequestHeader {
        flags: r.u16()?,
        command: r.u16()?,
        cookie: r.u64()?,
        offset: r.u64()?,
        len_bytes: r.u32()?,
    };
    r.finish()?;
    if header.payload_len() > max_payload_bytes {
        return Err(ProtoError::PayloadTooLarge {
            len: header.len_bytes,
            max: max_payload_bytes,
        });
    }
    Ok(header)
}

/// Client side of [`parse_request_header`] (the payload, if any, follows separately).
pub fn encode_request(out: &mut Vec<u8>, req: &RequestHeader) {
    out.extend_from_slice(&magic::REQUEST.to_be_bytes());
    out.extend_from_slice(&req.flags.to_be_bytes());
    out.extend_from_slice(&req.command.to_be_bytes());
    out.extend_from_slice(&req.cookie.to_be_bytes());
    out.extend_from_slice(&req.offset.to_be_bytes());
    out.extend_from_slice(&req.len_bytes.to_be_bytes());
}

/// Simple reply header; for a successful READ the data follows it.
pub fn encode_simple_reply(out: &mut Vec<u8>, cookie: u64, error: u32) {
    out.extend_from_slice(&magic::SIMPLE_REPLY.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

pub fn encode_chunk_header(out: &mut Vec<u8>, flags: u16, chunk_type: u16, cookie: u64, len: u32) {
    out.extend_from_slice(&magic::STRUCTURED_REPLY.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&chunk_type.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// Final chunk of a reply that carries nothing: success when no error chunk came before.
pub fn encode_none_chunk(out: &mut Vec<u8>, cookie: u64) {
    encode_chunk_header(out, chunk::FLAG_DONE, chunk::NONE, cookie, 0);
}

/// Header and offset of an OFFSET_DATA chunk whose `data_len` bytes the caller sends next;
/// kept apart from the data so a 32 MiB read is never copied just to prepend 28 bytes.
pub fn encode_offset_data_prefix(
    out: &mut Vec<u8>,
    cookie: u64,
    offset: u64,
    data_len: u32,
    done: bool,
) -> Result<(), ProtoError> {
    let Some(len) = data_len.checked_add(8) else {
        return Err(ProtoError::PayloadTooLarge {
            len: data_len,
            max: u32::MAX - 8,
        });
    };
    let flags = if done { chunk::FLAG_DONE } else { 0 };
    encode_chunk_header(out, flags, chunk::OFFSET_DATA, cookie, len);
    out.extend_from_slice(&offset.to_be_bytes());
    Ok(())
}

/// Final ERROR chunk: `error` is an NBD errno (nonzero), `message` is for a human.
pub fn encode_error_chunk(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str) {
    debug_assert!(error != 0, "an error chunk must carry a nonzero error");
    let message = sent_str(message);
    // sent_str caps at 4096 bytes, so both lengths fit their fields.
    encode_chunk_header(
        out,
        chunk::FLAG_DONE,
        chunk::ERROR,
        cookie,
        6 + message.len() as u32,
    );
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message);
}

/// Final BLOCK_STATUS chunk for one metadata context. Extents past
/// [`MAX_BLOCK_STATUS_EXTENTS`] are dropped (the client asks again from where we stopped).
pub fn encode_block_status_chunk(
    out: &mut Vec<u8>,
    cookie: u64,
    context_id: u32,
    extents: &[BlockStatus],
) {
    debug_assert!(
        !extents.is_empty(),
        "a block status chunk needs at least one extent"
    );
    let extents = &extents[..extents.len().min(MAX_BLOCK_STATUS_EXTENTS)];
    let len = 4 + 8 * extents.len() as u32;
    encode_chunk_header(out, chunk::FLAG_DONE, chunk::BLOCK_STATUS, cookie, len);
    out.extend_from_slice(&context_id.to_be_bytes());
    for e in extents {
        out.extend_from_slice(&e.len.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
    }
}
