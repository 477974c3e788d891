//! Space reports (`space.rs`): the walk skips the runs no layer of a view holds, and counts
//! exactly what a walk of every block counts. Seeds are printed; `STRATA_TEST_SEED=<n>`
//! replays one.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::space::Walk;
use crate::tests::{seed_for, small_cfg, Rig, MIB};
use crate::*;

const TIB: u64 = 1 << 40;
const KIB: u64 = 1 << 10;

fn totals(r: &SpaceReport) -> (u64, u64) {
    (
        r.exclusive_fast_bytes + r.exclusive_capacity_bytes,
        r.shared_fast_bytes + r.shared_capacity_bytes,
    )
}

/// A 256 TiB volume with a few pieces of data far apart, a snapshot and a clone of it: each
/// report takes a round per piece, not one per 1,024 blocks (2^26 rounds, 20 s of CPU for
/// the volume alone), and counts every piece. Totals only: the destager may move the fast
/// tier's pieces at any moment.
#[test]
fn a_large_sparse_volume_is_counted_in_a_few_rounds() {
    let rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), 41);
    let dg = rig.dg();
    let big = dg.create_volume("big", MAX_VOLUME_BYTES).unwrap().id;
    dg.write(big, 0, &[1u8; 64 * KIB as usize]).unwrap();
    dg.write(big, 100 * TIB, &[2u8; 64 * KIB as usize]).unwrap();
    dg.write(big, MAX_VOLUME_BYTES - 4096, &[3u8; 4096])
        .unwrap();
    assert!(dg.destage_all(Duration::from_secs(10)));
    dg.write(big, 200 * TIB, &[4u8; 8192]).unwrap();
    dg.create_snapshot("big", "s").unwrap();
    dg.write(big, 0, &[5u8; 4096]).unwrap();
    let clone = dg.clone_snapshot("big", "s", "c").unwrap().id;
    dg.write(clone, 50 * TIB, &[6u8; 4096]).unwrap();
    let snap = dg.view("big@s").unwrap().id;
    // (view, exclusive, shared): the volume and the clone each hide block 0 or nothing of
    // the snapshot's, so the snapshot holds nothing alone.
    let want = [
        ("big", big, 4 * KIB, 136 * KIB),
        ("big@s", snap, 0, 140 * KIB),
        ("c", clone, 4 * KIB, 140 * KIB),
    ];
    for (name, view, exclusive, shared) in want {
        let (report, rounds) = dg.space_walk(view, Walk::SkipHoles).unwrap();
        assert!(rounds <= 16, "{name}: {rounds} rounds");
        assert_eq!(totals(&report), (exclusive, shared), "{name}: {report:?}");
        assert_eq!(dg.space(view).unwrap(), report, "{name}");
    }
}

/// Seeded: data written, trimmed and zeroed in runs spread over sparse volumes, snapshots,
/// clones, rollbacks and deletes, destage between: for every view, the walk that skips holes
/// reports what the walk of every block reports, in no more rounds.
#[test]
fn skipping_holes_counts_what_a_walk_of_every_block_counts() {
    let seed = seed_for("skipping_holes_counts_what_a_walk_of_every_block_counts");
    let mut rng = StdRng::seed_from_u64(seed);
    // The destager moves data only when told (destage_all), so both walks of a view see the
    // same tiers.
    let cfg = EngineConfig {
        fill_ratio_low: 0.8,
        fill_ratio_high: 0.9,
        idle_destage_after: None,
        ..small_cfg()
    };
    let rig = Rig::new(128 * MIB, &[64 * MIB], cfg, seed);
    let dg = rig.dg();
    const VOL_BYTES: u64 = 1 << 30;
    let mut volumes = vec!["v0".to_string()];
    dg.create_volume("v0", VOL_BYTES).unwrap();
    let (mut snaps, mut made) = (Vec::<(String, String)>::new(), 0);
    for step in 0..400 {
        let vol = volumes[rng.gen_range(0..volumes.len())].clone();
        let id = dg.volume(&vol).unwrap().id;
        let at = rng.gen_range(0..VOL_BYTES / 4096) * 4096;
        let len = (rng.gen_range(1..=32) * 4096).min(VOL_BYTES - at);
        let what = format!("seed {seed} step {step}");
        match rng.gen_range(0..100) {
            0..=59 => dg.write(id, at, &vec![step as u8; len as usize]).unwrap(),
            60..=69 => dg.discard(id, at, len).unwrap(),
            70..=74 => dg.write_zeroes(id, at, len).unwrap(),
            75..=81 => {
                made += 1;
                let name = format!("s{made}");
                dg.create_snapshot(&vol, &name).unwrap();
                snaps.push((vol, name));
            }
            82..=85 if !snaps.is_empty() && volumes.len() < 4 => {
                let (from, snap) = snaps[rng.gen_range(0..snaps.len())].clone();
                made += 1;
                let name = format!("c{made}");
                dg.clone_snapshot(&from, &snap, &name).unwrap();
                volumes.push(name);
            }
            86..=88 if !snaps.is_empty() => {
                let (from, snap) = snaps.remove(rng.gen_range(0..snaps.len()));
                dg.delete_snapshot(&from, &snap).unwrap();
            }
            89..=90 => {
                let mine: Vec<_> = snaps.iter().filter(|(v, _)| *v == vol).collect();
                if let Some((_, snap)) = mine.first() {
                    dg.rollback_volume(&vol, snap).unwrap();
                }
            }
            91..=93 => assert!(dg.destage_all(Duration::from_secs(10)), "{what}"),
            _ => check_every_view(dg, &what),
        }
    }
    check_every_view(dg, &format!("seed {seed} at the end"));
}

