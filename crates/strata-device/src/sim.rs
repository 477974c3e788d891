//! `MemDevice`: an in-memory device for tests and a seeded, replayable fault simulator.
//!
//! It models what makes storage hard to get right: a volatile write cache. A completed
//! `write_at` lands in a volatile overlay; only `flush` makes it durable. [`MemDevice::crash`]
//! then drops the overlay the way a power loss does: durable data always survives, each
//! unflushed 4 KiB block independently survives or not, and one block may be torn (a prefix of
//! its 512-byte sectors new, the rest old). Every random choice comes from one seeded PRNG, so
//! a seed and the same sequence of calls replay exactly the same faults.
//!
//! Blocks are stored sparsely, so a simulated 16 GiB device costs only what was written.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::check::{check_io, check_range, io_error};
use crate::rng::SplitMix64;
use crate::stats::Counters;
use crate::{AlignedBuf, Device, DeviceError, DeviceStats, ReadDone, BLOCK_SIZE};

const BLOCK: u64 = BLOCK_SIZE as u64;
/// Torn writes happen at sector granularity: a sector is written entirely or not at all.
const SECTOR_SIZE: usize = 512;
const SECTORS_PER_BLOCK: u64 = (BLOCK_SIZE / SECTOR_SIZE) as u64;

type Block = Box<[u8; BLOCK_SIZE]>;

/// What an unflushed block holds in the volatile cache.
#[derive(Clone)]
enum Pending {
    Data(Block),
    /// Discarded since the last flush: reads return zeros; on a crash the old content may return.
    Discarded,
}

/// Fault injection settings. Rates are probabilities per call in [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct FaultConfig {
    /// Seeds the PRNG behind every random choice (faults and crash outcomes).
    pub seed: u64,
    /// A read fails with an I/O error; the buffer content is then unspecified.
    pub read_error_rate: f64,
    /// A write fails with an I/O error after applying a random prefix of its blocks (possibly
    /// none), because a real device gives no guarantee about a failed write's range.
    pub write_error_rate: f64,
    /// A flush fails after making a random subset of the unflushed blocks durable; the rest stay
    /// volatile (still visible to reads, still at risk in a crash).
    pub flush_error_rate: f64,
    /// A successful read returns one flipped bit (transient: storage is unchanged), as a bad
    /// cable or DRAM error would.
    pub bit_flip_on_read_rate: f64,
    /// Probability that an unflushed block survives a crash (or a failed flush makes it durable).
    pub crash_keep_rate: f64,
    /// Whether a crash tears one unflushed block that held data.
    pub torn_write_on_crash: bool,
}

impl Default for FaultConfig {
    /// No I/O faults; crashes keep half the unflushed blocks and tear one.
    fn default() -> Self {
        FaultConfig {
            seed: 0,
            read_error_rate: 0.0,
            write_error_rate: 0.0,
            flush_error_rate: 0.0,
            bit_flip_on_read_rate: 0.0,
            crash_keep_rate: 0.5,
            torn_write_on_crash: true,
        }
    }
}

impl FaultConfig {
    /// The default configuration with a given seed.
    pub fn seeded(seed: u64) -> FaultConfig {
        FaultConfig {
            seed,
            ..FaultConfig::default()
        }
    }
}

/// What a crash did, in byte offsets of 4 KiB blocks, sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CrashReport {
    /// Unflushed blocks whose newest content (data or discard) became durable.
    pub kept_offsets: Vec<u64>,
    /// Unflushed blocks that reverted to their durable content.
    pub lost_offsets: Vec<u64>,
    /// The block torn at sector granularity, if any, and how many leading 512-byte sectors
    /// carry the new data (1..=7; the rest are the old durable content).
    pub torn: Option<(u64, u32)>,
}

struct SimState {
    /// Durable content by block index; a missing block reads as zeros. Ordered so discards can
    /// visit only the stored blocks of a range.
    durable: BTreeMap<u64, Block>,
    /// Unflushed content by block index. Ordered so crash decisions iterate deterministically.
    volatile: BTreeMap<u64, Pending>,
    faults: FaultConfig,
    rng: SplitMix64,
    fail_next_reads: u64,
    fail_next_writes: u64,
    fail_next_flushes: u64,
    /// Blocks the device may hold content in (a sparse file on a file system with that much
    /// room); None: no limit.
    space_limit_blocks: Option<u64>,
}

