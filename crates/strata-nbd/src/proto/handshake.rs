//! Handshake phase: greeting, client flags, options and option replies.

use super::{client_flags, magic, rep, sent_str, ProtoError, Reader, MAX_OPTION_BYTES};

/// Server greeting: NBDMAGIC, IHAVEOPT, 16-bit handshake flags.
pub const GREETING_LEN: usize = 18;
pub const CLIENT_FLAGS_LEN: usize = 4;
/// IHAVEOPT, option code, payload length.
pub const OPTION_HEADER_LEN: usize = 16;
/// Zero padding after the NBD_OPT_EXPORT_NAME reply unless NO_ZEROES was negotiated.
pub const EXPORT_NAME_REPLY_ZEROES: usize = 124;

pub fn encode_greeting(out: &mut Vec<u8>, handshake_flags: u16) {
    out.extend_from_slice(&magic::NBDMAGIC.to_be_bytes());
    out.extend_from_slice(&magic::IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&handshake_flags.to_be_bytes());
}

/// The client's 32-bit flags. The spec makes the server drop a client that sets a flag
/// it does not know, so anything beyond FIXED_NEWSTYLE | NO_ZEROES is an error.
pub fn parse_client_flags(bytes: &[u8]) -> Result<u32, ProtoError> {
    let mut r = Reader::new(bytes);
    let flags = r.u32()?;
    r.finish()?;
    let known = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
    if flags & !known != 0 {
        return Err(ProtoError::UnknownClientFlags(flags));
    }
    Ok(flags)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len_bytes: u32,
}

/// Parses the 16-byte option header and bounds the payload length it announces, so the
/// caller can allocate `len_bytes` without trusting the client.
pub fn parse_option_header(bytes: &[u8]) -> Result<OptionHeader, ProtoError> {
    let mut r = Reader::new(bytes);
    let found = r.u64()?;
    if found != magic::IHAVEOPT {
        return Err(ProtoError::BadMagic {
            expected: magic::IHAVEOPT,
            found,
        });
    }
    let option = r.u32()?;
    let len_bytes = r.u32()?;
    r.finish()?;
    if len_bytes > MAX_OPTION_BYTES {
        return Err(ProtoError::OptionTooLong {
            option,
            len: len_bytes,
            max: MAX_OPTION_BYTES,
        });
    }
    Ok(OptionHeader { option, len_bytes })
}

/// Client side: one option with its payload.
pub fn encode_option(out: &mut Vec<u8>, option: u32, payload: &[u8]) {
    out.extend_from_slice(&magic::IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// NBD_OPT_EXPORT_NAME: the whole payload is the name.
pub fn parse_export_name(payload: &[u8]) -> Result<String, ProtoError> {
    Reader::new(payload).string(payload.len() as u64)
}

/// Payload of NBD_OPT_INFO and NBD_OPT_GO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    /// `info::*` codes the client asked for (unknown ones are kept; the server ignores them).
    pub requests: Vec<u16>,
}

pub fn parse_info_request(payload: &[u8]) -> Result<InfoRequest, ProtoError> {
    let mut r = Reader::new(payload);
    let name_len = r.u32()?;
    let name = r.string(u64::from(name_len))?;
    let count = usize::from(r.u16()?);
    // take() proves the client sent 2 * count bytes before we size the Vec.
    let raw = r.take(count * 2)?;
    r.finish()?;
    let requests = raw
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Ok(InfoRequest { name, requests })
}

/// Client side of [`parse_info_request`].
pub fn encode_info_request(out: &mut Vec<u8>, req: &InfoRequest) {
    out.extend_from_slice(&(req.name.len() as u32).to_be_bytes());
    out.extend_from_slice(req.name.as_bytes());
    out.extend_from_slice(&(req.requests.len() as u16).to_be_bytes());
    for code in &req.requests {
        out.extend_from_slice(&code.to_be_bytes());
    }
}

/// Payload of NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub export_name: String,
    pub queries: Vec<String>,
}

pub fn parse_meta_context_request(payload: &[u8]) -> Result<MetaContextRequest, ProtoError> {
    let mut r = Reader::new(payload);
    let name_len = r.u32()?;
    let export_name = r.string(u64::from(name_len))?;
    let count = r.u32()? as usize;
    // Each query needs at least its 4-byte length, so a count the remaining bytes cannot
    // hold is a lie; reject it before reserving space for it.
    let min_bytes = count.saturating_mul(4);
    if min_bytes > r.remaining() {
        return Err(ProtoError::Truncated {
            needed: min_bytes,
            available: r.remaining(),
        });
    }
    let mut queries = Vec::with_capacity(count);
    for _ in 0..count {
        let len = r.u32()?;
        queries.push(r.string(u64::from(len))?);
    }
    r.finish()?;
    Ok(MetaContextRequest {
        export_name,
        queries,
    })
}

