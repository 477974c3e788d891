//! A seeded random model of the NBD transmission phase against a live `strata serve`.
//!
//! Several connections to `vol0` (structured replies with `base:allocation`, structured
//! without it, simple replies only) each keep a batch of random requests in flight: every
//! command, valid and invalid flags, aligned and ragged ranges from 0 bytes to past 1 MiB,
//! some crossing or past the end of the volume or overflowing 64 bits. Every reply is
//! matched by cookie and checked against a model of the volume: errno, read data, that a
//! structured read covers exactly its range, that BLOCK_STATUS never reports zeros where the
//! volume holds data. Within a round no two in-flight requests overlap where one writes (the
//! spec does not order them), so the model is the same whatever order the server runs them
//! in. After each round every write is read back through another connection
//! (NBD_FLAG_CAN_MULTI_CONN). Clean restarts and a SIGKILL after a replied FLUSH check the
//! whole model through a fresh connection.
//!
//! Replay a run with STRATA_TEST_SEED=<seed printed by the test>.
use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::thread;

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use common::nbd::{self, Chunk, ReplyPiece};
use common::*;

const PAGE_BYTES: u64 = 4096;
/// Most requests land in the first HEAD_BYTES of the volume...
const HEAD_BYTES: u64 = 48 << 20;
/// ...the others in its last TAIL_BYTES, where ranges cross and pass the end.
const TAIL_BYTES: u64 = 4 << 20;
/// Longest READ or WRITE: a little over 1 MiB, so some are not block multiples.
const MAX_IO_BYTES: u64 = (1 << 20) + 4097;
/// Longest TRIM or WRITE_ZEROES (no payload; held only to the export's size).
const MAX_ZERO_BYTES: u64 = 4 << 20;
/// Longest BLOCK_STATUS (no payload either).
const MAX_STATUS_BYTES: u64 = 64 << 20;
/// Most requests one connection keeps in flight at once: past the server's limit (64), where
/// it stops reading until it has answered some.
const BATCH_MAX: usize = 96;
/// Rounds (one batch per connection, all at once) between two restarts.
const ROUNDS_PER_PHASE: usize = 50;
/// The largest request the server takes (`max_payload_bytes`, NBD_INFO_BLOCK_SIZE's maximum).
const MAX_PAYLOAD_BYTES: u64 = 32 << 20;
/// Reads that check the whole model are at most this long.
const VERIFY_READ_BYTES: u64 = 1 << 20;
/// Attempts to draw a request that overlaps nothing the round already writes.
const DRAW_ATTEMPTS: usize = 8;

/// The volume as the replies say it must be: the 4 KiB pages touched so far (absent: zeros).
#[derive(Default)]
struct Model {
    pages: BTreeMap<u64, Box<[u8]>>,
}

impl Model {
    fn read(&self, offset: u64, len: u64) -> Vec<u8> {
        let mut out = vec![0u8; len as usize];
        for (page, start, end) in pieces(offset, len) {
            if let Some(data) = self.pages.get(&page) {
                let at = (page * PAGE_BYTES + start - offset) as usize;
                out[at..at + (end - start) as usize]
                    .copy_from_slice(&data[start as usize..end as usize]);
            }
        }
        out
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        for (page, start, end) in pieces(offset, data.len() as u64) {
            let at = (page * PAGE_BYTES + start - offset) as usize;
            let slot = self.page_mut(page);
            slot[start as usize..end as usize]
                .copy_from_slice(&data[at..at + (end - start) as usize]);
        }
    }

    fn zero(&mut self, offset: u64, len: u64) {
        for (page, start, end) in pieces(offset, len) {
            self.page_mut(page)[start as usize..end as usize].fill(0);
        }
    }

    fn is_zero(&self, offset: u64, len: u64) -> bool {
        pieces(offset, len).all(|(page, start, end)| match self.pages.get(&page) {
            Some(data) => data[start as usize..end as usize].iter().all(|&b| b == 0),
            None => true,
        })
    }

    fn page_mut(&mut self, page: u64) -> &mut [u8] {
        self.pages
            .entry(page)
            .or_insert_with(|| vec![0u8; PAGE_BYTES as usize].into_boxed_slice())
    }

    /// The touched pages as runs of at most VERIFY_READ_BYTES: (offset, length).
    fn touched_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &page in self.pages.keys() {
            let offset = page * PAGE_BYTES;
            match runs.last_mut() {
                Some((start, len)) if *start + *len == offset && *len < VERIFY_READ_BYTES => {
                    *len += PAGE_BYTES
                }
                _ => runs.push((offset, PAGE_BYTES)),
            }
        }
        runs
    }
}

/// The pages a byte range covers: (page index, start, end within the page).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64, u64)> {
    let end = offset + len;
    let first = offset / PAGE_BYTES;
    let last = end.div_ceil(PAGE_BYTES);
    (first..last).map(move |page| {
        let base = page * PAGE_BYTES;
        (
            page,
            offset.max(base) - base,
            end.min(base + PAGE_BYTES) - base,
        )
    })
}

