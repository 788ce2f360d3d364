//! Store behaviour: model-based property test, snapshots, restore, TTL, reference counts,
//! corruption and torn writes.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use weir_io::{FaultConfig, FaultyFs, Fs, StdFs};
use weir_state::{
    segment_layout as L, FormatError, KeyGroupRange, SnapshotHandle, SnapshotJob, StateError,
    Store, StoreConfig,
};

mod common;
use common::{all, key};

fn small_config(mp: u16) -> StoreConfig {
    StoreConfig {
        memtable_budget_bytes: 16 << 10,
        block_target_bytes: 256,
        max_parallelism: mp,
        ..StoreConfig::default()
    }
}

/// What the store should hold.
type Model = BTreeMap<Vec<u8>, Vec<u8>>;

fn snapshot(store: &mut Store, id: u64) -> SnapshotHandle {
    store.snapshot(id).run().unwrap()
}

/// Every entry of snapshot `h` restored into `dir` with all key groups.
fn restored(fs: &Arc<dyn Fs>, dir: &Path, h: SnapshotHandle) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut r = Store::restore(
        fs.clone(),
        dir,
        small_config(8),
        &[h],
        KeyGroupRange::all(8),
    )
    .unwrap();
    all(&mut r)
}

#[derive(Debug, Clone)]
enum Op {
    Put(u16, u16, u8),
    Delete(u16, u16),
    Get(u16, u16),
    MultiGetAll,
    ScanKg(u16),
    Freeze,
    Maintain,
    FullCompact,
    Restore {
        first: u16,
        last: u16,
        replace: bool,
    },
    /// Start a snapshot whose job runs only at the next `SnapshotLater` (or the end), after
    /// the ops between have changed the store; its restore must equal the store at the start.
    SnapshotLater,
}

fn op() -> impl Strategy<Value = Op> {
    let kg = 0u16..8;
    let uk = 0u16..24;
    prop_oneof![
        30 => (kg.clone(), uk.clone(), 0u8..=255).prop_map(|(a, b, c)| Op::Put(a, b, c)),
        8 => (kg.clone(), uk.clone()).prop_map(|(a, b)| Op::Delete(a, b)),
        10 => (kg.clone(), uk).prop_map(|(a, b)| Op::Get(a, b)),
        2 => Just(Op::MultiGetAll),
        3 => kg.clone().prop_map(Op::ScanKg),
        3 => Just(Op::Freeze),
        3 => Just(Op::Maintain),
        1 => Just(Op::FullCompact),
        3 => Just(Op::SnapshotLater),
        2 => (kg.clone(), kg, any::<bool>()).prop_map(|(a, b, r)| Op::Restore {
            first: a.min(b),
            last: a.max(b),
            replace: r,
        }),
    ]
}

fn cases() -> u32 {
    std::env::var("WEIR_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// The store equals a BTreeMap model through puts, deletes, point and batched gets,
    /// flushes, compactions, snapshots and restores (onto key-group subranges too).
    #[test]
    fn store_matches_model(
        ops in proptest::collection::vec(op(), 1..120),
        retain in 0usize..3,
        prefault in proptest::bool::ANY,
        epochs in 0usize..3,
    ) {
        let root = tempfile::tempdir().unwrap();
        let fs: Arc<dyn Fs> = Arc::new(StdFs);
        let mut dirs = 0;
        // With retention, flushed memtables stay readable in front of their segments: reads
        // must not change, with room for several memtables or for about one (then freezes
        // recycle the retained memtable the next flush would evict). Nor may they with the
        // memtable's memory faulted in up front. Nor with snapshots that freeze the memtable
        // once its epochs' segments pass their bound (0: any epoch segment of it).
        let config = StoreConfig {
            retained_memtable_bytes: [0, 12 << 10, 48 << 10][retain],
            prefault_memtable: prefault,
            snapshot_epochs_max_shares: [0, 1, 4][epochs],
            ..small_config(8)
        };
        let mut store = Store::open(fs.clone(), &root.path().join("s0"), config.clone()).unwrap();
        let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let mut ckpt = 0;
        let mut later: Option<(weir_state::SnapshotJob, Model)> = None;
        let check_later = |job: weir_state::SnapshotJob, want: Model, dirs: &mut u32| {
            let h = job.run().unwrap();
            *dirs += 1;
            restored(&fs, &root.path().join(format!("s{dirs}")), h) == want.into_iter().collect::<Vec<_>>()
        };
        for op in ops {
            match op {
                Op::Put(kg, u, v) => {
                    let val = vec![v; 1 + usize::from(v % 40)];
                    store.put(&key(kg, u), &val);
                    model.insert(key(kg, u), val);
                }
                Op::Delete(kg, u) => {
                    store.delete(&key(kg, u));
                    model.remove(&key(kg, u));
                }
                Op::Get(kg, u) => {
                    let got = store.get(&key(kg, u)).unwrap().map(|f| f.value.to_vec());
                    prop_assert_eq!(got, model.get(&key(kg, u)).cloned());
                }
                Op::MultiGetAll => {
                    // Every key the ops can name, present or not, in one batched lookup.
                    let keys: Vec<Vec<u8>> = (0..8u16)
                        .flat_map(|kg| (0..24u16).map(move |u| key(kg, u)))
                        .collect();
                    let mut got = vec![None; keys.len()];
                    store
                        .multi_get(&keys, |i, f| got[i] = Some(f.map(|f| f.value.to_vec())))
                        .unwrap();
                    for (k, g) in keys.iter().zip(got) {
                        prop_assert_eq!(g, Some(model.get(k).cloned()), "key {:?}", k);
                    }
                }
                Op::ScanKg(kg) => {
                    let got: Vec<_> = store
                        .scan_key_groups(KeyGroupRange::new(kg, kg))
                        .map(|e| e.map(|(k, f)| (k.to_vec(), f.value.to_vec())).unwrap())
                        .collect();
                    let want: Vec<_> = model
                        .range(kg.to_be_bytes().to_vec()..(kg + 1).to_be_bytes().to_vec())
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    prop_assert_eq!(got, want);
                }
                Op::Freeze => store.freeze(),
                Op::Maintain => store.run_pending_maintenance().unwrap(),
                Op::FullCompact => store.flush_and_compact_all().unwrap(),
                Op::Restore { first, last, replace } => {
                    ckpt += 1;
                    let h = snapshot(&mut store, ckpt);
                    let h = SnapshotHandle::from_bytes(&h.to_bytes()).unwrap();
                    dirs += 1;
                    let range = if replace { KeyGroupRange::all(8) } else { KeyGroupRange::new(first, last) };
                    // The restored store keeps the case's configuration: a replacing restore
                    // goes on as the store under test.
                    let mut r = Store::restore(fs.clone(), &root.path().join(format!("s{dirs}")), config.clone(), &[h], range).unwrap();
                    let want: Vec<_> = model
                        .iter()
                        .filter(|(k, _)| range.contains(u16::from_be_bytes([k[0], k[1]])))
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    prop_assert_eq!(all(&mut r), want);
                    if replace {
                        // A snapshot job finishes before its store goes (the runtime's do).
                        if let Some((job, want)) = later.take() {
                            prop_assert!(check_later(job, want, &mut dirs), "deferred snapshot");
                        }
                        store = r;
                    }
                }
                Op::SnapshotLater => match later.take() {
                    Some((job, want)) => prop_assert!(check_later(job, want, &mut dirs), "deferred snapshot"),
                    None => {
                        ckpt += 1;
                        later = Some((store.snapshot(ckpt), model.clone()));
                    }
                },
            }
        }
        if let Some((job, want)) = later.take() {
            prop_assert!(check_later(job, want, &mut dirs), "deferred snapshot at the end");
        }
        prop_assert_eq!(all(&mut store), model.into_iter().collect::<Vec<_>>());
    }
}

#[test]
fn restore_merges_shards_onto_other_parallelism() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mp = 16;
    let mut handles = Vec::new();
    let mut model = BTreeMap::new();
    for shard in 0..2u16 {
        let range = KeyGroupRange::for_shard(shard, 2, mp);
        let mut s = Store::open(
            fs.clone(),
            &root.path().join(format!("old{shard}")),
            small_config(mp),
        )
        .unwrap();
        for kg in range.first..=range.last {
            for u in 0..50 {
                s.put(&key(kg, u), &[kg as u8, u as u8]);
                model.insert(key(kg, u), vec![kg as u8, u as u8]);
            }
        }
        s.run_pending_maintenance().unwrap();
        handles.push(snapshot(&mut s, 1));
    }
    let mut seen = BTreeMap::new();
    for shard in 0..3u16 {
        let range = KeyGroupRange::for_shard(shard, 3, mp);
        let mut s = Store::restore(
            fs.clone(),
            &root.path().join(format!("new{shard}")),
            small_config(mp),
            &handles,
            range,
        )
        .unwrap();
        for (k, v) in all(&mut s) {
            assert!(range.contains(u16::from_be_bytes([k[0], k[1]])));
            assert!(seen.insert(k, v).is_none(), "a key restored twice");
        }
    }
    assert_eq!(seen, model);
}