/// An in-memory [`Device`] with a volatile write cache, crash simulation and fault injection.
/// See the module documentation.
pub struct MemDevice {
    sim: Arc<Sim>,
    /// The completion thread of asynchronous reads, started by the first one.
    completions: OnceLock<crossbeam_channel::Sender<AsyncRead>>,
}

/// The device's content and counters, shared with its completion thread.
pub struct Sim {
    name: String,
    size_bytes: u64,
    state: Mutex<SimState>,
    counters: Counters,
}

impl std::ops::Deref for MemDevice {
    type Target = Sim;
    fn deref(&self) -> &Sim {
        &self.sim
    }
}

/// An asynchronous read, carried out by the completion thread when it gets to it (later
/// than its submission, as on a real device), then completed.
type AsyncRead = (Arc<Sim>, AlignedBuf, u64, ReadDone);

impl MemDevice {
    /// A zeroed device of `size_bytes` (rounded down to a multiple of 4 KiB), no I/O faults.
    pub fn new(name: impl Into<String>, size_bytes: u64) -> MemDevice {
        MemDevice::with_faults(name, size_bytes, FaultConfig::default())
    }

    /// A zeroed device with the given fault configuration.
    pub fn with_faults(name: impl Into<String>, size_bytes: u64, faults: FaultConfig) -> MemDevice {
        let state = SimState {
            durable: BTreeMap::new(),
            volatile: BTreeMap::new(),
            rng: SplitMix64::new(faults.seed),
            faults,
            fail_next_reads: 0,
            fail_next_writes: 0,
            fail_next_flushes: 0,
            space_limit_blocks: None,
        };
        MemDevice {
            sim: Arc::new(Sim {
                name: name.into(),
                size_bytes: size_bytes - size_bytes % BLOCK,
                state: Mutex::new(state),
                counters: Counters::new(),
            }),
            completions: OnceLock::new(),
        }
    }

    /// Replaces the fault configuration and reseeds the PRNG from `faults.seed`.
    pub fn set_faults(&self, faults: FaultConfig) {
        let mut state = self.state.lock();
        state.rng = SplitMix64::new(faults.seed);
        state.faults = faults;
    }

    /// Turns off every I/O fault (rates and pending one-shot failures). Crash behaviour and the
    /// PRNG state are kept, so a test can stop injecting errors and still crash reproducibly.
    pub fn clear_faults(&self) {
        let mut state = self.state.lock();
        let faults = &mut state.faults;
        faults.read_error_rate = 0.0;
        faults.write_error_rate = 0.0;
        faults.flush_error_rate = 0.0;
        faults.bit_flip_on_read_rate = 0.0;
        state.fail_next_reads = 0;
        state.fail_next_writes = 0;
        state.fail_next_flushes = 0;
    }

    /// The current fault configuration.
    pub fn faults(&self) -> FaultConfig {
        self.state.lock().faults.clone()
    }

    /// The next `n` reads fail (before any random fault is considered).
    pub fn fail_next_reads(&self, n: u64) {
        self.state.lock().fail_next_reads = n;
    }

    /// The next `n` writes fail without writing anything.
    pub fn fail_next_writes(&self, n: u64) {
        self.state.lock().fail_next_writes = n;
    }

    /// The next `n` flushes fail without making anything durable.
    pub fn fail_next_flushes(&self, n: u64) {
        self.state.lock().fail_next_flushes = n;
    }

    /// Models a sparse device file on a file system with `bytes` of room (None: no limit). A
    /// write that needs room for blocks holding no content yet, beyond the limit, lands its
    /// leading blocks that fit and fails with ENOSPC, as a file system that fills up does; a
    /// discard gives its blocks' room back. Lowering the limit below what is held already
    /// fails every write that needs a new block.
    pub fn set_space_limit(&self, bytes: Option<u64>) {
        self.state.lock().space_limit_blocks = bytes.map(|b| b / BLOCK);
    }