/// What a connection negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Structured replies and `base:allocation` (its context id).
    Status(u32),
    /// Structured replies, no metadata context.
    Structured,
    /// Simple replies only.
    Simple,
}

impl Kind {
    fn structured(self) -> bool {
        self != Kind::Simple
    }
}

struct Conn {
    stream: TcpStream,
    kind: Kind,
}

/// The connections of one run, in this order of kinds.
const KINDS: [Kind; 5] = [
    Kind::Status(0),
    Kind::Simple,
    Kind::Structured,
    Kind::Status(0),
    Kind::Simple,
];

fn open(daemon: &Daemon, kind: Kind) -> Conn {
    let (client, kind) = match kind {
        Kind::Status(_) => {
            let (client, id) = nbd::go_structured_block_status(daemon.nbd_addr, VOL0)
                .expect("handshake with base:allocation");
            (client, Kind::Status(id))
        }
        Kind::Structured => (
            nbd::go_structured(daemon.nbd_addr, VOL0).expect("structured handshake"),
            kind,
        ),
        Kind::Simple => (nbd::go(daemon.nbd_addr, VOL0).expect("handshake"), kind),
    };
    assert_eq!(client.size_bytes, VOL0_SIZE_BYTES, "export size");
    let flags = client.transmission_flags;
    let promised = nbd::TFLAG_SEND_FLUSH
        | nbd::TFLAG_SEND_FUA
        | nbd::TFLAG_SEND_TRIM
        | nbd::TFLAG_SEND_WRITE_ZEROES
        | nbd::TFLAG_SEND_CACHE
        | nbd::TFLAG_SEND_FAST_ZERO
        | nbd::TFLAG_CAN_MULTI_CONN;
    assert_eq!(flags & promised, promised, "transmission flags {flags:#x}");
    assert_eq!(
        flags & nbd::TFLAG_SEND_DF != 0,
        kind.structured(),
        "NBD_FLAG_SEND_DF exactly with structured replies (flags {flags:#x})"
    );
    Conn {
        stream: client.stream,
        kind,
    }
}

fn open_all(daemon: &Daemon) -> Vec<Conn> {
    KINDS.iter().map(|&kind| open(daemon, kind)).collect()
}

fn disconnect_all(conns: Vec<Conn>) {
    for mut conn in conns {
        let disc = nbd::request_bytes(0, nbd::CMD_DISC, 0, 0, 0);
        conn.stream.write_all(&disc).expect("send NBD_CMD_DISC");
    }
}

/// One request, with the errno the spec and docs/NBD.md make it earn.
#[derive(Clone)]
struct Req {
    cookie: u64,
    command: u16,
    flags: u16,
    offset: u64,
    len: u32,
    payload: Vec<u8>,
    expect_errno: u32,
}

impl std::fmt::Debug for Req {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = [
            "READ",
            "WRITE",
            "DISC",
            "FLUSH",
            "TRIM",
            "CACHE",
            "WRITE_ZEROES",
            "BLOCK_STATUS",
        ]
        .get(usize::from(self.command))
        .unwrap_or(&"?");
        write!(
            f,
            "{name} cookie={:#x} flags={:#x} offset={} len={} (expect errno {})",
            self.cookie, self.flags, self.offset, self.len, self.expect_errno
        )
    }
}

impl Req {
    fn writes(&self) -> bool {
        matches!(
            self.command,
            nbd::CMD_WRITE | nbd::CMD_WRITE_ZEROES | nbd::CMD_TRIM
        )
    }

    /// The bytes of the volume the request may touch: its range clipped to the export.
    fn footprint(&self, size_bytes: u64) -> (u64, u64) {
        if self.command == nbd::CMD_FLUSH {
            return (0, 0);
        }
        let end = self.offset.saturating_add(self.len.into()).min(size_bytes);
        (self.offset.min(size_bytes), end)
    }

    fn wire(&self) -> Vec<u8> {
        nbd::request_with_payload(
            self.flags,
            self.command,
            self.cookie,
            self.offset,
            self.len,
            &self.payload,
        )
    }
}

