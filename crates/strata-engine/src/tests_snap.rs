//! Snapshots, clones, rollback and deletion against a reference model of every volume and
//! snapshot, with destage, GC and power cuts in between. Seeds are printed;
//! `STRATA_TEST_SEED=<n>` replays one.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::tests::{check_volume, seed_for, small_cfg, Rig, MIB};
use crate::*;

const VOL_BYTES: usize = 2 * MIB as usize;

/// What every view must read as.
#[derive(Default)]
pub(crate) struct Model {
    pub(crate) volumes: BTreeMap<String, Vec<u8>>,
    /// "vol@snap" -> image
    pub(crate) snapshots: BTreeMap<String, Vec<u8>>,
}

impl Model {
    /// Takes snapshot `snap` of volume `vol`, on the group and in the model.
    pub(crate) fn snapshot(&mut self, dg: &DiskGroup, vol: &str, snap: &str, what: &str) {
        dg.create_snapshot(vol, snap)
            .unwrap_or_else(|e| panic!("{what}: snapshot {vol}@{snap}: {e}"));
        let image = self.volumes[vol].clone();
        self.snapshots.insert(format!("{vol}@{snap}"), image);
    }

    /// Clones snapshot `full` ("vol@snap") as volume `clone`, on the group and in the model.
    pub(crate) fn clone_snapshot(&mut self, dg: &DiskGroup, full: &str, clone: &str, what: &str) {
        let (vol, snap) = full.split_once('@').expect("vol@snap");
        dg.clone_snapshot(vol, snap, clone)
            .unwrap_or_else(|e| panic!("{what}: clone {full}: {e}"));
        let image = self.snapshots[full].clone();
        self.volumes.insert(clone.to_string(), image);
    }

    /// Deletes snapshot `full` ("vol@snap"), on the group and in the model.
    pub(crate) fn delete_snapshot(&mut self, dg: &DiskGroup, full: &str, what: &str) {
        let (vol, snap) = full.split_once('@').expect("vol@snap");
        dg.delete_snapshot(vol, snap)
            .unwrap_or_else(|e| panic!("{what}: delete {full}: {e}"));
        self.snapshots.remove(full);
    }

    /// Rolls volume "vol" back to snapshot `full` ("vol@snap"), on the group and in the model.
    pub(crate) fn rollback(&mut self, dg: &DiskGroup, full: &str, what: &str) {
        let (vol, snap) = full.split_once('@').expect("vol@snap");
        dg.rollback_volume(vol, snap)
            .unwrap_or_else(|e| panic!("{what}: rollback to {full}: {e}"));
        let image = self.snapshots[full].clone();
        self.volumes.insert(vol.to_string(), image);
    }

    /// Deletes volume `vol` with its snapshots (clones of them stay), on the group and in
    /// the model.
    pub(crate) fn delete_volume(&mut self, dg: &DiskGroup, vol: &str, what: &str) {
        dg.delete_volume(vol, true)
            .unwrap_or_else(|e| panic!("{what}: delete {vol}: {e}"));
        self.volumes.remove(vol);
        let prefix = format!("{vol}@");
        self.snapshots.retain(|k, _| !k.starts_with(&prefix));
    }
}

/// Every view reads as its image, and there are no others.
pub(crate) fn check_all(dg: &DiskGroup, m: &Model, what: &str) {
    for (name, image) in m.volumes.iter().chain(m.snapshots.iter()) {
        let v = dg
            .view(name)
            .unwrap_or_else(|| panic!("{what}: view {name} is missing"));
        assert_eq!(v.size_bytes as usize, image.len(), "{what}: size of {name}");
        let mut buf = vec![0u8; image.len()];
        dg.read(v.id, 0, &mut buf)
            .unwrap_or_else(|e| panic!("{what}: read {name}: {e}"));
        if let Some(i) = (0..buf.len()).find(|&i| buf[i] != image[i]) {
            panic!(
                "{what}: {name} byte {i} (block {}) is {:#x}, expected {:#x}",
                i / 4096,
                buf[i],
                image[i]
            );
        }
    }
    let views = dg.views().len();
    assert_eq!(
        views,
        m.volumes.len() + m.snapshots.len(),
        "{what}: views {:?}",
        dg.views()
    );
}

