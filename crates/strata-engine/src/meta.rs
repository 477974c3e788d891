//! The index on the devices: reading index pages (either copy), and the index flush that
//! writes the tree's dirty pages and the segment table copy-on-write, then commits them with
//! a checkpoint.
//!
//! A flush (run by the destager thread, which is the only one that changes the tree and the
//! segment table's live counts) goes:
//! 1. assign every dirty node and changed segment-table page a place in streams A and B and
//!    encode it (tree read lock only: readers go on);
//! 2. write the pages in long sequential runs and flush the devices;
//! 3. write the checkpoint naming the new root and pages, with the recent-segment list emptied;
//! 4. mark the nodes clean, and free what the old index used: old pages, and segments that
//!    were only waiting for a durable index without references to them.

use std::sync::atomic::Ordering;

use strata_device::AlignedBuf;

use crate::capacity::{discard_segments, SegTable};
use crate::ctree::page::{decode, encode, PageBody};
use crate::ctree::{CTree, FlushPlan, Miss, PagePtr};
use crate::error::EngineError;
use crate::format::{BLOCK, BLOCK_U64};
use crate::shared::{IndexParts, Shared};

/// Byte offset of page address `addr` on its capacity device.
fn page_place(sh: &Shared, addr: u64) -> Option<(usize, u64)> {
    let seg = (addr >> 32) as usize;
    let block = addr as u32;
    let (dev, off) = *sh.layout.segments.get(seg)?;
    (u64::from(block) < sh.layout.segment_size_bytes / BLOCK_U64)
        .then(|| (dev, off + u64::from(block) * BLOCK_U64))
}

/// Reads a page, trying copy B when copy A is unreadable or damaged. A damaged copy is
/// counted and logged (a scrub or the next flush of that node repairs it).
pub fn read_page(sh: &Shared, ptr: PagePtr) -> Result<PageBody, EngineError> {
    let mut why = Vec::new();
    for (copy, addr) in [("A", ptr.a), ("B", ptr.b)] {
        match read_copy(sh, addr) {
            Ok(Some(body)) => {
                if !why.is_empty() {
                    sh.counters
                        .index_copy_repairs_needed
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        page_a = ptr.a,
                        page_b = ptr.b,
                        "index page copy A was bad ({}); read copy B",
                        why.join("; ")
                    );
                }
                return Ok(body);
            }
            Ok(None) => why.push(format!("copy {copy} at {addr:#x} fails its checks")),
            Err(e) => why.push(format!("copy {copy}: {e}")),
        }
    }
    sh.checksum_error(sh.seg_device((ptr.a >> 32) as u32), 1);
    sh.checksum_error(sh.seg_device((ptr.b >> 32) as u32), 1);
    tracing::error!(
        page_a = ptr.a,
        page_b = ptr.b,
        "index page unreadable in both copies: {}",
        why.join("; ")
    );
    Err(EngineError::Corrupt(format!(
        "index page {:#x}/{:#x} is damaged in both copies",
        ptr.a, ptr.b
    )))
}

/// One copy of a page: None when it does not decode as the page written there.
pub fn read_copy(sh: &Shared, addr: u64) -> Result<Option<PageBody>, EngineError> {
    let (dev, off) = page_place(sh, addr).ok_or_else(|| {
        EngineError::Corrupt(format!(
            "index page address {addr:#x} is outside the devices"
        ))
    })?;
    let mut b = AlignedBuf::new_zeroed(BLOCK);
    sh.caps[dev].read_at(&mut b, off)?;
    Ok(decode(&b, &sh.layout.group, addr).map(|(body, _)| body))
}

/// Reads the page a lookup missed and installs it in the tree.
pub fn load(sh: &Shared, miss: Miss) -> Result<(), EngineError> {
    #[cfg(test)]
    {
        let hook = sh.before_page_load.lock().clone();
        if let Some(hook) = hook {
            hook();
        }
    }
    let body = read_page(sh, miss.ptr)?;
    sh.counters.index_page_reads.fetch_add(1, Ordering::Relaxed);
    sh.tree.write().install(miss, body);
    Ok(())
}

/// Runs a tree operation until it stops missing pages, loading them as needed.
pub fn with_tree<T>(
    sh: &Shared,
    mut f: impl FnMut(&mut CTree) -> Result<T, Miss>,
) -> Result<T, EngineError> {
    for _ in 0..MAX_TREE_RETRIES {
        let miss = match f(&mut sh.tree.write()) {
            Ok(v) => return Ok(v),
            Err(m) => m,
        };
        load(sh, miss)?;
    }
    Err(EngineError::Failed(
        "the index kept missing pages (cache too small for one operation?)".into(),
    ))
}

