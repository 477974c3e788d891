//! The client threads of e2e_lifecycle: each holds a connection to one volume at a time
//! with several requests in flight: writes, write-zeroes (plain, NO_HOLE, FAST_ZERO), trims
//! and reads of any byte range (whole blocks, 512-byte sectors, single bytes: the daemon
//! reads, patches and writes partial blocks), BLOCK_STATUS queries, flushes; on simple or
//! structured replies. Every reply is checked against the model (see replies.rs).
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

/// Requests one client keeps in flight.
pub const CLIENT_QUEUE_DEPTH: usize = 8;
/// Longest WRITE, WRITE_ZEROES, TRIM, READ or BLOCK_STATUS, in blocks.
pub const MAX_WRITE_BLOCKS: u64 = 16;

/// How a connection was negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replies {
    Simple,
    Structured,
    /// Structured, with `base:allocation` selected under this context id.
    BlockStatus(u32),
}

pub enum ReqKind {
    Read {
        offset: u64,
        len: u64,
    },
    /// WRITE (token != 0), WRITE_ZEROES or TRIM (token 0); `log` indexes the volume's writes.
    Write {
        offset: u64,
        len: u64,
        token: u64,
        log: Option<usize>,
    },
    /// WRITE_ZEROES with FAST_ZERO of a range holding no whole block: ENOTSUP, no change.
    FastZeroRefused {
        offset: u64,
        len: u64,
    },
    BlockStatus {
        offset: u64,
        len: u64,
        req_one: bool,
    },
    Flush,
    /// A READ just past the connection's end: EINVAL whatever happened to the volume.
    PastEnd,
}

impl ReqKind {
    /// The byte range whose blocks the request keeps busy.
    pub fn range(&self) -> Option<(u64, u64)> {
        match *self {
            ReqKind::Read { offset, len }
            | ReqKind::Write { offset, len, .. }
            | ReqKind::FastZeroRefused { offset, len }
            | ReqKind::BlockStatus { offset, len, .. } => Some((offset, len)),
            ReqKind::Flush | ReqKind::PastEnd => None,
        }
    }
}

/// A request in flight, and its reply as it comes in.
pub struct Req {
    pub kind: ReqKind,
    pub command: u16,
    pub flags: u16,
    pub sent: u64,
    pub errno: u32,
    /// A READ's buffer, and the (offset, length) pieces its reply filled.
    pub data: Vec<u8>,
    pub filled: Vec<(u64, u64)>,
    /// A BLOCK_STATUS chunk's context id and (length, flags) descriptors.
    pub status: Option<(u32, Vec<(u32, u32)>)>,
}

/// One client connection to one volume incarnation and generation.
pub struct Conn {
    pub client: nbd::Client,
    pub replies: Replies,
    pub name: String,
    pub uid: u64,
    pub gen: u64,
    /// The volume as this connection's acknowledged writes left it.
    pub local: Vec<u64>,
    /// Requests in flight per block (no request overlaps a write in flight).
    pub in_flight_blocks: Vec<u8>,
    pub in_flight: HashMap<u64, Req>,
    /// ESHUTDOWN seen: send nothing more.
    pub cut: bool,
    /// Replies checked, by what they answered (see `Conn::count`).
    pub tally: Tally,
}

/// Replies checked, by command, alignment and errno.
pub type Tally = BTreeMap<String, u64>;

#[derive(Clone, Copy)]
enum Op {
    Write,
    Zeroes,
    Trim,
    Read,
    Status,
    Flush,
    PastEnd,
}

/// Opens a connection, with simple or structured replies at random.
fn open(
    addr: SocketAddr,
    name: &str,
    rng: &mut SmallRng,
) -> Result<(nbd::Client, Replies), String> {
    let opened = match rng.gen_range(0..3) {
        0 => nbd::go(addr, name).map(|c| (c, Replies::Simple)),
        1 => nbd::go_structured(addr, name).map(|c| (c, Replies::Structured)),
        _ => {
            nbd::go_structured_block_status(addr, name).map(|(c, id)| (c, Replies::BlockStatus(id)))
        }
    };
    opened.map_err(|e| format!("opening {name}: {e:?}"))
}

/// Opens a connection to a volume no one else holds, or None when none is free.
pub fn claim(world: &Shared, addr: SocketAddr, rng: &mut SmallRng) -> Result<Option<Conn>, String> {
    let (name, uid, gen, local) = {
        let mut w = world.lock().expect("model");
        let free: Vec<u64> = w
            .vols
            .values()
            .filter(|v| !v.dead && !v.busy && !v.claimed)
            .map(|v| v.uid)
            .collect();
        if free.is_empty() {
            return Ok(None);
        }
        let v = vol_mut(&mut w, free[rng.gen_range(0..free.len())]);
        v.claimed = true;
        v.connecting = true;
        (v.name.clone(), v.uid, v.gen, v.current())
    };
    let opened = open(addr, &name, rng);
    let mut w = world.lock().expect("model");
    let v = vol_mut(&mut w, uid);
    v.connecting = false;
    let (client, replies) = match opened {
        Ok(c) => c,
        Err(e) => {
            v.claimed = false;
            return Err(e);
        }
    };
    if client.size_bytes != v.size_bytes {
        return Err(format!(
            "{name}: a new connection sees {} bytes, the volume is {}",
            client.size_bytes, v.size_bytes
        ));
    }
    Ok(Some(Conn {
        in_flight_blocks: vec![0; local.len()],
        client,
        replies,
        name,
        uid,
        gen,
        local,
        in_flight: HashMap::new(),
        cut: false,
        tally: Tally::new(),
    }))
}