    /// Flips bit `bit` (0..8) of the byte at `offset_bytes` in the stored content, durable and
    /// unflushed alike: silent media corruption that checksums must catch.
    pub fn flip_bit(&self, offset_bytes: u64, bit: u8) -> Result<(), DeviceError> {
        if offset_bytes >= self.size_bytes {
            let err = DeviceError::OutOfRange {
                device: self.name.clone(),
                offset: offset_bytes,
                len: 1,
                size_bytes: self.size_bytes,
            };
            return Err(err);
        }
        let index = offset_bytes / BLOCK;
        let byte = (offset_bytes % BLOCK) as usize;
        let mask = 1u8 << (bit % 8);
        let mut state = self.state.lock();
        state.durable.entry(index).or_insert_with(zero_block)[byte] ^= mask;
        if let Some(Pending::Data(block)) = state.volatile.get_mut(&index) {
            block[byte] ^= mask;
        }
        Ok(())
    }

    /// Simulates a power loss in place: the same object continues as the device after reboot.
    /// Durable data survives; each unflushed block survives with probability
    /// `crash_keep_rate`; one block may be torn. One-shot failures are reset.
    pub fn crash(&self) -> CrashReport {
        let mut state = self.state.lock();
        let volatile = std::mem::take(&mut state.volatile);
        let keep_rate = state.faults.crash_keep_rate;
        let mut report = CrashReport::default();
        let torn_index = pick_torn_block(&mut state, &volatile);
        for (index, pending) in volatile {
            if Some(index) == torn_index {
                if let Pending::Data(new) = &pending {
                    report.torn = Some(tear_block(&mut state, index, new));
                }
                continue;
            }
            if state.rng.chance(keep_rate) {
                make_durable(&mut state.durable, index, pending);
                report.kept_offsets.push(index * BLOCK);
            } else {
                report.lost_offsets.push(index * BLOCK);
            }
        }
        state.fail_next_reads = 0;
        state.fail_next_writes = 0;
        state.fail_next_flushes = 0;
        report
    }

    /// A new device holding only this device's durable content (no faults, fresh counters):
    /// what a clean reopen would see if the power failed and every unflushed block was lost.
    pub fn snapshot_durable(&self) -> MemDevice {
        let copy = MemDevice::new(self.name.clone(), self.size_bytes);
        copy.state.lock().durable = self.state.lock().durable.clone();
        copy
    }

    /// Number of 4 KiB blocks written or discarded since the last flush.
    pub fn unflushed_blocks(&self) -> usize {
        self.state.lock().volatile.len()
    }

    /// Bytes of block content held in memory (durable plus unflushed).
    pub fn stored_bytes(&self) -> u64 {
        let state = self.state.lock();
        let unflushed = state
            .volatile
            .values()
            .filter(|p| matches!(p, Pending::Data(_)))
            .count();
        (state.durable.len() + unflushed) as u64 * BLOCK
    }
}

impl Sim {
    /// Checks an I/O's buffer and range, counting a refusal as an error.
    fn check(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        let checked = check_io(
            &self.name,
            self.size_bytes,
            buf.as_ptr() as usize,
            buf.len(),
            offset,
        );
        checked.inspect_err(|_| self.counters.record_error())
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.check(buf, offset)?;
        let mut state = self.state.lock();
        if self.check_read_fault(&mut state) {
            return Err(self.injected(offset, "read"));
        }
        Self::read_blocks(&state, buf, offset);
        let flip_rate = state.faults.bit_flip_on_read_rate;
        if !buf.is_empty() && state.rng.chance(flip_rate) {
            let bit = state.rng.below(buf.len() as u64 * 8);
            buf[(bit / 8) as usize] ^= 1 << (bit % 8);
        }
        drop(state);
        self.counters.record_read(buf.len() as u64);
        Ok(())
    }

    fn injected(&self, offset: u64, what: &str) -> DeviceError {
        self.counters.record_error();
        let source = io::Error::other(format!("injected {what} fault (simulated EIO)"));
        io_error(&self.name, offset, source)
    }

    fn read_blocks(state: &SimState, buf: &mut [u8], offset: u64) {
        for (i, chunk) in buf.chunks_exact_mut(BLOCK_SIZE).enumerate() {
            let index = offset / BLOCK + i as u64;
            match state.volatile.get(&index) {
                Some(Pending::Data(block)) => chunk.copy_from_slice(&block[..]),
                Some(Pending::Discarded) => chunk.fill(0),
                None => match state.durable.get(&index) {
                    Some(block) => chunk.copy_from_slice(&block[..]),
                    None => chunk.fill(0),
                },
            }
        }
    }

