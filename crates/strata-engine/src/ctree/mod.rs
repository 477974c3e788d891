//! The capacity index: where every block that reached the capacity tier lives, for every
//! layer (volume head, snapshot, clone base), as one copy-on-write B+tree of extents keyed by
//! (layer, lba).
//!
//! Memory is bounded: leaves are paged. Inner nodes stay resident once loaded (one per ~144
//! leaves); clean leaves are evicted least recently used first; dirty nodes stay until the
//! next flush writes them to new places (copy-on-write), so the page set a durable checkpoint
//! names is never overwritten. The tree does no I/O itself: a lookup or change that needs a
//! page that is not resident returns a [`Miss`]; the caller reads the page with no lock held,
//! [`CTree::install`]s it and tries again. Changes check residency first, so a `Miss` never
//! leaves a change half done (`redirty` excepted: its next try completes it).
//!
//! Extents never cross a leaf's key range: a change is cut at leaf boundaries, so a lookup
//! only needs the leaves whose ranges overlap the query.

pub mod page;
#[cfg(test)]
mod tests;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::map::{same_area, Loc};
use page::{PageBody, INNER_MAX, LEAF_MAX};

/// (layer << 64) | lba.
pub type Key = u128;

/// The two places a page is written (copy A and copy B), as (segment << 32) | block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PagePtr {
    pub a: u64,
    pub b: u64,
}

/// `len` blocks from `key` at `loc` (a capacity location or a zero run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub key: Key,
    pub len: u64,
    pub loc: Loc,
}

impl Entry {
    pub fn end(&self) -> Key {
        self.key + u128::from(self.len)
    }

    /// The part of the entry inside `[start, end)` (which must overlap it).
    fn clip(&self, start: Key, end: Key) -> Entry {
        let s = self.key.max(start);
        let t = self.end().min(end);
        Entry {
            key: s,
            len: (t - s) as u64,
            loc: self.loc.advance((s - self.key) as u64),
        }
    }
}

/// A page that must be read and installed before the operation can go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Miss {
    /// A key inside the page's range (what `install` follows to find its place).
    pub key: Key,
    pub ptr: PagePtr,
}

pub enum Child {
    Mem(Box<Node>),
    Disk(PagePtr),
}

pub struct Node {
    body: Body,
    /// Changed since it was last written; its old page (if any) is in `CTree::freed`.
    dirty: bool,
    /// Where the clean copy of this node lives.
    ptr: Option<PagePtr>,
    /// Clock value of the last lookup that used it (LRU for leaves).
    stamp: AtomicU64,
}

enum Body {
    Leaf(Vec<Entry>),
    /// Children with the lowest key of their range; the first child's key is ignored (its
    /// range starts where the parent's does).
    Inner(Vec<(Key, Child)>),
}

impl Node {
    fn new(body: Body) -> Node {
        Node {
            body,
            dirty: true,
            ptr: None,
            stamp: AtomicU64::new(0),
        }
    }

    /// A clean node read from `ptr`.
    pub fn from_page(body: PageBody, ptr: PagePtr) -> Option<Node> {
        let body = match body {
            PageBody::Leaf(e) => Body::Leaf(e),
            PageBody::Inner(c) => {
                Body::Inner(c.into_iter().map(|(k, p)| (k, Child::Disk(p))).collect())
            }
            PageBody::SegTable(_) => return None,
        };
        Some(Node {
            body,
            dirty: false,
            ptr: Some(ptr),
            stamp: AtomicU64::new(0),
        })
    }

    fn is_leaf(&self) -> bool {
        matches!(self.body, Body::Leaf(_))
    }

    fn is_empty(&self) -> bool {
        match &self.body {
            Body::Leaf(e) => e.is_empty(),
            Body::Inner(c) => c.len() == 1 && matches!(&c[0].1, Child::Mem(n) if n.is_empty()),
        }
    }
}

/// Counters kept up to date by every change (what `stats` and the memory bound use).
#[derive(Debug, Default, Clone, Copy)]
pub struct TreeCounts {
    pub resident_leaves: usize,
    pub resident_inner: usize,
    pub dirty_nodes: usize,
}