#[test]
fn snapshot_is_isolated_from_later_writes_and_incremental() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    // A budget of 16 arena chunks: the one the writes after the seal copy for the job does
    // not take the memtable to its share (with `small_config` it is half of it, and froze it).
    let config = StoreConfig {
        memtable_budget_bytes: 64 << 10,
        ..small_config(8)
    };
    let mut s = Store::open(fs.clone(), &root.path().join("a"), config).unwrap();
    s.put(&key(1, 1), b"one");
    let job = s.snapshot(1);
    // Writes after the synchronous part are not in the snapshot.
    s.put(&key(1, 1), b"two");
    s.put(&key(2, 2), b"new");
    let h1 = job.run().unwrap();
    assert!(h1.segments.iter().all(|r| r.is_new));
    let h2 = snapshot(&mut s, 2);
    let old: Vec<_> = h2
        .segments
        .iter()
        .filter(|r| !r.is_new)
        .map(|r| r.segment_id)
        .collect();
    assert_eq!(
        old,
        h1.segments.iter().map(|r| r.segment_id).collect::<Vec<_>>(),
        "checkpoint 2 reuses checkpoint 1's segment"
    );
    assert_eq!(h2.segments.iter().filter(|r| r.is_new).count(), 1);
    let mut r = Store::restore(
        fs.clone(),
        &root.path().join("b"),
        small_config(8),
        &[h1],
        KeyGroupRange::all(8),
    )
    .unwrap();
    assert_eq!(all(&mut r), vec![(key(1, 1), b"one".to_vec())]);
}

#[test]
fn segments_are_deleted_only_when_nothing_refers_to_them() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    // Full listings only: a chain would keep the last snapshot's segments for the next one
    // (see `delta_snapshots_list_the_previous_snapshot_and_the_epochs_since`).
    let config = StoreConfig {
        snapshot_chain_segments_max: 0,
        ..small_config(8)
    };
    let mut s = Store::open(fs.clone(), root.path(), config).unwrap();
    s.put(&key(0, 1), b"a");
    let h1 = snapshot(&mut s, 1);
    s.put(&key(0, 2), b"b");
    let h2 = snapshot(&mut s, 2);
    let p1 = h1.segments[0].path.clone();
    // Compaction replaces both segments; the snapshots still hold them.
    s.flush_and_compact_all().unwrap();
    assert_eq!(s.metrics().segments, 1);
    assert!(p1.exists() && h2.segments[1].path.exists());
    s.release_snapshot(1);
    assert!(p1.exists(), "snapshot 2 still refers to it");
    s.release_snapshot(2);
    assert!(!p1.exists() && !h2.segments[1].path.exists());
    let live = s.segment_paths();
    assert!(live[0].exists());
    assert_eq!(all(&mut s).len(), 2);
    // Shutdown deletes nothing a retained snapshot names.
    s.put(&key(0, 3), b"c");
    let h3 = snapshot(&mut s, 3);
    s.flush_and_compact_all().unwrap();
    drop(s);
    for r in &h3.segments {
        assert!(r.path.exists());
    }
}

#[test]
fn ttl_hides_and_compaction_drops() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mut s = Store::open(fs, root.path(), small_config(8)).unwrap();
    s.set_ttl(1, Some(100));
    s.set_now_ms(1000);
    s.put(&key(0, 1), b"x");
    s.set_now_ms(1099);
    assert!(s.get(&key(0, 1)).unwrap().is_some());
    s.freeze();
    s.run_pending_maintenance().unwrap();
    assert!(
        s.get(&key(0, 1)).unwrap().is_some(),
        "still live from a segment"
    );
    s.set_now_ms(1100);
    assert!(s.get(&key(0, 1)).unwrap().is_none());
    assert_eq!(all(&mut s).len(), 0);
    s.put(&key(0, 9), b"keep");
    s.set_ttl(1, None);
    s.put(&key(0, 8), b"keep");
    s.flush_and_compact_all().unwrap();
    assert_eq!(s.metrics().segments, 1);
    s.set_now_ms(0);
    // Even with the clock turned back, the expired entry was dropped by the compaction.
    assert!(s.get(&key(0, 1)).unwrap().is_none());
}

#[test]
fn second_store_on_a_directory_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let _a = Store::open(fs.clone(), root.path(), small_config(8)).unwrap();
    assert!(matches!(
        Store::open(fs, root.path(), small_config(8)),
        Err(StateError::Io(weir_io::IoError::Locked { .. }))
    ));
}

/// A segment with several data blocks, and its handle.
fn one_segment(root: &Path) -> (SnapshotHandle, PathBuf) {
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 256 << 10,
        ..small_config(8)
    };
    let mut s = Store::open(fs, &root.join("src"), config).unwrap();
    for u in 0..60 {
        s.put(&key(u % 8, u), &[u as u8; 20]);
    }
    let h = snapshot(&mut s, 1);
    assert_eq!(h.segments.len(), 1);
    let p = h.segments[0].path.clone();
    (h, p)
}

fn rd(b: &[u8], at: usize, n: usize) -> u64 {
    let mut x = [0u8; 8];
    x[..n].copy_from_slice(&b[at..at + n]);
    u64::from_le_bytes(x)
}

/// The regions of a segment file: (name, start, end).
fn regions(b: &[u8]) -> Vec<(String, usize, usize)> {
    let fo = b.len() - L::FOOTER_LEN;
    let index_off = rd(b, fo + L::F_INDEX_OFFSET, 8) as usize;
    let filter_off = rd(b, fo + L::F_FILTER_OFFSET, 8) as usize;
    let blocks = rd(b, fo + L::F_DATA_BLOCKS, 4) as usize;
    let mut out = vec![("header".to_owned(), 0, L::FILE_HEADER_LEN)];
    let ip = index_off + weir_io::BLOCK_HEADER_LEN + L::INDEX_HEADER_LEN;
    let mut pos = ip;
    for i in 0..blocks {
        let off = rd(b, pos, 8) as usize;
        let len = rd(b, pos + 8, 4) as usize;
        let klen = rd(b, pos + 12, 2) as usize;
        out.push((format!("data block {i}"), off, off + len));
        pos += L::INDEX_ENTRY_FIXED_LEN + klen;
    }
    out.push(("index".to_owned(), index_off, filter_off));
    out.push(("filter".to_owned(), filter_off, fo));
    out.push(("footer".to_owned(), fo, b.len()));
    out
}

#[test]
fn corruption_of_every_region_is_detected_with_file_and_offset() {
    let root = tempfile::tempdir().unwrap();
    let (h, p) = one_segment(root.path());
    let pristine = std::fs::read(&p).unwrap();
    let regs = regions(&pristine);
    assert!(regs.len() >= 6, "want several data blocks: {regs:?}");
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mut n = 0;
    for (r, (name, start, end)) in regs.iter().enumerate() {
        // First, last and a few interior bytes of each region, each a different bit; over
        // the regions, every bit position.
        let len = end - start;
        let picks = [0, 1, len / 3, len / 2, len - 2, len - 1];
        for (j, &at) in picks.iter().enumerate() {
            let off = start + at;
            let mut c = pristine.clone();
            c[off] ^= 1 << ((j * 3 + r) % 8);
            std::fs::write(&p, &c).unwrap();
            n += 1;
            let err = Store::restore(
                fs.clone(),
                &root.path().join(format!("r{n}")),
                small_config(8),
                std::slice::from_ref(&h),
                KeyGroupRange::all(8),
            )
            .expect_err(&format!("flip in {name} at {off} undetected"));
            let f = err
                .as_format()
                .unwrap_or_else(|| panic!("{name} at {off}: not a format error: {err}"));
            assert_eq!(f.file(), p.as_path());
            assert!(
                (*start as u64..*end as u64).contains(&f.offset()),
                "flip in {name} [{start}, {end}) at {off} reported at {}: {f}",
                f.offset()
            );
        }
    }
    std::fs::write(&p, &pristine).unwrap();
    Store::restore(
        fs,
        &root.path().join("ok"),
        small_config(8),
        &[h],
        KeyGroupRange::all(8),
    )
    .unwrap();
}