pub fn release(world: &Shared, conn: Conn) {
    let uid = conn.uid;
    conn.client.disconnect();
    vol_mut(&mut world.lock().expect("model"), uid).claimed = false;
}

/// Whether a byte range holds at least one whole 4 KiB-aligned block.
pub fn holds_whole_block(offset: u64, len: u64) -> bool {
    offset.div_ceil(BLOCK_BYTES) < (offset + len) / BLOCK_BYTES
}

impl Conn {
    pub fn blocks(&self) -> u64 {
        self.local.len() as u64
    }

    pub fn range_free(&self, offset: u64, len: u64) -> bool {
        blocks_touched(offset, len).all(|b| self.in_flight_blocks[b as usize] == 0)
    }

    pub fn mark(&mut self, offset: u64, len: u64, up: bool) {
        for b in blocks_touched(offset, len) {
            let n = &mut self.in_flight_blocks[b as usize];
            *n = if up { *n + 1 } else { *n - 1 };
        }
    }

    /// A byte range inside the connection's size: whole blocks, 512-byte sectors or any
    /// bytes; often at most one block long (sub-block, or across one boundary).
    fn draw_range(&self, rng: &mut SmallRng) -> (u64, u64) {
        let size = self.blocks() * BLOCK_BYTES;
        let unit = [BLOCK_BYTES, BLOCK_BYTES, 512, 1][rng.gen_range(0..4)];
        let max_units = (MAX_WRITE_BLOCKS * BLOCK_BYTES).min(size) / unit;
        let short_units = (BLOCK_BYTES / unit).min(max_units);
        let units = match rng.gen_bool(0.4) {
            true => rng.gen_range(1..=short_units),
            false => rng.gen_range(1..=max_units),
        };
        let len = units * unit;
        (rng.gen_range(0..=(size - len) / unit) * unit, len)
    }

    fn draw_op(&self, rng: &mut SmallRng) -> Op {
        let status = matches!(self.replies, Replies::BlockStatus(_));
        match rng.gen_range(0..100) {
            0..=39 => Op::Write,
            40..=47 => Op::Zeroes,
            48..=54 => Op::Trim,
            84..=91 if status => Op::Status,
            55..=91 => Op::Read,
            92..=96 => Op::Flush,
            _ => Op::PastEnd,
        }
    }

    /// Flags valid for the command: FUA on any, NO_HOLE and FAST_ZERO on WRITE_ZEROES, DF on
    /// a READ with structured replies, REQ_ONE on BLOCK_STATUS.
    fn draw_flags(&self, op: Op, rng: &mut SmallRng) -> u16 {
        let fua = if rng.gen_bool(0.1) {
            nbd::CMD_FLAG_FUA
        } else {
            0
        };
        let zero_flags = [
            0,
            0,
            nbd::CMD_FLAG_NO_HOLE,
            nbd::CMD_FLAG_FAST_ZERO,
            nbd::CMD_FLAG_NO_HOLE | nbd::CMD_FLAG_FAST_ZERO,
        ];
        match op {
            Op::Zeroes => fua | zero_flags[rng.gen_range(0..zero_flags.len())],
            Op::Read if self.replies != Replies::Simple && rng.gen_bool(0.3) => {
                fua | nbd::CMD_FLAG_DF
            }
            Op::Status if rng.gen_bool(0.3) => nbd::CMD_FLAG_REQ_ONE,
            _ => fua,
        }
    }

    /// Sends one random request, or none when the range drawn is busy.
    pub fn send_random(&mut self, world: &Shared, rng: &mut SmallRng) -> Result<(), String> {
        let op = self.draw_op(rng);
        let flags = self.draw_flags(op, rng);
        let (offset, len) = self.draw_range(rng);
        let ranged = !matches!(op, Op::Flush | Op::PastEnd);
        if ranged && !self.range_free(offset, len) {
            return Ok(());
        }
        let fast_zero = flags & nbd::CMD_FLAG_FAST_ZERO != 0;
        let (kind, command, payload, sent) = match op {
            Op::Write => self.log_write(world, nbd::CMD_WRITE, offset, len),
            Op::Zeroes if fast_zero && !holds_whole_block(offset, len) => {
                let kind = ReqKind::FastZeroRefused { offset, len };
                (kind, nbd::CMD_WRITE_ZEROES, Vec::new(), tick())
            }
            Op::Zeroes => self.log_write(world, nbd::CMD_WRITE_ZEROES, offset, len),
            Op::Trim => self.log_write(world, nbd::CMD_TRIM, offset, len),
            Op::Read => (
                ReqKind::Read { offset, len },
                nbd::CMD_READ,
                Vec::new(),
                tick(),
            ),
            Op::Status => {
                let req_one = flags & nbd::CMD_FLAG_REQ_ONE != 0;
                let kind = ReqKind::BlockStatus {
                    offset,
                    len,
                    req_one,
                };
                (kind, nbd::CMD_BLOCK_STATUS, Vec::new(), tick())
            }
            Op::Flush => (ReqKind::Flush, nbd::CMD_FLUSH, Vec::new(), tick()),
            Op::PastEnd => (ReqKind::PastEnd, nbd::CMD_READ, Vec::new(), tick()),
        };
        self.send(kind, command, flags, payload, sent)
    }