fn random_write(rng: &mut StdRng, dg: &DiskGroup, m: &mut Model, what: &str) {
    let Some(name) = pick(rng, m.volumes.keys()) else {
        return;
    };
    let id = dg.volume(&name).expect("volume").id;
    let image = m.volumes.get_mut(&name).expect("model");
    let len = match rng.gen_range(0..3) {
        0 => rng.gen_range(1..700),
        1 => 4096 * rng.gen_range(1..8),
        _ => rng.gen_range(1..200_000),
    };
    let off = rng.gen_range(0..image.len() - len);
    if rng.gen_bool(0.15) {
        dg.write_zeroes(id, off as u64, len as u64)
            .unwrap_or_else(|e| panic!("{what}: zero: {e}"));
        image[off..off + len].fill(0);
    } else {
        let byte: u8 = rng.gen();
        let data: Vec<u8> = (0..len)
            .map(|i| byte.wrapping_add((i / 512) as u8))
            .collect();
        dg.write(id, off as u64, &data)
            .unwrap_or_else(|e| panic!("{what}: write: {e}"));
        image[off..off + len].copy_from_slice(&data);
    }
}

pub(crate) fn pick<'a>(rng: &mut StdRng, it: impl Iterator<Item = &'a String>) -> Option<String> {
    let all: Vec<&String> = it.collect();
    (!all.is_empty()).then(|| all[rng.gen_range(0..all.len())].clone())
}

fn snapshot_run(seed: u64, steps: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), seed);
    let mut m = Model::default();
    let mut names = 0;
    rig.dg().create_volume("v0", VOL_BYTES as u64).unwrap();
    m.volumes.insert("v0".into(), vec![0; VOL_BYTES]);
    for step in 0..steps {
        let what = format!("seed {seed} step {step}");
        let dg = rig.dg.clone().expect("running");
        match rng.gen_range(0..100) {
            0..=49 => random_write(&mut rng, &dg, &mut m, &what),
            50..=59 => {
                let Some(vol) = pick(&mut rng, m.volumes.keys()) else {
                    continue;
                };
                names += 1;
                m.snapshot(&dg, &vol, &format!("s{names}"), &what);
            }
            60..=65 => {
                let Some(full) = pick(&mut rng, m.snapshots.keys()) else {
                    continue;
                };
                m.delete_snapshot(&dg, &full, &what);
            }
            66..=70 if m.volumes.len() < 4 => {
                let Some(full) = pick(&mut rng, m.snapshots.keys()) else {
                    continue;
                };
                names += 1;
                m.clone_snapshot(&dg, &full, &format!("c{names}"), &what);
            }
            71..=74 => {
                let Some(full) = pick(&mut rng, m.snapshots.keys()) else {
                    continue;
                };
                m.rollback(&dg, &full, &what);
            }
            75..=77 if m.volumes.len() > 1 => {
                let Some(vol) = pick(&mut rng, m.volumes.keys()) else {
                    continue;
                };
                let has = m
                    .snapshots
                    .keys()
                    .any(|k| k.starts_with(&format!("{vol}@")));
                if has && rng.gen_bool(0.5) {
                    assert!(
                        matches!(dg.delete_volume(&vol, false), Err(EngineError::InUse(_))),
                        "{what}: delete with snapshots"
                    );
                    continue;
                }
                m.delete_volume(&dg, &vol, &what);
            }
            78..=85 => {
                dg.destage_all(Duration::from_secs(20));
            }
            86..=89 => {
                dg.settle(Duration::from_secs(20));
            }
            90..=95 => {
                drop(dg);
                rig.power_cut_and_restart();
                check_all(rig.dg(), &m, &format!("{what}: after power cut"));
            }
            96..=97 => {
                drop(dg);
                rig.clean_restart();
                check_all(rig.dg(), &m, &format!("{what}: after restart"));
            }
            _ => check_all(&dg, &m, &what),
        }
    }
    check_all(rig.dg(), &m, &format!("seed {seed}: final"));
    assert!(
        rig.dg().settle(Duration::from_secs(30)),
        "seed {seed}: background release never finished"
    );
    assert_eq!(
        rig.dg().stats().checksum_errors_total,
        0,
        "seed {seed}: checksum errors without faults"
    );
}

