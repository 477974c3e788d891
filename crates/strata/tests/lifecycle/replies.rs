//! Replies on a client connection of e2e_lifecycle: simple replies, or structured chunks
//! (which may interleave between requests) gathered per request until the one marked done;
//! then each finished request checked against the connection's model: a read's bytes, a
//! BLOCK_STATUS never calling bytes that hold data zero, the errors docs/NBD.md promises.
use std::io::Read;

use super::client::{Conn, Replies, Req, ReqKind};
use super::*;
use crate::common::nbd::{Chunk, ReplyPiece};

fn command_name(command: u16) -> &'static str {
    match command {
        nbd::CMD_READ => "READ",
        nbd::CMD_WRITE => "WRITE",
        nbd::CMD_FLUSH => "FLUSH",
        nbd::CMD_TRIM => "TRIM",
        nbd::CMD_WRITE_ZEROES => "WRITE_ZEROES",
        nbd::CMD_BLOCK_STATUS => "BLOCK_STATUS",
        _ => "?",
    }
}

fn describe_req(req: &Req) -> String {
    let name = command_name(req.command);
    match req.kind.range() {
        Some((offset, len)) => format!("{name} {len} bytes at {offset} (flags {:#x})", req.flags),
        None => format!("{name} (flags {:#x})", req.flags),
    }
}

impl Conn {
    /// Reads one reply or chunk; once a request's reply is whole, checks it against the
    /// model and returns true.
    pub fn take_reply(&mut self, world: &Shared) -> Result<bool, String> {
        let piece = nbd::read_reply_piece(&mut self.client.stream).map_err(|e| {
            format!(
                "{}: no reply ({e}); in flight: {}",
                self.name,
                self.in_flight.len()
            )
        })?;
        let (cookie, done) = match piece {
            ReplyPiece::Simple { cookie, errno } => (cookie, self.take_simple(cookie, errno)?),
            ReplyPiece::Chunk(chunk) => (chunk.cookie, self.take_chunk(&chunk)?),
        };
        if !done {
            return Ok(false);
        }
        let req = self.in_flight.remove(&cookie).expect("a known cookie");
        let acked = tick();
        self.count(&req);
        self.finish(world, req, acked)?;
        Ok(true)
    }

    /// Tallies a whole reply: its command, "unaligned" for a range not of whole blocks,
    /// its flags but FUA, its errno.
    fn count(&mut self, req: &Req) {
        let mut key = command_name(req.command).to_string();
        if let Some((offset, len)) = req.kind.range() {
            if !offset.is_multiple_of(BLOCK_BYTES) || !len.is_multiple_of(BLOCK_BYTES) {
                key += " unaligned";
            }
        }
        let flags = req.flags & !nbd::CMD_FLAG_FUA;
        if flags != 0 {
            key += &format!(" flags {flags:#x}");
        }
        if req.errno != 0 {
            key += &format!(" errno {}", req.errno);
        }
        *self.tally.entry(key).or_default() += 1;
    }

    fn req_mut(&mut self, cookie: u64) -> Result<&mut Req, String> {
        let name = &self.name;
        self.in_flight
            .get_mut(&cookie)
            .ok_or_else(|| format!("{name}: a reply to unknown cookie {cookie}"))
    }

    /// A simple reply: the whole reply (a READ's data follows it).
    fn take_simple(&mut self, cookie: u64, errno: u32) -> Result<bool, String> {
        let replies = self.replies;
        let req = self.req_mut(cookie)?;
        if replies != Replies::Simple {
            return Err(format!(
                "a simple reply to {} on a connection with structured replies (docs/NBD.md: \
                 every reply is a chunk)",
                describe_req(req)
            ));
        }
        req.errno = errno;
        let ReqKind::Read { offset, len } = req.kind else {
            return Ok(true);
        };
        if errno != 0 {
            return Ok(true);
        }
        let mut data = std::mem::take(&mut req.data);
        let read = self.client.stream.read_exact(&mut data);
        let req = self.req_mut(cookie)?;
        req.data = data;
        req.filled.push((offset, len));
        read.map_err(|e| format!("reading the data of {}: {e}", describe_req(req)))?;
        Ok(true)
    }

