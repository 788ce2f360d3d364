//! Restore installs segments inside the range as they are and rewrites only those that
//! straddle it: tombstones keep shadowing, no key group leaks out of the range, and the files
//! a restore used are never written by the restored store.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use weir_io::{Fs, StdFs};
use weir_state::{KeyGroupRange, RestoreReport, SnapshotHandle, Store, StoreConfig};

mod common;
use common::{all, key};

fn config(mp: u16) -> StoreConfig {
    StoreConfig {
        memtable_budget_bytes: 64 << 20,
        block_target_bytes: 256,
        // No automatic compaction: each test decides the segment layout.
        compaction_min_merge: 100,
        max_segments: 100,
        max_parallelism: mp,
        ..StoreConfig::default()
    }
}

fn fs() -> Arc<dyn Fs> {
    Arc::new(StdFs)
}

/// Writes `ops` (key group, user key, value or delete) and flushes them as one segment.
fn segment(s: &mut Store, ops: &[(u16, u16, Option<u8>)]) {
    for &(kg, u, v) in ops {
        match v {
            Some(v) => s.put(&key(kg, u), &[v, v]),
            None => s.delete(&key(kg, u)),
        }
    }
    s.freeze();
    s.run_pending_maintenance().unwrap();
}

fn snapshot(s: &mut Store, id: u64) -> SnapshotHandle {
    let h = s.snapshot(id).run().unwrap();
    // Through the bytes, as a checkpoint carries it.
    SnapshotHandle::from_bytes(&h.to_bytes()).unwrap()
}

fn file_bytes(h: &SnapshotHandle) -> Vec<(PathBuf, Vec<u8>)> {
    h.segments
        .iter()
        .map(|r| (r.path.clone(), std::fs::read(&r.path).unwrap()))
        .collect()
}

fn model_apply(model: &mut BTreeMap<Vec<u8>, Vec<u8>>, ops: &[(u16, u16, Option<u8>)]) {
    for &(kg, u, v) in ops {
        match v {
            Some(v) => model.insert(key(kg, u), vec![v, v]),
            None => model.remove(&key(kg, u)),
        };
    }
}

