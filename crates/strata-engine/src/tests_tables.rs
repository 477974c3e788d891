//! The volume table's layer bookkeeping (`Tables::settle_layers`) on tables built by hand:
//! which layers it marks, at the table's limits too, and what a chain at its limit says.

use crate::format::{LayerRecord, SnapshotRecord, VolumeRecord, LAYER_DELETED, LAYER_MERGING};
use crate::volumes::Tables;
use crate::{EngineError, MAX_SNAPSHOTS, MAX_VOLUMES};

fn layer(t: &mut Tables, id: u32, parent: u32) {
    t.layers.insert(
        id,
        LayerRecord {
            id,
            parent,
            flags: 0,
        },
    );
}

fn volume(t: &mut Tables, id: u32, head: u32) {
    t.volumes.insert(
        id,
        VolumeRecord {
            id,
            head,
            size_bytes: 4096,
            created_unix_s: 0,
            name: format!("v{id}"),
            policy: Vec::new(),
        },
    );
}

fn snapshot(t: &mut Tables, id: u32, volume: u32, layer: u32) {
    t.snapshots.insert(
        id,
        SnapshotRecord {
            id,
            volume,
            layer,
            size_bytes: 4096,
            created_unix_s: 0,
            name: format!("s{id}"),
        },
    );
}

fn flags(t: &Tables, id: u32) -> u32 {
    t.layers[&id].flags
}

#[test]
fn settling_marks_unneeded_layers_deleted_and_lone_hidden_ones_merging() {
    let mut t = Tables::default();
    // Volume 100 reads 4 -> 3 -> 2 -> 1. Layer 1 is snapshot 200's; layer 2 was a snapshot's,
    // since deleted, with one child: merging. Layer 3 was too, but clone 101 (head 5) sits on
    // it as well: two children, so it stays. Layer 6 is on no one's chain: deleted.
    for (id, parent) in [(1, 0), (2, 1), (3, 2), (4, 3), (5, 3), (6, 1)] {
        layer(&mut t, id, parent);
    }
    volume(&mut t, 100, 4);
    volume(&mut t, 101, 5);
    snapshot(&mut t, 200, 100, 1);
    t.layers.get_mut(&1).expect("layer 1").flags = LAYER_MERGING;
    t.settle_layers();
    assert_eq!(flags(&t, 1), 0, "a snapshot's layer is never merged away");
    assert_eq!(flags(&t, 2), LAYER_MERGING);
    assert_eq!(flags(&t, 3), 0, "two children read through it");
    assert_eq!(flags(&t, 4), 0);
    assert_eq!(flags(&t, 5), 0);
    assert_eq!(flags(&t, 6), LAYER_DELETED);
}

/// A table at its limits (4096 volumes, 16384 snapshots) settles as a small one does: each
/// volume's deleted snapshot's layer, alone under its child, is merged, and nothing else
/// changes. (Every volume-table change settles the layers with the table's lock held; counting
/// each layer's children by walking the whole table made that quadratic, 2.7 s at this size
/// against 0.03 s now: a figure for the note, not a timed assertion.)
#[test]
fn settling_a_table_at_its_limits_merges_each_deleted_snapshots_layer() {
    let mut t = Tables::default();
    let per_volume = MAX_SNAPSHOTS / MAX_VOLUMES;
    let mut next = 1u32;
    let mut take = || {
        next += 1;
        next - 1
    };
    for _ in 0..MAX_VOLUMES {
        let vid = take();
        let mut below = 0;
        for k in 0..per_volume {
            let l = take();
            layer(&mut t, l, below);
            // The second snapshot of each volume was deleted: its layer is to be merged.
            if k != 1 {
                snapshot(&mut t, take(), vid, l);
            }
            below = l;
        }
        let head = take();
        layer(&mut t, head, below);
        volume(&mut t, vid, head);
    }
    assert_eq!(t.layers.len(), MAX_VOLUMES * (per_volume + 1));
    t.settle_layers();
    let merging = t
        .layers
        .values()
        .filter(|l| l.flags == LAYER_MERGING)
        .count();
    assert_eq!(merging, MAX_VOLUMES);
    assert!(t.layers.values().all(|l| l.flags & LAYER_DELETED == 0));
}

/// A volume whose chain is as long as reads allow: snapshot `k` on layer `k` for every `k`
/// but those in `deleted`, and its head on top. Returns the head.
fn chain_at_the_limit(t: &mut Tables, deleted: &[u32]) -> u32 {
    let depth = crate::shared::MAX_CHAIN as u32;
    let vid = 100_000;
    for l in 1..depth {
        layer(t, l, l - 1);
        if !deleted.contains(&l) {
            snapshot(t, 200_000 + l, vid, l);
        }
    }
    layer(t, depth, depth - 1);
    volume(t, vid, depth);
    t.next_id = 300_000;
    t.settle_layers();
    depth
}

#[test]
fn a_chain_at_the_limit_says_when_deleted_snapshots_are_still_being_merged() {
    let mut t = Tables::default();
    let head = chain_at_the_limit(&mut t, &[]);
    let e = t.new_layer(head).expect_err("the chain is full");
    assert!(e.to_string().contains("delete some snapshots first"), "{e}");
    // A conflict with the volume's state, in plain words (was "invalid argument: ...", 400).
    assert!(matches!(e, EngineError::InUse(_)), "{e:?}");
    assert!(e.to_string().starts_with("at most"), "{e}");

    // Snapshots deleted: their layers stay on the chain until the destager merges them, and
    // the refusal says so rather than asking for what was just done.
    let mut t = Tables::default();
    let head = chain_at_the_limit(&mut t, &[500, 1000]);
    let e = t.new_layer(head).expect_err("the chain is still full");
    assert!(
        e.to_string().contains(
            "2 of them are of deleted snapshots, being merged in the background; \
             try again in a moment"
        ),
        "{e}"
    );
}