    /// One chunk of a structured reply; true when it is the last.
    fn take_chunk(&mut self, chunk: &Chunk) -> Result<bool, String> {
        if self.replies == Replies::Simple {
            return Err(format!(
                "{}: a structured chunk (type {:#x}) nobody asked for",
                self.name, chunk.chunk_type
            ));
        }
        let name = self.name.clone();
        let req = self.req_mut(chunk.cookie)?;
        let what = format!("{name}: {}", describe_req(req));
        let done = chunk.flags & nbd::CHUNK_FLAG_DONE != 0;
        match (chunk.chunk_type, &req.kind) {
            (nbd::CHUNK_ERROR | nbd::CHUNK_ERROR_OFFSET, _) => {
                let (errno, _) = chunk.error().expect("an error chunk");
                if errno == 0 {
                    return Err(format!("{what}: an error chunk with errno 0"));
                }
                req.errno = errno;
            }
            (nbd::CHUNK_OFFSET_DATA | nbd::CHUNK_OFFSET_HOLE, &ReqKind::Read { offset, len }) => {
                let (at, data) = chunk.read_data().expect("a data chunk");
                let start = at
                    .checked_sub(offset)
                    .filter(|s| s + data.len() as u64 <= len);
                let Some(start) = start else {
                    return Err(format!("{what}: a chunk of {} bytes at {at}", data.len()));
                };
                req.data[start as usize..start as usize + data.len()].copy_from_slice(&data);
                req.filled.push((at, data.len() as u64));
            }
            (nbd::CHUNK_BLOCK_STATUS, ReqKind::BlockStatus { .. }) if req.status.is_none() => {
                req.status = chunk.block_status();
            }
            (nbd::CHUNK_NONE, _) if done => {}
            (t, _) => return Err(format!("{what}: an unexpected chunk of type {t:#x}")),
        }
        Ok(done)
    }

    /// A whole reply against the model.
    fn finish(&mut self, world: &Shared, req: Req, acked: u64) -> Result<(), String> {
        if let Some((offset, len)) = req.kind.range() {
            self.mark(offset, len, false);
        }
        if req.errno != 0 {
            return self.refused(world, &req);
        }
        self.check_not_cut(world, &req)?;
        let what = format!("{}: {}", self.name, describe_req(&req));
        match req.kind {
            ReqKind::Read { offset, len } => {
                check_filled(offset, len, &req.filled).map_err(|e| format!("{what}: {e}"))?;
                self.check_read(offset, &req.data)
                    .map_err(|e| format!("{what} (volume #{}): {e}", self.uid))
            }
            ReqKind::Write {
                offset,
                len,
                token,
                log,
            } => {
                self.acknowledge(world, offset, len, token, log, acked);
                Ok(())
            }
            ReqKind::FastZeroRefused { .. } => Err(format!(
                "{what}: succeeded, though the range holds no whole block (docs/NBD.md: \
                 ENOTSUP, nothing changed)"
            )),
            ReqKind::BlockStatus {
                offset,
                len,
                req_one,
            } => self
                .check_block_status(offset, len, req_one, req.status.as_ref())
                .map_err(|e| format!("{what} (volume #{}): {e}", self.uid)),
            ReqKind::Flush => Ok(()),
            ReqKind::PastEnd => Err(format!(
                "{}: a READ past the connection's end ({} bytes) succeeded",
                self.name,
                self.blocks() * BLOCK_BYTES
            )),
        }
    }

    /// A request sent after a forced change answered must not have succeeded.
    pub fn check_not_cut(&self, world: &Shared, req: &Req) -> Result<(), String> {
        let w = world.lock().expect("model");
        let v = &w.vols[&self.uid];
        if v.cut_before(self.gen, req.sent) {
            return Err(format!(
                "{}: {} sent after a forced delete or rollback was answered succeeded",
                self.name,
                describe_req(req)
            ));
        }
        Ok(())
    }

