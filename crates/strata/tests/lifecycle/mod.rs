//! The model behind e2e_lifecycle: what every block of every volume incarnation and
//! snapshot must hold, on one clock with the admin calls, and reading views whole against it.

pub mod client;
pub mod content;
pub mod replies;

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

/// A block's content id (see [`content`]) in words.
pub fn describe_token(id: u64) -> String {
    content::describe(id)
}

// ---------------------------------------------------------------------------------------
// The model

/// One clock for NBD requests and admin calls: a request "sent at" a tick was written to
/// the socket after every tick before it was taken.
pub static CLOCK: AtomicU64 = AtomicU64::new(1);

pub fn tick() -> u64 {
    CLOCK.fetch_add(1, Ordering::SeqCst)
}

/// A WRITE (its token), or a WRITE_ZEROES or TRIM (token 0), of any byte range.
pub struct WriteRec {
    pub offset_bytes: u64,
    pub len_bytes: u64,
    pub token: u64,
    pub sent: u64,
    pub acked: Option<u64>,
    pub failed: bool,
}

impl WriteRec {
    pub fn apply(&self, blocks: &mut [u64]) {
        apply(blocks, self.offset_bytes, self.len_bytes, self.token);
    }
}

/// The blocks a byte range touches, whole or in part.
pub fn blocks_touched(offset_bytes: u64, len_bytes: u64) -> std::ops::Range<u64> {
    offset_bytes / BLOCK_BYTES..(offset_bytes + len_bytes).div_ceil(BLOCK_BYTES)
}

/// The contents of `blocks` once `len_bytes` at `offset_bytes` were written by `token` (0:
/// zeroed or trimmed: a Zero record, read back as zeros, docs/FORMAT.md).
pub fn apply(blocks: &mut [u64], offset_bytes: u64, len_bytes: u64, token: u64) {
    for lba in blocks_touched(offset_bytes, len_bytes) {
        let b = &mut blocks[lba as usize];
        *b = patch_block(*b, lba, offset_bytes, len_bytes, token);
    }
}

/// What block `lba`, holding `id`, holds once `len_bytes` at `offset_bytes` (touching it)
/// were written by `token`.
pub fn patch_block(id: u64, lba: u64, offset_bytes: u64, len_bytes: u64, token: u64) -> u64 {
    let at = lba * BLOCK_BYTES;
    let start = offset_bytes.max(at) - at;
    let end = (offset_bytes + len_bytes).min(at + BLOCK_BYTES) - at;
    content::patch(id, start as usize, end as usize, token)
}

pub struct Snap {
    pub name: String,
    pub size_bytes: u64,
    /// What the snapshot was read to hold once taken (content ids, see content.rs): it must
    /// hold it ever after.
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
            w.apply(&mut out);
        }
        out
    }

    /// The contents each block may hold in a snapshot requested at `req` and answered at
    /// `rep`: as the writes acknowledged before `req` left it, then as each write sent before
    /// `rep` and not yet acknowledged at `req` left it in turn (a block never has two writes
    /// in flight at once, so they apply in the order they were sent).
    pub fn snapshot_states(&self, req: u64, rep: u64) -> Vec<Vec<u64>> {
        let mut settled = self.base.clone();
        settled.resize(self.blocks() as usize, 0);
        let mut open: Vec<Vec<u64>> = vec![Vec::new(); settled.len()];
        for w in self.writes.iter().filter(|w| !w.failed) {
            let settles = w.acked.is_some_and(|acked| acked < req);
            if !settles && w.sent >= rep {
                continue;
            }
            for lba in blocks_touched(w.offset_bytes, w.len_bytes) {
                let i = lba as usize;
                assert!(
                    !settles || open[i].is_empty(),
                    "block {lba}: a write settled after one still open"
                );
                let before = open[i].last().copied().unwrap_or(settled[i]);
                let after = patch_block(before, lba, w.offset_bytes, w.len_bytes, w.token);
                match settles {
                    true => settled[i] = after,
                    false => open[i].push(after),
                }
            }
        }
        settled
            .into_iter()
            .zip(open)
            .map(|(s, mut o)| {
                o.insert(0, s);
                o
            })
            .collect()
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

/// A fresh connection's view of an export: its size and all its bytes.
pub fn read_view(addr: SocketAddr, export: &str) -> (u64, Vec<u8>) {
    read_view_from(addr, export, 0)
}

/// A fresh connection's size of an export, and its bytes from `from_bytes` on.
pub fn read_view_from(addr: SocketAddr, export: &str, from_bytes: u64) -> (u64, Vec<u8>) {
    let mut client = nbd::go(addr, export).unwrap_or_else(|e| panic!("opening {export}: {e:?}"));
    let size = client.size_bytes;
    let mut bytes = Vec::with_capacity(size.saturating_sub(from_bytes) as usize);
    let mut offset = from_bytes;
    while offset < size {
        let len = VERIFY_READ_BYTES.min(size - offset);
        let data = client
            .read(offset, len as u32)
            .unwrap_or_else(|e| panic!("{export}: reading at {offset}: {e}"))
            .unwrap_or_else(|errno| panic!("{export}: READ at {offset} failed with errno {errno}"));
        bytes.extend_from_slice(&data);
        offset += len;
    }
    client.disconnect();
    (size, bytes)
}

/// The first of `candidates` block `lba` reads as; a hole (0) last, so that zeros written
/// as data are never taken for a hole.
pub fn match_block(lba: u64, data: &[u8], candidates: &[u64]) -> Option<u64> {
    let holes_last = candidates
        .iter()
        .filter(|&&c| c != 0)
        .chain(candidates.iter().filter(|&&c| c == 0));
    holes_last
        .copied()
        .find(|&c| content::expected(c, lba) == data)
}

pub fn assert_view(addr: SocketAddr, export: &str, size_bytes: u64, want: &[u64], when: &str) {
    let (size, got) = read_view(addr, export);
    assert_eq!(size, size_bytes, "{when}: size of {export}");
    for (lba, data) in got.chunks_exact(BLOCK_BYTES as usize).enumerate() {
        let lba = lba as u64;
        if content::expected(want[lba as usize], lba) != data {
            panic!(
                "{when}: {export}: {}",
                content::explain_mismatch(lba, data, want[lba as usize])
            );
        }
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
