//! Transmission commands: validation against the session (pure, on the reader task) and
//! execution against the export (blocking, on the blocking pool), producing reply bytes.

use super::handshake::{Session, BASE_ALLOCATION_ID};
use super::PREFERRED_BLOCK_BYTES;
use crate::proto::{self, cmd, cmd_flags, RequestHeader, MAX_BLOCK_STATUS_EXTENTS};
use crate::{BlockStatus, Errno};

/// A request that passed validation: in range, flags allowed, export writable if needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Command {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Cache {
        offset: u64,
        len: u32,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        may_trim: bool,
        fua: bool,
    },
    BlockStatus {
        offset: u64,
        len: u32,
        req_one: bool,
    },
}

impl Command {
    /// The request's `cmd::*` value.
    pub(super) fn code(&self) -> u16 {
        match self {
            Command::Read { .. } => cmd::READ,
            Command::Write { .. } => cmd::WRITE,
            Command::Flush => cmd::FLUSH,
            Command::Trim { .. } => cmd::TRIM,
            Command::Cache { .. } => cmd::CACHE,
            Command::WriteZeroes { .. } => cmd::WRITE_ZEROES,
            Command::BlockStatus { .. } => cmd::BLOCK_STATUS,
        }
    }

    /// Bytes of buffer the command holds while in flight (write payload or read data).
    pub(super) fn buffer_bytes(&self) -> u32 {
        match *self {
            Command::Read { len, .. } | Command::Write { len, .. } => len,
            _ => 0,
        }
    }
}

/// A request refused before it reached the export, with a reason for the human.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Refusal {
    pub errno: Errno,
    pub why: &'static str,
}

fn refuse(errno: Errno, why: &'static str) -> Refusal {
    Refusal { errno, why }
}

/// Checks a request against the spec's rules and the session. DISC never gets here.
pub(super) fn validate(
    req: &RequestHeader,
    s: &Session,
    max_payload_bytes: u32,
) -> Result<Command, Refusal> {
    if req.flags & !allowed_flags(req.command, s) != 0 {
        return Err(refuse(
            Errno::Inval,
            "command flag not valid for this command",
        ));
    }
    let (offset, len) = (req.offset, req.len_bytes);
    let fua = req.flags & cmd_flags::FUA != 0;
    match req.command {
        cmd::READ => validate_read(req, s, max_payload_bytes),
        cmd::WRITE => {
            writable(s)?;
            in_range(req, s, Errno::NoSpc)?;
            Ok(Command::Write { offset, len, fua })
        }
        cmd::FLUSH => Ok(Command::Flush),
        cmd::TRIM => {
            writable(s)?;
            in_range(req, s, Errno::Inval)?;
            Ok(Command::Trim { offset, len, fua })
        }
        cmd::CACHE => {
            in_range(req, s, Errno::Inval)?;
            Ok(Command::Cache { offset, len })
        }
        cmd::WRITE_ZEROES => {
            writable(s)?;
            in_range(req, s, Errno::NoSpc)?;
            fast_enough(req)?;
            let may_trim = req.flags & cmd_flags::NO_HOLE == 0;
            Ok(Command::WriteZeroes {
                offset,
                len,
                may_trim,
                fua,
            })
        }
        cmd::BLOCK_STATUS => validate_block_status(req, s),
        _ => Err(refuse(Errno::Inval, "unknown command")),
    }
}

/// FUA is valid on every command (the spec says so); the rest depend on the command.
fn allowed_flags(command: u16, s: &Session) -> u16 {
    let specific = match command {
        cmd::READ if s.structured => cmd_flags::DF,
        cmd::WRITE_ZEROES => cmd_flags::NO_HOLE | cmd_flags::FAST_ZERO,
        cmd::BLOCK_STATUS => cmd_flags::REQ_ONE,
        _ => 0,
    };
    cmd_flags::FUA | specific
}

fn validate_read(
    req: &RequestHeader,
    s: &Session,
    max_payload_bytes: u32,
) -> Result<Command, Refusal> {
    if req.len_bytes > max_payload_bytes {
        if req.flags & cmd_flags::DF != 0 {
            return Err(refuse(
                Errno::Overflow,
                "read too large to send in one chunk",
            ));
        }
        return Err(refuse(
            Errno::Inval,
            "read longer than the maximum block size",
        ));
    }
    in_range(req, s, Errno::Inval)?;
    Ok(Command::Read {
        offset: req.offset,
        len: req.len_bytes,
    })
}