/// The pages a flush writes, children before parents, and the root they lead to.
pub struct FlushPlan {
    pub pages: Vec<(PagePtr, PageBody)>,
    pub root: PagePtr,
}

pub struct CTree {
    root: Child,
    clock: AtomicU64,
    counts: TreeCounts,
    /// Pages of nodes changed or removed since the last flush: free once the next flush is durable.
    freed: Vec<PagePtr>,
}

const KEY_MIN: Key = 0;
const KEY_MAX: Key = u128::MAX;

impl CTree {
    /// An empty tree (one empty, dirty leaf).
    pub fn new() -> CTree {
        let counts = TreeCounts {
            resident_leaves: 1,
            resident_inner: 0,
            dirty_nodes: 1,
        };
        CTree {
            root: Child::Mem(Box::new(Node::new(Body::Leaf(Vec::new())))),
            clock: AtomicU64::new(1),
            counts,
            freed: Vec::new(),
        }
    }

    /// The tree a checkpoint names (None: empty). Nothing is read until it is needed.
    pub fn open(root: Option<PagePtr>) -> CTree {
        match root {
            None => CTree::new(),
            Some(p) => CTree {
                root: Child::Disk(p),
                clock: AtomicU64::new(1),
                counts: TreeCounts::default(),
                freed: Vec::new(),
            },
        }
    }

    pub fn counts(&self) -> TreeCounts {
        self.counts
    }

    /// The extents inside `[start, end)`, clipped to it, in key order (holes are absent).
    pub fn lookup(&self, start: Key, end: Key, out: &mut Vec<Entry>) -> Result<(), Miss> {
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        if start < end {
            lookup_in(
                &self.root,
                KEY_MIN,
                KEY_MAX,
                start,
                end,
                now,
                out,
                usize::MAX,
            )?;
        }
        Ok(())
    }

    /// At most `limit` extents from `[start, end)` in key order.
    pub fn first_entries(
        &self,
        start: Key,
        end: Key,
        limit: usize,
        out: &mut Vec<Entry>,
    ) -> Result<(), Miss> {
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        if start < end && limit > 0 {
            lookup_in(&self.root, KEY_MIN, KEY_MAX, start, end, now, out, limit)?;
        }
        Ok(())
    }

    /// Every node a change of `[start, end)` touches is resident.
    pub fn ensure_resident(&self, start: Key, end: Key) -> Result<(), Miss> {
        if start < end {
            resident_in(&self.root, KEY_MIN, KEY_MAX, start, end)?;
        }
        Ok(())
    }