#[test]
fn model_snapshots_clones_rollbacks_with_power_cuts() {
    let seed = seed_for("model_snapshots_clones_rollbacks_with_power_cuts");
    for i in 0..6 {
        snapshot_run(seed.wrapping_add(i), 160);
    }
}

/// A snapshot holds exactly the writes completed before it, on both tiers and across a crash
/// right after it, while writers keep going.
#[test]
fn snapshot_under_concurrent_writes_holds_exactly_the_completed_ones() {
    let seed = seed_for("snapshot_under_concurrent_writes_holds_exactly_the_completed_ones");
    let mut rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), seed);
    let dg = rig.dg.clone().expect("running");
    let v = dg.create_volume("busy", 4 * MIB).unwrap().id;
    // Four writers, each owning 256 blocks, write block after block with an increasing round
    // number; each records the last round it saw completed before the snapshot began and the
    // first it started after the snapshot returned.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let progress = std::sync::Arc::new(parking_lot::Mutex::new(vec![0u32; 4]));
    let writers: Vec<_> = (0..4u64)
        .map(|t| {
            let (dg, stop, progress) = (dg.clone(), stop.clone(), progress.clone());
            std::thread::spawn(move || {
                let mut round = 1u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let blk = t * 256 + u64::from(round % 256);
                    let mut data = vec![0u8; 4096];
                    data[..4].copy_from_slice(&round.to_le_bytes());
                    data[4] = t as u8;
                    dg.write(v, blk * 4096, &data).expect("write");
                    progress.lock()[t as usize] = round;
                    round += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    dg.destage_all(Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(100));
    let before = progress.lock().clone();
    dg.create_snapshot("busy", "now").unwrap();
    let after = progress.lock().clone();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.join().expect("writer");
    }
    drop(dg);
    rig.power_cut_and_restart();
    let dg = rig.dg();
    let snap = dg.view("busy@now").expect("snapshot survives").id;
    let mut img = vec![0u8; 4 * MIB as usize];
    dg.read(snap, 0, &mut img).unwrap();
    for t in 0..4usize {
        // The newest round of this writer in the snapshot.
        let newest = (0..256)
            .map(|b| {
                let at = (t * 256 + b) * 4096;
                u32::from_le_bytes(img[at..at + 4].try_into().expect("4 bytes"))
            })
            .max()
            .unwrap_or(0);
        assert!(
            newest >= before[t],
            "writer {t}: snapshot lacks round {} completed before it (has {newest})",
            before[t]
        );
        assert!(
            newest <= after[t] + 1,
            "writer {t}: snapshot has round {newest}, started after it returned (after {})",
            after[t]
        );
    }
}

#[test]
fn deleting_snapshots_and_volumes_gives_space_back_on_both_tiers() {
    let rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), 31);
    let dg = rig.dg();
    let v = dg.create_volume("v", 4 * MIB).unwrap().id;
    dg.write(v, 0, &vec![1u8; 4 * MIB as usize]).unwrap();
    assert!(dg.destage_all(Duration::from_secs(10)));
    dg.create_snapshot("v", "a").unwrap();
    // Overwrite half: the snapshot now holds 2 MiB exclusively, shares 2 MiB with the volume.
    dg.write(v, 0, &vec![2u8; 2 * MIB as usize]).unwrap();
    let a = dg.view("v@a").unwrap().id;
    let s = dg.space(a).unwrap();
    assert_eq!(s.exclusive_capacity_bytes, 2 * MIB, "{s:?}");
    assert_eq!(s.shared_capacity_bytes, 2 * MIB, "{s:?}");
    let sv = dg.space(v).unwrap();
    assert_eq!(sv.exclusive_fast_bytes, 2 * MIB, "{sv:?}");
    assert_eq!(sv.shared_capacity_bytes, 2 * MIB, "{sv:?}");
    assert!(dg.destage_all(Duration::from_secs(10)));
    assert_eq!(dg.stats().capacity_live_bytes, 6 * MIB);
    dg.delete_snapshot("v", "a").unwrap();
    assert!(dg.settle(Duration::from_secs(20)));
    assert_eq!(
        dg.stats().capacity_live_bytes,
        4 * MIB,
        "the snapshot's exclusive 2 MiB came back"
    );
    let sv = dg.space(v).unwrap();
    assert_eq!(sv.exclusive_capacity_bytes, 4 * MIB, "{sv:?}");
    let mut b = vec![0u8; 4 * MIB as usize];
    dg.read(v, 0, &mut b).unwrap();
    assert!(
        b[..2 * MIB as usize].iter().all(|&x| x == 2)
            && b[2 * MIB as usize..].iter().all(|&x| x == 1)
    );
    dg.delete_volume("v", false).unwrap();
    assert!(dg.settle(Duration::from_secs(20)));
    assert_eq!(dg.stats().capacity_live_bytes, 0);
    assert_eq!(dg.stats().fast_resident_bytes, 0);
}

