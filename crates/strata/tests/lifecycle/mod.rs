//! The model behind e2e_lifecycle: what every block of every volume incarnation and
//! snapshot must hold, on one clock with the admin calls, and reading views whole against it.

pub mod client;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::common::{http, nbd, Daemon, VOL0};

pub const BLOCK_BYTES: u64 = 4096;
/// Reads that check a whole volume are at most this long.
pub const VERIFY_READ_BYTES: u64 = 1 << 20;

/// The 64-bit words of a block written by write `token` at block `lba`: the token, the
/// block number, then a stream both determine. Token 0 is a block of zeros.
pub fn block_word(token: u64, lba: u64, i: u64) -> u64 {
    match i {
        0 => token,
        1 => lba,
        _ => {
            let mut x = token ^ lba.rotate_left(23) ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            x ^= x >> 31;
            x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x ^ (x >> 29)
        }
    }
}

pub fn fill_blocks(token: u64, lba: u64, blocks: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity((blocks * BLOCK_BYTES) as usize);
    for b in lba..lba + blocks {
        for i in 0..BLOCK_BYTES / 8 {
            out.extend_from_slice(&block_word(token, b, i).to_le_bytes());
        }
    }
    out
}

/// The token a block read at `lba` holds (0 for zeros), or what is wrong with it.
pub fn decode_block(lba: u64, data: &[u8]) -> Result<u64, String> {
    if data.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let word = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let token = word(0);
    if word(1) != lba {
        return Err(format!(
            "block {lba} holds block {} of write {token:#x} (volume #{})",
            word(1),
            token >> TOKEN_UID_SHIFT
        ));
    }
    let intact = (2..BLOCK_BYTES as usize / 8).all(|i| word(i) == block_word(token, lba, i as u64));
    if !intact {
        return Err(format!("block {lba} is garbage (first word {token:#x})"));
    }
    Ok(token)
}

/// A token names its volume incarnation in the high bits: a read of another volume's data
/// says whose it is.
pub const TOKEN_UID_SHIFT: u32 = 40;

pub fn describe_token(token: u64) -> String {
    match token {
        0 => "zeros".into(),
        t => format!("write {t:#x} of volume #{}", t >> TOKEN_UID_SHIFT),
    }
}

// ---------------------------------------------------------------------------------------
// The model

/// One clock for NBD requests and admin calls: a request "sent at" a tick was written to
/// the socket after every tick before it was taken.
pub static CLOCK: AtomicU64 = AtomicU64::new(1);

pub fn tick() -> u64 {
    CLOCK.fetch_add(1, Ordering::SeqCst)
}

pub struct WriteRec {
    pub lba: u64,
    pub blocks: u64,
    /// 0 for WRITE_ZEROES.
    pub token: u64,
    pub sent: u64,
    pub acked: Option<u64>,
    pub failed: bool,
}

impl WriteRec {
    pub fn covers(&self, lba: u64) -> bool {
        (self.lba..self.lba + self.blocks).contains(&lba)
    }
}

pub struct Snap {
    pub name: String,
    pub size_bytes: u64,
    /// What the snapshot was read to hold once taken: it must hold it ever after.
    pub tokens: Vec<u64>,
    pub alive: bool,
}

/// One incarnation of a volume (a name deleted and created again is another one).
pub struct Vol {
    pub name: String,
    pub uid: u64,
    pub size_bytes: u64,
    /// Bumped by a rollback: connections of an earlier generation are cut off.
    pub gen: u64,
    /// The blocks when this generation began (zeros, a clone's or a rollback's snapshot).
    pub base: Vec<u64>,
    /// This generation's writes, in the order they were sent.
    pub writes: Vec<WriteRec>,
    /// A client holds a connection (or is opening one).
    pub claimed: bool,
    pub connecting: bool,
    /// The driver is changing the volume: no new connections.
    pub busy: bool,
    /// A forced change is cutting off the connections of this generation.
    pub fencing: Option<u64>,
    /// (generation, tick of the forced change's reply) for every generation cut off.
    pub fenced: Vec<(u64, u64)>,
    pub dead: bool,
    pub snaps: Vec<Snap>,
}

impl Vol {
    pub fn blocks(&self) -> u64 {
        self.size_bytes / BLOCK_BYTES
    }

    /// The blocks as acknowledged writes left them.
    pub fn current(&self) -> Vec<u64> {
        let mut out = self.base.clone();
        out.resize(self.blocks() as usize, 0);
        for w in self
            .writes
            .iter()
            .filter(|w| w.acked.is_some() && !w.failed)
        {
            for lba in w.lba..w.lba + w.blocks {
                out[lba as usize] = w.token;
            }
        }
        out
    }

    /// The tokens block `lba` may hold in a snapshot requested at `req` and answered at
    /// `rep`: the last write acknowledged before `req`, or any write sent before `rep` and
    /// not yet acknowledged at `req`.
    pub fn allowed_in_snapshot(&self, lba: u64, req: u64, rep: u64) -> Vec<u64> {
        let mut settled = self.base.get(lba as usize).copied().unwrap_or(0);
        let mut open = Vec::new();
        for w in self.writes.iter().filter(|w| w.covers(lba) && !w.failed) {
            match w.acked {
                Some(acked) if acked < req => settled = w.token,
                _ if w.sent < rep => open.push(w.token),
                _ => {}
            }
        }
        open.push(settled);
        open
    }