    /// Puts a page read for `miss` in its place, if that place still wants it.
    pub fn install(&mut self, miss: Miss, body: PageBody) {
        let Some(node) = Node::from_page(body, miss.ptr) else {
            return;
        };
        node.stamp.store(
            self.clock.fetch_add(1, Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let leaf = node.is_leaf();
        if install_in(&mut self.root, KEY_MIN, KEY_MAX, miss, node) {
            if leaf {
                self.counts.resident_leaves += 1;
            } else {
                self.counts.resident_inner += 1;
            }
        }
    }

    /// Points `[start, end)` at `loc` (consecutive blocks) or at nothing, and returns what it
    /// displaced (clipped to the range). Nothing changes when a page is missing.
    pub fn set(&mut self, start: Key, end: Key, loc: Option<Loc>) -> Result<Vec<Entry>, Miss> {
        self.ensure_resident(start, end)?;
        let mut displaced = Vec::new();
        if start >= end {
            return Ok(displaced);
        }
        let split = {
            let Child::Mem(root) = &mut self.root else {
                unreachable!("checked resident")
            };
            let mut cx = Cx {
                counts: &mut self.counts,
                freed: &mut self.freed,
                displaced: &mut displaced,
            };
            set_in(root, KEY_MIN, KEY_MAX, start, end, loc, &mut cx).1
        };
        if let Some((k, right)) = split {
            let old = std::mem::replace(&mut self.root, Child::Disk(PagePtr { a: 0, b: 0 }));
            self.root = Child::Mem(Box::new(Node::new(Body::Inner(vec![
                (KEY_MIN, old),
                (k, Child::Mem(right)),
            ]))));
            self.counts.resident_inner += 1;
            self.counts.dirty_nodes += 1;
        }
        self.collapse_root();
        Ok(displaced)
    }

    /// A root with a single resident child gives way to it.
    fn collapse_root(&mut self) {
        loop {
            let Child::Mem(root) = &mut self.root else {
                return;
            };
            let Body::Inner(children) = &mut root.body else {
                return;
            };
            if children.len() != 1 || !matches!(children[0].1, Child::Mem(_)) {
                return;
            }
            let (_, only) = children.pop().expect("one child");
            if let Some(p) = root.ptr {
                self.freed.push(p);
            }
            if root.dirty {
                self.counts.dirty_nodes -= 1;
            }
            self.counts.resident_inner -= 1;
            self.root = only;
        }
    }

    /// Evicts clean nodes, least recently used first, until at most `keep` nodes are
    /// resident: leaves first, then inner nodes none of whose children is resident (the root
    /// always stays). Dirty nodes are never evicted.
    pub fn evict(&mut self, keep: usize) {
        for inner in [false, true] {
            let resident = self.counts.resident_leaves + self.counts.resident_inner;
            if resident <= keep {
                return;
            }
            let mut cands = Vec::new();
            collect_evictable(&self.root, KEY_MIN, KEY_MAX, 0, inner, &mut cands);
            cands.sort_unstable_by_key(|c| c.0);
            for &(_, lo, depth) in cands.iter().take(resident - keep) {
                if evict_at(&mut self.root, KEY_MIN, KEY_MAX, lo, depth) {
                    if inner {
                        self.counts.resident_inner -= 1;
                    } else {
                        self.counts.resident_leaves -= 1;
                    }
                }
            }
        }
    }

    /// Assigns a place to every dirty node (children first) and returns their pages. The tree
    /// must not change until `commit_flush`.
    pub fn plan_flush<E>(
        &self,
        alloc: &mut dyn FnMut() -> Result<PagePtr, E>,
    ) -> Result<FlushPlan, E> {
        let mut pages = Vec::with_capacity(self.counts.dirty_nodes);
        let root = plan_in(&self.root, alloc, &mut pages)?;
        Ok(FlushPlan { pages, root })
    }

    /// Marks the planned nodes clean at their new places (once the pages and the checkpoint
    /// naming `plan.root` are durable) and returns the old pages, now free.
    pub fn commit_flush(&mut self, plan: &FlushPlan) -> Vec<PagePtr> {
        let mut next = plan.pages.iter().map(|(p, _)| *p);
        commit_in(&mut self.root, &mut next);
        debug_assert!(next.next().is_none(), "flush plan and tree disagree");
        self.counts.dirty_nodes = 0;
        std::mem::take(&mut self.freed)
    }

    /// Marks dirty every node whose page satisfies `moving` (and their ancestors), so the next
    /// flush writes them elsewhere. Returns a miss while a node it must look at (any inner node,
    /// or a leaf that moves) is not resident. Unlike other changes it does not check residency
    /// first: a miss can leave the nodes to its left dirtied and their ancestors not yet. The
    /// try after the install finishes it, since a node already dirty counts as changed.
    pub fn redirty(&mut self, moving: &dyn Fn(PagePtr) -> bool) -> Result<usize, Miss> {
        let levels = self.inner_levels()?;
        let mut cx = Cx {
            counts: &mut self.counts,
            freed: &mut self.freed,
            displaced: &mut Vec::new(),
        };
        let mut n = 0;
        redirty_in(
            &mut self.root,
            KEY_MIN,
            KEY_MAX,
            levels,
            moving,
            &mut cx,
            &mut n,
        )?;
        Ok(n)
    }

    /// Inner levels above the leaves (every leaf is at the same depth).
    fn inner_levels(&self) -> Result<usize, Miss> {
        let mut levels = 0;
        let mut at = &self.root;
        loop {
            match at {
                Child::Disk(p) => {
                    return Err(Miss {
                        key: KEY_MIN,
                        ptr: *p,
                    })
                }
                Child::Mem(n) => match &n.body {
                    Body::Leaf(_) => return Ok(levels),
                    Body::Inner(children) => {
                        levels += 1;
                        at = &children[0].1;
                    }
                },
            }
        }
    }

    /// Heap bytes held by resident nodes (their allocations, not an estimate per entry).
    pub fn resident_bytes(&self) -> usize {
        fn walk(c: &Child) -> usize {
            let Child::Mem(n) = c else { return 0 };
            std::mem::size_of::<Node>()
                + match &n.body {
                    Body::Leaf(e) => e.capacity() * std::mem::size_of::<Entry>(),
                    Body::Inner(ch) => {
                        ch.capacity() * std::mem::size_of::<(Key, Child)>()
                            + ch.iter().map(|x| walk(&x.1)).sum::<usize>()
                    }
                }
        }
        walk(&self.root)
    }

    /// Every page the tree references that is known without reading (resident nodes' own
    /// pages and their not-resident children), with whether its node is a leaf where known.
    pub fn known_pages(&self, out: &mut Vec<PagePtr>) {
        known_in(&self.root, out);
    }
}

impl Default for CTree {
    fn default() -> Self {
        CTree::new()
    }
}

struct Cx<'a> {
    counts: &'a mut TreeCounts,
    freed: &'a mut Vec<PagePtr>,
    displaced: &'a mut Vec<Entry>,
}

impl Cx<'_> {
    fn dirty(&mut self, node: &mut Node) {
        if !node.dirty {
            node.dirty = true;
            if let Some(p) = node.ptr.take() {
                self.freed.push(p);
            }
            self.counts.dirty_nodes += 1;
        }
    }

