//! Byte-level encoding of every structure Strata writes (see docs/FORMAT.md).
//!
//! All integers are little-endian. Every structure carries a magic, the format version and a
//! crc32c, and every structure but the superblock carries the disk group's UUID, so stale or
//! foreign blocks are recognised rather than trusted.

use crate::error::EngineError;

pub const BLOCK: usize = strata_device::BLOCK_SIZE;
pub const BLOCK_U64: u64 = BLOCK as u64;
/// The version every structure but the superblock carries (checkpoint, log batch and record
/// headers, segment summary, index page): the same in groups of format 2 and 3.
pub const FORMAT_VERSION: u32 = 2;
/// The superblock's version: the group's format. Format 3 writes each data segment's summary
/// twice (docs/FORMAT.md §3.5); format 2 wrote it once. This build reads both and formats 3.
pub const GROUP_VERSION: u32 = 3;
/// The oldest group format this build reads.
pub const GROUP_VERSION_MIN: u32 = 2;

pub const SUPERBLOCK_MAGIC: &[u8; 8] = b"STRATASB";
pub const CHECKPOINT_MAGIC: &[u8; 8] = b"STRATACP";
pub const BATCH_MAGIC: &[u8; 8] = b"STRATALB";
pub const SUMMARY_MAGIC: &[u8; 8] = b"STRATASS";
pub const RECORD_MAGIC: u32 = 0x5354_5243; // bytes on disk (little-endian): "CRTS"

pub type Uuid = [u8; 16];

/// Little-endian cursor over a byte slice; reads past the end yield an error, never a panic.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], EngineError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| EngineError::Format("structure truncated".into()))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, EngineError> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, EngineError> {
        let b = self.bytes(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Result<u32, EngineError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.bytes(4)?);
        Ok(u32::from_le_bytes(a))
    }
    pub fn u64(&mut self) -> Result<u64, EngineError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.bytes(8)?);
        Ok(u64::from_le_bytes(a))
    }
    pub fn uuid(&mut self) -> Result<Uuid, EngineError> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.bytes(16)?);
        Ok(a)
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
}

/// Little-endian writer into a growable buffer.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.bytes(&[v])
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn pad_to(&mut self, len: usize) -> &mut Self {
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        self
    }
}

/// Writes crc32c(buf with the 4 crc bytes zeroed) at `at`.
pub fn seal_crc(buf: &mut [u8], at: usize) {
    buf[at..at + 4].fill(0);
    let c = crc32c::crc32c(buf);
    buf[at..at + 4].copy_from_slice(&c.to_le_bytes());
}

/// Checks a crc written by [`seal_crc`].
pub fn check_crc(buf: &[u8], at: usize) -> bool {
    if buf.len() < at + 4 {
        return false;
    }
    let stored = u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
    let mut h = crc32c::crc32c(&buf[..at]);
    h = crc32c::crc32c_append(h, &[0u8; 4]);
    h = crc32c::crc32c_append(h, &buf[at + 4..]);
    h == stored
}

pub fn uuid_hex(u: &Uuid) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh random disk-group UUID.
/// Seconds since the Unix epoch; 0 if the clock is before it.
pub fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn new_uuid() -> Uuid {
    use std::io::Read;
    let mut u = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut u))
        .is_ok();
    if !ok {
        // No /dev/urandom: time and pid still make collisions between groups implausible.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        u[..8].copy_from_slice(&(t as u64).to_le_bytes());
        u[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    u
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Role {
    Fast = 1,
    Capacity = 2,
}

/// Block 0 and block 1 of every device: who the device is and how it is laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// The group's format (`GROUP_VERSION_MIN..=GROUP_VERSION`), the same on every device.
    pub version: u32,
    pub role: Role,
    pub group: Uuid,
    pub device_index: u32,
    pub capacity_devices: u32,
    pub device_size_bytes: u64,
    pub segment_size_bytes: u64,
    /// Fast device: where each checkpoint copy starts and how long it is (bytes).
    pub checkpoint_offsets: [u64; 2],
    pub checkpoint_size_bytes: u64,
    /// Fast device: the circular log area.
    pub log_offset: u64,
    pub log_size_bytes: u64,
    /// Capacity device: first segment and segment count.
    pub segments_offset: u64,
    pub segment_count: u64,
    /// Capacity device: the last opening (its epoch) that stamped it, at open and at a clean
    /// shutdown. The checkpoint says which stamps the group's devices may carry
    /// (`Checkpoint::device_stamps`), so a device restored from an older image is found out.
    /// 0: never stamped (a group from before stamps). The fast device: always 0.
    pub stamp: u32,
}

pub enum SuperblockRead {
    Blank,
    Valid(Superblock),
    Invalid(String),
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(SUPERBLOCK_MAGIC)
            .u32(self.version)
            .u32(self.role as u32)
            .bytes(&self.group);
        w.u32(self.device_index)
            .u32(self.capacity_devices)
            .u32(BLOCK as u32);
        w.u64(self.device_size_bytes).u64(self.segment_size_bytes);
        w.u64(self.checkpoint_offsets[0])
            .u64(self.checkpoint_offsets[1])
            .u64(self.checkpoint_size_bytes);
        w.u64(self.log_offset)
            .u64(self.log_size_bytes)
            .u64(self.segments_offset)
            .u64(self.segment_count)
            .u32(self.stamp);
        let mut b = w.pad_to(BLOCK).buf.clone();
        seal_crc(&mut b, BLOCK - 4);
        b
    }

    pub fn decode(b: &[u8]) -> SuperblockRead {
        if b.iter().all(|&x| x == 0) {
            return SuperblockRead::Blank;
        }
        match Self::decode_inner(b) {
            Ok(sb) => SuperblockRead::Valid(sb),
            Err(e) => SuperblockRead::Invalid(e.to_string()),
        }
    }

    fn decode_inner(b: &[u8]) -> Result<Superblock, EngineError> {
        let mut r = Reader::new(b);
        if r.bytes(8)? != SUPERBLOCK_MAGIC {
            return Err(EngineError::Format(
                "not a Strata device (bad superblock magic)".into(),
            ));
        }
        let version = r.u32()?;
        if version > GROUP_VERSION {
            return Err(EngineError::Format(format!(
                "formatted by a newer Strata (format version {version}; this build reads formats {GROUP_VERSION_MIN} and {GROUP_VERSION})"
            )));
        }
        if version < GROUP_VERSION_MIN {
            return Err(EngineError::Format(format!(
                "formatted by an older Strata (format version {version}; this build reads formats {GROUP_VERSION_MIN} and {GROUP_VERSION}): copy the volumes off with the older build, then reformat"
            )));
        }
        if b.len() < BLOCK || !check_crc(&b[..BLOCK], BLOCK - 4) {
            return Err(EngineError::Format("superblock checksum mismatch".into()));
        }
        let role = match r.u32()? {
            1 => Role::Fast,
            2 => Role::Capacity,
            x => return Err(EngineError::Format(format!("unknown device role {x}"))),
        };
        let group = r.uuid()?;
        let device_index = r.u32()?;
        let capacity_devices = r.u32()?;
        if r.u32()? != BLOCK as u32 {
            return Err(EngineError::Format("unsupported block size".into()));
        }
        Ok(Superblock {
            version,
            role,
            group,
            device_index,
            capacity_devices,
            device_size_bytes: r.u64()?,
            segment_size_bytes: r.u64()?,
            checkpoint_offsets: [r.u64()?, r.u64()?],
            checkpoint_size_bytes: r.u64()?,
            log_offset: r.u64()?,
            log_size_bytes: r.u64()?,
            segments_offset: r.u64()?,
            segment_count: r.u64()?,
            // Padding (zero) in superblocks written before stamps.
            stamp: r.u32()?,
        })
    }
}