fn check_every_view(dg: &DiskGroup, what: &str) {
    // A deleted snapshot's blocks count as shared until it is merged into its child.
    assert!(dg.settle(Duration::from_secs(20)), "{what}: settle");
    for v in dg.views() {
        let (skipped, rounds) = dg.space_walk(v.id, Walk::SkipHoles).unwrap();
        let (every, all_rounds) = dg.space_walk(v.id, Walk::EveryBlock).unwrap();
        assert_eq!(skipped, every, "{what}: {}", v.name);
        assert!(rounds <= all_rounds, "{what}: {}", v.name);
    }
}

/// Every view's report from `space_of_views` (all views at once, and a random part of them
/// in a random order, with one asked twice) is the report of its own walk.
fn check_one_walk_for_many(dg: &DiskGroup, rng: &mut StdRng, what: &str) {
    assert!(dg.settle(Duration::from_secs(20)), "{what}: settle");
    let views: Vec<ViewInfo> = dg.views();
    let mut ids: Vec<VolumeId> = views.iter().map(|v| v.id).collect();
    let all = dg.space_of_views(&ids);
    for (v, many) in views.iter().zip(&all) {
        let alone = dg.space(v.id).unwrap();
        assert_eq!(*many.as_ref().unwrap(), alone, "{what}: {}", v.name);
    }
    ids.retain(|_| rng.gen_bool(0.5));
    ids.shuffle(rng);
    if let Some(&first) = ids.first() {
        ids.push(first);
    }
    ids.push(u32::MAX - 7); // no such view
    let some = dg.space_of_views(&ids);
    for (id, many) in ids.iter().zip(&some) {
        match dg.space(*id) {
            Ok(alone) => assert_eq!(*many.as_ref().unwrap(), alone, "{what}: view #{id}"),
            Err(_) => assert!(many.is_err(), "{what}: view #{id} is not there"),
        }
    }
}