#[test]
fn truncated_foreign_and_wrong_version_files_are_typed_errors() {
    let root = tempfile::tempdir().unwrap();
    let (h, p) = one_segment(root.path());
    let pristine = std::fs::read(&p).unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mut n = 0;
    let mut try_bytes = |bytes: &[u8]| -> StateError {
        std::fs::write(&p, bytes).unwrap();
        n += 1;
        Store::restore(
            fs.clone(),
            &root.path().join(format!("t{n}")),
            small_config(8),
            std::slice::from_ref(&h),
            KeyGroupRange::all(8),
        )
        .unwrap_err()
    };
    for cut in (0..pristine.len()).step_by(97).chain([pristine.len() - 1]) {
        let e = try_bytes(&pristine[..cut]);
        assert!(
            e.as_format().is_some_and(|f| f.file() == p),
            "cut {cut}: {e}"
        );
    }
    let e =
        try_bytes(b"definitely not a weir segment, just some text padding it out to size........");
    assert!(
        matches!(e.as_format(), Some(FormatError::BadMagic { offset: 0, .. })),
        "{e}"
    );
    let mut v2 = pristine.clone();
    v2[L::FH_VERSION] = 2;
    let e = try_bytes(&v2);
    assert!(
        matches!(
            e.as_format(),
            Some(FormatError::UnsupportedVersion { found: 2, .. })
        ),
        "{e}"
    );
    // A valid segment with another id (misdirected file) is refused.
    let mut other = h.clone();
    other.segments[0].segment_id += 1;
    std::fs::write(&p, &pristine).unwrap();
    let e = Store::restore(
        Arc::new(StdFs),
        &root.path().join("m"),
        small_config(8),
        &[other],
        KeyGroupRange::all(8),
    )
    .unwrap_err();
    assert!(
        matches!(e.as_format(), Some(FormatError::Misdirected { .. })),
        "{e}"
    );
    // Same bytes, handle disagrees on the CRC.
    let mut wrong = h.clone();
    wrong.segments[0].crc32 ^= 1;
    let e = Store::restore(
        Arc::new(StdFs),
        &root.path().join("w"),
        small_config(8),
        &[wrong],
        KeyGroupRange::all(8),
    )
    .unwrap_err();
    assert!(
        matches!(e, StateError::HandleMismatch { what: "crc32", .. }),
        "{e}"
    );
}

#[test]
fn torn_segment_write_is_never_used() {
    for step in 0..4u64 {
        let root = tempfile::tempdir().unwrap();
        let faulty = FaultyFs::new(FaultConfig {
            seed: 7 + step,
            tear_write_at_step: Some(step),
            ..FaultConfig::default()
        });
        let fs: Arc<dyn Fs> = Arc::new(faulty.clone());
        let mut cfg = small_config(8);
        cfg.memtable_budget_bytes = 64 << 20;
        let mut s = Store::open(fs, root.path(), cfg).unwrap();
        // Enough data that a segment takes several 4 MiB writes.
        let val = vec![9u8; 200];
        for u in 0..60_000u32 {
            let mut k = key((u % 8) as u16, 0);
            k.extend_from_slice(&u.to_be_bytes());
            s.put(&k, &val);
        }
        s.freeze();
        let err = s
            .run_pending_maintenance()
            .expect_err("the torn write must fail the flush");
        assert!(
            matches!(err, StateError::Io(weir_io::IoError::Injected { .. })),
            "seed {}: {err}",
            faulty.seed()
        );
        let m = s.metrics();
        assert_eq!(
            (m.segments, m.frozen_memtables),
            (0, 1),
            "seed {}",
            faulty.seed()
        );
        assert!(s.segment_paths().is_empty());
        let leftovers: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "wseg"))
            .collect();
        assert!(
            leftovers.is_empty(),
            "seed {}: torn file left behind",
            faulty.seed()
        );
        // Data is intact and a retry succeeds.
        let mut k = key(3, 0);
        k.extend_from_slice(&3u32.to_be_bytes());
        assert_eq!(s.get(&k).unwrap().unwrap().value, &val[..]);
        s.run_pending_maintenance().unwrap();
        assert_eq!(s.metrics().segments, 1);
        assert_eq!(s.get(&k).unwrap().unwrap().value, &val[..]);
    }
}

#[test]
fn crash_before_snapshot_completes_leaves_no_usable_partial_segment() {
    let root = tempfile::tempdir().unwrap();
    let faulty = FaultyFs::new(FaultConfig {
        seed: 99,
        fail_sync_at_step: Some(1),
        ..FaultConfig::default()
    });
    let fs: Arc<dyn Fs> = Arc::new(faulty.clone());
    let mut s = Store::open(fs.clone(), &root.path().join("a"), small_config(8)).unwrap();
    s.put(&key(0, 0), b"v");
    let err = s.snapshot(1).run().unwrap_err();
    assert!(matches!(
        err,
        StateError::Io(weir_io::IoError::Injected { seed: 99, .. })
    ));
    assert!(s.retained_snapshots().is_empty());
    // The memtable is still frozen and readable; the next snapshot works.
    assert_eq!(s.get(&key(0, 0)).unwrap().unwrap().value, b"v");
    let h = snapshot(&mut s, 2);
    let mut r = Store::restore(
        Arc::new(StdFs),
        &root.path().join("b"),
        small_config(8),
        &[h],
        KeyGroupRange::all(8),
    )
    .unwrap();
    assert_eq!(all(&mut r), vec![(key(0, 0), b"v".to_vec())]);
}

#[test]
fn a_failed_snapshot_job_leaves_its_frozen_memtable_to_the_flushes() {
    let root = tempfile::tempdir().unwrap();
    let faulty = FaultyFs::new(FaultConfig {
        seed: 98,
        fail_sync_at_step: Some(1),
        ..FaultConfig::default()
    });
    let fs: Arc<dyn Fs> = Arc::new(faulty);
    let mut s = Store::open(fs, root.path(), small_config(8)).unwrap();
    for u in 0..100u16 {
        s.put(&key(u % 8, u), b"v");
    }
    s.freeze();
    // The small budget froze one on the way: the job fails at the first one's fsync and
    // skips the second.
    let frozen = s.metrics().frozen_memtables;
    assert_eq!(frozen, 2);
    // The snapshot takes their writes over (flushes wait meanwhile).
    let job = s.snapshot(1);
    assert!(s.flush_job().is_none(), "the snapshot job writes them");
    let err = job.run().unwrap_err();
    assert!(matches!(
        err,
        StateError::Io(weir_io::IoError::Injected { seed: 98, .. })
    ));
    assert_eq!(s.metrics().frozen_memtables, frozen);
    // The failed job gave the memtables back: flushes write them.
    s.run_pending_maintenance().unwrap();
    let m = s.metrics();
    assert_eq!(m.frozen_memtables, 0);
    assert!(m.segments >= 1);
    assert_eq!(s.get(&key(3, 3)).unwrap().unwrap().value, b"v");
}

/// A segment this process wrote is not read back when it is opened: each data block is
/// checked against its CRC when a read first touches it. A byte that changed on disk after
/// the write gives every read of its block a typed error naming file and offset (gets,
/// batched gets, scans, the compaction that reads it), never a wrong value; the other blocks
/// still read, and the failed compaction loses nothing.
#[test]
fn a_block_that_changed_after_its_write_fails_every_read_of_it() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 1 << 20,
        retained_memtable_bytes: 0,
        ..small_config(8)
    };
    let mut s = Store::open(fs, root.path(), config).unwrap();
    let value = |u: u16| u.to_le_bytes().repeat(4);
    for u in 0..2000u16 {
        s.put(&key(u % 8, u), &value(u));
    }
    flush(&mut s);
    for u in 2000..2100u16 {
        s.put(&key(u % 8, u), &value(u));
    }
    flush(&mut s);
    let paths = s.segment_paths();
    assert_eq!(paths.len(), 2);
    let path = paths[0].clone();
    // A byte in the middle of the older segment's data blocks.
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let is_crc_error = |e: &StateError| {
        matches!(e, StateError::Format(FormatError::ChecksumMismatch { file, offset, .. })
            if *file == path && (*offset as usize) <= at && at < *offset as usize + 4096)
    };
    let (mut ok, mut failed) = (0, 0);
    for u in 0..2000u16 {
        match s.get(&key(u % 8, u)) {
            Ok(Some(f)) => {
                assert_eq!(f.value, &value(u)[..], "key {u}");
                ok += 1;
            }
            Ok(None) => panic!("key {u} lost"),
            Err(e) => {
                assert!(is_crc_error(&e), "{e}");
                failed += 1;
            }
        }
    }
    assert!(ok > 1900 && failed > 0, "{ok} read, {failed} failed");
    let keys: Vec<Vec<u8>> = (0..2000u16).map(|u| key(u % 8, u)).collect();
    let batched = s.multi_get(&keys, |_, f| assert!(f.is_some()));
    assert!(is_crc_error(&batched.unwrap_err()));
    let scanned: Vec<_> = s.scan_range(&[], None).collect();
    let last = scanned.last().unwrap().as_ref().unwrap_err();
    assert!(is_crc_error(last), "the scan ends with the error: {last}");
    assert!(scanned[..scanned.len() - 1].iter().all(|e| e.is_ok()));
    // Compaction reads the block too: it fails, and both segments stay.
    let err = s.flush_and_compact_all().unwrap_err();
    assert!(is_crc_error(&err), "{err}");
    assert_eq!(s.segment_paths(), paths);
    assert_eq!(
        s.get(&key(1, 2001)).unwrap().unwrap().value,
        &value(2001)[..]
    );
}