/// Like `with_tree`, under the read lock.
pub fn with_tree_read<T>(
    sh: &Shared,
    mut f: impl FnMut(&CTree) -> Result<T, Miss>,
) -> Result<T, EngineError> {
    for _ in 0..MAX_TREE_RETRIES {
        let miss = match f(&sh.tree.read()) {
            Ok(v) => return Ok(v),
            Err(m) => m,
        };
        load(sh, miss)?;
    }
    Err(EngineError::Failed(
        "the index kept missing pages (cache too small for one operation?)".into(),
    ))
}

/// Like `with_tree_read`, with the index (volume table and fast maps) read-locked first, in
/// the lock order.
pub fn with_index_tree<T>(
    sh: &Shared,
    mut f: impl FnMut(&crate::shared::Index, &CTree) -> Result<T, Miss>,
) -> Result<T, EngineError> {
    for _ in 0..MAX_TREE_RETRIES {
        let miss = {
            let idx = sh.index.read();
            let tree = sh.tree.read();
            match f(&idx, &tree) {
                Ok(v) => return Ok(v),
                Err(m) => m,
            }
        };
        load(sh, miss)?;
    }
    Err(EngineError::Failed(
        "the index kept missing pages (cache too small for one operation?)".into(),
    ))
}

/// Each retry loads one page, and one operation may touch many leaves.
pub const MAX_TREE_RETRIES: usize = 1 << 20;

/// Pages to write in one flush: (address, bytes), both copies.
struct PageWrites {
    pages: Vec<(u64, Vec<u8>)>,
}

/// Writes the index and commits it. The caller is the only thread changing the tree and the
/// segment table's live counts (the destager, or open/shutdown with the destager stopped).
pub fn flush_index(sh: &Shared) -> Result<(), EngineError> {
    let _one = sh.flush_guard.lock();
    let started = std::time::Instant::now();
    let generation = sh.durable.lock().index_generation + 1;
    // 1. Places and contents.
    let (plan, writes, parts) = {
        let tree = sh.tree.read();
        let mut segs = sh.segs.lock();
        // Page copies placed so far: given back if the planning fails half way (no room).
        let mut placed = Vec::new();
        let planned = (|| {
            let plan = tree.plan_flush(&mut || alloc_ptr(&mut segs, &mut placed))?;
            let segtab = plan_segtab(&mut segs, &mut placed)?;
            Ok::<_, EngineError>((plan, segtab))
        })();
        let (plan, segtab) = match planned {
            Ok(planned) => planned,
            Err(e) => {
                for addr in placed {
                    segs.page_freed(addr);
                }
                return Err(e);
            }
        };
        let mut writes = PageWrites {
            pages: Vec::with_capacity(2 * (plan.pages.len() + segtab.len())),
        };
        for (ptr, body) in plan
            .pages
            .iter()
            .map(|(p, b)| (p, b))
            .chain(segtab.iter().map(|(_, p, b)| (p, b)))
        {
            for addr in [ptr.a, ptr.b] {
                writes
                    .pages
                    .push((addr, encode(body, &sh.layout.group, generation, addr)));
            }
        }
        let mut segtab_ptrs = segs.page_ptrs.clone();
        for (page, ptr, _) in &segtab {
            segtab_ptrs[*page] = Some(*ptr);
        }
        let parts = IndexParts {
            root: Some(plan.root),
            generation,
            segtab: segtab_ptrs,
            streams: segs.streams,
            recent: Vec::new(),
        };
        (plan, writes, parts)
    };
    // 2. The pages, durable. 3. The commit point.
    let committed = write_pages(sh, &writes).and_then(|()| {
        let mut d = sh.durable.lock();
        let tail = sh.log.lock().tail();
        sh.write_checkpoint_parts(&mut d, tail, &parts)?;
        d.index_root = parts.root;
        d.index_generation = generation;
        // Everything below is now what the durable index says: no checkpoint written after
        // this may still name the old recent segments or pages.
        let mut segs = sh.segs.lock();
        let old = std::mem::replace(&mut segs.page_ptrs, parts.segtab.clone());
        segs.durable_streams = parts.streams;
        segs.dirty_pages.clear();
        segs.recent.clear();
        Ok(old)
    });
    let old_segtab = match committed {
        Ok(old) => old,
        Err(e) => {
            // Nothing references the pages placed for this flush: give them back.
            let mut segs = sh.segs.lock();
            for (addr, _) in &writes.pages {
                segs.page_freed(*addr);
            }
            return Err(e);
        }
    };
    // 4. Clean nodes; free what the old index used.
    commit(sh, &plan, &old_segtab, &parts.segtab);
    sh.counters.index_flushes.fetch_add(1, Ordering::Relaxed);
    sh.counters
        .index_pages_written
        .fetch_add(writes.pages.len() as u64, Ordering::Relaxed);
    if !writes.pages.is_empty() {
        crate::room::note_success(sh, crate::room::Write::Other, None);
    }
    tracing::debug!(
        pages = writes.pages.len(),
        ms = started.elapsed().as_millis() as u64,
        "index flushed"
    );
    Ok(())
}