#[test]
fn snapshots_are_read_only() {
    let rig = Rig::new(24 * MIB, &[24 * MIB], small_cfg(), 32);
    let dg = rig.dg();
    dg.create_volume("v", MIB).unwrap();
    let s = dg.create_snapshot("v", "s").unwrap();
    assert!(matches!(
        dg.write(s.id, 0, &[1; 10]),
        Err(EngineError::ReadOnly(_))
    ));
    assert!(matches!(
        dg.write_zeroes(s.id, 0, 4096),
        Err(EngineError::ReadOnly(_))
    ));
    assert!(matches!(
        dg.create_snapshot("v", "s"),
        Err(EngineError::AlreadyExists(_))
    ));
    assert!(matches!(
        dg.create_snapshot("v", "bad@name"),
        Err(EngineError::InvalidArgument(_))
    ));
    assert!(matches!(
        dg.clone_snapshot("v", "nope", "c"),
        Err(EngineError::NotFound(_))
    ));
    assert!(matches!(
        dg.delete_volume("v", false),
        Err(EngineError::InUse(_))
    ));
}

/// Blocks a deleted snapshot hands to its volume stay where they are on the capacity tier but
/// are indexed under the volume's layer from then on. Garbage collection must still find and
/// move them: otherwise their segments can never be cleaned, and they fill the capacity tier.
#[test]
fn gc_moves_the_blocks_a_deleted_snapshot_handed_to_its_volume() {
    let mut rig = Rig::new(24 * MIB, &[32 * MIB], small_cfg(), 37);
    let dg = rig.dg();
    let size = 8 * MIB as usize;
    let v = dg.create_volume("v", size as u64).unwrap().id;
    let mut model = vec![1u8; size];
    dg.write(v, 0, &model).unwrap();
    assert!(dg.destage_all(Duration::from_secs(10)));
    dg.create_snapshot("v", "a").unwrap();
    // Three blocks in four overwritten: each segment of the first write keeps a quarter of
    // its blocks live, for the volume once the snapshot is gone; the rest is garbage then.
    for b in (0..size / 4096).filter(|b| b % 4 != 0) {
        let at = b * 4096;
        model[at..at + 4096].fill(2);
        dg.write(v, at as u64, &model[at..at + 4096]).unwrap();
    }
    assert!(dg.destage_all(Duration::from_secs(20)));
    dg.delete_snapshot("v", "a").unwrap();
    assert!(dg.settle(Duration::from_secs(20)));
    // New data elsewhere, more than the free segments hold: the only garbage to clean is in
    // the first write's segments.
    let w = dg.create_volume("w", 16 * MIB).unwrap().id;
    let fill = vec![9u8; 12 * MIB as usize];
    dg.write(w, 0, &fill).unwrap();
    assert!(
        dg.destage_all(Duration::from_secs(20)),
        "the log did not drain: {:?}",
        dg.stats()
    );
    let st = dg.stats();
    assert!(st.gc_relocated_bytes_total > 0, "GC moved nothing: {st:?}");
    let check = |dg: &DiskGroup, when: &str| {
        let mut got = vec![0u8; size];
        dg.read(v, 0, &mut got).unwrap();
        assert!(got == model, "{when}: v reads back what was written");
        let mut got = vec![0u8; fill.len()];
        dg.read(w, 0, &mut got).unwrap();
        assert!(got == fill, "{when}: w reads back what was written");
    };
    check(dg, "after GC");
    // The moved blocks' new entries (under the volume's layer) are what recovery reads.
    rig.power_cut_and_restart();
    check(rig.dg(), "after a power cut");
}

