//! Damage swept over the devices of a disk group with real history (volumes, snapshots, a
//! clone, data on both tiers, index flushes, writes left in the log): every metadata block,
//! and a seeded sample of the others, is damaged in turn on a copy of the devices, then the
//! group is opened. Open refuses with a clear error, or it opens and every block of every view
//! reads back as the model says or as an error, never other data; scrub reports or repairs
//! the damage; writes after the open work and survive another reopen. Both copies of each
//! twice-written structure are also damaged at once. `STRATA_TEST_SEED=<n>` replays a sample.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_device::{AlignedBuf, Device, MemDevice};

use crate::ctree::page::{decode, PageBody};
use crate::ctree::PagePtr;
use crate::format::{Checkpoint, SegmentSummary, BATCH_MAGIC, BLOCK, BLOCK_U64};
use crate::layout::{layout_from, read_checkpoint, read_superblock, Layout};
use crate::tests::{seed_for, small_cfg, Rig, MIB};
use crate::tests_snap::Model;
use crate::*;

const VOL_BLOCKS: u64 = 128;
const FAST_BYTES: u64 = 16 * MIB;
const CAP_BYTES: u64 = 24 * MIB;
/// Data blocks (log and segments) damaged per variant, drawn from the seeded generator.
const DATA_SAMPLE: usize = 16;
/// The last batches a power cut may take with it when one of them is damaged
/// (docs/FORMAT.md §9): the batch, and every later one, up to `PIPELINE_DEPTH` + 1.
const TAIL_BATCHES: usize = crate::log::PIPELINE_DEPTH + 1;

/// Block `lba` of a view: its number, a tag for the write that made it, then a fill.
fn block(lba: u64, tag: u8) -> Vec<u8> {
    let mut b = vec![tag; BLOCK];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b
}

