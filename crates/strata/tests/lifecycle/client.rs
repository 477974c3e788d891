//! The client threads of e2e_lifecycle: each holds a connection to one volume at a time
//! with several requests in flight, every reply checked against the model.
use std::collections::HashMap;
use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::common::nbd::ReplyPiece;

/// Requests one client keeps in flight.
pub const CLIENT_QUEUE_DEPTH: usize = 8;
/// Longest WRITE or WRITE_ZEROES, in blocks.
pub const MAX_WRITE_BLOCKS: u64 = 16;

pub enum ReqKind {
    Read {
        lba: u64,
        blocks: u64,
    },
    /// WRITE (token != 0) or WRITE_ZEROES (token 0); `log` indexes the volume's writes.
    Write {
        lba: u64,
        blocks: u64,
        token: u64,
        log: Option<usize>,
    },
    Flush,
    /// A READ just past the connection's end: EINVAL whatever happened to the volume.
    PastEnd,
}

pub struct Req {
    pub kind: ReqKind,
    pub sent: u64,
}

/// One client connection to one volume incarnation and generation.
pub struct Conn {
    pub client: nbd::Client,
    pub name: String,
    pub uid: u64,
    pub gen: u64,
    /// The volume as this connection's acknowledged writes left it.
    pub local: Vec<u64>,
    /// Requests in flight per block (reads and writes never overlap a write in flight).
    pub in_flight_blocks: Vec<u8>,
    pub in_flight: HashMap<u64, Req>,
    /// ESHUTDOWN seen: send nothing more.
    pub cut: bool,
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
    let opened = nbd::go(addr, &name);
    let mut w = world.lock().expect("model");
    let v = vol_mut(&mut w, uid);
    v.connecting = false;
    let client = match opened {
        Ok(c) => c,
        Err(e) => {
            v.claimed = false;
            return Err(format!("opening {name}: {e:?}"));
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
        name,
        uid,
        gen,
        local,
        in_flight: HashMap::new(),
        cut: false,
    }))
}

pub fn release(world: &Shared, conn: Conn) {
    let uid = conn.uid;
    conn.client.disconnect();
    vol_mut(&mut world.lock().expect("model"), uid).claimed = false;
}

impl Conn {
    pub fn blocks(&self) -> u64 {
        self.local.len() as u64
    }

    pub fn range_free(&self, lba: u64, blocks: u64) -> bool {
        (lba..lba + blocks).all(|b| self.in_flight_blocks[b as usize] == 0)
    }

    pub fn mark(&mut self, lba: u64, blocks: u64, up: bool) {
        for b in lba..lba + blocks {
            let n = &mut self.in_flight_blocks[b as usize];
            *n = if up { *n + 1 } else { *n - 1 };
        }
    }

    /// Sends one random request, or none when the range drawn is busy.
    pub fn send_random(&mut self, world: &Shared, rng: &mut SmallRng) -> Result<(), String> {
        let blocks = rng.gen_range(1..=MAX_WRITE_BLOCKS).min(self.blocks());
        let lba = rng.gen_range(0..=self.blocks() - blocks);
        let (kind, cmd) = match rng.gen_range(0..100) {
            0..=54 => (None, nbd::CMD_WRITE),
            55..=62 => (None, nbd::CMD_WRITE_ZEROES),
            63..=94 => (Some(ReqKind::Read { lba, blocks }), nbd::CMD_READ),
            95..=97 => (Some(ReqKind::Flush), nbd::CMD_FLUSH),
            _ => (Some(ReqKind::PastEnd), nbd::CMD_READ),
        };
        if !self.range_free(lba, blocks) && !matches!(kind, Some(ReqKind::Flush | ReqKind::PastEnd))
        {
            return Ok(());
        }
        let (kind, payload, sent) = match kind {
            Some(k) => (k, Vec::new(), tick()),
            None => self.log_write(world, cmd, lba, blocks),
        };
        let (offset, len) = match kind {
            ReqKind::Read { lba, blocks } | ReqKind::Write { lba, blocks, .. } => {
                self.mark(lba, blocks, true);
                (lba * BLOCK_BYTES, blocks * BLOCK_BYTES)
            }
            ReqKind::Flush => (0, 0),
            ReqKind::PastEnd => (self.blocks() * BLOCK_BYTES, BLOCK_BYTES),
        };
        let cookie = self
            .client
            .send(cmd, offset, len as u32, &payload)
            .map_err(|e| format!("{}: sending a request: {e}", self.name))?;
        self.in_flight.insert(cookie, Req { kind, sent });
        Ok(())
    }

    /// Records a write in the volume's log before it is sent (if this connection is still
    /// of the volume's generation): its request, payload and send tick.
    pub fn log_write(
        &mut self,
        world: &Shared,
        cmd: u16,
        lba: u64,
        blocks: u64,
    ) -> (ReqKind, Vec<u8>, u64) {
        let mut w = world.lock().expect("model");
        let sent = tick();
        let token = match cmd {
            nbd::CMD_WRITE => w.next_token(self.uid),
            _ => 0,
        };
        let v = vol_mut(&mut w, self.uid);
        let log = (v.gen == self.gen && !v.dead).then(|| {
            v.writes.push(WriteRec {
                lba,
                blocks,
                token,
                sent,
                acked: None,
                failed: false,
            });
            v.writes.len() - 1
        });
        let payload = match token {
            0 => Vec::new(),
            t => fill_blocks(t, lba, blocks),
        };
        (
            ReqKind::Write {
                lba,
                blocks,
                token,
                log,
            },
            payload,
            sent,
        )
    }