fn validate_block_status(req: &RequestHeader, s: &Session) -> Result<Command, Refusal> {
    if !s.base_allocation {
        return Err(refuse(Errno::Inval, "no metadata context selected"));
    }
    if req.len_bytes == 0 {
        return Err(refuse(Errno::Inval, "block status of an empty range"));
    }
    in_range(req, s, Errno::Inval)?;
    let req_one = req.flags & cmd_flags::REQ_ONE != 0;
    Ok(Command::BlockStatus {
        offset: req.offset,
        len: req.len_bytes,
        req_one,
    })
}

/// NBD_CMD_FLAG_FAST_ZERO asks for ENOTSUP unless zeroing is quicker than writing the zeros.
/// Zeroing is a metadata record per whole aligned block (the preferred block size we
/// advertise); anything smaller is a read-modify-write, as slow as a WRITE. So a fast zero
/// must cover at least one whole aligned block; the ragged ends of a larger range are
/// accepted, the bulk of it being fast. Refused here, the export is never touched.
fn fast_enough(req: &RequestHeader) -> Result<(), Refusal> {
    if req.flags & cmd_flags::FAST_ZERO == 0 || req.len_bytes == 0 {
        return Ok(());
    }
    let block = u64::from(PREFERRED_BLOCK_BYTES);
    // No overflow: in_range has checked offset + len.
    let end = req.offset + u64::from(req.len_bytes);
    if req.offset.div_ceil(block) < end / block {
        return Ok(());
    }
    Err(refuse(
        Errno::NotSup,
        "fast zero of a range without a whole aligned 4 KiB block would be as slow as a write",
    ))
}

fn writable(s: &Session) -> Result<(), Refusal> {
    if s.read_only {
        return Err(refuse(Errno::Perm, "export is read-only"));
    }
    Ok(())
}

/// `past_end` is the errno for a range that ends beyond the export (the spec wants ENOSPC
/// for writes, EINVAL otherwise). A range whose end overflows u64 is nonsense: EINVAL.
fn in_range(req: &RequestHeader, s: &Session, past_end: Errno) -> Result<(), Refusal> {
    match req.offset.checked_add(u64::from(req.len_bytes)) {
        None => Err(refuse(Errno::Inval, "offset + length overflows")),
        Some(end) if end > s.size_bytes => {
            Err(refuse(past_end, "range beyond the end of the export"))
        }
        Some(_) => Ok(()),
    }
}

/// Reply bytes: `head` then `data` (kept apart so read data is never copied).
#[derive(Debug, Default)]
pub(super) struct Wire {
    pub head: Vec<u8>,
    pub data: Vec<u8>,
}

/// Success without payload: a NONE chunk if structured replies were negotiated.
pub(super) fn ok_reply(s: &Session, cookie: u64) -> Wire {
    let mut head = Vec::with_capacity(proto::CHUNK_HEADER_LEN);
    if s.structured {
        proto::encode_none_chunk(&mut head, cookie);
    } else {
        proto::encode_simple_reply(&mut head, cookie, 0);
    }
    Wire {
        head,
        data: Vec::new(),
    }
}

/// Failure: an ERROR chunk carrying `why` if structured replies were negotiated.
pub(super) fn error_reply(s: &Session, cookie: u64, errno: Errno, why: &str) -> Wire {
    let mut head = Vec::new();
    if s.structured {
        proto::encode_error_chunk(&mut head, cookie, errno.code(), why);
    } else {
        proto::encode_simple_reply(&mut head, cookie, errno.code());
    }
    Wire {
        head,
        data: Vec::new(),
    }
}