/// Flush the mutable memtable now (freeze, run the flush job, install it).
fn flush(s: &mut Store) {
    s.freeze();
    while let Some(j) = s.flush_job() {
        s.install(j.run()).unwrap();
    }
}

#[test]
fn retained_flushed_memtables_answer_reads_newest_first_and_give_way_to_the_budget() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        retained_memtable_bytes: 40 << 10,
        ..small_config(8)
    };
    let mut s = Store::open(fs, root.path(), config).unwrap();
    s.put(&key(0, 1), b"old");
    s.put(&key(0, 2), b"two");
    flush(&mut s);
    s.put(&key(0, 1), b"new");
    s.delete(&key(0, 2));
    flush(&mut s);
    let m = s.metrics();
    assert_eq!((m.retained_memtables, m.segments), (2, 2));
    // Both keys are answered from memory, by the newest retained memtable: the newer value
    // and the tombstone shadow the older flush.
    assert_eq!(s.get(&key(0, 1)).unwrap().unwrap().value, b"new");
    assert!(s.get(&key(0, 2)).unwrap().is_none());
    assert_eq!(s.metrics().retained_hits, 2);
    // Compaction merges the segments; the retained memtables still agree with them.
    s.flush_and_compact_all().unwrap();
    assert_eq!(s.get(&key(0, 1)).unwrap().unwrap().value, b"new");
    assert!(s.get(&key(0, 2)).unwrap().is_none());
    // More flushes than the budget holds: the oldest leave, reads fall through to segments.
    for round in 0..6u16 {
        s.put(&key(1, round), &round.to_le_bytes());
        flush(&mut s);
    }
    let m = s.metrics();
    assert!(m.retained_memtable_bytes <= 40 << 10, "{m:?}");
    assert!(m.retained_memtables < 8, "{m:?}");
    let hits = m.retained_hits;
    assert_eq!(s.get(&key(0, 1)).unwrap().unwrap().value, b"new");
    assert!(s.get(&key(0, 2)).unwrap().is_none());
    assert_eq!(
        s.metrics().retained_hits,
        hits,
        "evicted: answered by a segment"
    );
    for round in 0..6u16 {
        assert_eq!(
            s.get(&key(1, round)).unwrap().unwrap().value,
            round.to_le_bytes()
        );
    }
}

/// Batched lookups give every key the answer a plain lookup gives, over more segments than a
/// batch prepares (versions shadowed across segments, deletions, filter false positives), and
/// count the same lookups and filter rejections.
#[test]
fn multi_get_agrees_with_get_across_many_segments() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        // No compaction: every flush stays a segment of its own.
        compaction_min_merge: 1000,
        max_segments: 1000,
        // Few filter bits: false positives happen.
        bloom_bits_per_key: 2,
        ..small_config(8)
    };
    let mut s = Store::open(fs, &root.path().join("m"), config).unwrap();
    for round in 0..12u16 {
        for u in 0..400u16 {
            let u = u * 3 + round * 50;
            s.put(&key(u % 8, u), &[round as u8; 5]);
        }
        for u in (round * 7..round * 7 + 40).step_by(2) {
            s.delete(&key(u % 8, u));
        }
        s.freeze();
        s.run_pending_maintenance().unwrap();
    }
    // Some versions still in memtables, too.
    s.put(&key(1, 1), b"fresh");
    assert!(s.metrics().segments > 10, "{:?}", s.metrics().segments);
    let keys: Vec<Vec<u8>> = (0..2400u16).map(|u| key(u % 8, u)).collect();
    let before = s.metrics();
    let want: Vec<Option<Vec<u8>>> = keys
        .iter()
        .map(|k| s.get(k).unwrap().map(|f| f.value.to_vec()))
        .collect();
    let plain = s.metrics();
    let mut got = vec![None; keys.len()];
    s.multi_get(&keys, |i, f| got[i] = Some(f.map(|f| f.value.to_vec())))
        .unwrap();
    let batched = s.metrics();
    for (i, (g, w)) in got.into_iter().zip(want).enumerate() {
        assert_eq!(g, Some(w), "key {i}");
    }
    assert_eq!(batched.gets - plain.gets, plain.gets - before.gets);
    assert_eq!(
        batched.bloom_negatives - plain.bloom_negatives,
        plain.bloom_negatives - before.bloom_negatives
    );
    // Short batches (shorter than the pipeline) too.
    for n in 0..6 {
        let mut seen = Vec::new();
        s.multi_get(&keys[..n], |i, f| {
            seen.push((i, f.map(|f| f.value.to_vec())))
        })
        .unwrap();
        let want: Vec<_> = (0..n)
            .map(|i| (i, s.get(&keys[i]).unwrap().map(|f| f.value.to_vec())))
            .collect();
        assert_eq!(seen, want);
    }
}

/// The index and filter a flush builds are counted from the job until the install, then as
/// the store's own; a compaction's likewise, beside those of the segments it replaces.
#[test]
fn index_and_filter_of_uninstalled_segments_count_as_building() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mut s = Store::open(fs, root.path(), small_config(8)).unwrap();
    let held = |s: &Store| {
        let m = s.metrics();
        (m.index_bytes + m.filter_bytes, m.building_bytes)
    };
    for round in 0..2u16 {
        for u in 0..400 {
            s.put(&key(u % 8, u * 2 + round), &[1u8; 16]);
        }
        s.freeze();
        while let Some(job) = s.flush_job() {
            let (before, building) = held(&s);
            assert_eq!(building, 0);
            let done = job.run();
            let (same, building) = held(&s);
            assert_eq!(same, before, "not the store's before the install");
            assert!(building > 0, "a flush's index and filter count as building");
            s.install(done).unwrap();
            assert_eq!(held(&s), (before + building, 0));
        }
    }
    let job = s.full_compaction_job().unwrap();
    let (before, _) = held(&s);
    let done = job.run();
    let (same, building) = held(&s);
    assert_eq!(same, before);
    assert!(building > 0);
    s.install(done).unwrap();
    // One segment replaced them all: its index and filter are all the store holds.
    assert_eq!(s.metrics().segments, 1);
    assert_eq!(held(&s), (building, 0));
}