    /// Reads one reply and checks it against the model.
    pub fn take_reply(&mut self, world: &Shared) -> Result<(), String> {
        let piece = nbd::read_reply_piece(&mut self.client.stream).map_err(|e| {
            format!(
                "{}: no reply ({e}); in flight: {}",
                self.name,
                self.in_flight.len()
            )
        })?;
        let ReplyPiece::Simple { cookie, errno } = piece else {
            return Err(format!(
                "{}: a structured reply nobody asked for",
                self.name
            ));
        };
        let req = self
            .in_flight
            .remove(&cookie)
            .ok_or_else(|| format!("{}: a reply to unknown cookie {cookie}", self.name))?;
        let acked = tick();
        let data = match (&req.kind, errno) {
            (ReqKind::Read { blocks, .. }, 0) => Some(self.read_payload(*blocks)?),
            _ => None,
        };
        if let ReqKind::Read { lba, blocks } | ReqKind::Write { lba, blocks, .. } = req.kind {
            self.mark(lba, blocks, false);
        }
        if errno != 0 {
            return self.refused(world, &req, errno);
        }
        self.check_not_cut(world, &req)?;
        match req.kind {
            ReqKind::Read { lba, .. } => self.check_read(lba, &data.expect("read data")),
            ReqKind::Write {
                lba,
                blocks,
                token,
                log,
            } => {
                self.acknowledge(world, lba, blocks, token, log, acked);
                Ok(())
            }
            ReqKind::Flush => Ok(()),
            ReqKind::PastEnd => Err(format!(
                "{}: a READ past the connection's end ({} bytes) succeeded",
                self.name,
                self.blocks() * BLOCK_BYTES
            )),
        }
    }

    pub fn read_payload(&mut self, blocks: u64) -> Result<Vec<u8>, String> {
        let mut data = vec![0u8; (blocks * BLOCK_BYTES) as usize];
        self.client
            .stream
            .read_exact(&mut data)
            .map_err(|e| format!("{}: reading a READ's data: {e}", self.name))?;
        Ok(data)
    }

    /// A request sent after a forced change answered must not have succeeded.
    pub fn check_not_cut(&self, world: &Shared, req: &Req) -> Result<(), String> {
        let w = world.lock().expect("model");
        let v = &w.vols[&self.uid];
        if v.cut_before(self.gen, req.sent) {
            return Err(format!(
                "{}: a request sent after a forced delete or rollback was answered succeeded",
                self.name
            ));
        }
        Ok(())
    }

    pub fn check_read(&self, lba: u64, data: &[u8]) -> Result<(), String> {
        for (i, block) in data.chunks_exact(BLOCK_BYTES as usize).enumerate() {
            let at = lba + i as u64;
            let got = decode_block(at, block).map_err(|e| format!("{}: {e}", self.name))?;
            let want = self.local[at as usize];
            if got != want {
                return Err(format!(
                    "{} (volume #{}): block {at} holds {}, expected {}",
                    self.name,
                    self.uid,
                    describe_token(got),
                    describe_token(want)
                ));
            }
        }
        Ok(())
    }

    pub fn acknowledge(
        &mut self,
        world: &Shared,
        lba: u64,
        blocks: u64,
        token: u64,
        log: Option<usize>,
        acked: u64,
    ) {
        for b in lba..lba + blocks {
            self.local[b as usize] = token;
        }
        let mut w = world.lock().expect("model");
        let v = vol_mut(&mut w, self.uid);
        if let (Some(i), true) = (log, v.gen == self.gen) {
            v.writes[i].acked = Some(acked);
        }
    }

    /// An error reply: EINVAL for a read past the end; ESHUTDOWN once the volume was deleted
    /// or rolled back under this connection; nothing else.
    pub fn refused(&mut self, world: &Shared, req: &Req, errno: u32) -> Result<(), String> {
        if matches!(req.kind, ReqKind::PastEnd) && errno == nbd::EINVAL {
            return Ok(());
        }
        let mut w = world.lock().expect("model");
        let v = vol_mut(&mut w, self.uid);
        if errno != nbd::ESHUTDOWN || !v.may_cut(self.gen) {
            return Err(format!(
                "{} (volume #{}, generation {}): errno {errno} for a request sent at tick {}",
                self.name, self.uid, self.gen, req.sent
            ));
        }
        if let (ReqKind::Write { log: Some(i), .. }, true) = (&req.kind, v.gen == self.gen) {
            v.writes[*i].failed = true;
        }
        self.cut = true;
        Ok(())
    }

    /// A burst of requests, then the replies of those still in flight.
    pub fn run(
        &mut self,
        world: &Shared,
        stop: &AtomicBool,
        rng: &mut SmallRng,
    ) -> Result<u64, String> {
        let mut answered = 0;
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
                answered += 1;
            }
        }
        while !self.in_flight.is_empty() {
            self.take_reply(world)?;
            answered += 1;
        }
        Ok(answered)
    }
}

/// A client's life: connections to free volumes, one after the other. Returns the replies it
/// checked and the connections cut off under it.
pub fn client_loop(
    world: &Shared,
    addr: SocketAddr,
    stop: &AtomicBool,
    seed: u64,
) -> Result<(u64, u64), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (mut answered, mut cut) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        let Some(mut conn) = claim(world, addr, &mut rng)? else {
            thread::sleep(Duration::from_millis(20));
            continue;
        };
        let result = conn.run(world, stop, &mut rng);
        cut += u64::from(conn.cut);
        release(world, conn);
        answered += result?;
    }
    Ok((answered, cut))
}