/// A volume-table change that grows the table must leave room in the checkpoint for the
/// destager's recent segments: with a table filled until changes were refused, writes are
/// still destaged and the log freed (the destager's checkpoints used to no longer fit, so the
/// log tail stopped moving). Deleting still works on a full table.
#[test]
fn a_full_volume_table_still_lets_destage_free_the_log() {
    use crate::format::{LayerRecord, SnapshotRecord};
    let rig = Rig::new(
        24 * MIB,
        &[48 * MIB],
        small_cfg(),
        seed_for("a_full_volume_table_still_lets_destage_free_the_log"),
    );
    let dg = rig.dg();
    let data = dg.create_volume("data", 16 * MIB).unwrap().id;
    // Many volumes keep each one's chain of snapshot layers short.
    let vols: Vec<u32> = (0..256)
        .map(|i| dg.create_volume(&format!("v{i:0>63}"), MIB).unwrap().id)
        .collect();
    let full = |e: &EngineError| e.to_string().contains("the volume table is full");
    // Snapshot records (106 bytes each with their layers) through the same admission as the
    // API, many per change, then fewer, until none fits.
    let mut taken = 0usize;
    for chunk in [1024usize, 64, 4, 1] {
        loop {
            let result = dg.change(|t| {
                for k in taken..taken + chunk {
                    let vol = vols[k % vols.len()];
                    let head = t.volumes[&vol].head;
                    let (id, layer) = (t.next_id, t.next_id + 1);
                    t.next_id += 2;
                    t.layers.insert(
                        layer,
                        LayerRecord {
                            id: layer,
                            parent: head,
                            flags: 0,
                        },
                    );
                    t.snapshots.insert(
                        id,
                        SnapshotRecord {
                            id,
                            volume: vol,
                            layer: head,
                            size_bytes: MIB,
                            created_unix_s: 1,
                            name: format!("s{k:0>63}"),
                        },
                    );
                    t.volumes.get_mut(&vol).unwrap().head = layer;
                }
                Ok(())
            });
            match result {
                Ok(()) => taken += chunk,
                Err(e) if full(&e) => break,
                Err(e) => panic!("{e}"),
            }
        }
    }
    assert!(taken > 5000, "only {taken} snapshots fit");
    // Then volumes through the API (40 bytes and the name), with names of 64 letters down to
    // one, until not even a one-letter name fits: less than 41 bytes are left.
    let mut made = 0;
    'fill: loop {
        for len in [64, 32, 16, 8, 4, 2, 1] {
            match dg.create_volume(&format!("{made:0>len$}"), MIB) {
                Ok(_) => {
                    made += 1;
                    continue 'fill;
                }
                Err(e) if full(&e) => {}
                Err(e) => panic!("{e}"),
            }
        }
        break;
    }
    // Writes that seal a dozen segments before the next index flush.
    let model = vec![7u8; 12 * MIB as usize];
    dg.write(data, 0, &model).unwrap();
    assert!(
        dg.destage_all(Duration::from_secs(20)),
        "destage could not free the log: {:?}",
        dg.stats()
    );
    check_volume(dg, data, &model, "after destage");
    dg.delete_volume(&format!("v{:0>63}", 3), true).unwrap();
}