/// Most devices whose wear a checkpoint carries (a bound on what a corrupt count can ask).
pub const MAX_WEAR_DEVICES: u32 = 1024;
/// Bounds on what a checkpoint may list (a corrupt count cannot make the decoder allocate more).
pub const MAX_LAYERS: u32 = 65_536;
pub const MAX_RECORDS: u32 = 65_536;
pub const MAX_RECENT_SEGMENTS: u32 = 4096;
pub const MAX_SEGTAB_PAGES: u32 = 8192;
pub const MAX_POLICY_BYTES: usize = 256;

/// A page written twice (copy A and copy B), as (segment << 32) | block for each copy.
pub use crate::ctree::PagePtr;

/// One layer: a set of blocks over an optional parent (a volume's head, a snapshot, a
/// clone's base). Log records and segment summaries name layers, not volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRecord {
    pub id: u32,
    /// 0: none.
    pub parent: u32,
    pub flags: u32,
}

/// The layer is being removed: its blocks are being released (no volume or snapshot uses it).
pub const LAYER_DELETED: u32 = 1;
/// The layer's blocks are moving into its only child (a deleted snapshot under a live one).
pub const LAYER_MERGING: u32 = 2;

/// One volume as the checkpoint records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    pub id: u32,
    /// The layer writes go to.
    pub head: u32,
    pub size_bytes: u64,
    pub created_unix_s: u64,
    pub name: String,
    /// The volume's tiering policy, encoded by the engine (empty: defaults).
    pub policy: Vec<u8>,
}

/// A read-only, point-in-time image of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub id: u32,
    pub volume: u32,
    pub layer: u32,
    pub size_bytes: u64,
    pub created_unix_s: u64,
    pub name: String,
}

/// A device's lifetime write total as of a checkpoint, for endurance accounting. Bytes are
/// counted as the device saw them (log, checkpoints, segments, summaries, index pages, GC), so
/// Strata's own write amplification is included. Writes after the last checkpoint are not: a
/// crash loses at most the writes since then from the count, never data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceWear {
    pub bytes_written_total: u64,
    /// When the disk group first used the device (its format time); 0 = unknown.
    pub first_use_unix_s: u64,
}

/// Where an index page stream appends next: (segment, next block). u32::MAX: no segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPos {
    pub seg: u32,
    pub next_block: u32,
}

impl StreamPos {
    pub const NONE: StreamPos = StreamPos {
        seg: u32::MAX,
        next_block: 0,
    };
}

/// The fast device's mutable metadata, stored twice (both copies on every update). It is the
/// commit point of everything: the log tail, the durable index, and the volume table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub group: Uuid,
    pub generation: u64,
    /// Recovery starts replaying the log here (a byte offset inside the log area) ...
    pub log_tail_offset: u64,
    /// ... expecting a batch whose first record has this sequence number ...
    pub log_tail_seq: u64,
    /// ... and batches whose epoch never decreases (bumped at every open).
    pub epoch: u32,
    /// The sequence number after the last record acknowledged when it was written, so recovery
    /// knows every record before it must be there: written by a clean shutdown (the log's end)
    /// and by the destager after a second with nothing acknowledged. 0: not known.
    pub log_end_seq: u64,
    pub next_id: u32,
    /// How many index flushes made this index (0 at format).
    pub index_generation: u64,
    pub next_segment_seq: u64,
    /// The index tree's root page; None: empty.
    pub index_root: Option<PagePtr>,
    /// The segment table's pages, in order; None: all free.
    pub segtab: Vec<Option<PagePtr>>,
    /// Index page streams A and B.
    pub streams: [StreamPos; 2],
    /// Data segments sealed since the index was last written: recovery applies their
    /// summaries over the index.
    pub recent: Vec<u32>,
    pub layers: Vec<LayerRecord>,
    pub volumes: Vec<VolumeRecord>,
    pub snapshots: Vec<SnapshotRecord>,
    /// One per device, fast first, then the capacity devices in index order.
    pub wear: Vec<DeviceWear>,
    /// The stamps (`Superblock::stamp`, inclusive range) the capacity devices may carry: a
    /// device below it is older than this metadata, one above it is newer. None: a checkpoint
    /// written before stamps (or by a build without them), which checks nothing.
    pub device_stamps: Option<(u32, u32)>,
    /// The part of the batch at the log tail already on the capacity tier (a destage stripe
    /// took it and was committed; the rest waits for the next stripe). Replay leaves it out
    /// of the fast maps. None: the tail batch is whole in the log. Written after the stamps,
    /// so a checkpoint without stamps has none.
    pub tail_destaged: Option<TailPart>,
}

/// Where the destaged first part of the log's tail batch ends: its records before the one
/// with sequence number `seq`, and the first `block` blocks of that one, are on the capacity
/// tier. `block` may be 0; it is below the record's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailPart {
    pub seq: u64,
    pub block: u64,
}

impl TailPart {
    /// The part of record `seq` (of `nblocks` blocks) still only in the log, as (first block
    /// offset, blocks); None when all of it is on the capacity tier.
    pub fn rest_of(&self, seq: u64, nblocks: u64) -> Option<(u64, u64)> {
        match seq.cmp(&self.seq) {
            std::cmp::Ordering::Less => None,
            std::cmp::Ordering::Equal => {
                (self.block < nblocks).then(|| (self.block, nblocks - self.block))
            }
            std::cmp::Ordering::Greater => Some((0, nblocks)),
        }
    }
}

fn put_name(p: &mut Writer, name: &str) {
    let b = name.as_bytes();
    p.u16(b.len() as u16).bytes(b);
}

fn get_name(p: &mut Reader<'_>) -> Result<String, EngineError> {
    let len = p.u16()? as usize;
    Ok(String::from_utf8_lossy(p.bytes(len)?).into_owned())
}

fn put_ptr(p: &mut Writer, ptr: Option<PagePtr>) {
    let ptr = ptr.unwrap_or(PagePtr {
        a: u64::MAX,
        b: u64::MAX,
    });
    p.u64(ptr.a).u64(ptr.b);
}

fn get_ptr(p: &mut Reader<'_>) -> Result<Option<PagePtr>, EngineError> {
    let (a, b) = (p.u64()?, p.u64()?);
    Ok((a != u64::MAX).then_some(PagePtr { a, b }))
}

/// A count read from a checkpoint, refused above `max`.
fn get_count(p: &mut Reader<'_>, max: u32, what: &str) -> Result<u32, EngineError> {
    let n = p.u32()?;
    if n > max {
        return Err(EngineError::Format(format!(
            "{what} count {n} is beyond the limit {max}"
        )));
    }
    Ok(n)
}