    fn check_read_fault(&self, state: &mut SimState) -> bool {
        if state.fail_next_reads > 0 {
            state.fail_next_reads -= 1;
            return true;
        }
        let rate = state.faults.read_error_rate;
        state.rng.chance(rate)
    }

    /// Decides whether this write fails; if so, returns how many leading blocks still land.
    fn check_write_fault(&self, state: &mut SimState, blocks: u64) -> Option<u64> {
        if state.fail_next_writes > 0 {
            state.fail_next_writes -= 1;
            return Some(0);
        }
        let rate = state.faults.write_error_rate;
        state.rng.chance(rate).then(|| state.rng.below(blocks))
    }

    fn check_flush_fault(&self, state: &mut SimState) -> Option<FlushFault> {
        if state.fail_next_flushes > 0 {
            state.fail_next_flushes -= 1;
            return Some(FlushFault::Nothing);
        }
        let rate = state.faults.flush_error_rate;
        state.rng.chance(rate).then_some(FlushFault::Partial)
    }
}

enum FlushFault {
    /// Nothing became durable.
    Nothing,
    /// A random subset became durable.
    Partial,
}

fn zero_block() -> Block {
    Box::new([0u8; BLOCK_SIZE])
}

fn write_blocks(state: &mut SimState, buf: &[u8], offset: u64) {
    for (i, chunk) in buf.chunks_exact(BLOCK_SIZE).enumerate() {
        let mut block = zero_block();
        block.copy_from_slice(chunk);
        state
            .volatile
            .insert(offset / BLOCK + i as u64, Pending::Data(block));
    }
}

/// With a space limit, how many leading blocks of a write of `blocks` at block `first` fit
/// when not all do; None when all do (or there is no limit).
fn blocks_that_fit(state: &SimState, first: u64, blocks: u64) -> Option<u64> {
    let limit = state.space_limit_blocks?;
    let holds = |index: u64| match state.volatile.get(&index) {
        Some(Pending::Data(_)) => true,
        Some(Pending::Discarded) => false,
        None => state.durable.contains_key(&index),
    };
    let mut held = state.durable.keys().filter(|&&i| holds(i)).count() as u64
        + state
            .volatile
            .iter()
            .filter(|(i, p)| matches!(p, Pending::Data(_)) && !state.durable.contains_key(i))
            .count() as u64;
    for i in 0..blocks {
        if !holds(first + i) {
            if held >= limit {
                return Some(i);
            }
            held += 1;
        }
    }
    None
}

fn make_durable(durable: &mut BTreeMap<u64, Block>, index: u64, pending: Pending) {
    match pending {
        Pending::Data(block) => durable.insert(index, block),
        Pending::Discarded => durable.remove(&index),
    };
}

/// Picks which unflushed data block a crash tears, if tearing is on.
fn pick_torn_block(state: &mut SimState, volatile: &BTreeMap<u64, Pending>) -> Option<u64> {
    if !state.faults.torn_write_on_crash {
        return None;
    }
    let candidates: Vec<u64> = volatile
        .iter()
        .filter(|(_, p)| matches!(p, Pending::Data(_)))
        .map(|(&index, _)| index)
        .collect();
    if candidates.is_empty() {
        return None;
    }
    let pick = state.rng.below(candidates.len() as u64) as usize;
    Some(candidates[pick])
}

/// Makes a prefix of 1..=7 sectors of `new` durable over the old content of block `index`.
fn tear_block(state: &mut SimState, index: u64, new: &Block) -> (u64, u32) {
    let sectors = 1 + state.rng.below(SECTORS_PER_BLOCK - 1) as usize;
    let prefix_bytes = sectors * SECTOR_SIZE;
    let old = state.durable.entry(index).or_insert_with(zero_block);
    old[..prefix_bytes].copy_from_slice(&new[..prefix_bytes]);
    (index * BLOCK, sectors as u32)
}