/// Volumes and snapshots are found by name (`volume`, `view`, what the API and every NBD
/// export lookup use) through maps made from the volume table: they follow every create,
/// clone, rollback and delete (names used again after a delete, by a new id), and are made
/// again at open, after a clean stop and after a power cut. Names gone are not found.
#[test]
fn names_are_found_after_every_change_and_after_a_restart() {
    let mut rig = Rig::new(16 * MIB, &[32 * MIB], small_cfg(), 44);
    // name -> id, for volumes and for `vol@snap`; and the names deleted.
    let mut live: BTreeMap<String, VolumeId> = BTreeMap::new();
    let mut gone: Vec<String> = Vec::new();
    let check = |dg: &DiskGroup, live: &BTreeMap<String, VolumeId>, gone: &[String], what: &str| {
        for (name, id) in live {
            let found = dg.view(name).map(|v| v.id);
            assert_eq!(found, Some(*id), "{what}: {name}");
            if !name.contains('@') {
                assert_eq!(dg.volume(name).map(|v| v.id), Some(*id), "{what}: {name}");
            }
        }
        for name in gone.iter().filter(|n| !live.contains_key(*n)) {
            assert!(dg.view(name).is_none(), "{what}: {name} was deleted");
        }
    };
    for round in 0..3 {
        let dg = rig.dg();
        for i in 0..4 {
            let v = format!("v{i}");
            if !live.contains_key(&v) {
                live.insert(v.clone(), dg.create_volume(&v, MIB).unwrap().id);
            }
            let s = format!("s{round}");
            let id = dg.create_snapshot(&v, &s).unwrap().id;
            live.insert(format!("{v}@{s}"), id);
        }
        check(dg, &live, &gone, &format!("round {round}, created"));
        let c = format!("c{round}");
        let id = dg
            .clone_snapshot("v1", &format!("s{round}"), &c)
            .unwrap()
            .id;
        live.insert(c, id);
        dg.rollback_volume("v2", "s0").unwrap();
        dg.delete_snapshot("v3", &format!("s{round}")).unwrap();
        gone.push(format!("v3@s{round}"));
        live.remove(&format!("v3@s{round}"));
        // v0 goes with its snapshots; the next round makes it again, with a new id.
        dg.delete_volume("v0", true).unwrap();
        live.retain(|name, _| name != "v0" && !name.starts_with("v0@"));
        gone.extend((0..=round).map(|r| format!("v0@s{r}")));
        gone.push("v0".into());
        check(dg, &live, &gone, &format!("round {round}, changed"));
        if round % 2 == 0 {
            rig.clean_restart();
        } else {
            rig.power_cut_and_restart();
        }
        check(rig.dg(), &live, &gone, &format!("round {round}, reopened"));
    }
}

/// A trim or write-zeroes of part of a block that holds nothing writes nothing (it reads as
/// zeros already); of part of a block that holds data, in the volume or in a snapshot it reads
/// through, it zeroes those bytes as before. (Each such request on an unwritten block wrote a
/// 4 KiB block of zeros: space taken, and ENOSPC possible on a full tier, for nothing.)
#[test]
fn a_partial_trim_of_a_block_that_holds_nothing_writes_nothing() {
    let rig = Rig::new(24 * MIB, &[48 * MIB], small_cfg(), 97);
    let dg = rig.dg();
    let v = dg.create_volume("v", 4 * MIB).unwrap().id;
    let appended = || {
        dg.sh
            .counters
            .log_host_appended_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = appended();
    dg.discard(v, 0, 1000).unwrap();
    dg.discard(v, 8192 + 100, 100).unwrap();
    dg.write_zeroes(v, 16384 + 512, 512).unwrap();
    // Across a block boundary, and with whole blocks between unwritten edges.
    dg.write_zeroes(v, 6 * 4096 - 100, 200).unwrap();
    dg.discard(v, 10 * 4096 + 1, 3 * 4096).unwrap();
    assert_eq!(
        appended(),
        before,
        "a request on unwritten blocks wrote the log"
    );
    let s = dg.space(v).unwrap();
    assert_eq!(
        s.exclusive_fast_bytes + s.exclusive_capacity_bytes,
        0,
        "{s:?}"
    );

    // Data in the volume's block, and data a snapshot holds under another block.
    dg.write(v, 20 * 4096, &[0x61; 4096]).unwrap();
    dg.write(v, 30 * 4096, &[0x62; 4096]).unwrap();
    dg.create_snapshot("v", "s").unwrap();
    dg.discard(v, 20 * 4096 + 100, 200).unwrap();
    dg.write_zeroes(v, 30 * 4096 + 4000, 96).unwrap();
    let mut block = vec![0u8; 4096];
    dg.read(v, 20 * 4096, &mut block).unwrap();
    let mut want = vec![0x61; 4096];
    want[100..300].fill(0);
    assert_eq!(block, want, "the volume's own block");
    dg.read(v, 30 * 4096, &mut block).unwrap();
    let mut want = vec![0x62; 4096];
    want[4000..].fill(0);
    assert_eq!(block, want, "a block the volume reads through its snapshot");
    let s = dg.view("v@s").unwrap().id;
    dg.read(s, 30 * 4096, &mut block).unwrap();
    assert_eq!(block, vec![0x62; 4096], "the snapshot kept its block");
}