impl Checkpoint {
    fn encode_payload(&self) -> Writer {
        let mut p = Writer::default();
        p.u32(self.next_id)
            .u32(self.epoch)
            .u64(self.index_generation)
            .u64(self.next_segment_seq)
            .u64(self.log_end_seq);
        put_ptr(&mut p, self.index_root);
        for s in &self.streams {
            p.u32(s.seg).u32(s.next_block);
        }
        p.u32(self.segtab.len() as u32);
        for ptr in &self.segtab {
            put_ptr(&mut p, *ptr);
        }
        p.u32(self.recent.len() as u32);
        for s in &self.recent {
            p.u32(*s);
        }
        p.u32(self.layers.len() as u32);
        for l in &self.layers {
            p.u32(l.id).u32(l.parent).u32(l.flags);
        }
        p.u32(self.volumes.len() as u32);
        for v in &self.volumes {
            p.u32(v.id)
                .u32(v.head)
                .u64(v.size_bytes)
                .u64(v.created_unix_s);
            put_name(&mut p, &v.name);
            p.u16(v.policy.len() as u16).bytes(&v.policy);
        }
        p.u32(self.snapshots.len() as u32);
        for s in &self.snapshots {
            p.u32(s.id)
                .u32(s.volume)
                .u32(s.layer)
                .u64(s.size_bytes)
                .u64(s.created_unix_s);
            put_name(&mut p, &s.name);
        }
        p.u32(self.wear.len() as u32);
        for w in &self.wear {
            p.u64(w.bytes_written_total).u64(w.first_use_unix_s);
        }
        // After the wear records, where a build from before stamps stops reading.
        if let Some((low, high)) = self.device_stamps {
            p.u32(low).u32(high);
            // After the stamps, where a build from before split batches stops reading.
            if let Some(t) = self.tail_destaged {
                p.u64(t.seq).u64(t.block);
            }
        }
        p
    }

    /// Refuses what the decoder would refuse: a checkpoint that cannot be read back is never
    /// written.
    fn check_limits(&self) -> Result<(), EngineError> {
        let over = |n: usize, max: u32, what: &str| {
            if n > max as usize {
                Err(EngineError::InvalidArgument(format!(
                    "the metadata would hold {n} {what}, more than the {max} it can record"
                )))
            } else {
                Ok(())
            }
        };
        over(self.segtab.len(), MAX_SEGTAB_PAGES, "segment table pages")?;
        over(self.recent.len(), MAX_RECENT_SEGMENTS, "recent segments")?;
        over(self.layers.len(), MAX_LAYERS, "layers")?;
        over(self.volumes.len(), MAX_RECORDS, "volumes")?;
        over(self.snapshots.len(), MAX_RECORDS, "snapshots")?;
        over(self.wear.len(), MAX_WEAR_DEVICES, "devices")?;
        if self
            .volumes
            .iter()
            .any(|v| v.policy.len() > MAX_POLICY_BYTES)
        {
            return Err(EngineError::InvalidArgument(format!(
                "a volume policy is longer than {MAX_POLICY_BYTES} bytes"
            )));
        }
        Ok(())
    }

    /// Bytes of the payload (the header adds 64).
    pub fn payload_len(&self) -> usize {
        self.encode_payload().buf.len()
    }

    pub fn encode(&self, area_bytes: usize) -> Result<Vec<u8>, EngineError> {
        self.check_limits()?;
        let p = self.encode_payload();
        let mut w = Writer::default();
        w.bytes(CHECKPOINT_MAGIC)
            .u32(FORMAT_VERSION)
            .bytes(&self.group)
            .u64(self.generation);
        w.u64(self.log_tail_offset).u64(self.log_tail_seq);
        w.u32(p.buf.len() as u32).u32(crc32c::crc32c(&p.buf)).u32(0);
        let header_len = w.buf.len();
        w.bytes(&p.buf);
        let total = w.buf.len().div_ceil(BLOCK) * BLOCK;
        if total > area_bytes {
            return Err(EngineError::InvalidArgument(format!(
                "the volume table is full: it would take {total} bytes of metadata, {area_bytes} are available; delete volumes or snapshots"
            )));
        }
        let mut b = w.pad_to(total).buf.clone();
        // The header crc covers the header only; the payload has its own crc.
        let mut h = b[..header_len].to_vec();
        seal_crc(&mut h, header_len - 4);
        b[..header_len].copy_from_slice(&h);
        Ok(b)
    }

    /// Decodes a copy; an error saying why if it is blank, torn, foreign or corrupt.
    pub fn decode(b: &[u8], group: &Uuid) -> Result<Checkpoint, String> {
        let mut r = Reader::new(b);
        let e = |x: EngineError| x.to_string();
        if r.bytes(8).map_err(e)? != CHECKPOINT_MAGIC {
            return Err("bad magic".into());
        }
        let version = r.u32().map_err(e)?;
        if version != FORMAT_VERSION {
            return Err(format!(
                "format version {version}, this build reads {FORMAT_VERSION}"
            ));
        }
        let g = r.uuid().map_err(e)?;
        let generation = r.u64().map_err(e)?;
        let log_tail_offset = r.u64().map_err(e)?;
        let log_tail_seq = r.u64().map_err(e)?;
        let payload_len = r.u32().map_err(e)? as usize;
        let payload_crc = r.u32().map_err(e)?;
        let _ = r.u32().map_err(e)?;
        let header_len = r.pos();
        if !check_crc(&b[..header_len], header_len - 4) {
            return Err("header checksum mismatch".into());
        }
        if &g != group {
            return Err("belongs to another disk group".into());
        }
        let payload = r.bytes(payload_len).map_err(e)?;
        if crc32c::crc32c(payload) != payload_crc {
            return Err("payload checksum mismatch".into());
        }
        let mut cp = Checkpoint::decode_payload(payload).map_err(e)?;
        cp.group = g;
        cp.generation = generation;
        cp.log_tail_offset = log_tail_offset;
        cp.log_tail_seq = log_tail_seq;
        Ok(cp)
    }