    fn forget(&mut self, node: &Node) {
        if let Some(p) = node.ptr {
            self.freed.push(p);
        }
        if node.dirty {
            self.counts.dirty_nodes -= 1;
        }
        if node.is_leaf() {
            self.counts.resident_leaves -= 1;
        } else {
            self.counts.resident_inner -= 1;
        }
    }
}

/// Children of an inner node whose ranges overlap `[start, end)`.
fn overlapping(children: &[(Key, Child)], start: Key, end: Key) -> Range<usize> {
    let first = children[1..].partition_point(|c| c.0 <= start);
    let last = children[1..].partition_point(|c| c.0 < end) + 1;
    first..last.max(first)
}

fn bounds(children: &[(Key, Child)], i: usize, lo: Key, hi: Key) -> (Key, Key) {
    let clo = if i == 0 { lo } else { children[i].0 };
    let chi = children.get(i + 1).map_or(hi, |c| c.0);
    (clo, chi)
}

#[allow(clippy::too_many_arguments)]
fn lookup_in(
    child: &Child,
    lo: Key,
    hi: Key,
    start: Key,
    end: Key,
    now: u64,
    out: &mut Vec<Entry>,
    limit: usize,
) -> Result<(), Miss> {
    let node = match child {
        Child::Disk(p) => {
            return Err(Miss {
                key: start.max(lo),
                ptr: *p,
            })
        }
        Child::Mem(n) => n,
    };
    node.stamp.store(now, Ordering::Relaxed);
    match &node.body {
        Body::Leaf(entries) => {
            let i = entries.partition_point(|e| e.end() <= start);
            for e in entries[i..].iter().take_while(|e| e.key < end) {
                if out.len() >= limit {
                    break;
                }
                out.push(e.clip(start, end));
            }
        }
        Body::Inner(children) => {
            for i in overlapping(children, start, end) {
                if out.len() >= limit {
                    break;
                }
                let (clo, chi) = bounds(children, i, lo, hi);
                lookup_in(
                    &children[i].1,
                    clo,
                    chi,
                    start.max(clo),
                    end.min(chi),
                    now,
                    out,
                    limit,
                )?;
            }
        }
    }
    Ok(())
}