/// Seeded: volumes with long chains of snapshots (writes, trims and zeroes between them),
/// clones of clones, rollbacks, volumes of other sizes and volumes grown, snapshots and
/// volumes deleted (merges), data destaged between: the walk of many views at once counts
/// for each what its own walk does.
#[test]
fn one_walk_for_many_views_counts_what_each_walk_counts() {
    let seed = seed_for("one_walk_for_many_views_counts_what_each_walk_counts");
    let mut rng = StdRng::seed_from_u64(seed);
    let cfg = EngineConfig {
        fill_ratio_low: 0.8,
        fill_ratio_high: 0.9,
        idle_destage_after: None,
        ..small_cfg()
    };
    let rig = Rig::new(128 * MIB, &[64 * MIB], cfg, seed);
    let dg = rig.dg();
    let mut volumes = vec!["v0".to_string(), "w0".to_string()];
    dg.create_volume("v0", 64 * MIB).unwrap();
    dg.create_volume("w0", 16 * MIB).unwrap();
    let (mut snaps, mut made) = (Vec::<(String, String)>::new(), 0);
    for step in 0..1200 {
        let vol = volumes[rng.gen_range(0..volumes.len())].clone();
        let info = dg.volume(&vol).unwrap();
        let blocks = info.size_bytes / 4096;
        // Most writes in a small region, so that layers hide each other's blocks.
        let region = if rng.gen_bool(0.7) { 256 } else { blocks };
        let at = rng.gen_range(0..blocks.min(region)) * 4096;
        let len = (rng.gen_range(1..=16) * 4096).min(info.size_bytes - at);
        let what = format!("seed {seed} step {step}");
        match rng.gen_range(0..100) {
            0..=44 => dg
                .write(info.id, at, &vec![step as u8; len as usize])
                .unwrap(),
            45..=51 => dg.discard(info.id, at, len).unwrap(),
            52..=55 => dg.write_zeroes(info.id, at, len).unwrap(),
            56..=71 => {
                made += 1;
                let name = format!("s{made}");
                dg.create_snapshot(&vol, &name).unwrap();
                snaps.push((vol, name));
            }
            72..=75 if !snaps.is_empty() && volumes.len() < 8 => {
                let (from, snap) = snaps[rng.gen_range(0..snaps.len())].clone();
                made += 1;
                let name = format!("c{made}");
                dg.clone_snapshot(&from, &snap, &name).unwrap();
                volumes.push(name);
            }
            76..=79 if !snaps.is_empty() => {
                let (from, snap) = snaps.remove(rng.gen_range(0..snaps.len()));
                dg.delete_snapshot(&from, &snap).unwrap();
            }
            80..=81 => {
                let mine: Vec<_> = snaps.iter().filter(|(v, _)| *v == vol).collect();
                if let Some((_, snap)) = mine.get(rng.gen_range(0..mine.len().max(1))) {
                    dg.rollback_volume(&vol, snap).unwrap();
                }
            }
            82 => {
                dg.resize_volume(&vol, info.size_bytes + rng.gen_range(1..=64) * 4096)
                    .unwrap();
            }
            83 if volumes.len() > 1 => {
                dg.delete_volume(&vol, true).unwrap();
                volumes.retain(|v| *v != vol);
                snaps.retain(|(v, _)| *v != vol);
            }
            84 if volumes.len() < 10 => {
                made += 1;
                let name = format!("n{made}");
                dg.create_volume(&name, rng.gen_range(1..=64) * MIB)
                    .unwrap();
                volumes.push(name);
            }
            85..=88 => assert!(dg.destage_all(Duration::from_secs(10)), "{what}"),
            89..=93 => check_one_walk_for_many(dg, &mut rng, &what),
            _ => {}
        }
    }
    check_one_walk_for_many(dg, &mut rng, &format!("seed {seed} at the end"));
}

/// A volume at the limit of its history (1,023 snapshots, its head the 1,024th layer), each
/// snapshot holding blocks of its own and hiding some of the one before: the walk of every
/// view at once counts what each view's own walk counts (the head, at the limit, is walked
/// alone), in far fewer rounds than the walks of the views one by one.
#[test]
fn one_walk_for_a_volume_at_its_history_limit() {
    let rig = Rig::new(64 * MIB, &[64 * MIB], small_cfg(), 43);
    let dg = rig.dg();
    let v = dg.create_volume("v", 64 * MIB).unwrap().id;
    for i in 0..(crate::shared::MAX_CHAIN as u64 - 1) {
        dg.write(v, (i % 200) * 4096, &[i as u8; 4096]).unwrap();
        dg.write(v, (1000 + i * 7) * 4096, &[i as u8; 8192])
            .unwrap();
        dg.create_snapshot("v", &format!("s{i}")).unwrap();
        if i == 500 {
            assert!(dg.destage_all(Duration::from_secs(10)));
        }
    }
    assert!(dg.settle(Duration::from_secs(20)));
    let ids: Vec<VolumeId> = dg.views().iter().map(|v| v.id).collect();
    assert_eq!(ids.len(), crate::shared::MAX_CHAIN);
    let many = dg.space_of_views(&ids);
    // Every view counted against its own walk would take a walk of up to 1,024 layers each
    // (half a minute): one view in 31, and the two ends of the chain, are checked.
    let last = ids.len() - 1;
    let mut checked = 0;
    for (i, (id, r)) in ids.iter().zip(many).enumerate() {
        if i % 31 == 0 || i >= last - 1 {
            assert_eq!(r.unwrap(), dg.space(*id).unwrap(), "view #{id}");
            checked += 1;
        }
    }
    assert!(checked > 30, "{checked} views checked");
}