#[test]
fn memtables_stay_within_the_budget_and_writes_stall_until_the_flush() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 256 << 10,
        ..small_config(8)
    };
    let budget = config.memtable_budget_bytes;
    let mut s = Store::open(fs, root.path(), config).unwrap();
    let mut u = 0u16;
    let memory = |s: &Store| {
        let m = s.metrics();
        m.memtable_bytes + m.frozen_bytes + m.spare_memtable_bytes
    };
    let mut put = |s: &mut Store| {
        s.put(&key(1, u), &[7u8; 64]);
        u = u.wrapping_add(1);
    };
    // No maintenance runs: the first memtable freezes at half the budget, the second one
    // fills the rest and stalls the writer instead of freezing.
    while !s.write_stalled() {
        put(&mut s);
        assert!(s.frozen_memtables() <= 1, "a second memtable froze");
    }
    assert_eq!(s.frozen_memtables(), 1);
    let at_stall = memory(&s);
    assert!(at_stall >= budget, "stalled at {at_stall} of {budget}");
    // A writer that ignores the stall grows the mutable memtable past its half; nothing
    // more freezes.
    while s.metrics().memtable_bytes < budget / 2 {
        put(&mut s);
        assert_eq!(s.frozen_memtables(), 1);
    }
    assert!(
        memory(&s) <= budget + budget / 4,
        "{} of {budget}",
        memory(&s)
    );
    // The flush ends the stall and freezes the deferred memtable; the next one is the
    // flushed memtable, recycled within the budget.
    let flushes = s.metrics().flushes;
    let job = s.flush_job().unwrap();
    s.install(job.run()).unwrap();
    assert_eq!(s.metrics().flushes, flushes + 1);
    assert_eq!(s.frozen_memtables(), 1, "the deferred freeze happened");
    assert!(!s.write_stalled(), "the flush ends the stall");
    s.run_pending_maintenance().unwrap();
    assert_eq!(s.frozen_memtables(), 0);
    assert!(memory(&s) <= budget, "{} of {budget}", memory(&s));
    for v in (0..u).step_by(97) {
        assert_eq!(s.get(&key(1, v)).unwrap().unwrap().value, &[7u8; 64]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Keys of every length with long shared starts, zero bytes and 0xff (prefix ties, keys
    /// that are prefixes of others, zero padding) spread over memtable and several segments:
    /// scans and compaction merge them in byte order, the newest version winning.
    #[test]
    fn merges_order_keys_that_tie_on_their_first_16_bytes(
        batches in proptest::collection::vec(
            proptest::collection::vec(
                (proptest::collection::vec(proptest::sample::select(vec![0u8, 1, 0xff]), 0..22),
                 proptest::option::of(any::<u8>())),
                1..40),
            1..6),
    ) {
        let root = tempfile::tempdir().unwrap();
        let fs: Arc<dyn Fs> = Arc::new(StdFs);
        let mut store = Store::open(fs, root.path(), small_config(8)).unwrap();
        let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        // Key group 0 and a run of 14 equal bytes: every key's first 16 bytes tie often.
        let full = |tail: &[u8]| [&[0u8, 0][..], &[1u8; 14][..], tail].concat();
        for (b, batch) in batches.iter().enumerate() {
            for (tail, v) in batch {
                let k = full(tail);
                match v {
                    Some(v) => {
                        store.put(&k, &[*v, b as u8]);
                        model.insert(k, vec![*v, b as u8]);
                    }
                    None => {
                        store.delete(&k);
                        model.remove(&k);
                    }
                }
            }
            if b + 1 < batches.len() {
                store.freeze();
                store.run_pending_maintenance().unwrap();
            }
        }
        let want: Vec<(Vec<u8>, Vec<u8>)> = model.into_iter().collect();
        prop_assert_eq!(&all(&mut store), &want);
        store.flush_and_compact_all().unwrap();
        prop_assert_eq!(&all(&mut store), &want);
    }
}

/// A merge of many sources (the memtable, a frozen one and 20 segments: more than a tier, and
/// not a power of two, so the merge's tournament has leaves at two depths): every key once,
/// its newest version, in byte order, also in bounded scans whose bounds fall between and on
/// keys; the same after a full compaction. Keys tie on their 16-byte prefixes often, and a
/// key's versions sit in many sources, deleted in some.
#[test]
fn a_merge_of_many_sources_yields_each_keys_newest_version_in_order() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        max_segments: 64,
        compaction_min_merge: 64,
        ..small_config(8)
    };
    let mut store = Store::open(fs, root.path(), config).unwrap();
    let mut model = Model::new();
    let shared = [&[0u8, 3][..], &[5u8; 14][..]].concat();
    let key_of = |x: u64| -> Vec<u8> {
        let n = (x % 40) as u8;
        match x % 3 {
            // Keys longer than 16 bytes that share their first 16.
            0 => [&shared[..], &[n, n / 3][..(1 + n as usize % 2)]].concat(),
            // Short keys, some ending in zero bytes (zero-padded prefixes tie).
            1 => [&[0u8, 3, n / 4][..], &[0u8; 2][..(n as usize % 3)]].concat(),
            _ => key(3, u16::from(n)),
        }
    };
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let sources = 21u32;
    for s in 0..=sources {
        for i in 0..30u32 {
            let r = rand();
            let k = key_of(r >> 8);
            if r % 7 == 0 {
                store.delete(&k);
                model.remove(&k);
            } else {
                let v = [s.to_le_bytes(), i.to_le_bytes()].concat();
                store.put(&k, &v);
                model.insert(k, v);
            }
        }
        // The last round stays in the memtable; the one before it stays frozen.
        if s < sources {
            store.freeze();
            if s + 1 < sources {
                store.run_pending_maintenance().unwrap();
            }
        }
    }
    assert_eq!(store.metrics().segments, sources as usize - 1);
    assert_eq!(store.frozen_memtables(), 1);
    let check = |store: &mut Store, model: &Model| {
        let want: Vec<(Vec<u8>, Vec<u8>)> =
            model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_eq!(all(store), want);
        let mut bounds: Vec<Vec<u8>> = model.keys().step_by(5).cloned().collect();
        bounds.push(vec![0, 3, 5]);
        bounds.push([&shared[..], &[7u8][..]].concat());
        for start in &bounds {
            for end in &bounds {
                let got: Vec<Vec<u8>> = store
                    .scan_range(start, Some(end))
                    .map(|e| e.unwrap().0.to_vec())
                    .collect();
                let want: Vec<Vec<u8>> = if start < end {
                    model
                        .range(start.clone()..end.clone())
                        .map(|(k, _)| k.clone())
                        .collect()
                } else {
                    Vec::new()
                };
                assert_eq!(got, want, "scan from {start:?} to {end:?}");
            }
        }
    };
    check(&mut store, &model);
    store.flush_and_compact_all().unwrap();
    assert_eq!(store.metrics().segments, 1);
    check(&mut store, &model);
}

/// A snapshot's job reads its sealed epoch on another thread while the store goes on
/// updating the same keys: in place, with longer values (records move), deleted, and new
/// keys. Each restore equals the store at its snapshot, and the store keeps every update.
#[test]
fn a_snapshot_job_on_another_thread_sees_the_state_at_its_snapshot() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 8 << 20,
        ..small_config(8)
    };
    let mut s = Store::open(fs.clone(), &root.path().join("live"), config).unwrap();
    let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let value =
        |round: u8, u: u16| vec![round ^ u as u8; 1 + (usize::from(u) + usize::from(round)) % 24];
    for u in 0..6000u16 {
        let (k, v) = (key(u % 8, u), value(0, u));
        s.put(&k, &v);
        model.insert(k, v);
    }
    for round in 1..=4u8 {
        let job = s.snapshot(u64::from(round));
        let want = model.clone();
        // The job starts only once half of the changes below are made (so that it reads
        // its epoch after they were), and races the other half.
        let (go, start) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn(move || {
            start.recv().unwrap();
            job.run().unwrap()
        });
        // Every key changes, a tenth are deleted, new keys arrive.
        let n = 6000u16 + 500 * u16::from(round);
        for u in 0..n {
            if u == n / 2 {
                go.send(()).unwrap();
            }
            let k = key(u % 8, u);
            if u % 10 == usize::from(round) as u16 {
                s.delete(&k);
                model.remove(&k);
            } else {
                let v = value(round, u);
                s.put(&k, &v);
                model.insert(k, v);
            }
        }
        let h = writer.join().unwrap();
        assert_eq!(
            restored(&fs, &root.path().join(format!("restored{round}")), h),
            want.into_iter().collect::<Vec<_>>(),
            "round {round}"
        );
        assert_eq!(
            all(&mut s),
            model.clone().into_iter().collect::<Vec<_>>(),
            "live store after round {round}"
        );
    }
    // Snapshots sealed the memtable instead of freezing it.
    assert_eq!(s.metrics().frozen_memtables, 0);
}

/// A snapshot job that starts late, after the store froze the memtable it sealed and more
/// behind it, with values that grow (records move) and maintenance attempted meanwhile
/// (flushes wait for the job: they install in order). The restore equals the store at the
/// snapshot; afterwards the frozen memtables flush, and their memory is recycled for the next
/// rounds while earlier epochs' segments are still referenced by retained snapshots.
#[test]
fn a_late_snapshot_job_reads_its_epoch_after_the_memtable_is_frozen() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 48 << 10,
        ..small_config(8)
    };
    let mut s = Store::open(fs.clone(), &root.path().join("live"), config).unwrap();
    let mut model: Model = BTreeMap::new();
    let value =
        |seed: u8, u: u16| vec![seed ^ u as u8; 8 + usize::from(seed % 24) + usize::from(u % 8)];
    for round in 0..6u8 {
        for u in 0..400u16 {
            let (k, v) = (key(u % 8, u), value(round.wrapping_mul(16), u));
            s.put(&k, &v);
            model.insert(k, v);
        }
        let job = s.snapshot(u64::from(round) + 1);
        let want = model.clone();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn(move || {
            let _ = wait.recv();
            job.run().unwrap()
        });
        for pass in 1..6u8 {
            for u in 0..400u16 {
                let (k, v) = (key(u % 8, u), value(round.wrapping_mul(16) + pass, u));
                s.put(&k, &v);
                model.insert(k, v);
            }
            s.freeze();
            s.run_pending_maintenance().unwrap();
        }
        go.send(()).unwrap();
        let h = writer.join().unwrap();
        s.run_pending_maintenance().unwrap();
        assert_eq!(
            restored(&fs, &root.path().join(format!("restored{round}")), h),
            want.into_iter().collect::<Vec<_>>(),
            "round {round}"
        );
    }
    assert!(
        s.metrics().flushes >= 6 * 5,
        "every frozen memtable flushed"
    );
    assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());
}