impl Device for MemDevice {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.sim.read(buf, offset)
    }

    /// Reads (faults included) on a thread of the device's own, later than the call, and
    /// completes there, as a real device's completion thread would.
    fn read_async(
        &self,
        buf: AlignedBuf,
        offset: u64,
        done: ReadDone,
    ) -> Result<(), (AlignedBuf, ReadDone)> {
        let completions = self.completions.get_or_init(|| {
            let (tx, rx) = crossbeam_channel::unbounded::<AsyncRead>();
            let complete = |(sim, mut buf, offset, done): AsyncRead| {
                std::thread::yield_now();
                let result = sim.read(&mut buf, offset);
                done(buf, result)
            };
            let spawned = std::thread::Builder::new()
                .name("sim-reads".into())
                .spawn(move || rx.iter().for_each(complete));
            // Without the thread its receiver is gone, and every read is handed back.
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "simulated device: no completion thread");
            }
            tx
        });
        completions
            .send((self.sim.clone(), buf, offset, done))
            .map_err(|crossbeam_channel::SendError((_, buf, _, done))| (buf, done))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.check(buf, offset)?;
        let mut state = self.state.lock();
        let blocks = (buf.len() / BLOCK_SIZE) as u64;
        if let Some(landed_blocks) = self.check_write_fault(&mut state, blocks) {
            let landed_bytes = landed_blocks as usize * BLOCK_SIZE;
            write_blocks(&mut state, &buf[..landed_bytes], offset);
            return Err(self.injected(offset, "write"));
        }
        if let Some(fit) = blocks_that_fit(&state, offset / BLOCK, blocks) {
            write_blocks(&mut state, &buf[..fit as usize * BLOCK_SIZE], offset);
            drop(state);
            let source = io::Error::from_raw_os_error(libc::ENOSPC);
            self.counters.record_failure(&source);
            return Err(io_error(&self.name, offset, source));
        }
        write_blocks(&mut state, buf, offset);
        drop(state);
        self.counters.record_write(buf.len() as u64);
        Ok(())
    }

    fn flush(&self) -> Result<(), DeviceError> {
        let mut state = self.state.lock();
        match self.check_flush_fault(&mut state) {
            None => {
                let volatile = std::mem::take(&mut state.volatile);
                for (index, pending) in volatile {
                    make_durable(&mut state.durable, index, pending);
                }
            }
            Some(FlushFault::Nothing) => return Err(self.injected(0, "flush")),
            Some(FlushFault::Partial) => {
                persist_random_subset(&mut state);
                return Err(self.injected(0, "flush"));
            }
        }
        drop(state);
        self.counters.record_flush();
        Ok(())
    }

    /// Discarded blocks read as zeros at once; like a write, the discard is durable only after
    /// a flush, so a crash may bring the old content back.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let checked = check_range(&self.name, self.size_bytes, offset, len);
        checked.inspect_err(|_| self.counters.record_error())?;
        let mut state = self.state.lock();
        for index in blocks_with_content(&state, offset / BLOCK, (offset + len) / BLOCK) {
            state.volatile.insert(index, Pending::Discarded);
        }
        drop(state);
        self.counters.record_discard(len);
        Ok(())
    }

    fn discard_is_cheap(&self) -> bool {
        true
    }

    fn stats(&self) -> DeviceStats {
        self.counters.snapshot(&self.name, self.size_bytes)
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// The blocks in `first..end` that hold anything: a block never written reads as zeros already,
/// so discarding it changes nothing, and skipping it keeps a discard of a whole 16 GiB device
/// from allocating an entry per block.
fn blocks_with_content(state: &SimState, first: u64, end: u64) -> Vec<u64> {
    let mut blocks: Vec<u64> = state.durable.range(first..end).map(|(&i, _)| i).collect();
    blocks.extend(state.volatile.range(first..end).map(|(&i, _)| i));
    blocks.sort_unstable();
    blocks.dedup();
    blocks
}

/// A failed flush: each unflushed block becomes durable with probability `crash_keep_rate`.
fn persist_random_subset(state: &mut SimState) {
    let volatile = std::mem::take(&mut state.volatile);
    let keep_rate = state.faults.crash_keep_rate;
    for (index, pending) in volatile {
        if state.rng.chance(keep_rate) {
            make_durable(&mut state.durable, index, pending);
        } else {
            state.volatile.insert(index, pending);
        }
    }
}

#[cfg(test)]
#[path = "sim_tests.rs"]
mod tests;