/// The errno a request must get: the server's checks, in docs/NBD.md's order (flags, then
/// range, then the command's own rules).
fn expected_errno(command: u16, flags: u16, offset: u64, len: u32, kind: Kind) -> u32 {
    let specific = match command {
        nbd::CMD_READ if kind.structured() => nbd::CMD_FLAG_DF,
        nbd::CMD_WRITE_ZEROES => nbd::CMD_FLAG_NO_HOLE | nbd::CMD_FLAG_FAST_ZERO,
        nbd::CMD_BLOCK_STATUS => nbd::CMD_FLAG_REQ_ONE,
        _ => 0,
    };
    if flags & !(nbd::CMD_FLAG_FUA | specific) != 0 {
        return nbd::EINVAL;
    }
    let end = offset.checked_add(len.into());
    let range = |past_end: u32| match end {
        None => nbd::EINVAL,
        Some(end) if end > VOL0_SIZE_BYTES => past_end,
        Some(_) => 0,
    };
    match command {
        nbd::CMD_READ if u64::from(len) > MAX_PAYLOAD_BYTES => match flags & nbd::CMD_FLAG_DF {
            0 => nbd::EINVAL,
            _ => nbd::EOVERFLOW,
        },
        nbd::CMD_READ | nbd::CMD_TRIM | nbd::CMD_CACHE => range(nbd::EINVAL),
        nbd::CMD_WRITE => range(nbd::ENOSPC),
        nbd::CMD_FLUSH => 0,
        nbd::CMD_WRITE_ZEROES => match range(nbd::ENOSPC) {
            0 if flags & nbd::CMD_FLAG_FAST_ZERO != 0 && !holds_whole_page(offset, len) => {
                nbd::ENOTSUP
            }
            errno => errno,
        },
        nbd::CMD_BLOCK_STATUS if !matches!(kind, Kind::Status(_)) || len == 0 => nbd::EINVAL,
        nbd::CMD_BLOCK_STATUS => range(nbd::EINVAL),
        _ => nbd::EINVAL,
    }
}

/// An empty range is not refused by FAST_ZERO; otherwise it needs a whole aligned block.
fn holds_whole_page(offset: u64, len: u32) -> bool {
    len == 0 || offset.div_ceil(PAGE_BYTES) < (offset + u64::from(len)) / PAGE_BYTES
}

/// Draws requests for one run from one seed.
struct Gen {
    rng: SmallRng,
    next_cookie: u64,
    /// Requests of the random rounds answered, by (command, errno): printed at the end.
    answered: BTreeMap<(u16, u32), usize>,
}

impl Gen {
    fn command(&mut self) -> u16 {
        match self.rng.gen_range(0..100) {
            0..=29 => nbd::CMD_READ,
            30..=59 => nbd::CMD_WRITE,
            60..=69 => nbd::CMD_WRITE_ZEROES,
            70..=75 => nbd::CMD_TRIM,
            76..=79 => nbd::CMD_FLUSH,
            80..=84 => nbd::CMD_CACHE,
            _ => nbd::CMD_BLOCK_STATUS,
        }
    }

    fn len(&mut self, command: u16) -> u64 {
        if command == nbd::CMD_READ && self.rng.gen_bool(0.02) {
            // Longer than the server's largest request: refused before the range is looked at.
            return MAX_PAYLOAD_BYTES + self.rng.gen_range(1..=PAGE_BYTES);
        }
        if command == nbd::CMD_BLOCK_STATUS && self.rng.gen_bool(0.03) {
            // Far past the head, into never-written space and past the server's own bound on
            // one query (the reply then stops short, which the spec allows).
            return self.rng.gen_range(MAX_STATUS_BYTES..=u64::from(u32::MAX));
        }
        let max = match command {
            nbd::CMD_TRIM | nbd::CMD_WRITE_ZEROES => MAX_ZERO_BYTES,
            nbd::CMD_BLOCK_STATUS => MAX_STATUS_BYTES,
            _ => MAX_IO_BYTES,
        };
        let len = match self.rng.gen_range(0..100) {
            0..=4 => 0,
            5..=49 => self.rng.gen_range(1..=8192),
            50..=84 => self.rng.gen_range(1..=128 << 10),
            _ => self.rng.gen_range(1..=max),
        };
        self.align(len).max(len.min(1))
    }

    /// Half of the values rounded down to 4 KiB, some to 512 bytes, the rest left ragged.
    fn align(&mut self, value: u64) -> u64 {
        match self.rng.gen_range(0..100) {
            0..=49 => value / PAGE_BYTES * PAGE_BYTES,
            50..=64 => value / 512 * 512,
            _ => value,
        }
    }

    fn offset(&mut self, len: u64) -> u64 {
        match self.rng.gen_range(0..100) {
            0..=79 => {
                let offset = self.rng.gen_range(0..=HEAD_BYTES - len.min(HEAD_BYTES));
                self.align(offset)
            }
            80..=95 => {
                let offset = VOL0_SIZE_BYTES - self.rng.gen_range(1..=TAIL_BYTES);
                self.align(offset)
            }
            96..=98 => VOL0_SIZE_BYTES + [0, 1, PAGE_BYTES][self.rng.gen_range(0..3)],
            _ => u64::MAX - self.rng.gen_range(0..=len),
        }
    }