fn in_range(model: &BTreeMap<Vec<u8>, Vec<u8>>, r: KeyGroupRange) -> Vec<(Vec<u8>, Vec<u8>)> {
    model
        .iter()
        .filter(|(k, _)| r.contains(u16::from_be_bytes([k[0], k[1]])))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Checks the restored store against the model on `range`, by scan and by point reads of
/// every key ever written (inside the range and out of it), before and after a full
/// compaction of the restored store.
fn check(
    s: &mut Store,
    model: &BTreeMap<Vec<u8>, Vec<u8>>,
    keys: &[Vec<u8>],
    range: KeyGroupRange,
    what: &str,
) {
    for pass in ["restored", "compacted"] {
        assert_eq!(all(s), in_range(model, range), "{what}, {pass}: scan");
        for k in keys {
            let kg = u16::from_be_bytes([k[0], k[1]]);
            let want = model.get(k).filter(|_| range.contains(kg));
            let got = s.get(k).unwrap().map(|f| f.value.to_vec());
            assert_eq!(got.as_ref(), want, "{what}, {pass}: get {k:?}");
        }
        s.flush_and_compact_all().unwrap();
    }
}

/// Layouts of an older and a newer segment (the newer deleting keys of the older), restored
/// onto ranges that make each of them inside or straddling: a tombstone of the newer one must
/// shadow the older one in every combination, and a straddling segment must not leak keys.
#[test]
fn tombstones_shadow_older_segments_whether_installed_or_rewritten() {
    let mp = 8;
    // Older: key groups 2..=3 (inside [0, 3]) or 2..=5 (straddles it).
    // Newer: deletes some of the older keys and overwrites others; 2..=3 or 2..=6.
    let older_narrow: Vec<_> = (2..=3)
        .flat_map(|kg| (0..40).map(move |u| (kg, u, Some(1))))
        .collect();
    let older_wide: Vec<_> = (2..=5)
        .flat_map(|kg| (0..40).map(move |u| (kg, u, Some(1))))
        .collect();
    let newer = |wide: bool| -> Vec<(u16, u16, Option<u8>)> {
        let mut v: Vec<_> = (2..=3)
            .flat_map(|kg| {
                (0..40).filter_map(move |u| match u % 3 {
                    0 => Some((kg, u, None)),
                    1 => Some((kg, u, Some(2))),
                    _ => None,
                })
            })
            .collect();
        if wide {
            v.extend((5..=6).map(|kg| (kg, 7, Some(3))));
            v.push((5, 1, None));
        }
        v
    };
    let root = tempfile::tempdir().unwrap();
    let mut n = 0;
    for older_wide_ in [false, true] {
        for newer_wide in [false, true] {
            let older = if older_wide_ {
                older_wide.clone()
            } else {
                older_narrow.clone()
            };
            let newer = newer(newer_wide);
            n += 1;
            let mut src =
                Store::open(fs(), &root.path().join(format!("src{n}")), config(mp)).unwrap();
            segment(&mut src, &older);
            segment(&mut src, &newer);
            let h = snapshot(&mut src, 1);
            assert_eq!(h.segments.len(), 2);
            let mut model = BTreeMap::new();
            model_apply(&mut model, &older);
            model_apply(&mut model, &newer);
            let keys: Vec<_> = older
                .iter()
                .chain(&newer)
                .map(|&(kg, u, _)| key(kg, u))
                .collect();
            for range in [
                KeyGroupRange::new(0, 3),
                KeyGroupRange::new(3, 7),
                KeyGroupRange::all(mp),
            ] {
                n += 1;
                let what =
                    format!("older wide {older_wide_}, newer wide {newer_wide}, range {range:?}");
                let (mut r, report) = restore_via_links(
                    &root.path().join(format!("r{n}")),
                    std::slice::from_ref(&h),
                    range,
                    mp,
                );
                let straddling = h
                    .segments
                    .iter()
                    .filter(|s| {
                        let kg = s.key_groups.unwrap();
                        kg.intersects(&range) && !(range.first <= kg.first && kg.last <= range.last)
                    })
                    .count();
                assert_eq!(report.rewritten_inputs, straddling, "{what}: {report:?}");
                check(&mut r, &model, &keys, range, &what);
            }
        }
    }
}

/// Restores `h` the way the runtime does, from files made for the new store alone, but as
/// hard links to the source files: whatever the store does later must leave them unchanged.
fn restore_via_links(
    dir: &Path,
    handles: &[SnapshotHandle],
    range: KeyGroupRange,
    mp: u16,
) -> (Store, RestoreReport) {
    let local = dir.join("restore");
    std::fs::create_dir_all(&local).unwrap();
    let mut handles = handles.to_vec();
    for (i, h) in handles.iter_mut().enumerate() {
        for s in &mut h.segments {
            let p = local.join(format!("{i}-{:016x}.wseg", s.segment_id));
            std::fs::hard_link(&s.path, &p).unwrap();
            s.path = p;
        }
    }
    Store::restore_adopting(fs(), dir, config(mp), &handles, range).unwrap()
}

/// The same parallelism restores without rewriting anything; scale-in installs segments as
/// they are (renumbering none: colliding ids of the other old shard are rewritten); scale-out
/// rewrites straddling segments and leaks no key group of another shard, by scan or by get.
#[test]
fn rescaled_restores_keep_exactly_their_key_groups() {
    let mp = 16;
    let root = tempfile::tempdir().unwrap();
    let mut handles = Vec::new();
    let mut model = BTreeMap::new();
    let mut keys = Vec::new();
    for shard in 0..2u16 {
        let range = KeyGroupRange::for_shard(shard, 2, mp);
        let mut s =
            Store::open(fs(), &root.path().join(format!("old{shard}")), config(mp)).unwrap();
        for round in 0..3u16 {
            let ops: Vec<_> = (range.first..=range.last)
                .flat_map(|kg| {
                    (0..30u16).map(move |u| {
                        let v = if (u + round) % 5 == 0 {
                            None
                        } else {
                            Some(round as u8)
                        };
                        (kg, u + round * 7, v)
                    })
                })
                .collect();
            segment(&mut s, &ops);
            model_apply(&mut model, &ops);
            keys.extend(ops.iter().map(|&(kg, u, _)| key(kg, u)));
        }
        handles.push(snapshot(&mut s, 1));
    }
    let segs: usize = handles.iter().map(|h| h.segments.len()).sum();
    let sources: Vec<_> = handles.iter().map(file_bytes).collect();
    let mut n = 0;
    for shards in [1u16, 2, 3, 5] {
        let mut union = BTreeMap::new();
        for shard in 0..shards {
            let range = KeyGroupRange::for_shard(shard, shards, mp);
            n += 1;
            let (mut r, report) =
                restore_via_links(&root.path().join(format!("new{n}")), &handles, range, mp);
            let what = format!("shard {shard} of {shards}, {range:?}");
            match shards {
                // Same parallelism: every segment is installed as it is.
                2 => assert_eq!(
                    (report.installed, report.rewritten_inputs),
                    (3, 0),
                    "{what}"
                ),
                // Scale-in: the first old shard's segments are installed; the second's ids
                // repeat the first's and are rewritten.
                1 => assert_eq!(
                    (report.installed, report.rewritten_inputs),
                    (3, 3),
                    "{what}"
                ),
                _ => {}
            }
            // Every installed segment lies inside the range.
            let hr = snapshot(&mut r, 2);
            for s in &hr.segments {
                let kg = s.key_groups.unwrap();
                assert!(
                    range.first <= kg.first && kg.last <= range.last,
                    "{what}: {s:?}"
                );
            }
            let before: Vec<_> = all(&mut r);
            for (k, v) in &before {
                assert!(
                    union.insert(k.clone(), v.clone()).is_none(),
                    "{what}: key restored twice"
                );
            }
            check(&mut r, &model, &keys, range, &what);
        }
        assert_eq!(
            union, model,
            "{shards} shards together hold the whole state"
        );
    }
    assert_eq!(segs, 6);
    let after: Vec<_> = handles.iter().map(file_bytes).collect();
    assert!(sources == after, "a source segment file changed");
}

/// Files a restore used are only read: after the restored store flushed, compacted (which
/// replaces and drops the installed segments) and snapshotted, the source files (here hard
/// links share their inodes with the adopted copies) hold the same bytes, and the source
/// store restores from them again.
#[test]
fn restored_files_are_never_written_by_later_store_activity() {
    let mp = 8;
    let root = tempfile::tempdir().unwrap();
    let mut src = Store::open(fs(), &root.path().join("src"), config(mp)).unwrap();
    let mut model = BTreeMap::new();
    for round in 0..3u8 {
        let ops: Vec<_> = (0..mp)
            .flat_map(|kg| (0..50u16).map(move |u| (kg, u, Some(round))))
            .collect();
        segment(&mut src, &ops);
        model_apply(&mut model, &ops);
    }
    let h = snapshot(&mut src, 1);
    let before = file_bytes(&h);
    for (adopt, range) in [
        (true, KeyGroupRange::all(mp)),
        (false, KeyGroupRange::all(mp)),
        (true, KeyGroupRange::new(2, 5)),
    ] {
        let dir = root.path().join(format!("r-{adopt}-{}", range.first));
        let mut r = if adopt {
            restore_via_links(&dir, std::slice::from_ref(&h), range, mp).0
        } else {
            Store::restore(fs(), &dir, config(mp), std::slice::from_ref(&h), range).unwrap()
        };
        for round in 0..4u8 {
            for kg in range.first..=range.last {
                for u in 0..60u16 {
                    r.put(&key(kg, u), &[round; 3]);
                }
                r.delete(&key(kg, 1));
            }
            r.freeze();
            r.run_pending_maintenance().unwrap();
            let _ = r.snapshot(10 + u64::from(round)).run().unwrap();
        }
        r.flush_and_compact_all().unwrap();
        for id in r.retained_snapshots() {
            r.release_snapshot(id);
        }
        drop(r);
        assert_eq!(
            file_bytes(&h),
            before,
            "adopt {adopt}, {range:?}: source files changed"
        );
    }
    let mut again = Store::restore(
        fs(),
        &root.path().join("again"),
        config(mp),
        &[h],
        KeyGroupRange::all(mp),
    )
    .unwrap();
    assert_eq!(all(&mut again), model.into_iter().collect::<Vec<_>>());
}