/// A snapshot after flushes and compactions lists the previous snapshot's segments and adds
/// only the epochs written since: its new bytes follow the change, not the state, however
/// the store rewrote its own segments meanwhile. A chain at its length limit gives way to a
/// full listing of the store's segments. Every snapshot restores to the model.
#[test]
fn delta_snapshots_list_the_previous_snapshot_and_the_epochs_since() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 64 << 10,
        snapshot_chain_segments_max: 6,
        ..small_config(8)
    };
    let mut s = Store::open(fs.clone(), &root.path().join("s"), config).unwrap();
    let mut model = Model::new();
    let put = |s: &mut Store, model: &mut Model, u: u16, v: u8| {
        let (k, val) = (key(u % 8, u), vec![v; 40]);
        s.put(&k, &val);
        model.insert(k, val);
    };
    for u in 0..2000 {
        put(&mut s, &mut model, u, 1);
    }
    s.flush_and_compact_all().unwrap();
    let h1 = snapshot(&mut s, 1);
    let base: u64 = h1.segments.iter().map(|r| r.size_bytes).sum();
    assert!(h1.segments.iter().all(|r| r.is_new));
    let mut prev = h1;
    for round in 2..=7u64 {
        // A few changes, then the store rewrites everything it has (freeze, flush, compact).
        for u in 0..20 {
            put(&mut s, &mut model, u * 97 % 2000, round as u8);
        }
        s.flush_and_compact_all().unwrap();
        let h = snapshot(&mut s, round);
        let ids = |h: &SnapshotHandle| h.segments.iter().map(|r| r.segment_id).collect::<Vec<_>>();
        let new: Vec<_> = h.segments.iter().filter(|r| r.is_new).collect();
        let new_bytes: u64 = new.iter().map(|r| r.size_bytes).sum();
        let dir = root.path().join(format!("r{round}"));
        if prev.segments.len() < 6 {
            // A delta: the previous list, then the epoch that holds the 20 changed keys.
            assert_eq!(
                ids(&h)[..prev.segments.len()],
                ids(&prev)[..],
                "round {round}"
            );
            assert!(!new.is_empty() && new.iter().all(|r| r.entry_count <= 20));
            assert!(
                new_bytes * 20 < base,
                "round {round}: {new_bytes} of {base}"
            );
            // The chain the next snapshot extends is this one (none once it is full).
            let m = s.metrics();
            if h.segments.len() < 6 {
                assert_eq!(m.snapshot_chain_segments, h.segments.len());
                assert_eq!(m.snapshot_chain_base_bytes, base);
                let deltas: u64 = h.segments[1..].iter().map(|r| r.size_bytes).sum();
                assert_eq!(m.snapshot_chain_delta_bytes, deltas);
            } else {
                assert_eq!(m.snapshot_chain_segments, 0);
            }
        } else {
            // The chain was full: the store's own (compacted) segment.
            assert_eq!(h.segments.len(), 1, "round {round}");
            assert_eq!(h.segments[0].entry_count, 2000);
        }
        let want: Vec<_> = model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_eq!(restored(&fs, &dir, h.clone()), want, "round {round}");
        prev = h;
    }
}

/// A flush may run and install while a compaction is in flight: the compaction then installs
/// its output where its inputs are, below the newer flush, and every read sees the newest
/// version.
#[test]
fn a_flush_installs_while_a_compaction_is_in_flight() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 16 << 20,
        ..small_config(8)
    };
    let mut s = Store::open(fs, root.path(), config).unwrap();
    let mut model = Model::new();
    for round in 0..4u8 {
        for u in 0..500u16 {
            let k = key(u % 8, u);
            s.put(&k, &[round; 8]);
            model.insert(k, vec![round; 8]);
        }
        flush(&mut s);
    }
    let compaction = s.full_compaction_job().expect("four segments");
    // Newer writes, a deletion among them, flushed and installed first.
    for u in 0..100u16 {
        let k = key(u % 8, u);
        s.put(&k, b"newest");
        model.insert(k, b"newest".to_vec());
    }
    s.delete(&key(3, 403));
    model.remove(&key(3, 403));
    s.freeze();
    let f = s.flush_job().expect("the frozen memtable");
    assert!(s.compaction_job().is_none(), "one compaction at a time");
    s.install(f.run()).unwrap();
    assert_eq!(s.metrics().segments, 5);
    s.install(compaction.run()).unwrap();
    assert_eq!(
        s.metrics().segments,
        2,
        "the four merged, the flush above them"
    );
    assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());
}

/// While a compaction runs, flushes (which a maintenance thread runs ahead of it) stop once
/// `max_segments` segments are outside its inputs, so that segments cannot pile up faster than
/// compactions merge them; however many segments the compaction merges (a restored store
/// starts with dozens), flushes go on until then. The frozen memtable is flushed once the
/// compaction is installed.
#[test]
fn flushes_wait_for_a_running_compaction_once_max_segments_are_outside_it() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 16 << 20,
        max_segments: 2,
        compaction_min_merge: 100,
        ..small_config(8)
    };
    let mut s = Store::open(fs, root.path(), config).unwrap();
    let mut round = 0u8;
    let mut fill = |s: &mut Store| {
        round += 1;
        for u in 0..200u16 {
            s.put(&key(u % 8, u), &[round; 8]);
        }
        s.freeze();
    };
    for _ in 0..3 {
        fill(&mut s);
        flush(&mut s);
    }
    let compaction = s.full_compaction_job().expect("three segments");
    // More segments than `max_segments` in all, fewer outside the compaction: flushes run.
    for n in 4..=5 {
        fill(&mut s);
        assert!(s.needs_maintenance());
        let f = s
            .flush_job()
            .expect("fewer than two outside the compaction");
        s.install(f.run()).unwrap();
        assert_eq!(s.metrics().segments, n);
    }
    // Two outside: the next flush waits.
    fill(&mut s);
    assert!(!s.needs_maintenance());
    assert!(s.flush_job().is_none(), "a flush past the cap");
    s.install(compaction.run()).unwrap();
    assert_eq!(
        s.metrics().segments,
        3,
        "the three merged, two flushes above them"
    );
    assert!(s.needs_maintenance());
    let f = s.flush_job().expect("the compaction is installed");
    s.install(f.run()).unwrap();
    assert_eq!(s.metrics().segments, 4);
    assert_eq!(s.get(&key(6, 198)).unwrap().unwrap().value, &[6u8; 8][..]);
}

/// Flushes (and compactions, through the same writer loop) of large values yield by bytes,
/// not only by entry count: 10 000 entries of 1 KiB (far fewer than the entry period) still
/// give the hook a turn every 4 MiB.
#[test]
fn large_values_yield_every_few_megabytes() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 256 << 20,
        ..small_config(8)
    };
    let mut s = Store::open(fs, root.path(), config).unwrap();
    let value = [7u8; 1024];
    for i in 0..10_000u16 {
        s.put(&key(i % 8, i), &value);
    }
    s.freeze();
    let job = s.flush_job().expect("a frozen memtable");
    let mut yields = 0;
    let done = job.run_yielding(&mut || {
        yields += 1;
        ControlFlow::Continue(())
    });
    s.install(done).unwrap();
    // 10 000 x (1 KiB + key) = ~10 MB: two 4 MiB periods.
    assert_eq!(yields, 2);
    assert_eq!(s.get(&key(3, 9_995)).unwrap().unwrap().value, &value[..]);
}