    /// Bytes read at `offset` against what the model says they hold.
    pub fn check_read(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        let end = offset + data.len() as u64;
        for lba in blocks_touched(offset, data.len() as u64) {
            let at = lba * BLOCK_BYTES;
            let (start, stop) = (offset.max(at), end.min(at + BLOCK_BYTES));
            let want = content::expected(self.local[lba as usize], lba);
            let got = &data[(start - offset) as usize..(stop - offset) as usize];
            let want = &want[(start - at) as usize..(stop - at) as usize];
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
                let zeros = if got.iter().all(|&b| b == 0) {
                    ", read as zeros"
                } else {
                    ""
                };
                return Err(format!(
                    "block {lba} bytes {}..{} should hold {}; first difference at byte {}{zeros}",
                    start - at,
                    stop - at,
                    describe_token(self.local[lba as usize]),
                    start - at + i as u64
                ));
            }
        }
        Ok(())
    }

    /// BLOCK_STATUS against the model: the selected context, at least one extent (one with
    /// REQ_ONE), none past the request; bytes holding data never ZERO; a block stored as a
    /// hole (never written, zeroed or trimmed whole) HOLE|ZERO (docs/NBD.md).
    fn check_block_status(
        &self,
        offset: u64,
        len: u64,
        req_one: bool,
        status: Option<&(u32, Vec<(u32, u32)>)>,
    ) -> Result<(), String> {
        let Some((id, extents)) = status else {
            return Err("no BLOCK_STATUS chunk".into());
        };
        if self.replies != Replies::BlockStatus(*id) {
            return Err(format!("context id {id}, selected {:?}", self.replies));
        }
        let total: u64 = extents.iter().map(|&(l, _)| u64::from(l)).sum();
        let bad_count = extents.is_empty() || (req_one && extents.len() != 1);
        if bad_count || total > len || extents.iter().any(|&(l, _)| l == 0) {
            return Err(format!("extents {extents:?} for {len} bytes"));
        }
        let mut cursor = offset;
        for &(l, flags) in extents {
            self.check_extent(cursor, u64::from(l), flags)?;
            cursor += u64::from(l);
        }
        Ok(())
    }

    fn check_extent(&self, offset: u64, len: u64, flags: u32) -> Result<(), String> {
        let hole = nbd::STATE_HOLE | nbd::STATE_ZERO;
        if flags & !hole != 0 {
            return Err(format!("unknown flags {flags:#x}"));
        }
        for lba in blocks_touched(offset, len) {
            let at = lba * BLOCK_BYTES;
            let start = offset.max(at) - at;
            let end = (offset + len).min(at + BLOCK_BYTES) - at;
            let id = self.local[lba as usize];
            let data_called_zero = flags & nbd::STATE_ZERO != 0
                && !content::zeros_in(id, start as usize, end as usize);
            let hole_called_data = id == 0 && flags != hole;
            if data_called_zero || hole_called_data {
                return Err(format!(
                    "bytes {start}..{end} of block {lba} reported with flags {flags:#x}; \
                     the block holds {}",
                    describe_token(id)
                ));
            }
        }
        Ok(())
    }

    pub fn acknowledge(
        &mut self,
        world: &Shared,
        offset: u64,
        len: u64,
        token: u64,
        log: Option<usize>,
        acked: u64,
    ) {
        apply(&mut self.local, offset, len, token);
        let mut w = world.lock().expect("model");
        let v = vol_mut(&mut w, self.uid);
        if let (Some(i), true) = (log, v.gen == self.gen) {
            v.writes[i].acked = Some(acked);
        }
    }

    /// An error reply: EINVAL for a read past the end; ENOTSUP for a FAST_ZERO over no
    /// whole block; ESHUTDOWN once the volume was deleted or rolled back under this
    /// connection; nothing else.
    pub fn refused(&mut self, world: &Shared, req: &Req) -> Result<(), String> {
        let expected = match req.kind {
            ReqKind::PastEnd => nbd::EINVAL,
            ReqKind::FastZeroRefused { .. } => nbd::ENOTSUP,
            _ => 0,
        };
        if req.errno == expected {
            return Ok(());
        }
        let mut w = world.lock().expect("model");
        let v = vol_mut(&mut w, self.uid);
        if req.errno != nbd::ESHUTDOWN || !v.may_cut(self.gen) {
            return Err(format!(
                "{} (volume #{}, generation {}): errno {} for {} sent at tick {}",
                self.name,
                self.uid,
                self.gen,
                req.errno,
                describe_req(req),
                req.sent
            ));
        }
        if let (ReqKind::Write { log: Some(i), .. }, true) = (&req.kind, v.gen == self.gen) {
            v.writes[*i].failed = true;
        }
        self.cut = true;
        Ok(())
    }
}

/// A read's reply pieces cover it exactly once.
fn check_filled(offset: u64, len: u64, filled: &[(u64, u64)]) -> Result<(), String> {
    let mut pieces = filled.to_vec();
    pieces.sort_unstable();
    let mut cursor = offset;
    for &(at, n) in &pieces {
        if at != cursor || n == 0 {
            return Err(format!("reply pieces {pieces:?} leave a gap or overlap"));
        }
        cursor += n;
    }
    if cursor != offset + len {
        return Err(format!("reply pieces {pieces:?} stop at {cursor}"));
    }
    Ok(())
}
