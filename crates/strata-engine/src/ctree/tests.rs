//! The tree against a block-by-block model, with flushes to an in-memory page store,
//! evictions and reopenings from the flushed root in between.

use std::collections::{BTreeMap, HashMap, HashSet};

use proptest::prelude::*;

use super::page::{decode, encode, key_of, split_key, PageBody};
use super::*;

const G: [u8; 16] = [9; 16];

#[derive(Default)]
struct Store {
    pages: HashMap<u64, Vec<u8>>,
    next: u64,
    generation: u64,
}

impl Store {
    fn read(&self, p: PagePtr) -> PageBody {
        let a = decode(&self.pages[&p.a], &G, p.a)
            .expect("copy A decodes")
            .0;
        let b = decode(&self.pages[&p.b], &G, p.b)
            .expect("copy B decodes")
            .0;
        assert_eq!(a, b, "the two copies differ");
        a
    }

    /// Writes the dirty nodes and commits; returns the new root and the pages freed.
    fn flush(&mut self, t: &mut CTree) -> (PagePtr, Vec<PagePtr>) {
        self.generation += 1;
        let next = &mut self.next;
        let plan = t
            .plan_flush::<()>(&mut || {
                *next += 2;
                Ok(PagePtr {
                    a: *next,
                    b: *next + 1,
                })
            })
            .unwrap();
        for (p, body) in &plan.pages {
            self.pages
                .insert(p.a, encode(body, &G, self.generation, p.a));
            self.pages
                .insert(p.b, encode(body, &G, self.generation, p.b));
        }
        let freed = t.commit_flush(&plan);
        assert_eq!(t.counts().dirty_nodes, 0);
        (plan.root, freed)
    }

    fn reachable(&self, root: PagePtr, out: &mut HashSet<PagePtr>) {
        out.insert(root);
        if let PageBody::Inner(children) = self.read(root) {
            for (_, c) in children {
                self.reachable(c, out);
            }
        }
    }
}

/// Runs `f` until no page is missing, installing pages from the store.
fn loaded<T>(t: &mut CTree, s: &Store, mut f: impl FnMut(&mut CTree) -> Result<T, Miss>) -> T {
    for _ in 0..10_000 {
        match f(t) {
            Ok(v) => return v,
            Err(m) => t.install(m, s.read(m.ptr)),
        }
    }
    panic!("lookups never stopped missing");
}

type Model = BTreeMap<(u32, u64), Loc>;

fn check(t: &mut CTree, s: &Store, model: &Model, layers: u32, blocks: u64) {
    for layer in 0..layers {
        let got = loaded(t, s, |t| {
            let mut v = Vec::new();
            t.lookup(key_of(layer, 0), key_of(layer, blocks), &mut v)
                .map(|()| v)
        });
        let mut seen = BTreeMap::new();
        let mut last_end = 0;
        for e in got {
            assert!(e.key >= last_end, "overlapping or unsorted results");
            last_end = e.end();
            let (l, lba) = split_key(e.key);
            assert_eq!(l, layer);
            for i in 0..e.len {
                seen.insert((l, lba + i), e.loc.advance(i));
            }
        }
        let want: Model = model
            .range((layer, 0)..(layer, blocks))
            .map(|(k, v)| (*k, *v))
            .collect();
        assert_eq!(seen, want, "layer {layer}");
    }
}