    fn decode_payload(payload: &[u8]) -> Result<Checkpoint, EngineError> {
        let mut p = Reader::new(payload);
        let (next_id, epoch) = (p.u32()?, p.u32()?);
        let (index_generation, next_segment_seq, log_end_seq) = (p.u64()?, p.u64()?, p.u64()?);
        let index_root = get_ptr(&mut p)?;
        let mut streams = [StreamPos::NONE; 2];
        for s in &mut streams {
            *s = StreamPos {
                seg: p.u32()?,
                next_block: p.u32()?,
            };
        }
        let n = get_count(&mut p, MAX_SEGTAB_PAGES, "segment table page")?;
        let segtab = (0..n)
            .map(|_| get_ptr(&mut p))
            .collect::<Result<Vec<_>, _>>()?;
        let n = get_count(&mut p, MAX_RECENT_SEGMENTS, "recent segment")?;
        let recent = (0..n).map(|_| p.u32()).collect::<Result<Vec<_>, _>>()?;
        let n = get_count(&mut p, MAX_LAYERS, "layer")?;
        let layers = (0..n)
            .map(|_| {
                Ok(LayerRecord {
                    id: p.u32()?,
                    parent: p.u32()?,
                    flags: p.u32()?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let n = get_count(&mut p, MAX_RECORDS, "volume")?;
        let mut volumes = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let (id, head, size_bytes, created_unix_s) = (p.u32()?, p.u32()?, p.u64()?, p.u64()?);
            let name = get_name(&mut p)?;
            let plen = p.u16()? as usize;
            if plen > MAX_POLICY_BYTES {
                return Err(EngineError::Format(format!(
                    "volume policy of {plen} bytes is beyond the limit"
                )));
            }
            let policy = p.bytes(plen)?.to_vec();
            volumes.push(VolumeRecord {
                id,
                head,
                size_bytes,
                created_unix_s,
                name,
                policy,
            });
        }
        let n = get_count(&mut p, MAX_RECORDS, "snapshot")?;
        let mut snapshots = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let (id, volume, layer, size_bytes, created_unix_s) =
                (p.u32()?, p.u32()?, p.u32()?, p.u64()?, p.u64()?);
            snapshots.push(SnapshotRecord {
                id,
                volume,
                layer,
                size_bytes,
                created_unix_s,
                name: get_name(&mut p)?,
            });
        }
        let n = get_count(&mut p, MAX_WEAR_DEVICES, "device")?;
        let wear = (0..n)
            .map(|_| {
                Ok(DeviceWear {
                    bytes_written_total: p.u64()?,
                    first_use_unix_s: p.u64()?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let device_stamps = match p.pos() == payload.len() {
            true => None,
            false => Some((p.u32()?, p.u32()?)),
        };
        let tail_destaged = match p.pos() == payload.len() {
            true => None,
            false => Some(TailPart {
                seq: p.u64()?,
                block: p.u64()?,
            }),
        };
        Ok(Checkpoint {
            group: [0; 16],
            generation: 0,
            log_tail_offset: 0,
            log_tail_seq: 0,
            epoch,
            log_end_seq,
            next_id,
            index_generation,
            next_segment_seq,
            index_root,
            segtab,
            streams,
            recent,
            layers,
            volumes,
            snapshots,
            wear,
            device_stamps,
            tail_destaged,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// Data follows in the batch.
    Write = 0,
    /// The range reads as zeros from now on (WRITE_ZEROES, TRIM); no data.
    Zero = 1,
    /// A clean copy of capacity-tier blocks (the read cache): the layer field holds the
    /// segment, the offset the first block. Data follows; replay ignores it.
    Cache = 2,
    /// The range was written straight to the capacity tier (a sequential write bypassing the
    /// log; see bypass.rs): log copies older than this record are stale. No data.
    Forget = 3,
}

/// One record header inside a log batch (64 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub seq: u64,
    /// The layer the record belongs to (a volume's head layer when it was written).
    pub layer: u32,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    pub data_crc: u32,
}

pub const RECORD_HEADER_BYTES: usize = 64;
pub const BATCH_HEADER_BYTES: usize = 64;
/// Records per batch: one header block holds them all, clear of the block's trailing crc.
pub const MAX_RECORDS_PER_BATCH: usize = (BLOCK - BATCH_HEADER_BYTES - 4) / RECORD_HEADER_BYTES;

impl RecordHeader {
    /// Written in place, with no allocation: a batch header encodes up to 62 of them, and a
    /// run's header copy all of its records again for every write.
    pub fn encode(&self, out: &mut [u8]) {
        let b = &mut out[..RECORD_HEADER_BYTES];
        b.fill(0);
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&(FORMAT_VERSION as u16).to_le_bytes());
        b[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.layer.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset_bytes.to_le_bytes());
        b[32..40].copy_from_slice(&self.len_bytes.to_le_bytes());
        b[40..44].copy_from_slice(&self.data_crc.to_le_bytes());
        seal_crc(b, RECORD_HEADER_BYTES - 4);
    }

    pub fn decode(b: &[u8]) -> Option<RecordHeader> {
        if b.len() < RECORD_HEADER_BYTES
            || !check_crc(&b[..RECORD_HEADER_BYTES], RECORD_HEADER_BYTES - 4)
        {
            return None;
        }
        let mut r = Reader::new(b);
        if r.u32().ok()? != RECORD_MAGIC || u32::from(r.u16().ok()?) != FORMAT_VERSION {
            return None;
        }
        let kind = match r.u16().ok()? {
            0 => RecordKind::Write,
            1 => RecordKind::Zero,
            2 => RecordKind::Cache,
            3 => RecordKind::Forget,
            _ => return None,
        };
        let seq = r.u64().ok()?;
        let layer = r.u32().ok()?;
        let _ = r.u32().ok()?;
        let offset_bytes = r.u64().ok()?;
        let len_bytes = r.u64().ok()?;
        let data_crc = r.u32().ok()?;
        if offset_bytes % BLOCK_U64 != 0 || len_bytes % BLOCK_U64 != 0 || len_bytes == 0 {
            return None;
        }
        Some(RecordHeader {
            kind,
            seq,
            layer,
            offset_bytes,
            len_bytes,
            data_crc,
        })
    }

    pub fn data_blocks(&self) -> u64 {
        match self.kind {
            RecordKind::Write | RecordKind::Cache => self.len_bytes / BLOCK_U64,
            RecordKind::Zero | RecordKind::Forget => 0,
        }
    }
}

/// The first block of every log batch: batch identity plus all record headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    pub group: Uuid,
    /// The epoch of the opening that wrote it (see `Checkpoint::epoch`).
    pub epoch: u32,
    /// Every record with a lower sequence number was durable and acknowledged when this batch
    /// was written (several batches are written at once; see replay.rs).
    pub committed_seq: u64,
    pub first_seq: u64,
    /// Blocks the batch occupies, header block included (a run: both header copies).
    pub total_blocks: u32,
    pub records: Vec<RecordHeader>,
    /// A run of lone writes (version 3, FORMAT.md §3.3.1): which of its two header copies
    /// this is, 0 at the run's first block, 1 at its third. None: an ordinary batch (version 2).
    pub run_copy: Option<u32>,
    /// When it was written, in wall-clock seconds since the Unix epoch (0: not known, as in
    /// batches of builds before this field): replay gives its data that age.
    pub written_unix_s: u32,
}

/// The header version of a run of lone writes (FORMAT.md §3.3.1); ordinary batches keep
/// `FORMAT_VERSION`.
pub const RUN_HEADER_VERSION: u32 = 3;
/// In a run, where the second header copy lives, from the run's first block: after the first
/// copy and the first record's one data block.
pub const RUN_SECOND_COPY: u64 = 2;

/// Where record `i` of a batch starts, in blocks from the batch's first block, given the data
/// blocks of the records before it: after the header block, and in a run, past record 0,
/// after the second header copy too.
pub fn record_data_offset(run: bool, i: usize, blocks_before: u64) -> u64 {
    1 + blocks_before + u64::from(run && i >= 1)
}

/// Blocks a batch takes for records holding `data` blocks in all: a run of more than one
/// record holds a second header copy.
pub fn batch_total_blocks(run: bool, records: usize, data: u64) -> u64 {
    1 + data + u64::from(run && records >= 2)
}

/// The header copy of a run that holds `records` records: odd counts live in copy 0, even
/// ones in copy 1, so each extension writes over the older copy.
pub fn run_copy_for(records: usize) -> u32 {
    u32::from(records.is_multiple_of(2))
}

impl BatchHeader {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK];
        let mut w = Writer::default();
        let version = match self.run_copy {
            Some(_) => RUN_HEADER_VERSION,
            None => FORMAT_VERSION,
        };
        w.bytes(BATCH_MAGIC)
            .u32(version)
            .bytes(&self.group)
            .u64(self.first_seq);
        w.u32(self.total_blocks)
            .u32(self.records.len() as u32)
            .u32(self.epoch)
            .u64(self.committed_seq)
            .u32(self.run_copy.unwrap_or(0))
            .u32(self.written_unix_s);
        b[..w.buf.len()].copy_from_slice(&w.buf);
        for (i, rec) in self.records.iter().enumerate() {
            let at = BATCH_HEADER_BYTES + i * RECORD_HEADER_BYTES;
            rec.encode(&mut b[at..at + RECORD_HEADER_BYTES]);
        }
        seal_crc(&mut b, BLOCK - 4);
        b
    }

    /// A valid header of this group, or None (blank, torn, stale format or foreign).
    pub fn decode(b: &[u8], group: &Uuid) -> Option<BatchHeader> {
        if b.len() < BLOCK || !check_crc(&b[..BLOCK], BLOCK - 4) {
            return None;
        }
        BatchHeader::decode_parts(b, group)
    }

    /// The header as its parts read, the block's own crc not checked: each record header
    /// still checks its crc, the records continue the batch's sequence and fill its blocks.
    /// For a header whose block fails its crc (`replay::salvage`): what is not covered by a
    /// crc of its own (the first 64 bytes) is only checked for agreeing with the rest.
    pub fn decode_parts(b: &[u8], group: &Uuid) -> Option<BatchHeader> {
        if b.len() < BLOCK {
            return None;
        }
        let mut r = Reader::new(b);
        if r.bytes(8).ok()? != BATCH_MAGIC {
            return None;
        }
        let run = match r.u32().ok()? {
            FORMAT_VERSION => false,
            RUN_HEADER_VERSION => true,
            _ => return None,
        };
        if &r.uuid().ok()? != group {
            return None;
        }
        let first_seq = r.u64().ok()?;
        let total_blocks = r.u32().ok()?;
        let n = r.u32().ok()? as usize;
        let epoch = r.u32().ok()?;
        let committed_seq = r.u64().ok()?;
        let copy = r.u32().ok()?;
        let written_unix_s = r.u32().ok()?;
        if n == 0 || n > MAX_RECORDS_PER_BATCH {
            return None;
        }
        let run_copy = match run {
            true if copy == run_copy_for(n) => Some(copy),
            true => return None,
            false => None,
        };
        let mut records = Vec::with_capacity(n);
        for i in 0..n {
            let at = BATCH_HEADER_BYTES + i * RECORD_HEADER_BYTES;
            let rec = RecordHeader::decode(&b[at..at + RECORD_HEADER_BYTES])?;
            if rec.seq != first_seq + i as u64 {
                return None;
            }
            records.push(rec);
        }
        // A run holds host writes only, and its first record one block (so its second header
        // copy has a fixed place).
        if run
            && (records.iter().any(|r| r.kind != RecordKind::Write)
                || records[0].data_blocks() != 1)
        {
            return None;
        }
        let data: u64 = records.iter().map(|r| r.data_blocks()).sum();
        if batch_total_blocks(run, n, data) != u64::from(total_blocks) {
            return None;
        }
        Some(BatchHeader {
            group: *group,
            epoch,
            committed_seq,
            first_seq,
            total_blocks,
            records,
            run_copy,
            written_unix_s,
        })
    }
}

/// What a segment holds: one entry per run of blocks that share a volume, an address run and a
/// sequence number, or a zero ("tombstone") run with no data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SummaryEntry {
    pub kind: RecordKind,
    pub layer: u32,
    pub lba: u64,
    pub nblocks: u32,
    pub seq: u64,
    /// Index of the first data block inside the segment (Write entries only).
    pub data_block: u32,
}

pub const SUMMARY_ENTRY_BYTES: usize = 32;
pub const SUMMARY_HEADER_BYTES: usize = 64;

/// Block crcs per crc block: the block's own crc takes the last four bytes.
pub const CRCS_PER_BLOCK: usize = BLOCK / 4 - 1;

/// Sizes of a segment's parts, fixed by the segment size and the group's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentGeometry {
    pub segment_blocks: u32,
    pub data_blocks: u32,
    /// One copy of the summary area: crc blocks, then header and entries.
    pub summary_blocks: u32,
    /// Crc blocks at the start of a summary area (one per `CRCS_PER_BLOCK` data blocks).
    pub crc_blocks: u32,
    pub max_entries: u32,
    /// Copies of the summary area in a data segment: 2 (format 3), or 1 (format 2).
    pub summary_copies: u32,
}

impl SegmentGeometry {
    /// The geometry of a group of format `version` (the superblock's).
    pub fn for_version(segment_size_bytes: u64, version: u32) -> SegmentGeometry {
        SegmentGeometry::new(segment_size_bytes, if version >= 3 { 2 } else { 1 })
    }

    pub fn new(segment_size_bytes: u64, summary_copies: u32) -> SegmentGeometry {
        debug_assert!((1..=2).contains(&summary_copies));
        let segment_blocks = (segment_size_bytes / BLOCK_U64) as u32;
        // Each data block needs a crc and at most one entry; tombstones share the entry
        // budget, which is why max_entries equals the data block count.
        let mut summary_blocks = 1u32;
        loop {
            let data = segment_blocks - summary_copies * summary_blocks;
            let crc_blocks = (data as usize).div_ceil(CRCS_PER_BLOCK) as u32;
            let entry_blocks =
                (SUMMARY_HEADER_BYTES + data as usize * SUMMARY_ENTRY_BYTES).div_ceil(BLOCK) as u32;
            if crc_blocks + entry_blocks <= summary_blocks {
                return SegmentGeometry {
                    segment_blocks,
                    data_blocks: data,
                    summary_blocks,
                    crc_blocks,
                    max_entries: data,
                    summary_copies,
                };
            }
            summary_blocks += 1;
        }
    }

    /// The block of the segment where data block 0 is: right after copy B, when there is one.
    pub fn data_start(&self) -> u32 {
        if self.summary_copies == 2 {
            self.summary_blocks
        } else {
            0
        }
    }

    /// The block of the segment where summary copy `copy` starts: copy A (0) at the tail,
    /// where a group of format 2 has its only copy, and copy B (1) at the head, the far end.
    pub fn summary_start(&self, copy: u32) -> u32 {
        debug_assert!(copy < self.summary_copies);
        match copy {
            0 => self.segment_blocks - self.summary_blocks,
            _ => 0,
        }
    }
}

/// Crc blocks holding crcs of a segment's `used` data blocks: the only ones sealed and read.
pub fn crc_blocks_used(used: u32) -> u32 {
    (used as usize).div_ceil(CRCS_PER_BLOCK) as u32
}

/// The summary at the end of every segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSummary {
    pub group: Uuid,
    /// Increases with every segment written in the disk group: orders segments in time.
    pub segment_seq: u64,
    pub segment_index: u32,
    pub data_blocks_used: u32,
    pub entries: Vec<SummaryEntry>,
    /// crc32c of each data block, in segment order.
    pub block_crcs: Vec<u32>,
}

/// The seal of crc block `idx` of segment `seg`: its crc also covers where it belongs, so a
/// crc block found in another segment's or position's place does not check.
fn seal_crc_block(b: &mut [u8], seg: u32, idx: u32) {
    b[BLOCK - 4..].fill(0);
    let c = crc32c::crc32c_append(
        crc32c::crc32c(&b[..BLOCK - 4]),
        &[&seg.to_le_bytes()[..], &idx.to_le_bytes()[..]].concat(),
    );
    b[BLOCK - 4..].copy_from_slice(&c.to_le_bytes());
}

/// The crcs in crc block `idx` of segment `seg`, if the block checks.
pub fn decode_crc_block(b: &[u8], seg: u32, idx: u32) -> Option<Vec<u32>> {
    if b.len() < BLOCK {
        return None;
    }
    let stored = u32::from_le_bytes([b[BLOCK - 4], b[BLOCK - 3], b[BLOCK - 2], b[BLOCK - 1]]);
    let c = crc32c::crc32c_append(
        crc32c::crc32c(&b[..BLOCK - 4]),
        &[&seg.to_le_bytes()[..], &idx.to_le_bytes()[..]].concat(),
    );
    (c == stored).then(|| {
        b[..BLOCK - 4]
            .chunks(4)
            .map(|x| u32::from_le_bytes([x[0], x[1], x[2], x[3]]))
            .collect()
    })
}

impl SegmentSummary {
    /// The whole summary area: the crc blocks, then the header and entries (sealed by the
    /// header's crc).
    pub fn encode(&self, geo: &SegmentGeometry) -> Vec<u8> {
        let crc_bytes = geo.crc_blocks as usize * BLOCK;
        let mut out = vec![0u8; geo.summary_blocks as usize * BLOCK];
        for (idx, chunk) in self.block_crcs.chunks(CRCS_PER_BLOCK).enumerate() {
            let b = &mut out[idx * BLOCK..(idx + 1) * BLOCK];
            for (k, c) in chunk.iter().enumerate() {
                b[k * 4..k * 4 + 4].copy_from_slice(&c.to_le_bytes());
            }
            seal_crc_block(b, self.segment_index, idx as u32);
        }
        let mut w = Writer::default();
        w.bytes(SUMMARY_MAGIC)
            .u32(FORMAT_VERSION)
            .bytes(&self.group)
            .u64(self.segment_seq);
        w.u32(self.segment_index)
            .u32(self.data_blocks_used)
            .u32(self.entries.len() as u32)
            .u32(0);
        w.pad_to(SUMMARY_HEADER_BYTES);
        for e in &self.entries {
            w.u8(e.kind as u8)
                .u8(0)
                .u16(0)
                .u32(e.layer)
                .u64(e.lba)
                .u32(e.nblocks)
                .u64(e.seq);
            w.u32(e.data_block);
        }
        let head = &mut out[crc_bytes..];
        head[..w.buf.len()].copy_from_slice(&w.buf);
        // The crc sits at a fixed place in the header and covers the header and entries area.
        seal_crc(head, 48);
        out
    }