    fn send(
        &mut self,
        kind: ReqKind,
        command: u16,
        flags: u16,
        payload: Vec<u8>,
        sent: u64,
    ) -> Result<(), String> {
        let (offset, len) = match kind {
            ReqKind::Flush => (0, 0),
            ReqKind::PastEnd => (self.blocks() * BLOCK_BYTES, BLOCK_BYTES),
            _ => kind.range().expect("a ranged request"),
        };
        if kind.range().is_some() {
            self.mark(offset, len, true);
        }
        let data = match kind {
            ReqKind::Read { len, .. } => vec![0u8; len as usize],
            _ => Vec::new(),
        };
        let cookie = self
            .client
            .send_flags(flags, command, offset, len as u32, &payload)
            .map_err(|e| format!("{}: sending a request: {e}", self.name))?;
        let req = Req {
            kind,
            command,
            flags,
            sent,
            errno: 0,
            data,
            filled: Vec::new(),
            status: None,
        };
        self.in_flight.insert(cookie, req);
        Ok(())
    }

    /// Records a WRITE, WRITE_ZEROES or TRIM in the volume's log before it is sent (if this
    /// connection is still of the volume's generation): its range, payload and send tick.
    pub fn log_write(
        &mut self,
        world: &Shared,
        command: u16,
        offset: u64,
        len: u64,
    ) -> (ReqKind, u16, Vec<u8>, u64) {
        let mut w = world.lock().expect("model");
        let sent = tick();
        let token = match command {
            nbd::CMD_WRITE => w.next_token(self.uid),
            _ => 0,
        };
        let v = vol_mut(&mut w, self.uid);
        let log = (v.gen == self.gen && !v.dead).then(|| {
            v.writes.push(WriteRec {
                offset_bytes: offset,
                len_bytes: len,
                token,
                sent,
                acked: None,
                failed: false,
            });
            v.writes.len() - 1
        });
        let payload = match token {
            0 => Vec::new(),
            t => write_payload(t, offset, len),
        };
        let kind = ReqKind::Write {
            offset,
            len,
            token,
            log,
        };
        (kind, command, payload, sent)
    }

    /// A burst of requests, then the replies of those still in flight.
    pub fn run(
        &mut self,
        world: &Shared,
        stop: &AtomicBool,
        rng: &mut SmallRng,
    ) -> Result<(), String> {
        for _ in 0..rng.gen_range(50..400) {
            if self.cut || stop.load(Ordering::Relaxed) {
                break;
            }
            while self.in_flight.len() < CLIENT_QUEUE_DEPTH && !self.cut {
                self.send_random(world, rng)?;
                if rng.gen_bool(0.3) {
                    break;
                }
            }
            if !self.in_flight.is_empty() {
                self.take_reply(world)?;
            }
        }
        while !self.in_flight.is_empty() {
            self.take_reply(world)?;
        }
        Ok(())
    }
}

/// The bytes write `token` puts at `offset`: each block's share of its whole-block fill.
pub fn write_payload(token: u64, offset: u64, len: u64) -> Vec<u8> {
    let blocks = blocks_touched(offset, len);
    let fill = fill_blocks(token, blocks.start, blocks.end - blocks.start);
    let start = (offset - blocks.start * BLOCK_BYTES) as usize;
    fill[start..start + len as usize].to_vec()
}

/// A client's life: connections to free volumes, one after the other. Returns the replies
/// it checked, and the connections cut off under it as "cut".
pub fn client_loop(
    world: &Shared,
    addr: SocketAddr,
    stop: &AtomicBool,
    seed: u64,
) -> Result<Tally, String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut tally = Tally::new();
    while !stop.load(Ordering::Relaxed) {
        let Some(mut conn) = claim(world, addr, &mut rng)? else {
            thread::sleep(Duration::from_millis(20));
            continue;
        };
        let result = conn.run(world, stop, &mut rng);
        *tally.entry("cut".into()).or_default() += u64::from(conn.cut);
        for (k, n) in std::mem::take(&mut conn.tally) {
            *tally.entry(k).or_default() += n;
        }
        release(world, conn);
        result?;
    }
    Ok(tally)
}