    fn flags(&mut self, command: u16, kind: Kind) -> u16 {
        let mut flags = 0;
        if self.rng.gen_bool(0.3) {
            flags |= nbd::CMD_FLAG_FUA;
        }
        match command {
            nbd::CMD_READ if kind.structured() && self.rng.gen_bool(0.3) => {
                flags |= nbd::CMD_FLAG_DF
            }
            nbd::CMD_WRITE_ZEROES => {
                if self.rng.gen_bool(0.5) {
                    flags |= nbd::CMD_FLAG_NO_HOLE;
                }
                if self.rng.gen_bool(0.3) {
                    flags |= nbd::CMD_FLAG_FAST_ZERO;
                }
            }
            nbd::CMD_BLOCK_STATUS if self.rng.gen_bool(0.3) => flags |= nbd::CMD_FLAG_REQ_ONE,
            _ => {}
        }
        if self.rng.gen_bool(0.03) {
            // Often one the command does not take: EINVAL, and nothing changes.
            let wrong = [
                nbd::CMD_FLAG_NO_HOLE,
                nbd::CMD_FLAG_DF,
                nbd::CMD_FLAG_REQ_ONE,
                nbd::CMD_FLAG_FAST_ZERO,
                1 << 5,
                1 << 15,
            ];
            flags |= wrong[self.rng.gen_range(0..wrong.len())];
        }
        flags
    }

    fn payload(&mut self, len: u64) -> Vec<u8> {
        let mut data = vec![0u8; len as usize];
        if self.rng.gen_bool(0.95) {
            self.rng.fill_bytes(&mut data);
        }
        data
    }

    fn cookie(&mut self) -> u64 {
        // Unique by the counter; the random high bits check the server echoes all 64.
        self.next_cookie += 1;
        u64::from(self.rng.gen::<u32>()) << 32 | self.next_cookie
    }

    fn request(&mut self, command: u16, kind: Kind) -> Req {
        let len = self.len(command);
        let offset = self.offset(len);
        let flags = self.flags(command, kind);
        let len = len as u32;
        let payload = match command {
            nbd::CMD_WRITE => self.payload(len.into()),
            _ => Vec::new(),
        };
        Req {
            cookie: self.cookie(),
            command,
            flags,
            offset,
            len,
            payload,
            expect_errno: expected_errno(command, flags, offset, len, kind),
        }
    }
}

/// The footprints of the requests of one round so far: (start, end, writes).
#[derive(Default)]
struct Busy(Vec<(u64, u64, bool)>);

impl Busy {
    /// Claims `req`'s footprint unless it overlaps one where either of the two writes.
    fn claim(&mut self, req: &Req) -> bool {
        let (start, end) = req.footprint(VOL0_SIZE_BYTES);
        let writes = req.writes();
        let clash = self
            .0
            .iter()
            .any(|&(s, e, w)| (w || writes) && start < e && s < end);
        if !clash {
            self.0.push((start, end, writes));
        }
        !clash
    }
}

/// One batch per connection, no two requests of the round in conflict.
fn draw_round(gen: &mut Gen, kinds: &[Kind], only_writes: bool) -> Vec<Vec<Req>> {
    let mut busy = Busy::default();
    let mut round = Vec::new();
    for &kind in kinds {
        let count = gen.rng.gen_range(1..=BATCH_MAX);
        let mut batch = Vec::new();
        for _ in 0..count {
            for _ in 0..DRAW_ATTEMPTS {
                let command = match only_writes {
                    true => [nbd::CMD_WRITE, nbd::CMD_WRITE_ZEROES, nbd::CMD_TRIM]
                        [gen.rng.gen_range(0..3)],
                    false => gen.command(),
                };
                let req = gen.request(command, kind);
                if busy.claim(&req) {
                    batch.push(req);
                    break;
                }
            }
        }
        round.push(batch);
    }
    round
}

/// The server's whole answer to one request.
#[derive(Debug, Default)]
struct Answer {
    errno: u32,
    /// A successful READ's data.
    data: Option<Vec<u8>>,
    /// A successful BLOCK_STATUS: the context id and (length, flags) descriptors.
    extents: Option<(u32, Vec<(u32, u32)>)>,
}

/// Reads replies until every request of `reqs` is answered, checking each is answered once.
/// With `until_eof`, a connection that ends first is no error: the answers so far come back.
/// Every complete answer's cookie goes to `answered`.
fn collect(
    stream: &mut TcpStream,
    kind: Kind,
    reqs: &[Req],
    until_eof: bool,
    answered: Option<mpsc::Sender<u64>>,
) -> HashMap<u64, Answer> {
    let mut pending: HashMap<u64, &Req> = reqs.iter().map(|r| (r.cookie, r)).collect();
    let mut partial: HashMap<u64, Vec<Chunk>> = HashMap::new();
    let mut answers = HashMap::new();
    while !pending.is_empty() {
        let piece = match nbd::read_reply_piece(stream) {
            Ok(piece) => piece,
            Err(_) if until_eof => break,
            Err(e) => panic!("reading replies, {} unanswered: {e}", pending.len()),
        };
        let answer = match take(stream, kind, piece, &mut pending, &mut partial) {
            Ok(Some(answer)) => answer,
            Ok(None) => continue,
            Err(_) if until_eof => break,
            Err(e) => panic!("reading a READ's data: {e}"),
        };
        if let Some(tx) = &answered {
            let _ = tx.send(answer.0);
        }
        answers.insert(answer.0, answer.1);
    }
    answers
}