    /// The summary from its copies (each one copy's area as read, an unreadable block left as
    /// zeros). The header and entries region and each crc block in use are each taken from
    /// the first copy where they check, so damage to different parts of the two copies loses
    /// nothing. None when a part checks in no copy, or the header names another segment.
    pub fn decode(
        copies: &[&[u8]],
        group: &Uuid,
        geo: &SegmentGeometry,
        seg: u32,
    ) -> Option<SegmentSummary> {
        let mut s = copies
            .iter()
            .find_map(|b| Self::decode_head(b, group, geo, seg))?;
        let used = s.data_blocks_used as usize;
        s.block_crcs.reserve(used);
        for idx in 0..crc_blocks_used(s.data_blocks_used) {
            let at = idx as usize * BLOCK..(idx as usize + 1) * BLOCK;
            let crcs = copies
                .iter()
                .find_map(|b| decode_crc_block(b.get(at.clone())?, seg, idx))?;
            let take = (used - s.block_crcs.len()).min(CRCS_PER_BLOCK);
            s.block_crcs.extend_from_slice(&crcs[..take]);
        }
        Some(s)
    }

    /// The header and entries region of one copy of the area, if it checks and names segment
    /// `seg` (its `block_crcs` left empty).
    pub fn decode_head(
        b: &[u8],
        group: &Uuid,
        geo: &SegmentGeometry,
        seg: u32,
    ) -> Option<SegmentSummary> {
        let crc_bytes = geo.crc_blocks as usize * BLOCK;
        if b.len() < geo.summary_blocks as usize * BLOCK
            || !check_crc(&b[crc_bytes..geo.summary_blocks as usize * BLOCK], 48)
        {
            return None;
        }
        let head = &b[crc_bytes..];
        let mut r = Reader::new(head);
        if r.bytes(8).ok()? != SUMMARY_MAGIC
            || r.u32().ok()? != FORMAT_VERSION
            || &r.uuid().ok()? != group
        {
            return None;
        }
        let segment_seq = r.u64().ok()?;
        let segment_index = r.u32().ok()?;
        let used = r.u32().ok()?;
        let n = r.u32().ok()?;
        if segment_index != seg || used > geo.data_blocks || n > geo.max_entries {
            return None;
        }
        let mut r = Reader::new(&head[SUMMARY_HEADER_BYTES..]);
        let mut entries = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let kind = match r.u8().ok()? {
                0 => RecordKind::Write,
                1 => RecordKind::Zero,
                _ => return None,
            };
            r.bytes(3).ok()?;
            let e = SummaryEntry {
                kind,
                layer: r.u32().ok()?,
                lba: r.u64().ok()?,
                nblocks: r.u32().ok()?,
                seq: r.u64().ok()?,
                data_block: r.u32().ok()?,
            };
            let end = u64::from(e.data_block) + u64::from(e.nblocks);
            if e.nblocks == 0 || (kind == RecordKind::Write && end > u64::from(used)) {
                return None;
            }
            entries.push(e);
        }
        Some(SegmentSummary {
            group: *group,
            segment_seq,
            segment_index,
            data_blocks_used: used,
            entries,
            block_crcs: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trip_and_rejections() {
        let sb = Superblock {
            version: GROUP_VERSION,
            role: Role::Capacity,
            group: [7; 16],
            device_index: 2,
            capacity_devices: 3,
            device_size_bytes: 1 << 30,
            segment_size_bytes: 8 << 20,
            checkpoint_offsets: [0, 0],
            checkpoint_size_bytes: 0,
            log_offset: 0,
            log_size_bytes: 0,
            segments_offset: 1 << 20,
            segment_count: 100,
            stamp: 6,
        };
        let mut b = sb.encode();
        // The stamp sits at offset 116, in what was padding.
        assert_eq!(b[116..120], 6u32.to_le_bytes());
        assert!(matches!(Superblock::decode(&b), SuperblockRead::Valid(x) if x == sb));
        assert!(matches!(
            Superblock::decode(&[0u8; BLOCK]),
            SuperblockRead::Blank
        ));
        b[100] ^= 1;
        assert!(matches!(Superblock::decode(&b), SuperblockRead::Invalid(_)));
        let mut newer = sb.encode();
        newer[8..12].copy_from_slice(&99u32.to_le_bytes());
        match Superblock::decode(&newer) {
            SuperblockRead::Invalid(m) => assert!(m.contains("newer"), "{m}"),
            _ => panic!("newer format accepted"),
        }
        // Format 2 (one summary copy) is still read, as itself; format 1 is not.
        let two = Superblock {
            version: 2,
            ..sb.clone()
        };
        assert!(matches!(Superblock::decode(&two.encode()), SuperblockRead::Valid(x) if x == two));
        let one = Superblock { version: 1, ..sb };
        match Superblock::decode(&one.encode()) {
            SuperblockRead::Invalid(m) => assert!(m.contains("older"), "{m}"),
            _ => panic!("format 1 accepted"),
        }
    }

    /// The geometries docs/FORMAT.md §3.7 gives, and where each part of a segment is.
    #[test]
    fn segment_geometry_with_one_and_two_summary_copies() {
        let parts = |mib: u64, copies| {
            let g = SegmentGeometry::new(mib << 20, copies);
            assert_eq!(
                g.segment_blocks,
                g.data_blocks + copies * g.summary_blocks,
                "{g:?}"
            );
            assert!(
                g.crc_blocks * CRCS_PER_BLOCK as u32 >= g.data_blocks,
                "{g:?}"
            );
            (g.summary_blocks, g.crc_blocks, g.data_blocks)
        };
        assert_eq!(parts(1, 1), (3, 1, 253));
        assert_eq!(parts(8, 1), (18, 2, 2030));
        assert_eq!(parts(1024, 1), (2286, 255, 259858));
        assert_eq!(parts(1, 2), (3, 1, 250));
        assert_eq!(parts(2, 2), (5, 1, 502));
        assert_eq!(parts(4, 2), (9, 1, 1006));
        assert_eq!(parts(8, 2), (18, 2, 2012));
        assert_eq!(parts(1024, 2), (2265, 252, 257614));
        // Format 2: data from block 0, the one copy at the tail. Format 3: copy B at the
        // head, the data after it, copy A at the tail.
        let one = SegmentGeometry::for_version(8 << 20, 2);
        assert_eq!((one.data_start(), one.summary_start(0)), (0, 2030));
        let two = SegmentGeometry::for_version(8 << 20, GROUP_VERSION);
        assert_eq!(two.summary_copies, 2);
        assert_eq!(
            (two.summary_start(1), two.data_start(), two.summary_start(0)),
            (0, 18, 2030)
        );
    }

    #[test]
    fn checkpoint_round_trip() {
        let cp = Checkpoint {
            group: [1; 16],
            generation: 9,
            log_tail_offset: 4096 * 10,
            log_tail_seq: 77,
            epoch: 4,
            log_end_seq: 1234,
            next_id: 9,
            index_generation: 12,
            next_segment_seq: 99,
            index_root: Some(PagePtr { a: 1 << 32, b: 7 }),
            segtab: vec![Some(PagePtr { a: 3, b: 4 }), None],
            streams: [
                StreamPos {
                    seg: 5,
                    next_block: 6,
                },
                StreamPos::NONE,
            ],
            recent: vec![8, 2],
            layers: vec![
                LayerRecord {
                    id: 2,
                    parent: 0,
                    flags: 0,
                },
                LayerRecord {
                    id: 5,
                    parent: 2,
                    flags: LAYER_DELETED,
                },
            ],
            volumes: vec![VolumeRecord {
                id: 1,
                head: 5,
                size_bytes: 1 << 33,
                created_unix_s: 5,
                name: "vol0".into(),
                policy: vec![1, 2],
            }],
            snapshots: vec![SnapshotRecord {
                id: 3,
                volume: 1,
                layer: 2,
                size_bytes: 1 << 33,
                created_unix_s: 6,
                name: "s1".into(),
            }],
            wear: vec![
                DeviceWear {
                    bytes_written_total: 1 << 40,
                    first_use_unix_s: 1_700_000_000,
                },
                DeviceWear {
                    bytes_written_total: 12345,
                    first_use_unix_s: 1_700_000_001,
                },
            ],
            device_stamps: Some((3, 4)),
            tail_destaged: Some(TailPart { seq: 80, block: 7 }),
        };
        let b = cp.encode(1 << 20).unwrap();
        assert_eq!(Checkpoint::decode(&b, &[1; 16]).unwrap(), cp);
        assert!(Checkpoint::decode(&b, &[2; 16]).is_err());
        let mut bad = b.clone();
        bad[70] ^= 0x10;
        assert!(Checkpoint::decode(&bad, &[1; 16]).is_err());
        // A checkpoint with the whole tail batch in the log ends after the stamps, and one
        // from before stamps after the wear records: each reads back as it was, and the
        // stamps and the tail's destaged part are the payload's last 8 and 16 bytes.
        let payload_len = |b: &[u8]| u32::from_le_bytes(b[52..56].try_into().unwrap());
        let whole = Checkpoint {
            tail_destaged: None,
            ..cp.clone()
        };
        let b_whole = whole.encode(1 << 20).unwrap();
        assert_eq!(Checkpoint::decode(&b_whole, &[1; 16]).unwrap(), whole);
        assert_eq!(payload_len(&b), payload_len(&b_whole) + 16);
        let old = Checkpoint {
            device_stamps: None,
            ..whole.clone()
        };
        let b_old = old.encode(1 << 20).unwrap();
        assert_eq!(Checkpoint::decode(&b_old, &[1; 16]).unwrap(), old);
        assert_eq!(payload_len(&b_whole), payload_len(&b_old) + 8);
    }

    #[test]
    fn batch_header_round_trip_and_torn_detection() {
        let recs = vec![
            RecordHeader {
                kind: RecordKind::Write,
                seq: 10,
                layer: 1,
                offset_bytes: 8192,
                len_bytes: 8192,
                data_crc: 5,
            },
            RecordHeader {
                kind: RecordKind::Zero,
                seq: 11,
                layer: 1,
                offset_bytes: 0,
                len_bytes: 4096,
                data_crc: 0,
            },
        ];
        let h = BatchHeader {
            group: [3; 16],
            epoch: 2,
            committed_seq: 9,
            first_seq: 10,
            total_blocks: 3,
            records: recs,
            run_copy: None,
            written_unix_s: 1_765_000_000,
        };
        let b = h.encode();
        assert_eq!(BatchHeader::decode(&b, &[3; 16]).unwrap(), h);
        assert!(BatchHeader::decode(&b, &[4; 16]).is_none());
        // The time stamp sits in what was padding (FORMAT.md §3.3): a header of an older
        // build, zeros there, reads as "not known".
        assert_eq!(b[60..64], 1_765_000_000u32.to_le_bytes());
        let mut older = b.clone();
        older[60..64].fill(0);
        seal_crc(&mut older, BLOCK - 4);
        let read = BatchHeader::decode(&older, &[3; 16]).unwrap();
        assert_eq!(read.written_unix_s, 0);
        assert_eq!(read.records, h.records);
        let mut torn = b.clone();
        torn[2000..].fill(0);
        assert!(BatchHeader::decode(&torn, &[3; 16]).is_none());
    }

    #[test]
    fn a_full_batch_header_round_trips() {
        let recs: Vec<_> = (0..MAX_RECORDS_PER_BATCH as u64)
            .map(|i| RecordHeader {
                kind: RecordKind::Write,
                seq: 5 + i,
                layer: 1,
                offset_bytes: i * 4096,
                len_bytes: 4096,
                data_crc: i as u32,
            })
            .collect();
        let h = BatchHeader {
            group: [3; 16],
            epoch: 1,
            committed_seq: 5,
            first_seq: 5,
            total_blocks: 1 + recs.len() as u32,
            records: recs,
            run_copy: None,
            written_unix_s: 0,
        };
        assert_eq!(BatchHeader::decode(&h.encode(), &[3; 16]).unwrap(), h);
    }

    fn run_header(n: usize, blocks_after_first: u64) -> BatchHeader {
        let recs: Vec<_> = (0..n as u64)
            .map(|i| RecordHeader {
                kind: RecordKind::Write,
                seq: 40 + i,
                layer: 2,
                offset_bytes: i * 8192,
                len_bytes: if i == 0 {
                    4096
                } else {
                    blocks_after_first * 4096
                },
                data_crc: 7 + i as u32,
            })
            .collect();
        let data = 1 + (n as u64 - 1) * blocks_after_first;
        BatchHeader {
            group: [5; 16],
            epoch: 3,
            committed_seq: 40 + n as u64 - 1,
            first_seq: 40,
            total_blocks: batch_total_blocks(true, n, data) as u32,
            records: recs,
            run_copy: Some(run_copy_for(n)),
            written_unix_s: 1_765_000_000 + n as u32,
        }
    }

    /// A run's header copies round-trip; one that breaks a run's rules (the copy for its
    /// record count, host writes only, a one-block first record, its size) is no header.
    #[test]
    fn run_header_copies_round_trip_and_break_no_rule() {
        for n in [1, 2, 3, 17, MAX_RECORDS_PER_BATCH] {
            let h = run_header(n, 2);
            let b = h.encode();
            assert_eq!(
                u32::from_le_bytes(b[8..12].try_into().unwrap()),
                RUN_HEADER_VERSION
            );
            assert_eq!(BatchHeader::decode(&b, &[5; 16]).unwrap(), h, "{n} records");
        }
        assert_eq!(
            run_header(1, 1).total_blocks,
            2,
            "a run of one write is an ordinary batch's size"
        );
        assert_eq!(run_header(2, 1).total_blocks, 4);
        assert_eq!(
            run_header(5, 1).total_blocks,
            7,
            "n + 2 blocks for n one-block writes"
        );
        type Break = Box<dyn Fn(&mut BatchHeader)>;
        let broken: Vec<(&str, Break)> = vec![
            (
                "the other copy",
                Box::new(|h| h.run_copy = h.run_copy.map(|c| 1 - c)),
            ),
            (
                "a zero record",
                Box::new(|h| h.records[1].kind = RecordKind::Zero),
            ),
            (
                "a cache record",
                Box::new(|h| h.records[2].kind = RecordKind::Cache),
            ),
            (
                "a two-block first record",
                Box::new(|h| {
                    h.records[0].len_bytes = 8192;
                    h.total_blocks += 1;
                }),
            ),
            ("a block short", Box::new(|h| h.total_blocks -= 1)),
            ("a block too many", Box::new(|h| h.total_blocks += 1)),
        ];
        for (what, f) in broken {
            let mut h = run_header(3, 1);
            f(&mut h);
            assert!(
                BatchHeader::decode(&h.encode(), &[5; 16]).is_none(),
                "{what} accepted"
            );
        }
        // An ordinary batch's header at the layout of a run is not a run, nor the reverse.
        let mut h = run_header(3, 1);
        h.run_copy = None;
        assert!(BatchHeader::decode(&h.encode(), &[5; 16]).is_none());
    }

    #[test]
    fn summary_round_trip() {
        let geo = SegmentGeometry::new(8 << 20, 1);
        assert!(geo.data_blocks + geo.summary_blocks == geo.segment_blocks);
        let s = SegmentSummary {
            group: [9; 16],
            segment_seq: 4,
            segment_index: 12,
            data_blocks_used: 2,
            entries: vec![SummaryEntry {
                kind: RecordKind::Write,
                layer: 1,
                lba: 5,
                nblocks: 2,
                seq: 99,
                data_block: 0,
            }],
            block_crcs: vec![1, 2],
        };
        let b = s.encode(&geo);
        assert_eq!(b.len(), geo.summary_blocks as usize * BLOCK);
        assert_eq!(
            SegmentSummary::decode(&[&b], &[9; 16], &geo, 12).unwrap(),
            s
        );
        // At another segment's place it is not this segment's summary.
        assert!(SegmentSummary::decode(&[&b], &[9; 16], &geo, 13).is_none());
        for at in [200, geo.crc_blocks as usize * BLOCK + 100] {
            let mut bad = b.clone();
            bad[at] ^= 1;
            assert!(
                SegmentSummary::decode(&[&bad], &[9; 16], &geo, 12).is_none(),
                "damage at {at} accepted"
            );
        }
        // A crc block reads on its own, and only at its own place.
        assert_eq!(
            decode_crc_block(&b[..BLOCK], 12, 0).map(|c| c[..2].to_vec()),
            Some(vec![1, 2])
        );
        assert!(decode_crc_block(&b[..BLOCK], 13, 0).is_none());
        assert!(decode_crc_block(&b[..BLOCK], 12, 1).is_none());
        assert_eq!((geo.crc_blocks, geo.summary_blocks), (2, 18), "{geo:?}");
    }

    /// Two copies each damaged in a different part still give the summary: each part comes
    /// from the copy where it checks. The same part damaged in both does not.
    #[test]
    fn summary_parts_come_from_whichever_copy_holds_them_sound() {
        let geo = SegmentGeometry::new(8 << 20, 2);
        let used = CRCS_PER_BLOCK as u32 + 5;
        let s = SegmentSummary {
            group: [9; 16],
            segment_seq: 4,
            segment_index: 12,
            data_blocks_used: used,
            entries: vec![SummaryEntry {
                kind: RecordKind::Write,
                layer: 1,
                lba: 5,
                nblocks: used,
                seq: 99,
                data_block: 0,
            }],
            block_crcs: (0..used).map(|i| i * 7 + 1).collect(),
        };
        let b = s.encode(&geo);
        let head = geo.crc_blocks as usize * BLOCK + 20;
        let damaged = |at: &[usize]| {
            let mut d = b.clone();
            for &x in at {
                d[x] ^= 0x40;
            }
            d
        };
        let decode = |a: &[u8], b: &[u8]| SegmentSummary::decode(&[a, b], &[9; 16], &geo, 12);
        // Copy A's header and copy B's second crc block; then A's first crc block and B's.
        let (a, bb) = (damaged(&[head]), damaged(&[BLOCK + 8]));
        assert_eq!(decode(&a, &bb).as_ref(), Some(&s));
        assert_eq!(decode(&bb, &a).as_ref(), Some(&s));
        let (a, bb) = (damaged(&[8]), damaged(&[BLOCK + 8, head]));
        assert_eq!(decode(&a, &bb).as_ref(), Some(&s));
        assert_eq!(
            SegmentSummary::decode_head(&a, &[9; 16], &geo, 12).map(|h| h.data_blocks_used),
            Some(used)
        );
        // The same crc block in both, or the header in both: no summary.
        assert!(decode(&damaged(&[8]), &damaged(&[9])).is_none());
        assert!(decode(&damaged(&[head]), &damaged(&[head + 1])).is_none());
    }
}
