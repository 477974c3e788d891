//! Wire format of the NBD protocol: pure encode/decode, no I/O.
//!
//! Everything a client sends is parsed here from a byte slice the caller already holds, and
//! every length the client claims is checked against a bound before anything is allocated,
//! so the server can read "header, then at most N bytes" and the fuzz target can feed these
//! functions arbitrary bytes. Server-to-client messages are only encoded; client-to-server
//! messages also have encoders so tests (and a future client) can build them.
//!
//! Names follow the specification (doc/proto.md of the NetworkBlockDevice project) with the
//! `NBD_` prefix dropped and grouped by module: `opt::GO` is `NBD_OPT_GO`.

mod fuzz;
mod handshake;
mod transmission;

#[cfg(test)]
mod tests;

pub use fuzz::fuzz_parsers;
pub use handshake::*;
pub use transmission::*;

/// Longest string (export name, metadata context query, error message) the spec allows.
pub const MAX_STRING_BYTES: usize = 4096;

/// Largest option payload we accept during option haggling. The biggest legitimate payload
/// is a SET_META_CONTEXT with a few queries, well under a KiB; 64 KiB leaves room for odd
/// clients while keeping a hostile one from making us buffer much.
pub const MAX_OPTION_BYTES: u32 = 64 * 1024;

/// Largest option payload the server reads (and drops) to answer NBD_REP_ERR_TOO_BIG and
/// go on haggling, as the spec prefers. Beyond it the client is taken for a denial of
/// service, which the spec lets the server end with a hard disconnect.
pub const MAX_OPTION_DISCARD_BYTES: u32 = 1 << 20;

/// `NBD_FLAG_*` handshake flags (sent by the server, 16 bits).
pub mod handshake_flags {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// `NBD_FLAG_C_*` client flags (sent by the client, 32 bits).
pub mod client_flags {
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const NO_ZEROES: u32 = 1 << 1;
}

/// `NBD_FLAG_*` transmission flags (16 bits, sent with the export size).
pub mod transmission_flags {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// `NBD_OPT_*` option codes.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
}

/// `NBD_REP_*` option reply types. Errors have bit 31 set.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    pub const ERR_POLICY: u32 = (1 << 31) + 2;
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    pub const ERR_PLATFORM: u32 = (1 << 31) + 4;
    pub const ERR_TLS_REQD: u32 = (1 << 31) + 5;
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    pub const ERR_SHUTDOWN: u32 = (1 << 31) + 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
    pub const ERR_TOO_BIG: u32 = (1 << 31) + 9;
}

/// `NBD_INFO_*` information types inside NBD_REP_INFO.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// `NBD_CMD_*` request types.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// `NBD_CMD_FLAG_*` command flags.
pub mod cmd_flags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// `NBD_REPLY_TYPE_*` structured reply chunk types. Error chunks have bit 15 set.
pub mod chunk {
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const ERROR: u16 = (1 << 15) + 1;
    pub const ERROR_OFFSET: u16 = (1 << 15) + 2;
    /// `NBD_REPLY_FLAG_DONE`: last chunk of a reply.
    pub const FLAG_DONE: u16 = 1 << 0;
}

/// `NBD_STATE_*` flags of the `base:allocation` metadata context.
pub mod state {
    pub const HOLE: u32 = 1 << 0;
    pub const ZERO: u32 = 1 << 1;
}

/// Magic numbers.
pub mod magic {
    /// "NBDMAGIC", first word of the server greeting.
    pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
    /// "IHAVEOPT", in the greeting and at the start of every option.
    pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
    /// Start of every option reply.
    pub const OPTION_REPLY: u64 = 0x0003_e889_0455_65a9;
    pub const REQUEST: u32 = 0x2560_9513;
    pub const SIMPLE_REPLY: u32 = 0x6744_6698;
    pub const STRUCTURED_REPLY: u32 = 0x668e_33ef;
}

/// The only metadata context Strata serves.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// Why bytes from a client were rejected. None of these is a server bug: each means the
/// client broke the protocol (or lied about a length) and the caller decides whether that
/// costs an error reply or the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("message truncated: needed {needed} more bytes, {available} available")]
    Truncated { needed: usize, available: usize },
    #[error("bad magic: expected {expected:#x}, found {found:#x}")]
    BadMagic { expected: u64, found: u64 },
    #[error("payload of option {option} ({len} bytes) exceeds the limit of {max}")]
    OptionTooLong { option: u32, len: u32, max: u32 },
    #[error("request payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge { len: u32, max: u32 },
    #[error("string of {len} bytes exceeds the limit of {max}")]
    StringTooLong { len: u64, max: usize },
    #[error("string is not valid UTF-8 or contains NUL")]
    InvalidString,
    #[error("{extra} unexpected bytes after the message")]
    TrailingBytes { extra: usize },
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
}

/// Bounds-checked big-endian cursor over bytes the caller already holds. Every read
/// either returns the bytes or `Truncated`; it never reads past the slice or allocates
/// more than the slice holds.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if n > self.buf.len() {
            return Err(ProtoError::Truncated {
                needed: n,
                available: self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtoError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(crate) fn u16(&mut self) -> Result<u16, ProtoError> {
        self.array().map(u16::from_be_bytes)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, ProtoError> {
        self.array().map(u32::from_be_bytes)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, ProtoError> {
        self.array().map(u64::from_be_bytes)
    }

    /// A protocol string of `len` bytes; the bound is checked before anything is copied.
    pub(crate) fn string(&mut self, len: u64) -> Result<String, ProtoError> {
        let len = checked_string_len(len)?;
        decode_string(self.take(len)?)
    }

    /// Rejects bytes left over: a message whose declared length disagrees with its
    /// content is malformed, and guessing what the client meant is how parsers get confused.
    pub(crate) fn finish(self) -> Result<(), ProtoError> {
        match self.buf.len() {
            0 => Ok(()),
            extra => Err(ProtoError::TrailingBytes { extra }),
        }
    }
}

fn checked_string_len(len: u64) -> Result<usize, ProtoError> {
    match usize::try_from(len) {
        Ok(n) if n <= MAX_STRING_BYTES => Ok(n),
        _ => Err(ProtoError::StringTooLong {
            len,
            max: MAX_STRING_BYTES,
        }),
    }
}

/// UTF-8 without NUL, as the spec defines a string.
pub(crate) fn decode_string(bytes: &[u8]) -> Result<String, ProtoError> {
    if bytes.contains(&0) {
        return Err(ProtoError::InvalidString);
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| ProtoError::InvalidString)
}

/// Appends a string we send, cut to the spec's 4096-byte limit. Our strings come from the
/// daemon's configuration; a longer one is a configuration mistake, not a reason to break
/// the wire format.
pub(crate) fn sent_str(s: &str) -> &[u8] {
    truncate_str(s, MAX_STRING_BYTES).as_bytes()
}

/// Longest prefix of `s` that is at most `max` bytes and ends on a char boundary.
pub(crate) fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