/// Places both copies of a page, noting each copy placed in `placed`.
fn alloc_ptr(segs: &mut SegTable, placed: &mut Vec<u64>) -> Result<PagePtr, EngineError> {
    let a = segs.alloc_page(0)?;
    placed.push(a);
    let b = segs.alloc_page(1)?;
    placed.push(b);
    Ok(PagePtr { a, b })
}

/// Places the changed segment-table pages. Placing pages can open a new index segment, which
/// changes the table again, so this runs until nothing new is dirty.
fn plan_segtab(
    segs: &mut SegTable,
    placed_copies: &mut Vec<u64>,
) -> Result<Vec<(usize, PagePtr, PageBody)>, EngineError> {
    let mut placed: Vec<(usize, PagePtr)> = Vec::new();
    loop {
        let todo: Vec<usize> = segs
            .dirty_pages
            .iter()
            .copied()
            .filter(|p| !placed.iter().any(|x| x.0 == *p))
            .collect();
        if todo.is_empty() {
            break;
        }
        for page in todo {
            let ptr = alloc_ptr(segs, placed_copies)?;
            placed.push((page, ptr));
        }
    }
    // Encoded last, from the final state (including every page placed above).
    Ok(placed
        .into_iter()
        .map(|(page, ptr)| (page, ptr, PageBody::SegTable(segs.page_records(page))))
        .collect())
}

/// Writes page copies in runs of consecutive addresses (one write per run), then flushes
/// every device written.
fn write_pages(sh: &Shared, w: &PageWrites) -> Result<(), EngineError> {
    let mut sorted: Vec<&(u64, Vec<u8>)> = w.pages.iter().collect();
    sorted.sort_by_key(|p| p.0);
    let mut touched = vec![false; sh.caps.len()];
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i + 1;
        while j < sorted.len()
            && sorted[j].0 == sorted[j - 1].0 + 1
            && (sorted[j].0 >> 32) == (sorted[i].0 >> 32)
        {
            j += 1;
        }
        let (dev, off) = page_place(sh, sorted[i].0)
            .ok_or_else(|| EngineError::Failed("index page placed outside the devices".into()))?;
        let mut buf = AlignedBuf::new_zeroed((j - i) * BLOCK);
        for (k, p) in sorted[i..j].iter().enumerate() {
            buf[k * BLOCK..(k + 1) * BLOCK].copy_from_slice(&p.1);
        }
        sh.caps[dev].write_at(&buf, off)?;
        touched[dev] = true;
        i = j;
    }
    for (dev, t) in touched.iter().enumerate() {
        if *t {
            sh.caps[dev].flush()?;
        }
    }
    Ok(())
}

fn commit(
    sh: &Shared,
    plan: &FlushPlan,
    old_segtab: &[Option<PagePtr>],
    new_segtab: &[Option<PagePtr>],
) {
    let freed = sh.tree.write().commit_flush(plan);
    // No reader may still be using a location in a segment about to be discarded or reused.
    drop(sh.reclaim.write());
    let pending = {
        let mut segs = sh.segs.lock();
        for p in &freed {
            segs.page_freed(p.a);
            segs.page_freed(p.b);
        }
        for (old, new) in old_segtab.iter().zip(new_segtab) {
            if let (Some(o), true) = (old, old != new) {
                segs.page_freed(o.a);
                segs.page_freed(o.b);
            }
        }
        segs.segs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == crate::capacity::SegState::PendingFree)
            .map(|(i, _)| i as u32)
            .collect::<Vec<_>>()
    };
    // Still pending (not reusable) while they are discarded; this thread is the only allocator.
    discard_segments(sh, &pending);
    let released = sh.segs.lock().release_pending();
    debug_assert!(released.len() >= pending.len());
    if !released.is_empty() {
        sh.counters.capacity_full.store(false, Ordering::Relaxed);
    }
}