/// Panics on engine threads (which a join ignores) since the hook was installed.
static ENGINE_PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_engine_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            if name.starts_with("strata") || name.starts_with("sim-") || name.is_empty() {
                ENGINE_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

/// The group at rest, and what every view must read as.
struct Built {
    images: Vec<MemDevice>,
    /// The final model; with a power cut, also the models before each of the last batches,
    /// which a damaged last batch may take back (oldest first, the final one last).
    models: Vec<Model>,
    layout: Layout,
    cp: Checkpoint,
    /// Every page the durable index and segment table use (both copies), and its kind.
    pages: Vec<(PagePtr, PageKind)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageKind {
    Leaf,
    Inner,
    SegTable,
}

fn write_blocks(dg: &DiskGroup, m: &mut Model, vol: &str, lbas: &[u64], tag: u8) {
    let id = dg.volume(vol).expect("volume").id;
    let image = m.volumes.get_mut(vol).expect("model");
    for &lba in lbas {
        let b = block(lba, tag);
        dg.write(id, lba * BLOCK_U64, &b).expect("write");
        image[(lba * BLOCK_U64) as usize..][..BLOCK].copy_from_slice(&b);
    }
}

/// Many single-block writes at once, so they share batches and the index holds many extents.
fn write_scattered(dg: &Arc<DiskGroup>, m: &mut Model, vol: &str, every: u64, tag: u8) {
    let id = dg.volume(vol).expect("volume").id;
    let lbas: Vec<u64> = (0..VOL_BLOCKS).filter(|l| l % every == 1).collect();
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut sent = 0;
    for &lba in &lbas {
        let tx = tx.clone();
        let done: WriteDone = Box::new(move |r| {
            let _ = tx.send(r);
        });
        if let Err(done) = dg.write_async(id, lba * BLOCK_U64, &block(lba, tag), done) {
            done(dg.write(id, lba * BLOCK_U64, &block(lba, tag)));
        }
        sent += 1;
    }
    for _ in 0..sent {
        let r = rx.recv_timeout(Duration::from_secs(30)).expect("answered");
        r.expect("write");
    }
    let image = m.volumes.get_mut(vol).expect("model");
    for lba in lbas {
        image[(lba * BLOCK_U64) as usize..][..BLOCK].copy_from_slice(&block(lba, tag));
    }
}

fn snapshot(dg: &DiskGroup, m: &mut Model, vol: &str, snap: &str) {
    dg.create_snapshot(vol, snap).expect("snapshot");
    let image = m.volumes[vol].clone();
    m.snapshots.insert(format!("{vol}@{snap}"), image);
}

fn new_volume(dg: &DiskGroup, m: &mut Model, vol: &str) {
    dg.create_volume(vol, VOL_BLOCKS * BLOCK_U64)
        .expect("volume");
    m.volumes
        .insert(vol.into(), vec![0; (VOL_BLOCKS * BLOCK_U64) as usize]);
}

fn copy_model(m: &Model) -> Model {
    Model {
        volumes: m.volumes.clone(),
        snapshots: m.snapshots.clone(),
    }
}

/// Writes a volume over until the log has wrapped, with destage and GC behind, then deletes
/// it: stale batches everywhere in the log, relocated segments, a deleted layer.
fn churn(dg: &DiskGroup) {
    let id = dg.create_volume("w", VOL_BLOCKS * BLOCK_U64).unwrap().id;
    let log_bytes = dg.sh.layout.log_blocks * BLOCK_U64;
    for i in 0..=log_bytes / (VOL_BLOCKS * BLOCK_U64) {
        let all = vec![i as u8; (VOL_BLOCKS * BLOCK_U64) as usize];
        dg.write(id, 0, &all).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
    dg.delete_volume("w", false).unwrap();
}

/// Volumes, snapshots and a clone; data destaged and indexed, more destaged since, more in
/// the log; then a clean shutdown, or a power cut after the last acknowledged writes.
fn build(power_cut: bool) -> Built {
    let mut rig = Rig::new(FAST_BYTES, &[CAP_BYTES, CAP_BYTES], small_cfg(), 71);
    let mut m = Model::default();
    let dg = rig.group().clone();
    for v in ["a", "b"] {
        new_volume(&dg, &mut m, v);
        let all = vec![0x10; (VOL_BLOCKS * BLOCK_U64) as usize];
        dg.write(dg.volume(v).unwrap().id, 0, &all).unwrap();
        m.volumes.get_mut(v).unwrap().copy_from_slice(&all);
    }
    // Destaged apart from what overwrites it, so the index holds an extent per overwrite.
    assert!(dg.destage_all(Duration::from_secs(20)));
    write_scattered(&dg, &mut m, "a", 2, 0x21);
    write_scattered(&dg, &mut m, "b", 3, 0x22);
    assert!(dg.destage_all(Duration::from_secs(20)));
    snapshot(&dg, &mut m, "a", "s1");
    write_blocks(&dg, &mut m, "a", &(0..32).collect::<Vec<_>>(), 0x31);
    dg.clone_snapshot("a", "s1", "c").unwrap();
    m.volumes.insert("c".into(), m.snapshots["a@s1"].clone());
    write_scattered(&dg, &mut m, "c", 5, 0x41);
    assert!(dg.destage_all(Duration::from_secs(20)));
    churn(&dg);
    drop(dg);
    rig.clean_restart();
    let dg = rig.group().clone();
    snapshot(&dg, &mut m, "c", "s2");
    write_blocks(&dg, &mut m, "c", &(64..80).collect::<Vec<_>>(), 0x51);
    dg.write_zeroes(dg.volume("b").unwrap().id, 16 * BLOCK_U64, 16 * BLOCK_U64)
        .unwrap();
    m.volumes.get_mut("b").unwrap()[16 * BLOCK..32 * BLOCK].fill(0);
    assert!(dg.destage_all(Duration::from_secs(20)));
    write_blocks(&dg, &mut m, "a", &(100..110).collect::<Vec<_>>(), 0x61);
    // The last batches, one write each: the models before each of them.
    let mut models = Vec::new();
    for (i, lba) in (40..48).enumerate() {
        models.push(copy_model(&m));
        write_blocks(&dg, &mut m, "b", &[lba], 0x70 + i as u8);
    }
    models.push(copy_model(&m));
    drop(dg);
    if power_cut {
        rig.power_cut();
        models.drain(..models.len() - TAIL_BATCHES);
    } else {
        rig.dg.take().unwrap().shutdown().unwrap();
        models.drain(..models.len() - 1);
    }
    let images: Vec<MemDevice> = std::iter::once(&rig.fast)
        .chain(&rig.caps)
        .map(|d| d.snapshot_durable())
        .collect();
    let (layout, cp) = read_layout(&images);
    let pages = index_pages(&images, &layout, &cp);
    assert_eq!(
        cp.recent.is_empty(),
        !power_cut,
        "segments destaged since the last index flush"
    );
    Built {
        images,
        models,
        layout,
        cp,
        pages,
    }
}

fn read_layout(images: &[MemDevice]) -> (Layout, Checkpoint) {
    let sbs: Vec<_> = images
        .iter()
        .map(|d| read_superblock(d).unwrap().expect("formatted"))
        .collect();
    let layout = layout_from(&sbs).unwrap();
    let cp = read_checkpoint(&images[0], &layout).unwrap();
    (layout, cp)
}

/// (capacity image index, byte offset) of index page address `addr`.
fn page_place(layout: &Layout, addr: u64) -> (usize, u64) {
    let (dev, off) = layout.segments[(addr >> 32) as usize];
    (1 + dev, off + (addr & 0xffff_ffff) * BLOCK_U64)
}

fn read_at(dev: &MemDevice, off: u64) -> AlignedBuf {
    let mut b = AlignedBuf::new_zeroed(BLOCK);
    dev.read_at(&mut b, off).unwrap();
    b
}

/// Every page of the durable index (walked from its root) and of the segment table.
fn index_pages(images: &[MemDevice], layout: &Layout, cp: &Checkpoint) -> Vec<(PagePtr, PageKind)> {
    let mut out: Vec<_> = cp
        .segtab
        .iter()
        .flatten()
        .map(|p| (*p, PageKind::SegTable))
        .collect();
    let mut todo: Vec<PagePtr> = cp.index_root.into_iter().collect();
    while let Some(p) = todo.pop() {
        let (dev, off) = page_place(layout, p.a);
        let b = read_at(&images[dev], off);
        match decode(&b, &layout.group, p.a).expect("a sound index").0 {
            PageBody::Inner(children) => {
                out.push((p, PageKind::Inner));
                todo.extend(children.iter().map(|c| c.1));
            }
            _ => out.push((p, PageKind::Leaf)),
        }
    }
    out
}

/// What a damaged block held, by where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Superblock,
    Checkpoint,
    LogHeader,
    LogData,
    /// A page copy the durable index uses, or an older one.
    IndexPage {
        live: bool,
    },
    /// A segment summary block, of a segment on the checkpoint's recent list or not.
    Summary {
        recent: bool,
    },
    /// The same block of both summary copies: nothing to mend it from.
    SummaryBoth {
        recent: bool,
    },
    SegData,
    /// Anything else not blank (unused areas).
    Other,
}

#[derive(Debug, Clone, Copy)]
enum Damage {
    FlipByte(usize),
    Zero,
    Garbage(u64),
}

#[derive(Debug, Clone, Copy)]
struct Target {
    dev: usize,
    off: u64,
    kind: Kind,
}

/// The global segment holding byte `off` of device `dev` (0: the fast device).
fn seg_of(b: &Built, dev: usize, off: u64) -> Option<usize> {
    let size = b.layout.segment_size_bytes;
    b.layout
        .segments
        .iter()
        .position(|&(d, start)| d + 1 == dev && (start..start + size).contains(&off))
}

fn classify(b: &Built, dev: usize, off: u64, content: &[u8]) -> Kind {
    let live: BTreeSet<u64> = b.pages.iter().flat_map(|(p, _)| [p.a, p.b]).collect();
    if off < 2 * BLOCK_U64 {
        return Kind::Superblock;
    }
    if dev == 0 {
        return match off {
            o if o < MIB => Kind::Other,
            o if o < b.layout.log_offset => Kind::Checkpoint,
            _ if &content[..8] == BATCH_MAGIC => Kind::LogHeader,
            _ => Kind::LogData,
        };
    }
    let Some(seg) = seg_of(b, dev, off) else {
        return Kind::Other;
    };
    let block = (off - b.layout.segments[seg].1) / BLOCK_U64;
    if &content[..8] == crate::ctree::page::PAGE_MAGIC {
        let addr = ((seg as u64) << 32) | block;
        return Kind::IndexPage {
            live: live.contains(&addr),
        };
    }
    let geo = &b.layout.geo;
    let data = u64::from(geo.data_start())..u64::from(geo.data_start() + geo.data_blocks);
    if !data.contains(&block) {
        return Kind::Summary {
            recent: b.cp.recent.contains(&(seg as u32)),
        };
    }
    Kind::SegData
}

/// Every block that is not blank on any device: metadata blocks all, data blocks sampled.
fn targets(b: &Built, rng: &mut StdRng) -> Vec<Target> {
    let mut meta = Vec::new();
    let mut data = Vec::new();
    for (dev, img) in b.images.iter().enumerate() {
        for blk in 0..img.size_bytes() / BLOCK_U64 {
            let off = blk * BLOCK_U64;
            let content = read_at(img, off);
            if content.iter().all(|&x| x == 0) {
                continue;
            }
            let kind = classify(b, dev, off, &content);
            let t = Target { dev, off, kind };
            match kind {
                Kind::LogData | Kind::SegData => data.push(t),
                _ => meta.push(t),
            }
        }
    }
    for _ in 0..DATA_SAMPLE.min(data.len()) {
        let i = rng.gen_range(0..data.len());
        meta.push(data.swap_remove(i));
    }
    meta
}

fn damage(img: &MemDevice, off: u64, how: Damage) {
    let mut b = read_at(img, off);
    match how {
        Damage::FlipByte(at) => b[at % BLOCK] ^= 0xff,
        Damage::Zero => b.fill(0),
        Damage::Garbage(seed) => StdRng::seed_from_u64(seed).fill(&mut b[..]),
    }
    img.write_at(&b, off).unwrap();
    img.flush().unwrap();
}

fn devices(images: &[MemDevice]) -> (Arc<MemDevice>, Vec<Arc<MemDevice>>) {
    let mut all = images.iter().map(|d| Arc::new(d.snapshot_durable()));
    let fast = all.next().unwrap();
    (fast, all.collect())
}

fn open(fast: &Arc<MemDevice>, caps: &[Arc<MemDevice>]) -> Result<Arc<DiskGroup>, EngineError> {
    let caps = caps.iter().map(|c| c.clone() as Arc<dyn Device>).collect();
    DiskGroup::open(fast.clone(), caps, small_cfg(), true)
}

/// What one damaged opening showed.
#[derive(Debug, Default)]
struct Seen {
    refused: Option<String>,
    read_errors: u64,
}

/// Every block of every view reads as in one of the models (block 7 of the volumes in
/// `written` as written since) or fails; returns how many failed.
fn check_views(dg: &DiskGroup, b: &Built, written: &BTreeMap<String, u8>, what: &str) -> u64 {
    let names: BTreeSet<String> = dg.views().into_iter().map(|v| v.name).collect();
    let last = b.models.last().unwrap();
    let want: BTreeSet<String> = last
        .volumes
        .keys()
        .chain(last.snapshots.keys())
        .cloned()
        .collect();
    assert_eq!(names, want, "{what}: the views");
    let mut errors = 0;
    for name in &want {
        let id = dg.view(name).unwrap().id;
        for lba in 0..VOL_BLOCKS {
            let mut got = vec![0u8; BLOCK];
            if let Err(e) = dg.read(id, lba * BLOCK_U64, &mut got) {
                assert!(
                    !e.to_string().is_empty(),
                    "{what}: an error says what failed"
                );
                errors += 1;
                continue;
            }
            if lba == 7 && written.contains_key(name) {
                assert_eq!(
                    got,
                    block(7, written[name]),
                    "{what}: {name} block 7, written since"
                );
                continue;
            }
            let at = (lba * BLOCK_U64) as usize..((lba + 1) * BLOCK_U64) as usize;
            let ok = b.models.iter().any(|m| {
                let image = m.volumes.get(name).or(m.snapshots.get(name)).unwrap();
                image[at.clone()] == got[..]
            });
            assert!(
                ok,
                "{what}: {name} block {lba} reads as other data (first bytes {:?})",
                &got[..16]
            );
        }
    }
    errors
}

/// Whether the copy at `t` holds a sound structure again (open or scrub mended it).
fn mended(
    b: &Built,
    t: Target,
    dg: &DiskGroup,
    fast: &Arc<MemDevice>,
    caps: &[Arc<MemDevice>],
) -> bool {
    let img: &MemDevice = if t.dev == 0 { fast } else { &caps[t.dev - 1] };
    let content = read_at(img, t.off);
    match t.kind {
        Kind::Superblock => matches!(
            crate::format::Superblock::decode(&content),
            crate::format::SuperblockRead::Valid(_)
        ),
        Kind::IndexPage { live: true } => {
            let seg = seg_of(b, t.dev, t.off).expect("a page in a segment");
            let addr = ((seg as u64) << 32) | ((t.off - b.layout.segments[seg].1) / BLOCK_U64);
            // Open may have written the page elsewhere (a segment-table page changes when
            // open finds index segments nothing uses): then the damaged copy is garbage.
            let mut in_use = Vec::new();
            dg.sh.tree.read().known_pages(&mut in_use);
            in_use.extend(dg.sh.segs.lock().page_ptrs.iter().flatten().copied());
            let used = in_use.iter().any(|p| p.a == addr || p.b == addr);
            !used || decode(&content, &b.layout.group, addr).is_some()
        }
        // Scrub mends a summary copy of a segment in use from the other.
        Kind::Summary { .. } if summary_in_use(b, t, dg) => {
            let seg = seg_of(b, t.dev, t.off).expect("a summary in a segment");
            let block = (t.off - b.layout.segments[seg].1) / BLOCK_U64;
            let copy = u32::from(block < u64::from(b.layout.geo.data_start()));
            let (_, at) = b.layout.seg_summary_byte(seg as u32, copy);
            let mut area = AlignedBuf::new_zeroed(b.layout.geo.summary_blocks as usize * BLOCK);
            caps[t.dev - 1].read_at(&mut area, at).unwrap();
            let geo = &b.layout.geo;
            SegmentSummary::decode(&[&area], &b.layout.group, geo, seg as u32).is_some()
        }
        _ => true,
    }
}

/// Whether `t` is in the summary of a sealed segment holding data, which scrub checks whole.
fn summary_in_use(b: &Built, t: Target, dg: &DiskGroup) -> bool {
    let (Kind::Summary { .. } | Kind::SummaryBoth { .. }) = t.kind else {
        return false;
    };
    let seg = seg_of(b, t.dev, t.off).expect("a summary in a segment");
    let info = dg.sh.segs.lock().segs[seg];
    info.state == crate::capacity::SegState::Sealed && info.used_blocks > 0
}

/// Opens a damaged copy and checks it: every view reads right or fails, scrub finds what
/// fails and mends a damaged copy of a twice-written structure, writes go on.
fn run_case(
    b: &Built,
    t: Target,
    fast: Arc<MemDevice>,
    caps: Vec<Arc<MemDevice>>,
    what: &str,
) -> Seen {
    let panics = ENGINE_PANICS.load(Ordering::SeqCst);
    let mut seen = Seen::default();
    let dg = match open(&fast, &caps) {
        Ok(dg) => dg,
        Err(e) => {
            let msg = e.to_string();
            assert!(
                matches!(e, EngineError::Format(_) | EngineError::Corrupt(_)),
                "{what}: refused with {e:?}"
            );
            assert!(msg.len() > 20, "{what}: a clear refusal, not {msg:?}");
            seen.refused = Some(msg);
            return seen;
        }
    };
    seen.read_errors = check_views(&dg, b, &BTreeMap::new(), what);
    let report = dg.scrub(&ScrubOptions::default()).expect("scrub");
    // One damaged summary copy is mended (below); both are damage to report.
    let mend = matches!(t.kind, Kind::Summary { .. });
    if seen.read_errors > 0 || (summary_in_use(b, t, &dg) && !mend) {
        assert!(!report.clean(), "{what}: scrub found nothing: {report:?}");
    }
    if mend && summary_in_use(b, t, &dg) {
        assert!(
            !report.metadata_repaired.is_empty(),
            "{what}: scrub mended nothing: {report:?}"
        );
    }
    assert!(
        mended(b, t, &dg, &fast, &caps),
        "{what}: the damaged copy was not mended: {report:?}"
    );
    let again = dg.scrub(&ScrubOptions::default()).expect("scrub");
    assert!(
        again.metadata_repaired.is_empty(),
        "{what}: repairs did not hold: {again:?}"
    );
    let mut written = BTreeMap::new();
    for (i, v) in ["a", "b", "c"].into_iter().enumerate() {
        let tag = 0xa0 + i as u8;
        let id = dg.volume(v).unwrap().id;
        dg.write(id, 7 * BLOCK_U64, &block(7, tag))
            .unwrap_or_else(|e| panic!("{what}: a write after the open: {e}"));
        written.insert(v.to_string(), tag);
    }
    dg.shutdown()
        .unwrap_or_else(|e| panic!("{what}: shutdown: {e}"));
    drop(dg);
    let dg = open(&fast, &caps).unwrap_or_else(|e| panic!("{what}: the second open: {e}"));
    check_views(&dg, b, &written, &format!("{what}, reopened"));
    dg.shutdown()
        .unwrap_or_else(|e| panic!("{what}: second shutdown: {e}"));
    assert_eq!(
        ENGINE_PANICS.load(Ordering::SeqCst),
        panics,
        "{what}: an engine thread panicked"
    );
    seen
}

fn case(b: &Built, t: Target, how: Damage, tally: &mut BTreeMap<String, usize>) {
    let what = format!(
        "{:?} at device {} offset {:#x}, {how:?}",
        t.kind, t.dev, t.off
    );
    let (fast, caps) = devices(&b.images);
    let img: &MemDevice = if t.dev == 0 { &fast } else { &caps[t.dev - 1] };
    damage(img, t.off, how);
    let seen = std::panic::catch_unwind(AssertUnwindSafe(|| run_case(b, t, fast, caps, &what)))
        .unwrap_or_else(|p| panic!("{what}: panicked: {:?}", p.downcast_ref::<String>()));
    // One bad copy of a twice-written structure (summaries included), or bad data, never
    // stops an opening; a bad header of a batch in the log may (docs/FORMAT.md §5.2, §9).
    let must_open = match t.kind {
        Kind::Superblock | Kind::Checkpoint | Kind::IndexPage { .. } => true,
        Kind::LogData | Kind::SegData | Kind::Other => true,
        Kind::Summary { .. } => true,
        Kind::SummaryBoth { .. } | Kind::LogHeader => false,
    };
    if let Some(msg) = &seen.refused {
        assert!(!must_open, "{what}: refused to open: {msg}");
    }
    let outcome = match (&seen.refused, seen.read_errors) {
        (Some(msg), _) => format!("refused: {}", msg.split(':').next().unwrap_or("")),
        (None, 0) => "opened, reads whole".into(),
        (None, _) => "opened, reads fail".into(),
    };
    *tally.entry(format!("{:?}: {outcome}", t.kind)).or_default() += 1;
}

/// Both copies of each twice-written structure: the superblocks of each device, the two
/// checkpoints, each page of the durable index and segment table.
fn both_copies(b: &Built) -> Vec<(String, [Target; 2], Option<bool>)> {
    let mut out = Vec::new();
    let at = |dev, off, kind| Target { dev, off, kind };
    for dev in 0..b.images.len() {
        let sb = |off| at(dev, off, Kind::Superblock);
        out.push((
            format!("superblocks of device {dev}"),
            [sb(0), sb(BLOCK_U64)],
            Some(true),
        ));
    }
    let [cp_a, cp_b] = b.layout.checkpoint_offsets;
    let cps = [at(0, cp_a, Kind::Checkpoint), at(0, cp_b, Kind::Checkpoint)];
    out.push(("both checkpoints".into(), cps, Some(true)));
    for (p, kind) in &b.pages {
        let copy = |addr| {
            let (dev, off) = page_place(&b.layout, addr);
            at(dev, off, Kind::IndexPage { live: true })
        };
        // A leaf is read when a lookup needs it: its damage is an error then, not at open
        // (unless open needs it to apply the summaries of recent segments).
        let refuse = (*kind != PageKind::Leaf).then_some(true);
        out.push((
            format!("{kind:?} page {p:x?}"),
            [copy(p.a), copy(p.b)],
            refuse,
        ));
    }
    out
}

/// Both copies damaged: open refuses (a structure it needs), or serves what it can read and
/// an error for the rest.
fn pair_case(b: &Built, what: &str, pair: [Target; 2], refuse: Option<bool>, how: Damage) -> Seen {
    let what = format!("{what}, {how:?}");
    let (fast, caps) = devices(&b.images);
    for t in pair {
        damage(
            if t.dev == 0 { &fast } else { &caps[t.dev - 1] },
            t.off,
            how,
        );
    }
    // Nothing to mend from: the target only names the damage.
    let t = Target {
        kind: Kind::Other,
        ..pair[0]
    };
    let seen = std::panic::catch_unwind(AssertUnwindSafe(|| run_case(b, t, fast, caps, &what)))
        .unwrap_or_else(|p| panic!("{what}: panicked: {:?}", p.downcast_ref::<String>()));
    if let Some(refuse) = refuse {
        assert_eq!(seen.refused.is_some(), refuse, "{what}: {seen:?}");
    }
    assert!(
        seen.refused.is_some() || seen.read_errors > 0,
        "{what}: no read failed"
    );
    seen
}

/// The same block of both copies of each summary in use (copy A's block in `all`, copy B's
/// at the same place in its copy).
fn summary_pairs(b: &Built, all: &[Target]) -> Vec<[Target; 2]> {
    let geo = &b.layout.geo;
    assert_eq!(geo.summary_copies, 2, "the group writes two summary copies");
    let mut out = Vec::new();
    for &t in all
        .iter()
        .filter(|t| matches!(t.kind, Kind::Summary { .. }))
    {
        let seg = seg_of(b, t.dev, t.off).expect("a summary in a segment");
        let start = b.layout.segments[seg].1;
        let block = ((t.off - start) / BLOCK_U64) as u32;
        let Some(k) = block.checked_sub(geo.summary_start(0)) else {
            continue;
        };
        let off_b = start + u64::from(geo.summary_start(1) + k) * BLOCK_U64;
        let content = read_at(&b.images[t.dev], off_b);
        // Copy B's block may since hold an index page (the segment was reused for pages).
        if classify(b, t.dev, off_b, &content) == t.kind {
            out.push([t, Target { off: off_b, ..t }]);
        }
    }
    out
}

/// Both copies of a summary block damaged: as with one copy in a group of format 2. Open
/// refuses, naming the segment, when the segment is on the recent list and the block one a
/// summary needs; otherwise it opens, and its blocks read right or fail (run_case).
fn summary_pair_case(b: &Built, pair: [Target; 2], how: Damage) -> Seen {
    let Kind::Summary { recent } = pair[0].kind else {
        unreachable!("a summary pair")
    };
    let seg = seg_of(b, pair[0].dev, pair[0].off).expect("a summary in a segment");
    let what = format!(
        "both copies of summary block at {:#x}/{:#x} of segment {seg}, {how:?}",
        pair[0].off, pair[1].off
    );
    let (fast, caps) = devices(&b.images);
    for t in pair {
        damage(&caps[t.dev - 1], t.off, how);
    }
    let t = Target {
        kind: Kind::SummaryBoth { recent },
        ..pair[0]
    };
    let seen = std::panic::catch_unwind(AssertUnwindSafe(|| run_case(b, t, fast, caps, &what)))
        .unwrap_or_else(|p| panic!("{what}: panicked: {:?}", p.downcast_ref::<String>()));
    match &seen.refused {
        Some(msg) => {
            assert!(recent, "{what}: refused to open: {msg}");
            assert!(
                msg.contains(&format!("capacity segment {seg},")),
                "{what}: the refusal names the segment: {msg}"
            );
        }
        None => assert!(
            !recent,
            "{what}: a recent segment's summary is needed at open"
        ),
    }
    seen
}

fn sweep(power_cut: bool, seed: u64) {
    count_engine_panics();
    let b = build(power_cut);
    let mut rng = StdRng::seed_from_u64(seed);
    let all = targets(&b, &mut rng);
    let mut tally = BTreeMap::new();
    for t in &all {
        case(
            &b,
            *t,
            Damage::FlipByte(rng.gen_range(0..BLOCK)),
            &mut tally,
        );
        let second = match rng.gen_bool(0.5) {
            true => Damage::Zero,
            false => Damage::Garbage(rng.gen()),
        };
        case(&b, *t, second, &mut tally);
    }
    for (what, pair, refuse) in both_copies(&b) {
        // A byte every structure's crc covers (a checkpoint's padding is not covered).
        for how in [Damage::Zero, Damage::FlipByte(rng.gen_range(0..64))] {
            let seen = pair_case(&b, &what, pair, refuse, how);
            let outcome = seen
                .refused
                .map_or("opened".into(), |m| format!("refused: {m}"));
            eprintln!("both copies of {what}, {how:?}: {outcome}");
        }
    }
    let pairs = summary_pairs(&b, &all);
    for pair in &pairs {
        // A flipped byte within the block's first 64: in a crc block, crcs of data blocks in
        // use; in the header region's first block, the header.
        for how in [Damage::Zero, Damage::FlipByte(rng.gen_range(0..64))] {
            let seen = summary_pair_case(&b, *pair, how);
            *tally
                .entry(format!(
                    "{:?} both copies: {}",
                    pair[0].kind,
                    match (&seen.refused, seen.read_errors) {
                        (Some(_), _) => "refused",
                        (None, 0) => "opened, reads whole",
                        (None, _) => "opened, reads fail",
                    }
                ))
                .or_default() += 1;
        }
    }
    assert!(
        !pairs.is_empty(),
        "no summary in use to damage in both copies"
    );
    let kinds: Vec<PageKind> = b.pages.iter().map(|p| p.1).collect();
    eprintln!(
        "power cut {power_cut}: {} blocks damaged; index pages {kinds:?}, recent segments {:?}: {tally:#?}",
        all.len(),
        b.cp.recent
    );
}

#[test]
fn every_damaged_metadata_block_is_refused_or_read_right_after_a_clean_shutdown() {
    sweep(false, seed_for("damage sweep, clean shutdown"));
}

#[test]
fn every_damaged_metadata_block_is_refused_or_read_right_after_a_power_cut() {
    sweep(true, seed_for("damage sweep, power cut"));
}