fn arb_loc() -> impl Strategy<Value = Option<Loc>> {
    prop_oneof![
        2 => Just(None),
        1 => Just(Some(Loc::Zero(0))),
        5 => (0u32..6, 0u32..5000).prop_map(|(seg, block)| Some(Loc::Cap { seg, block })),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Set(u32, u64, u64, Option<Loc>),
    Flush,
    Evict(usize),
    Reopen,
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (0u32..3, 0u64..3000, 1u64..8, arb_loc()).prop_map(|(l, a, n, loc)| Op::Set(l, a, n, loc)),
        8 => (0u32..3, 0u64..3000, 1u64..600, arb_loc()).prop_map(|(l, a, n, loc)| Op::Set(l, a, n, loc)),
        2 => Just(Op::Flush),
        2 => (0usize..4).prop_map(Op::Evict),
        1 => Just(Op::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn matches_a_block_model_through_flushes_evictions_and_reopens(ops in prop::collection::vec(arb_op(), 1..600)) {
        let mut t = CTree::new();
        let mut s = Store::default();
        let mut model = Model::new();
        let mut live: HashSet<PagePtr> = HashSet::new();
        let mut root = None;
        for op in ops {
            match op {
                Op::Set(layer, lba, n, loc) => {
                    let displaced = loaded(&mut t, &s, |t| t.set(key_of(layer, lba), key_of(layer, lba + n), loc));
                    let mut expect = 0;
                    for i in 0..n {
                        if let Some(old) = model.remove(&(layer, lba + i)) {
                            expect += 1;
                            let hit = displaced.iter().any(|d| d.key <= key_of(layer, lba + i) && key_of(layer, lba + i) < d.end()
                                && d.loc.advance((key_of(layer, lba + i) - d.key) as u64) == old);
                            prop_assert!(hit, "block {} displaced wrongly", lba + i);
                        }
                        if let Some(l) = loc {
                            model.insert((layer, lba + i), l.advance(i));
                        }
                    }
                    prop_assert_eq!(displaced.iter().map(|d| d.len).sum::<u64>(), expect);
                }
                Op::Flush => {
                    let (r, freed) = s.flush(&mut t);
                    let mut now = HashSet::new();
                    s.reachable(r, &mut now);
                    for f in &freed {
                        prop_assert!(live.contains(f), "freed a page that was not live");
                        prop_assert!(!now.contains(f), "freed a page still referenced");
                    }
                    for p in &live {
                        prop_assert!(now.contains(p) || freed.contains(p), "a page leaked");
                    }
                    live = now;
                    root = Some(r);
                }
                Op::Evict(keep) => t.evict(keep),
                Op::Reopen => {
                    let (r, _) = s.flush(&mut t);
                    live.clear();
                    s.reachable(r, &mut live);
                    root = Some(r);
                    t = CTree::open(root);
                }
            }
            check(&mut t, &s, &model, 3, 3300);
        }
        let _ = root;
    }
}

#[test]
fn a_deep_tree_pages_out_and_back_in() {
    let mut t = CTree::new();
    let mut s = Store::default();
    // Single-block runs that cannot merge (alternating segments): ~60,000 entries, so the tree
    // grows two inner levels.
    let n = 60_000u64;
    for i in 0..n {
        let loc = Loc::Cap {
            seg: (i % 2) as u32,
            block: i as u32,
        };
        t.set(key_of(1, i * 2), key_of(1, i * 2 + 1), Some(loc))
            .unwrap();
    }
    assert!(t.counts().resident_inner > 1, "{:?}", t.counts());
    // Appended in address order, leaves fill up instead of splitting in halves.
    let full = n as usize / page::LEAF_MAX;
    assert!(
        t.counts().resident_leaves <= full + 2,
        "{:?} for {full} full leaves",
        t.counts()
    );
    let (root, freed) = s.flush(&mut t);
    assert!(freed.is_empty());
    t.evict(0);
    // Everything but the root leaves memory: inner nodes too, once their children are out.
    assert_eq!(
        (t.counts().resident_leaves, t.counts().resident_inner),
        (0, 1),
        "{:?}",
        t.counts()
    );
    let mut got = Vec::new();
    let k = key_of(1, 2 * 4321);
    loaded(&mut t, &s, |t| {
        got.clear();
        t.lookup(k, k + 1, &mut got)
    });
    assert_eq!(
        got,
        vec![Entry {
            key: k,
            len: 1,
            loc: Loc::Cap {
                seg: 1,
                block: 4321
            }
        }]
    );
    // Reopened from the root, everything is there, and a range change spanning many leaves
    // works once they are read.
    let mut t = CTree::open(Some(root));
    let displaced = loaded(&mut t, &s, |t| {
        t.set(key_of(1, 1000), key_of(1, 100_000), None)
    });
    assert_eq!(displaced.len() as u64, (100_000 - 1000) / 2);
    let mut model = Model::new();
    for i in 0..n {
        if !(1000..100_000).contains(&(i * 2)) {
            model.insert(
                (1, i * 2),
                Loc::Cap {
                    seg: (i % 2) as u32,
                    block: i as u32,
                },
            );
        }
    }
    check(&mut t, &s, &model, 2, 2 * n + 10);
    let (_, freed) = s.flush(&mut t);
    assert!(!freed.is_empty(), "rewritten pages free their old copies");
}

#[test]
fn redirty_moves_every_page_of_a_segment() {
    let mut t = CTree::new();
    let mut s = Store::default();
    for i in 0..5_000u64 {
        t.set(
            key_of(2, i * 2),
            key_of(2, i * 2 + 1),
            Some(Loc::Cap {
                seg: 1,
                block: i as u32,
            }),
        )
        .unwrap();
    }
    let (root, _) = s.flush(&mut t);
    let mut before = HashSet::new();
    s.reachable(root, &mut before);
    let mut t = CTree::open(Some(root));
    // Move the pages whose copy A has an even address.
    let moving = |p: PagePtr| p.a % 4 == 2;
    let expected = before.iter().filter(|p| moving(**p)).count();
    assert!(expected > 0);
    loaded(&mut t, &s, |t| t.redirty(&moving));
    let (root2, freed) = s.flush(&mut t);
    let mut after = HashSet::new();
    s.reachable(root2, &mut after);
    assert!(
        after.iter().all(|p| !moving(*p) || !before.contains(p)),
        "a page in the moving set stayed"
    );
    assert!(freed.iter().filter(|p| moving(**p)).count() >= expected);
}

#[test]
fn a_change_across_many_leaves_keeps_each_part_at_its_place() {
    let mut t = CTree::new();
    // 2,000 single-block runs that cannot merge make ~20 leaves.
    for i in 0..2_000u64 {
        t.set(
            key_of(1, i * 3),
            key_of(1, i * 3 + 1),
            Some(Loc::Cap {
                seg: (i % 2) as u32,
                block: i as u32,
            }),
        )
        .unwrap();
    }
    let d = t
        .set(
            key_of(1, 100),
            key_of(1, 5_000),
            Some(Loc::Cap { seg: 9, block: 0 }),
        )
        .unwrap();
    assert_eq!(d.len(), (100..5_000).filter(|b| b % 3 == 0).count());
    let mut got = Vec::new();
    t.lookup(key_of(1, 0), key_of(1, 6_000), &mut got).unwrap();
    for e in got {
        let (_, lba) = split_key(e.key);
        if (100..5_000).contains(&lba) {
            assert_eq!(
                e.loc,
                Loc::Cap {
                    seg: 9,
                    block: (lba - 100) as u32
                },
                "run at {lba}"
            );
        }
    }
}

/// A redirty that misses an inner node after it dirtied a node to its left must still
/// leave every ancestor of the dirtied node dirty, or the flush writes neither the node nor its
/// ancestors while its old page goes into `freed` (still referenced by the unchanged root).
#[test]
fn a_redirty_that_misses_an_inner_node_keeps_the_ancestors_of_what_it_dirtied_dirty() {
    let mut t = CTree::new();
    let mut s = Store::default();
    // 25,000 single-block runs that cannot merge: ~174 full leaves under two inner nodes.
    for i in 0..25_000u64 {
        t.set(
            key_of(1, i * 2),
            key_of(1, i * 2 + 1),
            Some(Loc::Cap {
                seg: (i % 2) as u32,
                block: i as u32,
            }),
        )
        .unwrap();
    }
    let (root, _) = s.flush(&mut t);
    let PageBody::Inner(top) = s.read(root) else {
        panic!("root is a leaf")
    };
    assert!(top.len() >= 2, "root has {} children", top.len());
    let PageBody::Inner(first) = s.read(top[0].1) else {
        panic!("two levels expected")
    };
    let leaf0 = first[0].1;
    // Only the leftmost leaf moves (as when the index segment holding it is cleaned), and the
    // inner nodes are not resident (evicted: all their children were on disk).
    t.evict(0);
    assert_eq!(t.counts().resident_inner, 1, "{:?}", t.counts());
    loaded(&mut t, &s, |t| t.redirty(&|p| p == leaf0));
    let (root2, freed) = s.flush(&mut t);
    let mut now = HashSet::new();
    s.reachable(root2, &mut now);
    let still: Vec<_> = freed.iter().filter(|f| now.contains(f)).collect();
    assert!(
        still.is_empty(),
        "root {:?} -> {:?} (unchanged: {}); freed pages still referenced by it: {:?}; dirty left: {:?}",
        root,
        root2,
        root == root2,
        still,
        t.counts()
    );
}