/// A flush or compaction whose yield hook breaks (its store is gone) stops there: it ends with
/// `Cancelled` and leaves no file, and a store that installs it anyway is unchanged and hands
/// the same work out again.
#[test]
fn a_job_whose_yield_hook_breaks_stops_and_leaves_no_file() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 256 << 20,
        ..small_config(8)
    };
    let mut s = Store::open(fs, root.path(), config).unwrap();
    let files = || {
        std::fs::read_dir(root.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "wseg")
            })
            .count()
    };
    let mut model = Model::new();
    // 70 000 keys a memtable: past the first yield (every 65 536 entries).
    let mut fill = |s: &mut Store, round: u8| {
        for i in 0..70_000u32 {
            let k = key((i % 8) as u16, i as u16)
                .into_iter()
                .chain(i.to_be_bytes())
                .collect::<Vec<_>>();
            s.put(&k, &[round; 8]);
            model.insert(k, vec![round; 8]);
        }
        s.freeze();
    };
    fill(&mut s, 1);
    let job = s.flush_job().expect("a frozen memtable");
    let done = job.run_yielding(&mut || ControlFlow::Break(()));
    assert!(matches!(s.install(done), Err(StateError::Cancelled)));
    assert_eq!((files(), s.metrics().segments), (0, 0));
    flush(&mut s);
    fill(&mut s, 2);
    flush(&mut s);
    assert_eq!((files(), s.metrics().segments), (2, 2));
    let job = s.full_compaction_job().expect("two segments");
    let done = job.run_yielding(&mut || ControlFlow::Break(()));
    assert!(matches!(s.install(done), Err(StateError::Cancelled)));
    assert_eq!((files(), s.metrics().segments), (2, 2));
    let job = s.full_compaction_job().expect("the same compaction again");
    s.install(job.run()).unwrap();
    assert_eq!(s.metrics().segments, 1);
    assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());
}

/// The runtime's maintenance thread runs a waiting snapshot job inside a flush's or
/// compaction's yield hook, so that a checkpoint need not wait for a long compaction: both
/// jobs finish, the snapshot restores to the state at the snapshot, the store keeps the rest.
#[test]
fn a_snapshot_job_runs_inside_a_compactions_yield_hook() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = StoreConfig {
        memtable_budget_bytes: 64 << 20,
        ..small_config(8)
    };
    let mut s = Store::open(fs.clone(), &root.path().join("s"), config).unwrap();
    let mut model = Model::new();
    // Three segments of 30 000 keys: more entries than one yield period.
    for round in 0..3u8 {
        for i in 0..30_000u32 {
            let k = key((i % 8) as u16, (i / 8 + u32::from(round) * 4000) as u16);
            s.put(&k, &[round; 8]);
            model.insert(k, vec![round; 8]);
        }
        s.freeze();
        while let Some(j) = s.flush_job() {
            let done = j.run();
            s.install(done).unwrap();
        }
    }
    let at_snapshot: Vec<_> = model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut snap = Some(s.snapshot(1));
    s.put(&key(0, 1), b"after");
    let compaction = s.full_compaction_job().expect("three segments to merge");
    let (mut yields, mut handle) = (0, None);
    let done = compaction.run_yielding(&mut || {
        yields += 1;
        if let Some(j) = snap.take() {
            handle = Some(j.run().unwrap());
        }
        ControlFlow::Continue(())
    });
    assert!(yields >= 1, "the compaction never yielded");
    s.install(done).unwrap();
    assert_eq!(s.metrics().segments, 1);
    let h = handle.expect("the snapshot ran in the hook");
    assert_eq!(restored(&fs, &root.path().join("r"), h), at_snapshot);
    model.insert(key(0, 1), b"after".to_vec());
    let want: Vec<_> = model.into_iter().collect();
    assert_eq!(all(&mut s), want);
}

/// The copy tests' store: 32 MiB of memtable budget (a 16 MiB share), 8 key groups.
fn copies_config() -> StoreConfig {
    StoreConfig {
        memtable_budget_bytes: 32 << 20,
        // What copies do to the memtable, without the freezes that bound the epochs'
        // segments, which
        // `a_memtable_that_never_fills_keeps_its_epochs_segments_within_their_bound` tests.
        snapshot_epochs_max_shares: usize::MAX,
        ..small_config(8)
    }
}

/// Key `i` of the copy tests, spread over 8 key groups.
fn spread_key(i: u32) -> Vec<u8> {
    key((i % 8) as u16, (i / 8) as u16)
}

/// The value of key `i` written in `round`.
fn round_value(round: u32, i: u32) -> Vec<u8> {
    [round.to_le_bytes(), i.to_le_bytes()].concat()
}

/// Whether key `i` is updated in `round`: half of the keys, at random (splitmix64's
/// finaliser, every bit depending on both).
fn updated_in(round: u32, i: u32) -> bool {
    let mut z = u64::from(i) << 32 | u64::from(round);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) >> 63 == 0
}

/// The copy tests' run: a store of `n` keys, then 40 rounds of a snapshot (its job done at
/// once) and updates to half of the keys ([`updated_in`]); every `check_every` rounds, the
/// round's snapshot restores to the state at its seal. Returns the store, its model, the
/// most memtable bytes seen after a put, and the directory holding the store.
fn snapshot_rounds(n: u32, check_every: u32) -> (Store, Model, usize, tempfile::TempDir) {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mut s = Store::open(fs.clone(), &root.path().join("live"), copies_config()).unwrap();
    let mut model = Model::new();
    for i in 0..n {
        s.put(&spread_key(i), &round_value(0, i));
        model.insert(spread_key(i), round_value(0, i));
    }
    let mut most = 0;
    for round in 1..=40u32 {
        let h = snapshot(&mut s, u64::from(round));
        let at_snapshot = model.clone();
        for i in (0..n).filter(|&i| updated_in(round, i)) {
            s.put(&spread_key(i), &round_value(round, i));
            model.insert(spread_key(i), round_value(round, i));
            most = most.max(s.metrics().memtable_bytes);
        }
        if round % check_every == 0 {
            assert_eq!(
                restored(&fs, &root.path().join(format!("restored{round}")), h),
                at_snapshot.into_iter().collect::<Vec<_>>(),
                "round {round}"
            );
        }
    }
    (s, model, most, root)
}

/// A store snapshotted after every round of updates to half of its keys at random, as a job
/// that checkpoints often, does not freeze: updates after a seal stay in place (each job is
/// done before them here, so no chunk is even copied). (When each sealed record was copied
/// at its first update, the copies filled the memtable, and the few live records of older
/// chunks were copied to make room.) Every snapshot restores to the state at its seal.
#[test]
fn frequent_snapshots_reuse_the_memory_of_replaced_records_instead_of_freezing() {
    let (mut s, model, _, _dir) = snapshot_rounds(40_000, 10);
    let m = s.metrics();
    assert_eq!((m.flushes, m.frozen_memtables), (0, 0), "{m:?}");
    assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());
}

/// Bytes of the files in `dir`.
fn disk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// A memtable that never fills (a fixed key set, snapshotted after every round of updates)
/// keeps the segments of its snapshots' epochs only up to `snapshot_epochs_max_shares` of
/// its share: then a snapshot freezes it first, and its flushed segment replaces them. Disk
/// and the full listings stay bounded, and every snapshot restores to its seal. Without the
/// bound the epochs pile up, one segment a snapshot.
#[test]
fn a_memtable_that_never_fills_keeps_its_epochs_segments_within_their_bound() {
    let run = |shares: usize, rounds: u32| {
        let root = tempfile::tempdir().unwrap();
        let fs: Arc<dyn Fs> = Arc::new(StdFs);
        let dir = root.path().join("live");
        let config = StoreConfig {
            memtable_budget_bytes: 32 << 20,
            snapshot_epochs_max_shares: shares,
            ..small_config(8)
        };
        let mut s = Store::open(fs.clone(), &dir, config).unwrap();
        let n = 20_000u32;
        let mut model = Model::new();
        for i in 0..n {
            s.put(&spread_key(i), &round_value(0, i));
            model.insert(spread_key(i), round_value(0, i));
        }
        let (mut most_disk, mut most_listed) = (0, 0);
        for round in 1..=rounds {
            let spare_before = s.metrics().spare_memtable_bytes;
            let h = snapshot(&mut s, u64::from(round));
            if s.metrics().frozen_memtables > 0 {
                // The snapshot froze: its successor was ready before (made when the store
                // took in the epoch that passed the bound), not made in its synchronous part.
                assert!(spare_before > 0, "round {round}");
            }
            // As a job retaining one checkpoint: the one before goes.
            if round > 1 {
                s.release_snapshot(u64::from(round - 1));
            }
            // A flush the snapshot's freeze left, as the maintenance thread runs it.
            while let Some(job) = s.flush_job() {
                let done = job.run();
                s.install(done).unwrap();
            }
            most_disk = most_disk.max(disk_bytes(&dir));
            most_listed = most_listed.max(h.segments.len());
            if round % 25 == 0 {
                let want = model.clone().into_iter().collect::<Vec<_>>();
                let at = root.path().join(format!("restored{round}"));
                assert_eq!(restored(&fs, &at, h), want, "round {round}");
            }
            for i in (0..n).filter(|&i| updated_in(round, i)) {
                s.put(&spread_key(i), &round_value(round, i));
                model.insert(spread_key(i), round_value(round, i));
            }
        }
        assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());
        (s.metrics(), most_disk, most_listed)
    };
    // One share (15 MiB) of epochs of about half a megabyte each.
    let (m, most_disk, most_listed) = run(1, 100);
    assert!(m.flushes >= 2, "{m:?}");
    assert!(m.sealed_segments <= 40, "{m:?}");
    // The bound, the flushed memtable's segment and the epochs a retained snapshot holds.
    assert!(most_disk < 40 << 20, "{most_disk} bytes on disk at most");
    assert!(most_listed <= 130, "{most_listed} segments listed at most");
    // Unbounded (as before): every epoch's segment stays.
    let (m, most_disk, _) = run(usize::MAX, 100);
    assert_eq!((m.flushes, m.sealed_segments), (0, 100), "{m:?}");
    assert!(most_disk > 40 << 20, "{most_disk} bytes on disk at most");
}