/// Takes one reply piece; a request's answer once it is complete.
fn take(
    stream: &mut TcpStream,
    kind: Kind,
    piece: ReplyPiece,
    pending: &mut HashMap<u64, &Req>,
    partial: &mut HashMap<u64, Vec<Chunk>>,
) -> io::Result<Option<(u64, Answer)>> {
    let cookie = match &piece {
        ReplyPiece::Simple { cookie, .. } => *cookie,
        ReplyPiece::Chunk(chunk) => chunk.cookie,
    };
    let req = *pending.get(&cookie).unwrap_or_else(|| {
        panic!(
            "a reply to cookie {cookie:#x}, which is not in flight (unknown, or answered already)"
        )
    });
    let chunk = match piece {
        ReplyPiece::Simple { errno, .. } => {
            assert!(
                !kind.structured(),
                "a simple reply to {req:?} after structured replies were negotiated"
            );
            let mut data = None;
            if req.command == nbd::CMD_READ && errno == 0 {
                let mut buf = vec![0u8; req.len as usize];
                stream.read_exact(&mut buf)?;
                data = Some(buf);
            }
            pending.remove(&cookie);
            return Ok(Some((
                cookie,
                Answer {
                    errno,
                    data,
                    extents: None,
                },
            )));
        }
        ReplyPiece::Chunk(chunk) => chunk,
    };
    assert!(
        kind.structured(),
        "a structured chunk for {req:?} without structured replies"
    );
    let done = chunk.flags & nbd::CHUNK_FLAG_DONE != 0;
    partial.entry(cookie).or_default().push(chunk);
    if !done {
        return Ok(None);
    }
    pending.remove(&cookie);
    let chunks = partial
        .remove(&cookie)
        .expect("chunks of an answered request");
    Ok(Some((cookie, structured_answer(req, &chunks))))
}

/// Puts a structured reply together, checking its chunks are the kinds the request allows
/// and that a READ's data chunks cover exactly the requested range, once.
fn structured_answer(req: &Req, chunks: &[Chunk]) -> Answer {
    if let Some((errno, _message)) = chunks.iter().find_map(Chunk::error) {
        assert_ne!(errno, 0, "an error chunk with errno 0 for {req:?}");
        return Answer {
            errno,
            ..Answer::default()
        };
    }
    for chunk in chunks.iter().filter(|c| c.chunk_type == nbd::CHUNK_NONE) {
        assert!(
            chunk.payload.is_empty(),
            "a NONE chunk with a payload for {req:?}"
        );
        assert!(
            chunk.flags & nbd::CHUNK_FLAG_DONE != 0,
            "a NONE chunk without DONE for {req:?}"
        );
    }
    match req.command {
        nbd::CMD_READ => Answer {
            data: Some(read_data(req, chunks)),
            ..Answer::default()
        },
        nbd::CMD_BLOCK_STATUS => {
            let found: Vec<_> = chunks.iter().filter_map(Chunk::block_status).collect();
            assert_eq!(
                found.len(),
                1,
                "one BLOCK_STATUS chunk for the one context, {req:?}"
            );
            Answer {
                extents: found.into_iter().next(),
                ..Answer::default()
            }
        }
        _ => {
            let types: Vec<u16> = chunks.iter().map(|c| c.chunk_type).collect();
            assert_eq!(types, [nbd::CHUNK_NONE], "the reply to {req:?}");
            Answer::default()
        }
    }
}

fn read_data(req: &Req, chunks: &[Chunk]) -> Vec<u8> {
    let mut data = vec![0u8; req.len as usize];
    let mut covered: Vec<(u64, u64)> = Vec::new();
    for chunk in chunks {
        let Some((at, bytes)) = chunk.read_data() else {
            assert_eq!(
                chunk.chunk_type,
                nbd::CHUNK_NONE,
                "a chunk in the reply to {req:?}"
            );
            continue;
        };
        let end = at + bytes.len() as u64;
        assert!(
            at >= req.offset && end <= req.offset + u64::from(req.len),
            "a data chunk at {at}..{end} outside {req:?}"
        );
        let start = (at - req.offset) as usize;
        data[start..start + bytes.len()].copy_from_slice(&bytes);
        covered.push((at, end));
    }
    covered.sort_unstable();
    let mut at = req.offset;
    for (start, end) in covered {
        assert_eq!(
            start, at,
            "read chunks leave a gap or overlap at {at} in {req:?}"
        );
        at = end;
    }
    assert_eq!(
        at,
        req.offset + u64::from(req.len),
        "read chunks stop short in {req:?}"
    );
    data
}