    /// Whether a request of generation `gen` sent at `sent` must have been refused.
    pub fn cut_before(&self, gen: u64, sent: u64) -> bool {
        self.fenced.iter().any(|&(g, at)| g == gen && at < sent)
    }

    /// Whether an ESHUTDOWN for a connection of generation `gen` has a cause.
    pub fn may_cut(&self, gen: u64) -> bool {
        let fenced = self.fenced.iter().any(|&(g, _)| g == gen);
        self.dead || self.gen != gen || self.fencing == Some(gen) || fenced
    }
}

#[derive(Default)]
pub struct World {
    pub vols: HashMap<u64, Vol>,
    pub next_uid: u64,
    pub next_write: u64,
}

impl World {
    pub fn live(&self, name: &str) -> Option<&Vol> {
        self.vols.values().find(|v| v.name == name && !v.dead)
    }

    pub fn new_vol(&mut self, name: &str, size_bytes: u64, base: Vec<u64>) -> u64 {
        self.next_uid += 1;
        let uid = self.next_uid;
        self.vols.insert(
            uid,
            Vol {
                name: name.into(),
                uid,
                size_bytes,
                gen: 0,
                base,
                writes: Vec::new(),
                claimed: false,
                connecting: false,
                busy: true,
                fencing: None,
                fenced: Vec::new(),
                dead: false,
                snaps: Vec::new(),
            },
        );
        uid
    }

    pub fn next_token(&mut self, uid: u64) -> u64 {
        self.next_write += 1;
        (uid << TOKEN_UID_SHIFT) | self.next_write
    }
}

pub type Shared = Mutex<World>;

pub fn vol_mut(world: &mut World, uid: u64) -> &mut Vol {
    world.vols.get_mut(&uid).expect("volume in the model")
}

// ---------------------------------------------------------------------------------------
// Reading whole views

/// A fresh connection's view of an export: its size and every block's token.
pub fn read_view(addr: SocketAddr, export: &str) -> (u64, Vec<u64>) {
    read_view_from(addr, export, 0)
}

/// A fresh connection's size of an export, and the tokens of its blocks from `from_bytes`.
pub fn read_view_from(addr: SocketAddr, export: &str, from_bytes: u64) -> (u64, Vec<u64>) {
    let mut client = nbd::go(addr, export).unwrap_or_else(|e| panic!("opening {export}: {e:?}"));
    let size = client.size_bytes;
    let mut tokens = Vec::with_capacity((size / BLOCK_BYTES) as usize);
    let mut offset = from_bytes;
    while offset < size {
        let len = VERIFY_READ_BYTES.min(size - offset);
        let data = client
            .read(offset, len as u32)
            .unwrap_or_else(|e| panic!("{export}: reading at {offset}: {e}"))
            .unwrap_or_else(|errno| panic!("{export}: READ at {offset} failed with errno {errno}"));
        for (i, block) in data.chunks_exact(BLOCK_BYTES as usize).enumerate() {
            let lba = offset / BLOCK_BYTES + i as u64;
            tokens.push(decode_block(lba, block).unwrap_or_else(|e| panic!("{export}: {e}")));
        }
        offset += len;
    }
    client.disconnect();
    (size, tokens)
}

pub fn assert_view(addr: SocketAddr, export: &str, size_bytes: u64, want: &[u64], when: &str) {
    let (size, got) = read_view(addr, export);
    assert_eq!(size, size_bytes, "{when}: size of {export}");
    if let Some(lba) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{when}: {export} block {lba} holds {}, expected {}",
            describe_token(got[lba]),
            describe_token(want[lba])
        );
    }
}

/// Every live volume and snapshot against the model, and the API's lists against it too.
pub fn verify_all(daemon: &Daemon, world: &Shared, when: &str) {
    let w = world.lock().expect("model");
    let mut names = Vec::new();
    for v in w.vols.values().filter(|v| !v.dead) {
        assert_view(daemon.nbd_addr, &v.name, v.size_bytes, &v.current(), when);
        names.push((v.name.clone(), v.size_bytes));
        for s in v.snaps.iter().filter(|s| s.alive) {
            let export = format!("{}@{}", v.name, s.name);
            assert_view(daemon.nbd_addr, &export, s.size_bytes, &s.tokens, when);
        }
    }
    let listed = http::get_json(&format!("{}/api/v1/volumes", daemon.http_url()));
    let mut api: Vec<(String, u64)> = listed["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| {
            (
                v["name"].as_str().expect("name").to_string(),
                v["size_bytes"].as_u64().expect("size"),
            )
        })
        // The daemon makes vol0 at its first start; the run leaves it alone.
        .filter(|(name, _)| name != VOL0)
        .collect();
    api.sort();
    names.sort();
    assert_eq!(api, names, "{when}: the API's volumes");
    let snaps = http::get_json(&format!("{}/api/v1/snapshots", daemon.http_url()));
    let listed = snaps["snapshots"].as_array().expect("snapshots").len();
    let alive: usize = w
        .vols
        .values()
        .filter(|v| !v.dead)
        .map(|v| v.snaps.iter().filter(|s| s.alive).count())
        .sum();
    assert_eq!(listed, alive, "{when}: the API's snapshot count");
}