fn resident_in(child: &Child, lo: Key, hi: Key, start: Key, end: Key) -> Result<(), Miss> {
    match child {
        Child::Disk(p) => Err(Miss {
            key: start.max(lo),
            ptr: *p,
        }),
        Child::Mem(n) => match &n.body {
            Body::Leaf(_) => Ok(()),
            Body::Inner(children) => {
                for i in overlapping(children, start, end) {
                    let (clo, chi) = bounds(children, i, lo, hi);
                    resident_in(&children[i].1, clo, chi, start.max(clo), end.min(chi))?;
                }
                Ok(())
            }
        },
    }
}

fn install_in(child: &mut Child, lo: Key, hi: Key, miss: Miss, node: Node) -> bool {
    match child {
        Child::Disk(p) if *p == miss.ptr && (lo..hi).contains(&miss.key) => {
            *child = Child::Mem(Box::new(node));
            true
        }
        Child::Disk(_) => false,
        Child::Mem(n) => match &mut n.body {
            Body::Leaf(_) => false,
            Body::Inner(children) => {
                let i = children[1..].partition_point(|c| c.0 <= miss.key);
                let (clo, chi) = bounds(children, i, lo, hi);
                install_in(&mut children[i].1, clo, chi, miss, node)
            }
        },
    }
}

/// Applies a change to a resident subtree; returns whether it changed and a new right
/// sibling when the node split.
fn set_in(
    node: &mut Node,
    lo: Key,
    hi: Key,
    start: Key,
    end: Key,
    loc: Option<Loc>,
    cx: &mut Cx<'_>,
) -> (bool, Option<(Key, Box<Node>)>) {
    let (changed, appended) = match &mut node.body {
        Body::Leaf(entries) => set_leaf(entries, start, end, loc, cx.displaced),
        Body::Inner(children) => set_inner(children, lo, hi, start, end, loc, cx),
    };
    if !changed {
        return (false, None);
    }
    cx.dirty(node);
    // An append at the end of a layer's key range keeps the left node full: address-ordered
    // data then fills nodes instead of leaving them half empty.
    let layer_end = hi == KEY_MAX || (hi >> 64) != (start >> 64);
    (true, split_if_full(node, cx, appended && layer_end))
}

/// Returns whether the leaf changed, and whether the change went past its last entry (an
/// append, the common case of address-ordered destage).
fn set_leaf(
    entries: &mut Vec<Entry>,
    start: Key,
    end: Key,
    loc: Option<Loc>,
    displaced: &mut Vec<Entry>,
) -> (bool, bool) {
    let i0 = entries.partition_point(|e| e.end() <= start);
    let i1 = entries.partition_point(|e| e.key < end);
    if i0 >= i1 && loc.is_none() {
        return (false, false);
    }
    let appended = i1 >= entries.len();
    let mut repl = Vec::with_capacity(3);
    let mut right = None;
    for e in &entries[i0..i1.max(i0)] {
        if e.key < start {
            repl.push(Entry {
                key: e.key,
                len: (start - e.key) as u64,
                loc: e.loc,
            });
        }
        displaced.push(e.clip(start, end));
        if e.end() > end {
            right = Some(Entry {
                key: end,
                len: (e.end() - end) as u64,
                loc: e.loc.advance((end - e.key) as u64),
            });
        }
    }
    if let Some(l) = loc {
        repl.push(Entry {
            key: start,
            len: (end - start) as u64,
            loc: l,
        });
    }
    repl.extend(right);
    let n = repl.len();
    entries.splice(i0..i1.max(i0), repl);
    merge_window(
        entries,
        i0.saturating_sub(1),
        (i0 + n + 1).min(entries.len()),
    );
    (true, appended)
}