/// Sends `reqs` on `conn` from a second thread while this one reads the replies, so neither
/// side waits for the other (the server stops reading at its in-flight limit).
fn run_batch(conn: &mut Conn, reqs: &[Req]) -> HashMap<u64, Answer> {
    let mut writer = conn.stream.try_clone().expect("clone stream");
    let kind = conn.kind;
    thread::scope(|s| {
        s.spawn(move || {
            for req in reqs {
                writer.write_all(&req.wire()).expect("send request");
            }
        });
        collect(&mut conn.stream, kind, reqs, false, None)
    })
}

/// Sends `reqs` one at a time, each after the previous one's reply: a client at queue depth
/// 1, which the server serves on paths of their own (see docs/NBD.md, *Transmission phase*).
fn run_serially(conn: &mut Conn, reqs: &[Req]) -> HashMap<u64, Answer> {
    let mut answers = HashMap::new();
    for req in reqs {
        conn.stream.write_all(&req.wire()).expect("send request");
        answers.extend(collect(
            &mut conn.stream,
            conn.kind,
            std::slice::from_ref(req),
            false,
            None,
        ));
    }
    answers
}

/// Runs one batch per connection, all at once; a connection whose `serial` is true sends
/// its requests one at a time.
fn run_round(conns: &mut [Conn], round: &[Vec<Req>], serial: &[bool]) -> Vec<HashMap<u64, Answer>> {
    thread::scope(|s| {
        let handles: Vec<_> = conns
            .iter_mut()
            .zip(round)
            .zip(serial)
            .map(|((conn, reqs), &serial)| {
                s.spawn(move || match serial {
                    true => run_serially(conn, reqs),
                    false => run_batch(conn, reqs),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a connection's batch panicked"))
            .collect()
    })
}

/// Checks one answer against the model as it was before the round.
fn check_answer(model: &Model, kind: Kind, req: &Req, answer: &Answer) {
    assert_eq!(answer.errno, req.expect_errno, "errno of {req:?}");
    if answer.errno != 0 {
        return;
    }
    match req.command {
        nbd::CMD_READ => {
            let data = answer
                .data
                .as_ref()
                .expect("a successful READ carries data");
            assert_same_bytes(
                &format!("{req:?}"),
                &model.read(req.offset, req.len.into()),
                data,
            );
        }
        nbd::CMD_BLOCK_STATUS => check_extents(model, kind, req, answer),
        _ => {}
    }
}

/// The spec lets a server call a hole data, never data a hole: an extent flagged ZERO must
/// read as zeros, and so must one flagged HOLE (a Strata hole reads as zeros).
fn check_extents(model: &Model, kind: Kind, req: &Req, answer: &Answer) {
    let (id, extents) = answer.extents.as_ref().expect("a BLOCK_STATUS chunk");
    assert_eq!(kind, Kind::Status(*id), "context id of {req:?}");
    assert!(!extents.is_empty(), "no extents for {req:?}");
    if req.flags & nbd::CMD_FLAG_REQ_ONE != 0 {
        assert_eq!(
            extents.len(),
            1,
            "REQ_ONE answered with {extents:?} for {req:?}"
        );
    }
    let mut at = req.offset;
    for &(len, flags) in extents {
        assert!(len > 0, "an empty extent in {extents:?} for {req:?}");
        if flags & (nbd::STATE_HOLE | nbd::STATE_ZERO) != 0 {
            assert!(
                model.is_zero(at, len.into()),
                "{req:?}: {len} bytes at {at} reported as flags {flags:#x}, but the volume holds data there"
            );
        }
        at += u64::from(len);
    }
    assert!(
        at <= req.offset + u64::from(req.len),
        "extents {extents:?} run past {req:?}"
    );
}

fn apply(model: &mut Model, req: &Req) {
    match req.command {
        nbd::CMD_WRITE => model.write(req.offset, &req.payload),
        // Strata's TRIM is WRITE_ZEROES (the engine's `discard`): the range reads as zeros.
        nbd::CMD_WRITE_ZEROES | nbd::CMD_TRIM => model.zero(req.offset, req.len.into()),
        _ => {}
    }
}

/// Checks every answer of a round against the model, then applies its writes.
fn settle(
    gen: &mut Gen,
    model: &mut Model,
    kinds: &[Kind],
    round: &[Vec<Req>],
    answers: &[HashMap<u64, Answer>],
) {
    for ((reqs, answers), &kind) in round.iter().zip(answers).zip(kinds) {
        assert_eq!(
            answers.len(),
            reqs.len(),
            "answers on a {kind:?} connection"
        );
        for req in reqs {
            check_answer(model, kind, req, &answers[&req.cookie]);
            *gen.answered
                .entry((req.command, req.expect_errno))
                .or_default() += 1;
        }
    }
    for req in round.iter().flatten() {
        if req.expect_errno == 0 && req.writes() {
            apply(model, req);
        }
    }
}

/// Reads every write of the round back through the next connection.
fn check_other_connections(gen: &mut Gen, model: &Model, conns: &mut [Conn], round: &[Vec<Req>]) {
    let mut reads: Vec<Vec<Req>> = vec![Vec::new(); conns.len()];
    for (writer, reqs) in round.iter().enumerate() {
        let reader = (writer + 1) % conns.len();
        for req in reqs.iter().filter(|r| r.writes() && r.expect_errno == 0) {
            reads[reader].extend(read_reqs(gen, req.offset, req.len.into()));
        }
    }
    let answers = run_round(conns, &reads, &vec![false; conns.len()]);
    for ((reqs, answers), conn) in reads.iter().zip(&answers).zip(conns.iter()) {
        for req in reqs {
            check_answer(model, conn.kind, req, &answers[&req.cookie]);
        }
    }
}

fn read_req(gen: &mut Gen, offset: u64, len: u64) -> Req {
    Req {
        cookie: gen.cookie(),
        command: nbd::CMD_READ,
        flags: 0,
        offset,
        len: len as u32,
        payload: Vec::new(),
        expect_errno: 0,
    }
}

/// Reads of at most VERIFY_READ_BYTES covering a range.
fn read_reqs(gen: &mut Gen, offset: u64, len: u64) -> Vec<Req> {
    let end = offset + len;
    (offset..end)
        .step_by(VERIFY_READ_BYTES as usize)
        .map(|at| read_req(gen, at, (end - at).min(VERIFY_READ_BYTES)))
        .collect()
}

fn status_req(gen: &mut Gen, offset: u64, len: u64, kind: Kind) -> Req {
    Req {
        command: nbd::CMD_BLOCK_STATUS,
        expect_errno: expected_errno(nbd::CMD_BLOCK_STATUS, 0, offset, len as u32, kind),
        ..read_req(gen, offset, len)
    }
}

/// Reads (and asks the status of) every page the model holds, through a fresh connection.
fn check_whole_model(gen: &mut Gen, daemon: &Daemon, model: &Model) {
    let mut conn = open(daemon, Kind::Status(0));
    let mut reqs = Vec::new();
    for (offset, len) in model.touched_runs() {
        reqs.push(read_req(gen, offset, len));
        reqs.push(status_req(gen, offset, len, conn.kind));
    }
    // The end of the volume, which the model may never have touched.
    reqs.extend(read_reqs(gen, VOL0_SIZE_BYTES - TAIL_BYTES, TAIL_BYTES));
    for batch in reqs.chunks(BATCH_MAX) {
        let answers = run_batch(&mut conn, batch);
        for req in batch {
            check_answer(model, conn.kind, req, &answers[&req.cookie]);
        }
    }
    disconnect_all(vec![conn]);
}

/// Rounds of random requests on every connection.
fn phase(gen: &mut Gen, model: &mut Model, conns: &mut [Conn], rounds: usize) {
    let kinds: Vec<Kind> = conns.iter().map(|c| c.kind).collect();
    for _ in 0..rounds {
        let round = draw_round(gen, &kinds, false);
        let serial: Vec<bool> = kinds.iter().map(|_| gen.rng.gen_bool(0.2)).collect();
        let answers = run_round(conns, &round, &serial);
        settle(gen, model, &kinds, &round, &answers);
        check_other_connections(gen, model, conns, &round);
    }
}

/// How the daemon stops while a connection has writes in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// SIGKILL once the FLUSH among the writes is answered.
    Kill9AfterFlush,
    /// SIGTERM once the first request is answered: requests the server read but did not
    /// start get ESHUTDOWN and change nothing (docs/NBD.md, *Shutdown*).
    Terminate,
}

/// Writes on one connection with a FLUSH among them, the daemon stopped under them, then
/// started again. Whatever was answered must read back; a write answered ESHUTDOWN must not
/// have been made; an unanswered write may be there or not, byte by byte, but no byte may be
/// anything else.
fn stop_under_writes(
    gen: &mut Gen,
    model: &mut Model,
    daemon: &mut Daemon,
    conns: Vec<Conn>,
    stop: Stop,
) {
    let mut conns = conns;
    let conn = conns.swap_remove(0);
    let kind = conn.kind;
    disconnect_all(conns);
    let mut reqs = draw_round(gen, &[kind], true).remove(0);
    let flush = Req {
        command: nbd::CMD_FLUSH,
        ..read_req(gen, 0, 0)
    };
    let at = gen.rng.gen_range(0..=reqs.len());
    reqs.insert(at, flush.clone());
    let trigger = match stop {
        Stop::Kill9AfterFlush => Some(flush.cookie),
        Stop::Terminate => None,
    };
    let answers = stop_while_answering(daemon, conn, &reqs, trigger, stop);
    if stop == Stop::Kill9AfterFlush {
        assert_eq!(answers[&flush.cookie].errno, 0, "errno of the FLUSH");
    }
    daemon.restart();
    let mut unanswered = Vec::new();
    let mut shut = 0;
    for req in &reqs {
        match answers.get(&req.cookie) {
            None => unanswered.push(req),
            Some(answer) if answer.errno == nbd::ESHUTDOWN && stop == Stop::Terminate => shut += 1,
            Some(answer) => {
                check_answer(model, kind, req, answer);
                if answer.errno == 0 {
                    apply(model, req);
                }
            }
        }
    }
    eprintln!(
        "{stop:?}: of {} requests {} answered ({shut} with ESHUTDOWN), {} not",
        reqs.len(),
        answers.len(),
        unanswered.len()
    );
    adopt_unanswered(gen, model, daemon, &unanswered);
}

/// Sends `reqs` and reads their answers while the daemon is stopped as `stop` says, once
/// `trigger` (or, if None, any request) is answered; the answers read until the end.
fn stop_while_answering(
    daemon: &mut Daemon,
    mut conn: Conn,
    reqs: &[Req],
    trigger: Option<u64>,
    stop: Stop,
) -> HashMap<u64, Answer> {
    let (tx, rx) = mpsc::channel();
    let kind = conn.kind;
    let mut writer = conn.stream.try_clone().expect("clone stream");
    thread::scope(|s| {
        s.spawn(move || {
            for req in reqs {
                // The daemon may stop before it took them all.
                if writer.write_all(&req.wire()).is_err() {
                    break;
                }
            }
        });
        let reader = s.spawn(move || collect(&mut conn.stream, kind, reqs, true, Some(tx)));
        let triggered = rx.iter().any(|cookie| trigger.is_none_or(|t| t == cookie));
        assert!(
            triggered,
            "the connection ended before {trigger:?} was answered"
        );
        match stop {
            Stop::Kill9AfterFlush => daemon.kill9(),
            Stop::Terminate => daemon.terminate(),
        }
        reader.join().expect("reader")
    })
}

/// Each byte of an unanswered write reads as before it or as it would write; the model then
/// takes what the volume holds.
fn adopt_unanswered(gen: &mut Gen, model: &mut Model, daemon: &Daemon, unanswered: &[&Req]) {
    let mut conn = open(daemon, Kind::Simple);
    for req in unanswered
        .iter()
        .filter(|r| r.expect_errno == 0 && r.len > 0)
    {
        let read = read_req(gen, req.offset, req.len.into());
        let answers = run_batch(&mut conn, std::slice::from_ref(&read));
        let got = answers[&read.cookie]
            .data
            .clone()
            .expect("read data after the crash");
        let old = model.read(req.offset, req.len.into());
        let mut new = old.clone();
        match req.command {
            nbd::CMD_WRITE => new.copy_from_slice(&req.payload),
            _ => new.fill(0),
        }
        if let Some(i) = (0..got.len()).find(|&i| got[i] != old[i] && got[i] != new[i]) {
            panic!(
                "after SIGKILL, byte {} of unanswered {req:?} is {:#04x}: neither the old {:#04x} nor the new {:#04x}",
                req.offset + i as u64,
                got[i],
                old[i],
                new[i]
            );
        }
        model.write(req.offset, &got);
    }
    disconnect_all(vec![conn]);
}

#[test]
fn random_pipelined_requests_on_many_connections_match_the_model() {
    let seed = test_seed("nbd_model");
    let mut gen = Gen {
        rng: SmallRng::seed_from_u64(seed),
        next_cookie: 0,
        answered: BTreeMap::new(),
    };
    let mut model = Model::default();
    let mut daemon = Daemon::start_default();
    let mut conns = open_all(&daemon);
    phase(&mut gen, &mut model, &mut conns, ROUNDS_PER_PHASE);

    stop_under_writes(&mut gen, &mut model, &mut daemon, conns, Stop::Terminate);
    check_whole_model(&mut gen, &daemon, &model);
    let mut conns = open_all(&daemon);
    phase(&mut gen, &mut model, &mut conns, ROUNDS_PER_PHASE);

    stop_under_writes(
        &mut gen,
        &mut model,
        &mut daemon,
        conns,
        Stop::Kill9AfterFlush,
    );
    check_whole_model(&mut gen, &daemon, &model);
    let mut conns = open_all(&daemon);
    phase(&mut gen, &mut model, &mut conns, ROUNDS_PER_PHASE);

    disconnect_all(conns);
    daemon.restart();
    check_whole_model(&mut gen, &daemon, &model);
    eprintln!(
        "answered (command, errno): count: {:?}; model holds {} pages",
        gen.answered,
        model.pages.len()
    );
}