/// The segment a snapshot job writes for an epoch is kept as a file (later snapshots list
/// it), never as an open segment: nothing reads an epoch's segment (its memtable holds every
/// key of it, newer), and its map, block index and filter were memory that no figure counted.
/// Not mapped once the job is done, nor once the store took the segment in.
#[cfg(target_os = "linux")]
#[test]
fn an_epochs_segment_is_kept_as_a_file_not_as_an_open_segment() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mut s = Store::open(fs.clone(), &root.path().join("live"), copies_config()).unwrap();
    for i in 0..20_000 {
        s.put(&spread_key(i), &round_value(0, i));
    }
    let first = snapshot(&mut s, 1);
    let mapped = |path: &Path| {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.contains(path.to_str().unwrap())
    };
    let written = &first.segments.last().unwrap().path;
    assert!(written.exists());
    assert!(!mapped(written), "{written:?} was mapped by the job");
    for i in (0..20_000).filter(|&i| updated_in(1, i)) {
        s.put(&spread_key(i), &round_value(1, i));
    }
    // Takes in the first epoch's segment, and lists it.
    let second = snapshot(&mut s, 2);
    let epoch = &first.segments.last().unwrap().path;
    assert!(second.segments.iter().any(|r| &r.path == epoch));
    assert!(epoch.exists());
    assert!(!mapped(epoch), "{epoch:?} is still mapped");
    assert_eq!(s.metrics().sealed_segments, 1);
    // Both still restore.
    let at = |dir: &str| root.path().join(dir);
    assert_eq!(restored(&fs, &at("r1"), first).len(), 20_000);
    assert_eq!(restored(&fs, &at("r2"), second).len(), 20_000);
}

/// A memtable that passes its share while a snapshot job still reads the chunks it copied
/// waits for that job instead of freezing (the job runs on another thread in a real
/// store, and its chunks are reused once it is done), but only up to a quarter past its
/// share: with jobs that never finish it freezes. Each snapshot restores to its seal.
#[test]
fn a_memtable_past_its_share_waits_for_the_snapshot_job_reading_what_it_replaced() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let config = copies_config();
    let n = 62_000u32;
    let (k, v) = (spread_key, round_value);
    let fill = |dir: &str| {
        let mut s = Store::open(fs.clone(), &root.path().join(dir), config.clone()).unwrap();
        let mut model = Model::new();
        for i in 0..n {
            s.put(&k(i), &v(0, i));
            model.insert(k(i), v(0, i));
        }
        (s, model)
    };
    let update_all = |s: &mut Store, model: &mut Model, round: u32| {
        for i in 0..n {
            s.put(&k(i), &v(round, i));
            model.insert(k(i), v(round, i));
        }
    };

    // Each round's job runs only after the next round's copies: as a shard's updates overlap
    // the snapshot job of the checkpoint before.
    let (mut s, mut model) = fill("waits");
    let mut pending: Option<(SnapshotJob, Model)> = None;
    let mut most = 0;
    for round in 1..=6u32 {
        let job = s.snapshot(u64::from(round));
        let at_seal = model.clone();
        update_all(&mut s, &mut model, round);
        most = most.max(s.metrics().memtable_bytes);
        if let Some((job, want)) = pending.replace((job, at_seal)) {
            let h = job.run().unwrap();
            let dir = root.path().join(format!("restored{round}"));
            assert_eq!(restored(&fs, &dir, h), want.into_iter().collect::<Vec<_>>());
        }
    }
    let m = s.metrics();
    assert_eq!((m.flushes, m.frozen_memtables), (0, 0), "{m:?}");
    // It did pass its share (15 MiB: half the budget less a write-behind buffer) meanwhile,
    // with the chunks it copied while the previous job held them.
    assert!(most > 16 << 20, "{most} bytes at most");
    drop(pending);
    assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());

    // Jobs that never run: the memtable freezes a quarter past its share (19 MiB).
    let (mut s, mut model) = fill("freezes");
    let mut jobs = Vec::new();
    for round in 1..=6u32 {
        jobs.push(s.snapshot(u64::from(round)));
        update_all(&mut s, &mut model, round);
        let m = s.metrics();
        assert!(m.memtable_bytes <= 20 << 20, "round {round}: {m:?}");
    }
    let m = s.metrics();
    assert!(m.flushes + m.frozen_memtables as u64 > 0, "{m:?}");
    drop(jobs);
    s.run_pending_maintenance().unwrap();
    assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());
}

/// A memtable that its keys fill to its share, snapshotted after every round of updates to
/// half of its keys (each snapshot's job done at once, so no job holds its chunks), goes
/// past its share with what its tables grow by and cannot make room by moving the few live
/// records of sparse chunks (it has none). It goes on up to a quarter past its share instead
/// of freezing, since it has no more keys than when it got there: without this rule, when
/// sealed records were still copied one by one, it froze
/// five times in 40 rounds, each time flushing all 99,000 keys for a successor that read
/// them back. New keys make it freeze, within the same bound.
#[test]
fn a_memtable_past_its_share_by_copies_alone_does_not_freeze() {
    let n = 99_000u32;
    let (mut s, mut model, most, _dir) = snapshot_rounds(n, 20);
    let m = s.metrics();
    assert_eq!((m.flushes, m.frozen_memtables), (0, 0), "{m:?}");
    // It did pass its share (16 MiB), and stayed within a quarter past it (20 MiB).
    assert!(most > 16 << 20 && most <= 20 << 20, "{most} bytes at most");
    assert_eq!(all(&mut s), model.clone().into_iter().collect::<Vec<_>>());

    // New keys: it freezes, a quarter past its share at the latest.
    for i in n..n + 100_000 {
        s.put(&spread_key(i), &round_value(41, i));
        model.insert(spread_key(i), round_value(41, i));
        let m = s.metrics();
        assert!(m.memtable_bytes <= 20 << 20, "key {i}: {m:?}");
    }
    let m = s.metrics();
    assert!(m.flushes + m.frozen_memtables as u64 > 0, "{m:?}");
    s.run_pending_maintenance().unwrap();
    assert_eq!(all(&mut s), model.into_iter().collect::<Vec<_>>());
}

/// The arena chunks that writes after a seal copy while the snapshot job holds the originals
/// count in the memtable's bytes, frozen or not, until the job lets go.
#[test]
fn chunks_copied_for_a_snapshot_job_count_until_it_lets_go() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    // Arena chunks of a sixteenth of the memtable's share (about 1 MiB): 20,000 records of 48
    // bytes fit one, and the copy is at least their bytes.
    let mut s = Store::open(fs.clone(), &root.path().join("s"), copies_config()).unwrap();
    let n = 20_000u32;
    let records = 960_000;
    for i in 0..n {
        s.put(&spread_key(i), &round_value(0, i));
    }
    let base = s.metrics().memtable_bytes;
    let job = s.snapshot(1);
    for i in 0..n {
        s.put(&spread_key(i), &round_value(1, i));
    }
    let copied = s.metrics().memtable_bytes - base;
    assert!(copied >= records, "{copied} bytes more after the copy");
    s.freeze();
    let m = s.metrics();
    assert_eq!(m.memtable_entries, 0);
    let h = job.run().unwrap();
    drop(h);
    // The store lets go of the sealed epoch (with its view of the original) when it takes in
    // the next snapshot: frozen, the memtable counted the copy until then.
    let job2 = s.snapshot(2);
    let after = s.metrics();
    assert_eq!(after.frozen_memtables, 1, "its flush still waits");
    assert!(
        after.frozen_bytes + records <= m.frozen_bytes,
        "{after:?} after {m:?}"
    );
    let h2 = job2.run().unwrap();
    s.run_pending_maintenance().unwrap();
    assert_eq!(
        restored(&fs, &root.path().join("r"), h2),
        (0..n)
            .map(|i| (spread_key(i), round_value(1, i)))
            .collect::<Model>()
            .into_iter()
            .collect::<Vec<_>>()
    );
}