/// Runs a validated command against the export. Blocks; call on the blocking pool.
/// Zero-length ranges succeed without reaching the export (the spec leaves them undefined).
pub(super) fn execute(s: &Session, cookie: u64, command: Command, payload: Vec<u8>) -> Wire {
    let export = &*s.export;
    let result = match command {
        Command::Read { offset, len } => return read(s, cookie, offset, len),
        Command::BlockStatus {
            offset,
            len,
            req_one,
        } => return block_status(s, cookie, offset, len, req_one),
        Command::Write { len: 0, .. } => Ok(()),
        Command::Write { offset, fua, .. } => export.write(offset, &payload, fua),
        Command::Flush => export.flush(),
        Command::Trim { len: 0, .. } | Command::Cache { len: 0, .. } => Ok(()),
        Command::WriteZeroes { len: 0, .. } => Ok(()),
        Command::Trim { offset, len, fua } => then_flush(fua, export.trim(offset, len.into()), s),
        Command::Cache { offset, len } => export.cache(offset, len.into()),
        Command::WriteZeroes {
            offset,
            len,
            may_trim,
            fua,
        } => then_flush(fua, export.write_zeroes(offset, len.into(), may_trim), s),
    };
    match result {
        Ok(()) => ok_reply(s, cookie),
        Err(errno) => error_reply(s, cookie, errno, "export failed the request"),
    }
}

/// The Export API carries FUA only for writes; for trim and write-zeroes we honour it
/// with a flush, unless the export says they are durable once done (Strata's are: a flush
/// there would only be counted as one the client never sent).
fn then_flush(fua: bool, result: Result<(), Errno>, s: &Session) -> Result<(), Errno> {
    result?;
    if fua && !s.export.replies_are_durable() {
        s.export.flush()?;
    }
    Ok(())
}

/// Reads into one buffer and sends it as one chunk: that satisfies DF for any read we
/// accept, and the data is complete before the header goes out, so the chunk can be final.
fn read(s: &Session, cookie: u64, offset: u64, len: u32) -> Wire {
    let mut data = vec![0u8; len as usize];
    let result = match len {
        0 => Ok(()),
        _ => s.export.read(offset, &mut data),
    };
    read_reply(s, cookie, offset, result.map(|()| data))
}

/// The reply to a READ of `data.len()` bytes at `offset`, or its error.
pub(super) fn read_reply(s: &Session, cookie: u64, offset: u64, result: Result<Vec<u8>, Errno>) -> Wire {
    let data = match result {
        Ok(data) => data,
        Err(errno) => return error_reply(s, cookie, errno, "export failed the read"),
    };
    let len = data.len() as u32;
    let mut head = Vec::with_capacity(proto::CHUNK_HEADER_LEN + 8);
    if !s.structured {
        proto::encode_simple_reply(&mut head, cookie, 0);
    } else if len == 0 {
        // An OFFSET_DATA chunk must carry at least one byte.
        proto::encode_none_chunk(&mut head, cookie);
    } else if proto::encode_offset_data_prefix(&mut head, cookie, offset, len, true).is_err() {
        // Unreachable: len <= max_payload_bytes < u32::MAX - 8.
        return error_reply(s, cookie, Errno::Overflow, "read too large for one chunk");
    }
    Wire { head, data }
}

fn block_status(s: &Session, cookie: u64, offset: u64, len: u32, req_one: bool) -> Wire {
    let extents = match s.export.block_status(offset, len.into()) {
        Ok(extents) => clip_extents(&extents, len, req_one),
        Err(errno) => return error_reply(s, cookie, errno, "export failed block status"),
    };
    let mut head = Vec::new();
    proto::encode_block_status_chunk(&mut head, cookie, BASE_ALLOCATION_ID, &extents);
    Wire {
        head,
        data: Vec::new(),
    }
}

/// Makes the export's answer valid on the wire: no empty extents, no more than the
/// requested length in total, one extent for REQ_ONE, a bounded count. An export that
/// returns nothing breaks its contract; we then report "status unknown" (0), which the
/// spec allows for any block.
pub(super) fn clip_extents(extents: &[BlockStatus], len: u32, req_one: bool) -> Vec<BlockStatus> {
    let max_count = if req_one { 1 } else { MAX_BLOCK_STATUS_EXTENTS };
    let mut left = len;
    let mut out = Vec::new();
    for e in extents.iter().filter(|e| e.len > 0) {
        if left == 0 || out.len() == max_count {
            break;
        }
        let take = e.len.min(left);
        out.push(BlockStatus {
            len: take,
            flags: e.flags,
        });
        left -= take;
    }
    debug_assert!(
        !out.is_empty() || len == 0,
        "Export::block_status returned no extent"
    );
    if out.is_empty() {
        out.push(BlockStatus { len, flags: 0 });
    }
    out
}