/// Merges neighbours in `entries[from..to]` that continue each other.
fn merge_window(entries: &mut Vec<Entry>, from: usize, to: usize) {
    let mut i = from;
    let mut to = to;
    while i + 1 < to {
        let (a, b) = (entries[i], entries[i + 1]);
        if a.end() == b.key && a.loc.advance(a.len) == b.loc && same_area(a.loc, b.loc) {
            entries[i].len += b.len;
            entries.remove(i + 1);
            to -= 1;
        } else {
            i += 1;
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn set_inner(
    children: &mut Vec<(Key, Child)>,
    lo: Key,
    hi: Key,
    start: Key,
    end: Key,
    loc: Option<Loc>,
    cx: &mut Cx<'_>,
) -> (bool, bool) {
    let range = overlapping(children, start, end);
    let appended = range.end >= children.len();
    let mut changed = false;
    let mut splits = Vec::new();
    for i in range.clone() {
        let (clo, chi) = bounds(children, i, lo, hi);
        let Child::Mem(child) = &mut children[i].1 else {
            unreachable!("checked resident")
        };
        // The part of the change inside this child starts further on: so does its location.
        let from = start.max(clo);
        let part_loc = loc.map(|l| l.advance((from - start) as u64));
        let (c, split) = set_in(child, clo, chi, from, end.min(chi), part_loc, cx);
        changed |= c;
        if let Some(s) = split {
            splits.push((i + 1, s));
        }
    }
    for (at, (k, node)) in splits.into_iter().rev() {
        children.insert(at, (k, Child::Mem(node)));
    }
    if changed {
        remove_empty(children, cx);
    }
    (changed, appended)
}

/// Drops children that hold nothing (at least one child always stays).
fn remove_empty(children: &mut Vec<(Key, Child)>, cx: &mut Cx<'_>) {
    let mut i = 0;
    while i < children.len() && children.len() > 1 {
        let empty = matches!(&children[i].1, Child::Mem(n) if n.is_empty());
        if !empty {
            i += 1;
            continue;
        }
        let (_, child) = children.remove(i);
        if let Child::Mem(n) = child {
            forget_subtree(&n, cx);
        }
    }
}

/// Accounts for a removed (empty) subtree: its pages become free, its nodes leave memory.
fn forget_subtree(n: &Node, cx: &mut Cx<'_>) {
    if let Body::Inner(children) = &n.body {
        for (_, c) in children {
            match c {
                Child::Mem(m) => forget_subtree(m, cx),
                Child::Disk(p) => cx.freed.push(*p),
            }
        }
    }
    cx.forget(n);
}

fn split_if_full(node: &mut Node, cx: &mut Cx<'_>, appended: bool) -> Option<(Key, Box<Node>)> {
    let right = match &mut node.body {
        Body::Leaf(entries) if entries.len() > LEAF_MAX => {
            let at = if appended {
                LEAF_MAX
            } else {
                entries.len() / 2
            };
            let r = entries.split_off(at);
            entries.shrink_to_fit();
            cx.counts.resident_leaves += 1;
            (r[0].key, Body::Leaf(r))
        }
        Body::Inner(children) if children.len() > INNER_MAX => {
            let at = if appended {
                INNER_MAX
            } else {
                children.len() / 2
            };
            let r = children.split_off(at);
            children.shrink_to_fit();
            cx.counts.resident_inner += 1;
            (r[0].0, Body::Inner(r))
        }
        _ => return None,
    };
    cx.counts.dirty_nodes += 1;
    Some((right.0, Box::new(Node::new(right.1))))
}

/// Clean nodes that may be evicted: leaves (`inner` false), or inner nodes all of whose
/// children are on disk (`inner` true), with their stamp, lower key and depth.
fn collect_evictable(
    child: &Child,
    lo: Key,
    hi: Key,
    depth: usize,
    inner: bool,
    out: &mut Vec<(u64, Key, usize)>,
) {
    let Child::Mem(n) = child else { return };
    let clean = depth > 0 && !n.dirty && n.ptr.is_some();
    match &n.body {
        Body::Leaf(_) => {
            if clean && !inner {
                out.push((n.stamp.load(Ordering::Relaxed), lo, depth));
            }
        }
        Body::Inner(children) => {
            if clean && inner && children.iter().all(|c| matches!(c.1, Child::Disk(_))) {
                out.push((n.stamp.load(Ordering::Relaxed), lo, depth));
            }
            for i in 0..children.len() {
                let (clo, chi) = bounds(children, i, lo, hi);
                collect_evictable(&children[i].1, clo, chi, depth + 1, inner, out);
            }
        }
    }
}

/// Evicts the clean node at `depth` whose range starts at `key`, if it still qualifies.
fn evict_at(child: &mut Child, lo: Key, hi: Key, key: Key, depth: usize) -> bool {
    let Child::Mem(n) = child else { return false };
    let Body::Inner(children) = &mut n.body else {
        return false;
    };
    let i = children[1..].partition_point(|c| c.0 <= key);
    let (clo, chi) = bounds(children, i, lo, hi);
    if depth > 1 {
        return evict_at(&mut children[i].1, clo, chi, key, depth - 1);
    }
    let ptr = match &children[i].1 {
        Child::Mem(c) if !c.dirty && clo == key => match (&c.body, c.ptr) {
            (Body::Leaf(_), Some(p)) => p,
            (Body::Inner(gc), Some(p)) if gc.iter().all(|g| matches!(g.1, Child::Disk(_))) => p,
            _ => return false,
        },
        _ => return false,
    };
    children[i].1 = Child::Disk(ptr);
    true
}

fn plan_in<E>(
    child: &Child,
    alloc: &mut dyn FnMut() -> Result<PagePtr, E>,
    out: &mut Vec<(PagePtr, PageBody)>,
) -> Result<PagePtr, E> {
    let n = match child {
        Child::Disk(p) => return Ok(*p),
        Child::Mem(n) if !n.dirty => return Ok(n.ptr.expect("a clean node has a page")),
        Child::Mem(n) => n,
    };
    let body = match &n.body {
        Body::Leaf(e) => PageBody::Leaf(e.clone()),
        Body::Inner(children) => {
            let mut v = Vec::with_capacity(children.len());
            for (k, c) in children {
                v.push((*k, plan_in(c, alloc, out)?));
            }
            PageBody::Inner(v)
        }
    };
    let p = alloc()?;
    out.push((p, body));
    Ok(p)
}

fn commit_in(child: &mut Child, next: &mut dyn Iterator<Item = PagePtr>) {
    let Child::Mem(n) = child else { return };
    if !n.dirty {
        return;
    }
    if let Body::Inner(children) = &mut n.body {
        for (_, c) in children.iter_mut() {
            commit_in(c, next);
        }
    }
    n.ptr = next.next();
    n.dirty = false;
}

#[allow(clippy::too_many_arguments)]
fn redirty_in(
    child: &mut Child,
    lo: Key,
    hi: Key,
    levels: usize,
    moving: &dyn Fn(PagePtr) -> bool,
    cx: &mut Cx<'_>,
    n: &mut usize,
) -> Result<bool, Miss> {
    let node = match child {
        // An inner node must be read to see its children; a leaf only if it moves.
        Child::Disk(p) if levels > 0 || moving(*p) => return Err(Miss { key: lo, ptr: *p }),
        Child::Disk(_) => return Ok(false),
        Child::Mem(node) => node,
    };
    // A node dirty already (by an earlier try of this walk that stopped at a page not in
    // memory) counts as changed too: its ancestors must be written again with it, or the
    // flush keeps the old root and frees the pages it still names.
    let mut changed = node.dirty || node.ptr.is_some_and(moving);
    if let Body::Inner(children) = &mut node.body {
        for i in 0..children.len() {
            let (clo, chi) = bounds(children, i, lo, hi);
            changed |= redirty_in(
                &mut children[i].1,
                clo,
                chi,
                levels.saturating_sub(1),
                moving,
                cx,
                n,
            )?;
        }
    }
    if changed && !node.dirty {
        cx.dirty(node);
        *n += 1;
    }
    Ok(changed)
}

fn known_in(child: &Child, out: &mut Vec<PagePtr>) {
    match child {
        Child::Disk(p) => out.push(*p),
        Child::Mem(n) => {
            if let Some(p) = n.ptr {
                out.push(p);
            }
            if let Body::Inner(children) = &n.body {
                for (_, c) in children {
                    known_in(c, out);
                }
            }
        }
    }
}