/// Client side of [`parse_meta_context_request`].
pub fn encode_meta_context_request(out: &mut Vec<u8>, req: &MetaContextRequest) {
    out.extend_from_slice(&(req.export_name.len() as u32).to_be_bytes());
    out.extend_from_slice(req.export_name.as_bytes());
    out.extend_from_slice(&(req.queries.len() as u32).to_be_bytes());
    for q in &req.queries {
        out.extend_from_slice(&(q.len() as u32).to_be_bytes());
        out.extend_from_slice(q.as_bytes());
    }
}

/// One NBD_REP_INFO item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Info<'a> {
    Export {
        size_bytes: u64,
        transmission_flags: u16,
    },
    Name(&'a str),
    Description(&'a str),
    BlockSize {
        min_bytes: u32,
        preferred_bytes: u32,
        max_bytes: u32,
    },
}

impl Info<'_> {
    fn encode(&self, out: &mut Vec<u8>) {
        use super::info;
        match *self {
            Info::Export {
                size_bytes,
                transmission_flags,
            } => {
                out.extend_from_slice(&info::EXPORT.to_be_bytes());
                out.extend_from_slice(&size_bytes.to_be_bytes());
                out.extend_from_slice(&transmission_flags.to_be_bytes());
            }
            Info::Name(name) => {
                out.extend_from_slice(&info::NAME.to_be_bytes());
                out.extend_from_slice(sent_str(name));
            }
            Info::Description(text) => {
                out.extend_from_slice(&info::DESCRIPTION.to_be_bytes());
                out.extend_from_slice(sent_str(text));
            }
            Info::BlockSize {
                min_bytes,
                preferred_bytes,
                max_bytes,
            } => {
                out.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
                out.extend_from_slice(&min_bytes.to_be_bytes());
                out.extend_from_slice(&preferred_bytes.to_be_bytes());
                out.extend_from_slice(&max_bytes.to_be_bytes());
            }
        }
    }
}

/// A reply during option haggling (every option but NBD_OPT_EXPORT_NAME gets these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionReply<'a> {
    Ack,
    Server {
        name: &'a str,
        description: &'a str,
    },
    Info(Info<'a>),
    MetaContext {
        id: u32,
        name: &'a str,
    },
    /// `kind` is one of the `rep::ERR_*` codes; `message` is for a human.
    Error {
        kind: u32,
        message: &'a str,
    },
}

impl OptionReply<'_> {
    /// Appends magic, option, reply type, length and payload to `out`.
    pub fn encode(&self, option: u32, out: &mut Vec<u8>) {
        let mut payload = Vec::new();
        let reply_type = self.encode_payload(&mut payload);
        out.extend_from_slice(&magic::OPTION_REPLY.to_be_bytes());
        out.extend_from_slice(&option.to_be_bytes());
        out.extend_from_slice(&reply_type.to_be_bytes());
        // Every part of the payload is a bounded string or a fixed field: well under 4 GiB.
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&payload);
    }

    fn encode_payload(&self, out: &mut Vec<u8>) -> u32 {
        match *self {
            OptionReply::Ack => rep::ACK,
            OptionReply::Server { name, description } => {
                let name = sent_str(name);
                out.extend_from_slice(&(name.len() as u32).to_be_bytes());
                out.extend_from_slice(name);
                out.extend_from_slice(sent_str(description));
                rep::SERVER
            }
            OptionReply::Info(item) => {
                item.encode(out);
                rep::INFO
            }
            OptionReply::MetaContext { id, name } => {
                out.extend_from_slice(&id.to_be_bytes());
                out.extend_from_slice(sent_str(name));
                rep::META_CONTEXT
            }
            OptionReply::Error { kind, message } => {
                debug_assert!(kind & (1 << 31) != 0, "option error {kind:#x} lacks bit 31");
                out.extend_from_slice(sent_str(message));
                kind
            }
        }
    }
}

/// Reply to a successful NBD_OPT_EXPORT_NAME: size, flags and (unless the client
/// negotiated NO_ZEROES) 124 bytes of padding.
pub fn encode_export_name_reply(
    out: &mut Vec<u8>,
    size_bytes: u64,
    transmission_flags: u16,
    no_zeroes: bool,
) {
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_REPLY_ZEROES]);
    }
}
